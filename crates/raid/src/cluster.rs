//! An in-process Raid cluster: one weft node per site (in-process channels
//! between them), each with durable data in its own directory. Used by
//! `weft demo`, the debitcredit benchmark and tests.
//!
//! Owns starting, loading, auditing and measuring such a cluster. Must keep
//! every site's data on disk (fsync real), as a multi-process cluster would.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use weft::{FaultPlan, InprocHub, Node, NodeId, Seed};
use weft_wire::Failure;

use crate::ad::Ad;
use crate::audit::Audit;
use crate::load::{load_store, LoadRequest};
use crate::schema::Sizes;
use crate::site::{RaidSite, SiteConfig};

/// How to start an in-process cluster.
#[derive(Clone)]
pub struct ClusterOptions {
    /// Site settings.
    pub site: SiteConfig,
    /// Faults on every link (tests).
    pub fault: Option<Arc<FaultPlan>>,
    /// Failure-detector timing: probe interval and death bound.
    pub detector: (Duration, Duration),
}

impl Default for ClusterOptions {
    fn default() -> Self {
        ClusterOptions {
            site: SiteConfig::default(),
            fault: None,
            detector: (Duration::from_millis(100), Duration::from_millis(1000)),
        }
    }
}

/// Frames and log forces, summed over the cluster's nodes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counters {
    /// Requests, responses and protocol messages sent.
    pub messages: u64,
    /// fdatasyncs of the nodes' logs.
    pub forces: u64,
}

/// A running in-process cluster.
pub struct RaidCluster {
    /// The nodes, site 1 first.
    pub nodes: Vec<Node>,
    /// Their Raid sites.
    pub sites: Vec<RaidSite>,
    hub: Arc<InprocHub>,
    opts: ClusterOptions,
    dir: std::path::PathBuf,
    /// The temporary directory removed with the cluster (`None`: a kept
    /// directory, see [`RaidCluster::start_in`]).
    _temp: Option<tempfile::TempDir>,
}

impl RaidCluster {
    /// Starts `n` sites with data directories under a new temporary directory
    /// in `base` (removed with the cluster).
    ///
    /// Fails when a node does not start.
    pub async fn start(n: u32, base: &Path, opts: ClusterOptions) -> Result<RaidCluster, Failure> {
        let dir = tempfile::Builder::new()
            .prefix(".weft-raid-")
            .tempdir_in(base)
            .map_err(|e| {
                Failure::new(
                    weft_wire::Status::Internal,
                    format!("temporary directory: {e}"),
                )
            })?;
        let path = dir.path().to_path_buf();
        Self::start_at(n, path, Some(dir), opts).await
    }

    /// Starts `n` sites with data directories `site<i>` under `dir`
    /// (created if missing), kept when the cluster stops: a cluster started
    /// again in the same directory finds its copies loaded (a benchmark at
    /// a large scale loads once for several runs).
    ///
    /// Fails when the directory cannot be created or a node does not start.
    pub async fn start_in(
        n: u32,
        dir: &Path,
        opts: ClusterOptions,
    ) -> Result<RaidCluster, Failure> {
        std::fs::create_dir_all(dir).map_err(|e| {
            Failure::new(
                weft_wire::Status::Internal,
                format!("data directory {}: {e}", dir.display()),
            )
        })?;
        Self::start_at(n, dir.to_path_buf(), None, opts).await
    }

    async fn start_at(
        n: u32,
        dir: std::path::PathBuf,
        temp: Option<tempfile::TempDir>,
        opts: ClusterOptions,
    ) -> Result<RaidCluster, Failure> {
        let hub = InprocHub::new();
        let mut c = RaidCluster {
            nodes: Vec::new(),
            sites: Vec::new(),
            hub,
            opts,
            dir,
            _temp: temp,
        };
        for id in 1..=n {
            let (node, site) = c.start_site(id).await?;
            c.nodes.push(node);
            c.sites.push(site);
        }
        Ok(c)
    }

    async fn start_site(&self, id: u32) -> Result<(Node, RaidSite), Failure> {
        self.start_node(id, true).await
    }

