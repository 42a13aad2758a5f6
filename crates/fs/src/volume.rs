//! One volume: a directory tree whose changes are made by transactions.
//!
//! Owns each transaction's private view of the volume (its branch: new and
//! rewritten files staged in `.weft-fs/stage/<tid>/`, range writes to
//! existing files kept as extents of a redo file, names removed), the
//! volume's lock table, the prepare step that turns a branch into a
//! [`Plan`] (the redo the node's log makes durable) and the idempotent
//! application of a plan at commit and at recovery.
//! Must never change a committed file before its transaction commits, follow
//! a path out of the volume, or leave a staging directory behind once its
//! transaction's outcome is applied.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::fs::{self, File, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use parking_lot::Mutex;
use weft_wire::{SubPath, Tid, Xid};

use weft_log::Log;

use crate::api::{
    DirEntry, FileKind, FsError, FsRecord, Meta, Patch, Place, Plan, ReadMode, FS_RECORD_TAG,
};
use crate::lock::{Locks, Mode};
use crate::path::{VPath, RESERVED};

/// Bounds and knobs of one volume.
#[derive(Clone, Debug)]
pub struct VolumeLimits {
    /// Longest wait for a lock before LockConflict (0: fail at once).
    pub lock_wait: Duration,
    /// Largest single read, in bytes.
    pub max_read: u64,
    /// Most bytes one transaction may stage on this volume.
    pub max_staged_bytes: u64,
    /// Most names one transaction may change on this volume.
    pub max_changes: usize,
    /// Most paths locked at once.
    pub max_locked: usize,
    /// Most lock requests waiting at once.
    pub max_lock_waiters: usize,
    /// Staged data up to this many bytes per transaction travels inside the
    /// prepare record (one log force covers it); larger is fsynced in the
    /// staging area at prepare.
    pub max_inline_bytes: u64,
    /// Bytes that must stay free on the volume's file system after a
    /// commit's growth; prepare votes No otherwise.
    pub reserve_bytes: u64,
}

impl Default for VolumeLimits {
    fn default() -> Self {
        VolumeLimits {
            lock_wait: Duration::from_secs(1),
            max_read: 16 << 20,
            max_staged_bytes: 64 << 30,
            max_changes: 100_000,
            max_locked: 1 << 20,
            max_lock_waiters: 65_536,
            max_inline_bytes: 4 << 20,
            reserve_bytes: 16 << 20,
        }
    }
}

/// Chunk size of streaming copies.
const CHUNK: usize = 1 << 20;

/// A file in a transaction's view.
#[derive(Clone, Debug)]
enum FileNode {
    /// The whole content is the staging file `n<id>`.
    Staged { id: u64, len: u64 },
    /// A committed file (`base`, maybe renamed) with range writes.
    Patched {
        base: VPath,
        base_len: u64,
        min_len: u64,
        len: u64,
        /// Redo data file `r<id>` and its length.
        rid: Option<u64>,
        rlen: u64,
        /// start -> (len, offset in the redo file), non-overlapping.
        extents: BTreeMap<u64, (u64, u64)>,
    },
}

impl FileNode {
    fn len(&self) -> u64 {
        match self {
            FileNode::Staged { len, .. } | FileNode::Patched { len, .. } => *len,
        }
    }
}

#[derive(Clone, Debug)]
enum Node {
    Dir,
    File(FileNode),
    /// A symbolic link made (or moved) by the transaction, to this target.
    Link(String),
}

#[derive(Debug, PartialEq, Eq)]
enum BranchState {
    Active,
    Prepared,
}

/// A transaction's changes to this volume.
#[derive(Debug)]
struct Branch {
    stage: PathBuf,
    stage_made: bool,
    next_id: u64,
    entries: BTreeMap<VPath, Node>,
    removed: BTreeSet<VPath>,
    staged_bytes: u64,
    open: HashMap<VPath, u32>,
    /// The sub-transaction whose operation runs now (top for the
    /// transaction itself).
    cur: SubPath,
    /// For each sub-transaction that changed names here: the state each
    /// name it touched had before it first did, to put back if it aborts.
    undo: BTreeMap<SubPath, BTreeMap<VPath, Saved>>,
    state: BranchState,
    /// Set once prepared: the plan and its record's position.
    plan: Option<(Plan, u64)>,
    /// Commit is applying the plan.
    applying: bool,
    /// Rebuilt from the log after a restart: staging copies of inline data
    /// may have been lost with the machine, so commit rewrites them.
    recovered: bool,
}

/// How a name was in a branch before a sub-transaction changed it.
#[derive(Clone, Debug, Default)]
struct Saved {
    node: Option<Node>,
    removed: bool,
}

/// What a name is in a view.
#[derive(Clone, Debug)]
enum Seen {
    Absent,
    Dir,
    File(FileNode),
    /// A committed file untouched by the transaction.
    Committed(u64),
    /// A symbolic link made or moved by the transaction.
    NewLink(String),
    Symlink,
    Other,
}

/// Counters of a volume.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct VolumeStats {
    /// Transactions with a branch here (active or prepared).
    pub branches: usize,
    /// Of which prepared.
    pub prepared: usize,
    /// Paths locked now.
    pub locked_paths: usize,
}

/// A transactional directory tree. Cheap to clone.
#[derive(Clone)]
pub struct Volume {
    inner: Arc<VolInner>,
}

struct VolInner {
    name: String,
    root: PathBuf,
    stage_root: PathBuf,
    limits: VolumeLimits,
    locks: Locks,
    branches: Mutex<HashMap<Tid, Arc<Mutex<Branch>>>>,
    /// Bumped each time a branch ends here (aborted, or committed and its
    /// apply finished or given up), so a waiter can watch for the state it
    /// needs instead of polling ([`Volume::ended_branches`]).
    ended: tokio::sync::watch::Sender<u64>,
}

fn io_err(what: impl std::fmt::Display) -> impl FnOnce(std::io::Error) -> FsError {
    move |e| FsError::io(what, &e)
}

/// The file in the reserved directory that holds the name the volume is
/// served under, so a program given only a directory (`weft run --fs DIR`)
/// can find which volume holds it.
pub const NAME_FILE: &str = "name";

/// Records `name` in `root/.weft-fs/name` when it differs (written to a
/// temporary file and renamed over, so a reader sees the old or the new
/// name whole). Advisory: not forced, since nothing transactional depends on
/// it; a name lost at a power loss is written again at the next open.
fn record_name(root: &Path, name: &str) -> Result<(), FsError> {
    let path = root.join(RESERVED).join(NAME_FILE);
    if fs::read_to_string(&path).ok().as_deref() == Some(name) {
        return Ok(());
    }
    let tmp = root.join(RESERVED).join(".name.tmp");
    fs::write(&tmp, name).map_err(io_err(tmp.display()))?;
    fs::rename(&tmp, &path).map_err(io_err(path.display()))
}

impl Volume {
    /// Opens the directory `dir` as volume `name` (creating its reserved
    /// `.weft-fs/stage` area). Staging directories left by a crash are
    /// cleaned by the node's recovery, not here.
    ///
    /// Fails with NotFound/NotADirectory when `dir` is not a directory, Io
    /// when the reserved area cannot be made.
    pub fn open(name: &str, dir: &Path, limits: VolumeLimits) -> Result<Volume, FsError> {
        let root = fs::canonicalize(dir).map_err(io_err(dir.display()))?;
        if !root.is_dir() {
            return Err(FsError::NotADirectory(root.display().to_string()));
        }
        let stage_root = root.join(RESERVED).join("stage");
        fs::create_dir_all(&stage_root).map_err(io_err(stage_root.display()))?;
        record_name(&root, name)?;
        Ok(Volume {
            inner: Arc::new(VolInner {
                name: name.to_string(),
                root,
                stage_root,
                locks: Locks::new(limits.max_locked, limits.max_lock_waiters),
                limits,
                branches: Mutex::new(HashMap::new()),
                ended: tokio::sync::watch::Sender::new(0),
            }),
        })
    }

    /// A receiver that changes each time a branch ends here: aborted
    /// (locks released, staging removed) or committed (applied, locks
    /// released, staging removed once the Applied record is durable; or
    /// left for recovery when applying kept failing). Read the state you
    /// wait for ([`Volume::stats`]) after marking the receiver seen, then
    /// await its next change.
    pub fn ended_branches(&self) -> tokio::sync::watch::Receiver<u64> {
        self.inner.ended.subscribe()
    }

    fn branch_ended(&self) {
        self.inner.ended.send_modify(|n| *n += 1);
    }

    /// The volume's name.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// The volume's root directory (canonical).
    pub fn root(&self) -> &Path {
        &self.inner.root
    }

    /// The volume's limits.
    pub fn limits(&self) -> &VolumeLimits {
        &self.inner.limits
    }

    /// Counters.
    pub fn stats(&self) -> VolumeStats {
        let b = self.inner.branches.lock();
        VolumeStats {
            branches: b.len(),
            prepared: b
                .values()
                .filter(|x| x.lock().state == BranchState::Prepared)
                .count(),
            locked_paths: self.inner.locks.len(),
        }
    }

    // ---- paths on disk -------------------------------------------------

    /// The on-disk path of `p`, refusing symbolic links on the way: one
    /// pointing outside the volume is an Escape, one inside is Unsupported
    /// (a second name for a file would bypass its lock). The last component
    /// is never followed.
    fn disk(&self, p: &VPath) -> Result<PathBuf, FsError> {
        Ok(self.walk(p)?.0)
    }

    /// Like [`Volume::disk`], also saying whether `p`'s parent is a
    /// directory on disk (the walk lstats every parent component anyway):
    /// when it is not, nothing committed is at `p` either, which spares the
    /// callers that create a name a `stat` of the parent and of the name.
    fn walk(&self, p: &VPath) -> Result<(PathBuf, bool), FsError> {
        let mut at = self.inner.root.clone();
        let mut parent_on_disk = true;
        let parts: Vec<&str> = if p.is_root() {
            Vec::new()
        } else {
            p.as_str().split('/').collect()
        };
        for (i, c) in parts.iter().enumerate() {
            at.push(c);
            if i + 1 == parts.len() {
                break;
            }
            match fs::symlink_metadata(&at) {
                Ok(m) if m.file_type().is_symlink() => {
                    let inside = fs::canonicalize(&at)
                        .map(|t| t.starts_with(&self.inner.root))
                        .unwrap_or(false);
                    return Err(if inside {
                        FsError::Unsupported(format!(
                            "{p}: goes through the symbolic link {}",
                            parts[..=i].join("/")
                        ))
                    } else {
                        FsError::Escape(format!(
                            "{p}: the symbolic link {} points outside the volume",
                            parts[..=i].join("/")
                        ))
                    });
                }
                Ok(m) if m.is_dir() => {}
                // Missing, or a file (or other) on the way: nothing below
                // it exists.
                _ => {
                    parent_on_disk = false;
                    at = self.inner.root.join(p.as_str());
                    break;
                }
            }
        }
        Ok((at, parent_on_disk))
    }

