//! The group directory: the authority on which groups exist, their secrets'
//! verifiers and which nodes host members. It lives on the naming directory
//! node (T-Shoshin's group-id server) and pushes every change to all nodes,
//! which cache the table.
//!
//! Its state is soft: a restarted directory rebuilds the table from the
//! caches and hosting lists that nodes send when they see it come back
//! (`Sync`). A node's members leave the table when they end for real (the
//! node left or restarted), never on one node's failure verdict: the
//! directory's lost link to a node says nothing about the node's links to
//! the others. Owns the table's rules (unique ids, secrets, hosting order) and
//! the bookkeeping of pushes waiting for acknowledgements. Must never send
//! anything itself: it returns what to push and what to answer.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

use weft_wire::{Failure, GroupId, Incarnation, NodeId, Status};

use crate::msg::{Change, DirAnswer, DirOp, GroupRecord, Version};
use crate::secret::Verifier;

struct Entry {
    verifier: Verifier,
    hosts: BTreeSet<NodeId>,
    version: Version,
}

/// What handling one request produced.
#[derive(Debug)]
pub struct Outcome {
    /// The answer for the requester.
    pub result: Result<DirAnswer, Failure>,
    /// Table changes to push to every node.
    pub changes: Vec<Change>,
    /// True when the answer must wait until every node acknowledged the
    /// changes (so that, when the requester hears back, every node's cache
    /// already shows the change).
    pub wait: bool,
}

impl Outcome {
    fn answer(result: Result<DirAnswer, Failure>) -> Self {
        Outcome {
            result,
            changes: Vec::new(),
            wait: false,
        }
    }
}

/// The directory's table.
pub struct Directory {
    epoch: Incarnation,
    counter: u64,
    groups: BTreeMap<GroupId, Entry>,
    hosting: HashMap<(NodeId, GroupId), u64>,
    unique: u64,
    max_groups: usize,
}

impl Directory {
    /// An empty table whose versions start in `epoch` (the directory node's
    /// incarnation).
    pub fn new(epoch: Incarnation, max_groups: usize) -> Self {
        Directory {
            epoch,
            counter: 0,
            groups: BTreeMap::new(),
            hosting: HashMap::new(),
            unique: 0,
            max_groups,
        }
    }

    /// The latest version handed out.
    pub fn version(&self) -> Version {
        Version {
            epoch: self.epoch,
            counter: self.counter,
        }
    }

    fn bump(&mut self) -> Version {
        self.counter += 1;
        self.version()
    }

    fn record(gid: &GroupId, e: &Entry) -> GroupRecord {
        GroupRecord {
            gid: gid.clone(),
            verifier: e.verifier,
            hosts: e.hosts.iter().copied().collect(),
            version: e.version,
        }
    }

    fn upsert(&mut self, gid: &GroupId) -> Option<Change> {
        let v = self.bump();
        let e = self.groups.get_mut(gid)?;
        e.version = v;
        Some(Change::Upsert(Self::record(gid, e)))
    }

    /// Number of groups.
    pub fn len(&self) -> usize {
        self.groups.len()
    }

    /// True when there are no groups.
    pub fn is_empty(&self) -> bool {
        self.groups.is_empty()
    }

    /// Every group, sorted.
    pub fn records(&self) -> Vec<GroupRecord> {
        self.groups
            .iter()
            .map(|(g, e)| Self::record(g, e))
            .collect()
    }

    fn create(&mut self, gid: GroupId, verifier: Verifier) -> Outcome {
        if self.groups.contains_key(&gid) {
            return Outcome::answer(Err(Failure::new(
                Status::Refused,
                format!("group {gid} already exists"),
            )));
        }
        if self.groups.len() >= self.max_groups {
            return Outcome::answer(Err(Failure::new(
                Status::NoBuffer,
                format!(
                    "the directory holds its maximum of {} groups",
                    self.max_groups
                ),
            )));
        }
        self.groups.insert(
            gid.clone(),
            Entry {
                verifier,
                hosts: BTreeSet::new(),
                version: Version::default(),
            },
        );
        let change = self.upsert(&gid);
        Outcome {
            result: Ok(DirAnswer::Allocated(gid)),
            changes: change.into_iter().collect(),
            wait: true,
        }
    }

