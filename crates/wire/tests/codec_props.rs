//! Property tests of the frame codec: every frame kind round-trips, fragments
//! reassemble, and arbitrary or damaged bytes give typed errors, never panics.

use bytes::{Bytes, BytesMut};
use proptest::prelude::*;
use std::time::{Duration, Instant};
use weft_wire::codec::{HEADER_LEN, MAGIC, VERSION};
use weft_wire::txctx::MAX_BAGGAGE_ENTRIES;
use weft_wire::*;

fn arb_name() -> impl Strategy<Value = ServiceName> {
    "[a-z_][a-z0-9_-]{0,20}".prop_map(|s| ServiceName::new(s).unwrap())
}

fn arb_tid() -> impl Strategy<Value = Tid> {
    (any::<u32>(), any::<u32>(), any::<u64>())
        .prop_map(|(n, i, s)| Tid::new(NodeId(n), Incarnation(i), s))
}

fn arb_baggage() -> impl Strategy<Value = Baggage> {
    prop::collection::vec(
        ("[a-z.]{1,12}", prop::collection::vec(any::<u8>(), 0..40)).prop_map(|(k, v)| {
            BaggageItem {
                key: k,
                value: Bytes::from(v),
            }
        }),
        0..4,
    )
    .prop_map(Baggage)
}

fn arb_txctx() -> impl Strategy<Value = TxContext> {
    (
        arb_tid(),
        prop::collection::vec(any::<u32>(), 0..4),
        any::<Option<u64>>(),
        arb_baggage(),
    )
        .prop_map(|(tid, path, budget_us, baggage)| TxContext {
            tid,
            path: SubPath(path),
            budget_us,
            baggage,
        })
}

fn arb_status() -> impl Strategy<Value = Status> {
    any::<u16>().prop_map(Status::from_code)
}

fn arb_payload() -> impl Strategy<Value = Payload> {
    prop_oneof![
        prop::collection::vec(any::<u8>(), 0..300).prop_map(Payload::bytes),
        (any::<u64>(), ".{0,30}").prop_map(|(a, b)| Payload::local((a, b))),
    ]
}

fn arb_hello() -> impl Strategy<Value = Hello> {
    (
        any::<u32>(),
        any::<u32>(),
        any::<bool>(),
        any::<[u8; 16]>(),
        any::<u32>(),
        any::<u64>(),
    )
        .prop_map(|(n, i, client, nonce, mf, mm)| Hello {
            node: NodeId(n),
            incarnation: Incarnation(i),
            role: if client {
                PeerRole::Client
            } else {
                PeerRole::Node
            },
            nonce,
            max_frame: mf,
            max_message: mm,
        })
}

fn arb_frame() -> impl Strategy<Value = Frame> {
    prop_oneof![
        arb_hello().prop_map(Frame::Hello),
        any::<[u8; 32]>().prop_map(|proof| Frame::Auth(Auth { proof })),
        (arb_status(), ".{0,40}")
            .prop_map(|(status, reason)| Frame::Refused(Refused { status, reason })),
        (
            any::<u64>(),
            arb_name(),
            any::<u32>(),
            any::<u32>(),
            any::<Option<u64>>(),
            prop::option::of(arb_txctx()),
            arb_payload()
        )
            .prop_map(
                |(call_id, service, instance, node, budget_us, tx, payload)| {
                    Frame::Request(Request {
                        call_id,
                        service,
                        instance,
                        node: NodeId(node),
                        budget_us,
                        tx: tx.map(Box::new),
                        flags: 0,
                        payload,
                    })
                }
            ),
        (
            any::<u64>(),
            arb_status(),
            ".{0,40}",
            prop::option::of((arb_baggage(), any::<bool>())),
            arb_payload()
        )
            .prop_map(|(call_id, status, detail, tx, payload)| {
                Frame::Response(Response {
                    call_id,
                    status,
                    detail,
                    tx: tx.map(|(baggage, aborted)| Box::new(TxReturn { baggage, aborted })),
                    payload,
                })
            }),
        (any::<u16>(), arb_payload()).prop_map(|(p, payload)| Frame::Message(Message {
            port: Port(p),
            payload
        })),
        (any::<u64>(), any::<bool>())
            .prop_map(|(seq, reply)| Frame::Heartbeat(Heartbeat { seq, reply })),
        (
            any::<u64>(),
            2u32..100,
            prop::collection::vec(any::<u8>(), 0..100)
        )
            .prop_flat_map(|(id, count, chunk)| (0..count).prop_map(move |index| {
                Frame::Fragment(Fragment {
                    message_id: id,
                    index,
                    count,
                    chunk: Bytes::from(chunk.clone()),
                })
            })),
        ".{0,40}".prop_map(|reason| Frame::Goodbye(Goodbye { reason })),
    ]
}

