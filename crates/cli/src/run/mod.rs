//! `weft run [--node ADDR] [--fs DIR]... -- CMD ARGS...`: runs an unmodified
//! program under a default transaction (QuickSilver, section 5): its file
//! changes inside the `--fs` directories, and whatever the weft commands it
//! runs do (they find `$WEFT_TX`), commit together when it exits 0; a
//! non-zero exit, a signal, or a crash of `weft run` leaves no trace.
//!
//! Owns the life of one run: which node and transaction (a new one, or a
//! sub-transaction of `$WEFT_TX`), the capture of the program's file
//! changes (see [`capture`]), applying them in the transaction (see
//! [`apply`]), the outcome, and the process's notification transaction (see
//! [`lease`]). Must never change a captured directory outside the
//! transaction, and never commit after anything but exit status 0.

pub mod apply;
pub mod capture;
pub mod lease;
mod volume;

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use weft::admin::{TxReply, TxRequest, TX_SERVICE};
use weft::kv::{Kv, KvConfig};
use weft::{Node, NodeError};
use weft_wire::{Address, Failure, ServiceName, Status, TxContext, Xid};

use crate::client::{parse_duration, Client, ClientOpts, TlsOpts};
use capture::Capture;

/// Environment variable naming the directories an enclosing `weft run`
/// captures (so a nested run applies its changes into the enclosing run's
/// view of them).
pub const OVERLAYS_ENV: &str = "WEFT_RUN_OVERLAYS";

/// Environment variable holding the process's notification transaction.
pub const NOTIFY_ENV: &str = "WEFT_NOTIFY_TX";

/// Flags of `weft run`.
#[derive(clap::Args, Debug)]
pub struct RunArgs {
    /// The node to run the transaction at (host:port); without it (and
    /// without $WEFT_NODE), an embedded node whose data directory sits
    /// beside the first --fs directory.
    #[arg(long, env = "WEFT_NODE")]
    pub node: Option<String>,
    /// The cluster secret.
    #[arg(
        long,
        env = "WEFT_CLUSTER_SECRET",
        default_value = "",
        hide_env_values = true
    )]
    pub secret: String,
    /// A directory whose changes become the transaction's file writes: a
    /// volume of the node, or a directory inside one (repeatable).
    #[arg(long = "fs")]
    pub fs: Vec<PathBuf>,
    /// Join this transaction as a sub-transaction (default: $WEFT_TX; a
    /// new transaction when unset).
    #[arg(long, env = "WEFT_TX")]
    pub tx: Option<Xid>,
    /// The transaction's deadline (it aborts if the program runs longer).
    #[arg(long, default_value = "1h", value_parser = parse_duration)]
    pub deadline: Duration,
    /// How long to wait for one call to the node.
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    pub timeout: Duration,
    /// How long to wait for the embedded node's data directory when another
    /// `weft run` on the same volume holds it.
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    pub wait: Duration,
    /// Test hook (embedded node only): stop the transaction at this
    /// commit-protocol point and print `CRASHPOINT <point> <tid>` on stderr
    /// (a test then kills `weft run`).
    #[arg(long, hide = true)]
    pub crash_at: Option<weft_tx::CrashPoint>,
    /// TLS files for --node, when the cluster runs TLS (passed on to the
    /// program's weft commands through $WEFT_TLS_CERT/KEY/CA).
    #[command(flatten)]
    pub tls: TlsOpts,
    /// The program and its arguments.
    #[arg(trailing_var_arg = true, required = true, num_args = 1..)]
    pub cmd: Vec<OsString>,
}

/// Where the run's transaction lives: a node reached as a client, and the
/// embedded node when `weft run` started one.
pub struct Session {
    client: Client,
    node_addr: String,
    secret: String,
    embedded: Option<Node>,
    /// The embedded node's file store.
    fs: Option<weft_fs::Fs>,
}

