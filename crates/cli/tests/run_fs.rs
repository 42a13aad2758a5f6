//! `weft run --fs DIR -- CMD`: an unmodified program's file changes commit
//! when it exits 0 and leave no trace otherwise (a failure, a signal, a
//! crash of `weft run` itself), two runs changing one file never mix, and
//! a run inside a run is a sub-transaction. Real processes; the overlay
//! mounts need root (or user namespaces): without them the tests say so
//! and skip.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use common::*;

fn wcmd(args: &[&str], env: &[(&str, &str)]) -> Command {
    let mut cmd = weft();
    for k in [
        "WEFT_TX",
        "WEFT_NODE",
        "WEFT_NOTIFY_TX",
        "WEFT_RUN_OVERLAYS",
        "WEFT_CLUSTER_SECRET",
    ] {
        cmd.env_remove(k);
    }
    let bin = PathBuf::from(env!("CARGO_BIN_EXE_weft"));
    let path = std::env::var_os("PATH").unwrap_or_default();
    let mut paths = vec![bin.parent().unwrap().to_path_buf()];
    paths.extend(std::env::split_paths(&path));
    cmd.env("PATH", std::env::join_paths(paths).unwrap());
    cmd.args(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd
}

fn wrun_in(dir: &Path, args: &[&str], env: &[(&str, &str)]) -> (i32, String, String) {
    let out = wcmd(args, env)
        .current_dir(dir)
        .output()
        .expect("weft runs");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// True when this machine can make the private overlay mounts (root, or
/// unprivileged user namespaces); else prints why the test skips.
fn can_mount(test: &str) -> bool {
    let root = Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false);
    let userns = || {
        Command::new("unshare")
            .args(["-m", "-r", "true"])
            .stderr(Stdio::null())
            .status()
            .map(|s| s.success())
            .unwrap_or(false)
    };
    let ok = root || userns();
    if !ok {
        eprintln!(
            "SKIPPED {test}: weft run's overlay mounts need root or unprivileged user \
             namespaces, which this machine does not allow (CI runs as root)"
        );
    }
    ok
}

/// Every entry under `dir` (the file store's reserved area aside), files
/// with their contents: a picture to compare before and after.
fn tree(dir: &Path) -> BTreeMap<String, Option<String>> {
    fn walk(root: &Path, d: &Path, out: &mut BTreeMap<String, Option<String>>) {
        for e in std::fs::read_dir(d).unwrap() {
            let e = e.unwrap();
            let p = e.path();
            let rel = p.strip_prefix(root).unwrap().display().to_string();
            if rel.starts_with(".weft-fs") {
                continue;
            }
            if p.is_dir() {
                out.insert(rel, None);
                walk(root, &p, out);
            } else {
                out.insert(rel, Some(std::fs::read_to_string(&p).unwrap_or_default()));
            }
        }
    }
    let mut out = BTreeMap::new();
    walk(dir, dir, &mut out);
    out
}

/// A volume directory holding `c` and `keep/k`.
fn volume(t: &Path) -> PathBuf {
    let v = t.join("vol");
    std::fs::create_dir_all(v.join("keep")).unwrap();
    std::fs::write(v.join("c"), "old c\n").unwrap();
    std::fs::write(v.join("keep/k"), "k\n").unwrap();
    v
}

const SCRIPT: &str = "echo x > a; mv a b; rm c; mkdir d; echo y > keep/k; exit";

#[test]
fn a_failed_program_leaves_no_trace_and_a_successful_one_applies_everything() {
    if !can_mount("a_failed_program_leaves_no_trace") {
        return;
    }
    let t = tempfile::tempdir().unwrap();
    let v = volume(t.path());
    let before = tree(&v);
    let vs = v.display().to_string();
    let (code, _, err) = wrun_in(
        &v,
        &["run", "--fs", &vs, "--", "sh", "-c", &format!("{SCRIPT} 1")],
        &[],
    );
    assert_eq!(code, 1, "{err}");
    assert_eq!(tree(&v), before, "exit 1 left a trace");
    let (code, _, err) = wrun_in(
        &v,
        &["run", "--fs", &vs, "--", "sh", "-c", &format!("{SCRIPT} 0")],
        &[],
    );
    assert_eq!(code, 0, "{err}");
    let after = tree(&v);
    let want: BTreeMap<String, Option<String>> = [
        ("b", Some("x\n")),
        ("d", None),
        ("keep", None),
        ("keep/k", Some("y\n")),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.map(str::to_string)))
    .collect();
    assert_eq!(after, want);
    // Symbolic links are kept as links (never followed by the store).
    let (code, _, err) = wrun_in(&v, &["run", "--fs", &vs, "--", "ln", "-s", "b", "l"], &[]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(std::fs::read_link(v.join("l")).unwrap(), PathBuf::from("b"));
    // Nothing of the runs is left beside the volume but the node's data.
    let scratch = t.path().join(".vol.weft/run");
    assert_eq!(std::fs::read_dir(&scratch).unwrap().count(), 0);
}

#[test]
fn a_program_killed_by_a_signal_and_a_killed_weft_run_leave_no_trace() {
    if !can_mount("a_program_killed_by_a_signal") {
        return;
    }
    let t = tempfile::tempdir().unwrap();
    let v = volume(t.path());
    let before = tree(&v);
    let vs = v.display().to_string();
    // The program kills itself half-way.
    let (code, _, err) = wrun_in(
        &v,
        &[
            "run",
            "--fs",
            &vs,
            "--",
            "sh",
            "-c",
            "echo x > a; mv a b; kill -9 $$; rm c",
        ],
        &[],
    );
    assert_eq!(code, 137, "{err}");
    assert_eq!(tree(&v), before);
    // weft run itself is killed (SIGKILL) while the program is half-way:
    // the program dies with it, and the next run cleans up and recovers.
    let mid = t.path().join("mid");
    let script = format!(
        "echo x > a; mv a b; rm c; touch {}; sleep 60",
        mid.display()
    );
    let mut run = wcmd(&["run", "--fs", &vs, "--", "sh", "-c", &script], &[])
        .current_dir(&v)
        .spawn()
        .unwrap();
    eventually("the program half-way", Duration::from_secs(30), || {
        mid.exists().then_some(())
    });
    run.kill().unwrap();
    run.wait().unwrap();
    assert_eq!(tree(&v), before);
    let (code, _, err) = wrun_in(&v, &["run", "--fs", &vs, "--", "true"], &[]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(tree(&v), before);
    let scratch = t.path().join(".vol.weft/run");
    assert_eq!(
        std::fs::read_dir(&scratch).unwrap().count(),
        0,
        "the crashed run's scratch area is gone"
    );
}

#[test]
fn a_run_inside_a_run_is_a_sub_transaction_of_it() {
    if !can_mount("a_run_inside_a_run") {
        return;
    }
    let t = tempfile::tempdir().unwrap();
    let v = volume(t.path());
    let vs = v.display().to_string();
    // The inner runs share the outer one's node and transaction ($WEFT_NODE,
    // $WEFT_TX); the second fails alone, the outer one sees the first's
    // changes, and they commit with the outer one.
    let script = format!(
        "weft run --fs {vs} -- sh -c 'echo in > n' && cat n > copy && \
         ! weft run --fs {vs} -- sh -c 'echo bad > m; rm c; exit 3' && test -e c && test ! -e m"
    );
    let (code, _, err) = wrun_in(&v, &["run", "--fs", &vs, "--", "sh", "-c", &script], &[]);
    assert_eq!(code, 0, "{err}");
    let after = tree(&v);
    assert_eq!(after.get("n"), Some(&Some("in\n".to_string())));
    assert_eq!(after.get("copy"), Some(&Some("in\n".to_string())));
    assert_eq!(after.get("c"), Some(&Some("old c\n".to_string())));
    assert!(!after.contains_key("m"));
    // An outer failure drops what the inner run committed into it.
    let script = format!("weft run --fs {vs} -- sh -c 'echo in2 > n2'; exit 1");
    let (code, _, err) = wrun_in(&v, &["run", "--fs", &vs, "--", "sh", "-c", &script], &[]);
    assert_eq!(code, 1, "{err}");
    assert!(!v.join("n2").exists());
}

#[test]
fn two_runs_changing_one_file_never_mix_one_commits_the_other_conflicts() {
    if !can_mount("two_runs_changing_one_file") {
        return;
    }
    let t = tempfile::tempdir().unwrap();
    let v = volume(t.path());
    let vs = v.display().to_string();
    let n = NodeProc::start(1, &["--volume", &vs, "--data-dir", &data_dir(t.path(), 1)]);
    let env = [("WEFT_NODE", n.addr.as_str())];
    let flag = |name: &str| t.path().join(name);
    let script = |who: &str| {
        format!(
            "echo {who}1 > c; echo {who}2 > keep/k; touch {}; while [ ! -e {} ]; do sleep 0.02; done",
            flag(&format!("ready{who}")).display(),
            flag(&format!("go{who}")).display()
        )
    };
    let spawn = |who: &str| {
        wcmd(&["run", "--fs", &vs, "--", "sh", "-c", &script(who)], &env)
            .current_dir(&v)
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let a = spawn("A");
    let b = spawn("B");
    for who in ["A", "B"] {
        let f = flag(&format!("ready{who}"));
        eventually(&format!("run {who} ready"), Duration::from_secs(30), || {
            f.exists().then_some(())
        });
    }
    // Both changed both files; A ends first and commits.
    std::fs::write(flag("goA"), b"").unwrap();
    let a = a.wait_with_output().unwrap();
    assert!(a.status.success(), "{}", String::from_utf8_lossy(&a.stderr));
    std::fs::write(flag("goB"), b"").unwrap();
    let b = b.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&b.stderr);
    assert_eq!(
        b.status.code(),
        Some(4),
        "B must fail with a conflict: {err}"
    );
    assert!(err.contains("LockConflict"), "{err}");
    let after = tree(&v);
    assert_eq!(after.get("c"), Some(&Some("A1\n".to_string())));
    assert_eq!(after.get("keep/k"), Some(&Some("A2\n".to_string())));
}

#[test]
fn what_a_volume_cannot_hold_fails_the_run_cleanly() {
    if !can_mount("what_a_volume_cannot_hold") {
        return;
    }
    let t = tempfile::tempdir().unwrap();
    let v = volume(t.path());
    let before = tree(&v);
    let vs = v.display().to_string();
    let (code, _, err) = wrun_in(
        &v,
        &[
            "run",
            "--fs",
            &vs,
            "--",
            "sh",
            "-c",
            "echo x > a; mkfifo pipe",
        ],
        &[],
    );
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("fifo"), "{err}");
    assert_eq!(tree(&v), before);
}

#[test]
fn a_weft_run_killed_at_each_commit_point_is_recovered_by_the_next_run() {
    if !can_mount("a_weft_run_killed_at_each_commit_point") {
        return;
    }
    use std::io::{BufRead, BufReader};
    // (point, whether the transaction's changes survive): the embedded node
    // is the only node, so its commit points are the coordinator's two.
    for (point, survives) in [
        ("coordinator-before-commit-force", false),
        ("coordinator-after-commit-force", true),
    ] {
        let t = tempfile::tempdir().unwrap();
        let v = volume(t.path());
        let before = tree(&v);
        let vs = v.display().to_string();
        let mut run = wcmd(
            &[
                "run",
                "--crash-at",
                point,
                "--fs",
                &vs,
                "--",
                "sh",
                "-c",
                &format!("{SCRIPT} 0"),
            ],
            &[],
        )
        .current_dir(&v)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
        let stderr = run.stderr.take().unwrap();
        let mut seen = String::new();
        for line in BufReader::new(stderr).lines() {
            let line = line.unwrap();
            if line.starts_with("CRASHPOINT") {
                seen = line;
                break;
            }
        }
        assert!(
            !seen.is_empty(),
            "{point}: weft run never reached its crash point"
        );
        run.kill().unwrap();
        run.wait().unwrap();
        // Whatever the crash left, the next run on the volume recovers it.
        let (code, _, err) = wrun_in(&v, &["run", "--fs", &vs, "--", "true"], &[]);
        assert_eq!(code, 0, "{point}: {err}");
        let after = tree(&v);
        if survives {
            assert!(
                after.get("b") == Some(&Some("x\n".to_string()))
                    && !after.contains_key("c")
                    && after.get("keep/k") == Some(&Some("y\n".to_string())),
                "{point}: the committed run must be all there: {after:?}"
            );
        } else {
            assert_eq!(
                after, before,
                "{point}: the undecided run must leave no trace"
            );
        }
        let stage = v.join(".weft-fs/stage");
        let left = std::fs::read_dir(&stage).map(|d| d.count()).unwrap_or(0);
        assert_eq!(left, 0, "{point}: staging left behind");
        let scratch = t.path().join(".vol.weft/run");
        assert_eq!(std::fs::read_dir(&scratch).unwrap().count(), 0, "{point}");
    }
}

#[test]
fn the_programs_files_and_its_weft_commands_commit_or_abort_together() {
    if !can_mount("the_programs_files_and_its_weft_commands") {
        return;
    }
    let t = tempfile::tempdir().unwrap();
    let v = volume(t.path());
    let vs = v.display().to_string();
    // The program's `weft kv` reaches the embedded node ($WEFT_NODE) and
    // joins its default transaction ($WEFT_TX).
    let script = "echo x > f && weft kv put k v && weft kv get k > got && exit";
    let (code, _, err) = wrun_in(
        &v,
        &["run", "--fs", &vs, "--", "sh", "-c", &format!("{script} 1")],
        &[],
    );
    assert_eq!(code, 1, "{err}");
    assert!(!v.join("f").exists() && !v.join("got").exists());
    let (code, _, err) = wrun_in(
        &v,
        &[
            "run",
            "--fs",
            &vs,
            "--",
            "sh",
            "-c",
            "weft kv get k; test $? -eq 1",
        ],
        &[],
    );
    assert_eq!(code, 0, "the aborted run's key is gone: {err}");
    let (code, _, err) = wrun_in(
        &v,
        &["run", "--fs", &vs, "--", "sh", "-c", &format!("{script} 0")],
        &[],
    );
    assert_eq!(code, 0, "{err}");
    assert_eq!(std::fs::read_to_string(v.join("got")).unwrap(), "v\n");
    let (code, out, err) = wrun_in(
        &v,
        &["run", "--fs", &vs, "--", "weft", "kv", "get", "k"],
        &[],
    );
    assert_eq!((code, out.as_str()), (0, "v\n"), "{err}");
}

#[test]
fn without_root_weft_run_mounts_in_a_user_namespace_of_its_own() {
    // Run as `nobody` (from root, with setpriv): the mount namespace must
    // then come with a user namespace.
    let root = Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false);
    let nobody = ["--reuid=65534", "--regid=65534", "--clear-groups"];
    let userns = Command::new("setpriv")
        .args(nobody)
        .args(["unshare", "-m", "-r", "true"])
        .stderr(Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    let reachable = || {
        Command::new("setpriv")
            .args(nobody)
            .arg(env!("CARGO_BIN_EXE_weft"))
            .arg("--version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .map(|s| s.success())
            .unwrap_or(false)
    };
    if !root || !userns || !reachable() {
        eprintln!(
            "SKIPPED without_root_weft_run_mounts_in_a_user_namespace: needs root (to become \
             nobody with setpriv), unprivileged user namespaces, and a weft binary nobody \
             may run; root={root} userns={userns}"
        );
        return;
    }
    let t = tempfile::tempdir().unwrap();
    let base = t.path().join("base");
    let v = volume(&base);
    let chown = Command::new("chown")
        .args(["-R", "65534:65534"])
        .arg(&base)
        .status()
        .unwrap();
    assert!(chown.success());
    let mut perm = std::fs::metadata(t.path()).unwrap().permissions();
    std::os::unix::fs::PermissionsExt::set_mode(&mut perm, 0o755);
    std::fs::set_permissions(t.path(), perm).unwrap();
    let vs = v.display().to_string();
    let out = Command::new("setpriv")
        .args(nobody)
        .arg(env!("CARGO_BIN_EXE_weft"))
        .args(["run", "--fs", &vs, "--", "sh", "-c", &format!("{SCRIPT} 0")])
        .env_remove("WEFT_NODE")
        .env_remove("WEFT_TX")
        .env("HOME", t.path())
        .current_dir(&v)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    let after = tree(&v);
    assert_eq!(after.get("b"), Some(&Some("x\n".to_string())), "{after:?}");
    assert!(!after.contains_key("c"));
}

#[test]
fn runs_under_a_shell_transaction_commit_with_it_at_a_node_serving_the_volume() {
    if !can_mount("runs_under_a_shell_transaction") {
        return;
    }
    let t = tempfile::tempdir().unwrap();
    let v = volume(t.path());
    let vs = v.display().to_string();
    let n = NodeProc::start(1, &["--volume", &vs, "--data-dir", &data_dir(t.path(), 1)]);
    let (code, out, err) = wrun_in(&v, &["tx", "begin", "--node", &n.addr], &[]);
    assert_eq!(code, 0, "{err}");
    let tid = out.lines().next().unwrap().trim().to_string();
    let env = [("WEFT_NODE", n.addr.as_str()), ("WEFT_TX", tid.as_str())];
    let before = tree(&v);
    let (code, _, err) = wrun_in(
        &v,
        &["run", "--fs", &vs, "--", "sh", "-c", "echo 1 > one; rm c"],
        &env,
    );
    assert_eq!(code, 0, "{err}");
    // A failed step: aborted alone.
    let (code, _, err) = wrun_in(
        &v,
        &["run", "--fs", &vs, "--", "sh", "-c", "echo 2 > two; exit 1"],
        &env,
    );
    assert_eq!(code, 1, "{err}");
    assert_eq!(tree(&v), before, "nothing shows before the shell commits");
    let (code, _, err) = wrun_in(&v, &["tx", "commit"], &env);
    assert_eq!(code, 0, "{err}");
    let after = eventually("the commit applied", Duration::from_secs(10), || {
        let t = tree(&v);
        t.contains_key("one").then_some(t)
    });
    assert_eq!(after.get("one"), Some(&Some("1\n".to_string())));
    assert!(
        !after.contains_key("c") && !after.contains_key("two"),
        "{after:?}"
    );
}

#[test]
fn a_run_finds_a_volume_its_node_serves_under_another_name() {
    if !can_mount("a_run_finds_a_volume_its_node_serves_under_another_name") {
        return;
    }
    let t = tempfile::tempdir().unwrap();
    let v = volume(t.path());
    let vs = v.display().to_string();
    let named = format!("docs={vs}");
    let n = NodeProc::start(
        1,
        &["--volume", &named, "--data-dir", &data_dir(t.path(), 1)],
    );
    let env = [("WEFT_NODE", n.addr.as_str())];
    let (code, _, err) = wrun_in(
        &v,
        &["run", "--fs", &vs, "--", "sh", "-c", "echo 1 > one"],
        &env,
    );
    assert_eq!(code, 0, "{err}");
    let after = eventually("the commit applied", Duration::from_secs(10), || {
        let t = tree(&v);
        t.contains_key("one").then_some(t)
    });
    assert_eq!(after.get("one"), Some(&Some("1\n".to_string())));
}
