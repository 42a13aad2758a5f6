//! `weft group ...`: create, destroy, list, send to and listen on process
//! groups from a shell, and `weft bench group`.
//!
//! Talks to one node's `_group` service as a client (never a cluster
//! member) through [`weft_group::service::GroupClient`]. Group secrets stay
//! in this process: the client derives the key the node checks. Owns only
//! the mapping from arguments to those calls and the printing of results;
//! self-contained so `main.rs` only needs `group_cmd::run` and
//! `group_cmd::run_bench`.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;

use crate::client::{parse_duration, resolve};
use weft_group::bench::{bench, BenchChannel, BenchOptions, GroupBenchReport};
use weft_group::service::{GroupClient, SendReport};
use weft_wire::{Failure, GroupId, Status};

/// How to reach a node (the group's `--secret` is the group's, so the
/// cluster secret is `--cluster-secret`).
#[derive(clap::Args, Clone, Debug)]
pub struct Conn {
    /// The node to talk to (host:port).
    #[arg(long, env = "WEFT_NODE", default_value = "127.0.0.1:7000")]
    pub node: String,
    /// The cluster secret.
    #[arg(
        long,
        env = "WEFT_CLUSTER_SECRET",
        default_value = "",
        hide_env_values = true
    )]
    pub cluster_secret: String,
    /// TLS files, when the cluster runs TLS.
    #[command(flatten)]
    pub tls: crate::client::TlsOpts,
}

/// `weft group` arguments.
#[derive(clap::Args, Debug)]
pub struct GroupArgs {
    #[command(subcommand)]
    pub cmd: GroupCmd,
}

/// `weft group` subcommands.
#[derive(clap::Subcommand, Debug)]
pub enum GroupCmd {
    /// Create a group `class:name` with a secret (which may be empty).
    Create {
        #[command(flatten)]
        conn: Conn,
        /// The group, `class:name`.
        gid: String,
        /// The group's secret (needed to join, leave and destroy it).
        #[arg(long, default_value = "")]
        secret: String,
    },
    /// Destroy a group (every member is removed).
    Destroy {
        #[command(flatten)]
        conn: Conn,
        /// The group.
        gid: String,
        /// The group's secret.
        #[arg(long, default_value = "")]
        secret: String,
    },
    /// Join a group and print every message until interrupted, replying to
    /// each with `--reply` if given.
    Listen {
        #[command(flatten)]
        conn: Conn,
        /// The group.
        gid: String,
        /// The group's secret.
        #[arg(long, default_value = "")]
        secret: String,
        /// Reply with this text to every message.
        #[arg(long)]
        reply: Option<String>,
    },
    /// Send a message to a group; print how many members got it, their
    /// replies and the final status.
    Send {
        #[command(flatten)]
        conn: Conn,
        /// The group (`class:name` or `tx:<tid>`).
        gid: String,
        /// The message (sent as bytes).
        message: String,
        /// Replies wanted (default: every member reached; 0 sends without
        /// waiting for replies).
        #[arg(long)]
        replies: Option<u32>,
        /// How long to wait for replies.
        #[arg(long, default_value = "5s", value_parser = parse_duration)]
        timeout: Duration,
        /// Tag for members' selective receives.
        #[arg(long, default_value_t = 0)]
        tag: u32,
        /// Print the report as JSON.
        #[arg(long)]
        json: bool,
    },
    /// List the groups.
    Ls {
        #[command(flatten)]
        conn: Conn,
        /// Print JSON.
        #[arg(long)]
        json: bool,
        /// Use the node's cached table (no round trip to the directory).
        #[arg(long)]
        cached: bool,
    },
}

