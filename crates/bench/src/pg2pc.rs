//! PostgreSQL's own two-phase commit, as a baseline for weft's commit protocol.
//!
//! Owns: the `weft_pg2pc` database on the server it is given (its `accounts` table is dropped
//! and refilled on every run) and the prepared transactions named `bench-<client>-<n>`. Each
//! client runs, back to back: `BEGIN`; `UPDATE accounts SET balance = balance + 1 WHERE id = $1`
//! (a random row); `PREPARE TRANSACTION`; `COMMIT PREPARED` — one participant's work, prepare and
//! commit, four round trips, two WAL forces.
//!
//! Must never: run against a server with fsync off, or leave a prepared transaction behind
//! (a failed one is rolled back; leftovers of an interrupted run are rolled back at the start of
//! the next one).

use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};
use tokio_postgres::{Client, Statement};
use weft_pg::{client, TempPostgres};

use crate::{ensure_database, require_fsync, BenchError, MAX_DURATION};

/// The database the benchmark owns.
pub const DATABASE: &str = "weft_pg2pc";

/// Rows in `accounts` unless [`Pg2pcOptions::rows`] says otherwise.
pub const DEFAULT_ROWS: u32 = 10_000;

/// Distinct error messages a report keeps (the count is always complete).
pub const MAX_ERROR_SAMPLES: usize = 8;

/// Largest latency the histogram records, in µs (one hour); longer ones are clamped.
const MAX_LATENCY_US: u64 = 3_600_000_000;

/// Parameters of a [`run_with`].
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Pg2pcOptions {
    /// Concurrent connections, each running transactions back to back (1..=max_connections-3,
    /// and at most the server's `max_prepared_transactions`).
    pub clients: usize,
    /// How long clients keep starting transactions.
    pub duration: Duration,
    /// Rows in `accounts`; each transaction updates one at random.
    pub rows: u32,
}

impl Pg2pcOptions {
    /// `clients` clients for `duration` over [`DEFAULT_ROWS`] rows.
    pub fn new(clients: usize, duration: Duration) -> Self {
        Pg2pcOptions {
            clients,
            duration,
            rows: DEFAULT_ROWS,
        }
    }
}

/// What a [`run`] measured.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Pg2pcReport {
    /// Concurrent clients.
    pub clients: usize,
    /// Rows in `accounts`.
    pub rows: u32,
    /// Measured wall time from the first transaction to the last one's end, in seconds.
    pub duration_secs: f64,
    /// Transactions that reached `COMMIT PREPARED` successfully.
    pub committed: u64,
    /// Transactions that failed at any step (and were rolled back).
    pub errors: u64,
    /// `committed / duration_secs`.
    pub tps: f64,
    /// Median latency of a committed transaction, `BEGIN` to `COMMIT PREPARED` done, in µs.
    pub latency_p50_us: u64,
    /// 99th percentile latency, in µs.
    pub latency_p99_us: u64,
    /// Mean latency, in µs.
    pub latency_mean_us: f64,
    /// Worst latency, in µs.
    pub latency_max_us: u64,
    /// The server's `fsync` (always true: runs with it off are refused).
    pub fsync: bool,
    /// The server's `server_version`.
    pub server_version: String,
    /// Up to [`MAX_ERROR_SAMPLES`] distinct error messages.
    pub error_samples: Vec<String>,
}

/// Runs the benchmark with `clients` clients for `duration` over [`DEFAULT_ROWS`] rows.
///
/// # Errors
/// As for [`run_with`].
pub async fn run(
    server: &TempPostgres,
    clients: usize,
    duration: Duration,
) -> Result<Pg2pcReport, BenchError> {
    run_with(server, &Pg2pcOptions::new(clients, duration)).await
}

