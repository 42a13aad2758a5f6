//! Members at their node: which local processes belong to which groups,
//! their bounded message queues, and what this node knows about each
//! communication that reached it (T-Shoshin's remote OUTCM with its reverse
//! list of members: delivered, received, replied).
//!
//! Owns delivery into queues (counting what was queued), receive with group
//! and tag selection, the member side of replies, and what happens to queued
//! messages when a member leaves, is dropped or its group is destroyed.
//! Must never talk to other nodes: it reports what they must hear.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use weft_wire::{Failure, GroupId, NodeId, Payload, Status};

use crate::ids::{CommId, IdMap, MemberId, SenderId, Tag};

/// The member id of the node itself (the member of its transaction groups).
pub const NODE_MEMBER: u64 = 0;

/// A message a member took from its queue.
#[derive(Debug)]
pub struct Received {
    /// The communication.
    pub comm: CommId,
    /// The group it was sent to (shared by every copy of the message).
    pub gid: Arc<GroupId>,
    /// Its tag.
    pub tag: Tag,
    /// The message.
    pub payload: Payload,
}

/// Members that received a communication's message and will never reply.
#[derive(Debug, PartialEq, Eq)]
pub struct LostReport {
    /// The communication.
    pub comm: CommId,
    /// The members.
    pub members: Vec<MemberId>,
    /// Why.
    pub status: Status,
}

/// What a delivery did.
#[derive(Debug, Default)]
pub struct Delivered {
    /// Members the message was queued for.
    pub count: u32,
    /// Members whose queue was full.
    pub full: u32,
    /// Members to wake.
    pub woke: Vec<u64>,
}

struct Entry {
    comm: CommId,
    gid: Arc<GroupId>,
    tag: Tag,
    payload: Payload,
}

#[derive(Default)]
struct LocalMember {
    groups: BTreeSet<GroupId>,
    queue: VecDeque<Entry>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum MState {
    Queued,
    Received,
    Replying,
    Replied,
    Gone,
}

impl MState {
    fn pending(self) -> bool {
        matches!(self, MState::Queued | MState::Received | MState::Replying)
    }
}

struct InComm {
    /// `None` for a communication known only from its termination.
    gid: Option<Arc<GroupId>>,
    members: BTreeMap<u64, MState>,
    terminated: bool,
    count: u32,
    full: u32,
    touched: Instant,
    /// Its place in [`Host::schedule`]: the housekeeping looks at it
    /// again once this is a probe interval in the past.
    due: Instant,
}

impl InComm {
    fn settled(&self) -> bool {
        self.terminated || !self.members.values().any(|s| s.pending())
    }
}

/// The members of this node and the communications that reached them.
pub struct Host {
    me: NodeId,
    members: IdMap<u64, LocalMember>,
    next_member: u64,
    groups: HashMap<GroupId, BTreeSet<u64>>,
    comms: IdMap<CommId, InComm>,
    /// Every communication remembered, by when housekeeping looks at it
    /// next, so that a tick costs what is due, not what is remembered.
    schedule: BTreeSet<(Instant, CommId)>,
    /// The latest session seen from each sender, per group.
    latest: IdMap<SenderId, HashMap<GroupId, u64>>,
    replies: IdMap<u64, (CommId, u64)>,
    queue_cap: usize,
    max_members: usize,
    max_groups_per_member: usize,
}

impl Host {
    /// A node with only its own member (for transaction groups).
    pub fn new(
        me: NodeId,
        queue_cap: usize,
        max_members: usize,
        max_groups_per_member: usize,
    ) -> Self {
        let mut members = IdMap::default();
        members.insert(NODE_MEMBER, LocalMember::default());
        Host {
            me,
            members,
            next_member: 1,
            groups: HashMap::new(),
            comms: IdMap::default(),
            schedule: BTreeSet::new(),
            latest: IdMap::default(),
            replies: IdMap::default(),
            queue_cap,
            max_members,
            max_groups_per_member,
        }
    }

    fn mid(&self, id: u64) -> MemberId {
        MemberId { node: self.me, id }
    }

