//! `weft bench log`: the log's durable append rate against the raw fdatasync
//! rate of the same disk, measured in the same run.

use std::path::PathBuf;
use std::time::Duration;

use serde_json::json;
use weft_log::bench::{run_with_progress, BenchOptions};

use super::{check, r2, write_json};
use crate::client::parse_duration;

/// Flags of `weft bench log`.
#[derive(clap::Args, Debug)]
pub struct LogArgs {
    /// Write the results as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Directory on the disk to measure (a temporary directory under it is
    /// used and removed). Default: the current directory.
    #[arg(long, default_value = ".")]
    pub dir: PathBuf,
    /// How long each phase runs.
    #[arg(long, default_value = "1s", value_parser = parse_duration)]
    pub phase: Duration,
}

/// Runs `weft bench log`.
pub async fn run(args: LogArgs) -> anyhow::Result<()> {
    let dir = tempfile::Builder::new()
        .prefix(".weft-bench-log-")
        .tempdir_in(&args.dir)?;
    let opts = BenchOptions {
        fsync_duration: args.phase,
        level_duration: args.phase,
        ..BenchOptions::default()
    };
    let path = dir.path().to_path_buf();
    let report = tokio::task::spawn_blocking(move || {
        let pb = super::progress("measuring");
        let r = run_with_progress(&path, opts, &mut |msg: &str| {
            pb.set_message(msg.to_string())
        });
        pb.finish_and_clear();
        r
    })
    .await??;
    println!(
        "weft bench log ({} byte records, {:?} per phase)",
        report.record_size, args.phase
    );
    println!(
        "{:<28} {:>14} {:>16} {:>14}",
        "configuration", "records/s", "syncs/record", "mean µs"
    );
    println!(
        "{:<28} {:>14.0} {:>16} {:>14.1}",
        "raw write+fdatasync", report.fsync_per_s, "1", report.fsync_mean_us
    );
    for (n, rate, fpr, lat) in [
        (
            1,
            report.durable_appends_per_s_1,
            report.forces_per_record_1,
            report.mean_latency_us_1,
        ),
        (
            8,
            report.durable_appends_per_s_8,
            report.forces_per_record_8,
            report.mean_latency_us_8,
        ),
        (
            64,
            report.durable_appends_per_s_64,
            report.forces_per_record_64,
            report.mean_latency_us_64,
        ),
    ] {
        println!(
            "{:<28} {:>14.0} {:>16.3} {:>14.1}",
            format!("log, {n} appenders"),
            rate,
            fpr,
            lat
        );
    }
    println!("targets:");
    let ok = check(
        "durable_appends_per_s_64 / fsync_per_s",
        report.group_commit_gain_64,
        ">=",
        8.0,
    );
    let mut value = serde_json::to_value(&report)?;
    value["target_met"] = json!(ok);
    value["group_commit_gain_64"] = json!(r2(report.group_commit_gain_64));
    if let Some(p) = &args.json {
        write_json(p, &value)?;
    }
    Ok(())
}
