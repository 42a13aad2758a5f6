//! One simulated run: nodes, network, scheduler, workload and fault injection, in one thread
//! under one seed.
//!
//! Each node runs weft's real code: a [`TxCore`] per transaction (the commit protocol), the
//! KV [`Store`] and [`LockTable`] (strict two-phase locking, no-wait), the real [`Log`] over a
//! simulated disk ([`MemDisk`]), the real log recovery and KV snapshot code on restart. The
//! node-level glue around the cores (answers for transactions a node has forgotten,
//! incarnation checks, recovery from TM records) follows `weft_tx::manager` rule for rule;
//! it moves to the transaction manager's sans-IO node core once that exists (issue 17 item 1).
//!
//! Owns: simulated time (microseconds from 0), the event queue, the network model (drop,
//! duplicate, delay/reorder, per-link partitions), crash/restart, the workloads (Jepsen-style
//! bank transfers and read-only total checks across nodes, Raid DebitCredit written to every
//! replica) and coverage counting. Must never: read the real clock or any randomness but the
//! seeded generator (a seed replays exactly), let a force's result race the event loop (every
//! force waits for the log's flusher, so disk contents at a crash depend only on the seed),
//! or let the checkers see anything but committed state and client-visible results.

use std::cmp::Ordering;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap, VecDeque};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use bytes::Bytes;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use weft_kv::lock::{LockMode, LockTable, Wakeups};
use weft_kv::store::{Image, Store};
use weft_kv::{int_value, parse_int, snapshot, KvRecord, KV_RECORD_TAG};
use weft_log::{DiskFault, Log, LogConfig, Lsn, MemDisk};
use weft_raid::rc::{Replicas, PLACEMENT_KEY};
use weft_raid::schema::{balance, tuple, HistoryRow, Item, Relation};
use weft_tx::core::{late, Action, CoreConfig, Durability, Input, Phase, TxCore};
use weft_tx::{Answer, Outcome, TmRecord, TxMsg, Vote, TM_RECORD_TAG};
use weft_wire::{Incarnation, NodeId, Status, Tid, Xid};

use crate::check::{self, Checker, Kind, Op};
use crate::config::{Sabotage, SimConfig};
use crate::report::{Coverage, CrashPoint, FaultKind, SeedReport, Violation};

/// Lines of history kept for a failure report when tracing is off.
const HISTORY_KEPT: usize = 400;
/// A transaction's life bound (its deadline), simulated.
const TX_TIMEOUT: Duration = Duration::from_millis(1500);
/// How long a coordinator waits for its calls' replies.
const CALL_TIMEOUT_MICROS: u64 = 300_000;
/// Timer period of every node.
const TICK_MICROS: u64 = 20_000;
/// A failure detector's delay before peers hear of a crash.
const DETECT_MICROS: u64 = 100_000;
/// Tombstones (finished transactions) remembered per node, as the manager's bound.
const TOMBSTONES: usize = 100_000;

/// A message between nodes.
#[derive(Clone, Debug)]
enum Msg {
    /// The commit protocol.
    Tx(TxMsg),
    /// A call of a transaction: run these operations in its branch here.
    Call { tid: Tid, call: u64, ops: Vec<Op> },
    /// The answer to a call: the values read, and the callee's incarnation.
    Reply {
        tid: Tid,
        call: u64,
        incarnation: Incarnation,
        result: Result<Vec<i64>, String>,
    },
}

#[derive(Debug)]
enum Ev {
    Deliver {
        from: usize,
        to: usize,
        msg: Msg,
    },
    Tick(usize),
    StartTx,
    CallTimeout {
        node: usize,
        inc: Incarnation,
        tid: Tid,
    },
    Forced {
        node: usize,
        inc: Incarnation,
        tid: Tid,
    },
    Crash,
    Restart(usize),
    PeerDead {
        node: usize,
        dead: NodeId,
        before: u64,
    },
    Cut,
    Heal(usize, usize),
    DiskFault,
    Checkpoint(usize),
    EndFaults,
}

struct Sched {
    at: u64,
    seq: u64,
    ev: Ev,
}

impl PartialEq for Sched {
    fn eq(&self, o: &Self) -> bool {
        (self.at, self.seq) == (o.at, o.seq)
    }
}
impl Eq for Sched {}
impl PartialOrd for Sched {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Sched {
    fn cmp(&self, o: &Self) -> Ordering {
        // BinaryHeap is a max-heap: the earliest event must compare greatest.
        (o.at, o.seq).cmp(&(self.at, self.seq))
    }
}

/// A transaction branch at a node: its protocol core and what the driver keeps beside it.
struct Branch {
    core: TxCore,
    /// Simulated time it was created (peer deaths after it do not concern it).
    born: u64,
    /// Its first transaction-manager record (the log must keep it).
    first_lsn: Option<Lsn>,
    /// Calls already executed (a duplicated call message runs once).
    calls: BTreeSet<u64>,
}

/// A client waiting at the coordinator: lost if the coordinator crashes.
struct Client {
    kind: Kind,
    pending: BTreeSet<u64>,
    reads: Vec<i64>,
    decided: bool,
}

struct Node {
    id: NodeId,
    inc: Incarnation,
    up: bool,
    disk: MemDisk,
    log: Option<Log>,
    store: Store,
    locks: LockTable<Bytes, Xid>,
    txs: BTreeMap<Tid, Branch>,
    tombs: BTreeMap<Tid, Option<Outcome>>,
    tomb_order: VecDeque<Tid>,
    lazy: Vec<(Lsn, Tid)>,
    seq: u64,
    clients: BTreeMap<Tid, Client>,
}

impl Node {
    fn log_dir(&self) -> PathBuf {
        PathBuf::from(format!("/n{}/log", self.id.0))
    }

    fn kv_dir(&self) -> PathBuf {
        PathBuf::from(format!("/n{}/kv", self.id.0))
    }

