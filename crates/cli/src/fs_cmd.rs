//! `weft fs`: use a node's transactional file volumes from a shell, inside
//! `$WEFT_TX` when set, else inside a transaction of its own committed when
//! the command succeeds (QuickSilver's default transactions).
//!
//! Owns the shell forms of file-store requests. Must never move a file's
//! content through memory whole: `put` and `cat` stream in bounded chunks.

use std::io::{Read, Write};
use std::path::PathBuf;

use bytes::Bytes;
use weft::admin::{TxReply, TxRequest, TX_SERVICE};
use weft_fs::{FsOp, FsReply, FsRequest, FsResponse, ReadMode, REMOTE_CHUNK};
use weft_wire::{Address, Failure, NodeId, ServiceName, Tid, TxContext};

use crate::client::{Client, ClientOpts};

/// `weft fs` subcommands.
#[derive(clap::Subcommand, Debug)]
pub enum FsCmd {
    /// Write a file from stdin (or --from FILE), replacing its content;
    /// with --offset, write into the existing file at that offset instead.
    Put {
        #[command(flatten)]
        target: Target,
        /// The file in the volume.
        path: String,
        /// Read this local file instead of stdin.
        #[arg(long)]
        from: Option<PathBuf>,
        /// Write at this offset of the existing file (a range write) instead
        /// of replacing it.
        #[arg(long)]
        offset: Option<u64>,
    },
    /// Print a file.
    Cat {
        #[command(flatten)]
        target: Target,
        /// The file in the volume.
        path: String,
    },
    /// List a directory ("" or nothing: the volume's root).
    Ls {
        #[command(flatten)]
        target: Target,
        /// The directory.
        #[arg(default_value = "")]
        path: String,
    },
    /// Delete a file.
    Rm {
        #[command(flatten)]
        target: Target,
        /// The file.
        path: String,
    },
    /// Rename a file.
    Mv {
        #[command(flatten)]
        target: Target,
        /// The current name.
        from: String,
        /// The new name.
        to: String,
    },
    /// Create a directory.
    Mkdir {
        #[command(flatten)]
        target: Target,
        /// The directory.
        path: String,
    },
    /// Remove an empty directory.
    Rmdir {
        #[command(flatten)]
        target: Target,
        /// The directory.
        path: String,
    },
}

/// Which node, volume and transaction.
#[derive(clap::Args, Debug)]
pub struct Target {
    #[command(flatten)]
    pub client: ClientOpts,
    /// The node serving the volume (default: the one --node points at).
    #[arg(long)]
    pub at: Option<u32>,
    /// The volume's name on that node.
    #[arg(long)]
    pub volume: String,
    /// Run inside this transaction (default: $WEFT_TX, else a transaction of
    /// its own).
    #[arg(long, env = "WEFT_TX")]
    pub tx: Option<Tid>,
}

struct Session {
    client: Client,
    addr: Address,
    volume: String,
    ctx: TxContext,
}

impl Session {
    async fn op(&self, op: FsOp) -> anyhow::Result<FsReply> {
        let req = FsRequest {
            volume: self.volume.clone(),
            op,
        };
        let resp: FsResponse = self
            .client
            .call(&self.addr, req, Some(self.ctx.clone()))
            .await?;
        Ok(resp.map_err(Failure::from)?)
    }
}

