//! A weft node: transport, log, transaction manager, RPC and plugins,
//! assembled and started in the right order.
//!
//! Owns start-up (incarnation, log recovery, transaction recovery, plugin
//! recovery, services, then reachable and joining), periodic checkpoints and
//! shutdown. Must never take calls, nor be seen by a peer, before recovery is
//! complete and its services are registered: its endpoint starts unreachable
//! ([`Endpoint::start_recovering`]) and opens only at the end.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use serde::de::DeserializeOwned;
use serde::Serialize;
use weft_log::{Durability, Log, LogConfig};
use weft_rpc::{Plugin, Rpc, RpcConfig, ServiceOptions, Transaction};
use weft_transport::{ChannelSet, Endpoint, FaultPlan, InprocHub, Seed, TransportConfig};
use weft_tx::{RecoveryReport, TmConfig, TxManager};
use weft_wire::{Address, Failure, Incarnation, NodeId, Status};

use crate::admin;

/// The name prefix of a node's temporary data directory (a node started
/// without a data directory): `weft-node-<uid>-<pid>-`, so that the
/// directories of a killed process can be told from a live one's.
fn temp_dir_prefix(pid: u32) -> String {
    format!("{}{pid}-", temp_dir_user_prefix())
}

/// The part of [`temp_dir_prefix`] shared by all of this user's nodes.
fn temp_dir_user_prefix() -> String {
    format!("weft-node-{}-", weft_transport::shm::current_uid())
}

/// Removes, under `base`, the temporary data directories this user's nodes
/// left behind when their process was killed (a SIGKILL skips the removal
/// an orderly stop does; each holds a preallocated log segment). Only
/// directories named by [`temp_dir_prefix`] for a process that no longer
/// exists are touched; a reused pid only keeps a directory longer. Returns
/// how many were removed; errors (another user's directory, a race with
/// another sweeper) are skipped, never reported.
fn sweep_stale_temp_dirs(base: &Path) -> usize {
    let own = temp_dir_user_prefix();
    let mut removed = 0;
    for entry in weft_transport::shm::leftovers_of_dead_processes(base, &own) {
        let is_dir = entry.file_type().map(|t| t.is_dir()).unwrap_or(false);
        if is_dir && std::fs::remove_dir_all(entry.path()).is_ok() {
            removed += 1;
        }
    }
    if removed > 0 {
        tracing::info!(dir = %base.display(), removed, "removed temporary data directories of killed nodes");
    }
    removed
}