    fn tomb(&mut self, tid: Tid, outcome: Option<Outcome>) {
        if self.tombs.insert(tid, outcome).is_none() {
            self.tomb_order.push_back(tid);
            while self.tomb_order.len() > TOMBSTONES {
                if let Some(old) = self.tomb_order.pop_front() {
                    self.tombs.remove(&old);
                }
            }
        }
    }

    fn reset_volatile(&mut self) {
        self.log = None;
        self.store = Store::new();
        self.locks = LockTable::new();
        self.txs.clear();
        self.tombs.clear();
        self.tomb_order.clear();
        self.lazy.clear();
        self.clients.clear();
        self.seq = 0;
    }
}

/// The whole simulated world of one seed.
pub(crate) struct Sim {
    cfg: SimConfig,
    rng: ChaCha8Rng,
    now: u64,
    base: Instant,
    seq: u64,
    queue: BinaryHeap<Sched>,
    in_flight: u64,
    nodes: Vec<Node>,
    cut: BTreeSet<(usize, usize)>,
    faults_on: bool,
    done: bool,
    next_call: u64,
    core_cfg: CoreConfig,
    check: Checker,
    cov: Coverage,
    history: VecDeque<String>,
}

impl Sim {
    pub(crate) fn new(seed: u64, cfg: SimConfig) -> Sim {
        let n = cfg.nodes as usize;
        let check = Checker::new(&cfg);
        let mut sim = Sim {
            rng: ChaCha8Rng::seed_from_u64(seed),
            now: 0,
            base: Instant::now(),
            seq: 0,
            queue: BinaryHeap::new(),
            in_flight: 0,
            nodes: Vec::with_capacity(n),
            cut: BTreeSet::new(),
            faults_on: true,
            done: false,
            next_call: 1,
            core_cfg: CoreConfig {
                retry: Duration::from_millis(40),
                max_retry: Duration::from_millis(800),
                orphan_check: Duration::from_millis(250),
            },
            check,
            cov: Coverage::default(),
            history: VecDeque::new(),
            cfg,
        };
        for i in 0..n {
            sim.nodes.push(Node {
                id: NodeId(i as u32 + 1),
                inc: Incarnation(0),
                up: false,
                disk: MemDisk::new(),
                log: None,
                store: Store::new(),
                locks: LockTable::new(),
                txs: BTreeMap::new(),
                tombs: BTreeMap::new(),
                tomb_order: VecDeque::new(),
                lazy: Vec::new(),
                seq: 0,
                clients: BTreeMap::new(),
            });
        }
        sim
    }

    fn instant(&self) -> Instant {
        self.base + Duration::from_micros(self.now)
    }

    fn hist(&mut self, line: impl FnOnce() -> String) {
        let line = format!("{:>10.6}s {}", self.now as f64 / 1e6, line());
        if self.cfg.trace {
            println!("{line}");
        }
        self.history.push_back(line);
        if !self.cfg.trace && self.history.len() > HISTORY_KEPT {
            self.history.pop_front();
        }
    }

    fn at(&mut self, delay: u64, ev: Ev) {
        self.seq += 1;
        self.queue.push(Sched {
            at: self.now + delay,
            seq: self.seq,
            ev,
        });
    }

    /// An exponentially distributed gap with mean `mean` (at least 1 µs).
    fn gap(&mut self, mean: u64) -> u64 {
        let u: f64 = self.rng.gen();
        (-(1.0 - u).ln() * mean as f64) as u64 + 1
    }

    fn violation(&mut self, property: &'static str, detail: String) {
        let v = Violation {
            property,
            detail,
            at_micros: self.now,
        };
        self.hist(|| format!("VIOLATION {v}"));
        self.check.violations.push(v);
    }

    /// Runs the seed to its end and checks the outcome.
    pub(crate) fn run(mut self, seed: u64) -> SeedReport {
        for i in 0..self.nodes.len() {
            let image = self.check.initial_image(i);
            let node = &self.nodes[i];
            let dur = node.disk.durability();
            if let Err(e) = snapshot::write(&dur, &node.kv_dir(), 0, &image) {
                self.violation("setup", format!("initial snapshot of n{}: {e}", i + 1));
            }
            self.restart(i);
            self.at(i as u64 * 7_001 + 1, Ev::Tick(i));
            let cp = self.gap(self.cfg.checkpoint_gap_micros);
            self.at(cp, Ev::Checkpoint(i));
        }
        self.at(1_000, Ev::StartTx);
        self.at(self.cfg.fault_micros, Ev::EndFaults);
        if self.cfg.crash_gap_micros > 0 {
            let g = self.gap(self.cfg.crash_gap_micros);
            self.at(g, Ev::Crash);
        }
        if self.cfg.partition_gap_micros > 0 {
            let g = self.gap(self.cfg.partition_gap_micros);
            self.at(g, Ev::Cut);
        }
        if self.cfg.disk_fault_gap_micros > 0 {
            let g = self.gap(self.cfg.disk_fault_gap_micros);
            self.at(g, Ev::DiskFault);
        }
        let end = self.cfg.fault_micros + self.cfg.quiet_micros;
        while let Some(s) = self.queue.pop() {
            if s.at > end || self.done {
                break;
            }
            self.now = s.at;
            self.event(s.ev);
        }
        self.finish();
        let mut cov = std::mem::take(&mut self.cov);
        for n in &self.nodes {
            let st = n.disk.stats();
            cov.fault(FaultKind::FsyncFailure, st.file_sync_failures);
            cov.fault(FaultKind::DirSyncFailure, st.dir_sync_failures);
            cov.fault(FaultKind::LostUnsyncedWrite, st.lost_writes);
            cov.fault(FaultKind::TornWrite, st.torn_writes);
            cov.fault(FaultKind::KeptUnsyncedWrite, st.kept_unsynced_writes);
            cov.fault(FaultKind::LostDirEntry, st.lost_entries);
        }
        cov.sim_micros = self.now;
        cov.committed = self.check.committed;
        cov.aborted = self.check.aborted;
        cov.unknown = self.check.unknown;
        cov.checks = self.check.checks;
        cov.audits = self.check.audits;
        for n in &mut self.nodes {
            if let Some(log) = n.log.take() {
                log.crash();
            }
        }
        SeedReport {
            seed,
            violations: std::mem::take(&mut self.check.violations),
            coverage: cov,
            history: self.history.into_iter().collect(),
        }
    }

