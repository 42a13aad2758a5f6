//! The sans-IO core of the group layer: one node's whole protocol state as
//! pure code driven by events (operations of local handles, messages from
//! other nodes, node deaths, timer ticks) that returns actions (messages to
//! send, handles to wake, operations to complete). No sockets, clocks or
//! tasks: `now` is an argument, and the runtime (`crate::runtime`) carries
//! out the actions. Tests drive it message by message.
//!
//! Owns how the parts meet: the directory ([`directory`]) and the cached
//! table ([`cache`]), communications at the sender's node ([`origin`]),
//! members and their queues ([`host`]), transaction fan-out ([`fanout`]) and
//! retransmission ([`retry`]). Must never block or wait: every operation
//! that needs an answer from another node returns and completes later
//! through [`Action::Complete`].

pub mod cache;
pub mod directory;
pub mod fanout;
pub mod host;
pub mod origin;
pub mod retry;

#[cfg(test)]
mod sim;

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Instant;

use weft_wire::{Failure, GroupId, Incarnation, NodeId, Payload, Status, Tid};

use crate::config::GroupConfig;
use crate::ids::{CommId, IdMap, MemberId, SenderId, Tag};
use crate::msg::{Body, Change, DirAnswer, DirOp, GroupMsg, GroupRecord};
use crate::secret::GroupKey;

use cache::{Applied, Cache};
use directory::{Directory, Held, Pushes};
use fanout::{Duplicate, Fanout, Finished, Tree};
use host::{Host, LostReport, Received, NODE_MEMBER};
use origin::{Delivery, Origin, Progress, Take, Terminated};
use retry::{Outbox, RetryKey};

/// Something the runtime must do.
#[derive(Debug)]
pub enum Action {
    /// Send `msg` to `to` (this node included: local members are reached
    /// the same way). If the transport refuses it at once, report it with
    /// [`Core::on_send_failed`] and `key`.
    Send {
        /// Destination node.
        to: NodeId,
        /// The message.
        msg: GroupMsg,
        /// What it is waiting for, if anything.
        key: Option<RetryKey>,
    },
    /// A sender's communication changed (count, reply, termination).
    WakeSender(u64),
    /// A member's queue or membership changed.
    WakeMember(u64),
    /// An operation the runtime waits on (directory request, first join,
    /// reply) finished.
    Complete {
        /// The operation id the runtime passed in.
        op: u64,
        /// Its outcome.
        result: Result<DirAnswer, Failure>,
    },
}

/// What the core needs to know about the cluster, from the transport.
#[derive(Clone, Debug, Default)]
pub struct Env {
    /// The directory node, when known.
    pub directory: Option<NodeId>,
    /// Live members of the cluster other than this node.
    pub peers: Vec<NodeId>,
}

/// How a node stopped being reachable, as this node learned it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NodeLoss {
    /// This node's failure detector declared it dead (HostDead: silent;
    /// ProcDead: refused). A verdict about this node's links only: the node
    /// may be alive for every other node, so its members stay members.
    Unreachable(Status),
    /// It left the cluster in an orderly way: its members are gone.
    Left(Option<Incarnation>),
    /// It restarted: the members of the incarnation given (and older ones)
    /// are gone; the new incarnation joins again.
    Restarted(Option<Incarnation>),
}

impl NodeLoss {
    /// The status its lost members are reported with.
    fn status(self) -> Status {
        match self {
            NodeLoss::Unreachable(s) => s,
            NodeLoss::Left(_) | NodeLoss::Restarted(_) => Status::ProcDead,
        }
    }

    /// The incarnation whose members ended for real, if they did.
    fn ended(self) -> Option<Option<Incarnation>> {
        match self {
            NodeLoss::Unreachable(_) => None,
            NodeLoss::Left(i) | NodeLoss::Restarted(i) => Some(i),
        }
    }
}

#[derive(Debug)]
enum OpKind {
    /// A directory request a handle waits on.
    Dir,
    /// A first join waiting for the directory to record this node as a host.
    Join { member: u64, gid: GroupId },
    /// Requests nobody waits on (hosting ends, sync).
    Background,
    /// A sync whose snapshot refreshes the cache.
    Sync,
}

/// Ids the core allocates itself live above this bit, so they never meet
/// the runtime's operation ids.
const INTERNAL: u64 = 1 << 62;

/// One node's group protocol state.
pub struct Core {
    me: NodeId,
    incarnation: Incarnation,
    cfg: GroupConfig,
    cache: Cache,
    directory: Directory,
    pushes: Pushes,
    host: Host,
    origin: Origin,
    fanout: Fanout,
    outbox: Outbox,
    hosting: HashMap<GroupId, u64>,
    hosting_seq: u64,
    ops: IdMap<u64, OpKind>,
    next_internal: u64,
}

/// A receive's outcome.
pub type Receive = Result<Option<Received>, Failure>;

