//! The lock manager: strict two-phase locking with nested transactions.
//!
//! Used by weft's transactional KV service and by the Raid concurrency
//! controller. It comes in two layers, the etcd-raft / quinn-proto way:
//!
//! - [`LockTable`] (in `table`) is the sans-IO core. It owns, per key, the
//!   granted holders and the FIFO queue of waiters, and decides every grant.
//!   Each call that can unblock waiters returns the [`WaitId`]s it granted or
//!   cancelled ([`Wakeups`]); nothing changes behind the caller's back.
//! - [`LockManager`] (in `manager`) is the thin tokio shell: it keeps the
//!   table behind a mutex, parks each waiting request on a oneshot channel,
//!   wakes it when the table grants it and gives up after a bounded wait.
//!
//! Locks are held by [`LockOwner`]s, which are (sub)transactions. Nesting
//! follows Moss: a request is compatible with a conflicting holder that is
//! its ancestor; a committed sub-transaction's locks pass to its parent; an
//! aborted one's locks are released; everything a transaction family holds is
//! released when the top-level transaction ends.
//!
//! This module owns lock state only. It must never do I/O, read a clock
//! inside the core, wait without a bound, hold the table's mutex across an
//! `.await`, or keep an entry for a key that has neither holders nor waiters.
//! It does not detect deadlocks: a deadlock becomes a timeout (a
//! [`LockError::Conflict`]) for one of the parties (QuickSilver's lesson:
//! never wait forever).

mod manager;
mod owner;
mod table;

#[cfg(test)]
mod manager_tests;
#[cfg(test)]
mod prop_tests;
#[cfg(test)]
mod table_tests;

pub use manager::{LockManager, LockStats};
pub use owner::{LockOwner, TestOwner};
pub use table::{Acquire, HeldLock, Holder, LockLimits, LockTable, Waiter, Wakeups};

use std::fmt;

/// How a lock is held: many readers or one writer (modulo nesting).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum LockMode {
    /// A read lock: compatible with other shared locks.
    Shared,
    /// A write lock: conflicts with every lock held by an unrelated owner.
    Exclusive,
}

impl LockMode {
    /// True if a lock in `self` mode and one in `other` mode cannot be held
    /// at once by unrelated owners (at least one of them is exclusive).
    pub fn conflicts_with(self, other: LockMode) -> bool {
        self == LockMode::Exclusive || other == LockMode::Exclusive
    }

    /// True if holding `self` already gives everything `wanted` asks for
    /// (exclusive covers both modes, shared covers shared only).
    pub fn covers(self, wanted: LockMode) -> bool {
        self >= wanted
    }
}

impl fmt::Display for LockMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LockMode::Shared => "S",
            LockMode::Exclusive => "X",
        })
    }
}

/// Names one queued lock request of a [`LockTable`]. Unique within the table
/// for its whole life (ids are never reused).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct WaitId(u64);

impl WaitId {
    /// The raw number, for logs and metrics.
    pub fn get(self) -> u64 {
        self.0
    }
}

impl fmt::Display for WaitId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "w{}", self.0)
    }
}

/// Why a lock operation failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum LockError {
    /// The lock could not be granted: refused at once by a no-wait request,
    /// or not granted within the caller's wait bound (which is also how a
    /// deadlock shows up). `holders` lists the key's holders at that moment
    /// as `owner:mode`; it may be empty when the request was only queued
    /// behind earlier waiters.
    #[error("lock conflict on {key}: held by [{}]", holders.join(", "))]
    Conflict {
        /// The key, formatted with `Debug`.
        key: String,
        /// The holders, each formatted as `{owner:?}:{mode}`.
        holders: Vec<String>,
    },
    /// The table already has its maximum number of keys
    /// ([`LockLimits::max_keys`]) and the request named a new one.
    #[error("lock table full: at most {limit} locked keys")]
    TableFull {
        /// The configured maximum.
        limit: usize,
    },
    /// The table already has its maximum number of queued requests
    /// ([`LockLimits::max_waiters`]) and this one would have had to wait.
    #[error("lock wait queue full: at most {limit} waiting requests")]
    QueueFull {
        /// The configured maximum.
        limit: usize,
    },
    /// [`LockTable::cancel`] named a wait that is not queued (it was already
    /// granted or cancelled, or never existed).
    #[error("no queued lock request {0}")]
    NoSuchWait(WaitId),
    /// `commit_sub`/`abort_sub` was given a top-level transaction; those end
    /// with `release_all`.
    #[error("{owner} is a top-level transaction, not a sub-transaction")]
    NotSubTransaction {
        /// The owner, formatted with `Debug`.
        owner: String,
    },
    /// The wait ended because the waiting (sub)transaction ended (its family
    /// was released, or it or an ancestor committed or aborted as a
    /// sub-transaction) before the lock was granted.
    #[error("wait for lock on {key} abandoned: the waiting transaction ended")]
    Abandoned {
        /// The key, formatted with `Debug`.
        key: String,
    },
}
