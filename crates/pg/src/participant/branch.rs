//! One branch: the PostgreSQL transaction of one weft transaction at one node, and the handle
//! the program runs SQL through.
//!
//! Owns the branch's stage (active, preparing, prepared, ended), its connection while active, the
//! savepoints that carry weft sub-transactions into PostgreSQL, and whether a statement failed.
//! Must never run a statement outside the branch's PostgreSQL transaction, after the branch
//! started to prepare, or under a sub-transaction that already ended; and must never vote yes
//! for a PostgreSQL transaction that is not cleanly prepared.

use std::sync::Arc;

use parking_lot::Mutex;
use tokio_postgres::types::ToSql;
use tokio_postgres::{CancelToken, Client, NoTls, Row};
use weft_log::Log;
use weft_tx::Vote;
use weft_wire::{Failure, Status, SubPath, Tid};

use super::PgParticipant;
use crate::client::describe_error;
use crate::errors::{is_cancelled, statement_failure};
use crate::gid::{Gid, PgRecord, PG_RECORD_TAG};
use crate::pool::{PoolError, Pooled};

/// Where a branch is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stage {
    /// Statements may run.
    Active,
    /// `PREPARE TRANSACTION` is under way.
    Preparing,
    /// Prepared in PostgreSQL (or possibly prepared: the connection broke during
    /// `PREPARE TRANSACTION`); waiting for the outcome.
    Prepared,
    /// Committed, rolled back, or left the protocol (read-only, voted no).
    Ended,
}

/// A failed statement. PostgreSQL refuses everything after an error until the transaction, or
/// the savepoint the error happened under, is rolled back.
#[derive(Debug)]
struct Failed {
    /// How many savepoints were open when it happened: rolling back the savepoint at index
    /// `depth - 1` or an outer one clears it; 0 means only a rollback of the whole branch does.
    depth: usize,
    reason: String,
}

/// What the branch holds while it works (behind an async lock: statements, prepare and the
/// outcome take turns).
#[derive(Default)]
struct Work {
    /// The branch's connection, from its first statement until it is prepared or ended.
    conn: Option<Pooled>,
    /// Open savepoints, outermost first: one per level of the sub-transaction path last used.
    savepoints: Vec<SubPath>,
    failed: Option<Failed>,
}

/// Sub-transactions that ended, as the transaction manager reported them.
#[derive(Default)]
struct SubEnds {
    /// Not yet applied to PostgreSQL (applied before the next statement or at prepare).
    pending: Vec<(SubPath, bool)>,
    /// Every ended sub-transaction: statements under them are refused.
    ended: Vec<SubPath>,
}

/// What an abort needs to stop a running statement.
#[derive(Default)]
struct CancelSlot {
    token: Option<CancelToken>,
    running: bool,
    /// The branch is being aborted: no new statement starts.
    aborting: bool,
    /// A cancel request was sent: the connection must not be reused.
    cancelled: bool,
}

pub(super) struct Branch {
    pub(super) tid: Tid,
    pub(super) gid: Gid,
    /// Changed only while holding `work`.
    stage: Mutex<Stage>,
    work: tokio::sync::Mutex<Work>,
    subs: Mutex<SubEnds>,
    cancel: Mutex<CancelSlot>,
}

impl Branch {
    pub(super) fn new(tid: Tid, gid: Gid) -> Branch {
        Branch {
            tid,
            gid,
            stage: Mutex::new(Stage::Active),
            work: tokio::sync::Mutex::new(Work::default()),
            subs: Mutex::new(SubEnds::default()),
            cancel: Mutex::new(CancelSlot::default()),
        }
    }

    fn stage(&self) -> Stage {
        *self.stage.lock()
    }

    fn set_stage(&self, stage: Stage) {
        *self.stage.lock() = stage;
    }

    /// Fails with Aborted unless statements may still run.
    pub(super) fn check_active(&self, name: &str) -> Result<(), Failure> {
        let why = match self.stage() {
            Stage::Active if self.cancel.lock().aborting => "aborted",
            Stage::Active => return Ok(()),
            Stage::Preparing | Stage::Prepared => "preparing to commit",
            Stage::Ended => "ended",
        };
        Err(Failure::new(
            Status::Aborted,
            format!(
                "{name}: the branch of {} is {why}: no more statements",
                self.tid
            ),
        ))
    }