impl Core {
    /// The state of node `me` in incarnation `incarnation`.
    pub fn new(me: NodeId, incarnation: Incarnation, cfg: GroupConfig) -> Core {
        Core {
            me,
            incarnation,
            cache: Cache::default(),
            directory: Directory::new(incarnation, cfg.max_groups),
            pushes: Pushes::default(),
            host: Host::new(
                me,
                cfg.member_queue,
                cfg.max_members,
                cfg.max_groups_per_member,
            ),
            origin: Origin::new(cfg.max_open_comms, cfg.max_buffered_replies),
            fanout: Fanout::default(),
            outbox: Outbox::new(cfg.retransmit, cfg.max_retransmit),
            hosting: HashMap::new(),
            hosting_seq: directory::hosting_seq_base(incarnation),
            ops: IdMap::default(),
            next_internal: INTERNAL,
            cfg,
        }
    }

    /// This node.
    pub fn node(&self) -> NodeId {
        self.me
    }

    /// The configuration.
    pub fn config(&self) -> &GroupConfig {
        &self.cfg
    }

    fn internal_id(&mut self) -> u64 {
        self.next_internal += 1;
        self.next_internal
    }

    // ----- queries ----------------------------------------------------------

    /// The cached record of `gid`.
    pub fn record(&self, gid: &GroupId) -> Option<&GroupRecord> {
        self.cache.get(gid)
    }

    /// Every cached record.
    pub fn records(&self) -> Vec<GroupRecord> {
        self.cache.all()
    }

    /// Number of local members of `gid`.
    pub fn local_members(&self, gid: &GroupId) -> usize {
        self.host.local_members(gid)
    }

    /// The groups `member` belongs to.
    pub fn member_groups(&self, member: u64) -> Vec<GroupId> {
        self.host.member_groups(member)
    }

    /// Messages waiting for `member`.
    pub fn queue_len(&self, member: u64) -> usize {
        self.host.queue_len(member)
    }

    /// Where the send of `comm` stands.
    pub fn progress(&self, comm: &CommId) -> Progress {
        self.origin.progress(comm)
    }

    /// The delivery report of `sender`'s current communication to `gid`.
    pub fn delivery(&self, sender: u64, gid: &GroupId) -> Option<Delivery> {
        self.origin.delivery(sender, gid)
    }

    /// Messages waiting for an answer (retransmission queue).
    pub fn outstanding(&self) -> usize {
        self.outbox.len()
    }

    /// True when nothing here is timed: no message waits for an answer, no
    /// delivered communication waits to be probed or forgotten, no fan-out
    /// is remembered. [`Core::tick`] then has nothing to do until a step
    /// changes that.
    pub fn is_quiet(&self) -> bool {
        self.outbox.is_empty() && self.host.comms_len() == 0 && self.fanout.is_empty()
    }

    /// Groups held by this node's directory (empty unless it is the
    /// directory).
    pub fn directory_len(&self) -> usize {
        self.directory.len()
    }

    // ----- helpers ----------------------------------------------------------

    fn post(&mut self, out: &mut Vec<Action>, to: NodeId, msg: GroupMsg) {
        out.push(Action::Send { to, msg, key: None });
    }

    fn send_armed(
        &mut self,
        out: &mut Vec<Action>,
        key: RetryKey,
        to: NodeId,
        msg: GroupMsg,
        now: Instant,
        deadline: Instant,
    ) {
        self.outbox
            .arm(key, to, msg.retransmission(), now, deadline);
        out.push(Action::Send {
            to,
            msg,
            key: Some(key),
        });
    }

    fn dir_request(
        &mut self,
        req: u64,
        op: DirOp,
        kind: OpKind,
        env: &Env,
        now: Instant,
        out: &mut Vec<Action>,
    ) {
        let Some(dir) = env.directory else {
            self.fail_op(
                req,
                kind,
                Failure::new(Status::Unavailable, "no group directory is known yet"),
                out,
            );
            return;
        };
        self.ops.insert(req, kind);
        let deadline = now + self.cfg.directory_timeout;
        self.send_armed(
            out,
            RetryKey::Dir(req),
            dir,
            GroupMsg::DirRequest { req, op },
            now,
            deadline,
        );
    }

    fn fail_op(&mut self, req: u64, kind: OpKind, f: Failure, out: &mut Vec<Action>) {
        match kind {
            OpKind::Dir | OpKind::Join { .. } => out.push(Action::Complete {
                op: req,
                result: Err(f),
            }),
            OpKind::Background | OpKind::Sync => {
                tracing::debug!(req, "background directory request failed: {f}")
            }
        }
    }

    fn terminate_at(&mut self, t: Terminated, out: &mut Vec<Action>) {
        let comm = t.comm;
        self.outbox
            .disarm_where(|k| matches!(k, RetryKey::Deliver(c, _) if *c == comm));
        for h in t.hosts {
            self.post(out, h, GroupMsg::Terminate { comms: vec![comm] });
        }
    }

    fn after_origin(&mut self, comm: &CommId, t: Option<Terminated>, out: &mut Vec<Action>) {
        out.push(Action::WakeSender(comm.sender.id));
        if let Some(t) = t {
            self.terminate_at(t, out);
        }
    }

    fn send_lost(&mut self, reports: Vec<LostReport>, now: Instant, out: &mut Vec<Action>) {
        for r in reports {
            let id = self.internal_id();
            let to = r.comm.origin();
            let msg = GroupMsg::Lost {
                lost: id,
                comm: r.comm,
                members: r.members,
                status: r.status,
            };
            let deadline = now + self.cfg.reply_timeout;
            self.send_armed(out, RetryKey::Lost(id), to, msg, now, deadline);
        }
    }

