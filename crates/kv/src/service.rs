//! The KV service: a node's transactional key-value store, its RPC service
//! (`kv`), its part in two-phase commit, its snapshots and its recovery.
//!
//! Owns the glue between the store (data), the lock manager (isolation: strict
//! two-phase locking, a conflict waits at most a bound and then fails with
//! LockConflict) and the transaction manager (prepare writes the branch's
//! redo record to the node's log; commit applies it), and the bounds on what
//! one client may make the store hold ([`KvLimits`]). Must never make a
//! write visible before its transaction commits, hold a lock past its
//! transaction's end, nor take a lock or a byte for an operation past a
//! bound.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::future::BoxFuture;
use parking_lot::{Mutex, RwLock};
use weft_log::{Log, LogRecord, Lsn};
use weft_rpc::{CallContext, Plugin, Rpc, ServiceOptions};
use weft_tx::{ParticipationClass, Recovered, Resource, TxManager, Vote};
use weft_wire::{Failure, Status, SubPath, Tid, Xid};

use crate::api::{int_value, parse_int, KvRecord, KvRequest, KvResponse, Op, Reply, KV_RECORD_TAG};
use crate::disk::{DiskOptions, DiskStore, FlushJob, PreparedSet};
use crate::lock::{LockError, LockLimits, LockManager, LockMode, LockOwner};
use crate::snapshot;
use crate::store::{Store, WriteLimits};

/// The name the service registers under.
pub const SERVICE: &str = "kv";

impl LockOwner for Xid {
    type Family = Tid;

    fn family(&self) -> Tid {
        self.tid
    }

    fn is_ancestor_of(&self, other: &Self) -> bool {
        self.tid == other.tid && self.path.is_ancestor_or_self(&other.path)
    }

    fn parent(&self) -> Option<Self> {
        self.path.parent().map(|path| Xid {
            tid: self.tid,
            path,
        })
    }
}

/// Who isolates concurrent transactions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Locking {
    /// The store locks every key it touches (strict two-phase locking).
    Strict2PL,
    /// The caller locks before it calls (e.g. Raid's concurrency controller):
    /// the store takes no locks. Only for callers that guarantee isolation.
    External,
}

/// What one client may make the store hold: every operation past a bound is
/// refused with a precise status before it takes a lock or a byte.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvLimits {
    /// Longest key of any operation (a Scan's bounds too); longer: TooLarge.
    pub max_key_bytes: usize,
    /// Longest value a Put writes; longer: TooLarge.
    pub max_value_bytes: usize,
    /// Most keys one transaction writes at this node; more: TooLarge.
    pub max_writes: usize,
    /// Most key plus value bytes one transaction writes at this node; more:
    /// TooLarge. Below the log's largest record, which a prepare record must
    /// fit in.
    pub max_write_bytes: usize,
    /// Most keys locked at once at this node, over every transaction; a lock
    /// on one more: NoBuffer.
    pub max_locked_keys: usize,
    /// Most lock requests waiting at once at this node; one more that would
    /// wait: NoBuffer.
    pub max_lock_waiters: usize,
    /// Largest `limit` a Scan may ask for; larger: BadRequest.
    pub max_scan_rows: u32,
}

impl Default for KvLimits {
    fn default() -> Self {
        KvLimits {
            max_key_bytes: 4096,
            max_value_bytes: 1 << 20,
            max_writes: 65_536,
            max_write_bytes: 8 << 20,
            max_locked_keys: 1 << 20,
            max_lock_waiters: 65_536,
            max_scan_rows: 10_000,
        }
    }
}

/// KV settings.
#[derive(Clone, Debug)]
pub struct KvConfig {
    /// Longest wait for a lock before LockConflict.
    pub lock_wait: Duration,
    /// Where snapshots go; by default `kv/` next to the node's log directory.
    pub dir: Option<PathBuf>,
    /// Who locks.
    pub locking: Locking,
    /// Bounds on keys, values, write sets, the lock table and scans.
    pub limits: KvLimits,
    /// Where committed data lives.
    pub engine: KvEngine,
}

/// Where the committed data lives.
#[derive(Clone, Debug)]
pub enum KvEngine {
    /// Every key in memory; a checkpoint writes the whole map to one
    /// snapshot file, a restart reads it all back.
    Memory,
    /// On disk in the engine of [`crate::disk`] under a bounded cache and
    /// overlay; a checkpoint writes what changed since the last one, a
    /// restart opens the file and replays the log tail.
    Disk(DiskOptions),
}

impl Default for KvEngine {
    fn default() -> Self {
        KvEngine::Disk(DiskOptions::default())
    }
}

