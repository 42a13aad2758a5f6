//! Pending calls: requests sent and not yet answered.
//!
//! Owns the table from call id to the waiting caller. Every entry ends exactly
//! once: answered, failed (peer dead, link closed) or abandoned by the caller
//! (deadline, drop). Must never keep an entry whose caller is gone.

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::Mutex;
use tokio::sync::oneshot;
use weft_wire::{Failure, NodeId, Response};

const SHARDS: usize = 16;

struct Pending {
    node: NodeId,
    link: Option<u64>,
    tx: oneshot::Sender<Result<Response, Failure>>,
}

/// The pending-call table, sharded by call id.
pub(crate) struct Calls {
    shards: Vec<Mutex<HashMap<u64, Pending>>>,
}

impl Calls {
    pub(crate) fn new() -> Self {
        Calls {
            shards: (0..SHARDS).map(|_| Mutex::new(HashMap::new())).collect(),
        }
    }

    fn shard(&self, id: u64) -> &Mutex<HashMap<u64, Pending>> {
        &self.shards[(id as usize) % SHARDS]
    }

    /// Registers a call to `node`; the receiver gets its outcome.
    pub(crate) fn insert(
        &self,
        id: u64,
        node: NodeId,
    ) -> oneshot::Receiver<Result<Response, Failure>> {
        let (tx, rx) = oneshot::channel();
        self.shard(id).lock().insert(
            id,
            Pending {
                node,
                link: None,
                tx,
            },
        );
        rx
    }

    /// Records the link a call was sent on (it fails if that link closes).
    pub(crate) fn set_link(&self, id: u64, link: u64) {
        if let Some(p) = self.shard(id).lock().get_mut(&id) {
            p.link = Some(link);
        }
    }

    /// Completes a call with the response from `from`. Responses from a node
    /// other than the one called are ignored. Returns false when no such call
    /// is pending (late or duplicate response).
    pub(crate) fn complete(&self, id: u64, from: NodeId, response: Response) -> bool {
        let mut shard = self.shard(id).lock();
        match shard.get(&id) {
            Some(p) if p.node == from => {
                let p = shard.remove(&id).expect("entry checked above");
                drop(shard);
                let _ = p.tx.send(Ok(response));
                true
            }
            _ => false,
        }
    }

    /// Fails one call.
    pub(crate) fn fail(&self, id: u64, failure: Failure) {
        let p = self.shard(id).lock().remove(&id);
        if let Some(p) = p {
            let _ = p.tx.send(Err(failure));
        }
    }

    /// Removes a call its caller abandoned.
    pub(crate) fn forget(&self, id: u64) {
        self.shard(id).lock().remove(&id);
    }

    /// Fails every call matching `pred` with `failure`.
    fn fail_where(&self, failure: &Failure, pred: impl Fn(&Pending) -> bool) -> usize {
        let mut n = 0;
        for shard in &self.shards {
            let victims: Vec<Pending> = {
                let mut s = shard.lock();
                let ids: Vec<u64> = s
                    .iter()
                    .filter(|(_, p)| pred(p))
                    .map(|(id, _)| *id)
                    .collect();
                ids.into_iter().filter_map(|id| s.remove(&id)).collect()
            };
            for p in victims {
                n += 1;
                let _ = p.tx.send(Err(failure.clone()));
            }
        }
        n
    }

    /// Fails every call to `node`. Returns how many.
    pub(crate) fn fail_node(&self, node: NodeId, failure: &Failure) -> usize {
        self.fail_where(failure, |p| p.node == node)
    }

    /// Fails every call sent on `link`. Returns how many.
    pub(crate) fn fail_link(&self, link: u64, failure: &Failure) -> usize {
        self.fail_where(failure, |p| p.link == Some(link))
    }

    /// Fails every pending call (shutdown).
    pub(crate) fn fail_all(&self, failure: &Failure) -> usize {
        self.fail_where(failure, |_| true)
    }

    /// Number of pending calls.
    pub(crate) fn len(&self) -> usize {
        self.shards.iter().map(|s| s.lock().len()).sum()
    }
}

/// Removes a pending call when the waiting future is dropped early.
pub(crate) struct CallGuard {
    pub(crate) calls: Arc<Calls>,
    pub(crate) id: u64,
    pub(crate) armed: bool,
}

impl Drop for CallGuard {
    fn drop(&mut self) {
        if self.armed {
            self.calls.forget(self.id);
        }
    }
}
