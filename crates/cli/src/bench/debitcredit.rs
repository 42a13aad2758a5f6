//! `weft bench debitcredit`: DebitCredit on Raid over weft at several site
//! counts, against PostgreSQL measured in the same run (TPC-B, same scale,
//! same clients, fsync on): pgbench's stock script (`--pgbench`), the same
//! transaction as one PL/pgSQL call (`--pg-function`), and that call on a
//! primary with N synchronous standbys (`--pg-sync-standbys N`), the
//! strongest PostgreSQL set-ups to set beside one and N+1 weft sites.

use std::path::PathBuf;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

use serde_json::json;
use weft_raid::{ClusterOptions, Mode, RaidCluster, RunReport, Workload};

use super::{check, progress, r2, write_json};
use crate::client::parse_duration;

/// Flags of `weft bench debitcredit`.
#[derive(clap::Args, Debug, Clone)]
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
    /// tpcb scale (100 000 accounts a unit; 100 is ten million accounts
    /// per copy).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub scale: u32,
    /// KV engines to measure, alternated in each round (`disk`, `memory`,
    /// or both: `disk,memory`); the first one's figures are the report's
    /// main keys, and each other one's ratio against it is printed too.
    #[arg(long, value_delimiter = ',', default_value = "disk", value_parser = ["disk", "memory"])]
    pub kv_engine: Vec<String>,
    /// Page cache of each site's disk engine, in MiB.
    #[arg(long, default_value_t = 64)]
    pub kv_cache_mib: usize,
    /// How long each run lasts.
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    pub duration: Duration,
    /// Rounds of runs: each round runs every site count and pgbench, in
    /// alternating order, and the figures are their means, so that the
    /// disk's drift during the bench weighs on weft and pgbench alike.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..=20))]
    pub rounds: u32,
    /// Also run PostgreSQL's pgbench with its stock TPC-B script, seven
    /// round trips a transaction (starts a temporary server).
    #[arg(long)]
    pub pgbench: bool,
    /// Also run the TPC-B transaction as one PL/pgSQL function call per
    /// transaction, driven by pgbench (JSON `pgfn_tps`).
    #[arg(long)]
    pub pg_function: bool,
    /// Also run the function on a primary with this many synchronous
    /// standbys (all on this machine, started in temporary directories;
    /// JSON `pgfn_sync<N>_tps`), the PostgreSQL answer to N+1 weft sites.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=8))]
    pub pg_sync_standbys: u32,
    /// Where data directories go (temporary, removed).
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// Keep each configuration's data in `<DIR>/<sites>s-<engine>-scale<S>`
    /// instead of a temporary directory, and reuse it: a copy found loaded
    /// is not loaded again (a load at scale 100 takes minutes). Later runs
    /// start from the balances and history the earlier ones left.
    #[arg(long)]
    pub keep_data: Option<PathBuf>,
    /// Write the results as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Draw a bar chart of tps per configuration to this PNG file (with
    /// --sweep: tps and p99 against clients).
    #[arg(long)]
    pub plot: Option<PathBuf>,
    /// The scale curves instead: clients 1, 8, 32, 64 × sites 1, 3, 5 ×
    /// scale 1 and 10 (ignoring --sites, --clients, --scale and --rounds),
    /// with the PostgreSQL baselines asked for at the same client counts.
    #[arg(long)]
    pub sweep: bool,
    /// Client counts of --sweep.
    #[arg(long, value_delimiter = ',', default_value = "1,8,32,64")]
    pub sweep_clients: Vec<usize>,
    /// Site counts of --sweep.
    #[arg(long, value_delimiter = ',', default_value = "1,3,5")]
    pub sweep_sites: Vec<u32>,
    /// Scales of --sweep.
    #[arg(long, value_delimiter = ',', default_value = "1,10")]
    pub sweep_scales: Vec<u32>,
}

pub(super) struct SiteRun {
    pub(super) report: RunReport,
    messages: f64,
    forces: f64,
    pub(super) audit_ok: bool,
}

/// The rounds of one configuration: the means of their figures.
#[derive(Default)]
pub(super) struct Rounds {
    tps: Vec<f64>,
    p50_ms: Vec<f64>,
    p99_ms: Vec<f64>,
    messages: Vec<f64>,
    forces: Vec<f64>,
    aborts: std::collections::BTreeMap<String, u64>,
    audit_ok: bool,
    failed: u64,
}