impl Session {
    async fn close(self) {
        // Every transaction of the run has ended and the process exits
        // next (an embedded node stops first), which closes the connection:
        // a polite shutdown would only add the transport's pause for its
        // goodbye (5 ms, about half of a null program's run).
        drop(self.client);
        if let Some(fs) = &self.fs {
            // A commit returns once its files show; they are made durable
            // (and recorded as applied) just after: wait for that here, so
            // the next run on the volume finds nothing to redo.
            let done = fs.wait_until(|f| !f.volumes().any(|v| v.stats().prepared > 0));
            if tokio::time::timeout(Duration::from_secs(60), done)
                .await
                .is_err()
            {
                tracing::warn!("the embedded node's last commit is not forced after 60 s; the next run on the volume completes it");
            }
        }
        if let Some(n) = self.embedded {
            // Truncate a long log so the next run recovers little (a
            // checkpoint costs forces, and frees only whole segments: only
            // when a segment is full).
            if log_segments(&n.data_dir().join("log")) > 1 {
                let c = n.clone();
                match tokio::task::spawn_blocking(move || c.checkpoint()).await {
                    Ok(Ok(_)) => {}
                    Ok(Err(f)) => tracing::warn!("checkpoint of the embedded node: {f}"),
                    Err(e) => tracing::warn!("checkpoint of the embedded node: {e}"),
                }
            }
            n.shutdown().await;
        }
    }

    fn tx_addr(&self, node: weft_wire::NodeId) -> Address {
        Address {
            service: ServiceName::new(TX_SERVICE).expect("valid"),
            instance: 0,
            node,
        }
    }

    async fn tx(&self, node: weft_wire::NodeId, req: TxRequest) -> Result<TxReply, Failure> {
        self.client.call(&self.tx_addr(node), req, None).await
    }
}

/// Segment size of the embedded node's log (its largest record, 16 MiB,
/// must fit).
const SEGMENT_BYTES: u64 = 32 << 20;

/// Segment files in the log directory `dir`.
fn log_segments(dir: &Path) -> usize {
    std::fs::read_dir(dir)
        .map(|r| {
            r.flatten()
                .filter(|e| e.path().extension().is_some_and(|x| x == "wlog"))
                .count()
        })
        .unwrap_or(0)
}

/// How the run's transaction ends.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Own {
    /// A top-level transaction of its own: commit or abort it.
    Top,
    /// A sub-transaction of `$WEFT_TX`: end it into its parent.
    Sub,
}

/// Runs `weft run`. Exits with the program's status when it failed (128 +
/// the signal when a signal ended it), with the failure's exit code (see
/// `client::exit_code`) when the commit failed.
pub async fn run(args: RunArgs) -> anyhow::Result<()> {
    let code = run_inner(args).await?;
    if code != 0 {
        std::process::exit(code);
    }
    Ok(())
}

async fn run_inner(args: RunArgs) -> anyhow::Result<i32> {
    let enclosing = enclosing_overlays();
    let capture = if args.fs.is_empty() {
        None
    } else {
        let first = std::fs::canonicalize(&args.fs[0])
            .with_context(|| format!("--fs {}", args.fs[0].display()))?;
        Some(Capture::prepare(
            &capture::scratch_root(&volume::volume_root(&first)),
            &args.fs,
        )?)
    };
    let t = Instant::now();
    let session = connect(&args).await?;
    tracing::info!(
        ms = t.elapsed().as_millis() as u64,
        "connected (the embedded node started)"
    );
    let result = run_in(&args, &session, capture.as_ref(), &enclosing).await;
    let t = Instant::now();
    // The scratch area is the run's own: it is removed while the embedded
    // node makes the commit durable and stops.
    let discard = tokio::task::spawn_blocking(move || {
        if let Some(c) = capture {
            c.discard();
        }
    });
    let (_, discarded) = tokio::join!(session.close(), discard);
    if let Err(e) = discarded {
        tracing::warn!("removing the scratch area: {e}");
    }
    tracing::info!(ms = t.elapsed().as_millis() as u64, "the node closed");
    result
}

