//! The transaction manager of one node: the driver of the node's
//! transaction core ([`crate::node::TmCore`]) with real I/O: the node's log,
//! the transport, the local resources, timers and the callers who wait.
//!
//! Owns the wiring: the core behind one lock, the waiting callers (commit
//! waiters, calls waiting to be adopted), force intents, the timer task and
//! the hooks the RPC layer calls on every outgoing and incoming call. Must
//! never decide anything itself: every protocol decision (what to answer,
//! when to vote, what to force, what a peer's death means, when a
//! transaction is forgotten) is the core's; this module performs the
//! core's actions in order, in one flat loop per event, and feeds their
//! results back as events. It never holds the core's lock while doing I/O
//! or running a resource.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use parking_lot::{Mutex, RwLock};
use tokio::sync::{oneshot, Notify};
use tracing::Instrument;
use weft_log::{ForceIntent, Log};
use weft_transport::{Endpoint, MembershipEvent, PeerRef, PortHandler};
use weft_wire::{
    Baggage, Failure, NodeId, Payload, PeerRole, Port, Status, SubPath, Tid, TxContext, TxReturn,
};

use crate::core::CoreConfig;
use crate::msg::{Outcome, TxMsg, TM_RECORD_TAG};
use crate::node::{self, Action, CallId, CallIn, Event, NodeConfig, ResourceRef, TmCore, WaiterId};
use crate::resource::{ParticipationClass, Resource};

pub use crate::node::{CrashPoint, Recovered, RecoveryReport, TmStats, TxStatus};

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
    /// Finished transactions remembered to answer late messages (at most).
    pub tombstones: usize,
    /// How long a finished transaction is remembered past the later of its
    /// end and its deadline (see [`crate::node`] for why forgetting it then
    /// is safe).
    pub tombstone_retention: Duration,
    /// Live transactions at this node (at most): beyond it `begin` gives a
    /// transaction born aborted with NoBuffer, and calls that would join
    /// one more fail with NoBuffer.
    pub max_live: usize,
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
    /// One-phase delegation: a coordinator whose own resources hold nothing
    /// durable and that called exactly one other node hands that node the
    /// decision (it forces its commit record instead of a prepare record;
    /// one force per transaction instead of two), when all of that node's
    /// resources allow it ([`Resource::may_decide_alone`]). The
    /// coordinator is then in doubt until the decision arrives: if that
    /// node dies, its commit waits for its recovery. Off by default.
    pub delegate_commit: bool,
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
            .field("tombstone_retention", &self.tombstone_retention)
            .field("max_live", &self.max_live)
            .field("enlist_timeout", &self.enlist_timeout)
            .field("early_lock_release", &self.early_lock_release)
            .field("delegate_commit", &self.delegate_commit)
            .field("crash_at", &self.crash_at.as_ref().map(|(p, _)| p))
            .finish()
    }
}

impl Default for TmConfig {
    fn default() -> Self {
        let node = NodeConfig::default();
        TmConfig {
            core: node.core,
            default_timeout: node.default_timeout,
            tick: Duration::from_millis(20),
            tombstones: node.tombstones,
            tombstone_retention: node.tombstone_retention,
            max_live: node.max_live,
            enlist_timeout: node.enlist_timeout,
            early_lock_release: node.early_lock_release,
            delegate_commit: node.delegate_commit,
            crash_at: None,
        }
    }
}

impl TmConfig {
    /// The core's part of the configuration.
    pub fn node_config(&self) -> NodeConfig {
        NodeConfig {
            core: self.core,
            default_timeout: self.default_timeout,
            tombstones: self.tombstones.max(1),
            tombstone_retention: self.tombstone_retention,
            max_live: self.max_live.max(1),
            enlist_timeout: self.enlist_timeout,
            early_lock_release: self.early_lock_release,
            delegate_commit: self.delegate_commit,
        }
    }
}

/// A resource as enlisted in a transaction: the object and the class it
/// takes part in (a service may register a resource under its own class).
#[derive(Clone)]
pub struct Enlisted {
    resource: Arc<dyn Resource>,
    class: ParticipationClass,
    /// Asked once, at enlistment: the core consults it under its lock,
    /// where no resource code may run.
    commits_from_this_log: bool,
    may_decide_alone: bool,
}

impl std::fmt::Debug for Enlisted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}({})", self.resource.name(), self.class)
    }
}

impl ResourceRef for Enlisted {
    fn name(&self) -> String {
        self.resource.name().to_string()
    }
    fn class(&self) -> ParticipationClass {
        self.class
    }
    fn commits_from_this_log(&self) -> bool {
        self.commits_from_this_log
    }
    fn may_decide_alone(&self) -> bool {
        self.may_decide_alone
    }
    fn same(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.resource, &other.resource)
    }
}

