//! Drives whole nodes' transaction cores message by message, several of
//! them wired together by a tiny in-test world with explicit time, an
//! explicit network queue and a log per node that loses what was not
//! forced when the node crashes. No runtime, no sleeps, no real clock
//! beyond one `Instant` taken as the epoch.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};

use super::*;

fn n(i: u32) -> NodeId {
    NodeId(i)
}

/// A resource handle: an index into the node's resources of this test.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Res {
    id: u32,
    class: ParticipationClass,
    early: bool,
}

impl ResourceRef for Res {
    fn name(&self) -> String {
        format!("res{}", self.id)
    }
    fn class(&self) -> ParticipationClass {
        self.class
    }
    fn commits_from_this_log(&self) -> bool {
        self.early
    }
    fn same(&self, other: &Self) -> bool {
        self.id == other.id
    }
}

fn kv() -> Res {
    Res {
        id: 1,
        class: ParticipationClass::TwoPhase,
        early: true,
    }
}

fn ext() -> Res {
    Res {
        id: 2,
        class: ParticipationClass::TwoPhase,
        early: false,
    }
}

struct Node {
    core: TmCore<Res>,
    incarnation: Incarnation,
    /// Every record appended, in order; `durable` of them survive a crash.
    log: Vec<(Lsn, TmRecord)>,
    durable: usize,
    /// Forces and durability waits not yet carried out (the disk is slow
    /// until the test syncs it).
    pending: Vec<Event>,
    /// What the resources vote (default Yes).
    votes: HashMap<Tid, Vote>,
    /// Undecided dependencies the resources report.
    deps: HashMap<Tid, Vec<Tid>>,
    /// Barriers the resources refuse.
    refuse: HashSet<Tid>,
    /// What the resources were told, in order.
    told: Vec<(Tid, &'static str)>,
    completed: HashMap<u64, Result<(), Failure>>,
    admitted: HashMap<u64, Result<(), Failure>>,
    crash_at: Option<CrashPoint>,
    crashed: bool,
    /// Barriers the test answers itself (see `World::release`).
    hold_barriers: bool,
    held_barriers: Vec<(BarrierId, Tid)>,
    /// Prepares the test answers itself.
    hold_prepares: bool,
    held_prepares: Vec<Tid>,
    /// Crash points reached.
    reached: Vec<(CrashPoint, Tid)>,
    sync_forces: bool,
}

/// Drops a message when it answers true.
type DropRule = Box<dyn FnMut(NodeId, NodeId, &TxMsg) -> bool>;

struct World {
    now: Instant,
    nodes: BTreeMap<NodeId, Node>,
    net: VecDeque<(NodeId, NodeId, TxMsg)>,
    /// Messages matching this are dropped (once each).
    drop_next: Vec<DropRule>,
    history: Vec<String>,
    next_waiter: u64,
}

impl World {
    fn new(nodes: &[u32]) -> World {
        let epoch = Instant::now();
        let mut w = World {
            now: epoch,
            nodes: BTreeMap::new(),
            net: VecDeque::new(),
            drop_next: Vec::new(),
            history: Vec::new(),
            next_waiter: 1,
        };
        for &i in nodes {
            w.start(n(i), Incarnation(1), NodeConfig::default());
        }
        w
    }

    fn start(&mut self, id: NodeId, incarnation: Incarnation, cfg: NodeConfig) {
        let mut core = TmCore::new(id, incarnation, cfg, self.now);
        core.register_resource(kv());
        self.nodes.insert(
            id,
            Node {
                core,
                incarnation,
                log: Vec::new(),
                durable: 0,
                pending: Vec::new(),
                votes: HashMap::new(),
                deps: HashMap::new(),
                refuse: HashSet::new(),
                told: Vec::new(),
                completed: HashMap::new(),
                admitted: HashMap::new(),
                crash_at: None,
                crashed: false,
                hold_barriers: false,
                held_barriers: Vec::new(),
                hold_prepares: false,
                held_prepares: Vec::new(),
                reached: Vec::new(),
                sync_forces: true,
            },
        );
    }

    fn node(&mut self, i: u32) -> &mut Node {
        self.nodes.get_mut(&n(i)).expect("node exists")
    }

    /// A crash: only forced records survive; the node restarts at its next
    /// incarnation and recovers from them.
    fn crash_and_restart(&mut self, i: u32) -> RecoveryReport {
        let old = self.nodes.remove(&n(i)).expect("node exists");
        let durable: Vec<(Lsn, TmRecord)> = old.log[..old.durable].to_vec();
        let inc = Incarnation(old.incarnation.0 + 1);
        self.start(n(i), inc, *old.core.config());
        self.net.retain(|(_, to, _)| *to != n(i));
        let node = self.node(i);
        node.log = durable.clone();
        node.durable = durable.len();
        let report = node.core.recover(scan(durable));
        self.history.push(format!("node {i} restarted: {report:?}"));
        report
    }

