//! The TLA logger: a weft plugin that routes IP packets between the peer's
//! TUN device and the server's, runs a [`TlaConn`] per TCP connection the
//! peer opens, serves the `net` control service (the same messages as 2CA;
//! a restart answers where its replay lands) and takes part in the server's
//! transactions as a two-phase resource.
//!
//! Owns the TUN devices' reader threads, the packet task (parse, step the
//! connection, write what it says; other traffic passes unchanged), the
//! retransmission timer, the map from transactions to connections, commit
//! (release) and abort (drop); what prepare, TX_START and recovery do beyond
//! finding the connection is the shared [`crate::control::logger`]'s. Must never release a held
//! byte before the commit decision reached this node; never keep more
//! connections than its bound.

use std::collections::HashMap;
use std::fs::File;
use std::io::{Read, Write};
use std::net::SocketAddrV4;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use parking_lot::Mutex;
use tokio::sync::{mpsc, Notify};
use weft_log::{Log, LogRecord};
use weft_rpc::{CallContext, Plugin, Rpc, ServiceOptions};
use weft_tx::{ParticipationClass, Resource, TxManager, Vote};
use weft_wire::{Failure, Status, Tid};

use super::conn::{Out, TlaConfig, TlaConn, TlaError};
use super::packet::{self, PacketError, ACK, SYN};
use super::tun;
use crate::control::logger::{
    self as shared, need_tx, Check, PauseHook, PausePoint, Undeliverable,
};
use crate::control::{ConnInfo, NetRequest, NetResponse, SERVICE};
use crate::core::CoreError;

/// Prefix of the logger's messages.
const WHO: &str = "tla";

/// A TUN device, by name, in a network namespace (`ip netns`) or the
/// logger's own.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TunSpec {
    /// The device's name.
    pub name: String,
    /// The namespace, if not the logger's.
    pub netns: Option<String>,
}

/// Logger settings.
#[derive(Clone, Debug)]
pub struct TlaLoggerConfig {
    /// The device on the peer's side.
    pub peer: TunSpec,
    /// The device on the server's side.
    pub server: TunSpec,
    /// Each connection's bounds and timers.
    pub conn: TlaConfig,
    /// Longest wait at prepare for the transaction's last server bytes.
    pub prepare_wait: Duration,
    /// Longest wait of a TX_START for the previous transaction's outcome.
    pub start_wait: Duration,
    /// Most connections at once (further SYNs are dropped).
    pub max_conns: usize,
    /// Test hook: holds transactions at points of their commit.
    pub pause: Option<PauseHook>,
}

impl TlaLoggerConfig {
    /// Defaults for the two devices.
    pub fn new(peer: TunSpec, server: TunSpec) -> Self {
        TlaLoggerConfig {
            peer,
            server,
            conn: TlaConfig::default(),
            prepare_wait: Duration::from_secs(10),
            start_wait: Duration::from_secs(5),
            max_conns: 1024,
            pause: None,
        }
    }
}

/// Packets queued from the devices to the packet task.
const QUEUE: usize = 4096;
/// Largest packet read from a device.
const MTU_BUF: usize = 65536;
/// Period of the retransmission and aging timer.
const TICK: Duration = Duration::from_millis(20);

#[derive(Default)]
struct St {
    conns: HashMap<SocketAddrV4, TlaConn>,
    by_tid: HashMap<Tid, SocketAddrV4>,
}

struct Tuns {
    peer: File,
    server: File,
}

struct Inner {
    cfg: TlaLoggerConfig,
    st: Mutex<St>,
    /// Any change a waiter may care about (server bytes, a decision).
    progress: Notify,
    tuns: OnceLock<Tuns>,
    log: OnceLock<Log>,
    undeliverable: Mutex<Vec<Undeliverable>>,
}

/// The TLA logger, a [`Plugin`] of its node.
#[derive(Clone)]
pub struct TlaLogger {
    inner: Arc<Inner>,
}

struct TlaResource(Arc<Inner>);

impl TlaLogger {
    /// A logger with `cfg`; it opens its devices once its node serves.
    pub fn new(cfg: TlaLoggerConfig) -> TlaLogger {
        TlaLogger {
            inner: Arc::new(Inner {
                cfg,
                st: Mutex::new(St::default()),
                progress: Notify::new(),
                tuns: OnceLock::new(),
                log: OnceLock::new(),
                undeliverable: Mutex::new(Vec::new()),
            }),
        }
    }

