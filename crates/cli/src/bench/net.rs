//! `weft bench net`: the Transactional Network Interface paper's section 3.2
//! experiment. One connection, 100 transactions; a request of a few tens of
//! bytes and a 100 KB response; compute C per committed attempt and C/2 per
//! aborted one; aborts exactly half-way through the response, at most once
//! per transaction, chosen at random (seeded); first-attempt commit
//! percentages 0..100. Each architecture runs on the same path as a
//! non-transactional baseline measured in the same run: peer → a user-space
//! link (one-way delay, bandwidth) → [2CA proxy →] server.
//!
//! Owns the workload, the emulated link, the measures (tx/s, mean/min/max
//! time per transaction, r(c) = tx/s ÷ the baseline's, the communication
//! cost split and its linear fit) and the chart. The communication cost is
//! the paper's (section 3.3, Fig. 5): the mean time per transaction minus
//! the nominal compute (C per committed attempt, C/2 per aborted one), so
//! it includes the timer's overshoot of each compute; the cost with the
//! compute actually slept taken out is reported beside it. Must never count a run
//! whose peer received a wrong byte: the peer checks every response.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use plotters::prelude::*;
use rand::seq::SliceRandom;
use rand::SeedableRng;
use serde_json::{json, Map, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use weft::{Node, NodeId, Seed};
use weft_net::sma::TxStream;
use weft_net::tca::proxy::{NetProxy, ProxyConfig};
use weft_net::tca::server::ProxiedStream;
use weft_net::tla::logger::{TlaLogger, TlaLoggerConfig, TunSpec};
use weft_net::tla::server::TlaStream;
use weft_net::LoggerConfig;

use super::{check, r2, write_json};

/// Flags of `weft bench net`.
#[derive(clap::Args, Debug)]
pub struct NetArgs {
    /// Architectures: sma, 2ca, tla (tla needs root: it creates a network
    /// namespace and two TUN devices for the run).
    #[arg(long, value_delimiter = ',', default_value = "sma,2ca")]
    pub arch: Vec<String>,
    /// One-way delays of the emulated link, in ms (the paper's WAN: 35, 127).
    #[arg(long, value_delimiter = ',', default_value = "0")]
    pub delay_ms: Vec<u64>,
    /// First-attempt commit percentages.
    #[arg(long, value_delimiter = ',', default_value = "0,16,41,57,84,100")]
    pub pcts: Vec<u32>,
    /// Transactions per run.
    #[arg(long, default_value_t = 100)]
    pub txs: usize,
    /// Compute time of a committed attempt, ms (an aborted one: half). The
    /// paper's 30 ms scaled down; with the default link the ratio of compute
    /// to transfer stays the paper's (about 30:12).
    #[arg(long, default_value_t = 20.0)]
    pub compute_ms: f64,
    /// Response size in KB.
    #[arg(long, default_value_t = 100)]
    pub response_kb: usize,
    /// Bandwidth of the emulated link in Mbit/s (0: unlimited), the paper's
    /// 100 Mbit/s LAN by default.
    #[arg(long, default_value_t = 100.0)]
    pub bandwidth_mbps: f64,
    /// Seed of the abort choice (printed; random when absent).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Let the 2CA and TLA server decide as usual (two forced records per
    /// transaction: the logger's prepare record and the server's commit
    /// record) instead of handing the decision to its logger (one force).
    #[arg(long)]
    pub no_delegate: bool,
    /// Write the report as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Draw r(c) per architecture here (PNG, like the paper's Fig. 4).
    #[arg(long)]
    pub plot: Option<PathBuf>,
}

const REQUEST: usize = 40;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Arch {
    Baseline,
    Sma,
    Tca,
    Tla,
}

impl Arch {
    fn key(self) -> &'static str {
        match self {
            Arch::Baseline => "baseline",
            Arch::Sma => "sma",
            Arch::Tca => "2ca",
            Arch::Tla => "tla",
        }
    }
}

/// The response of transaction `i` (the peer checks it byte for byte).
fn response(i: usize, len: usize) -> Vec<u8> {
    let mut v = vec![b'r'; len];
    let tag = format!("resp {i:08} ");
    v[..tag.len()].copy_from_slice(tag.as_bytes());
    v
}

