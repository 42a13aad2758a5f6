//! The built-in services as a hostile authenticated client uses them: every
//! bad request ends with a precise status, never a panic, a hang or
//! unbounded memory (issue 16). RPC dispatch, `kv` and `_status`/`_tx`.

mod common;

use std::time::{Duration, Instant};

use common::*;
use futures::future::BoxFuture;
use weft::{Address, Failure, Payload, ServiceOptions, Status};

fn addr(s: &str) -> Address {
    s.parse().unwrap()
}

/// A call with a deadline far enough away that reaching it means a hang.
async fn call_raw(c: &Cluster, from: u32, to: &str, payload: Payload) -> Result<Payload, Failure> {
    c.node(from)
        .rpc()
        .call_payload(
            None,
            &addr(to),
            payload,
            Some(Instant::now() + Duration::from_secs(30)),
        )
        .await
}

/// Registers `boom` (panics as soon as it is polled), `boom_later` (panics
/// after it had to wait) and `boom_sync` (a raw handler that panics before
/// it returns a future) on every node.
fn install_panickers(c: &Cluster) {
    for node in &c.nodes {
        node.register(
            "boom",
            ServiceOptions::no_state(),
            |_ctx, n: u32| async move {
                if n > 0 {
                    panic!("boom {n}");
                }
                Ok(n)
            },
        )
        .unwrap();
        node.register(
            "boom_later",
            ServiceOptions::no_state(),
            |_ctx, n: u32| async move {
                tokio::time::sleep(Duration::from_millis(5)).await;
                if n > 0 {
                    panic!("boom later {n}");
                }
                Ok(n)
            },
        )
        .unwrap();
        node.rpc()
            .register_raw(
                "boom_sync",
                ServiceOptions::no_state(),
                |_ctx, _p: Payload| -> BoxFuture<'static, Result<Payload, Failure>> {
                    panic!("boom before the future")
                },
            )
            .unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_handler_answers_internal_and_the_node_stays_up() {
    let c = Cluster::start(2, 1601).await;
    install_panickers(&c);
    for to in [
        "boom@2",
        "boom@1",
        "boom_later@2",
        "boom_later@1",
        "boom_sync@2",
        "boom_sync@1",
    ] {
        for round in 0..3 {
            let err = call_raw(&c, 1, to, Payload::local(7u32)).await.unwrap_err();
            assert_eq!(err.status, Status::Internal, "{to} round {round}: {err}");
            assert!(err.detail.contains("panicked"), "{to}: {err}");
        }
    }
    // Within a transaction too, and the transaction can still end.
    let tx = c.node(1).begin();
    let err = tx.call::<_, u32>(&addr("boom@2"), 3u32).await.unwrap_err();
    assert_eq!(err.status, Status::Internal, "{err}");
    let _ = tx.abort("a handler panicked").await;
    // The links and both nodes still serve.
    for to in ["boom@2", "boom@1", "boom_later@2"] {
        let n: u32 = c.node(1).call(&addr(to), 0u32).await.unwrap();
        assert_eq!(n, 0);
    }
    let n: u32 = c.node(2).call(&addr("boom@1"), 0u32).await.unwrap();
    assert_eq!(n, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn undecodable_payloads_and_unknown_services_get_their_status() {
    let c = Cluster::start(2, 1602).await;
    for svc in ["kv@2", "_status@2", "_tx@2", "_group@2"] {
        for bytes in [
            vec![],
            vec![0xff; 3],
            vec![0x80; 40],
            vec![0x05, 0x01],
            vec![0u8; 4096],
        ] {
            match call_raw(&c, 1, svc, Payload::bytes(bytes.clone())).await {
                // `()` decodes from nothing and `_status` takes `()`.
                Ok(_) if svc == "_status@2" && bytes.is_empty() => {}
                Err(f) if f.status == Status::BadRequest || f.status == Status::NoSuchService => {}
                other => panic!("{svc} with {bytes:?}: {other:?}"),
            }
        }
    }
    let err = call_raw(&c, 1, "nosuch.7@2", Payload::empty())
        .await
        .unwrap_err();
    assert_eq!(err.status, Status::NoSuchService, "{err}");
}
