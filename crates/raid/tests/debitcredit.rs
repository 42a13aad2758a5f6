//! DebitCredit on in-process Raid clusters: the audit invariant after
//! concurrent runs, under message loss and partitions, with lock conflicts
//! forcing restarts, and across a site crash.

use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

use weft::{FaultPlan, FaultScope, LinkFaults, NodeId, Status};
use weft_raid::*;

/// A small tpcb database (the benchmark's shape, fewer accounts) for speed.
fn small() -> Sizes {
    Sizes {
        accounts: 2000,
        tellers: 10,
        branches: 1,
    }
}

async fn cluster(n: u32, opts: ClusterOptions) -> RaidCluster {
    RaidCluster::start(n, &std::env::temp_dir(), opts)
        .await
        .expect("cluster starts")
}

async fn run(
    c: &RaidCluster,
    mode: Mode,
    sizes: Sizes,
    clients: usize,
    secs: f64,
    seed: u64,
) -> RunReport {
    let ads = c.ads().unwrap();
    let runners: Vec<_> = ads
        .into_iter()
        .map(|ad| {
            move |req: AdRequest| {
                let ad = ad.clone();
                async move { ad.run(req).await }
            }
        })
        .collect();
    run_closed(
        runners,
        Workload { mode, sizes },
        clients,
        Duration::from_secs_f64(secs),
        seed,
        Arc::new(AtomicU64::new(0)),
    )
    .await
}

fn history_rows(c: &RaidCluster) -> u64 {
    c.audit().sites[0].1.history_rows
}

