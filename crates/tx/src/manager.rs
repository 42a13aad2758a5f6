//! The transaction manager of one node: drives a [`TxCore`] per transaction
//! with real I/O (the node's log, the transport, the local resources, timers)
//! and keeps the participant tree that calls build.
//!
//! Owns the transaction table, tombstones of finished transactions, the
//! resources enlisted per transaction and the hooks the RPC layer calls on
//! every outgoing and incoming call. Must never decide anything itself: every
//! protocol decision is the core's; this module only carries actions out and
//! feeds events in, never holding a transaction's lock while doing I/O.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use parking_lot::{Mutex, RwLock};
use serde::{Deserialize, Serialize};
use tokio::sync::{oneshot, Notify};
use tracing::Instrument;
use weft_log::{ForceIntent, Log};
use weft_transport::{Endpoint, MembershipEvent, PeerRef, PortHandler};
use weft_wire::{
    Baggage, Failure, Incarnation, NodeId, Payload, PeerRole, Port, Status, SubPath, Tid, TxContext,
};

use crate::core::{late, Action, CoreConfig, Durability, Input, Phase, TxCore};
use crate::msg::{Answer, Outcome, TmRecord, TxMsg, Vote, TM_RECORD_TAG};
use crate::resource::{ParticipationClass, Resource};

/// A named point of the commit protocol where a test can stop a node
/// (then kill it) to check atomicity across crashes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum CrashPoint {
    /// A participant's prepare record is durable; its vote is not sent.
    ParticipantPrepared,
    /// All votes are in; the coordinator's commit record is not yet forced.
    CoordinatorBeforeCommitForce,
    /// The commit record is durable; no decision has been sent.
    CoordinatorAfterCommitForce,
    /// A participant received the commit decision and has not applied it.
    ParticipantPhaseTwo,
}

impl std::str::FromStr for CrashPoint {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(match s {
            "participant-prepared" => CrashPoint::ParticipantPrepared,
            "coordinator-before-commit-force" => CrashPoint::CoordinatorBeforeCommitForce,
            "coordinator-after-commit-force" => CrashPoint::CoordinatorAfterCommitForce,
            "participant-phase-two" => CrashPoint::ParticipantPhaseTwo,
            other => return Err(format!("unknown crash point {other:?}")),
        })
    }
}

/// Called when a transaction reaches the configured crash point. The
/// transaction then stops making progress at this node (it waits to be
/// killed). Test-only: production nodes configure none.
pub type CrashHook = Arc<dyn Fn(CrashPoint, Tid) + Send + Sync>;

/// Configuration of a transaction manager.
#[derive(Clone)]
pub struct TmConfig {
    /// Retransmission timing of the commit protocol.
    pub core: CoreConfig,
    /// Deadline of a transaction begun without one.
    pub default_timeout: Duration,
    /// How often timers (deadlines, retransmissions, inquiries) are checked.
    pub tick: Duration,
    /// Finished transactions remembered to answer late messages.
    pub tombstones: usize,
    /// How long an incoming call waits for the coordinator to adopt this
    /// node when a client (not a member) brought the transaction here.
    pub enlist_timeout: Duration,
    /// Early lock release: a coordinator's own resources that commit from
    /// this node's log (see `Resource::commits_from_this_log`) commit, and
    /// free their locks, as soon as its commit record is appended, not once
    /// it is durable; commits are still reported only after the force, and
    /// read-only outcomes wait for the early-released records they may
    /// depend on. On by default.
    pub early_lock_release: bool,
    /// Test hook: stop transactions at this point and call the hook.
    pub crash_at: Option<(CrashPoint, CrashHook)>,
}

impl std::fmt::Debug for TmConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TmConfig")
            .field("core", &self.core)
            .field("default_timeout", &self.default_timeout)
            .field("tick", &self.tick)
            .field("tombstones", &self.tombstones)
            .field("enlist_timeout", &self.enlist_timeout)
            .field("early_lock_release", &self.early_lock_release)
            .field("crash_at", &self.crash_at.as_ref().map(|(p, _)| p))
            .finish()
    }
}

impl Default for TmConfig {
    fn default() -> Self {
        TmConfig {
            core: CoreConfig::default(),
            default_timeout: Duration::from_secs(60),
            tick: Duration::from_millis(20),
            tombstones: 100_000,
            enlist_timeout: Duration::from_secs(2),
            early_lock_release: true,
            crash_at: None,
        }
    }
}

/// A transaction as listed by `weft tx list`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TxStatus {
    /// The transaction.
    pub tid: Tid,
    /// True at the coordinator.
    pub coordinator: bool,
    /// Phase name (active, preparing, forcing, prepared, committing).
    pub phase: String,
    /// True when prepared and waiting for the outcome.
    pub in_doubt: bool,
    /// The node that called this branch first.
    pub parent: Option<NodeId>,
    /// Nodes this branch called.
    pub children: Vec<NodeId>,
    /// Local resources enlisted.
    pub resources: Vec<String>,
    /// Calls still running here.
    pub active_calls: usize,
    /// Age in milliseconds.
    pub age_ms: u64,
}

/// What recovery found about a transaction in this node's log.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Recovered {
    /// Committed (its effects must be redone).
    Committed,
    /// Aborted, or never prepared here (presumed abort).
    Aborted,
    /// Prepared, outcome unknown: the branch must stay ready and locked until
    /// the transaction manager learns the outcome.
    InDoubt,
}

/// What recovery did.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecoveryReport {
    /// Transactions found committed whose phase two is driven again.
    pub redriven: Vec<Tid>,
    /// Transactions in doubt (asking their parent).
    pub in_doubt: Vec<Tid>,
    /// Transactions found committed and complete.
    pub committed: usize,
    /// Transactions found aborted.
    pub aborted: usize,
}

/// Counters of the transaction manager.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TmStats {
    /// Transactions begun here.
    pub begun: u64,
    /// Transactions this node coordinated that committed.
    pub committed: u64,
    /// Of those, read-only ones (no log write at all).
    pub committed_read_only: u64,
    /// Transactions this node coordinated that aborted.
    pub aborted: u64,
    /// Log records forced by the transaction manager.
    pub forced_records: u64,
    /// Protocol messages sent.
    pub messages: u64,
}

#[derive(Default)]
struct Counters {
    begun: AtomicU64,
    committed: AtomicU64,
    committed_read_only: AtomicU64,
    aborted: AtomicU64,
    forced_records: AtomicU64,
    messages: AtomicU64,
}

struct Enlisted {
    resource: Arc<dyn Resource>,
    class: ParticipationClass,
}

struct SlotState {
    core: TxCore,
    enlisted: Vec<Enlisted>,
    active_calls: usize,
    waiters: Vec<oneshot::Sender<Outcome>>,
    outcome: Option<Outcome>,
    created: Instant,
    next_sub: HashMap<SubPath, u32>,
    baggage: Baggage,
    intent: Option<ForceIntent>,
    wrote_durable: bool,
    /// The coordinator's own resources committed as soon as the commit
    /// record was appended (early lock release): CommitLocal has nothing
    /// left to do.
    committed_early: bool,
    /// The coordinator's commit record is in the log (durable or not): a
    /// vote that named this transaction may now count (see `VoteAfter`).
    commit_appended: bool,
    /// Participant: transactions of the same coordinator whose writes this
    /// branch used and which were undecided here when it voted; the vote
    /// names them.
    vote_after: Vec<Tid>,
    /// The first TM record of this transaction in the log: the log must be
    /// kept from here until the transaction is forgotten.
    first_lsn: Option<weft_log::Lsn>,
}

struct Slot {
    tid: Tid,
    /// Order of creation among this node's slots (see `TmInner::slots_made`).
    born: u64,
    state: Mutex<SlotState>,
    calls_done: Notify,
    /// Notified when the commit record is appended or the outcome is set.
    decided: Notify,
}

/// What is remembered of a transaction that ended at this node.
struct Ended {
    /// `None` for a branch that ended read-only (or never ran here).
    outcome: Option<Outcome>,
    /// Why it aborted, when the state machine knew (a dead node, the
    /// deadline, a No vote): a late `commit` reports the same status as
    /// one that found the transaction still in its table.
    cause: Option<(Status, Box<str>)>,
}

struct Tombstones {
    map: HashMap<Tid, Ended>,
    order: VecDeque<Tid>,
    cap: usize,
}

impl Tombstones {
    fn insert(&mut self, tid: Tid, outcome: Option<Outcome>) {
        self.insert_with_cause(tid, outcome, None);
    }

    fn insert_with_cause(
        &mut self,
        tid: Tid,
        outcome: Option<Outcome>,
        cause: Option<(Status, Box<str>)>,
    ) {
        if self.map.insert(tid, Ended { outcome, cause }).is_none() {
            self.order.push_back(tid);
            if self.order.len() > self.cap {
                if let Some(old) = self.order.pop_front() {
                    self.map.remove(&old);
                }
            }
        }
    }

    /// The remembered outcome: `Some(None)` for a read-only branch, `None`
    /// when nothing is remembered.
    fn outcome(&self, tid: Tid) -> Option<Option<Outcome>> {
        self.map.get(&tid).map(|e| e.outcome)
    }
}

