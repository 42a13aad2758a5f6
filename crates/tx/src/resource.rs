//! What a resource manager implements to take part in transactions.
//!
//! Owns the contract between the transaction manager and the resources of a
//! node (the KV store, a PostgreSQL connection, a window server...). Must
//! never let a resource decide the outcome: resources vote; the protocol
//! decides.

use futures::future::BoxFuture;
use serde::{Deserialize, Serialize};
use weft_log::Log;
use weft_wire::{SubPath, Tid};

use crate::msg::{Outcome, Vote};

/// How a service or resource takes part in the end of a transaction
/// (QuickSilver's participation classes).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ParticipationClass {
    /// Never contacted at the end (stateless servers).
    NoState,
    /// Told the outcome after the decision (volatile state: sessions,
    /// windows, locks held for a client).
    OnePhase,
    /// Prepare, then commit or abort (recoverable state).
    TwoPhase,
}

impl std::fmt::Display for ParticipationClass {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ParticipationClass::NoState => "no-state",
            ParticipationClass::OnePhase => "one-phase",
            ParticipationClass::TwoPhase => "two-phase",
        })
    }
}

/// A resource manager of one node.
///
/// Methods other than `prepare` must not fail: a resource that cannot apply
/// an outcome retries internally (the outcome is final).
pub trait Resource: Send + Sync + 'static {
    /// A name unique on the node ("kv", "pg:bank"); printed in listings.
    fn name(&self) -> &str;

    /// The resource's participation class.
    fn class(&self) -> ParticipationClass;

    /// True when what this resource does at commit lives only in this
    /// process until this node's log is durable (its committed state is
    /// rebuilt from this node's log alone, like the KV store's). The
    /// transaction manager may then commit it, releasing its locks, as soon
    /// as the commit record is appended (early lock release). False, the
    /// default, for resources that make a commit durable elsewhere (a
    /// database's COMMIT PREPARED): they commit only after the force.
    fn commits_from_this_log(&self) -> bool {
        false
    }

    /// True when this node may decide a transaction's commit itself, as the
    /// single participant its coordinator hands the decision to
    /// (`TmConfig::delegate_commit`): the resource's `vote_barrier` and
    /// `undecided_dependencies` never wait or fail (a decider does not call
    /// them), and its `commit` may follow a commit record forced here.
    /// Default false: the node then votes as usual.
    fn may_decide_alone(&self) -> bool {
        false
    }

    /// Phase one (two-phase class): make the branch of `tid` ready to commit.
    /// Append whatever redo information recovery will need to `log` (do not
    /// force: the transaction manager forces its prepare record, which covers
    /// it). Vote `ReadOnly` when the branch changed nothing (and release what
    /// it held), `Yes { durable: true }` when ready, `No` otherwise.
    fn prepare<'a>(&'a self, _tid: Tid, _log: &'a Log) -> BoxFuture<'a, Vote> {
        Box::pin(async { Vote::ReadOnly })
    }

    /// Holds this node's Yes or ReadOnly vote for `tid` (and, at the
    /// coordinator, its commit decision) until the resource allows it:
    /// called after `prepare` voted and, at a participant, after the prepare
    /// record is durable, so the wait overlaps nothing it could share. A
    /// resource that let `tid` read or overwrite what a prepared transaction
    /// wrote (controlled lock violation) waits here until that transaction
    /// committed at this node. The default allows at once.
    ///
    /// Fails with the reason this node must abort `tid` instead (a
    /// transaction whose writes it used aborted).
    fn vote_barrier(&self, _tid: Tid) -> BoxFuture<'_, Result<(), String>> {
        Box::pin(async { Ok(()) })
    }

    /// The transactions whose writes `tid` used here and whose outcome this
    /// node does not know yet: what [`Resource::vote_barrier`] would wait
    /// for. When they all have `tid`'s coordinator, the transaction manager
    /// may vote at once, naming them, and the coordinator decides `tid` only
    /// after its own log holds their commit records. Default: none.
    ///
    /// Fails with the reason `tid` must abort (as `vote_barrier` would).
    fn undecided_dependencies(&self, _tid: Tid) -> Result<Vec<Tid>, String> {
        Ok(Vec::new())
    }

    /// Phase two, commit (two-phase class). Also called for a branch this
    /// resource never saw (it must then do nothing).
    fn commit(&self, _tid: Tid) -> BoxFuture<'_, ()> {
        Box::pin(async {})
    }

    /// The transaction aborted (two-phase class): undo the branch. Also
    /// called for branches that never prepared, and for unknown ones, and
    /// again for the same branch: after a call that was still running when
    /// the abort was applied ends, or a prepare that overlapped it returns,
    /// so that nothing those did outlives the branch. Whatever the resource
    /// still holds for `tid` when this returns is a leak.
    fn abort(&self, _tid: Tid) -> BoxFuture<'_, ()> {
        Box::pin(async {})
    }

    /// The outcome, for one-phase resources (termination notification).
    fn ended(&self, _tid: Tid, _outcome: Outcome) -> BoxFuture<'_, ()> {
        Box::pin(async {})
    }

    /// Every transaction this resource holds something for now (locks,
    /// prepared writes, registrations), each with a short description. For
    /// listings: [`crate::TxManager::list`] shows those the transaction
    /// manager no longer runs as orphaned. Default: none.
    fn held(&self) -> Vec<(Tid, String)> {
        Vec::new()
    }

    /// A sub-transaction of `tid` ended: committed into its parent (its
    /// effects and locks pass to the parent) or aborted (its effects are
    /// undone, the rest of the transaction goes on).
    fn sub_ended(&self, _tid: Tid, _path: &SubPath, _committed: bool) {}
}
