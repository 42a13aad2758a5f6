//! One end of a shared-memory link: the segment, the outgoing ring's producer
//! and the incoming ring's consumer, the reader thread that waits for traffic
//! (spin, yield, futex), and the watch on the peer process.
//!
//! Sending encodes the frame with the one codec (`weft_wire`) into a
//! reusable buffer and copies it into the outgoing ring from the sender's
//! context; if the ring is full the rest waits in that buffer (bounded: then
//! `Full`) and the reader thread pushes it when the peer frees room. The
//! reader thread copies the waiting records out of the incoming ring once
//! (the only sound way to read memory a peer can change under us), decodes
//! them and hands each frame to the link directly from its own context:
//! no task switch, and an inline handler answers before the thread waits
//! again (Raid's direct control passing, with the spinning reader in place
//! of the kernel's hand-off).
//!
//! ## Wake-ups
//!
//! A reader that found nothing spins (adaptive budget), yields, then sleeps
//! on its side's doorbell, a futex word in the segment: it sets the word to
//! 1, fences, looks at the ring once more and calls FUTEX_WAIT. A producer,
//! after publishing a record, reads the peer's doorbell and, if it is 1,
//! clears it and calls FUTEX_WAKE: a busy pair never enters the kernel. The
//! producer does *not* fence between publishing and reading the doorbell
//! (a full fence would stall it until the cache lines it just wrote reach
//! the other core, a large share of a round trip), so a record published in
//! the instant the reader decides to sleep can go unnoticed by the wake-up;
//! the reader therefore first naps briefly ([`NAP`]) and looks again before
//! it sleeps for long. The same holds for "room again" notices to a
//! producer waiting on a full ring.
//!
//! Owns its thread and its view of the segment. Must never block in `send`,
//! never hold the producer lock while delivering frames, and never read the
//! segment again once the peer is known dead or the ring corrupt.

use std::sync::atomic::{fence, AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::thread::Thread;
use std::time::{Duration, Instant};

use bytes::{Buf, BytesMut};
use parking_lot::Mutex;
use tokio::net::UnixStream;
use weft_wire::{
    decode_frame_with, encode_message_with, DecodeError, Frame, Integrity, Limits, Status,
};

use super::mem::{self, Segment};
use super::poll;
use super::ring::{Consumer, Layout, Producer, Ring, RingError};
use super::wait::{AdaptiveSpin, Placement};
use super::{ShmConfig, SpinPolicy};
use crate::channel::{io_error, ChannelKind, IoError, LinkIo};
use crate::link::Link;

/// How long a reader thread sleeps between checks while a [`crate::BusyPoll`]
/// drains the rings in its place.
const STAND_DOWN_TICK: Duration = Duration::from_millis(2);

/// The first, short sleep of a reader, after which it looks again before
/// sleeping for long: bounds the delay of a record whose wake-up was missed
/// (see the module documentation).
const NAP: Duration = Duration::from_micros(50);

/// Frames in the rings carry no checksum: both ends read the bytes the
/// writer wrote, and whatever a hostile peer writes still goes through the
/// ring's record checks and the decoder.
const INTEGRITY: Integrity = Integrity::Trusted;

const PEER_ALIVE: u8 = 0;
/// The peer closed its end in an orderly way: drain, then report the close.
const PEER_LEFT: u8 = 1;
/// The peer process died: the segment is never read again.
const PEER_DEAD: u8 = 2;

/// Where a channel delivers what it reads: the link in production, a probe
/// in tests.
pub(crate) trait Deliver: Send + Sync + 'static {
    /// Hands one received frame up. Returns false when the receiver is gone.
    fn frame(&self, frame: Frame) -> bool;
    /// The medium closed under the link (the peer left or died).
    fn closed(&self, reason: &str);
    /// The peer sent bytes that cannot be used: tell it why and close.
    fn refuse(&self, status: Status, reason: &str);
    /// A frame did not decode. Returns true when the stream goes on (a bad
    /// request answered by call id), false when the link was refused.
    fn malformed(&self, e: &DecodeError) -> bool {
        self.refuse(e.status(), &format!("malformed frame on shm: {e}"));
        false
    }
}

