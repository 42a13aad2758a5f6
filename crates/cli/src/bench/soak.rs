//! `weft bench soak`: DebitCredit for a long time on an in-process Raid
//! cluster, sampling the process's resident memory, the throughput and the
//! sites' checkpoint times every few seconds, then auditing every copy. It
//! answers one question: does anything but the data the application keeps
//! (the history rows) grow with the number of transactions run? The
//! same-run baseline is the run's own beginning: memory at 2 minutes against
//! memory at the end, throughput in the first minute against the last.
//!
//! Owns the soak's choreography, its samples, their JSON and their plot.
//! Must print a progress line per sample whether or not stderr is a
//! terminal, and must report (not hide) a failed audit.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use serde::Serialize;
use serde_json::json;
use weft_raid::{ClusterOptions, Mode, RaidCluster, Workload};

use super::{check, r2, write_json};
use crate::client::parse_duration;

/// Flags of `weft bench soak`.
#[derive(clap::Args, Debug)]
pub struct SoakArgs {
    /// How long the clients run.
    #[arg(long, default_value = "10m", value_parser = parse_duration)]
    pub duration: Duration,
    /// Sites (weft nodes in this process), each holding every relation.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=16))]
    pub sites: u32,
    /// Concurrent clients.
    #[arg(long, default_value_t = 32)]
    pub clients: usize,
    /// tpcb scale (100 000 accounts per unit).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub scale: u32,
    /// Time between samples.
    #[arg(long, default_value = "5s", value_parser = parse_duration)]
    pub every: Duration,
    /// Random seed of the clients.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Where the sites keep their data (a temporary directory is made under
    /// it and removed).
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// Write the results and every sample as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Plot memory, throughput and checkpoint times over time to this PNG.
    #[arg(long)]
    pub plot: Option<PathBuf>,
}

/// One sample of the running cluster.
#[derive(Clone, Debug, Serialize)]
pub struct Sample {
    /// Seconds since the clients started.
    pub t_s: f64,
    /// Resident memory of this process, MiB.
    pub rss_mib: f64,
    /// Transactions committed since the start.
    pub committed: u64,
    /// Commits per second since the previous sample.
    pub tps: f64,
    /// CPU seconds (user and system) this process used since it started.
    pub cpu_s: f64,
    /// Checkpoints completed so far, over every site.
    pub checkpoints: u64,
    /// Longest checkpoint so far at any site, ms.
    pub checkpoint_ms_max: f64,
    /// The latest checkpoint of each site, the longest of them, ms.
    pub checkpoint_ms_last: f64,
    /// Shipped-request markers kept, summed over the copies.
    pub markers: u64,
    /// Transactions live at the nodes' transaction managers.
    pub live_txs: u64,
    /// Committed changes held in memory by the disk engines, summed over
    /// the copies.
    pub overlay_keys: u64,
    /// Delta tables not merged yet, summed over the copies.
    pub delta_tables: u64,
}

/// Resident set size of this process in MiB: `VmRSS` of
/// /proc/self/status (the resident count /proc/self/statm gives in pages,
/// here in kB, so that no page size is assumed).
///
/// Fails when the file cannot be read (not Linux).
pub fn rss_mib() -> anyhow::Result<f64> {
    let text = std::fs::read_to_string("/proc/self/status").context("reading /proc/self/status")?;
    let kb = text
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|n| n.parse::<u64>().ok())
        .context("no VmRSS line in /proc/self/status")?;
    Ok(kb as f64 / 1024.0)
}

