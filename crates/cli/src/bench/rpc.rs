//! `weft bench rpc`: call latency against a raw TCP ping-pong measured in the
//! same run.
//!
//! Baseline: two threads exchanging `--payload` bytes over a loopback TCP
//! connection with blocking std sockets and TCP_NODELAY. Then weft: an echo
//! call between two nodes of this process over TCP (no in-process shortcut)
//! from a caller that busy-polls while it waits ([`BusyPoll`], issue 22: it
//! reads both nodes' sockets itself, so no round trip waits for a runtime
//! worker's wake-up), the same inside a transaction, the same from an
//! ordinary async caller (each message then wakes a runtime worker), and
//! between two in-process nodes. Then the
//! same-host channel (see [`super::rpc_shm`]): a bare shared-memory spin
//! ping-pong between two processes (the floor), weft RPC to a second `weft
//! node` process over shm, its throughput with 64 calls in flight and the
//! CPU an idle pair uses.
//!
//! TLS (issue 21): a second pair of nodes whose TCP link runs inside mutual
//! TLS (certificates made in memory), measured in rounds that alternate
//! with the plain TCP pair so both see the same machine: 64-byte call
//! latency, and the throughput of 1 MiB echo calls.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use serde_json::json;
use weft::{Address, BusyPoll, ChannelSet, InprocHub, Node, Payload, Seed};

use super::{check, progress, r2, write_json, Latency};

/// Flags of `weft bench rpc`.
#[derive(clap::Args, Debug)]
pub struct RpcArgs {
    /// Write the results as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Measured round trips per configuration (after a warm-up of a tenth).
    #[arg(long, default_value_t = 20_000)]
    pub calls: usize,
    /// Payload bytes per call.
    #[arg(long, default_value_t = 64)]
    pub payload: usize,
    /// Skip the shared-memory phase (e.g. where memfd is unavailable).
    #[arg(long)]
    pub no_shm: bool,
    /// 1 MiB echo calls per configuration of the bulk phase (plain TCP and
    /// TLS).
    #[arg(long, default_value_t = 200)]
    pub bulk_calls: usize,
    /// Skip the TLS phases.
    #[arg(long)]
    pub no_tls: bool,
    /// Round trips of the shared-memory phase (spin floor and calls; they
    /// cost about a hundredth of a TCP one, so more of them keep its p50
    /// steady). Default: ten times `--calls`.
    #[arg(long)]
    pub shm_calls: Option<usize>,
}

/// One measured configuration.
pub(super) struct Measured {
    lat: Latency,
    per_s: f64,
}

fn raw_tcp(calls: usize, payload: usize) -> anyhow::Result<Measured> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let server = std::thread::spawn(move || -> std::io::Result<()> {
        let (mut s, _) = listener.accept()?;
        s.set_nodelay(true)?;
        let mut buf = vec![0u8; payload];
        loop {
            if s.read_exact(&mut buf).is_err() {
                return Ok(());
            }
            s.write_all(&buf)?;
        }
    });
    let mut c = TcpStream::connect(addr)?;
    c.set_nodelay(true)?;
    let mut buf = vec![7u8; payload];
    let mut lat = Latency::default();
    let warm = calls / 10;
    let mut started = Instant::now();
    for i in 0..warm + calls {
        if i == warm {
            started = Instant::now();
        }
        let t = Instant::now();
        c.write_all(&buf)?;
        c.read_exact(&mut buf)?;
        if i >= warm {
            lat.record(t.elapsed());
        }
    }
    let per_s = calls as f64 / started.elapsed().as_secs_f64();
    drop(c);
    let _ = server.join();
    Ok(Measured { lat, per_s })
}

/// How a measured caller waits for its response.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Caller {
    /// An async task on the runtime: it sleeps until the reader task that
    /// took the response wakes it.
    Task,
    /// A thread of its own that busy-polls the process's channels while it
    /// waits ([`BusyPoll`]).
    BusyPoll,
}

/// `calls` echo calls of `payload` bytes to `to`, one at a time, after a
/// warm-up of a tenth, inside one transaction when `transactional`, from a
/// caller of the given kind.
///
/// Fails with the first call's failure.
async fn weft_calls(
    node: &Node,
    to: &Address,
    calls: usize,
    payload: usize,
    transactional: bool,
    caller: Caller,
) -> anyhow::Result<Measured> {
    match caller {
        Caller::Task => call_loop(node, to, calls, payload, transactional).await,
        Caller::BusyPoll => {
            let (node, to) = (node.clone(), to.clone());
            tokio::task::spawn_blocking(move || {
                BusyPoll::new().block_on(call_loop(&node, &to, calls, payload, transactional))
            })
            .await?
        }
    }
}

