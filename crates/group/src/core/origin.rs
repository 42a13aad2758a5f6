//! Communications at the sender's node (T-Shoshin's OUTCM): delivery counts,
//! the number of replies wanted, the reply buffer, supersession and
//! termination.
//!
//! One sender has at most one communication per group; a new send to the
//! same group supersedes the previous one. A communication terminates when
//! the wanted replies arrived, when the sender sets replies to 0, when it is
//! superseded, or when the sender goes away. Members that will never answer
//! (their node died, their handle was dropped) become failure items in the
//! reply stream, so a sender waiting for every reply never hangs on them.
//!
//! Owns that state machine. Must never send: it reports which nodes must
//! hear that a communication terminated, and the core sends.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;

use weft_wire::{Failure, GroupId, NodeId, Payload, Status};

use crate::ids::{CommId, IdMap, IdSet, MemberId, SenderId};

/// One item of a communication's reply stream.
#[derive(Debug)]
pub enum ReplyItem {
    /// A member replied.
    Reply {
        /// The member.
        from: MemberId,
        /// Its reply.
        payload: Payload,
    },
    /// A member that received the message will never reply.
    Lost {
        /// The member, when known (a dead node's members are not).
        member: Option<MemberId>,
        /// Its node.
        node: NodeId,
        /// Why: HostDead or ProcDead (node or process gone), NoSuchGroup
        /// (group destroyed), TimedOut (node silent).
        status: Status,
    },
}

/// Why a communication ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ended {
    /// The wanted replies arrived.
    Satisfied,
    /// The sender set the replies wanted to 0.
    Cancelled,
}

/// How a send went: the members reached and the ones that were not.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Delivery {
    /// Members the message was queued for.
    pub delivered: u32,
    /// Members not reached because their queue was full.
    pub full: u32,
    /// Nodes that could not be reached, and why.
    pub lost: Vec<(NodeId, Status)>,
}

impl Delivery {
    /// The status of a send that reached nobody: NoBuffer when queues were
    /// full, else the first unreachable node's status, else NoMembers.
    pub fn failure(&self, gid: &GroupId) -> Failure {
        if self.full > 0 {
            Failure::new(
                Status::NoBuffer,
                format!(
                    "every member of {gid} reached had a full queue ({})",
                    self.full
                ),
            )
        } else if let Some((node, status)) = self.lost.first() {
            Failure::new(
                *status,
                format!("no member of {gid} reached: node {node} is {status}"),
            )
        } else {
            Failure::new(Status::NoMembers, format!("group {gid} has no members"))
        }
    }
}

#[derive(Debug, Default)]
struct Tally {
    acked: Option<u32>,
    dead: Option<Status>,
}

/// One communication.
#[derive(Debug)]
pub struct Comm {
    id: CommId,
    gid: Arc<GroupId>,
    hosts: BTreeMap<NodeId, Tally>,
    /// The fan-out root of a transaction group (replaced by the nodes it
    /// reports).
    tx_root: Option<NodeId>,
    full: u32,
    lost: Vec<(NodeId, Status)>,
    wanted: Option<u32>,
    taken: u32,
    buffer: VecDeque<ReplyItem>,
    answered: IdSet<MemberId>,
    answered_by: IdMap<NodeId, u32>,
    ended: Option<Ended>,
}

impl Comm {
    fn counted(&self) -> bool {
        self.hosts
            .values()
            .all(|t| t.acked.is_some() || t.dead.is_some())
    }

    fn count(&self) -> u32 {
        self.hosts.values().filter_map(|t| t.acked).sum()
    }

    fn limit(&self) -> Option<u32> {
        if self.counted() {
            let count = self.count();
            Some(self.wanted.map_or(count, |w| w.min(count)))
        } else {
            self.wanted
        }
    }

    fn stream(&self) -> u32 {
        self.taken + self.buffer.len() as u32
    }

    /// True while another item may join the reply stream.
    fn room(&self) -> bool {
        self.ended.is_none() && self.limit().is_none_or(|l| self.stream() < l)
    }

