//! Directory entries that survive power loss: the one way weft creates directories, creates
//! and renames files into place, and removes them.
//!
//! A file's data is made durable by fsyncing the file; its *name* lives in the directory that
//! holds it, and is durable only once that directory is fsynced. A directory created by
//! `mkdir` is itself an entry in its parent. A file system may drop any entry whose directory
//! was not synced since it changed (ext4 without `auto_da_alloc`, XFS, most network file
//! systems), so a node that writes a snapshot into a fresh `kv/` directory, syncs `kv/` but
//! not its parent, and then truncates its log, can come back with no snapshot at all.
//!
//! Owns: [`Durability`], the seam every weft crate goes through to change directory entries
//! (`create_dir_all` syncs the parent of every directory it creates, `rename` syncs the
//! directories on both sides, `sync_dir` reports its failure), and [`PowerLoss`], a fault layer
//! for tests that records which entries were synced and, on [`PowerLoss::crash`], discards
//! every entry that was not. Must never: write file contents (callers write and fsync their
//! own files; only the simulation reads a file it is about to replace or remove, to undo it),
//! or retry a failed directory fsync (the caller treats it as fatal).

use std::fmt;
use std::fs::{self, File, OpenOptions};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use parking_lot::Mutex;

use crate::storage::{RealFs, Storage, StorageFile};

/// How directory entries are changed and made durable: the real file system, optionally
/// watched by a [`PowerLoss`] simulation.
///
/// Cheap to clone. [`Durability::default`] is the real file system alone.
///
/// [`Durability::on`] puts every operation on another [`Storage`] backend instead (the
/// in-memory [`crate::MemDisk`] of the whole-cluster simulator): the log, its metadata and
/// snapshots written through [`Durability::create`] then live there.
#[derive(Clone, Default)]
pub struct Durability {
    sim: Option<Arc<PowerLoss>>,
    storage: Option<Arc<dyn Storage>>,
}

impl fmt::Debug for Durability {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(if self.storage.is_some() {
            "Durability(simulated storage)"
        } else if self.sim.is_some() {
            "Durability(simulated power loss)"
        } else {
            "Durability"
        })
    }
}

