//! `log.meta`: the small file that remembers where the log starts after a checkpoint.
//!
//! Owns: the meta file's 32-byte format and its atomic replacement (write a temporary file,
//! fsync it, rename it over the old one, fsync the directory). Must never: be written in place,
//! or be trusted when its checksum fails.
//!
//! Layout (little-endian): magic `b"WEFTMETA"` (8), version u32 (4), reserved u32 (4),
//! first LSN u64 (8), CRC32C of bytes 0..24 (4), zero padding (4).

use std::io::ErrorKind;
use std::path::Path;

use crate::durable::Durability;
use crate::error::{LogError, Result};
use crate::lsn::Lsn;
use crate::segment::{FORMAT_VERSION, TMP_SUFFIX};

/// Name of the meta file inside the log directory.
pub(crate) const META_FILE: &str = "log.meta";
const META_MAGIC: [u8; 8] = *b"WEFTMETA";
const META_LEN: usize = 32;

/// Reads the first retained LSN from `dir/log.meta`; `None` if the file does not exist.
///
/// Returns [`LogError::Corrupt`] if the file exists but fails its checks (renames are atomic,
/// so a damaged meta file means damaged media, and guessing the start could replay records a
/// checkpoint already covers), and [`LogError::Io`] if it cannot be read.
pub(crate) fn read(dur: &Durability, dir: &Path) -> Result<Option<u64>> {
    let path = dir.join(META_FILE);
    let bytes = match dur.read(&path) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(LogError::io(format!("reading {}", path.display()), e)),
    };
    let corrupt = |reason: String| LogError::Corrupt {
        lsn: Lsn::ZERO,
        reason: format!("{}: {reason}", path.display()),
    };
    if bytes.len() != META_LEN {
        return Err(corrupt(format!(
            "{} bytes, expected {META_LEN}",
            bytes.len()
        )));
    }
    if bytes[0..8] != META_MAGIC {
        return Err(corrupt("bad magic".to_string()));
    }
    let stored = u32::from_le_bytes(bytes[24..28].try_into().expect("4 bytes"));
    if stored != crc32c::crc32c(&bytes[0..24]) {
        return Err(corrupt("checksum mismatch".to_string()));
    }
    let version = u32::from_le_bytes(bytes[8..12].try_into().expect("4 bytes"));
    if version != FORMAT_VERSION {
        return Err(corrupt(format!("unsupported version {version}")));
    }
    Ok(Some(u64::from_le_bytes(
        bytes[16..24].try_into().expect("8 bytes"),
    )))
}

/// Atomically replaces `dir/log.meta` with one recording `first_lsn`.
/// Returns [`LogError::Io`] if any step fails; the old file then stays in force.
pub(crate) fn write(dur: &Durability, dir: &Path, first_lsn: u64) -> Result<()> {
    let mut bytes = [0u8; META_LEN];
    bytes[0..8].copy_from_slice(&META_MAGIC);
    bytes[8..12].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
    bytes[16..24].copy_from_slice(&first_lsn.to_le_bytes());
    let crc = crc32c::crc32c(&bytes[0..24]);
    bytes[24..28].copy_from_slice(&crc.to_le_bytes());

    let path = dir.join(META_FILE);
    let tmp = dir.join(format!("{META_FILE}{TMP_SUFFIX}"));
    let ctx = |what: &str| format!("{what} {}", tmp.display());
    let f = dur
        .create(&tmp)
        .map_err(|e| LogError::io(ctx("creating"), e))?;
    f.write_all_at(&bytes, 0)
        .map_err(|e| LogError::io(ctx("writing"), e))?;
    f.sync_all().map_err(|e| LogError::io(ctx("syncing"), e))?;
    drop(f);
    dur.rename(&tmp, &path)
        .map_err(|e| LogError::io(format!("renaming {} into place", tmp.display()), e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn meta_round_trips_and_damage_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let dur = Durability::new();
        assert_eq!(read(&dur, dir.path()).unwrap(), None);
        write(&dur, dir.path(), 4096).unwrap();
        assert_eq!(read(&dur, dir.path()).unwrap(), Some(4096));
        write(&dur, dir.path(), 8192).unwrap();
        assert_eq!(read(&dur, dir.path()).unwrap(), Some(8192));
        let p = dir.path().join(META_FILE);
        let mut bytes = std::fs::read(&p).unwrap();
        bytes[17] ^= 1;
        std::fs::write(&p, &bytes).unwrap();
        assert!(matches!(
            read(&dur, dir.path()),
            Err(LogError::Corrupt { .. })
        ));
    }
}
