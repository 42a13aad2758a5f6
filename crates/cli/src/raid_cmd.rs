//! `weft raid`: run Raid sites as processes and drive them from the shell:
//! `site` runs one, `load` fills every copy, `run` drives DebitCredit clients
//! against them (`--acks` records what they were told committed), `audit`
//! checks the books on every copy, `history` lists one copy's history rows.
//!
//! Owns the multi-process forms of the demo's steps and the shared printing
//! of DebitCredit results. Must exit non-zero when the audit fails, and
//! an audit fails when it could not see every copy of the placement.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use weft::admin::{StatusReport, STATUS_SERVICE};
use weft_raid::{
    run_closed, AdRequest, Audit, LoadReply, LoadRequest, Mode, RaidSite, RunReport, SiteAudit,
    SiteConfig, Workload, AD_SERVICE, AUDIT_SERVICE, LOAD_SERVICE,
};
use weft_wire::{Address, Failure, Incarnation, NodeId, ServiceName, Status};

use crate::client::{parse_duration, Client, ClientOpts, Redial};
use crate::node_cmd::{announce, wait_for_signal, NodeArgs};
use crate::raid_acks::Acks;

/// `weft raid` subcommands.
// Parsed once per process: the size of `Site`'s node flags costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(clap::Subcommand, Debug)]
pub enum RaidCmd {
    /// Run a Raid site (a weft node with the Raid servers) until SIGINT/SIGTERM.
    Site {
        #[command(flatten)]
        node: NodeArgs,
        /// Raid's timeout per action (longest lock wait).
        #[arg(long, default_value = "1s", value_parser = parse_duration)]
        action_timeout: Duration,
    },
    /// Load the initial database on every site of the cluster.
    Load {
        #[command(flatten)]
        client: ClientOpts,
        /// Which DebitCredit.
        #[arg(long, default_value = "tpcb")]
        mode: Mode,
        /// tpcb scale (1 branch, 10 tellers, 100 000 accounts per unit).
        #[arg(long, default_value_t = 1)]
        scale: u32,
    },
    /// Run closed-loop DebitCredit clients against every site.
    Run {
        #[command(flatten)]
        client: ClientOpts,
        /// Which DebitCredit.
        #[arg(long, default_value = "tpcb")]
        mode: Mode,
        /// tpcb scale the database was loaded with.
        #[arg(long, default_value_t = 1)]
        scale: u32,
        /// Concurrent clients.
        #[arg(long, default_value_t = 8)]
        clients: usize,
        /// How long to run.
        #[arg(long, default_value = "10s", value_parser = parse_duration)]
        duration: Duration,
        /// Random seed.
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Print JSON.
        #[arg(long)]
        json: bool,
        /// Write one JSON line per transaction the client was told
        /// committed (time, answering site, request) to this file, and
        /// lines counting the failed attempts (at most four a second per
        /// site and status).
        #[arg(long)]
        acks: Option<std::path::PathBuf>,
    },
    /// Print the committed history rows of the site --node points at, one
    /// JSON line each, in key order.
    History {
        #[command(flatten)]
        client: ClientOpts,
    },
    /// Audit every copy: sum of accounts = tellers = branches = history.
    Audit {
        #[command(flatten)]
        client: ClientOpts,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
}

fn service(name: &str, node: NodeId) -> Address {
    Address {
        service: ServiceName::new(name).expect("valid service name"),
        instance: 0,
        node,
    }
}

/// A Raid site as the gateway node sees it.
struct SiteInfo {
    id: NodeId,
    addr: String,
    /// Why the gateway holds it dead (HostDead, ProcDead), when it does.
    down: Option<Status>,
}

/// The Raid sites a node knows, dead ones included, from its status.
async fn site_infos(client: &Client) -> anyhow::Result<Vec<SiteInfo>> {
    let report: StatusReport = client.call_here(STATUS_SERVICE, ()).await?;
    let mut v: Vec<SiteInfo> = report
        .view
        .nodes
        .iter()
        .filter(|n| n.info.services.iter().any(|s| s == weft_raid::SITE_SERVICE))
        .map(|n| SiteInfo {
            id: n.info.id,
            addr: n.info.addr.clone().unwrap_or_default(),
            down: (!n.alive).then(|| n.cause.unwrap_or(Status::HostDead)),
        })
        .collect();
    v.sort_by_key(|s| s.id);
    anyhow::ensure!(
        !v.is_empty(),
        "no Raid site in the cluster (start them with `weft raid site`)"
    );
    Ok(v)
}

/// The Raid sites a node knows (id and address), from its status.
async fn sites(client: &Client) -> anyhow::Result<Vec<(NodeId, String)>> {
    Ok(site_infos(client)
        .await?
        .into_iter()
        .map(|s| (s.id, s.addr))
        .collect())
}

/// Audits every copy through `client`: every Raid site the gateway knows,
/// and every site a copy's placement names. A copy that cannot be audited
/// (its site down, unknown, not answering) is named in the audit's
/// `missing`, which fails it; the others are audited all the same.
///
/// Fails only when the gateway cannot list the sites.
pub async fn audit_cluster(client: &Client) -> anyhow::Result<Audit> {
    let mut audit = Audit::default();
    let mut todo: Vec<NodeId> = site_infos(client).await?.iter().map(|s| s.id).collect();
    while let Some(id) = todo.pop() {
        if audit.sites.iter().any(|(n, _)| *n == id) || audit.missing.iter().any(|(n, _)| *n == id)
        {
            continue;
        }
        match client
            .call::<_, SiteAudit>(&service(AUDIT_SERVICE, id), (), None)
            .await
        {
            Ok(a) => {
                todo.extend(a.placement.iter().copied());
                audit.sites.push((id, a));
            }
            Err(f) => audit.missing.push((id, f.to_string())),
        }
    }
    audit.sites.sort_by_key(|(n, _)| *n);
    audit.missing.sort_by_key(|(n, _)| *n);
    Ok(audit)
}

/// Loads every site the gateway knows through `client`, each copy with
/// the placement naming all of them (the sites every write will go to).
/// A site that is down fails the load: a placement never leaves out a
/// copy.
pub async fn load_cluster(client: &Client, mode: Mode, scale: u32) -> anyhow::Result<u64> {
    let list = site_infos(client).await?;
    if let Some(s) = list.iter().find(|s| s.down.is_some()) {
        return Err(anyhow::Error::new(Failure::new(
            s.down.unwrap_or(Status::HostDead),
            format!("site {} is down: every copy must be loaded", s.id),
        )));
    }
    let req = LoadRequest {
        sizes: Workload::sizes(mode, scale),
        sites: list.iter().map(|s| s.id).collect(),
    };
    let mut tuples = 0;
    for s in &list {
        let started = Instant::now();
        println!("loading site {} ({} accounts)...", s.id, req.sizes.accounts);
        let r: LoadReply = client
            .call(&service(LOAD_SERVICE, s.id), req.clone(), None)
            .await
            .with_context(|| format!("loading site {}", s.id))?;
        println!(
            "site {}: {} tuples in {:.1} s",
            s.id,
            r.tuples,
            started.elapsed().as_secs_f64()
        );
        tuples += r.tuples;
    }
    Ok(tuples)
}

/// Messages and forces of one site incarnation.
pub type SiteCounters = BTreeMap<(NodeId, Incarnation), (u64, u64)>;

/// Messages and forces of every site that is up, by site incarnation, from
/// their status reports. A site that is down or unreachable is left out
/// (with a note on stderr): a run against a cluster missing a site must
/// still report.
pub async fn site_counters(opts: &ClientOpts) -> anyhow::Result<SiteCounters> {
    let gateway = Client::connect(opts).await?;
    let list = site_infos(&gateway).await;
    gateway.close().await;
    let mut out = SiteCounters::new();
    for s in list? {
        if let Some(cause) = s.down {
            eprintln!("weft: site {} is down ({cause}), not counted", s.id);
            continue;
        }
        let c = match Client::connect(&ClientOpts {
            node: s.addr.clone(),
            ..opts.clone()
        })
        .await
        {
            Ok(c) => c,
            Err(e) => {
                eprintln!("weft: site {} not counted: {e:#}", s.id);
                continue;
            }
        };
        let r: Result<StatusReport, Failure> = c.call_here(STATUS_SERVICE, ()).await;
        c.close().await;
        match r {
            Ok(r) => {
                out.insert(
                    (r.node, r.incarnation),
                    (r.transport.work_messages(), r.log.syncs),
                );
            }
            Err(f) => eprintln!("weft: site {} not counted: {f}", s.id),
        }
    }
    Ok(out)
}

/// Messages and forces between two snapshots, over the site incarnations
/// present in both.
pub fn counters_delta(before: &SiteCounters, after: &SiteCounters) -> (u64, u64) {
    after
        .iter()
        .filter_map(|(k, (m1, f1))| {
            let (m0, f0) = before.get(k)?;
            Some((m1.saturating_sub(*m0), f1.saturating_sub(*f0)))
        })
        .fold((0, 0), |(m, f), (dm, df)| (m + dm, f + df))
}

/// Messages and forces of every site that is up, from their status reports.
pub async fn cluster_counters(opts: &ClientOpts) -> anyhow::Result<(u64, u64)> {
    let c = site_counters(opts).await?;
    Ok(c.values().fold((0, 0), |(m, f), (dm, df)| (m + dm, f + df)))
}

/// Runs DebitCredit clients against a multi-process cluster: each client
/// talks to one site's action driver over its own connection.
#[allow(clippy::too_many_arguments)]
pub async fn run_remote(
    opts: &ClientOpts,
    mode: Mode,
    scale: u32,
    clients: usize,
    duration: Duration,
    seed: u64,
    progress: Arc<AtomicU64>,
    acks: Option<Arc<Acks>>,
) -> anyhow::Result<RunReport> {
    let gateway = Client::connect(opts).await?;
    let list = site_infos(&gateway).await;
    gateway.close().await;
    let mut runners = Vec::new();
    let mut links = Vec::new();
    for s in list? {
        // A site that is down runs no clients; the others' transactions
        // still need its copy and end with its status (HostDead, ProcDead).
        if let Some(cause) = s.down {
            eprintln!("weft: site {} is down ({cause}), no clients there", s.id);
            continue;
        }
        let site_opts = ClientOpts {
            node: s.addr.clone(),
            ..opts.clone()
        };
        // A link that breaks (the site restarted) connects again: the
        // clients there resume once the site is back.
        let first = match Client::dial(&site_opts).await {
            Ok(c) => Some(c),
            Err(f) => {
                eprintln!(
                    "weft: site {} at {} is unreachable ({f}); its clients will retry",
                    s.id, s.addr
                );
                None
            }
        };
        let c = Arc::new(Redial::new(site_opts, format!("site {}", s.id), first));
        links.push(c.clone());
        let ad = service(AD_SERVICE, s.id);
        let acks = acks.clone();
        let id = s.id;
        runners.push(move |req: AdRequest| {
            let c = c.clone();
            let ad = ad.clone();
            let acks = acks.clone();
            async move {
                let asked = acks.is_some().then(|| req.clone());
                let r: Result<weft_raid::AdReply, Failure> = c.call(&ad, req, None).await;
                match (acks, asked, &r) {
                    (Some(acks), Some(req), Ok(_)) => acks.record(id, &req),
                    (Some(acks), _, Err(f)) => acks.failed(id, f),
                    _ => {}
                }
                r.map(|r| r.0)
            }
        });
    }
    anyhow::ensure!(!runners.is_empty(), "no Raid site is up");
    let workload = Workload {
        mode,
        sizes: Workload::sizes(mode, scale),
    };
    let report = run_closed(runners, workload, clients, duration, seed, progress).await;
    for l in links {
        l.close().await;
    }
    Ok(report)
}

/// How often a run without a terminal prints its progress line.
pub const PROGRESS_EVERY: Duration = Duration::from_secs(2);

/// Shows a run's progress until aborted: a live line on a terminal, else
/// a line on stderr every [`PROGRESS_EVERY`] (commits so far, and the rate
/// over the last interval, so a stall shows).
fn spawn_progress(progress: Arc<AtomicU64>) -> tokio::task::JoinHandle<()> {
    use std::io::IsTerminal;
    let start = Instant::now();
    if std::io::stderr().is_terminal() {
        let bar = crate::bench::progress("running");
        return tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_millis(500)).await;
                let n = progress.load(Ordering::Relaxed);
                bar.set_message(format!(
                    "{n} committed, {:.0} tps",
                    n as f64 / start.elapsed().as_secs_f64()
                ));
            }
        });
    }
    tokio::spawn(async move {
        let (mut t0, mut n0) = (start, 0);
        loop {
            tokio::time::sleep(PROGRESS_EVERY).await;
            let (t, n) = (Instant::now(), progress.load(Ordering::Relaxed));
            eprintln!(
                "weft raid run: {:.1} s, {n} committed, {:.0} tps over the last {:.1} s",
                t.duration_since(start).as_secs_f64(),
                (n - n0) as f64 / t.duration_since(t0).as_secs_f64(),
                t.duration_since(t0).as_secs_f64()
            );
            (t0, n0) = (t, n);
        }
    })
}

