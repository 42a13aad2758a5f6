//! Recovery: reading the log back at open, and cutting off a torn or corrupt tail.
//!
//! Owns: the scan from the oldest retained segment to the first invalid record, the physical
//! removal of everything after that point (file truncation, later segments deleted), and the
//! [`Recovered`] report. Must never: hand back a record that failed validation, replay anything
//! past the first invalid record, or leave stale bytes after the cut where a later append could
//! be followed by them.

use std::fmt;
use std::ops::Range;
use std::path::Path;

use bytes::Bytes;

use crate::config::LogConfig;
use crate::dir::{self, sync_dir};
use crate::durable::Durability;
use crate::error::{LogError, Result};
use crate::lsn::{Lsn, RecordTag};
use crate::meta;
use crate::record::{self, Decoded};
use crate::segment::{self, SEGMENT_HEADER_LEN};

/// One record read back from the log.
#[derive(Clone, PartialEq, Eq)]
pub struct LogRecord {
    /// Where the record lies in the log stream.
    pub lsn: Lsn,
    /// The tag it was appended with.
    pub tag: RecordTag,
    /// Its payload (a zero-copy slice of the segment read at recovery).
    pub payload: Bytes,
}

/// What [`Log::open`](crate::Log::open) found on disk: the valid records, in log order, and a
/// report of anything cut off.
///
/// Records are held in memory; the log's checkpoints (`truncate_before`) keep the retained log,
/// and hence this, bounded.
#[derive(Clone, Default)]
pub struct Recovered {
    /// Every valid record at or after `first_lsn`, in LSN order.
    pub records: Vec<LogRecord>,
    /// The log start recorded by the last `truncate_before` (or the oldest segment's start).
    pub first_lsn: Lsn,
    /// The position right after the last valid record: the log continues from here.
    pub end_lsn: Lsn,
    /// Bytes cut off the tail: from the cut point to the last non-zero byte of that segment,
    /// plus the whole size of every later segment file removed. Zero after a clean shutdown.
    pub truncated_bytes: u64,
    /// Why the tail was cut (which check the first invalid record failed, and where), or
    /// `None` if the log ended cleanly.
    pub tail_error: Option<String>,
    /// Segment files removed because they lay after the cut.
    pub segments_removed: usize,
}

impl fmt::Debug for LogRecord {
    /// Shows the payload's length and first bytes only, so test failures stay readable.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const SHOWN: usize = 16;
        let head = &self.payload[..self.payload.len().min(SHOWN)];
        f.debug_struct("LogRecord")
            .field("lsn", &self.lsn)
            .field("tag", &self.tag)
            .field("len", &self.payload.len())
            .field(
                "head",
                &format_args!(
                    "{head:02x?}{}",
                    if self.payload.len() > SHOWN {
                        "…"
                    } else {
                        ""
                    }
                ),
            )
            .finish()
    }
}

impl fmt::Debug for Recovered {
    /// Summarizes the records (count and LSN range) instead of listing them.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Recovered")
            .field("records", &self.records.len())
            .field("first_record", &self.records.first().map(|r| r.lsn))
            .field("last_record", &self.last_lsn())
            .field("first_lsn", &self.first_lsn)
            .field("end_lsn", &self.end_lsn)
            .field("truncated_bytes", &self.truncated_bytes)
            .field("tail_error", &self.tail_error)
            .field("segments_removed", &self.segments_removed)
            .finish()
    }
}

impl Recovered {
    /// The records at or after `lsn`, in order. Never fails; empty if `lsn` is past the end.
    pub fn records_from(&self, lsn: Lsn) -> impl Iterator<Item = &LogRecord> + '_ {
        let start = self.records.partition_point(|r| r.lsn < lsn);
        self.records[start..].iter()
    }

    /// The LSN of the last recovered record, or `None` if none was recovered.
    #[must_use]
    pub fn last_lsn(&self) -> Option<Lsn> {
        self.records.last().map(|r| r.lsn)
    }

    /// True when the log had to cut off a torn or corrupt tail.
    #[must_use]
    pub fn was_cut(&self) -> bool {
        self.tail_error.is_some()
    }
}

impl IntoIterator for Recovered {
    type Item = LogRecord;
    type IntoIter = std::vec::IntoIter<LogRecord>;

    fn into_iter(self) -> Self::IntoIter {
        self.records.into_iter()
    }
}

/// Everything `Log::open` needs to continue where the log left off.
#[derive(Debug)]
pub(crate) struct Recovery {
    /// The report for the caller.
    pub recovered: Recovered,
    /// Bases of the retained segments, oldest first; the last one is the active segment.
    pub segments: Vec<u64>,
    /// Offset inside the active segment where the next record goes.
    pub active_end: u64,
    /// LSN of the last valid record in the retained segments (also those below the start),
    /// or 0 if there is none.
    pub last_lsn: u64,
}

