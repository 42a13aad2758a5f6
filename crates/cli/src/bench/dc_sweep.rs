//! `weft bench debitcredit --sweep`: the scale curves. DebitCredit at 1, 8,
//! 32 and 64 clients × 1, 3 and 5 sites × scale 1 and 10 (the defaults of
//! `--sweep-clients`, `--sweep-sites`, `--sweep-scales`), with the
//! PostgreSQL baselines the flags ask for at the same client counts and
//! scales, then tps and p99 against clients, one line per configuration.
//!
//! Owns the sweep's order, its table, its JSON (`sweep`: one object per
//! point) and its plot. Must never: decide a target from a point that did
//! not run (a configuration missing at some client count is reported as
//! missing, not as passed).

use std::path::Path;

use anyhow::Context;
use plotters::prelude::*;
use serde_json::json;

use super::debitcredit::{run_sites, DebitCreditArgs, PgBaseline, PgServers, Rounds};
use super::{check, r2, write_json};

/// One measured point.
#[derive(Clone, Debug)]
struct Point {
    /// `weft N site(s)` or a PostgreSQL baseline's label.
    config: String,
    /// JSON key prefix: `weft_sites_N` or the baseline's key.
    key: String,
    scale: u32,
    clients: usize,
    tps: f64,
    p99_ms: Option<f64>,
    audit_ok: bool,
}

/// Runs the sweep with `args` (its `--duration`, `--kv-engine`'s first
/// engine, `--dir`, `--mode`) and the PostgreSQL `baselines`.
pub(super) async fn run(
    args: &DebitCreditArgs,
    servers: &PgServers,
    baselines: &[PgBaseline],
) -> anyhow::Result<()> {
    let engine = args.kv_engine[0].clone();
    let total = args.sweep_scales.len()
        * args.sweep_clients.len()
        * (args.sweep_sites.len() + baselines.len());
    let mut points = Vec::with_capacity(total);
    let started = std::time::Instant::now();
    for &scale in &args.sweep_scales {
        for &clients in &args.sweep_clients {
            let shaped = DebitCreditArgs {
                clients,
                scale,
                ..args.clone()
            };
            for &sites in &args.sweep_sites {
                let run = run_sites(&shaped, sites, &engine).await?;
                let mut rounds = Rounds::default();
                rounds.add_site(&run);
                points.push(Point {
                    config: format!("weft {sites} site{}", if sites == 1 { "" } else { "s" }),
                    key: format!("weft_sites_{sites}"),
                    scale,
                    clients,
                    tps: rounds.tps(),
                    p99_ms: Some(run.report.p99_us / 1000.0),
                    audit_ok: run.audit_ok,
                });
                say(&points, total, started);
            }
            for b in baselines {
                let options =
                    weft_bench::pgbench::PgbenchOptions::new(scale, clients as u32, args.duration)
                        .script(b.script);
                let r = weft_bench::pgbench::run_with(servers.for_baseline(b), &options).await?;
                points.push(Point {
                    config: b.label.clone(),
                    key: b.key.clone(),
                    scale,
                    clients,
                    tps: r.tps,
                    // pgbench reports a mean, not percentiles: no p99 line for it.
                    p99_ms: None,
                    audit_ok: r.failed_transactions.unwrap_or(0) == 0,
                });
                say(&points, total, started);
            }
        }
    }
    report(args, &points)
}

/// One progress line per point, on stderr (also when not on a terminal).
fn say(points: &[Point], total: usize, started: std::time::Instant) {
    let p = points.last().expect("a point was just added");
    eprintln!(
        "sweep {}/{total} [{:.0?}]: {}, scale {}, {} clients: {:.0} tps{}",
        points.len(),
        started.elapsed(),
        p.config,
        p.scale,
        p.clients,
        p.tps,
        p.p99_ms
            .map_or(String::new(), |v| format!(", p99 {v:.2} ms"))
    );
}

