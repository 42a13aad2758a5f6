//! A deterministic simulation of several nodes' cores connected by a
//! network that reorders and drops messages, driven by a seeded random
//! scheduler. Property tests run whole group communications through it,
//! killing members and nodes at random moments, and check that every
//! communication ends (no sender or member waits forever), that counts and
//! replies agree, and that limits hold. Links can also be cut one at a
//! time: each end then declares the other dead on its own (a local verdict,
//! as the transport's failure detector does) while both stay alive for
//! everyone else. A failure prints the seed and the event history.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::{Duration, Instant};

use proptest::prelude::*;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use weft_wire::{Failure, GroupId, Incarnation, NodeId, Payload, Status, Tid};

use super::fanout::Tree;
use super::origin::{Progress, ReplyItem, Take};
use super::{Action, Core, Env, NodeLoss};
use crate::config::GroupConfig;
use crate::ids::{CommId, Tag};
use crate::msg::{DirAnswer, DirOp, GroupMsg};
use crate::secret::Verifier;

struct Sim {
    seed: u64,
    rng: ChaCha8Rng,
    now: Instant,
    cores: BTreeMap<NodeId, Core>,
    alive: BTreeSet<NodeId>,
    /// Cut links, as (lower, higher) node pairs: their messages are lost.
    cut: BTreeSet<(NodeId, NodeId)>,
    /// Local verdicts: (observer, peer) when the observer declared the
    /// peer dead.
    verdicts: BTreeSet<(NodeId, NodeId)>,
    net: Vec<(NodeId, NodeId, GroupMsg)>,
    done: HashMap<u64, Result<DirAnswer, Failure>>,
    next_op: u64,
    drop: f64,
    trees: HashMap<(Tid, NodeId), Tree>,
    history: Vec<String>,
}

impl Sim {
    fn new(seed: u64, nodes: u32, drop: f64) -> Sim {
        let cfg = GroupConfig {
            member_queue: 4,
            retransmit: Duration::from_millis(30),
            max_retransmit: Duration::from_millis(120),
            count_timeout: Duration::from_millis(900),
            reply_timeout: Duration::from_millis(900),
            directory_timeout: Duration::from_millis(1500),
            push_timeout: Duration::from_millis(500),
            probe_after: Duration::from_millis(300),
            ..GroupConfig::default()
        };
        let mut cores = BTreeMap::new();
        for n in 1..=nodes {
            cores.insert(NodeId(n), Core::new(NodeId(n), Incarnation(1), cfg.clone()));
        }
        Sim {
            seed,
            rng: ChaCha8Rng::seed_from_u64(seed),
            now: Instant::now(),
            alive: cores.keys().copied().collect(),
            cores,
            cut: BTreeSet::new(),
            verdicts: BTreeSet::new(),
            net: Vec::new(),
            done: HashMap::new(),
            next_op: 1,
            drop,
            trees: HashMap::new(),
            history: Vec::new(),
        }
    }

    fn report(&self) -> String {
        let tail: Vec<&String> = self.history.iter().rev().take(80).collect();
        let mut s = format!("sim seed = {}\n", self.seed);
        for l in tail.into_iter().rev() {
            s.push_str(l);
            s.push('\n');
        }
        s
    }

    fn env(&self, me: NodeId) -> Env {
        Env {
            directory: self.alive.contains(&NodeId(1)).then_some(NodeId(1)),
            peers: self
                .alive
                .iter()
                .copied()
                .filter(|n| *n != me && !self.verdicts.contains(&(me, *n)))
                .collect(),
        }
    }

    fn op(&mut self) -> u64 {
        self.next_op += 1;
        self.next_op
    }

    fn run(&mut self, node: NodeId, f: impl FnOnce(&mut Core, &Env, Instant, &mut Vec<Action>)) {
        if !self.alive.contains(&node) {
            return;
        }
        let env = self.env(node);
        let now = self.now;
        let mut out = Vec::new();
        let core = self.cores.get_mut(&node).expect("node exists");
        f(core, &env, now, &mut out);
        self.act(node, out);
    }

