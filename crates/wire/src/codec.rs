//! The byte layout of frames: a 12-byte header then a body, plus fragmentation
//! of frames larger than a link's maximum frame size.
//!
//! ```text
//! offset size field
//! 0      2    magic "wf" (0x77 0x66)
//! 2      1    version (1)
//! 3      1    kind (FrameKind)
//! 4      4    body length, u32 little-endian
//! 8      4    CRC32C of header bytes 0..8 followed by the body, u32 LE
//! 12     ..   body: postcard-encoded head, then (for Request, Response,
//!             Message, Fragment) the raw payload bytes up to the end
//! ```
//!
//! Owns encoding and decoding. The decoder returns a typed [`DecodeError`] for
//! every malformed input and must never panic, whatever the bytes. Every
//! head has one encoding: a varint that is not minimal, or that exceeds its
//! type, is [`DecodeError::Varint`], never accepted.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Buf, Bytes, BytesMut};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::frame::*;
use crate::heads::{self, RequestHead, ResponseHead};
use crate::ids::ServiceName;
use crate::payload::{encode_postcard, is_canonical, EncodeError, Payload};
use crate::status::Status;
use crate::txctx::MAX_BAGGAGE_ENTRIES;

/// The two magic bytes that start every frame.
pub const MAGIC: [u8; 2] = *b"wf";
/// The wire format version this crate speaks.
pub const VERSION: u8 = 1;
/// Size of the fixed frame header.
pub const HEADER_LEN: usize = 12;
/// Room reserved in every fragment frame for its header and head.
pub const FRAGMENT_OVERHEAD: usize = HEADER_LEN + 32;
/// Smallest maximum frame size a link may announce.
pub const MIN_MAX_FRAME: usize = 1024;
/// Smallest maximum message size a link may announce in its Hello. Like
/// `max_message` itself it counts a whole encoded frame, header included: a
/// receiver that accepted less could not be sent even the failure Response
/// that says its answer was too large.
pub const MIN_MAX_MESSAGE: usize = MIN_MAX_FRAME;
/// Largest frame accepted before a link's handshake completes. Hello, Auth
/// and Refused are all that may arrive then, and they are small; a larger
/// claim is refused as soon as its header arrives, so an unauthenticated
/// peer cannot make the receiver buffer a full `max_frame`.
pub const HANDSHAKE_MAX_FRAME: usize = MIN_MAX_FRAME;

/// Whether frames carry a checksum: what the header's CRC32C field holds and
/// whether the decoder checks it. Both ends of a link use the same.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Integrity {
    /// The field holds the CRC32C of the frame and the decoder checks it:
    /// for bytes that cross a medium that can damage them (TCP).
    #[default]
    Checksummed,
    /// The encoder writes zero in the field and the decoder does not check
    /// it: for the shared-memory channel, where both ends read the very
    /// bytes the writer wrote, and for frames received inside TLS, whose
    /// records are authenticated (there the sender still writes the CRC,
    /// for peers written from `docs/wire.md`). A checksum would guard
    /// against nothing (a hostile peer could compute it) and cost a pass
    /// over every frame.
    Trusted,
}

/// Size limits enforced by the decoder.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Largest frame accepted, header included.
    pub max_frame: usize,
    /// Largest frame accepted after reassembly of fragments.
    pub max_message: usize,
    /// Most fragmented messages being reassembled at once on one link. The
    /// sizes their first pieces claim must also add up to at most
    /// `max_message`.
    pub max_partial_messages: usize,
    /// How long a fragmented message may take from its first piece to its
    /// last; a message still incomplete then fails the link with TimedOut.
    pub reassembly_timeout: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_frame: 1 << 20,
            max_message: 64 << 20,
            max_partial_messages: 16,
            reassembly_timeout: Duration::from_secs(30),
        }
    }
}

impl Limits {
    /// The limits that apply before a link's handshake completes: frames of
    /// at most [`HANDSHAKE_MAX_FRAME`] bytes.
    pub fn handshake(&self) -> Limits {
        Limits {
            max_frame: self.max_frame.min(HANDSHAKE_MAX_FRAME),
            ..*self
        }
    }
}

