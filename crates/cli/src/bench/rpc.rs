//! `weft bench rpc`: call latency against a raw TCP ping-pong measured in the
//! same run.
//!
//! Baseline: two threads exchanging `--payload` bytes over a loopback TCP
//! connection with blocking std sockets and TCP_NODELAY. Then weft: an echo
//! call between two nodes of this process over TCP (no in-process shortcut),
//! the same inside a transaction, and between two in-process nodes.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use serde_json::json;
use weft::{Address, ChannelSet, InprocHub, Node, Payload, Seed};

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
}

/// One measured configuration.
struct Measured {
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

async fn weft_calls(
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
    let rpc_tcp = weft_calls(&a, &echo_b, calls, args.payload, false).await?;
    pb.set_message("weft RPC over TCP, in a transaction");
    let rpc_tcp_tx = weft_calls(&a, &echo_b, calls, args.payload, true).await?;
    pb.finish_and_clear();
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
    let inproc = weft_calls(&c, &echo_b, calls, args.payload, false).await?;
    pb.finish_and_clear();
    d.shutdown().await;
    c.shutdown().await;

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
        ("weft rpc inproc", &inproc),
    ] {
        println!(
            "{:<26} {:>9.1} {:>9.1} {:>11.0} {:>12.3}",
            name,
            m.lat.p50(),
            m.lat.p99(),
            m.per_s,
            m.lat.p50() / base
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
    let report = json!({
        "calls": calls,
        "payload_bytes": args.payload,
        "tcp_raw_p50_us": raw.lat.p50(),
        "tcp_raw_p99_us": raw.lat.p99(),
        "tcp_raw_calls_per_s": r2(raw.per_s),
        "rpc_tcp_p50_us": rpc_tcp.lat.p50(),
        "rpc_tcp_p99_us": rpc_tcp.lat.p99(),
        "rpc_tcp_calls_per_s": r2(rpc_tcp.per_s),
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
    if let Some(path) = &args.json {
        write_json(path, &report)?;
    }
    Ok(())
}