    fn event(&mut self, ev: Ev) {
        match ev {
            Ev::Deliver { from, to, msg } => {
                self.in_flight -= 1;
                if self.nodes[to].up {
                    self.on_msg(to, from, msg);
                }
            }
            Ev::Tick(i) => {
                if self.nodes[i].up {
                    let now = self.instant();
                    let tids: Vec<Tid> = self.nodes[i].txs.keys().copied().collect();
                    for tid in tids {
                        self.feed(i, tid, Input::Tick(now));
                    }
                }
                if !self.faults_on && i == 0 && self.quiescent() {
                    self.done = true;
                }
                self.at(TICK_MICROS, Ev::Tick(i));
            }
            Ev::StartTx => {
                if self.faults_on {
                    self.start_tx();
                    let g = self.gap(self.cfg.tx_gap_micros);
                    self.at(g, Ev::StartTx);
                }
            }
            Ev::CallTimeout { node, inc, tid } => {
                let n = &self.nodes[node];
                if n.up && n.inc == inc && n.clients.get(&tid).is_some_and(|c| !c.decided) {
                    self.client_abort(node, tid, "a call timed out".into());
                }
            }
            Ev::Forced { node, inc, tid } => {
                if self.nodes[node].up && self.nodes[node].inc == inc {
                    self.feed(node, tid, Input::Forced);
                    self.lazy_durable(node);
                }
            }
            Ev::Crash => {
                if self.faults_on {
                    let i = self.rng.gen_range(0..self.nodes.len());
                    if self.nodes[i].up {
                        self.cov.fault(FaultKind::CrashRandom, 1);
                        self.crash(i, "at a random instant");
                    }
                    let g = self.gap(self.cfg.crash_gap_micros);
                    self.at(g, Ev::Crash);
                }
            }
            Ev::Restart(i) => {
                if !self.nodes[i].up {
                    self.restart(i);
                }
            }
            Ev::PeerDead { node, dead, before } => {
                if self.nodes[node].up {
                    let tids: Vec<Tid> = self.nodes[node]
                        .txs
                        .iter()
                        .filter(|(_, b)| b.born < before)
                        .map(|(t, _)| *t)
                        .collect();
                    for tid in tids {
                        self.feed(node, tid, Input::PeerDead(dead, Status::ProcDead));
                    }
                }
            }
            Ev::Cut => {
                if self.faults_on {
                    let n = self.nodes.len();
                    let a = self.rng.gen_range(0..n);
                    let b = (a + self.rng.gen_range(1..n)) % n;
                    let pair = (a.min(b), a.max(b));
                    if self.cut.insert(pair) {
                        self.hist(|| format!("partition n{} | n{}", pair.0 + 1, pair.1 + 1));
                        let len = self.rng.gen_range(50_000..700_000);
                        self.at(len, Ev::Heal(pair.0, pair.1));
                    }
                    let g = self.gap(self.cfg.partition_gap_micros);
                    self.at(g, Ev::Cut);
                }
            }
            Ev::Heal(a, b) => {
                if self.cut.remove(&(a, b)) {
                    self.cov.fault(FaultKind::NetHeal, 1);
                    self.hist(|| format!("heal n{} | n{}", a + 1, b + 1));
                }
            }
            Ev::DiskFault => {
                if self.faults_on {
                    let i = self.rng.gen_range(0..self.nodes.len());
                    let fault = if self.rng.gen_bool(0.6) {
                        DiskFault::FailFileSync(self.rng.gen_range(1..4))
                    } else {
                        DiskFault::FailDirSync(self.rng.gen_range(1..3))
                    };
                    self.hist(|| format!("n{}: arm {fault:?}", i + 1));
                    self.nodes[i].disk.inject(fault);
                    let g = self.gap(self.cfg.disk_fault_gap_micros);
                    self.at(g, Ev::DiskFault);
                }
            }
            Ev::Checkpoint(i) => {
                if self.nodes[i].up {
                    self.checkpoint(i);
                }
                let g = self.gap(self.cfg.checkpoint_gap_micros);
                self.at(g, Ev::Checkpoint(i));
            }
            Ev::EndFaults => {
                self.faults_on = false;
                self.hist(|| "faults end: heal everything, restart every node".into());
                let cut = std::mem::take(&mut self.cut);
                self.cov.fault(FaultKind::NetHeal, cut.len() as u64);
                for i in 0..self.nodes.len() {
                    self.nodes[i].disk.clear_faults();
                    if !self.nodes[i].up {
                        self.at(1_000, Ev::Restart(i));
                    }
                }
            }
        }
    }

    fn quiescent(&self) -> bool {
        self.in_flight == 0
            && self
                .nodes
                .iter()
                .all(|n| n.up && n.txs.is_empty() && n.clients.is_empty())
    }

    // ---- the network ----------------------------------------------------------------------

    fn send(&mut self, from: usize, to: usize, msg: Msg) {
        if self.faults_on {
            if self.cut.contains(&(from.min(to), from.max(to))) {
                self.cov.fault(FaultKind::NetPartition, 1);
                return;
            }
            if self.rng.gen_bool(self.cfg.drop) {
                self.cov.fault(FaultKind::NetDrop, 1);
                return;
            }
        }
        let copies = if self.faults_on && self.rng.gen_bool(self.cfg.duplicate) {
            self.cov.fault(FaultKind::NetDuplicate, 1);
            2
        } else {
            1
        };
        for _ in 0..copies {
            let (lo, hi) = self.cfg.latency;
            let delay = self.rng.gen_range(lo..=hi);
            self.in_flight += 1;
            self.at(
                delay,
                Ev::Deliver {
                    from,
                    to,
                    msg: msg.clone(),
                },
            );
        }
    }