/// Prints a run's results.
pub fn print_results(r: &RunReport, sites: usize, messages: Option<f64>, forces: Option<f64>) {
    println!();
    println!("{:<28} {}", "sites", sites);
    println!(
        "{:<28} {} clients, {} mode, {:.1} s",
        "run", r.clients, r.mode, r.duration_s
    );
    println!(
        "{:<28} {} committed of {} attempts",
        "transactions", r.committed, r.attempts
    );
    println!("{:<28} {:.0}", "throughput (tps)", r.tps);
    println!(
        "{:<28} p50 {:.2} ms, p99 {:.2} ms",
        "latency",
        r.p50_us / 1000.0,
        r.p99_us / 1000.0
    );
    let aborts: Vec<String> = r.aborts.iter().map(|(k, v)| format!("{k} {v}")).collect();
    println!(
        "{:<28} {}",
        "aborts by cause",
        if aborts.is_empty() {
            "none".into()
        } else {
            aborts.join(", ")
        }
    );
    for (status, detail) in &r.abort_samples {
        println!("{:<28}   e.g. {status}: {detail}", "");
    }
    if let Some(m) = messages {
        println!(
            "{:<28} {:.1} (Raid V1: 168 for a single-site transaction)",
            "messages per transaction", m
        );
    }
    if let Some(f) = forces {
        println!("{:<28} {:.3}", "log forces per transaction", f);
    }
}