    /// Parses a client's name and refuses one that leaves the volume.
    fn name_of(&self, s: &str) -> Result<VPath, FsError> {
        let p = VPath::parse_name(s)?;
        self.disk(&p)?;
        Ok(p)
    }

    fn committed(&self, p: &VPath) -> Result<Seen, FsError> {
        if p.is_root() {
            return Ok(Seen::Dir);
        }
        let d = self.disk(p)?;
        match fs::symlink_metadata(&d) {
            Ok(m) => Ok(if m.is_dir() {
                Seen::Dir
            } else if m.is_file() {
                Seen::Committed(m.len())
            } else if m.file_type().is_symlink() {
                Seen::Symlink
            } else {
                Seen::Other
            }),
            Err(e) if matches!(e.raw_os_error(), Some(libc::ENOENT) | Some(libc::ENOTDIR)) => {
                Ok(Seen::Absent)
            }
            Err(e) => Err(FsError::io(p, &e)),
        }
    }

    /// The branch entry that moves the file or link `p` (as the transaction
    /// sees it, `seen`) under a new name: a file of the transaction as it is,
    /// a committed file as a patch over its committed bytes, a link as a new
    /// link to the same target (never followed). Callers handle the other
    /// kinds themselves; given one, this fails with Unsupported.
    fn moved_node(&self, p: &VPath, seen: Seen) -> Result<Node, FsError> {
        Ok(match seen {
            Seen::File(n) => Node::File(n),
            Seen::Committed(len) => Node::File(FileNode::Patched {
                base: p.clone(),
                base_len: len,
                min_len: len,
                len,
                rid: None,
                rlen: 0,
                extents: BTreeMap::new(),
            }),
            Seen::NewLink(target) => Node::Link(target),
            Seen::Symlink => {
                let target = fs::read_link(self.disk(p)?).map_err(io_err(p))?;
                Node::Link(target.to_string_lossy().to_string())
            }
            Seen::Absent | Seen::Dir | Seen::Other => {
                return Err(FsError::Unsupported(format!("{p}: not a file or a link")))
            }
        })
    }

    fn seen(&self, b: Option<&Branch>, p: &VPath) -> Result<Seen, FsError> {
        if let Some(b) = b {
            match b.entries.get(p) {
                Some(Node::Dir) => return Ok(Seen::Dir),
                Some(Node::File(f)) => return Ok(Seen::File(f.clone())),
                Some(Node::Link(t)) => return Ok(Seen::NewLink(t.clone())),
                None => {}
            }
            if b.removed.contains(p) {
                return Ok(Seen::Absent);
            }
        }
        self.committed(p)
    }

    // ---- branches --------------------------------------------------------

    fn branch(&self, tid: Tid) -> Arc<Mutex<Branch>> {
        let mut all = self.inner.branches.lock();
        all.entry(tid)
            .or_insert_with(|| {
                Arc::new(Mutex::new(Branch {
                    stage: self.inner.stage_root.join(tid.to_string()),
                    stage_made: false,
                    next_id: 0,
                    entries: BTreeMap::new(),
                    removed: BTreeSet::new(),
                    staged_bytes: 0,
                    open: HashMap::new(),
                    cur: SubPath::top(),
                    undo: BTreeMap::new(),
                    state: BranchState::Active,
                    plan: None,
                    applying: false,
                    recovered: false,
                }))
            })
            .clone()
    }

    fn existing_branch(&self, tid: Tid) -> Option<Arc<Mutex<Branch>>> {
        self.inner.branches.lock().get(&tid).cloned()
    }

    async fn lock(&self, tid: Tid, p: &VPath, mode: Mode) -> Result<(), FsError> {
        self.inner
            .locks
            .lock(tid, p, mode, self.inner.limits.lock_wait)
            .await
    }

    /// Locks an entry for writing: exclusive on the name, shared on its
    /// directory (so the directory cannot be removed under it; listing
    /// takes no lock: degree 1 for directories).
    async fn lock_entry(&self, tid: Tid, p: &VPath) -> Result<(), FsError> {
        if !p.parent().is_root() {
            self.lock(tid, &p.parent(), Mode::Shared).await?;
        }
        self.lock(tid, p, Mode::Exclusive).await
    }

    /// Runs `f` on the active branch of `xid` (created on first use).
    fn with_branch<T>(
        &self,
        xid: &Xid,
        f: impl FnOnce(&Volume, &mut Branch) -> Result<T, FsError>,
    ) -> Result<T, FsError> {
        let b = self.branch(xid.tid);
        let mut b = b.lock();
        if b.state != BranchState::Active {
            return Err(FsError::NotActive(format!(
                "{}: prepared on volume {}",
                xid.tid, self.inner.name
            )));
        }
        b.cur = xid.path.clone();
        f(self, &mut b)
    }

    fn new_id(b: &mut Branch) -> u64 {
        b.next_id += 1;
        b.next_id
    }

    fn ensure_stage(b: &mut Branch) -> Result<(), FsError> {
        if !b.stage_made {
            fs::create_dir_all(&b.stage).map_err(io_err(b.stage.display()))?;
            b.stage_made = true;
        }
        Ok(())
    }

    fn charge(&self, b: &mut Branch, bytes: u64) -> Result<(), FsError> {
        let total = b.staged_bytes.saturating_add(bytes);
        if total > self.inner.limits.max_staged_bytes {
            return Err(FsError::TooLarge(format!(
                "{total} bytes staged on volume {} (at most {})",
                self.inner.name, self.inner.limits.max_staged_bytes
            )));
        }
        b.staged_bytes = total;
        Ok(())
    }

    fn check_changes(&self, b: &Branch) -> Result<(), FsError> {
        if b.entries.len() + b.removed.len() >= self.inner.limits.max_changes {
            return Err(FsError::TooLarge(format!(
                "{} names changed on volume {} (at most {})",
                b.entries.len() + b.removed.len(),
                self.inner.name,
                self.inner.limits.max_changes
            )));
        }
        Ok(())
    }

    fn parent_is_dir(&self, b: &Branch, p: &VPath) -> Result<(), FsError> {
        match self.seen(Some(b), &p.parent())? {
            Seen::Dir => Ok(()),
            Seen::Absent => Err(FsError::NotFound(p.parent().to_string())),
            _ => Err(FsError::NotADirectory(p.parent().to_string())),
        }
    }

    /// The file node to change for a write at `p`: the branch's, or a
    /// patch over the committed file.
    fn writable(&self, b: &Branch, p: &VPath) -> Result<FileNode, FsError> {
        match self.seen(Some(b), p)? {
            Seen::File(f) => Ok(f),
            Seen::Committed(len) => Ok(FileNode::Patched {
                base: p.clone(),
                base_len: len,
                min_len: len,
                len,
                rid: None,
                rlen: 0,
                extents: BTreeMap::new(),
            }),
            Seen::Absent => Err(FsError::NotFound(p.to_string())),
            Seen::Dir => Err(FsError::IsADirectory(p.to_string())),
            Seen::Symlink | Seen::NewLink(_) | Seen::Other => {
                Err(FsError::Unsupported(format!("{p}: not a regular file")))
            }
        }
    }

    // ---- operations ------------------------------------------------------

    /// Creates an empty file at `path` (or empties an existing one, unless
    /// `exclusive`), visible to the transaction only until it commits.
    ///
    /// Fails with Escape/BadPath for a bad path, NotFound/NotADirectory when
    /// its directory is missing, AlreadyExists (exclusive), IsADirectory,
    /// LockConflict, TooLarge past a bound, NotActive once prepared, Io or
    /// NoSpace from the disk.
    pub async fn create(&self, xid: &Xid, path: &str, exclusive: bool) -> Result<(), FsError> {
        let p = self.name_of(path)?;
        self.lock_entry(xid.tid, &p).await?;
        let (_, parent_on_disk) = self.walk(&p)?;
        self.with_branch(xid, |v, b| {
            let id = v.new_name(b, &p, parent_on_disk, exclusive)?;
            let f = b.stage.join(format!("n{id}"));
            File::create(&f).map_err(io_err(&p))?;
            b.entries
                .insert(p.clone(), Node::File(FileNode::Staged { id, len: 0 }));
            Ok(())
        })
    }

    /// The checks and bookkeeping of making `p` a new file (created or
    /// replaced), under its write lock: returns the staging id its content
    /// goes to (the branch's own file's, else a new one), the caller writes
    /// it and records the node. `parent_on_disk` is [`Volume::walk`]'s,
    /// taken under the lock (no one else can add or remove `p` or its
    /// parent then): when the branch leaves the parent alone and it is a
    /// directory on disk, it needs no `stat`; when it is not on disk,
    /// nothing committed is at `p`.
    fn new_name(
        &self,
        b: &mut Branch,
        p: &VPath,
        parent_on_disk: bool,
        exclusive: bool,
    ) -> Result<u64, FsError> {
        let parent = p.parent();
        let branch_knows = |q: &VPath| b.entries.contains_key(q) || b.removed.contains(q);
        if !parent_on_disk || branch_knows(&parent) {
            self.parent_is_dir(b, p)?;
        }
        let seen = if !parent_on_disk && !branch_knows(p) {
            Seen::Absent
        } else {
            self.seen(Some(b), p)?
        };
        match seen {
            Seen::Dir => return Err(FsError::IsADirectory(p.to_string())),
            Seen::Absent => {}
            _ if exclusive => return Err(FsError::AlreadyExists(p.to_string())),
            _ => {}
        }
        self.check_changes(b)?;
        Self::ensure_stage(b)?;
        self.note(b, p)?;
        Ok(match b.entries.get(p) {
            Some(Node::File(FileNode::Staged { id, .. })) => *id,
            _ => Self::new_id(b),
        })
    }

    /// Writes `data` at `offset` of the file `path` (which must exist in the
    /// transaction's view). A committed file is not copied: the bytes go to
    /// the transaction's redo file and are written in place at commit.
    ///
    /// Fails like [`Volume::create`], and with NotFound when the file does
    /// not exist, Unsupported for a symbolic link or special file.
    pub async fn write(
        &self,
        xid: &Xid,
        path: &str,
        offset: u64,
        data: &[u8],
    ) -> Result<(), FsError> {
        let p = self.name_of(path)?;
        self.lock(xid.tid, &p, Mode::Exclusive).await?;
        self.with_branch(xid, |v, b| v.write_locked(b, &p, offset, data))
    }

