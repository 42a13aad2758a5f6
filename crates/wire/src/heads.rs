//! The heads of Request and Response frames, the two frames on every call's
//! path, and a hand-written fast path for them.
//!
//! A head is postcard: its fields one after the other, integers as varints,
//! strings as a varint length and the bytes, options as a 0/1 tag then the
//! value. Encoding it through serde costs a function call and a `memcpy` per
//! byte written; decoding it validates and copies through serde's visitors.
//! On a same-host call both are a large part of the round trip, so the fast
//! path writes a head into a stack buffer and copies it out once, and reads
//! one straight from the bytes.
//!
//! Owns that fast path. Must never produce or accept anything postcard would
//! not: the writer yields postcard's bytes exactly, and the reader answers
//! `None` (the caller then asks postcard, which also words the error)
//! wherever it is not sure, so that both agree on every input. The reader is
//! stricter than postcard in one way: it declines overlong (non-minimal)
//! varints, which the caller then refuses ([`request_head_is_canonical`]).
//! The property tests below hold them to it.

use bytes::BytesMut;
use serde::Deserialize;

use crate::frame::{Request, Response};
use crate::ids::{NodeId, ServiceName};
use crate::payload::Payload;
use crate::payload::{encode_postcard, is_canonical, EncodeError};
use crate::status::Status;
use crate::txctx::{TxContext, TxReturn};

/// A Request's head, decoded; [`write_request_head`] encodes it.
#[derive(Debug, PartialEq, Deserialize)]
pub(crate) struct RequestHead {
    pub(crate) call_id: u64,
    pub(crate) service: ServiceName,
    pub(crate) instance: u32,
    pub(crate) node: NodeId,
    pub(crate) budget_us: Option<u64>,
    pub(crate) tx: Option<Box<TxContext>>,
    pub(crate) flags: u32,
}

/// A Response's head, decoded; [`write_response_head`] encodes it.
#[derive(Debug, PartialEq, Deserialize)]
pub(crate) struct ResponseHead {
    pub(crate) call_id: u64,
    pub(crate) status: Status,
    pub(crate) detail: String,
    pub(crate) tx: Option<Box<TxReturn>>,
}

/// Appends the head of `r` to `out`: postcard's bytes for its
/// fields in [`RequestHead`]'s order.
///
/// Fails with [`EncodeError`] only when the transaction context cannot be
/// encoded; `out` may then hold part of the head (the caller truncates).
pub(crate) fn write_request_head(r: &Request, out: &mut BytesMut) -> Result<(), EncodeError> {
    let mut w = HeadWriter::new(out);
    w.varint(r.call_id);
    w.bytes_with_len(r.service.as_str().as_bytes());
    w.varint(u64::from(r.instance));
    w.varint(u64::from(r.node.0));
    match r.budget_us {
        None => w.byte(0),
        Some(b) => {
            w.byte(1);
            w.varint(b);
        }
    }
    match &r.tx {
        None => w.byte(0),
        Some(tx) => {
            w.byte(1);
            w.flush();
            encode_postcard(tx, w.out)?;
        }
    }
    w.varint(u64::from(r.flags));
    w.flush();
    Ok(())
}

/// Appends the head of `r` to `out`: postcard's bytes for its
/// fields in [`ResponseHead`]'s order.
///
/// Fails with [`EncodeError`] only when the transaction return cannot be
/// encoded; `out` may then hold part of the head (the caller truncates).
pub(crate) fn write_response_head(r: &Response, out: &mut BytesMut) -> Result<(), EncodeError> {
    let mut w = HeadWriter::new(out);
    w.varint(r.call_id);
    w.varint(u64::from(r.status.code()));
    w.bytes_with_len(r.detail.as_bytes());
    match &r.tx {
        None => w.byte(0),
        Some(tx) => {
            w.byte(1);
            w.flush();
            encode_postcard(tx, w.out)?;
        }
    }
    w.flush();
    Ok(())
}

