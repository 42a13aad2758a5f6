//! The log benchmark behind `weft bench log`: raw fdatasync rate of a disk versus durable
//! appends per second through the log at 1, 8 and 64 concurrent appenders.
//!
//! Owns: the measurement loops and the [`LogBenchReport`]. Must never: print (the CLI does;
//! progress goes through the callback), or leave files behind in the directory it was given.

use std::fs::{self, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::config::{LogConfig, DEFAULT_GROUP_COMMIT_MAX_DELAY};
use crate::error::{LogError, Result};
use crate::log::Log;
use crate::lsn::RecordTag;

/// Concurrency levels measured, in order.
pub const LEVELS: [usize; 3] = [1, 8, 64];
/// Tag of the records the benchmark appends.
const BENCH_TAG: RecordTag = RecordTag(0xBE00);

/// What to measure and for how long.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct BenchOptions {
    /// How long to measure raw write+fdatasync of a plain file. Default 1 s.
    pub fsync_duration: Duration,
    /// Upper bound on raw fdatasyncs (stops early on very fast disks). Default 200 000.
    pub fsync_max_iterations: u64,
    /// How long to run each concurrency level. Default 1 s.
    pub level_duration: Duration,
    /// Payload bytes per record (and bytes per raw write). Default 100.
    pub record_size: usize,
    /// `group_commit_max_delay` of the log under test. Default: the log's default.
    pub group_commit_max_delay: Duration,
    /// Executor threads driving the appenders. Default 2.
    pub worker_threads: usize,
}

impl Default for BenchOptions {
    fn default() -> BenchOptions {
        BenchOptions {
            fsync_duration: Duration::from_secs(1),
            fsync_max_iterations: 200_000,
            level_duration: Duration::from_secs(1),
            record_size: 100,
            group_commit_max_delay: DEFAULT_GROUP_COMMIT_MAX_DELAY,
            worker_threads: 2,
        }
    }
}

/// Results of one benchmark run. Every rate is per second of wall-clock time; ratios compare
/// numbers of the same run, the meaningful figures on a shared machine.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct LogBenchReport {
    /// Raw rate of "write `record_size` bytes at the end of a plain file, fdatasync".
    pub fsync_per_s: f64,
    /// Mean latency of one such write+fdatasync, in microseconds.
    pub fsync_mean_us: f64,
    /// Durable appends per second with 1 appender (append, force, repeat).
    pub durable_appends_per_s_1: f64,
    /// Durable appends per second with 8 concurrent appenders.
    pub durable_appends_per_s_8: f64,
    /// Durable appends per second with 64 concurrent appenders.
    pub durable_appends_per_s_64: f64,
    /// fdatasyncs per record with 1 appender (about 1: nothing to share).
    pub forces_per_record_1: f64,
    /// fdatasyncs per record with 8 appenders.
    pub forces_per_record_8: f64,
    /// fdatasyncs per record with 64 appenders (group commit drives it far below 1).
    pub forces_per_record_64: f64,
    /// Mean append-to-durable latency with 1 appender, in microseconds.
    pub mean_latency_us_1: f64,
    /// Mean append-to-durable latency with 8 appenders, in microseconds.
    pub mean_latency_us_8: f64,
    /// Mean append-to-durable latency with 64 appenders, in microseconds.
    pub mean_latency_us_64: f64,
    /// `durable_appends_per_s_64 / fsync_per_s`: what group commit buys (expected >= 8).
    pub group_commit_gain_64: f64,
    /// Payload bytes per record.
    pub record_size: usize,
    /// Seconds each level ran.
    pub level_duration_s: f64,
}

/// Runs the whole benchmark in `dir` (created if missing; everything it writes there is
/// removed again) and reports the figures. Quiet; see [`run_with_progress`].
///
/// Errors: [`LogError::Io`] if the directory or the probe file cannot be written, or any log
/// error from the log under test.
pub fn run(dir: &Path, opts: BenchOptions) -> Result<LogBenchReport> {
    run_with_progress(dir, opts, &mut |_| {})
}

