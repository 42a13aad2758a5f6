//! `weft node`: runs one node (with its KV store) until SIGINT or SIGTERM,
//! then leaves the cluster cleanly.
//!
//! Owns the mapping from flags to a node configuration. Must print exactly
//! one ready line on stdout once the node takes calls (scripts and tests wait
//! for it).

use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use weft::kv::{DiskOptions, Kv, KvConfig, KvEngine};
use weft::{ChannelSet, Node, NodeBuilder, NodeError, Seed, Status, TmConfig};
use weft_tx::CrashPoint;

use crate::client::{parse_duration, resolve, Client, ClientOpts, TlsOpts};

/// Flags of `weft node`.
#[derive(clap::Args, Debug, Clone)]
pub struct NodeArgs {
    /// This node's id (1 and up, unique in the cluster).
    #[arg(long)]
    pub id: u32,
    /// TCP address to listen on (port 0 picks a free port).
    #[arg(long, default_value = "127.0.0.1:7000")]
    pub listen: String,
    /// Members to join through (repeat the flag or separate them with
    /// commas); the first that answers is used, and they are tried again
    /// with backoff until one does (see --join-timeout). Without any, this
    /// node is the directory of a new cluster.
    #[arg(long, value_delimiter = ',')]
    pub join: Vec<String>,
    /// How long to keep trying the --join members before giving up (0: try
    /// each once).
    #[arg(long, default_value = "60s", value_parser = parse_duration)]
    pub join_timeout: Duration,
    /// Where the log, the incarnation and snapshots live (recovered after a
    /// crash); a temporary directory when absent.
    #[arg(long)]
    pub data_dir: Option<PathBuf>,
    /// The cluster secret every node must present.
    #[arg(
        long,
        env = "WEFT_CLUSTER_SECRET",
        default_value = "",
        hide_env_values = true
    )]
    pub secret: String,
    /// Mutual TLS on TCP links (node to node and client to node).
    #[command(flatten)]
    pub tls: TlsOpts,
    /// Shared memory with same-host peers, `on` or `off` (TCP instead).
    /// Same host means same kernel boot and same network namespace: nodes
    /// in different namespaces (containers, `ip netns`) always use TCP.
    #[arg(long, env = "WEFT_SHM", default_value = "on", value_parser = parse_on_off,
        action = clap::ArgAction::Set)]
    pub shm: bool,
    /// Same as `--shm off`.
    #[arg(long)]
    pub no_shm: bool,
    /// Failure detector: probe interval.
    #[arg(long, default_value = "200ms", value_parser = parse_duration)]
    pub heartbeat: Duration,
    /// Failure detector: a peer silent this long is dead.
    #[arg(long, default_value = "2s", value_parser = parse_duration)]
    pub dead_after: Duration,
    /// Longest wait for a KV lock before LockConflict.
    #[arg(long, default_value = "1s", value_parser = parse_duration)]
    pub lock_wait: Duration,
    /// Where the KV store (and a Raid site's copy) keeps committed data:
    /// `disk` (an on-disk B-tree under a bounded cache, incremental
    /// checkpoints) or `memory` (every key in memory, whole snapshots).
    #[arg(long, default_value = "disk", value_parser = parse_kv_engine)]
    pub kv_engine: String,
    /// Page cache of the disk engine, in MiB.
    #[arg(long, default_value_t = 64)]
    pub kv_cache_mib: usize,
    /// How often to checkpoint (write what changed and truncate the log).
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    pub checkpoint_every: Duration,
    /// Serve Prometheus metrics at http://ADDR/metrics. ADDR is a port
    /// (bound on 127.0.0.1) or host:port; without a value 127.0.0.1:9464.
    /// Only the address given is bound: loopback unless you name another.
    #[arg(long, value_name = "ADDR", num_args = 0..=1,
        default_missing_value = DEFAULT_METRICS_ADDR, value_parser = parse_metrics_addr)]
    pub metrics: Option<SocketAddr>,
    /// Test hook: stop transactions at this commit-protocol point and print
    /// `CRASHPOINT <point> <tid>` (a test then kills the node).
    #[arg(long, hide = true)]
    pub crash_at: Option<CrashPoint>,
    /// A directory this node serves as a transactional file volume
    /// (`DIR`, named after its last component, or `NAME=DIR`); repeatable.
    #[arg(long = "volume")]
    pub volumes: Vec<String>,
    /// Longest wait for a file lock before LockConflict (0: at once).
    #[arg(long, default_value = "1s", value_parser = parse_duration)]
    pub fs_lock_wait: Duration,
    /// Test hook: stop applying a file commit at this step
    /// (`after-phase-a`, `mid-phase-b`, `applied`) and print
    /// `FSCRASH <step>` (a test then kills the node).
    #[arg(long, hide = true)]
    pub fs_crash_at: Option<String>,
}

