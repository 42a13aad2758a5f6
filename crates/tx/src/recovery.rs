//! Recovery of the transaction manager from the node's log.
//!
//! Owns the reading of TM records after a restart: which transactions
//! committed (and must finish phase two), which are in doubt (prepared, no
//! outcome: they ask their parent), which aborted. Must never guess an
//! outcome: a prepared branch without one stays in doubt, however long.

use std::collections::BTreeMap;

use weft_log::LogRecord;
use weft_wire::{Incarnation, NodeId, Tid};

use crate::core::TxCore;
use crate::manager::{Recovered, RecoveryReport, TxManager};
use crate::msg::{TmRecord, TM_RECORD_TAG};

#[derive(Default)]
struct Seen {
    first_lsn: Option<weft_log::Lsn>,
    prepared: Option<(NodeId, Vec<(NodeId, Incarnation)>)>,
    committed: Option<Vec<(NodeId, Incarnation)>>,
    aborted: bool,
    ended: bool,
}

pub(crate) fn recover(tm: &TxManager, records: &[LogRecord]) -> RecoveryReport {
    let mut seen: BTreeMap<Tid, Seen> = BTreeMap::new();
    for r in records.iter().filter(|r| r.tag == TM_RECORD_TAG) {
        let rec: TmRecord = match postcard::from_bytes(&r.payload) {
            Ok(rec) => rec,
            Err(e) => {
                // The log's checksum passed, so this is a bug, not damage.
                tracing::error!(lsn = %r.lsn, "undecodable transaction record: {e}");
                continue;
            }
        };
        let tid = match &rec {
            TmRecord::Prepared { tid, .. }
            | TmRecord::Committed { tid, .. }
            | TmRecord::Aborted { tid }
            | TmRecord::End { tid } => *tid,
        };
        seen.entry(tid).or_default().first_lsn.get_or_insert(r.lsn);
        match rec {
            TmRecord::Prepared {
                tid,
                parent,
                children,
            } => {
                seen.entry(tid).or_default().prepared = Some((parent, children));
            }
            TmRecord::Committed { tid, children } => {
                seen.entry(tid).or_default().committed = Some(children);
            }
            TmRecord::Aborted { tid } => seen.entry(tid).or_default().aborted = true,
            TmRecord::End { tid } => seen.entry(tid).or_default().ended = true,
        }
    }
    let cfg = tm.core_config();
    let mut report = RecoveryReport::default();
    for (tid, s) in seen {
        if s.ended {
            tm.note_recovered(tid, Recovered::Committed);
            report.committed += 1;
        } else if let Some(children) = s.committed.clone() {
            let voter = s.prepared.as_ref().map(|(p, _)| *p);
            let core = TxCore::recovered_committed(tid, voter, children, cfg);
            tm.install_recovered(tid, core, Recovered::Committed, first(&s.first_lsn));
            report.redriven.push(tid);
        } else if s.aborted {
            tm.note_recovered(tid, Recovered::Aborted);
            report.aborted += 1;
        } else if let Some((parent, children)) = s.prepared.clone() {
            let core = TxCore::recovered_prepared(tid, parent, children, cfg);
            tm.install_recovered(tid, core, Recovered::InDoubt, first(&s.first_lsn));
            report.in_doubt.push(tid);
        }
    }
    if !report.redriven.is_empty() || !report.in_doubt.is_empty() {
        tracing::info!(
            redriven = report.redriven.len(),
            in_doubt = report.in_doubt.len(),
            "transaction manager recovered"
        );
    }
    report
}

fn first(lsn: &Option<weft_log::Lsn>) -> weft_log::Lsn {
    lsn.expect("every recovered transaction has at least one record")
}
