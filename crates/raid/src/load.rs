//! Loading a site's copy with the initial database.
//!
//! Owns the initial state: every balance 0, history empty, and the copy's
//! placement (the sites holding a copy, see [`crate::rc`]). Must never load
//! twice over a loaded copy (a reload would undo committed work), nor
//! change a loaded copy's placement, nor run a transaction in the poll
//! that starts it (the thread polling it first may be a link's reader).

use std::sync::Arc;

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use weft_kv::{Kv, Op};
use weft_rpc::Rpc;
use weft_tx::Resource;
use weft_wire::{Failure, NodeId, Status};

use crate::rc::{Replicas, MAX_SITES, PLACEMENT_KEY};
use crate::schema::{tuple, Item, Relation, Sizes};

/// Tuples written per loading transaction.
const LOAD_BATCH: u64 = 10_000;

/// What to load.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoadRequest {
    /// Sizes of the balance relations.
    pub sizes: Sizes,
    /// The sites holding a copy (this one among them): every write will
    /// go to each of them.
    pub sites: Vec<NodeId>,
}

/// What a load did.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoadReply {
    /// False when the copy was already loaded (nothing written).
    pub loaded: bool,
    /// Tuples written.
    pub tuples: u64,
}

/// The placement a copy was loaded with; `None` before its load ended.
///
/// Fails with Internal when the stored placement is unreadable.
pub fn stored_placement(kv: &Kv) -> Result<Option<Vec<NodeId>>, Failure> {
    match kv.try_committed(PLACEMENT_KEY)? {
        None => Ok(None),
        Some(b) => Replicas::decode_placement(&b).map(Some).ok_or_else(|| {
            Failure::new(
                Status::Internal,
                format!("the stored placement ({} bytes) is unreadable", b.len()),
            )
        }),
    }
}

/// Loads `kv` (a site's copy) through local transactions coordinated by
/// this site, unless it is loaded already. The last transaction also
/// stores the placement, so a copy holding one is fully loaded.
///
/// Fails with BadRequest when `req.sites` is empty, too long or leaves
/// this site out, Mismatch when the copy was loaded for other sites, and
/// when a loading transaction fails to commit.
pub async fn load_store(
    rpc: &Rpc,
    kv: &Kv,
    participant: Arc<dyn Resource>,
    req: LoadRequest,
) -> Result<LoadReply, Failure> {
    let me = rpc.node_id();
    let mut sites = req.sites.clone();
    sites.sort();
    sites.dedup();
    if sites.len() > MAX_SITES || !sites.contains(&me) {
        return Err(Failure::new(
            Status::BadRequest,
            format!(
                "a load of site {me} must name it among at most {MAX_SITES} sites, not {sites:?}"
            ),
        ));
    }
    let placement = Replicas::encode_placement(&sites);
    if let Some(loaded) = stored_placement(kv)? {
        if loaded != sites {
            return Err(Failure::new(
                Status::Mismatch,
                format!("site {me}'s copy was loaded for sites {loaded:?}, not {sites:?}"),
            ));
        }
        return Ok(LoadReply {
            loaded: false,
            tuples: 0,
        });
    }
    let marker = Item {
        rel: Relation::Branch,
        key: 1,
    };
    // Branches come last, so branch 1 is in the last batch: a copy that
    // holds it without a placement was loaded in full by a version that
    // stored none. It gets its placement alone.
    let sizes = req.sizes;
    let tuples: u64 = if kv.try_committed(&marker.kv_key())?.is_none() {
        Relation::BALANCES.iter().map(|r| sizes.of(*r)).sum()
    } else {
        0
    };
    let zero = tuple(0);
    // An empty copy on the disk engine is loaded straight into the
    // engine (sorted by key, no transactions, one checkpoint); the
    // placement then follows in a transaction of its own, as for a copy
    // that holds the tuples without one. Any other copy is loaded through
    // transactions.
    if tuples > 0 {
        let (kv2, zero2) = (kv.clone(), zero.clone());
        let started = std::time::Instant::now();
        let bulk = tokio::task::spawn_blocking(move || {
            let mut rels = Relation::BALANCES;
            rels.sort_by_key(|r| r.prefix());
            kv2.bulk_load(rels.into_iter().flat_map(move |rel| {
                let zero = zero2.clone();
                (1..=sizes.of(rel)).map(move |key| (Item { rel, key }.kv_key(), zero.clone()))
            }))
        })
        .await
        .map_err(|e| Failure::new(Status::Internal, format!("the bulk load's task: {e}")))??;
        if bulk {
            tracing::info!(
                site = %me,
                tuples,
                secs = started.elapsed().as_secs(),
                "loaded through the engine's bulk import"
            );
            let ops = vec![Op::Put(
                Bytes::from_static(PLACEMENT_KEY),
                placement.clone(),
            )];
            put_in_one_transaction(rpc, kv, &participant, ops).await?;
            return Ok(LoadReply {
                loaded: true,
                tuples,
            });
        }
    }
    // Generated batch by batch: a load of ten million tuples never holds
    // them all.
    let mut items = Relation::BALANCES
        .into_iter()
        .flat_map(move |rel| (1..=sizes.of(rel)).map(move |key| Item { rel, key }))
        .take(tuples as usize);
    let batches = tuples.div_ceil(LOAD_BATCH).max(1);
    let started = std::time::Instant::now();
    for i in 0..batches {
        // Each transaction runs in a poll of its own, never the first: the
        // RPC layer polls a handler once in the link's reader, and a load
        // (hundreds of ms in a debug build) would keep that link unread.
        tokio::task::yield_now().await;
        let mut ops: Vec<Op> = items
            .by_ref()
            .take(LOAD_BATCH as usize)
            .map(|i| Op::Put(i.kv_key(), zero.clone()))
            .collect();
        if i + 1 == batches {
            ops.push(Op::Put(
                Bytes::from_static(PLACEMENT_KEY),
                placement.clone(),
            ));
        }
        put_in_one_transaction(rpc, kv, &participant, ops).await?;
        if (i + 1) % 100 == 0 {
            tracing::info!(
                site = %me,
                tuples = (i + 1) * LOAD_BATCH,
                of = tuples,
                secs = started.elapsed().as_secs(),
                "loading"
            );
        }
    }
    Ok(LoadReply {
        loaded: tuples > 0,
        tuples,
    })
}

/// Runs `ops` on this site's store in one local transaction and commits it;
/// an execution failure aborts it.
async fn put_in_one_transaction(
    rpc: &Rpc,
    kv: &Kv,
    participant: &Arc<dyn Resource>,
    ops: Vec<Op>,
) -> Result<(), Failure> {
    let tx = rpc.begin();
    rpc.tm().enlist(tx.tid(), participant.clone())?;
    if let Err(f) = kv.execute(&tx.context().xid(), ops, None).await {
        let _ = tx.abort(&f.detail).await;
        return Err(f);
    }
    tx.commit().await?;
    Ok(())
}