    /// Carries out `actions` of node `at`, feeding results back (flat
    /// queue, results first).
    fn run(&mut self, at: NodeId, actions: Vec<Action<Res>>) {
        let mut queue: VecDeque<Action<Res>> = actions.into();
        while let Some(a) = queue.pop_front() {
            let now = self.now;
            let node = self.nodes.get_mut(&at).expect("node exists");
            if node.crashed {
                return;
            }
            let feed = |node: &mut Node, ev: Event, queue: &mut VecDeque<Action<Res>>| {
                let more = node.core.step(now, ev);
                for m in more.into_iter().rev() {
                    queue.push_front(m);
                }
            };
            match a {
                Action::Send { to, msg } => {
                    self.history.push(format!("{at} -> {to}: {msg:?}"));
                    self.net.push_back((at, to, msg));
                }
                Action::Append { record, token } => {
                    let lsn = Lsn(node.log.len() as u64 + 1);
                    node.log.push((lsn, record));
                    feed(node, Event::Appended { token, lsn }, &mut queue);
                }
                Action::ExpectForce { .. } | Action::Decided { .. } | Action::Forgotten { .. } => {}
                Action::Force { tid, lsn, .. } => {
                    if node.sync_forces {
                        node.durable = node.durable.max(lsn.0 as usize);
                        feed(node, Event::Forced { tid }, &mut queue);
                    } else {
                        node.pending.push(Event::Forced { tid });
                    }
                }
                Action::AwaitLazy { tid, .. } => node.pending.push(Event::LazyDurable { tid }),
                Action::WaitDurable { lsn } => node.pending.push(Event::Durable { upto: lsn }),
                Action::ResourcePrepare { tid, .. } if node.hold_prepares => {
                    node.held_prepares.push(tid);
                }
                Action::ResourcePrepare { tid, .. } => {
                    let vote = node
                        .votes
                        .get(&tid)
                        .cloned()
                        .unwrap_or(Vote::Yes { durable: true });
                    feed(node, Event::ResourceVoted { tid, vote }, &mut queue);
                }
                Action::ResourceCommit { tid, .. } => node.told.push((tid, "commit")),
                Action::ResourceAbort { tid, .. } => node.told.push((tid, "abort")),
                Action::ResourceEnded { tid, .. } => node.told.push((tid, "ended")),
                Action::ResourceSubEnded { tid, .. } => node.told.push((tid, "sub-ended")),
                Action::QueryDependencies { tid, .. } => {
                    let result = Ok(node.deps.get(&tid).cloned().unwrap_or_default());
                    feed(node, Event::Dependencies { tid, result }, &mut queue);
                }
                Action::VoteBarrier { id, tid, .. } if node.hold_barriers => {
                    node.held_barriers.push((id, tid));
                }
                Action::VoteBarrier { id, tid, .. } => {
                    let result = if node.refuse.contains(&tid) {
                        Err("refused".to_string())
                    } else {
                        Ok(())
                    };
                    feed(node, Event::BarrierDone { id, result }, &mut queue);
                }
                Action::Complete { waiter, result } => {
                    node.completed.insert(waiter.0, result);
                }
                Action::CallAdmitted { call, result } => {
                    node.admitted.insert(call.0, result);
                }
                Action::CrashPoint { point, tid } => {
                    node.reached.push((point, tid));
                    if node.crash_at == Some(point) {
                        self.history
                            .push(format!("{at} crashes at {point} ({tid})"));
                        node.crashed = true;
                        return;
                    }
                }
            }
        }
    }

    /// The disk of node `i` catches up: every pending force and wait ends.
    fn sync(&mut self, i: u32) {
        let node = self.node(i);
        node.durable = node.log.len();
        let upto = Lsn(node.log.len() as u64);
        let pending = std::mem::take(&mut node.pending);
        for ev in pending {
            let ev = match ev {
                Event::Durable { .. } => Event::Durable { upto },
                other => other,
            };
            self.step(i, ev);
        }
    }

    fn step(&mut self, i: u32, ev: Event) {
        let now = self.now;
        let node = self.node(i);
        if node.crashed {
            return;
        }
        let actions = node.core.step(now, ev);
        self.run(n(i), actions);
    }

    /// Delivers messages (and syncs disks) until nothing moves.
    fn settle(&mut self) {
        for _ in 0..100_000 {
            if let Some((from, to, msg)) = self.net.pop_front() {
                let mut dropped = false;
                for f in self.drop_next.iter_mut() {
                    if f(from, to, &msg) {
                        dropped = true;
                        break;
                    }
                }
                if dropped {
                    self.history
                        .push(format!("dropped {from} -> {to}: {msg:?}"));
                    continue;
                }
                let Some(node) = self.nodes.get(&to) else {
                    continue;
                };
                let from_incarnation = self
                    .nodes
                    .get(&from)
                    .map(|f| f.incarnation)
                    .unwrap_or_default();
                if node.crashed {
                    continue;
                }
                self.step(
                    to.0,
                    Event::Msg {
                        from,
                        from_incarnation,
                        msg,
                    },
                );
                continue;
            }
            let busy: Vec<u32> = self
                .nodes
                .iter()
                .filter(|(_, nd)| !nd.pending.is_empty() && !nd.crashed)
                .map(|(id, _)| id.0)
                .collect();
            if busy.is_empty() {
                return;
            }
            for i in busy {
                self.sync(i);
            }
        }
        panic!("the world never settled:\n{}", self.history.join("\n"));
    }

    /// Time passes by `d`; every node ticks, then the world settles.
    fn advance(&mut self, d: Duration) {
        self.now += d;
        let ids: Vec<u32> = self.nodes.keys().map(|k| k.0).collect();
        for i in ids {
            self.step(i, Event::Tick);
        }
        self.settle();
    }

    fn begin(&mut self, i: u32) -> TxContext {
        let now = self.now;
        let tid = self.node(i).core.begin(now, None).expect("under the limit");
        TxContext {
            tid,
            path: SubPath::top(),
            budget_us: Some(60_000_000),
            baggage: Baggage::default(),
        }
    }

