//! The thin async shell around the core: one [`Groups`] runtime per node,
//! and the handles programs use — [`Member`] (a receiving process),
//! [`GroupSender`] (a sending process), [`Incoming`] (a message a member
//! took, which it may reply to) and [`TxInbox`] (the node's messages to
//! its transactions' groups).
//!
//! Owns the glue: group messages in and out through the endpoint's
//! [`Port::GROUP`], membership events from the failure detector, a timer for
//! the core's retransmissions and probes, and waking the handles. Must never
//! hold the core's lock while sending or waking (the in-process channel may
//! run the receiving side synchronously), and never decide anything the core
//! decides.

use std::pin::pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, oneshot, Notify};
use tracing::Instrument;
use weft_transport::{Endpoint, MembershipEvent, PeerRef, PortHandler};
use weft_tx::TxManager;
use weft_wire::{Failure, GroupId, Incarnation, NodeId, Payload, PeerRole, Port, Status, Tid};

use crate::config::GroupConfig;
use crate::core::fanout::Tree;
use crate::core::host::NODE_MEMBER;
use crate::core::origin::{Delivery, Progress, ReplyItem, Take};
use crate::core::retry::RetryKey;
use crate::core::{Action, Core, Env, NodeLoss};
use crate::ids::{CommId, IdMap, MemberId, SenderId, Tag};
use crate::msg::{DirAnswer, DirOp, GroupMsg, GroupRecord};
use crate::secret::{GroupKey, Verifier};

/// A group as `weft group ls` shows it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GroupInfo {
    /// The group.
    pub gid: GroupId,
    /// Nodes hosting members.
    pub hosts: Vec<NodeId>,
    /// Members at the node that answered.
    pub local_members: usize,
}

/// A member's reply, as the sender takes it.
#[derive(Debug)]
pub struct Reply {
    /// The member that replied.
    pub from: MemberId,
    /// The reply.
    pub payload: Payload,
}

impl Reply {
    /// The reply as a `T`.
    ///
    /// Fails with Mismatch when it is not a `T`.
    pub fn decode<T: DeserializeOwned + Send + 'static>(self) -> Result<T, Failure> {
        self.payload
            .decode()
            .map_err(|e| Failure::new(Status::Mismatch, format!("reply from {}: {e}", self.from)))
    }
}

/// Proof of a group's secret: the secret itself (checked at this node, never
/// sent), or the key derived from it (what a remote client sends instead).
#[derive(Clone)]
pub(crate) enum Credential {
    Secret(Vec<u8>),
    Key(GroupKey),
}

impl Credential {
    fn key(&self, v: &Verifier) -> GroupKey {
        match self {
            Credential::Secret(s) => v.key_for(s),
            Credential::Key(k) => *k,
        }
    }
}

/// Shared state of a node's group runtime.
pub(crate) struct Shared {
    endpoint: Endpoint,
    tm: Option<TxManager>,
    cfg: GroupConfig,
    core: Mutex<Core>,
    ops: Mutex<IdMap<u64, oneshot::Sender<Result<DirAnswer, Failure>>>>,
    next_op: AtomicU64,
    next_sender: AtomicU64,
    senders: Mutex<IdMap<u64, Arc<Notify>>>,
    members: Mutex<IdMap<u64, Arc<Notify>>>,
    synced: Mutex<Option<(Option<NodeId>, Option<Incarnation>)>>,
    /// Deferrable messages waiting to be sent together.
    deferred: Mutex<Outgoing>,
    /// The timer sleeps while the core has nothing timed (set under the core
    /// lock); a step that gives it work clears this and wakes it.
    timer_asleep: AtomicBool,
    timer_work: Arc<Notify>,
}

/// What a core step needs to know about the cluster ([`Env`]).
#[derive(Clone, Copy)]
enum Need {
    /// Nothing: the step never looks (an empty [`Env`]).
    Nothing,
    /// The directory node.
    Directory,
    /// The directory and the live nodes.
    Cluster,
}

/// A message waiting to travel with others, and what it waits for.
type Deferred = (GroupMsg, Option<RetryKey>);

/// Deferrable messages and the task that sends them.
#[derive(Default)]
struct Outgoing {
    /// By destination.
    batches: IdMap<NodeId, Vec<Deferred>>,
    /// A task to send them is spawned and has not started.
    spawned: bool,
    /// Handlers that asked the task to wait for them (see
    /// [`Shared::on_group_message`]).
    holds: u32,
}

impl Outgoing {
    /// Whether to spawn the sending task now (and note that it is).
    fn spawn_now(&mut self) -> bool {
        let now = !self.spawned && self.holds == 0 && !self.batches.is_empty();
        self.spawned |= now;
        now
    }
}

impl Shared {
    fn env(&self, full: bool) -> Env {
        if !full {
            return Env {
                directory: self.endpoint.directory(),
                peers: Vec::new(),
            };
        }
        let view = self.endpoint.view();
        let me = self.endpoint.node_id();
        Env {
            directory: view.directory,
            peers: view
                .nodes
                .iter()
                .filter(|n| n.alive && n.info.id != me)
                .map(|n| n.info.id)
                .collect(),
        }
    }

    /// Runs one core step, then carries out its actions without the lock.
    fn step<R>(
        self: &Arc<Self>,
        need: Need,
        f: impl FnOnce(&mut Core, &Env, Instant, &mut Vec<Action>) -> R,
    ) -> R {
        let env = match need {
            Need::Nothing => Env::default(),
            Need::Directory => self.env(false),
            Need::Cluster => self.env(true),
        };
        let now = Instant::now();
        let mut out = Vec::with_capacity(8);
        let (r, wake_timer) = {
            let mut core = self.core.lock();
            let r = f(&mut core, &env, now, &mut out);
            // Checked under the lock the timer holds when it decides to
            // sleep, so new timed work never waits for its next look.
            let wake = self.timer_asleep.load(Ordering::Relaxed)
                && !core.is_quiet()
                && self.timer_asleep.swap(false, Ordering::Relaxed);
            (r, wake)
        };
        if wake_timer {
            self.timer_work.notify_one();
        }
        self.act(out);
        r
    }

