//! Transactional files, crash atomicity with real processes: one
//! transaction, begun at node 1, changes several files on node 1's volume
//! and on node 2's (new files, a range write into an existing file, a
//! rename across directories, a directory renamed with a tree in it, a
//! delete, a mkdir). One node is stopped at a
//! named point (a commit-protocol crash point, or a step of applying the
//! file commit), killed with SIGKILL and restarted from its data directory
//! and volume. Each volume must then hold either every change or none,
//! matching the outcome, with no staging file left.

mod common;

use std::collections::BTreeMap;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::time::Duration;

use common::*;

const SECRET: (&str, &str) = ("WEFT_CLUSTER_SECRET", "fs-crash-test");

fn free_port() -> String {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().to_string()
}

struct Cluster {
    dir: tempfile::TempDir,
    addrs: [String; 2],
    nodes: [Option<NodeProc>; 2],
}

impl Cluster {
    fn vol(&self, id: u32) -> PathBuf {
        self.dir.path().join(format!("vol{id}"))
    }

    fn start(crash: Option<(u32, &str, &str)>) -> Cluster {
        let dir = tempfile::tempdir().unwrap();
        let mut c = Cluster {
            dir,
            addrs: [free_port(), free_port()],
            nodes: [None, None],
        };
        for id in 1..=2 {
            seed_volume(&c.vol(id));
            let arm = crash.filter(|(n, _, _)| *n == id).map(|(_, f, p)| (f, p));
            c.launch(id, arm);
        }
        c
    }

    fn launch(&mut self, id: u32, arm: Option<(&str, &str)>) {
        let data = data_dir(self.dir.path(), id);
        let listen = self.addrs[(id - 1) as usize].clone();
        let join = self.addrs[0].clone();
        let vol = format!("v={}", self.vol(id).display());
        let mut args: Vec<&str> = vec!["--data-dir", &data, "--secret", SECRET.1, "--volume", &vol];
        if id != 1 {
            args.extend(["--join", &join]);
        }
        if let Some((flag, point)) = arm {
            args.extend([flag, point]);
        }
        self.nodes[(id - 1) as usize] = Some(NodeProc::start_at(id, &listen, &args));
    }

    fn node(&self, id: u32) -> &NodeProc {
        self.nodes[(id - 1) as usize].as_ref().expect("running")
    }

    fn kill(&mut self, id: u32) {
        if let Some(mut n) = self.nodes[(id - 1) as usize].take() {
            n.kill9();
        }
    }