async fn call_loop(
    node: &Node,
    to: &Address,
    calls: usize,
    payload: usize,
    transactional: bool,
) -> anyhow::Result<Measured> {
    let body = vec![7u8; payload];
    let tx = transactional.then(|| {
        node.rpc()
            .begin_with_timeout(Some(Duration::from_secs(3600)))
    });
    let mut lat = Latency::default();
    let warm = calls / 10;
    let mut started = Instant::now();
    for i in 0..warm + calls {
        if i == warm {
            started = Instant::now();
        }
        let p = Payload::bytes(body.clone());
        let t = Instant::now();
        let r = match &tx {
            Some(tx) => tx.call_payload(to, p).await?,
            None => node.rpc().call_payload(None, to, p, None).await?,
        };
        if i >= warm {
            lat.record(t.elapsed());
        }
        debug_assert!(matches!(r, Payload::Bytes(ref b) if b.len() == payload) || r.is_local());
    }
    let per_s = calls as f64 / started.elapsed().as_secs_f64();
    if let Some(tx) = tx {
        tx.commit().await?;
    }
    Ok(Measured { lat, per_s })
}

/// Runs `weft bench rpc`.
pub async fn run(args: RpcArgs) -> anyhow::Result<()> {
    let calls = args.calls.max(100);
    let pb = progress("raw TCP ping-pong (baseline)");
    let raw = tokio::task::spawn_blocking(move || raw_tcp(calls, args.payload)).await??;
    pb.finish_and_clear();

    let pb = progress("weft RPC over TCP");
    let tcp_only = ChannelSet {
        inproc: false,
        shm: false,
        tcp: true,
    };
    let a = Node::builder(1)
        .listen("127.0.0.1:0".parse()?)
        .channels(tcp_only)
        .hub(InprocHub::new())
        .checkpoint_every(None)
        .start()
        .await?;
    let b = Node::builder(2)
        .listen("127.0.0.1:0".parse()?)
        .channels(tcp_only)
        .hub(InprocHub::new())
        .join(Seed::Tcp(a.addr().expect("listening")))
        .checkpoint_every(None)
        .start()
        .await?;
    let echo_b: Address = "echo@2".parse()?;
    let rpc_tcp = weft_calls(&a, &echo_b, calls, args.payload, false, Caller::BusyPoll).await?;
    pb.set_message("weft RPC over TCP, in a transaction");
    let rpc_tcp_tx = weft_calls(&a, &echo_b, calls, args.payload, true, Caller::BusyPoll).await?;
    pb.set_message("weft RPC over TCP, from an async caller");
    let rpc_tcp_async = weft_calls(&a, &echo_b, calls, args.payload, false, Caller::Task).await?;
    pb.finish_and_clear();
    let tls = if args.no_tls {
        None
    } else {
        let pb = progress("weft RPC over TCP inside TLS, alternating with plain TCP");
        let figures = tls_phase(&a, calls, args.payload, args.bulk_calls.max(4)).await;
        pb.finish_and_clear();
        Some(figures?)
    };
    b.shutdown().await;
    a.shutdown().await;

    let pb = progress("weft RPC in-process");
    let hub = InprocHub::new();
    let c = Node::builder(1)
        .hub(hub.clone())
        .checkpoint_every(None)
        .start()
        .await?;
    let d = Node::builder(2)
        .hub(hub.clone())
        .join(Seed::Inproc(weft::NodeId(1)))
        .checkpoint_every(None)
        .start()
        .await?;
    let inproc = weft_calls(&c, &echo_b, calls, args.payload, false, Caller::Task).await?;
    pb.finish_and_clear();
    d.shutdown().await;
    c.shutdown().await;

    let shm = if args.no_shm {
        None
    } else {
        let pb = progress("shared memory: spin floor, then weft RPC to a second process");
        let shm_calls = args.shm_calls.unwrap_or(calls * 10).max(100);
        let figures = super::rpc_shm::rpc_over_shm(shm_calls, args.payload, &pb).await;
        pb.finish_and_clear();
        Some(figures?)
    };

    let base = raw.lat.p50();
    println!(
        "weft bench rpc: {} calls of {} bytes each, p50/p99 in µs",
        calls, args.payload
    );
    println!(
        "{:<26} {:>9} {:>9} {:>11} {:>12}",
        "configuration", "p50", "p99", "calls/s", "p50 / raw"
    );
    for (name, m) in [
        ("tcp raw (baseline)", &raw),
        ("weft rpc tcp", &rpc_tcp),
        ("weft rpc tcp + tx context", &rpc_tcp_tx),
        ("weft rpc tcp, async caller", &rpc_tcp_async),
        ("weft rpc inproc", &inproc),
    ] {
        row(name, &m.lat, m.per_s, base);
    }
    if let Some(t) = &tls {
        row("weft rpc tcp (beside tls)", &t.plain, t.plain_per_s, base);
        row("weft rpc tcp + tls", &t.tls, t.tls_per_s, base);
        println!(
            "bulk 1 MiB echo calls: tcp {:.1} MiB/s, tcp + tls {:.1} MiB/s (each way)",
            t.plain_bulk_mib_s, t.tls_bulk_mib_s
        );
    }
    if let Some(f) = &shm {
        row("shm raw spin (floor)", &f.raw_spin, f.raw_spin_per_s, base);
        row("weft rpc shm", &f.rpc, f.rpc_per_s, base);
        println!(
            "weft rpc shm, {} in flight: {:.0} calls/s; idle pair: {:.2}% of a core over {:?}",
            super::rpc_shm::IN_FLIGHT,
            f.rpc_pipelined_per_s,
            f.idle_cpu_percent,
            f.idle_window
        );
        let rounds: Vec<String> = f
            .rounds
            .iter()
            .map(|(spin, rpc)| format!("{rpc:.3}/{spin:.3}"))
            .collect();
        println!(
            "shm rounds (rpc p50 / floor p50, µs, alternating): {}",
            rounds.join("  ")
        );
    }
    println!("targets:");
    let t1 = check(
        "rpc_tcp_p50 / tcp_raw_p50",
        rpc_tcp.lat.p50() / base,
        "<=",
        1.2,
    );
    let t2 = check(
        "rpc_tcp_tx_p50 / rpc_tcp_p50",
        rpc_tcp_tx.lat.p50() / rpc_tcp.lat.p50(),
        "<=",
        1.05,
    );
    let t3 = check(
        "rpc_inproc_p50 / tcp_raw_p50",
        inproc.lat.p50() / base,
        "<=",
        0.1,
    );
    let tls_targets = tls.as_ref().map(|t| {
        json!({
            "rpc_tls_p50": check(
                "rpc_tls_p50 / rpc_tcp_p50 (alternating rounds)",
                t.tls.p50() / t.plain.p50(),
                "<=",
                1.15,
            ),
            "rpc_tls_bulk": check(
                "tls bulk / tcp bulk (1 MiB calls)",
                t.tls_bulk_mib_s / t.plain_bulk_mib_s,
                ">=",
                0.8,
            ),
        })
    });
    let shm_to_spin = shm.as_ref().map_or(0.0, |f| {
        f.rpc.p50_ns() as f64 / f.raw_spin.p50_ns().max(1) as f64
    });
    let shm_targets = shm.as_ref().map(|f| {
        json!({
            "rpc_shm_vs_tcp_raw": check("rpc_shm_p50 / tcp_raw_p50", f.rpc.p50() / base, "<=", 0.1),
            "rpc_shm_vs_raw_spin": check(
                "rpc_shm_p50 / shm_raw_spin_p50",
                shm_to_spin,
                "<=",
                10.0,
            ),
            "idle_cpu": check("idle pair CPU % of a core", f.idle_cpu_percent, "<=", 1.0),
        })
    });
    let mut report = json!({
        "calls": calls,
        "payload_bytes": args.payload,
        "tcp_raw_p50_us": raw.lat.p50(),
        "tcp_raw_p99_us": raw.lat.p99(),
        "tcp_raw_calls_per_s": r2(raw.per_s),
        "rpc_tcp_p50_us": rpc_tcp.lat.p50(),
        "rpc_tcp_p99_us": rpc_tcp.lat.p99(),
        "rpc_tcp_calls_per_s": r2(rpc_tcp.per_s),
        "rpc_tcp_caller": "busy-poll",
        "rpc_tcp_async_p50_us": rpc_tcp_async.lat.p50(),
        "rpc_tcp_async_p99_us": rpc_tcp_async.lat.p99(),
        "rpc_tcp_async_calls_per_s": r2(rpc_tcp_async.per_s),
        "rpc_tcp_tx_p50_us": rpc_tcp_tx.lat.p50(),
        "rpc_tcp_tx_p99_us": rpc_tcp_tx.lat.p99(),
        "rpc_tcp_tx_calls_per_s": r2(rpc_tcp_tx.per_s),
        "rpc_inproc_p50_us": inproc.lat.p50(),
        "rpc_inproc_p99_us": inproc.lat.p99(),
        "rpc_inproc_calls_per_s": r2(inproc.per_s),
        "ratio_rpc_tcp_to_raw": r2(rpc_tcp.lat.p50() / base),
        "ratio_rpc_tcp_tx_to_rpc_tcp": r2(rpc_tcp_tx.lat.p50() / rpc_tcp.lat.p50()),
        "ratio_rpc_inproc_to_raw": r2(inproc.lat.p50() / base),
        "targets_met": { "rpc_tcp": t1, "rpc_tcp_tx": t2, "rpc_inproc": t3 },
    });
    if let Some(f) = &shm {
        let extra = json!({
            "shm_raw_spin_p50_us": f.raw_spin.p50(),
            "shm_raw_spin_p99_us": f.raw_spin.p99(),
            "rpc_shm_p50_us": f.rpc.p50(),
            "rpc_shm_p99_us": f.rpc.p99(),
            "rpc_shm_calls_per_s": r2(f.rpc_per_s),
            "rpc_shm_calls_per_s_64_in_flight": r2(f.rpc_pipelined_per_s),
            "idle_pair_cpu_percent": r2(f.idle_cpu_percent),
            "ratio_rpc_shm_to_tcp_raw": r2(f.rpc.p50() / base),
            "shm_raw_spin_p50_ns": f.raw_spin.p50_ns(),
            "rpc_shm_p50_ns": f.rpc.p50_ns(),
            "shm_calls": f.calls,
            "ratio_rpc_shm_to_raw_spin": r2(shm_to_spin),
            "shm_rounds": f.rounds.iter().map(|(spin, rpc)| json!({
                "shm_raw_spin_p50_us": spin,
                "rpc_shm_p50_us": rpc,
            })).collect::<Vec<_>>(),
            "shm_targets_met": shm_targets,
        });
        if let (Some(obj), serde_json::Value::Object(more)) = (report.as_object_mut(), extra) {
            obj.extend(more);
        }
    }
    if let Some(t) = &tls {
        let extra = json!({
            "rpc_tls_p50_us": t.tls.p50(),
            "rpc_tls_p99_us": t.tls.p99(),
            "rpc_tls_calls_per_s": r2(t.tls_per_s),
            "rpc_tcp_beside_tls_p50_us": t.plain.p50(),
            "rpc_tcp_beside_tls_p99_us": t.plain.p99(),
            "ratio_rpc_tls_to_rpc_tcp": r2(t.tls.p50() / t.plain.p50()),
            "bulk_payload_bytes": BULK,
            "bulk_calls": t.bulk_calls,
            "rpc_tcp_bulk_mib_per_s": r2(t.plain_bulk_mib_s),
            "rpc_tls_bulk_mib_per_s": r2(t.tls_bulk_mib_s),
            "ratio_rpc_tls_bulk_to_rpc_tcp_bulk": r2(t.tls_bulk_mib_s / t.plain_bulk_mib_s),
            "tls_targets_met": tls_targets,
        });
        if let (Some(obj), serde_json::Value::Object(more)) = (report.as_object_mut(), extra) {
            obj.extend(more);
        }
    }
    if let Some(path) = &args.json {
        write_json(path, &report)?;
    }
    Ok(())
}

