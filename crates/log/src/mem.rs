//! An in-memory disk for deterministic simulation: a [`Storage`] that keeps, per file, what
//! the page cache holds and what is durable, and on [`MemDisk::crash`] keeps only what was
//! synced, plus (chosen by the caller's random source) a prefix of the unsynced writes, the
//! last of which may be torn. Directory entries are durable only once their directory was
//! synced. Syncs can be made to fail ([`DiskFault`]).
//!
//! Owns: the simulated files, names and directories, the crash rule and fault injection, and
//! counters of what faults happened ([`DiskStats`]). Must never: read a clock, use its own
//! randomness (the caller's seeded source decides every choice, so a run replays exactly),
//! or let a handle opened before a crash touch the disk after it.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use parking_lot::Mutex;

use crate::storage::{Storage, StorageFile};

/// A fault to inject into the next syncs of a [`MemDisk`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DiskFault {
    /// The `n`-th file sync (fsync/fdatasync) from now (1 = the next) fails with EIO and
    /// makes nothing durable.
    FailFileSync(u64),
    /// The `n`-th directory sync from now fails with EIO and makes no entry durable.
    FailDirSync(u64),
}

/// What happened on a [`MemDisk`] so far (for coverage reports).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DiskStats {
    /// File syncs that succeeded.
    pub file_syncs: u64,
    /// Directory syncs that succeeded.
    pub dir_syncs: u64,
    /// File syncs that failed by injection.
    pub file_sync_failures: u64,
    /// Directory syncs that failed by injection.
    pub dir_sync_failures: u64,
    /// Crashes.
    pub crashes: u64,
    /// Unsynced writes (or length changes) a crash discarded.
    pub lost_writes: u64,
    /// Unsynced writes a crash kept only a prefix of.
    pub torn_writes: u64,
    /// Unsynced writes a crash kept whole (written back before the crash).
    pub kept_unsynced_writes: u64,
    /// Directory entries (files or directories) a crash undid because their directory was
    /// not synced.
    pub lost_entries: u64,
}

#[derive(Debug, Clone)]
enum Pending {
    Write { offset: u64, bytes: Vec<u8> },
    SetLen(u64),
}

#[derive(Debug, Default, Clone)]
struct MemFile {
    /// What reads see (the page cache).
    data: Vec<u8>,
    /// What survives a crash.
    durable: Vec<u8>,
    /// Changes since the last sync, oldest first.
    unsynced: Vec<Pending>,
}

fn apply(buf: &mut Vec<u8>, p: &Pending) {
    match p {
        Pending::Write { offset, bytes } => {
            let off = *offset as usize;
            if buf.len() < off + bytes.len() {
                buf.resize(off + bytes.len(), 0);
            }
            buf[off..off + bytes.len()].copy_from_slice(bytes);
        }
        Pending::SetLen(len) => buf.resize(*len as usize, 0),
    }
}

#[derive(Debug)]
struct Disk {
    files: BTreeMap<u64, MemFile>,
    next_id: u64,
    names: BTreeMap<PathBuf, u64>,
    durable_names: BTreeMap<PathBuf, u64>,
    dirs: BTreeSet<PathBuf>,
    durable_dirs: BTreeSet<PathBuf>,
    /// Bumped at each crash: handles from an older epoch fail.
    epoch: u64,
    fail_file_sync_in: Option<u64>,
    fail_dir_sync_in: Option<u64>,
    stats: DiskStats,
}

impl Default for Disk {
    fn default() -> Self {
        let root: BTreeSet<PathBuf> = [PathBuf::from("/")].into_iter().collect();
        Disk {
            files: BTreeMap::new(),
            next_id: 1,
            names: BTreeMap::new(),
            durable_names: BTreeMap::new(),
            dirs: root.clone(),
            durable_dirs: root,
            epoch: 0,
            fail_file_sync_in: None,
            fail_dir_sync_in: None,
            stats: DiskStats::default(),
        }
    }
}

fn parent_of(path: &Path) -> PathBuf {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("/"),
    }
}

fn not_found(path: &Path) -> io::Error {
    io::Error::new(
        io::ErrorKind::NotFound,
        format!("{}: no such file", path.display()),
    )
}