impl Rounds {
    pub(super) fn add_site(&mut self, r: &SiteRun) {
        if self.tps.is_empty() {
            self.audit_ok = true;
        }
        self.tps.push(r.report.tps);
        self.p50_ms.push(r.report.p50_us / 1000.0);
        self.p99_ms.push(r.report.p99_us / 1000.0);
        self.messages.push(r.messages);
        self.forces.push(r.forces);
        for (k, v) in &r.report.aborts {
            *self.aborts.entry(k.clone()).or_default() += v;
        }
        self.audit_ok &= r.audit_ok;
    }

    fn add_pgbench(&mut self, r: &weft_bench::pgbench::PgbenchReport) {
        self.tps.push(r.tps);
        self.p50_ms.push(r.latency_avg_ms);
        self.failed += r.failed_transactions.unwrap_or(0);
    }

    pub(super) fn tps(&self) -> f64 {
        mean(&self.tps)
    }
}

fn mean(v: &[f64]) -> f64 {
    if v.is_empty() {
        0.0
    } else {
        v.iter().sum::<f64>() / v.len() as f64
    }
}

pub(super) async fn run_sites(
    args: &DebitCreditArgs,
    sites: u32,
    engine: &str,
) -> anyhow::Result<SiteRun> {
    let base = args.dir.clone().unwrap_or_else(std::env::temp_dir);
    let pb = progress(&format!(
        "{sites} site(s), {engine} engine: starting and loading"
    ));
    let mut opts = ClusterOptions::default();
    opts.site.kv_engine = crate::node_cmd::kv_engine(engine, args.kv_cache_mib);
    let cluster = match &args.keep_data {
        Some(keep) => {
            let dir = keep.join(format!("{sites}s-{engine}-scale{}", args.scale));
            RaidCluster::start_in(sites, &dir, opts).await?
        }
        None => RaidCluster::start(sites, &base, opts).await?,
    };
    let sizes = Workload::sizes(args.mode, args.scale);
    let loading = std::time::Instant::now();
    cluster.load(sizes).await?;
    // One line a run, terminal or not: a load at scale 100 takes minutes.
    eprintln!(
        "{sites} site(s), {engine} engine, scale {}: loaded in {:.1} s",
        args.scale,
        loading.elapsed().as_secs_f64()
    );
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
        messages: per(after.messages - before.messages),
        forces: per(after.forces - before.forces),
        report,
        audit_ok,
    })
}

/// One PostgreSQL configuration measured beside weft.
#[derive(Clone, Debug)]
pub(super) struct PgBaseline {
    /// Prefix of its JSON keys (`pgbench`, `pgfn`, `pgfn_sync2`).
    pub(super) key: String,
    /// Its row in the table and bar in the plot.
    pub(super) label: String,
    pub(super) script: weft_bench::pgbench::Script,
    /// Synchronous standbys of the server it runs on (0: the plain server).
    standbys: u32,
}

/// The PostgreSQL configurations the flags ask for, in the order they run.
fn pg_baselines(args: &DebitCreditArgs) -> Vec<PgBaseline> {
    use weft_bench::pgbench::Script;
    let mut out = Vec::new();
    if args.pgbench {
        out.push(PgBaseline {
            key: "pgbench".into(),
            label: "pgbench (PostgreSQL)".into(),
            script: Script::Stock,
            standbys: 0,
        });
    }
    if args.pg_function {
        out.push(PgBaseline {
            key: "pgfn".into(),
            label: "PG function".into(),
            script: Script::Function,
            standbys: 0,
        });
    }
    if args.pg_sync_standbys > 0 {
        let n = args.pg_sync_standbys;
        out.push(PgBaseline {
            key: format!("pgfn_sync{n}"),
            label: format!("PG function, {n} sync"),
            script: Script::Function,
            standbys: n,
        });
    }
    out
}

/// The temporary PostgreSQL servers of a run: a plain one, and a primary
/// with its synchronous standbys.
#[derive(Default)]
pub(super) struct PgServers {
    plain: Option<weft_pg::TempPostgres>,
    primary: Option<weft_pg::TempPostgres>,
    standbys: Vec<weft_pg::TempPostgres>,
}

