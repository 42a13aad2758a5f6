//! The heartbeat failure detector as a pure state machine.
//!
//! Owns the liveness verdict for every watched peer: a peer not heard from for
//! `dead_after` is dead; hearing from it again revives it. Any frame counts as
//! hearing from a peer; probes are only sent to peers that have been quiet for
//! a heartbeat interval. Silence counts towards death only while this node
//! listens: a peer whose link this node does not read for a while (its
//! reader is busy handing a frame up) is still probed (the probes are this
//! node's sign of life), never declared dead for that time. Must never touch
//! sockets or clocks: time comes in as an argument and verdicts go out as
//! values.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use weft_wire::NodeId;

/// What the detector wants done or announced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Send a heartbeat probe with this sequence number.
    Probe(NodeId, u64),
    /// The peer has been silent past the bound: declare it dead.
    Dead(NodeId),
    /// A peer declared dead was heard from again.
    Revived(NodeId),
}

#[derive(Debug)]
struct Watch {
    /// The last frame from the peer (probes go to a peer quiet for an
    /// interval).
    last_heard: Instant,
    /// Since when the peer has been silent while this node listened: the
    /// last frame, or the last moment this node could not read it.
    silent_since: Instant,
    last_probe: Option<Instant>,
    seq: u64,
    dead: bool,
}

/// Liveness of every watched peer.
pub(crate) struct Detector {
    interval: Duration,
    dead_after: Duration,
    peers: HashMap<NodeId, Watch>,
}

impl Detector {
    /// A detector probing every `interval` and declaring death after
    /// `dead_after` of silence.
    pub(crate) fn new(interval: Duration, dead_after: Duration) -> Self {
        debug_assert!(dead_after >= interval);
        Detector {
            interval,
            dead_after,
            peers: HashMap::new(),
        }
    }

    /// Starts watching `node` as if just heard from (no effect if watched).
    pub(crate) fn watch(&mut self, node: NodeId, now: Instant) {
        self.peers.entry(node).or_insert(Watch {
            last_heard: now,
            silent_since: now,
            last_probe: None,
            seq: 0,
            dead: false,
        });
    }

    /// Stops watching `node` (it left in an orderly way).
    pub(crate) fn unwatch(&mut self, node: NodeId) {
        self.peers.remove(&node);
    }

    /// Records that a frame arrived from `node`. Returns `Revived` when the
    /// peer had been declared dead.
    pub(crate) fn heard(&mut self, node: NodeId, now: Instant) -> Option<Verdict> {
        let w = self.peers.get_mut(&node)?;
        w.last_heard = now;
        w.silent_since = now;
        if w.dead {
            w.dead = false;
            return Some(Verdict::Revived(node));
        }
        None
    }

    /// Records that at `now` this node was not reading what `node` sends
    /// (a frame of its link still being handed up): its silence until now
    /// is no evidence. It is still probed (the probes tell it this node is
    /// alive), and a peer already dead stays dead.
    pub(crate) fn unread(&mut self, node: NodeId, now: Instant) {
        if let Some(w) = self.peers.get_mut(&node) {
            if !w.dead {
                w.silent_since = now;
            }
        }
    }

    /// Forces the verdict `dead` for `node` now (e.g. its process is known to
    /// be gone). Returns false if it was already dead or is not watched.
    pub(crate) fn declare_dead(&mut self, node: NodeId) -> bool {
        match self.peers.get_mut(&node) {
            Some(w) if !w.dead => {
                w.dead = true;
                true
            }
            _ => false,
        }
    }

    /// True when `node` is watched and currently dead.
    #[cfg(test)]
    pub(crate) fn is_dead(&self, node: NodeId) -> bool {
        self.peers.get(&node).is_some_and(|w| w.dead)
    }

    /// Advances time: returns probes to send and deaths to announce.
    pub(crate) fn tick(&mut self, now: Instant) -> Vec<Verdict> {
        let mut out = Vec::new();
        for (&node, w) in self.peers.iter_mut() {
            let silent = now.saturating_duration_since(w.last_heard);
            if !w.dead && now.saturating_duration_since(w.silent_since) > self.dead_after {
                w.dead = true;
                out.push(Verdict::Dead(node));
            }
            let probe_due = w
                .last_probe
                .is_none_or(|t| now.saturating_duration_since(t) >= self.interval);
            if silent >= self.interval && probe_due {
                w.seq += 1;
                w.last_probe = Some(now);
                out.push(Verdict::Probe(node, w.seq));
            }
        }
        out.sort_by_key(|v| match v {
            Verdict::Dead(n) | Verdict::Revived(n) | Verdict::Probe(n, _) => *n,
        });
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn silent_peer_dies_after_the_bound_and_revives() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let mut d = Detector::new(ms(100), ms(500));
        d.watch(NodeId(2), t0);
        assert!(
            d.tick(t0 + ms(50)).is_empty(),
            "recently heard: nothing to do"
        );
        assert_eq!(d.tick(t0 + ms(100)), vec![Verdict::Probe(NodeId(2), 1)]);
        assert_eq!(d.tick(t0 + ms(150)), vec![], "one probe per interval");
        assert_eq!(d.tick(t0 + ms(200)), vec![Verdict::Probe(NodeId(2), 2)]);
        let v = d.tick(t0 + ms(501));
        assert!(v.contains(&Verdict::Dead(NodeId(2))), "{v:?}");
        assert!(d.is_dead(NodeId(2)));
        assert!(
            !d.tick(t0 + ms(900)).contains(&Verdict::Dead(NodeId(2))),
            "dies once"
        );
        assert_eq!(
            d.heard(NodeId(2), t0 + ms(950)),
            Some(Verdict::Revived(NodeId(2)))
        );
        assert!(!d.is_dead(NodeId(2)));
    }

    #[test]
    fn a_peer_this_node_does_not_read_is_probed_but_not_declared_dead() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let mut d = Detector::new(ms(100), ms(500));
        d.watch(NodeId(3), t0);
        // This node's reader of node 3's link is busy from 10 ms to 2 s.
        let mut probes = 0;
        for i in 1..=40 {
            let now = t0 + ms(i * 50);
            d.unread(NodeId(3), now);
            for v in d.tick(now) {
                match v {
                    Verdict::Probe(NodeId(3), _) => probes += 1,
                    other => panic!("at {} ms: {other:?}", i * 50),
                }
            }
        }
        assert!(probes >= 15, "probed on every interval: {probes}");
        // Read again and silent: dead dead_after after the reader freed.
        assert!(!d.tick(t0 + ms(2500)).contains(&Verdict::Dead(NodeId(3))));
        assert!(d.tick(t0 + ms(2501)).contains(&Verdict::Dead(NodeId(3))));
        // A dead peer is not revived by this node's own busy reader.
        d.unread(NodeId(3), t0 + ms(2600));
        assert!(d.is_dead(NodeId(3)));
    }

    #[test]
    fn traffic_counts_as_heartbeat() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let mut d = Detector::new(ms(100), ms(300));
        d.watch(NodeId(5), t0);
        for i in 1..20 {
            d.heard(NodeId(5), t0 + ms(i * 90));
            assert!(d.tick(t0 + ms(i * 90 + 10)).is_empty());
        }
        assert!(d.declare_dead(NodeId(5)));
        assert!(!d.declare_dead(NodeId(5)));
        d.unwatch(NodeId(5));
        assert_eq!(d.heard(NodeId(5), t0), None);
    }
}
