//! Fault injection: drop, delay, duplicate, reorder and partition frames per
//! directed link, and strand the links open at some moment (they stay silent
//! after a heal, as a connection TCP retransmits on only after a long
//! backoff), from a seeded random source.
//!
//! Owns the decision of what happens to each frame a faulty link sends, and a
//! bounded history of those decisions to print when a test fails. Must never
//! act on a frame itself: it returns a verdict and the link carries it out.

use std::collections::{HashMap, HashSet, VecDeque};
use std::time::Duration;

use parking_lot::Mutex;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use weft_wire::{FrameKind, NodeId};

/// Which frames a link's random faults apply to. Partitions always apply to
/// every frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum FaultScope {
    /// Calls, responses, protocol messages and heartbeats.
    #[default]
    All,
    /// Only one-way protocol messages (naming, transactions, groups): models
    /// a lossy network under protocols that retransmit, while calls (which
    /// weft does not retransmit) stay reliable.
    Messages,
}

/// Random faults on one directed link.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LinkFaults {
    /// Probability of dropping a frame.
    pub drop: f64,
    /// Probability of sending a frame twice.
    pub duplicate: f64,
    /// Probability of holding a frame back so later frames overtake it.
    pub reorder: f64,
    /// Extra delay drawn uniformly from this range for every frame.
    pub delay: Option<(Duration, Duration)>,
    /// Which frames the faults apply to.
    pub scope: FaultScope,
}

impl LinkFaults {
    /// No faults.
    pub fn none() -> Self {
        LinkFaults::default()
    }

    /// True when this configuration does nothing.
    pub fn is_clean(&self) -> bool {
        self.drop == 0.0 && self.duplicate == 0.0 && self.reorder == 0.0 && self.delay.is_none()
    }
}

/// What to do with one frame: deliver a copy after each listed delay (an
/// empty list drops it).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Verdict {
    /// One entry per copy to deliver.
    pub deliveries: Vec<Duration>,
}

impl Verdict {
    fn deliver_now() -> Self {
        Verdict {
            deliveries: vec![Duration::ZERO],
        }
    }
}

const HISTORY_LEN: usize = 512;

struct PlanState {
    rng: ChaCha8Rng,
    default: LinkFaults,
    links: HashMap<(NodeId, NodeId), LinkFaults>,
    cut: HashSet<(NodeId, NodeId)>,
    /// Directed pairs whose links born before this generation are stranded.
    stranded: HashMap<(NodeId, NodeId), u64>,
    /// Incremented by every [`FaultPlan::strand`]; links are born with the
    /// value of the moment.
    generation: u64,
    history: VecDeque<String>,
    decisions: u64,
}

/// A seeded, shared fault plan. Every link of every node configured with the
/// plan asks it what to do with each frame it sends.
pub struct FaultPlan {
    seed: u64,
    state: Mutex<PlanState>,
}

impl FaultPlan {
    /// A plan with no faults, drawing randomness from `seed`.
    pub fn new(seed: u64) -> Self {
        FaultPlan {
            seed,
            state: Mutex::new(PlanState {
                rng: ChaCha8Rng::seed_from_u64(seed),
                default: LinkFaults::none(),
                links: HashMap::new(),
                cut: HashSet::new(),
                stranded: HashMap::new(),
                generation: 0,
                history: VecDeque::new(),
                decisions: 0,
            }),
        }
    }

    /// The seed, to print when a test fails.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// Faults for every link without its own setting.
    pub fn set_default(&self, faults: LinkFaults) {
        self.state.lock().default = faults;
    }

    /// Faults for the directed link `from -> to`.
    pub fn set_link(&self, from: NodeId, to: NodeId, faults: LinkFaults) {
        self.state.lock().links.insert((from, to), faults);
    }

    /// Cuts every link between a node of `a` and a node of `b`, both ways.
    pub fn partition(&self, a: &[NodeId], b: &[NodeId]) {
        let mut st = self.state.lock();
        for &x in a {
            for &y in b {
                st.cut.insert((x, y));
                st.cut.insert((y, x));
            }
        }
        st.history.push_back(format!("partition {a:?} | {b:?}"));
    }

