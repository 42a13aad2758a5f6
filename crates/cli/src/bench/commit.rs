//! `weft bench commit`: distributed commit throughput. Each transaction
//! writes one key on each of two other nodes through RPC and commits
//! (presumed-abort two-phase commit, durable logs on this machine's disk).
//! Read-only transactions are measured separately. With `--pg`, the same run
//! measures PostgreSQL's own two-phase commit (a single-row UPDATE with
//! PREPARE TRANSACTION + COMMIT PREPARED) over as many connections.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use parking_lot::Mutex;
use serde_json::json;
use weft::kv::{Kv, KvConfig, KvRequest, KvResponse, Op};
use weft::{Address, InprocHub, Node, NodeId, Seed};

use super::{check, progress, r2, write_json, Latency};
use crate::client::parse_duration;

/// Flags of `weft bench commit`.
#[derive(clap::Args, Debug)]
pub struct CommitArgs {
    /// Nodes in the cluster (at least 3).
    #[arg(long, default_value_t = 3)]
    pub nodes: u32,
    /// Concurrent clients, one run per value.
    #[arg(long, value_delimiter = ',', default_value = "1,16,64")]
    pub clients: Vec<usize>,
    /// How long each run lasts.
    #[arg(long, default_value = "5s", value_parser = parse_duration)]
    pub duration: Duration,
    /// Also measure PostgreSQL two-phase commit (starts a temporary server).
    #[arg(long)]
    pub pg: bool,
    /// Directory on the disk to measure (temporary data directories are made
    /// under it and removed).
    #[arg(long, default_value = ".")]
    pub dir: PathBuf,
    /// Write the results as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// How long a log flush may wait for imminent committers (group commit);
    /// the log's default when absent.
    #[arg(long, value_parser = parse_duration)]
    pub group_commit_delay: Option<Duration>,
    /// Rounds of the metrics comparison at the largest --clients (after one
    /// unmeasured warm-up run): each round runs once with metrics off and once with the Prometheus
    /// recorder on and `/metrics` scraped every second, off first in odd
    /// rounds and on first in even ones (0: skip it).
    #[arg(long, default_value_t = 2)]
    pub metrics_rounds: usize,
}

/// Scrapes `addr` `/metrics` every second until `stop` is set; returns the
/// scrapes that succeeded and the bytes they read.
async fn scrape_every_second(
    addr: std::net::SocketAddr,
    stop: Arc<std::sync::atomic::AtomicBool>,
) -> (u64, u64) {
    use std::sync::atomic::Ordering;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (mut scrapes, mut bytes) = (0u64, 0u64);
    let mut every = tokio::time::interval(Duration::from_secs(1));
    while !stop.load(Ordering::Relaxed) {
        every.tick().await;
        let Ok(mut s) = tokio::net::TcpStream::connect(addr).await else {
            continue;
        };
        if s.write_all(b"GET /metrics HTTP/1.1\r\nHost: bench\r\n\r\n")
            .await
            .is_err()
        {
            continue;
        }
        let mut body = Vec::new();
        if s.read_to_end(&mut body).await.is_ok() && body.starts_with(b"HTTP/1.1 200") {
            scrapes += 1;
            bytes += body.len() as u64;
        }
    }
    (scrapes, bytes)
}

/// CPU time this process has used (user + system), from /proc/self/stat;
/// `None` where it cannot be read.
fn process_cpu_seconds() -> Option<f64> {
    crate::cpu::process("self").map(|c| c.total_s())
}

/// Runs the clients and returns (commits/s, CPU µs per commit).
async fn run_measured(c: &Cluster, clients: usize, dur: Duration) -> (f64, Option<f64>) {
    let cpu0 = process_cpu_seconds();
    let r = run_clients(c, clients, dur, false).await;
    let cpu = cpu0
        .zip(process_cpu_seconds())
        .filter(|_| r.commits > 0)
        .map(|(a, b)| (b - a) * 1e6 / r.commits as f64);
    (r.per_s, cpu)
}

