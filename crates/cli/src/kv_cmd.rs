//! `weft kv`: read and write a node's KV store from a shell, inside
//! `$WEFT_TX` when set, else inside a default transaction committed when the
//! command succeeds (QuickSilver's default transactions).
//!
//! Owns the shell forms of KV requests.

use bytes::Bytes;
use weft::admin::{TxReply, TxRequest, TX_SERVICE};
use weft_kv::{KvRequest, KvResponse, Op, Reply};
use weft_wire::{Address, NodeId, ServiceName, Xid};

use crate::call_cmd::show;
use crate::client::{Client, ClientOpts};

/// `weft kv` subcommands.
#[derive(clap::Subcommand, Debug)]
pub enum KvCmd {
    /// Print a key's value.
    Get(KeyArgs),
    /// Set a key.
    Put {
        #[command(flatten)]
        key: KeyArgs,
        /// The value.
        value: String,
    },
    /// Delete a key.
    Del(KeyArgs),
}

/// Which store and key.
#[derive(clap::Args, Debug)]
pub struct KeyArgs {
    #[command(flatten)]
    pub client: ClientOpts,
    /// The node whose store to use (default: the one --node points at).
    #[arg(long)]
    pub at: Option<u32>,
    /// Run inside this (sub-)transaction (default: $WEFT_TX, else a
    /// transaction of its own).
    #[arg(long, env = "WEFT_TX")]
    pub tx: Option<Xid>,
    /// The key.
    pub key: String,
}

/// Runs `weft kv ...`.
pub async fn run(cmd: KvCmd) -> anyhow::Result<()> {
    let (args, op) = match cmd {
        KvCmd::Get(k) => {
            let key = Bytes::from(k.key.clone().into_bytes());
            (k, Op::Get(key))
        }
        KvCmd::Put { key, value } => {
            let k = Bytes::from(key.key.clone().into_bytes());
            (key, Op::Put(k, Bytes::from(value.into_bytes())))
        }
        KvCmd::Del(k) => {
            let key = Bytes::from(k.key.clone().into_bytes());
            (k, Op::Delete(key))
        }
    };
    let client = Client::connect(&args.client).await?;
    let at = args.at.map(NodeId).unwrap_or(client.gateway());
    let kv = Address {
        service: ServiceName::new(weft_kv::SERVICE)?,
        instance: 0,
        node: at,
    };
    let tx_addr = |node| Address {
        service: ServiceName::new(TX_SERVICE).expect("valid"),
        instance: 0,
        node,
    };
    let (ctx, own) = match args.tx {
        Some(xid) => (crate::call_cmd::context(xid), false),
        None => {
            let r: TxReply = client
                .call_here(TX_SERVICE, TxRequest::Begin { timeout_ms: None })
                .await?;
            let TxReply::Begun(ctx) = r else {
                anyhow::bail!("unexpected reply {r:?}")
            };
            (ctx, true)
        }
    };
    let tid = ctx.tid;
    let result: Result<KvResponse, _> = client.call(&kv, KvRequest(vec![op]), Some(ctx)).await;
    let outcome = match result {
        Ok(resp) => {
            if own {
                let r: Result<TxReply, _> = client
                    .call(&tx_addr(tid.node), TxRequest::Commit(tid), None)
                    .await;
                r?;
            }
            Ok(resp)
        }
        Err(f) => {
            if own {
                let _: Result<TxReply, _> = client
                    .call(
                        &tx_addr(tid.node),
                        TxRequest::Abort(tid, f.detail.clone()),
                        None,
                    )
                    .await;
            }
            Err(f)
        }
    };
    client.close().await;
    match outcome?.0.pop() {
        Some(Reply::Value(Some(v))) => println!("{}", show(&v)),
        Some(Reply::Value(None)) => {
            eprintln!("(no such key)");
            std::process::exit(1);
        }
        _ => {}
    }
    Ok(())
}
