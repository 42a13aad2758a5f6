//! Configuration of a log: where it lives and every limit it enforces.
//!
//! Owns: defaults, setters and validation of [`LogConfig`]. Must never: open files or start
//! threads; `Log::open` does that after [`LogConfig::validate`] accepted the values.

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::durable::Durability;
use crate::error::{LogError, Result};
use crate::record;
use crate::segment::SEGMENT_HEADER_LEN;

/// Default segment file size: 64 MiB.
pub const DEFAULT_SEGMENT_SIZE: u64 = 64 << 20;
/// Default maximum payload size of one record: 16 MiB.
pub const DEFAULT_MAX_RECORD_SIZE: usize = 16 << 20;
/// Default bound on how long the flusher waits for outstanding force intents: 500 µs. The
/// transaction manager registers an intent as soon as a transaction will need a force (a
/// two-phase resource joined, or a remote participant was called) and a lone committer never
/// waits (its own intent becomes its force). Measured with `weft bench commit` (64 clients,
/// 3 nodes on one disk): 200 µs gave 0.21 forces per commit, 500 µs 0.13 with higher
/// throughput and a lower p99 (fewer fdatasyncs compete for the disk). The flusher's own
/// bound, two measured fdatasyncs, comes first on a disk that syncs in under 250 µs.
pub const DEFAULT_GROUP_COMMIT_MAX_DELAY: Duration = Duration::from_micros(500);
/// Default largest company a sync waits for.
pub const DEFAULT_GROUP_COMMIT_BATCH: usize = 16;
/// Default interval after which lazily awaited records are forced anyway: 5 ms.
pub const DEFAULT_LAZY_FLUSH_INTERVAL: Duration = Duration::from_millis(5);
/// Default bound on bytes appended but not yet taken by the flusher: 64 MiB.
pub const DEFAULT_MAX_BUFFERED_BYTES: usize = 64 << 20;
/// Default amount of buffered bytes at which the flusher writes (without syncing): 1 MiB.
pub const DEFAULT_WRITE_BEHIND_BYTES: usize = 1 << 20;

/// Hard upper bound on `segment_size` (1 TiB), so offsets always fit comfortably in `u64`
/// arithmetic and `usize` buffers on 64-bit hosts.
const MAX_SEGMENT_SIZE: u64 = 1 << 40;

/// How a log is laid out on disk and which limits it enforces.
///
/// Build one with [`LogConfig::new`] and the chainable setters; [`crate::Log::open`] validates it.
///
/// ```
/// use std::time::Duration;
/// let config = weft_log::LogConfig::new("/var/lib/weft/log")
///     .segment_size(8 << 20)
///     .group_commit_max_delay(Duration::from_micros(100));
/// assert_eq!(config.segment_size, 8 << 20);
/// ```
#[derive(Clone, Debug)]
pub struct LogConfig {
    /// Directory holding the segment files and `log.meta`; created if missing.
    pub dir: PathBuf,
    /// Size of one segment file in bytes, header included. Default 64 MiB.
    pub segment_size: u64,
    /// Largest payload accepted by `append`. Default 16 MiB.
    pub max_record_size: usize,
    /// Longest time the flusher delays a requested sync, either while force intents are
    /// outstanding or while the committers it expects have not all arrived (see
    /// [`LogConfig::group_commit_batch`]). The wait is also never longer than two measured
    /// fdatasyncs. Zero disables both waits. Default 500 µs.
    pub group_commit_max_delay: Duration,
    /// Largest company a sync waits for. The flusher expects as many force requests as the
    /// last sync released plus those that arrived while it ran (a closed loop of N
    /// committers: N); it syncs at once when that many, or this many, are pending, and
    /// otherwise waits for them (bounded as above); a wait that times out lowers the
    /// expectation to those present. A lone committer, or a serialized hot spot, never
    /// waits. 1 disables waiting for company (intents are still waited for). Default 16.
    pub group_commit_batch: usize,
    /// Longest time a `when_durable` waiter waits before the log forces on its own.
    /// Default 5 ms.
    pub lazy_flush_interval: Duration,
    /// Allocate each segment's full size when it is created (fallocate), so a later
    /// fdatasync does not have to update the file size. Default true.
    pub preallocate: bool,
    /// Bound on bytes appended but not yet taken by the flusher; `append` returns
    /// [`LogError::BufferFull`] beyond it. Default 64 MiB.
    pub max_buffered_bytes: usize,
    /// The flusher writes buffered records to the file (without syncing) once this many bytes
    /// are buffered, so memory stays small even when nobody forces. Default 1 MiB.
    pub write_behind_bytes: usize,
    /// Fault injection for tests: the fdatasync with this 1-based number fails with EIO
    /// instead of running. `None` (the default) injects nothing.
    pub fail_sync_number: Option<u64>,
    /// How directory entries (segments, `log.meta`, the directory itself) are created,
    /// renamed, removed and synced. The default is the real file system; tests pass a
    /// [`Durability::simulated`] one to simulate power loss.
    pub durability: Durability,
}

