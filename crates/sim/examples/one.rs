fn main() {
    let args: Vec<String> = std::env::args().collect();
    let from: u64 = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    let n: u64 = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(1);
    let trace = args.get(3).is_some();
    let base = if std::env::var("CALM").is_ok() {
        weft_sim::SimConfig::calm()
    } else {
        Default::default()
    };
    let cfg = weft_sim::SimConfig { trace, ..base };
    let b = weft_sim::run_batch(from, n, &cfg, |_, r| {
        if !r.passed() {
            println!("{}", r.failure_text());
        }
        true
    })
    .unwrap();
    println!(
        "{} seeds {:.2}s {:.1} seeds/s {:.1} sim-s/s violations {}",
        b.seeds,
        b.wall_secs,
        b.seeds_per_s(),
        b.sim_speed(),
        b.violations()
    );
    println!("{}", b.coverage);
}