    /// The connections.
    pub fn list(&self) -> Vec<ConnInfo> {
        self.inner.list()
    }

    /// Committed (or in-doubt) output a previous run prepared and never
    /// released: its connection's mapping died with that run.
    pub fn undeliverable(&self) -> Vec<Undeliverable> {
        self.inner.undeliverable.lock().clone()
    }
}

fn tla_failure(e: TlaError) -> Failure {
    match e {
        TlaError::Core(c) => c.into(),
        TlaError::NotEstablished => Failure::new(Status::Unavailable, format!("tla: {e}")),
        TlaError::PeerClosed => Failure::new(Status::Mismatch, format!("tla: {e}")),
    }
}

fn conn_key(name: &str) -> Result<SocketAddrV4, Failure> {
    name.parse().map_err(|_| {
        Failure::new(
            Status::BadRequest,
            format!("tla: {name:?} is not a peer's IPv4 address and port"),
        )
    })
}

impl Inner {
    fn list(&self) -> Vec<ConnInfo> {
        let st = self.st.lock();
        let mut v: Vec<ConnInfo> = st
            .conns
            .iter()
            .map(|(k, c)| ConnInfo {
                conn: k.to_string(),
                peer: k.to_string(),
                state: c.state(),
                tx: c.tx(),
                server_gone: c.server_gone(),
                stats: c.stats(),
            })
            .collect();
        v.sort_by(|a, b| a.conn.cmp(&b.conn));
        v
    }

    /// Writes `o`'s segments to the devices.
    fn emit(&self, o: Out) {
        let Some(t) = self.tuns.get() else { return };
        for (dev, segs) in [(&t.peer, o.to_peer), (&t.server, o.to_server)] {
            for s in segs {
                match packet::build(&s) {
                    Ok(p) => {
                        if let Err(e) = (&*dev).write(&p) {
                            tracing::debug!(error = %e, "tla: a packet was not written");
                        }
                    }
                    Err(e) => tracing::warn!(error = %e, "tla: a segment could not be built"),
                }
            }
        }
    }

    fn pass(&self, from_peer: bool, pkt: &[u8]) {
        let Some(t) = self.tuns.get() else { return };
        let dev = if from_peer { &t.server } else { &t.peer };
        let _ = (&*dev).write(pkt);
    }

    fn on_packet(&self, from_peer: bool, pkt: &[u8]) {
        let now = Instant::now();
        let seg = match packet::parse(pkt) {
            Ok(s) => s,
            Err(PacketError::NotTcp(_)) => return self.pass(from_peer, pkt),
            Err(e) => {
                tracing::trace!(error = %e, "tla: packet dropped");
                return;
            }
        };
        let key = if from_peer {
            SocketAddrV4::new(seg.src, seg.sport)
        } else {
            SocketAddrV4::new(seg.dst, seg.dport)
        };
        let mut st = self.st.lock();
        let res = match st.conns.get_mut(&key) {
            Some(c) if from_peer => c.on_peer(now, &seg),
            Some(c) => c.on_server(now, &seg),
            None if from_peer && seg.has(SYN) && !seg.has(ACK) => {
                if st.conns.len() >= self.cfg.max_conns {
                    tracing::warn!(peer = %key, max = self.cfg.max_conns, "tla: too many connections, SYN dropped");
                    return;
                }
                let (c, syn) = TlaConn::new(self.cfg.conn, now, &seg);
                st.conns.insert(key, c);
                tracing::debug!(peer = %key, "tla: connection");
                Ok(Out {
                    to_peer: vec![],
                    to_server: vec![syn],
                })
            }
            None => {
                // Not a connection this logger tracks: routed unchanged.
                drop(st);
                return self.pass(from_peer, pkt);
            }
        };
        match res {
            Ok(o) => self.emit(o),
            Err(e) => tracing::debug!(peer = %key, error = %e, "tla: segment refused"),
        }
        if st.conns.get(&key).is_some_and(|c| c.is_closed()) {
            st.conns.remove(&key);
            st.by_tid.retain(|_, k| *k != key);
        }
        drop(st);
        self.progress.notify_waiters();
    }

    fn tick(&self) {
        let now = Instant::now();
        let mut st = self.st.lock();
        let mut outs = Vec::new();
        for c in st.conns.values_mut() {
            outs.push(c.tick(now));
        }
        for o in outs {
            self.emit(o);
        }
        let St { conns, by_tid } = &mut *st;
        conns.retain(|k, c| {
            let keep = !c.is_closed() && !c.is_idle(now);
            if !keep {
                tracing::debug!(peer = %k, "tla: connection forgotten (closed or idle)");
                by_tid.retain(|_, v| v != k);
            }
            keep
        });
    }