/// Runs `weft fs ...`.
pub async fn run(cmd: FsCmd) -> anyhow::Result<()> {
    let target = match &cmd {
        FsCmd::Put { target, .. }
        | FsCmd::Cat { target, .. }
        | FsCmd::Ls { target, .. }
        | FsCmd::Rm { target, .. }
        | FsCmd::Mv { target, .. }
        | FsCmd::Mkdir { target, .. }
        | FsCmd::Rmdir { target, .. } => target,
    };
    let client = Client::connect(&target.client).await?;
    let at = target.at.map(NodeId).unwrap_or(client.gateway());
    let addr = Address {
        service: ServiceName::new(weft_fs::SERVICE)?,
        instance: 0,
        node: at,
    };
    let (ctx, own) = match target.tx {
        Some(tid) => (TxContext::new(tid), false),
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
    let s = Session {
        client,
        addr,
        volume: target.volume.clone(),
        ctx,
    };
    let result = execute(&s, cmd).await;
    let tid = s.ctx.tid;
    let tx_addr = Address {
        service: ServiceName::new(TX_SERVICE)?,
        instance: 0,
        node: tid.node,
    };
    let outcome = match result {
        Ok(()) if own => s
            .client
            .call::<_, TxReply>(&tx_addr, TxRequest::Commit(tid), None)
            .await
            .map(|_| ())
            .map_err(anyhow::Error::new),
        Ok(()) => Ok(()),
        Err(e) => {
            if own {
                let _: Result<TxReply, _> = s
                    .client
                    .call(&tx_addr, TxRequest::Abort(tid, format!("{e:#}")), None)
                    .await;
            }
            Err(e)
        }
    };
    s.client.close().await;
    outcome
}

async fn execute(s: &Session, cmd: FsCmd) -> anyhow::Result<()> {
    match cmd {
        FsCmd::Put {
            path, from, offset, ..
        } => {
            let mut input: Box<dyn Read + Send> = match from {
                Some(f) => Box::new(std::fs::File::open(&f)?),
                None => Box::new(std::io::stdin()),
            };
            if offset.is_none() {
                s.op(FsOp::Create {
                    path: path.clone(),
                    exclusive: false,
                })
                .await?;
            }
            let mut buf = vec![0u8; REMOTE_CHUNK];
            let mut offset = offset.unwrap_or(0);
            loop {
                let n = fill(&mut input, &mut buf)?;
                if n == 0 {
                    break;
                }
                s.op(FsOp::Write {
                    path: path.clone(),
                    offset,
                    data: Bytes::copy_from_slice(&buf[..n]),
                })
                .await?;
                offset += n as u64;
            }
        }
        FsCmd::Cat { path, .. } => {
            s.op(FsOp::Open { path: path.clone() }).await?;
            let mut out = std::io::stdout().lock();
            let mut offset = 0u64;
            loop {
                let r = s
                    .op(FsOp::Read {
                        path: path.clone(),
                        offset,
                        len: REMOTE_CHUNK as u64,
                        mode: ReadMode::Degree2,
                    })
                    .await?;
                let FsReply::Data(d) = r else {
                    anyhow::bail!("unexpected reply {r:?}")
                };
                if d.is_empty() {
                    break;
                }
                out.write_all(&d)?;
                offset += d.len() as u64;
            }
            out.flush()?;
            drop(out);
            s.op(FsOp::Close { path }).await?;
        }
        FsCmd::Ls { path, .. } => {
            let r = s.op(FsOp::List { path }).await?;
            let FsReply::Entries(entries) = r else {
                anyhow::bail!("unexpected reply {r:?}")
            };
            for e in entries {
                let kind = match e.meta.kind {
                    weft_fs::FileKind::Dir => "d",
                    weft_fs::FileKind::File => "f",
                    weft_fs::FileKind::Symlink => "l",
                    weft_fs::FileKind::Other => "?",
                };
                println!("{kind} {:>12} {}", e.meta.len, e.name);
            }
        }
        FsCmd::Rm { path, .. } => {
            s.op(FsOp::Delete { path }).await?;
        }
        FsCmd::Mv { from, to, .. } => {
            s.op(FsOp::Rename { from, to }).await?;
        }
        FsCmd::Mkdir { path, .. } => {
            s.op(FsOp::Mkdir { path }).await?;
        }
        FsCmd::Rmdir { path, .. } => {
            s.op(FsOp::Rmdir { path }).await?;
        }
    }
    Ok(())
}

fn fill(r: &mut dyn Read, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut done = 0;
    while done < buf.len() {
        match r.read(&mut buf[done..]) {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(done)
}
