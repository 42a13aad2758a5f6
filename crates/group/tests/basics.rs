//! The basic round trip on bare endpoints (no whole nodes): create, join
//! at two nodes, send from a third, receive, reply, collect.

mod common;

use std::time::Duration;

use common::*;
use weft_wire::{Payload, Status};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn send_receive_reply_across_nodes() {
    let c = Cluster::start(3, 1).await;
    let g = gid("test:smoke");
    c.g(2).create(&g, "pw").await.expect("create");
    let m1 = c.g(1).join(&g, "pw").await.expect("join 1");
    let m3 = c.g(3).join(&g, "pw").await.expect("join 3");
    let s = c.g(2).sender();
    let n = s
        .send(&g, Payload::local("hi".to_string()))
        .await
        .expect("send");
    assert_eq!(n, 2);
    for m in [&m1, &m3] {
        let mut i = m.recv(&g, None).await.unwrap();
        let text: String = i.decode().unwrap();
        assert_eq!(text, "hi");
        i.reply(Payload::local(format!("from {}", m.id())))
            .await
            .unwrap();
    }
    let r1 = s.next_reply(&g, Duration::from_secs(1)).await.unwrap();
    let r2 = s.next_reply(&g, Duration::from_secs(1)).await.unwrap();
    assert_ne!(r1.from, r2.from);
    let end = s.next_reply(&g, Duration::from_secs(1)).await.unwrap_err();
    assert_eq!(end.status, Status::NoComm);
}
