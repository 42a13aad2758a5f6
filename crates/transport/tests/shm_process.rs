//! The shared-memory channel between real processes: this test process runs
//! node 1; helper processes (`weft-shm-peer`) run the other nodes or play a
//! hostile peer. Calls in both directions with many in flight, large
//! messages, a peer killed mid-call, garbage in the ring, resolution and
//! clean-up of rendezvous files.

mod shm_common;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use shm_common::*;
use weft_transport::*;
use weft_wire::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_cross_in_both_directions_with_many_in_flight() {
    let a = start(cfg(1)).await;
    let mut b = Peer::node(2, a.listen_addr().unwrap(), &[]);
    // Node 2 joined over TCP; node 1 (the lower id) upgrades the link.
    wait_route(&a, 2, ChannelKind::Shm).await;
    let line = b
        .ask("wait-route 1 shm 10000", "ROUTE", Duration::from_secs(15))
        .await;
    assert_eq!(line, "ROUTE 1 shm");
    // Both directions at once, 64 calls in flight each way.
    b.send("call 1 echo 3000 64 100");
    let done = echo_many(&a, 2, 3000, 64, 100).await;
    assert_eq!(done, 3000);
    let line = tokio::task::block_in_place(|| b.expect("CALLS", Duration::from_secs(60)));
    assert_eq!(line, "CALLS ok=3000 failed=0 status=-");
    assert_eq!(route(&a, 2), Some(ChannelKind::Shm), "still on shm");
    b.quit();
    a.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_messages_cross_small_rings_both_ways() {
    let mut c = cfg(1);
    // Node 1 opens the segment and picks its size: rings far smaller than
    // the messages, which stream through in pieces.
    c.shm.ring_bytes = 16 * 1024;
    let a = start(c).await;
    let mut b = Peer::node(2, a.listen_addr().unwrap(), &[]);
    wait_route(&a, 2, ChannelKind::Shm).await;
    b.send("call 1 echo 6 3 3000000");
    // 3 MB is three times the largest frame: fragmented, then streamed.
    assert_eq!(echo_many(&a, 2, 6, 3, 3_000_000).await, 6);
    assert_eq!(echo_many(&a, 2, 200, 16, 20_000).await, 200);
    let line = tokio::task::block_in_place(|| b.expect("CALLS", Duration::from_secs(60)));
    assert_eq!(line, "CALLS ok=6 failed=0 status=-");
    assert_eq!(route(&a, 2), Some(ChannelKind::Shm));
    b.quit();
    a.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_killed_mid_call_fails_the_call_with_proc_dead() {
    let a = start(cfg(1)).await;
    let mut b = Peer::node(2, a.listen_addr().unwrap(), &[]);
    wait_route(&a, 2, ChannelKind::Shm).await;
    assert_eq!(echo_many(&a, 2, 10, 4, 10).await, 10);
    let hang = Request {
        service: ServiceName::new("hang").unwrap(),
        ..echo_request(2, vec![1, 2, 3])
    };
    let ep = a.clone();
    let call = tokio::spawn(async move {
        let deadline = Instant::now() + Duration::from_secs(60);
        ep.call(NodeId(2), hang, Some(deadline)).await
    });
    let deadline = Instant::now() + Duration::from_secs(10);
    while a.pending_calls() == 0 {
        assert!(Instant::now() < deadline, "the call never went out");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    tokio::time::sleep(Duration::from_millis(20)).await; // in the peer's hands
    let killed = Instant::now();
    b.kill();
    let outcome = tokio::time::timeout(Duration::from_secs(10), call)
        .await
        .expect("the call ends (no hang)")
        .unwrap();
    let noticed = killed.elapsed();
    let failure = outcome.expect_err("a dead peer cannot answer");
    assert_eq!(failure.status, Status::ProcDead, "{failure}");
    assert!(
        noticed < Duration::from_secs(5),
        "death noticed after {noticed:?}, far sooner than the detector's 20 s"
    );
    // The node is declared dead too: new calls fail at once.
    let deadline = Instant::now() + Duration::from_secs(10);
    while a.peer_status(NodeId(2)) != Some(Status::ProcDead) {
        assert!(
            Instant::now() < deadline,
            "node 2 never declared dead: {:?}",
            a.view()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let again = a
        .call(
            NodeId(2),
            echo_request(2, vec![]),
            Some(Instant::now() + Duration::from_secs(30)),
        )
        .await
        .expect_err("dead");
    assert_eq!(again.status, Status::ProcDead);
    a.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_from_a_hostile_peer_closes_only_its_link() {
    let a = start(cfg(1)).await;
    let rendezvous = a.info().shm.expect("node 1 listens for shm links");
    let attack = |name: &str| {
        Peer::spawn(
            "hostile",
            &[
                "--connect".into(),
                rendezvous.clone(),
                "--attack".into(),
                name.into(),
            ],
        )
    };
    // Segments that must be refused before any link exists.
    for (name, outcome) in [
        ("unsealed", "HOSTILE refused"),
        ("bad-header", "HOSTILE refused"),
    ] {
        let mut h = attack(name);
        let line = tokio::task::block_in_place(|| h.expect("HOSTILE", Duration::from_secs(10)));
        assert_eq!(line, outcome, "{name}");
    }
    // The size is sealed: shrinking it under us is impossible.
    let mut h = attack("truncate");
    let line = tokio::task::block_in_place(|| h.expect("HOSTILE", Duration::from_secs(10)));
    assert!(line.starts_with("HOSTILE truncate refused"), "{line}");
    drop(h);
    // Random words over the whole segment, control words included: the
    // link closes or stays silent, depending on what was hit; either way
    // node 1 lives on (checked at the end).
    let mut h = attack("scribble");
    tokio::task::block_in_place(|| h.expect("HOSTILE", Duration::from_secs(10)));
    assert_eq!(
        echo_many(&a, 1, 10, 2, 10).await,
        10,
        "node 1 still answers"
    );
    drop(h);
    // Garbage in the ring: a protocol error on that link, nothing else.
    for name in ["garbage", "bad-record"] {
        let before = a.refusals().len();
        let mut h = attack(name);
        tokio::task::block_in_place(|| h.expect("HOSTILE", Duration::from_secs(10)));
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let refusals = a.refusals();
            if refusals.len() > before {
                let last = refusals.last().unwrap();
                assert!(last.starts_with("ProtocolError on shm"), "{name}: {last}");
                break;
            }
            assert!(
                Instant::now() < deadline,
                "{name}: no protocol error recorded"
            );
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }
    // Node 1 is unharmed: a real peer still gets a working shm link.
    let mut b = Peer::node(2, a.listen_addr().unwrap(), &[]);
    wait_route(&a, 2, ChannelKind::Shm).await;
    assert_eq!(echo_many(&a, 2, 100, 8, 64).await, 100);
    b.quit();
    a.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resolution_picks_shm_on_one_host_and_tcp_when_disabled() {
    let a = start(cfg(1)).await;
    let seed = a.listen_addr().unwrap();
    let mut b = Peer::node(2, seed, &[]);
    let mut c = Peer::node(3, seed, &[]);
    // Nodes 2 and 3 have no link yet: the first call resolves to shm.
    let line = b
        .ask("wait-member 3 10000", "MEMBER", Duration::from_secs(15))
        .await;
    assert_eq!(line, "MEMBER 3 yes");
    let line = b
        .ask("call 3 echo 50 8 64", "CALLS", Duration::from_secs(30))
        .await;
    assert_eq!(line, "CALLS ok=50 failed=0 status=-");
    assert_eq!(
        b.ask("route 3", "ROUTE", Duration::from_secs(5)).await,
        "ROUTE 3 shm"
    );
    assert_eq!(
        c.ask("route 2", "ROUTE", Duration::from_secs(5)).await,
        "ROUTE 2 shm"
    );
    // A node with shm disabled by configuration is reached over TCP, both
    // ways, even from a node that has shm.
    let mut d = Peer::node(4, seed, &["--no-shm"]);
    let line = b
        .ask("wait-member 4 10000", "MEMBER", Duration::from_secs(15))
        .await;
    assert_eq!(line, "MEMBER 4 yes");
    assert_eq!(echo_many(&a, 4, 20, 4, 64).await, 20);
    let line = b
        .ask("call 4 echo 20 4 64", "CALLS", Duration::from_secs(30))
        .await;
    assert_eq!(line, "CALLS ok=20 failed=0 status=-");
    assert_eq!(
        b.ask("route 4", "ROUTE", Duration::from_secs(5)).await,
        "ROUTE 4 tcp"
    );
    assert_eq!(
        d.ask("route 1", "ROUTE", Duration::from_secs(5)).await,
        "ROUTE 1 tcp"
    );
    assert_eq!(route(&a, 4), Some(ChannelKind::Tcp));
    wait_route(&a, 2, ChannelKind::Shm).await;
    // And a node that disables shm itself talks TCP to everyone.
    let mut no_shm = cfg(5);
    no_shm.channels.shm = false;
    let e = start(no_shm).await;
    assert!(e.info().shm.is_none(), "no rendezvous announced");
    e.join(Seed::Tcp(seed)).await.unwrap();
    assert_eq!(echo_many(&e, 2, 20, 4, 64).await, 20);
    assert_eq!(route(&e, 2), Some(ChannelKind::Tcp));
    for p in [&mut b, &mut c, &mut d] {
        p.quit();
    }
    e.shutdown().await;
    a.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rendezvous_files_are_removed_on_shutdown_and_stale_ones_at_start() {
    let a = start(cfg(1)).await;
    let own = PathBuf::from(a.info().shm.unwrap());
    assert!(own.exists());
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(
        std::fs::metadata(&own).unwrap().permissions().mode() & 0o777,
        0o600
    );
    // A clean stop removes the helper's file.
    let mut b = Peer::node(2, a.listen_addr().unwrap(), &[]);
    let b_file = b.rendezvous.clone().expect("helper announces shm");
    assert!(b_file.exists());
    b.quit();
    assert!(!b_file.exists(), "removed on shutdown");
    // A killed process leaves its file; the next process to start sweeps it.
    let mut c = Peer::node(3, a.listen_addr().unwrap(), &[]);
    let c_file = c.rendezvous.clone().unwrap();
    c.kill();
    assert!(c_file.exists(), "a SIGKILLed process cannot clean up");
    let mut d = Peer::node(4, a.listen_addr().unwrap(), &[]);
    assert!(!c_file.exists(), "swept by the next process at start");
    d.quit();
    a.shutdown().await;
    let deadline = Instant::now() + Duration::from_secs(5);
    while own.exists() {
        assert!(Instant::now() < deadline, "own rendezvous left behind");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}
