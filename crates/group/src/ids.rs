//! Identifiers of the group layer: members (processes that receive), senders
//! (processes that send), communications and tags.
//!
//! Owns their printable forms. Must never do I/O: identifiers are plain
//! values.

use std::fmt;

use serde::{Deserialize, Serialize};
use weft_wire::{Incarnation, NodeId};

pub(crate) use weft_wire::{IdMap, IdSet};

/// A message tag for selective receives (T-Shoshin's `mtag`). `Tag(0)` is
/// the tag of untagged sends.
#[derive(
    Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, Default, Debug,
)]
pub struct Tag(pub u32);

impl fmt::Display for Tag {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "#{}", self.0)
    }
}

/// A receiving process: a member handle living at `node`. Printed
/// `m<id>@<node>`. Member 0 of every node is the node itself, the member of
/// the `tx:<tid>` groups it participates in.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct MemberId {
    /// The node hosting the member.
    pub node: NodeId,
    /// The member's number at that node.
    pub id: u64,
}

impl MemberId {
    /// True for the node itself (member of its transaction groups).
    pub fn is_node(&self) -> bool {
        self.id == 0
    }
}

impl fmt::Display for MemberId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "m{}@{}", self.id, self.node)
    }
}

impl fmt::Debug for MemberId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

/// A sending process: a sender handle living at `node` in one incarnation.
/// Printed `s<id>@<node>`.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct SenderId {
    /// The node hosting the sender.
    pub node: NodeId,
    /// That node's incarnation.
    pub incarnation: Incarnation,
    /// The sender's number at that node.
    pub id: u64,
}

impl fmt::Display for SenderId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "s{}@{}", self.id, self.node)
    }
}

impl fmt::Debug for SenderId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

/// One group communication: a sender and a session number. Session numbers
/// grow at the sender's node, so a later send by the same sender to the same
/// group has a larger session and supersedes the earlier one (T-Shoshin's
/// session numbers). Printed `s<id>@<node>/<session>`.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct CommId {
    /// Who sent.
    pub sender: SenderId,
    /// The session number.
    pub session: u64,
}

impl CommId {
    /// The node of the sender (where replies are buffered).
    pub fn origin(&self) -> NodeId {
        self.sender.node
    }
}

impl fmt::Display for CommId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.sender, self.session)
    }
}

impl fmt::Debug for CommId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn printable() {
        let s = SenderId {
            node: NodeId(2),
            incarnation: Incarnation(1),
            id: 7,
        };
        assert_eq!(s.to_string(), "s7@2");
        assert_eq!(
            CommId {
                sender: s,
                session: 9
            }
            .to_string(),
            "s7@2/9"
        );
        assert_eq!(
            MemberId {
                node: NodeId(3),
                id: 4
            }
            .to_string(),
            "m4@3"
        );
        assert_eq!(Tag(5).to_string(), "#5");
    }
}
