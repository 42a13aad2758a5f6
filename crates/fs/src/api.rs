//! The vocabulary of the file store: errors, file kinds and metadata, read
//! options, the requests and replies of the `fs` RPC service, and the log
//! record a prepared branch writes.
//!
//! Owns the types that cross a process boundary (requests, replies, the
//! prepare record), so their encoding is one place. Must never do I/O.

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use weft_wire::{Failure, Status, Tid};

/// The log record tag of the file store's prepare records.
pub const FS_RECORD_TAG: weft_log::RecordTag = weft_log::RecordTag(0x0500);

/// How a file-store operation fails. Each kind names one precise cause; the
/// text says which path and why.
#[derive(thiserror::Error, Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum FsError {
    /// No file or directory by that name (in the transaction's view).
    #[error("not found: {0}")]
    NotFound(String),
    /// The name is taken (exclusive create, mkdir, rename onto a directory).
    #[error("already exists: {0}")]
    AlreadyExists(String),
    /// A path component that must be a directory is not one.
    #[error("not a directory: {0}")]
    NotADirectory(String),
    /// A file operation named a directory.
    #[error("is a directory: {0}")]
    IsADirectory(String),
    /// rmdir of a directory that still has entries.
    #[error("directory not empty: {0}")]
    DirectoryNotEmpty(String),
    /// The path leaves the volume: `..`, an absolute path, a symbolic link
    /// pointing outside, or the volume's reserved `.weft-fs` area.
    #[error("path escapes the volume: {0}")]
    Escape(String),
    /// The path is malformed (empty where a name is needed, NUL bytes, too
    /// long).
    #[error("bad path: {0}")]
    BadPath(String),
    /// No volume by that name on the node.
    #[error("no such volume: {0}")]
    NoSuchVolume(String),
    /// The volume's file system is out of space.
    #[error("no space: {0}")]
    NoSpace(String),
    /// A lock was not granted within the bound.
    #[error("lock conflict: {0}")]
    LockConflict(String),
    /// A bound was exceeded (read size, staged bytes, open handles, locks).
    #[error("too large: {0}")]
    TooLarge(String),
    /// The operation is not supported (e.g. renaming a directory).
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// The transaction can no longer change files here (it is preparing,
    /// prepared or ended).
    #[error("transaction not active here: {0}")]
    NotActive(String),
    /// An unexpected I/O error from the volume's file system.
    #[error("i/o error: {0}")]
    Io(String),
    /// The transaction layer or the network failed (not joined, aborted,
    /// timed out, host dead...).
    #[error("{0}")]
    Tx(Failure),
}

impl FsError {
    /// The weft status this error travels as.
    pub fn status(&self) -> Status {
        match self {
            FsError::NotFound(_)
            | FsError::AlreadyExists(_)
            | FsError::NotADirectory(_)
            | FsError::IsADirectory(_)
            | FsError::DirectoryNotEmpty(_)
            | FsError::NoSpace(_) => Status::AppError,
            FsError::Escape(_) | FsError::BadPath(_) | FsError::Unsupported(_) => {
                Status::BadRequest
            }
            FsError::NoSuchVolume(_) => Status::AddrError,
            FsError::LockConflict(_) => Status::LockConflict,
            FsError::TooLarge(_) => Status::TooLarge,
            FsError::NotActive(_) => Status::Aborted,
            FsError::Io(_) => Status::Internal,
            FsError::Tx(f) => f.status,
        }
    }

    /// The error for an I/O failure on `what`, keeping ENOSPC/EDQUOT apart.
    pub fn io(what: impl std::fmt::Display, e: &std::io::Error) -> FsError {
        match e.raw_os_error() {
            Some(libc::ENOSPC) | Some(libc::EDQUOT) => FsError::NoSpace(format!("{what}: {e}")),
            Some(libc::ENOENT) => FsError::NotFound(format!("{what}")),
            Some(libc::ENOTDIR) => FsError::NotADirectory(format!("{what}")),
            Some(libc::EISDIR) => FsError::IsADirectory(format!("{what}")),
            Some(libc::ENOTEMPTY) => FsError::DirectoryNotEmpty(format!("{what}")),
            Some(libc::EEXIST) => FsError::AlreadyExists(format!("{what}")),
            _ => FsError::Io(format!("{what}: {e}")),
        }
    }
}

impl From<Failure> for FsError {
    fn from(f: Failure) -> Self {
        FsError::Tx(f)
    }
}

impl From<FsError> for Failure {
    fn from(e: FsError) -> Failure {
        match e {
            FsError::Tx(f) => f,
            other => Failure::new(other.status(), format!("fs: {other}")),
        }
    }
}

/// What a name denotes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum FileKind {
    /// A regular file.
    File,
    /// A directory.
    Dir,
    /// A symbolic link (listed; never followed out of the volume).
    Symlink,
    /// Anything else (socket, fifo, device): listed, not opened.
    Other,
}

/// What `stat` says about a name, in the transaction's view.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Meta {
    /// File, directory, ...
    pub kind: FileKind,
    /// Length in bytes (0 for directories).
    pub len: u64,
    /// True when the transaction changed this name (created, wrote,
    /// truncated or renamed it here).
    pub changed: bool,
}

/// One entry of a directory listing.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DirEntry {
    /// The entry's name (one path component).
    pub name: String,
    /// What it denotes, with its length.
    pub meta: Meta,
}

/// How a read isolates itself (QuickSilver section 3).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum ReadMode {
    /// Degree 2 (the default): a read lock held for the operation (or, for
    /// an opened handle, until it is closed).
    #[default]
    Degree2,
    /// Degree 3: the read lock is held to the end of the transaction
    /// (repeatable reads).
    Degree3,
    /// No lock: reads the last committed state (or the transaction's own
    /// changes) without waiting for writers; may see a commit being
    /// applied.
    NoLock,
}