fn sample(cluster: &RaidCluster, t: f64, committed: u64, prev: Option<&Sample>) -> Sample {
    let cps: Vec<_> = cluster.sites.iter().map(|s| s.checkpoint_stats()).collect();
    let book: Vec<_> = cluster.sites.iter().map(|s| s.bookkeeping()).collect();
    let tps = match prev {
        Some(p) if t > p.t_s => (committed - p.committed) as f64 / (t - p.t_s),
        _ if t > 0.0 => committed as f64 / t,
        _ => 0.0,
    };
    Sample {
        t_s: r2(t),
        rss_mib: r2(rss_mib().unwrap_or(0.0)),
        committed,
        tps: r2(tps),
        cpu_s: r2(crate::cpu::process("self").map_or(0.0, |c| c.total_s())),
        checkpoints: cps.iter().map(|c| c.count).sum(),
        checkpoint_ms_max: r2(cps.iter().map(|c| c.max_us).max().unwrap_or(0) as f64 / 1000.0),
        checkpoint_ms_last: r2(cps.iter().map(|c| c.last_us).max().unwrap_or(0) as f64 / 1000.0),
        markers: book.iter().map(|b| b.markers as u64).sum(),
        overlay_keys: book.iter().map(|b| b.overlay_keys as u64).sum(),
        delta_tables: book.iter().map(|b| b.delta_tables as u64).sum(),
        live_txs: cluster
            .nodes
            .iter()
            .map(|n| n.tm().list().len() as u64)
            .sum(),
    }
}

/// Committed keys summed over the copies (history rows included), counted
/// exactly. Only before and after the clients run: an exact count holds
/// each store's lock while it looks up every change held in memory, and
/// sampling it under load (as this bench once did, every 5 s) stalled the
/// commits it was measuring.
async fn store_keys(cluster: &RaidCluster) -> anyhow::Result<u64> {
    let mut n = 0;
    for site in &cluster.sites {
        let kv = site.store().clone();
        n += tokio::task::spawn_blocking(move || kv.key_count())
            .await
            .context("the key count's task")?
            .map_err(|f| anyhow::anyhow!("counting a copy's keys: {f:?}"))?;
    }
    Ok(n)
}

/// The figures of a soak from its samples (the first at t = 0, the last at
/// the end of the run).
#[derive(Clone, Debug, PartialEq)]
pub struct Figures {
    /// RSS at the first sample at or after 2 minutes (the last sample when
    /// the run is shorter).
    pub rss_mib_at_2min: f64,
    /// RSS at the end.
    pub rss_mib_end: f64,
    /// Mean tps over the first minute (the whole run when shorter).
    pub tps_first_min: f64,
    /// Mean tps over the last minute (the whole run when shorter).
    pub tps_last_min: f64,
    /// Lowest RSS of the samples within 30 s of the 2-minute mark (of the
    /// whole run when shorter): memory between checkpoints, whose image
    /// copy of the in-memory store swings RSS by the store's size.
    pub rss_floor_mib_at_2min: f64,
    /// Lowest RSS of the samples of the last minute.
    pub rss_floor_mib_end: f64,
    /// CPU microseconds of this process per commit over the first minute:
    /// with the last minute's, the cost of a commit on a machine whose
    /// load varies (throughput follows the share of the cores the process
    /// gets; its CPU per commit much less).
    pub cpu_us_per_commit_first_min: f64,
    /// CPU microseconds per commit over the last minute.
    pub cpu_us_per_commit_last_min: f64,
}

/// Computes the figures; `None` without at least two samples.
pub fn figures(samples: &[Sample]) -> Option<Figures> {
    let (first, last) = (samples.first()?, samples.last()?);
    if samples.len() < 2 || last.t_s <= first.t_s {
        return None;
    }
    let at_or_after = |t: f64| samples.iter().find(|s| s.t_s >= t).unwrap_or(last);
    let at_or_before = |t: f64| samples.iter().rev().find(|s| s.t_s <= t).unwrap_or(first);
    let rate = |a: &Sample, b: &Sample| {
        if b.t_s > a.t_s {
            (b.committed - a.committed) as f64 / (b.t_s - a.t_s)
        } else {
            0.0
        }
    };
    let cpu_per_commit = |a: &Sample, b: &Sample| {
        if b.committed > a.committed {
            (b.cpu_s - a.cpu_s).max(0.0) * 1e6 / (b.committed - a.committed) as f64
        } else {
            0.0
        }
    };
    let floor = |from: f64, to: f64| {
        samples
            .iter()
            .filter(|s| s.t_s >= from && s.t_s <= to)
            .map(|s| s.rss_mib)
            .fold(f64::INFINITY, f64::min)
    };
    let two = at_or_after(first.t_s + 120.0).t_s;
    let minute_in = at_or_after(first.t_s + 60.0);
    let minute_out = at_or_before(last.t_s - 60.0);
    Some(Figures {
        rss_mib_at_2min: at_or_after(first.t_s + 120.0).rss_mib,
        rss_mib_end: last.rss_mib,
        tps_first_min: r2(rate(first, minute_in)),
        tps_last_min: r2(rate(minute_out, last)),
        rss_floor_mib_at_2min: floor(two - 30.0, two + 30.0),
        rss_floor_mib_end: floor(last.t_s - 60.0, last.t_s),
        cpu_us_per_commit_first_min: r2(cpu_per_commit(first, minute_in)),
        cpu_us_per_commit_last_min: r2(cpu_per_commit(minute_out, last)),
    })
}

