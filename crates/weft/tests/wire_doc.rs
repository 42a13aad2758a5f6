//! docs/wire.md's byte examples of the built-in services (`_tx`, `_status`,
//! `kv`) are checked against the real encoder, so the spec a second
//! implementation is written from cannot drift from the code.
//!
//! Every table row of docs/wire.md whose first cell is `` `ex:<name>` ``
//! carries, in its last cell, the hex bytes (or `(none)` for zero bytes) of the
//! value named `<name>` below. A row without a value here, or a value without a
//! row, fails the test too.

use std::collections::BTreeMap;

use bytes::{Bytes, BytesMut};
use weft::admin::{StatusReport, TxReply, TxRequest};
use weft::kv::{KvRequest, KvResponse, Op, Reply};
use weft_log::LogStats;
use weft_rpc::ServiceInfo;
use weft_transport::{ChannelKind, ClusterView, NodeInfo, NodeStatus, StatsSnapshot};
use weft_tx::{ParticipationClass, RecoveryReport, TmStats, TxStatus};
use weft_wire::payload::encode_postcard;
use weft_wire::{
    encode_frame, Baggage, BaggageItem, Frame, Incarnation, NodeId, Payload, Request, Response,
    ServiceName, Status, Tid, TxContext,
};

fn b(s: &str) -> Bytes {
    Bytes::copy_from_slice(s.as_bytes())
}

fn tid(node: u32, inc: u32, seq: u64) -> Tid {
    Tid::new(NodeId(node), Incarnation(inc), seq)
}

fn pc<T: serde::Serialize>(v: &T) -> Vec<u8> {
    let mut out = BytesMut::new();
    encode_postcard(v, &mut out).expect("encodes");
    out.to_vec()
}

fn frame(f: &Frame) -> Vec<u8> {
    let mut out = BytesMut::new();
    encode_frame(f, &mut out).expect("encodes");
    out.to_vec()
}

fn tx_status() -> TxStatus {
    TxStatus {
        tid: tid(1, 1, 5),
        coordinator: true,
        phase: "active".into(),
        in_doubt: false,
        parent: None,
        children: vec![NodeId(2)],
        resources: vec!["kv".into()],
        active_calls: 0,
        age_ms: 12,
    }
}

fn status_report() -> StatusReport {
    StatusReport {
        node: NodeId(2),
        incarnation: Incarnation(3),
        view: ClusterView {
            node: NodeId(2),
            directory: Some(NodeId(1)),
            nodes: vec![NodeStatus {
                info: NodeInfo {
                    id: NodeId(1),
                    incarnation: Incarnation(1),
                    addr: Some("10.0.0.1:7001".into()),
                    host: "h1".into(),
                    hub: None,
                    shm: None,
                    pid: 300,
                    services: vec!["kv".into()],
                    directory: true,
                },
                alive: true,
                cause: None,
                channel: Some(ChannelKind::Tcp),
                route: None,
            }],
        },
        services: vec![ServiceInfo {
            name: "kv".into(),
            instance: 0,
            class: ParticipationClass::TwoPhase,
        }],
        tm: TmStats {
            begun: 1,
            committed: 1,
            ..TmStats::default()
        },
        live_transactions: 0,
        log: LogStats {
            appends: 2,
            syncs: 1,
            ..LogStats::default()
        },
        transport: StatsSnapshot {
            requests: 4,
            responses: 4,
            ..StatsSnapshot::default()
        },
        refusals: vec![],
        recovery: RecoveryReport::default(),
        data_dir: "/d".into(),
    }
}

