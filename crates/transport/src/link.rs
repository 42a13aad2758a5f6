//! A link: one authenticated, bidirectional frame pipe between this node and
//! one peer, over any channel.
//!
//! Owns the per-link state (handshake, peer identity, fragment reassembly) and
//! the fault verdict applied to every frame it sends. Must never hold its own
//! lock while handing a frame to the channel or to the endpoint: a channel may
//! deliver synchronously into the peer, which may answer synchronously.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::time::Instant;

use parking_lot::Mutex;
use weft_wire::{
    DecodeError, Failure, Frame, Hello, Incarnation, NodeId, PeerRole, Reassembler, Response,
    Status,
};

use crate::channel::{ChannelKind, IoError, LinkIo};
use crate::endpoint::{Inner, Stats};
use crate::fault::FaultPlan;
use crate::handshake::{peer_text, Handshake, Side, Step};

/// Who is at the other end of an established link.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PeerRef {
    /// The peer's node id ([`NodeId::CLIENT`] for a client).
    pub node: NodeId,
    /// The peer's incarnation.
    pub incarnation: Incarnation,
    /// Member or client.
    pub role: PeerRole,
    /// The link's id on this node.
    pub link: u64,
    /// The medium.
    pub channel: ChannelKind,
}

enum State {
    Handshaking(Box<Handshake>),
    Up(PeerRef),
    Closed,
}

/// Where a link is in its life, as watched by whoever waits for it.
#[derive(Clone, Debug)]
pub(crate) enum Phase {
    Handshaking,
    Up(PeerRef),
    Closed(Status, String),
}

/// One end of a link.
pub(crate) struct Link {
    pub(crate) id: u64,
    pub(crate) side: Side,
    kind: ChannelKind,
    io: OnceLock<Arc<dyn LinkIo>>,
    ep: Weak<Inner>,
    /// The endpoint's crashed flag and counters: sending reads and counts
    /// without reaching the endpoint (an upgrade of `ep` is two atomic
    /// operations on a count every thread of the node touches).
    crashed: Arc<AtomicBool>,
    stats: Arc<Stats>,
    state: Mutex<State>,
    /// The peer once the handshake is done (never unset: a closed link is
    /// told by `closed`), so a received frame is dispatched without taking
    /// the state lock.
    up: OnceLock<PeerRef>,
    reassembler: Mutex<Reassembler>,
    /// The node this link is meant to reach (initiator) or that it turned
    /// out to reach (after the peer's Hello); used for fault verdicts.
    peer_hint: Mutex<Option<NodeId>>,
    /// The fault plan, this node, and the plan's generation when the link
    /// opened (stranded links are told by it).
    fault: Option<(Arc<FaultPlan>, NodeId, u64)>,
    closed: AtomicBool,
    /// A frame arrived since the failure detector last looked (any frame is
    /// a sign of life; the detector collects these flags on each tick, so
    /// the hot path takes no lock and reads no clock).
    heard: AtomicBool,
    /// Frames of this link being handed to the endpoint right now. While
    /// one is (a handler run in the reader's context that takes long),
    /// nothing more is read from the link, so its silence says nothing
    /// about the peer ([`crate::detector::Detector::unread`]).
    delivering: AtomicUsize,
    /// Messages from this link waiting for the endpoint's inbox task, and
    /// the most that may (`max_inbox_per_link`); the channel stops reading
    /// the link while it is full ([`Link::inbox_room`]).
    inbox: AtomicUsize,
    max_inbox: usize,
    inbox_room: tokio::sync::Notify,
    /// Requests received on this link and not yet answered (their
    /// Responders live), bounded by `max_requests_per_link`.
    requests: AtomicUsize,
    /// Set when this end decided to fail the link, so that a close triggered
    /// by the peer while we tell it why still reports our reason.
    failing: Mutex<Option<(Status, String)>>,
    phase: tokio::sync::watch::Sender<Phase>,
}

