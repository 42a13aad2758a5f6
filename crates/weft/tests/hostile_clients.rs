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
                // Pending once: the panic comes at a later poll, from the
                // task the handler was spawned into.
                tokio::task::yield_now().await;
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
    // A whole request with a byte after it, and one cut short, are refused.
    // `_tx`'s TxRequest::List is `04`; Commit(t1.1.5) is `01 01 01 05`.
    for bytes in [vec![0x04, 0x00], vec![0x01, 0x01, 0x01]] {
        let err = call_raw(&c, 1, "_tx@2", Payload::bytes(bytes.clone()))
            .await
            .unwrap_err();
        assert_eq!(err.status, Status::BadRequest, "{bytes:?}: {err}");
    }
    let err = call_raw(&c, 1, "nosuch.7@2", Payload::empty())
        .await
        .unwrap_err();
    assert_eq!(err.status, Status::NoSuchService, "{err}");
}

// ---------------------------------------------------------------- kv ----

use std::sync::Arc;

use bytes::Bytes;
use weft::kv::{Kv, KvConfig, KvLimits, KvRequest, KvResponse, Op, Reply};
use weft::{NodeId, Tid, Transaction, TxContext};

fn b(s: &str) -> Bytes {
    Bytes::copy_from_slice(s.as_bytes())
}

async fn kv(tx: &Transaction, node: u32, ops: Vec<Op>) -> Result<Vec<Reply>, Failure> {
    tx.call::<_, KvResponse>(&addr(&format!("kv@{node}")), KvRequest(ops))
        .await
        .map(|r| r.0)
}

