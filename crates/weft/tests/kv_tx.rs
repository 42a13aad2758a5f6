//! Transactions over the KV service across in-process clusters: commit and
//! abort, strict two-phase locking, read-only costs, nested transactions,
//! deadlines, crashes and restarts from the data directory, and atomicity
//! under message loss, duplication, delay and partitions.

mod common;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use common::*;
use rand::{Rng, SeedableRng};
use weft::kv::{parse_int, Kv, KvConfig, KvRequest, KvResponse, Op, Reply};
use weft::{Address, Failure, FaultScope, LinkFaults, NodeId, Status, Transaction};

fn b(s: &str) -> Bytes {
    Bytes::copy_from_slice(s.as_bytes())
}

fn kv_at(node: u32) -> Address {
    format!("kv@{node}").parse().unwrap()
}

async fn kv(tx: &Transaction, node: u32, ops: Vec<Op>) -> Result<Vec<Reply>, Failure> {
    tx.call::<_, KvResponse>(&kv_at(node), KvRequest(ops))
        .await
        .map(|r| r.0)
}

async fn get(tx: &Transaction, node: u32, key: &str) -> Result<Option<Bytes>, Failure> {
    match kv(tx, node, vec![Op::Get(b(key))]).await?.pop() {
        Some(Reply::Value(v)) => Ok(v),
        other => panic!("unexpected reply {other:?}"),
    }
}

