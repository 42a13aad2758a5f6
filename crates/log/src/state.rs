//! The log's shared in-memory state: buffered records, force requests, intents, and the
//! durable point; plus the group-commit decision the flusher acts on.
//!
//! Owns: where the next record goes (including the decision to roll to a new segment), the
//! buffer of encoded records not yet written, what has been asked to become durable, and
//! [`State::plan`], the sans-IO rule that says when the flusher syncs, waits for intents,
//! writes behind, or sleeps. Also owns the one way to wait for durability
//! ([`Shared::wait_blocking`], [`Shared::wait_async`]). Must never: do file I/O, or hold the
//! lock while anything slow (I/O, an `.await`) happens.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use parking_lot::{Condvar, Mutex, MutexGuard};
use tokio::sync::watch;

use crate::config::LogConfig;
use crate::error::{LogError, Result};
use crate::lsn::{Lsn, RecordTag};
use crate::record;
use crate::segment::SEGMENT_HEADER_LEN;
use crate::stats::{add, Counters};

/// Encoded records bound for one segment, contiguous in the file.
#[derive(Debug)]
pub(crate) struct Chunk {
    /// Base position of the segment the bytes belong to.
    pub seg_base: u64,
    /// File offset (within that segment) of `bytes[0]`.
    pub offset: u64,
    /// The segment does not exist yet: the flusher creates it before writing.
    pub new_segment: bool,
    /// Encoded records.
    pub bytes: Vec<u8>,
}

/// What the flusher takes in one go.
#[derive(Debug)]
pub(crate) struct Batch {
    pub chunks: Vec<Chunk>,
    /// LSN of the last record appended when the batch was taken (durable once it is synced).
    pub last_lsn: u64,
    /// Position right after that record.
    pub end: u64,
}

/// What the flusher should do next; the output of [`State::plan`].
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Plan {
    /// Nothing to do: sleep until woken, or until the instant if there is one.
    Sleep(Option<Instant>),
    /// A sync is wanted but force intents are outstanding: wait for them until the instant.
    AwaitIntents(Instant),
    /// Write everything buffered; then fdatasync if `sync`.
    Flush { sync: bool },
    /// Stop the flusher: the log is closed and everything appended is durable, or poisoned.
    Exit,
}

/// Outcome of registering a force or a lazy wait.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Request {
    /// The record is already durable.
    Durable,
    /// The caller must wait; `wake_flusher` says whether the flusher must be notified.
    Wait { wake_flusher: bool },
}

/// The mutable state behind the log's mutex.
#[derive(Debug)]
pub(crate) struct State {
    /// Base of the segment that receives the next record.
    pub seg_base: u64,
    /// Offset in that segment where the next record goes.
    pub seg_offset: u64,
    /// LSN of the last record appended (or recovered); 0 if none.
    pub last_lsn: u64,
    /// Encoded records not yet taken by the flusher.
    pub pending: Vec<Chunk>,
    /// Bytes in `pending`.
    pub pending_bytes: usize,
    /// Highest LSN a force asked for.
    pub force_target: u64,
    /// Highest LSN a lazy (`when_durable`) waiter asked for.
    pub lazy_target: u64,
    /// When the oldest unsatisfied lazy wait started.
    pub lazy_since: Option<Instant>,
    /// Force intents registered and not yet turned into forces or dropped.
    pub intents: usize,
    /// Deadline of the flusher's current wait for intents or for a batch.
    pub group_deadline: Option<Instant>,
    /// Force requests registered since the flusher last took a batch to sync.
    pub pending_forces: usize,
    /// When the previous force request arrived.
    pub last_force_at: Option<Instant>,
    /// Smoothed gap between force requests, in nanoseconds (the rate estimate).
    pub force_gap_ns: f64,
    /// Smoothed number of force requests each sync covered (the concurrency estimate: a
    /// lone committer's syncs cover one request each, however fast it loops).
    pub batch_avg: f64,
    /// LSN of the last durable record; 0 if none.
    pub durable_lsn: u64,
    /// Position right after the durable prefix of the log.
    pub durable_end: u64,
    /// The log start (records below it may be deleted).
    pub first_lsn: u64,
    /// Bases of the segment files that exist, oldest first; the last is the active one.
    pub segments: Vec<u64>,
    /// `close` was called: the flusher syncs everything and exits.
    pub closing: bool,
    /// The flusher thread has exited.
    pub stopped: bool,
    /// Why the log is poisoned, if it is.
    pub poisoned: Option<String>,
    /// Buffers the flusher gave back, reused by appends.
    pub spare: Vec<Vec<u8>>,
    /// Records appended since the log was opened (the flusher reports how
    /// many each sync made durable).
    pub appended: u64,
}

