//! One TCP connection as the transport-level logger sees it: TCP segments in,
//! TCP segments out, no I/O and no clock (time comes with each event).
//!
//! Owns the connection's two sequence spaces and the maps between them
//! (seed 001 section 2.1.2): in the peer→server direction the server's
//! space has the replayed bytes inserted (`d1`, per replay, kept as a table
//! of chunks so that acknowledgements map back exactly); in the server→peer
//! direction the peer's space lacks the bytes of aborted transactions (`d2`,
//! the difference between the logger core's received server bytes and the
//! bytes it released). Wraps a [`LoggerCore`], which decides what is held,
//! released, dropped and replayed.
//!
//! The logger acknowledges server bytes itself as it logs them (the paper's
//! fake acks, given at once rather than only for dropped bytes): a
//! transaction's output is then not limited by the server's congestion
//! window, and all of it is at the logger, to be made durable, at prepare.
//! In exchange the logger sends released bytes to the peer itself, within the
//! peer's window, and retransmits them until the peer acknowledges them.
//! Peer bytes are acknowledged to the peer only when the server acknowledged
//! them (the peer retransmits otherwise); replayed bytes, which the peer
//! never resends, the logger retransmits itself.
//!
//! Must never: send the peer a byte of a transaction that did not commit;
//! acknowledge to the peer a byte the server has not acknowledged; grow a
//! buffer past the logger core's bounds; panic on any segment.
//! SYN options other than MSS and window scale (timestamps, SACK) are
//! removed from the handshake so that no option carries unmapped numbers.

use std::collections::VecDeque;
use std::net::SocketAddrV4;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use weft_wire::Tid;

use super::packet::{self, Segment, SynOptions, ACK, FIN, PSH, RST, SYN};
use crate::core::{Action, ConnState, ConnStats, CoreError, Event, LoggerConfig, LoggerCore};

/// Bounds and timers of TLA connections.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TlaConfig {
    /// The logger core's bounds.
    pub logger: LoggerConfig,
    /// Retransmission timeout of bytes the logger sends itself (released
    /// output to the peer, replayed input to the server).
    pub rto: Duration,
    /// Largest payload of a segment the logger builds (also bounded by the
    /// receiver's MSS).
    pub max_segment: usize,
    /// A connection with no segment for this long and no transaction is
    /// forgotten (its ends vanished without FIN or RST).
    pub idle_timeout: Duration,
}

impl Default for TlaConfig {
    fn default() -> Self {
        TlaConfig {
            logger: LoggerConfig::default(),
            rto: Duration::from_millis(200),
            max_segment: 1400,
            idle_timeout: Duration::from_secs(600),
        }
    }
}

/// Why a segment or a control event was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum TlaError {
    /// The logger core refused it.
    #[error(transparent)]
    Core(#[from] CoreError),
    /// The handshake is not complete yet.
    #[error("the connection is not established")]
    NotEstablished,
    /// The peer closed its sending side before a restart's replay could be
    /// inserted in front of its end.
    #[error("the peer closed its side; nothing can be replayed after its end")]
    PeerClosed,
}

/// Segments to send, by direction.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Out {
    /// To the peer.
    pub to_peer: Vec<Segment>,
    /// To the server.
    pub to_server: Vec<Segment>,
}

impl Out {
    fn append(&mut self, o: Out) {
        self.to_peer.extend(o.to_peer);
        self.to_server.extend(o.to_server);
    }
}

/// Server-space range of forwarded peer bytes: `len` bytes at server
/// position `s` carry peer positions from `p`.
#[derive(Clone, Copy, Debug)]
struct Chunk {
    s: u64,
    p: u64,
    len: u64,
}

