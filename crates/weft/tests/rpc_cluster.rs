//! RPC across in-process clusters of 2 and 5 nodes: typed calls with and
//! without a transaction, the participant tree recorded at both ends, and
//! the status of every failure.

mod common;

use std::time::{Duration, Instant};

use common::*;
use serde::{Deserialize, Serialize};
use weft::{Address, Failure, Payload, ServiceOptions, Status};

#[derive(Serialize, Deserialize, Debug, PartialEq, Clone)]
struct Add {
    a: i64,
    b: i64,
}

/// The durations `slow` calls were started with (a call is known to run
/// once its value is here).
static SLOW_STARTED: parking_lot::Mutex<std::collections::BTreeSet<u64>> =
    parking_lot::Mutex::new(std::collections::BTreeSet::new());

fn addr(s: &str) -> Address {
    s.parse().unwrap()
}

/// Every node offers `add` and `relay` (which calls `add` on another node
/// within the caller's transaction) and `slow`.
fn install(c: &Cluster) {
    for node in &c.nodes {
        node.register(
            "add",
            ServiceOptions::no_state(),
            |_ctx, req: Add| async move { Ok(req.a + req.b) },
        )
        .unwrap();
        node.register(
            "relay",
            ServiceOptions::no_state(),
            |ctx, (to, req): (u32, Add)| async move {
                let sum: i64 = ctx.call(&format!("add@{to}").parse().unwrap(), req).await?;
                Ok(sum)
            },
        )
        .unwrap();
        node.register(
            "slow",
            ServiceOptions::no_state(),
            |_ctx, ms: u64| async move {
                SLOW_STARTED.lock().insert(ms);
                tokio::time::sleep(Duration::from_millis(ms)).await;
                Ok(ms)
            },
        )
        .unwrap();
        node.rpc()
            .register_raw(
                "is_local",
                ServiceOptions::no_state(),
                |_ctx, p: Payload| {
                    let local = p.is_local();
                    let fut: futures::future::BoxFuture<'static, Result<Payload, Failure>> =
                        Box::pin(async move { Ok(Payload::local(local)) });
                    fut
                },
            )
            .unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_across_five_nodes_without_and_with_a_transaction() {
    let c = Cluster::start(5, 101).await;
    install(&c);
    for from in &c.nodes {
        for to in 1..=5u32 {
            let sum: i64 = from
                .call(&addr(&format!("add@{to}")), Add { a: to as i64, b: 1 })
                .await
                .unwrap();
            assert_eq!(sum, to as i64 + 1);
        }
    }
    // In-process calls hand the value over without serializing it.
    let local: bool = c.node(1).call(&addr("is_local@3"), 5u8).await.unwrap();
    assert!(local);

    let tx = c.node(1).begin();
    let tid = tx.tid();
    let s: i64 = tx.call(&addr("add@2"), Add { a: 1, b: 2 }).await.unwrap();
    assert_eq!(s, 3);
    let s: i64 = tx
        .call(&addr("relay@3"), (5u32, Add { a: 10, b: 20 }))
        .await
        .unwrap();
    assert_eq!(s, 30);
    // The tree: 1 -> {2, 3}, 3 -> 5, recorded at both ends of every edge.
    let at1 = c.node(1).tm().status(tid).unwrap();
    assert!(at1.coordinator);
    assert_eq!(at1.children, vec![weft::NodeId(2), weft::NodeId(3)]);
    let at2 = c.node(2).tm().status(tid).unwrap();
    assert_eq!(at2.parent, Some(weft::NodeId(1)));
    let at3 = c.node(3).tm().status(tid).unwrap();
    assert_eq!(at3.parent, Some(weft::NodeId(1)));
    assert_eq!(at3.children, vec![weft::NodeId(5)]);
    let at5 = c.node(5).tm().status(tid).unwrap();
    assert_eq!(at5.parent, Some(weft::NodeId(3)));
    assert!(
        c.node(4).tm().status(tid).is_none(),
        "node 4 never took part"
    );
    tx.commit().await.unwrap();
    // Read-only everywhere: every branch left at once and wrote nothing.
    for n in &c.nodes {
        wait_for("branches forgotten", Duration::from_secs(60), || {
            n.tm().status(tid).is_none()
        })
        .await;
        assert_eq!(n.tm().stats().forced_records, 0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_failure_has_a_precise_status() {
    let c = Cluster::start(2, 102).await;
    install(&c);
    let n1 = c.node(1);
    let err = n1.call::<_, i64>(&addr("nosuch@2"), 1u8).await.unwrap_err();
    assert_eq!(err.status, Status::NoSuchService, "{err}");
    assert!(
        err.detail.contains("add"),
        "the error lists what exists: {err}"
    );
    let err = n1
        .call::<_, i64>(&addr("add@2"), "not an Add".to_string())
        .await
        .unwrap_err();
    assert_eq!(err.status, Status::BadRequest, "{err}");
    let err = n1
        .call::<_, String>(&addr("add@2"), Add { a: 1, b: 1 })
        .await
        .unwrap_err();
    assert_eq!(err.status, Status::Mismatch, "{err}");
    let err = n1
        .call::<_, i64>(&addr("add@9"), Add { a: 1, b: 1 })
        .await
        .unwrap_err();
    assert_eq!(err.status, Status::AddrError, "{err}");
    let err = n1
        .rpc()
        .call_payload(
            None,
            &addr("slow@2"),
            Payload::local(5_000u64),
            Some(Instant::now() + Duration::from_millis(100)),
        )
        .await
        .unwrap_err();
    // TimedOut, not the handler's answer: the caller did not wait for it.
    assert_eq!(err.status, Status::TimedOut, "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_node_fails_pending_calls_with_host_dead_and_aborts_its_transactions() {
    let c = Cluster::start(3, 103).await;
    install(&c);
    let tx = c.node(1).begin();
    let tid = tx.tid();
    let _: i64 = tx.call(&addr("add@2"), Add { a: 1, b: 1 }).await.unwrap();
    let caller = c.node(1).clone();
    let pending =
        tokio::spawn(async move { caller.call::<_, u64>(&addr("slow@3"), 60_000u64).await });
    wait_for(
        "the slow call runs at node 3",
        Duration::from_secs(60),
        || SLOW_STARTED.lock().contains(&60_000),
    )
    .await;
    c.node(3).crash();
    c.node(2).crash();
    let err = pending.await.unwrap().unwrap_err();
    assert_eq!(err.status, Status::HostDead, "{err}\n{}", c.plan.report());
    // Node 2 took part in the transaction and died: it aborts, and commit
    // says why, whether or not the coordinator has forgotten it yet.
    let err = tx.commit().await.unwrap_err();
    assert_eq!(err.status, Status::HostDead, "{err}");
    assert!(err.to_string().contains("node 2"), "{err}");
    assert!(c.node(1).tm().status(tid).is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_commit_reports_the_abort_cause_the_coordinator_remembered() {
    let c = Cluster::start(2, 105).await;
    install(&c);
    let tx = c.node(1).begin();
    let tid = tx.tid();
    let _: i64 = tx.call(&addr("add@2"), Add { a: 1, b: 1 }).await.unwrap();
    c.node(2).crash();
    // Wait until the coordinator has aborted and forgotten the transaction:
    // commit then finds only its tombstone.
    wait_for(
        "the coordinator forgets the transaction",
        Duration::from_secs(60),
        || c.node(1).tm().status(tid).is_none(),
    )
    .await;
    assert_eq!(
        c.node(1).tm().finished_outcome(tid),
        Some(Some(weft::Outcome::Aborted))
    );
    let err = tx.commit().await.unwrap_err();
    assert_eq!(err.status, Status::HostDead, "{err}");
    assert!(err.to_string().contains("node 2"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partition_gives_a_status_not_a_hang() {
    let c = Cluster::start(2, 104).await;
    install(&c);
    c.plan.partition(&[weft::NodeId(1)], &[weft::NodeId(2)]);
    let err = c
        .node(1)
        .call::<_, i64>(&addr("add@2"), Add { a: 1, b: 1 })
        .await
        .unwrap_err();
    assert!(
        matches!(err.status, Status::HostDead | Status::TimedOut),
        "{err}"
    );
    c.plan.heal();
    c.converge().await;
    let s: i64 = c
        .node(1)
        .call(&addr("add@2"), Add { a: 2, b: 2 })
        .await
        .unwrap();
    assert_eq!(s, 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transactional_calls_over_tcp() {
    use weft::{ChannelSet, Node, Seed};
    let only_tcp = ChannelSet {
        inproc: false,
        shm: false,
        tcp: true,
    };
    let a = Node::builder(1)
        .listen("127.0.0.1:0".parse().unwrap())
        .channels(only_tcp)
        .secret("s")
        .start()
        .await
        .unwrap();
    let b = Node::builder(2)
        .listen("127.0.0.1:0".parse().unwrap())
        .channels(only_tcp)
        .secret("s")
        .join(Seed::Tcp(a.addr().unwrap()))
        .start()
        .await
        .unwrap();
    b.register(
        "add",
        ServiceOptions::no_state(),
        |_ctx, req: Add| async move { Ok(req.a + req.b) },
    )
    .unwrap();
    let tx = a.begin();
    let s: i64 = tx.call(&addr("add@2"), Add { a: 40, b: 2 }).await.unwrap();
    assert_eq!(s, 42);
    assert_eq!(
        b.tm().status(tx.tid()).unwrap().parent,
        Some(weft::NodeId(1))
    );
    assert_eq!(
        a.endpoint()
            .view()
            .nodes
            .iter()
            .find(|n| n.info.id.0 == 2)
            .unwrap()
            .channel,
        Some(weft::ChannelKind::Tcp)
    );
    tx.commit().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_node_removes_its_temporary_directory() {
    let node = weft::Node::builder(1).start().await.unwrap();
    let dir = node.data_dir().to_path_buf();
    assert!(!node.is_persistent());
    assert!(dir.exists());
    // Its own admin services answer, then the node goes away entirely.
    let status = node
        .rpc()
        .call_payload(
            None,
            &"_status@1".parse().unwrap(),
            Payload::local(()),
            None,
        )
        .await;
    assert!(status.is_ok(), "{status:?}");
    node.shutdown().await;
    drop(node);
    let deadline = Instant::now() + Duration::from_secs(5);
    while dir.exists() {
        assert!(
            Instant::now() < deadline,
            "{} outlived its node: something still holds the node",
            dir.display()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
