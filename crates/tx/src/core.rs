//! The commit protocol for one transaction at one node, as a pure state
//! machine: presumed-abort two-phase commit down the tree of processes
//! (Mohan & Lindsay; QuickSilver's transaction manager).
//!
//! Each node prepares its local resources and its children and answers its
//! own parent (the first node that asked it to prepare) with one vote for the
//! whole subtree: COMMIT-READY (`Yes`), READ-ONLY or ABORT (`No`).
//! Participants force a prepare record before voting Yes; the coordinator
//! forces only its commit record; aborts are never forced and never
//! acknowledged; read-only subtrees leave the protocol at once and write
//! nothing.
//!
//! Owns every protocol decision. Must never do I/O, read a clock or spawn:
//! inputs come in through [`TxCore::step`] (time included) and the actions to
//! carry out come back as values, so tests drive it message by message.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use weft_wire::{Incarnation, NodeId, Status, SubPath, Tid};

use crate::msg::{Answer, Outcome, TmRecord, TxMsg, Vote};

/// Timing of retransmissions.
#[derive(Clone, Copy, Debug)]
pub struct CoreConfig {
    /// Resend an unanswered Prepare or Decision after this long.
    pub retry: Duration,
    /// Longest wait between retransmissions (backoff doubles up to this).
    pub max_retry: Duration,
    /// An active participant branch asks its coordinator whether the
    /// transaction still runs after this long (then with backoff), so that a
    /// lost abort notice does not leave it holding resources until its
    /// deadline.
    pub orphan_check: Duration,
}

impl Default for CoreConfig {
    fn default() -> Self {
        CoreConfig {
            retry: Duration::from_millis(200),
            max_retry: Duration::from_secs(5),
            orphan_check: Duration::from_secs(1),
        }
    }
}

/// Something that happened to the transaction.
#[derive(Clone, Debug, PartialEq)]
pub enum Input {
    /// The creator asks to commit (coordinator only).
    Commit,
    /// Abort locally decided: the application, a deadline, a failed call.
    Abort(String),
    /// PREPARE from `from`.
    Prepare {
        /// Sender.
        from: NodeId,
        /// Sub-transactions known to have aborted.
        aborted_subs: Vec<SubPath>,
        /// The coordinator hands the decision to this branch (see
        /// [`TxCore::with_delegation`]); the driver clears it when a local
        /// resource must not be committed by a decision taken here.
        one_phase: bool,
    },
    /// The local resources voted.
    LocalVote(Vote),
    /// A child voted.
    Vote {
        /// The child.
        from: NodeId,
        /// Its vote.
        vote: Vote,
    },
    /// The record requested with [`Durability::Force`] is durable.
    Forced,
    /// The record requested with [`Durability::Lazy`] is durable.
    LazyDurable,
    /// The parent's commit decision (aborts arrive as [`Input::AbortNotice`]).
    CommitDecision {
        /// Sender.
        from: NodeId,
    },
    /// A child finished phase two.
    Ack {
        /// The child.
        from: NodeId,
    },
    /// A neighbour aborted the transaction (termination notification).
    AbortNotice {
        /// Sender.
        from: NodeId,
        /// The cause's status as the sender gave it (Ok is read as Aborted).
        status: Status,
        /// Why.
        reason: String,
    },
    /// An answer to our inquiry.
    Answer(Answer),
    /// A node was declared dead (or restarted), with the status that says
    /// how (HostDead, ProcDead).
    PeerDead(NodeId, Status),
    /// Time passes (retransmissions, deadline, inquiries).
    Tick(Instant),
}

/// How soon a log record must be durable.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Durability {
    /// Force now; report [`Input::Forced`].
    Force,
    /// No force; report [`Input::LazyDurable`] when some force covers it.
    Lazy,
    /// No force, no report.
    None,
}

/// Something to carry out.
#[derive(Clone, Debug, PartialEq)]
pub enum Action {
    /// Ask the local resources to prepare; report [`Input::LocalVote`].
    /// Sub-transactions listed aborted first.
    PrepareLocal {
        /// Sub-transactions to abort before preparing.
        aborted_subs: Vec<SubPath>,
    },
    /// Send a message.
    Send(NodeId, TxMsg),
    /// Append a record.
    Log(TmRecord, Durability),
    /// Tell the local resources the outcome is commit.
    CommitLocal,
    /// Tell the local resources the outcome is abort.
    AbortLocal,
    /// The outcome is known (the creator's commit call returns it).
    Finished(Outcome),
    /// Nothing more to do: forget the transaction, remembering the outcome
    /// for late messages (`None` for a read-only branch).
    Forget(Option<Outcome>),
}

