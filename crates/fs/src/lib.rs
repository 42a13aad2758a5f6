//! weft's transactional files: QuickSilver's file system as a weft resource.
//!
//! A node serves one or more directory trees ("volumes"). Inside a
//! transaction, file changes (create, write ranges, truncate, delete,
//! rename, mkdir, rmdir) are visible to that transaction only; commit makes
//! them durable and visible together, across volumes and nodes (the file
//! store is a two-phase participant); abort leaves every file and name as it
//! was. New files are staged in the volume's reserved `.weft-fs/` area and
//! renamed in at commit; range writes to existing files are kept as redo
//! extents and written in place at commit, so a small write to a large file
//! copies nothing. Files take degree-2 locks, directories degree 1; a lock
//! conflict fails with LockConflict after a bound. See `docs/fs.md` and
//! `API.md`.

pub mod api;
pub mod lock;
pub mod path;
pub mod service;
pub mod volume;

pub use api::{
    DirEntry, FileKind, FsError, FsOp, FsRecord, FsReply, FsRequest, FsResponse, Meta, Patch,
    Place, Plan, ReadMode, FS_RECORD_TAG,
};
pub use service::{Fs, FsConfig, VolumeRef, REMOTE_CHUNK, SERVICE};
pub use volume::{CommitHook, Volume, VolumeLimits, VolumeStats};
