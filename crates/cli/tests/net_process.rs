//! 2CA with real processes: `weft net proxy`, the transactional line server
//! `weft net serve` behind it, and an unmodified peer (a plain
//! `std::net::TcpStream`). The server or the proxy is killed with SIGKILL
//! before, during and after a commit; the peer must see exactly the
//! committed answers, once, in order, and no byte of an aborted attempt.
//! The `delegated_*` tests run the server with `--delegate-commit` (the
//! proxy decides, one forced record per transaction) and kill the server or
//! the proxy before the proxy's commit record is forced, after it is forced
//! and before the decision reaches the server, and after the release.

mod common;

use common::{free_port, tid_of};

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

/// A process whose stdout lines are collected.
struct Proc {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: mpsc::Receiver<String>,
    ready: String,
}

impl Proc {
    fn spawn(args: &[&str]) -> Proc {
        let mut child = Command::new(env!("CARGO_BIN_EXE_weft"))
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("weft starts");
        let stdin = child.stdin.take();
        let out = child.stdout.take().expect("piped");
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for l in BufReader::new(out).lines().map_while(Result::ok) {
                if tx.send(l).is_err() {
                    return;
                }
            }
        });
        // A hang guard, not a speed bound.
        let ready = lines
            .recv_timeout(Duration::from_secs(60))
            .expect("a ready line");
        Proc {
            child,
            stdin,
            lines,
            ready,
        }
    }

    /// Lets a transaction held by `--pause-at` go on.
    fn go(&mut self) {
        let stdin = self.stdin.as_mut().expect("stdin piped");
        stdin.write_all(b"go\n").unwrap();
        stdin.flush().unwrap();
    }

    /// The word after `key` in the ready line.
    fn field(&self, key: &str) -> String {
        self.ready
            .split(&format!(" {key} "))
            .nth(1)
            .and_then(|r| r.split_whitespace().next())
            .unwrap_or_else(|| panic!("no {key} in {:?}", self.ready))
            .to_string()
    }

    fn wait_line(&self, prefix: &str) -> String {
        loop {
            let l = self
                .lines
                .recv_timeout(Duration::from_secs(60))
                .unwrap_or_else(|_| panic!("no line starting with {prefix:?}"));
            if l.starts_with(prefix) {
                return l;
            }
        }
    }

    fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill9();
    }
}

const FD: [&str; 4] = ["--heartbeat", "50ms", "--dead-after", "500ms"];

fn proxy(upstream: &str, data: &Path, extra: &[&str]) -> Proc {
    let d = data.to_str().unwrap();
    let mut args = vec![
        "net",
        "proxy",
        "--listen",
        "127.0.0.1:0",
        "--upstream",
        upstream,
        "--data-dir",
        d,
    ];
    args.extend(FD);
    args.extend(extra);
    Proc::spawn(&args)
}

/// The server listens (as a node) at `listen`: a restart reuses it, so the
/// proxy takes the new incarnation for the old one.
fn server(accept: &str, listen: &str, join: &str, data: &Path, extra: &[&str]) -> Proc {
    let d = data.to_str().unwrap();
    let mut args = vec![
        "net",
        "serve",
        "--id",
        "2",
        "--listen",
        listen,
        "--join",
        join,
        "--accept",
        accept,
        "--proxy-node",
        "1",
        "--data-dir",
        d,
        "--shm",
        "off",
    ];
    args.extend(FD);
    args.extend(extra);
    Proc::spawn(&args)
}

fn peers_addr(proxy: &Proc) -> String {
    proxy.field("peers on").to_string()
}

/// Everything the peer reads until the proxy closes (a reset counts as the
/// end too: the bytes read before it are what the peer saw).
fn read_all(peer: &mut TcpStream) -> Vec<u8> {
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match peer.read(&mut buf) {
            Ok(0) | Err(_) => return got,
            Ok(n) => got.extend_from_slice(&buf[..n]),
        }
    }
}

struct World {
    _dir: tempfile::TempDir,
    proxy: Proc,
    server: Proc,
    accept: String,
    peer: TcpStream,
}

