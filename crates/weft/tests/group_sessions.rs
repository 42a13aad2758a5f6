//! Sessions and termination (T-Shoshin chapters 3.2 and 4.3.5): supersession
//! by session numbers, reply limits (totreply), request, selective receives,
//! members of several groups, destroy, and the `_group` service a CLI uses.

#[path = "group_support.rs"]
mod support;

use std::time::Duration;

use support::*;
use weft::{NodeId, Payload, Status};
use weft_group::ids::Tag;
use weft_group::service::GroupClient;

const SHORT: Duration = Duration::from_millis(300);
const LONG: Duration = Duration::from_secs(5);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_send_supersedes_the_previous_one() {
    let c = GroupCluster::start(3, 201).await;
    let g = gid("se:super");
    c.g(1).create(&g, "").await.unwrap();
    let a = c.g(2).join(&g, "").await.unwrap();
    let b = c.g(3).join(&g, "").await.unwrap();
    let s = c.g(1).sender();
    assert_eq!(s.send(&g, Payload::local(1u32)).await.unwrap(), 2);
    let mut old = a.recv(&g, None).await.unwrap();
    assert_eq!(old.decode::<u32>().unwrap(), 1);
    let first_session = old.comm().session;
    assert_eq!(s.send(&g, Payload::local(2u32)).await.unwrap(), 2);
    // The old communication is over: its reply fails...
    let f = old.reply(Payload::local(10u32)).await.unwrap_err();
    assert_eq!(f.status, Status::NoComm, "{f}");
    // ...and a member that had not received the old message gets NoComm
    // instead of it, then the new message.
    let f = b.recv(&g, None).await.unwrap_err();
    assert_eq!(f.status, Status::NoComm, "{f}");
    let mut new = b.recv(&g, None).await.unwrap();
    assert!(new.comm().session > first_session);
    assert_eq!(new.decode::<u32>().unwrap(), 2);
    new.reply(Payload::local(20u32)).await.unwrap();
    let mut fresh = a.recv(&g, None).await.unwrap();
    assert_eq!(fresh.decode::<u32>().unwrap(), 2);
    fresh.reply(Payload::local(21u32)).await.unwrap();
    let mut got: Vec<u32> = Vec::new();
    for _ in 0..2 {
        got.push(s.next_reply(&g, LONG).await.unwrap().decode().unwrap());
    }
    got.sort();
    assert_eq!(got, vec![20, 21], "only the new communication's replies");
    // Another sender's communication with the same group is independent.
    let other = c.g(1).sender();
    other.send(&g, Payload::local(3u32)).await.unwrap();
    assert_eq!(
        s.next_reply(&g, SHORT).await.unwrap_err().status,
        Status::NoComm
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replies_beyond_the_wanted_number_are_dropped() {
    let c = GroupCluster::start(3, 202).await;
    let g = gid("se:limit");
    c.g(1).create(&g, "").await.unwrap();
    let mut members = Vec::new();
    for n in [1, 2, 3, 2, 3] {
        members.push(c.g(n).join(&g, "").await.unwrap());
    }
    let s = c.g(1).sender();
    assert_eq!(s.send(&g, Payload::local(0u8)).await.unwrap(), 5);
    assert_eq!(
        s.set_replies(&g, 9).unwrap(),
        5,
        "never more than delivered"
    );
    assert_eq!(s.set_replies(&g, 2).unwrap(), 2);
    assert_eq!(s.set_replies(&g, 4).unwrap(), 2, "may only be lowered");
    // Once two replies are in, the communication is over: later members get
    // NoComm, whether they reply or still had to receive.
    let mut outcomes = Vec::new();
    for m in &members {
        let outcome = match m.recv(&g, None).await {
            Ok(i) => i
                .reply(Payload::local(m.id().id))
                .await
                .map_err(|f| f.status),
            Err(f) => Err(f.status),
        };
        outcomes.push(outcome);
    }
    let accepted = outcomes.iter().filter(|o| o.is_ok()).count();
    assert_eq!(accepted, 2, "{outcomes:?}");
    assert!(outcomes
        .iter()
        .all(|o| matches!(o, Ok(()) | Err(Status::NoComm))));
    s.next_reply(&g, LONG).await.unwrap();
    s.next_reply(&g, LONG).await.unwrap();
    assert_eq!(
        s.next_reply(&g, SHORT).await.unwrap_err().status,
        Status::NoComm
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_returns_the_first_reply() {
    let c = GroupCluster::start(3, 203).await;
    let g = gid("se:request");
    c.g(1).create(&g, "").await.unwrap();
    let mut tasks = Vec::new();
    for n in [2, 3] {
        let m = c.g(n).join(&g, "").await.unwrap();
        let g = g.clone();
        tasks.push(tokio::spawn(async move {
            let mut statuses = Vec::new();
            for _ in 0..2 {
                match m.recv(&g, None).await {
                    Ok(mut i) => {
                        let x: u32 = i.decode().unwrap();
                        statuses.push(i.reply(Payload::local(x * 10)).await.map_err(|f| f.status));
                    }
                    Err(f) => statuses.push(Err(f.status)),
                }
            }
            statuses
        }));
    }
    let s = c.g(1).sender();
    let r = s.request(&g, Payload::local(4u32), LONG).await.unwrap();
    assert_eq!(r.decode::<u32>().unwrap(), 40);
    let r = s.request(&g, Payload::local(5u32), LONG).await.unwrap();
    assert_eq!(r.decode::<u32>().unwrap(), 50);
    for t in tasks {
        for st in t.await.unwrap() {
            assert!(matches!(st, Ok(()) | Err(Status::NoComm)), "{st:?}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn members_select_by_group_and_tag_blocking_or_not() {
    let c = GroupCluster::start(2, 204).await;
    let (ga, gb) = (gid("se:a"), gid("se:b"));
    c.g(1).create(&ga, "pa").await.unwrap();
    c.g(1).create(&gb, "pb").await.unwrap();
    let m = c.g(2).join(&ga, "pa").await.unwrap();
    m.join(&gb, "pb").await.unwrap();
    assert_eq!(m.groups(), vec![ga.clone(), gb.clone()]);
    assert!(
        m.try_recv_any(None).unwrap().is_none(),
        "nrecany on an empty queue"
    );
    let s = c.g(1).sender();
    s.send_tagged(&ga, Tag(7), Payload::local("a7".to_string()))
        .await
        .unwrap();
    s.send_tagged(&gb, Tag(8), Payload::local("b8".to_string()))
        .await
        .unwrap();
    wait_for("both queued", LONG, || m.pending() == 2).await;
    assert!(
        m.try_recv(&ga, Some(Tag(8))).unwrap().is_none(),
        "tag 8 is not in group a"
    );
    let mut b = m.try_recv(&gb, None).unwrap().expect("nrec from group b");
    assert_eq!(b.decode::<String>().unwrap(), "b8");
    let mut a = m.recv_any(Some(Tag(7))).await.unwrap();
    assert_eq!(a.decode::<String>().unwrap(), "a7");
    assert_eq!(a.tag(), Tag(7));
    assert_eq!(a.sender(), s.id());
    // A blocked receive wakes when a message arrives.
    let ga2 = ga.clone();
    let waiting = tokio::spawn(async move {
        let r = m
            .recv(&ga2, None)
            .await
            .map(|mut i| i.decode::<String>().unwrap());
        (m, r)
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    s.send(&ga, Payload::local("later".to_string()))
        .await
        .unwrap();
    let (m, got) = waiting.await.unwrap();
    assert_eq!(got.unwrap(), "later");
    // Leaving one group keeps the other.
    m.leave(&ga, "pa").await.unwrap();
    assert_eq!(m.groups(), vec![gb.clone()]);
    assert_eq!(
        s.send(&ga, Payload::empty()).await.unwrap_err().status,
        Status::NoMembers
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn destroy_removes_every_member() {
    let c = GroupCluster::start(3, 205).await;
    let g = gid("se:destroy");
    c.g(1).create(&g, "pw").await.unwrap();
    let m2 = c.g(2).join(&g, "pw").await.unwrap();
    let m3 = c.g(3).join(&g, "pw").await.unwrap();
    let s = c.g(1).sender();
    assert_eq!(s.send(&g, Payload::local(1u8)).await.unwrap(), 2);
    let (took, taken) = tokio::sync::oneshot::channel();
    let g3 = g.clone();
    let waiting = tokio::spawn(async move {
        let first = m3.recv(&g3, None).await;
        let _ = took.send(first);
        // Blocks until the group is destroyed.
        let f = m3.recv(&g3, None).await.unwrap_err();
        (m3, f)
    });
    let held = taken.await.unwrap().expect("m3 received its copy");
    c.g(2).destroy(&g, "pw").await.unwrap();
    let (m3, f) = tokio::time::timeout(LONG, waiting)
        .await
        .expect("the blocked receive ends")
        .unwrap();
    assert_eq!(f.status, Status::NoSuchGroup, "{f}");
    assert!(m2.groups().is_empty() && m3.groups().is_empty());
    // A message received before the destroy may still be answered.
    held.reply(Payload::local(2u8)).await.unwrap();
    // m2 never received its copy: the sender hears it will not reply.
    let f = s.next_reply(&g, LONG).await;
    let r = s.next_reply(&g, LONG).await;
    let (f, r) = match (f, r) {
        (Err(f), Ok(r)) | (Ok(r), Err(f)) => (f, r),
        other => panic!("expected one failure and one reply: {other:?}"),
    };
    assert_eq!(f.status, Status::NoSuchGroup, "{f}");
    assert_eq!(r.from, m3.id());
    assert_eq!(
        s.next_reply(&g, SHORT).await.unwrap_err().status,
        Status::NoComm
    );
    assert_eq!(
        c.g(1).lookup(&g).await.unwrap_err().status,
        Status::NoSuchGroup
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn joining_where_the_group_already_lives_needs_no_directory() {
    let c = GroupCluster::start(3, 206).await;
    let g = gid("se:local");
    c.g(1).create(&g, "").await.unwrap();
    let _first = c.g(3).join(&g, "").await.unwrap();
    // With the directory (node 1) unreachable from node 3, a second member
    // at node 3 still joins (node 3 already hosts the group), and sends
    // from node 2 still reach both from its cached table.
    c.cluster.plan.partition(&[NodeId(1)], &[NodeId(3)]);
    let second = c
        .g(3)
        .join(&g, "")
        .await
        .expect("local join without the directory");
    let s = c.g(2).sender();
    assert_eq!(s.send(&g, Payload::local(1u8)).await.unwrap(), 2);
    second.recv(&g, None).await.unwrap();
    c.cluster.plan.heal();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_group_service_serves_clients_without_secrets_on_the_wire() {
    let c = GroupCluster::start_with(
        2,
        207,
        |_| test_config(),
        |_, b| b.listen("127.0.0.1:0".parse().unwrap()),
    )
    .await;
    let addr = c.node(2).addr().expect("node 2 listens");
    let client = GroupClient::connect(addr, b"test-cluster", LONG)
        .await
        .unwrap();
    let g = gid("se:cli");
    client.create(&g, "s3cret").await.unwrap();
    assert_eq!(
        client.destroy(&g, "nope").await.unwrap_err().status,
        Status::WrongSecret
    );
    let listening = client.listen(&g, "s3cret").await.unwrap();
    assert_eq!(listening.member().node, NodeId(2));
    let list = client.list(false).await.unwrap();
    assert!(
        list.iter()
            .any(|i| i.gid == g && i.hosts == vec![NodeId(2)]),
        "{list:?}"
    );
    // A program at node 1 sends; the client's member replies.
    let s = c.g(1).sender();
    assert_eq!(
        s.send(&g, Payload::bytes(b"ping".to_vec())).await.unwrap(),
        1
    );
    let msg = listening.next(LONG).await.unwrap().expect("a message");
    assert_eq!(msg.body, b"ping");
    listening.reply(msg.id, b"pong".to_vec()).await.unwrap();
    let r = s.next_reply(&g, LONG).await.unwrap();
    assert_eq!(r.payload.into_bytes().unwrap().as_ref(), b"pong");
    // The client sends; a program member at node 1 answers.
    let m = c.g(1).join(&g, "s3cret").await.unwrap();
    let answer = tokio::spawn(async move {
        let mut i = m.recv(&gid("se:cli"), None).await.unwrap();
        let body = i.take_payload().unwrap().into_bytes().unwrap();
        i.reply(Payload::bytes([b"re: ".as_slice(), &body].concat()))
            .await
            .unwrap();
        m
    });
    let report = client
        .send(&g, 0, b"hello".to_vec(), Some(1), LONG)
        .await
        .unwrap();
    assert_eq!(report.delivered, 2, "{report:?}");
    assert_eq!(report.status, Status::Ok, "{report:?}");
    assert_eq!(report.replies.len(), 1);
    assert_eq!(report.replies[0].body, b"re: hello");
    let _m = answer.await.unwrap();
    let none = client
        .send(&gid("se:missing"), 0, vec![], None, SHORT)
        .await
        .unwrap();
    assert_eq!(none.status, Status::NoSuchGroup);
    listening.close().await.unwrap();
    client.destroy(&g, "s3cret").await.unwrap();
    client.close().await;
}