#[derive(Clone, Debug)]
struct Child {
    incarnation: Incarnation,
    vote: Option<Vote>,
    acked: bool,
}

/// Where the transaction is, at this node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Phase {
    /// Work is going on.
    Active,
    /// Waiting for the local vote and the children's votes.
    Preparing,
    /// The prepare record (participant) or commit record (coordinator) is
    /// being forced.
    Forcing,
    /// Voted Yes; waiting for the outcome (in doubt).
    Prepared,
    /// Committed; telling the children and waiting for their acks.
    Committing,
    /// Over: the transaction is to be forgotten.
    Done(Option<Outcome>),
}

/// The protocol state of one transaction at one node.
pub struct TxCore {
    tid: Tid,
    coordinator: bool,
    parent: Option<NodeId>,
    voter: Option<NodeId>,
    children: BTreeMap<NodeId, Child>,
    phase: Phase,
    local: Option<Vote>,
    durable_here: bool,
    own_record_durable: bool,
    /// Why the transaction aborted here (the first cause seen).
    abort_cause: Option<(Status, String)>,
    aborted_subs: Vec<SubPath>,
    deadline: Option<Instant>,
    cfg: CoreConfig,
    last_sent: Option<Instant>,
    wait: Duration,
    /// Coordinator: may hand the decision to a single child.
    delegate: bool,
    /// Coordinator: waits for its local vote before handing the decision on.
    delegating: bool,
    /// Coordinator: handed the decision to its only child (`voter`); in
    /// doubt until that child tells the outcome.
    delegated: bool,
    /// Participant: its coordinator asked it to decide.
    one_phase: bool,
    /// Participant deciding the outcome: its forced record is the commit
    /// record, and its voter is told the decision and must acknowledge it.
    decider: bool,
    voter_acked: bool,
}

impl TxCore {
    /// The core of a transaction this node created (and coordinates).
    pub fn coordinator(tid: Tid, deadline: Option<Instant>, cfg: CoreConfig) -> Self {
        TxCore::new(tid, true, None, deadline, cfg)
    }

    /// The core of a branch this node joined when `parent` called it.
    pub fn participant(
        tid: Tid,
        parent: NodeId,
        deadline: Option<Instant>,
        cfg: CoreConfig,
    ) -> Self {
        TxCore::new(tid, false, Some(parent), deadline, cfg)
    }

    /// The core of a branch found prepared in the log at recovery: in doubt,
    /// waiting for the outcome from `voter`.
    pub fn recovered_prepared(
        tid: Tid,
        voter: NodeId,
        children: Vec<(NodeId, Incarnation)>,
        cfg: CoreConfig,
    ) -> Self {
        let mut core = TxCore::new(tid, false, Some(voter), None, cfg);
        core.voter = Some(voter);
        core.durable_here = true;
        core.own_record_durable = true;
        core.phase = Phase::Prepared;
        // In doubt like any prepared branch: it asks after the retry period,
        // not after the orphan check of an active one (what its resources
        // hold, e.g. items in controlled lock violation, waits for it).
        core.wait = cfg.retry;
        for (node, incarnation) in children {
            core.children.insert(
                node,
                Child {
                    incarnation,
                    vote: Some(Vote::Yes { durable: true }),
                    acked: false,
                },
            );
        }
        core
    }

    /// The core of a transaction found committed (and not ended) in the log
    /// at recovery: phase two is driven again.
    pub fn recovered_committed(
        tid: Tid,
        voter: Option<NodeId>,
        children: Vec<(NodeId, Incarnation)>,
        cfg: CoreConfig,
    ) -> Self {
        let mut core = TxCore::new(tid, voter.is_none(), voter, None, cfg);
        core.voter = voter;
        core.durable_here = true;
        core.own_record_durable = true;
        core.phase = Phase::Committing;
        core.wait = cfg.retry;
        for (node, incarnation) in children {
            core.children.insert(
                node,
                Child {
                    incarnation,
                    vote: Some(Vote::Yes { durable: true }),
                    acked: false,
                },
            );
        }
        core
    }

