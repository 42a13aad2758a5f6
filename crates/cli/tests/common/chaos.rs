//! The chaos harness: Raid sites as real `weft raid site` processes, loaded
//! with `weft raid load`, under DebitCredit load from one `weft raid run
//! --acks`, while a seeded schedule of faults runs: sites killed with
//! SIGKILL and restarted from their data directories (one, the one the
//! client was pointed at, two, all), and, when network namespaces can be
//! had, a site partitioned from the others. Then the checks of
//! docs/chaos.md: liveness from the client's acknowledgements, the audit at
//! every site, every copy equal, and every acknowledged transaction present
//! on every copy.
//!
//! Owns the schedule (every choice from one seed) and the checks. Must kill
//! every process it started and remove every namespace, interface and
//! directory it made, on failure too (Drop), and must report a failure with
//! the seed, the schedule and the evidence.

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::Value;

use crate::common::free_port;
use crate::netns::Net;

const SECRET: &str = "weft-chaos";
/// The failure detector of every site: probe often, declare death fast.
/// A debug build gets 2 s: its `weft raid load` keeps a site from sending
/// heartbeats for more than 500 ms (the sites then declare each other dead
/// before the first transaction).
const DETECTOR: [&str; 4] = [
    "--heartbeat",
    "50ms",
    "--dead-after",
    if cfg!(debug_assertions) {
        "2s"
    } else {
        "500ms"
    },
];
/// The port every site listens on inside its namespace.
const NS_PORT: u16 = 7000;
/// Longest a site may take to print its ready line (start or restart).
const READY_LIMIT: Duration = Duration::from_secs(30);
/// While every site is up, the longest stretch allowed without a commit.
pub const MAX_STALL: Duration = Duration::from_secs(5);
/// After the last heal, throughput must be back to half its level before
/// the first fault within this long.
pub const RECOVERY_LIMIT: Duration = Duration::from_secs(5);

/// The weft binary under test.
fn weft_bin() -> &'static str {
    env!("CARGO_BIN_EXE_weft")
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock after 1970")
        .as_millis() as u64
}

/// splitmix64: a small, stable generator (the schedule of a seed must not
/// change with a dependency's version).
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo + 1)
    }

    /// A duration in `lo..=hi` ms.
    pub fn ms(&mut self, lo: u64, hi: u64) -> Duration {
        Duration::from_millis(self.range(lo, hi))
    }

    pub fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            let j = self.range(0, i as u64) as usize;
            v.swap(i, j);
        }
    }
}

/// One fault.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Fault {
    /// SIGKILL these sites, restart them from their data directories.
    Kill(Vec<usize>),
    /// Cut this site off from every other site (the client still reaches
    /// it), then heal.
    Isolate(usize),
}

impl std::fmt::Display for Fault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Fault::Kill(s) if s.len() == 1 && s[0] == 1 => {
                write!(f, "kill site 1 (the client's --node)")
            }
            Fault::Kill(s) => write!(f, "kill sites {s:?}"),
            Fault::Isolate(s) => write!(f, "partition site {s} from the other sites"),
        }
    }
}

/// A fault, how long it lasts, and the quiet time after it is healed.
#[derive(Clone, Debug)]
pub struct Step {
    pub fault: Fault,
    pub down: Duration,
    pub gap: Duration,
}

/// Settings of one chaos run.
#[derive(Clone, Debug)]
pub struct Options {
    pub seed: u64,
    pub sites: usize,
    pub clients: usize,
    /// Load before the first fault (the throughput baseline).
    pub warmup: Duration,
    /// Time the faults (and the gaps between them) take, roughly.
    pub fault_time: Duration,
    /// Load after the last heal.
    pub tail: Duration,
    /// Put the sites in network namespaces and include partitions.
    pub partitions: bool,
    /// Only these kinds of fault (all of [`KINDS`] when empty).
    pub kinds: Vec<String>,
    /// Start a new `weft raid run` after every heal (a diagnostic mode that
    /// hides the client's own reconnects, to see what lies beyond them).
    pub fresh_client: bool,
}

/// The kinds of fault: kill one site (not site 1), kill site 1 (the one
/// the client's --node names), kill several, kill all, partition one site
/// from the others (in namespaces only).
pub const KINDS: [&str; 5] = ["one", "gateway", "several", "all", "isolate"];

