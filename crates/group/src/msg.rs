//! The group protocol's messages (port [`weft_wire::Port::GROUP`]) and the
//! body type that carries a group message without serializing it when it
//! stays in one process.
//!
//! Owns the vocabulary between nodes: the directory protocol, delivery and
//! counts, replies, termination and probes, and the transaction fan-out.
//! Must never hold a group secret: only salts, check values and derived keys.

use std::fmt;
use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use parking_lot::Mutex;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use weft_wire::{Failure, GroupId, Incarnation, NodeId, Payload, Status, Tid};

use crate::ids::{CommId, MemberId, Tag};
use crate::secret::{GroupKey, Verifier};

/// A group message body as it travels between nodes. A local value for a
/// destination in this process moves without being serialized (it is encoded
/// only if a frame leaves the process); its retransmissions share the same
/// slot, so whichever copy arrives first takes the value, and a copy that
/// finds the slot empty knows the value already arrived.
pub enum Body {
    /// Bytes (shared by every copy), or a local value sent once.
    Payload(Payload),
    /// A local value in a slot shared by a message and its retransmissions.
    Shared(Arc<Mutex<Option<Payload>>>),
    /// No value: a copy whose value was taken by an earlier one.
    Elided,
}

impl Body {
    /// A body for `payload`: bytes as they are, a local value in a shared
    /// slot (so retransmissions can still carry it).
    pub fn moved(payload: Payload) -> Body {
        match payload {
            Payload::Bytes(b) => Body::Payload(Payload::Bytes(b)),
            local => Body::Shared(Arc::new(Mutex::new(Some(local)))),
        }
    }

    /// Takes the payload out (`None` when an earlier copy took it).
    pub fn into_payload(self) -> Option<Payload> {
        match self {
            Body::Payload(p) => Some(p),
            Body::Shared(slot) => slot.lock().take(),
            Body::Elided => None,
        }
    }

    /// Size in bytes when known without encoding (bytes payloads).
    pub fn known_len(&self) -> Option<usize> {
        match self {
            Body::Payload(Payload::Bytes(b)) => Some(b.len()),
            _ => None,
        }
    }
}

impl Clone for Body {
    /// Bytes and slots are shared; a bare local value cannot be copied
    /// without encoding, so its clone is `Elided`.
    fn clone(&self) -> Self {
        match self {
            Body::Payload(Payload::Bytes(b)) => Body::Payload(Payload::Bytes(b.clone())),
            Body::Shared(slot) => Body::Shared(Arc::clone(slot)),
            _ => Body::Elided,
        }
    }
}

impl fmt::Debug for Body {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Body::Payload(p) => write!(f, "{p:?}"),
            Body::Shared(slot) => match &*slot.lock() {
                Some(p) => write!(f, "Shared({p:?})"),
                None => f.write_str("Shared(taken)"),
            },
            Body::Elided => f.write_str("Elided"),
        }
    }
}

#[derive(Serialize, Deserialize)]
enum WireBody {
    Elided,
    Bytes(Bytes),
}

impl Serialize for Body {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let encode = |p: &Payload| -> Result<Bytes, S::Error> {
            let mut out = BytesMut::new();
            p.write_to(&mut out).map_err(serde::ser::Error::custom)?;
            Ok(out.freeze())
        };
        match self {
            Body::Elided => WireBody::Elided.serialize(s),
            Body::Payload(Payload::Bytes(b)) => WireBody::Bytes(b.clone()).serialize(s),
            Body::Payload(p) => WireBody::Bytes(encode(p)?).serialize(s),
            Body::Shared(slot) => {
                let bytes = match &*slot.lock() {
                    Some(p) => Some(encode(p)?),
                    None => None,
                };
                match bytes {
                    Some(b) => WireBody::Bytes(b).serialize(s),
                    None => WireBody::Elided.serialize(s),
                }
            }
        }
    }
}

impl<'de> Deserialize<'de> for Body {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Ok(match WireBody::deserialize(d)? {
            WireBody::Elided => Body::Elided,
            WireBody::Bytes(b) => Body::Payload(Payload::Bytes(b)),
        })
    }
}

/// A shared group id travels as the id itself.
mod shared_gid {
    use std::sync::Arc;

    use serde::{Deserialize, Deserializer, Serialize, Serializer};
    use weft_wire::GroupId;

