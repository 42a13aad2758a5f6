//! Unit tests of the sans-IO [`LockTable`], driven call by call.

use super::{
    Acquire, HeldLock, Holder, LockError, LockLimits, LockMode, LockOwner, LockTable, TestOwner,
    WaitId, Wakeups,
};
use LockMode::{Exclusive as X, Shared as S};

type Table = LockTable<&'static str, TestOwner>;

fn t(tx: u64) -> TestOwner {
    TestOwner::top(tx)
}

fn granted(a: Result<Acquire, LockError>) {
    assert_eq!(a, Ok(Acquire::Granted));
}

fn queued(a: Result<Acquire, LockError>) -> WaitId {
    match a {
        Ok(Acquire::Queued(id)) => id,
        other => panic!("expected a queued request, got {other:?}"),
    }
}

fn grants(ids: &[WaitId]) -> Wakeups {
    Wakeups {
        granted: ids.to_vec(),
        cancelled: Vec::new(),
    }
}

fn holders(table: &Table, key: &'static str) -> Vec<(TestOwner, LockMode)> {
    table
        .holders(&key)
        .into_iter()
        .map(|Holder { owner, mode }| (owner, mode))
        .collect()
}

fn ok(table: &Table) {
    table.check_invariants().unwrap();
}

#[test]
fn shared_locks_are_compatible() {
    let mut table = Table::new();
    granted(table.acquire(t(1), "a", S));
    granted(table.acquire(t(2), "a", S));
    granted(table.acquire(t(3), "a", S));
    assert_eq!(holders(&table, "a").len(), 3);
    assert_eq!(table.len(), 1);
    ok(&table);
}

#[test]
fn shared_and_exclusive_conflict() {
    let mut table = Table::new();
    granted(table.acquire(t(1), "a", S));
    let w = queued(table.acquire(t(2), "a", X));
    granted(table.acquire(t(3), "b", X));
    let v = queued(table.acquire(t(4), "b", S));
    assert_eq!(table.waiter_count(), 2);
    assert_eq!(table.release_all(&1), grants(&[w]));
    assert_eq!(table.release_all(&3), grants(&[v]));
    assert_eq!(holders(&table, "a"), vec![(t(2), X)]);
    assert_eq!(holders(&table, "b"), vec![(t(4), S)]);
    ok(&table);
}

#[test]
fn exclusive_locks_conflict() {
    let mut table = Table::new();
    granted(table.acquire(t(1), "a", X));
    let w = queued(table.acquire(t(2), "a", X));
    assert_eq!(table.waiters(&"a")[0].id, w);
    assert!(table.try_acquire(t(3), "a", X).is_err());
    assert_eq!(table.release_all(&1), grants(&[w]));
    assert_eq!(holders(&table, "a"), vec![(t(2), X)]);
    ok(&table);
}

#[test]
fn reacquiring_a_covered_lock_is_granted() {
    let mut table = Table::new();
    granted(table.acquire(t(1), "a", X));
    let w = queued(table.acquire(t(2), "a", S));
    granted(table.acquire(t(1), "a", X));
    granted(table.acquire(t(1), "a", S));
    assert_eq!(holders(&table, "a"), vec![(t(1), X)]);
    assert_eq!(table.waiters(&"a")[0].id, w);
    ok(&table);
}

#[test]
fn upgrade_is_granted_to_the_only_holder() {
    let mut table = Table::new();
    granted(table.acquire(t(1), "a", S));
    granted(table.acquire(t(1), "a", X));
    assert_eq!(holders(&table, "a"), vec![(t(1), X)]);
    ok(&table);
}

#[test]
fn upgrade_waits_for_other_readers_and_goes_ahead_of_writers() {
    let mut table = Table::new();
    granted(table.acquire(t(1), "a", S));
    granted(table.acquire(t(2), "a", S));
    let writer = queued(table.acquire(t(3), "a", X));
    let upgrade = queued(table.acquire(t(1), "a", X));
    let queue = table.waiters(&"a");
    assert_eq!(queue[0].id, upgrade);
    assert!(queue[0].upgrade);
    assert_eq!(queue[1].id, writer);
    assert!(!queue[1].upgrade);
    assert_eq!(table.release_all(&2), grants(&[upgrade]));
    assert_eq!(holders(&table, "a"), vec![(t(1), X)]);
    assert_eq!(table.release_all(&1), grants(&[writer]));
    ok(&table);
}

