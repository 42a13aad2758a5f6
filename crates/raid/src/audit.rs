//! The audit: the DebitCredit invariant on every copy, and the copies
//! against each other.
//!
//! For each balance relation, the sum of its balances equals the sum of the
//! deltas of the history rows that touched it (a tpcb row touches an account,
//! a teller and a branch; a raid-mode row one tuple of one relation); all
//! copies hold the same sums, the same number of history rows and the same
//! placement. Every site the placement names must be audited: a copy that
//! could not be seen fails the audit (by name), it is never left out
//! quietly. Owns the check. Must read committed state only.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use weft_kv::Kv;
use weft_wire::NodeId;

use crate::rc::{Replicas, PLACEMENT_KEY};
use crate::schema::{balance, HistoryRow, Relation};

/// Sums of one copy.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SiteAudit {
    /// Rows and balance sums of account, teller, branch.
    pub balances: BTreeMap<String, (u64, i64)>,
    /// History rows.
    pub history_rows: u64,
    /// Sum of the deltas of history rows touching each balance relation.
    pub history_sums: BTreeMap<String, i64>,
    /// Rows that could not be decoded.
    pub malformed: u64,
    /// The sites this copy's placement names (empty before its load).
    #[serde(default)]
    pub placement: Vec<NodeId>,
}

impl SiteAudit {
    /// Violations of the invariant on this copy (empty when it holds).
    pub fn problems(&self) -> Vec<String> {
        let mut out = Vec::new();
        if self.malformed > 0 {
            out.push(format!("{} malformed rows", self.malformed));
        }
        if self.placement.is_empty() {
            out.push("the copy is not loaded (no placement)".into());
        }
        for rel in Relation::BALANCES {
            let (_, sum) = self.balances.get(rel.name()).copied().unwrap_or_default();
            let hist = self
                .history_sums
                .get(rel.name())
                .copied()
                .unwrap_or_default();
            if sum != hist {
                out.push(format!(
                    "sum of {} balances is {sum} but history says {hist}",
                    rel.name()
                ));
            }
        }
        out
    }
}

/// Audits one copy's committed state.
pub fn audit_store(kv: &Kv) -> SiteAudit {
    let mut a = SiteAudit::default();
    match kv.try_committed(PLACEMENT_KEY) {
        Err(f) => {
            tracing::error!(error = %f, "audit: cannot read the placement");
            a.malformed += 1;
        }
        Ok(None) => {}
        Ok(Some(b)) => match Replicas::decode_placement(&b) {
            Some(sites) => a.placement = sites,
            None => a.malformed += 1,
        },
    }
    for rel in Relation::BALANCES {
        let mut rows = 0;
        let mut sum = 0i64;
        // Streamed: a copy of ten million accounts is never collected.
        let read = kv.visit_committed_with_prefix(&[rel.prefix()], |_, v| {
            match balance(v) {
                Some(b) => {
                    rows += 1;
                    sum = sum.wrapping_add(b);
                }
                None => a.malformed += 1,
            }
            true
        });
        if let Err(f) = read {
            tracing::error!(error = %f, "audit: cannot read {}", rel.name());
            a.malformed += 1;
        }
        a.balances.insert(rel.name().to_string(), (rows, sum));
        a.history_sums.insert(rel.name().to_string(), 0);
    }
    let mut malformed = 0;
    let read = kv.visit_committed_with_prefix(&[Relation::History.prefix()], |_, v| {
        let Some(row) = HistoryRow::decode(v) else {
            malformed += 1;
            return true;
        };
        a.history_rows += 1;
        let touched: &[Relation] = match row.rel {
            Relation::History => &Relation::BALANCES,
            Relation::Account => &[Relation::Account],
            Relation::Teller => &[Relation::Teller],
            Relation::Branch => &[Relation::Branch],
            Relation::Request => &[],
        };
        for rel in touched {
            *a.history_sums.entry(rel.name().to_string()).or_default() += row.delta;
        }
        true
    });
    a.malformed += malformed;
    if let Err(f) = read {
        tracing::error!(error = %f, "audit: cannot read the history");
        a.malformed += 1;
    }
    a
}