    /// Cuts the directed link `from -> to` only.
    pub fn cut_one_way(&self, from: NodeId, to: NodeId) {
        let mut st = self.state.lock();
        st.cut.insert((from, to));
        st.history.push_back(format!("cut {from:?} -> {to:?}"));
    }

    /// Strands every link open now between a node of `a` and a node of `b`,
    /// both ways: from now on they carry nothing, not even after
    /// [`FaultPlan::heal`], while links opened later work (a connection whose
    /// packets the network keeps losing, or that TCP retransmits on only
    /// after a long backoff, while a fresh connection gets through).
    pub fn strand(&self, a: &[NodeId], b: &[NodeId]) {
        let mut st = self.state.lock();
        st.generation += 1;
        let generation = st.generation;
        for &x in a {
            for &y in b {
                st.stranded.insert((x, y), generation);
                st.stranded.insert((y, x), generation);
            }
        }
        st.history
            .push_back(format!("strand links of {a:?} | {b:?} open now"));
    }

    /// The generation a link opened now is born with (see
    /// [`FaultPlan::decide_on`]).
    pub fn generation(&self) -> u64 {
        self.state.lock().generation
    }

    /// True when a link born in `generation` carries nothing `from -> to`:
    /// cut, or stranded.
    pub fn is_cut_on(&self, from: NodeId, to: NodeId, generation: u64) -> bool {
        let st = self.state.lock();
        st.cut.contains(&(from, to))
            || st
                .stranded
                .get(&(from, to))
                .is_some_and(|g| generation < *g)
    }

    /// Removes every partition and cut (stranded links stay stranded).
    pub fn heal(&self) {
        let mut st = self.state.lock();
        st.cut.clear();
        st.history.push_back("heal".to_string());
    }

    /// Removes every random fault (partitions stay).
    pub fn calm(&self) {
        let mut st = self.state.lock();
        st.default = LinkFaults::none();
        st.links.clear();
        st.history.push_back("calm".to_string());
    }

    /// True when `from -> to` is cut.
    pub fn is_cut(&self, from: NodeId, to: NodeId) -> bool {
        self.state.lock().cut.contains(&(from, to))
    }

    /// Decides the fate of a frame of `kind` sent on `from -> to` over a
    /// link opened now.
    pub fn decide(&self, from: NodeId, to: NodeId, kind: FrameKind) -> Verdict {
        let generation = self.generation();
        self.decide_on(from, to, generation, kind)
    }

    /// Decides the fate of a frame of `kind` sent on `from -> to` over a
    /// link born in `generation` ([`FaultPlan::generation`] when it opened).
    pub fn decide_on(&self, from: NodeId, to: NodeId, generation: u64, kind: FrameKind) -> Verdict {
        let mut st = self.state.lock();
        st.decisions += 1;
        let stranded = st
            .stranded
            .get(&(from, to))
            .is_some_and(|g| generation < *g);
        if stranded || st.cut.contains(&(from, to)) {
            if kind != FrameKind::Heartbeat {
                let n = st.decisions;
                push(
                    &mut st.history,
                    format!("#{n} {from:?}->{to:?} {kind:?}: cut"),
                );
            }
            return Verdict {
                deliveries: Vec::new(),
            };
        }
        let faults = st
            .links
            .get(&(from, to))
            .cloned()
            .unwrap_or_else(|| st.default.clone());
        let applies = match (faults.scope, kind) {
            (_, FrameKind::Hello | FrameKind::Auth | FrameKind::Refused | FrameKind::Goodbye) => {
                false
            }
            (_, FrameKind::Fragment) => false,
            (FaultScope::All, _) => true,
            (FaultScope::Messages, k) => k == FrameKind::Message,
        };
        if !applies || faults.is_clean() {
            return Verdict::deliver_now();
        }
        let mut deliveries = Vec::new();
        let dropped = st.rng.gen_bool(faults.drop.clamp(0.0, 1.0));
        if !dropped {
            let copies = if st.rng.gen_bool(faults.duplicate.clamp(0.0, 1.0)) {
                2
            } else {
                1
            };
            for _ in 0..copies {
                let mut d = match faults.delay {
                    Some((lo, hi)) if hi > lo => {
                        lo + Duration::from_micros(
                            st.rng
                                .gen_range(0..=(hi - lo).as_micros().min(u64::MAX as u128) as u64),
                        )
                    }
                    Some((lo, _)) => lo,
                    None => Duration::ZERO,
                };
                if st.rng.gen_bool(faults.reorder.clamp(0.0, 1.0)) {
                    d += Duration::from_micros(st.rng.gen_range(500..5000));
                }
                deliveries.push(d);
            }
        }
        let n = st.decisions;
        push(
            &mut st.history,
            format!("#{n} {from:?}->{to:?} {kind:?}: {deliveries:?}"),
        );
        Verdict { deliveries }
    }

