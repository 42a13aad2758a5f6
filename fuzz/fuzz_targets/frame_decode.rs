//! Fuzz target: the frame decoder (`weft_wire::codec`) on a byte stream from a hostile peer,
//! and the reassembly of fragments.
//!
//! Input: one control byte, then the stream. The control byte picks the integrity mode, the
//! limits, how the stream is cut into reads, and whether the harness seals each frame's
//! checksum first (so the mutator reaches the bodies of checksummed frames too).
//!
//! Checked beyond "no panic":
//! - every decoded frame re-encodes to exactly the bytes it was decoded from (the codec accepts
//!   only canonical encodings), and decodes back to an equal frame;
//! - `Ok(None)` consumes nothing; a decoded frame's kind is what `peek_kind` saw;
//! - `decode_exact` agrees with the streaming decoder on a single frame;
//! - reassembly holds at most `max_message` bytes and `max_partial_messages` messages, never
//!   takes more than the shared budget, returns every byte of it when dropped, and a
//!   reassembled frame round-trips too.
#![no_main]

use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use libfuzzer_sys::fuzz_target;
use weft_wire::codec::HEADER_LEN;
use weft_wire::{
    decode_exact, decode_frame_with, encode_frame_with, peek_kind, DecodeError, Frame, Integrity,
    Limits, Reassembler, ReassemblyBudget,
};

fn limits(ctl: u8) -> Limits {
    let (max_frame, max_message) = match ctl & 0b11 {
        0 => (1024, 1024),
        1 => (1024, 8192),
        2 => (4096, 1 << 16),
        _ => (1 << 16, 1 << 20),
    };
    Limits {
        max_frame,
        max_message,
        max_partial_messages: 4,
        reassembly_timeout: Duration::from_secs(30),
    }
}

/// Writes each whole frame's checksum into its header, as an honest encoder would.
fn seal_all(stream: &mut [u8]) {
    let mut at = 0;
    while stream.len() - at >= HEADER_LEN {
        let f = &mut stream[at..];
        let body = u32::from_le_bytes([f[4], f[5], f[6], f[7]]) as usize;
        let Some(total) = HEADER_LEN.checked_add(body).filter(|t| *t <= f.len()) else {
            return;
        };
        let crc = crc32c::crc32c_append(crc32c::crc32c(&f[..8]), &f[HEADER_LEN..total]);
        f[8..12].copy_from_slice(&crc.to_le_bytes());
        at += total;
    }
}

/// The frame re-encodes to exactly `wire` (checksum field aside when trusted) and decodes back
/// to itself.
fn check_round_trip(frame: &Frame, wire: &[u8], integrity: Integrity, limits: &Limits) {
    let mut out = BytesMut::new();
    encode_frame_with(frame, integrity, &mut out).expect("a decoded frame has only bytes payloads");
    match integrity {
        Integrity::Checksummed => assert_eq!(&out[..], wire, "re-encoding differs: {frame:?}"),
        Integrity::Trusted => {
            assert_eq!(
                out.len(),
                wire.len(),
                "re-encoding length differs: {frame:?}"
            );
            assert_eq!(&out[..8], &wire[..8], "header differs: {frame:?}");
            assert_eq!(&out[8..12], &[0u8; 4], "trusted frames carry no checksum");
            assert_eq!(&out[12..], &wire[12..], "body differs: {frame:?}");
        }
    }
    let mut sealed = BytesMut::new();
    encode_frame_with(frame, Integrity::Checksummed, &mut sealed).expect("encodes");
    let big = Limits {
        max_frame: usize::MAX,
        ..*limits
    };
    let back = decode_exact(sealed.freeze(), &big).expect("a re-encoded frame decodes");
    assert_eq!(&back, frame, "decode(encode(frame)) != frame");
}

fuzz_target!(|data: &[u8]| {
    let Some((&ctl, stream)) = data.split_first() else {
        return;
    };
    let limits = limits(ctl);
    let integrity = if ctl & 0b100 != 0 {
        Integrity::Trusted
    } else {
        Integrity::Checksummed
    };
    let mut stream = stream.to_vec();
    if ctl & 0b1000 != 0 {
        seal_all(&mut stream);
    }
    // Reads of 1 to 16 bytes, or everything at once.
    let read = match (ctl >> 4) as usize {
        0 => usize::MAX,
        n => n,
    };

    // The whole input as one frame.
    let exact = decode_exact(Bytes::copy_from_slice(&stream), &limits);
    if let Ok(frame) = &exact {
        check_round_trip(frame, &stream, Integrity::Checksummed, &limits);
    }

    let budget = ReassemblyBudget::new(limits.max_message / 2 + 1);
    let mut reasm = Reassembler::with_budget(limits, budget.clone());
    let now = Instant::now();
    let mut buf = BytesMut::new();
    let mut fed = 0;
    let mut consumed = 0;
    // Frames consumed, bad requests included (they are consumed whole too).
    let mut units = 0usize;
    'link: while fed < stream.len() {
        let n = read.min(stream.len() - fed);
        buf.extend_from_slice(&stream[fed..fed + n]);
        fed += n;
        loop {
            let before = buf.len();
            let peeked = peek_kind(&buf);
            match decode_frame_with(&mut buf, &limits, integrity) {
                Ok(None) => {
                    assert_eq!(buf.len(), before, "Ok(None) consumed bytes");
                    break;
                }
                Ok(Some(frame)) => {
                    let used = before - buf.len();
                    assert!(used >= HEADER_LEN && used <= limits.max_frame);
                    assert_eq!(peeked, Some(frame.kind()));
                    let wire = &stream[consumed..consumed + used];
                    consumed += used;
                    units += 1;
                    check_round_trip(&frame, wire, integrity, &limits);
                    if units == 1
                        && consumed == stream.len()
                        && integrity == Integrity::Checksummed
                    {
                        assert_eq!(exact.as_ref().ok(), Some(&frame), "decode_exact disagrees");
                    }
                    if let Frame::Fragment(f) = frame {
                        match reasm.accept(f, now) {
                            Ok(Some(whole)) => {
                                assert!(!matches!(whole, Frame::Fragment(_)));
                                let mut out = BytesMut::new();
                                encode_frame_with(&whole, Integrity::Checksummed, &mut out)
                                    .expect("encodes");
                                assert!(out.len() <= limits.max_message);
                                check_round_trip(&whole, &out, Integrity::Checksummed, &limits);
                            }
                            Ok(None) => {}
                            Err(_) => break 'link, // the link closes
                        }
                        assert!(reasm.held() <= limits.max_message);
                        assert!(reasm.in_progress() <= limits.max_partial_messages);
                        assert!(budget.in_use() <= budget.cap());
                        assert_eq!(budget.in_use(), reasm.held());
                    }
                }
                // That frame was consumed whole; the link goes on.
                Err(DecodeError::BadRequest { .. }) => {
                    let used = before - buf.len();
                    assert!(used >= HEADER_LEN, "a bad request is consumed whole");
                    consumed += used;
                    units += 1;
                }
                Err(_) => break 'link,
            }
        }
    }
    drop(reasm);
    assert_eq!(budget.in_use(), 0, "reassembly leaked budget");
});
