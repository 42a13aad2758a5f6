//! The shared-memory half of `weft bench rpc`: the physical floor (a bare
//! spin ping-pong between two processes), weft RPC to a second `weft node`
//! process on this host over the shm channel (latency, and throughput with
//! 64 calls in flight), and the CPU an idle pair of nodes uses.
//!
//! The floor and the calls are measured in alternating rounds: on a virtual
//! machine the floor moves by 3x from one minute to the next (it depends on
//! where the host places the two virtual CPUs), so one measured before the
//! other would compare two machines.

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::stream::{FuturesUnordered, StreamExt};
use indicatif::ProgressBar;
use weft::kv::{Kv, KvConfig};
use weft::{Address, ChannelKind, Node, NodeId, Payload};
use weft_transport::shm::{bench as shm_bench, wait_for_channel};
use weft_transport::BusyPoll;

use super::Latency;
use crate::child::ChildNode;

/// Calls kept in flight for the throughput figure.
pub const IN_FLIGHT: usize = 64;

/// Rounds of (floor, calls) the latency figures are measured in.
pub const ROUNDS: usize = 5;

/// What the shm phase measured.
pub struct ShmFigures {
    /// Round trips measured of the floor and of the calls (each, over all
    /// rounds).
    pub calls: usize,
    /// Bare spin ping-pong round trips between two processes.
    pub raw_spin: Latency,
    /// Its round trips per second.
    pub raw_spin_per_s: f64,
    /// One weft echo call at a time over shm.
    pub rpc: Latency,
    /// Its calls per second.
    pub rpc_per_s: f64,
    /// Calls per second with [`IN_FLIGHT`] in flight.
    pub rpc_pipelined_per_s: f64,
    /// Each round's (floor p50, call p50) in microseconds.
    pub rounds: Vec<(f64, f64)>,
    /// CPU both idle processes used over the idle window, in percent of one
    /// core.
    pub idle_cpu_percent: f64,
    /// The idle window.
    pub idle_window: Duration,
}

/// The bare shared-memory ping-pong with a helper process: `rounds`
/// measured round trips.
///
/// Fails when the helper process cannot be started or stops answering.
pub async fn raw_spin(rounds: usize) -> anyhow::Result<(Latency, f64)> {
    let trips = tokio::task::spawn_blocking(move || -> std::io::Result<_> {
        let peer = shm_bench::PeerCommand::current_exe()?;
        shm_bench::raw_spin_pingpong(&peer, rounds)
    })
    .await??;
    let mut lat = Latency::default();
    for s in &trips.samples {
        lat.record(*s);
    }
    Ok((lat, trips.per_second()))
}

/// Starts node 1 here and node 2 as a `weft node` child process, waits until
/// they talk over shm, then measures echo calls from 1 to 2, the pipelined
/// throughput and the idle CPU of both processes.
///
/// `pb` shows progress; its spinner is paused over the idle window so that
/// redrawing it is not counted as the nodes' CPU.
///
/// Fails when the child does not start, the link never becomes shm (shm
/// disabled or unavailable on this host), or a call fails.
pub async fn rpc_over_shm(
    calls: usize,
    payload: usize,
    pb: &ProgressBar,
) -> anyhow::Result<ShmFigures> {
    // The same services as the `weft node` child, so that neither waits on
    // the other for a layer it lacks (a group runtime asking a directory
    // without one retries for seconds, and that would count as idle CPU).
    let a = Node::builder(1)
        .listen("127.0.0.1:0".parse()?)
        .checkpoint_every(None)
        .plugin(Arc::new(Kv::new(KvConfig::default())))
        .plugin(weft_group::GroupPlugin::new(Default::default()))
        .start()
        .await?;
    let addr = a.addr().expect("listening").to_string();
    let child = ChildNode::start(
        "the benchmark's second node",
        &[
            "node".into(),
            "--id".into(),
            "2".into(),
            "--listen".into(),
            "127.0.0.1:0".into(),
            "--join".into(),
            addr,
        ],
    )?;
    let measured = measure(&a, &child, calls, payload, pb).await;
    child.terminate(Duration::from_secs(5));
    a.shutdown().await;
    measured
}

