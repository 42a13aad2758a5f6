//! The server's side of TLA: a [`TlaStream`] is an ordinary TCP connection
//! the server accepted from the peer (through the logger, which it does not
//! see); the transaction's control messages (TX_START, TX_RESTART, the end
//! of its bytes) are calls to the logger's `net` service within the
//! transaction, which makes the logger a participant.
//!
//! Owns the read side: bytes read from the socket (server space, replays
//! included) and the peer's bytes consumed (peer space), and skipping to the
//! replay after a restart ([`ServerReads`]). The control calls, the write
//! position and the per-transaction bounds are the shared
//! [`ControlStream`]'s. Reads happen only when the application reads (no
//! reader task), so a restart's skip position is set before any replayed
//! byte is taken.

use parking_lot::Mutex;
use tokio::io::AsyncReadExt;
use tokio::net::tcp::OwnedReadHalf;
use tokio::net::TcpStream;
use weft_rpc::{Rpc, Transaction};
use weft_wire::{Failure, NodeId, Status};

use super::conn::ServerReads;
use crate::control::stream::ControlStream;
use crate::control::NetResponse;
use crate::core::LoggerConfig;

/// The server's end of a TLA connection.
pub struct TlaStream {
    ctl: ControlStream,
    reads: Mutex<ServerReads>,
    rd: tokio::sync::Mutex<OwnedReadHalf>,
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
        let (ctl, rd) = ControlStream::new("tla", tcp, rpc, logger, cfg)?;
        Ok(TlaStream {
            ctl,
            reads: Mutex::new(ServerReads::default()),
            rd: tokio::sync::Mutex::new(rd),
        })
    }

    /// The connection's name at the logger (the peer's address).
    pub fn conn(&self) -> &str {
        self.ctl.conn()
    }

    /// TX_START: `tx` uses the connection from now on (its input starts at
    /// the first peer byte not read yet).
    ///
    /// Fails with the logger's status: Unavailable while the previous
    /// transaction is undecided there, Mismatch when another runs, and like
    /// [`Transaction::call`].
    pub async fn start(&self, tx: &Transaction) -> Result<(), Failure> {
        let in_from = self.reads.lock().consumed;
        self.ctl.start(tx, in_from).await
    }

    /// TX_RESTART: `tx` re-executes the transaction aborted last; its reads
    /// return that transaction's input again (the logger sends it again
    /// with new sequence numbers).
    ///
    /// Fails with Mismatch when no transaction aborted (or the peer already
    /// closed its side), ProtocolError for an answer that is not a replay
    /// position, and like [`TlaStream::start`].
    pub async fn restart(&self, tx: &Transaction) -> Result<(), Failure> {
        let (in_from, r) = self.ctl.restart(tx, |_| {}).await?;
        let NetResponse::ReplayAt(at) = r else {
            return Err(Failure::new(
                Status::ProtocolError,
                format!("tla: unexpected answer to a restart {r:?}"),
            ));
        };
        self.reads.lock().restart(in_from, at);
        Ok(())
    }

    /// Ends the transaction's bytes at the logger and commits it.
    ///
    /// Fails like [`Transaction::commit`]; the transaction then counts as
    /// aborted here (restart it with [`TlaStream::restart`]).
    pub async fn commit(&self, tx: Transaction) -> Result<(), Failure> {
        let in_end = self.reads.lock().consumed;
        self.ctl.commit(tx, in_end).await
    }

    /// Aborts the transaction; its output never reaches the peer.
    ///
    /// Fails like [`Transaction::abort`].
    pub async fn abort(&self, tx: Transaction, reason: &str) -> Result<(), Failure> {
        self.ctl.abort(tx, reason).await
    }

    /// Reads up to `buf.len()` peer bytes; 0 at the end of the peer's stream.
    ///
    /// Fails with NoBuffer when the transaction already read as much as the
    /// logger keeps for it, ProcDead when the socket failed.
    pub async fn read(&self, buf: &mut [u8]) -> Result<usize, Failure> {
        let consumed = self.reads.lock().consumed;
        let max = self.ctl.read_room(consumed, buf.len())?;
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
            let usable = self.reads.lock().take(&buf[..n]).len();
            let skipped = n - usable;
            if usable > 0 {
                buf.copy_within(skipped..n, 0);
                return Ok(usable);
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
        self.ctl.write_all(data).await
    }

    /// Closes the sending side.
    pub async fn shutdown(&self) {
        self.ctl.shutdown().await
    }
}
