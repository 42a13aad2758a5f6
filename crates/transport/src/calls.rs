//! Pending calls: requests sent and not yet answered, and their deadlines.
//!
//! Owns the table from call id to the waiting caller. Every entry ends exactly
//! once: answered, failed (peer dead, link closed, deadline passed) or
//! abandoned by the caller (drop). Must never keep an entry whose caller is
//! gone, nor let a call outlive its deadline by more than the timer's
//! granularity.
//!
//! ## Deadlines
//!
//! A call's deadline lives in its entry; no timer is armed per call (arming
//! and disarming a runtime timer was a large share of a same-host call's
//! cost). One sweeper task per table sleeps until the earliest deadline it
//! knows of, fails every call past its deadline with TimedOut (a response
//! arriving later finds no entry and is dropped) and sleeps again until the
//! earliest deadline left. A call whose deadline is earlier than the
//! sweeper's next look wakes it; a later one (the common case: calls with the
//! default timeout, made one after the other) costs nothing but the
//! comparison. A deadline that no longer matters (its call was answered)
//! costs at most one look at the table when it passes.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Instant;

use parking_lot::Mutex;
use tokio::sync::{oneshot, Notify};
use weft_wire::{Failure, NodeId, Response, Status};

use crate::idhash::IdHashing;

const SHARDS: usize = 16;

/// `next_sweep` when no deadline is known.
const NEVER: u64 = u64::MAX;

type Shard = HashMap<u64, Pending, IdHashing>;

struct Pending {
    /// The node the request went to (a client's gateway).
    node: NodeId,
    /// The node the call is for, named in a TimedOut failure.
    to: NodeId,
    link: Option<u64>,
    deadline: Option<Instant>,
    tx: oneshot::Sender<Result<Response, Failure>>,
}

/// The pending-call table, sharded by call id.
pub(crate) struct Calls {
    shards: Vec<Mutex<Shard>>,
    /// Deadlines are kept as nanoseconds after this instant.
    epoch: Instant,
    /// When the sweeper looks next (nanoseconds after `epoch`; [`NEVER`]).
    next_sweep: AtomicU64,
    /// Wakes the sweeper: an earlier deadline, or the table is gone.
    wake: Arc<Notify>,
}

