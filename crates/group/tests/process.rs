//! Member and sender death mid-communication with real processes: a node
//! in a child process is killed with SIGKILL while a communication waits on
//! it. Waits are bounded and poll with deadlines; nothing sleeps to
//! synchronize.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use weft_group::config::GroupConfig;
use weft_group::runtime::Groups;
use weft_transport::{ChannelSet, Endpoint, TransportConfig};
use weft_wire::{GroupId, Incarnation, NodeId, Payload, Status};

const SECRET: &str = "process-test";

/// A child node process and the lines it prints.
struct ChildNode {
    child: Child,
    lines: mpsc::Receiver<String>,
    seen: Vec<String>,
}

impl ChildNode {
    fn spawn(id: u32, join: std::net::SocketAddr, group: &GroupId, mode: &str) -> ChildNode {
        let mut child = Command::new(env!("CARGO_BIN_EXE_weft-group-node"))
            .args(["--id", &id.to_string()])
            .args(["--join", &join.to_string()])
            .args(["--secret", SECRET])
            .args(["--group", &group.to_string()])
            .args(["--group-secret", "pw"])
            .args(["--mode", mode])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("the test node binary starts");
        let stdout = child.stdout.take().expect("piped stdout");
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        ChildNode {
            child,
            lines,
            seen: Vec::new(),
        }
    }

    /// Waits (bounded) for a line starting with `prefix`.
    fn expect(&mut self, prefix: &str, limit: Duration) -> String {
        let deadline = Instant::now() + limit;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    self.seen.push(line.clone());
                    if line.starts_with(prefix) {
                        return line;
                    }
                }
                Err(_) => panic!("child never printed {prefix:?}; printed {:?}", self.seen),
            }
        }
    }

    fn say(&mut self, line: &str) {
        let stdin = self.child.stdin.as_mut().expect("piped stdin");
        writeln!(stdin, "{line}").expect("child reads stdin");
        stdin.flush().expect("flush");
    }

    /// SIGKILL: the process dies without a word.
    fn kill9(&mut self) {
        self.child.kill().expect("kill -9");
        let _ = self.child.wait();
    }
}

impl Drop for ChildNode {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn directory_node() -> (Endpoint, Groups) {
    let cfg = TransportConfig {
        secret: SECRET.as_bytes().to_vec(),
        listen: Some(std::net::SocketAddr::from(([127, 0, 0, 1], 0))),
        channels: ChannelSet {
            inproc: true,
            shm: false,
            tcp: true,
        },
        heartbeat_interval: Duration::from_millis(50),
        dead_after: Duration::from_millis(500),
        ..TransportConfig::node(NodeId(1), Incarnation(1))
    };
    let ep = Endpoint::start(cfg).await.expect("node 1 starts");
    let groups = Groups::start(ep.clone(), None, GroupConfig::default()).expect("groups start");
    (ep, groups)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_process_killed_mid_communication_is_reported_dead() {
    let (ep, groups) = directory_node().await;
    let g: GroupId = "proc:member".parse().unwrap();
    groups.create(&g, "pw").await.unwrap();
    let mut child = ChildNode::spawn(2, ep.listen_addr().unwrap(), &g, "member-hold");
    child.expect("READY", Duration::from_secs(20));
    let s = groups.sender();
    assert_eq!(
        s.send(&g, Payload::bytes(b"hold this".to_vec()))
            .await
            .unwrap(),
        1
    );
    child.expect("GOT", Duration::from_secs(10));
    child.kill9();
    let started = Instant::now();
    let f = s.next_reply(&g, Duration::from_secs(10)).await.unwrap_err();
    assert!(
        matches!(f.status, Status::ProcDead | Status::HostDead),
        "a killed member is a dead process or host, not {f}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "noticed within the detector's bound"
    );
    assert_eq!(
        s.next_reply(&g, Duration::from_millis(200))
            .await
            .unwrap_err()
            .status,
        Status::NoComm
    );
    ep.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sender_process_killed_mid_communication_ends_it_at_the_members() {
    let (ep, groups) = directory_node().await;
    let g: GroupId = "proc:sender".parse().unwrap();
    groups.create(&g, "pw").await.unwrap();
    let m = groups.join(&g, "pw").await.unwrap();
    let mut child = ChildNode::spawn(3, ep.listen_addr().unwrap(), &g, "sender");
    child.expect("READY", Duration::from_secs(20));
    child.say("are you there");
    let mut i = tokio::time::timeout(Duration::from_secs(10), m.recv(&g, None))
        .await
        .expect("the message arrives")
        .unwrap();
    assert_eq!(
        i.take_payload().unwrap().into_bytes().unwrap().as_ref(),
        b"are you there"
    );
    child.expect("SENT 1", Duration::from_secs(10));
    child.kill9();
    // The reply fails (the communication died with its sender) instead of
    // hanging: at once if the death is known, or when it becomes known.
    let f = tokio::time::timeout(
        Duration::from_secs(10),
        i.reply(Payload::bytes(b"yes".to_vec())),
    )
    .await
    .expect("the reply does not hang")
    .unwrap_err();
    assert_eq!(f.status, Status::NoComm, "{f}");
    ep.shutdown().await;
}
