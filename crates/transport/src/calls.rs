//! Pending calls: requests sent and not yet answered, and their deadlines.
//!
//! Owns the table from call id to the waiting caller. Every entry ends exactly
//! once: answered, failed (peer dead, link closed, deadline passed) or
//! abandoned by the caller (drop). Must never keep an entry whose caller is
//! gone, nor let a call outlive its deadline by more than the timer's
//! granularity.
//!
//! ## Outcomes
//!
//! An entry holds the caller's waker until the call ends, then the outcome
//! until the caller takes it ([`Calls::poll_outcome`]); there is no channel
//! per call. An ended entry is left to its caller, so a response that comes
//! after it (late, or a duplicate) finds it ended and is dropped.
//!
//! ## Deadlines
//!
//! A call's deadline lives in its entry; no timer is armed per call (arming
//! and disarming a runtime timer was a large share of a same-host call's
//! cost). One sweeper task per table sleeps until the earliest deadline it
//! knows of, fails every call past its deadline with TimedOut and sleeps
//! again until the earliest deadline left. A call whose deadline is earlier
//! than the sweeper's next look wakes it; a later one (the common case:
//! calls with the default timeout, made one after the other) costs nothing
//! but the comparison. A deadline that no longer matters (its call was
//! answered) costs at most one look at the table when it passes.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::task::{Context, Poll, Waker};
use std::time::Instant;

use parking_lot::Mutex;
use tokio::sync::Notify;
use weft_wire::{Failure, NodeId, Response, Status};

use weft_wire::IdHashing;

const SHARDS: usize = 16;

/// `next_sweep` when no deadline is known.
const NEVER: u64 = u64::MAX;

type Shard = HashMap<u64, Pending, IdHashing>;

/// What a call's caller waits for.
enum Outcome {
    /// Not yet: whom to wake when it comes.
    Waiting(Waker),
    /// Answered or failed, not yet taken by the caller.
    Ended(Result<Response, Failure>),
}

struct Pending {
    /// The node the request went to (a client's gateway).
    node: NodeId,
    /// The node the call is for, named in a TimedOut failure.
    to: NodeId,
    link: Option<u64>,
    deadline: Option<Instant>,
    outcome: Outcome,
}

impl Pending {
    fn waiting(&self) -> bool {
        matches!(self.outcome, Outcome::Waiting(_))
    }

    /// Ends the call with `result`; returns the waker to wake once the
    /// shard is unlocked (`None` when it had already ended).
    fn end(&mut self, result: Result<Response, Failure>) -> Option<Waker> {
        match std::mem::replace(&mut self.outcome, Outcome::Ended(result)) {
            Outcome::Waiting(waker) => Some(waker),
            earlier @ Outcome::Ended(_) => {
                self.outcome = earlier;
                None
            }
        }
    }
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
    /// at `deadline` unless it ends before; `waker` is woken when it ends,
    /// and [`Calls::poll_outcome`] then gives its outcome.
    pub(crate) fn insert(
        &self,
        id: u64,
        node: NodeId,
        to: NodeId,
        deadline: Option<Instant>,
        waker: Waker,
    ) {
        self.shard(id).lock().insert(
            id,
            Pending {
                node,
                to,
                link: None,
                deadline,
                outcome: Outcome::Waiting(waker),
            },
        );
        if let Some(d) = deadline {
            let at = self.nanos(d);
            if at < self.next_sweep.load(Ordering::Acquire) {
                self.next_sweep.fetch_min(at, Ordering::AcqRel);
                self.wake.notify_one();
            }
        }
    }

    /// The outcome of call `id` once it ended (the entry is then gone), or
    /// `Pending` with the waker of `cx` remembered. A call the table does
    /// not know (never inserted, or its outcome already taken) ends with
    /// Internal.
    pub(crate) fn poll_outcome(
        &self,
        id: u64,
        cx: &mut Context<'_>,
    ) -> Poll<Result<Response, Failure>> {
        let mut shard = self.shard(id).lock();
        let Some(p) = shard.get_mut(&id) else {
            return Poll::Ready(Err(Failure::new(
                Status::Internal,
                "call abandoned by the transport",
            )));
        };
        match &mut p.outcome {
            Outcome::Waiting(waker) => {
                if !waker.will_wake(cx.waker()) {
                    waker.clone_from(cx.waker());
                }
                Poll::Pending
            }
            Outcome::Ended(_) => match shard.remove(&id).map(|p| p.outcome) {
                Some(Outcome::Ended(result)) => Poll::Ready(result),
                _ => unreachable!("the entry was seen ended under the lock"),
            },
        }
    }

