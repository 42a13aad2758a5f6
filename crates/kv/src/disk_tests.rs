//! Tests of the disk engine: a crash at every point of a checkpoint, a store
//! larger than its cache against a model, spills that a crash forgets.

use std::collections::BTreeMap;
use std::io;
use std::path::Path;
use std::sync::Arc;

use bytes::Bytes;
use parking_lot::Mutex;
use proptest::prelude::*;
use rand::{Rng, SeedableRng};
use redb::StorageBackend;
use weft_log::Durability;
use weft_wire::{Incarnation, NodeId, Tid};

use crate::disk::{BackendFactory, DiskOptions, DiskStore, PreparedSet};

/// A disk in memory holding the engine's files, that loses unsynced writes
/// at a crash, and that can be set to fail (the process died) after a
/// number of operations over all its files.
#[derive(Default)]
struct SimDisk {
    files: BTreeMap<String, SimFile>,
    /// Operations (write, set_len, sync) done, over every file.
    ops: u64,
    /// Fail every operation from this count on.
    die_at: Option<u64>,
}

#[derive(Default)]
struct SimFile {
    /// What reads see.
    volatile: Vec<u8>,
    /// What survives a crash: the state at the last sync.
    durable: Vec<u8>,
    /// Changes since the last sync, in order (for a crash that keeps some).
    unsynced: Vec<Change>,
}

/// An unsynced change of the disk.
enum Change {
    Write(u64, Vec<u8>),
    SetLen(u64),
}

impl Change {
    fn apply(&self, to: &mut Vec<u8>) {
        match self {
            Change::Write(off, data) => {
                let end = *off as usize + data.len();
                if to.len() < end {
                    to.resize(end, 0);
                }
                to[*off as usize..end].copy_from_slice(data);
            }
            Change::SetLen(len) => to.resize(*len as usize, 0),
        }
    }
}

impl SimDisk {
    fn step(&mut self) -> io::Result<()> {
        if self.die_at.is_some_and(|d| self.ops >= d) {
            return Err(io::Error::other("simulated crash: the process is gone"));
        }
        self.ops += 1;
        Ok(())
    }

    /// Power loss: unsynced writes are lost, except those `keep` picks (a
    /// disk may have written some of them before the power went).
    fn crash(&mut self, mut keep: impl FnMut(&Change) -> bool) {
        for f in self.files.values_mut() {
            let mut after = f.durable.clone();
            for change in std::mem::take(&mut f.unsynced) {
                if keep(&change) {
                    change.apply(&mut after);
                }
            }
            f.volatile = after.clone();
            f.durable = after;
        }
        self.die_at = None;
    }

    fn bytes(&self) -> usize {
        self.files.values().map(|f| f.volatile.len()).sum()
    }
}

/// Ways a power loss treats the unsynced changes: 0 loses them all, 1
/// keeps them all, 2 keeps each with even odds, 3 keeps only writes to the
/// first page (the engine's header) and loses every change of length: the
/// disk wrote a block the file already had, but the file system's journal
/// never recorded the file's growth.
const KEEP_MODES: u64 = 4;

fn keep(mode: u64, change: &Change, rng: &mut impl Rng) -> bool {
    match mode {
        0 => false,
        1 => true,
        2 => rng.gen_bool(0.5),
        _ => matches!(change, Change::Write(off, _) if *off < 4096),
    }
}

/// One file of a [`SimDisk`].
#[derive(Debug, Clone)]
struct SimBackend(Arc<Mutex<SimDisk>>, String);

impl std::fmt::Debug for SimDisk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SimDisk({} bytes)", self.bytes())
    }
}