    /// Nodes that must hear that the communication ended: every node not
    /// known dead that may still hold a member of it with nothing to say
    /// yet. A node whose every member reached has answered (replied, or
    /// reported lost) has nobody left to tell, and a node that queued
    /// nothing neither.
    fn live_hosts(&self) -> Vec<NodeId> {
        self.hosts
            .iter()
            .filter(|(n, t)| {
                t.dead.is_none()
                    && t.acked
                        .is_none_or(|k| k > self.answered_by.get(n).copied().unwrap_or(0))
            })
            .map(|(n, _)| *n)
            .collect()
    }

    fn terminated(&self) -> Terminated {
        Terminated {
            comm: self.id,
            hosts: self.live_hosts(),
        }
    }

    fn delivery(&self) -> Delivery {
        let mut lost = self.lost.clone();
        for (n, t) in &self.hosts {
            if let (None, Some(s)) = (t.acked, t.dead) {
                if !lost.iter().any(|(m, _)| m == n) {
                    lost.push((*n, s));
                }
            }
        }
        Delivery {
            delivered: self.count(),
            full: self.full,
            lost,
        }
    }

    /// Ends the communication if the wanted replies are in. Returns the
    /// nodes to tell.
    fn settle(&mut self) -> Option<Terminated> {
        if self.ended.is_some() {
            return None;
        }
        match self.limit() {
            Some(limit) if self.counted() && self.stream() >= limit => {
                self.ended = Some(Ended::Satisfied);
                Some(self.terminated())
            }
            _ => None,
        }
    }
}

/// Where a send stands.
#[derive(Debug, PartialEq, Eq)]
pub enum Progress {
    /// Still waiting for delivery counts.
    Counting,
    /// Every count is in.
    Counted(Delivery),
    /// The communication is gone (superseded by a concurrent send, or the
    /// sender went away).
    Gone,
}

/// What taking a reply found.
#[derive(Debug)]
pub enum Take {
    /// The next item of the reply stream.
    Item(ReplyItem),
    /// Nothing yet; more may come.
    Pending,
    /// Nothing more will come (the communication terminated).
    NoComm(String),
}

/// A communication that must be terminated at its member nodes.
#[derive(Debug, PartialEq, Eq)]
pub struct Terminated {
    /// The communication.
    pub comm: CommId,
    /// Nodes to tell.
    pub hosts: Vec<NodeId>,
}

/// Every communication started at this node.
pub struct Origin {
    comms: IdMap<CommId, Comm>,
    /// Each sender's communication with each group.
    current: IdMap<u64, HashMap<GroupId, CommId>>,
    next_session: u64,
    max_open: usize,
    max_buffered: usize,
}

impl Origin {
    /// No communications; at most `max_open` (sender, group) pairs and
    /// `max_buffered` replies buffered per communication.
    pub fn new(max_open: usize, max_buffered: usize) -> Self {
        Origin {
            comms: IdMap::default(),
            current: IdMap::default(),
            next_session: 0,
            max_open,
            max_buffered,
        }
    }

    /// Number of communications held (terminated ones included until they
    /// are superseded or their sender goes).
    pub fn len(&self) -> usize {
        self.comms.len()
    }

    /// True when no communication is held.
    pub fn is_empty(&self) -> bool {
        self.comms.is_empty()
    }