    fn host_off(&mut self, gid: GroupId, env: &Env, now: Instant, out: &mut Vec<Action>) {
        self.hosting_seq += 1;
        self.hosting.remove(&gid);
        let req = self.internal_id();
        let op = DirOp::Host {
            gid,
            present: false,
            seq: self.hosting_seq,
            key: None,
        };
        self.dir_request(req, op, OpKind::Background, env, now, out);
    }

    fn apply_changes(&mut self, changes: Vec<Change>, now: Instant, out: &mut Vec<Action>) {
        for ch in changes {
            let gid = match &ch {
                Change::Upsert(r) => r.gid.clone(),
                Change::Remove { gid, .. } => gid.clone(),
            };
            if self.cache.apply(ch) == Applied::Removed {
                self.group_gone(&gid, now, out);
            }
        }
    }

    fn group_gone(&mut self, gid: &GroupId, now: Instant, out: &mut Vec<Action>) {
        self.hosting.remove(gid);
        let (lost, woke) = self.host.group_removed(gid);
        self.send_lost(lost, now, out);
        out.extend(woke.into_iter().map(Action::WakeMember));
    }

    fn send_finished(&mut self, f: Finished, out: &mut Vec<Action>) {
        if f.root {
            let msg = GroupMsg::Ack {
                comm: f.comm,
                counts: f.delivered.iter().map(|n| (*n, 1)).collect(),
                full: f.full,
                lost: f.lost,
            };
            self.post(out, f.comm.origin(), msg);
        } else {
            let msg = GroupMsg::TxAck {
                comm: f.comm,
                delivered: f.delivered,
                full: f.full,
                lost: f.lost,
            };
            self.post(out, f.upstream, msg);
        }
    }

    fn reply_to_member(&mut self, to: NodeId, reply: u64, status: Status, out: &mut Vec<Action>) {
        self.post(out, to, GroupMsg::ReplyAck { reply, status });
    }

    fn finish_reply(&mut self, reply: u64, status: Status, detail: &str, out: &mut Vec<Action>) {
        self.outbox.disarm(&RetryKey::Reply(reply));
        if self.host.reply_done(reply, status).is_none() {
            return;
        }
        let result = if status == Status::Ok {
            Ok(DirAnswer::Done)
        } else {
            Err(Failure::new(status, detail.to_string()))
        };
        out.push(Action::Complete { op: reply, result });
    }

    // ----- operations of local handles --------------------------------------

    /// Creates a member (a process that receives).
    ///
    /// Fails with NoBuffer when the node hosts its maximum of members.
    pub fn new_member(&mut self) -> Result<u64, Failure> {
        self.host.add_member()
    }

    /// Sends a directory request (create, destroy, lookup, list) as
    /// operation `op`; it completes with the directory's answer.
    pub fn directory_op(
        &mut self,
        op: u64,
        dir_op: DirOp,
        env: &Env,
        now: Instant,
        out: &mut Vec<Action>,
    ) {
        self.dir_request(op, dir_op, OpKind::Dir, env, now, out);
    }

    /// Introduces this node to the directory: its hosting list and cached
    /// table (a restarted directory rebuilds from these); the answer
    /// refreshes the cache.
    pub fn sync(&mut self, env: &Env, now: Instant, out: &mut Vec<Action>) {
        if env.directory.is_none_or(|d| d == self.me) {
            return;
        }
        // Groups hosted, and first joins still registering.
        let mut hosting: Vec<(GroupId, u64)> =
            self.hosting.iter().map(|(g, s)| (g.clone(), *s)).collect();
        hosting.sort();
        let op = DirOp::Sync {
            hosting,
            seq: self.hosting_seq,
            known: self.cache.all(),
        };
        let req = self.internal_id();
        self.dir_request(req, op, OpKind::Sync, env, now, out);
    }

    /// `member` joins `gid` (whose secret gave `key`, already checked
    /// against the cached verifier). Returns true when done at once (the
    /// node already hosts the group: no round trip); otherwise operation
    /// `op` completes once the directory recorded this node as a host and
    /// every node knows it.
    ///
    /// Fails with ProcDead for an unknown member, NoBuffer at a limit.
    #[allow(clippy::too_many_arguments)]
    pub fn join(
        &mut self,
        op: u64,
        member: u64,
        gid: &GroupId,
        key: GroupKey,
        env: &Env,
        now: Instant,
        out: &mut Vec<Action>,
    ) -> Result<bool, Failure> {
        if !self.host.has_member(member) || member == NODE_MEMBER {
            return Err(Failure::new(
                Status::ProcDead,
                format!("member {member} is gone"),
            ));
        }
        if self.host.is_member(member, gid) {
            return Ok(true);
        }
        let registered = self
            .cache
            .get(gid)
            .is_some_and(|r| r.hosts.contains(&self.me));
        if registered && self.host.hosts_group(gid) {
            self.host.join(member, gid)?;
            return Ok(true);
        }
        self.hosting_seq += 1;
        self.hosting.insert(gid.clone(), self.hosting_seq);
        let dir_op = DirOp::Host {
            gid: gid.clone(),
            present: true,
            seq: self.hosting_seq,
            key: Some(key),
        };
        let kind = OpKind::Join {
            member,
            gid: gid.clone(),
        };
        self.dir_request(op, dir_op, kind, env, now, out);
        Ok(false)
    }

