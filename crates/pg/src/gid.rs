//! The global transaction identifiers weft gives PostgreSQL, and the log record that remembers
//! them.
//!
//! Owns the GID format `weft:<tid>:n<node>:<database>` (e.g. `weft:t3.1.1042:n2:bank`): the weft
//! prefix and the transaction first (issue 3), then the node whose branch it is — so two weft
//! nodes sharing a database never collide and each resolves only its own — then the database,
//! because PostgreSQL's GIDs are unique across all databases of a server. Must never produce a
//! GID that does not parse back to the same parts, nor one longer than PostgreSQL accepts.

use std::fmt;

use serde::{Deserialize, Serialize};
use weft_log::RecordTag;
use weft_wire::{NodeId, Tid};

/// Every GID weft prepares starts with this.
pub const GID_PREFIX: &str = "weft:";

/// The longest GID PostgreSQL keeps (its `GIDSIZE` is 200 bytes with the terminating NUL).
pub const MAX_GID_BYTES: usize = 199;

/// The longest database name PostgreSQL keeps (`NAMEDATALEN` - 1).
pub const MAX_DATABASE_BYTES: usize = 63;

/// The log tag of [`PgRecord`]s.
pub const PG_RECORD_TAG: RecordTag = RecordTag(0x0300);

/// What the PostgreSQL participant writes to the node's log.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum PgRecord {
    /// This node's branch `gid` is prepared in PostgreSQL (appended after `PREPARE TRANSACTION`
    /// succeeded, before the transaction manager forces its prepare record, which covers it).
    Prepared {
        /// The GID, as printed by [`Gid`]'s `Display`.
        gid: String,
    },
}

/// The identity of one weft branch in PostgreSQL: transaction, node, database.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Gid {
    tid: Tid,
    node: NodeId,
    database: String,
}

impl Gid {
    /// The GID of `node`'s branch of `tid` in `database`.
    ///
    /// Returns `None` when `database` is empty, longer than [`MAX_DATABASE_BYTES`] or contains
    /// NUL (no PostgreSQL database has such a name).
    pub fn new(tid: Tid, node: NodeId, database: &str) -> Option<Gid> {
        if !valid_database(database) {
            return None;
        }
        let gid = Gid {
            tid,
            node,
            database: database.to_string(),
        };
        debug_assert!(gid.to_string().len() <= MAX_GID_BYTES, "{gid} is too long");
        Some(gid)
    }

    /// Parses a GID written by [`Gid`]'s `Display`; `None` for anything else (GIDs of other
    /// programs, malformed weft GIDs).
    pub fn parse(text: &str) -> Option<Gid> {
        let rest = text.strip_prefix(GID_PREFIX)?;
        let mut parts = rest.splitn(3, ':');
        let tid: Tid = parts.next()?.parse().ok()?;
        let node: u32 = parts.next()?.strip_prefix('n')?.parse().ok()?;
        let gid = Gid::new(tid, NodeId(node), parts.next()?)?;
        // Reject non-canonical spellings ("n02"): one branch, one GID.
        (gid.to_string() == text).then_some(gid)
    }

    /// The transaction.
    pub fn tid(&self) -> Tid {
        self.tid
    }

    /// The node whose branch this is.
    pub fn node(&self) -> NodeId {
        self.node
    }

    /// The database the branch ran in.
    pub fn database(&self) -> &str {
        &self.database
    }

    /// The GID as a SQL string literal (`'weft:t3.1.1042:n2:bank'`, quotes doubled).
    pub(crate) fn literal(&self) -> String {
        format!("'{}'", self.to_string().replace('\'', "''"))
    }
}

impl fmt::Display for Gid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{GID_PREFIX}{}:n{}:{}",
            self.tid, self.node.0, self.database
        )
    }
}

impl fmt::Debug for Gid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

/// Whether PostgreSQL could have a database called `name`.
pub(crate) fn valid_database(name: &str) -> bool {
    !name.is_empty() && name.len() <= MAX_DATABASE_BYTES && !name.contains('\0')
}

#[cfg(test)]
mod tests {
    use weft_wire::Incarnation;

    use super::*;

    fn tid(seq: u64) -> Tid {
        Tid::new(NodeId(3), Incarnation(1), seq)
    }

    #[test]
    fn prints_the_documented_format_and_parses_back() {
        let gid = Gid::new(tid(1042), NodeId(2), "bank").unwrap();
        assert_eq!(gid.to_string(), "weft:t3.1.1042:n2:bank");
        assert_eq!(Gid::parse("weft:t3.1.1042:n2:bank"), Some(gid.clone()));
        assert_eq!(gid.literal(), "'weft:t3.1.1042:n2:bank'");
        // Colons and quotes in a database name survive.
        let odd = Gid::new(tid(1), NodeId(7), "a:b'c").unwrap();
        assert_eq!(Gid::parse(&odd.to_string()), Some(odd.clone()));
        assert_eq!(odd.literal(), "'weft:t3.1.1:n7:a:b''c'");
    }

    #[test]
    fn the_longest_gid_fits_in_postgres() {
        let max = Tid::new(NodeId(u32::MAX), Incarnation(u32::MAX), u64::MAX);
        let gid = Gid::new(max, NodeId(u32::MAX), &"d".repeat(MAX_DATABASE_BYTES)).unwrap();
        assert!(
            gid.to_string().len() <= MAX_GID_BYTES,
            "{}",
            gid.to_string().len()
        );
    }

    #[test]
    fn rejects_what_weft_does_not_write() {
        for text in [
            "",
            "weft:",
            "weft:t3.1.1042",
            "weft:t3.1.1042:n2",
            "weft:t3.1.1042:n2:",
            "weft:t3.1.1042:2:bank",
            "weft:t3.1.1042:n02:bank",
            "weft:x:n2:bank",
            "other:t3.1.1042:n2:bank",
            "WEFT:t3.1.1042:n2:bank",
        ] {
            assert_eq!(Gid::parse(text), None, "{text:?}");
        }
        assert_eq!(Gid::new(tid(1), NodeId(1), ""), None);
        assert_eq!(Gid::new(tid(1), NodeId(1), "a\0b"), None);
        assert_eq!(Gid::new(tid(1), NodeId(1), &"d".repeat(64)), None);
    }
}
