//! TCP links inside mutual TLS: a three-node cluster whose every link is
//! TLS, and the ends that must be refused — a plaintext peer, a peer whose
//! certificate another CA signed, a peer whose certificate expired, a TLS
//! peer of a plaintext node — each with a clear error, and nothing they
//! sent acted on.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use weft_transport::certs::{ClusterCa, Pem, Validity};
use weft_transport::*;
use weft_wire::*;

/// Counts every request it is handed, answers `echo` with its payload.
struct Counting(Arc<AtomicUsize>);

impl RequestHandler for Counting {
    fn handle(&self, _from: PeerRef, req: Request, responder: Responder) {
        self.0.fetch_add(1, Ordering::SeqCst);
        responder.respond(Response {
            call_id: 0,
            status: Status::Ok,
            detail: String::new(),
            tx: None,
            payload: req.payload,
        })
    }
}

fn tls_of(ca: &ClusterCa, pair: &Pem) -> TlsConfig {
    TlsConfig::from_pem(
        pair.cert.as_bytes(),
        pair.key.as_bytes(),
        ca.cert_pem().as_bytes(),
    )
    .expect("TLS settings load")
}

fn cfg(node: u32, tls: Option<TlsConfig>) -> TransportConfig {
    TransportConfig {
        listen: Some("127.0.0.1:0".parse().unwrap()),
        channels: ChannelSet {
            inproc: false,
            shm: false,
            tcp: true,
        },
        hub: Some(InprocHub::new()),
        tls,
        heartbeat_interval: Duration::from_millis(100),
        dead_after: Duration::from_secs(3),
        connect_timeout: Duration::from_secs(5),
        secret: b"cluster".to_vec(),
        ..TransportConfig::node(NodeId(node), Incarnation(1))
    }
}

async fn start(cfg: TransportConfig, handled: &Arc<AtomicUsize>) -> Endpoint {
    let ep = Endpoint::start(cfg).await.expect("endpoint starts");
    ep.set_request_handler(Arc::new(Counting(handled.clone())));
    ep
}

fn request(node: u32, text: &str) -> Request {
    Request {
        call_id: 0,
        service: ServiceName::new("echo").unwrap(),
        instance: 0,
        node: NodeId(node),
        budget_us: None,
        tx: None,
        flags: 0,
        payload: Payload::local(text.to_string()),
    }
}

fn deadline() -> Option<Instant> {
    Some(Instant::now() + Duration::from_secs(10))
}

/// A TLS cluster of three nodes, all links over TCP inside TLS.
struct Cluster {
    ca: ClusterCa,
    eps: Vec<Endpoint>,
    handled: Arc<AtomicUsize>,
}

async fn tls_cluster() -> Cluster {
    let ca = ClusterCa::generate(Validity::days(1)).unwrap();
    let handled = Arc::new(AtomicUsize::new(0));
    let mut eps = Vec::new();
    for n in 1..=3u32 {
        let pair = ca.issue_node(n, Validity::days(1)).unwrap();
        let ep = start(cfg(n, Some(tls_of(&ca, &pair))), &handled).await;
        if n > 1 {
            let seed = Seed::Tcp(
                eps.first()
                    .map(|e: &Endpoint| e.listen_addr().unwrap())
                    .unwrap(),
            );
            ep.join(seed).await.expect("a TLS node joins a TLS cluster");
        }
        eps.push(ep);
    }
    Cluster { ca, eps, handled }
}