fn encode(frame: &Frame) -> BytesMut {
    let mut out = BytesMut::new();
    encode_frame(frame, &mut out).unwrap();
    out
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn every_frame_kind_round_trips(frame in arb_frame()) {
        let mut buf = encode(&frame);
        let bytes = buf.clone().freeze();
        let decoded = decode_frame(&mut buf, &Limits::default()).unwrap().unwrap();
        prop_assert!(buf.is_empty());
        prop_assert_eq!(&decoded, &frame);
        prop_assert_eq!(decode_exact(bytes, &Limits::default()).unwrap(), frame);
    }

    #[test]
    fn streams_decode_whatever_the_read_sizes(
        frames in prop::collection::vec(arb_frame(), 1..6),
        cuts in prop::collection::vec(1usize..64, 1..200),
    ) {
        let mut all = BytesMut::new();
        for f in &frames { encode_frame(f, &mut all).unwrap(); }
        let all = all.freeze();
        let mut buf = BytesMut::new();
        let mut got = Vec::new();
        let mut at = 0;
        let mut cut = cuts.iter().cycle();
        while at < all.len() {
            let n = (*cut.next().unwrap()).min(all.len() - at);
            buf.extend_from_slice(&all[at..at + n]);
            at += n;
            while let Some(f) = decode_frame(&mut buf, &Limits::default()).unwrap() {
                got.push(f);
            }
        }
        prop_assert_eq!(got, frames);
    }

    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..600)) {
        let limits = Limits { max_frame: 512, ..Limits::default() };
        let mut buf = BytesMut::from(&bytes[..]);
        while let Ok(Some(_)) = decode_frame(&mut buf, &limits) {}
        let _ = decode_exact(Bytes::from(bytes), &limits);
    }

    #[test]
    fn bytes_behind_a_valid_header_never_panic(
        kind in 0u8..12,
        body in prop::collection::vec(any::<u8>(), 0..300),
    ) {
        // A well-formed header with a correct checksum over a random body: the
        // body decoder itself is exercised, not just the checksum.
        let mut raw = Vec::new();
        raw.extend_from_slice(&MAGIC);
        raw.push(VERSION);
        raw.push(kind);
        raw.extend_from_slice(&(body.len() as u32).to_le_bytes());
        let crc = crc32c::crc32c_append(crc32c::crc32c(&raw[0..8]), &body);
        raw.extend_from_slice(&crc.to_le_bytes());
        raw.extend_from_slice(&body);
        let _ = decode_exact(Bytes::from(raw), &Limits::default());
    }

    #[test]
    fn damaged_frames_are_rejected(frame in arb_frame(), at in any::<usize>(), bit in 0u8..8) {
        let mut buf = encode(&frame);
        let i = at % buf.len();
        buf[i] ^= 1 << bit;
        let bytes = buf.freeze();
        // A single flipped bit is always caught: by the magic/version/kind/length
        // checks or by CRC32C (which detects every 1-bit error).
        prop_assert!(decode_exact(bytes, &Limits::default()).is_err());
    }

    #[test]
    fn truncated_frames_are_errors(frame in arb_frame(), cut in any::<usize>()) {
        let bytes = encode(&frame).freeze();
        let n = cut % bytes.len();
        match decode_exact(bytes.slice(..n), &Limits::default()) {
            Err(DecodeError::Truncated { .. }) => {}
            other => prop_assert!(false, "cut at {} gave {:?}", n, other),
        }
        let mut partial = BytesMut::from(&bytes[..n]);
        prop_assert!(decode_frame(&mut partial, &Limits::default()).unwrap().is_none());
    }

    #[test]
    fn fragments_reassemble(
        frame in arb_frame().prop_filter("not a fragment", |f| f.kind() != FrameKind::Fragment),
        pad in prop::collection::vec(any::<u8>(), 0..6000),
        max_frame in 1024usize..2048,
    ) {
        // Pad with a big message payload so that fragmentation happens.
        let frame = match frame {
            Frame::Message(m) => Frame::Message(Message { port: m.port, payload: Payload::bytes(pad) }),
            other => other,
        };
        let mut out = BytesMut::new();
        encode_message(&frame, max_frame, usize::MAX, 7, &mut out).unwrap();
        let limits = Limits { max_frame, ..Limits::default() };
        let mut re = Reassembler::new(limits);
        let mut result = None;
        while let Some(f) = decode_frame(&mut out, &limits).unwrap() {
            match f {
                Frame::Fragment(piece) => {
                    prop_assert!(result.is_none());
                    result = re.accept(piece, Instant::now()).unwrap();
                }
                whole => result = Some(whole),
            }
        }
        prop_assert_eq!(result.unwrap(), frame);
        prop_assert_eq!(re.in_progress(), 0);
    }

    #[test]
    fn trusted_frames_carry_no_checksum_and_still_fragment(
        frame in arb_frame().prop_filter("not a fragment", |f| f.kind() != FrameKind::Fragment),
        pad in prop::collection::vec(any::<u8>(), 0..6000),
        max_frame in 1024usize..2048,
    ) {
        let frame = match frame {
            Frame::Message(m) => Frame::Message(Message { port: m.port, payload: Payload::bytes(pad) }),
            other => other,
        };
        let mut out = BytesMut::new();
        encode_message_with(&frame, Integrity::Trusted, max_frame, usize::MAX, 7, &mut out).unwrap();
        let limits = Limits { max_frame, ..Limits::default() };
        // Every frame on the link has a zero checksum field, which a
        // checksumming decoder refuses.
        let mut first = out.clone();
        prop_assert_eq!(&first[8..12], &[0u8; 4]);
        let checked = decode_frame(&mut first, &limits);
        prop_assert!(matches!(checked, Err(DecodeError::Checksum { expected: 0, .. })), "{:?}", checked);
        // The trusting decoder takes them, and a fragmented frame's own
        // encoding still passes the reassembler's check.
        let mut re = Reassembler::new(limits);
        let mut result = None;
        while let Some(f) = decode_frame_with(&mut out, &limits, Integrity::Trusted).unwrap() {
            match f {
                Frame::Fragment(piece) => {
                    prop_assert!(result.is_none());
                    result = re.accept(piece, Instant::now()).unwrap();
                }
                whole => result = Some(whole),
            }
        }
        prop_assert_eq!(result.unwrap(), frame);
    }
}

