//! The 2CA proxy logger: a weft plugin that accepts unmodified peers,
//! connects each to the upstream server, runs a logger core per connection,
//! serves the `net` control service and takes part in the server's
//! transactions as a two-phase resource.
//!
//! Owns the proxy's sockets and tasks (the peer's writer is the shared
//! [`crate::writer`]), the map from transactions to
//! connections, commit (release to the peer) and abort (drop), and closing a
//! peer's connection once its server is gone and nothing is pending; what
//! prepare, TX_START and recovery do beyond finding the connection is the
//! shared [`crate::control::logger`]'s. Must never release a held byte before the commit decision
//! reached this node, nor keep a peer connection whose server is gone once
//! nothing undecided is held for it.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use futures::future::BoxFuture;
use parking_lot::Mutex;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, Notify};
use weft_log::{Log, LogRecord};
use weft_rpc::{CallContext, Plugin, Rpc, ServiceOptions};
use weft_tx::{ParticipationClass, Resource, TxManager, Vote};
use weft_wire::{Failure, Status, Tid};

use super::{frame, ConnInfo, ConnName, NetRequest, NetResponse, SERVICE};
pub use crate::control::logger::Undeliverable;
use crate::control::logger::{self as shared, need_tx, PauseHook, PausePoint};
use crate::core::{Action, ConnState, CoreError, Event, LoggerConfig, LoggerCore};
use crate::writer::PeerWriter;

/// Prefix of the proxy's messages.
const WHO: &str = "net";

/// Proxy settings.
#[derive(Clone, Debug)]
pub struct ProxyConfig {
    /// Where peers connect.
    pub listen: SocketAddr,
    /// The server.
    pub upstream: SocketAddr,
    /// Each connection's logger bounds.
    pub logger: LoggerConfig,
    /// Longest wait at prepare for the transaction's last server bytes.
    pub prepare_wait: Duration,
    /// Longest wait of a TX_START for the previous transaction's outcome.
    pub start_wait: Duration,
    /// Most peer connections at once (more are refused: closed at once).
    pub max_conns: usize,
    /// Test hook: holds transactions at points of their commit.
    pub pause: Option<PauseHook>,
}

impl ProxyConfig {
    /// Defaults for `listen` and `upstream`.
    pub fn new(listen: SocketAddr, upstream: SocketAddr) -> Self {
        ProxyConfig {
            listen,
            upstream,
            logger: LoggerConfig::default(),
            prepare_wait: Duration::from_secs(10),
            start_wait: Duration::from_secs(5),
            max_conns: 1024,
            pause: None,
        }
    }
}

/// Chunks queued per direction per connection.
const QUEUE: usize = 256;

enum Out {
    Bytes(Bytes),
    Close,
}

struct Conn {
    name: ConnName,
    peer: String,
    core: Mutex<LoggerCore>,
    /// Any change a waiter may care about (bytes, a decision, an end).
    progress: Notify,
    room: Notify,
    to_peer: PeerWriter,
    to_server: mpsc::Sender<Out>,
    server_gone: AtomicBool,
    peer_closed: AtomicBool,
    /// Of the server reader and the peer writer, how many ended: the
    /// second to end forgets the connection.
    halves_done: Arc<AtomicU8>,
}

impl Conn {
    fn step(&self, e: Event) -> Result<Vec<Action>, CoreError> {
        self.core.lock().step(Instant::now(), e)
    }

    async fn apply(&self, actions: Vec<Action>) {
        for a in actions {
            match a {
                Action::ToPeer(b) => {
                    let _ = self.to_peer.send(b).await;
                }
                Action::ToServer { pos, data } => {
                    for (i, part) in data.chunks(frame::MAX_PAYLOAD).enumerate() {
                        let p = pos + (i * frame::MAX_PAYLOAD) as u64;
                        let mut f = BytesMut::with_capacity(frame::HEADER + part.len());
                        f.extend_from_slice(&frame::header(p, part.len()));
                        f.extend_from_slice(part);
                        let _ = self.to_server.send(Out::Bytes(f.freeze())).await;
                    }
                }
            }
        }
        self.room.notify_one();
    }

