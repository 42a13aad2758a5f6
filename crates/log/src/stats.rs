//! Counters of what the log did, for benchmarks and operators.
//!
//! Owns: the atomic counters and the [`LogStats`] snapshot. Must never: influence behaviour;
//! counters are written with relaxed ordering and only ever read for reporting.

use std::sync::atomic::{AtomicU64, Ordering};

use serde::{Deserialize, Serialize};

/// A snapshot of a log's counters since it was opened.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LogStats {
    /// Records appended.
    pub appends: u64,
    /// Payload bytes appended.
    pub bytes_appended: u64,
    /// Bytes written to segment files (headers and padding included).
    pub bytes_written: u64,
    /// fdatasync calls on segment files (each one a group commit, or a segment rollover).
    pub syncs: u64,
    /// Total time spent in those fdatasync calls, in microseconds.
    pub sync_micros: u64,
    /// Calls to `force`, `force_blocking` and `ForceIntent::force`.
    pub forces_requested: u64,
    /// Of those, how many found their record already durable and did not wait.
    pub forces_already_durable: u64,
    /// Force intents registered.
    pub intents: u64,
    /// Times the flusher delayed a sync because intents were outstanding.
    pub intent_waits: u64,
    /// Of those, how many ended because the wait's bound (two measured syncs, at most
    /// `group_commit_max_delay`) ran out.
    pub intent_wait_timeouts: u64,
    /// Times the flusher delayed a sync to wait for the committers it expects (those its
    /// last sync released and those that arrived during it).
    pub batch_waits: u64,
    /// Syncs started because a `when_durable` waiter's interval ran out.
    pub lazy_syncs: u64,
    /// Segment files created by rollovers since the log was opened.
    pub segments_created: u64,
    /// Segment files deleted by `truncate_before`.
    pub segments_deleted: u64,
    /// Appends refused with `BufferFull`.
    pub buffer_full: u64,
}

impl LogStats {
    /// fdatasyncs per appended record (0 when nothing was appended): the benchmark's
    /// "forces per record". Group commit drives it well below 1.
    #[must_use]
    pub fn syncs_per_append(&self) -> f64 {
        if self.appends == 0 {
            0.0
        } else {
            self.syncs as f64 / self.appends as f64
        }
    }

    /// The counters accumulated between `earlier` and `self` (saturating).
    #[must_use]
    pub fn since(&self, earlier: &LogStats) -> LogStats {
        LogStats {
            appends: self.appends.saturating_sub(earlier.appends),
            bytes_appended: self.bytes_appended.saturating_sub(earlier.bytes_appended),
            bytes_written: self.bytes_written.saturating_sub(earlier.bytes_written),
            syncs: self.syncs.saturating_sub(earlier.syncs),
            sync_micros: self.sync_micros.saturating_sub(earlier.sync_micros),
            forces_requested: self
                .forces_requested
                .saturating_sub(earlier.forces_requested),
            forces_already_durable: self
                .forces_already_durable
                .saturating_sub(earlier.forces_already_durable),
            intents: self.intents.saturating_sub(earlier.intents),
            intent_waits: self.intent_waits.saturating_sub(earlier.intent_waits),
            intent_wait_timeouts: self
                .intent_wait_timeouts
                .saturating_sub(earlier.intent_wait_timeouts),
            batch_waits: self.batch_waits.saturating_sub(earlier.batch_waits),
            lazy_syncs: self.lazy_syncs.saturating_sub(earlier.lazy_syncs),
            segments_created: self
                .segments_created
                .saturating_sub(earlier.segments_created),
            segments_deleted: self
                .segments_deleted
                .saturating_sub(earlier.segments_deleted),
            buffer_full: self.buffer_full.saturating_sub(earlier.buffer_full),
        }
    }
}

/// The live counters behind [`LogStats`].
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub appends: AtomicU64,
    pub bytes_appended: AtomicU64,
    pub bytes_written: AtomicU64,
    pub syncs: AtomicU64,
    pub sync_micros: AtomicU64,
    pub forces_requested: AtomicU64,
    pub forces_already_durable: AtomicU64,
    pub intents: AtomicU64,
    pub intent_waits: AtomicU64,
    pub intent_wait_timeouts: AtomicU64,
    pub batch_waits: AtomicU64,
    pub lazy_syncs: AtomicU64,
    pub segments_created: AtomicU64,
    pub segments_deleted: AtomicU64,
    pub buffer_full: AtomicU64,
}

/// Adds `n` to a counter.
pub(crate) fn add(counter: &AtomicU64, n: u64) {
    counter.fetch_add(n, Ordering::Relaxed);
}

impl Counters {
    /// Reads every counter.
    pub(crate) fn snapshot(&self) -> LogStats {
        let r = |c: &AtomicU64| c.load(Ordering::Relaxed);
        LogStats {
            appends: r(&self.appends),
            bytes_appended: r(&self.bytes_appended),
            bytes_written: r(&self.bytes_written),
            syncs: r(&self.syncs),
            sync_micros: r(&self.sync_micros),
            forces_requested: r(&self.forces_requested),
            forces_already_durable: r(&self.forces_already_durable),
            intents: r(&self.intents),
            intent_waits: r(&self.intent_waits),
            intent_wait_timeouts: r(&self.intent_wait_timeouts),
            batch_waits: r(&self.batch_waits),
            lazy_syncs: r(&self.lazy_syncs),
            segments_created: r(&self.segments_created),
            segments_deleted: r(&self.segments_deleted),
            buffer_full: r(&self.buffer_full),
        }
    }
}
