//! The KV store's committed data on disk: two redb files under an in-memory
//! overlay of the changes since the last flush.
//!
//! Owns the engine files (`kv.redb` and `kv-main.redb` in the store's
//! directory), their tables and the overlay. Must never make the engine
//! durable outside a checkpoint or a merge (no fsync per commit: weft's log
//! is the write-ahead log), never write the checkpoint's log position in a
//! commit apart from the data it covers, never change the store's content
//! in a merge, and never hold more than a bounded overlay in memory without
//! asking for a spill ([`DiskStore::should_spill`]).
//!
//! ## Why redb, and why two files
//! redb is a copy-on-write B-tree whose commit is atomic (two commit slots
//! and a god byte, checksummed): a commit with [`redb::Durability::None`]
//! writes pages without an fsync and becomes durable only with the next
//! `Immediate` commit; after a crash the file reverts to the last durable
//! commit, whole. Its page cache has a size ([`DiskOptions::cache_bytes`]),
//! its storage is pluggable ([`redb::StorageBackend`], see
//! [`DiskOptions::backend`]), and quick-repair keeps a reopen after a crash
//! from walking the whole file. An LSM (fjall) would bring its own
//! write-ahead journal, a second log to keep in step with weft's.
//!
//! Updating a B-tree in place costs a page per distinct leaf touched: a
//! checkpoint of 100 000 random updates rewrites nearly every leaf of a
//! small table but ~50 000 leaves of a ten-million-key one (measured 39x
//! slower; see docs/kv-storage.md). So a flush never updates the big table:
//!
//! - `kv.redb`, the *delta file*, holds the checkpoint: the log position,
//!   the prepared write sets, and the changes as *delta tables*
//!   (`delta.<seq>`), one per flush, each written from the sorted overlay
//!   into a fresh table (packed pages, a cost that follows the number of
//!   changes, not the size of the store);
//! - `kv-main.redb`, the *main file*, holds the merged table and the number
//!   of the last delta merged into it (`merged`).
//!
//! A *merge* ([`DiskStore::begin_merge`], [`MergeJob::write`],
//! [`DiskStore::end_merge`]) applies the deltas to the merged table (in one
//! sorted pass over all of them, each key once with its newest value) in one
//! durable commit of the main file that also raises `merged`.
//! It runs in the background, on the other file, so it never holds up a
//! checkpoint (redb has one writer per file). A merge changes no content:
//! deltas numbered up to `merged` are skipped by reads and dropped by the
//! next flush. Batching many flushes' changes into one merge makes each leaf
//! rewritten once for all of them.
//!
//! ## Layout of the state
//! - `dirty`: commits since the last flush began (`None`: deleted);
//! - `flushing`: the overlay being written by a flush in progress (frozen);
//! - `layers` ([`Layers`], immutable, replaced whole): read snapshots of the
//!   delta tables numbered past `merged` with their Bloom filters, the
//!   changes the newest delta was written from (kept in memory until the
//!   next flush begins), and a read snapshot of the merged table.
//!
//! A read looks in `dirty`, then `flushing`, then the deltas newest first
//! (the newest in memory; the others skipped when their Bloom filter rules
//! the key out: see [`crate::bloom`]), then the merged table. The first two
//! need the store's lock; the layers do not ([`DiskStore::lookup`] hands
//! them out as a [`Lookup`]), so page reads never hold it. A flush
//! ([`DiskStore::begin_flush`], [`FlushJob::write`],
//! [`DiskStore::end_flush`]) moves `dirty` to `flushing` in O(1) under the
//! store's lock, writes it as a new delta, reopens the deltas and builds
//! the new one's filter outside the lock, and then reads it as one. A
//! checkpoint is a flush committed `Immediate` with its log position; a
//! spill (the overlay passed its bound between checkpoints) is
//! a flush committed with `Durability::None`, so a crash forgets it together
//! with everything after the last checkpoint, and recovery replays weft's
//! log from there. (A merge, durable, may carry a spill's delta into the
//! main file, and a clean close of the engine makes its last commit durable,
//! spill or not: the engine may then hold a state newer than its
//! checkpoint's position. Replay is idempotent over it, since a prepare
//! record holds final values and they are redone in log order; the service
//! forces the log over a spill's commits before writing it, so no such state
//! outlives its log. Delta numbers lost with a spill are never reused: the
//! next number is past both `merged` and every delta found.)

use std::fmt;
use std::fs::OpenOptions;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use bytes::Bytes;
use redb::{
    Database, Durability as RedbDurability, ReadOnlyTable, ReadableTable, ReadableTableMetadata,
    StorageBackend, TableDefinition, TableHandle,
};
use weft_log::Durability;
use weft_wire::Tid;

use crate::api::Write;
use crate::bloom::{Bloom, Probe};

/// The merged table (main file).
const DATA: TableDefinition<&[u8], &[u8]> = TableDefinition::new("data");
/// Positions: the checkpoint's (delta file), the last merged delta (main).
const META: TableDefinition<&str, &[u8]> = TableDefinition::new("meta");
const META_LSN: &str = "lsn";
const META_PREPARED: &str = "prepared";
const META_MERGED: &str = "merged";
const DELTA_PREFIX: &str = "delta.";
/// A delta's value: this tag, then the value; or [`TAG_DELETED`] alone.
const TAG_PUT: u8 = 1;
const TAG_DELETED: u8 = 0;

/// The delta file (the checkpoint) in a store's directory.
pub fn path(dir: &Path) -> PathBuf {
    dir.join("kv.redb")
}

/// The main file (the merged table) in a store's directory.
pub fn main_path(dir: &Path) -> PathBuf {
    dir.join("kv-main.redb")
}

fn delta_name(seq: u64) -> String {
    format!("{DELTA_PREFIX}{seq:020}")
}

fn delta_def(name: &str) -> TableDefinition<'_, &'static [u8], &'static [u8]> {
    TableDefinition::new(name)
}

