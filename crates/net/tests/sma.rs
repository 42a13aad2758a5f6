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
