//! Retransmission of protocol messages that expect an answer.
//!
//! The transport does not retransmit one-way messages (a link that breaks
//! loses what was in flight; the fault plan drops frames on purpose), so
//! every message that waits for an acknowledgement is kept here with a
//! backoff and a deadline until it is answered.
//!
//! Owns the schedule only. Must never read a clock: `now` comes from the
//! caller.

use std::time::{Duration, Instant};

use weft_wire::NodeId;

use crate::ids::{CommId, IdMap};
use crate::msg::GroupMsg;

/// What a retransmitted message is waiting for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RetryKey {
    /// A directory request (by request id), re-targeted at the current
    /// directory on every retransmission.
    Dir(u64),
    /// A table push to one node.
    Push(u64, NodeId),
    /// A delivery to one node, until its count arrives.
    Deliver(CommId, NodeId),
    /// A member's reply (by reply id), until the sender's node answers.
    Reply(u64),
    /// A lost-members report (by id).
    Lost(u64),
    /// A transaction fan-out hop to one neighbour.
    TxDeliver(CommId, NodeId),
}

struct Entry {
    to: NodeId,
    msg: GroupMsg,
    next: Instant,
    delay: Duration,
    deadline: Instant,
}

/// The set of messages waiting for an answer.
pub struct Outbox {
    entries: IdMap<RetryKey, Entry>,
    first: Duration,
    max: Duration,
}

/// What [`Outbox::due`] found.
#[derive(Default)]
pub struct Due {
    /// Messages to send again.
    pub resend: Vec<(RetryKey, NodeId, GroupMsg)>,
    /// Messages whose deadline passed unanswered (no longer kept).
    pub expired: Vec<(RetryKey, NodeId)>,
}

impl Outbox {
    /// An empty outbox with the first and the largest retransmission delay.
    pub fn new(first: Duration, max: Duration) -> Self {
        Outbox {
            entries: IdMap::default(),
            first,
            max: max.max(first),
        }
    }

    /// Keeps `msg` (a retransmission copy) for `to` until `deadline`.
    pub fn arm(
        &mut self,
        key: RetryKey,
        to: NodeId,
        msg: GroupMsg,
        now: Instant,
        deadline: Instant,
    ) {
        self.entries.insert(
            key,
            Entry {
                to,
                msg,
                next: now + self.first,
                delay: self.first,
                deadline,
            },
        );
    }

    /// Forgets a message (it was answered). Returns whether it was kept.
    pub fn disarm(&mut self, key: &RetryKey) -> bool {
        self.entries.remove(key).is_some()
    }

    /// True while `key` waits.
    pub fn contains(&self, key: &RetryKey) -> bool {
        self.entries.contains_key(key)
    }

    /// Forgets and returns every key waiting on `node`.
    pub fn take_to(&mut self, node: NodeId) -> Vec<RetryKey> {
        let keys: Vec<RetryKey> = self
            .entries
            .iter()
            .filter(|(_, e)| e.to == node)
            .map(|(k, _)| *k)
            .collect();
        for k in &keys {
            self.entries.remove(k);
        }
        keys
    }

    /// Forgets every key matching `pred`.
    pub fn disarm_where(&mut self, mut pred: impl FnMut(&RetryKey) -> bool) {
        self.entries.retain(|k, _| !pred(k));
    }

    /// Re-targets a directory request at `to` (the directory changed).
    pub fn retarget(&mut self, key: &RetryKey, to: NodeId) {
        if let Some(e) = self.entries.get_mut(key) {
            e.to = to;
        }
    }

    /// A copy of the message waiting for `key`, to send again now.
    pub fn copy(&self, key: &RetryKey) -> Option<GroupMsg> {
        self.entries.get(key).map(|e| e.msg.retransmission())
    }

    /// Messages due for retransmission at `now` (their next delay doubles)
    /// and messages whose deadline passed.
    pub fn due(&mut self, now: Instant) -> Due {
        let mut due = Due::default();
        let mut gone = Vec::new();
        for (key, e) in self.entries.iter_mut() {
            if now >= e.deadline {
                gone.push(*key);
                due.expired.push((*key, e.to));
            } else if now >= e.next {
                e.delay = (e.delay * 2).min(self.max);
                e.next = now + e.delay;
                due.resend.push((*key, e.to, e.msg.retransmission()));
            }
        }
        for k in gone {
            self.entries.remove(&k);
        }
        due
    }

    /// Number of waiting messages.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True when nothing waits.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backs_off_then_expires() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let mut o = Outbox::new(ms(10), ms(40));
        o.arm(
            RetryKey::Lost(1),
            NodeId(2),
            GroupMsg::LostAck { lost: 1 },
            t0,
            t0 + ms(100),
        );
        assert!(o.due(t0 + ms(5)).resend.is_empty());
        assert_eq!(o.due(t0 + ms(10)).resend.len(), 1);
        assert!(o.due(t0 + ms(20)).resend.is_empty(), "delay doubled to 20");
        assert_eq!(o.due(t0 + ms(30)).resend.len(), 1);
        let d = o.due(t0 + ms(100));
        assert_eq!(d.expired, vec![(RetryKey::Lost(1), NodeId(2))]);
        assert!(o.is_empty());
        o.arm(
            RetryKey::Lost(2),
            NodeId(3),
            GroupMsg::LostAck { lost: 2 },
            t0,
            t0 + ms(100),
        );
        assert_eq!(o.take_to(NodeId(3)), vec![RetryKey::Lost(2)]);
        assert!(!o.disarm(&RetryKey::Lost(2)));
    }
}
