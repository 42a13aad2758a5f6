//! Tests of the async [`LockManager`] shell. Most run on a paused tokio
//! clock, so bounded waits end without sleeping for real.

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::{LockError, LockManager, LockMode, LockStats, TestOwner};
use LockMode::{Exclusive as X, Shared as S};

type Manager = LockManager<&'static str, TestOwner>;

fn t(tx: u64) -> TestOwner {
    TestOwner::top(tx)
}

const SECOND: Duration = Duration::from_secs(1);

/// Lets every ready task run, without moving the paused clock.
async fn settle() {
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
}

#[tokio::test(start_paused = true)]
async fn waiter_is_granted_when_the_holder_releases() {
    let mgr = Arc::new(Manager::new());
    mgr.lock(t(1), "a", X, SECOND).await.unwrap();
    let waiter = tokio::spawn({
        let mgr = mgr.clone();
        async move { mgr.lock(t(2), "a", S, 10 * SECOND).await }
    });
    settle().await;
    assert_eq!(mgr.waiters(&"a").len(), 1);
    let start = Instant::now();
    mgr.release_all(&1);
    assert_eq!(waiter.await.unwrap(), Ok(()));
    assert_eq!(start.elapsed(), Duration::ZERO);
    assert_eq!(mgr.holders(&"a")[0].owner, t(2));
    mgr.check_invariants().unwrap();
    assert_eq!(
        mgr.stats(),
        LockStats {
            grants: 2,
            waits: 1,
            ..LockStats::default()
        }
    );
}

#[tokio::test(start_paused = true)]
async fn waiting_past_the_bound_is_a_conflict() {
    let mgr = Manager::new();
    mgr.lock(t(1), "a", S, SECOND).await.unwrap();
    let start = Instant::now();
    let err = mgr.lock(t(2), "a", X, 3 * SECOND).await.unwrap_err();
    assert_eq!(start.elapsed(), 3 * SECOND);
    assert_eq!(
        err,
        LockError::Conflict {
            key: "\"a\"".into(),
            holders: vec!["t1:S".into()],
        }
    );
    assert!(mgr.waiters(&"a").is_empty());
    mgr.check_invariants().unwrap();
    let stats = mgr.stats();
    assert_eq!((stats.timeouts, stats.conflicts, stats.waits), (1, 1, 1));
}

#[tokio::test(start_paused = true)]
async fn a_dropped_waiting_future_leaves_no_waiter() {
    let mgr = Manager::new();
    mgr.lock(t(1), "a", X, SECOND).await.unwrap();
    // The outer timeout drops the inner wait long before its own bound.
    let outer = tokio::time::timeout(SECOND, mgr.lock(t(2), "a", X, 60 * SECOND)).await;
    assert!(outer.is_err());
    assert!(mgr.waiters(&"a").is_empty());
    mgr.check_invariants().unwrap();
    // Releasing the holder grants nothing to the vanished waiter.
    mgr.release_all(&1);
    assert!(mgr.is_empty());
    assert!(mgr.locks_of(&2).is_empty());
    assert_eq!(mgr.stats().dropped, 1);
}

#[tokio::test(start_paused = true)]
async fn a_dropped_waiter_unblocks_those_queued_behind_it() {
    let mgr = Arc::new(Manager::new());
    mgr.lock(t(1), "a", S, SECOND).await.unwrap();
    let writer = tokio::spawn({
        let mgr = mgr.clone();
        async move { mgr.lock(t(2), "a", X, 60 * SECOND).await }
    });
    settle().await;
    let reader = tokio::spawn({
        let mgr = mgr.clone();
        async move { mgr.lock(t(3), "a", S, 60 * SECOND).await }
    });
    settle().await;
    assert_eq!(mgr.waiters(&"a").len(), 2);
    writer.abort();
    assert!(writer.await.unwrap_err().is_cancelled());
    assert_eq!(reader.await.unwrap(), Ok(()));
    assert_eq!(mgr.holders(&"a").len(), 2);
    mgr.check_invariants().unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_deadlock_ends_in_a_conflict_not_a_hang() {
    let mgr = Manager::new();
    mgr.lock(t(1), "a", X, SECOND).await.unwrap();
    mgr.lock(t(2), "b", X, SECOND).await.unwrap();
    let start = Instant::now();
    // Each transaction aborts (releases everything) when its wait fails.
    let run = |me: u64, key: &'static str, bound: Duration| {
        let mgr = &mgr;
        async move {
            let r = mgr.lock(t(me), key, X, bound).await;
            if r.is_err() {
                mgr.release_all(&me);
            }
            r
        }
    };
    let (r1, r2) = tokio::join!(run(1, "b", SECOND), run(2, "a", 2 * SECOND));
    assert!(matches!(r1, Err(LockError::Conflict { .. })));
    // t1 gave up and released "a": t2 proceeds as soon as that happens.
    assert_eq!(r2, Ok(()));
    assert_eq!(start.elapsed(), SECOND);
    mgr.release_all(&2);
    assert!(mgr.is_empty());
}

