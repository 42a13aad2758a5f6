//! Recovery from a torn or corrupt tail: the log is cut at the first invalid record, the cut
//! is reported, nothing after it is ever replayed, and appends continue from the cut.

mod common;

use common::*;
use rand::{Rng, SeedableRng};
use weft_log::{encoded_len, LogError, Lsn, RecordTag, RECORD_HEADER_LEN};

/// Writes 40 records (several segments), forces and closes; returns them.
fn write_and_close(config: &weft_log::LogConfig) -> Vec<(Lsn, RecordTag, Vec<u8>)> {
    let (log, _) = open(config.clone());
    let written = append_many(&log, 0, 40);
    log.force_blocking(written.last().unwrap().0).unwrap();
    log.close().unwrap();
    written
}

/// After a cut at the last record: new appends take its place, and everything survives
/// another reopen with no error.
fn appends_continue_after_cut(
    config: &weft_log::LogConfig,
    kept: &[(Lsn, RecordTag, Vec<u8>)],
    cut_lsn: Lsn,
) {
    let (log, _) = open(config.clone());
    let fresh = append_many(&log, 1000, 5);
    assert_eq!(
        fresh[0].0, cut_lsn,
        "the first new record takes the cut record's place"
    );
    log.force_blocking(fresh.last().unwrap().0).unwrap();
    log.close().unwrap();
    drop(log);
    let (_log, rec) = open(config.clone());
    assert_eq!(rec.tail_error, None);
    let all: Vec<_> = kept.iter().chain(&fresh).cloned().collect();
    assert_records(&rec.records, &all);
}

#[test]
fn file_truncated_mid_record_recovers_up_to_the_last_whole_record() {
    for preallocate in [true, false] {
        for cut_into in [
            1u64,
            10,
            RECORD_HEADER_LEN as u64,
            RECORD_HEADER_LEN as u64 + 5,
        ] {
            let dir = tempfile::tempdir().unwrap();
            let config = tiny(dir.path()).preallocate(preallocate);
            let written = write_and_close(&config);
            let (last_lsn, _, last_payload) = written.last().unwrap().clone();
            assert!(last_payload.len() as u64 + RECORD_HEADER_LEN as u64 > cut_into);
            let (path, offset) = locate(dir.path(), last_lsn);
            truncate_file(&path, offset + cut_into);

            let (log, rec) = open(config.clone());
            let kept = &written[..written.len() - 1];
            assert_records(&rec.records, kept);
            let reason = rec.tail_error.clone().expect("the cut must be reported");
            assert!(reason.contains(&last_lsn.to_string()), "{reason}");
            // Counted up to the last non-zero byte of the torn record.
            assert!(
                rec.truncated_bytes > 0 && rec.truncated_bytes <= cut_into,
                "preallocate={preallocate} cut_into={cut_into}: {}",
                rec.truncated_bytes
            );
            assert_eq!(rec.end_lsn, last_lsn);
            drop(log);
            appends_continue_after_cut(&config, kept, last_lsn);
        }
    }
}

#[test]
fn flipped_byte_in_the_last_record_recovers_up_to_the_record_before() {
    for preallocate in [true, false] {
        // Flip a header byte (the length) and, separately, a payload byte.
        for (what, at) in [("length", 5u64), ("payload", RECORD_HEADER_LEN as u64 + 3)] {
            let dir = tempfile::tempdir().unwrap();
            let config = tiny(dir.path()).preallocate(preallocate);
            let written = write_and_close(&config);
            let (last_lsn, _, last_payload) = written.last().unwrap().clone();
            let (path, offset) = locate(dir.path(), last_lsn);
            flip_byte(&path, offset + at, 0x40);

            let (log, rec) = open(config.clone());
            let kept = &written[..written.len() - 1];
            assert_records(&rec.records, kept);
            let reason = rec.tail_error.clone().expect("corruption must be reported");
            assert!(rec.truncated_bytes > 0, "{what}: {reason}");
            assert!(
                rec.truncated_bytes <= encoded_len(last_payload.len()) as u64,
                "{what}: only the last record is cut"
            );
            drop(log);
            appends_continue_after_cut(&config, kept, last_lsn);
        }
    }
}

#[test]
fn garbage_after_the_last_record_is_not_replayed() {
    const SEED: u64 = 0x5eed_0001;
    let mut rng = rand::rngs::StdRng::seed_from_u64(SEED);
    for preallocate in [true, false] {
        let dir = tempfile::tempdir().unwrap();
        let config = tiny(dir.path()).preallocate(preallocate);
        let written = write_and_close(&config);
        let (log, rec) = open(config.clone());
        let end = rec.end_lsn;
        drop(log);

        // Random bytes, then a copy of a real record (valid CRC, but it claims another LSN).
        let last_lsn = written.last().unwrap().0;
        let (path, offset) = locate(dir.path(), last_lsn);
        let end_offset = offset + (end.get() - last_lsn.get());
        let garbage: Vec<u8> = (0..100).map(|_| rng.gen::<u8>() | 1).collect();
        write_at(&path, end_offset, &garbage);
        let (log, rec) = open(config.clone());
        assert_records(&rec.records, &written);
        assert!(
            rec.tail_error.is_some(),
            "seed {SEED:#x}: garbage must be reported"
        );
        assert_eq!(rec.truncated_bytes, 100, "seed {SEED:#x}");
        drop(log);

        // A valid record copied to the end: its LSN does not match its position.
        let (src_path, src_off) = locate(dir.path(), written[written.len() - 2].0);
        let src_len = encoded_len(written[written.len() - 2].2.len());
        let bytes = std::fs::read(&src_path).unwrap();
        let copy = &bytes[src_off as usize..src_off as usize + src_len];
        write_at(&path, end_offset, copy);
        let (log, rec) = open(config.clone());
        assert_records(&rec.records, &written);
        let reason = rec
            .tail_error
            .clone()
            .expect("a misplaced record must be reported");
        assert!(reason.contains("claims"), "{reason}");
        drop(log);
        appends_continue_after_cut(&config, &written, end);
    }
}

