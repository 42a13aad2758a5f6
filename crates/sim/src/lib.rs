//! # weft-sim: deterministic simulation of a whole weft cluster
//!
//! One thread, one seed, a whole cluster: several nodes, each with weft's real transaction
//! manager core ([`weft_tx::TmCore`]: every commit-protocol decision of the node, recovery
//! included; the simulator only drives it, as `weft_tx::manager` does on a real node), the
//! real KV store and lock table (`weft_kv`), the real log ([`weft_log::Log`]) on a simulated
//! disk ([`weft_log::MemDisk`]) and the real log recovery and KV snapshot code on every
//! restart.
//! Around them: simulated time, a network that drops, duplicates, delays and reorders
//! messages and cuts links (partitions that heal), crashes of any node at random instants and
//! at the named crash points of the commit protocol, and disks that lose unsynced writes,
//! tear the last one, undo unsynced directory entries and fail fsyncs (a failed fsync stops
//! the node, as the poisoned log does).
//!
//! Two workloads run at once: a Jepsen-style bank (transfers between accounts held by
//! different nodes, and read-only checks that read every account and must see the constant
//! total) and Raid's DebitCredit written to every replica (read-one-write-all), audited on
//! every replica after each commit and at the end.
//!
//! Checkers ([`check`]): atomicity (no transaction committed at one node and aborted at
//! another), durability (every acknowledged commit, and every commit applied anywhere, is in
//! the final state of every node it wrote, exactly once; checked against a model replaying
//! the committed transactions), isolation (read-only checks see balanced totals; the
//! DebitCredit audit), liveness (after faults heal, every transaction ends: no branch in
//! doubt, no lock or prepared write set left, every client answered or dead with its node).
//! A failure prints the seed and the event history; the same seed replays the same run.
//!
//! ## Why our own simulator and not madsim or turmoil
//!
//! madsim and turmoil simulate tokio (time, tasks, sockets) so that async code runs
//! deterministically. weft's protocol cores are already sans-IO state machines
//! (`step(event) -> actions`), as in `weft_group::core::sim`, so a simulator only has to feed
//! them events: no executor to replace, no async code to make deterministic, and full control
//! of the interleaving (a seeded event queue). Under madsim the async `TxManager`, rpc and
//! transport would run too, but every sleep and spawn of theirs would multiply the events per
//! seed, and the log's flusher thread would still need this crate's disk seam. What the simulator must own anyway — the disk
//! that loses unsynced writes, crash points inside the protocol, the checkers — neither crate
//! provides. A plain event loop is also fast: hundreds of seeds per minute.
//!
//! ## Determinism
//!
//! Every choice comes from one ChaCha8 generator seeded by the seed. The real log runs its
//! flusher thread, but the simulator only ever waits for it synchronously (every force is a
//! `force_blocking`, no lazy or timed syncs), so what is on the simulated disk at a crash is a
//! function of the seed. Collections iterated by the simulator are ordered.

#![deny(missing_docs)]

pub mod check;
mod config;
mod report;
mod world;

use std::time::Instant;

pub use config::{Sabotage, SimConfig};
pub use report::{Coverage, CrashPoint, FaultKind, SeedReport, Violation};

/// Runs one seed and checks it. Never panics on a protocol failure: violations are in the
/// report. Fails only when `cfg` is invalid.
pub fn run_seed(seed: u64, cfg: &SimConfig) -> Result<SeedReport, String> {
    cfg.validate()?;
    Ok(world::Sim::new(seed, cfg.clone()).run(seed))
}

/// The result of many seeds.
#[derive(Clone, Debug, Default)]
pub struct BatchReport {
    /// Seeds run.
    pub seeds: u64,
    /// Reports of the seeds that failed.
    pub failures: Vec<SeedReport>,
    /// Coverage summed over every seed.
    pub coverage: Coverage,
    /// Wall-clock seconds the batch took.
    pub wall_secs: f64,
}

impl BatchReport {
    /// Violations over all seeds.
    pub fn violations(&self) -> usize {
        self.failures.iter().map(|f| f.violations.len()).sum()
    }

    /// Seeds per wall-clock second.
    pub fn seeds_per_s(&self) -> f64 {
        self.seeds as f64 / self.wall_secs.max(1e-9)
    }

    /// Simulated seconds per wall-clock second.
    pub fn sim_speed(&self) -> f64 {
        self.coverage.sim_micros as f64 / 1e6 / self.wall_secs.max(1e-9)
    }
}

/// Runs seeds `from..from + count`, calling `progress(done, report)` after each; stops early
/// when it returns false. Fails only when `cfg` is invalid.
pub fn run_batch(
    from: u64,
    count: u64,
    cfg: &SimConfig,
    mut progress: impl FnMut(u64, &SeedReport) -> bool,
) -> Result<BatchReport, String> {
    cfg.validate()?;
    let started = Instant::now();
    let mut out = BatchReport::default();
    for (done, seed) in (from..from.saturating_add(count)).enumerate() {
        let r = world::Sim::new(seed, cfg.clone()).run(seed);
        out.coverage.merge(&r.coverage);
        out.seeds += 1;
        let go_on = progress(done as u64 + 1, &r);
        if !r.passed() {
            out.failures.push(r);
        }
        if !go_on {
            break;
        }
    }
    out.wall_secs = started.elapsed().as_secs_f64();
    Ok(out)
}
