//! The transaction metadata table (InterWeave section 3.2).
//!
//! Owns the per-transaction record of shared state that travels in the
//! transaction context's baggage (key [`BAGGAGE_KEY`]) on every call and
//! return: per segment, the lock the transaction holds at the home, which
//! process is using it now, the master version it was locked at, the latest
//! (possibly tentative) version, and where each uncommitted diff lives. It
//! decides the four lock cases and merges a callee's table into the caller's.
//!
//! Must never hold diff contents (only where they are), and never grow past
//! [`MAX_TMT_SEGMENTS`] segments or [`MAX_DIFFS_PER_SEGMENT`] diffs each.

use serde::{Deserialize, Serialize};
use weft_wire::ids::SubPath;

use super::error::StateError;
use super::mip::SegUrl;

/// The baggage key the TMT travels under.
pub const BAGGAGE_KEY: &str = "state.tmt";
/// Most segments one transaction may lock.
pub const MAX_TMT_SEGMENTS: usize = 64;
/// Most uncommitted diffs recorded per segment.
pub const MAX_DIFFS_PER_SEGMENT: usize = 256;
/// Longest encoded TMT accepted.
pub const MAX_TMT_BYTES: usize = 64 * 1024;

/// A segment lock mode.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug, Serialize, Deserialize)]
pub enum LockMode {
    /// Shared.
    Read,
    /// Exclusive (needed to allocate, free or modify).
    Write,
}

/// Where one uncommitted diff lives: it takes the segment to `target` and is
/// held by process `at` (a node name the runtime can call) under the
/// identifier `id`, written in sub-transaction `sub`.
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct DiffLoc {
    /// The version the diff produces.
    pub target: u64,
    /// The process holding it.
    pub at: String,
    /// Its identifier (unique: a version number can be reused after a
    /// sub-transaction aborts, an identifier never is).
    pub id: u64,
    /// The (sub-)transaction that wrote it.
    pub sub: SubPath,
}

/// What the transaction knows about one segment.
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct TmtEntry {
    /// The segment.
    pub url: SegUrl,
    /// The lock the transaction holds at the home.
    pub mode: LockMode,
    /// The process using the segment now (inside its lock critical section),
    /// with the mode it uses; `None` between critical sections.
    pub active: Option<(String, LockMode)>,
    /// The master version when the lock was granted.
    pub master_version: u64,
    /// The identifier of the diff that produced that master version (0:
    /// unknown).
    pub master_tag: u64,
    /// The latest version in this transaction (tentative when > master).
    pub latest: u64,
    /// Uncommitted diffs, in version order.
    pub diffs: Vec<DiffLoc>,
}

/// The four cases of a lock request against the TMT.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum LockCase {
    /// (1) Another process of the transaction uses the segment incompatibly:
    /// a synchronization error; the transaction aborts.
    Clash,
    /// (2) Already held compatibly: granted locally, no message to the home.
    Local,
    /// (3) Held for reading, wanted for writing: ask the home to upgrade.
    Upgrade,
    /// (4) Not held: ask the home.
    Acquire,
}

/// The transaction metadata table.
#[derive(Clone, PartialEq, Eq, Debug, Default, Serialize, Deserialize)]
pub struct Tmt {
    /// One entry per segment locked in the transaction.
    pub entries: Vec<TmtEntry>,
}

impl Tmt {
    /// The entry for `url`.
    pub fn get(&self, url: &SegUrl) -> Option<&TmtEntry> {
        self.entries.iter().find(|e| &e.url == url)
    }

    /// The entry for `url`, mutably.
    pub fn get_mut(&mut self, url: &SegUrl) -> Option<&mut TmtEntry> {
        self.entries.iter_mut().find(|e| &e.url == url)
    }

    /// Decides how process `me` gets `mode` on `url` (section 3.2).
    pub fn lock_case(&self, url: &SegUrl, me: &str, mode: LockMode) -> LockCase {
        let Some(e) = self.get(url) else {
            return LockCase::Acquire;
        };
        if let Some((who, m)) = &e.active {
            if who != me && (mode == LockMode::Write || *m == LockMode::Write) {
                return LockCase::Clash;
            }
        }
        if e.mode == LockMode::Read && mode == LockMode::Write {
            LockCase::Upgrade
        } else {
            LockCase::Local
        }
    }