#[test]
fn oversized_frames_are_refused_from_the_header() {
    let frame = Frame::Message(Message {
        port: Port(9),
        payload: Payload::bytes(vec![0u8; 5000]),
    });
    let bytes = encode(&frame);
    let limits = Limits {
        max_frame: 4096,
        ..Limits::default()
    };
    // Only the header has arrived: the size is already known to be too large.
    let mut head = BytesMut::from(&bytes[..HEADER_LEN]);
    assert!(matches!(
        decode_frame(&mut head, &limits),
        Err(DecodeError::TooLarge {
            len: 5000..,
            max: 4096
        })
    ));
}

#[test]
fn a_message_over_the_receivers_limit_is_refused_at_the_sender() {
    let frame = Frame::Message(Message {
        port: Port(9),
        payload: Payload::bytes(vec![1u8; 10_000]),
    });
    let whole = encode(&frame).len();
    let mut out = BytesMut::from(&b"queued"[..]);
    // One byte under the encoded size: refused, and `out` is left as it was.
    let err = encode_message(&frame, 4096, whole - 1, 3, &mut out).unwrap_err();
    assert_eq!(
        err,
        MessageEncodeError::TooLarge {
            len: whole,
            max: whole - 1
        }
    );
    assert_eq!(&out[..], b"queued");
    // Exactly the encoded size: accepted and fragmented, and the receiver
    // with that limit reassembles it.
    encode_message(&frame, 4096, whole, 3, &mut out).unwrap();
    let mut stream = out.split_off(6);
    let limits = Limits {
        max_frame: 4096,
        max_message: whole,
        ..Limits::default()
    };
    let mut re = Reassembler::new(limits);
    let mut result = None;
    while let Some(f) = decode_frame(&mut stream, &limits).unwrap() {
        let Frame::Fragment(piece) = f else {
            panic!("a 10 kB message over 4 kB frames must be fragmented")
        };
        result = re.accept(piece, Instant::now()).unwrap();
    }
    assert_eq!(result, Some(frame));
}

/// A Request frame for service `name`, which may be invalid: encoded with
/// a valid name of the same length, then rewritten and re-checksummed.
fn request_named(call_id: u64, name: &str) -> BytesMut {
    let placeholder = "x".repeat(name.len());
    let frame = Frame::Request(Request {
        call_id,
        service: ServiceName::new(placeholder.clone()).unwrap(),
        instance: 0,
        node: NodeId(1),
        budget_us: None,
        tx: None,
        flags: 0,
        payload: Payload::bytes(vec![1, 2, 3]),
    });
    let mut out = encode(&frame);
    let at = out[HEADER_LEN..]
        .windows(name.len())
        .position(|w| w == placeholder.as_bytes())
        .expect("the name is in the head")
        + HEADER_LEN;
    out[at..at + name.len()].copy_from_slice(name.as_bytes());
    let crc = crc32c::crc32c_append(crc32c::crc32c(&out[0..8]), &out[HEADER_LEN..]);
    out[8..12].copy_from_slice(&crc.to_le_bytes());
    out
}