    /// Whether the timer may sleep: nothing timed in the core. Marks it
    /// asleep, under the core lock, when so.
    fn timer_may_sleep(&self) -> bool {
        let core = self.core.lock();
        let quiet = core.is_quiet();
        if quiet {
            self.timer_asleep.store(true, Ordering::Relaxed);
        }
        quiet
    }

    fn act(self: &Arc<Self>, out: Vec<Action>) {
        let mut deferred = Vec::new();
        let mut woken = Vec::new();
        for a in out {
            match a {
                Action::Send { to, msg, key } if msg.deferrable() => {
                    deferred.push((to, msg, key));
                }
                Action::Send { to, msg, key } => {
                    tracing::trace!(to = %to, kind = msg.kind(), "group message out");
                    if let Err(f) = self.endpoint.send(to, Port::GROUP, Payload::local(msg)) {
                        tracing::debug!(to = %to, %f, "group message not sent");
                        if let Some(key) = key {
                            self.step(Need::Directory, move |core, env, now, out| {
                                core.on_send_failed(key, to, f.status, env, now, out)
                            });
                        }
                    }
                }
                Action::WakeSender(id) => {
                    if let Some(n) = self.senders.lock().get(&id) {
                        n.notify_waiters();
                    }
                }
                Action::WakeMember(id) => woken.push(id),
                Action::Complete { op, result } => {
                    if let Some(tx) = self.ops.lock().remove(&op) {
                        let _ = tx.send(result);
                    }
                }
            }
        }
        // Members wake after this step's messages to other nodes left, and
        // before the task that sends the deferred ones is spawned, so that
        // it runs after them and takes their replies along.
        if !woken.is_empty() {
            let members = self.members.lock();
            for id in woken {
                if let Some(n) = members.get(&id) {
                    n.notify_waiters();
                }
            }
        }
        if !deferred.is_empty() {
            self.defer(deferred);
        }
    }

    /// A group message from node `from` (this node included). The delivery
    /// counts of a batch are taken first, and its other messages (replies)
    /// once the tasks the counts woke had their turn: a sender blocked on
    /// its count does not wait for the replies that travelled with it, and
    /// the answers to those replies wait for them.
    fn on_group_message(self: &Arc<Self>, from: NodeId, msg: GroupMsg) {
        let msg = match msg {
            GroupMsg::Batch(msgs)
                if msgs.iter().any(GroupMsg::is_count) && !msgs.iter().all(GroupMsg::is_count) =>
            {
                let (counts, rest): (Vec<GroupMsg>, Vec<GroupMsg>) =
                    msgs.into_iter().partition(GroupMsg::is_count);
                self.deferred.lock().holds += 1;
                self.handle_message(from, GroupMsg::Batch(counts));
                let rest = GroupMsg::Batch(rest);
                match tokio::runtime::Handle::try_current() {
                    Ok(rt) => {
                        let me = Arc::clone(self);
                        rt.spawn(async move {
                            me.handle_message(from, rest);
                            me.release_flush();
                        });
                    }
                    Err(_) => {
                        self.handle_message(from, rest);
                        self.release_flush();
                    }
                }
                return;
            }
            msg => msg,
        };
        self.handle_message(from, msg);
    }

    fn handle_message(self: &Arc<Self>, from: NodeId, msg: GroupMsg) {
        let span = match &msg {
            GroupMsg::TxDeliver { tid, comm, .. } => {
                tracing::debug_span!("group.tx_fanout", gid = %GroupId::Tx(*tid), %tid, %comm, %from)
            }
            GroupMsg::Deliver { gid, comm, .. } => {
                tracing::trace_span!("group.deliver", %gid, %comm, %from)
            }
            other => tracing::trace_span!("group.message", kind = other.kind(), %from),
        };
        let _entered = span.enter();
        let tree = match &msg {
            GroupMsg::TxDeliver { tid, .. } => self.tree(*tid),
            _ => None,
        };
        let need = if msg.needs_cluster() {
            Need::Cluster
        } else if msg.needs_directory() {
            Need::Directory
        } else {
            Need::Nothing
        };
        self.step(need, move |core, env, now, out| {
            core.on_message(from, msg, tree.as_ref(), env, now, out)
        });
    }

    /// Queues messages that may travel with others; a task sends
    /// everything queued, one batch per node. It is spawned after the step
    /// woke the members it concerns, so it runs once they had their turn:
    /// a delivery count leaves with the replies its members made at once,
    /// and several members of a node answering the same send cost the
    /// network one message. The task that produced the messages (often the
    /// inbox task) does not pay for the send.
    fn defer(self: &Arc<Self>, msgs: Vec<(NodeId, GroupMsg, Option<RetryKey>)>) {
        let spawn = {
            let mut d = self.deferred.lock();
            for (to, msg, key) in msgs {
                d.batches.entry(to).or_default().push((msg, key));
            }
            d.spawn_now()
        };
        if spawn {
            self.spawn_flush();
        }
    }

    /// A handler that held the sending task is done.
    fn release_flush(self: &Arc<Self>) {
        let spawn = {
            let mut d = self.deferred.lock();
            d.holds -= 1;
            d.spawn_now()
        };
        if spawn {
            self.spawn_flush();
        }
    }

