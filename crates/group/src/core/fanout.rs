//! Transaction multicast: a message to `tx:<tid>` travels hop by hop along
//! the transaction's participant tree (Raid's transaction-id multicast, with
//! no set-up messages). Each node delivers to itself, forwards to its
//! parent and children in the transaction except the neighbour it got the
//! message from, and answers that neighbour once its own subtree answered,
//! so the sender learns every participant reached. Message ids (the
//! communication id) deduplicate paths that meet.
//!
//! Owns the per-message fan-out state at one node. Must never look up the
//! transaction itself: the caller passes the node's neighbours in it.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use weft_wire::{NodeId, Status};

use crate::ids::{CommId, IdMap};

/// A node's place in a transaction's participant tree.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Tree {
    /// The node that called this node first on behalf of the transaction
    /// (`None` at the coordinator).
    pub parent: Option<NodeId>,
    /// Nodes this node called on behalf of the transaction.
    pub children: Vec<NodeId>,
}

impl Tree {
    /// The neighbours to forward to: parent and children, except `me` and
    /// `from`.
    pub fn neighbours(&self, me: NodeId, from: NodeId) -> BTreeSet<NodeId> {
        self.parent
            .iter()
            .chain(self.children.iter())
            .copied()
            .filter(|n| *n != me && *n != from)
            .collect()
    }
}

/// A subtree's outcome, to send upstream.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Finished {
    /// The communication.
    pub comm: CommId,
    /// Where to send it.
    pub upstream: NodeId,
    /// True at the fan-out's root (the answer goes to the sender as its
    /// delivery count).
    pub root: bool,
    /// Nodes of the subtree that queued the message.
    pub delivered: Vec<NodeId>,
    /// Nodes whose queue was full.
    pub full: u32,
    /// Neighbours that could not be reached.
    pub lost: Vec<(NodeId, Status)>,
}

/// What to do with a repeated arrival.
#[derive(Debug, PartialEq, Eq)]
pub enum Duplicate {
    /// Not seen before: handle it.
    New,
    /// The same upstream again while the subtree still works: ignore.
    Ignore,
    /// The same upstream again after the answer went out: repeat it.
    Repeat(Finished),
    /// Another path reached this node: answer with an empty subtree.
    Empty,
}

struct Fan {
    upstream: NodeId,
    root: bool,
    waiting: BTreeSet<NodeId>,
    delivered: Vec<NodeId>,
    full: u32,
    lost: Vec<(NodeId, Status)>,
    done: bool,
    since: Instant,
}

impl Fan {
    fn finished(&self, comm: CommId) -> Finished {
        Finished {
            comm,
            upstream: self.upstream,
            root: self.root,
            delivered: self.delivered.clone(),
            full: self.full,
            lost: self.lost.clone(),
        }
    }
}

/// Fan-outs this node takes part in.
#[derive(Default)]
pub struct Fanout {
    fans: IdMap<CommId, Fan>,
}

impl Fanout {
    /// How an arrival of `comm` from `from` relates to earlier ones.
    pub fn classify(&self, comm: &CommId, from: NodeId) -> Duplicate {
        match self.fans.get(comm) {
            None => Duplicate::New,
            Some(f) if f.upstream == from && f.done => Duplicate::Repeat(f.finished(*comm)),
            Some(f) if f.upstream == from => Duplicate::Ignore,
            Some(_) => Duplicate::Empty,
        }
    }

    /// Starts the fan-out of a first arrival: `delivered` whether the node
    /// queued the message itself, `full` whether its queue was full,
    /// `neighbours` where it is forwarded. Returns the outcome at once when
    /// there is nobody to wait for.
    #[allow(clippy::too_many_arguments)]
    pub fn begin(
        &mut self,
        me: NodeId,
        comm: CommId,
        upstream: NodeId,
        root: bool,
        delivered: bool,
        full: bool,
        neighbours: BTreeSet<NodeId>,
        now: Instant,
    ) -> Option<Finished> {
        let fan = Fan {
            upstream,
            root,
            waiting: neighbours,
            delivered: if delivered { vec![me] } else { Vec::new() },
            full: u32::from(full),
            lost: Vec::new(),
            done: false,
            since: now,
        };
        self.fans.insert(comm, fan);
        self.settle(&comm)
    }