    fn new(
        tid: Tid,
        coordinator: bool,
        parent: Option<NodeId>,
        deadline: Option<Instant>,
        cfg: CoreConfig,
    ) -> Self {
        TxCore {
            tid,
            coordinator,
            parent,
            voter: None,
            children: BTreeMap::new(),
            phase: Phase::Active,
            local: None,
            durable_here: false,
            own_record_durable: false,
            abort_cause: None,
            aborted_subs: Vec::new(),
            deadline,
            cfg,
            last_sent: None,
            wait: if coordinator {
                cfg.retry
            } else {
                cfg.orphan_check
            },
            delegate: false,
            delegating: false,
            delegated: false,
            one_phase: false,
            decider: false,
            voter_acked: false,
        }
    }

    /// Coordinator: when the transaction has exactly one child and this
    /// node's own resources vote without a durable effect (`Yes { durable:
    /// false }` or read-only), hand the decision to that child
    /// ("one-phase" prepare): it forces its commit record (the only force of
    /// the transaction) and sends the decision up; this node records
    /// nothing, waits for the decision like a prepared participant, and
    /// commits its own resources only once it arrives. A child that does not
    /// take the decision votes as usual and this node decides as usual.
    pub fn with_delegation(mut self, on: bool) -> Self {
        self.delegate = on && self.coordinator;
        self
    }

    /// True at a participant that took its coordinator's decision: its
    /// forced record is a commit record.
    pub fn is_decider(&self) -> bool {
        self.decider
    }

    /// The transaction.
    pub fn tid(&self) -> Tid {
        self.tid
    }

    /// The current phase.
    pub fn phase(&self) -> &Phase {
        &self.phase
    }

    /// True at the coordinator.
    pub fn is_coordinator(&self) -> bool {
        self.coordinator
    }

    /// Why the transaction aborted at this node, once it did: the status
    /// (Aborted, TimedOut when its deadline passed, HostDead/ProcDead when
    /// a node it needed died) and the reason.
    pub fn abort_cause(&self) -> Option<(Status, &str)> {
        self.abort_cause.as_ref().map(|(s, r)| (*s, r.as_str()))
    }

    /// The first caller (participants).
    pub fn parent(&self) -> Option<NodeId> {
        self.parent
    }

    /// The node this branch voted (or will vote) to.
    pub fn voter(&self) -> Option<NodeId> {
        self.voter
    }

    /// The children and their incarnations.
    pub fn children(&self) -> Vec<(NodeId, Incarnation)> {
        self.children
            .iter()
            .map(|(n, c)| (*n, c.incarnation))
            .collect()
    }

    /// The deadline, if any.
    pub fn deadline(&self) -> Option<Instant> {
        self.deadline
    }

    /// True while new work may join the transaction here.
    pub fn is_active(&self) -> bool {
        self.phase == Phase::Active
    }

    /// True when the branch is prepared and waiting for the outcome.
    pub fn in_doubt(&self) -> bool {
        self.phase == Phase::Prepared
    }