/// Why bytes could not be decoded into a frame.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// The first two bytes are not "wf".
    #[error("bad magic {0:02x?}: not a weft frame")]
    BadMagic([u8; 2]),
    /// The version byte is not one this node speaks.
    #[error("unknown wire version {0} (this node speaks {VERSION})")]
    UnknownVersion(u8),
    /// The kind byte is not a known frame kind.
    #[error("unknown frame kind {0}")]
    UnknownKind(u8),
    /// The frame is larger than the configured maximum.
    #[error("frame of {len} bytes exceeds the maximum of {max}")]
    TooLarge {
        /// Frame size (header included) or reassembled size.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// The checksum does not match the bytes.
    #[error("checksum mismatch: header says {expected:08x}, bytes give {actual:08x}")]
    Checksum {
        /// Checksum in the header.
        expected: u32,
        /// Checksum of the received bytes.
        actual: u32,
    },
    /// The input ends before the frame does (only from [`decode_exact`]).
    #[error("truncated: frame needs {needed} bytes, got {have}")]
    Truncated {
        /// Bytes the header announces.
        needed: usize,
        /// Bytes available.
        have: usize,
    },
    /// Bytes follow a complete frame (only from [`decode_exact`]) or a body
    /// that should have ended.
    #[error("{kind:?}: {extra} unexpected trailing bytes")]
    Trailing {
        /// The frame kind.
        kind: FrameKind,
        /// How many bytes were left over.
        extra: usize,
    },
    /// The body does not decode as the kind's head.
    #[error("{kind:?} body: {reason}")]
    Body {
        /// The frame kind.
        kind: FrameKind,
        /// The decoder's complaint.
        reason: String,
    },
    /// A fragment is inconsistent (index out of range, out of order, too many
    /// partial messages, a fragment inside a fragment).
    #[error("fragment: {0}")]
    Fragment(String),
    /// A fragmented message was not complete within the reassembly timeout.
    #[error("message {message_id} not reassembled within {after:?}")]
    ReassemblyTimeout {
        /// The message.
        message_id: u64,
        /// The timeout.
        after: Duration,
    },
    /// The node's memory for reassembly (shared by all its links) cannot
    /// hold the message a first fragment announces.
    #[error("reassembly memory exhausted: {need} bytes wanted, {available} of {cap} free")]
    NoBudget {
        /// Bytes the message claims.
        need: usize,
        /// Bytes left in the budget.
        available: usize,
        /// The budget.
        cap: usize,
    },
    /// A head holds a varint that is not in its one valid form. The stream
    /// cannot be trusted after it (the sender's encoder is broken).
    #[error("{kind:?} head: a varint {problem}")]
    Varint {
        /// The frame kind.
        kind: FrameKind,
        /// What is wrong with it.
        problem: VarintError,
    },
    /// A whole, checksummed Request whose head does not decode (an invalid
    /// service name, say), though its call id does: the frame was consumed,
    /// the stream is still in step, and the caller can be answered
    /// BadRequest by call id instead of losing its link.
    #[error("request {call_id}: {reason}")]
    BadRequest {
        /// The call to answer.
        call_id: u64,
        /// The decoder's complaint.
        reason: String,
    },
}

/// What is wrong with a varint in a frame head (see docs/wire.md §2).
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum VarintError {
    /// Not the shortest encoding of its value: it ends in a `0x00` byte
    /// after a continuation byte (`0x80 0x00` for 0, `0x81 0x00` for 1).
    #[error("is overlong (not the shortest encoding of its value)")]
    Overlong,
    /// Longer than its type allows (more than 3, 5 or 10 bytes for a u16,
    /// u32 or u64) or its value does not fit the type.
    #[error("exceeds the range of its type")]
    OutOfRange,
}

impl DecodeError {
    /// The status a peer gets for sending these bytes.
    pub fn status(&self) -> Status {
        match self {
            DecodeError::TooLarge { .. } => Status::TooLarge,
            DecodeError::BadRequest { .. } => Status::BadRequest,
            DecodeError::ReassemblyTimeout { .. } => Status::TimedOut,
            DecodeError::NoBudget { .. } => Status::NoBuffer,
            _ => Status::ProtocolError,
        }
    }
}

/// The front of a [`RequestHead`] with the service name unchecked, to say
/// what was wrong with a request whose head did not decode.
#[derive(Deserialize)]
struct RequestHeadFront {
    _call_id: u64,
    service: String,
}