    fn write_locked(
        &self,
        b: &mut Branch,
        p: &VPath,
        offset: u64,
        data: &[u8],
    ) -> Result<(), FsError> {
        self.note(b, p)?;
        let mut node = self.writable(b, p)?;
        let end = offset
            .checked_add(data.len() as u64)
            .ok_or_else(|| FsError::TooLarge(format!("{p}: offset {offset} overflows")))?;
        if !b.entries.contains_key(p) {
            self.check_changes(b)?;
        }
        self.charge(b, data.len() as u64)?;
        Self::ensure_stage(b)?;
        match &mut node {
            FileNode::Staged { id, len } => {
                let f = OpenOptions::new()
                    .write(true)
                    .open(b.stage.join(format!("n{id}")))
                    .map_err(io_err(p))?;
                f.write_all_at(data, offset).map_err(io_err(p))?;
                *len = (*len).max(end);
            }
            FileNode::Patched {
                len,
                rid,
                rlen,
                extents,
                ..
            } => {
                let id = match rid {
                    Some(id) => *id,
                    None => {
                        b.next_id += 1;
                        *rid = Some(b.next_id);
                        b.next_id
                    }
                };
                let f = OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(b.stage.join(format!("r{id}")))
                    .map_err(io_err(p))?;
                (&f).write_all(data).map_err(io_err(p))?;
                insert_extent(extents, offset, data.len() as u64, *rlen);
                *rlen += data.len() as u64;
                *len = (*len).max(end);
            }
        }
        b.entries.insert(p.clone(), Node::File(node));
        Ok(())
    }

    /// Sets the length of the file `path` (zeros when it grows).
    ///
    /// Fails like [`Volume::write`].
    pub async fn truncate(&self, xid: &Xid, path: &str, len: u64) -> Result<(), FsError> {
        let p = self.name_of(path)?;
        self.lock(xid.tid, &p, Mode::Exclusive).await?;
        self.with_branch(xid, |v, b| {
            v.note(b, &p)?;
            let mut node = v.writable(b, &p)?;
            if !b.entries.contains_key(&p) {
                v.check_changes(b)?;
            }
            match &mut node {
                FileNode::Staged { id, len: l } => {
                    let f = OpenOptions::new()
                        .write(true)
                        .open(b.stage.join(format!("n{id}")))
                        .map_err(io_err(&p))?;
                    f.set_len(len).map_err(io_err(&p))?;
                    *l = len;
                }
                FileNode::Patched {
                    min_len,
                    len: l,
                    extents,
                    ..
                } => {
                    *l = len;
                    *min_len = (*min_len).min(len);
                    clip_extents(extents, len);
                }
            }
            b.entries.insert(p.clone(), Node::File(node));
            Ok(())
        })
    }

    /// Deletes the file `path`.
    ///
    /// Fails with NotFound, IsADirectory (use rmdir), and like
    /// [`Volume::create`].
    pub async fn delete(&self, xid: &Xid, path: &str) -> Result<(), FsError> {
        let p = self.name_of(path)?;
        self.lock_entry(xid.tid, &p).await?;
        self.with_branch(xid, |v, b| {
            match v.seen(Some(b), &p)? {
                Seen::Absent => return Err(FsError::NotFound(p.to_string())),
                Seen::Dir => return Err(FsError::IsADirectory(p.to_string())),
                _ => {}
            }
            v.check_changes(b)?;
            v.note(b, &p)?;
            if let Some(Node::File(FileNode::Staged { id, .. })) = b.entries.remove(&p) {
                let _ = fs::remove_file(b.stage.join(format!("n{id}")));
            }
            v.remove_committed(b, &p)?;
            Ok(())
        })
    }

    /// Marks the committed name `p` as gone (if there is one).
    fn remove_committed(&self, b: &mut Branch, p: &VPath) -> Result<(), FsError> {
        if !matches!(self.committed(p)?, Seen::Absent) {
            b.removed.insert(p.clone());
        }
        Ok(())
    }

    /// Renames the file or directory `from` to `to` (also across
    /// directories). A file replaces a file at `to`; a directory replaces
    /// nothing but an empty directory, and takes everything in it along
    /// (see [`Volume::rename_dir`]).
    ///
    /// Fails with NotFound (no `from`, or no directory for `to`),
    /// IsADirectory when a file would replace a directory, and like
    /// [`Volume::create`] and [`Volume::rename_dir`].
    pub async fn rename(&self, xid: &Xid, from: &str, to: &str) -> Result<(), FsError> {
        let f = self.name_of(from)?;
        let t = self.name_of(to)?;
        if f != t {
            let b = self.existing_branch(xid.tid);
            let is_dir = matches!(
                self.seen(b.as_ref().map(|b| b.lock()).as_deref(), &f)?,
                Seen::Dir
            );
            if is_dir {
                return self.rename_dir(xid, f, t).await;
            }
        }
        if f == t {
            // Renaming a file onto itself changes nothing, if it exists.
            self.lock(xid.tid, &f, Mode::Shared).await?;
            return match self.seen(
                self.existing_branch(xid.tid)
                    .as_ref()
                    .map(|b| b.lock())
                    .as_deref(),
                &f,
            )? {
                Seen::Absent => Err(FsError::NotFound(f.to_string())),
                _ => Ok(()),
            };
        }
        // A fixed order, so two renames of the same pair wait, not cross.
        let (a, z) = if f < t { (&f, &t) } else { (&t, &f) };
        self.lock_entry(xid.tid, a).await?;
        self.lock_entry(xid.tid, z).await?;
        self.with_branch(xid, |v, b| {
            v.note(b, &f)?;
            v.note(b, &t)?;
            let node = match v.seen(Some(b), &f)? {
                Seen::Absent => return Err(FsError::NotFound(f.to_string())),
                Seen::Dir => {
                    // Made a directory by another call of this transaction
                    // since the check above.
                    return Err(FsError::Unsupported(format!(
                        "{f}: became a directory while being renamed"
                    )));
                }
                seen @ (Seen::File(_) | Seen::Committed(_) | Seen::NewLink(_) | Seen::Symlink) => {
                    v.moved_node(&f, seen)?
                }
                Seen::Other => {
                    return Err(FsError::Unsupported(format!("{f}: not a regular file")))
                }
            };
            v.parent_is_dir(b, &t)?;
            if let Seen::Dir = v.seen(Some(b), &t)? {
                return Err(FsError::IsADirectory(t.to_string()));
            }
            v.check_changes(b)?;
            b.entries.remove(&f);
            v.remove_committed(b, &f)?;
            if let Some(Node::File(FileNode::Staged { id, .. })) = b.entries.remove(&t) {
                let _ = fs::remove_file(b.stage.join(format!("n{id}")));
            }
            if let Node::File(FileNode::Patched { base, .. }) = &node {
                if *base == t {
                    b.removed.remove(&t);
                }
            }
            b.entries.insert(t.clone(), node);
            Ok(())
        })
    }

    /// Renames the directory `f` to `t` with everything in it (the
    /// transaction's view of it: committed entries and its own changes).
    /// Each entry moves like a renamed file (a committed file goes through
    /// the staging area by rename, never copied; a directory is made under
    /// the new name and removed under the old), so the plan holds only
    /// steps the commit and recovery already replay idempotently; the cost
    /// is one step per entry. Locks: the old and new names, every directory
    /// below exclusively (so no entry can appear in them meanwhile) and
    /// every file below.
    ///
    /// Fails with BadPath when `t` is inside `f`, AlreadyExists when `t` is
    /// a directory that is not empty, NotADirectory when `t` is something
    /// else, Unsupported when an entry below cannot be moved (a special
    /// file, a name that is not UTF-8), and like [`Volume::create`].
    async fn rename_dir(&self, xid: &Xid, f: VPath, t: VPath) -> Result<(), FsError> {
        if t.is_within(&f) {
            return Err(FsError::BadPath(format!(
                "{t}: cannot move the directory {f} inside itself"
            )));
        }
        let (a, z) = if f < t { (&f, &t) } else { (&t, &f) };
        self.lock_entry(xid.tid, a).await?;
        self.lock_entry(xid.tid, z).await?;
        // Lock the tree, directories before what is in them.
        let mut stack = vec![f.clone()];
        while let Some(d) = stack.pop() {
            self.lock(xid.tid, &d, Mode::Exclusive).await?;
            let children = {
                let b = self.existing_branch(xid.tid);
                let g = b.as_ref().map(|b| b.lock());
                self.tree_entries(g.as_deref(), &d)?
            };
            for (name, kind) in children {
                let c = d.join(&name);
                if kind == FileKind::Dir {
                    stack.push(c);
                } else {
                    self.lock(xid.tid, &c, Mode::Exclusive).await?;
                }
            }
        }
        self.with_branch(xid, |v, b| {
            if !matches!(v.seen(Some(b), &f)?, Seen::Dir) {
                return Err(FsError::NotFound(f.to_string()));
            }
            v.parent_is_dir(b, &t)?;
            match v.seen(Some(b), &t)? {
                Seen::Absent => {}
                Seen::Dir => {
                    if !v.list_in(Some(b), &t)?.is_empty() {
                        return Err(FsError::AlreadyExists(format!(
                            "{t}: a directory that is not empty"
                        )));
                    }
                    v.note(b, &t)?;
                    b.entries.remove(&t);
                    v.remove_committed(b, &t)?;
                }
                _ => return Err(FsError::NotADirectory(t.to_string())),
            }
            // Everything to move, parents first (all of it is locked).
            let mut all = vec![(f.clone(), FileKind::Dir)];
            let mut i = 0;
            while i < all.len() {
                let (d, k) = all[i].clone();
                if k == FileKind::Dir {
                    for (name, kind) in v.tree_entries(Some(b), &d)? {
                        all.push((d.join(&name), kind));
                    }
                }
                i += 1;
            }
            if b.entries.len() + b.removed.len() + 2 * all.len() > v.inner.limits.max_changes {
                return Err(FsError::TooLarge(format!(
                    "renaming {f} changes {} names (at most {} per transaction)",
                    2 * all.len(),
                    v.inner.limits.max_changes
                )));
            }
            let moved = |p: &VPath| {
                let rest = &p.as_str()[f.as_str().len()..];
                VPath::parse(&format!("{}{rest}", t.as_str()))
            };
            for (old, kind) in &all {
                let new = moved(old)?;
                v.note(b, old)?;
                v.note(b, &new)?;
                let node = match v.seen(Some(b), old)? {
                    Seen::Dir => Node::Dir,
                    seen @ (Seen::File(_)
                    | Seen::Committed(_)
                    | Seen::NewLink(_)
                    | Seen::Symlink) => v.moved_node(old, seen)?,
                    Seen::Absent | Seen::Other => {
                        return Err(FsError::Unsupported(format!(
                            "{old}: a {kind:?} that cannot be moved"
                        )))
                    }
                };
                b.entries.remove(old);
                v.remove_committed(b, old)?;
                // Moved back where it came from: the committed directory or
                // file is the same one again, not a removal and a remake.
                let back = match &node {
                    Node::Dir => matches!(v.committed(&new)?, Seen::Dir),
                    Node::File(FileNode::Patched { base, .. }) => *base == new,
                    _ => false,
                };
                if back {
                    b.removed.remove(&new);
                }
                b.entries.insert(new, node);
            }
            Ok(())
        })
    }

