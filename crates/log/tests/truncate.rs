//! Checkpoint truncation: `truncate_before` deletes whole segments below the new start,
//! persists the start, and recovery begins there.

mod common;

use common::*;
use weft_log::{LogError, Lsn, RecordTag};

#[test]
fn truncate_before_deletes_old_segments_and_recovery_starts_there() {
    let dir = tempfile::tempdir().unwrap();
    let config = tiny(dir.path());
    let (log, _) = open(config.clone());
    let written = append_many(&log, 0, 120);
    let last = written.last().unwrap().0;
    log.force_blocking(last).unwrap();
    let segments = log.segments();
    assert!(segments.len() >= 6, "{}", segments.len());
    assert_eq!(log.first_lsn(), Lsn::ZERO);

    // A record in the fourth segment: the first three lie wholly below it.
    let cut = written.iter().find(|w| w.0 > segments[3].base).unwrap().0;
    let deleted_bytes: Vec<Vec<u8>> = segments[..3]
        .iter()
        .map(|s| std::fs::read(&s.path).unwrap())
        .collect();
    log.truncate_before(cut).unwrap();
    assert_eq!(log.first_lsn(), cut);
    assert_eq!(log.stats().segments_deleted, 3);
    assert_eq!(log.segments(), segments[3..].to_vec());
    for s in &segments[..3] {
        assert!(!s.path.exists(), "{} must be deleted", s.path.display());
    }
    // Lower or equal starts are no-ops; beyond the durable end is refused.
    log.truncate_before(Lsn(cut.get() - 8)).unwrap();
    log.truncate_before(cut).unwrap();
    assert_eq!(log.first_lsn(), cut);
    let pending = log.append(RecordTag(1), b"not yet durable").unwrap();
    match log.truncate_before(Lsn(pending.get() + 8)) {
        Err(LogError::NotDurable { .. }) => {}
        other => panic!("expected NotDurable, got {other:?}"),
    }
    log.close().unwrap();
    drop(log);

    // A crash between writing log.meta and deleting the segments leaves stale segments
    // behind: recovery removes them and still starts at the recorded start.
    std::fs::write(&segments[0].path, &deleted_bytes[0]).unwrap();
    let (log, rec) = open(config.clone());
    assert!(!segments[0].path.exists());
    assert_eq!(rec.first_lsn, cut);
    assert_eq!(log.first_lsn(), cut);
    assert_eq!(rec.tail_error, None);
    let want: Vec<_> = written.iter().filter(|w| w.0 >= cut).cloned().collect();
    assert_eq!(rec.records.len(), want.len() + 1); // plus the record appended after the check
    assert_records(&rec.records[..want.len()], &want);
    assert_eq!(rec.records.last().unwrap().lsn, pending);
    drop(log);
}

#[test]
fn truncating_everything_leaves_an_empty_log_that_keeps_its_lsns() {
    let dir = tempfile::tempdir().unwrap();
    let config = tiny(dir.path());
    let (log, _) = open(config.clone());
    let written = append_many(&log, 0, 50);
    log.force_blocking(written.last().unwrap().0).unwrap();
    let end = log.end_lsn();
    log.truncate_before(end).unwrap();
    assert_eq!(
        log.segments().len(),
        1,
        "the active segment is never deleted"
    );
    drop(log);

    let (log, rec) = open(config.clone());
    assert!(rec.records.is_empty());
    assert_eq!(rec.first_lsn, end);
    assert_eq!(rec.end_lsn, end);
    let next = log.append(RecordTag(4), b"after checkpoint").unwrap();
    assert!(next >= end);
    drop(log);
    let (_log, rec) = open(config);
    assert_eq!(rec.records.len(), 1);
    assert_eq!(rec.records[0].lsn, next);
}

#[test]
fn a_missing_segment_below_records_is_corruption_not_a_fresh_start() {
    let dir = tempfile::tempdir().unwrap();
    let config = tiny(dir.path());
    let (log, _) = open(config.clone());
    let written = append_many(&log, 0, 60);
    log.force_blocking(written.last().unwrap().0).unwrap();
    let first = log.segments()[0].path.clone();
    drop(log);
    std::fs::remove_file(first).unwrap();
    match weft_log::Log::open(config) {
        Err(LogError::Corrupt { .. }) => {}
        other => panic!("expected Corrupt, got {other:?}"),
    }
}