struct TmInner {
    node: NodeId,
    incarnation: Incarnation,
    endpoint: Endpoint,
    log: Log,
    cfg: TmConfig,
    seq: AtomicU64,
    txs: Mutex<HashMap<Tid, Arc<Slot>>>,
    tombstones: Mutex<Tombstones>,
    resources: RwLock<Vec<Arc<dyn Resource>>>,
    recovered: Mutex<HashMap<Tid, Recovered>>,
    enlists: Mutex<HashMap<u64, oneshot::Sender<bool>>>,
    enlist_ids: AtomicU64,
    counters: Counters,
    /// Highest commit record whose transaction released its locks before
    /// the record was durable (early lock release). Anything that reports a
    /// commit without forcing a record of its own (a read-only finish, a
    /// read-only or volatile Yes vote) waits until the log is durable up to
    /// here: it may have read what that transaction wrote.
    early_released: AtomicU64,
    /// Wakes the timer when a transaction appears (it sleeps while none is
    /// live, so an idle node does not tick).
    work: Arc<Notify>,
    /// Slots made so far: a node's death, announced when this read `n`,
    /// concerns only slots born before `n`. A transaction begun after the
    /// announcement (with the node's next incarnation, say) never used the
    /// node that died, even if the announcement is handled after it began.
    slots_made: AtomicU64,
}

/// The transaction manager of one node. Cheap to clone.
#[derive(Clone)]
pub struct TxManager {
    inner: Arc<TmInner>,
}

/// Keeps a transaction's "call in progress" count up while a handler runs;
/// PREPARE at this node waits for every such call to finish.
#[must_use = "the call counts as running until the guard is dropped"]
pub struct CallGuard {
    slot: Option<Arc<Slot>>,
}

impl CallGuard {
    /// True when the transaction aborted while the call ran.
    pub fn aborted(&self) -> bool {
        self.slot
            .as_ref()
            .is_some_and(|s| s.state.lock().outcome == Some(Outcome::Aborted))
    }
}

impl Drop for CallGuard {
    fn drop(&mut self) {
        if let Some(slot) = self.slot.take() {
            let (zero, aborted) = {
                let mut st = slot.state.lock();
                st.active_calls = st.active_calls.saturating_sub(1);
                (st.active_calls == 0, st.outcome == Some(Outcome::Aborted))
            };
            if zero {
                slot.calls_done.notify_waiters();
            }
            if aborted {
                // The transaction aborted here while this call ran: whatever
                // the call did to the resources after they applied the abort
                // (a lock granted late, a write) is undone now. The outcome
                // was set before the resources were first told, so one of
                // the two tellings follows the call's last effect.
                if let Ok(rt) = tokio::runtime::Handle::try_current() {
                    rt.spawn(async move { abort_again(&slot).await });
                }
            }
        }
    }
}

struct TxPort(Weak<TmInner>);

impl PortHandler for TxPort {
    fn on_message(&self, from: PeerRef, payload: Payload) {
        let Some(inner) = self.0.upgrade() else {
            return;
        };
        match payload.decode::<TxMsg>() {
            Ok(msg) => inner.on_msg(from.node, msg),
            Err(e) => tracing::warn!(peer = %from.node, "undecodable transaction message: {e}"),
        }
    }

    fn inline(&self, _channel: weft_transport::ChannelKind) -> bool {
        true // decodes and spawns: nothing that could block a sender
    }
}

fn phase_name(p: &Phase) -> &'static str {
    match p {
        Phase::Active => "active",
        Phase::Preparing => "preparing",
        Phase::Forcing => "forcing",
        Phase::Prepared => "prepared",
        Phase::Committing => "committing",
        Phase::Done(_) => "done",
    }
}

impl TxManager {
    /// Starts the transaction manager of the node behind `endpoint`, logging
    /// to `log`. Registers the transaction port and the membership listener
    /// and starts the timer task. Call [`TxManager::recover`] before taking
    /// work when the log holds records.
    pub fn start(endpoint: Endpoint, log: Log, cfg: TmConfig) -> TxManager {
        let inner = Arc::new(TmInner {
            node: endpoint.node_id(),
            incarnation: endpoint.incarnation(),
            endpoint: endpoint.clone(),
            log,
            seq: AtomicU64::new(1),
            txs: Mutex::new(HashMap::new()),
            tombstones: Mutex::new(Tombstones {
                map: HashMap::new(),
                order: VecDeque::new(),
                cap: cfg.tombstones.max(1),
            }),
            resources: RwLock::new(Vec::new()),
            recovered: Mutex::new(HashMap::new()),
            enlists: Mutex::new(HashMap::new()),
            enlist_ids: AtomicU64::new(1),
            counters: Counters::default(),
            early_released: AtomicU64::new(0),
            work: Arc::new(Notify::new()),
            slots_made: AtomicU64::new(0),
            cfg,
        });
        endpoint.set_port_handler(Port::TX, Arc::new(TxPort(Arc::downgrade(&inner))));
        let weak = Arc::downgrade(&inner);
        endpoint.on_membership(move |event| {
            let (node, status, gone) = match event {
                MembershipEvent::Left {
                    node,
                    cause,
                    incarnation,
                    ..
                } => (*node, *cause, *incarnation),
                _ => return,
            };
            if let Some(inner) = weak.upgrade() {
                // Listeners must not block: hand the work to a task, which
                // spares the transactions begun after this moment.
                let born_before = inner.slots_made.load(Ordering::Acquire);
                tokio::spawn(async move { inner.peer_dead(node, status, gone, born_before) });
            }
        });
        tokio::spawn(TmInner::timer_task(
            Arc::downgrade(&inner),
            Arc::clone(&inner.work),
        ));
        TxManager { inner }
    }

    /// This node's id.
    pub fn node_id(&self) -> NodeId {
        self.inner.node
    }

    /// The node's log.
    pub fn log(&self) -> &Log {
        &self.inner.log
    }

    /// The node's transport endpoint.
    pub fn endpoint(&self) -> &Endpoint {
        &self.inner.endpoint
    }

    /// Registers a node-level resource manager: it is enlisted in every
    /// transaction recovered from the log (it must ignore outcomes of
    /// branches it does not hold).
    pub fn register_resource(&self, resource: Arc<dyn Resource>) {
        self.inner.resources.write().push(resource);
    }

    /// Begins a transaction coordinated by this node. `timeout` bounds its
    /// life (the configured default when `None`); past it, it aborts.
    pub fn begin(&self, timeout: Option<Duration>) -> TxContext {
        let inner = &self.inner;
        let seq = inner.seq.fetch_add(1, Ordering::Relaxed);
        let tid = Tid::new(inner.node, inner.incarnation, seq);
        let timeout = timeout.unwrap_or(inner.cfg.default_timeout);
        let deadline = Instant::now() + timeout;
        let core = TxCore::coordinator(tid, Some(deadline), inner.cfg.core);
        inner.insert_slot(tid, core);
        inner.counters.begun.fetch_add(1, Ordering::Relaxed);
        tracing::debug!(%tid, "begin");
        TxContext {
            tid,
            path: SubPath::top(),
            budget_us: Some(timeout.as_micros().min(u64::MAX as u128) as u64),
            baggage: Baggage::default(),
        }
    }

    /// Records that this node is about to call `to` on behalf of the
    /// transaction in `ctx`: `to` becomes a child in the participant tree.
    ///
    /// Fails with Aborted when the transaction is no longer active here
    /// (aborted, committing) and NoSuchTransaction when it is unknown here.
    pub fn on_call_out(&self, ctx: &TxContext, to: NodeId) -> Result<(), Failure> {
        let inner = &self.inner;
        let slot = inner.slot(ctx.tid).ok_or_else(|| inner.unknown(ctx.tid))?;
        let incarnation = inner.endpoint.peer_incarnation(to).unwrap_or_default();
        let mut st = slot.state.lock();
        if to == inner.node {
            // A call to this node itself adds no edge to the tree.
            return if st.core.is_active() {
                Ok(())
            } else {
                Err(not_active(ctx.tid, &st))
            };
        }
        if st.core.add_child(to, incarnation) {
            Ok(())
        } else {
            Err(not_active(ctx.tid, &st))
        }
    }

    /// Records that a call on behalf of `ctx` arrived from `from` for a
    /// service (or resource) of class `class`: this node joins the
    /// transaction (becoming the caller's child) if it had not, the resource
    /// is enlisted, and the returned guard marks the call as running.
    ///
    /// Fails with Aborted when the transaction already ended here (a late
    /// request), NotCoordinator-free but Aborted/NoSuchTransaction when a
    /// call to the coordinator names a transaction it does not run, and
    /// TimedOut/HostDead when a client brought the transaction and its
    /// coordinator cannot be reached to adopt this node.
    pub async fn on_call_in(
        &self,
        ctx: &TxContext,
        from: PeerRef,
        resource: Option<(Arc<dyn Resource>, ParticipationClass)>,
    ) -> Result<CallGuard, Failure> {
        let inner = &self.inner;
        let tid = ctx.tid;
        let slot = match inner.slot(tid) {
            Some(s) => s,
            None => {
                if tid.node == inner.node {
                    return Err(inner.unknown(tid));
                }
                if let Some(outcome) = inner.tombstones.lock().outcome(tid) {
                    return Err(Failure::new(
                        Status::Aborted,
                        format!("transaction {tid} already ended here ({outcome:?})"),
                    ));
                }
                let deadline = ctx
                    .budget_us
                    .map(|us| Instant::now() + Duration::from_micros(us))
                    .or_else(|| Some(Instant::now() + inner.cfg.default_timeout));
                let parent = if from.role == PeerRole::Node {
                    from.node
                } else {
                    // A client brought the transaction: ask its coordinator to
                    // adopt this node, so commit reaches it.
                    inner.enlist_with_coordinator(tid).await?;
                    tid.node
                };
                let core = TxCore::participant(tid, parent, deadline, inner.cfg.core);
                inner.insert_slot_if_absent(tid, core)
            }
        };
        let mut st = slot.state.lock();
        if !st.core.is_active() {
            return Err(not_active(tid, &st));
        }
        st.active_calls += 1;
        if !ctx.baggage.is_empty() {
            merge_baggage(&mut st.baggage, &ctx.baggage);
        }
        if let Some((r, class)) = resource {
            enlist(&mut st, r, class);
        }
        drop(st);
        Ok(CallGuard { slot: Some(slot) })
    }

