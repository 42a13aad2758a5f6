//! The segment layout and the single-producer single-consumer byte ring, as
//! safe code over a slice of `AtomicU64` words (a shared mapping in
//! production, a plain heap buffer in tests).
//!
//! Owns the positions of every word in a segment and the record format.
//! Must never trust a value read from the segment: the peer may be hostile
//! or corrupt, so every index is masked into the ring, every length and
//! position is checked, and our own positions live in process memory and are
//! only ever *stored* to the segment, never loaded back.
//!
//! ## Segment layout (all little-endian 64-bit words)
//!
//! ```text
//! page 0 (4096 bytes), one 64-byte line per control word:
//!   word 0   magic "weftshm1"     word 1  layout version (1)
//!   word 2   ring bytes (each)    word 3  creator's pid
//!   line 1   doorbell of side 0   (futex word: 1 = that side sleeps)
//!   line 2   doorbell of side 1
//!   line 3   side 0 closed        line 4  side 1 closed (orderly close)
//!   line 5   ring 0 consumer position ("tail")
//!   line 6   ring 0 space wanted  (its producer waits for room)
//!   line 7   ring 1 tail          line 8  ring 1 space wanted
//!   line 9   CPU side 0's reader last ran on   line 10  same for side 1
//! ring 0 data (side 0 -> side 1), ring_bytes bytes
//! ring 1 data (side 1 -> side 0), ring_bytes bytes
//! ```
//!
//! Side 0 created the segment (the initiator); side `s` produces ring `s`
//! and consumes ring `1 - s`.
//!
//! ## Records
//!
//! A ring carries a byte stream (weft frames back to back, decoded with the
//! one codec in `weft_wire`) cut into records. A record at byte position
//! `p` (a multiple of 8, counted from the start, never wrapping) is a header
//! word `tag(p) << 32 | len` followed by `len` bytes padded to whole words;
//! the data may wrap around the end of the ring. The producer writes the
//! data, then a zero word right after the record (so the next header slot
//! reads "empty", whatever an earlier lap left there), then publishes the
//! header with a release store. The consumer polls the header slot at its
//! position: zero means empty, a header with the right tag and a sane length
//! is a record, anything else is corruption. After reading it publishes its
//! position ("tail"); the producer reads it to know how much room is left.
//! Because the consumer spins on the header word itself (not on a separate
//! head counter), a message costs one cache-line transfer to notice.

use std::sync::atomic::{AtomicU64, Ordering};

use bytes::BytesMut;

/// "weftshm1" as a little-endian word.
pub(crate) const MAGIC: u64 = u64::from_le_bytes(*b"weftshm1");
/// Version of this layout.
pub(crate) const LAYOUT_VERSION: u64 = 1;
/// Bytes before the first ring.
pub(crate) const HEADER_BYTES: usize = 4096;
/// Smallest ring accepted.
pub(crate) const MIN_RING_BYTES: usize = 4096;
/// Largest ring accepted.
pub(crate) const MAX_RING_BYTES: usize = 1 << 28;

const WORD: u64 = 8;
const LINE: usize = 8; // words per 64-byte cache line
const W_MAGIC: usize = 0;
const W_VERSION: usize = 1;
const W_RING_BYTES: usize = 2;
const W_CREATOR_PID: usize = 3;
const TAG_SALT: u32 = 0x5746_5452;

fn doorbell_word(side: usize) -> usize {
    LINE * (1 + side)
}
fn closed_word(side: usize) -> usize {
    LINE * (3 + side)
}
fn tail_word(ring: usize) -> usize {
    LINE * (5 + 2 * ring)
}
fn wanted_word(ring: usize) -> usize {
    LINE * (6 + 2 * ring)
}
fn cpu_word(side: usize) -> usize {
    LINE * (9 + side)
}

