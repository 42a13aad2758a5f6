//! A loaded database is visible to the very next transaction at every site.

use std::future::Future;
use std::task::Context;
use std::time::Duration;

use weft::NodeId;
use weft_raid::*;

/// `weft raid load` failed with "peer closed the shared-memory link": the
/// RPC layer polls a handler once where the request arrives (a link's
/// reader), and that one poll ran the whole load, long enough for the site
/// to hear nothing from its caller and declare it dead. The load's first
/// poll now writes nothing and gives the thread back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_load_gives_back_the_thread_that_first_polls_it() {
    let c = RaidCluster::start(1, &std::env::temp_dir(), ClusterOptions::default())
        .await
        .unwrap();
    let site = c.sites[0].clone();
    let sizes = Sizes::tpcb(1);
    let mut load = Box::pin(weft_raid::load::load_store(
        c.nodes[0].rpc(),
        site.store(),
        site.participant_handle(),
        LoadRequest {
            sizes,
            sites: vec![NodeId(1)],
        },
    ));
    let mut cx = Context::from_waker(futures::task::noop_waker_ref());
    assert!(load.as_mut().poll(&mut cx).is_pending());
    let accounts = || {
        site.store()
            .committed_with_prefix(&[Relation::Account.prefix()])
            .len() as u64
    };
    assert_eq!(accounts(), 0, "the first poll wrote nothing");
    let reply = load.await.unwrap();
    let all: u64 = Relation::BALANCES.iter().map(|r| sizes.of(*r)).sum();
    assert_eq!(reply.tuples, all);
    assert_eq!(accounts(), sizes.of(Relation::Account));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_tuple_is_visible_right_after_the_load() {
    let c = RaidCluster::start(3, &std::env::temp_dir(), ClusterOptions::default())
        .await
        .unwrap();
    let sizes = Sizes::tpcb(1);
    c.load(sizes).await.unwrap();
    for (i, site) in c.sites.iter().enumerate() {
        for rel in Relation::BALANCES {
            let n = site.store().committed_with_prefix(&[rel.prefix()]).len() as u64;
            assert_eq!(n, sizes.of(rel), "site {} relation {}", i + 1, rel.name());
        }
    }
    let ads = c.ads().unwrap();
    for teller in 1..=10 {
        ads[0]
            .run(AdRequest::Tpcb {
                aid: teller,
                teller,
                branch: 1,
                delta: 1,
            })
            .await
            .unwrap_or_else(|f| panic!("teller {teller}: {f}"));
    }
    assert!(c.quiesce(Duration::from_secs(10)).await);
    assert!(c.audit().passed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_clients_right_after_the_load_find_every_tuple() {
    let c = RaidCluster::start(3, &std::env::temp_dir(), ClusterOptions::default())
        .await
        .unwrap();
    let sizes = Sizes::tpcb(1);
    c.load(sizes).await.unwrap();
    let runners: Vec<_> = c
        .ads()
        .unwrap()
        .into_iter()
        .map(|ad| {
            move |req| {
                let ad = ad.clone();
                async move { ad.run(req).await }
            }
        })
        .collect();
    let r = run_closed(
        runners,
        Workload {
            mode: Mode::Tpcb,
            sizes,
        },
        8,
        Duration::from_secs(3),
        1,
        std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0)),
    )
    .await;
    assert!(
        !r.aborts.contains_key("BadRequest"),
        "{:?} {:?}",
        r.aborts,
        r.abort_samples
    );
    assert!(c.quiesce(Duration::from_secs(20)).await);
    assert!(c.audit().passed());
}