/// One TLA connection (see the module comment).
#[derive(Debug)]
pub struct TlaConn {
    cfg: TlaConfig,
    core: LoggerCore,
    peer: SocketAddrV4,
    server: SocketAddrV4,
    peer_isn: u32,
    server_isn: Option<u32>,
    peer_opts: SynOptions,
    server_opts: SynOptions,
    /// The server was sent the handshake's last ACK.
    server_acked_syn: bool,
    // Peer→server.
    /// Next in-order peer byte (peer space).
    peer_next: u64,
    peer_fin: Option<u64>,
    /// Server-space position of the FIN forwarded to the server.
    fin_to_server: Option<u64>,
    /// Next server-space position to forward into.
    srv_next: u64,
    /// The server's cumulative acknowledgement (server space).
    srv_acked: u64,
    chunks: VecDeque<Chunk>,
    /// Forwarded and not acknowledged by the server (for retransmission).
    unacked: VecDeque<(u64, Bytes)>,
    in_progress_at: Instant,
    /// What the peer was told the server received (peer space).
    peer_acked: u64,
    peer_fin_acked: bool,
    server_wnd: u64,
    // Server→peer.
    srv_fin: Option<u64>,
    /// Released bytes from peer position `out_una` on.
    out_buf: VecDeque<Bytes>,
    out_una: u64,
    out_nxt: u64,
    /// Highest position sent (out_nxt goes back on a retransmission).
    out_hi: u64,
    out_end: u64,
    fin_to_peer: bool,
    peer_wnd: u64,
    out_progress_at: Instant,
    last_to_server: Option<(u64, u16)>,
    last_to_peer: Option<(u64, u16)>,
    closed: bool,
    last_seen: Instant,
}

/// Position of `seq` relative to `isn + 1`, unwrapped near `near`.
fn rel(seq: u32, isn: u32, near: u64) -> Option<u64> {
    let near_seq = isn.wrapping_add(1).wrapping_add(near as u32);
    let r = near as i64 + i64::from(seq.wrapping_sub(near_seq) as i32);
    u64::try_from(r).ok()
}

fn abs(pos: u64, isn: u32) -> u32 {
    isn.wrapping_add(1).wrapping_add(pos as u32)
}

impl TlaConn {
    /// A connection opened by the peer's `syn`; returns the SYN to forward
    /// (its options reduced to MSS and window scale).
    pub fn new(cfg: TlaConfig, now: Instant, syn: &Segment) -> (TlaConn, Segment) {
        let peer_opts = packet::syn_options(&syn.options);
        let c = TlaConn {
            cfg,
            core: LoggerCore::new(cfg.logger),
            peer: SocketAddrV4::new(syn.src, syn.sport),
            server: SocketAddrV4::new(syn.dst, syn.dport),
            peer_isn: syn.seq,
            server_isn: None,
            peer_opts,
            server_opts: SynOptions::default(),
            server_acked_syn: false,
            peer_next: 0,
            peer_fin: None,
            fin_to_server: None,
            srv_next: 0,
            srv_acked: 0,
            chunks: VecDeque::new(),
            unacked: VecDeque::new(),
            in_progress_at: now,
            peer_acked: 0,
            peer_fin_acked: false,
            server_wnd: 0,
            srv_fin: None,
            out_buf: VecDeque::new(),
            out_una: 0,
            out_nxt: 0,
            out_hi: 0,
            out_end: 0,
            fin_to_peer: false,
            peer_wnd: 0,
            out_progress_at: now,
            last_to_server: None,
            last_to_peer: None,
            closed: false,
            last_seen: now,
        };
        let mut fwd = syn.clone();
        fwd.options = packet::encode_syn_options(peer_opts);
        (c, fwd)
    }

    /// The peer's address.
    pub fn peer(&self) -> SocketAddrV4 {
        self.peer
    }

    /// The server's address.
    pub fn server(&self) -> SocketAddrV4 {
        self.server
    }

    /// The logger core deciding the connection's bytes.
    pub fn core(&self) -> &LoggerCore {
        &self.core
    }

    /// The logger core's state.
    pub fn state(&self) -> ConnState {
        self.core.state()
    }

    /// The running transaction.
    pub fn tx(&self) -> Option<Tid> {
        self.core.tx()
    }

    /// Counters and sizes.
    pub fn stats(&self) -> ConnStats {
        self.core.stats()
    }

    /// True when the running transaction's end is known and all its output
    /// arrived.
    pub fn is_complete(&self) -> bool {
        self.core.is_complete()
    }

