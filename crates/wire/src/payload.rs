//! Payloads: a local value or bytes (Raid's lazy data conversion).
//!
//! A payload that stays inside one process moves as the value itself and is
//! never serialized; it is encoded (postcard) only when a frame must cross a
//! process boundary. Owns that conversion. Must never encode eagerly.

use std::any::Any;
use std::fmt;

use bytes::{BufMut, Bytes, BytesMut};
use serde::de::DeserializeOwned;
use serde::Serialize;

/// Failure to turn a value into bytes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("cannot encode {type_name}: {reason}")]
pub struct EncodeError {
    /// The Rust type that failed to encode.
    pub type_name: &'static str,
    /// The serializer's complaint.
    pub reason: String,
}

/// Failure to get a typed value out of a payload.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PayloadError {
    /// A local value of another type was passed.
    #[error("type mismatch: expected {expected}, got {actual}")]
    TypeMismatch {
        /// The type the receiver asked for.
        expected: &'static str,
        /// The type the sender passed.
        actual: &'static str,
    },
    /// The bytes are not a valid postcard encoding of the expected type.
    #[error("cannot decode {expected}: {reason}")]
    Decode {
        /// The type the receiver asked for.
        expected: &'static str,
        /// The deserializer's complaint.
        reason: String,
    },
    /// The local value could not be encoded when bytes were needed.
    #[error(transparent)]
    Encode(#[from] EncodeError),
}

/// A value that can travel inside a payload without being serialized, and be
/// serialized on demand. Implemented for every `Serialize + Send + 'static`
/// type.
pub trait LocalValue: Send + 'static {
    /// Appends the postcard encoding of the value to `out`.
    fn encode_into(&self, out: &mut BytesMut) -> Result<(), EncodeError>;
    /// Converts the boxed value into `Any` for a typed downcast.
    fn into_any(self: Box<Self>) -> Box<dyn Any + Send>;
    /// The value's Rust type name, for error messages.
    fn type_name(&self) -> &'static str;
}

/// postcard output flavor that appends straight into a `BytesMut`.
struct BytesMutFlavor<'a>(&'a mut BytesMut);

impl postcard::ser_flavors::Flavor for BytesMutFlavor<'_> {
    type Output = ();
    fn try_push(&mut self, data: u8) -> postcard::Result<()> {
        self.0.put_u8(data);
        Ok(())
    }
    fn try_extend(&mut self, data: &[u8]) -> postcard::Result<()> {
        self.0.extend_from_slice(data);
        Ok(())
    }
    fn finalize(self) -> postcard::Result<()> {
        Ok(())
    }
}

/// Appends the postcard encoding of `value` to `out`.
///
/// Fails with [`EncodeError`] when the value's `Serialize` impl fails (postcard
/// rejects, for example, sequences of unknown length).
pub fn encode_postcard<T: Serialize + ?Sized>(
    value: &T,
    out: &mut BytesMut,
) -> Result<(), EncodeError> {
    postcard::serialize_with_flavor(value, BytesMutFlavor(out)).map_err(|e| EncodeError {
        type_name: std::any::type_name::<T>(),
        reason: e.to_string(),
    })
}

/// postcard output flavor that writes nothing and compares every byte with
/// the bytes a value was decoded from.
struct CompareFlavor<'a> {
    expect: &'a [u8],
    pos: usize,
    same: bool,
}

impl postcard::ser_flavors::Flavor for CompareFlavor<'_> {
    type Output = bool;
    fn try_push(&mut self, data: u8) -> postcard::Result<()> {
        self.same &= self.expect.get(self.pos) == Some(&data);
        self.pos += 1;
        Ok(())
    }
    fn try_extend(&mut self, data: &[u8]) -> postcard::Result<()> {
        let end = self.pos + data.len();
        self.same &= self.expect.get(self.pos..end) == Some(data);
        self.pos = end;
        Ok(())
    }
    fn finalize(self) -> postcard::Result<bool> {
        Ok(self.same && self.pos == self.expect.len())
    }
}

/// True when `bytes` are exactly postcard's encoding of `value`: the one
/// canonical form, in which every varint is minimal. postcard's decoder also
/// accepts overlong varints (`0x80 0x00` for 0); comparing the re-encoding
/// with what was read is how the wire codec refuses them. Writes and
/// allocates nothing.
pub(crate) fn is_canonical<T: Serialize + ?Sized>(value: &T, bytes: &[u8]) -> bool {
    postcard::serialize_with_flavor(
        value,
        CompareFlavor {
            expect: bytes,
            pos: 0,
            same: true,
        },
    )
    .unwrap_or(false)
}

/// Decodes a whole postcard value from `bytes`; trailing bytes are an error.
///
/// Fails with [`PayloadError::Decode`] on malformed input.
pub fn decode_postcard<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, PayloadError> {
    let expected = std::any::type_name::<T>();
    match postcard::take_from_bytes::<T>(bytes) {
        Ok((v, [])) => Ok(v),
        Ok((_, rest)) => Err(PayloadError::Decode {
            expected,
            reason: format!("{} trailing bytes", rest.len()),
        }),
        Err(e) => Err(PayloadError::Decode {
            expected,
            reason: e.to_string(),
        }),
    }
}

impl<T: Serialize + Send + 'static> LocalValue for T {
    fn encode_into(&self, out: &mut BytesMut) -> Result<(), EncodeError> {
        encode_postcard(self, out)
    }
    fn into_any(self: Box<Self>) -> Box<dyn Any + Send> {
        self
    }
    fn type_name(&self) -> &'static str {
        std::any::type_name::<T>()
    }
}