impl PgServers {
    /// Starts what `baselines` need.
    async fn start(baselines: &[PgBaseline]) -> anyhow::Result<PgServers> {
        let mut servers = PgServers::default();
        if baselines.iter().any(|b| b.standbys == 0) {
            let pb = progress("starting PostgreSQL");
            servers.plain = Some(
                tokio::task::spawn_blocking(|| {
                    weft_pg::TempPostgres::start(weft_pg::ServerOptions::default())
                })
                .await??,
            );
            pb.finish_and_clear();
        }
        if let Some(n) = baselines
            .iter()
            .map(|b| b.standbys)
            .max()
            .filter(|&n| n > 0)
        {
            let pb = progress(&format!(
                "starting PostgreSQL with {n} synchronous standbys"
            ));
            let primary = tokio::task::spawn_blocking(|| {
                weft_pg::TempPostgres::start(weft_pg::ServerOptions::default())
            })
            .await??;
            let names: Vec<String> = (1..=n).map(|i| format!("standby{i}")).collect();
            let primary = std::sync::Arc::new(primary);
            for name in &names {
                let (p, name) = (Arc::clone(&primary), name.clone());
                let standby = tokio::task::spawn_blocking(move || {
                    weft_pg::TempPostgres::start_standby(
                        &p,
                        &name,
                        weft_pg::ServerOptions::default(),
                    )
                })
                .await??;
                servers.standbys.push(standby);
            }
            let primary = Arc::into_inner(primary).expect("the standbys are started");
            let refs: Vec<&str> = names.iter().map(String::as_str).collect();
            primary.make_standbys_synchronous(&refs).await?;
            servers.primary = Some(primary);
            pb.finish_and_clear();
        }
        Ok(servers)
    }

    pub(super) fn for_baseline(&self, b: &PgBaseline) -> &weft_pg::TempPostgres {
        let server = if b.standbys == 0 {
            self.plain.as_ref()
        } else {
            self.primary.as_ref()
        };
        server.expect("started for every baseline")
    }

    /// Stops every server: the primary before its standbys, so that no commit
    /// is left waiting for a standby that is gone.
    async fn stop(self) -> anyhow::Result<()> {
        let mut servers: Vec<_> = self.plain.into_iter().chain(self.primary).collect();
        servers.extend(self.standbys);
        tokio::task::spawn_blocking(move || {
            servers.iter_mut().try_for_each(weft_pg::TempPostgres::stop)
        })
        .await??;
        Ok(())
    }
}

/// Runs `weft bench debitcredit`.
pub async fn run(args: DebitCreditArgs) -> anyhow::Result<()> {
    let baselines = pg_baselines(&args);
    anyhow::ensure!(
        baselines.is_empty() || args.mode == Mode::Tpcb,
        "the PostgreSQL baselines run the tpcb transaction: use --mode tpcb"
    );
    let servers = PgServers::start(&baselines).await?;
    if args.sweep {
        let swept = super::dc_sweep::run(&args, &servers, &baselines).await;
        servers.stop().await?;
        return swept;
    }
    let measured = measure_rounds(&args, &servers, &baselines).await;
    servers.stop().await?;
    let (mut runs, pg) = measured?;
    let main = runs.remove(0).1;
    report_engines(&args, &main, &runs);
    report(&args, &main, &pg, &runs)
}

/// Prints each further engine's figures and its ratio against the first.
fn report_engines(
    args: &DebitCreditArgs,
    main: &[(u32, Rounds)],
    others: &[(String, Vec<(u32, Rounds)>)],
) {
    if others.is_empty() {
        return;
    }
    let first = &args.kv_engine[0];
    for (engine, runs) in others {
        for (s, r) in runs {
            let base = main.iter().find(|(m, _)| m == s).map(|(_, r)| r.tps());
            println!(
                "weft, {s} site(s), {engine} engine: {:.0} tps (audit {}); {first} / {engine}: {:.3}",
                r.tps(),
                if r.audit_ok { "ok" } else { "FAILED" },
                base.map_or(0.0, |b| b / r.tps().max(1e-9)),
            );
        }
    }
}

/// Runs of every configuration, by engine (in `--kv-engine` order).
type EngineRuns = Vec<(String, Vec<(u32, Rounds)>)>;