/// The directory holding `path` (`.` for a bare relative name).
fn parent_of(path: &Path) -> PathBuf {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

impl Durability {
    /// The real file system, no simulation. Same as [`Durability::default`].
    #[must_use]
    pub fn new() -> Durability {
        Durability::default()
    }

    /// The real file system, with every entry change recorded in `sim` so that
    /// [`PowerLoss::crash`] can discard the ones never synced.
    #[must_use]
    pub fn simulated(sim: &Arc<PowerLoss>) -> Durability {
        Durability {
            sim: Some(Arc::clone(sim)),
            storage: None,
        }
    }

    /// Every operation goes to `storage` instead of the real file system (no [`PowerLoss`]
    /// recording: the backend simulates what it wants).
    #[must_use]
    pub fn on(storage: Arc<dyn Storage>) -> Durability {
        Durability {
            sim: None,
            storage: Some(storage),
        }
    }

    /// True when operations reach the real file system.
    #[must_use]
    pub fn is_real(&self) -> bool {
        self.storage.as_ref().is_none_or(|s| s.is_real())
    }

    fn backend(&self) -> &dyn Storage {
        match &self.storage {
            Some(s) => s.as_ref(),
            None => &RealFs,
        }
    }

    /// Creates (or truncates) `path` for reading and writing on this seam's backend, like
    /// [`Durability::create_file`] (the entry is not durable until its directory is synced).
    pub fn create(&self, path: &Path) -> io::Result<Box<dyn StorageFile>> {
        if self.storage.is_some() {
            return self.backend().create(path);
        }
        Ok(Box::new(self.create_file(path)?))
    }

    /// Opens the existing file `path` for reading and writing; `NotFound` if missing.
    pub fn open(&self, path: &Path) -> io::Result<Box<dyn StorageFile>> {
        self.backend().open(path)
    }

    /// Reads the whole file `path`; `NotFound` if missing.
    pub fn read(&self, path: &Path) -> io::Result<Vec<u8>> {
        self.backend().read(path)
    }

    /// Names of the entries of `dir`.
    pub fn list(&self, dir: &Path) -> io::Result<Vec<String>> {
        self.backend().list(dir)
    }

    /// True when `path` names an existing file or directory.
    #[must_use]
    pub fn exists(&self, path: &Path) -> bool {
        self.backend().exists(path)
    }

    /// Creates `dir` and every missing ancestor, and makes them durable: the parent of each
    /// directory it creates is fsynced, and so is the parent of `dir` even when `dir` already
    /// existed (an earlier process may have created it and died before syncing).
    ///
    /// Fails with the first I/O error; a directory fsync failure is not retried.
    pub fn create_dir_all(&self, dir: &Path) -> io::Result<()> {
        if let Some(st) = &self.storage {
            return create_dir_all_on(st.as_ref(), dir);
        }
        let mut missing = Vec::new();
        let mut cur = dir.to_path_buf();
        loop {
            match fs::metadata(&cur) {
                Ok(m) if m.is_dir() => break,
                Ok(_) => {
                    return Err(io::Error::new(
                        io::ErrorKind::NotADirectory,
                        format!("{} exists and is not a directory", cur.display()),
                    ))
                }
                Err(e) if e.kind() == io::ErrorKind::NotFound => {
                    let parent = parent_of(&cur);
                    if parent == cur {
                        return Err(e);
                    }
                    missing.push(cur);
                    cur = parent;
                }
                Err(e) => return Err(e),
            }
        }
        for d in missing.iter().rev() {
            match fs::create_dir(d) {
                Ok(()) => self.record(Op::CreateDir(d.clone())),
                // Someone else created it in between: it still needs its parent synced.
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists && d.is_dir() => {}
                Err(e) => return Err(e),
            }
        }
        // Innermost first, so that a directory's own entries are durable before the entry
        // naming it is.
        for d in &missing {
            self.sync_dir(&parent_of(d))?;
        }
        if missing.is_empty() {
            self.sync_dir(&parent_of(dir))?;
        }
        Ok(())
    }

    /// Creates (or truncates) `path` for reading and writing. The new entry is *not* durable
    /// until its directory is synced: write the file, fsync it, then [`Durability::rename`]
    /// it into place or [`Durability::sync_dir`] its directory.
    ///
    /// Fails with `Unsupported` on a seam made with [`Durability::on`] (use
    /// [`Durability::create`]).
    pub fn create_file(&self, path: &Path) -> io::Result<File> {
        if self.storage.is_some() {
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                "create_file on simulated storage: use Durability::create",
            ));
        }
        let existed = self.sim.is_some() && path.exists();
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(path)?;
        if self.sim.is_some() && !existed {
            self.record(Op::CreateFile(path.to_path_buf()));
        }
        Ok(file)
    }

    /// Renames `from` to `to` (replacing `to` atomically) and makes the rename durable by
    /// fsyncing the directory of `to`, and that of `from` when it differs.
    ///
    /// Fails with the first I/O error; the rename may then or may not survive a crash.
    pub fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        if let Some(st) = &self.storage {
            st.rename(from, to)?;
            let (to_dir, from_dir) = (parent_of(to), parent_of(from));
            st.sync_dir(&to_dir)?;
            if from_dir != to_dir {
                st.sync_dir(&from_dir)?;
            }
            return Ok(());
        }
        let displaced = match &self.sim {
            Some(_) => match fs::read(to) {
                Ok(bytes) => Some(bytes),
                Err(e) if e.kind() == io::ErrorKind::NotFound => None,
                Err(e) => return Err(e),
            },
            None => None,
        };
        fs::rename(from, to)?;
        self.record(Op::Rename {
            from: from.to_path_buf(),
            to: to.to_path_buf(),
            displaced,
        });
        let (to_dir, from_dir) = (parent_of(to), parent_of(from));
        self.sync_dir(&to_dir)?;
        if from_dir != to_dir {
            self.sync_dir(&from_dir)?;
        }
        Ok(())
    }

    /// Removes the file `path`. The removal is *not* durable until its directory is synced
    /// (remove several, then [`Durability::sync_dir`] once).
    pub fn remove_file(&self, path: &Path) -> io::Result<()> {
        if let Some(st) = &self.storage {
            return st.remove(path);
        }
        let content = match &self.sim {
            Some(_) => Some(fs::read(path)?),
            None => None,
        };
        fs::remove_file(path)?;
        if let Some(content) = content {
            self.record(Op::Remove {
                path: path.to_path_buf(),
                content,
            });
        }
        Ok(())
    }

    /// Fsyncs the directory `dir`, making every entry created, renamed or removed in it so far
    /// durable. Its failure must be treated as fatal by the caller: after a failed fsync the
    /// state of the directory on disk is unknown, and a retry that succeeds proves nothing.
    pub fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        if let Some(st) = &self.storage {
            return st.sync_dir(dir);
        }
        if let Some(sim) = &self.sim {
            if sim.state.lock().fail_dir_syncs {
                return Err(io::Error::from_raw_os_error(libc::EIO));
            }
        }
        File::open(dir)?.sync_all()?;
        if let Some(sim) = &self.sim {
            sim.synced(dir);
        }
        Ok(())
    }

    fn record(&self, op: Op) {
        if let Some(sim) = &self.sim {
            sim.record(op);
        }
    }
}