#[test]
fn later_upgrades_queue_behind_earlier_upgrades() {
    let mut table = Table::new();
    granted(table.acquire(t(1), "a", S));
    granted(table.acquire(t(2), "a", S));
    granted(table.acquire(t(3), "a", S));
    let writer = queued(table.acquire(t(4), "a", X));
    let up1 = queued(table.acquire(t(1), "a", X));
    let up2 = queued(table.acquire(t(2), "a", X));
    let order: Vec<WaitId> = table.waiters(&"a").iter().map(|w| w.id).collect();
    assert_eq!(order, vec![up1, up2, writer]);
    ok(&table);
}

#[test]
fn reader_does_not_overtake_a_queued_writer() {
    let mut table = Table::new();
    granted(table.acquire(t(1), "a", S));
    let writer = queued(table.acquire(t(2), "a", X));
    let reader = queued(table.acquire(t(3), "a", S));
    assert!(table.try_acquire(t(4), "a", S).is_err());
    assert_eq!(table.release_all(&1), grants(&[writer]));
    assert_eq!(table.release_all(&2), grants(&[reader]));
    ok(&table);
}

#[test]
fn a_family_holding_the_key_may_overtake_waiters() {
    let mut table = Table::new();
    granted(table.acquire(t(1), "a", S));
    let writer = queued(table.acquire(t(2), "a", X));
    // t1's child must not queue behind t2, which waits for t1 itself.
    granted(table.acquire(t(1).child(0), "a", S));
    assert_eq!(table.waiters(&"a")[0].id, writer);
    ok(&table);
}

#[test]
fn cancel_unblocks_requests_queued_behind_it() {
    let mut table = Table::new();
    granted(table.acquire(t(1), "a", S));
    let writer = queued(table.acquire(t(2), "a", X));
    let reader = queued(table.acquire(t(3), "a", S));
    assert_eq!(table.cancel(writer), Ok(grants(&[reader])));
    assert_eq!(holders(&table, "a"), vec![(t(1), S), (t(3), S)]);
    assert_eq!(table.waiter_count(), 0);
    ok(&table);
}

#[test]
fn cancel_of_a_blocked_request_grants_nothing() {
    let mut table = Table::new();
    granted(table.acquire(t(1), "a", X));
    let w2 = queued(table.acquire(t(2), "a", X));
    let w3 = queued(table.acquire(t(3), "a", S));
    assert_eq!(table.cancel(w2), Ok(Wakeups::default()));
    assert_eq!(table.waiters(&"a")[0].id, w3);
    ok(&table);
}

#[test]
fn cancel_of_an_unknown_wait_fails() {
    let mut table = Table::new();
    granted(table.acquire(t(1), "a", X));
    let w = queued(table.acquire(t(2), "a", X));
    assert_eq!(table.release_all(&1), grants(&[w]));
    assert_eq!(table.cancel(w), Err(LockError::NoSuchWait(w)));
    ok(&table);
}

#[test]
fn cancel_of_the_last_waiter_on_a_free_key_drops_the_entry() {
    let mut table = Table::new();
    granted(table.acquire(t(1).child(0), "a", X));
    // The parent waits for its child's lock; the child aborts.
    let w = queued(table.acquire(t(1), "a", S));
    assert_eq!(table.cancel(w), Ok(Wakeups::default()));
    assert_eq!(table.abort_sub(&t(1).child(0)), Ok(Wakeups::default()));
    assert!(table.is_empty());
    ok(&table);
}

#[test]
fn release_wakes_waiters_in_fifo_order() {
    let mut table = Table::new();
    granted(table.acquire(t(1), "a", X));
    let r2 = queued(table.acquire(t(2), "a", S));
    let r3 = queued(table.acquire(t(3), "a", S));
    let w4 = queued(table.acquire(t(4), "a", X));
    let r5 = queued(table.acquire(t(5), "a", S));
    assert_eq!(table.release_all(&1), grants(&[r2, r3]));
    assert_eq!(table.release_all(&3), Wakeups::default());
    assert_eq!(table.release_all(&2), grants(&[w4]));
    assert_eq!(table.release_all(&4), grants(&[r5]));
    assert_eq!(table.release_all(&5), Wakeups::default());
    assert!(table.is_empty());
    ok(&table);
}