    fn act(&mut self, node: NodeId, out: Vec<Action>) {
        for a in out {
            match a {
                Action::Send { to, msg, key } => {
                    // The transport refuses at once a send to a node this
                    // node declared dead.
                    if self.alive.contains(&to) && !self.verdicts.contains(&(node, to)) {
                        self.net.push((node, to, msg));
                    } else if let Some(key) = key {
                        self.run(node, |c, env, now, out| {
                            c.on_send_failed(key, to, Status::HostDead, env, now, out)
                        });
                    }
                }
                Action::Complete { op, result } => {
                    self.history
                        .push(format!("n{} op {op} -> {result:?}", node.0));
                    self.done.insert(op, result);
                }
                Action::WakeSender(_) | Action::WakeMember(_) => {}
            }
        }
    }

    /// Delivers one random message in flight (or drops it).
    fn step(&mut self) -> bool {
        if self.net.is_empty() {
            return false;
        }
        let i = self.rng.gen_range(0..self.net.len());
        let (from, to, msg) = self.net.swap_remove(i);
        if !self.alive.contains(&to) || !self.alive.contains(&from) {
            return true;
        }
        if self.cut.contains(&pair(from, to)) {
            self.history
                .push(format!("cut n{}->n{} {}", from.0, to.0, msg.kind()));
            return true;
        }
        if self.rng.gen_bool(self.drop) {
            self.history
                .push(format!("drop n{}->n{} {}", from.0, to.0, msg.kind()));
            return true;
        }
        self.history
            .push(format!("n{}->n{} {:?}", from.0, to.0, msg_summary(&msg)));
        let tree = match &msg {
            GroupMsg::TxDeliver { tid, .. } => self.trees.get(&(*tid, to)).cloned(),
            _ => None,
        };
        self.run(to, |c, env, now, out| {
            c.on_message(from, msg, tree.as_ref(), env, now, out)
        });
        true
    }

    fn tick(&mut self, by: Duration) {
        self.now += by;
        for n in self.alive.clone() {
            self.run(n, |c, env, now, out| c.tick(env, now, out));
        }
    }

    /// Runs until nothing is in flight and time passed `quiet`.
    fn settle(&mut self, quiet: Duration) {
        let until = self.now + quiet;
        let mut guard = 0;
        while self.now < until || !self.net.is_empty() {
            for _ in 0..self.rng.gen_range(1..8) {
                if !self.step() {
                    break;
                }
            }
            self.tick(Duration::from_millis(10));
            guard += 1;
            assert!(
                guard < 100_000,
                "simulation does not settle\n{}",
                self.report()
            );
        }
    }

    fn wait_op(&mut self, op: u64) -> Result<DirAnswer, Failure> {
        for _ in 0..10_000 {
            if let Some(r) = self.done.remove(&op) {
                return r;
            }
            if !self.step() {
                self.tick(Duration::from_millis(10));
            }
        }
        panic!("operation {op} never completed\n{}", self.report());
    }

    fn kill(&mut self, node: NodeId) {
        self.history.push(format!("kill n{}", node.0));
        self.alive.remove(&node);
        for n in self.alive.clone() {
            self.run(n, |c, env, now, out| {
                c.on_node_dead(node, NodeLoss::Unreachable(Status::HostDead), env, now, out)
            });
        }
    }

    /// Cuts the link between `a` and `b`: messages on it are lost, and each
    /// declares the other dead (HostDead) on its own. Every other node
    /// still reaches both.
    fn cut_link(&mut self, a: NodeId, b: NodeId) {
        self.history.push(format!("cut n{} n{}", a.0, b.0));
        self.cut.insert(pair(a, b));
        for (me, peer) in [(a, b), (b, a)] {
            self.verdicts.insert((me, peer));
            self.run(me, |c, env, now, out| {
                c.on_node_dead(peer, NodeLoss::Unreachable(Status::HostDead), env, now, out)
            });
        }
    }