fn world(server_extra: &[&str], proxy_extra: &[&str]) -> World {
    let dir = tempfile::tempdir().unwrap();
    let accept = format!("127.0.0.1:{}", free_port());
    let proxy = proxy(&accept, &dir.path().join("proxy"), proxy_extra);
    let node = proxy.field("on");
    let listen = format!("127.0.0.1:{}", free_port());
    let server = server(
        &accept,
        &listen,
        &node,
        &dir.path().join("server"),
        server_extra,
    );
    let mut peer = TcpStream::connect(peers_addr(&proxy)).unwrap();
    peer.write_all(b"a\nb\nc\n").unwrap();
    World {
        _dir: dir,
        proxy,
        server,
        accept,
        peer,
    }
}

#[test]
fn server_killed_before_commit_the_peer_gets_only_earlier_commits() {
    let mut w = world(&["--abort-first", "--stop-before-commit", "1"], &[]);
    w.server.wait_line("STOPPED before-commit 1");
    // `weft net ls` shows the transaction running, its answer held, and the
    // counts so far (each request's first attempt aborted and restarted).
    let node = w.proxy.field("on");
    let out = Command::new(env!("CARGO_BIN_EXE_weft"))
        .args(["net", "ls", "--node", &node, "--json"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let c = &v.as_array().unwrap()[0];
    assert_eq!(c["state"], "IN_TRANS", "{c}");
    assert_eq!(c["stats"]["held_bytes"], 5, "{c}");
    assert_eq!(c["stats"]["committed"], 1, "{c}");
    assert_eq!(c["stats"]["aborted"], 2, "{c}");
    assert_eq!(c["stats"]["restarted"], 2, "{c}");
    w.server.kill9();
    // The proxy learns its coordinator died, aborts, drops what it held and
    // closes the peer's connection.
    let got = read_all(&mut w.peer);
    assert_eq!(String::from_utf8_lossy(&got), "ok a\n");
}

#[test]
fn server_killed_after_commit_the_peer_gets_the_committed_answer_once() {
    let mut w = world(&["--abort-first", "--stop-after-commit", "1"], &[]);
    w.server.wait_line("STOPPED after-commit 1");
    w.server.kill9();
    let got = read_all(&mut w.peer);
    assert_eq!(String::from_utf8_lossy(&got), "ok a\nok b\n");
}

#[test]
fn server_killed_with_the_decision_durable_but_unsent_delivers_exactly_once_after_its_restart() {
    let dir = tempfile::tempdir().unwrap();
    let accept = format!("127.0.0.1:{}", free_port());
    let proxy = proxy(&accept, &dir.path().join("proxy"), &[]);
    let node = proxy.field("on");
    let sdir = dir.path().join("server");
    let listen = format!("127.0.0.1:{}", free_port());
    let mut srv = server(
        &accept,
        &listen,
        &node,
        &sdir,
        &["--crash-at", "coordinator-after-commit-force"],
    );
    let mut peer = TcpStream::connect(peers_addr(&proxy)).unwrap();
    peer.write_all(b"a\n").unwrap();
    // The commit record of the first answer is durable; no decision was sent.
    srv.wait_line("CRASHPOINT");
    srv.kill9();
    // The proxy is prepared and in doubt; the restarted server redrives the
    // decision and the proxy releases the held answer.
    let _srv2 = server(&accept, &listen, &node, &sdir, &[]);
    let got = read_all(&mut peer);
    assert_eq!(String::from_utf8_lossy(&got), "ok a\n");
}

#[test]
fn proxy_killed_mid_transaction_the_peer_sees_no_byte_of_it() {
    let mut w = world(&["--stop-before-commit", "1"], &[]);
    w.server.wait_line("STOPPED before-commit 1");
    w.proxy.kill9();
    let got = read_all(&mut w.peer);
    // The first answer committed; the second never reaches the peer.
    assert_eq!(String::from_utf8_lossy(&got), "ok a\n");
    let _ = &w.accept;
}

#[test]
fn proxy_killed_after_the_decision_before_release_reports_the_output_it_could_not_deliver() {
    let dir = tempfile::tempdir().unwrap();
    let accept = format!("127.0.0.1:{}", free_port());
    let node_listen = format!("127.0.0.1:{}", free_port());
    let pdir = dir.path().join("proxy");
    let mut p = proxy(
        &accept,
        &pdir,
        &[
            "--node-listen",
            &node_listen,
            "--crash-at",
            "participant-phase-two",
        ],
    );
    let listen = format!("127.0.0.1:{}", free_port());
    let _srv = server(
        &accept,
        &listen,
        &node_listen,
        &dir.path().join("server"),
        &[],
    );
    let mut peer = TcpStream::connect(peers_addr(&p)).unwrap();
    peer.write_all(b"a\n").unwrap();
    // The commit decision reached the proxy; it has not released the answer.
    let line = p.wait_line("CRASHPOINT");
    let tid = line.split_whitespace().nth(2).unwrap().to_string();
    p.kill9();
    // The peer's connection ended with the proxy: not a byte of the answer.
    let got = read_all(&mut peer);
    assert_eq!(String::from_utf8_lossy(&got), "");
    // The restarted proxy finds the prepared output in its log and says it
    // could not be delivered.
    let p2 = proxy(&accept, &pdir, &["--node-listen", &node_listen]);
    let u = p2.wait_line("UNDELIVERABLE");
    assert!(
        u.starts_with(&format!("UNDELIVERABLE {tid} 5 bytes")),
        "{u}"
    );
}

/// SMA: the peer connects to the server itself; the logger is in its process.
fn sma_world(extra: &[&str]) -> (tempfile::TempDir, Proc, TcpStream) {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().join("server");
    let mut args = vec![
        "net",
        "serve",
        "--sma",
        "--id",
        "1",
        "--listen",
        "127.0.0.1:0",
        "--accept",
        "127.0.0.1:0",
        "--data-dir",
        d.to_str().unwrap(),
        "--shm",
        "off",
    ];
    args.extend(extra);
    let srv = Proc::spawn(&args);
    let peer = TcpStream::connect(srv.field("accepting on")).unwrap();
    (dir, srv, peer)
}

#[test]
fn sma_server_killed_before_commit_the_peer_gets_only_earlier_commits() {
    let (_d, mut srv, mut peer) = sma_world(&["--abort-first", "--stop-before-commit", "1"]);
    peer.write_all(b"a\nb\n").unwrap();
    srv.wait_line("STOPPED before-commit 1");
    // The first answer committed and was released.
    let mut first = [0u8; 5];
    peer.read_exact(&mut first).unwrap();
    assert_eq!(&first, b"ok a\n");
    srv.kill9();
    // The connection ends (closed or reset): nothing of the second
    // transaction, nor of the aborted attempts, ever arrives.
    let rest = read_all(&mut peer);
    assert_eq!(String::from_utf8_lossy(&rest), "");
}

#[test]
fn sma_server_killed_after_commit_the_peer_never_sees_an_aborted_byte() {
    let (_d, mut srv, mut peer) = sma_world(&["--abort-first", "--stop-after-commit", "1"]);
    peer.write_all(b"a\nb\n").unwrap();
    srv.wait_line("STOPPED after-commit 1");
    let mut first = [0u8; 5];
    peer.read_exact(&mut first).unwrap();
    assert_eq!(&first, b"ok a\n");
    srv.kill9();
    let rest = String::from_utf8_lossy(&read_all(&mut peer)).to_string();
    // SMA makes no durability claim: the second answer was handed to the
    // connection's writer at commit and may or may not have left before the
    // kill (or a reset may discard it at the peer); nothing else may appear.
    assert!(rest.is_empty() || rest == "ok b\n", "{rest:?}");
}

// ---- One force per transaction: the server hands the decision to the proxy.

const DELEGATE: &str = "--delegate-commit";

#[test]
fn delegated_server_killed_before_the_proxys_force_aborts_and_the_peer_gets_only_earlier_commits() {
    let mut w = world(
        &[DELEGATE],
        &["--pause-at", "before-vote", "--pause-tx", "1"],
    );
    // The second transaction's one-phase prepare reached the proxy; it has
    // not voted, nothing of it is forced.
    let tid = tid_of(&w.proxy.wait_line("PAUSED before-vote"));
    w.server.kill9();
    // The proxy, not yet the decider, aborts when its coordinator dies,
    // drops the held answer and closes the peer's connection.
    let got = read_all(&mut w.peer);
    assert_eq!(String::from_utf8_lossy(&got), "ok a\n");
    // Its late vote changes nothing: it votes no on a transaction gone.
    w.proxy.go();
    common::wait_forgotten(&w.proxy.field("on"), &tid, &[]);
}

#[test]
fn delegated_server_killed_after_the_proxys_force_gets_the_committed_answer_once() {
    let dir = tempfile::tempdir().unwrap();
    let accept = format!("127.0.0.1:{}", free_port());
    let mut p = proxy(
        &accept,
        &dir.path().join("proxy"),
        &["--pause-at", "before-release", "--pause-tx", "1"],
    );
    let node = p.field("on");
    let sdir = dir.path().join("server");
    let listen = format!("127.0.0.1:{}", free_port());
    let mut srv = server(&accept, &listen, &node, &sdir, &[DELEGATE]);
    let mut peer = TcpStream::connect(peers_addr(&p)).unwrap();
    peer.write_all(b"a\nb\n").unwrap();
    // The proxy decided: its commit record (with the held answer) is
    // durable; the answer is not released and the decision not sent.
    let tid = tid_of(&p.wait_line("PAUSED before-release"));
    srv.kill9();
    p.go();
    // The decision stands without the server: the proxy releases the answer
    // once, then closes (the server is gone).
    let got = read_all(&mut peer);
    assert_eq!(String::from_utf8_lossy(&got), "ok a\nok b\n");
    // The proxy keeps telling the server the decision until a restarted
    // server acknowledges it; then the transaction ends at the proxy.
    let _srv2 = server(&accept, &listen, &node, &sdir, &[DELEGATE]);
    common::wait_forgotten(&node, &tid, &[]);
}

#[test]
fn delegated_server_killed_after_its_commit_returned_the_peer_gets_the_answer_once() {
    let mut w = world(&[DELEGATE, "--stop-after-commit", "1"], &[]);
    w.server.wait_line("STOPPED after-commit 1");
    w.server.kill9();
    let got = read_all(&mut w.peer);
    assert_eq!(String::from_utf8_lossy(&got), "ok a\nok b\n");
}

/// A proxy at a fixed node address (a restart keeps it) and a delegating
/// server behind it; the peer sends `a`.
fn delegated_world(proxy_extra: &[&str]) -> (tempfile::TempDir, Proc, Proc, TcpStream, String) {
    let dir = tempfile::tempdir().unwrap();
    let accept = format!("127.0.0.1:{}", free_port());
    let node_listen = format!("127.0.0.1:{}", free_port());
    let mut extra = vec!["--node-listen", node_listen.as_str()];
    extra.extend(proxy_extra);
    let p = proxy(&accept, &dir.path().join("proxy"), &extra);
    let listen = format!("127.0.0.1:{}", free_port());
    let srv = server(
        &accept,
        &listen,
        &node_listen,
        &dir.path().join("server"),
        &[DELEGATE],
    );
    let mut peer = TcpStream::connect(peers_addr(&p)).unwrap();
    peer.write_all(b"a\n").unwrap();
    (dir, p, srv, peer, node_listen)
}

fn restart_proxy(dir: &tempfile::TempDir, accept: &str, node_listen: &str) -> Proc {
    proxy(
        accept,
        &dir.path().join("proxy"),
        &["--node-listen", node_listen],
    )
}

#[test]
fn delegated_proxy_killed_before_its_force_the_waiting_server_aborts_when_it_returns() {
    let (dir, mut p, srv, mut peer, node_listen) =
        delegated_world(&["--crash-at", "coordinator-before-commit-force"]);
    let accept = p.ready.split(" upstream ").nth(1).unwrap().to_string();
    // The proxy took the decision and is about to force its commit record.
    let tid = tid_of(&p.wait_line("CRASHPOINT"));
    p.kill9();
    assert_eq!(String::from_utf8_lossy(&read_all(&mut peer)), "");
    // The server handed the decision on: it cannot abort alone and keeps
    // asking (the one-phase prepare again). The restarted proxy has no
    // record of the transaction and votes no: both sides abort.
    let p2 = restart_proxy(&dir, &accept, &node_listen);
    assert_eq!(p2.wait_line("RECOVERED"), "RECOVERED 0 undeliverable");
    let failed = srv.wait_line("COMMIT FAILED 0");
    assert!(failed.contains(&tid), "{failed}");
}

#[test]
fn delegated_proxy_killed_after_its_force_the_server_commits_when_it_returns() {
    let (dir, mut p, srv, mut peer, node_listen) =
        delegated_world(&["--crash-at", "coordinator-after-commit-force"]);
    let accept = p.ready.split(" upstream ").nth(1).unwrap().to_string();
    // Reached only by a proxy that decides: its commit record is durable,
    // the answer not released, the decision not sent.
    let tid = tid_of(&p.wait_line("CRASHPOINT"));
    p.kill9();
    // The peer's connection ended with the proxy (2CA's split connection):
    // nothing of the answer.
    assert_eq!(String::from_utf8_lossy(&read_all(&mut peer)), "");
    // The restarted proxy finds the commit record: the answer is committed
    // and undeliverable, and the decision goes to the waiting server.
    let p2 = restart_proxy(&dir, &accept, &node_listen);
    let u = p2.wait_line("UNDELIVERABLE");
    assert!(
        u.starts_with(&format!("UNDELIVERABLE {tid} 5 bytes")) && u.ends_with("(committed)"),
        "{u}"
    );
    let committed = srv.wait_line("COMMITTED 0");
    assert_eq!(tid_of(&committed), tid);
    common::wait_forgotten(&node_listen, &tid, &[]);
}

#[test]
fn delegated_proxy_killed_after_the_release_the_peer_has_each_answer_once() {
    let dir = tempfile::tempdir().unwrap();
    let accept = format!("127.0.0.1:{}", free_port());
    let node_listen = format!("127.0.0.1:{}", free_port());
    let mut p = restart_proxy(&dir, &accept, &node_listen);
    let listen = format!("127.0.0.1:{}", free_port());
    let srv = server(
        &accept,
        &listen,
        &node_listen,
        &dir.path().join("server"),
        &[DELEGATE, "--stop-after-commit", "2"],
    );
    let mut peer = TcpStream::connect(peers_addr(&p)).unwrap();
    peer.write_all(b"a\nb\nc\n").unwrap();
    let tids: Vec<String> = (0..3)
        .map(|n| tid_of(&srv.wait_line(&format!("COMMITTED {n} "))))
        .collect();
    srv.wait_line("STOPPED after-commit 2");
    // Each decision reached the server after the proxy released the answer.
    let mut all = [0u8; 15];
    peer.read_exact(&mut all).unwrap();
    assert_eq!(&all, b"ok a\nok b\nok c\n");
    p.kill9();
    assert_eq!(String::from_utf8_lossy(&read_all(&mut peer)), "");
    // After a restart, released output is not reported as undeliverable:
    // the release records of the first two were made durable by the next
    // transaction's forced record; the last one's is synced lazily, and
    // only it may be reported (the proxy may have died before that sync).
    let p2 = restart_proxy(&dir, &accept, &node_listen);
    loop {
        let l = p2.lines.recv_timeout(Duration::from_secs(60)).unwrap();
        if l.starts_with("RECOVERED") {
            assert!(
                l == "RECOVERED 0 undeliverable" || l == "RECOVERED 1 undeliverable",
                "{l}"
            );
            break;
        }
        assert!(
            l.starts_with(&format!("UNDELIVERABLE {} 5 bytes", tids[2]))
                && l.ends_with("(committed)"),
            "{l}"
        );
    }
}