impl StorageBackend for SimBackend {
    fn len(&self) -> io::Result<u64> {
        let d = self.0.lock();
        Ok(d.files.get(&self.1).map_or(0, |f| f.volatile.len()) as u64)
    }
    fn read(&self, offset: u64, len: usize) -> io::Result<Vec<u8>> {
        let d = self.0.lock();
        let end = offset as usize + len;
        let data = d.files.get(&self.1).map_or(&[][..], |f| &f.volatile);
        if end > data.len() {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "read past end",
            ));
        }
        Ok(data[offset as usize..end].to_vec())
    }
    fn set_len(&self, len: u64) -> io::Result<()> {
        let mut d = self.0.lock();
        d.step()?;
        let f = d.files.entry(self.1.clone()).or_default();
        f.volatile.resize(len as usize, 0);
        f.unsynced.push(Change::SetLen(len));
        Ok(())
    }
    fn sync_data(&self, _eventual: bool) -> io::Result<()> {
        let mut d = self.0.lock();
        d.step()?;
        let f = d.files.entry(self.1.clone()).or_default();
        let SimFile {
            durable, unsynced, ..
        } = f;
        for change in unsynced.drain(..) {
            change.apply(durable);
        }
        Ok(())
    }
    fn write(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        let mut d = self.0.lock();
        d.step()?;
        let f = d.files.entry(self.1.clone()).or_default();
        let end = offset as usize + data.len();
        if f.volatile.len() < end {
            f.volatile.resize(end, 0);
        }
        f.volatile[offset as usize..end].copy_from_slice(data);
        f.unsynced.push(Change::Write(offset, data.to_vec()));
        Ok(())
    }
}

fn options(disk: &Arc<Mutex<SimDisk>>, cache_bytes: usize, spill_entries: usize) -> DiskOptions {
    let disk = Arc::clone(disk);
    let factory: BackendFactory = Arc::new(move |p: &Path| {
        let name = p
            .file_name()
            .map_or_else(String::new, |n| n.to_string_lossy().into_owned());
        Ok(Box::new(SimBackend(Arc::clone(&disk), name)) as Box<dyn StorageBackend>)
    });
    DiskOptions {
        cache_bytes,
        spill_entries,
        spill_bytes: usize::MAX,
        // Merges only where a test asks for one.
        merge_deltas: usize::MAX,
        merge_entries: usize::MAX,
        backend: Some(factory),
    }
}

fn b(s: impl AsRef<[u8]>) -> Bytes {
    Bytes::copy_from_slice(s.as_ref())
}

fn tid(n: u64) -> Tid {
    Tid::new(NodeId(1), Incarnation(1), n)
}

fn contents(store: &DiskStore) -> BTreeMap<Bytes, Bytes> {
    let mut out = BTreeMap::new();
    store
        .visit_range(&Bytes::new(), &Bytes::new(), |k, v| {
            out.insert(k.clone(), v.clone());
            true
        })
        .unwrap();
    out
}

fn open(disk: &Arc<Mutex<SimDisk>>) -> crate::disk::Opened {
    DiskStore::open(
        Path::new("/sim/kv"),
        &Durability::new(),
        options(disk, 1 << 20, 1 << 20),
    )
    .unwrap()
}

fn checkpoint(store: &mut DiskStore, lsn: u64, prepared: &[PreparedSet]) -> Result<(), String> {
    let job = store.begin_flush().unwrap();
    let res = job.write(Some((lsn, prepared))).map_err(|e| e.to_string());
    store.end_flush(&job);
    res
}

/// The state of the test database before and after the checkpoint under
/// test, built on a fresh disk; returns the disk armed to die after `die_at`
/// operations of that checkpoint (None: not armed), and whether the
/// checkpoint returned Ok.
fn scenario(die_at: Option<u64>) -> (Arc<Mutex<SimDisk>>, u64, bool) {
    let disk = Arc::new(Mutex::new(SimDisk::default()));
    let mut store = open(&disk).store;
    for i in 0..300u32 {
        store.apply(b(format!("k{i:04}")), Some(b(format!("old{i}"))));
    }
    checkpoint(
        &mut store,
        100,
        &[(tid(1), 90, vec![(b("p"), Some(b("1")))])],
    )
    .unwrap();
    // Changes after it: updates, deletes, inserts, and a spill between.
    for i in (0..300u32).step_by(3) {
        store.apply(b(format!("k{i:04}")), Some(b(format!("new{i}"))));
    }
    let job = store.begin_flush().unwrap();
    let spilled = job.write(None);
    store.end_flush(&job);
    spilled.unwrap();
    for i in (1..300u32).step_by(7) {
        store.apply(b(format!("k{i:04}")), None);
    }
    for i in 300..340u32 {
        store.apply(b(format!("k{i:04}")), Some(b("fresh")));
    }
    let before = disk.lock().ops;
    disk.lock().die_at = die_at.map(|d| before + d);
    let ok = checkpoint(&mut store, 200, &[(tid(2), 150, vec![(b("q"), None)])]).is_ok();
    let ops = disk.lock().ops - before;
    drop(store);
    (disk, ops, ok)
}