    /// Heals the link between `a` and `b`: each hears from the other again.
    fn heal_link(&mut self, a: NodeId, b: NodeId) {
        self.history.push(format!("heal n{} n{}", a.0, b.0));
        self.cut.remove(&pair(a, b));
        for (me, peer) in [(a, b), (b, a)] {
            self.verdicts.remove(&(me, peer));
            self.run(me, |c, env, now, out| c.on_node_back(peer, env, now, out));
        }
    }

    /// Every other node learns that `node` was lost (`loss`).
    fn tell(&mut self, node: NodeId, loss: NodeLoss) {
        self.history.push(format!("tell n{} {loss:?}", node.0));
        for n in self.alive.clone() {
            if n != node {
                self.run(n, |c, env, now, out| {
                    c.on_node_dead(node, loss, env, now, out)
                });
            }
        }
    }

    /// Node `node` restarts as incarnation `inc`: its state and the
    /// messages in flight to and from it are gone. Nobody is told yet.
    fn restart(&mut self, node: NodeId, inc: Incarnation) {
        self.history.push(format!("restart n{} as {inc}", node.0));
        let cfg = self.cores[&node].config().clone();
        self.cores.insert(node, Core::new(node, inc, cfg));
        self.net.retain(|(f, t, _)| *f != node && *t != node);
    }
}

fn pair(a: NodeId, b: NodeId) -> (NodeId, NodeId) {
    (a.min(b), a.max(b))
}

fn msg_summary(m: &GroupMsg) -> String {
    match m {
        GroupMsg::Deliver { comm, .. } => format!("Deliver {comm}"),
        GroupMsg::Ack { comm, counts, .. } => format!("Ack {comm} {counts:?}"),
        GroupMsg::Reply { comm, member, .. } => format!("Reply {comm} {member}"),
        GroupMsg::ReplyAck { reply, status } => format!("ReplyAck {reply} {status}"),
        GroupMsg::Lost {
            comm,
            members,
            status,
            ..
        } => format!("Lost {comm} {members:?} {status}"),
        GroupMsg::Terminate { comms } => format!("Terminate {comms:?}"),
        GroupMsg::TxDeliver { comm, .. } => format!("TxDeliver {comm}"),
        GroupMsg::TxAck {
            comm, delivered, ..
        } => format!("TxAck {comm} {delivered:?}"),
        other => other.kind().to_string(),
    }
}

fn group() -> GroupId {
    "sim:g".parse().unwrap()
}

/// Creates the group from node 2 and joins `members` members spread over
/// the nodes. Returns (node, member id) pairs.
fn populate(sim: &mut Sim, members: usize) -> Vec<(NodeId, u64)> {
    let v = create(sim);
    let nodes: Vec<NodeId> = sim.cores.keys().copied().collect();
    let mut joined = Vec::new();
    for _ in 0..members {
        let node = nodes[sim.rng.gen_range(0..nodes.len())];
        // Nodes (re)introduce themselves to the directory at random
        // moments, racing with joins (a stale introduction must not undo a
        // newer join).
        if sim.rng.gen_bool(0.3) {
            let n = nodes[sim.rng.gen_range(0..nodes.len())];
            sim.run(n, |c, env, now, out| c.sync(env, now, out));
        }
        joined.push((node, join_at(sim, node, v)));
    }
    joined
}

/// Creates the group from node 2; returns its secret's verifier.
fn create(sim: &mut Sim) -> Verifier {
    let v = Verifier::new(b"pw");
    let op = sim.op();
    sim.run(NodeId(2), |c, env, now, out| {
        c.directory_op(
            op,
            DirOp::Create {
                gid: group(),
                verifier: v,
            },
            env,
            now,
            out,
        )
    });
    if let Err(f) = sim.wait_op(op) {
        panic!("create failed: {f}\n{}", sim.report());
    }
    v
}