fn decode_delta(v: &[u8]) -> Option<Option<Bytes>> {
    match v.split_first() {
        Some((&TAG_PUT, rest)) => Some(Some(Bytes::copy_from_slice(rest))),
        Some((&TAG_DELETED, [])) => Some(None),
        _ => None,
    }
}

/// Opens a storage backend for an engine file at the given path (a
/// simulator's disk, a fault-injecting file).
pub type BackendFactory =
    Arc<dyn Fn(&Path) -> io::Result<Box<dyn StorageBackend>> + Send + Sync + 'static>;

/// Settings of the on-disk engine.
#[derive(Clone)]
pub struct DiskOptions {
    /// Bytes of engine pages cached in memory, over both files (a quarter
    /// for the delta file, the rest for the main file).
    pub cache_bytes: usize,
    /// Keys changed since the last flush past which a spill is asked for.
    pub spill_entries: usize,
    /// Key and value bytes changed since the last flush past which a spill
    /// is asked for.
    pub spill_bytes: usize,
    /// Delta tables past which a merge is asked for. A merge rewrites the
    /// merged table's leaves that its keys fall in, which at ten million
    /// keys is most of them whatever the merge's size, so fewer, larger
    /// merges cost less per entry; a read checks one cache line of each
    /// unmerged delta's filter (16 by default: at scale 100, 8 deltas
    /// were ~1.1 million entries touching an estimated ~85% of the
    /// leaves, 16 are ~2 million touching ~97%, about 1.6× less merge
    /// work per entry by that estimate).
    pub merge_deltas: usize,
    /// Entries over the delta tables past which a merge is asked for.
    pub merge_entries: usize,
    /// The engine's storage; `None`: the real files.
    pub backend: Option<BackendFactory>,
}

impl Default for DiskOptions {
    fn default() -> Self {
        DiskOptions {
            cache_bytes: 64 << 20,
            spill_entries: 262_144,
            spill_bytes: 64 << 20,
            merge_deltas: 16,
            merge_entries: 2_000_000,
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
            .field("merge_deltas", &self.merge_deltas)
            .field("merge_entries", &self.merge_entries)
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

pub use crate::overlay::Overlay;

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

type Table = ReadOnlyTable<&'static [u8], &'static [u8]>;

/// One entry of a layer as a range walk yields it (`None`: deleted).
type Entry = Result<(Bytes, Option<Bytes>), DiskError>;

/// One delta table beneath the overlays.
struct Delta {
    seq: u64,
    table: Table,
    /// Its entries.
    entries: u64,
    /// A Bloom filter of its keys: a read skips the deltas that certainly
    /// do not hold its key. Shared by the snapshots that reopen the table.
    filter: Arc<Bloom>,
}

/// The immutable layers beneath a store's overlays: the delta tables
/// numbered past the last merge (oldest first) with their filters, and the
/// merged table, each a read snapshot of its file.
///
/// A value is never changed in place: a flush or a merge that ends replaces
/// the store's layers with a new `Layers` whose content is the same for
/// every key not in the flushed overlay. So a reader that found a key in
/// neither overlay may take the layers under the store's lock and search
/// them after releasing it ([`Lookup::Below`]): commits and other reads go
/// on meanwhile, and the answer is the one the lock would have given as
/// long as nobody commits that key in between, which the caller's key lock
/// guarantees (two-phase locking).
#[derive(Clone)]
pub struct Layers {
    /// The merged table.
    base: Arc<Table>,
    deltas: Vec<Arc<Delta>>,
    /// The changes the newest delta was written from, kept in memory from
    /// the end of its flush to the start of the next one: the keys changed
    /// most recently are the likeliest to be read again (an account of a
    /// scale-1 DebitCredit is in the newest delta 70% of the time), and a
    /// lookup here costs no page read. (redb drops a file's whole read
    /// cache whenever a commit grows or shrinks it, which the delta file
    /// does at nearly every flush.) The memory it holds is the overlay's,
    /// which the flush would otherwise free: a store holds at most two
    /// overlays either way (changes and this, or changes and the one
    /// being flushed).
    newest: Option<Arc<Overlay>>,
    /// Entries over `deltas`.
    delta_entries: u64,
    /// The delta file and the main file, for errors.
    path: Arc<Path>,
    main_path: Arc<Path>,
}

impl fmt::Debug for Layers {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Layers")
            .field("deltas", &self.seqs())
            .field("delta_entries", &self.delta_entries)
            .finish()
    }
}

impl Layers {
    fn new(
        base: Arc<Table>,
        deltas: Vec<Arc<Delta>>,
        newest: Option<Arc<Overlay>>,
        path: Arc<Path>,
        main_path: Arc<Path>,
    ) -> Layers {
        let delta_entries = deltas.iter().map(|d| d.entries).sum();
        Layers {
            base,
            deltas,
            newest,
            delta_entries,
            path,
            main_path,
        }
    }

    /// The delta numbers, oldest first.
    fn seqs(&self) -> Vec<u64> {
        self.deltas.iter().map(|d| d.seq).collect()
    }

    /// The value at `key` in the deltas (newest first, skipping those whose
    /// filter rules the key out) and else in the merged table.
    ///
    /// Fails with [`DiskError::Engine`] when the engine cannot read, and
    /// [`DiskError::Corrupt`] for a delta value that does not decode.
    pub fn get(&self, key: &Bytes) -> Result<Option<Bytes>, DiskError> {
        let mut deltas = self.deltas.iter().rev();
        if let Some(newest) = &self.newest {
            // It holds exactly the newest delta's entries.
            if let Some(v) = newest.get(key) {
                return Ok(v.clone());
            }
            deltas.next();
        }
        let probe = Probe::of(key.as_ref());
        for d in deltas {
            if !d.filter.may_contain_probe(probe) {
                continue;
            }
            let got = d
                .table
                .get(key.as_ref())
                .map_err(|e| engine_error(&self.path)(e.into()))?;
            if let Some(g) = got {
                return decode_delta(g.value()).ok_or_else(|| DiskError::Corrupt {
                    path: self.path.to_path_buf(),
                    reason: format!("the delta value at {key:?} has no valid tag"),
                });
            }
        }
        let got = self
            .base
            .get(key.as_ref())
            .map_err(|e| engine_error(&self.main_path)(e.into()))?;
        Ok(got.map(|g| Bytes::copy_from_slice(g.value())))
    }
}

/// Where a read of one key stands once the overlays were searched.
#[derive(Debug)]
pub enum Lookup {
    /// Found in memory (`None`: deleted or never written).
    Found(Option<Bytes>),
    /// In none of the overlays: to be searched in these layers, which need
    /// no lock (see [`Layers`]).
    Below(Arc<Layers>),
}

impl Lookup {
    /// The value at `key`.
    ///
    /// Fails as [`Layers::get`] does.
    pub fn value(&self, key: &Bytes) -> Result<Option<Bytes>, DiskError> {
        match self {
            Lookup::Found(v) => Ok(v.clone()),
            Lookup::Below(layers) => layers.get(key),
        }
    }
}

/// The committed data of a store on disk.
pub struct DiskStore {
    main: Arc<Database>,
    deltas_db: Arc<Database>,
    /// The delta file.
    path: PathBuf,
    main_path: PathBuf,
    /// The merged table and the deltas past `merged`.
    layers: Arc<Layers>,
    /// The last delta merged into the merged table.
    merged: u64,
    /// Merged deltas still in the delta file (the next flush drops them).
    obsolete: Vec<u64>,
    next_seq: u64,
    flushing: Option<Arc<Overlay>>,
    /// The delta number and the dropped deltas of the flush in progress.
    flushing_seq: u64,
    flushing_dropped: Vec<u64>,
    /// The last delta of the merge in progress.
    merging: Option<u64>,
    dirty: Overlay,
    dirty_bytes: usize,
    opts: DiskOptions,
    /// Keys committed in `base` and the deltas, for `(merged, delta
    /// numbers)`: recounted only when the deltas change, not per call.
    layers_count: parking_lot::Mutex<Option<(u64, Vec<u64>, i64)>>,
}

impl fmt::Debug for DiskStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DiskStore")
            .field("path", &self.path)
            .field("dirty", &self.dirty.len())
            .field("flushing", &self.flushing.as_ref().map(|f| f.len()))
            .field("deltas", &self.layers.deltas.len())
            .field("merged", &self.merged)
            .finish()
    }
}

