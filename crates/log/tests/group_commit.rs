//! Group commit, force intents, lazy durability and poisoning.
//!
//! No test here asserts that something is fast; where time matters, the assertion is a lower
//! bound the flusher guarantees (it cannot sync before a deadline) or a generous upper bound
//! that only a wedged flusher would miss.

mod common;

use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use common::*;
use weft_log::{Log, LogConfig, LogError, Lsn, RecordTag};

/// Far longer than any test should take; reaching it means the flusher is wedged.
const WEDGED: Duration = Duration::from_secs(20);

/// A configuration whose segments never roll over in these tests, so every fdatasync counted
/// is a group commit (a rollover adds one for the finished segment).
fn roomy(dir: &std::path::Path) -> LogConfig {
    LogConfig::new(dir)
        .segment_size(1 << 20)
        .max_record_size(4096)
}

/// Polls `cond` every millisecond until it holds or `WEDGED` passes.
fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + WEDGED;
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn concurrent_forcing_threads_share_syncs() {
    const THREADS: usize = 16;
    const ROUNDS: usize = 20;
    let dir = tempfile::tempdir().unwrap();
    let (log, _) = open(roomy(dir.path()));
    let barrier = Arc::new(Barrier::new(THREADS));
    let before = log.stats();
    std::thread::scope(|s| {
        for t in 0..THREADS {
            let (log, barrier) = (log.clone(), Arc::clone(&barrier));
            s.spawn(move || {
                for round in 0..ROUNDS {
                    let lsn = log
                        .append(RecordTag(1), &payload(t * 1000 + round, 100))
                        .unwrap();
                    // Every thread has appended before any forces, so the first force's sync
                    // covers the whole round.
                    barrier.wait();
                    log.force_blocking(lsn).unwrap();
                    assert!(log.durable_lsn() >= lsn);
                    barrier.wait();
                }
            });
        }
    });
    let d = log.stats().since(&before);
    assert_eq!(d.appends, (THREADS * ROUNDS) as u64);
    assert_eq!(d.forces_requested, (THREADS * ROUNDS) as u64);
    assert_eq!(d.segments_created, 0);
    assert_eq!(d.syncs, ROUNDS as u64, "one fdatasync per round: {d:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_forcing_tasks_share_syncs() {
    const TASKS: usize = 64;
    const ROUNDS: usize = 10;
    let dir = tempfile::tempdir().unwrap();
    let (log, _) = open(roomy(dir.path()));
    let barrier = Arc::new(tokio::sync::Barrier::new(TASKS));
    let before = log.stats();
    let mut tasks = Vec::new();
    for t in 0..TASKS {
        let (log, barrier) = (log.clone(), Arc::clone(&barrier));
        tasks.push(tokio::spawn(async move {
            for round in 0..ROUNDS {
                let lsn = log
                    .append(RecordTag(2), &payload(t * 1000 + round, 100))
                    .unwrap();
                barrier.wait().await;
                log.force(lsn).await.unwrap();
                barrier.wait().await;
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let d = log.stats().since(&before);
    assert_eq!(d.appends, (TASKS * ROUNDS) as u64);
    assert_eq!(d.segments_created, 0);
    assert_eq!(d.syncs, ROUNDS as u64, "one fdatasync per round: {d:?}");
}

#[test]
fn free_running_committers_need_fewer_syncs_than_records() {
    // No barrier: the coalescing comes from records arriving while a sync runs. The bound is
    // loose on purpose (a sync per record would need 8x more syncs).
    const THREADS: usize = 8;
    const PER_THREAD: usize = 100;
    let dir = tempfile::tempdir().unwrap();
    let (log, _) = open(tiny(dir.path()));
    let before = log.stats();
    std::thread::scope(|s| {
        for t in 0..THREADS {
            let log = log.clone();
            s.spawn(move || {
                for i in 0..PER_THREAD {
                    let lsn = log.append(RecordTag(1), &payload(t + i, 100)).unwrap();
                    log.force_blocking(lsn).unwrap();
                }
            });
        }
    });
    let d = log.stats().since(&before);
    let records = (THREADS * PER_THREAD) as u64;
    assert_eq!(d.appends, records);
    assert!(d.syncs < records, "{d:?}");
}

#[test]
fn a_lone_committer_never_waits_for_intents() {
    let dir = tempfile::tempdir().unwrap();
    let (log, _) = open(tiny(dir.path()).group_commit_max_delay(WEDGED * 2));
    let started = Instant::now();
    for i in 0..20 {
        let lsn = log.append(RecordTag(1), &payload(i, 10)).unwrap();
        log.force_blocking(lsn).unwrap();
    }
    let intent = log.intent();
    let lsn = log.append(RecordTag(1), b"mine").unwrap();
    intent.force_blocking(lsn).unwrap();
    assert!(started.elapsed() < WEDGED);
    assert_eq!(log.stats().intent_waits, 0);
    assert_eq!(log.stats().syncs, 21);
}

#[test]
fn an_outstanding_intent_delays_a_sync_by_at_most_the_max_delay() {
    let max_delay = Duration::from_millis(100);
    let dir = tempfile::tempdir().unwrap();
    let (log, _) = open(tiny(dir.path()).group_commit_max_delay(max_delay));
    let intent = log.intent(); // never forced while the other committer waits
    let lsn = log.append(RecordTag(1), b"other").unwrap();
    let started = Instant::now();
    log.force_blocking(lsn).unwrap();
    let waited = started.elapsed();
    assert!(
        waited >= max_delay,
        "the flusher must wait for the intent ({waited:?})"
    );
    assert!(waited < WEDGED, "the wait must end ({waited:?})");
    let s = log.stats();
    assert_eq!((s.intent_waits, s.intent_wait_timeouts, s.syncs), (1, 1, 1));
    drop(intent);
    // With the intent gone, the next force does not wait.
    let lsn = log.append(RecordTag(1), b"again").unwrap();
    log.force_blocking(lsn).unwrap();
    assert_eq!(log.stats().intent_waits, 1);
}

/// Starts a thread that forces a fresh record while `log` has one intent outstanding, and
/// waits until the flusher is holding that sync back for the intent.
fn force_held_back_by_intent(log: &Log) -> (Lsn, std::thread::JoinHandle<()>) {
    let lsn = log.append(RecordTag(1), b"waiting committer").unwrap();
    let forcer = {
        let log = log.clone();
        std::thread::spawn(move || log.force_blocking(lsn).unwrap())
    };
    eventually("the flusher to wait for the intent", || {
        log.stats().intent_waits == 1
    });
    assert!(log.durable_lsn() < lsn);
    (lsn, forcer)
}

#[test]
fn an_intent_turned_force_joins_the_waiting_sync() {
    let dir = tempfile::tempdir().unwrap();
    let (log, _) = open(tiny(dir.path()).group_commit_max_delay(WEDGED * 2));
    let intent = log.intent();
    let (other, forcer) = force_held_back_by_intent(&log);
    let mine = log.append(RecordTag(1), b"intent holder").unwrap();
    intent.force_blocking(mine).unwrap();
    forcer.join().unwrap();
    assert!(log.durable_lsn() >= mine && mine > other);
    let s = log.stats();
    assert_eq!(s.syncs, 1, "both records in one fdatasync: {s:?}");
    assert_eq!(s.intent_wait_timeouts, 0);
}

#[test]
fn a_dropped_intent_releases_the_waiting_sync() {
    let dir = tempfile::tempdir().unwrap();
    let (log, _) = open(tiny(dir.path()).group_commit_max_delay(WEDGED * 2));
    let intent = log.intent();
    let (other, forcer) = force_held_back_by_intent(&log);
    drop(intent);
    forcer.join().unwrap();
    assert!(log.durable_lsn() >= other);
    assert_eq!(log.stats().intent_wait_timeouts, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn async_intents_join_and_unpolled_intent_futures_release() {
    let dir = tempfile::tempdir().unwrap();
    let (log, _) = open(tiny(dir.path()).group_commit_max_delay(WEDGED * 2));
    // A force future dropped before it was polled gives its intent back.
    let abandoned = log.intent().force(Lsn::ZERO);
    drop(abandoned);
    let intent = log.intent();
    let log2 = log.clone();
    let (other, forcer) = tokio::task::spawn_blocking(move || force_held_back_by_intent(&log2))
        .await
        .unwrap();
    let mine = log.append(RecordTag(1), b"async intent").unwrap();
    intent.force(mine).await.unwrap();
    tokio::task::spawn_blocking(move || forcer.join().unwrap())
        .await
        .unwrap();
    assert!(log.durable_lsn() >= mine && mine > other);
    assert_eq!(log.stats().syncs, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lazy_waiters_piggyback_or_are_forced_after_the_interval() {
    let dir = tempfile::tempdir().unwrap();
    // A long interval: the lazy waiter is satisfied by someone else's force.
    let (log, _) = open(tiny(dir.path()).lazy_flush_interval(WEDGED * 2));
    let lazy_lsn = log.append(RecordTag(1), b"ack").unwrap();
    let waiter = {
        let log = log.clone();
        tokio::spawn(async move { log.when_durable(lazy_lsn).await })
    };
    tokio::task::yield_now().await;
    let forced = log.append(RecordTag(1), b"commit").unwrap();
    log.force(forced).await.unwrap();
    tokio::time::timeout(WEDGED, waiter)
        .await
        .expect("piggybacked waiter")
        .unwrap()
        .unwrap();
    assert_eq!(log.stats().lazy_syncs, 0);
    log.close().unwrap();
    drop(log);

    // A short interval and nobody forcing: the log syncs on its own.
    let interval = Duration::from_millis(20);
    let (log, _) = open(tiny(dir.path()).lazy_flush_interval(interval));
    let lsn = log.append(RecordTag(1), b"lonely ack").unwrap();
    let started = Instant::now();
    tokio::time::timeout(WEDGED, log.when_durable(lsn))
        .await
        .expect("lazy waiter must be forced eventually")
        .unwrap();
    assert!(started.elapsed() >= interval);
    let s = log.stats();
    assert_eq!((s.lazy_syncs, s.syncs), (1, 1));
}

#[test]
fn a_failed_fdatasync_poisons_the_log() {
    let dir = tempfile::tempdir().unwrap();
    let config = tiny(dir.path()).fail_sync_number(Some(2));
    let (log, _) = open(config.clone());
    let first = log.append(RecordTag(1), b"synced").unwrap();
    log.force_blocking(first).unwrap();
    let second = log.append(RecordTag(1), b"lost?").unwrap();
    match log.force_blocking(second) {
        Err(LogError::Poisoned { reason }) => assert!(reason.contains("fdatasync"), "{reason}"),
        other => panic!("expected Poisoned, got {other:?}"),
    }
    assert_eq!(
        log.durable_lsn(),
        first,
        "a failed sync must not advance the durable point"
    );
    assert!(log.poisoned().is_some());
    assert!(matches!(
        log.append(RecordTag(1), b"x"),
        Err(LogError::Poisoned { .. })
    ));
    assert!(matches!(
        log.force_blocking(second),
        Err(LogError::Poisoned { .. })
    ));
    log.force_blocking(first).unwrap(); // what was durable stays durable
    assert!(matches!(
        log.truncate_before(first),
        Err(LogError::Poisoned { .. })
    ));
    assert!(matches!(log.close(), Err(LogError::Poisoned { .. })));
    drop(log);

    // Reopening runs recovery; the first record is certainly there.
    let (_log, rec) = open(tiny(dir.path()));
    assert_eq!(rec.records[0].lsn, first);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn async_waiters_see_poisoning_too() {
    let dir = tempfile::tempdir().unwrap();
    let (log, _) = open(tiny(dir.path()).fail_sync_number(Some(1)));
    let lsn = log.append(RecordTag(1), b"x").unwrap();
    let lazy = {
        let log = log.clone();
        tokio::spawn(async move { log.when_durable(lsn).await })
    };
    let forced = log.force(lsn).await;
    assert!(
        matches!(forced, Err(LogError::Poisoned { .. })),
        "{forced:?}"
    );
    let lazy = tokio::time::timeout(WEDGED, lazy).await.unwrap().unwrap();
    assert!(matches!(lazy, Err(LogError::Poisoned { .. })), "{lazy:?}");
}
