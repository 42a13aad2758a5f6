//! A Raid site: the access manager (AM, a weft KV store whose isolation is
//! left to the CC), the concurrency controller (CC), the site's part of the
//! replication controller (RC: executing a transaction's operations on this
//! copy) and the services through which action drivers reach it. The
//! atomicity controller (AC) is weft's transaction manager itself.
//!
//! Owns the site's services and its participant in commit. Must never let a
//! transaction see another's uncommitted write, nor release a lock before
//! the write it protects is applied.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::future::BoxFuture;
use serde::{Deserialize, Serialize};
use weft_kv::lock::LockMode;
use weft_kv::{Kv, KvConfig, KvEngine, Locking, Op, Reply};
use weft_log::{Log, LogRecord, Lsn};
use weft_rpc::{CallContext, Plugin, Rpc, ServiceOptions};
use weft_tx::{ParticipationClass, Resource, TxManager, Vote};
use weft_wire::{Failure, NodeId, Status, SubPath, Tid, Xid};

use crate::ad::{Ad, AdReply, AdRequest};
use crate::audit::{audit_store, SiteAudit};
use crate::cc::Cc;
use crate::load::{load_store, stored_placement, LoadRequest};
use crate::marker::{self, MarkerLimits, Markers, HORIZON_KEY};
use crate::rc::Replicas;
use crate::schema::{balance, tuple, Item, Relation};

/// The site service (RC at this copy): runs operations on the local copy.
pub const SITE_SERVICE: &str = "raid";
/// The action driver service: runs a whole transaction for a client (at
/// this site, or shipped to the first copy's site when it writes).
pub const AD_SERVICE: &str = "raid-ad";
/// The action driver service that runs a transaction at this site, never
/// shipping it (what an AD ships to).
pub const AD_HERE_SERVICE: &str = "raid-ad-here";
/// The audit service: sums of this copy.
pub const AUDIT_SERVICE: &str = "raid-audit";
/// The load service: fills this copy with the initial database.
pub const LOAD_SERVICE: &str = "raid-load";

/// One operation on this site's copy.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum SiteOp {
    /// Shared lock, read the balance.
    Read(Item),
    /// Exclusive lock, add to the balance; answers the new balance.
    Update(Item, i64),
    /// Exclusive lock, write a history row.
    Insert(Item, Bytes),
    /// Exclusive lock; answers 1 when the item exists (its balance is then
    /// readable), 0 when it does not.
    Claim(Item),
    /// Exclusive lock, write a shipped request's marker (see
    /// [`crate::marker`]): the answer given (the batch's first answer when
    /// `None`) and when the request was first sent (ms since the epoch);
    /// answers 0. At the first copy the marker is indexed for reclamation.
    Mark(Item, Option<i64>, u64),
    /// Shared lock, read the answer a marker records.
    Answer(Item),
    /// Exclusive lock, delete the item (a reclaimed marker); answers 0.
    Remove(Item),
}

impl SiteOp {
    /// The item the operation locks, and how.
    fn lock(&self) -> (Item, LockMode) {
        match self {
            SiteOp::Read(item) => (*item, LockMode::Shared),
            SiteOp::Answer(item) => (*item, LockMode::Shared),
            SiteOp::Update(item, _)
            | SiteOp::Insert(item, _)
            | SiteOp::Claim(item)
            | SiteOp::Mark(item, ..)
            | SiteOp::Remove(item) => (*item, LockMode::Exclusive),
        }
    }
}

/// Operations to run in order on this site's copy, within the caller's
/// transaction.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SiteRequest(pub Vec<SiteOp>);

/// One answer per operation: a balance (0 for inserts).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SiteReply(pub Vec<i64>);

/// Settings of a site.
#[derive(Clone, Debug)]
pub struct SiteConfig {
    /// Longest wait for a lock: Raid's timeout per action.
    pub action_timeout: Duration,
    /// How long a transaction may run before it aborts.
    pub tx_timeout: Duration,
    /// Retention and bounds of shipped-request markers (see
    /// [`crate::marker`]). A retention shorter than the shipping AD's retry
    /// window (`tx_timeout` + 2 s) is raised to it.
    pub markers: MarkerLimits,
    /// Most prepared writers in controlled lock violation at once (see
    /// [`crate::violation`]); one more keeps its locks until its outcome.
    pub max_prepared_writers: usize,
    /// Where the copy's committed data lives.
    pub kv_engine: KvEngine,
}