/// [`Durability::create_dir_all`] on a non-default backend: the same order of creations and
/// syncs as on the real file system.
fn create_dir_all_on(st: &dyn Storage, dir: &Path) -> io::Result<()> {
    let mut missing = Vec::new();
    let mut cur = dir.to_path_buf();
    while !st.is_dir(&cur) {
        if st.exists(&cur) {
            return Err(io::Error::new(
                io::ErrorKind::NotADirectory,
                format!("{} exists and is not a directory", cur.display()),
            ));
        }
        let parent = parent_of(&cur);
        if parent == cur {
            break;
        }
        missing.push(cur);
        cur = parent;
    }
    for d in missing.iter().rev() {
        match st.create_dir(d) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists && st.is_dir(d) => {}
            Err(e) => return Err(e),
        }
    }
    for d in &missing {
        st.sync_dir(&parent_of(d))?;
    }
    if missing.is_empty() {
        st.sync_dir(&parent_of(dir))?;
    }
    Ok(())
}

/// A change to a directory entry, with what is needed to undo it.
#[derive(Debug)]
enum Op {
    CreateDir(PathBuf),
    CreateFile(PathBuf),
    Rename {
        from: PathBuf,
        to: PathBuf,
        /// The contents of the file `to` named before, if any.
        displaced: Option<Vec<u8>>,
    },
    Remove {
        path: PathBuf,
        content: Vec<u8>,
    },
}

impl Op {
    /// The directories whose fsync makes this change durable.
    fn dirs(&self) -> Vec<PathBuf> {
        match self {
            Op::CreateDir(p) | Op::CreateFile(p) | Op::Remove { path: p, .. } => {
                vec![abs(&parent_of(p))]
            }
            Op::Rename { from, to, .. } => {
                let (a, b) = (abs(&parent_of(from)), abs(&parent_of(to)));
                if a == b {
                    vec![a]
                } else {
                    vec![a, b]
                }
            }
        }
    }

    /// Reverts the change on disk, as a power loss would have.
    fn undo(&self) -> io::Result<()> {
        let gone = |r: io::Result<()>| match r {
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            r => r,
        };
        match self {
            Op::CreateDir(d) => gone(fs::remove_dir_all(d)),
            Op::CreateFile(p) => gone(fs::remove_file(p)),
            Op::Rename {
                from,
                to,
                displaced,
            } => {
                gone(fs::rename(to, from))?;
                match displaced {
                    Some(bytes) => fs::write(to, bytes),
                    None => Ok(()),
                }
            }
            Op::Remove { path, content } => fs::write(path, content),
        }
    }
}

fn abs(p: &Path) -> PathBuf {
    std::path::absolute(p).unwrap_or_else(|_| p.to_path_buf())
}

/// A power-loss simulation for tests: remembers every directory-entry change made through a
/// [`Durability::simulated`] seam until the directories holding it are fsynced, and on
/// [`PowerLoss::crash`] reverts those never synced, newest first, as a file system that loses
/// unsynced directory entries would.
///
/// Only entries are simulated: file contents written and fsynced by the caller stay. Undo
/// data (removed or replaced files) is kept in memory, so use it with small files.
#[derive(Debug, Default)]
pub struct PowerLoss {
    state: Mutex<SimState>,
}