impl Calls {
    /// An empty table with its sweeper, spawned on the current tokio
    /// runtime (without one, deadlines are recorded but nobody enforces
    /// them: tests of the table alone).
    pub(crate) fn start() -> Arc<Calls> {
        let calls = Arc::new(Calls {
            shards: (0..SHARDS).map(|_| Mutex::new(Shard::default())).collect(),
            epoch: Instant::now(),
            next_sweep: AtomicU64::new(NEVER),
            wake: Arc::new(Notify::new()),
        });
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(sweeper(Arc::downgrade(&calls), Arc::clone(&calls.wake)));
        }
        calls
    }

    fn shard(&self, id: u64) -> &Mutex<Shard> {
        &self.shards[(id as usize) % SHARDS]
    }

    fn nanos(&self, at: Instant) -> u64 {
        let n = at.saturating_duration_since(self.epoch).as_nanos();
        u64::try_from(n).unwrap_or(NEVER - 1)
    }

    /// Registers a call sent to `node` for `to` (the same node, except for
    /// a client, whose calls go through its gateway), failing with TimedOut
    /// at `deadline` unless it ends before; the receiver gets its outcome.
    pub(crate) fn insert(
        &self,
        id: u64,
        node: NodeId,
        to: NodeId,
        deadline: Option<Instant>,
    ) -> oneshot::Receiver<Result<Response, Failure>> {
        let (tx, rx) = oneshot::channel();
        self.shard(id).lock().insert(
            id,
            Pending {
                node,
                to,
                link: None,
                deadline,
                tx,
            },
        );
        if let Some(d) = deadline {
            let at = self.nanos(d);
            if at < self.next_sweep.load(Ordering::Acquire) {
                self.next_sweep.fetch_min(at, Ordering::AcqRel);
                self.wake.notify_one();
            }
        }
        rx
    }

    /// Records the link a call was sent on (it fails if that link closes).
    pub(crate) fn set_link(&self, id: u64, link: u64) {
        if let Some(p) = self.shard(id).lock().get_mut(&id) {
            p.link = Some(link);
        }
    }

    /// Completes a call with the response from `from`. Responses from a node
    /// other than the one called are ignored. Returns false when no such call
    /// is pending (late or duplicate response).
    pub(crate) fn complete(&self, id: u64, from: NodeId, response: Response) -> bool {
        let mut shard = self.shard(id).lock();
        let Some(p) = shard.remove(&id) else {
            return false;
        };
        if p.node != from {
            shard.insert(id, p);
            return false;
        }
        drop(shard);
        let _ = p.tx.send(Ok(response));
        true
    }

    /// Fails one call.
    pub(crate) fn fail(&self, id: u64, failure: Failure) {
        let p = self.shard(id).lock().remove(&id);
        if let Some(p) = p {
            let _ = p.tx.send(Err(failure));
        }
    }

    /// Removes a call its caller abandoned.
    pub(crate) fn forget(&self, id: u64) {
        self.shard(id).lock().remove(&id);
    }

    /// Removes every call matching `pred` (seen once per call, shard by
    /// shard) and returns them, for the caller to fail.
    fn take_where(&self, mut pred: impl FnMut(&Pending) -> bool) -> Vec<Pending> {
        let mut taken = Vec::new();
        for shard in &self.shards {
            let mut s = shard.lock();
            let ids: Vec<u64> = s
                .iter()
                .filter(|(_, p)| pred(p))
                .map(|(id, _)| *id)
                .collect();
            taken.extend(ids.into_iter().filter_map(|id| s.remove(&id)));
        }
        taken
    }

    /// Fails every call matching `pred` with `failure`.
    fn fail_where(&self, failure: &Failure, pred: impl Fn(&Pending) -> bool) -> usize {
        let victims = self.take_where(pred);
        let n = victims.len();
        for p in victims {
            let _ = p.tx.send(Err(failure.clone()));
        }
        n
    }

    /// Fails every call to `node`. Returns how many.
    pub(crate) fn fail_node(&self, node: NodeId, failure: &Failure) -> usize {
        self.fail_where(failure, |p| p.node == node)
    }

    /// Fails every call sent on `link`. Returns how many.
    pub(crate) fn fail_link(&self, link: u64, failure: &Failure) -> usize {
        self.fail_where(failure, |p| p.link == Some(link))
    }

    /// Fails every pending call (shutdown).
    pub(crate) fn fail_all(&self, failure: &Failure) -> usize {
        self.fail_where(failure, |_| true)
    }

    /// Number of pending calls.
    pub(crate) fn len(&self) -> usize {
        self.shards.iter().map(|s| s.lock().len()).sum()
    }

    /// Fails every call whose deadline is at or before `now` with TimedOut
    /// and schedules the next look at the earliest deadline left. Returns
    /// how many calls timed out.
    fn sweep(&self, now: Instant) -> usize {
        // Forget the schedule first: a call inserted from here on either is
        // seen by the scan below or lowers the schedule itself (and wakes
        // the sweeper), so no deadline is ever left unwatched.
        self.next_sweep.store(NEVER, Ordering::SeqCst);
        let mut earliest = NEVER;
        let victims = self.take_where(|p| match p.deadline {
            Some(d) if d <= now => true,
            Some(d) => {
                earliest = earliest.min(self.nanos(d));
                false
            }
            None => false,
        });
        self.next_sweep.fetch_min(earliest, Ordering::AcqRel);
        let n = victims.len();
        for p in victims {
            let _ = p.tx.send(Err(Failure::new(
                Status::TimedOut,
                format!("no answer from node {} before the deadline", p.to),
            )));
        }
        n
    }

    /// When the sweeper should look next, if ever.
    fn next_sweep_at(&self) -> Option<Instant> {
        match self.next_sweep.load(Ordering::Acquire) {
            NEVER => None,
            n => Some(self.epoch + std::time::Duration::from_nanos(n)),
        }
    }
}

impl Drop for Calls {
    fn drop(&mut self) {
        // Lets the sweeper see the table is gone and end.
        self.wake.notify_one();
    }
}

/// The sweeper of one table: sleeps until the table's next deadline (or
/// until woken by an earlier one), fails the calls past their deadline, and
/// ends when the table is dropped.
async fn sweeper(calls: Weak<Calls>, wake: Arc<Notify>) {
    loop {
        let next = match calls.upgrade() {
            Some(c) => c.next_sweep_at(),
            None => return,
        };
        let woken = wake.notified();
        match next {
            Some(at) => {
                tokio::select! {
                    _ = tokio::time::sleep_until(at.into()) => {}
                    _ = woken => continue,
                }
            }
            None => {
                woken.await;
                continue;
            }
        }
        let Some(c) = calls.upgrade() else { return };
        c.sweep(Instant::now());
    }
}

/// Removes a pending call when the waiting future is dropped early.
pub(crate) struct CallGuard {
    pub(crate) calls: Arc<Calls>,
    pub(crate) id: u64,
    pub(crate) armed: bool,
}