fn request(i: usize) -> Vec<u8> {
    let mut v = format!("req {i:08}").into_bytes();
    v.resize(REQUEST, b' ');
    v
}

// ---- the emulated link ----

/// A user-space link in front of `target`: each direction delivers a chunk
/// `delay` after it finished crossing a `mbps` wire (no netem here).
/// With `netns`, the link's connection to `target` starts in that network
/// namespace (TLA: the peer's side of the logger).
async fn link(
    target: SocketAddr,
    delay: Duration,
    mbps: f64,
    netns: Option<String>,
) -> anyhow::Result<SocketAddr> {
    let l = TcpListener::bind("127.0.0.1:0").await?;
    let addr = l.local_addr()?;
    tokio::spawn(async move {
        let Ok((a, _)) = l.accept().await else { return };
        let b = match netns {
            None => TcpStream::connect(target).await,
            Some(ns) => tokio::task::spawn_blocking(move || {
                let s = weft_net::tla::tun::connect_in_netns(&ns, target)?;
                s.set_nonblocking(true)?;
                Ok(s)
            })
            .await
            .unwrap_or_else(|e| Err(std::io::Error::other(e)))
            .and_then(TcpStream::from_std),
        };
        let Ok(b) = b else {
            eprintln!("weft bench net: the link could not reach {target}");
            return;
        };
        let _ = a.set_nodelay(true);
        let _ = b.set_nodelay(true);
        let (ar, aw) = a.into_split();
        let (br, bw) = b.into_split();
        tokio::spawn(one_way(ar, bw, delay, mbps));
        tokio::spawn(one_way(br, aw, delay, mbps));
    });
    Ok(addr)
}

async fn one_way(
    mut rd: tokio::net::tcp::OwnedReadHalf,
    mut wr: tokio::net::tcp::OwnedWriteHalf,
    delay: Duration,
    mbps: f64,
) {
    let (tx, mut rx) = mpsc::channel::<(tokio::time::Instant, Vec<u8>)>(1024);
    tokio::spawn(async move {
        while let Some((at, b)) = rx.recv().await {
            tokio::time::sleep_until(at).await;
            if wr.write_all(&b).await.is_err() {
                return;
            }
        }
        let _ = wr.shutdown().await;
    });
    let mut buf = vec![0u8; 16 * 1024];
    let mut wire_free = tokio::time::Instant::now();
    loop {
        let n = match rd.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        let now = tokio::time::Instant::now();
        let serialise = if mbps > 0.0 {
            Duration::from_secs_f64(n as f64 * 8.0 / (mbps * 1e6))
        } else {
            Duration::ZERO
        };
        wire_free = wire_free.max(now) + serialise;
        if tx
            .send((wire_free + delay, buf[..n].to_vec()))
            .await
            .is_err()
        {
            return;
        }
    }
}

// ---- one run ----

struct RunResult {
    tps: f64,
    times_ms: Vec<f64>,
    compute_ms: f64,
    control_ms: f64,
    commit_ms: f64,
    /// Forced log records per transaction, all nodes of the path.
    forces_per_tx: f64,
}

struct Plan {
    txs: usize,
    resp: usize,
    compute: Duration,
    /// Transactions whose first attempt aborts.
    aborts: Vec<bool>,
}

/// Runs the peer against `entry`; returns per-transaction times.
async fn peer(entry: SocketAddr, plan: &Plan) -> anyhow::Result<(Vec<f64>, Duration)> {
    let mut s = TcpStream::connect(entry).await?;
    s.set_nodelay(true)?;
    let mut buf = vec![0u8; plan.resp];
    let mut times = Vec::with_capacity(plan.txs);
    let start = Instant::now();
    for i in 0..plan.txs {
        let t0 = Instant::now();
        s.write_all(&request(i)).await?;
        s.read_exact(&mut buf)
            .await
            .with_context(|| format!("response {i}"))?;
        times.push(t0.elapsed().as_secs_f64() * 1e3);
        if buf != response(i, plan.resp) {
            bail!("transaction {i}: the peer received other bytes than the committed response");
        }
    }
    let total = start.elapsed();
    Ok((times, total))
}

