//! The home node's decisions for one segment: the master copy, its recent
//! history, reader/writer locks held by transactions, and each writing
//! transaction's uncommitted diffs.
//!
//! Owns: granting locks (strict two-phase: held until the transaction ends),
//! checking a submitted diff against the master with the transaction's
//! earlier diffs applied, without copying it ([`Ahead`]: so a malformed or
//! mismatched diff is refused and the master is untouched), applying a
//! transaction's diffs to the master in place only at commit, and choosing
//! what a stale reader receives (the chained diffs since its version, or the
//! whole segment when that is smaller). Must never wait, read a clock, do I/O
//! or let an uncommitted diff reach the master.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use bytes::Bytes;
use weft_wire::ids::{SubPath, Tid};

use super::apply::apply_diff_bytes;
use super::codec::encode_diff;
use super::error::StateError;
use super::segment::{Ahead, Diff, Segment};
use super::tmt::LockMode;

/// Bounds on a home segment's bookkeeping.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HomeLimits {
    /// Committed diffs kept to refresh stale readers.
    pub history: usize,
    /// Uncommitted diffs one transaction may submit to one segment.
    pub max_pending: usize,
    /// Transactions holding or sharing one segment's lock.
    pub max_holders: usize,
}

impl Default for HomeLimits {
    fn default() -> Self {
        HomeLimits {
            history: 64,
            max_pending: 256,
            max_holders: 1024,
        }
    }
}

/// What a reader receives to bring its copy to the master's version.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Refresh {
    /// Its copy is the master's version.
    Current,
    /// The chained diffs since its version.
    Diff(Diff),
    /// The whole segment (no copy, history too short, or the diff is larger).
    /// (Encode it from [`HomeSegment::master`]: no copy is made here.)
    Whole,
}

/// A transaction's uncommitted work on the segment.
#[derive(Clone, Debug)]
struct Tentative {
    /// What the master would be with `diffs` applied, as far as checking
    /// the next diff needs (no copy of the master: a diff costs what it
    /// carries; the master is changed in place only at commit).
    ahead: Ahead,
    /// Each diff with the (sub-)transaction that wrote it and its
    /// identifier (0: none given).
    diffs: Vec<(SubPath, Diff, u64)>,
    /// The wire form each diff arrived in, when it did (kept to log it and
    /// to serve readers without encoding it again); in step with `diffs`.
    wire: Vec<Option<Bytes>>,
    /// A sub-transaction's diffs were undone: version numbers were reused.
    sub_aborted: bool,
}

/// Most recently committed writers remembered (see [`HomeSegment::committed_linear`]).
pub const MAX_COMMITTED_REMEMBERED: usize = 1024;

/// The home's state for one segment.
#[derive(Clone, Debug)]
pub struct HomeSegment {
    master: Segment,
    /// Committed diffs, oldest first, with their wire form when known.
    history: VecDeque<(Diff, Option<Bytes>)>,
    readers: BTreeSet<Tid>,
    writer: Option<Tid>,
    pending: BTreeMap<Tid, Tentative>,
    committed: VecDeque<Tid>,
    /// The identifier of the diff that produced the master's version (0:
    /// unknown).
    tag: u64,
    limits: HomeLimits,
}

impl HomeSegment {
    /// A home segment around `master`.
    pub fn new(master: Segment, limits: HomeLimits) -> Self {
        HomeSegment {
            master,
            history: VecDeque::new(),
            readers: BTreeSet::new(),
            writer: None,
            pending: BTreeMap::new(),
            committed: VecDeque::new(),
            tag: 0,
            limits,
        }
    }

    /// The committed master copy.
    pub fn master(&self) -> &Segment {
        &self.master
    }

    /// The identifier of the diff that produced the master's version (0:
    /// unknown, e.g. after recovery).
    pub fn tag(&self) -> u64 {
        self.tag
    }

    /// Transactions holding a lock (readers and the writer).
    pub fn holders(&self) -> usize {
        self.readers.len() + usize::from(self.writer.is_some())
    }

