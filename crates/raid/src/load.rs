//! Loading a site's copy with the initial database.
//!
//! Owns the initial state: every balance 0, history empty. Must never load
//! twice over a loaded copy (a reload would undo committed work).

use std::sync::Arc;

use serde::{Deserialize, Serialize};
use weft_kv::{Kv, Op};
use weft_rpc::Rpc;
use weft_tx::Resource;
use weft_wire::Failure;

use crate::schema::{tuple, Item, Relation, Sizes};

/// Tuples written per loading transaction.
const LOAD_BATCH: u64 = 10_000;

/// What to load.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoadRequest {
    /// Sizes of the balance relations.
    pub sizes: Sizes,
}

/// What a load did.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoadReply {
    /// False when the copy was already loaded (nothing written).
    pub loaded: bool,
    /// Tuples written.
    pub tuples: u64,
}

/// Loads `kv` (a site's copy) through local transactions coordinated by
/// this site, unless it already holds branch 1.
///
/// Fails when a loading transaction fails to commit.
pub async fn load_store(
    rpc: &Rpc,
    kv: &Kv,
    participant: Arc<dyn Resource>,
    req: LoadRequest,
) -> Result<LoadReply, Failure> {
    let marker = Item {
        rel: Relation::Branch,
        key: 1,
    };
    if kv.committed(&marker.kv_key()).is_some() {
        return Ok(LoadReply {
            loaded: false,
            tuples: 0,
        });
    }
    let mut items: Vec<Item> = Vec::new();
    for rel in Relation::BALANCES {
        for key in 1..=req.sizes.of(rel) {
            items.push(Item { rel, key });
        }
    }
    let tuples = items.len() as u64;
    let zero = tuple(0);
    for chunk in items.chunks(LOAD_BATCH as usize) {
        let tx = rpc.begin();
        rpc.tm().enlist(tx.tid(), participant.clone())?;
        let ops = chunk
            .iter()
            .map(|i| Op::Put(i.kv_key(), zero.clone()))
            .collect();
        if let Err(f) = kv.execute(&tx.context().xid(), ops, None).await {
            let _ = tx.abort(&f.detail).await;
            return Err(f);
        }
        tx.commit().await?;
    }
    Ok(LoadReply {
        loaded: true,
        tuples,
    })
}
