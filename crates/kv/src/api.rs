//! The KV service's requests, responses and log records.
//!
//! Owns the vocabulary clients and the log see. Must never hold state.

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use weft_wire::Tid;

/// One operation on the store.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Op {
    /// Read a key (shared lock). Answers [`Reply::Value`].
    Get(Bytes),
    /// Write a key (exclusive lock). Answers [`Reply::Done`].
    Put(Bytes, Bytes),
    /// Delete a key (exclusive lock). Answers [`Reply::Done`].
    Delete(Bytes),
    /// Add `delta` to the signed 64-bit integer stored at the key (absent
    /// counts as 0) under one exclusive lock. Answers [`Reply::Number`] with
    /// the new value; BadRequest if the value is not an 8-byte integer.
    Add(Bytes, i64),
    /// Keys in `[start, end)` in order, at most `limit` (shared lock on every
    /// key returned). Answers [`Reply::Rows`].
    Scan {
        /// First key (inclusive).
        start: Bytes,
        /// Bound (exclusive); empty means no bound.
        end: Bytes,
        /// Most rows returned.
        limit: u32,
    },
}

/// A request: operations applied in order within the caller's transaction.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvRequest(pub Vec<Op>);

/// The answer to one operation.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Reply {
    /// The value read, if the key exists.
    Value(Option<Bytes>),
    /// Written.
    Done,
    /// The integer after an Add.
    Number(i64),
    /// Scanned rows.
    Rows(Vec<(Bytes, Bytes)>),
}

/// The answers, one per operation.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvResponse(pub Vec<Reply>);

/// Encodes an integer value as stored by [`Op::Add`].
pub fn int_value(v: i64) -> Bytes {
    Bytes::copy_from_slice(&v.to_le_bytes())
}

/// Decodes an integer value; `None` when the bytes are not 8 long.
pub fn parse_int(b: &[u8]) -> Option<i64> {
    <[u8; 8]>::try_from(b).ok().map(i64::from_le_bytes)
}

/// A write in a write set: the new value, or `None` for a delete.
pub type Write = (Bytes, Option<Bytes>);

/// The KV store's log records (tag [`KV_RECORD_TAG`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum KvRecord {
    /// The write set of a prepared branch: redone at recovery if the
    /// transaction committed.
    Prepared {
        /// The transaction.
        tid: Tid,
        /// Final value of every key written (None: deleted).
        writes: Vec<Write>,
    },
}

/// The log tag of KV records.
pub const KV_RECORD_TAG: weft_log::RecordTag = weft_log::RecordTag(0x0200);

impl KvRecord {
    /// Appends the prepare record of `tid`'s write set to `log` (not forced:
    /// the transaction manager forces before the vote) and returns its LSN.
    /// The one way a prepared write set reaches the log, for the KV service
    /// and for drivers of the store such as the simulator.
    ///
    /// Fails with the log's error, as text (the vote's reason).
    pub fn append_prepared(log: &weft_log::Log, tid: Tid, writes: &[Write]) -> Result<u64, String> {
        let rec = KvRecord::Prepared {
            tid,
            writes: writes.to_vec(),
        };
        let bytes = postcard::to_allocvec(&rec).map_err(|e| e.to_string())?;
        log.append(KV_RECORD_TAG, &bytes)
            .map(|l| l.get())
            .map_err(|e| e.to_string())
    }
}