    pub fn serialize<S: Serializer>(gid: &Arc<GroupId>, s: S) -> Result<S::Ok, S::Error> {
        gid.as_ref().serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Arc<GroupId>, D::Error> {
        GroupId::deserialize(d).map(Arc::new)
    }
}

/// Batches do not nest. Decoding recurses once per level of nesting, and a
/// level costs a peer two bytes, so a message of nested batches within the
/// message size limit would overflow the stack of the thread decoding it
/// (a tokio worker) and kill the node. Senders only batch messages that are
/// not batches themselves, so a batch met while decoding a batch is refused.
mod flat_batch {
    use std::cell::Cell;

    use serde::{de::Error as _, Deserialize, Deserializer};

    use super::GroupMsg;

    thread_local! {
        /// True while this thread decodes the messages of a batch.
        static IN_BATCH: Cell<bool> = const { Cell::new(false) };
    }

    /// Clears [`IN_BATCH`] however the batch's decoding ends.
    struct Leave;

    impl Drop for Leave {
        fn drop(&mut self) {
            IN_BATCH.set(false);
        }
    }

    /// Decodes a batch's messages; fails when already inside a batch.
    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<GroupMsg>, D::Error> {
        if IN_BATCH.get() {
            return Err(D::Error::custom("a batch inside a batch"));
        }
        IN_BATCH.set(true);
        let _leave = Leave;
        Vec::<GroupMsg>::deserialize(d)
    }
}

/// Orders table changes: the directory's incarnation, then a counter. A
/// restarted directory's changes win over everything its predecessor said.
#[derive(
    Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, Debug, Default,
)]
pub struct Version {
    /// The directory's incarnation.
    pub epoch: Incarnation,
    /// Change counter within that incarnation.
    pub counter: u64,
}

/// One group as the directory describes it to every node.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GroupRecord {
    /// The group.
    pub gid: GroupId,
    /// Salt and check value of its secret.
    pub verifier: Verifier,
    /// Nodes hosting at least one member.
    pub hosts: Vec<NodeId>,
    /// When this record was last changed.
    pub version: Version,
}

/// A change of the group table pushed by the directory.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Change {
    /// A group was created or its hosts changed.
    Upsert(GroupRecord),
    /// A group was destroyed.
    Remove {
        /// The group.
        gid: GroupId,
        /// When.
        version: Version,
    },
}

/// Operations a node asks of the directory.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum DirOp {
    /// Create `gid` with this verifier (Refused when it exists).
    Create {
        /// The group.
        gid: GroupId,
        /// Its secret's verifier.
        verifier: Verifier,
    },
    /// Create a group with a fresh name in `class`.
    CreateUnique {
        /// The class.
        class: String,
        /// The new group's secret's verifier.
        verifier: Verifier,
    },
    /// Destroy `gid`; `key` proves the secret.
    Destroy {
        /// The group.
        gid: GroupId,
        /// Derived from the secret.
        key: GroupKey,
    },
    /// The sending node starts (`present`) or stops hosting members of
    /// `gid`. `seq` orders a node's hosting changes; `key` proves the secret
    /// when starting.
    Host {
        /// The group.
        gid: GroupId,
        /// Hosting or not.
        present: bool,
        /// Per-node order of hosting changes: the node's incarnation in the
        /// high 32 bits (`core::directory::hosting_seq_base`), so that a
        /// restarted node's changes order after its earlier incarnations'.
        seq: u64,
        /// Proof of the secret, when `present`.
        key: Option<GroupKey>,
    },
    /// Describe one group.
    Lookup {
        /// The group.
        gid: GroupId,
    },
    /// List every group.
    List,
    /// A node (re)introduces itself: every group it hosts and every record
    /// it has cached (a restarted directory rebuilds its table from these).
    Sync {
        /// Groups the node hosts (or is registering), with the sequence
        /// number of its last hosting change for each.
        hosting: Vec<(GroupId, u64)>,
        /// The node's latest hosting sequence number when it wrote this:
        /// a hosting change the directory applied with a larger number
        /// happened after, and this message does not undo it.
        seq: u64,
        /// The node's cached table.
        known: Vec<GroupRecord>,
    },
}

/// The directory's answers.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum DirAnswer {
    /// Done.
    Done,
    /// A group was allocated by `CreateUnique`.
    Allocated(GroupId),
    /// One group.
    Record(GroupRecord),
    /// Every group.
    List(Vec<GroupRecord>),
    /// The whole table (answer to `Sync`), as of version `at`.
    Snapshot {
        /// Every group.
        records: Vec<GroupRecord>,
        /// The directory's latest version when the snapshot was taken.
        at: Version,
    },
}

