//! SMA end to end: a weft node serves an unmodified TCP peer (a plain tokio
//! `TcpStream`) through a `TxStream`; transactions abort and restart at
//! random (seeded) and the peer must see exactly the committed responses.

use std::sync::Arc;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use weft::Node;
use weft_net::sma::TxStream;
use weft_net::{ConnState, LoggerConfig};
use weft_wire::Status;

fn response(i: u32, len: usize) -> Vec<u8> {
    let mut v = format!("resp {i} ").into_bytes();
    v.resize(len, b'a' + (i % 26) as u8);
    v.push(b'\n');
    v
}

async fn pair(cfg: LoggerConfig) -> (Node, Arc<TxStream>, TcpStream) {
    let node = Node::builder(1).start().await.expect("node starts");
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let peer = TcpStream::connect(l.local_addr().unwrap()).await.unwrap();
    let (srv, _) = l.accept().await.unwrap();
    let s = Arc::new(TxStream::new(srv, node.tm().clone(), cfg));
    (node, s, peer)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_peer_sees_exactly_the_committed_responses_and_restarts_read_the_same_request() {
    let seed: u64 = std::env::var("WEFT_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x5eed_0019);
    println!("seed {seed} (WEFT_TEST_SEED to replay)");
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let (node, s, peer) = pair(LoggerConfig::default()).await;
    const N: u32 = 30;
    let aborts: Vec<bool> = (0..N).map(|_| rng.gen_bool(0.5)).collect();
    let lens: Vec<usize> = (0..N).map(|_| rng.gen_range(10..5000)).collect();

    // The unmodified peer: sends all its requests at once (they arrive
    // before the server's TX_STARTs), then reads the responses.
    let expected: Vec<u8> = (0..N).flat_map(|i| response(i, lens[i as usize])).collect();
    let peer_task = tokio::spawn(async move {
        let (rd, mut wr) = peer.into_split();
        for i in 0..N {
            wr.write_all(format!("req {i}\n").as_bytes()).await.unwrap();
        }
        let mut got = Vec::new();
        let mut rd = BufReader::new(rd);
        rd.read_to_end(&mut got).await.unwrap();
        got
    });

    for i in 0..N {
        let tx = node.begin();
        s.start(tx.tid()).unwrap();
        let mut req = vec![0u8; format!("req {i}\n").len()];
        s.read_exact(&mut req).await.unwrap();
        assert_eq!(req, format!("req {i}\n").as_bytes());
        let tx = if aborts[i as usize] {
            // Half the response, then the abort: none of it reaches the peer.
            s.write_all(b"ABORTED-ATTEMPT ").await.unwrap();
            assert_eq!(s.state(), ConnState::InTrans);
            tx.abort("test abort").await.unwrap();
            let again = node.begin();
            s.restart(again.tid()).unwrap();
            let mut req2 = vec![0u8; req.len()];
            s.read_exact(&mut req2).await.unwrap();
            assert_eq!(req2, req, "a restarted transaction reads the same request");
            again
        } else {
            tx
        };
        s.write_all(&response(i, lens[i as usize])).await.unwrap();
        assert_eq!(s.stats().released_bytes as usize, expected_upto(&lens, i));
        tx.commit().await.unwrap();
    }
    s.shutdown().await;
    let got = peer_task.await.unwrap();
    assert!(
        !got.windows(7).any(|w| w == b"ABORTED"),
        "seed {seed}: bytes of an aborted attempt reached the peer"
    );
    assert_eq!(got, expected, "seed {seed}");
    let st = s.stats();
    let n_aborts = aborts.iter().filter(|a| **a).count() as u64;
    assert_eq!(
        (st.committed, st.aborted, st.restarted),
        (N as u64, n_aborts, n_aborts)
    );
    node.shutdown().await;
}

fn expected_upto(lens: &[usize], i: u32) -> usize {
    (0..i).map(|j| response(j, lens[j as usize]).len()).sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_past_the_hold_limit_fails_with_no_buffer_and_the_rest_commits() {
    let cfg = LoggerConfig {
        max_hold: 100,
        ..LoggerConfig::default()
    };
    let (node, s, mut peer) = pair(cfg).await;
    let tx = node.begin();
    s.start(tx.tid()).unwrap();
    s.write_all(&[b'x'; 60]).await.unwrap();
    let e = s.write_all(&[b'y'; 60]).await.unwrap_err();
    assert_eq!(e.status, Status::NoBuffer, "{e}");
    s.write_all(&[b'z'; 40]).await.unwrap();
    tx.commit().await.unwrap();
    s.shutdown().await;
    let mut got = Vec::new();
    peer.read_to_end(&mut got).await.unwrap();
    let mut want = vec![b'x'; 60];
    want.extend([b'z'; 40]);
    assert_eq!(got, want);
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn output_outside_a_transaction_passes_and_an_aborted_one_is_dropped() {
    let (node, s, peer) = pair(LoggerConfig::default()).await;
    s.write_all(b"hello\n").await.unwrap();
    let mut rd = BufReader::new(peer);
    let mut line = String::new();
    rd.read_line(&mut line).await.unwrap();
    assert_eq!(line, "hello\n");
    {
        let tx = node.begin();
        s.start(tx.tid()).unwrap();
        s.write_all(b"never\n").await.unwrap();
        tx.abort("changed its mind").await.unwrap();
    }
    let tx = node.begin();
    s.restart(tx.tid()).unwrap();
    s.write_all(b"bye\n").await.unwrap();
    tx.commit().await.unwrap();
    s.shutdown().await;
    let mut rest = String::new();
    rd.read_to_string(&mut rest).await.unwrap();
    assert_eq!(rest, "bye\n");
    node.shutdown().await;
}

/// A resource with a durable effect: it votes `Yes { durable: true }`, as the
/// KV store does.
struct DurableEffect;

impl weft::Resource for DurableEffect {
    fn name(&self) -> &str {
        "durable-effect"
    }

    fn class(&self) -> weft_tx::ParticipationClass {
        weft_tx::ParticipationClass::TwoPhase
    }

    fn prepare<'a>(
        &'a self,
        _tid: weft_wire::Tid,
        _log: &'a weft::Log,
    ) -> futures::future::BoxFuture<'a, weft::Vote> {
        Box::pin(async { weft::Vote::Yes { durable: true } })
    }
}

/// A node that stops every transaction once its commit record is forced
/// (the crash point `coordinator-after-commit-force`), a stream on it, its
/// peer, and the stream's released bytes reported at that point.
async fn stopping_after_the_commit_force(
    dir: &std::path::Path,
) -> (
    Node,
    Arc<TxStream>,
    TcpStream,
    tokio::sync::mpsc::UnboundedReceiver<u64>,
) {
    let slot: Arc<std::sync::OnceLock<Arc<TxStream>>> = Arc::default();
    let (seen_tx, seen) = tokio::sync::mpsc::unbounded_channel();
    let hook_slot = Arc::clone(&slot);
    let hook: weft_tx::CrashHook = Arc::new(move |_, _| {
        let released = hook_slot.get().map_or(0, |s| s.stats().released_bytes);
        let _ = seen_tx.send(released);
    });
    let node = Node::builder(1)
        .data_dir(dir)
        .tm_config(weft::TmConfig {
            crash_at: Some((weft_tx::CrashPoint::CoordinatorAfterCommitForce, hook)),
            ..weft::TmConfig::default()
        })
        .start()
        .await
        .expect("node starts");
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let peer = TcpStream::connect(l.local_addr().unwrap()).await.unwrap();
    let (srv, _) = l.accept().await.unwrap();
    let s = Arc::new(TxStream::new(
        srv,
        node.tm().clone(),
        LoggerConfig::default(),
    ));
    assert!(slot.set(Arc::clone(&s)).is_ok());
    (node, s, peer, seen)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_durable_effect_nothing_leaves_before_the_commit_record_is_forced() {
    let dir = tempfile::tempdir().unwrap();
    let (node, s, peer, mut seen) = stopping_after_the_commit_force(dir.path()).await;
    let tx = node.begin();
    s.start(tx.tid()).unwrap();
    node.tm()
        .enlist(tx.tid(), Arc::new(DurableEffect))
        .expect("enlists");
    s.write_all(b"held until the decision is durable")
        .await
        .unwrap();
    // The transaction stops right after its commit record is forced: the
    // resources have not committed, so nothing may have left.
    let commit = tokio::spawn(tx.commit());
    let released = seen.recv().await.expect("the commit record was forced");
    assert_eq!(released, 0, "output left before the decision was durable");
    assert_eq!(s.stats().released_bytes, 0);
    assert_eq!(s.state(), ConnState::Commit);
    commit.abort();
    // The stopped transaction keeps the node from shutting down cleanly:
    // it is dropped with the test (a crash, as the crash point means).
    drop((s, peer, node));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn output_alone_commits_without_forcing_a_record() {
    let dir = tempfile::tempdir().unwrap();
    let (node, s, peer, mut seen) = stopping_after_the_commit_force(dir.path()).await;
    let tx = node.begin();
    s.start(tx.tid()).unwrap();
    s.write_all(b"nothing durable to wait for\n").await.unwrap();
    // With no durable effect there is no commit record to force: the crash
    // point after the force is never reached and the commit completes.
    tokio::select! {
        r = tx.commit() => r.unwrap(),
        _ = seen.recv() => panic!("a commit record was forced"),
    }
    let mut rd = BufReader::new(peer);
    let mut line = String::new();
    rd.read_line(&mut line).await.unwrap();
    assert_eq!(line, "nothing durable to wait for\n");
    node.shutdown().await;
}
