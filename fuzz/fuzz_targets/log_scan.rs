//! Fuzz target: the log's recovery scan (`weft_log`: segment header check and record scan,
//! the code `Log::open` runs on every segment), on a segment's bytes.
//!
//! Input: a mode byte, then
//! - mode even ("raw"): the bytes of a segment file as found on disk;
//! - mode odd ("damage"): a list of records, built into a segment the way the log writes
//!   it, then one damage (a byte changed, the file cut short, or garbage appended).
//!
//! Checked beyond "no panic":
//! - records are contiguous from the segment header on, aligned, in bounds, each at the LSN
//!   it lies at, and each re-encodes to exactly its bytes on disk;
//! - a clean end has only zeros after it;
//! - recovery is idempotent: scanning the file cut where recovery cuts it gives the same
//!   records and a clean end, and a record appended there is found after them;
//! - damage mode: every record wholly before the damaged byte is recovered intact, nothing
//!   from the damaged record on is (CRC32C catches every one-byte change), and a cut at a
//!   record boundary loses nothing else.
#![no_main]

use arbitrary::{Result, Unstructured};
use libfuzzer_sys::fuzz_target;
use weft_log::fuzzing::{encode_record, scan_segment, segment_header, SegmentScan};

const HEADER: usize = 32;
const RECORD_HEADER: usize = 24;

/// Checks what a scan of `buf` found; returns it.
fn check_scan(buf: &[u8], base: u64) -> SegmentScan {
    let scan = scan_segment(buf, base);
    let mut at = HEADER;
    for r in &scan.records {
        assert_eq!(
            r.lsn,
            base + at as u64,
            "record not where the previous one ended"
        );
        assert_eq!(r.payload.start, at + RECORD_HEADER);
        assert!(r.payload.end <= buf.len());
        let next = (r.payload.end).div_ceil(8) * 8;
        assert!(next <= buf.len());
        let mut again = Vec::new();
        encode_record(&mut again, r.lsn, r.tag, &buf[r.payload.clone()]);
        assert_eq!(
            &again[..],
            &buf[at..next],
            "record does not re-encode to its bytes"
        );
        at = next;
    }
    assert_eq!(scan.end, at, "scan end is not after the last record");
    if scan.invalid.is_none() && at < buf.len() {
        assert!(
            buf[at..].iter().all(|&b| b == 0),
            "clean end before non-zero bytes"
        );
    }
    scan
}

/// The scan of the cut file agrees, and the log can continue there.
fn check_cut(buf: &[u8], base: u64, scan: &SegmentScan) {
    if buf.len() < HEADER {
        return;
    }
    let cut = &buf[..scan.end.min(buf.len())];
    let again = check_scan(cut, base);
    assert_eq!(
        again.records, scan.records,
        "a second recovery found other records"
    );
    assert!(
        again.invalid.is_none(),
        "the cut file is not clean: {:?}",
        again.invalid
    );
    assert_eq!(again.end, scan.end);
    let mut more = cut.to_vec();
    let at = base + more.len() as u64;
    encode_record(&mut more, at, 7, b"after the cut");
    let after = check_scan(&more, base);
    assert_eq!(
        after.records.len(),
        scan.records.len() + 1,
        "the appended record is lost"
    );
    assert!(after.invalid.is_none());
}

fn raw(buf: &[u8]) {
    // Scan at the base the header claims, as recovery does for a file of that name (recovery
    // refuses files at or past 2^62 before scanning them).
    let base = buf
        .get(16..24)
        .map_or(0, |b| u64::from_le_bytes(b.try_into().unwrap()))
        % (1 << 62);
    let scan = check_scan(buf, base);
    if let Ok(b) = scan.header {
        assert_eq!(b % (1 << 62), base);
    }
    if base % 8 == 0 {
        check_cut(buf, base, &scan);
    }
}

fn damage(u: &mut Unstructured) -> Result<()> {
    let base = u.int_in_range(0..=1u64 << 40)? * 8;
    let mut buf = segment_header(base).to_vec();
    let mut ends = Vec::new(); // (start, end) of every record written
    let count = u.int_in_range(0..=12)?;
    for _ in 0..count {
        let tag: u16 = u.arbitrary()?;
        let len = u.int_in_range(0..=200)?;
        let payload = u.bytes(len)?;
        let start = buf.len();
        encode_record(&mut buf, base + start as u64, tag, payload);
        ends.push((start, buf.len(), tag, payload.to_vec()));
    }
    let tail_zeros = u.int_in_range(0..=64)?;
    buf.resize(buf.len() + tail_zeros, 0);
    let written = buf.len();
    let clean = check_scan(&buf, base);
    assert_eq!(clean.header, Ok(base));
    assert!(
        clean.invalid.is_none(),
        "an honest segment is invalid: {:?}",
        clean.invalid
    );
    assert_eq!(clean.records.len(), ends.len());
    for (r, (start, _, tag, payload)) in clean.records.iter().zip(&ends) {
        assert_eq!(r.lsn, base + *start as u64);
        assert_eq!(r.tag, *tag);
        assert_eq!(&buf[r.payload.clone()], &payload[..]);
    }

    // First byte changed: everything wholly before it survives, nothing at or after does.
    let mut appended = false;
    let first_bad = match u.int_in_range(0..=2)? {
        0 if written > HEADER => {
            let i = u.int_in_range(HEADER..=written - 1)?;
            let x = u.int_in_range(1..=255u8)?;
            buf[i] ^= x;
            Some(i)
        }
        1 => {
            let cut = u.int_in_range(HEADER..=written)?;
            buf.truncate(cut);
            None
        }
        _ => {
            let n = u.int_in_range(1..=64)?;
            buf.extend_from_slice(u.bytes(n)?);
            appended = true;
            None
        }
    };
    let scan = check_scan(&buf, base);
    check_cut(&buf, base, &scan);
    let survivors = ends
        .iter()
        .take_while(|(_, end, _, _)| *end <= buf.len() && first_bad.is_none_or(|b| *end <= b))
        .count();
    assert_eq!(
        &scan.records[..survivors.min(scan.records.len())],
        &clean.records[..survivors.min(scan.records.len())]
    );
    if appended {
        // Appended bytes are new records only if they happen to be valid ones.
        assert!(scan.records.len() >= survivors, "appending lost records");
    } else {
        assert_eq!(
            scan.records.len(),
            survivors,
            "records lost or damage accepted"
        );
    }
    if let Some(b) = first_bad {
        let in_a_record = ends.iter().any(|(s, e, _, _)| (*s..*e).contains(&b));
        if in_a_record {
            assert!(scan.invalid.is_some(), "a damaged record was not noticed");
        }
    }
    Ok(())
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    if mode % 2 == 0 {
        raw(rest);
    } else {
        let _ = damage(&mut Unstructured::new(rest));
    }
});
