//! `weft tx`: drive a transaction from a shell (QuickSilver's shell
//! transaction commands): begin prints the id and an `export WEFT_TX=...`
//! line; later commands use `$WEFT_TX`.
//!
//! Owns the shell-facing forms of the `_tx` service.

use weft::admin::{TxReply, TxRequest, TX_SERVICE};
use weft_wire::{Address, Failure, ServiceName, Status, Tid};

use crate::client::{parse_duration, Client, ClientOpts};

/// `weft tx` subcommands.
#[derive(clap::Subcommand, Debug)]
pub enum TxCmd {
    /// Begin a transaction coordinated by --node.
    Begin {
        #[command(flatten)]
        client: ClientOpts,
        /// Abort it if not committed within this time.
        #[arg(long, value_parser = parse_duration)]
        deadline: Option<std::time::Duration>,
    },
    /// Commit (sent to the transaction's coordinator).
    Commit(TidArgs),
    /// Abort.
    Abort(TidArgs),
    /// Show a transaction's state at its coordinator.
    Status(TidArgs),
    /// List the transactions live at --node, with their participant trees.
    List {
        #[command(flatten)]
        client: ClientOpts,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
}

/// A transaction id argument (default: $WEFT_TX).
#[derive(clap::Args, Debug)]
pub struct TidArgs {
    #[command(flatten)]
    pub client: ClientOpts,
    /// The transaction (default: $WEFT_TX).
    #[arg(env = "WEFT_TX")]
    pub tid: Tid,
}

fn tx_service(node: weft_wire::NodeId) -> Address {
    Address {
        service: ServiceName::new(TX_SERVICE).expect("valid name"),
        instance: 0,
        node,
    }
}

/// Runs `weft tx ...`.
pub async fn run(cmd: TxCmd) -> anyhow::Result<()> {
    match cmd {
        TxCmd::Begin { client, deadline } => {
            let c = Client::connect(&client).await?;
            let reply: TxReply = c
                .call_here(
                    TX_SERVICE,
                    TxRequest::Begin {
                        timeout_ms: deadline.map(|d| d.as_millis() as u64),
                    },
                )
                .await?;
            c.close().await;
            let TxReply::Begun(ctx) = reply else {
                anyhow::bail!("unexpected reply {reply:?}")
            };
            println!("{}", ctx.tid);
            println!("export WEFT_TX={}", ctx.tid);
        }
        TxCmd::Commit(a) => {
            let c = Client::connect(&a.client).await?;
            let r: Result<TxReply, Failure> = c
                .call(&tx_service(a.tid.node), TxRequest::Commit(a.tid), None)
                .await;
            c.close().await;
            r?;
            println!("{} committed", a.tid);
        }
        TxCmd::Abort(a) => {
            let c = Client::connect(&a.client).await?;
            let r: Result<TxReply, Failure> = c
                .call(
                    &tx_service(a.tid.node),
                    TxRequest::Abort(a.tid, "aborted from the shell".into()),
                    None,
                )
                .await;
            c.close().await;
            r?;
            println!("{} aborted", a.tid);
        }
        TxCmd::Status(a) => {
            let c = Client::connect(&a.client).await?;
            let r: TxReply = c
                .call(&tx_service(a.tid.node), TxRequest::Status(a.tid), None)
                .await?;
            c.close().await;
            match r {
                TxReply::Status { live: Some(s), .. } => {
                    println!(
                        "{} {} at node {}{}: children {:?}, resources {:?}, {} ms old",
                        s.tid,
                        s.phase,
                        a.tid.node,
                        if s.in_doubt { " (in doubt)" } else { "" },
                        s.children.iter().map(|n| n.0).collect::<Vec<_>>(),
                        s.resources,
                        s.age_ms
                    );
                }
                TxReply::Status {
                    live: None,
                    outcome: Some(o),
                } => println!("{} {}", a.tid, o),
                TxReply::Status {
                    live: None,
                    outcome: None,
                } => {
                    return Err(Failure::new(
                        Status::NoSuchTransaction,
                        format!(
                            "{} is unknown at its coordinator (aborted, or long finished)",
                            a.tid
                        ),
                    )
                    .into())
                }
                other => anyhow::bail!("unexpected reply {other:?}"),
            }
        }
        TxCmd::List { client, json } => {
            let c = Client::connect(&client).await?;
            let r: TxReply = c.call_here(TX_SERVICE, TxRequest::List).await?;
            c.close().await;
            let TxReply::List(list) = r else {
                anyhow::bail!("unexpected reply {r:?}")
            };
            if json {
                println!("{}", serde_json::to_string_pretty(&list)?);
                return Ok(());
            }
            println!(
                "{:<18} {:<6} {:<11} {:<7} {:<8} {:<12} RESOURCES",
                "TID", "ROLE", "PHASE", "PARENT", "AGE", "CHILDREN"
            );
            for s in list {
                println!(
                    "{:<18} {:<6} {:<11} {:<7} {:<8} {:<12} {}",
                    s.tid.to_string(),
                    if s.coordinator { "coord" } else { "part" },
                    format!("{}{}", s.phase, if s.in_doubt { "!" } else { "" }),
                    s.parent
                        .map(|p| p.to_string())
                        .unwrap_or_else(|| "-".into()),
                    format!("{}ms", s.age_ms),
                    s.children
                        .iter()
                        .map(|n| n.to_string())
                        .collect::<Vec<_>>()
                        .join(","),
                    s.resources.join(",")
                );
            }
        }
    }
    Ok(())
}