    /// Creates a member (a process) with no groups.
    ///
    /// Fails with NoBuffer when the node hosts its maximum of members.
    pub fn add_member(&mut self) -> Result<u64, Failure> {
        if self.members.len() > self.max_members {
            return Err(Failure::new(
                Status::NoBuffer,
                format!(
                    "node {} hosts its maximum of {} members",
                    self.me, self.max_members
                ),
            ));
        }
        let id = self.next_member;
        self.next_member += 1;
        self.members.insert(id, LocalMember::default());
        Ok(id)
    }

    /// True while `member` exists.
    pub fn has_member(&self, member: u64) -> bool {
        self.members.contains_key(&member)
    }

    /// The groups `member` belongs to.
    pub fn member_groups(&self, member: u64) -> Vec<GroupId> {
        self.members
            .get(&member)
            .map(|m| m.groups.iter().cloned().collect())
            .unwrap_or_default()
    }

    /// True when `member` belongs to `gid`.
    pub fn is_member(&self, member: u64, gid: &GroupId) -> bool {
        self.members
            .get(&member)
            .is_some_and(|m| m.groups.contains(gid))
    }

    /// Messages waiting in `member`'s queue.
    pub fn queue_len(&self, member: u64) -> usize {
        self.members.get(&member).map_or(0, |m| m.queue.len())
    }

    /// True when some local member belongs to `gid`.
    pub fn hosts_group(&self, gid: &GroupId) -> bool {
        self.groups.get(gid).is_some_and(|s| !s.is_empty())
    }

    /// Every group with local members, sorted.
    pub fn hosted_groups(&self) -> Vec<GroupId> {
        let mut v: Vec<GroupId> = self
            .groups
            .iter()
            .filter(|(_, s)| !s.is_empty())
            .map(|(g, _)| g.clone())
            .collect();
        v.sort();
        v
    }

    /// Local members of `gid`.
    pub fn local_members(&self, gid: &GroupId) -> usize {
        self.groups.get(gid).map_or(0, |s| s.len())
    }

    /// Adds `member` to `gid` (idempotent).
    ///
    /// Fails with ProcDead for an unknown member, NoBuffer when it belongs to
    /// its maximum of groups.
    pub fn join(&mut self, member: u64, gid: &GroupId) -> Result<(), Failure> {
        let max = self.max_groups_per_member;
        let m = self
            .members
            .get_mut(&member)
            .ok_or_else(|| Failure::new(Status::ProcDead, format!("member {member} is gone")))?;
        if m.groups.contains(gid) {
            return Ok(());
        }
        if m.groups.len() >= max {
            return Err(Failure::new(
                Status::NoBuffer,
                format!("a member may belong to at most {max} groups"),
            ));
        }
        m.groups.insert(gid.clone());
        self.groups.entry(gid.clone()).or_default().insert(member);
        Ok(())
    }

    fn forget_membership(&mut self, member: u64, gid: &GroupId) -> bool {
        if let Some(set) = self.groups.get_mut(gid) {
            set.remove(&member);
            if set.is_empty() {
                self.groups.remove(gid);
                return true;
            }
        }
        false
    }

    /// Drops `member`'s queued messages that match `pred`, reporting the
    /// live communications they belonged to as lost with `status`.
    fn drop_queued(
        &mut self,
        member: u64,
        status: Status,
        pred: impl Fn(&Entry) -> bool,
    ) -> Vec<LostReport> {
        let mut lost: BTreeMap<CommId, Vec<MemberId>> = BTreeMap::new();
        let mid = self.mid(member);
        let Some(m) = self.members.get_mut(&member) else {
            return Vec::new();
        };
        let mut kept = VecDeque::with_capacity(m.queue.len());
        for e in m.queue.drain(..) {
            if !pred(&e) {
                kept.push_back(e);
                continue;
            }
            if let Some(c) = self.comms.get_mut(&e.comm) {
                if let Some(s) = c.members.get_mut(&member) {
                    if *s == MState::Queued {
                        *s = MState::Gone;
                        if !c.terminated {
                            lost.entry(e.comm).or_default().push(mid);
                        }
                    }
                }
            }
        }
        m.queue = kept;
        lost.into_iter()
            .map(|(comm, members)| LostReport {
                comm,
                members,
                status,
            })
            .collect()
    }

