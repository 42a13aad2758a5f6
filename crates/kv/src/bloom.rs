//! A Bloom filter over the keys of one delta table of the disk engine.
//!
//! Owns only the bit set and its hashing. A read of a key past the overlay
//! looks through every unmerged delta before the merged table; for a key in
//! none of them (most keys of a large store) each look was a B-tree walk
//! with page reads. The filter answers "certainly not here" from memory for
//! all but about 1% of such keys. Must never answer "not here" for a key
//! that was added (no false negatives): a delta skipped wrongly would hide
//! a newer value behind an older one.
//!
//! Size: ten bits a key, so the filters of the unmerged deltas, bounded by
//! the merge bound ([`crate::disk::DiskOptions::merge_entries`]), stay a
//! few MiB.

/// Bits per key (about 1% false positives with [`HASHES`] probes).
const BITS_PER_KEY: usize = 10;
/// Probes per key.
const HASHES: u32 = 7;

/// A Bloom filter of byte-string keys.
#[derive(Clone, Debug)]
pub struct Bloom {
    bits: Vec<u64>,
}

/// Two independent 64-bit hashes of `key` (FNV-1a, then a SplitMix64
/// finalizer of it and of its rotation).
fn hashes(key: &[u8]) -> (u64, u64) {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in key {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    let mix = |mut z: u64| {
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    (mix(h), mix(h.rotate_left(32) ^ 0x9e37_79b9_7f4a_7c15) | 1)
}

impl Bloom {
    /// An empty filter sized for `len` keys.
    pub fn new(len: usize) -> Bloom {
        let words = (len.max(1) * BITS_PER_KEY).div_ceil(64);
        Bloom {
            bits: vec![0; words],
        }
    }

    /// A filter holding `keys`.
    pub fn build<'a>(len: usize, keys: impl Iterator<Item = &'a [u8]>) -> Bloom {
        let mut bloom = Bloom::new(len);
        for k in keys {
            bloom.add(k);
        }
        bloom
    }

    fn probes(&self, key: &[u8]) -> [usize; HASHES as usize] {
        let (h1, h2) = hashes(key);
        let n = (self.bits.len() * 64) as u64;
        let mut out = [0; HASHES as usize];
        for (i, p) in out.iter_mut().enumerate() {
            *p = (h1.wrapping_add(h2.wrapping_mul(i as u64)) % n) as usize;
        }
        out
    }

    /// Adds `key`.
    pub fn add(&mut self, key: &[u8]) {
        for p in self.probes(key) {
            self.bits[p / 64] |= 1 << (p % 64);
        }
    }

    /// False when `key` was certainly not added.
    pub fn may_contain(&self, key: &[u8]) -> bool {
        self.probes(key)
            .into_iter()
            .all(|p| self.bits[p / 64] & (1 << (p % 64)) != 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_false_negatives_and_few_false_positives() {
        let keys: Vec<Vec<u8>> = (0..50_000u64).map(|i| i.to_be_bytes().to_vec()).collect();
        let bloom = Bloom::build(keys.len(), keys.iter().map(Vec::as_slice));
        for k in &keys {
            assert!(bloom.may_contain(k), "added key {k:?} reported absent");
        }
        let false_pos = (50_000..150_000u64)
            .filter(|i| bloom.may_contain(&i.to_be_bytes()))
            .count();
        // About 1% expected; 3% would mean the hashing is broken.
        assert!(false_pos < 3_000, "{false_pos} false positives of 100 000");
        assert!(bloom.bits.len() * 8 <= 50_000 * BITS_PER_KEY / 8 + 8);
    }

    #[test]
    fn empty_filter_holds_nothing() {
        let bloom = Bloom::build(0, std::iter::empty());
        assert!(!bloom.may_contain(b"k"));
    }
}
