//! The PostgreSQL participant against a real PostgreSQL (a `TempPostgres`), driven by one
//! node's transaction manager: commit and abort paths, read-only votes, statement errors,
//! sub-transactions as savepoints, the connection bound, recovery's decision table, and phase
//! two across a PostgreSQL crash. They fail — never skip — when PostgreSQL is missing (CI
//! installs it with `.ci/install-postgres.sh`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use weft_log::{Log, LogConfig, LogRecord, Lsn};
use weft_pg::{client, Gid, PgConfig, PgParticipant, PgRecord, ServerOptions, TempPostgres};
use weft_rpc::Plugin;
use weft_transport::{Endpoint, InprocHub, TransportConfig};
use weft_tx::{Resource, TmConfig, TmRecord, TxManager, Vote, TM_RECORD_TAG};
use weft_wire::{Incarnation, NodeId, Status, Tid, TxContext};

/// The database the participant uses (the server's default one: creating another costs seconds
/// with `fsync` on).
const DB: &str = "postgres";

fn server(fsync: bool) -> TempPostgres {
    TempPostgres::start(
        ServerOptions::default()
            .fsync(fsync)
            .shared_buffers_mb(32)
            .max_connections(40),
    )
    .unwrap_or_else(|e| panic!("{e}"))
}

/// One node (id 1): its log, transaction manager and a participant for database [`DB`].
struct Harness {
    server: TempPostgres,
    tm: TxManager,
    log: Log,
    pg: Arc<PgParticipant>,
    _dir: tempfile::TempDir,
}

async fn harness_with(
    server: TempPostgres,
    tune: impl FnOnce(PgConfig) -> PgConfig,
    records: Vec<LogRecord>,
) -> Harness {
    let dir = tempfile::tempdir().unwrap();
    let (log, _) = Log::open(LogConfig::new(dir.path().join("log"))).unwrap();
    let endpoint = Endpoint::start(TransportConfig {
        hub: Some(InprocHub::new()),
        ..TransportConfig::node(NodeId(1), Incarnation(1))
    })
    .await
    .unwrap();
    let tm = TxManager::start(endpoint, log.clone(), TmConfig::default());
    let pg = PgParticipant::new(tune(PgConfig::new(server.client_config(DB)).unwrap()));
    pg.attach(&tm, &log).unwrap();
    tm.recover(&records);
    Plugin::recover(&*pg, &tm, &records).unwrap();
    Harness {
        server,
        tm,
        log,
        pg,
        _dir: dir,
    }
}

/// A fresh server whose database [`DB`] has table `accounts`.
async fn setup(fsync: bool) -> TempPostgres {
    let server = server(fsync);
    let db = client::connect(&server, DB).await.unwrap();
    db.batch_execute("CREATE TABLE accounts (id int PRIMARY KEY, balance bigint NOT NULL)")
        .await
        .unwrap();
    server
}

async fn harness() -> Harness {
    let h = harness_with(setup(false).await, |c| c, Vec::new()).await;
    h.pg.wait_recovered().await.unwrap();
    h
}

impl Harness {
    async fn sql(&self) -> tokio_postgres::Client {
        client::connect(&self.server, DB).await.unwrap()
    }

    async fn ids(&self) -> Vec<i32> {
        self.sql()
            .await
            .query("SELECT id FROM accounts ORDER BY id", &[])
            .await
            .unwrap()
            .iter()
            .map(|r| r.get(0))
            .collect()
    }

    async fn prepared(&self) -> Vec<String> {
        self.sql()
            .await
            .query("SELECT gid FROM pg_prepared_xacts ORDER BY gid", &[])
            .await
            .unwrap()
            .iter()
            .map(|r| r.get(0))
            .collect()
    }

    /// Waits until the participant has no branch left (phase two runs in the background).
    async fn settle(&self) {
        wait_for("branches ended", || self.pg.branches().is_empty()).await;
    }
}

async fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

