//! `weft bench debitcredit`: DebitCredit on Raid over weft at several site
//! counts, against PostgreSQL's own pgbench (TPC-B-like, same scale, same
//! clients, fsync on) measured in the same run.

use std::path::PathBuf;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

use serde_json::json;
use weft_raid::{ClusterOptions, Mode, RaidCluster, RunReport, Workload};

use super::{check, progress, r2, write_json};
use crate::client::parse_duration;

/// Flags of `weft bench debitcredit`.
#[derive(clap::Args, Debug)]
pub struct DebitCreditArgs {
    /// Site counts to measure (every relation replicated on every site).
    #[arg(long, value_delimiter = ',', default_value = "1,3,5")]
    pub sites: Vec<u32>,
    /// Concurrent clients.
    #[arg(long, default_value_t = 8)]
    pub clients: usize,
    /// Which DebitCredit.
    #[arg(long, default_value = "tpcb")]
    pub mode: Mode,
    /// tpcb scale.
    #[arg(long, default_value_t = 1)]
    pub scale: u32,
    /// How long each run lasts.
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    pub duration: Duration,
    /// Also run PostgreSQL's pgbench (starts a temporary server).
    #[arg(long)]
    pub pgbench: bool,
    /// Where data directories go (temporary, removed).
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// Write the results as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Draw a bar chart of tps per configuration to this PNG file.
    #[arg(long)]
    pub plot: Option<PathBuf>,
}

struct SiteRun {
    sites: u32,
    report: RunReport,
    messages: f64,
    forces: f64,
    audit_ok: bool,
}

async fn run_sites(args: &DebitCreditArgs, sites: u32) -> anyhow::Result<SiteRun> {
    let base = args.dir.clone().unwrap_or_else(std::env::temp_dir);
    let pb = progress(&format!("{sites} site(s): starting and loading"));
    let cluster = RaidCluster::start(sites, &base, ClusterOptions::default()).await?;
    let sizes = Workload::sizes(args.mode, args.scale);
    cluster.load(sizes).await?;
    pb.set_message(format!(
        "{sites} site(s): {} clients for {:?}",
        args.clients, args.duration
    ));
    let runners: Vec<_> = cluster
        .ads()?
        .into_iter()
        .map(|ad| {
            move |req| {
                let ad = ad.clone();
                async move { ad.run(req).await }
            }
        })
        .collect();
    let before = cluster.counters();
    let report = weft_raid::run_closed(
        runners,
        Workload {
            mode: args.mode,
            sizes,
        },
        args.clients,
        args.duration,
        1,
        Arc::new(AtomicU64::new(0)),
    )
    .await;
    let settled = cluster.quiesce(Duration::from_secs(30)).await;
    let after = cluster.counters();
    let per = |x: u64| {
        if report.committed == 0 {
            0.0
        } else {
            x as f64 / report.committed as f64
        }
    };
    let audit_ok = settled && cluster.audit().passed();
    cluster.shutdown().await;
    pb.finish_and_clear();
    Ok(SiteRun {
        sites,
        messages: per(after.messages - before.messages),
        forces: per(after.forces - before.forces),
        report,
        audit_ok,
    })
}

