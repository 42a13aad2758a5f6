//! Smoke runs of both baselines against a real server. They fail — never skip — when
//! PostgreSQL is missing: CI installs it with `.ci/install-postgres.sh`.

use std::time::Duration;

use weft_pg::{ServerOptions, TempPostgres};

use crate::{pg2pc, pgbench, BenchError};

/// Equal up to float rounding in a JSON round trip.
fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * a.abs().max(b.abs())
}

/// A benchmark server: fsync on, as the baselines require.
fn start() -> TempPostgres {
    TempPostgres::start(ServerOptions::default().shared_buffers_mb(32))
        .unwrap_or_else(|e| panic!("{e}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg2pc_smoke_run() {
    let server = start();
    let report = pg2pc::run(&server, 2, Duration::from_secs(1))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(report.tps > 0.0, "{report:?}");
    assert!(report.committed > 0 && report.errors == 0, "{report:?}");
    assert!(report.fsync);
    assert!(report.latency_p50_us > 0 && report.latency_p50_us <= report.latency_p99_us);
    assert!(report.latency_p99_us <= report.latency_max_us);
    assert!(report.duration_secs >= 1.0, "{report:?}");

    // Every transaction committed exactly one increment, and none is left prepared.
    let db = weft_pg::client::connect(&server, pg2pc::DATABASE)
        .await
        .unwrap();
    let total: i64 = db
        .query_one("SELECT sum(balance)::bigint FROM accounts", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(total as u64, report.committed);
    let prepared: i64 = db
        .query_one("SELECT count(*) FROM pg_prepared_xacts", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(prepared, 0);

    let json = serde_json::to_string(&report).unwrap();
    let back: pg2pc::Pg2pcReport = serde_json::from_str(&json).unwrap();
    // serde_json may round a float's last bit; everything else must come back exactly.
    assert!(close(back.tps, report.tps) && close(back.duration_secs, report.duration_secs));
    let back = pg2pc::Pg2pcReport {
        tps: report.tps,
        duration_secs: report.duration_secs,
        latency_mean_us: report.latency_mean_us,
        ..back
    };
    assert_eq!(back, report);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pgbench_smoke_run() {
    let server = start();
    let report = pgbench::run(&server, 1, 2, Duration::from_secs(2))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(report.tps > 0.0, "{report:?}");
    assert!(report.transactions > 0, "{report:?}");
    assert_eq!(report.failed_transactions, Some(0));
    assert!(report.latency_avg_ms > 0.0);
    assert_eq!(
        (report.clients, report.threads, report.duration_secs),
        (2, 2, 2)
    );

    let json = serde_json::to_string(&report).unwrap();
    let back: pgbench::PgbenchReport = serde_json::from_str(&json).unwrap();
    assert!(close(back.tps, report.tps));
    let back = pgbench::PgbenchReport {
        tps: report.tps,
        latency_avg_ms: report.latency_avg_ms,
        initial_connection_ms: report.initial_connection_ms,
        ..back
    };
    assert_eq!(back, report);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_function_script_runs_the_whole_tpcb_transaction_in_one_call() {
    let server = start();
    let options = pgbench::PgbenchOptions::new(1, 2, Duration::from_secs(2))
        .script(pgbench::Script::Function);
    let report = pgbench::run_with(&server, &options)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(report.script, pgbench::Script::Function);
    assert!(report.transactions > 0, "{report:?}");
    assert_eq!(report.failed_transactions, Some(0));
    // Every call made all four changes: one history row each, and the deltas add up on the
    // accounts, the tellers and the branches alike (TPC-B's consistency condition).
    let db = weft_pg::client::connect(&server, pgbench::DATABASE)
        .await
        .unwrap();
    let row = db
        .query_one(
            "SELECT (SELECT count(*) FROM pgbench_history), \
                    (SELECT coalesce(sum(delta), 0) FROM pgbench_history), \
                    (SELECT sum(abalance) FROM pgbench_accounts), \
                    (SELECT sum(tbalance) FROM pgbench_tellers), \
                    (SELECT sum(bbalance) FROM pgbench_branches)",
            &[],
        )
        .await
        .unwrap();
    let history: i64 = row.get(0);
    let deltas: i64 = row.get(1);
    let (accounts, tellers, branches): (i64, i64, i64) = (row.get(2), row.get(3), row.get(4));
    assert!(
        history as u64 >= report.transactions,
        "{history} rows for {report:?}"
    );
    assert_eq!((accounts, tellers, branches), (deltas, deltas, deltas));
}

#[tokio::test]
async fn baselines_refuse_a_server_without_fsync() {
    let server = TempPostgres::start(ServerOptions::default().fsync(false).shared_buffers_mb(32))
        .unwrap_or_else(|e| panic!("{e}"));
    let err = pg2pc::run(&server, 1, Duration::from_secs(1))
        .await
        .unwrap_err();
    assert!(matches!(err, BenchError::FsyncOff), "{err}");
    let err = pgbench::run(&server, 1, 1, Duration::from_secs(1))
        .await
        .unwrap_err();
    assert!(matches!(err, BenchError::FsyncOff), "{err}");
}

#[tokio::test]
async fn parameters_beyond_server_limits_are_invalid() {
    let server = TempPostgres::start(
        ServerOptions::default()
            .max_prepared_transactions(4)
            .shared_buffers_mb(32),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let err = pg2pc::run(&server, 5, Duration::from_secs(1))
        .await
        .unwrap_err();
    assert!(matches!(err, BenchError::Invalid(_)), "{err}");
    let err = pg2pc::run(&server, 0, Duration::from_secs(1))
        .await
        .unwrap_err();
    assert!(matches!(err, BenchError::Invalid(_)), "{err}");
    let err = pgbench::run(&server, 0, 1, Duration::from_secs(1))
        .await
        .unwrap_err();
    assert!(matches!(err, BenchError::Invalid(_)), "{err}");
}