    /// Tries to grant `mode` to `tid` now. `Ok(true)`: granted (or already
    /// held); `Ok(false)`: held incompatibly by another transaction (the
    /// shell waits, within its bound, and retries). Fails with
    /// [`StateError::LimitExceeded`] past [`HomeLimits::max_holders`].
    pub fn try_lock(&mut self, tid: Tid, mode: LockMode) -> Result<bool, StateError> {
        match mode {
            LockMode::Read => {
                if self.writer.is_some_and(|w| w != tid) {
                    return Ok(false);
                }
                if self.writer != Some(tid) && !self.readers.contains(&tid) {
                    if self.holders() >= self.limits.max_holders {
                        return Err(StateError::LimitExceeded("segment lock holders".into()));
                    }
                    self.readers.insert(tid);
                }
                Ok(true)
            }
            LockMode::Write => {
                if self.writer == Some(tid) {
                    return Ok(true);
                }
                if self.writer.is_some() || self.readers.iter().any(|r| *r != tid) {
                    return Ok(false);
                }
                self.readers.remove(&tid);
                self.writer = Some(tid);
                Ok(true)
            }
        }
    }

    /// The lock `tid` holds, if any.
    pub fn held(&self, tid: Tid) -> Option<LockMode> {
        if self.writer == Some(tid) {
            Some(LockMode::Write)
        } else if self.readers.contains(&tid) {
            Some(LockMode::Read)
        } else {
            None
        }
    }

    /// What a reader at version `have` (none: no copy) needs.
    pub fn refresh(&self, have: Option<u64>) -> Refresh {
        let v = self.master.version();
        match have {
            Some(h) if h == v => Refresh::Current,
            // Chain only when the diffs are smaller than the segment
            // (counted first, so a large refresh never copies twice).
            Some(h) if h < v && self.units_since(h).is_some_and(|u| u < self.master.units()) => {
                match self.chain_since(h) {
                    Some(d) => Refresh::Diff(d),
                    None => Refresh::Whole,
                }
            }
            _ => Refresh::Whole,
        }
    }

    /// The one committed diff from `have` to the master's version, when
    /// exactly one separates them and it is smaller than the segment (what
    /// [`HomeSegment::refresh`] would chain, without copying it).
    pub fn only_diff_since(&self, have: u64) -> Option<&Diff> {
        self.only_since(have).map(|(d, _)| d)
    }

    /// The wire form of [`HomeSegment::only_diff_since`]'s diff, when the
    /// home kept the bytes it arrived in (no encoding on a reader's path).
    pub fn only_wire_since(&self, have: u64) -> Option<Bytes> {
        self.only_since(have).and_then(|(_, b)| b.clone())
    }

    fn only_since(&self, have: u64) -> Option<&(Diff, Option<Bytes>)> {
        self.history
            .back()
            .filter(|(d, _)| d.base == have && d.target == self.master.version())
            .filter(|(d, _)| d.units() < self.master.units())
    }

    /// Units the retained diffs since `have` carry (`None`: not retained).
    fn units_since(&self, have: u64) -> Option<u64> {
        let first = self.history.iter().position(|(d, _)| d.base == have)?;
        Some(
            self.history
                .iter()
                .skip(first)
                .map(|(d, _)| d.units())
                .sum(),
        )
    }

    fn chain_since(&self, have: u64) -> Option<Diff> {
        let first = self.history.iter().position(|(d, _)| d.base == have)?;
        let mut it = self.history.iter().skip(first).map(|(d, _)| d);
        let mut out = it.next()?.clone();
        for d in it {
            out.chain(d).ok()?;
        }
        Some(out)
    }

    /// The version `tid` would see: its tentative copy's, or the master's.
    pub fn tentative_version(&self, tid: Tid) -> u64 {
        self.pending
            .get(&tid)
            .map_or(self.master.version(), |t| t.ahead.version())
    }

    /// Accepts a diff written by `tid` under its write lock, checked against
    /// `tid`'s tentative copy; the master is untouched. Fails with
    /// [`StateError::TxLockClash`] without the write lock, the
    /// [`Segment::apply`] statuses for a bad diff, or
    /// [`StateError::LimitExceeded`] past [`HomeLimits::max_pending`].
    pub fn submit(&mut self, tid: Tid, path: SubPath, diff: Diff) -> Result<u64, StateError> {
        self.submit_tagged(tid, path, diff, 0)
    }

    /// [`HomeSegment::submit`] of a diff with identifier `id` (given by the
    /// writer that held it; it becomes the master's tag at commit).
    pub fn submit_tagged(
        &mut self,
        tid: Tid,
        path: SubPath,
        diff: Diff,
        id: u64,
    ) -> Result<u64, StateError> {
        self.submit_wire(tid, path, diff, id, None)
    }