/// Why a node could not start.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    /// The data directory could not be prepared.
    #[error("data directory {dir}: {reason}")]
    DataDir {
        /// The directory.
        dir: PathBuf,
        /// What went wrong.
        reason: String,
    },
    /// The log could not be opened.
    #[error("log: {0}")]
    Log(#[from] weft_log::LogError),
    /// The transport could not start.
    #[error("transport: {0}")]
    Transport(#[from] weft_transport::StartError),
    /// A plugin failed to attach, recover or serve.
    #[error("plugin {plugin}: {failure}")]
    Plugin {
        /// The plugin's name.
        plugin: String,
        /// Its failure.
        failure: Failure,
    },
    /// Joining the cluster failed.
    #[error("join: {0}")]
    Join(Failure),
}

/// Configures and starts a [`Node`].
pub struct NodeBuilder {
    id: NodeId,
    listen: Option<SocketAddr>,
    join: Option<Seed>,
    data_dir: Option<PathBuf>,
    secret: Vec<u8>,
    tls: Option<weft_transport::TlsConfig>,
    hub: Option<Arc<InprocHub>>,
    fault: Option<Arc<FaultPlan>>,
    channels: ChannelSet,
    heartbeat: Duration,
    dead_after: Duration,
    connect_timeout: Duration,
    tm: TmConfig,
    rpc: RpcConfig,
    plugins: Vec<Arc<dyn Plugin>>,
    checkpoint_every: Option<Duration>,
    log_tuning: Option<Box<dyn FnOnce(LogConfig) -> LogConfig + Send>>,
}

impl NodeBuilder {
    fn new(id: u32) -> Self {
        NodeBuilder {
            id: NodeId(id),
            listen: None,
            join: None,
            data_dir: None,
            secret: Vec::new(),
            tls: None,
            hub: None,
            fault: None,
            channels: ChannelSet::default(),
            heartbeat: Duration::from_millis(200),
            dead_after: Duration::from_millis(2000),
            connect_timeout: Duration::from_millis(2000),
            tm: TmConfig::default(),
            rpc: RpcConfig::default(),
            plugins: Vec::new(),
            checkpoint_every: Some(Duration::from_secs(30)),
            log_tuning: None,
        }
    }

    /// Listens for TCP links on `addr` (port 0 picks one).
    pub fn listen(mut self, addr: SocketAddr) -> Self {
        self.listen = Some(addr);
        self
    }

    /// Joins the cluster through a member; without it the node is the
    /// directory of a new cluster.
    pub fn join(mut self, seed: Seed) -> Self {
        self.join = Some(seed);
        self
    }

    /// Keeps the log, the incarnation and plugin snapshots in `dir`, so the
    /// node recovers after a crash. Without it, state lives in a temporary
    /// directory removed with the node.
    pub fn data_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.data_dir = Some(dir.into());
        self
    }

    /// The cluster secret.
    pub fn secret(mut self, secret: impl AsRef<[u8]>) -> Self {
        self.secret = secret.as_ref().to_vec();
        self
    }

    /// Mutual TLS on this node's TCP links (see `docs/tls.md`); plaintext
    /// TCP without it.
    pub fn tls(mut self, tls: Option<weft_transport::TlsConfig>) -> Self {
        self.tls = tls;
        self
    }

    /// The in-process hub (tests build isolated clusters with their own).
    pub fn hub(mut self, hub: Arc<InprocHub>) -> Self {
        self.hub = Some(hub);
        self
    }

    /// Injects faults on every link of this node (tests).
    pub fn fault(mut self, plan: Arc<FaultPlan>) -> Self {
        self.fault = Some(plan);
        self
    }

    /// The channels this node may use.
    pub fn channels(mut self, channels: ChannelSet) -> Self {
        self.channels = channels;
        self
    }

    /// Failure-detector timing: probe interval and the bound past which a
    /// silent peer is dead.
    pub fn failure_detector(mut self, heartbeat: Duration, dead_after: Duration) -> Self {
        self.heartbeat = heartbeat;
        self.dead_after = dead_after;
        self
    }

    /// How long a link may take to connect.
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// Transaction manager settings.
    pub fn tm_config(mut self, cfg: TmConfig) -> Self {
        self.tm = cfg;
        self
    }

    /// RPC settings.
    pub fn rpc_config(mut self, cfg: RpcConfig) -> Self {
        self.rpc = cfg;
        self
    }

    /// Adds a plugin (a resource manager with services).
    pub fn plugin(mut self, plugin: Arc<dyn Plugin>) -> Self {
        self.plugins.push(plugin);
        self
    }

    /// How often to checkpoint (truncate the log); `None` never.
    pub fn checkpoint_every(mut self, every: Option<Duration>) -> Self {
        self.checkpoint_every = every;
        self
    }

    /// Adjusts the log configuration (segment size, group-commit delay).
    pub fn log_config(mut self, f: impl FnOnce(LogConfig) -> LogConfig + Send + 'static) -> Self {
        self.log_tuning = Some(Box::new(f));
        self
    }

    /// Starts the node: reads and bumps the incarnation, recovers the log,
    /// the transaction manager and every plugin, registers services, then
    /// becomes reachable (listener, rendezvous, hub) and joins the cluster.
    /// Until that last step no peer can link to it: a restarted node's peers
    /// see the previous incarnation gone, never this one half-recovered.
    ///
    /// Fails with [`NodeError`] naming the step that failed.
    pub async fn start(self) -> Result<Node, NodeError> {
        let (dir, temp) = match &self.data_dir {
            Some(d) => (d.clone(), None),
            None => {
                sweep_stale_temp_dirs(&std::env::temp_dir());
                let t = tempfile::Builder::new()
                    .prefix(&temp_dir_prefix(std::process::id()))
                    .tempdir()
                    .map_err(|e| NodeError::DataDir {
                        dir: std::env::temp_dir(),
                        reason: e.to_string(),
                    })?;
                (t.path().to_path_buf(), Some(t))
            }
        };
        let mut log_cfg = LogConfig::new(dir.join("log"));
        if let Some(f) = self.log_tuning {
            log_cfg = f(log_cfg);
        }
        // The data directory's own entry (and any parent created for it) must
        // survive power loss like everything inside it.
        let durability = log_cfg.durability.clone();
        durability
            .create_dir_all(&dir)
            .map_err(|e| NodeError::DataDir {
                dir: dir.clone(),
                reason: e.to_string(),
            })?;
        let incarnation = next_incarnation(&durability, &dir)?;
        let (log, recovered) = Log::open(log_cfg)?;
        if recovered.was_cut() {
            tracing::warn!(
                node = %self.id,
                bytes = recovered.truncated_bytes,
                "log tail cut at recovery: {}",
                recovered.tail_error.clone().unwrap_or_default()
            );
        }
        let endpoint = Endpoint::start_recovering(TransportConfig {
            secret: self.secret.clone(),
            tls: self.tls.clone(),
            listen: self.listen,
            channels: self.channels,
            hub: self.hub.clone(),
            fault: self.fault.clone(),
            heartbeat_interval: self.heartbeat,
            dead_after: self.dead_after,
            connect_timeout: self.connect_timeout,
            ..TransportConfig::node(self.id, incarnation)
        })?;
        let tm = TxManager::start(endpoint.clone(), log.clone(), self.tm.clone());
        let plugin_err = |p: &Arc<dyn Plugin>, failure: Failure| NodeError::Plugin {
            plugin: p.name().to_string(),
            failure,
        };
        for p in &self.plugins {
            p.attach(&tm, &log).map_err(|f| plugin_err(p, f))?;
        }
        let report = tm.recover(&recovered.records);
        for p in &self.plugins {
            p.recover(&tm, &recovered.records)
                .map_err(|f| plugin_err(p, f))?;
        }
        drop(recovered);
        let rpc = Rpc::new(endpoint.clone(), tm.clone(), self.rpc.clone());
        for p in &self.plugins {
            p.serve(&rpc).map_err(|f| plugin_err(p, f))?;
        }
        let node = Node {
            inner: Arc::new(NodeInner {
                endpoint,
                log,
                tm,
                rpc,
                dir,
                persistent: self.data_dir.is_some(),
                _temp: temp,
                recovery: report,
                plugins: self.plugins,
                checkpoints: Mutex::new(0),
            }),
        };
        admin::install(&node).map_err(|failure| NodeError::Plugin {
            plugin: "admin".into(),
            failure,
        })?;
        // Recovered, services registered: now reachable, then a member.
        node.inner
            .endpoint
            .ready(self.join)
            .await
            .map_err(|e| match e {
                weft_transport::StartError::Join(f) => NodeError::Join(f),
                other => NodeError::Transport(other),
            })?;
        if let Some(every) = self.checkpoint_every {
            let weak = Arc::downgrade(&node.inner);
            tokio::spawn(async move {
                let mut ticker = tokio::time::interval(every);
                ticker.tick().await;
                loop {
                    ticker.tick().await;
                    let Some(inner) = weak.upgrade() else { return };
                    if inner.endpoint.is_crashed() {
                        return;
                    }
                    let node = Node { inner };
                    // A checkpoint may wait for the log's disk: off the
                    // async workers.
                    match tokio::task::spawn_blocking(move || node.checkpoint()).await {
                        Ok(Ok(_)) => {}
                        Ok(Err(e)) => tracing::warn!("checkpoint failed: {e}"),
                        Err(e) => tracing::warn!("checkpoint task failed: {e}"),
                    }
                }
            });
        }
        Ok(node)
    }
}

