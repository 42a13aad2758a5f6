//! The public handle: [`Log`] and [`ForceIntent`].
//!
//! Owns: opening (lock, recover, start the flusher), the public operations and their argument
//! checks, checkpoint truncation, and shutdown. Must never: write segment records itself (the
//! flusher does), or block an async caller on anything but the state mutex, which is only ever
//! held for short, non-blocking work.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread::JoinHandle;

use parking_lot::Mutex;

use crate::config::LogConfig;
use crate::dir::{self, DirLock};
use crate::durable::Durability;
use crate::error::{LogError, Result};
use crate::flusher::Flusher;
use crate::lsn::{Lsn, RecordTag};
use crate::meta;
use crate::record;
use crate::recovery::{self, Recovered};
use crate::segment;
use crate::state::{Request, Shared, State};
use crate::stats::{add, LogStats};

/// A node's log: record-oriented, append-only, checksummed, in segment files, with group
/// commit.
///
/// `Log` is a cheap handle (`Clone`); every resource manager of a node holds one. The log is
/// closed by [`Log::close`] or when the last handle is dropped, which flushes everything
/// appended and stops the flusher thread.
///
/// ```
/// # fn main() -> Result<(), weft_log::LogError> {
/// use weft_log::{Log, LogConfig, RecordTag};
/// let dir = tempfile::tempdir().unwrap();
/// let (log, recovered) = Log::open(LogConfig::new(dir.path()))?;
/// assert!(recovered.records.is_empty());
/// let lsn = log.append(RecordTag(1), b"commit t1.1.7")?;
/// log.force_blocking(lsn)?;
/// assert!(log.durable_lsn() >= lsn);
/// log.close()?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Log {
    shared: Arc<Shared>,
    owner: Arc<Owner>,
}

/// Owns the flusher thread and the directory lock; dropped with the last `Log` handle.
struct Owner {
    shared: Arc<Shared>,
    flusher: Mutex<Option<JoinHandle<()>>>,
    /// Released by `close`, after the flusher stopped, so the directory can be reopened.
    lock: Mutex<Option<DirLock>>,
}

/// A segment file of the log, as listed by [`Log::segments`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SegmentInfo {
    /// Log position of the segment's first byte (its header); its first record is 32 bytes on.
    pub base: Lsn,
    /// The file.
    pub path: PathBuf,
}

impl Log {
    /// Opens (or creates) the log in `config.dir`, runs recovery, and starts the flusher.
    ///
    /// Returns the log and what recovery found: every valid record from the log start on, and
    /// a report of any torn or corrupt tail that was cut off. Appends continue right after the
    /// last valid record.
    ///
    /// Errors: [`LogError::InvalidConfig`] for inconsistent limits, [`LogError::Locked`] if
    /// another log has the directory open, [`LogError::Corrupt`] if records the log must have
    /// are missing (see [`Recovered`] for what is merely cut), [`LogError::Io`] otherwise.
    pub fn open(config: LogConfig) -> Result<(Log, Recovered)> {
        config.validate()?;
        dir::ensure_dir(&config.durability, &config.dir)?;
        let lock = DirLock::acquire(&config.durability, &config.dir)?;
        let recovery = recovery::recover(&config)?;

        let active_base = *recovery
            .segments
            .last()
            .expect("recovery always leaves an active segment");
        let active = segment::open(&config.durability, &config.dir, active_base)?;
        if config.preallocate {
            let ctx = || format!("preallocating segment {}", segment::file_name(active_base));
            let len = active.len().map_err(|e| LogError::io(ctx(), e))?;
            if len < config.segment_size {
                active
                    .allocate(config.segment_size)
                    .and_then(|()| active.sync_all())
                    .map_err(|e| LogError::io(ctx(), e))?;
            }
        }

        let state = State::new(
            recovery.segments,
            recovery.active_end,
            recovery.last_lsn,
            recovery.recovered.first_lsn.get(),
        );
        debug_assert_eq!(state.end(), recovery.recovered.end_lsn.get());
        let shared = Arc::new(Shared::new(config, state));
        let handle = Flusher::spawn(Arc::clone(&shared), active_base, active)?;
        let owner = Arc::new(Owner {
            shared: Arc::clone(&shared),
            flusher: Mutex::new(Some(handle)),
            lock: Mutex::new(Some(lock)),
        });
        Ok((Log { shared, owner }, recovery.recovered))
    }

