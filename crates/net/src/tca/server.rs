//! The server's side of 2CA: a [`ProxiedStream`] is a TCP connection the
//! server accepted from the proxy. Reads take the proxy's framed peer bytes
//! in position order; writes go out raw; the transaction's control messages
//! (TX_START, TX_RESTART, the end of its bytes) are calls to the proxy's
//! `net` service within the transaction, which makes the proxy a
//! participant.
//!
//! Owns the server's positions on the connection (bytes consumed, bytes
//! written), the receive buffer, and the rule that only the next expected
//! position is taken (bytes in flight from before a restart are dropped, the
//! proxy sends them again). Must never tell the proxy a position it has not
//! reached, nor write more than the per-transaction limit within one
//! transaction.

use std::collections::VecDeque;
use std::sync::Arc;

use parking_lot::Mutex;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::OwnedWriteHalf;
use tokio::net::TcpStream;
use tokio::sync::Notify;
use weft_rpc::{Rpc, Transaction};
use weft_wire::{Address, Failure, NodeId, Status, Tid};

use super::{frame, NetRequest, NetResponse, SERVICE};
use crate::core::LoggerConfig;

#[derive(Default)]
struct St {
    inbox: VecDeque<u8>,
    consumed: u64,
    expect: u64,
    eof: Option<String>,
    out_pos: u64,
    /// The running (or last aborted, not yet restarted) transaction.
    tx: Option<Tid>,
    tx_aborted: bool,
    tx_in_from: u64,
    tx_out_from: u64,
    /// An abort left output positions the proxy must be told about before
    /// writing outside a transaction.
    need_sync: bool,
}

/// The server's end of a 2CA connection.
pub struct ProxiedStream {
    rpc: Rpc,
    proxy: Address,
    conn: String,
    cfg: LoggerConfig,
    st: Arc<Mutex<St>>,
    readable: Arc<Notify>,
    room: Arc<Notify>,
    wr: tokio::sync::Mutex<OwnedWriteHalf>,
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
        let conn = tcp
            .peer_addr()
            .map_err(|e| Failure::new(Status::AddrError, format!("net: {e}")))?
            .to_string();
        let proxy = Address::new(SERVICE, proxy)
            .map_err(|e| Failure::new(Status::AddrError, format!("net: {e}")))?;
        let _ = tcp.set_nodelay(true);
        let (mut rd, wr) = tcp.into_split();
        let st = Arc::new(Mutex::new(St::default()));
        let readable = Arc::new(Notify::new());
        let room = Arc::new(Notify::new());
        let (st2, readable2, room2) = (Arc::clone(&st), Arc::clone(&readable), Arc::clone(&room));
        let max_rx = cfg.max_rx;
        let reader = tokio::spawn(async move {
            let mut buf = vec![0u8; frame::MAX_PAYLOAD];
            let end = |why: String| {
                st2.lock().eof = Some(why);
                readable2.notify_waiters();
            };
            loop {
                loop {
                    let notified = room2.notified();
                    if st2.lock().inbox.len() < max_rx {
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
                let mut s = st2.lock();
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
            rpc,
            proxy,
            conn,
            cfg,
            st,
            readable,
            room,
            wr: tokio::sync::Mutex::new(wr),
            reader,
        })
    }

    /// The connection's name at the proxy.
    pub fn conn(&self) -> &str {
        &self.conn
    }

    async fn control(&self, tx: Option<&Transaction>, req: NetRequest) -> Result<(), Failure> {
        let r: NetResponse = match tx {
            Some(tx) => tx.call(&self.proxy, req).await?,
            None => self.rpc.call(&self.proxy, req).await?,
        };
        match r {
            NetResponse::Done => Ok(()),
            other => Err(Failure::new(
                Status::ProtocolError,
                format!("net: unexpected answer {other:?}"),
            )),
        }
    }

    /// TX_START: `tx` uses the connection from now on (its input starts at
    /// the first byte not read yet).
    ///
    /// Fails with the proxy's status: Unavailable while the previous
    /// transaction is undecided there, Mismatch when another runs, and like
    /// [`Transaction::call`].
    pub async fn start(&self, tx: &Transaction) -> Result<(), Failure> {
        let (in_from, out_from, aborted) = {
            let s = self.st.lock();
            (s.consumed, s.out_pos, s.tx.filter(|_| s.tx_aborted))
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

    /// TX_RESTART: `tx` re-executes the transaction aborted last (by
    /// [`ProxiedStream::abort`] or a failed [`ProxiedStream::commit`]); its
    /// reads return that transaction's input again.
    ///
    /// Fails with Mismatch when no transaction aborted, and like
    /// [`ProxiedStream::start`].
    pub async fn restart(&self, tx: &Transaction) -> Result<(), Failure> {
        let (old, in_from, out_from) = {
            let mut s = self.st.lock();
            let Some(old) = s.tx.filter(|_| s.tx_aborted) else {
                return Err(Failure::new(
                    Status::Mismatch,
                    "net: restart without an aborted transaction",
                ));
            };
            // Forget what the aborted attempt had; the proxy sends it again.
            s.inbox.clear();
            s.consumed = s.tx_in_from;
            s.expect = s.tx_in_from;
            (old, s.tx_in_from, s.out_pos)
        };
        self.room.notify_one();
        self.control(
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
        let mut s = self.st.lock();
        s.tx = Some(tx.tid());
        s.tx_aborted = false;
        s.tx_out_from = out_from;
        s.need_sync = false;
        Ok(())
    }

    /// Ends the transaction's bytes at the proxy and commits it.
    ///
    /// Fails like [`Transaction::commit`]; the transaction then counts as
    /// aborted here (restart it with [`ProxiedStream::restart`]).
    pub async fn commit(&self, tx: Transaction) -> Result<(), Failure> {
        let (in_end, out_end) = {
            let s = self.st.lock();
            (s.consumed, s.out_pos)
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
            Ok(()) => tx.commit().await,
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

    /// Reads up to `buf.len()` bytes; 0 at the end of the peer's stream.
    ///
    /// Fails with NoBuffer when the transaction already read as much as the
    /// proxy keeps for it.
    pub async fn read(&self, buf: &mut [u8]) -> Result<usize, Failure> {
        loop {
            let notified = self.readable.notified();
            {
                let mut s = self.st.lock();
                let mut max = buf.len();
                if s.tx.is_some() && !s.tx_aborted {
                    let read = (s.consumed - s.tx_in_from) as usize;
                    let room = self.cfg.max_hold.saturating_sub(read);
                    if room == 0 && max > 0 {
                        return Err(Failure::new(
                            Status::NoBuffer,
                            format!(
                                "net: the transaction already read {read} bytes (at most {})",
                                self.cfg.max_hold
                            ),
                        ));
                    }
                    max = max.min(room);
                }
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
                let why = self.st.lock().eof.clone().unwrap_or_default();
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
        let sync = {
            let s = self.st.lock();
            if s.tx.is_some() && !s.tx_aborted {
                let written = (s.out_pos - s.tx_out_from) as usize;
                if written + data.len() > self.cfg.max_hold {
                    return Err(Failure::new(
                        Status::NoBuffer,
                        format!(
                            "net: a {}-byte write would hold {} bytes (at most {})",
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
            .map_err(|e| Failure::new(Status::ProcDead, format!("net: write to the proxy: {e}")))?;
        self.st.lock().out_pos += data.len() as u64;
        Ok(())
    }

    /// Closes the sending side.
    pub async fn shutdown(&self) {
        let _ = self.wr.lock().await.shutdown().await;
    }
}