/// Why a segment's contents cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum RingError {
    /// The segment header is not a weft segment of this version.
    #[error("bad segment header: {0}")]
    Header(String),
    /// A record header at the consumer's position is neither empty nor valid.
    #[error("corrupt record header {word:#018x} at position {pos}")]
    Record {
        /// The consumer's position.
        pos: u64,
        /// The word found there.
        word: u64,
    },
    /// The consumer published a position the producer never reached.
    #[error("consumer position {tail} impossible (producer at {head}, previous {previous})")]
    Tail {
        /// Published consumer position.
        tail: u64,
        /// Producer position.
        head: u64,
        /// Last consumer position seen.
        previous: u64,
    },
}

/// Where everything lives in a segment with rings of `ring_bytes` bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Layout {
    ring_bytes: usize,
}

impl Layout {
    /// A layout with rings of `ring_bytes` bytes each.
    ///
    /// Fails unless `ring_bytes` is a power of two within
    /// [`MIN_RING_BYTES`]..=[`MAX_RING_BYTES`].
    pub(crate) fn new(ring_bytes: usize) -> Result<Layout, String> {
        if !ring_bytes.is_power_of_two() || !(MIN_RING_BYTES..=MAX_RING_BYTES).contains(&ring_bytes)
        {
            return Err(format!(
                "shm ring size must be a power of two between {MIN_RING_BYTES} and \
                 {MAX_RING_BYTES} bytes, not {ring_bytes}"
            ));
        }
        Ok(Layout { ring_bytes })
    }

    /// Bytes of each ring.
    pub(crate) fn ring_bytes(&self) -> usize {
        self.ring_bytes
    }

    /// Size of the whole segment.
    pub(crate) fn segment_bytes(&self) -> usize {
        HEADER_BYTES + 2 * self.ring_bytes
    }

    /// Largest segment any acceptable layout needs.
    pub(crate) fn max_segment_bytes() -> usize {
        HEADER_BYTES + 2 * MAX_RING_BYTES
    }

    /// Smallest segment any acceptable layout needs.
    pub(crate) fn min_segment_bytes() -> usize {
        HEADER_BYTES + 2 * MIN_RING_BYTES
    }

    /// Writes the header of a fresh segment (the creator does this before
    /// the peer ever sees it).
    pub(crate) fn init(&self, words: &[AtomicU64], creator_pid: u32) {
        debug_assert_eq!(words.len() * 8, self.segment_bytes());
        words[W_VERSION].store(LAYOUT_VERSION, Ordering::Relaxed);
        words[W_RING_BYTES].store(self.ring_bytes as u64, Ordering::Relaxed);
        words[W_CREATOR_PID].store(u64::from(creator_pid), Ordering::Relaxed);
        words[W_MAGIC].store(MAGIC, Ordering::Release);
    }

    /// Reads and checks the header of a segment of `words.len()` words that a
    /// peer created. Reads each field once.
    ///
    /// Fails with [`RingError::Header`] for a wrong magic or version, a
    /// bad ring size, or a size that does not match the segment.
    pub(crate) fn read(words: &[AtomicU64]) -> Result<Layout, RingError> {
        if words.len() * 8 < HEADER_BYTES {
            return Err(RingError::Header("segment smaller than its header".into()));
        }
        let magic = words[W_MAGIC].load(Ordering::Acquire);
        if magic != MAGIC {
            return Err(RingError::Header(format!("magic {magic:#x}")));
        }
        let version = words[W_VERSION].load(Ordering::Relaxed);
        if version != LAYOUT_VERSION {
            return Err(RingError::Header(format!(
                "layout version {version}, this node speaks {LAYOUT_VERSION}"
            )));
        }
        let ring = words[W_RING_BYTES].load(Ordering::Relaxed);
        let layout = usize::try_from(ring)
            .map_err(|_| RingError::Header(format!("ring size {ring}")))
            .and_then(|r| Layout::new(r).map_err(RingError::Header))?;
        if layout.segment_bytes() != words.len() * 8 {
            return Err(RingError::Header(format!(
                "rings of {ring} bytes need a {} byte segment, this one has {}",
                layout.segment_bytes(),
                words.len() * 8
            )));
        }
        Ok(layout)
    }

