//! The `_group` service and the group API as a hostile authenticated client
//! uses them (issue 16): endless timeouts, sessions that do not exist,
//! wrong secrets over and over, joins past every limit. Each gets its
//! precise status and leaves nothing behind.

#[path = "group_support.rs"]
mod support;

use std::time::{Duration, Instant};

use support::*;
use weft::{Address, Failure, GroupId, Payload, Status};
use weft_group::config::GroupConfig;
use weft_group::secret::GroupKey;
use weft_group::service::{AdminReply, AdminRequest};

async fn admin(
    c: &GroupCluster,
    from: u32,
    to: u32,
    req: AdminRequest,
) -> Result<AdminReply, Failure> {
    let addr: Address = format!("_group@{to}").parse().unwrap();
    let payload = c
        .node(from)
        .rpc()
        .call_payload(
            None,
            &addr,
            Payload::local(req),
            Some(Instant::now() + Duration::from_secs(3)),
        )
        .await?;
    payload
        .decode::<AdminReply>()
        .map_err(|e| Failure::new(Status::Mismatch, e.to_string()))
}

async fn key(c: &GroupCluster, gid: &GroupId, secret: &str) -> GroupKey {
    match admin(c, 1, 2, AdminRequest::Verifier { gid: gid.clone() }).await {
        Ok(AdminReply::Verifier(v)) => v.key_for(secret.as_bytes()),
        other => panic!("verifier of {gid}: {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_endless_reply_wait_is_bounded_by_the_call_not_a_panic() {
    let c = GroupCluster::start(2, 1611).await;
    let g = gid("hostile:endless");
    c.g(1).create(&g, "").await.unwrap();
    let m = c.g(2).join(&g, "").await.unwrap();
    // Through `_group`: a timeout of u64::MAX ms, with a member that never
    // replies, ends at the call's deadline.
    let err = admin(
        &c,
        1,
        1,
        AdminRequest::Send {
            gid: g.clone(),
            tag: 0,
            body: vec![1],
            replies: None,
            timeout_ms: u64::MAX,
        },
    )
    .await
    .unwrap_err();
    assert_eq!(err.status, Status::TimedOut, "{err}");
    // Through the API: a wait of Duration::MAX returns the reply.
    let s = c.g(1).sender();
    assert_eq!(s.send(&g, Payload::local(2u8)).await.unwrap(), 1);
    let replier = tokio::spawn(async move {
        loop {
            // The message of the `_group` send above, whose communication
            // ended with its call, comes as NoComm.
            let mut i = match m.recv(&g, None).await {
                Err(f) if f.status == Status::NoComm => continue,
                got => got.unwrap(),
            };
            if i.decode::<u8>().unwrap() == 2 {
                i.reply(Payload::local(3u8)).await.unwrap();
                return m;
            }
        }
    });
    let r = s
        .next_reply(&gid("hostile:endless"), Duration::MAX)
        .await
        .unwrap();
    assert_eq!(r.payload.decode::<u8>().unwrap(), 3);
    let _m = replier.await.unwrap();
    let (s2, g2) = (c.g(1).sender(), gid("hostile:endless"));
    let r = s2.request(&g2, Payload::local(9u8), Duration::MAX);
    // Nobody answers 9: bounded only by the test's own patience.
    assert!(tokio::time::timeout(Duration::from_millis(200), r)
        .await
        .is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_that_do_not_exist_and_wrong_secrets_get_their_status() {
    let small = |_| GroupConfig {
        max_members: 4,
        ..test_config()
    };
    let c = GroupCluster::start_with(2, 1612, small, |_, b| b).await;
    let g = gid("hostile:secret");
    c.g(1).create(&g, "right").await.unwrap();
    for (req, want) in [
        (
            AdminRequest::Next {
                session: 77,
                wait_ms: u64::MAX,
            },
            Status::NoComm,
        ),
        (
            AdminRequest::Reply {
                session: 77,
                message: 1,
                body: vec![],
            },
            Status::NoComm,
        ),
        (
            AdminRequest::Verifier {
                gid: gid("hostile:nobody"),
            },
            Status::NoSuchGroup,
        ),
        (
            AdminRequest::Listen {
                gid: gid("hostile:nobody"),
                key: GroupKey([0; 32]),
            },
            Status::NoSuchGroup,
        ),
    ] {
        let err = admin(&c, 1, 2, req).await.unwrap_err();
        assert_eq!(err.status, want, "{err}");
    }
    // A wrong secret, many times over, takes no member for good: the node
    // hosts 4 at most, and the right secret still gets one after 50 tries.
    let wrong = key(&c, &g, "wrong").await;
    for _ in 0..50 {
        let err = admin(
            &c,
            1,
            2,
            AdminRequest::Listen {
                gid: g.clone(),
                key: wrong,
            },
        )
        .await
        .unwrap_err();
        assert_eq!(err.status, Status::WrongSecret, "{err}");
    }
    let right = key(&c, &g, "right").await;
    let session = match admin(
        &c,
        1,
        2,
        AdminRequest::Listen {
            gid: g.clone(),
            key: right,
        },
    )
    .await
    {
        Ok(AdminReply::Listening { session, .. }) => session,
        other => panic!("listen: {other:?}"),
    };
    let err = admin(
        &c,
        1,
        2,
        AdminRequest::Reply {
            session,
            message: 12345,
            body: vec![],
        },
    )
    .await
    .unwrap_err();
    assert_eq!(err.status, Status::Mismatch, "{err}");
    // Listening past the node's member limit: NoBuffer, not a new member.
    let mut statuses = Vec::new();
    for _ in 0..5 {
        statuses.push(
            match admin(
                &c,
                1,
                2,
                AdminRequest::Listen {
                    gid: g.clone(),
                    key: right,
                },
            )
            .await
            {
                Ok(_) => Status::Ok,
                Err(f) => f.status,
            },
        );
    }
    assert_eq!(
        statuses.iter().filter(|s| **s == Status::Ok).count(),
        3,
        "{statuses:?}"
    );
    assert_eq!(statuses.last(), Some(&Status::NoBuffer), "{statuses:?}");
    // Unlistening with a wrong key is refused and keeps the session.
    let err = admin(
        &c,
        1,
        2,
        AdminRequest::Unlisten {
            session,
            key: wrong,
        },
    )
    .await
    .unwrap_err();
    assert_eq!(err.status, Status::WrongSecret, "{err}");
    admin(
        &c,
        1,
        2,
        AdminRequest::Unlisten {
            session,
            key: right,
        },
    )
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn joining_again_and_creating_past_the_limits_are_bounded() {
    let small = |_| GroupConfig {
        max_groups: 5,
        max_groups_per_member: 3,
        ..test_config()
    };
    let c = GroupCluster::start_with(2, 1613, small, |_, b| b).await;
    let mut made = Vec::new();
    let mut last = Status::Ok;
    for i in 0..8 {
        let g = gid(&format!("hostile:g{i}"));
        match c.g(2).create(&g, "").await {
            Ok(()) => made.push(g),
            Err(f) => last = f.status,
        }
    }
    assert_eq!(made.len(), 5);
    assert_eq!(last, Status::NoBuffer);
    let m = c.g(2).member().unwrap();
    for _ in 0..100 {
        m.join(&made[0], "").await.unwrap();
    }
    assert_eq!(
        m.groups(),
        vec![made[0].clone()],
        "joining again joins once"
    );
    m.join(&made[1], "").await.unwrap();
    m.join(&made[2], "").await.unwrap();
    let err = m.join(&made[3], "").await.unwrap_err();
    assert_eq!(err.status, Status::NoBuffer, "{err}");
    assert_eq!(m.groups().len(), 3);
}
