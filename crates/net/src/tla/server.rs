//! The server's side of TLA: a [`TlaStream`] is an ordinary TCP connection
//! the server accepted from the peer (through the logger, which it does not
//! see); the transaction's control messages (TX_START, TX_RESTART, the end
//! of its bytes) are calls to the logger's `net` service within the
//! transaction, which makes the logger a participant.
//!
//! Owns the server's positions on the connection: bytes written (server
//! space), bytes read from the socket (server space, replays included) and
//! the peer's bytes consumed (peer space), and skipping to the replay after
//! a restart ([`ServerReads`]). Must never tell the logger a position it has
//! not reached, nor write more than the per-transaction limit within one
//! transaction. Reads happen only when the application reads (no reader
//! task), so a restart's skip position is set before any replayed byte is
//! taken.

use parking_lot::Mutex;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;
use weft_rpc::{Rpc, Transaction};
use weft_wire::{Address, Failure, NodeId, Status, Tid};

use super::conn::ServerReads;
use crate::core::LoggerConfig;
use crate::tca::{NetRequest, NetResponse, SERVICE};

#[derive(Default)]
struct St {
    reads: ServerReads,
    out_pos: u64,
    tx: Option<Tid>,
    tx_aborted: bool,
    tx_in_from: u64,
    tx_out_from: u64,
    need_sync: bool,
}

/// The server's end of a TLA connection.
pub struct TlaStream {
    rpc: Rpc,
    logger: Address,
    conn: String,
    cfg: LoggerConfig,
    st: Mutex<St>,
    rd: tokio::sync::Mutex<OwnedReadHalf>,
    wr: tokio::sync::Mutex<OwnedWriteHalf>,
}

impl TlaStream {
    /// Wraps `tcp`, accepted from a peer whose packets pass through the
    /// logger node `logger`; control calls go through `rpc`.
    /// `cfg.max_hold` bounds a transaction's reads and writes.
    ///
    /// Fails with AddrError when the socket has no peer address.
    pub fn new(
        tcp: TcpStream,
        rpc: Rpc,
        logger: NodeId,
        cfg: LoggerConfig,
    ) -> Result<Self, Failure> {
        let conn = tcp
            .peer_addr()
            .map_err(|e| Failure::new(Status::AddrError, format!("tla: {e}")))?
            .to_string();
        let logger = Address::new(SERVICE, logger)
            .map_err(|e| Failure::new(Status::AddrError, format!("tla: {e}")))?;
        let _ = tcp.set_nodelay(true);
        let (rd, wr) = tcp.into_split();
        Ok(TlaStream {
            rpc,
            logger,
            conn,
            cfg,
            st: Mutex::new(St::default()),
            rd: tokio::sync::Mutex::new(rd),
            wr: tokio::sync::Mutex::new(wr),
        })
    }

    /// The connection's name at the logger (the peer's address).
    pub fn conn(&self) -> &str {
        &self.conn
    }

    async fn control(
        &self,
        tx: Option<&Transaction>,
        req: NetRequest,
    ) -> Result<NetResponse, Failure> {
        match tx {
            Some(tx) => tx.call(&self.logger, req).await,
            None => self.rpc.call(&self.logger, req).await,
        }
    }

    /// TX_START: `tx` uses the connection from now on (its input starts at
    /// the first peer byte not read yet).
    ///
    /// Fails with the logger's status: Unavailable while the previous
    /// transaction is undecided there, Mismatch when another runs, and like
    /// [`Transaction::call`].
    pub async fn start(&self, tx: &Transaction) -> Result<(), Failure> {
        let (in_from, out_from, aborted) = {
            let s = self.st.lock();
            (s.reads.consumed, s.out_pos, s.tx.filter(|_| s.tx_aborted))
        };
        self.control(
            Some(tx),
            NetRequest::Start {
                conn: self.conn.clone(),
                in_from,
                out_from,
                aborted,
                replay: false,
            },
        )
        .await?;
        let mut s = self.st.lock();
        s.tx = Some(tx.tid());
        s.tx_aborted = false;
        s.tx_in_from = in_from;
        s.tx_out_from = out_from;
        s.need_sync = false;
        Ok(())
    }

    /// TX_RESTART: `tx` re-executes the transaction aborted last; its reads
    /// return that transaction's input again (the logger sends it again
    /// with new sequence numbers).
    ///
    /// Fails with Mismatch when no transaction aborted (or the peer already
    /// closed its side), ProtocolError for an answer that is not a replay
    /// position, and like [`TlaStream::start`].
    pub async fn restart(&self, tx: &Transaction) -> Result<(), Failure> {
        let (old, in_from, out_from) = {
            let s = self.st.lock();
            let Some(old) = s.tx.filter(|_| s.tx_aborted) else {
                return Err(Failure::new(
                    Status::Mismatch,
                    "tla: restart without an aborted transaction",
                ));
            };
            (old, s.tx_in_from, s.out_pos)
        };
        let r = self
            .control(
                Some(tx),
                NetRequest::Start {
                    conn: self.conn.clone(),
                    in_from,
                    out_from,
                    aborted: Some(old),
                    replay: true,
                },
            )
            .await?;
        let NetResponse::ReplayAt(at) = r else {
            return Err(Failure::new(
                Status::ProtocolError,
                format!("tla: unexpected answer to a restart {r:?}"),
            ));
        };
        let mut s = self.st.lock();
        s.reads.restart(in_from, at);
        s.tx = Some(tx.tid());
        s.tx_aborted = false;
        s.tx_out_from = out_from;
        s.need_sync = false;
        Ok(())
    }