    pub(super) fn note_sub_end(&self, path: &SubPath, committed: bool) {
        let mut subs = self.subs.lock();
        subs.pending.push((path.clone(), committed));
        subs.ended.push(path.clone());
    }

    /// Stops whatever statement runs and keeps new ones from starting.
    async fn stop_statements(&self) {
        let token = {
            let mut slot = self.cancel.lock();
            slot.aborting = true;
            if slot.running {
                slot.cancelled = true;
                slot.token.clone()
            } else {
                None
            }
        };
        if let Some(token) = token {
            if let Err(e) = token.cancel_query(NoTls).await {
                tracing::debug!(tid = %self.tid, "cancel request failed: {}", describe_error(&e));
            }
        }
    }
}

/// The connection of a branch that has one.
fn client(work: &Work) -> &Client {
    &work
        .conn
        .as_ref()
        .expect("the branch holds a connection")
        .client
}

/// The name of the savepoint of sub-transaction `path` (`weft_sp_1_2` for `/1/2`).
fn savepoint(path: &SubPath) -> String {
    let mut name = String::from("weft_sp");
    for n in &path.0 {
        name.push('_');
        name.push_str(&n.to_string());
    }
    name
}

/// What a statement's text must not be: transaction control belongs to the participant.
fn refused_control(sql: &str) -> Option<&'static str> {
    let mut words = sql
        .trim_start_matches(|c: char| c.is_whitespace() || c == '(')
        .split(|c: char| !c.is_ascii_alphabetic())
        .filter(|w| !w.is_empty())
        .map(|w| w.to_ascii_uppercase());
    let first = words.next()?;
    let second = words.next().unwrap_or_default();
    match (first.as_str(), second.as_str()) {
        ("BEGIN" | "START" | "COMMIT" | "END" | "ABORT", _) => Some("transaction control"),
        ("ROLLBACK", _) | ("SAVEPOINT", _) | ("RELEASE", _) => {
            Some("transaction control (use weft sub-transactions for savepoints)")
        }
        ("PREPARE", "TRANSACTION") => Some("transaction control"),
        _ => None,
    }
}

enum Want {
    Rows,
    Count,
}

enum Done {
    Rows(Vec<Row>),
    Count(u64),
}

/// The handle through which a program runs SQL in its transaction's branch at one node.
///
/// Cheap to clone; every handle of a transaction at this participant shares one PostgreSQL
/// transaction and runs its statements one at a time. Statements run under the
/// (sub-)transaction the handle was enlisted with: a sub-transaction's statements sit behind a
/// savepoint, rolled back if it aborts and released into its parent if it commits (so a branch
/// runs one sub-transaction at a time: PostgreSQL savepoints nest, they do not interleave).
///
/// Any statement error ends the PostgreSQL transaction (or the sub-transaction's savepoint) the
/// way PostgreSQL does: later statements fail with Aborted, and the branch votes no at commit —
/// unless the failed sub-transaction aborts first, which undoes the error with its savepoint.
/// Transaction control statements (`BEGIN`, `COMMIT`, `ROLLBACK`, `SAVEPOINT`,
/// `PREPARE TRANSACTION`, ...) are refused: the participant runs those.
#[derive(Clone)]
pub struct PgBranch {
    participant: Arc<PgParticipant>,
    branch: Arc<Branch>,
    path: SubPath,
}

impl std::fmt::Debug for PgBranch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgBranch")
            .field("gid", &self.branch.gid)
            .field("path", &self.path)
            .field("stage", &self.branch.stage())
            .finish()
    }
}

impl PgBranch {
    pub(super) fn new(participant: Arc<PgParticipant>, branch: Arc<Branch>, path: SubPath) -> Self {
        PgBranch {
            participant,
            branch,
            path,
        }
    }

    /// The transaction.
    pub fn tid(&self) -> Tid {
        self.branch.tid
    }

    /// The GID the branch is prepared under.
    pub fn gid(&self) -> &Gid {
        &self.branch.gid
    }

    /// The sub-transaction path the handle's statements run under (empty for the top level).
    pub fn path(&self) -> &SubPath {
        &self.path
    }

