//! One simulated run: nodes, network, scheduler, workload and fault injection, in one thread
//! under one seed.
//!
//! Each node runs weft's real code: the transaction manager's node core ([`TmCore`]: every
//! commit-protocol decision of the node, recovery from TM records included), the KV [`Store`]
//! and [`LockTable`] (strict two-phase locking, no-wait), the real [`Log`] over a simulated
//! disk ([`MemDisk`]), the real log recovery and KV snapshot code on restart. This module is
//! the node's driver (as `weft_tx::manager` is for real nodes): it performs the core's actions
//! and feeds their results back in a flat loop; it decides nothing about the protocol.
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
use weft_tx::core::CoreConfig;
use weft_tx::node::{
    decode_records, scan, Action, CallId, CallIn, Event as TmEvent, Recovered, ResourceRef,
    WaiterId,
};
use weft_tx::{
    Answer, NodeConfig, Outcome, ParticipationClass, TmCore, TxMsg, Vote, TM_RECORD_TAG,
};
use weft_wire::{Incarnation, NodeId, Status, SubPath, Tid, TxContext, Xid};

use crate::check::{self, Checker, Kind, Op};
use crate::config::{Sabotage, SimConfig};
use crate::report::{Coverage, CrashPoint, FaultKind, SeedReport, Violation};

/// Lines of history kept for a failure report (tracing prints every line as it happens).
const HISTORY_KEPT: usize = 400;
/// A transaction's life bound (its deadline), simulated.
const TX_TIMEOUT: Duration = Duration::from_millis(1500);
/// How long a coordinator waits for its calls' replies.
const CALL_TIMEOUT_MICROS: u64 = 300_000;
/// Timer period of every node.
const TICK_MICROS: u64 = 20_000;
/// A failure detector's delay before peers hear of a crash.
const DETECT_MICROS: u64 = 100_000;

