//! Crash atomicity with real processes: a transaction writes a key on two
//! participants; one node is stopped at a named point of the commit protocol
//! (a test-only hook, not a sleep), killed with SIGKILL and restarted from
//! its data directory. Every participant must reach the same outcome: no
//! committed write lost, no aborted write visible, nothing left in doubt.

mod common;

use std::net::TcpListener;
use std::time::Duration;

use common::*;

const SECRET: (&str, &str) = ("WEFT_CLUSTER_SECRET", "crash-test");

fn free_port() -> String {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().to_string()
}

/// Three nodes with data directories and fixed addresses; `crash_at` arms
/// one of them.
struct Cluster {
    dir: tempfile::TempDir,
    addrs: [String; 3],
    nodes: [Option<NodeProc>; 3],
}

impl Cluster {
    fn start(crash: Option<(u32, &str)>) -> Cluster {
        let dir = tempfile::tempdir().unwrap();
        let addrs = [free_port(), free_port(), free_port()];
        let mut c = Cluster {
            dir,
            addrs,
            nodes: [None, None, None],
        };
        for id in 1..=3 {
            let point = crash.filter(|(n, _)| *n == id).map(|(_, p)| p);
            c.launch(id, point);
        }
        c.wait_all_alive();
        c
    }

    fn launch(&mut self, id: u32, crash_at: Option<&str>) {
        let data = data_dir(self.dir.path(), id);
        let listen = self.addrs[(id - 1) as usize].clone();
        let join = self.addrs[0].clone();
        let mut args: Vec<&str> = vec!["--data-dir", &data, "--secret", SECRET.1];
        if id != 1 {
            args.extend(["--join", &join]);
        }
        if let Some(p) = crash_at {
            args.extend(["--crash-at", p]);
        }
        self.nodes[(id - 1) as usize] = Some(NodeProc::start_at(id, &listen, &args));
    }

    fn node(&self, id: u32) -> &NodeProc {
        self.nodes[(id - 1) as usize]
            .as_ref()
            .expect("node running")
    }

    fn kill(&mut self, id: u32) {
        if let Some(mut n) = self.nodes[(id - 1) as usize].take() {
            n.kill9();
        }
    }

    fn addr(&self, id: u32) -> &str {
        &self.addrs[(id - 1) as usize]
    }

    fn wait_all_alive(&self) {
        eventually("all three nodes alive", Duration::from_secs(20), || {
            let (code, out, _) = run(&["status", "--node", self.addr(1), "--json"], &[SECRET]);
            if code != 0 {
                return None;
            }
            let v: serde_json::Value = serde_json::from_str(&out).ok()?;
            let alive = v["nodes"]
                .as_array()?
                .iter()
                .filter(|n| n["alive"] == true)
                .count();
            (alive == 3).then_some(())
        });
    }

    /// Begins a transaction at node 1 that writes `key` on nodes 2 and 3.
    fn prepare_writes(&self, key: &str) -> String {
        let (code, out, err) = run(&["tx", "begin", "--node", self.addr(1)], &[SECRET]);
        assert_eq!(code, 0, "{err}");
        let tid = out.lines().next().unwrap().trim().to_string();
        for at in ["2", "3"] {
            let (code, _, err) = run(
                &[
                    "kv",
                    "put",
                    "--node",
                    self.addr(1),
                    "--at",
                    at,
                    key,
                    "written",
                ],
                &[SECRET, ("WEFT_TX", &tid)],
            );
            assert_eq!(code, 0, "{err}");
        }
        tid
    }

    /// Starts `weft tx commit` in the background.
    fn commit_in_background(&self, tid: &str) -> std::process::Child {
        weft()
            .args(["tx", "commit", "--node", self.addr(1), "--timeout", "60s"])
            .env(SECRET.0, SECRET.1)
            .env("WEFT_TX", tid)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap()
    }

    /// Waits until no node has a live transaction (nothing in doubt), then
    /// returns what each participant's store holds at `key`.
    fn settled_values(&self, key: &str) -> (Option<String>, Option<String>) {
        eventually(
            "no transaction left anywhere",
            Duration::from_secs(30),
            || {
                for id in 1..=3 {
                    let (code, out, _) = run(
                        &["tx", "list", "--node", self.addr(id), "--json"],
                        &[SECRET],
                    );
                    if code != 0 || out.trim() != "[]" {
                        return None;
                    }
                }
                Some(())
            },
        );
        let get = |at: &str| {
            let (code, out, err) = run(
                &["kv", "get", "--node", self.addr(1), "--at", at, key],
                &[SECRET],
            );
            match code {
                0 => Some(out.trim().to_string()),
                1 => None,
                _ => panic!("kv get failed: {err}"),
            }
        };
        (get("2"), get("3"))
    }
}

fn assert_same(values: (Option<String>, Option<String>), committed: bool, what: &str) {
    let want = committed.then(|| "written".to_string());
    assert_eq!(
        values,
        (want.clone(), want),
        "{what}: both participants must agree"
    );
}

#[test]
fn participant_killed_after_forcing_prepare_aborts_everywhere() {
    let mut c = Cluster::start(Some((2, "participant-prepared")));
    let tid = c.prepare_writes("k1");
    let mut commit = c.commit_in_background(&tid);
    c.node(2).wait_line("CRASHPOINT", Duration::from_secs(20));
    c.kill(2);
    let status = commit.wait().unwrap();
    assert!(
        !status.success(),
        "the coordinator never got node 2's vote: abort"
    );
    c.launch(2, None);
    assert_same(
        c.settled_values("k1"),
        false,
        "participant died prepared, before voting",
    );
}

#[test]
fn coordinator_killed_before_forcing_commit_presumes_abort() {
    let mut c = Cluster::start(Some((1, "coordinator-before-commit-force")));
    let tid = c.prepare_writes("k2");
    let mut commit = c.commit_in_background(&tid);
    c.node(1).wait_line("CRASHPOINT", Duration::from_secs(20));
    c.kill(1);
    assert!(!commit.wait().unwrap().success());
    // Both participants are prepared and in doubt until the coordinator
    // comes back; with no commit record it answers abort.
    c.launch(1, None);
    assert_same(
        c.settled_values("k2"),
        false,
        "no commit record: presumed abort",
    );
}

#[test]
fn coordinator_killed_after_forcing_commit_still_commits() {
    let mut c = Cluster::start(Some((1, "coordinator-after-commit-force")));
    let tid = c.prepare_writes("k3");
    let mut commit = c.commit_in_background(&tid);
    c.node(1).wait_line("CRASHPOINT", Duration::from_secs(20));
    c.kill(1);
    let _ = commit.wait();
    c.launch(1, None);
    assert_same(
        c.settled_values("k3"),
        true,
        "the commit record was durable",
    );
}

#[test]
fn participant_killed_in_phase_two_commits_on_recovery() {
    let mut c = Cluster::start(Some((2, "participant-phase-two")));
    let tid = c.prepare_writes("k4");
    let mut commit = c.commit_in_background(&tid);
    c.node(2).wait_line("CRASHPOINT", Duration::from_secs(20));
    c.kill(2);
    assert!(
        commit.wait().unwrap().success(),
        "the decision was made before node 2 died"
    );
    c.launch(2, None);
    assert_same(
        c.settled_values("k4"),
        true,
        "node 2 learns the outcome at recovery",
    );
}
