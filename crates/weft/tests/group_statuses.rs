//! Every failure status of group communication, each produced on purpose
//! through whole nodes (T-Shoshin's failure semantics, chapter 3.3).

#[path = "group_support.rs"]
mod support;

use std::time::Duration;

use support::*;
use weft::{Incarnation, NodeId, Payload, Status, Tid};
use weft_group::config::GroupConfig;

const SHORT: Duration = Duration::from_millis(300);
const LONG: Duration = Duration::from_secs(5);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_secret_and_no_such_group() {
    let c = GroupCluster::start(3, 101).await;
    let g = gid("st:secret");
    c.g(1).create(&g, "right").await.unwrap();
    let f = c.g(2).join(&g, "wrong").await.unwrap_err();
    assert_eq!(f.status, Status::WrongSecret, "{f}");
    let f = c.g(3).destroy(&g, "wrong").await.unwrap_err();
    assert_eq!(f.status, Status::WrongSecret, "{f}");
    let unknown = gid("st:nobody");
    let f = c.g(2).join(&unknown, "x").await.unwrap_err();
    assert_eq!(f.status, Status::NoSuchGroup, "{f}");
    let f = c
        .g(2)
        .sender()
        .send(&unknown, Payload::empty())
        .await
        .unwrap_err();
    assert_eq!(f.status, Status::NoSuchGroup, "{f}");
    let f = c.g(3).destroy(&unknown, "x").await.unwrap_err();
    assert_eq!(f.status, Status::NoSuchGroup, "{f}");
    // Creating twice is refused; after destroy the name is free again.
    assert_eq!(
        c.g(2).create(&g, "x").await.unwrap_err().status,
        Status::Refused
    );
    c.g(3).destroy(&g, "right").await.unwrap();
    assert_eq!(
        c.g(2).join(&g, "right").await.unwrap_err().status,
        Status::NoSuchGroup
    );
    c.g(2).create(&g, "new").await.unwrap();
    let _m = c
        .g(1)
        .join(&g, "new")
        .await
        .expect("re-created group takes its new secret");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_members_and_timed_out() {
    let c = GroupCluster::start(2, 102).await;
    let g = gid("st:empty");
    c.g(1).create(&g, "").await.unwrap();
    let s = c.g(2).sender();
    let f = s.send(&g, Payload::empty()).await.unwrap_err();
    assert_eq!(f.status, Status::NoMembers, "{f}");
    // A member that receives but never replies: the sender times out.
    let m = c.g(1).join(&g, "").await.unwrap();
    assert_eq!(s.send(&g, Payload::local(1u8)).await.unwrap(), 1);
    let _held = m.recv(&g, None).await.unwrap();
    let f = s.next_reply(&g, SHORT).await.unwrap_err();
    assert_eq!(f.status, Status::TimedOut, "{f}");
    // After leaving, the group is empty again.
    m.leave(&g, "").await.unwrap();
    let f = s.send(&g, Payload::empty()).await.unwrap_err();
    assert_eq!(f.status, Status::NoMembers, "{f}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_comm_for_replies_to_finished_communications() {
    let c = GroupCluster::start(3, 103).await;
    let g = gid("st:nocomm");
    c.g(1).create(&g, "").await.unwrap();
    let a = c.g(2).join(&g, "").await.unwrap();
    let b = c.g(3).join(&g, "").await.unwrap();
    let s = c.g(1).sender();
    assert_eq!(s.send(&g, Payload::local(1u8)).await.unwrap(), 2);
    let ia = a.recv(&g, None).await.unwrap();
    let ib = b.recv(&g, None).await.unwrap();
    // Replies set to 0: the communication terminates at once.
    assert_eq!(s.set_replies(&g, 0).unwrap(), 0);
    let f = ia.reply(Payload::local(2u8)).await.unwrap_err();
    assert_eq!(f.status, Status::NoComm, "{f}");
    let f = s.next_reply(&g, SHORT).await.unwrap_err();
    assert_eq!(f.status, Status::NoComm, "{f}");
    assert_eq!(s.set_replies(&g, 1).unwrap_err().status, Status::NoComm);
    // A member that learns late (its node may not have heard the
    // termination yet) still ends with NoComm, never hangs.
    let f = ib.reply(Payload::local(3u8)).await.unwrap_err();
    assert_eq!(f.status, Status::NoComm, "{f}");
    // Nothing sent by this sender yet to another group.
    let other = gid("st:other");
    c.g(1).create(&other, "").await.unwrap();
    assert_eq!(
        s.next_reply(&other, SHORT).await.unwrap_err().status,
        Status::NoComm
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn host_dead_when_a_member_node_dies_mid_communication() {
    let c = GroupCluster::start(3, 104).await;
    let g = gid("st:hostdead");
    c.g(1).create(&g, "").await.unwrap();
    let m2 = c.g(2).join(&g, "").await.unwrap();
    let _m3 = c.g(3).join(&g, "").await.unwrap();
    let s = c.g(1).sender();
    assert_eq!(s.send(&g, Payload::local(1u8)).await.unwrap(), 2);
    let i2 = m2.recv(&g, None).await.unwrap();
    i2.reply(Payload::local(2u8)).await.unwrap();
    c.node(3).crash();
    let r = s.next_reply(&g, LONG).await.unwrap();
    assert_eq!(r.from, m2.id());
    let f = s.next_reply(&g, LONG).await.unwrap_err();
    assert_eq!(f.status, Status::HostDead, "{f}\n{}", c.report());
    assert_eq!(
        s.next_reply(&g, SHORT).await.unwrap_err().status,
        Status::NoComm
    );
    // A crash is known only through each node's own verdict, which stays
    // local: node 3's member is not removed, and the next send counts 1 and
    // reports node 3 HostDead to the sender.
    assert_eq!(s.send(&g, Payload::local(3u8)).await.unwrap(), 1);
    assert_eq!(
        s.delivery(&g).unwrap().lost,
        vec![(NodeId(3), Status::HostDead)]
    );
    // A send whose only member node is dead reports HostDead.
    let lonely = gid("st:lonely");
    c.g(1).create(&lonely, "").await.unwrap();
    let _m = c.g(2).join(&lonely, "").await.unwrap();
    c.node(2).crash();
    let f = s.send(&lonely, Payload::empty()).await;
    match f {
        Err(f) => assert!(
            matches!(f.status, Status::HostDead | Status::NoMembers),
            "{f}"
        ),
        Ok(n) => panic!("sent to {n} members of a dead node"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proc_dead_when_a_member_is_dropped() {
    let c = GroupCluster::start(2, 105).await;
    let g = gid("st:procdead");
    c.g(1).create(&g, "").await.unwrap();
    let a = c.g(2).join(&g, "").await.unwrap();
    let b = c.g(2).join(&g, "").await.unwrap();
    let s = c.g(1).sender();
    assert_eq!(s.send(&g, Payload::local(1u8)).await.unwrap(), 2);
    let _received = a.recv(&g, None).await.unwrap();
    drop(a); // received, never replied: a dead process
    drop(b); // never even received
    for _ in 0..2 {
        let f = s.next_reply(&g, LONG).await.unwrap_err();
        assert_eq!(f.status, Status::ProcDead, "{f}");
    }
    assert_eq!(
        s.next_reply(&g, SHORT).await.unwrap_err().status,
        Status::NoComm
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_buffer_when_a_member_queue_is_full() {
    let small = |_| GroupConfig {
        member_queue: 2,
        ..test_config()
    };
    let c = GroupCluster::start_with(2, 106, small, |_, b| b).await;
    let g = gid("st:nobuffer");
    c.g(1).create(&g, "").await.unwrap();
    let m = c.g(2).join(&g, "").await.unwrap();
    // Three senders, whose communications stay open, fill the queue of 2.
    let senders: Vec<_> = (0..3).map(|_| c.g(1).sender()).collect();
    assert_eq!(senders[0].send(&g, Payload::local(0u8)).await.unwrap(), 1);
    assert_eq!(senders[1].send(&g, Payload::local(1u8)).await.unwrap(), 1);
    let f = senders[2].send(&g, Payload::local(2u8)).await.unwrap_err();
    assert_eq!(f.status, Status::NoBuffer, "{f}");
    assert_eq!(senders[2].delivery(&g).unwrap().full, 1);
    // A full queue is not a crash: once drained, deliveries resume.
    let mut first = m.recv(&g, None).await.unwrap();
    assert_eq!(first.decode::<u8>().unwrap(), 0);
    first.reply(Payload::local(10u8)).await.unwrap();
    assert_eq!(senders[2].send(&g, Payload::local(2u8)).await.unwrap(), 1);
    assert_eq!(m.groups(), vec![g.clone()]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn addr_error_for_bad_addresses() {
    let c = GroupCluster::start(2, 107).await;
    for bad in ["nocolon", "a:b:c", "tx:notatid", ":x", "class:"] {
        let f = weft_group::parse_group(bad).unwrap_err();
        assert_eq!(f.status, Status::AddrError, "{bad}: {f}");
    }
    // A transaction this node does not take part in, whose coordinator
    // nobody knows: the address names no reachable node.
    let ghost = weft::GroupId::Tx(Tid::new(NodeId(99), Incarnation(1), 1));
    let f = c
        .g(1)
        .sender()
        .send(&ghost, Payload::empty())
        .await
        .unwrap_err();
    assert_eq!(f.status, Status::AddrError, "{f}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mismatch_for_replies_that_do_not_fit() {
    let c = GroupCluster::start(2, 108).await;
    let g = gid("st:mismatch");
    c.g(1).create(&g, "pw").await.unwrap();
    let m = c.g(2).join(&g, "pw").await.unwrap();
    let s = c.g(1).sender();
    s.send(&g, Payload::local("text".to_string()))
        .await
        .unwrap();
    let mut i = m.recv(&g, None).await.unwrap();
    // The message is a String, not a number.
    assert_eq!(i.decode::<u64>().unwrap_err().status, Status::Mismatch);
    i.reply(Payload::local(1u8)).await.unwrap();
    // One reply per member and communication.
    let f = i.reply(Payload::local(2u8)).await.unwrap_err();
    assert_eq!(f.status, Status::Mismatch, "{f}");
    // Leaving a group one is not a member of.
    let other = gid("st:other");
    c.g(1).create(&other, "pw").await.unwrap();
    assert_eq!(
        m.leave(&other, "pw").await.unwrap_err().status,
        Status::Mismatch
    );
    assert_eq!(
        m.try_recv(&other, None).unwrap_err().status,
        Status::Mismatch
    );
    let r = s.next_reply(&g, LONG).await.unwrap();
    assert_eq!(r.decode::<String>().unwrap_err().status, Status::Mismatch);
}
