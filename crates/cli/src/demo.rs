//! `weft demo`: the main job. Starts a Raid cluster (3 sites, every relation
//! replicated on every site), loads the DebitCredit database, runs clients
//! with a live progress bar, prints the results and audits every copy.
//!
//! Owns the demo's choreography. Must need nothing set up by hand, and must
//! exit non-zero when the audit fails.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};
use weft_raid::{ClusterOptions, Mode, RaidCluster, Workload};

use crate::child::ChildNode;
use crate::client::{parse_duration, Client, ClientOpts};
use crate::raid_cmd::{
    audit_cluster, cluster_counters, load_cluster, print_audit, print_results, run_remote,
};

/// Flags of `weft demo`.
#[derive(clap::Args, Debug)]
pub struct DemoArgs {
    /// Sites (weft nodes), each holding a copy of every relation.
    #[arg(long, default_value_t = 3)]
    pub sites: u32,
    /// Concurrent clients.
    #[arg(long, default_value_t = 8)]
    pub clients: usize,
    /// How long the clients run.
    #[arg(long, default_value = "20s", value_parser = parse_duration)]
    pub duration: Duration,
    /// Which DebitCredit: tpcb (pgbench's) or raid (the paper's).
    #[arg(long, default_value = "tpcb")]
    pub mode: Mode,
    /// tpcb scale.
    #[arg(long, default_value_t = 1)]
    pub scale: u32,
    /// Run each site as a real child process instead of in this process.
    #[arg(long)]
    pub processes: bool,
    /// Where the sites keep their data (a temporary directory is made under
    /// it and removed).
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// Random seed of the clients.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
}

fn live_bar(duration: Duration) -> ProgressBar {
    let pb = ProgressBar::new(duration.as_millis() as u64);
    pb.set_style(
        ProgressStyle::with_template("{spinner} [{bar:30}] {elapsed_precise} {msg}")
            .expect("valid template")
            .progress_chars("=> "),
    );
    pb
}

/// Updates the bar with the commit rate over the last second until aborted.
fn spawn_ticker(pb: ProgressBar, progress: Arc<AtomicU64>) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let start = Instant::now();
        let mut window: std::collections::VecDeque<(Instant, u64)> = Default::default();
        loop {
            tokio::time::sleep(Duration::from_millis(200)).await;
            let now = Instant::now();
            let n = progress.load(Ordering::Relaxed);
            window.push_back((now, n));
            while window.len() > 6 {
                window.pop_front();
            }
            let (t0, n0) = window.front().copied().unwrap_or((start, 0));
            let dt = now.duration_since(t0).as_secs_f64();
            let live = if dt > 0.0 { (n - n0) as f64 / dt } else { 0.0 };
            pb.set_position(start.elapsed().as_millis() as u64);
            pb.set_message(format!("{n} committed, {live:.0} tps now"));
        }
    })
}

/// Runs `weft demo`.
pub async fn run(args: DemoArgs) -> anyhow::Result<()> {
    anyhow::ensure!(args.sites >= 1, "--sites must be at least 1");
    println!(
        "weft demo: Raid on weft, {} site(s) {}, every relation replicated on every site",
        args.sites,
        if args.processes {
            "as child processes"
        } else {
            "in this process"
        }
    );
    println!(
        "DebitCredit {} (scale {}), {} clients for {:?}; data on disk, fsync on",
        args.mode, args.scale, args.clients, args.duration
    );
    let base = args.dir.clone().unwrap_or_else(std::env::temp_dir);
    if args.processes {
        run_processes(&args, &base).await
    } else {
        run_in_process(&args, &base).await
    }
}

async fn run_in_process(args: &DemoArgs, base: &std::path::Path) -> anyhow::Result<()> {
    let spinner = crate::bench::progress("starting sites");
    let cluster = RaidCluster::start(args.sites, base, ClusterOptions::default()).await?;
    spinner.set_message("loading the database on every site");
    let sizes = Workload::sizes(args.mode, args.scale);
    cluster.load(sizes).await?;
    spinner.finish_and_clear();
    let ads = cluster.ads()?;
    let runners: Vec<_> = ads
        .into_iter()
        .map(|ad| {
            move |req| {
                let ad = ad.clone();
                async move { ad.run(req).await }
            }
        })
        .collect();
    let before = cluster.counters();
    let progress = Arc::new(AtomicU64::new(0));
    let pb = live_bar(args.duration);
    let ticker = spawn_ticker(pb.clone(), progress.clone());
    let report = weft_raid::run_closed(
        runners,
        Workload {
            mode: args.mode,
            sizes,
        },
        args.clients,
        args.duration,
        args.seed,
        progress,
    )
    .await;
    ticker.abort();
    pb.finish_and_clear();
    let settled = cluster.quiesce(Duration::from_secs(30)).await;
    let after = cluster.counters();
    let per = |x: u64| {
        if report.committed == 0 {
            0.0
        } else {
            x as f64 / report.committed as f64
        }
    };
    print_results(
        &report,
        args.sites as usize,
        Some(per(after.messages - before.messages)),
        Some(per(after.forces - before.forces)),
    );
    let audit = cluster.audit();
    let ok = print_audit(&audit) && settled;
    if !settled {
        println!("some transactions were still unfinished after 30 s");
    }
    cluster.shutdown().await;
    anyhow::ensure!(ok, "the audit failed");
    Ok(())
}