    /// `member` leaves `gid`. Its queued messages for the group count as
    /// lost (ProcDead) at their senders; the directory hears when the node
    /// hosts no member of the group any more.
    ///
    /// Fails with Mismatch when it is not a member, ProcDead for an unknown
    /// member.
    pub fn leave(
        &mut self,
        member: u64,
        gid: &GroupId,
        env: &Env,
        now: Instant,
        out: &mut Vec<Action>,
    ) -> Result<(), Failure> {
        let (lost, emptied) = self.host.leave(member, gid)?;
        self.send_lost(lost, now, out);
        out.push(Action::WakeMember(member));
        if emptied {
            self.host_off(gid.clone(), env, now, out);
        }
        Ok(())
    }

    /// `member`'s handle was dropped without leaving: a dead process.
    pub fn drop_member(&mut self, member: u64, env: &Env, now: Instant, out: &mut Vec<Action>) {
        let (lost, emptied) = self.host.drop_member(member);
        self.send_lost(lost, now, out);
        for g in emptied {
            self.host_off(g, env, now, out);
        }
    }

    /// Starts a communication from local sender `sender` to the named group
    /// `gid`, delivered to `hosts` (from the cached table). Returns its id;
    /// the count arrives as the hosts answer ([`Core::progress`]).
    ///
    /// Fails with NoMembers when `hosts` is empty, TooLarge beyond the
    /// message limit, BadRequest when a local value cannot be encoded for
    /// remote hosts, NoBuffer when too many communications are open.
    #[allow(clippy::too_many_arguments)]
    pub fn send(
        &mut self,
        sender: u64,
        gid: &GroupId,
        tag: Tag,
        payload: Payload,
        hosts: &[NodeId],
        now: Instant,
        out: &mut Vec<Action>,
    ) -> Result<CommId, Failure> {
        if hosts.is_empty() {
            return Err(Failure::new(
                Status::NoMembers,
                format!("group {gid} has no members"),
            ));
        }
        let bodies = self.bodies(payload, hosts)?;
        let sid = self.sender_id(sender);
        let shared = Arc::new(gid.clone());
        let (comm, superseded) = self.origin.start(sid, &shared, hosts, None)?;
        if let Some(t) = superseded {
            self.terminate_at(t, out);
        }
        let deadline = now + self.cfg.count_timeout;
        for (h, body) in hosts.iter().zip(bodies) {
            let msg = GroupMsg::Deliver {
                comm,
                gid: shared.clone(),
                tag,
                body,
            };
            self.send_armed(out, RetryKey::Deliver(comm, *h), *h, msg, now, deadline);
        }
        Ok(comm)
    }

    fn sender_id(&self, sender: u64) -> SenderId {
        SenderId {
            node: self.me,
            incarnation: self.incarnation,
            id: sender,
        }
    }

    fn check_size(&self, len: usize) -> Result<(), Failure> {
        if len > self.cfg.max_message {
            return Err(Failure::new(
                Status::TooLarge,
                format!(
                    "group message of {len} bytes exceeds the limit of {}",
                    self.cfg.max_message
                ),
            ));
        }
        Ok(())
    }

    /// The body for one destination: a payload for this node moves as is;
    /// otherwise it travels as bytes.
    fn body(&self, payload: Payload, to: NodeId) -> Result<Body, Failure> {
        if to == self.me {
            if let Payload::Bytes(b) = &payload {
                self.check_size(b.len())?;
            }
            return Ok(Body::moved(payload));
        }
        let bytes = payload
            .into_bytes()
            .map_err(|e| Failure::new(Status::BadRequest, e.to_string()))?;
        self.check_size(bytes.len())?;
        Ok(Body::Payload(Payload::Bytes(bytes)))
    }

    /// One body per destination: a payload for this node alone moves as
    /// is; otherwise it is encoded once and the bytes are shared.
    fn bodies(&self, payload: Payload, to: &[NodeId]) -> Result<Vec<Body>, Failure> {
        if let Payload::Bytes(b) = &payload {
            self.check_size(b.len())?;
        }
        if to == [self.me] {
            return Ok(vec![Body::moved(payload)]);
        }
        let bytes = payload
            .into_bytes()
            .map_err(|e| Failure::new(Status::BadRequest, e.to_string()))?;
        self.check_size(bytes.len())?;
        Ok(to
            .iter()
            .map(|_| Body::Payload(Payload::Bytes(bytes.clone())))
            .collect())
    }

