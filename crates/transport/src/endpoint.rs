//! The endpoint: one node's messaging runtime.
//!
//! Owns the peer table (routes, links, liveness), the pending-call table, the
//! dispatch of received frames to the layers above, the failure detector's
//! loop and the naming protocol (directory and member sides). Must never hold
//! a lock while handing a frame to a link or an event to a listener: links may
//! deliver synchronously into another node of the same process, which may
//! answer synchronously. Must never be reachable before its owner says it is
//! ready, nor broadcast a death verdict (docs/membership.md).

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::Poll;
use std::time::{Duration, Instant};

use parking_lot::{Mutex, RwLock};
use rand::RngCore;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use weft_wire::{
    Failure, Frame, FrameKind, Hello, Incarnation, Message, NodeId, Payload, PeerRole, Port,
    Request, Response, Status,
};

use crate::calls::{CallGuard, Calls};
use crate::channel::{ChannelKind, IoError};
use crate::config::TransportConfig;
use crate::detector::{Detector, Verdict};
use crate::handshake::Side;
use crate::inproc::{self, InprocHub, Lookup};
use crate::link::{Link, PeerRef};
use crate::naming::{admission, NamingMsg, NodeInfo};
use crate::tcp;
use weft_wire::IdHashing;

/// Handles requests addressed to this node (the RPC layer implements it).
pub trait RequestHandler: Send + Sync + 'static {
    /// Takes one request. It must not block: long work is spawned. The
    /// request is answered through `responder` (dropping it answers
    /// Internal).
    fn handle(&self, from: PeerRef, request: Request, responder: Responder);
}

/// Handles one-way messages on a port (transactions, groups...).
pub trait PortHandler: Send + Sync + 'static {
    /// Takes one message. Runs on the endpoint's inbox task, in arrival
    /// order; it must not block.
    fn on_message(&self, from: PeerRef, payload: Payload);

    /// True when `on_message` may run where a frame that came over
    /// `channel` arrives (the link's reader; for inproc, the sender's own
    /// send call) instead of the inbox task, saving a task hop. Only for
    /// handlers that never block and hold no lock while they send (over
    /// inproc a send runs the receiver's handler in the sender's call);
    /// messages of one link still arrive in order. False by default.
    fn inline(&self, channel: ChannelKind) -> bool {
        let _ = channel;
        false
    }
}

/// A change in cluster membership or liveness.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MembershipEvent {
    /// A member joined, or came back with a new incarnation.
    Joined(NodeInfo),
    /// A member left (`cause` Ok), was declared dead (HostDead: silent past
    /// the detector's bound; ProcDead: its process is gone), or restarted
    /// (the old incarnation is reported here, ProcDead).
    Left {
        /// The member.
        node: NodeId,
        /// The incarnation that is gone, when known.
        incarnation: Option<Incarnation>,
        /// Ok, HostDead or ProcDead.
        cause: Status,
        /// Explanation.
        reason: String,
    },
    /// A member declared dead was heard from again (same incarnation).
    Revived(NodeId),
}

/// Where to find a cluster to join.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Seed {
    /// A member's TCP address.
    Tcp(SocketAddr),
    /// A member in the same in-process hub.
    Inproc(NodeId),
}

/// How this node sees one member.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct NodeStatus {
    /// What the member announced.
    pub info: NodeInfo,
    /// False once declared dead.
    pub alive: bool,
    /// Why it is dead, when it is.
    pub cause: Option<Status>,
    /// The channel of the established link to it, if any.
    pub channel: Option<ChannelKind>,
    /// A description of that link.
    pub route: Option<String>,
}

/// This node's view of the cluster.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ClusterView {
    /// The node whose view this is.
    pub node: NodeId,
    /// The directory node, when known.
    pub directory: Option<NodeId>,
    /// Every member this node knows, itself included.
    pub nodes: Vec<NodeStatus>,
}

/// Counters of frames sent by this node.
#[derive(Default)]
pub struct Stats {
    sent: [AtomicU64; 10],
}

impl Stats {
    pub(crate) fn count_sent(&self, kind: FrameKind) {
        self.sent[kind as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// A snapshot of the counters.
    pub fn snapshot(&self) -> StatsSnapshot {
        let g = |k: FrameKind| self.sent[k as usize].load(Ordering::Relaxed);
        StatsSnapshot {
            requests: g(FrameKind::Request),
            responses: g(FrameKind::Response),
            messages: g(FrameKind::Message),
            heartbeats: g(FrameKind::Heartbeat),
            handshakes: g(FrameKind::Hello) + g(FrameKind::Auth),
        }
    }
}

/// Frames sent, by kind.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct StatsSnapshot {
    /// Call requests.
    pub requests: u64,
    /// Call responses.
    pub responses: u64,
    /// One-way protocol messages.
    pub messages: u64,
    /// Heartbeat probes and answers.
    pub heartbeats: u64,
    /// Handshake frames.
    pub handshakes: u64,
}

impl StatsSnapshot {
    /// Messages that carry work: requests, responses and protocol messages
    /// (heartbeats and handshakes excluded).
    pub fn work_messages(&self) -> u64 {
        self.requests + self.responses + self.messages
    }
}

/// Answers one request, on the link it came from.
pub struct Responder {
    link: Arc<Link>,
    call_id: u64,
    done: bool,
}

impl Responder {
    /// The call id being answered.
    pub fn call_id(&self) -> u64 {
        self.call_id
    }

    /// Sends the response. A link closed in the meantime drops it silently
    /// (the caller's side fails the call).
    pub fn respond(mut self, mut response: Response) {
        self.done = true;
        response.call_id = self.call_id;
        // An answer the caller's side would refuse (too large) or that cannot
        // be encoded becomes a failure, so the caller is not left waiting.
        let failure = match self.link.send(Frame::Response(response)) {
            Err(IoError::TooLarge(e)) => Failure::new(Status::TooLarge, format!("the answer: {e}")),
            Err(IoError::Encode(e)) => Failure::new(Status::Internal, format!("the answer: {e}")),
            Ok(()) | Err(IoError::Closed) | Err(IoError::Full) => return,
        };
        if let Err(e) = self
            .link
            .send(Frame::Response(Response::failure(self.call_id, failure)))
        {
            // Not even the failure fits: the caller is left to its own
            // timeout, so at least say so here.
            tracing::warn!(
                link = self.link.id,
                call = self.call_id,
                "cannot answer: {e}"
            );
        }
    }

    /// Sends a failure response.
    pub fn fail(self, failure: Failure) {
        self.respond(Response::failure(0, failure));
    }
}

impl Drop for Responder {
    fn drop(&mut self) {
        self.link.release_request_slot();
        if !self.done {
            let _ = self.link.send(Frame::Response(Response::failure(
                self.call_id,
                Failure::new(
                    Status::Internal,
                    "the request was dropped without an answer",
                ),
            )));
        }
    }
}

/// Failure to start an endpoint.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The configuration cannot work.
    #[error("invalid transport configuration: {0}")]
    Config(String),
    /// The TCP listener could not be bound.
    #[error("cannot listen on {addr}: {source}")]
    Listen {
        /// The address.
        addr: SocketAddr,
        /// The OS error.
        source: std::io::Error,
    },
    /// Joining the cluster failed (see [`Endpoint::join`]).
    #[error("join: {0}")]
    Join(Failure),
}

#[derive(Default)]
struct PeerEntry {
    info: Option<NodeInfo>,
    incarnation: Option<Incarnation>,
    links: Vec<Arc<Link>>,
    connecting: Option<VecDeque<Frame>>,
    dead: Option<(Status, String)>,
    backoff: Option<(Instant, Failure)>,
    next_backoff: Duration,
}

struct NamingState {
    /// The directory; `None` while recovering or joining (Joins sent here
    /// are then refused with Unavailable: a node that is not yet a member
    /// must not admit anyone).
    directory: Option<NodeId>,
    members: BTreeMap<NodeId, NodeInfo>,
    pending_join: Option<oneshot::Sender<NamingMsg>>,
    seed: Option<Seed>,
    rejoin_at: Option<Instant>,
    /// Naming messages that came while the directory was unknown.
    early: Early,
}

/// Naming messages that arrived while this node was joining (its directory
/// unknown): a message the directory sent after the Welcome may overtake it
/// on another link. Replayed after the Welcome, those from the directory
/// only; past [`MAX_EARLY_NAMING`] they are dropped and the view asked again.
#[derive(Default)]
struct Early {
    overflowed: bool,
    msgs: Vec<(PeerRef, NamingMsg)>,
}

/// Most naming messages kept while joining.
const MAX_EARLY_NAMING: usize = 256;