impl KvEngine {
    /// The engine named `memory` or `disk` (default options).
    ///
    /// Fails with the accepted names for any other name.
    pub fn parse(name: &str) -> Result<KvEngine, String> {
        match name {
            "memory" => Ok(KvEngine::Memory),
            "disk" => Ok(KvEngine::default()),
            other => Err(format!("unknown kv engine {other:?} (memory or disk)")),
        }
    }

    /// `memory` or `disk`.
    pub fn name(&self) -> &'static str {
        match self {
            KvEngine::Memory => "memory",
            KvEngine::Disk(_) => "disk",
        }
    }
}

impl Default for KvConfig {
    fn default() -> Self {
        KvConfig {
            lock_wait: Duration::from_secs(1),
            dir: None,
            locking: Locking::Strict2PL,
            limits: KvLimits::default(),
            engine: KvEngine::default(),
        }
    }
}

/// Counters of the KV service.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct KvStats {
    /// Committed changes held in memory until the next flush to the disk
    /// engine (0 in memory).
    pub overlay_keys: usize,
    /// Delta tables of the disk engine not merged into its main table yet
    /// (0 in memory).
    #[serde(default)]
    pub delta_tables: usize,
    /// Prepared write sets awaiting their outcome.
    pub prepared: usize,
    /// Lock requests that had to wait.
    pub lock_waits: u64,
    /// Lock requests that ended in LockConflict.
    pub lock_conflicts: u64,
    /// Keys locked (held or waited for) now.
    pub locked_keys: usize,
    /// Transactions that wrote here and have not prepared or ended yet.
    pub live_branches: usize,
}

struct Inner {
    cfg: KvConfig,
    store: RwLock<Store>,
    locks: LockManager<Bytes, Xid>,
    tm: OnceLock<TxManager>,
    log: OnceLock<Log>,
    dir: OnceLock<PathBuf>,
    /// Serializes flushes to the disk engine (checkpoints and spills).
    flush: Mutex<()>,
    /// A spill is running or queued.
    spilling: AtomicBool,
    /// Held by a merge of the disk engine's deltas while it runs.
    merge: Mutex<()>,
    /// A merge is running or queued.
    merging: AtomicBool,
    /// The log position of the disk engine's last checkpoint (0: none yet).
    checkpointed: AtomicU64,
}

/// A node's transactional key-value store. Cheap to clone; use it as a
/// [`Plugin`] of the node (`Node::builder(..).plugin(Arc::new(Kv::new(..)))`).
#[derive(Clone)]
pub struct Kv {
    inner: Arc<Inner>,
}

/// The two-phase participant registered with the transaction manager.
struct Participant(Arc<Inner>);

impl Kv {
    /// A store with `cfg`, empty until its node recovers it.
    pub fn new(cfg: KvConfig) -> Kv {
        let locks = LockManager::with_limits(LockLimits {
            max_keys: Some(cfg.limits.max_locked_keys),
            max_waiters: Some(cfg.limits.max_lock_waiters),
        });
        Kv {
            inner: Arc::new(Inner {
                cfg,
                store: RwLock::new(Store::new()),
                locks,
                tm: OnceLock::new(),
                log: OnceLock::new(),
                dir: OnceLock::new(),
                flush: Mutex::new(()),
                spilling: AtomicBool::new(false),
                merge: Mutex::new(()),
                merging: AtomicBool::new(false),
                checkpointed: AtomicU64::new(0),
            }),
        }
    }

    /// Committed keys, counted exactly. Not a counter: on the disk engine it
    /// looks up each key changed since the last merge beneath the newer
    /// changes, under the store's read lock, so commits at this store wait
    /// for it (seconds with a million keys in memory). For audits and tests,
    /// never for monitoring ([`Kv::stats`] is the cheap view).
    ///
    /// Fails with Internal when the disk engine cannot read.
    pub fn key_count(&self) -> Result<u64, Failure> {
        self.inner.store.read().key_count().map_err(plugin_failure)
    }

    /// Counters. Cheap: each is kept as it changes, and the store's lock is
    /// held only to read them (monitoring may call this every second).
    pub fn stats(&self) -> KvStats {
        let store = self.inner.store.read();
        let locks = self.inner.locks.stats();
        KvStats {
            overlay_keys: store.disk().map_or(0, DiskStore::overlay_len),
            delta_tables: store.disk().map_or(0, |d| d.delta_stats().0),
            prepared: store.prepared_tids().len(),
            lock_waits: locks.waits,
            lock_conflicts: locks.conflicts + locks.timeouts,
            locked_keys: self.inner.locks.len(),
            live_branches: store.live_branches(),
        }
    }