fn model(after: bool) -> BTreeMap<Bytes, Bytes> {
    let mut m = BTreeMap::new();
    for i in 0..300u32 {
        m.insert(b(format!("k{i:04}")), b(format!("old{i}")));
    }
    if after {
        for i in (0..300u32).step_by(3) {
            m.insert(b(format!("k{i:04}")), b(format!("new{i}")));
        }
        for i in (1..300u32).step_by(7) {
            m.remove(&b(format!("k{i:04}")));
        }
        for i in 300..340u32 {
            m.insert(b(format!("k{i:04}")), b("fresh"));
        }
    }
    m
}

/// A crash after each operation of a checkpoint's engine commit (every
/// write, length change and sync it makes), with the unsynced writes lost,
/// or some of them kept: the engine reopens at either the previous
/// checkpoint, whole, or the new one, whole, never at a mix, and the log
/// position it reports is the one its data is valid as of (recovery replays
/// weft's log from there).
#[test]
fn a_crash_at_every_point_of_a_checkpoint_leaves_one_whole_checkpoint() {
    let (disk, total, ok) = scenario(None);
    assert!(ok && total > 2, "the checkpoint makes {total} operations");
    eprintln!(
        "checkpoint: {total} operations, file {} bytes",
        disk.lock().bytes()
    );
    let (old, new) = (model(false), model(true));
    let (mut saw_old, mut saw_new) = (false, false);
    for die_at in 0..=total {
        for keep_mode in 0..KEEP_MODES {
            let seed = die_at * KEEP_MODES + keep_mode;
            let (disk, _, ok) = scenario(Some(die_at));
            let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
            disk.lock().crash(|c| keep(keep_mode, c, &mut rng));
            let opened = open(&disk);
            let got = contents(&opened.store);
            let ctx = format!("crash after op {die_at}/{total}, keep mode {keep_mode}, seed {seed}, checkpoint returned ok={ok}");
            match opened.lsn {
                Some(100) => {
                    assert!(!ok, "{ctx}: a checkpoint that returned Ok was lost");
                    assert_eq!(
                        got, old,
                        "{ctx}: old position, data not the old checkpoint's"
                    );
                    assert_eq!(opened.prepared[0].0, tid(1), "{ctx}");
                    saw_old = true;
                }
                Some(200) => {
                    assert_eq!(
                        got, new,
                        "{ctx}: new position, data not the new checkpoint's"
                    );
                    assert_eq!(opened.prepared[0].0, tid(2), "{ctx}");
                    saw_new = true;
                }
                other => panic!("{ctx}: engine at position {other:?}"),
            }
        }
    }
    assert!(saw_old && saw_new, "both outcomes were reached");
}

/// A spill is not durable: a crash before the next checkpoint forgets it,
/// with everything since the last checkpoint, and the engine reports that
/// checkpoint's position.
#[test]
fn a_crash_after_a_spill_reverts_to_the_last_checkpoint() {
    let disk = Arc::new(Mutex::new(SimDisk::default()));
    let mut store = open(&disk).store;
    store.apply(b("a"), Some(b("1")));
    checkpoint(&mut store, 10, &[]).unwrap();
    store.apply(b("a"), Some(b("2")));
    store.apply(b("b"), Some(b("2")));
    let job = store.begin_flush().unwrap();
    job.write(None).unwrap();
    store.end_flush(&job);
    assert_eq!(
        store.get(&b("a")).unwrap(),
        Some(b("2")),
        "the spill is read back"
    );
    let ops = disk.lock().ops;
    disk.lock().die_at = Some(ops);
    drop(store);
    disk.lock().crash(|_| false);
    let opened = open(&disk);
    assert_eq!(opened.lsn, Some(10));
    assert_eq!(contents(&opened.store), BTreeMap::from([(b("a"), b("1"))]));
}