/// Segments start below this position (2^62 bytes: centuries of logging at disk speed), so
/// `base + offset` never overflows for any file recovery reads or any append after it.
pub(crate) const MAX_SEGMENT_BASE: u64 = 1 << 62;

/// Runs recovery on `config.dir`: validates every record from the oldest retained segment on,
/// cuts the log at the first invalid one, makes what remains durable, and creates the first
/// segment of a fresh log.
///
/// Returns [`LogError::Corrupt`] when continuing would silently lose records the log must have
/// (the segment holding the start is missing or has a bad header, or a segment file between
/// two others is missing), [`LogError::Io`] when the directory cannot be read or repaired.
pub(crate) fn recover(config: &LogConfig) -> Result<Recovery> {
    let dir = config.dir.as_path();
    let dur = &config.durability;
    let meta_start = meta::read(dur, dir)?;
    let bases = dir::scan(dur, dir)?;
    if let Some(&base) = bases.iter().find(|&&b| b >= MAX_SEGMENT_BASE) {
        // Positions are byte offsets of the log stream: no log reaches 2^62 bytes, so such a
        // file is not one of this log's, and its positions could overflow.
        return Err(LogError::Corrupt {
            lsn: Lsn(base),
            reason: format!(
                "segment {} starts past the largest log position ({})",
                segment::file_name(base),
                Lsn(MAX_SEGMENT_BASE)
            ),
        });
    }

    let Some(&oldest) = bases.first() else {
        if let Some(start) = meta_start.filter(|&s| s > 0) {
            return Err(LogError::Corrupt {
                lsn: Lsn(start),
                reason: "log.meta records a start but no segment file exists".to_string(),
            });
        }
        segment::create(dur, dir, 0, config.segment_size, config.preallocate)?;
        return Ok(Recovery {
            recovered: Recovered {
                end_lsn: Lsn(SEGMENT_HEADER_LEN),
                ..Recovered::default()
            },
            segments: vec![0],
            active_end: SEGMENT_HEADER_LEN,
            last_lsn: 0,
        });
    };

    // Without log.meta the log was never truncated (truncate_before writes the meta file
    // before it deletes anything), so it must still start at position 0.
    let start = meta_start.unwrap_or(0);
    let first = match bases.partition_point(|&b| b <= start) {
        0 => {
            return Err(LogError::Corrupt {
                lsn: Lsn(start),
                reason: format!("the oldest segment starts later, at {}", Lsn(oldest)),
            })
        }
        n => n - 1,
    };
    remove_stale(dur, dir, &bases[..first])?;

    let mut out = Recovery {
        recovered: Recovered {
            first_lsn: Lsn(start),
            ..Recovered::default()
        },
        segments: Vec::new(),
        active_end: SEGMENT_HEADER_LEN,
        last_lsn: 0,
    };
    let mut prev_end: Option<u64> = None;
    let mut removed_any = false;
    for &base in &bases[first..] {
        if out.recovered.tail_error.is_some() {
            remove_after_cut(dur, dir, base, &mut out.recovered)?;
            removed_any = true;
            continue;
        }
        match scan_segment(dur, dir, base, prev_end, start, &mut out)? {
            SegmentScan::Kept { end } => {
                out.segments.push(base);
                out.active_end = end;
                prev_end = Some(base + end);
            }
            SegmentScan::Rejected(reason) if prev_end.is_some() => {
                out.recovered.tail_error = Some(reason);
                remove_after_cut(dur, dir, base, &mut out.recovered)?;
                removed_any = true;
            }
            SegmentScan::Rejected(reason) => {
                // The segment that holds the log start has an unusable header. If it holds no
                // record bytes either, nothing is lost: start it afresh. Otherwise every record
                // of the log would be dropped; refuse rather than start over empty.
                let Some(garbage) = headerless_garbage(dur, dir, base)? else {
                    return Err(LogError::Corrupt {
                        lsn: Lsn(base),
                        reason,
                    });
                };
                segment::create(dur, dir, base, config.segment_size, config.preallocate)?;
                out.recovered.tail_error = Some(format!("{reason}; segment recreated empty"));
                out.recovered.truncated_bytes += garbage;
                out.segments.push(base);
                out.active_end = SEGMENT_HEADER_LEN;
                prev_end = Some(base + SEGMENT_HEADER_LEN);
            }
        }
    }
    if removed_any {
        sync_dir(dur, dir)?;
    }

    let end = prev_end.expect("the first retained segment is kept or recovery failed");
    out.recovered.end_lsn = Lsn(end);
    if start > end {
        // The cut went below the checkpointed start: those records are gone, so the log now
        // starts where it ends, and new records (from `end` on) must be replayed next time.
        tracing::warn!(start, end, "log tail cut below the recorded log start");
        meta::write(dur, dir, end)?;
        out.recovered.first_lsn = Lsn(end);
    }
    if let Some(reason) = &out.recovered.tail_error {
        tracing::warn!(
            reason,
            truncated_bytes = out.recovered.truncated_bytes,
            segments_removed = out.recovered.segments_removed,
            "log tail cut during recovery"
        );
    }
    debug_assert!(out
        .recovered
        .records
        .windows(2)
        .all(|w| w[0].lsn < w[1].lsn));
    Ok(out)
}

