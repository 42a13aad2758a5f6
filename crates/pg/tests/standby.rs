//! `TempPostgres::start_standby`: a streaming standby of a temporary primary that the
//! primary can wait for synchronously. Fails, never skips, when PostgreSQL is missing (the
//! README's test command installs it).

use weft_pg::{client, ServerError, ServerOptions, TempPostgres};

fn options() -> ServerOptions {
    ServerOptions::default()
        .fsync(false)
        .shared_buffers_mb(16)
        .max_connections(20)
        .max_prepared_transactions(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_synchronous_standby_holds_every_commit_the_primary_acknowledged() {
    let primary = TempPostgres::start(options()).unwrap_or_else(|e| panic!("{e}"));
    let db = client::connect(&primary, "postgres").await.unwrap();
    db.batch_execute("CREATE TABLE t (id int PRIMARY KEY)")
        .await
        .unwrap();
    let standby =
        TempPostgres::start_standby(&primary, "s1", options()).unwrap_or_else(|e| panic!("{e}"));
    primary.make_standbys_synchronous(&["s1"]).await.unwrap();
    let names: String = db
        .query_one("SHOW synchronous_standby_names", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(names, "FIRST 1 (s1)");
    // remote_apply: the commit returns once the standby has applied it, so it is visible there.
    db.batch_execute("SET synchronous_commit = remote_apply")
        .await
        .unwrap();
    db.batch_execute("INSERT INTO t VALUES (7)").await.unwrap();
    let replica = client::connect(&standby, "postgres").await.unwrap();
    let ids: Vec<i32> = replica
        .query("SELECT id FROM t", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(ids, vec![7]);
    let in_recovery: bool = replica
        .query_one("SELECT pg_is_in_recovery()", &[])
        .await
        .unwrap()
        .get(0);
    assert!(in_recovery, "the standby is a standby");
}

#[test]
fn a_standby_name_that_is_not_an_identifier_is_refused_before_anything_starts() {
    let primary = TempPostgres::start(options()).unwrap_or_else(|e| panic!("{e}"));
    for bad in ["", "s 1", "s1'; DROP", &"s".repeat(64)] {
        match TempPostgres::start_standby(&primary, bad, options()) {
            Err(ServerError::InvalidOption(_)) => {}
            other => panic!("{bad:?}: {other:?}"),
        }
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    match runtime.block_on(primary.make_standbys_synchronous(&["s1', 'x"])) {
        Err(ServerError::InvalidOption(_)) => {}
        other => panic!("{other:?}"),
    }
}
