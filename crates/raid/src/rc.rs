//! The replication controller's map (RC): which sites hold a copy of each
//! relation, and the read-one-write-all rule.
//!
//! Owns placement. Every relation is replicated on the same set of sites
//! (the demo's full replication): the placement, written into every copy
//! by the load (with its last tuples: a copy that holds a placement is
//! fully loaded) and never changed after. Reads go to one copy (this site's
//! when it holds one); writes go to every copy, the lowest site first so
//! that transactions meet at the same first lock and cannot deadlock
//! across sites. Must never write fewer than all copies (ROWA): the set of
//! copies is the placement, never the members that happen to be alive or
//! to offer a service at the moment; a transaction that cannot reach a copy
//! fails with that site's status.

use bytes::{BufMut, Bytes, BytesMut};
use serde::{Deserialize, Serialize};
use weft_wire::NodeId;

/// The key under which a copy stores its placement (outside every
/// relation's key range: no transaction reads or writes it).
pub const PLACEMENT_KEY: &[u8] = b"c:placement";

/// Most sites a placement may name.
pub const MAX_SITES: usize = 1024;

/// The sites holding copies, in order.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Replicas {
    sites: Vec<NodeId>,
    local: NodeId,
}

impl Replicas {
    /// Copies on `sites`, as seen from site `local`.
    pub fn new(mut sites: Vec<NodeId>, local: NodeId) -> Replicas {
        sites.sort();
        sites.dedup();
        Replicas { sites, local }
    }

    /// The stored form of a placement: each site's id, 4 bytes
    /// little-endian, lowest first.
    pub fn encode_placement(sites: &[NodeId]) -> Bytes {
        let mut sorted = sites.to_vec();
        sorted.sort();
        sorted.dedup();
        let mut b = BytesMut::with_capacity(sorted.len() * 4);
        for s in sorted {
            b.put_u32_le(s.0);
        }
        b.freeze()
    }

    /// The sites of a stored placement; `None` when the bytes are not one
    /// (empty, a partial id, too many sites, not in ascending order).
    pub fn decode_placement(bytes: &[u8]) -> Option<Vec<NodeId>> {
        if bytes.is_empty() || !bytes.len().is_multiple_of(4) || bytes.len() / 4 > MAX_SITES {
            return None;
        }
        let sites: Vec<NodeId> = bytes
            .chunks_exact(4)
            .map(|c| NodeId(u32::from_le_bytes(c.try_into().expect("4 bytes"))))
            .collect();
        sites.windows(2).all(|w| w[0] < w[1]).then_some(sites)
    }

    /// Every copy, lowest site first.
    pub fn all(&self) -> &[NodeId] {
        &self.sites
    }

    /// The copy a read goes to: this site's if it holds one, else the first.
    pub fn read_site(&self) -> NodeId {
        if self.sites.contains(&self.local) {
            self.local
        } else {
            self.sites.first().copied().unwrap_or(self.local)
        }
    }

    /// The site these copies are seen from.
    pub fn local(&self) -> NodeId {
        self.local
    }

    /// The site whose copy writes reach first.
    pub fn first(&self) -> NodeId {
        self.sites.first().copied().unwrap_or(self.local)
    }

    /// The other copies.
    pub fn rest(&self) -> &[NodeId] {
        self.sites.get(1..).unwrap_or(&[])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn read_one_write_all() {
        let r = Replicas::new(vec![NodeId(3), NodeId(1), NodeId(2), NodeId(3)], NodeId(2));
        assert_eq!(r.all(), &[NodeId(1), NodeId(2), NodeId(3)]);
        assert_eq!(r.read_site(), NodeId(2));
        assert_eq!(r.first(), NodeId(1));
        assert_eq!(r.rest(), &[NodeId(2), NodeId(3)]);
        let outside = Replicas::new(vec![NodeId(5)], NodeId(2));
        assert_eq!(outside.read_site(), NodeId(5));
    }

    #[test]
    fn placements_round_trip_and_reject_garbage() {
        let stored = Replicas::encode_placement(&[NodeId(3), NodeId(1), NodeId(3)]);
        assert_eq!(
            Replicas::decode_placement(&stored),
            Some(vec![NodeId(1), NodeId(3)])
        );
        assert_eq!(Replicas::decode_placement(b""), None);
        assert_eq!(Replicas::decode_placement(b"\x01\x00\x00"), None);
        let unsorted = [2u32, 1]
            .iter()
            .flat_map(|i| i.to_le_bytes())
            .collect::<Vec<_>>();
        assert_eq!(Replicas::decode_placement(&unsorted), None);
        assert_eq!(
            Replicas::decode_placement(&vec![0u8; 4 * (MAX_SITES + 1)]),
            None
        );
    }
}
