//! The log's error type.
//!
//! Owns: every way a log operation can fail, as one typed enum. Must never: hide an I/O error
//! behind a success (a failed fdatasync poisons the log, see [`LogError::Poisoned`]).

use std::io;
use std::path::PathBuf;

use crate::lsn::Lsn;

/// Everything that can go wrong in the log manager.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LogError {
    /// An operating-system call failed. `context` says what the log was doing.
    #[error("log I/O error while {context}: {source}")]
    Io {
        /// What the log was doing (e.g. "creating segment 0000000000001000.wlog").
        context: String,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// A record's payload is longer than the configured `max_record_size`.
    #[error("record of {len} bytes exceeds the maximum record size of {max} bytes")]
    RecordTooLarge {
        /// The payload length that was offered.
        len: usize,
        /// The configured limit.
        max: usize,
    },
    /// On-disk state that recovery cannot accept without losing data that must not be lost
    /// (e.g. the segment holding the log start is missing or its header is unreadable).
    /// A merely torn or corrupt *tail* is not an error: it is cut off and reported in
    /// [`Recovered`](crate::Recovered).
    #[error("log corrupt at {lsn}: {reason}")]
    Corrupt {
        /// Where the problem was found.
        lsn: Lsn,
        /// What is wrong.
        reason: String,
    },
    /// The log was closed; no more records can be appended or forced.
    #[error("log is closed")]
    Closed,
    /// An earlier write or fdatasync failed. The state of the file after such a failure is
    /// unknown (the kernel may have dropped the dirty pages), so the log refuses all further
    /// appends and forces; the process must reopen the log, which runs recovery.
    #[error("log is poisoned by an earlier I/O failure: {reason}")]
    Poisoned {
        /// The failure that poisoned the log.
        reason: String,
    },
    /// The in-memory buffer of records not yet handed to the flusher is full. Force (or wait)
    /// and retry; this is backpressure, not a failure of the log.
    #[error("log buffer full: {buffered} bytes buffered, limit {limit}")]
    BufferFull {
        /// Bytes currently buffered.
        buffered: usize,
        /// The configured `max_buffered_bytes`.
        limit: usize,
    },
    /// A force or wait named an LSN beyond the last record appended, which would never
    /// become durable.
    #[error("{lsn} was never appended (last appended record is {last})")]
    NotAppended {
        /// The LSN asked for.
        lsn: Lsn,
        /// The last appended record's LSN.
        last: Lsn,
    },
    /// `truncate_before` was asked to drop records that are not yet durable.
    #[error("cannot truncate before {lsn}: only records before {durable_end} are durable")]
    NotDurable {
        /// The LSN asked for.
        lsn: Lsn,
        /// The end of the durable prefix of the log.
        durable_end: Lsn,
    },
    /// Another `Log` (in this or another process) already has this directory open.
    #[error("log directory {dir} is locked by another log instance")]
    Locked {
        /// The directory.
        dir: PathBuf,
    },
    /// The configuration is inconsistent (e.g. a segment cannot hold a maximum-size record).
    #[error("invalid log configuration: {0}")]
    InvalidConfig(String),
}

impl LogError {
    /// Builds an [`LogError::Io`] from a context description and an I/O error.
    pub(crate) fn io(context: impl Into<String>, source: io::Error) -> LogError {
        LogError::Io {
            context: context.into(),
            source,
        }
    }
}

/// `Result` with [`LogError`] as the error type.
pub type Result<T, E = LogError> = std::result::Result<T, E>;