    /// Records a lock the home granted (cases 3 and 4). Fails with
    /// [`StateError::LimitExceeded`] past [`MAX_TMT_SEGMENTS`].
    pub fn granted(
        &mut self,
        url: &SegUrl,
        mode: LockMode,
        master_version: u64,
        master_tag: u64,
    ) -> Result<(), StateError> {
        if let Some(e) = self.get_mut(url) {
            e.mode = e.mode.max(mode);
            if master_version > e.master_version {
                e.master_tag = master_tag;
            }
            e.master_version = e.master_version.max(master_version);
            e.latest = e.latest.max(master_version);
            return Ok(());
        }
        if self.entries.len() >= MAX_TMT_SEGMENTS {
            return Err(StateError::LimitExceeded(format!(
                "a transaction may lock at most {MAX_TMT_SEGMENTS} segments"
            )));
        }
        self.entries.push(TmtEntry {
            url: url.clone(),
            mode,
            active: None,
            master_version,
            master_tag,
            latest: master_version,
            diffs: Vec::new(),
        });
        Ok(())
    }

    /// Records that process `at` created the diff `id` to version `target`
    /// in sub-transaction `sub`. Fails with [`StateError::LimitExceeded`] or,
    /// for an unlocked segment, [`StateError::BadDiff`].
    pub fn created_diff(
        &mut self,
        url: &SegUrl,
        target: u64,
        at: &str,
        id: u64,
        sub: &SubPath,
    ) -> Result<(), StateError> {
        let e = self.get_mut(url).ok_or_else(|| {
            StateError::BadDiff(format!("{url} is not locked in this transaction"))
        })?;
        if e.diffs.len() >= MAX_DIFFS_PER_SEGMENT {
            return Err(StateError::LimitExceeded(format!(
                "more than {MAX_DIFFS_PER_SEGMENT} uncommitted diffs on {url}"
            )));
        }
        e.diffs.retain(|d| d.target < target);
        e.latest = target;
        e.diffs.push(DiffLoc {
            target,
            at: at.to_string(),
            id,
            sub: sub.clone(),
        });
        Ok(())
    }

    /// Forgets the diffs written inside the aborted sub-transactions
    /// `aborted` (and everything after the first of them: later diffs were
    /// built on it), so the transaction's latest version is again the last
    /// surviving diff's. Returns true when something was forgotten.
    pub fn prune(&mut self, aborted: &[SubPath]) -> bool {
        let mut any = false;
        for e in &mut self.entries {
            if let Some(cut) = e
                .diffs
                .iter()
                .position(|d| aborted.iter().any(|a| a.is_ancestor_or_self(&d.sub)))
            {
                e.diffs.truncate(cut);
                e.latest = e.diffs.last().map_or(e.master_version, |d| d.target);
                any = true;
            }
        }
        any
    }

    /// The identifier of what version `version` of `url` is in this
    /// transaction: the diff that produced it, or the master's tag.
    pub fn tag_at(&self, url: &SegUrl, version: u64) -> Option<u64> {
        let e = self.get(url)?;
        if version == e.master_version {
            return Some(e.master_tag);
        }
        e.diffs.iter().find(|d| d.target == version).map(|d| d.id)
    }

    /// Merges a table that came back from a callee (or arrived with a call):
    /// the union of segments, the stronger lock, the later versions, every
    /// diff location once, in version order. Fails with
    /// [`StateError::LimitExceeded`] when the union is over the bounds.
    pub fn merge(&mut self, other: &Tmt) -> Result<(), StateError> {
        for o in &other.entries {
            match self.get_mut(&o.url) {
                None => {
                    if self.entries.len() >= MAX_TMT_SEGMENTS {
                        return Err(StateError::LimitExceeded("TMT segments".into()));
                    }
                    self.entries.push(o.clone());
                }
                Some(e) => {
                    e.mode = e.mode.max(o.mode);
                    e.master_version = e.master_version.max(o.master_version);
                    if o.latest >= e.latest {
                        e.active = o.active.clone();
                    }
                    e.latest = e.latest.max(o.latest);
                    if o.master_version > e.master_version {
                        e.master_tag = o.master_tag;
                    }
                    for d in &o.diffs {
                        if !e.diffs.iter().any(|x| x.id == d.id) {
                            e.diffs.push(d.clone());
                        }
                    }
                    e.diffs.sort_by_key(|d| d.target);
                    // A later table replaces a version reused after a
                    // sub-transaction abort: keep one diff per version,
                    // the one the later side knows.
                    if o.latest >= e.latest {
                        e.diffs.retain(|d| {
                            o.diffs.iter().any(|x| x.id == d.id)
                                || !o.diffs.iter().any(|x| x.target == d.target)
                        });
                    }
                    if e.diffs.len() > MAX_DIFFS_PER_SEGMENT {
                        return Err(StateError::LimitExceeded("TMT diffs".into()));
                    }
                }
            }
        }
        Ok(())
    }

    /// The diffs a process holding `have` of `url` lacks, in order.
    pub fn missing(&self, url: &SegUrl, have: u64) -> Vec<DiffLoc> {
        self.get(url)
            .map(|e| {
                e.diffs
                    .iter()
                    .filter(|d| d.target > have)
                    .cloned()
                    .collect()
            })
            .unwrap_or_default()
    }