/// Time the server spent in compute and in transaction control (start,
/// restart, commit) over a run.
#[derive(Default)]
struct Spent {
    compute: Duration,
    control: Duration,
    /// The part of `control` spent in commits (the rest: starts, restarts).
    commit: Duration,
}

async fn compute(d: Duration, spent: &mut Duration) {
    let t = Instant::now();
    tokio::time::sleep(d).await;
    *spent += t.elapsed();
}

async fn run_baseline(l: &TcpListener, plan: &Plan) -> anyhow::Result<Spent> {
    let (mut s, _) = l.accept().await?;
    s.set_nodelay(true)?;
    let mut req = [0u8; REQUEST];
    let mut spent = Spent::default();
    for i in 0..plan.txs {
        s.read_exact(&mut req).await?;
        compute(plan.compute, &mut spent.compute).await;
        s.write_all(&response(i, plan.resp)).await?;
    }
    Ok(spent)
}

async fn run_sma(node: &Node, l: &TcpListener, plan: &Plan) -> anyhow::Result<Spent> {
    let (tcp, _) = l.accept().await?;
    let s = TxStream::new(tcp, node.tm().clone(), LoggerConfig::default());
    let mut req = [0u8; REQUEST];
    let mut spent = Spent::default();
    for i in 0..plan.txs {
        let resp = response(i, plan.resp);
        let mut tx = node.begin();
        s.start(tx.tid())?;
        s.read_exact(&mut req).await?;
        if plan.aborts[i] {
            compute(plan.compute / 2, &mut spent.compute).await;
            s.write_all(&vec![b'X'; plan.resp / 2]).await?;
            let t = Instant::now();
            tx.abort("aborted half-way (benchmark)").await?;
            tx = node.begin();
            s.restart(tx.tid())?;
            spent.control += t.elapsed();
            s.read_exact(&mut req).await?;
        }
        compute(plan.compute, &mut spent.compute).await;
        s.write_all(&resp).await?;
        let t = Instant::now();
        tx.commit().await?;
        spent.control += t.elapsed();
        spent.commit += t.elapsed();
    }
    s.shutdown().await;
    Ok(spent)
}

async fn run_tca(server: &Node, l: &TcpListener, plan: &Plan) -> anyhow::Result<Spent> {
    let (tcp, _) = l.accept().await?;
    let s = ProxiedStream::new(
        tcp,
        server.rpc().clone(),
        NodeId(1),
        LoggerConfig::default(),
    )?;
    let mut req = [0u8; REQUEST];
    let mut spent = Spent::default();
    for i in 0..plan.txs {
        let resp = response(i, plan.resp);
        let mut tx = server.begin();
        let t = Instant::now();
        s.start(&tx).await?;
        spent.control += t.elapsed();
        s.read_exact(&mut req).await?;
        if plan.aborts[i] {
            compute(plan.compute / 2, &mut spent.compute).await;
            s.write_all(&vec![b'X'; plan.resp / 2]).await?;
            let t = Instant::now();
            s.abort(tx, "aborted half-way (benchmark)").await?;
            tx = server.begin();
            s.restart(&tx).await?;
            spent.control += t.elapsed();
            s.read_exact(&mut req).await?;
        }
        compute(plan.compute, &mut spent.compute).await;
        s.write_all(&resp).await?;
        let t = Instant::now();
        s.commit(tx).await?;
        spent.control += t.elapsed();
        spent.commit += t.elapsed();
    }
    s.shutdown().await;
    Ok(spent)
}