/// Outcome of scanning one segment.
enum SegmentScan {
    /// The segment stays; `end` is the offset after its last valid record.
    Kept { end: u64 },
    /// The segment's header is unusable or it does not continue the previous one.
    Rejected(String),
}

/// Reads and validates one segment, appending its records at or after `start` to
/// `out.recovered.records`. If an invalid record is found, cuts the file there (truncate and
/// fsync) and records the reason in `out.recovered.tail_error`.
fn scan_segment(
    dur: &Durability,
    dir: &Path,
    base: u64,
    prev_end: Option<u64>,
    start: u64,
    out: &mut Recovery,
) -> Result<SegmentScan> {
    let name = segment::file_name(base);
    let file = segment::open(dur, dir, base)?;
    let mut buf = file
        .read_all()
        .map_err(|e| LogError::io(format!("reading segment {name}"), e))?;

    match segment::decode_header(&buf) {
        Err(reason) => return Ok(SegmentScan::Rejected(format!("segment {name}: {reason}"))),
        Ok(b) if b != base => {
            return Ok(SegmentScan::Rejected(format!(
                "segment {name}: header says it starts at {}",
                Lsn(b)
            )))
        }
        Ok(_) => {}
    }
    if let Some(pe) = prev_end.filter(|&pe| pe < base) {
        // A hole: the records in [pe, base) are in no file. Segments are created only after
        // the previous one is synced and their entries are synced, so no crash leaves a hole;
        // a segment file went missing (or the previous one lost its tail). Cutting here would
        // delete this and every later segment, durable records included: refuse instead.
        return Err(LogError::Corrupt {
            lsn: Lsn(pe),
            reason: format!(
                "no segment holds {}..{}: the previous segment ends at {} but the next file \
                 is {name}; refusing to delete it and the segments after it",
                Lsn(pe),
                Lsn(base),
                Lsn(pe)
            ),
        });
    }
    if let Some(pe) = prev_end.filter(|&pe| pe != base) {
        return Ok(SegmentScan::Rejected(format!(
            "segment {name} starts at {} but the previous segment ends at {}",
            Lsn(base),
            Lsn(pe)
        )));
    }

    let Scan {
        records: found,
        end: pos,
        invalid,
    } = scan_records(&buf, base);

    if let Some(reason) = invalid {
        let garbage_end = buf[pos..]
            .iter()
            .rposition(|&b| b != 0)
            .map_or(pos, |i| pos + i + 1);
        out.recovered.truncated_bytes += (garbage_end - pos) as u64;
        out.recovered.tail_error = Some(format!("{}: {reason}", Lsn(base + pos as u64)));
        // Cut physically: bytes after the cut must never be read again, or a later append that
        // ends where an old record began would make that record valid again.
        file.set_len(pos as u64)
            .and_then(|()| file.sync_all())
            .map_err(|e| LogError::io(format!("cutting segment {name} at offset {pos}"), e))?;
    } else {
        // The records may so far live only in the page cache (the process, not the machine,
        // crashed). Make them durable before anyone acts on them.
        file.sync_data()
            .map_err(|e| LogError::io(format!("syncing recovered segment {name}"), e))?;
    }

    buf.truncate(pos);
    buf.shrink_to_fit();
    let bytes = Bytes::from(buf);
    for (lsn, tag, range) in found {
        out.last_lsn = lsn;
        if lsn >= start {
            out.recovered.records.push(LogRecord {
                lsn: Lsn(lsn),
                tag,
                payload: bytes.slice(range),
            });
        }
    }
    Ok(SegmentScan::Kept { end: pos as u64 })
}

/// What [`scan_records`] found in one segment's bytes.
#[derive(Debug)]
pub(crate) struct Scan {
    /// Every valid record, in order: its LSN, tag and payload range in the buffer.
    pub(crate) records: Vec<(u64, RecordTag, Range<usize>)>,
    /// Offset right after the last valid record: where the segment is cut.
    pub(crate) end: usize,
    /// Why the record at `end` is invalid, or `None` when the segment ends cleanly there.
    pub(crate) invalid: Option<String>,
}

