//! Commit-protocol messages (port [`weft_wire::Port::TX`]) and log records.
//!
//! Owns the vocabulary of the transaction manager on the wire and on disk.
//! Must never carry resource-manager data: resources log their own records.

use serde::{Deserialize, Serialize};
use weft_wire::{Incarnation, NodeId, Status, SubPath, Tid};

/// A participant's answer to PREPARE.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Vote {
    /// Cannot commit; the reason travels to the coordinator.
    No(String),
    /// Changed nothing: leaves the protocol now and writes nothing.
    ReadOnly,
    /// Ready to commit. `durable` when the subtree holds durable state (a
    /// prepare record was forced); volatile-only subtrees need the outcome
    /// but wrote nothing.
    Yes {
        /// True when a prepare record was forced below.
        durable: bool,
    },
}

impl Vote {
    /// Combines two votes of one subtree: No wins, then Yes (durable if
    /// either is), then ReadOnly.
    pub fn and(self, other: Vote) -> Vote {
        match (self, other) {
            (Vote::No(r), _) | (_, Vote::No(r)) => Vote::No(r),
            (Vote::Yes { durable: a }, Vote::Yes { durable: b }) => Vote::Yes { durable: a || b },
            (y @ Vote::Yes { .. }, Vote::ReadOnly) | (Vote::ReadOnly, y @ Vote::Yes { .. }) => y,
            (Vote::ReadOnly, Vote::ReadOnly) => Vote::ReadOnly,
        }
    }
}

/// How a transaction ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Outcome {
    /// Committed.
    Committed,
    /// Aborted.
    Aborted,
}

/// The answer to an inquiry about a transaction.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Answer {
    /// The transaction committed.
    Committed,
    /// The transaction aborted, or the node has no record of it (presumed
    /// abort).
    Aborted,
    /// The node is itself waiting for the outcome; ask again later.
    Pending,
}

/// Transaction-manager messages between nodes.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum TxMsg {
    /// Phase one: prepare your branch and subtree. `incarnation` is the
    /// receiver's incarnation the sender saw when it called it: a receiver
    /// that restarted since then has lost its branch and votes No.
    Prepare {
        /// The transaction.
        tid: Tid,
        /// The receiver's incarnation as seen by the sender.
        incarnation: Incarnation,
        /// Sub-transactions that aborted (their effects must not commit).
        aborted_subs: Vec<SubPath>,
        /// Sent by a coordinator with no durable state of its own to its
        /// only child: the receiver may decide the outcome itself (force a
        /// commit record instead of a prepare record, commit, and send the
        /// decision up as `Decision`), or vote as usual.
        one_phase: bool,
    },
    /// The answer to Prepare.
    Vote {
        /// The transaction.
        tid: Tid,
        /// The vote.
        vote: Vote,
    },
    /// Phase two: the outcome.
    Decision {
        /// The transaction.
        tid: Tid,
        /// True to commit, false to abort.
        commit: bool,
    },
    /// Phase two is complete below the sender (sent for commits only:
    /// presumed abort needs no acknowledgement of aborts).
    Ack {
        /// The transaction.
        tid: Tid,
    },
    /// Termination notification: the transaction aborted (sent up and down
    /// the tree by whichever node aborted it; never acknowledged).
    Abort {
        /// The transaction.
        tid: Tid,
        /// The cause as a status (TimedOut for the deadline, HostDead or
        /// ProcDead when a node died, Aborted otherwise), so that every node
        /// reports the same cause.
        status: Status,
        /// Why.
        reason: String,
    },
    /// An in-doubt participant asks for the outcome.
    Inquire {
        /// The transaction.
        tid: Tid,
    },
    /// The answer to Inquire.
    Outcome {
        /// The transaction.
        tid: Tid,
        /// What the answering node knows.
        answer: Answer,
    },
    /// A node reached by a client (not through the tree) asks the
    /// coordinator to adopt it as a child.
    Enlist {
        /// The transaction.
        tid: Tid,
        /// Correlates the reply.
        request: u64,
    },
    /// The coordinator's answer to Enlist.
    Enlisted {
        /// The transaction.
        tid: Tid,
        /// Correlation id of the Enlist.
        request: u64,
        /// False when the transaction is unknown or no longer active.
        ok: bool,
    },
    /// A sub-transaction ended: sent down the part of the tree it reached.
    SubEnded {
        /// The transaction.
        tid: Tid,
        /// The sub-transaction.
        path: SubPath,
        /// True when it committed into its parent, false when it aborted.
        committed: bool,
    },
    /// A participant's vote that holds only if the named transactions,
    /// which have the same coordinator and whose writes it used, commit:
    /// the coordinator decides only after its log holds their commit
    /// records (and aborts when one aborted, sending the voter that one's
    /// abort as well as its own).
    VoteAfter {
        /// The transaction.
        tid: Tid,
        /// The vote.
        vote: Vote,
        /// Transactions that must commit first, at the same coordinator.
        after: Vec<Tid>,
    },
}

impl TxMsg {
    /// The transaction the message is about.
    pub fn tid(&self) -> Tid {
        match self {
            TxMsg::Prepare { tid, .. }
            | TxMsg::Vote { tid, .. }
            | TxMsg::VoteAfter { tid, .. }
            | TxMsg::Decision { tid, .. }
            | TxMsg::Ack { tid }
            | TxMsg::Abort { tid, .. }
            | TxMsg::Inquire { tid }
            | TxMsg::Outcome { tid, .. }
            | TxMsg::Enlist { tid, .. }
            | TxMsg::Enlisted { tid, .. }
            | TxMsg::SubEnded { tid, .. } => *tid,
        }
    }
}

/// Log records written by the transaction manager (tag [`TM_RECORD_TAG`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum TmRecord {
    /// A participant voted Yes: forced before the vote leaves.
    Prepared {
        /// The transaction.
        tid: Tid,
        /// The node the vote went to (asked on recovery).
        parent: NodeId,
        /// Children that voted Yes (told the outcome on recovery).
        children: Vec<(NodeId, Incarnation)>,
    },
    /// The outcome is commit: forced by the coordinator before phase two
    /// (the decision record), written lazily by participants.
    Committed {
        /// The transaction.
        tid: Tid,
        /// Children that voted Yes and must hear the outcome.
        children: Vec<(NodeId, Incarnation)>,
    },
    /// The outcome is abort (written lazily, never forced).
    Aborted {
        /// The transaction.
        tid: Tid,
    },
    /// Every child acknowledged the commit: the transaction can be forgotten.
    End {
        /// The transaction.
        tid: Tid,
    },
}

/// The log tag of transaction-manager records.
pub const TM_RECORD_TAG: weft_log::RecordTag = weft_log::RecordTag(1);