/// Reads a Request's head from the front of `body`; returns it and the bytes
/// it took. `None` when the bytes are not a head this path is sure of
/// (malformed, or a form it leaves to postcard): decode them with postcard.
pub(crate) fn read_request_head(body: &[u8]) -> Option<(RequestHead, usize)> {
    let mut r = HeadReader { b: body, pos: 0 };
    let call_id = r.varint_u64()?;
    let name = r.bytes_with_len()?;
    let service = ServiceName::from_bytes(name)?;
    let instance = r.varint_u32()?;
    let node = NodeId(r.varint_u32()?);
    let budget_us = match r.byte()? {
        0 => None,
        1 => Some(r.varint_u64()?),
        _ => return None,
    };
    let tx = match r.byte()? {
        0 => None,
        1 => Some(Box::new(r.postcard::<TxContext>()?)),
        _ => return None,
    };
    let flags = r.varint_u32()?;
    let head = RequestHead {
        call_id,
        service,
        instance,
        node,
        budget_us,
        tx,
        flags,
    };
    Some((head, r.pos))
}

/// Reads a Response's head from the front of `body` (see
/// [`read_request_head`]).
pub(crate) fn read_response_head(body: &[u8]) -> Option<(ResponseHead, usize)> {
    let mut r = HeadReader { b: body, pos: 0 };
    let call_id = r.varint_u64()?;
    let status = Status::from_code(r.varint_u16()?);
    let detail = std::str::from_utf8(r.bytes_with_len()?).ok()?.to_owned();
    let tx = match r.byte()? {
        0 => None,
        1 => Some(Box::new(r.postcard::<TxReturn>()?)),
        _ => return None,
    };
    let head = ResponseHead {
        call_id,
        status,
        detail,
        tx,
    };
    Some((head, r.pos))
}

/// True when `bytes` are exactly the encoding of `h` (every varint minimal).
/// For heads the fast reader declined; allocates.
pub(crate) fn request_head_is_canonical(h: &RequestHead, bytes: &[u8]) -> bool {
    let r = Request {
        call_id: h.call_id,
        service: h.service.clone(),
        instance: h.instance,
        node: h.node,
        budget_us: h.budget_us,
        tx: h.tx.clone(),
        flags: h.flags,
        payload: Payload::Bytes(bytes::Bytes::new()),
    };
    let mut out = BytesMut::new();
    write_request_head(&r, &mut out).is_ok() && out[..] == *bytes
}

/// [`request_head_is_canonical`] for a Response's head.
pub(crate) fn response_head_is_canonical(h: &ResponseHead, bytes: &[u8]) -> bool {
    let r = Response {
        call_id: h.call_id,
        status: h.status,
        detail: h.detail.clone(),
        tx: h.tx.clone(),
        payload: Payload::Bytes(bytes::Bytes::new()),
    };
    let mut out = BytesMut::new();
    write_response_head(&r, &mut out).is_ok() && out[..] == *bytes
}

/// Room of the stack buffer a head is written into: a request head without
/// a transaction context (at most 102 bytes with a 64-byte service name)
/// fits whole.
const SCRATCH: usize = 128;

/// Writes postcard's encoding of small values into a stack buffer and
/// appends it to `out` in one copy when flushed (or when full).
struct HeadWriter<'a> {
    out: &'a mut BytesMut,
    buf: [u8; SCRATCH],
    len: usize,
}

impl<'a> HeadWriter<'a> {
    #[inline]
    fn new(out: &'a mut BytesMut) -> Self {
        HeadWriter {
            out,
            buf: [0; SCRATCH],
            len: 0,
        }
    }

    #[inline]
    fn flush(&mut self) {
        if self.len > 0 {
            self.out.extend_from_slice(&self.buf[..self.len]);
            self.len = 0;
        }
    }

    /// Makes room for `n` bytes in the buffer (`n` at most [`SCRATCH`]).
    #[inline]
    fn room(&mut self, n: usize) {
        if self.len + n > SCRATCH {
            self.flush();
        }
    }