#[test]
fn release_grants_in_key_order() {
    let mut table = Table::new();
    granted(table.acquire(t(1), "c", X));
    granted(table.acquire(t(1), "a", X));
    granted(table.acquire(t(1), "b", X));
    let wc = queued(table.acquire(t(2), "c", X));
    let wa = queued(table.acquire(t(3), "a", X));
    let wb = queued(table.acquire(t(4), "b", X));
    assert_eq!(table.release_all(&1), grants(&[wa, wb, wc]));
    ok(&table);
}

#[test]
fn child_uses_its_parents_lock() {
    let mut table = Table::new();
    let parent = t(1);
    let child = parent.child(0);
    let grandchild = child.child(3);
    granted(table.acquire(parent.clone(), "a", X));
    granted(table.acquire(child.clone(), "a", S));
    granted(table.acquire(child.clone(), "a", X));
    granted(table.acquire(grandchild.clone(), "a", X));
    assert_eq!(
        holders(&table, "a"),
        vec![(parent, X), (child, X), (grandchild, X)]
    );
    ok(&table);
}

#[test]
fn sibling_waits_until_commit_sub_passes_the_lock_to_the_parent() {
    let mut table = Table::new();
    let parent = t(1);
    let (c0, c1) = (parent.child(0), parent.child(1));
    granted(table.acquire(c0.clone(), "a", X));
    let w = queued(table.acquire(c1.clone(), "a", S));
    // An unrelated transaction waits too; it must stay blocked.
    let other = queued(table.acquire(t(2), "a", S));
    assert_eq!(table.commit_sub(&c0), Ok(grants(&[w])));
    assert_eq!(holders(&table, "a"), vec![(parent.clone(), X), (c1, S)]);
    assert_eq!(table.waiters(&"a")[0].id, other);
    assert_eq!(table.release_all(&1), grants(&[other]));
    ok(&table);
}

#[test]
fn commit_sub_unions_modes_into_the_parent() {
    let mut table = Table::new();
    let parent = t(1);
    let child = parent.child(0);
    granted(table.acquire(parent.clone(), "a", S));
    granted(table.acquire(child.clone(), "a", X));
    granted(table.acquire(child.clone(), "b", S));
    granted(table.acquire(child.child(0), "c", X));
    assert_eq!(table.commit_sub(&child), Ok(Wakeups::default()));
    let locks: Vec<(&str, TestOwner, LockMode)> = table
        .locks_of(&1)
        .into_iter()
        .map(|HeldLock { key, owner, mode }| (key, owner, mode))
        .collect();
    assert_eq!(
        locks,
        vec![
            ("a", parent.clone(), X),
            ("b", parent.clone(), S),
            ("c", parent.clone(), X)
        ]
    );
    ok(&table);
}

#[test]
fn parent_waits_for_its_childs_lock() {
    let mut table = Table::new();
    let parent = t(1);
    let child = parent.child(0);
    granted(table.acquire(child.clone(), "a", X));
    let w = queued(table.acquire(parent.clone(), "a", S));
    assert_eq!(table.commit_sub(&child), Ok(grants(&[w])));
    assert_eq!(holders(&table, "a"), vec![(parent, X)]);
    ok(&table);
}

#[test]
fn abort_sub_releases_only_the_childs_own_locks() {
    let mut table = Table::new();
    let parent = t(1);
    let child = parent.child(0);
    granted(table.acquire(parent.clone(), "a", S));
    granted(table.acquire(child.clone(), "a", X));
    granted(table.acquire(child.clone(), "b", X));
    granted(table.acquire(child.child(1), "c", S));
    granted(table.acquire(parent.child(1), "d", S));
    let waits_for_b = queued(table.acquire(t(2), "b", S));
    let waits_for_a = queued(table.acquire(t(3), "a", S));
    assert_eq!(
        table.abort_sub(&child),
        Ok(grants(&[waits_for_a, waits_for_b]))
    );
    assert_eq!(holders(&table, "a"), vec![(parent.clone(), S), (t(3), S)]);
    assert_eq!(holders(&table, "b"), vec![(t(2), S)]);
    assert!(holders(&table, "c").is_empty());
    assert_eq!(holders(&table, "d"), vec![(parent.child(1), S)]);
    ok(&table);
}