fn overlay_bytes(k: &Bytes, v: &Option<Bytes>) -> usize {
    k.len() + v.as_ref().map_or(0, Bytes::len) + 64
}

fn engine_error(path: &Path) -> impl Fn(redb::Error) -> DiskError + '_ {
    move |e| DiskError::Engine {
        path: path.to_path_buf(),
        source: Box::new(e),
    }
}

/// Opens (creating if missing) one engine file.
fn open_file(
    dir: &Path,
    file: &Path,
    dur: &Durability,
    backend: Option<&BackendFactory>,
    cache_bytes: usize,
) -> Result<Database, DiskError> {
    let io_err = |context| {
        let file = file.to_path_buf();
        move |source| DiskError::Io {
            path: file,
            context,
            source,
        }
    };
    let engine = engine_error(file);
    let mut builder = Database::builder();
    builder.set_cache_size(cache_bytes);
    match backend {
        Some(factory) => {
            let backend = factory(file).map_err(io_err("opening the backend"))?;
            pad_lost_growth(backend.as_ref()).map_err(io_err("reading the header"))?;
            builder
                .create_with_backend(Boxed(backend))
                .map_err(|e| engine(e.into()))
        }
        None => {
            let fresh = !file.exists();
            let f = if fresh {
                dur.create_dir_all(dir)
                    .map_err(io_err("creating the directory"))?;
                dur.create_file(file).map_err(io_err("creating the file"))?
            } else {
                OpenOptions::new()
                    .read(true)
                    .write(true)
                    .open(file)
                    .map_err(io_err("opening the file"))?
            };
            let backend = redb::backends::FileBackend::new(f).map_err(|e| engine(e.into()))?;
            pad_lost_growth(&backend).map_err(io_err("reading the header"))?;
            let db = builder
                .create_with_backend(backend)
                .map_err(|e| engine(e.into()))?;
            if fresh {
                dur.sync_dir(dir).map_err(io_err("syncing the directory"))?;
            }
            Ok(db)
        }
    }
}

fn read_u64(
    path: &Path,
    v: Option<redb::AccessGuard<'_, &[u8]>>,
    what: &str,
) -> Result<Option<u64>, DiskError> {
    v.map(|v| {
        v.value()
            .try_into()
            .map(u64::from_le_bytes)
            .map_err(|_| DiskError::Corrupt {
                path: path.to_path_buf(),
                reason: format!("{what} is not 8 bytes"),
            })
    })
    .transpose()
}

/// Makes the tables `names` (data and meta tables, `&[u8]`/`&str` keys as
/// [`DATA`] and [`META`]) in `db` when one is missing, as happens only in a
/// new file.
///
/// The commit that makes them is durable with quick repair, like every
/// durable commit of the store: a reopen after a crash then repairs from
/// it quickly (redb marks a file for repair when it opens it, and a
/// process that exits without closing the engine leaves the mark).
fn ensure_tables(db: &Database, names: &[&str], path: &Path) -> Result<(), DiskError> {
    let engine = engine_error(path);
    let missing = {
        let tx = db.begin_read().map_err(|e| engine(e.into()))?;
        let present: Vec<String> = tx
            .list_tables()
            .map_err(|e| engine(e.into()))?
            .map(|t| t.name().to_string())
            .collect();
        names.iter().any(|n| !present.iter().any(|p| p == n))
    };
    if !missing {
        return Ok(());
    }
    let mut tx = db.begin_write().map_err(|e| engine(e.into()))?;
    tx.set_durability(RedbDurability::Immediate);
    tx.set_quick_repair(true);
    for name in names {
        if *name == META.name() {
            tx.open_table(META).map_err(|e| engine(e.into()))?;
        } else {
            tx.open_table(TableDefinition::<&[u8], &[u8]>::new(name))
                .map_err(|e| engine(e.into()))?;
        }
    }
    tx.commit().map_err(|e| engine(e.into()))
}

