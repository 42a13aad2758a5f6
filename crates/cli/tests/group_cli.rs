//! `weft group` against real `weft node` processes: create, listen with a
//! reply, send, list, and the statuses a shell user sees.

mod common;

use std::io::{BufRead, BufReader};
use std::process::Stdio;
use std::sync::mpsc;
use std::time::Duration;

use common::*;

const CLUSTER: &str = "cs";

fn group(args: &[&str], node: &str) -> (i32, String, String) {
    let mut all = vec!["group"];
    all.extend_from_slice(args);
    all.extend_from_slice(&["--node", node, "--cluster-secret", CLUSTER]);
    run(&all, &[])
}

#[test]
fn create_listen_send_and_list_across_two_processes() {
    let n1 = NodeProc::start(1, &["--secret", CLUSTER]);
    let n2 = NodeProc::start(2, &["--secret", CLUSTER, "--join", &n1.addr]);
    let (code, _, err) = group(&["create", "chat:room", "--secret", "gs"], &n1.addr);
    assert_eq!(code, 0, "{err}");

    // A listener on node 2 answers every message.
    let mut listener = weft()
        .args([
            "group",
            "listen",
            "chat:room",
            "--secret",
            "gs",
            "--reply",
            "pong",
        ])
        .args(["--node", &n2.addr, "--cluster-secret", CLUSTER])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("weft group listen starts");
    let stderr = listener.stderr.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let ready = rx
        .recv_timeout(Duration::from_secs(20))
        .expect("the listener says it listens");
    assert!(ready.contains("listening on chat:room"), "{ready}");

    let (code, out, err) = group(&["send", "chat:room", "ping", "--json"], &n1.addr);
    assert_eq!(code, 0, "{out}{err}");
    let report: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(report["delivered"], 1, "{report}");
    assert_eq!(report["status"], "Ok", "{report}");
    let replies = report["replies"].as_array().unwrap();
    assert_eq!(replies.len(), 1, "{report}");
    assert_eq!(replies[0]["body"], "pong");

    let (code, out, err) = group(&["ls", "--json"], &n2.addr);
    assert_eq!(code, 0, "{err}");
    let groups: serde_json::Value = serde_json::from_str(&out).unwrap();
    let listed = groups.as_array().unwrap();
    assert!(listed.iter().any(|g| g["gid"] == "chat:room"), "{groups}");
    let _ = listener.kill();
    let _ = listener.wait();
    drop(n2);
}

#[test]
fn wrong_secrets_unknown_groups_and_bad_names_get_their_statuses() {
    let n1 = NodeProc::start(1, &["--secret", CLUSTER]);
    let (code, _, err) = group(&["create", "chat:room", "--secret", "gs"], &n1.addr);
    assert_eq!(code, 0, "{err}");

    // The group's secret guards joining.
    let (code, _, err) = group(&["destroy", "chat:room", "--secret", "nope"], &n1.addr);
    assert_eq!(code, 5, "{err}");
    assert!(err.contains("WrongSecret"), "{err}");

    // Sending to a group nobody created.
    let (code, _, err) = group(&["send", "chat:nobody", "hi"], &n1.addr);
    assert_ne!(code, 0);
    assert!(err.contains("NoSuchGroup"), "{err}");

    // A name that is not `class:name`.
    let (code, _, err) = group(&["send", "no-colon", "hi"], &n1.addr);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("AddrError"), "{err}");

    // The cluster's secret guards the node itself.
    let (code, _, err) = run(
        &[
            "group",
            "ls",
            "--node",
            &n1.addr,
            "--cluster-secret",
            "wrong",
        ],
        &[],
    );
    assert_eq!(code, 5, "{err}");
    assert!(err.contains("WrongSecret"), "{err}");
}
