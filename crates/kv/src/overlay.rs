//! The disk engine's overlay: changes held in memory (`None`: deleted),
//! with a hash index for point lookups and the keys put in order only when
//! an ordered walk asks for it.
//!
//! Owns only the index and the order of its keys, and keeps them in step:
//! every key of the index is in exactly one sorted run or among the fresh
//! keys, and no key is in two places. Must never hand out a key's value
//! from anywhere but the index (the order holds keys only), and must never
//! sort on the insert path (inserts happen under the store's write lock).
//!
//! Why a hash index: a read looks in up to three overlays of up to 262,144
//! keys before the engine, and a commit inserts each key it wrote. In a
//! `BTreeMap<Bytes, _>` each of those walks ~40 keys, each behind a pointer
//! (a cache miss apiece): 1.3-2.2 µs a lookup or insert at that size on
//! this VM, and the overlay's lookups and inserts were the top of a
//! DebitCredit profile (a third of the CPU in `memcmp` and `insert`),
//! with the store's lock held meanwhile. A lookup in the index hashes the
//! key once (SipHash: keys come from clients, so no weaker hash).
//!
//! Why a lazy order: an ordered set beside the index still cost a tree
//! insert for every new key, under the store's write lock (~6% of the CPU
//! of a DebitCredit after its first checkpoint, when every key is new to
//! the fresh overlay). A new key is now only pushed on a list. A scan
//! sorts the fresh keys into a run and merges runs of like size, as a
//! binary counter carries: each key is merged O(log n) times in all, and a
//! scan merges at most ~log2(n) disjoint runs as it goes. A flush, which
//! walks a frozen overlay once, off the lock, sorts references to its
//! entries instead ([`Overlay::sorted`]) and leaves the runs alone.

use std::collections::HashMap;
use std::ops::RangeFrom;
use std::sync::Arc;

use bytes::Bytes;
use parking_lot::Mutex;

/// Changes not yet in the engine's layers (`None`: deleted).
#[derive(Debug, Default)]
pub struct Overlay {
    index: HashMap<Bytes, Option<Bytes>>,
    order: Mutex<Order>,
}

/// The keys of the index: sorted runs and the keys new since they were
/// last put in order.
#[derive(Clone, Debug, Default)]
struct Order {
    /// Disjoint sorted runs, each less than half as long as the one
    /// before it (so at most ~log2(n) of them).
    runs: Vec<Arc<[Bytes]>>,
    /// Keys inserted since the last ordered walk, in insertion order.
    fresh: Vec<Bytes>,
}

impl Order {
    /// Sorts the fresh keys into a run and merges runs of like size;
    /// returns the runs.
    fn settle(&mut self) -> Vec<Arc<[Bytes]>> {
        if !self.fresh.is_empty() {
            let mut fresh = std::mem::take(&mut self.fresh);
            fresh.sort_unstable();
            self.runs.push(fresh.into());
        }
        while let [.., older, newer] = self.runs.as_slice() {
            if newer.len() * 2 < older.len() {
                break;
            }
            let merged = merge_runs(older, newer);
            self.runs.pop();
            self.runs.pop();
            self.runs.push(merged);
        }
        self.runs.clone()
    }
}

/// The first 16 bytes of `key`, zero-padded, as a big-endian number:
/// ordered as the keys are, except that keys equal in their first 16
/// bytes (or differing only by trailing zeros there) compare equal.
fn key_prefix(key: &[u8]) -> u128 {
    let mut b = [0u8; 16];
    let n = key.len().min(16);
    b[..n].copy_from_slice(&key[..n]);
    u128::from_be_bytes(b)
}

/// One sorted run of two disjoint sorted runs.
fn merge_runs(a: &[Bytes], b: &[Bytes]) -> Arc<[Bytes]> {
    let mut out = Vec::with_capacity(a.len() + b.len());
    let (mut i, mut j) = (0, 0);
    while i < a.len() && j < b.len() {
        if a[i] < b[j] {
            out.push(a[i].clone());
            i += 1;
        } else {
            out.push(b[j].clone());
            j += 1;
        }
    }
    out.extend_from_slice(&a[i..]);
    out.extend_from_slice(&b[j..]);
    out.into()
}

/// The keys of disjoint sorted runs in order, from a start.
struct Ordered {
    runs: Vec<Arc<[Bytes]>>,
    at: Vec<usize>,
}

impl Ordered {
    fn new(runs: Vec<Arc<[Bytes]>>, start: &Bytes) -> Ordered {
        let at = runs
            .iter()
            .map(|r| r.partition_point(|k| k < start))
            .collect();
        Ordered { runs, at }
    }
}

impl Iterator for Ordered {
    type Item = Bytes;

    fn next(&mut self) -> Option<Bytes> {
        let mut least: Option<(usize, &Bytes)> = None;
        for (i, run) in self.runs.iter().enumerate() {
            if let Some(k) = run.get(self.at[i]) {
                if least.is_none_or(|(_, l)| k < l) {
                    least = Some((i, k));
                }
            }
        }
        let (i, k) = least?;
        let k = k.clone();
        self.at[i] += 1;
        Some(k)
    }
}