    fn spawn_flush(self: &Arc<Self>) {
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => {
                let me = Arc::clone(self);
                rt.spawn(async move { me.flush() });
            }
            // A handle dropped outside any runtime: send at once.
            Err(_) => self.flush(),
        }
    }

    fn flush(self: &Arc<Self>) {
        let batches = {
            let mut d = self.deferred.lock();
            d.spawned = false;
            std::mem::take(&mut d.batches)
        };
        for (to, mut items) in batches {
            let keys: Vec<RetryKey> = items.iter().filter_map(|(_, k)| *k).collect();
            let msg = if items.len() == 1 {
                items.pop().map(|(m, _)| m).expect("one message")
            } else {
                GroupMsg::Batch(items.into_iter().map(|(m, _)| m).collect())
            };
            if let Err(f) = self.endpoint.send(to, Port::GROUP, Payload::local(msg)) {
                tracing::debug!(to = %to, %f, "group messages not sent");
                for key in keys {
                    self.step(Need::Directory, move |core, env, now, out| {
                        core.on_send_failed(key, to, f.status, env, now, out)
                    });
                }
            }
        }
    }

    fn new_op(&self) -> (u64, oneshot::Receiver<Result<DirAnswer, Failure>>) {
        let op = self.next_op.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        self.ops.lock().insert(op, tx);
        (op, rx)
    }

    async fn wait_op(
        &self,
        op: u64,
        rx: oneshot::Receiver<Result<DirAnswer, Failure>>,
        limit: Duration,
    ) -> Result<DirAnswer, Failure> {
        match tokio::time::timeout(limit + Duration::from_secs(1), rx).await {
            Ok(Ok(r)) => r,
            Ok(Err(_)) => Err(Failure::new(Status::Internal, "operation abandoned")),
            Err(_) => {
                self.ops.lock().remove(&op);
                Err(Failure::new(Status::TimedOut, "no answer in time"))
            }
        }
    }

    /// A directory request; completes with the directory's answer.
    async fn directory(self: &Arc<Self>, dir_op: DirOp) -> Result<DirAnswer, Failure> {
        let (op, rx) = self.new_op();
        self.step(Need::Directory, move |core, env, now, out| {
            core.directory_op(op, dir_op, env, now, out)
        });
        self.wait_op(op, rx, self.cfg.directory_timeout).await
    }

    /// The record of `gid`: from the cache, else asked of the directory.
    async fn record(self: &Arc<Self>, gid: &GroupId) -> Result<GroupRecord, Failure> {
        if let Some(r) = self.core.lock().record(gid) {
            return Ok(r.clone());
        }
        match self.directory(DirOp::Lookup { gid: gid.clone() }).await? {
            DirAnswer::Record(r) => Ok(r),
            other => Err(unexpected(&other)),
        }
    }

    fn check_secret_len(&self, cred: &Credential) -> Result<(), Failure> {
        match cred {
            Credential::Secret(s) if s.len() > self.cfg.max_secret => Err(Failure::new(
                Status::BadRequest,
                format!("group secrets are at most {} bytes", self.cfg.max_secret),
            )),
            _ => Ok(()),
        }
    }

    async fn verified(
        self: &Arc<Self>,
        gid: &GroupId,
        cred: &Credential,
    ) -> Result<GroupKey, Failure> {
        named(gid)?;
        self.check_secret_len(cred)?;
        let rec = self.record(gid).await?;
        let key = cred.key(&rec.verifier);
        if !rec.verifier.verify_key(&key) {
            return Err(Failure::new(
                Status::WrongSecret,
                format!("wrong secret for group {gid}"),
            ));
        }
        Ok(key)
    }

    fn tree(&self, tid: Tid) -> Option<Tree> {
        let st = self.tm.as_ref()?.status(tid)?;
        Some(Tree {
            parent: st.parent,
            children: st.children,
        })
    }

    fn sync_if_directory_changed(self: &Arc<Self>) {
        let dir = self.endpoint.directory();
        let inc = dir.and_then(|d| self.endpoint.peer_incarnation(d));
        let changed = {
            let mut synced = self.synced.lock();
            let now = Some((dir, inc));
            let changed = *synced != now;
            *synced = now;
            changed
        };
        if changed {
            self.sync();
        }
    }

    fn sync(self: &Arc<Self>) {
        self.step(Need::Directory, |core, env, now, out| {
            core.sync(env, now, out)
        });
    }

    fn on_membership(self: &Arc<Self>, ev: MembershipEvent) {
        match ev {
            MembershipEvent::Left {
                node,
                incarnation,
                cause,
                ..
            } => {
                // A report about an incarnation the node no longer runs is
                // a restart, whatever led to it; otherwise the cause says
                // whether it left or this node's detector gave up on it.
                let now_runs = self.endpoint.peer_incarnation(node);
                let loss = match (cause, incarnation) {
                    (_, Some(old)) if now_runs.is_some_and(|n| n != old) => {
                        NodeLoss::Restarted(Some(old))
                    }
                    (Status::Ok, inc) => NodeLoss::Left(inc),
                    (Status::HostDead, _) => NodeLoss::Unreachable(Status::HostDead),
                    _ => NodeLoss::Unreachable(Status::ProcDead),
                };
                tracing::debug!(node = %self.endpoint.node_id(), peer = %node, ?loss, "group: node lost");
                self.step(Need::Cluster, move |core, env, now, out| {
                    core.on_node_dead(node, loss, env, now, out)
                });
                // The directory may have moved with it.
                self.sync_if_directory_changed();
            }
            MembershipEvent::Joined(info) => {
                if Some(info.id) == self.endpoint.directory() {
                    self.sync_if_directory_changed();
                } else {
                    self.back(info.id);
                }
            }
            MembershipEvent::Revived(node) => self.back(node),
        }
    }

    /// `node` joined or was heard from again: the core brings the cached
    /// table up to date (see [`Core::on_node_back`]).
    fn back(self: &Arc<Self>, node: NodeId) {
        self.step(Need::Directory, move |core, env, now, out| {
            core.on_node_back(node, env, now, out)
        });
    }

    fn register_sender(&self) -> (u64, Arc<Notify>) {
        let id = self.next_sender.fetch_add(1, Ordering::Relaxed);
        let n = Arc::new(Notify::new());
        self.senders.lock().insert(id, n.clone());
        (id, n)
    }
}