/// The audit of every copy.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Audit {
    /// Each audited site's sums.
    pub sites: Vec<(NodeId, SiteAudit)>,
    /// Sites whose copy could not be audited, with why.
    #[serde(default)]
    pub missing: Vec<(NodeId, String)>,
}

impl Audit {
    /// Every site that should hold a copy: those the audited copies'
    /// placements name, and those audited or tried. Lowest first.
    pub fn replicas(&self) -> Vec<NodeId> {
        let mut all: Vec<NodeId> = self
            .sites
            .iter()
            .flat_map(|(n, a)| std::iter::once(*n).chain(a.placement.iter().copied()))
            .chain(self.missing.iter().map(|(n, _)| *n))
            .collect();
        all.sort();
        all.dedup();
        all
    }

    /// Every violation: per copy, copies that differ from the first, and
    /// sites of the placement whose copy was not audited.
    pub fn problems(&self) -> Vec<String> {
        let mut out = Vec::new();
        if self.sites.is_empty() {
            out.push("no copy was audited".into());
        }
        for (node, why) in &self.missing {
            out.push(format!("site {node}: its copy could not be audited: {why}"));
        }
        for node in self.replicas() {
            let seen = self.sites.iter().any(|(n, _)| *n == node)
                || self.missing.iter().any(|(n, _)| *n == node);
            if !seen {
                out.push(format!(
                    "site {node}: named by a placement but its copy was not audited"
                ));
            }
        }
        for (node, a) in &self.sites {
            for p in a.problems() {
                out.push(format!("site {node}: {p}"));
            }
            if !a.placement.is_empty() && !a.placement.contains(node) {
                out.push(format!(
                    "site {node}: its placement {:?} leaves it out",
                    a.placement
                ));
            }
        }
        if let Some((first_node, first)) = self.sites.first() {
            for (node, a) in &self.sites[1..] {
                if a != first {
                    out.push(format!(
                        "site {node}'s copy differs from site {first_node}'s"
                    ));
                }
            }
        }
        out
    }

    /// True when every copy of the placement was audited, the invariant
    /// holds on each and all copies agree.
    pub fn passed(&self) -> bool {
        self.problems().is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn copy(placement: &[u32]) -> SiteAudit {
        SiteAudit {
            placement: placement.iter().map(|i| NodeId(*i)).collect(),
            ..SiteAudit::default()
        }
    }

    #[test]
    fn an_audit_that_misses_a_copy_fails_and_names_it() {
        let all = [1, 2, 3];
        let full = Audit {
            sites: all.iter().map(|i| (NodeId(*i), copy(&all))).collect(),
            missing: vec![],
        };
        assert!(full.passed(), "{:?}", full.problems());
        // Site 3 neither audited nor tried: the placement names it.
        let two = Audit {
            sites: full.sites[..2].to_vec(),
            missing: vec![],
        };
        assert!(!two.passed());
        assert_eq!(two.replicas(), vec![NodeId(1), NodeId(2), NodeId(3)]);
        assert!(
            two.problems().iter().any(|p| p.starts_with("site 3:")),
            "{:?}",
            two.problems()
        );
        // Site 3 tried and down.
        let down = Audit {
            sites: full.sites[..2].to_vec(),
            missing: vec![(NodeId(3), "HostDead: gone".into())],
        };
        assert!(!down.passed());
        assert!(down.problems().iter().any(|p| p.contains("HostDead: gone")));
        // Nothing audited, or nothing loaded.
        assert!(!Audit::default().passed());
        let unloaded = Audit {
            sites: vec![(NodeId(1), copy(&[]))],
            missing: vec![],
        };
        assert!(!unloaded.passed());
    }
}
