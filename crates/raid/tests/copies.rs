//! Read-one-write-all over the loaded placement: a write reaches every copy
//! the load named or fails; it never commits on the copies that happen to
//! be served while another one is not (issue 16, item 9).

use std::time::{Duration, Instant};

use weft::{Address, NodeId, Status};
use weft_raid::*;

fn small() -> Sizes {
    Sizes {
        accounts: 200,
        tellers: 10,
        branches: 1,
    }
}

fn tpcb(aid: u64) -> AdRequest {
    AdRequest::Tpcb {
        aid,
        teller: 1 + aid % 10,
        branch: 1,
        delta: 7,
    }
}

async fn cluster() -> RaidCluster {
    let c = RaidCluster::start(
        3,
        &std::env::temp_dir(),
        ClusterOptions {
            detector: (Duration::from_millis(50), Duration::from_millis(400)),
            ..ClusterOptions::default()
        },
    )
    .await
    .expect("cluster starts");
    c.load(small()).await.expect("load");
    c
}

/// Runs `req` through the AD service of site `at` (what `weft raid run`
/// calls), from that site's own node.
async fn through_ad_service(c: &RaidCluster, at: u32, req: AdRequest) -> Result<i64, Status> {
    let addr = Address::new(AD_SERVICE, NodeId(at)).unwrap();
    c.nodes[(at - 1) as usize]
        .call::<_, AdReply>(&addr, req)
        .await
        .map(|r| r.0)
        .map_err(|f| {
            println!("site {at}: {f}");
            f.status
        })
}

