//! Fuzzing hooks (cargo feature `fuzzing`, hidden from the docs): the record codec and the
//! recovery scan of one segment, over a byte buffer, for the cargo-fuzz targets in `fuzz/`.
//!
//! Owns nothing but thin wrappers: every call goes straight to the code recovery runs
//! (`segment::decode_header`, `recovery::scan_records`, `record::encode_into`). Must never add
//! behaviour of its own or be used by anything but fuzzing.

use std::ops::Range;

use crate::lsn::RecordTag;
use crate::{record, recovery, segment};

/// One valid record the scan found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScannedRecord {
    /// Its log position (base of the segment plus its offset).
    pub lsn: u64,
    /// Its tag.
    pub tag: u16,
    /// Its payload's byte range in the scanned buffer.
    pub payload: Range<usize>,
}

/// What recovery makes of one segment's bytes.
#[derive(Debug)]
pub struct SegmentScan {
    /// The segment header check: the base it records, or why it is refused.
    pub header: Result<u64, String>,
    /// The valid records, in order.
    pub records: Vec<ScannedRecord>,
    /// Offset right after the last valid record (where recovery cuts the file; at least the
    /// header length, even when the buffer is shorter).
    pub end: usize,
    /// Why the record at `end` is invalid, or `None` for a clean end.
    pub invalid: Option<String>,
}

/// Runs recovery's checks over `buf`, the bytes of the segment whose byte 0 has log position
/// `base`: the header check, then the record scan. Never fails; see [`SegmentScan`].
pub fn scan_segment(buf: &[u8], base: u64) -> SegmentScan {
    let header = segment::decode_header(buf);
    let scan = recovery::scan_records(buf, base);
    SegmentScan {
        header,
        records: scan
            .records
            .into_iter()
            .map(|(lsn, tag, payload)| ScannedRecord {
                lsn,
                tag: tag.0,
                payload,
            })
            .collect(),
        end: scan.end,
        invalid: scan.invalid,
    }
}

/// The 32-byte header of the segment starting at `base`.
pub fn segment_header(base: u64) -> [u8; segment::SEGMENT_HEADER_LEN as usize] {
    segment::encode_header(base)
}

/// Appends the encoding of one record at log position `lsn` (a multiple of 8) to `out`, as
/// the log writes it.
pub fn encode_record(out: &mut Vec<u8>, lsn: u64, tag: u16, payload: &[u8]) {
    record::encode_into(
        out,
        lsn,
        RecordTag(tag),
        payload,
        record::payload_crc(payload),
    );
}