#[test]
fn ending_a_sub_transaction_cancels_its_subtrees_waits() {
    let mut table = Table::new();
    let parent = t(1);
    let child = parent.child(0);
    granted(table.acquire(t(2), "a", X));
    let mine = queued(table.acquire(child.child(0), "a", S));
    let sibling = queued(table.acquire(parent.child(1), "a", S));
    let aborted = table.abort_sub(&child).unwrap();
    assert_eq!(aborted.cancelled, vec![mine]);
    assert!(aborted.granted.is_empty());
    let committed = table.commit_sub(&parent.child(1)).unwrap();
    assert_eq!(committed.cancelled, vec![sibling]);
    assert_eq!(table.waiter_count(), 0);
    assert!(table.locks_of(&1).is_empty());
    ok(&table);
}

#[test]
fn sub_transaction_operations_reject_top_level_owners() {
    let mut table = Table::new();
    granted(table.acquire(t(1), "a", X));
    assert!(matches!(
        table.commit_sub(&t(1)),
        Err(LockError::NotSubTransaction { .. })
    ));
    assert!(matches!(
        table.abort_sub(&t(1)),
        Err(LockError::NotSubTransaction { .. })
    ));
    assert_eq!(holders(&table, "a"), vec![(t(1), X)]);
}

#[test]
fn release_all_frees_the_whole_family_and_cancels_its_waits() {
    let mut table = Table::new();
    let top = t(1);
    granted(table.acquire(top.clone(), "a", S));
    granted(table.acquire(top.child(0), "b", X));
    granted(table.acquire(top.child(0).child(0), "c", X));
    granted(table.acquire(t(2), "d", X));
    let w = queued(table.acquire(top.child(1), "d", S));
    let other = queued(table.acquire(t(3), "b", S));
    assert_eq!(
        table.release_all(&1),
        Wakeups {
            granted: vec![other],
            cancelled: vec![w],
        }
    );
    assert!(table.locks_of(&1).is_empty());
    assert_eq!(table.len(), 2);
    ok(&table);
}

#[test]
fn release_shared_keeps_exclusive_locks() {
    let mut table = Table::new();
    let top = t(1);
    granted(table.acquire(top.clone(), "a", S));
    granted(table.acquire(top.child(0), "b", S));
    granted(table.acquire(top.clone(), "c", X));
    let w = queued(table.acquire(t(2), "a", X));
    assert_eq!(table.release_shared(&top), grants(&[w]));
    let keys: Vec<&str> = table.locks_of(&1).into_iter().map(|l| l.key).collect();
    assert_eq!(keys, vec!["c"]);
    ok(&table);
}

#[test]
fn release_shared_of_a_child_keeps_its_parents_locks() {
    let mut table = Table::new();
    let top = t(1);
    granted(table.acquire(top.clone(), "a", S));
    granted(table.acquire(top.child(0), "a", S));
    granted(table.acquire(top.child(0), "b", S));
    assert_eq!(table.release_shared(&top.child(0)), Wakeups::default());
    assert_eq!(holders(&table, "a"), vec![(top, S)]);
    assert!(holders(&table, "b").is_empty());
    ok(&table);
}

#[test]
fn release_shared_key_drops_one_read_lock() {
    let mut table = Table::new();
    granted(table.acquire(t(1), "a", S));
    granted(table.acquire(t(1), "b", S));
    granted(table.acquire(t(1), "c", X));
    let w = queued(table.acquire(t(2), "a", X));
    assert_eq!(table.release_shared_key(&t(1), &"a"), grants(&[w]));
    assert_eq!(table.release_shared_key(&t(1), &"c"), Wakeups::default());
    assert_eq!(table.release_shared_key(&t(1), &"zzz"), Wakeups::default());
    let keys: Vec<&str> = table.locks_of(&1).into_iter().map(|l| l.key).collect();
    assert_eq!(keys, vec!["b", "c"]);
    ok(&table);
}