impl Clone for Overlay {
    fn clone(&self) -> Overlay {
        Overlay {
            index: self.index.clone(),
            order: Mutex::new(self.order.lock().clone()),
        }
    }
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
                self.order.get_mut().fresh.push(key.clone());
                self.index.insert(key, value);
                None
            }
        }
    }

    /// Forgets every change.
    pub fn clear(&mut self) {
        self.index.clear();
        *self.order.get_mut() = Order::default();
    }

    /// The changes in key order from `range.start`. Puts the keys inserted
    /// since the last ordered walk in order first (see the module's top).
    pub fn range(
        &self,
        range: RangeFrom<Bytes>,
    ) -> impl Iterator<Item = (&Bytes, &Option<Bytes>)> + '_ {
        let runs = self.order.lock().settle();
        Ordered::new(runs, &range.start).map(|k| {
            self.index
                .get_key_value(&k)
                .expect("every ordered key is in the index")
        })
    }

    /// The changes in key order, sorted on the spot without touching the
    /// runs: for a flush of a frozen overlay, which walks every key once.
    /// Sorts references by a 16-byte prefix of the key held beside them
    /// (the whole key for most keys), so the comparisons stay in the
    /// vector; walking the runs instead cost a reference count increment,
    /// a decrement and a SipHash lookup per key, each a cache miss (a
    /// tenth of the CPU after a checkpoint, in a profile).
    pub fn sorted(&self) -> impl Iterator<Item = (&Bytes, &Option<Bytes>)> + '_ {
        let mut entries: Vec<(u128, &Bytes, &Option<Bytes>)> = self
            .index
            .iter()
            .map(|(k, v)| (key_prefix(k), k, v))
            .collect();
        entries.sort_unstable_by(|a, b| a.0.cmp(&b.0).then_with(|| a.1.cmp(b.1)));
        entries.into_iter().map(|(_, k, v)| (k, v))
    }

    /// The keys, in no particular order.
    pub fn unordered_keys(&self) -> impl Iterator<Item = &Bytes> + '_ {
        self.index.keys()
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

    fn key_of(k: u16) -> Bytes {
        let [hi, lo] = k.to_be_bytes();
        Bytes::from(vec![b'k', hi, lo])
    }

    proptest! {
        /// Under random inserts (new keys, overwrites, deletes), clears and
        /// ordered walks between them, the overlay answers lookups, ordered
        /// walks from any start and its length as a `BTreeMap` does.
        #[test]
        fn an_overlay_behaves_like_an_ordered_map(
            ops in proptest::collection::vec((0u16..300, proptest::option::of(0u8..4), 0u8..100), 1..800),
        ) {
            let mut o = Overlay::new();
            let mut model: BTreeMap<Bytes, Option<Bytes>> = BTreeMap::new();
            for (k, v, clear) in ops {
                if clear == 0 {
                    o.clear();
                    model.clear();
                    continue;
                }
                if clear < 8 {
                    // An ordered walk between inserts settles the fresh
                    // keys into runs; later inserts start new ones.
                    let from = key_of(k);
                    let got: Vec<_> = o.range(from.clone()..).collect();
                    let want: Vec<_> = model.range(from..).collect();
                    prop_assert_eq!(got, want);
                }
                let key = key_of(k);
                let value = v.map(|v| Bytes::from(vec![v]));
                prop_assert_eq!(o.insert(key.clone(), value.clone()), model.insert(key, value));
                prop_assert_eq!(o.len(), model.len());
            }
            for k in (0u16..300).step_by(7) {
                let key = key_of(k);
                prop_assert_eq!(o.get(&key), model.get(&key));
                prop_assert_eq!(o.contains_key(&key), model.contains_key(&key));
                let got: Vec<_> = o.range(key.clone()..).collect();
                let want: Vec<_> = model.range(key..).collect();
                prop_assert_eq!(got, want);
            }
            prop_assert_eq!(o.range(Bytes::new()..).collect::<Vec<_>>(), model.iter().collect::<Vec<_>>());
            prop_assert_eq!(o.sorted().collect::<Vec<_>>(), model.iter().collect::<Vec<_>>());
            let mut keys: Vec<_> = o.unordered_keys().collect();
            keys.sort();
            prop_assert!(keys.into_iter().eq(model.keys()));
            let mut all: Vec<_> = o.clone().into_unordered().collect();
            all.sort();
            prop_assert_eq!(all, model.into_iter().collect::<Vec<_>>());
        }
    }

    proptest! {
        /// `sorted` orders keys as bytes do, also keys longer than its
        /// 16-byte prefix, keys that share it, and keys that differ only
        /// by trailing zeros (equal prefixes).
        #[test]
        fn sorted_orders_any_keys(
            keys in proptest::collection::vec(
                proptest::collection::vec(prop_oneof![Just(0u8), Just(1u8), Just(255u8)], 0..24),
                0..200,
            ),
        ) {
            let mut o = Overlay::new();
            let mut model = BTreeMap::new();
            for (i, k) in keys.into_iter().enumerate() {
                let key = Bytes::from(k);
                let value = Some(Bytes::from((i as u32).to_be_bytes().to_vec()));
                o.insert(key.clone(), value.clone());
                model.insert(key, value);
            }
            prop_assert_eq!(o.sorted().collect::<Vec<_>>(), model.iter().collect::<Vec<_>>());
            prop_assert_eq!(o.range(Bytes::new()..).collect::<Vec<_>>(), model.iter().collect::<Vec<_>>());
        }
    }

    /// Walking after every insert (the worst case for the runs) keeps at
    /// most about log2(n) runs, each less than half the one before.
    #[test]
    fn runs_stay_logarithmic() {
        let mut o = Overlay::new();
        for k in (0u16..2000).rev() {
            o.insert(key_of(k.wrapping_mul(7919) % 2000), None);
            assert_eq!(o.range(Bytes::new()..).count(), o.len());
            let runs = o.order.lock().runs.clone();
            assert!(runs.len() <= 12, "{} runs for {} keys", runs.len(), o.len());
            for pair in runs.windows(2) {
                assert!(pair[1].len() * 2 < pair[0].len());
            }
        }
    }
}
