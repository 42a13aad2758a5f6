//! The simulator's batches: a small one on every `cargo test`, CI's larger one (ignored by
//! default), determinism of a seed, and proof that the checkers catch planted bugs.
//!
//! CI's batch: `cargo test --release -p weft-sim --test batch -- --ignored --nocapture`
//! (about 3 minutes on a 2-vCPU machine; it prints coverage and fails if a crash point or a
//! disk fault kind was never reached).

use weft_sim::{run_batch, run_seed, BatchReport, Sabotage, SimConfig};

fn batch(from: u64, count: u64, cfg: &SimConfig) -> BatchReport {
    run_batch(from, count, cfg, |_, r| {
        if !r.passed() {
            eprintln!("{}", r.failure_text());
        }
        true
    })
    .expect("valid configuration")
}

fn summary(b: &BatchReport) -> String {
    format!(
        "{} seeds in {:.1} s ({:.1} seeds/s, {:.0} simulated s per wall s), {} violation(s)\n{}",
        b.seeds,
        b.wall_secs,
        b.seeds_per_s(),
        b.sim_speed(),
        b.violations(),
        b.coverage
    )
}

#[test]
fn twenty_seeds_of_the_full_fault_mix_pass() {
    let b = batch(1_000, 20, &SimConfig::default());
    println!("{}", summary(&b));
    let failing: Vec<u64> = b.failures.iter().map(|f| f.seed).collect();
    assert!(failing.is_empty(), "failing seeds {failing:?}");
    assert!(
        b.coverage.committed > 0,
        "nothing committed:\n{}",
        summary(&b)
    );
    assert!(b.coverage.recoveries > 20 * 3, "no node ever restarted");
}

#[test]
fn a_calm_cluster_commits_most_work_and_checks_balanced_totals() {
    let b = batch(0, 5, &SimConfig::calm());
    println!("{}", summary(&b));
    assert_eq!(b.violations(), 0);
    let c = &b.coverage;
    assert!(c.checks > 0 && c.audits > 0, "{}", summary(&b));
    assert!(
        c.committed * 3 > c.aborted,
        "without faults most transactions should commit:\n{}",
        summary(&b)
    );
    assert_eq!(c.unknown, 0, "no client dies without crashes");
}

#[test]
fn a_seed_replays_exactly() {
    let cfg = SimConfig::default();
    for seed in [3, 17, 40, 41, 99] {
        let a = run_seed(seed, &cfg).unwrap();
        let b = run_seed(seed, &cfg).unwrap();
        assert_eq!(a.coverage, b.coverage, "seed {seed}: coverage differs");
        assert_eq!(a.history, b.history, "seed {seed}: histories differ");
        assert_eq!(a.violations, b.violations, "seed {seed}");
    }
}

#[test]
fn skipping_the_prepare_force_is_caught() {
    let cfg = SimConfig {
        sabotage: Sabotage::SkipPrepareForce,
        ..SimConfig::default()
    };
    let b = run_batch(0, 200, &cfg, |_, r| r.passed()).unwrap();
    let f = b
        .failures
        .first()
        .unwrap_or_else(|| panic!("200 seeds never caught a vote without a forced prepare record"));
    println!("caught at seed {}:\n{}", f.seed, f.failure_text());
    assert!(f.violations.iter().any(|v| matches!(
        v.property,
        "durability" | "atomicity" | "audit" | "isolation"
    )));
    // The failure replays from its seed.
    let again = run_seed(f.seed, &cfg).unwrap();
    assert_eq!(again.violations, f.violations);
}

#[test]
fn answering_commit_for_a_forgotten_transaction_is_caught() {
    let cfg = SimConfig {
        sabotage: Sabotage::CommitForgotten,
        ..SimConfig::default()
    };
    let b = run_batch(0, 200, &cfg, |_, r| r.passed()).unwrap();
    let f = b.failures.first().unwrap_or_else(|| {
        panic!("200 seeds never caught a Committed answer for an unknown transaction")
    });
    println!("caught at seed {}:\n{}", f.seed, f.failure_text());
}

/// CI's batch. Run: `cargo test --release -p weft-sim --test batch -- --ignored --nocapture`.
#[test]
#[ignore = "CI batch: about 3 minutes in a release build"]
fn ci_batch() {
    let seeds: u64 = std::env::var("WEFT_SIM_SEEDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(24_000);
    let b = run_batch(0, seeds, &SimConfig::default(), |done, r| {
        if !r.passed() {
            eprintln!("{}", r.failure_text());
        }
        if done % 2_000 == 0 {
            eprintln!("ci batch: {done}/{seeds} seeds");
        }
        true
    })
    .unwrap();
    println!("{}", summary(&b));
    let failing: Vec<u64> = b.failures.iter().map(|f| f.seed).take(20).collect();
    assert!(
        failing.is_empty(),
        "{} failing seeds, the first: {failing:?}",
        b.failures.len()
    );
    let gaps = b.coverage.gaps();
    assert!(gaps.is_empty(), "coverage gaps: {gaps:?}");
}