/// Rate estimate before any force request: one per second (no batching).
const INITIAL_FORCE_GAP_NS: f64 = 1e9;
/// Weight of the newest gap in the smoothed gap.
const FORCE_GAP_WEIGHT: f64 = 0.125;
/// Weight of the newest batch in the smoothed batch size.
const BATCH_WEIGHT: f64 = 0.25;
/// Smoothed requests per sync from which the flusher considers waiting for a batch.
const MIN_CONCURRENCY: f64 = 3.0;

/// Spare buffers kept for reuse, and the largest one kept.
const MAX_SPARE_BUFFERS: usize = 4;
const MAX_SPARE_CAPACITY: usize = 4 << 20;

impl State {
    /// State for a log whose next record goes at `seg_offset` in segment `seg_base`, and whose
    /// records up to `last_lsn` are all durable.
    pub(crate) fn new(segments: Vec<u64>, seg_offset: u64, last_lsn: u64, first_lsn: u64) -> State {
        let seg_base = *segments.last().expect("a log always has an active segment");
        State {
            seg_base,
            seg_offset,
            last_lsn,
            pending: Vec::new(),
            pending_bytes: 0,
            force_target: 0,
            lazy_target: 0,
            lazy_since: None,
            intents: 0,
            group_deadline: None,
            pending_forces: 0,
            last_force_at: None,
            force_gap_ns: INITIAL_FORCE_GAP_NS,
            batch_avg: 1.0,
            durable_lsn: last_lsn,
            durable_end: seg_base + seg_offset,
            first_lsn,
            segments,
            closing: false,
            stopped: false,
            poisoned: None,
            spare: Vec::new(),
            appended: 0,
        }
    }

    /// Position where the next record would start if it fits in the active segment.
    pub(crate) fn end(&self) -> u64 {
        self.seg_base + self.seg_offset
    }

    /// `Ok` if records may still be appended: not poisoned, not closed.
    pub(crate) fn check_usable(&self) -> Result<()> {
        if let Some(reason) = &self.poisoned {
            return Err(LogError::Poisoned {
                reason: reason.clone(),
            });
        }
        if self.closing || self.stopped {
            return Err(LogError::Closed);
        }
        Ok(())
    }

    /// Encodes one record into the buffer and returns its LSN and whether the flusher must be
    /// woken (the buffer just crossed the write-behind threshold).
    ///
    /// Rolls to a new segment when the record does not fit in the active one. Returns
    /// [`LogError::Poisoned`], [`LogError::Closed`] or [`LogError::BufferFull`].
    pub(crate) fn append(
        &mut self,
        config: &LogConfig,
        tag: RecordTag,
        payload: &[u8],
        payload_crc: u32,
    ) -> Result<(u64, bool)> {
        self.check_usable()?;
        let total = record::encoded_len(payload.len());
        if self.pending_bytes + total > config.max_buffered_bytes {
            return Err(LogError::BufferFull {
                buffered: self.pending_bytes,
                limit: config.max_buffered_bytes,
            });
        }
        let mut new_segment = false;
        if self.seg_offset + total as u64 > config.segment_size {
            // Roll: the next segment starts where this one's records end, so LSNs stay dense.
            self.seg_base += self.seg_offset;
            self.seg_offset = SEGMENT_HEADER_LEN;
            new_segment = true;
        }
        debug_assert!(self.seg_offset + total as u64 <= config.segment_size);
        let lsn = self.seg_base + self.seg_offset;
        debug_assert!(lsn > self.last_lsn, "LSNs must grow");

        let continues_last = !new_segment
            && self
                .pending
                .last()
                .is_some_and(|c| c.seg_base == self.seg_base);
        if !continues_last {
            let mut bytes = self.spare.pop().unwrap_or_default();
            bytes.clear();
            self.pending.push(Chunk {
                seg_base: self.seg_base,
                offset: self.seg_offset,
                new_segment,
                bytes,
            });
        }
        let chunk = self.pending.last_mut().expect("pushed above");
        debug_assert_eq!(chunk.offset + chunk.bytes.len() as u64, self.seg_offset);
        record::encode_into(&mut chunk.bytes, lsn, tag, payload, payload_crc);

        self.seg_offset += total as u64;
        self.last_lsn = lsn;
        self.appended += 1;
        let before = self.pending_bytes;
        self.pending_bytes += total;
        let wake =
            before < config.write_behind_bytes && self.pending_bytes >= config.write_behind_bytes;
        Ok((lsn, wake))
    }