    /// Loads an empty store on the disk engine with `data` (in key order
    /// for speed; no key twice) straight into the engine's merged table,
    /// without transactions or log records, and checkpoints it: the
    /// initial load of a large database (ten million tuples in about a
    /// minute, and no delta file grown to the data's size by spills).
    /// Returns false, writing nothing, when the store is not empty (a key,
    /// a change in memory, a prepared or live branch), runs on the memory
    /// engine, or is not attached to a node yet: the caller then loads
    /// through transactions.
    ///
    /// Holds the store (every read and write waits) while it runs. The
    /// data is durable when this returns, before any record that follows
    /// it in the log; a crash during it leaves the store empty or loaded
    /// whole (the engine's import is one durable commit of its merged
    /// table, then a checkpoint at the log's end).
    ///
    /// Fails with Internal when the engine or the log cannot write.
    pub fn bulk_load(&self, data: impl Iterator<Item = (Bytes, Bytes)>) -> Result<bool, Failure> {
        let Some(log) = self.inner.log.get() else {
            return Ok(false);
        };
        let _merge = self.inner.merge.lock();
        let _flush = self.inner.flush.lock();
        let mut store = self.inner.store.write();
        let empty = match store.disk() {
            Some(d) if d.overlay_len() == 0 => {
                let mut any = false;
                d.visit_range(&Bytes::new(), &Bytes::new(), |_, _| {
                    any = true;
                    false
                })
                .map_err(plugin_failure)?;
                !any
            }
            _ => false,
        } && store.live_branches() == 0
            && store.prepared_tids().is_empty();
        if !empty {
            return Ok(false);
        }
        let at = log.end_lsn();
        let last = log.last_lsn();
        if last > log.durable_lsn() {
            log.force_blocking(last).map_err(plugin_failure)?;
        }
        let disk = store.disk_mut().expect("checked: on disk");
        crate::disk::import(disk, data, at.get(), &[]).map_err(plugin_failure)?;
        self.inner.checkpointed.store(at.get(), Ordering::Release);
        Ok(true)
    }

    /// Keys locked (held or waited for) now.
    pub fn locked_keys(&self) -> usize {
        self.inner.locks.len()
    }

    /// The committed value of `key`, outside any transaction (a dirty-free
    /// read of the last committed state; for audits and tests).
    ///
    /// # Panics
    /// When the disk engine cannot read (a test's helper; code that must
    /// survive a damaged disk calls [`Kv::try_committed`]).
    pub fn committed(&self, key: &[u8]) -> Option<Bytes> {
        self.try_committed(key)
            .unwrap_or_else(|f| panic!("kv: reading {key:?}: {f}"))
    }

    /// The committed value of `key`, outside any transaction.
    ///
    /// Fails with Internal when the disk engine cannot read.
    pub fn try_committed(&self, key: &[u8]) -> Result<Option<Bytes>, Failure> {
        self.inner
            .store
            .read()
            .committed(&Bytes::copy_from_slice(key))
            .map_err(plugin_failure)
    }

    /// The keys of every prepared write set still waiting for its outcome
    /// (after recovery: the branches in doubt), in the order of their
    /// prepare records. A caller that locks for the store
    /// ([`Locking::External`]) re-locks these at start-up.
    pub fn prepared(&self) -> Vec<(Tid, Vec<Bytes>)> {
        let store = self.inner.store.read();
        store
            .prepared_in_log_order()
            .into_iter()
            .map(|t| (t, store.prepared_keys(t)))
            .collect()
    }

    /// Every committed pair whose key starts with `prefix`, in key order.
    ///
    /// # Panics
    /// When the disk engine cannot read (a test's helper; see
    /// [`Kv::visit_committed_with_prefix`]).
    pub fn committed_with_prefix(&self, prefix: &[u8]) -> Vec<(Bytes, Bytes)> {
        let mut out = Vec::new();
        self.visit_committed_with_prefix(prefix, |k, v| {
            out.push((k.clone(), v.clone()));
            true
        })
        .unwrap_or_else(|f| panic!("kv: reading keys with prefix {prefix:?}: {f}"));
        out
    }

    /// Visits every committed pair whose key starts with `prefix`, in key
    /// order, until `visit` returns false, without collecting them (an audit
    /// of ten million keys). Holds the store's read lock meanwhile: commits
    /// wait, so keep `visit` short.
    ///
    /// Fails with Internal when the disk engine cannot read.
    pub fn visit_committed_with_prefix(
        &self,
        prefix: &[u8],
        mut visit: impl FnMut(&Bytes, &Bytes) -> bool,
    ) -> Result<(), Failure> {
        let start = Bytes::copy_from_slice(prefix);
        self.inner
            .store
            .read()
            .committed_data()
            .visit_range(&start, &Bytes::new(), |k, v| {
                k.starts_with(prefix) && visit(k, v)
            })
            .map_err(plugin_failure)
    }

