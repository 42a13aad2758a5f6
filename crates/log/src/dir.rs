//! The log directory: its lock, its fsync, and listing what is in it.
//!
//! Owns: the exclusive lock that keeps two `Log`s off one directory, directory fsync (needed
//! after a file is created, renamed or removed; done through the [`Durability`] seam), and
//! enumerating segment files. Must never: read or write segment contents.

use std::fs::{File, OpenOptions};
use std::io;
use std::path::{Path, PathBuf};

use crate::durable::Durability;
use crate::error::{LogError, Result};
use crate::segment;

/// Name of the lock file inside the log directory.
const LOCK_FILE: &str = "log.lock";

/// Fsyncs a directory so that file creations, renames and removals in it are durable.
/// Returns [`LogError::Io`] on failure, which the caller must treat as fatal.
pub(crate) fn sync_dir(dur: &Durability, dir: &Path) -> Result<()> {
    dur.sync_dir(dir)
        .map_err(|e| LogError::io(format!("syncing directory {}", dir.display()), e))
}

/// Creates `dir` (and missing parents) if needed, making every new entry durable up to the
/// first ancestor that existed. Returns [`LogError::Io`] on failure.
pub(crate) fn ensure_dir(dur: &Durability, dir: &Path) -> Result<()> {
    dur.create_dir_all(dir)
        .map_err(|e| LogError::io(format!("creating log directory {}", dir.display()), e))
}

/// An exclusive advisory lock on a log directory, held for the lifetime of a `Log`.
/// Released when dropped (the kernel drops the `flock` with the last descriptor).
#[derive(Debug)]
pub(crate) struct DirLock {
    _file: Option<File>,
}

impl DirLock {
    /// Takes the lock without blocking. Returns [`LogError::Locked`] if another log instance
    /// holds it, [`LogError::Io`] for any other failure.
    pub(crate) fn acquire(dur: &Durability, dir: &Path) -> Result<DirLock> {
        if !dur.is_real() {
            // A simulated disk lives in one process that opens each log once.
            return Ok(DirLock { _file: None });
        }
        let path = dir.join(LOCK_FILE);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(|e| LogError::io(format!("opening {}", path.display()), e))?;
        use std::os::fd::AsRawFd;
        // SAFETY: the descriptor belongs to `file`, which is alive for the whole call; flock
        // takes only scalar arguments.
        let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
        if rc != 0 {
            let err = io::Error::last_os_error();
            if err.raw_os_error() == Some(libc::EWOULDBLOCK) {
                return Err(LogError::Locked {
                    dir: dir.to_path_buf(),
                });
            }
            return Err(LogError::io(format!("locking {}", path.display()), err));
        }
        Ok(DirLock { _file: Some(file) })
    }
}

/// Lists the segment files in `dir` as sorted base positions, and removes leftovers of
/// interrupted segment creation or meta writes (`*.tmp`). Returns [`LogError::Io`] on failure.
pub(crate) fn scan(dur: &Durability, dir: &Path) -> Result<Vec<u64>> {
    let ctx = |e| LogError::io(format!("listing log directory {}", dir.display()), e);
    let mut bases = Vec::new();
    let mut removed: Vec<PathBuf> = Vec::new();
    let mut names = dur.list(dir).map_err(ctx)?;
    names.sort_unstable();
    for name in names {
        if let Some(base) = segment::parse_file_name(&name) {
            bases.push(base);
        } else if name.ends_with(segment::TMP_SUFFIX) {
            let p = dir.join(&name);
            dur.remove_file(&p)
                .map_err(|e| LogError::io(format!("removing stale {}", p.display()), e))?;
            removed.push(p);
        }
    }
    if !removed.is_empty() {
        tracing::info!(?removed, "removed leftovers of interrupted log writes");
        sync_dir(dur, dir)?;
    }
    bases.sort_unstable();
    Ok(bases)
}
