//! Snapshot files of the KV store: the committed map and the prepared write
//! sets as of a log position, written atomically and checksummed.
//!
//! Layout: magic `WKVSNAP1` (8 bytes), log position (u64 LE), body length
//! (u64 LE), CRC32C of the body (u32 LE), body (postcard [`Image`]).
//! Owns that file, its directory, and the check that the log does not start
//! past what the snapshot holds. Must never replace a good snapshot with a
//! partial one (write a temporary file, fsync it, rename it into place through
//! [`Durability`], which syncs the directory; the directory itself is created
//! with its parents synced), and never let recovery start over an empty store
//! when the log's earlier records are gone.

use std::io;
use std::path::{Path, PathBuf};

use weft_log::Durability;

use crate::store::Image;

const MAGIC: &[u8; 8] = b"WKVSNAP1";
const HEADER: usize = 8 + 8 + 8 + 4;

/// Why a snapshot could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    /// File system error.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The OS error.
        source: io::Error,
    },
    /// The file is not a valid snapshot.
    #[error("snapshot {path} is corrupt: {reason}")]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// The log begins past the records the snapshot holds: the records in
    /// between are in neither, so the store cannot be rebuilt. Happens when a
    /// snapshot (or its directory) was lost after the log was truncated
    /// below it; starting anyway would silently drop committed writes.
    #[error(
        "log {log_dir} starts at LSN {log_start}, but {}: the records before LSN {log_start} \
         are in no snapshot; refusing to start",
        match snapshot_lsn {
            Some(at) => format!("snapshot {} holds only those before LSN {at}", snapshot.display()),
            None => format!("snapshot {} does not exist", snapshot.display()),
        }
    )]
    LogPastSnapshot {
        /// The snapshot file that should hold the missing records.
        snapshot: PathBuf,
        /// The log position the snapshot is valid as of, `None` without one.
        snapshot_lsn: Option<u64>,
        /// The log directory.
        log_dir: PathBuf,
        /// Where the log starts.
        log_start: u64,
    },
    /// The snapshot is valid as of a log position the log no longer reaches:
    /// records that were durable when it was taken are gone from the log
    /// (lost files, a cut below the checkpoint), and the records appended
    /// from now on would take positions below the snapshot's, where replay
    /// skips them.
    #[error(
        "snapshot {} holds the records before LSN {snapshot_lsn}, but log {log_dir} ends at \
         LSN {log_end}: the log lost records that were durable; refusing to start",
        snapshot.display()
    )]
    SnapshotPastLog {
        /// The snapshot file.
        snapshot: PathBuf,
        /// The log position the snapshot is valid as of.
        snapshot_lsn: u64,
        /// The log directory.
        log_dir: PathBuf,
        /// Where the log ends.
        log_end: u64,
    },
}

/// Checks that a snapshot valid as of `snapshot_lsn` (`None`: no snapshot)
/// in the file `snapshot` (this module's, or the disk engine's), together with a log in `log_dir` holding `log_start..log_end`,
/// holds every record: fails with [`SnapshotError::LogPastSnapshot`] when the
/// log starts past the snapshot, [`SnapshotError::SnapshotPastLog`] when the
/// log ends before it.
pub fn check_covers(
    snapshot: &Path,
    snapshot_lsn: Option<u64>,
    log_dir: &Path,
    log_start: u64,
    log_end: u64,
) -> Result<(), SnapshotError> {
    if let Some(at) = snapshot_lsn.filter(|&at| at > log_end) {
        return Err(SnapshotError::SnapshotPastLog {
            snapshot: snapshot.to_path_buf(),
            snapshot_lsn: at,
            log_dir: log_dir.to_path_buf(),
            log_end,
        });
    }
    if log_start > snapshot_lsn.unwrap_or(0) {
        return Err(SnapshotError::LogPastSnapshot {
            snapshot: snapshot.to_path_buf(),
            snapshot_lsn,
            log_dir: log_dir.to_path_buf(),
            log_start,
        });
    }
    Ok(())
}

fn io_err(context: impl Into<String>) -> impl FnOnce(io::Error) -> SnapshotError {
    let context = context.into();
    move |source| SnapshotError::Io { context, source }
}

/// The snapshot file in `dir`.
pub fn path(dir: &Path) -> PathBuf {
    dir.join("kv.snapshot")
}

/// Writes `image`, valid as of log position `lsn`, atomically and durably to
/// `dir` (created, with every new directory's entry synced, if missing): when
/// it returns `Ok`, the snapshot survives power loss.
///
/// Fails with [`SnapshotError::Io`]; the previous snapshot is then intact.
pub fn write(dur: &Durability, dir: &Path, lsn: u64, image: &Image) -> Result<(), SnapshotError> {
    dur.create_dir_all(dir)
        .map_err(io_err(format!("creating {}", dir.display())))?;
    let body = postcard::to_allocvec(image).map_err(|e| SnapshotError::Io {
        context: "encoding the snapshot".into(),
        source: io::Error::other(e.to_string()),
    })?;
    let tmp = dir.join("kv.snapshot.tmp");
    {
        let f = dur
            .create(&tmp)
            .map_err(io_err(format!("creating {}", tmp.display())))?;
        let mut head = Vec::with_capacity(HEADER);
        head.extend_from_slice(MAGIC);
        head.extend_from_slice(&lsn.to_le_bytes());
        head.extend_from_slice(&(body.len() as u64).to_le_bytes());
        head.extend_from_slice(&crc32c::crc32c(&body).to_le_bytes());
        f.write_all_at(&head, 0)
            .and_then(|()| f.write_all_at(&body, HEADER as u64))
            .map_err(io_err("writing the snapshot"))?;
        f.sync_all().map_err(io_err("syncing the snapshot"))?;
    }
    dur.rename(&tmp, &path(dir))
        .map_err(io_err("renaming the snapshot into place"))
}