/// `weft bench group` arguments.
#[derive(clap::Args, Debug)]
pub struct BenchGroupArgs {
    /// Nodes in the cluster (in this process).
    #[arg(long, default_value_t = 4)]
    pub nodes: u32,
    /// Member counts to measure, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,4,16")]
    pub members: Vec<usize>,
    /// Measured iterations per figure (after a warm-up of a tenth).
    #[arg(long, default_value_t = 2000)]
    pub iterations: usize,
    /// Message and reply size in bytes.
    #[arg(long, default_value_t = 64)]
    pub payload: usize,
    /// Between nodes: tcp (loopback, the headline) or inproc.
    #[arg(long, default_value = "tcp", value_parser = ["tcp", "inproc"])]
    pub channel: String,
    /// Write the report as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

fn group(text: &str) -> Result<GroupId, Failure> {
    weft_group::parse_group(text)
}

async fn connect(conn: &Conn) -> anyhow::Result<GroupClient> {
    let addr = resolve(&conn.node)?;
    GroupClient::connect_tls(
        addr,
        conn.cluster_secret.as_bytes(),
        conn.tls.load()?,
        Duration::from_secs(10),
    )
    .await
    .map_err(|f| anyhow::Error::new(f).context(format!("cannot connect to {addr}")))
}

/// Shows bytes as text, or hex when they are not UTF-8.
fn show(bytes: &[u8]) -> String {
    match std::str::from_utf8(bytes) {
        Ok(s) => s.to_string(),
        Err(_) => bytes.iter().map(|b| format!("{b:02x}")).collect(),
    }
}

/// Runs `weft group ...`.
pub async fn run(args: GroupArgs) -> anyhow::Result<()> {
    match args.cmd {
        GroupCmd::Create { conn, gid, secret } => {
            let gid = group(&gid)?;
            let client = connect(&conn).await?;
            let r = client.create(&gid, &secret).await;
            client.close().await;
            r?;
            println!("created {gid}");
            Ok(())
        }
        GroupCmd::Destroy { conn, gid, secret } => {
            let gid = group(&gid)?;
            let client = connect(&conn).await?;
            let r = client.destroy(&gid, &secret).await;
            client.close().await;
            r?;
            println!("destroyed {gid}");
            Ok(())
        }
        GroupCmd::Ls { conn, json, cached } => {
            let client = connect(&conn).await?;
            let r = client.list(cached).await;
            client.close().await;
            let groups = r?;
            if json {
                let rows: Vec<serde_json::Value> = groups
                    .iter()
                    .map(|g| {
                        serde_json::json!({
                            "gid": g.gid.to_string(),
                            "hosts": g.hosts.iter().map(|h| h.0).collect::<Vec<_>>(),
                            "local_members": g.local_members,
                        })
                    })
                    .collect();
                println!("{}", serde_json::to_string_pretty(&rows)?);
            } else {
                println!("{:<40} {:>7}  HOSTS", "GROUP", "MEMBERS");
                for g in groups {
                    let hosts: Vec<String> = g.hosts.iter().map(|h| h.to_string()).collect();
                    println!(
                        "{:<40} {:>7}  {}",
                        g.gid.to_string(),
                        g.local_members,
                        hosts.join(",")
                    );
                }
            }
            Ok(())
        }
        GroupCmd::Send {
            conn,
            gid,
            message,
            replies,
            timeout,
            tag,
            json,
        } => {
            let gid = group(&gid)?;
            let client = connect(&conn).await?;
            let r = client
                .send(&gid, tag, message.into_bytes(), replies, timeout)
                .await;
            client.close().await;
            let report = r?;
            if json {
                println!("{}", serde_json::to_string_pretty(&report_json(&report))?);
            } else {
                print_report(&gid, &report);
            }
            if report.status == Status::Ok {
                Ok(())
            } else {
                Err(Failure::new(report.status, report.detail).into())
            }
        }
        GroupCmd::Listen {
            conn,
            gid,
            secret,
            reply,
        } => listen(&conn, &group(&gid)?, &secret, reply).await,
    }
}

fn report_json(r: &SendReport) -> serde_json::Value {
    serde_json::json!({
        "delivered": r.delivered,
        "full": r.delivery.full,
        "unreachable": r.delivery.lost.iter()
            .map(|(n, s)| serde_json::json!({ "node": n.0, "status": s.name() }))
            .collect::<Vec<_>>(),
        "replies": r.replies.iter()
            .map(|x| serde_json::json!({ "from": x.from.to_string(), "body": show(&x.body) }))
            .collect::<Vec<_>>(),
        "failures": r.failures.iter()
            .map(|(who, s)| serde_json::json!({ "member": who, "status": s.name() }))
            .collect::<Vec<_>>(),
        "status": r.status.name(),
        "detail": r.detail,
    })
}

fn print_report(gid: &GroupId, r: &SendReport) {
    println!("delivered to {} member(s) of {gid}", r.delivered);
    if r.delivery.full > 0 {
        println!("  {} member(s) not reached: queue full", r.delivery.full);
    }
    for (node, status) in &r.delivery.lost {
        println!("  node {node} not reached: {status}");
    }
    for x in &r.replies {
        println!("reply from {}: {}", x.from, show(&x.body));
    }
    for (who, status) in &r.failures {
        println!("no reply: {status} ({who})");
    }
    if r.detail.is_empty() {
        println!("status: {}", r.status);
    } else {
        println!("status: {} ({})", r.status, r.detail);
    }
}

async fn listen(
    conn: &Conn,
    gid: &GroupId,
    secret: &str,
    reply: Option<String>,
) -> anyhow::Result<()> {
    let client = connect(conn).await?;
    let listening = match client.listen(gid, secret).await {
        Ok(l) => l,
        Err(f) => {
            client.close().await;
            return Err(f.into());
        }
    };
    eprintln!(
        "listening on {gid} as {} (Ctrl-C to stop)",
        listening.member()
    );
    let stop = interrupted();
    tokio::pin!(stop);
    let result: anyhow::Result<()> = loop {
        tokio::select! {
            _ = &mut stop => break Ok(()),
            next = listening.next(Duration::from_secs(5)) => match next {
                Ok(None) => continue,
                Ok(Some(msg)) => {
                    let tag = if msg.tag == 0 { String::new() } else { format!(" #{}", msg.tag) };
                    println!("{}{tag}: {}", msg.sender, show(&msg.body));
                    if let Some(text) = &reply {
                        if let Err(f) = listening.reply(msg.id, text.as_bytes().to_vec()).await {
                            eprintln!("reply to {} failed: {f}", msg.sender);
                        }
                    }
                }
                Err(f) => break Err(f.into()),
            },
        }
    };
    let _ = listening.close().await;
    client.close().await;
    result
}

/// Resolves on SIGINT or SIGTERM.
async fn interrupted() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

/// Runs `weft bench group`: prints the figures and the targets, writes JSON.
pub async fn run_bench(args: BenchGroupArgs) -> anyhow::Result<()> {
    let channel = match args.channel.as_str() {
        "inproc" => BenchChannel::Inproc,
        _ => BenchChannel::Tcp,
    };
    let opts = BenchOptions {
        channel,
        nodes: args.nodes,
        members: args.members.clone(),
        iterations: args.iterations.max(10),
        warmup: (args.iterations / 10).max(10),
        payload: args.payload,
    };
    eprintln!(
        "group bench: {} nodes over {}, members {:?}, {} iterations each...",
        opts.nodes, args.channel, opts.members, opts.iterations
    );
    let report = bench(opts).await?;
    print_bench(&report);
    if let Some(path) = &args.json {
        let text = serde_json::to_string_pretty(&report)?;
        std::fs::write(path, text + "\n").with_context(|| format!("writing {}", path.display()))?;
        eprintln!("wrote {}", path.display());
    }
    Ok(())
}

fn print_bench(r: &GroupBenchReport) {
    println!(
        "unicast RPC: p50 {:.1} us, p99 {:.1} us",
        r.unicast_p50_us, r.unicast_p99_us
    );
    println!(
        "{:>7} {:>12} {:>12} {:>12} {:>14} {:>14}",
        "members", "send p50", "request p50", "all p50", "seq RPC p50", "par RPC p50"
    );
    for m in &r.members {
        println!(
            "{:>7} {:>10.1}us {:>10.1}us {:>10.1}us {:>12.1}us {:>12.1}us",
            m,
            r.figure(&format!("send_{m}_p50_us")),
            r.figure(&format!("request_{m}_p50_us")),
            r.figure(&format!("all_replies_{m}_p50_us")),
            r.figure(&format!("seq_unicast_{m}_p50_us")),
            r.figure(&format!("par_unicast_{m}_p50_us")),
        );
    }
    let largest = r.members.iter().copied().max().unwrap_or(1);
    let check = |name: &str, value: f64, bound: f64| {
        let ok = value <= bound;
        println!(
            "  {} {name}: {value:.3} <= {bound:.3}",
            if ok { "PASS" } else { "MISS" }
        );
    };
    println!("targets:");
    check(
        &format!("send_{largest}_p50 / unicast_p50"),
        r.send_vs_unicast,
        2.0,
    );
    check(
        &format!("all_replies_{largest}_p50 / seq_unicast_{largest}_p50"),
        r.all_replies_vs_seq_unicast,
        0.3,
    );
}
