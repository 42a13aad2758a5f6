//! The async shell around [`LockTable`]: bounded waits on tokio.
//!
//! Owns the mapping from queued requests to the tasks waiting on them and
//! the statistics. It must never decide a grant itself (the table does),
//! hold its mutex across an `.await`, wait without a bound, or leave a
//! request queued after the future waiting on it is gone.

use std::collections::HashMap;
use std::fmt::Debug;
use std::hash::Hash;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use parking_lot::Mutex;
use tokio::sync::oneshot;

use super::table::{Acquire, HeldLock, Holder, LockLimits, LockTable, Waiter, Wakeups};
use super::{LockError, LockMode, LockOwner, WaitId};

/// Counters of a [`LockManager`] since it was created.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LockStats {
    /// Locks granted, at once or after a wait (re-acquiring a covered lock
    /// counts too).
    pub grants: u64,
    /// Requests that had to queue.
    pub waits: u64,
    /// Requests refused with [`LockError::Conflict`]: `try_lock` refusals
    /// plus waits that reached their bound.
    pub conflicts: u64,
    /// Waits that reached their bound (a subset of `conflicts`).
    pub timeouts: u64,
    /// Waits that ended with [`LockError::Abandoned`] because the waiting
    /// (sub)transaction ended.
    pub abandoned: u64,
    /// Waits whose future was dropped before it finished.
    pub dropped: u64,
}

#[derive(Debug, Default)]
struct Counters {
    grants: AtomicU64,
    waits: AtomicU64,
    conflicts: AtomicU64,
    timeouts: AtomicU64,
    abandoned: AtomicU64,
    dropped: AtomicU64,
}

fn bump(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}

/// What the mutex protects: the table and one wake-up channel per queued
/// request (exactly the table's queued requests).
#[derive(Debug)]
struct State<K, O: LockOwner> {
    table: LockTable<K, O>,
    wakers: HashMap<WaitId, oneshot::Sender<()>>,
}

impl<K, O> State<K, O>
where
    K: Clone + Eq + Hash + Ord + Debug,
    O: LockOwner,
{
    /// Wakes the granted requests and closes the channels of the cancelled
    /// ones (their waiters then see [`LockError::Abandoned`]).
    fn deliver(&mut self, wake: Wakeups) {
        for id in wake.granted {
            let tx = self.wakers.remove(&id);
            debug_assert!(tx.is_some(), "granted {id} has no waiter");
            if let Some(tx) = tx {
                // The receiver may be gone (its future is being dropped and
                // waits for this mutex); it then finds the wait not queued.
                let _ = tx.send(());
            }
        }
        for id in wake.cancelled {
            let tx = self.wakers.remove(&id);
            debug_assert!(tx.is_some(), "cancelled {id} has no waiter");
        }
        debug_assert_eq!(self.wakers.len(), self.table.waiter_count());
    }
}

/// The lock manager: a [`LockTable`] behind a mutex, with bounded waits.
///
/// Share it between tasks by reference or in an `Arc`. Every method is
/// short and non-blocking except [`lock`](Self::lock), which waits (without
/// holding the mutex) up to its bound.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), weft_kv::lock::LockError> {
/// use std::time::Duration;
/// use weft_kv::lock::{LockError, LockManager, LockMode, TestOwner};
///
/// let locks = LockManager::<&str, TestOwner>::new();
/// let bound = Duration::from_millis(50);
/// let (t1, t2) = (TestOwner::top(1), TestOwner::top(2));
/// locks.lock(t1.clone(), "account:42", LockMode::Exclusive, bound).await?;
/// // Nested: a sub-transaction of t1 may use its parent's lock.
/// locks.lock(t1.child(0), "account:42", LockMode::Shared, bound).await?;
/// locks.commit_sub(&t1.child(0))?;
/// // Another transaction waits at most `bound`, then gets a conflict.
/// let err = locks.lock(t2, "account:42", LockMode::Shared, bound).await;
/// assert!(matches!(err, Err(LockError::Conflict { .. })));
/// locks.release_all(&1);
/// assert!(locks.is_empty());
/// # Ok(())
/// # }
/// ```
#[derive(Debug)]
pub struct LockManager<K, O: LockOwner> {
    state: Mutex<State<K, O>>,
    counters: Counters,
}

impl<K, O> Default for LockManager<K, O>
where
    K: Clone + Eq + Hash + Ord + Debug,
    O: LockOwner,
{
    fn default() -> Self {
        Self::new()
    }
}