    /// Handles one request from node `from`.
    pub fn handle(&mut self, from: NodeId, op: DirOp) -> Outcome {
        match op {
            DirOp::Create { gid, verifier } => {
                if matches!(gid, GroupId::Tx(_)) {
                    return Outcome::answer(Err(Failure::new(
                        Status::BadRequest,
                        "tx groups exist without being created",
                    )));
                }
                self.create(gid, verifier)
            }
            DirOp::CreateUnique { class, verifier } => loop {
                self.unique += 1;
                let gid = match GroupId::named(&class, &format!("g{}", self.unique)) {
                    Ok(g) => g,
                    Err(e) => {
                        return Outcome::answer(Err(Failure::new(
                            Status::BadRequest,
                            e.to_string(),
                        )))
                    }
                };
                if !self.groups.contains_key(&gid) {
                    return self.create(gid, verifier);
                }
            },
            DirOp::Destroy { gid, key } => {
                let Some(e) = self.groups.get(&gid) else {
                    return Outcome::answer(Err(no_such(&gid)));
                };
                if !e.verifier.verify_key(&key) {
                    return Outcome::answer(Err(wrong_secret(&gid)));
                }
                self.groups.remove(&gid);
                self.hosting.retain(|(_, g), _| *g != gid);
                let version = self.bump();
                Outcome {
                    result: Ok(DirAnswer::Done),
                    changes: vec![Change::Remove { gid, version }],
                    wait: true,
                }
            }
            DirOp::Host {
                gid,
                present,
                seq,
                key,
            } => {
                let Some(e) = self.groups.get_mut(&gid) else {
                    return Outcome::answer(Err(no_such(&gid)));
                };
                if present && !key.is_some_and(|k| e.verifier.verify_key(&k)) {
                    return Outcome::answer(Err(wrong_secret(&gid)));
                }
                let last = self.hosting.entry((from, gid.clone())).or_insert(0);
                if seq <= *last {
                    // An older or repeated change: the newer one decided.
                    return Outcome::answer(Ok(DirAnswer::Done));
                }
                *last = seq;
                let changed = if present {
                    e.hosts.insert(from)
                } else {
                    e.hosts.remove(&from)
                };
                let changes = if changed {
                    self.upsert(&gid).into_iter().collect()
                } else {
                    Vec::new()
                };
                Outcome {
                    result: Ok(DirAnswer::Done),
                    changes,
                    wait: present,
                }
            }
            DirOp::Lookup { gid } => Outcome::answer(
                self.groups
                    .get(&gid)
                    .map(|e| DirAnswer::Record(Self::record(&gid, e)))
                    .ok_or_else(|| no_such(&gid)),
            ),
            DirOp::List => Outcome::answer(Ok(DirAnswer::List(self.records()))),
            DirOp::Sync {
                hosting,
                seq,
                known,
            } => {
                let mut touched = BTreeSet::new();
                // Adopt groups a previous directory created (never ones this
                // incarnation destroyed: those carry this epoch).
                for rec in known {
                    if rec.version.epoch >= self.epoch || self.groups.contains_key(&rec.gid) {
                        continue;
                    }
                    if self.groups.len() >= self.max_groups {
                        break;
                    }
                    // Every host listed, reachable from here or not: a
                    // host's own Sync corrects its entries, and this node's
                    // verdicts end no members (docs/membership.md §3).
                    let hosts = rec.hosts.iter().copied().collect();
                    self.groups.insert(
                        rec.gid.clone(),
                        Entry {
                            verifier: rec.verifier,
                            hosts,
                            version: Version::default(),
                        },
                    );
                    touched.insert(rec.gid);
                }
                // The node's own hosting list is authoritative for it, except
                // for changes it made after writing the list.
                let declared: HashMap<GroupId, u64> = hosting.into_iter().collect();
                for (gid, e) in self.groups.iter_mut() {
                    let key = (from, gid.clone());
                    let last = self.hosting.get(&key).copied();
                    let changed = match declared.get(gid) {
                        Some(&s) if last.is_none_or(|l| s >= l) => {
                            self.hosting.insert(key, s);
                            e.hosts.insert(from)
                        }
                        Some(_) => false,
                        None if last.is_none_or(|l| l <= seq) => {
                            self.hosting.remove(&key);
                            e.hosts.remove(&from)
                        }
                        None => false,
                    };
                    if changed {
                        touched.insert(gid.clone());
                    }
                }
                let changes = touched.iter().filter_map(|g| self.upsert(g)).collect();
                Outcome {
                    result: Ok(DirAnswer::Snapshot {
                        records: self.records(),
                        at: self.version(),
                    }),
                    changes,
                    wait: false,
                }
            }
        }
    }

