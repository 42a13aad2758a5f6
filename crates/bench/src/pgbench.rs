//! `pgbench`'s TPC-B-like run, as a baseline for weft's DebitCredit: the stock script (seven
//! client round trips a transaction) or the same transaction as one PL/pgSQL function call
//! (one round trip, what a PostgreSQL engineer would deploy against weft's one-call
//! transactions).
//!
//! Owns: the `weft_pgbench` database on the server it is given (re-initialised by
//! `pgbench -i` on every run), the `weft_tpcb` function and the custom script that calls it,
//! the two `pgbench` processes of a run, and the parsing of pgbench's summary (PostgreSQL 15's
//! format, and the older "excluding connections establishing" one).
//!
//! Must never: run against a server with fsync off, or leave a `pgbench` process behind — the
//! processes are killed if the future running them is dropped.

use std::process::Output;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use weft_pg::TempPostgres;

use crate::{ensure_database, require_fsync, BenchError, MAX_DURATION};

/// The database the benchmark owns.
pub const DATABASE: &str = "weft_pgbench";

/// Largest scale factor accepted (each unit is 100 000 accounts, about 15 MB).
pub const MAX_SCALE: u32 = 10_000;

/// How pgbench sends its statements (`-M`).
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum QueryMode {
    /// One round trip with the query text each time.
    Simple,
    /// Extended protocol, re-parsed each time.
    Extended,
    /// Extended protocol with statements prepared once per connection (the default here).
    #[default]
    Prepared,
}

impl QueryMode {
    fn as_arg(self) -> &'static str {
        match self {
            QueryMode::Simple => "simple",
            QueryMode::Extended => "extended",
            QueryMode::Prepared => "prepared",
        }
    }
}

/// Which transaction script pgbench runs.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Script {
    /// pgbench's built-in `tpcb-like`: three updates, a select and an insert, each its own
    /// round trip, inside `BEGIN`/`END`.
    #[default]
    Stock,
    /// The same five statements in the PL/pgSQL function [`FUNCTION_SQL`], called by one
    /// `SELECT` (one round trip, one transaction).
    Function,
}

/// The TPC-B transaction as a server-side function: the account, teller and branch updates,
/// the history row, and the account's new balance returned (the stock script's `SELECT`).
pub const FUNCTION_SQL: &str = "\
CREATE OR REPLACE FUNCTION weft_tpcb(p_aid int, p_bid int, p_tid int, p_delta int)
RETURNS int LANGUAGE plpgsql AS $$
DECLARE
    balance int;
BEGIN
    UPDATE pgbench_accounts SET abalance = abalance + p_delta WHERE aid = p_aid
        RETURNING abalance INTO balance;
    UPDATE pgbench_tellers SET tbalance = tbalance + p_delta WHERE tid = p_tid;
    UPDATE pgbench_branches SET bbalance = bbalance + p_delta WHERE bid = p_bid;
    INSERT INTO pgbench_history (tid, bid, aid, delta, mtime)
        VALUES (p_tid, p_bid, p_aid, p_delta, CURRENT_TIMESTAMP);
    RETURN balance;
END
$$";

/// The pgbench script that calls [`FUNCTION_SQL`] with the stock script's random choices.
pub const FUNCTION_SCRIPT: &str = "\
\\set aid random(1, 100000 * :scale)
\\set bid random(1, 1 * :scale)
\\set tid random(1, 10 * :scale)
\\set delta random(-5000, 5000)
SELECT weft_tpcb(:aid, :bid, :tid, :delta);
";

/// Parameters of a [`run_with`].
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct PgbenchOptions {
    /// Scale factor for `pgbench -i -s` (1..=[`MAX_SCALE`]).
    pub scale: u32,
    /// Concurrent clients (`-c`; 1..=max_connections-3).
    pub clients: u32,
    /// pgbench worker threads (`-j`); `None` means `min(clients, 2)`.
    pub threads: Option<u32>,
    /// Run length (`-T`, rounded up to whole seconds, at least 1).
    pub duration: Duration,
    /// Protocol (`-M`).
    pub query_mode: QueryMode,
    /// Connect through the Unix socket instead of TCP to 127.0.0.1 (the default, which is how
    /// [`crate::pg2pc`] connects, so the two baselines pay the same transport).
    pub unix_socket: bool,
    /// The stock script or the one-call function.
    #[serde(default)]
    pub script: Script,
}

impl PgbenchOptions {
    /// `clients` clients on a scale-`scale` database for `duration`, prepared statements, TCP.
    pub fn new(scale: u32, clients: u32, duration: Duration) -> Self {
        PgbenchOptions {
            scale,
            clients,
            threads: None,
            duration,
            query_mode: QueryMode::Prepared,
            unix_socket: false,
            script: Script::Stock,
        }
    }