    /// `member` leaves `gid`: its queued messages for the group are dropped
    /// (their communications count it as lost, ProcDead); messages it
    /// already received may still be replied to. Returns the lost reports
    /// and whether the node no longer hosts the group.
    ///
    /// Fails with Mismatch when the member does not belong to the group.
    pub fn leave(
        &mut self,
        member: u64,
        gid: &GroupId,
    ) -> Result<(Vec<LostReport>, bool), Failure> {
        let m = self
            .members
            .get_mut(&member)
            .ok_or_else(|| Failure::new(Status::ProcDead, format!("member {member} is gone")))?;
        if !m.groups.remove(gid) {
            return Err(Failure::new(
                Status::Mismatch,
                format!("{} is not a member of {gid}", self.mid(member)),
            ));
        }
        let lost = self.drop_queued(member, Status::ProcDead, |e| *e.gid == *gid);
        let emptied = self.forget_membership(member, gid);
        Ok((lost, emptied))
    }

    /// `member` is gone (its handle dropped without leaving: a dead
    /// process). Every communication waiting on it counts it as lost
    /// (ProcDead). Returns the reports and the groups the node no longer
    /// hosts.
    pub fn drop_member(&mut self, member: u64) -> (Vec<LostReport>, Vec<GroupId>) {
        if member == NODE_MEMBER || !self.members.contains_key(&member) {
            return (Vec::new(), Vec::new());
        }
        let mut lost = self.drop_queued(member, Status::ProcDead, |_| true);
        // Messages received but not replied to will never be.
        let mid = self.mid(member);
        for (id, c) in self.comms.iter_mut() {
            if let Some(s) = c.members.get_mut(&member) {
                if *s == MState::Received {
                    *s = MState::Gone;
                    if !c.terminated {
                        lost.push(LostReport {
                            comm: *id,
                            members: vec![mid],
                            status: Status::ProcDead,
                        });
                    }
                }
            }
        }
        let groups: Vec<GroupId> = self
            .members
            .remove(&member)
            .map(|m| m.groups.into_iter().collect())
            .unwrap_or_default();
        let emptied = groups
            .iter()
            .filter(|g| self.forget_membership(member, g))
            .cloned()
            .collect();
        (lost, emptied)
    }

    /// `gid` was destroyed: local members leave it; their queued messages
    /// for it are dropped (lost, NoSuchGroup). Returns the reports and the
    /// members to wake.
    pub fn group_removed(&mut self, gid: &GroupId) -> (Vec<LostReport>, Vec<u64>) {
        let members: Vec<u64> = self
            .groups
            .remove(gid)
            .map(|s| s.into_iter().collect())
            .unwrap_or_default();
        let mut lost = Vec::new();
        for m in &members {
            if let Some(lm) = self.members.get_mut(m) {
                lm.groups.remove(gid);
            }
            lost.extend(self.drop_queued(*m, Status::NoSuchGroup, |e| *e.gid == *gid));
        }
        (lost, members)
    }

