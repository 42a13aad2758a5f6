//! Shared helpers for weft's integration tests: in-process clusters through
//! the fault-injecting transport.

#![allow(dead_code)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use weft::{FaultPlan, InprocHub, Node, NodeBuilder, Seed};

/// Failure-detector timing used by tests: fast, so dead nodes are noticed
/// within a fraction of a second.
pub const HEARTBEAT: Duration = Duration::from_millis(50);
pub const DEAD_AFTER: Duration = Duration::from_millis(400);

/// An in-process cluster: node 1 is the directory.
pub struct Cluster {
    pub hub: Arc<InprocHub>,
    pub plan: Arc<FaultPlan>,
    pub nodes: Vec<Node>,
}

/// A builder for node `id` of a test cluster.
pub fn builder(id: u32, hub: &Arc<InprocHub>, plan: &Arc<FaultPlan>) -> NodeBuilder {
    Node::builder(id)
        .hub(hub.clone())
        .fault(plan.clone())
        .secret("test-cluster")
        .failure_detector(HEARTBEAT, DEAD_AFTER)
        .connect_timeout(Duration::from_millis(500))
}

impl Cluster {
    /// Starts `n` nodes, each configured by `tune`.
    pub async fn start_with(
        n: u32,
        seed: u64,
        tune: impl Fn(u32, NodeBuilder) -> NodeBuilder,
    ) -> Cluster {
        let hub = InprocHub::new();
        let plan = Arc::new(FaultPlan::new(seed));
        let mut nodes = Vec::new();
        for id in 1..=n {
            let mut b = tune(id, builder(id, &hub, &plan));
            if id > 1 {
                b = b.join(Seed::Inproc(weft::NodeId(1)));
            }
            nodes.push(
                b.start()
                    .await
                    .unwrap_or_else(|e| panic!("node {id} starts: {e}")),
            );
        }
        let c = Cluster { hub, plan, nodes };
        c.converge().await;
        c
    }

    /// Starts `n` plain nodes.
    pub async fn start(n: u32, seed: u64) -> Cluster {
        Cluster::start_with(n, seed, |_, b| b).await
    }

    /// Node `id` (1-based).
    pub fn node(&self, id: u32) -> &Node {
        &self.nodes[(id - 1) as usize]
    }

    /// Waits until every node sees every other node alive.
    pub async fn converge(&self) {
        let want: Vec<u32> = self.nodes.iter().map(|n| n.id().0).collect();
        wait_for("all nodes see each other", Duration::from_secs(5), || {
            self.nodes.iter().all(|n| {
                let alive: Vec<u32> = n
                    .endpoint()
                    .view()
                    .nodes
                    .iter()
                    .filter(|s| s.alive)
                    .map(|s| s.info.id.0)
                    .collect();
                alive == want
            })
        })
        .await;
    }
}

/// Polls `cond` until it holds or `limit` passes (then panics with `what`).
pub async fn wait_for(what: &str, limit: Duration, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !cond() {
        if Instant::now() > deadline {
            panic!("timed out waiting for: {what}");
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}