    /// The same run with `script`.
    pub fn script(mut self, script: Script) -> Self {
        self.script = script;
        self
    }

    fn threads(&self) -> u32 {
        self.threads.unwrap_or(self.clients.min(2))
    }

    fn seconds(&self) -> u64 {
        self.duration.as_secs() + u64::from(self.duration.subsec_nanos() > 0)
    }
}

/// What a [`run`] measured, from pgbench's own summary.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct PgbenchReport {
    /// Scale factor.
    pub scale: u32,
    /// Concurrent clients.
    pub clients: u32,
    /// pgbench worker threads.
    pub threads: u32,
    /// Requested run length in seconds (`-T`).
    pub duration_secs: u64,
    /// `-M` mode.
    pub query_mode: QueryMode,
    /// Which script ran.
    #[serde(default)]
    pub script: Script,
    /// Transactions pgbench completed ("number of transactions actually processed").
    pub transactions: u64,
    /// Failed transactions, when pgbench reports them (PostgreSQL 15 and later).
    pub failed_transactions: Option<u64>,
    /// Transactions per second, without initial connection time.
    pub tps: f64,
    /// Average latency in milliseconds.
    pub latency_avg_ms: f64,
    /// Time to open the connections, in milliseconds, when reported.
    pub initial_connection_ms: Option<f64>,
    /// The server's `fsync` (always true: runs with it off are refused).
    pub fsync: bool,
    /// pgbench's banner, e.g. `15.18 (Debian 15.18-0+deb12u1)`, when printed.
    pub pgbench_version: Option<String>,
}

/// Runs `pgbench -i -s scale`, then `clients` clients for `duration` with prepared statements.
///
/// # Errors
/// As for [`run_with`].
pub async fn run(
    server: &TempPostgres,
    scale: u32,
    clients: u32,
    duration: Duration,
) -> Result<PgbenchReport, BenchError> {
    run_with(server, &PgbenchOptions::new(scale, clients, duration)).await
}

