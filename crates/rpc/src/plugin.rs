//! Plugins: resource managers and services that live in a node and need a
//! say in its start-up (recovery) and its checkpoints.
//!
//! Owns the order of start-up: resources attach to the transaction manager,
//! the transaction manager recovers, each plugin rebuilds its state from the
//! log, then services open. Must never let a service take calls before its
//! plugin recovered.

use weft_log::{Log, LogRecord, Lsn};
use weft_tx::TxManager;
use weft_wire::Failure;

use crate::call::Rpc;

/// A component of a node with durable state or services.
pub trait Plugin: Send + Sync + 'static {
    /// A short name for logs and errors.
    fn name(&self) -> &str;

    /// Registers node-level resources with the transaction manager. Runs
    /// before recovery, so recovered transactions enlist them.
    ///
    /// Fails when the plugin cannot start (its error stops the node).
    fn attach(&self, _tm: &TxManager, _log: &Log) -> Result<(), Failure> {
        Ok(())
    }

    /// Rebuilds state from the log, after the transaction manager recovered
    /// (ask it what happened to each transaction with
    /// [`TxManager::recovered`]).
    ///
    /// Fails when the state cannot be rebuilt (the node does not start).
    fn recover(&self, _tm: &TxManager, _records: &[LogRecord]) -> Result<(), Failure> {
        Ok(())
    }

    /// Registers services.
    ///
    /// Fails when a service cannot be registered.
    fn serve(&self, _rpc: &Rpc) -> Result<(), Failure> {
        Ok(())
    }

    /// Takes a checkpoint (a snapshot of its state) and returns the lowest
    /// log position it still needs, or `None` if it needs none.
    ///
    /// Fails when the checkpoint cannot be written (the log is then kept).
    fn checkpoint(&self, _log: &Log) -> Result<Option<Lsn>, Failure> {
        Ok(None)
    }

    /// The node is being killed as a process would be (tests simulating a
    /// crash in-process): drop external connections and stop background
    /// work without any orderly goodbye. Default: nothing.
    fn crash(&self) {}
}
