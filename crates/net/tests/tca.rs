//! 2CA end to end in one process: a proxy node and a server node (joined
//! over TCP), an unmodified peer (a plain tokio `TcpStream`) connected to the
//! proxy. Transactions abort and restart at random (seeded); the peer must
//! see exactly the committed responses, in order.

use std::net::SocketAddr;
use std::sync::Arc;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use weft::{Node, NodeId, Seed};
use weft_net::tca::proxy::{NetProxy, ProxyConfig};
use weft_net::tca::server::ProxiedStream;
use weft_net::{ConnState, LoggerConfig};
use weft_wire::Status;

struct Setup {
    proxy_node: Node,
    proxy: NetProxy,
    server: Node,
    stream: Arc<ProxiedStream>,
    peer: TcpStream,
}

async fn setup(cfg: LoggerConfig) -> Setup {
    let upstream = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let mut pc = ProxyConfig::new(
        "127.0.0.1:0".parse().unwrap(),
        upstream.local_addr().unwrap(),
    );
    pc.logger = cfg;
    let proxy = NetProxy::new(pc);
    let local: SocketAddr = "127.0.0.1:0".parse().unwrap();
    let proxy_node = Node::builder(1)
        .listen(local)
        .plugin(Arc::new(proxy.clone()))
        .start()
        .await
        .expect("proxy node starts");
    let server = Node::builder(2)
        .listen(local)
        .join(Seed::Tcp(proxy_node.addr().unwrap()))
        .start()
        .await
        .expect("server node starts");
    let peer = TcpStream::connect(proxy.listen_addr().unwrap())
        .await
        .unwrap();
    let (up, _) = upstream.accept().await.unwrap();
    let stream = Arc::new(ProxiedStream::new(up, server.rpc().clone(), NodeId(1), cfg).unwrap());
    Setup {
        proxy_node,
        proxy,
        server,
        stream,
        peer,
    }
}

fn response(i: u32, len: usize) -> Vec<u8> {
    let mut v = format!("resp {i} ").into_bytes();
    v.resize(len, b'a' + (i % 26) as u8);
    v.push(b'\n');
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_peer_sees_exactly_the_committed_responses_through_the_proxy() {
    let seed: u64 = std::env::var("WEFT_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x2ca_0019);
    println!("seed {seed} (WEFT_TEST_SEED to replay)");
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let Setup {
        proxy_node,
        proxy,
        server,
        stream: s,
        peer,
    } = setup(LoggerConfig::default()).await;
    const N: u32 = 20;
    let aborts: Vec<bool> = (0..N).map(|_| rng.gen_bool(0.5)).collect();
    let lens: Vec<usize> = (0..N).map(|_| rng.gen_range(10..100_000)).collect();
    let expected: Vec<u8> = (0..N).flat_map(|i| response(i, lens[i as usize])).collect();
    let want = expected.len();
    let peer_task = tokio::spawn(async move {
        let (mut rd, mut wr) = peer.into_split();
        for i in 0..N {
            wr.write_all(format!("req {i}\n").as_bytes()).await.unwrap();
        }
        let mut got = vec![0u8; want];
        rd.read_exact(&mut got).await.unwrap();
        (got, rd, wr)
    });
    for i in 0..N {
        let tx = server.begin();
        s.start(&tx).await.unwrap();
        let mut req = vec![0u8; format!("req {i}\n").len()];
        s.read_exact(&mut req).await.unwrap();
        assert_eq!(req, format!("req {i}\n").as_bytes());
        let tx = if aborts[i as usize] {
            s.write_all(b"ABORTED-ATTEMPT ").await.unwrap();
            s.write_all(&vec![b'!'; lens[i as usize] / 2])
                .await
                .unwrap();
            s.abort(tx, "test abort").await.unwrap();
            let again = server.begin();
            s.restart(&again).await.unwrap();
            let mut req2 = vec![0u8; req.len()];
            s.read_exact(&mut req2).await.unwrap();
            assert_eq!(req2, req, "seed {seed}: a restart reads the same request");
            again
        } else {
            tx
        };
        s.write_all(&response(i, lens[i as usize])).await.unwrap();
        s.commit(tx).await.unwrap();
    }
    let (got, mut rd, _wr) = peer_task.await.unwrap();
    assert!(
        !got.windows(7).any(|w| w == b"ABORTED" || w == b"!!!!!!!"),
        "seed {seed}: bytes of an aborted attempt reached the peer"
    );
    assert!(got == expected, "seed {seed}: the peer's bytes differ");
    let n_aborts = aborts.iter().filter(|a| **a).count() as u64;
    let conns = proxy.list();
    assert_eq!(conns.len(), 1);
    let st = &conns[0].stats;
    assert_eq!(
        (st.committed, st.aborted, st.restarted),
        (N as u64, n_aborts, n_aborts),
        "seed {seed}"
    );
    assert_eq!(conns[0].state, ConnState::PreTrans);
    // The server closes: the peer reads the end of the stream, nothing more.
    s.shutdown().await;
    let mut rest = Vec::new();
    rd.read_to_end(&mut rest).await.unwrap();
    assert!(
        rest.is_empty(),
        "seed {seed}: {} bytes after the last commit",
        rest.len()
    );
    server.shutdown().await;
    proxy_node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_past_the_limit_fails_with_no_buffer_at_the_server_and_nothing_is_sent() {
    let cfg = LoggerConfig {
        max_hold: 100,
        ..LoggerConfig::default()
    };
    let Setup {
        proxy_node,
        proxy: _proxy,
        server,
        stream: s,
        mut peer,
    } = setup(cfg).await;
    let tx = server.begin();
    s.start(&tx).await.unwrap();
    s.write_all(&[b'x'; 60]).await.unwrap();
    let e = s.write_all(&[b'y'; 60]).await.unwrap_err();
    assert_eq!(e.status, Status::NoBuffer, "{e}");
    s.write_all(&[b'z'; 40]).await.unwrap();
    s.commit(tx).await.unwrap();
    s.shutdown().await;
    let mut got = Vec::new();
    peer.read_to_end(&mut got).await.unwrap();
    let mut want = vec![b'x'; 60];
    want.extend([b'z'; 40]);
    assert_eq!(got, want);
    server.shutdown().await;
    proxy_node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abort_then_output_outside_a_transaction_resynchronises() {
    let Setup {
        proxy_node,
        proxy: _proxy,
        server,
        stream: s,
        mut peer,
    } = setup(LoggerConfig::default()).await;
    let tx = server.begin();
    s.start(&tx).await.unwrap();
    s.write_all(b"never").await.unwrap();
    s.abort(tx, "test").await.unwrap();
    s.write_all(b"plain").await.unwrap();
    s.shutdown().await;
    let mut got = Vec::new();
    peer.read_to_end(&mut got).await.unwrap();
    assert_eq!(got, b"plain");
    server.shutdown().await;
    proxy_node.shutdown().await;
}
