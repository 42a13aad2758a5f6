//! Size and scale: a 1 MiB group message (fragmented on the wire) and a
//! thousand groups whose membership churns.

#[path = "group_support.rs"]
mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use support::*;
use weft::{ChannelSet, GroupId, NodeId, Payload, Status};
use weft_group::runtime::Member;

const LONG: Duration = Duration::from_secs(10);

async fn one_mebibyte_round_trip(c: &GroupCluster) {
    let g = gid("sc:big");
    c.g(1).create(&g, "").await.unwrap();
    let mut tasks = Vec::new();
    for n in [1, 2, 3] {
        let m = c.g(n).join(&g, "").await.unwrap();
        let g = g.clone();
        tasks.push(tokio::spawn(async move {
            let mut i = m.recv(&g, None).await.unwrap();
            let body: Vec<u8> = i.take_payload().unwrap().into_bytes().unwrap().to_vec();
            assert_eq!(body.len(), 1 << 20);
            assert!(body.iter().enumerate().all(|(k, b)| *b == (k % 251) as u8));
            // Reply with the whole mebibyte, reversed.
            let back: Vec<u8> = body.into_iter().rev().collect();
            i.reply(Payload::bytes(back)).await.unwrap();
            m
        }));
    }
    let body: Vec<u8> = (0..1 << 20).map(|k| (k % 251) as u8).collect();
    let s = c.g(2).sender();
    assert_eq!(s.send(&g, Payload::bytes(body.clone())).await.unwrap(), 3);
    let mut want = body;
    want.reverse();
    for _ in 0..3 {
        let r = s.next_reply(&g, LONG).await.unwrap();
        assert_eq!(r.payload.into_bytes().unwrap().as_ref(), want.as_slice());
    }
    for t in tasks {
        let _member = t.await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mebibyte_message_over_tcp() {
    let tcp = ChannelSet {
        inproc: false,
        shm: false,
        tcp: true,
    };
    let c = GroupCluster::start_with(
        3,
        501,
        |_| test_config(),
        move |_, b| b.listen("127.0.0.1:0".parse().unwrap()).channels(tcp),
    )
    .await;
    one_mebibyte_round_trip(&c).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mebibyte_message_in_process() {
    let c = GroupCluster::start(3, 502).await;
    one_mebibyte_round_trip(&c).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_groups_with_churning_membership() {
    let seed = 503u64;
    let nodes = 4u32;
    let c = GroupCluster::start(nodes, seed).await;
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let groups: Vec<GroupId> = (0..1000).map(|i| gid(&format!("churn:g{i}"))).collect();
    for (i, g) in groups.iter().enumerate() {
        let creator = 1 + (i as u32 % nodes);
        c.g(creator).create(g, &format!("pw{i}")).await.unwrap();
    }
    // The model: which member (node, handle) belongs to which group.
    let mut members: Vec<(u32, Member)> = Vec::new();
    let mut model: BTreeMap<usize, BTreeSet<usize>> = BTreeMap::new();
    let mut history = Vec::new();
    for step in 0..3000 {
        let gi = rng.gen_range(0..groups.len());
        let g = &groups[gi];
        let pw = format!("pw{gi}");
        match rng.gen_range(0..10) {
            0..=4 => {
                // A new process joins.
                let node = rng.gen_range(1..=nodes);
                let m = c.g(node).join(g, &pw).await.unwrap_or_else(|f| {
                    panic!("seed {seed} step {step}: join {g} at {node}: {f}\n{history:?}")
                });
                members.push((node, m));
                model.entry(gi).or_default().insert(members.len() - 1);
                history.push(format!(
                    "{step}: m{} joins {g} at n{node}",
                    members.len() - 1
                ));
            }
            5..=6 => {
                // An existing process joins another group.
                if members.is_empty() {
                    continue;
                }
                let mi = rng.gen_range(0..members.len());
                if model.get(&gi).is_some_and(|s| s.contains(&mi)) {
                    continue;
                }
                members[mi].1.join(g, &pw).await.unwrap_or_else(|f| {
                    panic!("seed {seed} step {step}: m{mi} joins {g}: {f}\n{history:?}")
                });
                model.entry(gi).or_default().insert(mi);
                history.push(format!("{step}: m{mi} also joins {g}"));
            }
            _ => {
                // A member leaves.
                let Some(set) = model.get_mut(&gi) else {
                    continue;
                };
                let Some(&mi) = set.iter().next() else {
                    continue;
                };
                members[mi].1.leave(g, &pw).await.unwrap_or_else(|f| {
                    panic!("seed {seed} step {step}: m{mi} leaves {g}: {f}\n{history:?}")
                });
                set.remove(&mi);
                history.push(format!("{step}: m{mi} leaves {g}"));
            }
        }
    }
    // Every node's cached table converges on the model's hosts.
    let hosts = |gi: usize| -> Vec<NodeId> {
        let set: BTreeSet<u32> = model
            .get(&gi)
            .map(|s| s.iter().map(|mi| members[*mi].0).collect())
            .unwrap_or_default();
        set.into_iter().map(NodeId).collect()
    };
    let want: BTreeMap<GroupId, Vec<NodeId>> = (0..groups.len())
        .map(|gi| (groups[gi].clone(), hosts(gi)))
        .collect();
    for n in 1..=nodes {
        wait_for(
            &format!("node {n}'s table matches (seed {seed})"),
            LONG,
            || {
                let got: BTreeMap<GroupId, Vec<NodeId>> = c
                    .g(n)
                    .cached()
                    .into_iter()
                    .map(|i| (i.gid, i.hosts))
                    .collect();
                got == want
            },
        )
        .await;
    }
    // Sends count exactly the model's members.
    let sender = c.g(2).sender();
    for (gi, g) in groups.iter().enumerate().step_by(7) {
        let expected = model.get(&gi).map_or(0, |s| s.len());
        match sender.send(g, Payload::local(gi as u32)).await {
            Ok(n) => assert_eq!(n, expected, "seed {seed}: {g}\n{history:?}"),
            Err(f) => {
                assert_eq!(expected, 0, "seed {seed}: {g}: {f}");
                assert_eq!(f.status, Status::NoMembers, "seed {seed}: {g}: {f}");
            }
        }
        let _ = sender.set_replies(g, 0);
    }
}
