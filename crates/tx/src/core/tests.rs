//! Drives commit cores message by message: scenarios, then a property test
//! over random delivery orders, losses and duplicates.

use std::collections::{BTreeMap, VecDeque};

use proptest::prelude::*;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::*;

fn n(i: u32) -> NodeId {
    NodeId(i)
}

fn tid() -> Tid {
    Tid::new(n(1), Incarnation(1), 7)
}

/// A tiny deterministic world: one core per node, an in-flight message
/// queue, a log per node, and what each node's resources were told.
struct Sim {
    cores: BTreeMap<NodeId, TxCore>,
    local_votes: BTreeMap<NodeId, Vote>,
    queue: VecDeque<(NodeId, NodeId, TxMsg)>,
    forces: BTreeMap<NodeId, usize>,
    records: BTreeMap<NodeId, Vec<TmRecord>>,
    local: BTreeMap<NodeId, Vec<&'static str>>,
    finished: Option<Outcome>,
    pending_force: Vec<NodeId>,
    pending_lazy: Vec<NodeId>,
    messages: usize,
    now: Instant,
    refuse_one_phase: Vec<NodeId>,
}

impl Sim {
    /// Node 1 coordinates; `edges` are (caller, callee) calls made while the
    /// transaction ran; `votes` the local vote of every node.
    fn new(edges: &[(u32, u32)], votes: &[(u32, Vote)]) -> Sim {
        let cfg = CoreConfig::default();
        let mut cores = BTreeMap::new();
        cores.insert(n(1), TxCore::coordinator(tid(), None, cfg));
        for &(from, to) in edges {
            cores
                .entry(n(to))
                .or_insert_with(|| TxCore::participant(tid(), n(from), None, cfg));
            let caller = cores.get_mut(&n(from)).expect("caller exists");
            assert!(caller.add_child(n(to), Incarnation(1)));
        }
        Sim {
            cores,
            local_votes: votes.iter().map(|(i, v)| (n(*i), v.clone())).collect(),
            queue: VecDeque::new(),
            forces: BTreeMap::new(),
            records: BTreeMap::new(),
            local: BTreeMap::new(),
            finished: None,
            pending_force: Vec::new(),
            pending_lazy: Vec::new(),
            messages: 0,
            now: Instant::now(),
            refuse_one_phase: Vec::new(),
        }
    }

    /// The coordinator hands the decision to a single child when it can.
    fn delegating(mut self) -> Sim {
        let c = self.cores.remove(&n(1)).expect("the coordinator");
        self.cores.insert(n(1), c.with_delegation(true));
        self
    }

    /// Delivers messages (forces complete as they come) until `pick`
    /// matches one in flight, which is taken out and returned.
    fn run_until(
        &mut self,
        pick: impl Fn(NodeId, NodeId, &TxMsg) -> bool,
    ) -> (NodeId, NodeId, TxMsg) {
        loop {
            if let Some(i) = self.queue.iter().position(|(f, t, m)| pick(*f, *t, m)) {
                return self.queue.remove(i).expect("found");
            }
            assert!(self.step_once(), "nothing left in flight and no match");
        }
    }

    /// Completes one pending force, else one lazy write, else delivers the
    /// oldest message in flight; false when nothing is left to do.
    fn step_once(&mut self) -> bool {
        if let Some(node) = self.pending_force.pop() {
            self.input(node, Input::Forced);
        } else if let Some(node) = self.pending_lazy.pop() {
            self.input(node, Input::LazyDurable);
        } else if let Some((from, to, msg)) = self.queue.pop_front() {
            self.deliver(from, to, msg);
        } else {
            return false;
        }
        true
    }

    fn input(&mut self, node: NodeId, input: Input) {
        let Some(core) = self.cores.get_mut(&node) else {
            return;
        };
        let actions = core.step(input);
        self.run(node, actions);
    }