    /// Records the link a call was sent on (it fails if that link closes).
    pub(crate) fn set_link(&self, id: u64, link: u64) {
        if let Some(p) = self.shard(id).lock().get_mut(&id) {
            p.link = Some(link);
        }
    }

    /// Completes a call with the response from `from`. Responses from a node
    /// other than the one called are ignored. Returns false when no such call
    /// is waiting (late or duplicate response).
    pub(crate) fn complete(&self, id: u64, from: NodeId, response: Response) -> bool {
        let waker = match self.shard(id).lock().get_mut(&id) {
            Some(p) if p.node == from => p.end(Ok(response)),
            _ => None,
        };
        waker.map(Waker::wake).is_some()
    }

    /// Fails one call.
    pub(crate) fn fail(&self, id: u64, failure: Failure) {
        let waker = self
            .shard(id)
            .lock()
            .get_mut(&id)
            .and_then(|p| p.end(Err(failure)));
        if let Some(w) = waker {
            w.wake();
        }
    }

    /// Removes a call its caller abandoned.
    pub(crate) fn forget(&self, id: u64) {
        self.shard(id).lock().remove(&id);
    }

    /// Ends every waiting call matching `pred` (seen once per call, shard by
    /// shard) with the failure `failure_of` makes for it, and wakes their
    /// callers. Returns how many.
    fn fail_where(
        &self,
        mut pred: impl FnMut(&Pending) -> bool,
        failure_of: impl Fn(&Pending) -> Failure,
    ) -> usize {
        let mut wakers = Vec::new();
        for shard in &self.shards {
            let mut s = shard.lock();
            for p in s.values_mut() {
                if p.waiting() && pred(p) {
                    let f = failure_of(p);
                    wakers.extend(p.end(Err(f)));
                }
            }
        }
        let n = wakers.len();
        wakers.into_iter().for_each(Waker::wake);
        n
    }

    /// Fails every call to `node`. Returns how many.
    pub(crate) fn fail_node(&self, node: NodeId, failure: &Failure) -> usize {
        self.fail_where(|p| p.node == node, |_| failure.clone())
    }

    /// Fails every call sent on `link`. Returns how many.
    pub(crate) fn fail_link(&self, link: u64, failure: &Failure) -> usize {
        self.fail_where(|p| p.link == Some(link), |_| failure.clone())
    }

    /// Fails every pending call (shutdown).
    pub(crate) fn fail_all(&self, failure: &Failure) -> usize {
        self.fail_where(|_| true, |_| failure.clone())
    }

    /// Number of calls waiting for their outcome.
    pub(crate) fn len(&self) -> usize {
        self.shards
            .iter()
            .map(|s| s.lock().values().filter(|p| p.waiting()).count())
            .sum()
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
        let n = self.fail_where(
            |p| match p.deadline {
                Some(d) if d <= now => true,
                Some(d) => {
                    earliest = earliest.min(self.nanos(d));
                    false
                }
                None => false,
            },
            |p| {
                Failure::new(
                    Status::TimedOut,
                    format!("no answer from node {} before the deadline", p.to),
                )
            },
        );
        self.next_sweep.fetch_min(earliest, Ordering::AcqRel);
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
pub(crate) struct CallGuard<'a> {
    pub(crate) calls: &'a Calls,
    pub(crate) id: u64,
    pub(crate) armed: bool,
}

impl Drop for CallGuard<'_> {
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

    /// Registers call `id` to node `node` and waits for its outcome, as
    /// `Endpoint::call` does.
    async fn call(
        calls: &Calls,
        id: u64,
        node: u32,
        deadline: Option<Instant>,
    ) -> Result<Response, Failure> {
        let mut inserted = false;
        std::future::poll_fn(|cx| {
            if !inserted {
                inserted = true;
                calls.insert(id, NodeId(node), NodeId(node), deadline, cx.waker().clone());
            }
            calls.poll_outcome(id, cx)
        })
        .await
    }

    fn insert_unwatched(calls: &Calls, id: u64, node: u32, deadline: Option<Instant>) {
        calls.insert(
            id,
            NodeId(node),
            NodeId(node),
            deadline,
            futures::task::noop_waker(),
        );
    }