    /// Runs operations within the (sub-)transaction `xid` at this node. The
    /// caller must have made this node a participant of the transaction
    /// (the `kv` service does so for calls; local code uses
    /// `TxManager::enlist` through [`Kv::resource`]).
    ///
    /// Fails with LockConflict when a lock is not granted within the bound
    /// (or before `deadline`), BadRequest for an Add on a non-integer value.
    pub async fn execute(
        &self,
        xid: &Xid,
        ops: Vec<Op>,
        deadline: Option<Instant>,
    ) -> Result<Vec<Reply>, Failure> {
        let mut out = Vec::with_capacity(ops.len());
        for op in ops {
            out.push(self.execute_one(xid, op, deadline).await?);
        }
        Ok(out)
    }

    /// The participant to enlist explicitly (for operations run through
    /// [`Kv::execute`] from local code).
    pub fn resource(&self) -> Arc<dyn Resource> {
        Arc::new(Participant(Arc::clone(&self.inner)))
    }

    async fn lock(
        &self,
        xid: &Xid,
        key: &Bytes,
        mode: LockMode,
        deadline: Option<Instant>,
    ) -> Result<(), Failure> {
        if self.inner.cfg.locking == Locking::External {
            return Ok(());
        }
        let mut bound = self.inner.cfg.lock_wait;
        if let Some(d) = deadline {
            bound = bound.min(d.saturating_duration_since(Instant::now()));
        }
        self.inner.locks.lock(xid.clone(), key.clone(), mode, bound).await.map_err(|e| match e {
            LockError::Conflict { key, holders } => Failure::new(
                Status::LockConflict,
                format!("{xid}: {mode} lock on {key} not granted within {bound:?} (held by {holders:?})"),
            ),
            e @ (LockError::TableFull { .. } | LockError::QueueFull { .. }) => {
                Failure::new(Status::NoBuffer, format!("{xid}: {e}"))
            }
            e @ LockError::Abandoned { .. } => Failure::new(Status::Aborted, format!("{xid}: {e}")),
            other => Failure::new(Status::LockConflict, format!("{xid}: {other}")),
        })
    }

    /// Refuses an operation whose keys, value or scan exceed the limits.
    fn check_op(&self, op: &Op) -> Result<(), Failure> {
        let limits = &self.inner.cfg.limits;
        let key = |k: &Bytes| {
            if k.len() > limits.max_key_bytes {
                Err(Failure::new(
                    Status::TooLarge,
                    format!(
                        "kv: a {}-byte key (at most {})",
                        k.len(),
                        limits.max_key_bytes
                    ),
                ))
            } else {
                Ok(())
            }
        };
        match op {
            Op::Get(k) | Op::Delete(k) | Op::Add(k, _) => key(k),
            Op::Put(k, v) => {
                key(k)?;
                if v.len() > limits.max_value_bytes {
                    return Err(Failure::new(
                        Status::TooLarge,
                        format!(
                            "kv: a {}-byte value (at most {})",
                            v.len(),
                            limits.max_value_bytes
                        ),
                    ));
                }
                Ok(())
            }
            Op::Scan { start, end, limit } => {
                key(start)?;
                key(end)?;
                if *limit > limits.max_scan_rows {
                    return Err(Failure::new(
                        Status::BadRequest,
                        format!(
                            "kv: a scan of up to {limit} rows (at most {})",
                            limits.max_scan_rows
                        ),
                    ));
                }
                Ok(())
            }
        }
    }

    /// Records a write within the transaction's write-set bound.
    fn write(&self, xid: &Xid, key: Bytes, value: Option<Bytes>) -> Result<(), Failure> {
        let limits = &self.inner.cfg.limits;
        self.inner
            .store
            .write()
            .try_write(
                xid,
                key,
                value,
                WriteLimits {
                    max_writes: limits.max_writes,
                    max_bytes: limits.max_write_bytes,
                },
            )
            .map_err(|e| Failure::new(Status::TooLarge, format!("kv: {e}")))
    }

    /// The value `xid` sees at `key`, which it holds a lock on: the store's
    /// lock is held only for the in-memory part of the search, not for the
    /// disk engine's page reads.
    ///
    /// Fails with Internal when the disk engine cannot read.
    fn read_locked(&self, xid: &Xid, key: &Bytes) -> Result<Option<Bytes>, Failure> {
        let lookup = self.inner.store.read().lookup(xid, key);
        lookup.value(key).map_err(plugin_failure)
    }

