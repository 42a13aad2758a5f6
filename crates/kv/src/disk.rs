//! The KV store's committed data on disk: a redb B-tree under an in-memory
//! overlay of the changes since the last flush.
//!
//! Owns the engine file (`kv.redb` in the store's directory), its tables and
//! the overlay. Must never make the engine durable outside a checkpoint (no
//! fsync per commit: weft's log is the write-ahead log), never write the
//! checkpoint's log position in a commit apart from the data it covers, and
//! never hold more than a bounded overlay in memory without asking for a
//! spill ([`DiskStore::should_spill`]).
//!
//! ## Why redb
//! redb is a copy-on-write B-tree whose commit is atomic (two commit slots
//! and a god byte, checksummed): a commit with [`redb::Durability::None`]
//! writes pages without an fsync and becomes durable only with the next
//! `Immediate` commit; after a crash the file reverts to the last durable
//! commit, whole. That is exactly a checkpoint: the engine's durable state
//! changes only at a checkpoint, in one commit holding the data, the prepared
//! write sets and the log position they are valid as of. Its page cache has a
//! size ([`DiskOptions::cache_bytes`]), its storage is pluggable
//! ([`redb::StorageBackend`], see [`DiskOptions::backend`]), and quick-repair
//! keeps a reopen after a crash from walking the whole file. An LSM (fjall)
//! would bring its own write-ahead journal, a second log to keep in step with
//! weft's; a B-tree keyed like the store reads with one lookup.
//!
//! ## Layout of the state
//! - `base`: a read snapshot of the engine as of the last flush;
//! - `flushing`: the overlay being written by a flush in progress (frozen);
//! - `dirty`: commits since then (`None`: deleted).
//!
//! A read looks in `dirty`, then `flushing`, then `base`. A flush
//! ([`DiskStore::begin_flush`], [`FlushJob::write`], [`DiskStore::end_flush`])
//! moves `dirty` to `flushing` in O(1) under the store's lock, writes it to the
//! engine outside the lock, and then swaps `base` for a snapshot holding it.
//! A checkpoint is a flush committed `Immediate` with its log position; a spill
//! (the overlay passed its bound between checkpoints) is a flush committed
//! with `Durability::None`, so a crash forgets it together with everything
//! after the last checkpoint, and recovery replays weft's log from there.
//! (A clean close of the engine makes its last commit durable, spill or not:
//! the engine may then hold a state newer than its checkpoint's position.
//! Replay is idempotent over it, since a prepare record holds final values
//! and they are redone in log order; the service forces the log over a
//! spill's commits before writing it, so no such state outlives its log.)

use std::collections::BTreeMap;
use std::fmt;
use std::fs::OpenOptions;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use bytes::Bytes;
use redb::{
    Database, Durability as RedbDurability, ReadOnlyTable, ReadableTable, ReadableTableMetadata,
    StorageBackend, TableDefinition,
};
use weft_log::Durability;
use weft_wire::Tid;

use crate::api::Write;

const DATA: TableDefinition<&[u8], &[u8]> = TableDefinition::new("data");
const META: TableDefinition<&str, &[u8]> = TableDefinition::new("meta");
const META_LSN: &str = "lsn";
const META_PREPARED: &str = "prepared";

/// The engine file in a store's directory.
pub fn path(dir: &Path) -> PathBuf {
    dir.join("kv.redb")
}

/// Opens a storage backend for the engine file at the given path (a
/// simulator's disk, a fault-injecting file).
pub type BackendFactory =
    Arc<dyn Fn(&Path) -> io::Result<Box<dyn StorageBackend>> + Send + Sync + 'static>;

/// Settings of the on-disk engine.
#[derive(Clone)]
pub struct DiskOptions {
    /// Bytes of engine pages cached in memory.
    pub cache_bytes: usize,
    /// Keys changed since the last flush past which a spill is asked for.
    pub spill_entries: usize,
    /// Key and value bytes changed since the last flush past which a spill
    /// is asked for.
    pub spill_bytes: usize,
    /// The engine's storage; `None`: the real file `kv.redb`.
    pub backend: Option<BackendFactory>,
}

impl Default for DiskOptions {
    fn default() -> Self {
        DiskOptions {
            cache_bytes: 64 << 20,
            spill_entries: 262_144,
            spill_bytes: 64 << 20,
            backend: None,
        }
    }
}