impl Default for SiteConfig {
    fn default() -> Self {
        SiteConfig {
            action_timeout: Duration::from_secs(1),
            tx_timeout: Duration::from_secs(10),
            markers: MarkerLimits::default(),
            max_prepared_writers: crate::violation::DEFAULT_MAX_WRITERS,
            kv_engine: KvEngine::default(),
        }
    }
}

impl SiteConfig {
    /// How long after its first sending a shipping AD may still repeat a
    /// request: the transaction timeout plus 2 s.
    pub fn retry_window(&self) -> Duration {
        self.tx_timeout + Duration::from_secs(2)
    }
}

struct Inner {
    cfg: SiteConfig,
    kv: Kv,
    cc: Cc,
    participant: OnceLock<Arc<dyn Resource>>,
    kv_participant: Arc<dyn Resource>,
    rpc: OnceLock<Rpc>,
    /// The copy's placement, once read from the loaded copy (it never
    /// changes after the load).
    placement: OnceLock<Vec<NodeId>>,
    /// How long the store's checkpoints took (counters only).
    checkpoints: parking_lot::Mutex<CheckpointStats>,
    /// The markers of requests shipped to this site as the first copy.
    markers: Arc<Markers>,
    /// Set when the node crashed: background work stops.
    crashed: AtomicBool,
}

/// What a site keeps, counted (see [`RaidSite::bookkeeping`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Bookkeeping {
    /// Shipped-request markers indexed for reclamation (at the first copy;
    /// every copy stores the same markers, other sites index none).
    pub markers: usize,
    /// Committed changes held in memory until the next flush of the disk
    /// engine (0 in memory).
    #[serde(default)]
    pub overlay_keys: usize,
    /// Delta tables of the disk engine not merged yet.
    #[serde(default)]
    pub delta_tables: usize,
}

/// The checkpoints of a site's store: how many ran and how long they took
/// (counters, not a list: their size never grows).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckpointStats {
    /// Checkpoints that completed.
    pub count: u64,
    /// Checkpoints that failed.
    pub failed: u64,
    /// Duration of the last one, microseconds.
    pub last_us: u64,
    /// Longest one, microseconds.
    pub max_us: u64,
    /// Sum of their durations, microseconds.
    pub total_us: u64,
}

/// A Raid site, installed in a weft node as a plugin.
#[derive(Clone)]
pub struct RaidSite {
    inner: Arc<Inner>,
}

/// The site's participant in commit: the AM's branch (durable) and the CC's
/// locks, in that order.
struct SiteParticipant(Arc<Inner>);

impl Resource for SiteParticipant {
    fn name(&self) -> &str {
        "raid"
    }

    fn commits_from_this_log(&self) -> bool {
        true // KV state from this node's log; locks are volatile
    }

    fn class(&self) -> ParticipationClass {
        ParticipationClass::TwoPhase
    }

    fn prepare<'a>(&'a self, tid: Tid, log: &'a Log) -> BoxFuture<'a, Vote> {
        Box::pin(async move {
            let vote = self.0.kv_participant.prepare(tid, log).await;
            match &vote {
                Vote::ReadOnly => self.0.cc.release(tid),
                // Its writes are in the prepared set (readable by the next
                // lock holder): the locks pass to violation mode.
                Vote::Yes { .. } => self.0.cc.prepared(tid),
                Vote::No(_) => {}
            }
            vote
        })
    }

    fn vote_barrier(&self, tid: Tid) -> BoxFuture<'_, Result<(), String>> {
        Box::pin(self.0.cc.vote_barrier(tid))
    }

    fn undecided_dependencies(&self, tid: Tid) -> Result<Vec<Tid>, String> {
        self.0.cc.undecided_dependencies(tid)
    }

    fn commit(&self, tid: Tid) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            // Apply first, then tell the dependents.
            self.0.kv_participant.commit(tid).await;
            self.0.cc.decided(tid, true);
        })
    }

    fn abort(&self, tid: Tid) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            self.0.kv_participant.abort(tid).await;
            self.0.cc.decided(tid, false);
        })
    }

    fn held(&self) -> Vec<(Tid, String)> {
        // The store's prepared sets are the KV resource's to list.
        self.0.cc.held()
    }

    fn sub_ended(&self, tid: Tid, path: &SubPath, committed: bool) {
        self.0.kv_participant.sub_ended(tid, path, committed);
        self.0.cc.sub_ended(tid, path, committed);
    }
}