/// Every example of the doc, by name.
fn examples() -> BTreeMap<&'static str, Vec<u8>> {
    let mut m = BTreeMap::new();
    let mut add = |name: &'static str, bytes: Vec<u8>| {
        assert!(m.insert(name, bytes).is_none(), "{name} twice");
    };
    // _tx
    add(
        "tx-begin",
        pc(&TxRequest::Begin {
            timeout_ms: Some(5000),
        }),
    );
    add(
        "tx-begin-default",
        pc(&TxRequest::Begin { timeout_ms: None }),
    );
    add("tx-commit", pc(&TxRequest::Commit(tid(1, 1, 5))));
    add(
        "tx-abort",
        pc(&TxRequest::Abort(tid(1, 1, 5), "bye".into())),
    );
    add("tx-status", pc(&TxRequest::Status(tid(3, 2, 1042))));
    add("tx-list", pc(&TxRequest::List));
    let mut ctx = TxContext::new(tid(2, 1, 7));
    ctx.budget_us = Some(5_000_000);
    add("tx-begun", pc(&TxReply::Begun(ctx)));
    add("tx-done", pc(&TxReply::Done));
    add(
        "tx-status-live",
        pc(&TxReply::Status {
            live: Some(tx_status()),
            outcome: None,
        }),
    );
    add(
        "tx-status-ended",
        pc(&TxReply::Status {
            live: None,
            outcome: Some("committed".into()),
        }),
    );
    add("tx-list-reply", pc(&TxReply::List(vec![tx_status()])));
    // _status
    add("status-request", pc(&()));
    add("status-reply", pc(&status_report()));
    // kv
    add("kv-get", pc(&KvRequest(vec![Op::Get(b("k"))])));
    add("kv-put", pc(&KvRequest(vec![Op::Put(b("k"), b("v"))])));
    add("kv-delete", pc(&KvRequest(vec![Op::Delete(b("k"))])));
    add("kv-add", pc(&KvRequest(vec![Op::Add(b("n"), -2)])));
    add(
        "kv-scan",
        pc(&KvRequest(vec![Op::Scan {
            start: b("a"),
            end: b(""),
            limit: 100,
        }])),
    );
    add(
        "kv-two-ops",
        pc(&KvRequest(vec![Op::Put(b("a"), b("1")), Op::Get(b("b"))])),
    );
    add(
        "kv-value",
        pc(&KvResponse(vec![Reply::Value(Some(b("v")))])),
    );
    add("kv-absent", pc(&KvResponse(vec![Reply::Value(None)])));
    add("kv-done", pc(&KvResponse(vec![Reply::Done])));
    add("kv-number", pc(&KvResponse(vec![Reply::Number(300)])));
    add(
        "kv-rows",
        pc(&KvResponse(vec![Reply::Rows(vec![
            (b("a"), b("1")),
            (b("b"), b("2")),
        ])])),
    );
    add(
        "kv-two-replies",
        pc(&KvResponse(vec![Reply::Done, Reply::Value(None)])),
    );
    // Whole frames: a kv call inside a transaction and its answer.
    let mut ctx = TxContext::new(tid(1, 1, 5));
    ctx.budget_us = Some(1000);
    ctx.baggage = Baggage(vec![BaggageItem {
        key: "a".into(),
        value: Bytes::from_static(&[7]),
    }]);
    add(
        "frame-kv-request",
        frame(&Frame::Request(Request {
            call_id: 9,
            service: ServiceName::new("kv").unwrap(),
            instance: 0,
            node: NodeId(2),
            budget_us: Some(1000),
            tx: Some(Box::new(ctx)),
            flags: 0,
            payload: Payload::local(KvRequest(vec![Op::Get(b("k"))])),
        })),
    );
    add(
        "frame-kv-response",
        frame(&Frame::Response(Response {
            call_id: 9,
            status: Status::Ok,
            detail: String::new(),
            tx: Some(Box::default()),
            payload: Payload::local(KvResponse(vec![Reply::Value(Some(b("v")))])),
        })),
    );
    add(
        "frame-kv-conflict",
        frame(&Frame::Response(Response::failure(
            9,
            weft_wire::Failure::new(Status::LockConflict, "busy"),
        ))),
    );
    m
}

/// The `ex:` rows of docs/wire.md: name → hex cell.
fn doc_rows() -> BTreeMap<String, String> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/wire.md");
    let text = std::fs::read_to_string(path).expect("docs/wire.md");
    let mut rows = BTreeMap::new();
    for (i, line) in text.lines().enumerate() {
        let Some(rest) = line.strip_prefix("| `ex:") else {
            continue;
        };
        let name = rest.split('`').next().unwrap().to_string();
        let cells: Vec<&str> = line.trim_end_matches('|').split('|').collect();
        let hex = cells.last().unwrap().trim().trim_matches('`').to_string();
        assert!(
            rows.insert(name.clone(), hex).is_none(),
            "docs/wire.md line {}: ex:{name} twice",
            i + 1
        );
    }
    rows
}

fn hex(bytes: &[u8]) -> String {
    if bytes.is_empty() {
        return "(none)".into();
    }
    bytes
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(" ")
}

#[test]
fn the_built_in_service_examples_in_wire_md_are_what_the_encoder_writes() {
    let want = examples();
    let doc = doc_rows();
    let mut wrong = Vec::new();
    for (name, bytes) in &want {
        match doc.get(*name) {
            None => wrong.push(format!("ex:{name} is missing; it is `{}`", hex(bytes))),
            Some(h) if *h != hex(bytes) => wrong.push(format!(
                "ex:{name}: the doc says `{h}`, the encoder `{}`",
                hex(bytes)
            )),
            Some(_) => {}
        }
    }
    for name in doc.keys() {
        if !want.contains_key(name.as_str()) {
            wrong.push(format!("ex:{name} in the doc has no value in this test"));
        }
    }
    assert!(
        wrong.is_empty(),
        "docs/wire.md drifted:\n{}",
        wrong.join("\n")
    );
}

/// The examples decode back to their values through the same types a
/// server uses (so the doc's bytes are accepted, not just produced).
#[test]
fn the_request_examples_decode() {
    let ex = examples();
    let decode = |name: &str| Payload::Bytes(Bytes::from(ex[name].clone()));
    assert!(matches!(
        decode("tx-begin").decode::<TxRequest>().unwrap(),
        TxRequest::Begin {
            timeout_ms: Some(5000)
        }
    ));
    assert_eq!(
        decode("kv-add").decode::<KvRequest>().unwrap(),
        KvRequest(vec![Op::Add(b("n"), -2)])
    );
    decode("status-request").decode::<()>().unwrap();
}
