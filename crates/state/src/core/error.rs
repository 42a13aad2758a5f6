//! The shared-state layer's typed errors and their wire statuses.
//!
//! Owns the mapping from every failure of the core to one [`Status`]; must
//! never lose the precise reason (the variant carries it for logs and CLIs).

use weft_wire::status::Status;

/// Every way a shared-state operation can fail.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum StateError {
    /// A type descriptor is malformed or over a limit.
    #[error("bad type descriptor: {0}")]
    BadType(String),
    /// A block, record or field name is malformed.
    #[error("bad name {0:?}")]
    BadName(String),
    /// A URL or MIP does not parse.
    #[error("bad address {0:?}")]
    BadAddress(String),
    /// The block never existed in this segment.
    #[error("no block {0} in the segment")]
    NoSuchBlock(String),
    /// The block existed and was freed; MIPs to it dangle.
    #[error("block {0} was freed")]
    BlockFreed(u32),
    /// The offset is past the end of the block.
    #[error("offset {offset} is past the end of block {block} ({units} units)")]
    OffsetOutOfRange {
        /// The block's serial.
        block: u32,
        /// The offset asked for.
        offset: u64,
        /// The block's size in units.
        units: u64,
    },
    /// A native type does not match the block's stored descriptor.
    #[error("type mismatch: block holds {stored}, asked for {asked}")]
    TypeMismatch {
        /// The stored descriptor, rendered.
        stored: String,
        /// The asked-for descriptor, rendered.
        asked: String,
    },
    /// A block name is already in use.
    #[error("block name {0:?} is already in use")]
    NameInUse(String),
    /// A diff or image is malformed or does not fit the segment; nothing applied.
    #[error("malformed diff: {0}")]
    BadDiff(String),
    /// A diff's base version is not the segment's version; nothing applied.
    #[error("diff is based on version {base}, the segment is at {have}")]
    VersionMismatch {
        /// The diff's base.
        base: u64,
        /// The segment's version.
        have: u64,
    },
    /// A segment, block-count or diff-size limit would be exceeded.
    #[error("limit exceeded: {0}")]
    LimitExceeded(String),
    /// A bytes form (wire or disk) does not decode or fails its checksum.
    #[error("undecodable {0}")]
    Decode(String),
    /// Two processes of one transaction hold incompatible locks (TMT case 1).
    #[error("segment {0} is locked incompatibly by another process of this transaction")]
    TxLockClash(String),
    /// The cached copy of a segment was made from a version of another segment
    /// older than the one already in use (cross-segment check, section 2.3).
    #[error("cross-segment inconsistency: {0}")]
    Inconsistent(String),
}

impl StateError {
    /// The wire status this error is reported with.
    pub fn status(&self) -> Status {
        match self {
            StateError::BadType(_)
            | StateError::BadName(_)
            | StateError::BadDiff(_)
            | StateError::Decode(_) => Status::BadRequest,
            StateError::BadAddress(_)
            | StateError::NoSuchBlock(_)
            | StateError::BlockFreed(_)
            | StateError::OffsetOutOfRange { .. } => Status::AddrError,
            StateError::TypeMismatch { .. }
            | StateError::VersionMismatch { .. }
            | StateError::Inconsistent(_) => Status::Mismatch,
            StateError::NameInUse(_) => Status::Refused,
            StateError::LimitExceeded(_) => Status::TooLarge,
            StateError::TxLockClash(_) => Status::Aborted,
        }
    }
}
