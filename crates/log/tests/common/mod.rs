//! Helpers shared by the integration tests: small configurations, deterministic payloads,
//! and direct access to segment files for damaging them.
#![allow(dead_code)]

use std::fs::{self, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use weft_log::{Log, LogConfig, LogRecord, Lsn, RecordTag, Recovered, SEGMENT_HEADER_LEN};

/// A log configuration with 4 KiB segments, so a few dozen records roll over several times.
pub fn tiny(dir: &Path) -> LogConfig {
    LogConfig::new(dir).segment_size(4096).max_record_size(1024)
}

/// Opens a log, panicking with the error on failure.
pub fn open(config: LogConfig) -> (Log, Recovered) {
    Log::open(config).expect("open log")
}

/// A deterministic, never-all-zero payload for record `i`, `len` bytes long.
pub fn payload(i: usize, len: usize) -> Vec<u8> {
    (0..len)
        .map(|j| ((i * 131 + j * 7) % 251) as u8 + 1)
        .collect()
}

/// Appends `n` records with sizes cycling through a fixed pattern; returns what was appended.
pub fn append_many(log: &Log, first: usize, n: usize) -> Vec<(Lsn, RecordTag, Vec<u8>)> {
    const SIZES: [usize; 7] = [0, 1, 100, 333, 7, 900, 64];
    (first..first + n)
        .map(|i| {
            let p = payload(i, SIZES[i % SIZES.len()]);
            let tag = RecordTag((i % 5) as u16);
            let lsn = log.append(tag, &p).expect("append");
            (lsn, tag, p)
        })
        .collect()
}

/// Asserts that recovered records equal the expected ones exactly.
pub fn assert_records(got: &[LogRecord], want: &[(Lsn, RecordTag, Vec<u8>)]) {
    let got: Vec<(Lsn, RecordTag, Vec<u8>)> = got
        .iter()
        .map(|r| (r.lsn, r.tag, r.payload.to_vec()))
        .collect();
    assert_eq!(got.len(), want.len(), "record count");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(g, w, "record {i} differs");
    }
}

/// The path of the segment file starting at `base`.
pub fn segment_path(dir: &Path, base: Lsn) -> PathBuf {
    dir.join(format!("{:016x}.wlog", base.get()))
}

/// Segment bases present in `dir`, sorted.
pub fn segment_bases(dir: &Path) -> Vec<Lsn> {
    let mut v: Vec<Lsn> = fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| {
            let name = e.unwrap().file_name().into_string().unwrap();
            let hex = name.strip_suffix(".wlog")?;
            Some(Lsn(u64::from_str_radix(hex, 16).unwrap()))
        })
        .collect();
    v.sort();
    v
}

/// The segment file holding `lsn`, and the offset of `lsn` inside it.
pub fn locate(dir: &Path, lsn: Lsn) -> (PathBuf, u64) {
    let base = *segment_bases(dir)
        .iter()
        .rev()
        .find(|b| **b <= lsn)
        .expect("a segment holds the lsn");
    assert!(lsn.get() >= base.get() + SEGMENT_HEADER_LEN);
    (segment_path(dir, base), lsn.get() - base.get())
}

/// Truncates a file to `len` bytes.
pub fn truncate_file(path: &Path, len: u64) {
    OpenOptions::new()
        .write(true)
        .open(path)
        .unwrap()
        .set_len(len)
        .unwrap();
}

/// XORs one byte of a file with `mask`.
pub fn flip_byte(path: &Path, offset: u64, mask: u8) {
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .unwrap();
    let mut b = [0u8];
    f.read_exact_at(&mut b, offset).unwrap();
    b[0] ^= mask;
    f.write_all_at(&b, offset).unwrap();
}

/// Writes bytes at an offset of a file.
pub fn write_at(path: &Path, offset: u64, bytes: &[u8]) {
    let f = OpenOptions::new().write(true).open(path).unwrap();
    f.write_all_at(bytes, offset).unwrap();
}