/// Turns the failure to decode a Request's head into
/// [`DecodeError::BadRequest`] when its call id reads (it leads the head),
/// naming an invalid service name when that is the trouble.
fn bad_request(e: DecodeError, body: &Bytes) -> DecodeError {
    let DecodeError::Body { reason, .. } = &e else {
        return e;
    };
    let Ok((call_id, _)) = postcard::take_from_bytes::<u64>(body) else {
        return e;
    };
    let invalid_name = postcard::take_from_bytes::<RequestHeadFront>(body)
        .ok()
        .and_then(|(front, _)| ServiceName::new(front.service).err());
    DecodeError::BadRequest {
        call_id,
        reason: invalid_name.map_or_else(|| reason.clone(), |e| e.to_string()),
    }
}

#[derive(Serialize, Deserialize)]
struct MessageHead {
    port: Port,
}

#[derive(Serialize, Deserialize)]
struct FragmentHead {
    message_id: u64,
    index: u32,
    count: u32,
}

/// Appends one frame (header and body) to `out`, whatever its size; see
/// [`encode_message`] for links with frame and message size limits.
///
/// Fails with [`EncodeError`] when a local payload cannot be encoded; `out` is
/// then left as it was.
pub fn encode_frame(frame: &Frame, out: &mut BytesMut) -> Result<(), EncodeError> {
    encode_frame_with(frame, Integrity::Checksummed, out)
}

/// [`encode_frame`] with the given [`Integrity`]: `Trusted` leaves the
/// checksum field zero.
///
/// Fails with [`EncodeError`] when a local payload cannot be encoded; `out` is
/// then left as it was.
pub fn encode_frame_with(
    frame: &Frame,
    integrity: Integrity,
    out: &mut BytesMut,
) -> Result<(), EncodeError> {
    let start = out.len();
    out.reserve(HEADER_LEN + 64);
    // Length and checksum are patched in below.
    let mut header = [0u8; HEADER_LEN];
    header[..2].copy_from_slice(&MAGIC);
    header[2] = VERSION;
    header[3] = frame.kind() as u8;
    out.extend_from_slice(&header);
    let body = encode_body(frame, out);
    if let Err(e) = body {
        out.truncate(start);
        return Err(e);
    }
    let body_len = out.len() - start - HEADER_LEN;
    let Ok(len32) = u32::try_from(body_len) else {
        out.truncate(start);
        return Err(EncodeError {
            type_name: "Frame",
            reason: format!("body of {body_len} bytes exceeds 4 GiB"),
        });
    };
    out[start + 4..start + 8].copy_from_slice(&len32.to_le_bytes());
    if integrity == Integrity::Checksummed {
        seal(&mut out[start..]);
    }
    Ok(())
}

/// The CRC32C of a frame: its header's first 8 bytes, then its body.
fn checksum(frame: &[u8]) -> u32 {
    crc32c::crc32c_append(crc32c::crc32c(&frame[..8]), &frame[HEADER_LEN..])
}

/// Writes the checksum of the one whole frame `frame` into its header.
fn seal(frame: &mut [u8]) {
    let crc = checksum(frame);
    frame[8..12].copy_from_slice(&crc.to_le_bytes());
}

fn encode_body(frame: &Frame, out: &mut BytesMut) -> Result<(), EncodeError> {
    match frame {
        Frame::Hello(h) => encode_postcard(h, out),
        Frame::Auth(a) => encode_postcard(a, out),
        Frame::Refused(r) => encode_postcard(r, out),
        Frame::Heartbeat(h) => encode_postcard(h, out),
        Frame::Goodbye(g) => encode_postcard(g, out),
        Frame::Request(r) => {
            heads::write_request_head(r, out)?;
            r.payload.write_to(out)
        }
        Frame::Response(r) => {
            heads::write_response_head(r, out)?;
            r.payload.write_to(out)
        }
        Frame::Message(m) => {
            encode_postcard(&MessageHead { port: m.port }, out)?;
            m.payload.write_to(out)
        }
        Frame::Fragment(f) => {
            let head = FragmentHead {
                message_id: f.message_id,
                index: f.index,
                count: f.count,
            };
            encode_postcard(&head, out)?;
            out.extend_from_slice(&f.chunk);
            Ok(())
        }
    }
}

