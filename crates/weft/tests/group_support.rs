//! Shared helpers for the group tests (included by each `group_*.rs` with
//! `#[path]`; compiled alone it is an empty test crate): in-process
//! clusters of whole nodes with the group plugin, through the
//! fault-injecting transport.

#![allow(dead_code)]

#[path = "common/mod.rs"]
mod common;

use std::sync::Arc;
use std::time::Duration;

#[allow(unused_imports)]
pub use common::{wait_for, Cluster, DEAD_AFTER, HEARTBEAT};
use weft::{GroupId, Node, NodeBuilder};
use weft_group::config::GroupConfig;
use weft_group::runtime::Groups;
use weft_group::service::GroupPlugin;

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

/// A cluster whose nodes run the group plugin. Each node keeps its data in
/// a directory under `dirs`, removed with the cluster (a node's own
/// temporary directory would outlive it: see the report on node leaks).
pub struct GroupCluster {
    pub cluster: Cluster,
    pub plugins: Vec<Arc<GroupPlugin>>,
    pub dirs: tempfile::TempDir,
}

impl GroupCluster {
    /// Starts `n` nodes with the test group configuration.
    pub async fn start(n: u32, seed: u64) -> GroupCluster {
        GroupCluster::start_with(n, seed, |_| test_config(), |_, b| b).await
    }

    /// Starts `n` nodes, node `id` with group configuration `cfg(id)` and
    /// builder adjustments `tune`.
    pub async fn start_with(
        n: u32,
        seed: u64,
        cfg: impl Fn(u32) -> GroupConfig,
        tune: impl Fn(u32, NodeBuilder) -> NodeBuilder,
    ) -> GroupCluster {
        let plugins: Vec<Arc<GroupPlugin>> = (1..=n).map(|id| GroupPlugin::new(cfg(id))).collect();
        let dirs = tempfile::Builder::new()
            .prefix("weft-group-test-")
            .tempdir()
            .expect("a temporary directory");
        let root = dirs.path().to_path_buf();
        let cluster = Cluster::start_with(n, seed, |id, b| {
            let b = b
                .plugin(plugins[(id - 1) as usize].clone())
                .data_dir(root.join(format!("n{id}")))
                .checkpoint_every(None)
                .log_config(|c| c.segment_size(32 << 20).preallocate(false));
            tune(id, b)
        })
        .await;
        GroupCluster {
            cluster,
            plugins,
            dirs,
        }
    }

    /// Node `id`'s group runtime.
    pub fn g(&self, id: u32) -> Groups {
        self.plugins[(id - 1) as usize]
            .groups()
            .expect("the group plugin started")
    }

    /// Node `id`.
    pub fn node(&self, id: u32) -> &Node {
        self.cluster.node(id)
    }

    /// The fault plan's report (seed and recent history), for failures.
    pub fn report(&self) -> String {
        self.cluster.plan.report()
    }
}

pub fn gid(s: &str) -> GroupId {
    s.parse().expect("valid group id")
}