/// The error an injected sync failure reports (the caller adds what it was doing).
fn eio(_what: &str) -> io::Error {
    io::Error::from_raw_os_error(libc::EIO)
}

fn stale() -> io::Error {
    io::Error::other("file handle from before a simulated crash")
}

/// A simulated disk shared by every file a node keeps (log segments, `log.meta`, snapshots).
/// Cheap to clone (clones share the disk). Use it through [`MemDisk::durability`].
///
/// Paths are absolute; `/` always exists.
#[derive(Clone, Default)]
pub struct MemDisk {
    disk: Arc<Mutex<Disk>>,
}

impl fmt::Debug for MemDisk {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let d = self.disk.lock();
        f.debug_struct("MemDisk")
            .field("files", &d.names.len())
            .field("epoch", &d.epoch)
            .finish_non_exhaustive()
    }
}

impl MemDisk {
    /// An empty disk holding only `/`.
    #[must_use]
    pub fn new() -> MemDisk {
        MemDisk::default()
    }

    /// The seam that puts a log (or snapshots) on this disk.
    #[must_use]
    pub fn durability(&self) -> crate::Durability {
        crate::Durability::on(Arc::new(self.clone()))
    }

    /// Arms a fault (replacing an armed fault of the same kind).
    pub fn inject(&self, fault: DiskFault) {
        let mut d = self.disk.lock();
        match fault {
            DiskFault::FailFileSync(n) => d.fail_file_sync_in = Some(n.max(1)),
            DiskFault::FailDirSync(n) => d.fail_dir_sync_in = Some(n.max(1)),
        }
    }

    /// Disarms every armed fault.
    pub fn clear_faults(&self) {
        let mut d = self.disk.lock();
        d.fail_file_sync_in = None;
        d.fail_dir_sync_in = None;
    }

    /// The counters so far.
    #[must_use]
    pub fn stats(&self) -> DiskStats {
        self.disk.lock().stats
    }

    /// Bytes of unsynced changes a crash now could lose (0 when everything is synced).
    #[must_use]
    pub fn unsynced_writes(&self) -> usize {
        self.disk
            .lock()
            .files
            .values()
            .map(|f| f.unsynced.len())
            .sum()
    }

    /// Power loss: every file goes back to what was synced, except that, for each file, a
    /// prefix of its unsynced changes (length chosen by `pick`) is kept, and the change right
    /// after that prefix may be torn (a prefix of its bytes kept). Directory entries not
    /// synced since they changed are undone. Every handle opened before fails from now on.
    ///
    /// `pick(n)` must return a number below `n` (`n >= 1`); pass the simulation's seeded
    /// random source so the crash replays. Returns what it did, as counters of this crash.
    pub fn crash(&self, pick: &mut dyn FnMut(u64) -> u64) -> DiskStats {
        let mut d = self.disk.lock();
        let mut this = DiskStats {
            crashes: 1,
            ..DiskStats::default()
        };
        d.epoch += 1;
        let durable_dirs = d.durable_dirs.clone();
        this.lost_entries += d.dirs.difference(&durable_dirs).count() as u64;
        d.dirs = durable_dirs;
        let durable_names = d.durable_names.clone();
        this.lost_entries += d
            .names
            .iter()
            .filter(|(p, id)| durable_names.get(*p) != Some(id))
            .count() as u64;
        this.lost_entries += durable_names
            .keys()
            .filter(|p| !d.names.contains_key(*p))
            .count() as u64;
        // A durable name in a directory that is itself gone is gone too.
        let dirs = d.dirs.clone();
        d.names = durable_names
            .into_iter()
            .filter(|(p, _)| dirs.contains(&parent_of(p)))
            .collect();
        d.durable_names = d.names.clone();
        let live: BTreeSet<u64> = d.names.values().copied().collect();
        d.files.retain(|id, _| live.contains(id));
        for file in d.files.values_mut() {
            let n = file.unsynced.len() as u64;
            let mut image = std::mem::take(&mut file.durable);
            if n > 0 {
                let kept = pick(n + 1);
                for p in &file.unsynced[..kept as usize] {
                    apply(&mut image, p);
                }
                this.kept_unsynced_writes += kept;
                this.lost_writes += n - kept;
                if kept < n {
                    if let Pending::Write { offset, bytes } = &file.unsynced[kept as usize] {
                        if bytes.len() > 1 && pick(2) == 1 {
                            let cut = 1 + pick(bytes.len() as u64 - 1) as usize;
                            apply(
                                &mut image,
                                &Pending::Write {
                                    offset: *offset,
                                    bytes: bytes[..cut].to_vec(),
                                },
                            );
                            this.torn_writes += 1;
                            this.lost_writes -= 1;
                        }
                    }
                }
            }
            file.unsynced.clear();
            file.data = image.clone();
            file.durable = image;
        }
        d.fail_file_sync_in = None;
        d.fail_dir_sync_in = None;
        let s = &mut d.stats;
        s.crashes += 1;
        s.lost_writes += this.lost_writes;
        s.torn_writes += this.torn_writes;
        s.kept_unsynced_writes += this.kept_unsynced_writes;
        s.lost_entries += this.lost_entries;
        this
    }