/// Failure of [`encode_message`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MessageEncodeError {
    /// The frame's encoding is larger than the receiver accepts: sending it
    /// would make the receiver close the link.
    #[error("a message of {len} bytes exceeds the receiver's maximum of {max}")]
    TooLarge {
        /// The encoded size.
        len: usize,
        /// The receiver's `max_message`.
        max: usize,
    },
    /// A local payload cannot be encoded.
    #[error(transparent)]
    Encode(#[from] EncodeError),
}

/// Appends `frame` to `out` as one frame if it fits in `max_frame` bytes, or
/// as a sequence of [`Fragment`] frames (each at most `max_frame` bytes) whose
/// chunks concatenate to the frame's encoding, for a receiver that accepts
/// messages of at most `max_message` bytes (it announced both in its Hello).
/// `message_id` identifies the fragments; the caller supplies a fresh one per
/// fragmented frame. Leaves `out` as it was on failure.
///
/// Fails with TooLarge when the frame's encoding exceeds `max_message`,
/// Encode when a local payload cannot be encoded.
pub fn encode_message(
    frame: &Frame,
    max_frame: usize,
    max_message: usize,
    message_id: u64,
    out: &mut BytesMut,
) -> Result<(), MessageEncodeError> {
    encode_message_with(
        frame,
        Integrity::Checksummed,
        max_frame,
        max_message,
        message_id,
        out,
    )
}

/// [`encode_message`] with the given [`Integrity`] for the frames written.
/// A fragmented frame's own encoding (what the fragments carry) is always
/// checksummed: the receiver checks it once reassembled, whatever the link.
///
/// Fails as [`encode_message`] does.
pub fn encode_message_with(
    frame: &Frame,
    integrity: Integrity,
    max_frame: usize,
    max_message: usize,
    message_id: u64,
    out: &mut BytesMut,
) -> Result<(), MessageEncodeError> {
    let start = out.len();
    encode_frame_with(frame, integrity, out)?; // leaves `out` as it was on failure
    let len = out.len() - start;
    if len > max_message {
        out.truncate(start);
        return Err(MessageEncodeError::TooLarge {
            len,
            max: max_message,
        });
    }
    if len <= max_frame {
        return Ok(());
    }
    if integrity != Integrity::Checksummed {
        seal(&mut out[start..]);
    }
    let whole = out.split_off(start).freeze();
    let chunk_len = max_frame.max(MIN_MAX_FRAME) - FRAGMENT_OVERHEAD;
    let count = whole.len().div_ceil(chunk_len);
    let count32 = u32::try_from(count).map_err(|_| EncodeError {
        type_name: "Frame",
        reason: format!("{} bytes need too many fragments", whole.len()),
    })?;
    for (index, chunk) in whole.chunks(chunk_len).enumerate() {
        let piece = Frame::Fragment(Fragment {
            message_id,
            index: index as u32,
            count: count32,
            chunk: whole.slice_ref(chunk),
        });
        encode_frame_with(&piece, integrity, out)?;
    }
    Ok(())
}

/// Decodes the next frame from the front of `buf`, consuming its bytes.
/// Returns `Ok(None)` when `buf` does not yet hold a whole frame (read more).
///
/// Fails with a [`DecodeError`] for malformed input; the stream cannot be
/// resynchronised after that and the link should be closed, except after
/// [`DecodeError::BadRequest`]: that frame was consumed whole, and the next
/// one decodes. A frame larger than `limits.max_frame` is rejected as soon
/// as its header arrives.
pub fn decode_frame(buf: &mut BytesMut, limits: &Limits) -> Result<Option<Frame>, DecodeError> {
    decode_frame_with(buf, limits, Integrity::Checksummed)
}

/// [`decode_frame`] for a link whose frames have the given [`Integrity`]:
/// `Trusted` does not check the checksum field.
///
/// Fails as [`decode_frame`] does.
pub fn decode_frame_with(
    buf: &mut BytesMut,
    limits: &Limits,
    integrity: Integrity,
) -> Result<Option<Frame>, DecodeError> {
    let Some(body_len) = check_header(buf, limits)? else {
        return Ok(None);
    };
    let total = HEADER_LEN + body_len;
    if buf.len() < total {
        buf.reserve(total - buf.len());
        return Ok(None);
    }
    let bytes = buf.split_to(total).freeze();
    decode_checked(bytes, integrity).map(Some)
}