    /// The futex word of `side` (0 awake, 1 asleep).
    pub(crate) fn doorbell<'a>(&self, words: &'a [AtomicU64], side: usize) -> &'a AtomicU64 {
        &words[doorbell_word(side & 1)]
    }

    /// The CPU `side`'s reader last ran on (a hint: a waiter on the same CPU
    /// yields instead of spinning).
    pub(crate) fn cpu<'a>(&self, words: &'a [AtomicU64], side: usize) -> &'a AtomicU64 {
        &words[cpu_word(side & 1)]
    }

    /// The orderly-close flag of `side`.
    pub(crate) fn closed<'a>(&self, words: &'a [AtomicU64], side: usize) -> &'a AtomicU64 {
        &words[closed_word(side & 1)]
    }

    /// Ring `r` (0: side 0 to side 1; 1: side 1 to side 0).
    pub(crate) fn ring<'a>(&self, words: &'a [AtomicU64], r: usize) -> Ring<'a> {
        debug_assert_eq!(words.len() * 8, self.segment_bytes());
        let r = r & 1;
        let start = (HEADER_BYTES + r * self.ring_bytes) / 8;
        Ring {
            data: &words[start..start + self.ring_bytes / 8],
            tail: &words[tail_word(r)],
            space_wanted: &words[wanted_word(r)],
        }
    }
}

/// One ring: its data words and its two control words.
#[derive(Clone, Copy)]
pub(crate) struct Ring<'a> {
    data: &'a [AtomicU64],
    /// Consumer position, published by the consumer.
    pub(crate) tail: &'a AtomicU64,
    /// Set by the producer when it has bytes waiting for room; cleared by the
    /// consumer, which then rings the producer's doorbell.
    pub(crate) space_wanted: &'a AtomicU64,
}

fn tag(pos: u64) -> u32 {
    ((pos / WORD) as u32) ^ TAG_SALT
}

fn header(pos: u64, len: usize) -> u64 {
    (u64::from(tag(pos)) << 32) | len as u64
}

fn words_for(len: usize) -> u64 {
    (len as u64).div_ceil(WORD)
}

impl Ring<'_> {
    fn mask(&self) -> u64 {
        self.data.len() as u64 - 1
    }

    fn word(&self, pos: u64) -> &AtomicU64 {
        // Masked: always inside the ring, whatever `pos` is.
        &self.data[((pos / WORD) & self.mask()) as usize]
    }

    /// Bytes in the ring.
    pub(crate) fn capacity(&self) -> usize {
        self.data.len() * 8
    }

    /// Largest payload of one record: a quarter of the ring, so a big write
    /// is cut into pieces the consumer can start on early.
    pub(crate) fn max_record(&self) -> usize {
        self.capacity() / 4
    }

    /// The run of `n` words from byte position `pos` on, when it does not
    /// wrap around the end of the ring.
    fn run(&self, pos: u64, n: usize) -> Option<&[AtomicU64]> {
        let start = ((pos / WORD) & self.mask()) as usize;
        self.data.get(start..start + n)
    }

    /// Stores `bytes` from byte position `pos` on, eight to a word, the
    /// last word padded with zeros.
    fn store(&self, pos: u64, bytes: &[u8]) {
        let (whole, rest) = bytes.as_chunks::<8>();
        let tail = (!rest.is_empty()).then(|| {
            rest.iter()
                .enumerate()
                .fold(0u64, |w, (i, b)| w | u64::from(*b) << (8 * i))
        });
        let n = whole.len() + usize::from(tail.is_some());
        match self.run(pos, n) {
            Some(run) => {
                for (word, chunk) in run.iter().zip(whole) {
                    word.store(u64::from_le_bytes(*chunk), Ordering::Relaxed);
                }
                if let (Some(w), Some(last)) = (tail, run.last()) {
                    last.store(w, Ordering::Relaxed);
                }
            }
            None => {
                let words = whole.iter().map(|c| u64::from_le_bytes(*c)).chain(tail);
                for (i, w) in words.enumerate() {
                    self.word(pos + i as u64 * WORD).store(w, Ordering::Relaxed);
                }
            }
        }
    }

    /// Fills `out` (whole words) with the words from byte position `pos` on.
    fn load(&self, pos: u64, out: &mut [u8]) {
        let (words, _) = out.as_chunks_mut::<8>();
        match self.run(pos, words.len()) {
            Some(run) => {
                for (dst, word) in words.iter_mut().zip(run) {
                    *dst = word.load(Ordering::Relaxed).to_le_bytes();
                }
            }
            None => {
                for (i, dst) in words.iter_mut().enumerate() {
                    *dst = self
                        .word(pos + i as u64 * WORD)
                        .load(Ordering::Relaxed)
                        .to_le_bytes();
                }
            }
        }
    }

    /// True when a record (or garbage) waits at consumer position `tail`.
    pub(crate) fn has_data_at(&self, tail: u64) -> bool {
        self.word(tail).load(Ordering::Relaxed) != 0
    }
}