    /// Forwards what the server may be handed now.
    async fn pump(&self) {
        match self.step(Event::ServerRead { max: usize::MAX }) {
            Ok(a) => self.apply(a).await,
            // The transaction read as much as it may keep: the rest waits.
            Err(e) => tracing::debug!(conn = %self.name, error = %e, "not forwarding"),
        }
    }

    /// Closes the peer's connection when the server is gone and nothing
    /// undecided is held.
    async fn close_if_done(&self) {
        if self.server_gone.load(Ordering::SeqCst)
            && self.core.lock().state() == ConnState::PreTrans
        {
            self.to_peer.close(false).await;
        }
    }

    fn info(&self) -> ConnInfo {
        let core = self.core.lock();
        ConnInfo {
            conn: self.name.clone(),
            peer: self.peer.clone(),
            state: core.state(),
            tx: core.tx(),
            server_gone: self.server_gone.load(Ordering::SeqCst),
            stats: core.stats(),
        }
    }
}

struct Inner {
    cfg: ProxyConfig,
    conns: Mutex<HashMap<ConnName, Arc<Conn>>>,
    /// A connection was registered.
    new_conn: Notify,
    by_tid: Mutex<HashMap<Tid, ConnName>>,
    log: OnceLock<Log>,
    bound: OnceLock<SocketAddr>,
    /// Output of transactions prepared (and committed, or in doubt) whose
    /// peer connection died with a previous run of this proxy (found at
    /// recovery).
    undeliverable: Mutex<Vec<Undeliverable>>,
}

/// The 2CA proxy logger, a [`Plugin`] of its node.
#[derive(Clone)]
pub struct NetProxy {
    inner: Arc<Inner>,
}

struct ProxyResource(Arc<Inner>);

impl NetProxy {
    /// A proxy with `cfg`; it listens once its node serves.
    pub fn new(cfg: ProxyConfig) -> NetProxy {
        NetProxy {
            inner: Arc::new(Inner {
                cfg,
                conns: Mutex::new(HashMap::new()),
                new_conn: Notify::new(),
                by_tid: Mutex::new(HashMap::new()),
                log: OnceLock::new(),
                bound: OnceLock::new(),
                undeliverable: Mutex::new(Vec::new()),
            }),
        }
    }

    /// The address peers connect to (once serving).
    pub fn listen_addr(&self) -> Option<SocketAddr> {
        self.inner.bound.get().copied()
    }

    /// The connections.
    pub fn list(&self) -> Vec<ConnInfo> {
        self.inner.list()
    }

    /// Transactions whose committed output could not be delivered because
    /// the proxy died with their peer's connection (from recovery).
    pub fn undeliverable(&self) -> Vec<Undeliverable> {
        self.inner.undeliverable.lock().clone()
    }
}

impl Inner {
    fn list(&self) -> Vec<ConnInfo> {
        let mut v: Vec<ConnInfo> = self.conns.lock().values().map(|c| c.info()).collect();
        v.sort_by(|a, b| a.conn.cmp(&b.conn));
        v
    }

    /// The connection `name`. The server may name it before this proxy
    /// registered it (it accepted the connection as soon as the proxy
    /// connected): waits up to the start bound for it.
    async fn conn(&self, name: &str) -> Result<Arc<Conn>, Failure> {
        let give_up = Instant::now() + self.cfg.start_wait;
        loop {
            let notified = self.new_conn.notified();
            if let Some(c) = self.conns.lock().get(name).cloned() {
                return Ok(c);
            }
            if tokio::time::timeout_at(give_up.into(), notified)
                .await
                .is_err()
            {
                return Err(Failure::new(
                    Status::BadRequest,
                    format!("net: no connection {name} at this proxy"),
                ));
            }
        }
    }

    fn conn_of(&self, tid: Tid) -> Option<Arc<Conn>> {
        let name = self.by_tid.lock().get(&tid).cloned()?;
        self.conns.lock().get(&name).cloned()
    }

