//! Hashing of identifiers weft allocates itself (call ids, node ids,
//! communication, member and sender ids) for hash maps on hot paths.
//!
//! Owns [`IdHasher`] and the map and set types built on it. Must never be
//! used for keys a peer or a client chooses freely in large numbers (names,
//! group ids): it has none of SipHash's resistance to chosen keys, which
//! buys nothing for ids a node allocates or cluster members it admitted,
//! and costs a hundred instructions per lookup on every message's path.

use std::collections::{HashMap, HashSet};
use std::hash::{BuildHasherDefault, Hasher};

/// Builds [`IdHasher`]s: the hashing of maps keyed by weft's own ids.
pub type IdHashing = BuildHasherDefault<IdHasher>;

/// A hash map keyed by identifiers (see [`IdHasher`]).
pub type IdMap<K, V> = HashMap<K, V, IdHashing>;

/// A hash set of identifiers (see [`IdHasher`]).
pub type IdSet<K> = HashSet<K, IdHashing>;

/// Hashes keys made of integers: each integer is folded in with a
/// multiply (so composite keys such as `(node, id)` do not cancel out),
/// and the result goes through the finalizer of MurmurHash3, so every
/// input bit reaches every output bit and sequential ids, or ids equal
/// modulo a shard count, spread over all buckets.
#[derive(Default)]
pub struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        let mut x = self.0;
        x ^= x >> 33;
        x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
        x ^= x >> 33;
        x = x.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
        x ^ (x >> 33)
    }

    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(*b)).wrapping_mul(0x100_0000_01b3);
        }
    }

    fn write_u8(&mut self, n: u8) {
        self.write_u64(u64::from(n));
    }

    fn write_u16(&mut self, n: u16) {
        self.write_u64(u64::from(n));
    }

    fn write_u32(&mut self, n: u32) {
        self.write_u64(u64::from(n));
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0.rotate_left(29) ^ n).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }

    fn write_usize(&mut self, n: usize) {
        self.write_u64(n as u64);
    }

    fn write_isize(&mut self, n: isize) {
        self.write_u64(n as u64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::NodeId;
    use std::hash::BuildHasher;

    #[test]
    fn node_ids_and_sequential_ids_spread() {
        let b = IdHashing::default();
        let nodes: HashSet<u64> = (0..1000u32).map(|n| b.hash_one(NodeId(n))).collect();
        assert_eq!(nodes.len(), 1000, "no two node ids collide");
        let low: HashSet<u64> = (0..64u64).map(|i| b.hash_one(i) & 63).collect();
        assert!(low.len() > 32, "sequential ids use most of 64 buckets");
    }

    #[test]
    fn composite_keys_do_not_cancel() {
        let b = IdHashing::default();
        // (a, b) and (b, a), and pairs with equal parts, must differ.
        let pairs: HashSet<u64> = (0..64u64)
            .flat_map(|x| (0..64u64).map(move |y| (x, y)))
            .map(|k| b.hash_one(k))
            .collect();
        assert_eq!(pairs.len(), 64 * 64, "no two pairs collide");
        let low: HashSet<u64> = (0..64u64).map(|i| b.hash_one((i, i)) & 63).collect();
        assert!(low.len() > 32, "equal-part pairs use most of 64 buckets");
    }
}
