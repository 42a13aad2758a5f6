//! Real `weft node` processes over mutual TLS: `weft tls init` makes the
//! certificates, three nodes (shared memory off, so every link is TCP inside
//! TLS) run a transaction across all of them, and the ends that must be
//! refused are: a plaintext client, a plaintext node, a client whose
//! certificate another CA signed, a client whose certificate is not
//! complete.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::time::Duration;

use common::*;

fn tls_flags(dir: &Path, who: &str) -> Vec<String> {
    vec![
        "--tls-cert".into(),
        dir.join(format!("{who}.crt")).display().to_string(),
        "--tls-key".into(),
        dir.join(format!("{who}.key")).display().to_string(),
        "--tls-ca".into(),
        dir.join("ca.crt").display().to_string(),
    ]
}

fn client_env(dir: &Path) -> Vec<(String, String)> {
    vec![
        ("WEFT_CLUSTER_SECRET".into(), "s3".into()),
        (
            "WEFT_TLS_CERT".into(),
            dir.join("client.crt").display().to_string(),
        ),
        (
            "WEFT_TLS_KEY".into(),
            dir.join("client.key").display().to_string(),
        ),
        (
            "WEFT_TLS_CA".into(),
            dir.join("ca.crt").display().to_string(),
        ),
    ]
}

fn run_env(args: &[&str], env: &[(String, String)]) -> (i32, String, String) {
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    run(args, &env)
}

fn start_tls(dir: &Path, id: u32, join: Option<&str>) -> NodeProc {
    let mut extra: Vec<String> = vec!["--secret".into(), "s3".into(), "--no-shm".into()];
    extra.extend(tls_flags(dir, &format!("node-{id}")));
    if let Some(j) = join {
        extra.push("--join".into());
        extra.push(j.into());
    }
    let extra: Vec<&str> = extra.iter().map(|s| s.as_str()).collect();
    NodeProc::start(id, &extra)
}

#[test]
fn a_tls_cluster_of_processes_commits_and_refuses_outsiders() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("tls");
    let d = dir.display().to_string();
    let (code, out, err) = run(&["tls", "init", &d, "--nodes", "1,2,3"], &[]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("wrote"), "{out}");
    for f in [
        "ca.crt",
        "node-1.crt",
        "node-3.key",
        "client.crt",
        "client.key",
    ] {
        assert!(dir.join(f).exists(), "{f} missing");
    }
    let mode = std::fs::metadata(dir.join("node-2.key"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o077, 0, "a key readable by others: {mode:o}");
    // Running it again does not overwrite the cluster's certificates.
    let (code, _, err) = run(&["tls", "init", &d], &[]);
    assert_ne!(code, 0);
    assert!(err.contains("exists already"), "{err}");

    let n1 = start_tls(&dir, 1, None);
    let n2 = start_tls(&dir, 2, Some(&n1.addr));
    let n3 = start_tls(&dir, 3, Some(&n2.addr));
    let env = client_env(&dir);
    eventually("three live nodes over TLS", Duration::from_secs(20), || {
        let (code, out, _) = run_env(&["status", "--node", &n1.addr, "--json"], &env);
        let v: serde_json::Value = serde_json::from_str(&out).ok()?;
        let alive = v["nodes"]
            .as_array()?
            .iter()
            .filter(|n| n["alive"] == true)
            .count();
        (code == 0 && alive == 3).then_some(())
    });
    // The links between nodes are TCP inside TLS.
    let (code, out, err) = run_env(&["status", "--node", &n1.addr], &env);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("tcp+tls"), "{out}");

    // One transaction writing on all three nodes, begun on node 1 and
    // committed through node 3.
    let (code, out, err) = run_env(&["tx", "begin", "--node", &n1.addr], &env);
    assert_eq!(code, 0, "{err}");
    let tid = out.lines().next().unwrap().trim().to_string();
    let mut txenv = env.clone();
    txenv.push(("WEFT_TX".into(), tid.clone()));
    for at in ["1", "2", "3"] {
        let (code, _, err) = run_env(
            &["kv", "put", "--node", &n2.addr, "--at", at, "color", "teal"],
            &txenv,
        );
        assert_eq!(code, 0, "put at {at}: {err}");
    }
    let (code, out, err) = run_env(&["tx", "commit", "--node", &n3.addr], &txenv);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("committed"), "{out}");
    for at in ["1", "2", "3"] {
        let (code, out, err) = run_env(
            &["kv", "get", "--node", &n1.addr, "--at", at, "color"],
            &env,
        );
        assert_eq!((code, out.trim()), (0, "teal"), "get at {at}: {err}");
    }
    // The group command takes the same flags.
    let (code, _, err) = run_env(&["group", "ls", "--node", &n1.addr], &env);
    assert_eq!(code, 0, "{err}");

    // A plaintext client is refused with a clear error, and its write is
    // not acted on.
    let plain = [("WEFT_CLUSTER_SECRET", "s3")];
    let (code, _, err) = run(
        &["kv", "put", "--node", &n1.addr, "--at", "1", "color", "red"],
        &plain,
    );
    assert_ne!(code, 0);
    assert!(err.contains("requires TLS"), "{err}");
    // A client with a certificate from another CA is refused.
    let other = tmp.path().join("other");
    let (code, _, err) = run(&["tls", "init", &other.display().to_string()], &[]);
    assert_eq!(code, 0, "{err}");
    let (code, _, err) = run_env(
        &["kv", "put", "--node", &n1.addr, "--at", "1", "color", "red"],
        &client_env(&other),
    );
    assert_ne!(code, 0);
    assert!(err.contains("UnknownIssuer"), "{err}");
    // Trusting this cluster's CA does not help a certificate it did not sign.
    let mut cheat = client_env(&other);
    cheat[3].1 = dir.join("ca.crt").display().to_string();
    let (code, _, err) = run_env(
        &["kv", "put", "--node", &n1.addr, "--at", "1", "color", "red"],
        &cheat,
    );
    assert_ne!(code, 0);
    assert!(err.contains("refused this end's certificate"), "{err}");
    let (_, out, _) = run_env(
        &["kv", "get", "--node", &n1.addr, "--at", "1", "color"],
        &env,
    );
    assert_eq!(out.trim(), "teal", "a refused client's write was acted on");
    // Two of three TLS flags is an error that says what is missing.
    let (code, _, err) = run(
        &[
            "status",
            "--node",
            &n1.addr,
            "--tls-cert",
            &dir.join("client.crt").display().to_string(),
        ],
        &[],
    );
    assert_ne!(code, 0);
    assert!(err.contains("all three"), "{err}");

    // A plaintext node cannot join.
    let out = weft()
        .args(["node", "--id", "4", "--listen", "127.0.0.1:0", "--no-shm"])
        .args(["--secret", "s3", "--join", &n1.addr, "--join-timeout", "0s"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("requires TLS"), "{err}");
    drop((n3, n2, n1));
}