#[test]
fn no_entries_are_left_behind() {
    let mut table = Table::new();
    let top = t(1);
    granted(table.acquire(top.clone(), "a", S));
    granted(table.acquire(top.child(0), "b", X));
    granted(table.acquire(top.child(1), "c", S));
    let w1 = queued(table.acquire(t(2), "b", X));
    let w2 = queued(table.acquire(t(3), "b", S));
    let w3 = queued(table.acquire(top.child(1), "b", S));
    assert_eq!(table.cancel(w2), Ok(Wakeups::default()));
    assert_eq!(table.abort_sub(&top.child(1)).unwrap().cancelled, vec![w3]);
    let _ = table.commit_sub(&top.child(0)).unwrap();
    assert_eq!(
        table.release_all(&1),
        Wakeups {
            granted: vec![w1],
            cancelled: vec![],
        }
    );
    assert_eq!(table.release_all(&2), Wakeups::default());
    assert!(table.is_empty());
    assert_eq!(table.len(), 0);
    assert_eq!(table.waiter_count(), 0);
    assert!(table.locks_of(&1).is_empty());
    ok(&table);
}

#[test]
fn table_limits_are_enforced() {
    let mut table = Table::with_limits(LockLimits {
        max_keys: Some(2),
        max_waiters: Some(1),
    });
    granted(table.acquire(t(1), "a", X));
    granted(table.acquire(t(1), "b", X));
    assert_eq!(
        table.acquire(t(1), "c", X),
        Err(LockError::TableFull { limit: 2 })
    );
    assert_eq!(
        table.try_acquire(t(2), "c", S),
        Err(LockError::TableFull { limit: 2 })
    );
    // Existing keys still work.
    let w = queued(table.acquire(t(2), "a", X));
    assert_eq!(
        table.acquire(t(3), "b", X),
        Err(LockError::QueueFull { limit: 1 })
    );
    assert_eq!(table.cancel(w), Ok(Wakeups::default()));
    let _ = table.release_all(&1);
    granted(table.acquire(t(1), "c", X));
    assert_eq!(table.len(), 1);
    ok(&table);
}

#[test]
fn conflict_error_names_the_key_and_its_holders() {
    let mut table = Table::new();
    granted(table.acquire(t(1), "a", S));
    granted(table.acquire(t(2).child(4), "a", S));
    assert_eq!(
        table.try_acquire(t(3), "a", X),
        Err(LockError::Conflict {
            key: "\"a\"".into(),
            holders: vec!["t1:S".into(), "t2.4:S".into()],
        })
    );
    assert_eq!(table.waiter_count(), 0);
    let err = table.conflict_error(&"a").to_string();
    assert_eq!(err, "lock conflict on \"a\": held by [t1:S, t2.4:S]");
}

#[test]
fn waiting_key_names_the_queue() {
    let mut table = Table::new();
    granted(table.acquire(t(1), "a", X));
    let w = queued(table.acquire(t(2), "a", S));
    assert_eq!(table.waiting_key(w), Some(&"a"));
    let _ = table.release_all(&1);
    assert_eq!(table.waiting_key(w), None);
    assert!(t(1).is_ancestor_of(&t(1).child(0)));
}

#[test]
fn families_holding_lists_holders_not_waiters() {
    let mut table = Table::new();
    granted(table.acquire(t(1), "a", X));
    granted(table.acquire(t(1), "b", S));
    granted(table.acquire(t(2), "b", S));
    queued(table.acquire(t(3), "a", S));
    let mut held = table.families_holding();
    held.sort();
    assert_eq!(held, vec![(1, 2), (2, 1)], "family 3 only waits");
    let woken = table.release_all(&1);
    assert_eq!(woken.granted.len(), 1, "family 3 is granted");
    let mut held = table.families_holding();
    held.sort();
    assert_eq!(held, vec![(2, 1), (3, 1)]);
    ok(&table);
}
