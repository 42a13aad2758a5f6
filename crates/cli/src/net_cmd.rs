//! `weft net`: the Transactional Network Interface from the command line:
//! run the 2CA proxy logger, list a proxy's connections, and a small
//! transactional line server (hidden; the crash tests drive it).
//!
//! Owns the mapping from flags to a proxy node and a server node. Must print
//! exactly one ready line on stdout once a process takes connections
//! (scripts and tests wait for it).

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use tokio::net::TcpListener;
use weft::{Failure, Node, NodeId, Seed, Transaction};
use weft_net::control::logger::{PauseHook, PausePoint};
use weft_net::sma::TxStream;
use weft_net::tca::proxy::{NetProxy, ProxyConfig, Undeliverable};
use weft_net::tca::server::ProxiedStream;
use weft_net::tca::{ConnInfo, NetRequest, NetResponse};
use weft_net::tla::logger::{TlaLogger, TlaLoggerConfig, TunSpec};
use weft_net::tla::server::TlaStream;
use weft_net::LoggerConfig;

use crate::client::{parse_duration, resolve, Client, ClientOpts};
use crate::node_cmd::{self, NodeArgs};

/// `weft net` subcommands.
#[derive(clap::Subcommand, Debug)]
pub enum NetCmd {
    /// Run the 2CA proxy logger: peers connect to --listen, each is relayed
    /// to --upstream; the server's transactions hold what it writes until
    /// they commit. The proxy is a weft node (the server joins its cluster).
    Proxy(ProxyArgs),
    /// Run the TLA transport-level logger: route IP packets between the
    /// peer's TUN device and the server's, holding the server's segments of
    /// a transaction until it commits (the TCP connection stays end to end).
    /// The logger is a weft node (the server joins its cluster).
    Tla(TlaArgs),
    /// List a proxy's (or TLA logger's) connections: state, held and logged
    /// bytes, counts.
    Ls(LsArgs),
    /// A transactional line server behind a proxy (tests and demos): each
    /// request line is answered with `ok <line>` in a transaction.
    #[command(hide = true)]
    Serve(ServeArgs),
}

/// Flags of `weft net proxy`.
#[derive(clap::Args, Debug)]
pub struct ProxyArgs {
    /// Where peers connect.
    #[arg(long)]
    pub listen: String,
    /// The server peers are relayed to.
    #[arg(long)]
    pub upstream: String,
    /// Where the proxy node's log lives (a temporary directory when absent).
    #[arg(long)]
    pub data_dir: Option<PathBuf>,
    /// The proxy node's id.
    #[arg(long, default_value_t = 1)]
    pub id: u32,
    /// The proxy node's weft address (the server joins through it).
    #[arg(long, default_value = "127.0.0.1:0")]
    pub node_listen: String,
    /// Cluster members to join through (none: the proxy starts a cluster).
    #[arg(long, value_delimiter = ',')]
    pub join: Vec<String>,
    /// The cluster secret.
    #[arg(
        long,
        env = "WEFT_CLUSTER_SECRET",
        default_value = "",
        hide_env_values = true
    )]
    pub secret: String,
    /// Mutual TLS on this node's TCP links.
    #[command(flatten)]
    pub tls: crate::client::TlsOpts,
    /// Most bytes one transaction may hold (and read) per connection.
    #[arg(long, default_value_t = 4 << 20)]
    pub max_hold: usize,
    /// Failure detector: probe interval.
    #[arg(long, default_value = "200ms", value_parser = parse_duration)]
    pub heartbeat: Duration,
    /// Failure detector: a peer silent this long is dead.
    #[arg(long, default_value = "2s", value_parser = parse_duration)]
    pub dead_after: Duration,
    /// The crash tests' hooks.
    #[command(flatten)]
    pub hooks: LoggerHooks,
}

/// Test hooks of a logger (`weft net proxy`, `weft net tla`), hidden.
#[derive(clap::Args, Debug)]
pub struct LoggerHooks {
    /// Test hook: stop transactions at this commit-protocol point and print
    /// `CRASHPOINT <point> <tid>` (a test then kills the logger).
    #[arg(long, hide = true)]
    pub crash_at: Option<weft_tx::CrashPoint>,
    /// Test hook: hold the `--pause-tx`-th transaction (0-based, counted
    /// per point) at this point of its commit (`before-vote`,
    /// `before-release`), print `PAUSED <point> <tid>` and go on when a
    /// line arrives on stdin.
    #[arg(long, hide = true)]
    pub pause_at: Option<PausePoint>,
    /// Which transaction `--pause-at` holds.
    #[arg(long, hide = true, default_value_t = 0)]
    pub pause_tx: u64,
}