async fn run_tla(server: &Node, l: &TcpListener, plan: &Plan) -> anyhow::Result<Spent> {
    let (tcp, _) = l.accept().await?;
    let s = TlaStream::new(
        tcp,
        server.rpc().clone(),
        NodeId(TLA_NODE),
        LoggerConfig::default(),
    )?;
    let mut req = [0u8; REQUEST];
    let mut spent = Spent::default();
    for i in 0..plan.txs {
        let resp = response(i, plan.resp);
        let mut tx = server.begin();
        let t = Instant::now();
        s.start(&tx).await?;
        spent.control += t.elapsed();
        s.read_exact(&mut req).await?;
        if plan.aborts[i] {
            compute(plan.compute / 2, &mut spent.compute).await;
            s.write_all(&vec![b'X'; plan.resp / 2]).await?;
            let t = Instant::now();
            s.abort(tx, "aborted half-way (benchmark)").await?;
            tx = server.begin();
            s.restart(&tx).await?;
            spent.control += t.elapsed();
            s.read_exact(&mut req).await?;
        }
        compute(plan.compute, &mut spent.compute).await;
        s.write_all(&resp).await?;
        let t = Instant::now();
        s.commit(tx).await?;
        spent.control += t.elapsed();
        spent.commit += t.elapsed();
    }
    s.shutdown().await;
    Ok(spent)
}

/// The TLA logger's node id in the bench's cluster.
const TLA_NODE: u32 = 4;

/// TLA's set-up: the peer's namespace with its TUN device, the server's TUN
/// device, routes, the logger node and the server's listener on the
/// server's side. Removed on drop.
struct TlaLab {
    ns: String,
    server_tun: String,
    logger: Node,
    /// Where the server accepts peers (its address on the TUN's network).
    listener: TcpListener,
}

fn ip(args: &[&str]) -> anyhow::Result<()> {
    let s = std::process::Command::new("ip")
        .args(args)
        .status()
        .context("running ip")?;
    if !s.success() {
        bail!("ip {} failed", args.join(" "));
    }
    Ok(())
}

impl TlaLab {
    async fn new(dir: &std::path::Path, join: SocketAddr) -> anyhow::Result<TlaLab> {
        if !weft_net::tla::tun::is_root() {
            bail!("--arch tla needs root (a network namespace, TUN devices, routes)");
        }
        let n = std::process::id() % 200;
        let ns = format!("wbench{n}");
        let (pt, st) = (format!("wbp{n}"), format!("wbs{n}"));
        let _ = std::process::Command::new("ip")
            .args(["netns", "del", &ns])
            .stderr(std::process::Stdio::null())
            .status();
        let _ = std::process::Command::new("ip")
            .args(["link", "del", &st])
            .stderr(std::process::Stdio::null())
            .status();
        ip(&["netns", "add", &ns])?;
        let lab_ns = ns.clone();
        let lab_st = st.clone();
        let cleanup = move || {
            let _ = std::process::Command::new("ip")
                .args(["netns", "del", &lab_ns])
                .status();
            let _ = std::process::Command::new("ip")
                .args(["link", "del", &lab_st])
                .status();
        };
        let setup = || -> anyhow::Result<()> {
            ip(&["-n", &ns, "link", "set", "lo", "up"])?;
            ip(&["-n", &ns, "tuntap", "add", "dev", &pt, "mode", "tun"])?;
            ip(&["-n", &ns, "addr", "add", "10.203.0.2/24", "dev", &pt])?;
            ip(&["-n", &ns, "link", "set", &pt, "up"])?;
            ip(&["-n", &ns, "route", "add", "10.204.0.0/24", "dev", &pt])?;
            ip(&["tuntap", "add", "dev", &st, "mode", "tun"])?;
            ip(&["addr", "add", "10.204.0.1/24", "dev", &st])?;
            ip(&["link", "set", &st, "up"])?;
            ip(&["route", "add", "10.203.0.0/24", "dev", &st])?;
            Ok(())
        };
        if let Err(e) = setup() {
            cleanup();
            return Err(e);
        }
        let logger = TlaLogger::new(TlaLoggerConfig::new(
            TunSpec {
                name: pt,
                netns: Some(ns.clone()),
            },
            TunSpec {
                name: st.clone(),
                netns: None,
            },
        ));
        let node = Node::builder(TLA_NODE)
            .listen("127.0.0.1:0".parse()?)
            .data_dir(dir.join("tla"))
            .join(Seed::Tcp(join))
            .plugin(Arc::new(logger))
            .start()
            .await;
        let node = match node {
            Ok(n) => n,
            Err(e) => {
                cleanup();
                return Err(e).context("the TLA logger node");
            }
        };
        let listener = TcpListener::bind("10.204.0.1:0").await?;
        Ok(TlaLab {
            ns,
            server_tun: st,
            logger: node,
            listener,
        })
    }
}

