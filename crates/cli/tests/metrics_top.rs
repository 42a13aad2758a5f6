//! Operating a cluster of real `weft node` processes: the Prometheus
//! endpoint (`--metrics`) counts a known workload exactly and binds to
//! loopback unless told otherwise; `weft top --once --json` shows the
//! cluster, including a transaction left in doubt by a killed coordinator.

mod common;

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Duration;

use common::*;

const SECRET: (&str, &str) = ("WEFT_CLUSTER_SECRET", "metrics-test");

fn free_port() -> String {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().to_string()
}

/// `GET path` on `addr`: (status code, content type, body).
fn http_get(addr: &str, path: &str) -> (u16, String, String) {
    let mut s = TcpStream::connect(addr).expect("connect to the metrics endpoint");
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(s, "GET {path} HTTP/1.1\r\nHost: {addr}\r\n\r\n").unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).expect("read the answer");
    let (head, body) = text.split_once("\r\n\r\n").expect("an HTTP answer");
    let code = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .expect("a status code");
    let ctype = head
        .lines()
        .find_map(|l| l.strip_prefix("Content-Type: "))
        .unwrap_or_default()
        .to_string();
    (code, ctype, body.to_string())
}

/// The samples of a Prometheus text exposition: `name{labels}` -> value.
fn samples(body: &str) -> BTreeMap<String, f64> {
    body.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .filter_map(|l| {
            let (k, v) = l.rsplit_once(' ')?;
            Some((k.to_string(), v.parse().ok()?))
        })
        .collect()
}

/// The value of `key` (0 when absent, as Prometheus reads a counter never
/// incremented).
fn value(s: &BTreeMap<String, f64>, key: &str) -> f64 {
    s.get(key).copied().unwrap_or(0.0)
}

/// The sum of every sample of `name` whose labels contain all of `labels`.
fn sum(s: &BTreeMap<String, f64>, name: &str, labels: &[&str]) -> f64 {
    s.iter()
        .filter(|(k, _)| k.split('{').next() == Some(name) && labels.iter().all(|l| k.contains(l)))
        .map(|(_, v)| v)
        .sum()
}

/// The metrics address a node printed after its ready line.
fn metrics_addr(n: &NodeProc) -> String {
    let line = n.wait_line(" metrics on http://", Duration::from_secs(20));
    line.split("http://")
        .nth(1)
        .and_then(|r| r.strip_suffix("/metrics"))
        .unwrap_or_else(|| panic!("unexpected metrics line: {line}"))
        .to_string()
}

fn wait_alive(addr: &str, want: usize) {
    eventually(
        &format!("{want} nodes alive"),
        Duration::from_secs(20),
        || {
            let (code, out, _) = run(&["status", "--node", addr, "--json"], &[SECRET]);
            if code != 0 {
                return None;
            }
            let v: serde_json::Value = serde_json::from_str(&out).ok()?;
            let alive = v["nodes"]
                .as_array()?
                .iter()
                .filter(|n| n["alive"] == true)
                .count();
            (alive == want).then_some(())
        },
    );
}

/// Begins a transaction at `coord` that writes `key` at each of `at`.
fn begin_and_write(coord: &str, key: &str, at: &[&str]) -> String {
    let (code, out, err) = run(&["tx", "begin", "--node", coord], &[SECRET]);
    assert_eq!(code, 0, "{err}");
    let tid = out.lines().next().unwrap().trim().to_string();
    for node in at {
        let (code, _, err) = run(
            &["kv", "put", "--node", coord, "--at", node, key, "v"],
            &[SECRET, ("WEFT_TX", &tid)],
        );
        assert_eq!(code, 0, "{err}");
    }
    tid
}

