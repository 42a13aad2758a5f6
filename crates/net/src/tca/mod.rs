//! 2CA, the two-connection architecture: a proxy logger between the peer and
//! the server. The peer connects to the proxy, the proxy to the server; the
//! proxy is its own weft node, and the paper's control connection is weft's:
//! the server's transaction calls the proxy's `net` service (TX_START,
//! TX_RESTART, the end of the transaction's bytes), which makes the proxy a
//! two-phase participant, and prepare/commit/abort arrive as weft's commit
//! protocol.
//!
//! Owns the control messages ([`NetRequest`]), the framing of peer bytes on
//! the proxy→server link ([`frame`]: each chunk carries its position, so a
//! replay after a restart cannot be confused with bytes still in flight),
//! the proxy ([`proxy::NetProxy`]) and the server's side ([`server::ProxiedStream`]).
//! The server→proxy direction is raw bytes; positions in the control
//! messages place them. Must never let the proxy send the peer a byte of a
//! transaction that did not commit.

pub mod proxy;
pub mod server;

use serde::{Deserialize, Serialize};
use weft_wire::Tid;

use crate::core::{ConnState, ConnStats};

/// The name the proxy's service registers under.
pub const SERVICE: &str = "net";

/// The proxy's log records' tag.
pub const NET_RECORD_TAG: weft_log::RecordTag = weft_log::RecordTag(0x0400);

/// A connection at the proxy is named by the proxy's local address of its
/// connection to the server: the address the server sees as its peer.
pub type ConnName = String;

/// Control messages from the server to the proxy (calls to `net@<proxy>`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum NetRequest {
    /// TX_START, or TX_RESTART when `replay`, in the calling transaction.
    Start {
        /// The connection.
        conn: ConnName,
        /// First peer byte of the transaction (ignored for a restart: the
        /// aborted transaction's first byte).
        in_from: u64,
        /// First server byte of the transaction.
        out_from: u64,
        /// The transaction the server aborted last on this connection, if
        /// its abort may not have reached the proxy yet (the proxy applies
        /// it first: the server coordinates it, its word is final).
        aborted: Option<Tid>,
        /// TX_RESTART: re-execute the aborted transaction; the proxy sends
        /// its input again.
        replay: bool,
    },
    /// The end of the calling transaction's bytes (before its commit).
    End {
        /// The connection.
        conn: ConnName,
        /// End of the input it consumed.
        in_end: u64,
        /// End of the output it wrote.
        out_end: u64,
    },
    /// Outside a transaction, after an abort: the server's next byte.
    Sync {
        /// The connection.
        conn: ConnName,
        /// The server's write position.
        out_from: u64,
        /// The transaction the server aborted last, if its abort may not
        /// have reached the proxy yet.
        aborted: Option<Tid>,
    },
    /// The connections and their state (`weft net ls`).
    List,
}

/// Answers of the proxy.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum NetResponse {
    /// Done.
    Done,
    /// The connections.
    Conns(Vec<ConnInfo>),
    /// TLA's answer to a restart: the server-space position (bytes since
    /// the connection's start, as the server's socket counts them) where
    /// the logger inserts the replayed input.
    ReplayAt(u64),
}

/// One connection as `weft net ls` shows it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConnInfo {
    /// The connection's name (proxy side of the server connection).
    pub conn: ConnName,
    /// The peer's address.
    pub peer: String,
    /// The state.
    pub state: ConnState,
    /// The running transaction.
    pub tx: Option<Tid>,
    /// True once the server's side closed or failed.
    pub server_gone: bool,
    /// Counters and sizes.
    pub stats: ConnStats,
}

/// What the proxy logs.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum NetRecord {
    /// At prepare: the transaction's held output, made durable by the
    /// transaction manager's forced prepare record.
    Prepared {
        /// The transaction.
        tid: Tid,
        /// Its connection.
        conn: ConnName,
        /// The held bytes.
        bytes: Vec<u8>,
    },
    /// After commit: the bytes were handed to the peer's connection.
    Released {
        /// The transaction.
        tid: Tid,
    },
}

/// The proxy→server framing: `[position: u64 LE][length: u32 LE][bytes]`.
pub mod frame {
    /// Header bytes.
    pub const HEADER: usize = 12;
    /// Largest payload of one frame.
    pub const MAX_PAYLOAD: usize = 64 * 1024;

    /// Encodes a frame header.
    pub fn header(pos: u64, len: usize) -> [u8; HEADER] {
        debug_assert!(len <= MAX_PAYLOAD);
        let mut h = [0u8; HEADER];
        h[..8].copy_from_slice(&pos.to_le_bytes());
        h[8..].copy_from_slice(&(len as u32).to_le_bytes());
        h
    }

    /// Decodes a header: position and length.
    ///
    /// Fails when the length is past [`MAX_PAYLOAD`].
    pub fn parse(h: &[u8; HEADER]) -> Result<(u64, usize), String> {
        let pos = u64::from_le_bytes(h[..8].try_into().expect("8 bytes"));
        let len = u32::from_le_bytes(h[8..].try_into().expect("4 bytes")) as usize;
        if len > MAX_PAYLOAD {
            return Err(format!("a {len}-byte frame (at most {MAX_PAYLOAD})"));
        }
        Ok((pos, len))
    }
}
