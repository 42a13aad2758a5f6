//! Raid with real processes: three `weft raid site` processes hold a copy of
//! every relation each; `weft raid run` drives DebitCredit clients while site
//! 3 is killed with SIGKILL (at a known point of the commit protocol, through
//! the `--crash-at` test hook, not at a random instant). While it is down,
//! transactions that need its copy end with HostDead or ProcDead within a
//! bounded time (no hang); once it restarts from its data directory it
//! recovers from its log, takes load again, and `weft raid audit` passes on
//! every copy.

mod common;

use std::io::Read;
use std::net::TcpListener;
use std::process::{Child, Stdio};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use common::*;
use serde_json::Value;

const SECRET: &str = "raid-process-test";
/// The failure detector of every site: probe often, declare death fast.
const DETECTOR: [&str; 4] = ["--heartbeat", "50ms", "--dead-after", "500ms"];
/// Seeds of the four runs (printed, so a failure can be replayed).
const SEEDS: [u64; 4] = [0x5eed_0001, 0x5eed_0002, 0x5eed_0003, 0x5eed_0004];

fn free_port() -> String {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().to_string()
}

/// A running `weft raid site` process, killed when dropped.
struct Site {
    child: Child,
    id: u32,
    /// What it printed on stdout after its ready line.
    lines: mpsc::Receiver<String>,
}

impl Site {
    /// Starts `weft raid site` and waits (bounded) for its ready line;
    /// returns the site and that line.
    fn start(
        id: u32,
        listen: &str,
        join: Option<&str>,
        data: &str,
        extra: &[&str],
    ) -> (Site, String) {
        let site = Site::spawn(id, listen, join, data, extra);
        let ready = site.wait_line(" listening on ", Duration::from_secs(30));
        (site, ready)
    }

    /// Starts `weft raid site` without waiting for its ready line.
    fn spawn(id: u32, listen: &str, join: Option<&str>, data: &str, extra: &[&str]) -> Site {
        let mut cmd = weft();
        cmd.args(["raid", "site", "--id", &id.to_string(), "--listen", listen])
            .args(["--data-dir", data, "--secret", SECRET])
            .args(DETECTOR)
            .args(extra);
        if let Some(j) = join {
            cmd.args(["--join", j]);
        }
        let mut child = cmd
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("weft raid site starts");
        let stdout = child.stdout.take().expect("piped stdout");
        let stderr = child.stderr.take().expect("piped stderr");
        let (tx, rx) = mpsc::channel();
        let tx_err = tx.clone();
        std::thread::spawn(move || {
            use std::io::BufRead;
            // Keep draining so the site never blocks on a full pipe.
            for line in std::io::BufReader::new(stdout).lines() {
                let Ok(line) = line else { return };
                let _ = tx.send(line);
            }
        });
        std::thread::spawn(move || {
            use std::io::BufRead;
            // Its log still shows in the test's output, and its lines can
            // be waited for like the ready line.
            for line in std::io::BufReader::new(stderr).lines() {
                let Ok(line) = line else { return };
                eprintln!("{line}");
                let _ = tx_err.send(line);
            }
        });
        Site {
            child,
            id,
            lines: rx,
        }
    }