    /// Queues a communication's message for the local members of `gid` (for
    /// a transaction group, for the node itself when `tx_target`). A
    /// repeated delivery answers the first one's count; an `Elided` body
    /// (retransmission of a moved value) never seen before, or a delivery
    /// already superseded, counts 0.
    pub fn deliver(
        &mut self,
        comm: CommId,
        gid: Arc<GroupId>,
        tag: Tag,
        payload: Option<Payload>,
        tx_target: bool,
        now: Instant,
    ) -> Delivered {
        if let Some(c) = self.comms.get(&comm) {
            let (count, full) = (c.count, c.full);
            self.touch(&comm, now);
            return Delivered {
                count,
                full,
                woke: Vec::new(),
            };
        }
        let latest = self.latest.entry(comm.sender).or_default();
        let seen = latest.get_mut(&*gid);
        let superseded = seen.as_ref().is_some_and(|s| **s > comm.session);
        let mut record = InComm {
            gid: Some(gid.clone()),
            members: BTreeMap::new(),
            terminated: false,
            count: 0,
            full: 0,
            touched: now,
            due: now,
        };
        let (Some(payload), false) = (payload, superseded) else {
            record.terminated = true;
            self.remember(comm, record);
            return Delivered::default();
        };
        let old = match seen {
            Some(s) => Some(std::mem::replace(s, comm.session)),
            None => {
                latest.insert((*gid).clone(), comm.session);
                None
            }
        };
        if let Some(old) = old {
            let old_id = CommId {
                sender: comm.sender,
                session: old,
            };
            if let Some(c) = self.comms.get_mut(&old_id) {
                c.terminated = true; // superseded
            }
        }
        let named = match &*gid {
            GroupId::Named { .. } => self.groups.get(&*gid),
            GroupId::Tx(_) => None,
        };
        let node = matches!(&*gid, GroupId::Tx(_)) && tx_target;
        let mut eligible = Vec::with_capacity(named.map_or(1, |s| s.len()));
        for t in named
            .into_iter()
            .flatten()
            .copied()
            .chain(node.then_some(NODE_MEMBER))
        {
            let Some(m) = self.members.get_mut(&t) else {
                continue;
            };
            if m.queue.len() >= self.queue_cap {
                // Entries of finished communications would only say NoComm.
                let comms = &self.comms;
                m.queue
                    .retain(|e| comms.get(&e.comm).is_some_and(|c| !c.terminated));
            }
            if m.queue.len() >= self.queue_cap {
                record.full += 1;
            } else {
                eligible.push(t);
            }
        }
        // One copy per member: bytes are shared; a local value is encoded
        // once when more than one member takes it.
        let (mut single, shared) = match eligible.len() {
            0 => (None, None),
            1 => (Some(payload), None),
            _ => match payload.into_bytes() {
                Ok(b) => (None, Some(b)),
                Err(e) => {
                    tracing::warn!(%comm, "group message cannot be encoded for copies: {e}");
                    eligible.clear();
                    (None, None)
                }
            },
        };
        for t in &eligible {
            let Some(p) = single
                .take()
                .or_else(|| shared.as_ref().map(|b| Payload::Bytes(b.clone())))
            else {
                break;
            };
            if let Some(m) = self.members.get_mut(t) {
                m.queue.push_back(Entry {
                    comm,
                    gid: gid.clone(),
                    tag,
                    payload: p,
                });
                record.members.insert(*t, MState::Queued);
            }
        }
        record.count = eligible.len() as u32;
        let out = Delivered {
            count: record.count,
            full: record.full,
            woke: eligible,
        };
        self.remember(comm, record);
        out
    }

    /// Starts remembering a communication (not known yet).
    fn remember(&mut self, comm: CommId, record: InComm) {
        self.schedule.insert((record.due, comm));
        self.comms.insert(comm, record);
    }

    /// Something happened to `comm` at `now`: its idle time restarts.
    fn touch(&mut self, comm: &CommId, now: Instant) {
        if let Some(c) = self.comms.get_mut(comm) {
            self.schedule.remove(&(c.due, *comm));
            c.touched = now;
            c.due = now;
            self.schedule.insert((now, *comm));
        }
    }

    /// Takes the first message in `member`'s queue sent to `gid` (any group
    /// when `None`) with `tag` (any tag when `None`). `Ok(None)` when there
    /// is none.
    ///
    /// Fails with NoComm when that message's communication terminated or
    /// was superseded (the message is consumed: T-Shoshin's member "gets a
    /// termination status instead of the message"), ProcDead for an unknown
    /// member.
    pub fn receive(
        &mut self,
        member: u64,
        gid: Option<&GroupId>,
        tag: Option<Tag>,
    ) -> Result<Option<Received>, Failure> {
        let m = self
            .members
            .get_mut(&member)
            .ok_or_else(|| Failure::new(Status::ProcDead, format!("member {member} is gone")))?;
        let pos = m
            .queue
            .iter()
            .position(|e| gid.is_none_or(|g| *e.gid == *g) && tag.is_none_or(|t| e.tag == t));
        let Some(pos) = pos else {
            return Ok(None);
        };
        let Some(e) = m.queue.remove(pos) else {
            return Ok(None);
        };
        match self.comms.get_mut(&e.comm) {
            Some(c) if !c.terminated && c.members.get(&member) == Some(&MState::Queued) => {
                c.members.insert(member, MState::Received);
                Ok(Some(Received {
                    comm: e.comm,
                    gid: e.gid,
                    tag: e.tag,
                    payload: e.payload,
                }))
            }
            Some(c) => {
                c.members.insert(member, MState::Gone);
                Err(Failure::new(
                    Status::NoComm,
                    format!(
                        "communication {} with {} terminated or was superseded",
                        e.comm, e.gid
                    ),
                ))
            }
            None => Err(Failure::new(
                Status::NoComm,
                format!("communication {} with {} is over", e.comm, e.gid),
            )),
        }
    }

