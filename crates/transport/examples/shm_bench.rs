//! Transport-level measurement of the shm channel (the full RPC figure lives
//! in `weft bench rpc`): raw TCP and raw shared-memory ping-pongs between two
//! processes as baselines, then echo calls between two endpoints in two
//! processes over shm (busy-polling caller), 64 calls in flight, and the CPU
//! an idle pair uses. It re-executes itself as the helper process, exactly as
//! the CLI does.
//!
//! `cargo run --release -p weft-transport --example shm_bench [calls]`

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use weft_transport::shm::bench::{self, PeerCommand, RoundTrips, PEER_ARG};
use weft_transport::BusyPoll;
use weft_transport::*;
use weft_wire::*;

struct Echo;

impl RequestHandler for Echo {
    fn handle(&self, _from: PeerRef, req: Request, responder: Responder) {
        responder.respond(Response {
            call_id: 0,
            status: Status::Ok,
            detail: String::new(),
            tx: None,
            payload: req.payload,
        });
    }
}

fn raw_tcp(calls: usize, payload: usize) -> RoundTrips {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        s.set_nodelay(true).unwrap();
        let mut buf = vec![0u8; payload];
        while s.read_exact(&mut buf).is_ok() {
            s.write_all(&buf).unwrap();
        }
    });
    let mut c = TcpStream::connect(addr).unwrap();
    c.set_nodelay(true).unwrap();
    let mut buf = vec![7u8; payload];
    let mut samples = Vec::new();
    let start = Instant::now();
    for i in 0..calls + calls / 10 {
        let t = Instant::now();
        c.write_all(&buf).unwrap();
        c.read_exact(&mut buf).unwrap();
        if i >= calls / 10 {
            samples.push(t.elapsed());
        }
    }
    RoundTrips {
        samples,
        elapsed: start.elapsed(),
    }
}

fn request(payload: &[u8]) -> Request {
    Request {
        call_id: 0,
        service: ServiceName::new("echo").unwrap(),
        instance: 0,
        node: NodeId(2),
        budget_us: None,
        tx: None,
        flags: 0,
        payload: Payload::bytes(payload.to_vec()),
    }
}