    fn handle(&self, id: u64, epoch: u64) -> Box<dyn StorageFile> {
        Box::new(MemHandle {
            disk: self.clone(),
            id,
            epoch,
        })
    }
}

impl Storage for MemDisk {
    fn create_dir(&self, dir: &Path) -> io::Result<()> {
        let mut d = self.disk.lock();
        if d.dirs.contains(dir) || d.names.contains_key(dir) {
            return Err(io::Error::new(
                io::ErrorKind::AlreadyExists,
                format!("{} exists", dir.display()),
            ));
        }
        if !d.dirs.contains(&parent_of(dir)) {
            return Err(not_found(&parent_of(dir)));
        }
        d.dirs.insert(dir.to_path_buf());
        Ok(())
    }

    fn is_dir(&self, path: &Path) -> bool {
        self.disk.lock().dirs.contains(path)
    }

    fn exists(&self, path: &Path) -> bool {
        let d = self.disk.lock();
        d.dirs.contains(path) || d.names.contains_key(path)
    }

    fn list(&self, dir: &Path) -> io::Result<Vec<String>> {
        let d = self.disk.lock();
        if !d.dirs.contains(dir) {
            return Err(not_found(dir));
        }
        let names = d.names.keys().chain(d.dirs.iter());
        Ok(names
            .filter(|p| p.as_path() != Path::new("/") && parent_of(p) == dir)
            .filter_map(|p| p.file_name()?.to_str().map(str::to_string))
            .collect())
    }

    fn create(&self, path: &Path) -> io::Result<Box<dyn StorageFile>> {
        let mut d = self.disk.lock();
        if !d.dirs.contains(&parent_of(path)) {
            return Err(not_found(&parent_of(path)));
        }
        let epoch = d.epoch;
        if let Some(&id) = d.names.get(path) {
            let f = d.files.get_mut(&id).expect("named files exist");
            f.data.clear();
            f.unsynced.push(Pending::SetLen(0));
            drop(d);
            return Ok(self.handle(id, epoch));
        }
        let id = d.next_id;
        d.next_id += 1;
        d.files.insert(id, MemFile::default());
        d.names.insert(path.to_path_buf(), id);
        drop(d);
        Ok(self.handle(id, epoch))
    }

    fn open(&self, path: &Path) -> io::Result<Box<dyn StorageFile>> {
        let d = self.disk.lock();
        let id = *d.names.get(path).ok_or_else(|| not_found(path))?;
        let epoch = d.epoch;
        drop(d);
        Ok(self.handle(id, epoch))
    }

