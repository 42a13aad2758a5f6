//! The KV store's data: committed values, the write sets of live branches
//! (per sub-transaction) and the write sets of prepared branches.
//!
//! Owns what each transaction sees and what commit applies. No locks (the
//! lock manager guards isolation), no clocks; the committed data is either an
//! in-memory map ([`Committed::Memory`]) or the on-disk engine
//! ([`Committed::Disk`], reads only here: flushes are driven by the service).
//! Must never let a write reach the committed data before its transaction
//! committed (deferred update: abort has nothing to undo).

use std::collections::{BTreeMap, HashMap};

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use weft_wire::{SubPath, Tid, Xid};

use crate::api::Write;
use crate::disk::{DiskError, DiskStore, Lookup, PreparedSet};

/// Writes of one live branch, per sub-transaction path.
#[derive(Default, Debug)]
struct Branch {
    writes: BTreeMap<SubPath, HashMap<Bytes, Option<Bytes>>>,
    /// Entries over every path (a key written at two levels counts twice).
    entries: usize,
    /// Key and value bytes of those entries.
    bytes: usize,
}

impl Branch {
    /// Recounts `entries` and `bytes` after paths were merged or dropped.
    fn recount(&mut self) {
        self.entries = self.writes.values().map(HashMap::len).sum();
        self.bytes = self
            .writes
            .values()
            .flat_map(|w| w.iter())
            .map(|(k, v)| write_bytes(k, v))
            .sum();
    }
}

fn write_bytes(key: &Bytes, value: &Option<Bytes>) -> usize {
    key.len() + value.as_ref().map_or(0, Bytes::len)
}

/// Bounds on one live branch's write set: what a transaction may make this
/// store hold before it commits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WriteLimits {
    /// Most keys written (counted once per sub-transaction that wrote them).
    pub max_writes: usize,
    /// Most key plus value bytes written.
    pub max_bytes: usize,
}

impl WriteLimits {
    /// No bound.
    pub const UNBOUNDED: WriteLimits = WriteLimits {
        max_writes: usize::MAX,
        max_bytes: usize::MAX,
    };
}

/// A write refused because the branch's write set would pass its bound.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum WriteSetFull {
    /// Too many keys.
    #[error("{tid} would write more than {limit} keys at this node")]
    Writes {
        /// The transaction.
        tid: Tid,
        /// [`WriteLimits::max_writes`].
        limit: usize,
    },
    /// Too many bytes.
    #[error("{tid} would write more than {limit} key and value bytes at this node")]
    Bytes {
        /// The transaction.
        tid: Tid,
        /// [`WriteLimits::max_bytes`].
        limit: usize,
    },
}

/// What a snapshot holds: the committed map and the prepared write sets.
#[derive(Default, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct Image {
    /// Committed values.
    pub committed: BTreeMap<Bytes, Bytes>,
    /// Write sets of branches prepared and not yet decided, with the log
    /// position of their prepare record.
    pub prepared: Vec<(Tid, u64, Vec<Write>)>,
}

/// The committed data: every key in memory, or on disk under a bounded
/// overlay.
#[derive(Debug)]
pub enum Committed {
    /// Every committed pair in memory (snapshotted whole at checkpoints).
    Memory(BTreeMap<Bytes, Bytes>),
    /// The on-disk engine.
    Disk(Box<DiskStore>),
}

impl Default for Committed {
    fn default() -> Self {
        Committed::Memory(BTreeMap::new())
    }
}

impl Committed {
    /// The committed value at `key`.
    ///
    /// Fails with [`DiskError`] when the engine cannot read.
    pub fn get(&self, key: &Bytes) -> Result<Option<Bytes>, DiskError> {
        self.lookup(key).value(key)
    }

    /// The committed value at `key` if memory holds it (the whole map, or
    /// the disk engine's overlays), else the engine's layers to search
    /// after the store's lock is released ([`Lookup::value`]).
    pub fn lookup(&self, key: &Bytes) -> Lookup {
        match self {
            Committed::Memory(m) => Lookup::Found(m.get(key).cloned()),
            Committed::Disk(d) => d.lookup(key),
        }
    }