/// A new member at `node` joins the group; returns its id.
fn join_at(sim: &mut Sim, node: NodeId, v: Verifier) -> u64 {
    let id = sim.cores.get_mut(&node).unwrap().new_member().unwrap();
    let op = sim.op();
    let key = v.key_for(b"pw");
    let mut now_done = false;
    sim.run(node, |c, env, now, out| {
        now_done = c
            .join(op, id, &group(), key, env, now, out)
            .expect("join starts");
    });
    if !now_done {
        sim.wait_op(op)
            .unwrap_or_else(|f| panic!("join at n{} failed: {f}\n{}", node.0, sim.report()));
    }
    id
}

/// The group's hosts in `node`'s cached table.
fn hosts_at(sim: &Sim, node: NodeId) -> Vec<NodeId> {
    sim.cores[&node]
        .record(&group())
        .map(|r| r.hosts.clone())
        .unwrap_or_default()
}

fn send(sim: &mut Sim, from: NodeId, sender: u64) -> CommId {
    let hosts = sim.cores[&from]
        .record(&group())
        .map(|r| r.hosts.clone())
        .unwrap_or_default();
    let mut comm = None;
    sim.run(from, |c, _env, now, out| {
        comm = Some(
            c.send(
                sender,
                &group(),
                Tag(0),
                Payload::bytes(vec![7]),
                &hosts,
                now,
                out,
            )
            .expect("send starts"),
        );
    });
    comm.expect("sender alive")
}

fn counted(sim: &mut Sim, from: NodeId, comm: &CommId) -> u32 {
    for _ in 0..10_000 {
        match sim.cores[&from].progress(comm) {
            Progress::Counted(d) => return d.delivered,
            Progress::Gone => panic!("communication gone\n{}", sim.report()),
            Progress::Counting => {
                if !sim.step() {
                    sim.tick(Duration::from_millis(10));
                }
            }
        }
    }
    panic!("never counted\n{}", sim.report());
}

/// Members receive and reply, in random order.
fn members_answer(sim: &mut Sim, members: &[(NodeId, u64)], skip: &BTreeSet<(NodeId, u64)>) {
    let mut order: Vec<(NodeId, u64)> = members.to_vec();
    for i in (1..order.len()).rev() {
        let j = sim.rng.gen_range(0..=i);
        order.swap(i, j);
    }
    for (node, m) in order {
        if skip.contains(&(node, m)) || !sim.alive.contains(&node) {
            continue;
        }
        let got = sim
            .cores
            .get_mut(&node)
            .unwrap()
            .receive(m, Some(&group()), None);
        if let Ok(Some(r)) = got {
            let op = sim.op();
            sim.run(node, |c, _env, now, out| {
                let _ = c.reply(op, m, &r.comm, Payload::bytes(vec![m as u8]), now, out);
            });
        }
        for _ in 0..sim.rng.gen_range(0..4) {
            sim.step();
        }
    }
}

/// Takes every reply until NoComm; panics if the stream never ends.
fn drain(sim: &mut Sim, from: NodeId, sender: u64) -> (Vec<ReplyItem>, String) {
    let mut items = Vec::new();
    for _ in 0..20_000 {
        if !sim.alive.contains(&from) {
            return (items, "sender's node dead".into());
        }
        match sim
            .cores
            .get_mut(&from)
            .unwrap()
            .take_reply(sender, &group())
        {
            Take::Item(i) => items.push(i),
            Take::NoComm(why) => return (items, why),
            Take::Pending => {
                if !sim.step() {
                    sim.tick(Duration::from_millis(10));
                }
            }
        }
    }
    panic!("the sender waits forever\n{}", sim.report());
}