impl Drop for TlaLab {
    fn drop(&mut self) {
        let _ = std::process::Command::new("ip")
            .args(["netns", "del", &self.ns])
            .status();
        let _ = std::process::Command::new("ip")
            .args(["link", "del", &self.server_tun])
            .status();
    }
}

/// The nodes and listeners every run of the process shares.
struct Setup {
    dir: tempfile::TempDir,
    sma: Node,
    proxy_node: Node,
    proxy: NetProxy,
    server: Node,
    /// Where the 2CA server accepts the proxy's connections.
    tca_upstream: TcpListener,
    /// TLA's namespace, devices and logger, when TLA runs.
    tla: Option<TlaLab>,
}

async fn setup(with_tla: bool, delegate: bool) -> anyhow::Result<Setup> {
    let dir = tempfile::tempdir()?;
    let local: SocketAddr = "127.0.0.1:0".parse()?;
    let sma = Node::builder(3)
        .data_dir(dir.path().join("sma"))
        .start()
        .await?;
    let tca_upstream = TcpListener::bind(local).await?;
    let proxy = NetProxy::new(ProxyConfig::new(local, tca_upstream.local_addr()?));
    let proxy_node = Node::builder(1)
        .listen(local)
        .data_dir(dir.path().join("proxy"))
        .plugin(Arc::new(proxy.clone()))
        .start()
        .await?;
    // The server holds nothing durable: with delegation its one logger
    // (proxy or TLA) decides, and the commit costs one force, not two.
    let server = Node::builder(2)
        .listen(local)
        .tm_config(weft::TmConfig {
            delegate_commit: delegate,
            ..Default::default()
        })
        .data_dir(dir.path().join("server"))
        .join(Seed::Tcp(proxy_node.addr().context("proxy node address")?))
        .start()
        .await?;
    let tla = if with_tla {
        let join = proxy_node.addr().context("proxy node address")?;
        Some(TlaLab::new(dir.path(), join).await?)
    } else {
        None
    };
    Ok(Setup {
        dir,
        sma,
        proxy_node,
        proxy,
        server,
        tca_upstream,
        tla,
    })
}

async fn one_run(
    arch: Arch,
    st: &Setup,
    delay: Duration,
    mbps: f64,
    plan: &Plan,
) -> anyhow::Result<RunResult> {
    let l = TcpListener::bind("127.0.0.1:0").await?;
    let (target, netns) = match (arch, &st.tla) {
        (Arch::Tca, _) => (st.proxy.listen_addr().context("proxy listening")?, None),
        (Arch::Tla, Some(t)) => (t.listener.local_addr()?, Some(t.ns.clone())),
        (Arch::Tla, None) => bail!("tla was not set up"),
        _ => (l.local_addr()?, None),
    };
    let entry = link(target, delay, mbps, netns).await?;
    let server = async {
        match (arch, &st.tla) {
            (Arch::Baseline, _) => run_baseline(&l, plan).await,
            (Arch::Sma, _) => run_sma(&st.sma, &l, plan).await,
            (Arch::Tca, _) => run_tca(&st.server, &st.tca_upstream, plan).await,
            (Arch::Tla, Some(t)) => run_tla(&st.server, &t.listener, plan).await,
            (Arch::Tla, None) => bail!("tla was not set up"),
        }
    };
    let nodes: Vec<&Node> = match (arch, &st.tla) {
        (Arch::Sma, _) => vec![&st.sma],
        (Arch::Tca, _) => vec![&st.server, &st.proxy_node],
        (Arch::Tla, Some(t)) => vec![&st.server, &t.logger],
        _ => Vec::new(),
    };
    let forced =
        |nodes: &[&Node]| -> u64 { nodes.iter().map(|n| n.tm().stats().forced_records).sum() };
    let forced_before = forced(&nodes);
    let (srv, peer) = tokio::join!(server, peer(entry, plan));
    let forces = forced(&nodes) - forced_before;
    let spent = srv.with_context(|| format!("{} server", arch.key()))?;
    let (times, total) = peer.with_context(|| format!("{} peer", arch.key()))?;
    Ok(RunResult {
        tps: plan.txs as f64 / total.as_secs_f64(),
        compute_ms: spent.compute.as_secs_f64() * 1e3 / plan.txs as f64,
        control_ms: spent.control.as_secs_f64() * 1e3 / plan.txs as f64,
        forces_per_tx: forces as f64 / plan.txs as f64,
        commit_ms: spent.commit.as_secs_f64() * 1e3 / plan.txs as f64,
        times_ms: times,
    })
}