    fn run(&mut self, node: NodeId, actions: Vec<Action>) {
        for a in actions {
            match a {
                Action::PrepareLocal { .. } => {
                    let v = self
                        .local_votes
                        .get(&node)
                        .cloned()
                        .unwrap_or(Vote::ReadOnly);
                    self.local.entry(node).or_default().push("prepare");
                    self.input(node, Input::LocalVote(v));
                }
                Action::Send(to, msg) => {
                    self.messages += 1;
                    self.queue.push_back((node, to, msg));
                }
                Action::Log(rec, d) => {
                    self.records.entry(node).or_default().push(rec);
                    match d {
                        Durability::Force => {
                            *self.forces.entry(node).or_default() += 1;
                            self.pending_force.push(node);
                        }
                        Durability::Lazy => self.pending_lazy.push(node),
                        Durability::None => {}
                    }
                }
                Action::CommitLocal => self.local.entry(node).or_default().push("commit"),
                Action::AbortLocal => self.local.entry(node).or_default().push("abort"),
                Action::Finished(o) => {
                    assert!(
                        self.finished.is_none() || self.finished == Some(o),
                        "two outcomes"
                    );
                    self.finished = Some(o);
                }
                Action::Forget(_) => {}
            }
        }
    }

    fn deliver(&mut self, from: NodeId, to: NodeId, msg: TxMsg) {
        let input = match msg {
            TxMsg::Prepare { aborted_subs, .. } => Input::Prepare {
                from,
                aborted_subs,
                one_phase: false,
            },
            TxMsg::DelegatedPrepare { aborted_subs, .. } => Input::Prepare {
                from,
                aborted_subs,
                // A driver whose resources do not allow deciding clears it.
                one_phase: !self.refuse_one_phase.contains(&to),
            },
            TxMsg::Vote { vote, .. } => Input::Vote { from, vote },
            TxMsg::Decision { commit: true, .. } => Input::CommitDecision { from },
            TxMsg::Decision { commit: false, .. } => Input::AbortNotice {
                from,
                status: Status::Aborted,
                reason: "decision".into(),
            },
            TxMsg::Ack { .. } => Input::Ack { from },
            TxMsg::Abort { status, reason, .. } => Input::AbortNotice {
                from,
                status,
                reason,
            },
            TxMsg::Inquire { .. } => {
                let answer = self
                    .cores
                    .get(&to)
                    .map(|c| c.answer())
                    .unwrap_or(Answer::Aborted);
                self.queue
                    .push_back((to, from, TxMsg::Outcome { tid: tid(), answer }));
                return;
            }
            TxMsg::Outcome { answer, .. } => Input::Answer(answer),
            other => panic!("unexpected {other:?}"),
        };
        self.input(to, input);
    }

    /// Completes forces and delivers messages until nothing moves.
    fn settle(&mut self) {
        while self.step_once() {}
    }

    /// Lets the resend timers fire once (a tick to arm them, one past their
    /// period), then settles.
    fn resend_and_settle(&mut self) {
        self.tick(Duration::from_millis(1));
        self.tick(Duration::from_secs(1));
        self.settle();
    }

    fn tick(&mut self, by: Duration) {
        self.now += by;
        let nodes: Vec<NodeId> = self.cores.keys().copied().collect();
        for node in nodes {
            self.input(node, Input::Tick(self.now));
        }
    }

    fn total_forces(&self) -> usize {
        self.forces.values().sum()
    }

    fn did(&self, node: u32, what: &str) -> bool {
        self.local.get(&n(node)).is_some_and(|v| v.contains(&what))
    }

    fn phase(&self, node: u32) -> Phase {
        self.cores[&n(node)].phase().clone()
    }
}

const DURABLE: Vote = Vote::Yes { durable: true };

#[test]
fn read_only_transaction_writes_nothing_and_costs_one_round() {
    let mut sim = Sim::new(&[(1, 2), (1, 3)], &[]);
    sim.input(n(1), Input::Commit);
    sim.settle();
    assert_eq!(sim.finished, Some(Outcome::Committed));
    assert_eq!(sim.total_forces(), 0);
    assert!(
        sim.records.is_empty(),
        "read-only writes no log record at all"
    );
    assert_eq!(sim.messages, 4, "one Prepare and one Vote per participant");
    for i in 1..=3 {
        assert_eq!(sim.phase(i), Phase::Done(None));
    }
}