/// Every round: each site count and each PostgreSQL baseline, weft first in
/// odd rounds and PostgreSQL first in even ones.
async fn measure_rounds(
    args: &DebitCreditArgs,
    servers: &PgServers,
    baselines: &[PgBaseline],
) -> anyhow::Result<(EngineRuns, Vec<(PgBaseline, Rounds)>)> {
    let mut runs: EngineRuns = args
        .kv_engine
        .iter()
        .map(|e| {
            (
                e.clone(),
                args.sites.iter().map(|&s| (s, Rounds::default())).collect(),
            )
        })
        .collect();
    let mut pg: Vec<(PgBaseline, Rounds)> = baselines
        .iter()
        .map(|b| (b.clone(), Rounds::default()))
        .collect();
    for round in 0..args.rounds {
        let pg_first = round % 2 == 1;
        for step in 0..2 {
            if (step == 0) == pg_first {
                for (baseline, rounds) in &mut pg {
                    let pb = progress(&format!(
                        "round {}/{}: {}, scale {}, {} clients",
                        round + 1,
                        args.rounds,
                        baseline.label,
                        args.scale,
                        args.clients
                    ));
                    let options = weft_bench::pgbench::PgbenchOptions::new(
                        args.scale,
                        args.clients as u32,
                        args.duration,
                    )
                    .script(baseline.script);
                    let r = weft_bench::pgbench::run_with(servers.for_baseline(baseline), &options)
                        .await?;
                    pb.finish_and_clear();
                    rounds.add_pgbench(&r);
                }
            } else {
                // Engines alternate too: the first one first in odd rounds.
                let n = runs.len();
                for i in 0..args.sites.len() {
                    for j in 0..n {
                        let e = if round % 2 == 0 { j } else { n - 1 - j };
                        let (engine, per_site) = &mut runs[e];
                        let (s, rounds) = &mut per_site[i];
                        rounds.add_site(&run_sites(args, *s, engine).await?);
                    }
                }
            }
        }
    }
    Ok((runs, pg))
}