    /// Buffers one record in memory and returns its LSN. The record is not durable until a
    /// force (or another caller's force, or the write-behind/close path) covers it.
    ///
    /// Never blocks on I/O. Errors: [`LogError::RecordTooLarge`] if the payload exceeds
    /// `max_record_size`, [`LogError::BufferFull`] if `max_buffered_bytes` are waiting for the
    /// flusher (force and retry), [`LogError::Poisoned`] after an I/O failure,
    /// [`LogError::Closed`] after `close`.
    pub fn append(&self, tag: RecordTag, payload: &[u8]) -> Result<Lsn> {
        let config = &self.shared.config;
        if payload.len() > config.max_record_size {
            return Err(LogError::RecordTooLarge {
                len: payload.len(),
                max: config.max_record_size,
            });
        }
        // Checksum the payload before taking the lock; only the header is hashed under it.
        let crc = record::payload_crc(payload);
        let result = self.shared.state.lock().append(config, tag, payload, crc);
        match result {
            Ok((lsn, wake)) => {
                if wake {
                    self.shared.flusher_cv.notify_one();
                }
                let counters = &self.shared.counters;
                add(&counters.appends, 1);
                add(&counters.bytes_appended, payload.len() as u64);
                Ok(Lsn(lsn))
            }
            Err(e) => {
                if matches!(e, LogError::BufferFull { .. }) {
                    add(&self.shared.counters.buffer_full, 1);
                }
                Err(e)
            }
        }
    }

    /// Makes every record up to and including `lsn` durable, waiting without blocking the
    /// executor thread. Concurrent forces share one fdatasync (group commit).
    ///
    /// Returns `Ok(())` at once if `lsn` is already durable (including [`Lsn::ZERO`]).
    /// Errors: [`LogError::NotAppended`] if no record up to `lsn` was appended,
    /// [`LogError::Poisoned`] if a write or fdatasync failed before `lsn` became durable,
    /// [`LogError::Closed`] if the log stopped first.
    pub async fn force(&self, lsn: Lsn) -> Result<()> {
        force_async(&self.shared, lsn, false).await
    }

    /// [`Log::force`] for threads that may block. Do not call it on an async executor thread.
    /// Same results and errors as [`Log::force`].
    pub fn force_blocking(&self, lsn: Lsn) -> Result<()> {
        force_blocking(&self.shared, lsn, false)
    }

    /// Waits until `lsn` is durable without asking for a sync: someone else's force will
    /// usually cover it (e.g. an acknowledgement that may piggyback on a commit). If nobody
    /// forces, the log syncs on its own after `lazy_flush_interval`, so this always ends.
    ///
    /// Errors: as [`Log::force`].
    pub async fn when_durable(&self, lsn: Lsn) -> Result<()> {
        if lsn.get() <= self.shared.durable_lsn() {
            return Ok(());
        }
        match self.shared.begin_lazy(lsn.get())? {
            Request::Durable => Ok(()),
            Request::Wait { .. } => self.shared.wait_async(lsn.get()).await,
        }
    }

    /// Announces that a force is imminent (e.g. a transaction entered its commit protocol).
    ///
    /// While intents are outstanding, the flusher delays a requested sync (for at most two
    /// measured syncs, and never past `group_commit_max_delay`) so that the intent holders'
    /// records join the same fdatasync.
    /// Turn the intent into a force with [`ForceIntent::force`], or drop it to withdraw.
    /// Never fails; on a closed log the eventual force reports the error.
    pub fn intent(&self) -> ForceIntent {
        self.shared.state.lock().intents += 1;
        add(&self.shared.counters.intents, 1);
        ForceIntent {
            shared: Arc::clone(&self.shared),
            armed: true,
        }
    }

    /// The LSN of the last durable record ([`Lsn::ZERO`] if none): every record at or below
    /// it survives a crash. Never fails; lock-free.
    #[must_use]
    pub fn durable_lsn(&self) -> Lsn {
        Lsn(self.shared.durable_lsn())
    }

    /// The LSN of the last record appended (or recovered); [`Lsn::ZERO`] if there is none.
    #[must_use]
    pub fn last_lsn(&self) -> Lsn {
        Lsn(self.shared.state.lock().last_lsn)
    }

    /// The position right after the last appended record. The next record starts here, or
    /// 32 bytes later if it has to start a new segment. Never fails.
    #[must_use]
    pub fn end_lsn(&self) -> Lsn {
        Lsn(self.shared.state.lock().end())
    }

    /// The log start: records below it may already be deleted and are never recovered.
    /// Never fails.
    #[must_use]
    pub fn first_lsn(&self) -> Lsn {
        Lsn(self.shared.state.lock().first_lsn)
    }