#[test]
fn durable_commit_forces_prepares_and_the_commit_record_only() {
    let mut sim = Sim::new(&[(1, 2), (1, 3)], &[(2, DURABLE), (3, DURABLE)]);
    sim.input(n(1), Input::Commit);
    sim.settle();
    assert_eq!(sim.finished, Some(Outcome::Committed));
    assert_eq!(
        sim.forces.get(&n(1)),
        Some(&1),
        "the coordinator forces its commit record"
    );
    assert_eq!(
        sim.forces.get(&n(2)),
        Some(&1),
        "participants force their prepare record"
    );
    assert_eq!(sim.forces.get(&n(3)), Some(&1));
    assert!(sim.did(2, "commit") && sim.did(3, "commit") && sim.did(1, "commit"));
    assert!(matches!(
        sim.records[&n(1)].last(),
        Some(TmRecord::End { .. })
    ));
    assert_eq!(
        sim.messages, 8,
        "prepare, vote, decision, ack per participant"
    );
    for i in 1..=3 {
        assert_eq!(sim.phase(i), Phase::Done(Some(Outcome::Committed)));
    }
}

#[test]
fn a_read_only_branch_leaves_phase_two() {
    let mut sim = Sim::new(&[(1, 2), (1, 3)], &[(2, DURABLE)]);
    sim.input(n(1), Input::Commit);
    sim.settle();
    assert_eq!(sim.finished, Some(Outcome::Committed));
    assert_eq!(sim.phase(3), Phase::Done(None));
    assert!(
        !sim.did(3, "commit"),
        "read-only node 3 never hears the outcome"
    );
    assert_eq!(sim.messages, 6);
}

#[test]
fn a_no_vote_aborts_everyone_without_forcing_an_abort() {
    let mut sim = Sim::new(
        &[(1, 2), (1, 3)],
        &[(2, DURABLE), (3, Vote::No("full".into()))],
    );
    sim.input(n(1), Input::Commit);
    sim.settle();
    assert_eq!(sim.finished, Some(Outcome::Aborted));
    assert!(sim.did(2, "abort") && sim.did(1, "abort"));
    assert!(!sim.did(2, "commit"));
    assert!(!sim.forces.contains_key(&n(1)), "aborts are never forced");
}

/// A prepared participant's Yes that the coordinator turned into No (a
/// VoteAfter naming a transaction that aborted, or a vote its resources
/// refused after the branch prepared): that participant is in doubt and
/// hears the abort at once, like every other one, not through its own
/// inquiry a retry period later.
#[test]
fn a_prepared_participant_whose_vote_counted_as_no_hears_the_abort_at_once() {
    let mut sim = Sim::new(&[(1, 2), (1, 3)], &[(2, DURABLE), (3, DURABLE)]);
    sim.input(n(1), Input::Commit);
    while let Some((from, to, msg)) = sim.queue.pop_front() {
        let msg = match msg {
            TxMsg::Vote { tid, .. } if from == n(3) => TxMsg::Vote {
                tid,
                vote: Vote::No(format!("{tid} used writes of t1.1.1, which aborted")),
            },
            other => other,
        };
        sim.deliver(from, to, msg);
        while let Some(node) = sim.pending_force.pop() {
            sim.input(node, Input::Forced);
        }
    }
    assert_eq!(sim.finished, Some(Outcome::Aborted));
    // No tick happened: the abort reached both participants as messages.
    for i in 1..=3 {
        assert_eq!(
            sim.phase(i),
            Phase::Done(Some(Outcome::Aborted)),
            "node {i}"
        );
        assert!(sim.did(i, "abort"), "node {i}");
    }
}