/// The length redb's header at the start of `header` says its file has,
/// or `None` when `header` is not one (too short, no magic number). The
/// fields are those of redb's file format (2.x: `docs/design.md` of redb,
/// "Database header"): the page size, the header pages and data pages of a
/// full region, the number of full regions and the data pages of a trailing
/// partial one, after a 9-byte magic number, the god byte and two bytes of
/// padding; the regions follow one page of database header.
pub(crate) fn redb_layout_len(header: &[u8]) -> Option<u64> {
    const MAGIC: [u8; 9] = [b'r', b'e', b'd', b'b', 0x1A, 0x0A, 0xA9, 0x0D, 0x0A];
    if header.len() < 32 || header[..9] != MAGIC {
        return None;
    }
    let field = |at: usize| -> Option<u64> {
        Some(u64::from(u32::from_le_bytes(
            header[at..at + 4].try_into().ok()?,
        )))
    };
    let (page, region_header, region_data, full, trailing) =
        (field(12)?, field(16)?, field(20)?, field(24)?, field(28)?);
    let full_len = full.checked_mul(region_header.checked_add(region_data)?)?;
    let trailing_len = if trailing > 0 {
        region_header.checked_add(trailing)?
    } else {
        0
    };
    page.checked_mul(1u64.checked_add(full_len)?.checked_add(trailing_len)?)
}

/// Pads an engine file with zeros up to the length its header names, when
/// it is shorter: what a power loss leaves when it kept the header and
/// lost the file's growth.
///
/// redb grows a file (`set_len`) before writing a commit's pages, and
/// writes its header (already on disk, in the first block) before forcing
/// both. A power loss may then keep the header's new block and lose the
/// growth the file system's journal had not recorded yet. redb 2.6 refuses
/// such a file with an assertion (a panic at open: the node could never
/// start again), although the commit that header describes was never
/// acknowledged and its repair would go back to the one before. Padded,
/// the file opens and redb's repair runs (the pages it lost read as zeros,
/// so their checksums fail). A file at least as long as its header's
/// layout, or without redb's header, is left as it is.
///
/// Fails with the backend's I/O error.
fn pad_lost_growth(backend: &dyn StorageBackend) -> io::Result<()> {
    let len = backend.len()?;
    if len < 32 {
        return Ok(());
    }
    let header = backend.read(0, 32)?;
    match redb_layout_len(&header) {
        Some(want) if want > len => {
            tracing::warn!(
                len,
                want,
                "kv: an engine file is shorter than its header says (growth lost in a power loss); padding it for repair"
            );
            backend.set_len(want)
        }
        _ => Ok(()),
    }
}

/// Opens the delta tables `seqs` from a fresh snapshot of the delta file
/// (the snapshots of older ones are then released, so the engine may reuse
/// the pages of deltas dropped since), with the filter `known` gives for a
/// number, or else one built by a walk of the table (on opening: the
/// entries are bounded by the merge bound).
fn open_deltas(
    db: &Database,
    path: &Path,
    seqs: &[u64],
    known: impl Fn(u64) -> Option<(Arc<Bloom>, u64)>,
) -> Result<Vec<Arc<Delta>>, DiskError> {
    let engine = engine_error(path);
    let tx = db.begin_read().map_err(|e| engine(e.into()))?;
    seqs.iter()
        .map(|&seq| {
            let name = delta_name(seq);
            let table = tx
                .open_table(delta_def(&name))
                .map_err(|e| engine(e.into()))?;
            let (filter, entries) = match known(seq) {
                Some(k) => k,
                None => {
                    let entries = table.len().map_err(|e| engine(e.into()))?;
                    let mut filter = Bloom::new(entries as usize);
                    for r in table.iter().map_err(|e| engine(e.into()))? {
                        let (k, _) = r.map_err(|e| engine(e.into()))?;
                        filter.add(k.value());
                    }
                    (Arc::new(filter), entries)
                }
            };
            Ok(Arc::new(Delta {
                seq,
                table,
                entries,
                filter,
            }))
        })
        .collect()
}

/// Opens the merged table from a fresh snapshot of the main file.
fn open_base(db: &Database, path: &Path) -> Result<Arc<Table>, DiskError> {
    let engine = engine_error(path);
    let table = db
        .begin_read()
        .map_err(|e| engine(e.into()))?
        .open_table(DATA)
        .map_err(|e| engine(e.into()))?;
    Ok(Arc::new(table))
}

/// A walk of one table from `start` in key order.
fn walk<'a>(
    t: &'a Table,
    start: &Bytes,
    delta: bool,
    path: &'a Path,
) -> Result<Box<dyn Iterator<Item = Entry> + 'a>, DiskError> {
    let range = t
        .range::<&[u8]>(start.as_ref()..)
        .map_err(|e| engine_error(path)(e.into()))?;
    Ok(Box::new(range.map(move |r| {
        let (k, v) = r.map_err(|e| engine_error(path)(e.into()))?;
        let key = Bytes::copy_from_slice(k.value());
        let value = if delta {
            decode_delta(v.value()).ok_or_else(|| DiskError::Corrupt {
                path: path.to_path_buf(),
                reason: format!(
                    "a delta value of {} bytes with no valid tag",
                    v.value().len()
                ),
            })?
        } else {
            Some(Bytes::copy_from_slice(v.value()))
        };
        Ok((key, value))
    })))
}

