//! Naming: the cluster directory ("the oracle" in Raid) and its messages.
//!
//! One node serves as the directory (the embedded default: the node started
//! without `--join`). Others join it; it pushes joins, changes and orderly
//! leaves to every member, which caches them as routes. Owns the message
//! vocabulary and the directory's admission rule. Must never carry a death
//! verdict: liveness is each node's own failure detector's, about its own
//! links (docs/membership.md).

use serde::{Deserialize, Serialize};
use weft_wire::{Incarnation, NodeId, Status};

/// What a node tells the cluster about itself.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeInfo {
    /// Node id.
    pub id: NodeId,
    /// Current incarnation.
    pub incarnation: Incarnation,
    /// TCP address others can reach it at, if it listens.
    pub addr: Option<String>,
    /// Host identity (same string for processes on one machine).
    pub host: String,
    /// Id of its in-process hub (nodes with the same hub id share a process).
    pub hub: Option<u64>,
    /// Shared-memory rendezvous, when it accepts same-host shm links.
    pub shm: Option<String>,
    /// OS process id.
    pub pid: u32,
    /// Names of the services it offers.
    pub services: Vec<String>,
    /// True for the node serving as the directory.
    pub directory: bool,
}

/// Naming protocol messages (port [`weft_wire::Port::NAMING`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum NamingMsg {
    /// Member → directory: admit me.
    Join {
        /// The joiner's information.
        info: NodeInfo,
    },
    /// Directory → joiner: admitted; here is the cluster. Also directory →
    /// member it heard from again after believing it dead: the view it may
    /// have missed.
    Welcome {
        /// The directory's node id.
        directory: NodeId,
        /// Every member, the joiner included (no liveness: each node judges
        /// that over its own links).
        members: Vec<NodeInfo>,
    },
    /// Directory → joiner: not admitted.
    JoinRefused {
        /// Why.
        status: Status,
        /// Explanation.
        reason: String,
    },
    /// Non-directory member → joiner: ask the directory instead.
    Redirect {
        /// The directory.
        directory: NodeInfo,
    },
    /// Directory → members: a member joined or its information changed.
    /// Member → directory: my information changed (services).
    Update {
        /// The member's information.
        info: NodeInfo,
    },
    /// Directory → members (or a leaving directory → members): a member
    /// left in an orderly way. Receivers ignore any `cause` but Ok: deaths
    /// are never broadcast.
    Left {
        /// The member.
        node: NodeId,
        /// Its incarnation.
        incarnation: Incarnation,
        /// Ok (an orderly leave).
        cause: Status,
    },
    /// Member → directory: I am leaving.
    Leave {
        /// The member.
        node: NodeId,
        /// Its incarnation.
        incarnation: Incarnation,
    },
}

/// The directory's admission rule for a joiner whose id is already taken.
///
/// A live member with the same id somewhere else (another address, or for
/// nodes without one another in-process hub) is a configuration error
/// (Refused); otherwise the joiner is that member restarted (a new process at
/// the same place, hence a new hub), and replaces it.
pub(crate) fn admission(
    existing: Option<(&NodeInfo, bool)>,
    joiner: &NodeInfo,
) -> Result<(), String> {
    let Some((old, alive)) = existing else {
        return Ok(());
    };
    let same_place = match (&old.addr, &joiner.addr) {
        (Some(a), Some(b)) => a == b,
        _ => old.hub == joiner.hub,
    };
    if alive && old.incarnation != joiner.incarnation && !same_place {
        return Err(format!(
            "node id {} is in use by a live node at {}",
            joiner.id,
            old.addr
                .clone()
                .unwrap_or_else(|| format!("hub {:?}", old.hub))
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(id: u32, inc: u32, addr: &str) -> NodeInfo {
        NodeInfo {
            id: NodeId(id),
            incarnation: Incarnation(inc),
            addr: Some(addr.into()),
            host: "h".into(),
            hub: None,
            shm: None,
            pid: 1,
            services: vec![],
            directory: false,
        }
    }

    #[test]
    fn duplicate_ids_are_refused_restarts_are_not() {
        let old = info(3, 1, "a:1");
        assert!(admission(None, &info(3, 1, "a:1")).is_ok());
        assert!(
            admission(Some((&old, true)), &info(3, 2, "a:1")).is_ok(),
            "restart"
        );
        assert!(
            admission(Some((&old, false)), &info(3, 2, "b:1")).is_ok(),
            "dead id reused"
        );
        assert!(
            admission(Some((&old, true)), &info(3, 2, "b:1")).is_err(),
            "live clash"
        );
        assert!(
            admission(Some((&old, true)), &info(3, 1, "a:1")).is_ok(),
            "re-join"
        );
    }
}