impl fmt::Debug for DiskOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DiskOptions")
            .field("cache_bytes", &self.cache_bytes)
            .field("spill_entries", &self.spill_entries)
            .field("spill_bytes", &self.spill_bytes)
            .field("backend", &self.backend.as_ref().map(|_| "custom"))
            .finish()
    }
}

/// Why the engine failed.
#[derive(Debug, thiserror::Error)]
pub enum DiskError {
    /// The engine reported an error (I/O, corruption, a damaged file).
    #[error("kv engine {path}: {source}")]
    Engine {
        /// The engine file.
        path: PathBuf,
        /// The engine's error.
        source: Box<redb::Error>,
    },
    /// File system error outside the engine.
    #[error("kv engine {path}: {context}: {source}")]
    Io {
        /// The engine file.
        path: PathBuf,
        /// What was being done.
        context: &'static str,
        /// The OS error.
        source: io::Error,
    },
    /// The engine's own records do not decode.
    #[error("kv engine {path} is corrupt: {reason}")]
    Corrupt {
        /// The engine file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
}

/// Changes not yet in the engine's base snapshot (`None`: deleted).
pub type Overlay = BTreeMap<Bytes, Option<Bytes>>;

/// A prepared write set as the engine keeps it: transaction, log position of
/// its prepare record, writes.
pub type PreparedSet = (Tid, u64, Vec<Write>);

/// What [`DiskStore::open`] found.
pub struct Opened {
    /// The store.
    pub store: DiskStore,
    /// The log position of the last checkpoint; `None` for a fresh engine.
    pub lsn: Option<u64>,
    /// The prepared write sets of that checkpoint.
    pub prepared: Vec<PreparedSet>,
}

/// Wraps a boxed backend (redb takes one by value).
#[derive(Debug)]
struct Boxed(Box<dyn StorageBackend>);

impl StorageBackend for Boxed {
    fn len(&self) -> io::Result<u64> {
        self.0.len()
    }
    fn read(&self, offset: u64, len: usize) -> io::Result<Vec<u8>> {
        self.0.read(offset, len)
    }
    fn set_len(&self, len: u64) -> io::Result<()> {
        self.0.set_len(len)
    }
    fn sync_data(&self, eventual: bool) -> io::Result<()> {
        self.0.sync_data(eventual)
    }
    fn write(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        self.0.write(offset, data)
    }
}

type Base = ReadOnlyTable<&'static [u8], &'static [u8]>;

/// The committed data of a store on disk.
pub struct DiskStore {
    db: Arc<Database>,
    path: PathBuf,
    base: Base,
    flushing: Option<Arc<Overlay>>,
    dirty: Overlay,
    dirty_bytes: usize,
    opts: DiskOptions,
}

impl fmt::Debug for DiskStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DiskStore")
            .field("path", &self.path)
            .field("dirty", &self.dirty.len())
            .field("flushing", &self.flushing.as_ref().map(|f| f.len()))
            .finish()
    }
}

fn overlay_bytes(k: &Bytes, v: &Option<Bytes>) -> usize {
    k.len() + v.as_ref().map_or(0, Bytes::len) + 64
}

