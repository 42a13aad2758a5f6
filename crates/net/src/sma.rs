//! SMA, the single-machine architecture: a [`TxStream`] is a TCP stream
//! inside the server process whose reads and writes within a weft
//! transaction follow the logger core, and which takes part in the
//! transaction as a two-phase resource of the server's node.
//!
//! Owns one accepted (or connected) TCP stream: a reader task that fills the
//! core's receive window from the socket, the peer's writer
//! ([`crate::writer`]) that sends what the core releases, in order, and the resource that turns prepare, commit and
//! abort into the core's end, TX_COMMIT and TX_ABORT. Must never put a byte
//! of a transaction on the wire before every durable effect of the
//! transaction is committed durably, and never read from the peer past the
//! window.
//!
//! The stream itself keeps nothing durable (its bytes live in this process
//! only), so it votes `Yes { durable: false }`: a transaction whose only
//! effect is the stream's output has no record to force, and its output
//! leaves at once. When another resource of the transaction votes durable,
//! the coordinator forces its commit record before any resource commits, and
//! this resource (which does not commit from this node's log) is committed,
//! and so releases its bytes, only after that force: the output never
//! precedes the durability of the transaction's other effects.

use std::sync::Arc;

use bytes::Bytes;
use futures::future::BoxFuture;
use parking_lot::Mutex;
use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;
use tokio::sync::Notify;
use weft_log::Log;
use weft_tx::{ParticipationClass, Resource, TxManager, Vote};
use weft_wire::{Failure, Status, Tid};

use crate::core::{Action, ConnState, ConnStats, Event, LoggerConfig, LoggerCore};
use crate::writer::PeerWriter;

/// Most chunks queued for the writer task (each at most one write or one
/// commit's release); the writer's queue is bounded by this.
const WRITER_QUEUE: usize = 1024;

struct Shared {
    name: String,
    core: Mutex<LoggerCore>,
    /// Set when the peer closed its side (or the read failed).
    eof: Mutex<Option<String>>,
    readable: Notify,
    room: Notify,
    out: PeerWriter,
}

impl Shared {
    fn step(&self, e: Event) -> Result<Vec<Action>, Failure> {
        self.core
            .lock()
            .step(std::time::Instant::now(), e)
            .map_err(Failure::from)
    }

    async fn release(&self, actions: Vec<Action>) -> Result<(), Failure> {
        for a in actions {
            if let Action::ToPeer(b) = a {
                self.out
                    .send(b)
                    .await
                    .map_err(|e| Failure::new(Status::ProcDead, format!("{}: {e}", self.name)))?;
            }
        }
        Ok(())
    }
}

/// A transactional TCP stream (SMA). Cheap to share by reference; one
/// transaction at a time uses it.
pub struct TxStream {
    shared: Arc<Shared>,
    tm: TxManager,
    reader: tokio::task::JoinHandle<()>,
}

impl Drop for TxStream {
    fn drop(&mut self) {
        self.reader.abort();
    }
}

/// The resource enlisted in each transaction that uses the stream.
struct StreamResource(Arc<Shared>);

