//! The control stream between a server and its logger, shared by 2CA and
//! TLA: the paper's TX_START / TX_RESTART / TX_COMMIT / TX_ABORT become
//! calls to the logger's `net` service inside the server's transaction
//! (which makes the logger a two-phase participant) and weft's own commit
//! protocol.
//!
//! Owns the control messages ([`NetRequest`], [`NetResponse`]) and the
//! logger's log records ([`NetRecord`]); the server's side of the stream
//! ([`stream::ControlStream`]: positions, the running transaction, the
//! per-transaction write bound, resynchronisation after an abort); and the
//! logger's side that does not depend on how bytes reach it
//! ([`logger`]: waiting for the previous transaction's outcome at
//! TX_START, the prepare vote and its log record, the released record,
//! recovery's list of output that could not be delivered). Must never let a
//! logger vote yes before every server byte of the transaction reached it
//! and was logged, nor let a server tell its logger a position it has not
//! reached.

pub mod logger;
pub(crate) mod stream;

use serde::{Deserialize, Serialize};
use weft_wire::Tid;

use crate::core::{ConnState, ConnStats};

/// The name the logger's service registers under.
pub const SERVICE: &str = "net";

/// The logger's log records' tag.
pub const NET_RECORD_TAG: weft_log::RecordTag = weft_log::RecordTag(0x0400);

/// A connection at the logger: for 2CA the proxy's local address of its
/// connection to the server (the address the server sees as its peer), for
/// TLA the peer's address.
pub type ConnName = String;

/// Control messages from the server to its logger (calls to `net@<logger>`).
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
        /// its abort may not have reached the logger yet (the logger applies
        /// it first: the server coordinates it, its word is final).
        aborted: Option<Tid>,
        /// TX_RESTART: re-execute the aborted transaction; the logger sends
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
        /// have reached the logger yet.
        aborted: Option<Tid>,
    },
    /// The connections and their state (`weft net ls`).
    List,
}

/// Answers of the logger.
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
    /// The connection's name.
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

/// What the logger logs.
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