/// Decodes exactly one frame from `bytes`: the input must hold one whole frame
/// and nothing else.
///
/// Fails with [`DecodeError::Truncated`] when bytes are missing,
/// [`DecodeError::Trailing`] when bytes follow the frame, and any other
/// [`DecodeError`] for malformed input.
pub fn decode_exact(bytes: Bytes, limits: &Limits) -> Result<Frame, DecodeError> {
    let Some(body_len) = check_header(&bytes, limits)? else {
        return Err(DecodeError::Truncated {
            needed: HEADER_LEN,
            have: bytes.len(),
        });
    };
    let total = HEADER_LEN + body_len;
    if bytes.len() < total {
        return Err(DecodeError::Truncated {
            needed: total,
            have: bytes.len(),
        });
    }
    if bytes.len() > total {
        let kind = FrameKind::from_u8(bytes[3]).unwrap_or(FrameKind::Hello);
        return Err(DecodeError::Trailing {
            kind,
            extra: bytes.len() - total,
        });
    }
    decode_checked(bytes, Integrity::Checksummed)
}

/// The kind byte of the frame at the front of `buf`, once its magic and
/// version have arrived and are valid; `None` before that or when they are
/// not (decoding then says why). Lets a receiver judge a frame by its kind
/// before decoding its body (before a handshake completes, say).
pub fn peek_kind(buf: &[u8]) -> Option<FrameKind> {
    if buf.len() < 4 || buf[0..2] != MAGIC || buf[2] != VERSION {
        return None;
    }
    FrameKind::from_u8(buf[3])
}

/// Validates the header at the front of `buf`; returns the body length, or
/// `None` if fewer than [`HEADER_LEN`] bytes are present.
fn check_header(buf: &[u8], limits: &Limits) -> Result<Option<usize>, DecodeError> {
    if buf.len() < 2 {
        return Ok(None);
    }
    if buf[0..2] != MAGIC {
        return Err(DecodeError::BadMagic([buf[0], buf[1]]));
    }
    if buf.len() < HEADER_LEN {
        return Ok(None);
    }
    if buf[2] != VERSION {
        return Err(DecodeError::UnknownVersion(buf[2]));
    }
    if FrameKind::from_u8(buf[3]).is_none() {
        return Err(DecodeError::UnknownKind(buf[3]));
    }
    let body_len = u32::from_le_bytes([buf[4], buf[5], buf[6], buf[7]]) as usize;
    let total = HEADER_LEN.saturating_add(body_len);
    if total > limits.max_frame {
        return Err(DecodeError::TooLarge {
            len: total,
            max: limits.max_frame,
        });
    }
    Ok(Some(body_len))
}

/// Decodes one whole frame whose header has been validated, checking its
/// checksum when `integrity` says it has one.
fn decode_checked(bytes: Bytes, integrity: Integrity) -> Result<Frame, DecodeError> {
    debug_assert!(bytes.len() >= HEADER_LEN);
    if integrity == Integrity::Checksummed {
        let expected = u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]);
        let actual = checksum(&bytes);
        if expected != actual {
            return Err(DecodeError::Checksum { expected, actual });
        }
    }
    let Some(kind) = FrameKind::from_u8(bytes[3]) else {
        return Err(DecodeError::UnknownKind(bytes[3]));
    };
    let mut body = bytes;
    body.advance(HEADER_LEN);
    decode_body(kind, body)
}

/// Decodes a postcard head from the front of `body`, accepting overlong
/// varints; returns it and the rest. Only for heads the caller checks.
fn head_lenient<T: DeserializeOwned>(
    kind: FrameKind,
    body: &Bytes,
) -> Result<(T, Bytes), DecodeError> {
    match postcard::take_from_bytes::<T>(body) {
        Ok((v, rest)) => {
            let used = body.len() - rest.len();
            Ok((v, body.slice(used..)))
        }
        Err(postcard::Error::DeserializeBadVarint) => Err(DecodeError::Varint {
            kind,
            problem: VarintError::OutOfRange,
        }),
        Err(e) => Err(DecodeError::Body {
            kind,
            reason: e.to_string(),
        }),
    }
}