/// Delivers to a link.
pub(crate) struct ToLink(pub(crate) Weak<Link>);

impl Deliver for ToLink {
    fn frame(&self, frame: Frame) -> bool {
        match self.0.upgrade() {
            Some(link) => {
                link.on_frame(frame);
                true
            }
            None => false,
        }
    }

    fn closed(&self, reason: &str) {
        if let Some(link) = self.0.upgrade() {
            link.on_closed(reason);
        }
    }

    fn refuse(&self, status: Status, reason: &str) {
        if let Some(link) = self.0.upgrade() {
            link.refuse(status, reason);
        }
    }

    fn malformed(&self, e: &DecodeError) -> bool {
        self.0
            .upgrade()
            .is_some_and(|link| link.on_malformed(e, "malformed frame on shm"))
    }
}

struct Outgoing {
    ring: Producer,
    /// Encoded bytes not yet in the ring (empty on the fast path).
    buf: BytesMut,
    next_message_id: u64,
}

struct Incoming {
    ring: Consumer,
    /// Bytes copied out of the ring, not yet decoded into frames.
    buf: BytesMut,
}

/// One end of a shared-memory channel.
pub(crate) struct Channel {
    seg: Segment,
    layout: Layout,
    /// 0: created the segment (initiator); 1: accepted it.
    side: usize,
    out: Mutex<Outgoing>,
    inc: Mutex<Incoming>,
    /// Copy of the consumer position, for lock-free "anything waiting?" peeks.
    seen_tail: AtomicU64,
    /// Bytes wait in `out.buf` for room in the ring.
    pending: AtomicBool,
    /// The consumer position the producer last saw while bytes were left
    /// waiting: room appeared once the published position differs.
    stuck_at: AtomicU64,
    peer_max_frame: AtomicUsize,
    peer_max_message: AtomicUsize,
    limits: Limits,
    policy: SpinPolicy,
    max_pending: usize,
    target: OnceLock<Box<dyn Deliver>>,
    closed: AtomicBool,
    /// A ring is corrupt: nothing more is read or written.
    broken: AtomicBool,
    peer: AtomicU8,
    reader: OnceLock<Thread>,
    sock: Option<Arc<UnixStream>>,
    desc: String,
}

impl Channel {
    /// A channel end over a mapped, checked segment. `sock` is the rendezvous
    /// connection whose closing tells us the peer is gone (none in tests).
    pub(crate) fn new(
        seg: Segment,
        layout: Layout,
        side: usize,
        limits: Limits,
        cfg: &ShmConfig,
        sock: Option<Arc<UnixStream>>,
        desc: String,
    ) -> Arc<Channel> {
        debug_assert!(side < 2);
        debug_assert_eq!(seg.len_bytes(), layout.segment_bytes());
        Arc::new(Channel {
            seg,
            layout,
            side,
            out: Mutex::new(Outgoing {
                ring: Producer::default(),
                buf: BytesMut::with_capacity(8192),
                next_message_id: 1,
            }),
            inc: Mutex::new(Incoming {
                ring: Consumer::default(),
                buf: BytesMut::with_capacity(64 * 1024),
            }),
            seen_tail: AtomicU64::new(0),
            pending: AtomicBool::new(false),
            stuck_at: AtomicU64::new(0),
            peer_max_frame: AtomicUsize::new(limits.max_frame),
            peer_max_message: AtomicUsize::new(limits.max_message),
            limits,
            policy: cfg.spin,
            max_pending: cfg.max_pending_bytes,
            target: OnceLock::new(),
            closed: AtomicBool::new(false),
            broken: AtomicBool::new(false),
            peer: AtomicU8::new(PEER_ALIVE),
            reader: OnceLock::new(),
            sock,
            desc,
        })
    }

    /// Sets where received frames go. Must be called before [`Channel::start`].
    pub(crate) fn attach(&self, target: Box<dyn Deliver>) {
        if self.target.set(target).is_err() {
            debug_assert!(false, "shm channel attached twice");
        }
    }