    /// [`HomeSegment::submit_tagged`] of a diff that arrived as `wire` (its
    /// wire form, kept to log it at prepare and to refresh readers after
    /// commit without encoding it again).
    pub fn submit_wire(
        &mut self,
        tid: Tid,
        path: SubPath,
        diff: Diff,
        id: u64,
        wire: Option<Bytes>,
    ) -> Result<u64, StateError> {
        if self.writer != Some(tid) {
            return Err(StateError::TxLockClash(format!(
                "{} (a diff needs the write lock)",
                self.master.url()
            )));
        }
        let master = &self.master;
        let t = self.pending.entry(tid).or_insert_with(|| Tentative {
            ahead: Ahead::new(master),
            diffs: Vec::new(),
            wire: Vec::new(),
            sub_aborted: false,
        });
        if t.diffs.len() >= self.limits.max_pending {
            return Err(StateError::LimitExceeded(
                "uncommitted diffs per segment".into(),
            ));
        }
        master.check_ahead(&mut t.ahead, &diff)?;
        t.diffs.push((path, diff, id));
        t.wire.push(wire);
        Ok(t.ahead.version())
    }

    /// A sub-transaction of `tid` aborted: the diffs it (or its descendants)
    /// wrote vanish, with everything written after them inside it, while the
    /// parent's earlier diffs stay. (A parent is suspended while its
    /// sub-transaction runs, so the sub's diffs are the tail.)
    pub fn sub_aborted(&mut self, tid: Tid, path: &SubPath) {
        let Some(t) = self.pending.get_mut(&tid) else {
            return;
        };
        let Some(cut) = t
            .diffs
            .iter()
            .position(|(p, _, _)| path.is_ancestor_or_self(p))
        else {
            return;
        };
        t.diffs.truncate(cut);
        t.wire.truncate(cut);
        t.sub_aborted = true;
        let mut ahead = Ahead::new(&self.master);
        for (_, d, _) in &t.diffs {
            if self.master.check_ahead(&mut ahead, d).is_err() {
                debug_assert!(false, "a prefix of checked diffs failed to replay");
            }
        }
        t.ahead = ahead;
    }

    /// True when `tid` committed here recently and every version it made is
    /// a master version (no sub-transaction of it was undone): a copy holding
    /// its uncommitted diffs at version v is then the master's version v.
    pub fn committed_linear(&self, tid: Tid) -> bool {
        self.committed.contains(&tid)
    }

    /// `tid`'s uncommitted diffs after version `have`, chained (what a callee
    /// in the same transaction lacks). `None` when it has none past `have`.
    pub fn pending_since(&self, tid: Tid, have: u64) -> Option<Diff> {
        let t = self.pending.get(&tid)?;
        let mut out: Option<Diff> = None;
        for (_, d, _) in t.diffs.iter().filter(|(_, d, _)| d.base >= have) {
            match &mut out {
                None => out = Some(d.clone()),
                Some(o) => o.chain(d).ok()?,
            }
        }
        out
    }

    /// What committing `tid` would do to the master: (its version now, the
    /// version after, units changed). `None` when `tid` changes nothing.
    pub fn pending_summary(&self, tid: Tid) -> Option<(u64, u64, u64)> {
        let t = self.pending.get(&tid)?;
        if t.diffs.is_empty() {
            return None;
        }
        let changed = t.diffs.iter().map(|(_, d, _)| d.units()).sum();
        Some((self.master.version(), t.ahead.version(), changed))
    }

    /// `tid`'s uncommitted diffs, in order (what prepare logs).
    pub fn prepared(&self, tid: Tid) -> Vec<Diff> {
        self.pending
            .get(&tid)
            .map(|t| t.diffs.iter().map(|(_, d, _)| d.clone()).collect())
            .unwrap_or_default()
    }