/// A message between nodes.
#[derive(Clone, Debug)]
enum Msg {
    /// The commit protocol.
    Tx(TxMsg),
    /// A call of a transaction: run these operations in its branch here.
    Call {
        ctx: TxContext,
        call: u64,
        ops: Vec<Op>,
    },
    /// The answer to a call: the values read.
    Reply {
        tid: Tid,
        call: u64,
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
        gone: Incarnation,
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

/// How the node core sees the KV store: the node's one two-phase resource.
#[derive(Clone, Debug)]
struct KvRes;

impl ResourceRef for KvRes {
    fn name(&self) -> String {
        "kv".into()
    }
    fn class(&self) -> ParticipationClass {
        ParticipationClass::TwoPhase
    }
    fn commits_from_this_log(&self) -> bool {
        true
    }
    fn same(&self, _other: &Self) -> bool {
        true
    }
}

/// A client waiting at the coordinator: lost if the coordinator crashes.
struct Client {
    kind: Kind,
    pending: BTreeSet<u64>,
    reads: Vec<i64>,
    decided: bool,
}

/// What waits for the log to become durable up to a position.
enum LazyWait {
    /// [`Action::AwaitLazy`] of a transaction.
    Tx(Tid),
    /// [`Action::WaitDurable`].
    Durable,
}

struct Node {
    id: NodeId,
    inc: Incarnation,
    up: bool,
    disk: MemDisk,
    log: Option<Log>,
    tm: Option<TmCore<KvRes>>,
    store: Store,
    locks: LockTable<Bytes, Xid>,
    lazy: Vec<(Lsn, LazyWait)>,
    /// Calls already run per live transaction (a duplicated call message runs once).
    calls: BTreeMap<Tid, BTreeSet<u64>>,
    clients: BTreeMap<Tid, Client>,
}

impl Node {
    fn log_dir(&self) -> PathBuf {
        PathBuf::from(format!("/n{}/log", self.id.0))
    }

    fn kv_dir(&self) -> PathBuf {
        PathBuf::from(format!("/n{}/kv", self.id.0))
    }

    fn reset_volatile(&mut self) {
        self.log = None;
        self.tm = None;
        self.store = Store::new();
        self.locks = LockTable::new();
        self.lazy.clear();
        self.calls.clear();
        self.clients.clear();
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
    node_cfg: NodeConfig,
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
            node_cfg: NodeConfig {
                core: CoreConfig {
                    retry: Duration::from_millis(40),
                    max_retry: Duration::from_millis(800),
                    orphan_check: Duration::from_millis(250),
                },
                default_timeout: TX_TIMEOUT,
                // The simulator checks what the core commits against what resources applied,
                // and early lock release applies a coordinator's commit before its record is
                // durable: off here (see the crate docs).
                early_lock_release: false,
                ..NodeConfig::default()
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
                tm: None,
                store: Store::new(),
                locks: LockTable::new(),
                lazy: Vec::new(),
                calls: BTreeMap::new(),
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
        if self.history.len() > HISTORY_KEPT {
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
                self.step(i, TmEvent::Tick);
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
                    self.step(node, TmEvent::Forced { tid });
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
            Ev::PeerDead { node, dead, gone } => {
                if let Some(tm) = &self.nodes[node].tm {
                    // Announced now: transactions born from now on are spared.
                    let born_before = Some(tm.births());
                    self.step(
                        node,
                        TmEvent::PeerDead {
                            node: dead,
                            status: Status::ProcDead,
                            incarnation: Some(gone),
                            born_before,
                        },
                    );
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
            && self.nodes.iter().all(|n| {
                n.up && n.clients.is_empty() && n.tm.as_ref().is_some_and(|tm| tm.live() == 0)
            })
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
        debug_assert!(node.0 >= 1 && node.0 as usize <= self.nodes.len());
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
        let (id, gone) = (node.id, node.inc);
        let back = if self.faults_on {
            self.rng.gen_range(20_000..400_000)
        } else {
            1_000
        };
        self.at(back, Ev::Restart(i));
        for j in 0..self.nodes.len() {
            if j != i {
                self.at(
                    DETECT_MICROS,
                    Ev::PeerDead {
                        node: j,
                        dead: id,
                        gone,
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
        let (records, undecodable) = decode_records(&rec.records);
        if !undecodable.is_empty() {
            self.violation(
                "recovery",
                format!("n{}: undecodable TM records at {undecodable:?}", i + 1),
            );
        }
        let now = self.instant();
        let mut tm = TmCore::new(self.nodes[i].id, inc, self.node_cfg, now);
        tm.register_resource(KvRes);
        let report = tm.recover(scan(records));
        // The KV store redoes its prepared write sets by the outcomes the core recovered, as
        // `weft_kv`'s plugin does.
        let mut locks = LockTable::new();
        let mut applied = Vec::new();
        for tid in store.prepared_in_log_order() {
            match tm.recovered(tid) {
                Some(Recovered::Committed) => {
                    store.commit(tid);
                    applied.push((tid, true));
                }
                Some(Recovered::InDoubt) => {
                    for key in store.prepared_keys(tid) {
                        if let Err(e) = locks.try_acquire(Xid::top(tid), key, LockMode::Exclusive) {
                            self.violation(
                                "recovery",
                                format!("n{}: relocking in-doubt {tid}: {e}", i + 1),
                            );
                        }
                    }
                }
                Some(Recovered::Aborted) | None => {
                    store.abort(tid);
                    applied.push((tid, false));
                }
            }
        }
        let node = &mut self.nodes[i];
        node.store = store;
        node.locks = locks;
        node.log = Some(log);
        node.tm = Some(tm);
        node.up = true;
        self.cov.recoveries += 1;
        self.hist(|| {
            format!(
                "n{} recovered: {} to redrive, {} in doubt",
                i + 1,
                report.redriven.len(),
                report.in_doubt.len()
            )
        });
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
            node.store
                .image()
                .expect("the simulator runs the KV store's memory engine"),
            node.store.oldest_prepared(),
        );
        let low_water = node.tm.as_ref().and_then(|tm| tm.low_water());
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

    /// Steps node `i`'s core with `ev` and carries out the actions, feeding their results
    /// back and carrying out what those produce, in order, until nothing is left (a flat
    /// loop, no re-entry).
    fn step(&mut self, i: usize, ev: TmEvent) {
        let now = self.instant();
        let Some(tm) = self.nodes[i].tm.as_mut() else {
            return;
        };
        let actions = tm.step(now, ev);
        self.carry_out(i, actions);
    }

    fn carry_out(&mut self, i: usize, actions: Vec<Action<KvRes>>) {
        let mut queue: VecDeque<Action<KvRes>> = actions.into();
        while let Some(a) = queue.pop_front() {
            if !self.nodes[i].up {
                return;
            }
            let result = match a {
                Action::Send { to, msg } => {
                    self.send_tx(i, to, msg);
                    None
                }
                Action::Append { record, token } => {
                    let bytes = postcard::to_allocvec(&record).expect("TM records encode");
                    let log = self.nodes[i].log.clone().expect("an up node has a log");
                    match log.append(TM_RECORD_TAG, &bytes) {
                        Ok(lsn) => Some(TmEvent::Appended { token, lsn }),
                        Err(e) => return self.log_failed(i, "append", e),
                    }
                }
                Action::ExpectForce { .. } => None,
                Action::Force { tid, lsn, token } => {
                    let skip = self.cfg.sabotage == Sabotage::SkipPrepareForce && !token.commit;
                    let log = self.nodes[i].log.clone().expect("an up node has a log");
                    if !skip {
                        if let Err(e) = log.force_blocking(lsn) {
                            return self.log_failed(i, "force", e);
                        }
                    }
                    let inc = self.nodes[i].inc;
                    let fsync = self.rng.gen_range(50..1_500);
                    self.at(fsync, Ev::Forced { node: i, inc, tid });
                    None
                }
                Action::AwaitLazy { tid, lsn } => self.wait_durable(i, lsn, LazyWait::Tx(tid)),
                Action::WaitDurable { lsn } => self.wait_durable(i, lsn, LazyWait::Durable),
                Action::ResourcePrepare { tid, .. } => {
                    let vote = self.prepare_local(i, tid, &[]);
                    Some(TmEvent::ResourceVoted { tid, vote })
                }
                Action::ResourceCommit { tid, .. } => {
                    let node = &mut self.nodes[i];
                    node.store.commit(tid);
                    released(node.locks.release_all(&tid));
                    self.check.applied(i, tid, true, self.now);
                    if self.check.kind(tid) == Some(Kind::DebitCredit) {
                        self.audit(i);
                    }
                    None
                }
                Action::ResourceAbort { tid, .. } => {
                    let node = &mut self.nodes[i];
                    node.store.abort(tid);
                    released(node.locks.release_all(&tid));
                    self.check.applied(i, tid, false, self.now);
                    None
                }
                Action::ResourceEnded { .. } | Action::ResourceSubEnded { .. } => None,
                // No-wait locking never lets a transaction use another's undecided writes.
                Action::QueryDependencies { tid, .. } => Some(TmEvent::Dependencies {
                    tid,
                    result: Ok(Vec::new()),
                }),
                Action::VoteBarrier { id, .. } => Some(TmEvent::BarrierDone { id, result: Ok(()) }),
                Action::Complete { waiter, result } => {
                    let node = &self.nodes[i];
                    let tid = Tid::new(node.id, node.inc, waiter.0);
                    if let Some(c) = self.nodes[i].clients.remove(&tid) {
                        let outcome = match &result {
                            Ok(()) => Outcome::Committed,
                            Err(_) => Outcome::Aborted,
                        };
                        self.hist(|| format!("n{} {tid} -> client: {result:?}", i + 1));
                        self.check
                            .finished(tid, outcome, c.kind, &c.reads, self.now);
                    }
                    None
                }
                Action::CallAdmitted { .. } => None,
                Action::CrashPoint { point, tid } => {
                    if self.point(i, CrashPoint::from(point)) {
                        self.hist(|| format!("n{} crashed at {point} of {tid}", i + 1));
                        return;
                    }
                    None
                }
                Action::Decided { .. } => None,
                Action::Forgotten { tid } => {
                    self.nodes[i].calls.remove(&tid);
                    None
                }
            };
            if let Some(ev) = result {
                let now = self.instant();
                let Some(tm) = self.nodes[i].tm.as_mut() else {
                    return;
                };
                queue.extend(tm.step(now, ev));
            }
        }
    }

    /// The event to feed at once when the log is already durable up to `lsn`, else `None`
    /// (the wait is kept until a force covers it).
    fn wait_durable(&mut self, i: usize, lsn: Lsn, w: LazyWait) -> Option<TmEvent> {
        let durable = self.nodes[i].log.as_ref()?.durable_lsn();
        if durable >= lsn {
            return Some(match w {
                LazyWait::Tx(tid) => TmEvent::LazyDurable { tid },
                LazyWait::Durable => TmEvent::Durable { upto: durable },
            });
        }
        self.nodes[i].lazy.push((lsn, w));
        None
    }

    /// After a force: what waited for a position it covered goes on.
    fn lazy_durable(&mut self, i: usize) {
        let Some(log) = self.nodes[i].log.as_ref() else {
            return;
        };
        let durable = log.durable_lsn();
        let (ready, wait): (Vec<_>, Vec<_>) = std::mem::take(&mut self.nodes[i].lazy)
            .into_iter()
            .partition(|(l, _)| *l <= durable);
        self.nodes[i].lazy = wait;
        for (_, w) in ready {
            let ev = match w {
                LazyWait::Tx(tid) => TmEvent::LazyDurable { tid },
                LazyWait::Durable => TmEvent::Durable { upto: durable },
            };
            self.step(i, ev);
        }
    }

    /// The KV store's part in prepare (as `weft_kv`'s resource): log the write set and vote.
    fn prepare_local(&mut self, i: usize, tid: Tid, aborted: &[weft_wire::SubPath]) -> Vote {
        let node = &mut self.nodes[i];
        let Some(log) = node.log.clone() else {
            return Vote::No("node down".into());
        };
        let prepared = node.store.prepare(tid, aborted, |writes| {
            KvRecord::append_prepared(&log, tid, writes)
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

    fn on_msg(&mut self, i: usize, from_ix: usize, msg: Msg) {
        let from = self.nodes[from_ix].id;
        match msg {
            Msg::Tx(m) => self.on_tx_msg(i, from_ix, m),
            Msg::Call { ctx, call, ops } => self.on_call(i, from_ix, ctx, call, ops),
            Msg::Reply {
                tid, call, result, ..
            } => self.on_reply(i, from, tid, call, result),
        }
    }

    fn on_tx_msg(&mut self, i: usize, from_ix: usize, msg: TxMsg) {
        let from = self.nodes[from_ix].id;
        if self.cfg.sabotage == Sabotage::CommitForgotten {
            if let (TxMsg::Inquire { tid }, Some(tm)) = (&msg, &self.nodes[i].tm) {
                if !tm.is_live(*tid) && tm.finished_outcome(*tid).is_none() {
                    let tid = *tid;
                    let answer = Answer::Committed;
                    return self.send_tx(i, from, TxMsg::Outcome { tid, answer });
                }
            }
        }
        // The transport knows the sender's incarnation from its membership view.
        let from_incarnation = self.nodes[from_ix].inc;
        self.step(
            i,
            TmEvent::Msg {
                from,
                from_incarnation,
                msg,
            },
        );
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
            let cur = node
                .store
                .read(&xid, key)
                .expect("the memory engine reads without failing");
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

    fn on_call(&mut self, i: usize, from_ix: usize, ctx: TxContext, call: u64, ops: Vec<Op>) {
        let from = self.nodes[from_ix].id;
        let tid = ctx.tid;
        let now = self.instant();
        let node = &mut self.nodes[i];
        if node.calls.get(&tid).is_some_and(|c| c.contains(&call)) {
            return; // a duplicate: it ran already
        }
        let Some(tm) = node.tm.as_mut() else {
            return;
        };
        let mut out = Vec::new();
        let joined = tm.call_in(now, &ctx, from, true, Some(KvRes), CallId(call), &mut out);
        self.carry_out(i, out);
        if !self.nodes[i].up {
            return;
        }
        let result = match joined {
            Ok(CallIn::Joined) => {
                self.nodes[i].calls.entry(tid).or_default().insert(call);
                let r = self.run_ops(i, tid, &ops);
                self.step(i, TmEvent::CallDone { tid });
                r
            }
            Ok(CallIn::Enlisting) => Err("a member's call is never enlisted".to_string()),
            Err(f) => Err(f.to_string()),
        };
        if !self.nodes[i].up || self.point(i, CrashPoint::ParticipantAfterCall) {
            return;
        }
        self.send(i, from_ix, Msg::Reply { tid, call, result });
    }

    fn on_reply(
        &mut self,
        i: usize,
        from: NodeId,
        tid: Tid,
        call: u64,
        result: Result<Vec<i64>, String>,
    ) {
        let node = &mut self.nodes[i];
        let Some(client) = node.clients.get_mut(&tid) else {
            return;
        };
        if client.decided || !client.pending.remove(&call) {
            return;
        }
        match result {
            Ok(vals) => {
                client.reads.extend(vals);
                if client.pending.is_empty() {
                    client.decided = true;
                    self.commit(i, tid);
                }
            }
            Err(e) => self.client_abort(i, tid, format!("call to n{}: {e}", from.0)),
        }
    }

    fn commit(&mut self, i: usize, tid: Tid) {
        self.step(
            i,
            TmEvent::Commit {
                tid,
                waiter: WaiterId(tid.seq),
            },
        );
    }

    fn client_abort(&mut self, i: usize, tid: Tid, reason: String) {
        if let Some(c) = self.nodes[i].clients.get_mut(&tid) {
            c.decided = true;
        }
        self.hist(|| format!("n{} {tid} client aborts: {reason}", i + 1));
        self.step(i, TmEvent::Abort { tid, reason });
        // The commit call answers the client: an abort before it reports here.
        self.commit(i, tid);
    }

    fn start_tx(&mut self) {
        let up: Vec<usize> = (0..self.nodes.len())
            .filter(|&i| self.nodes[i].up)
            .collect();
        if up.is_empty() {
            return;
        }
        let c = up[self.rng.gen_range(0..up.len())];
        let now = self.instant();
        let Some(tm) = self.nodes[c].tm.as_mut() else {
            return;
        };
        let tid = match tm.begin(now, Some(TX_TIMEOUT)) {
            Ok(tid) => tid,
            Err(refused) => {
                let detail = refused.failure.to_string();
                self.hist(|| format!("n{} begin refused: {detail}", c + 1));
                return;
            }
        };
        let (kind, plan) = self.check.plan(&mut self.rng, tid, self.nodes.len());
        self.hist(|| format!("n{} begin {tid} {kind:?}", c + 1));
        self.nodes[c].clients.insert(
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
                let enlisted = match self.nodes[c].tm.as_mut() {
                    Some(tm) => tm.enlist(tid, KvRes),
                    None => return,
                };
                if let Err(f) = enlisted {
                    return self.client_abort(c, tid, f.to_string());
                }
                match self.run_ops(c, tid, &ops) {
                    Ok(vals) => {
                        if let Some(cl) = self.nodes[c].clients.get_mut(&tid) {
                            cl.reads.extend(vals);
                        }
                    }
                    Err(e) => return self.client_abort(c, tid, e),
                }
            } else {
                let (to, to_inc) = (self.nodes[target].id, self.nodes[target].inc);
                let Some(tm) = self.nodes[c].tm.as_mut() else {
                    return;
                };
                if let Err(f) = tm.call_out(tid, to, to_inc) {
                    return self.client_abort(c, tid, f.to_string());
                }
                let budget_us = tm
                    .deadline(tid)
                    .map(|d| d.saturating_duration_since(now).as_micros() as u64);
                let call = self.next_call;
                self.next_call += 1;
                if let Some(cl) = self.nodes[c].clients.get_mut(&tid) {
                    cl.pending.insert(call);
                }
                let ctx = TxContext {
                    tid,
                    path: SubPath::top(),
                    budget_us,
                    baggage: Default::default(),
                };
                self.send(c, target, Msg::Call { ctx, call, ops });
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
            self.commit(c, tid);
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
            let stuck: Vec<String> =
                n.tm.as_ref()
                    .map(|tm| {
                        tm.list()
                            .into_iter()
                            .map(|t| format!("{} {}", t.tid, t.phase))
                            .collect()
                    })
                    .unwrap_or_default();
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