/// The body of a request, response or message: either a value that has not
/// been serialized (same process) or bytes (it crossed a process boundary, or
/// the sender only had bytes).
pub enum Payload {
    /// A value passed by move, never serialized.
    Local(Box<dyn LocalValue>),
    /// Encoded bytes (postcard for typed values, anything for raw services).
    Bytes(Bytes),
}

impl Payload {
    /// An empty byte payload.
    pub fn empty() -> Self {
        Payload::Bytes(Bytes::new())
    }

    /// Wraps a typed value without serializing it.
    pub fn local<T: Serialize + Send + 'static>(value: T) -> Self {
        Payload::Local(Box::new(value))
    }

    /// Wraps bytes.
    pub fn bytes(b: impl Into<Bytes>) -> Self {
        Payload::Bytes(b.into())
    }

    /// True when the payload still holds an unserialized value.
    pub fn is_local(&self) -> bool {
        matches!(self, Payload::Local(_))
    }

    /// Gets the typed value: a downcast for a local value, a postcard decode
    /// for bytes.
    ///
    /// Fails with [`PayloadError::TypeMismatch`] when a local value of another
    /// type was passed, or [`PayloadError::Decode`] when the bytes are not a
    /// valid encoding of `T`.
    pub fn decode<T: DeserializeOwned + Send + 'static>(self) -> Result<T, PayloadError> {
        match self {
            Payload::Local(v) => {
                let actual = v.type_name();
                v.into_any()
                    .downcast::<T>()
                    .map(|b| *b)
                    .map_err(|_| PayloadError::TypeMismatch {
                        expected: std::any::type_name::<T>(),
                        actual,
                    })
            }
            Payload::Bytes(b) => decode_postcard(&b),
        }
    }

    /// Appends the payload's bytes to `out`, encoding a local value.
    ///
    /// Fails with [`EncodeError`] when a local value cannot be encoded.
    pub fn write_to(&self, out: &mut BytesMut) -> Result<(), EncodeError> {
        match self {
            Payload::Local(v) => v.encode_into(out),
            Payload::Bytes(b) => {
                out.extend_from_slice(b);
                Ok(())
            }
        }
    }

    /// The payload as bytes, encoding a local value if needed.
    ///
    /// Fails with [`EncodeError`] when a local value cannot be encoded.
    pub fn into_bytes(self) -> Result<Bytes, EncodeError> {
        match self {
            Payload::Bytes(b) => Ok(b),
            local => {
                let mut out = BytesMut::new();
                local.write_to(&mut out)?;
                Ok(out.freeze())
            }
        }
    }

    /// A second copy of the payload. Local values cannot be cloned in general,
    /// so the copy of a local value is its encoding (the original stays local).
    ///
    /// Fails with [`EncodeError`] when a local value cannot be encoded.
    pub fn try_clone(&self) -> Result<Payload, EncodeError> {
        match self {
            Payload::Bytes(b) => Ok(Payload::Bytes(b.clone())),
            Payload::Local(v) => {
                let mut out = BytesMut::new();
                v.encode_into(&mut out)?;
                Ok(Payload::Bytes(out.freeze()))
            }
        }
    }
}

impl Default for Payload {
    fn default() -> Self {
        Payload::empty()
    }
}

impl fmt::Debug for Payload {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Payload::Local(v) => write!(f, "Local({})", v.type_name()),
            Payload::Bytes(b) => write!(f, "Bytes({} bytes)", b.len()),
        }
    }
}

impl PartialEq for Payload {
    /// Payloads compare by their encoding (a local value equals its bytes).
    fn eq(&self, other: &Self) -> bool {
        match (self.try_clone(), other.try_clone()) {
            (Ok(Payload::Bytes(a)), Ok(Payload::Bytes(b))) => a == b,
            _ => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;

    #[derive(Serialize, Deserialize, Debug, PartialEq)]
    struct Req {
        a: u32,
        b: String,
    }

    #[test]
    fn local_value_moves_without_encoding() {
        let p = Payload::local(Req {
            a: 1,
            b: "x".into(),
        });
        assert!(p.is_local());
        assert_eq!(
            p.decode::<Req>().unwrap(),
            Req {
                a: 1,
                b: "x".into()
            }
        );
    }

    #[test]
    fn local_and_bytes_agree() {
        let p = Payload::local(Req {
            a: 7,
            b: "hello".into(),
        });
        let bytes = p.try_clone().unwrap();
        assert!(!bytes.is_local());
        assert_eq!(bytes, p);
        assert_eq!(
            bytes.decode::<Req>().unwrap(),
            Req {
                a: 7,
                b: "hello".into()
            }
        );
    }

    #[test]
    fn mismatches_are_errors() {
        let p = Payload::local(5u32);
        assert!(matches!(
            p.decode::<Req>(),
            Err(PayloadError::TypeMismatch { .. })
        ));
        let p = Payload::bytes(vec![0xff, 0xff, 0xff]);
        assert!(matches!(
            p.decode::<Req>(),
            Err(PayloadError::Decode { .. })
        ));
        let mut good = BytesMut::new();
        encode_postcard(&3u8, &mut good).unwrap();
        good.extend_from_slice(&[1, 2]);
        assert!(matches!(
            Payload::Bytes(good.freeze()).decode::<u8>(),
            Err(PayloadError::Decode { .. })
        ));
    }
}