impl LoggerHooks {
    /// The pause hook `--pause-at` asks for.
    fn pause(&self) -> Option<PauseHook> {
        self.pause_at.map(|at| pause_hook(at, self.pause_tx))
    }

    /// Adds the crash point `--crash-at` asks for to `b`.
    fn apply_crash_at(&self, b: weft::NodeBuilder) -> weft::NodeBuilder {
        match self.crash_at {
            Some(point) => b.tm_config(crash_config(point)),
            None => b,
        }
    }
}

/// Flags of `weft net tla`.
#[derive(clap::Args, Debug)]
pub struct TlaArgs {
    /// The TUN device on the peer's side (created if absent).
    #[arg(long)]
    pub peer_tun: String,
    /// The network namespace (`ip netns`) of the peer's TUN device.
    #[arg(long)]
    pub peer_netns: Option<String>,
    /// The TUN device on the server's side (created if absent).
    #[arg(long)]
    pub server_tun: String,
    /// The network namespace of the server's TUN device.
    #[arg(long)]
    pub server_netns: Option<String>,
    /// Where the logger node's log lives (a temporary directory when absent).
    #[arg(long)]
    pub data_dir: Option<PathBuf>,
    /// The logger node's id.
    #[arg(long, default_value_t = 1)]
    pub id: u32,
    /// The logger node's weft address (the server joins through it).
    #[arg(long, default_value = "127.0.0.1:0")]
    pub node_listen: String,
    /// Cluster members to join through (none: the logger starts a cluster).
    #[arg(long, value_delimiter = ',')]
    pub join: Vec<String>,
    /// The cluster secret.
    #[arg(
        long,
        env = "WEFT_CLUSTER_SECRET",
        default_value = "",
        hide_env_values = true
    )]
    pub secret: String,
    /// Most bytes one transaction may hold (and read) per connection.
    #[arg(long, default_value_t = 4 << 20)]
    pub max_hold: usize,
    /// Failure detector: probe interval.
    #[arg(long, default_value = "200ms", value_parser = parse_duration)]
    pub heartbeat: Duration,
    /// Failure detector: a peer silent this long is dead.
    #[arg(long, default_value = "2s", value_parser = parse_duration)]
    pub dead_after: Duration,
    /// The crash tests' hooks.
    #[command(flatten)]
    pub hooks: LoggerHooks,
}