    #[tokio::test]
    async fn a_call_past_its_deadline_ends_timed_out_and_leaves_nothing() {
        let calls = Calls::start();
        let outcome = tokio::time::timeout(HANG, call(&calls, 1, 2, soon(20)))
            .await
            .expect("the sweeper ends the call");
        let f = outcome.unwrap_err();
        assert_eq!(f.status, Status::TimedOut, "{f}");
        assert!(f.detail.contains("node 2"), "{f}");
        assert_eq!(calls.len(), 0);
        assert!(
            calls.shards.iter().all(|s| s.lock().is_empty()),
            "the outcome was taken"
        );
    }

    #[tokio::test]
    async fn a_response_after_the_deadline_is_dropped() {
        let calls = Calls::start();
        insert_unwatched(&calls, 7, 3, soon(10));
        tokio::time::timeout(HANG, async {
            while calls.len() > 0 {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        })
        .await
        .expect("the sweeper ends the call");
        assert!(
            !calls.complete(7, NodeId(3), ok(7)),
            "a late response finds the call ended"
        );
        let outcome = call_outcome(&calls, 7).await;
        assert_eq!(
            outcome.unwrap_err().status,
            Status::TimedOut,
            "not the late answer"
        );
    }

    /// The outcome of an inserted call.
    async fn call_outcome(calls: &Calls, id: u64) -> Result<Response, Failure> {
        std::future::poll_fn(|cx| calls.poll_outcome(id, cx)).await
    }

    #[tokio::test]
    async fn an_earlier_deadline_wakes_the_sweeper() {
        let calls = Calls::start();
        // The sweeper first sleeps until this call's deadline, an hour away.
        insert_unwatched(&calls, 1, 2, soon(3_600_000));
        tokio::task::yield_now().await;
        let outcome = tokio::time::timeout(HANG, call(&calls, 2, 2, soon(10)))
            .await
            .expect("the earlier deadline is enforced");
        assert_eq!(outcome.unwrap_err().status, Status::TimedOut);
        assert_eq!(calls.len(), 1, "the later call still waits");
        assert!(calls.complete(1, NodeId(2), ok(1)));
        assert_eq!(call_outcome(&calls, 1).await.unwrap().status, Status::Ok);
    }

    #[tokio::test]
    async fn answered_calls_and_calls_without_deadline_are_left_alone() {
        let calls = Calls::start();
        insert_unwatched(&calls, 1, 2, soon(5));
        assert!(calls.complete(1, NodeId(2), ok(1)));
        assert!(
            !calls.complete(1, NodeId(2), ok(1)),
            "a duplicate is dropped"
        );
        assert_eq!(call_outcome(&calls, 1).await.unwrap().status, Status::Ok);
        insert_unwatched(&calls, 2, 2, None);
        let outcome = tokio::time::timeout(HANG, call(&calls, 3, 2, soon(5)))
            .await
            .unwrap();
        assert_eq!(outcome.unwrap_err().status, Status::TimedOut);
        assert_eq!(calls.len(), 1, "the call without a deadline waits on");
        // A sweep with nothing due fails nothing.
        assert_eq!(calls.sweep(Instant::now()), 0);
        assert_eq!(calls.len(), 1);
    }

    #[tokio::test]
    async fn an_answer_from_another_node_is_ignored_and_failures_wake_the_caller() {
        let calls = Calls::start();
        let waiting = {
            let calls = Arc::clone(&calls);
            tokio::spawn(async move { call(&calls, 5, 2, None).await })
        };
        while calls.len() == 0 {
            tokio::task::yield_now().await;
        }
        assert!(!calls.complete(5, NodeId(9), ok(5)), "not the node called");
        calls.set_link(5, 77);
        assert_eq!(
            calls.fail_link(76, &Failure::new(Status::ProcDead, "other link")),
            0
        );
        assert_eq!(
            calls.fail_link(77, &Failure::new(Status::ProcDead, "its link")),
            1
        );
        let f = tokio::time::timeout(HANG, waiting)
            .await
            .unwrap()
            .unwrap()
            .unwrap_err();
        assert_eq!(
            (f.status, f.detail.as_str()),
            (Status::ProcDead, "its link")
        );
        assert!(
            !calls.complete(5, NodeId(2), ok(5)),
            "its outcome was taken"
        );
        let f = call_outcome(&calls, 5).await.unwrap_err();
        assert_eq!(f.status, Status::Internal, "an unknown call: {f}");
    }

    #[tokio::test]
    async fn the_sweeper_ends_with_its_table() {
        let calls = Calls::start();
        insert_unwatched(&calls, 1, 2, soon(3_600_000));
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
