//! weft's transaction manager: presumed-abort two-phase commit down the tree
//! of processes that calls build (QuickSilver), participation classes,
//! nested transactions, deadlines, termination notification and recovery.
//!
//! The protocol is pure code: [`core`] is the state machine of one
//! transaction at one node, and [`node`] the node-level core that owns all
//! of a node's transactions and makes every other decision (see
//! `docs/tx.md`). [`TxManager`] is the driver that runs the node core with
//! the node's log, transport and resources; a simulator is another.

pub mod core;
pub mod manager;
pub mod msg;
pub mod node;
#[cfg(feature = "otel")]
pub mod otel;
pub mod resource;

pub use manager::{
    CallGuard, CrashHook, CrashPoint, Recovered, RecoveryReport, TmConfig, TmStats, TxManager,
    TxStatus,
};
pub use msg::{Answer, Outcome, TmRecord, TraceParent, TxMsg, Vote, TM_RECORD_TAG};
pub use node::{Bookkeeping, NodeConfig, TmCore};
pub use resource::{ParticipationClass, Resource};