    /// The entries of the directory `d` in a view, with their kinds, for a
    /// directory rename: fails with Unsupported when the directory on disk
    /// holds something no view shows (a name that is not UTF-8) or that
    /// cannot be moved (a special file), since removing the old directory
    /// at commit would then fail.
    fn tree_entries(
        &self,
        b: Option<&Branch>,
        d: &VPath,
    ) -> Result<Vec<(String, FileKind)>, FsError> {
        if let Ok(rd) = fs::read_dir(self.disk(d)?) {
            for e in rd.flatten() {
                if e.file_name().to_str().is_none() {
                    return Err(FsError::Unsupported(format!(
                        "{d}: holds a name that is not UTF-8"
                    )));
                }
            }
        }
        let mut out = Vec::new();
        for e in self.list_in(b, d)? {
            if e.meta.kind == FileKind::Other {
                return Err(FsError::Unsupported(format!(
                    "{d}/{}: a special file cannot be moved",
                    e.name
                )));
            }
            out.push((e.name, e.meta.kind));
        }
        Ok(out)
    }

    /// Creates the symbolic link `path` pointing to `target` (stored as
    /// given; weft itself never follows it).
    ///
    /// Fails with AlreadyExists, NotFound/NotADirectory for its directory,
    /// BadPath for an empty or NUL-holding target or one past 4 KiB, and
    /// like [`Volume::create`].
    pub async fn symlink(&self, xid: &Xid, path: &str, target: &str) -> Result<(), FsError> {
        let p = self.name_of(path)?;
        if target.is_empty() || target.contains('\0') || target.len() > crate::path::MAX_PATH {
            return Err(FsError::BadPath(format!("{p}: bad link target {target:?}")));
        }
        self.lock_entry(xid.tid, &p).await?;
        self.with_branch(xid, |v, b| {
            v.parent_is_dir(b, &p)?;
            if !matches!(v.seen(Some(b), &p)?, Seen::Absent) {
                return Err(FsError::AlreadyExists(p.to_string()));
            }
            v.check_changes(b)?;
            v.note(b, &p)?;
            b.entries.insert(p.clone(), Node::Link(target.to_string()));
            Ok(())
        })
    }

    /// Creates the directory `path`.
    ///
    /// Fails with AlreadyExists, NotFound/NotADirectory for its parent, and
    /// like [`Volume::create`].
    pub async fn mkdir(&self, xid: &Xid, path: &str) -> Result<(), FsError> {
        let p = self.name_of(path)?;
        self.lock_entry(xid.tid, &p).await?;
        self.with_branch(xid, |v, b| {
            v.parent_is_dir(b, &p)?;
            if !matches!(v.seen(Some(b), &p)?, Seen::Absent) {
                return Err(FsError::AlreadyExists(p.to_string()));
            }
            v.check_changes(b)?;
            v.note(b, &p)?;
            b.entries.insert(p.clone(), Node::Dir);
            Ok(())
        })
    }

    /// Removes the empty directory `path`.
    ///
    /// Fails with NotFound, NotADirectory, DirectoryNotEmpty, and like
    /// [`Volume::create`].
    pub async fn rmdir(&self, xid: &Xid, path: &str) -> Result<(), FsError> {
        let p = self.name_of(path)?;
        self.lock_entry(xid.tid, &p).await?;
        self.with_branch(xid, |v, b| {
            match v.seen(Some(b), &p)? {
                Seen::Dir => {}
                Seen::Absent => return Err(FsError::NotFound(p.to_string())),
                _ => return Err(FsError::NotADirectory(p.to_string())),
            }
            if !v.list_in(Some(b), &p)?.is_empty() {
                return Err(FsError::DirectoryNotEmpty(p.to_string()));
            }
            v.check_changes(b)?;
            v.note(b, &p)?;
            b.entries.remove(&p);
            v.remove_committed(b, &p)?;
            Ok(())
        })
    }

    /// Describes `path` in the transaction's view, or None when absent.
    ///
    /// Fails with Escape/BadPath, LockConflict (unless `NoLock`), Io.
    pub async fn stat(
        &self,
        xid: &Xid,
        path: &str,
        mode: ReadMode,
    ) -> Result<Option<Meta>, FsError> {
        let p = VPath::parse(path)?;
        self.disk(&p)?;
        self.read_locked(xid, &p, mode, |v, b| Ok(meta_of(&v.seen(b, &p)?)))
            .await
    }

    /// Lists the directory `path` ("" for the root) in the transaction's
    /// view, sorted by name. Takes no locks (degree 1 for directories).
    ///
    /// Fails with NotFound, NotADirectory, Escape/BadPath, Io.
    pub async fn list(&self, xid: &Xid, path: &str) -> Result<Vec<DirEntry>, FsError> {
        let p = VPath::parse(path)?;
        self.disk(&p)?;
        let b = self.existing_branch(xid.tid);
        let guard = b.as_ref().map(|b| b.lock());
        match self.seen(guard.as_deref(), &p)? {
            Seen::Dir => {}
            Seen::Absent => return Err(FsError::NotFound(p.to_string())),
            _ => return Err(FsError::NotADirectory(p.to_string())),
        }
        self.list_in(guard.as_deref(), &p)
    }

    fn list_in(&self, b: Option<&Branch>, dir: &VPath) -> Result<Vec<DirEntry>, FsError> {
        let mut out: BTreeMap<String, Meta> = BTreeMap::new();
        let committed_dir = match b {
            Some(b) => {
                !b.removed.contains(dir)
                    && !matches!(b.entries.get(dir), Some(Node::Dir) if !matches!(self.committed(dir), Ok(Seen::Dir)))
            }
            None => true,
        };
        if committed_dir {
            let d = self.disk(dir)?;
            match fs::read_dir(&d) {
                Ok(rd) => {
                    for e in rd {
                        let e = e.map_err(io_err(dir))?;
                        let Some(name) = e.file_name().to_str().map(str::to_string) else {
                            continue; // not UTF-8: not addressable through this API
                        };
                        if dir.is_root() && name == RESERVED {
                            continue;
                        }
                        let child = dir.join(&name);
                        if b.is_some_and(|b| b.removed.contains(&child)) {
                            continue;
                        }
                        if let Some(m) = meta_of(&self.committed(&child)?) {
                            out.insert(name, m);
                        }
                    }
                }
                Err(e) if matches!(e.raw_os_error(), Some(libc::ENOENT) | Some(libc::ENOTDIR)) => {}
                Err(e) => return Err(FsError::io(dir, &e)),
            }
        }
        if let Some(b) = b {
            let depth = dir.depth() + 1;
            for (k, n) in b.entries.range(dir.clone()..) {
                if !k.is_within(dir) {
                    if dir.is_root() {
                        continue;
                    }
                    break;
                }
                if k.depth() != depth {
                    continue;
                }
                let m = match n {
                    Node::Dir => Meta {
                        kind: FileKind::Dir,
                        len: 0,
                        changed: true,
                    },
                    Node::File(f) => Meta {
                        kind: FileKind::File,
                        len: f.len(),
                        changed: true,
                    },
                    Node::Link(t) => Meta {
                        kind: FileKind::Symlink,
                        len: t.len() as u64,
                        changed: true,
                    },
                };
                out.insert(k.name().to_string(), m);
            }
        }
        Ok(out
            .into_iter()
            .map(|(name, meta)| DirEntry { name, meta })
            .collect())
    }

    /// Reads up to `len` bytes at `offset` of the file `path`, in the
    /// transaction's view (shorter at end of file).
    ///
    /// Fails with NotFound, IsADirectory, Unsupported (not a regular file),
    /// TooLarge past the read limit, LockConflict (unless `NoLock`), Io.
    pub async fn read(
        &self,
        xid: &Xid,
        path: &str,
        offset: u64,
        len: u64,
        mode: ReadMode,
    ) -> Result<Bytes, FsError> {
        if len > self.inner.limits.max_read {
            return Err(FsError::TooLarge(format!(
                "a read of {len} bytes (at most {})",
                self.inner.limits.max_read
            )));
        }
        let p = self.name_of(path)?;
        self.read_locked(xid, &p, mode, |v, b| v.read_in(b, &p, offset, len))
            .await
    }

    /// Runs a read under the lock `mode` asks for.
    async fn read_locked<T>(
        &self,
        xid: &Xid,
        p: &VPath,
        mode: ReadMode,
        f: impl FnOnce(&Volume, Option<&Branch>) -> Result<T, FsError>,
    ) -> Result<T, FsError> {
        if mode != ReadMode::NoLock {
            self.lock(xid.tid, p, Mode::Shared).await?;
        }
        let result = {
            let b = self.existing_branch(xid.tid);
            let guard = b.as_ref().map(|b| b.lock());
            f(self, guard.as_deref())
        };
        if mode == ReadMode::Degree2 {
            self.inner.locks.unlock_shared(xid.tid, p);
        }
        result
    }

    fn read_in(
        &self,
        b: Option<&Branch>,
        p: &VPath,
        offset: u64,
        len: u64,
    ) -> Result<Bytes, FsError> {
        match self.seen(b, p)? {
            Seen::Committed(_) => {
                let f = open_nofollow(&self.disk(p)?).map_err(io_err(p))?;
                let size = f.metadata().map_err(io_err(p))?.len();
                let n = len.min(size.saturating_sub(offset)) as usize;
                let mut buf = vec![0u8; n];
                read_full_at(&f, &mut buf, offset).map_err(io_err(p))?;
                Ok(Bytes::from(buf))
            }
            Seen::File(FileNode::Staged { id, len: size }) => {
                let b = b.expect("a staged file has a branch");
                let f = File::open(b.stage.join(format!("n{id}"))).map_err(io_err(p))?;
                let n = len.min(size.saturating_sub(offset)) as usize;
                let mut buf = vec![0u8; n];
                read_full_at(&f, &mut buf, offset).map_err(io_err(p))?;
                Ok(Bytes::from(buf))
            }
            Seen::File(FileNode::Patched {
                base,
                min_len,
                len: size,
                rid,
                extents,
                ..
            }) => {
                let b = b.expect("a patched file has a branch");
                let n = len.min(size.saturating_sub(offset)) as usize;
                let mut buf = vec![0u8; n];
                let end = offset + n as u64;
                // Committed bytes below min_len.
                let from_base = min_len.min(end).saturating_sub(offset) as usize;
                if from_base > 0 {
                    let f = open_nofollow(&self.disk(&base)?).map_err(io_err(&base))?;
                    read_full_at(&f, &mut buf[..from_base], offset).map_err(io_err(&base))?;
                }
                if let Some(rid) = rid {
                    let r = File::open(b.stage.join(format!("r{rid}"))).map_err(io_err(p))?;
                    for (s, (l, roff)) in overlapping(&extents, offset, end) {
                        let lo = s.max(offset);
                        let hi = (s + l).min(end);
                        let dst = &mut buf[(lo - offset) as usize..(hi - offset) as usize];
                        read_full_at(&r, dst, roff + (lo - s)).map_err(io_err(p))?;
                    }
                }
                Ok(Bytes::from(buf))
            }
            Seen::Absent => Err(FsError::NotFound(p.to_string())),
            Seen::Dir => Err(FsError::IsADirectory(p.to_string())),
            Seen::Symlink | Seen::NewLink(_) | Seen::Other => {
                Err(FsError::Unsupported(format!("{p}: not a regular file")))
            }
        }
    }