    /// Registers a force of everything up to `lsn`.
    ///
    /// Returns [`LogError::NotAppended`] for an LSN beyond the last record, and
    /// [`LogError::Poisoned`] / [`LogError::Closed`] if `lsn` is not durable and can no longer
    /// become durable.
    pub(crate) fn request_force(
        &mut self,
        lsn: u64,
        now: Instant,
        batch: usize,
    ) -> Result<Request> {
        if lsn <= self.durable_lsn {
            return Ok(Request::Durable);
        }
        self.check_waitable(lsn)?;
        if let Some(prev) = self.last_force_at {
            let gap = now.saturating_duration_since(prev).as_nanos() as f64;
            self.force_gap_ns +=
                FORCE_GAP_WEIGHT * (gap.min(INITIAL_FORCE_GAP_NS) - self.force_gap_ns);
        }
        self.last_force_at = Some(now);
        self.pending_forces += 1;
        // Wake the flusher for the first request since the last sync, and when a batch
        // it may be waiting for is complete.
        let wake_flusher = self.force_target <= self.durable_lsn || self.pending_forces == batch;
        self.force_target = self.force_target.max(lsn);
        Ok(Request::Wait { wake_flusher })
    }

    /// Registers a lazy wait for `lsn`: no sync is requested now, but the flusher forces once
    /// `lazy_flush_interval` has passed. Errors as [`State::request_force`].
    pub(crate) fn request_lazy(&mut self, lsn: u64, now: Instant) -> Result<Request> {
        if lsn <= self.durable_lsn {
            return Ok(Request::Durable);
        }
        self.check_waitable(lsn)?;
        self.lazy_target = self.lazy_target.max(lsn);
        let wake_flusher = self.lazy_since.is_none();
        if wake_flusher {
            self.lazy_since = Some(now);
        }
        Ok(Request::Wait { wake_flusher })
    }

    /// Checks that a record that is not yet durable can still become durable.
    fn check_waitable(&self, lsn: u64) -> Result<()> {
        if let Some(reason) = &self.poisoned {
            return Err(LogError::Poisoned {
                reason: reason.clone(),
            });
        }
        if self.stopped {
            return Err(LogError::Closed);
        }
        if lsn > self.last_lsn {
            return Err(LogError::NotAppended {
                lsn: Lsn(lsn),
                last: Lsn(self.last_lsn),
            });
        }
        Ok(())
    }

    /// Releases one force intent; returns whether the flusher must be woken (it may be
    /// waiting for exactly this).
    pub(crate) fn release_intent(&mut self) -> bool {
        debug_assert!(self.intents > 0, "intent released twice");
        self.intents = self.intents.saturating_sub(1);
        self.intents == 0 && self.force_target > self.durable_lsn
    }

    /// How a waiter for `lsn` stands: `Some(Ok)` durable, `Some(Err)` never will be, `None`
    /// keep waiting.
    pub(crate) fn wait_outcome(&self, lsn: u64) -> Option<Result<()>> {
        if lsn <= self.durable_lsn {
            return Some(Ok(()));
        }
        if let Some(reason) = &self.poisoned {
            return Some(Err(LogError::Poisoned {
                reason: reason.clone(),
            }));
        }
        if self.stopped {
            return Some(Err(LogError::Closed));
        }
        None
    }