fn check_communication(seed: u64, drop: f64, kill_member_node: bool, lower_to: Option<u32>) {
    let mut sim = Sim::new(seed, 4, drop);
    let members = populate(&mut sim, 1 + (seed % 7) as usize);
    sim.settle(Duration::from_millis(50));
    let from = NodeId(1 + (seed % 4) as u32);
    let sender = 1;
    let comm = send(&mut sim, from, sender);
    let count = counted(&mut sim, from, &comm);
    if drop == 0.0 {
        assert_eq!(
            count as usize,
            members.len(),
            "everyone reached\n{}",
            sim.report()
        );
    }
    if let Some(n) = lower_to {
        sim.run(from, |c, _env, _now, out| {
            let _ = c.set_replies(sender, &group(), n, out);
        });
    }
    let mut skip = BTreeSet::new();
    if kill_member_node {
        // A member node other than the sender's and the directory dies
        // mid-communication; another member's handle is dropped.
        if let Some((victim, _)) = members
            .iter()
            .find(|(n, _)| *n != from && *n != NodeId(1))
            .copied()
        {
            sim.kill(victim);
        }
        if let Some((node, m)) = members.iter().find(|(n, _)| sim.alive.contains(n)).copied() {
            skip.insert((node, m));
            sim.run(node, |c, env, now, out| c.drop_member(m, env, now, out));
        }
    }
    members_answer(&mut sim, &members, &skip);
    let (items, why) = drain(&mut sim, from, sender);
    let wanted = lower_to.map_or(count, |n| n.min(count));
    assert!(
        items.len() as u32 <= wanted,
        "at most the wanted replies: count {count}, lowered to {lower_to:?}, got {items:?}\n{}",
        sim.report()
    );
    let mut seen = BTreeSet::new();
    for i in &items {
        if let ReplyItem::Reply { from, .. } = i {
            assert!(seen.insert(*from), "{from} replied twice\n{}", sim.report());
        }
    }
    if drop == 0.0 {
        assert_eq!(
            items.len() as u32,
            wanted,
            "every wanted answer came ({why})\n{}",
            sim.report()
        );
    }
    // Members that learn late end with NoComm, never hang: a late reply
    // to the terminated communication fails.
    sim.settle(Duration::from_secs(2));
    assert!(
        sim.cores
            .values()
            .all(|c| c.outstanding() == 0 || drop > 0.0),
        "nothing left to retransmit\n{}",
        sim.report()
    );
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, .. ProptestConfig::default() })]

    #[test]
    fn communications_end_without_faults(seed in any::<u64>()) {
        check_communication(seed, 0.0, false, None);
    }

    #[test]
    fn communications_end_when_members_and_nodes_die(seed in any::<u64>()) {
        check_communication(seed, 0.0, true, None);
    }

    #[test]
    fn communications_end_on_a_lossy_network(seed in any::<u64>(), lower in proptest::option::of(0u32..4)) {
        check_communication(seed, 0.15, seed % 2 == 0, lower);
    }
}

#[test]
fn supersession_makes_old_replies_fail_with_nocomm() {
    let mut sim = Sim::new(7, 3, 0.0);
    let members = populate(&mut sim, 2);
    let (node, m) = members[0];
    let first = send(&mut sim, NodeId(3), 1);
    counted(&mut sim, NodeId(3), &first);
    let r1 = sim
        .cores
        .get_mut(&node)
        .unwrap()
        .receive(m, None, None)
        .unwrap()
        .unwrap();
    let second = send(&mut sim, NodeId(3), 1);
    assert!(second.session > first.session);
    counted(&mut sim, NodeId(3), &second);
    let op = sim.op();
    let mut started = Ok(());
    sim.run(node, |c, _env, now, out| {
        started = c.reply(op, m, &r1.comm, Payload::bytes(vec![1]), now, out);
    });
    let result = match started {
        Err(f) => Err(f),
        Ok(()) => sim.wait_op(op),
    };
    assert_eq!(
        result.unwrap_err().status,
        Status::NoComm,
        "{}",
        sim.report()
    );
}