#[test]
fn a_tree_of_processes_votes_per_subtree() {
    // 1 -> 2 -> 4, 1 -> 3; node 4 holds durable state, node 2 none itself.
    let mut sim = Sim::new(&[(1, 2), (2, 4), (1, 3)], &[(4, DURABLE)]);
    sim.input(n(1), Input::Commit);
    sim.settle();
    assert_eq!(sim.finished, Some(Outcome::Committed));
    assert!(sim.did(4, "commit"));
    assert_eq!(
        sim.forces.get(&n(2)),
        Some(&1),
        "node 2 votes for a durable subtree"
    );
    assert!(matches!(
        sim.records[&n(2)][0],
        TmRecord::Prepared {
            parent: NodeId(1),
            ..
        }
    ));
    assert_eq!(sim.phase(3), Phase::Done(None));
}

#[test]
fn a_cycle_back_to_the_coordinator_commits() {
    let mut sim = Sim::new(&[(1, 2), (2, 1)], &[(2, DURABLE)]);
    sim.input(n(1), Input::Commit);
    sim.settle();
    assert_eq!(sim.finished, Some(Outcome::Committed));
    assert!(sim.did(2, "commit"));
}

#[test]
fn a_node_with_two_parents_votes_once() {
    // 1 -> 2 -> 3 and 1 -> 3: node 3 answers the first Prepare it gets.
    let mut sim = Sim::new(&[(1, 2), (2, 3), (1, 3)], &[(3, DURABLE)]);
    sim.input(n(1), Input::Commit);
    sim.settle();
    assert_eq!(sim.finished, Some(Outcome::Committed));
    assert!(sim.did(3, "commit"));
    assert_eq!(sim.forces.get(&n(3)), Some(&1));
}

#[test]
fn lost_messages_are_retransmitted() {
    let mut sim = Sim::new(&[(1, 2)], &[(2, DURABLE)]);
    sim.input(n(1), Input::Commit);
    sim.queue.clear(); // the Prepare is lost
    sim.tick(Duration::ZERO);
    sim.tick(Duration::from_millis(250));
    sim.settle();
    assert_eq!(sim.finished, Some(Outcome::Committed));
    // Now lose the Ack: the coordinator keeps sending the decision.
    let mut sim = Sim::new(&[(1, 2)], &[(2, DURABLE)]);
    sim.input(n(1), Input::Commit);
    while let Some((from, to, msg)) = sim.queue.pop_front() {
        if matches!(msg, TxMsg::Ack { .. }) {
            continue;
        }
        sim.deliver(from, to, msg);
        while let Some(node) = sim.pending_force.pop() {
            sim.input(node, Input::Forced);
        }
        while let Some(node) = sim.pending_lazy.pop() {
            sim.input(node, Input::LazyDurable);
        }
    }
    assert_eq!(sim.phase(1), Phase::Committing);
    sim.tick(Duration::ZERO);
    sim.tick(Duration::from_millis(250));
    sim.settle();
    assert_eq!(sim.phase(1), Phase::Done(Some(Outcome::Committed)));
}

#[test]
fn an_in_doubt_participant_inquires_and_learns_the_outcome() {
    let mut sim = Sim::new(&[(1, 2)], &[(2, DURABLE)]);
    sim.input(n(1), Input::Commit);
    // Deliver everything but the coordinator's decision, which is lost.
    while let Some((from, to, msg)) = sim.queue.pop_front() {
        if matches!(msg, TxMsg::Decision { .. }) {
            continue;
        }
        sim.deliver(from, to, msg);
        while let Some(node) = sim.pending_force.pop() {
            sim.input(node, Input::Forced);
        }
    }
    assert_eq!(sim.phase(2), Phase::Prepared);
    // The coordinator's retransmission is lost too; node 2 asks on its own.
    sim.tick(Duration::ZERO);
    sim.tick(Duration::from_millis(250));
    sim.queue.retain(|(from, _, _)| *from == n(2));
    assert!(sim
        .queue
        .iter()
        .any(|(_, _, m)| matches!(m, TxMsg::Inquire { .. })));
    sim.settle();
    assert!(sim.did(2, "commit"));
}

