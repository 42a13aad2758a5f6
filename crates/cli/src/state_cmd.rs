//! `weft state`: list a node's shared segments, print one decoded through its
//! stored type descriptors, and watch its versions under a coherence model.
//!
//! Owns the shell forms of the `state` service's requests. Never interprets a
//! segment with compiled-in types: everything printed comes from the
//! descriptors the segment stores.

use std::time::{Duration, Instant};

use weft::admin::{TxReply, TxRequest, TX_SERVICE};
use weft_state::core::codec;
use weft_state::core::mip::BlockRef;
use weft_state::core::segment::{SegLimits, Segment};
use weft_state::core::twin::{collect, Twins, Writer};
use weft_state::core::types::{TypeDesc, Unit};
use weft_state::service::{HomeReply, HomeRequest, WireRefresh};
use weft_state::LockMode;
use weft_state::{Coherence, SegUrl, SERVICE};
use weft_wire::{Address, NodeId, ServiceName, Tid, TxContext};

use crate::client::{parse_duration, Client, ClientOpts};

/// `weft state` subcommands.
#[derive(clap::Subcommand, Debug)]
pub enum StateCmd {
    /// List the segments a node is home to (versions, sizes, lock holders).
    Ls {
        #[command(flatten)]
        client: ClientOpts,
        /// The home node (default: the one --node points at).
        #[arg(long)]
        at: Option<u32>,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Print a segment's blocks, decoded through its stored type descriptors.
    Cat {
        #[command(flatten)]
        client: ClientOpts,
        /// The segment, `weft://<node id>/<path>`.
        url: String,
        /// The segment's access secret.
        #[arg(long = "seg-secret", env = "WEFT_STATE_SECRET", default_value = "")]
        seg_secret: String,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Set an `i64` block (allocated when absent) inside `$WEFT_TX` when
    /// set, else inside a transaction of its own committed on success.
    Set {
        #[command(flatten)]
        client: ClientOpts,
        /// The segment, `weft://<node id>/<path>`.
        url: String,
        /// The block's name.
        block: String,
        /// The value.
        #[arg(allow_negative_numbers = true)]
        value: i64,
        /// The segment's access secret.
        #[arg(long = "seg-secret", env = "WEFT_STATE_SECRET", default_value = "")]
        seg_secret: String,
        /// Create the segment when absent.
        #[arg(long)]
        create: bool,
        /// Run inside this transaction (default: $WEFT_TX).
        #[arg(long, env = "WEFT_TX")]
        tx: Option<Tid>,
    },
    /// Print each new version of a segment and the bytes its refresh moved.
    Watch {
        #[command(flatten)]
        client: ClientOpts,
        /// The segment, `weft://<node id>/<path>`.
        url: String,
        /// The segment's access secret.
        #[arg(long = "seg-secret", env = "WEFT_STATE_SECRET", default_value = "")]
        seg_secret: String,
        /// full | delta:N | temporal:DUR | diff:PCT.
        #[arg(long, default_value = "full")]
        coherence: String,
        /// How often to ask the home when the model does not say otherwise.
        #[arg(long, default_value = "200ms", value_parser = parse_duration)]
        interval: Duration,
        /// Stop after this many new versions (default: run until killed).
        #[arg(long)]
        count: Option<u64>,
    },
}

fn home(node: NodeId) -> Address {
    Address {
        service: ServiceName::new(SERVICE).expect("valid"),
        instance: 0,
        node,
    }
}

fn parse_url(s: &str) -> anyhow::Result<(SegUrl, NodeId)> {
    let url: SegUrl = s.parse()?;
    let node: u32 = url
        .node
        .parse()
        .map_err(|_| anyhow::anyhow!("{url}: the home must be a node id"))?;
    Ok((url, NodeId(node)))
}

/// Brings `seg` (or nothing) up to date; returns the bytes moved.
async fn fetch(
    client: &Client,
    url: &SegUrl,
    node: NodeId,
    secret: &str,
    seg: &mut Option<Segment>,
) -> anyhow::Result<u64> {
    let have = seg.as_ref().map(Segment::version);
    let req = HomeRequest::Fetch {
        path: url.path.clone(),
        secret: secret.as_bytes().to_vec(),
        have,
        tentative_of: None,
        // A one-shot process serves no peers: no notices.
        peer: false,
    };
    let reply: HomeReply = client.call(&home(node), req, None).await?;
    let HomeReply::Refresh { refresh, .. } = reply else {
        anyhow::bail!("unexpected reply")
    };
    Ok(match refresh {
        WireRefresh::Current => 0,
        WireRefresh::Diff(b) => {
            let d = codec::decode_diff(&b, usize::MAX)?;
            match seg.as_mut() {
                Some(s) => s.apply(&d)?,
                None => anyhow::bail!("a diff for a copy we do not have"),
            }
            b.len() as u64
        }
        WireRefresh::Image(b) => {
            let img = codec::decode_image(&b, usize::MAX)?;
            *seg = Some(Segment::from_image(img, SegLimits::default())?);
            b.len() as u64
        }
    })
}

/// Renders `units` of type `ty` as JSON text, consuming them.
fn render(ty: &TypeDesc, units: &mut std::slice::Iter<'_, Unit>) -> String {
    match ty {
        TypeDesc::Prim(_) => units
            .next()
            .map(Unit::render)
            .unwrap_or_else(|| "null".into()),
        TypeDesc::Array { elem, len } => {
            let v: Vec<String> = (0..*len).map(|_| render(elem, units)).collect();
            format!("[{}]", v.join(","))
        }
        TypeDesc::Record { fields, .. } => {
            let v: Vec<String> = fields
                .iter()
                .map(|f| format!("{:?}:{}", f.name, render(&f.ty, units)))
                .collect();
            format!("{{{}}}", v.join(","))
        }
    }
}

/// Runs `weft state ...`.
pub async fn run(cmd: StateCmd) -> anyhow::Result<()> {
    match cmd {
        StateCmd::Ls { client, at, json } => {
            let c = Client::connect(&client).await?;
            let node = at.map(NodeId).unwrap_or(c.gateway());
            let reply: HomeReply = c.call(&home(node), HomeRequest::List, None).await?;
            c.close().await;
            let HomeReply::List(segs) = reply else {
                anyhow::bail!("unexpected reply")
            };
            if json {
                println!("{}", serde_json::to_string_pretty(&segs)?);
            } else {
                println!(
                    "{:<40} {:>8} {:>8} {:>10} {:>8}",
                    "URL", "VERSION", "BLOCKS", "UNITS", "LOCKS"
                );
                for s in segs {
                    println!(
                        "{:<40} {:>8} {:>8} {:>10} {:>8}",
                        s.url, s.version, s.blocks, s.units, s.holders
                    );
                }
            }
            Ok(())
        }
        StateCmd::Cat {
            client,
            url,
            seg_secret: secret,
            json,
        } => {
            let (url, node) = parse_url(&url)?;
            let c = Client::connect(&client).await?;
            let mut seg = None;
            fetch(&c, &url, node, &secret, &mut seg).await?;
            c.close().await;
            let seg = seg.ok_or_else(|| anyhow::anyhow!("no copy"))?;
            let blocks: Vec<String> = seg
                .blocks()
                .map(|(serial, b)| {
                    let name = b.name.as_deref().map(|n| format!("{n:?}")).unwrap_or("null".into());
                    let value = render(&b.ty, &mut b.data.iter());
                    if json {
                        format!(
                            "{{\"serial\":{serial},\"name\":{name},\"type\":{:?},\"value\":{value}}}",
                            b.ty.render()
                        )
                    } else {
                        format!("#{serial} {name} : {} = {value}", b.ty.render())
                    }
                })
                .collect();
            if json {
                println!(
                    "{{\"url\":\"{}\",\"version\":{},\"blocks\":[{}]}}",
                    seg.url(),
                    seg.version(),
                    blocks.join(",")
                );
            } else {
                println!("{} version {}", seg.url(), seg.version());
                for b in blocks {
                    println!("{b}");
                }
            }
            Ok(())
        }
        StateCmd::Set {
            client,
            url,
            block,
            value,
            seg_secret: secret,
            create,
            tx,
        } => {
            let (url, node) = parse_url(&url)?;
            let c = Client::connect(&client).await?;
            let r = set(&c, &url, node, &block, value, &secret, create, tx).await;
            c.close().await;
            r
        }
        StateCmd::Watch {
            client,
            url,
            seg_secret: secret,
            coherence,
            interval,
            count,
        } => {
            let (url, node) = parse_url(&url)?;
            let model: Coherence = coherence.parse()?;
            // Without version notices from the home, a watcher polls: every
            // DUR under temporal:DUR, every --interval otherwise.
            let every = match model {
                Coherence::Temporal(t) => t,
                _ => interval,
            };
            let c = Client::connect(&client).await?;
            let mut seg = None;
            let mut seen = 0;
            let mut last: Option<u64> = None;
            loop {
                let t = Instant::now();
                let moved = fetch(&c, &url, node, &secret, &mut seg).await?;
                let v = seg.as_ref().map_or(0, Segment::version);
                if last != Some(v) {
                    println!(
                        "version {v} moved {moved} bytes in {} us",
                        t.elapsed().as_micros()
                    );
                    last = Some(v);
                    seen += 1;
                    if count.is_some_and(|n| seen >= n) {
                        break;
                    }
                }
                tokio::time::sleep(every).await;
            }
            c.close().await;
            Ok(())
        }
    }
}

/// `weft state set`: one write critical section from a shell.
#[allow(clippy::too_many_arguments)]
async fn set(
    c: &Client,
    url: &SegUrl,
    node: NodeId,
    block: &str,
    value: i64,
    secret: &str,
    create: bool,
    tx: Option<Tid>,
) -> anyhow::Result<()> {
    let open = HomeRequest::Open {
        path: url.path.clone(),
        secret: secret.as_bytes().to_vec(),
        create,
    };
    let _: HomeReply = c.call(&home(node), open, None).await?;
    let tx_addr = |node| Address {
        service: ServiceName::new(TX_SERVICE).expect("valid"),
        instance: 0,
        node,
    };
    let (ctx, own) = match tx {
        Some(tid) => (TxContext::new(tid), false),
        None => {
            let r: TxReply = c
                .call_here(TX_SERVICE, TxRequest::Begin { timeout_ms: None })
                .await?;
            let TxReply::Begun(ctx) = r else {
                anyhow::bail!("unexpected reply {r:?}")
            };
            (ctx, true)
        }
    };
    let tid = ctx.tid;
    let work = async {
        let lock = HomeRequest::Lock {
            path: url.path.clone(),
            secret: secret.as_bytes().to_vec(),
            mode: LockMode::Write,
            have: None,
            tentative_of: None,
            // It exits before the root ends: its diffs go to the home.
            peer: false,
        };
        let reply: HomeReply = c.call(&home(node), lock, Some(ctx.clone())).await?;
        let HomeReply::Refresh {
            refresh, tentative, ..
        } = reply
        else {
            anyhow::bail!("unexpected reply")
        };
        let WireRefresh::Image(b) = refresh else {
            anyhow::bail!("expected a whole segment")
        };
        let mut seg =
            Segment::from_image(codec::decode_image(&b, usize::MAX)?, SegLimits::default())?;
        if let Some(t) = tentative {
            seg.apply(&codec::decode_diff(&t, usize::MAX)?)?;
        }
        let mut twins = Twins::new(&seg);
        {
            let mut w = Writer::new(&mut seg, &mut twins)?;
            let r = BlockRef::Name(block.to_string());
            match w.segment().lookup(&r) {
                Ok(_) => w.write(&r, &value)?,
                Err(_) => {
                    w.alloc(Some(block), &value)?;
                }
            }
        }
        let diff = collect(&mut seg, twins);
        if diff.target != diff.base {
            let submit = HomeRequest::Submit {
                path: url.path.clone(),
                diff: codec::encode_diff(&diff),
            };
            let _: HomeReply = c.call(&home(node), submit, Some(ctx.clone())).await?;
        }
        Ok(())
    };
    let r = work.await;
    if own {
        let req = match &r {
            Ok(()) => TxRequest::Commit(tid),
            Err(e) => TxRequest::Abort(tid, e.to_string()),
        };
        let done: Result<TxReply, _> = c.call(&tx_addr(tid.node), req, None).await;
        if r.is_ok() {
            done?;
        }
    }
    r
}