    /// Enlists a resource in a transaction active at this node (explicit
    /// enlistment, e.g. a PostgreSQL connection).
    ///
    /// Fails with NoSuchTransaction when unknown here, Aborted when no longer
    /// active.
    pub fn enlist(&self, tid: Tid, resource: Arc<dyn Resource>) -> Result<(), Failure> {
        let inner = &self.inner;
        let slot = inner.slot(tid).ok_or_else(|| inner.unknown(tid))?;
        let mut st = slot.state.lock();
        if !st.core.is_active() {
            return Err(not_active(tid, &st));
        }
        let class = resource.class();
        enlist(&mut st, resource, class);
        Ok(())
    }

    /// Commits a transaction this node created: two-phase commit down the
    /// participant tree. Returns when the outcome is decided (phase two
    /// continues in the background).
    ///
    /// Calling it again after the outcome is decided gives the same answer
    /// (Ok for a commit, the abort's status) for as long as the transaction
    /// is remembered.
    ///
    /// Fails with NotCoordinator when another node created it,
    /// NoSuchTransaction when unknown, the abort's cause when it aborted:
    /// HostDead/ProcDead when a participant's node died, TimedOut at the
    /// deadline, Aborted for a No vote or an abort by any participant;
    /// InDoubt when the commit record could not be forced (the log failed).
    pub async fn commit(&self, tid: Tid) -> Result<(), Failure> {
        let inner = &self.inner;
        if tid.node != inner.node || tid.incarnation != inner.incarnation {
            return Err(Failure::new(
                Status::NotCoordinator,
                format!(
                    "only node {} (incarnation {}) can commit {tid}",
                    tid.node, tid.incarnation
                ),
            ));
        }
        let Some(slot) = inner.slot(tid) else {
            return inner.ended_result(tid);
        };
        let rx = {
            let mut st = slot.state.lock();
            if let Some(o) = st.outcome {
                return outcome_result(tid, o, st.core.abort_cause());
            }
            let (tx, rx) = oneshot::channel();
            st.waiters.push(tx);
            // A coordinator with no children forces its commit record right
            // after its own resources prepared: imminent. With children, the
            // record waits for their votes (their nodes' forces), so an
            // intent here would hold this node's flusher back for other
            // transactions' prepares: none is registered.
            if st.core.children().is_empty()
                && st
                    .enlisted
                    .iter()
                    .any(|e| e.class == ParticipationClass::TwoPhase)
            {
                expect_force(&mut st, &inner.log);
            }
            rx
        };
        let span = tracing::debug_span!("commit", %tid);
        inner.input(&slot, Input::Commit).instrument(span).await;
        match rx.await {
            Ok(o) => outcome_result(tid, o, slot.state.lock().core.abort_cause()),
            Err(_) => Err(Failure::new(
                Status::InDoubt,
                format!("{tid}: the commit record could not be made durable"),
            )),
        }
    }

    /// Aborts a transaction at this node (any participant may): the
    /// abort spreads up and down the tree. No effect when it is already
    /// decided or in doubt here.
    ///
    /// Fails with NoSuchTransaction when unknown here.
    pub async fn abort(&self, tid: Tid, reason: &str) -> Result<(), Failure> {
        let inner = &self.inner;
        let slot = inner.slot(tid).ok_or_else(|| inner.unknown(tid))?;
        inner.input(&slot, Input::Abort(reason.to_string())).await;
        Ok(())
    }

    /// Starts a sub-transaction of the (sub-)transaction in `ctx`; returns
    /// its context. Calls made with it run in the sub-transaction.
    ///
    /// Fails with NoSuchTransaction / Aborted when the transaction is not
    /// active here.
    pub fn sub_begin(&self, ctx: &TxContext) -> Result<TxContext, Failure> {
        let inner = &self.inner;
        let slot = inner.slot(ctx.tid).ok_or_else(|| inner.unknown(ctx.tid))?;
        let mut st = slot.state.lock();
        if !st.core.is_active() {
            return Err(not_active(ctx.tid, &st));
        }
        let n = st.next_sub.entry(ctx.path.clone()).or_insert(0);
        *n += 1;
        let path = ctx.path.child(*n);
        Ok(TxContext {
            path,
            ..ctx.clone()
        })
    }

    /// Ends a sub-transaction: committed into its parent (its effects and
    /// locks pass to the parent) or aborted (its effects are undone, the
    /// parent goes on). Every node the sub-transaction reached is told.
    ///
    /// Fails with NoSuchTransaction / Aborted when the transaction is not
    /// active here, BadRequest for the top-level path.
    pub fn sub_end(&self, tid: Tid, path: &SubPath, committed: bool) -> Result<(), Failure> {
        if path.is_top() {
            return Err(Failure::new(
                Status::BadRequest,
                "the top level is not a sub-transaction",
            ));
        }
        self.inner.sub_ended(tid, path, committed, None)
    }

    /// The deadline of `tid` as this node knows it (`None` when unknown here
    /// or without one).
    pub fn deadline(&self, tid: Tid) -> Option<Instant> {
        self.inner
            .slot(tid)
            .and_then(|s| s.state.lock().core.deadline())
    }

    /// The baggage merged at this node for `tid`.
    pub fn baggage(&self, tid: Tid) -> Option<Baggage> {
        self.inner.slot(tid).map(|s| s.state.lock().baggage.clone())
    }

    /// Merges baggage returned by a call into the transaction's baggage.
    pub fn merge_baggage(&self, tid: Tid, baggage: &Baggage) {
        if let Some(slot) = self.inner.slot(tid) {
            merge_baggage(&mut slot.state.lock().baggage, baggage);
        }
    }

    /// The status of a transaction at this node, or what is remembered of it.
    pub fn status(&self, tid: Tid) -> Option<TxStatus> {
        self.inner.slot(tid).map(|s| self.inner.describe(&s))
    }

    /// The outcome remembered for a finished transaction (`Some(None)` for a
    /// read-only branch), or `None` when it is live or unknown.
    pub fn finished_outcome(&self, tid: Tid) -> Option<Option<Outcome>> {
        self.inner.tombstones.lock().outcome(tid)
    }

    /// Every transaction live at this node, oldest first, then the
    /// orphaned ones (see [`TxManager::orphans`]).
    pub fn list(&self) -> Vec<TxStatus> {
        let slots: Vec<Arc<Slot>> = self.inner.txs.lock().values().cloned().collect();
        let mut v: Vec<TxStatus> = slots.iter().map(|s| self.inner.describe(s)).collect();
        v.sort_by_key(|s| std::cmp::Reverse(s.age_ms));
        v.extend(self.orphans());
        v
    }

    /// Transactions that a registered resource still holds something for
    /// (locks, prepared writes, registrations: see [`Resource::held`]) and
    /// that this node no longer runs: phase "orphaned", with what each
    /// resource holds. A resource that outlives its branch this way blocks
    /// whoever needs what it holds until the node restarts; none should
    /// ever be listed.
    pub fn orphans(&self) -> Vec<TxStatus> {
        let resources = self.inner.resources.read().clone();
        let mut held: std::collections::BTreeMap<Tid, Vec<String>> = Default::default();
        for r in &resources {
            for (tid, what) in r.held() {
                held.entry(tid)
                    .or_default()
                    .push(format!("{}: {what}", r.name()));
            }
        }
        let txs = self.inner.txs.lock();
        held.into_iter()
            .filter(|(tid, _)| !txs.contains_key(tid))
            .map(|(tid, resources)| TxStatus {
                tid,
                coordinator: tid.node == self.inner.node
                    && tid.incarnation == self.inner.incarnation,
                phase: "orphaned".to_string(),
                in_doubt: false,
                parent: None,
                children: Vec::new(),
                resources,
                active_calls: 0,
                age_ms: 0,
            })
            .collect()
    }

    /// Counters.
    pub fn stats(&self) -> TmStats {
        let c = &self.inner.counters;
        TmStats {
            begun: c.begun.load(Ordering::Relaxed),
            committed: c.committed.load(Ordering::Relaxed),
            committed_read_only: c.committed_read_only.load(Ordering::Relaxed),
            aborted: c.aborted.load(Ordering::Relaxed),
            forced_records: c.forced_records.load(Ordering::Relaxed),
            messages: c.messages.load(Ordering::Relaxed),
        }
    }

    /// What recovery found about `tid` (resources ask this while redoing).
    pub fn recovered(&self, tid: Tid) -> Option<Recovered> {
        self.inner.recovered.lock().get(&tid).copied()
    }

    /// The lowest log position the transaction manager still needs: the
    /// first record of the oldest transaction that has written one and is
    /// not finished. `None` when no live transaction needs the log (any
    /// prefix may be truncated as far as the transaction manager goes).
    pub fn low_water(&self) -> Option<weft_log::Lsn> {
        let slots: Vec<Arc<Slot>> = self.inner.txs.lock().values().cloned().collect();
        slots.iter().filter_map(|s| s.state.lock().first_lsn).min()
    }

    /// Replays the transaction manager's records from the log: re-drives
    /// phase two of committed transactions that did not end, and puts
    /// prepared transactions without an outcome in doubt (they ask their
    /// parent, with backoff, until they learn it). Every registered resource
    /// is enlisted in those transactions.
    pub fn recover(&self, records: &[weft_log::LogRecord]) -> RecoveryReport {
        crate::recovery::recover(self, records)
    }