#[test]
fn a_request_with_an_invalid_service_name_is_answerable_and_the_stream_goes_on() {
    let mut stream = request_named(42, "no/such");
    encode_frame(&Frame::Goodbye(Goodbye { reason: "x".into() }), &mut stream).unwrap();
    match decode_frame(&mut stream, &Limits::default()) {
        Err(DecodeError::BadRequest { call_id, reason }) => {
            assert_eq!(call_id, 42);
            assert!(reason.contains("service name"), "{reason}");
        }
        other => panic!("expected BadRequest, got {other:?}"),
    }
    assert_eq!(
        DecodeError::BadRequest {
            call_id: 1,
            reason: String::new()
        }
        .status(),
        Status::BadRequest
    );
    // The bad frame was consumed whole: the next one decodes.
    assert_eq!(
        decode_frame(&mut stream, &Limits::default()).unwrap(),
        Some(Frame::Goodbye(Goodbye { reason: "x".into() }))
    );
    // A valid name in the same frame decodes as a request.
    let mut ok = request_named(43, "nosuch1");
    assert!(matches!(
        decode_frame(&mut ok, &Limits::default()),
        Ok(Some(Frame::Request(r))) if r.call_id == 43 && r.service.as_str() == "nosuch1"
    ));
}

#[test]
fn a_request_over_the_baggage_limit_is_answerable() {
    let with_baggage = |call_id: u64, entries: usize| {
        let mut tx = TxContext::new(Tid::new(NodeId(1), Incarnation(1), 5));
        tx.baggage = Baggage(
            (0..entries)
                .map(|i| BaggageItem {
                    key: format!("k{i}"),
                    value: Bytes::from_static(b"v"),
                })
                .collect(),
        );
        encode(&Frame::Request(Request {
            call_id,
            service: ServiceName::new("svc").unwrap(),
            instance: 0,
            node: NodeId(1),
            budget_us: None,
            tx: Some(Box::new(tx)),
            flags: 0,
            payload: Payload::empty(),
        }))
    };
    let mut at_limit = with_baggage(1, MAX_BAGGAGE_ENTRIES);
    assert!(matches!(
        decode_frame(&mut at_limit, &Limits::default()),
        Ok(Some(Frame::Request(r))) if r.tx.as_ref().unwrap().baggage.0.len() == MAX_BAGGAGE_ENTRIES
    ));
    let mut over = with_baggage(2, MAX_BAGGAGE_ENTRIES + 1);
    match decode_frame(&mut over, &Limits::default()) {
        Err(DecodeError::BadRequest { call_id: 2, reason }) => {
            assert!(reason.contains("65 baggage entries"), "{reason}")
        }
        other => panic!("expected BadRequest, got {other:?}"),
    }
}

#[test]
fn unknown_version_and_kind_are_named() {
    let mut bytes = encode(&Frame::Goodbye(Goodbye { reason: "x".into() }));
    bytes[2] = 9;
    assert_eq!(
        decode_exact(bytes.clone().freeze(), &Limits::default()),
        Err(DecodeError::UnknownVersion(9))
    );
    bytes[2] = VERSION;
    bytes[3] = 200;
    assert_eq!(
        decode_exact(bytes.freeze(), &Limits::default()),
        Err(DecodeError::UnknownKind(200))
    );
    assert!(matches!(
        decode_exact(
            Bytes::from_static(b"GET / HTTP/1.1\r\n"),
            &Limits::default()
        ),
        Err(DecodeError::BadMagic(_))
    ));
}

/// A piece of message `id`; a first piece starts with the header of a
/// Goodbye frame of `whole` bytes, as a real first piece would.
fn piece(id: u64, index: u32, count: u32, n: usize, whole: usize) -> Fragment {
    let mut chunk = vec![0u8; n];
    if index == 0 && n >= 8 {
        let head = [
            &MAGIC[..],
            &[VERSION, FrameKind::Goodbye as u8],
            &((whole - HEADER_LEN) as u32).to_le_bytes(),
        ]
        .concat();
        chunk[..8].copy_from_slice(&head);
    }
    Fragment {
        message_id: id,
        index,
        count,
        chunk: Bytes::from(chunk),
    }
}

