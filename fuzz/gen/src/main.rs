//! Writes the seed corpora in `fuzz/corpus/<target>/` from real encoded values: frames from
//! the wire encoder, segments from the log's record encoder, group messages from the group
//! protocol's types. Run from the repository root:
//!
//! ```text
//! cargo run --release --manifest-path fuzz/gen/Cargo.toml
//! ```
//!
//! Seeds are named `seed-<what>`, so re-running overwrites them and leaves the files the
//! fuzzer added alone.

use std::fs;
use std::path::Path;
use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use weft_group::ids::{CommId, MemberId, SenderId, Tag};
use weft_group::msg::{Body, Change, DirAnswer, DirOp, GroupMsg, GroupRecord, Version};
use weft_group::secret::Verifier;
use weft_log::fuzzing::{encode_record, segment_header};
use weft_wire::payload::encode_postcard;
use weft_wire::{
    encode_frame_with, encode_message_with, Auth, Baggage, BaggageItem, Failure, Fragment, Frame,
    GroupId, Heartbeat, Hello, Incarnation, Integrity, Message, NodeId, Payload, PeerRole, Port,
    Refused, Request, Response, ServiceName, Status, SubPath, Tid, TxContext, TxReturn,
};

fn put(target: &str, name: &str, bytes: &[u8]) {
    let dir = Path::new("fuzz/corpus").join(target);
    fs::create_dir_all(&dir).expect("corpus dir");
    fs::write(dir.join(format!("seed-{name}")), bytes).expect("write seed");
}

fn tid() -> Tid {
    Tid::new(NodeId(3), Incarnation(2), 41)
}

fn frames() -> Vec<(&'static str, Frame)> {
    let hello = Hello {
        node: NodeId(1),
        incarnation: Incarnation(5),
        role: PeerRole::Node,
        nonce: [7; 16],
        max_frame: 1 << 20,
        max_message: 1 << 26,
    };
    let mut tx = TxContext::new(tid());
    tx.path = SubPath(vec![1, 2]);
    tx.budget_us = Some(250_000);
    tx.baggage = Baggage(vec![BaggageItem {
        key: "k".into(),
        value: Bytes::from_static(b"v"),
    }]);
    vec![
        ("hello", Frame::Hello(hello.clone())),
        (
            "hello-client",
            Frame::Hello(Hello {
                node: NodeId::CLIENT,
                role: PeerRole::Client,
                ..hello
            }),
        ),
        ("auth", Frame::Auth(Auth { proof: [9; 32] })),
        (
            "refused",
            Frame::Refused(Refused {
                status: Status::WrongSecret,
                reason: "wrong secret".into(),
            }),
        ),
        (
            "request",
            Frame::Request(Request {
                call_id: 17,
                service: ServiceName::new("kv").unwrap(),
                instance: 0,
                node: NodeId(2),
                budget_us: Some(1_000_000),
                tx: None,
                flags: 0,
                payload: Payload::bytes(&b"get key"[..]),
            }),
        ),
        (
            "request-tx",
            Frame::Request(Request {
                call_id: 1 << 40,
                service: ServiceName::new("bank").unwrap(),
                instance: 3,
                node: NodeId(9),
                budget_us: None,
                tx: Some(Box::new(tx.clone())),
                flags: 0,
                payload: Payload::bytes(vec![0u8; 40]),
            }),
        ),
        (
            "response",
            Frame::Response(Response {
                call_id: 17,
                status: Status::Ok,
                detail: String::new(),
                tx: Some(Box::new(TxReturn {
                    baggage: tx.baggage.clone(),
                    aborted: false,
                })),
                payload: Payload::bytes(&b"value"[..]),
            }),
        ),
        (
            "response-failure",
            Frame::Response(Response::failure(
                5,
                Failure::new(Status::TimedOut, "too slow"),
            )),
        ),
        (
            "message",
            Frame::Message(Message {
                port: Port::TX,
                payload: Payload::bytes(&b"vote"[..]),
            }),
        ),
        (
            "heartbeat",
            Frame::Heartbeat(Heartbeat {
                seq: 99,
                reply: true,
            }),
        ),
        (
            "goodbye",
            Frame::Goodbye(weft_wire::Goodbye {
                reason: "shutdown".into(),
            }),
        ),
        (
            "fragment",
            Frame::Fragment(Fragment {
                message_id: 4,
                index: 1,
                count: 3,
                chunk: Bytes::from_static(b"piece"),
            }),
        ),
    ]
}

