//! An adversarial client against the TCP listener of a real in-process node,
//! through raw sockets: connection churn, malformed and hostile frames,
//! identity claims, oversized and abandoned reassembly. The node must answer
//! each with a precise refusal, never panic or hang, keep its descriptors and
//! memory bounded, and go on serving.
//!
//! The tests count this process's open descriptors, so they run one at a time
//! (`SERIAL`).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use weft_transport::*;
use weft_wire::codec::HEADER_LEN;
use weft_wire::*;

/// Held by each test for its whole run (an async lock: it is held across
/// awaits; it does not poison, so one failure does not fail the others).
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

const SECRET: &[u8] = b"adversary";

/// Requests of the `hold` service, kept unanswered until a test lets go.
static HELD: std::sync::Mutex<Vec<Responder>> = std::sync::Mutex::new(Vec::new());

/// Answers `echo` with its payload; keeps `hold` requests in [`HELD`].
struct Echo;

impl RequestHandler for Echo {
    fn handle(&self, _from: PeerRef, req: Request, responder: Responder) {
        match req.service.as_str() {
            "hold" => HELD.lock().unwrap().push(responder),
            "echo" => responder.respond(Response {
                call_id: 0,
                status: Status::Ok,
                detail: String::new(),
                tx: None,
                payload: req.payload,
            }),
            other => responder.fail(Failure::new(Status::NoSuchService, other.to_string())),
        }
    }
}

/// Counts the protocol messages a port receives.
struct CountMessages(Arc<AtomicUsize>);

impl PortHandler for CountMessages {
    fn on_message(&self, _from: PeerRef, _payload: Payload) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

fn cfg(node: u32) -> TransportConfig {
    TransportConfig {
        listen: Some("127.0.0.1:0".parse().unwrap()),
        channels: ChannelSet {
            inproc: false,
            shm: false,
            tcp: true,
        },
        hub: Some(InprocHub::new()),
        heartbeat_interval: Duration::from_millis(100),
        dead_after: Duration::from_secs(3),
        connect_timeout: Duration::from_secs(2),
        handshake_timeout: Duration::from_secs(1),
        secret: SECRET.to_vec(),
        ..TransportConfig::node(NodeId(node), Incarnation(5))
    }
}

async fn start(cfg: TransportConfig) -> Endpoint {
    let ep = Endpoint::start(cfg).await.expect("endpoint starts");
    ep.set_request_handler(Arc::new(Echo));
    ep
}

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .expect("/proc/self/fd")
        .count()
}

