//! Log sequence numbers and record tags: the two small vocabulary types of the log.
//!
//! Owns: the meaning of an [`Lsn`] (a byte position in the logical log stream) and of a
//! [`RecordTag`] (an opaque label chosen by a resource manager). Must never: know about files,
//! segments or encodings; those belong to `record` and `segment`.

use std::fmt;

use serde::{Deserialize, Serialize};

/// A log sequence number: the byte offset of a record's start in the logical log stream.
///
/// The logical stream is the concatenation of the used part of every segment, segment headers
/// included, so LSNs grow monotonically across segment rollovers and are unique for the
/// lifetime of a log directory. The very first record of a fresh log has LSN 32 (the size of a
/// segment header); LSNs of records are always multiples of 8. [`Lsn::ZERO`] is never the LSN of
/// a record and stands for "before the first record".
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
#[serde(transparent)]
pub struct Lsn(pub u64);

impl Lsn {
    /// The position before any record; no record has this LSN.
    pub const ZERO: Lsn = Lsn(0);

    /// Wraps a raw byte position. Never fails.
    #[must_use]
    pub const fn new(raw: u64) -> Lsn {
        Lsn(raw)
    }

    /// The raw byte position. Never fails.
    #[must_use]
    pub const fn get(self) -> u64 {
        self.0
    }
}

impl fmt::Display for Lsn {
    /// Prints the LSN as `lsn:` followed by its decimal byte position, e.g. `lsn:32`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "lsn:{}", self.0)
    }
}

impl From<u64> for Lsn {
    fn from(raw: u64) -> Lsn {
        Lsn(raw)
    }
}

impl From<Lsn> for u64 {
    fn from(lsn: Lsn) -> u64 {
        lsn.0
    }
}

/// Identifies which resource manager wrote a record and what kind of record it is.
///
/// The log never interprets a tag; it stores it beside the payload and hands it back on
/// recovery so each resource manager can pick out its own records. Allocating tag values is the
/// job of the crates that write records (e.g. the transaction manager owns a range).
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
#[serde(transparent)]
pub struct RecordTag(pub u16);

impl fmt::Display for RecordTag {
    /// Prints the tag as `tag:` followed by its hexadecimal value, e.g. `tag:0x0101`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "tag:{:#06x}", self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lsn_orders_prints_and_serializes_as_a_number() {
        assert!(Lsn::ZERO < Lsn(32));
        assert_eq!(Lsn(32).to_string(), "lsn:32");
        assert_eq!(serde_json::to_string(&Lsn(4096)).unwrap(), "4096");
        assert_eq!(serde_json::from_str::<Lsn>("4096").unwrap(), Lsn(4096));
        assert_eq!(RecordTag(0x101).to_string(), "tag:0x0101");
        assert_eq!(u64::from(Lsn::new(7)), 7);
    }
}