#[test]
fn counters_have_the_values_of_a_known_workload() {
    let dir = tempfile::tempdir().unwrap();
    let (d1, d2) = (data_dir(dir.path(), 1), data_dir(dir.path(), 2));
    let n1 = NodeProc::start(
        1,
        &["--data-dir", &d1, "--secret", SECRET.1, "--metrics", "0"],
    );
    let n2 = NodeProc::start(
        2,
        &[
            "--data-dir",
            &d2,
            "--secret",
            SECRET.1,
            "--metrics",
            "0",
            "--join",
            &n1.addr,
        ],
    );
    let (m1, m2) = (metrics_addr(&n1), metrics_addr(&n2));
    wait_alive(&n1.addr, 2);
    let before2 = samples(&http_get(&m2, "/metrics").2);

    // The workload: three transactions that write at both nodes and
    // commit, one that writes at both and is aborted from the shell.
    const COMMITS: usize = 3;
    for i in 0..COMMITS {
        let tid = begin_and_write(&n1.addr, &format!("k{i}"), &["1", "2"]);
        let (code, _, err) = run(&["tx", "commit", "--node", &n1.addr, &tid], &[SECRET]);
        assert_eq!(code, 0, "commit {tid}: {err}");
    }
    let tid = begin_and_write(&n1.addr, "gone", &["1", "2"]);
    let (code, _, err) = run(&["tx", "abort", "--node", &n1.addr, &tid], &[SECRET]);
    assert_eq!(code, 0, "abort {tid}: {err}");

    let (code, ctype, body) = http_get(&m1, "/metrics");
    assert_eq!(code, 200);
    assert!(ctype.starts_with("text/plain; version=0.0.4"), "{ctype}");
    let s1 = samples(&body);
    let report = || format!("node 1 exposes:\n{body}");
    assert_eq!(value(&s1, "weft_tx_begun_total"), 4.0, "{}", report());
    assert_eq!(
        value(&s1, "weft_tx_committed_total"),
        COMMITS as f64,
        "{}",
        report()
    );
    assert_eq!(
        value(&s1, "weft_tx_aborted_total{cause=\"Aborted\"}"),
        1.0,
        "{}",
        report()
    );
    assert_eq!(sum(&s1, "weft_tx_aborted_total", &[]), 1.0, "{}", report());
    assert_eq!(
        value(&s1, "weft_tx_commit_duration_seconds_count"),
        COMMITS as f64,
        "{}",
        report()
    );
    assert_eq!(value(&s1, "weft_tx_in_flight"), 0.0, "{}", report());
    assert_eq!(value(&s1, "weft_tx_in_doubt"), 0.0, "{}", report());
    // Each committed transaction forced its commit record at node 1.
    assert!(
        value(&s1, "weft_log_forces_total") >= COMMITS as f64,
        "{}",
        report()
    );
    assert_eq!(
        value(&s1, "weft_log_force_duration_seconds_count"),
        value(&s1, "weft_log_forces_total"),
        "one duration per force: {}",
        report()
    );
    assert!(
        value(&s1, "weft_log_records_per_force_count") >= 1.0,
        "{}",
        report()
    );
    // The client's four writes at node 1 came in over TCP.
    assert_eq!(
        value(
            &s1,
            "weft_rpc_calls_total{service=\"kv\",status=\"Ok\",channel=\"tcp\"}"
        ),
        4.0,
        "{}",
        report()
    );
    assert!(
        sum(&s1, "weft_transport_links", &[]) >= 1.0,
        "a link to node 2 is up: {}",
        report()
    );
    assert!(sum(&s1, "weft_transport_frames_sent_total", &[]) > 0.0);

    // Node 2 served the four writes relayed by node 1, and prepared (and
    // forced) the three committed ones.
    let s2 = samples(&http_get(&m2, "/metrics").2);
    let delta = |k: &str, labels: &[&str]| sum(&s2, k, labels) - sum(&before2, k, labels);
    assert_eq!(
        delta("weft_rpc_calls_total", &["service=\"kv\"", "status=\"Ok\""]),
        4.0,
        "node 2: {s2:?}"
    );
    assert_eq!(
        value(&s2, "weft_tx_begun_total"),
        0.0,
        "node 2 coordinated nothing"
    );
    assert!(
        delta("weft_log_forces_total", &[]) >= COMMITS as f64,
        "node 2 forced its prepare records: {s2:?}"
    );
    drop((n1, n2));
}

#[test]
fn the_endpoint_binds_to_loopback_and_serves_only_slash_metrics() {
    let n = NodeProc::start(1, &["--secret", SECRET.1, "--metrics", "0"]);
    let addr = metrics_addr(&n);
    let sock: std::net::SocketAddr = addr.parse().unwrap();
    assert!(
        sock.ip().is_loopback(),
        "a bare port must bind loopback, not {sock}"
    );
    let (code, _, body) = http_get(&addr, "/metrics");
    assert_eq!(code, 200);
    assert!(
        body.contains("# TYPE weft_tx_committed_total counter"),
        "{body}"
    );
    assert!(body.contains("# HELP weft_log_forces_total"), "{body}");
    assert_eq!(http_get(&addr, "/").0, 404);
    assert_eq!(http_get(&addr, "/debug").0, 404);
    // A taken port fails the start with a clear error.
    let (code, _, err) = run(
        &[
            "node",
            "--id",
            "9",
            "--listen",
            "127.0.0.1:0",
            "--metrics",
            &addr,
        ],
        &[SECRET],
    );
    assert_ne!(code, 0);
    assert!(err.contains("cannot listen for metrics on"), "{err}");
}

