//! The transaction context that rides on every call, and what comes back with
//! every response.
//!
//! Owns the wire form only: time is a *budget* (microseconds left when the frame
//! was sent), never an absolute clock reading, because peers' clocks differ.
//! Must never interpret baggage: merge rules belong to the transaction layer.

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use crate::ids::{SubPath, Tid, Xid};

/// Maximum number of baggage entries carried by one context. A request
/// carrying more is answered BadRequest.
pub const MAX_BAGGAGE_ENTRIES: usize = 64;

/// One typed piece of per-transaction metadata: a key naming its owner and
/// type (e.g. `state.meta`) and an opaque value that the owner knows how to
/// merge.
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct BaggageItem {
    /// Who owns the entry and how it merges.
    pub key: String,
    /// The encoded value.
    pub value: Bytes,
}

/// Transaction baggage: metadata that travels with every call and every return
/// and is merged on arrival.
#[derive(Clone, PartialEq, Eq, Debug, Default, Serialize, Deserialize)]
pub struct Baggage(pub Vec<BaggageItem>);

impl Baggage {
    /// True when there is nothing to carry.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The value stored under `key`, if any.
    pub fn get(&self, key: &str) -> Option<&Bytes> {
        self.0.iter().find(|i| i.key == key).map(|i| &i.value)
    }

    /// Sets `key` to `value`, replacing an earlier value.
    pub fn set(&mut self, key: impl Into<String>, value: Bytes) {
        let key = key.into();
        match self.0.iter_mut().find(|i| i.key == key) {
            Some(item) => item.value = value,
            None => self.0.push(BaggageItem { key, value }),
        }
    }
}

/// What a call carries about its transaction: which (sub-)transaction, how
/// long it may still run, and its baggage.
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct TxContext {
    /// The top-level transaction.
    pub tid: Tid,
    /// The sub-transaction the call runs in (empty: the top level).
    pub path: SubPath,
    /// Microseconds left until the transaction's deadline when the frame was
    /// sent; `None` when the transaction has no deadline.
    pub budget_us: Option<u64>,
    /// Per-transaction metadata.
    pub baggage: Baggage,
}

impl TxContext {
    /// A context for the top level of `tid` with no deadline and no baggage.
    pub fn new(tid: Tid) -> Self {
        TxContext {
            tid,
            path: SubPath::top(),
            budget_us: None,
            baggage: Baggage::default(),
        }
    }

    /// The (sub-)transaction this context names.
    pub fn xid(&self) -> Xid {
        Xid {
            tid: self.tid,
            path: self.path.clone(),
        }
    }
}

/// What a response carries back about the transaction.
#[derive(Clone, PartialEq, Eq, Debug, Default, Serialize, Deserialize)]
pub struct TxReturn {
    /// Baggage to merge into the caller's context.
    pub baggage: Baggage,
    /// True when the callee (or something it called) aborted the transaction.
    pub aborted: bool,
}