/// Messages of the group protocol.
#[derive(Debug, Serialize, Deserialize)]
pub enum GroupMsg {
    /// Node → directory.
    DirRequest {
        /// Correlation id at the requesting node.
        req: u64,
        /// What to do.
        op: DirOp,
    },
    /// Directory → node.
    DirReply {
        /// The request answered.
        req: u64,
        /// The outcome.
        result: Result<DirAnswer, Failure>,
    },
    /// Directory → every node: apply these changes and acknowledge.
    Push {
        /// Correlation id at the directory.
        push: u64,
        /// The changes.
        changes: Vec<Change>,
    },
    /// Node → directory.
    PushAck {
        /// The push acknowledged.
        push: u64,
    },
    /// Sender's node → member node: queue this message for your members of
    /// `gid` and tell me how many you reached.
    Deliver {
        /// The communication.
        comm: CommId,
        /// The group (shared by the copies for every node, their
        /// retransmissions and the members' queue entries).
        #[serde(with = "shared_gid")]
        gid: Arc<GroupId>,
        /// The tag.
        tag: Tag,
        /// The message.
        body: Body,
    },
    /// A node's delivery count for a communication: `counts` members queued
    /// per node (one entry for a named group; one per participant reached
    /// for a transaction group), `full` members whose queue was full, `lost`
    /// nodes that could not be reached.
    Ack {
        /// The communication.
        comm: CommId,
        /// Members reached, per node.
        counts: Vec<(NodeId, u32)>,
        /// Members not reached because their queue was full.
        full: u32,
        /// Nodes not reached, and why.
        lost: Vec<(NodeId, Status)>,
    },
    /// Sender's node → member nodes: these communications are over
    /// (wanted replies arrived, replies set to 0, superseded, sender gone).
    Terminate {
        /// The communications.
        comms: Vec<CommId>,
    },
    /// Member node → sender's node: a member's reply.
    Reply {
        /// Correlation id at the member's node.
        reply: u64,
        /// The communication.
        comm: CommId,
        /// The replying member.
        member: MemberId,
        /// The reply.
        body: Body,
    },
    /// Sender's node → member node: the reply was buffered (Ok) or refused
    /// (NoComm, NoBuffer).
    ReplyAck {
        /// The reply answered.
        reply: u64,
        /// The outcome.
        status: Status,
    },
    /// Member node → sender's node: these members received the message but
    /// will never reply (dropped: ProcDead; left; group destroyed).
    Lost {
        /// Correlation id at the member's node.
        lost: u64,
        /// The communication.
        comm: CommId,
        /// The members.
        members: Vec<MemberId>,
        /// Why.
        status: Status,
    },
    /// Sender's node → member node.
    LostAck {
        /// The report acknowledged.
        lost: u64,
    },
    /// Member node → sender's node: do these communications still live?
    Probe {
        /// The communications asked about.
        comms: Vec<CommId>,
    },
    /// Sender's node → member node: these are over.
    ProbeAck {
        /// The communications that ended.
        dead: Vec<CommId>,
    },
    /// Transaction multicast, hop by hop along the participant tree.
    TxDeliver {
        /// The communication (its id also deduplicates the fan-out).
        comm: CommId,
        /// The transaction.
        tid: Tid,
        /// The tag.
        tag: Tag,
        /// The message.
        body: Body,
        /// True when sent by the sender's node to the root of the fan-out,
        /// which answers with an [`GroupMsg::Ack`] instead of a
        /// [`GroupMsg::TxAck`].
        root: bool,
        /// Milliseconds left for the whole fan-out.
        budget_ms: u32,
    },
    /// Several messages to one node, sent together (a delivery count with
    /// the replies made at once, acknowledgements, terminations). The
    /// receiver takes the counts first. Batches do not nest: a batch inside
    /// a batch is refused when decoded (see `flat_batch` in this file).
    #[serde(deserialize_with = "flat_batch::deserialize")]
    Batch(Vec<GroupMsg>),
    /// Directory → a node it hears from again after declaring it dead:
    /// introduce yourself again (`Sync`); the pushes sent while the link was
    /// down were lost, and hosting changes the node made meanwhile may not
    /// have reached the directory.
    Resync,
    /// A fan-out subtree's outcome, to the node that forwarded the message.
    TxAck {
        /// The communication.
        comm: CommId,
        /// Nodes of the subtree that queued the message.
        delivered: Vec<NodeId>,
        /// Nodes whose queue was full.
        full: u32,
        /// Neighbours that could not be reached, and why.
        lost: Vec<(NodeId, Status)>,
    },
}