async fn settle_and_audit(c: &RaidCluster, context: &str) -> Audit {
    assert!(
        c.quiesce(Duration::from_secs(20)).await,
        "{context}: transactions still live"
    );
    let audit = c.audit();
    assert!(
        audit.passed(),
        "{context}: audit failed: {:?}\n{audit:#?}",
        audit.problems()
    );
    audit
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tpcb_on_one_site_keeps_the_books() {
    let c = cluster(1, ClusterOptions::default()).await;
    c.load(small()).await.unwrap();
    let r = run(&c, Mode::Tpcb, small(), 8, 1.0, 1).await;
    assert!(r.committed > 50, "{r:?}");
    let audit = settle_and_audit(&c, "1 site").await;
    assert_eq!(
        audit.sites[0].1.history_rows, r.committed,
        "one history row per commit"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tpcb_on_three_sites_keeps_every_copy_identical() {
    let c = cluster(3, ClusterOptions::default()).await;
    c.load(small()).await.unwrap();
    let r = run(&c, Mode::Tpcb, small(), 8, 1.5, 2).await;
    assert!(r.committed > 20, "{r:?}");
    let audit = settle_and_audit(&c, "3 sites").await;
    for (_, a) in &audit.sites {
        assert_eq!(a.history_rows, r.committed);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raid_mode_with_hot_spot_deadlocks_and_restarts_keeps_the_invariant() {
    let opts = ClusterOptions {
        site: SiteConfig {
            action_timeout: Duration::from_millis(100),
            ..SiteConfig::default()
        },
        ..ClusterOptions::default()
    };
    let c = cluster(3, opts).await;
    c.load(Sizes::raid()).await.unwrap();
    let r = run(&c, Mode::Raid, Sizes::raid(), 8, 2.0, 3).await;
    assert!(r.committed > 20, "{r:?}");
    settle_and_audit(&c, "raid mode").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lock_timeouts_restart_transactions_without_losing_or_duplicating_history() {
    // A 2 ms action timeout makes the single branch's lock a source of
    // constant LockConflicts: every one must abort cleanly and restart.
    let opts = ClusterOptions {
        site: SiteConfig {
            action_timeout: Duration::from_millis(2),
            ..SiteConfig::default()
        },
        ..ClusterOptions::default()
    };
    let c = cluster(2, opts).await;
    c.load(small()).await.unwrap();
    let r = run(&c, Mode::Tpcb, small(), 8, 1.5, 4).await;
    assert!(
        r.aborts.get("LockConflict").copied().unwrap_or(0) > 0,
        "conflicts happened: {r:?}"
    );
    assert!(r.committed > 0, "{r:?}");
    settle_and_audit(&c, "lock timeouts").await;
    assert_eq!(
        history_rows(&c),
        r.committed,
        "exactly one history row per committed transaction"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn message_loss_and_a_partition_do_not_break_the_books() {
    let seed = 5;
    let plan = Arc::new(FaultPlan::new(seed));
    let opts = ClusterOptions {
        fault: Some(plan.clone()),
        detector: (Duration::from_millis(50), Duration::from_millis(400)),
        site: SiteConfig {
            action_timeout: Duration::from_millis(300),
            ..SiteConfig::default()
        },
    };
    let c = cluster(3, opts).await;
    c.load(small()).await.unwrap();
    plan.set_default(LinkFaults {
        drop: 0.03,
        duplicate: 0.03,
        reorder: 0.05,
        delay: Some((Duration::ZERO, Duration::from_millis(2))),
        scope: FaultScope::Messages,
    });
    let runner = run(&c, Mode::Tpcb, small(), 6, 2.5, seed);
    let partition = async {
        tokio::time::sleep(Duration::from_millis(800)).await;
        plan.partition(&[NodeId(3)], &[NodeId(1), NodeId(2)]);
        tokio::time::sleep(Duration::from_millis(700)).await;
        plan.heal();
    };
    let (r, ()) = tokio::join!(runner, partition);
    plan.calm();
    assert!(r.committed > 0, "{r:?}\n{}", plan.report());
    let audit = c.audit();
    assert!(
        c.quiesce(Duration::from_secs(30)).await,
        "transactions still live\n{}",
        plan.report()
    );
    let audit_after = c.audit();
    assert!(
        audit_after.passed(),
        "audit: {:?}\n{audit:#?}\n{}",
        audit_after.problems(),
        plan.report()
    );
    assert_eq!(history_rows(&c), r.committed, "{}", plan.report());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_site_crash_and_restart_from_its_log() {
    let mut c = cluster(
        3,
        ClusterOptions {
            detector: (Duration::from_millis(50), Duration::from_millis(400)),
            ..ClusterOptions::default()
        },
    )
    .await;
    c.load(small()).await.unwrap();
    let before = run(&c, Mode::Tpcb, small(), 4, 0.8, 6).await;
    c.restart(2).await.unwrap();
    // The restarted copy recovered everything committed so far.
    if !c.quiesce(Duration::from_secs(20)).await {
        let live: Vec<_> = c
            .nodes
            .iter()
            .map(|n| (n.id(), n.tm().list(), n.recovery().clone()))
            .collect();
        panic!("transactions still live after the restart: {live:#?}");
    }
    let audit = c.audit();
    assert!(audit.passed(), "{:?}", audit.problems());
    assert_eq!(history_rows(&c), before.committed);
    let after = run(&c, Mode::Tpcb, small(), 4, 0.8, 7).await;
    assert!(after.committed > 0, "{after:?}");
    settle_and_audit(&c, "after restart").await;
    assert_eq!(history_rows(&c), before.committed + after.committed);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writing_transactions_are_coordinated_at_the_first_copys_site() {
    let c = cluster(3, ClusterOptions::default()).await;
    c.load(small()).await.unwrap();
    let committed = |site: usize| c.nodes[site].tm().stats().committed;
    let before: Vec<u64> = (0..3).map(committed).collect();
    let ads = c.ads().unwrap();
    let tpcb = AdRequest::Tpcb {
        aid: 7,
        teller: 2,
        branch: 1,
        delta: 5,
    };
    // Submitted at site 3: shipped to site 1, which coordinates it.
    ads[2].run(tpcb.clone()).await.unwrap();
    assert_eq!(committed(0), before[0] + 1, "site 1 coordinated it");
    assert_eq!(committed(2), before[2], "site 3 did not");
    // A read-only raid transaction stays where it was submitted.
    let read = AdRequest::Raid {
        actions: vec![Action::Read(Item {
            rel: Relation::Account,
            key: 7,
        })],
    };
    assert!(!read.writes() && tpcb.writes());
    ads[2].run(read).await.unwrap();
    assert_eq!(committed(0), before[0] + 1);
    assert_eq!(committed(2), before[2] + 1, "site 3 ran the read itself");
    let audit = settle_and_audit(&c, "after shipped transactions").await;
    assert!(audit.passed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shipped_request_sent_twice_runs_once() {
    let c = cluster(3, ClusterOptions::default()).await;
    c.load(small()).await.unwrap();
    let ads = c.ads().unwrap();
    let shipped = Shipped {
        id: 0x5eed,
        sent_ms: weft_raid::marker::now_ms(),
        attempt: 0,
        sites: ads[0].replicas().all().to_vec(),
        req: AdRequest::Tpcb {
            aid: 9,
            teller: 3,
            branch: 1,
            delta: 11,
        },
    };
    let rows = history_rows(&c);
    let first = ads[0].run_shipped(shipped.clone()).await;
    let again = ads[0].run_shipped(shipped).await;
    let ShippedReply::Done(Ok(balance)) = first else {
        panic!("the first run commits: {first:?}");
    };
    assert_eq!(
        again,
        ShippedReply::Done(Ok(balance)),
        "the repeat answers the first run's result"
    );
    let audit = settle_and_audit(&c, "after a repeated request").await;
    assert!(audit.passed());
    assert_eq!(history_rows(&c), rows + 1, "one deposit, not two");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeat_that_failed_stops_an_earlier_copy_from_running_later() {
    let c = cluster(3, ClusterOptions::default()).await;
    c.load(small()).await.unwrap();
    let ads = c.ads().unwrap();
    let sites = ads[0].replicas().all().to_vec();
    let tpcb = |aid| AdRequest::Tpcb {
        aid,
        teller: 1,
        branch: 1,
        delta: 3,
    };
    let rows = history_rows(&c);
    // A repeat (attempt 1) fails for good: no such account.
    let failed = ads[0]
        .run_shipped(Shipped {
            id: 0xbad,
            sent_ms: weft_raid::marker::now_ms(),
            attempt: 1,
            sites: sites.clone(),
            req: tpcb(small().accounts + 1),
        })
        .await;
    assert!(
        matches!(&failed, ShippedReply::Done(Err(f)) if f.status == Status::BadRequest),
        "{failed:?}"
    );
    // The first copy of the same request arrives late: it must not run.
    let late = ads[0]
        .run_shipped(Shipped {
            id: 0xbad,
            sent_ms: weft_raid::marker::now_ms(),
            attempt: 0,
            sites,
            req: tpcb(5),
        })
        .await;
    assert!(
        matches!(&late, ShippedReply::Done(Err(f)) if f.status == Status::Aborted),
        "{late:?}"
    );
    let audit = settle_and_audit(&c, "after a failed repeat").await;
    assert!(audit.passed());
    assert_eq!(history_rows(&c), rows, "nothing ran");
}

/// Issue 23: a marker is reclaimed once its request cannot be repeated any
/// more, from every copy; a repeat arriving after that is refused with
/// Refused (before and after a restart of the first copy), never run a
/// second time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeat_after_its_marker_was_reclaimed_is_refused_not_run_twice() {
    let mut c = cluster(3, ClusterOptions::default()).await;
    c.load(small()).await.unwrap();
    let ads = c.ads().unwrap();
    let now = weft_raid::marker::now_ms();
    let shipped = Shipped {
        id: 0xfeed,
        sent_ms: now - 5_000,
        attempt: 0,
        sites: ads[0].replicas().all().to_vec(),
        req: AdRequest::Tpcb {
            aid: 9,
            teller: 3,
            branch: 1,
            delta: 11,
        },
    };
    let rows = history_rows(&c);
    let first = ads[0].run_shipped(shipped.clone()).await;
    assert!(matches!(first, ShippedReply::Done(Ok(_))), "{first:?}");
    let key = Item {
        rel: Relation::Request,
        key: 0xfeed,
    }
    .kv_key();
    // The other copies apply the commit in phase two, after the answer.
    assert!(c.quiesce(Duration::from_secs(20)).await);
    assert!(c.sites.iter().all(|s| s.store().committed(&key).is_some()));
    assert_eq!(
        c.sites[0].bookkeeping().markers,
        1,
        "indexed at the first copy"
    );
    assert_eq!(c.sites[1].bookkeeping().markers, 0, "and only there");
    // Not due before the retention has passed.
    assert_eq!(c.sites[0].reclaim_due_at(now).await.unwrap(), 0);
    assert_eq!(c.sites[1].reclaim_due_at(now + 3_600_000).await.unwrap(), 0);
    // Due: gone from every copy, and the horizon stored with it.
    assert_eq!(c.sites[0].reclaim_due_at(now + 60_000).await.unwrap(), 1);
    assert!(c.quiesce(Duration::from_secs(20)).await);
    for (i, s) in c.sites.iter().enumerate() {
        assert_eq!(s.store().committed(&key), None, "site {}", i + 1);
    }
    assert_eq!(c.sites[0].bookkeeping().markers, 0);
    assert_eq!(c.sites[0].markers().horizon(), now - 5_000);
    let repeat = Shipped {
        attempt: 1,
        ..shipped.clone()
    };
    let refused = ads[0].run_shipped(repeat.clone()).await;
    assert!(
        matches!(&refused, ShippedReply::Done(Err(f)) if f.status == Status::Refused && f.detail.contains("twice")),
        "{refused:?}"
    );
    // The first copy restarts: the stored horizon still refuses it.
    c.restart(1).await.unwrap();
    let ad = c.sites[0].loaded_ad().unwrap();
    let again = ad.run_shipped(repeat).await;
    assert!(
        matches!(&again, ShippedReply::Done(Err(f)) if f.status == Status::Refused),
        "{again:?}"
    );
    // A request first sent after the horizon still runs (once site 1 knows
    // the other copies' sites again; a failed try runs nothing).
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    for n in 0u64.. {
        let fresh = Shipped {
            id: 0xbeef + n,
            sent_ms: weft_raid::marker::now_ms(),
            ..shipped.clone()
        };
        match ad.run_shipped(fresh).await {
            ShippedReply::Done(Ok(_)) => break,
            other => assert!(
                std::time::Instant::now() < deadline,
                "writes never resumed after site 1 came back: {other:?}"
            ),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    settle_and_audit(&c, "after a refused repeat").await;
    assert_eq!(history_rows(&c), rows + 2, "two requests ran, once each");
}

/// Issue 23: under load, the first copy's background task reclaims the
/// markers of shipped requests once their retention has passed, from every
/// copy; only the horizon record is left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn markers_of_a_run_are_reclaimed_in_the_background_from_every_copy() {
    let opts = ClusterOptions {
        site: SiteConfig {
            // Retention: the retry window, 1 s + 2 s.
            tx_timeout: Duration::from_secs(1),
            markers: MarkerLimits {
                retention: Duration::ZERO,
                reclaim_every: Duration::from_millis(100),
                ..MarkerLimits::default()
            },
            ..SiteConfig::default()
        },
        ..ClusterOptions::default()
    };
    let c = cluster(3, opts).await;
    c.load(small()).await.unwrap();
    let r = run(&c, Mode::Tpcb, small(), 6, 1.5, 23).await;
    assert!(r.committed > 10, "{r:?}");
    let markers = |site: usize| {
        c.sites[site]
            .store()
            .committed_with_prefix(b"r")
            .into_iter()
            .filter(|(k, _)| k[1..] != [0u8; 8])
            .count()
    };
    assert!(markers(0) > 0, "sites 2 and 3 shipped their writes");
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while (0..3).any(|s| markers(s) > 0) || c.sites[0].bookkeeping().markers > 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "markers left: {:?}, indexed {}",
            (0..3).map(markers).collect::<Vec<_>>(),
            c.sites[0].bookkeeping().markers
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let horizon = c.sites[0].markers().horizon();
    assert!(horizon > 0);
    for s in &c.sites {
        let stored = s.store().committed(&[b'r', 0, 0, 0, 0, 0, 0, 0, 0]);
        assert_eq!(
            stored
                .and_then(|v| weft_raid::marker::decode(&v))
                .map(|(_, t)| t),
            Some(horizon),
            "every copy stores the horizon"
        );
    }
    settle_and_audit(&c, "after reclamation").await;
}
