//! Peer baselines for `weft bench`: what plain PostgreSQL does on this machine, measured the same
//! way weft's own benchmarks are, so weft's numbers have something honest to stand beside.
//!
//! Owns: [`pg2pc`] (PostgreSQL's own two-phase commit — `PREPARE TRANSACTION` then
//! `COMMIT PREPARED` — driven from tokio-postgres clients) and [`pgbench`] (the stock TPC-B-like
//! `pgbench` run), both against a [`weft_pg::TempPostgres`], each returning a serde-serializable
//! report.
//!
//! Must never: report numbers from a server with `fsync` off (both refuse to run), start or
//! stop the server it measures (the caller owns it), or run in the default test profile beyond
//! a seconds-long smoke run.

pub mod pg2pc;
pub mod pgbench;

use std::time::Duration;

use weft_pg::ServerError;

/// Failure of a baseline run. Per-transaction failures during a run are not errors: they are
/// counted in the report.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BenchError {
    /// Starting, reaching or preparing the server failed.
    #[error(transparent)]
    Server(#[from] ServerError),
    /// A setup or check statement failed.
    #[error("SQL error while {context}: {}", weft_pg::client::describe_error(.source))]
    Sql {
        /// What the benchmark was doing.
        context: &'static str,
        /// The driver's error.
        #[source]
        source: tokio_postgres::Error,
    },
    /// The server runs with `fsync` off, so its numbers would be meaningless.
    #[error(
        "the server runs with fsync off; baselines must be measured with fsync on \
         (ServerOptions::default() has it on)"
    )]
    FsyncOff,
    /// The parameters are out of range or do not fit the server's limits.
    #[error("invalid benchmark parameters: {0}")]
    Invalid(String),
    /// Running a program failed.
    #[error("{context}: {source}")]
    Io {
        /// What the benchmark was doing.
        context: String,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// `pgbench` exited unsuccessfully.
    #[error("pgbench {phase} failed ({status}):\n{stderr}")]
    Pgbench {
        /// `initialize` or `run`.
        phase: &'static str,
        /// pgbench's exit status.
        status: String,
        /// pgbench's stderr.
        stderr: String,
    },
    /// `pgbench` succeeded but its output could not be understood.
    #[error("could not parse pgbench output: {reason}\n--- stdout ---\n{stdout}\n--- stderr ---\n{stderr}")]
    PgbenchOutput {
        /// What was missing or malformed.
        reason: String,
        /// pgbench's stdout.
        stdout: String,
        /// pgbench's stderr.
        stderr: String,
    },
    /// A benchmark client task panicked or was cancelled.
    #[error("benchmark client task failed: {0}")]
    Worker(String),
}

/// The longest run either baseline accepts.
pub const MAX_DURATION: Duration = Duration::from_secs(24 * 60 * 60);

/// Reads `fsync` from the server and refuses to go on if it is off.
async fn require_fsync(client: &tokio_postgres::Client) -> Result<(), BenchError> {
    let fsync: String = client
        .query_one("SELECT current_setting('fsync')", &[])
        .await
        .map_err(|source| BenchError::Sql {
            context: "reading fsync",
            source,
        })?
        .get(0);
    if fsync != "on" {
        return Err(BenchError::FsyncOff);
    }
    Ok(())
}

/// Creates database `name` unless it exists.
async fn ensure_database(
    server: &weft_pg::TempPostgres,
    admin: &tokio_postgres::Client,
    name: &str,
) -> Result<(), BenchError> {
    let exists = admin
        .query_opt("SELECT 1 FROM pg_database WHERE datname = $1", &[&name])
        .await
        .map_err(|source| BenchError::Sql {
            context: "looking up the benchmark database",
            source,
        })?
        .is_some();
    if !exists {
        server.create_database(name).await?;
    }
    Ok(())
}

#[cfg(test)]
mod tests;
