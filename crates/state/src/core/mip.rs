//! Segment URLs and machine-independent pointers (MIPs).
//!
//! Owns the text forms `weft://<node>/<path>` and
//! `weft://<node>/<path>#<block>#<offset>`, where `<block>` is a block serial
//! (digits) or a block name, and `<offset>` counts primitive units from the
//! block's start. Must never resolve anything: turning a MIP into a local
//! reference is [`super::segment::Segment::resolve`]'s job, which reports
//! freed or missing blocks.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use super::error::StateError;

/// Longest URL or MIP text accepted.
pub const MAX_URL_BYTES: usize = 512;

/// The name of a segment: its home node and a path there.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Debug, Serialize, Deserialize)]
pub struct SegUrl {
    /// The home node (a node id or a host name: whatever the runtime resolves).
    pub node: String,
    /// The path on the home node (`/`-separated, no `#`).
    pub path: String,
}

/// Which block a MIP names.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Debug, Serialize, Deserialize)]
pub enum BlockRef {
    /// By serial number (never reused within a segment).
    Serial(u32),
    /// By name.
    Name(String),
}

impl fmt::Display for BlockRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BlockRef::Serial(n) => write!(f, "{n}"),
            BlockRef::Name(s) => f.write_str(s),
        }
    }
}

/// A machine-independent pointer to one unit of one block of one segment.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Debug, Serialize, Deserialize)]
pub struct Mip {
    /// The segment.
    pub seg: SegUrl,
    /// The block.
    pub block: BlockRef,
    /// Offset in primitive units from the block's start.
    pub offset: u64,
}

fn bad(s: &str) -> StateError {
    StateError::BadAddress(s.chars().take(80).collect())
}

fn valid_part(p: &str) -> bool {
    !p.is_empty()
        && p.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-' | ':' | '/'))
}

impl FromStr for SegUrl {
    type Err = StateError;

    /// Parses `weft://node/path`. Fails with [`StateError::BadAddress`].
    fn from_str(s: &str) -> Result<Self, StateError> {
        if s.len() > MAX_URL_BYTES {
            return Err(bad(s));
        }
        let rest = s.strip_prefix("weft://").ok_or_else(|| bad(s))?;
        let (node, path) = rest.split_once('/').ok_or_else(|| bad(s))?;
        if !valid_part(node)
            || node.contains('/')
            || !valid_part(path)
            || path.contains("//")
            || path.ends_with('/')
        {
            return Err(bad(s));
        }
        Ok(SegUrl {
            node: node.to_string(),
            path: path.to_string(),
        })
    }
}

impl fmt::Display for SegUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "weft://{}/{}", self.node, self.path)
    }
}

impl FromStr for Mip {
    type Err = StateError;

    /// Parses `weft://node/path#block#offset`. Fails with [`StateError::BadAddress`].
    fn from_str(s: &str) -> Result<Self, StateError> {
        let mut parts = s.splitn(3, '#');
        let url = parts.next().ok_or_else(|| bad(s))?;
        let block = parts.next().ok_or_else(|| bad(s))?;
        let offset = parts.next().ok_or_else(|| bad(s))?;
        let seg: SegUrl = url.parse()?;
        let block = if !block.is_empty() && block.bytes().all(|b| b.is_ascii_digit()) {
            BlockRef::Serial(block.parse().map_err(|_| bad(s))?)
        } else {
            super::types::check_name(block, &Default::default()).map_err(|_| bad(s))?;
            BlockRef::Name(block.to_string())
        };
        if offset.is_empty() || !offset.bytes().all(|b| b.is_ascii_digit()) {
            return Err(bad(s));
        }
        let offset = offset.parse().map_err(|_| bad(s))?;
        Ok(Mip { seg, block, offset })
    }
}

impl fmt::Display for Mip {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}#{}#{}", self.seg, self.block, self.offset)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mips_round_trip_through_text() {
        for s in [
            "weft://n1/a/b#3#0",
            "weft://127.0.0.1:7000/grid#cells#1024",
            "weft://7/x#_t.m-2#18446744073709551615",
        ] {
            let m: Mip = s.parse().unwrap();
            assert_eq!(m.to_string(), s);
        }
        let m: Mip = "weft://n1/a#12#5".parse().unwrap();
        assert_eq!(m.block, BlockRef::Serial(12));
        assert_eq!(m.seg.path, "a");
    }

    #[test]
    fn malformed_addresses_get_bad_address() {
        for s in [
            "",
            "http://n/a#1#1",
            "weft://n#1#1",
            "weft:///a#1#1",
            "weft://n/a#1",
            "weft://n/a#1#-1",
            "weft://n/a##1",
            "weft://n/a#1#x",
            "weft://n/a#1#99999999999999999999999",
            "weft://n/a#9x#1",
            "weft://n/a/#1#1",
            "weft://n/a b#1#1",
        ] {
            assert!(
                matches!(s.parse::<Mip>(), Err(StateError::BadAddress(_))),
                "{s}"
            );
        }
        let long = format!("weft://n/{}", "a".repeat(600));
        assert!(long.parse::<SegUrl>().is_err());
    }
}
