//! weft's transaction manager: presumed-abort two-phase commit down the tree
//! of processes that calls build (QuickSilver), participation classes,
//! nested transactions, deadlines, termination notification and recovery.
//!
//! The protocol itself is the pure state machine in [`core`]; [`TxManager`]
//! drives one core per transaction with the node's log and transport.

pub mod core;
pub mod manager;
pub mod msg;
pub mod node;
pub mod resource;

pub use manager::{
    CallGuard, CrashHook, CrashPoint, Recovered, RecoveryReport, TmConfig, TmStats, TxManager,
    TxStatus,
};
pub use msg::{Answer, Outcome, TmRecord, TxMsg, Vote, TM_RECORD_TAG};
pub use node::{Bookkeeping, NodeConfig, TmCore};
pub use resource::{ParticipationClass, Resource};
