//! A busy-polling caller (`BusyPoll`) over TCP: it reads the process's
//! sockets itself while it waits, side by side with the links' reader tasks,
//! and nothing is lost, reordered or stalled whoever reads. In its own test
//! binary: a busy poller services every channel of its process.

mod shm_common;

use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use shm_common::{echo_many, echo_request, Service};
use tokio::sync::Notify;
use weft_transport::*;
use weft_wire::*;

fn tcp_cfg(node: u32, max_inbox_per_link: usize) -> TransportConfig {
    TransportConfig {
        listen: Some("127.0.0.1:0".parse().unwrap()),
        channels: ChannelSet {
            inproc: false,
            shm: false,
            tcp: true,
        },
        hub: Some(InprocHub::new()),
        heartbeat_interval: Duration::from_millis(100),
        dead_after: Duration::from_secs(5),
        connect_timeout: Duration::from_millis(1000),
        secret: b"poll".to_vec(),
        max_inbox_per_link,
        ..TransportConfig::node(NodeId(node), Incarnation(1))
    }
}

/// Two endpoints joined over TCP, both serving `echo`.
async fn pair(max_inbox_per_link: usize) -> (Endpoint, Endpoint) {
    let a = Endpoint::start(tcp_cfg(1, max_inbox_per_link))
        .await
        .unwrap();
    a.set_request_handler(Arc::new(Service));
    let b = Endpoint::start(tcp_cfg(2, max_inbox_per_link))
        .await
        .unwrap();
    b.set_request_handler(Arc::new(Service));
    // Woken by every membership change on either side, then looks again.
    let changed = Arc::new(Notify::new());
    for ep in [&a, &b] {
        let changed = changed.clone();
        ep.on_membership(move |_| changed.notify_one());
    }
    b.join(Seed::Tcp(a.listen_addr().unwrap())).await.unwrap();
    let formed = async {
        loop {
            let next = changed.notified();
            tokio::pin!(next);
            next.as_mut().enable();
            if a.view().nodes.len() == 2 && b.view().nodes.len() == 2 {
                return;
            }
            next.await;
        }
    };
    tokio::time::timeout(Duration::from_secs(10), formed)
        .await
        .expect("the pair never formed");
    (a, b)
}

/// `n` echo calls from `from` to `to`, one at a time, each with its own
/// body (some large enough to span many reads); checks every answer.
async fn echo_in_turn(from: &Endpoint, to: u32, n: u32) -> u32 {
    for i in 0..n {
        let len = if i % 50 == 7 {
            300_000
        } else {
            4 + i as usize % 200
        };
        let mut body = vec![(i % 251) as u8; len];
        body[..4].copy_from_slice(&i.to_le_bytes());
        let deadline = Some(Instant::now() + Duration::from_secs(30));
        let r = from
            .call(NodeId(to), echo_request(to, body.clone()), deadline)
            .await
            .unwrap_or_else(|f| panic!("call {i} to node {to}: {f}"));
        assert_eq!(r.payload.into_bytes().unwrap()[..], body[..], "call {i}");
    }
    n
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_poller_and_the_reader_tasks_share_the_sockets() {
    let (a, b) = pair(16384).await;
    // Node 2 calls node 1 from a busy-polling thread while node 1 calls
    // node 2 from a runtime task: both sockets are read by the poller and
    // by their reader tasks at once.
    let polled = {
        let b = b.clone();
        tokio::task::spawn_blocking(move || {
            let mut bp = BusyPoll::new();
            let one_by_one = bp.block_on(echo_in_turn(&b, 1, 1500));
            // Many in flight at once: frames pile up in one read.
            let many = bp.block_on(echo_many(&b, 1, 2000, 100, 64));
            (one_by_one, many)
        })
    };
    let tasks = echo_in_turn(&a, 2, 1500).await;
    assert_eq!(polled.await.unwrap(), (1500, 2000));
    assert_eq!(tasks, 1500);
    assert_eq!((a.pending_calls(), b.pending_calls()), (0, 0));
    // No busy poller any more: the reader tasks serve alone.
    assert_eq!(echo_in_turn(&b, 1, 300).await, 300);
    b.shutdown().await;
    a.shutdown().await;
}

/// Takes protocol messages on its port in order; the first one waits at a
/// gate, so the link's inbox fills up behind it.
struct Gated {
    gate: Mutex<Option<mpsc::Receiver<()>>>,
    got: Mutex<Vec<u32>>,
    all: Notify,
    expect: usize,
}

impl PortHandler for Gated {
    fn on_message(&self, _from: PeerRef, payload: Payload) {
        if let Some(gate) = self.gate.lock().take() {
            gate.recv().unwrap();
        }
        let n = u32::from_le_bytes(payload.into_bytes().unwrap()[..4].try_into().unwrap());
        let mut got = self.got.lock();
        got.push(n);
        if got.len() == self.expect {
            self.all.notify_one();
        }
    }
}

/// A poller that fills a link's inbox stops reading it and hands it back to
/// the reader task, which delivers what waits in the buffer once there is
/// room: every message arrives, in order, while the poller stays active.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_inbox_under_a_busy_poller_loses_and_stalls_nothing() {
    const MESSAGES: usize = 3000;
    let (a, b) = pair(4).await;
    let (open, gate) = mpsc::channel();
    let handler = Arc::new(Gated {
        gate: Mutex::new(Some(gate)),
        got: Mutex::new(Vec::new()),
        all: Notify::new(),
        expect: MESSAGES,
    });
    let port = Port(4242);
    a.set_port_handler(port, handler.clone());
    let waiter = {
        let handler = handler.clone();
        tokio::task::spawn_blocking(move || {
            BusyPoll::new().block_on(async {
                let all = handler.all.notified();
                tokio::pin!(all);
                all.as_mut().enable();
                if handler.got.lock().len() < MESSAGES {
                    all.await;
                }
            })
        })
    };
    for i in 0..MESSAGES as u32 {
        let mut body = i.to_le_bytes().to_vec();
        body.resize(64, 0);
        b.send(NodeId(1), port, Payload::bytes(body)).unwrap();
    }
    open.send(()).unwrap();
    waiter.await.unwrap();
    let got = handler.got.lock().clone();
    assert_eq!(got, (0..MESSAGES as u32).collect::<Vec<_>>());
    b.shutdown().await;
    a.shutdown().await;
}
