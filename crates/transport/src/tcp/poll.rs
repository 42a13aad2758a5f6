//! The TCP links a [`crate::BusyPoll`] reads: every link whose reader task
//! runs is registered here, and a busy poller reads and delivers for it
//! while it waits, so a response completes its call on the poller's own
//! thread instead of after a wake-up of a runtime worker (on a VM whose
//! halted vCPUs take ~60 µs to wake, that wake-up is most of a loopback
//! round trip).
//!
//! A poller reads only links that are up (the handshake stays the reader
//! task's) and whose inbox has room, one `recv` per link per round, under
//! the same lock the reader task reads under. The reader task keeps waiting
//! for readiness meanwhile and clears it only on its own empty or short
//! read, so whatever a poller leaves is still read.
//!
//! Owns the process-wide registry of pollable TCP links. Must never hold
//! the registry lock while reading a socket.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};

use parking_lot::Mutex;
use weft_wire::Limits;

use super::{Pass, TcpIo};
use crate::link::Link;

static REGISTRY: Mutex<Vec<Pollable>> = Mutex::new(Vec::new());
static GENERATION: AtomicU64 = AtomicU64::new(0);

/// One registered link: its socket, the link it delivers to and its limits.
#[derive(Clone)]
struct Pollable {
    io: Weak<TcpIo>,
    link: Weak<Link>,
    limits: Limits,
}

impl Pollable {
    /// Reads once and delivers what completed, if the link is up, has room
    /// and nobody else reads it right now. True when anything moved.
    fn service(&self) -> bool {
        let Some(io) = self.io.upgrade() else {
            return false;
        };
        if io.closed.load(Ordering::Acquire) {
            return false;
        }
        match self.link.upgrade() {
            Some(l) if l.is_up() && !l.inbox_full() => {}
            _ => return false,
        }
        let Some(mut read) = io.read.try_lock() else {
            return false;
        };
        match io.pass(&mut read, &self.link, self.limits) {
            Pass::Empty => false,
            Pass::Read { .. } => true,
            // Frames wait in the buffer for room, or the link is over: the
            // reader task takes it from here. The arrival read here woke it
            // already; the notice makes sure it does not depend on that.
            Pass::InboxFull | Pass::Over => {
                drop(read);
                io.resume.notify_one();
                true
            }
        }
    }
}

/// Keeps a link in the registry while its reader task runs.
pub(super) struct Registration(Weak<TcpIo>);

/// Makes a link's socket readable by busy pollers until the returned value
/// is dropped.
pub(super) fn register(io: &Arc<TcpIo>, link: &Weak<Link>, limits: Limits) -> Registration {
    let io = Arc::downgrade(io);
    REGISTRY.lock().push(Pollable {
        io: io.clone(),
        link: link.clone(),
        limits,
    });
    GENERATION.fetch_add(1, Ordering::Release);
    Registration(io)
}

impl Drop for Registration {
    fn drop(&mut self) {
        REGISTRY.lock().retain(|p| !p.io.ptr_eq(&self.0));
        GENERATION.fetch_add(1, Ordering::Release);
    }
}

/// A busy poller's copy of the registry, refreshed when links come or go.
/// Holds no link alive: a closed link's socket is released at once.
pub(crate) struct Sockets {
    links: Vec<Pollable>,
    generation: u64,
}

impl Sockets {
    pub(crate) fn new() -> Sockets {
        Sockets {
            links: Vec::new(),
            generation: u64::MAX,
        }
    }

    /// Reads and delivers once on every pollable link. True when anything
    /// moved.
    pub(crate) fn service(&mut self) -> bool {
        let now = GENERATION.load(Ordering::Acquire);
        if now != self.generation {
            self.links = REGISTRY.lock().clone();
            self.generation = now;
        }
        let mut progress = false;
        for p in &self.links {
            progress |= p.service();
        }
        progress
    }
}
