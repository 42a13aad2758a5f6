//! Hashing of the transport's own identifiers (call ids, node ids) for its
//! hash maps.
//!
//! Owns [`IdHashing`]. Must never be used for keys a peer chooses freely in
//! large numbers: it has none of SipHash's resistance to chosen keys, which
//! buys nothing for ids this node allocates or cluster members it admitted,
//! and costs a hundred instructions per lookup on every call's path.

use std::hash::{BuildHasherDefault, Hasher};

/// Builds [`IdHasher`]s: the hashing of maps keyed by call or node ids.
pub(crate) type IdHashing = BuildHasherDefault<IdHasher>;

/// Hashes an integer id with the finalizer of MurmurHash3: every input bit
/// reaches every output bit, so sequential ids, or ids equal modulo a shard
/// count, spread over all buckets.
#[derive(Default)]
pub(crate) struct IdHasher(u64);

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

    fn write_u32(&mut self, n: u32) {
        self.write_u64(u64::from(n));
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = self.0.rotate_left(32) ^ n;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::hash::BuildHasher;

    #[test]
    fn node_ids_and_call_ids_hash_apart() {
        let b = IdHashing::default();
        let nodes: std::collections::HashSet<u64> = (0..1000u32)
            .map(|n| b.hash_one(weft_wire::NodeId(n)))
            .collect();
        assert_eq!(nodes.len(), 1000, "no two node ids collide");
        let low: std::collections::HashSet<u64> = (0..64u64).map(|i| b.hash_one(i) & 63).collect();
        assert!(low.len() > 32, "sequential ids use most of 64 buckets");
    }
}