fn row(name: &str, lat: &Latency, per_s: f64, base: f64) {
    println!(
        "{:<26} {:>9.2} {:>9.2} {:>11.0} {:>12.3}",
        name,
        lat.p50(),
        lat.p99(),
        per_s,
        lat.p50() / base
    );
}

/// Payload of a bulk call.
const BULK: usize = 1 << 20;

/// Rounds each TLS figure is measured in, alternating with plain TCP.
const TLS_ROUNDS: usize = 4;

/// The TLS phase's figures, each beside the plain TCP one measured in
/// alternation with it.
struct TlsFigures {
    plain: Latency,
    plain_per_s: f64,
    tls: Latency,
    tls_per_s: f64,
    bulk_calls: usize,
    plain_bulk_mib_s: f64,
    tls_bulk_mib_s: f64,
}

/// Starts two TLS nodes (node 1 and 2 of their own cluster, certificates
/// made here) and measures them in rounds alternating with `plain` (node 1
/// of a plain TCP pair whose node 2 serves `echo`).
async fn tls_phase(
    plain: &Node,
    calls: usize,
    payload: usize,
    bulk_calls: usize,
) -> anyhow::Result<TlsFigures> {
    use weft_transport::certs::{ClusterCa, Validity};
    let ca = ClusterCa::generate(Validity::days(1))?;
    let tls_of = |node: u32| -> anyhow::Result<weft::TlsConfig> {
        let pair = ca.issue_node(node, Validity::days(1))?;
        Ok(weft::TlsConfig::from_pem(
            pair.cert.as_bytes(),
            pair.key.as_bytes(),
            ca.cert_pem().as_bytes(),
        )?)
    };
    let tcp_only = ChannelSet {
        inproc: false,
        shm: false,
        tcp: true,
    };
    let a = Node::builder(1)
        .listen("127.0.0.1:0".parse()?)
        .channels(tcp_only)
        .hub(InprocHub::new())
        .tls(Some(tls_of(1)?))
        .checkpoint_every(None)
        .start()
        .await?;
    let b = Node::builder(2)
        .listen("127.0.0.1:0".parse()?)
        .channels(tcp_only)
        .hub(InprocHub::new())
        .tls(Some(tls_of(2)?))
        .join(Seed::Tcp(a.addr().expect("listening")))
        .checkpoint_every(None)
        .start()
        .await?;
    let echo_b: Address = "echo@2".parse()?;
    let mut f = TlsFigures {
        plain: Latency::default(),
        plain_per_s: 0.0,
        tls: Latency::default(),
        tls_per_s: 0.0,
        bulk_calls,
        plain_bulk_mib_s: 0.0,
        tls_bulk_mib_s: 0.0,
    };
    let per_round = (calls / TLS_ROUNDS).max(100);
    let (mut plain_s, mut tls_s) = (0.0, 0.0);
    for _ in 0..TLS_ROUNDS {
        let m = weft_calls(plain, &echo_b, per_round, payload, false, Caller::Task).await?;
        f.plain.merge(&m.lat);
        plain_s += per_round as f64 / m.per_s;
        let m = weft_calls(&a, &echo_b, per_round, payload, false, Caller::Task).await?;
        f.tls.merge(&m.lat);
        tls_s += per_round as f64 / m.per_s;
    }
    f.plain_per_s = (per_round * TLS_ROUNDS) as f64 / plain_s;
    f.tls_per_s = (per_round * TLS_ROUNDS) as f64 / tls_s;
    let bulk_round = (bulk_calls / TLS_ROUNDS).max(1);
    let (mut plain_s, mut tls_s) = (0.0, 0.0);
    for _ in 0..TLS_ROUNDS {
        plain_s += bulk(plain, &echo_b, bulk_round).await?;
        tls_s += bulk(&a, &echo_b, bulk_round).await?;
    }
    let mib = (bulk_round * TLS_ROUNDS * BULK) as f64 / (1 << 20) as f64;
    f.plain_bulk_mib_s = mib / plain_s;
    f.tls_bulk_mib_s = mib / tls_s;
    b.shutdown().await;
    a.shutdown().await;
    Ok(f)
}

/// Seconds `n` echo calls of [`BULK`] bytes take, one at a time.
async fn bulk(node: &Node, to: &Address, n: usize) -> anyhow::Result<f64> {
    let body = bytes::Bytes::from(vec![7u8; BULK]);
    let started = Instant::now();
    for _ in 0..n {
        let r = node
            .rpc()
            .call_payload(None, to, Payload::bytes(body.clone()), None)
            .await?;
        anyhow::ensure!(
            matches!(&r, Payload::Bytes(b) if b.len() == BULK) || r.is_local(),
            "a bulk echo came back changed"
        );
    }
    Ok(started.elapsed().as_secs_f64())
}