    /// True when the running transaction lost output past its limit.
    pub fn is_doomed(&self) -> bool {
        self.core.is_doomed()
    }

    /// The held output of the running transaction.
    pub fn held(&self) -> impl Iterator<Item = &Bytes> {
        self.core.held()
    }

    /// The logger core's bounds.
    pub fn config(&self) -> &LoggerConfig {
        self.core.config()
    }

    /// True once a RST passed, or both sides' FINs were acknowledged: the
    /// connection can be forgotten.
    pub fn is_closed(&self) -> bool {
        self.closed
            || (self.peer_fin_acked
                && self.fin_to_peer
                && self.out_una > self.out_end
                && self.core.state() == ConnState::PreTrans)
    }

    /// True when no segment came for the idle timeout and no transaction
    /// runs or awaits its decision.
    pub fn is_idle(&self, now: Instant) -> bool {
        self.core.state() == ConnState::PreTrans
            && now.saturating_duration_since(self.last_seen) >= self.cfg.idle_timeout
    }

    /// True once the server's FIN or RST passed (nothing more comes from it).
    pub fn server_gone(&self) -> bool {
        self.srv_fin.is_some() || self.closed
    }

    fn shifts(&self) -> (u8, u8) {
        match (self.peer_opts.wscale, self.server_opts.wscale) {
            (Some(p), Some(s)) => (p, s),
            _ => (0, 0),
        }
    }

    fn mss_to_peer(&self) -> usize {
        usize::from(self.peer_opts.mss.unwrap_or(536)).min(self.cfg.max_segment)
    }

    fn mss_to_server(&self) -> usize {
        usize::from(self.server_opts.mss.unwrap_or(536)).min(self.cfg.max_segment)
    }

    fn seg_to_server(&self, seq_pos: u64, flags: u8, payload: Bytes) -> Segment {
        let isn = self.server_isn.unwrap_or(0);
        let mut ack = self.core.out_pos();
        if self.srv_fin.is_some() {
            ack += 1;
        }
        Segment {
            src: *self.peer.ip(),
            dst: *self.server.ip(),
            sport: self.peer.port(),
            dport: self.peer_port_of_server(),
            seq: abs(seq_pos, self.peer_isn),
            ack: abs(ack, isn),
            flags: flags | ACK,
            window: self.window_to_server(),
            options: Vec::new(),
            payload,
        }
    }

    fn peer_port_of_server(&self) -> u16 {
        self.server.port()
    }

    fn seg_to_peer(&self, seq_pos: u64, flags: u8, payload: Bytes) -> Segment {
        let isn = self.server_isn.unwrap_or(0);
        let ack = self.peer_acked + u64::from(self.peer_fin_acked);
        Segment {
            src: *self.server.ip(),
            dst: *self.peer.ip(),
            sport: self.server.port(),
            dport: self.peer.port(),
            seq: abs(seq_pos, isn),
            ack: abs(ack, self.peer_isn),
            flags: flags | ACK,
            window: self.window_to_peer(),
            options: Vec::new(),
            payload,
        }
    }

    /// Room the logger offers the server: what it may still buffer for the
    /// peer, in the peer's window scale (the server believes the peer
    /// advertised it).
    fn window_to_server(&self) -> u16 {
        let buffered = self.core.stats().held_bytes + self.out_end.saturating_sub(self.out_una);
        let room = (self.cfg.logger.max_hold as u64).saturating_sub(buffered);
        (room >> self.shifts().0).min(u64::from(u16::MAX)) as u16
    }

    /// The server's window, bounded by the logger core's receive room, in
    /// the server's window scale.
    fn window_to_peer(&self) -> u16 {
        let room = self.server_wnd.min(self.core.peer_room() as u64);
        (room >> self.shifts().1).min(u64::from(u16::MAX)) as u16
    }