/// Validates the records of a segment read into `buf` (header included, not checked here),
/// whose byte 0 has log position `base`, up to the first invalid record or the clean end.
/// Pure: recovery cuts the file at `end`. Never panics, whatever the bytes, for a `base`
/// below [`MAX_SEGMENT_BASE`] (recovery refuses any other) and a buffer shorter than 2^62.
pub(crate) fn scan_records(buf: &[u8], base: u64) -> Scan {
    debug_assert!(
        base < MAX_SEGMENT_BASE,
        "segment base {base} past the limit"
    );
    let mut pos = SEGMENT_HEADER_LEN as usize;
    let mut records = Vec::new();
    let mut invalid = None;
    loop {
        match record::decode_at(buf, pos, base + pos as u64) {
            Decoded::Record { tag, payload, next } => {
                records.push((base + pos as u64, tag, payload));
                pos = next;
            }
            Decoded::End => break,
            Decoded::Invalid(reason) => {
                invalid = Some(reason);
                break;
            }
        }
    }
    Scan {
        records,
        end: pos,
        invalid,
    }
}

/// For a segment whose header is unusable: `Some(non-zero bytes in the header region)` if no
/// byte after the header region is non-zero (the segment holds no records), else `None`.
fn headerless_garbage(dur: &Durability, dir: &Path, base: u64) -> Result<Option<u64>> {
    let p = segment::path(dir, base);
    let bytes = dur
        .read(&p)
        .map_err(|e| LogError::io(format!("reading {}", p.display()), e))?;
    let split = bytes.len().min(SEGMENT_HEADER_LEN as usize);
    if !record::all_zero(&bytes[split..]) {
        return Ok(None);
    }
    Ok(Some(
        bytes[..split]
            .iter()
            .rposition(|&b| b != 0)
            .map_or(0, |i| i as u64 + 1),
    ))
}

/// Removes a segment that lies after the cut, counting its size as truncated.
fn remove_after_cut(dur: &Durability, dir: &Path, base: u64, rec: &mut Recovered) -> Result<()> {
    let p = segment::path(dir, base);
    let len = dur
        .open(&p)
        .and_then(|f| f.len())
        .map_err(|e| LogError::io(format!("inspecting {}", p.display()), e))?;
    dur.remove_file(&p)
        .map_err(|e| LogError::io(format!("removing {}", p.display()), e))?;
    rec.truncated_bytes += len;
    rec.segments_removed += 1;
    Ok(())
}

/// Removes segments wholly below the log start (left over when a crash interrupted
/// `truncate_before` after it wrote `log.meta`).
fn remove_stale(dur: &Durability, dir: &Path, bases: &[u64]) -> Result<()> {
    for &base in bases {
        let p = segment::path(dir, base);
        dur.remove_file(&p)
            .map_err(|e| LogError::io(format!("removing {}", p.display()), e))?;
        tracing::info!(segment = %p.display(), "removed segment below the log start");
    }
    if !bases.is_empty() {
        sync_dir(dur, dir)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Found by the `log_scan` fuzz target: a segment whose base lies near the top of the
    /// LSN range (a file named `ffffffffffffffe0.wlog` with a matching header, and a
    /// `log.meta` starting there) made the scan's `base + offset` overflow: a panic in debug
    /// builds, wrapped LSNs in release. Such a directory is refused as corrupt.
    #[test]
    fn a_segment_near_the_top_of_the_lsn_range_is_refused_not_a_panic() {
        for base in [u64::MAX - 31, u64::MAX - 0xfff, MAX_SEGMENT_BASE] {
            let base = base & !7;
            let tmp = tempfile::tempdir().unwrap();
            let mut config = LogConfig::new(tmp.path());
            config.segment_size = 4096;
            let dur = config.durability.clone();
            segment::create(&dur, tmp.path(), base, 4096, true).unwrap();
            meta::write(&dur, tmp.path(), base).unwrap();
            match recover(&config) {
                Err(LogError::Corrupt { lsn, reason }) => {
                    assert_eq!(lsn, Lsn(base));
                    assert!(reason.contains("largest"), "{reason}");
                }
                other => panic!("base {base:#x}: {other:?}"),
            }
        }
        // Just below the limit is an ordinary (empty) log.
        let tmp = tempfile::tempdir().unwrap();
        let mut config = LogConfig::new(tmp.path());
        config.segment_size = 4096;
        let base = MAX_SEGMENT_BASE - 4096;
        segment::create(&config.durability, tmp.path(), base, 4096, true).unwrap();
        meta::write(&config.durability, tmp.path(), base).unwrap();
        let r = recover(&config).unwrap();
        assert_eq!(r.recovered.end_lsn, Lsn(base + SEGMENT_HEADER_LEN));
    }
}