/// A membership listener.
type Listener = Arc<dyn Fn(&MembershipEvent) + Send + Sync>;

#[derive(Default)]
struct Handlers {
    request: Option<Arc<dyn RequestHandler>>,
    ports: HashMap<Port, Arc<dyn PortHandler>>,
    listeners: Vec<Listener>,
}

/// Shared state of an endpoint; see [`Endpoint`].
pub(crate) struct Inner {
    pub(crate) cfg: TransportConfig,
    /// Memory for fragment reassembly, shared by every link of the node.
    pub(crate) reassembly: weft_wire::ReassemblyBudget,
    /// Accepts that failed for want of descriptors or memory.
    pub(crate) accept_starved: AtomicU64,
    /// The most messages of one link ever waiting for the inbox task.
    inbox_high_water: AtomicUsize,
    pub(crate) secret: Arc<[u8]>,
    pub(crate) stats: Arc<Stats>,
    hub: Option<Arc<InprocHub>>,
    me: RwLock<NodeInfo>,
    peers: Mutex<HashMap<NodeId, PeerEntry, IdHashing>>,
    links: Mutex<HashMap<u64, Arc<Link>>>,
    calls: Arc<Calls>,
    handlers: RwLock<Handlers>,
    detector: Mutex<Detector>,
    naming: Mutex<NamingState>,
    /// Messages for the inbox task, each with the link it came on (which
    /// counts its messages waiting here; see [`Link::inbox_full`]).
    inbox: mpsc::UnboundedSender<(PeerRef, Message, Arc<Link>)>,
    gateway: Mutex<Option<NodeId>>,
    link_ids: AtomicU64,
    call_ids: AtomicU64,
    crashed: Arc<AtomicBool>,
    closing: AtomicBool,
    /// Set by [`Endpoint::ready`]: until then nothing can reach this node.
    ready: AtomicBool,
    tasks: Mutex<Vec<JoinHandle<()>>>,
    refusals: Mutex<VecDeque<String>>,
}

/// Most refused-link reports kept for [`Endpoint::refusals`].
const MAX_REFUSALS: usize = 64;

/// One node's messaging runtime: links to peers over the cheapest channel,
/// calls with deadlines, one-way protocol messages, cluster membership and
/// failure detection. Cheap to clone.
#[derive(Clone)]
pub struct Endpoint {
    inner: Arc<Inner>,
}

impl Endpoint {
    /// Starts an endpoint that is reachable at once: [`Endpoint::start_recovering`]
    /// then [`Endpoint::ready`] without a seed. A member starts as the
    /// directory of a one-node cluster until it joins another.
    ///
    /// Must be called inside a tokio runtime. Fails with [`StartError`] for
    /// an invalid configuration or a listener that cannot be bound.
    pub async fn start(cfg: TransportConfig) -> Result<Endpoint, StartError> {
        let ep = Endpoint::start_recovering(cfg)?;
        ep.ready(None).await?;
        Ok(ep)
    }

    /// Starts an endpoint that nothing can reach yet: no TCP listener, no
    /// shared-memory rendezvous, absent from the in-process hub, member of
    /// no cluster. Its owner recovers (log, services) and then calls
    /// [`Endpoint::ready`]; until then peers see the previous incarnation as
    /// gone (a refused connection) and never this one, so a node still
    /// recovering is never a member and never takes a call.
    ///
    /// Must be called inside a tokio runtime. Fails with
    /// [`StartError::Config`] for an invalid configuration.
    pub fn start_recovering(cfg: TransportConfig) -> Result<Endpoint, StartError> {
        cfg.validate().map_err(StartError::Config)?;
        let hub = if cfg.role == PeerRole::Node {
            Some(cfg.hub.clone().unwrap_or_else(InprocHub::global))
        } else {
            None
        };
        let me = NodeInfo {
            id: cfg.node,
            incarnation: cfg.incarnation,
            addr: None,
            host: cfg.host_id.clone(),
            hub: hub.as_ref().filter(|_| cfg.channels.inproc).map(|h| h.id()),
            shm: None,
            pid: std::process::id(),
            services: Vec::new(),
            directory: false,
        };
        let (inbox_tx, inbox_rx) = mpsc::unbounded_channel();
        let inner = Arc::new(Inner {
            reassembly: weft_wire::ReassemblyBudget::new(cfg.reassembly_budget),
            accept_starved: AtomicU64::new(0),
            inbox_high_water: AtomicUsize::new(0),
            secret: cfg.secret.clone().into(),
            detector: Mutex::new(Detector::new(cfg.heartbeat_interval, cfg.dead_after)),
            hub,
            me: RwLock::new(me.clone()),
            peers: Mutex::new(HashMap::default()),
            links: Mutex::new(HashMap::new()),
            calls: Calls::start(),
            handlers: RwLock::new(Handlers::default()),
            naming: Mutex::new(NamingState {
                directory: None,
                members: BTreeMap::new(),
                pending_join: None,
                seed: None,
                rejoin_at: None,
                early: Early::default(),
            }),
            inbox: inbox_tx,
            gateway: Mutex::new(None),
            link_ids: AtomicU64::new(1),
            call_ids: AtomicU64::new(1),
            crashed: Arc::new(AtomicBool::new(false)),
            closing: AtomicBool::new(false),
            ready: AtomicBool::new(false),
            tasks: Mutex::new(Vec::new()),
            refusals: Mutex::new(VecDeque::new()),
            stats: Arc::new(Stats::default()),
            cfg,
        });
        if inner.cfg.role == PeerRole::Node {
            inner.naming.lock().members.insert(me.id, me);
        }
        inner.spawn(Inner::inbox_task(Arc::downgrade(&inner), inbox_rx));
        inner.spawn(Inner::detector_task(Arc::downgrade(&inner)));
        Ok(Endpoint { inner })
    }

    /// Makes a recovered endpoint reachable and enters the cluster: binds the
    /// TCP listener (if configured), the shared-memory rendezvous, registers
    /// in the in-process hub, then joins through `seed` or, without one,
    /// serves as the directory of a new cluster. The node's services must be
    /// registered before: from here on peers may call it. Its directory stays
    /// unknown until the join completes, so it admits nobody meanwhile.
    ///
    /// Fails with [`StartError::Listen`] when the listener cannot be bound
    /// and [`StartError::Join`] when joining fails (see [`Endpoint::join`]).
    /// Calling it again does nothing.
    pub async fn ready(&self, seed: Option<Seed>) -> Result<(), StartError> {
        let inner = &self.inner;
        if inner.ready.load(Ordering::Acquire) {
            return Ok(());
        }
        if let Some(addr) = inner.cfg.listen.filter(|_| inner.cfg.channels.tcp) {
            let bound = tcp::listen(inner, addr)
                .await
                .map_err(|source| StartError::Listen { addr, source })?;
            inner.me.write().addr = Some(bound.to_string());
        }
        // shm (issue 6): same-host peers reach this node through shared memory.
        if inner.cfg.channels.shm && inner.cfg.role == PeerRole::Node {
            match crate::shm::listen(inner).await {
                Ok(rendezvous) => inner.me.write().shm = Some(rendezvous),
                Err(e) => tracing::warn!(node = %inner.cfg.node, "no shared-memory channel: {e}"),
            }
        }
        inner.ready.store(true, Ordering::Release);
        if inner.cfg.role != PeerRole::Node {
            return Ok(());
        }
        if seed.is_none() {
            inner.me.write().directory = true;
            inner.naming.lock().directory = Some(inner.cfg.node);
        }
        let me = inner.me.read().clone();
        inner.naming.lock().members.insert(me.id, me);
        if let Some(hub) = &inner.hub {
            hub.register(inner.cfg.node, inner);
        }
        match seed {
            Some(seed) => self.join(seed).await.map_err(StartError::Join),
            None => Ok(()),
        }
    }

    /// Connects a client endpoint to one node, which relays its calls.
    ///
    /// Fails with the handshake's status (WrongSecret when the secret is
    /// wrong), ProcDead/HostDead when the node cannot be reached.
    pub async fn connect_client(
        cfg: TransportConfig,
        addr: SocketAddr,
    ) -> Result<Endpoint, Failure> {
        let ep = Endpoint::start(TransportConfig {
            role: PeerRole::Client,
            listen: None,
            ..cfg
        })
        .await
        .map_err(|e| Failure::new(Status::BadRequest, e.to_string()))?;
        let link = tcp::connect(&ep.inner, addr, None).await?;
        let peer = link.established(ep.inner.cfg.connect_timeout).await?;
        *ep.inner.gateway.lock() = Some(peer.node);
        Ok(ep)
    }