/// Decodes a postcard head from the front of `body`; returns it and the rest.
/// Fails with [`DecodeError::Varint`] unless the bytes it took are the
/// head's one canonical encoding.
fn head<T: DeserializeOwned + Serialize>(
    kind: FrameKind,
    body: &Bytes,
) -> Result<(T, Bytes), DecodeError> {
    let (v, rest) = head_lenient::<T>(kind, body)?;
    let used = body.len() - rest.len();
    if !is_canonical(&v, &body[..used]) {
        return Err(overlong(kind));
    }
    Ok((v, rest))
}

fn overlong(kind: FrameKind) -> DecodeError {
    DecodeError::Varint {
        kind,
        problem: VarintError::Overlong,
    }
}

/// Decodes a head that must fill the whole body.
fn whole<T: DeserializeOwned + Serialize>(kind: FrameKind, body: &Bytes) -> Result<T, DecodeError> {
    let (v, rest) = head::<T>(kind, body)?;
    if !rest.is_empty() {
        return Err(DecodeError::Trailing {
            kind,
            extra: rest.len(),
        });
    }
    Ok(v)
}

fn decode_body(kind: FrameKind, body: Bytes) -> Result<Frame, DecodeError> {
    Ok(match kind {
        FrameKind::Hello => Frame::Hello(whole(kind, &body)?),
        FrameKind::Auth => Frame::Auth(whole(kind, &body)?),
        FrameKind::Refused => Frame::Refused(whole(kind, &body)?),
        FrameKind::Heartbeat => Frame::Heartbeat(whole(kind, &body)?),
        FrameKind::Goodbye => Frame::Goodbye(whole(kind, &body)?),
        FrameKind::Request => {
            let (h, rest) = match heads::read_request_head(&body) {
                Some((h, used)) => (h, body.slice(used..)),
                None => {
                    // The strict fast reader declined; postcard words the
                    // error, and what it accepts must still be canonical.
                    let (h, rest) = head_lenient::<RequestHead>(kind, &body)
                        .map_err(|e| bad_request(e, &body))?;
                    if !heads::request_head_is_canonical(&h, &body[..body.len() - rest.len()]) {
                        return Err(overlong(kind));
                    }
                    (h, rest)
                }
            };
            let entries = h.tx.as_ref().map_or(0, |tx| tx.baggage.0.len());
            if entries > MAX_BAGGAGE_ENTRIES {
                return Err(DecodeError::BadRequest {
                    call_id: h.call_id,
                    reason: format!(
                        "{entries} baggage entries exceed the maximum of {MAX_BAGGAGE_ENTRIES}"
                    ),
                });
            }
            Frame::Request(Request {
                call_id: h.call_id,
                service: h.service,
                instance: h.instance,
                node: h.node,
                budget_us: h.budget_us,
                tx: h.tx,
                flags: h.flags,
                payload: Payload::Bytes(rest),
            })
        }
        FrameKind::Response => {
            let (h, rest) = match heads::read_response_head(&body) {
                Some((h, used)) => (h, body.slice(used..)),
                None => {
                    let (h, rest) = head_lenient::<ResponseHead>(kind, &body)?;
                    if !heads::response_head_is_canonical(&h, &body[..body.len() - rest.len()]) {
                        return Err(overlong(kind));
                    }
                    (h, rest)
                }
            };
            Frame::Response(Response {
                call_id: h.call_id,
                status: h.status,
                detail: h.detail,
                tx: h.tx,
                payload: Payload::Bytes(rest),
            })
        }
        FrameKind::Message => {
            let (h, rest) = head::<MessageHead>(kind, &body)?;
            Frame::Message(Message {
                port: h.port,
                payload: Payload::Bytes(rest),
            })
        }
        FrameKind::Fragment => {
            let (h, rest) = head::<FragmentHead>(kind, &body)?;
            if h.count < 2 || h.index >= h.count {
                return Err(DecodeError::Fragment(format!(
                    "index {} of {} is out of range",
                    h.index, h.count
                )));
            }
            Frame::Fragment(Fragment {
                message_id: h.message_id,
                index: h.index,
                count: h.count,
                chunk: rest,
            })
        }
    })
}

struct Partial {
    count: u32,
    next: u32,
    /// The size of the whole inner frame, from the header in its first piece.
    claimed: usize,
    started: Instant,
    bytes: BytesMut,
}