async fn run_in(
    args: &RunArgs,
    s: &Session,
    capture: Option<&Capture>,
    enclosing: &[PathBuf],
) -> anyhow::Result<i32> {
    let deadline_ms = args.deadline.as_millis().min(u64::MAX as u128) as u64;
    let begin_main = async {
        match &args.tx {
            Some(xid) => {
                let r = s
                    .tx(xid.tid.node, TxRequest::SubBegin(xid.clone()))
                    .await
                    .with_context(|| format!("cannot join {xid}"))?;
                let TxReply::Begun(ctx) = r else {
                    anyhow::bail!("unexpected reply {r:?}")
                };
                Ok((ctx, Own::Sub))
            }
            None => {
                let r = s
                    .client
                    .call_here(
                        TX_SERVICE,
                        TxRequest::Begin {
                            timeout_ms: Some(deadline_ms),
                        },
                    )
                    .await
                    .context("cannot begin the transaction")?;
                let TxReply::Begun(ctx) = r else {
                    anyhow::bail!("unexpected reply {r:?}")
                };
                Ok((ctx, Own::Top))
            }
        }
    };
    // The notification transaction: only ever aborted, when the process
    // ends (or at its deadline, if this run dies first).
    let begin_notify = async {
        match s
            .client
            .call_here(
                TX_SERVICE,
                TxRequest::Begin {
                    timeout_ms: Some(deadline_ms),
                },
            )
            .await
        {
            Ok(TxReply::Begun(n)) => Ok(n),
            Ok(r) => Err(anyhow::anyhow!("unexpected reply {r:?}")),
            Err(f) => {
                Err(anyhow::Error::new(f).context("cannot begin the notification transaction"))
            }
        }
    };
    let (main, notify) = tokio::join!(begin_main, begin_notify);
    let (ctx, own, notify) = match (main, notify) {
        (Ok((ctx, own)), Ok(n)) => (ctx, own, n),
        (Ok((ctx, own)), Err(e)) => {
            end(s, &ctx, own, "no notification transaction").await;
            return Err(e);
        }
        (Err(e), n) => {
            if let Ok(n) = n {
                let _ = s
                    .tx(
                        n.tid.node,
                        TxRequest::Abort(n.tid, "no default transaction".into()),
                    )
                    .await;
            }
            return Err(e);
        }
    };
    let t = Instant::now();
    let status = spawn_and_wait(args, s, capture, &ctx, &notify).await;
    tracing::info!(ms = t.elapsed().as_millis() as u64, "the program ended");
    // The process ended: tell its one-phase participants, whatever happens
    // to its default transaction (at the same time as that ends).
    let ended = async {
        if let Err(f) = s
            .tx(
                notify.tid.node,
                TxRequest::Abort(notify.tid, "the process ended".into()),
            )
            .await
        {
            tracing::warn!("ending the notification transaction {}: {f}", notify.tid);
        }
    };
    let (_, result) = tokio::join!(
        ended,
        finish(args, s, capture, enclosing, &ctx, own, status)
    );
    result
}