    async fn serve_call(
        self: &Arc<Self>,
        ctx: CallContext,
        req: NetRequest,
    ) -> Result<NetResponse, Failure> {
        match req {
            NetRequest::List => Ok(NetResponse::Conns(self.list())),
            NetRequest::Sync {
                conn,
                out_from,
                aborted,
            } => {
                let c = self.conn(&conn).await?;
                let a = {
                    let mut core = c.core.lock();
                    let now = Instant::now();
                    if let Some(old) = aborted.filter(|o| core.tx() == Some(*o)) {
                        let _ = core.step(now, Event::Abort { tx: old });
                        self.by_tid.lock().remove(&old);
                    }
                    core.step(now, Event::Sync { out_from })?
                };
                c.apply(a).await;
                Ok(NetResponse::Done)
            }
            NetRequest::End {
                conn,
                in_end,
                out_end,
            } => {
                let tid = need_tx(&ctx, WHO)?;
                let c = self.conn(&conn).await?;
                c.step(Event::End {
                    tx: tid,
                    in_end,
                    out_end,
                })?;
                c.progress.notify_waiters();
                Ok(NetResponse::Done)
            }
            NetRequest::Start {
                conn,
                in_from,
                out_from,
                aborted,
                replay,
            } => {
                let tid = need_tx(&ctx, WHO)?;
                let c = self.conn(&conn).await?;
                let a = shared::when_free(WHO, &conn, self.cfg.start_wait, &c.progress, || {
                    let mut core = c.core.lock();
                    let now = Instant::now();
                    if let Some(old) = aborted.filter(|o| core.tx() == Some(*o)) {
                        let _ = core.step(now, Event::Abort { tx: old });
                    }
                    let res = if replay {
                        core.step(now, Event::Restart { tx: tid, out_from })
                    } else {
                        core.step(
                            now,
                            Event::Start {
                                tx: tid,
                                in_from,
                                out_from,
                            },
                        )
                    };
                    match res {
                        Ok(a) => Ok(Some(a)),
                        Err(CoreError::Busy(_)) => Ok(None),
                        Err(e) => Err(e.into()),
                    }
                })
                .await?;
                if let Some(old) = aborted {
                    self.by_tid.lock().remove(&old);
                }
                self.by_tid.lock().insert(tid, conn.clone());
                c.apply(a).await;
                c.pump().await;
                Ok(NetResponse::Done)
            }
        }
    }

    async fn accept_loop(self: Arc<Self>, listener: TcpListener) {
        loop {
            let (peer, addr) = match listener.accept().await {
                Ok(x) => x,
                Err(e) => {
                    // Out of descriptors or similar: back off instead of
                    // spinning on the same error.
                    tracing::warn!(error = %e, "net proxy: accept failed");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    continue;
                }
            };
            if self.conns.lock().len() >= self.cfg.max_conns {
                tracing::warn!(%addr, max = self.cfg.max_conns, "net proxy: too many connections, refusing");
                continue;
            }
            let inner = Arc::clone(&self);
            tokio::spawn(async move {
                match TcpStream::connect(inner.cfg.upstream).await {
                    Ok(up) => inner.run_conn(peer, addr, up),
                    Err(e) => {
                        tracing::warn!(%addr, error = %e, "net proxy: upstream unreachable, closing the peer")
                    }
                }
            });
        }
    }

    /// One of a connection's two ending halves (server reader, peer writer)
    /// ended; after both, nothing can reach the peer: forget it.
    fn half_done(&self, name: &str, halves: &AtomicU8) {
        if halves.fetch_add(1, Ordering::SeqCst) == 1 {
            self.conns.lock().remove(name);
        }
    }