/// `now + wait`, or a century from now when that is not a time (a caller's
/// `Duration::MAX` means "no bound" and must not overflow the clock).
pub(crate) fn deadline_after(now: Instant, wait: Duration) -> Instant {
    const CENTURY: Duration = Duration::from_secs(100 * 365 * 24 * 3600);
    now.checked_add(wait.min(CENTURY)).unwrap_or(now)
}

fn unexpected(a: &DirAnswer) -> Failure {
    Failure::new(
        Status::ProtocolError,
        format!("unexpected directory answer {a:?}"),
    )
}

fn named(gid: &GroupId) -> Result<(), Failure> {
    match gid {
        GroupId::Named { .. } => Ok(()),
        GroupId::Tx(_) => Err(Failure::new(
            Status::BadRequest,
            "tx:<tid> groups need no set-up: their members are the transaction's participants",
        )),
    }
}

struct Handler(Weak<Shared>);

impl PortHandler for Handler {
    fn on_message(&self, from: PeerRef, payload: Payload) {
        let Some(shared) = self.0.upgrade() else {
            return;
        };
        if from.role != PeerRole::Node {
            tracing::debug!(peer = %from.node, "group message from a client ignored");
            return;
        }
        let msg = match payload.decode::<GroupMsg>() {
            Ok(m) => m,
            Err(e) => {
                tracing::warn!(peer = %from.node, "undecodable group message: {e}");
                return;
            }
        };
        shared.on_group_message(from.node, msg);
    }
}

impl std::fmt::Debug for Groups {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Groups")
            .field("node", &self.node())
            .finish()
    }
}

/// One node's group runtime: the group directory (when the node is the
/// naming directory), the cached group table, the node's members and the
/// communications of its senders. Cheap to clone.
#[derive(Clone)]
pub struct Groups {
    shared: Arc<Shared>,
}

