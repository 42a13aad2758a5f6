//! A loaded database is visible to the very next transaction at every site.

use std::time::Duration;

use weft_raid::*;

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