/// Median and 90th percentile, in ms, of an fdatasync after a 200-byte
/// append in `dir`: what one forced log record costs on this disk now (2CA
/// and TLA force two per transaction on the commit path: the logger's
/// prepare record and the coordinator's commit record).
fn fdatasync_ms(dir: &std::path::Path) -> anyhow::Result<(f64, f64)> {
    use std::io::Write;
    let path = dir.join("fdatasync-probe");
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)?;
    let mut ms = Vec::new();
    for _ in 0..30 {
        f.write_all(&[b'x'; 200])?;
        let t = Instant::now();
        f.sync_data()?;
        ms.push(t.elapsed().as_secs_f64() * 1e3);
    }
    drop(f);
    let _ = std::fs::remove_file(&path);
    ms.sort_by(|a, b| a.total_cmp(b));
    Ok((ms[ms.len() / 2], ms[ms.len() * 9 / 10]))
}

/// Least-squares line y = a + b·x, and R².
fn fit(points: &[(f64, f64)]) -> (f64, f64, f64) {
    let n = points.len() as f64;
    if n < 2.0 {
        return (points.first().map_or(0.0, |p| p.1), 0.0, 1.0);
    }
    let mx = points.iter().map(|p| p.0).sum::<f64>() / n;
    let my = points.iter().map(|p| p.1).sum::<f64>() / n;
    let sxx: f64 = points.iter().map(|p| (p.0 - mx).powi(2)).sum();
    let sxy: f64 = points.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
    let syy: f64 = points.iter().map(|p| (p.1 - my).powi(2)).sum();
    let b = if sxx > 0.0 { sxy / sxx } else { 0.0 };
    let a = my - b * mx;
    let r2v = if sxx > 0.0 && syy > 0.0 {
        sxy * sxy / (sxx * syy)
    } else {
        1.0
    };
    (a, b, r2v)
}