/// A cluster whose nodes each run a KV store; returns the stores too.
async fn kv_cluster(n: u32, seed: u64, lock_wait: Duration) -> (Cluster, Vec<Kv>) {
    let stores: Vec<Kv> = (0..n)
        .map(|_| {
            Kv::new(KvConfig {
                lock_wait,
                ..KvConfig::default()
            })
        })
        .collect();
    let s2 = stores.clone();
    let c = Cluster::start_with(n, seed, move |id, b| {
        b.plugin(Arc::new(s2[(id - 1) as usize].clone()))
    })
    .await;
    (c, stores)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_distributed_write_commits_everywhere_or_nowhere() {
    let (c, stores) = kv_cluster(3, 201, Duration::from_millis(300)).await;
    let tx = c.node(1).begin();
    kv(&tx, 2, vec![Op::Put(b("x"), b("1"))]).await.unwrap();
    kv(&tx, 3, vec![Op::Put(b("y"), b("1"))]).await.unwrap();
    assert_eq!(stores[1].committed(b"x"), None, "not visible before commit");
    tx.commit().await.unwrap();
    wait_for("writes applied", Duration::from_secs(60), || {
        stores[1].committed(b"x") == Some(b("1")) && stores[2].committed(b"y") == Some(b("1"))
    })
    .await;
    // Forced records: one prepare record per participant, one commit record.
    assert_eq!(c.node(1).tm().stats().forced_records, 1);
    assert_eq!(c.node(2).tm().stats().forced_records, 1);
    assert_eq!(c.node(3).tm().stats().forced_records, 1);

    let tx = c.node(1).begin();
    kv(&tx, 2, vec![Op::Put(b("x"), b("2"))]).await.unwrap();
    kv(&tx, 3, vec![Op::Delete(b("y"))]).await.unwrap();
    tx.abort("changed my mind").await.unwrap();
    let tx = c.node(1).begin();
    assert_eq!(
        get(&tx, 2, "x").await.unwrap(),
        Some(b("1")),
        "an aborted write leaves no trace"
    );
    assert_eq!(get(&tx, 3, "y").await.unwrap(), Some(b("1")));
    tx.commit().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_only_transactions_force_nothing_and_vote_read_only() {
    let (c, _stores) = kv_cluster(3, 202, Duration::from_millis(300)).await;
    let before: Vec<u64> = c
        .nodes
        .iter()
        .map(|n| n.tm().stats().forced_records)
        .collect();
    let msgs_before: u64 = c.nodes.iter().map(|n| n.tm().stats().messages).sum();
    let tx = c.node(1).begin();
    get(&tx, 2, "a").await.unwrap();
    get(&tx, 3, "b").await.unwrap();
    tx.commit().await.unwrap();
    let after: Vec<u64> = c
        .nodes
        .iter()
        .map(|n| n.tm().stats().forced_records)
        .collect();
    assert_eq!(before, after, "a read-only transaction forces nothing");
    let msgs: u64 = c.nodes.iter().map(|n| n.tm().stats().messages).sum::<u64>() - msgs_before;
    assert_eq!(msgs, 4, "one round (prepare, vote) per participant");
    assert_eq!(c.node(1).tm().stats().committed_read_only, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strict_two_phase_locking_prevents_lost_updates_and_dirty_reads() {
    let (c, stores) = kv_cluster(2, 203, Duration::from_millis(2000)).await;
    // Lost update: 8 clients add 1 to one counter, 10 times each, retrying
    // on conflict; every committed increment is counted once.
    let mut tasks = Vec::new();
    for i in 0..8 {
        let node = c.node(1 + (i % 2)).clone();
        tasks.push(tokio::spawn(async move {
            let mut committed = 0;
            while committed < 10 {
                let tx = node.begin();
                match kv(&tx, 2, vec![Op::Add(b("counter"), 1)]).await {
                    Ok(_) => {
                        if tx.commit().await.is_ok() {
                            committed += 1;
                        }
                    }
                    Err(f) => {
                        assert_eq!(f.status, Status::LockConflict, "{f}");
                        let _ = tx.abort("retry").await;
                    }
                }
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    wait_for("all increments applied", Duration::from_secs(60), || {
        stores[1].committed(b"counter").and_then(|v| parse_int(&v)) == Some(80)
    })
    .await;

    // Dirty read: an uncommitted write blocks readers until it ends.
    let writer = c.node(1).begin();
    kv(&writer, 2, vec![Op::Put(b("d"), b("dirty"))])
        .await
        .unwrap();
    let tx = c.node(2).begin();
    let reading = tx.tid();
    let reader = tokio::spawn(async move {
        let v = get(&tx, 2, "d").await;
        tx.commit().await.unwrap();
        v
    });
    // The read runs at node 2, where the writer holds the lock.
    wait_for("the read runs", Duration::from_secs(60), || {
        c.node(2)
            .tm()
            .status(reading)
            .is_some_and(|s| s.active_calls == 1)
    })
    .await;
    assert!(
        !reader.is_finished(),
        "the reader waits for the writer's lock"
    );
    writer.abort("never mind").await.unwrap();
    assert_eq!(
        reader.await.unwrap().unwrap(),
        None,
        "it never saw the aborted value"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_conflict_ends_after_the_bound() {
    let (c, _stores) = kv_cluster(2, 204, Duration::from_millis(150)).await;
    let holder = c.node(1).begin();
    kv(&holder, 2, vec![Op::Put(b("k"), b("1"))]).await.unwrap();
    let other = c.node(1).begin();
    let started = std::time::Instant::now();
    let err = kv(&other, 2, vec![Op::Put(b("k"), b("2"))])
        .await
        .unwrap_err();
    assert_eq!(err.status, Status::LockConflict, "{err}");
    assert!(started.elapsed() >= Duration::from_millis(150));
    assert!(
        err.detail.contains(&holder.tid().to_string()),
        "names the holder: {err}"
    );
    other.abort("conflict").await.unwrap();
    holder.commit().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nested_transactions_abort_alone_or_pass_effects_up() {
    let (c, stores) = kv_cluster(3, 205, Duration::from_millis(300)).await;
    let tx = c.node(1).begin();
    kv(&tx, 2, vec![Op::Put(b("parent"), b("p"))])
        .await
        .unwrap();
    // A sub-transaction writes on two nodes, then aborts alone.
    let sub = tx.sub().unwrap();
    sub.call::<_, KvResponse>(&kv_at(2), KvRequest(vec![Op::Put(b("s1"), b("x"))]))
        .await
        .unwrap();
    sub.call::<_, KvResponse>(&kv_at(3), KvRequest(vec![Op::Put(b("s1"), b("x"))]))
        .await
        .unwrap();
    sub.abort().unwrap();
    // Another commits into the parent; the parent then reads it.
    let sub = tx.sub().unwrap();
    sub.call::<_, KvResponse>(&kv_at(3), KvRequest(vec![Op::Put(b("s2"), b("y"))]))
        .await
        .unwrap();
    sub.commit().unwrap();
    assert_eq!(
        get(&tx, 3, "s2").await.unwrap(),
        Some(b("y")),
        "the parent inherits its effects"
    );
    // A nested call that fails leaves the parent going.
    let err = tx
        .call_nested::<_, KvResponse>(&kv_at(2), KvRequest(vec![Op::Add(b("parent"), 1)]))
        .await;
    assert_eq!(err.unwrap_err().status, Status::BadRequest);
    tx.commit().await.unwrap();
    // Each participant applies the outcome when its Commit arrives, after
    // the coordinator has answered: wait for both.
    wait_for("applied", Duration::from_secs(60), || {
        stores[2].committed(b"s2").is_some() && stores[1].committed(b"parent").is_some()
    })
    .await;
    assert_eq!(stores[1].committed(b"parent"), Some(b("p")));
    assert_eq!(
        stores[1].committed(b"s1"),
        None,
        "the aborted sub-transaction left nothing"
    );
    assert_eq!(stores[2].committed(b"s1"), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_past_its_deadline_aborts_and_releases_its_locks() {
    let (c, _stores) = kv_cluster(2, 206, Duration::from_millis(2000)).await;
    let tx = c
        .node(1)
        .rpc()
        .begin_with_timeout(Some(Duration::from_millis(200)));
    kv(&tx, 2, vec![Op::Put(b("k"), b("1"))]).await.unwrap();
    let tid = tx.tid();
    wait_for("the deadline aborts it", Duration::from_secs(60), || {
        c.node(1).tm().status(tid).is_none()
    })
    .await;
    // Whichever node noticed the deadline first, commit names it.
    let err = tx.commit().await.unwrap_err();
    assert_eq!(err.status, Status::TimedOut, "{err}");
    // Its lock is gone: another transaction writes at once.
    let other = c.node(1).begin();
    kv(&other, 2, vec![Op::Put(b("k"), b("2"))]).await.unwrap();
    other.commit().await.unwrap();
}

/// Transfers between keys spread over nodes, under faults; afterwards every
/// transaction is all-or-nothing on every node and the total is conserved.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn atomicity_holds_under_drops_duplicates_delays_and_partitions() {
    let seed: u64 = 207;
    let (c, stores) = kv_cluster(4, seed, Duration::from_millis(200)).await;
    let report = || c.plan.report();
    // Initial balances: 100 on each of 4 accounts (one per node).
    let setup = c.node(1).begin();
    for n in 1..=4 {
        kv(
            &setup,
            n,
            vec![Op::Put(b("acct"), weft::kv::int_value(100))],
        )
        .await
        .unwrap();
    }
    setup.commit().await.unwrap();
    c.plan.set_default(LinkFaults {
        drop: 0.05,
        duplicate: 0.05,
        reorder: 0.1,
        delay: Some((Duration::ZERO, Duration::from_millis(3))),
        scope: FaultScope::Messages,
    });
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let mut outcomes = Vec::new();
    for i in 0..60u32 {
        if i == 20 {
            c.plan
                .partition(&[NodeId(4)], &[NodeId(1), NodeId(2), NodeId(3)]);
        }
        if i == 35 {
            c.plan.heal();
        }
        let from = rng.gen_range(1..=4u32);
        let to = 1 + (from + rng.gen_range(0..3u32)) % 4;
        let coordinator = c.node(rng.gen_range(1..=3u32));
        let tx = coordinator.begin();
        let tid = tx.tid();
        let marker = format!("m/{tid}");
        let step = async {
            kv(
                &tx,
                from,
                vec![Op::Add(b("acct"), -7), Op::Put(b(&marker), b("1"))],
            )
            .await?;
            kv(
                &tx,
                to,
                vec![Op::Add(b("acct"), 7), Op::Put(b(&marker), b("1"))],
            )
            .await?;
            Ok::<_, Failure>(())
        };
        let result = match tokio::time::timeout(Duration::from_secs(3), step).await {
            Ok(Ok(())) => tx.commit().await,
            Ok(Err(f)) => {
                let _ = tx.abort(&f.detail).await;
                Err(f)
            }
            Err(_) => {
                let _ = tx.abort("step timed out").await;
                Err(Failure::new(Status::TimedOut, "step"))
            }
        };
        outcomes.push((marker, from, to, result.is_ok()));
    }
    c.plan.heal();
    c.plan.calm();
    // Wait until no transaction is left anywhere (phase two completed,
    // in-doubt branches resolved).
    // (A guard against a hang, generous for a busy machine: not a speed
    // target.)
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    while !c.nodes.iter().all(|n| n.tm().list().is_empty()) {
        if std::time::Instant::now() > deadline {
            let live: Vec<_> = c.nodes.iter().map(|n| (n.id(), n.tm().list())).collect();
            panic!("transactions still live: {live:#?}\n{}", report());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut total = 0;
    for s in &stores {
        total += s.committed(b"acct").and_then(|v| parse_int(&v)).unwrap();
    }
    assert_eq!(total, 400, "money is conserved\n{}", report());
    for (marker, from, to, committed) in outcomes {
        let at_from = stores[(from - 1) as usize]
            .committed(marker.as_bytes())
            .is_some();
        let at_to = stores[(to - 1) as usize]
            .committed(marker.as_bytes())
            .is_some();
        assert_eq!(at_from, at_to, "{marker} is all-or-nothing\n{}", report());
        if committed {
            assert!(at_from, "{marker} committed but is missing\n{}", report());
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn committed_writes_survive_a_crash_and_restart_from_the_data_directory() {
    let dir = tempfile::tempdir().unwrap();
    let hub = weft::InprocHub::new();
    let plan = Arc::new(weft::FaultPlan::new(208));
    let start = |dir: std::path::PathBuf, join: bool| {
        let mut b = builder(2, &hub, &plan)
            .data_dir(dir)
            .plugin(Arc::new(Kv::new(KvConfig::default())));
        if join {
            b = b.join(weft::Seed::Inproc(NodeId(1)));
        }
        b.start()
    };
    let n1 = builder(1, &hub, &plan).start().await.unwrap();
    let n2 = start(dir.path().to_path_buf(), true).await.unwrap();
    let tx = n1.begin();
    kv(&tx, 2, vec![Op::Put(b("kept"), b("yes"))])
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let tx = n1.begin();
    kv(&tx, 2, vec![Op::Put(b("lost"), b("uncommitted"))])
        .await
        .unwrap();
    n2.crash();
    drop(n2);
    let n2 = start(dir.path().to_path_buf(), true).await.unwrap();
    assert!(n2.incarnation().0 >= 2, "a restart is a new incarnation");
    // Its participant died: reported by the failure detector (HostDead) or,
    // when the new incarnation's Hello comes first, as a restart (ProcDead);
    // which one wins depends on how long the restart took.
    let status = tx.commit().await.unwrap_err().status;
    assert!(
        matches!(status, Status::HostDead | Status::ProcDead),
        "its participant died, yet commit failed with {status}"
    );
    let tx = n1.begin();
    assert_eq!(get(&tx, 2, "kept").await.unwrap(), Some(b("yes")));
    assert_eq!(get(&tx, 2, "lost").await.unwrap(), None);
    tx.commit().await.unwrap();
    // Checkpoint, write more, crash, recover from snapshot plus log.
    n2.checkpoint().unwrap();
    let tx = n1.begin();
    kv(&tx, 2, vec![Op::Put(b("after"), b("checkpoint"))])
        .await
        .unwrap();
    tx.commit().await.unwrap();
    wait_for("applied", Duration::from_secs(60), || {
        n2.tm().list().is_empty()
    })
    .await;
    n2.crash();
    drop(n2);
    let _n2 = start(dir.path().to_path_buf(), true).await.unwrap();
    let tx = n1.begin();
    assert_eq!(get(&tx, 2, "kept").await.unwrap(), Some(b("yes")));
    assert_eq!(get(&tx, 2, "after").await.unwrap(), Some(b("checkpoint")));
    tx.commit().await.unwrap();
}

/// Issue 16: the first checkpoint creates `<data>/kv`; a power loss that
/// drops every directory entry never fsynced must leave the snapshot (and
/// the data directory itself) in place, and a node whose log starts past its
/// snapshot must refuse to start instead of coming up empty.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checkpoint_survives_power_loss_and_a_log_past_its_snapshot_is_refused() {
    checkpoint_survives_power_loss(weft::kv::KvEngine::Memory, "kv.snapshot").await;
}

/// The same with the disk engine, whose checkpoint is a durable commit of
/// its file: that file lost, the log past it is refused the same way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_disk_engine_checkpoint_survives_power_loss_and_a_log_past_it_is_refused() {
    checkpoint_survives_power_loss(weft::kv::KvEngine::default(), "kv.redb").await;
}

async fn checkpoint_survives_power_loss(engine: weft::kv::KvEngine, file: &str) {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("data");
    let sim = weft::PowerLoss::new();
    let hub = weft::InprocHub::new();
    let plan = Arc::new(weft::FaultPlan::new(216));
    let start = || {
        let d = weft::Durability::simulated(&sim);
        builder(2, &hub, &plan)
            .data_dir(dir.clone())
            .log_config(move |c| c.durability(d))
            .plugin(Arc::new(Kv::new(KvConfig {
                engine: engine.clone(),
                ..KvConfig::default()
            })))
            .join(weft::Seed::Inproc(NodeId(1)))
            .start()
    };
    let n1 = builder(1, &hub, &plan).start().await.unwrap();
    let n2 = start().await.unwrap();
    let tx = n1.begin();
    kv(&tx, 2, vec![Op::Put(b("before"), b("checkpoint"))])
        .await
        .unwrap();
    tx.commit().await.unwrap();
    wait_for("applied", Duration::from_secs(60), || {
        n2.tm().list().is_empty()
    })
    .await;
    let start_lsn = n2.checkpoint().unwrap();
    assert!(start_lsn.get() > 0, "the checkpoint truncated the log");
    n2.crash();
    drop(n2);
    let dropped = sim.crash().unwrap();
    assert!(dropped.is_empty(), "unsynced entries: {dropped:#?}");

    let n2 = start().await.unwrap();
    let tx = n1.begin();
    assert_eq!(get(&tx, 2, "before").await.unwrap(), Some(b("checkpoint")));
    tx.commit().await.unwrap();
    n2.crash();
    drop(n2);

    // The snapshot is gone but the log says it starts past it: refuse, loudly.
    let snapshot = dir.join("kv").join(file);
    std::fs::remove_file(&snapshot).unwrap();
    let err = match start().await {
        Ok(_) => panic!("a node whose log starts past its snapshot started"),
        Err(e) => e.to_string(),
    };
    assert!(
        err.contains("refusing to start") && err.contains(&snapshot.display().to_string()),
        "{err}"
    );
}

/// A resource whose commit takes a scheduling round before it applies.
struct SlowApply(Arc<std::sync::atomic::AtomicBool>);

impl weft::Resource for SlowApply {
    fn name(&self) -> &str {
        "slow-apply"
    }
    fn class(&self) -> weft::ParticipationClass {
        weft::ParticipationClass::TwoPhase
    }
    fn prepare<'a>(
        &'a self,
        _tid: weft::Tid,
        _log: &'a weft::Log,
    ) -> futures::future::BoxFuture<'a, weft::Vote> {
        Box::pin(async { weft::Vote::Yes { durable: true } })
    }
    fn commit(&self, _tid: weft::Tid) -> futures::future::BoxFuture<'_, ()> {
        Box::pin(async move {
            tokio::task::yield_now().await;
            tokio::time::sleep(Duration::from_millis(20)).await;
            self.0.store(true, std::sync::atomic::Ordering::SeqCst);
        })
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commit_returns_only_once_the_coordinators_resources_applied_it() {
    let c = Cluster::start(2, 209).await;
    let applied = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let tx = c.node(1).begin();
    c.node(1)
        .tm()
        .enlist(tx.tid(), Arc::new(SlowApply(applied.clone())))
        .unwrap();
    tx.commit().await.unwrap();
    assert!(
        applied.load(std::sync::atomic::Ordering::SeqCst),
        "a transaction begun after commit returns must see the commit applied here"
    );
}

/// Starts one node with a KV store whose transaction manager stops every
/// coordinator right after its commit record is durable, before it reports
/// the outcome (as if it froze there); the receiver hears each one frozen.
async fn frozen_after_commit_force(
    early_lock_release: bool,
) -> (weft::Node, tokio::sync::mpsc::UnboundedReceiver<weft::Tid>) {
    let (frozen, rx) = tokio::sync::mpsc::unbounded_channel();
    let hook: weft_tx::CrashHook = Arc::new(move |_, tid| {
        let _ = frozen.send(tid);
    });
    let cfg = weft::TmConfig {
        early_lock_release,
        crash_at: Some((weft_tx::CrashPoint::CoordinatorAfterCommitForce, hook)),
        ..weft::TmConfig::default()
    };
    let kv = Kv::new(KvConfig {
        lock_wait: Duration::from_millis(200),
        ..KvConfig::default()
    });
    let node = weft::Node::builder(1)
        .tm_config(cfg)
        .plugin(Arc::new(kv))
        .checkpoint_every(None)
        .start()
        .await
        .unwrap();
    (node, rx)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn early_lock_release_frees_a_coordinators_locks_once_the_commit_record_is_logged() {
    let (node, mut frozen) = frozen_after_commit_force(true).await;
    let t1 = node.begin();
    kv(&t1, 1, vec![Op::Put(b("k"), b("1"))]).await.unwrap();
    let tid = t1.tid();
    let commit = tokio::spawn(async move { t1.commit().await });
    // T1's record is logged and forced, and T1 never reports: its lock on
    // k is nevertheless free and its write is visible.
    assert_eq!(frozen.recv().await, Some(tid));
    let t2 = node.begin();
    let seen = get(&t2, 1, "k").await.expect("k is free");
    let _ = t2.abort("probe").await;
    assert_eq!(seen, Some(b("1")));
    assert!(!commit.is_finished(), "{tid} must not have reported");
    commit.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_early_lock_release_the_locks_wait_for_the_outcome() {
    let (node, mut frozen) = frozen_after_commit_force(false).await;
    let t1 = node.begin();
    kv(&t1, 1, vec![Op::Put(b("k"), b("1"))]).await.unwrap();
    let tid = t1.tid();
    let commit = tokio::spawn(async move { t1.commit().await });
    // T1's commit record is durable; it froze before applying it.
    assert_eq!(frozen.recv().await, Some(tid));
    let t2 = node.begin();
    let err = get(&t2, 1, "k").await.unwrap_err();
    assert_eq!(err.status, Status::LockConflict, "{err}");
    let _ = t2.abort("done").await;
    commit.abort();
}
