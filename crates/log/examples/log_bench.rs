//! Runs the log benchmark once and prints its JSON report.
//!
//! `cargo run --release -p weft-log --example log_bench -- [DIR] [SECONDS_PER_PHASE]`
//! (DIR defaults to a fresh temporary directory; SECONDS_PER_PHASE to 1).

use std::time::Duration;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let tmp = tempfile::tempdir()?;
    let dir = args
        .next()
        .map_or_else(|| tmp.path().to_path_buf(), Into::into);
    let secs: f64 = args.next().map_or(Ok(1.0), |s| s.parse())?;
    let opts = weft_log::bench::BenchOptions {
        fsync_duration: Duration::from_secs_f64(secs),
        level_duration: Duration::from_secs_f64(secs),
        ..Default::default()
    };
    let report = weft_log::bench::run_with_progress(&dir, opts, &mut |msg| eprintln!("{msg}"))?;
    println!("{}", serde_json::to_string_pretty(&report)?);
    Ok(())
}