#[test]
fn transaction_multicast_reaches_every_participant_once() {
    let mut sim = Sim::new(11, 5, 0.0);
    let tid = Tid::new(NodeId(1), Incarnation(1), 42);
    // 1 called 2 and 3; 2 called 4; 3 also called 4 (a cycle); 5 is not in it.
    let t = |p: Option<u32>, c: &[u32]| Tree {
        parent: p.map(NodeId),
        children: c.iter().map(|n| NodeId(*n)).collect(),
    };
    sim.trees.insert((tid, NodeId(1)), t(None, &[2, 3]));
    sim.trees.insert((tid, NodeId(2)), t(Some(1), &[4]));
    sim.trees.insert((tid, NodeId(3)), t(Some(1), &[4]));
    sim.trees.insert((tid, NodeId(4)), t(Some(2), &[]));
    // Node 5 sends without taking part: the fan-out starts at the coordinator.
    let mut comm = None;
    sim.run(NodeId(5), |c, _env, now, out| {
        comm = Some(
            c.send_tx(1, tid, Tag(0), Payload::bytes(vec![1]), None, now, out)
                .unwrap(),
        );
    });
    let comm = comm.unwrap();
    let count = counted(&mut sim, NodeId(5), &comm);
    assert_eq!(count, 4, "{}", sim.report());
    for n in 1..=4 {
        let got = sim
            .cores
            .get_mut(&NodeId(n))
            .unwrap()
            .receive(0, Some(&GroupId::Tx(tid)), None);
        assert!(got.unwrap().is_some(), "node {n} got it\n{}", sim.report());
        assert!(
            sim.cores
                .get_mut(&NodeId(n))
                .unwrap()
                .receive(0, None, None)
                .unwrap()
                .is_none(),
            "once"
        );
    }
    assert!(sim
        .cores
        .get_mut(&NodeId(5))
        .unwrap()
        .receive(0, None, None)
        .unwrap()
        .is_none());
}

/// Issue 16 at the group layer: only the directory's link to `victim` is
/// cut. The directory declares it dead on its own; every other node still
/// reaches it. Its members must stay members: nodes that reach it count
/// them, and the directory's senders get HostDead for them alone.
fn check_directory_cut(seed: u64) {
    let mut sim = Sim::new(seed, 4, 0.0);
    let members = populate(&mut sim, 2 + (seed % 6) as usize);
    sim.settle(Duration::from_millis(50));
    let hosts: Vec<NodeId> = members
        .iter()
        .map(|(n, _)| *n)
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    let victim = NodeId(2 + (seed % 3) as u32);
    let victims = members.iter().filter(|(n, _)| *n == victim).count() as u32;
    sim.cut_link(NodeId(1), victim);
    // Past every push and directory timeout.
    sim.settle(Duration::from_secs(2));
    for n in 1..=4 {
        assert_eq!(
            hosts_at(&sim, NodeId(n)),
            hosts,
            "n{n}'s table after the directory lost its link to n{}\n{}",
            victim.0,
            sim.report()
        );
    }
    // A node reaching everyone counts every member, the victim's included.
    let from = [NodeId(2), NodeId(3), NodeId(4)]
        .into_iter()
        .filter(|n| *n != victim)
        .nth((seed % 2) as usize)
        .expect("two other nodes");
    let comm = send(&mut sim, from, 1);
    assert_eq!(
        counted(&mut sim, from, &comm) as usize,
        members.len(),
        "n{} counts every member\n{}",
        from.0,
        sim.report()
    );
    // The directory's own sender cannot reach the victim: HostDead for its
    // members, reported to the sender only.
    let comm = send(&mut sim, NodeId(1), 1);
    let count = counted(&mut sim, NodeId(1), &comm);
    assert_eq!(count as usize, members.len() - victims as usize);
    let d = sim.cores[&NodeId(1)]
        .delivery(1, &group())
        .expect("a delivery report");
    assert_eq!(
        d.lost.contains(&(victim, Status::HostDead)),
        victims > 0,
        "{d:?}\n{}",
        sim.report()
    );
    // Healed: the directory reaches the victim's members again.
    sim.heal_link(NodeId(1), victim);
    sim.settle(Duration::from_millis(500));
    let comm = send(&mut sim, NodeId(1), 2);
    assert_eq!(
        counted(&mut sim, NodeId(1), &comm) as usize,
        members.len(),
        "{}",
        sim.report()
    );
    assert_eq!(hosts_at(&sim, NodeId(2)), hosts, "{}", sim.report());
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 32, .. ProptestConfig::default() })]

    #[test]
    fn a_node_cut_from_the_directory_alone_keeps_its_members(seed in any::<u64>()) {
        check_directory_cut(seed);
    }
}