/// Reads the incarnation stored in `dir`, stores the next one durably and
/// returns it (1 for a new directory).
fn next_incarnation(durability: &Durability, dir: &Path) -> Result<Incarnation, NodeError> {
    let path = dir.join("incarnation");
    let err = |reason: String| NodeError::DataDir {
        dir: dir.to_path_buf(),
        reason,
    };
    let current = match std::fs::read_to_string(&path) {
        Ok(s) => s
            .trim()
            .parse::<u32>()
            .map_err(|e| err(format!("bad incarnation file: {e}")))?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => 0,
        Err(e) => return Err(err(e.to_string())),
    };
    let next = current
        .checked_add(1)
        .ok_or_else(|| err("incarnation overflow".into()))?;
    let tmp = dir.join("incarnation.tmp");
    {
        use std::io::Write;
        let mut f = durability
            .create_file(&tmp)
            .map_err(|e| err(e.to_string()))?;
        writeln!(f, "{next}").map_err(|e| err(e.to_string()))?;
        f.sync_all().map_err(|e| err(e.to_string()))?;
    }
    durability
        .rename(&tmp, &path)
        .map_err(|e| err(format!("cannot store the incarnation durably: {e}")))?;
    Ok(Incarnation(next))
}

pub(crate) struct NodeInner {
    endpoint: Endpoint,
    log: Log,
    tm: TxManager,
    rpc: Rpc,
    dir: PathBuf,
    persistent: bool,
    _temp: Option<tempfile::TempDir>,
    recovery: RecoveryReport,
    plugins: Vec<Arc<dyn Plugin>>,
    checkpoints: Mutex<u64>,
}