/// Runs the benchmark as `options` say. Must be called inside a tokio runtime; clients are
/// spawned as tasks, so a multi-threaded runtime measures the server rather than the driver.
///
/// # Errors
/// [`BenchError::Invalid`] for parameters out of range or beyond the server's connection or
/// prepared-transaction limits, [`BenchError::FsyncOff`], [`BenchError::Sql`] or
/// [`BenchError::Server`] when setup or connecting fails, [`BenchError::Worker`] if a client task
/// panics. Failed transactions are counted in the report, not returned.
pub async fn run_with(
    server: &TempPostgres,
    options: &Pg2pcOptions,
) -> Result<Pg2pcReport, BenchError> {
    validate(server, options)?;
    let admin = connect(server, "postgres").await?;
    require_fsync(&admin).await?;
    let limit: usize = show(&admin, "max_prepared_transactions")
        .await?
        .parse()
        .map_err(|_| BenchError::Invalid("unreadable max_prepared_transactions".into()))?;
    if options.clients > limit {
        return Err(BenchError::Invalid(format!(
            "{} clients need {} prepared transactions at once; the server allows {limit}",
            options.clients, options.clients
        )));
    }
    let server_version = show(&admin, "server_version").await?;
    ensure_database(server, &admin, DATABASE).await?;
    drop(admin);

    let setup = connect(server, DATABASE).await?;
    prepare_table(&setup, options.rows).await?;
    drop(setup);

    // Connect every client before the clock starts, so connection set-up is not measured.
    let mut clients = Vec::with_capacity(options.clients);
    for _ in 0..options.clients {
        let db = connect(server, DATABASE).await?;
        let update = db
            .prepare("UPDATE accounts SET balance = balance + 1 WHERE id = $1")
            .await
            .map_err(sql("preparing the update"))?;
        clients.push((db, update));
    }

    let start = Instant::now();
    let end = start + options.duration;
    let rows = i32::try_from(options.rows).expect("validated");
    let tasks: Vec<_> = clients
        .into_iter()
        .enumerate()
        .map(|(n, (db, update))| tokio::spawn(client_loop(n, db, update, rows, end)))
        .collect();

    let mut histogram = new_histogram();
    let mut committed = 0;
    let mut errors = 0;
    let mut error_samples: Vec<String> = Vec::new();
    let mut last_done = start;
    for task in tasks {
        let result = task.await.map_err(|e| BenchError::Worker(e.to_string()))?;
        histogram
            .add(&result.histogram)
            .expect("histograms share bounds");
        committed += result.committed;
        errors += result.errors;
        for sample in result.error_samples {
            if error_samples.len() < MAX_ERROR_SAMPLES && !error_samples.contains(&sample) {
                error_samples.push(sample);
            }
        }
        last_done = last_done.max(result.done);
    }
    debug_assert_eq!(histogram.len(), committed, "one latency per commit");

    let duration_secs = (last_done - start).as_secs_f64().max(f64::EPSILON);
    let latency = |q: f64| {
        if committed == 0 {
            0
        } else {
            histogram.value_at_quantile(q)
        }
    };
    Ok(Pg2pcReport {
        clients: options.clients,
        rows: options.rows,
        duration_secs,
        committed,
        errors,
        tps: committed as f64 / duration_secs,
        latency_p50_us: latency(0.5),
        latency_p99_us: latency(0.99),
        latency_mean_us: if committed == 0 {
            0.0
        } else {
            histogram.mean()
        },
        latency_max_us: if committed == 0 { 0 } else { histogram.max() },
        fsync: true,
        server_version,
        error_samples,
    })
}

fn validate(server: &TempPostgres, options: &Pg2pcOptions) -> Result<(), BenchError> {
    // Three connections stay free: the admin one, the setup one, and one for whoever watches.
    let max_clients = (server.options().connections() as usize).saturating_sub(3);
    if !(1..=max_clients).contains(&options.clients) {
        return Err(BenchError::Invalid(format!(
            "clients {} not in 1..={max_clients} (the server's max_connections less 3)",
            options.clients
        )));
    }
    if options.duration.is_zero() || options.duration > MAX_DURATION {
        return Err(BenchError::Invalid(format!(
            "duration {:?} not in (0, {MAX_DURATION:?}]",
            options.duration
        )));
    }
    if options.rows == 0 || i32::try_from(options.rows).is_err() {
        return Err(BenchError::Invalid(format!(
            "rows {} not in 1..={}",
            options.rows,
            i32::MAX
        )));
    }
    Ok(())
}

async fn connect(server: &TempPostgres, db: &str) -> Result<Client, BenchError> {
    client::connect(server, db).await.map_err(sql("connecting"))
}

async fn show(client: &Client, setting: &str) -> Result<String, BenchError> {
    Ok(client
        .query_one("SELECT current_setting($1)", &[&setting])
        .await
        .map_err(sql("reading a server setting"))?
        .get(0))
}