    /// Takes a read lock on `path` held until [`Volume::close_file`] (or the end
    /// of the transaction): degree 2 across several reads.
    ///
    /// Fails with LockConflict, Escape/BadPath, TooLarge past the lock
    /// table's bound.
    pub async fn open_file(&self, xid: &Xid, path: &str) -> Result<(), FsError> {
        let p = self.name_of(path)?;
        self.lock(xid.tid, &p, Mode::Shared).await?;
        let b = self.branch(xid.tid);
        *b.lock().open.entry(p).or_insert(0) += 1;
        Ok(())
    }

    /// Releases one [`Volume::open_file`] of `path`. Closing what is not open
    /// does nothing.
    ///
    /// Fails with Escape/BadPath.
    pub fn close_file(&self, xid: &Xid, path: &str) -> Result<(), FsError> {
        let p = self.name_of(path)?;
        if let Some(b) = self.existing_branch(xid.tid) {
            let mut b = b.lock();
            if let Some(n) = b.open.get_mut(&p) {
                *n -= 1;
                if *n == 0 {
                    b.open.remove(&p);
                }
                self.inner.locks.unlock_shared(xid.tid, &p);
            }
        }
        Ok(())
    }

    // ---- streaming (local) -----------------------------------------------

    /// Writes everything `reader` yields into `path` from `offset`, in
    /// bounded chunks (a large file never sits in memory).
    /// Returns the number of bytes written.
    ///
    /// Fails like [`Volume::write`], and with Io when `reader` fails.
    pub async fn write_from(
        &self,
        xid: &Xid,
        path: &str,
        mut offset: u64,
        reader: &mut (dyn Read + Send),
    ) -> Result<u64, FsError> {
        let p = self.name_of(path)?;
        self.lock(xid.tid, &p, Mode::Exclusive).await?;
        let mut buf = vec![0u8; CHUNK];
        let mut total = 0u64;
        loop {
            let n = read_some(reader, &mut buf).map_err(io_err(format!("{p}: source")))?;
            if n == 0 {
                return Ok(total);
            }
            self.with_branch(xid, |v, b| v.write_locked(b, &p, offset, &buf[..n]))?;
            offset += n as u64;
            total += n as u64;
        }
    }

    /// Makes `path` a copy of the local file `source` (created or replaced),
    /// copied by the kernel into the staging area: no copy in memory.
    /// Returns the number of bytes.
    ///
    /// Fails like [`Volume::create`], and with NotFound/Io when `source`
    /// cannot be read.
    pub async fn put_file(&self, xid: &Xid, path: &str, source: &Path) -> Result<u64, FsError> {
        let mut src = File::open(source).map_err(io_err(source.display()))?;
        let size = src.metadata().map_err(io_err(source.display()))?.len();
        self.create(xid, path, false).await?;
        // Checked by `create`.
        let p = VPath::parse_name(path)?;
        self.with_branch(xid, |v, b| {
            v.charge(b, size)?;
            let Some(Node::File(FileNode::Staged { id, .. })) = b.entries.get(&p).cloned() else {
                return Err(FsError::Io(format!("{p}: created file not staged")));
            };
            let mut dst = OpenOptions::new()
                .write(true)
                .truncate(true)
                .open(b.stage.join(format!("n{id}")))
                .map_err(io_err(&p))?;
            let n = std::io::copy(&mut src, &mut dst).map_err(io_err(&p))?;
            b.entries
                .insert(p.clone(), Node::File(FileNode::Staged { id, len: n }));
            Ok(n)
        })
    }

    /// Makes `path` hold exactly `data` (created or replaced whole), with
    /// one walk of its path under its write lock (a `create` and a `write`
    /// in one, for small files).
    ///
    /// Fails like [`Volume::create`].
    pub async fn put_bytes(&self, xid: &Xid, path: &str, data: &[u8]) -> Result<(), FsError> {
        let p = VPath::parse_name(path)?;
        self.lock_entry(xid.tid, &p).await?;
        let (_, parent_on_disk) = self.walk(&p)?;
        self.with_branch(xid, |v, b| {
            let id = v.new_name(b, &p, parent_on_disk, false)?;
            v.charge(b, data.len() as u64)?;
            let f = b.stage.join(format!("n{id}"));
            fs::write(&f, data).map_err(io_err(&p))?;
            b.entries.insert(
                p.clone(),
                Node::File(FileNode::Staged {
                    id,
                    len: data.len() as u64,
                }),
            );
            Ok(())
        })
    }

    /// Makes `path` hold the local file `source` (created or replaced) by
    /// moving `source` into the staging area: a rename when it is on the
    /// volume's file system (nothing copied), a copy otherwise. `source` is
    /// gone afterwards (`weft run` hands over the files of its scratch
    /// area this way). Returns the number of bytes.
    ///
    /// Fails like [`Volume::put_file`], and with Unsupported when `source`
    /// is not a regular file.
    pub async fn take_file(&self, xid: &Xid, path: &str, source: &Path) -> Result<u64, FsError> {
        let meta = fs::symlink_metadata(source).map_err(io_err(source.display()))?;
        if !meta.is_file() {
            return Err(FsError::Unsupported(format!(
                "{}: not a regular file",
                source.display()
            )));
        }
        let size = meta.len();
        let p = VPath::parse_name(path)?;
        self.lock_entry(xid.tid, &p).await?;
        // Under the lock, so what it says about `p` stays true; one walk
        // serves the escape check, the parent and the name (most of the
        // cost of taking a small file was `stat`ing them again).
        let (_, parent_on_disk) = self.walk(&p)?;
        self.with_branch(xid, |v, b| {
            let id = v.new_name(b, &p, parent_on_disk, false)?;
            v.charge(b, size)?;
            // Renamed over the branch's older content of `p`, if any: no
            // empty file is made first.
            let dst = b.stage.join(format!("n{id}"));
            let n = match fs::rename(source, &dst) {
                Ok(()) => size,
                Err(e) if e.raw_os_error() == Some(libc::EXDEV) => {
                    let n = fs::copy(source, &dst).map_err(io_err(&p))?;
                    let _ = fs::remove_file(source);
                    n
                }
                Err(e) => return Err(FsError::io(&p, &e)),
            };
            b.entries
                .insert(p.clone(), Node::File(FileNode::Staged { id, len: n }));
            Ok(n)
        })
    }

    /// Streams the file `path` (transaction's view) into `out`, in bounded
    /// chunks, under one read lock of `mode`. Returns the number of bytes.
    ///
    /// Fails like [`Volume::read`], and with Io when `out` fails.
    pub async fn read_to(
        &self,
        xid: &Xid,
        path: &str,
        mode: ReadMode,
        out: &mut (dyn Write + Send),
    ) -> Result<u64, FsError> {
        let p = self.name_of(path)?;
        self.read_locked(xid, &p, mode, |v, b| {
            let mut off = 0u64;
            loop {
                let chunk = v.read_in(b, &p, off, CHUNK as u64)?;
                if chunk.is_empty() {
                    return Ok(off);
                }
                out.write_all(&chunk)
                    .map_err(io_err(format!("{p}: destination")))?;
                off += chunk.len() as u64;
            }
        })
        .await
    }

    // ---- two-phase commit ----------------------------------------------

    /// Phase one: builds the branch's plan, makes its staged data durable
    /// (or inline), checks space. Returns ReadOnly (everything released),
    /// or the plan when ready (the caller logs it and reports the
    /// record's position with [`Volume::prepared_at`]).
    ///
    /// Fails with the reason to vote No (the branch is then dropped).
    pub(crate) fn prepare(&self, tid: Tid) -> Result<Prepared, String> {
        let Some(b) = self.existing_branch(tid) else {
            self.inner.locks.release_all(tid);
            return Ok(Prepared::ReadOnly);
        };
        let mut b = b.lock();
        if b.state == BranchState::Prepared {
            // Asked again (a repeated prepare): the plan is logged already.
            return Ok(Prepared::Already);
        }
        if b.entries.is_empty() && b.removed.is_empty() {
            drop(b);
            self.drop_branch(tid);
            return Ok(Prepared::ReadOnly);
        }
        b.state = BranchState::Prepared;
        let started = std::time::Instant::now();
        let planned = self.plan(&b);
        tracing::debug!(%tid, volume = %self.inner.name, ms = started.elapsed().as_secs_f64() * 1e3, "fs: prepared");
        match planned {
            Ok(plan) => {
                self.inner.locks.release_shared(tid);
                b.open.clear();
                Ok(Prepared::Plan(plan))
            }
            Err(e) => {
                drop(b);
                self.drop_branch(tid);
                Err(format!("fs volume {}: {e}", self.inner.name))
            }
        }
    }

    /// Notes where the branch's prepare record is (for checkpoints).
    pub(crate) fn prepared_at(&self, tid: Tid, plan: Plan, lsn: u64) {
        if let Some(b) = self.existing_branch(tid) {
            b.lock().plan = Some((plan, lsn));
        }
    }