#[tokio::test(start_paused = true)]
async fn a_deadlock_with_equal_bounds_fails_both_parties() {
    let mgr = Manager::new();
    mgr.lock(t(1), "a", S, SECOND).await.unwrap();
    mgr.lock(t(2), "a", S, SECOND).await.unwrap();
    // The classic upgrade deadlock, nobody giving anything back.
    let (r1, r2) = tokio::join!(
        mgr.lock(t(1), "a", X, SECOND),
        mgr.lock(t(2), "a", X, SECOND)
    );
    assert!(matches!(r1, Err(LockError::Conflict { .. })));
    assert!(matches!(r2, Err(LockError::Conflict { .. })));
    assert!(mgr.waiters(&"a").is_empty());
    mgr.check_invariants().unwrap();
}

#[tokio::test(start_paused = true)]
async fn try_lock_never_waits() {
    let mgr = Manager::new();
    mgr.try_lock(t(1), "a", S).unwrap();
    mgr.try_lock(t(2), "a", S).unwrap();
    assert!(matches!(
        mgr.try_lock(t(3), "a", X),
        Err(LockError::Conflict { .. })
    ));
    assert!(mgr.waiters(&"a").is_empty());
    mgr.release_shared(&t(1));
    mgr.release_shared_key(&t(2), &"a");
    mgr.try_lock(t(3), "a", X).unwrap();
    let stats = mgr.stats();
    assert_eq!((stats.grants, stats.conflicts, stats.waits), (3, 1, 0));
}

#[tokio::test(start_paused = true)]
async fn ending_a_sub_transaction_abandons_its_wait() {
    let mgr = Arc::new(Manager::new());
    mgr.lock(t(2), "a", X, SECOND).await.unwrap();
    let child = t(1).child(0);
    let waiter = tokio::spawn({
        let (mgr, child) = (mgr.clone(), child.clone());
        async move { mgr.lock(child, "a", S, 60 * SECOND).await }
    });
    settle().await;
    mgr.abort_sub(&child).unwrap();
    assert_eq!(
        waiter.await.unwrap(),
        Err(LockError::Abandoned {
            key: "\"a\"".into()
        })
    );
    assert_eq!(mgr.stats().abandoned, 1);
    mgr.check_invariants().unwrap();
}

#[tokio::test(start_paused = true)]
async fn commit_sub_wakes_a_waiting_sibling() {
    let mgr = Arc::new(Manager::new());
    let (c0, c1) = (t(1).child(0), t(1).child(1));
    mgr.lock(c0.clone(), "a", X, SECOND).await.unwrap();
    let sibling = tokio::spawn({
        let (mgr, c1) = (mgr.clone(), c1.clone());
        async move { mgr.lock(c1, "a", X, 60 * SECOND).await }
    });
    settle().await;
    assert_eq!(mgr.waiters(&"a").len(), 1);
    mgr.commit_sub(&c0).unwrap();
    assert_eq!(sibling.await.unwrap(), Ok(()));
    assert!(matches!(
        mgr.commit_sub(&t(1)),
        Err(LockError::NotSubTransaction { .. })
    ));
    mgr.abort_sub(&c1).unwrap();
    let locks = mgr.locks_of(&1);
    assert_eq!(locks.len(), 1);
    assert_eq!((locks[0].owner.clone(), locks[0].mode), (t(1), X));
    mgr.release_all(&1);
    assert!(mgr.is_empty());
}

#[tokio::test(start_paused = true)]
async fn a_full_table_refuses_new_keys() {
    let mgr = Manager::with_limits(super::LockLimits {
        max_keys: Some(1),
        max_waiters: Some(0),
    });
    mgr.lock(t(1), "a", X, SECOND).await.unwrap();
    assert_eq!(
        mgr.lock(t(1), "b", X, SECOND).await,
        Err(LockError::TableFull { limit: 1 })
    );
    assert_eq!(
        mgr.lock(t(2), "a", X, SECOND).await,
        Err(LockError::QueueFull { limit: 0 })
    );
}

/// Real threads and a real clock: writers on a multi-threaded runtime never
/// overlap and every one of them gets through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_writers_are_mutually_exclusive() {
    const TASKS: u64 = 8;
    const ROUNDS: u32 = 25;
    let mgr = Arc::new(LockManager::<u32, TestOwner>::new());
    let inside = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicU32::new(0));
    let mut tasks = Vec::new();
    for task in 0..TASKS {
        let (mgr, inside, done) = (mgr.clone(), inside.clone(), done.clone());
        tasks.push(tokio::spawn(async move {
            for round in 0..ROUNDS {
                let tx = task * 1000 + u64::from(round);
                mgr.lock(t(tx), 7, X, 10 * SECOND).await.unwrap();
                assert!(!inside.swap(true, Ordering::SeqCst), "two writers inside");
                tokio::task::yield_now().await;
                inside.store(false, Ordering::SeqCst);
                done.fetch_add(1, Ordering::SeqCst);
                mgr.release_all(&tx);
            }
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
    assert_eq!(done.load(Ordering::SeqCst), TASKS as u32 * ROUNDS);
    assert!(mgr.is_empty());
    mgr.check_invariants().unwrap();
}
