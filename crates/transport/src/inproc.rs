//! The in-process channel: nodes in one process hand each other the frame
//! value itself (payloads stay unserialized, Raid's lazy data conversion) and
//! the receiving side runs synchronously in the sender's context (direct
//! control passing).
//!
//! Owns the hub that lets nodes of one process find each other. Must never
//! encode a frame.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, Weak};

use parking_lot::Mutex;
use weft_wire::{Frame, NodeId};

use crate::channel::{ChannelKind, IoError, LinkIo};
use crate::endpoint::Inner;
use crate::fault::FaultPlan;
use crate::handshake::Side;
use crate::link::Link;

/// A registry of the nodes living in one process (or one test).
pub struct InprocHub {
    id: u64,
    nodes: Mutex<HashMap<NodeId, Slot>>,
}

enum Slot {
    Live(Weak<Inner>),
    /// A crashed node: connections to it are never answered.
    Crashed,
}

/// What the hub knows about a node.
pub(crate) enum Lookup {
    Live(Arc<Inner>),
    Crashed,
    Absent,
}

static NEXT_HUB: AtomicU64 = AtomicU64::new(1);

impl InprocHub {
    /// A new, empty hub (tests use one per simulated cluster).
    pub fn new() -> Arc<Self> {
        let n = NEXT_HUB.fetch_add(1, Ordering::Relaxed);
        Arc::new(InprocHub {
            id: (u64::from(std::process::id()) << 32) | n,
            nodes: Mutex::default(),
        })
    }

    /// The process-wide default hub.
    pub fn global() -> Arc<Self> {
        static GLOBAL: OnceLock<Arc<InprocHub>> = OnceLock::new();
        GLOBAL.get_or_init(InprocHub::new).clone()
    }

    /// The hub's id, unique across processes of one host.
    pub fn id(&self) -> u64 {
        self.id
    }

    pub(crate) fn register(&self, node: NodeId, inner: &Arc<Inner>) {
        self.nodes
            .lock()
            .insert(node, Slot::Live(Arc::downgrade(inner)));
    }

    pub(crate) fn mark_crashed(&self, node: NodeId, inner: &Arc<Inner>) {
        let mut nodes = self.nodes.lock();
        if let Some(Slot::Live(w)) = nodes.get(&node) {
            if w.as_ptr() == Arc::as_ptr(inner) {
                nodes.insert(node, Slot::Crashed);
            }
        }
    }

    pub(crate) fn unregister(&self, node: NodeId, inner: &Arc<Inner>) {
        let mut nodes = self.nodes.lock();
        if let Some(Slot::Live(w)) = nodes.get(&node) {
            if w.as_ptr() == Arc::as_ptr(inner) {
                nodes.remove(&node);
            }
        }
    }

    pub(crate) fn lookup(&self, node: NodeId) -> Lookup {
        match self.nodes.lock().get(&node) {
            Some(Slot::Live(w)) => w.upgrade().map(Lookup::Live).unwrap_or(Lookup::Absent),
            Some(Slot::Crashed) => Lookup::Crashed,
            None => Lookup::Absent,
        }
    }
}

/// One end of an in-process link: sending hands the frame to the other end.
struct InprocIo {
    peer: Weak<Link>,
    closed: AtomicBool,
    desc: String,
    /// The fault plan with (this node, the peer): a close is a frame like
    /// any other, so over a cut direction the peer never hears of it (as a
    /// FIN lost in a partition) and finds out by its own detector.
    fault: Option<(Arc<FaultPlan>, NodeId, NodeId, u64)>,
}

impl LinkIo for InprocIo {
    fn send(&self, frame: Frame) -> Result<(), IoError> {
        if self.closed.load(Ordering::Acquire) {
            return Err(IoError::Closed);
        }
        match self.peer.upgrade() {
            Some(peer) => {
                peer.on_frame(frame);
                Ok(())
            }
            None => Err(IoError::Closed),
        }
    }

    fn close(&self) {
        if !self.closed.swap(true, Ordering::AcqRel) {
            if let Some((plan, me, to, generation)) = &self.fault {
                if plan.is_cut_on(*me, *to, *generation) {
                    return;
                }
            }
            if let Some(peer) = self.peer.upgrade() {
                peer.on_closed("in-process peer closed the link");
            }
        }
    }

    fn kind(&self) -> ChannelKind {
        ChannelKind::Inproc
    }

    fn describe(&self) -> String {
        self.desc.clone()
    }
}

/// Creates a link pair between `from` (initiator) and `to` (acceptor) and runs
/// the handshake, which completes synchronously. Returns the initiator's end.
pub(crate) fn connect(from: &Arc<Inner>, to: &Arc<Inner>, expected: NodeId) -> Arc<Link> {
    let a = Link::new(from, Side::Initiator, ChannelKind::Inproc, Some(expected));
    let b = Link::new(to, Side::Acceptor, ChannelKind::Inproc, None);
    a.attach(Arc::new(InprocIo {
        peer: Arc::downgrade(&b),
        closed: AtomicBool::new(false),
        desc: format!("inproc to node {expected}"),
        fault: from.cfg.fault.clone().map(|f| {
            let generation = f.generation();
            (f, from.cfg.node, expected, generation)
        }),
    }));
    b.attach(Arc::new(InprocIo {
        peer: Arc::downgrade(&a),
        closed: AtomicBool::new(false),
        desc: format!("inproc from node {}", from.cfg.node),
        fault: to.cfg.fault.clone().map(|f| {
            let generation = f.generation();
            (f, to.cfg.node, from.cfg.node, generation)
        }),
    }));
    from.register_link(&a);
    to.register_link(&b);
    a.start();
    a
}