/// What the metrics comparison measured.
struct MetricsComparison {
    off: Vec<f64>,
    on: Vec<f64>,
    cpu_off: Vec<f64>,
    cpu_on: Vec<f64>,
    scrapes: u64,
    scrape_bytes: u64,
    series: usize,
}

/// Runs one unmeasured warm-up run, then `rounds` pairs of runs at
/// `clients`, metrics off and on in alternating order (the recorder is installed once; off, every update is
/// a no-op), scraping every second while on.
async fn compare_metrics(
    cluster: &Cluster,
    clients: usize,
    dur: Duration,
    rounds: usize,
    pb: &indicatif::ProgressBar,
) -> anyhow::Result<MetricsComparison> {
    let server = weft::metrics::serve(([127, 0, 0, 1], 0).into()).await?;
    for n in &cluster.nodes {
        server.watch(n);
    }
    let mut cmp = MetricsComparison {
        off: Vec::new(),
        on: Vec::new(),
        cpu_off: Vec::new(),
        cpu_on: Vec::new(),
        scrapes: 0,
        scrape_bytes: 0,
        series: 0,
    };
    // One unmeasured run first: the first write run after the read-only
    // one was measured faster than every later run (the disk had been idle),
    // which always favoured the side that runs first (metrics off).
    pb.set_message(format!(
        "metrics comparison: {clients} clients, warm-up run (not counted)"
    ));
    weft::metrics::set_recording(false);
    let _ = run_clients(cluster, clients, dur, false).await;
    for round in 1..=rounds {
        // Odd rounds run metrics off first, even rounds on first (off, on,
        // on, off, ...): a cluster whose throughput drifts during the run
        // (its logs grow, the machine's load changes) then weighs on both
        // sides alike instead of always on the second.
        let order = if round % 2 == 1 {
            [false, true]
        } else {
            [true, false]
        };
        for on in order {
            if !on {
                pb.set_message(format!(
                    "metrics comparison, round {round}/{rounds}: {clients} clients, metrics off"
                ));
                weft::metrics::set_recording(false);
                let (tps, cpu) = run_measured(cluster, clients, dur).await;
                cmp.off.push(tps);
                cmp.cpu_off.extend(cpu);
                continue;
            }
            pb.set_message(format!(
                "metrics comparison, round {round}/{rounds}: {clients} clients, metrics on, scraped every second"
            ));
            weft::metrics::set_recording(true);
            let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
            let scraper = tokio::spawn(scrape_every_second(server.local_addr(), stop.clone()));
            let (tps, cpu) = run_measured(cluster, clients, dur).await;
            cmp.on.push(tps);
            cmp.cpu_on.extend(cpu);
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
            let (scrapes, bytes) = scraper.await.unwrap_or((0, 0));
            cmp.scrapes += scrapes;
            cmp.scrape_bytes += bytes;
        }
    }
    let body = weft::metrics::install()?.render();
    cmp.series = body
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .count();
    weft::metrics::set_recording(false);
    Ok(cmp)
}

/// What one run measured.
struct RunResult {
    commits: u64,
    per_s: f64,
    lat: Latency,
    forces_per_commit: f64,
    messages_per_commit: f64,
    errors: BTreeMap<String, u64>,
}

struct Cluster {
    nodes: Vec<Node>,
    _dir: tempfile::TempDir,
}

async fn start_cluster(
    n: u32,
    base: &std::path::Path,
    group_commit_delay: Option<Duration>,
) -> anyhow::Result<Cluster> {
    let dir = tempfile::Builder::new()
        .prefix(".weft-bench-commit-")
        .tempdir_in(base)?;
    let hub = InprocHub::new();
    let mut nodes = Vec::new();
    for id in 1..=n {
        let mut b = Node::builder(id)
            .hub(hub.clone())
            .data_dir(dir.path().join(format!("n{id}")))
            .checkpoint_every(None)
            .plugin(Arc::new(Kv::new(KvConfig::default())));
        if let Some(d) = group_commit_delay {
            b = b.log_config(move |c| c.group_commit_max_delay(d));
        }
        if id > 1 {
            b = b.join(Seed::Inproc(NodeId(1)));
        }
        nodes.push(b.start().await?);
    }
    Ok(Cluster { nodes, _dir: dir })
}

