//! The record codec: how one log record is laid out in bytes, and how it is checked on the way
//! back in.
//!
//! Owns: the record header layout, its checksum, alignment and the validation rules recovery
//! applies (magic, flags, length bounds, checksum, LSN equals position, zero padding).
//! Must never: do I/O, allocate per record on the decode path, or accept a record whose
//! checksum or position does not match. See `FORMAT.md` for the byte layout.
//!
//! Layout (little-endian), 24-byte header followed by the payload and zero padding up to the
//! next multiple of 8:
//!
//! | offset | size | field                                                    |
//! |-------:|-----:|----------------------------------------------------------|
//! | 0      | 4    | magic `b"WREC"`                                          |
//! | 4      | 4    | payload length `len` (u32)                               |
//! | 8      | 4    | CRC32C (see below)                                       |
//! | 12     | 2    | tag (u16, opaque to the log)                             |
//! | 14     | 2    | flags (u16, must be 0 in version 1)                      |
//! | 16     | 8    | lsn (u64): the record's own position in the log stream   |
//! | 24     | len  | payload                                                  |
//!
//! The CRC32C is computed over the payload first, then header bytes 0..8 and 12..24 (every
//! header field except the CRC itself). Hashing the payload first lets `append` checksum a
//! large payload before it takes the log's lock; only the 20 header bytes, which contain the
//! LSN, are hashed under the lock.

use std::ops::Range;

use crate::lsn::RecordTag;

/// Bytes in a record header.
pub(crate) const RECORD_HEADER_LEN: usize = 24;
/// Records start at, and are padded to, multiples of this many bytes.
pub(crate) const RECORD_ALIGN: usize = 8;
/// The four bytes every record starts with.
pub(crate) const RECORD_MAGIC: [u8; 4] = *b"WREC";
/// Hard format limit on a payload (1 GiB), independent of configuration, so recovery can
/// reject absurd lengths even if `max_record_size` changed between runs.
pub(crate) const MAX_PAYLOAD_LIMIT: usize = 1 << 30;

/// Bytes a record with a payload of `payload_len` bytes occupies on disk, header and padding
/// included.
pub(crate) const fn encoded_len(payload_len: usize) -> usize {
    (RECORD_HEADER_LEN + payload_len).div_ceil(RECORD_ALIGN) * RECORD_ALIGN
}

/// The part of a record's checksum that depends on the payload only. `append` computes it
/// before taking the log's lock.
pub(crate) fn payload_crc(payload: &[u8]) -> u32 {
    crc32c::crc32c(payload)
}

/// Finishes a record checksum: the payload's CRC extended with the checksummed header bytes.
fn finish_crc(payload_crc: u32, header: &[u8; RECORD_HEADER_LEN]) -> u32 {
    let crc = crc32c::crc32c_append(payload_crc, &header[0..8]);
    crc32c::crc32c_append(crc, &header[12..24])
}

/// Appends the encoding of one record to `out`.
///
/// `payload_crc` must be `payload_crc(payload)`; `lsn` must be the position the first header
/// byte will occupy in the log stream.
pub(crate) fn encode_into(
    out: &mut Vec<u8>,
    lsn: u64,
    tag: RecordTag,
    payload: &[u8],
    payload_crc: u32,
) {
    debug_assert!(
        payload.len() <= MAX_PAYLOAD_LIMIT,
        "payload over format limit"
    );
    debug_assert_eq!(lsn % RECORD_ALIGN as u64, 0, "record LSN must be aligned");
    debug_assert_eq!(payload_crc, self::payload_crc(payload), "stale payload CRC");
    let len = u32::try_from(payload.len()).expect("payload length checked against the limit");
    let mut header = [0u8; RECORD_HEADER_LEN];
    header[0..4].copy_from_slice(&RECORD_MAGIC);
    header[4..8].copy_from_slice(&len.to_le_bytes());
    header[12..14].copy_from_slice(&tag.0.to_le_bytes());
    // bytes 14..16: flags, zero in version 1.
    header[16..24].copy_from_slice(&lsn.to_le_bytes());
    let crc = finish_crc(payload_crc, &header);
    header[8..12].copy_from_slice(&crc.to_le_bytes());

    let start = out.len();
    let total = encoded_len(payload.len());
    out.reserve(total);
    out.extend_from_slice(&header);
    out.extend_from_slice(payload);
    out.resize(start + total, 0);
    debug_assert!(
        matches!(decode_at(&out[start..], 0, lsn), Decoded::Record { next, .. } if next == total),
        "a record must decode right after it was encoded"
    );
}

/// What [`decode_at`] found at a position.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Decoded {
    /// A valid record. `payload` is its byte range in the buffer; `next` is where the next
    /// record would start.
    Record {
        tag: RecordTag,
        payload: Range<usize>,
        next: usize,
    },
    /// No record here, and every byte from here to the end of the buffer is zero: the clean
    /// end of the written log (a preallocated or never-written region).
    End,
    /// Bytes that are not a valid record at this position: a torn write, a corrupt record, or
    /// garbage. The reason says which check failed.
    Invalid(String),
}

