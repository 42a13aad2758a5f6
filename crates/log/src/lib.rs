//! # weft-log: the log manager
//!
//! One log per weft node, shared by every resource manager on it (the transaction manager, a
//! KV store, ...). After QuickSilver's log manager: "the abstraction of a record-oriented
//! append-only file ... accepts log records of arbitrary length from servers and buffers them
//! in memory. A server may request that all records up to some point be forced to disk."
//!
//! - [`Log::append`] buffers a record and returns its [`Lsn`], the record's byte position in
//!   the logical log stream. The first record of a fresh log has LSN 32 (one segment header).
//! - [`Log::force`] / [`Log::force_blocking`] make every record up to an LSN durable.
//!   Concurrent forces share one fdatasync (group commit): a dedicated flusher thread syncs
//!   everything buffered when a sync starts, and records arriving during that sync go into
//!   the next one. A device that is idle syncs at once; while committers that the last sync
//!   released are expected back, the flusher waits for them (at most about two syncs), so a
//!   closed loop of N committers shares one sync and no committer waits for company that is
//!   not coming. [`Log::intent`] lets a committer announce an imminent force so the flusher
//!   waits (as long, at most) for it to join the same sync.
//! - [`Log::when_durable`] waits without asking for a sync (lazy durability); the log syncs on
//!   its own after `lazy_flush_interval`.
//! - [`Log::open`] recovers: every record is validated (magic, length, CRC32C, LSN equals
//!   position); at the first invalid one the tail is cut off, reported in [`Recovered`], and
//!   never replayed.
//! - [`Log::truncate_before`] is the checkpoint hook: whole segments below an LSN are deleted.
//! - A failed write or fdatasync poisons the log ([`LogError::Poisoned`]): it is never retried
//!   as if it had succeeded.
//!
//! ## On disk
//!
//! Segment files `<dir>/<16 hex digits of the segment's base LSN>.wlog`, each a 32-byte
//! header followed by records; `<dir>/log.meta` holds the log start after a checkpoint;
//! `<dir>/log.lock` keeps a second `Log` out. A record is a 24-byte header
//! `{magic "WREC", len u32, crc32c u32, tag u16, flags u16, lsn u64}`, the payload, and zero
//! padding to a multiple of 8. The CRC32C covers the payload and every header field but
//! itself, so a torn record or one read at the wrong position is detected. A record never
//! spans segments. `FORMAT.md` in the crate has the byte-level description.
//!
//! ## Modules
//!
//! `record` (codec), `segment` (segment files), `dir` (directory lock, fsync, listing),
//! [`Durability`] (the one way to create, rename and remove directory entries durably, and a
//! power-loss simulation for tests), `meta`
//! (`log.meta`), `recovery` (scan and cut), `state` (in-memory state and the group-commit
//! rule), `flusher` (the writing thread), [`metrics`] (kept metric handles and the exporting
//! switch, shared with the layers above), `log` (the public handle), `stats`, [`bench`](mod@bench),
//! [`Storage`] / [`StorageFile`] (the storage seam every file operation goes through; the real
//! file system by default) and [`MemDisk`] (a simulated disk that loses unsynced writes at a
//! crash, may tear the last one and fails syncs on request, for the whole-cluster simulator).
//!
//! This crate is for Unix (it uses positional writes and `flock`).

#![deny(missing_docs)]
#![deny(unsafe_op_in_unsafe_fn)]

pub mod bench;
mod config;
mod dir;
mod durable;
mod error;
mod flusher;
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod fuzzing;
mod log;
mod lsn;
mod mem;
mod meta;
pub mod metrics;
mod record;
mod recovery;
mod segment;
mod state;
mod stats;
mod storage;

pub use crate::config::{
    LogConfig, DEFAULT_GROUP_COMMIT_MAX_DELAY, DEFAULT_LAZY_FLUSH_INTERVAL,
    DEFAULT_MAX_BUFFERED_BYTES, DEFAULT_MAX_RECORD_SIZE, DEFAULT_SEGMENT_SIZE,
    DEFAULT_WRITE_BEHIND_BYTES,
};
pub use crate::durable::{Durability, PowerLoss};
pub use crate::error::{LogError, Result};
pub use crate::log::{ForceIntent, Log, SegmentInfo};
pub use crate::lsn::{Lsn, RecordTag};
pub use crate::mem::{DiskFault, DiskStats, MemDisk};
pub use crate::recovery::{LogRecord, Recovered};
pub use crate::segment::SEGMENT_HEADER_LEN;
pub use crate::stats::LogStats;
pub use crate::storage::{RealFs, Storage, StorageFile};

/// Bytes of a record header; a record with a payload of `n` bytes occupies
/// [`encoded_len`]`(n)` bytes on disk.
pub const RECORD_HEADER_LEN: usize = record::RECORD_HEADER_LEN;

/// Bytes a record with a payload of `payload_len` bytes occupies in a segment (header and
/// padding to 8 bytes included). Never fails.
#[must_use]
pub const fn encoded_len(payload_len: usize) -> usize {
    record::encoded_len(payload_len)
}
