//! weft's services and calls.
//!
//! A service registers under a name with a participation class; a call names
//! `service.instance@node`, carries the caller's transaction context and a
//! deadline, and ends with the response or a status. The callee's node joins
//! the caller's transaction and the caller's node records the callee as its
//! child: the tree two-phase commit walks.
//!
//! Owns service dispatch and the typed call API. Must never make a commit
//! decision (the transaction manager does) nor move bytes itself (the
//! transport does).

mod call;
#[cfg(feature = "otel")]
pub mod otel;
mod plugin;
mod service;
mod transaction;

pub use call::{CallContext, Rpc, RpcConfig};
pub use plugin::Plugin;
pub use service::{Handler, ServiceInfo, ServiceOptions};
pub use transaction::{SubTransaction, Transaction};
pub use weft_tx::ParticipationClass;