    fn index(&self, node: NodeId) -> usize {
        node.0 as usize - 1
    }

    fn send_tx(&mut self, from: usize, to: NodeId, msg: TxMsg) {
        let to = self.index(to);
        self.send(from, to, Msg::Tx(msg));
    }

    // ---- crash points and crashes ------------------------------------------------------

    /// Passes a named crash point; true when the node crashed there.
    fn point(&mut self, i: usize, p: CrashPoint) -> bool {
        *self.cov.points_reached.entry(p).or_default() += 1;
        // Calls are many times more frequent than the commit protocol's points.
        let p_crash = match p {
            CrashPoint::ParticipantAfterCall => self.cfg.crash_point_p / 8.0,
            _ => self.cfg.crash_point_p,
        };
        if self.faults_on && self.rng.gen_bool(p_crash) {
            *self.cov.crash_points.entry(p).or_default() += 1;
            self.cov.fault(FaultKind::CrashAtPoint, 1);
            self.crash(i, p.name());
            true
        } else {
            false
        }
    }

    fn crash(&mut self, i: usize, why: &str) {
        if !self.nodes[i].up {
            return;
        }
        self.hist(|| format!("n{} CRASH ({why})", i + 1));
        if let Some(log) = self.nodes[i].log.take() {
            log.crash();
        }
        let rng = &mut self.rng;
        let st = self.nodes[i].disk.crash(&mut |n| rng.gen_range(0..n));
        if st.lost_writes + st.torn_writes + st.lost_entries > 0 {
            self.hist(|| {
                format!(
                    "n{} disk: {} unsynced writes lost, {} torn, {} kept, {} entries lost",
                    i + 1,
                    st.lost_writes,
                    st.torn_writes,
                    st.kept_unsynced_writes,
                    st.lost_entries
                )
            });
        }
        let lost: Vec<Tid> = self.nodes[i].clients.keys().copied().collect();
        for tid in lost {
            self.check.client_lost(tid);
        }
        let node = &mut self.nodes[i];
        node.reset_volatile();
        node.up = false;
        let id = node.id;
        let back = if self.faults_on {
            self.rng.gen_range(20_000..400_000)
        } else {
            1_000
        };
        self.at(back, Ev::Restart(i));
        let before = self.now + 1;
        for j in 0..self.nodes.len() {
            if j != i {
                self.at(
                    DETECT_MICROS,
                    Ev::PeerDead {
                        node: j,
                        dead: id,
                        before,
                    },
                );
            }
        }
    }

    /// A failed log operation: the log is poisoned, so the node stops (fail-stop).
    fn log_failed(&mut self, i: usize, what: &str, e: impl std::fmt::Display) {
        let why = format!("{what} failed: {e}");
        self.crash(i, &why);
    }

    fn log_config(&self, i: usize) -> LogConfig {
        let node = &self.nodes[i];
        LogConfig::new(node.log_dir())
            .durability(node.disk.durability())
            .segment_size(self.cfg.segment_size)
            .max_record_size(2048)
            .max_buffered_bytes(1 << 20)
            .write_behind_bytes(1 << 20)
            .group_commit_batch(1)
            .group_commit_max_delay(Duration::ZERO)
            // Nobody waits lazily; a timed sync would make the disk depend on the real clock.
            .lazy_flush_interval(Duration::from_secs(24 * 3600))
    }

    /// Restart: recover the node from its simulated disk with the real log recovery, the
    /// real KV snapshot code, and the transaction manager's recovery rules.
    fn restart(&mut self, i: usize) {
        let cfg = self.log_config(i);
        {
            let node = &mut self.nodes[i];
            node.reset_volatile();
            node.inc = Incarnation(node.inc.0 + 1);
        }
        let inc = self.nodes[i].inc;
        self.hist(|| format!("n{} restart (incarnation {})", i + 1, inc.0));
        let (log, rec) = match Log::open(cfg) {
            Ok(x) => x,
            Err(e @ weft_log::LogError::Io { .. }) => {
                // An injected EIO during recovery: the node fails to start; try again (the
                // fault was one-shot), as an operator or supervisor would.
                self.hist(|| format!("n{} cannot start: {e}; retrying", i + 1));
                self.at(50_000, Ev::Restart(i));
                return;
            }
            Err(e) => {
                self.violation(
                    "recovery",
                    format!("n{}: the log does not open: {e}", i + 1),
                );
                return;
            }
        };
        if let Some(why) = &rec.tail_error {
            self.cov.fault(FaultKind::LogTailCut, 1);
            let why = why.clone();
            self.hist(|| format!("n{} log tail cut: {why}", i + 1));
        }
        let dur = log.durability().clone();
        let kv_dir = self.nodes[i].kv_dir();
        let snap = match snapshot::read_on(&dur, &kv_dir) {
            Ok(s) => s,
            Err(e) => {
                self.violation("recovery", format!("n{}: snapshot: {e}", i + 1));
                log.crash();
                return;
            }
        };
        let at = snap.as_ref().map(|(at, _)| *at);
        if let Err(e) = snapshot::check_covers(
            &kv_dir,
            at,
            log.dir(),
            log.first_lsn().get(),
            log.end_lsn().get(),
        ) {
            self.violation("recovery", format!("n{}: {e}", i + 1));
            log.crash();
            return;
        }
        let (from, image) = snap.unwrap_or_default();
        let mut store = Store::from_image(image);
        for r in rec
            .records
            .iter()
            .filter(|r| r.tag == KV_RECORD_TAG && r.lsn.get() >= from)
        {
            match postcard::from_bytes::<KvRecord>(&r.payload) {
                Ok(KvRecord::Prepared { tid, writes }) => {
                    store.restore_prepared(tid, r.lsn.get(), writes)
                }
                Err(e) => self.violation(
                    "recovery",
                    format!("n{}: undecodable kv record: {e}", i + 1),
                ),
            }
        }
        let tm = check::tm_recovery(&rec.records);
        let mut locks = LockTable::new();
        let mut applied = Vec::new();
        for tid in store.prepared_in_log_order() {
            match tm.get(&tid).map(|s| s.verdict()) {
                Some(check::Verdict::Committed) => {
                    store.commit(tid);
                    applied.push((tid, true));
                }
                Some(check::Verdict::InDoubt) => {
                    for key in store.prepared_keys(tid) {
                        if let Err(e) = locks.try_acquire(Xid::top(tid), key, LockMode::Exclusive) {
                            self.violation(
                                "recovery",
                                format!("n{}: relocking in-doubt {tid}: {e}", i + 1),
                            );
                        }
                    }
                }
                Some(check::Verdict::Aborted) | None => {
                    store.abort(tid);
                    applied.push((tid, false));
                }
            }
        }
        let node = &mut self.nodes[i];
        let voter_cfg = self.core_cfg;
        for (tid, s) in &tm {
            match s.verdict() {
                check::Verdict::Committed if s.ended => node.tomb(*tid, Some(Outcome::Committed)),
                check::Verdict::Committed => {
                    let voter = s.prepared.as_ref().map(|(p, _)| *p);
                    let children = s.committed.clone().unwrap_or_default();
                    let core = TxCore::recovered_committed(*tid, voter, children, voter_cfg);
                    node.txs.insert(
                        *tid,
                        Branch {
                            core,
                            born: 0,
                            first_lsn: s.first_lsn,
                            calls: BTreeSet::new(),
                        },
                    );
                }
                check::Verdict::Aborted => node.tomb(*tid, Some(Outcome::Aborted)),
                check::Verdict::InDoubt => {
                    let (parent, children) = s.prepared.clone().expect("in doubt means prepared");
                    let core = TxCore::recovered_prepared(*tid, parent, children, voter_cfg);
                    node.txs.insert(
                        *tid,
                        Branch {
                            core,
                            born: 0,
                            first_lsn: s.first_lsn,
                            calls: BTreeSet::new(),
                        },
                    );
                }
            }
        }
        node.store = store;
        node.locks = locks;
        node.log = Some(log);
        node.up = true;
        self.cov.recoveries += 1;
        let in_doubt = self.nodes[i].txs.len();
        self.hist(|| format!("n{} recovered: {in_doubt} transaction(s) to finish", i + 1));
        for (tid, commit) in applied {
            self.check.applied(i, tid, commit, self.now);
        }
        self.audit(i);
    }

