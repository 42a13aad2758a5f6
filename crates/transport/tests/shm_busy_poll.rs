//! A busy-polling caller (`BusyPoll`) against a node in another process: it
//! drains the rings itself while it waits, and the reader threads take over
//! again when it stops. In its own test binary: a busy poller services every
//! channel of its process.

mod shm_common;

use std::time::{Duration, Instant};

use shm_common::*;
use weft_transport::*;
use weft_wire::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_poller_completes_calls_and_hands_the_rings_back() {
    let a = start(cfg(1)).await;
    let mut b = Peer::node(2, a.listen_addr().unwrap(), &[]);
    wait_route(&a, 2, ChannelKind::Shm).await;
    let ep = a.clone();
    let (one_by_one, in_flight) = tokio::task::spawn_blocking(move || {
        let mut bp = BusyPoll::new();
        let mut ok = 0;
        for i in 0..2000u32 {
            let body = i.to_le_bytes().to_vec();
            let deadline = Some(Instant::now() + Duration::from_secs(30));
            let r = bp
                .block_on(ep.call(NodeId(2), echo_request(2, body.clone()), deadline))
                .expect("call over shm");
            assert_eq!(r.payload.into_bytes().unwrap()[..], body[..]);
            ok += 1;
        }
        let many = bp.block_on(echo_many(&ep, 2, 3000, 64, 100));
        (ok, many)
    })
    .await
    .unwrap();
    assert_eq!((one_by_one, in_flight), (2000, 3000));
    assert_eq!(a.pending_calls(), 0);
    // No busy poller any more: the reader threads serve plain async calls.
    assert_eq!(echo_many(&a, 2, 500, 16, 64).await, 500);
    // The helper calls us meanwhile, served by our reader thread.
    let line = b
        .ask("call 1 echo 300 8 64", "CALLS", Duration::from_secs(30))
        .await;
    assert_eq!(line, "CALLS ok=300 failed=0 status=-");
    b.quit();
    a.shutdown().await;
}