/// Initialises [`DATABASE`] with `pgbench -i` and runs the default TPC-B-like script as
/// `options` say, as the `postgres` OS user when the harness is root.
///
/// # Errors
/// [`BenchError::Invalid`] for parameters out of range, [`BenchError::FsyncOff`],
/// [`BenchError::Sql`]/[`BenchError::Server`] when the server cannot be reached or prepared,
/// [`BenchError::Io`] if pgbench cannot be run, [`BenchError::Pgbench`] (with its stderr) when it
/// fails, [`BenchError::PgbenchOutput`] when its summary cannot be parsed.
pub async fn run_with(
    server: &TempPostgres,
    options: &PgbenchOptions,
) -> Result<PgbenchReport, BenchError> {
    validate(server, options)?;
    let admin = weft_pg::client::connect(server, "postgres")
        .await
        .map_err(|source| BenchError::Sql {
            context: "connecting",
            source,
        })?;
    require_fsync(&admin).await?;
    ensure_database(server, &admin, DATABASE).await?;
    drop(admin);

    let scale = options.scale.to_string();
    let init = pgbench(server, options, &["-i", "-q", "-s", &scale], "initialize").await?;
    drop(init);

    let clients = options.clients.to_string();
    let threads = options.threads().to_string();
    let seconds = options.seconds().to_string();
    let mut args: Vec<String> = [
        "-c",
        &clients,
        "-j",
        &threads,
        "-T",
        &seconds,
        "-M",
        options.query_mode.as_arg(),
    ]
    .map(str::to_owned)
    .to_vec();
    if options.script == Script::Function {
        let script = install_function(server).await?;
        // A custom script's :scale is 1 unless given (pgbench reads it from the tables only
        // for its built-in scripts).
        args.extend(["-s".to_owned(), scale.clone(), "-f".to_owned(), script]);
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = pgbench(server, options, &args, "run").await?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let summary = parse_summary(&stdout).map_err(|reason| BenchError::PgbenchOutput {
        reason,
        stdout: stdout.clone().into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    })?;
    Ok(PgbenchReport {
        scale: options.scale,
        clients: options.clients,
        threads: options.threads(),
        duration_secs: options.seconds(),
        query_mode: options.query_mode,
        script: options.script,
        transactions: summary.transactions,
        failed_transactions: summary.failed_transactions,
        tps: summary.tps,
        latency_avg_ms: summary.latency_avg_ms,
        initial_connection_ms: summary.initial_connection_ms,
        fsync: true,
        pgbench_version: summary.version,
    })
}

/// Creates [`FUNCTION_SQL`] in [`DATABASE`] and writes [`FUNCTION_SCRIPT`] into the server's
/// temporary directory (readable by the OS user pgbench runs as); returns the script's path.
async fn install_function(server: &TempPostgres) -> Result<String, BenchError> {
    let db = weft_pg::client::connect(server, DATABASE)
        .await
        .map_err(|source| BenchError::Sql {
            context: "connecting",
            source,
        })?;
    db.batch_execute(FUNCTION_SQL)
        .await
        .map_err(|source| BenchError::Sql {
            context: "creating the weft_tpcb function",
            source,
        })?;
    let path = server.socket_dir().join("weft_tpcb.sql");
    std::fs::write(&path, FUNCTION_SCRIPT).map_err(|source| BenchError::Io {
        context: format!("writing {}", path.display()),
        source,
    })?;
    Ok(path.to_string_lossy().into_owned())
}

fn validate(server: &TempPostgres, options: &PgbenchOptions) -> Result<(), BenchError> {
    let invalid = |msg: String| Err(BenchError::Invalid(msg));
    if !(1..=MAX_SCALE).contains(&options.scale) {
        return invalid(format!("scale {} not in 1..={MAX_SCALE}", options.scale));
    }
    let max_clients = server.options().connections().saturating_sub(3);
    if !(1..=max_clients).contains(&options.clients) {
        return invalid(format!(
            "clients {} not in 1..={max_clients} (the server's max_connections less 3)",
            options.clients
        ));
    }
    if !(1..=options.clients).contains(&options.threads()) {
        return invalid(format!(
            "threads {} not in 1..={} (clients)",
            options.threads(),
            options.clients
        ));
    }
    if options.duration.is_zero() || options.duration > MAX_DURATION {
        return invalid(format!(
            "duration {:?} not in (0, {MAX_DURATION:?}]",
            options.duration
        ));
    }
    Ok(())
}

/// Runs pgbench with the connection arguments for `server` plus `args`, on [`DATABASE`].
async fn pgbench(
    server: &TempPostgres,
    options: &PgbenchOptions,
    args: &[&str],
    phase: &'static str,
) -> Result<Output, BenchError> {
    let host = if options.unix_socket {
        server.socket_dir().to_string_lossy().into_owned()
    } else {
        server.host().to_owned()
    };
    let mut cmd = tokio::process::Command::from(server.command("pgbench"));
    cmd.args(["-h", &host, "-p", &server.port().to_string()])
        .args(["-U", server.user()])
        .args(args)
        .arg(DATABASE)
        .kill_on_drop(true);
    tracing::debug!(?cmd, "running pgbench");
    let out = cmd.output().await.map_err(|source| BenchError::Io {
        context: format!("running {}", server.bin_dir().join("pgbench").display()),
        source,
    })?;
    if !out.status.success() {
        return Err(BenchError::Pgbench {
            phase,
            status: out.status.to_string(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        });
    }
    Ok(out)
}

/// The numbers of a pgbench summary.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Summary {
    pub(crate) transactions: u64,
    pub(crate) failed_transactions: Option<u64>,
    pub(crate) tps: f64,
    pub(crate) latency_avg_ms: f64,
    pub(crate) initial_connection_ms: Option<f64>,
    pub(crate) version: Option<String>,
}

/// Parses pgbench's summary. `tps` is the figure without connection set-up: PostgreSQL 14+
/// prints one `tps = N (without initial connection time)` line; 13 and older print
/// `(including connections establishing)` and `(excluding connections establishing)` lines.
/// Both `=` and `:` separators are accepted (9.x wrote `latency average: N ms`).
pub(crate) fn parse_summary(stdout: &str) -> Result<Summary, String> {
    let mut transactions = None;
    let mut failed_transactions = None;
    let mut latency_avg_ms = None;
    let mut initial_connection_ms = None;
    let mut version = None;
    let (mut tps_without, mut tps_including, mut tps_plain) = (None, None, None);

    for line in stdout.lines().map(str::trim) {
        if let Some(rest) = line.strip_prefix("pgbench (") {
            version = rest.strip_suffix(')').map(str::to_owned);
        } else if let Some(rest) = value_of(line, "number of transactions actually processed") {
            // "N" with -T, "N/M" with -t
            transactions = Some(first_number::<u64>(rest.split('/').next().unwrap_or(""))?);
        } else if let Some(rest) = value_of(line, "number of failed transactions") {
            failed_transactions = Some(first_number::<u64>(rest)?);
        } else if let Some(rest) = value_of(line, "latency average") {
            latency_avg_ms = Some(millis(rest)?);
        } else if let Some(rest) = value_of(line, "initial connection time") {
            initial_connection_ms = Some(millis(rest)?);
        } else if let Some(rest) = value_of(line, "tps") {
            let tps = first_number::<f64>(rest)?;
            if rest.contains("without initial connection time") || rest.contains("excluding") {
                tps_without = Some(tps);
            } else if rest.contains("including") {
                tps_including = Some(tps);
            } else {
                tps_plain = Some(tps);
            }
        }
    }
    let tps = tps_without
        .or(tps_plain)
        .or(tps_including)
        .ok_or("no `tps = ...` line")?;
    if !tps.is_finite() || tps < 0.0 {
        return Err(format!("tps {tps} is not a rate"));
    }
    Ok(Summary {
        transactions: transactions.ok_or("no `number of transactions actually processed` line")?,
        failed_transactions,
        tps,
        latency_avg_ms: latency_avg_ms.ok_or("no `latency average` line")?,
        initial_connection_ms,
        version,
    })
}

/// The text after `key` and its `=` or `:` separator, if `line` is that key's line.
fn value_of<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    let rest = line.strip_prefix(key)?.trim_start();
    let rest = rest.strip_prefix('=').or_else(|| rest.strip_prefix(':'))?;
    Some(rest.trim())
}