/// Where this process serves metrics (set by [`NodeArgs::start`]).
static METRICS_AT: std::sync::OnceLock<SocketAddr> = std::sync::OnceLock::new();

/// Where `--metrics` without a value listens: loopback only.
pub const DEFAULT_METRICS_ADDR: &str = "127.0.0.1:9464";

/// Parses a `--metrics` address: a bare port (or `:port`) means that port on
/// 127.0.0.1, so the endpoint is never reachable from other hosts unless the
/// user names a non-loopback address.
pub fn parse_metrics_addr(s: &str) -> Result<SocketAddr, String> {
    let s = s.trim();
    let port = s.strip_prefix(':').unwrap_or(s);
    if let Ok(p) = port.parse::<u16>() {
        return Ok(SocketAddr::from(([127, 0, 0, 1], p)));
    }
    resolve(s).map_err(|e| format!("{e:#} (give a port, or host:port)"))
}

/// First and longest wait between two rounds over the --join members.
const JOIN_BACKOFF: (Duration, Duration) = (Duration::from_millis(100), Duration::from_secs(2));

impl NodeArgs {
    /// The first --join member that answers (a client handshake with the
    /// cluster secret), trying them in order, round after round with
    /// backoff, for up to --join-timeout. `None` without --join.
    ///
    /// Fails with the last member's failure when none answered in time
    /// (ProcDead/HostDead/TimedOut: exit 3), at once on a wrong secret, TLS
    /// refused either way, TLS files that do not load, or an address that
    /// does not resolve.
    pub async fn find_seed(&self) -> anyhow::Result<Option<Seed>> {
        if self.join.is_empty() {
            return Ok(None);
        }
        let give_up = Instant::now() + self.join_timeout;
        let mut backoff = JOIN_BACKOFF.0;
        let mut announced = false;
        loop {
            let mut last = None;
            for seed in &self.join {
                let opts = ClientOpts {
                    node: seed.clone(),
                    secret: self.secret.clone(),
                    timeout: Duration::from_secs(2),
                    tls: self.tls.clone(),
                };
                match Client::dial(&opts).await {
                    Ok(c) => {
                        c.close().await;
                        return Ok(Some(Seed::Tcp(resolve(seed)?)));
                    }
                    Err(f)
                        if matches!(
                            f.status,
                            Status::AddrError
                                | Status::WrongSecret
                                | Status::Refused
                                | Status::BadRequest
                        ) =>
                    {
                        return Err(anyhow::Error::new(f).context(format!("cannot join {seed}")));
                    }
                    Err(f) => last = Some((seed, f)),
                }
            }
            let (seed, f) = last.expect("at least one seed");
            if Instant::now() + backoff > give_up {
                return Err(anyhow::Error::new(f).context(format!(
                    "no --join member answered within {:?} (last tried {seed})",
                    self.join_timeout
                )));
            }
            if !announced {
                eprintln!(
                    "weft node {}: no --join member answers yet ({seed}: {f}); retrying for up to {:?}",
                    self.id, self.join_timeout
                );
                announced = true;
            }
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(JOIN_BACKOFF.1);
        }
    }

