//! 2CA with real processes: `weft net proxy`, the transactional line server
//! `weft net serve` behind it, and an unmodified peer (a plain
//! `std::net::TcpStream`). The server or the proxy is killed with SIGKILL
//! before, during and after a commit; the peer must see exactly the
//! committed answers, once, in order, and no byte of an aborted attempt.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

/// A process whose stdout lines are collected.
struct Proc {
    child: Child,
    lines: mpsc::Receiver<String>,
    ready: String,
}

impl Proc {
    fn spawn(args: &[&str]) -> Proc {
        let mut child = Command::new(env!("CARGO_BIN_EXE_weft"))
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("weft starts");
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
            lines,
            ready,
        }
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

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
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