    /// Applies `f` to the connection `name`, writes what it says; the
    /// outer error when there is no such connection, the inner one when `f`
    /// refused. Wakes no waiter (a waiting caller would wake itself).
    fn try_conn<T>(
        &self,
        name: &str,
        f: impl FnOnce(&mut TlaConn, Instant) -> Result<(T, Out), TlaError>,
    ) -> Result<Result<T, TlaError>, Failure> {
        let key = conn_key(name)?;
        let mut st = self.st.lock();
        let c = st.conns.get_mut(&key).ok_or_else(|| {
            Failure::new(
                Status::BadRequest,
                format!("tla: no connection from {name} at this logger"),
            )
        })?;
        let res = f(c, Instant::now()).map(|(t, o)| {
            self.emit(o);
            t
        });
        Ok(res)
    }

    fn with_conn<T>(
        &self,
        name: &str,
        f: impl FnOnce(&mut TlaConn, Instant) -> Result<(T, Out), TlaError>,
    ) -> Result<T, Failure> {
        let res = self.try_conn(name, f)?.map_err(tla_failure);
        self.progress.notify_waiters();
        res
    }

    fn abort_old(&self, name: &str, aborted: Option<Tid>) -> Result<(), Failure> {
        let Some(old) = aborted else { return Ok(()) };
        self.with_conn(name, |c, now| {
            if c.tx() == Some(old) {
                c.abort(now, old).map(|o| ((), o))
            } else {
                Ok(((), Out::default()))
            }
        })?;
        self.st.lock().by_tid.remove(&old);
        Ok(())
    }

    async fn serve_call(&self, ctx: CallContext, req: NetRequest) -> Result<NetResponse, Failure> {
        match req {
            NetRequest::List => Ok(NetResponse::Conns(self.list())),
            NetRequest::Sync {
                conn,
                out_from,
                aborted,
            } => {
                self.abort_old(&conn, aborted)?;
                self.with_conn(&conn, |c, now| c.sync(now, out_from).map(|o| ((), o)))?;
                Ok(NetResponse::Done)
            }
            NetRequest::End {
                conn,
                in_end,
                out_end,
            } => {
                let tid = need_tx(&ctx, WHO)?;
                self.with_conn(&conn, |c, now| {
                    c.end(now, tid, in_end, out_end).map(|o| ((), o))
                })?;
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
                self.abort_old(&conn, aborted)?;
                let r = shared::when_free(WHO, &conn, self.cfg.start_wait, &self.progress, || {
                    let res = self.try_conn(&conn, |c, now| {
                        if replay {
                            c.restart(now, tid, out_from)
                                .map(|(at, o)| (NetResponse::ReplayAt(at), o))
                        } else {
                            c.start(now, tid, in_from, out_from)
                                .map(|o| (NetResponse::Done, o))
                        }
                    })?;
                    match res {
                        Ok(r) => Ok(Some(r)),
                        Err(TlaError::Core(CoreError::Busy(_))) => Ok(None),
                        Err(e) => Err(tla_failure(e)),
                    }
                })
                .await?;
                self.st.lock().by_tid.insert(tid, conn_key(&conn)?);
                self.progress.notify_waiters();
                Ok(r)
            }
        }
    }

    fn conn_of(&self, tid: Tid) -> Option<SocketAddrV4> {
        self.st.lock().by_tid.get(&tid).copied()
    }
}

impl Resource for TlaResource {
    fn name(&self) -> &str {
        "net-tla"
    }

    fn class(&self) -> ParticipationClass {
        ParticipationClass::TwoPhase
    }

    /// As the 2CA proxy's: the logger may take the server's decision.
    fn may_decide_alone(&self) -> bool {
        true
    }

    fn prepare<'a>(&'a self, tid: Tid, log: &'a Log) -> BoxFuture<'a, Vote> {
        Box::pin(async move {
            let Some(key) = self.0.conn_of(tid) else {
                return Vote::ReadOnly;
            };
            shared::pause(self.0.cfg.pause.as_ref(), PausePoint::BeforeVote, tid).await;
            let wait = self.0.cfg.prepare_wait;
            shared::prepare(WHO, tid, log, wait, &self.0.progress, || {
                let st = self.0.st.lock();
                match st.conns.get(&key) {
                    None => {
                        Check::Vote(Vote::No(format!("tla: the connection from {key} is gone")))
                    }
                    Some(c) => {
                        shared::prepare_check(WHO, c.core(), c.server_gone(), tid, &key.to_string())
                    }
                }
            })
            .await
        })
    }