fn encode(f: &Frame, integrity: Integrity) -> BytesMut {
    let mut out = BytesMut::new();
    encode_frame_with(f, integrity, &mut out).unwrap();
    out
}

fn frame_seeds() {
    let all = frames();
    for (name, f) in &all {
        // Control byte: checksummed, limits 2, whole reads.
        let mut s = vec![0b10];
        s.extend_from_slice(&encode(f, Integrity::Checksummed));
        put("frame_decode", name, &s);
        // Trusted, read 3 bytes at a time.
        let mut s = vec![0b0011_0110];
        s.extend_from_slice(&encode(f, Integrity::Trusted));
        put("frame_decode", &format!("{name}-trusted"), &s);
    }
    // A stream of every frame.
    let mut s = vec![0b0101_0011];
    for (_, f) in &all {
        s.extend_from_slice(&encode(f, Integrity::Checksummed));
    }
    put("frame_decode", "stream", &s);
    // A message fragmented into 1 KiB frames, with a heartbeat between messages.
    let big = Frame::Message(Message {
        port: Port::GROUP,
        payload: Payload::bytes(vec![0xabu8; 3000]),
    });
    for (name, ctl, integrity) in [
        ("fragmented", 0b01u8, Integrity::Checksummed),
        ("fragmented-trusted", 0b0111, Integrity::Trusted),
    ] {
        let mut out = BytesMut::new();
        encode_message_with(&big, integrity, 1024, 8192, 1, &mut out).unwrap();
        out.extend_from_slice(&encode(&all[9].1, integrity));
        encode_message_with(&big, integrity, 1024, 8192, 2, &mut out).unwrap();
        let mut s = vec![ctl];
        s.extend_from_slice(&out);
        put("frame_decode", name, &s);
    }
}

fn handshake_seeds() {
    // cfg, the subject's nonce, the peer's nonce, then operations (0-1 deliver to the
    // subject, 2 deliver to the peer, 3 a made-up frame, 4 raw bytes, 5 drop, 6 replay).
    for (name, cfg) in [
        ("acceptor", 0u8),
        ("initiator", 1),
        ("client", 0b110),
        ("wrong-secret", 0b1000),
        ("wrong-node", 0b1_0001),
    ] {
        let mut s = vec![cfg];
        s.extend_from_slice(&[0x11; 16]);
        s.extend_from_slice(&[0x22; 16]);
        s.extend_from_slice(&[0, 2, 0, 2, 0, 2, 0, 2]);
        put("handshake", name, &s);
    }
    let hello = encode(&frames()[0].1, Integrity::Trusted);
    let mut s = vec![0u8];
    s.extend_from_slice(&[0x11; 16]);
    s.extend_from_slice(&[0x22; 16]);
    s.push(4);
    s.push(hello.len() as u8);
    s.extend_from_slice(&hello);
    s.extend_from_slice(&[0, 2, 3, 3, 0, 2]);
    put("handshake", "raw-hello", &s);
}

fn ring_seeds() {
    // ring size, seed, then operations (0-1 write, 2-3 read, 4 hostile store, 5 ring 1).
    put(
        "shm_ring",
        "write-read",
        &[0, 7, 0, 200, 10, 2, 255, 255, 0, 100, 3, 50, 50],
    );
    put(
        "shm_ring",
        "wrap",
        &[
            1, 3, 0, 255, 255, 0, 255, 255, 2, 255, 255, 0, 255, 255, 0, 255, 255, 3, 255, 255, 0,
            1, 1, 2, 0, 9,
        ],
    );
    put(
        "shm_ring",
        "hostile",
        &[
            0, 1, 0, 40, 0, 4, 0, 2, 2, 10, 0, 0, 2, 255, 255, 5, 100, 100,
        ],
    );
}

fn segment(base: u64, records: &[(u16, &[u8])], zeros: usize) -> Vec<u8> {
    let mut buf = segment_header(base).to_vec();
    for (tag, p) in records {
        let at = base + buf.len() as u64;
        encode_record(&mut buf, at, *tag, p);
    }
    buf.resize(buf.len() + zeros, 0);
    buf
}