#[derive(Debug, Default)]
struct SimState {
    /// Changes not yet durable, oldest first, each with the directories still to be synced.
    pending: Vec<(Op, Vec<PathBuf>)>,
    /// Every directory fsync fails with EIO while set.
    fail_dir_syncs: bool,
    /// Directory fsyncs that succeeded.
    dir_syncs: u64,
}

impl PowerLoss {
    /// A simulation with nothing recorded yet.
    #[must_use]
    pub fn new() -> Arc<PowerLoss> {
        Arc::new(PowerLoss::default())
    }

    /// The changes that a crash now would discard, described one per line.
    #[must_use]
    pub fn unsynced(&self) -> Vec<String> {
        self.state
            .lock()
            .pending
            .iter()
            .map(|(op, _)| format!("{op:?}"))
            .collect()
    }

    /// Directory fsyncs that succeeded so far.
    #[must_use]
    pub fn dir_syncs(&self) -> u64 {
        self.state.lock().dir_syncs
    }

    /// While `on`, every directory fsync through the seam fails with EIO (and syncs nothing).
    pub fn fail_dir_syncs(&self, on: bool) {
        self.state.lock().fail_dir_syncs = on;
    }

    /// Power loss: reverts every change whose directory was not fsynced since, newest first,
    /// and forgets them. Returns what was discarded. Stop every writer first.
    ///
    /// Fails if the file system refuses to revert a change.
    pub fn crash(&self) -> io::Result<Vec<String>> {
        let pending = std::mem::take(&mut self.state.lock().pending);
        let mut dropped = Vec::with_capacity(pending.len());
        for (op, _) in pending.into_iter().rev() {
            op.undo()?;
            dropped.push(format!("{op:?}"));
        }
        Ok(dropped)
    }

    fn record(&self, op: Op) {
        let dirs = op.dirs();
        self.state.lock().pending.push((op, dirs));
    }

    fn synced(&self, dir: &Path) {
        let dir = abs(dir);
        let mut st = self.state.lock();
        st.dir_syncs += 1;
        for (_, dirs) in &mut st.pending {
            dirs.retain(|d| *d != dir);
        }
        st.pending.retain(|(_, dirs)| !dirs.is_empty());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unsynced_entries_vanish_and_synced_ones_stay() {
        let root = tempfile::tempdir().unwrap();
        let sim = PowerLoss::new();
        let d = Durability::simulated(&sim);
        let a = root.path().join("a");
        // Created without a parent sync: lost.
        fs::create_dir(&a).unwrap();
        d.record(Op::CreateDir(a.clone()));
        let f = a.join("f");
        d.create_file(&f).unwrap();
        d.sync_dir(&a).unwrap();
        assert_eq!(sim.unsynced().len(), 1, "{:?}", sim.unsynced());
        sim.crash().unwrap();
        assert!(!a.exists());

        // Created durably: stays, with a file renamed into it.
        let b = root.path().join("b").join("c");
        d.create_dir_all(&b).unwrap();
        let tmp = b.join("x.tmp");
        fs::write(&tmp, b"new").unwrap();
        fs::write(b.join("x"), b"old").unwrap();
        d.rename(&tmp, &b.join("x")).unwrap();
        assert!(sim.unsynced().is_empty(), "{:?}", sim.unsynced());
        d.rename(&b.join("x"), &b.join("y")).unwrap();
        let gone = b.join("gone");
        d.create_file(&gone).unwrap();
        d.remove_file(&b.join("y")).unwrap();
        sim.crash().unwrap();
        assert!(!gone.exists());
        assert_eq!(fs::read(b.join("y")).unwrap(), b"new");
        assert!(!b.join("x").exists());
    }

    #[test]
    fn a_failed_directory_sync_is_reported() {
        let root = tempfile::tempdir().unwrap();
        let sim = PowerLoss::new();
        let d = Durability::simulated(&sim);
        sim.fail_dir_syncs(true);
        let err = d.create_dir_all(&root.path().join("x")).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::EIO));
        sim.crash().unwrap();
        assert!(!root.path().join("x").exists());
    }
}
