//! Runs the group benchmark and prints its JSON report (what `weft bench
//! group` wraps): `cargo run --release -p weft-group --example group_bench
//! [iterations] [tcp|inproc]`.

#[tokio::main(flavor = "multi_thread")]
async fn main() {
    let iterations = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(2000);
    let channel = match std::env::args().nth(2).as_deref() {
        Some("inproc") => weft_group::bench::BenchChannel::Inproc,
        _ => weft_group::bench::BenchChannel::Tcp,
    };
    let opts = weft_group::bench::BenchOptions {
        iterations,
        channel,
        ..Default::default()
    };
    match weft_group::bench::bench(opts).await {
        Ok(r) => println!(
            "{}",
            serde_json::to_string_pretty(&r).expect("serializable")
        ),
        Err(f) => {
            eprintln!("group bench failed: {f}");
            std::process::exit(1);
        }
    }
}