impl TxStream {
    /// Wraps `tcp`; transactions of `tm`'s node use it. Starts the reader
    /// and writer tasks (a tokio runtime must be running).
    pub fn new(tcp: TcpStream, tm: TxManager, cfg: LoggerConfig) -> TxStream {
        let name = match tcp.peer_addr() {
            Ok(a) => format!("net:{a}"),
            Err(_) => "net:?".to_string(),
        };
        let _ = tcp.set_nodelay(true);
        let (mut rd, wr) = tcp.into_split();
        let shared = Arc::new(Shared {
            name,
            core: Mutex::new(LoggerCore::new(cfg)),
            eof: Mutex::new(None),
            readable: Notify::new(),
            room: Notify::new(),
            out: PeerWriter::spawn(wr, WRITER_QUEUE, || {}),
        });
        let r = Arc::clone(&shared);
        let reader = tokio::spawn(async move {
            let mut buf = vec![0u8; 64 * 1024];
            loop {
                let room = loop {
                    let notified = r.room.notified();
                    let room = r.core.lock().peer_room();
                    if room > 0 {
                        break room;
                    }
                    notified.await;
                };
                let n = room.min(buf.len());
                match rd.read(&mut buf[..n]).await {
                    Ok(0) => {
                        *r.eof.lock() = Some("the peer closed the connection".into());
                        r.readable.notify_waiters();
                        return;
                    }
                    Ok(k) => {
                        let res = r.step(Event::PeerData(Bytes::copy_from_slice(&buf[..k])));
                        debug_assert!(res.is_ok(), "read within the window: {res:?}");
                        r.readable.notify_waiters();
                    }
                    Err(e) => {
                        *r.eof.lock() = Some(format!("read from the peer failed: {e}"));
                        r.readable.notify_waiters();
                        return;
                    }
                }
            }
        });
        TxStream { shared, tm, reader }
    }

    /// The resource's name on the node (`net:<peer address>`).
    pub fn name(&self) -> &str {
        &self.shared.name
    }

    /// TX_START: transaction `tid` (active at this node) uses the stream
    /// from now on: its input starts at the first byte not read yet (bytes
    /// the peer sent before are the transaction's), its output is held.
    ///
    /// Fails with Mismatch when another transaction uses the stream,
    /// Unavailable while the previous one is undecided, NoSuchTransaction /
    /// Aborted when `tid` is not active here.
    pub fn start(&self, tid: Tid) -> Result<(), Failure> {
        {
            let mut core = self.shared.core.lock();
            let (in_from, out_from) = (core.in_read_pos(), core.out_pos());
            core.step(
                std::time::Instant::now(),
                Event::Start {
                    tx: tid,
                    in_from,
                    out_from,
                },
            )?;
        }
        self.enlist(tid)
    }

    /// TX_RESTART: transaction `tid` re-executes the transaction that last
    /// aborted on this stream; its reads return that transaction's input
    /// again from its first byte. Call it after the abort (the aborted
    /// transaction is given up here if its abort was not applied yet).
    ///
    /// Fails with Mismatch when no transaction aborted, Aborted (AgedOut)
    /// when its input aged out, and like [`TxStream::start`].
    pub fn restart(&self, tid: Tid) -> Result<(), Failure> {
        {
            let mut core = self.shared.core.lock();
            let now = std::time::Instant::now();
            if let Some(old) = core.tx() {
                // The application aborted `old`; its abort may still be on
                // its way to this resource (a second one is ignored).
                core.step(now, Event::Abort { tx: old })?;
            }
            let out_from = core.out_pos();
            core.step(now, Event::Restart { tx: tid, out_from })?;
        }
        self.enlist(tid)
    }

    fn enlist(&self, tid: Tid) -> Result<(), Failure> {
        if let Err(f) = self
            .tm
            .enlist(tid, Arc::new(StreamResource(Arc::clone(&self.shared))))
        {
            let _ = self.shared.step(Event::Abort { tx: tid });
            return Err(f);
        }
        Ok(())
    }

    /// Reads up to `buf.len()` bytes; 0 at the end of the peer's stream.
    /// Within a transaction the bytes are kept for a restart.
    ///
    /// Fails with NoBuffer when the transaction already read as much as it
    /// may keep, ProtocolError once the connection is desynchronised.
    pub async fn read(&self, buf: &mut [u8]) -> Result<usize, Failure> {
        if buf.is_empty() {
            return Ok(0);
        }
        loop {
            let notified = self.shared.readable.notified();
            let actions = self.shared.step(Event::ServerRead { max: buf.len() })?;
            let mut n = 0;
            for a in actions {
                if let Action::ToServer { data, .. } = a {
                    buf[n..n + data.len()].copy_from_slice(&data);
                    n += data.len();
                }
            }
            if n > 0 {
                self.shared.room.notify_one();
                return Ok(n);
            }
            if self.shared.eof.lock().is_some() {
                return Ok(0);
            }
            notified.await;
        }
    }