    /// Runs one statement (with `$1`... parameters) and returns the number of rows it affected.
    ///
    /// # Errors
    /// - BadRequest: the statement is wrong (syntax, unknown table, bad data: SQLSTATE classes
    ///   42, 22, 0A), a parameter does not encode, it is transaction control, or it runs under a
    ///   sub-transaction while another one's savepoint is open here.
    /// - AppError: PostgreSQL refused it otherwise (a constraint violation, a raised
    ///   exception...); LockConflict: deadlock detected or lock not available.
    /// - Aborted: the transaction aborted (or started to commit), this (sub-)transaction
    ///   ended, or an earlier statement failed.
    /// - Unavailable: no connection came free within the pool's wait, PostgreSQL cannot be
    ///   reached, or the connection was lost (the branch then votes no).
    /// - ShuttingDown: the participant was stopped.
    ///
    /// Every failure carries PostgreSQL's own message (`ERROR 23505: duplicate key ...`).
    pub async fn execute(&self, sql: &str, params: &[&(dyn ToSql + Sync)]) -> Result<u64, Failure> {
        match self.run(sql, params, Want::Count).await? {
            Done::Count(n) => Ok(n),
            Done::Rows(rows) => Ok(rows.len() as u64),
        }
    }

    /// Runs one query and returns its rows.
    ///
    /// # Errors
    /// As [`PgBranch::execute`].
    pub async fn query(
        &self,
        sql: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Vec<Row>, Failure> {
        match self.run(sql, params, Want::Rows).await? {
            Done::Rows(rows) => Ok(rows),
            Done::Count(_) => Ok(Vec::new()),
        }
    }

    /// Runs a query that returns at most one row.
    ///
    /// # Errors
    /// As [`PgBranch::execute`], and AppError when it returns more than one row (the branch
    /// goes on).
    pub async fn query_opt(
        &self,
        sql: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Option<Row>, Failure> {
        let mut rows = self.query(sql, params).await?;
        if rows.len() > 1 {
            return Err(Failure::new(
                Status::AppError,
                format!(
                    "{}: expected at most one row, got {}",
                    self.context(),
                    rows.len()
                ),
            ));
        }
        Ok(rows.pop())
    }

    /// Runs a query that returns exactly one row.
    ///
    /// # Errors
    /// As [`PgBranch::execute`], and AppError when it returns no row or several (the branch
    /// goes on).
    pub async fn query_one(
        &self,
        sql: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Row, Failure> {
        self.query_opt(sql, params).await?.ok_or_else(|| {
            Failure::new(
                Status::AppError,
                format!("{}: expected one row, got none", self.context()),
            )
        })
    }

    fn context(&self) -> String {
        format!("{} {}", self.participant.name, self.branch.tid)
    }

    async fn run(
        &self,
        sql: &str,
        params: &[&(dyn ToSql + Sync)],
        want: Want,
    ) -> Result<Done, Failure> {
        let p = &self.participant;
        let b = &self.branch;
        if let Some(what) = refused_control(sql) {
            return Err(Failure::new(
                Status::BadRequest,
                format!("{}: {what} is the participant's job", self.context()),
            ));
        }
        p.check_open()?;
        let mut work = b.work.lock().await;
        b.check_active(&p.name)?;
        if let Some(ended) = b
            .subs
            .lock()
            .ended
            .iter()
            .find(|e| e.is_ancestor_or_self(&self.path))
        {
            return Err(Failure::new(
                Status::Aborted,
                format!(
                    "{}: sub-transaction {ended:?} already ended",
                    self.context()
                ),
            ));
        }
        p.apply_sub_ends(b, &mut work).await;
        if let Some(failed) = &work.failed {
            return Err(Failure::new(
                Status::Aborted,
                format!(
                    "{}: an earlier statement failed ({}); abort the (sub-)transaction",
                    self.context(),
                    failed.reason
                ),
            ));
        }
        if work.conn.is_none() {
            p.open(b, &mut work).await?;
        }
        p.open_savepoints(b, &mut work, &self.path).await?;
        {
            let mut slot = b.cancel.lock();
            if slot.aborting {
                return Err(Failure::new(
                    Status::Aborted,
                    format!("{}: the transaction is aborting", self.context()),
                ));
            }
            slot.running = true;
        }
        let result = {
            let client = &work.conn.as_ref().expect("opened above").client;
            match want {
                Want::Rows => client.query(sql, params).await.map(Done::Rows),
                Want::Count => client.execute(sql, params).await.map(Done::Count),
            }
        };
        let cancelled_by_abort = {
            let mut slot = b.cancel.lock();
            slot.running = false;
            slot.cancelled
        };
        result.map_err(|e| {
            let failure = if cancelled_by_abort && is_cancelled(&e) {
                Failure::new(
                    Status::Aborted,
                    format!(
                        "{}: the transaction aborted while the statement ran",
                        self.context()
                    ),
                )
            } else {
                statement_failure(&self.context(), &e)
            };
            p.fail(&mut work, &e, &failure.detail);
            failure
        })
    }
}

impl PgParticipant {
    /// Takes a connection for `branch` and begins its PostgreSQL transaction.
    async fn open(&self, branch: &Branch, work: &mut Work) -> Result<(), Failure> {
        let context = format!("{} {}", self.name, branch.tid);
        let conn = self
            .branch_pool
            .get(Some(self.cfg.acquire_timeout))
            .await
            .map_err(|e| match e {
                PoolError::Exhausted { size, waited } => Failure::new(
                    Status::Unavailable,
                    format!(
                        "{context}: all {size} connections are held by active branches \
                         (waited {waited:?}); raise PgConfig::max_connections or retry"
                    ),
                ),
                PoolError::Connect(e) => Failure::new(
                    Status::Unavailable,
                    format!(
                        "{context}: cannot connect to PostgreSQL: {}",
                        describe_error(&e)
                    ),
                ),
                PoolError::Closed => {
                    Failure::new(Status::ShuttingDown, format!("{} is stopped", self.name))
                }
            })?;
        if let Err(e) = conn.client.batch_execute("BEGIN").await {
            return Err(Failure::new(
                Status::Unavailable,
                format!("{context}: BEGIN failed: {}", describe_error(&e)),
            ));
        }
        branch.cancel.lock().token = Some(conn.client.cancel_token());
        work.conn = Some(conn);
        Ok(())
    }

    /// Opens the savepoints of every level of `path` not open yet.
    async fn open_savepoints(
        &self,
        branch: &Branch,
        work: &mut Work,
        path: &SubPath,
    ) -> Result<(), Failure> {
        let context = format!("{} {}", self.name, branch.tid);
        if let Some(open) = work
            .savepoints
            .iter()
            .find(|s| !s.is_ancestor_or_self(path))
        {
            return Err(Failure::new(
                Status::BadRequest,
                format!(
                    "{context}: a statement of {path:?} while sub-transaction {open:?} is open \
                     here; PostgreSQL savepoints nest, so end one sub-transaction before \
                     running another's statements"
                ),
            ));
        }
        for depth in work.savepoints.len() + 1..=path.depth() {
            let level = SubPath(path.0[..depth].to_vec());
            let sql = format!("SAVEPOINT {}", savepoint(&level));
            let client = &work.conn.as_ref().expect("open branch").client;
            if let Err(e) = client.batch_execute(&sql).await {
                let failure = statement_failure(&context, &e);
                self.fail(work, &e, &failure.detail);
                return Err(failure);
            }
            work.savepoints.push(level);
        }
        debug_assert!(work
            .savepoints
            .iter()
            .enumerate()
            .all(|(i, s)| s.depth() == i + 1));
        Ok(())
    }

    /// Records a failed statement; a lost connection fails the whole branch.
    fn fail(&self, work: &mut Work, error: &tokio_postgres::Error, reason: &str) {
        let lost = error.is_closed() || work.conn.as_ref().is_some_and(|c| c.client.is_closed());
        let depth = if lost { 0 } else { work.savepoints.len() };
        if lost {
            // PostgreSQL rolled the branch back when the connection went.
            work.conn = None;
            work.savepoints.clear();
        }
        let keep_outer = work.failed.as_ref().is_some_and(|f| f.depth <= depth);
        if !keep_outer {
            work.failed = Some(Failed {
                depth,
                reason: reason.to_string(),
            });
        }
    }

    /// Applies the sub-transaction ends reported since the last statement: an aborted one's
    /// savepoint is rolled back (undoing its statements, and any error they hit), a committed
    /// one's is released into its parent.
    async fn apply_sub_ends(&self, branch: &Branch, work: &mut Work) {
        let pending = std::mem::take(&mut branch.subs.lock().pending);
        for (path, committed) in pending {
            let Some(index) = work.savepoints.iter().position(|s| *s == path) else {
                continue; // it ran no statement here
            };
            let name = savepoint(&path);
            let Some(conn) = work.conn.as_ref() else {
                break;
            };
            if committed {
                // In a failed transaction PostgreSQL refuses RELEASE; the error stays and
                // moves to the parent, where the next rollback finds it.
                if work.failed.is_none() {
                    if let Err(e) = conn
                        .client
                        .batch_execute(&format!("RELEASE SAVEPOINT {name}"))
                        .await
                    {
                        let reason = format!("RELEASE SAVEPOINT failed: {}", describe_error(&e));
                        work.failed = Some(Failed { depth: 0, reason });
                    }
                }
                work.savepoints.truncate(index);
                if let Some(f) = work.failed.as_mut() {
                    f.depth = f.depth.min(index);
                }
            } else {
                let sql = format!("ROLLBACK TO SAVEPOINT {name}; RELEASE SAVEPOINT {name}");
                match conn.client.batch_execute(&sql).await {
                    Ok(()) => {
                        if work.failed.as_ref().is_some_and(|f| f.depth > index) {
                            work.failed = None;
                        }
                    }
                    Err(e) => {
                        let reason = format!(
                            "rolling back sub-transaction {path:?} failed: {}",
                            describe_error(&e)
                        );
                        work.failed = Some(Failed { depth: 0, reason });
                    }
                }
                work.savepoints.truncate(index);
            }
        }
    }

    /// Gives the branch's connection back to the pool (or closes it when it may be dirty).
    fn release(&self, branch: &Branch, work: &mut Work, clean: bool) {
        work.savepoints.clear();
        let Some(conn) = work.conn.take() else {
            return;
        };
        let reusable = {
            let mut slot = branch.cancel.lock();
            slot.token = None;
            clean && !slot.cancelled
        };
        if reusable {
            self.branch_pool.put(conn);
        }
    }

    /// Rolls back an active branch's PostgreSQL transaction and frees its connection.
    async fn rollback_active(&self, branch: &Branch, work: &mut Work) {
        work.failed = None;
        let clean = match work.conn.as_ref() {
            Some(conn) => conn.client.batch_execute("ROLLBACK").await.is_ok(),
            None => return,
        };
        // A failed ROLLBACK means the connection is gone, and PostgreSQL rolled back anyway.
        self.release(branch, work, clean);
    }

    /// Phase one for `branch` (see [`weft_tx::Resource::prepare`]).
    pub(super) async fn prepare_branch(&self, branch: &Arc<Branch>, log: &Log) -> Vote {
        let context = format!("{} {}", self.name, branch.tid);
        let mut work = branch.work.lock().await;
        match branch.stage() {
            Stage::Active => {}
            Stage::Preparing | Stage::Prepared => return Vote::Yes { durable: true },
            Stage::Ended => return Vote::No(format!("{context}: the branch already ended")),
        }
        if self.is_closed() {
            return Vote::No(format!("{} is stopped", self.name));
        }
        self.apply_sub_ends(branch, &mut work).await;
        if let Some(failed) = work.failed.take() {
            self.rollback_active(branch, &mut work).await;
            self.end(branch);
            return Vote::No(failed.reason);
        }
        if work.conn.is_none() {
            // No statement ran: nothing to prepare.
            self.end(branch);
            return Vote::ReadOnly;
        }
        // No transaction id means nothing was written (or row-locked): commit the reads now
        // and leave the protocol. In an aborted PostgreSQL transaction this query fails, which
        // catches an error we did not see.
        let wrote = client(&work)
            .query_one(
                "SELECT pg_catalog.txid_current_if_assigned() IS NOT NULL",
                &[],
            )
            .await
            .and_then(|row| row.try_get::<_, bool>(0));
        match wrote {
            Err(e) => {
                let reason = format!("{context}: {}", describe_error(&e));
                self.rollback_active(branch, &mut work).await;
                self.end(branch);
                return Vote::No(reason);
            }
            Ok(false) => {
                let committed = client(&work).batch_execute("COMMIT").await;
                self.release(branch, &mut work, committed.is_ok());
                self.end(branch);
                return match committed {
                    Ok(()) => Vote::ReadOnly,
                    Err(e) => Vote::No(format!(
                        "{context}: COMMIT of a read-only branch: {}",
                        describe_error(&e)
                    )),
                };
            }
            Ok(true) => {}
        }
        branch.set_stage(Stage::Preparing);
        let sql = format!("PREPARE TRANSACTION {}", branch.gid.literal());
        let prepared = client(&work).batch_execute(&sql).await;
        let lost = client(&work).is_closed();
        match prepared {
            Ok(()) => {
                self.release(branch, &mut work, true);
                branch.set_stage(Stage::Prepared);
                let record = PgRecord::Prepared {
                    gid: branch.gid.to_string(),
                };
                let appended = postcard::to_allocvec(&record)
                    .map_err(|e| e.to_string())
                    .and_then(|bytes| log.append(PG_RECORD_TAG, &bytes).map_err(|e| e.to_string()));
                match appended {
                    Ok(_) => Vote::Yes { durable: true },
                    // Prepared in PostgreSQL but not in the log: vote no; the abort that
                    // follows rolls the prepared transaction back.
                    Err(e) => Vote::No(format!("{context}: cannot log the prepare record: {e}")),
                }
            }
            Err(e) if e.as_db_error().is_some() && !lost => {
                // PostgreSQL refused and rolled the transaction back (GID in use, prepared
                // transactions disabled...).
                self.release(branch, &mut work, true);
                self.end(branch);
                Vote::No(format!(
                    "{context}: PREPARE TRANSACTION: {}",
                    describe_error(&e)
                ))
            }
            Err(e) => {
                // The connection broke: the PREPARE may or may not have happened. Stay
                // "prepared" so that the abort rolls the GID back if it exists.
                self.release(branch, &mut work, false);
                branch.set_stage(Stage::Prepared);
                Vote::No(format!(
                    "{context}: connection lost during PREPARE TRANSACTION: {}",
                    describe_error(&e)
                ))
            }
        }
    }

    /// Phase two (or an abort before it) for a live branch.
    pub(super) async fn finish_branch(&self, branch: &Arc<Branch>, commit: bool) {
        if !commit {
            branch.stop_statements().await;
        }
        let mut work = branch.work.lock().await;
        match branch.stage() {
            Stage::Active if commit => {
                // The protocol prepares every branch before it commits, so this is a bug
                // elsewhere; the decision is commit all the same, so commit in one phase.
                tracing::error!(
                    participant = %self.name, tid = %branch.tid,
                    "commit of a branch that never prepared; committing it in one phase"
                );
                if work.conn.is_some() {
                    let committed = client(&work).batch_execute("COMMIT").await;
                    if let Err(e) = &committed {
                        tracing::error!(
                            participant = %self.name, tid = %branch.tid,
                            "one-phase COMMIT failed: {}", describe_error(e)
                        );
                    }
                    self.release(branch, &mut work, committed.is_ok());
                }
                self.count_outcome(true);
            }
            Stage::Active => {
                self.rollback_active(branch, &mut work).await;
                self.count_outcome(false);
            }
            Stage::Preparing | Stage::Prepared => {
                self.resolve(&branch.gid, commit, true).await;
            }
            Stage::Ended => {}
        }
        drop(work);
        self.end(branch);
    }

    fn end(&self, branch: &Arc<Branch>) {
        branch.set_stage(Stage::Ended);
        self.forget(branch);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn savepoints_are_named_by_path() {
        assert_eq!(savepoint(&SubPath(vec![1])), "weft_sp_1");
        assert_eq!(savepoint(&SubPath(vec![3, 12])), "weft_sp_3_12");
    }

    #[test]
    fn transaction_control_is_refused() {
        for sql in [
            "BEGIN",
            "  begin isolation level serializable",
            "COMMIT",
            "commit prepared 'x'",
            "END",
            "ABORT",
            "ROLLBACK",
            "rollback to savepoint a",
            "SAVEPOINT a",
            "RELEASE a",
            "START TRANSACTION",
            "PREPARE TRANSACTION 'x'",
            "\n\tPrepare  Transaction 'x'",
        ] {
            assert!(refused_control(sql).is_some(), "{sql:?}");
        }
        for sql in [
            "SELECT 1",
            "INSERT INTO commits VALUES (1)",
            "PREPARE q AS SELECT 1",
            "UPDATE t SET begin = 1",
            "WITH x AS (SELECT 1) SELECT * FROM x",
            "",
        ] {
            assert!(refused_control(sql).is_none(), "{sql:?}");
        }
    }
}