/// Memory for reassembly shared by every link of a node: each message in
/// reassembly holds the size its first piece claims until it completes or
/// fails. Cheap to clone (clones share the budget).
#[derive(Clone, Debug)]
pub struct ReassemblyBudget {
    used: Arc<AtomicUsize>,
    cap: usize,
}

impl ReassemblyBudget {
    /// A budget of `cap` bytes.
    pub fn new(cap: usize) -> Self {
        ReassemblyBudget {
            used: Arc::new(AtomicUsize::new(0)),
            cap,
        }
    }

    /// Bytes held by messages in reassembly now.
    pub fn in_use(&self) -> usize {
        self.used.load(Ordering::Acquire)
    }

    /// The budget's size.
    pub fn cap(&self) -> usize {
        self.cap
    }

    fn take(&self, n: usize) -> Result<(), DecodeError> {
        let mut used = self.used.load(Ordering::Acquire);
        loop {
            let available = self.cap.saturating_sub(used);
            if n > available {
                return Err(DecodeError::NoBudget {
                    need: n,
                    available,
                    cap: self.cap,
                });
            }
            match self.used.compare_exchange_weak(
                used,
                used + n,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return Ok(()),
                Err(now) => used = now,
            }
        }
    }

    fn give_back(&self, n: usize) {
        let before = self.used.fetch_sub(n, Ordering::AcqRel);
        debug_assert!(before >= n, "reassembly budget returned more than taken");
    }
}

/// Reassembles fragmented frames arriving on one link, in order.
///
/// Bounded: at most `limits.max_partial_messages` frames in reassembly, whose
/// claimed sizes (from the inner frame header the first piece carries) add
/// up to at most `limits.max_message` and fit the node's
/// [`ReassemblyBudget`]; each must complete within
/// `limits.reassembly_timeout` ([`Reassembler::check_deadline`]). A claim
/// too large is refused on the first piece, before its bytes arrive.
pub struct Reassembler {
    limits: Limits,
    budget: ReassemblyBudget,
    partial: HashMap<u64, Partial>,
    /// Sum of the claimed sizes of `partial`, all taken from `budget`.
    held: usize,
}

impl Reassembler {
    /// An empty reassembler enforcing `limits`, with a budget of its own of
    /// `limits.max_message` bytes.
    pub fn new(limits: Limits) -> Self {
        Self::with_budget(limits, ReassemblyBudget::new(limits.max_message))
    }

    /// An empty reassembler enforcing `limits` that draws on `budget`,
    /// shared with other links.
    pub fn with_budget(limits: Limits, budget: ReassemblyBudget) -> Self {
        Reassembler {
            limits,
            budget,
            partial: HashMap::new(),
            held: 0,
        }
    }

    /// Number of frames currently being reassembled.
    pub fn in_progress(&self) -> usize {
        self.partial.len()
    }

    /// Bytes this link holds in the node's budget (claimed sizes).
    pub fn held(&self) -> usize {
        self.held
    }

    fn drop_partial(&mut self, id: u64) {
        if let Some(p) = self.partial.remove(&id) {
            self.held -= p.claimed;
            self.budget.give_back(p.claimed);
        }
    }

    /// Forgets every message in reassembly and returns their budget (the
    /// link closed).
    pub fn clear(&mut self) {
        self.partial.clear();
        self.budget.give_back(self.held);
        self.held = 0;
    }

    /// Fails with [`DecodeError::ReassemblyTimeout`] (and forgets the
    /// message) when a message has been in reassembly longer than
    /// `limits.reassembly_timeout` at `now`.
    pub fn check_deadline(&mut self, now: Instant) -> Result<(), DecodeError> {
        let after = self.limits.reassembly_timeout;
        let late = self
            .partial
            .iter()
            .find(|(_, p)| now.saturating_duration_since(p.started) > after)
            .map(|(id, _)| *id);
        match late {
            Some(message_id) => {
                self.drop_partial(message_id);
                Err(DecodeError::ReassemblyTimeout { message_id, after })
            }
            None => Ok(()),
        }
    }

