//! The server's side of the control stream, shared by 2CA's
//! [`crate::tca::server::ProxiedStream`] and TLA's
//! [`crate::tla::server::TlaStream`]: the part of a server's connection that
//! does not depend on how peer bytes reach it.
//!
//! Owns the connection's name at the logger, the server's write position
//! (server bytes written since the connection began, aborted ones
//! included), the running or last aborted transaction and where its input
//! and output began, the control calls (TX_START, TX_RESTART, the end of
//! the transaction's bytes before its commit, and the resynchronisation of
//! a write outside a transaction after an abort), and the bound on a
//! transaction's reads and writes. The read side (positions consumed, the
//! receive buffer, skipping to a replay) belongs to the architecture, which
//! passes its consumed position in. Must never tell the logger a position
//! the server has not reached, nor write more than the per-transaction
//! limit within one transaction.

use parking_lot::Mutex;
use tokio::io::AsyncWriteExt;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;
use weft_rpc::{Rpc, Transaction};
use weft_wire::{Address, Failure, NodeId, Status, Tid};

use super::{NetRequest, NetResponse, SERVICE};
use crate::core::LoggerConfig;

#[derive(Default)]
struct TxState {
    out_pos: u64,
    /// The running (or last aborted, not yet restarted) transaction.
    tx: Option<Tid>,
    tx_aborted: bool,
    tx_in_from: u64,
    tx_out_from: u64,
    /// An abort left output positions the logger must be told about before
    /// writing outside a transaction.
    need_sync: bool,
}

impl TxState {
    fn running(&self) -> bool {
        self.tx.is_some() && !self.tx_aborted
    }

    fn begun(&mut self, tid: Tid, out_from: u64) {
        self.tx = Some(tid);
        self.tx_aborted = false;
        self.tx_out_from = out_from;
        self.need_sync = false;
    }

    fn ended(&mut self, committed: bool) {
        if committed {
            self.tx = None;
            self.tx_aborted = false;
        } else {
            self.tx_aborted = true;
            self.need_sync = true;
        }
    }
}

/// The server's end of a control stream (see the module comment).
pub(crate) struct ControlStream {
    /// Prefix of error texts ("net", "tla").
    who: &'static str,
    rpc: Rpc,
    logger: Address,
    conn: String,
    cfg: LoggerConfig,
    st: Mutex<TxState>,
    wr: tokio::sync::Mutex<OwnedWriteHalf>,
}

impl ControlStream {
    /// Wraps `tcp`, whose logger is the node `logger`; the connection is
    /// named by the socket's peer address. Returns the read half, which the
    /// architecture reads.
    ///
    /// Fails with AddrError when the socket has no peer address.
    pub(crate) fn new(
        who: &'static str,
        tcp: TcpStream,
        rpc: Rpc,
        logger: NodeId,
        cfg: LoggerConfig,
    ) -> Result<(Self, OwnedReadHalf), Failure> {
        let conn = tcp
            .peer_addr()
            .map_err(|e| Failure::new(Status::AddrError, format!("{who}: {e}")))?
            .to_string();
        let logger = Address::new(SERVICE, logger)
            .map_err(|e| Failure::new(Status::AddrError, format!("{who}: {e}")))?;
        let _ = tcp.set_nodelay(true);
        let (rd, wr) = tcp.into_split();
        let ctl = ControlStream {
            who,
            rpc,
            logger,
            conn,
            cfg,
            st: Mutex::new(TxState::default()),
            wr: tokio::sync::Mutex::new(wr),
        };
        Ok((ctl, rd))
    }

    /// The connection's name at the logger.
    pub(crate) fn conn(&self) -> &str {
        &self.conn
    }

    async fn call(
        &self,
        tx: Option<&Transaction>,
        req: NetRequest,
    ) -> Result<NetResponse, Failure> {
        match tx {
            Some(tx) => tx.call(&self.logger, req).await,
            None => self.rpc.call(&self.logger, req).await,
        }
    }

    fn unexpected(&self, r: NetResponse) -> Failure {
        Failure::new(
            Status::ProtocolError,
            format!("{}: unexpected answer {r:?}", self.who),
        )
    }

    /// TX_START: `tx` uses the connection from now on; its input starts at
    /// peer position `in_from` (the first byte the server has not read).
    ///
    /// Fails with the logger's status: Unavailable while the previous
    /// transaction is undecided there, Mismatch when another runs, and like
    /// [`Transaction::call`].
    pub(crate) async fn start(&self, tx: &Transaction, in_from: u64) -> Result<(), Failure> {
        let (out_from, aborted) = {
            let s = self.st.lock();
            (s.out_pos, s.tx.filter(|_| s.tx_aborted))
        };
        let req = NetRequest::Start {
            conn: self.conn.clone(),
            in_from,
            out_from,
            aborted,
            replay: false,
        };
        match self.call(Some(tx), req).await? {
            NetResponse::Done => {}
            other => return Err(self.unexpected(other)),
        }
        let mut s = self.st.lock();
        s.begun(tx.tid(), out_from);
        s.tx_in_from = in_from;
        Ok(())
    }