#[test]
fn a_dead_participant_aborts_an_active_transaction_and_everyone_is_told() {
    let mut sim = Sim::new(&[(1, 2), (2, 3)], &[(2, DURABLE), (3, DURABLE)]);
    sim.input(n(2), Input::PeerDead(n(3), Status::HostDead));
    sim.settle();
    assert!(sim.did(2, "abort"));
    let cause = sim.cores[&n(2)]
        .abort_cause()
        .map(|(s, r)| (s, r.to_string()));
    assert_eq!(
        cause,
        Some((
            Status::HostDead,
            "node 3 died while the transaction ran".to_string()
        )),
        "the node that saw the death keeps how it happened"
    );
    assert!(
        sim.did(1, "abort"),
        "termination notification reached the coordinator"
    );
    assert_eq!(sim.phase(1), Phase::Done(Some(Outcome::Aborted)));
    assert_eq!(
        sim.finished,
        Some(Outcome::Aborted),
        "a waiting commit learns it"
    );
    assert!(sim
        .cores
        .get_mut(&n(1))
        .unwrap()
        .step(Input::Commit)
        .is_empty());
}

#[test]
fn the_deadline_aborts_an_active_transaction() {
    let cfg = CoreConfig::default();
    let start = Instant::now();
    let mut core = TxCore::coordinator(tid(), Some(start + Duration::from_secs(1)), cfg);
    assert!(core.add_child(n(2), Incarnation(1)));
    assert!(core.step(Input::Tick(start)).is_empty());
    let acts = core.step(Input::Tick(start + Duration::from_secs(2)));
    assert!(
        acts.contains(&Action::Finished(Outcome::Aborted)),
        "{acts:?}"
    );
    assert!(acts
        .iter()
        .any(|a| matches!(a, Action::Send(NodeId(2), TxMsg::Abort { .. }))));
    assert!(
        !core.add_child(n(3), Incarnation(1)),
        "an ended transaction takes no more calls"
    );
}

#[test]
fn in_doubt_branches_ignore_local_aborts_and_dead_parents() {
    let cfg = CoreConfig::default();
    let mut core = TxCore::recovered_prepared(tid(), n(1), vec![], cfg);
    assert!(core.step(Input::Abort("app".into())).is_empty());
    assert!(core
        .step(Input::PeerDead(n(1), Status::ProcDead))
        .is_empty());
    assert!(core.in_doubt());
    let acts = core.step(Input::Answer(Answer::Committed));
    assert!(acts.contains(&Action::CommitLocal));
}

#[test]
fn a_branch_recovered_in_doubt_asks_after_the_retry_period() {
    let cfg = CoreConfig::default();
    let t0 = Instant::now();
    let mut core = TxCore::recovered_prepared(tid(), n(1), vec![], cfg);
    assert!(core.step(Input::Tick(t0)).is_empty(), "the first tick arms");
    let acts = core.step(Input::Tick(t0 + cfg.retry));
    assert_eq!(
        acts,
        vec![Action::Send(n(1), TxMsg::Inquire { tid: tid() })],
        "asked like any prepared branch, not after the orphan check"
    );
}