/// Polls until every node sees `n` live members; panics after a bound.
async fn all_see(eps: &[Endpoint], n: usize) {
    let until = Instant::now() + Duration::from_secs(20);
    loop {
        if eps
            .iter()
            .all(|e| e.view().nodes.iter().filter(|s| s.alive).count() == n)
        {
            return;
        }
        assert!(Instant::now() < until, "views never showed {n} live nodes");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_three_node_cluster_talks_over_mutual_tls() {
    let c = tls_cluster().await;
    all_see(&c.eps, 3).await;
    // Every node calls every other: each link is TCP inside TLS.
    for (i, from) in c.eps.iter().enumerate() {
        for to in 1..=3u32 {
            if to as usize == i + 1 {
                continue;
            }
            let text = format!("{} to {to}", i + 1);
            let r = from
                .call(NodeId(to), request(to, &text), deadline())
                .await
                .expect("a call over TLS");
            assert_eq!(r.status, Status::Ok);
            assert_eq!(r.payload.decode::<String>().unwrap(), text);
        }
    }
    assert_eq!(c.handled.load(Ordering::SeqCst), 6);
    // A large message (fragmented, many TLS records) arrives whole.
    let big: Vec<u8> = (0..3_000_000u32).map(|i| (i % 251) as u8).collect();
    let r = c.eps[0]
        .call(
            NodeId(2),
            Request {
                payload: Payload::local(big.clone()),
                ..request(2, "")
            },
            deadline(),
        )
        .await
        .expect("a large call over TLS");
    assert_eq!(r.payload.decode::<Vec<u8>>().unwrap(), big);
    // A client with a client certificate calls through node 1.
    let client_pair = c.ca.issue_client(Validity::days(1)).unwrap();
    let client = Endpoint::connect_client(
        TransportConfig {
            tls: Some(tls_of(&c.ca, &client_pair)),
            secret: b"cluster".to_vec(),
            ..TransportConfig::client(Incarnation(7))
        },
        c.eps[0].listen_addr().unwrap(),
    )
    .await
    .expect("a TLS client connects");
    let r = client
        .call(NodeId(3), request(3, "via 1"), deadline())
        .await
        .expect("a client call over TLS");
    assert_eq!(r.payload.decode::<String>().unwrap(), "via 1");
    client.shutdown().await;
    for ep in &c.eps {
        ep.shutdown().await;
    }
}

/// Starts a node 9 with `tls` and has it try to join the cluster and to
/// call node 1 as a client; both must fail, and the cluster must have
/// acted on nothing. Returns the join failure's reason.
async fn refused_everywhere(c: &Cluster, tls: Option<TlsConfig>, case: &str) -> Failure {
    let before = c.handled.load(Ordering::SeqCst);
    let rogue_handled = Arc::new(AtomicUsize::new(0));
    let rogue = start(cfg(9, tls.clone()), &rogue_handled).await;
    let seed = Seed::Tcp(c.eps[0].listen_addr().unwrap());
    let failure = rogue
        .join(seed)
        .await
        .expect_err(&format!("{case}: the join must be refused"));
    let client = Endpoint::connect_client(
        TransportConfig {
            tls,
            secret: b"cluster".to_vec(),
            ..TransportConfig::client(Incarnation(8))
        },
        c.eps[0].listen_addr().unwrap(),
    )
    .await;
    match client {
        Ok(client) => {
            // Connected at the TCP level only if the refusal is still on
            // its way: a call must fail all the same.
            let r = client
                .call(NodeId(1), request(1, "sneak"), deadline())
                .await;
            assert!(r.is_err(), "{case}: a call went through: {r:?}");
            client.shutdown().await;
        }
        Err(f) => assert_ne!(f.status, Status::Ok),
    }
    // Nothing acted on: no request handled, node 9 in no view.
    assert_eq!(
        c.handled.load(Ordering::SeqCst),
        before,
        "{case}: a request was handled"
    );
    for ep in &c.eps {
        assert!(
            ep.view().nodes.iter().all(|s| s.info.id != NodeId(9)),
            "{case}: node 9 is in node {}'s view",
            ep.node_id()
        );
    }
    rogue.shutdown().await;
    eprintln!("{case}: {failure}");
    failure
}

/// Waits until node `ep` has recorded a refusal containing `words`.
async fn node_refused(ep: &Endpoint, words: &str) {
    let until = Instant::now() + Duration::from_secs(10);
    while !ep.refusals().iter().any(|r| r.contains(words)) {
        assert!(
            Instant::now() < until,
            "no refusal with {words:?}: {:?}",
            ep.refusals()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plaintext_peer_is_refused_with_a_clear_error() {
    let c = tls_cluster().await;
    let f = refused_everywhere(&c, None, "plaintext").await;
    assert_eq!(f.status, Status::Refused, "{f}");
    assert!(f.detail.contains("requires TLS"), "{f}");
    node_refused(&c.eps[0], "plaintext peer refused").await;
    for ep in &c.eps {
        ep.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_certificate_from_another_ca_is_refused() {
    let c = tls_cluster().await;
    let other = ClusterCa::generate(Validity::days(1)).unwrap();
    let pair = other.issue_node(9, Validity::days(1)).unwrap();
    // Trusting only its own CA, the peer refuses the node's certificate.
    let f = refused_everywhere(&c, Some(tls_of(&other, &pair)), "other CA").await;
    assert_eq!(f.status, Status::Refused, "{f}");
    assert!(
        f.detail.contains("invalid peer certificate: UnknownIssuer"),
        "{f}"
    );
    // Trusting the cluster's CA, it is the node that refuses its certificate.
    let cheat = TlsConfig::from_pem(
        pair.cert.as_bytes(),
        pair.key.as_bytes(),
        c.ca.cert_pem().as_bytes(),
    )
    .unwrap();
    let f = refused_everywhere(&c, Some(cheat), "other CA, trusting ours").await;
    assert_eq!(f.status, Status::Refused, "{f}");
    assert!(f.detail.contains("refused this end's certificate"), "{f}");
    node_refused(&c.eps[0], "invalid peer certificate: UnknownIssuer").await;
    for ep in &c.eps {
        ep.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_certificate_is_refused() {
    let c = tls_cluster().await;
    let now = SystemTime::now();
    let expired = Validity {
        not_before: now - Duration::from_secs(10 * 86_400),
        not_after: now - Duration::from_secs(86_400),
    };
    let pair = c.ca.issue_node(9, expired).unwrap();
    let f = refused_everywhere(&c, Some(tls_of(&c.ca, &pair)), "expired").await;
    assert_eq!(f.status, Status::Refused, "{f}");
    assert!(f.detail.contains("refused this end's certificate"), "{f}");
    node_refused(&c.eps[0], "invalid peer certificate: certificate expired").await;
    for ep in &c.eps {
        ep.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tls_peer_of_a_plaintext_node_is_refused() {
    let handled = Arc::new(AtomicUsize::new(0));
    let plain = start(cfg(1, None), &handled).await;
    let ca = ClusterCa::generate(Validity::days(1)).unwrap();
    let pair = ca.issue_node(2, Validity::days(1)).unwrap();
    let other = start(cfg(2, Some(tls_of(&ca, &pair))), &handled).await;
    let f = other
        .join(Seed::Tcp(plain.listen_addr().unwrap()))
        .await
        .expect_err("a TLS node cannot join a plaintext one");
    eprintln!("TLS to plaintext: {f}");
    assert_eq!(f.status, Status::Refused, "{f}");
    assert!(f.detail.contains("not configured for TLS"), "{f}");
    assert_eq!(handled.load(Ordering::SeqCst), 0);
    assert!(plain.view().nodes.iter().all(|s| s.info.id != NodeId(2)));
    // The plaintext node says why in its refusals.
    node_refused(&plain, "speaks TLS").await;
    other.shutdown().await;
    plain.shutdown().await;
}

/// Forwards connections on its own port to `to`, and flips the last byte of
/// the first chunk the client sends after `armed` is set.
async fn tampering_proxy(
    to: std::net::SocketAddr,
    armed: Arc<std::sync::atomic::AtomicBool>,
) -> std::net::SocketAddr {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let Ok(server) = tokio::net::TcpStream::connect(to).await else {
                return;
            };
            let (mut cr, mut cw) = client.into_split();
            let (mut sr, mut sw) = server.into_split();
            let armed = armed.clone();
            tokio::spawn(async move {
                let mut buf = vec![0u8; 64 * 1024];
                while let Ok(n) = cr.read(&mut buf).await {
                    if n == 0 {
                        break;
                    }
                    if armed.swap(false, Ordering::SeqCst) {
                        buf[n - 1] ^= 0x01;
                    }
                    if sw.write_all(&buf[..n]).await.is_err() {
                        break;
                    }
                }
            });
            tokio::spawn(async move {
                let mut buf = vec![0u8; 64 * 1024];
                while let Ok(n) = sr.read(&mut buf).await {
                    if n == 0 || cw.write_all(&buf[..n]).await.is_err() {
                        break;
                    }
                }
            });
        }
    });
    addr
}

/// Frames inside TLS carry no CRC of their own: a byte altered on the way
/// must still be caught (by the record's AEAD tag), end the link, and
/// reach no handler.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_altered_on_the_way_ends_the_link_and_reaches_nobody() {
    let ca = ClusterCa::generate(Validity::days(1)).unwrap();
    let handled = Arc::new(AtomicUsize::new(0));
    let node = start(
        cfg(
            1,
            Some(tls_of(&ca, &ca.issue_node(1, Validity::days(1)).unwrap())),
        ),
        &handled,
    )
    .await;
    let armed = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let proxy = tampering_proxy(node.listen_addr().unwrap(), armed.clone()).await;
    let client = Endpoint::connect_client(
        TransportConfig {
            tls: Some(tls_of(&ca, &ca.issue_client(Validity::days(1)).unwrap())),
            secret: b"cluster".to_vec(),
            ..TransportConfig::client(Incarnation(7))
        },
        proxy,
    )
    .await
    .expect("a TLS client connects through the proxy");
    let r = client
        .call(NodeId(1), request(1, "intact"), deadline())
        .await
        .expect("an intact call");
    assert_eq!(r.payload.decode::<String>().unwrap(), "intact");
    assert_eq!(handled.load(Ordering::SeqCst), 1);
    armed.store(true, Ordering::SeqCst);
    let r = client
        .call(NodeId(1), request(1, "altered"), deadline())
        .await;
    assert!(
        r.is_err(),
        "a call whose bytes were altered went through: {r:?}"
    );
    assert!(!armed.load(Ordering::SeqCst), "the proxy altered nothing");
    assert_eq!(
        handled.load(Ordering::SeqCst),
        1,
        "an altered request reached the handler"
    );
    client.shutdown().await;
    node.shutdown().await;
}
