//! The transaction manager of one node as a pure state machine: every
//! commit-protocol decision for ALL the transactions of a node, with no
//! I/O, no clock, no tasks and no randomness (the image of
//! `weft_group::core`, etcd raft's `RawNode` and quinn-proto's `Endpoint`).
//!
//! Owns: the table of live transactions (one [`TxCore`] each, the inner
//! per-transaction machine) with the participant tree, the enlisted
//! resources, the running calls, the commit waiters and the baggage; the
//! tombstones of decided transactions and the answers for forgotten or
//! unknown ones (presumed abort); incarnation checks; the ordering of
//! `VoteAfter` votes behind the commit records they name; the filtering of
//! peer deaths (incarnation and born-before checks); early lock release and
//! the waits it imposes on votes and read-only outcomes; deadlines and
//! retransmission timers (time comes in with the events); the named crash
//! points; and recovery from the log's records (pure: records in, table
//! out).
//!
//! Must never: perform I/O, read a clock, spawn, block, or hold a resource
//! manager object other than as an opaque handle `R` it hands back in
//! actions. A driver (`crate::manager` for real nodes, a simulator for
//! whole clusters) feeds [`Event`]s in, carries the returned [`Action`]s
//! out in order, and feeds their results back as further events. See
//! `API.md` beside this file.
//!
//! # Bounded bookkeeping
//!
//! Nothing here grows with the number of transactions ever run:
//!
//! - live transactions are capped by [`NodeConfig::max_live`]: a
//!   transaction begun beyond it is born aborted with `NoBuffer` (its
//!   commit reports that status), and a call that would make this node join
//!   one more fails with `NoBuffer`;
//! - tombstones (what is remembered of a decided transaction) are capped by
//!   [`NodeConfig::tombstones`] and reclaimed after
//!   [`NodeConfig::tombstone_retention`] past the later of their end and
//!   their transaction's deadline. Forgetting one is safe under presumed
//!   abort because: a coordinator forgets a committed transaction only
//!   once every participant that voted Yes acknowledged the decision (none
//!   can be in doubt and ask any more; read-only voters left the protocol),
//!   so "no record means abort" can no longer mislead anyone; a participant
//!   branch that aborted without voting Yes is needed only while its
//!   coordinator may still collect votes, which stops at the transaction's
//!   deadline (a coordinator still preparing at its deadline aborts), so
//!   its tombstone is kept at least that long. When the cap forces out a
//!   tombstone still inside that window, [`Bookkeeping::tombstones_evicted_early`]
//!   counts it (size the cap to the rate times the window);
//! - everything else (running calls' leftovers, held votes, pending
//!   enlistments, votes waiting on other commit records) belongs to a live
//!   transaction or to a running call, so it is bounded by the above;
//! - statistics are fixed counters ([`TmStats`]).

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use weft_log::Lsn;
use weft_wire::{Baggage, Failure, IdMap, Incarnation, NodeId, Status, SubPath, Tid, TxContext};

use crate::core::{self, late, CoreConfig, Durability, Input, Phase, TxCore};
use crate::msg::{Answer, Outcome, TmRecord, TxMsg, Vote};
use crate::resource::{ParticipationClass, Resource};

mod recovery;
#[cfg(test)]
mod tests;

pub use recovery::{decode_records, scan, RecoveredEntry, RecoveredTx, RecoveryScan};

/// A named point of the commit protocol where a test or a simulator can
/// stop (crash) a node, to check atomicity across crashes. The core emits
/// [`Action::CrashPoint`] when a transaction reaches one; the actions after
/// it in the same batch are what the node does if it does not crash there.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum CrashPoint {
    /// A participant is about to append (and force) its prepare record.
    ParticipantBeforePrepareForce,
    /// A participant's prepare record is durable; its vote is not sent.
    ParticipantPrepared,
    /// All votes are in; the coordinator's commit record is not yet forced.
    CoordinatorBeforeCommitForce,
    /// The commit record is durable; no decision has been sent.
    CoordinatorAfterCommitForce,
    /// The coordinator sent the commit decision to its children; its own
    /// resources have not applied it and its caller has not heard.
    CoordinatorDecisionSent,
    /// A participant received the commit decision and has not applied it.
    ParticipantPhaseTwo,
}

impl CrashPoint {
    /// Every crash point, for coverage counts.
    pub const ALL: [CrashPoint; 6] = [
        CrashPoint::ParticipantBeforePrepareForce,
        CrashPoint::ParticipantPrepared,
        CrashPoint::CoordinatorBeforeCommitForce,
        CrashPoint::CoordinatorAfterCommitForce,
        CrashPoint::CoordinatorDecisionSent,
        CrashPoint::ParticipantPhaseTwo,
    ];

    /// The name used on command lines (`participant-prepared`...).
    pub fn name(self) -> &'static str {
        match self {
            CrashPoint::ParticipantBeforePrepareForce => "participant-before-prepare-force",
            CrashPoint::ParticipantPrepared => "participant-prepared",
            CrashPoint::CoordinatorBeforeCommitForce => "coordinator-before-commit-force",
            CrashPoint::CoordinatorAfterCommitForce => "coordinator-after-commit-force",
            CrashPoint::CoordinatorDecisionSent => "coordinator-decision-sent",
            CrashPoint::ParticipantPhaseTwo => "participant-phase-two",
        }
    }
}

impl std::str::FromStr for CrashPoint {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        CrashPoint::ALL
            .into_iter()
            .find(|p| p.name() == s)
            .ok_or_else(|| format!("unknown crash point {s:?}"))
    }
}

impl std::fmt::Display for CrashPoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// How the core sees a resource manager: an opaque, cloneable handle the
/// driver resolves when it carries out an action. The real node uses
/// `Arc<dyn Resource>`; a simulator may use a plain index. The core calls
/// these methods while it runs (a driver may hold a lock around it): they
/// must answer at once and never call back into the driver.
pub trait ResourceRef: Clone + Send + 'static {
    /// A name for listings.
    fn name(&self) -> String;
    /// The participation class.
    fn class(&self) -> ParticipationClass;
    /// See [`Resource::commits_from_this_log`].
    fn commits_from_this_log(&self) -> bool;
    /// See [`Resource::may_decide_alone`].
    fn may_decide_alone(&self) -> bool {
        false
    }
    /// True when both handles name the same resource (enlisted once).
    fn same(&self, other: &Self) -> bool;
}

impl ResourceRef for Arc<dyn Resource> {
    fn name(&self) -> String {
        Resource::name(self.as_ref()).to_string()
    }
    fn class(&self) -> ParticipationClass {
        Resource::class(self.as_ref())
    }
    fn commits_from_this_log(&self) -> bool {
        Resource::commits_from_this_log(self.as_ref())
    }
    fn may_decide_alone(&self) -> bool {
        Resource::may_decide_alone(self.as_ref())
    }
    fn same(&self, other: &Self) -> bool {
        Arc::ptr_eq(self, other)
    }
}

/// Identifies a commit waiter (the creator's `commit` call); chosen by the
/// driver, echoed in [`Action::Complete`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct WaiterId(pub u64);

/// Identifies an incoming call that waits for the coordinator to adopt this
/// node; chosen by the driver, echoed in [`Action::CallAdmitted`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CallId(pub u64);

/// Identifies a vote barrier the core asked for ([`Action::VoteBarrier`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BarrierId(pub u64);

/// Echoed with the result of an [`Action::Append`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AppendToken {
    /// The transaction whose record it is.
    pub tid: Tid,
    /// How soon the record must be durable.
    pub durability: Durability,
    /// True for a `Committed` record.
    pub commit: bool,
}

/// Configuration of a node's transaction core.
#[derive(Clone, Copy, Debug)]
pub struct NodeConfig {
    /// Retransmission timing of the per-transaction machines.
    pub core: CoreConfig,
    /// Deadline of a transaction begun (or joined) without one.
    pub default_timeout: Duration,
    /// At most this many tombstones of decided transactions are kept.
    pub tombstones: usize,
    /// A tombstone is reclaimed this long after the later of its end and
    /// its transaction's deadline (see the module comment).
    pub tombstone_retention: Duration,
    /// At most this many live transactions at this node.
    pub max_live: usize,
    /// How long an incoming call waits for the coordinator to adopt this
    /// node when a client (not a member) brought the transaction here.
    pub enlist_timeout: Duration,
    /// Early lock release (see `crate::manager::TmConfig`).
    pub early_lock_release: bool,
    /// One-phase delegation (see `crate::manager::TmConfig`).
    pub delegate_commit: bool,
}