/// Polls `cond` every 20 ms until it holds; panics with `what()` after a
/// generous bound.
async fn eventually(what: impl Fn() -> String, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !cond() {
        assert!(Instant::now() < deadline, "never: {}", what());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn request(service: &str, node: u32, call_id: u64, payload: Payload) -> Request {
    Request {
        call_id,
        service: ServiceName::new(service).unwrap(),
        instance: 0,
        node: NodeId(node),
        budget_us: None,
        tx: None,
        flags: 0,
        payload,
    }
}

fn hello(node: u32, incarnation: u32, role: PeerRole) -> Hello {
    Hello {
        node: NodeId(node),
        incarnation: Incarnation(incarnation),
        role,
        nonce: [node as u8 ^ 0x5a; 16],
        max_frame: 1 << 20,
        max_message: 64 << 20,
    }
}

fn encoded(frame: &Frame) -> BytesMut {
    let mut out = BytesMut::new();
    encode_frame(frame, &mut out).unwrap();
    out
}

/// A hand-driven connection.
struct Raw {
    sock: TcpStream,
    buf: BytesMut,
}

impl Raw {
    async fn connect(ep: &Endpoint) -> Raw {
        Raw {
            sock: TcpStream::connect(ep.listen_addr().unwrap()).await.unwrap(),
            buf: BytesMut::new(),
        }
    }

    async fn send(&mut self, frame: &Frame) {
        self.write(&encoded(frame)).await;
    }

    async fn write(&mut self, bytes: &[u8]) {
        // The node may have refused and closed already: that shows in what
        // is read next.
        let _ = self.sock.write_all(bytes).await;
    }

    /// The next frame, or `None` at EOF; panics if the node stays silent
    /// for 20 s (a hang).
    async fn next(&mut self) -> Option<Frame> {
        loop {
            match decode_frame(&mut self.buf, &Limits::default()) {
                Ok(Some(f)) => return Some(f),
                Ok(None) => {}
                Err(e) => panic!("the node sent bytes that do not decode: {e}"),
            }
            let mut chunk = [0u8; 4096];
            let read = tokio::time::timeout(Duration::from_secs(20), self.sock.read(&mut chunk))
                .await
                .expect("the node neither answered nor closed within 20 s");
            match read {
                Ok(0) | Err(_) => return None,
                Ok(n) => self.buf.extend_from_slice(&chunk[..n]),
            }
        }
    }

    /// Expects a Refused with `status`, then the connection closed.
    async fn refused(&mut self, status: Status, case: &str) -> String {
        loop {
            match self.next().await {
                Some(Frame::Refused(r)) => {
                    assert_eq!(r.status, status, "{case}: {}", r.reason);
                    assert!(
                        self.next().await.is_none(),
                        "{case}: not closed after Refused"
                    );
                    return r.reason;
                }
                Some(Frame::Hello(_) | Frame::Auth(_) | Frame::Heartbeat(_)) => {}
                other => panic!("{case}: expected Refused({status}), got {other:?}"),
            }
        }
    }

    /// Says Hello as `hello` and answers the node's proof; returns the
    /// node's Hello.
    async fn handshake(ep: &Endpoint, hello: Hello, secret: &[u8]) -> (Raw, Hello) {
        let mut raw = Raw::connect(ep).await;
        raw.send(&Frame::Hello(hello.clone())).await;
        let Some(Frame::Hello(theirs)) = raw.next().await else {
            panic!("no Hello from the node")
        };
        assert!(matches!(raw.next().await, Some(Frame::Auth(_))));
        let proof = auth::proof(secret, &hello, &theirs.nonce);
        raw.send(&Frame::Auth(Auth { proof })).await;
        (raw, theirs)
    }

    /// Calls echo and expects it answered.
    async fn echo(&mut self, node: u32, call_id: u64) {
        self.send(&Frame::Request(request(
            "echo",
            node,
            call_id,
            Payload::bytes(vec![1, 2, 3]),
        )))
        .await;
        loop {
            match self.next().await {
                Some(Frame::Response(r)) if r.call_id == call_id => {
                    assert_eq!(r.status, Status::Ok, "{r:?}");
                    return;
                }
                Some(Frame::Heartbeat(_)) => {}
                other => panic!("expected the echo's response, got {other:?}"),
            }
        }
    }
}

/// A real node joins `ep` and calls it.
async fn still_serves(ep: &Endpoint, joiner: u32) {
    let other = start(cfg(joiner)).await;
    other
        .join(Seed::Tcp(ep.listen_addr().unwrap()))
        .await
        .expect("a real node still joins");
    let r = other
        .call(
            ep.node_id(),
            request("echo", ep.node_id().0, 0, Payload::local(7u8)),
            Some(Instant::now() + Duration::from_secs(10)),
        )
        .await
        .expect("the call is answered");
    assert_eq!(r.status, Status::Ok);
    other.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_churn_leaks_no_descriptors_and_the_node_keeps_serving() {
    let _serial = SERIAL.lock().await;
    let a = start(cfg(1)).await;
    // One full link first, so that every lazily opened descriptor of the
    // runtime and the node exists before the baseline is taken.
    let (mut warm, _) = Raw::handshake(&a, hello(0, 1, PeerRole::Client), SECRET).await;
    warm.echo(1, 1).await;
    drop(warm);
    eventually(
        || format!("{} links", a.open_links()),
        || a.open_links() == 0,
    )
    .await;
    let baseline = open_fds();

    const ROUNDS: usize = 2000;
    for i in 0..ROUNDS {
        match i % 4 {
            // connect() then close(), not a byte sent.
            0 | 1 => drop(Raw::connect(&a).await),
            // Half a handshake: a Hello, then gone.
            2 => {
                let mut raw = Raw::connect(&a).await;
                raw.send(&Frame::Hello(hello(0, i as u32, PeerRole::Client)))
                    .await;
            }
            // A whole legitimate client link with a call, then gone.
            _ => {
                let (mut raw, _) =
                    Raw::handshake(&a, hello(0, i as u32, PeerRole::Client), SECRET).await;
                raw.echo(1, i as u64).await;
            }
        }
    }
    // Every accepted connection's descriptor is closed again (a little
    // slack for descriptors the runtime opens on its own).
    eventually(
        || {
            format!(
                "{} descriptors open, {baseline} before {ROUNDS} connections; {} links",
                open_fds(),
                a.open_links()
            )
        },
        || open_fds() <= baseline + 8 && a.open_links() == 0,
    )
    .await;
    assert_eq!(a.reassembly_bytes(), 0);
    still_serves(&a, 2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_and_hostile_frames_get_precise_refusals() {
    let _serial = SERIAL.lock().await;
    let a = start(cfg(1)).await;

    // Not weft at all.
    let mut raw = Raw::connect(&a).await;
    raw.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").await;
    let why = raw.refused(Status::ProtocolError, "garbage").await;
    assert!(why.contains("magic"), "{why}");

    // A Hello with a bad checksum.
    let mut raw = Raw::connect(&a).await;
    let mut bytes = encoded(&Frame::Hello(hello(0, 1, PeerRole::Client)));
    let last = bytes.len() - 1;
    bytes[last] ^= 0xff;
    raw.write(&bytes).await;
    let why = raw.refused(Status::ProtocolError, "bad crc").await;
    assert!(why.contains("checksum"), "{why}");

    // A truncated Hello, then silence: refused at the handshake bound.
    let mut raw = Raw::connect(&a).await;
    let bytes = encoded(&Frame::Hello(hello(0, 1, PeerRole::Client)));
    raw.write(&bytes[..bytes.len() / 2]).await;
    raw.refused(Status::TimedOut, "truncated").await;

    // A Hello whose header claims more than a handshake frame may be.
    let mut raw = Raw::connect(&a).await;
    let mut header = Vec::from(&b"wf"[..]);
    header.extend_from_slice(&[1, FrameKind::Hello as u8]);
    header.extend_from_slice(&(64u32 << 10).to_le_bytes());
    header.extend_from_slice(&[0; 4]);
    raw.write(&header).await;
    raw.refused(Status::TooLarge, "huge hello").await;

    // A well-formed Request before the handshake.
    let mut raw = Raw::connect(&a).await;
    raw.send(&Frame::Request(request("echo", 1, 1, Payload::empty())))
        .await;
    let why = raw.refused(Status::ProtocolError, "early request").await;
    assert!(why.contains("before the handshake"), "{why}");

    // A malformed Request before the handshake (an invalid service name,
    // answered BadRequest on a live link): a protocol error all the same.
    let mut raw = Raw::connect(&a).await;
    let mut bytes = encoded(&Frame::Request(request("nosuch", 1, 7, Payload::empty())));
    let at = bytes.windows(6).position(|w| w == b"nosuch").unwrap();
    bytes[at..at + 6].copy_from_slice(b"no/suc");
    let crc = crc32c::crc32c_append(crc32c::crc32c(&bytes[0..8]), &bytes[HEADER_LEN..]);
    bytes[8..12].copy_from_slice(&crc.to_le_bytes());
    raw.write(&bytes).await;
    let why = raw
        .refused(Status::ProtocolError, "early malformed request")
        .await;
    assert!(why.contains("before the handshake"), "{why}");

    // An Auth before any Hello.
    let mut raw = Raw::connect(&a).await;
    raw.send(&Frame::Auth(Auth { proof: [0; 32] })).await;
    raw.refused(Status::ProtocolError, "early auth").await;

    // The wrong secret.
    let mut raw = Raw::connect(&a).await;
    let mine = hello(0, 1, PeerRole::Client);
    raw.send(&Frame::Hello(mine.clone())).await;
    let Some(Frame::Hello(theirs)) = raw.next().await else {
        panic!("no Hello")
    };
    let proof = auth::proof(b"not the secret", &mine, &theirs.nonce);
    raw.send(&Frame::Auth(Auth { proof })).await;
    raw.refused(Status::WrongSecret, "wrong secret").await;

    // A client that could not be sent even a failure: refused at once,
    // with the bound in the reason.
    let mut raw = Raw::connect(&a).await;
    raw.send(&Frame::Hello(Hello {
        max_message: 16,
        ..hello(0, 1, PeerRole::Client)
    }))
    .await;
    let why = raw.refused(Status::ProtocolError, "max_message 16").await;
    assert!(
        why.contains("max_message 16") && why.contains("1024"),
        "{why}"
    );

    // Garbage after a good handshake.
    let (mut raw, _) = Raw::handshake(&a, hello(0, 1, PeerRole::Client), SECRET).await;
    raw.echo(1, 1).await;
    raw.write(&[0xde; 64]).await;
    raw.refused(Status::ProtocolError, "garbage on a live link")
        .await;

    still_serves(&a, 2).await;
    eventually(
        || format!("{} links", a.open_links()),
        || a.open_links() == 0,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn identity_claims_are_checked() {
    let _serial = SERIAL.lock().await;
    let a = start(cfg(1)).await;
    // A real member, node 2 incarnation 5.
    let b = start(cfg(2)).await;
    b.join(Seed::Tcp(a.listen_addr().unwrap())).await.unwrap();

    let cases = [
        (hello(1, 5, PeerRole::Node), Status::Refused, "own id"),
        (
            hello(1, 9, PeerRole::Node),
            Status::Refused,
            "own id, newer",
        ),
        (
            hello(u32::MAX, 1, PeerRole::Node),
            Status::ProtocolError,
            "u32::MAX",
        ),
        (
            hello(7, 1, PeerRole::Client),
            Status::ProtocolError,
            "client with an id",
        ),
        (
            hello(2, 4, PeerRole::Node),
            Status::Refused,
            "older than live node 2",
        ),
    ];
    for (claim, status, case) in cases {
        let mut raw = Raw::connect(&a).await;
        raw.send(&Frame::Hello(claim.clone())).await;
        // Checks on the Hello itself come before the node says anything;
        // checks against what the node knows, after both proofs.
        match raw.next().await {
            Some(Frame::Hello(theirs)) => {
                assert!(matches!(raw.next().await, Some(Frame::Auth(_))));
                let proof = auth::proof(SECRET, &claim, &theirs.nonce);
                raw.send(&Frame::Auth(Auth { proof })).await;
                raw.refused(status, case).await;
            }
            Some(Frame::Refused(r)) => {
                assert_eq!(r.status, status, "{case}: {}", r.reason);
            }
            other => panic!("{case}: got {other:?}"),
        }
    }
    // The same incarnation as the live node is that node opening another
    // link: admitted.
    let (mut raw, _) = Raw::handshake(&a, hello(2, 5, PeerRole::Node), SECRET).await;
    raw.echo(1, 1).await;
    drop(raw);
    assert!(a
        .view()
        .nodes
        .iter()
        .any(|n| n.info.id == NodeId(2) && n.alive));
    still_serves(&a, 3).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn protocol_messages_on_a_client_link_are_refused_not_obeyed() {
    let _serial = SERIAL.lock().await;
    let a = start(cfg(1)).await;
    let seen = Arc::new(AtomicUsize::new(0));
    for port in [Port::TX, Port::GROUP, Port::NAMING] {
        a.set_port_handler(port, Arc::new(CountMessages(seen.clone())));
    }
    for port in [Port::TX, Port::GROUP, Port::NAMING, Port(77)] {
        let (mut raw, _) = Raw::handshake(&a, hello(0, 1, PeerRole::Client), SECRET).await;
        raw.echo(1, 1).await;
        raw.send(&Frame::Message(Message {
            port,
            payload: Payload::bytes(vec![0, 1, 2, 3]),
        }))
        .await;
        let why = raw.refused(Status::ProtocolError, "client message").await;
        assert!(why.contains("protocol message"), "{why}");
    }
    assert_eq!(
        seen.load(Ordering::SeqCst),
        0,
        "a client's message was acted on"
    );
    // A member's message is delivered.
    let (mut raw, _) = Raw::handshake(&a, hello(9, 1, PeerRole::Node), SECRET).await;
    raw.send(&Frame::Message(Message {
        port: Port::GROUP,
        payload: Payload::bytes(vec![0]),
    }))
    .await;
    eventually(
        || "the member's message".into(),
        || seen.load(Ordering::SeqCst) == 1,
    )
    .await;
}

/// The first fragment of message `id` whose inner frame claims `whole`
/// bytes, with `chunk` bytes of it.
fn first_fragment(id: u64, count: u32, whole: u64, chunk: usize) -> Frame {
    let mut bytes = vec![0u8; chunk];
    bytes[0..2].copy_from_slice(b"wf");
    bytes[2] = 1;
    bytes[3] = FrameKind::Request as u8;
    let body = u32::try_from(whole - HEADER_LEN as u64).unwrap_or(u32::MAX);
    bytes[4..8].copy_from_slice(&body.to_le_bytes());
    Frame::Fragment(Fragment {
        message_id: id,
        index: 0,
        count,
        chunk: Bytes::from(bytes),
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reassembly_is_bounded_per_link_per_node_and_in_time() {
    let _serial = SERIAL.lock().await;
    let mut c = cfg(1);
    c.limits.max_message = 4 << 20;
    c.limits.reassembly_timeout = Duration::from_secs(1);
    c.reassembly_budget = 6 << 20;
    let a = start(c).await;

    // A claim of ~4 GiB is refused on its first piece, before its bytes.
    let (mut raw, _) = Raw::handshake(&a, hello(0, 1, PeerRole::Client), SECRET).await;
    raw.send(&first_fragment(1, 70_000, u32::MAX as u64, 60_000))
        .await;
    let why = raw.refused(Status::TooLarge, "4 GiB claim").await;
    assert!(why.contains("4294967"), "{why}");

    // One link may not claim more than max_message in all.
    let (mut raw, _) = Raw::handshake(&a, hello(0, 1, PeerRole::Client), SECRET).await;
    raw.send(&first_fragment(1, 100, 3 << 20, 60_000)).await;
    raw.send(&first_fragment(2, 100, 3 << 20, 60_000)).await;
    raw.refused(Status::TooLarge, "link share").await;
    eventually(
        || format!("{} held", a.reassembly_bytes()),
        || a.reassembly_bytes() == 0,
    )
    .await;

    // The node's budget is shared by its links: the second 4 MiB claim
    // does not fit in 6 MiB and its link is told NoBuffer.
    let (mut one, _) = Raw::handshake(&a, hello(0, 1, PeerRole::Client), SECRET).await;
    one.send(&first_fragment(1, 100, 4 << 20, 60_000)).await;
    one.echo(1, 2).await; // the fragment was taken in
    assert_eq!(a.reassembly_bytes(), 4 << 20);
    let (mut two, _) = Raw::handshake(&a, hello(0, 2, PeerRole::Client), SECRET).await;
    two.send(&first_fragment(1, 100, 4 << 20, 60_000)).await;
    two.refused(Status::NoBuffer, "node budget").await;

    // The first link's message never completes: it fails with TimedOut
    // and its budget comes back.
    one.refused(Status::TimedOut, "reassembly timeout").await;
    eventually(
        || format!("{} held", a.reassembly_bytes()),
        || a.reassembly_bytes() == 0,
    )
    .await;

    // A frame begun and never finished on a live link (slowloris) is
    // bounded by the same timeout.
    let (mut raw, _) = Raw::handshake(&a, hello(0, 1, PeerRole::Client), SECRET).await;
    let bytes = encoded(&Frame::Request(request(
        "echo",
        1,
        3,
        Payload::bytes(vec![0; 4000]),
    )));
    raw.write(&bytes[..2000]).await;
    raw.refused(Status::TimedOut, "slowloris").await;

    still_serves(&a, 2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_cannot_pile_up_unanswered_requests() {
    let _serial = SERIAL.lock().await;
    let a = start(TransportConfig {
        max_requests_per_link: 4,
        ..cfg(1)
    })
    .await;
    let (mut raw, _) = Raw::handshake(&a, hello(0, 1, PeerRole::Client), SECRET).await;
    for id in 1..=5 {
        raw.send(&Frame::Request(request("hold", 1, id, Payload::empty())))
            .await;
    }
    // The fifth is answered at once; the four before it wait.
    match raw.next().await {
        Some(Frame::Response(r)) => {
            assert_eq!((r.call_id, r.status), (5, Status::NoBuffer), "{r:?}")
        }
        other => panic!("expected NoBuffer for call 5, got {other:?}"),
    }
    let held: Vec<Responder> = std::mem::take(&mut *HELD.lock().unwrap());
    assert_eq!(held.len(), 4);
    drop(held); // answered Internal: dropped without an answer
    for _ in 0..4 {
        assert!(
            matches!(raw.next().await, Some(Frame::Response(r)) if r.status == Status::Internal)
        );
    }
    // Slots free again: the link serves.
    raw.echo(1, 6).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_stops_reading_loses_its_link() {
    let _serial = SERIAL.lock().await;
    let a = start(TransportConfig {
        write_stall_timeout: Duration::from_secs(1),
        ..cfg(1)
    })
    .await;
    let baseline = a.open_links();
    let (mut raw, _) = Raw::handshake(&a, hello(0, 1, PeerRole::Client), SECRET).await;
    raw.echo(1, 1).await;
    // 32 MiB of echoes whose answers it never reads: more than the kernel
    // buffers of both ends hold.
    for id in 2..130 {
        raw.send(&Frame::Request(request(
            "echo",
            1,
            id,
            Payload::bytes(vec![9u8; 256 << 10]),
        )))
        .await;
    }
    eventually(
        || format!("{} links", a.open_links()),
        || a.open_links() == baseline,
    )
    .await;
    drop(raw);
    still_serves(&a, 2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peers_reasons_are_kept_short_and_on_one_line() {
    let _serial = SERIAL.lock().await;
    let a = start(cfg(1)).await;
    let (mut raw, _) = Raw::handshake(&a, hello(9, 1, PeerRole::Node), SECRET).await;
    raw.send(&Frame::Refused(Refused {
        status: Status::ProtocolError,
        reason: "forged\nlog line ".repeat(20_000),
    }))
    .await;
    assert!(raw.next().await.is_none(), "closed");
    eventually(
        || format!("{:?}", a.refusals().len()),
        || !a.refusals().is_empty(),
    )
    .await;
    let kept = a.refusals().pop().unwrap();
    assert!(kept.len() < 1024, "{} bytes kept", kept.len());
    assert!(!kept.contains('\n'), "{kept}");
}

/// Sets this process's soft descriptor limit; returns the previous one.
fn set_fd_limit(soft: u64) -> u64 {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit only read and write the struct given.
    unsafe {
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim), 0);
        let old = lim.rlim_cur;
        lim.rlim_cur = soft.min(lim.rlim_max);
        assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &lim), 0);
        old
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn running_out_of_descriptors_does_not_stop_the_listener() {
    let _serial = SERIAL.lock().await;
    let a = start(cfg(1)).await;
    let (mut warm, _) = Raw::handshake(&a, hello(0, 1, PeerRole::Client), SECRET).await;
    warm.echo(1, 1).await;
    drop(warm);
    eventually(
        || format!("{} links", a.open_links()),
        || a.open_links() == 0,
    )
    .await;
    // Room for a few descriptors only: the clients' sockets and the node's
    // accepted ones soon use them all, and the node's accept fails EMFILE.
    let starved = a.accept_starved();
    let old = set_fd_limit(open_fds() as u64 + 12);
    let mut clients = Vec::new();
    for _ in 0..40 {
        match std::net::TcpStream::connect(a.listen_addr().unwrap()) {
            Ok(s) => clients.push(s),
            Err(_) => break, // this process is out of descriptors
        }
    }
    assert!(!clients.is_empty());
    // Connections wait in the backlog while the node has no descriptor to
    // accept them with; the accept loop meets EMFILE, backs off, tries
    // again.
    eventually(
        || format!("{} starved accepts", a.accept_starved() - starved),
        || a.accept_starved() >= starved + 2,
    )
    .await;
    drop(clients);
    set_fd_limit(old);
    // Descriptors free again: the node accepts and serves.
    let (mut raw, _) = Raw::handshake(&a, hello(0, 2, PeerRole::Client), SECRET).await;
    raw.echo(1, 2).await;
    eventually(
        || format!("{} links", a.open_links()),
        || a.open_links() <= 1,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_over_the_handshaking_bound_are_turned_away() {
    let _serial = SERIAL.lock().await;
    let a = start(TransportConfig {
        max_handshaking: 2,
        ..cfg(1)
    })
    .await;
    // Two connections that never say Hello take both places...
    let mut silent = vec![Raw::connect(&a).await, Raw::connect(&a).await];
    eventually(
        || format!("{} links", a.open_links()),
        || a.open_links() == 2,
    )
    .await;
    // ...so a third is told Unavailable at once.
    let mut third = Raw::connect(&a).await;
    third.refused(Status::Unavailable, "over the bound").await;
    // The silent ones are refused at the handshake bound; then there is room.
    for raw in &mut silent {
        raw.refused(Status::TimedOut, "silent").await;
    }
    eventually(
        || format!("{} links", a.open_links()),
        || a.open_links() == 0,
    )
    .await;
    let (mut raw, _) = Raw::handshake(&a, hello(0, 1, PeerRole::Client), SECRET).await;
    raw.echo(1, 1).await;
}

/// Blocks the inbox task on the first message until the gate opens, then
/// counts every message.
struct Gate {
    open: Arc<(std::sync::Mutex<bool>, std::sync::Condvar)>,
    seen: Arc<AtomicUsize>,
}

impl PortHandler for Gate {
    fn on_message(&self, _from: PeerRef, _payload: Payload) {
        let (lock, cv) = &*self.open;
        let mut open = lock.lock().unwrap();
        while !*open {
            open = cv.wait(open).unwrap();
        }
        self.seen.fetch_add(1, Ordering::SeqCst);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 3)]
async fn a_member_faster_than_the_node_is_slowed_down_not_queued() {
    let _serial = SERIAL.lock().await;
    const BOUND: usize = 8;
    const SENT: usize = 1000;
    let a = start(TransportConfig {
        max_inbox_per_link: BOUND,
        ..cfg(1)
    })
    .await;
    let open = Arc::new((std::sync::Mutex::new(false), std::sync::Condvar::new()));
    let seen = Arc::new(AtomicUsize::new(0));
    a.set_port_handler(
        Port::GROUP,
        Arc::new(Gate {
            open: open.clone(),
            seen: seen.clone(),
        }),
    );
    let (raw, _) = Raw::handshake(&a, hello(9, 1, PeerRole::Node), SECRET).await;
    // 1000 messages of 64 KiB while the node handles none: far more than
    // the kernel buffers hold.
    let writer = tokio::spawn(async move {
        let mut raw = raw;
        let one = encoded(&Frame::Message(Message {
            port: Port::GROUP,
            payload: Payload::bytes(vec![3u8; 64 << 10]),
        }));
        for _ in 0..SENT {
            raw.write(&one).await;
        }
        raw
    });
    eventually(
        || format!("high water {}", a.inbox_high_water()),
        || a.inbox_high_water() >= BOUND,
    )
    .await;
    // Without the bound the node would read on and queue them all: give
    // the writer every chance to finish (it cannot while the node holds).
    let deadline = Instant::now() + Duration::from_secs(3);
    while !writer.is_finished() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let high_water = a.inbox_high_water();
    // Open the gate (before any assertion: a test failing with the inbox
    // task blocked would hang in the runtime's shutdown).
    {
        let (lock, cv) = &*open;
        *lock.lock().unwrap() = true;
        cv.notify_all();
    }
    assert!(
        high_water <= BOUND,
        "{high_water} messages of one link queued, bound {BOUND}"
    );
    // Every message is handled, none lost, the link lives.
    let mut raw = writer.await.unwrap();
    eventually(
        || format!("{} of {SENT} handled", seen.load(Ordering::SeqCst)),
        || seen.load(Ordering::SeqCst) == SENT,
    )
    .await;
    raw.echo(1, 1).await;
    assert!(a.inbox_high_water() <= BOUND);
}