/// The producer's side of one ring; its position lives here, not in the
/// segment.
#[derive(Debug, Default)]
pub(crate) struct Producer {
    head: u64,
    seen_tail: u64,
}

impl Producer {
    fn free_words(&self, cap_words: u64) -> u64 {
        cap_words - (self.head - self.seen_tail) / WORD
    }

    fn refresh_tail(&mut self, ring: &Ring<'_>) -> Result<(), RingError> {
        let tail = ring.tail.load(Ordering::Acquire);
        let cap = ring.capacity() as u64;
        if !tail.is_multiple_of(WORD)
            || tail < self.seen_tail
            || tail > self.head
            || self.head - tail > cap
        {
            return Err(RingError::Tail {
                tail,
                head: self.head,
                previous: self.seen_tail,
            });
        }
        self.seen_tail = tail;
        Ok(())
    }

    /// Writes a prefix of `bytes` (as much as fits, at most
    /// [`Ring::max_record`]) as one record and publishes it. Returns how many
    /// bytes were written: 0 when the ring has no room.
    ///
    /// Fails with [`RingError::Tail`] when the consumer published an
    /// impossible position.
    pub(crate) fn write(&mut self, ring: &Ring<'_>, bytes: &[u8]) -> Result<usize, RingError> {
        let want = bytes.len().min(ring.max_record());
        if want == 0 {
            return Ok(0);
        }
        let cap_words = ring.data.len() as u64;
        // Room for the header, the data and the zero word after the record.
        if self.free_words(cap_words) < 2 + words_for(want) {
            self.refresh_tail(ring)?;
        }
        let free = self.free_words(cap_words);
        if free < 3 {
            return Ok(0);
        }
        let len = want.min(((free - 2) * WORD) as usize);
        let data = self.head + WORD;
        ring.store(data, &bytes[..len]);
        let end = data + words_for(len) * WORD;
        ring.word(end).store(0, Ordering::Relaxed);
        ring.word(self.head)
            .store(header(self.head, len), Ordering::Release);
        self.head = end;
        Ok(len)
    }

    /// The consumer position this producer last read.
    pub(crate) fn seen_tail(&self) -> u64 {
        self.seen_tail
    }

    /// The producer's position.
    #[cfg(test)]
    pub(crate) fn head(&self) -> u64 {
        self.head
    }
}

/// The consumer's side of one ring; its position lives here, not in the
/// segment.
#[derive(Debug, Default)]
pub(crate) struct Consumer {
    tail: u64,
}

impl Consumer {
    /// The consumer's position.
    pub(crate) fn tail(&self) -> u64 {
        self.tail
    }