/// Starts `weft raid site` number `id` with its data under `dir`.
fn spawn_site(id: u32, dir: &std::path::Path, join: Option<&str>) -> anyhow::Result<ChildNode> {
    let mut args: Vec<String> = [
        "raid",
        "site",
        "--id",
        &id.to_string(),
        "--listen",
        "127.0.0.1:0",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    args.push("--data-dir".into());
    args.push(dir.join(format!("site{id}")).display().to_string());
    if let Some(j) = join {
        args.push("--join".into());
        args.push(j.to_string());
    }
    ChildNode::start(&format!("site {id}"), &args)
}

/// CPU time per committed transaction of each site process and of the
/// clients (this process), with the share of the transport threads, as Raid
/// reported it (seed 000, section 2.2: 267 ms of system time per
/// transaction, over 92% of it communication).
fn print_cpu(sites: &[crate::cpu::CpuSample], client: &crate::cpu::CpuSample, committed: u64) {
    if committed == 0 {
        return;
    }
    let per = |s: f64| s * 1e6 / committed as f64;
    println!("CPU per committed transaction (µs; Raid V1: 267,000 µs of system time, >92% communication):");
    println!(
        "  {:<10} {:>9} {:>9} {:>10}  by thread group (user+system µs)",
        "process", "user", "system", "transport"
    );
    let row = |name: String, s: &crate::cpu::CpuSample| {
        let total = s.total();
        let groups: Vec<String> = s
            .by_group
            .iter()
            .filter(|(_, c)| c.total_s() > 0.0)
            .map(|(g, c)| format!("{g} {:.0}", per(c.total_s())))
            .collect();
        println!(
            "  {:<10} {:>9.0} {:>9.0} {:>9.0}%  {}",
            name,
            per(total.user_s),
            per(total.system_s),
            s.transport_share() * 100.0,
            groups.join(", ")
        );
    };
    for (i, s) in sites.iter().enumerate() {
        row(format!("site {}", i + 1), s);
    }
    row("clients".into(), client);
    println!(
        "  (transport: the shm links' reader threads; TCP frames are read and written by the runtime workers)"
    );
}

async fn run_processes(args: &DemoArgs, base: &std::path::Path) -> anyhow::Result<()> {
    let dir = tempfile::Builder::new()
        .prefix(".weft-demo-")
        .tempdir_in(base)?;
    let spinner = crate::bench::progress("starting site processes");
    let mut procs = vec![spawn_site(1, dir.path(), None)?];
    let first = procs[0].addr.clone();
    for id in 2..=args.sites {
        procs.push(spawn_site(id, dir.path(), Some(&first))?);
    }
    let opts = ClientOpts {
        node: first,
        secret: String::new(),
        timeout: Duration::from_secs(60),
        tls: Default::default(),
    };
    // Wait until the directory sees every site.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let c = Client::connect(&opts).await?;
        let n = audit_cluster(&c).await.map(|a| a.sites.len()).unwrap_or(0);
        c.close().await;
        if n == args.sites as usize {
            break;
        }
        anyhow::ensure!(Instant::now() < deadline, "the sites did not all join");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    spinner.set_message("loading the database on every site");
    let c = Client::connect(&opts).await?;
    load_cluster(&c, args.mode, args.scale).await?;
    c.close().await;
    spinner.finish_and_clear();
    let (m0, f0) = cluster_counters(&opts).await?;
    let cpu_before: Vec<_> = procs
        .iter()
        .map(|p| crate::cpu::sample(&p.id().to_string()))
        .collect();
    let client_before = crate::cpu::sample("self");
    let progress = Arc::new(AtomicU64::new(0));
    let pb = live_bar(args.duration);
    let ticker = spawn_ticker(pb.clone(), progress.clone());
    let report = run_remote(
        &opts,
        args.mode,
        args.scale,
        args.clients,
        args.duration,
        args.seed,
        progress,
        None,
    )
    .await?;
    ticker.abort();
    pb.finish_and_clear();
    let cpu_spent: Vec<_> = procs
        .iter()
        .zip(&cpu_before)
        .map(|(p, before)| crate::cpu::sample(&p.id().to_string()).since(before))
        .collect();
    let client_spent = crate::cpu::sample("self").since(&client_before);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (m1, f1) = cluster_counters(&opts).await?;
    let per = |x: u64| {
        if report.committed == 0 {
            0.0
        } else {
            x as f64 / report.committed as f64
        }
    };
    print_results(
        &report,
        args.sites as usize,
        Some(per(m1 - m0)),
        Some(per(f1 - f0)),
    );
    print_cpu(&cpu_spent, &client_spent, report.committed);
    let c = Client::connect(&opts).await?;
    let audit = audit_cluster(&c).await?;
    c.close().await;
    let ok = print_audit(&audit);
    drop(procs);
    anyhow::ensure!(ok, "the audit failed");
    Ok(())
}
