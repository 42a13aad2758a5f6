//! weft's Transactional Network Interface (seed 001): a server's TCP reads
//! and writes take part in weft transactions while the peer stays an
//! ordinary, unmodified TCP program. Bytes for the peer are held until the
//! transaction commits and dropped if it aborts; bytes from the peer are
//! kept so that a restarted transaction reads them again.
//!
//! - [`core`]: the sans-IO logger state machine shared by every architecture.
//! - [`control`]: the control stream between a server and its logger (2CA
//!   and TLA): its messages, the server's side, and the logger's side that
//!   does not depend on how bytes reach the logger.
//! - [`sma`]: the in-process architecture, a [`sma::TxStream`] enlisted as a
//!   weft resource.
//! - [`tca`]: the two-connection architecture, a proxy logger that is its own
//!   weft node and a two-phase participant, and the server's side of it.
//! - [`tla`]: the transport-level logger, a router of IP packets between two
//!   TUN devices that keeps the TCP connection end to end.
//!
//! Owns nothing below weft's transaction manager: it never decides an
//! outcome, only applies it.

pub mod control;
pub mod core;
pub mod sma;
pub mod tca;
pub mod tla;
mod writer;

pub use crate::core::{ConnState, ConnStats, CoreError, LoggerConfig};
