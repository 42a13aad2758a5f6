//! Built-in administrative services, used by the `weft` CLI and by
//! operators: `_status` (the node's view of the cluster and its counters)
//! and `_tx` (begin, commit, abort, inspect transactions from outside).
//!
//! Owns the request and reply types of those services. Must never bypass the
//! transaction manager: `_tx` drives it exactly as a program would.

use serde::{Deserialize, Serialize};
use weft_log::LogStats;
use weft_rpc::{ServiceInfo, ServiceOptions};
use weft_transport::{ClusterView, StatsSnapshot};
use weft_tx::{RecoveryReport, TmStats, TxStatus};
use weft_wire::{Failure, Incarnation, NodeId, Status, Tid, TxContext, Xid};

use crate::node::Node;

/// Name of the status service.
pub const STATUS_SERVICE: &str = "_status";
/// Name of the transaction administration service.
pub const TX_SERVICE: &str = "_tx";

/// Longest life a `_tx` Begin may ask for: a transaction a client forgets
/// still ends (aborts) within it. Longer: BadRequest.
pub const MAX_TX_TIMEOUT_MS: u64 = 3_600_000;

/// Longest reason a `_tx` Abort may give (it is remembered with the
/// outcome). Longer: BadRequest.
pub const MAX_ABORT_REASON: usize = 1024;

/// What `_status` returns.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct StatusReport {
    /// The answering node.
    pub node: NodeId,
    /// Its incarnation.
    pub incarnation: Incarnation,
    /// Its view of the cluster.
    pub view: ClusterView,
    /// Its services.
    pub services: Vec<ServiceInfo>,
    /// Transaction counters.
    pub tm: TmStats,
    /// Transactions live at the node.
    pub live_transactions: usize,
    /// Log counters.
    pub log: LogStats,
    /// Frames sent.
    pub transport: StatsSnapshot,
    /// Recent refused links (wrong secret, malformed frames).
    pub refusals: Vec<String>,
    /// What recovery did at start-up.
    pub recovery: RecoveryReport,
    /// The data directory.
    pub data_dir: String,
}

/// Requests of `_tx`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum TxRequest {
    /// Begin a transaction coordinated by the answering node.
    Begin {
        /// Deadline in milliseconds (the node's default when absent).
        timeout_ms: Option<u64>,
    },
    /// Commit (the answering node must be the coordinator).
    Commit(Tid),
    /// Abort.
    Abort(Tid, String),
    /// The transaction's state at the answering node.
    Status(Tid),
    /// Every transaction live at the answering node.
    List,
    /// Begin a sub-transaction of this (sub-)transaction (the answering
    /// node must run it: its coordinator); answered `Begun` with the
    /// sub-transaction's context.
    SubBegin(Xid),
    /// End a sub-transaction: committed into its parent (true) or aborted
    /// (false); answered `Done`.
    SubEnd(Xid, bool),
}

/// Replies of `_tx`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum TxReply {
    /// A transaction was begun: its context.
    Begun(TxContext),
    /// Commit or abort done.
    Done,
    /// The state of one transaction: live (`Some` status), or finished
    /// (`outcome`: "committed", "aborted", "read-only"), or unknown.
    Status {
        /// Live state, if the transaction is live here.
        live: Option<TxStatus>,
        /// How it ended, if it ended here recently.
        outcome: Option<String>,
    },
    /// Live transactions.
    List(Vec<TxStatus>),
}

/// Registers `_status` and `_tx` on `node`.
pub(crate) fn install(node: &Node) -> Result<(), Failure> {
    // The services hold weak handles: the node owns its Rpc, which owns
    // these closures, so strong ones would keep the node alive forever.
    let weak = node.downgrade();
    node.rpc().register(
        STATUS_SERVICE,
        ServiceOptions::no_state(),
        move |_ctx, (): ()| {
            let n = Node::upgrade(&weak);
            async move { Ok(status(&alive(n)?)) }
        },
    )?;
    let weak = node.downgrade();
    node.rpc().register(
        TX_SERVICE,
        ServiceOptions::no_state(),
        move |_ctx, req: TxRequest| {
            let n = Node::upgrade(&weak);
            async move { tx_admin(&alive(n)?, req).await }
        },
    )?;
    Ok(())
}

/// The node, or ShuttingDown when it has been dropped.
fn alive(node: Option<Node>) -> Result<Node, Failure> {
    node.ok_or_else(|| Failure::new(Status::ShuttingDown, "the node is shutting down"))
}

fn status(node: &Node) -> StatusReport {
    StatusReport {
        node: node.id(),
        incarnation: node.incarnation(),
        view: node.endpoint().view(),
        services: node.rpc().services(),
        tm: node.tm().stats(),
        live_transactions: node.tm().list().len(),
        log: node.log().stats(),
        transport: node.endpoint().stats(),
        refusals: node.endpoint().refusals(),
        recovery: node.recovery().clone(),
        data_dir: node.data_dir().display().to_string(),
    }
}

async fn tx_admin(node: &Node, req: TxRequest) -> Result<TxReply, Failure> {
    let tm = node.tm();
    match req {
        TxRequest::Begin { timeout_ms } => {
            if let Some(ms) = timeout_ms.filter(|ms| *ms > MAX_TX_TIMEOUT_MS) {
                return Err(Failure::new(
                    Status::BadRequest,
                    format!("a transaction of {ms} ms (at most {MAX_TX_TIMEOUT_MS})"),
                ));
            }
            let ctx = tm.begin(timeout_ms.map(std::time::Duration::from_millis));
            Ok(TxReply::Begun(ctx))
        }
        TxRequest::Commit(tid) => tm.commit(tid).await.map(|()| TxReply::Done),
        TxRequest::Abort(_, reason) if reason.len() > MAX_ABORT_REASON => Err(Failure::new(
            Status::BadRequest,
            format!(
                "an abort reason of {} bytes (at most {MAX_ABORT_REASON})",
                reason.len()
            ),
        )),
        TxRequest::Abort(tid, reason) => tm.abort(tid, &reason).await.map(|()| TxReply::Done),
        TxRequest::Status(tid) => {
            let live = tm.status(tid);
            let outcome = tm.finished_outcome(tid).map(|o| match o {
                Some(weft_tx::Outcome::Committed) => "committed".to_string(),
                Some(weft_tx::Outcome::Aborted) => "aborted".to_string(),
                None => "read-only".to_string(),
            });
            if live.is_none() && outcome.is_none() && tid.node != node.id() {
                return Err(Failure::new(
                    Status::NoSuchTransaction,
                    format!(
                        "node {} knows nothing of {tid}; ask its coordinator, node {}",
                        node.id(),
                        tid.node
                    ),
                ));
            }
            Ok(TxReply::Status { live, outcome })
        }
        TxRequest::List => Ok(TxReply::List(tm.list())),
        TxRequest::SubBegin(xid) => {
            let ctx = TxContext {
                path: xid.path,
                ..TxContext::new(xid.tid)
            };
            tm.sub_begin(&ctx).map(TxReply::Begun)
        }
        TxRequest::SubEnd(xid, committed) => tm
            .sub_end(xid.tid, &xid.path, committed)
            .map(|()| TxReply::Done),
    }
}
