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
    /// [`TxMsg::Prepare`] with the sender's trace context: sent instead of
    /// it only by a node that traces the transaction (the `otel` feature
    /// with a tracing layer that records the transaction manager's spans),
    /// so that the receiver's prepare and outcome work joins the trace.
    /// Handled exactly as Prepare otherwise. docs/tracing.md.
    TracedPrepare {
        /// The transaction.
        tid: Tid,
        /// The receiver's incarnation as seen by the sender.
        incarnation: Incarnation,
        /// Sub-transactions that aborted (their effects must not commit).
        aborted_subs: Vec<SubPath>,
        /// The span the receiver's spans of this transaction are children of.
        trace: TraceParent,
    },
    /// A Prepare that hands the decision to its receiver: sent by a
    /// coordinator with no durable state of its own to its only child, which
    /// may decide the outcome itself (force a commit record instead of a
    /// prepare record, commit, and send the decision up as `Decision`) or
    /// vote as usual. Its fields and encoding are the Prepare's.
    DelegatedPrepare {
        /// The transaction.
        tid: Tid,
        /// The receiver's incarnation as seen by the sender.
        incarnation: Incarnation,
        /// Sub-transactions that aborted (their effects must not commit).
        aborted_subs: Vec<SubPath>,
    },
}

/// A W3C trace context (`traceparent`) in binary: the span that a message's
/// receiver makes the parent of its own spans. 25 bytes on the wire.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct TraceParent {
    /// The trace id (16 raw bytes, big-endian as in the hex text; never all zero).
    pub trace_id: [u8; 16],
    /// The parent span's id (8 raw bytes; never all zero).
    pub span_id: [u8; 8],
    /// The trace flags (bit 0: sampled).
    pub flags: u8,
}

