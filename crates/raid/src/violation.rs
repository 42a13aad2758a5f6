//! Controlled lock violation (Graefe et al., "Controlled lock violation",
//! SIGMOD 2013) at one site: once a transaction has prepared here, its
//! write locks stop blocking others. A later transaction may lock the items
//! at once and use the prepared values, and it becomes *dependent* on the
//! prepared writer: its vote is held (see [`Violations::barrier`]) until the
//! writer's outcome is known here, and it must abort if the writer aborted.
//!
//! Under strict two-phase locking a hot item (TPC-B's branch) is otherwise
//! held through the writer's prepare force, the coordinator's commit force
//! and the decision's trip back; with violation, the next transaction's work
//! and prepare force overlap the previous one's commit.
//!
//! A writer bound to abort (one whose own writers aborted) lends nothing:
//! whoever locks its items waits for its abort instead of joining the
//! cascade, and an abort dooms every transaction downstream of it at once.
//!
//! Owns the prepared writers of this site's items and the dependencies
//! between transactions. Must never let a dependent's vote leave before all
//! its writers committed here, nor forget that a writer aborted while a
//! dependent of it may still vote, nor keep anything for a transaction
//! after [`Violations::decided`] (the transaction manager calls it again for
//! whatever overlapped the abort; [`Violations::registrations`] shows what
//! is left).
//!
//! Bounded: at most `max_writers` prepared writers are in violation mode at
//! once. A writer that prepares beyond that is not registered and keeps its
//! locks until its outcome (plain strict two-phase locking: slower for the
//! next transaction, never wrong). Every other entry belongs to a
//! transaction that locked an item of a registered writer, so the state is
//! bounded by the writers and the lock table's own limits. Branches found
//! in doubt at recovery are registered whatever the bound: they hold no
//! locks.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tokio::sync::Notify;
use weft_wire::Tid;

use crate::schema::Item;

#[derive(Default)]
struct State {
    /// Items whose writers prepared and gave up their locks, with those
    /// writers in the order they prepared (the last one's value is current).
    writers: HashMap<Item, Vec<Tid>>,
    /// The items each prepared writer gave up.
    released: HashMap<Tid, Vec<Item>>,
    /// Transaction → the prepared writers whose values it used, not yet
    /// decided here.
    deps: HashMap<Tid, HashSet<Tid>>,
    /// Prepared writer → the transactions that used its values.
    dependents: HashMap<Tid, HashSet<Tid>>,
    /// Transactions that must abort, with the reason: a writer they depend
    /// on aborted, or they ended while their vote was held.
    doomed: HashMap<Tid, String>,
    /// Transactions whose vote is held in [`Violations::barrier`].
    waiting: HashSet<Tid>,
    /// Dependencies recorded since the site started.
    granted: u64,
    /// Transactions doomed by a writer's abort since the site started.
    cascaded: u64,
    /// Writers not registered because the bound was reached.
    full: u64,
}

/// Most prepared writers in violation mode at once, by default.
pub const DEFAULT_MAX_WRITERS: usize = 16_384;

/// The dependency bookkeeping of controlled lock violation at one site.
pub struct Violations {
    state: Mutex<State>,
    decided: Notify,
    max_writers: usize,
}

impl Default for Violations {
    fn default() -> Self {
        Violations::with_limit(DEFAULT_MAX_WRITERS)
    }
}

impl Violations {
    /// No prepared writers, no dependencies, the default bound.
    pub fn new() -> Violations {
        Violations::default()
    }

    /// No prepared writers, no dependencies; at most `max_writers`
    /// prepared writers registered at once.
    pub fn with_limit(max_writers: usize) -> Violations {
        Violations {
            state: Mutex::new(State::default()),
            decided: Notify::new(),
            max_writers,
        }
    }

    /// `tid` locked `item`: when a prepared writer holds it in violation
    /// mode, `tid` depends on the latest such writer (which depends on the
    /// earlier ones itself).
    ///
    /// Fails with a writer of the item that is doomed (bound to abort: a
    /// writer it depends on aborted here): `tid` records no dependency, as
    /// it would only be doomed too, and must wait until that writer's abort
    /// is applied here (see [`Violations::await_decided`]), then access
    /// again. A doomed writer thus attracts no new dependents.
    pub fn accessed(&self, tid: Tid, item: Item) -> Result<(), Tid> {
        let mut st = self.state.lock();
        let Some(writers) = st.writers.get(&item) else {
            return Ok(());
        };
        if let Some(&doomed) = writers
            .iter()
            .find(|w| **w != tid && st.doomed.contains_key(w))
        {
            return Err(doomed);
        }
        let Some(&writer) = writers.last() else {
            return Ok(());
        };
        if writer == tid {
            return Ok(());
        }
        if st.deps.entry(tid).or_default().insert(writer) {
            st.dependents.entry(writer).or_default().insert(tid);
            st.granted += 1;
            tracing::trace!(%tid, %writer, ?item, "lock granted in violation mode");
        }
        Ok(())
    }