    fn checkpoint(&mut self, i: usize) {
        let node = &self.nodes[i];
        let Some(log) = node.log.clone() else {
            return;
        };
        let (at, last, image, oldest) = (
            log.end_lsn(),
            log.last_lsn(),
            node.store.image(),
            node.store.oldest_prepared(),
        );
        let low_water = node.txs.values().filter_map(|b| b.first_lsn).min();
        let kv_dir = node.kv_dir();
        if last > log.durable_lsn() {
            if let Err(e) = log.force_blocking(last) {
                return self.log_failed(i, "checkpoint force", e);
            }
            self.lazy_durable(i);
        }
        if let Err(e) = snapshot::write(log.durability(), &kv_dir, at.get(), &image) {
            // A failed fsync leaves the disk unknown: the node stops, as on a failed force.
            return self.log_failed(i, "snapshot", e);
        }
        if self.point(i, CrashPoint::Checkpoint) {
            return;
        }
        let mut keep = at.get();
        if let Some(o) = oldest {
            keep = keep.min(o);
        }
        if let Some(l) = low_water {
            keep = keep.min(l.get());
        }
        if let Err(e) = log.truncate_before(Lsn(keep)) {
            return self.log_failed(i, "log truncation", e);
        }
        self.hist(|| format!("n{} checkpoint at {at}, log kept from {}", i + 1, Lsn(keep)));
    }

    // ---- the driver loop: inputs in, actions out ------------------------------------------

    /// Feeds `input` to `tid`'s core at node `i` and carries out the actions, feeding what
    /// they produce back in, until nothing is left (a flat loop, no re-entry).
    fn feed(&mut self, i: usize, tid: Tid, input: Input) {
        let mut work: VecDeque<(Tid, Input)> = VecDeque::from([(tid, input)]);
        while let Some((tid, input)) = work.pop_front() {
            if !self.nodes[i].up {
                return;
            }
            let in_doubt = self.nodes[i]
                .txs
                .get(&tid)
                .is_some_and(|b| b.core.in_doubt());
            if matches!(input, Input::CommitDecision { .. })
                && in_doubt
                && self.point(i, CrashPoint::ParticipantPhaseTwo)
            {
                return;
            }
            let forced = matches!(input, Input::Forced);
            let (actions, coordinator) = match self.nodes[i].txs.get_mut(&tid) {
                Some(b) => (b.core.step(input), b.core.is_coordinator()),
                None => {
                    self.no_branch(i, tid, input);
                    continue;
                }
            };
            if coordinator
                && actions.iter().any(|a| {
                    matches!(
                        a,
                        Action::Log(TmRecord::Committed { .. }, Durability::Force)
                    )
                })
                && self.point(i, CrashPoint::CoordinatorBeforeCommitForce)
            {
                return;
            }
            if forced
                && coordinator
                && actions.iter().any(|a| matches!(a, Action::CommitLocal))
                && self.point(i, CrashPoint::CoordinatorAfterCommitForce)
            {
                return;
            }
            if forced
                && !coordinator
                && actions.iter().any(|a| {
                    matches!(
                        a,
                        Action::Send(
                            _,
                            TxMsg::Vote {
                                vote: Vote::Yes { .. },
                                ..
                            }
                        )
                    )
                })
                && self.point(i, CrashPoint::ParticipantPrepared)
            {
                return;
            }
            for a in actions {
                if !self.act(i, tid, a, &mut work) {
                    return;
                }
            }
        }
    }