    /// Node `from` calls node `to` in `ctx`; the call enlists `res` at `to`
    /// and ends at once.
    fn call(&mut self, ctx: &TxContext, from: u32, to: u32, res: Res) {
        let inc = self.node(to).incarnation;
        self.node(from)
            .core
            .call_out(ctx.tid, n(to), inc)
            .expect("active");
        self.local_call(ctx, to, from, res);
    }

    /// A call at node `at` (from node `from`) enlisting `res`.
    fn local_call(&mut self, ctx: &TxContext, at: u32, from: u32, res: Res) {
        let now = self.now;
        let mut out = Vec::new();
        let joined = self
            .node(at)
            .core
            .call_in(now, ctx, n(from), true, Some(res), CallId(0), &mut out)
            .expect("joined");
        assert_eq!(joined, CallIn::Joined);
        self.run(n(at), out);
        self.step(at, Event::CallDone { tid: ctx.tid });
    }

    fn commit(&mut self, i: u32, tid: Tid) -> u64 {
        let waiter = self.next_waiter;
        self.next_waiter += 1;
        self.step(
            i,
            Event::Commit {
                tid,
                waiter: WaiterId(waiter),
            },
        );
        waiter
    }

    fn result(&mut self, i: u32, waiter: u64) -> Option<Result<(), Failure>> {
        self.node(i).completed.get(&waiter).cloned()
    }

    fn told(&mut self, i: u32, tid: Tid) -> Vec<&'static str> {
        self.node(i)
            .told
            .iter()
            .filter(|(t, _)| *t == tid)
            .map(|(_, w)| *w)
            .collect()
    }

    /// Answers node `i`'s held barriers of `tid` with `result`.
    fn release(&mut self, i: u32, tid: Tid, result: Result<(), String>) {
        let node = self.node(i);
        let (mine, rest): (Vec<_>, Vec<_>) =
            node.held_barriers.drain(..).partition(|(_, t)| *t == tid);
        node.held_barriers = rest;
        assert!(!mine.is_empty(), "no barrier of {tid} is held at node {i}");
        for (id, _) in mine {
            self.step(
                i,
                Event::BarrierDone {
                    id,
                    result: result.clone(),
                },
            );
        }
        self.settle();
    }

    fn dump(&self) -> String {
        self.history.join("\n")
    }
}

#[test]
fn a_tree_of_three_nodes_commits_and_forgets() {
    let mut w = World::new(&[1, 2, 3]);
    let ctx = w.begin(1);
    w.local_call(&ctx, 1, 1, kv());
    w.call(&ctx, 1, 2, kv());
    w.call(&ctx, 2, 3, kv());
    let waiter = w.commit(1, ctx.tid);
    w.settle();
    assert_eq!(w.result(1, waiter), Some(Ok(())), "{}", w.dump());
    for i in [1, 2, 3] {
        assert_eq!(w.told(i, ctx.tid), vec!["commit"], "node {i}\n{}", w.dump());
        assert!(!w.node(i).core.is_live(ctx.tid), "node {i} forgot it");
    }
    // Participants forced a prepare record; the coordinator its commit
    // record; every node ends with End (or a lazy Committed below).
    assert!(matches!(w.node(2).log[0].1, TmRecord::Prepared { .. }));
    assert!(matches!(w.node(1).log[0].1, TmRecord::Committed { .. }));
    assert_eq!(w.node(1).core.stats().forced_records, 1);
    assert_eq!(
        w.node(1).core.finished_outcome(ctx.tid),
        Some(Some(Outcome::Committed))
    );
}

#[test]
fn forgotten_and_unknown_transactions_get_presumed_abort_answers() {
    let mut w = World::new(&[1, 2]);
    let never = Tid::new(n(1), Incarnation(1), 99);
    let now = w.now;
    let mut out = w.node(1).core.step(
        now,
        Event::Msg {
            from: n(2),
            from_incarnation: Incarnation(1),
            msg: TxMsg::Inquire { tid: never },
        },
    );
    assert!(matches!(
        out.pop(),
        Some(Action::Send { to, msg: TxMsg::Outcome { answer: Answer::Aborted, .. } }) if to == n(2)
    ));
    // A Prepare for a branch never heard of (same incarnation): read-only.
    let other = Tid::new(n(2), Incarnation(1), 5);
    let mut out = w.node(1).core.step(
        now,
        Event::Msg {
            from: n(2),
            from_incarnation: Incarnation(1),
            msg: TxMsg::Prepare {
                tid: other,
                incarnation: Incarnation(1),
                aborted_subs: vec![],
            },
        },
    );
    assert!(matches!(
        out.pop(),
        Some(Action::Send {
            msg: TxMsg::Vote {
                vote: Vote::ReadOnly,
                ..
            },
            ..
        })
    ));
    // A retransmitted commit decision for a forgotten branch: acked.
    let mut out = w.node(1).core.step(
        now,
        Event::Msg {
            from: n(2),
            from_incarnation: Incarnation(1),
            msg: TxMsg::Decision {
                tid: Tid::new(n(2), Incarnation(1), 6),
                commit: true,
            },
        },
    );
    assert!(matches!(
        out.pop(),
        Some(Action::Send {
            msg: TxMsg::Ack { .. },
            ..
        })
    ));
    // A committed transaction, forgotten, still answers Committed while
    // its tombstone lasts, then presumed abort.
    let ctx = w.begin(1);
    w.local_call(&ctx, 1, 1, kv());
    let waiter = w.commit(1, ctx.tid);
    w.settle();
    assert_eq!(w.result(1, waiter), Some(Ok(())));
    let inquire = |w: &mut World| {
        let now = w.now;
        let out = w.node(1).core.step(
            now,
            Event::Msg {
                from: n(2),
                from_incarnation: Incarnation(1),
                msg: TxMsg::Inquire { tid: ctx.tid },
            },
        );
        match &out[..] {
            [Action::Send {
                msg: TxMsg::Outcome { answer, .. },
                ..
            }] => *answer,
            other => panic!("{other:?}"),
        }
    };
    assert_eq!(inquire(&mut w), Answer::Committed);
    // A late commit call gets the same answer.
    let again = w.commit(1, ctx.tid);
    assert_eq!(w.result(1, again), Some(Ok(())));
    // Past the deadline and the retention window the tombstone goes.
    w.advance(Duration::from_secs(61) + NodeConfig::default().tombstone_retention);
    assert_eq!(w.node(1).core.tombstone_count(), 0);
    assert_eq!(inquire(&mut w), Answer::Aborted);
    let again = w.commit(1, ctx.tid);
    assert_eq!(
        w.result(1, again).expect("answered").unwrap_err().status,
        Status::NoSuchTransaction
    );
}