/// Rolls back this benchmark's leftover prepared transactions, then (re)creates and fills
/// `accounts`.
async fn prepare_table(db: &Client, rows: u32) -> Result<(), BenchError> {
    let leftovers = db
        .query(
            "SELECT gid FROM pg_prepared_xacts \
             WHERE database = current_database() AND gid LIKE 'bench-%'",
            &[],
        )
        .await
        .map_err(sql("listing leftover prepared transactions"))?;
    for row in leftovers {
        let gid: String = row.get(0);
        db.batch_execute(&format!("ROLLBACK PREPARED {}", quote_literal(&gid)))
            .await
            .map_err(sql("rolling back a leftover prepared transaction"))?;
    }
    db.batch_execute(
        "DROP TABLE IF EXISTS accounts; \
         CREATE TABLE accounts (id int PRIMARY KEY, balance bigint NOT NULL)",
    )
    .await
    .map_err(sql("creating accounts"))?;
    let rows = i32::try_from(rows).expect("validated");
    db.execute(
        "INSERT INTO accounts SELECT g, 0 FROM generate_series(1, $1) AS g",
        &[&rows],
    )
    .await
    .map_err(sql("filling accounts"))?;
    // One statement per call: VACUUM cannot run inside the implicit transaction of a batch.
    for statement in ["VACUUM ANALYZE accounts", "CHECKPOINT"] {
        db.batch_execute(statement)
            .await
            .map_err(sql("vacuuming accounts"))?;
    }
    Ok(())
}

/// What one client did.
struct ClientResult {
    committed: u64,
    errors: u64,
    histogram: Histogram<u64>,
    error_samples: Vec<String>,
    done: Instant,
}

/// One client: transactions back to back until `end`.
async fn client_loop(
    client_no: usize,
    db: Client,
    update: Statement,
    rows: i32,
    end: Instant,
) -> ClientResult {
    let mut rng = rand::rngs::StdRng::from_entropy();
    let mut result = ClientResult {
        committed: 0,
        errors: 0,
        histogram: new_histogram(),
        error_samples: Vec::new(),
        done: Instant::now(),
    };
    let mut n: u64 = 0;
    while Instant::now() < end {
        n += 1;
        let gid = format!("bench-{client_no}-{n}");
        let id: i32 = rng.gen_range(1..=rows);
        let began = Instant::now();
        match transaction(&db, &update, id, &gid).await {
            Ok(()) => {
                let micros = u64::try_from(began.elapsed().as_micros()).unwrap_or(u64::MAX);
                result
                    .histogram
                    .saturating_record(micros.clamp(1, MAX_LATENCY_US));
                result.committed += 1;
            }
            Err((step, error)) => {
                result.errors += 1;
                let sample = format!("{step}: {}", client::describe_error(&error));
                if result.error_samples.len() < MAX_ERROR_SAMPLES
                    && !result.error_samples.contains(&sample)
                {
                    result.error_samples.push(sample);
                }
                if db.is_closed() {
                    break;
                }
                clean_up(&db, step, &gid).await;
            }
        }
    }
    result.done = Instant::now();
    result
}

/// The step a transaction failed at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
    Begin,
    Update,
    Prepare,
    CommitPrepared,
}

impl std::fmt::Display for Step {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Step::Begin => "BEGIN",
            Step::Update => "UPDATE",
            Step::Prepare => "PREPARE TRANSACTION",
            Step::CommitPrepared => "COMMIT PREPARED",
        })
    }
}

async fn transaction(
    db: &Client,
    update: &Statement,
    id: i32,
    gid: &str,
) -> Result<(), (Step, tokio_postgres::Error)> {
    db.batch_execute("BEGIN")
        .await
        .map_err(|e| (Step::Begin, e))?;
    let updated = db
        .execute(update, &[&id])
        .await
        .map_err(|e| (Step::Update, e))?;
    debug_assert_eq!(updated, 1, "row {id} missing from accounts");
    db.batch_execute(&format!("PREPARE TRANSACTION '{gid}'"))
        .await
        .map_err(|e| (Step::Prepare, e))?;
    db.batch_execute(&format!("COMMIT PREPARED '{gid}'"))
        .await
        .map_err(|e| (Step::CommitPrepared, e))?;
    Ok(())
}

/// Leaves the connection outside any transaction and `gid` not prepared. Errors are ignored:
/// there is nothing left to undo when these fail.
async fn clean_up(db: &Client, failed: Step, gid: &str) {
    match failed {
        // A failed PREPARE TRANSACTION already rolled the transaction back.
        Step::Begin | Step::Update | Step::Prepare => {
            let _ = db.batch_execute("ROLLBACK").await;
        }
        Step::CommitPrepared => {
            let _ = db
                .batch_execute(&format!("ROLLBACK PREPARED '{gid}'"))
                .await;
        }
    }
}

fn new_histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, MAX_LATENCY_US, 3).expect("valid histogram bounds")
}

fn quote_literal(s: &str) -> String {
    format!("'{}'", s.replace('\'', "''"))
}

fn sql(context: &'static str) -> impl FnOnce(tokio_postgres::Error) -> BenchError {
    move |source| BenchError::Sql { context, source }
}