    #[inline]
    fn byte(&mut self, b: u8) {
        self.room(1);
        self.buf[self.len] = b;
        self.len += 1;
    }

    /// postcard's varint: seven bits a byte, least significant first, the
    /// high bit set on every byte but the last.
    #[inline(always)]
    fn varint(&mut self, mut v: u64) {
        self.room(10);
        while v >= 0x80 {
            self.buf[self.len] = (v as u8) | 0x80;
            self.len += 1;
            v >>= 7;
        }
        self.buf[self.len] = v as u8;
        self.len += 1;
    }

    /// A string or byte sequence: its length as a varint, then the bytes.
    #[inline]
    fn bytes_with_len(&mut self, b: &[u8]) {
        self.varint(b.len() as u64);
        if b.len() <= SCRATCH {
            self.room(b.len());
            self.buf[self.len..self.len + b.len()].copy_from_slice(b);
            self.len += b.len();
        } else {
            self.flush();
            self.out.extend_from_slice(b);
        }
    }
}

/// Reads postcard's encoding of small values, with postcard's checks: every
/// read answers `None` where postcard would fail.
struct HeadReader<'a> {
    b: &'a [u8],
    pos: usize,
}

impl<'a> HeadReader<'a> {
    #[inline]
    fn byte(&mut self) -> Option<u8> {
        let v = *self.b.get(self.pos)?;
        self.pos += 1;
        Some(v)
    }

    /// A varint of at most `max_bytes` bytes whose last byte is at most
    /// `last_max` when it uses all of them (postcard's rule against values
    /// that overflow the type), and whose last byte is not zero unless it is
    /// the only one (the rule against overlong encodings postcard lacks).
    #[inline(always)]
    fn varint(&mut self, max_bytes: usize, last_max: u8) -> Option<u64> {
        let mut out = 0u64;
        for i in 0..max_bytes {
            let v = self.byte()?;
            out |= u64::from(v & 0x7f) << (7 * i);
            if v & 0x80 == 0 {
                if (i == max_bytes - 1 && v > last_max) || (i > 0 && v == 0) {
                    return None;
                }
                return Some(out);
            }
        }
        None
    }

    #[inline]
    fn varint_u64(&mut self) -> Option<u64> {
        self.varint(10, 1)
    }

    #[inline]
    fn varint_u32(&mut self) -> Option<u32> {
        self.varint(5, 0x0f).map(|v| v as u32)
    }

    #[inline]
    fn varint_u16(&mut self) -> Option<u16> {
        self.varint(3, 0x03).map(|v| v as u16)
    }

