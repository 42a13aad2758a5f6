//! The flusher thread: the only writer of segment files once the log is open.
//!
//! Owns: the active segment file, writing buffered records into it, rolling to new segments,
//! and fdatasync — one sync for every record buffered when it starts (group commit). Follows
//! the decisions of [`State::plan`]. Must never: hold the state lock across I/O, publish a
//! record as durable before the fdatasync covering it returned success, or retry a failed
//! fdatasync (the failure poisons the log: after an EIO the kernel may have dropped the dirty
//! pages, and a retry that "succeeds" would lie).

use std::io;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use parking_lot::MutexGuard;

use crate::error::{LogError, Result};
use crate::metrics::{FixedCounter, FixedHistogram};
use crate::segment;
use crate::state::{Chunk, Plan, Shared};
use crate::stats::add;
use crate::storage::StorageFile;

/// `weft_log_forces_total`, `weft_log_force_duration_seconds` and
/// `weft_log_records_per_force` (docs/metrics.md): kept handles, so a force
/// hashes and looks up no key.
static FORCES: FixedCounter = FixedCounter::new("weft_log_forces_total");
static FORCE_DURATION: FixedHistogram = FixedHistogram::new("weft_log_force_duration_seconds");
static RECORDS_PER_FORCE: FixedHistogram = FixedHistogram::new("weft_log_records_per_force");

/// The flusher's private state: the file it writes.
pub(crate) struct Flusher {
    shared: Arc<Shared>,
    /// Base of the segment `active` is.
    active_base: u64,
    /// The segment file records are written to.
    active: Box<dyn StorageFile>,
    /// Bytes were written to `active` since its last fdatasync.
    unsynced: bool,
    /// fdatasyncs attempted so far (for fault injection).
    sync_attempts: u64,
    /// Records appended when the last sync's batch was taken.
    synced_records: u64,
    /// Duration of the last fdatasync, not yet reported to the group-commit rule.
    last_sync: Option<std::time::Duration>,
}

impl Flusher {
    /// Starts the flusher thread over the already-open active segment.
    /// Returns [`LogError::Io`] if the thread cannot be spawned.
    pub(crate) fn spawn(
        shared: Arc<Shared>,
        active_base: u64,
        active: Box<dyn StorageFile>,
    ) -> Result<JoinHandle<()>> {
        let flusher = Flusher {
            shared,
            active_base,
            active,
            unsynced: false,
            sync_attempts: 0,
            synced_records: 0,
            last_sync: None,
        };
        std::thread::Builder::new()
            .name("weft-log-flusher".to_string())
            .spawn(move || flusher.run())
            .map_err(|e| LogError::io("spawning the log flusher thread", e))
    }

    /// The flusher loop: plan, then sleep, wait for intents, or write and sync.
    fn run(mut self) {
        let shared = Arc::clone(&self.shared);
        let _halt_on_panic = HaltOnPanic(Arc::clone(&shared));
        let mut st = shared.state.lock();
        loop {
            match st.plan(Instant::now(), &shared.config, &shared.counters) {
                Plan::Exit => break,
                Plan::Sleep(None) => shared.flusher_cv.wait(&mut st),
                Plan::Sleep(Some(until)) | Plan::AwaitIntents(until) => {
                    let _ = shared.flusher_cv.wait_until(&mut st, until);
                }
                Plan::Flush { sync } => {
                    let mut batch = st.take_batch();
                    // Every record appended so far is in this batch or an earlier one.
                    let appended = st.appended;
                    let result = MutexGuard::unlocked(&mut st, || self.write(&batch.chunks, sync));
                    if let Some(took) = self.last_sync.take() {
                        st.note_sync(took);
                    }
                    for chunk in batch.chunks.drain(..) {
                        st.recycle(chunk.bytes);
                    }
                    match result {
                        Ok(created) => {
                            st.segments.extend(created);
                            if sync {
                                let records = appended.saturating_sub(self.synced_records);
                                self.synced_records = appended;
                                if records > 0 {
                                    RECORDS_PER_FORCE.record(records as f64);
                                }
                                st.publish_durable(batch.last_lsn, batch.end, Instant::now());
                                shared.announce(&st);
                            }
                        }
                        Err(e) => {
                            tracing::error!(error = %e, "log poisoned");
                            st.poisoned = Some(e.to_string());
                            break;
                        }
                    }
                }
            }
        }
        st.stopped = true;
        shared.announce(&st);
    }

    /// Writes the chunks (creating segments as they begin) and, if `sync`, fdatasyncs.
    /// Returns the bases of the segments it created.
    fn write(&mut self, chunks: &[Chunk], sync: bool) -> Result<Vec<u64>> {
        let shared = Arc::clone(&self.shared);
        let config = &shared.config;
        let mut created = Vec::new();
        for chunk in chunks {
            if chunk.new_segment {
                debug_assert!(
                    chunk.seg_base > self.active_base,
                    "segments only move forward"
                );
                // Records of the old segment become durable before any of the new one, so
                // recovery can always stop at the first gap.
                if self.unsynced {
                    self.sync()?;
                }
                self.active = segment::create(
                    &config.durability,
                    &config.dir,
                    chunk.seg_base,
                    config.segment_size,
                    config.preallocate,
                )?;
                self.active_base = chunk.seg_base;
                add(&self.shared.counters.segments_created, 1);
                created.push(chunk.seg_base);
            }
            debug_assert_eq!(
                chunk.seg_base, self.active_base,
                "chunk for another segment"
            );
            debug_assert!(
                chunk.offset >= segment::SEGMENT_HEADER_LEN,
                "record over a header"
            );
            self.active
                .write_all_at(&chunk.bytes, chunk.offset)
                .map_err(|e| {
                    LogError::io(
                        format!(
                            "writing {} bytes at offset {} of segment {}",
                            chunk.bytes.len(),
                            chunk.offset,
                            segment::file_name(chunk.seg_base)
                        ),
                        e,
                    )
                })?;
            add(
                &self.shared.counters.bytes_written,
                chunk.bytes.len() as u64,
            );
            self.unsynced = true;
        }
        if sync && self.unsynced {
            self.sync()?;
        }
        Ok(created)
    }

    /// One fdatasync of the active segment.
    fn sync(&mut self) -> Result<()> {
        self.sync_attempts += 1;
        let started = Instant::now();
        let outcome = if self.shared.config.fail_sync_number == Some(self.sync_attempts) {
            Err(io::Error::from_raw_os_error(libc::EIO))
        } else {
            self.active.sync_data()
        };
        outcome.map_err(|e| {
            LogError::io(
                format!(
                    "fdatasync of segment {}",
                    segment::file_name(self.active_base)
                ),
                e,
            )
        })?;
        let counters = &self.shared.counters;
        let took = started.elapsed();
        self.last_sync = Some(took);
        add(&counters.syncs, 1);
        add(&counters.sync_micros, took.as_micros() as u64);
        FORCES.increment(1);
        FORCE_DURATION.record(took.as_secs_f64());
        self.unsynced = false;
        Ok(())
    }
}

/// Poisons and halts the log if the flusher thread unwinds, so that no waiter waits forever
/// for a sync that will never come.
struct HaltOnPanic(Arc<Shared>);

impl Drop for HaltOnPanic {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let mut st = self.0.state.lock();
            st.poisoned
                .get_or_insert_with(|| "the log flusher thread panicked".to_string());
            st.stopped = true;
            self.0.announce(&st);
        }
    }
}
