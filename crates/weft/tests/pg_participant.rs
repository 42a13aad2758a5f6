//! The PostgreSQL participant in whole in-process clusters, against a real PostgreSQL started
//! in a temporary directory: commit and abort across nodes, and crashes at precise points of
//! the commit protocol (the transaction manager's crash points, never timing) resolved at
//! recovery — the PostgreSQL row appears if and only if the transaction committed.
//!
//! Topology: node 1 is the cluster directory (and a plain participant to call); node 2 begins
//! the transactions and may write PostgreSQL itself; node 3 serves `pgsql`, which runs one SQL
//! statement in the caller's transaction. Nodes 2 and 3 each have a participant for the same
//! database of one shared server. These tests fail — never skip — when PostgreSQL is missing.

mod common;

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use common::*;
use tokio::sync::mpsc;
use weft::{Address, Failure, Node, NodeId, Seed, ServiceOptions, Status, Tid, TmConfig};
use weft_pg::{client, Gid, PgConfig, PgParticipant, ServerOptions, TempPostgres};
use weft_tx::{CrashHook, CrashPoint};

/// The database the participants use (the server's default one: creating another costs
/// seconds with `fsync` on).
const DB: &str = "postgres";

/// A fresh server whose database `postgres` holds table `accounts`.
async fn postgres(fsync: bool) -> TempPostgres {
    let server = TempPostgres::start(
        ServerOptions::default()
            .fsync(fsync)
            .shared_buffers_mb(32)
            .max_connections(60),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    client::connect(&server, DB)
        .await
        .unwrap()
        .batch_execute("CREATE TABLE accounts (id int PRIMARY KEY, balance bigint NOT NULL)")
        .await
        .unwrap();
    server
}

fn participant(server: &TempPostgres) -> Arc<PgParticipant> {
    PgParticipant::new(
        PgConfig::new(server.client_config(DB))
            .unwrap()
            .retry(Duration::from_millis(5), Duration::from_millis(100)),
    )
}

async fn ids(server: &TempPostgres) -> Vec<i32> {
    client::connect(server, DB)
        .await
        .unwrap()
        .query("SELECT id FROM accounts ORDER BY id", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect()
}

async fn prepared(server: &TempPostgres) -> Vec<String> {
    client::connect(server, DB)
        .await
        .unwrap()
        .query("SELECT gid FROM pg_prepared_xacts ORDER BY gid", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect()
}

/// Polls PostgreSQL until `cond` holds for the ids committed and the GIDs prepared.
async fn wait_pg(server: &TempPostgres, what: &str, cond: impl Fn(&[i32], &[String]) -> bool) {
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    loop {
        let (ids, gids) = (ids(server).await, prepared(server).await);
        if cond(&ids, &gids) {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "timed out waiting for: {what} (committed ids {ids:?}, prepared {gids:?})"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn insert(id: i32) -> String {
    format!("INSERT INTO accounts VALUES ({id}, 100)")
}

fn pgsql_at(node: u32) -> Address {
    format!("pgsql@{node}").parse().unwrap()
}

/// Registers `pgsql` on `node`: runs the SQL statement it is sent in the caller's transaction
/// and returns the number of rows affected.
fn serve_pgsql(node: &Node, pg: &Arc<PgParticipant>) {
    let pg = Arc::clone(pg);
    node.register(
        "pgsql",
        ServiceOptions::no_state(),
        move |ctx, sql: String| {
            let pg = Arc::clone(&pg);
            async move {
                let tx = ctx
                    .tx()
                    .ok_or_else(|| Failure::new(Status::BadRequest, "pgsql needs a transaction"))?;
                let branch = pg.enlist(ctx.rpc().tm(), tx)?;
                branch.execute(&sql, &[]).await
            }
        },
    )
    .unwrap();
}

/// A crash point for node `id`'s transaction manager; the hook reports the transaction.
fn crash_at(point: CrashPoint) -> (TmConfig, mpsc::UnboundedReceiver<Tid>) {
    let (tx, rx) = mpsc::unbounded_channel();
    let hook: CrashHook = Arc::new(move |_, tid| {
        let _ = tx.send(tid);
    });
    let cfg = TmConfig {
        crash_at: Some((point, hook)),
        ..TmConfig::default()
    };
    (cfg, rx)
}

/// The test cluster: node 1 plain, nodes 2 and 3 with their own data directories and
/// participants; node 3 serves `pgsql`.
struct PgCluster {
    c: Cluster,
    pg: Vec<Arc<PgParticipant>>,
    dirs: Vec<tempfile::TempDir>,
}

impl PgCluster {
    async fn start(server: &TempPostgres, seed: u64, tm: impl Fn(u32) -> TmConfig) -> PgCluster {
        let dirs: Vec<tempfile::TempDir> = (0..3).map(|_| tempfile::tempdir().unwrap()).collect();
        let pg: Vec<Arc<PgParticipant>> = (0..3).map(|_| participant(server)).collect();
        let (pg2, paths) = (
            pg.clone(),
            dirs.iter()
                .map(|d| d.path().to_path_buf())
                .collect::<Vec<_>>(),
        );
        let c = Cluster::start_with(3, seed, move |id, b| {
            let b = b.data_dir(&paths[(id - 1) as usize]).tm_config(tm(id));
            if id == 1 {
                b
            } else {
                b.plugin(pg2[(id - 1) as usize].clone())
            }
        })
        .await;
        serve_pgsql(c.node(3), &pg[2]);
        for p in &pg[1..] {
            p.wait_recovered().await.unwrap();
        }
        PgCluster { c, pg, dirs }
    }

    fn node(&self, id: u32) -> &Node {
        self.c.node(id)
    }

    fn pg(&self, id: u32) -> &Arc<PgParticipant> {
        &self.pg[(id - 1) as usize]
    }

    /// Crashes node `id` and its participant, as the death of its process would.
    fn crash(&self, id: u32) {
        self.node(id).crash();
        self.pg(id).crash();
    }

    /// Starts node `id` again from its data directory, with a new participant.
    async fn restart(&mut self, id: u32, server: &TempPostgres) {
        let pg = participant(server);
        let node = restart_node(self, id, self.dirs[(id - 1) as usize].path(), &pg).await;
        if id == 3 {
            serve_pgsql(&node, &pg);
        }
        self.c.nodes[(id - 1) as usize] = node;
        self.pg[(id - 1) as usize] = pg;
    }
}

async fn restart_node(c: &PgCluster, id: u32, dir: &Path, pg: &Arc<PgParticipant>) -> Node {
    let node = builder(id, &c.c.hub, &c.c.plan)
        .data_dir(dir)
        .plugin(pg.clone())
        .join(Seed::Inproc(NodeId(1)))
        .start()
        .await
        .unwrap_or_else(|e| panic!("node {id} restarts: {e}"));
    assert!(node.incarnation().0 >= 2, "a restart is a new incarnation");
    node
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_writing_postgres_on_another_node_commits() {
    let server = postgres(false).await;
    let c = PgCluster::start(&server, 301, |_| TmConfig::default()).await;
    let tx = c.node(2).begin();
    let tid = tx.tid();
    let n: u64 = tx.call(&pgsql_at(3), insert(1)).await.unwrap();
    assert_eq!(n, 1);
    let echoed: String = tx
        .call(&"echo@1".parse().unwrap(), "hello".to_string())
        .await
        .unwrap();
    assert_eq!(echoed, "hello");
    assert!(ids(&server).await.is_empty(), "invisible before commit");
    tx.commit().await.unwrap();
    wait_pg(&server, "the row committed", |ids, gids| {
        ids == [1] && gids.is_empty()
    })
    .await;
    let stats = c.pg(3).stats();
    assert_eq!((stats.prepared, stats.committed), (1, 1), "{stats:?}");
    assert_eq!(
        c.node(3).tm().stats().forced_records,
        1,
        "node 3's prepare record"
    );
    assert!(c
        .pg(3)
        .gid(tid)
        .unwrap()
        .to_string()
        .ends_with(":n3:postgres"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aborts_and_failed_statements_leave_no_row() {
    let server = postgres(false).await;
    let c = PgCluster::start(&server, 302, |_| TmConfig::default()).await;
    // The program aborts.
    let tx = c.node(2).begin();
    let _: u64 = tx.call(&pgsql_at(3), insert(1)).await.unwrap();
    tx.abort("changed my mind").await.unwrap();

    // A statement fails on node 3: its branch votes no, so the commit aborts everywhere,
    // including node 2's own branch.
    let tx = c.node(2).begin();
    let own = c.pg(2).enlist(c.node(2).tm(), tx.context()).unwrap();
    own.execute(&insert(2), &[]).await.unwrap();
    let _: u64 = tx.call(&pgsql_at(3), insert(3)).await.unwrap();
    let err = tx
        .call::<_, u64>(&pgsql_at(3), "UPDATE nowhere SET x = 1".to_string())
        .await
        .unwrap_err();
    assert_eq!(err.status, Status::BadRequest, "{err}");
    assert!(
        err.detail.contains("ERROR 42P01"),
        "carries PostgreSQL's message: {err}"
    );
    let err = tx.commit().await.unwrap_err();
    assert_eq!(err.status, Status::Aborted, "{err}");

    wait_pg(&server, "everything rolled back", |_, gids| gids.is_empty()).await;
    wait_for("branches ended", Duration::from_secs(5), || {
        c.pg(2).branches().is_empty() && c.pg(3).branches().is_empty()
    })
    .await;
    assert!(ids(&server).await.is_empty());
    assert_eq!(c.pg(3).stats().voted_no + c.pg(2).stats().voted_no, 1);
}

/// (a) The participant dies after forcing its prepare record, before its vote leaves: the
/// coordinator decides (abort: the vote never came), and the restarted participant, in doubt,
/// learns it and rolls the prepared branch back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_participant_crash_after_its_prepare_record_is_resolved_by_the_coordinator() {
    let server = postgres(false).await;
    let (cfg3, mut crashed) = crash_at(CrashPoint::ParticipantPrepared);
    let mut c = PgCluster::start(&server, 303, move |id| {
        if id == 3 {
            cfg3.clone()
        } else {
            TmConfig::default()
        }
    })
    .await;
    let tx = c.node(2).begin();
    let tid = tx.tid();
    let _: u64 = tx.call(&pgsql_at(3), insert(1)).await.unwrap();
    let commit = tokio::spawn(tx.commit());
    assert_eq!(crashed.recv().await, Some(tid));
    c.crash(3);
    let gid = Gid::new(tid, NodeId(3), DB).unwrap().to_string();
    assert_eq!(
        prepared(&server).await,
        [gid],
        "PostgreSQL holds the branch"
    );

    let outcome = commit.await.unwrap();
    // The vote never came: the abort says which node died, and how.
    let err = outcome.clone().expect_err("no vote, no commit");
    assert!(
        matches!(err.status, Status::HostDead | Status::ProcDead),
        "{err}"
    );
    assert!(err.detail.contains("node 3 died"), "{err}");
    c.restart(3, &server).await;
    assert!(
        c.node(3).recovery().in_doubt.contains(&tid),
        "{:?}",
        c.node(3).recovery()
    );
    wait_pg(&server, "the in-doubt branch resolved", |_, gids| {
        gids.is_empty()
    })
    .await;
    let committed = outcome.is_ok();
    assert_eq!(
        ids(&server).await.contains(&1),
        committed,
        "the row iff committed"
    );
    c.pg(3).wait_recovered().await.unwrap();
}

/// (a) The participant dies after voting yes, when the commit decision reaches it but before it
/// applied it: the transaction committed, and the restarted participant, in doubt, asks the
/// coordinator and commits the prepared branch its new process never opened.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_participant_crash_before_applying_the_decision_commits_at_recovery() {
    let server = postgres(false).await;
    let (cfg3, mut crashed) = crash_at(CrashPoint::ParticipantPhaseTwo);
    let mut c = PgCluster::start(&server, 307, move |id| {
        if id == 3 {
            cfg3.clone()
        } else {
            TmConfig::default()
        }
    })
    .await;
    let tx = c.node(2).begin();
    let tid = tx.tid();
    let _: u64 = tx.call(&pgsql_at(3), insert(1)).await.unwrap();
    tx.commit().await.expect("every vote was yes");
    assert_eq!(crashed.recv().await, Some(tid));
    c.crash(3);
    let gid = Gid::new(tid, NodeId(3), DB).unwrap();
    assert_eq!(prepared(&server).await, [gid.to_string()]);
    assert!(
        ids(&server).await.is_empty(),
        "not applied before the crash"
    );

    c.restart(3, &server).await;
    assert!(c.node(3).recovery().in_doubt.contains(&tid));
    wait_pg(&server, "the in-doubt branch committed", |ids, gids| {
        ids == [1] && gids.is_empty()
    })
    .await;
    c.pg(3).wait_recovered().await.unwrap();
}

/// (b) The coordinator dies with every vote in but before forcing its commit record: at
/// recovery it has no record of the transaction (presumed abort), so its own prepared branch
/// is rolled back, and the participant in doubt is told abort.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_coordinator_crash_before_its_commit_record_rolls_back() {
    let server = postgres(false).await;
    let (cfg2, mut crashed) = crash_at(CrashPoint::CoordinatorBeforeCommitForce);
    let mut c = PgCluster::start(&server, 304, move |id| {
        if id == 2 {
            cfg2.clone()
        } else {
            TmConfig::default()
        }
    })
    .await;
    let tx = c.node(2).begin();
    let tid = tx.tid();
    let own = c.pg(2).enlist(c.node(2).tm(), tx.context()).unwrap();
    own.execute(&insert(1), &[]).await.unwrap();
    let _: u64 = tx.call(&pgsql_at(3), insert(2)).await.unwrap();
    let _commit = tokio::spawn(tx.commit());
    assert_eq!(crashed.recv().await, Some(tid));
    c.crash(2);
    let gid2 = Gid::new(tid, NodeId(2), DB).unwrap();
    let gid3 = Gid::new(tid, NodeId(3), DB).unwrap();
    let mut both = vec![gid2.to_string(), gid3.to_string()];
    both.sort();
    assert_eq!(prepared(&server).await, both, "both branches prepared");

    // Node 3 may ask the restarted coordinator for the outcome, and roll
    // its branch back, before node 2's participant has scanned the prepared
    // branches: keep the two apart until the scan is reported.
    c.c.plan.partition(&[NodeId(2)], &[NodeId(3)]);
    c.restart(2, &server).await;
    let report = c.pg(2).wait_recovered().await.unwrap();
    assert_eq!(
        report.rolled_back,
        [gid2],
        "presumed abort at the coordinator"
    );
    assert_eq!(report.others, 1, "node 3's branch is node 3's to resolve");
    c.c.plan.heal();
    wait_pg(&server, "node 3 learns abort", |_, gids| gids.is_empty()).await;
    assert!(ids(&server).await.is_empty());
}

/// (c) The coordinator dies right after forcing its commit record, and the participant —
/// prepared, the decision never delivered — dies too. The participant restarts first and keeps
/// its branch prepared in doubt; the coordinator restarts, commits its own branch at recovery
/// and re-drives phase two, and the participant commits a GID its new process never opened.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_coordinator_crash_after_its_commit_record_commits_everywhere_at_recovery() {
    let server = postgres(false).await;
    let (cfg2, mut crashed) = crash_at(CrashPoint::CoordinatorAfterCommitForce);
    let mut c = PgCluster::start(&server, 305, move |id| {
        if id == 2 {
            cfg2.clone()
        } else {
            TmConfig::default()
        }
    })
    .await;
    let tx = c.node(2).begin();
    let tid = tx.tid();
    let own = c.pg(2).enlist(c.node(2).tm(), tx.context()).unwrap();
    own.execute(&insert(1), &[]).await.unwrap();
    let _: u64 = tx.call(&pgsql_at(3), insert(2)).await.unwrap();
    let _commit = tokio::spawn(tx.commit());
    assert_eq!(crashed.recv().await, Some(tid));
    c.crash(2);
    c.crash(3);
    let gid2 = Gid::new(tid, NodeId(2), DB).unwrap();
    let gid3 = Gid::new(tid, NodeId(3), DB).unwrap();

    c.restart(3, &server).await;
    let report = c.pg(3).wait_recovered().await.unwrap();
    assert_eq!(report.in_doubt, [gid3], "{report:?}");
    assert_eq!(report.others, 1);
    assert!(
        ids(&server).await.is_empty(),
        "nothing visible while in doubt"
    );
    assert_eq!(prepared(&server).await.len(), 2);

    c.restart(2, &server).await;
    let report = c.pg(2).wait_recovered().await.unwrap();
    assert_eq!(report.committed, [gid2], "{report:?}");
    wait_pg(&server, "both branches committed", |ids, gids| {
        ids == [1, 2] && gids.is_empty()
    })
    .await;
    wait_for("node 3's branch ended", Duration::from_secs(5), || {
        c.pg(3).stats().committed == 1
    })
    .await;
}

/// PostgreSQL itself crashes (kill -9) while a branch is prepared and its outcome not yet
/// delivered: the prepared transaction survives PostgreSQL's crash recovery, and phase two —
/// re-driven by the restarted coordinator — reconnects and commits it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prepared_branch_survives_a_postgres_crash() {
    let mut server = postgres(true).await; // fsync on: the PREPARE must be durable
    let (cfg2, mut crashed) = crash_at(CrashPoint::CoordinatorAfterCommitForce);
    let mut c = PgCluster::start(&server, 306, move |id| {
        if id == 2 {
            cfg2.clone()
        } else {
            TmConfig::default()
        }
    })
    .await;
    let tx = c.node(2).begin();
    let tid = tx.tid();
    let _: u64 = tx.call(&pgsql_at(3), insert(1)).await.unwrap();
    let _commit = tokio::spawn(tx.commit());
    assert_eq!(crashed.recv().await, Some(tid));
    c.crash(2);

    server.crash().unwrap();
    server.restart().unwrap_or_else(|e| panic!("{e}"));
    let gid3 = Gid::new(tid, NodeId(3), DB).unwrap();
    assert_eq!(
        prepared(&server).await,
        [gid3.to_string()],
        "survived the crash"
    );

    c.restart(2, &server).await;
    wait_pg(
        &server,
        "committed after PostgreSQL's crash",
        |ids, gids| ids == [1] && gids.is_empty(),
    )
    .await;
}
