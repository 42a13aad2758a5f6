//! OpenTelemetry: the spans of one transaction, on every node it touches,
//! form one trace (the rpc layer's `otel` feature, on for tests), and two
//! transactions form two traces. Spans are collected by an in-memory
//! exporter.

mod common;

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use common::*;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
use tracing::Level;
use tracing_subscriber::filter::Targets;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::Layer;
use weft::kv::{Kv, KvConfig, KvRequest, KvResponse, Op};
use weft::{Address, Transaction};

fn attr(span: &SpanData, key: &str) -> Option<String> {
    span.attributes
        .iter()
        .find(|kv| kv.key.as_str() == key)
        .map(|kv| kv.value.as_str().into_owned())
}

async fn put(tx: &Transaction, node: u32, key: &str) {
    let at: Address = format!("kv@{node}").parse().unwrap();
    tx.call::<_, KvResponse>(
        &at,
        KvRequest(vec![Op::Put(
            Bytes::copy_from_slice(key.as_bytes()),
            Bytes::from_static(b"v"),
        )]),
    )
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_spans_of_a_three_node_transaction_share_one_trace() {
    let exporter = InMemorySpanExporter::default();
    let provider = SdkTracerProvider::builder()
        .with_simple_exporter(exporter.clone())
        .build();
    let layer = tracing_opentelemetry::layer()
        .with_tracer(provider.tracer("weft-test"))
        .with_filter(
            Targets::new()
                .with_target("weft_rpc", Level::DEBUG)
                .with_target("weft_tx", Level::DEBUG),
        );
    tracing::subscriber::set_global_default(tracing_subscriber::registry().with(layer))
        .expect("the only subscriber of this test binary");

    let stores: Vec<Kv> = (0..3).map(|_| Kv::new(KvConfig::default())).collect();
    let s2 = stores.clone();
    let c = Cluster::start_with(3, 77, move |id, b| {
        b.plugin(Arc::new(s2[(id - 1) as usize].clone()))
    })
    .await;
    let mut tids = Vec::new();
    for round in 0..2 {
        let tx = c.node(1).begin();
        tids.push(tx.tid().to_string());
        put(&tx, 2, &format!("a{round}")).await;
        put(&tx, 3, &format!("b{round}")).await;
        tx.commit().await.unwrap();
    }
    // A serve span ends as its response leaves, a participant's outcome span
    // after the commit returned: wait for both nodes' spans of both
    // transactions.
    let spans_of = |tid: &str| -> Vec<SpanData> {
        let _ = provider.force_flush();
        exporter
            .get_finished_spans()
            .unwrap()
            .into_iter()
            .filter(|s| attr(s, "tid").as_deref() == Some(tid))
            .collect()
    };
    wait_for("every node's spans", Duration::from_secs(20), || {
        tids.iter().all(|t| {
            let spans = spans_of(t);
            ["serve", "tx.prepare", "tx.outcome"].iter().all(|name| {
                let nodes: HashSet<String> = spans
                    .iter()
                    .filter(|s| s.name == *name)
                    .filter_map(|s| attr(s, "node"))
                    .collect();
                nodes.contains("2") && nodes.contains("3")
            })
        })
    })
    .await;

    let mut traces = Vec::new();
    for tid in &tids {
        let spans = spans_of(tid);
        let names: Vec<(String, Option<String>)> = spans
            .iter()
            .map(|s| (s.name.to_string(), attr(s, "node")))
            .collect();
        let ids: HashSet<_> = spans.iter().map(|s| s.span_context.trace_id()).collect();
        assert_eq!(
            ids.len(),
            1,
            "{tid}: spans in {} traces: {names:?}",
            ids.len()
        );
        // Calls on node 1, serves on nodes 2 and 3, the commit, the
        // participants' prepare and outcome: all there, in the one trace.
        for want in [
            "call",
            "serve",
            "tx.commit",
            "commit",
            "tx.prepare",
            "tx.outcome",
        ] {
            assert!(
                names.iter().any(|(n, _)| n == want),
                "{tid}: no {want}: {names:?}"
            );
        }
        // Each serve is the child of the call that caused it.
        let by_id: HashMap<_, _> = spans
            .iter()
            .map(|s| (s.span_context.span_id(), s.name.to_string()))
            .collect();
        for serve in spans.iter().filter(|s| s.name == "serve") {
            assert_eq!(
                by_id.get(&serve.parent_span_id).map(String::as_str),
                Some("call"),
                "{tid}: a serve span's parent is not a call span"
            );
        }
        // A participant's prepare and outcome spans are children of the
        // coordinator's `commit` span (the Prepare carried it), which is the
        // child of the application's `tx.commit`.
        let commit = spans
            .iter()
            .find(|s| s.name == "commit")
            .expect("the coordinator's commit span");
        assert_eq!(attr(commit, "tid").as_deref(), Some(tid.as_str()));
        assert_eq!(
            by_id.get(&commit.parent_span_id).map(String::as_str),
            Some("tx.commit"),
            "{tid}: the commit span's parent is not tx.commit"
        );
        for node in ["2", "3"] {
            for name in ["tx.prepare", "tx.outcome"] {
                let mine: Vec<_> = spans
                    .iter()
                    .filter(|s| s.name == name && attr(s, "node").as_deref() == Some(node))
                    .collect();
                assert_eq!(
                    mine.len(),
                    1,
                    "{tid}: node {node}'s {name} spans: {names:?}"
                );
                assert_eq!(
                    mine[0].parent_span_id,
                    commit.span_context.span_id(),
                    "{tid}: node {node}'s {name} is not a child of the coordinator's commit"
                );
            }
            let outcome = spans
                .iter()
                .find(|s| s.name == "tx.outcome" && attr(s, "node").as_deref() == Some(node))
                .unwrap();
            assert_eq!(attr(outcome, "outcome").as_deref(), Some("commit"));
        }
        traces.push(*ids.iter().next().unwrap());
    }
    assert_ne!(traces[0], traces[1], "two transactions share one trace");
}
