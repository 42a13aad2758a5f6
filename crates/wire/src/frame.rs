//! Frames: the unit that moves on a link between two nodes.
//!
//! Owns the in-memory shape of every frame kind. The byte layout lives in
//! [`crate::codec`] and `docs/wire.md`. Must never hold anything that cannot be
//! encoded: every frame can cross a process boundary.

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use crate::ids::{Incarnation, NodeId, ServiceName};
use crate::payload::Payload;
use crate::status::{Failure, Status};
use crate::txctx::{TxContext, TxReturn};

/// Frame kind byte.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
#[repr(u8)]
pub enum FrameKind {
    /// Link handshake, first frame in each direction.
    Hello = 1,
    /// Link handshake, proof of the cluster secret.
    Auth = 2,
    /// The link is refused or closed because of an error; last frame.
    Refused = 3,
    /// A call.
    Request = 4,
    /// The answer to a call.
    Response = 5,
    /// A one-way protocol message to a port (naming, transactions, groups).
    Message = 6,
    /// Failure-detector probe or its answer.
    Heartbeat = 7,
    /// A piece of a frame larger than the link's maximum frame size.
    Fragment = 8,
    /// Orderly close: the sender leaves.
    Goodbye = 9,
}

impl FrameKind {
    /// Maps a kind byte to a kind; `None` for unknown bytes.
    pub fn from_u8(b: u8) -> Option<FrameKind> {
        Some(match b {
            1 => FrameKind::Hello,
            2 => FrameKind::Auth,
            3 => FrameKind::Refused,
            4 => FrameKind::Request,
            5 => FrameKind::Response,
            6 => FrameKind::Message,
            7 => FrameKind::Heartbeat,
            8 => FrameKind::Fragment,
            9 => FrameKind::Goodbye,
            _ => return None,
        })
    }
}

/// Whether the other end of a link is a cluster member or an outside client.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash, Serialize, Deserialize)]
pub enum PeerRole {
    /// A node that joined (or is joining) the cluster.
    Node,
    /// A client such as the CLI: it may call services but is not a member,
    /// is not probed by the failure detector and never hosts participants.
    Client,
}

/// A protocol port for one-way messages.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Port(pub u16);

impl Port {
    /// Naming: joins, leaves, directory updates.
    pub const NAMING: Port = Port(1);
    /// The transaction manager's commit protocol.
    pub const TX: Port = Port(2);
    /// Group communication.
    pub const GROUP: Port = Port(3);
}

/// First frame on a link, sent by both ends.
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct Hello {
    /// The sender's node id ([`NodeId::CLIENT`] for clients).
    pub node: NodeId,
    /// The sender's incarnation.
    pub incarnation: Incarnation,
    /// Member or client.
    pub role: PeerRole,
    /// Random challenge the other end must include in its proof.
    pub nonce: [u8; 16],
    /// The largest frame (header included) the sender accepts.
    pub max_frame: u32,
    /// The largest reassembled message the sender accepts.
    pub max_message: u64,
}

/// Second frame on a link: proof that the sender knows the cluster secret.
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct Auth {
    /// HMAC-SHA256 over both nonces and the sender's identity (see docs/wire.md).
    pub proof: [u8; 32],
}

/// The link is refused or being closed because of an error.
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct Refused {
    /// Why (WrongSecret, ProtocolError, Refused, ShuttingDown...).
    pub status: Status,
    /// Human-readable explanation.
    pub reason: String,
}

/// A call to `service.instance@node`.
#[derive(Debug, PartialEq)]
pub struct Request {
    /// Correlates the response; unique per link direction.
    pub call_id: u64,
    /// The service called.
    pub service: ServiceName,
    /// The service instance.
    pub instance: u32,
    /// The node the call is meant for (a receiving node that is not it answers
    /// AddrError).
    pub node: NodeId,
    /// Microseconds left before the caller gives up, when the frame was sent.
    pub budget_us: Option<u64>,
    /// The caller's transaction, if the call is made on behalf of one.
    /// Boxed: most calls carry none, and a request small enough to be moved
    /// without a `memcpy` call is what every layer of a call's path handles.
    pub tx: Option<Box<TxContext>>,
    /// Reserved for future use; must be 0.
    pub flags: u32,
    /// The request body.
    pub payload: Payload,
}