fn log_seeds() {
    let recs: Vec<(u16, &[u8])> = vec![
        (1, b"begin t1"),
        (2, b""),
        (3, &[0xee; 100]),
        (1, b"commit t1 with a longer payload"),
    ];
    let with_mode = |name: &str, mode: u8, bytes: &[u8]| {
        let mut s = vec![mode];
        s.extend_from_slice(bytes);
        put("log_scan", name, &s);
    };
    with_mode("empty", 0, &segment(0, &[], 64));
    with_mode("records", 0, &segment(0, &recs, 0));
    with_mode("records-prealloc", 0, &segment(1 << 20, &recs, 256));
    let mut torn = segment(0, &recs, 0);
    torn.truncate(torn.len() - 5);
    with_mode("torn", 0, &torn);
    let mut flipped = segment(4096, &recs, 32);
    flipped[80] ^= 0x10;
    with_mode("flipped", 0, &flipped);
    // Damage mode: the bytes are choices (base, count, records, damage).
    with_mode(
        "damage",
        1,
        &[
            3, 0, 0, 0, 0, 0, 3, 1, 0, 5, b'h', b'e', b'l', b'l', b'o', 2, 0, 0, 8, 0, 40, 7, 1,
        ],
    );
}

fn group_seeds() {
    let gid = GroupId::named("raid", "site-1").unwrap();
    let sender = SenderId {
        node: NodeId(1),
        incarnation: Incarnation(2),
        id: 3,
    };
    let comm = CommId { sender, session: 4 };
    let verifier = Verifier::with_salt(b"secret", [5; 16]);
    let record = GroupRecord {
        gid: gid.clone(),
        verifier: verifier.clone(),
        hosts: vec![NodeId(1), NodeId(2)],
        version: Version {
            epoch: Incarnation(1),
            counter: 9,
        },
    };
    let body = || Body::Payload(Payload::bytes(&b"message body"[..]));
    let msgs: Vec<(&str, GroupMsg)> = vec![
        (
            "dir-create",
            GroupMsg::DirRequest {
                req: 1,
                op: DirOp::Create {
                    gid: gid.clone(),
                    verifier: verifier.clone(),
                },
            },
        ),
        (
            "dir-host",
            GroupMsg::DirRequest {
                req: 2,
                op: DirOp::Host {
                    gid: gid.clone(),
                    present: true,
                    seq: (2 << 32) | 1,
                    key: Some(verifier.key_for(b"secret")),
                },
            },
        ),
        (
            "dir-sync",
            GroupMsg::DirRequest {
                req: 3,
                op: DirOp::Sync {
                    hosting: vec![(gid.clone(), 5)],
                    seq: 5,
                    known: vec![record.clone()],
                },
            },
        ),
        (
            "dir-reply",
            GroupMsg::DirReply {
                req: 3,
                result: Ok(DirAnswer::Snapshot {
                    records: vec![record.clone()],
                    at: record.version,
                }),
            },
        ),
        (
            "dir-reply-err",
            GroupMsg::DirReply {
                req: 4,
                result: Err(Failure::new(Status::Refused, "exists")),
            },
        ),
        (
            "push",
            GroupMsg::Push {
                push: 6,
                changes: vec![
                    Change::Upsert(record.clone()),
                    Change::Remove {
                        gid: gid.clone(),
                        version: record.version,
                    },
                ],
            },
        ),
        (
            "deliver",
            GroupMsg::Deliver {
                comm,
                gid: Arc::new(gid.clone()),
                tag: Tag(7),
                body: body(),
            },
        ),
        (
            "ack",
            GroupMsg::Ack {
                comm,
                counts: vec![(NodeId(2), 3)],
                full: 1,
                lost: vec![(NodeId(4), Status::HostDead)],
            },
        ),
        (
            "reply",
            GroupMsg::Reply {
                reply: 8,
                comm,
                member: MemberId {
                    node: NodeId(2),
                    id: 1,
                },
                body: Body::Elided,
            },
        ),
        (
            "tx-deliver",
            GroupMsg::TxDeliver {
                comm,
                tid: tid(),
                tag: Tag(1),
                body: body(),
                root: true,
                budget_ms: 5000,
            },
        ),
        (
            "batch",
            GroupMsg::Batch(vec![
                GroupMsg::PushAck { push: 6 },
                GroupMsg::Terminate { comms: vec![comm] },
                GroupMsg::Probe { comms: vec![comm] },
                GroupMsg::Resync,
            ]),
        ),
        (
            "tx-ack",
            GroupMsg::TxAck {
                comm,
                delivered: vec![NodeId(1), NodeId(5)],
                full: 0,
                lost: vec![],
            },
        ),
    ];
    for (name, m) in msgs {
        let mut out = BytesMut::new();
        encode_postcard(&m, &mut out).unwrap();
        put("group_msg", name, &out);
    }
}

fn main() {
    frame_seeds();
    handshake_seeds();
    ring_seeds();
    log_seeds();
    group_seeds();
    println!("seeds written under fuzz/corpus/");
}