fn merge(store: &mut DiskStore) -> Result<bool, String> {
    let Some(job) = store.begin_merge().map_err(|e| e.to_string())? else {
        return Ok(false);
    };
    let res = job.write().map_err(|e| e.to_string());
    store.end_merge(&job);
    res.map(|()| true)
}

/// The state of [`scenario`] after its checkpoint, on a fresh disk, with
/// one more checkpoint of further changes; then a merge of every delta,
/// armed to die after `die_at` operations. Returns the disk, the merge's
/// operations and whether it returned Ok.
fn merge_scenario(die_at: Option<u64>) -> (Arc<Mutex<SimDisk>>, u64, bool) {
    let (disk, _, ok) = scenario(None);
    assert!(ok);
    let mut store = open(&disk).store;
    for i in 340..360u32 {
        store.apply(b(format!("k{i:04}")), Some(b("late")));
    }
    store.apply(b("k0000"), None);
    checkpoint(&mut store, 300, &[]).unwrap();
    let before = disk.lock().ops;
    disk.lock().die_at = die_at.map(|d| before + d);
    let ok = merge(&mut store).is_ok_and(|merged| merged);
    let ops = disk.lock().ops - before;
    drop(store);
    (disk, ops, ok)
}

fn merge_model() -> BTreeMap<Bytes, Bytes> {
    let mut m = model(true);
    for i in 340..360u32 {
        m.insert(b(format!("k{i:04}")), b("late"));
    }
    m.remove(&b("k0000"));
    m
}

/// A merge changes no content: a crash after each of its operations, with
/// unsynced writes lost, kept or half kept, reopens the engine with the
/// same data and the same checkpoint position, whether the merge took
/// effect or not; and the next flush drops the merged deltas.
#[test]
fn a_crash_at_every_point_of_a_merge_changes_nothing() {
    let (disk, total, ok) = merge_scenario(None);
    assert!(ok && total > 2, "the merge makes {total} operations");
    let want = merge_model();
    {
        let mut opened = open(&disk);
        assert_eq!(opened.store.delta_stats().0, 0, "every delta merged");
        assert_eq!(contents(&opened.store), want);
        checkpoint(&mut opened.store, 301, &[]).unwrap();
        assert_eq!(
            contents(&opened.store),
            want,
            "merged deltas dropped, content kept"
        );
    }
    for die_at in 0..=total {
        for keep_mode in 0..KEEP_MODES {
            let seed = die_at * KEEP_MODES + keep_mode;
            let (disk, _, ok) = merge_scenario(Some(die_at));
            let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
            disk.lock().crash(|c| keep(keep_mode, c, &mut rng));
            let ctx = format!("crash after op {die_at}/{total} of a merge, keep mode {keep_mode}, seed {seed}, merge returned ok={ok}");
            let mut opened = open(&disk);
            assert_eq!(opened.lsn, Some(300), "{ctx}");
            assert_eq!(contents(&opened.store), want, "{ctx}");
            if ok {
                assert_eq!(
                    opened.store.delta_stats().0,
                    0,
                    "{ctx}: a merge that returned Ok was lost"
                );
            }
            assert_eq!(
                opened.store.key_count().unwrap(),
                want.len() as u64,
                "{ctx}"
            );
            // Merging again (or for the first time) still changes nothing.
            merge(&mut opened.store).unwrap();
            assert_eq!(contents(&opened.store), want, "{ctx}: merged again");
        }
    }
}

