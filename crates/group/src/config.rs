//! Group configuration: every limit and every timer of the group layer, with
//! its default (TigerStyle: a limit on everything).
//!
//! Owns the knobs only. Must never read the environment or a clock.

use std::time::Duration;

/// Limits and timing of one node's group runtime.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GroupConfig {
    /// Messages queued for one member before further sends count it as not
    /// delivered (NoBuffer). A full queue is not a crash: the member stays.
    pub member_queue: usize,
    /// Groups the directory holds; creating more fails with NoBuffer.
    pub max_groups: usize,
    /// Members (processes) one node hosts; more joins fail with NoBuffer.
    pub max_members: usize,
    /// Groups one member may belong to; more joins fail with NoBuffer.
    pub max_groups_per_member: usize,
    /// Replies (and lost-member reports) buffered at the sender's node for
    /// one communication; further replies are refused with NoBuffer.
    pub max_buffered_replies: usize,
    /// Communications one node's senders may have open at once; more sends
    /// fail with NoBuffer.
    pub max_open_comms: usize,
    /// Largest group message body in bytes (TooLarge beyond).
    pub max_message: usize,
    /// Longest accepted group secret in bytes (BadRequest beyond).
    pub max_secret: usize,
    /// How long `send` waits for a node's delivery count before counting
    /// that node as unreachable (TimedOut in the delivery report).
    pub count_timeout: Duration,
    /// How long a member's reply may wait for the sender's node to accept
    /// it (TimedOut beyond).
    pub reply_timeout: Duration,
    /// How long a directory operation (create, destroy, first join) may take.
    pub directory_timeout: Duration,
    /// How long the directory waits for every node to acknowledge a table
    /// change before answering anyway (nodes that did not answer are
    /// usually unreachable; they bring their cached table up to date when
    /// the directory hears from them again).
    pub push_timeout: Duration,
    /// First retransmission delay of an unacknowledged protocol message;
    /// doubles up to `max_retransmit`.
    pub retransmit: Duration,
    /// Largest retransmission delay.
    pub max_retransmit: Duration,
    /// A member's node asks the sender's node whether a communication still
    /// lives once it has heard nothing about it for this long (T-Shoshin's
    /// probes), so that members never wait on a dead communication.
    pub probe_after: Duration,
    /// Period of the runtime's timer (retransmissions, probes, expiry)
    /// while something is timed.
    pub tick: Duration,
    /// While nothing is timed the timer sleeps, woken by the step that
    /// gives it work; it also looks on its own this often (at whether the
    /// naming directory moved, for one).
    pub quiet_check: Duration,
    /// How long a transaction fan-out remembers a message id (duplicates
    /// arriving later are answered with an empty count).
    pub fanout_memory: Duration,
}

impl Default for GroupConfig {
    fn default() -> Self {
        GroupConfig {
            member_queue: 256,
            max_groups: 100_000,
            max_members: 65_536,
            max_groups_per_member: 1024,
            max_buffered_replies: 4096,
            max_open_comms: 65_536,
            max_message: 16 << 20,
            max_secret: 1024,
            count_timeout: Duration::from_secs(3),
            reply_timeout: Duration::from_secs(5),
            directory_timeout: Duration::from_secs(5),
            push_timeout: Duration::from_secs(2),
            retransmit: Duration::from_millis(150),
            max_retransmit: Duration::from_secs(1),
            probe_after: Duration::from_secs(2),
            tick: Duration::from_millis(10),
            quiet_check: Duration::from_secs(1),
            fanout_memory: Duration::from_secs(30),
        }
    }
}

impl GroupConfig {
    /// Checks the configuration for values that cannot work.
    ///
    /// Fails with a message naming the first bad setting.
    pub fn validate(&self) -> Result<(), String> {
        let positive = [
            ("member_queue", self.member_queue),
            ("max_groups", self.max_groups),
            ("max_members", self.max_members),
            ("max_groups_per_member", self.max_groups_per_member),
            ("max_buffered_replies", self.max_buffered_replies),
            ("max_open_comms", self.max_open_comms),
            ("max_message", self.max_message),
        ];
        for (name, v) in positive {
            if v == 0 {
                return Err(format!("{name} must be at least 1"));
            }
        }
        let times = [
            ("count_timeout", self.count_timeout),
            ("reply_timeout", self.reply_timeout),
            ("directory_timeout", self.directory_timeout),
            ("push_timeout", self.push_timeout),
            ("retransmit", self.retransmit),
            ("probe_after", self.probe_after),
            ("tick", self.tick),
            ("quiet_check", self.quiet_check),
        ];
        for (name, v) in times {
            if v.is_zero() {
                return Err(format!("{name} must be positive"));
            }
        }
        if self.push_timeout * 2 > self.directory_timeout {
            return Err(
                "push_timeout must be at most half of directory_timeout (a directory answer \
                 may wait for a push)"
                    .into(),
            );
        }
        if self.max_retransmit < self.retransmit {
            return Err("max_retransmit must be at least retransmit".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_is_valid_and_zeroes_are_not() {
        assert!(GroupConfig::default().validate().is_ok());
        let bad = GroupConfig {
            member_queue: 0,
            ..GroupConfig::default()
        };
        assert!(bad.validate().unwrap_err().contains("member_queue"));
        let bad = GroupConfig {
            tick: Duration::ZERO,
            ..GroupConfig::default()
        };
        assert!(bad.validate().unwrap_err().contains("tick"));
    }
}
