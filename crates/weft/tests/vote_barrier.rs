//! `Resource::vote_barrier`: a resource may hold its node's vote (and the
//! coordinator's decision) until it allows it, or turn it into an abort.
//! The Raid site uses it for controlled lock violation: a transaction that
//! used a prepared writer's values votes only after that writer committed.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use futures::future::BoxFuture;
use parking_lot::Mutex;
use tokio::sync::oneshot;
use weft::{Address, ParticipationClass, ServiceOptions, Status, Tid, Vote};

/// A resource that votes `vote` and then holds the vote until the test
/// opens its gate (with the barrier's answer).
struct Gated {
    vote: Vote,
    gate: Mutex<Option<oneshot::Receiver<Result<(), String>>>>,
    barriers: AtomicUsize,
    committed: AtomicUsize,
    aborted: AtomicUsize,
}

impl Gated {
    fn new(vote: Vote) -> (Arc<Gated>, oneshot::Sender<Result<(), String>>) {
        let (open, gate) = oneshot::channel();
        let g = Arc::new(Gated {
            vote,
            gate: Mutex::new(Some(gate)),
            barriers: AtomicUsize::new(0),
            committed: AtomicUsize::new(0),
            aborted: AtomicUsize::new(0),
        });
        (g, open)
    }
}

impl weft::Resource for Gated {
    fn name(&self) -> &str {
        "gated"
    }
    fn class(&self) -> ParticipationClass {
        ParticipationClass::TwoPhase
    }
    fn prepare<'a>(&'a self, _tid: Tid, _log: &'a weft::Log) -> BoxFuture<'a, Vote> {
        Box::pin(async move { self.vote.clone() })
    }
    fn vote_barrier(&self, _tid: Tid) -> BoxFuture<'_, Result<(), String>> {
        self.barriers.fetch_add(1, Ordering::SeqCst);
        let gate = self.gate.lock().take();
        Box::pin(async move {
            match gate {
                Some(g) => g.await.unwrap_or(Err("gate dropped".into())),
                None => Ok(()),
            }
        })
    }
    fn commit(&self, _tid: Tid) -> BoxFuture<'_, ()> {
        self.committed.fetch_add(1, Ordering::SeqCst);
        Box::pin(async {})
    }
    fn abort(&self, _tid: Tid) -> BoxFuture<'_, ()> {
        self.aborted.fetch_add(1, Ordering::SeqCst);
        Box::pin(async {})
    }
}

/// A two-node cluster whose node 2 serves `touch`, enlisting `r`.
async fn with_participant(r: Arc<Gated>, seed: u64) -> Cluster {
    let c = Cluster::start(2, seed).await;
    c.node(2)
        .register(
            "touch",
            ServiceOptions::with_participant(r),
            |_ctx, (): ()| async move { Ok(()) },
        )
        .unwrap();
    c
}

/// The phase of `tid` at node `i` ("gone" once it left the table).
fn phase(c: &Cluster, i: u32, tid: Tid) -> String {
    c.node(i)
        .tm()
        .status(tid)
        .map_or_else(|| "gone".to_string(), |s| s.phase)
}