    /// Checkpoint truncation: the caller no longer needs records below `lsn`.
    ///
    /// Persists the new start in `log.meta` (atomically) and deletes every segment that lies
    /// wholly below `lsn`; the active segment is never deleted. Recovery then starts at
    /// `lsn`. Pass the LSN of a record (or [`Log::end_lsn`]). A value at or below the current
    /// start is a no-op. Blocks on file I/O: call it from a blocking context.
    ///
    /// Errors: [`LogError::NotDurable`] if `lsn` lies beyond the durable prefix,
    /// [`LogError::Poisoned`] / [`LogError::Closed`], [`LogError::Io`] if a deletion fails
    /// (the log stays consistent: an old start only means more to replay, and recovery removes
    /// segments left below the start). A failure to write `log.meta` or to fsync the
    /// directory also poisons the log: what the directory holds after a failed fsync is
    /// unknown, and retrying it could report success for entries already lost.
    pub fn truncate_before(&self, lsn: Lsn) -> Result<()> {
        let _serial = self.shared.truncate_lock.lock();
        let victims: Vec<u64> = {
            let st = self.shared.state.lock();
            if let Some(reason) = &st.poisoned {
                return Err(LogError::Poisoned {
                    reason: reason.clone(),
                });
            }
            if st.stopped {
                return Err(LogError::Closed);
            }
            if lsn.get() <= st.first_lsn {
                return Ok(());
            }
            if lsn.get() > st.durable_end {
                return Err(LogError::NotDurable {
                    lsn,
                    durable_end: Lsn(st.durable_end),
                });
            }
            st.segments
                .windows(2)
                .filter(|w| w[1] <= lsn.get())
                .map(|w| w[0])
                .collect()
        };
        let dir = &self.shared.config.dir;
        let dur = &self.shared.config.durability;
        meta::write(dur, dir, lsn.get()).map_err(|e| self.poison(e))?;
        let mut deleted = Vec::new();
        let mut failure = None;
        for &base in &victims {
            let p = segment::path(dir, base);
            match dur.remove_file(&p) {
                Ok(()) => deleted.push(base),
                Err(e) => {
                    failure = Some(LogError::io(format!("deleting {}", p.display()), e));
                    break;
                }
            }
        }
        if !deleted.is_empty() {
            dir::sync_dir(dur, dir).map_err(|e| self.poison(e))?;
        }
        {
            let mut st = self.shared.state.lock();
            st.first_lsn = st.first_lsn.max(lsn.get());
            st.segments.retain(|b| !deleted.contains(b));
        }
        add(&self.shared.counters.segments_deleted, deleted.len() as u64);
        failure.map_or(Ok(()), Err)
    }

    /// Poisons the log with `e` (the first poison wins), wakes every waiter and the flusher,
    /// and hands `e` back.
    fn poison(&self, e: LogError) -> LogError {
        tracing::error!(error = %e, "log poisoned");
        {
            let mut st = self.shared.state.lock();
            st.poisoned.get_or_insert_with(|| e.to_string());
            self.shared.announce(&st);
        }
        self.shared.flusher_cv.notify_one();
        e
    }

    /// How this log changes and syncs directory entries; resource managers that keep files
    /// next to the log (snapshots) use the same seam.
    #[must_use]
    pub fn durability(&self) -> &Durability {
        &self.shared.config.durability
    }

    /// The segment files of the log, oldest first; the last one is being written.
    /// Never fails.
    #[must_use]
    pub fn segments(&self) -> Vec<SegmentInfo> {
        let dir = &self.shared.config.dir;
        self.shared
            .state
            .lock()
            .segments
            .iter()
            .map(|&b| SegmentInfo {
                base: Lsn(b),
                path: segment::path(dir, b),
            })
            .collect()
    }

    /// A snapshot of the log's counters. Never fails.
    #[must_use]
    pub fn stats(&self) -> LogStats {
        self.shared.counters.snapshot()
    }

    /// The configuration the log was opened with.
    #[must_use]
    pub fn config(&self) -> &LogConfig {
        &self.shared.config
    }

    /// The log directory.
    #[must_use]
    pub fn dir(&self) -> &Path {
        &self.shared.config.dir
    }

    /// Why the log is poisoned, or `None` if it is healthy.
    #[must_use]
    pub fn poisoned(&self) -> Option<String> {
        self.shared.state.lock().poisoned.clone()
    }

    /// Flushes and syncs every appended record, then stops the flusher thread; afterwards
    /// appends fail with [`LogError::Closed`], and the directory may be opened again.
    /// Affects every handle of this log. Idempotent. Blocks until the final sync is done.
    ///
    /// Errors: [`LogError::Poisoned`] if a write or sync failed (now or earlier): records not
    /// yet durable then may be lost.
    pub fn close(&self) -> Result<()> {
        self.owner.close()
    }