    fn plan(&self, b: &Branch) -> Result<Plan, FsError> {
        let mut plan = Plan::default();
        let mut bases = BTreeSet::new();
        // Inline only when all of it fits: a transaction larger than that
        // forces its data in the staging area once, where part of it inline
        // would be written twice (in the log, then forced in its file).
        let staged: u64 = b
            .entries
            .values()
            .map(|n| match n {
                Node::File(FileNode::Staged { len, .. }) => *len,
                Node::File(FileNode::Patched { rlen, .. }) => *rlen,
                _ => 0,
            })
            .sum();
        let mut inline_left = if staged <= self.inner.limits.max_inline_bytes {
            self.inner.limits.max_inline_bytes
        } else {
            0
        };
        let mut to_sync: Vec<PathBuf> = Vec::new();
        let mut growth = 0u64;
        let mut next = b.next_id;
        for (p, n) in &b.entries {
            match n {
                Node::Dir => plan.mkdirs.push(p.as_str().to_string()),
                Node::Link(t) => plan.links.push((p.as_str().to_string(), t.clone())),
                Node::File(FileNode::Staged { id, len }) => {
                    let name = format!("n{id}");
                    let file = b.stage.join(&name);
                    let inline = if *len <= inline_left {
                        inline_left -= len;
                        Some(Bytes::from(fs::read(&file).map_err(io_err(p))?))
                    } else {
                        to_sync.push(file);
                        None
                    };
                    growth += len;
                    plan.places.push(Place {
                        path: p.as_str().to_string(),
                        staged: name,
                        inline,
                    });
                }
                Node::File(FileNode::Patched {
                    base,
                    base_len,
                    min_len,
                    len,
                    rid,
                    rlen,
                    extents,
                }) => {
                    if base != p {
                        next += 1;
                        bases.insert(base.clone());
                        plan.moves.push((base.as_str().to_string(), next));
                        plan.places.push(Place {
                            path: p.as_str().to_string(),
                            staged: format!("m{next}"),
                            inline: None,
                        });
                    }
                    let changed = !extents.is_empty() || min_len != base_len || len != base_len;
                    if changed {
                        growth += len.saturating_sub(*base_len);
                        let (data, inline) = match rid {
                            None => (String::new(), Some(Bytes::new())),
                            Some(rid) if *rlen <= inline_left => {
                                inline_left -= rlen;
                                let d =
                                    fs::read(b.stage.join(format!("r{rid}"))).map_err(io_err(p))?;
                                (String::new(), Some(Bytes::from(d)))
                            }
                            Some(rid) => {
                                let name = format!("r{rid}");
                                to_sync.push(b.stage.join(&name));
                                (name, None)
                            }
                        };
                        plan.patches.push(Patch {
                            path: p.as_str().to_string(),
                            min_len: *min_len,
                            len: *len,
                            data,
                            inline,
                            extents: extents.iter().map(|(s, (l, r))| (*s, *l, *r)).collect(),
                        });
                    }
                }
            }
        }
        let mut rmdirs = Vec::new();
        for r in &b.removed {
            if bases.contains(r) {
                continue;
            }
            match self.committed(r)? {
                Seen::Dir => rmdirs.push(r.clone()),
                Seen::Absent => {}
                _ => plan.unlinks.push(r.as_str().to_string()),
            }
        }
        rmdirs.sort_by_key(|d| std::cmp::Reverse(d.depth()));
        plan.rmdirs = rmdirs.into_iter().map(|d| d.as_str().to_string()).collect();
        // Space: what commit adds must fit, with the reserve left over.
        let free = free_bytes(&self.inner.root).map_err(io_err("statvfs"))?;
        let need = growth.saturating_add(self.inner.limits.reserve_bytes);
        if free < need {
            return Err(FsError::NoSpace(format!(
                "commit needs {growth} bytes plus a reserve of {}; {free} free",
                self.inner.limits.reserve_bytes
            )));
        }
        // Data too large for the record is forced in the staging area, with
        // the names that find it; inline data needs nothing on disk (the
        // record, forced by the transaction manager, carries it).
        if !to_sync.is_empty() {
            let marker = self.inner.root.join(RESERVED).join(FORCE_MARK);
            force_all(
                &to_sync,
                [b.stage.as_path(), self.inner.stage_root.as_path()],
                &marker,
            )
            .map_err(io_err(b.stage.display()))?;
        }
        Ok(plan)
    }

    /// Phase two, commit, first half: applies the prepared plan so that
    /// every change is visible under its public name (phase A, forced when
    /// it removed anything, then phase B: renames in, in-place patches; no
    /// forces). The branch keeps its locks. Retries on I/O errors (the
    /// outcome is final) a few times, then leaves the branch for recovery,
    /// logs the error and returns None. Finish with [`Volume::finish`].
    pub(crate) fn publish(&self, tid: Tid, hook: Option<&CommitHook>) -> Option<Published> {
        let Some(b) = self.existing_branch(tid) else {
            self.inner.locks.release_all(tid);
            return None;
        };
        let (plan, stage, recovered) = {
            let mut b = b.lock();
            if b.applying {
                return None; // a repeated commit: the first one applies
            }
            b.applying = true;
            match &b.plan {
                Some((plan, _)) => (plan.clone(), b.stage.clone(), b.recovered),
                None => {
                    // Not prepared here (one-phase end of an empty branch).
                    drop(b);
                    self.drop_branch(tid);
                    return None;
                }
            }
        };
        let mut tries = 0;
        let started = std::time::Instant::now();
        loop {
            match publish(&self.inner.root, &stage, &plan, recovered, hook) {
                Ok(to_force) => {
                    tracing::debug!(%tid, volume = %self.inner.name, ms = started.elapsed().as_secs_f64() * 1e3, "fs: published");
                    return Some(Published {
                        tid,
                        stage,
                        to_force,
                    });
                }
                Err(e) if tries < 3 => {
                    tries += 1;
                    tracing::warn!(%tid, volume = %self.inner.name, error = %e, "fs: applying a commit failed; retrying");
                    std::thread::sleep(Duration::from_millis(50 << tries));
                }
                Err(e) => {
                    tracing::error!(%tid, volume = %self.inner.name, error = %e, "fs: cannot apply a committed transaction; the next start retries it");
                    self.branch_ended();
                    return None;
                }
            }
        }
    }

    /// Phase two, second half: makes what [`Volume::publish`] did durable
    /// (every file and directory it changed, with as few journal commits as
    /// the file system allows), releases the locks, then logs that the plan
    /// is applied and removes the staging area once that record is
    /// durable. On repeated I/O errors leaves the branch for recovery.
    pub(crate) fn finish(&self, p: Published, hook: Option<&CommitHook>, log: Option<&Log>) {
        let tid = p.tid;
        let mut tries = 0;
        let started = std::time::Instant::now();
        loop {
            match p.to_force.force() {
                Ok(()) => break,
                Err(e) if tries < 3 => {
                    tries += 1;
                    tracing::warn!(%tid, volume = %self.inner.name, error = %e, "fs: forcing a commit failed; retrying");
                    std::thread::sleep(Duration::from_millis(50 << tries));
                }
                Err(e) => {
                    tracing::error!(%tid, volume = %self.inner.name, error = %e, "fs: cannot force a committed transaction; the next start applies it again");
                    self.branch_ended();
                    return;
                }
            }
        }
        tracing::debug!(%tid, volume = %self.inner.name, ms = started.elapsed().as_secs_f64() * 1e3, "fs: forced");
        if let Some(h) = hook {
            h("applied");
        }
        self.inner.branches.lock().remove(&tid);
        self.inner.locks.release_all(tid);
        self.applied(tid, &p.stage, log);
        self.branch_ended();
    }

    /// Records that `tid`'s plan is wholly applied here and, once that is
    /// durable, removes its staging area (until then recovery may need the
    /// phase-A mark in it).
    fn applied(&self, tid: Tid, stage: &Path, log: Option<&Log>) {
        let Some(log) = log else {
            return; // not attached: the next start cleans up
        };
        let rec = FsRecord::Applied {
            tid,
            volume: self.inner.name.clone(),
        };
        let logged = postcard::to_allocvec(&rec)
            .map_err(|e| e.to_string())
            .and_then(|b| log.append(FS_RECORD_TAG, &b).map_err(|e| e.to_string()))
            .and_then(|lsn| log.force_blocking(lsn).map_err(|e| e.to_string()));
        match logged {
            Ok(()) => {
                if let Err(e) = remove_stage(stage) {
                    tracing::warn!(%tid, error = %e, "fs: cannot remove a staging area");
                }
            }
            Err(e) => {
                tracing::warn!(%tid, error = %e, "fs: cannot log that a commit is applied; the next start applies it again")
            }
        }
    }

    /// Abort: forgets the branch, removes its staging area, releases locks.
    pub(crate) fn abort(&self, tid: Tid) {
        self.drop_branch(tid);
    }

    fn drop_branch(&self, tid: Tid) {
        let b = self.inner.branches.lock().remove(&tid);
        let stage = self.inner.stage_root.join(tid.to_string());
        if b.is_some() || stage.exists() {
            if let Err(e) = remove_stage(&stage) {
                tracing::warn!(%tid, error = %e, "fs: cannot remove a staging area");
            }
        }
        self.inner.locks.release_all(tid);
        self.branch_ended();
    }

    /// A sub-transaction ended. Committed: what it changed passes to its
    /// parent (the parent's undo keeps, for each name, the oldest state).
    /// Aborted: every name it (or a sub-transaction of it) changed here is
    /// put back as it was before, deepest first; the parent goes on and may
    /// still commit (QuickSilver's nested transactions). Locks stay with
    /// the transaction.
    pub(crate) fn sub_ended(&self, tid: Tid, path: &SubPath, committed: bool) {
        if path.is_top() {
            return;
        }
        let Some(b) = self.existing_branch(tid) else {
            return;
        };
        let mut b = b.lock();
        if committed {
            let Some(saved) = b.undo.remove(path) else {
                return;
            };
            match path.parent() {
                Some(parent) if !parent.is_top() => {
                    let into = b.undo.entry(parent).or_default();
                    for (p, s) in saved {
                        into.entry(p).or_insert(s);
                    }
                }
                _ => {} // passed to the transaction itself: nothing to undo
            }
            return;
        }
        let mut gone: Vec<SubPath> = b
            .undo
            .keys()
            .filter(|s| path.is_ancestor_or_self(s))
            .cloned()
            .collect();
        gone.sort_by_key(|s| std::cmp::Reverse(s.depth()));
        for s in gone {
            let saved = b.undo.remove(&s).unwrap_or_default();
            for (p, was) in saved {
                self.restore(&mut b, p, was);
            }
        }
    }

    /// Puts the name `p` back to the state `was` (an aborted
    /// sub-transaction's undo), dropping the staging data only the undone
    /// state used.
    fn restore(&self, b: &mut Branch, p: VPath, was: Saved) {
        if let Some(Node::File(FileNode::Staged { id, .. })) = b.entries.get(&p) {
            let keep =
                matches!(&was.node, Some(Node::File(FileNode::Staged { id: w, .. })) if w == id);
            if !keep {
                let _ = fs::remove_file(b.stage.join(format!("n{id}")));
            }
        }
        if let Some(Node::File(FileNode::Patched {
            rid: Some(rid),
            rlen,
            ..
        })) = &was.node
        {
            // Later writes went past `rlen` in the redo file: cut them off
            // (the next write appends where the restored extents end).
            let r = b.stage.join(format!("r{rid}"));
            if let Err(e) = OpenOptions::new()
                .write(true)
                .open(&r)
                .and_then(|f| f.set_len(*rlen))
            {
                tracing::warn!(path = %p, error = %e, "fs: cannot cut a redo file back");
            }
        }
        match was.node {
            Some(n) => {
                b.entries.insert(p.clone(), n);
            }
            None => {
                b.entries.remove(&p);
            }
        }
        if was.removed {
            b.removed.insert(p);
        } else {
            b.removed.remove(&p);
        }
    }

    /// Before the running sub-transaction changes `p` for the first time:
    /// records how `p` was, and gives a staged file a copy of its own to
    /// change (the recorded state keeps the old one). Nothing for the
    /// transaction itself.
    ///
    /// Fails with Io when the staged file cannot be copied.
    fn note(&self, b: &mut Branch, p: &VPath) -> Result<(), FsError> {
        if b.cur.is_top() || b.undo.get(&b.cur).is_some_and(|u| u.contains_key(p)) {
            return Ok(());
        }
        let was = Saved {
            node: b.entries.get(p).cloned(),
            removed: b.removed.contains(p),
        };
        if let Some(Node::File(FileNode::Staged { id, len })) = was.node.clone() {
            let new = Self::new_id(b);
            fs::copy(
                b.stage.join(format!("n{id}")),
                b.stage.join(format!("n{new}")),
            )
            .map_err(io_err(p))?;
            b.entries
                .insert(p.clone(), Node::File(FileNode::Staged { id: new, len }));
        }
        let cur = b.cur.clone();
        b.undo.entry(cur).or_default().insert(p.clone(), was);
        Ok(())
    }