fn insert(id: i32) -> String {
    format!("INSERT INTO accounts VALUES ({id}, 100)")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_committed_branch_is_prepared_then_committed() {
    let h = harness().await;
    let ctx = h.tm.begin(None);
    let branch = h.pg.enlist(&h.tm, &ctx).unwrap();
    assert_eq!(
        branch.gid().to_string(),
        format!("weft:{}:n1:postgres", ctx.tid)
    );
    assert_eq!(branch.execute(&insert(1), &[]).await.unwrap(), 1);
    let n: i64 = 2;
    branch
        .execute("UPDATE accounts SET balance = balance * $1", &[&n])
        .await
        .unwrap();
    // Another handle of the same transaction shares the PostgreSQL transaction.
    let again = h.pg.enlist(&h.tm, &ctx).unwrap();
    let row = again
        .query_one("SELECT balance FROM accounts WHERE id = 1", &[])
        .await
        .unwrap();
    assert_eq!(row.get::<_, i64>(0), 200);
    assert!(h.ids().await.is_empty(), "invisible before commit");

    h.tm.commit(ctx.tid).await.unwrap();
    h.settle().await;
    assert_eq!(h.ids().await, [1]);
    assert!(h.prepared().await.is_empty());
    let stats = h.pg.stats();
    assert_eq!((stats.branches, stats.prepared, stats.committed), (1, 1, 1));
    assert_eq!(h.tm.stats().forced_records, 1, "the commit record only");
    let err = branch.execute(&insert(2), &[]).await.unwrap_err();
    assert_eq!(err.status, Status::Aborted, "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_aborted_branch_leaves_no_trace() {
    let h = harness().await;
    // Abort while active: plain ROLLBACK.
    let ctx = h.tm.begin(None);
    let branch = h.pg.enlist(&h.tm, &ctx).unwrap();
    branch.execute(&insert(1), &[]).await.unwrap();
    h.tm.abort(ctx.tid, "changed my mind").await.unwrap();
    h.settle().await;
    assert!(h.ids().await.is_empty());
    let err = branch.execute(&insert(2), &[]).await.unwrap_err();
    assert_eq!(err.status, Status::Aborted, "{err}");

    // Abort after prepare: ROLLBACK PREPARED.
    let ctx = h.tm.begin(None);
    let branch = h.pg.enlist(&h.tm, &ctx).unwrap();
    branch.execute(&insert(3), &[]).await.unwrap();
    let vote = Resource::prepare(&*h.pg, ctx.tid, &h.log).await;
    assert_eq!(vote, Vote::Yes { durable: true });
    assert_eq!(h.prepared().await, [branch.gid().to_string()]);
    Resource::abort(&*h.pg, ctx.tid).await;
    assert!(h.prepared().await.is_empty());
    assert!(h.ids().await.is_empty());
    assert_eq!(h.pg.stats().rolled_back, 2);
    h.tm.abort(ctx.tid, "done").await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_branch_that_writes_nothing_votes_read_only() {
    let h = harness().await;
    let ctx = h.tm.begin(None);
    let branch = h.pg.enlist(&h.tm, &ctx).unwrap();
    let rows = branch
        .query("SELECT id FROM accounts WHERE id > $1", &[&0_i32])
        .await
        .unwrap();
    assert!(rows.is_empty());
    assert_eq!(
        branch
            .query_opt("SELECT 1 WHERE false", &[])
            .await
            .unwrap()
            .map(|_| ()),
        None
    );
    h.tm.commit(ctx.tid).await.unwrap();
    // Enlisted but never used: read-only without a round trip.
    let ctx = h.tm.begin(None);
    let _unused = h.pg.enlist(&h.tm, &ctx).unwrap();
    h.tm.commit(ctx.tid).await.unwrap();

    let stats = h.pg.stats();
    assert_eq!((stats.read_only, stats.prepared), (2, 0), "{stats:?}");
    assert_eq!(h.tm.stats().committed_read_only, 2);
    assert_eq!(h.tm.stats().forced_records, 0, "read-only forces nothing");
    assert!(h.pg.branches().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_statement_aborts_the_transaction() {
    let h = harness().await;
    let ctx = h.tm.begin(None);
    let branch = h.pg.enlist(&h.tm, &ctx).unwrap();
    branch.execute(&insert(1), &[]).await.unwrap();
    let err = branch
        .execute("INSERT INTO missing VALUES (1)", &[])
        .await
        .unwrap_err();
    assert_eq!(err.status, Status::BadRequest, "{err}");
    assert!(
        err.detail
            .contains("ERROR 42P01: relation \"missing\" does not exist"),
        "{err}"
    );
    let err = branch.execute(&insert(2), &[]).await.unwrap_err();
    assert_eq!(err.status, Status::Aborted, "{err}");
    assert!(err.detail.contains("42P01"), "names the first error: {err}");
    let err = h.tm.commit(ctx.tid).await.unwrap_err();
    assert_eq!(err.status, Status::Aborted, "{err}");
    h.settle().await;
    assert!(h.ids().await.is_empty());
    assert_eq!(h.pg.stats().voted_no, 1);

    // A constraint violation is the application's error.
    let ctx = h.tm.begin(None);
    let branch = h.pg.enlist(&h.tm, &ctx).unwrap();
    branch.execute(&insert(5), &[]).await.unwrap();
    let err = branch.execute(&insert(5), &[]).await.unwrap_err();
    assert_eq!(err.status, Status::AppError, "{err}");
    assert!(err.detail.contains("ERROR 23505"), "{err}");
    assert!(h.tm.commit(ctx.tid).await.is_err());

    // Transaction control is the participant's.
    let ctx = h.tm.begin(None);
    let branch = h.pg.enlist(&h.tm, &ctx).unwrap();
    for sql in [
        "COMMIT",
        "rollback",
        "PREPARE TRANSACTION 'x'",
        "SAVEPOINT s",
    ] {
        let err = branch.execute(sql, &[]).await.unwrap_err();
        assert_eq!(err.status, Status::BadRequest, "{sql}: {err}");
    }
    // A wrong row count is the caller's problem, not the transaction's.
    assert_eq!(
        branch
            .query_one("SELECT 1 WHERE false", &[])
            .await
            .unwrap_err()
            .status,
        Status::AppError
    );
    branch.execute(&insert(6), &[]).await.unwrap();
    h.tm.commit(ctx.tid).await.unwrap();
    h.settle().await;
    assert_eq!(h.ids().await, [6]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sub_transactions_are_savepoints() {
    let h = harness().await;
    let top = h.tm.begin(None);
    let branch = h.pg.enlist(&h.tm, &top).unwrap();
    branch.execute(&insert(1), &[]).await.unwrap();

    // A sub-transaction writes, hits an error, and aborts alone: its error goes with it.
    let sub = h.tm.sub_begin(&top).unwrap();
    let in_sub = h.pg.enlist(&h.tm, &sub).unwrap();
    in_sub.execute(&insert(2), &[]).await.unwrap();
    let err = in_sub.execute(&insert(1), &[]).await.unwrap_err();
    assert_eq!(err.status, Status::AppError, "{err}");
    h.tm.sub_end(top.tid, &sub.path, false).unwrap();
    let err = in_sub.execute(&insert(9), &[]).await.unwrap_err();
    assert_eq!(
        err.status,
        Status::Aborted,
        "an ended sub-transaction runs nothing: {err}"
    );

    // Another one, nested two deep, commits into the top level.
    let sub = h.tm.sub_begin(&top).unwrap();
    let inner = h.tm.sub_begin(&sub).unwrap();
    h.pg.enlist(&h.tm, &inner)
        .unwrap()
        .execute(&insert(3), &[])
        .await
        .unwrap();
    // While /2/1 is open, a statement of another sub-transaction cannot run here.
    let other = h.tm.sub_begin(&top).unwrap();
    let err =
        h.pg.enlist(&h.tm, &other)
            .unwrap()
            .execute(&insert(8), &[])
            .await
            .unwrap_err();
    assert_eq!(err.status, Status::BadRequest, "{err}");
    h.tm.sub_end(top.tid, &inner.path, true).unwrap();
    h.tm.sub_end(top.tid, &sub.path, true).unwrap();
    h.tm.sub_end(top.tid, &other.path, false).unwrap();

    branch.execute(&insert(4), &[]).await.unwrap();
    h.tm.commit(top.tid).await.unwrap();
    h.settle().await;
    assert_eq!(h.ids().await, [1, 3, 4]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn branches_hold_at_most_the_configured_connections() {
    let h = harness_with(
        setup(false).await,
        |c| {
            c.max_connections(1)
                .acquire_timeout(Duration::from_millis(100))
        },
        Vec::new(),
    )
    .await;
    h.pg.wait_recovered().await.unwrap();
    let first = h.tm.begin(None);
    h.pg.enlist(&h.tm, &first)
        .unwrap()
        .execute(&insert(1), &[])
        .await
        .unwrap();
    let second = h.tm.begin(None);
    let branch = h.pg.enlist(&h.tm, &second).unwrap();
    let started = Instant::now();
    let err = branch.execute(&insert(2), &[]).await.unwrap_err();
    assert_eq!(err.status, Status::Unavailable, "{err}");
    assert!(err.detail.contains("all 1 connections"), "{err}");
    assert!(started.elapsed() >= Duration::from_millis(100));
    // Once the first is prepared its connection is free again.
    h.tm.commit(first.tid).await.unwrap();
    branch.execute(&insert(2), &[]).await.unwrap();
    h.tm.commit(second.tid).await.unwrap();
    h.settle().await;
    assert_eq!(h.ids().await, [1, 2]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abort_cancels_a_statement_waiting_for_a_lock() {
    let h = harness().await;
    let holder = h.tm.begin(None);
    h.pg.enlist(&h.tm, &holder)
        .unwrap()
        .execute(&insert(1), &[])
        .await
        .unwrap();
    let waiter = h.tm.begin(None);
    let branch = h.pg.enlist(&h.tm, &waiter).unwrap();
    let blocked = tokio::spawn(async move { branch.execute(&insert(1), &[]).await });
    // Wait until PostgreSQL shows the second insert waiting on the first's lock.
    let sql = h.sql().await;
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let waiting: i64 = sql
            .query_one(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        if waiting == 1 {
            break;
        }
        assert!(Instant::now() < deadline, "the insert never waited");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    h.tm.abort(waiter.tid, "give up").await.unwrap();
    let err = tokio::time::timeout(Duration::from_secs(5), blocked)
        .await
        .expect("the abort ends the statement")
        .unwrap()
        .unwrap_err();
    assert_eq!(err.status, Status::Aborted, "{err}");
    h.tm.commit(holder.tid).await.unwrap();
    h.settle().await;
    assert_eq!(h.ids().await, [1]);
}

fn record(lsn: u64, tag: weft_log::RecordTag, payload: Vec<u8>) -> LogRecord {
    LogRecord {
        lsn: Lsn(lsn),
        tag,
        payload: payload.into(),
    }
}

fn tm_record(lsn: u64, rec: &TmRecord) -> LogRecord {
    record(lsn, TM_RECORD_TAG, postcard::to_allocvec(rec).unwrap())
}

/// Leaves a prepared transaction named `gid` in database `db` that inserts `id`.
async fn leave_prepared(server: &TempPostgres, db: &str, gid: &str, id: i32) {
    let c = client::connect(server, db).await.unwrap();
    c.batch_execute(&format!(
        "BEGIN; {}; PREPARE TRANSACTION '{gid}'",
        insert(id)
    ))
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recovery_resolves_this_nodes_branches_with_the_transaction_manager() {
    let server = setup(false).await;
    server.create_database("other").await.unwrap();
    client::connect(&server, "other")
        .await
        .unwrap()
        .batch_execute("CREATE TABLE accounts (id int PRIMARY KEY, balance bigint NOT NULL)")
        .await
        .unwrap();
    let tid = |node: u32, seq: u64| Tid::new(NodeId(node), Incarnation(1), seq);
    let gid = |t: Tid, node: u32| Gid::new(t, NodeId(node), DB).unwrap();
    let committed = gid(tid(1, 5), 1);
    let unknown = gid(tid(1, 6), 1);
    let in_doubt = gid(tid(2, 7), 1);
    let aborted = gid(tid(2, 8), 1);
    let other_node = gid(tid(1, 9), 2);
    leave_prepared(&server, DB, &committed.to_string(), 1).await;
    leave_prepared(&server, DB, &unknown.to_string(), 2).await;
    leave_prepared(&server, DB, &in_doubt.to_string(), 3).await;
    leave_prepared(&server, DB, &aborted.to_string(), 4).await;
    leave_prepared(&server, DB, &other_node.to_string(), 5).await;
    leave_prepared(&server, DB, "not-weft", 6).await;
    let elsewhere = Gid::new(tid(1, 10), NodeId(1), "other").unwrap();
    leave_prepared(&server, "other", &elsewhere.to_string(), 7).await;

    let pg_record = |lsn, g: &Gid| {
        let rec = PgRecord::Prepared { gid: g.to_string() };
        record(
            lsn,
            weft_pg::PG_RECORD_TAG,
            postcard::to_allocvec(&rec).unwrap(),
        )
    };
    let resolved_before = gid(tid(1, 4), 1);
    let records = vec![
        pg_record(10, &resolved_before),
        pg_record(20, &committed),
        tm_record(
            30,
            &TmRecord::Committed {
                tid: committed.tid(),
                children: vec![],
            },
        ),
        pg_record(40, &in_doubt),
        tm_record(
            50,
            &TmRecord::Prepared {
                tid: in_doubt.tid(),
                parent: NodeId(2),
                children: vec![],
            },
        ),
        pg_record(60, &aborted),
        tm_record(
            70,
            &TmRecord::Prepared {
                tid: aborted.tid(),
                parent: NodeId(2),
                children: vec![],
            },
        ),
        tm_record(80, &TmRecord::Aborted { tid: aborted.tid() }),
    ];
    let h = harness_with(server, |c| c, records).await;
    let report = h.pg.wait_recovered().await.unwrap();
    assert_eq!(report.committed, std::slice::from_ref(&committed));
    let mut rolled_back = report.rolled_back.clone();
    rolled_back.sort_by_key(|g| g.to_string());
    assert_eq!(rolled_back, [unknown.clone(), aborted.clone()]);
    assert_eq!(report.in_doubt, std::slice::from_ref(&in_doubt));
    assert_eq!(report.others, 1, "node 2's branch");
    assert_eq!((report.logged, report.logged_not_prepared), (4, 1));

    let mut left = h.prepared().await;
    left.sort();
    let mut want = vec![
        elsewhere.to_string(),
        in_doubt.to_string(),
        "not-weft".to_string(),
        other_node.to_string(),
    ];
    want.sort();
    assert_eq!(
        left, want,
        "only this node's resolvable branches in this database"
    );
    assert_eq!(h.ids().await, [1]);

    // The transaction manager learns the in-doubt outcome: the participant commits a GID it
    // never opened in this process.
    Resource::commit(&*h.pg, in_doubt.tid()).await;
    assert_eq!(h.ids().await, [1, 3]);
    assert!(!h.prepared().await.contains(&in_doubt.to_string()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn phase_two_survives_a_postgres_crash() {
    // fsync on: the prepared transaction must survive the kill -9.
    let mut h = harness_with(
        setup(true).await,
        |c| c.retry(Duration::from_millis(5), Duration::from_millis(50)),
        Vec::new(),
    )
    .await;
    h.pg.wait_recovered().await.unwrap();
    let prepared = h.tm.begin(None);
    let branch = h.pg.enlist(&h.tm, &prepared).unwrap();
    branch.execute(&insert(1), &[]).await.unwrap();
    assert_eq!(
        Resource::prepare(&*h.pg, prepared.tid, &h.log).await,
        Vote::Yes { durable: true }
    );
    let active = h.tm.begin(None);
    let cut = h.pg.enlist(&h.tm, &active).unwrap();
    cut.execute(&insert(2), &[]).await.unwrap();

    h.server.crash().unwrap();
    // Phase two starts while PostgreSQL is down: it retries until the server is back.
    let pg = Arc::clone(&h.pg);
    let tid = prepared.tid;
    let commit = tokio::spawn(async move { Resource::commit(&*pg, tid).await });
    wait_for("a failed attempt", || h.pg.stats().retries > 0).await;
    h.server.restart().unwrap_or_else(|e| panic!("{e}"));
    tokio::time::timeout(Duration::from_secs(10), commit)
        .await
        .expect("phase two ends once PostgreSQL is back")
        .unwrap();
    assert_eq!(
        h.ids().await,
        [1],
        "the prepared insert survived and committed"
    );
    assert!(h.prepared().await.is_empty());

    // The active branch lost its connection: its statements fail and it votes no.
    let err = cut.execute(&insert(3), &[]).await.unwrap_err();
    assert_eq!(err.status, Status::Unavailable, "{err}");
    let err = cut.execute(&insert(3), &[]).await.unwrap_err();
    assert_eq!(err.status, Status::Aborted, "{err}");
    let err = h.tm.commit(active.tid).await.unwrap_err();
    assert_eq!(err.status, Status::Aborted, "{err}");
    h.tm.abort(prepared.tid, "test over").await.unwrap();
}

fn _assert_send(ctx: TxContext, h: &Harness) {
    fn send<T: Send>(_: T) {}
    let branch = h.pg.enlist(&h.tm, &ctx).unwrap();
    send(async move { branch.execute("SELECT 1", &[]).await });
}