    /// Starts a communication from local sender `sender` to `tx:<tid>`:
    /// the message fans out along the participant tree from this node when
    /// it takes part in the transaction (`tree`), else from the
    /// coordinator. Returns its id.
    ///
    /// Fails like [`Core::send`].
    #[allow(clippy::too_many_arguments)]
    pub fn send_tx(
        &mut self,
        sender: u64,
        tid: Tid,
        tag: Tag,
        payload: Payload,
        tree: Option<&Tree>,
        now: Instant,
        out: &mut Vec<Action>,
    ) -> Result<CommId, Failure> {
        let gid = GroupId::Tx(tid);
        let root = if tree.is_some() {
            self.me
        } else {
            tid.coordinator()
        };
        let mut bodies = self.bodies(payload, &[root])?;
        let body = bodies.pop().unwrap_or(Body::Elided);
        let sid = self.sender_id(sender);
        let (comm, superseded) = self
            .origin
            .start(sid, &Arc::new(gid), &[root], Some(root))?;
        if let Some(t) = superseded {
            self.terminate_at(t, out);
        }
        let budget = self.cfg.count_timeout * 4 / 5;
        let msg = GroupMsg::TxDeliver {
            comm,
            tid,
            tag,
            body,
            root: true,
            budget_ms: budget.as_millis().min(u32::MAX as u128) as u32,
        };
        let deadline = now + self.cfg.count_timeout;
        self.send_armed(out, RetryKey::Deliver(comm, root), root, msg, now, deadline);
        Ok(comm)
    }

    /// T-Shoshin's totreply for `sender`'s communication with `gid`.
    ///
    /// Fails with NoComm when there is none (see
    /// [`Origin::set_replies`]).
    pub fn set_replies(
        &mut self,
        sender: u64,
        gid: &GroupId,
        n: u32,
        out: &mut Vec<Action>,
    ) -> Result<u32, Failure> {
        let (total, t) = self.origin.set_replies(sender, gid, n)?;
        if let Some(t) = t {
            self.terminate_at(t, out);
        }
        Ok(total)
    }

    /// The next reply of `sender`'s communication with `gid`, if any.
    pub fn take_reply(&mut self, sender: u64, gid: &GroupId) -> Take {
        self.origin.take(sender, gid)
    }

    /// A sender handle went away: its communications terminate.
    pub fn drop_sender(&mut self, sender: u64, out: &mut Vec<Action>) {
        for t in self.origin.drop_sender(sender) {
            self.terminate_at(t, out);
        }
    }

    /// T-Shoshin's nrec / nrecany: the first message for `member` from
    /// `gid` (any of its groups when `None`) with `tag` (any when `None`).
    ///
    /// Fails with NoSuchGroup for an unknown group, Mismatch when the member
    /// does not belong to `gid` (or to any group), NoComm when the message
    /// found belongs to a terminated communication (it is consumed).
    pub fn receive(&mut self, member: u64, gid: Option<&GroupId>, tag: Option<Tag>) -> Receive {
        if member != NODE_MEMBER {
            match gid {
                Some(g @ GroupId::Named { .. }) if !self.host.is_member(member, g) => {
                    if self.cache.get(g).is_none() {
                        return Err(Failure::new(Status::NoSuchGroup, format!("no group {g}")));
                    }
                    return Err(Failure::new(
                        Status::Mismatch,
                        format!("m{member}@{} is not a member of {g}", self.me),
                    ));
                }
                Some(GroupId::Tx(_)) => {
                    return Err(Failure::new(
                        Status::Mismatch,
                        "transaction groups are received through the node's transaction inbox",
                    ))
                }
                None if self.host.member_groups(member).is_empty()
                    && self.host.queue_len(member) == 0 =>
                {
                    return Err(Failure::new(
                        Status::Mismatch,
                        format!("m{member}@{} is a member of no group", self.me),
                    ))
                }
                _ => {}
            }
        }
        self.host.receive(member, gid, tag)
    }

    /// `member` replies to `comm` as operation `op`, which completes when
    /// the sender's node buffered the reply (or refused it).
    ///
    /// Fails at once with NoComm when the communication is known to be
    /// over, Mismatch when the member did not receive it or already replied,
    /// TooLarge beyond the message limit.
    #[allow(clippy::too_many_arguments)]
    pub fn reply(
        &mut self,
        op: u64,
        member: u64,
        comm: &CommId,
        payload: Payload,
        now: Instant,
        out: &mut Vec<Action>,
    ) -> Result<(), Failure> {
        let origin = comm.origin();
        let body = self.body(payload, origin)?;
        self.host.begin_reply(member, comm, op)?;
        let msg = GroupMsg::Reply {
            reply: op,
            comm: *comm,
            member: MemberId {
                node: self.me,
                id: member,
            },
            body,
        };
        let deadline = now + self.cfg.reply_timeout;
        self.send_armed(out, RetryKey::Reply(op), origin, msg, now, deadline);
        Ok(())
    }

    // ----- events -------------------------------------------------------