/// The faults of a seed: kinds in seeded shuffled rounds, each fault
/// lasting 1-2.5 s and followed by 5.5-8 s of every site up (longer than
/// [`MAX_STALL`], so that a stall after any heal shows), until
/// `opts.fault_time` is used and at least one round (one fault of each
/// kind) is done.
pub fn schedule(opts: &Options) -> Vec<Step> {
    let mut rng = Rng::new(opts.seed);
    let n = opts.sites as u64;
    let kinds: Vec<&str> = KINDS
        .iter()
        .copied()
        .filter(|k| opts.partitions || *k != "isolate")
        .filter(|k| opts.kinds.is_empty() || opts.kinds.iter().any(|w| w == k))
        .collect();
    assert!(!kinds.is_empty(), "no kind of fault left to run");
    let mut steps = Vec::new();
    let mut used = Duration::ZERO;
    'rounds: loop {
        let mut round = kinds.clone();
        rng.shuffle(&mut round);
        for kind in round {
            let fault = match kind {
                "one" => Fault::Kill(vec![rng.range(2, n) as usize]),
                "gateway" => Fault::Kill(vec![1]),
                "several" => {
                    let mut all: Vec<usize> = (1..=opts.sites).collect();
                    rng.shuffle(&mut all);
                    let k = rng.range(2, (n - 1).max(2)) as usize;
                    let mut some = all[..k.min(all.len())].to_vec();
                    some.sort();
                    Fault::Kill(some)
                }
                "all" => Fault::Kill((1..=opts.sites).collect()),
                _ => Fault::Isolate(rng.range(1, n) as usize),
            };
            let step = Step {
                fault,
                down: rng.ms(1000, 2500),
                gap: rng.ms(5500, 8000),
            };
            used += step.down + step.gap;
            steps.push(step);
            // At least one round: one fault of each kind.
            if used >= opts.fault_time && steps.len() >= kinds.len() {
                break 'rounds;
            }
        }
    }
    steps
}

/// A running `weft raid site`.
struct SiteProc {
    child: Child,
    /// Its stdout lines after the ready line.
    lines: mpsc::Receiver<String>,
}

/// Something that happened, for the report.
#[derive(Clone, Debug)]
struct Event {
    ms: u64,
    what: String,
    /// Every site up (and joined) from here on, until the next fault.
    all_up: bool,
}

/// A cluster under chaos; everything it started goes when it is dropped.
pub struct Chaos {
    opts: Options,
    steps: Vec<Step>,
    sites: Vec<Option<SiteProc>>,
    addrs: Vec<String>,
    run: Option<Child>,
    /// How many `weft raid run`s were started (the last one's files are
    /// run<runs-1>.out/.err, each one's acknowledgements acks<k>.jsonl).
    runs: usize,
    events: Vec<Event>,
    problems: Vec<String>,
    notes: Vec<String>,
    /// When the client's load stops (its --duration from its start).
    load_end_ms: u64,
    net: Option<Net>,
    dir: Option<tempfile::TempDir>,
}

impl Drop for Chaos {
    fn drop(&mut self) {
        if let Some(r) = &mut self.run {
            let _ = r.kill();
            let _ = r.wait();
        }
        for s in self.sites.iter_mut().flatten() {
            let _ = s.child.kill();
            let _ = s.child.wait();
        }
        // Then the namespaces and the directories.
        self.net.take();
        if std::env::var_os("WEFT_CHAOS_KEEP").is_some() {
            if let Some(d) = self.dir.take() {
                println!("kept {}", d.keep().display());
            }
        }
        self.dir.take();
    }
}

