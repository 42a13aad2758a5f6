//! Shipped-request markers: their stored form, the first copy's index of
//! them, and the rule that reclaims them.
//!
//! A transaction shipped to the first copy's AD leaves a marker under its
//! request id on every copy (see [`crate::ad`]): the answer it gave and
//! when the shipping AD first sent it (`sent_ms`, its wall clock). A repeat
//! of the request finds the marker and gets the recorded answer instead of
//! running again. Markers are needed only while a repeat can arrive: the
//! shipping AD stops repeating a request once the transaction timeout plus
//! a margin has passed since it first sent it.
//!
//! Reclamation rule: the first copy indexes every marker it writes by
//! `(sent_ms, id)`. Once a marker's `sent_ms` is older than the retention
//! (a setting at least the shipping AD's retry window), the first copy
//! deletes it from every copy in a transaction that also raises the
//! *horizon*, the largest `sent_ms` ever reclaimed, stored on every copy
//! under [`HORIZON_KEY`]. A shipped request whose `sent_ms` is at or below
//! the horizon is refused with Status::Refused before it claims anything:
//! its marker may be gone, so running it could run it twice. The horizon
//! is raised in memory before the deleting transaction starts, and never
//! while a run is between its horizon check and its claim of the marker
//! (the admission gate), so no run can miss both the marker and the
//! horizon. Safety rests on the horizon alone; clocks only decide when
//! markers go (a shipping AD whose clock is behind by more than the
//! retention sees its requests refused, never run twice).
//!
//! Limits: at most `max_markers` markers indexed (a shipped request past
//! that is refused with NoBuffer before it runs), at most `reclaim_batch`
//! deleted per transaction.
//!
//! Owns the index and the horizon. Must never forget a marker it may still
//! be asked about, nor let the index grow past its limit.

use std::collections::BTreeSet;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::{BufMut, Bytes, BytesMut};
use parking_lot::Mutex;
use weft_wire::{Failure, Status};

/// The key (in the request relation) of the horizon record; no request id
/// is ever 0.
pub const HORIZON_KEY: u64 = 0;

/// Bytes of a stored marker: the answer (i64), then `sent_ms` (u64), both
/// little-endian.
pub const MARKER_BYTES: usize = 16;

/// The stored form of a marker (and of the horizon record, whose answer is
/// 0 and whose time is the horizon).
pub fn encode(answer: i64, sent_ms: u64) -> Bytes {
    let mut b = BytesMut::with_capacity(MARKER_BYTES);
    b.put_i64_le(answer);
    b.put_u64_le(sent_ms);
    b.freeze()
}

/// `(answer, sent_ms)` of a stored marker; `None` when the bytes are not
/// one.
pub fn decode(b: &[u8]) -> Option<(i64, u64)> {
    if b.len() != MARKER_BYTES {
        return None;
    }
    Some((
        i64::from_le_bytes(b[..8].try_into().expect("8 bytes")),
        u64::from_le_bytes(b[8..].try_into().expect("8 bytes")),
    ))
}

/// Milliseconds since the Unix epoch by this host's clock (0 before it).
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// Bounds and timing of the markers of a first copy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MarkerLimits {
    /// How long after its first sending a marker is kept. Must be at least
    /// the shipping AD's retry window (the transaction timeout plus 2 s):
    /// a repeat arriving later than that is refused.
    pub retention: Duration,
    /// Most markers indexed at once; a shipped request beyond it is refused
    /// with NoBuffer.
    pub max_markers: usize,
    /// Most markers one reclaiming transaction deletes.
    pub reclaim_batch: usize,
    /// How often the first copy looks for markers to reclaim.
    pub reclaim_every: Duration,
}

impl Default for MarkerLimits {
    fn default() -> Self {
        MarkerLimits {
            retention: Duration::from_secs(20),
            max_markers: 1 << 20,
            reclaim_batch: 4096,
            reclaim_every: Duration::from_secs(1),
        }
    }
}

/// A batch of markers taken for reclamation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Batch {
    /// Their request ids.
    pub ids: Vec<u64>,
    /// The horizon that covers them (the largest `sent_ms` among them, or
    /// higher).
    pub horizon: u64,
    entries: Vec<(u64, u64)>,
}

struct State {
    /// `(sent_ms, id)` of every marker this copy wrote and has not
    /// reclaimed.
    index: BTreeSet<(u64, u64)>,
    /// Requests first sent at or before this are refused.
    horizon: u64,
    /// The store's markers were read into the index.
    scanned: bool,
}

/// The first copy's markers: index, horizon, and the admission gate.
pub struct Markers {
    limits: MarkerLimits,
    state: Mutex<State>,
    /// Held shared by a run from its horizon check to the end of its claim,
    /// exclusively while the horizon is raised.
    gate: tokio::sync::RwLock<()>,
}