    pub(crate) fn install_recovered(
        &self,
        tid: Tid,
        core: TxCore,
        state: Recovered,
        first_lsn: weft_log::Lsn,
    ) {
        let inner = &self.inner;
        inner.recovered.lock().insert(tid, state);
        if matches!(state, Recovered::Committed | Recovered::InDoubt)
            && matches!(core.phase(), Phase::Prepared | Phase::Committing)
        {
            let slot = inner.insert_slot(tid, core);
            let resources = inner.resources.read().clone();
            let mut st = slot.state.lock();
            st.wrote_durable = true;
            st.first_lsn = Some(first_lsn);
            for r in resources {
                let class = r.class();
                enlist(&mut st, r, class);
            }
        }
    }

    pub(crate) fn note_recovered(&self, tid: Tid, state: Recovered) {
        self.inner.recovered.lock().insert(tid, state);
        let outcome = match state {
            Recovered::Committed => Some(Outcome::Committed),
            Recovered::Aborted => Some(Outcome::Aborted),
            Recovered::InDoubt => return,
        };
        self.inner.tombstones.lock().insert(tid, outcome);
    }

    pub(crate) fn core_config(&self) -> CoreConfig {
        self.inner.cfg.core
    }

    /// Feeds a tick now (tests use it to avoid waiting for the timer).
    pub async fn tick(&self) {
        self.inner.tick_all().await;
    }
}

/// The result `commit` reports: Ok, or the abort's cause (Aborted with the
/// reason, TimedOut, HostDead/ProcDead when a node it needed died).
fn outcome_result(tid: Tid, o: Outcome, cause: Option<(Status, &str)>) -> Result<(), Failure> {
    match (o, cause) {
        (Outcome::Committed, _) => Ok(()),
        (Outcome::Aborted, Some((status, reason))) => Err(Failure::new(
            status,
            format!("transaction {tid} aborted: {reason}"),
        )),
        (Outcome::Aborted, None) => Err(Failure::new(
            Status::Aborted,
            format!("transaction {tid} aborted"),
        )),
    }
}

fn not_active(tid: Tid, st: &SlotState) -> Failure {
    match st.outcome {
        Some(Outcome::Aborted) => {
            Failure::new(Status::Aborted, format!("transaction {tid} aborted"))
        }
        _ => Failure::new(
            Status::Aborted,
            format!(
                "transaction {tid} is {} here: no more work may join it",
                phase_name(st.core.phase())
            ),
        ),
    }
}

/// Registers a force intent for the transaction, once, when a force is
/// imminent: a participant is asked to prepare, or a coordinator without
/// children starts commit. The log's flusher waits briefly
/// for transactions with intents before syncing, so concurrent committers
/// share one fdatasync; a transaction alone never waits (its own intent turns
/// into its force). Not earlier: a transaction still working (or waiting for
/// a lock) must not hold the flusher back. Dropped when it forces or ends.
fn expect_force(st: &mut SlotState, log: &Log) {
    if st.intent.is_none() && matches!(st.core.phase(), Phase::Active) {
        st.intent = Some(log.intent());
    }
}

fn enlist(st: &mut SlotState, resource: Arc<dyn Resource>, class: ParticipationClass) {
    if class == ParticipationClass::NoState {
        return;
    }
    if st
        .enlisted
        .iter()
        .any(|e| Arc::ptr_eq(&e.resource, &resource))
    {
        return;
    }
    st.enlisted.push(Enlisted { resource, class });
}

/// Last writer wins per key.
fn merge_baggage(into: &mut Baggage, from: &Baggage) {
    for item in &from.0 {
        into.set(item.key.clone(), item.value.clone());
    }
}

impl TmInner {
    fn slot(&self, tid: Tid) -> Option<Arc<Slot>> {
        self.txs.lock().get(&tid).cloned()
    }

    /// What `commit` answers for a transaction no longer in the table: the
    /// remembered outcome with its cause, exactly as while it was there.
    ///
    /// The tombstones' lock is released before `unknown` takes it again
    /// (parking_lot's mutex is not reentrant: a guard kept alive across the
    /// match froze the node).
    fn ended_result(&self, tid: Tid) -> Result<(), Failure> {
        let ended = {
            let tombstones = self.tombstones.lock();
            tombstones
                .map
                .get(&tid)
                .and_then(|e| e.outcome.map(|o| (o, e.cause.clone())))
        };
        match ended {
            Some((o, cause)) => outcome_result(tid, o, cause.as_ref().map(|(s, r)| (*s, &**r))),
            None => Err(self.unknown(tid)),
        }
    }

    fn unknown(&self, tid: Tid) -> Failure {
        match self.tombstones.lock().outcome(tid) {
            Some(Some(Outcome::Aborted)) => {
                Failure::new(Status::Aborted, format!("transaction {tid} aborted"))
            }
            Some(o) => Failure::new(
                Status::NoSuchTransaction,
                format!("transaction {tid} already ended here ({o:?})"),
            ),
            None => Failure::new(
                Status::NoSuchTransaction,
                format!("no transaction {tid} at node {}", self.node),
            ),
        }
    }

    fn new_slot(&self, tid: Tid, core: TxCore) -> Arc<Slot> {
        Arc::new(Slot {
            tid,
            born: self.slots_made.fetch_add(1, Ordering::AcqRel),
            state: Mutex::new(SlotState {
                core,
                enlisted: Vec::new(),
                active_calls: 0,
                waiters: Vec::new(),
                outcome: None,
                created: Instant::now(),
                next_sub: HashMap::new(),
                baggage: Baggage::default(),
                intent: None,
                wrote_durable: false,
                committed_early: false,
                commit_appended: false,
                vote_after: Vec::new(),
                first_lsn: None,
            }),
            calls_done: Notify::new(),
            decided: Notify::new(),
        })
    }

    fn insert_slot(&self, tid: Tid, core: TxCore) -> Arc<Slot> {
        let slot = self.new_slot(tid, core);
        self.txs.lock().insert(tid, slot.clone());
        self.work.notify_one();
        slot
    }

    fn insert_slot_if_absent(&self, tid: Tid, core: TxCore) -> Arc<Slot> {
        let slot = self
            .txs
            .lock()
            .entry(tid)
            .or_insert_with(|| self.new_slot(tid, core))
            .clone();
        self.work.notify_one();
        slot
    }

    fn describe(&self, slot: &Slot) -> TxStatus {
        let st = slot.state.lock();
        TxStatus {
            tid: slot.tid,
            coordinator: st.core.is_coordinator(),
            phase: phase_name(st.core.phase()).to_string(),
            in_doubt: st.core.in_doubt(),
            parent: st.core.voter().or(st.core.parent()),
            children: st.core.children().into_iter().map(|(n, _)| n).collect(),
            resources: st
                .enlisted
                .iter()
                .map(|e| e.resource.name().to_string())
                .collect(),
            active_calls: st.active_calls,
            age_ms: st.created.elapsed().as_millis() as u64,
        }
    }