    /// Starts a communication from `sender` to `gid` delivered to `hosts`
    /// (for a transaction group, `hosts` is the fan-out root alone and
    /// `tx_root` names it). Returns its id and the superseded communication,
    /// if one was still live.
    ///
    /// Fails with NoBuffer when too many communications are open.
    pub fn start(
        &mut self,
        sender: SenderId,
        gid: &Arc<GroupId>,
        hosts: &[NodeId],
        tx_root: Option<NodeId>,
    ) -> Result<(CommId, Option<Terminated>), Failure> {
        let previous = self.current_of(sender.id, gid);
        if previous.is_none() && self.comms.len() >= self.max_open {
            return Err(Failure::new(
                Status::NoBuffer,
                format!("{} communications are open at this node", self.comms.len()),
            ));
        }
        let superseded = previous.and_then(|old| {
            let c = self.comms.remove(&old)?;
            c.ended.is_none().then(|| c.terminated())
        });
        self.next_session += 1;
        let id = CommId {
            sender,
            session: self.next_session,
        };
        let comm = Comm {
            id,
            gid: Arc::clone(gid),
            hosts: hosts.iter().map(|h| (*h, Tally::default())).collect(),
            tx_root,
            full: 0,
            lost: Vec::new(),
            wanted: None,
            taken: 0,
            buffer: VecDeque::new(),
            answered: IdSet::default(),
            answered_by: IdMap::default(),
            ended: None,
        };
        self.comms.insert(id, comm);
        let current = self.current.entry(sender.id).or_default();
        match current.get_mut(&**gid) {
            Some(c) => *c = id,
            None => {
                current.insert((**gid).clone(), id);
            }
        }
        Ok((id, superseded))
    }

    /// `sender`'s current communication with `gid`.
    fn current_of(&self, sender: u64, gid: &GroupId) -> Option<CommId> {
        self.current.get(&sender)?.get(gid).copied()
    }

    /// The communication, if held.
    pub fn get(&self, comm: &CommId) -> Option<&Comm> {
        self.comms.get(comm)
    }

    /// True while the communication is held and not terminated.
    pub fn alive(&self, comm: &CommId) -> bool {
        self.comms.get(comm).is_some_and(|c| c.ended.is_none())
    }

    /// Where the send of `comm` stands.
    pub fn progress(&self, comm: &CommId) -> Progress {
        match self.comms.get(comm) {
            None => Progress::Gone,
            Some(c) if c.counted() => Progress::Counted(c.delivery()),
            Some(_) => Progress::Counting,
        }
    }

    /// The delivery report of `sender`'s current communication to `gid`.
    pub fn delivery(&self, sender: u64, gid: &GroupId) -> Option<Delivery> {
        let id = self.current_of(sender, gid)?;
        self.comms.get(&id).map(|c| c.delivery())
    }

    /// A node's count arrived: `counts` members queued per node, `full`
    /// members with a full queue, `lost` nodes not reached (fan-out).
    pub fn on_ack(
        &mut self,
        comm: &CommId,
        from: NodeId,
        counts: &[(NodeId, u32)],
        full: u32,
        lost: &[(NodeId, Status)],
    ) -> Option<Terminated> {
        let c = self.comms.get_mut(comm)?;
        if c.tx_root == Some(from) {
            let root = c.hosts.get(&from)?;
            if root.acked.is_some() || root.dead.is_some() {
                return None; // repeated
            }
            c.hosts.remove(&from);
            c.tx_root = None;
            for (n, k) in counts {
                c.hosts.insert(
                    *n,
                    Tally {
                        acked: Some(*k),
                        dead: None,
                    },
                );
            }
            if counts.is_empty() {
                // Keep the root as a zero count so the send is counted.
                c.hosts.insert(
                    from,
                    Tally {
                        acked: Some(0),
                        dead: None,
                    },
                );
            }
        } else {
            let t = c.hosts.get_mut(&from)?;
            if t.acked.is_some() || t.dead.is_some() {
                return None; // repeated, or too late: counted as lost
            }
            t.acked = Some(counts.iter().map(|(_, k)| *k).sum());
        }
        c.full += full;
        c.lost.extend_from_slice(lost);
        c.settle()
    }