/// Runs `weft bench net`.
pub async fn run(a: NetArgs) -> anyhow::Result<()> {
    let mut archs = Vec::new();
    for name in &a.arch {
        match name.as_str() {
            "sma" => archs.push(Arch::Sma),
            "2ca" => archs.push(Arch::Tca),
            "tla" => archs.push(Arch::Tla),
            other => bail!("unknown architecture {other:?} (sma, 2ca, tla)"),
        }
    }
    if archs.is_empty() {
        bail!("no architecture to run");
    }
    if a.txs == 0 || a.pcts.iter().any(|p| *p > 100) {
        bail!("--txs must be at least 1 and percentages at most 100");
    }
    let seed = a.seed.unwrap_or_else(rand::random);
    println!(
        "weft bench net: {} transactions, {}-byte requests, {} KB responses, compute {} ms (aborted attempts {} ms), link {} Mbit/s, seed {seed}",
        a.txs,
        REQUEST,
        a.response_kb,
        a.compute_ms,
        a.compute_ms / 2.0,
        if a.bandwidth_mbps > 0.0 { a.bandwidth_mbps.to_string() } else { "unlimited".into() },
    );
    let st = setup(archs.contains(&Arch::Tla), !a.no_delegate).await?;
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let compute = Duration::from_secs_f64(a.compute_ms / 1e3);
    let resp = a.response_kb * 1024;
    let mut report = Map::new();
    report.insert("seed".into(), json!(seed));
    report.insert("txs".into(), json!(a.txs));
    report.insert("compute_ms".into(), json!(a.compute_ms));
    report.insert("response_bytes".into(), json!(resp));
    report.insert("bandwidth_mbps".into(), json!(a.bandwidth_mbps));
    let mut all_ok = true;
    let mut series: Vec<(String, Vec<(f64, f64)>)> = Vec::new();
    let total_runs = a.delay_ms.len() * (1 + archs.len() * a.pcts.len());
    let mut done = 0;
    for &d in &a.delay_ms {
        let delay = Duration::from_millis(d);
        let suffix = if a.delay_ms.len() > 1 || d > 0 {
            format!("_d{d}")
        } else {
            String::new()
        };
        let plan = Plan {
            txs: a.txs,
            resp,
            compute,
            aborts: vec![false; a.txs],
        };
        done += 1;
        eprintln!("[{done}/{total_runs}] baseline, delay {d} ms ...");
        let base = one_run(Arch::Baseline, &st, delay, a.bandwidth_mbps, &plan).await?;
        println!(
            "
delay {d} ms one way: non-transactional baseline {:.2} tx/s",
            base.tps
        );
        report.insert(format!("baseline_tps{suffix}"), json!(r2(base.tps)));
        let base_ave = base.times_ms.iter().sum::<f64>() / base.times_ms.len() as f64;
        println!(
            "  baseline per transaction: {:.2} ms, of which compute slept {:.2} ms, the rest {:.2} ms",
            base_ave,
            base.compute_ms,
            base_ave - base.compute_ms
        );
        report.insert(
            format!("baseline_time_ms{suffix}"),
            json!({"ave": r2(base_ave), "compute": r2(base.compute_ms)}),
        );
        let (sync_med, sync_p90) = fdatasync_ms(st.dir.path())?;
        println!(
            "  one forced record (fdatasync of a 200-byte append) now: median {sync_med:.2} ms, p90 {sync_p90:.2} ms"
        );
        report.insert(
            format!("fdatasync_ms{suffix}"),
            json!({"median": r2(sync_med), "p90": r2(sync_p90)}),
        );
        println!(
            "  {:<5} {:>6} {:>8} {:>8} {:>8} {:>8} {:>7} {:>10} {:>10} {:>10} {:>10}",
            "arch",
            "commit",
            "tx/s",
            "ave ms",
            "min ms",
            "max ms",
            "r",
            "compute ms",
            "comm ms",
            "comm-slept",
            "control ms"
        );
        for &arch in &archs {
            let mut points = Vec::new();
            let mut comm = Vec::new();
            let mut comm_slept = Vec::new();
            for &pct in &a.pcts {
                let committed_first = ((pct as f64 / 100.0) * a.txs as f64).round() as usize;
                let mut aborts: Vec<bool> = (0..a.txs).map(|i| i >= committed_first).collect();
                aborts.shuffle(&mut rng);
                let plan = Plan {
                    txs: a.txs,
                    resp,
                    compute,
                    aborts,
                };
                done += 1;
                eprintln!(
                    "[{done}/{total_runs}] {} at {pct}% first-attempt commits, delay {d} ms ...",
                    arch.key()
                );
                let r = one_run(arch, &st, delay, a.bandwidth_mbps, &plan).await?;
                let ave = r.times_ms.iter().sum::<f64>() / r.times_ms.len() as f64;
                let min = r.times_ms.iter().cloned().fold(f64::INFINITY, f64::min);
                let max = r.times_ms.iter().cloned().fold(0.0, f64::max);
                let ratio = r.tps / base.tps;
                // The paper's split: nominal compute, C per committed attempt
                // and C/2 per aborted one; the rest is communication.
                let aborted = plan.aborts.iter().filter(|a| **a).count() as f64 / a.txs as f64;
                let nominal_ms = a.compute_ms * (1.0 + aborted / 2.0);
                let comm_ms = ave - nominal_ms;
                let slept_ms = ave - r.compute_ms;
                println!(
                    "  {:<5} {:>5}% {:>8.2} {:>8.2} {:>8.2} {:>8.2} {:>7.4} {:>10.2} {:>10.2} {:>10.2} {:>10.2}",
                    arch.key(), pct, r.tps, ave, min, max, ratio, r.compute_ms, comm_ms, slept_ms, r.control_ms
                );
                println!(
                    "  {:<5} {:>5}% forced log records per transaction: {:.2}; control: commit {:.2} ms, start/restart {:.2} ms",
                    arch.key(),
                    pct,
                    r.forces_per_tx,
                    r.commit_ms,
                    r.control_ms - r.commit_ms
                );
                let k = format!("{}_{pct}{suffix}", arch.key());
                report.insert(format!("r_{k}"), json!((ratio * 1e4).round() / 1e4));
                report.insert(format!("tps_{k}"), json!(r2(r.tps)));
                report.insert(
                    format!("time_ms_{k}"),
                    json!({"ave": r2(ave), "min": r2(min), "max": r2(max)}),
                );
                report.insert(
                    format!("cost_ms_{k}"),
                    json!({
                        "compute_nominal": r2(nominal_ms),
                        "compute": r2(r.compute_ms),
                        "communication": r2(comm_ms),
                        "communication_slept_out": r2(slept_ms),
                        "server_control": r2(r.control_ms),
                        "forces_per_tx": r2(r.forces_per_tx),
                        "server_commit": r2(r.commit_ms),
                    }),
                );
                points.push((pct as f64, ratio));
                comm.push((aborted, comm_ms));
                comm_slept.push((aborted, slept_ms));
                if pct == 100 && d == 0 {
                    let bound = if arch == Arch::Sma || arch == Arch::Tca {
                        0.99
                    } else {
                        0.98
                    };
                    all_ok &= check(&format!("r_{}_100", arch.key()), ratio, ">=", bound);
                }
            }
            for (name, key, pts) in [
                ("communication cost", "comm_fit", &comm),
                (
                    "with the compute slept taken out",
                    "comm_slept_fit",
                    &comm_slept,
                ),
            ] {
                let (ia, slope, rsq) = fit(pts);
                println!(
                    "  {} {name} vs abort fraction f: {:.2} + {:.2}·f ms (R² {:.3})",
                    arch.key(),
                    ia,
                    slope,
                    rsq
                );
                report.insert(
                    format!("{key}_{}{suffix}", arch.key()),
                    json!({"intercept_ms": r2(ia), "slope_ms": r2(slope), "r2": (rsq * 1e3).round() / 1e3}),
                );
            }
            series.push((
                format!("{} (delay {d} ms)", arch.key().to_uppercase()),
                points,
            ));
        }
    }
    report.insert("targets_met".into(), json!(all_ok));
    st.server.shutdown().await;
    st.proxy_node.shutdown().await;
    st.sma.shutdown().await;
    if let Some(p) = &a.json {
        write_json(p, &Value::Object(report))?;
    }
    if let Some(p) = &a.plot {
        plot(p, &series)?;
        eprintln!("wrote {}", p.display());
    }
    Ok(())
}