    #[inline]
    fn bytes_with_len(&mut self) -> Option<&'a [u8]> {
        let len = usize::try_from(self.varint_u64()?).ok()?;
        let end = self.pos.checked_add(len)?;
        let s = self.b.get(self.pos..end)?;
        self.pos = end;
        Some(s)
    }

    /// A postcard value, declined unless its bytes are its canonical form.
    fn postcard<T: serde::de::DeserializeOwned + serde::Serialize>(&mut self) -> Option<T> {
        let rest = self.b.get(self.pos..)?;
        let (v, after) = postcard::take_from_bytes::<T>(rest).ok()?;
        let used = rest.len() - after.len();
        if !is_canonical(&v, &rest[..used]) {
            return None;
        }
        self.pos += used;
        Some(v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::{Incarnation, SubPath, Tid};
    use crate::payload::Payload;
    use crate::txctx::{Baggage, BaggageItem};
    use bytes::Bytes;
    use proptest::prelude::*;
    use serde::Serialize;

    /// [`RequestHead`] as serde encodes it (postcard writes a reference as the
    /// value): the reference the fast writer is held to.
    #[derive(Serialize)]
    struct RequestHeadRef<'a> {
        call_id: u64,
        service: &'a ServiceName,
        instance: u32,
        node: NodeId,
        budget_us: Option<u64>,
        tx: &'a Option<Box<TxContext>>,
        flags: u32,
    }

    /// [`ResponseHead`] as serde encodes it (see [`RequestHeadRef`]).
    #[derive(Serialize)]
    struct ResponseHeadRef<'a> {
        call_id: u64,
        status: Status,
        detail: &'a str,
        tx: &'a Option<Box<TxReturn>>,
    }

    fn arb_tx() -> impl Strategy<Value = TxContext> {
        (
            any::<u32>(),
            any::<u64>(),
            prop::collection::vec(any::<u32>(), 0..3),
            any::<Option<u64>>(),
            prop::collection::vec(
                ("[a-z.]{1,8}", prop::collection::vec(any::<u8>(), 0..9)),
                0..3,
            ),
        )
            .prop_map(|(n, seq, path, budget_us, items)| TxContext {
                tid: Tid::new(NodeId(n), Incarnation(n ^ 7), seq),
                path: SubPath(path),
                budget_us,
                baggage: Baggage(
                    items
                        .into_iter()
                        .map(|(key, v)| BaggageItem {
                            key,
                            value: Bytes::from(v),
                        })
                        .collect(),
                ),
            })
    }

    fn arb_request() -> impl Strategy<Value = Request> {
        (
            any::<u64>(),
            "[A-Za-z0-9_-]{1,64}",
            any::<u32>(),
            any::<u32>(),
            any::<Option<u64>>(),
            prop::option::of(arb_tx()),
            any::<u32>(),
        )
            .prop_map(
                |(call_id, name, instance, node, budget_us, tx, flags)| Request {
                    call_id,
                    service: ServiceName::new(name).expect("valid by construction"),
                    instance,
                    node: NodeId(node),
                    budget_us,
                    tx: tx.map(Box::new),
                    flags,
                    payload: Payload::empty(),
                },
            )
    }

    fn arb_response() -> impl Strategy<Value = Response> {
        (
            any::<u64>(),
            any::<u16>(),
            ".{0,200}",
            prop::option::of((arb_tx(), any::<bool>())),
        )
            .prop_map(|(call_id, code, detail, tx)| Response {
                call_id,
                status: Status::from_code(code),
                detail,
                tx: tx.map(|(ctx, aborted)| {
                    Box::new(TxReturn {
                        baggage: ctx.baggage,
                        aborted,
                    })
                }),
                payload: Payload::empty(),
            })
    }

    fn postcard_request(r: &Request) -> Vec<u8> {
        postcard::to_stdvec(&RequestHeadRef {
            call_id: r.call_id,
            service: &r.service,
            instance: r.instance,
            node: r.node,
            budget_us: r.budget_us,
            tx: &r.tx,
            flags: r.flags,
        })
        .expect("encodes")
    }

    fn postcard_response(r: &Response) -> Vec<u8> {
        postcard::to_stdvec(&ResponseHeadRef {
            call_id: r.call_id,
            status: r.status,
            detail: &r.detail,
            tx: &r.tx,
        })
        .expect("encodes")
    }

    /// The fast reader may decline, but whatever it accepts postcard
    /// accepts too, with the same value and length.
    fn agrees<T: serde::de::DeserializeOwned + PartialEq + std::fmt::Debug>(
        bytes: &[u8],
        fast: Option<(T, usize)>,
    ) -> Result<(), TestCaseError> {
        if let Some((v, used)) = fast {
            let (slow, rest) = postcard::take_from_bytes::<T>(bytes)
                .map_err(|e| TestCaseError::fail(format!("fast path accepted, postcard: {e}")))?;
            prop_assert_eq!(v, slow);
            prop_assert_eq!(used, bytes.len() - rest.len());
        }
        Ok(())
    }

    proptest! {
        #[test]
        fn request_heads_are_postcards_bytes_and_read_back(r in arb_request(), tail in prop::collection::vec(any::<u8>(), 0..8)) {
            let mut out = BytesMut::new();
            write_request_head(&r, &mut out).unwrap();
            prop_assert_eq!(&out[..], &postcard_request(&r)[..]);
            out.extend_from_slice(&tail);
            let (h, used) = read_request_head(&out).expect("a head the writer wrote");
            prop_assert_eq!(used, out.len() - tail.len());
            prop_assert_eq!((h.call_id, &h.service, h.instance, h.node), (r.call_id, &r.service, r.instance, r.node));
            prop_assert_eq!((h.budget_us, &h.tx, h.flags), (r.budget_us, &r.tx, r.flags));
        }

        #[test]
        fn response_heads_are_postcards_bytes_and_read_back(r in arb_response(), tail in prop::collection::vec(any::<u8>(), 0..8)) {
            let mut out = BytesMut::new();
            write_response_head(&r, &mut out).unwrap();
            prop_assert_eq!(&out[..], &postcard_response(&r)[..]);
            out.extend_from_slice(&tail);
            let (h, used) = read_response_head(&out).expect("a head the writer wrote");
            prop_assert_eq!(used, out.len() - tail.len());
            prop_assert_eq!((h.call_id, h.status, &h.detail, &h.tx), (r.call_id, r.status, &r.detail, &r.tx));
        }

        #[test]
        fn the_fast_reader_never_accepts_what_postcard_refuses(
            r in arb_request(),
            flips in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..4),
            cut in any::<prop::sample::Index>(),
        ) {
            let mut bytes = postcard_request(&r);
            for (at, v) in &flips {
                let i = at.index(bytes.len());
                bytes[i] = *v;
            }
            agrees::<RequestHead>(&bytes, read_request_head(&bytes))?;
            let short = &bytes[..cut.index(bytes.len() + 1)];
            agrees::<RequestHead>(short, read_request_head(short))?;
        }

        #[test]
        fn the_fast_reader_never_accepts_what_postcard_refuses_in_responses(
            r in arb_response(),
            flips in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..4),
            cut in any::<prop::sample::Index>(),
        ) {
            let mut bytes = postcard_response(&r);
            for (at, v) in &flips {
                let i = at.index(bytes.len());
                bytes[i] = *v;
            }
            agrees::<ResponseHead>(&bytes, read_response_head(&bytes))?;
            let short = &bytes[..cut.index(bytes.len() + 1)];
            agrees::<ResponseHead>(short, read_response_head(short))?;
        }

        #[test]
        fn random_bytes_never_split_the_two_readers(bytes in prop::collection::vec(any::<u8>(), 0..40)) {
            agrees::<RequestHead>(&bytes, read_request_head(&bytes))?;
            agrees::<ResponseHead>(&bytes, read_response_head(&bytes))?;
        }
    }

    #[test]
    fn varints_at_the_edges_of_their_types_follow_postcard() {
        // u32::MAX in five bytes is accepted; one more bit in the last byte
        // is not, nor is a sixth byte.
        let max = [0xff, 0xff, 0xff, 0xff, 0x0f];
        assert_eq!(HeadReader { b: &max, pos: 0 }.varint_u32(), Some(u32::MAX));
        let over = [0xff, 0xff, 0xff, 0xff, 0x1f];
        assert_eq!(HeadReader { b: &over, pos: 0 }.varint_u32(), None);
        assert!(postcard::from_bytes::<u32>(&over).is_err());
        let long = [0x80, 0x80, 0x80, 0x80, 0x80, 0x00];
        assert_eq!(HeadReader { b: &long, pos: 0 }.varint_u32(), None);
        assert!(postcard::from_bytes::<u32>(&long).is_err());
        // A non-minimal encoding: postcard accepts it, the fast reader
        // declines it (and the codec then refuses it).
        let padded = [0x81, 0x00];
        assert_eq!(HeadReader { b: &padded, pos: 0 }.varint_u64(), None);
        assert_eq!(postcard::from_bytes::<u64>(&padded).ok(), Some(1));
        assert_eq!(HeadReader { b: &[0x00], pos: 0 }.varint_u64(), Some(0));
    }
}