/// Walks `layers` (newest first) together in key order below `end` (empty:
/// no bound): each key once, with the newest layer's value (`None`:
/// deleted), until `visit` returns false.
fn merge_walk<'a>(
    layers: Vec<Box<dyn Iterator<Item = Entry> + 'a>>,
    end: &Bytes,
    mut visit: impl FnMut(&Bytes, Option<&Bytes>) -> Result<bool, DiskError>,
) -> Result<(), DiskError> {
    let mut layers: Vec<_> = layers.into_iter().map(Iterator::peekable).collect();
    loop {
        let mut min: Option<Bytes> = None;
        for l in layers.iter_mut() {
            match l.peek() {
                Some(Ok((k, _))) if min.as_ref().is_none_or(|m| k < m) => {
                    min = Some(k.clone());
                }
                Some(Ok(_)) => {}
                Some(Err(_)) => {
                    return Err(l.next().and_then(Result::err).expect("peeked an error"));
                }
                None => {}
            }
        }
        let Some(k) = min else { return Ok(()) };
        if !end.is_empty() && k >= *end {
            return Ok(());
        }
        let mut value: Option<Option<Bytes>> = None;
        for l in layers.iter_mut() {
            if matches!(l.peek(), Some(Ok((lk, _))) if *lk == k) {
                if let Some(Ok((_, v))) = l.next() {
                    value.get_or_insert(v);
                }
            }
        }
        let value = value.expect("the smallest key came from a layer");
        if !visit(&k, value.as_ref())? {
            return Ok(());
        }
    }
}

fn overlay_walk<'a>(o: &'a Overlay, start: &Bytes) -> Box<dyn Iterator<Item = Entry> + 'a> {
    Box::new(
        o.range(start.clone()..)
            .map(|(k, v)| Ok((k.clone(), v.clone()))),
    )
}

impl DiskStore {
    /// Opens (creating if missing) the engine in `dir`; new directories and
    /// files are made durable through `dur` before this returns.
    ///
    /// Fails with [`DiskError`] when a file cannot be opened or created, is
    /// not an engine file (or one of the earlier one-file layout, whose
    /// `kv.redb` held the whole table: refused, never read as empty), or
    /// its records do not decode.
    pub fn open(dir: &Path, dur: &Durability, opts: DiskOptions) -> Result<Opened, DiskError> {
        let file = path(dir);
        let main_file = main_path(dir);
        let delta_cache = (opts.cache_bytes / 4).max(1 << 16);
        let main_cache = opts.cache_bytes.saturating_sub(delta_cache).max(1 << 16);
        let deltas_db = open_file(dir, &file, dur, opts.backend.as_ref(), delta_cache)?;
        let main = open_file(dir, &main_file, dur, opts.backend.as_ref(), main_cache)?;
        let engine = engine_error(&file);
        let main_engine = engine_error(&main_file);
        let corrupt = |reason: String| DiskError::Corrupt {
            path: file.clone(),
            reason,
        };
        // The delta file: its tables, and the checkpoint.
        let mut seqs: Vec<u64> = Vec::new();
        {
            let tx = deltas_db.begin_read().map_err(|e| engine(e.into()))?;
            for t in tx.list_tables().map_err(|e| engine(e.into()))? {
                let name = t.name();
                if name == DATA.name() {
                    return Err(corrupt(
                        "an engine file of the earlier one-file layout (move it away to start empty, \
                         or run the build that wrote it)"
                            .into(),
                    ));
                }
                if let Some(n) = name.strip_prefix(DELTA_PREFIX) {
                    seqs.push(
                        n.parse()
                            .map_err(|_| corrupt(format!("a delta table named {name:?}")))?,
                    );
                }
            }
        }
        seqs.sort_unstable();
        // The tables are made once, when a file is new; every later open
        // only reads (a write transaction here would cost redb's commit
        // fsyncs on every start).
        ensure_tables(&deltas_db, &[META.name()], &file)?;
        ensure_tables(&main, &[DATA.name(), META.name()], &main_file)?;
        let (lsn, prepared) = {
            let tx = deltas_db.begin_read().map_err(|e| engine(e.into()))?;
            let meta = tx.open_table(META).map_err(|e| engine(e.into()))?;
            let lsn = read_u64(
                &file,
                meta.get(META_LSN).map_err(|e| engine(e.into()))?,
                "checkpoint position",
            )?;
            let prepared: Vec<PreparedSet> =
                match meta.get(META_PREPARED).map_err(|e| engine(e.into()))? {
                    None => Vec::new(),
                    Some(v) => postcard::from_bytes(v.value())
                        .map_err(|e| corrupt(format!("prepared write sets undecodable: {e}")))?,
                };
            (lsn, prepared)
        };
        // The main file: the last delta merged into its table.
        let merged = {
            let tx = main.begin_read().map_err(|e| main_engine(e.into()))?;
            let meta = tx.open_table(META).map_err(|e| main_engine(e.into()))?;
            read_u64(
                &main_file,
                meta.get(META_MERGED).map_err(|e| main_engine(e.into()))?,
                "merged delta number",
            )?
            .unwrap_or(0)
        };
        let base = open_base(&main, &main_file)?;
        let (obsolete, live): (Vec<u64>, Vec<u64>) = seqs.iter().partition(|s| **s <= merged);
        let deltas = open_deltas(&deltas_db, &file, &live, |_| None)?;
        let next_seq = merged.max(seqs.last().copied().unwrap_or(0)) + 1;
        let layers = Layers::new(
            base,
            deltas,
            None,
            file.as_path().into(),
            main_file.as_path().into(),
        );
        let store = DiskStore {
            main: Arc::new(main),
            deltas_db: Arc::new(deltas_db),
            path: file.clone(),
            main_path: main_file.clone(),
            layers: Arc::new(layers),
            merged,
            obsolete,
            next_seq,
            flushing: None,
            flushing_seq: 0,
            flushing_dropped: Vec::new(),
            merging: None,
            dirty: Overlay::new(),
            dirty_bytes: 0,
            opts,
            layers_count: parking_lot::Mutex::new(None),
        };
        Ok(Opened {
            store,
            lsn,
            prepared,
        })
    }

    /// The delta file, whose durable commits are the checkpoints.
    pub fn file(&self) -> &Path {
        &self.path
    }