impl Link {
    /// A link end in the handshaking state. The channel must call
    /// [`Link::attach`] before any frame flows.
    pub(crate) fn new(
        ep: &Arc<Inner>,
        side: Side,
        kind: ChannelKind,
        expected_peer: Option<NodeId>,
    ) -> Arc<Link> {
        let own = ep.own_hello();
        let hs = Handshake::new(
            side,
            own,
            ep.secret.clone(),
            expected_peer,
            ep.cfg.role == PeerRole::Node,
        );
        Arc::new(Link {
            id: ep.next_link_id(),
            side,
            kind,
            io: OnceLock::new(),
            ep: Arc::downgrade(ep),
            crashed: ep.crashed_flag(),
            stats: Arc::clone(&ep.stats),
            state: Mutex::new(State::Handshaking(Box::new(hs))),
            up: OnceLock::new(),
            reassembler: Mutex::new(Reassembler::with_budget(
                ep.cfg.limits,
                ep.reassembly.clone(),
            )),
            peer_hint: Mutex::new(expected_peer),
            fault: ep.cfg.fault.clone().map(|f| {
                let generation = f.generation();
                (f, ep.cfg.node, generation)
            }),
            closed: AtomicBool::new(false),
            heard: AtomicBool::new(false),
            delivering: AtomicUsize::new(0),
            requests: AtomicUsize::new(0),
            inbox: AtomicUsize::new(0),
            max_inbox: ep.cfg.max_inbox_per_link,
            inbox_room: tokio::sync::Notify::new(),
            failing: Mutex::new(None),
            phase: tokio::sync::watch::channel(Phase::Handshaking).0,
        })
    }

    /// Connects the link to its medium.
    pub(crate) fn attach(&self, io: Arc<dyn LinkIo>) {
        if self.io.set(io).is_err() {
            debug_assert!(false, "link {} attached twice", self.id);
        }
    }

    /// Starts the handshake (sends the initiator's Hello).
    pub(crate) fn start(self: &Arc<Self>) {
        let steps = match &*self.state.lock() {
            State::Handshaking(hs) => hs.start(),
            _ => Vec::new(),
        };
        self.run_steps(steps);
    }

    /// Waits until the handshake completes or fails, up to `timeout`.
    ///
    /// Fails with the handshake's status (WrongSecret, Mismatch,
    /// ProtocolError...), ProcDead when the medium closed, or HostDead when the
    /// peer did not answer in time (the link is then closed).
    pub(crate) async fn established(
        self: &Arc<Self>,
        timeout: std::time::Duration,
    ) -> Result<PeerRef, weft_wire::Failure> {
        let mut rx = self.phase.subscribe();
        let waited =
            tokio::time::timeout(timeout, rx.wait_for(|p| !matches!(p, Phase::Handshaking))).await;
        match waited {
            Ok(Ok(phase)) => match &*phase {
                Phase::Up(p) => Ok(*p),
                Phase::Closed(status, reason) => {
                    Err(weft_wire::Failure::new(*status, reason.clone()))
                }
                Phase::Handshaking => unreachable!("waited for a later phase"),
            },
            Ok(Err(_)) => Err(weft_wire::Failure::new(Status::Internal, "link dropped")),
            Err(_) => {
                let reason = format!("no handshake answer within {timeout:?}");
                self.close(Status::HostDead, &reason);
                Err(weft_wire::Failure::new(Status::HostDead, reason))
            }
        }
    }

    /// Refuses the link (TimedOut, the peer is told) if its handshake has
    /// not completed within `timeout`: an accepted connection that never
    /// says Hello must not hold a socket and a task forever.
    pub(crate) async fn handshake_deadline(self: Arc<Self>, timeout: std::time::Duration) {
        let mut rx = self.phase.subscribe();
        let waited =
            tokio::time::timeout(timeout, rx.wait_for(|p| !matches!(p, Phase::Handshaking))).await;
        if waited.is_err() {
            self.refuse(
                Status::TimedOut,
                &format!("handshake not completed within {timeout:?}"),
            );
        }
    }

    /// The channel kind.
    pub(crate) fn kind(&self) -> ChannelKind {
        self.kind
    }

    /// The established peer, or `None` while handshaking or once closed.
    pub(crate) fn peer_ref(&self) -> Option<PeerRef> {
        match &*self.state.lock() {
            State::Up(p) => Some(*p),
            _ => None,
        }
    }

    /// True once the handshake completed (and stays true once closed).
    pub(crate) fn is_up(&self) -> bool {
        self.up.get().is_some()
    }

    /// True once the link is closed.
    pub(crate) fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    /// A description of the medium for status output.
    pub(crate) fn describe(&self) -> String {
        self.io
            .get()
            .map(|io| io.describe())
            .unwrap_or_else(|| self.kind.to_string())
    }