impl TxMsg {
    /// The transaction the message is about.
    pub fn tid(&self) -> Tid {
        match self {
            TxMsg::Prepare { tid, .. }
            | TxMsg::TracedPrepare { tid, .. }
            | TxMsg::DelegatedPrepare { tid, .. }
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

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn arb_tid() -> impl Strategy<Value = Tid> {
        (any::<u32>(), any::<u32>(), any::<u64>()).prop_map(|(n, i, seq)| Tid {
            node: NodeId(n),
            incarnation: Incarnation(i),
            seq,
        })
    }

    fn arb_subs() -> impl Strategy<Value = Vec<SubPath>> {
        prop::collection::vec(
            prop::collection::vec(any::<u32>(), 0..4).prop_map(SubPath),
            0..3,
        )
    }

    fn arb_vote() -> impl Strategy<Value = Vote> {
        prop_oneof![
            ".{0,8}".prop_map(Vote::No),
            Just(Vote::ReadOnly),
            any::<bool>().prop_map(|durable| Vote::Yes { durable }),
        ]
    }

    fn arb_msg() -> impl Strategy<Value = TxMsg> {
        prop_oneof![
            (arb_tid(), any::<u32>(), arb_subs()).prop_map(|(tid, i, aborted_subs)| {
                TxMsg::Prepare {
                    tid,
                    incarnation: Incarnation(i),
                    aborted_subs,
                }
            }),
            (arb_tid(), arb_vote()).prop_map(|(tid, vote)| TxMsg::Vote { tid, vote }),
            (arb_tid(), any::<bool>()).prop_map(|(tid, commit)| TxMsg::Decision { tid, commit }),
            arb_tid().prop_map(|tid| TxMsg::Ack { tid }),
            (arb_tid(), any::<u16>(), ".{0,8}").prop_map(|(tid, c, reason)| TxMsg::Abort {
                tid,
                status: Status::from_code(c),
                reason,
            }),
            (
                arb_tid(),
                arb_vote(),
                prop::collection::vec(arb_tid(), 0..3)
            )
                .prop_map(|(tid, vote, after)| TxMsg::VoteAfter { tid, vote, after }),
            (arb_tid(), any::<u32>(), arb_subs()).prop_map(|(tid, i, aborted_subs)| {
                TxMsg::DelegatedPrepare {
                    tid,
                    incarnation: Incarnation(i),
                    aborted_subs,
                }
            }),
            (
                arb_tid(),
                any::<u32>(),
                arb_subs(),
                any::<[u8; 16]>(),
                any::<[u8; 8]>(),
                any::<u8>()
            )
                .prop_map(|(tid, i, aborted_subs, trace_id, span_id, flags)| {
                    TxMsg::TracedPrepare {
                        tid,
                        incarnation: Incarnation(i),
                        aborted_subs,
                        trace: TraceParent {
                            trace_id,
                            span_id,
                            flags,
                        },
                    }
                }),
        ]
    }

    proptest! {
        /// Every message decodes to itself; a TracedPrepare is its Prepare's
        /// encoding with another variant index and 25 bytes of trace context
        /// after it; every strict prefix of an encoding is refused.
        #[test]
        fn messages_round_trip(msg in arb_msg()) {
            let bytes = postcard::to_allocvec(&msg).unwrap();
            prop_assert_eq!(postcard::from_bytes::<TxMsg>(&bytes).unwrap(), msg.clone());
            for cut in 0..bytes.len() {
                prop_assert!(postcard::from_bytes::<TxMsg>(&bytes[..cut]).is_err());
            }
            if let TxMsg::TracedPrepare { tid, incarnation, aborted_subs, trace } = msg {
                let plain = postcard::to_allocvec(&TxMsg::Prepare { tid, incarnation, aborted_subs }).unwrap();
                prop_assert_eq!(plain[0], 0);
                prop_assert_eq!(bytes[0], 11);
                prop_assert_eq!(&bytes[1..plain.len()], &plain[1..]);
                prop_assert_eq!(&bytes[plain.len()..plain.len() + 16], &trace.trace_id[..]);
                prop_assert_eq!(&bytes[plain.len() + 16..plain.len() + 24], &trace.span_id[..]);
                prop_assert_eq!(bytes[plain.len() + 24], trace.flags);
                prop_assert_eq!(bytes.len(), plain.len() + 25);
            }
        }
    }

    fn t1_1_5() -> Tid {
        Tid {
            node: NodeId(1),
            incarnation: Incarnation(1),
            seq: 5,
        }
    }

    /// The encodings docs/wire.md §11 gives: a Prepare as every earlier
    /// version sends it still decodes, and the TracedPrepare example is
    /// byte-exact.
    #[test]
    fn the_documented_encodings_hold() {
        let prepare = TxMsg::Prepare {
            tid: t1_1_5(),
            incarnation: Incarnation(2),
            aborted_subs: vec![SubPath(vec![1])],
        };
        let old = [0x00, 0x01, 0x01, 0x05, 0x02, 0x01, 0x01, 0x01];
        assert_eq!(postcard::from_bytes::<TxMsg>(&old).unwrap(), prepare);
        assert_eq!(postcard::to_allocvec(&prepare).unwrap(), old);
        let traced = TxMsg::TracedPrepare {
            tid: t1_1_5(),
            incarnation: Incarnation(2),
            aborted_subs: vec![],
            trace: TraceParent {
                trace_id: [
                    0x0a, 0xf7, 0x65, 0x19, 0x16, 0xcd, 0x43, 0xdd, 0x84, 0x48, 0xeb, 0x21, 0x1c,
                    0x80, 0x31, 0x9c,
                ],
                span_id: [0xb7, 0xad, 0x6b, 0x71, 0x69, 0x20, 0x33, 0x31],
                flags: 1,
            },
        };
        let golden = [
            0x0b, 0x01, 0x01, 0x05, 0x02, 0x00, // variant 11, tid, incarnation, no subs
            0x0a, 0xf7, 0x65, 0x19, 0x16, 0xcd, 0x43, 0xdd, 0x84, 0x48, 0xeb, 0x21, 0x1c, 0x80,
            0x31, 0x9c, // trace id
            0xb7, 0xad, 0x6b, 0x71, 0x69, 0x20, 0x33, 0x31, // span id
            0x01, // flags
        ];
        assert_eq!(postcard::to_allocvec(&traced).unwrap(), golden);
        assert_eq!(postcard::from_bytes::<TxMsg>(&golden).unwrap(), traced);
        let delegated = TxMsg::DelegatedPrepare {
            tid: t1_1_5(),
            incarnation: Incarnation(2),
            aborted_subs: vec![SubPath(vec![1])],
        };
        let mut golden = old;
        golden[0] = 0x0c; // the Prepare's bytes under variant 12
        assert_eq!(postcard::to_allocvec(&delegated).unwrap(), golden);
        assert_eq!(postcard::from_bytes::<TxMsg>(&golden).unwrap(), delegated);
        // A variant past the last is refused, never mistaken for another.
        let mut unknown = golden;
        unknown[0] = 13;
        assert!(postcard::from_bytes::<TxMsg>(&unknown).is_err());
    }
}