/// Runs `weft bench soak`.
pub async fn run(args: SoakArgs) -> anyhow::Result<()> {
    anyhow::ensure!(args.clients >= 1, "--clients must be at least 1");
    anyhow::ensure!(
        args.every >= Duration::from_millis(100),
        "--every must be at least 100ms"
    );
    let base = args.dir.clone().unwrap_or_else(std::env::temp_dir);
    eprintln!(
        "soak: {} site(s) in this process, scale {}, {} clients for {:?}, a sample every {:?}",
        args.sites, args.scale, args.clients, args.duration, args.every
    );
    let cluster = RaidCluster::start(args.sites, &base, ClusterOptions::default()).await?;
    let sizes = Workload::sizes(Mode::Tpcb, args.scale);
    let load_start = Instant::now();
    cluster.load(sizes).await?;
    let keys_start = store_keys(&cluster).await?;
    eprintln!(
        "soak: loaded in {:.1}s, RSS {:.0} MiB, {keys_start} keys over the copies",
        load_start.elapsed().as_secs_f64(),
        rss_mib().unwrap_or(0.0)
    );
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
    let progress = Arc::new(AtomicU64::new(0));
    let clients = tokio::spawn(weft_raid::run_closed(
        runners,
        Workload {
            mode: Mode::Tpcb,
            sizes,
        },
        args.clients,
        args.duration,
        args.seed,
        progress.clone(),
    ));
    let start = Instant::now();
    let end = start + args.duration;
    let mut samples = vec![sample(&cluster, 0.0, 0, None)];
    loop {
        let next = (start + args.every * samples.len() as u32).min(end);
        tokio::time::sleep_until(next.into()).await;
        let t = start.elapsed().as_secs_f64();
        let s = sample(
            &cluster,
            t,
            progress.load(Ordering::Relaxed),
            samples.last(),
        );
        eprintln!(
            "soak: {:>7.1}s  {:>9} committed  {:>8.0} tps  RSS {:>7.1} MiB  overlay {:>7}  deltas {:>3}  markers {:>7}  live txs {:>4}  checkpoints {} (max {:.1} ms)",
            s.t_s, s.committed, s.tps, s.rss_mib, s.overlay_keys, s.delta_tables, s.markers, s.live_txs, s.checkpoints, s.checkpoint_ms_max
        );
        samples.push(s);
        if next >= end {
            break;
        }
    }
    let report = clients.await.context("the clients' task")?;
    let settled = cluster.quiesce(Duration::from_secs(30)).await;
    let keys_end = store_keys(&cluster).await?;
    // One more checkpoint per site, so that even a short soak measures one.
    let mut final_ms: Vec<f64> = Vec::new();
    for node in &cluster.nodes {
        let node = node.clone();
        let t = Instant::now();
        tokio::task::spawn_blocking(move || node.checkpoint())
            .await
            .context("the checkpoint task")??;
        final_ms.push(t.elapsed().as_secs_f64() * 1000.0);
    }
    let checkpoint_ms_max = cluster
        .sites
        .iter()
        .map(|s| s.checkpoint_stats().max_us)
        .max()
        .unwrap_or(0) as f64
        / 1000.0;
    let audit = cluster.audit();
    let audit_passed = settled && audit.passed();
    let f = figures(&samples).context("the soak took fewer than two samples")?;
    cluster.shutdown().await;

    println!(
        "soak: {} committed in {:.0}s ({:.0} tps), {} attempts",
        report.committed, report.duration_s, report.tps, report.attempts
    );
    println!(
        "  RSS at 2 min {:.1} MiB, at the end {:.1} MiB (lowest around 2 min {:.1}, in the last minute {:.1}); tps first minute {:.0}, last minute {:.0}; longest checkpoint {:.1} ms",
        f.rss_mib_at_2min, f.rss_mib_end, f.rss_floor_mib_at_2min, f.rss_floor_mib_end, f.tps_first_min, f.tps_last_min, checkpoint_ms_max
    );
    println!(
        "  CPU per commit: {:.0} us in the first minute, {:.0} us in the last",
        f.cpu_us_per_commit_first_min, f.cpu_us_per_commit_last_min
    );
    println!(
        "  audit: {}",
        if audit_passed {
            "passed"
        } else if !settled {
            "FAILED (transactions still unfinished after 30 s)"
        } else {
            "FAILED"
        }
    );
    check(
        "rss_mib_end <= rss_mib_at_2min + 256",
        f.rss_mib_end,
        "<=",
        f.rss_mib_at_2min + 256.0,
    );
    check(
        "tps_last_min >= 0.9 x tps_first_min",
        f.tps_last_min,
        ">=",
        0.9 * f.tps_first_min,
    );
    let value = json!({
        "bench": "soak",
        "sites": args.sites,
        "clients": args.clients,
        "scale": args.scale,
        "duration_s": r2(start.elapsed().as_secs_f64().min(args.duration.as_secs_f64())),
        "committed": report.committed,
        "attempts": report.attempts,
        "tps": r2(report.tps),
        "aborts": report.aborts,
        "rss_mib_at_2min": f.rss_mib_at_2min,
        "rss_mib_end": f.rss_mib_end,
        "rss_growth_mib": r2(f.rss_mib_end - f.rss_mib_at_2min),
        "rss_floor_mib_at_2min": f.rss_floor_mib_at_2min,
        "rss_floor_mib_end": f.rss_floor_mib_end,
        "tps_first_min": f.tps_first_min,
        "tps_last_min": f.tps_last_min,
        "cpu_us_per_commit_first_min": f.cpu_us_per_commit_first_min,
        "cpu_us_per_commit_last_min": f.cpu_us_per_commit_last_min,
        "tps_last_over_first": if f.tps_first_min > 0.0 { r2(f.tps_last_min / f.tps_first_min) } else { 0.0 },
        "store_keys_start": keys_start,
        "store_keys_end": keys_end,
        "checkpoint_ms_max": r2(checkpoint_ms_max),
        "final_checkpoint_ms": final_ms.iter().map(|m| r2(*m)).collect::<Vec<_>>(),
        "audit_passed": audit_passed,
        "samples": samples,
    });
    if let Some(path) = &args.json {
        write_json(path, &value)?;
    }
    if let Some(path) = &args.plot {
        plot(path, &samples, &args)?;
        eprintln!("wrote {}", path.display());
    }
    anyhow::ensure!(audit_passed, "the audit failed");
    Ok(())
}

