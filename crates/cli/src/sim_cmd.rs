//! `weft sim`: runs many seeds of the deterministic whole-cluster simulator (`weft_sim`) and
//! reports violations, speed and coverage.
//!
//! Owns the command's arguments, its progress display (a bar on a terminal, a line every few
//! seconds otherwise) and its JSON report. Must never change what a seed does: a seed run
//! here replays exactly as in the tests.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use weft_sim::{run_batch, CrashPoint, FaultKind, SimConfig};

/// Arguments of `weft sim`.
#[derive(Args, Debug)]
pub struct SimArgs {
    /// Number of seeds to run.
    #[arg(long, default_value_t = 100)]
    pub seeds: u64,
    /// First seed.
    #[arg(long, default_value_t = 0)]
    pub from: u64,
    /// Write a JSON report here.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Print every event of every seed (use with `--seeds 1` to replay one).
    #[arg(long)]
    pub trace: bool,
    /// No faults at all (a baseline for the speed figures).
    #[arg(long)]
    pub calm: bool,
    /// Nodes per cluster (2..=8).
    #[arg(long, default_value_t = 3)]
    pub nodes: u32,
    /// Stop at the first failing seed.
    #[arg(long)]
    pub fail_fast: bool,
}

/// Runs the command. Fails (exit code 1) when any seed found a violation.
pub async fn run(a: SimArgs) -> anyhow::Result<()> {
    let base = if a.calm {
        SimConfig::calm()
    } else {
        SimConfig::default()
    };
    let cfg = SimConfig {
        nodes: a.nodes,
        trace: a.trace,
        ..base
    };
    cfg.validate().map_err(anyhow::Error::msg)?;
    let tty = std::io::stderr().is_terminal() && !a.trace;
    let pb = if tty {
        let pb = ProgressBar::new(a.seeds);
        pb.set_style(
            ProgressStyle::with_template("{bar:40} {pos}/{len} seeds  {per_sec}  {msg}  eta {eta}")
                .expect("template"),
        );
        Some(pb)
    } else {
        None
    };
    let started = Instant::now();
    let mut last_line = Instant::now();
    let mut failed = 0u64;
    let mut stop = false;
    let total = a.seeds;
    let batch = tokio::task::block_in_place(|| {
        run_batch(a.from, a.seeds, &cfg, |done, r| {
            if !r.passed() {
                failed += 1;
                let text = r.failure_text();
                match &pb {
                    Some(pb) => pb.suspend(|| eprintln!("{text}")),
                    None => eprintln!("{text}"),
                }
                if a.fail_fast {
                    stop = true;
                }
            }
            match &pb {
                Some(pb) => {
                    pb.set_position(done);
                    pb.set_message(format!("{failed} failing"));
                }
                None => {
                    if last_line.elapsed() >= Duration::from_secs(5) || done == total {
                        last_line = Instant::now();
                        let rate = done as f64 / started.elapsed().as_secs_f64().max(1e-9);
                        eprintln!(
                            "weft sim: {done}/{total} seeds, {rate:.1} seeds/s, {failed} failing"
                        );
                    }
                }
            }
            !stop
        })
    })
    .map_err(anyhow::Error::msg)?;
    if let Some(pb) = &pb {
        pb.finish_and_clear();
    }
    let violations = batch.violations();
    println!(
        "weft sim: {} seeds from {} in {:.1} s: {:.1} seeds/s, {:.0} simulated s per wall s, \
         {} violation(s) in {} seed(s)",
        batch.seeds,
        a.from,
        batch.wall_secs,
        batch.seeds_per_s(),
        batch.sim_speed(),
        violations,
        batch.failures.len()
    );
    print!("{}", batch.coverage);
    for f in &batch.failures {
        println!(
            "failing seed {}: replay with `weft sim --seeds 1 --from {} --trace`",
            f.seed, f.seed
        );
    }
    if let Some(path) = &a.json {
        let cov = &batch.coverage;
        let report = serde_json::json!({
            "seeds": batch.seeds,
            "from": a.from,
            "nodes": a.nodes,
            "calm": a.calm,
            "violations": violations,
            "failing_seeds": batch.failures.iter().map(|f| f.seed).collect::<Vec<_>>(),
            "failures": batch.failures.iter().map(|f| serde_json::json!({
                "seed": f.seed,
                "violations": f.violations.iter().map(|v| v.to_string()).collect::<Vec<_>>(),
            })).collect::<Vec<_>>(),
            "wall_s": batch.wall_secs,
            "seeds_per_s": batch.seeds_per_s(),
            "sim_s_per_wall_s": batch.sim_speed(),
            "sim_s": cov.sim_micros as f64 / 1e6,
            "committed": cov.committed,
            "aborted": cov.aborted,
            "unknown": cov.unknown,
            "checks": cov.checks,
            "audits": cov.audits,
            "recoveries": cov.recoveries,
            "crash_points": CrashPoint::ALL.iter().map(|p| (p.name().to_string(),
                serde_json::json!({
                    "crashed": cov.crash_points.get(p).copied().unwrap_or(0),
                    "reached": cov.points_reached.get(p).copied().unwrap_or(0),
                }))).collect::<serde_json::Map<_, _>>(),
            "faults": FaultKind::ALL.iter().map(|k| (k.name().to_string(),
                serde_json::json!(cov.faults.get(k).copied().unwrap_or(0))))
                .collect::<serde_json::Map<_, _>>(),
            "coverage_gaps": cov.gaps(),
        });
        std::fs::write(path, serde_json::to_string_pretty(&report)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    if violations > 0 {
        bail!(
            "{violations} violation(s) in {} seed(s)",
            batch.failures.len()
        );
    }
    Ok(())
}