/// Runs `weft bench debitcredit`.
pub async fn run(args: DebitCreditArgs) -> anyhow::Result<()> {
    let mut runs = Vec::new();
    for &s in &args.sites {
        runs.push(run_sites(&args, s).await?);
    }
    let mut pg = None;
    if args.pgbench {
        anyhow::ensure!(
            args.mode == Mode::Tpcb,
            "pgbench runs the tpcb transaction: use --mode tpcb"
        );
        let pb = progress(&format!(
            "pgbench, scale {}, {} clients",
            args.scale, args.clients
        ));
        let mut server = tokio::task::spawn_blocking(|| {
            weft_pg::TempPostgres::start(weft_pg::ServerOptions::default())
        })
        .await??;
        let r = weft_bench::pgbench::run(&server, args.scale, args.clients as u32, args.duration)
            .await?;
        tokio::task::spawn_blocking(move || server.stop()).await??;
        pb.finish_and_clear();
        pg = Some(r);
    }
    println!(
        "weft bench debitcredit: {} mode, scale {}, {} clients, {:?} per run, every relation on every site",
        args.mode, args.scale, args.clients, args.duration
    );
    println!(
        "{:<22} {:>9} {:>9} {:>9} {:>11} {:>11} {:>7}  aborts",
        "configuration", "tps", "p50 ms", "p99 ms", "msgs/txn", "forces/txn", "audit"
    );
    let mut report = serde_json::Map::new();
    let mut bars = Vec::new();
    for r in &runs {
        println!(
            "{:<22} {:>9.0} {:>9.2} {:>9.2} {:>11.1} {:>11.3} {:>7}  {:?}",
            format!("weft, {} site(s)", r.sites),
            r.report.tps,
            r.report.p50_us / 1000.0,
            r.report.p99_us / 1000.0,
            r.messages,
            r.forces,
            if r.audit_ok { "ok" } else { "FAILED" },
            r.report.aborts
        );
        let s = r.sites;
        report.insert(format!("weft_tps_sites_{s}"), json!(r2(r.report.tps)));
        report.insert(
            format!("p50_ms_sites_{s}"),
            json!(r2(r.report.p50_us / 1000.0)),
        );
        report.insert(
            format!("p99_ms_sites_{s}"),
            json!(r2(r.report.p99_us / 1000.0)),
        );
        report.insert(format!("messages_per_txn_sites_{s}"), json!(r2(r.messages)));
        report.insert(
            format!("forces_per_txn_sites_{s}"),
            json!(r2(r.forces * 1000.0) / 1000.0),
        );
        report.insert(format!("aborts_sites_{s}"), json!(r.report.aborts));
        report.insert(format!("audit_sites_{s}"), json!(r.audit_ok));
        bars.push((
            format!("weft {s} site{}", if s == 1 { "" } else { "s" }),
            r.report.tps,
        ));
    }
    if let Some(p) = &pg {
        println!(
            "{:<22} {:>9.0} {:>9.2} {:>9} {:>11} {:>11} {:>7}  {} failed",
            "pgbench (PostgreSQL)",
            p.tps,
            p.latency_avg_ms,
            "-",
            "-",
            "-",
            "-",
            p.failed_transactions.unwrap_or(0)
        );
        report.insert("pgbench_tps".into(), json!(r2(p.tps)));
        report.insert("pgbench_latency_avg_ms".into(), json!(p.latency_avg_ms));
        bars.push(("pgbench".to_string(), p.tps));
    }
    println!("targets:");
    let mut met = serde_json::Map::new();
    if let Some(p) = &pg {
        if let Some(r) = runs.iter().find(|r| r.sites == 1) {
            met.insert(
                "sites_1".into(),
                json!(check(
                    "weft_tps_sites_1 / pgbench_tps",
                    r.report.tps / p.tps,
                    ">=",
                    2.0
                )),
            );
        }
        if let Some(r) = runs.iter().find(|r| r.sites == 3) {
            met.insert(
                "sites_3".into(),
                json!(check(
                    "weft_tps_sites_3 / pgbench_tps",
                    r.report.tps / p.tps,
                    ">=",
                    1.0
                )),
            );
        }
    }
    if let Some(r) = runs.iter().find(|r| r.sites == 1) {
        println!(
            "  (messages per single-site transaction: {:.1}; Raid V1 needed 168)",
            r.messages
        );
    }
    report.insert("targets_met".into(), serde_json::Value::Object(met));
    report.insert("mode".into(), json!(args.mode.to_string()));
    report.insert("scale".into(), json!(args.scale));
    report.insert("clients".into(), json!(args.clients));
    report.insert("duration_s".into(), json!(args.duration.as_secs_f64()));
    if let Some(path) = &args.json {
        write_json(path, &serde_json::Value::Object(report))?;
    }
    if let Some(path) = &args.plot {
        super::plot::bar_chart(
            path,
            &format!(
                "DebitCredit ({}) throughput, {} clients",
                args.mode, args.clients
            ),
            "committed transactions per second",
            &bars,
        )?;
        eprintln!("wrote {}", path.display());
    }
    anyhow::ensure!(runs.iter().all(|r| r.audit_ok), "an audit failed");
    Ok(())
}