#[test]
fn inconsistent_fragments_are_errors() {
    let limits = Limits {
        max_message: 100,
        max_partial_messages: 1,
        ..Limits::default()
    };
    let now = Instant::now();
    let mut re = Reassembler::new(limits);
    assert!(
        re.accept(piece(1, 1, 3, 10, 30), now).is_err(),
        "piece of an unknown message"
    );
    re.accept(piece(1, 0, 3, 12, 30), now).unwrap();
    assert!(
        re.accept(piece(2, 0, 3, 12, 30), now).is_err(),
        "too many partial messages"
    );
    assert!(
        re.accept(piece(1, 2, 3, 10, 30), now).is_err(),
        "out of order"
    );
    assert_eq!(re.in_progress(), 0, "a broken message is dropped");
    assert_eq!(re.held(), 0, "and its budget returned");
    // More bytes than the first piece's header claims.
    re.accept(piece(3, 0, 3, 40, 90), now).unwrap();
    assert!(matches!(
        re.accept(piece(3, 1, 3, 60, 0), now),
        Err(DecodeError::Fragment(_))
    ));
    // Reassembled bytes that are not a frame (a zero body is no Goodbye).
    re.accept(piece(4, 0, 2, 12, 22), now).unwrap();
    assert!(re.accept(piece(4, 1, 2, 10, 0), now).is_err());
    // A first piece without a frame header, an empty piece.
    let mut bare = piece(5, 0, 2, 10, 20);
    bare.chunk = Bytes::from(vec![0u8; 10]);
    assert!(re.accept(bare, now).is_err());
    assert!(re.accept(piece(6, 0, 2, 0, 20), now).is_err());
    assert_eq!(re.held(), 0);
}

#[test]
fn an_oversized_claim_is_refused_on_the_first_piece() {
    let limits = Limits {
        max_message: 1 << 20,
        ..Limits::default()
    };
    let mut re = Reassembler::new(limits);
    // A first piece whose inner frame claims ~4 GiB.
    let mut first = piece(1, 0, 4_000_000, 64, 64);
    first.chunk = {
        let mut c = first.chunk.to_vec();
        c[4..8].copy_from_slice(&(u32::MAX - 100).to_le_bytes());
        Bytes::from(c)
    };
    match re.accept(first, Instant::now()) {
        Err(DecodeError::TooLarge { len, max }) => {
            assert_eq!(max, 1 << 20);
            assert!(len > 1 << 31, "{len}");
        }
        other => panic!("expected TooLarge on the first piece, got {other:?}"),
    }
    assert_eq!(re.in_progress(), 0);
    // Claims on one link add up: two half-size messages fit, a third does not.
    let half = 1 << 19;
    re.accept(piece(2, 0, 2, 100, half), Instant::now())
        .unwrap();
    re.accept(piece(3, 0, 2, 100, half), Instant::now())
        .unwrap();
    assert!(matches!(
        re.accept(piece(4, 0, 2, 100, 100), Instant::now()),
        Err(DecodeError::TooLarge { .. })
    ));
}

#[test]
fn links_share_the_nodes_reassembly_budget() {
    let limits = Limits::default();
    let budget = ReassemblyBudget::new(1000);
    let mut a = Reassembler::with_budget(limits, budget.clone());
    let mut b = Reassembler::with_budget(limits, budget.clone());
    let now = Instant::now();
    a.accept(piece(1, 0, 2, 100, 600), now).unwrap();
    assert_eq!(budget.in_use(), 600);
    match b.accept(piece(1, 0, 2, 100, 600), now) {
        Err(e @ DecodeError::NoBudget { .. }) => assert_eq!(e.status(), Status::NoBuffer),
        other => panic!("expected NoBudget, got {other:?}"),
    }
    b.accept(piece(2, 0, 2, 100, 400), now).unwrap();
    assert_eq!(budget.in_use(), 1000);
    // A closed link gives its share back, a dropped one too.
    a.clear();
    assert_eq!(budget.in_use(), 400);
    drop(b);
    assert_eq!(budget.in_use(), 0);
}