/// Runs one transaction over a random tree with random local votes, with
/// random delivery order, losses and duplicates, ticking time forward, and
/// checks atomicity: no node both commits and aborts, every node that
/// commits does so only if the coordinator finished with Committed, and when
/// the coordinator committed, every durable branch commits.
fn run_random(seed: u64) -> Result<(), String> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let size = rng.gen_range(2..6u32);
    let mut edges = Vec::new();
    for child in 2..=size {
        edges.push((rng.gen_range(1..child), child));
    }
    if rng.gen_bool(0.3) {
        let a = rng.gen_range(1..=size);
        let b = rng.gen_range(2..=size);
        if a != b {
            edges.push((a, b));
        }
    }
    let mut votes = Vec::new();
    for i in 1..=size {
        let v = match rng.gen_range(0..10) {
            0 => Vote::No("random".into()),
            1..=4 => Vote::ReadOnly,
            5 => Vote::Yes { durable: false },
            _ => DURABLE,
        };
        votes.push((i, v));
    }
    let mut sim = Sim::new(&edges, &votes);
    let drop_p = rng.gen_range(0.0..0.3);
    sim.input(n(1), Input::Commit);
    for _round in 0..400 {
        if rng.gen_bool(0.2) {
            sim.tick(Duration::from_millis(rng.gen_range(0..400)));
        }
        if let Some(node) = (!sim.pending_force.is_empty()).then(|| sim.pending_force.remove(0)) {
            sim.input(node, Input::Forced);
        }
        if let Some(node) = (!sim.pending_lazy.is_empty()).then(|| sim.pending_lazy.remove(0)) {
            sim.input(node, Input::LazyDurable);
        }
        if sim.queue.is_empty() {
            continue;
        }
        let i = rng.gen_range(0..sim.queue.len());
        let (from, to, msg) = sim.queue.remove(i).expect("index in range");
        if rng.gen_bool(drop_p) {
            continue;
        }
        if rng.gen_bool(0.1) {
            sim.queue.push_back((from, to, msg.clone()));
        }
        sim.deliver(from, to, msg);
    }
    // Calm network: let retransmissions finish the job.
    for _ in 0..50 {
        sim.settle();
        sim.tick(Duration::from_secs(6));
    }
    sim.settle();
    let report = || {
        format!(
            "seed {seed}: edges {edges:?} votes {votes:?} local {:?}",
            sim.local
        )
    };
    for (node, acts) in &sim.local {
        if acts.contains(&"commit") && acts.contains(&"abort") {
            return Err(format!(
                "node {node:?} both committed and aborted; {}",
                report()
            ));
        }
        if acts.contains(&"commit") && sim.finished != Some(Outcome::Committed) {
            return Err(format!(
                "node {node:?} committed but the outcome is {:?}; {}",
                sim.finished,
                report()
            ));
        }
    }
    if sim.finished.is_none() {
        return Err(format!("the coordinator never finished; {}", report()));
    }
    if sim.finished == Some(Outcome::Committed) {
        for (i, v) in &votes {
            if matches!(v, Vote::Yes { .. }) && !sim.did(*i, "commit") {
                return Err(format!(
                    "node {i} voted yes but never committed; {}",
                    report()
                ));
            }
        }
    }
    for (node, core) in &sim.cores {
        if !matches!(core.phase(), Phase::Done(_)) && core.phase() != &Phase::Active {
            return Err(format!(
                "node {node:?} stuck in {:?}; {}",
                core.phase(),
                report()
            ));
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]
    #[test]
    fn atomicity_holds_under_loss_duplication_and_reordering(seed in any::<u64>()) {
        if let Err(e) = run_random(seed) {
            prop_assert!(false, "{}", e);
        }
    }
}

#[test]
fn an_orphaned_active_branch_asks_and_aborts() {
    // 1 -> 2; node 1 aborts and its notice to node 2 is lost.
    let mut sim = Sim::new(&[(1, 2)], &[(2, DURABLE)]);
    sim.input(n(1), Input::Abort("app".into()));
    sim.queue.clear();
    assert_eq!(sim.phase(2), Phase::Active);
    sim.tick(Duration::ZERO);
    sim.tick(Duration::from_secs(2));
    assert!(
        sim.queue.iter().any(|(from, to, m)| *from == n(2)
            && *to == n(1)
            && matches!(m, TxMsg::Inquire { .. })),
        "the quiet branch asks its coordinator"
    );
    // The coordinator has forgotten the transaction: presumed abort.
    sim.cores.remove(&n(1));
    sim.settle();
    assert!(sim.did(2, "abort"));
    assert_eq!(sim.phase(2), Phase::Done(Some(Outcome::Aborted)));
}

#[test]
fn a_branch_of_a_live_transaction_keeps_waiting() {
    let mut sim = Sim::new(&[(1, 2)], &[(2, DURABLE)]);
    sim.tick(Duration::ZERO);
    sim.tick(Duration::from_secs(2));
    sim.settle();
    assert_eq!(
        sim.phase(2),
        Phase::Active,
        "Pending: the coordinator still runs it"
    );
}