    /// Joins the cluster through `seed` (any member; a non-directory member
    /// redirects to the directory). Retries the directory automatically later
    /// if it dies or restarts.
    ///
    /// Fails with WrongSecret when the cluster's secret differs (the
    /// directory logs the refusal too), Refused when the node id is taken by
    /// another live node, HostDead/ProcDead when the seed cannot be reached,
    /// TimedOut when the directory does not answer, Unavailable before
    /// [`Endpoint::ready`] or when the seed is itself still joining past
    /// four connect timeouts (it is asked again meanwhile).
    pub async fn join(&self, seed: Seed) -> Result<(), Failure> {
        let inner = &self.inner;
        if !inner.ready.load(Ordering::Acquire) {
            return Err(Failure::new(
                Status::Unavailable,
                "the node is still recovering: not reachable yet",
            ));
        }
        // A node that is the directory of nobody but itself stops being one
        // while it joins: it must not admit a node joining through it before
        // it knows the real directory.
        let was_alone = {
            let mut naming = inner.naming.lock();
            naming.seed = Some(seed.clone());
            let alone = naming.directory == Some(inner.cfg.node)
                && naming.members.keys().all(|n| *n == inner.cfg.node);
            if alone {
                naming.directory = None;
            }
            alone
        };
        if was_alone {
            inner.me.write().directory = false;
        }
        let deadline = Instant::now() + inner.cfg.connect_timeout * 4;
        let mut pause = Duration::from_millis(10);
        let result = loop {
            match inner.join_via(seed.clone()).await {
                Err(f) if f.status == Status::Unavailable && Instant::now() < deadline => {
                    tracing::debug!(node = %inner.cfg.node, %f, "seed not ready; asking again");
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_millis(200));
                }
                other => break other,
            }
        };
        if result.is_err() && was_alone {
            let mut naming = inner.naming.lock();
            if naming.directory.is_none() {
                naming.directory = Some(inner.cfg.node);
                drop(naming);
                inner.me.write().directory = true;
            }
        }
        result
    }

    /// This node's id.
    pub fn node_id(&self) -> NodeId {
        self.inner.cfg.node
    }

    /// This node's incarnation.
    pub fn incarnation(&self) -> Incarnation {
        self.inner.cfg.incarnation
    }

    /// The configuration the endpoint runs with.
    pub fn config(&self) -> &TransportConfig {
        &self.inner.cfg
    }

    /// The bound TCP address, if listening.
    pub fn listen_addr(&self) -> Option<SocketAddr> {
        self.inner
            .me
            .read()
            .addr
            .as_deref()
            .and_then(|a| a.parse().ok())
    }

    /// What this node announces about itself.
    pub fn info(&self) -> NodeInfo {
        self.inner.me.read().clone()
    }

    /// Installs the handler for requests to this node.
    pub fn set_request_handler(&self, handler: Arc<dyn RequestHandler>) {
        self.inner.handlers.write().request = Some(handler);
    }

    /// Installs the handler of a protocol port.
    pub fn set_port_handler(&self, port: Port, handler: Arc<dyn PortHandler>) {
        self.inner.handlers.write().ports.insert(port, handler);
    }

    /// Adds a membership listener. Listeners run synchronously where the
    /// event happens and must not block.
    pub fn on_membership(&self, listener: impl Fn(&MembershipEvent) + Send + Sync + 'static) {
        self.inner
            .handlers
            .write()
            .listeners
            .push(Arc::new(listener));
    }

    /// Announces this node's services to the cluster.
    pub fn set_services(&self, mut services: Vec<String>) {
        services.sort();
        services.dedup();
        let info = {
            let mut me = self.inner.me.write();
            if me.services == services {
                return;
            }
            me.services = services;
            me.clone()
        };
        self.inner.announce_self(info);
    }

    /// Sends a one-way message to a port of `to`.
    ///
    /// Fails with AddrError for an unknown node, HostDead/ProcDead for a dead
    /// one, NoBuffer when too many frames wait for its link, ShuttingDown
    /// after shutdown. Success means handed to the link, not delivered.
    pub fn send(&self, to: NodeId, port: Port, payload: Payload) -> Result<(), Failure> {
        self.inner
            .send_frame(to, Frame::Message(Message { port, payload }), false)
    }

    /// Calls `to` with `request` (its `call_id` is assigned here) and waits
    /// for the response until `deadline`. A request without a `budget_us`
    /// gets the time left until `deadline`; one with a budget keeps it (a
    /// caller that just read the clock to set the deadline spares a second
    /// reading).
    ///
    /// Fails with TimedOut at the deadline, HostDead when the detector
    /// declares the node dead meanwhile, ProcDead when its process is gone or
    /// the link closes, AddrError for an unknown node, NoBuffer when its
    /// queue is full. A response with a non-Ok status is returned as `Ok`:
    /// the status belongs to the callee.
    pub async fn call(
        &self,
        to: NodeId,
        mut request: Request,
        deadline: Option<Instant>,
    ) -> Result<Response, Failure> {
        let inner = &self.inner;
        let id = inner.call_ids.fetch_add(1, Ordering::Relaxed);
        request.call_id = id;
        let target = if inner.cfg.role == PeerRole::Client {
            inner
                .gateway
                .lock()
                .ok_or_else(|| Failure::new(Status::ProcDead, "not connected"))?
        } else {
            to
        };
        if let (Some(d), None) = (deadline, request.budget_us) {
            let left = d.saturating_duration_since(Instant::now());
            request.budget_us = Some(left.as_micros().min(u64::MAX as u128) as u64);
        }
        // The table fails the call with TimedOut at the deadline: no timer
        // per call (see the calls module). It holds this task's waker from
        // before the request leaves, so the first poll sends and the next
        // one, when woken, takes the outcome.
        let calls = &*inner.calls;
        let mut guard = CallGuard {
            calls,
            id,
            armed: false,
        };
        let mut request = Some(request);
        std::future::poll_fn(|cx| {
            let Some(request) = request.take() else {
                let outcome = calls.poll_outcome(id, cx);
                guard.armed = outcome.is_pending();
                return outcome;
            };
            calls.insert(id, target, to, deadline, cx.waker().clone());
            guard.armed = true;
            if let Err(f) = inner.send_frame(target, Frame::Request(request), false) {
                return Poll::Ready(Err(f));
            }
            Poll::Pending
        })
        .await
    }

    /// For a client: the node it is connected to (which relays its calls).
    pub fn gateway(&self) -> Option<NodeId> {
        *self.inner.gateway.lock()
    }

    /// The node serving as the cluster directory, when known.
    pub fn directory(&self) -> Option<NodeId> {
        self.inner.naming.lock().directory
    }

    /// The incarnation of `node` as last seen, if known.
    pub fn peer_incarnation(&self, node: NodeId) -> Option<Incarnation> {
        if node == self.inner.cfg.node {
            return Some(self.inner.cfg.incarnation);
        }
        self.inner
            .peers
            .lock()
            .get(&node)
            .and_then(|e| e.incarnation)
    }

    /// The status of `node`: `None` when alive and known, else why not
    /// (AddrError unknown, HostDead/ProcDead dead).
    pub fn peer_status(&self, node: NodeId) -> Option<Status> {
        if node == self.inner.cfg.node {
            return None;
        }
        match self.inner.peers.lock().get(&node) {
            None => Some(Status::AddrError),
            Some(e) => e.dead.as_ref().map(|(s, _)| *s),
        }
    }

    /// This node's view of the cluster.
    pub fn view(&self) -> ClusterView {
        self.inner.view()
    }

    /// Frame counters.
    pub fn stats(&self) -> StatsSnapshot {
        self.inner.stats.snapshot()
    }

    /// Bytes messages in reassembly hold now, all links together (bounded
    /// by [`TransportConfig::reassembly_budget`]).
    pub fn reassembly_bytes(&self) -> usize {
        self.inner.reassembly.in_use()
    }

    /// How many times accepting a TCP connection failed for want of
    /// descriptors or memory (the listener backs off and goes on).
    pub fn accept_starved(&self) -> u64 {
        self.inner.accept_starved.load(Ordering::Relaxed)
    }

    /// The most protocol messages of one link that ever waited for this
    /// node's inbox task at once (bounded by
    /// [`TransportConfig::max_inbox_per_link`] on TCP links).
    pub fn inbox_high_water(&self) -> usize {
        self.inner.inbox_high_water.load(Ordering::Relaxed)
    }

    /// Links open now (handshaking or established), all channels.
    pub fn open_links(&self) -> usize {
        self.inner.links.lock().len()
    }

    /// Recent links this node refused or was refused on (wrong secret,
    /// protocol errors), newest last.
    pub fn refusals(&self) -> Vec<String> {
        self.inner.refusals.lock().iter().cloned().collect()
    }

    /// Number of calls waiting for an answer.
    pub fn pending_calls(&self) -> usize {
        self.inner.calls.len()
    }

    /// Leaves the cluster in an orderly way: tells the directory, says
    /// goodbye on every link, fails pending calls with ShuttingDown and stops.
    pub async fn shutdown(&self) {
        let inner = &self.inner;
        if inner.closing.swap(true, Ordering::AcqRel) {
            return;
        }
        let directory = inner.naming.lock().directory;
        if let Some(dir) = directory.filter(|d| *d != inner.cfg.node) {
            let msg = NamingMsg::Leave {
                node: inner.cfg.node,
                incarnation: inner.cfg.incarnation,
            };
            let _ = inner.send_frame(dir, naming_frame(msg), true);
        } else if directory == Some(inner.cfg.node) {
            // The directory leaving tells everyone itself.
            inner.broadcast(
                NamingMsg::Left {
                    node: inner.cfg.node,
                    incarnation: inner.cfg.incarnation,
                    cause: Status::Ok,
                },
                None,
            );
        }
        let links: Vec<Arc<Link>> = inner.links.lock().values().cloned().collect();
        for link in &links {
            let _ = link.send(Frame::Goodbye(weft_wire::Goodbye {
                reason: "shutdown".into(),
            }));
        }
        // Give the goodbyes a moment to be written before the sockets close.
        tokio::time::sleep(Duration::from_millis(5)).await;
        for link in links {
            link.close(Status::ShuttingDown, "node shutting down");
        }
        inner
            .calls
            .fail_all(&Failure::new(Status::ShuttingDown, "node shutting down"));
        if let Some(hub) = &inner.hub {
            hub.unregister(inner.cfg.node, inner);
        }
        inner.stop_tasks();
    }

    /// Simulates a crash (tests): from now on the node neither sends nor
    /// receives anything; in-process peers see silence (and declare it dead
    /// after the detector's bound), TCP peers see their connections drop as
    /// when a process dies.
    pub fn crash(&self) {
        let inner = &self.inner;
        if inner.crashed.swap(true, Ordering::AcqRel) {
            return;
        }
        inner.closing.store(true, Ordering::Release);
        if let Some(hub) = &inner.hub {
            hub.mark_crashed(inner.cfg.node, inner);
        }
        let links: Vec<Arc<Link>> = inner.links.lock().values().cloned().collect();
        for link in links {
            if link.kind() != ChannelKind::Inproc {
                link.close(Status::ProcDead, "crashed");
            }
        }
        inner
            .calls
            .fail_all(&Failure::new(Status::ShuttingDown, "node crashed"));
        inner.stop_tasks();
    }

    /// True after [`Endpoint::crash`].
    pub fn is_crashed(&self) -> bool {
        self.inner.is_crashed()
    }
}