    fn apply(&mut self, now: Instant, actions: Vec<Action>, out: &mut Out) {
        for a in actions {
            match a {
                Action::ToPeer(b) => {
                    self.out_end += b.len() as u64;
                    self.out_buf.push_back(b);
                }
                Action::ToServer { pos, data } => {
                    if self.unacked.is_empty() {
                        self.in_progress_at = now;
                    }
                    let mss = self.mss_to_server();
                    let mut at = 0usize;
                    while at < data.len() {
                        let n = (data.len() - at).min(mss);
                        let part = data.slice(at..at + n);
                        let s = self.srv_next;
                        self.chunks.push_back(Chunk {
                            s,
                            p: pos + at as u64,
                            len: n as u64,
                        });
                        out.to_server.push(self.seg_to_server(s, PSH, part.clone()));
                        self.unacked.push_back((s, part));
                        self.srv_next += n as u64;
                        at += n;
                    }
                }
            }
        }
    }

    /// Hands the server the peer bytes the core lets through, then the
    /// peer's FIN once all its bytes were handed over.
    fn pump(&mut self, now: Instant, out: &mut Out) {
        if let Ok(a) = self.core.step(now, Event::ServerRead { max: usize::MAX }) {
            self.apply(now, a, out);
        }
        if let Some(f) = self.peer_fin {
            if self.fin_to_server.is_none() && self.core.in_read_pos() == f {
                let s = self.srv_next;
                self.fin_to_server = Some(s);
                self.srv_next += 1;
                out.to_server.push(self.seg_to_server(s, FIN, Bytes::new()));
            }
        }
    }

    /// Sends the peer released bytes within its window, then the server's
    /// FIN once everything before it is resolved; `force` sends at least
    /// one segment (a probe or an acknowledgement).
    fn flush_peer(&mut self, now: Instant, force: bool, out: &mut Out) {
        self.maybe_fin_from_server(now, out);
        let mss = self.mss_to_peer();
        let mut sent = false;
        loop {
            let limit = (self.out_una + self.peer_wnd.max(1)).min(self.out_end);
            if self.out_nxt >= limit {
                break;
            }
            let n = ((limit - self.out_nxt) as usize).min(mss);
            let data = self.out_slice(self.out_nxt, n);
            out.to_peer.push(self.seg_to_peer(self.out_nxt, PSH, data));
            self.out_nxt += n as u64;
            sent = true;
        }
        if self.fin_to_peer && self.out_nxt == self.out_end {
            out.to_peer
                .push(self.seg_to_peer(self.out_end, FIN, Bytes::new()));
            self.out_nxt = self.out_end + 1;
            sent = true;
        }
        self.out_hi = self.out_hi.max(self.out_nxt);
        let now_ack = (
            self.peer_acked + u64::from(self.peer_fin_acked),
            self.window_to_peer(),
        );
        if !sent && (force || self.last_to_peer != Some(now_ack)) {
            let seq = self.out_nxt;
            out.to_peer.push(self.seg_to_peer(seq, 0, Bytes::new()));
        }
        self.last_to_peer = Some(now_ack);
    }

    fn out_slice(&self, from: u64, n: usize) -> Bytes {
        let mut off = (from - self.out_una) as usize;
        let mut b = BytesMut::with_capacity(n);
        for part in &self.out_buf {
            if off >= part.len() {
                off -= part.len();
                continue;
            }
            let take = (part.len() - off).min(n - b.len());
            b.extend_from_slice(&part[off..off + take]);
            off = 0;
            if b.len() == n {
                break;
            }
        }
        b.freeze()
    }

    /// Once the server's FIN arrived and nothing before it is undecided:
    /// its aborted tail is dropped, and the FIN goes to the peer after the
    /// released bytes.
    fn maybe_fin_from_server(&mut self, now: Instant, out: &mut Out) {
        let Some(f) = self.srv_fin else { return };
        if self.fin_to_peer || self.core.state() != ConnState::PreTrans {
            return;
        }
        if let Ok(a) = self.core.step(now, Event::Sync { out_from: f }) {
            self.apply(now, a, out);
        }
        self.fin_to_peer = true;
    }

    fn ack_server(&mut self, force: bool, out: &mut Out) {
        if self.server_isn.is_none() {
            return;
        }
        let key = (
            self.core.out_pos() + u64::from(self.srv_fin.is_some()),
            self.window_to_server(),
        );
        if force || self.last_to_server != Some(key) {
            self.last_to_server = Some(key);
            out.to_server
                .push(self.seg_to_server(self.srv_next, 0, Bytes::new()));
        }
    }