    /// Feeds an input to a transaction and carries out the resulting actions.
    fn input<'a>(
        self: &'a Arc<Self>,
        slot: &'a Arc<Slot>,
        input: Input,
    ) -> futures::future::BoxFuture<'a, ()> {
        Box::pin(async move {
            let actions = slot.state.lock().core.step(input);
            self.run(slot, actions).await;
        })
    }

    async fn run(self: &Arc<Self>, slot: &Arc<Slot>, actions: Vec<Action>) {
        let n = actions.len();
        for (i, action) in actions.into_iter().enumerate() {
            self.act(slot, action, i + 1 == n).await;
        }
    }

    /// Carries out one action; `last` when it ends its step (waiting here
    /// then delays nothing else, so the task hop can be saved).
    async fn act(self: &Arc<Self>, slot: &Arc<Slot>, action: Action, last: bool) {
        let tid = slot.tid;
        match action {
            Action::PrepareLocal { aborted_subs } => {
                for path in &aborted_subs {
                    self.apply_sub_end(slot, path, false);
                }
                let two_phase = slot
                    .state
                    .lock()
                    .enlisted
                    .iter()
                    .any(|e| e.class == ParticipationClass::TwoPhase);
                if !two_phase && slot.state.lock().active_calls == 0 {
                    // Nothing durable here: vote without a task hop.
                    let vote = local_vote_volatile(&slot.state.lock());
                    self.input(slot, Input::LocalVote(vote)).await;
                } else if last {
                    // No Prepare to children waits behind it: prepare here.
                    let vote = self.prepare_local(slot).await;
                    self.input(slot, Input::LocalVote(vote)).await;
                } else {
                    let me = Arc::clone(self);
                    let slot = Arc::clone(slot);
                    tokio::spawn(async move {
                        let vote = me.prepare_local(&slot).await;
                        me.input(&slot, Input::LocalVote(vote)).await;
                    });
                }
            }
            Action::Send(to, msg) => {
                if matches!(
                    msg,
                    TxMsg::Vote {
                        vote: Vote::ReadOnly | Vote::Yes { durable: false },
                        ..
                    }
                ) {
                    self.await_early_released(tid).await;
                }
                // A vote that needed no force waits for the resources here.
                let msg = match msg {
                    TxMsg::Vote {
                        tid,
                        vote: vote @ Vote::Yes { durable: true },
                    } => {
                        // Kept: a repeated vote (the Prepare was retried)
                        // must name them too, or the coordinator could
                        // count it before their commit records.
                        let after = slot.state.lock().vote_after.clone();
                        if after.is_empty() {
                            TxMsg::Vote { tid, vote }
                        } else {
                            TxMsg::VoteAfter { tid, vote, after }
                        }
                    }
                    TxMsg::Vote {
                        tid,
                        vote: Vote::ReadOnly | Vote::Yes { durable: false },
                    } => match vote_barrier(slot).await {
                        Ok(()) => msg,
                        Err(reason) => TxMsg::Vote {
                            tid,
                            vote: Vote::No(reason),
                        },
                    },
                    other => other,
                };
                self.counters.messages.fetch_add(1, Ordering::Relaxed);
                if let Err(f) = self.endpoint.send(to, Port::TX, Payload::local(msg)) {
                    tracing::debug!(%tid, peer = %to, %f, "protocol message not sent");
                    if matches!(
                        f.status,
                        Status::HostDead | Status::ProcDead | Status::AddrError
                    ) {
                        let me = Arc::clone(self);
                        let slot = Arc::clone(slot);
                        let status = f.status;
                        tokio::spawn(
                            async move { me.input(&slot, Input::PeerDead(to, status)).await },
                        );
                    }
                }
            }
            Action::Log(record, durability) => {
                self.log_record(slot, record, durability, last).await
            }
            Action::CommitLocal => {
                // Applied before the next action: the creator's commit
                // returns (Finished) only once this node's resources hold
                // the outcome.
                let early = slot.state.lock().committed_early;
                commit_resources(slot, |r| !(early && r.commits_from_this_log())).await;
            }
            Action::AbortLocal => {
                slot.state.lock().outcome = Some(Outcome::Aborted);
                slot.decided.notify_waiters();
                for (r, class) in resources_of(slot) {
                    match class {
                        ParticipationClass::TwoPhase => r.abort(tid).await,
                        ParticipationClass::OnePhase => r.ended(tid, Outcome::Aborted).await,
                        ParticipationClass::NoState => {}
                    }
                }
            }
            Action::Finished(outcome) => {
                if outcome == Outcome::Committed && !slot.state.lock().wrote_durable {
                    // A read-only commit may have read an early-released
                    // transaction's writes: report it only once they last.
                    self.await_early_released(tid).await;
                }
                let (waiters, durable) = {
                    let mut st = slot.state.lock();
                    st.outcome = Some(outcome);
                    st.intent = None;
                    (std::mem::take(&mut st.waiters), st.wrote_durable)
                };
                slot.decided.notify_waiters();
                match outcome {
                    Outcome::Committed => {
                        self.counters.committed.fetch_add(1, Ordering::Relaxed);
                        if !durable {
                            self.counters
                                .committed_read_only
                                .fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    Outcome::Aborted => {
                        self.counters.aborted.fetch_add(1, Ordering::Relaxed);
                    }
                }
                tracing::debug!(%tid, ?outcome, "finished");
                for w in waiters {
                    let _ = w.send(outcome);
                }
            }
            Action::Forget(outcome) => {
                let cause = {
                    let mut st = slot.state.lock();
                    if st.outcome.is_none() {
                        st.outcome = outcome;
                    }
                    st.intent = None;
                    for w in std::mem::take(&mut st.waiters) {
                        let _ = w.send(outcome.unwrap_or(Outcome::Committed));
                    }
                    st.core.abort_cause().map(|(s, r)| (s, Box::from(r)))
                };
                self.txs.lock().remove(&tid);
                self.tombstones
                    .lock()
                    .insert_with_cause(tid, outcome, cause);
                slot.calls_done.notify_waiters();
            }
        }
    }

    /// Waits until every early-released commit record appended so far is
    /// durable (at once when none is pending). A log failure is reported by
    /// the forces themselves; here it only ends the wait.
    async fn await_early_released(&self, tid: Tid) {
        let lsn = self.early_released.load(Ordering::Acquire);
        if lsn > self.log.durable_lsn().get() {
            if let Err(e) = self.log.when_durable(weft_log::Lsn(lsn)).await {
                tracing::warn!(%tid, "waiting for early-released commits: {e}");
            }
        }
    }

    /// Commits the coordinator's log-recovered resources once its commit
    /// record at `lsn` is appended (early lock release).
    async fn commit_early(&self, slot: &Arc<Slot>, lsn: weft_log::Lsn) {
        self.early_released.fetch_max(lsn.get(), Ordering::AcqRel);
        slot.state.lock().committed_early = true;
        commit_resources(slot, |r| r.commits_from_this_log()).await;
    }

    /// Carries on once a forced record is durable (or the log failed).
    async fn after_force(
        self: &Arc<Self>,
        slot: &Arc<Slot>,
        coordinator: bool,
        forced: weft_log::Result<()>,
    ) {
        match forced {
            Ok(()) => {
                let point = if coordinator {
                    CrashPoint::CoordinatorAfterCommitForce
                } else {
                    CrashPoint::ParticipantPrepared
                };
                self.crash_point(point, slot.tid).await;
                // A participant's vote leaves only once its resources allow
                // it; the force is already done, so this wait overlaps it.
                // When what it waits for has the same coordinator, the vote
                // leaves now naming it, and the coordinator orders the
                // commits in its own log instead.
                let allowed = if coordinator {
                    Ok(())
                } else if let Some(after) = self.early_vote(slot) {
                    slot.state.lock().vote_after = after;
                    Ok(())
                } else {
                    vote_barrier(slot).await
                };
                match allowed {
                    Ok(()) => self.input(slot, Input::Forced).await,
                    Err(reason) => self.input(slot, Input::Abort(reason)).await,
                }
            }
            Err(e) => {
                tracing::error!(tid = %slot.tid, "log force failed: {e}");
                self.log_failed(slot, Durability::Force);
            }
        }
    }

    /// Appends a TM record; `last` when no other action of the same step
    /// follows (a force may then be awaited here instead of in a task).
    async fn log_record(
        self: &Arc<Self>,
        slot: &Arc<Slot>,
        record: TmRecord,
        durability: Durability,
        last: bool,
    ) {
        let tid = slot.tid;
        if durability == Durability::Force && matches!(record, TmRecord::Committed { .. }) {
            self.crash_point(CrashPoint::CoordinatorBeforeCommitForce, tid)
                .await;
        }
        let bytes = match postcard::to_allocvec(&record) {
            Ok(b) => b,
            Err(e) => {
                tracing::error!(%tid, "cannot encode log record: {e}");
                return;
            }
        };
        let lsn = match self.log.append(TM_RECORD_TAG, &bytes) {
            Ok(l) => {
                let commit = matches!(record, TmRecord::Committed { .. });
                {
                    let mut st = slot.state.lock();
                    st.first_lsn.get_or_insert(l);
                    st.commit_appended |= commit && st.core.is_coordinator();
                }
                if commit {
                    slot.decided.notify_waiters();
                }
                l
            }
            Err(e) => {
                tracing::error!(%tid, "log append failed: {e}");
                self.log_failed(slot, durability);
                return;
            }
        };
        match durability {
            Durability::None => {}
            Durability::Force => {
                self.counters.forced_records.fetch_add(1, Ordering::Relaxed);
                let intent = {
                    let mut st = slot.state.lock();
                    st.wrote_durable = true;
                    st.intent.take()
                };
                let coordinator = matches!(record, TmRecord::Committed { .. });
                // Early lock release: once its commit record is in the log
                // the coordinator's own resources commit (and release their
                // locks) while the record is forced. Nobody can act on what
                // they wrote before it is durable: later writers' records
                // follow it in the log, and read-only reporters wait for
                // `early_released` (see `await_early_released`).
                let early = coordinator && self.cfg.early_lock_release;
                let me = Arc::clone(self);
                let forcing = async move {
                    match intent {
                        Some(i) => i.force(lsn).await,
                        None => me.log.force(lsn).await,
                    }
                };
                if last {
                    // Nothing else in this step waits: force here, without a
                    // task hop. The first poll hands the sync to the flusher,
                    // which runs while the early commit applies.
                    let mut forcing = std::pin::pin!(forcing);
                    let polled = futures::poll!(forcing.as_mut());
                    if early {
                        self.commit_early(slot, lsn).await;
                    }
                    let forced = match polled {
                        std::task::Poll::Ready(r) => r,
                        std::task::Poll::Pending => forcing.await,
                    };
                    self.after_force(slot, coordinator, forced).await;
                } else {
                    let (applied_tx, applied_rx) = oneshot::channel::<()>();
                    let me = Arc::clone(self);
                    let forced_slot = Arc::clone(slot);
                    tokio::spawn(async move {
                        let forced = forcing.await;
                        // The outcome moves on only after the early commit
                        // finished (or was not attempted).
                        let _ = applied_rx.await;
                        me.after_force(&forced_slot, coordinator, forced).await;
                    });
                    if early {
                        self.commit_early(slot, lsn).await;
                    }
                    drop(applied_tx);
                }
            }
            Durability::Lazy => {
                let me = Arc::clone(self);
                let slot = Arc::clone(slot);
                tokio::spawn(async move {
                    match me.log.when_durable(lsn).await {
                        Ok(()) => me.input(&slot, Input::LazyDurable).await,
                        Err(e) => tracing::error!(tid = %slot.tid, "log failed: {e}"),
                    }
                });
            }
        }
    }

    /// The log cannot make a record durable. A participant votes No (its
    /// prepare record may or may not be on disk: recovery will ask and get
    /// abort); a coordinator cannot know whether its commit record is on
    /// disk, so its caller hears InDoubt and the node must restart.
    fn log_failed(self: &Arc<Self>, slot: &Arc<Slot>, durability: Durability) {
        if durability != Durability::Force {
            return;
        }
        let coordinator = slot.state.lock().core.is_coordinator();
        if coordinator {
            // Dropping the waiters makes commit() report InDoubt.
            slot.state.lock().waiters.clear();
        } else {
            let me = Arc::clone(self);
            let slot = Arc::clone(slot);
            tokio::spawn(async move {
                me.input(&slot, Input::Abort("the log failed".into())).await;
            });
        }
    }

    async fn prepare_local(self: &Arc<Self>, slot: &Arc<Slot>) -> Vote {
        // Late calls still running here finish first (bounded by the
        // transaction's deadline).
        loop {
            let notified = slot.calls_done.notified();
            let (busy, deadline) = {
                let st = slot.state.lock();
                (st.active_calls > 0, st.core.deadline())
            };
            if !busy {
                break;
            }
            let wait = deadline
                .map(|d| d.saturating_duration_since(Instant::now()))
                .unwrap_or(Duration::from_secs(60));
            if tokio::time::timeout(wait, notified).await.is_err() {
                return Vote::No("calls still running at the deadline".into());
            }
        }
        if slot.state.lock().outcome == Some(Outcome::Aborted) {
            // Aborted here while calls finished: nothing to prepare (the
            // calls' leftovers are undone as each ends, see CallGuard).
            return Vote::No("the transaction aborted here before it prepared".into());
        }
        let enlisted = resources_of(slot);
        let mut vote = Vote::ReadOnly;
        for (r, class) in enlisted {
            let v = match class {
                ParticipationClass::TwoPhase => r.prepare(slot.tid, &self.log).await,
                ParticipationClass::OnePhase => Vote::Yes { durable: false },
                ParticipationClass::NoState => Vote::ReadOnly,
            };
            vote = vote.and(v);
            if matches!(vote, Vote::No(_)) {
                break;
            }
        }
        if slot.state.lock().outcome == Some(Outcome::Aborted) {
            // The abort was applied while the resources prepared: what they
            // registered for the branch since (a prepared write set, items
            // in violation mode) would outlive it. They hear it again.
            abort_again(slot).await;
            return Vote::No("the transaction aborted here while it prepared".into());
        }
        // The coordinator decides from its local vote: it may count only
        // once the resources allow it (participants wait after their force).
        if slot.tid.node == self.node && !matches!(vote, Vote::No(_)) {
            if let Err(reason) = vote_barrier(slot).await {
                return Vote::No(reason);
            }
        }
        vote
    }

    fn on_msg(self: &Arc<Self>, from: NodeId, msg: TxMsg) {
        let me = Arc::clone(self);
        // Protocol steps may await resources; never block the inbox.
        tokio::spawn(async move { me.handle_msg(from, msg).await });
    }

    async fn handle_msg(self: &Arc<Self>, from: NodeId, msg: TxMsg) {
        let tid = match &msg {
            TxMsg::Prepare { tid, .. }
            | TxMsg::Vote { tid, .. }
            | TxMsg::VoteAfter { tid, .. }
            | TxMsg::Decision { tid, .. }
            | TxMsg::Ack { tid }
            | TxMsg::Abort { tid, .. }
            | TxMsg::Inquire { tid }
            | TxMsg::Outcome { tid, .. }
            | TxMsg::Enlist { tid, .. }
            | TxMsg::Enlisted { tid, .. }
            | TxMsg::SubEnded { tid, .. } => *tid,
        };
        let slot = self.slot(tid);
        let input = match msg {
            TxMsg::Prepare {
                incarnation,
                aborted_subs,
                ..
            } => {
                if slot.is_none() && incarnation != self.incarnation && !self.tombstoned(tid) {
                    // The caller reached an earlier life of this node: that
                    // branch's work is gone.
                    let vote = Vote::No(format!(
                        "node {} restarted (incarnation {} -> {}): its branch was lost",
                        self.node, incarnation, self.incarnation
                    ));
                    self.send(from, TxMsg::Vote { tid, vote });
                    return;
                }
                if let Some(slot) = &slot {
                    expect_force(&mut slot.state.lock(), &self.log);
                }
                Input::Prepare { from, aborted_subs }
            }
            TxMsg::Vote { vote, .. } => Input::Vote { from, vote },
            TxMsg::VoteAfter { vote, after, .. } => {
                let vote = match self.committed_here(tid, &after).await {
                    Ok(()) => vote,
                    Err((dep, reason)) => {
                        // The participant named `dep` as undecided: it has
                        // not heard of its abort (the notice is lost or on
                        // its way), and until it does, whoever locks what
                        // `dep` wrote there uses its writes and is doomed.
                        // What an inquiry would answer, said now.
                        self.send(
                            from,
                            TxMsg::Abort {
                                tid: dep,
                                status: Status::Aborted,
                                reason: format!("{dep} aborted at its coordinator"),
                            },
                        );
                        Vote::No(reason)
                    }
                };
                Input::Vote { from, vote }
            }
            TxMsg::Decision { commit: true, .. } => {
                if slot
                    .as_ref()
                    .is_some_and(|s| s.state.lock().core.in_doubt())
                {
                    self.crash_point(CrashPoint::ParticipantPhaseTwo, tid).await;
                }
                Input::CommitDecision { from }
            }
            TxMsg::Decision { commit: false, .. } => Input::AbortNotice {
                from,
                status: Status::Aborted,
                reason: "the parent decided abort".into(),
            },
            TxMsg::Ack { .. } => Input::Ack { from },
            TxMsg::Abort { status, reason, .. } => Input::AbortNotice {
                from,
                status,
                reason,
            },
            TxMsg::Outcome { answer, .. } => Input::Answer(answer),
            TxMsg::Inquire { .. } => {
                let answer = match &slot {
                    Some(s) => s.state.lock().core.answer(),
                    None => match self.tombstones.lock().outcome(tid) {
                        Some(Some(Outcome::Committed)) => Answer::Committed,
                        // Presumed abort: no record means abort.
                        _ => Answer::Aborted,
                    },
                };
                self.send(from, TxMsg::Outcome { tid, answer });
                return;
            }
            TxMsg::Enlist { request, .. } => {
                let ok = match &slot {
                    Some(s) if tid.node == self.node => {
                        let inc = self.endpoint.peer_incarnation(from).unwrap_or_default();
                        s.state.lock().core.add_child(from, inc)
                    }
                    _ => false,
                };
                self.send(from, TxMsg::Enlisted { tid, request, ok });
                return;
            }
            TxMsg::Enlisted { request, ok, .. } => {
                if let Some(tx) = self.enlists.lock().remove(&request) {
                    let _ = tx.send(ok);
                }
                return;
            }
            TxMsg::SubEnded {
                path, committed, ..
            } => {
                let _ = self.sub_ended(tid, &path, committed, Some(from));
                return;
            }
        };
        match slot {
            Some(slot) => self.input(&slot, input).await,
            None => {
                let outcome = self.tombstones.lock().outcome(tid);
                let actions = match outcome {
                    Some(o) => late(tid, o, input),
                    None => match input {
                        // Never heard of it: the request never arrived here.
                        Input::Prepare { from, .. } => {
                            self.tombstones.lock().insert(tid, None);
                            vec![Action::Send(
                                from,
                                TxMsg::Vote {
                                    tid,
                                    vote: Vote::ReadOnly,
                                },
                            )]
                        }
                        Input::CommitDecision { from } => {
                            vec![Action::Send(from, TxMsg::Ack { tid })]
                        }
                        Input::AbortNotice { .. } => {
                            // Refuse late calls of this transaction.
                            self.tombstones.lock().insert(tid, Some(Outcome::Aborted));
                            Vec::new()
                        }
                        _ => Vec::new(),
                    },
                };
                for a in actions {
                    if let Action::Send(to, msg) = a {
                        self.send(to, msg);
                    }
                }
            }
        }
    }

    /// At a configured crash point: tell the hook, then never return (the
    /// transaction stops here until the node is killed).
    async fn crash_point(&self, point: CrashPoint, tid: Tid) {
        if let Some((at, hook)) = &self.cfg.crash_at {
            if *at == point {
                tracing::warn!(%tid, ?point, "crash point reached");
                hook(point, tid);
                std::future::pending::<()>().await;
            }
        }
    }

    /// The dependencies a participant's vote may name instead of waiting
    /// for them: `Some` when its resources report undecided dependencies
    /// that all have this transaction's coordinator, none of them refuses,
    /// and the vote goes straight to that coordinator (which orders the
    /// commit records). `None` sends the vote through the barrier.
    fn early_vote(&self, slot: &Slot) -> Option<Vec<Tid>> {
        let tid = slot.tid;
        let voter = {
            let st = slot.state.lock();
            st.core.voter().or(st.core.parent())
        };
        if voter != Some(tid.node) {
            return None;
        }
        let mut after: Vec<Tid> = Vec::new();
        for (r, class) in resources_of(slot) {
            if class == ParticipationClass::NoState {
                continue;
            }
            for d in r.undecided_dependencies(tid).ok()? {
                if !after.contains(&d) {
                    after.push(d);
                }
            }
        }
        let same_coordinator = after
            .iter()
            .all(|d| d.node == tid.node && d.incarnation == tid.incarnation);
        (!after.is_empty() && same_coordinator).then_some(after)
    }

    /// At the coordinator: waits until each of `after` has its commit record
    /// in this node's log, so that `tid`'s own record follows theirs.
    ///
    /// Fails with the reason `tid` must abort: one of them (named) aborted,
    /// or is not known here (presumed aborted).
    async fn committed_here(&self, tid: Tid, after: &[Tid]) -> Result<(), (Tid, String)> {
        for &dep in after {
            loop {
                let Some(slot) = self.slot(dep) else {
                    match self.tombstones.lock().outcome(dep) {
                        Some(Some(Outcome::Committed)) => break,
                        _ => {
                            return Err((dep, format!("{tid} used writes of {dep}, which aborted")))
                        }
                    }
                };
                let notified = slot.decided.notified();
                tokio::pin!(notified);
                notified.as_mut().enable();
                {
                    let st = slot.state.lock();
                    if st.commit_appended || st.outcome == Some(Outcome::Committed) {
                        break;
                    }
                    if st.outcome == Some(Outcome::Aborted) {
                        return Err((dep, format!("{tid} used writes of {dep}, which aborted")));
                    }
                }
                // Decisions notify; the timeout only guards a lost wake-up.
                let _ = tokio::time::timeout(Duration::from_secs(1), notified).await;
            }
        }
        Ok(())
    }

    fn tombstoned(&self, tid: Tid) -> bool {
        self.tombstones.lock().map.contains_key(&tid)
    }

    fn send(&self, to: NodeId, msg: TxMsg) {
        self.counters.messages.fetch_add(1, Ordering::Relaxed);
        if let Err(f) = self.endpoint.send(to, Port::TX, Payload::local(msg)) {
            tracing::debug!(peer = %to, %f, "protocol message not sent");
        }
    }

    async fn enlist_with_coordinator(self: &Arc<Self>, tid: Tid) -> Result<(), Failure> {
        let request = self.enlist_ids.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        self.enlists.lock().insert(request, tx);
        self.endpoint.send(
            tid.node,
            Port::TX,
            Payload::local(TxMsg::Enlist { tid, request }),
        )?;
        let result = tokio::time::timeout(self.cfg.enlist_timeout, rx).await;
        self.enlists.lock().remove(&request);
        match result {
            Ok(Ok(true)) => Ok(()),
            Ok(Ok(false)) => Err(Failure::new(
                Status::Aborted,
                format!("coordinator {} does not run {tid} any more", tid.node),
            )),
            Ok(Err(_)) => Err(Failure::new(Status::Internal, "enlistment abandoned")),
            Err(_) => Err(Failure::new(
                Status::TimedOut,
                format!("coordinator {} did not adopt this node in time", tid.node),
            )),
        }
    }

    fn apply_sub_end(&self, slot: &Arc<Slot>, path: &SubPath, committed: bool) {
        let resources = resources_of(slot);
        if !committed {
            slot.state.lock().core.note_aborted_sub(path.clone());
        }
        for (r, _) in resources {
            r.sub_ended(slot.tid, path, committed);
        }
    }

    fn sub_ended(
        self: &Arc<Self>,
        tid: Tid,
        path: &SubPath,
        committed: bool,
        from: Option<NodeId>,
    ) -> Result<(), Failure> {
        let slot = self.slot(tid).ok_or_else(|| self.unknown(tid))?;
        if !slot.state.lock().core.is_active() {
            return Err(not_active(tid, &slot.state.lock()));
        }
        self.apply_sub_end(&slot, path, committed);
        let children = slot.state.lock().core.children();
        for (child, _) in children {
            if Some(child) != from {
                self.send(
                    child,
                    TxMsg::SubEnded {
                        tid,
                        path: path.clone(),
                        committed,
                    },
                );
            }
        }
        Ok(())
    }

    /// `node` died (its incarnation `gone`, when known): every transaction
    /// born before `born_before` that waits on it gets the news, as its
    /// parent or voter, or as a child called at that incarnation (a child
    /// first called at the node's next incarnation lost nothing).
    fn peer_dead(
        self: &Arc<Self>,
        node: NodeId,
        status: Status,
        gone: Option<Incarnation>,
        born_before: u64,
    ) {
        let died =
            |inc: Incarnation| gone.is_none_or(|g| inc == g || inc == Incarnation::default());
        let slots: Vec<Arc<Slot>> = self
            .txs
            .lock()
            .values()
            .filter(|s| s.born < born_before)
            .cloned()
            .collect();
        for slot in slots {
            let involved = {
                let st = slot.state.lock();
                st.core.parent() == Some(node)
                    || st.core.voter() == Some(node)
                    || st
                        .core
                        .children()
                        .iter()
                        .any(|(n, inc)| *n == node && died(*inc))
            };
            if involved {
                let me = Arc::clone(self);
                tokio::spawn(async move { me.input(&slot, Input::PeerDead(node, status)).await });
            }
        }
    }

    async fn tick_all(self: &Arc<Self>) {
        let now = Instant::now();
        let slots: Vec<Arc<Slot>> = self.txs.lock().values().cloned().collect();
        for slot in slots {
            self.input(&slot, Input::Tick(now)).await;
        }
    }

    /// Ticks every live transaction each `cfg.tick`; while none is live it
    /// sleeps until one appears (checking now and then that the manager
    /// still exists), so an idle node costs no wake-ups here.
    async fn timer_task(weak: Weak<TmInner>, work: Arc<Notify>) {
        let period = match weak.upgrade() {
            Some(i) => i.cfg.tick,
            None => return,
        };
        let mut ticker = tokio::time::interval(period);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            ticker.tick().await;
            let idle = {
                let Some(inner) = weak.upgrade() else { return };
                if inner.endpoint.is_crashed() {
                    return;
                }
                inner.tick_all().await;
                let empty = inner.txs.lock().is_empty();
                empty
            };
            if idle {
                // No strong reference is held while asleep.
                let _ = tokio::time::timeout(Duration::from_secs(5), work.notified()).await;
                ticker.reset();
            }
        }
    }
}