fn naming_frame(msg: NamingMsg) -> Frame {
    Frame::Message(Message {
        port: Port::NAMING,
        payload: Payload::local(msg),
    })
}

impl Inner {
    pub(crate) fn own_hello(&self) -> Hello {
        let mut nonce = [0u8; 16];
        rand::thread_rng().fill_bytes(&mut nonce);
        Hello {
            node: self.cfg.node,
            incarnation: self.cfg.incarnation,
            role: self.cfg.role,
            nonce,
            max_frame: self.cfg.limits.max_frame.min(u32::MAX as usize) as u32,
            max_message: self.cfg.limits.max_message as u64,
        }
    }

    pub(crate) fn next_link_id(&self) -> u64 {
        self.link_ids.fetch_add(1, Ordering::Relaxed)
    }

    pub(crate) fn is_crashed(&self) -> bool {
        self.crashed.load(Ordering::Acquire)
    }

    /// The flag [`Inner::is_crashed`] reads, for a link to read without
    /// reaching the endpoint.
    pub(crate) fn crashed_flag(&self) -> Arc<AtomicBool> {
        Arc::clone(&self.crashed)
    }

    pub(crate) fn is_closing(&self) -> bool {
        self.closing.load(Ordering::Acquire)
    }

    pub(crate) fn spawn(&self, fut: impl Future<Output = ()> + Send + 'static) {
        let handle = tokio::spawn(fut);
        let mut tasks = self.tasks.lock();
        tasks.retain(|t| !t.is_finished());
        tasks.push(handle);
    }

    fn stop_tasks(&self) {
        for t in self.tasks.lock().drain(..) {
            t.abort();
        }
    }

    pub(crate) fn register_link(&self, link: &Arc<Link>) {
        self.links.lock().insert(link.id, Arc::clone(link));
    }

    fn emit(&self, event: MembershipEvent) {
        tracing::debug!(node = %self.cfg.node, ?event, "membership");
        let listeners = self.handlers.read().listeners.clone();
        for l in listeners {
            l(&event);
        }
    }

    // ----- sending ---------------------------------------------------------

    /// Sends a frame to `to` over an established link, queueing it while a
    /// link is being set up. `probe` lets heartbeats reach peers believed dead.
    pub(crate) fn send_frame(
        self: &Arc<Self>,
        to: NodeId,
        frame: Frame,
        probe: bool,
    ) -> Result<(), Failure> {
        if self.is_crashed() {
            return Ok(());
        }
        if self.is_closing() && !probe {
            return Err(Failure::new(Status::ShuttingDown, "node is shutting down"));
        }
        {
            let call_id = match &frame {
                Frame::Request(r) => Some(r.call_id),
                _ => None,
            };
            let link = {
                let mut peers = self.peers.lock();
                let entry = match peers.get_mut(&to) {
                    Some(e) => e,
                    None if to == self.cfg.node => peers.entry(to).or_default(),
                    None => {
                        return Err(Failure::new(
                            Status::AddrError,
                            format!("node {to} is not a known member"),
                        ))
                    }
                };
                if let (Some((status, reason)), false) = (&entry.dead, probe) {
                    return Err(Failure::new(
                        *status,
                        format!("node {to} is dead: {reason}"),
                    ));
                }
                entry.links.retain(|l| !l.is_closed());
                match entry.links.first() {
                    Some(l) => Arc::clone(l),
                    None => {
                        if let Some(q) = entry.connecting.as_mut() {
                            if q.len() >= self.cfg.max_queued_frames {
                                return Err(Failure::new(
                                    Status::NoBuffer,
                                    format!("{} frames already wait for node {to}", q.len()),
                                ));
                            }
                            q.push_back(frame);
                            return Ok(());
                        }
                        if let Some((until, failure)) = &entry.backoff {
                            if Instant::now() < *until {
                                return Err(failure.clone());
                            }
                        }
                        if self.cfg.role == PeerRole::Client {
                            return Err(Failure::new(Status::ProcDead, "gateway link closed"));
                        }
                        entry.connecting = Some(VecDeque::from([frame]));
                        drop(peers);
                        let me = Arc::clone(self);
                        self.spawn(async move {
                            let result = me.connect_peer(to).await;
                            if let Err(f) = result {
                                me.connect_failed(to, f);
                            }
                        });
                        return Ok(());
                    }
                }
            };
            if let Some(id) = call_id {
                self.calls.set_link(id, link.id);
            }
            match link.send(frame) {
                Ok(()) => Ok(()),
                Err(IoError::Closed) => {
                    // Lost a race with a closing link: the frame is consumed,
                    // so a request fails and the caller may retry.
                    if let Some(id) = call_id {
                        let f = Failure::new(Status::ProcDead, format!("link to node {to} closed"));
                        self.calls.fail(id, f);
                    }
                    Ok(())
                }
                Err(IoError::Full) => Err(Failure::new(
                    Status::NoBuffer,
                    format!("link to {to} is full"),
                )),
                Err(IoError::Encode(e)) => Err(Failure::new(Status::BadRequest, e)),
                Err(IoError::TooLarge(e)) => Err(Failure::new(Status::TooLarge, e)),
            }
        }
    }