/// Waits (bounded) until every other node sees `id` alive with the
/// incarnation it runs now.
async fn wait_seen(c: &RaidCluster, id: u32) {
    let inc = c.nodes[(id - 1) as usize].incarnation();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let seen = c.nodes.iter().filter(|n| n.id() != NodeId(id)).all(|n| {
            n.endpoint()
                .view()
                .nodes
                .iter()
                .any(|s| s.info.id == NodeId(id) && s.alive && s.info.incarnation == inc)
        });
        if seen {
            return;
        }
        assert!(Instant::now() < deadline, "site {id} {inc} never seen");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn history_rows(c: &RaidCluster, site: usize) -> u64 {
    c.sites[site].audit().history_rows
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_fail_rather_than_skip_a_copy_whose_raid_service_is_absent() {
    let mut c = cluster().await;
    // Every site up: a write submitted at site 2 commits (at site 1).
    through_ad_service(&c, 2, tpcb(1)).await.expect("commits");
    assert!(c.quiesce(Duration::from_secs(20)).await);
    let rows = history_rows(&c, 1);
    assert_eq!(rows, 1);

    // Site 1's process comes back without its Raid services: a member of
    // the cluster, its copy not served. Writes need that copy.
    c.restart_without_raid(1).await.unwrap();
    wait_seen(&c, 1).await;
    for (i, at) in [2, 3, 2, 3].into_iter().enumerate() {
        let r = through_ad_service(&c, at, tpcb(10 + i as u64)).await;
        assert!(
            matches!(r, Err(Status::HostDead | Status::ProcDead)),
            "a write submitted at site {at} while site 1's copy is not served: {r:?}"
        );
    }
    // Read-only transactions at the surviving copies still run.
    let read = AdRequest::Raid {
        actions: vec![Action::Read(Item {
            rel: Relation::Account,
            key: 1,
        })],
    };
    assert_eq!(through_ad_service(&c, 2, read).await, Ok(7));
    assert!(c.quiesce(Duration::from_secs(20)).await);
    for site in [1, 2] {
        assert_eq!(
            history_rows(&c, site),
            rows,
            "nothing committed on site {}'s copy alone",
            site + 1
        );
    }

    // Site 1 back with its copy: the copies are equal, and writes commit.
    c.restart(1).await.unwrap();
    wait_seen(&c, 1).await;
    assert!(c.quiesce(Duration::from_secs(20)).await);
    let audit = c.audit();
    assert!(audit.passed(), "{:?}", audit.problems());
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        match through_ad_service(&c, 3, tpcb(50)).await {
            Ok(_) => break,
            Err(s) => assert!(
                Instant::now() < deadline,
                "writes never resumed after site 1 came back: {s}"
            ),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(c.quiesce(Duration::from_secs(20)).await);
    let audit = c.audit();
    assert!(audit.passed(), "{:?}", audit.problems());
    assert_eq!(audit.sites[0].1.history_rows, rows + 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shipped_request_runs_at_the_first_copy_of_the_same_placement_or_fails() {
    let c = cluster().await;
    let ads = c.ads().unwrap();
    let all = ads[0].replicas().all().to_vec();
    assert_eq!(all, [NodeId(1), NodeId(2), NodeId(3)]);
    let shipped = |id, sites: Vec<NodeId>| Shipped {
        id,
        sent_ms: weft_raid::marker::now_ms(),
        attempt: 0,
        sites,
        req: tpcb(3),
    };
    // Site 2 is not the first copy: it must not coordinate the write.
    let r = ads[1].run_shipped(shipped(1, all.clone())).await;
    assert!(
        matches!(&r, ShippedReply::Done(Err(f)) if f.status == Status::Mismatch),
        "{r:?}"
    );
    // Shipped for two copies of three: refused, not written to two.
    let r = ads[0].run_shipped(shipped(2, all[..2].to_vec())).await;
    assert!(
        matches!(&r, ShippedReply::Done(Err(f)) if f.status == Status::Mismatch),
        "{r:?}"
    );
    assert!(c.quiesce(Duration::from_secs(20)).await);
    let audit = c.audit();
    assert!(audit.passed(), "{:?}", audit.problems());
    assert_eq!(audit.sites[0].1.history_rows, 0, "nothing ran");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_loaded_copy_keeps_its_placement() {
    let c = cluster().await;
    for (i, site) in c.sites.iter().enumerate() {
        assert_eq!(
            site.placement().unwrap().all(),
            [NodeId(1), NodeId(2), NodeId(3)],
            "site {}",
            i + 1
        );
        assert_eq!(site.audit().placement, [NodeId(1), NodeId(2), NodeId(3)]);
    }
    let load = |sites: Vec<NodeId>| {
        let rpc = c.nodes[1].rpc().clone();
        let site = c.sites[1].clone();
        async move {
            weft_raid::load::load_store(
                &rpc,
                site.store(),
                site.participant_handle(),
                LoadRequest {
                    sizes: small(),
                    sites,
                },
            )
            .await
        }
    };
    // The same placement again: nothing to do.
    let again = load(vec![NodeId(3), NodeId(2), NodeId(1)]).await.unwrap();
    assert_eq!(
        again,
        LoadReply {
            loaded: false,
            tuples: 0
        }
    );
    // Another placement: refused.
    let other = load(vec![NodeId(2), NodeId(3)]).await.unwrap_err();
    assert_eq!(other.status, Status::Mismatch, "{other}");
    // A placement without the site: refused.
    let without = load(vec![NodeId(1), NodeId(3)]).await.unwrap_err();
    assert_eq!(without.status, Status::BadRequest, "{without}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_that_is_not_loaded_takes_no_writes() {
    let c = RaidCluster::start(2, &std::env::temp_dir(), ClusterOptions::default())
        .await
        .unwrap();
    // Only site 1's copy is loaded, for both sites.
    let site = c.sites[0].clone();
    weft_raid::load::load_store(
        c.nodes[0].rpc(),
        site.store(),
        site.participant_handle(),
        LoadRequest {
            sizes: small(),
            sites: vec![NodeId(1), NodeId(2)],
        },
    )
    .await
    .unwrap();
    assert_eq!(
        c.sites[1].placement().unwrap_err().status,
        Status::Unavailable
    );
    let ad = c.sites[0].loaded_ad().unwrap();
    let f = ad.run(tpcb(4)).await.unwrap_err();
    assert_eq!(f.status, Status::ProcDead, "{f}");
    assert!(c.quiesce(Duration::from_secs(20)).await);
    assert_eq!(history_rows(&c, 0), 0);
    assert_eq!(history_rows(&c, 1), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_shipped_to_a_first_copy_that_is_not_loaded_fails_at_once() {
    let c = RaidCluster::start(2, &std::env::temp_dir(), ClusterOptions::default())
        .await
        .unwrap();
    // Only site 2's copy is loaded: its writes ship to site 1, which
    // cannot run them.
    let site = c.sites[1].clone();
    weft_raid::load::load_store(
        c.nodes[1].rpc(),
        site.store(),
        site.participant_handle(),
        LoadRequest {
            sizes: small(),
            sites: vec![NodeId(1), NodeId(2)],
        },
    )
    .await
    .unwrap();
    let f = c.sites[1]
        .loaded_ad()
        .unwrap()
        .run(tpcb(4))
        .await
        .unwrap_err();
    assert_eq!(f.status, Status::ProcDead, "{f}");
    assert!(c.quiesce(Duration::from_secs(20)).await);
    assert_eq!(history_rows(&c, 1), 0);
}