    /// The main file, holding the merged table.
    pub fn main_file(&self) -> &Path {
        &self.main_path
    }

    /// The committed value at `key`.
    ///
    /// Fails with [`DiskError::Engine`] when the engine cannot read, and
    /// [`DiskError::Corrupt`] for a delta value that does not decode.
    pub fn get(&self, key: &Bytes) -> Result<Option<Bytes>, DiskError> {
        self.lookup(key).value(key)
    }

    /// The value at `key` if the overlays hold it, else the layers beneath
    /// them, to search without the store's lock (see [`Layers`]). Costs two
    /// in-memory lookups and, past them, a reference count.
    pub fn lookup(&self, key: &Bytes) -> Lookup {
        if let Some(v) = self.dirty.get(key) {
            return Lookup::Found(v.clone());
        }
        if let Some(v) = self.flushing.as_ref().and_then(|f| f.get(key)) {
            return Lookup::Found(v.clone());
        }
        Lookup::Below(Arc::clone(&self.layers))
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

    /// True when the delta tables passed their bound (in number or in
    /// entries) and no merge is running.
    pub fn should_merge(&self) -> bool {
        self.merging.is_none()
            && !self.layers.deltas.is_empty()
            && (self.layers.deltas.len() >= self.opts.merge_deltas
                || self.layers.delta_entries >= self.opts.merge_entries as u64)
    }

    /// Changes held in memory (keys), over the overlay being flushed too.
    pub fn overlay_len(&self) -> usize {
        self.dirty.len() + self.flushing.as_ref().map_or(0, |f| f.len())
    }

    /// Delta tables not merged yet, and their entries.
    pub fn delta_stats(&self) -> (usize, u64) {
        (self.layers.deltas.len(), self.layers.delta_entries)
    }

    /// The changed layers (overlays and deltas), newest first, from `start`.
    fn changed_layers<'a>(
        &'a self,
        start: &Bytes,
        empty: &'a Overlay,
    ) -> Result<Vec<Box<dyn Iterator<Item = Entry> + 'a>>, DiskError> {
        let mut layers = vec![
            overlay_walk(&self.dirty, start),
            overlay_walk(self.flushing.as_deref().unwrap_or(empty), start),
        ];
        for d in self.layers.deltas.iter().rev() {
            layers.push(walk(&d.table, start, true, &self.path)?);
        }
        Ok(layers)
    }

    /// Number of committed keys. The count of the merged table and the
    /// deltas is kept from one call to the next while they do not change
    /// (one lookup in the merged table per delta entry when they did); the
    /// overlay costs one lookup per key it holds.
    ///
    /// Fails with [`DiskError`] when the engine cannot read.
    pub fn key_count(&self) -> Result<u64, DiskError> {
        let seqs = self.layers.seqs();
        let cached = self
            .layers_count
            .lock()
            .as_ref()
            .filter(|(m, s, _)| *m == self.merged && *s == seqs)
            .map(|(_, _, n)| *n);
        let below = match cached {
            Some(n) => n,
            None => {
                let main_err = engine_error(&self.main_path);
                let base = &self.layers.base;
                let mut n = base.len().map_err(|e| main_err(e.into()))? as i64;
                let mut layers: Vec<Box<dyn Iterator<Item = Entry> + '_>> = Vec::new();
                for d in self.layers.deltas.iter().rev() {
                    layers.push(walk(&d.table, &Bytes::new(), true, &self.path)?);
                }
                merge_walk(layers, &Bytes::new(), |k, v| {
                    let in_base = base
                        .get(k.as_ref())
                        .map_err(|e| main_err(e.into()))?
                        .is_some();
                    n += i64::from(v.is_some()) - i64::from(in_base);
                    Ok(true)
                })?;
                *self.layers_count.lock() = Some((self.merged, seqs, n));
                n
            }
        };
        let mut n = below;
        let empty = Overlay::new();
        let overlays = vec![
            overlay_walk(&self.dirty, &Bytes::new()),
            overlay_walk(self.flushing.as_deref().unwrap_or(&empty), &Bytes::new()),
        ];
        merge_walk(overlays, &Bytes::new(), |k, v| {
            let below = self.layers.get(k)?.is_some();
            n += i64::from(v.is_some()) - i64::from(below);
            Ok(true)
        })?;
        Ok(n.max(0) as u64)
    }

    /// Visits committed pairs with keys in `[start, end)` (`end` empty: no
    /// bound) in key order until `visit` returns false. Streams: memory use
    /// does not follow the number of keys visited.
    ///
    /// Fails with [`DiskError`] when the engine cannot read.
    pub fn visit_range(
        &self,
        start: &Bytes,
        end: &Bytes,
        mut visit: impl FnMut(&Bytes, &Bytes) -> bool,
    ) -> Result<(), DiskError> {
        let empty = Overlay::new();
        let mut layers = self.changed_layers(start, &empty)?;
        layers.push(walk(&self.layers.base, start, false, &self.main_path)?);
        merge_walk(layers, end, |k, v| Ok(v.is_none_or(|v| visit(k, v))))
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
        // The overlays held stay two (see `Layers::newest`). The job frees
        // the newest delta's overlay, off the store's lock: dropping its
        // quarter-million keys here took a twelfth of a checkpoint's CPU
        // with every commit waiting.
        let retired = self.layers.newest.clone();
        if retired.is_some() {
            self.layers = Arc::new(Layers {
                newest: None,
                ..Layers::clone(&self.layers)
            });
        }
        let seq = self.next_seq;
        self.next_seq += 1;
        self.flushing_seq = seq;
        self.flushing_dropped = std::mem::take(&mut self.obsolete);
        Some(FlushJob {
            db: Arc::clone(&self.deltas_db),
            path: self.path.clone(),
            entries: frozen,
            seq,
            dropped: self.flushing_dropped.clone(),
            layers: Arc::clone(&self.layers),
            written: parking_lot::Mutex::new(None),
            retired: parking_lot::Mutex::new(retired),
        })
    }

    /// Ends the flush of `job`. Written (its [`FlushJob::write`] succeeded):
    /// reads move to the delta it wrote, opened by the job. Not written (it
    /// failed, or was not called): the frozen changes go back under the
    /// newer ones, to be written by the next flush. Cheap: what is opened
    /// and built for the new delta was done by the job, off the store's
    /// lock.
    pub fn end_flush(&mut self, job: &FlushJob) {
        let Some(frozen) = self.flushing.take() else {
            return;
        };
        let dropped = std::mem::take(&mut self.flushing_dropped);
        if let Some(opened) = job.written.lock().take() {
            // A merge that ended meanwhile took some of the deltas the job
            // reopened: keep the ones still unmerged, and the new one.
            let deltas: Vec<Arc<Delta>> =
                opened.into_iter().filter(|d| d.seq > self.merged).collect();
            let newest = deltas
                .last()
                .filter(|d| d.seq == self.flushing_seq)
                .map(|_| frozen);
            self.layers = Arc::new(Layers::new(
                Arc::clone(&self.layers.base),
                deltas,
                newest,
                Arc::clone(&self.layers.path),
                Arc::clone(&self.layers.main_path),
            ));
            return;
        }
        self.obsolete.extend(dropped);
        let frozen = Arc::try_unwrap(frozen).unwrap_or_else(|a| (*a).clone());
        for (k, v) in frozen.into_unordered() {
            if !self.dirty.contains_key(&k) {
                self.dirty_bytes += overlay_bytes(&k, &v);
                self.dirty.insert(k, v);
            }
        }
    }

    /// Starts a merge of every delta table written so far into the merged
    /// table. Call [`DiskStore::end_merge`] with the job's result. `None`
    /// when a merge is running or there is nothing to merge.
    ///
    /// Fails with [`DiskError::Engine`] when the deltas cannot be opened
    /// for the job.
    pub fn begin_merge(&mut self) -> Result<Option<MergeJob>, DiskError> {
        let Some(last) = self.layers.deltas.last().filter(|_| self.merging.is_none()) else {
            return Ok(None);
        };
        let upto = last.seq;
        self.merging = Some(upto);
        Ok(Some(MergeJob {
            db: Arc::clone(&self.main),
            path: self.main_path.clone(),
            delta_path: self.path.clone(),
            layers: Arc::clone(&self.layers),
            upto,
            written: parking_lot::Mutex::new(None),
        }))
    }

    /// Ends the merge of `job`. Written (its [`MergeJob::write`]
    /// succeeded): reads move to the merged table holding it, opened by the
    /// job, and skip the deltas it took (the next flush drops them). Not
    /// written: nothing changes.
    pub fn end_merge(&mut self, job: &MergeJob) {
        let Some(upto) = self.merging.take() else {
            return;
        };
        let Some(base) = job.written.lock().take() else {
            return;
        };
        self.merged = upto;
        let (gone, kept): (Vec<_>, Vec<_>) = self
            .layers
            .deltas
            .iter()
            .cloned()
            .partition(|d| d.seq <= upto);
        self.obsolete.extend(gone.iter().map(|d| d.seq));
        // The newest delta's changes stay in memory while it is unmerged.
        let newest = self.layers.newest.clone().filter(|_| !kept.is_empty());
        self.layers = Arc::new(Layers::new(
            base,
            kept,
            newest,
            Arc::clone(&self.layers.path),
            Arc::clone(&self.layers.main_path),
        ));
    }
}