    fn apply(&mut self, key: Bytes, value: Option<Bytes>) {
        match (self, value) {
            (Committed::Memory(m), Some(v)) => {
                m.insert(key, v);
            }
            (Committed::Memory(m), None) => {
                m.remove(&key);
            }
            (Committed::Disk(d), v) => d.apply(key, v),
        }
    }

    /// Visits pairs with keys in `[start, end)` (`end` empty: no bound) in
    /// order until `visit` returns false.
    ///
    /// Fails with [`DiskError`] when the engine cannot read.
    pub fn visit_range(
        &self,
        start: &Bytes,
        end: &Bytes,
        mut visit: impl FnMut(&Bytes, &Bytes) -> bool,
    ) -> Result<(), DiskError> {
        match self {
            Committed::Memory(m) => {
                for (k, v) in m.range(start.clone()..) {
                    if (!end.is_empty() && k >= end) || !visit(k, v) {
                        break;
                    }
                }
                Ok(())
            }
            Committed::Disk(d) => d.visit_range(start, end, visit),
        }
    }

    /// Number of committed keys.
    ///
    /// Fails with [`DiskError`] when the engine cannot read.
    pub fn key_count(&self) -> Result<u64, DiskError> {
        match self {
            Committed::Memory(m) => Ok(m.len() as u64),
            Committed::Disk(d) => d.key_count(),
        }
    }
}

/// The store.
#[derive(Default, Debug)]
pub struct Store {
    committed: Committed,
    live: HashMap<Tid, Branch>,
    /// Prepared write sets and the log position of their prepare record.
    prepared: HashMap<Tid, (Vec<Write>, u64)>,
    /// Key → the prepared sets that write it, by prepare record position.
    pending: HashMap<Bytes, BTreeMap<u64, Tid>>,
}

impl Store {
    /// An empty store.
    pub fn new() -> Self {
        Store::default()
    }

    /// A store rebuilt from a snapshot image.
    pub fn from_image(image: Image) -> Self {
        let mut store = Store {
            committed: Committed::Memory(image.committed),
            ..Store::default()
        };
        for (tid, lsn, writes) in image.prepared {
            store.restore_prepared(tid, lsn, writes);
        }
        store
    }

    /// A store over the on-disk engine, with the prepared write sets of its
    /// last checkpoint.
    pub fn on_disk(disk: DiskStore, prepared: Vec<PreparedSet>) -> Self {
        let mut store = Store {
            committed: Committed::Disk(Box::new(disk)),
            ..Store::default()
        };
        for (tid, lsn, writes) in prepared {
            store.restore_prepared(tid, lsn, writes);
        }
        store
    }

    /// The on-disk engine, if the store has one.
    pub fn disk_mut(&mut self) -> Option<&mut DiskStore> {
        match &mut self.committed {
            Committed::Disk(d) => Some(d),
            Committed::Memory(_) => None,
        }
    }

    /// The on-disk engine, if the store has one.
    pub fn disk(&self) -> Option<&DiskStore> {
        match &self.committed {
            Committed::Disk(d) => Some(d),
            Committed::Memory(_) => None,
        }
    }

    /// The value `xid` sees at `key`: its own writes (its sub-transaction's,
    /// then its ancestors'), else the latest prepared write of `key`, else
    /// the committed value.
    ///
    /// A prepared write is visible because whoever may read `key` while it
    /// is prepared holds a lock the lock owner granted over the prepared
    /// writer (controlled lock violation) and waits for its outcome before
    /// voting; under strict two-phase locking nobody else can reach `key`.
    ///
    /// Fails with [`DiskError`] when the engine cannot read.
    pub fn read(&self, xid: &Xid, key: &Bytes) -> Result<Option<Bytes>, DiskError> {
        self.lookup(xid, key).value(key)
    }

    /// What [`Store::read`] finds in memory, or the disk engine's layers
    /// where the rest of the search goes: a caller that holds a lock on
    /// `key` finishes it ([`Lookup::value`]) after releasing the store's
    /// lock, so commits and other reads do not wait for the engine's page
    /// reads. (The lock keeps every writer of `key` away until then; see
    /// [`crate::disk::Layers`].)
    pub fn lookup(&self, xid: &Xid, key: &Bytes) -> Lookup {
        if let Some(branch) = self.live.get(&xid.tid) {
            let mut path = Some(xid.path.clone());
            while let Some(p) = path {
                if let Some(v) = branch.writes.get(&p).and_then(|w| w.get(key)) {
                    return Lookup::Found(v.clone());
                }
                path = p.parent();
            }
        }
        if let Some(v) = self.latest_prepared(key) {
            return Lookup::Found(v);
        }
        self.committed.lookup(key)
    }