#[test]
fn a_branch_recovered_committed_with_nothing_left_to_do_finishes() {
    let cfg = CoreConfig::default();
    let t0 = Instant::now();
    let mut core = TxCore::recovered_committed(tid(), Some(n(1)), vec![], cfg);
    assert_eq!(core.phase(), &Phase::Committing);
    assert!(
        core.step(Input::Tick(t0)).is_empty(),
        "the first tick arms the timer"
    );
    let acts = core.step(Input::Tick(t0 + Duration::from_secs(1)));
    assert!(
        acts.contains(&Action::Send(n(1), TxMsg::Ack { tid: tid() })),
        "{acts:?}"
    );
    assert_eq!(core.phase(), &Phase::Done(Some(Outcome::Committed)));
}

const VOLATILE: Vote = Vote::Yes { durable: false };

#[test]
fn a_coordinator_without_durable_state_hands_the_decision_to_its_one_child() {
    for local in [VOLATILE, Vote::ReadOnly] {
        let mut sim = Sim::new(&[(1, 2)], &[(1, local.clone()), (2, DURABLE)]).delegating();
        sim.input(n(1), Input::Commit);
        sim.settle();
        assert_eq!(sim.finished, Some(Outcome::Committed), "local {local:?}");
        assert_eq!(
            sim.total_forces(),
            1,
            "one force: the child's commit record"
        );
        assert!(
            !sim.records.contains_key(&n(1)),
            "the coordinator writes nothing"
        );
        assert_eq!(
            sim.records[&n(2)],
            vec![
                TmRecord::Committed {
                    tid: tid(),
                    children: vec![(n(1), Incarnation(1))],
                },
                TmRecord::End { tid: tid() },
            ],
            "the decider's record names the coordinator, which must hear the decision"
        );
        assert!(sim.did(1, "commit") && sim.did(2, "commit"));
        assert_eq!(
            sim.messages, 3,
            "a one-phase Prepare, the Decision up, the Ack"
        );
        assert_eq!(sim.phase(1), Phase::Done(Some(Outcome::Committed)));
        assert_eq!(sim.phase(2), Phase::Done(Some(Outcome::Committed)));
    }
}

#[test]
fn the_delegating_coordinator_commits_its_resources_only_after_the_decision() {
    let mut sim = Sim::new(&[(1, 2)], &[(1, VOLATILE), (2, DURABLE)]).delegating();
    sim.input(n(1), Input::Commit);
    let (f, t, _) = sim.run_until(|_, _, m| matches!(m, TxMsg::Decision { .. }));
    assert_eq!((f, t), (n(2), n(1)));
    assert_eq!(
        sim.forces.get(&n(2)),
        Some(&1),
        "the decision is durable first"
    );
    assert!(
        !sim.did(1, "commit"),
        "nothing committed before the decision"
    );
    assert!(sim.cores[&n(1)].in_doubt());
    assert_eq!(sim.cores[&n(1)].answer(), Answer::Pending);
    // The decision is lost: the decider sends it again until acknowledged.
    sim.settle();
    assert_eq!(sim.finished, None);
    sim.resend_and_settle();
    assert_eq!(sim.finished, Some(Outcome::Committed));
    assert!(sim.did(1, "commit"));
    assert_eq!(sim.phase(2), Phase::Done(Some(Outcome::Committed)));
}

#[test]
fn a_lost_one_phase_prepare_is_sent_again() {
    let mut sim = Sim::new(&[(1, 2)], &[(1, VOLATILE), (2, DURABLE)]).delegating();
    sim.input(n(1), Input::Commit);
    let (_, _, m) = sim
        .run_until(|_, _, m| matches!(m, TxMsg::Prepare { .. } | TxMsg::DelegatedPrepare { .. }));
    assert!(matches!(m, TxMsg::DelegatedPrepare { .. }));
    sim.resend_and_settle();
    assert_eq!(sim.finished, Some(Outcome::Committed));
    assert_eq!(sim.total_forces(), 1);
}

#[test]
fn a_delegate_that_votes_no_aborts_the_transaction() {
    let mut sim = Sim::new(&[(1, 2)], &[(1, VOLATILE), (2, Vote::No("full".into()))]).delegating();
    sim.input(n(1), Input::Commit);
    sim.settle();
    assert_eq!(sim.finished, Some(Outcome::Aborted));
    assert_eq!(sim.total_forces(), 0);
    assert!(sim.did(1, "abort") && sim.did(2, "abort"));
    assert!(!sim.did(1, "commit"));
}