/// Prints an audit; returns whether it passed.
pub fn print_audit(audit: &Audit) -> bool {
    println!();
    println!("audit (sum of balances per relation = sum of history deltas, on every copy):");
    for (node, a) in &audit.sites {
        let sum = |name: &str| a.balances.get(name).map(|(_, s)| *s).unwrap_or_default();
        println!(
            "  site {node}: accounts {} = tellers {} = branches {} = history {} ({} rows) {}",
            sum("account"),
            sum("teller"),
            sum("branch"),
            a.history_sums.get("account").copied().unwrap_or_default(),
            a.history_rows,
            if a.problems().is_empty() {
                "ok"
            } else {
                "FAILED"
            }
        );
    }
    for (node, why) in &audit.missing {
        println!("  site {node}: NOT AUDITED ({why})");
    }
    let problems = audit.problems();
    for p in &problems {
        println!("  problem: {p}");
    }
    let ok = audit.passed();
    println!("audit {}", if ok { "PASSED" } else { "FAILED" });
    ok
}

/// Runs `weft raid ...`.
pub async fn run(cmd: RaidCmd) -> anyhow::Result<()> {
    match cmd {
        RaidCmd::Site {
            node,
            action_timeout,
        } => {
            let site = RaidSite::new(SiteConfig {
                action_timeout,
                kv_engine: node.kv_engine(),
                ..SiteConfig::default()
            });
            let b = node
                .builder()?
                .plugin(Arc::new(site.clone()))
                .plugin(Arc::new(crate::raid_acks::HistoryService(site)));
            let n = node.start(b).await?;
            announce(&n);
            wait_for_signal().await;
            n.shutdown().await;
            Ok(())
        }
        RaidCmd::Load {
            client,
            mode,
            scale,
        } => {
            // A site loads its copy in one call: ten million accounts
            // (scale 100) take minutes, past any answer timeout.
            let opts = ClientOpts {
                timeout: client.timeout.max(Duration::from_secs(4 * 3600)),
                ..client
            };
            let c = Client::connect(&opts).await?;
            let started = Instant::now();
            let tuples = load_cluster(&c, mode, scale).await?;
            c.close().await;
            println!(
                "loaded {tuples} tuples in {:.1} s",
                started.elapsed().as_secs_f64()
            );
            Ok(())
        }
        RaidCmd::Run {
            client,
            mode,
            scale,
            clients,
            duration,
            seed,
            json,
            acks,
        } => {
            let acks = acks.as_deref().map(Acks::create).transpose()?;
            let c = Client::connect(&client).await?;
            let n = sites(&c).await?.len();
            c.close().await;
            let before = site_counters(&client).await?;
            let progress = Arc::new(AtomicU64::new(0));
            let ticker = spawn_progress(progress.clone());
            let r = run_remote(
                &client,
                mode,
                scale,
                clients,
                duration,
                seed,
                progress,
                acks.clone(),
            )
            .await?;
            ticker.abort();
            if let Some(a) = &acks {
                a.finish()?;
            }
            // The clients' own counts are the report; the sites' counters
            // only add to it. A gateway down at the end loses those, not
            // the report.
            let after = site_counters(&client).await.inspect_err(|e| {
                eprintln!("weft: the sites' message and force counters could not be fetched: {e:#}")
            });
            let per = |x: u64| {
                if r.committed == 0 {
                    0.0
                } else {
                    x as f64 / r.committed as f64
                }
            };
            let (msgs, forces) = match &after {
                Ok(after) => {
                    let (m, f) = counters_delta(&before, after);
                    (Some(per(m)), Some(per(f)))
                }
                Err(_) => (None, None),
            };
            if json {
                let mut v = serde_json::to_value(&r)?;
                v["messages_per_txn"] = serde_json::json!(msgs);
                v["forces_per_txn"] = serde_json::json!(forces);
                if let Err(e) = &after {
                    v["not_fetched"] = serde_json::json!({ "site_counters": format!("{e:#}") });
                }
                println!("{}", serde_json::to_string_pretty(&v)?);
            } else {
                print_results(&r, n, msgs, forces);
                if let Err(e) = &after {
                    println!("{:<28} {e:#}", "not fetched: site counters");
                }
            }
            Ok(())
        }
        RaidCmd::History { client } => {
            let c = Client::connect(&client).await?;
            let rows = crate::raid_acks::print_history(&c).await;
            c.close().await;
            rows.map(|_| ())
        }
        RaidCmd::Audit { client, json } => {
            let c = Client::connect(&client).await?;
            let audit = audit_cluster(&c).await?;
            c.close().await;
            let ok = if json {
                // Every site of the placement, with what was audited there
                // (a copy's sums), or why nothing was.
                let mut by_site: BTreeMap<String, serde_json::Value> = audit
                    .sites
                    .iter()
                    .map(|(n, a)| Ok((n.to_string(), serde_json::to_value(a)?)))
                    .collect::<anyhow::Result<_>>()?;
                for (n, why) in &audit.missing {
                    by_site.insert(
                        n.to_string(),
                        serde_json::json!({ "audited": false, "error": why }),
                    );
                }
                println!(
                    "{}",
                    serde_json::to_string_pretty(&serde_json::json!({
                        "passed": audit.passed(),
                        "problems": audit.problems(),
                        "replicas": audit.replicas(),
                        "missing": audit.missing.iter().map(|(n, _)| n).collect::<Vec<_>>(),
                        "sites": by_site,
                    }))?
                );
                audit.passed()
            } else {
                print_audit(&audit)
            };
            anyhow::ensure!(ok, "the audit failed");
            Ok(())
        }
    }
}