    fn fs(&self, tid: &str, args: &[&str], stdin: Option<&[u8]>) {
        let mut cmd = weft();
        cmd.args(["fs"])
            .args(&args[..1])
            .args(["--node", &self.addrs[0], "--volume", "v"])
            .args(&args[1..])
            .env(SECRET.0, SECRET.1)
            .env("WEFT_TX", tid);
        let out = match stdin {
            Some(data) => {
                use std::io::Write;
                let mut child = cmd
                    .stdin(std::process::Stdio::piped())
                    .stdout(std::process::Stdio::piped())
                    .stderr(std::process::Stdio::piped())
                    .spawn()
                    .unwrap();
                child.stdin.take().unwrap().write_all(data).unwrap();
                child.wait_with_output().unwrap()
            }
            None => cmd.output().unwrap(),
        };
        assert!(
            out.status.success(),
            "weft fs {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// Begins the transaction at node 1 and makes its changes on both
    /// volumes.
    fn changes(&self) -> String {
        let (code, out, err) = run(&["tx", "begin", "--node", &self.addrs[0]], &[SECRET]);
        assert_eq!(code, 0, "{err}");
        let tid = out.lines().next().unwrap().trim().to_string();
        // A file larger than what travels inline in the prepare record.
        let big = big();
        for at in ["1", "2"] {
            self.fs(&tid, &["put", "--at", at, "new.txt"], Some(b"new file"));
            self.fs(&tid, &["put", "--at", at, "big.bin"], Some(&big));
            self.fs(&tid, &["mkdir", "--at", at, "d"], None);
            self.fs(&tid, &["put", "--at", at, "d/inner"], Some(b"inner"));
            self.fs(
                &tid,
                &["mv", "--at", at, "src/moved.txt", "d/moved.txt"],
                None,
            );
            self.fs(&tid, &["rm", "--at", at, "doomed.txt"], None);
            // A directory with a tree in it, renamed into another one.
            self.fs(&tid, &["mv", "--at", at, "olddir", "d/newdir"], None);
            self.fs(
                &tid,
                &["put", "--at", at, "rewritten.txt"],
                Some(b"rewritten"),
            );
            // Range writes into existing files: one small (inline in the
            // record), one past the inline budget (a forced redo file).
            self.fs(
                &tid,
                &["put", "--at", at, "--offset", "0", "patched.txt"],
                Some(b"REWRITTEN"),
            );
            self.fs(
                &tid,
                &["put", "--at", at, "--offset", "1048576", "large.bin"],
                Some(&big),
            );
        }
        tid
    }

    fn commit_in_background(&self, tid: &str) -> std::process::Child {
        weft()
            .args(["tx", "commit", "--node", &self.addrs[0], "--timeout", "60s"])
            .env(SECRET.0, SECRET.1)
            .env("WEFT_TX", tid)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap()
    }

    /// Waits until neither node has a transaction left.
    fn settle(&self) {
        eventually(
            "no transaction left anywhere",
            Duration::from_secs(60),
            || {
                for a in &self.addrs {
                    let (code, out, _) = run(&["tx", "list", "--node", a, "--json"], &[SECRET]);
                    if code != 0 || out.trim() != "[]" {
                        return None;
                    }
                }
                Some(())
            },
        );
    }

    fn check(&self, committed: bool, what: &str) {
        self.settle();
        for id in 1..=2 {
            let vol = self.vol(id);
            let want = if committed { after() } else { before() };
            // Phase two may still be finishing its last fsync after the
            // transaction left the lists: poll for the final state.
            eventually(
                &format!("{what}: volume {id} settles"),
                Duration::from_secs(30),
                || (snapshot(&vol) == want && staging_empty(&vol)).then_some(()),
            );
        }
    }
}

fn seed_volume(vol: &Path) {
    std::fs::create_dir_all(vol.join("src")).unwrap();
    std::fs::write(vol.join("src/moved.txt"), "moved").unwrap();
    std::fs::write(vol.join("doomed.txt"), "doomed").unwrap();
    std::fs::create_dir_all(vol.join("olddir/deep")).unwrap();
    std::fs::write(vol.join("olddir/x.txt"), "x").unwrap();
    std::fs::write(vol.join("olddir/deep/y.txt"), "y").unwrap();
    std::fs::write(vol.join("rewritten.txt"), "original content").unwrap();
    std::fs::write(vol.join("patched.txt"), "original content").unwrap();
    std::fs::write(vol.join("large.bin"), vec![7u8; 8 << 20]).unwrap();
}

fn before() -> BTreeMap<String, Vec<u8>> {
    let mut m = BTreeMap::new();
    m.insert("src/".into(), vec![]);
    m.insert("src/moved.txt".into(), b"moved".to_vec());
    m.insert("doomed.txt".into(), b"doomed".to_vec());
    m.insert("olddir/".into(), vec![]);
    m.insert("olddir/x.txt".into(), b"x".to_vec());
    m.insert("olddir/deep/".into(), vec![]);
    m.insert("olddir/deep/y.txt".into(), b"y".to_vec());
    m.insert("rewritten.txt".into(), b"original content".to_vec());
    m.insert("patched.txt".into(), b"original content".to_vec());
    m.insert("large.bin".into(), vec![7u8; 8 << 20]);
    m
}

fn after() -> BTreeMap<String, Vec<u8>> {
    let mut m = BTreeMap::new();
    m.insert("src/".into(), vec![]);
    m.insert("d/".into(), vec![]);
    m.insert("d/inner".into(), b"inner".to_vec());
    m.insert("d/moved.txt".into(), b"moved".to_vec());
    m.insert("d/newdir/".into(), vec![]);
    m.insert("d/newdir/x.txt".into(), b"x".to_vec());
    m.insert("d/newdir/deep/".into(), vec![]);
    m.insert("d/newdir/deep/y.txt".into(), b"y".to_vec());
    m.insert("new.txt".into(), b"new file".to_vec());
    m.insert("big.bin".into(), big());
    m.insert("rewritten.txt".into(), b"rewritten".to_vec());
    m.insert("patched.txt".into(), b"REWRITTENcontent".to_vec());
    let mut large = vec![7u8; 8 << 20];
    large[1 << 20..(1 << 20) + (5 << 20)].copy_from_slice(&big());
    m.insert("large.bin".into(), large);
    m
}

fn big() -> Vec<u8> {
    (0..(5u32 << 20)).map(|i| (i % 251) as u8).collect()
}

/// Every name in the volume (directories end in `/`) with its content.
fn snapshot(vol: &Path) -> BTreeMap<String, Vec<u8>> {
    fn walk(root: &Path, dir: &Path, out: &mut BTreeMap<String, Vec<u8>>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let e = e.unwrap();
            let rel = e.path().strip_prefix(root).unwrap().display().to_string();
            if rel == ".weft-fs" {
                continue;
            }
            if e.file_type().unwrap().is_dir() {
                out.insert(format!("{rel}/"), vec![]);
                walk(root, &e.path(), out);
            } else {
                out.insert(rel, std::fs::read(e.path()).unwrap());
            }
        }
    }
    let mut out = BTreeMap::new();
    walk(vol, vol, &mut out);
    out
}

fn staging_empty(vol: &Path) -> bool {
    std::fs::read_dir(vol.join(".weft-fs/stage"))
        .map(|mut d| d.next().is_none())
        .unwrap_or(false)
}

/// Arms `point` on node `victim`, runs the transaction, kills the victim at
/// the point, restarts it and checks the outcome.
fn crash_case(victim: u32, flag: &str, point: &str, line: &str, committed: bool) {
    let mut c = Cluster::start(Some((victim, flag, point)));
    let tid = c.changes();
    // Nothing is visible before commit.
    for id in 1..=2 {
        assert_eq!(snapshot(&c.vol(id)), before(), "volume {id} before commit");
    }
    let mut commit = c.commit_in_background(&tid);
    c.node(victim).wait_line(line, Duration::from_secs(60));
    c.kill(victim);
    c.launch(victim, None);
    let _ = commit.wait();
    c.check(committed, point);
}

#[test]
fn participant_killed_before_forcing_prepare_aborts_both_volumes() {
    crash_case(
        2,
        "--crash-at",
        "participant-before-prepare-force",
        "CRASHPOINT",
        false,
    );
}

#[test]
fn participant_killed_prepared_aborts_both_volumes() {
    crash_case(2, "--crash-at", "participant-prepared", "CRASHPOINT", false);
}

#[test]
fn coordinator_killed_before_commit_force_aborts_both_volumes() {
    crash_case(
        1,
        "--crash-at",
        "coordinator-before-commit-force",
        "CRASHPOINT",
        false,
    );
}

#[test]
fn coordinator_killed_after_commit_force_commits_both_volumes() {
    crash_case(
        1,
        "--crash-at",
        "coordinator-after-commit-force",
        "CRASHPOINT",
        true,
    );
}

#[test]
fn coordinator_killed_after_sending_the_decision_commits_both_volumes() {
    crash_case(
        1,
        "--crash-at",
        "coordinator-decision-sent",
        "CRASHPOINT",
        true,
    );
}

#[test]
fn participant_killed_in_phase_two_commits_both_volumes() {
    crash_case(2, "--crash-at", "participant-phase-two", "CRASHPOINT", true);
}

#[test]
fn participant_killed_after_removing_names_finishes_the_commit() {
    crash_case(2, "--fs-crash-at", "after-phase-a", "FSCRASH", true);
}

#[test]
fn participant_killed_while_renaming_in_finishes_the_commit() {
    crash_case(2, "--fs-crash-at", "mid-phase-b", "FSCRASH", true);
}

#[test]
fn coordinator_killed_after_applying_before_cleaning_finishes_the_commit() {
    crash_case(1, "--fs-crash-at", "applied", "FSCRASH", true);
}

#[test]
fn an_aborted_shell_transaction_leaves_no_trace() {
    let c = Cluster::start(None);
    let tid = c.changes();
    let (code, _, err) = run(
        &["tx", "abort", "--node", &c.addrs[0]],
        &[SECRET, ("WEFT_TX", &tid)],
    );
    assert_eq!(code, 0, "{err}");
    c.check(false, "aborted");
}