/// Withdraws a queued request if the future waiting for it is dropped
/// before the wait ends.
struct PendingWait<'a, K, O>
where
    K: Clone + Eq + Hash + Ord + Debug,
    O: LockOwner,
{
    manager: &'a LockManager<K, O>,
    id: WaitId,
    armed: bool,
}

impl<K, O> Drop for PendingWait<'_, K, O>
where
    K: Clone + Eq + Hash + Ord + Debug,
    O: LockOwner,
{
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        bump(&self.manager.counters.dropped);
        let mut state = self.manager.state.lock();
        state.wakers.remove(&self.id);
        // Not queued any more: granted (the lock stays with its owner, as
        // any lock does, until its transaction ends) or cancelled.
        if let Ok(wake) = state.table.cancel(self.id) {
            state.deliver(wake);
        }
    }
}

impl<K, O> LockManager<K, O>
where
    K: Clone + Eq + Hash + Ord + Debug,
    O: LockOwner,
{
    /// A manager with an unbounded table.
    pub fn new() -> Self {
        Self::with_limits(LockLimits::default())
    }

    /// A manager whose table has the given limits.
    pub fn with_limits(limits: LockLimits) -> Self {
        LockManager {
            state: Mutex::new(State {
                table: LockTable::with_limits(limits),
                wakers: HashMap::new(),
            }),
            counters: Counters::default(),
        }
    }

    /// Acquires `key` in `mode` for `owner`, waiting up to `wait_bound` if
    /// it is not grantable now. On success the owner holds the lock until
    /// its transaction ends (or its sub-transaction passes it on).
    ///
    /// Fails with [`LockError::Conflict`] if the lock was not granted within
    /// `wait_bound` (a deadlock ends this way for one of its parties), with
    /// [`LockError::Abandoned`] if the owner's (sub)transaction ended while
    /// it waited, and with [`LockError::TableFull`] / [`LockError::QueueFull`]
    /// when the table's limits are reached.
    ///
    /// Cancel-safe: dropping the future removes the request from the queue.
    /// If the lock was granted just before the drop, the owner keeps it (as
    /// it keeps every lock) until its (sub)transaction ends.
    pub async fn lock(
        &self,
        owner: O,
        key: K,
        mode: LockMode,
        wait_bound: Duration,
    ) -> Result<(), LockError> {
        let (id, key, mut rx) = {
            let mut state = self.state.lock();
            match state.table.acquire(owner, key, mode)? {
                Acquire::Granted => {
                    bump(&self.counters.grants);
                    return Ok(());
                }
                Acquire::Queued(id) => {
                    let key = state.table.waiting_key(id).cloned().expect("just queued");
                    let (tx, rx) = oneshot::channel();
                    state.wakers.insert(id, tx);
                    (id, key, rx)
                }
            }
        };
        bump(&self.counters.waits);
        metrics::counter!("weft_lock_waits_total").increment(1);
        let waiting_since = std::time::Instant::now();
        tracing::trace!(wait = %id, ?key, %mode, "lock request queued");
        let mut pending = PendingWait {
            manager: self,
            id,
            armed: true,
        };
        let outcome = tokio::time::timeout(wait_bound, &mut rx).await;
        pending.armed = false;
        metrics::histogram!("weft_lock_wait_duration_seconds")
            .record(waiting_since.elapsed().as_secs_f64());
        match outcome {
            Ok(Ok(())) => {
                bump(&self.counters.grants);
                Ok(())
            }
            Ok(Err(_closed)) => {
                bump(&self.counters.abandoned);
                Err(LockError::Abandoned {
                    key: format!("{key:?}"),
                })
            }
            Err(_elapsed) => {
                let mut state = self.state.lock();
                match state.table.cancel(id) {
                    Ok(wake) => {
                        state.wakers.remove(&id);
                        state.deliver(wake);
                        let err = state.table.conflict_error(&key);
                        drop(state);
                        bump(&self.counters.timeouts);
                        bump(&self.counters.conflicts);
                        metrics::counter!("weft_lock_conflicts_total").increment(1);
                        tracing::debug!(wait = %id, %err, ?wait_bound, "lock wait timed out");
                        Err(err)
                    }
                    // Granted or cancelled between the deadline and the
                    // mutex: the channel says which.
                    Err(_) => {
                        drop(state);
                        if rx.try_recv().is_ok() {
                            bump(&self.counters.grants);
                            Ok(())
                        } else {
                            bump(&self.counters.abandoned);
                            Err(LockError::Abandoned {
                                key: format!("{key:?}"),
                            })
                        }
                    }
                }
            }
        }
    }

    /// Acquires `key` in `mode` for `owner` if that is possible without
    /// waiting.
    ///
    /// Fails, changing nothing, with [`LockError::Conflict`] if the request
    /// would have to wait, or with [`LockError::TableFull`] if the key is new
    /// and the table is full.
    pub fn try_lock(&self, owner: O, key: K, mode: LockMode) -> Result<(), LockError> {
        let result = self.state.lock().table.try_acquire(owner, key, mode);
        match &result {
            Ok(()) => bump(&self.counters.grants),
            Err(LockError::Conflict { .. }) => {
                bump(&self.counters.conflicts);
                metrics::counter!("weft_lock_conflicts_total").increment(1);
            }
            Err(_) => {}
        }
        result
    }

    /// Releases every lock of `family` and ends its pending waits (with
    /// [`LockError::Abandoned`]); wakes the requests this unblocks. Call it
    /// when the top-level transaction commits or aborts. Never fails.
    pub fn release_all(&self, family: &O::Family) {
        self.apply(|table| table.release_all(family));
    }

    /// Releases the shared locks of `owner` and its descendants (a READ-ONLY
    /// vote, or degree-2 consistency) and wakes the requests this unblocks.
    /// Never fails.
    pub fn release_shared(&self, owner: &O) {
        self.apply(|table| table.release_shared(owner));
    }

    /// Releases the shared lock on `key` of `owner` and its descendants
    /// (degree-2 consistency) and wakes the requests this unblocks. Never
    /// fails.
    pub fn release_shared_key(&self, owner: &O, key: &K) {
        self.apply(|table| table.release_shared_key(owner, key));
    }

    /// Passes the locks of sub-transaction `child` (and its descendants) to
    /// its parent, ends their pending waits and wakes the requests this
    /// unblocks. Fails with [`LockError::NotSubTransaction`] if `child` is
    /// top-level.
    pub fn commit_sub(&self, child: &O) -> Result<(), LockError> {
        let mut state = self.state.lock();
        let wake = state.table.commit_sub(child)?;
        state.deliver(wake);
        Ok(())
    }

    /// Releases the locks of sub-transaction `child` (and its descendants),
    /// ends their pending waits and wakes the requests this unblocks. Fails
    /// with [`LockError::NotSubTransaction`] if `child` is top-level.
    pub fn abort_sub(&self, child: &O) -> Result<(), LockError> {
        let mut state = self.state.lock();
        let wake = state.table.abort_sub(child)?;
        state.deliver(wake);
        Ok(())
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> LockStats {
        let c = &self.counters;
        LockStats {
            grants: c.grants.load(Ordering::Relaxed),
            waits: c.waits.load(Ordering::Relaxed),
            conflicts: c.conflicts.load(Ordering::Relaxed),
            timeouts: c.timeouts.load(Ordering::Relaxed),
            abandoned: c.abandoned.load(Ordering::Relaxed),
            dropped: c.dropped.load(Ordering::Relaxed),
        }
    }

    /// The holders of `key` now, in grant order.
    pub fn holders(&self, key: &K) -> Vec<Holder<O>> {
        self.state.lock().table.holders(key)
    }

    /// The queued requests on `key` now, front first.
    pub fn waiters(&self, key: &K) -> Vec<Waiter<O>> {
        self.state.lock().table.waiters(key)
    }

    /// Every lock `family` holds now, by ascending key.
    pub fn locks_of(&self, family: &O::Family) -> Vec<HeldLock<K, O>> {
        self.state.lock().table.locks_of(family)
    }

    /// Every family that holds a lock now, with the number of keys it
    /// holds (in no particular order): for listings of what is held.
    pub fn families_holding(&self) -> Vec<(O::Family, usize)> {
        self.state.lock().table.families_holding()
    }

    /// The number of keys with holders or waiters now.
    pub fn len(&self) -> usize {
        self.state.lock().table.len()
    }

    /// True if no key has holders or waiters now.
    pub fn is_empty(&self) -> bool {
        self.state.lock().table.is_empty()
    }

    /// Checks every invariant of the table and that each queued request has
    /// exactly one waiting channel; for tests. Returns the first violation.
    pub fn check_invariants(&self) -> Result<(), String> {
        let state = self.state.lock();
        state.table.check_invariants()?;
        if state.wakers.len() != state.table.waiter_count() {
            return Err(format!(
                "{} wake-up channels for {} queued requests",
                state.wakers.len(),
                state.table.waiter_count()
            ));
        }
        Ok(())
    }

    fn apply(&self, op: impl FnOnce(&mut LockTable<K, O>) -> Wakeups) {
        let mut state = self.state.lock();
        let wake = op(&mut state.table);
        state.deliver(wake);
    }
}