#[test]
fn a_prepare_for_an_earlier_incarnation_is_refused() {
    let mut w = World::new(&[1, 2]);
    let ctx = w.begin(1);
    w.call(&ctx, 1, 2, kv());
    w.crash_and_restart(2);
    let waiter = w.commit(1, ctx.tid);
    w.settle();
    let err = w.result(1, waiter).expect("answered").unwrap_err();
    assert_eq!(err.status, Status::Aborted, "{err}");
    assert!(err.detail.contains("restarted"), "{err}\n{}", w.dump());
}

#[test]
fn a_vote_after_waits_for_the_commit_record_it_names() {
    let mut w = World::new(&[1, 2]);
    // A writes at node 2; B used A's writes there (controlled lock
    // violation) and names A in its vote.
    let a = w.begin(1);
    w.call(&a, 1, 2, kv());
    let b = w.begin(1);
    w.call(&b, 1, 2, kv());
    w.node(2).deps.insert(b.tid, vec![a.tid]);
    // Node 1's disk is slow: A's commit record is appended but not durable
    // when B's vote arrives.
    w.node(1).sync_forces = false;
    let wb = w.commit(1, b.tid);
    // B's vote names A, which has no commit record yet: B waits.
    let mut guard = 0;
    while let Some((from, to, msg)) = w.net.pop_front() {
        guard += 1;
        assert!(guard < 100);
        let inc = w.node(from.0).incarnation;
        w.step(
            to.0,
            Event::Msg {
                from,
                from_incarnation: inc,
                msg,
            },
        );
    }
    assert!(w.result(1, wb).is_none(), "B waits for A\n{}", w.dump());
    assert!(
        w.history.iter().any(|h| h.contains("VoteAfter")),
        "{}",
        w.dump()
    );
    assert_eq!(w.node(1).core.side_tables(), 1, "one vote waits");
    let wa = w.commit(1, a.tid);
    w.settle();
    assert_eq!(w.result(1, wa), Some(Ok(())), "{}", w.dump());
    assert_eq!(w.result(1, wb), Some(Ok(())), "{}", w.dump());
    // A's commit record precedes B's in the coordinator's log.
    let order: Vec<Tid> = w
        .node(1)
        .log
        .iter()
        .filter_map(|(_, r)| match r {
            TmRecord::Committed { tid, .. } => Some(*tid),
            _ => None,
        })
        .collect();
    assert_eq!(order, vec![a.tid, b.tid]);
    assert_eq!(w.node(1).core.side_tables(), 0);
}

#[test]
fn a_vote_after_naming_an_aborted_transaction_brings_both_aborts() {
    let mut w = World::new(&[1, 2]);
    let a = w.begin(1);
    w.call(&a, 1, 2, kv());
    let b = w.begin(1);
    w.call(&b, 1, 2, kv());
    w.node(2).deps.insert(b.tid, vec![a.tid]);
    // A aborts at the coordinator; node 2 never hears (the notice is lost).
    w.drop_next.push(Box::new({
        let a = a.tid;
        let mut once = true;
        move |_, _, m| {
            let hit = once && matches!(m, TxMsg::Abort { tid, .. } if *tid == a);
            once &= !hit;
            hit
        }
    }));
    let mut out = Vec::new();
    w.node(1).core.abort(a.tid, "test", &mut out).expect("live");
    w.run(n(1), out);
    w.settle();
    assert!(w.node(2).core.is_live(a.tid), "node 2 missed the abort");
    let wb = w.commit(1, b.tid);
    w.settle();
    let err = w.result(1, wb).expect("answered").unwrap_err();
    assert_eq!(err.status, Status::Aborted, "{err}");
    assert!(
        !w.node(2).core.is_live(a.tid),
        "node 2 heard A's abort\n{}",
        w.dump()
    );
    assert!(!w.node(2).core.is_live(b.tid));
    assert!(w.told(2, a.tid).contains(&"abort"));
}

