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
//! Owns the prepared writers of this site's items and the dependencies
//! between transactions. Must never let a dependent's vote leave before all
//! its writers committed here, nor forget that a writer aborted while a
//! dependent of it may still vote.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

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
}

/// The dependency bookkeeping of controlled lock violation at one site.
#[derive(Default)]
pub struct Violations {
    state: Mutex<State>,
    decided: Notify,
}

impl Violations {
    /// No prepared writers, no dependencies.
    pub fn new() -> Violations {
        Violations::default()
    }

    /// `tid` locked `item`: when a prepared writer holds it in violation
    /// mode, `tid` depends on the latest such writer (which depends on the
    /// earlier ones itself).
    pub fn accessed(&self, tid: Tid, item: Item) {
        let mut st = self.state.lock();
        let Some(&writer) = st.writers.get(&item).and_then(|w| w.last()) else {
            return;
        };
        if writer == tid {
            return;
        }
        if st.deps.entry(tid).or_default().insert(writer) {
            st.dependents.entry(writer).or_default().insert(tid);
            st.granted += 1;
            tracing::trace!(%tid, %writer, ?item, "lock granted in violation mode");
        }
    }

    /// `tid` prepared here having written `items`: they are registered as
    /// its, and the caller may release its locks on them. Call before
    /// releasing, so that no one locks an item without seeing the writer.
    pub fn prepared(&self, tid: Tid, items: Vec<Item>) {
        if items.is_empty() {
            return;
        }
        let mut st = self.state.lock();
        for item in &items {
            let w = st.writers.entry(*item).or_default();
            if !w.contains(&tid) {
                w.push(tid);
            }
        }
        st.released.entry(tid).or_default().extend(items);
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
            for d in st.dependents.remove(&tid).unwrap_or_default() {
                if let Some(set) = st.deps.get_mut(&d) {
                    set.remove(&tid);
                }
                if !committed {
                    st.doomed.entry(d).or_insert_with(|| {
                        format!("it used values written by {tid}, which aborted")
                    });
                    st.cascaded += 1;
                }
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
                if let Some(reason) = st.doomed.remove(&tid) {
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
    /// waiting).
    pub fn is_idle(&self) -> bool {
        let st = self.state.lock();
        st.writers.is_empty() && st.deps.is_empty() && st.dependents.is_empty()
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
        v.accessed(tid(2), branch());
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
        v.accessed(tid(2), branch());
        v.prepared(tid(2), vec![branch()]);
        v.accessed(tid(3), branch());
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
    async fn without_prepared_writers_nothing_depends_and_nothing_waits() {
        let v = Violations::new();
        v.accessed(tid(2), branch());
        assert_eq!(v.barrier(tid(2)).await, Ok(()));
        // A writer's own access is no dependency.
        v.prepared(tid(1), vec![branch()]);
        v.accessed(tid(1), branch());
        assert_eq!(v.barrier(tid(1)).await, Ok(()));
        v.decided(tid(1), true);
        assert!(v.is_idle());
    }

    #[tokio::test]
    async fn a_held_vote_ends_when_its_own_transaction_ends() {
        let v = Arc::new(Violations::new());
        v.prepared(tid(1), vec![branch()]);
        v.accessed(tid(2), branch());
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
}