impl Markers {
    /// No markers, horizon 0.
    pub fn new(limits: MarkerLimits) -> Markers {
        Markers {
            limits,
            state: Mutex::new(State {
                index: BTreeSet::new(),
                horizon: 0,
                scanned: false,
            }),
            gate: tokio::sync::RwLock::new(()),
        }
    }

    /// The settings.
    pub fn limits(&self) -> MarkerLimits {
        self.limits
    }

    /// Markers indexed now.
    pub fn len(&self) -> usize {
        self.state.lock().index.len()
    }

    /// True when none is indexed.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The current horizon.
    pub fn horizon(&self) -> u64 {
        self.state.lock().horizon
    }

    /// Holds off horizon raises until the guard drops: take it before
    /// [`Markers::admit`] and keep it until the marker is claimed.
    pub async fn admission(&self) -> tokio::sync::RwLockReadGuard<'_, ()> {
        self.gate.read().await
    }

    /// Whether a request first sent at `sent_ms` may run here.
    ///
    /// Fails with Refused when `sent_ms` is at or below the horizon (its
    /// marker may have been reclaimed), BadRequest for the reserved id 0.
    pub fn admit(&self, id: u64, sent_ms: u64) -> Result<(), Failure> {
        if id == HORIZON_KEY {
            return Err(Failure::new(
                Status::BadRequest,
                "request id 0 is reserved for the marker horizon",
            ));
        }
        let horizon = self.state.lock().horizon;
        if sent_ms <= horizon {
            return Err(Failure::new(
                Status::Refused,
                format!(
                    "request {id:016x} was first sent at {sent_ms} ms, at or before the marker horizon \
                     {horizon} ms: its marker may have been reclaimed (markers are kept {:?}), so it is \
                     refused rather than risk running it twice; an earlier run may have committed",
                    self.limits.retention
                ),
            ));
        }
        Ok(())
    }

    /// Indexes a marker this copy is writing.
    ///
    /// Fails with NoBuffer when the index is full.
    pub fn note(&self, id: u64, sent_ms: u64) -> Result<(), Failure> {
        let mut st = self.state.lock();
        if st.index.contains(&(sent_ms, id)) {
            return Ok(());
        }
        if st.index.len() >= self.limits.max_markers {
            return Err(Failure::new(
                Status::NoBuffer,
                format!(
                    "{} shipped-request markers are kept, the most allowed; request {id:016x} is \
                     refused until older ones are reclaimed",
                    st.index.len()
                ),
            ));
        }
        st.index.insert((sent_ms, id));
        Ok(())
    }

    /// True once the store's markers were read in (see
    /// [`Markers::restore`]).
    pub fn scanned(&self) -> bool {
        self.state.lock().scanned
    }

    /// Takes in what the store holds after a restart: its markers
    /// (`(id, stored bytes)`, the horizon record among them) and the
    /// horizon, raised to at least `now_ms - retention` (what an in-doubt
    /// reclamation may have covered). Markers beyond the limit are
    /// indexed anyway: they exist and must be reclaimed.
    pub fn restore(&self, stored: impl IntoIterator<Item = (u64, Bytes)>, now_ms: u64) {
        let mut st = self.state.lock();
        let floor = now_ms.saturating_sub(self.limits.retention.as_millis() as u64);
        st.horizon = st.horizon.max(floor);
        for (id, value) in stored {
            let Some((_, sent_ms)) = decode(&value) else {
                continue;
            };
            if id == HORIZON_KEY {
                st.horizon = st.horizon.max(sent_ms);
            } else {
                st.index.insert((sent_ms, id));
            }
        }
        st.scanned = true;
    }

    /// Takes the markers first sent before `now_ms - retention`, oldest
    /// first, at most `reclaim_batch` (plus those sent in the same
    /// millisecond as the last), out of the index, and raises the horizon
    /// over them: from now on their repeats are refused. `None` when none
    /// is due.
    pub async fn take_due(&self, now_ms: u64) -> Option<Batch> {
        let cutoff = now_ms.saturating_sub(self.limits.retention.as_millis() as u64);
        {
            let st = self.state.lock();
            match st.index.first() {
                Some((sent, _)) if *sent < cutoff => {}
                _ => return None,
            }
        }
        // No run is between its check and its claim while this is held.
        let _gate = self.gate.write().await;
        let mut st = self.state.lock();
        let mut entries: Vec<(u64, u64)> = Vec::new();
        while let Some(&(sent, id)) = st.index.first() {
            let full = entries.len() >= self.limits.reclaim_batch;
            let same_ms = entries.last().is_some_and(|(s, _)| *s == sent);
            if sent >= cutoff || (full && !same_ms) {
                break;
            }
            st.index.pop_first();
            entries.push((sent, id));
        }
        let last = entries.last()?.0;
        st.horizon = st.horizon.max(last);
        Some(Batch {
            ids: entries.iter().map(|(_, id)| *id).collect(),
            horizon: st.horizon,
            entries,
        })
    }

    /// The batch's deletion did not commit: its markers go back into the
    /// index (the horizon stays: their repeats stay refused).
    pub fn put_back(&self, batch: Batch) {
        let mut st = self.state.lock();
        st.index.extend(batch.entries);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(batch: usize, max: usize) -> MarkerLimits {
        MarkerLimits {
            retention: Duration::from_secs(10),
            max_markers: max,
            reclaim_batch: batch,
            reclaim_every: Duration::from_secs(1),
        }
    }

    #[test]
    fn markers_round_trip_and_reject_garbage() {
        assert_eq!(decode(&encode(-42, 7)), Some((-42, 7)));
        assert_eq!(
            decode(&encode(i64::MIN, u64::MAX)),
            Some((i64::MIN, u64::MAX))
        );
        assert_eq!(decode(b"short"), None);
        assert_eq!(decode(&[0u8; 100]), None, "a balance tuple is no marker");
    }

    #[tokio::test]
    async fn due_markers_leave_the_index_oldest_first_and_raise_the_horizon() {
        let m = Markers::new(limits(2, 100));
        for (id, sent) in [(1, 1_000), (2, 2_000), (3, 3_000), (4, 50_000)] {
            m.admit(id, sent).unwrap();
            m.note(id, sent).unwrap();
        }
        assert_eq!(m.take_due(10_500).await, None, "nothing is 10 s old yet");
        let b = m.take_due(20_000).await.unwrap();
        assert_eq!(b.ids, vec![1, 2], "oldest first, at most the batch");
        assert_eq!(b.horizon, 2_000);
        assert_eq!(m.len(), 2);
        // A repeat of a reclaimed request is refused, clearly; a later one
        // is not.
        let f = m.admit(2, 2_000).unwrap_err();
        assert_eq!(f.status, Status::Refused);
        assert!(f.detail.contains("running it twice"), "{f}");
        assert!(m.admit(3, 3_000).is_ok());
        let b = m.take_due(20_000).await.unwrap();
        assert_eq!(b.ids, vec![3]);
        assert_eq!(m.take_due(20_000).await, None);
        assert_eq!(m.len(), 1, "the young marker stays");
        assert_eq!(m.admit(0, 99_999).unwrap_err().status, Status::BadRequest);
    }

    #[tokio::test]
    async fn a_batch_takes_every_marker_of_its_last_millisecond() {
        let m = Markers::new(limits(2, 100));
        for id in 1..=4 {
            m.note(id, 1_000).unwrap();
        }
        let b = m.take_due(60_000).await.unwrap();
        assert_eq!(b.ids.len(), 4, "the horizon must cover all it reclaims");
        assert!(m.is_empty());
    }

    #[tokio::test]
    async fn a_failed_reclamation_puts_its_markers_back_but_keeps_the_horizon() {
        let m = Markers::new(limits(10, 100));
        m.note(5, 1_000).unwrap();
        let b = m.take_due(60_000).await.unwrap();
        m.put_back(b);
        assert_eq!(m.len(), 1);
        assert_eq!(m.admit(5, 1_000).unwrap_err().status, Status::Refused);
        assert_eq!(m.take_due(60_000).await.unwrap().ids, vec![5]);
    }

    #[test]
    fn the_index_is_bounded() {
        let m = Markers::new(limits(10, 2));
        m.note(1, 1).unwrap();
        m.note(2, 2).unwrap();
        m.note(2, 2).unwrap();
        assert_eq!(m.note(3, 3).unwrap_err().status, Status::NoBuffer);
        assert_eq!(m.len(), 2);
    }

    #[test]
    fn a_restart_restores_markers_and_a_conservative_horizon() {
        let m = Markers::new(limits(10, 100));
        m.restore(
            vec![
                (HORIZON_KEY, encode(0, 40_000)),
                (7, encode(12, 45_000)),
                (8, Bytes::from_static(b"junk")),
            ],
            30_000,
        );
        assert!(m.scanned());
        assert_eq!(m.horizon(), 40_000, "the stored horizon");
        assert_eq!(m.len(), 1);
        let m = Markers::new(limits(10, 100));
        m.restore(vec![], 100_000);
        assert_eq!(m.horizon(), 90_000, "now minus the retention");
    }
}
