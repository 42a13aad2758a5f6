//! Who holds a lock: the [`LockOwner`] trait and a concrete [`TestOwner`].
//!
//! The lock manager is generic over its owner type so that it does not
//! depend on the transaction manager's identifiers; `weft-tx` (or any user)
//! implements [`LockOwner`] for its sub-transaction id. This module must
//! never hold lock state.

use std::fmt::Debug;
use std::hash::Hash;

/// A lock owner: a top-level transaction or one of its nested
/// sub-transactions.
///
/// Implementations must be consistent: `is_ancestor_of` is reflexive and
/// transitive and only relates owners of one family; `parent()` is an
/// ancestor of `self` in the same family; a top-level owner (no parent) is
/// an ancestor of every owner of its family.
pub trait LockOwner: Clone + Eq + Hash + Debug {
    /// The top-level transaction this owner belongs to (its "family").
    type Family: Clone + Eq + Hash + Debug;

    /// The family (top-level transaction) of this owner.
    fn family(&self) -> Self::Family;

    /// True if `self` is an ancestor of `other` or equal to it (same family).
    fn is_ancestor_of(&self, other: &Self) -> bool;

    /// The parent owner, or `None` for a top-level transaction.
    fn parent(&self) -> Option<Self>;
}

/// A simple owner for tests and examples: top-level transaction `tx` and the
/// path of child indices from it (`[]` is the top level, `[0, 2]` is the
/// third child of the first child).
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TestOwner {
    /// The top-level transaction number (the family).
    pub tx: u64,
    /// Child indices from the top-level transaction down to this owner.
    pub path: Vec<u32>,
}

impl TestOwner {
    /// The top-level transaction `tx`.
    pub fn top(tx: u64) -> Self {
        TestOwner {
            tx,
            path: Vec::new(),
        }
    }

    /// The `index`th child sub-transaction of `self`.
    pub fn child(&self, index: u32) -> Self {
        let mut path = self.path.clone();
        path.push(index);
        TestOwner { tx: self.tx, path }
    }
}

impl Debug for TestOwner {
    /// Prints `t3` for a top-level transaction and `t3.0.2` for a nested one.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "t{}", self.tx)?;
        for step in &self.path {
            write!(f, ".{step}")?;
        }
        Ok(())
    }
}

impl LockOwner for TestOwner {
    type Family = u64;

    fn family(&self) -> u64 {
        self.tx
    }

    fn is_ancestor_of(&self, other: &Self) -> bool {
        self.tx == other.tx && other.path.starts_with(&self.path)
    }

    fn parent(&self) -> Option<Self> {
        let (_, rest) = self.path.split_last()?;
        Some(TestOwner {
            tx: self.tx,
            path: rest.to_vec(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_owner_ancestry() {
        let top = TestOwner::top(1);
        let a = top.child(0);
        let ab = a.child(1);
        let b = top.child(1);
        assert!(top.is_ancestor_of(&ab));
        assert!(a.is_ancestor_of(&ab));
        assert!(ab.is_ancestor_of(&ab));
        assert!(!ab.is_ancestor_of(&a));
        assert!(!b.is_ancestor_of(&ab));
        assert!(!TestOwner::top(2).is_ancestor_of(&ab));
        assert_eq!(ab.parent(), Some(a.clone()));
        assert_eq!(a.parent(), Some(top.clone()));
        assert_eq!(top.parent(), None);
        assert_eq!(format!("{ab:?}"), "t1.0.1");
    }
}