#[test]
fn a_message_not_complete_in_time_fails_with_timed_out() {
    let limits = Limits {
        reassembly_timeout: Duration::from_secs(30),
        ..Limits::default()
    };
    let budget = ReassemblyBudget::new(1 << 20);
    let mut re = Reassembler::with_budget(limits, budget.clone());
    let t0 = Instant::now();
    re.accept(piece(7, 0, 3, 100, 300), t0).unwrap();
    assert!(re.check_deadline(t0 + Duration::from_secs(30)).is_ok());
    match re.check_deadline(t0 + Duration::from_secs(31)) {
        Err(e @ DecodeError::ReassemblyTimeout { message_id: 7, .. }) => {
            assert_eq!(e.status(), Status::TimedOut)
        }
        other => panic!("expected ReassemblyTimeout, got {other:?}"),
    }
    assert_eq!(budget.in_use(), 0);
    // A late piece of a message past its deadline fails too.
    re.accept(piece(8, 0, 3, 100, 300), t0).unwrap();
    assert!(matches!(
        re.accept(piece(8, 1, 3, 100, 0), t0 + Duration::from_secs(40)),
        Err(DecodeError::ReassemblyTimeout { message_id: 8, .. })
    ));
}

#[test]
fn request_with_context_has_a_stable_encoding() {
    // A golden vector for implementers in other languages (docs/wire.md).
    let frame = Frame::Request(Request {
        call_id: 1,
        service: ServiceName::new("echo").unwrap(),
        instance: 0,
        node: NodeId(2),
        budget_us: Some(1000),
        tx: Some(Box::new(TxContext::new(Tid::new(
            NodeId(1),
            Incarnation(1),
            5,
        )))),
        flags: 0,
        payload: Payload::bytes(&b"hi"[..]),
    });
    let hex: String = encode(&frame).iter().map(|b| format!("{b:02x}")).collect();
    assert_eq!(hex, GOLDEN_REQUEST.trim());
}

const GOLDEN_REQUEST: &str = include_str!("golden_request.hex");

// ---------------------------------------------------------------------------
// Varints have one encoding (docs/wire.md §2): overlong (non-minimal) and
// over-range varints in any head are DecodeError::Varint, never accepted.

/// A postcard writer for heads whose `pad`-th varint (counting from 0) is
/// written `extra` bytes longer than it needs (`0x80` continuation bytes,
/// then a final `0x00`).
struct PadWriter {
    out: Vec<u8>,
    seen: usize,
    pad: usize,
    extra: usize,
}

impl PadWriter {
    fn new(pad: usize, extra: usize) -> Self {
        PadWriter {
            out: Vec::new(),
            seen: 0,
            pad,
            extra,
        }
    }
    fn varint(&mut self, mut v: u64) {
        let mut bytes = Vec::new();
        while v >= 0x80 {
            bytes.push(v as u8 | 0x80);
            v >>= 7;
        }
        bytes.push(v as u8);
        if self.seen == self.pad && self.extra > 0 {
            *bytes.last_mut().unwrap() |= 0x80;
            bytes.extend(std::iter::repeat_n(0x80, self.extra - 1));
            bytes.push(0x00);
        }
        self.seen += 1;
        self.out.extend_from_slice(&bytes);
    }
    fn byte(&mut self, b: u8) {
        self.out.push(b);
    }
    fn bytes(&mut self, b: &[u8]) {
        self.varint(b.len() as u64);
        self.out.extend_from_slice(b);
    }
    fn tx(&mut self, tx: &TxContext) {
        self.varint(u64::from(tx.tid.node.0));
        self.varint(u64::from(tx.tid.incarnation.0));
        self.varint(tx.tid.seq);
        self.varint(tx.path.0.len() as u64);
        for &p in &tx.path.0 {
            self.varint(u64::from(p));
        }
        self.option(tx.budget_us);
        self.varint(tx.baggage.0.len() as u64);
        for item in &tx.baggage.0 {
            self.bytes(item.key.as_bytes());
            self.bytes(&item.value);
        }
    }
    fn option(&mut self, v: Option<u64>) {
        match v {
            None => self.byte(0),
            Some(v) => {
                self.byte(1);
                self.varint(v);
            }
        }
    }
}

/// A whole frame of `kind` around `body`, checksummed.
fn frame_of(kind: u8, body: &[u8]) -> BytesMut {
    let mut out = BytesMut::new();
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&[VERSION, kind]);
    out.extend_from_slice(&(body.len() as u32).to_le_bytes());
    out.extend_from_slice(&[0; 4]);
    out.extend_from_slice(body);
    let crc = crc32c::crc32c_append(crc32c::crc32c(&out[0..8]), &out[HEADER_LEN..]);
    out[8..12].copy_from_slice(&crc.to_le_bytes());
    out
}

