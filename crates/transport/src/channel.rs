//! The interface every channel implements for one end of one link.
//!
//! Owns the contract between the generic link logic and a concrete medium
//! (in-process hand-off, shared memory, TCP). Must never contain protocol
//! logic: a channel moves frames and reports closure, nothing else.

use std::fmt;

use serde::{Deserialize, Serialize};
use weft_wire::Frame;

/// The kind of medium a link runs over, cheapest first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum ChannelKind {
    /// Same process: the frame value itself is handed over, never encoded.
    Inproc,
    /// Same host: shared-memory rings.
    Shm,
    /// Anywhere: TCP.
    Tcp,
}

impl ChannelKind {
    /// The kind's name: `inproc`, `shm` or `tcp`.
    pub fn name(self) -> &'static str {
        match self {
            ChannelKind::Inproc => "inproc",
            ChannelKind::Shm => "shm",
            ChannelKind::Tcp => "tcp",
        }
    }
}

impl fmt::Display for ChannelKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Why a channel could not take a frame.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IoError {
    /// The link is closed.
    #[error("link closed")]
    Closed,
    /// The channel's outgoing buffer is full.
    #[error("outgoing buffer full")]
    Full,
    /// The frame could not be encoded.
    #[error("cannot encode frame: {0}")]
    Encode(String),
    /// The message is larger than the peer accepts (its Hello said so);
    /// nothing was sent and the link stays up.
    #[error("{0}")]
    TooLarge(String),
}

/// The [`IoError`] for a message that could not be encoded for a peer.
pub(crate) fn io_error(e: weft_wire::MessageEncodeError) -> IoError {
    match e {
        weft_wire::MessageEncodeError::TooLarge { .. } => IoError::TooLarge(e.to_string()),
        weft_wire::MessageEncodeError::Encode(e) => IoError::Encode(e.to_string()),
    }
}

/// One end of a link over some medium.
///
/// `send` must not block. It may run the receiving end's processing
/// synchronously (the inproc channel does: direct control passing), so a
/// caller must never hold a lock that the receiving side could need.
pub trait LinkIo: Send + Sync + 'static {
    /// Hands one frame to the medium.
    ///
    /// Fails with [`IoError::Closed`] once the link is closed, [`IoError::Full`]
    /// when a bounded buffer is full, [`IoError::Encode`] when a payload cannot
    /// be encoded for a byte medium, [`IoError::TooLarge`] when the message
    /// exceeds what the peer accepts.
    fn send(&self, frame: Frame) -> Result<(), IoError>;

    /// Tells the channel the largest frame and the largest message the peer
    /// accepts (learned in the handshake): byte channels fragment larger
    /// frames and refuse larger messages with [`IoError::TooLarge`].
    fn set_peer_limits(&self, _max_frame: usize, _max_message: usize) {}

    /// Closes the medium; the other end sees the link close.
    fn close(&self);

    /// The medium's kind.
    fn kind(&self) -> ChannelKind;

    /// A short description for status output ("tcp 127.0.0.1:7001").
    fn describe(&self) -> String;
}
