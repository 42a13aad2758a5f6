//! A node's cached copy of the group table, kept current by the directory's
//! pushes so that a send finds the member nodes without a round trip.
//!
//! Owns the rule that a change applies only when it is newer than what the
//! cache holds (pushes can be reordered or repeated), including changes that
//! removed a group. Must never decide anything about a group: the directory
//! does.

use std::collections::{HashMap, VecDeque};

use weft_wire::GroupId;

use crate::msg::{Change, GroupRecord, Version};

/// Most destroyed groups remembered to refuse stale re-creations.
const MAX_TOMBSTONES: usize = 65_536;

/// What applying a change did.
#[derive(Debug, PartialEq, Eq)]
pub enum Applied {
    /// Nothing (the change was older than the cache).
    Stale,
    /// The record was inserted or replaced.
    Upserted,
    /// The group was removed.
    Removed,
}

/// The cached table.
#[derive(Default)]
pub struct Cache {
    records: HashMap<GroupId, GroupRecord>,
    removed: HashMap<GroupId, Version>,
    removed_order: VecDeque<GroupId>,
}

impl Cache {
    /// The record of `gid`, if cached.
    pub fn get(&self, gid: &GroupId) -> Option<&GroupRecord> {
        self.records.get(gid)
    }

    /// Every cached record, sorted by group id.
    pub fn all(&self) -> Vec<GroupRecord> {
        let mut v: Vec<GroupRecord> = self.records.values().cloned().collect();
        v.sort_by(|a, b| a.gid.cmp(&b.gid));
        v
    }

    /// Number of cached groups.
    pub fn len(&self) -> usize {
        self.records.len()
    }

    /// True when nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.records.is_empty()
    }

    fn tombstone(&mut self, gid: GroupId, version: Version) {
        if self.removed.insert(gid.clone(), version).is_none() {
            self.removed_order.push_back(gid);
            if self.removed_order.len() > MAX_TOMBSTONES {
                if let Some(old) = self.removed_order.pop_front() {
                    self.removed.remove(&old);
                }
            }
        }
    }

    /// Applies one change if it is newer than what is cached.
    pub fn apply(&mut self, change: Change) -> Applied {
        match change {
            Change::Upsert(rec) => {
                if self
                    .removed
                    .get(&rec.gid)
                    .is_some_and(|v| *v >= rec.version)
                {
                    return Applied::Stale;
                }
                if self
                    .records
                    .get(&rec.gid)
                    .is_some_and(|old| old.version >= rec.version)
                {
                    return Applied::Stale;
                }
                self.removed.remove(&rec.gid);
                self.records.insert(rec.gid.clone(), rec);
                Applied::Upserted
            }
            Change::Remove { gid, version } => {
                if self.records.get(&gid).is_some_and(|r| r.version > version) {
                    return Applied::Stale;
                }
                let had = self.records.remove(&gid).is_some();
                self.tombstone(gid, version);
                if had {
                    Applied::Removed
                } else {
                    Applied::Stale
                }
            }
        }
    }

    /// Applies a full snapshot taken at `at`: every record in it is applied,
    /// and cached records older than `at` that it does not mention are
    /// dropped (they were destroyed while this node was out of touch).
    /// Returns the dropped groups.
    pub fn apply_snapshot(&mut self, records: Vec<GroupRecord>, at: Version) -> Vec<GroupId> {
        let mut mentioned = std::collections::HashSet::new();
        for r in records {
            mentioned.insert(r.gid.clone());
            self.apply(Change::Upsert(r));
        }
        let stale: Vec<GroupId> = self
            .records
            .iter()
            .filter(|(gid, r)| !mentioned.contains(*gid) && r.version < at)
            .map(|(gid, _)| gid.clone())
            .collect();
        for gid in &stale {
            self.apply(Change::Remove {
                gid: gid.clone(),
                version: at,
            });
        }
        stale
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::secret::Verifier;
    use weft_wire::{Incarnation, NodeId};

    fn rec(name: &str, counter: u64, hosts: &[u32]) -> GroupRecord {
        let gid: GroupId = format!("c:{name}").parse().unwrap();
        GroupRecord {
            verifier: Verifier::with_salt(b"s", [0; 16]),
            gid,
            hosts: hosts.iter().map(|h| NodeId(*h)).collect(),
            version: Version {
                epoch: Incarnation(1),
                counter,
            },
        }
    }

    #[test]
    fn newer_wins_and_removals_stick() {
        let mut c = Cache::default();
        assert_eq!(
            c.apply(Change::Upsert(rec("a", 2, &[1]))),
            Applied::Upserted
        );
        assert_eq!(c.apply(Change::Upsert(rec("a", 1, &[2]))), Applied::Stale);
        assert_eq!(c.get(&rec("a", 0, &[]).gid).unwrap().hosts, vec![NodeId(1)]);
        let gid = rec("a", 0, &[]).gid;
        let v3 = Version {
            epoch: Incarnation(1),
            counter: 3,
        };
        assert_eq!(
            c.apply(Change::Remove {
                gid: gid.clone(),
                version: v3
            }),
            Applied::Removed
        );
        assert_eq!(
            c.apply(Change::Upsert(rec("a", 2, &[1]))),
            Applied::Stale,
            "no resurrection"
        );
        assert_eq!(
            c.apply(Change::Upsert(rec("a", 4, &[1]))),
            Applied::Upserted,
            "re-created"
        );
        // A restarted directory's epoch beats everything.
        let mut newer = rec("a", 0, &[3]);
        newer.version.epoch = Incarnation(2);
        assert_eq!(c.apply(Change::Upsert(newer)), Applied::Upserted);
    }

    #[test]
    fn snapshots_drop_only_older_unmentioned() {
        let mut c = Cache::default();
        c.apply(Change::Upsert(rec("old", 1, &[1])));
        c.apply(Change::Upsert(rec("young", 9, &[1])));
        let at = Version {
            epoch: Incarnation(1),
            counter: 5,
        };
        let dropped = c.apply_snapshot(vec![rec("kept", 4, &[2])], at);
        assert_eq!(dropped, vec![rec("old", 0, &[]).gid]);
        assert!(
            c.get(&rec("young", 0, &[]).gid).is_some(),
            "newer than the snapshot"
        );
        assert!(c.get(&rec("kept", 0, &[]).gid).is_some());
        assert_eq!(c.len(), 2);
    }
}