/// One operation of the `fs` service. Paths are relative to the volume,
/// `/`-separated.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum FsOp {
    /// Create an empty file, or empty an existing one unless `exclusive`.
    Create {
        /// The file.
        path: String,
        /// Fail with AlreadyExists when the name is taken.
        exclusive: bool,
    },
    /// Write `data` at `offset` (the file must exist; it grows as needed).
    Write {
        /// The file.
        path: String,
        /// Where.
        offset: u64,
        /// What.
        data: Bytes,
    },
    /// Set a file's length.
    Truncate {
        /// The file.
        path: String,
        /// The new length.
        len: u64,
    },
    /// Delete a file.
    Delete {
        /// The file.
        path: String,
    },
    /// Rename a file (also across directories; replaces a file at `to`).
    Rename {
        /// The current name.
        from: String,
        /// The new name.
        to: String,
    },
    /// Create a directory.
    Mkdir {
        /// The directory.
        path: String,
    },
    /// Remove an empty directory.
    Rmdir {
        /// The directory.
        path: String,
    },
    /// Create a symbolic link (never followed by weft).
    Symlink {
        /// The link's name.
        path: String,
        /// What it points to, as given.
        target: String,
    },
    /// Describe a name.
    Stat {
        /// The name.
        path: String,
        /// Isolation of the read.
        mode: ReadMode,
    },
    /// List a directory (no locks: degree 1 for directories).
    List {
        /// The directory ("" is the volume's root).
        path: String,
    },
    /// Read up to `len` bytes at `offset`.
    Read {
        /// The file.
        path: String,
        /// Where.
        offset: u64,
        /// How many bytes at most (bounded by the volume's read limit).
        len: u64,
        /// Isolation of the read.
        mode: ReadMode,
    },
    /// Take a read lock on a file until [`FsOp::Close`] (degree 2 across
    /// several reads).
    Open {
        /// The file.
        path: String,
    },
    /// Release what [`FsOp::Open`] took.
    Close {
        /// The file.
        path: String,
    },
    /// Make the file hold exactly `data` (created, or replaced whole): a
    /// small file in one request instead of a `Create` and a `Write`.
    Put {
        /// The file.
        path: String,
        /// Its whole content.
        data: Bytes,
    },
    /// Run `ops` in order, in one request (many small changes without a
    /// round trip each); stops at the first that fails and returns its
    /// error (those before it stay done in the transaction). A batch may
    /// not hold a batch. Replies [`FsReply::Batch`], one reply per op.
    Batch {
        /// The operations.
        ops: Vec<FsOp>,
    },
}

/// A request to the `fs` service: one operation on one volume.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FsRequest {
    /// The volume's name on the serving node.
    pub volume: String,
    /// What to do.
    pub op: FsOp,
}

/// What an operation returns.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum FsReply {
    /// Done, nothing to return.
    Done,
    /// `Stat`: the name's metadata, or None when absent.
    Meta(Option<Meta>),
    /// `List`: the entries, sorted by name.
    Entries(Vec<DirEntry>),
    /// `Read`: the bytes (shorter than asked at end of file).
    Data(Bytes),
    /// `Batch`: each operation's reply, in order.
    Batch(Vec<FsReply>),
}

/// The service's response: the reply or the file store's error (carried as
/// a value so its kind survives the network).
pub type FsResponse = Result<FsReply, FsError>;

/// A prepared branch's plan: everything commit does to the volume, in order,
/// idempotent when replayed (see `docs/fs.md`, "Commit").
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Plan {
    /// Phase A: committed files renamed by the transaction, moved into the
    /// staging area as `m<id>`.
    pub moves: Vec<(String, u64)>,
    /// Phase A: committed files deleted.
    pub unlinks: Vec<String>,
    /// Phase A: committed directories removed, deepest first.
    pub rmdirs: Vec<String>,
    /// Phase B: directories created, parents first.
    pub mkdirs: Vec<String>,
    /// Phase B: staged files renamed into place.
    pub places: Vec<Place>,
    /// Phase B: range writes applied in place.
    pub patches: Vec<Patch>,
    /// Phase B: symbolic links made: (path, target).
    pub links: Vec<(String, String)>,
}

/// A staged file renamed into place at commit.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Place {
    /// Where it goes.
    pub path: String,
    /// Its name in the staging area (`n<id>`, `m<id>`).
    pub staged: String,
    /// Its content, when small enough to travel in the record (then the
    /// staging copy was never forced: recovery writes this instead).
    pub inline: Option<Bytes>,
}

/// Range writes to one file, applied in place at commit.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Patch {
    /// The file (after phase B's renames).
    pub path: String,
    /// Bytes at and past this length come from `extents` or are zeros.
    pub min_len: u64,
    /// The final length.
    pub len: u64,
    /// The staging file that holds the written bytes (`r<id>`), when they
    /// are not inline.
    pub data: String,
    /// The written bytes, when small enough to travel in the record.
    pub inline: Option<Bytes>,
    /// (file offset, length, offset in `data`), non-overlapping.
    pub extents: Vec<(u64, u64, u64)>,
}

/// The file store's log record.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum FsRecord {
    /// A branch prepared on a volume: its plan, applied at commit.
    Prepared {
        /// The transaction.
        tid: Tid,
        /// The volume's name.
        volume: String,
        /// What commit does.
        plan: Plan,
    },
    /// A committed branch's plan is wholly applied and durable on the
    /// volume: recovery need not apply it again.
    Applied {
        /// The transaction.
        tid: Tid,
        /// The volume's name.
        volume: String,
    },
}