    /// A member's reply arrived. Returns the answer for the member (Ok:
    /// buffered; NoComm: terminated, superseded or unknown; NoBuffer: the
    /// buffer is full) and the termination it caused, if any.
    pub fn on_reply(
        &mut self,
        comm: &CommId,
        member: MemberId,
        payload: Payload,
    ) -> (Status, Option<Terminated>) {
        let Some(c) = self.comms.get_mut(comm) else {
            return (Status::NoComm, None);
        };
        if c.answered.contains(&member) {
            return (Status::Ok, None); // a retransmission of an accepted reply
        }
        if c.ended.is_some() {
            return (Status::NoComm, None);
        }
        if c.hosts.get(&member.node).is_some_and(|t| t.dead.is_some()) {
            return (Status::NoComm, None); // already counted as lost
        }
        if !c.room() {
            return (Status::NoComm, None);
        }
        if c.buffer.len() >= self.max_buffered {
            return (Status::NoBuffer, None);
        }
        c.answered.insert(member);
        *c.answered_by.entry(member.node).or_default() += 1;
        c.buffer.push_back(ReplyItem::Reply {
            from: member,
            payload,
        });
        let t = c.settle();
        (Status::Ok, t)
    }

    /// The answer to a repeated reply whose value an earlier copy already
    /// delivered: Ok when it was accepted, NoComm otherwise.
    pub fn reply_status(&self, comm: &CommId, member: MemberId) -> Status {
        match self.comms.get(comm) {
            Some(c) if c.answered.contains(&member) => Status::Ok,
            _ => Status::NoComm,
        }
    }

    /// Members at `node` received the message but will never reply.
    pub fn on_lost(
        &mut self,
        comm: &CommId,
        node: NodeId,
        members: &[MemberId],
        status: Status,
    ) -> Option<Terminated> {
        let c = self.comms.get_mut(comm)?;
        if c.hosts.get(&node).is_some_and(|t| t.dead.is_some()) {
            return None;
        }
        for m in members {
            if c.answered.insert(*m) {
                *c.answered_by.entry(node).or_default() += 1;
                if c.room() {
                    c.buffer.push_back(ReplyItem::Lost {
                        member: Some(*m),
                        node,
                        status,
                    });
                }
            }
        }
        c.settle()
    }

    fn lose_host(c: &mut Comm, node: NodeId, status: Status) -> bool {
        let Some(t) = c.hosts.get_mut(&node) else {
            return false;
        };
        if t.dead.is_some() {
            return false;
        }
        t.dead = Some(status);
        if c.tx_root == Some(node) {
            c.tx_root = None;
        }
        if let Some(k) = t.acked {
            let answered = c.answered_by.get(&node).copied().unwrap_or(0);
            for _ in answered..k {
                if c.room() {
                    c.buffer.push_back(ReplyItem::Lost {
                        member: None,
                        node,
                        status,
                    });
                }
            }
            c.answered_by.insert(node, k.max(answered));
        }
        true
    }

    /// `node` will not answer for `comm` (its count timed out, or it could
    /// not be reached): its members count as lost with `status`.
    pub fn host_lost(&mut self, comm: &CommId, node: NodeId, status: Status) -> Option<Terminated> {
        let c = self.comms.get_mut(comm)?;
        if !Self::lose_host(c, node, status) {
            return None;
        }
        c.settle()
    }

    /// `node` died: every communication that reached or tried to reach it
    /// counts its members there as lost. Returns the communications touched
    /// (their senders must wake) and the terminations caused.
    pub fn node_dead(&mut self, node: NodeId, status: Status) -> (Vec<CommId>, Vec<Terminated>) {
        let mut touched = Vec::new();
        let mut ended = Vec::new();
        for c in self.comms.values_mut() {
            if Self::lose_host(c, node, status) {
                touched.push(c.id);
                if let Some(t) = c.settle() {
                    ended.push(t);
                }
            }
        }
        (touched, ended)
    }

