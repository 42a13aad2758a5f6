//! `weft bench group`: group send latency against unicast baselines measured
//! in the same run, on a cluster of nodes inside this process. By default
//! the nodes talk over TCP loopback (no in-process shortcut between nodes,
//! as `weft bench rpc` measures RPC): the in-process channel runs a callee
//! synchronously inside its caller, which makes a unicast call a function
//! call, while one-way group messages always pass through the receiving
//! endpoint's inbox task. [`BenchChannel::Inproc`] measures that case too.
//!
//! For each member count, members are spread over the nodes (the sender's
//! node last) and each runs a receive-reply loop. Measured: `send` until the
//! delivery count returns, `request` until the first reply, and a send until
//! every reply was taken; baselines: one unicast RPC (echo at another node)
//! and sequential unicast RPCs to the node of every member. Iterations never
//! overlap: each waits until every member finished the previous one.
//!
//! Owns the measurement and its report. Must never be a timed test: targets
//! are checked and printed by the caller, never asserted here.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use serde::Serialize;
use weft_log::{Log, LogConfig};
use weft_rpc::{Rpc, RpcConfig};
use weft_transport::{ChannelSet, Endpoint, InprocHub, Seed, TransportConfig};
use weft_tx::{TmConfig, TxManager};
use weft_wire::{Address, Failure, GroupId, Incarnation, NodeId, Payload, Status};

use crate::config::GroupConfig;
use crate::runtime::Groups;

/// How the benchmark's nodes reach each other.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum BenchChannel {
    /// TCP loopback between nodes (each node alone in its in-process hub).
    Tcp,
    /// The in-process channel between nodes.
    Inproc,
}

/// What to measure.
#[derive(Clone, Debug)]
pub struct BenchOptions {
    /// How nodes reach each other.
    pub channel: BenchChannel,
    /// Nodes in the in-process cluster (at least 2).
    pub nodes: u32,
    /// Member counts to measure.
    pub members: Vec<usize>,
    /// Measured iterations per figure.
    pub iterations: usize,
    /// Unmeasured iterations first.
    pub warmup: usize,
    /// Message and reply size in bytes.
    pub payload: usize,
}

impl Default for BenchOptions {
    fn default() -> Self {
        BenchOptions {
            channel: BenchChannel::Tcp,
            nodes: 4,
            members: vec![1, 4, 16],
            iterations: 2000,
            warmup: 200,
            payload: 64,
        }
    }
}

/// The figures of one run, in microseconds. `figures` holds, for each member
/// count `m`: `send_{m}_p50_us`, `send_{m}_p99_us`, `request_{m}_p50_us`,
/// `request_{m}_p99_us`, `all_replies_{m}_p50_us`, `all_replies_{m}_p99_us`,
/// `seq_unicast_{m}_p50_us`, `seq_unicast_{m}_p99_us`.
#[derive(Clone, Debug, Serialize)]
pub struct GroupBenchReport {
    /// How nodes reached each other.
    pub channel: BenchChannel,
    /// Nodes in the cluster.
    pub nodes: u32,
    /// Member counts measured.
    pub members: Vec<usize>,
    /// Measured iterations per figure.
    pub iterations: usize,
    /// Message size in bytes.
    pub payload: usize,
    /// One unicast RPC to another node, median.
    pub unicast_p50_us: f64,
    /// One unicast RPC, 99th percentile.
    pub unicast_p99_us: f64,
    /// Per member count figures (see the type's documentation).
    #[serde(flatten)]
    pub figures: BTreeMap<String, f64>,
    /// `send_{M}_p50_us / unicast_p50_us` for the largest member count M
    /// (target: at most 2).
    pub send_vs_unicast: f64,
    /// `all_replies_{M}_p50_us / seq_unicast_{M}_p50_us` for the largest
    /// member count M (target: at most 0.3).
    pub all_replies_vs_seq_unicast: f64,
}

impl GroupBenchReport {
    /// The figure `key` (0 when absent).
    pub fn figure(&self, key: &str) -> f64 {
        self.figures.get(key).copied().unwrap_or(0.0)
    }
}

struct Latency(Histogram<u64>);

impl Latency {
    fn new() -> Latency {
        Latency(Histogram::new_with_bounds(1, 60_000_000_000, 3).expect("valid histogram bounds"))
    }

