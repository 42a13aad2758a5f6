//! `weft call`: one call from the command line, for diagnostics; inside
//! `$WEFT_TX` when set (a shell's `weft tx begin`, or the program's default
//! transaction under `weft run`), so the called service joins it.
//!
//! Owns nothing but the mapping from arguments to a raw call: the payload is
//! sent as bytes and the answer printed as text (hex when not UTF-8).

use weft_wire::{Address, Payload, TxContext, Xid};

use crate::client::{Client, ClientOpts};

/// Flags of `weft call`.
#[derive(clap::Args, Debug)]
pub struct CallArgs {
    #[command(flatten)]
    pub client: ClientOpts,
    /// Make the call on behalf of this (sub-)transaction (default:
    /// $WEFT_TX; none when unset).
    #[arg(long, env = "WEFT_TX")]
    pub tx: Option<Xid>,
    /// The service to call, as service[.instance]@node (e.g. echo@2).
    pub address: Address,
    /// The payload, sent as raw bytes.
    pub payload: String,
}

/// Renders bytes as text, or hex when they are not UTF-8.
pub fn show(bytes: &[u8]) -> String {
    match std::str::from_utf8(bytes) {
        Ok(s) => s.to_string(),
        Err(_) => bytes.iter().map(|b| format!("{b:02x}")).collect(),
    }
}

/// The context a shell command sends for `xid` (the node fills in the
/// deadline and baggage it keeps for the transaction).
pub fn context(xid: Xid) -> TxContext {
    TxContext {
        path: xid.path,
        ..TxContext::new(xid.tid)
    }
}

/// Runs `weft call`.
pub async fn run(args: CallArgs) -> anyhow::Result<()> {
    let client = Client::connect(&args.client).await?;
    let started = std::time::Instant::now();
    let result = client
        .call_payload(
            &args.address,
            Payload::bytes(args.payload.into_bytes()),
            args.tx.map(context),
        )
        .await;
    let took = started.elapsed();
    client.close().await;
    let payload = result?;
    let bytes = payload.into_bytes()?;
    println!("{}", show(&bytes));
    eprintln!(
        "({} bytes from {} in {:.1} ms)",
        bytes.len(),
        args.address,
        took.as_secs_f64() * 1e3
    );
    Ok(())
}
