//! The PostgreSQL participant: a PostgreSQL database enlisted in weft transactions through
//! PostgreSQL's own two-phase commit.
//!
//! Each (weft transaction, node) pair that runs SQL here is one **branch**: one PostgreSQL
//! transaction on one dedicated connection, begun at its first statement. Phase one is
//! `PREPARE TRANSACTION '<gid>'` (see [`Gid`] for the format), after which the connection goes
//! back to the pool; phase two is `COMMIT PREPARED` or `ROLLBACK PREPARED`, run on separate
//! resolver connections and retried with backoff until PostgreSQL has applied it (the outcome is
//! final). A branch that wrote nothing commits its read-only PostgreSQL transaction at prepare and
//! votes read-only; a branch whose statement failed votes no.
//!
//! Recovery (as a [`Plugin`]): after the transaction manager replayed the log, the participant
//! lists the prepared transactions of its database whose GID names this node and resolves each
//! with what the transaction manager found — committed: `COMMIT PREPARED`; aborted or unknown
//! (presumed abort): `ROLLBACK PREPARED`; in doubt: kept prepared until the transaction manager
//! learns the outcome and calls [`Resource::commit`] or [`Resource::abort`], which then resolve the
//! GID even though this process never opened it.
//!
//! Owns the branch table, the two connection pools and the recovery scan. Must never decide an
//! outcome (the transaction manager does), never resolve a GID of another node or database, and
//! never give up on an outcome while it runs: a lost connection is reopened and the command
//! retried.

mod branch;
mod recovery;

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, Weak};

use futures::future::BoxFuture;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use tokio::sync::watch;
use weft_log::{Log, LogRecord, Lsn};
use weft_rpc::Plugin;
use weft_tx::{ParticipationClass, Resource, TxManager, Vote};
use weft_wire::{Failure, NodeId, Status, SubPath, Tid, TxContext};

pub use branch::PgBranch;

use crate::client::describe_error;
use crate::config::PgConfig;
use crate::errors::is_unknown_gid;
use crate::gid::Gid;
use crate::pool::{Pool, PoolError};
use branch::Branch;

/// Counters of a [`PgParticipant`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PgStats {
    /// Branches opened (first enlistment of a transaction at this participant).
    pub branches: u64,
    /// Branches that voted yes after `PREPARE TRANSACTION`.
    pub prepared: u64,
    /// Branches that voted read-only (no statement, or no write).
    pub read_only: u64,
    /// Branches that voted no.
    pub voted_no: u64,
    /// Prepared branches committed (`COMMIT PREPARED` applied, here or found applied).
    pub committed: u64,
    /// Branches rolled back (active ones, and prepared ones by `ROLLBACK PREPARED`).
    pub rolled_back: u64,
    /// Phase-two or recovery commands retried after a failure (lost connection, server down).
    pub retries: u64,
}

#[derive(Default)]
struct Counters {
    branches: AtomicU64,
    prepared: AtomicU64,
    read_only: AtomicU64,
    voted_no: AtomicU64,
    committed: AtomicU64,
    rolled_back: AtomicU64,
    retries: AtomicU64,
}

fn bump(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}

/// What the recovery scan did with the prepared transactions it found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PgRecoveryReport {
    /// This node's branches found committed by the transaction manager: `COMMIT PREPARED`.
    pub committed: Vec<Gid>,
    /// This node's branches found aborted, or unknown to the transaction manager (presumed
    /// abort): `ROLLBACK PREPARED`.
    pub rolled_back: Vec<Gid>,
    /// This node's branches in doubt: kept prepared until the transaction manager learns the
    /// outcome.
    pub in_doubt: Vec<Gid>,
    /// Prepared transactions with a weft GID of another node or database, left alone.
    pub others: usize,
    /// [`crate::PgRecord::Prepared`] records found in the log.
    pub logged: usize,
    /// Of those, GIDs PostgreSQL no longer lists: resolved before the crash (phase two is
    /// applied before the transaction manager's own outcome record becomes durable), or lost by
    /// PostgreSQL (a crash with `fsync` off).
    pub logged_not_prepared: usize,
}

/// How many ended branches a participant remembers (see [`Ended`]).
const ENDED_REMEMBERED: usize = 65_536;

