//! Real `weft node` processes driven by the `weft` command line.

mod common;

use std::time::Duration;

use common::*;

fn status_json(addr: &str) -> Option<serde_json::Value> {
    let (code, out, _) = run(&["status", "--node", addr, "--json", "--secret", "s3"], &[]);
    if code != 0 {
        return None;
    }
    serde_json::from_str(&out).ok()
}

fn alive_ids(v: &serde_json::Value) -> Vec<u64> {
    v["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|n| n["alive"].as_bool() == Some(true))
        .map(|n| n["id"].as_u64().unwrap())
        .collect()
}

#[test]
fn status_json_shows_the_cluster_and_follows_a_death() {
    let n1 = NodeProc::start(1, &["--secret", "s3"]);
    let n2 = NodeProc::start(2, &["--secret", "s3", "--join", &n1.addr]);
    let mut n3 = NodeProc::start(3, &["--secret", "s3", "--join", &n2.addr]);
    let v = eventually("three live nodes", Duration::from_secs(10), || {
        status_json(&n1.addr).filter(|v| alive_ids(v) == vec![1, 2, 3])
    });
    for n in v["nodes"].as_array().unwrap() {
        assert!(n["addr"].as_str().unwrap().starts_with("127.0.0.1:"), "{n}");
        assert!(n["id"].is_u64() && n["alive"].is_boolean());
    }
    assert_eq!(v["directory"], 1);
    // The view is the same from another node.
    eventually("node 3 sees everyone", Duration::from_secs(10), || {
        status_json(&n3.addr).filter(|v| alive_ids(v) == vec![1, 2, 3])
    });
    n3.kill9();
    eventually("node 3 seen dead", Duration::from_secs(10), || {
        status_json(&n2.addr).filter(|v| alive_ids(v) == vec![1, 2])
    });
    drop(n2);
}

#[test]
fn a_wrong_secret_is_refused_with_a_clear_error() {
    let n1 = NodeProc::start(1, &["--secret", "right"]);
    let (code, _, err) = run(&["status", "--node", &n1.addr, "--secret", "wrong"], &[]);
    assert_ne!(code, 0);
    assert!(err.contains("WrongSecret"), "{err}");
    // A node with the wrong secret cannot join either.
    let out = weft()
        .args([
            "node",
            "--id",
            "2",
            "--listen",
            "127.0.0.1:0",
            "--secret",
            "wrong",
            "--join",
            &n1.addr,
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("WrongSecret"), "{err}");
}

#[test]
fn call_tx_and_kv_from_a_shell() {
    let n1 = NodeProc::start(1, &["--secret", "s3"]);
    let n2 = NodeProc::start(2, &["--secret", "s3", "--join", &n1.addr]);
    eventually("two nodes", Duration::from_secs(10), || {
        status_json(&n1.addr).filter(|v| alive_ids(v) == vec![1, 2])
    });
    let env = [("WEFT_CLUSTER_SECRET", "s3")];
    let (code, out, err) = run(&["call", "--node", &n1.addr, "echo@2", "hello weft"], &env);
    assert_eq!(code, 0, "{err}");
    assert_eq!(out.trim(), "hello weft");
    let (code, _, err) = run(&["call", "--node", &n1.addr, "nosuch@2", "x"], &env);
    assert_eq!(code, 2, "NoSuchService exits 2");
    assert!(err.contains("NoSuchService"), "{err}");

    // A default transaction per command.
    let (code, _, err) = run(
        &[
            "kv", "put", "--node", &n1.addr, "--at", "2", "color", "blue",
        ],
        &env,
    );
    assert_eq!(code, 0, "{err}");
    let (code, out, _) = run(&["kv", "get", "--node", &n2.addr, "color"], &env);
    assert_eq!((code, out.trim()), (0, "blue"));

    // An explicit transaction across commands: begin, write on both nodes
    // (one through a node that is not the coordinator), abort: nothing stays.
    let (code, out, err) = run(&["tx", "begin", "--node", &n1.addr], &env);
    assert_eq!(code, 0, "{err}");
    let tid = out.lines().next().unwrap().trim().to_string();
    assert!(out.contains(&format!("export WEFT_TX={tid}")), "{out}");
    let txenv = [("WEFT_CLUSTER_SECRET", "s3"), ("WEFT_TX", tid.as_str())];
    let (code, _, err) = run(&["kv", "put", "--node", &n2.addr, "color", "red"], &txenv);
    assert_eq!(code, 0, "{err}");
    let (code, _, err) = run(
        &["kv", "put", "--node", &n1.addr, "--at", "1", "size", "L"],
        &txenv,
    );
    assert_eq!(code, 0, "{err}");
    let (code, out, err) = run(&["tx", "list", "--node", &n2.addr, "--json"], &env);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains(&tid), "node 2 lists the transaction: {out}");
    let (code, _, err) = run(&["tx", "abort", "--node", &n2.addr], &txenv);
    assert_eq!(code, 0, "{err}");
    let (_, out, _) = run(
        &["kv", "get", "--node", &n1.addr, "--at", "2", "color"],
        &env,
    );
    assert_eq!(out.trim(), "blue", "the aborted write left no trace");
    let (code, _, _) = run(&["kv", "get", "--node", &n1.addr, "size"], &env);
    assert_eq!(code, 1, "no such key");

    // Now commit one.
    let (_, out, _) = run(&["tx", "begin", "--node", &n2.addr], &env);
    let tid = out.lines().next().unwrap().trim().to_string();
    let txenv = [("WEFT_CLUSTER_SECRET", "s3"), ("WEFT_TX", tid.as_str())];
    let (code, _, err) = run(
        &["kv", "put", "--node", &n1.addr, "--at", "1", "size", "M"],
        &txenv,
    );
    assert_eq!(code, 0, "{err}");
    let (code, out, err) = run(&["tx", "status", "--node", &n1.addr], &txenv);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("active"), "{out}");
    let (code, out, err) = run(&["tx", "commit", "--node", &n1.addr], &txenv);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("committed"));
    let (_, out, _) = run(
        &["kv", "get", "--node", &n2.addr, "--at", "1", "size"],
        &env,
    );
    assert_eq!(out.trim(), "M");
}

#[test]
fn a_node_shuts_down_cleanly_on_sigterm() {
    let n1 = NodeProc::start(1, &[]);
    let mut n2 = NodeProc::start(2, &["--join", &n1.addr]);
    let status = n2.terminate();
    assert!(status.success(), "{status:?}");
    let v = eventually("node 2 left", Duration::from_secs(10), || {
        let (code, out, _) = run(&["status", "--node", &n1.addr, "--json"], &[]);
        (code == 0)
            .then(|| serde_json::from_str::<serde_json::Value>(&out).unwrap())
            .filter(|v| {
                v["nodes"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .all(|n| n["id"] != 2 || n["alive"] == false)
            })
    });
    assert!(v["nodes"].is_array());
}