    fn record(&mut self, d: Duration) {
        let ns = (d.as_nanos().min(60_000_000_000) as u64).max(1);
        let _ = self.0.record(ns);
    }

    fn us(&self, q: f64) -> f64 {
        (self.0.value_at_quantile(q) as f64 / 10.0).round() / 100.0
    }
}

struct BenchNode {
    groups: Groups,
    rpc: Rpc,
    endpoint: Endpoint,
    _dir: tempfile::TempDir,
}

/// A node's own runtime on its own thread, as if it were a process.
struct NodeRuntime {
    handle: tokio::runtime::Handle,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl NodeRuntime {
    fn start(id: u32) -> Result<NodeRuntime, Failure> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| fail("runtime", e))?;
        let handle = rt.handle().clone();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::Builder::new()
            .name(format!("bench-node-{id}"))
            .spawn(move || {
                rt.block_on(async {
                    let _ = stopped.await;
                });
            })
            .map_err(|e| fail("thread", e))?;
        Ok(NodeRuntime {
            handle,
            stop: Some(stop),
            thread: Some(thread),
        })
    }

    /// Runs `fut` on this node's runtime and waits for it.
    async fn run<T: Send + 'static>(
        &self,
        fut: impl std::future::Future<Output = T> + Send + 'static,
    ) -> Result<T, Failure> {
        self.handle
            .spawn(fut)
            .await
            .map_err(|e| fail("node task", e))
    }
}