    /// Sends a frame to the peer, applying the fault plan.
    ///
    /// Fails with [`IoError::Closed`] when the link is closed.
    pub(crate) fn send(self: &Arc<Self>, frame: Frame) -> Result<(), IoError> {
        if self.is_closed() {
            return Err(IoError::Closed);
        }
        let Some(io) = self.io.get() else {
            return Err(IoError::Closed);
        };
        if self.crashed.load(Ordering::Acquire) {
            return Ok(()); // a crashed node sends nothing, silently
        }
        self.stats.count_sent(frame.kind());
        crate::metrics::frame_sent(self.kind);
        let Some((plan, me, generation)) = &self.fault else {
            return io.send(frame);
        };
        let Some(peer) = *self.peer_hint.lock() else {
            return io.send(frame);
        };
        let verdict = plan.decide_on(*me, peer, *generation, frame.kind());
        let n = verdict.deliveries.len();
        if n == 0 {
            return Ok(()); // dropped: the sender cannot tell, as on a real network
        }
        let mut frame = Some(frame);
        for (i, delay) in verdict.deliveries.into_iter().enumerate() {
            let copy = if i + 1 == n {
                frame.take().expect("one frame per delivery")
            } else {
                match frame.as_ref().expect("frame kept for copies").try_clone() {
                    Ok(f) => f,
                    Err(e) => return Err(IoError::Encode(e.to_string())),
                }
            };
            if delay.is_zero() {
                io.send(copy)?;
            } else {
                let link = Arc::clone(self);
                tokio::spawn(async move {
                    tokio::time::sleep(delay).await;
                    if let Some(io) = link.io.get() {
                        let _ = io.send(copy);
                    }
                });
            }
        }
        Ok(())
    }

    /// Closes the link: tells the medium and the endpoint. Idempotent.
    pub(crate) fn close(self: &Arc<Self>, cause: Status, reason: &str) {
        if self.closed.swap(true, Ordering::AcqRel) {
            return;
        }
        let failing = self.failing.lock().take();
        let (cause, reason) = match &failing {
            Some((s, r)) => (*s, r.as_str()),
            None => (cause, reason),
        };
        let peer = match std::mem::replace(&mut *self.state.lock(), State::Closed) {
            State::Up(p) => Some(p),
            _ => None,
        };
        self.phase
            .send_replace(Phase::Closed(cause, reason.to_string()));
        // Messages half reassembled will never complete: give their memory
        // back to the node now, not when the last holder of the link drops it.
        self.reassembler.lock().clear();
        if let Some(io) = self.io.get() {
            io.close();
        }
        if let Some(ep) = self.ep.upgrade() {
            ep.link_down(self, peer, cause, reason);
        }
    }

    /// Called by the channel when the medium closed under the link (EOF,
    /// reset, peer gone).
    pub(crate) fn on_closed(self: &Arc<Self>, reason: &str) {
        self.close(Status::ProcDead, reason);
    }

    /// Called by the channel for every frame received.
    pub(crate) fn on_frame(self: &Arc<Self>, frame: Frame) {
        let Some(ep) = self.ep.upgrade() else { return };
        if ep.is_crashed() || self.is_closed() {
            return;
        }
        crate::metrics::frame_received(self.kind);
        if let Some(peer) = self.up.get() {
            let _delivering = Delivering::enter(self);
            self.dispatch(&ep, *peer, frame);
            return;
        }
        let mut state = self.state.lock();
        match &mut *state {
            State::Closed => {}
            State::Handshaking(hs) => {
                if let Frame::Hello(h) = &frame {
                    if h.role == PeerRole::Node {
                        *self.peer_hint.lock() = Some(h.node);
                    }
                }
                let steps = hs.on_frame(frame);
                drop(state);
                self.run_steps(steps);
            }
            State::Up(peer) => {
                let peer = *peer;
                drop(state);
                let _delivering = Delivering::enter(self);
                self.dispatch(&ep, peer, frame);
            }
        }
    }

    /// Fails the link with TimedOut when a fragmented message has been in
    /// reassembly longer than the limit (called on every detector tick, so a
    /// peer that stops sending pieces does not hold memory forever).
    pub(crate) fn check_reassembly(self: &Arc<Self>, now: Instant) {
        let late = self.reassembler.lock().check_deadline(now);
        if let Err(e) = late {
            self.refuse(e.status(), &format!("incomplete message: {e}"));
        }
    }

    /// One more message of this link waits for the inbox task; returns
    /// how many now do.
    pub(crate) fn inbox_enter(&self) -> usize {
        self.inbox.fetch_add(1, Ordering::AcqRel) + 1
    }

    /// A message of this link left the inbox; wakes a reader waiting for
    /// room once half of it is free.
    pub(crate) fn inbox_leave(&self) {
        let before = self.inbox.fetch_sub(1, Ordering::AcqRel);
        debug_assert!(before > 0, "link {}: inbox count below zero", self.id);
        if before == self.max_inbox / 2 + 1 || before == 1 {
            self.inbox_room.notify_waiters();
        }
    }