    fn read(&self, path: &Path) -> io::Result<Vec<u8>> {
        let d = self.disk.lock();
        let id = d.names.get(path).ok_or_else(|| not_found(path))?;
        Ok(d.files[id].data.clone())
    }

    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        let mut d = self.disk.lock();
        if !d.dirs.contains(&parent_of(to)) {
            return Err(not_found(&parent_of(to)));
        }
        let id = d.names.remove(from).ok_or_else(|| not_found(from))?;
        d.names.insert(to.to_path_buf(), id);
        Ok(())
    }

    fn remove(&self, path: &Path) -> io::Result<()> {
        let mut d = self.disk.lock();
        d.names.remove(path).ok_or_else(|| not_found(path))?;
        Ok(())
    }

    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        let mut d = self.disk.lock();
        if !d.dirs.contains(dir) {
            return Err(not_found(dir));
        }
        if let Some(n) = d.fail_dir_sync_in {
            if n <= 1 {
                d.fail_dir_sync_in = None;
                d.stats.dir_sync_failures += 1;
                return Err(eio(&format!("fsync of directory {}", dir.display())));
            }
            d.fail_dir_sync_in = Some(n - 1);
        }
        d.stats.dir_syncs += 1;
        let in_dir = |p: &PathBuf| parent_of(p) == dir;
        let current: Vec<(PathBuf, u64)> = d
            .names
            .iter()
            .filter(|(p, _)| in_dir(p))
            .map(|(p, id)| (p.clone(), *id))
            .collect();
        d.durable_names.retain(|p, _| !in_dir(p));
        d.durable_names.extend(current);
        let subdirs: Vec<PathBuf> = d.dirs.iter().filter(|p| in_dir(p)).cloned().collect();
        d.durable_dirs
            .retain(|p| p.as_path() == Path::new("/") || !in_dir(p));
        d.durable_dirs.extend(subdirs);
        Ok(())
    }
}

/// An open file of a [`MemDisk`] (like an inode: it survives renames).
struct MemHandle {
    disk: MemDisk,
    id: u64,
    epoch: u64,
}

impl fmt::Debug for MemHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "MemHandle(#{})", self.id)
    }
}

impl MemHandle {
    fn with<T>(&self, op: impl FnOnce(&mut Disk, u64) -> io::Result<T>) -> io::Result<T> {
        let mut d = self.disk.disk.lock();
        if d.epoch != self.epoch {
            return Err(stale());
        }
        op(&mut d, self.id)
    }

    fn sync(&self, what: &str) -> io::Result<()> {
        self.with(|d, id| {
            if let Some(n) = d.fail_file_sync_in {
                if n <= 1 {
                    d.fail_file_sync_in = None;
                    d.stats.file_sync_failures += 1;
                    return Err(eio(what));
                }
                d.fail_file_sync_in = Some(n - 1);
            }
            d.stats.file_syncs += 1;
            if let Some(f) = d.files.get_mut(&id) {
                for p in std::mem::take(&mut f.unsynced) {
                    apply(&mut f.durable, &p);
                }
                debug_assert_eq!(f.durable, f.data, "a synced file is what reads see");
            }
            Ok(())
        })
    }
}