fn kv_failure(reply: Option<Reply>) -> Failure {
    Failure::new(
        Status::Internal,
        format!("unexpected store reply {reply:?}"),
    )
}

impl RaidSite {
    /// A site with `cfg`; empty until its node recovers it.
    pub fn new(cfg: SiteConfig) -> RaidSite {
        let kv = Kv::new(KvConfig {
            lock_wait: cfg.action_timeout,
            locking: Locking::External,
            engine: cfg.kv_engine.clone(),
            ..KvConfig::default()
        });
        let kv_participant = kv.resource();
        let mut limits = cfg.markers;
        limits.retention = limits.retention.max(cfg.retry_window());
        RaidSite {
            inner: Arc::new(Inner {
                cc: Cc::with_limits(cfg.action_timeout, cfg.max_prepared_writers),
                cfg,
                kv,
                participant: OnceLock::new(),
                kv_participant,
                rpc: OnceLock::new(),
                placement: OnceLock::new(),
                checkpoints: parking_lot::Mutex::new(CheckpointStats::default()),
                markers: Arc::new(Markers::new(limits)),
                crashed: AtomicBool::new(false),
            }),
        }
    }

    /// The participant that loading transactions enlist.
    pub fn participant_handle(&self) -> Arc<dyn Resource> {
        self.participant()
    }

    fn participant(&self) -> Arc<dyn Resource> {
        self.inner
            .participant
            .get_or_init(|| Arc::new(SiteParticipant(Arc::clone(&self.inner))))
            .clone()
    }

    /// The site's store (for audits and tests).
    pub fn store(&self) -> &Kv {
        &self.inner.kv
    }

    /// How the store's checkpoints went so far.
    pub fn checkpoint_stats(&self) -> CheckpointStats {
        *self.inner.checkpoints.lock()
    }

    /// What the site keeps now, for soak tests: shipped-request markers and
    /// the committed changes its disk engine holds in memory. Cheap (kept
    /// counters): a soak samples it every few seconds under load.
    pub fn bookkeeping(&self) -> Bookkeeping {
        let kv = self.inner.kv.stats();
        Bookkeeping {
            markers: self.inner.markers.len(),
            overlay_keys: kv.overlay_keys,
            delta_tables: kv.delta_tables,
        }
    }

    /// Lock waits and conflicts seen by the CC.
    pub fn contention(&self) -> (u64, u64) {
        self.inner.cc.contention()
    }

