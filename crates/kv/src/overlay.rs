//! The disk engine's overlay: changes held in memory (`None`: deleted),
//! with a hash index for point lookups and the keys in order for flushes
//! and scans.
//!
//! Owns only the two structures and keeps them in step: every key of the
//! order is in the index and the other way round. Must never hand out a
//! key's value from anywhere but the index (the order holds keys only).
//!
//! Why two: a read looks in up to three overlays of up to 262,144 keys
//! before the engine, and a commit inserts each key it wrote. In a
//! `BTreeMap<Bytes, _>` each of those walks ~40 keys, each behind a pointer
//! (a cache miss apiece): 1.3-2.2 µs a lookup or insert at that size on
//! this VM, and the overlay's lookups and inserts were the top of a
//! DebitCredit profile (a third of the CPU in `memcmp` and `insert`),
//! with the store's lock held meanwhile. A lookup in the index hashes the
//! key once (SipHash: keys come from clients, so no weaker hash). The
//! order costs an insert of a new key only; an overwrite touches the index
//! alone.

use std::collections::{BTreeSet, HashMap};
use std::ops::RangeFrom;

use bytes::Bytes;

/// Changes not yet in the engine's layers (`None`: deleted).
#[derive(Clone, Debug, Default)]
pub struct Overlay {
    index: HashMap<Bytes, Option<Bytes>>,
    order: BTreeSet<Bytes>,
}

impl Overlay {
    /// An empty overlay.
    pub fn new() -> Overlay {
        Overlay::default()
    }

    /// Keys held.
    pub fn len(&self) -> usize {
        self.index.len()
    }

    /// True when no key is held.
    pub fn is_empty(&self) -> bool {
        self.index.is_empty()
    }

    /// The change held for `key` (`Some(None)`: deleted).
    pub fn get(&self, key: &[u8]) -> Option<&Option<Bytes>> {
        self.index.get(key)
    }

    /// True when a change is held for `key`.
    pub fn contains_key(&self, key: &[u8]) -> bool {
        self.index.contains_key(key)
    }

    /// Holds `value` for `key`; returns the change it replaces.
    pub fn insert(&mut self, key: Bytes, value: Option<Bytes>) -> Option<Option<Bytes>> {
        match self.index.get_mut(&key) {
            Some(held) => Some(std::mem::replace(held, value)),
            None => {
                self.order.insert(key.clone());
                self.index.insert(key, value);
                None
            }
        }
    }

    /// Forgets every change.
    pub fn clear(&mut self) {
        self.index.clear();
        self.order.clear();
    }

    /// The changes in key order from `range.start`.
    pub fn range(
        &self,
        range: RangeFrom<Bytes>,
    ) -> impl Iterator<Item = (&Bytes, &Option<Bytes>)> + '_ {
        self.order.range(range).map(|k| (k, &self.index[k]))
    }

    /// The changes in key order.
    pub fn iter(&self) -> impl Iterator<Item = (&Bytes, &Option<Bytes>)> + '_ {
        self.order.iter().map(|k| (k, &self.index[k]))
    }

    /// The keys in order.
    pub fn keys(&self) -> impl Iterator<Item = &Bytes> + '_ {
        self.order.iter()
    }

    /// The changes, in no particular order.
    pub fn into_unordered(self) -> impl Iterator<Item = (Bytes, Option<Bytes>)> {
        self.index.into_iter()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeMap;

    proptest! {
        /// Under random inserts (new keys, overwrites, deletes) and clears,
        /// the overlay answers lookups, ordered walks from any start and
        /// its length as a `BTreeMap` does.
        #[test]
        fn an_overlay_behaves_like_an_ordered_map(
            ops in proptest::collection::vec((0u8..40, proptest::option::of(0u8..4), 0u8..50), 1..300),
        ) {
            let mut o = Overlay::new();
            let mut model: BTreeMap<Bytes, Option<Bytes>> = BTreeMap::new();
            for (k, v, clear) in ops {
                if clear == 0 {
                    o.clear();
                    model.clear();
                    continue;
                }
                let key = Bytes::from(vec![b'k', k]);
                let value = v.map(|v| Bytes::from(vec![v]));
                prop_assert_eq!(o.insert(key.clone(), value.clone()), model.insert(key, value));
                prop_assert_eq!(o.len(), model.len());
            }
            for k in 0u8..40 {
                let key = Bytes::from(vec![b'k', k]);
                prop_assert_eq!(o.get(&key), model.get(&key));
                prop_assert_eq!(o.contains_key(&key), model.contains_key(&key));
                let got: Vec<_> = o.range(key.clone()..).collect();
                let want: Vec<_> = model.range(key..).collect();
                prop_assert_eq!(got, want);
            }
            prop_assert_eq!(o.iter().collect::<Vec<_>>(), model.iter().collect::<Vec<_>>());
            prop_assert!(o.keys().eq(model.keys()));
            let mut all: Vec<_> = o.clone().into_unordered().collect();
            all.sort();
            prop_assert_eq!(all, model.into_iter().collect::<Vec<_>>());
        }
    }
}