fn touch() -> Address {
    "touch@2".parse().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_participants_held_vote_holds_the_commit_until_released() {
    let (r, open) = Gated::new(Vote::Yes { durable: true });
    let c = with_participant(r.clone(), 301).await;
    let tx = c.node(1).begin();
    let tid = tx.tid();
    let (): () = tx.call(&touch(), ()).await.unwrap();
    let commit = tokio::spawn(async move { tx.commit().await });
    wait_for("the vote is held", Duration::from_secs(60), || {
        r.barriers.load(Ordering::SeqCst) == 1
    })
    .await;
    // The participant is at its barrier: its vote has not left, so the
    // coordinator is still collecting votes.
    assert_eq!(phase(&c, 1, tid), "preparing");
    assert!(
        !commit.is_finished(),
        "the decision waits for the held vote"
    );
    open.send(Ok(())).unwrap();
    commit.await.unwrap().unwrap();
    wait_for("applied", Duration::from_secs(60), || {
        r.committed.load(Ordering::SeqCst) == 1
    })
    .await;
    assert_eq!(r.aborted.load(Ordering::SeqCst), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_barrier_aborts_a_prepared_participant_before_it_votes() {
    let (r, open) = Gated::new(Vote::Yes { durable: true });
    let c = with_participant(r.clone(), 302).await;
    let tx = c.node(1).begin();
    let tid = tx.tid();
    let (): () = tx.call(&touch(), ()).await.unwrap();
    open.send(Err("a writer it used aborted".into())).unwrap();
    let err = tx.commit().await.unwrap_err();
    assert_eq!(err.status, Status::Aborted, "{err}");
    assert!(
        err.to_string().contains("a writer it used aborted"),
        "{err}"
    );
    wait_for("undone at the participant", Duration::from_secs(60), || {
        r.aborted.load(Ordering::SeqCst) >= 1 && c.node(2).tm().status(tid).is_none()
    })
    .await;
    assert_eq!(r.committed.load(Ordering::SeqCst), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_barrier_turns_a_read_only_vote_into_no() {
    let (r, open) = Gated::new(Vote::ReadOnly);
    let c = with_participant(r.clone(), 303).await;
    let tx = c.node(1).begin();
    let (): () = tx.call(&touch(), ()).await.unwrap();
    open.send(Err("it read a value that was never committed".into()))
        .unwrap();
    let err = tx.commit().await.unwrap_err();
    assert_eq!(err.status, Status::Aborted, "{err}");
    assert!(err.to_string().contains("never committed"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_coordinators_own_barrier_gates_its_decision() {
    let c = Cluster::start(1, 304).await;
    // Held, then allowed: the commit waits for it.
    let (r, open) = Gated::new(Vote::Yes { durable: true });
    let tx = c.node(1).begin();
    let tid = tx.tid();
    c.node(1).tm().enlist(tx.tid(), r.clone()).unwrap();
    let commit = tokio::spawn(async move { tx.commit().await });
    wait_for("the vote is held", Duration::from_secs(60), || {
        r.barriers.load(Ordering::SeqCst) == 1
    })
    .await;
    // The local vote waits at the barrier: nothing was logged.
    assert_eq!(phase(&c, 1, tid), "preparing");
    assert_eq!(c.node(1).tm().stats().forced_records, 0);
    assert!(!commit.is_finished(), "no commit record before the barrier");
    open.send(Ok(())).unwrap();
    commit.await.unwrap().unwrap();
    assert_eq!(r.committed.load(Ordering::SeqCst), 1);
    // Refused: the transaction aborts.
    let (r, open) = Gated::new(Vote::Yes { durable: true });
    let tx = c.node(1).begin();
    c.node(1).tm().enlist(tx.tid(), r.clone()).unwrap();
    open.send(Err("refused".into())).unwrap();
    let err = tx.commit().await.unwrap_err();
    assert_eq!(err.status, Status::Aborted, "{err}");
    assert!(err.to_string().contains("refused"), "{err}");
    assert_eq!(r.committed.load(Ordering::SeqCst), 0);
}

/// A participant that used writes of `on` (undecided here): its barrier
/// never opens, so it can only commit through an early vote naming them.
struct Dependent {
    on: Mutex<Vec<Tid>>,
}

impl weft::Resource for Dependent {
    fn name(&self) -> &str {
        "dependent"
    }
    fn class(&self) -> ParticipationClass {
        ParticipationClass::TwoPhase
    }
    fn prepare<'a>(&'a self, _tid: Tid, _log: &'a weft::Log) -> BoxFuture<'a, Vote> {
        Box::pin(async { Vote::Yes { durable: true } })
    }
    fn vote_barrier(&self, _tid: Tid) -> BoxFuture<'_, Result<(), String>> {
        Box::pin(futures::future::pending())
    }
    fn undecided_dependencies(&self, _tid: Tid) -> Result<Vec<Tid>, String> {
        Ok(self.on.lock().clone())
    }
}

/// Node 1 coordinates T1 (held at its own barrier) and T2, whose
/// participant at node 2 used T1's writes. With `lose_first_vote`, node 2's
/// first vote is lost, so node 1 asks again and gets a repeated one.
/// Returns T1's gate and both commits' handles.
async fn t2_after_t1(
    c: &Cluster,
    lose_first_vote: bool,
) -> (
    oneshot::Sender<Result<(), String>>,
    tokio::task::JoinHandle<Result<(), weft::Failure>>,
    tokio::task::JoinHandle<Result<(), weft::Failure>>,
) {
    let dependent = Arc::new(Dependent {
        on: Mutex::new(Vec::new()),
    });
    c.node(2)
        .register(
            "dependent",
            ServiceOptions::with_participant(dependent.clone()),
            |_ctx, (): ()| async move { Ok(()) },
        )
        .unwrap();
    let (gate, open) = Gated::new(Vote::Yes { durable: true });
    let t1 = c.node(1).begin();
    c.node(1).tm().enlist(t1.tid(), gate.clone()).unwrap();
    let t2 = c.node(1).begin();
    let t2_tid = t2.tid();
    *dependent.on.lock() = vec![t1.tid()];
    let (): () = t2.call(&"dependent@2".parse().unwrap(), ()).await.unwrap();
    let t1 = tokio::spawn(async move { t1.commit().await });
    wait_for("T1 is held", Duration::from_secs(60), || {
        gate.barriers.load(Ordering::SeqCst) == 1
    })
    .await;
    let lossy = weft::LinkFaults {
        drop: 1.0,
        scope: weft::FaultScope::Messages,
        ..weft::LinkFaults::none()
    };
    if lose_first_vote {
        c.plan.set_link(weft::NodeId(2), weft::NodeId(1), lossy);
    }
    let t2 = tokio::spawn(async move { t2.commit().await });
    if lose_first_vote {
        // Node 2 voted (the vote is lost on the way).
        wait_for("node 2 voted", Duration::from_secs(60), || {
            phase(c, 2, t2_tid) == "prepared"
        })
        .await;
        c.plan
            .set_link(weft::NodeId(2), weft::NodeId(1), weft::LinkFaults::none());
        // The coordinator's retried Prepare draws the vote again.
    }
    // The vote, naming T1, waits at the coordinator for T1's commit record.
    wait_for("T2's vote waits for T1", Duration::from_secs(60), || {
        c.node(1).tm().bookkeeping().side_tables == 1
    })
    .await;
    assert_eq!(phase(c, 1, t2_tid), "preparing");
    assert!(!t2.is_finished(), "T2 is decided only after T1");
    (open, t1, t2)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vote_naming_a_transaction_of_the_same_coordinator_commits_right_after_it() {
    let c = Cluster::start(2, 305).await;
    let (open, t1, t2) = t2_after_t1(&c, false).await;
    open.send(Ok(())).unwrap();
    t1.await.unwrap().unwrap();
    tokio::time::timeout(Duration::from_secs(60), t2)
        .await
        .expect("T2 commits without its participant's barrier")
        .unwrap()
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vote_naming_a_transaction_that_aborts_aborts_too() {
    let c = Cluster::start(2, 306).await;
    let (open, t1, t2) = t2_after_t1(&c, false).await;
    open.send(Err("T1 gave up".into())).unwrap();
    assert_eq!(t1.await.unwrap().unwrap_err().status, Status::Aborted);
    let err = tokio::time::timeout(Duration::from_secs(60), t2)
        .await
        .expect("T2 ends")
        .unwrap()
        .unwrap_err();
    assert_eq!(err.status, Status::Aborted, "{err}");
    assert!(err.to_string().contains("which aborted"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeated_vote_still_names_what_it_waits_for() {
    let c = Cluster::start(2, 307).await;
    let (open, t1, t2) = t2_after_t1(&c, true).await;
    open.send(Ok(())).unwrap();
    t1.await.unwrap().unwrap();
    tokio::time::timeout(Duration::from_secs(60), t2)
        .await
        .expect("T2 ends")
        .unwrap()
        .unwrap();
}
