//! PostgreSQL for weft.
//!
//! This crate owns everything weft knows about PostgreSQL. Today that is the test and benchmark
//! harness: [`server::TempPostgres`], a throwaway server in a temporary directory, and
//! [`client::connect`], a tokio-postgres connection to it. The resource manager that enlists a
//! PostgreSQL transaction through `PREPARE TRANSACTION` will live here as well.
//!
//! It must never touch a PostgreSQL installation it did not create: no system clusters, no data
//! directories outside its own temporary directories, no processes it did not spawn.

pub mod client;
pub mod server;

pub use server::{ServerError, ServerOptions, TempPostgres};

#[cfg(test)]
mod tests;