    /// T-Shoshin's totreply: lowers the total number of replies wanted from
    /// `sender`'s current communication to `gid` (replies already taken
    /// count). 0 terminates it. Returns the effective total and the
    /// termination caused.
    ///
    /// Fails with NoComm when there is no communication, or it terminated
    /// and nothing is left to take.
    pub fn set_replies(
        &mut self,
        sender: u64,
        gid: &GroupId,
        n: u32,
    ) -> Result<(u32, Option<Terminated>), Failure> {
        let id = self
            .current_of(sender, gid)
            .ok_or_else(|| no_comm(gid, "no communication with this group"))?;
        let c = self
            .comms
            .get_mut(&id)
            .ok_or_else(|| no_comm(gid, "the communication is over"))?;
        if c.ended.is_some() {
            if c.buffer.is_empty() {
                return Err(no_comm(gid, "the communication is over"));
            }
            c.buffer.truncate(n.saturating_sub(c.taken) as usize);
            return Ok((c.stream(), None));
        }
        let mut total = c.wanted.map_or(n, |w| w.min(n));
        if c.counted() {
            total = total.min(c.count());
        }
        c.wanted = Some(total);
        if total == 0 {
            c.ended = Some(Ended::Cancelled);
            c.buffer.clear();
            return Ok((0, Some(c.terminated())));
        }
        c.buffer.truncate(total.saturating_sub(c.taken) as usize);
        let t = c.settle();
        Ok((total, t))
    }

    /// T-Shoshin's getreply without the wait: the next item of `sender`'s
    /// current communication with `gid`.
    pub fn take(&mut self, sender: u64, gid: &GroupId) -> Take {
        let Some(id) = self.current_of(sender, gid) else {
            return Take::NoComm(format!("no communication with {gid}"));
        };
        let Some(c) = self.comms.get_mut(&id) else {
            return Take::NoComm(format!("the communication with {gid} is over"));
        };
        if let Some(item) = c.buffer.pop_front() {
            c.taken += 1;
            return Take::Item(item);
        }
        match c.ended {
            Some(Ended::Satisfied) => Take::NoComm(format!(
                "the communication with {gid} is over: the {} wanted replies were taken",
                c.taken
            )),
            Some(Ended::Cancelled) => Take::NoComm(format!(
                "the communication with {gid} was terminated by setting replies to 0"
            )),
            None => Take::Pending,
        }
    }

    /// The sender went away: its communications end. Returns those that
    /// were live, with the nodes to tell.
    pub fn drop_sender(&mut self, sender: u64) -> Vec<Terminated> {
        let mut out = Vec::new();
        for id in self
            .current
            .remove(&sender)
            .into_iter()
            .flat_map(|m| m.into_values())
        {
            if let Some(c) = self.comms.remove(&id) {
                if c.ended.is_none() {
                    out.push(c.terminated());
                }
            }
        }
        out
    }

    /// The local sender id of `comm`'s sender, when held.
    pub fn sender_of(&self, comm: &CommId) -> Option<u64> {
        self.comms.get(comm).map(|c| c.id.sender.id)
    }

    /// The group of `comm`, when held.
    pub fn gid_of(&self, comm: &CommId) -> Option<&GroupId> {
        self.comms.get(comm).map(|c| &*c.gid)
    }
}