fn show(name: &str, r: &RoundTrips, base: f64) {
    println!(
        "{name:<34} p50 {:>8.2} µs  p99 {:>8.2} µs  {:>10.0}/s  p50/tcp_raw {:.3}",
        r.quantile_us(0.5),
        r.quantile_us(0.99),
        r.per_second(),
        r.quantile_us(0.5) / base
    );
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some(PEER_ARG) {
        std::process::exit(bench::peer_main(args[2..].to_vec()));
    }
    let calls: usize = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(50_000);
    let payload = 64;
    let only_busy = std::env::var_os("SHM_BENCH_ONLY_BUSY").is_some();
    let quick = if only_busy { 100 } else { calls };
    let tcp = raw_tcp(quick.min(20_000), payload);
    let base = tcp.quantile_us(0.5);
    show("tcp raw (baseline)", &tcp, base);
    let peer = PeerCommand::current_exe().unwrap();
    let spin = bench::raw_spin_pingpong(&peer, quick * 4).unwrap();
    show("shm raw spin (floor)", &spin, base);

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let a = rt.block_on(async {
        let cfg = TransportConfig {
            listen: Some("127.0.0.1:0".parse().unwrap()),
            hub: Some(InprocHub::new()),
            ..TransportConfig::node(NodeId(1), Incarnation(1))
        };
        let a = Endpoint::start(cfg).await.unwrap();
        a.set_request_handler(Arc::new(Echo));
        a
    });
    let mut child = peer
        .command(
            "node",
            &[
                "--id".into(),
                "2".into(),
                "--join".into(),
                a.listen_addr().unwrap().to_string(),
            ],
        )
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let ready = lines.next().unwrap().unwrap();
    assert!(ready.starts_with("READY"), "{ready}");
    rt.block_on(shm::wait_for_channel(
        &a,
        NodeId(2),
        ChannelKind::Shm,
        Duration::from_secs(10),
    ))
    .unwrap();

    let _guard = rt.enter();
    let body = vec![7u8; payload];
    // Plain async caller: the runtime thread parks between calls.
    let mut samples = Vec::new();
    let start = Instant::now();
    let plain_calls = quick.min(20_000);
    for i in 0..plain_calls + plain_calls / 10 {
        let t = Instant::now();
        let r = rt
            .block_on(a.call(
                NodeId(2),
                request(&body),
                Some(Instant::now() + Duration::from_secs(10)),
            ))
            .unwrap();
        assert_eq!(r.status, Status::Ok);
        if i >= plain_calls / 10 {
            samples.push(t.elapsed());
        }
    }
    let plain = RoundTrips {
        samples,
        elapsed: start.elapsed(),
    };
    show("transport shm, parked caller", &plain, base);

    let mut bp = BusyPoll::new();
    let mut samples = Vec::new();
    let start = Instant::now();
    for i in 0..calls + calls / 10 {
        let t = Instant::now();
        let r = bp
            .block_on(a.call(
                NodeId(2),
                request(&body),
                Some(Instant::now() + Duration::from_secs(10)),
            ))
            .unwrap();
        assert_eq!(r.status, Status::Ok);
        if i >= calls / 10 {
            samples.push(t.elapsed());
        }
    }
    let busy = RoundTrips {
        samples,
        elapsed: start.elapsed(),
    };
    show("transport shm, busy-poll caller", &busy, base);

    // 64 calls in flight.
    let total = quick * 2;
    let t = Instant::now();
    bp.block_on(async {
        use futures::stream::{FuturesUnordered, StreamExt};
        let mut running = FuturesUnordered::new();
        let mut started = 0;
        let one = || {
            let a = a.clone();
            let req = request(&body);
            async move {
                a.call(
                    NodeId(2),
                    req,
                    Some(Instant::now() + Duration::from_secs(10)),
                )
                .await
                .unwrap()
            }
        };
        while started < 64 {
            running.push(one());
            started += 1;
        }
        while running.next().await.is_some() {
            if started < total {
                running.push(one());
                started += 1;
            }
        }
    });
    let per_s = total as f64 / t.elapsed().as_secs_f64();
    println!("transport shm, 64 in flight        {per_s:>10.0} calls/s");
    drop(bp);

    // Idle pair: both processes, 2 s.
    std::thread::sleep(Duration::from_millis(300));
    let pids = [std::process::id(), child.id()];
    let before = threads(&pids);
    let pct = bench::cpu_percent(&pids, Duration::from_secs(2)).unwrap();
    println!("idle pair CPU over 2 s             {pct:>10.3} % of a core");
    if std::env::var_os("SHM_BENCH_THREADS").is_some() {
        let after = threads(&pids);
        for (k, v) in &after {
            let b = before.get(k).copied().unwrap_or(0);
            if v - b > 0 {
                println!("  {k:<40} {:>8.3} ms", (v - b) as f64 / 1e6);
            }
        }
    }
    println!(
        "ratios: busy p50 / tcp raw p50 = {:.3}; busy p50 / spin p50 = {:.2}",
        busy.quantile_us(0.5) / base,
        busy.quantile_us(0.5) / spin.quantile_us(0.5)
    );
    drop(child.stdin.take());
    let _ = child.wait();
}

/// CPU nanoseconds per thread (pid/tid name) from /proc schedstat.
fn threads(pids: &[u32]) -> std::collections::BTreeMap<String, u64> {
    let mut out = std::collections::BTreeMap::new();
    for p in pids {
        let Ok(dir) = std::fs::read_dir(format!("/proc/{p}/task")) else {
            continue;
        };
        for t in dir.flatten() {
            let path = t.path();
            let comm = std::fs::read_to_string(path.join("comm")).unwrap_or_default();
            let ns = std::fs::read_to_string(path.join("schedstat"))
                .ok()
                .and_then(|s| s.split_whitespace().next().and_then(|x| x.parse().ok()))
                .unwrap_or(0u64);
            out.insert(
                format!("{p}/{} {}", t.file_name().to_string_lossy(), comm.trim()),
                ns,
            );
        }
    }
    out
}