    /// A segment from the peer.
    ///
    /// Fails with NotEstablished for a segment other than a SYN before the
    /// server answered the handshake.
    pub fn on_peer(&mut self, now: Instant, seg: &Segment) -> Result<Out, TlaError> {
        let mut out = Out::default();
        self.last_seen = now;
        if seg.has(RST) {
            self.closed = true;
            // At the server's next expected byte: a reset elsewhere in its
            // window only draws a challenge ACK (RFC 5961).
            let s = self.srv_acked;
            let mut r = self.seg_to_server(s, RST, Bytes::new());
            r.flags = RST;
            out.to_server.push(r);
            return Ok(out);
        }
        if seg.has(SYN) {
            // A retransmitted SYN: forward it again.
            let mut fwd = seg.clone();
            fwd.options = packet::encode_syn_options(self.peer_opts);
            out.to_server.push(fwd);
            return Ok(out);
        }
        let Some(isn) = self.server_isn else {
            return Err(TlaError::NotEstablished);
        };
        let (peer_shift, _) = self.shifts();
        if seg.has(ACK) {
            self.peer_wnd = u64::from(seg.window) << peer_shift;
            if let Some(q) = rel(seg.ack, isn, self.out_una) {
                let top = self.out_hi.max(self.out_nxt);
                if q > self.out_una && q <= top {
                    self.trim_out(q.min(self.out_end));
                    self.out_una = q;
                    // An acknowledgement of bytes sent before a go-back.
                    self.out_nxt = self.out_nxt.max(q);
                    self.out_progress_at = now;
                }
            }
        }
        let mut dup = false;
        if let Some(p) = rel(seg.seq, self.peer_isn, self.peer_next) {
            let len = seg.payload.len() as u64;
            if len > 0 {
                if p <= self.peer_next && self.peer_next < p + len {
                    let from = (self.peer_next - p) as usize;
                    let room = self.core.peer_room();
                    let take = (seg.payload.len() - from).min(room);
                    if take > 0 {
                        let data = seg.payload.slice(from..from + take);
                        self.core.step(now, Event::PeerData(data))?;
                        self.peer_next += take as u64;
                    }
                } else if p + len <= self.peer_next {
                    dup = true;
                }
            }
            if seg.has(FIN) && p + len == self.peer_next && self.peer_fin.is_none() {
                self.peer_fin = Some(self.peer_next);
            } else if seg.has(FIN) && p + len < self.peer_next {
                dup = true;
            }
        }
        self.pump(now, &mut out);
        if dup {
            // The peer retransmits: resend what the server has not
            // acknowledged, and tell the peer again where it stands.
            self.resend_to_server(&mut out);
        }
        let handshake = !self.server_acked_syn;
        self.server_acked_syn = true;
        self.ack_server(handshake, &mut out);
        self.flush_peer(now, dup, &mut out);
        Ok(out)
    }

    fn trim_out(&mut self, to: u64) {
        let mut n = (to - self.out_una) as usize;
        while n > 0 {
            let Some(front) = self.out_buf.front_mut() else {
                break;
            };
            if front.len() <= n {
                n -= front.len();
                self.out_buf.pop_front();
            } else {
                *front = front.slice(n..);
                n = 0;
            }
        }
    }

    fn resend_to_server(&mut self, out: &mut Out) {
        for (s, b) in &self.unacked {
            out.to_server.push(self.seg_to_server(*s, PSH, b.clone()));
        }
        if let Some(f) = self.fin_to_server {
            if self.srv_acked <= f {
                out.to_server.push(self.seg_to_server(f, FIN, Bytes::new()));
            }
        }
    }

