//! The replication controller's map (RC): which sites hold a copy of each
//! relation, and the read-one-write-all rule.
//!
//! Owns placement. Every relation is replicated on the same set of sites
//! (the demo's full replication). Reads go to one copy (this site's when it
//! holds one); writes go to every copy, the lowest site first so that
//! transactions meet at the same first lock and cannot deadlock across
//! sites. Must never write fewer than all copies (ROWA): a transaction that
//! cannot reach a copy fails with that site's status.

use serde::{Deserialize, Serialize};
use weft_transport::Endpoint;
use weft_wire::NodeId;

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

    /// Every member the endpoint knows offering the site service (alive or
    /// not: a dead copy must fail writes, not be skipped).
    pub fn all_alive(ep: &Endpoint) -> Replicas {
        let sites = ep
            .view()
            .nodes
            .iter()
            .filter(|n| {
                n.info
                    .services
                    .iter()
                    .any(|s| s == crate::site::SITE_SERVICE)
            })
            .map(|n| n.info.id)
            .collect();
        Replicas::new(sites, ep.node_id())
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
}