    /// Lowest log position a prepared branch still needs.
    pub(crate) fn oldest_prepared(&self) -> Option<u64> {
        self.inner
            .branches
            .lock()
            .values()
            .filter_map(|b| b.lock().plan.as_ref().map(|(_, l)| *l))
            .min()
    }

    /// Transactions holding something here.
    pub(crate) fn held(&self) -> Vec<(Tid, String)> {
        let mut out: Vec<(Tid, String)> = self
            .inner
            .branches
            .lock()
            .iter()
            .map(|(t, b)| {
                let b = b.lock();
                (
                    *t,
                    format!(
                        "fs {}: {} change(s){}",
                        self.inner.name,
                        b.entries.len() + b.removed.len(),
                        if b.plan.is_some() { ", prepared" } else { "" }
                    ),
                )
            })
            .collect();
        for (t, n) in self.inner.locks.holders() {
            out.push((t, format!("fs {}: locks on {n} path(s)", self.inner.name)));
        }
        out
    }

    // ---- recovery ------------------------------------------------------

    /// Recovery: a branch whose commit is recorded and not recorded as
    /// applied is applied again (idempotent), then recorded as applied.
    ///
    /// Fails with the I/O error that stops the node from starting.
    pub(crate) fn redo(&self, tid: Tid, plan: &Plan, log: Option<&Log>) -> Result<(), FsError> {
        let stage = self.inner.stage_root.join(tid.to_string());
        apply(&self.inner.root, &stage, plan, true, None)?;
        self.applied(tid, &stage, log);
        Ok(())
    }

    /// Recovery: a branch prepared and in doubt is kept, locked, until its
    /// outcome arrives.
    ///
    /// Fails with LockConflict when two in-doubt branches claim a path (a
    /// corrupt log).
    pub(crate) fn keep_in_doubt(&self, tid: Tid, plan: Plan, lsn: u64) -> Result<(), FsError> {
        for p in plan_paths(&plan) {
            self.inner
                .locks
                .try_lock(tid, &VPath::parse(&p)?, Mode::Exclusive)?;
        }
        let b = self.branch(tid);
        let mut b = b.lock();
        b.state = BranchState::Prepared;
        b.stage_made = true;
        b.recovered = true;
        b.plan = Some((plan, lsn));
        Ok(())
    }

    /// Recovery, last: removes every staging area not kept for an in-doubt
    /// branch (orphans of transactions that never prepared or that ended).
    ///
    /// Fails with Io when the staging root cannot be read.
    pub(crate) fn clean_orphans(&self) -> Result<usize, FsError> {
        let keep: HashSet<String> = self
            .inner
            .branches
            .lock()
            .keys()
            .map(|t| t.to_string())
            .collect();
        let mut n = 0;
        for e in fs::read_dir(&self.inner.stage_root).map_err(io_err("staging area"))? {
            let e = e.map_err(io_err("staging area"))?;
            let name = e.file_name().to_string_lossy().to_string();
            if !keep.contains(&name) {
                remove_stage(&e.path()).map_err(io_err(e.path().display()))?;
                n += 1;
            }
        }
        if n > 0 {
            sync_dir(&self.inner.stage_root).map_err(io_err("staging area"))?;
        }
        Ok(n)
    }
}

/// What [`Volume::prepare`] found.
pub(crate) enum Prepared {
    /// Nothing changed here: everything is released.
    ReadOnly,
    /// Ready: log this plan.
    Plan(Plan),
    /// Prepared before (a repeated request): its plan is logged.
    Already,
}

/// A test hook called between commit's steps: `"after-phase-a"`,
/// `"mid-phase-b"`, `"applied"`; a test kills the process there.
pub type CommitHook = Arc<dyn Fn(&str) + Send + Sync>;

/// Every path a plan changes (locked again for an in-doubt branch).
fn plan_paths(plan: &Plan) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    out.extend(plan.moves.iter().map(|(p, _)| p.clone()));
    out.extend(plan.unlinks.iter().cloned());
    out.extend(plan.rmdirs.iter().cloned());
    out.extend(plan.mkdirs.iter().cloned());
    out.extend(plan.places.iter().map(|p| p.path.clone()));
    out.extend(plan.patches.iter().map(|p| p.path.clone()));
    out.extend(plan.links.iter().map(|(p, _)| p.clone()));
    out.sort();
    out.dedup();
    out
}

/// What [`Volume::publish`] did, for [`Volume::finish`] to force.
pub(crate) struct Published {
    tid: Tid,
    stage: PathBuf,
    to_force: ToForce,
}

/// Files and directories a published plan changed, not yet forced.
#[derive(Debug, Default)]
struct ToForce {
    files: Vec<PathBuf>,
    dirs: BTreeSet<PathBuf>,
    marker: PathBuf,
}

impl ToForce {
    fn force(&self) -> std::io::Result<()> {
        force_all(
            &self.files,
            self.dirs.iter().map(PathBuf::as_path),
            &self.marker,
        )
    }
}

/// Applies a plan and makes it durable (recovery): [`publish`] then a
/// force of everything it changed.
fn apply(
    root: &Path,
    stage: &Path,
    plan: &Plan,
    recovering: bool,
    hook: Option<&CommitHook>,
) -> Result<(), FsError> {
    publish(root, stage, plan, recovering, hook)?
        .force()
        .map_err(io_err("forcing a commit"))?;
    if let Some(h) = hook {
        h("applied");
    }
    Ok(())
}

/// Makes a plan visible (see docs/fs.md, "Commit"): phase A (removals),
/// forced when there is any, then phase B (names added, bytes written),
/// not forced: returns what to force. Idempotent: each step checks whether
/// it is done, and the `A` mark in the staging area says phase A (which
/// only removes names) is over, so a replay never removes a name phase B
/// put back; a plan that removes nothing needs no mark (its phase A is
/// empty, replaying it does nothing). `recovering`: inline data is written
/// again (after a crash the staging copies may be lost; in the normal path
/// they are the same bytes).
fn publish(
    root: &Path,
    stage: &Path,
    plan: &Plan,
    recovering: bool,
    hook: Option<&CommitHook>,
) -> Result<ToForce, FsError> {
    let at = |p: &str| root.join(p);
    let mut dirs: BTreeSet<PathBuf> = BTreeSet::new();
    let mark = stage.join("A");
    let removes = !(plan.moves.is_empty() && plan.unlinks.is_empty() && plan.rmdirs.is_empty());
    if removes && !mark.exists() {
        // No mark: phase B never began (the mark is durable before it
        // does), so removing names again is safe.
        fs::create_dir_all(stage).map_err(io_err(stage.display()))?;
        for (p, id) in &plan.moves {
            let m = stage.join(format!("m{id}"));
            if !m.exists() {
                fs::rename(at(p), &m).map_err(io_err(p))?;
                dirs.insert(parent_of(&at(p)));
            }
        }
        for p in &plan.unlinks {
            match fs::remove_file(at(p)) {
                Ok(()) => {
                    dirs.insert(parent_of(&at(p)));
                }
                Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {}
                Err(e) => return Err(FsError::io(p, &e)),
            }
        }
        for p in &plan.rmdirs {
            match fs::remove_dir(at(p)) {
                Ok(()) => {
                    dirs.insert(parent_of(&at(p)));
                }
                Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {}
                Err(e) => return Err(FsError::io(p, &e)),
            }
        }
        for d in std::mem::take(&mut dirs) {
            match sync_dir(&d) {
                // Removed itself by the rmdirs above (a renamed directory
                // whose files moved out): its parent is synced instead.
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                r => r.map_err(io_err(d.display()))?,
            }
        }
        File::create(&mark)
            .and_then(|f| f.sync_all())
            .map_err(io_err(mark.display()))?;
        sync_dir(stage).map_err(io_err(stage.display()))?;
        if let Some(parent) = stage.parent() {
            sync_dir(parent).map_err(io_err(parent.display()))?;
        }
    }
    if let Some(h) = hook {
        h("after-phase-a");
    }
    for p in &plan.mkdirs {
        match fs::create_dir(at(p)) {
            Ok(()) => {
                dirs.insert(parent_of(&at(p)));
            }
            Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {}
            Err(e) => return Err(FsError::io(p, &e)),
        }
    }
    let mut files: Vec<PathBuf> = Vec::new();
    for (i, place) in plan.places.iter().enumerate() {
        let p = &place.path;
        let target = at(p);
        let from = stage.join(&place.staged);
        if !recovering {
            // The common case needs no `stat` first: a staging copy that is
            // gone was renamed in already (the same outcome as below).
            match fs::rename(&from, &target) {
                Ok(()) => {
                    dirs.insert(parent_of(&target));
                }
                Err(e) if e.raw_os_error() == Some(libc::ENOENT) && !from.exists() => {}
                Err(e) => return Err(FsError::io(p, &e)),
            }
        } else {
            // Recovering: the staging copies of inline data may be lost.
            match (&place.inline, from.exists()) {
                (Some(data), true) => {
                    // Its staging copy was never forced: after a crash it is
                    // rewritten from the record before it is renamed in.
                    fs::write(&from, data).map_err(io_err(p))?;
                    fs::rename(&from, &target).map_err(io_err(p))?;
                    dirs.insert(parent_of(&target));
                }
                (Some(data), false) => {
                    // Renamed in before a crash, maybe without its data: write
                    // it again (nothing later in this plan changes this file,
                    // and the transaction's locks kept every other one away).
                    fs::write(&target, data).map_err(io_err(p))?;
                }
                (None, true) => {
                    fs::rename(&from, &target).map_err(io_err(p))?;
                    dirs.insert(parent_of(&target));
                }
                (None, false) => {} // renamed in already; its data was forced
            }
        }
        // A new file's staging copy not inline was forced at prepare (data
        // and inode): only its new name needs forcing, which its
        // directory's force does. Inline data was never forced on disk,
        // and a moved file (`m`) may hold a plain writer's unforced bytes.
        if place.inline.is_some() || !place.staged.starts_with('n') {
            files.push(target);
        }
        if i == 0 {
            if let Some(h) = hook {
                h("mid-phase-b");
            }
        }
    }
    for (i, (p, target)) in plan.links.iter().enumerate() {
        let path = at(p);
        let staged = stage.join(format!("l{i}"));
        let done = !staged.exists()
            && fs::read_link(&path).is_ok_and(|t| t.as_os_str() == std::ffi::OsStr::new(target));
        if !done {
            if !staged.exists() {
                fs::create_dir_all(stage).map_err(io_err(stage.display()))?;
                std::os::unix::fs::symlink(target, &staged).map_err(io_err(p))?;
            }
            fs::rename(&staged, &path).map_err(io_err(p))?;
            dirs.insert(parent_of(&path));
        }
    }
    for patch in &plan.patches {
        let target = at(&patch.path);
        let f = OpenOptions::new()
            .write(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&target)
            .map_err(io_err(&patch.path))?;
        let cur = f.metadata().map_err(io_err(&patch.path))?.len();
        if cur > patch.min_len {
            f.set_len(patch.min_len).map_err(io_err(&patch.path))?;
        }
        match &patch.inline {
            Some(d) => {
                for (s, l, r) in &patch.extents {
                    let chunk = d
                        .get(*r as usize..(*r + *l) as usize)
                        .ok_or_else(|| FsError::Io(format!("{}: bad extent", patch.path)))?;
                    f.write_all_at(chunk, *s).map_err(io_err(&patch.path))?;
                }
            }
            None => {
                let src = File::open(stage.join(&patch.data)).map_err(io_err(&patch.path))?;
                let mut buf = vec![0u8; CHUNK];
                for (s, l, r) in &patch.extents {
                    let mut done = 0u64;
                    while done < *l {
                        let n = ((*l - done) as usize).min(CHUNK);
                        read_full_at(&src, &mut buf[..n], r + done).map_err(io_err(&patch.path))?;
                        f.write_all_at(&buf[..n], s + done)
                            .map_err(io_err(&patch.path))?;
                        done += n as u64;
                    }
                }
            }
        }
        f.set_len(patch.len).map_err(io_err(&patch.path))?;
        files.push(target);
    }
    Ok(ToForce {
        files,
        dirs,
        marker: root.join(RESERVED).join(FORCE_MARK),
    })
}

