//! weft's transactional key-value service, the reference two-phase resource.
//!
//! Per node: a store of byte keys and values, isolated by strict two-phase
//! locking ([`lock`]; a conflict waits up to a bound, then fails with
//! LockConflict), durable through the node's log (prepare records) plus
//! periodic checkpoints, recovered with the transaction manager's outcomes.
//! Committed data lives on disk ([`disk`]: a redb B-tree under a bounded
//! cache and overlay, checkpoints write what changed) or, behind
//! [`KvEngine::Memory`], all in memory with whole snapshots ([`snapshot`]);
//! see `docs/kv-storage.md`.
//! Read-only branches vote READ-ONLY and leave the protocol at once. Keys,
//! values, each transaction's write set, the lock table and scans are
//! bounded ([`KvLimits`]): past a bound an operation is refused with
//! TooLarge, NoBuffer or BadRequest before it holds anything.

pub mod api;
mod background;
mod bloom;
pub mod disk;
#[cfg(test)]
mod disk_tests;
pub mod lock;
mod overlay;
pub mod service;
pub mod snapshot;
pub mod store;

pub use api::{int_value, parse_int, KvRecord, KvRequest, KvResponse, Op, Reply, KV_RECORD_TAG};
pub use disk::{DiskOptions, DiskStore};
pub use service::{Kv, KvConfig, KvEngine, KvLimits, KvStats, Locking, SERVICE};