/// Flags of `weft net ls`.
#[derive(clap::Args, Debug)]
pub struct LsArgs {
    #[command(flatten)]
    pub client: ClientOpts,
    /// JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// Flags of `weft net serve`.
#[derive(clap::Args, Debug)]
pub struct ServeArgs {
    #[command(flatten)]
    pub node: NodeArgs,
    /// Where the proxy connects (the proxy's --upstream).
    #[arg(long)]
    pub accept: String,
    /// The proxy's node id (2CA: the proxy connects to --accept).
    #[arg(long, required_unless_present_any = ["sma", "tla_node"])]
    pub proxy_node: Option<u32>,
    /// TLA instead: peers connect to --accept through the TLA logger whose
    /// node id this is.
    #[arg(long)]
    pub tla_node: Option<u32>,
    /// SMA instead: peers connect to --accept directly and the logger runs
    /// in this process.
    #[arg(long)]
    pub sma: bool,
    /// Abort every request's first attempt half-way through its answer, then
    /// restart it.
    #[arg(long)]
    pub abort_first: bool,
    /// Stop before committing this request (0-based, per connection): print
    /// `STOPPED before-commit <n>` and wait to be killed.
    #[arg(long)]
    pub stop_before_commit: Option<u64>,
    /// Stop after this request committed: print `STOPPED after-commit <n>`
    /// and wait to be killed.
    #[arg(long)]
    pub stop_after_commit: Option<u64>,
    /// Hand each commit's decision to the logger (`TmConfig::delegate_commit`:
    /// one forced record per transaction, at the logger).
    #[arg(long)]
    pub delegate_commit: bool,
}

/// Runs `weft net ...`.
pub async fn run(cmd: NetCmd) -> anyhow::Result<()> {
    match cmd {
        NetCmd::Proxy(a) => proxy(a).await,
        NetCmd::Tla(a) => tla(a).await,
        NetCmd::Ls(a) => ls(a).await,
        NetCmd::Serve(a) => serve(a).await,
    }
}

async fn proxy(a: ProxyArgs) -> anyhow::Result<()> {
    let mut cfg = ProxyConfig::new(resolve(&a.listen)?, resolve(&a.upstream)?);
    cfg.logger.max_hold = a.max_hold;
    cfg.pause = a.hooks.pause();
    let proxy = NetProxy::new(cfg);
    let mut b = Node::builder(a.id)
        .listen(resolve(&a.node_listen)?)
        .secret(a.secret.as_bytes())
        .tls(a.tls.load()?)
        .failure_detector(a.heartbeat, a.dead_after)
        .plugin(Arc::new(proxy.clone()));
    if let Some(dir) = &a.data_dir {
        b = b.data_dir(dir);
    }
    if let Some(seed) = a.join.first() {
        b = b.join(Seed::Tcp(resolve(seed)?));
    }
    b = a.hooks.apply_crash_at(b);
    let node = b.start().await.context("the proxy node did not start")?;
    {
        let mut out = std::io::stdout().lock();
        let _ = writeln!(
            out,
            "weft net proxy node {} incarnation {} listening on {} peers on {} upstream {}",
            node.id(),
            node.incarnation(),
            node.addr()
                .map(|x| x.to_string())
                .unwrap_or_else(|| "-".into()),
            proxy
                .listen_addr()
                .map(|x| x.to_string())
                .unwrap_or_else(|| "-".into()),
            a.upstream
        );
        // After the ready line: what a previous run prepared and never
        // released (its peer connection ended with that run).
        print_undeliverable(&mut out, &proxy.undeliverable());
        let _ = out.flush();
    }
    node_cmd::wait_for_signal().await;
    node.shutdown().await;
    Ok(())
}

/// The transaction manager's settings of `--crash-at`: stop transactions
/// at `point` and print `CRASHPOINT <point> <tid>`.
fn crash_config(point: weft_tx::CrashPoint) -> weft::TmConfig {
    let hook: weft_tx::CrashHook = Arc::new(|point, tid| {
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "CRASHPOINT {point:?} {tid}");
        let _ = out.flush();
    });
    weft::TmConfig {
        crash_at: Some((point, hook)),
        ..weft::TmConfig::default()
    }
}

/// The hook of `--pause-at`: holds the `nth` transaction to reach `at`
/// until a line arrives on stdin (or stdin ends).
fn pause_hook(at: PausePoint, nth: u64) -> PauseHook {
    let seen = Arc::new(std::sync::atomic::AtomicU64::new(0));
    PauseHook(Arc::new(move |point, tid| {
        let hit = point == at && seen.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == nth;
        Box::pin(async move {
            if !hit {
                return;
            }
            say(format!("PAUSED {} {tid}", point.name()));
            let _ = tokio::task::spawn_blocking(|| {
                let mut line = String::new();
                let _ = std::io::stdin().read_line(&mut line);
            })
            .await;
        })
    }))
}

/// Prints, after a logger's ready line, the held output a previous run
/// prepared and never released (its peer connection ended with that run),
/// then `RECOVERED <n> undeliverable` (the list is complete).
fn print_undeliverable(out: &mut impl Write, items: &[Undeliverable]) {
    for u in items {
        let _ = writeln!(
            out,
            "UNDELIVERABLE {} {} bytes for {} ({})",
            u.tid,
            u.bytes,
            u.conn,
            if u.committed {
                "committed"
            } else {
                "in doubt at restart"
            }
        );
    }
    let _ = writeln!(out, "RECOVERED {} undeliverable", items.len());
}

