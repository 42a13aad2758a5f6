//! Segment files: naming, the segment header, and creating a segment durably.
//!
//! Owns: the `<16 hex digits>.wlog` naming scheme, the 32-byte segment header codec,
//! preallocation, and the create-then-rename dance that makes a new segment appear in the
//! directory only once its header is on disk. Must never: interpret records (that is
//! `record`), decide when to roll (that is the append path in `state`), or delete segments
//! (that is `recovery` and `Log::truncate_before`).
//!
//! Header layout (little-endian):
//!
//! | offset | size | field                                   |
//! |-------:|-----:|-----------------------------------------|
//! | 0      | 8    | magic `b"WEFTLOG\0"`                    |
//! | 8      | 4    | format version (1)                      |
//! | 12     | 4    | header length (32)                      |
//! | 16     | 8    | base LSN: log position of byte 0 here   |
//! | 24     | 4    | reserved, 0                             |
//! | 28     | 4    | CRC32C of bytes 0..28                   |

use std::path::{Path, PathBuf};

use crate::durable::Durability;
use crate::error::{LogError, Result};
use crate::storage::StorageFile;

/// Bytes in a segment header; the first record of a segment starts right after it.
pub const SEGMENT_HEADER_LEN: u64 = 32;
/// The eight bytes every segment file starts with.
const SEGMENT_MAGIC: [u8; 8] = *b"WEFTLOG\0";
/// The on-disk format version this crate writes and reads.
pub(crate) const FORMAT_VERSION: u32 = 1;
/// File name suffix of a segment.
pub(crate) const SEGMENT_SUFFIX: &str = ".wlog";
/// Suffix of a segment being created; such files are removed on open.
pub(crate) const TMP_SUFFIX: &str = ".tmp";

/// The file name of the segment whose byte 0 has log position `base`.
pub(crate) fn file_name(base: u64) -> String {
    format!("{base:016x}{SEGMENT_SUFFIX}")
}

/// The path of the segment starting at `base` in `dir`.
pub(crate) fn path(dir: &Path, base: u64) -> PathBuf {
    dir.join(file_name(base))
}

/// Parses a segment file name back into its base position; `None` for any other file.
pub(crate) fn parse_file_name(name: &str) -> Option<u64> {
    let hex = name.strip_suffix(SEGMENT_SUFFIX)?;
    if hex.len() != 16 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    u64::from_str_radix(hex, 16).ok()
}

/// Encodes the header of the segment starting at `base`.
pub(crate) fn encode_header(base: u64) -> [u8; SEGMENT_HEADER_LEN as usize] {
    let mut h = [0u8; SEGMENT_HEADER_LEN as usize];
    h[0..8].copy_from_slice(&SEGMENT_MAGIC);
    h[8..12].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
    h[12..16].copy_from_slice(&(SEGMENT_HEADER_LEN as u32).to_le_bytes());
    h[16..24].copy_from_slice(&base.to_le_bytes());
    let crc = crc32c::crc32c(&h[0..28]);
    h[28..32].copy_from_slice(&crc.to_le_bytes());
    h
}

/// Decodes and checks a segment header; returns the base position it records.
///
/// Returns a description of the first failed check (length, magic, checksum, version,
/// header length) as the error.
pub(crate) fn decode_header(bytes: &[u8]) -> std::result::Result<u64, String> {
    let Some(h) = bytes.get(..SEGMENT_HEADER_LEN as usize) else {
        return Err(format!(
            "segment header torn: file has {} bytes",
            bytes.len()
        ));
    };
    if h[0..8] != SEGMENT_MAGIC {
        return Err("bad segment magic".to_string());
    }
    let stored = u32::from_le_bytes(h[28..32].try_into().expect("4 bytes"));
    let crc = crc32c::crc32c(&h[0..28]);
    if stored != crc {
        return Err(format!(
            "segment header checksum mismatch: stored {stored:#010x}, computed {crc:#010x}"
        ));
    }
    let version = u32::from_le_bytes(h[8..12].try_into().expect("4 bytes"));
    if version != FORMAT_VERSION {
        return Err(format!("unsupported segment format version {version}"));
    }
    let header_len = u32::from_le_bytes(h[12..16].try_into().expect("4 bytes"));
    if u64::from(header_len) != SEGMENT_HEADER_LEN {
        return Err(format!("unexpected segment header length {header_len}"));
    }
    Ok(u64::from_le_bytes(h[16..24].try_into().expect("8 bytes")))
}

/// Creates the segment starting at `base` and returns it open for writing.
///
/// The file is written under a temporary name (header, preallocation, fsync), renamed into
/// place and the directory fsynced ([`Durability::rename`]), so after a crash a `.wlog` file
/// either does not exist or has a valid header. Returns [`LogError::Io`] if any step fails,
/// and removes the temporary file on a best-effort basis.
pub(crate) fn create(
    dur: &Durability,
    dir: &Path,
    base: u64,
    size: u64,
    preallocate: bool,
) -> Result<Box<dyn StorageFile>> {
    let final_path = path(dir, base);
    let tmp_path = dir.join(format!("{}{TMP_SUFFIX}", file_name(base)));
    let ctx = |what: &str| format!("{what} segment {}", final_path.display());
    let result = (|| {
        let file = dur
            .create(&tmp_path)
            .map_err(|e| LogError::io(ctx("creating"), e))?;
        if preallocate {
            file.allocate(size)
                .map_err(|e| LogError::io(ctx("preallocating"), e))?;
        }
        file.write_all_at(&encode_header(base), 0)
            .map_err(|e| LogError::io(ctx("writing the header of"), e))?;
        file.sync_all()
            .map_err(|e| LogError::io(ctx("syncing the new"), e))?;
        dur.rename(&tmp_path, &final_path)
            .map_err(|e| LogError::io(ctx("renaming (and syncing the directory of)"), e))?;
        Ok(file)
    })();
    if result.is_err() {
        let _ = dur.remove_file(&tmp_path);
    }
    result
}

/// Opens an existing segment for reading and writing. Returns [`LogError::Io`] on failure.
pub(crate) fn open(dur: &Durability, dir: &Path, base: u64) -> Result<Box<dyn StorageFile>> {
    let p = path(dir, base);
    dur.open(&p)
        .map_err(|e| LogError::io(format!("opening segment {}", p.display()), e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_others_are_ignored() {
        assert_eq!(file_name(0x1234), "0000000000001234.wlog");
        assert_eq!(parse_file_name("0000000000001234.wlog"), Some(0x1234));
        assert_eq!(parse_file_name("1234.wlog"), None);
        assert_eq!(parse_file_name("0000000000001234.wlog.tmp"), None);
        assert_eq!(parse_file_name("log.meta"), None);
        assert_eq!(parse_file_name("+000000000001234.wlog"), None);
    }

    #[test]
    fn header_round_trips_and_damage_is_detected() {
        let h = encode_header(4096);
        assert_eq!(decode_header(&h), Ok(4096));
        for i in 0..h.len() {
            let mut bad = h;
            bad[i] ^= 0x10;
            assert!(decode_header(&bad).is_err(), "flip at {i}");
        }
        assert!(decode_header(&h[..31]).is_err());
    }
}
