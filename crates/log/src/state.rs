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
    /// Force requests covered by the batch being synced (0 when no sync is under way).
    pub in_sync_forces: usize,
    /// The company the next sync expects: how many force requesters are known to be active,
    /// namely those the last sync released plus those that arrived while it ran (at least 1).
    /// A closed loop of N committers keeps it at N; a lone committer, however fast it loops,
    /// at 1. It shrinks to the requesters present whenever a wait for company times out.
    pub company: usize,
    /// Smoothed duration of one fdatasync in nanoseconds; 0 until the first one is measured.
    pub sync_ns: f64,
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

/// Weight of the newest fdatasync in the smoothed sync time.
const SYNC_WEIGHT: f64 = 0.125;
/// A wait for company lasts at most this many smoothed syncs: waiting longer than about one
/// sync costs more than syncing now and letting the latecomers form the next batch.
const COMPANY_WAIT_SYNCS: f64 = 2.0;

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
            in_sync_forces: 0,
            company: 1,
            sync_ns: 0.0,
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
    pub(crate) fn request_force(&mut self, lsn: u64, batch: usize) -> Result<Request> {
        if lsn <= self.durable_lsn {
            return Ok(Request::Durable);
        }
        self.check_waitable(lsn)?;
        self.pending_forces += 1;
        // Wake the flusher for the first request since the last sync, and when the company
        // it may be waiting for is complete.
        let wake_flusher = self.force_target <= self.durable_lsn
            || self.pending_forces == self.wanted_company(batch);
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
    /// - a force is pending → sync, unless force intents are outstanding (a force is
    ///   announced) or the expected company is not here yet (as many requests as the last
    ///   sync released plus those that arrived during it, capped at `group_commit_batch`):
    ///   then wait for them, at most [`State::company_wait`] (about two syncs, never more
    ///   than `group_commit_max_delay`) counted from when the wait began. A wait for company
    ///   that times out shrinks the expected company to the requests present, so no
    ///   committer waits twice for company that is not coming;
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
            let wanted = self.wanted_company(config.group_commit_batch);
            let company_here = self.pending_forces >= wanted;
            let wait_for_intents = self.intents > 0;
            let wait_for_company = !company_here && config.group_commit_batch > 1 && wanted > 1;
            let may_wait =
                !config.group_commit_max_delay.is_zero() && (wait_for_intents || wait_for_company);
            if may_wait {
                match self.group_deadline {
                    None => {
                        let deadline = now + self.company_wait(config);
                        self.group_deadline = Some(deadline);
                        add(
                            if wait_for_intents {
                                &counters.intent_waits
                            } else {
                                &counters.batch_waits
                            },
                            1,
                        );
                        return Plan::AwaitIntents(deadline);
                    }
                    Some(deadline) if now < deadline => return Plan::AwaitIntents(deadline),
                    Some(_) => {
                        if wait_for_intents {
                            add(&counters.intent_wait_timeouts, 1);
                        }
                        if !company_here {
                            // Whoever did not come is not coming soon.
                            self.company = self.pending_forces.max(1);
                        }
                    }
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

    /// How many force requests make a batch worth syncing at once: the expected company,
    /// capped at the target batch.
    pub(crate) fn wanted_company(&self, batch: usize) -> usize {
        self.company.min(batch).max(1)
    }

    /// The longest wait for company or intents: two smoothed syncs, at most
    /// `group_commit_max_delay` (which is also the bound before the first sync is measured).
    pub(crate) fn company_wait(&self, config: &LogConfig) -> std::time::Duration {
        let max = config.group_commit_max_delay;
        if self.sync_ns <= 0.0 {
            return max;
        }
        max.min(std::time::Duration::from_nanos(
            (COMPANY_WAIT_SYNCS * self.sync_ns) as u64,
        ))
    }

    /// Folds one measured fdatasync into the smoothed sync time.
    pub(crate) fn note_sync(&mut self, took: std::time::Duration) {
        let ns = took.as_nanos() as f64;
        if self.sync_ns <= 0.0 {
            self.sync_ns = ns;
        } else {
            self.sync_ns += SYNC_WEIGHT * (ns - self.sync_ns);
        }
    }

    /// Takes every buffered record for the flusher.
    pub(crate) fn take_batch(&mut self) -> Batch {
        self.pending_bytes = 0;
        self.in_sync_forces += self.pending_forces;
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
        // The requesters this sync releases, and those that arrived while it ran, are the
        // company the next sync expects.
        if self.in_sync_forces + self.pending_forces > 0 {
            self.company = self.in_sync_forces + self.pending_forces;
        }
        self.in_sync_forces = 0;
        if self.force_target <= last_lsn {
            // Requests that arrived during the sync for records it covered are answered.
            self.pending_forces = 0;
        }
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
            let request = st.request_force(lsn, self.config.group_commit_batch);
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

    /// Syncs what is buffered as the flusher would, with `arrived` more requests coming in
    /// while the sync runs, and a measured sync of 150 µs.
    fn sync_with_arrivals(st: &mut State, cfg: &LogConfig, at: Instant, arrived: usize) {
        let crc = record::payload_crc(b"x");
        let batch = st.take_batch();
        for _ in 0..arrived {
            let lsn = st.append(cfg, RecordTag(1), b"x", crc).unwrap().0;
            st.request_force(lsn, cfg.group_commit_batch).unwrap();
        }
        st.note_sync(Duration::from_micros(150));
        st.publish_durable(batch.last_lsn, batch.end, at);
    }

    #[test]
    fn committers_in_a_closed_loop_are_waited_for_and_no_one_waits_for_company_that_left() {
        let cfg = config(); // max delay 1 ms, batch 16
        let counters = Counters::default();
        let crc = record::payload_crc(b"x");
        let mut st = fresh();
        let t0 = Instant::now();
        let force = |st: &mut State| {
            let lsn = st.append(&cfg, RecordTag(1), b"x", crc).unwrap().0;
            st.request_force(lsn, cfg.group_commit_batch).unwrap()
        };
        // Eight committers start: the first finds the device idle and syncs at once; the
        // other seven arrive while that sync runs.
        force(&mut st);
        assert_eq!(st.plan(t0, &cfg, &counters), Plan::Flush { sync: true });
        sync_with_arrivals(&mut st, &cfg, t0, 7);
        assert_eq!(st.company, 8, "one released plus seven arrived");
        // The seven wait (bounded by two syncs) for the one just released to come back.
        let deadline = t0 + Duration::from_micros(300);
        assert_eq!(st.plan(t0, &cfg, &counters), Plan::AwaitIntents(deadline));
        assert_eq!(
            force(&mut st),
            Request::Wait { wake_flusher: true },
            "the eighth request completes the company and wakes the flusher"
        );
        assert_eq!(st.plan(t0, &cfg, &counters), Plan::Flush { sync: true });
        sync_with_arrivals(&mut st, &cfg, t0, 0);
        assert_eq!(st.company, 8);
        assert_eq!(counters.snapshot().batch_waits, 1);

        // Then five of them stop: the three left wait once, until the deadline, and the
        // expected company shrinks to them, so the next round syncs at once.
        for _ in 0..3 {
            force(&mut st);
        }
        let t1 = t0 + Duration::from_millis(1);
        let deadline = t1 + Duration::from_micros(300);
        assert_eq!(st.plan(t1, &cfg, &counters), Plan::AwaitIntents(deadline));
        assert_eq!(
            st.plan(deadline, &cfg, &counters),
            Plan::Flush { sync: true }
        );
        assert_eq!(st.company, 3);
        sync_with_arrivals(&mut st, &cfg, deadline, 0);
        for _ in 0..3 {
            force(&mut st);
        }
        assert_eq!(
            st.plan(deadline, &cfg, &counters),
            Plan::Flush { sync: true }
        );

        // A serialized hot spot (one request per sync, however the requests are spaced)
        // syncs each at once.
        let mut st = fresh();
        for i in 0..4u64 {
            let at = t0 + Duration::from_millis(2 * i);
            force(&mut st);
            assert_eq!(
                st.plan(at, &cfg, &counters),
                Plan::Flush { sync: true },
                "request {i}"
            );
            sync_with_arrivals(&mut st, &cfg, at, 0);
        }
    }

    /// Figures of a simulated closed loop of committers (see [`closed_loop`]).
    #[derive(Debug)]
    struct LoopFigures {
        per_s: f64,
        mean_latency_us: f64,
        syncs: u64,
    }

    /// Drives the group-commit rule in simulated time: `committers` each append a record and
    /// force it, wait for the sync, then spend `cpu` of one shared processor before the next
    /// append; every fdatasync takes `sync`. Runs the default configuration for one second
    /// of simulated time. Deterministic: no clock, no threads.
    fn closed_loop(committers: usize, cpu: Duration, sync: Duration) -> LoopFigures {
        let cfg = LogConfig::new("/unused"); // the defaults: 500 µs, batch 16
        let counters = Counters::default();
        let crc = record::payload_crc(b"x");
        let mut st = fresh();
        let t0 = Instant::now();
        let horizon = Duration::from_secs(1);
        // When each committer next appends, and (lsn, asked at) of those waiting.
        let mut ready: Vec<Duration> = (1..=committers).map(|k| cpu * k as u32).collect();
        let mut waiting: Vec<(u64, Duration)> = Vec::new();
        let (mut done, mut latency, mut syncs) = (0u64, Duration::ZERO, 0u64);
        let mut t = Duration::ZERO;
        // Appends and forces of every committer ready by `until`, in time order; returns
        // whether one of them woke the flusher.
        let arrive = |st: &mut State,
                      ready: &mut Vec<Duration>,
                      waiting: &mut Vec<(u64, Duration)>,
                      until: Duration,
                      stop_on_wake: bool|
         -> Option<Duration> {
            loop {
                let (i, at) = ready
                    .iter()
                    .copied()
                    .enumerate()
                    .filter(|&(_, at)| at <= until)
                    .min_by_key(|&(_, at)| at)?;
                ready.swap_remove(i);
                let lsn = st.append(&cfg, RecordTag(1), b"x", crc).unwrap().0;
                let woke = matches!(
                    st.request_force(lsn, cfg.group_commit_batch).unwrap(),
                    Request::Wait { wake_flusher: true }
                );
                waiting.push((lsn, at));
                if woke && stop_on_wake {
                    return Some(at);
                }
            }
        };
        while t < horizon {
            match st.plan(t0 + t, &cfg, &counters) {
                Plan::Flush { sync: true } => {
                    let batch = st.take_batch();
                    let end = t + sync;
                    arrive(&mut st, &mut ready, &mut waiting, end, false);
                    st.note_sync(sync);
                    st.publish_durable(batch.last_lsn, batch.end, t0 + end);
                    syncs += 1;
                    t = end;
                    let mut cpu_free = t;
                    waiting.retain(|&(lsn, at)| {
                        if lsn > batch.last_lsn {
                            return true;
                        }
                        done += 1;
                        latency += t - at;
                        cpu_free += cpu;
                        ready.push(cpu_free);
                        false
                    });
                }
                Plan::Flush { sync: false } => {
                    st.take_batch();
                }
                Plan::AwaitIntents(deadline) => {
                    let deadline = deadline - t0;
                    t = arrive(&mut st, &mut ready, &mut waiting, deadline, true)
                        .unwrap_or(deadline);
                }
                Plan::Sleep(_) => {
                    let next = ready
                        .iter()
                        .copied()
                        .min()
                        .expect("a committer is always due");
                    t = t.max(next);
                    arrive(&mut st, &mut ready, &mut waiting, t, false);
                }
                Plan::Exit => unreachable!("never closed"),
            }
        }
        LoopFigures {
            per_s: done as f64 / t.as_secs_f64(),
            mean_latency_us: latency.as_secs_f64() * 1e6 / done.max(1) as f64,
            syncs,
        }
    }

    #[test]
    fn group_commit_meets_its_targets_in_a_simulated_closed_loop() {
        // The figures for this machine's disk: a 150 µs fdatasync (6,667 a second).
        let sync = Duration::from_micros(150);
        let fsync_per_s = 1.0 / sync.as_secs_f64();
        let one = closed_loop(1, Duration::from_micros(10), sync);
        let eight = closed_loop(8, Duration::from_micros(10), sync);
        let many = closed_loop(64, Duration::from_micros(5), sync);
        eprintln!("1: {one:?}\n8: {eight:?}\n64: {many:?}");
        assert!(
            one.mean_latency_us < 1.2 * 150.0,
            "a lone committer never waits: {one:?}"
        );
        assert!(
            eight.per_s >= 5.0 * fsync_per_s,
            "8 committers get at least 5x the fsync rate: {eight:?}"
        );
        assert!(
            eight.mean_latency_us <= 2.5 * one.mean_latency_us,
            "8 committers wait at most 2.5x a lone one: {eight:?} vs {one:?}"
        );
        assert!(
            many.per_s >= 20.0 * fsync_per_s,
            "64 committers get at least 20x the fsync rate: {many:?}"
        );
        assert!(many.syncs > 0);
    }

    #[test]
    fn the_wait_for_company_is_two_syncs_at_most_and_never_past_the_configured_delay() {
        let cfg = config(); // max delay 1 ms
        let mut st = fresh();
        assert_eq!(
            st.company_wait(&cfg),
            Duration::from_millis(1),
            "no sync measured yet"
        );
        st.note_sync(Duration::from_micros(100));
        assert_eq!(st.company_wait(&cfg), Duration::from_micros(200));
        for _ in 0..200 {
            st.note_sync(Duration::from_millis(3));
        }
        assert_eq!(st.company_wait(&cfg), Duration::from_millis(1));
        // Many committers: a batch of the target size syncs without waiting for the rest.
        st.company = 64;
        assert_eq!(st.wanted_company(cfg.group_commit_batch), 16);
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
            st.request_force(lsn, cfg.group_commit_batch).unwrap();
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
            st.request_force(lsn, 16).unwrap(),
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
            st.request_force(1000, 16),
            Err(LogError::NotAppended { .. })
        ));
        assert_eq!(st.request_force(0, 16).unwrap(), Request::Durable);
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