    /// Ends the transaction's bytes at the logger and commits it.
    ///
    /// Fails like [`Transaction::commit`]; the transaction then counts as
    /// aborted here (restart it with [`TlaStream::restart`]).
    pub async fn commit(&self, tx: Transaction) -> Result<(), Failure> {
        let (in_end, out_end) = {
            let s = self.st.lock();
            (s.reads.consumed, s.out_pos)
        };
        let res = match self
            .control(
                Some(&tx),
                NetRequest::End {
                    conn: self.conn.clone(),
                    in_end,
                    out_end,
                },
            )
            .await
        {
            Ok(_) => tx.commit().await,
            Err(f) => {
                let _ = tx.abort(&f.detail).await;
                Err(f)
            }
        };
        let mut s = self.st.lock();
        match &res {
            Ok(()) => {
                s.tx = None;
                s.tx_aborted = false;
            }
            Err(_) => {
                s.tx_aborted = true;
                s.need_sync = true;
            }
        }
        res
    }

    /// Aborts the transaction; its output never reaches the peer.
    ///
    /// Fails like [`Transaction::abort`].
    pub async fn abort(&self, tx: Transaction, reason: &str) -> Result<(), Failure> {
        {
            let mut s = self.st.lock();
            s.tx_aborted = true;
            s.need_sync = true;
        }
        tx.abort(reason).await
    }

    /// Reads up to `buf.len()` peer bytes; 0 at the end of the peer's stream.
    ///
    /// Fails with NoBuffer when the transaction already read as much as the
    /// logger keeps for it, ProcDead when the socket failed.
    pub async fn read(&self, buf: &mut [u8]) -> Result<usize, Failure> {
        let mut max = buf.len();
        {
            let s = self.st.lock();
            if s.tx.is_some() && !s.tx_aborted {
                let read = (s.reads.consumed - s.tx_in_from) as usize;
                let room = self.cfg.max_hold.saturating_sub(read);
                if room == 0 && max > 0 {
                    return Err(Failure::new(
                        Status::NoBuffer,
                        format!(
                            "tla: the transaction already read {read} bytes (at most {})",
                            self.cfg.max_hold
                        ),
                    ));
                }
                max = max.min(room);
            }
        }
        if max == 0 {
            return Ok(0);
        }
        let mut rd = self.rd.lock().await;
        loop {
            let n = rd
                .read(&mut buf[..max])
                .await
                .map_err(|e| Failure::new(Status::ProcDead, format!("tla: read: {e}")))?;
            if n == 0 {
                return Ok(0);
            }
            let mut s = self.st.lock();
            let usable = s.reads.take(&buf[..n]);
            let (k, skipped) = (usable.len(), n - usable.len());
            drop(s);
            if k > 0 {
                buf.copy_within(skipped..n, 0);
                return Ok(k);
            }
        }
    }

    /// Reads exactly `buf.len()` bytes.
    ///
    /// Fails like [`TlaStream::read`], and with ProcDead when the stream
    /// ends first.
    pub async fn read_exact(&self, buf: &mut [u8]) -> Result<(), Failure> {
        let mut at = 0;
        while at < buf.len() {
            let n = self.read(&mut buf[at..]).await?;
            if n == 0 {
                return Err(Failure::new(
                    Status::ProcDead,
                    format!("tla: the peer closed after {at} of {} bytes", buf.len()),
                ));
            }
            at += n;
        }
        Ok(())
    }

    /// Writes `data` (held at the logger until the transaction commits;
    /// outside a transaction the logger passes it at once).
    ///
    /// Fails with NoBuffer when the transaction would write more than its
    /// limit (nothing is sent), ProcDead when the connection failed.
    pub async fn write_all(&self, data: &[u8]) -> Result<(), Failure> {
        let sync = {
            let s = self.st.lock();
            if s.tx.is_some() && !s.tx_aborted {
                let written = (s.out_pos - s.tx_out_from) as usize;
                if written + data.len() > self.cfg.max_hold {
                    return Err(Failure::new(
                        Status::NoBuffer,
                        format!(
                            "tla: a {}-byte write would hold {} bytes (at most {})",
                            data.len(),
                            written + data.len(),
                            self.cfg.max_hold
                        ),
                    ));
                }
                None
            } else if s.need_sync {
                Some((s.out_pos, s.tx))
            } else {
                None
            }
        };
        if let Some((out_from, aborted)) = sync {
            self.control(
                None,
                NetRequest::Sync {
                    conn: self.conn.clone(),
                    out_from,
                    aborted,
                },
            )
            .await?;
            let mut s = self.st.lock();
            s.need_sync = false;
            s.tx = None;
            s.tx_aborted = false;
        }
        let mut wr = self.wr.lock().await;
        wr.write_all(data)
            .await
            .map_err(|e| Failure::new(Status::ProcDead, format!("tla: write: {e}")))?;
        self.st.lock().out_pos += data.len() as u64;
        Ok(())
    }

    /// Closes the sending side.
    pub async fn shutdown(&self) {
        let _ = self.wr.lock().await.shutdown().await;
    }
}