    /// Checks the inner frame header a first piece starts with; returns the
    /// whole inner frame's size.
    fn claim(&self, fragment: &Fragment) -> Result<usize, DecodeError> {
        let id = fragment.message_id;
        if fragment.chunk.len() < HEADER_LEN {
            return Err(DecodeError::Fragment(format!(
                "message {id}: a first piece of {} bytes does not hold a frame header",
                fragment.chunk.len()
            )));
        }
        let whole_limits = Limits {
            max_frame: self.limits.max_message,
            ..self.limits
        };
        let body = check_header(&fragment.chunk, &whole_limits)?.unwrap_or_default();
        if fragment.chunk[3] == FrameKind::Fragment as u8 {
            return Err(DecodeError::Fragment(
                "a fragment cannot contain a fragment".into(),
            ));
        }
        let claimed = HEADER_LEN + body;
        if (fragment.count as usize) > claimed || fragment.chunk.len() > claimed {
            return Err(DecodeError::Fragment(format!(
                "message {id}: {} pieces cannot make a frame of {claimed} bytes",
                fragment.count
            )));
        }
        Ok(claimed)
    }

    /// Accepts one fragment, received at `now`. Returns the reassembled
    /// frame when `fragment` was the last piece, `None` while pieces are
    /// missing.
    ///
    /// Fails with [`DecodeError::Fragment`] for out-of-order, empty or
    /// inconsistent pieces or too many frames in reassembly,
    /// [`DecodeError::TooLarge`] when the size a first piece claims exceeds
    /// `max_message` or, with the messages already in reassembly, the
    /// link's share of it, [`DecodeError::NoBudget`] when the node's budget
    /// cannot hold it, [`DecodeError::ReassemblyTimeout`] for a message past
    /// its deadline, and any [`DecodeError`] of the reassembled frame itself
    /// (which may not be a fragment).
    pub fn accept(
        &mut self,
        fragment: Fragment,
        now: Instant,
    ) -> Result<Option<Frame>, DecodeError> {
        self.check_deadline(now)?;
        let id = fragment.message_id;
        if fragment.chunk.is_empty() {
            self.drop_partial(id);
            return Err(DecodeError::Fragment(format!(
                "message {id}: empty piece {}",
                fragment.index
            )));
        }
        if fragment.index == 0 {
            if self.partial.contains_key(&id) {
                self.drop_partial(id);
                return Err(DecodeError::Fragment(format!("message {id} restarted")));
            }
            if self.partial.len() >= self.limits.max_partial_messages {
                return Err(DecodeError::Fragment(format!(
                    "more than {} fragmented messages in flight",
                    self.limits.max_partial_messages
                )));
            }
            let claimed = self.claim(&fragment)?;
            if self.held + claimed > self.limits.max_message {
                return Err(DecodeError::TooLarge {
                    len: self.held + claimed,
                    max: self.limits.max_message,
                });
            }
            self.budget.take(claimed)?;
            self.held += claimed;
            self.partial.insert(
                id,
                Partial {
                    count: fragment.count,
                    next: 0,
                    claimed,
                    started: now,
                    bytes: BytesMut::new(),
                },
            );
        }
        let Some(p) = self.partial.get_mut(&id) else {
            return Err(DecodeError::Fragment(format!(
                "piece {} of unknown message {id}",
                fragment.index
            )));
        };
        if fragment.index != p.next || fragment.count != p.count {
            let msg = format!(
                "message {id}: got piece {}/{}, expected {}/{}",
                fragment.index, fragment.count, p.next, p.count
            );
            self.drop_partial(id);
            return Err(DecodeError::Fragment(msg));
        }
        let len = p.bytes.len() + fragment.chunk.len();
        let last = p.next + 1 == p.count;
        if len > p.claimed || (last && len != p.claimed) {
            let msg = format!(
                "message {id}: {len} bytes after piece {}/{}, its header says {}",
                fragment.index, p.count, p.claimed
            );
            self.drop_partial(id);
            return Err(DecodeError::Fragment(msg));
        }
        p.bytes.extend_from_slice(&fragment.chunk);
        p.next += 1;
        if !last {
            return Ok(None);
        }
        let done = std::mem::take(&mut p.bytes).freeze();
        self.drop_partial(id);
        let whole_limits = Limits {
            max_frame: self.limits.max_message,
            ..self.limits
        };
        match decode_exact(done, &whole_limits)? {
            Frame::Fragment(_) => Err(DecodeError::Fragment(
                "a fragment cannot contain a fragment".into(),
            )),
            frame => Ok(Some(frame)),
        }
    }
}

impl Drop for Reassembler {
    fn drop(&mut self) {
        self.clear();
    }
}