/// The answer to a [`Request`].
#[derive(Debug, PartialEq)]
pub struct Response {
    /// The request's call id.
    pub call_id: u64,
    /// How the call ended.
    pub status: Status,
    /// Explanation when the status is not Ok (empty otherwise).
    pub detail: String,
    /// Transaction information flowing back to the caller.
    /// Boxed for the reason [`Request::tx`] is.
    pub tx: Option<Box<TxReturn>>,
    /// The response body (empty unless Ok or AppError).
    pub payload: Payload,
}

impl Response {
    /// The response that reports `failure` for call `call_id`: no
    /// transaction information, no body.
    pub fn failure(call_id: u64, failure: Failure) -> Response {
        Response {
            call_id,
            status: failure.status,
            detail: failure.detail,
            tx: None,
            payload: Payload::empty(),
        }
    }
}

/// A one-way protocol message.
#[derive(Debug, PartialEq)]
pub struct Message {
    /// Which protocol it is for.
    pub port: Port,
    /// The protocol message.
    pub payload: Payload,
}

/// A failure-detector probe (`reply == false`) or its answer.
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct Heartbeat {
    /// Probe sequence number, echoed in the reply.
    pub seq: u64,
    /// True for the answer to a probe.
    pub reply: bool,
}

/// One piece of a frame too large for one frame: the concatenated chunks of a
/// message, in index order, are the bytes of one encoded frame.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct Fragment {
    /// Identifies the fragmented frame on this link.
    pub message_id: u64,
    /// Index of this piece, from 0.
    pub index: u32,
    /// Number of pieces.
    pub count: u32,
    /// The bytes of this piece.
    pub chunk: Bytes,
}

/// Orderly close: the sender is leaving.
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct Goodbye {
    /// Why it is leaving (e.g. "shutdown").
    pub reason: String,
}

/// Any frame.
#[derive(Debug, PartialEq)]
pub enum Frame {
    /// See [`Hello`].
    Hello(Hello),
    /// See [`Auth`].
    Auth(Auth),
    /// See [`Refused`].
    Refused(Refused),
    /// See [`Request`].
    Request(Request),
    /// See [`Response`].
    Response(Response),
    /// See [`Message`].
    Message(Message),
    /// See [`Heartbeat`].
    Heartbeat(Heartbeat),
    /// See [`Fragment`].
    Fragment(Fragment),
    /// See [`Goodbye`].
    Goodbye(Goodbye),
}

impl Frame {
    /// The frame's kind.
    pub fn kind(&self) -> FrameKind {
        match self {
            Frame::Hello(_) => FrameKind::Hello,
            Frame::Auth(_) => FrameKind::Auth,
            Frame::Refused(_) => FrameKind::Refused,
            Frame::Request(_) => FrameKind::Request,
            Frame::Response(_) => FrameKind::Response,
            Frame::Message(_) => FrameKind::Message,
            Frame::Heartbeat(_) => FrameKind::Heartbeat,
            Frame::Fragment(_) => FrameKind::Fragment,
            Frame::Goodbye(_) => FrameKind::Goodbye,
        }
    }

    /// A copy of the frame; local payloads are encoded in the copy (see
    /// [`Payload::try_clone`]).
    ///
    /// Fails when a local payload cannot be encoded.
    pub fn try_clone(&self) -> Result<Frame, crate::payload::EncodeError> {
        Ok(match self {
            Frame::Hello(h) => Frame::Hello(h.clone()),
            Frame::Auth(a) => Frame::Auth(a.clone()),
            Frame::Refused(r) => Frame::Refused(r.clone()),
            Frame::Request(r) => Frame::Request(Request {
                call_id: r.call_id,
                service: r.service.clone(),
                instance: r.instance,
                node: r.node,
                budget_us: r.budget_us,
                tx: r.tx.clone(),
                flags: r.flags,
                payload: r.payload.try_clone()?,
            }),
            Frame::Response(r) => Frame::Response(Response {
                call_id: r.call_id,
                status: r.status,
                detail: r.detail.clone(),
                tx: r.tx.clone(),
                payload: r.payload.try_clone()?,
            }),
            Frame::Message(m) => Frame::Message(Message {
                port: m.port,
                payload: m.payload.try_clone()?,
            }),
            Frame::Heartbeat(h) => Frame::Heartbeat(h.clone()),
            Frame::Fragment(f) => Frame::Fragment(f.clone()),
            Frame::Goodbye(g) => Frame::Goodbye(g.clone()),
        })
    }
}