impl Drop for NodeRuntime {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn fail(what: &str, e: impl std::fmt::Display) -> Failure {
    Failure::new(Status::Internal, format!("{what}: {e}"))
}

async fn start_node(
    id: u32,
    channel: BenchChannel,
    hub: &Arc<InprocHub>,
    seed: Option<Seed>,
) -> Result<BenchNode, Failure> {
    let dir = tempfile::Builder::new()
        .prefix("weft-group-bench-")
        .tempdir()
        .map_err(|e| fail("temporary directory", e))?;
    let log_cfg = LogConfig::new(dir.path().join("log")).preallocate(false);
    let (log, _) = Log::open(log_cfg).map_err(|e| fail("log", e))?;
    let cfg = match channel {
        BenchChannel::Inproc => TransportConfig {
            hub: Some(hub.clone()),
            ..TransportConfig::node(NodeId(id), Incarnation(1))
        },
        BenchChannel::Tcp => TransportConfig {
            hub: Some(InprocHub::new()),
            listen: Some(std::net::SocketAddr::from(([127, 0, 0, 1], 0))),
            channels: ChannelSet {
                inproc: false,
                shm: false,
                tcp: true,
            },
            ..TransportConfig::node(NodeId(id), Incarnation(1))
        },
    };
    let endpoint = Endpoint::start(cfg)
        .await
        .map_err(|e| fail("transport", e))?;
    let tm = TxManager::start(endpoint.clone(), log, TmConfig::default());
    let rpc = Rpc::new(endpoint.clone(), tm.clone(), RpcConfig::default());
    let groups = Groups::start(endpoint.clone(), Some(tm), GroupConfig::default())?;
    if let Some(seed) = seed {
        endpoint.join(seed).await?;
    }
    Ok(BenchNode {
        groups,
        rpc,
        endpoint,
        _dir: dir,
    })
}

async fn settle(done: &AtomicU64, want: u64) -> Result<(), Failure> {
    let deadline = Instant::now() + Duration::from_secs(10);
    while done.load(Ordering::Acquire) < want {
        if Instant::now() > deadline {
            return Err(Failure::new(
                Status::TimedOut,
                "members did not finish an iteration",
            ));
        }
        tokio::task::yield_now().await;
    }
    Ok(())
}

/// Latencies of one member count, measured at the sender's node.
struct Measured {
    unicast: Latency,
    send: Latency,
    all: Latency,
    request: Latency,
    seq: Latency,
    par: Latency,
}

/// The measuring loops, run on the sender's node (node 1).
async fn measure(
    groups: Groups,
    rpc: Rpc,
    gid: GroupId,
    members: usize,
    homes: Vec<u32>,
    done: Arc<AtomicU64>,
    opts: BenchOptions,
) -> Result<Measured, Failure> {
    let body = vec![7u8; opts.payload];
    let total = opts.warmup + opts.iterations;
    let timeout = Duration::from_secs(5);
    let sender = groups.sender();
    let mut m = Measured {
        unicast: Latency::new(),
        send: Latency::new(),
        all: Latency::new(),
        request: Latency::new(),
        seq: Latency::new(),
        par: Latency::new(),
    };
    let echo = |n: u32| Address::new("echo", NodeId(n)).map_err(|e| fail("address", e));
    let targets: Vec<Address> = homes.iter().map(|h| echo(*h)).collect::<Result<_, _>>()?;
    let unicast_to = echo(2)?;
    let mut distinct: Vec<Address> = Vec::new();
    for t in &targets {
        if !distinct.contains(t) {
            distinct.push(t.clone());
        }
    }
    // The kinds of measurement take turns, so that whatever else the
    // machine does at a given moment weighs on all of them alike.
    let mut expected = 0u64;
    for i in 0..total {
        let measured = i >= opts.warmup;
        // A send, then every reply.
        let t = Instant::now();
        let n = sender.send(&gid, Payload::bytes(body.clone())).await?;
        let sent = t.elapsed();
        for _ in 0..n {
            sender.next_reply(&gid, timeout).await?;
        }
        let everything = t.elapsed();
        if measured {
            m.send.record(sent);
            m.all.record(everything);
        }
        expected += members as u64;
        settle(&done, expected).await?;
        // A request (the first reply ends the communication).
        let t = Instant::now();
        sender
            .request(&gid, Payload::bytes(body.clone()), timeout)
            .await?;
        if measured {
            m.request.record(t.elapsed());
        }
        expected += members as u64;
        settle(&done, expected).await?;
        // Baseline: one unicast call to another node.
        let t = Instant::now();
        rpc.call_payload(None, &unicast_to, Payload::bytes(body.clone()), None)
            .await?;
        if measured {
            m.unicast.record(t.elapsed());
        }
        // Baseline: one call after the other to the node of every member.
        let t = Instant::now();
        for to in &targets {
            rpc.call_payload(None, to, Payload::bytes(body.clone()), None)
                .await?;
        }
        if measured {
            m.seq.record(t.elapsed());
        }
        // The floor of a fan-out: one call to every member node at once.
        let t = Instant::now();
        let calls = distinct
            .iter()
            .map(|to| rpc.call_payload(None, to, Payload::bytes(body.clone()), None));
        for r in futures::future::join_all(calls).await {
            r?;
        }
        if measured {
            m.par.record(t.elapsed());
        }
    }
    Ok(m)
}

/// Runs the benchmark on a fresh cluster of nodes inside this process, each
/// node on its own runtime thread (as if it were a process).
///
/// Fails with BadRequest for fewer than 2 nodes or no member count, or with
/// the status of the first operation that failed.
pub async fn bench(opts: BenchOptions) -> Result<GroupBenchReport, Failure> {
    if opts.nodes < 2 || opts.members.is_empty() || opts.iterations == 0 {
        return Err(Failure::new(
            Status::BadRequest,
            "the group benchmark needs at least 2 nodes, a member count and an iteration",
        ));
    }
    let hub = InprocHub::new();
    let mut runtimes = Vec::new();
    let mut nodes: Vec<BenchNode> = Vec::new();
    for id in 1..=opts.nodes {
        let seed = match (id, opts.channel) {
            (1, _) => None,
            (_, BenchChannel::Inproc) => Some(Seed::Inproc(NodeId(1))),
            (_, BenchChannel::Tcp) => Some(Seed::Tcp(
                nodes[0]
                    .endpoint
                    .listen_addr()
                    .ok_or_else(|| fail("node 1", "not listening"))?,
            )),
        };
        let rt = NodeRuntime::start(id)?;
        let (channel, hub) = (opts.channel, hub.clone());
        nodes.push(
            rt.run(async move { start_node(id, channel, &hub, seed).await })
                .await??,
        );
        runtimes.push(rt);
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while nodes
        .iter()
        .any(|n| n.endpoint.view().nodes.iter().filter(|s| s.alive).count() < opts.nodes as usize)
    {
        if Instant::now() > deadline {
            return Err(Failure::new(Status::TimedOut, "the cluster did not form"));
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let body = vec![7u8; opts.payload];
    let mut unicast = Latency::new();
    let mut figures = BTreeMap::new();
    for &m in &opts.members {
        let gid = GroupId::named("bench", &format!("m{m}")).map_err(|e| fail("group id", e))?;
        nodes[0].groups.create(&gid, "").await?;
        let done = Arc::new(AtomicU64::new(0));
        let mut tasks = Vec::new();
        let mut homes = Vec::new();
        for i in 0..m {
            let home = (i as u32 + 1) % opts.nodes; // the sender's node last
            homes.push(home + 1);
            let node = &nodes[home as usize];
            let (groups, gid, done, reply) =
                (node.groups.clone(), gid.clone(), done.clone(), body.clone());
            let joined = tokio::sync::oneshot::channel();
            let (joined_tx, joined_rx) = joined;
            tasks.push(runtimes[home as usize].handle.spawn(async move {
                let member = match groups.join(&gid, "").await {
                    Ok(m) => {
                        let _ = joined_tx.send(Ok(()));
                        m
                    }
                    Err(f) => {
                        let _ = joined_tx.send(Err(f));
                        return;
                    }
                };
                loop {
                    match member.recv(&gid, None).await {
                        Ok(incoming) => {
                            let _ = incoming.reply(Payload::bytes(reply.clone())).await;
                        }
                        Err(f) if f.status == Status::NoComm => {}
                        Err(_) => return,
                    }
                    done.fetch_add(1, Ordering::AcqRel);
                }
            }));
            joined_rx.await.map_err(|e| fail("member task", e))??;
        }
        let run = measure(
            nodes[0].groups.clone(),
            nodes[0].rpc.clone(),
            gid.clone(),
            m,
            homes,
            done,
            opts.clone(),
        );
        let measured = runtimes[0].run(run).await??;
        let _ = unicast.0.add(&measured.unicast.0);
        for t in tasks {
            t.abort();
        }
        for (name, lat) in [
            ("send", &measured.send),
            ("request", &measured.request),
            ("all_replies", &measured.all),
            ("seq_unicast", &measured.seq),
            ("par_unicast", &measured.par),
        ] {
            figures.insert(format!("{name}_{m}_p50_us"), lat.us(0.5));
            figures.insert(format!("{name}_{m}_p99_us"), lat.us(0.99));
        }
    }
    for (n, rt) in nodes.iter().zip(&runtimes) {
        let ep = n.endpoint.clone();
        let _ = rt.run(async move { ep.shutdown().await }).await;
    }
    drop(nodes);
    drop(runtimes);
    let largest = opts.members.iter().copied().max().unwrap_or(1);
    let unicast_p50 = unicast.us(0.5);
    let ratio = |a: f64, b: f64| {
        if b > 0.0 {
            (a / b * 1000.0).round() / 1000.0
        } else {
            0.0
        }
    };
    Ok(GroupBenchReport {
        channel: opts.channel,
        nodes: opts.nodes,
        members: opts.members.clone(),
        iterations: opts.iterations,
        payload: opts.payload,
        unicast_p50_us: unicast_p50,
        unicast_p99_us: unicast.us(0.99),
        send_vs_unicast: ratio(figures[&format!("send_{largest}_p50_us")], unicast_p50),
        all_replies_vs_seq_unicast: ratio(
            figures[&format!("all_replies_{largest}_p50_us")],
            figures[&format!("seq_unicast_{largest}_p50_us")],
        ),
        figures,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_short_run_reports_every_key() {
        let r = bench(BenchOptions {
            channel: BenchChannel::Inproc,
            nodes: 3,
            members: vec![1, 4],
            iterations: 20,
            warmup: 5,
            payload: 16,
        })
        .await
        .expect("bench runs");
        let json = serde_json::to_string(&r).expect("serializable");
        for key in [
            "unicast_p50_us",
            "send_4_p50_us",
            "all_replies_4_p50_us",
            "seq_unicast_4_p50_us",
            "request_1_p99_us",
        ] {
            assert!(json.contains(key), "{key} missing from {json}");
        }
        assert!(r.unicast_p50_us > 0.0 && r.figure("send_4_p50_us") > 0.0);
        assert!(bench(BenchOptions {
            nodes: 1,
            ..BenchOptions::default()
        })
        .await
        .is_err());
    }
}