/// Transactions whose branch ended in this process, oldest first, bounded: a late commit or
/// abort for one of them (the transaction manager tells every enlisted resource the outcome,
/// including branches that already left the protocol) needs no PostgreSQL command.
#[derive(Default)]
struct Ended {
    set: HashSet<Tid>,
    order: VecDeque<Tid>,
}

impl Ended {
    fn insert(&mut self, tid: Tid) {
        if self.set.insert(tid) {
            self.order.push_back(tid);
            if self.order.len() > ENDED_REMEMBERED {
                if let Some(old) = self.order.pop_front() {
                    self.set.remove(&old);
                }
            }
        }
    }
}

#[derive(Clone, Debug)]
enum RecoveryState {
    /// [`Plugin::recover`] was not called.
    NotStarted,
    /// The scan runs (or waits for PostgreSQL).
    Running,
    /// The scan finished.
    Done(PgRecoveryReport),
    /// The participant stopped before the scan finished.
    Abandoned,
}

/// A PostgreSQL database as a two-phase participant of weft transactions.
///
/// Create it with [`PgParticipant::new`], add it to a node as a plugin
/// (`Node::builder(id).plugin(participant.clone())`), then, in a service handler or in the
/// program that began a transaction, [`PgParticipant::enlist`] it and run SQL through the
/// returned [`PgBranch`]. One participant serves one database of one node; give each database
/// its own participant (two participants on the same database of the same node would share
/// GIDs).
pub struct PgParticipant {
    me: Weak<PgParticipant>,
    name: String,
    cfg: PgConfig,
    branch_pool: Pool,
    resolvers: Pool,
    node: OnceLock<NodeId>,
    live: Mutex<HashMap<Tid, Arc<Branch>>>,
    /// Branches of earlier lives found in doubt by recovery, awaiting their outcome.
    in_doubt: Mutex<HashSet<Tid>>,
    ended: Mutex<Ended>,
    recovery: watch::Sender<RecoveryState>,
    closed: AtomicBool,
    counters: Counters,
}

impl std::fmt::Debug for PgParticipant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgParticipant")
            .field("name", &self.name)
            .field("node", &self.node.get())
            .field("live", &self.live.lock().len())
            .field("closed", &self.is_closed())
            .finish()
    }
}

impl PgParticipant {
    /// A participant for the database of `cfg`, named `pg:<database>`. Opens no connection yet:
    /// branches connect at their first statement, recovery when the node starts.
    pub fn new(cfg: PgConfig) -> Arc<PgParticipant> {
        Arc::new_cyclic(|me| PgParticipant {
            me: me.clone(),
            name: format!("pg:{}", cfg.database),
            branch_pool: Pool::new("branch", cfg.pg.clone(), cfg.max_connections),
            resolvers: Pool::new("resolver", cfg.pg.clone(), cfg.resolver_connections),
            cfg,
            node: OnceLock::new(),
            live: Mutex::new(HashMap::new()),
            in_doubt: Mutex::new(HashSet::new()),
            ended: Mutex::new(Ended::default()),
            recovery: watch::Sender::new(RecoveryState::NotStarted),
            closed: AtomicBool::new(false),
            counters: Counters::default(),
        })
    }

    /// The participant's name, `pg:<database>` (its resource and plugin name).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The configuration.
    pub fn config(&self) -> &PgConfig {
        &self.cfg
    }

    /// The node this participant serves, once attached or first enlisted.
    pub fn node(&self) -> Option<NodeId> {
        self.node.get().copied()
    }

    /// The GID of this node's branch of `tid` (`None` before the node is known).
    pub fn gid(&self, tid: Tid) -> Option<Gid> {
        Gid::new(tid, *self.node.get()?, &self.cfg.database)
    }