/// Commits the resources enlisted at this node that `which` selects
/// (resources of the one-phase class hear that the transaction ended
/// committed).
async fn commit_resources(slot: &Slot, which: impl Fn(&dyn Resource) -> bool) {
    for (r, class) in resources_of(slot) {
        if !which(r.as_ref()) {
            continue;
        }
        match class {
            ParticipationClass::TwoPhase => r.commit(slot.tid).await,
            ParticipationClass::OnePhase => r.ended(slot.tid, Outcome::Committed).await,
            ParticipationClass::NoState => {}
        }
    }
}

/// Waits until every enlisted resource allows this node's vote (see
/// [`Resource::vote_barrier`]); the first refusal's reason otherwise.
async fn vote_barrier(slot: &Slot) -> Result<(), String> {
    for (r, class) in resources_of(slot) {
        if class != ParticipationClass::NoState {
            r.vote_barrier(slot.tid).await?;
        }
    }
    Ok(())
}

/// Tells the two-phase resources of a branch that aborted here the abort
/// once more (see [`Resource::abort`]: they must undo whatever they hold
/// for it, and hold nothing for one they do not know).
async fn abort_again(slot: &Slot) {
    for (r, class) in resources_of(slot) {
        if class == ParticipationClass::TwoPhase {
            r.abort(slot.tid).await;
        }
    }
}