impl Default for NodeConfig {
    fn default() -> Self {
        NodeConfig {
            core: CoreConfig::default(),
            default_timeout: Duration::from_secs(60),
            tombstones: 100_000,
            tombstone_retention: Duration::from_secs(30),
            max_live: 100_000,
            enlist_timeout: Duration::from_secs(2),
            early_lock_release: true,
            delegate_commit: false,
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

/// Counters of the transaction manager (fixed size: nothing per
/// transaction).
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

/// The size of the transaction manager's bookkeeping and what its limits
/// did (kept apart from [`TmStats`], whose encoding is part of the status
/// service's wire format).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Bookkeeping {
    /// Live transactions.
    pub live: usize,
    /// Remembered tombstones.
    pub tombstones: usize,
    /// Held steps, lingering calls, pending enlistments, waiting votes.
    pub side_tables: usize,
    /// Transactions refused because [`NodeConfig::max_live`] were live.
    pub refused_live_limit: u64,
    /// Tombstones forced out by the cap before their retention window
    /// ended.
    pub tombstones_evicted_early: u64,
}

/// Something that happened, fed to [`TmCore::step`].
#[derive(Debug)]
pub enum Event {
    /// A protocol message from node `from` (at `from_incarnation`, as the
    /// transport knows it; default when unknown).
    Msg {
        /// Sender.
        from: NodeId,
        /// Sender's incarnation.
        from_incarnation: Incarnation,
        /// The message.
        msg: TxMsg,
    },
    /// Time passes: deadlines, retransmissions, inquiries, reclamation.
    Tick,
    /// The creator asks to commit `tid`; the answer comes as
    /// [`Action::Complete`] for `waiter` (see also [`TmCore::commit`]).
    Commit {
        /// The transaction.
        tid: Tid,
        /// Who waits for the answer.
        waiter: WaiterId,
    },
    /// Abort `tid` here (any participant may).
    Abort {
        /// The transaction.
        tid: Tid,
        /// Why.
        reason: String,
    },
    /// A call admitted with [`TmCore::call_in`] ended.
    CallDone {
        /// The transaction.
        tid: Tid,
    },
    /// A node died (or restarted). `incarnation` is the one that died when
    /// known; `born_before` (from [`TmCore::births`] when the death was
    /// announced) limits the news to transactions that existed then.
    PeerDead {
        /// The node.
        node: NodeId,
        /// HostDead or ProcDead.
        status: Status,
        /// The incarnation that died.
        incarnation: Option<Incarnation>,
        /// Only transactions born before this count.
        born_before: Option<u64>,
    },
    /// An [`Action::Send`] of a message about `tid` failed with `status`.
    SendFailed {
        /// The transaction the message was about.
        tid: Tid,
        /// The destination.
        to: NodeId,
        /// Why.
        status: Status,
    },
    /// Answer to [`Action::ResourcePrepare`].
    ResourceVoted {
        /// The transaction.
        tid: Tid,
        /// The resource's vote.
        vote: Vote,
    },
    /// Answer to [`Action::QueryDependencies`]: the union of the resources'
    /// undecided dependencies, or the first refusal.
    Dependencies {
        /// The transaction.
        tid: Tid,
        /// The dependencies.
        result: Result<Vec<Tid>, String>,
    },
    /// Answer to [`Action::VoteBarrier`].
    BarrierDone {
        /// The barrier.
        id: BarrierId,
        /// Ok when every resource allows the vote; the first refusal.
        result: Result<(), String>,
    },
    /// An [`Action::Append`] is in the log at `lsn` (not yet durable).
    Appended {
        /// The token of the action.
        token: AppendToken,
        /// Where.
        lsn: Lsn,
    },
    /// The record of an [`Action::Force`] is durable.
    Forced {
        /// The transaction.
        tid: Tid,
    },
    /// The record of an [`Action::AwaitLazy`] is durable.
    LazyDurable {
        /// The transaction.
        tid: Tid,
    },
    /// The log is durable up to `upto` (answer to [`Action::WaitDurable`];
    /// may be fed at any time).
    Durable {
        /// Durable up to and including this position.
        upto: Lsn,
    },
    /// An append or a force failed.
    LogFailed {
        /// The token of the append.
        token: AppendToken,
    },
}

/// Something for the driver to carry out, in order.
#[derive(Debug)]
pub enum Action<R> {
    /// Send a protocol message. Report a failure as [`Event::SendFailed`].
    Send {
        /// Destination.
        to: NodeId,
        /// The message.
        msg: TxMsg,
    },
    /// Append a record to the node's log; report [`Event::Appended`] (or
    /// [`Event::LogFailed`]) at once, before the next action.
    Append {
        /// The record.
        record: TmRecord,
        /// Echo this back.
        token: AppendToken,
    },
    /// A force of the log up to `lsn` is imminent for `tid`: register a
    /// group-commit intent (a hint; may be ignored).
    ExpectForce {
        /// The transaction.
        tid: Tid,
    },
    /// Force the log up to `lsn`; report [`Event::Forced`] (or
    /// [`Event::LogFailed`]).
    Force {
        /// The transaction.
        tid: Tid,
        /// Up to here.
        lsn: Lsn,
        /// Echo this back on failure.
        token: AppendToken,
    },
    /// Report [`Event::LazyDurable`] once some force covers `lsn`.
    AwaitLazy {
        /// The transaction.
        tid: Tid,
        /// The record's position.
        lsn: Lsn,
    },
    /// Report [`Event::Durable`] once the log is durable up to `lsn`.
    WaitDurable {
        /// Up to here.
        lsn: Lsn,
    },
    /// Ask `resource` to prepare its branch of `tid`; report
    /// [`Event::ResourceVoted`].
    ResourcePrepare {
        /// The transaction.
        tid: Tid,
        /// The resource.
        resource: R,
    },
    /// Phase two, commit, for a two-phase resource. Carry out before the
    /// next action.
    ResourceCommit {
        /// The transaction.
        tid: Tid,
        /// The resource.
        resource: R,
    },
    /// The branch aborted, for a two-phase resource (may repeat). Carry out
    /// before the next action.
    ResourceAbort {
        /// The transaction.
        tid: Tid,
        /// The resource.
        resource: R,
    },
    /// The outcome, for a one-phase resource. Carry out before the next
    /// action.
    ResourceEnded {
        /// The transaction.
        tid: Tid,
        /// The resource.
        resource: R,
        /// The outcome.
        outcome: Outcome,
    },
    /// A sub-transaction ended (see [`Resource::sub_ended`]).
    ResourceSubEnded {
        /// The transaction.
        tid: Tid,
        /// The resource.
        resource: R,
        /// The sub-transaction.
        path: SubPath,
        /// True when it committed into its parent.
        committed: bool,
    },
    /// Ask the resources for `tid`'s undecided dependencies; report
    /// [`Event::Dependencies`].
    QueryDependencies {
        /// The transaction.
        tid: Tid,
        /// The resources to ask.
        resources: Vec<R>,
    },
    /// Wait until each resource allows `tid`'s vote (see
    /// [`Resource::vote_barrier`]), in order; report [`Event::BarrierDone`].
    VoteBarrier {
        /// The barrier.
        id: BarrierId,
        /// The transaction.
        tid: Tid,
        /// The resources to ask.
        resources: Vec<R>,
    },
    /// Answer a commit waiter.
    Complete {
        /// The waiter.
        waiter: WaiterId,
        /// Ok, or the failure `commit` reports.
        result: Result<(), Failure>,
    },
    /// Answer a call that waited to be adopted by the coordinator.
    CallAdmitted {
        /// The call.
        call: CallId,
        /// Ok when admitted (it now counts as running: report
        /// [`Event::CallDone`] when it ends).
        result: Result<(), Failure>,
    },
    /// The transaction reached a named crash point.
    CrashPoint {
        /// The point.
        point: CrashPoint,
        /// The transaction.
        tid: Tid,
    },
    /// The outcome of `tid` is known here (drop any force intent).
    Decided {
        /// The transaction.
        tid: Tid,
        /// The outcome (`None` read-only).
        outcome: Option<Outcome>,
        /// Why it aborted (the status its commit call answers), for an
        /// abort; `None` for a commit.
        cause: Option<Status>,
    },
    /// `tid` is no longer live here (the driver may drop what it keeps
    /// for it).
    Forgotten {
        /// The transaction.
        tid: Tid,
    },
}

/// What [`TmCore::call_in`] did with an incoming call.
#[derive(Debug, PartialEq, Eq)]
pub enum CallIn {
    /// The call runs in the transaction; report [`Event::CallDone`] when it
    /// ends.
    Joined,
    /// The coordinator is being asked to adopt this node: wait for
    /// [`Action::CallAdmitted`].
    Enlisting,
}

/// A transaction begun beyond [`NodeConfig::max_live`]: it has a tid, was
/// born aborted, and its commit reports `failure`.
#[derive(Debug)]
pub struct Refused {
    /// The transaction's id.
    pub tid: Tid,
    /// NoBuffer.
    pub failure: Failure,
}

/// What is remembered of a transaction that ended at this node.
#[derive(Clone, Debug)]
struct Ended {
    /// `None` for a branch that ended read-only (or never ran here).
    outcome: Option<Outcome>,
    cause: Option<(Status, Box<str>)>,
    keep_until: Instant,
}

struct Tombstones {
    map: HashMap<Tid, Ended>,
    order: VecDeque<Tid>,
}

/// Where a branch's local prepare is.
#[derive(Clone, Debug)]
enum Prep {
    Idle,
    /// Waiting for running calls to end.
    WaitingCalls,
    /// Asking the resources in order: `next` is the index of the one asked.
    Resources {
        next: usize,
        vote: Vote,
    },
    /// The coordinator's local vote waits for its barrier.
    Barrier {
        id: BarrierId,
        vote: Vote,
    },
    Done,
}

struct Entry<R> {
    core: TxCore,
    born: u64,
    created: Instant,
    enlisted: Vec<R>,
    active_calls: usize,
    waiters: Vec<WaiterId>,
    outcome: Option<Outcome>,
    next_sub: HashMap<SubPath, u32>,
    baggage: Baggage,
    /// Counts the changes of `baggage` (an entry added or given another
    /// value): a call compares it to learn whether anything changed.
    baggage_changes: u64,
    expecting_force: bool,
    wrote_durable: bool,
    committed_early: bool,
    commit_appended: bool,
    vote_after: Vec<Tid>,
    first_lsn: Option<Lsn>,
    /// The position of the record being forced.
    forcing: Option<Lsn>,
    prep: Prep,
    /// A participant's forced prepare record waits for its barrier.
    after_force_barrier: Option<BarrierId>,
    /// Halted at a crash point by the driver: nothing more is done.
    halted: bool,
}

/// A step of a transaction's action list, held until a condition holds
/// (the durable position reaches an early-released commit; a barrier
/// answers), then continued in order.
enum Step {
    Core(core::Action),
    /// Send this volatile vote once the barrier allows it.
    SendVote {
        to: NodeId,
        msg: TxMsg,
    },
    /// Report this outcome (read-only commit) now.
    Finish(Outcome),
}

enum HoldOn {
    Durable(Lsn),
    Barrier(BarrierId),
}

struct Hold<R> {
    tid: Tid,
    on: HoldOn,
    rest: VecDeque<Step>,
    /// The resources, kept for a barrier of a branch forgotten meanwhile.
    resources: Vec<R>,
}

/// A running call (or a resource's prepare) whose transaction was
/// forgotten here while it ran: when it ends, the resources hear the abort
/// again, so that nothing it did outlives the branch.
struct Lingering<R> {
    calls: usize,
    preparing: bool,
    aborted: bool,
    resources: Vec<R>,
}

struct PendingEnlist<R> {
    call: CallId,
    tid: Tid,
    deadline: Instant,
    give_up: Instant,
    baggage: Baggage,
    resource: Option<R>,
}

struct VoteWait {
    tid: Tid,
    from: NodeId,
    vote: Vote,
    after: Vec<Tid>,
}

/// The node-level transaction core. See the module comment and `API.md`.
pub struct TmCore<R: ResourceRef> {
    node: NodeId,
    incarnation: Incarnation,
    cfg: NodeConfig,
    now: Instant,
    seq: u64,
    births: u64,
    /// Keyed by ids cluster members allocate (a client's transaction is
    /// only entered once its coordinator adopts the node), so hashed as ids:
    /// every call under a transaction looks it up several times.
    txs: IdMap<Tid, Entry<R>>,
    tombstones: Tombstones,
    registered: Vec<R>,
    recovered: HashMap<Tid, Recovered>,
    holds: Vec<Hold<R>>,
    lingering: HashMap<Tid, Lingering<R>>,
    enlists: HashMap<u64, PendingEnlist<R>>,
    enlist_ids: u64,
    vote_waits: Vec<VoteWait>,
    barrier_ids: u64,
    /// Highest commit record released early whose durability read-only
    /// reporters must wait for.
    early_released: Lsn,
    /// Durable position as last reported.
    durable: Lsn,
    stats: TmStats,
    refused_live_limit: u64,
    tombstones_evicted_early: u64,
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

/// The result `commit` reports: Ok, or the abort's cause.
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

fn volatile_vote(msg: &TxMsg) -> bool {
    matches!(
        msg,
        TxMsg::Vote {
            vote: Vote::ReadOnly | Vote::Yes { durable: false },
            ..
        }
    )
}

impl<R: ResourceRef> TmCore<R> {
    /// The core of node `node` at `incarnation`, at time `now`.
    pub fn new(node: NodeId, incarnation: Incarnation, cfg: NodeConfig, now: Instant) -> Self {
        TmCore {
            node,
            incarnation,
            cfg,
            now,
            seq: 1,
            births: 0,
            txs: IdMap::default(),
            tombstones: Tombstones {
                map: HashMap::new(),
                order: VecDeque::new(),
            },
            registered: Vec::new(),
            recovered: HashMap::new(),
            holds: Vec::new(),
            lingering: HashMap::new(),
            enlists: HashMap::new(),
            enlist_ids: 1,
            vote_waits: Vec::new(),
            barrier_ids: 1,
            early_released: Lsn(0),
            durable: Lsn(0),
            stats: TmStats::default(),
            refused_live_limit: 0,
            tombstones_evicted_early: 0,
        }
    }

    /// This node.
    pub fn node(&self) -> NodeId {
        self.node
    }

    /// This node's incarnation.
    pub fn incarnation(&self) -> Incarnation {
        self.incarnation
    }

    /// The configuration.
    pub fn config(&self) -> &NodeConfig {
        &self.cfg
    }

    /// Advances the core's notion of time (never backwards). Every entry
    /// point takes `now` too; this is for drivers that tick separately.
    pub fn set_now(&mut self, now: Instant) {
        if now > self.now {
            self.now = now;
        }
    }

    /// The current time as last given.
    pub fn now(&self) -> Instant {
        self.now
    }

    /// Registers a node-level resource: enlisted in every transaction
    /// recovered from the log.
    pub fn register_resource(&mut self, resource: R) {
        if !self.registered.iter().any(|r| r.same(&resource)) {
            self.registered.push(resource);
        }
    }

    /// The registered resources.
    pub fn registered(&self) -> &[R] {
        &self.registered
    }

    /// Transactions made so far: pass it as `born_before` of a peer death
    /// announced now.
    pub fn births(&self) -> u64 {
        self.births
    }

    /// Counters.
    pub fn stats(&self) -> TmStats {
        self.stats
    }

    /// The size of the bookkeeping and what the limits did.
    pub fn bookkeeping(&self) -> Bookkeeping {
        Bookkeeping {
            live: self.txs.len(),
            tombstones: self.tombstones.map.len(),
            side_tables: self.side_tables(),
            refused_live_limit: self.refused_live_limit,
            tombstones_evicted_early: self.tombstones_evicted_early,
        }
    }

    /// Number of live transactions.
    pub fn live(&self) -> usize {
        self.txs.len()
    }

    /// Number of remembered tombstones.
    pub fn tombstone_count(&self) -> usize {
        self.tombstones.map.len()
    }

    /// Everything kept besides live transactions and tombstones (held
    /// steps, lingering calls, pending enlistments, waiting votes): for
    /// tests of boundedness.
    pub fn side_tables(&self) -> usize {
        self.holds.len() + self.lingering.len() + self.enlists.len() + self.vote_waits.len()
    }

    /// True while `tid` is live here.
    pub fn is_live(&self, tid: Tid) -> bool {
        self.txs.contains_key(&tid)
    }

    /// The earliest time at which a [`Event::Tick`] has something to do
    /// (`None`: nothing is timed). A driver that ticks periodically may
    /// ignore it; a simulator sleeps until it.
    pub fn next_wake(&self) -> Option<Instant> {
        let mut best: Option<Instant> = None;
        let mut take = |t: Instant| best = Some(best.map_or(t, |b: Instant| b.min(t)));
        for e in self.txs.values() {
            if let Some(t) = e.core.next_timer(self.now) {
                take(t);
            }
        }
        for p in self.enlists.values() {
            take(p.give_up);
        }
        if let Some(front) = self.tombstones.order.front() {
            if let Some(e) = self.tombstones.map.get(front) {
                take(e.keep_until);
            }
        }
        best
    }

    // ----- local API (synchronous answers) -----

    /// Begins a transaction coordinated by this node; `timeout` bounds its
    /// life (the configured default when `None`).
    ///
    /// Fails (with the tid it was given, born aborted) with NoBuffer when
    /// [`NodeConfig::max_live`] transactions are live.
    pub fn begin(&mut self, now: Instant, timeout: Option<Duration>) -> Result<Tid, Refused> {
        self.set_now(now);
        let tid = Tid::new(self.node, self.incarnation, self.seq);
        self.seq += 1;
        self.stats.begun += 1;
        let timeout = timeout.unwrap_or(self.cfg.default_timeout);
        let deadline = self.now + timeout;
        if self.txs.len() >= self.cfg.max_live {
            self.refused_live_limit += 1;
            let failure = self.live_limit_failure();
            self.stats.aborted += 1;
            self.tombstone(
                tid,
                Some(Outcome::Aborted),
                Some((Status::NoBuffer, failure.detail.clone().into())),
                deadline,
            );
            return Err(Refused { tid, failure });
        }
        let core = TxCore::coordinator(tid, Some(deadline), self.cfg.core)
            .with_delegation(self.cfg.delegate_commit);
        self.insert(tid, core);
        Ok(tid)
    }

    fn live_limit_failure(&self) -> Failure {
        Failure::new(
            Status::NoBuffer,
            format!(
                "node {} runs {} transactions, its limit",
                self.node, self.cfg.max_live
            ),
        )
    }

    fn insert(&mut self, tid: Tid, core: TxCore) -> &mut Entry<R> {
        let born = self.births;
        self.births += 1;
        let now = self.now;
        self.txs.entry(tid).or_insert_with(|| Entry {
            core,
            born,
            created: now,
            enlisted: Vec::new(),
            active_calls: 0,
            waiters: Vec::new(),
            outcome: None,
            next_sub: HashMap::new(),
            baggage: Baggage::default(),
            baggage_changes: 0,
            expecting_force: false,
            wrote_durable: false,
            committed_early: false,
            commit_appended: false,
            vote_after: Vec::new(),
            first_lsn: None,
            forcing: None,
            prep: Prep::Idle,
            after_force_barrier: None,
            halted: false,
        })
    }

    fn unknown(&self, tid: Tid) -> Failure {
        match self.tombstones.map.get(&tid).map(|e| (e.outcome, &e.cause)) {
            Some((Some(Outcome::Aborted), Some((status, reason))))
                if *status == Status::NoBuffer =>
            {
                Failure::new(*status, format!("transaction {tid} aborted: {reason}"))
            }
            Some((Some(Outcome::Aborted), _)) => {
                Failure::new(Status::Aborted, format!("transaction {tid} aborted"))
            }
            Some((o, _)) => Failure::new(
                Status::NoSuchTransaction,
                format!("transaction {tid} already ended here ({o:?})"),
            ),
            None => Failure::new(
                Status::NoSuchTransaction,
                format!("no transaction {tid} at node {}", self.node),
            ),
        }
    }

    fn not_active(tid: Tid, e: &Entry<R>) -> Failure {
        match e.outcome {
            Some(Outcome::Aborted) => {
                Failure::new(Status::Aborted, format!("transaction {tid} aborted"))
            }
            _ => Failure::new(
                Status::Aborted,
                format!(
                    "transaction {tid} is {} here: no more work may join it",
                    phase_name(e.core.phase())
                ),
            ),
        }
    }

    /// Records that this node is about to call `to` (at `to_incarnation`,
    /// default when unknown) on behalf of `tid`: `to` becomes a child.
    ///
    /// Fails with Aborted when the transaction is no longer active here and
    /// NoSuchTransaction (or the abort's status) when it is unknown here.
    pub fn call_out(
        &mut self,
        tid: Tid,
        to: NodeId,
        to_incarnation: Incarnation,
    ) -> Result<(), Failure> {
        let node = self.node;
        let Some(e) = self.txs.get_mut(&tid) else {
            return Err(self.unknown(tid));
        };
        let ok = if to == node {
            e.core.is_active()
        } else {
            e.core.add_child(to, to_incarnation)
        };
        if ok {
            Ok(())
        } else {
            Err(Self::not_active(tid, e))
        }
    }

    /// A call on behalf of `ctx` arrived from `from` (a node of the cluster
    /// when `from_member`, else a client) for a service or resource
    /// `resource`: this node joins the transaction if it had not, the
    /// resource is enlisted, and the call counts as running.
    ///
    /// Fails with Aborted when the transaction already ended here or is no
    /// longer active, NoSuchTransaction when a call to the coordinator
    /// names a transaction it does not run, NoBuffer at the live limit.
    /// A call a client brought returns [`CallIn::Enlisting`]: the answer
    /// comes as [`Action::CallAdmitted`] (TimedOut when the coordinator
    /// does not answer in time, Aborted when it refuses).
    #[allow(clippy::too_many_arguments)]
    pub fn call_in(
        &mut self,
        now: Instant,
        ctx: &TxContext,
        from: NodeId,
        from_member: bool,
        resource: Option<R>,
        call: CallId,
        out: &mut Vec<Action<R>>,
    ) -> Result<CallIn, Failure> {
        self.set_now(now);
        let tid = ctx.tid;
        if !self.txs.contains_key(&tid) {
            if tid.node == self.node {
                return Err(self.unknown(tid));
            }
            if let Some(e) = self.tombstones.map.get(&tid) {
                return Err(Failure::new(
                    Status::Aborted,
                    format!("transaction {tid} already ended here ({:?})", e.outcome),
                ));
            }
            if self.txs.len() + self.enlists.len() >= self.cfg.max_live {
                self.refused_live_limit += 1;
                return Err(self.live_limit_failure());
            }
            let deadline = self.now
                + ctx
                    .budget_us
                    .map(Duration::from_micros)
                    .unwrap_or(self.cfg.default_timeout);
            if !from_member {
                let request = self.enlist_ids;
                self.enlist_ids += 1;
                self.enlists.insert(
                    request,
                    PendingEnlist {
                        call,
                        tid,
                        deadline,
                        give_up: self.now + self.cfg.enlist_timeout,
                        baggage: ctx.baggage.clone(),
                        resource,
                    },
                );
                self.send(tid.node, TxMsg::Enlist { tid, request }, out);
                return Ok(CallIn::Enlisting);
            }
            let core = TxCore::participant(tid, from, Some(deadline), self.cfg.core);
            self.insert(tid, core);
        }
        self.join(tid, &ctx.baggage, resource)?;
        Ok(CallIn::Joined)
    }

    fn join(&mut self, tid: Tid, baggage: &Baggage, resource: Option<R>) -> Result<(), Failure> {
        let e = self.txs.get_mut(&tid).expect("joined a live transaction");
        if !e.core.is_active() {
            return Err(Self::not_active(tid, e));
        }
        e.active_calls += 1;
        if !baggage.is_empty() && merge_baggage(&mut e.baggage, baggage) {
            e.baggage_changes += 1;
        }
        if let Some(r) = resource {
            enlist(e, r);
        }
        Ok(())
    }

    /// Enlists a resource in a transaction active here.
    ///
    /// Fails with NoSuchTransaction when unknown here, Aborted when no
    /// longer active.
    pub fn enlist(&mut self, tid: Tid, resource: R) -> Result<(), Failure> {
        let Some(e) = self.txs.get_mut(&tid) else {
            return Err(self.unknown(tid));
        };
        if !e.core.is_active() {
            return Err(Self::not_active(tid, e));
        }
        enlist(e, resource);
        Ok(())
    }

    /// Starts a sub-transaction of the (sub-)transaction in `ctx`.
    ///
    /// Fails with NoSuchTransaction / Aborted when not active here.
    pub fn sub_begin(&mut self, ctx: &TxContext) -> Result<TxContext, Failure> {
        let Some(e) = self.txs.get_mut(&ctx.tid) else {
            return Err(self.unknown(ctx.tid));
        };
        if !e.core.is_active() {
            return Err(Self::not_active(ctx.tid, e));
        }
        let n = e.next_sub.entry(ctx.path.clone()).or_insert(0);
        *n += 1;
        Ok(TxContext {
            path: ctx.path.child(*n),
            ..ctx.clone()
        })
    }

    /// Ends a sub-transaction (committed into its parent, or aborted); the
    /// resources and every child but `from` are told.
    ///
    /// Fails with NoSuchTransaction / Aborted when not active here,
    /// BadRequest for the top-level path.
    pub fn sub_end(
        &mut self,
        tid: Tid,
        path: &SubPath,
        committed: bool,
        from: Option<NodeId>,
        out: &mut Vec<Action<R>>,
    ) -> Result<(), Failure> {
        if path.is_top() {
            return Err(Failure::new(
                Status::BadRequest,
                "the top level is not a sub-transaction",
            ));
        }
        let Some(e) = self.txs.get_mut(&tid) else {
            return Err(self.unknown(tid));
        };
        if !e.core.is_active() {
            return Err(Self::not_active(tid, e));
        }
        apply_sub_end(tid, e, path, committed, out);
        let children = e.core.children();
        for (child, _) in children {
            if Some(child) != from {
                self.send(
                    child,
                    TxMsg::SubEnded {
                        tid,
                        path: path.clone(),
                        committed,
                    },
                    out,
                );
            }
        }
        Ok(())
    }

    /// Starts the commit of a transaction this node created. `Some` is the
    /// answer now (decided already, or not this node's to commit); `None`
    /// means the answer comes as [`Action::Complete`] for `waiter`.
    ///
    /// Answers NotCoordinator when another node (or an earlier life of this
    /// one) created it, NoSuchTransaction when unknown, the abort's cause
    /// when it aborted (HostDead/ProcDead, TimedOut, Aborted, NoBuffer),
    /// InDoubt when the commit record could not be forced.
    pub fn commit(
        &mut self,
        now: Instant,
        tid: Tid,
        waiter: WaiterId,
        out: &mut Vec<Action<R>>,
    ) -> Option<Result<(), Failure>> {
        self.set_now(now);
        if tid.node != self.node || tid.incarnation != self.incarnation {
            return Some(Err(Failure::new(
                Status::NotCoordinator,
                format!(
                    "only node {} (incarnation {}) can commit {tid}",
                    tid.node, tid.incarnation
                ),
            )));
        }
        let Some(e) = self.txs.get_mut(&tid) else {
            return Some(self.ended_result(tid));
        };
        if let Some(o) = e.outcome {
            return Some(outcome_result(tid, o, e.core.abort_cause()));
        }
        e.waiters.push(waiter);
        // A coordinator with no children forces its commit record right
        // after its own resources prepared: imminent. With children the
        // record waits for their votes (their forces), so an intent would
        // hold this node's flusher back for others: none.
        if e.core.children().is_empty()
            && e.enlisted
                .iter()
                .any(|r| r.class() == ParticipationClass::TwoPhase)
        {
            expect_force(tid, e, out);
        }
        self.feed(tid, Input::Commit, out);
        self.after_step(out);
        None
    }

    fn ended_result(&self, tid: Tid) -> Result<(), Failure> {
        match self.tombstones.map.get(&tid) {
            Some(Ended {
                outcome: Some(o),
                cause,
                ..
            }) => outcome_result(tid, *o, cause.as_ref().map(|(s, r)| (*s, &**r))),
            _ => Err(self.unknown(tid)),
        }
    }

    /// Aborts `tid` here (it spreads up and down the tree). No effect when
    /// it is decided or in doubt here.
    ///
    /// Fails with NoSuchTransaction when unknown here.
    pub fn abort(
        &mut self,
        tid: Tid,
        reason: &str,
        out: &mut Vec<Action<R>>,
    ) -> Result<(), Failure> {
        if !self.txs.contains_key(&tid) {
            return Err(self.unknown(tid));
        }
        self.feed(tid, Input::Abort(reason.to_string()), out);
        self.after_step(out);
        Ok(())
    }

    // ----- queries -----

    /// The deadline of `tid` as known here.
    pub fn deadline(&self, tid: Tid) -> Option<Instant> {
        self.txs.get(&tid).and_then(|e| e.core.deadline())
    }

    /// The baggage merged here for `tid`.
    pub fn baggage(&self, tid: Tid) -> Option<Baggage> {
        self.txs.get(&tid).map(|e| e.baggage.clone())
    }

    /// A mark of `tid`'s baggage here for a call that brought `brought`,
    /// taken when it joined: `Some` when the baggage here is exactly
    /// `brought` (every entry here came with the same value), `None` when it
    /// holds more or `tid` is not live here.
    pub fn baggage_mark(&self, tid: Tid, brought: &Baggage) -> Option<u64> {
        let e = self.txs.get(&tid)?;
        e.baggage
            .0
            .iter()
            .all(|i| brought.get(&i.key) == Some(&i.value))
            .then_some(e.baggage_changes)
    }

    /// What the response to a call marked `mark` (see
    /// [`TmCore::baggage_mark`]) returns of `tid`'s baggage: nothing when
    /// it is still what the call brought (the caller has it), else all of
    /// it; nothing when `tid` is not live here.
    pub fn baggage_since(&self, tid: Tid, mark: Option<u64>) -> Baggage {
        match self.txs.get(&tid) {
            Some(e) if mark != Some(e.baggage_changes) => e.baggage.clone(),
            _ => Baggage::default(),
        }
    }

    /// Merges baggage returned by a call.
    pub fn merge_baggage(&mut self, tid: Tid, baggage: &Baggage) {
        if let Some(e) = self.txs.get_mut(&tid) {
            if merge_baggage(&mut e.baggage, baggage) {
                e.baggage_changes += 1;
            }
        }
    }

    /// True when `tid` aborted here (live or remembered).
    pub fn is_aborted(&self, tid: Tid) -> bool {
        match self.txs.get(&tid) {
            Some(e) => e.outcome == Some(Outcome::Aborted),
            None => {
                self.lingering.get(&tid).is_some_and(|l| l.aborted)
                    || self
                        .tombstones
                        .map
                        .get(&tid)
                        .is_some_and(|e| e.outcome == Some(Outcome::Aborted))
            }
        }
    }

    /// The outcome remembered for a finished transaction (`Some(None)` for
    /// a read-only branch), `None` when live or unknown.
    pub fn finished_outcome(&self, tid: Tid) -> Option<Option<Outcome>> {
        self.tombstones.map.get(&tid).map(|e| e.outcome)
    }

    /// What recovery found about `tid`.
    pub fn recovered(&self, tid: Tid) -> Option<Recovered> {
        self.recovered.get(&tid).copied()
    }

    /// The status of a live transaction.
    pub fn status(&self, tid: Tid) -> Option<TxStatus> {
        self.txs.get(&tid).map(|e| self.describe(tid, e))
    }

    /// Every live transaction, oldest first.
    pub fn list(&self) -> Vec<TxStatus> {
        let mut v: Vec<TxStatus> = self.txs.iter().map(|(t, e)| self.describe(*t, e)).collect();
        v.sort_by_key(|s| std::cmp::Reverse(s.age_ms));
        v
    }

    fn describe(&self, tid: Tid, e: &Entry<R>) -> TxStatus {
        TxStatus {
            tid,
            coordinator: e.core.is_coordinator(),
            phase: phase_name(e.core.phase()).to_string(),
            in_doubt: e.core.in_doubt(),
            parent: e.core.voter().or(e.core.parent()),
            children: e.core.children().into_iter().map(|(n, _)| n).collect(),
            resources: e.enlisted.iter().map(|r| r.name()).collect(),
            active_calls: e.active_calls,
            age_ms: self.now.saturating_duration_since(e.created).as_millis() as u64,
        }
    }

    /// The lowest log position still needed: the first record of the
    /// oldest live transaction that wrote one.
    pub fn low_water(&self) -> Option<Lsn> {
        self.txs.values().filter_map(|e| e.first_lsn).min()
    }

    /// The phase of a live transaction (tests, simulators).
    pub fn phase(&self, tid: Tid) -> Option<&Phase> {
        self.txs.get(&tid).map(|e| e.core.phase())
    }

    /// Stops all progress of `tid` here: the driver halted it at a crash
    /// point (it waits to be killed). Later events for it are ignored.
    pub fn halt(&mut self, tid: Tid) {
        if let Some(e) = self.txs.get_mut(&tid) {
            e.halted = true;
        }
        self.holds.retain(|h| h.tid != tid);
    }

    // ----- recovery -----

    /// Rebuilds the table from the records recovery read (see
    /// [`scan`]): committed transactions that did not end drive phase two
    /// again, prepared ones without an outcome are in doubt (they ask their
    /// parent). Every registered resource is enlisted in both. Decided ones
    /// are remembered as tombstones. Call once, before any other event.
    pub fn recover(&mut self, scan: RecoveryScan) -> RecoveryReport {
        let mut report = RecoveryReport::default();
        let keep_until = self.now + self.cfg.tombstone_retention;
        for rec in scan.txs {
            let tid = rec.tid;
            match rec.state {
                RecoveredTx::Ended => {
                    self.recovered.insert(tid, Recovered::Committed);
                    self.tombstone(tid, Some(Outcome::Committed), None, keep_until);
                    report.committed += 1;
                }
                RecoveredTx::Aborted => {
                    self.recovered.insert(tid, Recovered::Aborted);
                    self.tombstone(tid, Some(Outcome::Aborted), None, keep_until);
                    report.aborted += 1;
                }
                RecoveredTx::Committed { voter, children } => {
                    let core = TxCore::recovered_committed(tid, voter, children, self.cfg.core);
                    self.install_recovered(tid, core, Recovered::Committed, rec.first_lsn);
                    report.redriven.push(tid);
                }
                RecoveredTx::Prepared { parent, children } => {
                    let core = TxCore::recovered_prepared(tid, parent, children, self.cfg.core);
                    self.install_recovered(tid, core, Recovered::InDoubt, rec.first_lsn);
                    report.in_doubt.push(tid);
                }
            }
        }
        report
    }

    fn install_recovered(&mut self, tid: Tid, core: TxCore, state: Recovered, first: Lsn) {
        self.recovered.insert(tid, state);
        let resources = self.registered.clone();
        let e = self.insert(tid, core);
        e.wrote_durable = true;
        e.first_lsn = Some(first);
        for r in resources {
            enlist(e, r);
        }
    }

    // ----- events -----

    /// Feeds one event at time `now`; returns the actions to carry out, in
    /// order.
    pub fn step(&mut self, now: Instant, event: Event) -> Vec<Action<R>> {
        let mut out = Vec::new();
        self.step_into(now, event, &mut out);
        out
    }

    /// [`TmCore::step`] appending to `out` (drivers reuse the buffer).
    pub fn step_into(&mut self, now: Instant, event: Event, out: &mut Vec<Action<R>>) {
        self.set_now(now);
        match event {
            Event::Msg {
                from,
                from_incarnation,
                msg,
            } => self.on_msg(from, from_incarnation, msg, out),
            Event::Tick => self.on_tick(out),
            Event::Commit { tid, waiter } => {
                if let Some(result) = self.commit(now, tid, waiter, out) {
                    out.push(Action::Complete { waiter, result });
                }
            }
            Event::Abort { tid, reason } => {
                let _ = self.abort(tid, &reason, out);
            }
            Event::CallDone { tid } => self.on_call_done(tid, out),
            Event::PeerDead {
                node,
                status,
                incarnation,
                born_before,
            } => self.on_peer_dead(node, status, incarnation, born_before, out),
            Event::SendFailed { tid, to, status } => {
                if matches!(
                    status,
                    Status::HostDead | Status::ProcDead | Status::AddrError
                ) {
                    self.feed(tid, Input::PeerDead(to, status), out);
                }
            }
            Event::ResourceVoted { tid, vote } => self.on_resource_voted(tid, vote, out),
            Event::Dependencies { tid, result } => self.on_dependencies(tid, result, out),
            Event::BarrierDone { id, result } => self.on_barrier(id, result, out),
            Event::Appended { token, lsn } => self.on_appended(token, lsn, out),
            Event::Forced { tid } => self.on_forced(tid, out),
            Event::LazyDurable { tid } => self.feed(tid, Input::LazyDurable, out),
            Event::Durable { upto } => self.on_durable(upto, out),
            Event::LogFailed { token } => self.on_log_failed(token, out),
        }
        self.after_step(out);
    }

    /// Re-checks what waits on other transactions (votes naming commit
    /// records) after anything changed.
    fn after_step(&mut self, out: &mut Vec<Action<R>>) {
        if self.vote_waits.is_empty() {
            return;
        }
        loop {
            let mut progressed = false;
            let waits = std::mem::take(&mut self.vote_waits);
            for w in waits {
                match self.deps_state(w.tid, &w.after) {
                    DepState::Pending => self.vote_waits.push(w),
                    DepState::Committed => {
                        progressed = true;
                        self.feed(
                            w.tid,
                            Input::Vote {
                                from: w.from,
                                vote: w.vote,
                            },
                            out,
                        );
                    }
                    DepState::Aborted(dep, reason) => {
                        progressed = true;
                        self.vote_after_failed(w.tid, w.from, dep, reason, out);
                    }
                }
            }
            if !progressed || self.vote_waits.is_empty() {
                break;
            }
        }
    }

    fn deps_state(&self, tid: Tid, after: &[Tid]) -> DepState {
        for &dep in after {
            let aborted =
                || DepState::Aborted(dep, format!("{tid} used writes of {dep}, which aborted"));
            match self.txs.get(&dep) {
                Some(e) => {
                    if e.commit_appended || e.outcome == Some(Outcome::Committed) {
                        continue;
                    }
                    if e.outcome == Some(Outcome::Aborted) {
                        return aborted();
                    }
                    return DepState::Pending;
                }
                None => match self.tombstones.map.get(&dep).map(|e| e.outcome) {
                    Some(Some(Outcome::Committed)) => continue,
                    _ => return aborted(),
                },
            }
        }
        DepState::Committed
    }

    fn vote_after_failed(
        &mut self,
        tid: Tid,
        from: NodeId,
        dep: Tid,
        reason: String,
        out: &mut Vec<Action<R>>,
    ) {
        // The participant named `dep` as undecided: it has not heard of its
        // abort, and until it does, whoever locks what `dep` wrote there
        // uses its writes and is doomed. What an inquiry would answer, said
        // now.
        self.send(
            from,
            TxMsg::Abort {
                tid: dep,
                status: Status::Aborted,
                reason: format!("{dep} aborted at its coordinator"),
            },
            out,
        );
        self.feed(
            tid,
            Input::Vote {
                from,
                vote: Vote::No(reason),
            },
            out,
        );
    }

    fn send(&mut self, to: NodeId, msg: TxMsg, out: &mut Vec<Action<R>>) {
        self.stats.messages += 1;
        out.push(Action::Send { to, msg });
    }

    fn tombstone(
        &mut self,
        tid: Tid,
        outcome: Option<Outcome>,
        cause: Option<(Status, Box<str>)>,
        protect_until: Instant,
    ) {
        let keep_until = protect_until.max(self.now) + self.cfg.tombstone_retention;
        let ended = Ended {
            outcome,
            cause,
            keep_until,
        };
        if self.tombstones.map.insert(tid, ended).is_none() {
            self.tombstones.order.push_back(tid);
        }
        let cap = self.cfg.tombstones.max(1);
        while self.tombstones.order.len() > cap {
            if let Some(old) = self.tombstones.order.pop_front() {
                if let Some(e) = self.tombstones.map.remove(&old) {
                    if e.keep_until > self.now {
                        self.tombstones_evicted_early += 1;
                    }
                }
            }
        }
    }

    fn on_msg(
        &mut self,
        from: NodeId,
        from_incarnation: Incarnation,
        msg: TxMsg,
        out: &mut Vec<Action<R>>,
    ) {
        let tid = msg.tid();
        let live = self.txs.contains_key(&tid);
        let one_phase = matches!(msg, TxMsg::DelegatedPrepare { .. });
        let input = match msg {
            TxMsg::Prepare {
                incarnation,
                aborted_subs,
                ..
            }
            | TxMsg::TracedPrepare {
                incarnation,
                aborted_subs,
                ..
            }
            | TxMsg::DelegatedPrepare {
                incarnation,
                aborted_subs,
                ..
            } => {
                if !live
                    && incarnation != self.incarnation
                    && !self.tombstones.map.contains_key(&tid)
                {
                    // The caller reached an earlier life of this node: that
                    // branch's work is gone.
                    let vote = Vote::No(format!(
                        "node {} restarted (incarnation {} -> {}): its branch was lost",
                        self.node, incarnation, self.incarnation
                    ));
                    self.send(from, TxMsg::Vote { tid, vote }, out);
                    return;
                }
                if let Some(e) = self.txs.get_mut(&tid) {
                    expect_force(tid, e, out);
                }
                // This node may decide only when no resource here waits on
                // another transaction (vote barriers, dependencies: the
                // decider skips them) and each agrees to it.
                let one_phase = one_phase
                    && self
                        .txs
                        .get(&tid)
                        .is_some_and(|e| e.enlisted.iter().all(|r| r.may_decide_alone()));
                Input::Prepare {
                    from,
                    aborted_subs,
                    one_phase,
                }
            }
            TxMsg::Vote { vote, .. } => Input::Vote { from, vote },
            TxMsg::VoteAfter { vote, after, .. } => match self.deps_state(tid, &after) {
                DepState::Committed => Input::Vote { from, vote },
                DepState::Aborted(dep, reason) => {
                    self.vote_after_failed(tid, from, dep, reason, out);
                    return;
                }
                DepState::Pending => {
                    if live {
                        self.vote_waits.push(VoteWait {
                            tid,
                            from,
                            vote,
                            after,
                        });
                    }
                    return;
                }
            },
            TxMsg::Decision { commit: true, .. } => {
                if self.txs.get(&tid).is_some_and(|e| e.core.in_doubt()) {
                    out.push(Action::CrashPoint {
                        point: CrashPoint::ParticipantPhaseTwo,
                        tid,
                    });
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
                let answer = match self.txs.get(&tid) {
                    Some(e) => e.core.answer(),
                    None => match self.tombstones.map.get(&tid).map(|e| e.outcome) {
                        Some(Some(Outcome::Committed)) => Answer::Committed,
                        // Presumed abort: no record means abort.
                        _ => Answer::Aborted,
                    },
                };
                self.send(from, TxMsg::Outcome { tid, answer }, out);
                return;
            }
            TxMsg::Enlist { request, .. } => {
                let ok = match self.txs.get_mut(&tid) {
                    Some(e) if tid.node == self.node => e.core.add_child(from, from_incarnation),
                    _ => false,
                };
                self.send(from, TxMsg::Enlisted { tid, request, ok }, out);
                return;
            }
            TxMsg::Enlisted { request, ok, .. } => {
                self.on_enlisted(request, ok, out);
                return;
            }
            TxMsg::SubEnded {
                path, committed, ..
            } => {
                let _ = self.sub_end(tid, &path, committed, Some(from), out);
                return;
            }
        };
        if live {
            self.feed(tid, input, out);
            return;
        }
        // Not live here: answer from the tombstone, or as for a
        // transaction never heard of.
        let outcome = self.tombstones.map.get(&tid).map(|e| e.outcome);
        let actions = match outcome {
            Some(o) => late(tid, o, input),
            None => match input {
                // Never heard of it: the request never arrived here.
                Input::Prepare { from, .. } => {
                    let until = self.now;
                    self.tombstone(tid, None, None, until);
                    vec![core::Action::Send(
                        from,
                        TxMsg::Vote {
                            tid,
                            vote: Vote::ReadOnly,
                        },
                    )]
                }
                Input::CommitDecision { from } => {
                    vec![core::Action::Send(from, TxMsg::Ack { tid })]
                }
                Input::AbortNotice { .. } => {
                    // Refuse late calls of this transaction.
                    let until = self.now;
                    self.tombstone(tid, Some(Outcome::Aborted), None, until);
                    Vec::new()
                }
                _ => Vec::new(),
            },
        };
        for a in actions {
            if let core::Action::Send(to, msg) = a {
                self.send(to, msg, out);
            }
        }
    }

    fn on_enlisted(&mut self, request: u64, ok: bool, out: &mut Vec<Action<R>>) {
        let Some(p) = self.enlists.remove(&request) else {
            return;
        };
        let tid = p.tid;
        let result = if !ok {
            Err(Failure::new(
                Status::Aborted,
                format!("coordinator {} does not run {tid} any more", tid.node),
            ))
        } else {
            if !self.txs.contains_key(&tid) {
                if let Some(e) = self.tombstones.map.get(&tid) {
                    let f = Failure::new(
                        Status::Aborted,
                        format!("transaction {tid} already ended here ({:?})", e.outcome),
                    );
                    out.push(Action::CallAdmitted {
                        call: p.call,
                        result: Err(f),
                    });
                    return;
                }
                let core = TxCore::participant(tid, tid.node, Some(p.deadline), self.cfg.core);
                self.insert(tid, core);
            }
            self.join(tid, &p.baggage, p.resource)
        };
        out.push(Action::CallAdmitted {
            call: p.call,
            result,
        });
    }

    fn on_call_done(&mut self, tid: Tid, out: &mut Vec<Action<R>>) {
        if let Some(e) = self.txs.get_mut(&tid) {
            e.active_calls = e.active_calls.saturating_sub(1);
            let zero = e.active_calls == 0;
            if e.outcome == Some(Outcome::Aborted) {
                // The transaction aborted here while this call ran: whatever
                // the call did after the resources applied the abort is
                // undone now.
                abort_two_phase(tid, &e.enlisted, out);
            }
            if zero && matches!(e.prep, Prep::WaitingCalls) {
                self.start_resources(tid, out);
            }
            return;
        }
        if let Some(l) = self.lingering.get_mut(&tid) {
            l.calls = l.calls.saturating_sub(1);
            if l.aborted {
                abort_two_phase(tid, &l.resources, out);
            }
            if l.calls == 0 && !l.preparing {
                self.lingering.remove(&tid);
            }
        }
    }

    fn on_peer_dead(
        &mut self,
        node: NodeId,
        status: Status,
        gone: Option<Incarnation>,
        born_before: Option<u64>,
        out: &mut Vec<Action<R>>,
    ) {
        let died =
            |inc: Incarnation| gone.is_none_or(|g| inc == g || inc == Incarnation::default());
        let mut involved: Vec<(u64, Tid)> = self
            .txs
            .iter()
            .filter(|(_, e)| born_before.is_none_or(|b| e.born < b))
            .filter(|(_, e)| {
                e.core.parent() == Some(node)
                    || e.core.voter() == Some(node)
                    || e.core
                        .children()
                        .iter()
                        .any(|(n, inc)| *n == node && died(*inc))
            })
            .map(|(t, e)| (e.born, *t))
            .collect();
        involved.sort();
        for (_, tid) in involved {
            self.feed(tid, Input::PeerDead(node, status), out);
        }
    }

    fn on_tick(&mut self, out: &mut Vec<Action<R>>) {
        let now = self.now;
        // Local prepares waiting for calls past the deadline vote No.
        let late_calls: Vec<Tid> = self
            .txs
            .iter()
            .filter(|(_, e)| {
                matches!(e.prep, Prep::WaitingCalls) && e.core.deadline().is_some_and(|d| now >= d)
            })
            .map(|(t, _)| *t)
            .collect();
        for tid in late_calls {
            if let Some(e) = self.txs.get_mut(&tid) {
                e.prep = Prep::Done;
            }
            self.feed(
                tid,
                Input::LocalVote(Vote::No("calls still running at the deadline".into())),
                out,
            );
        }
        let mut tids: Vec<(u64, Tid)> = self.txs.iter().map(|(t, e)| (e.born, *t)).collect();
        tids.sort();
        for (_, tid) in tids {
            self.feed(tid, Input::Tick(now), out);
        }
        // Enlistments the coordinator did not answer in time.
        let expired: Vec<u64> = self
            .enlists
            .iter()
            .filter(|(_, p)| now >= p.give_up)
            .map(|(r, _)| *r)
            .collect();
        for request in expired {
            if let Some(p) = self.enlists.remove(&request) {
                out.push(Action::CallAdmitted {
                    call: p.call,
                    result: Err(Failure::new(
                        Status::TimedOut,
                        format!("coordinator {} did not adopt this node in time", p.tid.node),
                    )),
                });
            }
        }
        // Tombstones past their retention window.
        while let Some(front) = self.tombstones.order.front().copied() {
            match self.tombstones.map.get(&front) {
                Some(e) if e.keep_until > now => break,
                _ => {
                    self.tombstones.order.pop_front();
                    self.tombstones.map.remove(&front);
                }
            }
        }
    }

    fn on_resource_voted(&mut self, tid: Tid, vote: Vote, out: &mut Vec<Action<R>>) {
        let Some(e) = self.txs.get_mut(&tid) else {
            // The branch ended while its resource prepared: what the
            // resource registered since (a prepared write set, items in
            // violation mode) would outlive it. It hears the abort again.
            if let Some(l) = self.lingering.get_mut(&tid) {
                if l.preparing {
                    l.preparing = false;
                    if l.aborted {
                        abort_two_phase(tid, &l.resources, out);
                    }
                    if l.calls == 0 {
                        self.lingering.remove(&tid);
                    }
                }
            }
            return;
        };
        let Prep::Resources { next, vote: so_far } = e.prep.clone() else {
            return;
        };
        let vote = so_far.and(vote);
        self.continue_resources(tid, next + 1, vote, out);
    }

    fn on_dependencies(
        &mut self,
        tid: Tid,
        result: Result<Vec<Tid>, String>,
        out: &mut Vec<Action<R>>,
    ) {
        let Some(e) = self.txs.get_mut(&tid) else {
            return;
        };
        if e.halted {
            return;
        }
        let after = result.ok().filter(|after| {
            !after.is_empty()
                && after
                    .iter()
                    .all(|d| d.node == tid.node && d.incarnation == tid.incarnation)
        });
        match after {
            Some(after) => {
                // Vote now naming them: the coordinator orders the commit
                // records in its own log.
                e.vote_after = after;
                self.feed(tid, Input::Forced, out);
            }
            None => self.barrier_after_force(tid, out),
        }
    }

    fn barrier_after_force(&mut self, tid: Tid, out: &mut Vec<Action<R>>) {
        let id = self.barrier_id();
        let Some(e) = self.txs.get_mut(&tid) else {
            return;
        };
        e.after_force_barrier = Some(id);
        out.push(Action::VoteBarrier {
            id,
            tid,
            resources: e.enlisted.clone(),
        });
    }

    fn barrier_id(&mut self) -> BarrierId {
        let id = BarrierId(self.barrier_ids);
        self.barrier_ids += 1;
        id
    }

    fn on_barrier(&mut self, id: BarrierId, result: Result<(), String>, out: &mut Vec<Action<R>>) {
        // A held step (a volatile vote)?
        if let Some(i) = self
            .holds
            .iter()
            .position(|h| matches!(h.on, HoldOn::Barrier(b) if b == id))
        {
            let mut hold = self.holds.swap_remove(i);
            if let Some(Step::SendVote { to, msg }) = hold.rest.pop_front() {
                let msg = match (result, msg) {
                    (Err(reason), TxMsg::Vote { tid, .. }) => TxMsg::Vote {
                        tid,
                        vote: Vote::No(reason),
                    },
                    (_, msg) => msg,
                };
                self.send(to, msg, out);
            }
            self.run_steps(hold.tid, hold.rest, Some(hold.resources), out);
            return;
        }
        // A participant's vote after its force, or a coordinator's local
        // vote.
        let found = self.txs.iter().find_map(|(t, e)| {
            if e.after_force_barrier == Some(id) {
                Some((*t, true))
            } else if matches!(e.prep, Prep::Barrier { id: b, .. } if b == id) {
                Some((*t, false))
            } else {
                None
            }
        });
        match found {
            Some((tid, true)) => {
                if let Some(e) = self.txs.get_mut(&tid) {
                    e.after_force_barrier = None;
                }
                match result {
                    Ok(()) => self.feed(tid, Input::Forced, out),
                    Err(reason) => self.feed(tid, Input::Abort(reason), out),
                }
            }
            Some((tid, false)) => {
                let e = self.txs.get_mut(&tid).expect("found above");
                let Prep::Barrier { vote, .. } = std::mem::replace(&mut e.prep, Prep::Done) else {
                    return;
                };
                let vote = match result {
                    Ok(()) => vote,
                    Err(reason) => Vote::No(reason),
                };
                self.feed(tid, Input::LocalVote(vote), out);
            }
            None => {}
        }
    }

    fn on_appended(&mut self, token: AppendToken, lsn: Lsn, out: &mut Vec<Action<R>>) {
        let tid = token.tid;
        let early_lock_release = self.cfg.early_lock_release;
        let Some(e) = self.txs.get_mut(&tid) else {
            return;
        };
        e.first_lsn.get_or_insert(lsn);
        let coordinator = e.core.is_coordinator();
        e.commit_appended |= token.commit && coordinator;
        match token.durability {
            Durability::None => {}
            Durability::Lazy => out.push(Action::AwaitLazy { tid, lsn }),
            Durability::Force => {
                self.stats.forced_records += 1;
                e.wrote_durable = true;
                e.forcing = Some(lsn);
                e.expecting_force = false;
                if token.commit && coordinator && early_lock_release {
                    // Early lock release: once its commit record is in the
                    // log the coordinator's own resources that commit from
                    // this log commit (and release their locks) while the
                    // record is forced. Nobody can act on what they wrote
                    // before it is durable: later writers' records follow
                    // it in the log, and read-only reporters wait for
                    // `early_released`.
                    e.committed_early = true;
                    self.early_released = self.early_released.max(lsn);
                    commit_resources(tid, &e.enlisted, |r| r.commits_from_this_log(), out);
                }
                out.push(Action::Force { tid, lsn, token });
            }
        }
    }

    fn on_forced(&mut self, tid: Tid, out: &mut Vec<Action<R>>) {
        let Some(e) = self.txs.get_mut(&tid) else {
            return;
        };
        // The log is durable at least up to the forced record.
        if let Some(lsn) = e.forcing.take() {
            self.durable = self.durable.max(lsn);
        }
        let e = &*e;
        if e.halted || *e.core.phase() != Phase::Forcing {
            return;
        }
        if e.core.is_coordinator() || e.core.is_decider() {
            // A decider's forced record is the commit record too; it took
            // the decision only with resources that wait on nothing.
            out.push(Action::CrashPoint {
                point: CrashPoint::CoordinatorAfterCommitForce,
                tid,
            });
            self.feed(tid, Input::Forced, out);
            return;
        }
        out.push(Action::CrashPoint {
            point: CrashPoint::ParticipantPrepared,
            tid,
        });
        // A participant's vote leaves only once its resources allow it;
        // when what it waits for has the same coordinator and the vote goes
        // straight there, the vote leaves now naming it.
        let voter = e.core.voter().or(e.core.parent());
        if voter == Some(tid.node) && !e.enlisted.is_empty() {
            out.push(Action::QueryDependencies {
                tid,
                resources: e.enlisted.clone(),
            });
        } else {
            self.barrier_after_force(tid, out);
        }
    }

    fn on_durable(&mut self, upto: Lsn, out: &mut Vec<Action<R>>) {
        if upto > self.durable {
            self.durable = upto;
        }
        let durable = self.durable;
        let mut i = 0;
        while i < self.holds.len() {
            if matches!(self.holds[i].on, HoldOn::Durable(l) if l <= durable) {
                let hold = self.holds.swap_remove(i);
                self.run_steps(hold.tid, hold.rest, Some(hold.resources), out);
                // `run_steps` may have pushed new holds: restart the scan.
                i = 0;
            } else {
                i += 1;
            }
        }
    }

    fn on_log_failed(&mut self, token: AppendToken, out: &mut Vec<Action<R>>) {
        // A record that needed no force: nothing waits on it.
        if token.durability != Durability::Force {
            return;
        }
        let tid = token.tid;
        let Some(e) = self.txs.get_mut(&tid) else {
            return;
        };
        if e.core.is_coordinator() {
            // It cannot know whether its commit record is on disk: its
            // caller hears InDoubt and the node must restart.
            for waiter in std::mem::take(&mut e.waiters) {
                out.push(Action::Complete {
                    waiter,
                    result: Err(Failure::new(
                        Status::InDoubt,
                        format!("{tid}: the commit record could not be made durable"),
                    )),
                });
            }
        } else {
            // Its prepare record may or may not be on disk: recovery asks
            // and hears abort.
            self.feed(tid, Input::Abort("the log failed".into()), out);
        }
    }

    // ----- local prepare -----

    fn start_local_prepare(
        &mut self,
        tid: Tid,
        aborted_subs: Vec<SubPath>,
        out: &mut Vec<Action<R>>,
    ) {
        let Some(e) = self.txs.get_mut(&tid) else {
            return;
        };
        for path in &aborted_subs {
            apply_sub_end(tid, e, path, false, out);
        }
        let two_phase = e
            .enlisted
            .iter()
            .any(|r| r.class() == ParticipationClass::TwoPhase);
        if !two_phase && e.active_calls == 0 {
            // Nothing durable here: vote at once.
            let vote = if e
                .enlisted
                .iter()
                .any(|r| r.class() == ParticipationClass::OnePhase)
            {
                Vote::Yes { durable: false }
            } else {
                Vote::ReadOnly
            };
            e.prep = Prep::Done;
            self.feed(tid, Input::LocalVote(vote), out);
            return;
        }
        if e.active_calls > 0 {
            // Late calls still running here finish first (bounded by the
            // deadline, see `on_tick`).
            e.prep = Prep::WaitingCalls;
            return;
        }
        self.start_resources(tid, out);
    }

    fn start_resources(&mut self, tid: Tid, out: &mut Vec<Action<R>>) {
        let Some(e) = self.txs.get_mut(&tid) else {
            return;
        };
        if e.outcome == Some(Outcome::Aborted) {
            // Aborted here while calls finished: nothing to prepare (the
            // calls' leftovers are undone as each ends).
            e.prep = Prep::Done;
            let vote = Vote::No("the transaction aborted here before it prepared".into());
            self.feed(tid, Input::LocalVote(vote), out);
            return;
        }
        self.continue_resources(tid, 0, Vote::ReadOnly, out);
    }

    fn continue_resources(
        &mut self,
        tid: Tid,
        mut next: usize,
        mut vote: Vote,
        out: &mut Vec<Action<R>>,
    ) {
        let own = tid.node == self.node;
        let barrier = self.barrier_id();
        let Some(e) = self.txs.get_mut(&tid) else {
            return;
        };
        while next < e.enlisted.len() && !matches!(vote, Vote::No(_)) {
            let r = &e.enlisted[next];
            match r.class() {
                ParticipationClass::TwoPhase => {
                    e.prep = Prep::Resources { next, vote };
                    out.push(Action::ResourcePrepare {
                        tid,
                        resource: r.clone(),
                    });
                    return;
                }
                ParticipationClass::OnePhase => vote = vote.and(Vote::Yes { durable: false }),
                ParticipationClass::NoState => {}
            }
            next += 1;
        }
        if e.outcome == Some(Outcome::Aborted) {
            // The abort was applied while the resources prepared: what they
            // registered since would outlive the branch. They hear it again.
            abort_two_phase(tid, &e.enlisted, out);
            e.prep = Prep::Done;
            let vote = Vote::No("the transaction aborted here while it prepared".into());
            self.feed(tid, Input::LocalVote(vote), out);
            return;
        }
        // The coordinator decides from its local vote: it counts only once
        // the resources allow it (participants wait after their force).
        if own && !matches!(vote, Vote::No(_)) {
            e.prep = Prep::Barrier { id: barrier, vote };
            out.push(Action::VoteBarrier {
                id: barrier,
                tid,
                resources: e.enlisted.clone(),
            });
            return;
        }
        e.prep = Prep::Done;
        self.feed(tid, Input::LocalVote(vote), out);
    }

    // ----- the per-transaction machine and its actions -----

    /// Feeds an input to `tid`'s machine and carries its actions into `out`.
    fn feed(&mut self, tid: Tid, input: Input, out: &mut Vec<Action<R>>) {
        let Some(e) = self.txs.get_mut(&tid) else {
            return;
        };
        if e.halted {
            return;
        }
        let actions = e.core.step(input);
        self.run_steps(
            tid,
            actions.into_iter().map(Step::Core).collect(),
            None,
            out,
        );
    }

    /// The resources a held step of `tid` needs: those it was held with,
    /// else the live transaction's (a hold is made while it is live).
    fn hold_resources(&self, tid: Tid, resources: Option<Vec<R>>) -> Vec<R> {
        resources
            .or_else(|| self.txs.get(&tid).map(|e| e.enlisted.clone()))
            .unwrap_or_default()
    }

    /// Carries out the steps of `tid` in order until one must wait; the
    /// rest is then held (with the resources a later barrier needs).
    fn run_steps(
        &mut self,
        tid: Tid,
        mut steps: VecDeque<Step>,
        resources: Option<Vec<R>>,
        out: &mut Vec<Action<R>>,
    ) {
        while let Some(step) = steps.pop_front() {
            match step {
                Step::Core(a) => {
                    if let Some(hold_on) = self.core_action(tid, a, &mut steps, out) {
                        let resources = self.hold_resources(tid, resources);
                        self.holds.push(Hold {
                            tid,
                            on: hold_on,
                            rest: steps,
                            resources,
                        });
                        return;
                    }
                }
                Step::SendVote { to, msg } => {
                    // Past the durable wait: now the barrier.
                    let resources = self.hold_resources(tid, resources);
                    let id = self.barrier_id();
                    out.push(Action::VoteBarrier {
                        id,
                        tid,
                        resources: resources.clone(),
                    });
                    steps.push_front(Step::SendVote { to, msg });
                    self.holds.push(Hold {
                        tid,
                        on: HoldOn::Barrier(id),
                        rest: steps,
                        resources,
                    });
                    return;
                }
                Step::Finish(outcome) => self.finish(tid, outcome, out),
            }
        }
    }

    /// Carries out one action of the per-transaction machine. Returns what
    /// to wait for before the rest (then pushed back onto `rest`).
    fn core_action(
        &mut self,
        tid: Tid,
        action: core::Action,
        rest: &mut VecDeque<Step>,
        out: &mut Vec<Action<R>>,
    ) -> Option<HoldOn> {
        match action {
            core::Action::PrepareLocal { aborted_subs } => {
                self.start_local_prepare(tid, aborted_subs, out);
            }
            core::Action::Send(to, msg) => {
                let msg = match msg {
                    TxMsg::Vote {
                        tid,
                        vote: vote @ Vote::Yes { durable: true },
                    } => {
                        // Kept: a repeated vote must name them too.
                        let after = self
                            .txs
                            .get(&tid)
                            .map(|e| e.vote_after.clone())
                            .unwrap_or_default();
                        if after.is_empty() {
                            TxMsg::Vote { tid, vote }
                        } else {
                            TxMsg::VoteAfter { tid, vote, after }
                        }
                    }
                    msg if volatile_vote(&msg) => {
                        // A vote that needed no force may have read an
                        // early-released commit: it waits until that is
                        // durable, then for the resources' barrier.
                        rest.push_front(Step::SendVote { to, msg });
                        if self.early_released > self.durable {
                            out.push(Action::WaitDurable {
                                lsn: self.early_released,
                            });
                            return Some(HoldOn::Durable(self.early_released));
                        }
                        return None;
                    }
                    other => other,
                };
                let is_decision = matches!(msg, TxMsg::Decision { commit: true, .. });
                self.send(to, msg, out);
                // The coordinator's decision went out: a crash point once
                // the last one left (its local commit follows).
                if is_decision
                    && self.txs.get(&tid).is_some_and(|e| e.core.is_coordinator())
                    && !rest.iter().any(|s| {
                        matches!(s, Step::Core(core::Action::Send(_, TxMsg::Decision { .. })))
                    })
                    && matches!(rest.front(), Some(Step::Core(core::Action::CommitLocal)))
                {
                    out.push(Action::CrashPoint {
                        point: CrashPoint::CoordinatorDecisionSent,
                        tid,
                    });
                }
            }
            core::Action::Log(record, durability) => {
                let commit = matches!(record, TmRecord::Committed { .. });
                if durability == Durability::Force {
                    let point = if commit {
                        CrashPoint::CoordinatorBeforeCommitForce
                    } else {
                        CrashPoint::ParticipantBeforePrepareForce
                    };
                    out.push(Action::CrashPoint { point, tid });
                }
                out.push(Action::Append {
                    record,
                    token: AppendToken {
                        tid,
                        durability,
                        commit,
                    },
                });
            }
            core::Action::CommitLocal => {
                if let Some(e) = self.txs.get(&tid) {
                    let early = e.committed_early;
                    commit_resources(
                        tid,
                        &e.enlisted,
                        |r| !(early && r.commits_from_this_log()),
                        out,
                    );
                }
            }
            core::Action::AbortLocal => {
                if let Some(e) = self.txs.get_mut(&tid) {
                    e.outcome = Some(Outcome::Aborted);
                    for r in &e.enlisted {
                        match r.class() {
                            ParticipationClass::TwoPhase => out.push(Action::ResourceAbort {
                                tid,
                                resource: r.clone(),
                            }),
                            ParticipationClass::OnePhase => out.push(Action::ResourceEnded {
                                tid,
                                resource: r.clone(),
                                outcome: Outcome::Aborted,
                            }),
                            ParticipationClass::NoState => {}
                        }
                    }
                }
            }
            core::Action::Finished(outcome) => {
                let read_only = self.txs.get(&tid).is_some_and(|e| !e.wrote_durable);
                if outcome == Outcome::Committed && read_only && self.early_released > self.durable
                {
                    // A read-only commit may have read an early-released
                    // transaction's writes: report it only once they last.
                    rest.push_front(Step::Finish(outcome));
                    out.push(Action::WaitDurable {
                        lsn: self.early_released,
                    });
                    return Some(HoldOn::Durable(self.early_released));
                }
                self.finish(tid, outcome, out);
            }
            core::Action::Forget(outcome) => self.forget(tid, outcome, out),
        }
        None
    }

    fn finish(&mut self, tid: Tid, outcome: Outcome, out: &mut Vec<Action<R>>) {
        let Some(e) = self.txs.get_mut(&tid) else {
            return;
        };
        e.outcome = Some(outcome);
        e.expecting_force = false;
        match outcome {
            Outcome::Committed => {
                self.stats.committed += 1;
                if !e.wrote_durable {
                    self.stats.committed_read_only += 1;
                }
            }
            Outcome::Aborted => self.stats.aborted += 1,
        }
        let cause = match outcome {
            Outcome::Committed => None,
            Outcome::Aborted => Some(e.core.abort_cause().map_or(Status::Aborted, |(s, _)| s)),
        };
        out.push(Action::Decided {
            tid,
            outcome: Some(outcome),
            cause,
        });
        let result = outcome_result(tid, outcome, e.core.abort_cause());
        for waiter in std::mem::take(&mut e.waiters) {
            out.push(Action::Complete {
                waiter,
                result: result.clone(),
            });
        }
    }

    fn forget(&mut self, tid: Tid, outcome: Option<Outcome>, out: &mut Vec<Action<R>>) {
        let Some(mut e) = self.txs.remove(&tid) else {
            return;
        };
        if e.outcome.is_none() {
            e.outcome = outcome;
        }
        let result = outcome_result(
            tid,
            outcome.unwrap_or(Outcome::Committed),
            e.core.abort_cause(),
        );
        for waiter in std::mem::take(&mut e.waiters) {
            out.push(Action::Complete {
                waiter,
                result: result.clone(),
            });
        }
        let cause = e.core.abort_cause().map(|(s, r)| (s, Box::from(r)));
        let protect = e.core.deadline().unwrap_or(self.now);
        let preparing = matches!(e.prep, Prep::Resources { .. });
        if e.active_calls > 0 || preparing {
            self.lingering.insert(
                tid,
                Lingering {
                    calls: e.active_calls,
                    preparing,
                    aborted: e.outcome == Some(Outcome::Aborted),
                    resources: e.enlisted,
                },
            );
        }
        self.vote_waits.retain(|w| w.tid != tid);
        self.tombstone(tid, outcome, cause, protect);
        out.push(Action::Forgotten { tid });
    }
}

enum DepState {
    Committed,
    Pending,
    Aborted(Tid, String),
}

fn expect_force<R: ResourceRef>(tid: Tid, e: &mut Entry<R>, out: &mut Vec<Action<R>>) {
    if !e.expecting_force && matches!(e.core.phase(), Phase::Active) {
        e.expecting_force = true;
        out.push(Action::ExpectForce { tid });
    }
}

fn enlist<R: ResourceRef>(e: &mut Entry<R>, resource: R) {
    if resource.class() == ParticipationClass::NoState {
        return;
    }
    if e.enlisted.iter().any(|r| r.same(&resource)) {
        return;
    }
    e.enlisted.push(resource);
}

/// Last writer wins per key; true when an entry was added or given another
/// value. An entry already here with the same value is left as it is (this
/// runs on every call that carries baggage, and on its return).
fn merge_baggage(into: &mut Baggage, from: &Baggage) -> bool {
    let mut changed = false;
    for item in &from.0 {
        match into.0.iter_mut().find(|i| i.key == item.key) {
            Some(have) if have.value == item.value => {}
            Some(have) => {
                have.value = item.value.clone();
                changed = true;
            }
            None => {
                into.0.push(item.clone());
                changed = true;
            }
        }
    }
    changed
}

fn apply_sub_end<R: ResourceRef>(
    tid: Tid,
    e: &mut Entry<R>,
    path: &SubPath,
    committed: bool,
    out: &mut Vec<Action<R>>,
) {
    if !committed {
        e.core.note_aborted_sub(path.clone());
    }
    for r in &e.enlisted {
        out.push(Action::ResourceSubEnded {
            tid,
            resource: r.clone(),
            path: path.clone(),
            committed,
        });
    }
}

fn commit_resources<R: ResourceRef>(
    tid: Tid,
    resources: &[R],
    which: impl Fn(&R) -> bool,
    out: &mut Vec<Action<R>>,
) {
    for r in resources {
        if !which(r) {
            continue;
        }
        match r.class() {
            ParticipationClass::TwoPhase => out.push(Action::ResourceCommit {
                tid,
                resource: r.clone(),
            }),
            ParticipationClass::OnePhase => out.push(Action::ResourceEnded {
                tid,
                resource: r.clone(),
                outcome: Outcome::Committed,
            }),
            ParticipationClass::NoState => {}
        }
    }
}

fn abort_two_phase<R: ResourceRef>(tid: Tid, resources: &[R], out: &mut Vec<Action<R>>) {
    for r in resources {
        if r.class() == ParticipationClass::TwoPhase {
            out.push(Action::ResourceAbort {
                tid,
                resource: r.clone(),
            });
        }
    }
}