    /// Waits until `writer` is decided here (no item is in violation mode
    /// on its account any more), or `until`. True when it was decided.
    pub async fn await_decided(&self, writer: Tid, until: Instant) -> bool {
        loop {
            let notified = self.decided.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if !self.state.lock().released.contains_key(&writer) {
                return true;
            }
            if tokio::time::timeout_at(until.into(), notified)
                .await
                .is_err()
            {
                return !self.state.lock().released.contains_key(&writer);
            }
        }
    }

    /// `tid` prepared here having written `items`: they are registered as
    /// its, and the caller may release its locks on them. Call before
    /// releasing, so that no one locks an item without seeing the writer.
    ///
    /// Returns false, registering nothing, when `max_writers` other writers
    /// are registered: the caller then keeps its locks until the outcome.
    pub fn prepared(&self, tid: Tid, items: Vec<Item>) -> bool {
        if items.is_empty() {
            return true;
        }
        let mut st = self.state.lock();
        if st.released.len() >= self.max_writers && !st.released.contains_key(&tid) {
            st.full += 1;
            return false;
        }
        register(&mut st, tid, items);
        true
    }

    /// `tid` was found prepared (in doubt) at recovery, having written
    /// `items`: registered whatever the bound (it holds no locks).
    pub fn restore(&self, tid: Tid, items: Vec<Item>) {
        if !items.is_empty() {
            register(&mut self.state.lock(), tid, items);
        }
    }

    /// Prepared writers that kept their locks because the bound was
    /// reached, since start.
    pub fn refused(&self) -> u64 {
        self.state.lock().full
    }

    /// The outcome of `tid` is applied here (`committed` or not): its items
    /// are no longer in violation mode on its account, its dependents stop
    /// waiting for it (and are doomed when it aborted), and its own
    /// dependencies are dropped.
    pub fn decided(&self, tid: Tid, committed: bool) {
        {
            let mut st = self.state.lock();
            if let Some(items) = st.released.remove(&tid) {
                for item in items {
                    if let Some(w) = st.writers.get_mut(&item) {
                        w.retain(|t| *t != tid);
                        if w.is_empty() {
                            st.writers.remove(&item);
                        }
                    }
                }
            }
            let dependents = st.dependents.remove(&tid).unwrap_or_default();
            for d in &dependents {
                if let Some(set) = st.deps.get_mut(d) {
                    set.remove(&tid);
                }
            }
            if !committed {
                doom(&mut st, tid, dependents);
            }
            drop_deps(&mut st, tid);
            if st.waiting.contains(&tid) {
                st.doomed
                    .insert(tid, format!("{tid} ended while its vote was held"));
            } else {
                st.doomed.remove(&tid);
            }
        }
        self.decided.notify_waiters();
    }

    /// The prepared writers `tid` depends on that are not decided here yet.
    ///
    /// Fails with the reason `tid` must abort (a writer it used aborted).
    pub fn undecided(&self, tid: Tid) -> Result<Vec<Tid>, String> {
        let st = self.state.lock();
        if let Some(reason) = st.doomed.get(&tid) {
            return Err(reason.clone());
        }
        let mut v: Vec<Tid> = st
            .deps
            .get(&tid)
            .map(|d| d.iter().copied().collect())
            .unwrap_or_default();
        v.sort();
        Ok(v)
    }

    /// Why `tid` must abort, when a writer it depends on aborted.
    pub fn doomed(&self, tid: Tid) -> Option<String> {
        self.state.lock().doomed.get(&tid).cloned()
    }