    /// Runs operations on this copy within the (sub-)transaction `xid`: the
    /// CC locks each item (bounded wait), the AM reads or writes it.
    ///
    /// Fails with LockConflict when a lock is not granted in time,
    /// BadRequest for a malformed tuple or an overflowing balance.
    pub async fn execute(
        &self,
        xid: &Xid,
        ops: Vec<SiteOp>,
        deadline: Option<Instant>,
    ) -> Result<Vec<i64>, Failure> {
        let inner = &self.inner;
        let mut out = Vec::with_capacity(ops.len());
        for op in ops {
            // Every operation locks its item first (strict 2PL at the CC).
            let (item, mode) = op.lock();
            inner.cc.lock(xid, item, mode, deadline).await?;
            let put = |value: Bytes| {
                inner
                    .kv
                    .execute(xid, vec![Op::Put(item.kv_key(), value)], deadline)
            };
            let answer = match op {
                SiteOp::Read(_) => read_balance(&inner.kv, xid, item, deadline).await?,
                SiteOp::Update(_, delta) => {
                    let current = read_balance(&inner.kv, xid, item, deadline).await?;
                    let new = current.checked_add(delta).ok_or_else(|| {
                        Failure::new(Status::BadRequest, format!("{current} + {delta} overflows"))
                    })?;
                    put(tuple(new)).await?;
                    new
                }
                SiteOp::Claim(_) => {
                    let mut r = inner
                        .kv
                        .execute(xid, vec![Op::Get(item.kv_key())], deadline)
                        .await?;
                    match r.pop() {
                        Some(Reply::Value(v)) => i64::from(v.is_some()),
                        other => return Err(kv_failure(other)),
                    }
                }
                SiteOp::Mark(_, answer, sent_ms) => {
                    let answer = match answer {
                        Some(a) => a,
                        None => *out.first().ok_or_else(|| {
                            Failure::new(Status::BadRequest, "a mark needs an answer before it")
                        })?,
                    };
                    if item.rel != Relation::Request {
                        return Err(Failure::new(
                            Status::BadRequest,
                            format!("{item:?} is not a request marker"),
                        ));
                    }
                    if item.key != HORIZON_KEY && self.is_first_copy() {
                        inner.markers.note(item.key, sent_ms)?;
                    }
                    put(marker::encode(answer, sent_ms)).await?;
                    0
                }
                SiteOp::Answer(_) => {
                    let mut r = inner
                        .kv
                        .execute(xid, vec![Op::Get(item.kv_key())], deadline)
                        .await?;
                    match r.pop() {
                        Some(Reply::Value(Some(v))) => marker::decode(&v)
                            .map(|(answer, _)| answer)
                            .ok_or_else(|| {
                                Failure::new(
                                    Status::BadRequest,
                                    format!("{item:?} holds {} bytes, not a marker", v.len()),
                                )
                            })?,
                        Some(Reply::Value(None)) => {
                            return Err(Failure::new(
                                Status::BadRequest,
                                format!("no marker {:016x}", item.key),
                            ))
                        }
                        other => return Err(kv_failure(other)),
                    }
                }
                SiteOp::Remove(_) => {
                    inner
                        .kv
                        .execute(xid, vec![Op::Delete(item.kv_key())], deadline)
                        .await?;
                    0
                }
                SiteOp::Insert(_, row) => {
                    put(row).await?;
                    0
                }
            };
            out.push(answer);
        }
        Ok(out)
    }

    /// True when this site holds the first copy (and has started).
    fn is_first_copy(&self) -> bool {
        self.placement().is_ok_and(|r| r.first() == r.local())
    }

    /// Reads the store's markers and horizon into the index, once per
    /// start (at the first copy, before it admits a shipped request).
    pub(crate) fn ensure_markers_scanned(&self) {
        let markers = &self.inner.markers;
        if markers.scanned() {
            return;
        }
        let stored = self
            .inner
            .kv
            .committed_with_prefix(&[Relation::Request.prefix()])
            .into_iter()
            .filter_map(|(k, v)| item_of_key(&k).map(|item| (item.key, v)));
        markers.restore(stored, marker::now_ms());
    }

    /// The copies, as this site's loaded copy names them: every write goes
    /// to each of them, whether it is up or not.
    ///
    /// Fails with Unavailable before the site's node started or while its
    /// copy is not loaded, Internal when the stored placement is
    /// unreadable.
    pub fn placement(&self) -> Result<Replicas, Failure> {
        let me = self
            .inner
            .rpc
            .get()
            .ok_or_else(|| Failure::new(Status::Unavailable, "the site has not started"))?
            .node_id();
        if let Some(sites) = self.inner.placement.get() {
            return Ok(Replicas::new(sites.clone(), me));
        }
        let sites = stored_placement(&self.inner.kv)?.ok_or_else(|| {
            Failure::new(
                Status::Unavailable,
                format!("site {me}'s copy is not loaded (run `weft raid load`)"),
            )
        })?;
        Ok(Replicas::new(
            self.inner.placement.get_or_init(|| sites).clone(),
            me,
        ))
    }

    /// An action driver writing to the copies this site's loaded copy
    /// names.
    ///
    /// Fails like [`RaidSite::placement`].
    pub fn loaded_ad(&self) -> Result<Ad, Failure> {
        self.ad(self.placement()?)
    }

    /// An action driver running transactions from this site, writing to
    /// `replicas`.
    ///
    /// Fails with Unavailable before the site's node started.
    pub fn ad(&self, replicas: Replicas) -> Result<Ad, Failure> {
        let rpc = self
            .inner
            .rpc
            .get()
            .ok_or_else(|| Failure::new(Status::Unavailable, "the site has not started"))?;
        Ok(Ad::new(
            rpc.clone(),
            replicas,
            self.inner.cfg.clone(),
            Some(self.clone()),
        ))
    }

