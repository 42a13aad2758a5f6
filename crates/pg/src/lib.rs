//! PostgreSQL for weft.
//!
//! This crate owns everything weft knows about PostgreSQL:
//!
//! - [`PgParticipant`]: the resource manager that enlists a PostgreSQL database in weft
//!   transactions — `PREPARE TRANSACTION 'weft:<tid>:n<node>:<database>'` in phase one,
//!   `COMMIT PREPARED` / `ROLLBACK PREPARED` in phase two, and recovery of the prepared
//!   transactions an earlier life left behind. Programs run SQL through a [`PgBranch`].
//! - [`server::TempPostgres`], a throwaway server in a temporary directory for tests and
//!   benchmarks, and [`client::connect`], a tokio-postgres connection to it.
//!
//! It must never touch a PostgreSQL installation it did not create in tests (no system
//! clusters, no data directories outside its own temporary directories, no processes it did not
//! spawn), and never resolve a prepared transaction that is not its own.
//!
//! ```no_run
//! # async fn demo(node: &weft_rpc::Rpc, server: &weft_pg::TempPostgres)
//! #     -> Result<(), weft_wire::Failure> {
//! use weft_pg::{PgConfig, PgParticipant};
//! // Add `pg` to the node with `Node::builder(id).plugin(pg.clone())`.
//! let pg = PgParticipant::new(PgConfig::new(server.client_config("bank"))?);
//! let tx = node.begin();
//! let branch = pg.enlist(node.tm(), tx.context())?;
//! branch.execute("INSERT INTO accounts VALUES ($1, $2)", &[&1_i32, &100_i64]).await?;
//! tx.commit().await?;
//! # Ok(()) }
//! ```

#![warn(missing_docs)]

pub mod client;
mod config;
mod errors;
mod gid;
mod participant;
mod pool;
pub mod server;

pub use config::PgConfig;
pub use gid::{Gid, PgRecord, GID_PREFIX, MAX_DATABASE_BYTES, MAX_GID_BYTES, PG_RECORD_TAG};
pub use participant::{PgBranch, PgParticipant, PgRecoveryReport, PgStats};
pub use server::{ServerError, ServerOptions, TempPostgres};
pub use tokio_postgres::types::ToSql;
pub use tokio_postgres::Row;

#[cfg(test)]
mod tests;