async fn measure(
    a: &Node,
    child: &ChildNode,
    calls: usize,
    payload: usize,
    pb: &ProgressBar,
) -> anyhow::Result<ShmFigures> {
    wait_for_channel(
        a.endpoint(),
        NodeId(2),
        ChannelKind::Shm,
        Duration::from_secs(10),
    )
    .await?;
    let per_round = calls.div_ceil(ROUNDS);
    let mut raw_spin_all = Latency::default();
    let mut rpc = Latency::default();
    let (mut spin_time, mut spin_trips) = (0.0, 0.0);
    let (mut rpc_time, mut rpc_calls) = (0.0, 0.0);
    let mut rounds = Vec::new();
    for _ in 0..ROUNDS {
        let (spin, spin_per_s) = raw_spin(per_round).await?;
        spin_time += per_round as f64 / spin_per_s;
        spin_trips += per_round as f64;
        let node = a.clone();
        let (lat, per_s) =
            tokio::task::spawn_blocking(move || sequential_calls(&node, per_round, payload))
                .await??;
        rpc_time += per_round as f64 / per_s;
        rpc_calls += per_round as f64;
        rounds.push((spin.p50_ns() as f64 / 1000.0, lat.p50_ns() as f64 / 1000.0));
        raw_spin_all.merge(&spin);
        rpc.merge(&lat);
    }
    let node = a.clone();
    let pipelined = tokio::task::spawn_blocking(move || {
        let echo: Address = "echo@2".parse().expect("valid address");
        let body = vec![7u8; payload];
        let mut bp = BusyPoll::new();
        let started = Instant::now();
        let pipelined: Result<usize, weft::Failure> = bp.block_on(async {
            let mut pending = FuturesUnordered::new();
            let mut issued = 0;
            let mut done = 0;
            while done < calls {
                while issued < calls && pending.len() < IN_FLIGHT {
                    let p = Payload::bytes(body.clone());
                    let rpc = node.rpc().clone();
                    let echo = echo.clone();
                    pending.push(async move { rpc.call_payload(None, &echo, p, None).await });
                    issued += 1;
                }
                match pending.next().await {
                    Some(r) => {
                        r?;
                        done += 1;
                    }
                    None => break,
                }
            }
            Ok(done)
        });
        Ok::<_, weft::Failure>(pipelined? as f64 / started.elapsed().as_secs_f64())
    })
    .await??;
    // Idle: let the spinning readers settle, then count both processes' CPU
    // with this process's spinner still (its redraws are not the nodes').
    let window = Duration::from_secs(2);
    pb.disable_steady_tick();
    pb.set_message(format!(
        "shared memory: CPU of the idle pair over {window:?} (spinner paused)"
    ));
    pb.tick();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let pids = [std::process::id(), child.id()];
    let cpu = tokio::task::spawn_blocking(move || shm_bench::cpu_percent(&pids, window)).await??;
    Ok(ShmFigures {
        calls: per_round * ROUNDS,
        raw_spin: raw_spin_all,
        raw_spin_per_s: spin_trips / spin_time,
        rpc,
        rpc_per_s: rpc_calls / rpc_time,
        rpc_pipelined_per_s: pipelined,
        rounds,
        idle_cpu_percent: cpu,
        idle_window: window,
    })
}

/// `calls` echo calls to node 2, one at a time, after a warm-up of a tenth,
/// from a thread that busy-polls the rings (so a response needs no kernel
/// wake-up). Returns their latencies and calls per second.
///
/// Fails with the first call's failure.
fn sequential_calls(
    node: &Node,
    calls: usize,
    payload: usize,
) -> Result<(Latency, f64), weft::Failure> {
    let echo: Address = "echo@2".parse().expect("valid address");
    let body = vec![7u8; payload];
    let mut bp = BusyPoll::new();
    let mut lat = Latency::default();
    let warm = calls / 10;
    let mut started = Instant::now();
    for i in 0..warm + calls {
        if i == warm {
            started = Instant::now();
        }
        let p = Payload::bytes(body.clone());
        let t = Instant::now();
        bp.block_on(node.rpc().call_payload(None, &echo, p, None))?;
        if i >= warm {
            lat.record(t.elapsed());
        }
    }
    Ok((lat, calls as f64 / started.elapsed().as_secs_f64()))
}