    /// Opens a link to `to` over the cheapest channel that reaches it.
    async fn connect_peer(self: &Arc<Self>, to: NodeId) -> Result<(), Failure> {
        if to == self.cfg.node {
            let link = inproc::connect(self, self, to);
            link.established(self.cfg.connect_timeout).await?;
            return Ok(());
        }
        let info = self.peers.lock().get(&to).and_then(|e| e.info.clone());
        let Some(info) = info else {
            return Err(Failure::new(
                Status::AddrError,
                format!("no route to node {to}"),
            ));
        };
        if self.cfg.channels.inproc {
            if let (Some(hub), Some(their_hub)) = (&self.hub, info.hub) {
                if hub.id() == their_hub {
                    return match hub.lookup(to) {
                        Lookup::Live(other) => {
                            let link = inproc::connect(self, &other, to);
                            link.established(self.cfg.connect_timeout).await.map(|_| ())
                        }
                        Lookup::Crashed => {
                            tokio::time::sleep(self.cfg.connect_timeout).await;
                            Err(Failure::new(
                                Status::HostDead,
                                format!("node {to} does not answer"),
                            ))
                        }
                        Lookup::Absent => Err(Failure::new(
                            Status::ProcDead,
                            format!("node {to} is no longer in this process"),
                        )),
                    };
                }
            }
        }
        // shm (issue 6): a same-host peer in another process.
        if let Some(result) = crate::shm::resolve(self, to, &info).await {
            return result;
        }
        if self.cfg.channels.tcp {
            if let Some(addr) = info
                .addr
                .as_deref()
                .and_then(|a| a.parse::<SocketAddr>().ok())
            {
                let link = tcp::connect(self, addr, Some(to)).await?;
                link.established(self.cfg.connect_timeout).await?;
                return Ok(());
            }
        }
        Err(Failure::new(
            Status::AddrError,
            format!("no enabled channel reaches node {to}"),
        ))
    }

    fn connect_failed(self: &Arc<Self>, to: NodeId, failure: Failure) {
        tracing::debug!(node = %self.cfg.node, peer = %to, %failure, "connect failed");
        let queued = {
            let mut peers = self.peers.lock();
            let Some(entry) = peers.get_mut(&to) else {
                return;
            };
            if !entry.links.iter().any(|l| !l.is_closed()) {
                let step = entry.next_backoff.max(self.cfg.reconnect_backoff.0);
                entry.next_backoff = (step * 2).min(self.cfg.reconnect_backoff.1);
                entry.backoff = Some((Instant::now() + step, failure.clone()));
            }
            entry.connecting.take().unwrap_or_default()
        };
        self.fail_queued(queued, &failure);
        if failure.status == Status::ProcDead && to != self.cfg.node {
            self.declare_dead(to, Status::ProcDead, failure.detail.clone());
        }
    }

    fn fail_queued(&self, queued: VecDeque<Frame>, failure: &Failure) {
        for frame in queued {
            if let Frame::Request(r) = frame {
                self.calls.fail(r.call_id, failure.clone());
            }
        }
    }

    // ----- link events -----------------------------------------------------

    /// Whether an authenticated peer's identity claim is admitted (see
    /// [`handshake::admit`]): checked before its link is trusted.
    pub(crate) fn admit(
        &self,
        claim: &Hello,
        channel: ChannelKind,
    ) -> Result<(), (Status, String)> {
        let live = if claim.role == PeerRole::Node {
            let peers = self.peers.lock();
            peers
                .get(&claim.node)
                .filter(|e| e.dead.is_none())
                .and_then(|e| e.incarnation)
        } else {
            None
        };
        crate::handshake::admit(claim, (self.cfg.node, self.cfg.incarnation), channel, live)
    }

    /// Fails the links whose fragmented messages are past their deadline.
    fn check_reassembly(&self, now: Instant) {
        let links: Vec<Arc<Link>> = self.links.lock().values().cloned().collect();
        for link in links {
            link.check_reassembly(now);
        }
    }

    pub(crate) fn link_up(self: &Arc<Self>, link: &Arc<Link>, peer: PeerRef) {
        tracing::debug!(node = %self.cfg.node, peer = %peer.node, link = link.id,
            channel = %link.kind(), "link up");
        if peer.role == PeerRole::Client {
            return;
        }
        crate::metrics::link_up(link.kind());
        if link.kind() == ChannelKind::Shm {
            // Said once per link: shared memory ignores the network between
            // the two, so no network partition cuts this link.
            tracing::info!(node = %self.cfg.node, peer = %peer.node,
                "linked over shared memory (same host and network namespace; \
                 channels.shm = false, or WEFT_SHM=off for the weft binary, to use TCP)");
        }
        let mut restarted = None;
        let mut revived = false;
        let (queued, stale, after_a_gap) = {
            let mut peers = self.peers.lock();
            let entry = peers.entry(peer.node).or_default();
            let after_a_gap =
                entry.incarnation.is_some() && !entry.links.iter().any(|l| !l.is_closed());
            let mut stale = Vec::new();
            match entry.incarnation {
                Some(old) if old != peer.incarnation => {
                    restarted = Some(old);
                    stale = std::mem::take(&mut entry.links);
                }
                _ => {}
            }
            entry.incarnation = Some(peer.incarnation);
            if restarted.is_some() {
                entry.dead = None;
            } else if entry.dead.is_some() && link.side == Side::Initiator {
                // We reached it again ourselves: it is alive.
                entry.dead = None;
                revived = true;
            }
            entry.backoff = None;
            entry.next_backoff = Duration::ZERO;
            // Cheapest channel first, and of one channel the newest: sends
            // use the first live link, and an older link of the same kind
            // may be a dead socket the peer already replaced.
            let at = entry.links.partition_point(|l| l.kind() < link.kind());
            entry.links.insert(at, Arc::clone(link));
            let queued = if link.side == Side::Initiator || entry.links.len() == 1 {
                entry.connecting.take().unwrap_or_default()
            } else {
                VecDeque::new()
            };
            (queued, stale, after_a_gap && restarted.is_none())
        };
        if after_a_gap {
            self.resync_after_gap(link, peer.node);
        }
        for old in stale {
            old.close(Status::ProcDead, "peer restarted");
        }
        if let Some(old) = restarted {
            let f = Failure::new(Status::ProcDead, format!("node {} restarted", peer.node));
            self.calls.fail_node(peer.node, &f);
            self.emit(MembershipEvent::Left {
                node: peer.node,
                incarnation: Some(old),
                cause: Status::ProcDead,
                reason: "restarted with a new incarnation".into(),
            });
            if self.naming.lock().directory == Some(peer.node) {
                // A restarted directory forgot us: join it again.
                self.schedule_rejoin(Duration::ZERO);
            }
        }
        if revived {
            self.emit(MembershipEvent::Revived(peer.node));
            self.on_revived(peer.node);
        }
        for frame in queued {
            let call_id = match &frame {
                Frame::Request(r) => Some(r.call_id),
                _ => None,
            };
            if let Some(id) = call_id {
                self.calls.set_link(id, link.id);
            }
            if link.send(frame).is_err() {
                if let Some(id) = call_id {
                    self.calls
                        .fail(id, Failure::new(Status::ProcDead, "link closed"));
                }
            }
        }
    }

    /// Keeps one line for [`Endpoint::refusals`] (the oldest goes when
    /// full).
    pub(crate) fn note_refusal(&self, line: String) {
        let mut log = self.refusals.lock();
        if log.len() == MAX_REFUSALS {
            log.pop_front();
        }
        log.push_back(line);
    }

    pub(crate) fn link_down(
        self: &Arc<Self>,
        link: &Arc<Link>,
        peer: Option<PeerRef>,
        cause: Status,
        reason: &str,
    ) {
        self.links.lock().remove(&link.id);
        if peer.is_some_and(|p| p.role == PeerRole::Node) {
            crate::metrics::link_down(link.kind(), cause);
        }
        if matches!(
            cause,
            Status::WrongSecret
                | Status::ProtocolError
                | Status::Mismatch
                | Status::Refused
                | Status::TooLarge
        ) || (cause == Status::TimedOut && peer.is_none())
        {
            self.note_refusal(format!("{cause} on {}: {reason}", link.describe()));
        }
        let status = match cause {
            Status::ShuttingDown | Status::Ok => Status::ProcDead,
            s => s,
        };
        let f = Failure::new(status, format!("link closed: {reason}"));
        self.calls.fail_link(link.id, &f);
        let Some(peer) = peer else { return };
        if peer.role == PeerRole::Client {
            return;
        }
        tracing::debug!(node = %self.cfg.node, peer = %peer.node, link = link.id, %cause,
            "link down: {reason}");
        let reconnect = {
            let mut peers = self.peers.lock();
            match peers.get_mut(&peer.node) {
                Some(entry) => {
                    entry.links.retain(|l| l.id != link.id && !l.is_closed());
                    entry.links.is_empty()
                        && entry.dead.is_none()
                        && matches!(link.kind(), ChannelKind::Tcp | ChannelKind::Shm)
                        && !self.is_closing()
                        // A client has no route to reconnect by: its calls
                        // end with ProcDead (gateway link closed).
                        && self.cfg.role == PeerRole::Node
                }
                None => false,
            }
        };
        if reconnect && cause != Status::ShuttingDown {
            // The connection dropped without a goodbye: find out at once
            // whether the process is still there (a refusal declares it dead).
            let me = Arc::clone(self);
            let node = peer.node;
            self.spawn(async move {
                if let Err(f) = me.connect_peer(node).await {
                    me.connect_failed(node, f);
                }
            });
        }
    }

