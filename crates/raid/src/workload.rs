//! The DebitCredit workloads and the closed-loop clients that run them.
//!
//! `tpcb` is pgbench's TPC-B-like transaction over a database at some scale.
//! `raid` is the Raid paper's extended benchmark: relations of 100 tuples, a
//! hot spot of 20% of the tuples taking 80% of the accesses, on average 6
//! actions per transaction (variance 4), 10% of them updates, a closed
//! experiment, a timeout per action, and rolling-restart backoff: an aborted
//! transaction is restarted after the mean response time of the last few.
//! Owns request generation and client statistics. Must seed every random
//! choice.

use std::collections::{BTreeMap, VecDeque};
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};
use weft_wire::{Failure, Status};

use crate::ad::{Action, AdRequest};
use crate::schema::{Item, Relation, Sizes};

/// Which DebitCredit.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Mode {
    /// pgbench's TPC-B-like transaction.
    Tpcb,
    /// The Raid paper's extended parameters.
    Raid,
}

impl std::str::FromStr for Mode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "tpcb" => Ok(Mode::Tpcb),
            "raid" => Ok(Mode::Raid),
            other => Err(format!("unknown mode {other:?} (tpcb or raid)")),
        }
    }
}

impl std::fmt::Display for Mode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Mode::Tpcb => "tpcb",
            Mode::Raid => "raid",
        })
    }
}

/// The Raid benchmark's parameters.
pub const RAID_HOT_FRACTION: f64 = 0.2;
/// Share of accesses that go to the hot spot.
pub const RAID_HOT_ACCESS: f64 = 0.8;
/// Mean actions per transaction.
pub const RAID_MEAN_ACTIONS: f64 = 6.0;
/// Variance of actions per transaction.
pub const RAID_ACTION_VARIANCE: f64 = 4.0;
/// Share of actions that are updates.
pub const RAID_UPDATE_SHARE: f64 = 0.1;
/// Response times averaged for the rolling restart delay.
pub const RESTART_WINDOW: usize = 5;

/// Generates the transactions of a mode.
#[derive(Clone, Copy, Debug)]
pub struct Workload {
    /// Which DebitCredit.
    pub mode: Mode,
    /// Relation sizes.
    pub sizes: Sizes,
}

impl Workload {
    /// The sizes a mode needs at a tpcb scale.
    pub fn sizes(mode: Mode, scale: u32) -> Sizes {
        match mode {
            Mode::Tpcb => Sizes::tpcb(scale),
            Mode::Raid => Sizes::raid(),
        }
    }

    /// The next transaction.
    pub fn next(&self, rng: &mut ChaCha8Rng) -> AdRequest {
        match self.mode {
            Mode::Tpcb => AdRequest::Tpcb {
                aid: rng.gen_range(1..=self.sizes.accounts),
                teller: rng.gen_range(1..=self.sizes.tellers),
                branch: rng.gen_range(1..=self.sizes.branches),
                delta: rng.gen_range(-5000..=5000),
            },
            Mode::Raid => {
                // Normal(6, 2) by Box-Muller, rounded, at least one action.
                let (u1, u2): (f64, f64) = (rng.gen_range(f64::EPSILON..1.0), rng.gen());
                let z = (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos();
                let n = (RAID_MEAN_ACTIONS + RAID_ACTION_VARIANCE.sqrt() * z)
                    .round()
                    .clamp(1.0, 20.0) as usize;
                let actions = (0..n)
                    .map(|_| {
                        let rel = Relation::BALANCES[rng.gen_range(0..3)];
                        let size = self.sizes.of(rel).max(1);
                        let hot = ((size as f64 * RAID_HOT_FRACTION) as u64).max(1);
                        let key = if rng.gen_bool(RAID_HOT_ACCESS) || hot == size {
                            rng.gen_range(1..=hot)
                        } else {
                            rng.gen_range(hot + 1..=size)
                        };
                        let item = Item { rel, key };
                        if rng.gen_bool(RAID_UPDATE_SHARE) {
                            Action::Update(item, rng.gen_range(-100..=100))
                        } else {
                            Action::Read(item)
                        }
                    })
                    .collect();
                AdRequest::Raid { actions }
            }
        }
    }
}

/// What the clients of one run measured.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct RunReport {
    /// Which DebitCredit.
    pub mode: String,
    /// Concurrent clients.
    pub clients: usize,
    /// Seconds measured.
    pub duration_s: f64,
    /// Transactions committed.
    pub committed: u64,
    /// Attempts, aborted ones included.
    pub attempts: u64,
    /// Committed transactions per second.
    pub tps: f64,
    /// Median response time of committed transactions, µs (restarts
    /// included: from first attempt to commit).
    pub p50_us: f64,
    /// 99th percentile, µs.
    pub p99_us: f64,
    /// Mean, µs.
    pub mean_us: f64,
    /// Aborted attempts by the status that ended them.
    pub aborts: BTreeMap<String, u64>,
    /// The first failure message seen for each status (diagnostics).
    pub abort_samples: BTreeMap<String, String>,
}

struct ClientOutcome {
    hist: Histogram<u64>,
    committed: u64,
    attempts: u64,
    aborts: BTreeMap<String, u64>,
    samples: BTreeMap<String, String>,
}

fn histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 600_000_000, 3).expect("valid histogram bounds")
}