    /// Stops the log the way a process crash would (used to simulate crashes
    /// in-process): records still buffered in memory are lost, records already
    /// handed to the operating system stay; every later operation fails with
    /// [`LogError::Poisoned`]; the directory lock is released so that a new
    /// [`Log::open`] of the same directory recovers what a restarted process
    /// would find.
    pub fn crash(&self) {
        {
            let mut st = self.shared.state.lock();
            st.pending.clear();
            st.pending_bytes = 0;
            st.poisoned
                .get_or_insert_with(|| "the process crashed".to_string());
            self.shared.announce(&st);
        }
        self.shared.flusher_cv.notify_one();
        let _ = self.owner.close();
    }
}

impl Owner {
    fn close(&self) -> Result<()> {
        let handle = self.flusher.lock().take();
        if let Some(handle) = handle {
            self.shared.state.lock().closing = true;
            self.shared.flusher_cv.notify_one();
            if handle.join().is_err() {
                tracing::error!("log flusher thread panicked");
                let mut st = self.shared.state.lock();
                st.poisoned
                    .get_or_insert_with(|| "the flusher thread panicked".to_string());
                st.stopped = true;
                self.shared.announce(&st);
            }
        }
        self.lock.lock().take();
        match &self.shared.state.lock().poisoned {
            Some(reason) => Err(LogError::Poisoned {
                reason: reason.clone(),
            }),
            None => Ok(()),
        }
    }
}

impl Drop for Owner {
    fn drop(&mut self) {
        if let Err(e) = self.close() {
            tracing::error!(error = %e, "log closed with an error");
        }
    }
}

impl fmt::Debug for Log {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let st = self.shared.state.lock();
        f.debug_struct("Log")
            .field("dir", &self.shared.config.dir)
            .field("first_lsn", &Lsn(st.first_lsn))
            .field("last_lsn", &Lsn(st.last_lsn))
            .field("durable_lsn", &Lsn(st.durable_lsn))
            .field("poisoned", &st.poisoned)
            .finish_non_exhaustive()
    }
}

/// A registered promise that a force is coming soon; see [`Log::intent`].
///
/// Consume it with [`ForceIntent::force`] (or [`ForceIntent::force_blocking`]). Dropping it
/// unused withdraws the intent, so the flusher stops waiting for it.
#[must_use = "an intent delays other committers' syncs until it is forced or dropped"]
pub struct ForceIntent {
    shared: Arc<Shared>,
    armed: bool,
}

impl ForceIntent {
    /// Turns the intent into a force of everything up to `lsn` and waits (asynchronously)
    /// for it. Same results and errors as [`Log::force`].
    pub async fn force(mut self, lsn: Lsn) -> Result<()> {
        self.armed = false;
        force_async(&self.shared, lsn, true).await
    }

    /// [`ForceIntent::force`] for threads that may block. Same results and errors.
    pub fn force_blocking(mut self, lsn: Lsn) -> Result<()> {
        self.armed = false;
        force_blocking(&self.shared, lsn, true)
    }
}

impl Drop for ForceIntent {
    fn drop(&mut self) {
        if self.armed {
            let wake = self.shared.state.lock().release_intent();
            if wake {
                self.shared.flusher_cv.notify_one();
            }
        }
    }
}

impl fmt::Debug for ForceIntent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ForceIntent")
            .field("armed", &self.armed)
            .finish()
    }
}

/// The one async force path (plain forces and intents).
async fn force_async(shared: &Shared, lsn: Lsn, from_intent: bool) -> Result<()> {
    if !from_intent && lsn.get() <= shared.durable_lsn() {
        add(&shared.counters.forces_requested, 1);
        add(&shared.counters.forces_already_durable, 1);
        return Ok(());
    }
    match shared.begin_force(lsn.get(), from_intent)? {
        Request::Durable => Ok(()),
        Request::Wait { .. } => shared.wait_async(lsn.get()).await,
    }
}

/// The one blocking force path (plain forces and intents).
fn force_blocking(shared: &Shared, lsn: Lsn, from_intent: bool) -> Result<()> {
    if !from_intent && lsn.get() <= shared.durable_lsn() {
        add(&shared.counters.forces_requested, 1);
        add(&shared.counters.forces_already_durable, 1);
        return Ok(());
    }
    match shared.begin_force(lsn.get(), from_intent)? {
        Request::Durable => Ok(()),
        Request::Wait { .. } => shared.wait_blocking(lsn.get()),
    }
}