    /// Starts `member`'s reply `reply` to `comm`.
    ///
    /// Fails with NoComm when the communication terminated (or the member
    /// left it), Mismatch when the member did not receive that message or
    /// already replied.
    pub fn begin_reply(&mut self, member: u64, comm: &CommId, reply: u64) -> Result<(), Failure> {
        let mid = self.mid(member);
        let over = || Failure::new(Status::NoComm, format!("communication {comm} is over"));
        let c = self.comms.get_mut(comm).ok_or_else(over)?;
        match c.members.get(&member).copied() {
            Some(MState::Replying) | Some(MState::Replied) => Err(Failure::new(
                Status::Mismatch,
                format!("{mid} already replied to {comm}"),
            )),
            Some(MState::Queued) => Err(Failure::new(
                Status::Mismatch,
                format!("{mid} has not received {comm}"),
            )),
            Some(MState::Received) if !c.terminated => {
                c.members.insert(member, MState::Replying);
                self.replies.insert(reply, (*comm, member));
                Ok(())
            }
            Some(MState::Received) => Err(over()),
            Some(MState::Gone) | None => Err(Failure::new(
                Status::NoComm,
                format!("{mid} is no longer part of {comm}"),
            )),
        }
    }

    /// The sender's node answered reply `reply` (or it will never answer:
    /// NoComm, TimedOut). Returns the member that replied, when known.
    pub fn reply_done(&mut self, reply: u64, status: Status) -> Option<(CommId, u64)> {
        let (comm, member) = self.replies.remove(&reply)?;
        if let Some(c) = self.comms.get_mut(&comm) {
            let next = match status {
                Status::Ok => MState::Replied,
                // Refused for now: the member may try again.
                Status::NoBuffer | Status::TimedOut => MState::Received,
                _ => MState::Gone,
            };
            if status == Status::NoComm {
                c.terminated = true;
            }
            c.members.insert(member, next);
        }
        Some((comm, member))
    }

    /// The communication is over (terminated at the sender). Returns true
    /// when it was known and live.
    pub fn terminate(&mut self, comm: &CommId, now: Instant) -> bool {
        match self.comms.get_mut(comm) {
            Some(c) if !c.terminated => {
                c.terminated = true;
                self.touch(comm, now);
                true
            }
            Some(_) => false,
            None => {
                // Remember it, in case its delivery is still on the way.
                self.remember(
                    *comm,
                    InComm {
                        gid: None,
                        members: BTreeMap::new(),
                        terminated: true,
                        count: 0,
                        full: 0,
                        touched: now,
                        due: now,
                    },
                );
                false
            }
        }
    }

    /// The sender's node died: every communication it started is over.
    /// Returns the pending replies to it (they fail with NoComm).
    pub fn origin_dead(&mut self, node: NodeId) -> Vec<u64> {
        for (id, c) in self.comms.iter_mut() {
            if id.origin() == node {
                c.terminated = true;
            }
        }
        self.latest.retain(|s, _| s.node != node);
        self.replies
            .iter()
            .filter(|(_, (c, _))| c.origin() == node)
            .map(|(r, _)| *r)
            .collect()
    }