fn first_number<T: std::str::FromStr>(text: &str) -> Result<T, String> {
    let word = text.split_whitespace().next().unwrap_or("");
    word.parse()
        .map_err(|_| format!("expected a number, found {text:?}"))
}

/// "6.480 ms" -> 6.48
fn millis(text: &str) -> Result<f64, String> {
    let mut words = text.split_whitespace();
    let value: f64 = first_number(text)?;
    match words.nth(1) {
        Some("ms") | None => Ok(value),
        Some("s") => Ok(value * 1000.0),
        Some(unit) => Err(format!("unknown time unit {unit:?} in {text:?}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PG15: &str = "\
pgbench (15.18 (Debian 15.18-0+deb12u1))
starting vacuum...end.
transaction type: <builtin: TPC-B (sort of)>
scaling factor: 1
query mode: prepared
number of clients: 8
number of threads: 2
maximum number of tries: 1
duration: 10 s
number of transactions actually processed: 23411
number of failed transactions: 0 (0.000%)
latency average = 3.415 ms
initial connection time = 18.271 ms
tps = 2342.417893 (without initial connection time)
";

    const PG13: &str = "\
starting vacuum...end.
transaction type: <builtin: TPC-B (sort of)>
scaling factor: 1
query mode: simple
number of clients: 4
number of threads: 2
duration: 5 s
number of transactions actually processed: 5000/5000
latency average = 4.001 ms
tps = 999.500000 (including connections establishing)
tps = 1001.250000 (excluding connections establishing)
";

    #[test]
    fn parses_pg15_summary() {
        let s = parse_summary(PG15).unwrap();
        assert_eq!(s.transactions, 23411);
        assert_eq!(s.failed_transactions, Some(0));
        assert!((s.tps - 2342.417893).abs() < 1e-9);
        assert!((s.latency_avg_ms - 3.415).abs() < 1e-9);
        assert_eq!(s.initial_connection_ms, Some(18.271));
        assert_eq!(s.version.as_deref(), Some("15.18 (Debian 15.18-0+deb12u1)"));
    }

    #[test]
    fn parses_pre14_summary_preferring_excluding_connections() {
        let s = parse_summary(PG13).unwrap();
        assert_eq!(s.transactions, 5000);
        assert_eq!(s.failed_transactions, None);
        assert!((s.tps - 1001.25).abs() < 1e-9);
        assert!((s.latency_avg_ms - 4.001).abs() < 1e-9);
        assert_eq!(s.initial_connection_ms, None);
    }

    #[test]
    fn rejects_output_without_a_summary() {
        assert!(parse_summary("pgbench: error: connection refused\n").is_err());
        let no_latency = PG15.replace("latency average = 3.415 ms\n", "");
        assert!(parse_summary(&no_latency)
            .unwrap_err()
            .contains("latency average"));
        assert!(parse_summary(&PG15.replace("2342.417893", "many")).is_err());
    }

    #[test]
    fn report_round_trips_through_json() {
        let report = PgbenchReport {
            scale: 1,
            clients: 8,
            threads: 2,
            duration_secs: 10,
            query_mode: QueryMode::Prepared,
            script: Script::Function,
            transactions: 23411,
            failed_transactions: Some(0),
            tps: 2342.4,
            latency_avg_ms: 3.4,
            initial_connection_ms: Some(18.3),
            fsync: true,
            pgbench_version: None,
        };
        let json = serde_json::to_string(&report).unwrap();
        assert!(json.contains("\"query_mode\":\"prepared\""), "{json}");
        assert!(json.contains("\"script\":\"function\""), "{json}");
        assert_eq!(
            serde_json::from_str::<PgbenchReport>(&json).unwrap(),
            report
        );
    }
}