    async fn serve_site(&self, ctx: CallContext, req: SiteRequest) -> Result<SiteReply, Failure> {
        let tx = ctx.tx().ok_or_else(|| {
            Failure::new(
                Status::BadRequest,
                "site operations run within a transaction",
            )
        })?;
        // A copy that is not loaded is no copy yet: writing to it would
        // make it differ from the others.
        if self.inner.placement.get().is_none() {
            self.placement()?;
        }
        self.execute(&tx.xid(), req.0, ctx.deadline())
            .await
            .map(SiteReply)
    }

    /// The audit of this copy.
    pub fn audit(&self) -> SiteAudit {
        audit_store(&self.inner.kv)
    }
}

async fn read_balance(
    kv: &Kv,
    xid: &Xid,
    item: Item,
    deadline: Option<Instant>,
) -> Result<i64, Failure> {
    let mut r = kv
        .execute(xid, vec![Op::Get(item.kv_key())], deadline)
        .await?;
    match r.pop() {
        Some(Reply::Value(Some(v))) => balance(&v).ok_or_else(|| {
            Failure::new(
                Status::BadRequest,
                format!("{item:?} holds {} bytes, not a tuple", v.len()),
            )
        }),
        Some(Reply::Value(None)) => Err(Failure::new(
            Status::BadRequest,
            format!(
                "no {} {} (is the database loaded?)",
                item.rel.name(),
                item.key
            ),
        )),
        other => Err(kv_failure(other)),
    }
}

impl Plugin for RaidSite {
    fn name(&self) -> &str {
        "raid"
    }

    fn attach(&self, tm: &TxManager, log: &Log) -> Result<(), Failure> {
        self.inner.kv.attach(tm, log)?;
        // In-doubt branches recovered from the log get the outcome through
        // this participant: apply, then unlock.
        tm.register_resource(self.participant());
        Ok(())
    }

    fn recover(&self, tm: &TxManager, records: &[LogRecord]) -> Result<(), Failure> {
        self.inner.kv.recover(tm, records)?;
        // Branches in doubt keep their items in violation mode until the
        // outcome arrives: whoever uses them waits for it to vote.
        for (tid, keys) in self.inner.kv.prepared() {
            let items = keys.iter().filter_map(|k| item_of_key(k)).collect();
            self.inner.cc.restore_prepared(tid, items);
        }
        Ok(())
    }

    fn serve(&self, rpc: &Rpc) -> Result<(), Failure> {
        let _ = self.inner.rpc.set(rpc.clone());
        let site = self.clone();
        rpc.register(
            SITE_SERVICE,
            ServiceOptions::with_participant(self.participant()),
            move |ctx, req| {
                let site = site.clone();
                async move { site.serve_site(ctx, req).await }
            },
        )?;
        let site = self.clone();
        rpc.register(
            AD_SERVICE,
            ServiceOptions::no_state(),
            move |_ctx, req: AdRequest| {
                let site = site.clone();
                async move { site.loaded_ad()?.run(req).await.map(AdReply) }
            },
        )?;
        let site = self.clone();
        rpc.register(
            AD_HERE_SERVICE,
            ServiceOptions::no_state(),
            move |_ctx, req: crate::ad::Shipped| {
                let site = site.clone();
                async move {
                    // A first copy that is not loaded did not run it: say
                    // so (the shipping AD would otherwise ask again until
                    // its timeout, then call it in doubt).
                    Ok(match site.loaded_ad() {
                        Ok(ad) => ad.run_shipped(req).await,
                        Err(f) => crate::ad::ShippedReply::Done(Err(crate::ad::copy_unavailable(
                            me_of(&site),
                            f,
                        ))),
                    })
                }
            },
        )?;
        let site = self.clone();
        rpc.register(
            AUDIT_SERVICE,
            ServiceOptions::no_state(),
            move |_ctx, (): ()| {
                let site = site.clone();
                async move { Ok(site.audit()) }
            },
        )?;
        let site = self.clone();
        rpc.register(
            LOAD_SERVICE,
            ServiceOptions::no_state(),
            move |_ctx, req: LoadRequest| {
                let site = site.clone();
                async move {
                    let rpc = site.inner.rpc.get().expect("serving").clone();
                    load_store(&rpc, &site.inner.kv, site.participant(), req).await
                }
            },
        )?;
        self.spawn_reclaimer();
        Ok(())
    }

