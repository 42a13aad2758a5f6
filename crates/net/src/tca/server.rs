//! The server's side of 2CA: a [`ProxiedStream`] is a TCP connection the
//! server accepted from the proxy. Reads take the proxy's framed peer bytes
//! in position order; writes go out raw; the transaction's control messages
//! (TX_START, TX_RESTART, the end of its bytes) are calls to the proxy's
//! `net` service within the transaction, which makes the proxy a
//! participant.
//!
//! Owns the read side: the peer bytes consumed, the receive buffer and its
//! reader task, and the rule that only the next expected position is taken
//! (bytes in flight from before a restart are dropped, the proxy sends them
//! again). The control calls, the write position and the per-transaction
//! bounds are the shared [`ControlStream`]'s. Must never hand the
//! application a byte out of the peer's order.

use std::collections::VecDeque;
use std::sync::Arc;

use parking_lot::Mutex;
use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;
use tokio::sync::Notify;
use weft_rpc::{Rpc, Transaction};
use weft_wire::{Failure, NodeId, Status};

use super::{frame, NetResponse};
use crate::control::stream::ControlStream;
use crate::core::LoggerConfig;

#[derive(Default)]
struct Rx {
    inbox: VecDeque<u8>,
    consumed: u64,
    expect: u64,
    eof: Option<String>,
}

/// The server's end of a 2CA connection.
pub struct ProxiedStream {
    ctl: ControlStream,
    rx: Arc<Mutex<Rx>>,
    readable: Arc<Notify>,
    room: Arc<Notify>,
    reader: tokio::task::JoinHandle<()>,
}

impl Drop for ProxiedStream {
    fn drop(&mut self) {
        self.reader.abort();
    }
}