    /// Starts the node `b` describes, joining through the first --join
    /// member that answers.
    ///
    /// Fails like [`NodeArgs::find_seed`], or with the step of the start
    /// that failed (a failed join keeps its status for the exit code).
    ///
    /// With --metrics, the metrics endpoint is bound first (a taken port
    /// fails the start at once) and serves for the rest of the process;
    /// [`announce`] prints its address after the ready line.
    pub async fn start(&self, b: NodeBuilder) -> anyhow::Result<Node> {
        let metrics = match self.metrics {
            Some(addr) => Some(
                weft::metrics::serve(addr)
                    .await
                    .map_err(|e| anyhow::Error::new(e).context(format!("node {}", self.id)))?,
            ),
            None => None,
        };
        let b = match self.find_seed().await? {
            Some(seed) => b.join(seed),
            None => b,
        };
        let node = b.start().await.map_err(|e| match e {
            NodeError::Join(f) => {
                anyhow::Error::new(f).context(format!("node {} did not join", self.id))
            }
            other => anyhow::Error::new(other).context(format!("node {} did not start", self.id)),
        })?;
        if let Some(m) = metrics {
            m.watch(&node);
            let _ = METRICS_AT.set(m.local_addr());
            // One node per process here: the endpoint lives as long as it.
            std::mem::forget(m);
        }
        Ok(node)
    }

    /// The node builder these flags describe (plugins and the join not
    /// included: [`NodeArgs::start`] adds the join).
    pub fn builder(&self) -> anyhow::Result<NodeBuilder> {
        let listen = resolve(&self.listen)?;
        let mut b = Node::builder(self.id)
            .listen(listen)
            .secret(self.secret.as_bytes())
            .tls(self.tls.load()?)
            .failure_detector(self.heartbeat, self.dead_after)
            .checkpoint_every(Some(self.checkpoint_every))
            .channels(ChannelSet {
                inproc: true,
                shm: self.shm && !self.no_shm,
                tcp: true,
            });
        if let Some(dir) = &self.data_dir {
            b = b.data_dir(dir);
        }
        if self.crash_at.is_some() {
            b = b.tm_config(self.tm_config());
        }
        Ok(b)
    }

    /// The transaction manager's settings these flags describe (the
    /// defaults, with `--crash-at`'s hook).
    pub fn tm_config(&self) -> TmConfig {
        let crash_at = self.crash_at.map(|point| {
            let hook: weft_tx::CrashHook = Arc::new(|point, tid| {
                let mut out = std::io::stdout().lock();
                let _ = writeln!(out, "CRASHPOINT {point:?} {tid}");
                let _ = out.flush();
            });
            (point, hook)
        });
        TmConfig {
            crash_at,
            ..TmConfig::default()
        }
    }
}

impl NodeArgs {
    /// The file store serving the `--volume` directories (None without).
    ///
    /// Fails when a volume cannot be opened.
    pub fn file_store(&self) -> anyhow::Result<Option<weft_fs::Fs>> {
        if self.volumes.is_empty() {
            return Ok(None);
        }
        let mut cfg = weft_fs::FsConfig::default();
        cfg.limits.lock_wait = self.fs_lock_wait;
        for v in &self.volumes {
            cfg = cfg.volume_spec(v)?;
        }
        if let Some(step) = self.fs_crash_at.clone() {
            let hook: weft_fs::CommitHook = Arc::new(move |at: &str| {
                if at == step {
                    let mut out = std::io::stdout().lock();
                    let _ = writeln!(out, "FSCRASH {at}");
                    let _ = out.flush();
                    drop(out);
                    // Stay at this step until the test kills the process.
                    loop {
                        std::thread::park();
                    }
                }
            });
            cfg.commit_hook = Some(hook);
        }
        Ok(Some(weft_fs::Fs::new(cfg)?))
    }
}

/// Checks a `--kv-engine` name.
fn parse_kv_engine(s: &str) -> Result<String, String> {
    KvEngine::parse(s).map(|e| e.name().to_string())
}

impl NodeArgs {
    /// The KV engine the flags ask for.
    pub fn kv_engine(&self) -> KvEngine {
        kv_engine(&self.kv_engine, self.kv_cache_mib)
    }
}

/// The engine named `memory` or `disk` (anything else: disk), the disk one
/// with a page cache of `cache_mib` MiB.
pub fn kv_engine(name: &str, cache_mib: usize) -> KvEngine {
    match KvEngine::parse(name) {
        Ok(KvEngine::Memory) => KvEngine::Memory,
        _ => KvEngine::Disk(DiskOptions {
            cache_bytes: cache_mib.max(1) << 20,
            ..DiskOptions::default()
        }),
    }
}

