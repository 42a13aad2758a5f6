//! Helpers of the two-process shm tests: a node of this process and helper
//! processes (`weft-shm-peer`) spoken to line by line.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::stream::{FuturesUnordered, StreamExt};
use weft_transport::*;
use weft_wire::*;

pub const SECRET: &str = "shm-test-secret";

/// `echo` answers with the payload, `hang` never answers.
pub struct Service;

impl RequestHandler for Service {
    fn handle(&self, _from: PeerRef, req: Request, responder: Responder) {
        match req.service.as_str() {
            "echo" => responder.respond(Response {
                call_id: 0,
                status: Status::Ok,
                detail: String::new(),
                tx: None,
                payload: req.payload,
            }),
            "hang" => std::mem::forget(responder),
            other => responder.fail(Failure::new(Status::NoSuchService, other.to_string())),
        }
    }
}

pub fn cfg(node: u32) -> TransportConfig {
    TransportConfig {
        listen: Some("127.0.0.1:0".parse().unwrap()),
        hub: Some(InprocHub::new()),
        secret: SECRET.as_bytes().to_vec(),
        heartbeat_interval: Duration::from_millis(100),
        // Long enough that a death noticed within it was noticed by the
        // shm channel, not by missed heartbeats.
        dead_after: Duration::from_secs(20),
        connect_timeout: Duration::from_secs(5),
        ..TransportConfig::node(NodeId(node), Incarnation(1))
    }
}

pub async fn start(cfg: TransportConfig) -> Endpoint {
    let ep = Endpoint::start(cfg).await.expect("endpoint starts");
    ep.set_request_handler(Arc::new(Service));
    ep
}

/// A helper process and its line-oriented conversation.
pub struct Peer {
    pub child: Child,
    stdin: Option<ChildStdin>,
    lines: mpsc::Receiver<String>,
    pub pid: u32,
    pub rendezvous: Option<PathBuf>,
}

impl Peer {
    pub fn spawn(mode: &str, args: &[String]) -> Peer {
        let mut child = Command::new(env!("CARGO_BIN_EXE_weft-shm-peer"))
            .arg(mode)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("helper starts");
        let stdout = child.stdout.take().unwrap();
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { return };
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        Peer {
            pid: child.id(),
            stdin: child.stdin.take(),
            child,
            lines,
            rendezvous: None,
        }
    }

    /// A node helper joining `seed`; returns once it is READY.
    pub fn node(id: u32, seed: std::net::SocketAddr, extra: &[&str]) -> Peer {
        let mut args = vec![
            "--id".to_string(),
            id.to_string(),
            "--join".into(),
            seed.to_string(),
            "--secret".into(),
            SECRET.into(),
            "--heartbeat-ms".into(),
            "100".into(),
            "--dead-ms".into(),
            "20000".into(),
        ];
        args.extend(extra.iter().map(|s| s.to_string()));
        let mut p = Peer::spawn("node", &args);
        let ready = p.expect("READY", Duration::from_secs(20));
        let rendezvous = ready.split_whitespace().nth(4).unwrap_or("-");
        if rendezvous != "-" {
            p.rendezvous = Some(PathBuf::from(rendezvous));
        }
        p
    }

    pub fn expect(&mut self, prefix: &str, within: Duration) -> String {
        let deadline = Instant::now() + within;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) if line.starts_with(prefix) => return line,
                Ok(_) => continue,
                Err(e) => panic!(
                    "helper {} sent no {prefix} line within {within:?}: {e}",
                    self.pid
                ),
            }
        }
    }

    pub fn send(&mut self, line: &str) {
        let stdin = self.stdin.as_mut().expect("stdin open");
        writeln!(stdin, "{line}").expect("helper reads stdin");
        stdin.flush().unwrap();
    }

    /// Asks the helper for something and waits (off the runtime) for the
    /// answer line.
    pub async fn ask(&mut self, line: &str, prefix: &str, within: Duration) -> String {
        self.send(line);
        tokio::task::block_in_place(|| self.expect(prefix, within))
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Asks the helper to shut down cleanly and waits for it.
    pub fn quit(&mut self) {
        if let Some(mut stdin) = self.stdin.take() {
            let _ = writeln!(stdin, "quit");
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(status)) = self.child.try_wait() {
                assert!(status.success(), "helper exited with {status}");
                return;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        panic!("helper {} did not quit", self.pid);
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
    }
}

pub fn route(ep: &Endpoint, node: u32) -> Option<ChannelKind> {
    ep.view()
        .nodes
        .into_iter()
        .find(|n| n.info.id == NodeId(node))
        .and_then(|n| n.channel)
}

pub fn echo_request(node: u32, body: Vec<u8>) -> Request {
    Request {
        call_id: 0,
        service: ServiceName::new("echo").unwrap(),
        instance: 0,
        node: NodeId(node),
        budget_us: None,
        tx: None,
        flags: 0,
        payload: Payload::bytes(body),
    }
}

/// `count` echo calls of `size` bytes to `node`, `in_flight` at a time, each
/// checked to come back intact. Returns the number that succeeded.
pub async fn echo_many(
    ep: &Endpoint,
    node: u32,
    count: usize,
    in_flight: usize,
    size: usize,
) -> usize {
    let one = |i: usize| {
        let body: Vec<u8> = (0..size).map(|k| (k ^ i) as u8).collect();
        let ep = ep.clone();
        async move {
            let deadline = Instant::now() + Duration::from_secs(30);
            let r = ep
                .call(
                    NodeId(node),
                    echo_request(node, body.clone()),
                    Some(deadline),
                )
                .await
                .unwrap_or_else(|f| panic!("call {i} to node {node} failed: {f}"));
            assert_eq!(r.status, Status::Ok);
            let back = r.payload.into_bytes().unwrap();
            assert!(back[..] == body[..], "call {i}: payload changed on the way");
        }
    };
    let mut running = FuturesUnordered::new();
    let mut started = 0;
    let mut done = 0;
    while started < count.min(in_flight) {
        running.push(one(started));
        started += 1;
    }
    while running.next().await.is_some() {
        done += 1;
        if started < count {
            running.push(one(started));
            started += 1;
        }
    }
    done
}

pub async fn wait_route(ep: &Endpoint, node: u32, kind: ChannelKind) {
    if let Err(f) = shm::wait_for_channel(ep, NodeId(node), kind, Duration::from_secs(10)).await {
        panic!("{f}; view: {:#?}", ep.view());
    }
}