impl Drop for CallGuard {
    fn drop(&mut self) {
        if self.armed {
            self.calls.forget(self.id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;
    use weft_wire::Payload;

    /// A guard against a hang, far above any deadline used here: these
    /// tests assert outcomes, never timings.
    const HANG: Duration = Duration::from_secs(30);

    fn ok(id: u64) -> Response {
        Response {
            call_id: id,
            status: Status::Ok,
            detail: String::new(),
            tx: None,
            payload: Payload::empty(),
        }
    }

    fn soon(ms: u64) -> Option<Instant> {
        Some(Instant::now() + Duration::from_millis(ms))
    }

    #[tokio::test]
    async fn a_call_past_its_deadline_ends_timed_out_and_leaves_nothing() {
        let calls = Calls::start();
        let rx = calls.insert(1, NodeId(2), NodeId(2), soon(20));
        let outcome = tokio::time::timeout(HANG, rx)
            .await
            .expect("the sweeper ends the call")
            .expect("the call ends with a status, not dropped");
        let f = outcome.unwrap_err();
        assert_eq!(f.status, Status::TimedOut, "{f}");
        assert!(f.detail.contains("node 2"), "{f}");
        assert_eq!(calls.len(), 0);
    }

    #[tokio::test]
    async fn a_response_after_the_deadline_is_dropped() {
        let calls = Calls::start();
        let rx = calls.insert(7, NodeId(3), NodeId(3), soon(10));
        let outcome = tokio::time::timeout(HANG, rx).await.unwrap().unwrap();
        assert_eq!(outcome.unwrap_err().status, Status::TimedOut);
        assert!(
            !calls.complete(7, NodeId(3), ok(7)),
            "a late response finds no call"
        );
    }

    #[tokio::test]
    async fn an_earlier_deadline_wakes_the_sweeper() {
        let calls = Calls::start();
        // The sweeper first sleeps until this call's deadline, an hour away.
        let mut late = calls.insert(1, NodeId(2), NodeId(2), soon(3_600_000));
        tokio::task::yield_now().await;
        let early = calls.insert(2, NodeId(2), NodeId(2), soon(10));
        let outcome = tokio::time::timeout(HANG, early)
            .await
            .expect("the earlier deadline is enforced")
            .unwrap();
        assert_eq!(outcome.unwrap_err().status, Status::TimedOut);
        assert!(late.try_recv().is_err(), "the later call still waits");
        assert_eq!(calls.len(), 1);
        assert!(calls.complete(1, NodeId(2), ok(1)));
        assert_eq!(late.await.unwrap().unwrap().status, Status::Ok);
    }

    #[tokio::test]
    async fn answered_calls_and_calls_without_deadline_are_left_alone() {
        let calls = Calls::start();
        let rx = calls.insert(1, NodeId(2), NodeId(2), soon(5));
        assert!(calls.complete(1, NodeId(2), ok(1)));
        assert_eq!(rx.await.unwrap().unwrap().status, Status::Ok);
        let _forever = calls.insert(2, NodeId(2), NodeId(2), None);
        let timed = calls.insert(3, NodeId(2), NodeId(2), soon(5));
        let outcome = tokio::time::timeout(HANG, timed).await.unwrap().unwrap();
        assert_eq!(outcome.unwrap_err().status, Status::TimedOut);
        assert_eq!(calls.len(), 1, "the call without a deadline waits on");
        // A sweep with nothing due fails nothing.
        assert_eq!(calls.sweep(Instant::now()), 0);
        assert_eq!(calls.len(), 1);
    }

    #[tokio::test]
    async fn the_sweeper_ends_with_its_table() {
        let calls = Calls::start();
        let _rx = calls.insert(1, NodeId(2), NodeId(2), soon(3_600_000));
        let wake = Arc::clone(&calls.wake);
        let weak = Arc::downgrade(&calls);
        drop(calls);
        assert!(weak.upgrade().is_none(), "the sweeper holds no strong ref");
        // The sweeper ends: it was the only other holder of `wake`.
        tokio::time::timeout(HANG, async {
            while Arc::strong_count(&wake) > 1 {
                tokio::task::yield_now().await;
            }
        })
        .await
        .expect("the sweeper ends");
    }

    #[test]
    fn ids_of_one_shard_spread_over_the_buckets() {
        use std::hash::BuildHasher;
        let b = IdHashing::default();
        let mut low: Vec<u64> = (0..64u64)
            .map(|i| b.hash_one(i * SHARDS as u64 + 3) & 63)
            .collect();
        low.sort_unstable();
        low.dedup();
        assert!(low.len() > 32, "only {} distinct buckets of 64", low.len());
    }
}