impl Groups {
    /// Starts the group runtime on `endpoint` (installing the handler of
    /// [`Port::GROUP`] and a membership listener). `tm` resolves `tx:<tid>`
    /// groups from the transaction's participant tree; without it this node
    /// takes part in no transaction group. Must be called inside a tokio
    /// runtime.
    ///
    /// Fails with BadRequest for an invalid configuration.
    pub fn start(
        endpoint: Endpoint,
        tm: Option<TxManager>,
        cfg: GroupConfig,
    ) -> Result<Groups, Failure> {
        cfg.validate()
            .map_err(|e| Failure::new(Status::BadRequest, format!("group configuration: {e}")))?;
        let core = Core::new(endpoint.node_id(), endpoint.incarnation(), cfg.clone());
        let shared = Arc::new(Shared {
            endpoint: endpoint.clone(),
            tm,
            core: Mutex::new(core),
            ops: Mutex::new(IdMap::default()),
            next_op: AtomicU64::new(1),
            next_sender: AtomicU64::new(1),
            senders: Mutex::new(IdMap::default()),
            members: Mutex::new(IdMap::default()),
            synced: Mutex::new(None),
            deferred: Mutex::new(Outgoing::default()),
            timer_asleep: AtomicBool::new(false),
            timer_work: Arc::new(Notify::new()),
            cfg,
        });
        shared
            .members
            .lock()
            .insert(NODE_MEMBER, Arc::new(Notify::new()));
        endpoint.set_port_handler(Port::GROUP, Arc::new(Handler(Arc::downgrade(&shared))));
        let (events_tx, mut events_rx) = mpsc::unbounded_channel::<MembershipEvent>();
        endpoint.on_membership(move |ev| {
            let _ = events_tx.send(ev.clone());
        });
        let weak = Arc::downgrade(&shared);
        tokio::spawn(async move {
            while let Some(ev) = events_rx.recv().await {
                let Some(s) = weak.upgrade() else { return };
                s.on_membership(ev);
            }
        });
        let weak = Arc::downgrade(&shared);
        let (tick, quiet_check) = (shared.cfg.tick, shared.cfg.quiet_check);
        let work = Arc::clone(&shared.timer_work);
        // Ticks while something waits for a retransmission, a deadline or
        // to be forgotten; otherwise sleeps, so an idle node costs no
        // wake-ups here.
        tokio::spawn(async move {
            let mut ticker = tokio::time::interval(tick);
            ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                ticker.tick().await;
                let quiet = {
                    let Some(s) = weak.upgrade() else { return };
                    if s.endpoint.is_crashed() {
                        return;
                    }
                    s.step(Need::Directory, |core, env, now, out| {
                        core.tick(env, now, out)
                    });
                    s.sync_if_directory_changed();
                    s.timer_may_sleep()
                };
                if quiet {
                    // No strong reference is held while asleep.
                    let _ = tokio::time::timeout(quiet_check, work.notified()).await;
                    if let Some(s) = weak.upgrade() {
                        s.timer_asleep.store(false, Ordering::Relaxed);
                    }
                    ticker.reset();
                }
            }
        });
        Ok(Groups { shared })
    }

    /// This node.
    pub fn node(&self) -> NodeId {
        self.shared.endpoint.node_id()
    }

    /// The configuration.
    pub fn config(&self) -> &GroupConfig {
        &self.shared.cfg
    }

    /// Creates group `gid` (`class:name`) with `secret` (which may be
    /// empty). Returns once every live node knows the group.
    ///
    /// Fails with Refused when it exists, BadRequest for a `tx:` group or a
    /// secret too long, NoBuffer when the directory is full,
    /// HostDead/ProcDead/TimedOut/Unavailable when the directory cannot be
    /// reached.
    pub async fn create(&self, gid: &GroupId, secret: &str) -> Result<(), Failure> {
        self.shared
            .check_secret_len(&Credential::Secret(secret.as_bytes().to_vec()))?;
        self.create_verified(gid, Verifier::new(secret.as_bytes()))
            .instrument(tracing::debug_span!("group.create", %gid))
            .await
    }

    pub(crate) async fn create_verified(
        &self,
        gid: &GroupId,
        verifier: Verifier,
    ) -> Result<(), Failure> {
        named(gid)?;
        let op = DirOp::Create {
            gid: gid.clone(),
            verifier,
        };
        self.shared.directory(op).await.map(|_| ())
    }

    /// Creates a group with a fresh name in `class` (T-Shoshin's
    /// `create_grp`: the directory allocates the id). Returns the new id.
    ///
    /// Fails like [`Groups::create`].
    pub async fn create_in(&self, class: &str, secret: &str) -> Result<GroupId, Failure> {
        self.shared
            .check_secret_len(&Credential::Secret(secret.as_bytes().to_vec()))?;
        let op = DirOp::CreateUnique {
            class: class.to_string(),
            verifier: Verifier::new(secret.as_bytes()),
        };
        match self.shared.directory(op).await? {
            DirAnswer::Allocated(g) => Ok(g),
            other => Err(unexpected(&other)),
        }
    }

    /// Destroys `gid`: every member is removed (their queued messages count
    /// as lost, NoSuchGroup). Returns once every live node dropped it.
    ///
    /// Fails with NoSuchGroup, WrongSecret (checked at this node first, then
    /// by the directory), or the directory's unreachability status.
    pub async fn destroy(&self, gid: &GroupId, secret: &str) -> Result<(), Failure> {
        self.destroy_with(gid, Credential::Secret(secret.as_bytes().to_vec()))
            .instrument(tracing::debug_span!("group.destroy", %gid))
            .await
    }

    pub(crate) async fn destroy_with(
        &self,
        gid: &GroupId,
        cred: Credential,
    ) -> Result<(), Failure> {
        let key = self.shared.verified(gid, &cred).await?;
        let op = DirOp::Destroy {
            gid: gid.clone(),
            key,
        };
        self.shared.directory(op).await.map(|_| ())
    }

    /// A new process that belongs to no group yet.
    ///
    /// Fails with NoBuffer when the node hosts its maximum of members.
    pub fn member(&self) -> Result<Member, Failure> {
        let id = self.shared.core.lock().new_member()?;
        let notify = Arc::new(Notify::new());
        self.shared.members.lock().insert(id, notify.clone());
        Ok(Member {
            shared: self.shared.clone(),
            id,
            notify,
        })
    }

    /// A new process that joins `gid` at once: [`Groups::member`] then
    /// [`Member::join`].
    ///
    /// Fails like [`Member::join`].
    pub async fn join(&self, gid: &GroupId, secret: &str) -> Result<Member, Failure> {
        let m = self.member()?;
        m.join(gid, secret).await?;
        Ok(m)
    }

    /// A new sending process.
    pub fn sender(&self) -> GroupSender {
        let (id, notify) = self.shared.register_sender();
        GroupSender {
            shared: self.shared.clone(),
            id,
            notify,
        }
    }

    /// This node's inbox of messages to the `tx:<tid>` groups of the
    /// transactions it takes part in.
    pub fn tx_inbox(&self) -> TxInbox {
        let notify = self
            .shared
            .members
            .lock()
            .get(&NODE_MEMBER)
            .cloned()
            .unwrap_or_default();
        TxInbox {
            shared: self.shared.clone(),
            notify,
        }
    }

    /// Every group, as the directory knows them.
    ///
    /// Fails when the directory cannot be reached (see [`Groups::cached`]).
    pub async fn list(&self) -> Result<Vec<GroupInfo>, Failure> {
        match self.shared.directory(DirOp::List).await? {
            DirAnswer::List(records) => Ok(self.infos(records)),
            other => Err(unexpected(&other)),
        }
    }

    /// Every group, as this node's cache knows them (no round trip).
    pub fn cached(&self) -> Vec<GroupInfo> {
        let records = self.shared.core.lock().records();
        self.infos(records)
    }

    /// One group, from the cache or the directory.
    ///
    /// Fails with NoSuchGroup, or when the directory cannot be reached.
    pub async fn lookup(&self, gid: &GroupId) -> Result<GroupInfo, Failure> {
        let rec = self.shared.record(gid).await?;
        Ok(self.infos(vec![rec]).remove(0))
    }

    /// The salt of `gid`'s secret, for a client that derives the key itself.
    pub(crate) async fn verifier(&self, gid: &GroupId) -> Result<Verifier, Failure> {
        named(gid)?;
        Ok(self.shared.record(gid).await?.verifier)
    }

    fn infos(&self, records: Vec<GroupRecord>) -> Vec<GroupInfo> {
        let core = self.shared.core.lock();
        records
            .into_iter()
            .map(|r| GroupInfo {
                local_members: core.local_members(&r.gid),
                gid: r.gid,
                hosts: r.hosts,
            })
            .collect()
    }

    /// Messages this node still retransmits (diagnostics).
    pub fn outstanding(&self) -> usize {
        self.shared.core.lock().outstanding()
    }
}

/// A receiving process at this node. Dropping it without leaving its groups
/// is a process death: communications waiting on it get ProcDead.
#[must_use = "dropping a member is a process death"]
pub struct Member {
    shared: Arc<Shared>,
    id: u64,
    notify: Arc<Notify>,
}

impl Member {
    /// This member.
    pub fn id(&self) -> MemberId {
        MemberId {
            node: self.shared.endpoint.node_id(),
            id: self.id,
        }
    }

    /// Joins `gid`; a process can only join itself. Returns at once when
    /// this node already hosts members of the group (no round trip), else
    /// once the directory and every node know this node hosts it.
    ///
    /// Fails with NoSuchGroup, WrongSecret, BadRequest for a `tx:` group or
    /// a secret too long, NoBuffer at a limit, or the directory's
    /// unreachability status.
    pub async fn join(&self, gid: &GroupId, secret: &str) -> Result<(), Failure> {
        self.join_with(gid, Credential::Secret(secret.as_bytes().to_vec()))
            .instrument(tracing::debug_span!("group.join", %gid, member = %self.id()))
            .await
    }