    /// Enlists this database in the transaction of `ctx`, active at the node of `tm`, and returns
    /// the handle through which SQL runs in the transaction's branch here. Statements run in
    /// `ctx`'s (sub-)transaction. The first enlistment of a transaction opens its branch; later
    /// ones (another call of the same transaction, a sub-transaction) share it. Opens no
    /// connection: the first statement does.
    ///
    /// # Errors
    /// - NoSuchTransaction when the transaction is unknown at this node; Aborted when it is no
    ///   longer active here (aborted, or already preparing).
    /// - ShuttingDown after [`PgParticipant::crash`].
    /// - Internal when `tm` belongs to another node than the one this participant serves.
    pub fn enlist(self: &Arc<Self>, tm: &TxManager, ctx: &TxContext) -> Result<PgBranch, Failure> {
        self.check_open()?;
        self.set_node(tm.node_id())?;
        let tid = ctx.tid;
        let gid = self.gid(tid).ok_or_else(|| {
            Failure::new(Status::Internal, format!("{}: no GID for {tid}", self.name))
        })?;
        // Holding the table across `TxManager::enlist` orders concurrent enlistments: a branch
        // is in the table before the transaction manager can ask it to prepare, and a branch
        // whose enlistment failed is gone before anyone else sees it. (The transaction manager
        // never calls a resource while holding its own locks, so this cannot deadlock.)
        let mut live = self.live.lock();
        let (branch, opened) = match live.get(&tid) {
            Some(b) => (Arc::clone(b), false),
            None => {
                let b = Arc::new(Branch::new(tid, gid));
                live.insert(tid, Arc::clone(&b));
                (b, true)
            }
        };
        let me: Arc<dyn Resource> = Arc::clone(self) as Arc<dyn Resource>;
        if let Err(failure) = tm.enlist(tid, me) {
            if opened {
                live.remove(&tid);
            }
            return Err(failure);
        }
        drop(live);
        branch.check_active(&self.name)?;
        if opened {
            bump(&self.counters.branches);
            tracing::debug!(participant = %self.name, %tid, "branch opened");
        }
        Ok(PgBranch::new(Arc::clone(self), branch, ctx.path.clone()))
    }

    /// Waits until the recovery scan started by [`Plugin::recover`] has resolved (or kept in
    /// doubt) every prepared branch this node left in PostgreSQL, and returns what it did. The
    /// scan retries while PostgreSQL is unreachable, so this waits as long.
    ///
    /// # Errors
    /// Unavailable when recovery was never started (the participant is not part of a node);
    /// ShuttingDown when the participant was stopped before the scan finished.
    pub async fn wait_recovered(&self) -> Result<PgRecoveryReport, Failure> {
        let mut rx = self.recovery.subscribe();
        let state = rx
            .wait_for(|s| !matches!(s, RecoveryState::Running))
            .await
            .map(|s| s.clone())
            .unwrap_or(RecoveryState::Abandoned);
        match state {
            RecoveryState::Done(report) => Ok(report),
            RecoveryState::NotStarted => Err(Failure::new(
                Status::Unavailable,
                format!(
                    "{}: recovery was never started (add it to a node)",
                    self.name
                ),
            )),
            RecoveryState::Abandoned | RecoveryState::Running => Err(Failure::new(
                Status::ShuttingDown,
                format!("{}: stopped before recovery finished", self.name),
            )),
        }
    }

    /// Counters.
    pub fn stats(&self) -> PgStats {
        let c = &self.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        PgStats {
            branches: get(&c.branches),
            prepared: get(&c.prepared),
            read_only: get(&c.read_only),
            voted_no: get(&c.voted_no),
            committed: get(&c.committed),
            rolled_back: get(&c.rolled_back),
            retries: get(&c.retries),
        }
    }

    /// The transactions with a branch here that has not ended (active, or prepared and waiting
    /// for the outcome), oldest first by id.
    pub fn branches(&self) -> Vec<Tid> {
        let mut tids: Vec<Tid> = self.live.lock().keys().copied().collect();
        tids.sort();
        tids
    }

    /// Stops the participant at once, as the death of its process would: every connection is cut
    /// (PostgreSQL rolls back active branches and keeps prepared ones), phase two and recovery
    /// stop retrying, and every later call fails or does nothing. Tests call it next to
    /// `Node::crash`; a new participant for the same node and database recovers what this one
    /// left.
    pub fn crash(&self) {
        if self.closed.swap(true, Ordering::AcqRel) {
            return;
        }
        self.branch_pool.close();
        self.resolvers.close();
        self.recovery.send_if_modified(|s| {
            if matches!(s, RecoveryState::Running) {
                *s = RecoveryState::Abandoned;
                true
            } else {
                false
            }
        });
        tracing::debug!(participant = %self.name, "participant stopped");
    }

    fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    fn check_open(&self) -> Result<(), Failure> {
        if self.is_closed() {
            return Err(Failure::new(
                Status::ShuttingDown,
                format!("{} is stopped", self.name),
            ));
        }
        Ok(())
    }

    fn set_node(&self, node: NodeId) -> Result<(), Failure> {
        let set = *self.node.get_or_init(|| node);
        if set != node {
            return Err(Failure::new(
                Status::Internal,
                format!(
                    "{} serves node {set}, not node {node}: give each node its own participant",
                    self.name
                ),
            ));
        }
        Ok(())
    }

    fn live_branch(&self, tid: Tid) -> Option<Arc<Branch>> {
        self.live.lock().get(&tid).cloned()
    }

    /// Drops `branch` from the table (if it is still the one there).
    fn forget(&self, branch: &Arc<Branch>) {
        let mut live = self.live.lock();
        if live
            .get(&branch.tid)
            .is_some_and(|b| Arc::ptr_eq(b, branch))
        {
            live.remove(&branch.tid);
            self.ended.lock().insert(branch.tid);
        }
    }

    fn scan_done(&self) -> bool {
        matches!(*self.recovery.borrow(), RecoveryState::Done(_))
    }

    /// Phase two of a transaction this participant has no live branch of: a branch that ended
    /// already (nothing to do), or one of an earlier life, in doubt at recovery. Before the recovery scan has listed what PostgreSQL
    /// holds, any transaction might be one, so the GID is resolved on the off chance (a GID
    /// PostgreSQL does not know is no error).
    async fn finish_unknown(&self, tid: Tid, commit: bool) {
        let Some(gid) = self.gid(tid) else {
            return;
        };
        if self.ended.lock().set.contains(&tid) {
            return; // its branch ended here already (read-only, voted no, or resolved)
        }
        let recovered = self.in_doubt.lock().remove(&tid);
        if !recovered && self.scan_done() {
            return; // not a branch of ours
        }
        let resolved = self.resolve(&gid, commit, false).await;
        if resolved && recovered {
            tracing::info!(participant = %self.name, %gid, commit, "in-doubt branch resolved");
        }
    }

    /// Applies the outcome to prepared transaction `gid`, retrying with backoff (and new
    /// connections) until PostgreSQL has applied it or says it has no such GID — which after a
    /// retry means an earlier attempt applied it. `expect_present` says whether this process
    /// prepared it itself (then an unknown GID on the first attempt is worth a warning: someone
    /// else resolved it). Returns false only when the participant stopped first.
    async fn resolve(&self, gid: &Gid, commit: bool, expect_present: bool) -> bool {
        let command = if commit {
            "COMMIT PREPARED"
        } else {
            "ROLLBACK PREPARED"
        };
        let sql = format!("{command} {}", gid.literal());
        let mut delay = self.cfg.retry_min;
        let mut attempt: u32 = 0;
        loop {
            if self.is_closed() {
                return false;
            }
            attempt += 1;
            let error = match self.resolvers.get(None).await {
                Ok(conn) => match conn.client.batch_execute(&sql).await {
                    Ok(()) => {
                        self.resolvers.put(conn);
                        self.count_outcome(commit);
                        return true;
                    }
                    Err(e) if is_unknown_gid(&e) => {
                        self.resolvers.put(conn);
                        if attempt == 1 && expect_present {
                            tracing::warn!(
                                participant = %self.name, %gid,
                                "{command}: PostgreSQL no longer has this prepared transaction \
                                 (resolved by someone else?)"
                            );
                        } else {
                            tracing::debug!(participant = %self.name, %gid, attempt, "{command}: already resolved");
                        }
                        self.count_outcome(commit);
                        return true;
                    }
                    Err(e) => {
                        if e.as_db_error().is_some() && !conn.client.is_closed() {
                            self.resolvers.put(conn);
                        }
                        describe_error(&e)
                    }
                },
                Err(PoolError::Closed) => return false,
                Err(PoolError::Connect(e)) => format!("cannot connect: {}", describe_error(&e)),
                Err(PoolError::Exhausted { .. }) => "no resolver connection".to_string(),
            };
            if self.is_closed() {
                return false;
            }
            bump(&self.counters.retries);
            tracing::warn!(
                participant = %self.name, %gid, attempt, retry_in = ?delay,
                "{command} failed, retrying: {error}"
            );
            tokio::time::sleep(delay).await;
            delay = (delay * 2).min(self.cfg.retry_max);
        }
    }

