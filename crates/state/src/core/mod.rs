//! The sans-IO core of shared state: no tokio, no sockets, no clocks, no files.
//!
//! Types and units ([`types`]), native mapping ([`record`]), URLs and MIPs
//! ([`mip`]), segments and diffs ([`segment`]), twins and diff collection
//! ([`twin`]), coherence decisions ([`coherence`]), the transaction metadata
//! table ([`tmt`]), the machine-independent bytes ([`codec`]) and applying a
//! diff straight from them ([`apply`]). The runtime
//! performs what these decide.

pub mod apply;
pub mod codec;
pub mod coherence;
pub mod error;
pub mod home;
pub mod mip;
pub mod record;
pub mod segment;
pub mod tmt;
pub mod twin;
pub mod types;

#[cfg(test)]
mod prop_tests;
#[cfg(test)]
mod tests;
