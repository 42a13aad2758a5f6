//! Configuration of a [`crate::PgParticipant`].
//!
//! Owns the limits of the participant: how many connections branches may hold, how long a branch
//! waits for one, how many connections phase two and recovery use, and how phase two backs off
//! while PostgreSQL is unreachable. Must never accept a configuration without a database name or
//! with a zero limit: every bound is explicit.

use std::time::Duration;

use weft_wire::{Failure, Status};

use crate::gid::{valid_database, MAX_DATABASE_BYTES};

/// Settings for a [`crate::PgParticipant`]: where PostgreSQL is and the participant's limits.
///
/// Start from [`PgConfig::new`] with a `tokio_postgres::Config` naming the server, user and
/// database, then chain setters. Connections are made without TLS.
#[derive(Clone, Debug)]
pub struct PgConfig {
    pub(crate) pg: tokio_postgres::Config,
    pub(crate) database: String,
    pub(crate) max_connections: usize,
    pub(crate) resolver_connections: usize,
    pub(crate) acquire_timeout: Duration,
    pub(crate) retry_min: Duration,
    pub(crate) retry_max: Duration,
}

impl PgConfig {
    /// A configuration for the server and database in `pg`, with the default limits:
    /// 16 branch connections, 2 resolver connections, a 2 s wait for a branch connection, phase
    /// two retries from 10 ms doubling up to 1 s.
    ///
    /// # Errors
    /// BadRequest when `pg` names no database (`dbname`), or one PostgreSQL cannot have (empty,
    /// longer than 63 bytes, containing NUL).
    pub fn new(pg: tokio_postgres::Config) -> Result<PgConfig, Failure> {
        let database = pg
            .get_dbname()
            .ok_or_else(|| {
                Failure::new(
                    Status::BadRequest,
                    "the PostgreSQL configuration names no database (set dbname)",
                )
            })?
            .to_string();
        if !valid_database(&database) {
            return Err(Failure::new(
                Status::BadRequest,
                format!(
                    "database name {database:?} must be 1..={MAX_DATABASE_BYTES} bytes without NUL"
                ),
            ));
        }
        Ok(PgConfig {
            pg,
            database,
            max_connections: 16,
            resolver_connections: 2,
            acquire_timeout: Duration::from_secs(2),
            retry_min: Duration::from_millis(10),
            retry_max: Duration::from_secs(1),
        })
    }

    /// Bounds the connections active branches hold at once (default 16, at least 1). A branch
    /// takes one at its first statement and gives it back once prepared or ended; a branch that
    /// finds them all taken waits [`PgConfig::acquire_timeout`], then fails with Unavailable.
    pub fn max_connections(mut self, n: usize) -> Self {
        self.max_connections = n.max(1);
        self
    }

    /// Bounds the extra connections used for `COMMIT PREPARED`, `ROLLBACK PREPARED` and the
    /// recovery scan (default 2, at least 1). They are separate from the branches' so that phase
    /// two never waits behind branches blocked on locks that phase two would release.
    pub fn resolver_connections(mut self, n: usize) -> Self {
        self.resolver_connections = n.max(1);
        self
    }

    /// How long a branch's first statement waits for a free connection (default 2 s).
    pub fn acquire_timeout(mut self, wait: Duration) -> Self {
        self.acquire_timeout = wait;
        self
    }

    /// Backoff of phase two and of the recovery scan while PostgreSQL cannot be reached: the
    /// first retry after `min`, doubling up to `max` (defaults 10 ms and 1 s; `max` is raised to
    /// `min` if below it). Outcomes are retried until they are applied: they are final.
    pub fn retry(mut self, min: Duration, max: Duration) -> Self {
        self.retry_min = min.max(Duration::from_millis(1));
        self.retry_max = max.max(self.retry_min);
        self
    }

    /// The database every connection uses.
    pub fn database(&self) -> &str {
        &self.database
    }

    /// The connection settings.
    pub fn pg(&self) -> &tokio_postgres::Config {
        &self.pg
    }
}