    /// The group-commit rule: what the flusher does next, given the time `now`.
    ///
    /// - poisoned → exit; closing → sync everything, then exit;
    /// - a lazy wait older than `lazy_flush_interval` becomes a force;
    /// - a force is pending → sync, unless intents are outstanding and
    ///   `group_commit_max_delay` is non-zero, in which case wait for them until that delay
    ///   (counted from when the wait began) has passed;
    /// - `write_behind_bytes` buffered → write without syncing;
    /// - otherwise sleep, until the oldest lazy wait falls due if there is one.
    pub(crate) fn plan(&mut self, now: Instant, config: &LogConfig, counters: &Counters) -> Plan {
        if self.poisoned.is_some() {
            return Plan::Exit;
        }
        if self.closing {
            return if self.pending.is_empty() && self.durable_lsn == self.last_lsn {
                Plan::Exit
            } else {
                Plan::Flush { sync: true }
            };
        }
        let lazy_due = if self.lazy_target > self.durable_lsn {
            self.lazy_since.map(|t| t + config.lazy_flush_interval)
        } else {
            None
        };
        if let Some(due) = lazy_due.filter(|&due| now >= due) {
            if self.force_target < self.lazy_target {
                self.force_target = self.lazy_target;
                add(&counters.lazy_syncs, 1);
            }
            debug_assert!(due <= now);
        }
        if self.force_target > self.durable_lsn {
            if self.intents > 0 && !config.group_commit_max_delay.is_zero() {
                match self.group_deadline {
                    None => {
                        let deadline = now + config.group_commit_max_delay;
                        self.group_deadline = Some(deadline);
                        add(&counters.intent_waits, 1);
                        return Plan::AwaitIntents(deadline);
                    }
                    Some(deadline) if now < deadline => return Plan::AwaitIntents(deadline),
                    Some(_) => add(&counters.intent_wait_timeouts, 1),
                }
            }
            if self.worth_batching(now, config) {
                match self.group_deadline {
                    None => {
                        let deadline = now + config.group_commit_max_delay;
                        self.group_deadline = Some(deadline);
                        add(&counters.batch_waits, 1);
                        return Plan::AwaitIntents(deadline);
                    }
                    Some(deadline) if now < deadline => return Plan::AwaitIntents(deadline),
                    Some(_) => {}
                }
            }
            self.group_deadline = None;
            return Plan::Flush { sync: true };
        }
        self.group_deadline = None;
        if self.pending_bytes >= config.write_behind_bytes {
            return Plan::Flush { sync: false };
        }
        Plan::Sleep(lazy_due)
    }

    /// True when a sync should wait for more force requests: recent syncs each covered
    /// several requests (committers are concurrent, not one committer looping), fewer than
    /// the target batch are pending, and at the recent arrival rate at least a quarter of a
    /// batch will have arrived before the deadline.
    fn worth_batching(&self, now: Instant, config: &LogConfig) -> bool {
        let batch = config.group_commit_batch;
        if batch <= 1
            || config.group_commit_max_delay.is_zero()
            || self.pending_forces >= batch
            || self.batch_avg < MIN_CONCURRENCY
        {
            return false;
        }
        let left = match self.group_deadline {
            Some(d) => d.saturating_duration_since(now),
            None => config.group_commit_max_delay,
        };
        let expected =
            self.pending_forces as f64 + left.as_nanos() as f64 / self.force_gap_ns.max(1.0);
        expected >= (batch as f64 / 4.0).max(2.0)
    }

    /// Takes every buffered record for the flusher.
    pub(crate) fn take_batch(&mut self) -> Batch {
        self.pending_bytes = 0;
        if self.pending_forces > 0 {
            self.batch_avg += BATCH_WEIGHT * (self.pending_forces as f64 - self.batch_avg);
        }
        self.pending_forces = 0;
        Batch {
            chunks: std::mem::take(&mut self.pending),
            last_lsn: self.last_lsn,
            end: self.end(),
        }
    }

    /// Gives a written chunk's buffer back for reuse.
    pub(crate) fn recycle(&mut self, mut bytes: Vec<u8>) {
        if self.spare.len() < MAX_SPARE_BUFFERS && bytes.capacity() <= MAX_SPARE_CAPACITY {
            bytes.clear();
            self.spare.push(bytes);
        }
    }