/// Prints the table and the targets, writes the JSON and the plot.
fn report(
    args: &DebitCreditArgs,
    runs: &[(u32, Rounds)],
    pg: &[(PgBaseline, Rounds)],
    others: &[(String, Vec<(u32, Rounds)>)],
) -> anyhow::Result<()> {
    println!(
        "weft bench debitcredit: {} mode, scale {}, {} clients, {:?} per run, {} round(s), every relation on every site",
        args.mode, args.scale, args.clients, args.duration, args.rounds
    );
    println!(
        "{:<22} {:>9} {:>9} {:>9} {:>11} {:>11} {:>7}  aborts",
        "configuration", "tps", "p50 ms", "p99 ms", "msgs/txn", "forces/txn", "audit"
    );
    let mut report = serde_json::Map::new();
    let mut bars = Vec::new();
    let rounded = |v: &[f64]| v.iter().map(|x| r2(*x)).collect::<Vec<_>>();
    for (s, r) in runs {
        let s = *s;
        println!(
            "{:<22} {:>9.0} {:>9.2} {:>9.2} {:>11.1} {:>11.3} {:>7}  {:?}",
            format!("weft, {s} site(s)"),
            r.tps(),
            mean(&r.p50_ms),
            mean(&r.p99_ms),
            mean(&r.messages),
            mean(&r.forces),
            if r.audit_ok { "ok" } else { "FAILED" },
            r.aborts
        );
        report.insert(format!("weft_tps_sites_{s}"), json!(r2(r.tps())));
        report.insert(format!("weft_tps_sites_{s}_rounds"), json!(rounded(&r.tps)));
        report.insert(format!("p50_ms_sites_{s}"), json!(r2(mean(&r.p50_ms))));
        report.insert(format!("p99_ms_sites_{s}"), json!(r2(mean(&r.p99_ms))));
        report.insert(
            format!("messages_per_txn_sites_{s}"),
            json!(r2(mean(&r.messages))),
        );
        report.insert(
            format!("forces_per_txn_sites_{s}"),
            json!(r2(mean(&r.forces) * 1000.0) / 1000.0),
        );
        report.insert(format!("aborts_sites_{s}"), json!(r.aborts));
        report.insert(format!("audit_sites_{s}"), json!(r.audit_ok));
        bars.push((
            format!("weft {s} site{}", if s == 1 { "" } else { "s" }),
            r.tps(),
        ));
    }
    for (b, p) in pg {
        println!(
            "{:<22} {:>9.0} {:>9.2} {:>9} {:>11} {:>11} {:>7}  {} failed",
            b.label,
            p.tps(),
            mean(&p.p50_ms),
            "-",
            "-",
            "-",
            "-",
            p.failed
        );
        let key = &b.key;
        report.insert(format!("{key}_tps"), json!(r2(p.tps())));
        report.insert(format!("{key}_tps_rounds"), json!(rounded(&p.tps)));
        report.insert(format!("{key}_latency_avg_ms"), json!(r2(mean(&p.p50_ms))));
        bars.push((b.label.replace(" (PostgreSQL)", ""), p.tps()));
    }
    if !pg.is_empty() {
        println!("  (PostgreSQL's p50 column is pgbench's mean latency)");
    }
    if args.rounds > 1 {
        for (s, r) in runs {
            let per_round: Vec<String> = r.tps.iter().map(|t| format!("{t:.0}")).collect();
            println!(
                "  weft {s} site(s), tps per round: {}",
                per_round.join(", ")
            );
        }
        for (b, p) in pg {
            let per_round: Vec<String> = p.tps.iter().map(|t| format!("{t:.0}")).collect();
            println!("  {}, tps per round: {}", b.label, per_round.join(", "));
        }
    }
    println!("targets (means over the rounds):");
    let mut met = serde_json::Map::new();
    let find = |n: u32| runs.iter().find(|(s, _)| *s == n).map(|(_, r)| r);
    // weft at 1 site against PostgreSQL alone, weft at 3 sites (three copies)
    // against PostgreSQL alone and against the function with two synchronous
    // standbys (three copies too).
    let targets: [(u32, &str, f64, &str); 5] = [
        (1, "pgbench", 2.0, "sites_1"),
        (3, "pgbench", 1.0, "sites_3"),
        (1, "pgfn", 2.0, "sites_1_vs_pgfn"),
        (3, "pgfn", 1.0, "sites_3_vs_pgfn"),
        (3, "pgfn_sync2", 2.0, "sites_3_vs_pgfn_sync2"),
    ];
    for (n, key, bound, name) in targets {
        let (Some(r), Some((_, p))) = (find(n), pg.iter().find(|(b, _)| b.key == key)) else {
            continue;
        };
        met.insert(
            name.to_string(),
            json!(check(
                &format!("weft_tps_sites_{n} / {key}_tps"),
                r.tps() / p.tps(),
                ">=",
                bound
            )),
        );
    }
    if let Some(r) = find(1) {
        println!(
            "  (messages per single-site transaction: {:.1}; Raid V1 needed 168)",
            mean(&r.messages)
        );
    }
    let first = &args.kv_engine[0];
    for (engine, other) in others {
        for (s, r) in other {
            report.insert(format!("weft_tps_sites_{s}_{engine}"), json!(r2(r.tps())));
            report.insert(
                format!("weft_tps_sites_{s}_{engine}_rounds"),
                json!(rounded(&r.tps)),
            );
            report.insert(format!("audit_sites_{s}_{engine}"), json!(r.audit_ok));
            if let Some((_, m)) = runs.iter().find(|(m, _)| m == s) {
                let ratio = m.tps() / r.tps().max(1e-9);
                report.insert(
                    format!("{first}_vs_{engine}_tps_sites_{s}"),
                    json!(r2(ratio)),
                );
                if first == "disk" && engine == "memory" {
                    met.insert(
                        format!("disk_vs_memory_sites_{s}"),
                        json!(check(
                            &format!("weft_tps_sites_{s} (disk) / weft_tps_sites_{s}_memory"),
                            ratio,
                            ">=",
                            0.9
                        )),
                    );
                }
            }
        }
    }
    report.insert("kv_engine".into(), json!(first));
    report.insert("targets_met".into(), serde_json::Value::Object(met));
    report.insert("mode".into(), json!(args.mode.to_string()));
    report.insert("scale".into(), json!(args.scale));
    report.insert("clients".into(), json!(args.clients));
    report.insert("duration_s".into(), json!(args.duration.as_secs_f64()));
    report.insert("rounds".into(), json!(args.rounds));
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
    anyhow::ensure!(
        runs.iter().all(|(_, r)| r.audit_ok)
            && others
                .iter()
                .all(|(_, o)| o.iter().all(|(_, r)| r.audit_ok)),
        "an audit failed"
    );
    Ok(())
}