async fn tla(a: TlaArgs) -> anyhow::Result<()> {
    let mut cfg = TlaLoggerConfig::new(
        TunSpec {
            name: a.peer_tun.clone(),
            netns: a.peer_netns.clone(),
        },
        TunSpec {
            name: a.server_tun.clone(),
            netns: a.server_netns.clone(),
        },
    );
    cfg.conn.logger.max_hold = a.max_hold;
    cfg.pause = a.hooks.pause();
    let logger = TlaLogger::new(cfg);
    let mut b = Node::builder(a.id)
        .listen(resolve(&a.node_listen)?)
        .secret(a.secret.as_bytes())
        .failure_detector(a.heartbeat, a.dead_after)
        .plugin(Arc::new(logger.clone()));
    if let Some(dir) = &a.data_dir {
        b = b.data_dir(dir);
    }
    if let Some(seed) = a.join.first() {
        b = b.join(Seed::Tcp(resolve(seed)?));
    }
    b = a.hooks.apply_crash_at(b);
    let node = b
        .start()
        .await
        .context("the TLA logger node did not start")?;
    {
        let mut out = std::io::stdout().lock();
        let _ = writeln!(
            out,
            "weft net tla node {} incarnation {} listening on {} peer tun {} server tun {}",
            node.id(),
            node.incarnation(),
            node.addr()
                .map(|x| x.to_string())
                .unwrap_or_else(|| "-".into()),
            a.peer_tun,
            a.server_tun
        );
        print_undeliverable(&mut out, &logger.undeliverable());
        let _ = out.flush();
    }
    node_cmd::wait_for_signal().await;
    node.shutdown().await;
    Ok(())
}

async fn ls(a: LsArgs) -> anyhow::Result<()> {
    let c = Client::connect(&a.client).await?;
    let r: NetResponse = c
        .call_here(weft_net::tca::SERVICE, NetRequest::List)
        .await?;
    c.close().await;
    let NetResponse::Conns(conns) = r else {
        anyhow::bail!("unexpected answer {r:?}");
    };
    if a.json {
        println!("{}", serde_json::to_string_pretty(&conns)?);
    } else {
        print_table(&conns);
    }
    Ok(())
}

fn print_table(conns: &[ConnInfo]) {
    println!(
        "{:<22} {:<22} {:<9} {:<14} {:>9} {:>9} {:>9} {:>7} {:>9}",
        "conn", "peer", "state", "tx", "held", "logged", "committed", "aborted", "restarted"
    );
    for c in conns {
        println!(
            "{:<22} {:<22} {:<9} {:<14} {:>9} {:>9} {:>9} {:>7} {:>9}{}",
            c.conn,
            c.peer,
            c.state.to_string(),
            c.tx.map(|t| t.to_string()).unwrap_or_else(|| "-".into()),
            c.stats.held_bytes,
            c.stats.logged_bytes,
            c.stats.committed,
            c.stats.aborted,
            c.stats.restarted,
            if c.server_gone { "  (server gone)" } else { "" }
        );
    }
}

fn say(line: String) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

async fn serve(a: ServeArgs) -> anyhow::Result<()> {
    let listener = TcpListener::bind(resolve(&a.accept)?).await?;
    let mut b = a.node.builder()?;
    if a.delegate_commit {
        b = b.tm_config(weft::TmConfig {
            delegate_commit: true,
            ..a.node.tm_config()
        });
    }
    let node = a.node.start(b).await?;
    say(format!(
        "weft net serve node {} incarnation {} listening on {} accepting on {}",
        node.id(),
        node.incarnation(),
        node.addr()
            .map(|x| x.to_string())
            .unwrap_or_else(|| "-".into()),
        listener.local_addr()?
    ));
    let a = Arc::new(a);
    let node = Arc::new(node);
    loop {
        let (tcp, _) = listener.accept().await?;
        let s = match (a.tla_node, a.proxy_node.filter(|_| !a.sma)) {
            (Some(logger), _) => Stream::Tla(TlaStream::new(
                tcp,
                node.rpc().clone(),
                NodeId(logger),
                LoggerConfig::default(),
            )?),
            (None, Some(proxy)) => Stream::Tca(ProxiedStream::new(
                tcp,
                node.rpc().clone(),
                NodeId(proxy),
                LoggerConfig::default(),
            )?),
            (None, None) => Stream::Sma(TxStream::new(
                tcp,
                node.tm().clone(),
                LoggerConfig::default(),
            )),
        };
        let (node, a) = (Arc::clone(&node), Arc::clone(&a));
        tokio::spawn(async move {
            if let Err(e) = serve_conn(&node, &a, s).await {
                eprintln!("weft net serve: connection ended: {e:#}");
            }
        });
    }
}