/// Parses `on`/`off` (also `true`/`false`, `1`/`0`, `yes`/`no`).
fn parse_on_off(s: &str) -> Result<bool, String> {
    match s.to_ascii_lowercase().as_str() {
        "on" | "true" | "1" | "yes" => Ok(true),
        "off" | "false" | "0" | "no" => Ok(false),
        _ => Err(format!("expected on or off, not {s:?}")),
    }
}

/// Runs `weft node`.
pub async fn run(args: NodeArgs) -> anyhow::Result<()> {
    let kv = Kv::new(KvConfig {
        lock_wait: args.lock_wait,
        engine: args.kv_engine(),
        ..KvConfig::default()
    });
    let mut b = args
        .builder()?
        .plugin(Arc::new(kv))
        .plugin(weft_group::GroupPlugin::new(Default::default()))
        .plugin(Arc::new(weft_state::StateHome::new(Default::default())))
        .plugin(Arc::new(crate::run::lease::LeasePlugin::default()));
    if let Some(fs) = args.file_store()? {
        b = b.plugin(Arc::new(fs));
    }
    let node = args.start(b).await?;
    announce(&node);
    wait_for_signal().await;
    eprintln!("weft node {}: shutting down", node.id());
    node.shutdown().await;
    Ok(())
}

/// Prints the ready line: `weft node <id> incarnation <n> listening on <addr>`,
/// then, with --metrics, `weft node <id> metrics on http://<addr>/metrics`.
pub fn announce(node: &Node) {
    let addr = node
        .addr()
        .map(|a| a.to_string())
        .unwrap_or_else(|| "-".into());
    let rec = node.recovery();
    let mut out = std::io::stdout().lock();
    let _ = writeln!(
        out,
        "weft node {} incarnation {} listening on {} (data {}, recovered: {} redriven, {} in doubt)",
        node.id(),
        node.incarnation(),
        addr,
        node.data_dir().display(),
        rec.redriven.len(),
        rec.in_doubt.len()
    );
    if let Some(addr) = METRICS_AT.get() {
        let _ = writeln!(
            out,
            "weft node {} metrics on http://{addr}/metrics",
            node.id()
        );
    }
    let _ = out.flush();
}

/// Waits for SIGINT or SIGTERM.
pub async fn wait_for_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler installs");
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cmd {
        #[command(flatten)]
        node: NodeArgs,
    }

    #[test]
    fn shared_memory_can_be_turned_off() {
        let on = Cmd::try_parse_from(["weft", "--id", "1"]).unwrap().node;
        assert!(on.shm && !on.no_shm);
        let off = Cmd::try_parse_from(["weft", "--id", "1", "--shm", "off"])
            .unwrap()
            .node;
        assert!(!off.shm);
        assert!(Cmd::try_parse_from(["weft", "--id", "1", "--shm", "maybe"]).is_err());
        assert_eq!(parse_on_off("OFF"), Ok(false));
        assert_eq!(parse_on_off("yes"), Ok(true));
    }

    #[test]
    fn the_metrics_endpoint_binds_to_loopback_unless_told_otherwise() {
        let none = Cmd::try_parse_from(["weft", "--id", "1"]).unwrap().node;
        assert_eq!(none.metrics, None, "no endpoint unless asked for");
        let bare = Cmd::try_parse_from(["weft", "--id", "1", "--metrics"])
            .unwrap()
            .node;
        assert_eq!(bare.metrics, Some("127.0.0.1:9464".parse().unwrap()));
        for port in ["9100", ":9100"] {
            let p = Cmd::try_parse_from(["weft", "--id", "1", "--metrics", port])
                .unwrap()
                .node;
            let addr = p.metrics.unwrap();
            assert!(addr.ip().is_loopback(), "{port} binds {addr}");
            assert_eq!(addr.port(), 9100);
        }
        let all = Cmd::try_parse_from(["weft", "--id", "1", "--metrics", "0.0.0.0:9100"])
            .unwrap()
            .node;
        assert!(
            all.metrics.unwrap().ip().is_unspecified(),
            "only when asked"
        );
        assert!(Cmd::try_parse_from(["weft", "--id", "1", "--metrics", "no:such:port"]).is_err());
        assert_eq!(parse_on_off("yes"), Ok(true));
    }
}