/// The file in the reserved area whose force commits the file system's
/// journal for [`force_all`].
const FORCE_MARK: &str = "force";

/// Makes `files` (their data) and `dirs` durable.
///
/// Forcing files one by one costs a device cache flush (and often a
/// journal commit) each: seconds for a thousand small files. On a file
/// system whose metadata journal is one ordered stream for the whole file
/// system (ext4, xfs: a journal commit covers every metadata change made
/// before it, and flushes the device first), this writes every file's data
/// and waits for it (`sync_file_range`, no flush), then changes and forces
/// one marker file in the volume's reserved area (`marker`): that commit
/// carries the files' allocations and sizes and the directories' entries,
/// all made before it. Elsewhere (or for a couple of files) each file and
/// directory is forced on its own.
///
/// Fails with the first I/O error.
fn force_all<'a>(
    files: &[PathBuf],
    dirs: impl IntoIterator<Item = &'a Path>,
    marker: &Path,
) -> std::io::Result<()> {
    let dirs: Vec<&Path> = dirs.into_iter().collect();
    if files.len() + dirs.len() > 2 {
        let mark = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(marker)?;
        if journal_orders_all(&mark)? {
            for f in files {
                range_sync(&open_nofollow(f)?, libc::SYNC_FILE_RANGE_WRITE)?;
            }
            for f in files {
                range_sync(
                    &open_nofollow(f)?,
                    libc::SYNC_FILE_RANGE_WAIT_BEFORE
                        | libc::SYNC_FILE_RANGE_WRITE
                        | libc::SYNC_FILE_RANGE_WAIT_AFTER,
                )?;
            }
            // A change of the marker's time lands in the running journal
            // transaction, after every change above: forcing it commits
            // them all.
            let stamp = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(0);
            mark.write_all_at(&stamp.to_le_bytes(), 0)?;
            return mark.sync_all();
        }
    }
    for f in files {
        open_nofollow(f)?.sync_data()?;
    }
    for d in dirs {
        sync_dir(d)?;
    }
    Ok(())
}

/// `sync_file_range` over the whole of `f` with `flags`.
fn range_sync(f: &File, flags: libc::c_uint) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    // SAFETY: the descriptor is open for the whole call (`f` is borrowed);
    // sync_file_range only reads its integer arguments. Exercised by every
    // commit of more than two files (e.g. `force_all_forces_many_files`).
    let rc = unsafe { libc::sync_file_range(f.as_raw_fd(), 0, 0, flags) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// True when the file system holding `f` is one whose journal commits
/// every metadata change in order (ext4, xfs).
fn journal_orders_all(f: &File) -> std::io::Result<bool> {
    use std::os::fd::AsRawFd;
    const EXT4: i64 = 0xEF53;
    const XFS: i64 = 0x5846_5342;
    let mut s = std::mem::MaybeUninit::<libc::statfs>::zeroed();
    // SAFETY: the descriptor is open for the whole call and `s` points to
    // writable memory the size of a `statfs`, which the call fills on
    // success; it is read only then. Exercised with `range_sync`.
    let rc = unsafe { libc::fstatfs(f.as_raw_fd(), s.as_mut_ptr()) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // `f_type`'s integer type differs between targets.
    #[allow(clippy::unnecessary_cast)]
    // SAFETY: fstatfs returned 0, so it initialized the struct.
    let kind = unsafe { s.assume_init() }.f_type as i64;
    Ok(kind == EXT4 || kind == XFS)
}

fn parent_of(p: &Path) -> PathBuf {
    p.parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("/"))
}

fn remove_stage(stage: &Path) -> std::io::Result<()> {
    match fs::remove_dir_all(stage) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        r => r,
    }
}

fn sync_dir(d: &Path) -> std::io::Result<()> {
    File::open(d)?.sync_all()
}

fn open_nofollow(p: &Path) -> std::io::Result<File> {
    OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(p)
}

/// Reads exactly `buf.len()` bytes at `offset`; zeros past end of file.
fn read_full_at(f: &File, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
    let mut done = 0;
    while done < buf.len() {
        match f.read_at(&mut buf[done..], offset + done as u64) {
            Ok(0) => {
                buf[done..].fill(0);
                return Ok(());
            }
            Ok(n) => done += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

fn read_some(r: &mut (dyn Read + Send), buf: &mut [u8]) -> std::io::Result<usize> {
    let mut done = 0;
    while done < buf.len() {
        match r.read(&mut buf[done..]) {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(done)
}

/// Free bytes for unprivileged users on the file system holding `p`.
fn free_bytes(p: &Path) -> std::io::Result<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(p.as_os_str().as_bytes())
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
    let mut s = std::mem::MaybeUninit::<libc::statvfs>::zeroed();
    // SAFETY: `c` is a valid NUL-terminated path and `s` points to writable
    // memory the size of a `statvfs`, which the call fills on success; it is
    // read only then. Exercised by every prepare that changes files (e.g.
    // the tests in `tests.rs`).
    let rc = unsafe { libc::statvfs(c.as_ptr(), s.as_mut_ptr()) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: statvfs returned 0, so it initialized the struct.
    let s = unsafe { s.assume_init() };
    Ok(s.f_bavail.saturating_mul(s.f_frsize))
}

fn meta_of(s: &Seen) -> Option<Meta> {
    let (kind, len, changed) = match s {
        Seen::Absent => return None,
        Seen::Dir => (FileKind::Dir, 0, false),
        Seen::File(f) => (FileKind::File, f.len(), true),
        Seen::Committed(l) => (FileKind::File, *l, false),
        Seen::NewLink(t) => (FileKind::Symlink, t.len() as u64, true),
        Seen::Symlink => (FileKind::Symlink, 0, false),
        Seen::Other => (FileKind::Other, 0, false),
    };
    Some(Meta { kind, len, changed })
}

/// Extents overlapping [lo, hi): (start, (len, roff)).
fn overlapping(ext: &BTreeMap<u64, (u64, u64)>, lo: u64, hi: u64) -> Vec<(u64, (u64, u64))> {
    let mut out = Vec::new();
    if let Some((s, v)) = ext.range(..lo).next_back() {
        if s + v.0 > lo {
            out.push((*s, *v));
        }
    }
    for (s, v) in ext.range(lo..hi) {
        out.push((*s, *v));
    }
    out
}

/// Records that [s, s+len) now comes from the redo file at `roff`,
/// splitting what it overlaps and merging with a contiguous predecessor.
fn insert_extent(ext: &mut BTreeMap<u64, (u64, u64)>, s: u64, len: u64, roff: u64) {
    if len == 0 {
        return;
    }
    let e = s + len;
    for (os, (ol, or)) in overlapping(ext, s, e) {
        ext.remove(&os);
        if os < s {
            ext.insert(os, (s - os, or));
        }
        if os + ol > e {
            ext.insert(e, (os + ol - e, or + (e - os)));
        }
    }
    if let Some((ps, (pl, pr))) = ext.range(..s).next_back().map(|(a, b)| (*a, *b)) {
        if ps + pl == s && pr + pl == roff {
            ext.insert(ps, (pl + len, pr));
            return;
        }
    }
    ext.insert(s, (len, roff));
}

/// Drops what lies at and past `len`.
fn clip_extents(ext: &mut BTreeMap<u64, (u64, u64)>, len: u64) {
    let past: Vec<u64> = ext.range(len..).map(|(s, _)| *s).collect();
    for s in past {
        ext.remove(&s);
    }
    if let Some((s, (l, r))) = ext.range(..len).next_back().map(|(a, b)| (*a, *b)) {
        if s + l > len {
            ext.insert(s, (len - s, r));
        }
    }
}

#[cfg(test)]
mod force_tests {
    use super::*;

    #[test]
    fn force_all_forces_many_files_and_few() {
        let t = tempfile::tempdir().unwrap();
        let marker = t.path().join("mark");
        let files: Vec<PathBuf> = (0..5).map(|i| t.path().join(format!("f{i}"))).collect();
        for f in &files {
            fs::write(f, b"data").unwrap();
        }
        // Many files: the batched path where the file system allows it.
        force_all(&files, [t.path()], &marker).unwrap();
        assert!(marker.exists(), "the marker is made to force the journal");
        // A couple: each on its own.
        force_all(&files[..1], [t.path()], &t.path().join("unused")).unwrap();
        assert!(!t.path().join("unused").exists());
        // A missing file is an error, not a silent success.
        let gone = vec![t.path().join("absent"); 3];
        assert!(force_all(&gone, [t.path()], &marker).is_err());
        let f = File::open(&files[0]).unwrap();
        journal_orders_all(&f).unwrap();
        range_sync(&f, libc::SYNC_FILE_RANGE_WRITE).unwrap();
    }
}

#[cfg(test)]
mod extent_tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// The extent map always describes the last write of every byte.
        #[test]
        fn extents_model_last_writer(ops in proptest::collection::vec((0u64..64, 1u64..16, any::<bool>(), 0u64..80), 1..40)) {
            let mut ext = BTreeMap::new();
            let mut model: Vec<Option<u64>> = vec![None; 96];
            let mut rlen = 0u64;
            for (s, l, trunc, tl) in ops {
                if trunc {
                    clip_extents(&mut ext, tl);
                    for b in model.iter_mut().skip(tl as usize) { *b = None; }
                } else {
                    insert_extent(&mut ext, s, l, rlen);
                    for i in 0..l { model[(s + i) as usize] = Some(rlen + i); }
                    rlen += l;
                }
            }
            let mut got: Vec<Option<u64>> = vec![None; 96];
            let mut last_end = 0;
            for (s, (l, r)) in &ext {
                prop_assert!(*s >= last_end, "overlap at {}", s);
                last_end = s + l;
                for i in 0..*l { got[(s + i) as usize] = Some(r + i); }
            }
            prop_assert_eq!(got, model);
        }
    }
}