fn counters(nodes: &[Node]) -> (u64, u64) {
    let syncs = nodes.iter().map(|n| n.log().stats().syncs).sum();
    let msgs = nodes
        .iter()
        .map(|n| n.endpoint().stats().work_messages())
        .sum();
    (syncs, msgs)
}

async fn run_clients(c: &Cluster, clients: usize, dur: Duration, read_only: bool) -> RunResult {
    let n = c.nodes.len();
    let (s0, m0) = counters(&c.nodes);
    let stop = Instant::now() + dur;
    let errors = Arc::new(Mutex::new(BTreeMap::<String, u64>::new()));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for i in 0..clients {
        let coord = c.nodes[i % n].clone();
        let me = (i % n) as u32 + 1;
        let others: Vec<Address> = (1..=n as u32)
            .filter(|&x| x != me)
            .take(2)
            .map(|x| format!("kv@{x}").parse().expect("valid address"))
            .collect();
        let errors = errors.clone();
        tasks.push(tokio::spawn(async move {
            let key = Bytes::from(format!("client/{i}").into_bytes());
            let mut lat = Latency::default();
            let mut seq = 0u64;
            while Instant::now() < stop {
                seq += 1;
                let op = if read_only {
                    Op::Get(key.clone())
                } else {
                    Op::Put(key.clone(), Bytes::from(seq.to_le_bytes().to_vec()))
                };
                let t = Instant::now();
                let tx = coord.begin();
                let mut ok = true;
                for o in &others {
                    if let Err(f) = tx
                        .call::<_, KvResponse>(o, KvRequest(vec![op.clone()]))
                        .await
                    {
                        *errors.lock().entry(f.status.to_string()).or_default() += 1;
                        ok = false;
                        break;
                    }
                }
                let result = if ok {
                    tx.commit().await
                } else {
                    tx.abort("error").await
                };
                match result {
                    Ok(()) if ok => lat.record(t.elapsed()),
                    Ok(()) => {}
                    Err(f) => *errors.lock().entry(f.status.to_string()).or_default() += 1,
                }
            }
            lat
        }));
    }
    let mut lat = Latency::default();
    for t in tasks {
        if let Ok(l) = t.await {
            lat.merge(&l);
        }
    }
    let elapsed = started.elapsed().as_secs_f64();
    // Let phase two and lazy log writes of the last transactions settle.
    tokio::time::sleep(Duration::from_millis(50)).await;
    let (s1, m1) = counters(&c.nodes);
    let commits = lat.count();
    let errors_seen = errors.lock().clone();
    let per = |x: u64| {
        if commits == 0 {
            0.0
        } else {
            x as f64 / commits as f64
        }
    };
    RunResult {
        commits,
        per_s: commits as f64 / elapsed,
        lat,
        forces_per_commit: per(s1 - s0),
        messages_per_commit: per(m1 - m0),
        errors: errors_seen,
    }
}