impl DiskStore {
    fn engine_err(&self) -> impl Fn(redb::Error) -> DiskError + '_ {
        |e| DiskError::Engine {
            path: self.path.clone(),
            source: Box::new(e),
        }
    }

    /// Opens (creating if missing) the engine in `dir`; a new directory and
    /// file are made durable through `dur` before this returns.
    ///
    /// Fails with [`DiskError`] when the file cannot be opened or created,
    /// is not an engine file, or its records do not decode.
    pub fn open(dir: &Path, dur: &Durability, opts: DiskOptions) -> Result<Opened, DiskError> {
        let file = path(dir);
        let io_err = |context| {
            let file = file.clone();
            move |source| DiskError::Io {
                path: file,
                context,
                source,
            }
        };
        let engine = |e: redb::Error| DiskError::Engine {
            path: file.clone(),
            source: Box::new(e),
        };
        let mut builder = Database::builder();
        builder.set_cache_size(opts.cache_bytes);
        let db = match &opts.backend {
            Some(factory) => {
                let backend = factory(&file).map_err(io_err("opening the backend"))?;
                builder
                    .create_with_backend(Boxed(backend))
                    .map_err(|e| engine(e.into()))?
            }
            None => {
                let fresh = !file.exists();
                let f = if fresh {
                    dur.create_dir_all(dir)
                        .map_err(io_err("creating the directory"))?;
                    dur.create_file(&file)
                        .map_err(io_err("creating the file"))?
                } else {
                    OpenOptions::new()
                        .read(true)
                        .write(true)
                        .open(&file)
                        .map_err(io_err("opening the file"))?
                };
                let db = builder.create_file(f).map_err(|e| engine(e.into()))?;
                if fresh {
                    dur.sync_dir(dir).map_err(io_err("syncing the directory"))?;
                }
                db
            }
        };
        // Make both tables exist, durably, so a read snapshot can open them.
        let mut tx = db.begin_write().map_err(|e| engine(e.into()))?;
        tx.set_durability(RedbDurability::Immediate);
        tx.set_quick_repair(true);
        let (lsn, prepared) = {
            tx.open_table(DATA).map_err(|e| engine(e.into()))?;
            let meta = tx.open_table(META).map_err(|e| engine(e.into()))?;
            let corrupt = |reason: String| DiskError::Corrupt {
                path: file.clone(),
                reason,
            };
            let lsn = match meta.get(META_LSN).map_err(|e| engine(e.into()))? {
                None => None,
                Some(v) => {
                    Some(u64::from_le_bytes(v.value().try_into().map_err(|_| {
                        corrupt("checkpoint position is not 8 bytes".into())
                    })?))
                }
            };
            let prepared: Vec<PreparedSet> =
                match meta.get(META_PREPARED).map_err(|e| engine(e.into()))? {
                    None => Vec::new(),
                    Some(v) => postcard::from_bytes(v.value())
                        .map_err(|e| corrupt(format!("prepared write sets undecodable: {e}")))?,
                };
            (lsn, prepared)
        };
        tx.commit().map_err(|e| engine(e.into()))?;
        let db = Arc::new(db);
        let base = db
            .begin_read()
            .map_err(|e| engine(e.into()))?
            .open_table(DATA)
            .map_err(|e| engine(e.into()))?;
        Ok(Opened {
            store: DiskStore {
                db,
                path: file,
                base,
                flushing: None,
                dirty: Overlay::new(),
                dirty_bytes: 0,
                opts,
            },
            lsn,
            prepared,
        })
    }

    /// The engine file.
    pub fn file(&self) -> &Path {
        &self.path
    }

    /// The committed value at `key`.
    ///
    /// Fails with [`DiskError::Engine`] when the engine cannot read it.
    pub fn get(&self, key: &Bytes) -> Result<Option<Bytes>, DiskError> {
        if let Some(v) = self.dirty.get(key) {
            return Ok(v.clone());
        }
        if let Some(v) = self.flushing.as_ref().and_then(|f| f.get(key)) {
            return Ok(v.clone());
        }
        let got = self
            .base
            .get(key.as_ref())
            .map_err(|e| self.engine_err()(e.into()))?;
        Ok(got.map(|g| Bytes::copy_from_slice(g.value())))
    }

    /// Records a committed write (`None`: delete).
    pub fn apply(&mut self, key: Bytes, value: Option<Bytes>) {
        self.dirty_bytes += overlay_bytes(&key, &value);
        if let Some(old) = self.dirty.insert(key.clone(), value) {
            self.dirty_bytes -= overlay_bytes(&key, &old);
        }
    }

    /// True when the changes since the last flush passed their bound and no
    /// flush is running.
    pub fn should_spill(&self) -> bool {
        self.flushing.is_none()
            && (self.dirty.len() >= self.opts.spill_entries
                || self.dirty_bytes >= self.opts.spill_bytes)
    }

    /// Changes held in memory (keys), over the overlay being flushed too.
    pub fn overlay_len(&self) -> usize {
        self.dirty.len() + self.flushing.as_ref().map_or(0, |f| f.len())
    }

    /// Number of committed keys (one engine lookup per key changed since the
    /// last flush).
    ///
    /// Fails with [`DiskError::Engine`] when the engine cannot read.
    pub fn key_count(&self) -> Result<u64, DiskError> {
        let mut n = self.base.len().map_err(|e| self.engine_err()(e.into()))? as i64;
        let mut seen = |k: &Bytes, v: &Option<Bytes>| -> Result<(), DiskError> {
            let in_base = self
                .base
                .get(k.as_ref())
                .map_err(|e| self.engine_err()(e.into()))?
                .is_some();
            n += i64::from(v.is_some()) - i64::from(in_base);
            Ok(())
        };
        for (k, v) in &self.dirty {
            seen(k, v)?;
        }
        if let Some(f) = &self.flushing {
            for (k, v) in f.iter().filter(|(k, _)| !self.dirty.contains_key(*k)) {
                seen(k, v)?;
            }
        }
        Ok(n.max(0) as u64)
    }

    /// Visits committed pairs with keys in `[start, end)` (`end` empty: no
    /// bound) in key order until `visit` returns false. Streams: memory use
    /// does not follow the number of keys visited.
    ///
    /// Fails with [`DiskError::Engine`] when the engine cannot read.
    pub fn visit_range(
        &self,
        start: &Bytes,
        end: &Bytes,
        mut visit: impl FnMut(&Bytes, &Bytes) -> bool,
    ) -> Result<(), DiskError> {
        let empty = Overlay::new();
        let mut d = self.dirty.range(start.clone()..).peekable();
        let mut f = self
            .flushing
            .as_deref()
            .unwrap_or(&empty)
            .range(start.clone()..)
            .peekable();
        let err = self.engine_err();
        let mut b = self
            .base
            .range::<&[u8]>(start.as_ref()..)
            .map_err(|e| err(e.into()))?
            .map(|r| {
                r.map(|(k, v)| {
                    (
                        Bytes::copy_from_slice(k.value()),
                        Bytes::copy_from_slice(v.value()),
                    )
                })
            })
            .peekable();
        loop {
            let kb = match b.peek() {
                Some(Ok((k, _))) => Some(k.clone()),
                Some(Err(_)) => {
                    let e = b.next().and_then(|r| r.err()).expect("peeked an error");
                    return Err(err(e.into()));
                }
                None => None,
            };
            let kd = d.peek().map(|(k, _)| (*k).clone());
            let kf = f.peek().map(|(k, _)| (*k).clone());
            let Some(k) = [&kd, &kf, &kb].into_iter().flatten().min().cloned() else {
                return Ok(());
            };
            if !end.is_empty() && k >= *end {
                return Ok(());
            }
            // The newest layer holding the key wins.
            let mut value: Option<Option<Bytes>> = None;
            if kd.as_ref() == Some(&k) {
                value = d.next().map(|(_, v)| v.clone());
            }
            if kf.as_ref() == Some(&k) {
                let v = f.next().map(|(_, v)| v.clone());
                value = value.or(v);
            }
            if kb.as_ref() == Some(&k) {
                let v = b.next().and_then(|r| r.ok()).map(|(_, v)| Some(v));
                value = value.or(v);
            }
            if let Some(Some(v)) = value {
                if !visit(&k, &v) {
                    return Ok(());
                }
            }
        }
    }

    /// Starts a flush: the changes since the last one are frozen and handed
    /// to the returned job; new commits go to a fresh overlay. Call
    /// [`DiskStore::end_flush`] with the job's result. `None` when a flush is
    /// already running (the caller serializes flushes; this is a guard).
    pub fn begin_flush(&mut self) -> Option<FlushJob> {
        if self.flushing.is_some() {
            return None;
        }
        let frozen = Arc::new(std::mem::take(&mut self.dirty));
        self.dirty_bytes = 0;
        self.flushing = Some(Arc::clone(&frozen));
        Some(FlushJob {
            db: Arc::clone(&self.db),
            path: self.path.clone(),
            entries: frozen,
        })
    }

    /// Ends a flush. Written: reads move to a snapshot holding it. Failed:
    /// the frozen changes go back under the newer ones, to be written by the
    /// next flush.
    ///
    /// Fails with [`DiskError::Engine`] when the new snapshot cannot be
    /// opened; the frozen changes then stay in memory, still read first.
    pub fn end_flush(&mut self, written: bool) -> Result<(), DiskError> {
        let Some(frozen) = self.flushing.take() else {
            return Ok(());
        };
        if written {
            let path = self.path.clone();
            let err = move |e: redb::Error| DiskError::Engine {
                path: path.clone(),
                source: Box::new(e),
            };
            let snap = self
                .db
                .begin_read()
                .map_err(|e| err(e.into()))
                .and_then(|tx| tx.open_table(DATA).map_err(|e| err(e.into())));
            match snap {
                Ok(base) => {
                    self.base = base;
                    return Ok(());
                }
                Err(e) => {
                    self.flushing = Some(frozen);
                    return Err(e);
                }
            }
        }
        let frozen = Arc::try_unwrap(frozen).unwrap_or_else(|a| (*a).clone());
        for (k, v) in frozen {
            if !self.dirty.contains_key(&k) {
                self.dirty_bytes += overlay_bytes(&k, &v);
                self.dirty.insert(k, v);
            }
        }
        Ok(())
    }
}

