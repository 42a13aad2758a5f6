//! Transaction multicast (Raid 3.2–3.4): `tx:<tid>` reaches every node
//! taking part in a transaction, resolved from the participant tree with no
//! set-up messages.

#[path = "group_support.rs"]
mod support;

use std::time::Duration;

use support::*;
use weft::{Address, GroupId, NodeId, Payload, ServiceOptions, Status};

const LONG: Duration = Duration::from_secs(5);

/// Registers `hop` on every node: it calls, within the caller's
/// transaction, the first node of its argument with the rest of it.
fn install_hops(c: &GroupCluster, n: u32) {
    for id in 1..=n {
        c.node(id)
            .register(
                "hop",
                ServiceOptions::no_state(),
                |ctx, path: Vec<u32>| async move {
                    if let Some((next, rest)) = path.split_first() {
                        let to: Address = format!("hop@{next}").parse().expect("address");
                        ctx.call::<Vec<u32>, ()>(&to, rest.to_vec()).await?;
                    }
                    Ok(())
                },
            )
            .expect("hop registers");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_group_reaches_every_participant_and_no_one_else() {
    let c = GroupCluster::start(5, 401).await;
    install_hops(&c, 5);
    // Participant tree: 1 -> 2 -> 3, 1 -> 4, and 4 -> 3 (3 reached twice).
    let tx = c.node(1).begin();
    tx.call::<Vec<u32>, ()>(&"hop@2".parse().unwrap(), vec![3])
        .await
        .unwrap();
    tx.call::<Vec<u32>, ()>(&"hop@4".parse().unwrap(), vec![3])
        .await
        .unwrap();
    let tid = tx.tid();
    let g = GroupId::Tx(tid);
    assert!(c.node(3).tm().status(tid).is_some(), "node 3 takes part");
    assert!(c.node(5).tm().status(tid).is_none(), "node 5 does not");
    // Every participant answers from its transaction inbox.
    let mut tasks = Vec::new();
    for id in 1..=5 {
        let inbox = c.g(id).tx_inbox();
        tasks.push(tokio::spawn(async move {
            let got = tokio::time::timeout(Duration::from_millis(800), inbox.recv(Some(tid))).await;
            match got {
                Ok(Ok(mut i)) => {
                    let text: String = i.decode().unwrap();
                    i.reply(Payload::local(format!("{id} got {text}")))
                        .await
                        .unwrap();
                    true
                }
                Ok(Err(f)) => panic!("node {id}: {f}"),
                Err(_) => false,
            }
        }));
    }
    // From a leaf of the tree.
    let s = c.g(3).sender();
    let n = s
        .send(&g, Payload::local("prepare".to_string()))
        .await
        .unwrap();
    assert_eq!(n, 4, "nodes 1-4, each once\n{}", c.report());
    let mut from = Vec::new();
    for _ in 0..4 {
        let r = s.next_reply(&g, LONG).await.unwrap();
        from.push(r.from.node.0);
        assert!(r.decode::<String>().unwrap().ends_with("got prepare"));
    }
    from.sort();
    assert_eq!(from, vec![1, 2, 3, 4]);
    let reached: Vec<bool> = futures::future::join_all(tasks)
        .await
        .into_iter()
        .map(|r| r.unwrap())
        .collect();
    assert_eq!(
        reached,
        vec![true, true, true, true, false],
        "node 5 is not a participant"
    );
    // From a node outside the transaction: routed through the coordinator.
    let outside = c.g(5).sender();
    assert_eq!(
        outside
            .send(&g, Payload::local("commit".to_string()))
            .await
            .unwrap(),
        4
    );
    for id in 1..=4 {
        let mut i = c.g(id).tx_inbox().recv(None).await.unwrap();
        assert_eq!(i.gid(), &g);
        assert_eq!(i.decode::<String>().unwrap(), "commit");
    }
    assert!(outside.delivery(&g).unwrap().lost.is_empty());
    tx.commit().await.unwrap();
    // Once the transaction is over nobody takes part any more.
    wait_for("every participant forgot the transaction", LONG, || {
        (1..=4).all(|id| c.node(id).tm().status(tid).is_none())
    })
    .await;
    let f = c
        .g(2)
        .sender()
        .send(&g, Payload::empty())
        .await
        .unwrap_err();
    assert_eq!(f.status, Status::NoMembers, "{f}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_participant_is_reported_by_the_fan_out() {
    let c = GroupCluster::start(4, 402).await;
    install_hops(&c, 4);
    let tx = c.node(1).begin_with_timeout_for_test();
    tx.call::<Vec<u32>, ()>(&"hop@2".parse().unwrap(), vec![3])
        .await
        .unwrap();
    tx.call::<Vec<u32>, ()>(&"hop@4".parse().unwrap(), vec![])
        .await
        .unwrap();
    let tid = tx.tid();
    let g = GroupId::Tx(tid);
    c.node(3).crash();
    let s = c.g(4).sender();
    let n = s.send(&g, Payload::local(1u8)).await.unwrap();
    assert_eq!(n, 3, "{}", c.report());
    let d = s.delivery(&g).unwrap();
    assert_eq!(
        d.lost.iter().map(|(n, _)| *n).collect::<Vec<_>>(),
        vec![NodeId(3)],
        "{d:?}"
    );
    drop(tx);
}

trait BeginForTest {
    fn begin_with_timeout_for_test(&self) -> weft::Transaction;
}

impl BeginForTest for weft::Node {
    fn begin_with_timeout_for_test(&self) -> weft::Transaction {
        self.rpc().begin_with_timeout(Some(Duration::from_secs(30)))
    }
}
