//! A node is a member only once recovered: while a restarted node replays
//! its log and registers its services, no peer sees its new incarnation,
//! links to it or calls it (issue 16).

mod common;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use weft::{ChannelSet, Failure, Incarnation, Node, NodeId, Plugin, Rpc, Seed, ServiceOptions};

/// A plugin whose recovery waits for the test to open a gate, and which
/// serves `ready` once recovered.
struct GatedRecovery {
    gate: Option<Gate>,
    recovering: Arc<AtomicBool>,
}

impl Plugin for GatedRecovery {
    fn name(&self) -> &str {
        "gated-recovery"
    }

    fn recover(
        &self,
        _tm: &weft::TxManager,
        _records: &[weft_log::LogRecord],
    ) -> Result<(), Failure> {
        self.recovering.store(true, Ordering::Release);
        if let Some(gate) = &self.gate {
            let (open, cv) = &**gate;
            let mut open = open.lock().expect("gate");
            while !*open {
                open = cv.wait(open).expect("gate");
            }
        }
        Ok(())
    }

    fn serve(&self, rpc: &Rpc) -> Result<(), Failure> {
        rpc.register(
            "ready",
            ServiceOptions::no_state(),
            |_ctx, (): ()| async move { Ok(true) },
        )
    }
}

type Gate = Arc<(std::sync::Mutex<bool>, std::sync::Condvar)>;

/// Opens the gate when dropped, so that a failing test does not leave a
/// runtime thread waiting in `recover` forever.
struct OpenOnDrop(Gate);

impl OpenOnDrop {
    fn open(&self) {
        let (open, cv) = &*self.0;
        *open.lock().unwrap_or_else(|e| e.into_inner()) = true;
        cv.notify_all();
    }
}

impl Drop for OpenOnDrop {
    fn drop(&mut self) {
        self.open();
    }
}

const ONLY_TCP: ChannelSet = ChannelSet {
    inproc: false,
    shm: false,
    tcp: true,
};

fn tcp_node(id: u32, listen: SocketAddr) -> weft::NodeBuilder {
    Node::builder(id)
        .listen(listen)
        .channels(ONLY_TCP)
        .secret("s")
        .failure_detector(HEARTBEAT, DEAD_AFTER)
        .connect_timeout(Duration::from_millis(500))
}

/// What node `of` sees of node `node`: its incarnation, whether alive, its
/// services.
fn seen(of: &Node, node: u32) -> Option<(Incarnation, bool, Vec<String>)> {
    of.endpoint()
        .view()
        .nodes
        .into_iter()
        .find(|n| n.info.id == NodeId(node))
        .map(|n| {
            let inc = of
                .endpoint()
                .peer_incarnation(NodeId(node))
                .unwrap_or(n.info.incarnation);
            (inc, n.alive, n.info.services)
        })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_restarted_node_is_not_seen_before_its_recovery_is_complete() {
    let any: SocketAddr = "127.0.0.1:0".parse().unwrap();
    let n1 = tcp_node(1, any).start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let recovering = Arc::new(AtomicBool::new(false));
    let n2 = tcp_node(2, any)
        .data_dir(dir.path())
        .join(Seed::Tcp(n1.addr().unwrap()))
        .plugin(Arc::new(GatedRecovery {
            gate: None,
            recovering: recovering.clone(),
        }))
        .start()
        .await
        .unwrap();
    let addr2 = n2.addr().unwrap();
    let first = n2.incarnation();
    wait_for("node 1 sees node 2", Duration::from_secs(5), || {
        seen(&n1, 2).is_some_and(|(inc, alive, _)| inc == first && alive)
    })
    .await;
    n2.crash();
    drop(n2);

    // Restart at the same address; its recovery waits for the gate.
    let gate: Gate = Arc::new((std::sync::Mutex::new(false), std::sync::Condvar::new()));
    let opener = OpenOnDrop(gate.clone());
    let recovering = Arc::new(AtomicBool::new(false));
    let restart = tokio::spawn({
        let builder = tcp_node(2, addr2)
            .data_dir(dir.path())
            .join(Seed::Tcp(n1.addr().unwrap()))
            .plugin(Arc::new(GatedRecovery {
                gate: Some(gate.clone()),
                recovering: recovering.clone(),
            }));
        async move { builder.start().await }
    });
    wait_for("node 2 recovering", Duration::from_secs(5), || {
        recovering.load(Ordering::Acquire)
    })
    .await;
    // While it recovers, node 1 keeps probing node 2's address (every
    // heartbeat, reconnecting within its backoff of at most a second): over
    // this window it would have reached a listening new incarnation.
    let window = Instant::now() + Duration::from_secs(2);
    while Instant::now() < window {
        if let Some((inc, alive, _)) = seen(&n1, 2) {
            assert!(
                !(alive && inc != first),
                "node 1 sees node 2's new incarnation {inc} alive while it recovers"
            );
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(!restart.is_finished(), "still recovering");
    opener.open();
    let n2 = restart.await.unwrap().unwrap();
    let second = n2.incarnation();
    assert!(second > first);
    // Once seen alive, the new incarnation offers its services.
    wait_for(
        "node 1 sees node 2 again",
        Duration::from_secs(5),
        || match seen(&n1, 2) {
            Some((inc, true, services)) if inc == second => {
                assert!(
                    services.iter().any(|s| s == "ready"),
                    "seen without its services: {services:?}"
                );
                true
            }
            _ => false,
        },
    )
    .await;
    let ok: bool = n1.call(&"ready@2".parse().unwrap(), ()).await.unwrap();
    assert!(ok);
}