    pub(crate) async fn join_with(&self, gid: &GroupId, cred: Credential) -> Result<(), Failure> {
        let key = self.shared.verified(gid, &cred).await?;
        let (op, rx) = self.shared.new_op();
        let (member, g) = (self.id, gid.clone());
        let done = self
            .shared
            .step(Need::Directory, move |core, env, now, out| {
                core.join(op, member, &g, key, env, now, out)
            });
        match done {
            Ok(true) => {
                self.shared.ops.lock().remove(&op);
                Ok(())
            }
            Ok(false) => self
                .shared
                .wait_op(op, rx, self.shared.cfg.directory_timeout)
                .await
                .map(|_| ()),
            Err(f) => {
                self.shared.ops.lock().remove(&op);
                Err(f)
            }
        }
    }

    /// Leaves `gid`; a process can only leave itself. Messages queued for it
    /// from the group are dropped (their senders count it as lost).
    ///
    /// Fails with NoSuchGroup, WrongSecret, Mismatch when not a member.
    pub async fn leave(&self, gid: &GroupId, secret: &str) -> Result<(), Failure> {
        self.leave_with(gid, Credential::Secret(secret.as_bytes().to_vec()))
            .await
    }

    pub(crate) async fn leave_with(&self, gid: &GroupId, cred: Credential) -> Result<(), Failure> {
        self.shared.verified(gid, &cred).await?;
        let (member, g) = (self.id, gid.clone());
        self.shared
            .step(Need::Directory, move |core, env, now, out| {
                core.leave(member, &g, env, now, out)
            })
    }

    /// The groups this member belongs to.
    pub fn groups(&self) -> Vec<GroupId> {
        self.shared.core.lock().member_groups(self.id)
    }

    /// Messages waiting in this member's queue.
    pub fn pending(&self) -> usize {
        self.shared.core.lock().queue_len(self.id)
    }

    fn take(&self, gid: Option<&GroupId>, tag: Option<Tag>) -> Result<Option<Incoming>, Failure> {
        let got = self.shared.core.lock().receive(self.id, gid, tag)?;
        Ok(got.map(|r| Incoming::new(self.shared.clone(), self.id, r)))
    }

    async fn wait(&self, gid: Option<&GroupId>, tag: Option<Tag>) -> Result<Incoming, Failure> {
        loop {
            // A queued message is taken without registering to wait (the
            // common case once woken).
            if let Some(i) = self.take(gid, tag)? {
                return Ok(i);
            }
            let mut notified = pin!(self.notify.notified());
            notified.as_mut().enable();
            if let Some(i) = self.take(gid, tag)? {
                return Ok(i);
            }
            notified.await;
        }
    }

    /// T-Shoshin's brec: waits for a message sent to `gid` (with `tag`, if
    /// given). Cancel-safe.
    ///
    /// Fails with NoSuchGroup (unknown or destroyed group), Mismatch (not a
    /// member), NoComm when the message taken belongs to a communication
    /// that terminated or was superseded (it is consumed; receive again).
    pub async fn recv(&self, gid: &GroupId, tag: Option<Tag>) -> Result<Incoming, Failure> {
        self.wait(Some(gid), tag).await
    }

    /// T-Shoshin's nrec: like [`Member::recv`] without waiting (`None` when
    /// nothing is queued).
    ///
    /// Fails like [`Member::recv`].
    pub fn try_recv(&self, gid: &GroupId, tag: Option<Tag>) -> Result<Option<Incoming>, Failure> {
        self.take(Some(gid), tag)
    }

    /// T-Shoshin's brecany: waits for a message from any of this member's
    /// groups. Cancel-safe.
    ///
    /// Fails with Mismatch when the member belongs to no group, NoComm as
    /// [`Member::recv`].
    pub async fn recv_any(&self, tag: Option<Tag>) -> Result<Incoming, Failure> {
        self.wait(None, tag).await
    }

    /// T-Shoshin's nrecany: like [`Member::recv_any`] without waiting.
    ///
    /// Fails like [`Member::recv_any`].
    pub fn try_recv_any(&self, tag: Option<Tag>) -> Result<Option<Incoming>, Failure> {
        self.take(None, tag)
    }
}

impl std::fmt::Debug for Member {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Member").field("id", &self.id()).finish()
    }
}

impl Drop for Member {
    fn drop(&mut self) {
        self.shared.members.lock().remove(&self.id);
        let id = self.id;
        self.shared
            .step(Need::Directory, move |core, env, now, out| {
                core.drop_member(id, env, now, out)
            });
    }
}

/// The node's inbox for messages sent to `tx:<tid>` groups of the
/// transactions it takes part in (the node itself is the member). Several
/// inbox handles share one queue.
pub struct TxInbox {
    shared: Arc<Shared>,
    notify: Arc<Notify>,
}

impl std::fmt::Debug for TxInbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TxInbox")
            .field("node", &self.shared.endpoint.node_id())
            .finish()
    }
}

impl TxInbox {
    /// Waits for a message to `tx:<tid>` (any transaction when `None`).
    /// Cancel-safe.
    ///
    /// Fails with NoComm when the message taken belongs to a terminated
    /// communication (it is consumed; receive again).
    pub async fn recv(&self, tid: Option<Tid>) -> Result<Incoming, Failure> {
        loop {
            let mut notified = pin!(self.notify.notified());
            notified.as_mut().enable();
            if let Some(i) = self.try_recv(tid)? {
                return Ok(i);
            }
            notified.await;
        }
    }

    /// Like [`TxInbox::recv`] without waiting.
    ///
    /// Fails like [`TxInbox::recv`].
    pub fn try_recv(&self, tid: Option<Tid>) -> Result<Option<Incoming>, Failure> {
        let gid = tid.map(GroupId::Tx);
        let got = self
            .shared
            .core
            .lock()
            .receive(NODE_MEMBER, gid.as_ref(), None)?;
        Ok(got.map(|r| Incoming::new(self.shared.clone(), NODE_MEMBER, r)))
    }
}

/// A message a member took from its queue. It may be replied to once.
pub struct Incoming {
    shared: Arc<Shared>,
    member: u64,
    comm: CommId,
    gid: Arc<GroupId>,
    tag: Tag,
    payload: Option<Payload>,
}

