//! In-process clusters of endpoints with a group runtime each, through the
//! fault-injecting transport (node 1 is the directory).

#![allow(dead_code)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use weft_group::config::GroupConfig;
use weft_group::runtime::Groups;
use weft_transport::{ClusterView, Endpoint, FaultPlan, InprocHub, Seed, TransportConfig};
use weft_wire::{GroupId, Incarnation, NodeId};

pub const HEARTBEAT: Duration = Duration::from_millis(40);
pub const DEAD_AFTER: Duration = Duration::from_millis(300);

pub struct Cluster {
    pub hub: Arc<InprocHub>,
    pub plan: Arc<FaultPlan>,
    pub eps: Vec<Endpoint>,
    pub groups: Vec<Groups>,
}

/// Group timing for tests: quick retransmissions and probes.
pub fn test_config() -> GroupConfig {
    GroupConfig {
        count_timeout: Duration::from_millis(1500),
        reply_timeout: Duration::from_millis(1500),
        directory_timeout: Duration::from_millis(3000),
        push_timeout: Duration::from_millis(1000),
        retransmit: Duration::from_millis(60),
        max_retransmit: Duration::from_millis(250),
        probe_after: Duration::from_millis(400),
        ..GroupConfig::default()
    }
}

pub fn transport(node: u32, hub: &Arc<InprocHub>, plan: &Arc<FaultPlan>) -> TransportConfig {
    TransportConfig {
        hub: Some(hub.clone()),
        fault: Some(plan.clone()),
        heartbeat_interval: HEARTBEAT,
        dead_after: DEAD_AFTER,
        connect_timeout: Duration::from_millis(500),
        secret: b"group-tests".to_vec(),
        ..TransportConfig::node(NodeId(node), Incarnation(1))
    }
}

impl Cluster {
    pub async fn start(n: u32, seed: u64) -> Cluster {
        Cluster::start_with(n, seed, |_| test_config()).await
    }

    pub async fn start_with(n: u32, seed: u64, cfg: impl Fn(u32) -> GroupConfig) -> Cluster {
        let hub = InprocHub::new();
        let plan = Arc::new(FaultPlan::new(seed));
        let mut eps = Vec::new();
        let mut groups = Vec::new();
        for id in 1..=n {
            let ep = Endpoint::start(transport(id, &hub, &plan))
                .await
                .expect("endpoint starts");
            if id > 1 {
                ep.join(Seed::Inproc(NodeId(1))).await.expect("join");
            }
            groups.push(Groups::start(ep.clone(), None, cfg(id)).expect("groups start"));
            eps.push(ep);
        }
        let c = Cluster {
            hub,
            plan,
            eps,
            groups,
        };
        c.converge().await;
        c
    }

    pub fn g(&self, node: u32) -> &Groups {
        &self.groups[(node - 1) as usize]
    }

    pub fn ep(&self, node: u32) -> &Endpoint {
        &self.eps[(node - 1) as usize]
    }

    /// Waits until every live node sees exactly the live nodes alive.
    pub async fn converge(&self) {
        let live: Vec<u32> = self
            .eps
            .iter()
            .filter(|e| !e.is_crashed())
            .map(|e| e.node_id().0)
            .collect();
        let plan = self.plan.clone();
        wait_for("views converge", Duration::from_secs(5), &plan, || {
            self.eps
                .iter()
                .filter(|e| !e.is_crashed())
                .all(|e| alive(&e.view()) == live)
        })
        .await;
    }
}

pub fn alive(v: &ClusterView) -> Vec<u32> {
    v.nodes
        .iter()
        .filter(|n| n.alive)
        .map(|n| n.info.id.0)
        .collect()
}

pub fn gid(s: &str) -> GroupId {
    s.parse().expect("valid group id")
}

/// Polls `cond` every few milliseconds until it holds; panics after `limit`
/// with the fault plan's seed and history.
pub async fn wait_for(
    what: &str,
    limit: Duration,
    plan: &FaultPlan,
    mut cond: impl FnMut() -> bool,
) {
    let deadline = Instant::now() + limit;
    while !cond() {
        if Instant::now() > deadline {
            panic!("timed out waiting for: {what}\n{}", plan.report());
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}