    /// Holds `tid`'s vote until every prepared writer it depends on is
    /// decided here. Returns at once without dependencies.
    ///
    /// Fails with the reason `tid` must abort: a writer it depends on
    /// aborted, or `tid` itself ended meanwhile.
    pub async fn barrier(&self, tid: Tid) -> Result<(), String> {
        loop {
            let notified = self.decided.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let mut st = self.state.lock();
                if let Some(reason) = st.doomed.get(&tid).cloned() {
                    // A doomed prepared writer stays marked until its abort
                    // is applied here ([`Violations::decided`]): its items
                    // are still in violation mode meanwhile, and whoever
                    // locks one must wait for that abort, not use its value
                    // and be doomed in turn.
                    if !st.released.contains_key(&tid) {
                        st.doomed.remove(&tid);
                    }
                    st.waiting.remove(&tid);
                    drop_deps(&mut st, tid);
                    return Err(reason);
                }
                if st.deps.get(&tid).is_none_or(|d| d.is_empty()) {
                    st.waiting.remove(&tid);
                    st.deps.remove(&tid);
                    return Ok(());
                }
                st.waiting.insert(tid);
            }
            // Decisions notify; the timeout only guards against a lost one.
            let _ = tokio::time::timeout(Duration::from_secs(1), notified).await;
        }
    }

    /// (dependencies recorded, transactions doomed by an abort) since start.
    pub fn stats(&self) -> (u64, u64) {
        let st = self.state.lock();
        (st.granted, st.cascaded)
    }

    /// True when nothing is registered (every writer decided, no dependent
    /// waiting or doomed).
    pub fn is_idle(&self) -> bool {
        let st = self.state.lock();
        st.writers.is_empty()
            && st.released.is_empty()
            && st.deps.is_empty()
            && st.dependents.is_empty()
            && st.doomed.is_empty()
            && st.waiting.is_empty()
    }

    /// Every transaction something is registered for here, with what: a
    /// prepared writer's items in violation mode, the writers whose values
    /// it used, a held vote, the reason it is doomed. For listings: an
    /// entry whose transaction this node no longer runs is a leak.
    pub fn registrations(&self) -> Vec<(Tid, String)> {
        let st = self.state.lock();
        let mut tids: Vec<Tid> = st
            .released
            .keys()
            .chain(st.deps.keys())
            .chain(st.doomed.keys())
            .chain(st.waiting.iter())
            .copied()
            .collect();
        tids.sort();
        tids.dedup();
        tids.into_iter()
            .map(|t| {
                let mut parts = Vec::new();
                if let Some(items) = st.released.get(&t) {
                    parts.push(format!("prepared writer of {} item(s)", items.len()));
                }
                if let Some(n) = st.dependents.get(&t).map(HashSet::len).filter(|n| *n > 0) {
                    parts.push(format!("{n} dependent(s)"));
                }
                if let Some(deps) = st.deps.get(&t).filter(|d| !d.is_empty()) {
                    let mut deps: Vec<String> = deps.iter().map(Tid::to_string).collect();
                    deps.sort();
                    parts.push(format!("used writes of {}", deps.join(",")));
                }
                if st.waiting.contains(&t) {
                    parts.push("vote held".to_string());
                }
                if let Some(reason) = st.doomed.get(&t) {
                    parts.push(format!("doomed: {reason}"));
                }
                if parts.is_empty() {
                    parts.push("a dependency entry with no writer left".to_string());
                }
                (t, format!("violation: {}", parts.join("; ")))
            })
            .collect()
    }
}

/// Registers `items` as prepared writes of `tid`.
fn register(st: &mut State, tid: Tid, items: Vec<Item>) {
    for item in &items {
        let w = st.writers.entry(*item).or_default();
        if !w.contains(&tid) {
            w.push(tid);
        }
    }
    st.released.entry(tid).or_default().extend(items);
}

/// `aborted` aborted here: each of its `dependents` must abort, and so must
/// whoever used a dependent's writes in turn (a dependent's vote holds only
/// if the writers it used commit, so it is bound to abort, however long
/// its own outcome takes to arrive). Counts each transaction doomed once.
fn doom(st: &mut State, aborted: Tid, dependents: HashSet<Tid>) {
    let mut next: Vec<(Tid, Tid)> = dependents.into_iter().map(|d| (d, aborted)).collect();
    while let Some((d, writer)) = next.pop() {
        if st.doomed.contains_key(&d) {
            continue;
        }
        let reason = if writer == aborted {
            format!("it used values written by {aborted}, which aborted")
        } else {
            format!("it used values written by {writer}, which must abort ({aborted} aborted)")
        };
        st.doomed.insert(d, reason);
        st.cascaded += 1;
        if let Some(ds) = st.dependents.get(&d) {
            next.extend(ds.iter().map(|x| (*x, d)));
        }
    }
}