    /// Starts the reader thread (it enters the current tokio runtime, if
    /// any, so that handlers it runs may spawn tasks) and makes the channel
    /// visible to [`crate::BusyPoll`].
    ///
    /// Fails when the thread cannot be spawned.
    pub(crate) fn start(self: &Arc<Self>, name: String) -> std::io::Result<()> {
        let handle = tokio::runtime::Handle::try_current().ok();
        let me = Arc::clone(self);
        let join = std::thread::Builder::new()
            .name(name)
            .spawn(move || me.reader_loop(handle))?;
        let _ = self.reader.set(join.thread().clone());
        poll::register(self);
        Ok(())
    }

    fn words(&self) -> &[AtomicU64] {
        self.seg.words()
    }

    fn out_ring(&self) -> Ring<'_> {
        self.layout.ring(self.words(), self.side)
    }

    fn in_ring(&self) -> Ring<'_> {
        self.layout.ring(self.words(), 1 - self.side)
    }

    fn bell(&self, side: usize) -> &AtomicU64 {
        self.layout.doorbell(self.words(), side)
    }

    /// True once this end will never move another byte.
    pub(crate) fn is_finished(&self) -> bool {
        self.closed.load(Ordering::Acquire)
            || self.broken.load(Ordering::Acquire)
            || self.peer.load(Ordering::Acquire) == PEER_DEAD
    }

    /// A description for status output.
    pub(crate) fn describe(&self) -> &str {
        &self.desc
    }

    // ----- sending -----------------------------------------------------------

    /// Encodes `frame` and writes it into the outgoing ring; what does not fit
    /// waits for room.
    ///
    /// Fails with `Closed` once closed, `Full` when too many bytes already
    /// wait, `Encode` when the frame cannot be encoded.
    pub(crate) fn send(&self, frame: &Frame) -> Result<(), IoError> {
        if self.is_finished() {
            return Err(IoError::Closed);
        }
        let mut out = self.out.lock();
        if out.buf.len() > self.max_pending {
            return Err(IoError::Full);
        }
        let id = out.next_message_id;
        out.next_message_id += 1;
        let start = out.buf.len();
        let max = self.peer_max_frame.load(Ordering::Relaxed);
        let max_message = self.peer_max_message.load(Ordering::Relaxed);
        if let Err(e) = encode_message_with(frame, INTEGRITY, max, max_message, id, &mut out.buf) {
            out.buf.truncate(start);
            return Err(io_error(e));
        }
        crate::metrics::bytes_sent(crate::channel::ChannelKind::Shm, out.buf.len() - start);
        if let Err(e) = self.flush(&mut out) {
            drop(out);
            self.fail_ring(e);
            return Err(IoError::Closed);
        }
        Ok(())
    }

    /// Writes what waits in `out.buf` into the ring, as far as it fits, and
    /// rings the peer's doorbell if it sleeps.
    fn flush(&self, out: &mut Outgoing) -> Result<(), RingError> {
        let ring = self.out_ring();
        let mut wrote = Self::write_some(out, &ring)?;
        if !out.buf.is_empty() {
            // Ask the consumer to wake us when it frees room, then look once
            // more: it may have freed some before it could see the request.
            ring.space_wanted.store(1, Ordering::Relaxed);
            fence(Ordering::SeqCst);
            wrote |= Self::write_some(out, &ring)?;
            self.stuck_at.store(out.ring.seen_tail(), Ordering::Relaxed);
        }
        self.pending.store(!out.buf.is_empty(), Ordering::Release);
        if wrote {
            self.ring_bell(1 - self.side);
        }
        Ok(())
    }

    fn write_some(out: &mut Outgoing, ring: &Ring<'_>) -> Result<bool, RingError> {
        let mut wrote = false;
        while !out.buf.is_empty() {
            let n = out.ring.write(ring, &out.buf)?;
            if n == 0 {
                break;
            }
            if n == out.buf.len() {
                // All of it: the buffer starts over where it began, with no
                // offset to track or space to reclaim later.
                out.buf.clear();
            } else {
                out.buf.advance(n);
            }
            wrote = true;
        }
        Ok(wrote)
    }

    /// Wakes `side` if it sleeps on its doorbell. No fence before the read:
    /// a wake-up lost to the race is caught by the reader's nap (see the
    /// module documentation).
    fn ring_bell(&self, side: usize) {
        let bell = self.bell(side);
        if bell.load(Ordering::Relaxed) != 0 && bell.swap(0, Ordering::Relaxed) != 0 {
            mem::futex_wake(bell, 1);
        }
    }

    /// Sets the largest frame and message the peer accepts.
    pub(crate) fn set_peer_limits(&self, max_frame: usize, max_message: usize) {
        self.peer_max_frame.store(max_frame, Ordering::Relaxed);
        self.peer_max_message.store(max_message, Ordering::Relaxed);
    }

    // ----- receiving ---------------------------------------------------------

    fn target(&self) -> Option<&dyn Deliver> {
        self.target.get().map(|b| &**b)
    }

    /// True when the reader has something to do (or to notice).
    fn has_work(&self) -> bool {
        let tail = self.seen_tail.load(Ordering::Acquire);
        self.in_ring().has_data_at(tail)
            || (self.pending.load(Ordering::Acquire) && self.room_appeared())
            || self.peer.load(Ordering::Acquire) != PEER_ALIVE
            || self.peer_closed_flag()
            || self.is_finished()
    }

    /// The consumer moved since the producer found the ring full.
    fn room_appeared(&self) -> bool {
        let ring = self.out_ring();
        ring.space_wanted.load(Ordering::Relaxed) == 0
            || ring.tail.load(Ordering::Relaxed) != self.stuck_at.load(Ordering::Relaxed)
    }

    fn peer_closed_flag(&self) -> bool {
        self.layout
            .closed(self.words(), 1 - self.side)
            .load(Ordering::Acquire)
            != 0
    }

    /// Moves whatever can move: reads and delivers incoming frames, pushes
    /// waiting outgoing bytes, notices an orderly close. Safe to call from
    /// any thread (the reader thread and busy pollers take turns); returns
    /// true when anything moved.
    pub(crate) fn service(&self) -> bool {
        let mut progress = false;
        let tail = self.seen_tail.load(Ordering::Acquire);
        if self.in_ring().has_data_at(tail) && !self.is_finished() {
            if let Some(mut inc) = self.inc.try_lock() {
                progress |= self.drain(&mut inc);
            }
        }
        if self.pending.load(Ordering::Acquire) && !self.is_finished() {
            if let Some(mut out) = self.out.try_lock() {
                let before = out.buf.len();
                match self.flush(&mut out) {
                    Ok(()) => progress |= out.buf.len() < before,
                    Err(e) => {
                        drop(out);
                        self.fail_ring(e);
                        return true;
                    }
                }
            }
        }
        if (self.peer.load(Ordering::Acquire) == PEER_LEFT || self.peer_closed_flag())
            && !self.is_finished()
        {
            self.finish_if_drained();
        }
        progress
    }

    /// After the peer's orderly close: once nothing is left to read, report
    /// the close and stop.
    fn finish_if_drained(&self) {
        let Some(inc) = self.inc.try_lock() else {
            return;
        };
        if self.in_ring().has_data_at(inc.ring.tail()) {
            return; // drain first
        }
        drop(inc);
        if let Some(t) = self.target() {
            t.closed("peer closed the shared-memory link");
        }
        self.close();
    }

    /// Copies waiting records out, publishes the new position (waking a
    /// producer that waits for room), then decodes and delivers every whole
    /// frame, in order. Runs under the consumer lock.
    fn drain(&self, inc: &mut Incoming) -> bool {
        let ring = self.in_ring();
        if inc.buf.capacity() - inc.buf.len() < 4096 {
            inc.buf.reserve(64 * 1024);
        }
        let read = inc.ring.read(&ring, &mut inc.buf, ring.capacity() / 2);
        let n = match read {
            Ok(n) => n,
            Err(e) => {
                self.fail_ring(e);
                return true;
            }
        };
        if n == 0 {
            return false;
        }
        crate::metrics::bytes_received(crate::channel::ChannelKind::Shm, n);
        self.seen_tail.store(inc.ring.tail(), Ordering::Release);
        // No fence: a missed request is caught by the producer's nap.
        if ring.space_wanted.load(Ordering::Relaxed) != 0 {
            ring.space_wanted.store(0, Ordering::Relaxed);
            self.ring_bell(1 - self.side);
        }
        let Some(target) = self.target() else {
            return true;
        };
        loop {
            if self.is_finished() {
                break;
            }
            match decode_frame_with(&mut inc.buf, &self.limits, INTEGRITY) {
                Ok(Some(frame)) => {
                    if !target.frame(frame) {
                        self.close();
                        break;
                    }
                }
                Ok(None) => break,
                Err(e) => {
                    if target.malformed(&e) {
                        continue; // consumed whole and answered
                    }
                    inc.buf.clear();
                    self.close();
                    break;
                }
            }
        }
        true
    }

    /// A ring is corrupt: stop touching the segment, close the link.
    fn fail_ring(&self, e: RingError) {
        if self.broken.swap(true, Ordering::AcqRel) {
            return;
        }
        tracing::warn!(channel = %self.desc, "corrupt shared-memory ring: {e}");
        if let Some(t) = self.target() {
            // The Refused frame cannot go out (the channel is broken), but the
            // link records why it closed.
            t.refuse(Status::ProtocolError, &format!("corrupt shm ring: {e}"));
        }
        self.close();
    }

    // ----- waiting -----------------------------------------------------------

    fn reader_loop(self: Arc<Self>, handle: Option<tokio::runtime::Handle>) {
        let _runtime = handle.as_ref().map(|h| h.enter());
        let mut spin = AdaptiveSpin::new(self.policy);
        let mut placement = Placement::default();
        while !self.is_finished() {
            if self.service() {
                continue;
            }
            if poll::pollers_active() {
                // A busy poller drains every ring of this process; stay out
                // of its way (two spinners would fight for the CPUs).
                std::thread::park_timeout(STAND_DOWN_TICK);
                continue;
            }
            self.publish_cpu(mem::current_cpu());
            let ready = || self.has_work() || poll::pollers_active();
            let colocated = || poll::colocated(std::slice::from_ref(&self), &mut placement);
            if spin.wait(ready, colocated) {
                continue;
            }
            let started = Instant::now();
            let for_work = self.park();
            spin.parked(started.elapsed(), for_work);
        }
    }

    /// Sleeps on this side's doorbell until the peer (or a local close) rings
    /// it, or the policy's timeout: first a [`NAP`], then, if still nothing
    /// came, for long. Returns whether work was waiting.
    fn park(&self) -> bool {
        let bell = self.bell(self.side);
        bell.store(1, Ordering::Relaxed);
        fence(Ordering::SeqCst);
        for timeout in [NAP, self.policy.park_timeout] {
            if self.has_work() || poll::pollers_active() {
                break;
            }
            if bell.load(Ordering::Relaxed) == 0 {
                break; // rung meanwhile
            }
            mem::futex_wait(bell, 1, timeout);
        }
        bell.store(0, Ordering::Relaxed);
        self.has_work()
    }

    /// Wakes this end's reader thread wherever it waits.
    fn wake_reader(&self) {
        let bell = self.bell(self.side);
        bell.store(0, Ordering::Relaxed);
        mem::futex_wake(bell, i32::MAX);
        self.unpark_reader();
    }

    /// Announces the CPU this side's reader (thread or busy poller) runs on.
    pub(crate) fn publish_cpu(&self, cpu: u32) {
        let w = self.layout.cpu(self.words(), self.side);
        if w.load(Ordering::Relaxed) != u64::from(cpu) {
            w.store(u64::from(cpu), Ordering::Relaxed);
        }
    }

    /// True when the peer's reader last ran on `cpu` and is not asleep on
    /// its doorbell: spinning there only keeps it from running. (A parked
    /// peer's CPU is stale and it needs no CPU until woken.)
    pub(crate) fn peer_on_cpu(&self, cpu: u32) -> bool {
        let words = self.words();
        self.layout
            .cpu(words, 1 - self.side)
            .load(Ordering::Relaxed)
            == u64::from(cpu)
            && self.bell(1 - self.side).load(Ordering::Relaxed) == 0
    }

    /// True when this end is the one that moves to another CPU when both
    /// ends spin on the same one (see [`Placement`]): side 0, so that the
    /// two never both move, and maybe onto the same CPU again.
    pub(crate) fn steps_aside(&self) -> bool {
        self.side == 0
    }

    /// Unparks the reader thread if it stands down for a busy poller.
    pub(crate) fn unpark_reader(&self) {
        if let Some(t) = self.reader.get() {
            t.unpark();
        }
    }

    // ----- closing and death -------------------------------------------------

    /// Closes this end: tells the peer it is an orderly close, shuts the
    /// rendezvous connection and stops the reader thread. Idempotent.
    pub(crate) fn close(&self) {
        if self.closed.swap(true, Ordering::AcqRel) {
            return;
        }
        self.layout
            .closed(self.words(), self.side)
            .store(1, Ordering::Release);
        self.ring_bell(1 - self.side);
        if let Some(s) = &self.sock {
            let _ = socket2::SockRef::from(&**s).shutdown(std::net::Shutdown::Both);
        }
        self.wake_reader();
        poll::changed();
    }

    /// Watches the rendezvous connection: the kernel closes the peer's end
    /// when its process exits, however it dies. An end closed without the
    /// peer's orderly-close flag means the process died: the link closes at
    /// once (ProcDead) and the segment is never read again.
    pub(crate) async fn watch_peer(self: Arc<Self>) {
        let Some(sock) = self.sock.clone() else {
            return;
        };
        let mut buf = [0u8; 64];
        loop {
            if self.is_finished() {
                return;
            }
            if sock.readable().await.is_err() {
                break;
            }
            match sock.try_read(&mut buf) {
                Ok(0) => break,
                Ok(_) => continue, // nothing is expected after setup: ignored
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
                Err(_) => break,
            }
        }
        self.peer_gone();
    }

    /// The peer's end of the rendezvous connection closed.
    pub(crate) fn peer_gone(&self) {
        if self.is_finished() {
            return;
        }
        if self.peer_closed_flag() {
            self.peer.store(PEER_LEFT, Ordering::Release);
            self.wake_reader();
            return;
        }
        self.peer.store(PEER_DEAD, Ordering::Release);
        tracing::debug!(channel = %self.desc, "shm peer process died");
        if let Some(t) = self.target() {
            t.closed("peer process died (its shm connection closed without a goodbye)");
        }
        self.close();
    }
}