impl GroupMsg {
    /// A copy for retransmission: bytes bodies are shared, moved local values
    /// become `Elided`.
    pub fn retransmission(&self) -> GroupMsg {
        match self {
            GroupMsg::DirRequest { req, op } => GroupMsg::DirRequest {
                req: *req,
                op: op.clone(),
            },
            GroupMsg::DirReply { req, result } => GroupMsg::DirReply {
                req: *req,
                result: result.clone(),
            },
            GroupMsg::Push { push, changes } => GroupMsg::Push {
                push: *push,
                changes: changes.clone(),
            },
            GroupMsg::PushAck { push } => GroupMsg::PushAck { push: *push },
            GroupMsg::Deliver {
                comm,
                gid,
                tag,
                body,
            } => GroupMsg::Deliver {
                comm: *comm,
                gid: gid.clone(),
                tag: *tag,
                body: body.clone(),
            },
            GroupMsg::Ack {
                comm,
                counts,
                full,
                lost,
            } => GroupMsg::Ack {
                comm: *comm,
                counts: counts.clone(),
                full: *full,
                lost: lost.clone(),
            },
            GroupMsg::Terminate { comms } => GroupMsg::Terminate {
                comms: comms.clone(),
            },
            GroupMsg::Reply {
                reply,
                comm,
                member,
                body,
            } => GroupMsg::Reply {
                reply: *reply,
                comm: *comm,
                member: *member,
                body: body.clone(),
            },
            GroupMsg::ReplyAck { reply, status } => GroupMsg::ReplyAck {
                reply: *reply,
                status: *status,
            },
            GroupMsg::Lost {
                lost,
                comm,
                members,
                status,
            } => GroupMsg::Lost {
                lost: *lost,
                comm: *comm,
                members: members.clone(),
                status: *status,
            },
            GroupMsg::LostAck { lost } => GroupMsg::LostAck { lost: *lost },
            GroupMsg::Probe { comms } => GroupMsg::Probe {
                comms: comms.clone(),
            },
            GroupMsg::ProbeAck { dead } => GroupMsg::ProbeAck { dead: dead.clone() },
            GroupMsg::TxDeliver {
                comm,
                tid,
                tag,
                body,
                root,
                budget_ms,
            } => GroupMsg::TxDeliver {
                comm: *comm,
                tid: *tid,
                tag: *tag,
                body: body.clone(),
                root: *root,
                budget_ms: *budget_ms,
            },
            GroupMsg::Resync => GroupMsg::Resync,
            GroupMsg::Batch(v) => GroupMsg::Batch(v.iter().map(|m| m.retransmission()).collect()),
            GroupMsg::TxAck {
                comm,
                delivered,
                full,
                lost,
            } => GroupMsg::TxAck {
                comm: *comm,
                delivered: delivered.clone(),
                full: *full,
                lost: lost.clone(),
            },
        }
    }

