//! Fuzzing hooks (cargo feature `fuzzing`, hidden from the docs): public
//! wrappers over the link handshake and the shared-memory ring so the
//! cargo-fuzz targets in `fuzz/` can drive them from outside the crate.
//!
//! Owns nothing but the wrappers: every call goes straight to the real code
//! ([`crate::handshake`], `shm::ring`). Must never add behaviour of its own
//! or be used by anything but fuzzing.

use std::sync::Arc;

use weft_wire::{Frame, Hello, NodeId, Status};

use crate::handshake;

pub use crate::shm::fuzzing::{RingConsumer, RingProducer, RingSegment};

/// Which end of the link a [`Handshake`] is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    /// Opened the connection; speaks first.
    Initiator,
    /// Accepted the connection.
    Acceptor,
}

/// What the handshake wants done (mirror of the crate's own `Step`).
#[derive(Debug, PartialEq)]
pub enum Step {
    /// Send this frame to the peer.
    Send(Frame),
    /// The peer is authenticated; its Hello.
    Established(Hello),
    /// The handshake failed; close the link.
    Fail(Status, String),
}

impl From<handshake::Step> for Step {
    fn from(s: handshake::Step) -> Step {
        match s {
            handshake::Step::Send(f) => Step::Send(f),
            handshake::Step::Established(h) => Step::Established(h),
            handshake::Step::Fail(st, why) => Step::Fail(st, why),
        }
    }
}

/// The real handshake state machine of one link end.
pub struct Handshake(handshake::Handshake);

impl Handshake {
    /// See the crate's `Handshake::new`.
    pub fn new(
        side: Side,
        own: Hello,
        secret: Arc<[u8]>,
        expected_peer: Option<NodeId>,
        accept_clients: bool,
    ) -> Handshake {
        let side = match side {
            Side::Initiator => handshake::Side::Initiator,
            Side::Acceptor => handshake::Side::Acceptor,
        };
        Handshake(handshake::Handshake::new(
            side,
            own,
            secret,
            expected_peer,
            accept_clients,
        ))
    }

    /// The first frames to send.
    pub fn start(&self) -> Vec<Step> {
        self.0.start().into_iter().map(Step::from).collect()
    }

    /// Feeds one received frame; returns what to do.
    pub fn on_frame(&mut self, frame: Frame) -> Vec<Step> {
        self.0.on_frame(frame).into_iter().map(Step::from).collect()
    }
}