    /// Drops the members of incarnation `incarnation` of `node` (every
    /// incarnation up to it; all of them when `None`) from every group: that
    /// incarnation left in an orderly way or restarted, so its members are
    /// gone for real. Hosting changes a later incarnation already made stay
    /// (hosting sequence numbers carry the incarnation: see
    /// [`hosting_seq_base`]). Returns the changes to push.
    ///
    /// Never called for a failure detector's verdict: that one node lost
    /// its link to `node` does not end `node`'s members (docs/membership.md).
    pub fn node_gone(&mut self, node: NodeId, incarnation: Option<Incarnation>) -> Vec<Change> {
        let ended = |seq: u64| incarnation.is_none_or(|i| seq >> 32 <= u64::from(i.0));
        let mut touched = Vec::new();
        for (g, e) in self.groups.iter_mut() {
            let key = (node, g.clone());
            // A host adopted from a cache has no sequence number: it can only
            // be from an ended incarnation or one that synced since.
            let gone = self.hosting.get(&key).is_none_or(|s| ended(*s));
            if gone {
                self.hosting.remove(&key);
                if e.hosts.remove(&node) {
                    touched.push(g.clone());
                }
            }
        }
        touched.iter().filter_map(|g| self.upsert(g)).collect()
    }
}

/// The first hosting sequence number of incarnation `inc` of a node: its
/// hosting changes number from here up, so that those of a restarted node
/// order after every change of its previous incarnations, and a late report
/// that an old incarnation ended does not undo them.
pub fn hosting_seq_base(inc: Incarnation) -> u64 {
    u64::from(inc.0) << 32
}

fn no_such(gid: &GroupId) -> Failure {
    Failure::new(Status::NoSuchGroup, format!("no group {gid}"))
}

fn wrong_secret(gid: &GroupId) -> Failure {
    Failure::new(Status::WrongSecret, format!("wrong secret for group {gid}"))
}

/// The answer a push is holding back until every node acknowledged it.
#[derive(Debug)]
pub struct Held {
    /// The requesting node.
    pub to: NodeId,
    /// Its request id.
    pub req: u64,
    /// The answer.
    pub result: Result<DirAnswer, Failure>,
}

struct Pending {
    waiting: BTreeSet<NodeId>,
    held: Option<Held>,
}

/// Most recent answers remembered to repeat them to retransmitted requests.
const MAX_REMEMBERED: usize = 4096;

/// Pushes waiting for acknowledgements, and recent answers (a request
/// whose answer was lost is retransmitted; it must get the same answer, not
/// be executed twice).
#[derive(Default)]
pub struct Pushes {
    next: u64,
    pending: HashMap<u64, Pending>,
    answering: HashSet<(NodeId, u64)>,
    answered: HashMap<(NodeId, u64), Result<DirAnswer, Failure>>,
    answered_order: std::collections::VecDeque<(NodeId, u64)>,
}

impl Pushes {
    /// The answer already given to request `req` of `from`, if remembered.
    pub fn answered(&self, from: NodeId, req: u64) -> Option<&Result<DirAnswer, Failure>> {
        self.answered.get(&(from, req))
    }

    /// Remembers the answer given to request `req` of `from`.
    pub fn remember(&mut self, from: NodeId, req: u64, result: &Result<DirAnswer, Failure>) {
        if self.answered.insert((from, req), result.clone()).is_none() {
            self.answered_order.push_back((from, req));
            if self.answered_order.len() > MAX_REMEMBERED {
                if let Some(old) = self.answered_order.pop_front() {
                    self.answered.remove(&old);
                }
            }
        }
    }

    /// True when a held answer for request `req` of `from` is pending (a
    /// repeated request must not be answered early).
    pub fn is_answering(&self, from: NodeId, req: u64) -> bool {
        self.answering.contains(&(from, req))
    }