    /// Starts site `id`'s node from its data directory; with `raid` false
    /// without the Raid plugin (its process up, its copy not served).
    async fn start_node(&self, id: u32, raid: bool) -> Result<(Node, RaidSite), Failure> {
        let site = RaidSite::new(self.opts.site.clone());
        let mut b = Node::builder(id)
            .hub(self.hub.clone())
            .data_dir(self.dir.join(format!("site{id}")))
            .failure_detector(self.opts.detector.0, self.opts.detector.1);
        if raid {
            b = b.plugin(Arc::new(site.clone()));
        } else {
            // Nothing may touch the log of a copy nobody serves.
            b = b.checkpoint_every(None);
        }
        if let Some(f) = &self.opts.fault {
            b = b.fault(f.clone());
        }
        if id > 1 {
            b = b.join(Seed::Inproc(NodeId(1)));
        }
        let node = b
            .start()
            .await
            .map_err(|e| Failure::new(weft_wire::Status::Internal, format!("site {id}: {e}")))?;
        Ok((node, site))
    }

    /// Crashes site `id` and starts it again from its data directory.
    ///
    /// Fails when it does not restart.
    pub async fn restart(&mut self, id: u32) -> Result<(), Failure> {
        let i = (id - 1) as usize;
        self.nodes[i].crash();
        let (node, site) = self.start_site(id).await?;
        self.nodes[i] = node;
        self.sites[i] = site;
        Ok(())
    }

    /// Crashes site `id` and starts its node again from its data directory
    /// without the Raid plugin (tests): the node is up and a member, but
    /// serves no copy. [`RaidCluster::restart`] brings the site back.
    ///
    /// Fails when the node does not restart.
    pub async fn restart_without_raid(&mut self, id: u32) -> Result<(), Failure> {
        let i = (id - 1) as usize;
        self.nodes[i].crash();
        let (node, site) = self.start_node(id, false).await?;
        self.nodes[i] = node;
        self.sites[i] = site;
        Ok(())
    }

    /// Loads every copy, each with the placement naming every site.
    ///
    /// Fails when a copy cannot be loaded.
    pub async fn load(&self, sizes: Sizes) -> Result<(), Failure> {
        let all: Vec<NodeId> = self.nodes.iter().map(|n| n.id()).collect();
        let loads = self.nodes.iter().zip(&self.sites).map(|(node, site)| {
            let participant = site.clone();
            let req = LoadRequest {
                sizes,
                sites: all.clone(),
            };
            async move {
                let p = participant.participant_handle();
                load_store(node.rpc(), site.store(), p, req).await
            }
        });
        for r in futures::future::join_all(loads).await {
            r?;
        }
        Ok(())
    }

    /// One action driver per site, writing to the copies its loaded copy
    /// names (every site's).
    ///
    /// Fails before the load.
    pub fn ads(&self) -> Result<Vec<Ad>, Failure> {
        self.sites.iter().map(RaidSite::loaded_ad).collect()
    }

    /// Audits every copy.
    pub fn audit(&self) -> Audit {
        Audit {
            sites: self
                .nodes
                .iter()
                .zip(&self.sites)
                .map(|(n, s)| (n.id(), s.audit()))
                .collect(),
            missing: Vec::new(),
        }
    }

    /// Waits until no transaction is live at any site (phase two done,
    /// in-doubt branches resolved), up to `limit`. Returns whether it
    /// happened.
    pub async fn quiesce(&self, limit: Duration) -> bool {
        let deadline = std::time::Instant::now() + limit;
        while std::time::Instant::now() < deadline {
            if self.nodes.iter().all(|n| n.tm().list().is_empty()) {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        false
    }

    /// Messages and forces so far.
    pub fn counters(&self) -> Counters {
        Counters {
            messages: self
                .nodes
                .iter()
                .map(|n| n.endpoint().stats().work_messages())
                .sum(),
            forces: self.nodes.iter().map(|n| n.log().stats().syncs).sum(),
        }
    }

    /// Stops every node.
    pub async fn shutdown(self) {
        for n in &self.nodes {
            n.shutdown().await;
        }
    }
}