/// A flush in progress: the frozen changes to write to the engine.
pub struct FlushJob {
    db: Arc<Database>,
    path: PathBuf,
    entries: Arc<Overlay>,
}

impl FlushJob {
    /// Keys written by this flush.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True when there is nothing to write.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Writes the frozen changes in one engine commit. With a checkpoint
    /// (`Some((lsn, prepared))`) the commit also records the log position and
    /// the prepared write sets and is durable when this returns; without,
    /// it is a spill, not durable, forgotten by a crash.
    ///
    /// Fails with [`DiskError`]; the engine then keeps its previous state.
    pub fn write(&self, checkpoint: Option<(u64, &[PreparedSet])>) -> Result<(), DiskError> {
        let engine = |e: redb::Error| DiskError::Engine {
            path: self.path.clone(),
            source: Box::new(e),
        };
        let mut tx = self.db.begin_write().map_err(|e| engine(e.into()))?;
        match checkpoint {
            Some(_) => {
                tx.set_durability(RedbDurability::Immediate);
                tx.set_quick_repair(true);
            }
            None => tx.set_durability(RedbDurability::None),
        }
        {
            let mut data = tx.open_table(DATA).map_err(|e| engine(e.into()))?;
            for (k, v) in self.entries.iter() {
                match v {
                    Some(v) => {
                        data.insert(k.as_ref(), v.as_ref())
                            .map_err(|e| engine(e.into()))?;
                    }
                    None => {
                        data.remove(k.as_ref()).map_err(|e| engine(e.into()))?;
                    }
                }
            }
            if let Some((lsn, prepared)) = checkpoint {
                let mut meta = tx.open_table(META).map_err(|e| engine(e.into()))?;
                let blob = postcard::to_allocvec(prepared).map_err(|e| DiskError::Corrupt {
                    path: self.path.clone(),
                    reason: format!("cannot encode the prepared write sets: {e}"),
                })?;
                meta.insert(META_PREPARED, blob.as_slice())
                    .map_err(|e| engine(e.into()))?;
                meta.insert(META_LSN, lsn.to_le_bytes().as_slice())
                    .map_err(|e| engine(e.into()))?;
            }
        }
        tx.commit().map_err(|e| engine(e.into()))
    }
}