/// The head of `r` with its `pad`-th varint padded by `extra` bytes.
fn padded_request_head(r: &Request, pad: usize, extra: usize) -> (Vec<u8>, usize) {
    let mut w = PadWriter::new(pad, extra);
    w.varint(r.call_id);
    w.bytes(r.service.as_str().as_bytes());
    w.varint(u64::from(r.instance));
    w.varint(u64::from(r.node.0));
    w.option(r.budget_us);
    match &r.tx {
        None => w.byte(0),
        Some(tx) => {
            w.byte(1);
            w.tx(tx);
        }
    }
    w.varint(u64::from(r.flags));
    (w.out, w.seen)
}

fn padded_response_head(r: &Response, pad: usize, extra: usize) -> (Vec<u8>, usize) {
    let mut w = PadWriter::new(pad, extra);
    w.varint(r.call_id);
    w.varint(u64::from(r.status.code()));
    w.bytes(r.detail.as_bytes());
    match &r.tx {
        None => w.byte(0),
        Some(tx) => {
            w.byte(1);
            w.varint(tx.baggage.0.len() as u64);
            for item in &tx.baggage.0 {
                w.bytes(item.key.as_bytes());
                w.bytes(&item.value);
            }
            w.byte(u8::from(tx.aborted));
        }
    }
    (w.out, w.seen)
}

fn arb_request() -> impl Strategy<Value = Request> {
    (
        any::<u64>(),
        arb_name(),
        any::<u32>(),
        any::<u32>(),
        any::<Option<u64>>(),
        prop::option::of(arb_txctx()),
        any::<u32>(),
    )
        .prop_map(
            |(call_id, service, instance, node, budget_us, tx, flags)| Request {
                call_id,
                service,
                instance,
                node: NodeId(node),
                budget_us,
                tx: tx.map(Box::new),
                flags,
                payload: Payload::Bytes(Bytes::new()),
            },
        )
}

fn arb_response() -> impl Strategy<Value = Response> {
    (
        any::<u64>(),
        arb_status(),
        ".{0,20}",
        prop::option::of((arb_baggage(), any::<bool>())),
    )
        .prop_map(|(call_id, status, detail, tx)| Response {
            call_id,
            status,
            detail,
            tx: tx.map(|(baggage, aborted)| Box::new(TxReturn { baggage, aborted })),
            payload: Payload::Bytes(Bytes::new()),
        })
}