/// Decodes and validates the record that should start at `pos` in `buf`, whose first byte has
/// log position `lsn`.
///
/// Never panics, whatever the bytes: every length is bounds-checked before use.
pub(crate) fn decode_at(buf: &[u8], pos: usize, lsn: u64) -> Decoded {
    let rest = buf.get(pos..).unwrap_or(&[]);
    if rest.len() < RECORD_HEADER_LEN {
        return if all_zero(rest) {
            Decoded::End
        } else {
            Decoded::Invalid(format!(
                "torn record header: only {} bytes before the end of the segment",
                rest.len()
            ))
        };
    }
    let header: &[u8; RECORD_HEADER_LEN] = rest[..RECORD_HEADER_LEN]
        .try_into()
        .expect("length checked above");
    if header[0..4] != RECORD_MAGIC {
        return if all_zero(rest) {
            Decoded::End
        } else {
            Decoded::Invalid(format!("bad record magic {:02x?}", &header[0..4]))
        };
    }
    let len = u32::from_le_bytes(header[4..8].try_into().expect("4 bytes")) as usize;
    let stored_crc = u32::from_le_bytes(header[8..12].try_into().expect("4 bytes"));
    let tag = RecordTag(u16::from_le_bytes(
        header[12..14].try_into().expect("2 bytes"),
    ));
    let flags = u16::from_le_bytes(header[14..16].try_into().expect("2 bytes"));
    let stored_lsn = u64::from_le_bytes(header[16..24].try_into().expect("8 bytes"));

    if len > MAX_PAYLOAD_LIMIT {
        return Decoded::Invalid(format!("record length {len} exceeds the format limit"));
    }
    let total = encoded_len(len);
    if total > rest.len() {
        return Decoded::Invalid(format!(
            "torn record: {total} bytes announced, {} bytes left in the segment",
            rest.len()
        ));
    }
    let payload = &rest[RECORD_HEADER_LEN..RECORD_HEADER_LEN + len];
    let crc = finish_crc(payload_crc(payload), header);
    if crc != stored_crc {
        return Decoded::Invalid(format!(
            "checksum mismatch: stored {stored_crc:#010x}, computed {crc:#010x}"
        ));
    }
    if stored_lsn != lsn {
        return Decoded::Invalid(format!(
            "record claims lsn:{stored_lsn} but lies at lsn:{lsn}"
        ));
    }
    if flags != 0 {
        return Decoded::Invalid(format!("unknown record flags {flags:#06x}"));
    }
    if !all_zero(&rest[RECORD_HEADER_LEN + len..total]) {
        return Decoded::Invalid("non-zero record padding".to_string());
    }
    let start = pos + RECORD_HEADER_LEN;
    Decoded::Record {
        tag,
        payload: start..start + len,
        next: pos + total,
    }
}

/// True when every byte is zero.
pub(crate) fn all_zero(bytes: &[u8]) -> bool {
    // Compare in 8-byte words; this runs over the whole preallocated tail of a segment.
    let (words, tail) = bytes.split_at(bytes.len() - bytes.len() % 8);
    words
        .chunks_exact(8)
        .all(|w| u64::from_ne_bytes(w.try_into().expect("8 bytes")) == 0)
        && tail.iter().all(|&b| b == 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn encode(lsn: u64, tag: u16, payload: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        encode_into(&mut out, lsn, RecordTag(tag), payload, payload_crc(payload));
        out
    }

    #[test]
    fn round_trip_and_alignment() {
        for len in [0usize, 1, 7, 8, 9, 100, 4096] {
            let payload: Vec<u8> = (0..len).map(|i| (i * 31 + 7) as u8).collect();
            let buf = encode(64, 9, &payload);
            assert_eq!(buf.len(), encoded_len(len));
            assert_eq!(buf.len() % RECORD_ALIGN, 0);
            match decode_at(&buf, 0, 64) {
                Decoded::Record {
                    tag,
                    payload: r,
                    next,
                } => {
                    assert_eq!(tag, RecordTag(9));
                    assert_eq!(&buf[r], &payload[..]);
                    assert_eq!(next, buf.len());
                }
                other => panic!("len {len}: {other:?}"),
            }
        }
    }

    #[test]
    fn zeros_are_a_clean_end_and_garbage_is_not() {
        assert_eq!(decode_at(&[0u8; 100], 0, 32), Decoded::End);
        assert_eq!(decode_at(&[0u8; 10], 0, 32), Decoded::End);
        assert_eq!(decode_at(&[], 0, 32), Decoded::End);
        let mut junk = vec![0u8; 100];
        junk[77] = 1;
        assert!(matches!(decode_at(&junk, 0, 32), Decoded::Invalid(_)));
        assert!(matches!(decode_at(&[1, 2, 3], 0, 32), Decoded::Invalid(_)));
    }

    #[test]
    fn every_single_byte_flip_is_detected() {
        let buf = encode(96, 3, b"hello, log");
        for i in 0..buf.len() {
            for bit in 0..8 {
                let mut bad = buf.clone();
                bad[i] ^= 1 << bit;
                assert!(
                    matches!(decode_at(&bad, 0, 96), Decoded::Invalid(_)),
                    "flip of byte {i} bit {bit} went unnoticed"
                );
            }
        }
    }

    #[test]
    fn a_record_at_the_wrong_place_is_rejected() {
        let buf = encode(96, 3, b"x");
        match decode_at(&buf, 0, 104) {
            Decoded::Invalid(reason) => assert!(reason.contains("lsn"), "{reason}"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn every_truncation_is_detected() {
        let buf = encode(32, 1, &[0xAB; 50]);
        for cut in 1..buf.len() {
            assert!(
                matches!(decode_at(&buf[..cut], 0, 32), Decoded::Invalid(_)),
                "cut at {cut}"
            );
        }
    }
}