    /// A segment from the server.
    ///
    /// Fails with NotEstablished for a non-SYN segment before the handshake,
    /// with Core(Broken) when the server's output cannot be placed any more
    /// (the caller resets the connection).
    pub fn on_server(&mut self, now: Instant, seg: &Segment) -> Result<Out, TlaError> {
        let mut out = Out::default();
        self.last_seen = now;
        if seg.has(SYN) {
            if self.server_isn.is_none() {
                self.server_isn = Some(seg.seq);
                self.server_opts = packet::syn_options(&seg.options);
            }
            let mut fwd = seg.clone();
            fwd.options = packet::encode_syn_options(self.server_opts);
            self.server_wnd = u64::from(seg.window);
            out.to_peer.push(fwd);
            return Ok(out);
        }
        let Some(isn) = self.server_isn else {
            return Err(TlaError::NotEstablished);
        };
        if seg.has(RST) {
            self.closed = true;
            let mut r = self.seg_to_peer(self.out_nxt, RST, Bytes::new());
            r.flags = RST;
            out.to_peer.push(r);
            return Ok(out);
        }
        let (_, server_shift) = self.shifts();
        if seg.has(ACK) {
            self.server_wnd = u64::from(seg.window) << server_shift;
            if let Some(a) = rel(seg.ack, self.peer_isn, self.srv_acked) {
                if a > self.srv_acked && a <= self.srv_next {
                    self.srv_acked = a;
                    self.in_progress_at = now;
                    self.on_server_ack(a);
                }
            }
        }
        let mut force = false;
        if let Some(o) = rel(seg.seq, isn, self.core.out_pos()) {
            let len = seg.payload.len() as u64;
            let at = self.core.out_pos();
            if len > 0 && self.srv_fin.is_none() {
                if o <= at && at < o + len {
                    let data = seg.payload.slice((at - o) as usize..);
                    let a = self.core.step(
                        now,
                        Event::ServerData {
                            data,
                            refusable: false,
                        },
                    )?;
                    self.apply(now, a, &mut out);
                } else {
                    force = true;
                }
            }
            if seg.has(FIN) {
                if o + len == self.core.out_pos() && self.srv_fin.is_none() {
                    self.srv_fin = Some(self.core.out_pos());
                } else {
                    force = true;
                }
            }
        }
        self.ack_server(force, &mut out);
        self.flush_peer(now, false, &mut out);
        Ok(out)
    }

    /// The server acknowledged server-space bytes up to `a`: the peer may be
    /// told of the peer bytes they carry.
    fn on_server_ack(&mut self, a: u64) {
        while let Some(c) = self.chunks.front().copied() {
            if c.s >= a {
                break;
            }
            let got = (a - c.s).min(c.len);
            self.peer_acked = self.peer_acked.max(c.p + got);
            if got == c.len {
                self.chunks.pop_front();
            } else {
                break;
            }
        }
        while let Some((s, b)) = self.unacked.front() {
            if s + b.len() as u64 <= a {
                self.unacked.pop_front();
            } else {
                break;
            }
        }
        if let (Some(f), Some(pf)) = (self.fin_to_server, self.peer_fin) {
            if a > f && self.peer_acked == pf {
                self.peer_fin_acked = true;
            }
        }
    }

    /// Time passed: retransmits what the logger sends itself and the
    /// receivers did not acknowledge within the timeout; ages logged bytes.
    pub fn tick(&mut self, now: Instant) -> Out {
        let mut out = Out::default();
        if self.server_isn.is_none() || self.closed {
            return out;
        }
        if let Ok(a) = self.core.step(now, Event::Tick) {
            self.apply(now, a, &mut out);
        }
        let rto = self.cfg.rto;
        if self.srv_acked < self.srv_next && now.duration_since(self.in_progress_at) >= rto {
            self.in_progress_at = now;
            self.resend_to_server(&mut out);
        }
        let pending =
            self.out_una < self.out_end || (self.fin_to_peer && self.out_una <= self.out_end);
        if pending && now.duration_since(self.out_progress_at) >= rto {
            // Go back to the first unacknowledged byte.
            self.out_progress_at = now;
            self.out_nxt = self.out_una.min(self.out_end);
            self.flush_peer(now, true, &mut out);
        }
        out
    }

    /// TX_START: `tx` begins; its input starts at peer position `in_from`,
    /// its output at server position `out_from`.
    ///
    /// Fails like [`LoggerCore::step`] with [`Event::Start`].
    pub fn start(
        &mut self,
        now: Instant,
        tx: Tid,
        in_from: u64,
        out_from: u64,
    ) -> Result<Out, TlaError> {
        self.control(
            now,
            Event::Start {
                tx,
                in_from,
                out_from,
            },
        )
    }