fn expect_varint_error(
    bytes: BytesMut,
    want: VarintError,
    what: &str,
) -> Result<(), TestCaseError> {
    match decode_exact(bytes.freeze(), &Limits::default()) {
        Err(DecodeError::Varint { problem, .. }) => {
            prop_assert_eq!(problem, want, "{}", what);
            Ok(())
        }
        other => Err(TestCaseError::fail(format!(
            "{what}: expected a {want:?} varint error, got {other:?}"
        ))),
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn the_test_writer_without_padding_is_the_codec(r in arb_request(), s in arb_response()) {
        let (head, _) = padded_request_head(&r, usize::MAX, 0);
        let mut want = encode(&Frame::Request(r));
        prop_assert_eq!(&frame_of(4, &head)[..], &want.split_to(want.len())[..]);
        let (head, _) = padded_response_head(&s, usize::MAX, 0);
        prop_assert_eq!(&frame_of(5, &head)[..], &encode(&Frame::Response(s))[..]);
    }

    #[test]
    fn an_overlong_varint_anywhere_in_a_request_head_is_refused(
        r in arb_request(),
        pad in any::<prop::sample::Index>(),
        extra in 1usize..3,
    ) {
        let (_, count) = padded_request_head(&r, usize::MAX, 0);
        let k = pad.index(count);
        let (head, _) = padded_request_head(&r, k, extra);
        // A padded varint can exceed its type's length; then it is out of
        // range rather than overlong. Both are refused.
        match decode_exact(frame_of(4, &head).freeze(), &Limits::default()) {
            Err(DecodeError::Varint { kind: FrameKind::Request, .. }) => {}
            other => prop_assert!(false, "varint {k} of {count} padded by {extra}: {other:?}"),
        }
    }

    #[test]
    fn an_overlong_varint_anywhere_in_a_response_head_is_refused(
        r in arb_response(),
        pad in any::<prop::sample::Index>(),
        extra in 1usize..3,
    ) {
        let (_, count) = padded_response_head(&r, usize::MAX, 0);
        let k = pad.index(count);
        let (head, _) = padded_response_head(&r, k, extra);
        match decode_exact(frame_of(5, &head).freeze(), &Limits::default()) {
            Err(DecodeError::Varint { kind: FrameKind::Response, .. }) => {}
            other => prop_assert!(false, "varint {k} of {count} padded by {extra}: {other:?}"),
        }
    }

    #[test]
    fn a_small_varint_padded_by_one_byte_is_overlong(call_id in 0u64..(1 << 56), r in arb_request()) {
        // call_id leads the head; padded by one byte it still fits 10 bytes.
        let r = Request { call_id, ..r };
        let (head, _) = padded_request_head(&r, 0, 1);
        expect_varint_error(frame_of(4, &head), VarintError::Overlong, "request call id")?;
    }

    #[test]
    fn the_first_varint_of_every_other_head_padded_is_refused(frame in arb_frame()) {
        // Request and Response heads have their own tests; Auth has no varint.
        if matches!(frame, Frame::Request(_) | Frame::Response(_) | Frame::Auth(_)) {
            return Ok(());
        }
        let bytes = encode(&frame);
        let mut body = bytes[HEADER_LEN..].to_vec();
        let end = body.iter().position(|b| b & 0x80 == 0).unwrap();
        body[end] |= 0x80;
        body.insert(end + 1, 0x00);
        let bad = frame_of(bytes[3], &body);
        if end < 2 {
            // Padded, it still fits the shortest type (u16: three bytes).
            expect_varint_error(bad, VarintError::Overlong, &format!("{frame:?}"))?;
        } else {
            match decode_exact(bad.freeze(), &Limits::default()) {
                Err(DecodeError::Varint { .. }) => {}
                other => prop_assert!(false, "{:?}: {:?}", frame, other),
            }
        }
    }

    #[test]
    fn over_range_varints_are_refused(r in arb_request(), big in (1u64 << 32)..(1u64 << 35), code in (1u64 << 16)..(1u64 << 21)) {
        // `instance` is a u32: a five-byte varint above u32::MAX.
        let mut w = PadWriter::new(usize::MAX, 0);
        w.varint(r.call_id);
        w.bytes(r.service.as_str().as_bytes());
        w.varint(big);
        w.varint(u64::from(r.node.0));
        w.byte(0);
        w.byte(0);
        w.varint(0);
        expect_varint_error(frame_of(4, &w.out), VarintError::OutOfRange, "instance")?;
        // A Response's status is a u16: a three-byte varint above u16::MAX.
        let mut w = PadWriter::new(usize::MAX, 0);
        w.varint(1);
        w.varint(code);
        w.bytes(b"");
        w.byte(0);
        expect_varint_error(frame_of(5, &w.out), VarintError::OutOfRange, "status")?;
    }
}

#[test]
fn zero_and_the_edges_of_each_length_are_minimal_and_accepted() {
    for v in [
        0u64,
        1,
        127,
        128,
        16383,
        16384,
        u64::from(u32::MAX),
        u64::MAX,
    ] {
        let frame = Frame::Heartbeat(Heartbeat {
            seq: v,
            reply: false,
        });
        assert_eq!(
            decode_exact(encode(&frame).freeze(), &Limits::default()).unwrap(),
            frame
        );
    }
    // 0 as `0x80 0x00`: the shortest overlong form.
    let body = [0x80, 0x00, 0x00];
    match decode_exact(frame_of(7, &body).freeze(), &Limits::default()) {
        Err(
            e @ DecodeError::Varint {
                kind: FrameKind::Heartbeat,
                problem: VarintError::Overlong,
            },
        ) => {
            assert_eq!(e.status(), Status::ProtocolError);
        }
        other => panic!("expected an overlong varint error, got {other:?}"),
    }
}

#[test]
fn peek_kind_reads_the_kind_once_magic_and_version_are_in() {
    let mut out = BytesMut::new();
    encode_frame(&Frame::Goodbye(Goodbye { reason: "x".into() }), &mut out).unwrap();
    assert_eq!(peek_kind(&out[..3]), None, "not enough bytes");
    assert_eq!(peek_kind(&out[..4]), Some(FrameKind::Goodbye));
    assert_eq!(peek_kind(b"GET "), None, "bad magic");
    assert_eq!(peek_kind(&[b'w', b'f', 9, 1]), None, "unknown version");
    assert_eq!(peek_kind(&[b'w', b'f', 1, 200]), None, "unknown kind");
    // Before a handshake a frame may be no larger than a handshake needs.
    let limits = Limits::default().handshake();
    assert_eq!(limits.max_frame, codec::HANDSHAKE_MAX_FRAME);
    let mut big = BytesMut::new();
    encode_frame(
        &Frame::Refused(Refused {
            status: Status::Refused,
            reason: "r".repeat(2000),
        }),
        &mut big,
    )
    .unwrap();
    assert!(matches!(
        decode_frame(&mut big, &limits),
        Err(DecodeError::TooLarge { max: 1024, .. })
    ));
}
