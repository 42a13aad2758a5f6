//! The protocol between shared-state processes (not homes): the service
//! [`PEER_SERVICE`] that every [`crate::StateClient`] serves on its node.
//!
//! Owns the request and reply shapes only: a process of a transaction asks
//! the holder of uncommitted diffs for them (`Diffs`), a home asks the
//! transaction's root for every diff of the segments it will commit
//! (`Collect`, at prepare), and a home tells caching processes of a new
//! master version (`Notice`). A request for uncommitted diffs carries the
//! SHA-256 of the segment's secret, which the holder checks against its own.

use serde::{Deserialize, Serialize};
use weft_wire::ids::{SubPath, Tid};

use crate::core::mip::SegUrl;

/// The service every state client serves.
pub const PEER_SERVICE: &str = "state-peer";

/// One held diff as it travels: identifier, writer's sub-transaction, wire
/// form.
pub type WireHeld = (u64, SubPath, Vec<u8>);

/// A request to a state client.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum PeerRequest {
    /// The diffs `ids` of `url` that transaction `tid` wrote here.
    Diffs {
        /// The transaction.
        tid: Tid,
        /// The segment.
        url: SegUrl,
        /// SHA-256 of the segment's secret.
        secret: [u8; 32],
        /// The identifiers wanted, in order.
        ids: Vec<u64>,
    },
    /// Every uncommitted diff of `tid` on each segment, in order, wherever
    /// it lives (asked of the transaction's root by a home at prepare).
    Collect {
        /// The transaction.
        tid: Tid,
        /// The segments and the SHA-256 of their secrets.
        segs: Vec<(SegUrl, [u8; 32])>,
    },
    /// The master of `url` is now at `version`; `changed` units changed
    /// since `since`.
    Notice {
        /// The segment.
        url: SegUrl,
        /// The version before.
        since: u64,
        /// The new master version.
        version: u64,
        /// Units the new versions changed.
        changed: u64,
    },
}

/// A state client's reply.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum PeerReply {
    /// The diffs asked for, in order.
    Diffs(Vec<WireHeld>),
    /// Per segment, the transaction's diffs in order.
    Collected(Vec<(SegUrl, Vec<WireHeld>)>),
    /// Noted.
    Ack,
}