    fn crash(&self) {
        self.inner.crashed.store(true, Ordering::Relaxed);
        self.inner.kv.crash();
    }

    fn checkpoint(&self, log: &Log) -> Result<Option<Lsn>, Failure> {
        let start = Instant::now();
        let r = self.inner.kv.checkpoint(log);
        let us = u64::try_from(start.elapsed().as_micros()).unwrap_or(u64::MAX);
        let mut st = self.inner.checkpoints.lock();
        if r.is_ok() {
            st.count += 1;
            st.last_us = us;
            st.max_us = st.max_us.max(us);
            st.total_us = st.total_us.saturating_add(us);
        } else {
            st.failed += 1;
        }
        r
    }
}

impl RaidSite {
    /// Starts the task that reclaims due markers at the first copy, every
    /// `reclaim_every`, until the node crashes or shuts down (or the site
    /// is dropped).
    fn spawn_reclaimer(&self) {
        let weak = Arc::downgrade(&self.inner);
        let every = self.inner.markers.limits().reclaim_every;
        tokio::spawn(async move {
            let mut ticker = tokio::time::interval(every);
            ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                ticker.tick().await;
                let Some(inner) = weak.upgrade() else { return };
                if inner.crashed.load(Ordering::Relaxed) {
                    return;
                }
                let site = RaidSite { inner };
                match site.reclaim_due().await {
                    Err(f) if f.status == Status::ShuttingDown => return,
                    Err(f) => tracing::debug!("marker reclamation: {f}"),
                    Ok(_) => {}
                }
            }
        });
    }

    /// Deletes the markers due for reclamation (at most one batch) from
    /// every copy, with the raised horizon, in one transaction. Does
    /// nothing unless this site holds the first copy. Returns how many it
    /// deleted.
    ///
    /// Fails with the status of the deleting transaction (the markers are
    /// then kept, and tried again later).
    pub async fn reclaim_due(&self) -> Result<usize, Failure> {
        self.reclaim_due_at(marker::now_ms()).await
    }

    /// [`RaidSite::reclaim_due`] as if the clock read `now_ms` (tests).
    ///
    /// Fails like [`RaidSite::reclaim_due`].
    pub async fn reclaim_due_at(&self, now_ms: u64) -> Result<usize, Failure> {
        if !self.is_first_copy() {
            return Ok(0);
        }
        self.ensure_markers_scanned();
        let markers = &self.inner.markers;
        let Some(batch) = markers.take_due(now_ms).await else {
            return Ok(0);
        };
        let n = batch.ids.len();
        match self.loaded_ad()?.reclaim(&batch).await {
            Ok(()) => {
                tracing::debug!(n, horizon = batch.horizon, "markers reclaimed");
                Ok(n)
            }
            Err(f) => {
                markers.put_back(batch);
                Err(f)
            }
        }
    }

    /// The markers of requests shipped to this site.
    pub fn markers(&self) -> &Markers {
        &self.inner.markers
    }
}

/// The node a serving site runs on.
fn me_of(site: &RaidSite) -> weft_wire::NodeId {
    site.inner.rpc.get().map(Rpc::node_id).unwrap_or_default()
}

/// The item a KV key stores.
fn item_of_key(key: &[u8]) -> Option<Item> {
    if key.len() != 9 {
        return None;
    }
    let rel = match key[0] {
        b'a' => Relation::Account,
        b't' => Relation::Teller,
        b'b' => Relation::Branch,
        b'h' => Relation::History,
        b'r' => Relation::Request,
        _ => return None,
    };
    Some(Item {
        rel,
        key: u64::from_be_bytes(key[1..9].try_into().expect("8 bytes")),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_map_back_to_items() {
        for rel in [
            Relation::Account,
            Relation::Teller,
            Relation::Branch,
            Relation::History,
        ] {
            let item = Item { rel, key: 987_654 };
            assert_eq!(item_of_key(&item.kv_key()), Some(item));
        }
        assert_eq!(item_of_key(b"x"), None);
    }
}