#[test]
fn a_peer_death_concerns_its_incarnation_and_older_transactions_only() {
    let mut w = World::new(&[1, 2]);
    let older = w.begin(1);
    w.node(1)
        .core
        .call_out(older.tid, n(2), Incarnation(1))
        .expect("active");
    let announced = w.node(1).core.births();
    let newer = w.begin(1);
    w.node(1)
        .core
        .call_out(newer.tid, n(2), Incarnation(1))
        .expect("active");
    let dead = |inc: u32, born_before: Option<u64>| Event::PeerDead {
        node: n(2),
        status: Status::ProcDead,
        incarnation: Some(Incarnation(inc)),
        born_before,
    };
    w.step(1, dead(7, None));
    assert!(w.node(1).core.phase(older.tid) == Some(&Phase::Active));
    assert!(w.node(1).core.phase(newer.tid) == Some(&Phase::Active));
    w.step(1, dead(1, Some(announced)));
    assert!(
        !w.node(1).core.is_live(older.tid),
        "it used the node that died"
    );
    assert!(w.node(1).core.is_live(newer.tid), "it began after the news");
    let waiter = w.commit(1, older.tid);
    assert_eq!(
        w.result(1, waiter).expect("answered").unwrap_err().status,
        Status::ProcDead
    );
    // Without an incarnation every child there counts.
    w.step(
        1,
        Event::PeerDead {
            node: n(2),
            status: Status::HostDead,
            incarnation: None,
            born_before: None,
        },
    );
    assert!(!w.node(1).core.is_live(newer.tid));
}

#[test]
fn early_lock_release_commits_log_resources_before_the_force_and_holds_read_only_answers() {
    let mut w = World::new(&[1]);
    w.node(1).sync_forces = false;
    let writer = w.begin(1);
    w.local_call(&writer, 1, 1, kv());
    w.local_call(&writer, 1, 1, ext());
    let ww = w.commit(1, writer.tid);
    // The commit record is appended, not durable: the KV store (which
    // commits from this log) already committed; the external one has not;
    // the writer's caller has not heard.
    assert_eq!(w.told(1, writer.tid), vec!["commit"]);
    assert!(w.result(1, ww).is_none());
    // A read-only transaction that may have read the writer's data is not
    // reported committed before the writer's record is durable.
    let reader = w.begin(1);
    let wr = w.commit(1, reader.tid);
    assert!(w.result(1, wr).is_none(), "held behind the early release");
    w.settle();
    assert_eq!(w.result(1, wr), Some(Ok(())));
    assert_eq!(w.result(1, ww), Some(Ok(())));
    assert_eq!(w.told(1, writer.tid), vec!["commit", "commit"]);
}

#[test]
fn in_doubt_participants_recover_and_learn_the_outcome() {
    // The coordinator crashes once its commit record is durable, before
    // any decision leaves; the participant stays prepared (in doubt).
    let mut w = World::new(&[1, 2]);
    w.node(1).crash_at = Some(CrashPoint::CoordinatorAfterCommitForce);
    let ctx = w.begin(1);
    w.call(&ctx, 1, 2, kv());
    w.commit(1, ctx.tid);
    w.settle();
    assert_eq!(w.node(2).core.phase(ctx.tid), Some(&Phase::Prepared));
    // The participant crashes too, and recovers in doubt.
    let report = w.crash_and_restart(2);
    assert_eq!(report.in_doubt, vec![ctx.tid]);
    assert_eq!(w.node(2).core.recovered(ctx.tid), Some(Recovered::InDoubt));
    // The coordinator recovers committed and drives phase two again.
    let report = w.crash_and_restart(1);
    assert_eq!(report.redriven, vec![ctx.tid], "{}", w.dump());
    w.advance(Duration::from_secs(1));
    w.advance(Duration::from_secs(1));
    assert_eq!(w.told(2, ctx.tid), vec!["commit"], "{}", w.dump());
    assert!(!w.node(2).core.is_live(ctx.tid));
    assert!(!w.node(1).core.is_live(ctx.tid), "{}", w.dump());
    assert!(matches!(
        w.node(1).log.last(),
        Some((_, TmRecord::End { .. }))
    ));
}

#[test]
fn an_in_doubt_branch_inquires_and_hears_abort_from_a_coordinator_without_a_record() {
    let mut w = World::new(&[1, 2]);
    w.node(1).crash_at = Some(CrashPoint::CoordinatorBeforeCommitForce);
    let ctx = w.begin(1);
    w.call(&ctx, 1, 2, kv());
    w.commit(1, ctx.tid);
    w.settle();
    assert_eq!(w.node(2).core.phase(ctx.tid), Some(&Phase::Prepared));
    let report = w.crash_and_restart(1);
    assert!(report.redriven.is_empty() && report.in_doubt.is_empty());
    // The participant's inquiry (after its retry period) hears abort.
    w.advance(Duration::from_millis(10));
    w.advance(CoreConfig::default().retry);
    assert_eq!(w.told(2, ctx.tid), vec!["abort"], "{}", w.dump());
    assert!(!w.node(2).core.is_live(ctx.tid));
}

#[test]
fn a_lost_prepare_is_retransmitted_and_a_lost_abort_is_found_by_the_orphan_check() {
    let mut w = World::new(&[1, 2]);
    let ctx = w.begin(1);
    w.call(&ctx, 1, 2, kv());
    w.drop_next.push(Box::new({
        let mut once = true;
        move |_, _, m| {
            let hit = once && matches!(m, TxMsg::Prepare { .. });
            once &= !hit;
            hit
        }
    }));
    let waiter = w.commit(1, ctx.tid);
    w.settle();
    assert!(w.result(1, waiter).is_none(), "the Prepare was lost");
    w.advance(Duration::from_millis(1)); // arms the retransmission timer
    w.advance(CoreConfig::default().retry);
    assert_eq!(w.result(1, waiter), Some(Ok(())), "{}", w.dump());

    // An abort notice lost on its way to an active branch: the branch asks
    // after the orphan check and aborts.
    let ctx = w.begin(1);
    w.call(&ctx, 1, 2, kv());
    w.drop_next.push(Box::new({
        let mut once = true;
        move |_, _, m| {
            let hit = once && matches!(m, TxMsg::Abort { .. });
            once &= !hit;
            hit
        }
    }));
    let mut out = Vec::new();
    w.node(1)
        .core
        .abort(ctx.tid, "test", &mut out)
        .expect("live");
    w.run(n(1), out);
    w.settle();
    assert!(w.node(2).core.is_live(ctx.tid));
    w.advance(Duration::from_millis(1));
    w.advance(CoreConfig::default().orphan_check);
    assert!(!w.node(2).core.is_live(ctx.tid), "{}", w.dump());
    assert_eq!(w.told(2, ctx.tid), vec!["abort"]);
}