    /// The baggage value (postcard, see docs/state.md).
    pub fn encode(&self) -> Vec<u8> {
        postcard::to_allocvec(self).expect("a TMT always encodes")
    }

    /// Decodes a baggage value. Fails with [`StateError::Decode`] when it is
    /// too long or malformed, [`StateError::LimitExceeded`] past the bounds.
    pub fn decode(bytes: &[u8]) -> Result<Tmt, StateError> {
        if bytes.len() > MAX_TMT_BYTES {
            return Err(StateError::Decode(format!("TMT of {} bytes", bytes.len())));
        }
        let t: Tmt =
            postcard::from_bytes(bytes).map_err(|e| StateError::Decode(format!("TMT: {e}")))?;
        if t.entries.len() > MAX_TMT_SEGMENTS
            || t.entries
                .iter()
                .any(|e| e.diffs.len() > MAX_DIFFS_PER_SEGMENT)
        {
            return Err(StateError::LimitExceeded("TMT over its bounds".into()));
        }
        Ok(t)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn url(p: &str) -> SegUrl {
        SegUrl {
            node: "1".into(),
            path: p.into(),
        }
    }

    #[test]
    fn the_four_lock_cases() {
        let mut t = Tmt::default();
        let a = url("a");
        assert_eq!(t.lock_case(&a, "p1", LockMode::Read), LockCase::Acquire);
        t.granted(&a, LockMode::Read, 4, 0).unwrap();
        assert_eq!(t.lock_case(&a, "p1", LockMode::Read), LockCase::Local);
        assert_eq!(t.lock_case(&a, "p1", LockMode::Write), LockCase::Upgrade);
        t.granted(&a, LockMode::Write, 4, 0).unwrap();
        t.get_mut(&a).unwrap().active = Some(("p1".into(), LockMode::Write));
        assert_eq!(t.lock_case(&a, "p2", LockMode::Read), LockCase::Clash);
        assert_eq!(t.lock_case(&a, "p1", LockMode::Write), LockCase::Local);
        t.get_mut(&a).unwrap().active = Some(("p1".into(), LockMode::Read));
        assert_eq!(t.lock_case(&a, "p2", LockMode::Read), LockCase::Local);
        assert_eq!(t.lock_case(&a, "p2", LockMode::Write), LockCase::Clash);
    }

    #[test]
    fn merge_keeps_later_versions_and_every_diff_once() {
        let a = url("a");
        let mut caller = Tmt::default();
        caller.granted(&a, LockMode::Write, 4, 0).unwrap();
        caller
            .created_diff(&a, 5, "n1", 105, &SubPath::top())
            .unwrap();
        let mut callee = Tmt::decode(&caller.encode()).unwrap();
        assert_eq!(callee, caller);
        callee
            .created_diff(&a, 6, "n2", 106, &SubPath::top())
            .unwrap();
        callee.granted(&url("b"), LockMode::Read, 9, 0).unwrap();
        caller.merge(&callee).unwrap();
        let e = caller.get(&a).unwrap();
        assert_eq!(e.latest, 6);
        assert_eq!(
            e.diffs.iter().map(|d| d.target).collect::<Vec<_>>(),
            vec![5, 6]
        );
        assert_eq!(
            caller.missing(&a, 5),
            vec![DiffLoc {
                target: 6,
                at: "n2".into(),
                id: 106,
                sub: SubPath::top(),
            }]
        );
        assert!(caller.get(&url("b")).is_some());
    }

    #[test]
    fn an_aborted_subs_diffs_are_pruned_and_the_parents_stay() {
        let a = url("a");
        let mut t = Tmt::default();
        t.granted(&a, LockMode::Write, 4, 77).unwrap();
        let sub = SubPath::top().child(1);
        t.created_diff(&a, 5, "n1", 1, &SubPath::top()).unwrap();
        t.created_diff(&a, 6, "n2", 2, &sub).unwrap();
        t.created_diff(&a, 7, "n2", 3, &sub.child(1)).unwrap();
        assert_eq!(t.tag_at(&a, 4), Some(77));
        assert_eq!(t.tag_at(&a, 6), Some(2));
        assert!(!t.prune(&[SubPath::top().child(2)]));
        assert!(t.prune(&[sub]));
        let e = t.get(&a).unwrap();
        assert_eq!((e.latest, e.diffs.len()), (5, 1));
        // The parent writes on: version 6 again, under a new identifier.
        t.created_diff(&a, 6, "n1", 4, &SubPath::top()).unwrap();
        assert_eq!(t.tag_at(&a, 6), Some(4));
    }

    #[test]
    fn malformed_tables_are_refused() {
        assert!(matches!(
            Tmt::decode(&[0xff, 0xff, 0xff]),
            Err(StateError::Decode(_))
        ));
        assert!(Tmt::decode(&vec![0u8; MAX_TMT_BYTES + 1]).is_err());
    }
}