    /// Records that everything up to `last_lsn` (ending at `end`) is durable.
    pub(crate) fn publish_durable(&mut self, last_lsn: u64, end: u64, now: Instant) {
        debug_assert!(
            last_lsn >= self.durable_lsn,
            "durable point must not move back"
        );
        debug_assert!(last_lsn <= self.last_lsn);
        self.durable_lsn = last_lsn;
        self.durable_end = end;
        self.lazy_since = (self.lazy_target > last_lsn).then_some(now);
    }
}

/// What async waiters watch: the durable point, and whether the flusher stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Progress {
    pub durable_lsn: u64,
    pub halted: bool,
}

/// Everything the log handles, intents and the flusher share.
#[derive(Debug)]
pub(crate) struct Shared {
    pub config: LogConfig,
    pub state: Mutex<State>,
    /// The flusher sleeps on this; appends, forces and intents wake it.
    pub flusher_cv: Condvar,
    /// Blocking waiters sleep on this; the flusher wakes them after each sync.
    pub durable_cv: Condvar,
    /// Async waiters watch this; the flusher publishes after each sync.
    pub progress: watch::Sender<Progress>,
    /// Copy of `State::durable_lsn` for lock-free reads.
    pub durable: AtomicU64,
    pub counters: Counters,
    /// Serializes `truncate_before` calls.
    pub truncate_lock: Mutex<()>,
}

impl Shared {
    /// Wraps a fresh state.
    pub(crate) fn new(config: LogConfig, state: State) -> Shared {
        let durable = state.durable_lsn;
        let (progress, _) = watch::channel(Progress {
            durable_lsn: durable,
            halted: false,
        });
        Shared {
            config,
            state: Mutex::new(state),
            flusher_cv: Condvar::new(),
            durable_cv: Condvar::new(),
            progress,
            durable: AtomicU64::new(durable),
            counters: Counters::default(),
            truncate_lock: Mutex::new(()),
        }
    }

    /// The durable point without taking the lock.
    pub(crate) fn durable_lsn(&self) -> u64 {
        self.durable.load(Ordering::Acquire)
    }

    /// Registers a force of `lsn` (releasing one intent first if `from_intent`), wakes the
    /// flusher if needed, and says whether the caller must wait.
    pub(crate) fn begin_force(&self, lsn: u64, from_intent: bool) -> Result<Request> {
        add(&self.counters.forces_requested, 1);
        let (request, wake) = {
            let mut st = self.state.lock();
            let wake_for_intent = from_intent && st.release_intent();
            let request = st.request_force(lsn, Instant::now(), self.config.group_commit_batch);
            let wake =
                wake_for_intent || matches!(request, Ok(Request::Wait { wake_flusher: true }));
            (request, wake)
        };
        if wake {
            self.flusher_cv.notify_one();
        }
        if matches!(request, Ok(Request::Durable)) {
            add(&self.counters.forces_already_durable, 1);
        }
        request
    }

    /// Registers a lazy wait for `lsn`, waking the flusher to arm its timer if needed.
    pub(crate) fn begin_lazy(&self, lsn: u64) -> Result<Request> {
        let request = self.state.lock().request_lazy(lsn, Instant::now());
        if matches!(request, Ok(Request::Wait { wake_flusher: true })) {
            self.flusher_cv.notify_one();
        }
        request
    }

    /// Blocks the calling thread until `lsn` is durable, or the log is poisoned or stopped.
    pub(crate) fn wait_blocking(&self, lsn: u64) -> Result<()> {
        let mut st: MutexGuard<'_, State> = self.state.lock();
        loop {
            if let Some(outcome) = st.wait_outcome(lsn) {
                return outcome;
            }
            self.durable_cv.wait(&mut st);
        }
    }

    /// Waits, without blocking the executor thread, until `lsn` is durable, or the log is
    /// poisoned or stopped.
    pub(crate) async fn wait_async(&self, lsn: u64) -> Result<()> {
        let mut rx = self.progress.subscribe();
        let seen = rx
            .wait_for(|p| p.durable_lsn >= lsn || p.halted)
            .await
            .map(|p| *p);
        match seen {
            Ok(p) if p.durable_lsn >= lsn => Ok(()),
            // Halted (or the sender is gone, which cannot happen while `self` lives): the state
            // says why.
            _ => self
                .state
                .lock()
                .wait_outcome(lsn)
                .unwrap_or(Err(LogError::Closed)),
        }
    }