    /// Appends the payloads of the records waiting in the ring to `out`
    /// (stopping once `max_bytes` were read) and publishes the new position.
    /// Returns the number of bytes appended.
    ///
    /// Fails with [`RingError::Record`] when the slot at the position holds
    /// neither zero nor a valid header; the bytes of the records read before
    /// it are in `out` but the position is not published (the ring is dead).
    pub(crate) fn read(
        &mut self,
        ring: &Ring<'_>,
        out: &mut BytesMut,
        max_bytes: usize,
    ) -> Result<usize, RingError> {
        let max_record = ring.max_record();
        let mut got = 0;
        while got < max_bytes {
            let h = ring.word(self.tail).load(Ordering::Acquire);
            if h == 0 {
                break;
            }
            let len = (h & 0xffff_ffff) as usize;
            if (h >> 32) as u32 != tag(self.tail) || len == 0 || len > max_record {
                return Err(RingError::Record {
                    pos: self.tail,
                    word: h,
                });
            }
            let n = words_for(len);
            let start = out.len();
            out.resize(start + (n * WORD) as usize, 0);
            let first = self.tail + WORD;
            ring.load(first, &mut out[start..]);
            out.truncate(start + len);
            self.tail = first + n * WORD;
            got += len;
        }
        if got > 0 {
            ring.tail.store(self.tail, Ordering::Release);
        }
        Ok(got)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A segment in plain heap memory.
    pub(crate) fn heap(layout: Layout) -> Vec<AtomicU64> {
        let words: Vec<AtomicU64> = (0..layout.segment_bytes() / 8)
            .map(|_| AtomicU64::new(0))
            .collect();
        layout.init(&words, 1);
        words
    }

    fn pattern(n: usize, seed: u8) -> Vec<u8> {
        (0..n)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
            .collect()
    }

    #[test]
    fn header_round_trip_and_rejections() {
        let l = Layout::new(4096).unwrap();
        let words = heap(l);
        assert_eq!(Layout::read(&words).unwrap(), l);
        words[W_RING_BYTES].store(8192, Ordering::Relaxed);
        assert!(matches!(Layout::read(&words), Err(RingError::Header(_))));
        words[W_RING_BYTES].store(3000, Ordering::Relaxed);
        assert!(Layout::read(&words).is_err());
        words[W_MAGIC].store(7, Ordering::Relaxed);
        assert!(Layout::read(&words).is_err());
        assert!(Layout::read(&words[..3]).is_err());
        assert!(Layout::new(1000).is_err());
        assert!(Layout::new(1 << 40).is_err());
    }

    #[test]
    fn records_round_trip_across_the_wrap() {
        let l = Layout::new(4096).unwrap();
        let words = heap(l);
        let ring = l.ring(&words, 0);
        let (mut p, mut c) = (Producer::default(), Consumer::default());
        let mut out = BytesMut::new();
        let mut expected = Vec::new();
        for round in 0..500usize {
            let msg = pattern(1 + (round * 37) % 700, round as u8);
            let mut off = 0;
            while off < msg.len() {
                let n = p.write(&ring, &msg[off..]).unwrap();
                if n == 0 {
                    c.read(&ring, &mut out, usize::MAX).unwrap();
                    continue;
                }
                off += n;
            }
            expected.extend_from_slice(&msg);
        }
        c.read(&ring, &mut out, usize::MAX).unwrap();
        assert_eq!(&out[..], &expected[..]);
        assert!(p.head() > 10 * 4096, "wrapped many times");
        assert!(!ring.has_data_at(c.tail()));
    }

    #[test]
    fn a_full_ring_takes_nothing_until_the_consumer_frees_room() {
        let l = Layout::new(4096).unwrap();
        let words = heap(l);
        let ring = l.ring(&words, 1);
        let (mut p, mut c) = (Producer::default(), Consumer::default());
        let big = pattern(100_000, 3);
        let mut written = 0;
        loop {
            let n = p.write(&ring, &big[written..]).unwrap();
            if n == 0 {
                break;
            }
            written += n;
        }
        assert!(
            written > 3000 && written < 4096,
            "fills the ring: {written}"
        );
        assert_eq!(p.write(&ring, b"x").unwrap(), 0);
        let mut out = BytesMut::new();
        assert_eq!(c.read(&ring, &mut out, usize::MAX).unwrap(), written);
        assert!(p.write(&ring, &big[written..]).unwrap() > 0);
    }

    #[test]
    fn read_stops_at_max_bytes_and_resumes() {
        let l = Layout::new(4096).unwrap();
        let words = heap(l);
        let ring = l.ring(&words, 0);
        let (mut p, mut c) = (Producer::default(), Consumer::default());
        for i in 0..10u8 {
            assert_eq!(p.write(&ring, &[i; 10]).unwrap(), 10);
        }
        let mut out = BytesMut::new();
        assert_eq!(c.read(&ring, &mut out, 25).unwrap(), 30);
        assert_eq!(c.read(&ring, &mut out, usize::MAX).unwrap(), 70);
        assert_eq!(out.len(), 100);
    }

    #[test]
    fn a_lying_consumer_is_caught() {
        let l = Layout::new(4096).unwrap();
        let words = heap(l);
        let ring = l.ring(&words, 0);
        let mut p = Producer::default();
        ring.tail.store(1 << 40, Ordering::Relaxed);
        let big = pattern(4000, 1);
        let mut r = Ok(1);
        for _ in 0..4 {
            r = p.write(&ring, &big);
            if r.is_err() {
                break;
            }
        }
        assert!(matches!(r, Err(RingError::Tail { .. })), "{r:?}");
    }

    #[test]
    fn garbage_headers_are_errors() {
        let l = Layout::new(4096).unwrap();
        let words = heap(l);
        let ring = l.ring(&words, 0);
        let mut c = Consumer::default();
        let mut out = BytesMut::new();
        // Right tag, absurd length.
        ring.word(0).store(header(0, 1 << 30), Ordering::Relaxed);
        assert!(matches!(
            c.read(&ring, &mut out, usize::MAX),
            Err(RingError::Record { .. })
        ));
        // Wrong tag.
        ring.word(0).store(header(8, 10), Ordering::Relaxed);
        assert!(c.read(&ring, &mut out, usize::MAX).is_err());
        // Zero length.
        ring.word(0).store(header(0, 0), Ordering::Relaxed);
        assert!(c.read(&ring, &mut out, usize::MAX).is_err());
    }

    proptest! {
        /// Whatever a hostile peer writes over the ring and its control words,
        /// reading returns Ok or an error, never panics, and never hands out
        /// more than the ring holds per record.
        #[test]
        fn arbitrary_corruption_never_panics(
            writes in proptest::collection::vec((0usize..2048, any::<u64>()), 1..64),
            honest in proptest::collection::vec(1usize..300, 0..8),
        ) {
            let l = Layout::new(4096).unwrap();
            let words = heap(l);
            let ring = l.ring(&words, 0);
            let (mut p, mut c) = (Producer::default(), Consumer::default());
            for n in honest {
                let _ = p.write(&ring, &pattern(n, 9));
            }
            for (i, v) in writes {
                words[i % words.len()].store(v, Ordering::Relaxed);
            }
            let mut out = BytesMut::new();
            for _ in 0..4 {
                match c.read(&ring, &mut out, 1 << 20) {
                    Ok(_) => {}
                    Err(_) => break,
                }
            }
            prop_assert!(out.len() <= 4 * (1 << 20) + ring.max_record());
            let _ = p.write(&ring, b"more");
            let _ = Layout::read(&words);
        }
    }

    #[test]
    fn concurrent_producer_and_consumer_see_one_stream() {
        let l = Layout::new(8192).unwrap();
        let words = std::sync::Arc::new(heap(l));
        let total: usize = 3_000_000;
        let w2 = words.clone();
        let producer = std::thread::spawn(move || {
            let ring = l.ring(&w2, 0);
            let mut p = Producer::default();
            let data = pattern(total, 5);
            let mut off = 0;
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
            while off < total {
                let end = (off + 1 + off % 977).min(total);
                let n = p.write(&ring, &data[off..end]).unwrap();
                off += n;
                if n == 0 {
                    assert!(std::time::Instant::now() < deadline, "consumer stalled");
                    std::thread::yield_now();
                }
            }
        });
        let ring = l.ring(&words, 0);
        let mut c = Consumer::default();
        let mut out = BytesMut::new();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        while out.len() < total {
            if c.read(&ring, &mut out, 1 << 16).unwrap() == 0 {
                assert!(std::time::Instant::now() < deadline, "producer stalled");
                std::thread::yield_now();
            }
        }
        producer.join().unwrap();
        assert!(out[..] == pattern(total, 5)[..], "stream intact");
    }
}