/// r(c) per architecture against the first-attempt commit percentage.
fn plot(path: &std::path::Path, series: &[(String, Vec<(f64, f64)>)]) -> anyhow::Result<()> {
    super::plot::ensure_font()?;
    let lo = series
        .iter()
        .flat_map(|s| s.1.iter().map(|p| p.1))
        .fold(1.0f64, f64::min)
        .min(0.5);
    let root = BitMapBackend::new(path, (900, 560)).into_drawing_area();
    root.fill(&WHITE).context("drawing")?;
    let mut chart = ChartBuilder::on(&root)
        .caption("r(c): tx/s ÷ non-transactional tx/s", ("sans-serif", 22))
        .margin(20)
        .x_label_area_size(45)
        .y_label_area_size(60)
        .build_cartesian_2d(0f64..100f64, (lo - 0.05)..1.05f64)
        .context("drawing")?;
    chart
        .configure_mesh()
        .x_desc("first-attempt commits (%)")
        .y_desc("r")
        .draw()
        .context("drawing")?;
    let colors = [BLUE, RED, GREEN, MAGENTA, CYAN, BLACK];
    for (i, (name, pts)) in series.iter().enumerate() {
        let c = colors[i % colors.len()];
        chart
            .draw_series(LineSeries::new(pts.iter().cloned(), c.stroke_width(2)))
            .context("drawing")?
            .label(name.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2)));
        chart
            .draw_series(pts.iter().map(|p| Circle::new(*p, 4, c.filled())))
            .context("drawing")?;
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .position(SeriesLabelPosition::LowerRight)
        .draw()
        .context("drawing")?;
    root.present().context("writing the chart")?;
    Ok(())
}