fn handle(resource: Arc<dyn Resource>, class: ParticipationClass) -> Enlisted {
    let commits_from_this_log = resource.commits_from_this_log();
    let may_decide_alone = resource.may_decide_alone();
    Enlisted {
        resource,
        class,
        commits_from_this_log,
        may_decide_alone,
    }
}

type Core = TmCore<Enlisted>;
type Act = Action<Enlisted>;

struct TmInner {
    node: NodeId,
    incarnation: weft_wire::Incarnation,
    endpoint: Endpoint,
    log: Log,
    cfg: TmConfig,
    core: Mutex<Core>,
    resources: RwLock<Vec<Arc<dyn Resource>>>,
    waiters: Mutex<HashMap<u64, oneshot::Sender<Result<(), Failure>>>>,
    admits: Mutex<HashMap<u64, oneshot::Sender<Result<(), Failure>>>>,
    ids: AtomicU64,
    intents: Mutex<HashMap<Tid, ForceIntent>>,
    /// Wakes the timer when a transaction appears (it sleeps while none is
    /// live, so an idle node does not tick).
    work: Arc<Notify>,
    /// Trace contexts of the transactions traced here (docs/tracing.md).
    #[cfg(feature = "otel")]
    traces: crate::otel::Traces,
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
    call: Option<(Arc<TmInner>, Tid)>,
    /// The transaction's baggage here when the call joined, if it was
    /// exactly what the call brought ([`TmCore::baggage_mark`]).
    baggage_mark: Option<u64>,
}

impl CallGuard {
    /// True when the transaction aborted while the call ran.
    pub fn aborted(&self) -> bool {
        self.call
            .as_ref()
            .is_some_and(|(inner, tid)| inner.core.lock().is_aborted(*tid))
    }

    /// Ends the call and answers what its response carries back about the
    /// transaction, read under the lock that ends the call (one look at the
    /// core, where reading them and then dropping the guard took three):
    /// whether the transaction aborted while the call ran, and its baggage
    /// here, or none when that is still exactly what the request brought
    /// (the caller has it: the common call does not carry the baggage back,
    /// decode it and merge it again for nothing).
    pub fn finish(mut self) -> TxReturn {
        let Some((inner, tid)) = self.call.take() else {
            return TxReturn::default();
        };
        let (ret, actions) = {
            let mut core = inner.core.lock();
            let ret = TxReturn {
                baggage: core.baggage_since(tid, self.baggage_mark),
                aborted: core.is_aborted(tid),
            };
            (ret, core.step(Instant::now(), Event::CallDone { tid }))
        };
        if !actions.is_empty() {
            inner.spawn_drive(actions);
        }
        ret
    }
}

