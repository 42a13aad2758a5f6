//! The application's handle on a transaction it began.
//!
//! Owns the rule that only the creator commits and that a transaction
//! dropped without commit aborts (QuickSilver: a program that ends abnormally
//! aborts its transaction). Must never outlive its decision: commit and abort
//! consume the handle.

use serde::de::DeserializeOwned;
use serde::Serialize;
use tracing::Instrument;
use weft_wire::{Address, Failure, Payload, Status, SubPath, Tid, TxContext};

use crate::call::Rpc;

/// A transaction this node created. Calls made through it carry its context;
/// `commit` runs two-phase commit down the tree those calls built.
#[must_use = "a transaction dropped without commit aborts"]
pub struct Transaction {
    rpc: Rpc,
    ctx: TxContext,
    done: bool,
}

impl Transaction {
    pub(crate) fn new(rpc: Rpc, ctx: TxContext) -> Self {
        Transaction {
            rpc,
            ctx,
            done: false,
        }
    }

    /// The transaction id.
    pub fn tid(&self) -> Tid {
        self.ctx.tid
    }

    /// The context calls carry.
    pub fn context(&self) -> &TxContext {
        &self.ctx
    }

    /// Calls a service on behalf of the transaction.
    ///
    /// Fails like [`Rpc::call`], and with Aborted once the transaction
    /// aborted.
    pub async fn call<Req, Resp>(&self, addr: &Address, request: Req) -> Result<Resp, Failure>
    where
        Req: Serialize + Send + 'static,
        Resp: DeserializeOwned + Send + 'static,
    {
        call_in(&self.rpc, &self.ctx, addr, request).await
    }

    /// Untyped call on behalf of the transaction.
    ///
    /// Fails like [`Transaction::call`].
    pub async fn call_payload(&self, addr: &Address, payload: Payload) -> Result<Payload, Failure> {
        self.rpc
            .call_payload(Some(&self.ctx), addr, payload, None)
            .await
    }

    /// Runs one call as a sub-transaction: if it fails, its effects are undone
    /// everywhere it reached and the transaction goes on; if it succeeds, its
    /// effects and locks pass to the transaction.
    ///
    /// Fails with the call's failure (after undoing the sub-transaction).
    pub async fn call_nested<Req, Resp>(
        &self,
        addr: &Address,
        request: Req,
    ) -> Result<Resp, Failure>
    where
        Req: Serialize + Send + 'static,
        Resp: DeserializeOwned + Send + 'static,
    {
        let sub = self.sub()?;
        match sub.call(addr, request).await {
            Ok(r) => {
                sub.commit()?;
                Ok(r)
            }
            Err(e) => {
                let _ = sub.abort();
                Err(e)
            }
        }
    }

    /// Starts a sub-transaction.
    ///
    /// Fails with Aborted / NoSuchTransaction when the transaction is not
    /// active.
    pub fn sub(&self) -> Result<SubTransaction, Failure> {
        let ctx = self.rpc.tm().sub_begin(&self.ctx)?;
        Ok(SubTransaction {
            rpc: self.rpc.clone(),
            ctx,
            done: false,
        })
    }

    /// Commits: two-phase commit, presumed abort. Returns once the outcome is
    /// durable at the coordinator.
    ///
    /// Fails with Aborted when any participant voted no, died or aborted, or
    /// the deadline passed; InDoubt when the log failed to make the decision
    /// durable.
    pub async fn commit(mut self) -> Result<(), Failure> {
        self.done = true;
        let tid = self.ctx.tid;
        let span = tracing::debug_span!("tx.commit", %tid);
        #[cfg(feature = "otel")]
        crate::otel::root(&span, tid);
        self.rpc.tm().commit(tid).instrument(span).await
    }

    /// Aborts; every participant is told.
    ///
    /// Fails with NoSuchTransaction when the transaction already ended.
    pub async fn abort(mut self, reason: &str) -> Result<(), Failure> {
        self.done = true;
        self.rpc.tm().abort(self.ctx.tid, reason).await
    }
}

impl Drop for Transaction {
    fn drop(&mut self) {
        if !self.done {
            let tm = self.rpc.tm().clone();
            let tid = self.ctx.tid;
            if let Ok(handle) = tokio::runtime::Handle::try_current() {
                handle.spawn(async move {
                    let _ = tm.abort(tid, "the transaction handle was dropped").await;
                });
            }
        }
    }
}

/// A sub-transaction: aborts alone, or passes its effects to its parent.
#[must_use = "a sub-transaction dropped without commit aborts"]
pub struct SubTransaction {
    rpc: Rpc,
    ctx: TxContext,
    done: bool,
}

impl SubTransaction {
    /// The sub-transaction's path under its top-level transaction.
    pub fn path(&self) -> &SubPath {
        &self.ctx.path
    }

    /// The context its calls carry.
    pub fn context(&self) -> &TxContext {
        &self.ctx
    }

    /// Calls a service on behalf of the sub-transaction.
    ///
    /// Fails like [`Transaction::call`].
    pub async fn call<Req, Resp>(&self, addr: &Address, request: Req) -> Result<Resp, Failure>
    where
        Req: Serialize + Send + 'static,
        Resp: DeserializeOwned + Send + 'static,
    {
        call_in(&self.rpc, &self.ctx, addr, request).await
    }

    /// Starts a sub-transaction of this one.
    ///
    /// Fails like [`Transaction::sub`].
    pub fn sub(&self) -> Result<SubTransaction, Failure> {
        let ctx = self.rpc.tm().sub_begin(&self.ctx)?;
        Ok(SubTransaction {
            rpc: self.rpc.clone(),
            ctx,
            done: false,
        })
    }

    /// Commits into the parent: effects and locks pass to it.
    ///
    /// Fails when the transaction is no longer active.
    pub fn commit(mut self) -> Result<(), Failure> {
        self.done = true;
        self.rpc.tm().sub_end(self.ctx.tid, &self.ctx.path, true)
    }

    /// Aborts the sub-transaction alone: its effects are undone everywhere it
    /// reached; the parent goes on.
    ///
    /// Fails when the transaction is no longer active.
    pub fn abort(mut self) -> Result<(), Failure> {
        self.done = true;
        self.rpc.tm().sub_end(self.ctx.tid, &self.ctx.path, false)
    }
}

impl Drop for SubTransaction {
    fn drop(&mut self) {
        if !self.done {
            let _ = self.rpc.tm().sub_end(self.ctx.tid, &self.ctx.path, false);
        }
    }
}

async fn call_in<Req, Resp>(
    rpc: &Rpc,
    ctx: &TxContext,
    addr: &Address,
    request: Req,
) -> Result<Resp, Failure>
where
    Req: Serialize + Send + 'static,
    Resp: DeserializeOwned + Send + 'static,
{
    let payload = rpc
        .call_payload(Some(ctx), addr, Payload::local(request), None)
        .await?;
    payload.decode::<Resp>().map_err(|e| {
        Failure::new(
            Status::Mismatch,
            format!("response of {addr} is not the expected type: {e}"),
        )
    })
}