    async fn execute_one(
        &self,
        xid: &Xid,
        op: Op,
        deadline: Option<Instant>,
    ) -> Result<Reply, Failure> {
        self.check_op(&op)?;
        match op {
            Op::Get(key) => {
                self.lock(xid, &key, LockMode::Shared, deadline).await?;
                Ok(Reply::Value(self.read_locked(xid, &key)?))
            }
            Op::Put(key, value) => {
                self.lock(xid, &key, LockMode::Exclusive, deadline).await?;
                self.write(xid, key, Some(value))?;
                Ok(Reply::Done)
            }
            Op::Delete(key) => {
                self.lock(xid, &key, LockMode::Exclusive, deadline).await?;
                self.write(xid, key, None)?;
                Ok(Reply::Done)
            }
            Op::Add(key, delta) => {
                self.lock(xid, &key, LockMode::Exclusive, deadline).await?;
                let current = match self.read_locked(xid, &key)? {
                    None => 0,
                    Some(v) => parse_int(&v).ok_or_else(|| {
                        Failure::new(
                            Status::BadRequest,
                            format!(
                                "value at {key:?} is not a 64-bit integer ({} bytes)",
                                v.len()
                            ),
                        )
                    })?,
                };
                let new = current.checked_add(delta).ok_or_else(|| {
                    Failure::new(Status::BadRequest, format!("{current} + {delta} overflows"))
                })?;
                self.write(xid, key, Some(int_value(new)))?;
                Ok(Reply::Number(new))
            }
            Op::Scan { start, end, limit } => {
                let keys: Vec<Bytes> = self
                    .inner
                    .store
                    .read()
                    .scan(xid, &start, &end, limit as usize)
                    .map_err(plugin_failure)?
                    .into_iter()
                    .map(|(k, _)| k)
                    .collect();
                let mut rows = Vec::with_capacity(keys.len());
                for k in keys {
                    self.lock(xid, &k, LockMode::Shared, deadline).await?;
                    // Re-read under the lock: the value may have changed.
                    if let Some(v) = self.read_locked(xid, &k)? {
                        rows.push((k, v));
                    }
                }
                Ok(Reply::Rows(rows))
            }
        }
    }

    async fn serve_call(&self, ctx: CallContext, req: KvRequest) -> Result<KvResponse, Failure> {
        let deadline = ctx.deadline();
        match ctx.tx() {
            Some(tx) => self
                .execute(&tx.xid(), req.0, deadline)
                .await
                .map(KvResponse),
            None => {
                // No transaction: a local one-operation transaction.
                let tm = self.tm()?;
                let ctx = tm.begin(None);
                tm.enlist(ctx.tid, self.resource())?;
                match self.execute(&ctx.xid(), req.0, deadline).await {
                    Ok(replies) => {
                        tm.commit(ctx.tid).await?;
                        Ok(KvResponse(replies))
                    }
                    Err(f) => {
                        let _ = tm.abort(ctx.tid, &f.detail).await;
                        Err(f)
                    }
                }
            }
        }
    }

    fn tm(&self) -> Result<&TxManager, Failure> {
        self.inner.tm.get().ok_or_else(|| {
            Failure::new(
                Status::Unavailable,
                "the KV store is not attached to a node",
            )
        })
    }

    fn snapshot_dir(&self) -> Option<&PathBuf> {
        self.inner.dir.get()
    }
}

impl Resource for Participant {
    fn name(&self) -> &str {
        SERVICE
    }

    fn commits_from_this_log(&self) -> bool {
        true // the store is rebuilt from snapshots and this node's log
    }

    fn class(&self) -> ParticipationClass {
        ParticipationClass::TwoPhase
    }

    fn prepare<'a>(&'a self, tid: Tid, log: &'a Log) -> BoxFuture<'a, Vote> {
        Box::pin(async move {
            let prepared = self.0.store.write().prepare(tid, &[], |writes| {
                KvRecord::append_prepared(log, tid, writes)
            });
            match prepared {
                Ok(None) => {
                    // Read-only: leave the protocol now and release everything.
                    self.0.locks.release_all(&tid);
                    Vote::ReadOnly
                }
                Ok(Some(_)) => {
                    // Strict 2PL keeps write locks to the end; reads are done.
                    self.0.locks.release_shared(&Xid::top(tid));
                    Vote::Yes { durable: true }
                }
                Err(e) => {
                    self.0.store.write().abort(tid);
                    self.0.locks.release_all(&tid);
                    Vote::No(format!("kv: cannot log the prepare record: {e}"))
                }
            }
        })
    }