/// The [`LinkIo`] of a shared-memory link end.
pub(crate) struct ShmIo(pub(crate) Arc<Channel>);

impl LinkIo for ShmIo {
    fn send(&self, frame: Frame) -> Result<(), IoError> {
        self.0.send(&frame)
    }

    fn set_peer_limits(&self, max_frame: usize, max_message: usize) {
        self.0.set_peer_limits(max_frame, max_message);
    }

    fn close(&self) {
        self.0.close();
    }

    fn kind(&self) -> ChannelKind {
        ChannelKind::Shm
    }

    fn describe(&self) -> String {
        self.0.describe().to_string()
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::super::ring::MIN_RING_BYTES;
    use super::*;
    use std::sync::atomic::AtomicUsize;
    use weft_wire::{Heartbeat, Payload, Request, ServiceName};

    /// Collects what a channel delivers.
    #[derive(Default)]
    pub(crate) struct Probe {
        pub(crate) frames: Mutex<Vec<Frame>>,
        pub(crate) closed: Mutex<Vec<String>>,
        pub(crate) refused: Mutex<Vec<(Status, String)>>,
        pub(crate) count: AtomicUsize,
    }

    pub(crate) struct ToProbe(pub(crate) Arc<Probe>);

    impl Deliver for ToProbe {
        fn frame(&self, frame: Frame) -> bool {
            self.0.count.fetch_add(1, Ordering::AcqRel);
            self.0.frames.lock().push(frame);
            true
        }
        fn closed(&self, reason: &str) {
            self.0.closed.lock().push(reason.to_string());
        }
        fn refuse(&self, status: Status, reason: &str) {
            self.0.refused.lock().push((status, reason.to_string()));
        }
    }

    pub(crate) fn cfg(ring_bytes: usize) -> ShmConfig {
        ShmConfig {
            ring_bytes,
            max_pending_bytes: 1 << 20,
            ..ShmConfig::default()
        }
    }

    /// Two channel ends over two mappings of one memfd, as two processes
    /// would have, delivering into probes. Reader threads are not started.
    pub(crate) fn pair(cfg: &ShmConfig) -> (Arc<Channel>, Arc<Probe>, Arc<Channel>, Arc<Probe>) {
        let layout = Layout::new(cfg.ring_bytes).unwrap();
        let a = Segment::create("weft-test", layout.segment_bytes()).unwrap();
        layout.init(a.words(), std::process::id());
        let fd = a.fd().try_clone_to_owned().unwrap();
        let b = Segment::open(fd, 0, usize::MAX).unwrap();
        assert_eq!(Layout::read(b.words()).unwrap(), layout);
        let limits = Limits::default();
        let ca = Channel::new(a, layout, 0, limits, cfg, None, "a".into());
        let cb = Channel::new(b, layout, 1, limits, cfg, None, "b".into());
        let (pa, pb) = (Arc::new(Probe::default()), Arc::new(Probe::default()));
        ca.attach(Box::new(ToProbe(pa.clone())));
        cb.attach(Box::new(ToProbe(pb.clone())));
        (ca, pa, cb, pb)
    }

    fn request(n: usize) -> Frame {
        Frame::Request(Request {
            call_id: n as u64,
            service: ServiceName::new("echo").unwrap(),
            instance: 0,
            node: weft_wire::NodeId(2),
            budget_us: None,
            tx: None,
            flags: 0,
            payload: Payload::bytes(vec![n as u8; n]),
        })
    }

    #[test]
    fn a_peer_shares_a_cpu_only_while_it_is_awake_there() {
        let (a, _pa, b, _pb) = pair(&cfg(8192));
        a.publish_cpu(5);
        assert!(b.peer_on_cpu(5), "awake on CPU 5");
        assert!(!b.peer_on_cpu(6));
        // Parked on its doorbell: its CPU is free.
        a.bell(a.side).store(1, Ordering::Relaxed);
        assert!(!b.peer_on_cpu(5), "asleep");
        a.bell(a.side).store(0, Ordering::Relaxed);
        assert!(b.peer_on_cpu(5), "awake again");
        assert!(a.steps_aside() && !b.steps_aside(), "exactly one end moves");
        a.close();
        b.close();
    }

    #[test]
    fn frames_cross_in_order_including_fragmented_large_ones() {
        let (a, _pa, b, pb) = pair(&cfg(MIN_RING_BYTES));
        a.set_peer_limits(4096, 64 << 20);
        let sizes = [0usize, 1, 7, 100, 3000, 5000, 70_000, 12];
        for (i, n) in sizes.iter().enumerate() {
            a.send(&request(*n)).unwrap();
            // The 4 KiB ring cannot hold 70 KB: keep draining while it waits.
            let deadline = Instant::now() + Duration::from_secs(10);
            while a.pending.load(Ordering::Acquire) {
                b.service();
                a.service();
                assert!(Instant::now() < deadline, "stuck at frame {i}");
            }
        }
        while b.service() {}
        let frames = pb.frames.lock();
        // Fragments are reassembled by the link, not the channel: count the
        // logical messages by their call ids.
        let ids: Vec<u64> = frames
            .iter()
            .filter_map(|f| match f {
                Frame::Request(r) => Some(r.call_id),
                _ => None,
            })
            .collect();
        assert_eq!(ids, vec![0, 1, 7, 100, 3000, 12]);
        assert!(frames.iter().any(|f| matches!(f, Frame::Fragment(_))));
    }

    #[test]
    fn a_stuck_consumer_gives_back_pressure_not_loss() {
        let (a, _pa, b, pb) = pair(&cfg(MIN_RING_BYTES));
        let mut sent = 0;
        let err = loop {
            match a.send(&request(1000)) {
                Ok(()) => sent += 1,
                Err(e) => break e,
            }
            assert!(sent < 10_000, "never full");
        };
        assert_eq!(err, IoError::Full);
        // Now the consumer catches up and everything arrives.
        let deadline = Instant::now() + Duration::from_secs(10);
        while pb.count.load(Ordering::Acquire) < sent {
            b.service();
            a.service();
            assert!(Instant::now() < deadline);
        }
        assert_eq!(pb.frames.lock().len(), sent);
        a.send(&request(5)).unwrap();
    }

    #[test]
    fn garbage_in_the_ring_is_an_error_and_stops_the_channel() {
        let (a, _pa, b, pb) = pair(&cfg(MIN_RING_BYTES));
        a.send(&Frame::Heartbeat(Heartbeat {
            seq: 1,
            reply: false,
        }))
        .unwrap();
        assert!(b.service());
        assert_eq!(pb.frames.lock().len(), 1);
        // A well-formed record holding bytes that are not a frame.
        {
            let mut out = a.out.lock();
            let ring = a.out_ring();
            out.ring
                .write(&ring, b"this is not a weft frame at all")
                .unwrap();
        }
        b.service();
        let refused = pb.refused.lock().clone();
        assert_eq!(refused.len(), 1, "{refused:?}");
        assert_eq!(refused[0].0, Status::ProtocolError);
        assert!(b.is_finished());
        assert_eq!(b.send(&request(1)), Err(IoError::Closed));
    }

    #[test]
    fn scribbling_over_the_segment_is_an_error_never_a_crash() {
        for seed in 0..20u64 {
            let (a, _pa, b, pb) = pair(&cfg(MIN_RING_BYTES));
            a.send(&request(50)).unwrap();
            let words = a.words();
            let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
            for _ in 0..64 {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                words[(x as usize) % words.len()].store(x, Ordering::Relaxed);
            }
            // Whatever happened, servicing terminates and the process lives.
            for _ in 0..8 {
                b.service();
                a.service();
            }
            let _ = a.send(&request(10));
            let _ = b.send(&request(10));
            drop(pb);
        }
    }

    #[test]
    fn orderly_close_is_seen_after_draining() {
        let (a, _pa, b, pb) = pair(&cfg(MIN_RING_BYTES));
        a.send(&request(3)).unwrap();
        a.close();
        assert_eq!(a.send(&request(3)), Err(IoError::Closed));
        b.service();
        assert_eq!(
            pb.frames.lock().len(),
            1,
            "the frame before the close arrives"
        );
        assert_eq!(pb.closed.lock().len(), 1);
        assert!(b.is_finished());
    }

    #[test]
    fn a_dead_peer_is_never_read_again() {
        let (a, _pa, b, pb) = pair(&cfg(MIN_RING_BYTES));
        a.send(&request(3)).unwrap();
        b.peer_gone(); // no orderly-close flag: the peer died
        assert_eq!(pb.closed.lock().len(), 1);
        assert!(!b.service());
        assert!(pb.frames.lock().is_empty());
    }

    #[test]
    fn reader_threads_spin_then_park_and_wake_on_traffic() {
        let _serial = super::super::tests::SERIAL.lock();
        let mut c = cfg(MIN_RING_BYTES * 4);
        c.spin.max_spin = Duration::from_micros(20);
        let (a, pa, b, pb) = pair(&c);
        a.start("weft-test-a".into()).unwrap();
        b.start("weft-test-b".into()).unwrap();
        let wait = |p: &Arc<Probe>, n: usize| {
            let deadline = Instant::now() + Duration::from_secs(10);
            while p.count.load(Ordering::Acquire) < n {
                assert!(Instant::now() < deadline, "frame {n} never arrived");
                std::thread::yield_now();
            }
        };
        for i in 1..=200 {
            a.send(&request(i % 50)).unwrap();
            wait(&pb, i);
            b.send(&request(i % 30)).unwrap();
            wait(&pa, i);
        }
        // Let both readers fall asleep on their futex, then wake them.
        let deadline = Instant::now() + Duration::from_secs(10);
        while a.bell(1).load(Ordering::Relaxed) == 0 {
            assert!(Instant::now() < deadline, "reader b never parked");
            std::thread::sleep(Duration::from_millis(1));
        }
        a.send(&request(1)).unwrap();
        wait(&pb, 201);
        a.close();
        b.close();
    }
}