#[test]
fn a_transaction_past_its_deadline_aborts_with_timed_out() {
    let mut w = World::new(&[1, 2]);
    let now = w.now;
    let tid = w
        .node(1)
        .core
        .begin(now, Some(Duration::from_secs(5)))
        .expect("begun");
    let ctx = TxContext {
        tid,
        path: SubPath::top(),
        budget_us: Some(5_000_000),
        baggage: Baggage::default(),
    };
    w.call(&ctx, 1, 2, kv());
    w.advance(Duration::from_secs(4));
    assert!(w.node(1).core.is_live(tid));
    w.advance(Duration::from_secs(1));
    assert!(!w.node(1).core.is_live(tid));
    assert!(!w.node(2).core.is_live(tid), "{}", w.dump());
    let waiter = w.commit(1, tid);
    assert_eq!(
        w.result(1, waiter).expect("answered").unwrap_err().status,
        Status::TimedOut
    );
}

#[test]
fn a_call_still_running_at_the_deadline_makes_the_branch_vote_no() {
    let mut w = World::new(&[1, 2]);
    let ctx = w.begin(1);
    w.node(1)
        .core
        .call_out(ctx.tid, n(2), Incarnation(1))
        .expect("active");
    let now = w.now;
    let mut out = Vec::new();
    w.node(2)
        .core
        .call_in(now, &ctx, n(1), true, Some(kv()), CallId(0), &mut out)
        .expect("joined");
    let waiter = w.commit(1, ctx.tid);
    w.settle();
    assert!(
        w.result(1, waiter).is_none(),
        "node 2's prepare waits for the call"
    );
    w.advance(Duration::from_secs(61));
    assert!(w.result(1, waiter).expect("answered").is_err());
    // The call ends after the abort: the resources hear the abort again.
    w.step(2, Event::CallDone { tid: ctx.tid });
    assert_eq!(w.told(2, ctx.tid).last(), Some(&"abort"));
    assert_eq!(w.node(2).core.side_tables(), 0);
}

#[test]
fn a_client_brought_transaction_is_adopted_or_times_out() {
    let mut w = World::new(&[1, 2]);
    let ctx = w.begin(1);
    let now = w.now;
    let mut out = Vec::new();
    let r = w
        .node(2)
        .core
        .call_in(now, &ctx, n(9), false, Some(kv()), CallId(5), &mut out)
        .expect("asked");
    assert_eq!(r, CallIn::Enlisting);
    w.run(n(2), out);
    w.settle();
    assert_eq!(w.node(2).admitted.get(&5), Some(&Ok(())));
    w.step(2, Event::CallDone { tid: ctx.tid });
    let waiter = w.commit(1, ctx.tid);
    w.settle();
    assert_eq!(w.result(1, waiter), Some(Ok(())));
    assert_eq!(w.told(2, ctx.tid), vec!["commit"]);

    // The coordinator never answers.
    let ctx = w.begin(1);
    w.drop_next
        .push(Box::new(|_, _, m| matches!(m, TxMsg::Enlist { .. })));
    let now = w.now;
    let mut out = Vec::new();
    w.node(2)
        .core
        .call_in(now, &ctx, n(9), false, None, CallId(6), &mut out)
        .expect("asked");
    w.run(n(2), out);
    w.settle();
    w.advance(NodeConfig::default().enlist_timeout);
    let err = w
        .node(2)
        .admitted
        .get(&6)
        .cloned()
        .expect("answered")
        .unwrap_err();
    assert_eq!(err.status, Status::TimedOut);
    assert_eq!(w.node(2).core.side_tables(), 0);
}

#[test]
fn a_participant_stopped_once_prepared_recovers_in_doubt_and_learns_abort() {
    let mut w = World::new(&[1, 2]);
    w.node(2).crash_at = Some(CrashPoint::ParticipantPrepared);
    let ctx = w.begin(1);
    w.call(&ctx, 1, 2, kv());
    w.commit(1, ctx.tid);
    w.settle();
    assert_eq!(
        w.node(2).reached,
        vec![
            (CrashPoint::ParticipantBeforePrepareForce, ctx.tid),
            (CrashPoint::ParticipantPrepared, ctx.tid)
        ]
    );
    // The prepare record is durable: recovery finds the branch in doubt,
    // and it learns abort (the coordinator never got the vote and aborts
    // at its deadline; presumed abort answers the inquiry).
    let report = w.crash_and_restart(2);
    assert_eq!(report.in_doubt, vec![ctx.tid]);
    w.advance(Duration::from_secs(61));
    w.advance(Duration::from_secs(1));
    assert_eq!(w.told(2, ctx.tid), vec!["abort"], "{}", w.dump());
}

#[test]
fn every_crash_point_is_reached_by_a_two_node_commit() {
    let mut w = World::new(&[1, 2]);
    let ctx = w.begin(1);
    w.local_call(&ctx, 1, 1, kv());
    w.call(&ctx, 1, 2, kv());
    w.commit(1, ctx.tid);
    w.settle();
    let mut reached: Vec<CrashPoint> = w
        .nodes
        .values()
        .flat_map(|nd| nd.reached.iter().map(|(p, _)| *p))
        .collect();
    reached.sort();
    reached.dedup();
    assert_eq!(reached, CrashPoint::ALL.to_vec());
    for p in CrashPoint::ALL {
        assert_eq!(p.name().parse::<CrashPoint>(), Ok(p));
    }
}

