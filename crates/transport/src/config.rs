//! Transport configuration: identity, secret, channels, limits and timing.
//!
//! Owns every knob of the messaging layer with its default and its bound
//! (TigerStyle: a limit on everything). Must never read the environment; the
//! binary maps flags and environment variables onto this struct.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use weft_wire::{Incarnation, Limits, NodeId, PeerRole};

use crate::fault::FaultPlan;
use crate::inproc::InprocHub;

/// Which channel kinds a node may use. Resolution picks the cheapest enabled
/// channel that reaches a peer: inproc, then shm, then tcp.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChannelSet {
    /// Same-process nodes exchange values directly.
    pub inproc: bool,
    /// Same-host nodes talk through shared memory.
    pub shm: bool,
    /// Everything else goes over TCP.
    pub tcp: bool,
}

impl Default for ChannelSet {
    fn default() -> Self {
        ChannelSet {
            inproc: true,
            shm: true,
            tcp: true,
        }
    }
}

/// Configuration of one node's transport.
#[derive(Clone)]
pub struct TransportConfig {
    /// This node's id ([`NodeId::CLIENT`] for clients).
    pub node: NodeId,
    /// This node's incarnation.
    pub incarnation: Incarnation,
    /// Member or client.
    pub role: PeerRole,
    /// The cluster secret every link must prove (may be empty: then every
    /// node must use the empty secret).
    pub secret: Vec<u8>,
    /// TCP address to listen on (port 0 picks a free port); `None` for no
    /// TCP listener.
    pub listen: Option<SocketAddr>,
    /// Channels this node may use.
    pub channels: ChannelSet,
    /// Mutual TLS on TCP links, both ways (`None`: plaintext TCP). A node
    /// with TLS refuses plaintext peers and clients; a node without it
    /// refuses TLS ones. Shared-memory and in-process links are unaffected.
    pub tls: Option<crate::tls::TlsConfig>,
    /// The in-process hub; `None` uses the process-wide default hub.
    pub hub: Option<Arc<InprocHub>>,
    /// Fault injection applied to every link of this node (tests).
    pub fault: Option<Arc<FaultPlan>>,
    /// Frame and message size limits, and the reassembly timeout.
    pub limits: Limits,
    /// Bytes that messages in reassembly may hold on this node, all links
    /// together (each holds the size its first fragment claims). A first
    /// fragment that does not fit fails its link with NoBuffer. At least
    /// `limits.max_message`.
    pub reassembly_budget: usize,
    /// Accepted connections that may be handshaking at once; more are
    /// closed as soon as they are accepted (each costs a descriptor, a
    /// buffer and two tasks until its handshake bound).
    pub max_handshaking: usize,
    /// How often the failure detector probes each peer.
    pub heartbeat_interval: Duration,
    /// A peer not heard from for this long is declared dead (HostDead).
    pub dead_after: Duration,
    /// How long a link may take to connect and authenticate.
    pub connect_timeout: Duration,
    /// How long an accepted connection may take to complete the handshake
    /// before it is refused with TimedOut (generous: a busy peer is not a
    /// silent one).
    pub handshake_timeout: Duration,
    /// First and largest delay between reconnection attempts.
    pub reconnect_backoff: (Duration, Duration),
    /// Requests received on one link and not yet answered; more are
    /// answered NoBuffer at once (a peer cannot pile up handler work).
    pub max_requests_per_link: usize,
    /// Protocol messages from one link that may wait for the inbox task
    /// (ports handled off the receiving thread, naming); while that many
    /// wait, the link is not read, so a member that sends faster than this
    /// node handles is slowed down by TCP instead of growing a queue.
    pub max_inbox_per_link: usize,
    /// How long a TCP link may have frames waiting for the peer to read
    /// without any of them being taken; then the link is closed
    /// (TimedOut): a peer that stops reading must not hold a socket and its
    /// buffered bytes forever.
    pub write_stall_timeout: Duration,
    /// Frames queued for a peer while its link is being established; more
    /// gives NoBuffer.
    pub max_queued_frames: usize,
    /// Identity of this host, used to find same-host peers.
    pub host_id: String,
    /// Shared-memory channel settings (ring size, waiting policy, where the
    /// rendezvous live).
    pub shm: crate::shm::ShmConfig,
}

impl TransportConfig {
    /// A member node with default settings and no TCP listener.
    pub fn node(node: NodeId, incarnation: Incarnation) -> Self {
        TransportConfig {
            node,
            incarnation,
            role: PeerRole::Node,
            secret: Vec::new(),
            listen: None,
            channels: ChannelSet::default(),
            tls: None,
            hub: None,
            fault: None,
            limits: Limits::default(),
            reassembly_budget: 256 << 20,
            max_handshaking: 256,
            heartbeat_interval: Duration::from_millis(200),
            dead_after: Duration::from_millis(2000),
            connect_timeout: Duration::from_millis(2000),
            handshake_timeout: Duration::from_secs(10),
            reconnect_backoff: (Duration::from_millis(20), Duration::from_millis(1000)),
            max_queued_frames: 4096,
            max_requests_per_link: 16384,
            max_inbox_per_link: 16384,
            write_stall_timeout: Duration::from_secs(30),
            host_id: crate::host::host_id(),
            shm: crate::shm::ShmConfig::default(),
        }
    }

    /// A client (not a member) with default settings.
    pub fn client(incarnation: Incarnation) -> Self {
        TransportConfig {
            role: PeerRole::Client,
            channels: ChannelSet {
                inproc: false,
                shm: false,
                tcp: true,
            },
            ..TransportConfig::node(NodeId::CLIENT, incarnation)
        }
    }

    /// Checks the configuration for values that cannot work.
    ///
    /// Fails with a message naming the first bad setting.
    pub fn validate(&self) -> Result<(), String> {
        if self.role == PeerRole::Node && !self.node.is_member() {
            return Err(format!(
                "node id {} is not a member id: 0 is reserved for clients, {} is reserved",
                self.node,
                u32::MAX
            ));
        }
        if self.limits.max_frame < weft_wire::codec::MIN_MAX_FRAME {
            return Err(format!(
                "max frame size must be at least {} bytes",
                weft_wire::codec::MIN_MAX_FRAME
            ));
        }
        if self.limits.max_message < self.limits.max_frame {
            return Err("max message size must be at least the max frame size".into());
        }
        if self.reassembly_budget < self.limits.max_message {
            return Err("the reassembly budget must hold at least one max-size message".into());
        }
        if self.limits.reassembly_timeout.is_zero() {
            return Err("the reassembly timeout must not be zero".into());
        }
        if self.max_inbox_per_link < 2 {
            return Err("at least two inbox messages per link must be allowed".into());
        }
        if self.max_requests_per_link == 0 {
            return Err("at least one request per link must be allowed".into());
        }
        if self.write_stall_timeout.is_zero() {
            return Err("the write stall timeout must not be zero".into());
        }
        if self.max_handshaking == 0 {
            return Err("at least one connection must be allowed to handshake".into());
        }
        if self.heartbeat_interval.is_zero() || self.dead_after < self.heartbeat_interval * 2 {
            return Err("dead_after must be at least twice the heartbeat interval".into());
        }
        if !(self.channels.inproc || self.channels.tcp || self.channels.shm) {
            return Err("at least one channel must be enabled".into());
        }
        if self.channels.shm {
            self.shm.validate(&self.limits)?;
        }
        Ok(())
    }
}