impl Drop for CallGuard {
    fn drop(&mut self) {
        if let Some((inner, tid)) = self.call.take() {
            // The core decides what the end of the call means: a prepare
            // that waited for it goes on; a branch that aborted while it
            // ran has its resources told again.
            let actions = inner.step(Event::CallDone { tid });
            if !actions.is_empty() {
                inner.spawn_drive(actions);
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
            Ok(msg) => {
                // A participant's prepare and outcome work is a span of the
                // transaction's trace when it is traced (docs/tracing.md).
                #[cfg(feature = "otel")]
                if let Some(span) = inner.traces.on_receive(inner.node, &msg) {
                    let tid = msg.tid();
                    let event = Event::Msg {
                        from: from.node,
                        from_incarnation: from.incarnation,
                        msg,
                    };
                    tokio::spawn(
                        async move {
                            inner.feed(event).await;
                            // A Prepare for a transaction not live here (a
                            // late one, a lost branch) leaves no context.
                            if !inner.core.lock().is_live(tid) {
                                inner.traces.forget(tid);
                            }
                        }
                        .instrument(span),
                    );
                    return;
                }
                // Protocol steps may await resources; never block the inbox.
                let event = Event::Msg {
                    from: from.node,
                    from_incarnation: from.incarnation,
                    msg,
                };
                tokio::spawn(async move { inner.feed(event).await });
            }
            Err(e) => tracing::warn!(peer = %from.node, "undecodable transaction message: {e}"),
        }
    }

    fn inline(&self, _channel: weft_transport::ChannelKind) -> bool {
        true // decodes and spawns: nothing that could block a sender
    }
}

impl TxManager {
    /// Starts the transaction manager of the node behind `endpoint`, logging
    /// to `log`. Registers the transaction port and the membership listener
    /// and starts the timer task. Call [`TxManager::recover`] before taking
    /// work when the log holds records.
    pub fn start(endpoint: Endpoint, log: Log, cfg: TmConfig) -> TxManager {
        let core = TmCore::new(
            endpoint.node_id(),
            endpoint.incarnation(),
            cfg.node_config(),
            Instant::now(),
        );
        let inner = Arc::new(TmInner {
            node: endpoint.node_id(),
            incarnation: endpoint.incarnation(),
            endpoint: endpoint.clone(),
            log,
            core: Mutex::new(core),
            resources: RwLock::new(Vec::new()),
            waiters: Mutex::new(HashMap::new()),
            admits: Mutex::new(HashMap::new()),
            ids: AtomicU64::new(1),
            intents: Mutex::new(HashMap::new()),
            work: Arc::new(Notify::new()),
            #[cfg(feature = "otel")]
            traces: crate::otel::Traces::default(),
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
                // The news concerns the transactions that exist now (the
                // core filters by birth and incarnation); listeners must not
                // block, so a task carries it.
                let born_before = Some(inner.core.lock().births());
                let event = Event::PeerDead {
                    node,
                    status,
                    incarnation: gone,
                    born_before,
                };
                tokio::spawn(async move { inner.feed(event).await });
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
        let h = handle(resource.clone(), resource.class());
        self.inner.core.lock().register_resource(h);
        self.inner.resources.write().push(resource);
    }

    /// Begins a transaction coordinated by this node. `timeout` bounds its
    /// life (the configured default when `None`); past it, it aborts.
    ///
    /// Never fails: beyond [`TmConfig::max_live`] live transactions the
    /// transaction is born aborted, and its calls and commit fail with
    /// NoBuffer (see [`TxManager::try_begin`] to learn it at once).
    pub fn begin(&self, timeout: Option<Duration>) -> TxContext {
        match self.try_begin(timeout) {
            Ok(ctx) => ctx,
            Err((ctx, failure)) => {
                tracing::warn!(tid = %ctx.tid, "{failure}");
                ctx
            }
        }
    }

    /// [`TxManager::begin`], failing with NoBuffer (and the context of the
    /// transaction born aborted) at the live limit.
    #[allow(clippy::result_large_err)]
    pub fn try_begin(&self, timeout: Option<Duration>) -> Result<TxContext, (TxContext, Failure)> {
        let inner = &self.inner;
        let timeout = timeout.unwrap_or(inner.cfg.default_timeout);
        let begun = inner.core.lock().begin(Instant::now(), Some(timeout));
        let ctx = |tid| TxContext {
            tid,
            path: SubPath::top(),
            budget_us: Some(timeout.as_micros().min(u64::MAX as u128) as u64),
            baggage: Baggage::default(),
        };
        match begun {
            Ok(tid) => {
                inner.work.notify_one();
                tracing::debug!(%tid, "begin");
                Ok(ctx(tid))
            }
            Err(refused) => Err((ctx(refused.tid), refused.failure)),
        }
    }

    /// Records that this node is about to call `to` on behalf of the
    /// transaction in `ctx`: `to` becomes a child in the participant tree.
    ///
    /// Fails with Aborted when the transaction is no longer active here
    /// (aborted, committing) and NoSuchTransaction when it is unknown here.
    pub fn on_call_out(&self, ctx: &TxContext, to: NodeId) -> Result<(), Failure> {
        let inner = &self.inner;
        let incarnation = inner.endpoint.peer_incarnation(to).unwrap_or_default();
        inner.core.lock().call_out(ctx.tid, to, incarnation)
    }

    /// [`TxManager::on_call_out`] and what the call then carries, under one
    /// look at the transaction (one lock, no clone of the context's own
    /// baggage): `to` becomes a child, and the answer is the context to send
    /// (`ctx`'s transaction and path, the baggage merged here, the budget
    /// left at `now` until the deadline known here, else `ctx`'s budget)
    /// with that deadline.
    ///
    /// Fails like [`TxManager::on_call_out`].
    pub fn call_out_context(
        &self,
        ctx: &TxContext,
        to: NodeId,
        now: Instant,
    ) -> Result<(TxContext, Option<Instant>), Failure> {
        let inner = &self.inner;
        let incarnation = inner.endpoint.peer_incarnation(to).unwrap_or_default();
        let (deadline, baggage) = {
            let mut core = inner.core.lock();
            core.call_out(ctx.tid, to, incarnation)?;
            (core.deadline(ctx.tid), core.baggage(ctx.tid))
        };
        let budget_us = match deadline {
            Some(d) => Some(
                d.saturating_duration_since(now)
                    .as_micros()
                    .min(u64::MAX as u128) as u64,
            ),
            None => ctx.budget_us,
        };
        let out = TxContext {
            tid: ctx.tid,
            path: ctx.path.clone(),
            budget_us,
            baggage: baggage.unwrap_or_else(|| ctx.baggage.clone()),
        };
        Ok((out, deadline))
    }

    /// Records that a call on behalf of `ctx` arrived from `from` for a
    /// service (or resource) of class `class`: this node joins the
    /// transaction (becoming the caller's child) if it had not, the resource
    /// is enlisted, and the returned guard marks the call as running.
    ///
    /// Fails with Aborted when the transaction already ended here (a late
    /// request) or a call to the coordinator names a transaction it does
    /// not run (NoSuchTransaction when it never did), NoBuffer at the live
    /// limit, and TimedOut/Aborted when a client brought the transaction and
    /// its coordinator does not adopt this node in time (or refuses).
    pub async fn on_call_in(
        &self,
        ctx: &TxContext,
        from: PeerRef,
        resource: Option<(Arc<dyn Resource>, ParticipationClass)>,
    ) -> Result<CallGuard, Failure> {
        let inner = &self.inner;
        let call = inner.ids.fetch_add(1, Ordering::Relaxed);
        let mut out = Vec::new();
        // Resource code runs before the core's lock is taken, never under it.
        let resource = resource.map(|(r, class)| handle(r, class));
        let joined = {
            let mut core = inner.core.lock();
            let was_live = core.live();
            let joined = core.call_in(
                Instant::now(),
                ctx,
                from.node,
                from.role == PeerRole::Node,
                resource,
                CallId(call),
                &mut out,
            );
            // Only a call that must wait for its adoption has an answer to
            // wait for; its waiter is in place before the core's lock is let
            // go, so no answer can come first (the common call, joining at
            // once, costs no channel and no table entry).
            let joined = joined.map(|j| {
                let rx = (j == CallIn::Enlisting).then(|| {
                    let (tx, rx) = oneshot::channel();
                    inner.admits.lock().insert(call, tx);
                    rx
                });
                let new_here = rx.is_some() || core.live() != was_live;
                // An adopted call's baggage is merged later: it gets all of
                // it back.
                let mark = match j {
                    CallIn::Joined => core.baggage_mark(ctx.tid, &ctx.baggage),
                    CallIn::Enlisting => None,
                };
                (rx, new_here, mark)
            });
            joined
        };
        let (rx, new_here, baggage_mark) = joined?;
        if new_here {
            // A transaction (or an adoption awaited) appeared here: the
            // timer, which sleeps while there is none, must tick.
            inner.work.notify_one();
        }
        if !out.is_empty() {
            inner.drive(out).await;
        }
        if let Some(rx) = rx {
            match rx.await {
                Ok(Ok(())) => {}
                Ok(Err(f)) => return Err(f),
                Err(_) => return Err(Failure::new(Status::Internal, "enlistment abandoned")),
            }
        }
        Ok(CallGuard {
            call: Some((Arc::clone(inner), ctx.tid)),
            baggage_mark,
        })
    }

    /// Enlists a resource in a transaction active at this node (explicit
    /// enlistment, e.g. a PostgreSQL connection).
    ///
    /// Fails with NoSuchTransaction when unknown here, Aborted when no longer
    /// active.
    pub fn enlist(&self, tid: Tid, resource: Arc<dyn Resource>) -> Result<(), Failure> {
        let h = handle(resource.clone(), resource.class());
        self.inner.core.lock().enlist(tid, h)
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
    /// deadline, NoBuffer when it was begun beyond the live limit, Aborted
    /// for a No vote or an abort by any participant; InDoubt when the
    /// commit record could not be forced (the log failed).
    pub async fn commit(&self, tid: Tid) -> Result<(), Failure> {
        let started = Instant::now();
        let result = self.commit_inner(tid).await;
        if result.is_ok() {
            COMMIT_DURATION.record(started.elapsed().as_secs_f64());
        }
        result
    }

    async fn commit_inner(&self, tid: Tid) -> Result<(), Failure> {
        let inner = &self.inner;
        let waiter = inner.ids.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        inner.waiters.lock().insert(waiter, tx);
        let mut out = Vec::new();
        let now = inner
            .core
            .lock()
            .commit(Instant::now(), tid, WaiterId(waiter), &mut out);
        if let Some(result) = now {
            inner.waiters.lock().remove(&waiter);
            return result;
        }
        let span = tracing::debug_span!("commit", %tid);
        #[cfg(feature = "otel")]
        inner.traces.commit(&span, tid);
        inner.drive(out).instrument(span).await;
        match rx.await {
            Ok(result) => result,
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
        let mut out = Vec::new();
        self.inner.core.lock().abort(tid, reason, &mut out)?;
        self.inner.drive(out).await;
        Ok(())
    }

    /// Starts a sub-transaction of the (sub-)transaction in `ctx`; returns
    /// its context. Calls made with it run in the sub-transaction.
    ///
    /// Fails with NoSuchTransaction / Aborted when the transaction is not
    /// active here.
    pub fn sub_begin(&self, ctx: &TxContext) -> Result<TxContext, Failure> {
        self.inner.core.lock().sub_begin(ctx)
    }

    /// Ends a sub-transaction: committed into its parent (its effects and
    /// locks pass to the parent) or aborted (its effects are undone, the
    /// parent goes on). Every node the sub-transaction reached is told.
    ///
    /// Fails with NoSuchTransaction / Aborted when the transaction is not
    /// active here, BadRequest for the top-level path.
    pub fn sub_end(&self, tid: Tid, path: &SubPath, committed: bool) -> Result<(), Failure> {
        let mut out = Vec::new();
        self.inner
            .core
            .lock()
            .sub_end(tid, path, committed, None, &mut out)?;
        // The resources apply it before this returns (the caller's next
        // statement may depend on it); anything that must wait runs later.
        let mut later = Vec::new();
        for action in out {
            match action {
                Action::ResourceSubEnded {
                    tid,
                    resource,
                    path,
                    committed,
                } => resource.resource.sub_ended(tid, &path, committed),
                Action::Send { to, msg } => {
                    if let Some(event) = self.inner.send(to, msg) {
                        later.extend(self.inner.step(event));
                    }
                }
                other => later.push(other),
            }
        }
        self.inner.spawn_drive(later);
        Ok(())
    }

    /// The deadline of `tid` as this node knows it (`None` when unknown here
    /// or without one).
    pub fn deadline(&self, tid: Tid) -> Option<Instant> {
        self.inner.core.lock().deadline(tid)
    }

    /// The baggage merged at this node for `tid`.
    pub fn baggage(&self, tid: Tid) -> Option<Baggage> {
        self.inner.core.lock().baggage(tid)
    }

    /// Merges baggage returned by a call into the transaction's baggage.
    pub fn merge_baggage(&self, tid: Tid, baggage: &Baggage) {
        self.inner.core.lock().merge_baggage(tid, baggage)
    }

    /// The status of a transaction at this node.
    pub fn status(&self, tid: Tid) -> Option<TxStatus> {
        let mut core = self.inner.core.lock();
        core.set_now(Instant::now());
        core.status(tid)
    }

    /// The outcome remembered for a finished transaction (`Some(None)` for a
    /// read-only branch), or `None` when it is live or unknown.
    pub fn finished_outcome(&self, tid: Tid) -> Option<Option<Outcome>> {
        self.inner.core.lock().finished_outcome(tid)
    }

    /// Every transaction live at this node, oldest first, then the
    /// orphaned ones (see [`TxManager::orphans`]).
    pub fn list(&self) -> Vec<TxStatus> {
        let mut v = {
            let mut core = self.inner.core.lock();
            core.set_now(Instant::now());
            core.list()
        };
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
        let core = self.inner.core.lock();
        held.into_iter()
            .filter(|(tid, _)| !core.is_live(*tid))
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
        self.inner.core.lock().stats()
    }

    /// The size of the transaction manager's bookkeeping (live
    /// transactions, tombstones...) and what its limits refused.
    pub fn bookkeeping(&self) -> node::Bookkeeping {
        self.inner.core.lock().bookkeeping()
    }

    /// What recovery found about `tid` (resources ask this while redoing).
    pub fn recovered(&self, tid: Tid) -> Option<Recovered> {
        self.inner.core.lock().recovered(tid)
    }

    /// The lowest log position the transaction manager still needs: the
    /// first record of the oldest transaction that has written one and is
    /// not finished. `None` when no live transaction needs the log (any
    /// prefix may be truncated as far as the transaction manager goes).
    pub fn low_water(&self) -> Option<weft_log::Lsn> {
        self.inner.core.lock().low_water()
    }

    /// Replays the transaction manager's records from the log: re-drives
    /// phase two of committed transactions that did not end, and puts
    /// prepared transactions without an outcome in doubt (they ask their
    /// parent, with backoff, until they learn it). Every registered resource
    /// is enlisted in those transactions.
    pub fn recover(&self, records: &[weft_log::LogRecord]) -> RecoveryReport {
        let (decoded, undecodable) = node::decode_records(records);
        for lsn in undecodable {
            // The log's checksum passed, so this is a bug, not damage.
            tracing::error!(%lsn, "undecodable transaction record");
        }
        let report = {
            let mut core = self.inner.core.lock();
            core.set_now(Instant::now());
            core.recover(node::scan(decoded))
        };
        self.inner.work.notify_one();
        if !report.redriven.is_empty() || !report.in_doubt.is_empty() {
            tracing::info!(
                redriven = report.redriven.len(),
                in_doubt = report.in_doubt.len(),
                "transaction manager recovered"
            );
        }
        report
    }

    /// Feeds a tick now (tests use it to avoid waiting for the timer).
    pub async fn tick(&self) {
        self.inner.feed(Event::Tick).await;
    }
}

/// `weft_tx_commit_duration_seconds` (docs/metrics.md), recorded at every
/// successful commit: a kept handle, so a commit hashes and looks up no key.
static COMMIT_DURATION: weft_transport::metrics::FixedHistogram =
    weft_transport::metrics::FixedHistogram::new("weft_tx_commit_duration_seconds");

/// Counts an abort this node decided as coordinator in the metrics registry
/// by cause (`weft_tx_aborted_total{cause}`, docs/metrics.md). Commits are
/// not counted here: the exporter reads them from [`TmStats`] at each
/// scrape, which keeps the commit path free of registry lookups. A no-op
/// when no metrics recorder is installed.
fn count_decided(outcome: Option<Outcome>, cause: Option<Status>) {
    if outcome == Some(Outcome::Aborted) {
        let cause = cause.unwrap_or(Status::Aborted).name();
        metrics::counter!("weft_tx_aborted_total", "cause" => cause).increment(1);
    }
}

impl TmInner {
    /// Steps the core with one event, now.
    fn step(&self, event: Event) -> Vec<Act> {
        self.core.lock().step(Instant::now(), event)
    }

    /// Steps the core with one event and carries out what it says.
    async fn feed(self: &Arc<Self>, event: Event) {
        let actions = self.step(event);
        self.drive(actions).await;
    }

    fn spawn_drive(self: &Arc<Self>, actions: Vec<Act>) {
        if actions.is_empty() {
            return;
        }
        let me = Arc::clone(self);
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => {
                rt.spawn(async move { me.drive(actions).await });
            }
            Err(_) => futures::executor::block_on(me.drive(actions)),
        }
    }

    /// The flat driver loop: performs the actions in order; the results of
    /// those that answer at once are stepped into the core and their
    /// actions run next (before the rest); those that wait (forces,
    /// prepares and barriers not last in the batch) run in a task that
    /// feeds its result back through a loop of its own.
    async fn drive(self: &Arc<Self>, actions: Vec<Act>) {
        let mut queue: VecDeque<Act> = actions.into();
        while let Some(action) = queue.pop_front() {
            let last = queue.is_empty();
            let result = match action {
                Action::Send { to, msg } => self.send(to, msg),
                Action::Append { record, token } => {
                    let appended = postcard::to_allocvec(&record)
                        .map_err(|e| e.to_string())
                        .and_then(|bytes| {
                            self.log
                                .append(TM_RECORD_TAG, &bytes)
                                .map_err(|e| e.to_string())
                        });
                    Some(match appended {
                        Ok(lsn) => Event::Appended { token, lsn },
                        Err(e) => {
                            tracing::error!(tid = %token.tid, "log append failed: {e}");
                            Event::LogFailed { token }
                        }
                    })
                }
                Action::ExpectForce { tid } => {
                    self.intents
                        .lock()
                        .entry(tid)
                        .or_insert_with(|| self.log.intent());
                    None
                }
                Action::Force { tid, lsn, token } => {
                    let intent = self.intents.lock().remove(&tid);
                    let log = self.log.clone();
                    let forcing = async move {
                        let forced = match intent {
                            Some(i) => i.force(lsn).await,
                            None => log.force(lsn).await,
                        };
                        match forced {
                            Ok(()) => Event::Forced { tid },
                            Err(e) => {
                                tracing::error!(%tid, "log force failed: {e}");
                                Event::LogFailed { token }
                            }
                        }
                    };
                    if last {
                        Some(forcing.await)
                    } else {
                        self.later(forcing);
                        None
                    }
                }
                Action::AwaitLazy { tid, lsn } => {
                    let log = self.log.clone();
                    self.later(async move {
                        match log.when_durable(lsn).await {
                            Ok(()) => Event::LazyDurable { tid },
                            Err(e) => {
                                // Nothing waits on it but the acknowledgement;
                                // the node must restart.
                                tracing::error!(%tid, "log failed: {e}");
                                Event::Tick
                            }
                        }
                    });
                    None
                }
                Action::WaitDurable { lsn } => {
                    if self.log.durable_lsn() >= lsn {
                        Some(Event::Durable {
                            upto: self.log.durable_lsn(),
                        })
                    } else {
                        let log = self.log.clone();
                        self.later(async move {
                            if let Err(e) = log.when_durable(lsn).await {
                                // A log failure is reported by the forces
                                // themselves; here it only ends the wait.
                                tracing::warn!("waiting for early-released commits: {e}");
                            }
                            Event::Durable { upto: lsn }
                        });
                        None
                    }
                }
                Action::ResourcePrepare { tid, resource } => {
                    let log = self.log.clone();
                    let preparing = async move {
                        let vote = resource.resource.prepare(tid, &log).await;
                        Event::ResourceVoted { tid, vote }
                    };
                    if last {
                        Some(preparing.await)
                    } else {
                        self.later(preparing);
                        None
                    }
                }
                Action::ResourceCommit { tid, resource } => {
                    resource.resource.commit(tid).await;
                    None
                }
                Action::ResourceAbort { tid, resource } => {
                    resource.resource.abort(tid).await;
                    None
                }
                Action::ResourceEnded {
                    tid,
                    resource,
                    outcome,
                } => {
                    resource.resource.ended(tid, outcome).await;
                    None
                }
                Action::ResourceSubEnded {
                    tid,
                    resource,
                    path,
                    committed,
                } => {
                    resource.resource.sub_ended(tid, &path, committed);
                    None
                }
                Action::QueryDependencies { tid, resources } => {
                    let mut result: Result<Vec<Tid>, String> = Ok(Vec::new());
                    for r in &resources {
                        match (r.resource.undecided_dependencies(tid), &mut result) {
                            (Ok(deps), Ok(all)) => {
                                for d in deps {
                                    if !all.contains(&d) {
                                        all.push(d);
                                    }
                                }
                            }
                            (Err(reason), _) => {
                                result = Err(reason);
                                break;
                            }
                            (Ok(_), Err(_)) => {}
                        }
                    }
                    Some(Event::Dependencies { tid, result })
                }
                Action::VoteBarrier { id, tid, resources } => {
                    let waiting = async move {
                        let mut result = Ok(());
                        for r in &resources {
                            if let Err(reason) = r.resource.vote_barrier(tid).await {
                                result = Err(reason);
                                break;
                            }
                        }
                        Event::BarrierDone { id, result }
                    };
                    if last {
                        Some(waiting.await)
                    } else {
                        self.later(waiting);
                        None
                    }
                }
                Action::Complete { waiter, result } => {
                    if let Some(w) = self.waiters.lock().remove(&waiter.0) {
                        let _ = w.send(result);
                    }
                    None
                }
                Action::CallAdmitted { call, result } => {
                    if let Some(w) = self.admits.lock().remove(&call.0) {
                        let _ = w.send(result);
                    }
                    None
                }
                Action::CrashPoint { point, tid } => {
                    if let Some((at, hook)) = &self.cfg.crash_at {
                        if *at == point {
                            // The transaction stops here until the node is
                            // killed: nothing after this point happens.
                            tracing::warn!(%tid, ?point, "crash point reached");
                            self.core.lock().halt(tid);
                            hook(point, tid);
                            return;
                        }
                    }
                    None
                }
                Action::Decided {
                    tid,
                    outcome,
                    cause,
                } => {
                    count_decided(outcome, cause);
                    self.intents.lock().remove(&tid);
                    None
                }
                Action::Forgotten { tid } => {
                    self.intents.lock().remove(&tid);
                    #[cfg(feature = "otel")]
                    self.traces.forget(tid);
                    None
                }
            };
            if let Some(event) = result {
                let more = self.step(event);
                for a in more.into_iter().rev() {
                    queue.push_front(a);
                }
            }
        }
    }

    /// Runs `waiting` in a task and feeds its event back when it ends.
    fn later(self: &Arc<Self>, waiting: impl std::future::Future<Output = Event> + Send + 'static) {
        let me = Arc::clone(self);
        tokio::spawn(async move {
            let event = waiting.await;
            me.feed(event).await;
        });
    }

    fn send(&self, to: NodeId, msg: TxMsg) -> Option<Event> {
        let tid = msg.tid();
        #[cfg(feature = "otel")]
        let msg = self.traces.on_send(msg);
        match self.endpoint.send(to, Port::TX, Payload::local(msg)) {
            Ok(()) => None,
            Err(f) => {
                tracing::debug!(%tid, peer = %to, %f, "protocol message not sent");
                Some(Event::SendFailed {
                    tid,
                    to,
                    status: f.status,
                })
            }
        }
    }

    /// Ticks the core each `cfg.tick`; while no transaction is live it
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
                inner.feed(Event::Tick).await;
                let core = inner.core.lock();
                core.live() == 0 && core.side_tables() == 0
            };
            if idle {
                // No strong reference is held while asleep.
                let _ = tokio::time::timeout(Duration::from_secs(5), work.notified()).await;
                ticker.reset();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::msg::Vote;
    use weft_log::LogConfig;
    use weft_transport::{InprocHub, Seed, TransportConfig};
    use weft_wire::Incarnation;

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
        let announced_at = tm.inner.core.lock().births();
        let newer = tm.begin(None);
        tm.on_call_out(&newer, NodeId(2)).expect("active");

        let dead = |status, incarnation, born_before| Event::PeerDead {
            node: NodeId(2),
            status,
            incarnation,
            born_before,
        };
        // Another incarnation's death concerns neither.
        tm.inner
            .feed(dead(Status::ProcDead, Some(Incarnation(7)), None))
            .await;
        assert!(active(&tm, &older) && active(&tm, &newer));

        // Incarnation 1's death, announced between the two, ends only the
        // transaction that existed when it was announced.
        tm.inner
            .feed(dead(
                Status::ProcDead,
                Some(Incarnation(1)),
                Some(announced_at),
            ))
            .await;
        assert!(!active(&tm, &older), "it used the node that died");
        assert!(active(&tm, &newer), "it began after the announcement");

        // Without an incarnation, a death concerns every child at the node.
        tm.inner.feed(dead(Status::HostDead, None, None)).await;
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
        /// Notified whenever `held` shrinks.
        changed: Notify,
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
            self.changed.notify_one();
            Box::pin(async {})
        }

        fn abort(&self, tid: Tid) -> futures::future::BoxFuture<'_, ()> {
            self.held.lock().remove(&tid);
            self.changed.notify_one();
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
    /// Waits until `cond` holds, re-checking whenever `changed` is
    /// notified (a spawned follow-up must run); no sleeps. The timeout only
    /// turns a hang into a failure.
    async fn until(what: &str, changed: &Notify, cond: impl Fn() -> bool) {
        while !cond() {
            if tokio::time::timeout(Duration::from_secs(60), changed.notified())
                .await
                .is_err()
            {
                panic!("never: {what}");
            }
        }
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
        until("the leftover is undone", &res.changed, || {
            !res.holds(ctx.tid)
        })
        .await;
        assert!(tm.orphans().is_empty());
    }

    /// A call's response returns no baggage when the baggage where it ran
    /// is still exactly what its request brought, and all of it otherwise:
    /// either way the caller merging it ends where merging the whole
    /// baggage would leave it.
    #[tokio::test]
    async fn a_call_returns_the_baggage_only_when_it_is_not_what_the_request_brought() {
        let dir = tempfile::tempdir().expect("temporary directory");
        let hub = InprocHub::new();
        let (e1, tm) = node(1, &hub, dir.path()).await;
        let tm = tm.expect("node 1 has a transaction manager");
        let from = PeerRef {
            node: NodeId(1),
            incarnation: e1.incarnation(),
            role: PeerRole::Node,
            link: 0,
            channel: weft_transport::ChannelKind::Inproc,
        };
        let item = |k: &str, v: &'static [u8]| weft_wire::BaggageItem {
            key: k.to_string(),
            value: bytes::Bytes::from_static(v),
        };
        let merged = |into: &Baggage, from: &Baggage| {
            let mut b = into.clone();
            for i in &from.0 {
                b.set(i.key.clone(), i.value.clone());
            }
            b
        };
        let mut ctx = tm.begin(None);
        ctx.baggage = Baggage(vec![item("a", b"1")]);

        // Nothing changed where the call ran: nothing comes back.
        let call = tm.on_call_in(&ctx, from, None).await.expect("joined");
        assert_eq!(call.finish(), TxReturn::default());

        // The same again, the request now bringing a new entry.
        ctx.baggage = Baggage(vec![item("a", b"1"), item("c", b"3")]);
        let call = tm.on_call_in(&ctx, from, None).await.expect("joined");
        assert_eq!(call.finish(), TxReturn::default());

        // The call replaced an entry and added one: all of it comes back.
        let call = tm.on_call_in(&ctx, from, None).await.expect("joined");
        tm.merge_baggage(ctx.tid, &Baggage(vec![item("b", b"2"), item("a", b"9")]));
        let ret = call.finish();
        assert!(!ret.aborted);
        let whole = tm.baggage(ctx.tid).expect("live");
        assert_eq!(ret.baggage, whole);
        assert_eq!(
            merged(&ctx.baggage, &ret.baggage),
            Baggage(vec![item("a", b"9"), item("c", b"3"), item("b", b"2")])
        );

        // Whatever comes back, the caller ends where the whole baggage would
        // leave it.
        let call = tm.on_call_in(&ctx, from, None).await.expect("joined");
        tm.merge_baggage(ctx.tid, &Baggage(vec![item("b", b"2")]));
        let ret = call.finish();
        let whole = tm.baggage(ctx.tid).expect("live");
        assert_eq!(
            merged(&ctx.baggage, &ret.baggage),
            merged(&ctx.baggage, &whole)
        );

        // A caller that lacks an entry held here gets all of it back.
        ctx.baggage = Baggage(vec![item("a", b"9")]);
        let call = tm.on_call_in(&ctx, from, None).await.expect("joined");
        let ret = call.finish();
        assert_eq!(ret.baggage, tm.baggage(ctx.tid).expect("live"));
        tm.abort(ctx.tid, "test").await.expect("aborted");
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
        until("the prepared branch is undone", &res.changed, || {
            !res.holds(ctx.tid)
        })
        .await;
        assert!(tm.list().is_empty(), "{:?}", tm.list());
    }

    /// Collects the protocol messages a node without a transaction manager
    /// receives.
    #[derive(Default)]
    struct Capture(parking_lot::Mutex<Vec<TxMsg>>, Notify);

    impl PortHandler for Capture {
        fn on_message(&self, _from: PeerRef, payload: Payload) {
            if let Ok(m) = payload.decode::<TxMsg>() {
                self.0.lock().push(m);
                self.1.notify_one();
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
        until("node 2 is asked to prepare", &seen.1, || {
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
        until("node 2 hears the writer's abort", &seen.1, aborted(writer)).await;
        until(
            "node 2 hears its own transaction's abort",
            &seen.1,
            aborted(ctx.tid),
        )
        .await;
    }
}