fn resources_of(slot: &Slot) -> Vec<(Arc<dyn Resource>, ParticipationClass)> {
    slot.state
        .lock()
        .enlisted
        .iter()
        .map(|e| (Arc::clone(&e.resource), e.class))
        .collect()
}

fn local_vote_volatile(st: &SlotState) -> Vote {
    if st
        .enlisted
        .iter()
        .any(|e| e.class == ParticipationClass::OnePhase)
    {
        Vote::Yes { durable: false }
    } else {
        Vote::ReadOnly
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use weft_log::LogConfig;
    use weft_transport::{InprocHub, Seed, TransportConfig};

    async fn node(
        id: u32,
        hub: &Arc<InprocHub>,
        dir: &std::path::Path,
    ) -> (Endpoint, Option<TxManager>) {
        node_with(id, hub, dir, TmConfig::default()).await
    }

    async fn node_with(
        id: u32,
        hub: &Arc<InprocHub>,
        dir: &std::path::Path,
        tm_cfg: TmConfig,
    ) -> (Endpoint, Option<TxManager>) {
        let cfg = TransportConfig {
            hub: Some(hub.clone()),
            ..TransportConfig::node(NodeId(id), Incarnation(1))
        };
        let endpoint = Endpoint::start(cfg).await.expect("endpoint");
        if id != 1 {
            endpoint.join(Seed::Inproc(NodeId(1))).await.expect("join");
            return (endpoint, None);
        }
        let cfg = LogConfig::new(dir.join(format!("log-{id}"))).preallocate(false);
        let (log, _) = Log::open(cfg).expect("log");
        let tm = TxManager::start(endpoint.clone(), log, tm_cfg);
        (endpoint, Some(tm))
    }

    /// Whether the transaction still takes calls (an aborted one refuses).
    fn active(tm: &TxManager, ctx: &TxContext) -> bool {
        tm.on_call_out(ctx, NodeId(3)).is_ok()
    }

    async fn settle() {
        for _ in 0..50 {
            tokio::task::yield_now().await;
        }
    }

    #[tokio::test]
    async fn a_death_concerns_the_incarnation_and_the_transactions_it_was_announced_to() {
        let dir = tempfile::tempdir().expect("temporary directory");
        let hub = InprocHub::new();
        let (_e1, tm) = node(1, &hub, dir.path()).await;
        let tm = tm.expect("node 1 has a transaction manager");
        let (_e2, _) = node(2, &hub, dir.path()).await;
        assert_eq!(
            tm.endpoint().peer_incarnation(NodeId(2)),
            Some(Incarnation(1))
        );

        // Both call node 2 at its incarnation 1.
        let older = tm.begin(None);
        tm.on_call_out(&older, NodeId(2)).expect("active");
        let announced_at = tm.inner.slots_made.load(Ordering::Acquire);
        let newer = tm.begin(None);
        tm.on_call_out(&newer, NodeId(2)).expect("active");

        // Another incarnation's death concerns neither.
        tm.inner
            .peer_dead(NodeId(2), Status::ProcDead, Some(Incarnation(7)), u64::MAX);
        settle().await;
        assert!(active(&tm, &older) && active(&tm, &newer));

        // Incarnation 1's death, announced between the two, ends only the
        // transaction that existed when it was announced.
        tm.inner.peer_dead(
            NodeId(2),
            Status::ProcDead,
            Some(Incarnation(1)),
            announced_at,
        );
        settle().await;
        assert!(!active(&tm, &older), "it used the node that died");
        assert!(active(&tm, &newer), "it began after the announcement");

        // Without an incarnation, a death concerns every child at the node.
        tm.inner
            .peer_dead(NodeId(2), Status::HostDead, None, u64::MAX);
        settle().await;
        assert!(!active(&tm, &newer));
    }

    /// Runs `commit(tid)` on a thread of its own and waits for its answer
    /// (generously): a commit that deadlocks inside the manager fails the
    /// test instead of freezing it.
    fn commit_answer(tm: &TxManager, tid: Tid) -> Result<(), Failure> {
        let (tx, rx) = std::sync::mpsc::channel();
        let tm = tm.clone();
        std::thread::spawn(move || {
            let _ = tx.send(futures::executor::block_on(tm.commit(tid)));
        });
        rx.recv_timeout(Duration::from_secs(60))
            .expect("commit answered (a deadlock in the manager never answers)")
    }

    #[tokio::test]
    async fn commit_of_an_unknown_or_forgotten_transaction_answers_no_such_transaction() {
        let dir = tempfile::tempdir().expect("temporary directory");
        let hub = InprocHub::new();
        let cfg = TmConfig {
            tombstones: 1,
            ..TmConfig::default()
        };
        let (_e1, tm) = node_with(1, &hub, dir.path(), cfg).await;
        let tm = tm.expect("node 1 has a transaction manager");

        // A Tid of this node's own incarnation that was never begun.
        let never = Tid::new(NodeId(1), Incarnation(1), 5);
        let err = commit_answer(&tm, never).unwrap_err();
        assert_eq!(err.status, Status::NoSuchTransaction, "{err}");

        // A late commit of a transaction whose outcome was evicted from the
        // remembered outcomes (one is kept).
        let first = tm.begin(None).tid;
        tm.abort(first, "test").await.expect("aborted");
        let second = tm.begin(None).tid;
        tm.abort(second, "test").await.expect("aborted");
        assert_eq!(tm.finished_outcome(first), None, "evicted");
        let err = commit_answer(&tm, first).unwrap_err();
        assert_eq!(err.status, Status::NoSuchTransaction, "{err}");
        // The remembered one still reports its abort.
        let err = commit_answer(&tm, second).unwrap_err();
        assert_eq!(err.status, Status::Aborted, "{err}");

        // The node still works.
        let ctx = tm.begin(None);
        commit_answer(&tm, ctx.tid).expect("an empty transaction commits");
    }

    /// A two-phase resource that holds something for each branch it saw
    /// (what a lock table or controlled lock violation keeps) until it
    /// hears the outcome; its prepare may wait on a gate.
    #[derive(Default)]
    struct Holding {
        held: parking_lot::Mutex<std::collections::BTreeSet<Tid>>,
        gate: Option<(Notify, Notify)>,
    }

    impl Holding {
        fn gated() -> Holding {
            Holding {
                gate: Some((Notify::new(), Notify::new())),
                ..Holding::default()
            }
        }

        /// What a call does: locks something for `tid`.
        fn touch(&self, tid: Tid) {
            self.held.lock().insert(tid);
        }

        fn holds(&self, tid: Tid) -> bool {
            self.held.lock().contains(&tid)
        }
    }

    impl Resource for Holding {
        fn name(&self) -> &str {
            "holding"
        }

        fn class(&self) -> ParticipationClass {
            ParticipationClass::TwoPhase
        }

        fn prepare<'a>(&'a self, tid: Tid, _log: &'a Log) -> futures::future::BoxFuture<'a, Vote> {
            Box::pin(async move {
                if let Some((entered, open)) = &self.gate {
                    entered.notify_one();
                    open.notified().await;
                }
                // Prepared: its writes stay registered until the outcome.
                self.touch(tid);
                Vote::Yes { durable: true }
            })
        }

        fn commit(&self, tid: Tid) -> futures::future::BoxFuture<'_, ()> {
            self.held.lock().remove(&tid);
            Box::pin(async {})
        }

        fn abort(&self, tid: Tid) -> futures::future::BoxFuture<'_, ()> {
            self.held.lock().remove(&tid);
            Box::pin(async {})
        }

        fn held(&self) -> Vec<(Tid, String)> {
            self.held
                .lock()
                .iter()
                .map(|t| (*t, "something".to_string()))
                .collect()
        }
    }

    /// Polls `cond` (generously bounded): a spawned follow-up must run.
    async fn eventually(what: &str, cond: impl Fn() -> bool) {
        for _ in 0..10_000 {
            if cond() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        panic!("never: {what}");
    }

    /// Issue 16 item 11: a call still running when its transaction aborted
    /// here (a lock granted after the abort released everything) must not
    /// leave what it took behind: the resources hear the abort again when
    /// it ends, and meanwhile the leftover is listed as orphaned.
    #[tokio::test]
    async fn what_a_call_running_at_the_abort_took_is_undone_when_it_ends() {
        let dir = tempfile::tempdir().expect("temporary directory");
        let hub = InprocHub::new();
        let (e1, tm) = node(1, &hub, dir.path()).await;
        let tm = tm.expect("node 1 has a transaction manager");
        let res = Arc::new(Holding::default());
        tm.register_resource(res.clone());
        let ctx = tm.begin(None);
        let from = PeerRef {
            node: NodeId(1),
            incarnation: e1.incarnation(),
            role: PeerRole::Node,
            link: 0,
            channel: weft_transport::ChannelKind::Inproc,
        };
        let call = tm
            .on_call_in(
                &ctx,
                from,
                Some((res.clone(), ParticipationClass::TwoPhase)),
            )
            .await
            .expect("joined");
        tm.abort(ctx.tid, "test").await.expect("aborted");
        assert!(call.aborted());
        // The call goes on and takes a lock after the abort was applied.
        res.touch(ctx.tid);
        let orphans = tm.list();
        assert_eq!(orphans.len(), 1, "{orphans:?}");
        assert_eq!(orphans[0].tid, ctx.tid);
        assert_eq!(orphans[0].phase, "orphaned");
        assert_eq!(orphans[0].resources, vec!["holding: something".to_string()]);
        drop(call);
        eventually("the leftover is undone", || !res.holds(ctx.tid)).await;
        assert!(tm.orphans().is_empty());
    }

    /// Issue 16 item 11: a local prepare that overlapped the abort (the
    /// abort arrived while the resources prepared) must not leave the
    /// branch prepared, registered in violation mode, forever.
    #[tokio::test]
    async fn a_prepare_overlapping_the_abort_leaves_nothing_behind() {
        let dir = tempfile::tempdir().expect("temporary directory");
        let hub = InprocHub::new();
        let (_e1, tm) = node(1, &hub, dir.path()).await;
        let tm = tm.expect("node 1 has a transaction manager");
        let res = Arc::new(Holding::gated());
        tm.register_resource(res.clone());
        let ctx = tm.begin(None);
        tm.enlist(ctx.tid, res.clone()).expect("enlisted");
        let committing = tokio::spawn({
            let tm = tm.clone();
            async move { tm.commit(ctx.tid).await }
        });
        let (entered, open) = res.gate.as_ref().expect("gated");
        entered.notified().await;
        tm.abort(ctx.tid, "test").await.expect("aborted");
        open.notify_one();
        let err = committing.await.expect("joined").unwrap_err();
        assert_eq!(err.status, Status::Aborted, "{err}");
        eventually("the prepared branch is undone", || !res.holds(ctx.tid)).await;
        assert!(tm.list().is_empty(), "{:?}", tm.list());
    }

    /// Collects the protocol messages a node without a transaction manager
    /// receives.
    #[derive(Default)]
    struct Capture(parking_lot::Mutex<Vec<TxMsg>>);

    impl PortHandler for Capture {
        fn on_message(&self, _from: PeerRef, payload: Payload) {
            if let Ok(m) = payload.decode::<TxMsg>() {
                self.0.lock().push(m);
            }
        }
    }

    /// Issue 16 item 10: a participant whose vote names a transaction that
    /// aborted at the coordinator has evidently not heard of that abort
    /// (meanwhile its items stay in violation mode and doom whoever uses
    /// them). The coordinator tells it, along with the abort of the voter.
    #[tokio::test]
    async fn a_vote_naming_an_aborted_transaction_brings_its_voter_both_aborts() {
        let dir = tempfile::tempdir().expect("temporary directory");
        let hub = InprocHub::new();
        let (_e1, tm) = node(1, &hub, dir.path()).await;
        let tm = tm.expect("node 1 has a transaction manager");
        let (e2, _) = node(2, &hub, dir.path()).await;
        let seen = Arc::new(Capture::default());
        e2.set_port_handler(Port::TX, seen.clone());

        let writer = tm.begin(None).tid;
        tm.abort(writer, "test").await.expect("aborted");
        let ctx = tm.begin(None);
        tm.on_call_out(&ctx, NodeId(2)).expect("active");
        let committing = tokio::spawn({
            let tm = tm.clone();
            async move { tm.commit(ctx.tid).await }
        });
        eventually("node 2 is asked to prepare", || {
            seen.0
                .lock()
                .iter()
                .any(|m| matches!(m, TxMsg::Prepare { .. }))
        })
        .await;
        e2.send(
            NodeId(1),
            Port::TX,
            Payload::local(TxMsg::VoteAfter {
                tid: ctx.tid,
                vote: Vote::Yes { durable: true },
                after: vec![writer],
            }),
        )
        .expect("sent");
        let err = committing.await.expect("joined").unwrap_err();
        assert_eq!(err.status, Status::Aborted, "{err}");
        let aborted = |t: Tid| {
            let seen = seen.clone();
            move || {
                seen.0
                    .lock()
                    .iter()
                    .any(|m| matches!(m, TxMsg::Abort { tid, .. } if *tid == t))
            }
        };
        eventually("node 2 hears the writer's abort", aborted(writer)).await;
        eventually("node 2 hears its own transaction's abort", aborted(ctx.tid)).await;
    }
}
