//! Power loss that drops every directory entry never fsynced ([`PowerLoss`]): the log's
//! directory (nested, freshly created), its segments, `log.meta` and the deletions of a
//! checkpoint survive, and a failed directory fsync poisons the log instead of being retried.

mod common;

use common::*;
use weft_log::{Durability, LogError, PowerLoss};

#[test]
fn a_fresh_nested_log_directory_and_its_segments_survive_power_loss() {
    let root = tempfile::tempdir().unwrap();
    let sim = PowerLoss::new();
    // Two levels that do not exist yet: both entries must be made durable.
    let dir = root.path().join("data").join("log");
    let config = tiny(&dir).durability(Durability::simulated(&sim));
    let (log, _) = open(config.clone());
    let written = append_many(&log, 0, 60);
    log.force_blocking(written.last().unwrap().0).unwrap();
    assert!(log.segments().len() >= 3, "{:?}", log.segments());
    log.close().unwrap();
    drop(log);

    let dropped = sim.crash().unwrap();
    assert!(dropped.is_empty(), "unsynced entries: {dropped:#?}");
    let (log, rec) = open(config);
    assert_records(&rec.records, &written);
    drop(log);
}

#[test]
fn a_checkpoint_survives_power_loss() {
    let root = tempfile::tempdir().unwrap();
    let sim = PowerLoss::new();
    let config = tiny(root.path()).durability(Durability::simulated(&sim));
    let (log, _) = open(config.clone());
    let written = append_many(&log, 0, 120);
    log.force_blocking(written.last().unwrap().0).unwrap();
    let segments = log.segments();
    let cut = written.iter().find(|w| w.0 > segments[3].base).unwrap().0;
    log.truncate_before(cut).unwrap();
    log.close().unwrap();
    drop(log);

    let dropped = sim.crash().unwrap();
    assert!(dropped.is_empty(), "unsynced entries: {dropped:#?}");
    for s in &segments[..3] {
        assert!(!s.path.exists(), "{} must stay deleted", s.path.display());
    }
    let (log, rec) = open(config);
    assert_eq!(rec.first_lsn, cut);
    let want: Vec<_> = written.iter().filter(|w| w.0 >= cut).cloned().collect();
    assert_records(&rec.records, &want);
    drop(log);
}

#[test]
fn a_failed_directory_fsync_at_a_checkpoint_poisons_the_log() {
    let root = tempfile::tempdir().unwrap();
    let sim = PowerLoss::new();
    let config = tiny(root.path()).durability(Durability::simulated(&sim));
    let (log, _) = open(config.clone());
    let written = append_many(&log, 0, 120);
    log.force_blocking(written.last().unwrap().0).unwrap();
    let cut = written[written.len() / 2].0;

    sim.fail_dir_syncs(true);
    match log.truncate_before(cut) {
        Err(LogError::Io { .. }) => {}
        other => panic!("expected an I/O error, got {other:?}"),
    }
    sim.fail_dir_syncs(false);
    // No retry after EIO: the log refuses everything until it is reopened.
    assert!(log.poisoned().is_some());
    match log.truncate_before(cut) {
        Err(LogError::Poisoned { .. }) => {}
        other => panic!("expected Poisoned, got {other:?}"),
    }
    match log.append(weft_log::RecordTag(1), b"after EIO") {
        Err(LogError::Poisoned { .. }) => {}
        other => panic!("expected Poisoned, got {other:?}"),
    }
    drop(log);

    // Whatever the failed sync left, recovery finds every record at or after the start.
    sim.crash().unwrap();
    let (log, rec) = open(config);
    assert!(rec.first_lsn <= cut);
    let want: Vec<_> = written
        .iter()
        .filter(|w| w.0 >= rec.first_lsn)
        .cloned()
        .collect();
    assert_records(&rec.records, &want);
    drop(log);
}

#[test]
fn a_failed_directory_fsync_when_rolling_a_segment_poisons_the_log() {
    let root = tempfile::tempdir().unwrap();
    let sim = PowerLoss::new();
    let config = tiny(root.path()).durability(Durability::simulated(&sim));
    let (log, _) = open(config);
    sim.fail_dir_syncs(true);
    // Enough to need a second segment: its creation syncs the directory and fails.
    let written = append_many(&log, 0, 60);
    match log.force_blocking(written.last().unwrap().0) {
        Err(LogError::Poisoned { .. }) => {}
        other => panic!("expected Poisoned, got {other:?}"),
    }
    assert!(log.poisoned().is_some());
    drop(log);
}
