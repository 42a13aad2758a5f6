//! Reading the transaction manager's records after a restart, as pure code:
//! records in, what each transaction's state was out.
//!
//! Owns the rule of what the log says about a transaction: ended (committed
//! and complete), committed (phase two to drive again), aborted, or
//! prepared without an outcome (in doubt). Must never guess an outcome: a
//! prepared branch without one stays in doubt, however long.

use std::collections::BTreeMap;

use weft_log::{LogRecord, Lsn};
use weft_wire::{Incarnation, NodeId, Tid};

use crate::msg::{TmRecord, TM_RECORD_TAG};

/// What the log says about one transaction.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RecoveredTx {
    /// Committed, and every child acknowledged (an `End` record).
    Ended,
    /// Committed, phase two not known complete: drive it again.
    Committed {
        /// The node this branch voted to (`None` at the coordinator).
        voter: Option<NodeId>,
        /// Children that voted Yes.
        children: Vec<(NodeId, Incarnation)>,
    },
    /// Aborted.
    Aborted,
    /// Prepared, no outcome: in doubt.
    Prepared {
        /// The node the vote went to (asked on recovery).
        parent: NodeId,
        /// Children that voted Yes.
        children: Vec<(NodeId, Incarnation)>,
    },
}

/// One transaction found in the log.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RecoveredEntry {
    /// The transaction.
    pub tid: Tid,
    /// Its state.
    pub state: RecoveredTx,
    /// Its first record (the log is kept from here while it lives).
    pub first_lsn: Lsn,
}

/// What [`scan`] found, in tid order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RecoveryScan {
    /// Every transaction with a record.
    pub txs: Vec<RecoveredEntry>,
    /// Records with the TM tag that did not decode (a bug: the log's
    /// checksum passed), by position.
    pub undecodable: Vec<Lsn>,
}

#[derive(Default)]
struct Seen {
    first_lsn: Option<Lsn>,
    prepared: Option<(NodeId, Vec<(NodeId, Incarnation)>)>,
    committed: Option<Vec<(NodeId, Incarnation)>>,
    aborted: bool,
    ended: bool,
}

/// Decodes the TM records of a log scan (other tags are skipped).
pub fn decode_records(records: &[LogRecord]) -> (Vec<(Lsn, TmRecord)>, Vec<Lsn>) {
    let mut ok = Vec::new();
    let mut bad = Vec::new();
    for r in records.iter().filter(|r| r.tag == TM_RECORD_TAG) {
        match postcard::from_bytes::<TmRecord>(&r.payload) {
            Ok(rec) => ok.push((r.lsn, rec)),
            Err(_) => bad.push(r.lsn),
        }
    }
    (ok, bad)
}

/// Folds the TM records, in log order, into each transaction's state.
pub fn scan(records: impl IntoIterator<Item = (Lsn, TmRecord)>) -> RecoveryScan {
    let mut seen: BTreeMap<Tid, Seen> = BTreeMap::new();
    for (lsn, rec) in records {
        let tid = match &rec {
            TmRecord::Prepared { tid, .. }
            | TmRecord::Committed { tid, .. }
            | TmRecord::Aborted { tid }
            | TmRecord::End { tid } => *tid,
        };
        let s = seen.entry(tid).or_default();
        s.first_lsn.get_or_insert(lsn);
        match rec {
            TmRecord::Prepared {
                parent, children, ..
            } => s.prepared = Some((parent, children)),
            TmRecord::Committed { children, .. } => s.committed = Some(children),
            TmRecord::Aborted { .. } => s.aborted = true,
            TmRecord::End { .. } => s.ended = true,
        }
    }
    let mut out = RecoveryScan::default();
    for (tid, s) in seen {
        let first_lsn = s.first_lsn.expect("every transaction seen has a record");
        let state = if s.ended {
            RecoveredTx::Ended
        } else if let Some(children) = s.committed {
            RecoveredTx::Committed {
                voter: s.prepared.map(|(p, _)| p),
                children,
            }
        } else if s.aborted {
            RecoveredTx::Aborted
        } else if let Some((parent, children)) = s.prepared {
            RecoveredTx::Prepared { parent, children }
        } else {
            continue;
        };
        out.txs.push(RecoveredEntry {
            tid,
            state,
            first_lsn,
        });
    }
    out
}