impl std::fmt::Debug for Incoming {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Incoming")
            .field("gid", &self.gid)
            .field("comm", &self.comm)
            .field("tag", &self.tag)
            .field("payload", &self.payload)
            .finish()
    }
}

impl Incoming {
    fn new(shared: Arc<Shared>, member: u64, r: crate::core::host::Received) -> Self {
        Incoming {
            shared,
            member,
            comm: r.comm,
            gid: r.gid,
            tag: r.tag,
            payload: Some(r.payload),
        }
    }

    /// The group it was sent to.
    pub fn gid(&self) -> &GroupId {
        &self.gid
    }

    /// Who sent it.
    pub fn sender(&self) -> SenderId {
        self.comm.sender
    }

    /// The communication (sender and session).
    pub fn comm(&self) -> CommId {
        self.comm
    }

    /// Its tag.
    pub fn tag(&self) -> Tag {
        self.tag
    }

    /// The message, unless taken.
    pub fn payload(&self) -> Option<&Payload> {
        self.payload.as_ref()
    }

    /// Takes the message out (`None` when already taken).
    pub fn take_payload(&mut self) -> Option<Payload> {
        self.payload.take()
    }

    /// Takes the message out as a `T`.
    ///
    /// Fails with Mismatch when it is not a `T` or was already taken.
    pub fn decode<T: DeserializeOwned + Send + 'static>(&mut self) -> Result<T, Failure> {
        let p = self
            .payload
            .take()
            .ok_or_else(|| Failure::new(Status::Mismatch, "the message was already taken"))?;
        p.decode()
            .map_err(|e| Failure::new(Status::Mismatch, format!("message from {}: {e}", self.comm)))
    }

    /// Replies to the sender. Returns once the sender's node buffered the
    /// reply; it never waits for the sender to ask for it.
    ///
    /// Fails with NoComm when the communication terminated, was superseded
    /// or its sender died; Mismatch when this member already replied;
    /// NoBuffer when the sender's reply buffer is full; TimedOut when the
    /// sender's node does not answer; TooLarge beyond the message limit.
    pub fn reply(
        &self,
        payload: Payload,
    ) -> impl std::future::Future<Output = Result<(), Failure>> + Send + 'static {
        let span = tracing::debug_span!("group.reply", gid = %self.gid, comm = %self.comm);
        let shared = self.shared.clone();
        let (member, comm) = (self.member, self.comm);
        async move {
            let (op, rx) = shared.new_op();
            let started = shared.step(Need::Nothing, move |core, _env, now, out| {
                core.reply(op, member, &comm, payload, now, out)
            });
            if let Err(f) = started {
                shared.ops.lock().remove(&op);
                return Err(f);
            }
            shared
                .wait_op(op, rx, shared.cfg.reply_timeout)
                .await
                .map(|_| ())
        }
        .instrument(span)
    }

    /// Replies with a typed value (moved, not serialized, when the sender
    /// is in this process).
    ///
    /// Fails like [`Incoming::reply`].
    pub fn reply_value<T: Serialize + Send + 'static>(
        &self,
        value: T,
    ) -> impl std::future::Future<Output = Result<(), Failure>> + Send + 'static {
        self.reply(Payload::local(value))
    }
}

/// A sending process at this node. It has at most one communication per
/// group: a new send to a group supersedes the previous one. Dropping it is
/// the sender's death: its communications terminate.
#[must_use = "dropping a sender terminates its communications"]
pub struct GroupSender {
    shared: Arc<Shared>,
    id: u64,
    notify: Arc<Notify>,
}

impl GroupSender {
    /// This sender.
    pub fn id(&self) -> SenderId {
        SenderId {
            node: self.shared.endpoint.node_id(),
            incarnation: self.shared.endpoint.incarnation(),
            id: self.id,
        }
    }

    /// Sends `payload` to `gid` (T-Shoshin's bsend). Returns the number of
    /// members it was delivered to (queued at the member) once every member
    /// node answered. The replies wanted start at that count.
    ///
    /// Fails with NoSuchGroup, NoMembers (nobody to deliver to), NoBuffer
    /// (every member reached had a full queue), HostDead/ProcDead/TimedOut/
    /// AddrError (no member node could be reached; the first node's status),
    /// TooLarge, NoComm when a concurrent send by this sender to the same
    /// group superseded it first.
    pub async fn send(&self, gid: &GroupId, payload: Payload) -> Result<usize, Failure> {
        self.send_tagged(gid, Tag::default(), payload).await
    }

    /// [`GroupSender::send`] with a tag for members' selective receives.
    ///
    /// Fails like [`GroupSender::send`].
    pub async fn send_tagged(
        &self,
        gid: &GroupId,
        tag: Tag,
        payload: Payload,
    ) -> Result<usize, Failure> {
        let span = tracing::debug_span!("group.send", %gid, tid = tracing::field::Empty);
        if let GroupId::Tx(tid) = gid {
            span.record("tid", tracing::field::display(tid));
        }
        let result = self.send_inner(gid, tag, payload).instrument(span).await;
        if let Ok(n) = &result {
            metrics::counter!("weft_group_deliveries_total").increment(*n as u64);
        }
        count_status("weft_group_sends_total", result.as_ref().map(|_| ()));
        result
    }

