//! Snapshot files of the KV store: the committed map and the prepared write
//! sets as of a log position, written atomically and checksummed.
//!
//! Layout: magic `WKVSNAP1` (8 bytes), log position (u64 LE), body length
//! (u64 LE), CRC32C of the body (u32 LE), body (postcard [`Image`]).
//! Owns that file and nothing else. Must never replace a good snapshot with
//! a partial one: write to a temporary file, fsync, rename, fsync the
//! directory.

use std::fs::{self, File};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};

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
}

fn io_err(context: impl Into<String>) -> impl FnOnce(io::Error) -> SnapshotError {
    let context = context.into();
    move |source| SnapshotError::Io { context, source }
}

/// The snapshot file in `dir`.
pub fn path(dir: &Path) -> PathBuf {
    dir.join("kv.snapshot")
}

/// Writes `image`, valid as of log position `lsn`, atomically to `dir`.
///
/// Fails with [`SnapshotError::Io`]; the previous snapshot is then intact.
pub fn write(dir: &Path, lsn: u64, image: &Image) -> Result<(), SnapshotError> {
    fs::create_dir_all(dir).map_err(io_err(format!("creating {}", dir.display())))?;
    let body = postcard::to_allocvec(image).map_err(|e| SnapshotError::Io {
        context: "encoding the snapshot".into(),
        source: io::Error::other(e.to_string()),
    })?;
    let tmp = dir.join("kv.snapshot.tmp");
    {
        let mut f = File::create(&tmp).map_err(io_err(format!("creating {}", tmp.display())))?;
        let mut head = Vec::with_capacity(HEADER);
        head.extend_from_slice(MAGIC);
        head.extend_from_slice(&lsn.to_le_bytes());
        head.extend_from_slice(&(body.len() as u64).to_le_bytes());
        head.extend_from_slice(&crc32c::crc32c(&body).to_le_bytes());
        f.write_all(&head)
            .and_then(|()| f.write_all(&body))
            .map_err(io_err("writing the snapshot"))?;
        f.sync_all().map_err(io_err("syncing the snapshot"))?;
    }
    fs::rename(&tmp, path(dir)).map_err(io_err("renaming the snapshot"))?;
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io_err("syncing the snapshot directory"))?;
    Ok(())
}

/// Reads the snapshot in `dir`: `None` when there is none.
///
/// Fails with [`SnapshotError::Corrupt`] when the file exists but does not
/// check out (a snapshot is only ever replaced atomically, so this is damage,
/// not a crash), [`SnapshotError::Io`] otherwise.
pub fn read(dir: &Path) -> Result<Option<(u64, Image)>, SnapshotError> {
    let p = path(dir);
    let mut f = match File::open(&p) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io_err(format!("opening {}", p.display()))(e)),
    };
    let mut bytes = Vec::new();
    f.read_to_end(&mut bytes)
        .map_err(io_err(format!("reading {}", p.display())))?;
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

    #[test]
    fn round_trip_and_damage_detection() {
        let dir = tempfile::tempdir().unwrap();
        assert!(read(dir.path()).unwrap().is_none());
        let mut image = Image::default();
        image
            .committed
            .insert(Bytes::from_static(b"k"), Bytes::from_static(b"v"));
        write(dir.path(), 77, &image).unwrap();
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
}