    /// Waits (bounded) for a line of its stdout or stderr containing
    /// `needle`.
    fn wait_line(&self, needle: &str, limit: Duration) -> String {
        let deadline = Instant::now() + limit;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(l) if l.contains(needle) => return l,
                Ok(_) => continue,
                Err(e) => panic!("site {} never printed {needle:?} ({e})", self.id),
            }
        }
    }

    /// Stops it with SIGTERM and waits (bounded) for a clean exit.
    fn terminate(mut self) {
        let _ = std::process::Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                assert!(status.success(), "site {} exited {status}", self.id);
                return;
            }
            assert!(
                Instant::now() < deadline,
                "site {} ignored SIGTERM",
                self.id
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Site {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// A `weft` command running in the background, killed when dropped.
struct Bg {
    child: Child,
    started: Instant,
    out: Option<JoinHandle<String>>,
    err: Option<JoinHandle<String>>,
    what: String,
}

/// How a background command ended.
struct Done {
    code: i32,
    out: String,
    err: String,
    elapsed: Duration,
}

impl Bg {
    fn spawn(args: &[&str]) -> Bg {
        let mut child = weft()
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("weft runs");
        let drain = |mut r: Box<dyn Read + Send>| {
            std::thread::spawn(move || {
                let mut s = String::new();
                let _ = r.read_to_string(&mut s);
                s
            })
        };
        let out = drain(Box::new(child.stdout.take().unwrap()));
        let err = drain(Box::new(child.stderr.take().unwrap()));
        Bg {
            child,
            started: Instant::now(),
            out: Some(out),
            err: Some(err),
            what: args.join(" "),
        }
    }

    fn running(&mut self) -> bool {
        self.child.try_wait().expect("try_wait").is_none()
    }

    /// Waits for the exit, at most `limit` from the start (then fails).
    fn finish(mut self, limit: Duration) -> Done {
        let deadline = self.started + limit;
        let status = loop {
            if let Some(s) = self.child.try_wait().expect("try_wait") {
                break s;
            }
            if Instant::now() >= deadline {
                let _ = self.child.kill();
                let _ = self.child.wait();
                panic!("`weft {}` still running after {limit:?}: a hang", self.what);
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let elapsed = self.started.elapsed();
        Done {
            code: status.code().unwrap_or(-1),
            out: self.out.take().unwrap().join().unwrap(),
            err: self.err.take().unwrap().join().unwrap(),
            elapsed,
        }
    }
}

impl Drop for Bg {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Three sites on fixed addresses, each with its own data directory in a
/// tempdir removed at the end.
struct Cluster {
    // Fields drop in order: the sites die before their directories go.
    sites: [Option<Site>; 3],
    addrs: [String; 3],
    dir: tempfile::TempDir,
}

impl Cluster {
    fn start() -> Cluster {
        let mut c = Cluster {
            dir: tempfile::tempdir().unwrap(),
            addrs: [free_port(), free_port(), free_port()],
            sites: [None, None, None],
        };
        for id in 1..=3 {
            c.launch(id, &[]);
        }
        c
    }

    /// Starts site `id` (site 1 founds the cluster, the others join it).
    fn launch(&mut self, id: u32, extra: &[&str]) -> String {
        let i = (id - 1) as usize;
        let data = data_dir(self.dir.path(), id);
        let join = (id != 1).then(|| self.addrs[0].clone());
        let (site, ready) = Site::start(id, &self.addrs[i], join.as_deref(), &data, extra);
        self.sites[i] = Some(site);
        ready
    }

    fn site(&self, id: u32) -> &Site {
        self.sites[(id - 1) as usize]
            .as_ref()
            .expect("site running")
    }

    fn take(&mut self, id: u32) -> Site {
        let s = self.sites[(id - 1) as usize].take().expect("site running");
        assert_eq!(s.id, id);
        s
    }

    /// The transactions live at site `id` that hold their locks undecided
    /// (anything but a decided coordinator waiting for acknowledgements).
    fn undecided_at(&self, id: u32) -> Option<Vec<Value>> {
        let (code, out, _) = run(
            &[
                "tx",
                "list",
                "--node",
                self.addr(id),
                "--json",
                "--secret",
                SECRET,
            ],
            &[],
        );
        let v: Value = serde_json::from_str(&out).ok().filter(|_| code == 0)?;
        Some(
            v.as_array()?
                .iter()
                .filter(|t| t["phase"] != "committing" && t["phase"] != "done")
                .cloned()
                .collect(),
        )
    }

    fn addr(&self, id: u32) -> &str {
        &self.addrs[(id - 1) as usize]
    }

    fn status(&self, id: u32) -> Option<Value> {
        let (code, out, _) = run(
            &[
                "status",
                "--node",
                self.addr(id),
                "--json",
                "--secret",
                SECRET,
            ],
            &[],
        );
        (code == 0)
            .then(|| serde_json::from_str(&out).ok())
            .flatten()
    }

    /// Waits until site `at` sees exactly `want` as the live Raid sites
    /// (and, for each, the incarnation given, when one is).
    fn wait_view(&self, at: u32, want: &[(u64, Option<u64>)], limit: Duration) {
        eventually(
            &format!("site {at} to see live sites {want:?}"),
            limit,
            || {
                let v = self.status(at)?;
                let mut live: Vec<(u64, u64)> = v["nodes"]
                    .as_array()?
                    .iter()
                    .filter(|n| n["alive"] == true)
                    .filter(|n| {
                        n["services"]
                            .as_array()
                            .is_some_and(|s| s.iter().any(|x| x == "raid"))
                    })
                    .map(|n| {
                        (
                            n["id"].as_u64().unwrap(),
                            n["incarnation"].as_u64().unwrap(),
                        )
                    })
                    .collect();
                live.sort();
                let ok = live.len() == want.len()
                    && live.iter().zip(want).all(|((id, inc), (wid, winc))| {
                        id == wid && winc.is_none_or(|w| w == *inc)
                    });
                ok.then_some(())
            },
        );
    }

    /// `weft raid run` against the cluster, in the background.
    fn run_bg(&self, duration: &str, seed: u64) -> Bg {
        Bg::spawn(&[
            "raid",
            "run",
            "--node",
            self.addr(1),
            "--secret",
            SECRET,
            "--clients",
            "4",
            "--duration",
            duration,
            "--seed",
            &seed.to_string(),
            "--json",
        ])
    }
}

/// Parses a finished `weft raid run --json`.
fn report(what: &str, d: &Done) -> Value {
    assert_eq!(
        d.code, 0,
        "{what}: weft raid run failed\nstdout:\n{}\nstderr:\n{}",
        d.out, d.err
    );
    let v: Value = serde_json::from_str(&d.out)
        .unwrap_or_else(|e| panic!("{what}: not JSON ({e}):\n{}", d.out));
    println!(
        "{what}: {:.1} s wall, committed {} of {} attempts, aborts {}, e.g. {}",
        d.elapsed.as_secs_f64(),
        v["committed"],
        v["attempts"],
        v["aborts"],
        v["abort_samples"]
    );
    v
}

fn count(v: &Value, key: &str) -> u64 {
    v[key].as_u64().unwrap_or_else(|| panic!("no {key} in {v}"))
}

/// Aborts with a status that names the dead copy's site.
fn dead_site_aborts(v: &Value) -> u64 {
    ["HostDead", "ProcDead"]
        .iter()
        .map(|k| v["aborts"][k].as_u64().unwrap_or(0))
        .sum()
}

/// The counts of a ready line's "recovered: R redriven, D in doubt".
fn recovered(ready: &str) -> (u64, u64) {
    let rest = ready
        .split("recovered: ")
        .nth(1)
        .unwrap_or_else(|| panic!("no recovery in {ready:?}"));
    let n: Vec<u64> = rest
        .split(|c: char| !c.is_ascii_digit())
        .filter(|w| !w.is_empty())
        .map(|w| w.parse().unwrap())
        .collect();
    (n[0], n[1])
}

#[test]
fn a_killed_site_fails_transactions_clearly_and_recovers_with_a_passing_audit() {
    let t0 = Instant::now();
    println!("seeds of the runs: {SEEDS:?}");
    let mut c = Cluster::start();
    let inc = |i3: u64| [(1, Some(1)), (2, Some(1)), (3, Some(i3))];
    // Every site must be known before the load: the load names the copies
    // the gateway knows in every copy's placement.
    for at in 1..=3 {
        c.wait_view(at, &inc(1), Duration::from_secs(20));
    }

    // 1. The smallest tpcb database (scale 1), on every copy; a first run
    // so that site 3's log holds committed DebitCredit work.
    let (code, out, err) = run(
        &[
            "raid",
            "load",
            "--node",
            c.addr(1),
            "--secret",
            SECRET,
            "--scale",
            "1",
            "--timeout",
            "60s",
        ],
        &[],
    );
    assert_eq!(code, 0, "load failed: {out}{err}");
    assert!(out.contains("loaded 300033 tuples"), "{out}");
    println!("{} ({:.1} s in)", out.trim(), t0.elapsed().as_secs_f64());
    let d = c.run_bg("1s", SEEDS[0]).finish(Duration::from_secs(12));
    let warm = count(&report("first run, every site up", &d), "committed");
    assert!(warm > 0);

    // Site 3 restarts (SIGTERM, then the same id and data directory) with
    // the test hook that stops a transaction once site 3's prepare record
    // is durable and before its vote leaves: the kill below then lands at
    // a known point instead of a random one. A random instant can fall
    // while site 3 coordinates a transaction whose other participants are
    // already prepared; they then stay in doubt, holding the lock on the
    // only branch, and every transaction ends in LockConflict until site 3
    // is back (two-phase commit blocking). At the hook's point the stopped
    // transaction is prepared at site 3 and has not voted; transactions
    // behind it at the other sites may still prepare there (controlled lock
    // violation), see step 3.
    c.take(3).terminate();
    let ready = c.launch(3, &["--crash-at", "participant-prepared"]);
    assert!(ready.contains("incarnation 2"), "{ready}");
    for at in 1..=3 {
        c.wait_view(at, &inc(2), Duration::from_secs(20));
    }

    // 2. Load in the background; SIGKILL site 3 at that point.
    let mut run1 = c.run_bg("3s", SEEDS[1]);
    let point = c.site(3).wait_line("CRASHPOINT", Duration::from_secs(20));
    assert!(run1.running(), "the run ended before site 3 was killed");
    let stopped = point.split_whitespace().last().unwrap().to_string();
    let killed_at = run1.started.elapsed();
    c.take(3).kill9();
    println!(
        "{point}: site 3 killed {:.2} s into the run",
        killed_at.as_secs_f64()
    );
    // The run still ends on time (3 s plus slack, less than the 10 s call
    // and transaction timeouts a hang would run into) and reports why the
    // transactions that needed site 3 failed.
    let d = run1.finish(Duration::from_secs(10));
    let v = report("run while site 3 is killed", &d);
    let committed_run1 = count(&v, "committed");
    assert!(
        dead_site_aborts(&v) > 0,
        "transactions needing site 3 end with HostDead/ProcDead: {v}"
    );
    // Besides those: the stopped transaction itself, which its coordinator
    // aborts when site 3 dies during prepare, ends with ProcDead or
    // HostDead (the cause); a transaction that used its prepared values
    // aborts with it ("Aborted"); the client attached to
    // site 3 may see "AddrError: no route to node 3" from its own dead link
    // (weft-transport's client reconnect probe); transactions queued behind
    // the stopped one's locks may time out on them. No other status: none
    // waited for a call or transaction timeout.
    for status in v["aborts"].as_object().unwrap().keys() {
        match status.as_str() {
            "HostDead" | "ProcDead" | "AddrError" | "LockConflict" | "Aborted" => {}
            other => panic!("unexpected abort status {other}: {v}"),
        }
    }

    // 3. While site 3 is down (and known to be), with nothing left
    // undecided at the other sites but what waits for site 3 itself, a new
    // run: every tpcb transaction writes all three copies, so none
    // commits, and each ends at once with the dead site's status. (With
    // controlled lock violation, transactions that site 3 coordinated may
    // have prepared at sites 1 and 2 behind the stopped one: two-phase
    // commit keeps them in doubt until their coordinator returns, and
    // others may still use their values.)
    for at in [1, 2] {
        c.wait_view(at, &inc(2)[..2], Duration::from_secs(10));
        eventually(
            &format!("site {at} to hold nothing undecided but what waits for site 3"),
            Duration::from_secs(10),
            || {
                c.undecided_at(at)
                    .map(|l| {
                        l.into_iter()
                            .filter(|t| !(t["in_doubt"] == true && t["parent"] == 3))
                            .collect::<Vec<_>>()
                    })
                    .filter(|l| {
                        // Shown if the wait fails.
                        println!("site {at} undecided: {l:?}");
                        l.is_empty()
                    })
            },
        );
    }
    let d = c.run_bg("1s", SEEDS[2]).finish(Duration::from_secs(8));
    let v = report("run while site 3 is down", &d);
    assert!(
        d.elapsed < Duration::from_secs(7),
        "a 1 s run took {:?}",
        d.elapsed
    );
    assert!(
        d.err.contains("site 3 is down"),
        "the run says site 3 is down: {}",
        d.err
    );
    assert_eq!(
        count(&v, "committed"),
        0,
        "no write reaches all copies: {v}"
    );
    let attempts = count(&v, "attempts");
    assert!(
        attempts >= 40,
        "4 clients for 1 s: each attempt ends fast, not at a timeout: {v}"
    );
    let aborts = v["aborts"].as_object().unwrap();
    assert!(
        aborts.keys().all(|k| k == "HostDead" || k == "ProcDead"),
        "every abort names the dead site: {v}"
    );
    assert_eq!(dead_site_aborts(&v), attempts, "{v}");

    // 4. Restart site 3 from its data directory, without the hook: it
    // recovers from its log (the stopped transaction in doubt until its
    // coordinator answers) and rejoins with a new incarnation.
    let ready = c.launch(3, &[]);
    println!("{ready}");
    assert!(ready.contains("incarnation 3"), "{ready}");
    let (_, in_doubt) = recovered(&ready);
    assert!(
        in_doubt >= 1,
        "the stopped transaction is in doubt: {ready}"
    );
    let status = c.status(3).expect("site 3 status");
    assert!(
        status["recovery"]["in_doubt"]
            .as_array()
            .unwrap()
            .iter()
            .any(|t| t.as_str() == Some(stopped.as_str())),
        "{stopped} recovered in doubt: {}",
        status["recovery"]
    );
    for at in 1..=3 {
        c.wait_view(at, &inc(3), Duration::from_secs(20));
    }
    eventually(
        "site 3 to resolve what it recovered in doubt",
        Duration::from_secs(15),
        || c.undecided_at(3).filter(|l| l.is_empty()),
    );
    let d = c.run_bg("2s", SEEDS[3]).finish(Duration::from_secs(15));
    let v = report("run after site 3 restarted", &d);
    let committed_run3 = count(&v, "committed");
    assert!(committed_run3 > 0, "{v}");

    // 5. The audit: the invariant on every copy, and the copies equal.
    // Phase two reaches the participants after the client's commit returns,
    // so the copies converge within a bound rather than at once.
    let deadline = Instant::now() + Duration::from_secs(15);
    let audit = loop {
        let (code, out, err) = run(
            &[
                "raid",
                "audit",
                "--node",
                c.addr(1),
                "--secret",
                SECRET,
                "--json",
            ],
            &[],
        );
        let v: Option<Value> = serde_json::from_str(&out).ok();
        match v {
            Some(v) if code == 0 && v["passed"] == true => break v,
            _ if Instant::now() >= deadline => {
                panic!("the audit never passed; last one (exit {code}):\n{out}{err}")
            }
            _ => std::thread::sleep(Duration::from_millis(200)),
        }
    };
    assert_eq!(audit["problems"], serde_json::json!([]), "{audit}");
    let sites = audit["sites"].as_object().unwrap();
    assert_eq!(
        sites.keys().collect::<Vec<_>>(),
        ["1", "2", "3"],
        "every copy is audited"
    );
    let first = &sites["1"];
    for (id, s) in sites {
        assert_eq!(s, first, "site {id}'s copy equals site 1's");
        assert_eq!(s["malformed"], 0);
        for rel in ["account", "teller", "branch"] {
            assert_eq!(
                s["balances"][rel][1], s["history_sums"][rel],
                "site {id}: sum of {rel} balances = history"
            );
        }
    }
    assert_eq!(first["balances"]["account"][0], 100_000);
    assert_eq!(first["balances"]["teller"][0], 10);
    assert_eq!(first["balances"]["branch"][0], 1);
    // Nothing committed is lost: a history row per committed transaction
    // (a few more may come from attempts whose answer was lost with site 3).
    let rows = first["history_rows"].as_u64().unwrap();
    let committed = warm + committed_run1 + committed_run3;
    assert!(
        rows >= committed,
        "{rows} history rows for {committed} commits"
    );
    println!(
        "audit passed on 3 copies, {rows} history rows for {committed} commits ({:.1} s in all)",
        t0.elapsed().as_secs_f64()
    );
}

/// Site `id`'s status counter `transactions.stats.<key>`, when it answers.
fn tm_stat(c: &Cluster, id: u32, key: &str) -> Option<u64> {
    c.status(id)?["transactions"]["stats"][key].as_u64()
}

/// Requests site `id` sent: a site sends requests only as an action
/// driver (shipping a write, reading its copy), that is, only when a
/// client calls it.
fn requests_sent(c: &Cluster, id: u32) -> Option<u64> {
    c.status(id)?["transport"]["requests"].as_u64()
}

/// `weft raid audit --json` through site `at`: exit code and report.
fn audit(c: &Cluster, at: u32) -> (i32, Value, String) {
    let (code, out, err) = run(
        &[
            "raid",
            "audit",
            "--node",
            c.addr(at),
            "--secret",
            SECRET,
            "--json",
        ],
        &[],
    );
    let v = serde_json::from_str(&out)
        .unwrap_or_else(|e| panic!("audit prints JSON ({e}), exit {code}:\n{out}{err}"));
    (code, v, err)
}

/// Waits (bounded) for a passing audit through site `at`.
fn audit_passes(c: &Cluster, at: u32) -> Value {
    eventually("a passing audit", Duration::from_secs(20), || {
        let (code, v, _) = audit(c, at);
        (code == 0 && v["passed"] == true).then_some(v)
    })
}

/// Issue 16, items 12-14: clients keep running across a site's restart
/// (the run reconnects to it), an audit with a site down audits the live
/// copies and fails naming the missing one, a run whose `--node` site dies
/// still reports, a refused connection exits 3, and after a whole-cluster
/// crash the sites may be started in any order (the joiners wait for a
/// `--join` member to answer).
#[test]
fn clients_ride_out_restarts_and_audits_name_every_copy() {
    let t0 = Instant::now();
    let seed = 0x5eed_0016u64;
    println!("seed {seed:#x}");
    let mut c = Cluster::start();
    let all = [(1, None), (2, None), (3, None)];
    for at in 1..=3 {
        c.wait_view(at, &all, Duration::from_secs(20));
    }
    let (code, out, err) = run(
        &[
            "raid",
            "load",
            "--node",
            c.addr(1),
            "--secret",
            SECRET,
            "--mode",
            "raid",
        ],
        &[],
    );
    assert_eq!(code, 0, "load failed: {out}{err}");

    // 1. A raid-mode run with a client at each site. Site 3 is killed and
    // restarted under it: its new incarnation sends requests (as an action
    // driver) only if the run reconnects to it (checked in step 4: a site
    // restarted without clients sends none). (The load began transactions
    // at site 3 too.)
    let loaded = tm_stat(&c, 3, "begun").expect("site 3 answers");
    let mut bg = Bg::spawn(&[
        "raid",
        "run",
        "--node",
        c.addr(2),
        "--secret",
        SECRET,
        "--mode",
        "raid",
        "--clients",
        "3",
        "--duration",
        "10s",
        "--seed",
        &seed.to_string(),
        "--json",
    ]);
    eventually(
        "site 3 to run transactions",
        Duration::from_secs(10),
        || tm_stat(&c, 3, "begun").filter(|n| *n > loaded),
    );
    c.take(3).kill9();
    let ready = c.launch(3, &[]);
    assert!(ready.contains("incarnation 2"), "{ready}");
    let restarted = bg.started.elapsed();
    let deadline = Instant::now() + Duration::from_secs(8);
    while requests_sent(&c, 3).is_none_or(|n| n == 0) {
        if Instant::now() >= deadline || !bg.running() {
            let d = bg.finish(Duration::from_secs(30));
            panic!(
                "the run never sent transactions to the restarted site 3:\n{}\n{}",
                d.out, d.err
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    println!(
        "site 3 restarted {:.1} s into the run; clients back on it {:.1} s later",
        restarted.as_secs_f64(),
        (bg.started.elapsed() - restarted).as_secs_f64()
    );
    let d = bg.finish(Duration::from_secs(30));
    let lost = d.err.find("weft: lost the link to site 3");
    let back = d.err.find("weft: connected to site 3");
    assert!(
        lost.is_some() && back > lost,
        "the run reconnected to site 3:\n{}",
        d.err
    );
    let v = report("run across site 3's restart", &d);
    assert!(count(&v, "committed") > 0, "{v}");
    // A restarted site is reachable only once its Raid services are
    // registered: a client back on it never sees NoSuchService.
    assert!(v["aborts"].get("NoSuchService").is_none(), "{v}");
    // Without a terminal, a progress line every few seconds on stderr.
    let progress: Vec<&str> = d
        .err
        .lines()
        .filter(|l| l.starts_with("weft raid run: "))
        .collect();
    assert!(progress.len() >= 3, "progress lines on stderr:\n{}", d.err);
    for l in &progress {
        println!("  {l}");
    }
    let first = audit_passes(&c, 1);
    assert_eq!(first["replicas"], serde_json::json!([1, 2, 3]), "{first}");

    // 2. Site 3 down: the audit covers the live copies, fails, and names
    // the copy it could not see.
    c.take(3).kill9();
    c.wait_view(1, &all[..2], Duration::from_secs(10));
    let (code, v, err) = audit(&c, 1);
    assert_ne!(code, 0, "an audit missing a copy fails: {v}\n{err}");
    assert_eq!(v["passed"], false, "{v}");
    assert_eq!(v["missing"], serde_json::json!([3]), "{v}");
    assert_eq!(v["replicas"], serde_json::json!([1, 2, 3]), "{v}");
    assert_eq!(v["sites"]["3"]["audited"], false, "{v}");
    for id in ["1", "2"] {
        assert_eq!(
            v["sites"][id]["balances"]["account"][0], 100,
            "site {id} audited: {v}"
        );
    }
    assert!(
        v["problems"]
            .as_array()
            .unwrap()
            .iter()
            .any(|p| p.as_str().unwrap().starts_with("site 3:")),
        "{v}"
    );

    // 3. A refused connection exits 3 (HostDead/ProcDead), as documented.
    let dead = c.addr(3).to_string();
    for args in [
        &["status", "--node", dead.as_str(), "--secret", SECRET][..],
        &["raid", "audit", "--node", dead.as_str(), "--secret", SECRET],
    ] {
        let (code, _, err) = run(args, &[]);
        assert_eq!(
            code,
            3,
            "`weft {}` against a dead node: {err}",
            args.join(" ")
        );
    }

    // 4. A run whose --node site dies before the end still reports what
    // its clients counted, and says what it could not fetch.
    c.launch(3, &[]);
    for at in 1..=3 {
        c.wait_view(at, &all, Duration::from_secs(20));
    }
    // Nothing to coordinate, no clients: a restarted site sends no request.
    assert_eq!(requests_sent(&c, 3), Some(0));
    let before = tm_stat(&c, 3, "begun").expect("site 3 answers");
    let mut bg = Bg::spawn(&[
        "raid",
        "run",
        "--node",
        c.addr(3),
        "--secret",
        SECRET,
        "--mode",
        "raid",
        "--clients",
        "3",
        "--duration",
        "3s",
        "--seed",
        &(seed + 1).to_string(),
        "--json",
    ]);
    eventually(
        "site 3 to run transactions",
        Duration::from_secs(10),
        || tm_stat(&c, 3, "begun").filter(|n| *n > before),
    );
    assert!(bg.running());
    c.take(3).kill9();
    let d = bg.finish(Duration::from_secs(30));
    let v = report("run whose --node site died", &d);
    assert!(count(&v, "attempts") > 0, "{v}");
    assert!(v["not_fetched"]["site_counters"].is_string(), "{v}");
    assert!(v["messages_per_txn"].is_null(), "{v}");

    // 5. The whole cluster crashes; the sites come back in reverse order:
    // 3 and 2 wait for a --join member to answer, 1 founds the cluster.
    for id in [1, 2] {
        c.take(id).kill9();
    }
    let joins = format!("{},{}", c.addr(2), c.addr(1));
    let data = |id| data_dir(c.dir.path(), id);
    let s3 = Site::spawn(3, c.addr(3), Some(&joins), &data(3), &[]);
    let s2 = Site::spawn(2, c.addr(2), Some(c.addr(1)), &data(2), &[]);
    // Site 2 finds nobody (site 1, its one member, is down) and goes on
    // trying; site 3, started before it, meanwhile tries 2 and 1.
    s2.wait_line("no --join member answers yet", Duration::from_secs(30));
    c.launch(1, &[]);
    for s in [s2, s3] {
        s.wait_line(" listening on ", Duration::from_secs(30));
        let i = (s.id - 1) as usize;
        c.sites[i] = Some(s);
    }
    for at in 1..=3 {
        c.wait_view(at, &all, Duration::from_secs(20));
    }
    let v = audit_passes(&c, 2);
    println!(
        "audit after the whole-cluster restart: {} history rows ({:.1} s in all)",
        v["sites"]["1"]["history_rows"],
        t0.elapsed().as_secs_f64()
    );

    // A --join member that never answers: bounded by --join-timeout, exit 3.
    let lone = free_port();
    let started = Instant::now();
    let (code, _, err) = run(
        &[
            "raid",
            "site",
            "--id",
            "9",
            "--listen",
            &free_port(),
            "--secret",
            SECRET,
            "--join",
            &lone,
            "--join-timeout",
            "1s",
        ],
        &[],
    );
    assert_eq!(code, 3, "{err}");
    assert!(err.contains("no --join member answered"), "{err}");
    println!("gave up joining after {:?}", started.elapsed());
}