    fn commit(&self, tid: Tid) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            let spill = {
                let mut store = self.0.store.write();
                store.commit(tid);
                store.disk().is_some_and(DiskStore::should_spill)
            };
            self.0.locks.release_all(&tid);
            if spill && !self.0.spilling.swap(true, Ordering::AcqRel) {
                let inner = Arc::clone(&self.0);
                let run = move || {
                    if let Err(e) = spill_overlay(&inner) {
                        tracing::warn!(error = %e, "kv: spill to the disk engine failed; kept in memory");
                    }
                    inner.spilling.store(false, Ordering::Release);
                    maybe_merge(&inner);
                };
                // A spill writes up to the overlay's bound: off the runtime's
                // threads when there is one.
                match tokio::runtime::Handle::try_current() {
                    Ok(h) => {
                        h.spawn_blocking(run);
                    }
                    Err(_) => run(),
                }
            }
        })
    }

    fn abort(&self, tid: Tid) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            self.0.store.write().abort(tid);
            self.0.locks.release_all(&tid);
        })
    }

    fn held(&self) -> Vec<(Tid, String)> {
        let mut out: Vec<(Tid, String)> = self
            .0
            .store
            .read()
            .prepared_tids()
            .into_iter()
            .map(|t| (t, "prepared write set".to_string()))
            .collect();
        for (tid, keys) in self.0.locks.families_holding() {
            out.push((tid, format!("locks on {keys} key(s)")));
        }
        out
    }

    fn sub_ended(&self, tid: Tid, path: &SubPath, committed: bool) {
        self.0.store.write().sub_ended(tid, path, committed);
        let owner = Xid {
            tid,
            path: path.clone(),
        };
        let _ = if committed {
            self.0.locks.commit_sub(&owner)
        } else {
            self.0.locks.abort_sub(&owner)
        };
    }
}

fn plugin_failure(e: impl std::fmt::Display) -> Failure {
    Failure::new(Status::Internal, format!("kv: {e}"))
}

impl Plugin for Kv {
    fn name(&self) -> &str {
        SERVICE
    }

    fn attach(&self, tm: &TxManager, log: &Log) -> Result<(), Failure> {
        let dir = self.inner.cfg.dir.clone().unwrap_or_else(|| {
            log.dir()
                .parent()
                .map(|p| p.join("kv"))
                .unwrap_or_else(|| log.dir().join("kv"))
        });
        let _ = self.inner.dir.set(dir);
        let _ = self.inner.tm.set(tm.clone());
        let _ = self.inner.log.set(log.clone());
        tm.register_resource(self.resource());
        Ok(())
    }