    /// Feeds the failure detector with the links that received frames since
    /// the last tick, and those not read now (a frame still being handed
    /// up: a handler polled in the reader's context may run long).
    fn collect_heard(self: &Arc<Self>, now: Instant) {
        let mut heard = Vec::new();
        let mut unread = Vec::new();
        for l in self.links.lock().values() {
            let (got, busy) = (l.take_heard(), l.is_delivering());
            if !got && !busy {
                continue;
            }
            let Some(p) = l.peer_ref() else { continue };
            if p.role != PeerRole::Node || p.node == self.cfg.node {
                continue;
            }
            if got {
                heard.push(p.node);
            }
            if busy {
                unread.push(p.node);
            }
        }
        {
            let mut detector = self.detector.lock();
            for node in unread {
                detector.unread(node, now);
            }
        }
        for node in heard {
            let verdict = self.detector.lock().heard(node, now);
            if let Some(Verdict::Revived(node)) = verdict {
                let was_dead = {
                    let mut peers = self.peers.lock();
                    peers
                        .get_mut(&node)
                        .map(|e| e.dead.take().is_some())
                        .unwrap_or(false)
                };
                if was_dead {
                    self.emit(MembershipEvent::Revived(node));
                    self.on_revived(node);
                }
            }
        }
    }

    pub(crate) fn on_request(self: &Arc<Self>, link: &Arc<Link>, peer: PeerRef, req: Request) {
        // A peer may not pile up requests without bound: each holds a
        // handler's work and a Responder until answered.
        if !link.take_request_slot(self.cfg.max_requests_per_link) {
            let _ = link.send(Frame::Response(Response::failure(
                req.call_id,
                Failure::new(
                    Status::NoBuffer,
                    format!(
                        "{} requests of this link are already being served",
                        self.cfg.max_requests_per_link
                    ),
                ),
            )));
            return;
        }
        let responder = Responder {
            link: Arc::clone(link),
            call_id: req.call_id,
            done: false,
        };
        if peer.role == PeerRole::Node && req.node != self.cfg.node {
            responder.fail(Failure::new(
                Status::AddrError,
                format!("this is node {}, not node {}", self.cfg.node, req.node),
            ));
            return;
        }
        let handler = self.handlers.read().request.clone();
        match handler {
            Some(h) => h.handle(peer, req, responder),
            None => responder.fail(Failure::new(
                Status::NoSuchService,
                format!("node {} serves no requests", self.cfg.node),
            )),
        }
    }

    pub(crate) fn on_response(&self, _link: &Arc<Link>, peer: PeerRef, resp: Response) {
        let id = resp.call_id;
        if !self.calls.complete(id, peer.node, resp) {
            tracing::trace!(node = %self.cfg.node, call = id, "late or unknown response dropped");
        }
    }

    pub(crate) fn on_message(&self, link: &Arc<Link>, peer: PeerRef, msg: Message) {
        if msg.port != Port::NAMING {
            let handler = self.handlers.read().ports.get(&msg.port).cloned();
            if let Some(h) = handler.filter(|h| h.inline(peer.channel)) {
                if !self.is_crashed() {
                    h.on_message(peer, msg.payload);
                }
                return;
            }
        }
        let waiting = link.inbox_enter();
        self.inbox_high_water.fetch_max(waiting, Ordering::Relaxed);
        if let Err(mpsc::error::SendError((_, _, link))) =
            self.inbox.send((peer, msg, Arc::clone(link)))
        {
            link.inbox_leave(); // the inbox task is gone: the node is closing
        }
    }

    pub(crate) fn on_goodbye(self: &Arc<Self>, peer: PeerRef, reason: &str) {
        if peer.role != PeerRole::Node {
            return;
        }
        self.detector.lock().unwatch(peer.node);
        let newly = {
            let mut peers = self.peers.lock();
            match peers.get_mut(&peer.node) {
                Some(e) if e.dead.is_none() && e.incarnation == Some(peer.incarnation) => {
                    e.dead = Some((Status::ProcDead, format!("left the cluster ({reason})")));
                    true
                }
                _ => false,
            }
        };
        if newly {
            let f = Failure::new(
                Status::ProcDead,
                format!("node {} left the cluster", peer.node),
            );
            self.calls.fail_node(peer.node, &f);
            self.emit(MembershipEvent::Left {
                node: peer.node,
                incarnation: Some(peer.incarnation),
                cause: Status::Ok,
                reason: reason.to_string(),
            });
        }
    }

    /// Declares `node` dead on this node: fails its calls and queued frames,
    /// abandons its links (closed, sockets shut down: a link that went
    /// silent must not carry anything once the peer is back, which it does
    /// over a new link) and tells the listeners. The verdict stays here: it
    /// is about this node's links, and is never broadcast
    /// (docs/membership.md).
    fn declare_dead(self: &Arc<Self>, node: NodeId, status: Status, reason: String) {
        if node == self.cfg.node {
            return;
        }
        self.detector.lock().declare_dead(node);
        let (queued, incarnation, links) = {
            let mut peers = self.peers.lock();
            let entry = peers.entry(node).or_default();
            if entry.dead.is_some() {
                return;
            }
            entry.dead = Some((status, reason.clone()));
            (
                entry.connecting.take().unwrap_or_default(),
                entry.incarnation,
                std::mem::take(&mut entry.links),
            )
        };
        tracing::info!(node = %self.cfg.node, peer = %node, %status, "peer declared dead: {reason}");
        let f = Failure::new(status, format!("node {node} is dead: {reason}"));
        self.fail_queued(queued, &f);
        self.calls.fail_node(node, &f);
        for link in links {
            link.close(status, "peer declared dead: link abandoned");
        }
        self.emit(MembershipEvent::Left {
            node,
            incarnation,
            cause: status,
            reason,
        });
        if self.naming.lock().directory == Some(node) {
            self.schedule_rejoin(self.cfg.dead_after);
        }
    }

    // ----- tasks -----------------------------------------------------------

    async fn inbox_task(
        weak: std::sync::Weak<Inner>,
        mut rx: mpsc::UnboundedReceiver<(PeerRef, Message, Arc<Link>)>,
    ) {
        while let Some((peer, msg, link)) = rx.recv().await {
            // Whatever happens to the message, it no longer waits here.
            link.inbox_leave();
            drop(link);
            let Some(inner) = weak.upgrade() else { return };
            if inner.is_crashed() {
                return;
            }
            if msg.port == Port::NAMING {
                match msg.payload.decode::<NamingMsg>() {
                    Ok(m) => inner.on_naming(peer, m),
                    Err(e) => tracing::warn!(peer = %peer.node, "bad naming message: {e}"),
                }
                continue;
            }
            let handler = inner.handlers.read().ports.get(&msg.port).cloned();
            match handler {
                Some(h) => h.on_message(peer, msg.payload),
                None => tracing::debug!(port = msg.port.0, "message for a port with no handler"),
            }
        }
    }

