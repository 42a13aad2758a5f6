//! `_lease`: named exclusive leases held for a process, released when the
//! process ends (QuickSilver's termination notification, lesson 1).
//!
//! A process started by `weft run` gets, besides its default transaction,
//! a notification transaction (`$WEFT_NOTIFY_TX`) used for nothing but
//! telling servers that the process ended: `weft run` aborts it when the
//! process exits, whatever the exit status, and its deadline ends it if
//! `weft run` itself dies. `weft lease acquire NAME` takes a lease on
//! behalf of that transaction; the lease table is a one-phase participant
//! of it, so when the process ends the table is told and the lease goes,
//! even when the default transaction is shared by other processes still
//! running (a shell script under `weft tx begin`).
//!
//! Owns the lease table of one node. Must never hold a lease for a
//! transaction that ended (every lease is dropped in `ended`/`abort`), and
//! never grow past [`MAX_LEASES`].

use std::collections::BTreeMap;
use std::sync::Arc;

use futures::future::BoxFuture;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use weft::{CallContext, Failure, Outcome, ParticipationClass, Plugin, Resource, Rpc, Status, Tid};

/// The service name.
pub const SERVICE: &str = "_lease";

/// Most leases a node holds at once.
pub const MAX_LEASES: usize = 65_536;

/// Longest lease name, in bytes.
pub const MAX_NAME: usize = 256;

/// Requests of `_lease`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum LeaseRequest {
    /// Take the lease `name` for the calling transaction (the caller's
    /// notification transaction); LockConflict when another holds it.
    Acquire(String),
    /// Give the lease back before the process ends.
    Release(String),
    /// Every lease held, with its holder.
    List,
}

/// Replies of `_lease`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum LeaseReply {
    /// Done.
    Done,
    /// The leases: (name, holding transaction).
    List(Vec<(String, Tid)>),
}

/// The lease table: a one-phase participant of the transactions holding
/// leases.
#[derive(Default)]
pub struct Leases {
    table: Mutex<BTreeMap<String, Tid>>,
}

impl Leases {
    fn serve(&self, ctx: &CallContext, req: LeaseRequest) -> Result<LeaseReply, Failure> {
        let need_tx = || {
            ctx.tid().ok_or_else(|| {
                Failure::new(
                    Status::BadRequest,
                    "a lease is held for a process: call with its notification transaction \
                     ($WEFT_NOTIFY_TX, set by weft run)",
                )
            })
        };
        let check = |name: &str| {
            if name.is_empty() || name.len() > MAX_NAME {
                Err(Failure::new(
                    Status::BadRequest,
                    format!("a lease name of {} bytes (1 to {MAX_NAME})", name.len()),
                ))
            } else {
                Ok(())
            }
        };
        let mut t = self.table.lock();
        match req {
            LeaseRequest::Acquire(name) => {
                check(&name)?;
                let tid = need_tx()?;
                match t.get(&name) {
                    Some(holder) if *holder == tid => Ok(LeaseReply::Done),
                    Some(holder) => Err(Failure::new(
                        Status::LockConflict,
                        format!("lease {name:?} is held by the process of {holder}"),
                    )),
                    None if t.len() >= MAX_LEASES => Err(Failure::new(
                        Status::NoBuffer,
                        format!("{MAX_LEASES} leases are held here already"),
                    )),
                    None => {
                        t.insert(name, tid);
                        Ok(LeaseReply::Done)
                    }
                }
            }
            LeaseRequest::Release(name) => {
                check(&name)?;
                let tid = need_tx()?;
                match t.get(&name) {
                    Some(holder) if *holder == tid => {
                        t.remove(&name);
                        Ok(LeaseReply::Done)
                    }
                    _ => Err(Failure::new(
                        Status::BadRequest,
                        format!("lease {name:?} is not held by {tid}"),
                    )),
                }
            }
            LeaseRequest::List => Ok(LeaseReply::List(
                t.iter().map(|(n, tid)| (n.clone(), *tid)).collect(),
            )),
        }
    }

    fn drop_all(&self, tid: Tid) {
        self.table.lock().retain(|_, holder| *holder != tid);
    }
}

impl Resource for Leases {
    fn name(&self) -> &str {
        "lease"
    }

    fn class(&self) -> ParticipationClass {
        ParticipationClass::OnePhase
    }

    fn ended(&self, tid: Tid, _outcome: Outcome) -> BoxFuture<'_, ()> {
        self.drop_all(tid);
        Box::pin(async {})
    }

    fn abort(&self, tid: Tid) -> BoxFuture<'_, ()> {
        self.drop_all(tid);
        Box::pin(async {})
    }

    fn held(&self) -> Vec<(Tid, String)> {
        self.table
            .lock()
            .iter()
            .map(|(n, tid)| (*tid, format!("lease {n}")))
            .collect()
    }
}

/// Serves `_lease` on a node.
#[derive(Default)]
pub struct LeasePlugin {
    leases: Arc<Leases>,
}

impl Plugin for LeasePlugin {
    fn name(&self) -> &str {
        SERVICE
    }

    fn serve(&self, rpc: &Rpc) -> Result<(), Failure> {
        let leases = self.leases.clone();
        rpc.register(
            SERVICE,
            weft::ServiceOptions::with_participant(self.leases.clone()),
            move |ctx: CallContext, req: LeaseRequest| {
                let r = leases.serve(&ctx, req);
                async move { r }
            },
        )
    }
}
