//! `weft run` against a real `weft node` (no --fs): the program's default
//! transaction, nesting under `weft tx begin` and under another `weft run`,
//! `weft call` joining `$WEFT_TX`, and the notification transaction that
//! releases a process's leases when it ends.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use common::*;

/// `weft ARGS` with a clean weft environment plus `env`, the `weft` under
/// test first on PATH (so programs run by `weft run` find it).
pub fn wrun(args: &[&str], env: &[(&str, &str)]) -> (i32, String, String) {
    let out = wcmd(args, env).output().expect("weft runs");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

pub fn wcmd(args: &[&str], env: &[(&str, &str)]) -> Command {
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
    let dir = bin.parent().unwrap();
    let path = std::env::var_os("PATH").unwrap_or_default();
    let mut paths = vec![dir.to_path_buf()];
    paths.extend(std::env::split_paths(&path));
    cmd.env("PATH", std::env::join_paths(paths).unwrap());
    cmd.args(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd
}

fn kv_get(node: &str, key: &str) -> Option<String> {
    let (code, out, err) = wrun(&["kv", "get", "--node", node, key], &[]);
    match code {
        0 => Some(out.trim().to_string()),
        1 if err.contains("no such key") => None,
        _ => panic!("kv get {key}: exit {code}: {err}"),
    }
}

#[test]
fn exit_zero_commits_what_the_programs_weft_commands_did_and_anything_else_aborts() {
    let n = NodeProc::start(1, &[]);
    let env = [("WEFT_NODE", n.addr.as_str())];
    let (code, out, err) = wrun(
        &[
            "run",
            "--",
            "sh",
            "-c",
            "echo \"tx=$WEFT_TX\"; weft kv put a 1 && weft kv put b 2",
        ],
        &env,
    );
    assert_eq!(code, 0, "{err}");
    assert!(out.starts_with("tx=t1."), "{out}");
    assert_eq!(kv_get(&n.addr, "a").as_deref(), Some("1"));
    assert_eq!(kv_get(&n.addr, "b").as_deref(), Some("2"));
    // A failing program: its exit status comes back, its writes are gone.
    let (code, _, err) = wrun(&["run", "--", "sh", "-c", "weft kv put c 3; exit 7"], &env);
    assert_eq!(code, 7, "{err}");
    assert!(err.contains("aborted"), "{err}");
    assert_eq!(kv_get(&n.addr, "c"), None);
    // Killed by a signal: 128 + the signal, nothing kept.
    let (code, _, err) = wrun(
        &["run", "--", "sh", "-c", "weft kv put d 4; kill -9 $$"],
        &env,
    );
    assert_eq!(code, 128 + 9, "{err}");
    assert_eq!(kv_get(&n.addr, "d"), None);
}

#[test]
fn weft_call_under_weft_tx_joins_the_transaction() {
    let n1 = NodeProc::start(1, &[]);
    let n2 = NodeProc::start(2, &["--join", &n1.addr]);
    let (code, out, err) = wrun(&["tx", "begin", "--node", &n1.addr], &[]);
    assert_eq!(code, 0, "{err}");
    let tid = out.lines().next().unwrap().trim().to_string();
    let env = [("WEFT_NODE", n1.addr.as_str()), ("WEFT_TX", tid.as_str())];
    let (code, out, err) = eventually("echo@2 answers", Duration::from_secs(10), || {
        let r = wrun(&["call", "echo@2", "hello"], &env);
        (r.0 == 0).then_some(r)
    });
    assert_eq!((code, out.trim()), (0, "hello"), "{err}");
    // Node 2 is now a participant: a child of the coordinator.
    let (code, out, err) = wrun(&["tx", "status"], &env);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("children [2]"), "{out}");
    // A transaction the coordinator does not know: the call is refused.
    let (code, _, err) = wrun(&["call", "--tx", &format!("{}9", tid), "echo@2", "x"], &env);
    assert_eq!(code, 4, "{err}");
    assert!(err.contains("NoSuchTransaction"), "{err}");
    let (code, _, err) = wrun(&["tx", "commit"], &env);
    assert_eq!(code, 0, "{err}");
    drop(n2);
}

#[test]
fn a_run_under_a_shell_transaction_or_another_run_is_a_sub_transaction() {
    let n = NodeProc::start(1, &[]);
    let (code, out, err) = wrun(&["tx", "begin", "--node", &n.addr], &[]);
    assert_eq!(code, 0, "{err}");
    let tid = out.lines().next().unwrap().trim().to_string();
    let env = [("WEFT_NODE", n.addr.as_str()), ("WEFT_TX", tid.as_str())];
    let (code, _, err) = wrun(&["run", "--", "weft", "kv", "put", "s1", "kept"], &env);
    assert_eq!(code, 0, "{err}");
    // A failed step aborts alone: the enclosing transaction goes on.
    let (code, _, err) = wrun(
        &["run", "--", "sh", "-c", "weft kv put s2 lost; exit 1"],
        &env,
    );
    assert_eq!(code, 1, "{err}");
    // A run inside a run: a sub-transaction of a sub-transaction.
    let (code, out, err) = wrun(
        &[
            "run",
            "--",
            "sh",
            "-c",
            "weft run -- sh -c 'echo \"$WEFT_TX\"; weft kv put s3 nested'",
        ],
        &env,
    );
    assert_eq!(code, 0, "{err}");
    assert!(
        out.trim().starts_with(&tid) && out.trim().matches('/').count() == 2,
        "{out}"
    );
    // Before the shell's commit the write belongs to its transaction: another
    // transaction cannot read it.
    let (code, _, err) = wrun(&["kv", "get", "--node", &n.addr, "s1"], &[]);
    assert_eq!(code, 4, "{err}");
    assert!(err.contains("LockConflict"), "{err}");
    let (code, _, err) = wrun(&["tx", "commit"], &env);
    assert_eq!(code, 0, "{err}");
    assert_eq!(kv_get(&n.addr, "s1").as_deref(), Some("kept"));
    assert_eq!(kv_get(&n.addr, "s2"), None);
    assert_eq!(kv_get(&n.addr, "s3").as_deref(), Some("nested"));
}

fn wait_for_file(p: &Path) {
    eventually(&format!("{}", p.display()), Duration::from_secs(20), || {
        p.exists().then_some(())
    });
}

#[test]
fn a_lease_goes_when_its_process_ends_though_the_default_transaction_lives_on() {
    let n = NodeProc::start(1, &[]);
    let t = tempfile::tempdir().unwrap();
    let held = t.path().join("held");
    let go = t.path().join("go");
    // One shell transaction shared by two processes: the lease is the
    // process's, not the transaction's.
    let (code, out, err) = wrun(&["tx", "begin", "--node", &n.addr], &[]);
    assert_eq!(code, 0, "{err}");
    let tid = out.lines().next().unwrap().trim().to_string();
    let env = [("WEFT_NODE", n.addr.as_str()), ("WEFT_TX", tid.as_str())];
    let script = format!(
        "weft lease acquire deploy && touch {} && while [ ! -e {} ]; do sleep 0.05; done",
        held.display(),
        go.display()
    );
    let mut first = wcmd(&["run", "--", "sh", "-c", &script], &env)
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    wait_for_file(&held);
    let (code, _, err) = wrun(&["run", "--", "weft", "lease", "acquire", "deploy"], &env);
    assert_eq!(code, 4, "a held lease is refused: {err}");
    assert!(err.contains("LockConflict"), "{err}");
    // Without a process to hold it for, a lease is refused.
    let (code, _, err) = wrun(&["lease", "acquire", "x", "--node", &n.addr], &[]);
    assert_eq!(code, 2, "{err}");
    std::fs::write(&go, b"").unwrap();
    assert!(first.wait().unwrap().success());
    // The first process ended: its lease went with it, while the shell's
    // transaction is still running.
    let (code, out, _) = wrun(&["lease", "list", "--node", &n.addr], &[]);
    assert_eq!((code, out.as_str()), (0, ""));
    let (code, out, _) = wrun(&["tx", "status"], &env);
    assert_eq!(code, 0);
    assert!(out.contains("active"), "{out}");
    let (code, _, err) = wrun(&["run", "--", "weft", "lease", "acquire", "deploy"], &env);
    assert_eq!(code, 0, "{err}");
    // A process killed with SIGKILL loses its lease too (weft run sees it
    // end).
    let (code, _, err) = wrun(
        &[
            "run",
            "--",
            "sh",
            "-c",
            "weft lease acquire k && kill -9 $$",
        ],
        &env,
    );
    assert_eq!(code, 137, "{err}");
    let (_, out, _) = wrun(&["lease", "list", "--node", &n.addr], &[]);
    assert_eq!(out, "");
    let (code, _, _) = wrun(&["tx", "abort"], &env);
    assert_eq!(code, 0);
}