    /// A short name for traces.
    pub fn kind(&self) -> &'static str {
        match self {
            GroupMsg::DirRequest { .. } => "DirRequest",
            GroupMsg::DirReply { .. } => "DirReply",
            GroupMsg::Push { .. } => "Push",
            GroupMsg::PushAck { .. } => "PushAck",
            GroupMsg::Deliver { .. } => "Deliver",
            GroupMsg::Ack { .. } => "Ack",
            GroupMsg::Terminate { .. } => "Terminate",
            GroupMsg::Reply { .. } => "Reply",
            GroupMsg::ReplyAck { .. } => "ReplyAck",
            GroupMsg::Lost { .. } => "Lost",
            GroupMsg::LostAck { .. } => "LostAck",
            GroupMsg::Probe { .. } => "Probe",
            GroupMsg::ProbeAck { .. } => "ProbeAck",
            GroupMsg::TxDeliver { .. } => "TxDeliver",
            GroupMsg::Resync => "Resync",
            GroupMsg::Batch(_) => "Batch",
            GroupMsg::TxAck { .. } => "TxAck",
        }
    }

    /// True when handling the message may need to know the directory node:
    /// everything but the messages of communications (deliveries, counts,
    /// replies, terminations, lost members, probes), which never look.
    pub fn needs_directory(&self) -> bool {
        match self {
            GroupMsg::Deliver { .. }
            | GroupMsg::Ack { .. }
            | GroupMsg::Reply { .. }
            | GroupMsg::ReplyAck { .. }
            | GroupMsg::Terminate { .. }
            | GroupMsg::Lost { .. }
            | GroupMsg::LostAck { .. }
            | GroupMsg::Probe { .. }
            | GroupMsg::ProbeAck { .. } => false,
            GroupMsg::Batch(v) => v.iter().any(|m| m.needs_directory()),
            _ => true,
        }
    }

    /// True when handling the message needs the list of live nodes (the
    /// directory pushes changes to every node).
    pub fn needs_cluster(&self) -> bool {
        match self {
            GroupMsg::DirRequest { .. } => true,
            GroupMsg::Batch(v) => v.iter().any(|m| m.needs_cluster()),
            _ => false,
        }
    }

    /// True for delivery counts (a sender may be blocked on them).
    pub fn is_count(&self) -> bool {
        matches!(self, GroupMsg::Ack { .. } | GroupMsg::TxAck { .. })
    }

    /// True for messages that may wait a moment to travel with others to
    /// the same node: delivery counts (they wait only for the members they
    /// woke to have their turn, and leave with the replies those made at
    /// once: one write instead of two, which is what a busy machine saves
    /// most), replies (several members of one node usually answer the same
    /// send together), acknowledgements and terminations.
    pub fn deferrable(&self) -> bool {
        matches!(
            self,
            GroupMsg::Ack { .. }
                | GroupMsg::Reply { .. }
                | GroupMsg::ReplyAck { .. }
                | GroupMsg::LostAck { .. }
                | GroupMsg::PushAck { .. }
                | GroupMsg::ProbeAck { .. }
                | GroupMsg::Terminate { .. }
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use weft_wire::payload::{decode_postcard, encode_postcard};

    /// Found by the `group_msg` fuzz target's rule: a peer's message of nested batches
    /// (two bytes a level) made the decoder recurse once per level and overflow the stack of
    /// the tokio worker decoding it, killing the node. A batch inside a batch is refused.
    #[test]
    fn nested_batches_are_refused_not_a_stack_overflow() {
        const BATCH: u8 = 14; // GroupMsg::Batch's variant index
        const RESYNC: u8 = 15;
        let mut deep = Vec::new();
        for _ in 0..1_000_000 {
            deep.extend_from_slice(&[BATCH, 1]);
        }
        deep.push(RESYNC);
        // On a thread with a tokio worker's stack (2 MiB), as the runtime decodes.
        let got = std::thread::Builder::new()
            .stack_size(2 << 20)
            .spawn(move || decode_postcard::<GroupMsg>(&deep).map(|m| m.kind()))
            .unwrap()
            .join()
            .unwrap();
        got.expect_err("deep nesting must be refused");
        // One level is what senders make, and is fine.
        let one = decode_postcard::<GroupMsg>(&[BATCH, 2, RESYNC, RESYNC]).unwrap();
        assert!(matches!(&one, GroupMsg::Batch(v) if v.len() == 2));
        assert!(decode_postcard::<GroupMsg>(&[BATCH, 1, BATCH, 1, RESYNC]).is_err());
        // A failed decode leaves nothing behind: the next message decodes normally.
        assert!(decode_postcard::<GroupMsg>(&[BATCH, 1, BATCH, 0]).is_err());
        assert!(decode_postcard::<GroupMsg>(&[BATCH, 1, RESYNC]).is_ok());
    }

    #[test]
    fn bodies_encode_local_values_and_bytes_alike() {
        let gid: GroupId = "a:b".parse().unwrap();
        let comm = CommId {
            sender: crate::ids::SenderId {
                node: NodeId(1),
                incarnation: Incarnation(1),
                id: 1,
            },
            session: 1,
        };
        let local = GroupMsg::Deliver {
            comm,
            gid: Arc::new(gid.clone()),
            tag: Tag(3),
            body: Body::Payload(Payload::local("hello".to_string())),
        };
        let mut out = BytesMut::new();
        encode_postcard(&local, &mut out).unwrap();
        let back: GroupMsg = decode_postcard(&out).unwrap();
        let GroupMsg::Deliver { body, tag, .. } = back else {
            panic!("kind changed")
        };
        assert_eq!(tag, Tag(3));
        let p = body.into_payload().unwrap();
        assert!(!p.is_local());
        assert_eq!(p.decode::<String>().unwrap(), "hello");
        // A moved local value shares its slot with its retransmissions:
        // the first copy to arrive takes it.
        let moved = Body::moved(Payload::local(7u32));
        let again = moved.clone();
        assert_eq!(moved.into_payload().unwrap().decode::<u32>().unwrap(), 7);
        assert!(again.into_payload().is_none(), "taken by the first copy");
        let lost = Body::moved(Payload::local(8u32));
        let retransmitted = lost.clone();
        drop(lost); // the first copy was dropped on the way
        assert_eq!(
            retransmitted
                .into_payload()
                .unwrap()
                .decode::<u32>()
                .unwrap(),
            8
        );
        let bytes = Body::moved(Payload::bytes(vec![1u8, 2, 3]));
        assert_eq!(bytes.clone().known_len(), Some(3));
    }
}
