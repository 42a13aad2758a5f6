//! `weft bench ...`: benchmarks that compare weft with a baseline measured in
//! the same run (raw TCP, the disk's fsync rate, PostgreSQL), print a table
//! and write JSON. Speed targets live here, never in tests.
//!
//! Owns the shared measuring tools (latency histograms, reports, progress).

pub mod commit;
mod dc_sweep;
pub mod debitcredit;
pub mod fs;
pub mod fs_run;
pub mod kvstore;
pub mod log;
pub mod net;
pub mod plot;
pub mod rpc;
pub mod rpc_shm;
pub mod soak;
pub mod state;

use std::path::Path;
use std::time::Duration;

use anyhow::Context;
use hdrhistogram::Histogram;
use indicatif::{ProgressBar, ProgressStyle};

/// `weft bench` subcommands.
#[derive(clap::Subcommand, Debug)]
pub enum BenchCmd {
    /// RPC latency: raw TCP (baseline), weft over TCP with and without a
    /// transaction, in-process.
    Rpc(rpc::RpcArgs),
    /// Log throughput: the disk's fdatasync rate (baseline), then durable
    /// appends with 1, 8 and 64 concurrent appenders (group commit).
    Log(log::LogArgs),
    /// Distributed commit throughput against PostgreSQL's two-phase commit.
    Commit(commit::CommitArgs),
    /// DebitCredit on Raid over weft at several site counts, against pgbench.
    Debitcredit(debitcredit::DebitCreditArgs),
    /// Group send and reply collection against unicast calls.
    Group(crate::group_cmd::BenchGroupArgs),
    /// DebitCredit for a long time: memory, throughput and checkpoint
    /// times over time, and an audit at the end.
    Soak(soak::SoakArgs),
    /// The Transactional Network Interface experiment (seed 001, section
    /// 3.2): tx/s of SMA and 2CA against a non-transactional baseline.
    Net(net::NetArgs),
    /// The KV disk engine at a small and a large size: checkpoint, reopen,
    /// random reads.
    Kvstore(kvstore::KvStoreArgs),
    /// Shared state (InterWeave): diffs vs deep copies, cached reads, the
    /// TMT's cost on a null RPC, a call chain over uncommitted updates.
    State(state::StateArgs),
    /// Transactional files against plain files (QuickSilver's Table 2):
    /// creating 100 small files, reading 256 KiB files.
    Fs(fs::FsArgs),
    /// The `weft run` part of `weft bench fs`: the null program and an
    /// Andrew-like script under `weft run` against running them plainly.
    FsRun(fs_run::FsRunArgs),
}

/// Runs a benchmark.
pub async fn run(cmd: BenchCmd) -> anyhow::Result<()> {
    match cmd {
        BenchCmd::Rpc(a) => rpc::run(a).await,
        BenchCmd::Log(a) => log::run(a).await,
        BenchCmd::Commit(a) => commit::run(a).await,
        BenchCmd::Debitcredit(a) => debitcredit::run(a).await,
        BenchCmd::Group(a) => crate::group_cmd::run_bench(a).await,
        BenchCmd::Soak(a) => soak::run(a).await,
        BenchCmd::Net(a) => net::run(a).await,
        BenchCmd::Kvstore(a) => kvstore::run(a).await,
        BenchCmd::State(a) => state::run(a).await,
        BenchCmd::Fs(a) => fs::run(a).await,
        BenchCmd::FsRun(a) => fs_run::run(a).await,
    }
}

/// A latency histogram recorded in nanoseconds (1 ns .. 60 s, 3 significant
/// digits) and reported in microseconds.
pub struct Latency(Histogram<u64>);

const MAX_NS: u64 = 60_000_000_000;

impl Default for Latency {
    fn default() -> Self {
        Latency(Histogram::new_with_bounds(1, MAX_NS, 3).expect("valid histogram bounds"))
    }
}

impl Latency {
    /// Records one sample.
    pub fn record(&mut self, d: Duration) {
        let ns = (d.as_nanos().min(MAX_NS as u128) as u64).max(1);
        self.0.record(ns).expect("value within bounds");
    }

    /// Adds another histogram's samples.
    pub fn merge(&mut self, other: &Latency) {
        self.0.add(&other.0).expect("same bounds");
    }

    /// Median in microseconds.
    pub fn p50(&self) -> f64 {
        r2(self.0.value_at_quantile(0.5) as f64 / 1000.0)
    }

    /// Median in nanoseconds, unrounded (for ratios of sub-microsecond
    /// figures, which two decimals of a microsecond would skew).
    pub fn p50_ns(&self) -> u64 {
        self.0.value_at_quantile(0.5)
    }

    /// 99th percentile in microseconds.
    pub fn p99(&self) -> f64 {
        r2(self.0.value_at_quantile(0.99) as f64 / 1000.0)
    }

    /// Number of samples.
    pub fn count(&self) -> u64 {
        self.0.len()
    }
}

/// A spinner with a message, for long phases.
pub fn progress(msg: &str) -> ProgressBar {
    let pb = ProgressBar::new_spinner();
    pb.set_style(
        ProgressStyle::with_template("{spinner} {msg} [{elapsed}]").expect("valid template"),
    );
    pb.set_message(msg.to_string());
    pb.enable_steady_tick(Duration::from_millis(120));
    pb
}

/// Writes a JSON report to `path` (pretty-printed).
pub fn write_json(path: &Path, value: &serde_json::Value) -> anyhow::Result<()> {
    let text = serde_json::to_string_pretty(value)?;
    std::fs::write(path, text + "\n").with_context(|| format!("writing {}", path.display()))?;
    eprintln!("wrote {}", path.display());
    Ok(())
}

/// Rounds to two decimals for reports.
pub fn r2(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}

/// Prints a target check line and returns whether it holds.
pub fn check(name: &str, value: f64, op: &str, bound: f64) -> bool {
    let ok = match op {
        "<=" => value <= bound,
        ">=" => value >= bound,
        "==" => (value - bound).abs() < 1e-9,
        _ => false,
    };
    println!(
        "  {} {name}: {:.3} {op} {:.3}",
        if ok { "PASS" } else { "MISS" },
        value,
        bound
    );
    ok
}
