//! The storage seam: the file operations the log (and a resource manager's snapshots) need,
//! as a trait, so that the same log code runs over the real file system or over a simulated
//! disk ([`crate::MemDisk`]) that loses unsynced writes at a crash.
//!
//! Owns: [`Storage`] (directory-level operations: list, create, open, read, rename, remove,
//! sync a directory) and [`StorageFile`] (an open file: positional write, read, length,
//! truncate, allocate, data and full sync), and their real implementation over `std::fs`
//! ([`RealFs`]), which does exactly what the log did before the seam existed (same calls,
//! same on-disk bytes). Must never: buffer, reorder or retry anything (a failed sync is
//! reported once and the caller poisons), or decide durability policy.

use std::fmt;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Read};
use std::os::unix::fs::FileExt;
use std::path::Path;

/// An open file of a [`Storage`]: what the log does to a segment or a small metadata file.
///
/// Every method reports the operating system's (or the simulation's) error as is; none
/// retries.
pub trait StorageFile: Send + Sync + fmt::Debug {
    /// Writes all of `buf` at byte `offset` (the file grows if needed).
    fn write_all_at(&self, buf: &[u8], offset: u64) -> io::Result<()>;
    /// Reads the whole file.
    fn read_all(&self) -> io::Result<Vec<u8>>;
    /// The file's length in bytes.
    fn len(&self) -> io::Result<u64>;
    /// True when the file holds no byte.
    fn is_empty(&self) -> io::Result<bool> {
        Ok(self.len()? == 0)
    }
    /// Cuts or extends the file to `len` bytes.
    fn set_len(&self, len: u64) -> io::Result<()>;
    /// Makes sure the file has `size` bytes allocated (its length becomes at least `size`).
    fn allocate(&self, size: u64) -> io::Result<()>;
    /// Makes the file's data durable (fdatasync).
    fn sync_data(&self) -> io::Result<()>;
    /// Makes the file's data and metadata durable (fsync).
    fn sync_all(&self) -> io::Result<()>;
}

/// Directory-level operations of a storage backend. Names created, renamed or removed are
/// durable only after [`Storage::sync_dir`] of their directory.
pub trait Storage: Send + Sync + fmt::Debug {
    /// Creates `dir` (not its parents); `AlreadyExists` if it exists.
    fn create_dir(&self, dir: &Path) -> io::Result<()>;
    /// True when `path` is an existing directory.
    fn is_dir(&self, path: &Path) -> bool;
    /// True when `path` names an existing file.
    fn exists(&self, path: &Path) -> bool;
    /// Names of the entries of `dir`.
    fn list(&self, dir: &Path) -> io::Result<Vec<String>>;
    /// Creates (or truncates) the file `path`, open for reading and writing.
    fn create(&self, path: &Path) -> io::Result<Box<dyn StorageFile>>;
    /// Opens the existing file `path` for reading and writing; `NotFound` if missing.
    fn open(&self, path: &Path) -> io::Result<Box<dyn StorageFile>>;
    /// Reads the whole file `path`; `NotFound` if missing.
    fn read(&self, path: &Path) -> io::Result<Vec<u8>>;
    /// Renames `from` to `to`, replacing `to`.
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()>;
    /// Removes the file `path`.
    fn remove(&self, path: &Path) -> io::Result<()>;
    /// Fsyncs the directory `dir`.
    fn sync_dir(&self, dir: &Path) -> io::Result<()>;
    /// True for the real file system (the log then also takes its `flock` on the directory).
    fn is_real(&self) -> bool {
        false
    }
}

/// The real file system.
#[derive(Debug, Default, Clone, Copy)]
pub struct RealFs;

impl StorageFile for File {
    fn write_all_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        FileExt::write_all_at(self, buf, offset)
    }

    fn read_all(&self) -> io::Result<Vec<u8>> {
        let mut buf = Vec::new();
        let mut f = self;
        f.read_to_end(&mut buf)?;
        Ok(buf)
    }

    fn len(&self) -> io::Result<u64> {
        Ok(self.metadata()?.len())
    }

    fn set_len(&self, len: u64) -> io::Result<()> {
        File::set_len(self, len)
    }

    fn allocate(&self, size: u64) -> io::Result<()> {
        allocate(self, size)
    }

    fn sync_data(&self) -> io::Result<()> {
        File::sync_data(self)
    }

    fn sync_all(&self) -> io::Result<()> {
        File::sync_all(self)
    }
}

impl Storage for RealFs {
    fn create_dir(&self, dir: &Path) -> io::Result<()> {
        fs::create_dir(dir)
    }

    fn is_dir(&self, path: &Path) -> bool {
        path.is_dir()
    }

    fn exists(&self, path: &Path) -> bool {
        path.exists()
    }

    fn list(&self, dir: &Path) -> io::Result<Vec<String>> {
        let mut names = Vec::new();
        for entry in fs::read_dir(dir)? {
            if let Some(name) = entry?.file_name().to_str() {
                names.push(name.to_string());
            }
        }
        Ok(names)
    }

    fn create(&self, path: &Path) -> io::Result<Box<dyn StorageFile>> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(path)?;
        Ok(Box::new(file))
    }

    fn open(&self, path: &Path) -> io::Result<Box<dyn StorageFile>> {
        let file = OpenOptions::new().read(true).write(true).open(path)?;
        Ok(Box::new(file))
    }

    fn read(&self, path: &Path) -> io::Result<Vec<u8>> {
        fs::read(path)
    }

    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        fs::rename(from, to)
    }

    fn remove(&self, path: &Path) -> io::Result<()> {
        fs::remove_file(path)
    }

    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        File::open(dir)?.sync_all()
    }

    fn is_real(&self) -> bool {
        true
    }
}

/// Makes sure `file` has `size` bytes of allocated space (its length becomes at least `size`).
///
/// Uses `fallocate` where the platform has it, so later writes inside the file do not change
/// its size and fdatasync need not flush the inode's size; falls back to `set_len` (a sparse
/// extension) where it does not.
pub(crate) fn allocate(file: &File, size: u64) -> io::Result<()> {
    #[cfg(target_os = "linux")]
    {
        use std::os::fd::AsRawFd;
        let len = libc::off_t::try_from(size)
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "segment too large"))?;
        // SAFETY: `file` is an open file we own for the duration of the call, so the raw fd is
        // valid; fallocate only reads its scalar arguments and touches no memory of ours.
        let rc = unsafe { libc::fallocate(file.as_raw_fd(), 0, 0, len) };
        if rc == 0 {
            return Ok(());
        }
        let err = io::Error::last_os_error();
        match err.raw_os_error() {
            Some(libc::EOPNOTSUPP) | Some(libc::ENOSYS) => {}
            _ => return Err(err),
        }
    }
    if file.metadata()?.len() < size {
        file.set_len(size)?;
    }
    Ok(())
}