    /// Starts a push to `waiting`, holding `held` until all acknowledged.
    /// Returns the push id, and the held answer back when nobody needs to
    /// acknowledge.
    pub fn start(&mut self, waiting: BTreeSet<NodeId>, held: Option<Held>) -> (u64, Option<Held>) {
        self.next += 1;
        let id = self.next;
        if waiting.is_empty() {
            return (id, held);
        }
        if let Some(h) = &held {
            self.answering.insert((h.to, h.req));
        }
        self.pending.insert(id, Pending { waiting, held });
        (id, None)
    }

    fn settle(&mut self, id: u64) -> Option<Held> {
        let done = self.pending.get(&id).is_some_and(|p| p.waiting.is_empty());
        if !done {
            return None;
        }
        let held = self.pending.remove(&id).and_then(|p| p.held);
        if let Some(h) = &held {
            self.answering.remove(&(h.to, h.req));
        }
        held
    }

    /// Records `node`'s acknowledgement (or that it will never come).
    /// Returns the held answer once the last node acknowledged.
    pub fn ack(&mut self, id: u64, node: NodeId) -> Option<Held> {
        self.pending.get_mut(&id)?.waiting.remove(&node);
        self.settle(id)
    }

    /// `node` is gone: stop waiting for it anywhere. Returns the answers
    /// that no longer wait.
    pub fn node_gone(&mut self, node: NodeId) -> Vec<Held> {
        let ids: Vec<u64> = self
            .pending
            .iter_mut()
            .filter_map(|(id, p)| p.waiting.remove(&node).then_some(*id))
            .collect();
        ids.into_iter().filter_map(|id| self.settle(id)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::secret::Verifier;

    fn gid(s: &str) -> GroupId {
        s.parse().unwrap()
    }

    #[test]
    fn create_host_destroy() {
        let mut d = Directory::new(Incarnation(1), 10);
        let v = Verifier::new(b"pw");
        let g = gid("a:b");
        let out = d.handle(
            NodeId(2),
            DirOp::Create {
                gid: g.clone(),
                verifier: v,
            },
        );
        assert!(out.wait && out.result.is_ok() && out.changes.len() == 1);
        let again = d.handle(
            NodeId(3),
            DirOp::Create {
                gid: g.clone(),
                verifier: v,
            },
        );
        assert_eq!(again.result.unwrap_err().status, Status::Refused);
        let wrong = d.handle(
            NodeId(2),
            DirOp::Host {
                gid: g.clone(),
                present: true,
                seq: 1,
                key: Some(v.key_for(b"no")),
            },
        );
        assert_eq!(wrong.result.unwrap_err().status, Status::WrongSecret);
        let host = d.handle(
            NodeId(2),
            DirOp::Host {
                gid: g.clone(),
                present: true,
                seq: 1,
                key: Some(v.key_for(b"pw")),
            },
        );
        assert!(host.wait);
        let Change::Upsert(rec) = &host.changes[0] else {
            panic!()
        };
        assert_eq!(rec.hosts, vec![NodeId(2)]);
        // An older hosting change arriving late is ignored.
        let late = d.handle(
            NodeId(2),
            DirOp::Host {
                gid: g.clone(),
                present: false,
                seq: 1,
                key: None,
            },
        );
        assert!(late.changes.is_empty());
        assert_eq!(d.node_gone(NodeId(2), None).len(), 1);
        let bad = d.handle(
            NodeId(2),
            DirOp::Destroy {
                gid: g.clone(),
                key: v.key_for(b"x"),
            },
        );
        assert_eq!(bad.result.unwrap_err().status, Status::WrongSecret);
        let ok = d.handle(
            NodeId(2),
            DirOp::Destroy {
                gid: g.clone(),
                key: v.key_for(b"pw"),
            },
        );
        assert!(matches!(ok.changes[0], Change::Remove { .. }));
        let gone = d.handle(NodeId(2), DirOp::Lookup { gid: g });
        assert_eq!(gone.result.unwrap_err().status, Status::NoSuchGroup);
    }

    #[test]
    fn limits_and_unique_names() {
        let mut d = Directory::new(Incarnation(1), 2);
        let v = Verifier::new(b"");
        let a = d.handle(
            NodeId(1),
            DirOp::CreateUnique {
                class: "c".into(),
                verifier: v,
            },
        );
        assert_eq!(a.result.unwrap(), DirAnswer::Allocated(gid("c:g1")));
        d.handle(
            NodeId(1),
            DirOp::Create {
                gid: gid("c:g2"),
                verifier: v,
            },
        );
        let full = d.handle(
            NodeId(1),
            DirOp::Create {
                gid: gid("c:x"),
                verifier: v,
            },
        );
        assert_eq!(full.result.unwrap_err().status, Status::NoBuffer);
        let bad = d.handle(
            NodeId(1),
            DirOp::CreateUnique {
                class: "tx".into(),
                verifier: v,
            },
        );
        assert_eq!(bad.result.unwrap_err().status, Status::BadRequest);
    }

    #[test]
    fn a_restarted_directory_adopts_cached_groups() {
        let mut old = Directory::new(Incarnation(1), 10);
        let v = Verifier::new(b"pw");
        old.handle(
            NodeId(2),
            DirOp::Create {
                gid: gid("a:b"),
                verifier: v,
            },
        );
        old.handle(
            NodeId(2),
            DirOp::Host {
                gid: gid("a:b"),
                present: true,
                seq: 1,
                key: Some(v.key_for(b"pw")),
            },
        );
        old.handle(
            NodeId(3),
            DirOp::Host {
                gid: gid("a:b"),
                present: true,
                seq: 1,
                key: Some(v.key_for(b"pw")),
            },
        );
        let cached = old.records();
        let mut new = Directory::new(Incarnation(2), 10);
        let out = new.handle(
            NodeId(2),
            DirOp::Sync {
                hosting: vec![(gid("a:b"), 1)],
                seq: 1,
                known: cached.clone(),
            },
        );
        let DirAnswer::Snapshot { records, at } = out.result.unwrap() else {
            panic!()
        };
        // Node 3 is listed although it has not synced (it may be out of the
        // new directory's reach, not gone).
        assert_eq!(records[0].hosts, vec![NodeId(2), NodeId(3)]);
        assert_eq!(at.epoch, Incarnation(2));
        assert_eq!(records[0].verifier, v);
        // Stale caches from this epoch do not resurrect destroyed groups.
        let mut stale = records.clone();
        stale[0].gid = gid("a:gone");
        let _ = new.handle(
            NodeId(4),
            DirOp::Sync {
                hosting: vec![],
                seq: 0,
                known: stale,
            },
        );
        assert_eq!(new.len(), 1);
        // A sync written before a later hosting change does not undo it.
        let host = DirOp::Host {
            gid: gid("a:b"),
            present: true,
            seq: 3,
            key: Some(v.key_for(b"pw")),
        };
        new.handle(NodeId(5), host);
        let sync = |seq| DirOp::Sync {
            hosting: vec![],
            seq,
            known: vec![],
        };
        let late = new.handle(NodeId(5), sync(2));
        let DirAnswer::Snapshot { records, .. } = late.result.unwrap() else {
            panic!()
        };
        assert_eq!(records[0].hosts, vec![NodeId(2), NodeId(3), NodeId(5)]);
        // A newer one does.
        let newer = new.handle(NodeId(5), sync(4));
        let DirAnswer::Snapshot { records, .. } = newer.result.unwrap() else {
            panic!()
        };
        assert_eq!(records[0].hosts, vec![NodeId(2), NodeId(3)]);
        // Node 3's own Sync is authoritative for it.
        let three = new.handle(NodeId(3), sync(hosting_seq_base(Incarnation(2))));
        let DirAnswer::Snapshot { records, .. } = three.result.unwrap() else {
            panic!()
        };
        assert_eq!(records[0].hosts, vec![NodeId(2)]);
    }

    #[test]
    fn pushes_hold_answers_until_everyone_acked() {
        let mut p = Pushes::default();
        let held = Held {
            to: NodeId(2),
            req: 7,
            result: Ok(DirAnswer::Done),
        };
        let (id, now) = p.start([NodeId(2), NodeId(3)].into_iter().collect(), Some(held));
        assert!(now.is_none());
        assert!(p.is_answering(NodeId(2), 7));
        assert!(p.ack(id, NodeId(2)).is_none());
        assert_eq!(p.node_gone(NodeId(3)).len(), 1);
        assert!(!p.is_answering(NodeId(2), 7));
        let (_, now) = p.start(
            BTreeSet::new(),
            Some(Held {
                to: NodeId(1),
                req: 1,
                result: Ok(DirAnswer::Done),
            }),
        );
        assert!(now.is_some(), "nobody to wait for");
    }
}