    async fn send_inner(
        &self,
        gid: &GroupId,
        tag: Tag,
        payload: Payload,
    ) -> Result<usize, Failure> {
        let sender = self.id;
        let comm = match gid {
            GroupId::Named { .. } => {
                let cached = self.shared.core.lock().record(gid).map(|r| r.hosts.clone());
                let hosts = match cached {
                    Some(hosts) => hosts,
                    None => self.shared.record(gid).await?.hosts,
                };
                let g = gid.clone();
                self.shared
                    .step(Need::Nothing, move |core, _env, now, out| {
                        core.send(sender, &g, tag, payload, &hosts, now, out)
                    })?
            }
            GroupId::Tx(tid) => {
                let tree = self.shared.tree(*tid);
                let tid = *tid;
                self.shared
                    .step(Need::Nothing, move |core, _env, now, out| {
                        core.send_tx(sender, tid, tag, payload, tree.as_ref(), now, out)
                    })?
            }
        };
        let deadline = Instant::now() + self.shared.cfg.count_timeout + Duration::from_secs(1);
        let delivery = loop {
            let mut notified = pin!(self.notify.notified());
            notified.as_mut().enable();
            match self.shared.core.lock().progress(&comm) {
                Progress::Counted(d) => break d,
                Progress::Gone => {
                    return Err(Failure::new(
                        Status::NoComm,
                        format!("the send to {gid} was superseded by another send"),
                    ))
                }
                Progress::Counting => {}
            }
            if tokio::time::timeout_at(deadline.into(), notified)
                .await
                .is_err()
            {
                return Err(Failure::new(
                    Status::TimedOut,
                    "delivery counts did not arrive",
                ));
            }
        };
        tracing::debug!(
            delivered = delivery.delivered,
            full = delivery.full,
            "group send counted"
        );
        if delivery.delivered == 0 {
            return Err(delivery.failure(gid));
        }
        Ok(delivery.delivered as usize)
    }

    /// How the last send to `gid` went: members reached, full queues,
    /// unreachable nodes.
    pub fn delivery(&self, gid: &GroupId) -> Option<Delivery> {
        self.shared.core.lock().delivery(self.id, gid)
    }

    /// T-Shoshin's totreply: lowers the total number of replies wanted from
    /// the communication with `gid` (replies already taken count; raising is
    /// ignored). 0 terminates the communication. Returns the effective
    /// total. Replies beyond it are dropped, not queued.
    ///
    /// Fails with NoComm when there is no communication with `gid` or it is
    /// over.
    pub fn set_replies(&self, gid: &GroupId, n: usize) -> Result<usize, Failure> {
        let (sender, g) = (self.id, gid.clone());
        let n = u32::try_from(n).unwrap_or(u32::MAX);
        self.shared
            .step(Need::Nothing, move |core, _env, _now, out| {
                core.set_replies(sender, &g, n, out)
            })
            .map(|n| n as usize)
    }

    /// T-Shoshin's getreply: the next reply of the communication with `gid`,
    /// waiting up to `timeout`. A member that will never reply yields its
    /// failure instead (HostDead: its node died; ProcDead: the process died
    /// or left; NoSuchGroup: the group was destroyed), so waiting for every
    /// reply never hangs on the dead.
    ///
    /// Fails with those statuses, TimedOut, or NoComm when the
    /// communication is over (every wanted reply taken, replies set to 0,
    /// superseded, or no send).
    pub async fn next_reply(&self, gid: &GroupId, timeout: Duration) -> Result<Reply, Failure> {
        let result = self.next_reply_inner(gid, timeout).await;
        count_status("weft_group_replies_total", result.as_ref().map(|_| ()));
        result
    }

    async fn next_reply_inner(&self, gid: &GroupId, timeout: Duration) -> Result<Reply, Failure> {
        let deadline = deadline_after(Instant::now(), timeout);
        loop {
            let mut notified = pin!(self.notify.notified());
            notified.as_mut().enable();
            let took = self.shared.core.lock().take_reply(self.id, gid);
            match took {
                Take::Item(ReplyItem::Reply { from, payload }) => {
                    return Ok(Reply { from, payload })
                }
                Take::Item(ReplyItem::Lost {
                    member,
                    node,
                    status,
                }) => {
                    let who = member
                        .map_or_else(|| format!("a member at node {node}"), |m| m.to_string());
                    return Err(Failure::new(
                        status,
                        format!("{who} will not reply to {gid}: {status}"),
                    ));
                }
                Take::NoComm(why) => return Err(Failure::new(Status::NoComm, why)),
                Take::Pending => {}
            }
            if tokio::time::timeout_at(deadline.into(), notified)
                .await
                .is_err()
            {
                return Err(Failure::new(
                    Status::TimedOut,
                    format!("no reply from {gid} within {timeout:?}"),
                ));
            }
        }
    }

    /// Sends `payload` to `gid` and returns the first reply (waiting up to
    /// `timeout` after the send); the communication then terminates.
    ///
    /// Fails like [`GroupSender::send`], TimedOut when no reply came, or
    /// the last member's failure when every member reached will never reply.
    pub async fn request(
        &self,
        gid: &GroupId,
        payload: Payload,
        timeout: Duration,
    ) -> Result<Reply, Failure> {
        self.send(gid, payload).await?;
        let mut last = None;
        loop {
            match self.next_reply(gid, timeout).await {
                Ok(r) => {
                    let _ = self.set_replies(gid, 0);
                    return Ok(r);
                }
                Err(f) if f.status == Status::NoComm => {
                    return Err(last.unwrap_or(f));
                }
                Err(f) if f.status == Status::TimedOut => {
                    let _ = self.set_replies(gid, 0);
                    return Err(f);
                }
                Err(f) => last = Some(f),
            }
        }
    }
}

impl std::fmt::Debug for GroupSender {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GroupSender")
            .field("id", &self.id())
            .finish()
    }
}

impl Drop for GroupSender {
    fn drop(&mut self) {
        self.shared.senders.lock().remove(&self.id);
        let id = self.id;
        self.shared
            .step(Need::Nothing, move |core, _env, _now, out| {
                core.drop_sender(id, out)
            });
    }
}

/// Counts one outcome of a group operation in the counter `name` with a
/// `status` label (docs/metrics.md), only while an exporter is installed
/// (the label is not a literal).
fn count_status(name: &'static str, result: Result<(), &Failure>) {
    if !weft_transport::metrics::exporting() {
        return;
    }
    let status = match result {
        Ok(()) => Status::Ok,
        Err(f) => f.status,
    };
    metrics::counter!(name, "status" => status.name()).increment(1);
}