/// A flush in progress: the frozen changes to write as a delta.
pub struct FlushJob {
    db: Arc<Database>,
    path: PathBuf,
    entries: Arc<Overlay>,
    seq: u64,
    dropped: Vec<u64>,
    /// The store's layers when the flush began (its deltas and filters).
    layers: Arc<Layers>,
    /// The deltas reopened after the write, the new one last: set by a
    /// successful [`FlushJob::write`], taken by [`DiskStore::end_flush`].
    written: parking_lot::Mutex<Option<Vec<Arc<Delta>>>>,
    /// The overlay the newest delta was read from until this flush began:
    /// freed by [`FlushJob::write`], off the store's lock.
    retired: parking_lot::Mutex<Option<Arc<Overlay>>>,
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

    /// Writes the frozen changes as a new delta table in one commit of the
    /// delta file, which also drops the deltas merged since the last flush.
    /// With a checkpoint (`Some((lsn, prepared))`) the commit also records
    /// the log position and the prepared write sets and is durable when
    /// this returns; without, it is a spill, not durable, forgotten by a
    /// crash. Its cost follows the number of changes, not the store's size.
    /// Then opens the deltas to read from a fresh snapshot and builds the
    /// new one's filter, for [`DiskStore::end_flush`] (off the store's
    /// lock, as the write).
    ///
    /// Fails with [`DiskError`]; the engine then keeps its previous state
    /// (or, when only the reopening failed, holds the delta, which the
    /// store does not read: the frozen changes stay in memory and the next
    /// flush writes them again under a new number).
    pub fn write(&self, checkpoint: Option<(u64, &[PreparedSet])>) -> Result<(), DiskError> {
        drop(self.retired.lock().take());
        self.write_delta(checkpoint)?;
        let mut seqs = self.layers.seqs();
        if !self.entries.is_empty() {
            seqs.push(self.seq);
        }
        let opened = open_deltas(&self.db, &self.path, &seqs, |seq| {
            if seq == self.seq {
                let keys = self.entries.unordered_keys().map(|k| k.as_ref());
                let filter = Bloom::build(self.entries.len(), keys);
                return Some((Arc::new(filter), self.entries.len() as u64));
            }
            let d = self.layers.deltas.iter().find(|d| d.seq == seq)?;
            Some((Arc::clone(&d.filter), d.entries))
        })?;
        *self.written.lock() = Some(opened);
        Ok(())
    }