impl ProxiedStream {
    /// Wraps `tcp`, accepted from the proxy whose node is `proxy`; control
    /// calls go through `rpc` (the server's node). `cfg.max_hold` bounds a
    /// transaction's writes, `cfg.max_rx` the receive buffer.
    ///
    /// Fails with AddrError when the socket has no peer address.
    pub fn new(
        tcp: TcpStream,
        rpc: Rpc,
        proxy: NodeId,
        cfg: LoggerConfig,
    ) -> Result<Self, Failure> {
        let (ctl, mut rd) = ControlStream::new("net", tcp, rpc, proxy, cfg)?;
        let rx = Arc::new(Mutex::new(Rx::default()));
        let readable = Arc::new(Notify::new());
        let room = Arc::new(Notify::new());
        let (rx2, readable2, room2) = (Arc::clone(&rx), Arc::clone(&readable), Arc::clone(&room));
        let max_rx = cfg.max_rx;
        let reader = tokio::spawn(async move {
            let mut buf = vec![0u8; frame::MAX_PAYLOAD];
            let end = |why: String| {
                rx2.lock().eof = Some(why);
                readable2.notify_waiters();
            };
            loop {
                loop {
                    let notified = room2.notified();
                    if rx2.lock().inbox.len() < max_rx {
                        break;
                    }
                    notified.await;
                }
                let mut h = [0u8; frame::HEADER];
                match rd.read_exact(&mut h).await {
                    Ok(_) => {}
                    Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                        return end("the peer closed the connection".into())
                    }
                    Err(e) => return end(format!("read from the proxy failed: {e}")),
                }
                let (pos, len) = match frame::parse(&h) {
                    Ok(x) => x,
                    Err(e) => return end(format!("bad frame from the proxy: {e}")),
                };
                if let Err(e) = rd.read_exact(&mut buf[..len]).await {
                    return end(format!("read from the proxy failed: {e}"));
                }
                let mut s = rx2.lock();
                let end_pos = pos + len as u64;
                // Only the next expected position is taken.
                if pos <= s.expect && s.expect < end_pos {
                    let from = (s.expect - pos) as usize;
                    s.inbox.extend(&buf[from..len]);
                    s.expect = end_pos;
                    drop(s);
                    readable2.notify_waiters();
                }
            }
        });
        Ok(ProxiedStream {
            ctl,
            rx,
            readable,
            room,
            reader,
        })
    }

    /// The connection's name at the proxy.
    pub fn conn(&self) -> &str {
        self.ctl.conn()
    }

    /// TX_START: `tx` uses the connection from now on (its input starts at
    /// the first byte not read yet).
    ///
    /// Fails with the proxy's status: Unavailable while the previous
    /// transaction is undecided there, Mismatch when another runs, and like
    /// [`Transaction::call`].
    pub async fn start(&self, tx: &Transaction) -> Result<(), Failure> {
        let in_from = self.rx.lock().consumed;
        self.ctl.start(tx, in_from).await
    }

    /// TX_RESTART: `tx` re-executes the transaction aborted last (by
    /// [`ProxiedStream::abort`] or a failed [`ProxiedStream::commit`]); its
    /// reads return that transaction's input again.
    ///
    /// Fails with Mismatch when no transaction aborted, and like
    /// [`ProxiedStream::start`].
    pub async fn restart(&self, tx: &Transaction) -> Result<(), Failure> {
        let (_, r) = self
            .ctl
            .restart(tx, |in_from| {
                // Forget what the aborted attempt had; the proxy sends it again.
                let mut s = self.rx.lock();
                s.inbox.clear();
                s.consumed = in_from;
                s.expect = in_from;
                drop(s);
                self.room.notify_one();
            })
            .await?;
        match r {
            NetResponse::Done => Ok(()),
            other => Err(Failure::new(
                Status::ProtocolError,
                format!("net: unexpected answer {other:?}"),
            )),
        }
    }

    /// Ends the transaction's bytes at the proxy and commits it.
    ///
    /// Fails like [`Transaction::commit`]; the transaction then counts as
    /// aborted here (restart it with [`ProxiedStream::restart`]).
    pub async fn commit(&self, tx: Transaction) -> Result<(), Failure> {
        let in_end = self.rx.lock().consumed;
        self.ctl.commit(tx, in_end).await
    }

    /// Aborts the transaction; its output never reaches the peer.
    ///
    /// Fails like [`Transaction::abort`].
    pub async fn abort(&self, tx: Transaction, reason: &str) -> Result<(), Failure> {
        self.ctl.abort(tx, reason).await
    }

    /// Reads up to `buf.len()` bytes; 0 at the end of the peer's stream.
    ///
    /// Fails with NoBuffer when the transaction already read as much as the
    /// proxy keeps for it.
    pub async fn read(&self, buf: &mut [u8]) -> Result<usize, Failure> {
        loop {
            let notified = self.readable.notified();
            {
                let mut s = self.rx.lock();
                let max = self.ctl.read_room(s.consumed, buf.len())?;
                let n = max.min(s.inbox.len());
                if n > 0 {
                    for (i, b) in s.inbox.drain(..n).enumerate() {
                        buf[i] = b;
                    }
                    s.consumed += n as u64;
                    drop(s);
                    self.room.notify_one();
                    return Ok(n);
                }
                if s.eof.is_some() || buf.is_empty() {
                    return Ok(0);
                }
            }
            notified.await;
        }
    }

    /// Reads exactly `buf.len()` bytes.
    ///
    /// Fails like [`ProxiedStream::read`], and with ProcDead when the stream
    /// ends first.
    pub async fn read_exact(&self, buf: &mut [u8]) -> Result<(), Failure> {
        let mut at = 0;
        while at < buf.len() {
            let n = self.read(&mut buf[at..]).await?;
            if n == 0 {
                let why = self.rx.lock().eof.clone().unwrap_or_default();
                return Err(Failure::new(
                    Status::ProcDead,
                    format!("net: {why} after {at} of {} bytes", buf.len()),
                ));
            }
            at += n;
        }
        Ok(())
    }

    /// Writes `data` (held at the proxy until the transaction commits;
    /// outside a transaction the proxy sends it at once).
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