    fn commit(&self, tid: Tid) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            let Some(key) = self.0.conn_of(tid) else {
                return;
            };
            shared::pause(self.0.cfg.pause.as_ref(), PausePoint::BeforeRelease, tid).await;
            let res = self.0.with_conn(&key.to_string(), |c, now| {
                c.commit(now, tid).map(|o| ((), o))
            });
            match res {
                Ok(()) => shared::log_released(self.0.log.get(), tid),
                Err(e) => tracing::warn!(%tid, peer = %key, error = %e, "tla: commit not applied"),
            }
            self.0.st.lock().by_tid.remove(&tid);
        })
    }

    fn abort(&self, tid: Tid) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            let Some(key) = self.0.conn_of(tid) else {
                return;
            };
            let _ = self.0.with_conn(&key.to_string(), |c, now| {
                c.abort(now, tid).map(|o| ((), o))
            });
            self.0.st.lock().by_tid.remove(&tid);
        })
    }

    fn held(&self) -> Vec<(Tid, String)> {
        let st = self.0.st.lock();
        st.by_tid
            .iter()
            .filter_map(|(t, k)| {
                let c = st.conns.get(k)?;
                Some((
                    *t,
                    format!("{k}: {} bytes held for the peer", c.stats().held_bytes),
                ))
            })
            .collect()
    }
}

fn plugin_failure(e: impl std::fmt::Display) -> Failure {
    Failure::new(Status::Internal, format!("tla logger: {e}"))
}

fn open_tun(spec: &TunSpec) -> Result<File, Failure> {
    tun::open(&spec.name, spec.netns.as_deref()).map_err(|e| {
        Failure::new(
            Status::AddrError,
            format!(
                "tla: cannot open the TUN device {} (namespace {}): {e}",
                spec.name,
                spec.netns.as_deref().unwrap_or("-")
            ),
        )
    })
}

fn spawn_reader(mut dev: File, from_peer: bool, tx: mpsc::Sender<(bool, Vec<u8>)>) {
    std::thread::spawn(move || {
        let mut buf = vec![0u8; MTU_BUF];
        loop {
            match dev.read(&mut buf) {
                Ok(0) => return,
                Ok(n) => {
                    if tx.blocking_send((from_peer, buf[..n].to_vec())).is_err() {
                        return;
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    tracing::warn!(error = %e, "tla: reading a TUN device failed");
                    return;
                }
            }
        }
    });
}

impl Plugin for TlaLogger {
    fn name(&self) -> &str {
        SERVICE
    }

    fn attach(&self, tm: &TxManager, log: &Log) -> Result<(), Failure> {
        let _ = self.inner.log.set(log.clone());
        tm.register_resource(Arc::new(TlaResource(Arc::clone(&self.inner))));
        Ok(())
    }

    fn recover(&self, tm: &TxManager, records: &[LogRecord]) -> Result<(), Failure> {
        let lost = shared::undeliverable("tla logger", tm, records)?;
        self.inner.undeliverable.lock().extend(lost);
        Ok(())
    }

    fn serve(&self, rpc: &Rpc) -> Result<(), Failure> {
        let peer = open_tun(&self.inner.cfg.peer)?;
        let server = open_tun(&self.inner.cfg.server)?;
        let (tx, mut rx) = mpsc::channel(QUEUE);
        spawn_reader(peer.try_clone().map_err(plugin_failure)?, true, tx.clone());
        spawn_reader(server.try_clone().map_err(plugin_failure)?, false, tx);
        let _ = self.inner.tuns.set(Tuns { peer, server });
        let inner = Arc::clone(&self.inner);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(TICK);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    p = rx.recv() => match p {
                        Some((from_peer, pkt)) => inner.on_packet(from_peer, &pkt),
                        None => return,
                    },
                    _ = tick.tick() => inner.tick(),
                }
            }
        });
        let inner = Arc::clone(&self.inner);
        rpc.register(
            SERVICE,
            ServiceOptions::with_participant(Arc::new(TlaResource(Arc::clone(&self.inner)))),
            move |ctx, req: NetRequest| {
                let inner = Arc::clone(&inner);
                async move { inner.serve_call(ctx, req).await }
            },
        )
    }
}