#[test]
fn records_beyond_a_cut_never_come_back() {
    // Corrupt a record in the middle of the active segment while later records stay intact.
    // After the cut, new appends of the same size end exactly where an old, valid record
    // began; the cut must have erased it, or it would be replayed as if it were new.
    let dir = tempfile::tempdir().unwrap();
    let config = tiny(dir.path());
    let (log, _) = open(config.clone());
    let mut lsns = Vec::new();
    for i in 0..6 {
        lsns.push(log.append(RecordTag(1), &payload(i, 40)).unwrap());
    }
    log.close().unwrap();
    drop(log);
    let (path, off) = locate(dir.path(), lsns[2]);
    flip_byte(&path, off + RECORD_HEADER_LEN as u64, 0x01);

    let (log, rec) = open(config.clone());
    assert_eq!(rec.records.len(), 2);
    assert!(rec.tail_error.is_some());
    let replacement = log.append(RecordTag(9), &payload(99, 40)).unwrap();
    assert_eq!(replacement, lsns[2]);
    log.close().unwrap();
    drop(log);

    let (_log, rec) = open(config);
    assert_eq!(rec.tail_error, None);
    let got: Vec<Lsn> = rec.records.iter().map(|r| r.lsn).collect();
    assert_eq!(got, vec![lsns[0], lsns[1], lsns[2]]);
    assert_eq!(rec.records[2].tag, RecordTag(9));
}

#[test]
fn corruption_in_an_older_segment_cuts_every_later_segment() {
    let dir = tempfile::tempdir().unwrap();
    let config = tiny(dir.path());
    let written = write_and_close(&config);
    let bases = segment_bases(dir.path());
    assert!(bases.len() >= 3);
    // The first record of the second segment.
    let victim = written
        .iter()
        .position(|w| w.0 > bases[1])
        .expect("a record in the second segment");
    let (path, off) = locate(dir.path(), written[victim].0);
    flip_byte(&path, off + 2, 0x20); // inside the magic

    let (log, rec) = open(config.clone());
    assert_records(&rec.records, &written[..victim]);
    assert_eq!(rec.segments_removed, bases.len() - 2);
    assert_eq!(log.segments().len(), 2);
    assert_eq!(segment_bases(dir.path()).len(), 2);
    drop(log);
    appends_continue_after_cut(&config, &written[..victim], written[victim].0);
}

#[test]
fn torn_header_of_the_only_segment_starts_afresh_but_damaged_data_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let config = tiny(dir.path());
    let (log, _) = open(config.clone());
    log.close().unwrap();
    drop(log);
    let path = segment_path(dir.path(), Lsn::ZERO);
    truncate_file(&path, 10);
    let (log, rec) = open(config.clone());
    assert!(rec.records.is_empty() && rec.tail_error.is_some());
    let lsn = log.append(RecordTag(1), b"after").unwrap();
    assert_eq!(lsn, Lsn(32));
    log.close().unwrap();
    drop(log);

    // A damaged header in front of records: refusing is better than dropping them silently.
    flip_byte(&path, 3, 0xff);
    match weft_log::Log::open(config) {
        Err(LogError::Corrupt { lsn, .. }) => assert_eq!(lsn, Lsn::ZERO),
        other => panic!("expected Corrupt, got {other:?}"),
    }
}

#[test]
fn a_missing_segment_between_two_others_is_refused_not_cut() {
    let dir = tempfile::tempdir().unwrap();
    let config = tiny(dir.path());
    let written = write_and_close(&config);
    let bases = segment_bases(dir.path());
    assert!(bases.len() >= 3);
    let missing = segment_path(dir.path(), bases[1]);
    std::fs::remove_file(&missing).unwrap();
    match weft_log::Log::open(config) {
        Err(LogError::Corrupt { lsn, reason }) => {
            assert_eq!(lsn, bases[1]);
            assert!(
                reason.contains(&format!("{:016x}.wlog", bases[2].get())),
                "{reason}"
            );
        }
        other => panic!("expected Corrupt, got {other:?}"),
    }
    // Nothing was deleted: the later segments are still there for an operator.
    assert_eq!(segment_bases(dir.path()).len(), bases.len() - 1);
    assert!(written.len() > 1);
}