    /// TX_RESTART: `tx` re-executes the aborted transaction; its input is
    /// sent to the server again, inserted at the returned server-space
    /// position (the server's reads skip to it).
    ///
    /// Fails with PeerClosed after the peer's FIN reached the server, and
    /// like [`LoggerCore::step`] with [`Event::Restart`].
    pub fn restart(
        &mut self,
        now: Instant,
        tx: Tid,
        out_from: u64,
    ) -> Result<(u64, Out), TlaError> {
        if self.fin_to_server.is_some() {
            return Err(TlaError::PeerClosed);
        }
        let at = self.srv_next;
        let out = self.control(now, Event::Restart { tx, out_from })?;
        Ok((at, out))
    }

    /// The end of `tx`'s bytes.
    ///
    /// Fails like [`LoggerCore::step`] with [`Event::End`].
    pub fn end(
        &mut self,
        now: Instant,
        tx: Tid,
        in_end: u64,
        out_end: u64,
    ) -> Result<Out, TlaError> {
        self.control(
            now,
            Event::End {
                tx,
                in_end,
                out_end,
            },
        )
    }

    /// TX_COMMIT decided: the held output goes to the peer.
    ///
    /// Fails like [`LoggerCore::step`] with [`Event::Commit`].
    pub fn commit(&mut self, now: Instant, tx: Tid) -> Result<Out, TlaError> {
        self.control(now, Event::Commit { tx })
    }

    /// TX_ABORT decided: the held output is dropped (the server was already
    /// acknowledged for it: the hole stays out of the peer's space).
    ///
    /// Fails like [`LoggerCore::step`] with [`Event::Abort`].
    pub fn abort(&mut self, now: Instant, tx: Tid) -> Result<Out, TlaError> {
        self.control(now, Event::Abort { tx })
    }

    /// After an abort that was not restarted: the server's next byte is at
    /// server position `out_from`.
    ///
    /// Fails like [`LoggerCore::step`] with [`Event::Sync`].
    pub fn sync(&mut self, now: Instant, out_from: u64) -> Result<Out, TlaError> {
        self.control(now, Event::Sync { out_from })
    }

    fn control(&mut self, now: Instant, e: Event) -> Result<Out, TlaError> {
        if self.server_isn.is_none() {
            return Err(TlaError::NotEstablished);
        }
        let a = self.core.step(now, e)?;
        let mut out = Out::default();
        self.apply(now, a, &mut out);
        let mut more = Out::default();
        self.pump(now, &mut more);
        self.ack_server(false, &mut more);
        self.flush_peer(now, false, &mut more);
        out.append(more);
        Ok(out)
    }
}

/// The server's positions on a TLA connection: what it read from its
/// socket (server space, replays included) and what of the peer's stream it
/// consumed (peer space). After a restart the logger inserts the replay at
/// a server-space position; bytes before it are skipped (they were read
/// before, or are part of the replay).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ServerReads {
    /// Bytes taken from the socket.
    pub sock: u64,
    /// Skip socket bytes below this position.
    pub skip_to: u64,
    /// Peer-space position of the next byte the application reads.
    pub consumed: u64,
}

impl ServerReads {
    /// `data` was read from the socket: the part the application gets.
    pub fn take<'a>(&mut self, data: &'a [u8]) -> &'a [u8] {
        let skip = self
            .skip_to
            .saturating_sub(self.sock)
            .min(data.len() as u64) as usize;
        self.sock += data.len() as u64;
        let usable = &data[skip..];
        self.consumed += usable.len() as u64;
        usable
    }

    /// A restart: the application reads again from peer position `in_from`,
    /// which the logger sends at socket position `replay_at`.
    pub fn restart(&mut self, in_from: u64, replay_at: u64) {
        self.skip_to = replay_at;
        self.consumed = in_from;
    }
}

#[cfg(test)]
#[path = "conn_tests.rs"]
mod tests;