#[derive(Clone, Debug)]
enum Step {
    Put(u16, u8),
    Delete(u16),
    Spill,
    Checkpoint,
    /// Merge the deltas into the main table.
    Merge,
    /// Start a merge and leave it running (ended by `EndMerge`, spills and
    /// checkpoints meanwhile).
    BeginMerge,
    /// Write and end the merge `BeginMerge` started.
    EndMerge,
    /// Take the lookup of a key as a reader holding its lock would, to be
    /// finished later, after flushes and merges (until the key is written,
    /// which the reader's lock would have held off).
    Hold(u16),
    /// Crash and reopen: back to the last checkpoint (or the last merge).
    Crash,
    Scan(u16, u16, u8),
}

/// A model's state as of a flush, with that flush's count.
type Flushed = (u64, BTreeMap<Bytes, Bytes>);

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        8 => (0u16..2000, any::<u8>()).prop_map(|(k, v)| Step::Put(k, v)),
        3 => (0u16..2000).prop_map(Step::Delete),
        1 => Just(Step::Spill),
        1 => Just(Step::Checkpoint),
        1 => Just(Step::Merge),
        1 => Just(Step::BeginMerge),
        1 => Just(Step::EndMerge),
        2 => (0u16..2000).prop_map(Step::Hold),
        1 => Just(Step::Crash),
        2 => (0u16..2000, 0u16..2000, 1u8..50).prop_map(|(a, z, n)| Step::Scan(a, z, n)),
    ]
}

fn key(k: u16) -> Bytes {
    b(format!("key{k:05}"))
}