#[test]
fn a_node_that_left_loses_its_members_everywhere() {
    let mut sim = Sim::new(21, 3, 0.0);
    let v = create(&mut sim);
    join_at(&mut sim, NodeId(2), v);
    join_at(&mut sim, NodeId(3), v);
    assert_eq!(hosts_at(&sim, NodeId(2)), vec![NodeId(2), NodeId(3)]);
    sim.alive.remove(&NodeId(3));
    sim.tell(NodeId(3), NodeLoss::Left(Some(Incarnation(1))));
    sim.settle(Duration::from_millis(200));
    for n in [1, 2] {
        assert_eq!(
            hosts_at(&sim, NodeId(n)),
            vec![NodeId(2)],
            "{}",
            sim.report()
        );
    }
}

#[test]
fn a_restart_ends_the_old_members_not_the_new_ones() {
    let mut sim = Sim::new(22, 3, 0.0);
    let v = create(&mut sim);
    join_at(&mut sim, NodeId(2), v);
    join_at(&mut sim, NodeId(3), v);
    join_at(&mut sim, NodeId(3), v);
    // Node 3 restarts and a new member joins before the directory hears
    // that the old incarnation is over (the report of the restart and the
    // new incarnation's messages travel separately).
    sim.restart(NodeId(3), Incarnation(2));
    sim.run(NodeId(3), |c, env, now, out| c.sync(env, now, out));
    sim.settle(Duration::from_millis(50));
    let fresh = join_at(&mut sim, NodeId(3), v);
    sim.tell(NodeId(3), NodeLoss::Restarted(Some(Incarnation(1))));
    sim.settle(Duration::from_millis(200));
    for n in [1, 2, 3] {
        assert_eq!(
            hosts_at(&sim, NodeId(n)),
            vec![NodeId(2), NodeId(3)],
            "n{n}\n{}",
            sim.report()
        );
    }
    let comm = send(&mut sim, NodeId(1), 1);
    assert_eq!(counted(&mut sim, NodeId(1), &comm), 2, "{}", sim.report());
    let got = sim
        .cores
        .get_mut(&NodeId(3))
        .unwrap()
        .receive(fresh, Some(&group()), None);
    assert!(matches!(got, Ok(Some(_))), "{got:?}\n{}", sim.report());
    // Without a new member, the restart drops the node from the group.
    sim.restart(NodeId(3), Incarnation(3));
    sim.tell(NodeId(3), NodeLoss::Restarted(Some(Incarnation(2))));
    sim.settle(Duration::from_millis(200));
    assert_eq!(
        hosts_at(&sim, NodeId(2)),
        vec![NodeId(2)],
        "{}",
        sim.report()
    );
}

#[test]
fn a_restarted_directory_keeps_the_members_of_a_node_it_cannot_reach() {
    let mut sim = Sim::new(23, 3, 0.0);
    let v = create(&mut sim);
    join_at(&mut sim, NodeId(2), v);
    join_at(&mut sim, NodeId(3), v);
    sim.settle(Duration::from_millis(50));
    // The directory restarts, and its new incarnation cannot reach node 3;
    // node 2 reaches both. Node 2 introduces itself with its cached table.
    sim.restart(NodeId(1), Incarnation(2));
    sim.cut_link(NodeId(1), NodeId(3));
    sim.run(NodeId(2), |c, env, now, out| {
        c.on_node_dead(
            NodeId(1),
            NodeLoss::Restarted(Some(Incarnation(1))),
            env,
            now,
            out,
        );
        c.sync(env, now, out);
    });
    sim.settle(Duration::from_millis(500));
    for n in [1, 2] {
        assert_eq!(
            hosts_at(&sim, NodeId(n)),
            vec![NodeId(2), NodeId(3)],
            "n{n}\n{}",
            sim.report()
        );
    }
    let comm = send(&mut sim, NodeId(2), 1);
    assert_eq!(counted(&mut sim, NodeId(2), &comm), 2, "{}", sim.report());
}