    /// A message from node `from`. `tree` is this node's place in the
    /// transaction of a `TxDeliver` (`None` when it does not take part).
    #[allow(clippy::too_many_arguments)]
    pub fn on_message(
        &mut self,
        from: NodeId,
        msg: GroupMsg,
        tree: Option<&Tree>,
        env: &Env,
        now: Instant,
        out: &mut Vec<Action>,
    ) {
        match msg {
            GroupMsg::DirRequest { req, op } => self.on_dir_request(from, req, op, env, now, out),
            GroupMsg::DirReply { req, result } => {
                self.on_dir_reply(from, req, result, env, now, out)
            }
            GroupMsg::Push { push, changes } => {
                self.apply_changes(changes, now, out);
                self.post(out, from, GroupMsg::PushAck { push });
            }
            GroupMsg::PushAck { push } => {
                self.outbox.disarm(&RetryKey::Push(push, from));
                if let Some(h) = self.pushes.ack(push, from) {
                    self.answer(h, out);
                }
            }
            GroupMsg::Deliver {
                comm,
                gid,
                tag,
                body,
            } => {
                let d = self
                    .host
                    .deliver(comm, gid, tag, body.into_payload(), false, now);
                // The count is deferrable: it leaves once the members woken
                // here had their turn, in one message with the replies they
                // made at once (see `GroupMsg::deferrable`).
                let ack = GroupMsg::Ack {
                    comm,
                    counts: vec![(self.me, d.count)],
                    full: d.full,
                    lost: Vec::new(),
                };
                self.post(out, comm.origin(), ack);
                out.extend(d.woke.iter().map(|m| Action::WakeMember(*m)));
            }
            GroupMsg::Ack {
                comm,
                counts,
                full,
                lost,
            } => {
                self.outbox.disarm(&RetryKey::Deliver(comm, from));
                let t = self.origin.on_ack(&comm, from, &counts, full, &lost);
                self.after_origin(&comm, t, out);
            }
            GroupMsg::Terminate { comms } => {
                for c in comms {
                    self.host.terminate(&c, now);
                }
            }
            GroupMsg::Reply {
                reply,
                comm,
                member,
                body,
            } => {
                let status = match body.into_payload() {
                    // A node answers only for its own members.
                    _ if member.node != from => Status::Mismatch,
                    Some(p) => {
                        let (status, t) = self.origin.on_reply(&comm, member, p);
                        if status == Status::Ok || t.is_some() {
                            self.after_origin(&comm, t, out);
                        }
                        status
                    }
                    // A repeated copy whose value an earlier copy took.
                    None => self.origin.reply_status(&comm, member),
                };
                self.reply_to_member(from, reply, status, out);
            }
            GroupMsg::ReplyAck { reply, status } => {
                let detail = match status {
                    Status::NoComm => "the communication terminated or was superseded",
                    Status::NoBuffer => "the sender's reply buffer is full",
                    _ => "the sender's node refused the reply",
                };
                self.finish_reply(reply, status, detail, out);
            }
            GroupMsg::Lost {
                lost,
                comm,
                members,
                status,
            } => {
                let members: Vec<MemberId> =
                    members.into_iter().filter(|m| m.node == from).collect();
                let t = self.origin.on_lost(&comm, from, &members, status);
                self.after_origin(&comm, t, out);
                self.post(out, from, GroupMsg::LostAck { lost });
            }
            GroupMsg::LostAck { lost } => {
                self.outbox.disarm(&RetryKey::Lost(lost));
            }
            GroupMsg::Probe { comms } => {
                let dead = comms
                    .into_iter()
                    .filter(|c| !self.origin.alive(c))
                    .collect();
                self.post(out, from, GroupMsg::ProbeAck { dead });
            }
            GroupMsg::ProbeAck { dead } => {
                for c in dead {
                    self.host.terminate(&c, now);
                }
            }
            GroupMsg::TxDeliver {
                comm,
                tid,
                tag,
                body,
                root,
                budget_ms,
            } => self.on_tx_deliver(from, comm, tid, tag, body, root, budget_ms, tree, now, out),
            GroupMsg::Resync => self.sync(env, now, out),
            GroupMsg::Batch(msgs) => {
                for m in msgs {
                    self.on_message(from, m, tree, env, now, out);
                }
            }
            GroupMsg::TxAck {
                comm,
                delivered,
                full,
                lost,
            } => {
                self.outbox.disarm(&RetryKey::TxDeliver(comm, from));
                if let Some(f) = self.fanout.ack(&comm, from, &delivered, full, &lost) {
                    self.send_finished(f, out);
                }
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn on_tx_deliver(
        &mut self,
        from: NodeId,
        comm: CommId,
        tid: Tid,
        tag: Tag,
        body: Body,
        root: bool,
        budget_ms: u32,
        tree: Option<&Tree>,
        now: Instant,
        out: &mut Vec<Action>,
    ) {
        match self.fanout.classify(&comm, from) {
            Duplicate::New => {}
            Duplicate::Ignore => return,
            Duplicate::Repeat(f) => {
                self.send_finished(f, out);
                return;
            }
            Duplicate::Empty => {
                let msg = GroupMsg::TxAck {
                    comm,
                    delivered: Vec::new(),
                    full: 0,
                    lost: Vec::new(),
                };
                self.post(out, from, msg);
                return;
            }
        }
        let gid = GroupId::Tx(tid);
        let neighbours: BTreeSet<NodeId> = tree
            .map(|t| t.neighbours(self.me, from))
            .unwrap_or_default();
        let payload = body.into_payload();
        let (local, forward) = match payload {
            Some(p) if !neighbours.is_empty() => match p.into_bytes() {
                Ok(b) => (
                    Some(Payload::Bytes(b.clone())),
                    Body::Payload(Payload::Bytes(b)),
                ),
                Err(e) => {
                    tracing::warn!(%comm, "transaction multicast body cannot be encoded: {e}");
                    (None, Body::Elided)
                }
            },
            p => (p, Body::Elided),
        };
        let d = self
            .host
            .deliver(comm, Arc::new(gid), tag, local, tree.is_some(), now);
        out.extend(d.woke.iter().map(|m| Action::WakeMember(*m)));
        let budget = budget_ms * 4 / 5;
        let deadline = now + std::time::Duration::from_millis(u64::from(budget.max(1)));
        for n in &neighbours {
            let msg = GroupMsg::TxDeliver {
                comm,
                tid,
                tag,
                body: forward.clone(),
                root: false,
                budget_ms: budget,
            };
            self.send_armed(out, RetryKey::TxDeliver(comm, *n), *n, msg, now, deadline);
        }
        let me = self.me;
        if let Some(f) = self.fanout.begin(
            me,
            comm,
            from,
            root,
            d.count > 0,
            d.full > 0,
            neighbours,
            now,
        ) {
            self.send_finished(f, out);
        }
    }

    fn answer(&mut self, h: Held, out: &mut Vec<Action>) {
        if !matches!(
            h.result,
            Ok(DirAnswer::Snapshot { .. }) | Ok(DirAnswer::List(_))
        ) {
            self.pushes.remember(h.to, h.req, &h.result);
        }
        let msg = GroupMsg::DirReply {
            req: h.req,
            result: h.result,
        };
        self.post(out, h.to, msg);
    }

    fn on_dir_request(
        &mut self,
        from: NodeId,
        req: u64,
        op: DirOp,
        env: &Env,
        now: Instant,
        out: &mut Vec<Action>,
    ) {
        if env.directory != Some(self.me) {
            let result = Err(Failure::new(
                Status::Unavailable,
                format!("node {} is not the group directory", self.me),
            ));
            self.post(out, from, GroupMsg::DirReply { req, result });
            return;
        }
        if self.pushes.is_answering(from, req) {
            return; // a retransmission: the answer follows the push
        }
        if let Some(result) = self.pushes.answered(from, req).cloned() {
            // A retransmission whose answer was lost: the same answer again.
            self.post(out, from, GroupMsg::DirReply { req, result });
            return;
        }
        let me = self.me;
        let outcome = self.directory.handle(from, op);
        let held = Held {
            to: from,
            req,
            result: outcome.result,
        };
        if outcome.changes.is_empty() {
            self.answer(held, out);
            return;
        }
        self.apply_changes(outcome.changes.clone(), now, out);
        let peers: BTreeSet<NodeId> = env.peers.iter().copied().filter(|p| *p != me).collect();
        let (held, answer_now) = if outcome.wait {
            (Some(held), None)
        } else {
            (None, Some(held))
        };
        let (push, ready) = self.pushes.start(peers.clone(), held);
        let deadline = now + self.cfg.push_timeout;
        for p in peers {
            let msg = GroupMsg::Push {
                push,
                changes: outcome.changes.clone(),
            };
            self.send_armed(out, RetryKey::Push(push, p), p, msg, now, deadline);
        }
        for h in answer_now.into_iter().chain(ready) {
            self.answer(h, out);
        }
    }

    fn on_dir_reply(
        &mut self,
        from: NodeId,
        req: u64,
        result: Result<DirAnswer, Failure>,
        env: &Env,
        now: Instant,
        out: &mut Vec<Action>,
    ) {
        let key = RetryKey::Dir(req);
        if let Err(f) = &result {
            if f.status == Status::Unavailable {
                if let Some(dir) = env.directory.filter(|d| *d != from) {
                    // The directory moved: ask the new one.
                    self.outbox.retarget(&key, dir);
                    if let Some(msg) = self.outbox.copy(&key) {
                        out.push(Action::Send {
                            to: dir,
                            msg,
                            key: Some(key),
                        });
                        return;
                    }
                }
            }
        }
        if !self.outbox.disarm(&key) {
            return; // a repeated answer
        }
        let Some(kind) = self.ops.remove(&req) else {
            return;
        };
        match kind {
            OpKind::Dir => {
                if let Ok(DirAnswer::Record(r)) = &result {
                    self.apply_changes(vec![Change::Upsert(r.clone())], now, out);
                }
                out.push(Action::Complete { op: req, result });
            }
            OpKind::Join { member, gid } => {
                let result = result.and_then(|_| {
                    self.host.join(member, &gid)?;
                    Ok(DirAnswer::Done)
                });
                if result.is_err() && !self.host.hosts_group(&gid) {
                    self.hosting.remove(&gid);
                }
                out.push(Action::WakeMember(member));
                out.push(Action::Complete { op: req, result });
            }
            OpKind::Background => {}
            OpKind::Sync => {
                if let Ok(DirAnswer::Snapshot { records, at }) = result {
                    for gid in self.cache.apply_snapshot(records, at) {
                        self.group_gone(&gid, now, out);
                    }
                }
            }
        }
    }

    /// This node lost `node` (`loss`): communications count its members as
    /// lost at their senders (T-Shoshin's HostDead/ProcDead, reported to the
    /// sender for the members it cannot reach), members here stop waiting
    /// on its senders, fan-outs stop waiting for it, pushes stop waiting
    /// for its acknowledgement.
    ///
    /// Group membership changes only when the node's members ended for
    /// real (an orderly leave or a restart): then the directory drops them
    /// and pushes that to every node. A failure detector's verdict
    /// ([`NodeLoss::Unreachable`]) is about this node's links alone and
    /// never removes members: the directory losing its link to a node does
    /// not make the node's members vanish for the nodes that still reach it
    /// (docs/membership.md).
    pub fn on_node_dead(
        &mut self,
        node: NodeId,
        loss: NodeLoss,
        env: &Env,
        now: Instant,
        out: &mut Vec<Action>,
    ) {
        if node == self.me {
            return;
        }
        let status = loss.status();
        for key in self.outbox.take_to(node) {
            self.give_up(key, node, status, env, now, out);
        }
        let (touched, ended) = self.origin.node_dead(node, status);
        out.extend(touched.iter().map(|c| Action::WakeSender(c.sender.id)));
        for t in ended {
            self.terminate_at(t, out);
        }
        for r in self.host.origin_dead(node) {
            self.finish_reply(r, Status::NoComm, "the sender's node died", out);
        }
        for f in self.fanout.node_dead(node, status) {
            self.send_finished(f, out);
        }
        if env.directory != Some(self.me) {
            return;
        }
        for h in self.pushes.node_gone(node) {
            self.answer(h, out);
        }
        let Some(incarnation) = loss.ended() else {
            return;
        };
        let changes = self.directory.node_gone(node, incarnation);
        if changes.is_empty() {
            return;
        }
        self.apply_changes(changes.clone(), now, out);
        let peers: BTreeSet<NodeId> = env
            .peers
            .iter()
            .copied()
            .filter(|p| *p != node && *p != self.me)
            .collect();
        let (push, _) = self.pushes.start(peers.clone(), None);
        let deadline = now + self.cfg.push_timeout;
        for p in peers {
            let msg = GroupMsg::Push {
                push,
                changes: changes.clone(),
            };
            self.send_armed(out, RetryKey::Push(push, p), p, msg, now, deadline);
        }
    }

    /// This node hears from `node` again after declaring it dead. Pushes
    /// sent while the link was down are lost, so the cached table is
    /// brought up to date: when `node` is the directory this node
    /// introduces itself again (its answer is a snapshot); when this node
    /// is the directory it asks `node` to do so.
    pub fn on_node_back(&mut self, node: NodeId, env: &Env, now: Instant, out: &mut Vec<Action>) {
        if node == self.me {
            return;
        }
        if env.directory == Some(node) {
            self.sync(env, now, out);
        } else if env.directory == Some(self.me) {
            self.post(out, node, GroupMsg::Resync);
        }
    }

    /// The transport refused to send the message waiting for `key` to `to`
    /// (unknown node: AddrError; dead: HostDead/ProcDead; queue full:
    /// NoBuffer).
    pub fn on_send_failed(
        &mut self,
        key: RetryKey,
        to: NodeId,
        status: Status,
        env: &Env,
        now: Instant,
        out: &mut Vec<Action>,
    ) {
        if self.outbox.disarm(&key) {
            self.give_up(key, to, status, env, now, out);
        }
    }

    fn give_up(
        &mut self,
        key: RetryKey,
        to: NodeId,
        status: Status,
        _env: &Env,
        _now: Instant,
        out: &mut Vec<Action>,
    ) {
        match key {
            RetryKey::Dir(req) => {
                if let Some(kind) = self.ops.remove(&req) {
                    let f = Failure::new(
                        status,
                        format!("the group directory (node {to}) did not answer: {status}"),
                    );
                    if let OpKind::Join { gid, .. } = &kind {
                        if !self.host.hosts_group(gid) {
                            self.hosting.remove(gid);
                        }
                    }
                    self.fail_op(req, kind, f, out);
                }
            }
            RetryKey::Push(push, node) => {
                if let Some(h) = self.pushes.ack(push, node) {
                    self.answer(h, out);
                }
            }
            RetryKey::Deliver(comm, node) => {
                let t = self.origin.host_lost(&comm, node, status);
                self.after_origin(&comm, t, out);
            }
            RetryKey::Reply(reply) => {
                let (status, detail) = match status {
                    Status::HostDead | Status::ProcDead | Status::ShuttingDown => {
                        (Status::NoComm, "the sender's node is gone")
                    }
                    Status::TimedOut => (Status::TimedOut, "the sender's node did not answer"),
                    _ => (status, "the reply could not be sent"),
                };
                self.finish_reply(reply, status, detail, out);
            }
            RetryKey::Lost(_) => {}
            RetryKey::TxDeliver(comm, node) => {
                if let Some(f) = self.fanout.neighbour_lost(&comm, node, status) {
                    self.send_finished(f, out);
                }
            }
        }
    }

    /// Timer: retransmits what waits for an answer, gives up past
    /// deadlines, probes the senders of long-lived communications and
    /// forgets old state.
    pub fn tick(&mut self, env: &Env, now: Instant, out: &mut Vec<Action>) {
        let due = self.outbox.due(now);
        for (key, mut to, msg) in due.resend {
            if let (RetryKey::Dir(_), Some(dir)) = (key, env.directory) {
                if dir != to {
                    self.outbox.retarget(&key, dir);
                    to = dir;
                }
            }
            out.push(Action::Send {
                to,
                msg,
                key: Some(key),
            });
        }
        for (key, to) in due.expired {
            self.give_up(key, to, Status::TimedOut, env, now, out);
        }
        for (origin, comms) in self.host.tick(now, self.cfg.probe_after) {
            self.post(out, origin, GroupMsg::Probe { comms });
        }
        self.fanout.tick(now, self.cfg.fanout_memory);
    }
}