fn value(k: u16, v: u8) -> Bytes {
    // 200 bytes a value: a few hundred keys already pass the cache.
    let mut out = vec![v; 200];
    out[..2].copy_from_slice(&k.to_le_bytes());
    Bytes::from(out)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// A store whose data passes its page cache many times (a 16 KiB cache,
    /// up to 2000 keys of 200 bytes) and its overlay bound (64 changes)
    /// answers reads and scans as a model map does, across spills,
    /// checkpoints and crashes, with merges that end after flushes began
    /// and ended, and lookups finished after the layers they took changed.
    #[test]
    fn a_store_larger_than_its_cache_behaves_like_a_map(
        steps in proptest::collection::vec(step(), 1..400),
    ) {
        let disk = Arc::new(Mutex::new(SimDisk::default()));
        let opts = options(&disk, 16 << 10, 64);
        let reopen = || DiskStore::open(Path::new("/sim/kv"), &Durability::new(), opts.clone()).unwrap().store;
        let mut store = reopen();
        let mut live: BTreeMap<Bytes, Bytes> = BTreeMap::new();
        // What a crash goes back to, and the flush that made it (by count).
        let mut durable = (0u64, live.clone());
        // The state as of the last flush (what a merge makes durable), and
        // that flush's count.
        let mut flushed = (0u64, live.clone());
        let mut lsn = 0;
        // A merge in progress, with the flushed state it covers.
        let mut merging: Option<(crate::disk::MergeJob, Flushed)> = None;
        // Lookups taken and not finished yet, with the value they must give.
        let mut held: Vec<(Bytes, crate::disk::Lookup, Option<Bytes>)> = Vec::new();
        for (i, s) in steps.iter().enumerate() {
            match s {
                Step::Put(k, v) => {
                    held.retain(|(h, _, _)| *h != key(*k));
                    store.apply(key(*k), Some(value(*k, *v)));
                    live.insert(key(*k), value(*k, *v));
                }
                Step::Delete(k) => {
                    held.retain(|(h, _, _)| *h != key(*k));
                    store.apply(key(*k), None);
                    live.remove(&key(*k));
                }
                Step::Spill => {
                    let job = store.begin_flush().unwrap();
                    let res = job.write(None);
                    store.end_flush(&job);
                    res.unwrap();
                    flushed = (flushed.0 + 1, live.clone());
                }
                Step::Checkpoint => {
                    lsn += 1;
                    checkpoint(&mut store, lsn, &[]).unwrap();
                    flushed = (flushed.0 + 1, live.clone());
                    durable = flushed.clone();
                }
                Step::Merge if merging.is_none() => {
                    // A merge is durable and may carry spills: after a
                    // crash the engine is at least as new as the merge
                    // (recovery replays the log over it).
                    if merge(&mut store).unwrap() {
                        durable = flushed.clone();
                    }
                }
                Step::Merge => {}
                Step::BeginMerge => {
                    if merging.is_none() {
                        if let Some(job) = store.begin_merge().unwrap() {
                            merging = Some((job, flushed.clone()));
                        }
                    }
                }
                Step::EndMerge => {
                    if let Some((job, covered)) = merging.take() {
                        job.write().unwrap();
                        store.end_merge(&job);
                        // A checkpoint taken while it ran may be newer.
                        if covered.0 > durable.0 {
                            durable = covered;
                        }
                    }
                }
                Step::Hold(k) => {
                    held.push((key(*k), store.lookup(&key(*k)), live.get(&key(*k)).cloned()));
                }
                Step::Crash => {
                    // The process dies: the engine's drop cannot write.
                    held.clear();
                    merging = None;
                    let ops = disk.lock().ops;
                    disk.lock().die_at = Some(ops);
                    drop(store);
                    disk.lock().crash(|_| false);
                    store = reopen();
                    live = durable.1.clone();
                    flushed = durable.clone();
                }
                Step::Scan(a, z, n) => {
                    let (a, z) = (key(*a.min(z)), key(*a.max(z)));
                    let mut got = Vec::new();
                    store.visit_range(&a, &z, |k, v| {
                        got.push((k.clone(), v.clone()));
                        got.len() < usize::from(*n)
                    }).unwrap();
                    let want: Vec<(Bytes, Bytes)> = live
                        .range(a..z)
                        .take(usize::from(*n))
                        .map(|(k, v)| (k.clone(), v.clone()))
                        .collect();
                    prop_assert_eq!(got, want, "scan at step {}", i);
                }
            }
            if store.should_spill() {
                let job = store.begin_flush().unwrap();
                job.write(None).unwrap();
                store.end_flush(&job);
                flushed = (flushed.0 + 1, live.clone());
            }
            if i % 16 == 0 {
                for k in (0u16..2000).step_by(97) {
                    prop_assert_eq!(store.get(&key(k)).unwrap(), live.get(&key(k)).cloned(), "get at step {}", i);
                }
                for (k, lookup, want) in &held {
                    prop_assert_eq!(&lookup.value(k).unwrap(), want, "held lookup of {:?} at step {}", k, i);
                }
                prop_assert_eq!(store.key_count().unwrap(), live.len() as u64, "len at step {}", i);
            }
        }
        for (k, lookup, want) in &held {
            prop_assert_eq!(&lookup.value(k).unwrap(), want, "held lookup of {:?} at the end", k);
        }
        prop_assert_eq!(contents(&store), live);
    }
}

/// The length read from a redb header is the file's own after a clean
/// close (the header's layout covers the file exactly), for both files of
/// a store that grew past redb's first allocation.
#[test]
fn the_layout_read_from_a_redb_header_is_the_file_length() {
    let disk = Arc::new(Mutex::new(SimDisk::default()));
    {
        let mut store = open(&disk).store;
        for i in 0..3000u32 {
            store.apply(b(format!("k{i:05}")), Some(Bytes::from(vec![7u8; 300])));
        }
        checkpoint(&mut store, 1, &[]).unwrap();
        assert!(merge(&mut store).unwrap());
    }
    let d = disk.lock();
    assert_eq!(d.files.len(), 2);
    for (name, f) in &d.files {
        assert!(
            f.volatile.len() > 1 << 20,
            "{name} grew: {}",
            f.volatile.len()
        );
        assert_eq!(
            crate::disk::redb_layout_len(&f.volatile[..32]),
            Some(f.volatile.len() as u64),
            "{name}"
        );
    }
    assert_eq!(crate::disk::redb_layout_len(&[0u8; 32]), None);
    assert_eq!(
        crate::disk::redb_layout_len(&d.files.values().next().unwrap().volatile[..31]),
        None
    );
}
