//! Tests against a real PostgreSQL server. They fail — never skip — when PostgreSQL is missing:
//! CI installs it with `.ci/install-postgres.sh`.

use std::net::TcpStream;
use std::time::Duration;

use crate::client::connect;
use crate::server::{ServerError, ServerOptions, TempPostgres};

/// A fast server for tests: fsync off (a kill -9 of PostgreSQL loses nothing the OS has).
fn start() -> TempPostgres {
    TempPostgres::start(ServerOptions::default().fsync(false).shared_buffers_mb(32))
        .unwrap_or_else(|e| panic!("{e}"))
}

fn pid_alive(pid: u32) -> bool {
    // SAFETY: signal 0 only checks that the process exists.
    unsafe { libc::kill(pid as libc::pid_t, 0) == 0 }
}

async fn prepared_gids(client: &tokio_postgres::Client) -> Vec<String> {
    client
        .query("SELECT gid FROM pg_prepared_xacts ORDER BY gid", &[])
        .await
        .unwrap()
        .iter()
        .map(|row| row.get(0))
        .collect()
}

#[tokio::test]
async fn sql_round_trip_and_create_database() {
    let server = start();
    assert!(server.is_running());
    assert!(server.data_dir().join("PG_VERSION").exists());
    assert!(server
        .connection_string("bank")
        .contains(&server.port().to_string()));

    server.create_database("bank").await.unwrap();
    let db = connect(&server, "bank").await.unwrap();
    db.batch_execute("CREATE TABLE accounts (id int PRIMARY KEY, balance bigint NOT NULL)")
        .await
        .unwrap();
    for id in 1..=3_i32 {
        db.execute(
            "INSERT INTO accounts VALUES ($1, $2)",
            &[&id, &(i64::from(id) * 100)],
        )
        .await
        .unwrap();
    }
    let row = db
        .query_one("SELECT count(*), sum(balance)::bigint FROM accounts", &[])
        .await
        .unwrap();
    assert_eq!(row.get::<_, i64>(0), 3);
    assert_eq!(row.get::<_, i64>(1), 600);

    let settings = db
        .query_one(
            "SELECT current_setting('max_prepared_transactions'), current_setting('fsync')",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(settings.get::<_, String>(0), "128");
    assert_eq!(settings.get::<_, String>(1), "off");

    let err = server.create_database("bank").await.unwrap_err();
    assert!(matches!(err, ServerError::Sql(_)), "{err}");
    assert!(
        err.to_string().contains("42P04"),
        "server message missing: {err}"
    );
    let err = db.batch_execute("SELECT * FROM missing").await.unwrap_err();
    let text = crate::client::describe_error(&err);
    assert!(
        text.starts_with("ERROR 42P01: relation \"missing\" does not exist"),
        "{text}"
    );
}

#[tokio::test]
async fn prepare_transaction_is_listed_then_commit_prepared() {
    let server = start();
    let db = connect(&server, "postgres").await.unwrap();
    db.batch_execute("CREATE TABLE t (id int PRIMARY KEY)")
        .await
        .unwrap();

    db.batch_execute("BEGIN; INSERT INTO t VALUES (1); PREPARE TRANSACTION 'weft:test'")
        .await
        .unwrap();
    assert_eq!(prepared_gids(&db).await, ["weft:test"]);
    let visible: i64 = db
        .query_one("SELECT count(*) FROM t", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(visible, 0, "a prepared transaction is not visible yet");

    db.batch_execute("COMMIT PREPARED 'weft:test'")
        .await
        .unwrap();
    assert!(prepared_gids(&db).await.is_empty());
    let visible: i64 = db
        .query_one("SELECT count(*) FROM t", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(visible, 1);
}

#[tokio::test]
async fn prepared_transaction_survives_crash_and_restart() {
    let mut server = start();
    {
        let db = connect(&server, "postgres").await.unwrap();
        db.batch_execute("CREATE TABLE t (id int PRIMARY KEY)")
            .await
            .unwrap();
        db.batch_execute("BEGIN; INSERT INTO t VALUES (7); PREPARE TRANSACTION 'weft:crash'")
            .await
            .unwrap();
    }
    let old_pid = server.pid().unwrap();
    server.crash().unwrap();
    assert!(!server.is_running());
    assert!(!pid_alive(old_pid), "postmaster {old_pid} survived crash()");
    assert!(
        TcpStream::connect((server.host(), server.port())).is_err(),
        "port still open after crash()"
    );
    assert!(matches!(server.crash(), Err(ServerError::NotRunning)));

    server.restart().unwrap_or_else(|e| panic!("{e}"));
    assert!(
        server.log_tail(200).contains("redo"),
        "restart after crash() ran no crash recovery:\n{}",
        server.log_tail(200)
    );
    let db = connect(&server, "postgres").await.unwrap();
    assert_eq!(prepared_gids(&db).await, ["weft:crash"]);
    db.batch_execute("ROLLBACK PREPARED 'weft:crash'")
        .await
        .unwrap();
    assert!(prepared_gids(&db).await.is_empty());
    let rows: i64 = db
        .query_one("SELECT count(*) FROM t", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(rows, 0, "rolled-back prepared insert is visible");
}

#[tokio::test]
async fn stop_then_restart_keeps_data() {
    let mut server = start();
    let db = connect(&server, "postgres").await.unwrap();
    db.batch_execute("CREATE TABLE t (id int); INSERT INTO t VALUES (1)")
        .await
        .unwrap();
    server.stop().unwrap();
    assert!(!server.is_running());
    server.stop().unwrap(); // idempotent
    server.restart().unwrap();
    let db = connect(&server, "postgres").await.unwrap();
    let rows: i64 = db
        .query_one("SELECT count(*) FROM t", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(rows, 1);
}

#[test]
fn drop_stops_the_server_and_deletes_its_data() {
    let server = start();
    let pid = server.pid().unwrap();
    let port = server.port();
    let dir = server.data_dir().to_path_buf();
    assert!(TcpStream::connect(("127.0.0.1", port)).is_ok());
    drop(server);
    assert!(!pid_alive(pid), "postmaster {pid} still running after drop");
    let refused =
        TcpStream::connect_timeout(&([127, 0, 0, 1], port).into(), Duration::from_millis(500));
    assert!(refused.is_err(), "port {port} still open after drop");
    assert!(!dir.exists(), "{} not deleted", dir.display());
}

#[test]
fn drop_stops_the_server_during_a_panic() {
    let pid = std::sync::Mutex::new(None);
    let result = std::panic::catch_unwind(|| {
        let server = start();
        *pid.lock().unwrap() = server.pid();
        panic!("test body failed");
    });
    assert!(result.is_err());
    let pid = pid.lock().unwrap().expect("server started");
    assert!(!pid_alive(pid), "postmaster {pid} survived a panic");
}

#[test]
fn startup_failure_carries_the_log_tail() {
    let err = TempPostgres::start(
        ServerOptions::default()
            .fsync(false)
            .setting("shared_buffers", "lots"),
    )
    .unwrap_err();
    let text = err.to_string();
    assert!(matches!(err, ServerError::Start { .. }), "{text}");
    assert!(text.starts_with("PostgreSQL failed to start"), "{text}");
    assert!(text.contains("shared_buffers"), "log tail missing:\n{text}");
}

#[test]
fn invalid_options_are_refused_before_anything_runs() {
    let err = TempPostgres::start(ServerOptions::default().max_connections(0)).unwrap_err();
    assert!(matches!(err, ServerError::InvalidOption(_)), "{err}");
    let err = TempPostgres::start(ServerOptions::default().setting("bad name", "1")).unwrap_err();
    assert!(matches!(err, ServerError::InvalidOption(_)), "{err}");
}

#[test]
fn explicit_bin_dir_without_postgres_is_not_found() {
    let dir = tempfile::tempdir().unwrap();
    let err = TempPostgres::start(ServerOptions::default().bin_dir(dir.path())).unwrap_err();
    assert!(
        err.to_string()
            .starts_with("PostgreSQL not found: install postgresql-15 or set WEFT_PG_BIN"),
        "{err}"
    );
}

#[test]
fn crash_then_drop_leaves_no_process_or_shared_memory() {
    let mut server = start();
    let pid = server.pid().unwrap();
    let pid_file = std::fs::read_to_string(server.data_dir().join("postmaster.pid")).unwrap();
    let key: libc::key_t = pid_file
        .lines()
        .nth(6)
        .unwrap()
        .split_whitespace()
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert!(segment_exists(key), "no segment for key {key}");
    server.crash().unwrap();
    drop(server);
    assert!(!pid_alive(pid));
    assert!(
        !segment_exists(key),
        "segment {key} leaked after crash + drop"
    );
}

fn segment_exists(key: libc::key_t) -> bool {
    // SAFETY: shmget with size 0 and no flags only looks the segment up.
    unsafe { libc::shmget(key, 0, 0) >= 0 }
}

/// Whether `pid` is gone or a zombie (an orphan's zombie may wait a while for its reaper).
fn process_gone(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(stat) => stat
            .rfind(')')
            .and_then(|i| stat[i + 1..].split_whitespace().next())
            .is_some_and(|state| state == "Z" || state == "X"),
    }
}

const CHILD_ENV: &str = "WEFT_PG_TEST_HARNESS_CHILD";

/// Helper for `postmaster_dies_with_the_harness_process`: a harness that starts a server, says
/// where it is, and waits to be killed.
#[test]
#[ignore = "run only as a child of postmaster_dies_with_the_harness_process"]
fn harness_child_that_gets_killed() {
    if std::env::var_os(CHILD_ENV).is_none() {
        return;
    }
    let server = start();
    println!(
        "POSTMASTER {} {}",
        server.pid().unwrap(),
        server.socket_dir().display()
    );
    std::thread::sleep(Duration::from_secs(120));
}

#[test]
fn postmaster_dies_with_the_harness_process() {
    use std::io::BufRead as _;
    /// Kills the child harness if this test fails before it does.
    struct KillOnDrop(std::process::Child);
    impl Drop for KillOnDrop {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "tests::harness_child_that_gets_killed"])
        .args(["--include-ignored", "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, "1")
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut child = KillOnDrop(child);
    let mut seen = Vec::new();
    let line = stdout
        .lines()
        .map_while(Result::ok)
        .inspect(|l| seen.push(l.clone()))
        // libtest prints "test <name> ... " before it on the same line
        .find_map(|l| Some(l.split_once("POSTMASTER ")?.1.to_owned()))
        .unwrap_or_else(|| panic!("child harness failed:\n{}", seen.join("\n")));
    let mut fields = line.split_whitespace();
    let pid: u32 = fields.next().unwrap().parse().unwrap();
    let dir = std::path::PathBuf::from(fields.next().unwrap());
    assert!(pid_alive(pid));

    child.0.kill().unwrap(); // SIGKILL: no destructor runs in the child
    child.0.wait().unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !process_gone(pid) && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let gone = process_gone(pid);
    // The killed harness could clean up nothing: do it for it.
    crate::server::remove_orphaned_shared_memory(&dir.join("data"));
    let _ = std::fs::remove_dir_all(&dir);
    assert!(gone, "postmaster {pid} outlived its SIGKILLed harness");
}

#[test]
fn handles_can_be_shared_across_tasks() {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<TempPostgres>();
    send_sync::<ServerError>();
}