    fn run_conn(self: &Arc<Self>, peer: TcpStream, peer_addr: SocketAddr, up: TcpStream) {
        let name = match up.local_addr() {
            Ok(a) => a.to_string(),
            Err(_) => return,
        };
        let _ = peer.set_nodelay(true);
        let _ = up.set_nodelay(true);
        let (mut peer_rd, peer_wr) = peer.into_split();
        let (mut up_rd, mut up_wr) = up.into_split();
        let (to_server, mut up_q) = mpsc::channel::<Out>(QUEUE);
        let halves_done = Arc::new(AtomicU8::new(0));
        // Peer writer: released bytes, in order.
        let to_peer = {
            let (inner, name, halves) = (Arc::clone(self), name.clone(), Arc::clone(&halves_done));
            PeerWriter::spawn(peer_wr, QUEUE, move || inner.half_done(&name, &halves))
        };
        let c = Arc::new(Conn {
            name: name.clone(),
            peer: peer_addr.to_string(),
            core: Mutex::new(LoggerCore::new(self.cfg.logger)),
            progress: Notify::new(),
            room: Notify::new(),
            to_peer,
            to_server,
            server_gone: AtomicBool::new(false),
            peer_closed: AtomicBool::new(false),
            halves_done,
        });
        self.conns.lock().insert(name.clone(), Arc::clone(&c));
        self.new_conn.notify_waiters();
        tracing::debug!(conn = %name, peer = %peer_addr, "net proxy: connection");

        // Server writer: framed peer bytes.
        tokio::spawn(async move {
            while let Some(o) = up_q.recv().await {
                match o {
                    Out::Bytes(b) => {
                        if up_wr.write_all(&b).await.is_err() {
                            return;
                        }
                    }
                    Out::Close => {
                        let _ = up_wr.shutdown().await;
                        return;
                    }
                }
            }
        });
        // Peer reader.
        let cr = Arc::clone(&c);
        tokio::spawn(async move {
            let mut buf = vec![0u8; 64 * 1024];
            loop {
                let room = loop {
                    let notified = cr.room.notified();
                    let room = cr.core.lock().peer_room();
                    if room > 0 {
                        break room;
                    }
                    notified.await;
                };
                let n = room.min(buf.len());
                match peer_rd.read(&mut buf[..n]).await {
                    Ok(0) | Err(_) => {
                        cr.peer_closed.store(true, Ordering::SeqCst);
                        // Everything forwarded first, then the end of stream.
                        cr.pump().await;
                        let _ = cr.to_server.send(Out::Close).await;
                        return;
                    }
                    Ok(k) => {
                        let _ = cr.step(Event::PeerData(Bytes::copy_from_slice(&buf[..k])));
                        cr.pump().await;
                    }
                }
            }
        });
        // Server reader: raw bytes of the server.
        let cs = Arc::clone(&c);
        let inner2 = Arc::clone(self);
        tokio::spawn(async move {
            let mut buf = vec![0u8; 64 * 1024];
            loop {
                match up_rd.read(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(k) => {
                        let res = cs.step(Event::ServerData {
                            data: Bytes::copy_from_slice(&buf[..k]),
                            refusable: false,
                        });
                        match res {
                            Ok(a) => cs.apply(a).await,
                            Err(e) => {
                                tracing::warn!(conn = %cs.name, error = %e, "net proxy: closing a desynchronised connection");
                                break;
                            }
                        }
                        cs.progress.notify_waiters();
                    }
                }
            }
            cs.server_gone.store(true, Ordering::SeqCst);
            cs.progress.notify_waiters();
            cs.close_if_done().await;
            inner2.half_done(&cs.name, &cs.halves_done);
        });
    }
}

impl Resource for ProxyResource {
    fn name(&self) -> &str {
        "net-proxy"
    }

    fn class(&self) -> ParticipationClass {
        ParticipationClass::TwoPhase
    }

    /// No vote barrier, no dependencies, and the release at commit needs
    /// only that the decision be durable: the proxy may take the decision of
    /// a server that hands it on (`TmConfig::delegate_commit`), forcing one
    /// record (held output and commit) instead of two.
    fn may_decide_alone(&self) -> bool {
        true
    }

