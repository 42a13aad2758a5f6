//! The audit: the DebitCredit invariant on every copy, and the copies
//! against each other.
//!
//! For each balance relation, the sum of its balances equals the sum of the
//! deltas of the history rows that touched it (a tpcb row touches an account,
//! a teller and a branch; a raid-mode row one tuple of one relation); all
//! copies hold the same sums and the same number of history rows. Owns the
//! check. Must read committed state only.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use weft_kv::Kv;
use weft_wire::NodeId;

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
}

impl SiteAudit {
    /// Violations of the invariant on this copy (empty when it holds).
    pub fn problems(&self) -> Vec<String> {
        let mut out = Vec::new();
        if self.malformed > 0 {
            out.push(format!("{} malformed rows", self.malformed));
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
    for rel in Relation::BALANCES {
        let mut rows = 0;
        let mut sum = 0i64;
        for (_, v) in kv.committed_with_prefix(&[rel.prefix()]) {
            match balance(&v) {
                Some(b) => {
                    rows += 1;
                    sum = sum.wrapping_add(b);
                }
                None => a.malformed += 1,
            }
        }
        a.balances.insert(rel.name().to_string(), (rows, sum));
        a.history_sums.insert(rel.name().to_string(), 0);
    }
    for (_, v) in kv.committed_with_prefix(&[Relation::History.prefix()]) {
        let Some(row) = HistoryRow::decode(&v) else {
            a.malformed += 1;
            continue;
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
    }
    a
}

/// The audit of every copy.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Audit {
    /// Each site's sums.
    pub sites: Vec<(NodeId, SiteAudit)>,
}

impl Audit {
    /// Every violation: per copy, and copies that differ from the first.
    pub fn problems(&self) -> Vec<String> {
        let mut out = Vec::new();
        for (node, a) in &self.sites {
            for p in a.problems() {
                out.push(format!("site {node}: {p}"));
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

    /// True when the invariant holds everywhere and all copies agree.
    pub fn passed(&self) -> bool {
        !self.sites.is_empty() && self.problems().is_empty()
    }
}