/// One weft runtime: its transport endpoint, log, transaction manager, RPC
/// layer and plugins. Cheap to clone.
#[derive(Clone)]
pub struct Node {
    inner: Arc<NodeInner>,
}

impl Node {
    /// A handle that does not keep the node alive: services the node itself
    /// registers hold this, or the node (and its temporary directory) would
    /// never be dropped.
    pub(crate) fn downgrade(&self) -> std::sync::Weak<NodeInner> {
        Arc::downgrade(&self.inner)
    }

    /// The node behind a handle from [`Node::downgrade`], if it still lives.
    pub(crate) fn upgrade(weak: &std::sync::Weak<NodeInner>) -> Option<Node> {
        weak.upgrade().map(|inner| Node { inner })
    }

    /// Starts configuring node `id`.
    pub fn builder(id: u32) -> NodeBuilder {
        NodeBuilder::new(id)
    }

    /// The node id.
    pub fn id(&self) -> NodeId {
        self.inner.endpoint.node_id()
    }

    /// The incarnation this run has.
    pub fn incarnation(&self) -> Incarnation {
        self.inner.endpoint.incarnation()
    }

    /// The bound TCP address, if listening.
    pub fn addr(&self) -> Option<SocketAddr> {
        self.inner.endpoint.listen_addr()
    }

    /// The transport endpoint.
    pub fn endpoint(&self) -> &Endpoint {
        &self.inner.endpoint
    }

    /// The node's log.
    pub fn log(&self) -> &Log {
        &self.inner.log
    }

    /// The transaction manager.
    pub fn tm(&self) -> &TxManager {
        &self.inner.tm
    }

    /// The RPC layer.
    pub fn rpc(&self) -> &Rpc {
        &self.inner.rpc
    }

    /// The data directory (a temporary one when none was configured).
    pub fn data_dir(&self) -> &Path {
        &self.inner.dir
    }

    /// True when the data directory survives the node.
    pub fn is_persistent(&self) -> bool {
        self.inner.persistent
    }

    /// What transaction recovery did at start-up.
    pub fn recovery(&self) -> &RecoveryReport {
        &self.inner.recovery
    }

    /// Begins a transaction coordinated by this node.
    pub fn begin(&self) -> Transaction {
        self.inner.rpc.begin()
    }

    /// Calls a service outside any transaction.
    ///
    /// Fails like [`Rpc::call`].
    pub async fn call<Req, Resp>(&self, addr: &Address, request: Req) -> Result<Resp, Failure>
    where
        Req: Serialize + Send + 'static,
        Resp: DeserializeOwned + Send + 'static,
    {
        self.inner.rpc.call(addr, request).await
    }

    /// Registers a typed service.
    ///
    /// Fails like [`Rpc::register`].
    pub fn register<Req, Resp, F, Fut>(
        &self,
        name: &str,
        opts: ServiceOptions,
        f: F,
    ) -> Result<(), Failure>
    where
        Req: DeserializeOwned + Send + 'static,
        Resp: Serialize + Send + 'static,
        F: Fn(weft_rpc::CallContext, Req) -> Fut + Send + Sync + 'static,
        Fut: std::future::Future<Output = Result<Resp, Failure>> + Send + 'static,
    {
        self.inner.rpc.register(name, opts, f)
    }