    /// Housekeeping at `now`: forgets settled communications idle for twice
    /// `after`, and returns live ones idle for `after`, by origin, to probe.
    pub fn tick(&mut self, now: Instant, after: Duration) -> Vec<(NodeId, Vec<CommId>)> {
        let mut forget = Vec::new();
        let mut probe: BTreeMap<NodeId, Vec<CommId>> = BTreeMap::new();
        let mut later = Vec::new();
        // Only communications idle for `after` are looked at: a settled one
        // comes back when it is idle for twice that (settling is for good),
        // a live one is probed and comes back an interval later.
        while let Some(&(due, id)) = self.schedule.first() {
            if now.saturating_duration_since(due) < after {
                break;
            }
            self.schedule.pop_first();
            let Some(c) = self.comms.get_mut(&id) else {
                continue;
            };
            let idle = now.saturating_duration_since(c.touched);
            if c.settled() {
                if idle >= after * 2 {
                    forget.push(id);
                } else {
                    c.due = c.touched + after;
                    later.push((c.due, id));
                }
            } else {
                c.touched = now;
                c.due = now;
                later.push((now, id));
                probe.entry(id.origin()).or_default().push(id);
            }
        }
        self.schedule.extend(later);
        for id in forget {
            if let Some(gid) = self.comms.remove(&id).and_then(|c| c.gid) {
                if let Some(latest) = self.latest.get_mut(&id.sender) {
                    if latest.get(&*gid) == Some(&id.session) {
                        latest.remove(&*gid);
                        if latest.is_empty() {
                            self.latest.remove(&id.sender);
                        }
                    }
                }
            }
        }
        probe.into_iter().collect()
    }