    async fn detector_task(weak: std::sync::Weak<Inner>) {
        let period = {
            let Some(inner) = weak.upgrade() else { return };
            (inner.cfg.heartbeat_interval / 2).max(Duration::from_millis(1))
        };
        let mut ticker = tokio::time::interval(period);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            ticker.tick().await;
            let Some(inner) = weak.upgrade() else { return };
            if inner.is_crashed() || inner.is_closing() {
                return;
            }
            let now = Instant::now();
            inner.collect_heard(now);
            inner.check_reassembly(now);
            let verdicts = inner.detector.lock().tick(now);
            for v in verdicts {
                match v {
                    Verdict::Probe(node, seq) => {
                        let hb = Frame::Heartbeat(weft_wire::Heartbeat { seq, reply: false });
                        let _ = inner.send_frame(node, hb, true);
                    }
                    Verdict::Dead(node) => {
                        let reason = format!("no frame for {:?}", inner.cfg.dead_after);
                        inner.declare_dead(node, Status::HostDead, reason);
                    }
                    Verdict::Revived(_) => {}
                }
            }
            let rejoin = {
                let mut naming = inner.naming.lock();
                match (naming.rejoin_at, naming.seed.clone()) {
                    (Some(at), Some(seed)) if now >= at => {
                        naming.rejoin_at =
                            Some(now + inner.cfg.dead_after.max(Duration::from_millis(500)));
                        Some(seed)
                    }
                    _ => None,
                }
            };
            if let Some(seed) = rejoin {
                let me = Arc::clone(&inner);
                inner.spawn(async move {
                    match me.join_via(seed).await {
                        Ok(()) => tracing::info!(node = %me.cfg.node, "re-joined the cluster"),
                        Err(f) => tracing::debug!(node = %me.cfg.node, %f, "re-join failed"),
                    }
                });
            }
        }
    }

    // ----- naming ----------------------------------------------------------

    fn schedule_rejoin(&self, after: Duration) {
        let mut naming = self.naming.lock();
        if naming.seed.is_some() {
            naming.rejoin_at = Some(Instant::now() + after);
        }
    }

    async fn join_via(self: &Arc<Self>, seed: Seed) -> Result<(), Failure> {
        let mut seed = seed;
        for _hop in 0..4 {
            let link = match &seed {
                Seed::Tcp(addr) => {
                    let link = tcp::connect(self, *addr, None).await?;
                    link.established(self.cfg.connect_timeout).await?;
                    link
                }
                Seed::Inproc(node) => {
                    let hub = self.hub.clone().ok_or_else(|| {
                        Failure::new(Status::AddrError, "no in-process hub configured")
                    })?;
                    match hub.lookup(*node) {
                        Lookup::Live(other) => {
                            let link = inproc::connect(self, &other, *node);
                            link.established(self.cfg.connect_timeout).await?;
                            link
                        }
                        Lookup::Crashed => {
                            return Err(Failure::new(
                                Status::HostDead,
                                format!("seed node {node} does not answer"),
                            ))
                        }
                        Lookup::Absent => {
                            return Err(Failure::new(
                                Status::ProcDead,
                                format!("no node {node} in this process"),
                            ))
                        }
                    }
                }
            };
            let (tx, rx) = oneshot::channel();
            self.naming.lock().pending_join = Some(tx);
            let info = self.me.read().clone();
            // The Join goes over the link just opened, never over an older
            // link to the same node: that one may be a dead socket (after a
            // partition, TCP retransmits on it only as its backoff allows).
            if link
                .send(naming_frame(NamingMsg::Join { info: info.clone() }))
                .is_err()
            {
                return Err(Failure::new(
                    Status::ProcDead,
                    "the link to the seed closed before the join was sent",
                ));
            }
            let reply = tokio::time::timeout(self.cfg.connect_timeout * 2, rx).await;
            match reply {
                Ok(Ok(NamingMsg::Welcome { directory, .. })) => {
                    // The inbox task applied the Welcome before any later
                    // naming message from the directory (see `on_naming`).
                    let now = self.me.read().clone();
                    if now.services != info.services {
                        // Services changed while the Join was on its way.
                        self.announce_self(now);
                    }
                    tracing::info!(node = %self.cfg.node, %directory, "joined the cluster");
                    return Ok(());
                }
                Ok(Ok(NamingMsg::Redirect { directory })) => {
                    let id = directory.id;
                    seed = match directory.addr.as_deref().and_then(|a| a.parse().ok()) {
                        Some(addr)
                            if directory.hub != self.me.read().hub || !self.cfg.channels.inproc =>
                        {
                            Seed::Tcp(addr)
                        }
                        _ => Seed::Inproc(id),
                    };
                    self.upsert_member(directory);
                }
                Ok(Ok(NamingMsg::JoinRefused { status, reason })) => {
                    return Err(Failure::new(status, format!("join refused: {reason}")))
                }
                Ok(Ok(other)) => {
                    return Err(Failure::new(
                        Status::ProtocolError,
                        format!("unexpected answer to join: {other:?}"),
                    ))
                }
                Ok(Err(_)) => return Err(Failure::new(Status::Internal, "join abandoned")),
                Err(_) => {
                    return Err(Failure::new(
                        Status::TimedOut,
                        "the directory did not answer",
                    ))
                }
            }
        }
        Err(Failure::new(
            Status::AddrError,
            "too many redirects while joining",
        ))
    }

    /// Records what a member announced; detects restarts.
    fn upsert_member(self: &Arc<Self>, info: NodeInfo) {
        if info.id == self.cfg.node {
            return;
        }
        let id = info.id;
        let was_member = self.naming.lock().members.contains_key(&id);
        let (event_left, event_joined, stale) = {
            let mut peers = self.peers.lock();
            let entry = peers.entry(id).or_default();
            let mut left = None;
            let mut stale = Vec::new();
            let known = entry.info.as_ref().map(|i| i.incarnation);
            if let Some(old) = entry.incarnation.filter(|old| *old != info.incarnation) {
                if old < info.incarnation || entry.links.is_empty() {
                    left = Some(old);
                    stale = std::mem::take(&mut entry.links);
                }
            }
            // A new incarnation, or a node that had left, is a new member,
            // alive until this node's detector says otherwise. A member
            // announced again (a re-join, a changed service) is not revived
            // if this node declared it dead: only hearing from it does.
            let new_member = left.is_some() || entry.incarnation.is_none() || !was_member;
            if new_member {
                entry.dead = None;
                entry.backoff = None;
            }
            let joined = known != Some(info.incarnation) && entry.dead.is_none();
            entry.incarnation = Some(info.incarnation);
            entry.info = Some(info.clone());
            (left, joined, stale)
        };
        self.naming.lock().members.insert(id, info.clone());
        {
            let mut detector = self.detector.lock();
            if event_left.is_some() {
                detector.unwatch(id); // the old incarnation's verdict goes with it
            }
            detector.watch(id, Instant::now());
        }
        for l in stale {
            l.close(Status::ProcDead, "peer restarted");
        }
        if let Some(old) = event_left {
            let f = Failure::new(Status::ProcDead, format!("node {id} restarted"));
            self.calls.fail_node(id, &f);
            self.emit(MembershipEvent::Left {
                node: id,
                incarnation: Some(old),
                cause: Status::ProcDead,
                reason: "restarted with a new incarnation".into(),
            });
        }
        // shm (issue 6): a same-host member reached over TCP gets an shm link.
        let best = self.peers.lock().get(&id).and_then(|e| {
            e.links
                .iter()
                .filter(|l| !l.is_closed())
                .map(|l| l.kind())
                .min()
        });
        crate::shm::consider_upgrade(self, &info, best);
        if event_joined {
            self.emit(MembershipEvent::Joined(info));
        }
    }

    fn broadcast(self: &Arc<Self>, msg: NamingMsg, except: Option<NodeId>) {
        let targets: Vec<NodeId> = {
            let naming = self.naming.lock();
            naming
                .members
                .keys()
                .copied()
                .filter(|n| *n != self.cfg.node && Some(*n) != except)
                .collect()
        };
        for n in targets {
            let _ = self.send_frame(n, naming_frame(msg.clone()), false);
        }
    }

    fn announce_self(self: &Arc<Self>, info: NodeInfo) {
        let directory = self.naming.lock().directory;
        match directory {
            Some(d) if d == self.cfg.node => {
                self.naming.lock().members.insert(info.id, info.clone());
                self.broadcast(NamingMsg::Update { info }, None);
            }
            Some(d) => {
                let _ = self.send_frame(d, naming_frame(NamingMsg::Update { info }), false);
            }
            None => {}
        }
    }

    /// Answers a naming message on the link it came on: the sender may be
    /// believed dead here (a node re-joining after a partition), or its
    /// older links may be dead sockets.
    fn reply(self: &Arc<Self>, to: PeerRef, msg: NamingMsg) {
        let link = self.links.lock().get(&to.link).cloned();
        let sent = match link {
            Some(link) => link.send(naming_frame(msg)).map_err(|e| e.to_string()),
            None => Err("its link closed".to_string()),
        };
        if let Err(e) = sent {
            tracing::debug!(peer = %to.node, "naming reply not sent: {e}");
        }
    }

    /// Installs the directory's view of the cluster (a Welcome), then the
    /// naming messages that overtook it on another link.
    fn apply_welcome(self: &Arc<Self>, directory: NodeId, members: Vec<NodeInfo>) {
        let early = {
            let mut naming = self.naming.lock();
            naming.directory = Some(directory);
            naming.rejoin_at = None;
            std::mem::take(&mut naming.early)
        };
        self.me.write().directory = directory == self.cfg.node;
        for m in members {
            self.upsert_member(m);
        }
        let Early { overflowed, msgs } = early;
        for (peer, msg) in msgs {
            if peer.node == directory {
                self.on_naming(peer, msg);
            }
        }
        if overflowed {
            // Some were dropped: ask for the whole view again.
            self.schedule_rejoin(Duration::ZERO);
        }
    }

    /// Called when a member is linked to again after a time without any
    /// link: naming messages sent meanwhile may have been lost (dropped with
    /// a failed connection attempt, or with the link that broke). The
    /// directory sends the member its whole view, a member sends the
    /// directory its own information, on the new link.
    fn resync_after_gap(self: &Arc<Self>, link: &Arc<Link>, node: NodeId) {
        let msg = {
            let naming = self.naming.lock();
            if !naming.members.contains_key(&node) {
                return; // a joiner: its Join brings the Welcome
            }
            if naming.directory == Some(self.cfg.node) {
                NamingMsg::Welcome {
                    directory: self.cfg.node,
                    members: naming.members.values().cloned().collect(),
                }
            } else if naming.directory == Some(node) {
                NamingMsg::Update {
                    info: self.me.read().clone(),
                }
            } else {
                return;
            }
        };
        let _ = link.send(naming_frame(msg));
    }

    /// Called when `node` is heard from again after this node declared it
    /// dead (same incarnation). Naming messages sent meanwhile were lost: the
    /// directory sends the revived member its whole view; a member whose
    /// directory revived joins again to get it.
    fn on_revived(self: &Arc<Self>, node: NodeId) {
        let directory = self.naming.lock().directory;
        if directory == Some(self.cfg.node) {
            let members: Vec<NodeInfo> = self.naming.lock().members.values().cloned().collect();
            let msg = NamingMsg::Welcome {
                directory: self.cfg.node,
                members,
            };
            if let Err(f) = self.send_frame(node, naming_frame(msg), false) {
                tracing::debug!(peer = %node, %f, "view not sent to a revived member");
            }
        } else if directory == Some(node) && self.naming.lock().pending_join.is_none() {
            // (Revived by the link a join in progress opened: that join
            // brings the view.)
            self.schedule_rejoin(Duration::ZERO);
        }
    }

    fn on_naming(self: &Arc<Self>, peer: PeerRef, msg: NamingMsg) {
        let directory = self.naming.lock().directory;
        let am_directory = directory == Some(self.cfg.node);
        if directory.is_none() && matches!(msg, NamingMsg::Update { .. } | NamingMsg::Left { .. }) {
            let mut naming = self.naming.lock();
            if naming.early.msgs.len() < MAX_EARLY_NAMING {
                naming.early.msgs.push((peer, msg));
            } else {
                naming.early.overflowed = true;
            }
            return;
        }
        match msg {
            NamingMsg::Join { info } => {
                if !am_directory {
                    let dir_info =
                        directory.and_then(|d| self.naming.lock().members.get(&d).cloned());
                    match dir_info {
                        Some(d) => self.reply(peer, NamingMsg::Redirect { directory: d }),
                        None => self.reply(
                            peer,
                            NamingMsg::JoinRefused {
                                status: Status::Unavailable,
                                reason: "this node is not a member yet (joining)".into(),
                            },
                        ),
                    }
                    return;
                }
                if info.id != peer.node || info.incarnation != peer.incarnation {
                    self.reply(
                        peer,
                        NamingMsg::JoinRefused {
                            status: Status::Mismatch,
                            reason: format!(
                                "join for node {} arrived from node {}",
                                info.id, peer.node
                            ),
                        },
                    );
                    return;
                }
                let existing = {
                    let naming = self.naming.lock();
                    naming.members.get(&info.id).cloned()
                };
                let alive = self
                    .peers
                    .lock()
                    .get(&info.id)
                    .is_some_and(|e| e.dead.is_none());
                if let Err(reason) = admission(existing.as_ref().map(|i| (i, alive)), &info) {
                    tracing::warn!(node = %self.cfg.node, "refused join: {reason}");
                    self.reply(
                        peer,
                        NamingMsg::JoinRefused {
                            status: Status::Refused,
                            reason,
                        },
                    );
                    return;
                }
                self.upsert_member(info.clone());
                // The joiner's view: every member, and no death verdicts (a
                // verdict is about this node's links, not the joiner's).
                let members: Vec<NodeInfo> = self.naming.lock().members.values().cloned().collect();
                tracing::info!(node = %self.cfg.node, joiner = %info.id, "admitted a member");
                self.reply(
                    peer,
                    NamingMsg::Welcome {
                        directory: self.cfg.node,
                        members,
                    },
                );
                self.broadcast(NamingMsg::Update { info }, Some(peer.node));
            }
            NamingMsg::Welcome {
                directory: dir,
                members,
            } => {
                // Only the directory itself welcomes. Applied here, in the
                // inbox's order, so that naming messages the directory sends
                // after it are applied after it (applied by the joining
                // task, an Update could be handled first, while this node
                // still took itself for the directory, and be lost).
                let pending = {
                    let mut naming = self.naming.lock();
                    if dir != peer.node
                        || (naming.pending_join.is_none() && naming.directory != Some(dir))
                    {
                        return; // not from the directory it names, or unsolicited
                    }
                    naming.pending_join.take()
                };
                self.apply_welcome(dir, members);
                if let Some(tx) = pending {
                    let _ = tx.send(NamingMsg::Welcome {
                        directory: dir,
                        members: Vec::new(),
                    });
                }
            }
            NamingMsg::JoinRefused { .. } | NamingMsg::Redirect { .. } => {
                if let Some(tx) = self.naming.lock().pending_join.take() {
                    let _ = tx.send(msg);
                }
            }
            NamingMsg::Update { info } => {
                if am_directory {
                    if info.id != peer.node {
                        return; // only a member may update itself
                    }
                    let known = self.naming.lock().members.get(&info.id) == Some(&info);
                    self.upsert_member(info.clone());
                    if !known {
                        self.broadcast(NamingMsg::Update { info }, Some(peer.node));
                    }
                } else if Some(peer.node) == directory || info.id == peer.node {
                    self.upsert_member(info);
                }
            }
            NamingMsg::Left {
                node,
                incarnation,
                cause,
            } => {
                if node == self.cfg.node || cause != Status::Ok {
                    // Only orderly leaves travel: a death verdict is about
                    // the links of the node that reached it (docs/membership.md).
                    return;
                }
                if directory != Some(peer.node) && node != peer.node {
                    return; // only the directory, or the leaver, says who left
                }
                let current = self.peers.lock().get(&node).and_then(|e| e.incarnation);
                if current.is_some_and(|c| c != incarnation) {
                    return; // about an older incarnation
                }
                self.naming.lock().members.remove(&node);
                self.detector.lock().unwatch(node);
                let newly = {
                    let mut peers = self.peers.lock();
                    let e = peers.entry(node).or_default();
                    let newly = e.dead.is_none();
                    e.dead = Some((Status::ProcDead, "left the cluster".into()));
                    newly
                };
                if newly {
                    let f = Failure::new(Status::ProcDead, format!("node {node} left"));
                    self.calls.fail_node(node, &f);
                    self.emit(MembershipEvent::Left {
                        node,
                        incarnation: Some(incarnation),
                        cause: Status::Ok,
                        reason: "left the cluster".into(),
                    });
                }
            }
            NamingMsg::Leave { node, incarnation } => {
                if !am_directory || node != peer.node {
                    return;
                }
                self.naming.lock().members.remove(&node);
                self.detector.lock().unwatch(node);
                {
                    let mut peers = self.peers.lock();
                    let e = peers.entry(node).or_default();
                    e.dead = Some((Status::ProcDead, "left the cluster".into()));
                }
                self.emit(MembershipEvent::Left {
                    node,
                    incarnation: Some(incarnation),
                    cause: Status::Ok,
                    reason: "left the cluster".into(),
                });
                self.broadcast(
                    NamingMsg::Left {
                        node,
                        incarnation,
                        cause: Status::Ok,
                    },
                    Some(node),
                );
            }
        }
    }

    fn view(&self) -> ClusterView {
        let naming = self.naming.lock();
        let peers = self.peers.lock();
        let mut nodes = Vec::new();
        for info in naming.members.values() {
            let (alive, cause, channel, route) = if info.id == self.cfg.node {
                (true, None, None, None)
            } else {
                match peers.get(&info.id) {
                    Some(e) => {
                        let link = e.links.iter().find(|l| !l.is_closed());
                        (
                            e.dead.is_none(),
                            e.dead.as_ref().map(|(s, _)| *s),
                            link.map(|l| l.kind()),
                            link.map(|l| l.describe()),
                        )
                    }
                    None => (true, None, None, None),
                }
            };
            let info = if info.id == self.cfg.node {
                self.me.read().clone()
            } else {
                info.clone()
            };
            nodes.push(NodeStatus {
                info,
                alive,
                cause,
                channel,
                route,
            });
        }
        ClusterView {
            node: self.cfg.node,
            directory: naming.directory,
            nodes,
        }
    }
}