    /// Reads exactly `buf.len()` bytes.
    ///
    /// Fails like [`TxStream::read`], and with ProcDead when the peer's
    /// stream ends first.
    pub async fn read_exact(&self, buf: &mut [u8]) -> Result<(), Failure> {
        let mut at = 0;
        while at < buf.len() {
            let n = self.read(&mut buf[at..]).await?;
            if n == 0 {
                let why = self.shared.eof.lock().clone().unwrap_or_default();
                return Err(Failure::new(
                    Status::ProcDead,
                    format!(
                        "{}: {why} after {at} of {} bytes",
                        self.shared.name,
                        buf.len()
                    ),
                ));
            }
            at += n;
        }
        Ok(())
    }

    /// Writes `data`: within a transaction it is held until the commit
    /// (dropped at abort); outside one it is sent at once.
    ///
    /// Fails with NoBuffer when the transaction would hold more than its
    /// limit (nothing of `data` is held or sent), ProcDead when the
    /// connection's writer stopped.
    pub async fn write_all(&self, data: &[u8]) -> Result<(), Failure> {
        if let Some(e) = self.shared.out.error() {
            return Err(Failure::new(
                Status::ProcDead,
                format!("{}: {e}", self.shared.name),
            ));
        }
        let actions = self.shared.step(Event::ServerData {
            data: Bytes::copy_from_slice(data),
            refusable: true,
        })?;
        self.shared.release(actions).await
    }

    /// Sends what was released and closes the sending side (the peer reads
    /// end-of-stream after the last committed byte).
    pub async fn shutdown(&self) {
        self.shared.out.close(true).await;
    }

    /// The connection's state.
    pub fn state(&self) -> ConnState {
        self.shared.core.lock().state()
    }

    /// Counters and sizes.
    pub fn stats(&self) -> ConnStats {
        self.shared.core.lock().stats()
    }
}

impl Resource for StreamResource {
    fn name(&self) -> &str {
        &self.0.name
    }

    fn class(&self) -> ParticipationClass {
        ParticipationClass::TwoPhase
    }

    fn prepare<'a>(&'a self, tid: Tid, _log: &'a Log) -> BoxFuture<'a, Vote> {
        Box::pin(async move {
            let mut core = self.0.core.lock();
            if core.tx() != Some(tid) {
                return Vote::ReadOnly;
            }
            let (in_end, out_end) = (core.in_read_pos(), core.out_pos());
            match core.step(
                std::time::Instant::now(),
                Event::End {
                    tx: tid,
                    in_end,
                    out_end,
                },
            ) {
                // Nothing of the stream is durable. Output cannot be taken
                // back, but it needs a durable decision only when the
                // transaction has durable effects; their votes make the
                // coordinator force its commit record, and this resource
                // commits (releases) only after that force.
                Ok(_) => Vote::Yes { durable: false },
                Err(e) => Vote::No(format!("{}: {e}", self.0.name)),
            }
        })
    }

    fn commit(&self, tid: Tid) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            let res = self.0.step(Event::Commit { tx: tid });
            match res {
                Ok(actions) => {
                    let _ = self.0.release(actions).await;
                }
                Err(e) => {
                    tracing::debug!(%tid, error = %e, name = %self.0.name, "commit of a transaction the stream does not run")
                }
            }
        })
    }

    fn abort(&self, tid: Tid) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            let _ = self.0.step(Event::Abort { tx: tid });
        })
    }

    fn held(&self) -> Vec<(Tid, String)> {
        let core = self.0.core.lock();
        core.tx()
            .map(|t| {
                (
                    t,
                    format!(
                        "{}: {} bytes held for the peer",
                        self.0.name,
                        core.stats().held_bytes
                    ),
                )
            })
            .into_iter()
            .collect()
    }
}