#[test]
fn a_delegate_that_may_not_decide_votes_and_the_coordinator_decides() {
    let mut sim = Sim::new(&[(1, 2)], &[(1, VOLATILE), (2, DURABLE)]).delegating();
    sim.refuse_one_phase.push(n(2));
    sim.input(n(1), Input::Commit);
    sim.settle();
    assert_eq!(sim.finished, Some(Outcome::Committed));
    assert_eq!(sim.forces.get(&n(1)), Some(&1), "the usual commit record");
    assert_eq!(sim.forces.get(&n(2)), Some(&1), "the usual prepare record");
    assert!(sim.did(1, "commit") && sim.did(2, "commit"));
    assert_eq!(sim.phase(2), Phase::Done(Some(Outcome::Committed)));
}

#[test]
fn no_delegation_with_durable_state_at_the_coordinator_or_two_children() {
    let mut sim = Sim::new(&[(1, 2)], &[(1, DURABLE), (2, DURABLE)]).delegating();
    sim.input(n(1), Input::Commit);
    sim.settle();
    assert_eq!(sim.finished, Some(Outcome::Committed));
    assert_eq!(sim.total_forces(), 2);
    assert!(matches!(sim.records[&n(2)][0], TmRecord::Prepared { .. }));

    let mut sim = Sim::new(
        &[(1, 2), (1, 3)],
        &[(1, VOLATILE), (2, DURABLE), (3, DURABLE)],
    )
    .delegating();
    sim.input(n(1), Input::Commit);
    sim.settle();
    assert_eq!(sim.finished, Some(Outcome::Committed));
    assert_eq!(sim.total_forces(), 3);
}

#[test]
fn a_decider_forcing_its_commit_record_ignores_aborts_and_a_dead_coordinator() {
    let mut sim = Sim::new(&[(1, 2)], &[(1, VOLATILE), (2, DURABLE)]).delegating();
    sim.input(n(1), Input::Commit);
    // Deliver the one-phase Prepare; the decider's force stays pending.
    let (f, t, m) = sim
        .run_until(|_, _, m| matches!(m, TxMsg::Prepare { .. } | TxMsg::DelegatedPrepare { .. }));
    sim.deliver(f, t, m);
    assert_eq!(sim.phase(2), Phase::Forcing);
    assert!(sim.cores[&n(2)].is_decider());
    sim.input(n(2), Input::Abort("local".into()));
    sim.input(n(2), Input::PeerDead(n(1), Status::ProcDead));
    sim.input(
        n(2),
        Input::AbortNotice {
            from: n(1),
            status: Status::Aborted,
            reason: "late".into(),
        },
    );
    assert_eq!(sim.phase(2), Phase::Forcing);
    assert!(!sim.did(2, "abort"));
    sim.settle();
    assert_eq!(sim.finished, Some(Outcome::Committed));
}

#[test]
fn a_decider_recovered_committed_tells_the_coordinator() {
    let mut sim = Sim::new(&[(1, 2)], &[(1, VOLATILE), (2, DURABLE)]).delegating();
    sim.input(n(1), Input::Commit);
    // The decider crashes right after its force: the decision never left.
    let _ = sim.run_until(|_, _, m| matches!(m, TxMsg::Decision { .. }));
    sim.settle();
    assert!(sim.cores[&n(1)].in_doubt());
    let Some(TmRecord::Committed { children, .. }) = sim.records[&n(2)].first().cloned() else {
        panic!("the decider forced a commit record");
    };
    let cfg = CoreConfig::default();
    sim.cores.insert(
        n(2),
        TxCore::recovered_committed(tid(), None, children, cfg),
    );
    sim.resend_and_settle();
    assert_eq!(sim.finished, Some(Outcome::Committed));
    assert!(sim.did(1, "commit"));
    assert_eq!(sim.phase(2), Phase::Done(Some(Outcome::Committed)));
}
