//! Fuzzing hooks for the shared-memory ring (cargo feature `fuzzing`,
//! hidden from the docs), re-exported as `weft_transport::fuzzing`.
//!
//! Owns nothing but wrappers over [`super::ring`]: a segment in plain heap
//! memory, and the real producer and consumer. Must never add behaviour of
//! its own or be used by anything but fuzzing.

use std::sync::atomic::AtomicU64;

use bytes::BytesMut;

use super::ring::{Consumer, Layout, Producer};

/// A segment with two rings in plain heap memory, its header written as a
/// creator writes it.
pub struct RingSegment {
    layout: Layout,
    words: Vec<AtomicU64>,
}

impl RingSegment {
    /// A fresh segment with rings of `ring_bytes` bytes.
    ///
    /// Fails unless `ring_bytes` is a power of two within the accepted range.
    pub fn new(ring_bytes: usize) -> Result<RingSegment, String> {
        let layout = Layout::new(ring_bytes)?;
        let words = (0..layout.segment_bytes() / 8)
            .map(|_| AtomicU64::new(0))
            .collect::<Vec<_>>();
        layout.init(&words, 1);
        Ok(RingSegment { layout, words })
    }

    /// Every word of the segment: what a hostile peer can write.
    pub fn words(&self) -> &[AtomicU64] {
        &self.words
    }

    /// Bytes in each ring.
    pub fn ring_bytes(&self) -> usize {
        self.layout.ring_bytes()
    }

    /// Largest payload of one record.
    pub fn max_record(&self) -> usize {
        self.layout.ring(&self.words, 0).max_record()
    }

    /// Word index of ring `r`'s first data word.
    pub fn ring_start_word(&self, r: usize) -> usize {
        (super::ring::HEADER_BYTES + (r & 1) * self.layout.ring_bytes()) / 8
    }

    /// Checks a peer's segment header as the accepting side does; returns
    /// the ring size.
    ///
    /// Fails with the reason the header is refused.
    pub fn read_header(words: &[AtomicU64]) -> Result<usize, String> {
        Layout::read(words)
            .map(|l| l.ring_bytes())
            .map_err(|e| e.to_string())
    }
}

/// The real producer of one ring.
#[derive(Default)]
pub struct RingProducer(Producer);

impl RingProducer {
    /// Writes a prefix of `bytes` as one record of ring `r`; returns how many
    /// bytes were written.
    ///
    /// Fails when the consumer published an impossible position.
    pub fn write(&mut self, seg: &RingSegment, r: usize, bytes: &[u8]) -> Result<usize, String> {
        let ring = seg.layout.ring(&seg.words, r);
        self.0.write(&ring, bytes).map_err(|e| e.to_string())
    }
}

/// The real consumer of one ring.
#[derive(Default)]
pub struct RingConsumer(Consumer);

impl RingConsumer {
    /// Appends the records waiting in ring `r` to `out`, stopping once
    /// `max_bytes` were read; returns the number of bytes appended.
    ///
    /// Fails when the slot at the position is neither empty nor a record.
    pub fn read(
        &mut self,
        seg: &RingSegment,
        r: usize,
        out: &mut BytesMut,
        max_bytes: usize,
    ) -> Result<usize, String> {
        let ring = seg.layout.ring(&seg.words, r);
        self.0
            .read(&ring, out, max_bytes)
            .map_err(|e| e.to_string())
    }

    /// The consumer's position (bytes from the start of the stream).
    pub fn tail(&self) -> u64 {
        self.0.tail()
    }
}