/// The served connection, SMA, 2CA or TLA.
enum Stream {
    Sma(TxStream),
    Tca(ProxiedStream),
    Tla(TlaStream),
}

impl Stream {
    async fn start(&self, tx: &Transaction) -> Result<(), Failure> {
        match self {
            Stream::Sma(s) => s.start(tx.tid()),
            Stream::Tca(s) => s.start(tx).await,
            Stream::Tla(s) => s.start(tx).await,
        }
    }
    async fn restart(&self, tx: &Transaction) -> Result<(), Failure> {
        match self {
            Stream::Sma(s) => s.restart(tx.tid()),
            Stream::Tca(s) => s.restart(tx).await,
            Stream::Tla(s) => s.restart(tx).await,
        }
    }
    async fn abort(&self, tx: Transaction, reason: &str) -> Result<(), Failure> {
        match self {
            Stream::Sma(_) => tx.abort(reason).await,
            Stream::Tca(s) => s.abort(tx, reason).await,
            Stream::Tla(s) => s.abort(tx, reason).await,
        }
    }
    async fn commit(&self, tx: Transaction) -> Result<(), Failure> {
        match self {
            Stream::Sma(_) => tx.commit().await,
            Stream::Tca(s) => s.commit(tx).await,
            Stream::Tla(s) => s.commit(tx).await,
        }
    }
    async fn read(&self, buf: &mut [u8]) -> Result<usize, Failure> {
        match self {
            Stream::Sma(s) => s.read(buf).await,
            Stream::Tca(s) => s.read(buf).await,
            Stream::Tla(s) => s.read(buf).await,
        }
    }
    async fn write_all(&self, data: &[u8]) -> Result<(), Failure> {
        match self {
            Stream::Sma(s) => s.write_all(data).await,
            Stream::Tca(s) => s.write_all(data).await,
            Stream::Tla(s) => s.write_all(data).await,
        }
    }
    async fn shutdown(&self) {
        match self {
            Stream::Sma(s) => s.shutdown().await,
            Stream::Tca(s) => s.shutdown().await,
            Stream::Tla(s) => s.shutdown().await,
        }
    }
}

async fn read_line(s: &Stream) -> anyhow::Result<Option<Vec<u8>>> {
    let mut line = Vec::new();
    let mut b = [0u8; 1];
    loop {
        if s.read(&mut b).await? == 0 {
            return Ok(None);
        }
        line.push(b[0]);
        if b[0] == b'\n' || line.len() > 4096 {
            return Ok(Some(line));
        }
    }
}

async fn serve_conn(node: &Node, a: &ServeArgs, s: Stream) -> anyhow::Result<()> {
    let mut n: u64 = 0;
    loop {
        let tx = node.begin();
        s.start(&tx).await?;
        let Some(line) = read_line(&s).await? else {
            let _ = s.abort(tx, "the peer closed").await;
            s.shutdown().await;
            return Ok(());
        };
        let mut answer = b"ok ".to_vec();
        answer.extend_from_slice(&line);
        let tx = if a.abort_first {
            s.write_all(b"ABORTED ").await?;
            s.write_all(&answer[..answer.len() / 2]).await?;
            s.abort(tx, "first attempt").await?;
            let again = node.begin();
            s.restart(&again).await?;
            let replayed = read_line(&s).await?.context("replay ended early")?;
            anyhow::ensure!(replayed == line, "the restart read other bytes");
            again
        } else {
            tx
        };
        s.write_all(&answer).await?;
        if a.stop_before_commit == Some(n) {
            say(format!("STOPPED before-commit {n}"));
            std::future::pending::<()>().await;
        }
        let tid = tx.tid();
        if let Err(e) = s.commit(tx).await {
            say(format!("COMMIT FAILED {n} {tid}: {e}"));
            return Err(e.into());
        }
        say(format!("COMMITTED {n} {tid}"));
        if a.stop_after_commit == Some(n) {
            say(format!("STOPPED after-commit {n}"));
            std::future::pending::<()>().await;
        }
        n += 1;
    }
}
