//! The `weft` command line: run nodes, inspect clusters, drive transactions
//! from a shell, run the demo and the benchmarks.

mod bench;
mod call_cmd;
mod child;
mod client;
mod cpu;
mod demo;
mod fs_cmd;
mod group_cmd;
mod kv_cmd;
mod net_cmd;
mod node_cmd;
#[cfg(feature = "otel")]
mod otel;
mod raid_acks;
mod raid_cmd;
mod run;
mod sim_cmd;
mod state_cmd;
mod status_cmd;
mod tls_cmd;
mod top_cmd;
mod tx_cmd;

use clap::{Parser, Subcommand};

/// mimalloc instead of glibc's malloc: a node's memory is set by its bounded caches and
/// overlays, and glibc's per-thread arenas kept about a third of a soak's RSS as freed memory
/// never returned (docs/kv-storage.md, "Soak memory"); mimalloc returns freed pages.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// weft: a transactional fabric for distributed programs.
#[derive(Parser, Debug)]
#[command(name = "weft", version, about, long_about = None)]
struct Cli {
    /// Log filter (tracing env-filter syntax), e.g. `info` or `weft_tx=debug`.
    #[arg(long, global = true, env = "WEFT_LOG", default_value = "warn")]
    log: String,
    /// Export tracing spans over OTLP/HTTP to this collector URL (e.g.
    /// http://127.0.0.1:4318/v1/traces); built with the `otel` feature.
    #[cfg(feature = "otel")]
    #[arg(long, global = true, env = "WEFT_OTLP_ENDPOINT")]
    otlp: Option<String>,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// The main job: Raid on weft, DebitCredit, an audit of every copy.
    Demo(demo::DemoArgs),
    /// Run a node until SIGINT/SIGTERM.
    Node(node_cmd::NodeArgs),
    /// Show the cluster as one node sees it.
    Status(status_cmd::StatusArgs),
    /// A live view of the cluster: rates, transactions, links.
    Top(top_cmd::TopArgs),
    /// Call a service once (diagnostics).
    Call(call_cmd::CallArgs),
    /// Begin, commit, abort and inspect transactions.
    #[command(subcommand)]
    Tx(tx_cmd::TxCmd),
    /// Read and write a node's key-value store.
    #[command(subcommand)]
    Kv(kv_cmd::KvCmd),
    /// Read and change a node's transactional file volumes.
    #[command(subcommand)]
    Fs(fs_cmd::FsCmd),
    /// Run Raid sites and drive DebitCredit against them.
    #[command(subcommand)]
    Raid(raid_cmd::RaidCmd),
    /// Create, join, send to and list process groups.
    Group(group_cmd::GroupArgs),
    /// Certificates for mutual TLS between nodes and clients.
    #[command(subcommand)]
    Tls(tls_cmd::TlsCmd),
    /// Deterministic whole-cluster simulation under many seeds (faults, crashes, checkers).
    Sim(sim_cmd::SimArgs),
    /// Benchmarks against same-run baselines.
    #[command(subcommand)]
    Bench(bench::BenchCmd),
    /// Transactional TCP to unmodified peers: the 2CA proxy logger, its
    /// connections.
    #[command(subcommand)]
    Net(net_cmd::NetCmd),
    /// Shared state segments: list, print, watch.
    #[command(subcommand)]
    State(state_cmd::StateCmd),
    /// Run a program under a default transaction: its changes in --fs
    /// directories (and its weft commands) commit when it exits 0.
    Run(run::RunArgs),
    /// Named leases held for a process (`weft run`), released when it ends.
    #[command(subcommand)]
    Lease(run::LeaseCmd),
}

fn main() {
    // `weft bench rpc` re-runs this binary as its shared-memory helper
    // process (a hidden mode, before any argument parsing).
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some(weft_transport::shm::bench::PEER_ARG) {
        std::process::exit(weft_transport::shm::bench::peer_main(args[2..].to_vec()));
    }
    let cli = Cli::parse();
    // The simulator crashes nodes thousands of times a second: their logs' own error lines
    // would drown its report, so it is quiet unless a filter is asked for.
    let filter = match (&cli.cmd, cli.log.as_str()) {
        (Cmd::Sim(_), "warn") => "off",
        (_, f) => f,
    };
    use tracing_subscriber::layer::SubscriberExt;
    #[cfg(not(feature = "otel"))]
    use tracing_subscriber::util::SubscriberInitExt;
    use tracing_subscriber::Layer;
    let logs = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_filter(
            tracing_subscriber::EnvFilter::try_new(filter).unwrap_or_else(|_| "warn".into()),
        );
    let registry = tracing_subscriber::registry().with(logs);
    #[cfg(feature = "otel")]
    let otel = otel::install(registry, cli.otlp.as_deref());
    #[cfg(not(feature = "otel"))]
    registry.init();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    let result = runtime.block_on(async move {
        match cli.cmd {
            Cmd::Demo(a) => demo::run(a).await,
            Cmd::Node(a) => node_cmd::run(a).await,
            Cmd::Raid(c) => raid_cmd::run(c).await,
            Cmd::Status(a) => status_cmd::run(a).await,
            Cmd::Top(a) => top_cmd::run(a).await,
            Cmd::Call(a) => call_cmd::run(a).await,
            Cmd::Tx(c) => tx_cmd::run(c).await,
            Cmd::Kv(c) => kv_cmd::run(c).await,
            Cmd::Fs(c) => fs_cmd::run(c).await,
            Cmd::Group(a) => group_cmd::run(a).await,
            Cmd::Bench(c) => bench::run(c).await,
            Cmd::Net(c) => net_cmd::run(c).await,
            Cmd::Sim(a) => sim_cmd::run(a).await,
            Cmd::State(c) => state_cmd::run(c).await,
            Cmd::Run(a) => run::run(a).await,
            Cmd::Lease(c) => run::lease_cmd(c).await,
            Cmd::Tls(c) => tls_cmd::run(c).await,
        }
    });
    runtime.shutdown_timeout(std::time::Duration::from_millis(200));
    #[cfg(feature = "otel")]
    drop(otel); // sends the spans still batched
    if let Err(e) = result {
        let code = client::exit_code_of(&e);
        eprintln!("weft: {e:#}");
        std::process::exit(code);
    }
}