    fn prepare<'a>(&'a self, tid: Tid, log: &'a Log) -> BoxFuture<'a, Vote> {
        Box::pin(async move {
            let Some(c) = self.0.conn_of(tid) else {
                return Vote::ReadOnly;
            };
            shared::pause(self.0.cfg.pause.as_ref(), PausePoint::BeforeVote, tid).await;
            let wait = self.0.cfg.prepare_wait;
            shared::prepare(WHO, tid, log, wait, &c.progress, || {
                let gone = c.server_gone.load(Ordering::SeqCst);
                shared::prepare_check(WHO, &c.core.lock(), gone, tid, &c.name)
            })
            .await
        })
    }

    fn commit(&self, tid: Tid) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            let Some(c) = self.0.conn_of(tid) else { return };
            shared::pause(self.0.cfg.pause.as_ref(), PausePoint::BeforeRelease, tid).await;
            match c.step(Event::Commit { tx: tid }) {
                Ok(a) => {
                    c.apply(a).await;
                    shared::log_released(self.0.log.get(), tid);
                }
                Err(e) => {
                    tracing::warn!(%tid, conn = %c.name, error = %e, "net proxy: commit not applied")
                }
            }
            self.0.by_tid.lock().remove(&tid);
            c.progress.notify_waiters();
            c.pump().await;
            c.close_if_done().await;
        })
    }

    fn abort(&self, tid: Tid) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            let Some(c) = self.0.conn_of(tid) else { return };
            let _ = c.step(Event::Abort { tx: tid });
            self.0.by_tid.lock().remove(&tid);
            c.progress.notify_waiters();
            c.close_if_done().await;
        })
    }

    fn held(&self) -> Vec<(Tid, String)> {
        let tids: Vec<(Tid, ConnName)> = self
            .0
            .by_tid
            .lock()
            .iter()
            .map(|(t, c)| (*t, c.clone()))
            .collect();
        tids.into_iter()
            .filter_map(|(t, name)| {
                let c = self.0.conns.lock().get(&name).cloned()?;
                let s = c.core.lock().stats();
                Some((
                    t,
                    format!("{name}: {} bytes held for the peer", s.held_bytes),
                ))
            })
            .collect()
    }
}

fn plugin_failure(e: impl std::fmt::Display) -> Failure {
    Failure::new(Status::Internal, format!("net proxy: {e}"))
}

impl Plugin for NetProxy {
    fn name(&self) -> &str {
        SERVICE
    }

    fn attach(&self, tm: &TxManager, log: &Log) -> Result<(), Failure> {
        let _ = self.inner.log.set(log.clone());
        tm.register_resource(Arc::new(ProxyResource(Arc::clone(&self.inner))));
        Ok(())
    }

    fn recover(&self, tm: &TxManager, records: &[LogRecord]) -> Result<(), Failure> {
        let lost = shared::undeliverable("net proxy", tm, records)?;
        self.inner.undeliverable.lock().extend(lost);
        Ok(())
    }

    fn serve(&self, rpc: &Rpc) -> Result<(), Failure> {
        let std_listener = std::net::TcpListener::bind(self.inner.cfg.listen).map_err(|e| {
            Failure::new(
                Status::AddrError,
                format!("net proxy: cannot listen on {}: {e}", self.inner.cfg.listen),
            )
        })?;
        std_listener.set_nonblocking(true).map_err(plugin_failure)?;
        let bound = std_listener.local_addr().map_err(plugin_failure)?;
        let listener = TcpListener::from_std(std_listener).map_err(plugin_failure)?;
        let _ = self.inner.bound.set(bound);
        tokio::spawn(Arc::clone(&self.inner).accept_loop(listener));
        let inner = Arc::clone(&self.inner);
        rpc.register(
            SERVICE,
            ServiceOptions::with_participant(Arc::new(ProxyResource(Arc::clone(&self.inner)))),
            move |ctx, req: NetRequest| {
                let inner = Arc::clone(&inner);
                async move { inner.serve_call(ctx, req).await }
            },
        )
    }
}