    fn recover(&self, tm: &TxManager, records: &[LogRecord]) -> Result<(), Failure> {
        let dir = self
            .snapshot_dir()
            .cloned()
            .ok_or_else(|| plugin_failure("not attached"))?;
        let snap = snapshot::read(&dir).map_err(plugin_failure)?;
        let (from, mut store, file) = match &self.inner.cfg.engine {
            KvEngine::Memory => {
                let at = snap.as_ref().map(|(at, _)| *at);
                let (_, image) = snap.unwrap_or_default();
                (at, Store::from_image(image), snapshot::path(&dir))
            }
            KvEngine::Disk(opts) => {
                let dur = self
                    .inner
                    .log
                    .get()
                    .map(|l| l.durability().clone())
                    .unwrap_or_default();
                let opened = DiskStore::open(&dir, &dur, opts.clone()).map_err(plugin_failure)?;
                let (mut disk, mut at, mut prepared) = (opened.store, opened.lsn, opened.prepared);
                // A snapshot of the memory engine newer than the disk
                // engine's checkpoint (the store ran in memory since): its
                // image replaces the engine's content.
                if let Some((snap_at, image)) = snap.filter(|(s, _)| at.is_none_or(|a| *s > a)) {
                    tracing::info!(
                        keys = image.committed.len(),
                        lsn = snap_at,
                        "kv: importing the memory engine's snapshot into the disk engine"
                    );
                    crate::disk::import(
                        &mut disk,
                        image.committed.into_iter(),
                        snap_at,
                        &image.prepared,
                    )
                    .map_err(plugin_failure)?;
                    at = Some(snap_at);
                    prepared = image.prepared;
                }
                let file = disk.file().to_path_buf();
                self.inner
                    .checkpointed
                    .store(at.unwrap_or(0), Ordering::Release);
                (at, Store::on_disk(disk, prepared), file)
            }
        };
        if let Some(log) = self.inner.log.get() {
            let (start, end) = (log.first_lsn().get(), log.end_lsn().get());
            snapshot::check_covers(&file, from, log.dir(), start, end).map_err(|e| {
                tracing::error!(error = %e, "kv cannot recover");
                plugin_failure(e)
            })?;
        }
        let from = from.unwrap_or(0);
        for r in records
            .iter()
            .filter(|r| r.tag == KV_RECORD_TAG && r.lsn.get() >= from)
        {
            let rec: KvRecord = postcard::from_bytes(&r.payload)
                .map_err(|e| plugin_failure(format!("undecodable record at {}: {e}", r.lsn)))?;
            match rec {
                KvRecord::Prepared { tid, writes } => {
                    store.restore_prepared(tid, r.lsn.get(), writes)
                }
            }
        }
        let (mut redone, mut dropped, mut in_doubt) = (0, 0, 0);
        for tid in store.prepared_in_log_order() {
            match tm.recovered(tid) {
                Some(Recovered::Committed) => {
                    store.commit(tid);
                    redone += 1;
                }
                Some(Recovered::InDoubt) => {
                    // Keep it ready, and locked, until the outcome arrives
                    // (an external lock owner re-locks for itself: it may
                    // let several in-doubt writers share a key).
                    let keys = match self.inner.cfg.locking {
                        Locking::Strict2PL => store.prepared_keys(tid),
                        Locking::External => Vec::new(),
                    };
                    for key in keys {
                        self.inner
                            .locks
                            .try_lock(Xid::top(tid), key, LockMode::Exclusive)
                            .map_err(plugin_failure)?;
                    }
                    in_doubt += 1;
                }
                Some(Recovered::Aborted) | None => {
                    store.abort(tid);
                    dropped += 1;
                }
            }
        }
        tracing::info!(
            overlay = store.disk().map_or(0, DiskStore::overlay_len),
            redone,
            dropped,
            in_doubt,
            "kv recovered"
        );
        *self.inner.store.write() = store;
        Ok(())
    }

    fn serve(&self, rpc: &Rpc) -> Result<(), Failure> {
        let kv = self.clone();
        rpc.register(
            SERVICE,
            ServiceOptions::with_participant(self.resource()),
            move |ctx, req: KvRequest| {
                let kv = kv.clone();
                async move { kv.serve_call(ctx, req).await }
            },
        )
    }

    fn checkpoint(&self, log: &Log) -> Result<Option<Lsn>, Failure> {
        let dir = self
            .snapshot_dir()
            .cloned()
            .ok_or_else(|| plugin_failure("not attached"))?;
        let _flush = self.inner.flush.lock();
        let started = Instant::now();
        // The state and its log position are taken together under the store
        // lock: every record before `at` is reflected in it (for the disk
        // engine: in the engine's last flush plus the frozen overlay).
        let (at, last, state, oldest) = {
            let mut store = self.inner.store.write();
            let at = log.end_lsn();
            let last = log.last_lsn();
            let oldest = store.oldest_prepared();
            let prepared = store.prepared_image();
            let state = match store.image() {
                Some(image) => Checkpointed::Image(image),
                None => {
                    let disk = store.disk_mut().expect("a store not in memory is on disk");
                    let job = disk
                        .begin_flush()
                        .expect("flushes are serialized by the flush lock");
                    Checkpointed::Flush(job, prepared)
                }
            };
            (at, last, state, oldest)
        };
        // The state may hold commits whose records are not durable yet
        // (early lock release applies them once appended): the checkpoint
        // must not outlive them, so they are forced first.
        let forced = if last > log.durable_lsn() {
            log.force_blocking(last).map_err(plugin_failure)
        } else {
            Ok(())
        };
        match state {
            Checkpointed::Image(image) => {
                forced?;
                snapshot::write(log.durability(), &dir, at.get(), &image)
                    .map_err(plugin_failure)?;
            }
            Checkpointed::Flush(job, _)
                if job.is_empty()
                    && self.inner.checkpointed.load(Ordering::Acquire) == at.get() =>
            {
                // Nothing appended since the last checkpoint (a prepare, an
                // outcome, a commit all append): the engine holds it already.
                forced?;
                self.inner
                    .store
                    .write()
                    .disk_mut()
                    .expect("on disk")
                    .end_flush(&job);
            }
            Checkpointed::Flush(job, prepared) => {
                let written = forced.and_then(|()| {
                    job.write(Some((at.get(), &prepared)))
                        .map_err(plugin_failure)
                });
                self.inner
                    .store
                    .write()
                    .disk_mut()
                    .expect("on disk")
                    .end_flush(&job);
                written?;
                self.inner.checkpointed.store(at.get(), Ordering::Release);
                tracing::info!(
                    keys = job.len(),
                    lsn = at.get(),
                    ms = started.elapsed().as_millis() as u64,
                    "kv checkpoint written"
                );
            }
        }
        maybe_merge(&self.inner);
        // Keep the records of prepared branches: the transaction manager's
        // outcome records for them follow their prepare records.
        Ok(Some(Lsn(oldest.map_or(at.get(), |o| o.min(at.get())))))
    }

