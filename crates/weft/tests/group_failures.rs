//! Member, sender and directory failures in the middle of group
//! communications, through the fault-injecting transport: crashes,
//! partitions, lossy links, a restarted directory (T-Shoshin 3.3.2).

#[path = "group_support.rs"]
mod support;

use std::sync::Arc;
use std::time::Duration;

use support::*;
use weft::{FaultScope, LinkFaults, Node, NodeId, Payload, Seed, Status};
use weft_group::config::GroupConfig;
use weft_group::service::GroupPlugin;

const LONG: Duration = Duration::from_secs(5);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_senders_communications_end_with_nocomm_at_its_members() {
    let c = GroupCluster::start(3, 301).await;
    let g = gid("fa:sender");
    c.g(1).create(&g, "").await.unwrap();
    let a = c.g(2).join(&g, "").await.unwrap();
    let b = c.g(2).join(&g, "").await.unwrap();
    let s = c.g(3).sender();
    assert_eq!(s.send(&g, Payload::local(1u8)).await.unwrap(), 2);
    let received = a.recv(&g, None).await.unwrap();
    c.node(3).crash();
    // The reply fails once node 2 knows the sender's node is gone.
    let f = tokio::time::timeout(LONG, received.reply(Payload::local(2u8)))
        .await
        .expect("the reply does not hang")
        .unwrap_err();
    assert_eq!(f.status, Status::NoComm, "{f}\n{}", c.report());
    // The member that had not received yet gets NoComm instead of the
    // message: it never waits on a dead communication.
    let f = b.recv(&g, None).await.unwrap_err();
    assert_eq!(f.status, Status::NoComm, "{f}");
    assert!(b.try_recv(&g, None).unwrap().is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_sender_terminates_its_communications() {
    let c = GroupCluster::start(2, 302).await;
    let g = gid("fa:dropped");
    c.g(1).create(&g, "").await.unwrap();
    let m = c.g(2).join(&g, "").await.unwrap();
    let s = c.g(1).sender();
    s.send(&g, Payload::local(1u8)).await.unwrap();
    let i = m.recv(&g, None).await.unwrap();
    drop(s); // the sending process dies, its node lives on
    let f = i.reply(Payload::local(2u8)).await.unwrap_err();
    assert_eq!(f.status, Status::NoComm, "{f}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partitioned_member_node_is_counted_dead_then_comes_back() {
    let c = GroupCluster::start(3, 303).await;
    let g = gid("fa:partition");
    c.g(1).create(&g, "").await.unwrap();
    let m2 = c.g(2).join(&g, "").await.unwrap();
    let m3 = c.g(3).join(&g, "").await.unwrap();
    let s = c.g(2).sender();
    assert_eq!(s.send(&g, Payload::local(1u8)).await.unwrap(), 2);
    m2.recv(&g, None)
        .await
        .unwrap()
        .reply(Payload::local(2u8))
        .await
        .unwrap();
    let _held = m3.recv(&g, None).await.unwrap();
    c.cluster
        .plan
        .partition(&[NodeId(3)], &[NodeId(1), NodeId(2)]);
    assert!(s.next_reply(&g, LONG).await.is_ok());
    let f = s.next_reply(&g, LONG).await.unwrap_err();
    assert_eq!(f.status, Status::HostDead, "{f}\n{}", c.report());
    // While cut off, node 3's member is not counted: node 2's sends report
    // its node unreachable. It stays a member (a death verdict is each
    // node's own), so no table drops it.
    assert_eq!(s.send(&g, Payload::local(3u8)).await.unwrap(), 1);
    assert_eq!(
        s.delivery(&g).unwrap().lost,
        vec![(NodeId(3), Status::HostDead)]
    );
    assert_eq!(hosts(&c, 2, &g), vec![NodeId(2), NodeId(3)]);
    // Healed: node 3's member counts again.
    c.cluster.plan.heal();
    c.cluster.converge().await;
    assert_eq!(
        s.send(&g, Payload::local(4u8)).await.unwrap(),
        2,
        "{}",
        c.report()
    );
}

/// The hosts of `g` in node `n`'s cached table.
fn hosts(c: &GroupCluster, n: u32, g: &weft::GroupId) -> Vec<NodeId> {
    c.g(n)
        .cached()
        .into_iter()
        .find(|i| &i.gid == g)
        .map(|i| i.hosts)
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_cut_from_the_directory_alone_keeps_its_members() {
    // Issue 16 at the group layer: only the link between the directory
    // (node 1) and node 3 is cut. Node 1 declares node 3 dead on its own;
    // node 2 still reaches it, so node 3's member stays a member: node 2
    // delivers to it and counts it, and only node 1's sends report it
    // unreachable (HostDead, to the sender).
    let c = GroupCluster::start(3, 307).await;
    let g = gid("fa:dircut");
    c.g(1).create(&g, "").await.unwrap();
    let m2 = c.g(2).join(&g, "").await.unwrap();
    let m3 = c.g(3).join(&g, "").await.unwrap();
    let both = vec![NodeId(2), NodeId(3)];
    wait_for("every node knows both hosts", LONG, || {
        (1..=3).all(|n| hosts(&c, n, &g) == both)
    })
    .await;
    c.cluster.plan.partition(&[NodeId(1)], &[NodeId(3)]);
    wait_for("node 1 declared node 3 dead", LONG, || {
        c.node(1).endpoint().peer_status(NodeId(3)).is_some()
    })
    .await;
    assert_eq!(
        c.node(2).endpoint().peer_status(NodeId(3)),
        None,
        "node 2 still reaches node 3\n{}",
        c.report()
    );
    // For longer than a push takes after the verdict (a removal pushed by
    // the directory would reach node 2 well within it), every send from
    // node 2 reaches both members.
    let s = c.g(2).sender();
    let until = std::time::Instant::now() + test_config().push_timeout;
    let mut round = 0u32;
    while round < 5 || std::time::Instant::now() < until {
        round += 1;
        assert_eq!(
            s.send(&g, Payload::local(round)).await.unwrap(),
            2,
            "round {round}: node 3's member counts at node 2\n{}",
            c.report()
        );
        assert_eq!(
            m3.recv(&g, None).await.unwrap().decode::<u32>().unwrap(),
            round
        );
        assert_eq!(
            m2.recv(&g, None).await.unwrap().decode::<u32>().unwrap(),
            round
        );
        tokio::time::sleep(HEARTBEAT).await;
    }
    assert_eq!(hosts(&c, 2, &g), both, "{}", c.report());
    // The directory's own sender cannot reach node 3: it alone is told.
    let s1 = c.g(1).sender();
    assert_eq!(s1.send(&g, Payload::local(0u32)).await.unwrap(), 1);
    assert_eq!(
        s1.delivery(&g).unwrap().lost,
        vec![(NodeId(3), Status::HostDead)]
    );
    assert_eq!(hosts(&c, 1, &g), both, "{}", c.report());
    // Healed: the directory reaches node 3's member again.
    c.cluster.plan.heal();
    c.cluster.converge().await;
    assert_eq!(
        s1.send(&g, Payload::local(1u32)).await.unwrap(),
        2,
        "{}",
        c.report()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_send_after_an_idle_spell_is_retransmitted_promptly() {
    // A node's group timer sleeps while nothing is timed, looking again on
    // its own only every `quiet_check` (here 30 s); a send whose message is
    // lost must wake it at once, so the first retransmission comes after
    // 60 ms, not after that look.
    let c = GroupCluster::start_with(
        2,
        306,
        |_| GroupConfig {
            quiet_check: Duration::from_secs(30),
            ..test_config()
        },
        |_, b| b,
    )
    .await;
    let g = gid("fa:idle");
    c.g(1).create(&g, "pw").await.unwrap();
    let _m = c.g(2).join(&g, "pw").await.unwrap();
    wait_for("node 1 knows node 2 hosts the group", LONG, || {
        c.g(1)
            .cached()
            .iter()
            .any(|i| i.gid == g && i.hosts == vec![NodeId(2)])
    })
    .await;
    // Past 2 × probe_after (400 ms): every communication is forgotten and
    // the timers sleep.
    tokio::time::sleep(Duration::from_millis(1000)).await;
    c.cluster.plan.set_link(
        NodeId(1),
        NodeId(2),
        LinkFaults {
            drop: 1.0,
            scope: FaultScope::Messages,
            ..LinkFaults::none()
        },
    );
    let plan = c.cluster.plan.clone();
    let calm = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(20)).await;
        plan.calm();
    });
    let s = c.g(1).sender();
    let started = std::time::Instant::now();
    assert_eq!(s.send(&g, Payload::local(1u8)).await.unwrap(), 1);
    let took = started.elapsed();
    calm.await.unwrap();
    assert!(
        c.cluster
            .plan
            .history()
            .iter()
            .any(|h| h.contains("Message: []")),
        "the first message was dropped: {}",
        c.report()
    );
    assert!(
        took < Duration::from_millis(700),
        "the retransmission waited for the idle timer's look: {took:?}\n{}",
        c.report()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn communications_complete_over_lossy_links() {
    let c = GroupCluster::start(3, 304).await;
    c.cluster.plan.set_default(LinkFaults {
        drop: 0.2,
        duplicate: 0.1,
        reorder: 0.1,
        scope: FaultScope::Messages,
        ..LinkFaults::none()
    });
    let g = gid("fa:lossy");
    c.g(1).create(&g, "pw").await.unwrap();
    let mut tasks = Vec::new();
    for n in [1, 2, 3, 3] {
        let m = c.g(n).join(&g, "pw").await.unwrap();
        let g = g.clone();
        tasks.push(tokio::spawn(async move {
            loop {
                match m.recv(&g, None).await {
                    Ok(mut i) => {
                        let x: u32 = i.decode().unwrap();
                        let _ = i.reply(Payload::local(x + 1)).await;
                    }
                    Err(f) if f.status == Status::NoComm => {}
                    Err(f) => panic!("member failed: {f}"),
                }
            }
        }));
    }
    let s = c.g(2).sender();
    for round in 0..20u32 {
        let n = s
            .send(&g, Payload::local(round))
            .await
            .unwrap_or_else(|f| panic!("round {round}: {f}\n{}", c.report()));
        assert!(n <= 4);
        let mut replies = 0;
        loop {
            match s.next_reply(&g, LONG).await {
                Ok(r) => {
                    assert_eq!(r.decode::<u32>().unwrap(), round + 1);
                    replies += 1;
                }
                Err(f) if f.status == Status::NoComm => break,
                Err(f) => panic!("round {round}: {f}\n{}", c.report()),
            }
        }
        assert_eq!(replies, n, "round {round}\n{}", c.report());
    }
    c.cluster.plan.calm();
    for t in tasks {
        t.abort();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn groups_keep_working_from_caches_while_the_directory_is_down() {
    let c = GroupCluster::start(3, 305).await;
    let g = gid("fa:nodir");
    c.g(1).create(&g, "pw").await.unwrap();
    let m3 = c.g(3).join(&g, "pw").await.unwrap();
    c.node(1).crash();
    let s = c.g(2).sender();
    assert_eq!(s.send(&g, Payload::local(1u8)).await.unwrap(), 1);
    m3.recv(&g, None)
        .await
        .unwrap()
        .reply(Payload::local(2u8))
        .await
        .unwrap();
    s.next_reply(&g, LONG).await.unwrap();
    // Node 3 already hosts the group: another member joins locally.
    let _again = c.g(3).join(&g, "pw").await.unwrap();
    // A first member at node 2 needs the directory.
    let f = c.g(2).join(&g, "pw").await.unwrap_err();
    assert!(
        matches!(
            f.status,
            Status::HostDead | Status::TimedOut | Status::Unavailable
        ),
        "{f}"
    );
    assert_eq!(s.send(&g, Payload::local(3u8)).await.unwrap(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_directory_rebuilds_the_table_from_the_nodes() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().to_path_buf();
    let c = GroupCluster::start_with(
        3,
        306,
        |_| test_config(),
        move |id, b| {
            if id == 1 {
                b.data_dir(data.clone())
            } else {
                b
            }
        },
    )
    .await;
    let g = gid("fa:restart");
    c.g(2).create(&g, "pw").await.unwrap();
    let m2 = c.g(2).join(&g, "pw").await.unwrap();
    let m3 = c.g(3).join(&g, "pw").await.unwrap();
    c.node(1).crash();
    tokio::time::sleep(DEAD_AFTER).await;
    let plugin = GroupPlugin::new(test_config());
    let restarted = Node::builder(1)
        .hub(c.cluster.hub.clone())
        .fault(c.cluster.plan.clone())
        .secret("test-cluster")
        .failure_detector(HEARTBEAT, DEAD_AFTER)
        .connect_timeout(Duration::from_millis(500))
        .data_dir(dir.path())
        .plugin(plugin.clone())
        .start()
        .await
        .expect("node 1 restarts");
    let _ = Seed::Inproc(NodeId(1));
    let g1 = plugin.groups().unwrap();
    wait_for(
        "the new directory learned the group and its hosts",
        LONG,
        || {
            g1.cached()
                .iter()
                .any(|i| i.gid == g && i.hosts == vec![NodeId(2), NodeId(3)])
        },
    )
    .await;
    // A host is listed from the first node's cache, before the new
    // directory reaches it: the send waits for the links, not the table.
    wait_for("the new directory reaches nodes 2 and 3", LONG, || {
        [NodeId(2), NodeId(3)]
            .iter()
            .all(|n| restarted.endpoint().peer_status(*n).is_none())
    })
    .await;
    let s = g1.sender();
    assert_eq!(
        s.send(&g, Payload::local(1u8)).await.unwrap(),
        2,
        "{}",
        c.report()
    );
    m2.recv(&g, None).await.unwrap();
    m3.recv(&g, None).await.unwrap();
    // The old secret still holds; the new directory serves first joins.
    let _m1 = g1
        .join(&g, "pw")
        .await
        .expect("first join at the restarted node");
    assert_eq!(
        g1.join(&g, "bad").await.unwrap_err().status,
        Status::WrongSecret
    );
    c.g(3)
        .destroy(&g, "pw")
        .await
        .expect("destroy through the new directory");
    let _ = Arc::new(restarted);
}