/// Ends the run's transaction after the program's exit `status`: applies
/// the captured changes and commits after exit 0, aborts otherwise.
async fn finish(
    args: &RunArgs,
    s: &Session,
    capture: Option<&Capture>,
    enclosing: &[PathBuf],
    ctx: &TxContext,
    own: Own,
    status: anyhow::Result<std::process::ExitStatus>,
) -> anyhow::Result<i32> {
    let status = match status {
        Ok(st) => st,
        Err(e) => {
            end(s, ctx, own, "weft run could not run the program").await;
            return Err(e);
        }
    };
    let xid = ctx.xid();
    if !status.success() {
        let (code, what) = match (status.code(), signal_of(&status)) {
            (Some(c), _) => (c, format!("exited with status {c}")),
            (None, Some(sig)) => (128 + sig, format!("was killed by signal {sig}")),
            (None, None) => (1, "ended abnormally".to_string()),
        };
        end(s, ctx, own, &format!("the program {what}")).await;
        eprintln!("weft run: the program {what}; {xid} aborted, nothing it changed was kept");
        return Ok(code);
    }
    let t = Instant::now();
    if let Some(c) = capture {
        match apply::apply_all(s, c, ctx, enclosing, args.timeout).await {
            Ok(()) => {}
            Err(f) => {
                end(s, ctx, own, &format!("applying the changes: {f}")).await;
                return Err(anyhow::Error::new(f).context(format!(
                    "the program exited 0 but its file changes could not be applied; {xid} aborted"
                )));
            }
        }
    }
    tracing::info!(ms = t.elapsed().as_millis() as u64, "changes applied");
    let t = Instant::now();
    match own {
        Own::Top => {
            s.tx(ctx.tid.node, TxRequest::Commit(ctx.tid))
                .await
                .map_err(|f| anyhow::Error::new(f).context(format!("{xid} did not commit")))?;
            // The node's commit returns once its volumes show the changes:
            // the program's caller may look at the files next.
            tracing::info!(ms = t.elapsed().as_millis() as u64, "committed");
        }
        Own::Sub => {
            s.tx(ctx.tid.node, TxRequest::SubEnd(xid.clone(), true))
                .await
                .map_err(|f| {
                    anyhow::Error::new(f).context(format!("{xid} could not end into its parent"))
                })?;
        }
    }
    Ok(0)
}

/// Aborts the run's (sub-)transaction, best effort (an abort that cannot
/// reach the coordinator still happens at the deadline).
async fn end(s: &Session, ctx: &TxContext, own: Own, why: &str) {
    let r = match own {
        Own::Top => {
            s.tx(ctx.tid.node, TxRequest::Abort(ctx.tid, why.to_string()))
                .await
        }
        Own::Sub => {
            s.tx(ctx.tid.node, TxRequest::SubEnd(ctx.xid(), false))
                .await
        }
    };
    if let Err(f) = r {
        tracing::warn!("aborting {}: {f}", ctx.xid());
    }
}

fn signal_of(status: &std::process::ExitStatus) -> Option<i32> {
    use std::os::unix::process::ExitStatusExt;
    status.signal()
}

/// Starts the program (in the capture's namespace) and waits for it; a
/// SIGINT or SIGTERM to `weft run` kills it (and so aborts the run).
async fn spawn_and_wait(
    args: &RunArgs,
    s: &Session,
    capture: Option<&Capture>,
    ctx: &TxContext,
    notify: &TxContext,
) -> anyhow::Result<std::process::ExitStatus> {
    let mut cmd = tokio::process::Command::new(&args.cmd[0]);
    cmd.args(&args.cmd[1..])
        .env("WEFT_TX", ctx.xid().to_string())
        .env(NOTIFY_ENV, notify.tid.to_string())
        .env("WEFT_NODE", &s.node_addr)
        .env("WEFT_CLUSTER_SECRET", &s.secret)
        .kill_on_drop(true);
    if s.embedded.is_none() {
        for (var, path) in [
            ("WEFT_TLS_CERT", &args.tls.tls_cert),
            ("WEFT_TLS_KEY", &args.tls.tls_key),
            ("WEFT_TLS_CA", &args.tls.tls_ca),
        ] {
            if let Some(p) = path {
                // Absolute, so a program that changes directory (into its
                // --fs directory, say) still finds the files.
                cmd.env(var, std::fs::canonicalize(p).unwrap_or_else(|_| p.clone()));
            }
        }
    } else {
        // The program's weft commands talk to the embedded node, which
        // listens on loopback without TLS.
        for var in ["WEFT_TLS_CERT", "WEFT_TLS_KEY", "WEFT_TLS_CA"] {
            cmd.env_remove(var);
        }
    }
    if let Some(c) = capture {
        let mut dirs: Vec<PathBuf> = enclosing_overlays();
        dirs.extend(c.dirs.iter().map(|d| d.dir.clone()));
        if let Ok(v) = std::env::join_paths(&dirs) {
            cmd.env(OVERLAYS_ENV, v);
        }
        let cwd = std::env::current_dir().context("the working directory")?;
        c.install(&mut cmd, &cwd)?;
    }
    // Spawned from this (the runtime's main) thread: the program's
    // parent-death signal follows this thread, which lives as long as the
    // run.
    let mut child = cmd
        .spawn()
        .map_err(|e| spawn_error(&args.cmd[0], capture, e))?;
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let mut term = signal(SignalKind::terminate()).context("SIGTERM handler")?;
        let mut int = signal(SignalKind::interrupt()).context("SIGINT handler")?;
        tokio::select! {
            st = child.wait() => Ok(st?),
            _ = term.recv() => { let _ = child.kill().await; Ok(child.wait().await?) }
            _ = int.recv() => { let _ = child.kill().await; Ok(child.wait().await?) }
        }
    }
    #[cfg(not(unix))]
    {
        Ok(child.wait().await?)
    }
}