/// The sweep's table, its targets, JSON and plot.
fn report(args: &DebitCreditArgs, points: &[Point]) -> anyhow::Result<()> {
    println!(
        "weft bench debitcredit --sweep: {} mode, {:?} per point",
        args.mode, args.duration
    );
    println!(
        "{:<24} {:>6} {:>8} {:>10} {:>9}",
        "configuration", "scale", "clients", "tps", "p99 ms"
    );
    for p in points {
        println!(
            "{:<24} {:>6} {:>8} {:>10.0} {:>9}",
            p.config,
            p.scale,
            p.clients,
            p.tps,
            p.p99_ms.map_or("-".into(), |v| format!("{v:.2}"))
        );
    }
    println!("targets (every client count, every scale):");
    let mut met = serde_json::Map::new();
    for (weft, pg, name) in [
        ("weft_sites_1", "pgfn", "sweep_sites_1_ahead_of_pgfn"),
        (
            "weft_sites_3",
            "pgfn_sync2",
            "sweep_sites_3_ahead_of_pgfn_sync2",
        ),
    ] {
        if !points.iter().any(|p| p.key == pg) {
            continue;
        }
        let mut worst: Option<f64> = None;
        for &scale in &args.sweep_scales {
            for &clients in &args.sweep_clients {
                let at = |key: &str| {
                    points
                        .iter()
                        .find(|p| p.key == key && p.scale == scale && p.clients == clients)
                        .map(|p| p.tps)
                };
                let ratio = match (at(weft), at(pg)) {
                    (Some(w), Some(b)) => w / b.max(1e-9),
                    // A point that did not run fails the target.
                    _ => 0.0,
                };
                worst = Some(worst.map_or(ratio, |w: f64| w.min(ratio)));
            }
        }
        met.insert(
            name.into(),
            json!(check(
                &format!("min over the sweep of {weft}_tps / {pg}_tps"),
                worst.unwrap_or(0.0),
                ">=",
                1.0
            )),
        );
    }
    let audit_ok = points.iter().all(|p| p.audit_ok);
    if let Some(path) = &args.json {
        let sweep: Vec<_> = points
            .iter()
            .map(|p| {
                json!({
                    "config": p.config, "key": p.key, "scale": p.scale, "clients": p.clients,
                    "tps": r2(p.tps), "p99_ms": p.p99_ms.map(r2), "audit_passed": p.audit_ok,
                })
            })
            .collect();
        write_json(
            path,
            &json!({
                "mode": args.mode.to_string(),
                "duration_s": args.duration.as_secs_f64(),
                "kv_engine": args.kv_engine[0],
                "sweep": sweep,
                "targets_met": met,
                "audit_passed": audit_ok,
            }),
        )?;
    }
    if let Some(path) = &args.plot {
        plot(args, path, points)?;
        eprintln!("wrote {}", path.display());
    }
    anyhow::ensure!(audit_ok, "an audit (or a PostgreSQL transaction) failed");
    Ok(())
}

/// Panels of tps (top) and p99 (bottom) against clients, one column per scale.
fn plot(args: &DebitCreditArgs, path: &Path, points: &[Point]) -> anyhow::Result<()> {
    super::plot::ensure_font()?;
    let root = BitMapBackend::new(path, (1400, 1000)).into_drawing_area();
    root.fill(&WHITE).context("drawing")?;
    let scales = &args.sweep_scales;
    let panels = root.split_evenly((2, scales.len().max(1)));
    let mut configs: Vec<&str> = Vec::new();
    for p in points {
        if !configs.contains(&p.config.as_str()) {
            configs.push(&p.config);
        }
    }
    let x_max = args.sweep_clients.iter().copied().max().unwrap_or(1) as f64 * 1.06 + 1.0;
    let colors = [
        RGBColor(52, 101, 164),
        RGBColor(78, 154, 6),
        RGBColor(117, 80, 123),
        RGBColor(204, 0, 0),
        RGBColor(245, 121, 0),
        RGBColor(0, 0, 0),
    ];
    for (i, panel) in panels.iter().enumerate() {
        let Some(&scale) = scales.get(i % scales.len().max(1)) else {
            break;
        };
        let p99 = i >= scales.len();
        let value = |p: &Point| if p99 { p.p99_ms } else { Some(p.tps) };
        let top = points
            .iter()
            .filter(|p| p.scale == scale)
            .filter_map(value)
            .fold(0.0f64, f64::max)
            .max(1.0)
            * 1.1;
        let title = if p99 {
            format!("p99 latency (ms), scale {scale}")
        } else {
            format!("committed tps, scale {scale}")
        };
        let mut chart = ChartBuilder::on(panel)
            .caption(title, ("sans-serif", 20))
            .margin(14)
            .x_label_area_size(40)
            .y_label_area_size(60)
            .build_cartesian_2d(0f64..x_max, 0f64..top)
            .context("laying out the chart")?;
        chart
            .configure_mesh()
            .x_desc("clients")
            .x_label_formatter(&|x| format!("{x:.0}"))
            .y_label_formatter(&|y| {
                if p99 {
                    format!("{y:.1}")
                } else {
                    format!("{y:.0}")
                }
            })
            .label_style(("sans-serif", 14))
            .draw()
            .context("drawing the axes")?;
        for (c, config) in configs.iter().enumerate() {
            let line: Vec<(f64, f64)> = points
                .iter()
                .filter(|p| p.scale == scale && p.config == *config)
                .filter_map(|p| value(p).map(|v| (p.clients as f64, v)))
                .collect();
            if line.is_empty() {
                continue;
            }
            let color = colors[c % colors.len()];
            chart
                .draw_series(LineSeries::new(line.clone(), color.stroke_width(2)))
                .context("drawing a line")?
                .label(config.to_string())
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
                });
            chart
                .draw_series(line.iter().map(|&p| Circle::new(p, 4, color.filled())))
                .context("drawing the points")?;
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .label_font(("sans-serif", 14))
            .position(SeriesLabelPosition::UpperLeft)
            .draw()
            .context("drawing the legend")?;
    }
    root.present()
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}