/// Runs `weft ARGS` to its end: (exit code, stdout, stderr).
fn weft(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(weft_bin())
        .args(args)
        .output()
        .expect("weft runs");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn tail(path: &Path, lines: usize) -> String {
    let s = std::fs::read_to_string(path).unwrap_or_default();
    let v: Vec<&str> = s.lines().collect();
    v[v.len().saturating_sub(lines)..].join("\n")
}

/// JSON lines with their time (ms since the epoch).
type Lines = Vec<(u64, Value)>;

/// What identifies a tpcb transaction's history row.
pub type RowKey = (u64, u64, u64, i64);

impl Chaos {
    /// Starts the sites (in namespaces when `opts.partitions`).
    ///
    /// Fails when namespaces cannot be made (the caller then runs without
    /// partitions).
    pub fn new(opts: Options, net: Option<Net>) -> Chaos {
        let dir = tempfile::tempdir().expect("tempdir");
        let addrs = (1..=opts.sites)
            .map(|i| match &net {
                Some(n) => format!("{}:{NS_PORT}", n.addr(i)),
                None => format!("127.0.0.1:{}", free_port()),
            })
            .collect();
        let steps = schedule(&opts);
        Chaos {
            sites: (0..opts.sites).map(|_| None).collect(),
            opts,
            steps,
            addrs,
            run: None,
            runs: 0,
            events: Vec::new(),
            problems: Vec::new(),
            notes: Vec::new(),
            load_end_ms: u64::MAX,
            net,
            dir: Some(dir),
        }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.as_ref().expect("dir").path().join(name)
    }

    fn log_of(&self, id: usize) -> PathBuf {
        self.path(&format!("site{id}.log"))
    }

    /// The schedule, one line per step.
    pub fn schedule_text(&self) -> String {
        let mut s = String::new();
        for (i, st) in self.steps.iter().enumerate() {
            let _ = writeln!(
                s,
                "  {}. {} for {:.1} s, then {:.1} s with every site up",
                i + 1,
                st.fault,
                st.down.as_secs_f64(),
                st.gap.as_secs_f64()
            );
        }
        s
    }

    /// Starts site `id` and waits for its ready line.
    fn start_site(&mut self, id: usize) -> Result<String, String> {
        let data = self.path(&format!("site{id}"));
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_of(id))
            .expect("site log");
        let mut cmd = match &self.net {
            Some(n) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", &n.ns(id), weft_bin()]);
                // TCP only: shared memory would link the namespaces
                // around any partition.
                c.env("WEFT_SHM", "off");
                c
            }
            None => Command::new(weft_bin()),
        };
        // The sites' log filter (WEFT_LOG syntax); warnings by default.
        if let Ok(filter) = std::env::var("WEFT_CHAOS_LOG") {
            cmd.env("WEFT_LOG", filter);
        }
        cmd.args(["raid", "site", "--id", &id.to_string()])
            .args(["--listen", &self.addrs[id - 1]])
            .args(["--data-dir", &data.display().to_string()])
            .args(["--secret", SECRET])
            .args(DETECTOR);
        if self.net.is_some() {
            cmd.arg("--no-shm");
        }
        if id != 1 {
            cmd.args(["--join", &self.addrs[0]]);
        }
        let mut child = cmd
            .stdout(Stdio::piped())
            .stderr(Stdio::from(log))
            .spawn()
            .map_err(|e| format!("site {id} did not spawn: {e}"))?;
        let stdout = child.stdout.take().expect("piped");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { return };
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        let deadline = Instant::now() + READY_LIMIT;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left) {
                Ok(l) if l.contains(" listening on ") => {
                    self.sites[id - 1] = Some(SiteProc { child, lines: rx });
                    return Ok(l);
                }
                Ok(_) => continue,
                Err(_) => {
                    let _ = child.kill();
                    let status = child.wait().ok();
                    return Err(format!(
                        "site {id} printed no ready line within {READY_LIMIT:?} (exit {status:?}); its log ends:\n{}",
                        tail(&self.log_of(id), 15)
                    ));
                }
            }
        }
    }

    fn kill_site(&mut self, id: usize) {
        if let Some(mut s) = self.sites[id - 1].take() {
            let _ = s.child.kill();
            let _ = s.child.wait();
        }
    }

    /// The Raid sites site `at` holds alive.
    fn live_at(&self, at: usize) -> Option<Vec<u64>> {
        let (code, out, _) = weft(&[
            "status",
            "--node",
            &self.addrs[at - 1],
            "--secret",
            SECRET,
            "--json",
            "--timeout",
            "2s",
        ]);
        let v: Value = serde_json::from_str(&out).ok().filter(|_| code == 0)?;
        let mut live: Vec<u64> = v["nodes"]
            .as_array()?
            .iter()
            .filter(|n| n["alive"] == true)
            .filter(|n| {
                n["services"]
                    .as_array()
                    .is_some_and(|s| s.iter().any(|x| x == "raid"))
            })
            .filter_map(|n| n["id"].as_u64())
            .collect();
        live.sort();
        Some(live)
    }

    /// Waits (bounded) until every site sees every site alive.
    fn wait_joined(&self, limit: Duration) -> Result<(), String> {
        let want: Vec<u64> = (1..=self.opts.sites as u64).collect();
        let deadline = Instant::now() + limit;
        loop {
            let views: Vec<Option<Vec<u64>>> =
                (1..=self.opts.sites).map(|i| self.live_at(i)).collect();
            if views.iter().all(|v| v.as_ref() == Some(&want)) {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(format!(
                    "the sites' views never all showed sites {want:?} alive within {limit:?}: {}",
                    views
                        .iter()
                        .enumerate()
                        .map(|(i, v)| format!("site {} sees {v:?}", i + 1))
                        .collect::<Vec<_>>()
                        .join(", ")
                ));
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    fn event(&mut self, what: String, all_up: bool) {
        self.event_at(now_ms(), what, all_up);
    }

    /// An event that began at `ms` (before the action it names).
    fn event_at(&mut self, ms: u64, what: String, all_up: bool) {
        println!("  [{}] {what}", self.rel(ms));
        self.events.push(Event { ms, what, all_up });
    }

    /// `t+S.SSS s` from the start of the run.
    fn rel(&self, ms: u64) -> String {
        match self.events.first() {
            Some(e) => format!("t+{:.3}s", (ms as f64 - e.ms as f64) / 1000.0),
            None => "t+0".into(),
        }
    }

    /// Runs the whole thing; returns the problems found (empty: passed).
    pub fn run(mut self) -> Vec<String> {
        let o = self.opts.clone();
        println!(
            "chaos seed {} ({} sites, {} clients, {}): schedule\n{}",
            o.seed,
            o.sites,
            o.clients,
            match (o.partitions, o.fresh_client) {
                (true, false) => "kills and partitions, TCP only",
                (false, false) => "kills only",
                (true, true) => "kills and partitions, TCP only, a new client after each heal",
                (false, true) => "kills only, a new client after each heal",
            },
            self.schedule_text()
        );
        for id in 1..=o.sites {
            if let Err(e) = self.start_site(id) {
                return self.fail(vec![format!("set-up: {e}")]);
            }
        }
        if let Err(e) = self.wait_joined(Duration::from_secs(30)) {
            return self.fail(vec![format!("set-up: {e}")]);
        }
        let (code, out, err) = weft(&[
            "raid",
            "load",
            "--node",
            &self.addrs[0],
            "--secret",
            SECRET,
            "--timeout",
            "60s",
        ]);
        if code != 0 {
            return self.fail(vec![format!("set-up: weft raid load failed: {out}{err}")]);
        }
        println!("  {}", out.trim());

        // The load, long enough for the schedule and the tail.
        let planned: Duration = self.steps.iter().map(|s| s.down + s.gap).sum();
        let duration = o.warmup + planned + o.tail + Duration::from_secs(2);
        self.start_run(duration);
        let started = Instant::now();
        self.event("weft raid run started".into(), true);
        self.load_end_ms = now_ms() + duration.as_millis() as u64;

        // The schedule: each step at its time, late when a restart was slow.
        let mut at = o.warmup;
        let steps = self.steps.clone();
        for (i, st) in steps.iter().enumerate() {
            sleep_until(started + at);
            self.snapshot_transactions(&format!("before fault {}", i + 1));
            match &st.fault {
                Fault::Kill(ids) => {
                    let ms = now_ms();
                    for id in ids {
                        self.kill_site(*id);
                    }
                    self.event_at(ms, format!("fault {}: {}", i + 1, st.fault), false);
                    std::thread::sleep(st.down);
                    // Site 1 first: the others join through it.
                    let mut up = true;
                    for id in ids {
                        if let Err(e) = self.start_site(*id) {
                            self.problems
                                .push(format!("restart after fault {}: {e}", i + 1));
                            up = false;
                        }
                    }
                    self.event(format!("heal {}: sites {ids:?} restarted", i + 1), up);
                    self.fresh_client();
                }
                Fault::Isolate(id) => {
                    let ms = now_ms();
                    let net = self.net.as_mut().expect("partitions need namespaces");
                    if let Err(e) = net.isolate(*id) {
                        self.problems.push(format!("partition {}: {e}", i + 1));
                    }
                    self.event_at(ms, format!("fault {}: {}", i + 1, st.fault), false);
                    std::thread::sleep(st.down);
                    let healed = self.net.as_mut().expect("namespaces").heal();
                    if let Err(e) = healed {
                        self.problems.push(format!("heal {}: {e}", i + 1));
                    }
                    self.event(format!("heal {}: partition removed", i + 1), true);
                    self.fresh_client();
                }
            }
            at = started.elapsed() + st.gap;
        }

        // The run ends on its own: its duration plus the call timeout.
        let limit = duration + Duration::from_secs(30);
        let exit = loop {
            let r = self.run.as_mut().expect("run");
            if let Some(s) = r.try_wait().expect("try_wait") {
                break Some(s);
            }
            if started.elapsed() > limit {
                let _ = r.kill();
                let _ = r.wait();
                break None;
            }
            std::thread::sleep(Duration::from_millis(100));
        };
        self.run = None;
        self.snapshot_transactions("when the run ended");
        let end_ms = now_ms();
        self.event("weft raid run ended".into(), true);
        let out = std::fs::read_to_string(self.run_file("out")).unwrap_or_default();
        let err = std::fs::read_to_string(self.run_file("err")).unwrap_or_default();
        match exit {
            None => self.problems.push(format!(
                "weft raid run still running {limit:?} after it started (a {duration:?} run): a hang; stderr ends:\n{}",
                tail(&self.run_file("err"), 10)
            )),
            Some(s) if !s.success() => self.problems.push(format!(
                "weft raid run exited {s}; stderr ends:\n{}",
                tail(&self.run_file("err"), 10)
            )),
            Some(_) => match serde_json::from_str::<Value>(&out) {
                Ok(v) => self.notes.push(format!(
                    "run: {} committed of {} attempts; aborts {}; e.g. {}",
                    v["committed"], v["attempts"], v["aborts"], v["abort_samples"]
                )),
                Err(e) => self
                    .problems
                    .push(format!("weft raid run printed no report ({e}): {out}{err}")),
            },
        }
        let (mut acked, mut failures) = (Vec::new(), Vec::new());
        for k in 0..self.runs {
            let (a, f) = read_acks(&self.path(&format!("acks{k}.jsonl")));
            acked.extend(a);
            failures.extend(f);
        }
        self.note_failures(&failures);
        self.check_liveness(&acked, end_ms);
        if let Err(e) = self.wait_joined(Duration::from_secs(20)) {
            self.problems.push(format!("membership after the run: {e}"));
        }
        self.check_fresh_client();
        self.check_copies(&acked);
        let problems = std::mem::take(&mut self.problems);
        if problems.is_empty() {
            for n in &self.notes {
                println!("  {n}");
            }
            println!("chaos seed {}: every check passed", o.seed);
            problems
        } else {
            self.fail(problems)
        }
    }

    /// Notes the transactions live at every site (`weft tx list`): how
    /// many, by phase, how many in doubt, the oldest. A wedge shows as
    /// transactions that stay.
    fn snapshot_transactions(&mut self, when: &str) {
        let mut s = format!("transactions live {when}:");
        for i in 1..=self.opts.sites {
            let (code, out, err) = weft(&[
                "tx",
                "list",
                "--node",
                &self.addrs[i - 1],
                "--secret",
                SECRET,
                "--json",
                "--timeout",
                "2s",
            ]);
            let list: Option<Vec<Value>> = serde_json::from_str(&out).ok().filter(|_| code == 0);
            let Some(list) = list else {
                let _ = write!(s, " site {i}: no answer ({});", err.trim());
                continue;
            };
            let mut phases: BTreeMap<String, usize> = BTreeMap::new();
            for t in &list {
                *phases
                    .entry(t["phase"].as_str().unwrap_or("?").to_string())
                    .or_default() += 1;
            }
            let in_doubt = list.iter().filter(|t| t["in_doubt"] == true).count();
            let oldest = list
                .iter()
                .max_by_key(|t| t["age_ms"].as_u64().unwrap_or(0))
                .map(|t| format!(", oldest {} {} ms {}", t["tid"], t["age_ms"], t["phase"]))
                .unwrap_or_default();
            let _ = write!(
                s,
                " site {i}: {} {phases:?}, {in_doubt} in doubt{oldest};",
                list.len()
            );
        }
        self.notes.push(s);
    }

    /// Starts `weft raid run` for `duration`, writing its acknowledgements
    /// to acks<k>.jsonl.
    fn start_run(&mut self, duration: Duration) {
        let k = self.runs;
        self.runs += 1;
        let acks = self.path(&format!("acks{k}.jsonl"));
        let run_out = std::fs::File::create(self.run_file("out")).unwrap();
        let run_err = std::fs::File::create(self.run_file("err")).unwrap();
        let run = Command::new(weft_bin())
            .args(["raid", "run", "--node", &self.addrs[0], "--secret", SECRET])
            .args(["--clients", &self.opts.clients.to_string()])
            .args(["--duration", &format!("{}ms", duration.as_millis())])
            .args(["--seed", &self.opts.seed.wrapping_add(k as u64).to_string()])
            .args(["--json", "--acks", &acks.display().to_string()])
            .stdout(Stdio::from(run_out))
            .stderr(Stdio::from(run_err))
            .spawn()
            .expect("weft raid run starts");
        self.run = Some(run);
    }

    /// The last `weft raid run`'s stdout ("out") or stderr ("err").
    fn run_file(&self, which: &str) -> PathBuf {
        self.path(&format!("run{}.{which}", self.runs.saturating_sub(1)))
    }

    /// In the fresh-client mode, replaces the client with a new one for the
    /// rest of the load.
    fn fresh_client(&mut self) {
        if !self.opts.fresh_client {
            return;
        }
        if let Some(mut r) = self.run.take() {
            let _ = r.kill();
            let _ = r.wait();
        }
        let left = self.load_end_ms.saturating_sub(now_ms()).max(1000);
        self.start_run(Duration::from_millis(left));
        self.event("a new weft raid run replaces the client".into(), true);
    }

    /// Notes the client's failed attempts between one event and the next,
    /// by the site it called and the status (with the last detail).
    fn note_failures(&mut self, failures: &[(u64, Value)]) {
        let mut s =
            String::from("failed attempts by phase (site it called: status x count, last detail):");
        for (i, e) in self.events.iter().enumerate() {
            let end = self.events.get(i + 1).map(|n| n.ms).unwrap_or(u64::MAX);
            let mut by: BTreeMap<(u64, String), (u64, String)> = BTreeMap::new();
            for (_, f) in failures.iter().filter(|(ms, _)| *ms >= e.ms && *ms < end) {
                let k = (
                    f["site"].as_u64().unwrap_or(0),
                    f["failed"].as_str().unwrap_or("?").to_string(),
                );
                let v = by.entry(k).or_default();
                v.0 += f["n"].as_u64().unwrap_or(0);
                if let Some(d) = f["detail"].as_str().filter(|d| !d.is_empty()) {
                    v.1 = d.to_string();
                }
            }
            if by.is_empty() {
                continue;
            }
            let _ = write!(s, "\n    after \"{}\":", e.what);
            for ((site, status), (n, detail)) in by {
                let _ = write!(s, "\n      site {site}: {status} x{n} ({detail})");
            }
        }
        self.notes.push(s);
    }

    /// Prints the report of a failed run; returns its problems.
    fn fail(&mut self, problems: Vec<String>) -> Vec<String> {
        let mut r = String::new();
        let _ = writeln!(
            r,
            "\n==== chaos seed {} FAILED ({} problems) ====\nreplay: WEFT_CHAOS_SEED={} cargo test --release -p weft-cli --test chaos -- --nocapture\nschedule:\n{}events:",
            self.opts.seed,
            problems.len(),
            self.opts.seed,
            self.schedule_text()
        );
        for e in &self.events {
            let _ = writeln!(r, "  {} {}", self.rel(e.ms), e.what);
        }
        for n in &self.notes {
            let _ = writeln!(r, "note: {n}");
        }
        for (i, p) in problems.iter().enumerate() {
            let _ = writeln!(r, "problem {}: {p}", i + 1);
        }
        for id in 1..=self.opts.sites {
            let _ = writeln!(
                r,
                "--- site {id} log (last 12 lines):\n{}",
                tail(&self.log_of(id), 12)
            );
        }
        let _ = writeln!(
            r,
            "--- weft raid run stderr (last 12 lines):\n{}",
            tail(&self.run_file("err"), 12)
        );
        println!("{r}");
        problems
    }

    /// The liveness checks: while every site is up, no stretch of
    /// [`MAX_STALL`] without a commit; after the last heal, a second with at
    /// least half the commits per second before the first fault, starting
    /// within [`RECOVERY_LIMIT`].
    fn check_liveness(&mut self, acked: &[(u64, Value)], end_ms: u64) {
        let times: Vec<u64> = {
            let mut t: Vec<u64> = acked.iter().map(|(ms, _)| *ms).collect();
            t.sort();
            t
        };
        let start = self.events[0].ms;
        let count = |a: u64, b: u64| times.iter().filter(|t| **t >= a && **t < b).count() as u64;
        // Per second from the start, with the faults and heals marked.
        let secs = (end_ms.saturating_sub(start)).div_ceil(1000);
        let mut line = String::new();
        for s in 0..secs {
            let (a, b) = (start + s * 1000, start + (s + 1) * 1000);
            let mark: String = self
                .events
                .iter()
                .filter(|e| e.ms >= a && e.ms < b)
                .filter_map(|e| {
                    e.what
                        .split(':')
                        .next()
                        .filter(|w| w.starts_with("fault") || w.starts_with("heal"))
                        .map(|w| format!("[{w}]"))
                })
                .collect();
            let _ = write!(line, "{mark}{} ", count(a, b));
        }
        self.notes
            .push(format!("commits per second from t+0: {}", line.trim_end()));
        let Some(first_fault) = self.events.iter().find(|e| !e.all_up).map(|e| e.ms) else {
            return;
        };
        // The baseline: from 1 s in (connections made) to the first fault.
        let base_from = start + 1000;
        let base = count(base_from, first_fault) as f64
            / ((first_fault.saturating_sub(base_from)) as f64 / 1000.0).max(0.001);
        self.notes
            .push(format!("throughput before the first fault: {base:.0} tps"));
        if base < 1.0 {
            self.problems.push(format!(
                "liveness: no throughput before the first fault ({base:.1} tps)"
            ));
            return;
        }
        // Stretches with every site up: from a heal (or the start) to the
        // next fault (or the end of the run).
        let mut windows = Vec::new();
        let mut open = Some(base_from);
        for e in &self.events[1..] {
            match (e.all_up, open) {
                (false, Some(a)) => {
                    windows.push((a, e.ms));
                    open = None;
                }
                (true, None) => open = Some(e.ms),
                _ => {}
            }
        }
        if let Some(a) = open {
            // The clients stop at their duration (a little after it, as
            // they start a little after the process).
            windows.push((a, end_ms.min(self.load_end_ms)));
        }
        for (a, b) in windows {
            let mut last = a;
            let mut worst = (0, a);
            for t in times.iter().copied().filter(|t| *t >= a && *t < b) {
                if t - last > worst.0 {
                    worst = (t - last, last);
                }
                last = t;
            }
            if b.saturating_sub(last) > worst.0 {
                worst = (b - last, last);
            }
            if worst.0 > MAX_STALL.as_millis() as u64 {
                self.problems.push(format!(
                    "liveness: every site up from {} to {}, but no commit for {:.1} s from {} ({} commits in that stretch)",
                    self.rel(a),
                    self.rel(b),
                    worst.0 as f64 / 1000.0,
                    self.rel(worst.1),
                    count(a, b)
                ));
            }
        }
        // Recovery after the last heal.
        let last_heal = self
            .events
            .iter()
            .rev()
            .find(|e| e.what.starts_with("heal"))
            .map(|e| e.ms);
        if let Some(h) = last_heal {
            let want = (base / 2.0).ceil() as u64;
            let back = (0..=(RECOVERY_LIMIT.as_millis() as u64 - 1000) / 100)
                .map(|k| h + k * 100)
                .find(|t| count(*t, t + 1000) >= want);
            let after: Vec<String> = (0..8)
                .map(|s| count(h + s * 1000, h + (s + 1) * 1000).to_string())
                .collect();
            match back {
                Some(t) => self.notes.push(format!(
                    "throughput back to >= {want}/s {:.1} s after the last heal (per second after it: {})",
                    (t - h) as f64 / 1000.0,
                    after.join(" ")
                )),
                None => self.problems.push(format!(
                    "liveness: after the last heal at {}, no second with >= {want} commits (half of {base:.0} tps) starting within {:.0} s; commits per second after it: {}",
                    self.rel(h),
                    (RECOVERY_LIMIT.as_millis() as f64 - 1000.0) / 1000.0,
                    after.join(" ")
                )),
            }
        }
    }

    /// Commits resume for a new client: a short `weft raid run` after the
    /// schedule commits (telling a stall of the sites from one of the
    /// long-running client's links).
    fn check_fresh_client(&mut self) {
        let (code, out, err) = weft(&[
            "raid",
            "run",
            "--node",
            &self.addrs[0],
            "--secret",
            SECRET,
            "--clients",
            &self.opts.clients.to_string(),
            "--duration",
            "3s",
            "--seed",
            &self.opts.seed.wrapping_add(1).to_string(),
            "--json",
        ]);
        let v: Option<Value> = serde_json::from_str(&out).ok().filter(|_| code == 0);
        match v {
            Some(v) if v["committed"].as_u64().unwrap_or(0) > 0 => self.notes.push(format!(
                "a new client after the schedule: {} committed in 3 s of {} attempts, aborts {}",
                v["committed"], v["attempts"], v["aborts"]
            )),
            Some(v) => self.problems.push(format!(
                "commits resume: a new client after the schedule committed nothing in 3 s ({} attempts, aborts {}, e.g. {})",
                v["attempts"], v["aborts"], v["abort_samples"]
            )),
            None => self.problems.push(format!(
                "commits resume: a new client after the schedule failed (exit {code}): {}",
                err.trim()
            )),
        }
    }

    /// The safety checks: the audit passes at every site and every copy is
    /// the same (within a bound: phase two reaches the copies after the
    /// client's answer); every acknowledged transaction has its history row
    /// on every copy.
    fn check_copies(&mut self, acked: &[(u64, Value)]) {
        let deadline = Instant::now() + Duration::from_secs(30);
        let last = loop {
            let audits: Vec<(usize, i32, Option<Value>, String)> = (1..=self.opts.sites)
                .map(|i| {
                    let (code, out, err) = weft(&[
                        "raid",
                        "audit",
                        "--node",
                        &self.addrs[i - 1],
                        "--secret",
                        SECRET,
                        "--json",
                    ]);
                    (i, code, serde_json::from_str(&out).ok(), err)
                })
                .collect();
            let ok = audits.iter().all(|(_, code, v, _)| {
                *code == 0
                    && v.as_ref().is_some_and(|v| {
                        v["passed"] == true
                            && v["sites"].as_object().map(|s| s.len()) == Some(self.opts.sites)
                    })
            }) && audits.windows(2).all(|w| w[0].2 == w[1].2);
            if ok || Instant::now() >= deadline {
                break (ok, audits);
            }
            std::thread::sleep(Duration::from_millis(500));
        };
        let (ok, audits) = last;
        if !ok {
            let mut s = String::from(
                "audit: within 30 s, the audit never passed at every site with every copy equal; last answers:",
            );
            for (i, code, v, err) in &audits {
                let _ = write!(s, "\n  at site {i} (exit {code}): ");
                match v {
                    Some(v) => {
                        let _ = write!(s, "passed {}, problems {}", v["passed"], v["problems"]);
                        for (id, c) in v["sites"].as_object().into_iter().flatten() {
                            let _ = write!(
                                s,
                                "\n    copy {id}: balances {}, history rows {}, history sums {}",
                                c["balances"], c["history_rows"], c["history_sums"]
                            );
                        }
                    }
                    None => {
                        let _ = write!(s, "{}", err.trim());
                    }
                }
            }
            self.problems.push(s);
        }

        // Every copy's history rows.
        let mut copies: BTreeMap<usize, Vec<Value>> = BTreeMap::new();
        for i in 1..=self.opts.sites {
            let (code, out, err) = weft(&[
                "raid",
                "history",
                "--node",
                &self.addrs[i - 1],
                "--secret",
                SECRET,
            ]);
            if code != 0 {
                self.problems.push(format!(
                    "history: weft raid history at site {i} failed (exit {code}): {}",
                    err.trim()
                ));
                continue;
            }
            copies.insert(
                i,
                out.lines()
                    .filter_map(|l| serde_json::from_str(l).ok())
                    .collect(),
            );
        }
        let mut digests = Vec::new();
        for (i, rows) in &copies {
            let mut keys: Vec<u64> = rows.iter().filter_map(|r| r["key"].as_u64()).collect();
            keys.sort();
            let mut h: u64 = 0xcbf2_9ce4_8422_2325;
            for k in &keys {
                for b in k.to_le_bytes() {
                    h ^= u64::from(b);
                    h = h.wrapping_mul(0x0000_0100_0000_01b3);
                }
            }
            digests.push(format!(
                "copy {i}: {} history rows, digest {h:016x}",
                keys.len()
            ));
        }
        self.notes.push(format!(
            "{} acknowledged; {}",
            acked.len(),
            digests.join("; ")
        ));
        // Rows some copy lacks.
        if let Some((_, first)) = copies.iter().next() {
            let all: BTreeMap<u64, &Value> = copies
                .values()
                .flatten()
                .filter_map(|r| Some((r["key"].as_u64()?, r)))
                .collect();
            let _ = first;
            for (i, rows) in &copies {
                let have: std::collections::BTreeSet<u64> =
                    rows.iter().filter_map(|r| r["key"].as_u64()).collect();
                let missing: Vec<String> = all
                    .iter()
                    .filter(|(k, _)| !have.contains(k))
                    .map(|(_, r)| format!("{} {}", r["tid"], key_str(key_of(r))))
                    .collect();
                if !missing.is_empty() {
                    self.problems.push(format!(
                        "copies differ: copy {i} lacks {} history rows other copies hold, e.g. {}",
                        missing.len(),
                        missing
                            .iter()
                            .take(8)
                            .cloned()
                            .collect::<Vec<_>>()
                            .join(", ")
                    ));
                }
            }
        }
        // Every acknowledged request has a row of its own on every copy.
        for (i, rows) in &copies {
            let missing = missing_acks(acked, rows);
            if !missing.is_empty() {
                let examples: Vec<String> = missing
                    .iter()
                    .take(10)
                    .map(|(ms, site, k)| {
                        format!(
                            "acked at {} ({}) by site {site}: {}",
                            self.rel(*ms),
                            self.phase_at(*ms),
                            key_str(*k)
                        )
                    })
                    .collect();
                self.problems.push(format!(
                    "lost commits: copy {i} lacks the history rows of {} of {} acknowledged transactions:\n    {}",
                    missing.len(),
                    acked.len(),
                    examples.join("\n    ")
                ));
            }
        }
    }

    /// What the schedule was doing at `ms`.
    fn phase_at(&self, ms: u64) -> String {
        self.events
            .iter()
            .rev()
            .find(|e| e.ms <= ms)
            .map(|e| format!("after \"{}\"", e.what))
            .unwrap_or_else(|| "before the run".into())
    }
}

/// The history row fields of a `weft raid history` line.
fn key_of(r: &Value) -> RowKey {
    (
        r["aid"].as_u64().unwrap_or(0),
        r["teller"].as_u64().unwrap_or(0),
        r["branch"].as_u64().unwrap_or(0),
        r["delta"].as_i64().unwrap_or(0),
    )
}

/// The history row fields an acknowledged tpcb request must have left.
fn ack_key(a: &Value) -> Option<RowKey> {
    let t = &a["req"]["Tpcb"];
    Some((
        t["aid"].as_u64()?,
        t["teller"].as_u64()?,
        t["branch"].as_u64()?,
        t["delta"].as_i64()?,
    ))
}

/// The acknowledgements (ms, line) that `rows` (one copy's `weft raid
/// history` lines) lack a row for, as (ms, answering site, fields), by
/// time: matched as a multiset, so two acknowledged equal requests need
/// two rows.
pub fn missing_acks(acked: &[(u64, Value)], rows: &[Value]) -> Vec<(u64, Value, RowKey)> {
    let mut want: BTreeMap<RowKey, Vec<&(u64, Value)>> = BTreeMap::new();
    for a in acked {
        if let Some(k) = ack_key(&a.1) {
            want.entry(k).or_default().push(a);
        }
    }
    let mut have: BTreeMap<RowKey, usize> = BTreeMap::new();
    for r in rows {
        *have.entry(key_of(r)).or_default() += 1;
    }
    let mut missing = Vec::new();
    for (k, acks) in &want {
        let h = have.get(k).copied().unwrap_or(0);
        for a in acks.iter().skip(h) {
            missing.push((a.0, a.1["site"].clone(), *k));
        }
    }
    missing.sort_by_key(|m| m.0);
    missing
}

fn key_str(k: RowKey) -> String {
    format!("aid {} teller {} branch {} delta {}", k.0, k.1, k.2, k.3)
}

fn sleep_until(t: Instant) {
    let now = Instant::now();
    if t > now {
        std::thread::sleep(t - now);
    }
}

/// The lines of `weft raid run --acks`: (ms, line) of the
/// acknowledgements, and of the failure counts.
fn read_acks(path: &Path) -> (Lines, Lines) {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter_map(|v| Some((v["ms"].as_u64()?, v)))
        .partition(|(_, v)| v.get("req").is_some())
}