    /// When a [`Input::Tick`] next has something to do (a retransmission,
    /// an inquiry, the deadline), given the current time; `None` when
    /// nothing is timed. A machine whose timer is not armed yet answers
    /// `now` (the next tick arms it).
    pub fn next_timer(&self, now: Instant) -> Option<Instant> {
        let deadline = match self.phase {
            Phase::Active | Phase::Preparing => self.deadline,
            _ => None,
        };
        let retries = match self.phase {
            Phase::Active => !self.coordinator,
            Phase::Preparing | Phase::Prepared | Phase::Committing => true,
            Phase::Forcing | Phase::Done(_) => false,
        };
        let retry = retries.then(|| match self.last_sent {
            None => now,
            Some(t) => t + self.wait,
        });
        match (deadline, retry) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Records a child: this node called `node` (at `incarnation`) on behalf
    /// of the transaction. Returns false once the transaction is no longer
    /// active here (the call must not be made).
    pub fn add_child(&mut self, node: NodeId, incarnation: Incarnation) -> bool {
        if self.phase != Phase::Active {
            return false;
        }
        if Some(node) == self.parent && !self.coordinator {
            // Calling back up the tree: the parent is already in the protocol.
            return true;
        }
        let child = self.children.entry(node).or_insert(Child {
            incarnation,
            vote: None,
            acked: false,
        });
        child.incarnation = incarnation;
        true
    }

    /// Notes that a sub-transaction aborted (sent along with PREPARE).
    pub fn note_aborted_sub(&mut self, path: SubPath) {
        if !self.aborted_subs.contains(&path) {
            self.aborted_subs.push(path);
        }
    }

    /// The answer this node gives to an inquiry about the transaction.
    pub fn answer(&self) -> Answer {
        match &self.phase {
            Phase::Committing | Phase::Done(Some(Outcome::Committed)) => Answer::Committed,
            // Not decided yet: a prepared child asking early must wait.
            Phase::Active | Phase::Preparing | Phase::Forcing | Phase::Prepared => Answer::Pending,
            Phase::Done(_) => Answer::Aborted,
        }
    }

    /// Feeds one input; returns the actions to carry out, in order.
    pub fn step(&mut self, input: Input) -> Vec<Action> {
        let mut out = Vec::new();
        if let Phase::Done(outcome) = self.phase {
            return late(self.tid, outcome, input);
        }
        match input {
            Input::Commit => self.on_commit(&mut out),
            Input::Abort(reason) => self.on_abort_request(reason, &mut out),
            Input::Prepare {
                from,
                aborted_subs,
                one_phase,
            } => self.on_prepare(from, aborted_subs, one_phase, &mut out),
            Input::LocalVote(v) => {
                if self.phase == Phase::Preparing && self.local.is_none() {
                    if self.delegating {
                        self.on_local_vote_delegating(v, &mut out);
                    } else {
                        self.local = Some(v);
                        self.check_votes(&mut out);
                    }
                }
            }
            Input::Vote { from, vote }
                if self.delegated && self.phase == Phase::Prepared && Some(from) == self.voter =>
            {
                self.on_delegate_vote(from, vote, &mut out)
            }
            Input::Vote { from, vote } => self.on_vote(from, vote, &mut out),
            Input::Forced => self.on_forced(&mut out),
            Input::LazyDurable => {
                self.own_record_durable = true;
                self.check_acks(&mut out);
            }
            Input::CommitDecision { from } => self.on_commit_decision(from, &mut out),
            Input::Ack { from } => {
                if self.phase == Phase::Committing {
                    if let Some(c) = self.children.get_mut(&from) {
                        c.acked = true;
                    }
                    if self.decider && Some(from) == self.voter {
                        self.voter_acked = true;
                    }
                    self.check_acks(&mut out);
                }
            }
            Input::AbortNotice {
                from,
                status,
                reason,
            } => self.on_abort_notice(from, status, reason, &mut out),
            Input::Answer(a) => match (a, &self.phase) {
                (Answer::Committed, Phase::Prepared) => self.commit_here(&mut out),
                (Answer::Aborted, Phase::Prepared) => self.abort_here(
                    "the parent reports the transaction aborted".into(),
                    None,
                    &mut out,
                ),
                // An active branch whose transaction ended without it: its
                // abort notice was lost, or it joined after the end.
                (Answer::Committed | Answer::Aborted, Phase::Active) if !self.coordinator => self
                    .abort_here(
                        "the coordinator no longer runs the transaction".into(),
                        None,
                        &mut out,
                    ),
                _ => {}
            },
            Input::PeerDead(node, status) => self.on_peer_dead(node, status, &mut out),
            Input::Tick(now) => self.on_tick(now, &mut out),
        }
        out
    }

    fn on_commit(&mut self, out: &mut Vec<Action>) {
        if !self.coordinator || self.phase != Phase::Active {
            return;
        }
        self.phase = Phase::Preparing;
        out.push(Action::PrepareLocal {
            aborted_subs: self.aborted_subs.clone(),
        });
        if self.delegate && self.children.len() == 1 {
            // The local vote decides whether the child may decide.
            self.delegating = true;
            self.last_sent = None;
            return;
        }
        self.send_prepares(None, out);
    }

    /// The coordinator's local vote while it may delegate (see
    /// [`TxCore::with_delegation`]).
    fn on_local_vote_delegating(&mut self, v: Vote, out: &mut Vec<Action>) {
        self.delegating = false;
        match v {
            Vote::No(reason) => self.abort_here(reason, None, out),
            Vote::Yes { durable: true } => {
                // Durable state here too: the usual protocol.
                self.local = Some(v);
                self.send_prepares(None, out);
                self.check_votes(out);
            }
            Vote::Yes { durable: false } | Vote::ReadOnly => {
                self.local = Some(v);
                let Some(child) = self.children.keys().next().copied() else {
                    self.check_votes(out);
                    return;
                };
                self.delegated = true;
                self.voter = Some(child);
                self.phase = Phase::Prepared;
                self.send_one_phase_prepare(out);
                self.last_sent = None;
                self.wait = self.cfg.retry;
            }
        }
    }

    fn send_one_phase_prepare(&self, out: &mut Vec<Action>) {
        let Some(node) = self.voter else { return };
        let Some(child) = self.children.get(&node) else {
            return;
        };
        out.push(Action::Send(
            node,
            TxMsg::DelegatedPrepare {
                tid: self.tid,
                incarnation: child.incarnation,
                aborted_subs: self.aborted_subs.clone(),
            },
        ));
    }

    /// A vote from the child the decision was handed to: it did not take
    /// the decision (Yes: decide as usual, forcing the commit record here),
    /// has nothing to commit (read-only), or refused.
    fn on_delegate_vote(&mut self, from: NodeId, vote: Vote, out: &mut Vec<Action>) {
        match vote {
            Vote::No(reason) => {
                self.abort_here(format!("node {from} voted no: {reason}"), None, out)
            }
            Vote::ReadOnly => {
                self.children.remove(&from);
                self.delegated = false;
                self.voter = None;
                self.commit_here(out);
            }
            Vote::Yes { durable } => {
                self.delegated = false;
                self.voter = None;
                self.phase = Phase::Preparing;
                if let Some(c) = self.children.get_mut(&from) {
                    c.vote = Some(Vote::Yes { durable });
                }
                self.check_votes(out);
            }
        }
    }

    fn send_prepares(&mut self, skip: Option<NodeId>, out: &mut Vec<Action>) {
        let subs = self.aborted_subs.clone();
        for (node, child) in self.children.iter_mut() {
            if Some(*node) == skip {
                // The node asking us is in the protocol already.
                child.vote = Some(Vote::ReadOnly);
                continue;
            }
            if child.vote.is_none() {
                out.push(Action::Send(
                    *node,
                    TxMsg::Prepare {
                        tid: self.tid,
                        incarnation: child.incarnation,
                        aborted_subs: subs.clone(),
                    },
                ));
            }
        }
        self.last_sent = None; // armed by the next tick
        self.wait = self.cfg.retry;
    }

    fn on_prepare(
        &mut self,
        from: NodeId,
        aborted_subs: Vec<SubPath>,
        one_phase: bool,
        out: &mut Vec<Action>,
    ) {
        if self.coordinator {
            // A cycle in the tree reached the coordinator: it answers for
            // itself through its own vote collection.
            out.push(Action::Send(
                from,
                TxMsg::Vote {
                    tid: self.tid,
                    vote: Vote::ReadOnly,
                },
            ));
            return;
        }
        match &self.phase {
            Phase::Active => {
                self.voter = Some(from);
                // Only the coordinator hands its decision down (its
                // incarnation is the transaction's: the decider's commit
                // record names it as a child to tell).
                self.one_phase = one_phase && from == self.tid.node;
                for s in aborted_subs {
                    self.note_aborted_sub(s);
                }
                self.phase = Phase::Preparing;
                out.push(Action::PrepareLocal {
                    aborted_subs: self.aborted_subs.clone(),
                });
                self.send_prepares(Some(from), out);
            }
            _ if Some(from) != self.voter => {
                // Another parent: our vote goes to the first one.
                out.push(Action::Send(
                    from,
                    TxMsg::Vote {
                        tid: self.tid,
                        vote: Vote::ReadOnly,
                    },
                ));
            }
            Phase::Prepared => {
                // A retransmitted Prepare: vote again, idempotently.
                let vote = Vote::Yes {
                    durable: self.durable_here,
                };
                out.push(Action::Send(
                    from,
                    TxMsg::Vote {
                        tid: self.tid,
                        vote,
                    },
                ));
            }
            _ => {} // still preparing or already decided: the vote will come
        }
    }

    fn on_vote(&mut self, from: NodeId, vote: Vote, out: &mut Vec<Action>) {
        if self.phase != Phase::Preparing {
            return;
        }
        let Some(child) = self.children.get_mut(&from) else {
            return;
        };
        if child.vote.is_some() {
            return;
        }
        if let Vote::No(reason) = &vote {
            let reason = format!("node {from} voted no: {reason}");
            child.vote = Some(vote);
            // The No voter hears the abort too: a No may stand for a Yes
            // that cannot count (a VoteAfter naming a transaction that
            // aborted, a vote its resources refused after the branch
            // prepared), whose branch is prepared and in doubt. Waiting for
            // its own inquiry would keep its resources (and whoever used
            // its writes) a retry period longer; a branch that did abort
            // ignores the notice.
            self.abort_here(reason, None, out);
            return;
        }
        child.vote = Some(vote);
        self.check_votes(out);
    }

    fn check_votes(&mut self, out: &mut Vec<Action>) {
        let Some(local) = self.local.clone() else {
            return;
        };
        if self.children.values().any(|c| c.vote.is_none()) {
            return;
        }
        let combined = self
            .children
            .values()
            .filter_map(|c| c.vote.clone())
            .fold(local.clone(), Vote::and);
        match combined {
            Vote::No(reason) => self.abort_here(reason, None, out),
            Vote::ReadOnly => {
                if let Some(v) = self.voter {
                    out.push(Action::Send(
                        v,
                        TxMsg::Vote {
                            tid: self.tid,
                            vote: Vote::ReadOnly,
                        },
                    ));
                }
                if self.coordinator {
                    out.push(Action::Finished(Outcome::Committed));
                }
                self.phase = Phase::Done(None);
                out.push(Action::Forget(None));
            }
            Vote::Yes { durable } => {
                self.durable_here = durable;
                // Children that voted read-only have left the protocol.
                self.children
                    .retain(|_, c| matches!(c.vote, Some(Vote::Yes { .. })));
                let yes = self.children();
                if self.coordinator {
                    if durable {
                        self.phase = Phase::Forcing;
                        out.push(Action::Log(
                            TmRecord::Committed {
                                tid: self.tid,
                                children: yes,
                            },
                            Durability::Force,
                        ));
                    } else {
                        self.commit_here(out);
                    }
                } else if self.one_phase {
                    // Deciding here: the commit record (naming the
                    // coordinator, which must hear the decision) is the one
                    // force of the transaction.
                    let voter = self.voter.expect("a participant prepares for a voter");
                    self.decider = true;
                    if durable {
                        self.phase = Phase::Forcing;
                        let mut children = yes;
                        children.push((voter, self.tid.incarnation));
                        out.push(Action::Log(
                            TmRecord::Committed {
                                tid: self.tid,
                                children,
                            },
                            Durability::Force,
                        ));
                    } else {
                        self.commit_here(out);
                    }
                } else {
                    let voter = self.voter.expect("a participant prepares for a voter");
                    if durable {
                        self.phase = Phase::Forcing;
                        out.push(Action::Log(
                            TmRecord::Prepared {
                                tid: self.tid,
                                parent: voter,
                                children: yes,
                            },
                            Durability::Force,
                        ));
                    } else {
                        self.phase = Phase::Prepared;
                        out.push(Action::Send(
                            voter,
                            TxMsg::Vote {
                                tid: self.tid,
                                vote: Vote::Yes { durable: false },
                            },
                        ));
                        self.last_sent = None;
                        self.wait = self.cfg.retry;
                    }
                }
            }
        }
    }

    fn on_forced(&mut self, out: &mut Vec<Action>) {
        if self.phase != Phase::Forcing {
            return;
        }
        self.own_record_durable = true;
        if self.coordinator || self.decider {
            self.commit_here(out);
        } else {
            let voter = self.voter.expect("a participant prepares for a voter");
            self.phase = Phase::Prepared;
            out.push(Action::Send(
                voter,
                TxMsg::Vote {
                    tid: self.tid,
                    vote: Vote::Yes { durable: true },
                },
            ));
            self.last_sent = None;
            self.wait = self.cfg.retry;
        }
    }

    /// The outcome is commit here: resources commit, children are told.
    fn commit_here(&mut self, out: &mut Vec<Action>) {
        // Children hear the decision first, so their phase two overlaps the
        // local one; then the local resources apply it; only then does the
        // creator's commit return (a transaction it begins next sees it).
        self.phase = Phase::Committing;
        if self.delegated {
            // The child decided: it needs our ack, not the decision.
            self.delegated = false;
            if let Some(v) = self.voter {
                self.children.remove(&v);
            }
        }
        for node in self.children.keys() {
            out.push(Action::Send(
                *node,
                TxMsg::Decision {
                    tid: self.tid,
                    commit: true,
                },
            ));
        }
        out.push(Action::CommitLocal);
        if self.coordinator {
            out.push(Action::Finished(Outcome::Committed));
            // The forced commit record (if any) is the coordinator's own.
            self.own_record_durable = true;
        } else if self.decider {
            // The decision goes up; the record (if any) was forced.
            if let Some(v) = self.voter {
                out.push(Action::Send(
                    v,
                    TxMsg::Decision {
                        tid: self.tid,
                        commit: true,
                    },
                ));
            }
            self.own_record_durable = true;
        } else if self.durable_here {
            // Participants record the outcome lazily; the ack waits for it.
            self.own_record_durable = false;
            out.push(Action::Log(
                TmRecord::Committed {
                    tid: self.tid,
                    children: self.children(),
                },
                Durability::Lazy,
            ));
        } else {
            self.own_record_durable = true;
        }
        self.last_sent = None;
        self.wait = self.cfg.retry;
        self.check_acks(out);
    }

    fn check_acks(&mut self, out: &mut Vec<Action>) {
        if self.phase != Phase::Committing || !self.own_record_durable {
            return;
        }
        if self.children.values().any(|c| !c.acked) {
            return;
        }
        if self.decider {
            if !self.voter_acked {
                return;
            }
        } else if let Some(v) = self.voter {
            out.push(Action::Send(v, TxMsg::Ack { tid: self.tid }));
        }
        if self.durable_here {
            out.push(Action::Log(
                TmRecord::End { tid: self.tid },
                Durability::None,
            ));
        }
        self.phase = Phase::Done(Some(Outcome::Committed));
        out.push(Action::Forget(Some(Outcome::Committed)));
    }

    fn on_commit_decision(&mut self, from: NodeId, out: &mut Vec<Action>) {
        match &self.phase {
            Phase::Prepared if Some(from) == self.voter => self.commit_here(out),
            Phase::Committing if Some(from) == self.voter => {
                // A retransmitted decision: ack again once complete.
                self.check_acks(out);
            }
            _ => {}
        }
    }

    fn on_abort_request(&mut self, reason: String, out: &mut Vec<Action>) {
        match self.phase {
            Phase::Active | Phase::Preparing => self.abort_here(reason, None, out),
            // A participant that has not voted yet may still abort (a
            // decider forcing its commit record may not).
            Phase::Forcing if !self.coordinator && !self.decider => {
                self.abort_here(reason, None, out)
            }
            _ => {} // decided or in doubt: not ours to abort any more
        }
    }

    fn on_abort_notice(
        &mut self,
        from: NodeId,
        status: Status,
        reason: String,
        out: &mut Vec<Action>,
    ) {
        let status = if status == Status::Ok {
            Status::Aborted
        } else {
            status
        };
        let from_above =
            Some(from) == self.voter || (self.voter.is_none() && Some(from) == self.parent);
        match self.phase {
            Phase::Active | Phase::Preparing => self.abort_with(status, reason, Some(from), out),
            Phase::Forcing if !self.coordinator && !self.decider => {
                self.abort_with(status, reason, Some(from), out)
            }
            // In doubt: only the node we voted to decides.
            Phase::Prepared if from_above => self.abort_with(status, reason, Some(from), out),
            _ => {}
        }
    }

    fn on_peer_dead(&mut self, node: NodeId, status: Status, out: &mut Vec<Action>) {
        let status = match status {
            Status::HostDead | Status::ProcDead => status,
            _ => Status::ProcDead,
        };
        let is_parent = Some(node) == self.parent || Some(node) == self.voter;
        let is_child = self.children.contains_key(&node);
        if !is_parent && !is_child {
            return;
        }
        match self.phase {
            Phase::Active => self.abort_with(
                status,
                format!("node {node} died while the transaction ran"),
                Some(node),
                out,
            ),
            Phase::Preparing => {
                let waiting_on_it =
                    is_parent || self.children.get(&node).is_some_and(|c| c.vote.is_none());
                if waiting_on_it {
                    let reason = format!("node {node} died during prepare");
                    self.abort_with(status, reason, Some(node), out)
                }
            }
            Phase::Forcing if !self.coordinator && !self.decider && is_parent => {
                let reason = format!("node {node} died during prepare");
                self.abort_with(status, reason, Some(node), out)
            }
            _ => {} // prepared or decided: keep going; recovery resolves it
        }
    }

    fn on_tick(&mut self, now: Instant, out: &mut Vec<Action>) {
        if let Some(d) = self.deadline {
            if now >= d && matches!(self.phase, Phase::Active | Phase::Preparing) {
                let reason = "the transaction's deadline passed".to_string();
                self.abort_with(Status::TimedOut, reason, None, out);
                return;
            }
        }
        let due = match self.last_sent {
            None => {
                self.last_sent = Some(now);
                false
            }
            Some(t) => now.saturating_duration_since(t) >= self.wait,
        };
        if !due {
            return;
        }
        self.last_sent = Some(now);
        self.wait = (self.wait * 2).min(self.cfg.max_retry);
        match self.phase {
            Phase::Active if !self.coordinator => {
                out.push(Action::Send(
                    self.tid.node,
                    TxMsg::Inquire { tid: self.tid },
                ));
            }
            Phase::Preparing if self.delegating => {} // the local vote comes
            Phase::Prepared if self.delegated => {
                // Whatever the child answers settles it: the decision, an
                // abort, or a vote (see `on_delegate_vote`).
                self.send_one_phase_prepare(out);
            }
            Phase::Preparing => {
                let subs = self.aborted_subs.clone();
                for (node, c) in &self.children {
                    if c.vote.is_none() {
                        out.push(Action::Send(
                            *node,
                            TxMsg::Prepare {
                                tid: self.tid,
                                incarnation: c.incarnation,
                                aborted_subs: subs.clone(),
                            },
                        ));
                    }
                }
            }
            Phase::Prepared => {
                if let Some(v) = self.voter {
                    out.push(Action::Send(v, TxMsg::Inquire { tid: self.tid }));
                }
            }
            Phase::Committing => {
                for (node, c) in &self.children {
                    if !c.acked {
                        out.push(Action::Send(
                            *node,
                            TxMsg::Decision {
                                tid: self.tid,
                                commit: true,
                            },
                        ));
                    }
                }
                if let (true, false, Some(v)) = (self.decider, self.voter_acked, self.voter) {
                    out.push(Action::Send(
                        v,
                        TxMsg::Decision {
                            tid: self.tid,
                            commit: true,
                        },
                    ));
                }
                // Phase two may be complete already (a branch recovered
                // committed, with nobody left to tell): finish it.
                self.check_acks(out);
            }
            _ => {}
        }
    }

    /// The outcome is abort here: resources undo, every neighbour but
    /// `from` is told, nothing is forced.
    fn abort_here(&mut self, reason: String, from: Option<NodeId>, out: &mut Vec<Action>) {
        self.abort_with(Status::Aborted, reason, from, out)
    }

    /// [`TxCore::abort_here`] remembering `status` as the cause.
    fn abort_with(
        &mut self,
        status: Status,
        reason: String,
        from: Option<NodeId>,
        out: &mut Vec<Action>,
    ) {
        if self.abort_cause.is_none() {
            self.abort_cause = Some((status, reason.clone()));
        }
        let was_prepared = matches!(self.phase, Phase::Prepared | Phase::Forcing);
        out.push(Action::AbortLocal);
        let msg = TxMsg::Abort {
            tid: self.tid,
            status,
            reason,
        };
        let mut told = Vec::new();
        for up in [self.voter, self.parent].into_iter().flatten() {
            if Some(up) != from && !told.contains(&up) {
                told.push(up);
                out.push(Action::Send(up, msg.clone()));
            }
        }
        for (node, c) in &self.children {
            // Read-only children have left; everyone else hears the outcome.
            if Some(*node) != from && c.vote != Some(Vote::ReadOnly) && !told.contains(node) {
                told.push(*node);
                out.push(Action::Send(*node, msg.clone()));
            }
        }
        if was_prepared && self.durable_here {
            out.push(Action::Log(
                TmRecord::Aborted { tid: self.tid },
                Durability::None,
            ));
        }
        if self.coordinator {
            out.push(Action::Finished(Outcome::Aborted));
        }
        self.phase = Phase::Done(Some(Outcome::Aborted));
        out.push(Action::Forget(Some(Outcome::Aborted)));
    }
}

/// What a node answers to a protocol input about a transaction it has
/// finished (`outcome` `None` for a read-only branch) or forgotten: used by
/// finished cores and by the manager's tombstones.
pub fn late(tid: Tid, outcome: Option<Outcome>, input: Input) -> Vec<Action> {
    match input {
        // A retransmitted decision: the ack was lost; the branch is complete.
        Input::CommitDecision { from } => vec![Action::Send(from, TxMsg::Ack { tid })],
        Input::Prepare { from, .. } => {
            let vote = match outcome {
                None => Vote::ReadOnly,
                Some(Outcome::Aborted) => Vote::No("the transaction already aborted here".into()),
                // Cannot happen in a correct run (a decided branch was
                // prepared); answering Yes again is idempotent.
                Some(Outcome::Committed) => Vote::Yes { durable: true },
            };
            vec![Action::Send(from, TxMsg::Vote { tid, vote })]
        }
        _ => Vec::new(),
    }
}

#[cfg(test)]
mod tests;