fn spawn_error(cmd: &OsString, capture: Option<&Capture>, e: std::io::Error) -> anyhow::Error {
    let setup = capture.is_some() && e.raw_os_error() == Some(libc::EPERM);
    if setup {
        anyhow::Error::new(Failure::new(
            Status::Refused,
            format!(
                "cannot make the private overlay mounts for --fs ({e}): weft run needs root, \
                 or unprivileged user namespaces (kernel.unprivileged_userns_clone=1)"
            ),
        ))
    } else {
        anyhow::Error::new(e).context(format!("cannot start {}", cmd.to_string_lossy()))
    }
}

/// The directories an enclosing `weft run` captures.
fn enclosing_overlays() -> Vec<PathBuf> {
    std::env::var_os(OVERLAYS_ENV)
        .map(|v| std::env::split_paths(&v).collect())
        .unwrap_or_default()
}

/// Connects to --node, or starts the embedded node.
async fn connect(args: &RunArgs) -> anyhow::Result<Session> {
    if let Some(addr) = &args.node {
        let opts = ClientOpts {
            node: addr.clone(),
            secret: args.secret.clone(),
            timeout: args.timeout,
            tls: args.tls.clone(),
        };
        let client = Client::connect(&opts).await?;
        return Ok(Session {
            client,
            node_addr: addr.clone(),
            secret: args.secret.clone(),
            embedded: None,
            fs: None,
        });
    }
    if args.tx.is_some() {
        anyhow::bail!(Failure::new(
            Status::BadRequest,
            "$WEFT_TX is set but no node is named (--node or $WEFT_NODE)"
        ));
    }
    let Some(first) = args.fs.first() else {
        anyhow::bail!(Failure::new(
            Status::BadRequest,
            "with neither --node nor $WEFT_NODE, weft run keeps its node beside the first --fs \
             directory: name one"
        ));
    };
    let first = std::fs::canonicalize(first).with_context(|| first.display().to_string())?;
    let dir = capture::weft_dir(&volume::volume_root(&first)).join("node");
    let secret = format!("{:032x}", rand::random::<u128>());
    let (node, fs) = start_embedded(&dir, &secret, &args.fs, args.wait, args.crash_at).await?;
    let node_addr = node
        .addr()
        .map(|a| a.to_string())
        .ok_or_else(|| anyhow::anyhow!("the embedded node has no address"))?;
    let opts = ClientOpts {
        node: node_addr.clone(),
        secret: secret.clone(),
        timeout: args.timeout,
        // The embedded node listens on loopback only, without TLS.
        tls: TlsOpts::default(),
    };
    let client = Client::connect(&opts).await?;
    Ok(Session {
        client,
        node_addr,
        secret,
        embedded: Some(node),
        fs: Some(fs),
    })
}