/// Two nodes each with a KV store limited by `limits`.
async fn kv_pair(seed: u64, limits: KvLimits) -> (Cluster, Vec<Kv>) {
    let stores: Vec<Kv> = (0..2)
        .map(|_| {
            Kv::new(KvConfig {
                lock_wait: Duration::from_millis(200),
                limits,
                ..KvConfig::default()
            })
        })
        .collect();
    let s2 = stores.clone();
    let c = Cluster::start_with(2, seed, move |id, b| {
        b.plugin(Arc::new(s2[(id - 1) as usize].clone()))
    })
    .await;
    (c, stores)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_refuses_oversized_keys_and_values_with_too_large() {
    let (c, stores) = kv_pair(1603, KvLimits::default()).await;
    let limits = KvLimits::default();
    let big_key = Bytes::from(vec![b'k'; limits.max_key_bytes + 1]);
    let big_value = Bytes::from(vec![0u8; limits.max_value_bytes + 1]);
    let ok_key = Bytes::from(vec![b'k'; limits.max_key_bytes]);
    for ops in [
        vec![Op::Put(big_key.clone(), b("v"))],
        vec![Op::Get(big_key.clone())],
        vec![Op::Delete(big_key.clone())],
        vec![Op::Add(big_key.clone(), 1)],
        vec![Op::Put(b("k"), big_value.clone())],
        vec![Op::Scan {
            start: big_key.clone(),
            end: Bytes::new(),
            limit: 1,
        }],
    ] {
        let tx = c.node(1).begin();
        let err = kv(&tx, 2, ops.clone()).await.unwrap_err();
        assert_eq!(err.status, Status::TooLarge, "{err}");
        let _ = tx.abort("refused").await;
    }
    // Exactly at the limit is fine.
    let tx = c.node(1).begin();
    kv(&tx, 2, vec![Op::Put(ok_key.clone(), b("v"))])
        .await
        .unwrap();
    tx.commit().await.unwrap();
    wait_for("node 2 applies the commit", Duration::from_secs(5), || {
        stores[1].committed(&ok_key) == Some(b("v"))
    })
    .await;
    // A scan may not ask for more rows than the store answers at once.
    let tx = c.node(1).begin();
    let err = kv(
        &tx,
        2,
        vec![Op::Scan {
            start: Bytes::new(),
            end: Bytes::new(),
            limit: u32::MAX,
        }],
    )
    .await
    .unwrap_err();
    assert_eq!(err.status, Status::BadRequest, "{err}");
    let _ = tx.abort("refused").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transactions_write_set_at_a_node_is_bounded_and_released_on_abort() {
    let limits = KvLimits {
        max_writes: 100,
        max_write_bytes: 4000,
        ..KvLimits::default()
    };
    let (c, stores) = kv_pair(1604, limits).await;
    // Too many keys, across several calls of one transaction.
    let tx = c.node(1).begin();
    for i in 0..10 {
        let ops = (0..10)
            .map(|j| Op::Put(b(&format!("k{i}.{j}")), b("v")))
            .collect();
        kv(&tx, 2, ops).await.unwrap();
    }
    // Overwriting a key already written costs nothing more.
    kv(&tx, 2, vec![Op::Put(b("k0.0"), b("w"))]).await.unwrap();
    let err = kv(&tx, 2, vec![Op::Put(b("one-more"), b("v"))])
        .await
        .unwrap_err();
    assert_eq!(err.status, Status::TooLarge, "{err}");
    assert!(err.detail.contains("100"), "{err}");
    tx.abort("too large").await.unwrap();
    wait_for("node 2 releases the locks", Duration::from_secs(5), || {
        stores[1].locked_keys() == 0
    })
    .await;
    // Too many bytes.
    let tx = c.node(1).begin();
    let err = kv(
        &tx,
        2,
        (0..5)
            .map(|i| Op::Put(b(&format!("b{i}")), Bytes::from(vec![1u8; 1000])))
            .collect(),
    )
    .await
    .unwrap_err();
    assert_eq!(err.status, Status::TooLarge, "{err}");
    assert!(err.detail.contains("4000"), "{err}");
    tx.abort("too large").await.unwrap();
    // The node still takes a transaction within the bounds.
    let tx = c.node(1).begin();
    kv(&tx, 2, vec![Op::Put(b("x"), b("1"))]).await.unwrap();
    tx.commit().await.unwrap();
    wait_for("node 2 applies the commit", Duration::from_secs(5), || {
        stores[1].committed(b"x") == Some(b("1"))
    })
    .await;
    assert_eq!(stores[1].committed(b"k0.0"), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_lock_table_answers_no_buffer() {
    let limits = KvLimits {
        max_locked_keys: 50,
        ..KvLimits::default()
    };
    let (c, stores) = kv_pair(1605, limits).await;
    let tx = c.node(1).begin();
    let ops = (0..50).map(|i| Op::Get(b(&format!("r{i}")))).collect();
    kv(&tx, 2, ops).await.unwrap();
    let err = kv(&tx, 2, vec![Op::Get(b("r50"))]).await.unwrap_err();
    assert_eq!(err.status, Status::NoBuffer, "{err}");
    tx.abort("full").await.unwrap();
    wait_for("node 2 releases the locks", Duration::from_secs(5), || {
        stores[1].locked_keys() == 0
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_under_a_prepared_writer_waits_its_bound_then_conflicts() {
    let (c, stores) = kv_pair(1606, KvLimits::default()).await;
    let node = c.node(2);
    let writer = node.begin();
    node.tm()
        .enlist(writer.tid(), stores[1].resource())
        .unwrap();
    stores[1]
        .execute(
            &writer.context().xid(),
            vec![Op::Put(b("p"), b("new"))],
            None,
        )
        .await
        .unwrap();
    let vote = stores[1].resource().prepare(writer.tid(), node.log()).await;
    assert!(matches!(vote, weft::Vote::Yes { .. }), "{vote:?}");
    for from in [1, 2] {
        let reader = c.node(from).begin();
        let err = kv(&reader, 2, vec![Op::Get(b("p"))]).await.unwrap_err();
        assert_eq!(err.status, Status::LockConflict, "{err}");
        let _ = reader.abort("conflict").await;
    }
    // Without a transaction too.
    let err = c
        .node(1)
        .call::<_, KvResponse>(&addr("kv@2"), KvRequest(vec![Op::Get(b("p"))]))
        .await
        .unwrap_err();
    assert_eq!(err.status, Status::LockConflict, "{err}");
    stores[1].resource().abort(writer.tid()).await;
    let _ = writer.abort("done").await;
    assert_eq!(stores[1].committed(b"p"), None);
    assert_eq!(stores[1].locked_keys(), 0);
}

/// Sends a `kv` request carrying `ctx` straight through node `from`'s
/// endpoint, as a client that forged or replayed a context would; returns
/// the answer's status and detail.
async fn kv_with_context(
    c: &Cluster,
    from: u32,
    to: u32,
    ctx: TxContext,
    ops: Vec<Op>,
) -> (Status, String) {
    let request = weft_wire::Request {
        call_id: 0,
        service: weft_wire::ServiceName::new("kv").unwrap(),
        instance: 0,
        node: NodeId(to),
        budget_us: Some(5_000_000),
        tx: Some(Box::new(ctx)),
        flags: 0,
        payload: Payload::local(KvRequest(ops)),
    };
    let resp = c
        .node(from)
        .endpoint()
        .call(
            NodeId(to),
            request,
            Some(Instant::now() + Duration::from_secs(30)),
        )
        .await
        .unwrap();
    (resp.status, resp.detail)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_naming_a_finished_or_foreign_transaction_leave_no_locks() {
    let (c, stores) = kv_pair(1607, KvLimits::default()).await;
    // A transaction that wrote at node 2 and committed.
    let tx = c.node(1).begin();
    let ctx = tx.context().clone();
    kv(&tx, 2, vec![Op::Put(b("a"), b("1"))]).await.unwrap();
    tx.commit().await.unwrap();
    wait_for("node 2 applies the commit", Duration::from_secs(5), || {
        stores[1].committed(b"a") == Some(b("1"))
    })
    .await;
    let (status, detail) =
        kv_with_context(&c, 1, 2, ctx.clone(), vec![Op::Put(b("a"), b("2"))]).await;
    assert_eq!(status, Status::Aborted, "{detail}");
    // One that ended at node 1 without ever reaching node 2.
    let tx = c.node(1).begin();
    let ctx = tx.context().clone();
    tx.abort("gone").await.unwrap();
    // Node 2 cannot tell it from a live one it has not heard of yet: it
    // serves it, and its orphan check learns the abort from node 1.
    let (status, detail) = kv_with_context(&c, 1, 2, ctx, vec![Op::Put(b("b"), b("2"))]).await;
    eprintln!("a finished transaction unknown at node 2: {status} {detail}");
    // One named after node 2 itself that node 2 never began.
    let forged = TxContext {
        tid: Tid {
            node: NodeId(2),
            incarnation: c.node(2).incarnation(),
            seq: 999_999,
        },
        ..ctx_of(&c)
    };
    let (status, detail) = kv_with_context(&c, 1, 2, forged, vec![Op::Put(b("c"), b("2"))]).await;
    assert_eq!(status, Status::NoSuchTransaction, "{detail}");
    wait_for(
        "node 2 holds no locks and no live branch",
        Duration::from_secs(10),
        || stores[1].locked_keys() == 0 && c.node(2).tm().list().is_empty(),
    )
    .await;
    assert_eq!(stores[1].committed(b"a"), Some(b("1")));
    assert_eq!(stores[1].committed(b"b"), None);
}

fn ctx_of(c: &Cluster) -> TxContext {
    let tx = c.node(1).begin();
    let ctx = tx.context().clone();
    drop(tx);
    ctx
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_still_running_when_its_transaction_aborts_leaves_no_lock_or_write() {
    let (c, stores) = kv_pair(1608, KvLimits::default()).await;
    // A service of node 2 that writes to its store once let go: a kv
    // request still working through its operations when the abort comes.
    let gate = Arc::new(tokio::sync::Notify::new());
    let (kv2, g) = (stores[1].clone(), gate.clone());
    c.node(2)
        .register(
            "slow_put",
            ServiceOptions::with_participant(kv2.resource()),
            move |ctx, key: String| {
                let (kv, g) = (kv2.clone(), g.clone());
                async move {
                    g.notified().await;
                    let xid = ctx.tx().expect("called in a transaction").xid();
                    kv.execute(&xid, vec![Op::Put(b(&key), b("late"))], ctx.deadline())
                        .await?;
                    Ok(())
                }
            },
        )
        .unwrap();
    let tx = c.node(1).begin();
    let (tid, ctx) = (tx.tid(), tx.context().clone());
    let rpc = c.node(1).rpc().clone();
    let call = tokio::spawn(async move {
        rpc.call_payload(
            Some(&ctx),
            &addr("slow_put@2"),
            Payload::local("late".to_string()),
            None,
        )
        .await
    });
    wait_for("node 2 runs the call", Duration::from_secs(5), || {
        c.node(2)
            .tm()
            .status(tid)
            .is_some_and(|s| s.active_calls == 1)
    })
    .await;
    tx.abort("the client gave up").await.unwrap();
    wait_for("node 2 aborts", Duration::from_secs(5), || {
        c.node(2).tm().status(tid).is_none_or(|s| s.phase == "done")
    })
    .await;
    gate.notify_one();
    let _ = call.await.unwrap();
    wait_for(
        "node 2 holds no lock and no write of the aborted transaction",
        Duration::from_secs(5),
        || {
            let s = stores[1].stats();
            s.locked_keys == 0 && s.live_branches == 0
        },
    )
    .await;
    assert_eq!(stores[1].committed(b"late"), None);
}

// ------------------------------------------------------------ _tx ----

use weft::admin::{TxReply, TxRequest, MAX_ABORT_REASON, MAX_TX_TIMEOUT_MS};

async fn tx_admin(c: &Cluster, to: u32, req: TxRequest) -> Result<TxReply, Failure> {
    let p = c
        .node(1)
        .rpc()
        .call_payload(
            None,
            &addr(&format!("_tx@{to}")),
            Payload::local(req),
            Some(Instant::now() + Duration::from_secs(5)),
        )
        .await?;
    Ok(p.decode().unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tx_admin_refuses_endless_transactions_and_huge_reasons() {
    let c = Cluster::start(2, 1609).await;
    for ms in [MAX_TX_TIMEOUT_MS + 1, u64::MAX] {
        let err = tx_admin(
            &c,
            2,
            TxRequest::Begin {
                timeout_ms: Some(ms),
            },
        )
        .await
        .unwrap_err();
        assert_eq!(err.status, Status::BadRequest, "{err}");
    }
    assert!(c.node(2).tm().list().is_empty(), "nothing was begun");
    let ctx = match tx_admin(
        &c,
        2,
        TxRequest::Begin {
            timeout_ms: Some(MAX_TX_TIMEOUT_MS),
        },
    )
    .await
    {
        Ok(TxReply::Begun(ctx)) => ctx,
        other => panic!("begin: {other:?}"),
    };
    let err = tx_admin(
        &c,
        2,
        TxRequest::Abort(ctx.tid, "x".repeat(MAX_ABORT_REASON + 1)),
    )
    .await
    .unwrap_err();
    assert_eq!(err.status, Status::BadRequest, "{err}");
    tx_admin(
        &c,
        2,
        TxRequest::Abort(ctx.tid, "x".repeat(MAX_ABORT_REASON)),
    )
    .await
    .unwrap();
    // Naming a transaction nobody began.
    let unknown = Tid {
        node: NodeId(2),
        incarnation: c.node(2).incarnation(),
        seq: 424_242,
    };
    let err = tx_admin(&c, 1, TxRequest::Commit(unknown))
        .await
        .unwrap_err();
    assert_eq!(err.status, Status::NotCoordinator, "{err}");
    let err = tx_admin(&c, 1, TxRequest::Status(unknown))
        .await
        .unwrap_err();
    assert_eq!(err.status, Status::NoSuchTransaction, "{err}");
}

/// `TxManager::commit` of a transaction its coordinator never began (or has
/// forgotten) used to lock the node's tombstones twice (`ended_result`
/// called `unknown` while its guard lived) and parking_lot does not
/// re-enter: the node froze for good (issue 16 item 1). It must answer
/// NoSuchTransaction.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tx_admin_commit_of_an_unknown_transaction_answers_no_such_transaction() {
    let c = Cluster::start(2, 1610).await;
    let unknown = Tid {
        node: NodeId(2),
        incarnation: c.node(2).incarnation(),
        seq: 424_242,
    };
    let err = tx_admin(&c, 2, TxRequest::Commit(unknown))
        .await
        .unwrap_err();
    assert_eq!(err.status, Status::NoSuchTransaction, "{err}");
}
