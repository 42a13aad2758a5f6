//! The lock table of one volume: shared and exclusive locks on paths, owned
//! by transactions (every process and sub-transaction of a transaction
//! shares its locks, QuickSilver's rule).
//!
//! Owns who holds what and the bounded wait for a conflicting lock
//! (LockConflict after the bound; 0 fails at once, QuickSilver's choice, so
//! there is never a deadlock, only a timeout). The table itself
//! ([`LockTable`]) is pure bookkeeping; [`Locks`] adds the wait. Must never
//! grant a lock that conflicts with a holder, nor hold more entries or
//! waiters than its limits.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tokio::sync::Notify;
use weft_wire::Tid;

use crate::api::FsError;
use crate::path::VPath;

/// Shared (read) or exclusive (write).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Readers share it.
    Shared,
    /// One writer.
    Exclusive,
}

#[derive(Default, Debug)]
struct Entry {
    /// Holders and how many times each took it shared.
    shared: HashMap<Tid, u32>,
    exclusive: Option<Tid>,
}

impl Entry {
    fn grantable(&self, tid: Tid, mode: Mode) -> Result<(), Vec<Tid>> {
        if let Some(x) = self.exclusive {
            if x != tid {
                return Err(vec![x]);
            }
            return Ok(());
        }
        if mode == Mode::Exclusive {
            let others: Vec<Tid> = self.shared.keys().copied().filter(|t| *t != tid).collect();
            if !others.is_empty() {
                return Err(others);
            }
        }
        Ok(())
    }

    fn is_empty(&self) -> bool {
        self.shared.is_empty() && self.exclusive.is_none()
    }
}

/// The pure lock table.
#[derive(Default, Debug)]
pub struct LockTable {
    entries: HashMap<VPath, Entry>,
}

impl LockTable {
    /// Grants `mode` on `path` to `tid` if no other transaction conflicts;
    /// otherwise returns the holders in the way. A transaction holding the
    /// exclusive lock holds every mode.
    pub fn try_lock(&mut self, tid: Tid, path: &VPath, mode: Mode) -> Result<(), Vec<Tid>> {
        let e = self.entries.entry(path.clone()).or_default();
        if let Err(h) = e.grantable(tid, mode) {
            if e.is_empty() {
                self.entries.remove(path);
            }
            return Err(h);
        }
        match mode {
            Mode::Exclusive => e.exclusive = Some(tid),
            Mode::Shared => *e.shared.entry(tid).or_insert(0) += 1,
        }
        Ok(())
    }

    /// Releases one shared hold of `tid` on `path` (a degree-2 read ends).
    /// Returns true when something was released.
    pub fn unlock_shared(&mut self, tid: Tid, path: &VPath) -> bool {
        let Some(e) = self.entries.get_mut(path) else {
            return false;
        };
        let released = match e.shared.get_mut(&tid) {
            Some(n) if *n > 1 => {
                *n -= 1;
                true
            }
            Some(_) => {
                e.shared.remove(&tid);
                true
            }
            None => false,
        };
        if e.is_empty() {
            self.entries.remove(path);
        }
        released
    }

    /// Releases every shared lock of `tid` (its reads are over: prepare).
    pub fn release_shared(&mut self, tid: Tid) {
        self.entries.retain(|_, e| {
            e.shared.remove(&tid);
            !e.is_empty()
        });
    }

    /// Releases every lock of `tid`.
    pub fn release_all(&mut self, tid: Tid) {
        self.entries.retain(|_, e| {
            e.shared.remove(&tid);
            if e.exclusive == Some(tid) {
                e.exclusive = None;
            }
            !e.is_empty()
        });
    }

    /// Paths locked (by anyone).
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True when nothing is locked.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Transactions holding locks, with how many paths each.
    pub fn holders(&self) -> HashMap<Tid, usize> {
        let mut out: HashMap<Tid, usize> = HashMap::new();
        for e in self.entries.values() {
            for t in e.shared.keys().chain(e.exclusive.iter()) {
                *out.entry(*t).or_default() += 1;
            }
        }
        out
    }
}

/// A lock table with bounded waits.
pub struct Locks {
    table: Mutex<LockTable>,
    released: Notify,
    max_paths: usize,
    max_waiters: usize,
    waiters: Mutex<usize>,
}

impl Locks {
    /// A table of at most `max_paths` locked paths and `max_waiters`
    /// waiting requests.
    pub fn new(max_paths: usize, max_waiters: usize) -> Locks {
        Locks {
            table: Mutex::new(LockTable::default()),
            released: Notify::new(),
            max_paths,
            max_waiters,
            waiters: Mutex::new(0),
        }
    }