impl LogConfig {
    /// A configuration for a log in `dir` with every other value at its default. Never fails.
    #[must_use]
    pub fn new(dir: impl AsRef<Path>) -> LogConfig {
        LogConfig {
            dir: dir.as_ref().to_path_buf(),
            segment_size: DEFAULT_SEGMENT_SIZE,
            max_record_size: DEFAULT_MAX_RECORD_SIZE,
            group_commit_max_delay: DEFAULT_GROUP_COMMIT_MAX_DELAY,
            group_commit_batch: DEFAULT_GROUP_COMMIT_BATCH,
            lazy_flush_interval: DEFAULT_LAZY_FLUSH_INTERVAL,
            preallocate: true,
            max_buffered_bytes: DEFAULT_MAX_BUFFERED_BYTES,
            write_behind_bytes: DEFAULT_WRITE_BEHIND_BYTES,
            fail_sync_number: None,
            durability: Durability::new(),
        }
    }

    /// Sets [`LogConfig::durability`].
    #[must_use]
    pub fn durability(mut self, durability: Durability) -> LogConfig {
        self.durability = durability;
        self
    }

    /// Sets [`LogConfig::segment_size`].
    #[must_use]
    pub fn segment_size(mut self, bytes: u64) -> LogConfig {
        self.segment_size = bytes;
        self
    }

    /// Sets [`LogConfig::max_record_size`].
    #[must_use]
    pub fn max_record_size(mut self, bytes: usize) -> LogConfig {
        self.max_record_size = bytes;
        self
    }

    /// Sets [`LogConfig::group_commit_batch`] (at least 1).
    #[must_use]
    pub fn group_commit_batch(mut self, batch: usize) -> LogConfig {
        self.group_commit_batch = batch.max(1);
        self
    }

    /// Sets [`LogConfig::group_commit_max_delay`].
    #[must_use]
    pub fn group_commit_max_delay(mut self, delay: Duration) -> LogConfig {
        self.group_commit_max_delay = delay;
        self
    }

    /// Sets [`LogConfig::lazy_flush_interval`].
    #[must_use]
    pub fn lazy_flush_interval(mut self, interval: Duration) -> LogConfig {
        self.lazy_flush_interval = interval;
        self
    }

    /// Sets [`LogConfig::preallocate`].
    #[must_use]
    pub fn preallocate(mut self, on: bool) -> LogConfig {
        self.preallocate = on;
        self
    }

    /// Sets [`LogConfig::max_buffered_bytes`].
    #[must_use]
    pub fn max_buffered_bytes(mut self, bytes: usize) -> LogConfig {
        self.max_buffered_bytes = bytes;
        self
    }

    /// Sets [`LogConfig::write_behind_bytes`].
    #[must_use]
    pub fn write_behind_bytes(mut self, bytes: usize) -> LogConfig {
        self.write_behind_bytes = bytes;
        self
    }

    /// Sets [`LogConfig::fail_sync_number`] (test-only fault injection).
    #[must_use]
    pub fn fail_sync_number(mut self, nth: Option<u64>) -> LogConfig {
        self.fail_sync_number = nth;
        self
    }

    /// Checks that the values fit together.
    ///
    /// Returns [`LogError::InvalidConfig`] when a segment cannot hold one maximum-size record
    /// after its header, when the buffer cannot hold one maximum-size record, or when a size
    /// is zero or absurdly large.
    pub fn validate(&self) -> Result<()> {
        let bad = |msg: String| Err(LogError::InvalidConfig(msg));
        if self.segment_size > MAX_SEGMENT_SIZE {
            return bad(format!(
                "segment_size {} exceeds the limit of {MAX_SEGMENT_SIZE}",
                self.segment_size
            ));
        }
        if self.max_record_size > record::MAX_PAYLOAD_LIMIT {
            return bad(format!(
                "max_record_size {} exceeds the format limit of {}",
                self.max_record_size,
                record::MAX_PAYLOAD_LIMIT
            ));
        }
        let largest = record::encoded_len(self.max_record_size) as u64;
        if self.segment_size < SEGMENT_HEADER_LEN + largest {
            return bad(format!(
                "segment_size {} cannot hold a record of max_record_size {} \
                 ({largest} bytes encoded) after the {SEGMENT_HEADER_LEN}-byte segment header",
                self.segment_size, self.max_record_size
            ));
        }
        if (self.max_buffered_bytes as u64) < largest {
            return bad(format!(
                "max_buffered_bytes {} cannot hold a record of max_record_size {}",
                self.max_buffered_bytes, self.max_record_size
            ));
        }
        if self.write_behind_bytes == 0 {
            return bad("write_behind_bytes must be positive".to_string());
        }
        if self.lazy_flush_interval.is_zero() {
            return bad("lazy_flush_interval must be positive".to_string());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_validate_and_tiny_segments_need_small_records() {
        LogConfig::new("/tmp/x").validate().unwrap();
        let tiny = LogConfig::new("/tmp/x").segment_size(4096);
        assert!(matches!(tiny.validate(), Err(LogError::InvalidConfig(_))));
        tiny.max_record_size(1024).validate().unwrap();
    }
}