#[test]
fn beyond_the_live_limit_a_transaction_is_born_aborted_with_no_buffer() {
    let mut w = World::new(&[]);
    let cfg = NodeConfig {
        max_live: 2,
        ..NodeConfig::default()
    };
    w.start(n(1), Incarnation(1), cfg);
    let now = w.now;
    let a = w.node(1).core.begin(now, None).expect("first");
    let _b = w.node(1).core.begin(now, None).expect("second");
    let refused = w.node(1).core.begin(now, None).unwrap_err();
    assert_eq!(refused.failure.status, Status::NoBuffer);
    let waiter = w.commit(1, refused.tid);
    assert_eq!(
        w.result(1, waiter).expect("answered").unwrap_err().status,
        Status::NoBuffer
    );
    // A call that would join one more is refused too.
    let ctx = TxContext {
        tid: Tid::new(n(2), Incarnation(1), 1),
        path: SubPath::top(),
        budget_us: None,
        baggage: Baggage::default(),
    };
    let err = w
        .node(1)
        .core
        .call_in(now, &ctx, n(2), true, None, CallId(0), &mut Vec::new())
        .unwrap_err();
    assert_eq!(err.status, Status::NoBuffer);
    // Once one ends, there is room again.
    let waiter = w.commit(1, a);
    assert_eq!(w.result(1, waiter), Some(Ok(())));
    w.node(1).core.begin(now, None).expect("room again");
    assert_eq!(w.node(1).core.bookkeeping().refused_live_limit, 2);
}

/// Issue 23 item 4: a million transactions leave a bounded table.
#[test]
fn a_million_transactions_leave_bounded_bookkeeping() {
    let epoch = Instant::now();
    let cfg = NodeConfig {
        tombstones: 1_000,
        tombstone_retention: Duration::from_millis(100),
        ..NodeConfig::default()
    };
    let mut core: TmCore<Res> = TmCore::new(n(1), Incarnation(1), cfg, epoch);
    let mut out = Vec::new();
    let mut now = epoch;
    let mut peak = 0;
    for i in 0..1_000_000u64 {
        now += Duration::from_micros(10);
        let tid = core
            .begin(now, Some(Duration::from_millis(1)))
            .expect("begun");
        if i % 3 == 0 {
            core.abort(tid, "test", &mut out).expect("live");
        } else {
            let _ = core.commit(now, tid, WaiterId(i), &mut out);
        }
        out.clear();
        if i % 1000 == 0 {
            core.step_into(now, Event::Tick, &mut out);
            out.clear();
        }
        peak = peak.max(core.tombstone_count());
        assert_eq!(core.live(), 0);
    }
    assert!(peak <= 1_000, "tombstones peaked at {peak}");
    assert_eq!(core.side_tables(), 0);
    assert_eq!(core.stats().begun, 1_000_000);
    // Retention reclaims the rest once time passes.
    core.step_into(now + Duration::from_secs(1), Event::Tick, &mut out);
    assert_eq!(core.tombstone_count(), 0);
}

#[test]
fn a_participants_held_barrier_holds_the_decision_until_it_allows_the_vote() {
    let mut w = World::new(&[1, 2]);
    w.node(2).hold_barriers = true;
    let ctx = w.begin(1);
    w.call(&ctx, 1, 2, kv());
    let waiter = w.commit(1, ctx.tid);
    w.settle();
    // Prepared and forced at node 2, the vote waits for the barrier.
    assert!(matches!(
        w.node(2).log[..],
        [(_, TmRecord::Prepared { .. })]
    ));
    assert_eq!(w.node(1).core.phase(ctx.tid), Some(&Phase::Preparing));
    assert!(w.result(1, waiter).is_none());
    w.release(2, ctx.tid, Ok(()));
    assert_eq!(w.result(1, waiter), Some(Ok(())), "{}", w.dump());
}

#[test]
fn a_refused_barrier_aborts_the_prepared_participant_and_the_transaction() {
    let mut w = World::new(&[1, 2]);
    w.node(2).hold_barriers = true;
    let ctx = w.begin(1);
    w.call(&ctx, 1, 2, kv());
    let waiter = w.commit(1, ctx.tid);
    w.settle();
    w.release(2, ctx.tid, Err("a writer it used aborted".into()));
    let err = w.result(1, waiter).expect("answered").unwrap_err();
    assert_eq!(err.status, Status::Aborted);
    assert!(err.detail.contains("a writer it used aborted"), "{err}");
    assert_eq!(w.told(2, ctx.tid), vec!["abort"]);
    // A read-only vote refused by its barrier becomes No.
    let ctx = w.begin(1);
    w.call(&ctx, 1, 2, kv());
    w.node(2).votes.insert(ctx.tid, Vote::ReadOnly);
    let waiter = w.commit(1, ctx.tid);
    w.settle();
    w.release(2, ctx.tid, Err("it read a value never committed".into()));
    let err = w.result(1, waiter).expect("answered").unwrap_err();
    assert!(err.detail.contains("never committed"), "{err}");
}