/// Forgets what `tid` depends on (and its place among those writers'
/// dependents).
fn drop_deps(st: &mut State, tid: Tid) {
    if let Some(set) = st.deps.remove(&tid) {
        for w in set {
            if let Some(ds) = st.dependents.get_mut(&w) {
                ds.remove(&tid);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schema::Relation;
    use std::sync::Arc;
    use weft_wire::{Incarnation, NodeId};

    fn tid(n: u64) -> Tid {
        Tid::new(NodeId(1), Incarnation(1), n)
    }

    fn branch() -> Item {
        Item {
            rel: Relation::Branch,
            key: 1,
        }
    }

    #[tokio::test]
    async fn a_dependent_votes_only_after_its_writer_committed() {
        let v = Arc::new(Violations::new());
        v.prepared(tid(1), vec![branch()]);
        v.accessed(tid(2), branch()).unwrap();
        assert_eq!(v.undecided(tid(2)), Ok(vec![tid(1)]));
        let held = tokio::spawn({
            let v = v.clone();
            async move { v.barrier(tid(2)).await }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!held.is_finished(), "the vote waits for the writer");
        v.decided(tid(1), true);
        assert_eq!(held.await.unwrap(), Ok(()));
        v.decided(tid(2), true);
        assert!(v.is_idle());
        assert_eq!(v.stats(), (1, 0));
    }

    #[tokio::test]
    async fn a_writer_abort_dooms_its_dependents_and_theirs() {
        let v = Violations::new();
        v.prepared(tid(1), vec![branch()]);
        v.accessed(tid(2), branch()).unwrap();
        v.prepared(tid(2), vec![branch()]);
        v.accessed(tid(3), branch()).unwrap();
        v.decided(tid(1), false);
        assert!(v.doomed(tid(2)).unwrap().contains("aborted"));
        assert!(v.undecided(tid(2)).is_err(), "no early vote for the doomed");
        let err = v.barrier(tid(2)).await.unwrap_err();
        assert!(err.contains(&tid(1).to_string()), "{err}");
        // The doomed dependent aborts too, which dooms the next one.
        v.decided(tid(2), false);
        assert!(v.barrier(tid(3)).await.is_err());
        v.decided(tid(3), false);
        assert!(v.is_idle());
        assert_eq!(v.stats(), (2, 2));
    }

    #[tokio::test]
    async fn a_doomed_writer_lends_nothing_after_its_vote_until_its_abort() {
        let v = Violations::new();
        v.prepared(tid(1), vec![branch()]);
        v.accessed(tid(2), branch()).unwrap();
        v.prepared(tid(2), vec![branch()]);
        v.decided(tid(1), false);
        // T2's vote leaves as No; its abort has not reached this site yet.
        assert!(v.barrier(tid(2)).await.is_err());
        assert_eq!(
            v.accessed(tid(3), branch()),
            Err(tid(2)),
            "T3 must wait for T2's abort, not use its write"
        );
        v.decided(tid(2), false);
        v.accessed(tid(3), branch()).unwrap();
        assert_eq!(v.barrier(tid(3)).await, Ok(()));
        v.decided(tid(3), true);
        assert!(v.is_idle());
    }

    #[tokio::test]
    async fn without_prepared_writers_nothing_depends_and_nothing_waits() {
        let v = Violations::new();
        v.accessed(tid(2), branch()).unwrap();
        assert_eq!(v.barrier(tid(2)).await, Ok(()));
        // A writer's own access is no dependency.
        v.prepared(tid(1), vec![branch()]);
        v.accessed(tid(1), branch()).unwrap();
        assert_eq!(v.barrier(tid(1)).await, Ok(()));
        v.decided(tid(1), true);
        assert!(v.is_idle());
    }

    #[tokio::test]
    async fn a_held_vote_ends_when_its_own_transaction_ends() {
        let v = Arc::new(Violations::new());
        v.prepared(tid(1), vec![branch()]);
        v.accessed(tid(2), branch()).unwrap();
        let held = tokio::spawn({
            let v = v.clone();
            async move { v.barrier(tid(2)).await }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        v.decided(tid(2), false);
        assert!(held.await.unwrap().is_err());
        v.decided(tid(1), true);
        assert!(v.is_idle());
    }

    /// Issue 16 item 10: once a prepared writer is bound to abort (a
    /// writer it used aborted), whoever locks its items waits for its
    /// abort instead of using its writes and being doomed in turn.
    #[tokio::test]
    async fn a_writer_bound_to_abort_attracts_no_dependents() {
        let v = Arc::new(Violations::new());
        v.prepared(tid(1), vec![branch()]);
        v.accessed(tid(2), branch()).unwrap();
        v.prepared(tid(2), vec![branch()]);
        v.decided(tid(1), false);
        assert!(v.doomed(tid(2)).is_some());
        assert_eq!(v.accessed(tid(3), branch()), Err(tid(2)), "it must wait");
        assert_eq!(v.undecided(tid(3)), Ok(vec![]), "no dependency recorded");
        assert!(v.doomed(tid(3)).is_none(), "and not doomed");
        let until = Instant::now() + Duration::from_secs(60);
        let waiting = tokio::spawn({
            let v = v.clone();
            async move { v.await_decided(tid(2), until).await }
        });
        v.decided(tid(2), false);
        assert!(waiting.await.unwrap(), "the abort ends the wait");
        assert_eq!(v.accessed(tid(3), branch()), Ok(()));
        assert_eq!(v.barrier(tid(3)).await, Ok(()), "nothing to wait for");
        v.decided(tid(3), true);
        assert!(v.is_idle(), "{:?}", v.registrations());
        // An undecided writer's wait ends at its bound.
        v.prepared(tid(4), vec![branch()]);
        assert!(!v.await_decided(tid(4), Instant::now()).await);
    }

    #[tokio::test]
    async fn an_abort_dooms_the_dependents_of_its_dependents_at_once() {
        let v = Violations::new();
        v.prepared(tid(1), vec![branch()]);
        v.accessed(tid(2), branch()).unwrap();
        v.prepared(tid(2), vec![branch()]);
        v.accessed(tid(3), branch()).unwrap();
        v.prepared(tid(3), vec![branch()]);
        v.accessed(tid(4), branch()).unwrap();
        v.decided(tid(1), false);
        // Each of them is bound to abort: none waits for the one before it
        // to abort here first.
        for t in 2..=4 {
            assert!(v.doomed(tid(t)).is_some(), "{t}");
        }
        let reason = v.doomed(tid(4)).unwrap();
        assert!(reason.contains(&tid(3).to_string()), "{reason}");
        assert!(reason.contains(&tid(1).to_string()), "{reason}");
        assert_eq!(v.stats(), (3, 3));
        for t in 2..=4 {
            v.decided(tid(t), false);
        }
        assert_eq!(v.stats(), (3, 3), "each counted once");
        assert!(v.is_idle());
    }

    #[test]
    fn at_most_max_writers_are_registered_and_recovery_bypasses_the_bound() {
        let v = Violations::with_limit(1);
        assert!(v.prepared(tid(1), vec![branch()]));
        assert!(v.prepared(tid(1), vec![branch()]), "the same writer again");
        assert!(
            !v.prepared(tid(2), vec![branch()]),
            "full: it keeps its locks"
        );
        assert_eq!(v.refused(), 1);
        assert_eq!(v.registrations().len(), 1);
        assert_eq!(v.accessed(tid(3), branch()), Ok(()));
        assert_eq!(
            v.undecided(tid(3)),
            Ok(vec![tid(1)]),
            "not on the refused one"
        );
        v.restore(tid(4), vec![branch()]);
        assert_eq!(v.registrations().len(), 3, "{:?}", v.registrations());
        for t in [1, 3, 4] {
            v.decided(tid(t), true);
        }
        assert!(v.is_idle(), "{:?}", v.registrations());
        assert!(v.prepared(tid(5), vec![branch()]), "room again");
    }

    #[tokio::test]
    async fn registrations_name_every_transaction_something_is_held_for() {
        let v = Violations::new();
        v.prepared(tid(1), vec![branch()]);
        v.accessed(tid(2), branch()).unwrap();
        let r = v.registrations();
        assert_eq!(r.len(), 2, "{r:?}");
        assert_eq!(r[0].0, tid(1));
        assert!(r[0].1.contains("prepared writer of 1 item"), "{r:?}");
        assert!(
            r[1].1.contains(&format!("used writes of {}", tid(1))),
            "{r:?}"
        );
        v.decided(tid(1), false);
        assert!(v.registrations()[0].1.contains("doomed"));
        v.decided(tid(2), false);
        assert!(v.registrations().is_empty());
    }
}