/// Runs `clients` closed-loop clients for `duration`: client `i` sends its
/// transactions to `runners[i % runners.len()]` and restarts an aborted one
/// (same operations, new transaction) after the mean response time of its
/// last few commits; one that ended InDoubt (it may have committed) is not
/// run again. `progress` counts commits as they happen.
pub async fn run_closed<R, F>(
    runners: Vec<R>,
    workload: Workload,
    clients: usize,
    duration: Duration,
    seed: u64,
    progress: Arc<AtomicU64>,
) -> RunReport
where
    R: Fn(AdRequest) -> F + Clone + Send + Sync + 'static,
    F: Future<Output = Result<i64, Failure>> + Send + 'static,
{
    assert!(!runners.is_empty(), "at least one runner");
    let stop = Instant::now() + duration;
    let started = Instant::now();
    let mut tasks = Vec::new();
    for i in 0..clients {
        let run = runners[i % runners.len()].clone();
        let progress = progress.clone();
        let mut rng = ChaCha8Rng::seed_from_u64(seed.wrapping_add(i as u64 * 0x9e37_79b9));
        tasks.push(tokio::spawn(async move {
            let mut out = ClientOutcome {
                hist: histogram(),
                committed: 0,
                attempts: 0,
                aborts: BTreeMap::new(),
                samples: BTreeMap::new(),
            };
            let mut recent: VecDeque<Duration> = VecDeque::new();
            while Instant::now() < stop {
                let req = workload.next(&mut rng);
                let first_try = Instant::now();
                loop {
                    out.attempts += 1;
                    let t = Instant::now();
                    match run(req.clone()).await {
                        Ok(_) => {
                            out.committed += 1;
                            progress.fetch_add(1, Ordering::Relaxed);
                            let us = first_try.elapsed().as_micros().clamp(1, 600_000_000) as u64;
                            let _ = out.hist.record(us);
                            if recent.len() == RESTART_WINDOW {
                                recent.pop_front();
                            }
                            recent.push_back(t.elapsed());
                            break;
                        }
                        Err(f) => {
                            *out.aborts.entry(f.status.to_string()).or_default() += 1;
                            out.samples
                                .entry(f.status.to_string())
                                .or_insert_with(|| f.detail.clone());
                            // An InDoubt transaction may have committed:
                            // running it again could apply it twice.
                            if Instant::now() >= stop || f.status == Status::InDoubt {
                                break;
                            }
                            // Rolling restart: wait the mean response time of
                            // the last few transactions, then try again.
                            let delay = if recent.is_empty() {
                                Duration::from_millis(1)
                            } else {
                                recent.iter().sum::<Duration>() / recent.len() as u32
                            };
                            tokio::time::sleep(delay.min(Duration::from_secs(1))).await;
                        }
                    }
                }
            }
            out
        }));
    }
    let mut hist = histogram();
    let (mut committed, mut attempts) = (0, 0);
    let mut aborts = BTreeMap::new();
    let mut abort_samples = BTreeMap::new();
    for t in tasks {
        if let Ok(o) = t.await {
            hist.add(&o.hist).expect("same bounds");
            committed += o.committed;
            attempts += o.attempts;
            for (k, v) in o.aborts {
                *aborts.entry(k).or_default() += v;
            }
            for (k, v) in o.samples {
                abort_samples.entry(k).or_insert(v);
            }
        }
    }
    let secs = started.elapsed().as_secs_f64();
    RunReport {
        mode: workload.mode.to_string(),
        clients,
        duration_s: secs,
        committed,
        attempts,
        tps: committed as f64 / secs,
        p50_us: hist.value_at_quantile(0.5) as f64,
        p99_us: hist.value_at_quantile(0.99) as f64,
        mean_us: hist.mean(),
        aborts,
        abort_samples,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn raid_mode_matches_the_papers_parameters() {
        let w = Workload {
            mode: Mode::Raid,
            sizes: Sizes::raid(),
        };
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        let (mut actions, mut updates, mut hot, mut txs) = (0usize, 0usize, 0usize, 0usize);
        for _ in 0..5000 {
            let AdRequest::Raid { actions: a } = w.next(&mut rng) else {
                unreachable!()
            };
            txs += 1;
            actions += a.len();
            for x in &a {
                let item = match x {
                    Action::Read(i) => i,
                    Action::Update(i, _) => {
                        updates += 1;
                        i
                    }
                };
                assert!((1..=100).contains(&item.key));
                if item.key <= 20 {
                    hot += 1;
                }
            }
        }
        let mean = actions as f64 / txs as f64;
        assert!((5.7..6.3).contains(&mean), "mean actions {mean}");
        let upd = updates as f64 / actions as f64;
        assert!((0.08..0.12).contains(&upd), "update share {upd}");
        let h = hot as f64 / actions as f64;
        assert!((0.77..0.83).contains(&h), "hot-spot share {h}");
    }

    #[test]
    fn tpcb_stays_in_range() {
        let w = Workload {
            mode: Mode::Tpcb,
            sizes: Sizes::tpcb(2),
        };
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        for _ in 0..1000 {
            let AdRequest::Tpcb {
                aid,
                teller,
                branch,
                delta,
            } = w.next(&mut rng)
            else {
                unreachable!()
            };
            assert!(
                (1..=200_000).contains(&aid)
                    && (1..=20).contains(&teller)
                    && (1..=2).contains(&branch)
            );
            assert!((-5000..=5000).contains(&delta));
        }
    }
}