    fn write_delta(&self, checkpoint: Option<(u64, &[PreparedSet])>) -> Result<(), DiskError> {
        let engine = engine_error(&self.path);
        let mut tx = self.db.begin_write().map_err(|e| engine(e.into()))?;
        match checkpoint {
            Some(_) => {
                tx.set_durability(RedbDurability::Immediate);
                tx.set_quick_repair(true);
            }
            None => tx.set_durability(RedbDurability::None),
        }
        for seq in &self.dropped {
            tx.delete_table(delta_def(&delta_name(*seq)))
                .map_err(|e| engine(e.into()))?;
        }
        if !self.entries.is_empty() {
            let name = delta_name(self.seq);
            let mut data = tx
                .open_table(delta_def(&name))
                .map_err(|e| engine(e.into()))?;
            let mut buf = Vec::new();
            for (k, v) in self.entries.sorted() {
                buf.clear();
                match v {
                    Some(v) => {
                        buf.push(TAG_PUT);
                        buf.extend_from_slice(v);
                    }
                    None => buf.push(TAG_DELETED),
                }
                data.insert(k.as_ref(), buf.as_slice())
                    .map_err(|e| engine(e.into()))?;
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
        tx.commit().map_err(|e| engine(e.into()))
    }
}

/// A merge in progress: delta tables to apply to the merged table.
pub struct MergeJob {
    db: Arc<Database>,
    path: PathBuf,
    delta_path: PathBuf,
    /// The store's layers when the merge began: it merges all their deltas.
    layers: Arc<Layers>,
    upto: u64,
    /// The merged table reopened after the write: set by a successful
    /// [`MergeJob::write`], taken by [`DiskStore::end_merge`].
    written: parking_lot::Mutex<Option<Arc<Table>>>,
}

impl MergeJob {
    /// Entries over the deltas this merge applies.
    ///
    /// Never fails today (the count is kept).
    pub fn entries(&self) -> Result<u64, DiskError> {
        Ok(self.layers.delta_entries)
    }

    /// Applies the deltas to the merged table and records the last one
    /// merged, in one durable commit of the main file. Changes no content
    /// of the store: what it writes was already read from the deltas.
    ///
    /// The deltas are walked together in key order, each key once with its
    /// newest value (the same result as applying them oldest first), so the
    /// merged table is visited in one sorted pass: each leaf is dirtied
    /// once, and a dirty leaf the engine's write buffer evicted to the file
    /// is never read back to take another delta's keys (applying 8 deltas
    /// one after the other walked a ten-million-key table 8 times).
    ///
    /// Fails with [`DiskError`]; the main file then keeps its previous
    /// state.
    pub fn write(&self) -> Result<(), DiskError> {
        let engine = engine_error(&self.path);
        let mut tx = self.db.begin_write().map_err(|e| engine(e.into()))?;
        tx.set_durability(RedbDurability::Immediate);
        tx.set_quick_repair(true);
        {
            let mut data = tx.open_table(DATA).map_err(|e| engine(e.into()))?;
            let mut layers: Vec<Box<dyn Iterator<Item = Entry> + '_>> = Vec::new();
            for d in self.layers.deltas.iter().rev() {
                layers.push(walk(&d.table, &Bytes::new(), true, &self.delta_path)?);
            }
            merge_walk(layers, &Bytes::new(), |k, v| {
                match v {
                    Some(v) => {
                        data.insert(k.as_ref(), v.as_ref())
                            .map_err(|e| engine(e.into()))?;
                    }
                    None => {
                        data.remove(k.as_ref()).map_err(|e| engine(e.into()))?;
                    }
                }
                Ok(true)
            })?;
            let mut meta = tx.open_table(META).map_err(|e| engine(e.into()))?;
            meta.insert(META_MERGED, self.upto.to_le_bytes().as_slice())
                .map_err(|e| engine(e.into()))?;
        }
        tx.commit().map_err(|e| engine(e.into()))?;
        *self.written.lock() = Some(open_base(&self.db, &self.path)?);
        Ok(())
    }
}

/// Replaces the whole content of the engine with `data` and the checkpoint
/// `(lsn, prepared)`, durably (importing a snapshot of the in-memory engine).
/// The merged table is rewritten first, covering every delta; then a
/// checkpoint drops the deltas and records the position. A crash between
/// leaves the old position, so the import runs again.
///
/// Fails with [`DiskError`]; the engine then keeps its previous content.
pub fn import(
    store: &mut DiskStore,
    data: impl Iterator<Item = (Bytes, Bytes)>,
    lsn: u64,
    prepared: &[PreparedSet],
) -> Result<(), DiskError> {
    let covers = store.next_seq - 1;
    {
        let engine = engine_error(&store.main_path);
        let mut tx = store.main.begin_write().map_err(|e| engine(e.into()))?;
        tx.set_durability(RedbDurability::Immediate);
        tx.set_quick_repair(true);
        tx.delete_table(DATA).map_err(|e| engine(e.into()))?;
        {
            let mut t = tx.open_table(DATA).map_err(|e| engine(e.into()))?;
            for (k, v) in data {
                t.insert(k.as_ref(), v.as_ref())
                    .map_err(|e| engine(e.into()))?;
            }
            let mut meta = tx.open_table(META).map_err(|e| engine(e.into()))?;
            meta.insert(META_MERGED, covers.to_le_bytes().as_slice())
                .map_err(|e| engine(e.into()))?;
        }
        tx.commit().map_err(|e| engine(e.into()))?;
    }
    let base = open_base(&store.main, &store.main_path)?;
    store.merged = covers;
    store.obsolete.extend(store.layers.seqs());
    store.layers = Arc::new(Layers::new(
        base,
        Vec::new(),
        None,
        Arc::clone(&store.layers.path),
        Arc::clone(&store.layers.main_path),
    ));
    store.dirty.clear();
    store.dirty_bytes = 0;
    let job = store.begin_flush().expect("no flush runs during recovery");
    let res = job.write(Some((lsn, prepared)));
    store.end_flush(&job);
    res
}
