//! Recovery: resolving the prepared transactions an earlier life of this node left in
//! PostgreSQL, with what the transaction manager found in the log.
//!
//! Owns the decision table ([`decide`]) and the scan that applies it. Must never resolve a GID
//! of another node or another database, nor one whose branch is live in this life, nor guess
//! the outcome of a branch in doubt: those wait for the transaction manager.

use std::collections::HashSet;
use std::sync::Arc;

use weft_log::LogRecord;
use weft_tx::{Recovered, TxManager};
use weft_wire::NodeId;

use super::{PgParticipant, PgRecoveryReport, RecoveryState};
use crate::client::describe_error;
use crate::gid::{Gid, PgRecord, PG_RECORD_TAG};
use crate::pool::PoolError;

/// What to do with a prepared branch found at recovery.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Resolution {
    /// The transaction committed: `COMMIT PREPARED`.
    Commit,
    /// It aborted, or the transaction manager has no record of it: `ROLLBACK PREPARED`.
    Rollback,
    /// Prepared with no outcome yet: keep it until the transaction manager learns it.
    KeepInDoubt,
    /// A branch of this life (still live): its own phase two resolves it.
    LeaveToLiveBranch,
}

/// The decision table. `recovered` is what transaction recovery found about the transaction;
/// `live_here` whether it runs in this life (a live branch here, or a transaction the
/// transaction manager runs now and did not recover).
///
/// No record means presumed abort: a participant forces its prepare record before voting yes,
/// and the coordinator forces its commit record before anyone commits, so a transaction that
/// left no record at this node cannot have committed.
pub(super) fn decide(recovered: Option<Recovered>, live_here: bool) -> Resolution {
    if live_here {
        return Resolution::LeaveToLiveBranch;
    }
    match recovered {
        Some(Recovered::Committed) => Resolution::Commit,
        Some(Recovered::InDoubt) => Resolution::KeepInDoubt,
        Some(Recovered::Aborted) | None => Resolution::Rollback,
    }
}

/// The GIDs of this participant's branches that the log says were prepared.
pub(super) fn logged_gids(
    name: &str,
    records: &[LogRecord],
    node: Option<NodeId>,
    database: &str,
) -> Vec<Gid> {
    let mut gids = Vec::new();
    for r in records.iter().filter(|r| r.tag == PG_RECORD_TAG) {
        match postcard::from_bytes::<PgRecord>(&r.payload) {
            Ok(PgRecord::Prepared { gid }) => match Gid::parse(&gid) {
                Some(g) if Some(g.node()) == node && g.database() == database => gids.push(g),
                Some(_) => {} // another participant's
                None => {
                    tracing::error!(participant = name, lsn = %r.lsn, %gid, "malformed GID in the log")
                }
            },
            // The log's checksum passed, so this is a bug, not damage.
            Err(e) => {
                tracing::error!(participant = name, lsn = %r.lsn, "undecodable pg record: {e}")
            }
        }
    }
    gids
}

impl PgParticipant {
    /// Runs the scan until it completes (retrying while PostgreSQL cannot be reached) or the
    /// participant stops, then publishes the report.
    pub(super) async fn recovery_task(self: Arc<Self>, tm: TxManager, logged: Vec<Gid>) {
        let mut delay = self.cfg.retry_min;
        loop {
            if self.is_closed() {
                return;
            }
            match self.scan(&tm, &logged).await {
                Ok(Some(report)) => {
                    tracing::info!(
                        participant = %self.name,
                        committed = report.committed.len(),
                        rolled_back = report.rolled_back.len(),
                        in_doubt = report.in_doubt.len(),
                        others = report.others,
                        "postgres participant recovered"
                    );
                    self.recovery.send_replace(RecoveryState::Done(report));
                    return;
                }
                Ok(None) => return, // stopped
                Err(error) => {
                    if self.is_closed() {
                        return;
                    }
                    super::bump(&self.counters.retries);
                    tracing::warn!(
                        participant = %self.name, retry_in = ?delay,
                        "recovery scan failed, retrying: {error}"
                    );
                    tokio::time::sleep(delay).await;
                    delay = (delay * 2).min(self.cfg.retry_max);
                }
            }
        }
    }

    /// One pass: list the weft GIDs PostgreSQL holds for this database and resolve this node's.
    /// `Ok(None)` when the participant stopped.
    async fn scan(
        &self,
        tm: &TxManager,
        logged: &[Gid],
    ) -> Result<Option<PgRecoveryReport>, String> {
        let conn = match self.resolvers.get(None).await {
            Ok(conn) => conn,
            Err(PoolError::Closed) => return Ok(None),
            Err(PoolError::Connect(e)) => {
                return Err(format!("cannot connect: {}", describe_error(&e)))
            }
            Err(PoolError::Exhausted { .. }) => return Err("no resolver connection".into()),
        };
        let rows = conn
            .client
            .query(
                "SELECT gid FROM pg_catalog.pg_prepared_xacts \
                 WHERE database = pg_catalog.current_database() AND gid LIKE 'weft:%' \
                 ORDER BY prepared",
                &[],
            )
            .await
            .map_err(|e| describe_error(&e))?;
        self.resolvers.put(conn);
        let node = self.node();
        let mut report = PgRecoveryReport {
            logged: logged.len(),
            ..PgRecoveryReport::default()
        };
        let mut listed = HashSet::new();
        for row in rows {
            let text: String = row.try_get(0).map_err(|e| describe_error(&e))?;
            let gid = match Gid::parse(&text) {
                Some(g) if Some(g.node()) == node && g.database() == self.cfg.database => g,
                _ => {
                    report.others += 1;
                    continue;
                }
            };
            let tid = gid.tid();
            listed.insert(gid.clone());
            let recovered = tm.recovered(tid);
            let live_here = self.live.lock().contains_key(&tid)
                || (recovered.is_none() && tm.status(tid).is_some());
            match decide(recovered, live_here) {
                Resolution::Commit => {
                    if !self.resolve(&gid, true, false).await {
                        return Ok(None);
                    }
                    tracing::info!(participant = %self.name, %gid, "committed at recovery");
                    report.committed.push(gid);
                }
                Resolution::Rollback => {
                    if !self.resolve(&gid, false, false).await {
                        return Ok(None);
                    }
                    tracing::info!(participant = %self.name, %gid, ?recovered, "rolled back at recovery");
                    report.rolled_back.push(gid);
                }
                Resolution::KeepInDoubt => {
                    self.in_doubt.lock().insert(tid);
                    tracing::info!(participant = %self.name, %gid, "in doubt: kept prepared until the outcome is known");
                    report.in_doubt.push(gid);
                }
                Resolution::LeaveToLiveBranch => {}
            }
        }
        report.logged_not_prepared = logged.iter().filter(|g| !listed.contains(*g)).count();
        Ok(Some(report))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_decision_table() {
        use Recovered::*;
        use Resolution::*;
        assert_eq!(decide(Some(Committed), false), Commit);
        assert_eq!(decide(Some(InDoubt), false), KeepInDoubt);
        assert_eq!(decide(Some(Aborted), false), Rollback);
        assert_eq!(decide(None, false), Rollback, "presumed abort");
        for recovered in [Some(Committed), Some(InDoubt), Some(Aborted), None] {
            assert_eq!(decide(recovered, true), LeaveToLiveBranch);
        }
    }
}