/// One panel of the plot: its label, colour and what it shows of a sample.
type Panel = (&'static str, plotters::style::RGBColor, fn(&Sample) -> f64);

/// Draws RSS, tps and the latest checkpoint's duration against time, one
/// panel each.
fn plot(path: &Path, samples: &[Sample], args: &SoakArgs) -> anyhow::Result<()> {
    use plotters::prelude::*;
    super::plot::ensure_font()?;
    let root = BitMapBackend::new(path, (1000, 900)).into_drawing_area();
    root.fill(&WHITE).context("drawing")?;
    let title = format!(
        "weft soak: DebitCredit, {} site(s), {} clients, scale {}",
        args.sites, args.clients, args.scale
    );
    let root = root
        .titled(&title, ("sans-serif", 22))
        .context("drawing the title")?;
    let panels = root.split_evenly((3, 1));
    let t_max = samples.last().map_or(1.0, |s| s.t_s).max(1.0);
    let series: [Panel; 3] = [
        ("RSS (MiB)", RGBColor(52, 101, 164), |s| s.rss_mib),
        ("committed tps", RGBColor(78, 154, 6), |s| s.tps),
        ("latest checkpoint (ms)", RGBColor(204, 0, 0), |s| {
            s.checkpoint_ms_last
        }),
    ];
    for (panel, (label, color, f)) in panels.iter().zip(series) {
        let y_max = samples.iter().map(f).fold(0.0f64, f64::max).max(1.0) * 1.1;
        let mut chart = ChartBuilder::on(panel)
            .margin(12)
            .x_label_area_size(36)
            .y_label_area_size(70)
            .build_cartesian_2d(0.0..t_max, 0.0..y_max)
            .context("laying out a panel")?;
        chart
            .configure_mesh()
            .x_desc("seconds")
            .y_desc(label)
            .label_style(("sans-serif", 14))
            .draw()
            .context("drawing the axes")?;
        chart
            .draw_series(LineSeries::new(
                // The first sample has no rate yet.
                samples
                    .iter()
                    .skip(usize::from(label == "committed tps"))
                    .map(|s| (s.t_s, f(s))),
                color.stroke_width(2),
            ))
            .context("drawing a line")?;
    }
    root.present()
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(t: f64, committed: u64, rss: f64) -> Sample {
        Sample {
            t_s: t,
            rss_mib: rss,
            committed,
            tps: 0.0,
            cpu_s: 0.0,
            checkpoints: 0,
            checkpoint_ms_max: 0.0,
            checkpoint_ms_last: 0.0,
            markers: 0,
            live_txs: 0,
            overlay_keys: 0,
            delta_tables: 0,
        }
    }

    #[test]
    fn figures_take_the_first_and_last_minutes() {
        // 100 tps for the first 60 s, then 50 tps; RSS 10 MiB per 30 s.
        let samples: Vec<Sample> = (0..=10)
            .map(|i| {
                let t = i as f64 * 30.0;
                let c = if t <= 60.0 {
                    (t * 100.0) as u64
                } else {
                    6000 + ((t - 60.0) * 50.0) as u64
                };
                Sample {
                    cpu_s: t * 0.5,
                    ..s(t, c, 100.0 + i as f64 * 10.0)
                }
            })
            .collect();
        let f = figures(&samples).unwrap();
        // Half a CPU throughout: 30 CPU-s for 6,000 commits, then for 3,000.
        assert_eq!(f.cpu_us_per_commit_first_min, 5000.0);
        assert_eq!(f.cpu_us_per_commit_last_min, 10000.0);
        assert_eq!(f.rss_mib_at_2min, 140.0);
        assert_eq!(f.rss_mib_end, 200.0);
        assert_eq!(f.tps_first_min, 100.0);
        assert_eq!(f.tps_last_min, 50.0);
        assert_eq!(f.rss_floor_mib_at_2min, 130.0, "samples at 90..150 s");
        assert_eq!(f.rss_floor_mib_end, 180.0, "samples at 240..300 s");
    }

    #[test]
    fn a_short_run_measures_its_whole_span() {
        let samples = vec![s(0.0, 0, 50.0), s(5.0, 500, 60.0), s(10.0, 1500, 70.0)];
        let f = figures(&samples).unwrap();
        assert_eq!(f.rss_mib_at_2min, 70.0, "the last sample stands in");
        assert_eq!(f.tps_first_min, 150.0);
        assert_eq!(f.tps_last_min, 150.0);
        assert_eq!(figures(&samples[..1]), None);
    }

    #[test]
    fn rss_is_read_from_proc() {
        match rss_mib() {
            Ok(m) => assert!(m > 0.0, "{m}"),
            Err(e) => assert!(!Path::new("/proc/self/status").exists(), "{e}"),
        }
    }
}