    /// Carries out one action. False when the node crashed doing it.
    fn act(&mut self, i: usize, tid: Tid, a: Action, work: &mut VecDeque<(Tid, Input)>) -> bool {
        match a {
            Action::PrepareLocal { aborted_subs } => {
                let vote = self.prepare_local(i, tid, &aborted_subs);
                work.push_back((tid, Input::LocalVote(vote)));
            }
            Action::Send(to, msg) => self.send_tx(i, to, msg),
            Action::Log(rec, durability) => {
                let bytes = postcard::to_allocvec(&rec).expect("TM records encode");
                let Some(log) = self.nodes[i].log.clone() else {
                    return false;
                };
                let lsn = match log.append(TM_RECORD_TAG, &bytes) {
                    Ok(l) => l,
                    Err(e) => {
                        self.log_failed(i, "append", e);
                        return false;
                    }
                };
                if let Some(b) = self.nodes[i].txs.get_mut(&tid) {
                    b.first_lsn.get_or_insert(lsn);
                }
                let skip = self.cfg.sabotage == Sabotage::SkipPrepareForce
                    && matches!(rec, TmRecord::Prepared { .. });
                match durability {
                    Durability::Force => {
                        if skip {
                            let inc = self.nodes[i].inc;
                            self.at(1, Ev::Forced { node: i, inc, tid });
                        } else if let Err(e) = log.force_blocking(lsn) {
                            self.log_failed(i, "force", e);
                            return false;
                        }
                        let inc = self.nodes[i].inc;
                        let fsync = self.rng.gen_range(50..1_500);
                        self.at(fsync, Ev::Forced { node: i, inc, tid });
                    }
                    Durability::Lazy => {
                        if log.durable_lsn() >= lsn {
                            work.push_back((tid, Input::LazyDurable));
                        } else {
                            self.nodes[i].lazy.push((lsn, tid));
                        }
                    }
                    Durability::None => {}
                }
            }
            Action::CommitLocal => {
                let node = &mut self.nodes[i];
                node.store.commit(tid);
                released(node.locks.release_all(&tid));
                self.check.applied(i, tid, true, self.now);
                if self.check.kind(tid) == Some(Kind::DebitCredit) {
                    self.audit(i);
                }
            }
            Action::AbortLocal => {
                let node = &mut self.nodes[i];
                node.store.abort(tid);
                released(node.locks.release_all(&tid));
                self.check.applied(i, tid, false, self.now);
            }
            Action::Finished(outcome) => {
                if let Some(c) = self.nodes[i].clients.remove(&tid) {
                    self.hist(|| format!("n{} {tid} {:?} -> client", i + 1, outcome));
                    self.check
                        .finished(tid, outcome, c.kind, &c.reads, self.now);
                }
            }
            Action::Forget(outcome) => {
                let node = &mut self.nodes[i];
                node.txs.remove(&tid);
                node.tomb(tid, outcome);
            }
        }
        true
    }

    /// After a force: records appended lazily that it covered are durable now.
    fn lazy_durable(&mut self, i: usize) {
        let Some(log) = self.nodes[i].log.as_ref() else {
            return;
        };
        let durable = log.durable_lsn();
        let (ready, wait): (Vec<_>, Vec<_>) = std::mem::take(&mut self.nodes[i].lazy)
            .into_iter()
            .partition(|(l, _)| *l <= durable);
        self.nodes[i].lazy = wait;
        for (_, tid) in ready {
            self.feed(i, tid, Input::LazyDurable);
        }
    }

    /// The KV store's part in prepare (as `weft_kv`'s resource): log the write set and vote.
    fn prepare_local(&mut self, i: usize, tid: Tid, aborted: &[weft_wire::SubPath]) -> Vote {
        let node = &mut self.nodes[i];
        let Some(log) = node.log.clone() else {
            return Vote::No("node down".into());
        };
        let prepared = node.store.prepare(tid, aborted, |writes| {
            let rec = KvRecord::Prepared {
                tid,
                writes: writes.to_vec(),
            };
            let bytes = postcard::to_allocvec(&rec).map_err(|e| e.to_string())?;
            log.append(KV_RECORD_TAG, &bytes)
                .map(|l| l.get())
                .map_err(|e| e.to_string())
        });
        match prepared {
            Ok(None) => {
                released(node.locks.release_all(&tid));
                Vote::ReadOnly
            }
            Ok(Some(_)) => {
                released(node.locks.release_shared(&Xid::top(tid)));
                Vote::Yes { durable: true }
            }
            Err(e) => {
                node.store.abort(tid);
                released(node.locks.release_all(&tid));
                Vote::No(format!("kv: cannot log the prepare record: {e}"))
            }
        }
    }

    /// A protocol input for a transaction with no core here: the manager's rules for
    /// finished (tombstoned) and unknown transactions.
    fn no_branch(&mut self, i: usize, tid: Tid, input: Input) {
        let outcome = self.nodes[i].tombs.get(&tid).copied();
        let actions = match outcome {
            Some(o) => late(tid, o, input),
            None => match input {
                Input::Prepare { from, .. } => {
                    self.nodes[i].tomb(tid, None);
                    vec![Action::Send(
                        from,
                        TxMsg::Vote {
                            tid,
                            vote: Vote::ReadOnly,
                        },
                    )]
                }
                Input::CommitDecision { from } => vec![Action::Send(from, TxMsg::Ack { tid })],
                Input::AbortNotice { .. } => {
                    self.nodes[i].tomb(tid, Some(Outcome::Aborted));
                    Vec::new()
                }
                _ => Vec::new(),
            },
        };
        for a in actions {
            if let Action::Send(to, msg) = a {
                self.send_tx(i, to, msg);
            }
        }
    }

    fn on_msg(&mut self, i: usize, from_ix: usize, msg: Msg) {
        let from = self.nodes[from_ix].id;
        match msg {
            Msg::Tx(m) => self.on_tx_msg(i, from, m),
            Msg::Call { tid, call, ops } => self.on_call(i, from_ix, tid, call, ops),
            Msg::Reply {
                tid,
                call,
                incarnation,
                result,
            } => self.on_reply(i, from, tid, call, incarnation, result),
        }
    }