    fn settle(&mut self, comm: &CommId) -> Option<Finished> {
        let f = self.fans.get_mut(comm)?;
        if f.done || !f.waiting.is_empty() {
            return None;
        }
        f.done = true;
        Some(f.finished(*comm))
    }

    /// A neighbour's subtree answered.
    pub fn ack(
        &mut self,
        comm: &CommId,
        from: NodeId,
        delivered: &[NodeId],
        full: u32,
        lost: &[(NodeId, Status)],
    ) -> Option<Finished> {
        let f = self.fans.get_mut(comm)?;
        if !f.waiting.remove(&from) {
            return None;
        }
        for n in delivered {
            if !f.delivered.contains(n) {
                f.delivered.push(*n);
            }
        }
        f.full += full;
        f.lost.extend_from_slice(lost);
        self.settle(comm)
    }

    /// A neighbour cannot answer (unreachable, timed out).
    pub fn neighbour_lost(
        &mut self,
        comm: &CommId,
        node: NodeId,
        status: Status,
    ) -> Option<Finished> {
        let f = self.fans.get_mut(comm)?;
        if !f.waiting.remove(&node) {
            return None;
        }
        f.lost.push((node, status));
        self.settle(comm)
    }

    /// `node` died: no fan-out waits for it any more.
    pub fn node_dead(&mut self, node: NodeId, status: Status) -> Vec<Finished> {
        let comms: Vec<CommId> = self
            .fans
            .iter()
            .filter(|(_, f)| f.waiting.contains(&node))
            .map(|(c, _)| *c)
            .collect();
        comms
            .into_iter()
            .filter_map(|c| self.neighbour_lost(&c, node, status))
            .collect()
    }

    /// Forgets fan-outs finished longer than `memory` ago.
    pub fn tick(&mut self, now: Instant, memory: Duration) {
        self.fans
            .retain(|_, f| !(f.done && now.saturating_duration_since(f.since) >= memory));
    }

    /// Number of fan-outs remembered.
    pub fn len(&self) -> usize {
        self.fans.len()
    }

    /// True when none is remembered.
    pub fn is_empty(&self) -> bool {
        self.fans.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::SenderId;
    use weft_wire::Incarnation;

    fn comm() -> CommId {
        CommId {
            sender: SenderId {
                node: NodeId(1),
                incarnation: Incarnation(1),
                id: 1,
            },
            session: 1,
        }
    }

    #[test]
    fn answers_upstream_once_the_subtree_answered() {
        let now = Instant::now();
        let mut f = Fanout::default();
        let tree = Tree {
            parent: Some(NodeId(1)),
            children: vec![NodeId(3), NodeId(4)],
        };
        let nb = tree.neighbours(NodeId(2), NodeId(1));
        assert_eq!(nb, [NodeId(3), NodeId(4)].into_iter().collect());
        assert!(f
            .begin(NodeId(2), comm(), NodeId(1), false, true, false, nb, now)
            .is_none());
        assert_eq!(f.classify(&comm(), NodeId(1)), Duplicate::Ignore);
        assert_eq!(f.classify(&comm(), NodeId(3)), Duplicate::Empty);
        assert!(f
            .ack(&comm(), NodeId(3), &[NodeId(3), NodeId(5)], 0, &[])
            .is_none());
        let done = f.node_dead(NodeId(4), Status::HostDead);
        assert_eq!(done.len(), 1);
        assert_eq!(done[0].delivered, vec![NodeId(2), NodeId(3), NodeId(5)]);
        assert_eq!(done[0].lost, vec![(NodeId(4), Status::HostDead)]);
        assert!(matches!(
            f.classify(&comm(), NodeId(1)),
            Duplicate::Repeat(_)
        ));
        f.tick(now + Duration::from_secs(10), Duration::from_secs(1));
        assert!(f.is_empty());
    }
}