    /// Takes a checkpoint: every plugin snapshots its state, and the log is
    /// truncated below what the transaction manager and the plugins still
    /// need. Returns the new start of the log.
    ///
    /// May wait for the log's disk: call it where blocking is allowed.
    ///
    /// Fails when a plugin cannot checkpoint or the log cannot be truncated.
    pub fn checkpoint(&self) -> Result<weft_log::Lsn, Failure> {
        let inner = &self.inner;
        let log = &inner.log;
        // Everything appended so far is covered by the snapshots taken below.
        let mut keep = log.end_lsn();
        // The log lets go only of durable records: force those the checkpoint may drop. (A
        // node whose plugins hold no log position, e.g. one serving only network streams
        // whose records were never forced, otherwise failed every checkpoint with NotDurable.)
        let last = log.last_lsn();
        if last.get() > 0 {
            log.force_blocking(last)
                .map_err(|e| Failure::new(Status::Internal, format!("log force: {e}")))?;
        }
        for p in &inner.plugins {
            if let Some(lsn) = p.checkpoint(log)? {
                keep = keep.min(lsn);
            }
        }
        if let Some(lsn) = inner.tm.low_water() {
            keep = keep.min(lsn);
        }
        log.truncate_before(keep)
            .map_err(|e| Failure::new(Status::Internal, format!("log truncation: {e}")))?;
        *inner.checkpoints.lock() += 1;
        Ok(log.first_lsn())
    }

    /// Leaves the cluster and stops.
    pub async fn shutdown(&self) {
        self.inner.endpoint.shutdown().await;
        let _ = self.inner.log.close();
    }

    /// Stops abruptly as if the process died (tests): nothing more is sent,
    /// received or logged. The data directory keeps what was durable.
    pub fn crash(&self) {
        self.inner.endpoint.crash();
        self.inner.log.crash();
        for p in &self.inner.plugins {
            p.crash();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_checkpoint_lets_go_of_records_nobody_forced() {
        // A node with no plugin: nothing holds a log position, so the checkpoint keeps only
        // what the transaction manager needs, here nothing, and must first make durable
        // the records it drops (appended and never forced, as a non-durable vote leaves them).
        let dir = tempfile::tempdir().expect("temporary directory");
        let node = Node::builder(1)
            .data_dir(dir.path())
            .start()
            .await
            .expect("node starts");
        let last = node
            .log()
            .append(weft_log::RecordTag(0x7e57), b"unforced")
            .expect("append");
        assert!(node.log().durable_lsn() < last, "not forced yet");
        let first = node.checkpoint().expect("the checkpoint succeeds");
        assert!(node.log().durable_lsn() >= last);
        assert!(first > last, "the log now starts past the record");
        node.shutdown().await;
    }

    #[test]
    fn only_temp_dirs_of_dead_processes_are_swept() {
        let base = tempfile::tempdir().expect("temporary directory");
        let dead = {
            let mut child = std::process::Command::new("true")
                .spawn()
                .expect("spawn true");
            let pid = child.id();
            child.wait().expect("wait for true");
            pid
        };
        let make = |pid: u32, tail: &str| {
            let dir = base.path().join(format!("{}{tail}", temp_dir_prefix(pid)));
            std::fs::create_dir_all(dir.join("log")).expect("create");
            std::fs::write(dir.join("log").join("segment"), b"x").expect("write");
            dir
        };
        let of_dead = make(dead, "aaaa");
        let of_me = make(std::process::id(), "bbbb");
        let of_init = make(1, "cccc");
        let unnamed = base.path().join("weft-node-Xy12Zq");
        std::fs::create_dir(&unnamed).expect("create");
        assert_eq!(sweep_stale_temp_dirs(base.path()), 1);
        assert!(!of_dead.exists(), "a killed process's directory is removed");
        for kept in [&of_me, &of_init, &unnamed] {
            assert!(kept.exists(), "{} must stay", kept.display());
        }
        assert_eq!(sweep_stale_temp_dirs(base.path()), 0);
    }
}