    /// True while as many messages of this link wait for the inbox task as
    /// may: the channel should stop reading the link (the peer's sends then
    /// back up to it) until [`Link::inbox_room`].
    pub(crate) fn inbox_full(&self) -> bool {
        self.inbox.load(Ordering::Acquire) >= self.max_inbox
    }

    /// Waits until the link's messages in the inbox are at most half the
    /// bound, or the link closed.
    pub(crate) async fn inbox_room(&self) {
        loop {
            let room = self.inbox_room.notified();
            tokio::pin!(room);
            room.as_mut().enable();
            if self.inbox.load(Ordering::Acquire) <= self.max_inbox / 2 || self.is_closed() {
                return;
            }
            room.await;
        }
    }

    /// Counts one more request being served on this link; false (and
    /// nothing counted) when `max` are already being served.
    pub(crate) fn take_request_slot(&self, max: usize) -> bool {
        self.requests
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < max).then_some(n + 1)
            })
            .is_ok()
    }

    /// A request of this link was answered (or dropped).
    pub(crate) fn release_request_slot(&self) {
        let before = self.requests.fetch_sub(1, Ordering::AcqRel);
        debug_assert!(
            before > 0,
            "link {}: more requests answered than taken",
            self.id
        );
    }

    /// Returns and clears the "a frame arrived" flag.
    pub(crate) fn take_heard(&self) -> bool {
        self.heard.swap(false, Ordering::Relaxed)
    }

    /// True while a frame of this link is being delivered: the link is not
    /// read meanwhile, so the peer cannot be heard however much it sends.
    pub(crate) fn is_delivering(&self) -> bool {
        self.delivering.load(Ordering::Relaxed) > 0
    }

    fn dispatch(self: &Arc<Self>, ep: &Arc<Inner>, peer: PeerRef, frame: Frame) {
        if !self.heard.load(Ordering::Relaxed) {
            self.heard.store(true, Ordering::Relaxed);
        }
        match frame {
            Frame::Fragment(piece) => {
                let result = self.reassembler.lock().accept(piece, Instant::now());
                match result {
                    Ok(Some(whole)) => self.dispatch(ep, peer, whole),
                    Ok(None) => {}
                    Err(e) => {
                        self.on_malformed(&e, "malformed message");
                    }
                }
            }
            Frame::Request(req) => ep.on_request(self, peer, req),
            Frame::Response(resp) => ep.on_response(self, peer, resp),
            // Protocol messages (naming, transactions, groups) are the
            // members' business: a client that sends one is refused, never
            // obeyed (docs/wire.md, "Client links").
            Frame::Message(msg) if peer.role == PeerRole::Client => self.refuse(
                Status::ProtocolError,
                &format!(
                    "a client sent a protocol message (port {}): only member links carry them",
                    msg.port.0
                ),
            ),
            Frame::Message(msg) => ep.on_message(self, peer, msg),
            Frame::Heartbeat(hb) => {
                if !hb.reply {
                    let _ = self.send(Frame::Heartbeat(weft_wire::Heartbeat {
                        seq: hb.seq,
                        reply: true,
                    }));
                }
            }
            Frame::Goodbye(g) => {
                let reason = peer_text(&g.reason);
                ep.on_goodbye(peer, &reason);
                self.close(Status::ShuttingDown, &format!("peer left: {reason}"));
            }
            Frame::Refused(r) => {
                let reason = format!("closed by peer: {}", peer_text(&r.reason));
                tracing::warn!(link = self.id, peer = %peer.node, status = %r.status, "{reason}");
                self.close(r.status, &reason);
            }
            Frame::Hello(_) | Frame::Auth(_) => self.refuse(
                Status::ProtocolError,
                "handshake frame on an established link",
            ),
        }
    }

    /// Called by the channel (or the reassembler) for bytes that did not
    /// decode. Before the handshake completes anything malformed is a
    /// ProtocolError and closes the link. After it, a request whose head is
    /// invalid (an invalid service name, say) was consumed whole and names
    /// its call: it is answered BadRequest and the link goes on (returns
    /// true). Anything else means the stream cannot be trusted: the peer is
    /// told why and the link closes (returns false).
    pub(crate) fn on_malformed(self: &Arc<Self>, e: &DecodeError, what: &str) -> bool {
        if !self.is_up() {
            // The phase is judged before the bytes: before the handshake
            // completes only Hello, Auth and Refused may arrive, so no
            // request is answered BadRequest (a frame too large is still
            // TooLarge).
            let status = match e.status() {
                Status::BadRequest => Status::ProtocolError,
                s => s,
            };
            self.refuse(
                status,
                &format!("{what} before the handshake completed: {e}"),
            );
            return false;
        }
        if let DecodeError::BadRequest { call_id, reason } = e {
            tracing::warn!(link = self.id, call_id, "bad request: {reason}");
            let _ = self.send(Frame::Response(Response::failure(
                *call_id,
                Failure::new(Status::BadRequest, format!("malformed request: {reason}")),
            )));
            return true;
        }
        self.refuse(e.status(), &format!("{what}: {e}"));
        false
    }

    /// Tells the peer why the link is being closed, then closes it.
    pub(crate) fn refuse(self: &Arc<Self>, status: Status, reason: &str) {
        tracing::warn!(link = self.id, %status, "closing link: {reason}");
        *self.failing.lock() = Some((status, reason.to_string()));
        if let Some(io) = self.io.get() {
            let _ = io.send(Frame::Refused(weft_wire::Refused {
                status,
                reason: reason.to_string(),
            }));
        }
        self.close(status, reason);
    }

    fn run_steps(self: &Arc<Self>, steps: Vec<Step>) {
        // Become Up before sending the last handshake frame: over an
        // in-process link the peer handles that frame synchronously and may
        // answer with data at once, which must find this end established.
        let established = steps.iter().find_map(|s| match s {
            Step::Established(h) => Some(h.clone()),
            _ => None,
        });
        // An authenticated peer's identity claim is checked against what
        // this node knows before the link is trusted with anything.
        if let Some(hello) = &established {
            let admitted = match self.ep.upgrade() {
                Some(ep) => ep.admit(hello, self.kind),
                None => Err((Status::ShuttingDown, "node is gone".to_string())),
            };
            if let Err((status, reason)) = admitted {
                tracing::warn!(link = self.id, %status, "identity claim refused: {reason}");
                self.refuse(status, &reason);
                return;
            }
        }
        let peer = established.and_then(|h| self.become_up(h));
        if let Some(Step::Fail(status, reason)) = steps.iter().find(|s| matches!(s, Step::Fail(..)))
        {
            *self.failing.lock() = Some((*status, reason.clone()));
        }
        for step in steps {
            match step {
                Step::Send(frame) => {
                    if self.send(frame).is_err() {
                        self.close(Status::ProcDead, "medium closed during handshake");
                        return;
                    }
                }
                Step::Established(_) => {}
                Step::Fail(status, reason) => {
                    match status {
                        Status::WrongSecret => {
                            tracing::error!(link = self.id, "link refused: {reason}")
                        }
                        _ => tracing::warn!(link = self.id, %status, "handshake failed: {reason}"),
                    }
                    self.close(status, &reason);
                    return;
                }
            }
        }
        if let Some(peer) = peer {
            if let Some(ep) = self.ep.upgrade() {
                ep.link_up(self, peer);
            }
            // Announced after the endpoint knows the link, so a waiter can use it.
            self.phase.send_replace(Phase::Up(peer));
        }
    }

    /// Switches to the established state; returns the peer, or `None` if the
    /// link was no longer handshaking.
    fn become_up(self: &Arc<Self>, hello: Hello) -> Option<PeerRef> {
        let peer = PeerRef {
            node: hello.node,
            incarnation: hello.incarnation,
            role: hello.role,
            link: self.id,
            channel: self.kind,
        };
        if let Some(io) = self.io.get() {
            io.set_peer_limits(
                hello.max_frame as usize,
                usize::try_from(hello.max_message).unwrap_or(usize::MAX),
            );
        }
        let mut st = self.state.lock();
        if !matches!(&*st, State::Handshaking(_)) {
            return None;
        }
        *st = State::Up(peer);
        let _ = self.up.set(peer);
        Some(peer)
    }
}

/// Counts one frame of a link being delivered, for as long as it lives
/// (also when the handler panics).
struct Delivering<'a>(&'a Link);

impl<'a> Delivering<'a> {
    fn enter(link: &'a Link) -> Self {
        link.delivering.fetch_add(1, Ordering::Relaxed);
        Delivering(link)
    }
}

impl Drop for Delivering<'_> {
    fn drop(&mut self) {
        self.0.delivering.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Drop for Link {
    fn drop(&mut self) {
        if !self.closed.load(Ordering::Acquire) {
            if let Some(io) = self.io.get() {
                io.close();
            }
        }
    }
}