/// Replaces the whole content of the engine with `data` and the checkpoint
/// `(lsn, prepared)`, durably (importing a snapshot of the in-memory engine).
///
/// Fails with [`DiskError`]; the engine then keeps its previous state.
pub fn import(
    store: &mut DiskStore,
    data: impl Iterator<Item = (Bytes, Bytes)>,
    lsn: u64,
    prepared: &[PreparedSet],
) -> Result<(), DiskError> {
    let engine = |e: redb::Error| DiskError::Engine {
        path: store.path.clone(),
        source: Box::new(e),
    };
    {
        let mut tx = store.db.begin_write().map_err(|e| engine(e.into()))?;
        tx.set_durability(RedbDurability::Immediate);
        tx.set_quick_repair(true);
        tx.delete_table(DATA).map_err(|e| engine(e.into()))?;
        {
            let mut t = tx.open_table(DATA).map_err(|e| engine(e.into()))?;
            for (k, v) in data {
                t.insert(k.as_ref(), v.as_ref())
                    .map_err(|e| engine(e.into()))?;
            }
        }
        tx.commit().map_err(|e| engine(e.into()))?;
    }
    store.dirty.clear();
    store.dirty_bytes = 0;
    let job = store.begin_flush().expect("no flush runs during recovery");
    let res = job.write(Some((lsn, prepared)));
    store.end_flush(res.is_ok())?;
    res
}