    fn on_tx_msg(&mut self, i: usize, from: NodeId, m: TxMsg) {
        let node = &self.nodes[i];
        let (tid, input) = match m {
            TxMsg::Prepare {
                tid,
                incarnation,
                aborted_subs,
            } => {
                if !node.txs.contains_key(&tid)
                    && incarnation != node.inc
                    && !node.tombs.contains_key(&tid)
                {
                    let vote = Vote::No(format!(
                        "node {} restarted (incarnation {} -> {}): its branch was lost",
                        node.id, incarnation, node.inc
                    ));
                    self.send_tx(i, from, TxMsg::Vote { tid, vote });
                    return;
                }
                (tid, Input::Prepare { from, aborted_subs })
            }
            TxMsg::Vote { tid, vote } => (tid, Input::Vote { from, vote }),
            TxMsg::VoteAfter { tid, vote, .. } => (tid, Input::Vote { from, vote }),
            TxMsg::Decision { tid, commit: true } => (tid, Input::CommitDecision { from }),
            TxMsg::Decision { tid, commit: false } => (
                tid,
                Input::AbortNotice {
                    from,
                    status: Status::Aborted,
                    reason: "the parent decided abort".into(),
                },
            ),
            TxMsg::Ack { tid } => (tid, Input::Ack { from }),
            TxMsg::Abort {
                tid,
                status,
                reason,
            } => (
                tid,
                Input::AbortNotice {
                    from,
                    status,
                    reason,
                },
            ),
            TxMsg::Outcome { tid, answer } => (tid, Input::Answer(answer)),
            TxMsg::Inquire { tid } => {
                let answer = match node.txs.get(&tid) {
                    Some(b) => b.core.answer(),
                    None => match node.tombs.get(&tid) {
                        Some(Some(Outcome::Committed)) => Answer::Committed,
                        None if self.cfg.sabotage == Sabotage::CommitForgotten => Answer::Committed,
                        // Presumed abort: no record means abort.
                        _ => Answer::Aborted,
                    },
                };
                self.send_tx(i, from, TxMsg::Outcome { tid, answer });
                return;
            }
            TxMsg::Enlist { .. } | TxMsg::Enlisted { .. } | TxMsg::SubEnded { .. } => return,
        };
        self.feed(i, tid, input);
    }

    // ---- calls: the workload's operations, run in a transaction's branch -----------------

    fn run_ops(&mut self, i: usize, tid: Tid, ops: &[Op]) -> Result<Vec<i64>, String> {
        let node = &mut self.nodes[i];
        let xid = Xid::top(tid);
        let mut out = Vec::new();
        for op in ops {
            let (key, mode) = match op {
                Op::Read(k) => (k, LockMode::Shared),
                Op::AddInt(k, _) | Op::AddTuple(k, _) | Op::Insert(k, _) => {
                    (k, LockMode::Exclusive)
                }
            };
            node.locks
                .try_acquire(xid.clone(), key.clone(), mode)
                .map_err(|e| format!("n{}: {e}", node.id.0))?;
            let cur = node.store.read(&xid, key);
            match op {
                Op::Read(_) => out.push(cur.as_deref().and_then(parse_int).unwrap_or(0)),
                Op::AddInt(k, d) => {
                    let v = cur.as_deref().and_then(parse_int).unwrap_or(0) + d;
                    node.store.write(&xid, k.clone(), Some(int_value(v)));
                }
                Op::AddTuple(k, d) => {
                    let v = cur.as_deref().and_then(balance).unwrap_or(0) + d;
                    node.store.write(&xid, k.clone(), Some(tuple(v)));
                }
                Op::Insert(k, v) => node.store.write(&xid, k.clone(), Some(v.clone())),
            }
        }
        Ok(out)
    }

    fn on_call(&mut self, i: usize, from_ix: usize, tid: Tid, call: u64, ops: Vec<Op>) {
        let from = self.nodes[from_ix].id;
        let deadline = self.instant() + TX_TIMEOUT;
        let cfg = self.core_cfg;
        let now = self.now;
        let node = &mut self.nodes[i];
        let refuse = match node.txs.get_mut(&tid) {
            Some(b) if b.calls.contains(&call) => return, // a duplicate: ran already
            Some(b) if !b.core.is_active() => Some("the transaction is ending here".to_string()),
            Some(b) => {
                b.calls.insert(call);
                None
            }
            None if node.tombs.contains_key(&tid) => Some("the transaction is over here".into()),
            None => {
                let mut calls = BTreeSet::new();
                calls.insert(call);
                node.txs.insert(
                    tid,
                    Branch {
                        core: TxCore::participant(tid, from, Some(deadline), cfg),
                        born: now,
                        first_lsn: None,
                        calls,
                    },
                );
                None
            }
        };
        let result = match refuse {
            Some(r) => Err(r),
            None => self.run_ops(i, tid, &ops),
        };
        if self.point(i, CrashPoint::ParticipantAfterCall) {
            return;
        }
        let incarnation = self.nodes[i].inc;
        self.send(
            i,
            from_ix,
            Msg::Reply {
                tid,
                call,
                incarnation,
                result,
            },
        );
    }

    fn on_reply(
        &mut self,
        i: usize,
        from: NodeId,
        tid: Tid,
        call: u64,
        incarnation: Incarnation,
        result: Result<Vec<i64>, String>,
    ) {
        let node = &mut self.nodes[i];
        let Some(client) = node.clients.get_mut(&tid) else {
            return;
        };
        if client.decided || !client.pending.remove(&call) {
            return;
        }
        // The callee holds a branch either way: the core must know it to tell it the end.
        let added = node
            .txs
            .get_mut(&tid)
            .is_some_and(|b| b.core.add_child(from, incarnation));
        match result {
            Ok(vals) if added => {
                client.reads.extend(vals);
                if client.pending.is_empty() {
                    client.decided = true;
                    self.feed(i, tid, Input::Commit);
                }
            }
            Ok(_) => self.client_abort(i, tid, "the transaction ended during a call".into()),
            Err(e) => self.client_abort(i, tid, e),
        }
    }