    /// TX_RESTART: `tx` re-executes the transaction aborted last. `rewind`
    /// is called with that transaction's first input position before the
    /// logger is asked to send the input again. Returns that position and
    /// the logger's answer.
    ///
    /// Fails with Mismatch when no transaction aborted, and like
    /// [`ControlStream::start`].
    pub(crate) async fn restart(
        &self,
        tx: &Transaction,
        rewind: impl FnOnce(u64),
    ) -> Result<(u64, NetResponse), Failure> {
        let (old, in_from, out_from) = {
            let s = self.st.lock();
            let Some(old) = s.tx.filter(|_| s.tx_aborted) else {
                return Err(Failure::new(
                    Status::Mismatch,
                    format!("{}: restart without an aborted transaction", self.who),
                ));
            };
            (old, s.tx_in_from, s.out_pos)
        };
        rewind(in_from);
        let req = NetRequest::Start {
            conn: self.conn.clone(),
            in_from,
            out_from,
            aborted: Some(old),
            replay: true,
        };
        let r = self.call(Some(tx), req).await?;
        self.st.lock().begun(tx.tid(), out_from);
        Ok((in_from, r))
    }

    /// Ends the transaction's bytes at the logger (its input at peer
    /// position `in_end`) and commits it.
    ///
    /// Fails like [`Transaction::commit`]; the transaction then counts as
    /// aborted here (it may be restarted).
    pub(crate) async fn commit(&self, tx: Transaction, in_end: u64) -> Result<(), Failure> {
        let out_end = self.st.lock().out_pos;
        let req = NetRequest::End {
            conn: self.conn.clone(),
            in_end,
            out_end,
        };
        let res = match self.call(Some(&tx), req).await {
            Ok(NetResponse::Done) => tx.commit().await,
            Ok(other) => {
                let f = self.unexpected(other);
                let _ = tx.abort(&f.detail).await;
                Err(f)
            }
            Err(f) => {
                let _ = tx.abort(&f.detail).await;
                Err(f)
            }
        };
        self.st.lock().ended(res.is_ok());
        res
    }

    /// Aborts the transaction; its output never reaches the peer.
    ///
    /// Fails like [`Transaction::abort`].
    pub(crate) async fn abort(&self, tx: Transaction, reason: &str) -> Result<(), Failure> {
        self.st.lock().ended(false);
        tx.abort(reason).await
    }

    /// How many bytes a read of up to `want` may take when the server's
    /// input stands at peer position `consumed`: all outside a transaction,
    /// what is left of the transaction's bound inside one.
    ///
    /// Fails with NoBuffer when the transaction already read as much as the
    /// logger keeps for it.
    pub(crate) fn read_room(&self, consumed: u64, want: usize) -> Result<usize, Failure> {
        let s = self.st.lock();
        if !s.running() {
            return Ok(want);
        }
        let read = (consumed - s.tx_in_from) as usize;
        let room = self.cfg.max_hold.saturating_sub(read);
        if room == 0 && want > 0 {
            return Err(Failure::new(
                Status::NoBuffer,
                format!(
                    "{}: the transaction already read {read} bytes (at most {})",
                    self.who, self.cfg.max_hold
                ),
            ));
        }
        Ok(want.min(room))
    }

    /// Writes `data` (held at the logger until the transaction commits;
    /// outside a transaction the logger passes it at once, after telling
    /// it where the server's output stands if an abort left it unsure).
    ///
    /// Fails with NoBuffer when the transaction would write more than its
    /// limit (nothing is sent), ProcDead when the connection failed.
    pub(crate) async fn write_all(&self, data: &[u8]) -> Result<(), Failure> {
        let sync = {
            let s = self.st.lock();
            if s.running() {
                let written = (s.out_pos - s.tx_out_from) as usize;
                if written + data.len() > self.cfg.max_hold {
                    return Err(Failure::new(
                        Status::NoBuffer,
                        format!(
                            "{}: a {}-byte write would hold {} bytes (at most {})",
                            self.who,
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
            // Writing outside a transaction gives up restarting the aborted one.
            let req = NetRequest::Sync {
                conn: self.conn.clone(),
                out_from,
                aborted,
            };
            match self.call(None, req).await? {
                NetResponse::Done => {}
                other => return Err(self.unexpected(other)),
            }
            let mut s = self.st.lock();
            s.need_sync = false;
            s.tx = None;
            s.tx_aborted = false;
        }
        let mut wr = self.wr.lock().await;
        wr.write_all(data)
            .await
            .map_err(|e| Failure::new(Status::ProcDead, format!("{}: write: {e}", self.who)))?;
        self.st.lock().out_pos += data.len() as u64;
        Ok(())
    }

    /// Closes the sending side.
    pub(crate) async fn shutdown(&self) {
        let _ = self.wr.lock().await.shutdown().await;
    }
}
