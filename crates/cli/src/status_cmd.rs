//! `weft status`: the cluster as one node sees it.
//!
//! Owns the human and JSON renderings of a node's status report. Must keep
//! the JSON shape stable: an object with a `nodes` array whose items have
//! `id`, `addr` and `alive`.

use serde_json::json;
use weft::admin::{StatusReport, STATUS_SERVICE};

use crate::client::{Client, ClientOpts};

/// Flags of `weft status`.
#[derive(clap::Args, Debug)]
pub struct StatusArgs {
    #[command(flatten)]
    pub client: ClientOpts,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// The JSON form of a status report.
pub fn to_json(r: &StatusReport) -> serde_json::Value {
    let nodes: Vec<serde_json::Value> = r
        .view
        .nodes
        .iter()
        .map(|n| {
            json!({
                "id": n.info.id.0,
                "addr": n.info.addr,
                "alive": n.alive,
                "cause": n.cause.map(|s| s.to_string()),
                "incarnation": n.info.incarnation.0,
                "host": n.info.host,
                "pid": n.info.pid,
                "directory": n.info.directory,
                "services": n.info.services,
                "channel": n.channel.map(|c| c.to_string()),
                "route": n.route,
            })
        })
        .collect();
    json!({
        "node": r.node.0,
        "incarnation": r.incarnation.0,
        "directory": r.view.directory.map(|d| d.0),
        "nodes": nodes,
        "services": r.services,
        "transactions": { "live": r.live_transactions, "stats": r.tm },
        "log": r.log,
        "transport": r.transport,
        "refusals": r.refusals,
        "recovery": r.recovery,
        "data_dir": r.data_dir,
    })
}

/// Runs `weft status`.
pub async fn run(args: StatusArgs) -> anyhow::Result<()> {
    let client = Client::connect(&args.client).await?;
    let report: StatusReport = client.call_here(STATUS_SERVICE, ()).await?;
    client.close().await;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&to_json(&report))?);
        return Ok(());
    }
    println!(
        "node {} (incarnation {}), directory {}",
        report.node,
        report.incarnation,
        report
            .view
            .directory
            .map(|d| d.to_string())
            .unwrap_or_else(|| "unknown".into())
    );
    println!(
        "{:<5} {:<22} {:<9} {:<7} {:<30} SERVICES",
        "NODE", "ADDR", "ALIVE", "CHAN", "ROUTE"
    );
    for n in &report.view.nodes {
        let alive = match (n.alive, n.cause) {
            (true, _) => "yes".to_string(),
            (false, Some(c)) => c.to_string(),
            (false, None) => "no".to_string(),
        };
        let me = if n.info.id == report.node { "*" } else { "" };
        println!(
            "{:<5} {:<22} {:<9} {:<7} {:<30} {}",
            format!("{}{}", n.info.id, me),
            n.info.addr.clone().unwrap_or_else(|| "-".into()),
            alive,
            n.channel
                .map(|c| c.to_string())
                .unwrap_or_else(|| if me.is_empty() {
                    "-".into()
                } else {
                    "self".into()
                }),
            n.route.clone().unwrap_or_default(),
            n.info.services.join(",")
        );
    }
    let t = &report.tm;
    println!(
        "transactions: {} live; begun {}, committed {} ({} read-only), aborted {}; forced records {}",
        report.live_transactions, t.begun, t.committed, t.committed_read_only, t.aborted, t.forced_records
    );
    println!(
        "log: {} appends, {} syncs; frames sent: {} requests, {} responses, {} messages",
        report.log.appends,
        report.log.syncs,
        report.transport.requests,
        report.transport.responses,
        report.transport.messages
    );
    for r in &report.refusals {
        println!("refused: {r}");
    }
    Ok(())
}
