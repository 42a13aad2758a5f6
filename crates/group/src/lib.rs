//! Process groups and group messaging for weft: T-Shoshin's group
//! communication (one message to a group, a count of members reached,
//! replies collected one by one, sessions and precise failure statuses) and
//! Raid's transaction multicast (`tx:<tid>` reaches every node taking part in
//! a transaction, with no set-up messages).
//!
//! ```no_run
//! # async fn demo(groups: weft_group::runtime::Groups) -> Result<(), weft_wire::Failure> {
//! use std::time::Duration;
//! use weft_wire::Payload;
//! let gid = weft_group::parse_group("printers:floor2")?;
//! groups.create(&gid, "s3cret").await?;
//! let member = groups.join(&gid, "s3cret").await?;          // a process joins itself
//! let sender = groups.sender();                             // any process may send
//! let reached = sender.send(&gid, Payload::local("job 7".to_string())).await?;
//! let incoming = member.recv(&gid, None).await?;            // brec
//! incoming.reply(Payload::local("done".to_string())).await?; // buffered at the sender's node
//! let reply = sender.next_reply(&gid, Duration::from_secs(1)).await?; // getreply
//! # let _ = (reached, reply); Ok(()) }
//! ```
//!
//! Layout: [`mod@core`] is the sans-IO protocol (directory, cached table,
//! communications at the sender's node, members and queues, transaction
//! fan-out, retransmission), driven by events and tested message by
//! message; [`runtime`] is the async shell on a node's transport endpoint
//! and the handles programs use; [`service`] puts it in a weft node (the
//! `_group` service and its client); [`mod@bench`] measures it against unicast
//! baselines.
//!
//! The directory of groups lives on the naming directory node and pushes the
//! group table (ids, salted secret verifiers, which nodes host members) to
//! every node, so a send needs no round trip to it; the sender's node sends
//! the message to every member node at once and each answers how many of its
//! members it queued the message for, in one message with the replies its
//! members made at once (a member node's whole answer to a send is usually
//! one write, and the sender's node takes the count before those replies).
//! A communication's end is told only to nodes with members still to answer.
//! Messages of any size travel through the
//! transport (fragmented on the wire); local values move without being
//! serialized when they stay in the process.
#![warn(missing_docs)]

pub mod bench;
pub mod config;
pub mod core;
pub mod ids;
pub mod msg;
pub mod runtime;
pub mod secret;
pub mod service;

pub use crate::config::GroupConfig;
pub use crate::core::origin::Delivery;
pub use crate::ids::{CommId, MemberId, SenderId, Tag};
pub use crate::runtime::{GroupInfo, GroupSender, Groups, Incoming, Member, Reply, TxInbox};
pub use crate::service::{GroupClient, GroupPlugin};

use weft_wire::{Failure, GroupId, Status};

/// Parses a group id (`class:name` or `tx:<tid>`).
///
/// Fails with AddrError (T-Shoshin's illegal address) when the text is not
/// a valid group id.
pub fn parse_group(text: &str) -> Result<GroupId, Failure> {
    text.parse()
        .map_err(|e: weft_wire::ParseIdError| Failure::new(Status::AddrError, e.to_string()))
}