    /// Takes `mode` on `path` for `tid`, waiting at most `bound`.
    ///
    /// Fails with LockConflict when not granted within the bound (at once
    /// for a zero bound), TooLarge when the table or its wait queue is full.
    pub async fn lock(
        &self,
        tid: Tid,
        path: &VPath,
        mode: Mode,
        bound: Duration,
    ) -> Result<(), FsError> {
        let deadline = Instant::now() + bound;
        let mut counted = false;
        let result = loop {
            let notified = self.released.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let holders = {
                let mut t = self.table.lock();
                if t.len() >= self.max_paths && !t.entries.contains_key(path) {
                    break Err(FsError::TooLarge(format!(
                        "{tid}: {} paths locked already (at most {})",
                        t.len(),
                        self.max_paths
                    )));
                }
                match t.try_lock(tid, path, mode) {
                    Ok(()) => break Ok(()),
                    Err(h) => h,
                }
            };
            let now = Instant::now();
            if now >= deadline {
                break Err(FsError::LockConflict(format!(
                    "{tid}: {mode:?} lock on {path} not granted within {bound:?} (held by {holders:?})"
                )));
            }
            if !counted {
                let mut w = self.waiters.lock();
                if *w >= self.max_waiters {
                    break Err(FsError::TooLarge(format!(
                        "{tid}: {w} lock requests waiting already (at most {})",
                        self.max_waiters
                    )));
                }
                *w += 1;
                counted = true;
            }
            let _ = tokio::time::timeout(deadline - now, notified).await;
        };
        if counted {
            *self.waiters.lock() -= 1;
        }
        result
    }

    /// Takes `mode` without waiting (recovery re-locks in-doubt branches).
    ///
    /// Fails with LockConflict when another transaction holds it.
    pub fn try_lock(&self, tid: Tid, path: &VPath, mode: Mode) -> Result<(), FsError> {
        self.table
            .lock()
            .try_lock(tid, path, mode)
            .map_err(|h| FsError::LockConflict(format!("{tid}: {path} held by {h:?}")))
    }

    /// Ends one degree-2 read hold.
    pub fn unlock_shared(&self, tid: Tid, path: &VPath) -> bool {
        let r = self.table.lock().unlock_shared(tid, path);
        if r {
            self.released.notify_waiters();
        }
        r
    }

    /// Releases `tid`'s read locks.
    pub fn release_shared(&self, tid: Tid) {
        self.table.lock().release_shared(tid);
        self.released.notify_waiters();
    }

    /// Releases all of `tid`'s locks.
    pub fn release_all(&self, tid: Tid) {
        self.table.lock().release_all(tid);
        self.released.notify_waiters();
    }

    /// Locked paths now.
    pub fn len(&self) -> usize {
        self.table.lock().len()
    }

    /// True when nothing is locked.
    pub fn is_empty(&self) -> bool {
        self.table.lock().is_empty()
    }

    /// Transactions holding locks, with how many paths each.
    pub fn holders(&self) -> HashMap<Tid, usize> {
        self.table.lock().holders()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use weft_wire::{Incarnation, NodeId};

    fn tid(n: u64) -> Tid {
        Tid {
            node: NodeId(1),
            incarnation: Incarnation(1),
            seq: n,
        }
    }

    fn p(s: &str) -> VPath {
        VPath::parse(s).unwrap()
    }

    #[test]
    fn shared_shares_exclusive_excludes() {
        let mut t = LockTable::default();
        t.try_lock(tid(1), &p("a"), Mode::Shared).unwrap();
        t.try_lock(tid(2), &p("a"), Mode::Shared).unwrap();
        let mut h = t.try_lock(tid(3), &p("a"), Mode::Exclusive).unwrap_err();
        h.sort();
        assert_eq!(h, vec![tid(1), tid(2)]);
        assert!(t.unlock_shared(tid(1), &p("a")));
        assert!(t.unlock_shared(tid(2), &p("a")));
        t.try_lock(tid(3), &p("a"), Mode::Exclusive).unwrap();
        // The holder of the exclusive lock holds every mode.
        t.try_lock(tid(3), &p("a"), Mode::Shared).unwrap();
        assert_eq!(t.try_lock(tid(1), &p("a"), Mode::Shared), Err(vec![tid(3)]));
        t.release_all(tid(3));
        assert!(t.is_empty());
    }

    #[test]
    fn upgrade_only_when_alone() {
        let mut t = LockTable::default();
        t.try_lock(tid(1), &p("a"), Mode::Shared).unwrap();
        t.try_lock(tid(1), &p("a"), Mode::Exclusive).unwrap();
        t.release_shared(tid(1));
        assert_eq!(t.len(), 1, "the exclusive lock stays");
        t.release_all(tid(1));
        assert!(t.is_empty());
    }

    #[tokio::test]
    async fn zero_bound_fails_at_once_and_a_release_wakes_a_waiter() {
        let locks = std::sync::Arc::new(Locks::new(100, 10));
        locks
            .lock(tid(1), &p("f"), Mode::Exclusive, Duration::ZERO)
            .await
            .unwrap();
        let e = locks
            .lock(tid(2), &p("f"), Mode::Shared, Duration::ZERO)
            .await
            .unwrap_err();
        assert!(matches!(e, FsError::LockConflict(_)), "{e}");
        let l2 = locks.clone();
        let waiter = tokio::spawn(async move {
            l2.lock(tid(2), &p("f"), Mode::Shared, Duration::from_secs(3600))
                .await
        });
        // Poll until the waiter is queued, then release.
        while *locks.waiters.lock() == 0 {
            tokio::task::yield_now().await;
        }
        locks.release_all(tid(1));
        waiter.await.unwrap().unwrap();
    }

    #[tokio::test]
    async fn table_limit_is_enforced() {
        let locks = Locks::new(1, 1);
        locks
            .lock(tid(1), &p("a"), Mode::Shared, Duration::ZERO)
            .await
            .unwrap();
        let e = locks
            .lock(tid(1), &p("b"), Mode::Shared, Duration::ZERO)
            .await
            .unwrap_err();
        assert!(matches!(e, FsError::TooLarge(_)), "{e}");
    }
}