    fn client_abort(&mut self, i: usize, tid: Tid, reason: String) {
        if let Some(c) = self.nodes[i].clients.get_mut(&tid) {
            c.decided = true;
        }
        self.hist(|| format!("n{} {tid} client aborts: {reason}", i + 1));
        self.feed(i, tid, Input::Abort(reason));
    }

    fn start_tx(&mut self) {
        let up: Vec<usize> = (0..self.nodes.len())
            .filter(|&i| self.nodes[i].up)
            .collect();
        if up.is_empty() {
            return;
        }
        let c = up[self.rng.gen_range(0..up.len())];
        let tid = {
            let node = &mut self.nodes[c];
            node.seq += 1;
            Tid::new(node.id, node.inc, node.seq)
        };
        let (kind, plan) = self.check.plan(&mut self.rng, tid, self.nodes.len());
        self.hist(|| format!("n{} begin {tid} {kind:?}", c + 1));
        let deadline = self.instant() + TX_TIMEOUT;
        let now = self.now;
        let cfg = self.core_cfg;
        let node = &mut self.nodes[c];
        node.txs.insert(
            tid,
            Branch {
                core: TxCore::coordinator(tid, Some(deadline), cfg),
                born: now,
                first_lsn: None,
                calls: BTreeSet::new(),
            },
        );
        node.clients.insert(
            tid,
            Client {
                kind,
                pending: BTreeSet::new(),
                reads: Vec::new(),
                decided: false,
            },
        );
        for (target, ops) in plan {
            if target == c {
                match self.run_ops(c, tid, &ops) {
                    Ok(vals) => {
                        if let Some(cl) = self.nodes[c].clients.get_mut(&tid) {
                            cl.reads.extend(vals);
                        }
                    }
                    Err(e) => return self.client_abort(c, tid, e),
                }
            } else {
                let call = self.next_call;
                self.next_call += 1;
                if let Some(cl) = self.nodes[c].clients.get_mut(&tid) {
                    cl.pending.insert(call);
                }
                self.send(c, target, Msg::Call { tid, call, ops });
            }
        }
        let pending = self.nodes[c]
            .clients
            .get(&tid)
            .is_some_and(|cl| !cl.pending.is_empty());
        if pending {
            let inc = self.nodes[c].inc;
            self.at(CALL_TIMEOUT_MICROS, Ev::CallTimeout { node: c, inc, tid });
        } else {
            if let Some(cl) = self.nodes[c].clients.get_mut(&tid) {
                cl.decided = true;
            }
            self.feed(c, tid, Input::Commit);
        }
    }

    // ---- checks ---------------------------------------------------------------------------

    /// The DebitCredit audit of node `i`'s committed copy (Raid's per-copy invariant).
    fn audit(&mut self, i: usize) {
        let a = check::site_audit(&self.nodes[i].store);
        self.check.audits += 1;
        for p in a.problems() {
            self.violation("audit", format!("n{}: {p}", i + 1));
        }
    }

    fn finish(&mut self) {
        // Liveness: after the faults healed, everything ended.
        for i in 0..self.nodes.len() {
            let n = &self.nodes[i];
            if !n.up {
                self.violation("liveness", format!("n{} is still down", i + 1));
                continue;
            }
            let stuck: Vec<String> = n
                .txs
                .iter()
                .map(|(t, b)| format!("{t} {}", phase_name(b.core.phase())))
                .collect();
            let prepared = n.store.prepared_tids();
            let locked = n.locks.len();
            let clients = n.clients.len();
            if !stuck.is_empty() {
                self.violation(
                    "liveness",
                    format!("n{}: transactions never ended: {}", i + 1, stuck.join(", ")),
                );
            }
            if !prepared.is_empty() || locked > 0 || clients > 0 {
                self.violation(
                    "liveness",
                    format!(
                        "n{}: {} prepared write sets, {locked} locked keys, {clients} clients left",
                        i + 1,
                        prepared.len()
                    ),
                );
            }
        }
        let stores: Vec<(NodeId, &Store)> = self
            .nodes
            .iter()
            .filter(|n| n.up)
            .map(|n| (n.id, &n.store))
            .collect();
        let found = self.check.final_checks(&stores);
        for (p, d) in found {
            self.violation(p, d);
        }
    }
}

/// Locks are only ever tried (no-wait), so a release never has a waiter to wake.
fn released(w: Wakeups) {
    debug_assert!(w.is_empty(), "no-wait locking queued a waiter");
}

fn phase_name(p: &Phase) -> &'static str {
    match p {
        Phase::Active => "active",
        Phase::Preparing => "preparing",
        Phase::Forcing => "forcing",
        Phase::Prepared => "prepared (in doubt)",
        Phase::Committing => "committing",
        Phase::Done(_) => "done",
    }
}

/// The placement and tables every replica starts with.
pub(crate) fn dc_image(cfg: &SimConfig) -> Image {
    let mut img = Image::default();
    let sites: Vec<NodeId> = (1..=cfg.nodes).map(NodeId).collect();
    img.committed.insert(
        Bytes::from_static(PLACEMENT_KEY),
        Replicas::encode_placement(&sites),
    );
    for (rel, n) in [
        (Relation::Account, cfg.dc_accounts),
        (Relation::Teller, cfg.dc_tellers),
        (Relation::Branch, 1),
    ] {
        for key in 0..n {
            img.committed.insert(Item { rel, key }.kv_key(), tuple(0));
        }
    }
    img
}

/// A DebitCredit history row's key and stored form.
pub(crate) fn history(tid: Tid, aid: u64, teller: u64, delta: i64) -> (Bytes, Bytes) {
    let row = HistoryRow {
        tid,
        rel: Relation::History,
        aid,
        tid_key: teller,
        bid: 0,
        delta,
    };
    let key = Item {
        rel: Relation::History,
        key: HistoryRow::key(tid, 0),
    }
    .kv_key();
    (key, row.encode())
}