#[test]
fn the_coordinators_own_barrier_comes_before_its_commit_record() {
    let mut w = World::new(&[1]);
    w.node(1).hold_barriers = true;
    let ctx = w.begin(1);
    w.local_call(&ctx, 1, 1, kv());
    let waiter = w.commit(1, ctx.tid);
    w.settle();
    assert!(
        w.node(1).log.is_empty(),
        "nothing logged before the barrier"
    );
    assert!(w.result(1, waiter).is_none());
    w.release(1, ctx.tid, Ok(()));
    assert_eq!(w.result(1, waiter), Some(Ok(())));
    assert!(matches!(w.node(1).log[0].1, TmRecord::Committed { .. }));
}

#[test]
fn a_repeated_vote_still_names_what_it_waits_for() {
    let mut w = World::new(&[1, 2]);
    let a = w.begin(1);
    w.local_call(&a, 1, 1, kv());
    let b = w.begin(1);
    w.call(&b, 1, 2, kv());
    w.node(2).deps.insert(b.tid, vec![a.tid]);
    // The first vote is lost.
    w.drop_next.push(Box::new({
        let mut once = true;
        move |_, _, m| {
            let hit = once && matches!(m, TxMsg::VoteAfter { .. });
            once &= !hit;
            hit
        }
    }));
    w.node(1).hold_barriers = true; // A stays undecided
    let wa = w.commit(1, a.tid);
    let wb = w.commit(1, b.tid);
    w.settle();
    w.advance(Duration::from_millis(1));
    w.advance(CoreConfig::default().retry);
    let votes_after = w
        .history
        .iter()
        .filter(|h| h.starts_with("2 -> 1: VoteAfter"))
        .count();
    assert_eq!(
        votes_after,
        2,
        "the repeated vote names A too\n{}",
        w.dump()
    );
    assert!(w.result(1, wb).is_none(), "B waits for A");
    w.release(1, a.tid, Ok(()));
    assert_eq!(w.result(1, wa), Some(Ok(())));
    assert_eq!(w.result(1, wb), Some(Ok(())), "{}", w.dump());
}

#[test]
fn a_prepare_overlapping_the_abort_is_undone_when_it_returns() {
    let mut w = World::new(&[1]);
    w.node(1).hold_prepares = true;
    let ctx = w.begin(1);
    w.local_call(&ctx, 1, 1, kv());
    let waiter = w.commit(1, ctx.tid);
    assert_eq!(w.node(1).held_prepares, vec![ctx.tid]);
    let mut out = Vec::new();
    w.node(1)
        .core
        .abort(ctx.tid, "test", &mut out)
        .expect("live");
    w.run(n(1), out);
    assert_eq!(
        w.result(1, waiter).expect("answered").unwrap_err().status,
        Status::Aborted
    );
    assert!(!w.node(1).core.is_live(ctx.tid));
    assert_eq!(w.node(1).core.side_tables(), 1, "the prepare is still out");
    // The resource's prepare returns after the abort: it hears it again.
    w.step(
        1,
        Event::ResourceVoted {
            tid: ctx.tid,
            vote: Vote::Yes { durable: true },
        },
    );
    assert_eq!(w.told(1, ctx.tid), vec!["abort", "abort"]);
    assert_eq!(w.node(1).core.side_tables(), 0);
    assert!(w.node(1).log.is_empty());
}

#[test]
fn an_aborted_sub_transaction_travels_with_prepare_and_its_resources_hear_it() {
    let mut w = World::new(&[1, 2]);
    let ctx = w.begin(1);
    let sub = w.node(1).core.sub_begin(&ctx).expect("active");
    assert_eq!(sub.path, SubPath::top().child(1));
    w.call(&sub, 1, 2, kv());
    let mut out = Vec::new();
    w.node(1)
        .core
        .sub_end(ctx.tid, &sub.path, false, None, &mut out)
        .expect("active");
    assert!(out.iter().any(|a| matches!(
        a,
        Action::Send {
            msg: TxMsg::SubEnded {
                committed: false,
                ..
            },
            ..
        }
    )));
    w.run(n(1), out);
    w.settle();
    assert_eq!(w.told(2, ctx.tid), vec!["sub-ended"]);
    let waiter = w.commit(1, ctx.tid);
    w.settle();
    assert_eq!(w.result(1, waiter), Some(Ok(())));
    assert!(
        w.history
            .iter()
            .any(|h| h.contains("Prepare") && h.contains("aborted_subs: [/1]")),
        "{}",
        w.dump()
    );
    let err = w
        .node(1)
        .core
        .sub_end(ctx.tid, &SubPath::top(), true, None, &mut Vec::new())
        .unwrap_err();
    assert_eq!(err.status, Status::BadRequest);
}

#[test]
fn next_wake_says_when_a_tick_has_work() {
    let mut w = World::new(&[1, 2]);
    assert_eq!(w.node(1).core.next_wake(), None, "an idle node sleeps");
    let ctx = w.begin(1);
    w.call(&ctx, 1, 2, kv());
    let now = w.now;
    // The participant's orphan check is not armed yet: the next tick arms it.
    assert_eq!(w.node(2).core.next_wake(), Some(now));
    w.advance(Duration::ZERO);
    let wake = w.node(2).core.next_wake().expect("armed");
    assert_eq!(wake, now + CoreConfig::default().orphan_check);
    // Ticking before it sends nothing; at it, the branch inquires.
    w.now = wake - Duration::from_millis(1);
    w.step(2, Event::Tick);
    assert!(w.net.is_empty());
    w.now = wake;
    w.step(2, Event::Tick);
    assert!(matches!(w.net.front(), Some((_, _, TxMsg::Inquire { .. }))));
    // The coordinator's next wake is its deadline.
    assert_eq!(w.node(1).core.next_wake(), w.node(1).core.deadline(ctx.tid));
}