    /// The latest prepared write of `key` (`Some(None)`: a delete).
    fn latest_prepared(&self, key: &Bytes) -> Option<Option<Bytes>> {
        let (_, tid) = self.pending.get(key)?.last_key_value()?;
        let (writes, _) = self.prepared.get(tid)?;
        writes
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.clone())
    }

    fn index_prepared(&mut self, tid: Tid, lsn: u64, writes: &[Write]) {
        for (k, _) in writes {
            self.pending.entry(k.clone()).or_default().insert(lsn, tid);
        }
    }

    /// Removes `tid`'s prepared set and its index entries.
    fn take_prepared(&mut self, tid: Tid) -> Option<(Vec<Write>, u64)> {
        let (writes, lsn) = self.prepared.remove(&tid)?;
        for (k, _) in &writes {
            if let Some(m) = self.pending.get_mut(k) {
                m.remove(&lsn);
                if m.is_empty() {
                    self.pending.remove(k);
                }
            }
        }
        Some((writes, lsn))
    }

    /// Records a write (`None`: delete) by `xid`, without a bound.
    pub fn write(&mut self, xid: &Xid, key: Bytes, value: Option<Bytes>) {
        self.try_write(xid, key, value, WriteLimits::UNBOUNDED)
            .expect("an unbounded write set is never full");
    }

    /// Records a write (`None`: delete) by `xid` if its branch's write set
    /// stays within `limits` (overwriting a key the same sub-transaction
    /// wrote costs only the difference in bytes).
    ///
    /// Fails with [`WriteSetFull`], writing nothing.
    pub fn try_write(
        &mut self,
        xid: &Xid,
        key: Bytes,
        value: Option<Bytes>,
        limits: WriteLimits,
    ) -> Result<(), WriteSetFull> {
        let branch = self.live.entry(xid.tid).or_default();
        let old = branch
            .writes
            .get(&xid.path)
            .and_then(|w| w.get(&key))
            .map(|v| write_bytes(&key, v));
        let entries = branch.entries + usize::from(old.is_none());
        let bytes = (branch.bytes - old.unwrap_or(0)).saturating_add(write_bytes(&key, &value));
        let full = if entries > limits.max_writes {
            Some(WriteSetFull::Writes {
                tid: xid.tid,
                limit: limits.max_writes,
            })
        } else if bytes > limits.max_bytes {
            Some(WriteSetFull::Bytes {
                tid: xid.tid,
                limit: limits.max_bytes,
            })
        } else {
            None
        };
        if let Some(full) = full {
            if branch.writes.is_empty() {
                self.live.remove(&xid.tid);
            }
            return Err(full);
        }
        branch.entries = entries;
        branch.bytes = bytes;
        branch
            .writes
            .entry(xid.path.clone())
            .or_default()
            .insert(key, value);
        Ok(())
    }

    /// Live branches: transactions that wrote here and have not prepared,
    /// committed or aborted yet.
    pub fn live_branches(&self) -> usize {
        self.live.len()
    }

    /// Keys in `[start, end)` as `xid` sees them, at most `limit`.
    ///
    /// Fails with [`DiskError`] when the engine cannot read.
    pub fn scan(
        &self,
        xid: &Xid,
        start: &Bytes,
        end: &Bytes,
        limit: usize,
    ) -> Result<Vec<(Bytes, Bytes)>, DiskError> {
        let in_range = |k: &Bytes| k >= start && (end.is_empty() || k < end);
        // Own writes visible to xid, outermost first so inner ones win.
        let mut overlay: BTreeMap<Bytes, Option<Bytes>> = BTreeMap::new();
        if let Some(branch) = self.live.get(&xid.tid) {
            for (path, writes) in &branch.writes {
                if path.is_ancestor_or_self(&xid.path) {
                    for (k, v) in writes {
                        if in_range(k) {
                            overlay.insert(k.clone(), v.clone());
                        }
                    }
                }
            }
        }
        let mut out = Vec::new();
        let mut own = overlay.into_iter().peekable();
        // Own writes before (or at) each committed key come first; one at the
        // committed key replaces it.
        let mut emit_own_before = |k: Option<&Bytes>, out: &mut Vec<(Bytes, Bytes)>| -> bool {
            while out.len() < limit {
                match own.peek() {
                    Some((o, _)) if k.is_none_or(|k| o <= k) => {
                        let (o, v) = own.next().expect("peeked");
                        let replaces = k == Some(&o);
                        if let Some(v) = v {
                            out.push((o, v));
                        }
                        if replaces {
                            return true;
                        }
                    }
                    _ => return false,
                }
            }
            true
        };
        if limit > 0 {
            self.committed.visit_range(start, end, |k, v| {
                let replaced = emit_own_before(Some(k), &mut out);
                if out.len() >= limit {
                    return false;
                }
                if !replaced {
                    out.push((k.clone(), v.clone()));
                }
                out.len() < limit
            })?;
            emit_own_before(None, &mut out);
        }
        Ok(out)
    }

    /// A sub-transaction ended: its writes (and its descendants') pass to its
    /// parent, or are dropped.
    pub fn sub_ended(&mut self, tid: Tid, path: &SubPath, committed: bool) {
        let Some(branch) = self.live.get_mut(&tid) else {
            return;
        };
        let Some(parent) = path.parent() else { return };
        let affected: Vec<SubPath> = branch
            .writes
            .keys()
            .filter(|p| path.is_ancestor_or_self(p))
            .cloned()
            .collect();
        // BTreeMap order puts a path before its descendants: apply in that
        // order so the innermost (latest) write of a key wins.
        let mut moved = HashMap::new();
        for p in affected {
            if let Some(w) = branch.writes.remove(&p) {
                if committed {
                    moved.extend(w);
                }
            }
        }
        if committed && !moved.is_empty() {
            branch.writes.entry(parent).or_default().extend(moved);
        }
        branch.recount();
    }

    /// Phase one: the branch's final write set moves to the prepared sets
    /// once `log` returned the position of its prepare record. Returns the
    /// write set, or `None` when the branch wrote nothing (read-only; `log`
    /// is not called). `aborted` sub-transactions' writes are dropped first.
    ///
    /// Fails with `log`'s error; the branch's writes are then dropped.
    pub fn prepare<E>(
        &mut self,
        tid: Tid,
        aborted: &[SubPath],
        log: impl FnOnce(&[Write]) -> Result<u64, E>,
    ) -> Result<Option<Vec<Write>>, E> {
        let Some(mut branch) = self.live.remove(&tid) else {
            return Ok(None);
        };
        branch
            .writes
            .retain(|p, _| !aborted.iter().any(|a| a.is_ancestor_or_self(p)));
        let mut flat: BTreeMap<Bytes, Option<Bytes>> = BTreeMap::new();
        for (_, writes) in branch.writes {
            flat.extend(writes);
        }
        if flat.is_empty() {
            return Ok(None);
        }
        let writes: Vec<Write> = flat.into_iter().collect();
        let lsn = log(&writes)?;
        self.index_prepared(tid, lsn, &writes);
        self.prepared.insert(tid, (writes.clone(), lsn));
        Ok(Some(writes))
    }

    /// Installs a prepared write set found at recovery (`lsn`: its record).
    pub fn restore_prepared(&mut self, tid: Tid, lsn: u64, writes: Vec<Write>) {
        self.take_prepared(tid);
        self.index_prepared(tid, lsn, &writes);
        self.prepared.insert(tid, (writes, lsn));
    }

    /// The log position of the oldest prepared write set's record.
    pub fn oldest_prepared(&self) -> Option<u64> {
        self.prepared.values().map(|(_, lsn)| *lsn).min()
    }

    /// Phase two, commit: the prepared writes reach the committed map.
    /// Returns the keys written (to release their locks), empty if nothing
    /// was prepared for `tid`.
    ///
    /// A write set prepared earlier that is still undecided (in doubt after
    /// a restart) loses the keys this one writes: this transaction used its
    /// values (it could only lock them after that one prepared), so applying
    /// the older values later would undo this commit.
    pub fn commit(&mut self, tid: Tid) -> Vec<Bytes> {
        self.live.remove(&tid);
        let Some((writes, lsn)) = self.take_prepared(tid) else {
            return Vec::new();
        };
        for (k, _) in &writes {
            let Some(m) = self.pending.get_mut(k) else {
                continue;
            };
            // Sets prepared before this one lose `k`; later ones keep it.
            let later = m.split_off(&lsn);
            let earlier = std::mem::replace(m, later);
            if m.is_empty() {
                self.pending.remove(k);
            }
            for t in earlier.into_values() {
                if let Some((w, _)) = self.prepared.get_mut(&t) {
                    w.retain(|(key, _)| key != k);
                }
            }
        }
        let mut keys = Vec::with_capacity(writes.len());
        for (k, v) in writes {
            self.committed.apply(k.clone(), v);
            keys.push(k);
        }
        keys
    }

    /// Abort: the branch's writes (live or prepared) are dropped.
    pub fn abort(&mut self, tid: Tid) {
        self.live.remove(&tid);
        self.take_prepared(tid);
    }

    /// Transactions with a prepared write set.
    pub fn prepared_tids(&self) -> Vec<Tid> {
        self.prepared.keys().copied().collect()
    }

    /// Transactions with a prepared write set, in the order of their prepare
    /// records in the log: for transactions that wrote the same key, strict
    /// two-phase locking makes that the order their writes were applied in,
    /// so recovery redoes them in it.
    pub fn prepared_in_log_order(&self) -> Vec<Tid> {
        let mut v: Vec<(u64, Tid)> = self
            .prepared
            .iter()
            .map(|(t, (_, lsn))| (*lsn, *t))
            .collect();
        v.sort();
        v.into_iter().map(|(_, t)| t).collect()
    }

    /// The keys of a prepared write set.
    pub fn prepared_keys(&self, tid: Tid) -> Vec<Bytes> {
        self.prepared
            .get(&tid)
            .map(|(w, _)| w.iter().map(|(k, _)| k.clone()).collect())
            .unwrap_or_default()
    }

    /// Number of committed keys.
    ///
    /// Fails with [`DiskError`] when the engine cannot read.
    pub fn key_count(&self) -> Result<u64, DiskError> {
        self.committed.key_count()
    }

    /// The prepared write sets, by transaction.
    pub fn prepared_image(&self) -> Vec<PreparedSet> {
        let mut prepared: Vec<PreparedSet> = self
            .prepared
            .iter()
            .map(|(t, (w, lsn))| (*t, *lsn, w.clone()))
            .collect();
        prepared.sort_by_key(|(t, _, _)| *t);
        prepared
    }

    /// A copy of the durable state of an in-memory store: committed map and
    /// prepared write sets; `None` for a store on disk (its checkpoints are
    /// flushes of what changed).
    pub fn image(&self) -> Option<Image> {
        match &self.committed {
            Committed::Memory(m) => Some(Image {
                committed: m.clone(),
                prepared: self.prepared_image(),
            }),
            Committed::Disk(_) => None,
        }
    }

    /// The committed data.
    pub fn committed_data(&self) -> &Committed {
        &self.committed
    }

    /// The committed value at `key` (no transaction).
    ///
    /// Fails with [`DiskError`] when the engine cannot read.
    pub fn committed(&self, key: &Bytes) -> Result<Option<Bytes>, DiskError> {
        self.committed.get(key)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use weft_wire::{Incarnation, NodeId};

    fn tid(n: u64) -> Tid {
        Tid::new(NodeId(1), Incarnation(1), n)
    }

    fn b(s: &str) -> Bytes {
        Bytes::copy_from_slice(s.as_bytes())
    }

    /// Prepares `tid(n)`, pretending its record went to log position 1000 + n.
    fn prep(s: &mut Store, n: u64, aborted: &[SubPath]) -> Option<Vec<Write>> {
        s.prepare::<()>(tid(n), aborted, |_| Ok(1000 + n)).unwrap()
    }

    #[test]
    fn writes_are_invisible_until_commit() {
        let mut s = Store::new();
        let t1 = Xid::top(tid(1));
        let t2 = Xid::top(tid(2));
        s.write(&t1, b("k"), Some(b("v1")));
        assert_eq!(s.read(&t1, &b("k")).unwrap(), Some(b("v1")));
        assert_eq!(s.read(&t2, &b("k")).unwrap(), None, "no dirty read");
        let w = prep(&mut s, 1, &[]).unwrap();
        assert_eq!(w, vec![(b("k"), Some(b("v1")))]);
        assert_eq!(
            s.committed(&b("k")).unwrap(),
            None,
            "prepared is not committed"
        );
        assert_eq!(s.commit(tid(1)), vec![b("k")]);
        assert_eq!(s.read(&t2, &b("k")).unwrap(), Some(b("v1")));
        assert_eq!(s.committed(&b("k")).unwrap(), Some(b("v1")));
    }

    #[test]
    fn a_lock_granted_over_prepared_writers_reads_the_latest_of_them() {
        let mut s = Store::new();
        let (t1, t2, t3) = (Xid::top(tid(1)), Xid::top(tid(2)), Xid::top(tid(3)));
        s.write(&t1, b("k"), Some(b("v1")));
        prep(&mut s, 1, &[]);
        assert_eq!(
            s.read(&t2, &b("k")).unwrap(),
            Some(b("v1")),
            "violation mode"
        );
        s.write(&t2, b("k"), None);
        prep(&mut s, 2, &[]);
        assert_eq!(s.read(&t3, &b("k")).unwrap(), None, "the later delete wins");
        s.abort(tid(2));
        assert_eq!(s.read(&t3, &b("k")).unwrap(), Some(b("v1")));
        s.commit(tid(1));
        assert_eq!(s.read(&t3, &b("k")).unwrap(), Some(b("v1")));
        assert!(s.pending.is_empty(), "the index follows the prepared sets");
    }

    #[test]
    fn a_later_commit_takes_its_keys_from_earlier_sets_still_in_doubt() {
        // After a restart both are prepared; the later one, which used the
        // earlier one's value, is resolved first.
        let mut s = Store::new();
        s.restore_prepared(
            tid(1),
            10,
            vec![(b("k"), Some(b("1"))), (b("j"), Some(b("x")))],
        );
        s.restore_prepared(tid(2), 20, vec![(b("k"), Some(b("2")))]);
        s.commit(tid(2));
        assert_eq!(s.prepared_keys(tid(1)), vec![b("j")]);
        s.commit(tid(1));
        assert_eq!(
            s.committed(&b("k")).unwrap(),
            Some(b("2")),
            "not undone by the older value"
        );
        assert_eq!(s.committed(&b("j")).unwrap(), Some(b("x")));
        assert!(s.pending.is_empty());
    }

    #[test]
    fn read_only_branches_prepare_nothing_and_aborts_leave_no_trace() {
        let mut s = Store::new();
        assert!(prep(&mut s, 1, &[]).is_none());
        let t = Xid::top(tid(2));
        s.write(&t, b("k"), Some(b("v")));
        s.abort(tid(2));
        assert_eq!(s.read(&Xid::top(tid(3)), &b("k")).unwrap(), None);
        assert!(s.prepared_tids().is_empty());
    }

    #[test]
    fn sub_transactions_pass_or_drop_their_writes() {
        let mut s = Store::new();
        let top = Xid::top(tid(1));
        let sub1 = Xid {
            tid: tid(1),
            path: SubPath(vec![1]),
        };
        let sub2 = Xid {
            tid: tid(1),
            path: SubPath(vec![2]),
        };
        s.write(&top, b("a"), Some(b("top")));
        s.write(&sub1, b("a"), Some(b("sub1")));
        s.write(&sub1, b("b"), Some(b("sub1")));
        assert_eq!(s.read(&sub1, &b("a")).unwrap(), Some(b("sub1")));
        assert_eq!(
            s.read(&top, &b("a")).unwrap(),
            Some(b("top")),
            "parent does not see open child"
        );
        s.sub_ended(tid(1), &sub1.path, false);
        assert_eq!(
            s.read(&top, &b("b")).unwrap(),
            None,
            "aborted sub leaves no trace"
        );
        s.write(&sub2, b("c"), Some(b("sub2")));
        s.sub_ended(tid(1), &sub2.path, true);
        assert_eq!(
            s.read(&top, &b("c")).unwrap(),
            Some(b("sub2")),
            "committed sub passes to parent"
        );
        let w = prep(&mut s, 1, &[]).unwrap();
        assert_eq!(w, vec![(b("a"), Some(b("top"))), (b("c"), Some(b("sub2")))]);
    }

    #[test]
    fn prepare_drops_subs_known_aborted() {
        let mut s = Store::new();
        let sub = Xid {
            tid: tid(1),
            path: SubPath(vec![3]),
        };
        s.write(&sub, b("x"), Some(b("1")));
        assert!(prep(&mut s, 1, &[SubPath(vec![3])]).is_none());
    }

    #[test]
    fn scans_merge_own_writes_and_deletes() {
        let mut s = Store::new();
        let t0 = Xid::top(tid(9));
        for k in ["a", "b", "c", "d"] {
            s.write(&t0, b(k), Some(b(k)));
        }
        prep(&mut s, 9, &[]);
        s.commit(tid(9));
        let t = Xid::top(tid(1));
        s.write(&t, b("b"), None);
        s.write(&t, b("bb"), Some(b("new")));
        s.write(&t, b("c"), Some(b("C")));
        let rows = s.scan(&t, &b("a"), &b("d"), 10).unwrap();
        assert_eq!(
            rows,
            vec![(b("a"), b("a")), (b("bb"), b("new")), (b("c"), b("C"))]
        );
        assert_eq!(s.scan(&t, &b("a"), &Bytes::new(), 2).unwrap().len(), 2);
        let other = Xid::top(tid(2));
        assert_eq!(s.scan(&other, &b("a"), &Bytes::new(), 10).unwrap().len(), 4);
    }

    #[test]
    fn images_round_trip_prepared_sets() {
        let mut s = Store::new();
        let t = Xid::top(tid(1));
        s.write(&t, b("k"), Some(b("v")));
        prep(&mut s, 1, &[]);
        let again = Store::from_image(s.image().unwrap());
        assert_eq!(again.prepared_tids(), vec![tid(1)]);
        assert_eq!(again.prepared_keys(tid(1)), vec![b("k")]);
        assert_eq!(again.oldest_prepared(), Some(1000 + 1));
    }

    #[test]
    fn a_write_set_stays_within_its_limits_counting_overwrites_once() {
        let mut s = Store::new();
        let limits = WriteLimits {
            max_writes: 2,
            max_bytes: 10,
        };
        let top = Xid::top(tid(1));
        let sub = Xid {
            tid: tid(1),
            path: SubPath(vec![1]),
        };
        s.try_write(&top, b("a"), Some(b("1234")), limits).unwrap();
        // Overwriting costs the difference only.
        s.try_write(&top, b("a"), Some(b("12")), limits).unwrap();
        s.try_write(&top, b("b"), None, limits).unwrap();
        assert_eq!(
            s.try_write(&top, b("c"), None, limits),
            Err(WriteSetFull::Writes {
                tid: tid(1),
                limit: 2
            })
        );
        assert_eq!(
            s.try_write(&top, b("a"), Some(b("123456789")), limits),
            Err(WriteSetFull::Bytes {
                tid: tid(1),
                limit: 10
            })
        );
        assert_eq!(
            s.read(&top, &b("a")).unwrap(),
            Some(b("12")),
            "a refused write writes nothing"
        );
        // A key written again by a sub-transaction counts again...
        s.try_write(&sub, b("b"), None, limits).unwrap_err();
        // ...until the sub-transaction's writes merge into its parent's.
        let mut roomy = limits;
        roomy.max_writes = 3;
        s.try_write(&sub, b("b"), None, roomy).unwrap();
        s.sub_ended(tid(1), &SubPath(vec![1]), true);
        s.try_write(&top, b("a"), None, limits).unwrap();
        s.abort(tid(1));
        assert_eq!(s.live_branches(), 0);
        // A refused first write leaves no empty branch behind.
        let t2 = Xid::top(tid(2));
        s.try_write(&t2, b("long-key-past-ten"), None, limits)
            .unwrap_err();
        assert_eq!(s.live_branches(), 0);
    }
}
