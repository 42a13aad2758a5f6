//! The concurrency controller (CC): strict two-phase locking of data items
//! at one site, with Raid's bounded wait per action.
//!
//! Owns the site's lock table. Must never release a write lock before the
//! transaction's outcome is applied at this site (the site participant
//! applies, then releases).

use std::time::{Duration, Instant};

use weft_kv::lock::{LockError, LockManager, LockMode};
use weft_wire::{Failure, Status, SubPath, Tid, Xid};

use crate::schema::Item;

/// A site's concurrency controller.
pub struct Cc {
    locks: LockManager<Item, Xid>,
    wait: Duration,
}

impl Cc {
    /// A controller whose lock waits last at most `wait` (Raid: one second
    /// per action).
    pub fn new(wait: Duration) -> Cc {
        Cc {
            locks: LockManager::new(),
            wait,
        }
    }

    /// Locks `item` for `xid` in `mode`, waiting at most the bound (or until
    /// `deadline`).
    ///
    /// Fails with LockConflict naming the holders when the wait ends.
    pub async fn lock(
        &self,
        xid: &Xid,
        item: Item,
        mode: LockMode,
        deadline: Option<Instant>,
    ) -> Result<(), Failure> {
        let mut bound = self.wait;
        if let Some(d) = deadline {
            bound = bound.min(d.saturating_duration_since(Instant::now()));
        }
        self.locks.lock(xid.clone(), item, mode, bound).await.map_err(|e| match e {
            LockError::Conflict { key, holders } => Failure::new(
                Status::LockConflict,
                format!("{xid}: {mode} lock on {key} not granted within {bound:?} (held by {holders:?})"),
            ),
            other => Failure::new(Status::LockConflict, format!("{xid}: {other}")),
        })
    }

    /// Locks an item at recovery (no waiting: nothing else runs yet).
    ///
    /// Fails when the item is already locked by another transaction.
    pub fn relock(&self, tid: Tid, item: Item) -> Result<(), Failure> {
        self.locks
            .try_lock(Xid::top(tid), item, LockMode::Exclusive)
            .map_err(|e| {
                Failure::new(
                    Status::Internal,
                    format!("relocking {item:?} for {tid}: {e}"),
                )
            })
    }

    /// True when the transaction holds an exclusive lock here.
    pub fn holds_writes(&self, tid: Tid) -> bool {
        self.locks
            .locks_of(&tid)
            .iter()
            .any(|l| l.mode == LockMode::Exclusive)
    }

    /// Releases every lock of the transaction.
    pub fn release(&self, tid: Tid) {
        self.locks.release_all(&tid);
    }

    /// Releases the transaction's read locks (its reads are over once it
    /// prepares; strict 2PL keeps only the write locks to the end).
    pub fn release_reads(&self, tid: Tid) {
        self.locks.release_shared(&Xid::top(tid));
    }

    /// A sub-transaction ended: its locks pass to its parent or are released.
    pub fn sub_ended(&self, tid: Tid, path: &SubPath, committed: bool) {
        let owner = Xid {
            tid,
            path: path.clone(),
        };
        let _ = if committed {
            self.locks.commit_sub(&owner)
        } else {
            self.locks.abort_sub(&owner)
        };
    }

    /// Lock table statistics: (waits, conflicts).
    pub fn contention(&self) -> (u64, u64) {
        let s = self.locks.stats();
        (s.waits, s.conflicts + s.timeouts)
    }
}