#[test]
fn top_once_json_lists_an_in_doubt_transaction_left_by_a_killed_coordinator() {
    let dir = tempfile::tempdir().unwrap();
    let addrs = [free_port(), free_port(), free_port()];
    let mut nodes = Vec::new();
    for id in 1..=3u32 {
        let data = data_dir(dir.path(), id);
        let mut args = vec!["--data-dir", &data, "--secret", SECRET.1];
        if id == 1 {
            args.extend(["--crash-at", "coordinator-before-commit-force"]);
        } else {
            args.extend(["--join", &addrs[0]]);
        }
        nodes.push(Some(NodeProc::start_at(
            id,
            &addrs[(id - 1) as usize],
            &args,
        )));
    }
    wait_alive(&addrs[0], 3);
    let tid = begin_and_write(&addrs[0], "doubt", &["2", "3"]);
    let mut commit = weft()
        .args([
            "tx",
            "commit",
            "--node",
            &addrs[0],
            "--timeout",
            "60s",
            &tid,
        ])
        .env(SECRET.0, SECRET.1)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    nodes[0]
        .as_ref()
        .unwrap()
        .wait_line("CRASHPOINT", Duration::from_secs(20));
    nodes[0].take().unwrap().kill9();
    let _ = commit.wait();

    // Both participants voted yes and wait for a coordinator that is gone.
    let snap = eventually(
        "weft top to show the dead coordinator and the in-doubt branches",
        Duration::from_secs(30),
        || {
            let (code, out, err) = run(
                &[
                    "top",
                    "--once",
                    "--json",
                    "--interval",
                    "0",
                    "--timeout",
                    "5s",
                    "--node",
                    &addrs[1],
                ],
                &[SECRET],
            );
            assert_eq!(code, 0, "weft top failed: {err}");
            let v: serde_json::Value = serde_json::from_str(&out).expect("one JSON snapshot");
            let n1 = v["nodes"]
                .as_array()?
                .iter()
                .find(|n| n["id"] == 1)?
                .clone();
            let gone = n1["alive"] == false || n1["reachable"] == false;
            let t = v["transactions"]
                .as_array()?
                .iter()
                .find(|t| t["tid"] == tid.as_str())?
                .clone();
            let doubted: Vec<u64> = t["branches"]
                .as_array()?
                .iter()
                .filter(|b| b["in_doubt"] == true)
                .filter_map(|b| b["node"].as_u64())
                .collect();
            (gone && doubted == [2, 3]).then_some(v)
        },
    );
    let t = snap["transactions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["tid"] == tid.as_str())
        .unwrap();
    assert_eq!(t["coordinator"], 1, "{snap}");
    assert_eq!(t["in_doubt"], true, "{snap}");
    for b in t["branches"].as_array().unwrap() {
        assert_eq!(b["parent"], 1, "each branch was called by node 1: {snap}");
        assert_eq!(b["phase"], "prepared", "{snap}");
    }
    for id in [2, 3] {
        let n = snap["nodes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|n| n["id"] == id)
            .unwrap();
        assert_eq!(n["in_doubt"], 1, "node {id}: {snap}");
        assert_eq!(n["reachable"], true, "node {id}: {snap}");
    }
    // The text form names it too.
    let (code, out, err) = run(
        &["top", "--once", "--interval", "0", "--node", &addrs[1]],
        &[SECRET],
    );
    assert_eq!(code, 0, "{err}");
    assert!(out.contains(&tid) && out.contains("prepared!"), "{out}");
    drop(nodes);
}

#[test]
fn group_sends_deliveries_and_replies_are_counted() {
    let n1 = NodeProc::start(1, &["--secret", SECRET.1, "--metrics", "0"]);
    let n2 = NodeProc::start(2, &["--secret", SECRET.1, "--join", &n1.addr]);
    let m1 = metrics_addr(&n1);
    let group = |args: &[&str], node: &str| {
        let mut all = vec!["group"];
        all.extend_from_slice(args);
        all.extend_from_slice(&["--node", node, "--cluster-secret", SECRET.1]);
        run(&all, &[])
    };
    let (code, _, err) = group(&["create", "m:room", "--secret", "gs"], &n1.addr);
    assert_eq!(code, 0, "{err}");
    // A member on node 2 answers every message.
    let mut listener = weft()
        .args([
            "group", "listen", "m:room", "--secret", "gs", "--reply", "pong",
        ])
        .args(["--node", &n2.addr, "--cluster-secret", SECRET.1])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("weft group listen starts");
    let mut said = String::new();
    let mut stderr = std::io::BufReader::new(listener.stderr.take().unwrap());
    std::io::BufRead::read_line(&mut stderr, &mut said).unwrap();
    assert!(said.contains("listening on m:room"), "{said}");
    const SENDS: usize = 2;
    for _ in 0..SENDS {
        let (code, out, err) = group(&["send", "m:room", "ping", "--json"], &n1.addr);
        assert_eq!(code, 0, "{out}{err}");
    }
    let (code, _, _) = group(&["send", "m:nobody", "hi"], &n1.addr);
    assert_ne!(code, 0, "nobody created m:nobody");
    let (_, _, body) = http_get(&m1, "/metrics");
    let s = samples(&body);
    assert_eq!(
        value(&s, "weft_group_sends_total{status=\"Ok\"}"),
        SENDS as f64,
        "{body}"
    );
    assert_eq!(
        sum(&s, "weft_group_sends_total", &[]),
        SENDS as f64 + 1.0,
        "the failed send is counted with its status: {body}"
    );
    assert_eq!(
        value(&s, "weft_group_deliveries_total"),
        SENDS as f64,
        "{body}"
    );
    assert_eq!(
        value(&s, "weft_group_replies_total{status=\"Ok\"}"),
        SENDS as f64,
        "{body}"
    );
    let _ = listener.kill();
    let _ = listener.wait();
}