    /// Number of communications remembered.
    pub fn comms_len(&self) -> usize {
        self.comms.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use weft_wire::Incarnation;

    fn comm(session: u64) -> CommId {
        CommId {
            sender: SenderId {
                node: NodeId(9),
                incarnation: Incarnation(1),
                id: 1,
            },
            session,
        }
    }

    fn g() -> GroupId {
        "a:b".parse().unwrap()
    }

    /// A host at node 2 with one member, `a`, in `g()`.
    fn one_member() -> (Host, u64) {
        let mut h = Host::new(NodeId(2), 4, 10, 10);
        let a = h.add_member().unwrap();
        h.join(a, &g()).unwrap();
        (h, a)
    }

    fn bytes(b: u8) -> Option<Payload> {
        Some(Payload::bytes(vec![b]))
    }

    #[test]
    fn delivers_receives_replies() {
        let now = Instant::now();
        let mut h = Host::new(NodeId(2), 4, 10, 10);
        let a = h.add_member().unwrap();
        let b = h.add_member().unwrap();
        h.join(a, &g()).unwrap();
        h.join(b, &g()).unwrap();
        let d = h.deliver(
            comm(1),
            Arc::new(g()),
            Tag(0),
            Some(Payload::local(5u32)),
            false,
            now,
        );
        assert_eq!((d.count, d.full), (2, 0));
        assert_eq!(
            h.deliver(comm(1), Arc::new(g()), Tag(0), None, false, now)
                .count,
            2,
            "repeat"
        );
        let r = h.receive(a, Some(&g()), None).unwrap().unwrap();
        assert_eq!(
            r.payload.decode::<u32>().unwrap(),
            5,
            "copies of a local value decode"
        );
        assert_eq!(
            h.begin_reply(b, &comm(1), 7).unwrap_err().status,
            Status::Mismatch
        );
        h.begin_reply(a, &comm(1), 8).unwrap();
        assert_eq!(
            h.begin_reply(a, &comm(1), 9).unwrap_err().status,
            Status::Mismatch
        );
        assert_eq!(h.reply_done(8, Status::Ok), Some((comm(1), a)));
        assert!(h.receive(a, Some(&g()), None).unwrap().is_none());
        // Tag selection.
        h.deliver(comm(2), Arc::new(g()), Tag(7), bytes(1), false, now);
        assert!(h.receive(b, None, Some(Tag(8))).unwrap().is_none());
        // b's copy of comm 1 was superseded by comm 2.
        assert_eq!(h.receive(b, None, None).unwrap_err().status, Status::NoComm);
        assert!(h.receive(b, None, Some(Tag(7))).unwrap().is_some());
    }

    #[test]
    fn full_queues_count_as_not_delivered() {
        let now = Instant::now();
        let mut h = Host::new(NodeId(2), 1, 10, 10);
        let a = h.add_member().unwrap();
        h.join(a, &g()).unwrap();
        let other = |i: u64| CommId {
            sender: SenderId {
                node: NodeId(9),
                incarnation: Incarnation(1),
                id: 10 + i,
            },
            session: i,
        };
        assert_eq!(
            h.deliver(other(1), Arc::new(g()), Tag(0), bytes(1), false, now)
                .count,
            1
        );
        let d = h.deliver(other(2), Arc::new(g()), Tag(0), bytes(2), false, now);
        assert_eq!((d.count, d.full), (0, 1));
        // Entries of terminated communications make room.
        h.terminate(&other(1), now);
        assert_eq!(
            h.deliver(other(3), Arc::new(g()), Tag(0), bytes(3), false, now)
                .count,
            1
        );
    }

    #[test]
    fn leaving_and_dropping_report_lost_members() {
        let now = Instant::now();
        let mut h = Host::new(NodeId(2), 4, 10, 10);
        let a = h.add_member().unwrap();
        let b = h.add_member().unwrap();
        h.join(a, &g()).unwrap();
        h.join(b, &g()).unwrap();
        h.deliver(comm(1), Arc::new(g()), Tag(0), bytes(1), false, now);
        let (lost, emptied) = h.leave(a, &g()).unwrap();
        assert!(!emptied);
        assert_eq!(
            lost[0].members,
            vec![MemberId {
                node: NodeId(2),
                id: a
            }]
        );
        assert_eq!(h.leave(a, &g()).unwrap_err().status, Status::Mismatch);
        h.receive(b, None, None).unwrap().unwrap();
        let (lost, emptied) = h.drop_member(b);
        assert_eq!(lost.len(), 1, "received but never replied");
        assert_eq!(lost[0].status, Status::ProcDead);
        assert_eq!(emptied, vec![g()]);
        assert!(!h.hosts_group(&g()));
    }

    #[test]
    fn late_and_elided_deliveries_count_zero() {
        let now = Instant::now();
        let (mut h, _) = one_member();
        assert_eq!(
            h.deliver(comm(5), Arc::new(g()), Tag(0), bytes(1), false, now)
                .count,
            1
        );
        assert_eq!(
            h.deliver(comm(4), Arc::new(g()), Tag(0), bytes(1), false, now)
                .count,
            0,
            "older session"
        );
        assert_eq!(
            h.deliver(comm(6), Arc::new(g()), Tag(0), None, false, now)
                .count,
            0,
            "elided"
        );
        // Terminated before its delivery arrived.
        h.terminate(&comm(8), now);
        assert_eq!(
            h.deliver(comm(8), Arc::new(g()), Tag(0), bytes(1), false, now)
                .count,
            0
        );
    }

    #[test]
    fn probes_then_forgets() {
        let t0 = Instant::now();
        let s = Duration::from_secs(1);
        let (mut h, a) = one_member();
        h.deliver(comm(1), Arc::new(g()), Tag(0), bytes(1), false, t0);
        assert!(h.tick(t0, s).is_empty());
        assert_eq!(h.tick(t0 + s, s), vec![(NodeId(9), vec![comm(1)])]);
        assert!(h.tick(t0 + s, s).is_empty(), "not again at once");
        assert!(h.origin_dead(NodeId(9)).is_empty());
        assert_eq!(h.receive(a, None, None).unwrap_err().status, Status::NoComm);
        h.tick(t0 + s * 4, s);
        assert_eq!(h.comms_len(), 0);
    }

    /// The sender's node tells nothing to a node whose members all
    /// replied: such a communication is settled here without a Terminate,
    /// is never probed, and is forgotten after two idle intervals.
    #[test]
    fn fully_answered_settles_without_terminate() {
        let t0 = Instant::now();
        let s = Duration::from_secs(1);
        let (mut h, a) = one_member();
        h.deliver(comm(1), Arc::new(g()), Tag(0), bytes(1), false, t0);
        assert!(h.receive(a, None, None).unwrap().is_some());
        h.begin_reply(a, &comm(1), 77).unwrap();
        assert_eq!(h.reply_done(77, Status::Ok), Some((comm(1), a)));
        assert!(h.tick(t0 + s, s).is_empty(), "no probe for a settled one");
        assert_eq!(h.comms_len(), 1, "remembered against late duplicates");
        assert!(h.tick(t0 + s * 2, s).is_empty());
        assert_eq!(h.comms_len(), 0, "forgotten after two idle intervals");
    }
}