/// [`run`], calling `progress` with a one-line message before each phase and after it.
///
/// Errors: as [`run`].
pub fn run_with_progress(
    dir: &Path,
    opts: BenchOptions,
    progress: &mut dyn FnMut(&str),
) -> Result<LogBenchReport> {
    fs::create_dir_all(dir)
        .map_err(|e| LogError::io(format!("creating bench directory {}", dir.display()), e))?;
    let mut report = LogBenchReport {
        record_size: opts.record_size,
        level_duration_s: opts.level_duration.as_secs_f64(),
        ..LogBenchReport::default()
    };

    progress("measuring raw write+fdatasync");
    let (per_s, mean_us) = raw_fsync_rate(dir, &opts)?;
    report.fsync_per_s = per_s;
    report.fsync_mean_us = mean_us;
    progress(&format!(
        "raw fdatasync: {per_s:.0}/s, {mean_us:.1} µs each"
    ));

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(opts.worker_threads.max(1))
        .enable_all()
        .build()
        .map_err(|e| LogError::io("starting the benchmark runtime", e))?;
    for level in LEVELS {
        progress(&format!("{level} concurrent appenders"));
        let r = runtime.block_on(durable_appends(dir, &opts, level))?;
        progress(&format!(
            "{level} appenders: {:.0} durable appends/s, {:.3} syncs/record, {:.0} µs mean",
            r.per_s, r.syncs_per_record, r.mean_latency_us
        ));
        match level {
            1 => {
                report.durable_appends_per_s_1 = r.per_s;
                report.forces_per_record_1 = r.syncs_per_record;
                report.mean_latency_us_1 = r.mean_latency_us;
            }
            8 => {
                report.durable_appends_per_s_8 = r.per_s;
                report.forces_per_record_8 = r.syncs_per_record;
                report.mean_latency_us_8 = r.mean_latency_us;
            }
            _ => {
                report.durable_appends_per_s_64 = r.per_s;
                report.forces_per_record_64 = r.syncs_per_record;
                report.mean_latency_us_64 = r.mean_latency_us;
            }
        }
    }
    if report.fsync_per_s > 0.0 {
        report.group_commit_gain_64 = report.durable_appends_per_s_64 / report.fsync_per_s;
    }
    Ok(report)
}

/// Appends `record_size` bytes to a plain file and fdatasyncs, repeatedly; returns
/// (syncs per second, mean microseconds per write+sync).
fn raw_fsync_rate(dir: &Path, opts: &BenchOptions) -> Result<(f64, f64)> {
    let path = dir.join("fsync-probe.dat");
    let ctx = |e| LogError::io(format!("probing fdatasync with {}", path.display()), e);
    let file = OpenOptions::new()
        .create(true)
        .truncate(true)
        .read(true)
        .write(true)
        .open(&path)
        .map_err(ctx)?;
    let record = vec![0x5Au8; opts.record_size.max(1)];
    let started = Instant::now();
    let mut n = 0u64;
    let result = (|| {
        while n < opts.fsync_max_iterations.max(1)
            && (n == 0 || started.elapsed() < opts.fsync_duration)
        {
            file.write_all_at(&record, n * record.len() as u64)?;
            file.sync_data()?;
            n += 1;
        }
        Ok(())
    })();
    let elapsed = started.elapsed().as_secs_f64();
    drop(file);
    let _ = fs::remove_file(&path);
    result.map_err(ctx)?;
    Ok((n as f64 / elapsed, elapsed * 1e6 / n as f64))
}

/// Figures of one concurrency level.
struct LevelResult {
    per_s: f64,
    syncs_per_record: f64,
    mean_latency_us: f64,
}

/// Runs `appenders` tasks that each append a record and force it, in a loop, for
/// `level_duration`, against a fresh log in a subdirectory of `dir`.
async fn durable_appends(dir: &Path, opts: &BenchOptions, appenders: usize) -> Result<LevelResult> {
    let sub = dir.join(format!("log-bench-{appenders}"));
    let _ = fs::remove_dir_all(&sub);
    let config = LogConfig::new(&sub).group_commit_max_delay(opts.group_commit_max_delay);
    let (log, _) = Log::open(config)?;
    let payload: Arc<[u8]> = vec![0xA5u8; opts.record_size].into();
    let before = log.stats();
    let started = Instant::now();
    let deadline = started + opts.level_duration;

    let mut tasks = Vec::with_capacity(appenders);
    for _ in 0..appenders {
        let log = log.clone();
        let payload = Arc::clone(&payload);
        tasks.push(tokio::spawn(async move {
            let mut done = 0u64;
            let mut latency = Duration::ZERO;
            while Instant::now() < deadline {
                let t = Instant::now();
                let lsn = log.append(BENCH_TAG, &payload)?;
                log.force(lsn).await?;
                latency += t.elapsed();
                done += 1;
            }
            Ok::<_, LogError>((done, latency))
        }));
    }
    let mut records = 0u64;
    let mut latency = Duration::ZERO;
    let mut failure = None;
    for task in tasks {
        match task.await {
            Ok(Ok((n, l))) => {
                records += n;
                latency += l;
            }
            Ok(Err(e)) => failure = Some(e),
            Err(join) => {
                failure = Some(LogError::io(
                    "running a benchmark appender",
                    std::io::Error::other(join.to_string()),
                ))
            }
        }
    }
    let elapsed = started.elapsed().as_secs_f64();
    let delta = log.stats().since(&before);
    let closed = log.close();
    drop(log);
    let _ = fs::remove_dir_all(&sub);
    if let Some(e) = failure {
        return Err(e);
    }
    closed?;
    Ok(LevelResult {
        per_s: records as f64 / elapsed,
        syncs_per_record: delta.syncs_per_append(),
        mean_latency_us: if records == 0 {
            0.0
        } else {
            latency.as_secs_f64() * 1e6 / records as f64
        },
    })
}