    /// Closes the disk engine as a killed process would leave it: the
    /// overlay is dropped (its commits are in the log), so that the node
    /// restarted in this process can open the engine file again.
    fn crash(&self) {
        let _merge = self.inner.merge.lock();
        let _flush = self.inner.flush.lock();
        *self.inner.store.write() = Store::default();
    }
}

/// What a checkpoint writes.
enum Checkpointed {
    /// The whole in-memory state.
    Image(crate::store::Image),
    /// What changed since the last flush, with the prepared write sets.
    Flush(FlushJob, Vec<PreparedSet>),
}

/// Starts a merge of the disk engine's deltas into its merged table when
/// they passed their bound and none is running: in the background (see
/// [`crate::background`]: a thread of its own at a lower priority, one
/// merge at a time in the process; here when there is no runtime), on the
/// engine's other file, so checkpoints and spills go on meanwhile.
fn maybe_merge(inner: &Arc<Inner>) {
    let wanted = inner
        .store
        .read()
        .disk()
        .is_some_and(DiskStore::should_merge);
    if !wanted || inner.merging.swap(true, Ordering::AcqRel) {
        return;
    }
    let inner2 = Arc::clone(inner);
    let run = move || {
        if let Err(e) = merge_deltas(&inner2) {
            tracing::warn!(error = %e, "kv: merge of the disk engine's deltas failed; they stay read as deltas");
        }
        inner2.merging.store(false, Ordering::Release);
    };
    if let Err(e) = crate::background::spawn_merge(run) {
        tracing::warn!(error = %e, "kv: cannot start a merge thread; the deltas stay read as they are");
        inner.merging.store(false, Ordering::Release);
    }
}

/// Merges the disk engine's deltas into its merged table (content
/// unchanged, durable in the engine's main file).
///
/// Fails with Internal when the engine cannot read or write; the deltas then
/// stay, read as before.
fn merge_deltas(inner: &Inner) -> Result<(), Failure> {
    let _merge = inner.merge.lock();
    let job = {
        let mut store = inner.store.write();
        match store.disk_mut().map(DiskStore::begin_merge) {
            Some(Ok(Some(job))) => job,
            Some(Err(e)) => return Err(plugin_failure(e)),
            _ => return Ok(()),
        }
    };
    let started = Instant::now();
    let written = job.write().map_err(plugin_failure);
    if let Some(d) = inner.store.write().disk_mut() {
        d.end_merge(&job);
    }
    written?;
    tracing::info!(
        entries = job.entries().unwrap_or(0),
        ms = started.elapsed().as_millis() as u64,
        "kv: deltas merged into the disk engine's main table"
    );
    Ok(())
}

/// Writes the disk engine's overlay without making it durable (it passed its
/// bound between checkpoints). Skips when a checkpoint is flushing.
///
/// Fails with Internal when the engine cannot write; the overlay then stays
/// in memory for the next flush.
fn spill_overlay(inner: &Inner) -> Result<(), Failure> {
    let Some(_flush) = inner.flush.try_lock() else {
        return Ok(());
    };
    let (job, last) = {
        let mut store = inner.store.write();
        let last = inner.log.get().map(Log::last_lsn);
        match store.disk_mut().and_then(DiskStore::begin_flush) {
            Some(job) => (job, last),
            None => return Ok(()),
        }
    };
    // A spill is not durable, but a clean close of the engine makes its last
    // commit durable: the commits it holds must not outlive their records
    // (early lock release applies them once appended), so those are forced
    // first, as for a checkpoint. Replaying the log from the last checkpoint
    // over such a newer state redoes the same final values.
    let forced = match (inner.log.get(), last) {
        (Some(log), Some(last)) if last > log.durable_lsn() => {
            log.force_blocking(last).map_err(plugin_failure)
        }
        _ => Ok(()),
    };
    let written = forced.and_then(|()| job.write(None).map_err(plugin_failure));
    inner
        .store
        .write()
        .disk_mut()
        .expect("on disk")
        .end_flush(&job);
    written?;
    tracing::debug!(keys = job.len(), "kv: overlay spilled to the disk engine");
    Ok(())
}
