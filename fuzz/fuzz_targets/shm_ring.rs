//! Fuzz target: the shared-memory ring (`weft_transport`'s `shm::ring`): the real producer
//! and consumer of ring 0 of a heap segment, with a hostile peer that may store any value in
//! any word of the segment between operations.
//!
//! Checked beyond "no panic":
//! - differential: before every read, a plain reference reader (written from the record
//!   format in `ring.rs`'s module comment) decides from the segment's words what the read must
//!   return; the real consumer must return exactly those bytes, or fail exactly where the
//!   reference finds a bad header. So the reader never returns a byte that is not in the ring;
//! - a read appends what it says, and stops within one record of `max_bytes`;
//! - while the peer has not touched ring 0's data or its consumer position, the stream read
//!   is exactly the stream written (stores to other words, ring 1 traffic included, change
//!   nothing);
//! - the header check (`Layout::read`) never accepts a ring size other than the segment's.
#![no_main]

use std::sync::atomic::Ordering;

use arbitrary::{Result, Unstructured};
use bytes::BytesMut;
use libfuzzer_sys::fuzz_target;
use weft_transport::fuzzing::{RingConsumer, RingProducer, RingSegment};

const TAG_SALT: u32 = 0x5746_5452;

/// What a read must do, worked out independently from the record format.
#[derive(Debug, PartialEq)]
enum Expect {
    Bytes(Vec<u8>, u64),
    Corrupt(u64),
}

fn reference_read(seg: &RingSegment, mut tail: u64, max_bytes: usize) -> Expect {
    let words = seg.words();
    let start = seg.ring_start_word(0);
    let n = (seg.ring_bytes() / 8) as u64;
    let word = |pos: u64| words[start + ((pos / 8) % n) as usize].load(Ordering::Relaxed);
    let mut out = Vec::new();
    while out.len() < max_bytes {
        let h = word(tail);
        if h == 0 {
            break;
        }
        let len = (h & 0xffff_ffff) as usize;
        let tag = ((tail / 8) as u32) ^ TAG_SALT;
        if (h >> 32) as u32 != tag || len == 0 || len > seg.max_record() {
            return Expect::Corrupt(tail);
        }
        let nw = len.div_ceil(8) as u64;
        let mut rec = Vec::new();
        for i in 0..nw {
            rec.extend_from_slice(&word(tail + 8 + i * 8).to_le_bytes());
        }
        rec.truncate(len);
        out.extend_from_slice(&rec);
        tail += 8 + nw * 8;
    }
    Expect::Bytes(out, tail)
}

fn pattern(n: usize, seed: u8, at: usize) -> Vec<u8> {
    (0..n)
        .map(|i| ((at + i) as u8).wrapping_mul(31) ^ seed)
        .collect()
}

fn run(u: &mut Unstructured) -> Result<()> {
    let ring_bytes = if u.arbitrary::<bool>()? { 4096 } else { 8192 };
    let seg = RingSegment::new(ring_bytes).expect("valid size");
    let total_words = seg.words().len();
    let data0 = seg.ring_start_word(0)..seg.ring_start_word(0) + ring_bytes / 8;
    let tail0_word = 8 * 5; // ring 0's consumer position (line 5)
    let mut p0 = RingProducer::default();
    let mut p1 = RingProducer::default();
    let mut c0 = RingConsumer::default();
    let mut written: Vec<u8> = Vec::new();
    let mut read = BytesMut::new();
    let mut clean = true;
    let mut dead = false;
    let mut producer_dead = false;
    let seed: u8 = u.arbitrary()?;

    for _ in 0..96 {
        if u.is_empty() {
            break;
        }
        match u.int_in_range(0..=5)? {
            0 | 1 if !producer_dead => {
                let n = u.int_in_range(0..=3000)?;
                let bytes = pattern(n, seed, written.len());
                match p0.write(&seg, 0, &bytes) {
                    Ok(k) => {
                        assert!(k <= n && k <= seg.max_record());
                        written.extend_from_slice(&bytes[..k]);
                    }
                    Err(_) => {
                        assert!(!clean, "the producer failed on an untouched ring");
                        producer_dead = true;
                    }
                }
            }
            2 | 3 if !dead => {
                let max = u.int_in_range(1..=9000)?;
                let expect = reference_read(&seg, c0.tail(), max);
                let before = read.len();
                match (c0.read(&seg, 0, &mut read, max), expect) {
                    (Ok(got), Expect::Bytes(bytes, tail)) => {
                        assert_eq!(read.len() - before, got, "read appended a different count");
                        assert_eq!(&read[before..], &bytes[..], "read returned other bytes");
                        assert_eq!(c0.tail(), tail, "consumer position");
                        assert!(got < max + seg.max_record(), "read far past max_bytes");
                        if got > 0 {
                            let published = seg.words()[tail0_word].load(Ordering::Relaxed);
                            assert_eq!(published, tail, "position not published");
                        }
                    }
                    (Err(_), Expect::Corrupt(at)) => {
                        assert!(!clean, "a corrupt record on an untouched ring");
                        assert_eq!(c0.tail(), at, "failed at another position");
                        dead = true;
                    }
                    (got, want) => panic!("reader {got:?}, reference {want:?}"),
                }
                if clean {
                    assert_eq!(&read[..], &written[..read.len()], "stream differs");
                }
            }
            4 => {
                let i = u.choose_index(total_words)?;
                let v: u64 = match u.int_in_range(0..=3)? {
                    0 => u.arbitrary()?,
                    1 => 0,
                    // Something header-like: a plausible tag and length.
                    2 => {
                        let pos = u.int_in_range(0..=64u64)? * 8;
                        (u64::from(((pos / 8) as u32) ^ TAG_SALT) << 32)
                            | u64::from(u.int_in_range(0..=5000u32)?)
                    }
                    _ => seg.words()[u.choose_index(total_words)?].load(Ordering::Relaxed),
                };
                seg.words()[i].store(v, Ordering::Relaxed);
                if data0.contains(&i) || i == tail0_word {
                    clean = false;
                }
                if i < 4 {
                    // The header: accepted only with this segment's own ring size.
                    if let Ok(r) = RingSegment::read_header(seg.words()) {
                        assert_eq!(r, ring_bytes, "header accepted a foreign ring size");
                    }
                }
            }
            _ => {
                // Traffic on the other ring must not reach ring 0.
                let n = u.int_in_range(0..=2000)?;
                let _ = p1.write(&seg, 1, &pattern(n, !seed, 0));
            }
        }
    }
    if clean && !dead {
        // Everything written arrives.
        let mut rest = BytesMut::new();
        while c0.read(&seg, 0, &mut rest, usize::MAX).expect("clean ring") > 0 {}
        read.extend_from_slice(&rest);
        assert_eq!(&read[..], &written[..], "stream lost or changed bytes");
    }
    Ok(())
}

fuzz_target!(|data: &[u8]| {
    let _ = run(&mut Unstructured::new(data));
});