/// Runs `weft bench commit`.
pub async fn run(args: CommitArgs) -> anyhow::Result<()> {
    anyhow::ensure!(args.nodes >= 3, "--nodes must be at least 3");
    let pb = progress(&format!("starting {} nodes", args.nodes));
    let cluster = start_cluster(args.nodes, &args.dir, args.group_commit_delay).await?;
    let mut report = serde_json::Map::new();
    let mut rows = Vec::new();
    for &c in &args.clients {
        pb.set_message(format!(
            "{c} clients, writing transactions, {:?}",
            args.duration
        ));
        let r = run_clients(&cluster, c, args.duration, false).await;
        report.insert(format!("commits_per_s_{c}"), json!(r2(r.per_s)));
        report.insert(format!("p50_us_{c}"), json!(r.lat.p50()));
        report.insert(format!("p99_us_{c}"), json!(r.lat.p99()));
        report.insert(
            format!("forces_per_commit_{c}"),
            json!(r2(r.forces_per_commit * 1000.0) / 1000.0),
        );
        report.insert(
            format!("messages_per_commit_{c}"),
            json!(r2(r.messages_per_commit)),
        );
        report.insert(format!("errors_{c}"), json!(r.errors));
        rows.push((format!("weft, {c} clients"), r));
    }
    let ro_clients = *args.clients.iter().max().unwrap_or(&16);
    pb.set_message(format!("{ro_clients} clients, read-only transactions"));
    let ro = run_clients(&cluster, ro_clients, args.duration, true).await;
    report.insert("readonly_clients".into(), json!(ro_clients));
    report.insert("readonly_commits_per_s".into(), json!(r2(ro.per_s)));
    report.insert("readonly_p50_us".into(), json!(ro.lat.p50()));
    report.insert(
        "readonly_forces_per_commit".into(),
        json!(ro.forces_per_commit),
    );
    report.insert(
        "readonly_messages_per_commit".into(),
        json!(r2(ro.messages_per_commit)),
    );
    rows.push((format!("weft read-only, {ro_clients} clients"), ro));
    let metrics_clients = *args.clients.iter().max().unwrap_or(&64);
    let metrics = if args.metrics_rounds > 0 {
        let m = compare_metrics(
            &cluster,
            metrics_clients,
            args.duration,
            args.metrics_rounds,
            &pb,
        )
        .await?;
        let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
        let (off, on) = (mean(&m.off), mean(&m.on));
        report.insert("metrics_clients".into(), json!(metrics_clients));
        report.insert("commit_tps".into(), json!(r2(off)));
        report.insert("commit_tps_metrics".into(), json!(r2(on)));
        report.insert(
            "commit_tps_rounds".into(),
            json!(m.off.iter().map(|x| r2(*x)).collect::<Vec<_>>()),
        );
        report.insert(
            "commit_tps_metrics_rounds".into(),
            json!(m.on.iter().map(|x| r2(*x)).collect::<Vec<_>>()),
        );
        report.insert(
            "ratio_commit_tps_metrics".into(),
            json!(r2(on / off.max(1e-9) * 100.0) / 100.0),
        );
        let (cpu_off, cpu_on) = (mean(&m.cpu_off), mean(&m.cpu_on));
        if cpu_off > 0.0 && cpu_on > 0.0 {
            report.insert("cpu_us_per_commit".into(), json!(r2(cpu_off)));
            report.insert("cpu_us_per_commit_metrics".into(), json!(r2(cpu_on)));
            report.insert(
                "ratio_cpu_per_commit_metrics".into(),
                json!(r2(cpu_on / cpu_off * 1000.0) / 1000.0),
            );
        }
        report.insert("metrics_scrapes".into(), json!(m.scrapes));
        report.insert("metrics_scrape_bytes".into(), json!(m.scrape_bytes));
        report.insert("metrics_series".into(), json!(m.series));
        Some((off, on, m))
    } else {
        None
    };
    for n in &cluster.nodes {
        n.shutdown().await;
    }
    drop(cluster);
    let mut pg = None;
    if args.pg {
        let pg_clients = *args.clients.iter().max().unwrap_or(&64);
        pb.set_message(format!("PostgreSQL 2PC, {pg_clients} connections"));
        let mut server = tokio::task::spawn_blocking(|| {
            weft_pg::TempPostgres::start(weft_pg::ServerOptions::default())
        })
        .await??;
        let r = weft_bench::pg2pc::run(&server, pg_clients, args.duration).await?;
        report.insert(format!("pg2pc_per_s_{pg_clients}"), json!(r2(r.tps)));
        report.insert(
            format!("pg2pc_p50_us_{pg_clients}"),
            json!(r.latency_p50_us),
        );
        report.insert(
            format!("pg2pc_p99_us_{pg_clients}"),
            json!(r.latency_p99_us),
        );
        pg = Some((pg_clients, r));
        tokio::task::spawn_blocking(move || server.stop()).await??;
    }
    pb.finish_and_clear();
    println!(
        "weft bench commit: {} nodes, each transaction writes one key on two other nodes, {:?} per run",
        args.nodes, args.duration
    );
    println!(
        "{:<32} {:>10} {:>9} {:>9} {:>13} {:>13}  errors",
        "configuration", "commits/s", "p50 µs", "p99 µs", "forces/commit", "msgs/commit"
    );
    for (name, r) in &rows {
        println!(
            "{:<32} {:>10.0} {:>9.0} {:>9.0} {:>13.3} {:>13.1}  {:?}",
            name,
            r.per_s,
            r.lat.p50(),
            r.lat.p99(),
            r.forces_per_commit,
            r.messages_per_commit,
            r.errors
        );
        let _ = r.commits;
    }
    if let Some((c, r)) = &pg {
        println!(
            "{:<32} {:>10.0} {:>9.0} {:>9.0} {:>13} {:>13}  {} errors",
            format!("PostgreSQL 2PC, {c} conns"),
            r.tps,
            r.latency_p50_us,
            r.latency_p99_us,
            "-",
            "-",
            r.errors
        );
    }
    if let Some((off, on, m)) = &metrics {
        println!(
            "{:<32} {:>10.0} (rounds {:?})",
            format!("metrics off, {metrics_clients} clients"),
            off,
            m.off.iter().map(|x| x.round()).collect::<Vec<_>>()
        );
        println!(
            "{:<32} {:>10.0} (rounds {:?}; {} scrapes, {} series, {} bytes)",
            format!("metrics on, {metrics_clients} clients"),
            on,
            m.on.iter().map(|x| x.round()).collect::<Vec<_>>(),
            m.scrapes,
            m.series,
            m.scrape_bytes
        );
        println!(
            "CPU µs per commit (whole process): metrics off {:?}, on {:?}",
            m.cpu_off.iter().map(|x| x.round()).collect::<Vec<_>>(),
            m.cpu_on.iter().map(|x| x.round()).collect::<Vec<_>>()
        );
    }
    println!("targets:");
    let mut met = serde_json::Map::new();
    if let Some((off, on, _)) = &metrics {
        met.insert(
            "commit_tps_metrics".into(),
            json!(check(
                "commit_tps_metrics / commit_tps",
                on / off.max(1e-9),
                ">=",
                0.98
            )),
        );
    }
    if let Some(r) = rows
        .iter()
        .find(|(n, _)| n == "weft, 64 clients")
        .map(|(_, r)| r)
    {
        met.insert(
            "forces_per_commit_64".into(),
            json!(check(
                "forces_per_commit_64",
                r.forces_per_commit,
                "<=",
                0.25
            )),
        );
        if let Some((_, p)) = &pg {
            let ratio = r.per_s / p.tps.max(1e-9);
            report.insert("ratio_commits_to_pg2pc_64".into(), json!(r2(ratio)));
            met.insert(
                "commits_vs_pg2pc".into(),
                json!(check("commits_per_s_64 / pg2pc_per_s_64", ratio, ">=", 3.0)),
            );
        }
    }
    let ro_ok = check(
        "readonly_forces_per_commit",
        report["readonly_forces_per_commit"].as_f64().unwrap_or(1.0),
        "==",
        0.0,
    );
    met.insert("readonly_forces".into(), json!(ro_ok));
    report.insert("targets_met".into(), serde_json::Value::Object(met));
    report.insert("nodes".into(), json!(args.nodes));
    report.insert("duration_s".into(), json!(args.duration.as_secs_f64()));
    if let Some(p) = &args.json {
        write_json(p, &serde_json::Value::Object(report))?;
    }
    Ok(())
}