fn no_comm(gid: &GroupId, why: &str) -> Failure {
    Failure::new(Status::NoComm, format!("{gid}: {why}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use weft_wire::Incarnation;

    fn sender() -> SenderId {
        SenderId {
            node: NodeId(1),
            incarnation: Incarnation(1),
            id: 1,
        }
    }

    fn gid() -> GroupId {
        "a:b".parse().unwrap()
    }

    fn m(node: u32, id: u64) -> MemberId {
        MemberId {
            node: NodeId(node),
            id,
        }
    }

    fn reply(o: &mut Origin, c: &CommId, member: MemberId) -> (Status, Option<Terminated>) {
        o.on_reply(c, member, Payload::bytes(vec![member.id as u8]))
    }

    #[test]
    fn counts_then_replies_then_terminates() {
        let mut o = Origin::new(10, 10);
        let (c, sup) = o
            .start(sender(), &Arc::new(gid()), &[NodeId(2), NodeId(3)], None)
            .unwrap();
        assert!(sup.is_none());
        assert_eq!(o.progress(&c), Progress::Counting);
        // A fast member replies before its node's count arrived.
        assert_eq!(reply(&mut o, &c, m(2, 1)).0, Status::Ok);
        assert!(o.on_ack(&c, NodeId(2), &[(NodeId(2), 2)], 0, &[]).is_none());
        assert_eq!(o.progress(&c), Progress::Counting);
        assert!(o.on_ack(&c, NodeId(3), &[(NodeId(3), 1)], 1, &[]).is_none());
        let Progress::Counted(d) = o.progress(&c) else {
            panic!()
        };
        assert_eq!((d.delivered, d.full), (3, 1));
        assert_eq!(reply(&mut o, &c, m(2, 1)).0, Status::Ok, "retransmission");
        assert!(reply(&mut o, &c, m(3, 1)).1.is_none());
        let (st, t) = reply(&mut o, &c, m(2, 2));
        assert_eq!(st, Status::Ok);
        let t = t.expect("the third reply satisfies");
        assert!(t.hosts.is_empty(), "every member reached answered");
        assert_eq!(reply(&mut o, &c, m(2, 9)).0, Status::NoComm);
        for _ in 0..3 {
            assert!(matches!(
                o.take(1, &gid()),
                Take::Item(ReplyItem::Reply { .. })
            ));
        }
        assert!(matches!(o.take(1, &gid()), Take::NoComm(_)));
    }

    #[test]
    fn replies_may_only_be_lowered_and_zero_terminates() {
        let mut o = Origin::new(10, 10);
        let (c, _) = o
            .start(sender(), &Arc::new(gid()), &[NodeId(2)], None)
            .unwrap();
        o.on_ack(&c, NodeId(2), &[(NodeId(2), 5)], 0, &[]);
        assert_eq!(
            o.set_replies(1, &gid(), 9).unwrap().0,
            5,
            "never above the count"
        );
        assert_eq!(o.set_replies(1, &gid(), 2).unwrap().0, 2);
        assert_eq!(o.set_replies(1, &gid(), 4).unwrap().0, 2, "only lowered");
        reply(&mut o, &c, m(2, 1));
        let (_, t) = reply(&mut o, &c, m(2, 2));
        assert!(t.is_some());
        assert_eq!(
            reply(&mut o, &c, m(2, 3)).0,
            Status::NoComm,
            "beyond the wanted: dropped"
        );
        assert_eq!(
            o.set_replies(1, &gid(), 1).unwrap().0,
            1,
            "buffered replies dropped"
        );
        assert!(matches!(o.take(1, &gid()), Take::Item(_)));
        assert!(matches!(o.take(1, &gid()), Take::NoComm(_)));
        assert_eq!(
            o.set_replies(1, &gid(), 0).unwrap_err().status,
            Status::NoComm
        );

        let (c2, _) = o
            .start(sender(), &Arc::new(gid()), &[NodeId(2)], None)
            .unwrap();
        o.on_ack(&c2, NodeId(2), &[(NodeId(2), 5)], 0, &[]);
        reply(&mut o, &c2, m(2, 1));
        let (n, t) = o.set_replies(1, &gid(), 0).unwrap();
        assert_eq!(n, 0);
        assert_eq!(t.unwrap().hosts, vec![NodeId(2)]);
        assert!(
            matches!(o.take(1, &gid()), Take::NoComm(_)),
            "the buffer went with it"
        );
    }

    #[test]
    fn a_new_send_supersedes() {
        let mut o = Origin::new(10, 10);
        let (c1, _) = o
            .start(sender(), &Arc::new(gid()), &[NodeId(2)], None)
            .unwrap();
        o.on_ack(&c1, NodeId(2), &[(NodeId(2), 1)], 0, &[]);
        let (c2, sup) = o
            .start(sender(), &Arc::new(gid()), &[NodeId(2)], None)
            .unwrap();
        assert!(c2.session > c1.session);
        assert_eq!(
            sup.unwrap(),
            Terminated {
                comm: c1,
                hosts: vec![NodeId(2)],
            }
        );
        assert_eq!(reply(&mut o, &c1, m(2, 1)).0, Status::NoComm);
        assert_eq!(o.progress(&c1), Progress::Gone);
        assert_eq!(o.len(), 1);
    }

    #[test]
    fn dead_hosts_become_failure_items() {
        let mut o = Origin::new(10, 10);
        let (c, _) = o
            .start(
                sender(),
                &Arc::new(gid()),
                &[NodeId(2), NodeId(3), NodeId(4)],
                None,
            )
            .unwrap();
        o.on_ack(&c, NodeId(2), &[(NodeId(2), 2)], 0, &[]);
        o.on_ack(&c, NodeId(3), &[(NodeId(3), 1)], 0, &[]);
        reply(&mut o, &c, m(2, 1));
        let (touched, _) = o.node_dead(NodeId(2), Status::HostDead);
        assert_eq!(touched, vec![c]);
        // Node 4 never counted: lost with its status, the send completes.
        o.host_lost(&c, NodeId(4), Status::TimedOut);
        let Progress::Counted(d) = o.progress(&c) else {
            panic!()
        };
        assert_eq!(d.delivered, 3);
        assert_eq!(d.lost, vec![(NodeId(4), Status::TimedOut)]);
        assert_eq!(
            reply(&mut o, &c, m(2, 2)).0,
            Status::NoComm,
            "counted as lost"
        );
        let t = o.on_lost(&c, NodeId(3), &[m(3, 1)], Status::ProcDead);
        assert!(t.is_some(), "everyone answered");
        let mut statuses = Vec::new();
        while let Take::Item(i) = o.take(1, &gid()) {
            statuses.push(match i {
                ReplyItem::Reply { .. } => Status::Ok,
                ReplyItem::Lost { status, .. } => status,
            });
        }
        assert_eq!(
            statuses,
            vec![Status::Ok, Status::HostDead, Status::ProcDead]
        );
    }

    #[test]
    fn transaction_roots_report_their_nodes() {
        let mut o = Origin::new(10, 10);
        let g = GroupId::Tx(weft_wire::Tid::new(NodeId(1), Incarnation(1), 5));
        let (c, _) = o
            .start(
                sender(),
                &Arc::new(g.clone()),
                &[NodeId(1)],
                Some(NodeId(1)),
            )
            .unwrap();
        o.on_ack(
            &c,
            NodeId(1),
            &[(NodeId(1), 1), (NodeId(2), 1)],
            0,
            &[(NodeId(3), Status::HostDead)],
        );
        let Progress::Counted(d) = o.progress(&c) else {
            panic!()
        };
        assert_eq!(d.delivered, 2);
        assert_eq!(d.lost, vec![(NodeId(3), Status::HostDead)]);
        o.node_dead(NodeId(2), Status::ProcDead);
        assert!(matches!(
            o.take(1, &g),
            Take::Item(ReplyItem::Lost {
                node: NodeId(2),
                ..
            })
        ));
    }

    #[test]
    fn bounded() {
        let mut o = Origin::new(1, 1);
        let (c, _) = o
            .start(sender(), &Arc::new(gid()), &[NodeId(2)], None)
            .unwrap();
        let other: GroupId = "a:c".parse().unwrap();
        assert_eq!(
            o.start(sender(), &Arc::new(other.clone()), &[NodeId(2)], None)
                .unwrap_err()
                .status,
            Status::NoBuffer
        );
        o.on_ack(&c, NodeId(2), &[(NodeId(2), 3)], 0, &[]);
        assert_eq!(reply(&mut o, &c, m(2, 1)).0, Status::Ok);
        assert_eq!(reply(&mut o, &c, m(2, 2)).0, Status::NoBuffer);
        assert_eq!(o.drop_sender(1).len(), 1);
        assert!(o.is_empty());
    }
}