impl StorageFile for MemHandle {
    fn write_all_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.with(|d, id| {
            let f = d.files.get_mut(&id).ok_or_else(stale)?;
            let p = Pending::Write {
                offset,
                bytes: buf.to_vec(),
            };
            apply(&mut f.data, &p);
            f.unsynced.push(p);
            Ok(())
        })
    }

    fn read_all(&self) -> io::Result<Vec<u8>> {
        self.with(|d, id| Ok(d.files.get(&id).ok_or_else(stale)?.data.clone()))
    }

    fn len(&self) -> io::Result<u64> {
        self.with(|d, id| Ok(d.files.get(&id).ok_or_else(stale)?.data.len() as u64))
    }

    fn set_len(&self, len: u64) -> io::Result<()> {
        self.with(|d, id| {
            let f = d.files.get_mut(&id).ok_or_else(stale)?;
            let p = Pending::SetLen(len);
            apply(&mut f.data, &p);
            f.unsynced.push(p);
            Ok(())
        })
    }

    fn allocate(&self, size: u64) -> io::Result<()> {
        // Allocation only reserves space; the simulated file's length changes as on Linux.
        if self.len()? < size {
            self.set_len(size)?;
        }
        Ok(())
    }

    fn sync_data(&self) -> io::Result<()> {
        self.sync("fdatasync")
    }

    fn sync_all(&self) -> io::Result<()> {
        self.sync("fsync")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fixed sequence of choices standing in for a seeded random source.
    fn picks(v: Vec<u64>) -> impl FnMut(u64) -> u64 {
        let mut it = v.into_iter();
        move |n| it.next().unwrap_or(0) % n
    }

    #[test]
    fn unsynced_data_and_entries_are_lost_synced_ones_stay() {
        let disk = MemDisk::new();
        let dur = disk.durability();
        dur.create_dir_all(Path::new("/n/log")).unwrap();
        let f = dur.create(Path::new("/n/log/a")).unwrap();
        f.write_all_at(b"hello", 0).unwrap();
        f.sync_data().unwrap();
        dur.sync_dir(Path::new("/n/log")).unwrap();
        f.write_all_at(b" world", 5).unwrap();
        let g = dur.create(Path::new("/n/log/b")).unwrap();
        g.sync_all().unwrap();
        assert_eq!(dur.read(Path::new("/n/log/a")).unwrap(), b"hello world");
        let st = disk.crash(&mut picks(vec![0]));
        assert_eq!(st.lost_writes, 1);
        assert_eq!(st.lost_entries, 1, "b's name was never synced");
        assert_eq!(dur.read(Path::new("/n/log/a")).unwrap(), b"hello");
        assert!(!dur.exists(Path::new("/n/log/b")));
        assert!(f.write_all_at(b"x", 0).is_err(), "old handles are dead");
    }

    #[test]
    fn a_crash_can_tear_the_first_lost_write_and_keep_earlier_ones() {
        let disk = MemDisk::new();
        let dur = disk.durability();
        dur.create_dir_all(Path::new("/d")).unwrap();
        let f = dur.create(Path::new("/d/f")).unwrap();
        dur.sync_dir(Path::new("/d")).unwrap();
        f.write_all_at(b"aaaa", 0).unwrap();
        f.write_all_at(b"bbbb", 4).unwrap();
        f.write_all_at(b"cccc", 8).unwrap();
        // keep 1 write, tear the second after 2 bytes (1 + pick(3) = 2).
        let st = disk.crash(&mut picks(vec![1, 1, 1]));
        assert_eq!(st.torn_writes, 1);
        assert_eq!(st.kept_unsynced_writes, 1);
        assert_eq!(st.lost_writes, 1);
        assert_eq!(dur.read(Path::new("/d/f")).unwrap(), b"aaaabb");
    }

    #[test]
    fn injected_sync_failures_fail_once_and_sync_nothing() {
        let disk = MemDisk::new();
        let dur = disk.durability();
        dur.create_dir_all(Path::new("/d")).unwrap();
        let f = dur.create(Path::new("/d/f")).unwrap();
        dur.sync_dir(Path::new("/d")).unwrap();
        disk.inject(DiskFault::FailFileSync(2));
        f.write_all_at(b"one", 0).unwrap();
        f.sync_data().unwrap();
        f.write_all_at(b"two", 3).unwrap();
        assert!(f.sync_data().is_err());
        disk.inject(DiskFault::FailDirSync(1));
        assert!(dur.sync_dir(Path::new("/d")).is_err());
        assert_eq!(disk.stats().file_sync_failures, 1);
        assert_eq!(disk.stats().dir_sync_failures, 1);
        disk.crash(&mut picks(vec![0]));
        assert_eq!(dur.read(Path::new("/d/f")).unwrap(), b"one");
    }

    #[test]
    fn renames_become_durable_with_the_directory_sync() {
        let disk = MemDisk::new();
        let dur = disk.durability();
        dur.create_dir_all(Path::new("/d")).unwrap();
        let f = dur.create(Path::new("/d/x.tmp")).unwrap();
        f.write_all_at(b"v1", 0).unwrap();
        f.sync_all().unwrap();
        dur.rename(Path::new("/d/x.tmp"), Path::new("/d/x"))
            .unwrap();
        let g = dur.create(Path::new("/d/y.tmp")).unwrap();
        g.write_all_at(b"v2", 0).unwrap();
        g.sync_all().unwrap();
        disk.crash(&mut picks(vec![]));
        assert_eq!(dur.read(Path::new("/d/x")).unwrap(), b"v1");
        assert_eq!(dur.list(Path::new("/d")).unwrap(), vec!["x".to_string()]);
    }
}