/// Reads the snapshot in `dir`: `None` when there is none.
///
/// Fails with [`SnapshotError::Corrupt`] when the file exists but does not
/// check out (a snapshot is only ever replaced atomically, so this is damage,
/// not a crash), [`SnapshotError::Io`] otherwise.
pub fn read(dir: &Path) -> Result<Option<(u64, Image)>, SnapshotError> {
    read_on(&Durability::new(), dir)
}

/// [`read`] through the storage behind `dur` (a simulated disk in the simulator).
pub fn read_on(dur: &Durability, dir: &Path) -> Result<Option<(u64, Image)>, SnapshotError> {
    let p = path(dir);
    let bytes = match dur.read(&p) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io_err(format!("reading {}", p.display()))(e)),
    };
    let corrupt = |reason: &str| SnapshotError::Corrupt {
        path: p.clone(),
        reason: reason.into(),
    };
    if bytes.len() < HEADER || &bytes[0..8] != MAGIC {
        return Err(corrupt("bad header"));
    }
    let lsn = u64::from_le_bytes(bytes[8..16].try_into().expect("8 bytes"));
    let len = u64::from_le_bytes(bytes[16..24].try_into().expect("8 bytes")) as usize;
    let crc = u32::from_le_bytes(bytes[24..28].try_into().expect("4 bytes"));
    let body = &bytes[HEADER..];
    if body.len() != len {
        return Err(corrupt("length does not match"));
    }
    if crc32c::crc32c(body) != crc {
        return Err(corrupt("checksum mismatch"));
    }
    let image = postcard::from_bytes(body).map_err(|e| corrupt(&format!("undecodable: {e}")))?;
    Ok(Some((lsn, image)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use std::fs;
    use weft_log::PowerLoss;

    #[test]
    fn round_trip_and_damage_detection() {
        let dir = tempfile::tempdir().unwrap();
        assert!(read(dir.path()).unwrap().is_none());
        let mut image = Image::default();
        image
            .committed
            .insert(Bytes::from_static(b"k"), Bytes::from_static(b"v"));
        write(&Durability::new(), dir.path(), 77, &image).unwrap();
        let (lsn, back) = read(dir.path()).unwrap().unwrap();
        assert_eq!((lsn, back), (77, image));
        let mut raw = fs::read(path(dir.path())).unwrap();
        let last = raw.len() - 1;
        raw[last] ^= 1;
        fs::write(path(dir.path()), raw).unwrap();
        assert!(matches!(
            read(dir.path()),
            Err(SnapshotError::Corrupt { .. })
        ));
    }

    /// The first checkpoint creates `<data>/kv`: a power loss that drops every
    /// directory entry never synced must not take the snapshot with it.
    #[test]
    fn the_first_snapshot_survives_power_loss_in_a_fresh_directory() {
        let root = tempfile::tempdir().unwrap();
        let data = root.path().join("data");
        fs::create_dir(&data).unwrap();
        let dir = data.join("kv");
        let sim = PowerLoss::new();
        let mut image = Image::default();
        image
            .committed
            .insert(Bytes::from_static(b"k"), Bytes::from_static(b"v"));
        write(&Durability::simulated(&sim), &dir, 4096, &image).unwrap();
        let dropped = sim.crash().unwrap();
        assert!(dropped.is_empty(), "unsynced entries: {dropped:#?}");
        assert_eq!(read(&dir).unwrap(), Some((4096, image)));
    }

    #[test]
    fn a_log_not_reaching_from_the_snapshot_on_is_refused_naming_both() {
        let (kv, log) = (Path::new("/d/kv/kv.snapshot"), Path::new("/d/log"));
        check_covers(kv, None, log, 0, 32).unwrap();
        check_covers(kv, Some(4096), log, 4096, 4096).unwrap();
        check_covers(kv, Some(4096), log, 100, 8000).unwrap();
        let err = check_covers(kv, None, log, 4096, 8000).unwrap_err();
        let text = err.to_string();
        assert!(
            matches!(
                err,
                SnapshotError::LogPastSnapshot {
                    snapshot_lsn: None,
                    log_start: 4096,
                    ..
                }
            ),
            "{text}"
        );
        assert!(
            text.contains("/d/kv/kv.snapshot") && text.contains("/d/log"),
            "{text}"
        );
        assert!(
            text.contains("4096") && text.contains("does not exist"),
            "{text}"
        );
        let err = check_covers(kv, Some(64), log, 4096, 8000).unwrap_err();
        assert!(err.to_string().contains("before LSN 64"), "{err}");
        // A log that lost its tail below the snapshot (new records would land
        // below it and never be replayed).
        let err = check_covers(kv, Some(4096), log, 0, 32).unwrap_err();
        assert!(
            matches!(
                err,
                SnapshotError::SnapshotPastLog {
                    snapshot_lsn: 4096,
                    log_end: 32,
                    ..
                }
            ),
            "{err}"
        );
    }
}