/// Starts the embedded node over `dir`, waiting up to `wait` while another
/// run holds it.
///
/// Fails with LockConflict when it stays held, or with the node's error.
async fn start_embedded(
    dir: &Path,
    secret: &str,
    volumes: &[PathBuf],
    wait: Duration,
    crash_at: Option<weft_tx::CrashPoint>,
) -> anyhow::Result<(Node, weft_fs::Fs)> {
    std::fs::create_dir_all(dir).with_context(|| dir.display().to_string())?;
    let give_up = Instant::now() + wait;
    let mut pause = Duration::from_millis(5);
    loop {
        // Opened after the node's lock is ours would be better; opening a
        // volume only makes its reserved area and reads nothing of another
        // run's transactions, so it is safe before.
        let fs = volume::embedded_fs(volumes)?;
        let mut b = Node::builder(1);
        if let Some(point) = crash_at {
            let hook: weft_tx::CrashHook = Arc::new(|point, tid| {
                eprintln!("CRASHPOINT {point:?} {tid}");
            });
            b = b.tm_config(weft::TmConfig {
                crash_at: Some((point, hook)),
                ..weft::TmConfig::default()
            });
        }
        let b = b
            .listen(([127, 0, 0, 1], 0).into())
            .secret(secret.as_bytes())
            .data_dir(dir)
            .plugin(Arc::new(Kv::new(KvConfig::default())))
            .plugin(Arc::new(lease::LeasePlugin::default()))
            .plugin(Arc::new(fs.clone()))
            // A log that grows as written: recovery at the next run reads
            // what was written, not a preallocated 64 MiB segment.
            .log_config(|c| weft::LogConfig {
                preallocate: false,
                segment_size: SEGMENT_BYTES,
                ..c
            });
        match b.start().await {
            Ok(n) => return Ok((n, fs)),
            Err(NodeError::Log(weft_log::LogError::Locked { .. })) if Instant::now() < give_up => {
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_millis(200));
            }
            Err(NodeError::Log(weft_log::LogError::Locked { .. })) => {
                return Err(anyhow::Error::new(Failure::new(
                    Status::LockConflict,
                    format!(
                        "another weft run on this volume holds its node ({}) for more than {wait:?}",
                        dir.display()
                    ),
                )))
            }
            Err(e) => return Err(anyhow::Error::new(e).context("the embedded node did not start")),
        }
    }
}

/// `weft lease` subcommands: named leases held for the calling process,
/// released when it ends (its `$WEFT_NOTIFY_TX`).
#[derive(clap::Subcommand, Debug)]
pub enum LeaseCmd {
    /// Take a lease for this process (LockConflict, exit 4, when held).
    Acquire(LeaseArgs),
    /// Give a lease back.
    Release(LeaseArgs),
    /// List the leases held at the node.
    List {
        #[command(flatten)]
        client: ClientOpts,
    },
}

/// A lease and its holder.
#[derive(clap::Args, Debug)]
pub struct LeaseArgs {
    #[command(flatten)]
    pub client: ClientOpts,
    /// The process's notification transaction (set by weft run).
    #[arg(long, env = NOTIFY_ENV)]
    pub notify: Option<weft_wire::Tid>,
    /// The lease's name.
    pub name: String,
}

/// Runs `weft lease ...`.
pub async fn lease_cmd(cmd: LeaseCmd) -> anyhow::Result<()> {
    use lease::{LeaseReply, LeaseRequest, SERVICE};
    let (opts, req, notify) = match cmd {
        LeaseCmd::Acquire(a) => (a.client, LeaseRequest::Acquire(a.name), a.notify),
        LeaseCmd::Release(a) => (a.client, LeaseRequest::Release(a.name), a.notify),
        LeaseCmd::List { client } => (client, LeaseRequest::List, None),
    };
    let c = Client::connect(&opts).await?;
    let addr = Address {
        service: ServiceName::new(SERVICE)?,
        instance: 0,
        node: c.gateway(),
    };
    let r: Result<LeaseReply, Failure> = c.call(&addr, req, notify.map(TxContext::new)).await;
    c.close().await;
    match r? {
        LeaseReply::Done => {}
        LeaseReply::List(l) => {
            for (name, tid) in l {
                println!("{name}\t{tid}");
            }
        }
    }
    Ok(())
}