    /// Publishes a new durable point to every kind of waiter.
    pub(crate) fn announce(&self, st: &State) {
        self.durable.store(st.durable_lsn, Ordering::Release);
        self.progress.send_replace(Progress {
            durable_lsn: st.durable_lsn,
            halted: st.stopped,
        });
        self.durable_cv.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn config() -> LogConfig {
        LogConfig::new("/unused")
            .segment_size(256)
            .max_record_size(64)
            .write_behind_bytes(1 << 20)
            .group_commit_max_delay(Duration::from_millis(1))
            .lazy_flush_interval(Duration::from_millis(5))
    }

    fn fresh() -> State {
        State::new(vec![0], SEGMENT_HEADER_LEN, 0, 0)
    }

    #[test]
    fn appends_roll_to_a_new_segment_where_the_old_one_ends() {
        let cfg = config();
        let mut st = fresh();
        let payload = [7u8; 64]; // 88 bytes encoded
        let crc = record::payload_crc(&payload);
        let lsns: Vec<u64> = (0..4)
            .map(|_| st.append(&cfg, RecordTag(1), &payload, crc).unwrap().0)
            .collect();
        // Segment 0 holds two records (32 + 2 * 88 = 208 <= 256); the third rolls to base 208.
        assert_eq!(lsns, vec![32, 120, 240, 328]);
        assert_eq!(st.pending.len(), 2);
        assert!(!st.pending[0].new_segment && st.pending[1].new_segment);
        assert_eq!((st.pending[1].seg_base, st.pending[1].offset), (208, 32));
    }

    #[test]
    fn a_fast_stream_of_forces_waits_for_a_batch_a_slow_one_does_not() {
        let cfg = config(); // max delay 1 ms, batch 16
        let counters = Counters::default();
        let crc = record::payload_crc(b"x");
        // Requests 20 µs apart, and recent syncs covered many requests each: 50 would
        // arrive within the delay, so the flusher waits.
        let mut st = fresh();
        st.batch_avg = 8.0;
        let t0 = Instant::now();
        let mut lsn;
        for i in 0..4u32 {
            lsn = st.append(&cfg, RecordTag(1), b"x", crc).unwrap().0;
            let at = t0 + Duration::from_micros(20 * u64::from(i));
            st.request_force(lsn, at, cfg.group_commit_batch).unwrap();
        }
        let now = t0 + Duration::from_micros(80);
        assert!(matches!(
            st.plan(now, &cfg, &counters),
            Plan::AwaitIntents(_)
        ));
        // The batch completes: the request that makes it 16 wakes the flusher, which syncs.
        let mut woke = false;
        for i in 4..16u32 {
            lsn = st.append(&cfg, RecordTag(1), b"x", crc).unwrap().0;
            let at = t0 + Duration::from_micros(20 * u64::from(i));
            woke = matches!(
                st.request_force(lsn, at, cfg.group_commit_batch).unwrap(),
                Request::Wait { wake_flusher: true }
            );
        }
        assert!(woke, "the 16th request wakes the flusher");
        assert_eq!(st.plan(now, &cfg, &counters), Plan::Flush { sync: true });
        assert_eq!(counters.snapshot().batch_waits, 1);
        let _ = st.take_batch();
        assert_eq!(st.pending_forces, 0);

        // Requests 2 ms apart (a serialized hot spot): each syncs at once.
        let mut st = fresh();
        st.batch_avg = 8.0;
        for i in 0..4u32 {
            let at = t0 + Duration::from_millis(2 * u64::from(i));
            lsn = st.append(&cfg, RecordTag(1), b"x", crc).unwrap().0;
            st.request_force(lsn, at, 16).unwrap();
            assert_eq!(
                st.plan(at, &cfg, &counters),
                Plan::Flush { sync: true },
                "request {i}"
            );
            let batch = st.take_batch();
            st.publish_durable(batch.last_lsn, batch.end, at);
        }
    }

    #[test]
    fn a_lone_committer_looping_fast_never_waits_for_a_batch() {
        let cfg = config();
        let counters = Counters::default();
        let crc = record::payload_crc(b"x");
        let mut st = fresh();
        let t0 = Instant::now();
        // One request per sync, 10 µs apart: fast, but never concurrent.
        for i in 0..50u32 {
            let at = t0 + Duration::from_micros(10 * u64::from(i));
            let lsn = st.append(&cfg, RecordTag(1), b"x", crc).unwrap().0;
            st.request_force(lsn, at, cfg.group_commit_batch).unwrap();
            assert_eq!(
                st.plan(at, &cfg, &counters),
                Plan::Flush { sync: true },
                "request {i}"
            );
            let batch = st.take_batch();
            st.publish_durable(batch.last_lsn, batch.end, at);
        }
        assert_eq!(counters.snapshot().batch_waits, 0);
    }

    #[test]
    fn lone_force_syncs_at_once_and_intents_make_it_wait_bounded() {
        let cfg = config();
        let counters = Counters::default();
        let mut st = fresh();
        let crc = record::payload_crc(b"x");
        let (lsn, _) = st.append(&cfg, RecordTag(1), b"x", crc).unwrap();
        let t0 = Instant::now();
        assert_eq!(st.plan(t0, &cfg, &counters), Plan::Sleep(None));
        assert_eq!(
            st.request_force(lsn, Instant::now(), 16).unwrap(),
            Request::Wait { wake_flusher: true }
        );
        assert_eq!(st.plan(t0, &cfg, &counters), Plan::Flush { sync: true });

        st.intents = 1;
        let deadline = t0 + cfg.group_commit_max_delay;
        assert_eq!(st.plan(t0, &cfg, &counters), Plan::AwaitIntents(deadline));
        // The deadline is fixed when the wait starts; later plans keep it.
        let later = t0 + Duration::from_micros(500);
        assert_eq!(
            st.plan(later, &cfg, &counters),
            Plan::AwaitIntents(deadline)
        );
        assert_eq!(
            st.plan(deadline, &cfg, &counters),
            Plan::Flush { sync: true }
        );
        assert_eq!(counters.snapshot().intent_wait_timeouts, 1);

        // An intent turning into a force ends the wait early.
        st.group_deadline = None;
        assert!(matches!(
            st.plan(t0, &cfg, &counters),
            Plan::AwaitIntents(_)
        ));
        assert!(st.release_intent(), "the flusher must be woken");
        assert_eq!(st.plan(t0, &cfg, &counters), Plan::Flush { sync: true });
    }

    #[test]
    fn lazy_waits_become_a_sync_after_the_interval() {
        let cfg = config();
        let counters = Counters::default();
        let mut st = fresh();
        let crc = record::payload_crc(b"x");
        let (lsn, _) = st.append(&cfg, RecordTag(1), b"x", crc).unwrap();
        let t0 = Instant::now();
        assert_eq!(
            st.request_lazy(lsn, t0).unwrap(),
            Request::Wait { wake_flusher: true }
        );
        let due = t0 + cfg.lazy_flush_interval;
        assert_eq!(st.plan(t0, &cfg, &counters), Plan::Sleep(Some(due)));
        assert_eq!(st.plan(due, &cfg, &counters), Plan::Flush { sync: true });
        let batch = st.take_batch();
        st.publish_durable(batch.last_lsn, batch.end, due);
        assert_eq!(st.lazy_since, None);
        assert_eq!(st.plan(due, &cfg, &counters), Plan::Sleep(None));
        assert_eq!(counters.snapshot().lazy_syncs, 1);
    }

    #[test]
    fn forcing_the_unappended_is_an_error_and_closing_drains() {
        let cfg = config();
        let counters = Counters::default();
        let mut st = fresh();
        assert!(matches!(
            st.request_force(1000, Instant::now(), 16),
            Err(LogError::NotAppended { .. })
        ));
        assert_eq!(
            st.request_force(0, Instant::now(), 16).unwrap(),
            Request::Durable
        );
        let crc = record::payload_crc(b"x");
        st.append(&cfg, RecordTag(1), b"x", crc).unwrap();
        st.closing = true;
        assert!(matches!(
            st.append(&cfg, RecordTag(1), b"x", crc),
            Err(LogError::Closed)
        ));
        assert_eq!(
            st.plan(Instant::now(), &cfg, &counters),
            Plan::Flush { sync: true }
        );
        let batch = st.take_batch();
        st.publish_durable(batch.last_lsn, batch.end, Instant::now());
        assert_eq!(st.plan(Instant::now(), &cfg, &counters), Plan::Exit);
    }
}