    /// The most recent decisions, oldest first, to replay a failure.
    pub fn history(&self) -> Vec<String> {
        self.state.lock().history.iter().cloned().collect()
    }

    /// A report for a failing test: the seed and the recent history.
    pub fn report(&self) -> String {
        let mut s = format!("fault plan seed = {}\n", self.seed);
        for line in self.history() {
            s.push_str(&line);
            s.push('\n');
        }
        s
    }
}

fn push(history: &mut VecDeque<String>, line: String) {
    if history.len() == HISTORY_LEN {
        history.pop_front();
    }
    history.push_back(line);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_decisions() {
        let run = |seed| {
            let p = FaultPlan::new(seed);
            p.set_default(LinkFaults {
                drop: 0.3,
                duplicate: 0.2,
                reorder: 0.2,
                delay: Some((Duration::ZERO, Duration::from_millis(3))),
                scope: FaultScope::All,
            });
            (0..200)
                .map(|i| p.decide(NodeId(1), NodeId(2 + i % 3), FrameKind::Message))
                .collect::<Vec<_>>()
        };
        assert_eq!(run(42), run(42));
        assert_ne!(run(42), run(43));
    }

    #[test]
    fn partitions_cut_both_ways_and_heal() {
        let p = FaultPlan::new(1);
        p.partition(&[NodeId(1)], &[NodeId(2), NodeId(3)]);
        assert!(p
            .decide(NodeId(1), NodeId(2), FrameKind::Request)
            .deliveries
            .is_empty());
        assert!(p
            .decide(NodeId(3), NodeId(1), FrameKind::Hello)
            .deliveries
            .is_empty());
        assert_eq!(
            p.decide(NodeId(2), NodeId(3), FrameKind::Request)
                .deliveries
                .len(),
            1
        );
        p.heal();
        assert_eq!(
            p.decide(NodeId(1), NodeId(2), FrameKind::Request)
                .deliveries
                .len(),
            1
        );
        assert!(p.report().contains("seed = 1"));
    }

    #[test]
    fn stranded_links_stay_silent_after_a_heal_new_ones_work() {
        let p = FaultPlan::new(3);
        let old = p.generation();
        p.strand(&[NodeId(1)], &[NodeId(2)]);
        let new = p.generation();
        p.heal();
        for (from, to) in [(NodeId(1), NodeId(2)), (NodeId(2), NodeId(1))] {
            assert!(p
                .decide_on(from, to, old, FrameKind::Message)
                .deliveries
                .is_empty());
            assert!(p.is_cut_on(from, to, old));
            assert_eq!(
                p.decide_on(from, to, new, FrameKind::Message)
                    .deliveries
                    .len(),
                1
            );
            assert!(!p.is_cut_on(from, to, new));
        }
        assert_eq!(
            p.decide_on(NodeId(1), NodeId(3), old, FrameKind::Message)
                .deliveries
                .len(),
            1,
            "other pairs are not stranded"
        );
    }

    #[test]
    fn message_scope_spares_calls() {
        let p = FaultPlan::new(7);
        p.set_default(LinkFaults {
            drop: 1.0,
            scope: FaultScope::Messages,
            ..LinkFaults::none()
        });
        assert_eq!(
            p.decide(NodeId(1), NodeId(2), FrameKind::Request)
                .deliveries
                .len(),
            1
        );
        assert!(p
            .decide(NodeId(1), NodeId(2), FrameKind::Message)
            .deliveries
            .is_empty());
    }
}