    /// `tid`'s uncommitted diffs in wire form, in order (what prepare logs):
    /// the bytes each arrived in, or its encoding.
    pub fn prepared_wire(&self, tid: Tid) -> Vec<Bytes> {
        self.pending
            .get(&tid)
            .map(|t| {
                t.diffs
                    .iter()
                    .zip(&t.wire)
                    .map(|((_, d, _), w)| w.clone().unwrap_or_else(|| encode_diff(d).into()))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Restores, at recovery, an in-doubt transaction's diffs and write lock.
    pub fn restore_in_doubt(&mut self, tid: Tid, diffs: Vec<Diff>) -> Result<(), StateError> {
        if !self.try_lock(tid, LockMode::Write)? {
            return Err(StateError::TxLockClash(self.master.url().to_string()));
        }
        for d in diffs {
            self.submit(tid, SubPath::top(), d)?;
        }
        Ok(())
    }

    /// Releases `tid`'s locks without changing anything (a read-only branch).
    pub fn release(&mut self, tid: Tid) {
        self.readers.remove(&tid);
        if self.writer == Some(tid) {
            self.writer = None;
        }
    }

    /// Commits `tid`: its diffs reach the master (and the history), its locks
    /// are released. Returns the units changed.
    pub fn commit(&mut self, tid: Tid) -> u64 {
        let mut changed = 0;
        if let Some(t) = self.pending.remove(&tid) {
            if !t.sub_aborted {
                self.committed.push_back(tid);
                while self.committed.len() > MAX_COMMITTED_REMEMBERED {
                    self.committed.pop_front();
                }
            }
            // Each diff was checked against the master with the earlier
            // ones applied (the write lock kept the master still since):
            // applied in place now, each costs what it changes.
            for ((_, d, id), w) in t.diffs.into_iter().zip(t.wire) {
                // From the bytes it arrived in when kept (the faster path;
                // the same diff, held to the same checks).
                let applied = match &w {
                    Some(b) => apply_diff_bytes(&mut self.master, b, usize::MAX),
                    None => self.master.apply(&d),
                };
                if let Err(e) = applied {
                    debug_assert!(false, "a checked diff failed at commit: {e}");
                    continue;
                }
                self.tag = id;
                changed += d.units();
                self.history.push_back((d, w));
                while self.history.len() > self.limits.history {
                    self.history.pop_front();
                }
            }
        }
        self.release(tid);
        changed
    }

    /// Aborts `tid`: its diffs vanish, its locks are released.
    pub fn abort(&mut self, tid: Tid) {
        self.pending.remove(&tid);
        self.release(tid);
    }

    /// Redoes a committed diff found in the log at recovery (skipped when the
    /// master, restored from a checkpoint, already holds it).
    pub fn redo(&mut self, d: &Diff) -> Result<(), StateError> {
        if d.target <= self.master.version() {
            return Ok(());
        }
        self.master.apply(d)?;
        self.tag = 0;
        self.history.push_back((d.clone(), None));
        while self.history.len() > self.limits.history {
            self.history.pop_front();
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::mip::{BlockRef, SegUrl};
    use crate::core::segment::SegLimits;
    use crate::core::twin::{collect, Twins, Writer};
    use weft_wire::ids::NodeId;

    fn tid(n: u64) -> Tid {
        Tid::new(NodeId(1), weft_wire::ids::Incarnation(1), n)
    }

    fn home() -> HomeSegment {
        let mut s = Segment::new(
            SegUrl {
                node: "1".into(),
                path: "h".into(),
            },
            SegLimits::default(),
        );
        let mut tw = Twins::new(&s);
        Writer::new(&mut s, &mut tw)
            .unwrap()
            .alloc(Some("a"), &[0u32; 100])
            .unwrap();
        collect(&mut s, tw);
        HomeSegment::new(
            s,
            HomeLimits {
                history: 3,
                ..HomeLimits::default()
            },
        )
    }

    fn edit(copy: &mut Segment, at: u64, v: u32) -> Diff {
        let mut tw = Twins::new(copy);
        Writer::new(copy, &mut tw)
            .unwrap()
            .write_at(&BlockRef::Name("a".into()), at, &v)
            .unwrap();
        collect(copy, tw)
    }

    #[test]
    fn locks_are_reader_writer_and_held_to_the_end() {
        let mut h = home();
        assert!(h.try_lock(tid(1), LockMode::Read).unwrap());
        assert!(h.try_lock(tid(2), LockMode::Read).unwrap());
        assert!(
            !h.try_lock(tid(1), LockMode::Write).unwrap(),
            "upgrade waits for the other reader"
        );
        h.release(tid(2));
        assert!(h.try_lock(tid(1), LockMode::Write).unwrap());
        assert!(!h.try_lock(tid(2), LockMode::Read).unwrap());
        assert_eq!(h.held(tid(1)), Some(LockMode::Write));
        h.abort(tid(1));
        assert!(h.try_lock(tid(2), LockMode::Write).unwrap());
    }

    #[test]
    fn diffs_reach_the_master_only_at_commit() {
        let mut h = home();
        let mut copy = h.master().clone();
        assert!(h.try_lock(tid(1), LockMode::Write).unwrap());
        let d1 = edit(&mut copy, 3, 7);
        let d2 = edit(&mut copy, 4, 8);
        assert_eq!(h.submit(tid(1), SubPath::top(), d1.clone()).unwrap(), 2);
        assert_eq!(h.submit(tid(1), SubPath::top(), d2).unwrap(), 3);
        assert_eq!(h.master().version(), 1, "uncommitted");
        assert_eq!(h.refresh(Some(1)), Refresh::Current);
        // A callee of the same transaction at version 2 lacks only d2.
        let lack = h.pending_since(tid(1), 2).unwrap();
        assert_eq!((lack.base, lack.target), (2, 3));
        assert_eq!(h.commit(tid(1)), 2);
        assert_eq!(h.master(), &copy);
        assert!(h.committed_linear(tid(1)));
        match h.refresh(Some(1)) {
            Refresh::Diff(d) => assert_eq!((d.base, d.target, d.units()), (1, 3, 2)),
            r => panic!("{r:?}"),
        }
        assert!(matches!(h.refresh(None), Refresh::Whole));
    }

    #[test]
    fn bad_or_unlocked_diffs_are_refused_and_aborts_vanish() {
        let mut h = home();
        let before = h.master().clone();
        let mut copy = before.clone();
        let d = edit(&mut copy, 1, 1);
        assert!(matches!(
            h.submit(tid(1), SubPath::top(), d.clone()),
            Err(StateError::TxLockClash(_))
        ));
        assert!(h.try_lock(tid(1), LockMode::Write).unwrap());
        let mut stale = d.clone();
        stale.base = 0;
        assert!(matches!(
            h.submit(tid(1), SubPath::top(), stale),
            Err(StateError::VersionMismatch { .. })
        ));
        h.submit(tid(1), SubPath::top(), d).unwrap();
        h.abort(tid(1));
        assert_eq!(h.master(), &before);
        assert_eq!(h.tentative_version(tid(1)), 1);
    }

    #[test]
    fn an_aborted_sub_transactions_diffs_vanish_while_the_parents_stay() {
        let mut h = home();
        let mut copy = h.master().clone();
        assert!(h.try_lock(tid(1), LockMode::Write).unwrap());
        let parent = edit(&mut copy, 1, 11);
        let keep = copy.clone();
        h.submit(tid(1), SubPath::top(), parent).unwrap();
        let sub = SubPath::top().child(1);
        h.submit(tid(1), sub.clone(), edit(&mut copy, 2, 22))
            .unwrap();
        h.submit(tid(1), sub.child(1), edit(&mut copy, 3, 33))
            .unwrap();
        assert_eq!(h.tentative_version(tid(1)), 4);
        h.sub_aborted(tid(1), &sub);
        assert_eq!(h.tentative_version(tid(1)), 2);
        h.commit(tid(1));
        assert_eq!(h.master(), &keep);
        assert!(
            !h.committed_linear(tid(1)),
            "versions were reused: copies of it are not trusted"
        );
    }

    #[test]
    fn a_reader_older_than_the_history_gets_the_image() {
        let mut h = home();
        let mut copy = h.master().clone();
        for i in 0..5u32 {
            assert!(h.try_lock(tid(10 + u64::from(i)), LockMode::Write).unwrap());
            let d = edit(&mut copy, u64::from(i), i + 1);
            h.submit(tid(10 + u64::from(i)), SubPath::top(), d).unwrap();
            h.commit(tid(10 + u64::from(i)));
        }
        assert_eq!(h.master().version(), 6);
        assert!(
            matches!(h.refresh(Some(1)), Refresh::Whole),
            "history keeps 3"
        );
        assert!(matches!(h.refresh(Some(3)), Refresh::Diff(_)));
    }
}