    fn count_outcome(&self, commit: bool) {
        if commit {
            bump(&self.counters.committed);
        } else {
            bump(&self.counters.rolled_back);
        }
    }
}

impl Resource for PgParticipant {
    fn name(&self) -> &str {
        &self.name
    }

    fn class(&self) -> ParticipationClass {
        ParticipationClass::TwoPhase
    }

    fn prepare<'a>(&'a self, tid: Tid, log: &'a Log) -> BoxFuture<'a, Vote> {
        Box::pin(async move {
            let Some(branch) = self.live_branch(tid) else {
                return Vote::ReadOnly;
            };
            let vote = self.prepare_branch(&branch, log).await;
            match &vote {
                Vote::Yes { .. } => bump(&self.counters.prepared),
                Vote::ReadOnly => bump(&self.counters.read_only),
                Vote::No(reason) => {
                    bump(&self.counters.voted_no);
                    tracing::debug!(participant = %self.name, %tid, "votes no: {reason}");
                }
            }
            vote
        })
    }

    fn commit(&self, tid: Tid) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            match self.live_branch(tid) {
                Some(branch) => self.finish_branch(&branch, true).await,
                None => self.finish_unknown(tid, true).await,
            }
        })
    }

    fn abort(&self, tid: Tid) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            match self.live_branch(tid) {
                Some(branch) => self.finish_branch(&branch, false).await,
                None => self.finish_unknown(tid, false).await,
            }
        })
    }

    fn sub_ended(&self, tid: Tid, path: &SubPath, committed: bool) {
        if let Some(branch) = self.live_branch(tid) {
            branch.note_sub_end(path, committed);
        }
    }
}

impl Plugin for PgParticipant {
    fn name(&self) -> &str {
        &self.name
    }

    /// Registers the participant with the transaction manager, so that it is enlisted in every
    /// transaction recovered from the log (and hears the outcome of its in-doubt branches).
    fn attach(&self, tm: &TxManager, _log: &Log) -> Result<(), Failure> {
        self.check_open()?;
        self.set_node(tm.node_id())?;
        let me = self
            .me
            .upgrade()
            .ok_or_else(|| Failure::new(Status::Internal, "participant dropped"))?;
        tm.register_resource(me);
        Ok(())
    }

    /// Starts the recovery scan in the background (PostgreSQL may be slow or down; the node
    /// starts anyway, and new transactions never touch the GIDs of earlier lives).
    /// [`PgParticipant::wait_recovered`] waits for it.
    fn recover(&self, tm: &TxManager, records: &[LogRecord]) -> Result<(), Failure> {
        self.check_open()?;
        self.set_node(tm.node_id())?;
        let me = self
            .me
            .upgrade()
            .ok_or_else(|| Failure::new(Status::Internal, "participant dropped"))?;
        let logged = recovery::logged_gids(&self.name, records, self.node(), &self.cfg.database);
        let runtime = tokio::runtime::Handle::try_current().map_err(|_| {
            Failure::new(
                Status::Internal,
                format!("{}: recovery must run inside a tokio runtime", self.name),
            )
        })?;
        self.recovery.send_replace(RecoveryState::Running);
        let tm = tm.clone();
        runtime.spawn(async move { me.recovery_task(tm, logged).await });
        Ok(())
    }

    /// Needs no log: the GIDs are derived from the transaction, node and database, PostgreSQL
    /// lists the prepared ones, and the transaction manager keeps its own records.
    fn checkpoint(&self, _log: &Log) -> Result<Option<Lsn>, Failure> {
        Ok(None)
    }

    fn crash(&self) {
        PgParticipant::crash(self);
    }
}
