//! The transport's figures in the process's metrics registry (the `metrics`
//! facade; names and labels in docs/metrics.md): frames and bytes per channel
//! and direction, links up and down per channel.
//!
//! Owns this layer's metric names. The process-wide switch that says an
//! exporter is installed ([`set_exporting`], [`exporting`]) and the kept
//! handles for hot paths ([`FixedCounter`], [`FixedHistogram`]) are the log
//! crate's (`weft_log::metrics`, the lowest crate that records metrics),
//! re-exported here for the layers that see the transport. Must never
//! allocate, lock or build a label from a run-time string on a frame's path:
//! every metric here has a fixed key (channel and direction are literals),
//! and the per-frame ones are only touched while exporting, through handles
//! kept after their first use: without an exporter a frame costs one relaxed
//! load here.

use std::sync::OnceLock;

use metrics::Counter;

use weft_wire::Status;

use crate::channel::ChannelKind;

pub use weft_log::metrics::{exporting, set_exporting, FixedCounter, FixedHistogram};

/// One counter per channel, registered on first use while exporting and
/// kept: a frame's update is then one relaxed atomic add, with no registry
/// lookup (frames are the most frequent events weft counts).
struct PerChannel([OnceLock<Counter>; 3]);

impl PerChannel {
    const fn new() -> PerChannel {
        PerChannel([const { OnceLock::new() }; 3])
    }

    /// Adds `n` to the counter `name{channel=kind}` if exporting.
    fn add(&self, name: &'static str, kind: ChannelKind, n: u64) {
        if !exporting() {
            return;
        }
        let i = kind as usize;
        self.0[i]
            .get_or_init(|| metrics::counter!(name, "channel" => kind.name()))
            .increment(n);
    }
}

static FRAMES_SENT: PerChannel = PerChannel::new();
static FRAMES_RECEIVED: PerChannel = PerChannel::new();
static BYTES_SENT: PerChannel = PerChannel::new();
static BYTES_RECEIVED: PerChannel = PerChannel::new();

/// A frame handed to a link's medium.
pub(crate) fn frame_sent(kind: ChannelKind) {
    FRAMES_SENT.add("weft_transport_frames_sent_total", kind, 1);
}

/// A frame received from a link's medium.
pub(crate) fn frame_received(kind: ChannelKind) {
    FRAMES_RECEIVED.add("weft_transport_frames_received_total", kind, 1);
}

/// Encoded bytes written to a medium (shm, tcp; in-process frames move as
/// values and have no bytes).
pub(crate) fn bytes_sent(kind: ChannelKind, n: usize) {
    BYTES_SENT.add("weft_transport_sent_bytes_total", kind, n as u64);
}

/// Bytes read from a medium.
pub(crate) fn bytes_received(kind: ChannelKind, n: usize) {
    BYTES_RECEIVED.add("weft_transport_received_bytes_total", kind, n as u64);
}

/// Expands to the same counter update for each channel, with the channel as
/// a literal label, so that every key is static.
macro_rules! per_channel {
    ($kind:expr, $name:literal, $n:expr) => {
        match $kind {
            ChannelKind::Inproc => metrics::counter!($name, "channel" => "inproc").increment($n),
            ChannelKind::Shm => metrics::counter!($name, "channel" => "shm").increment($n),
            ChannelKind::Tcp => metrics::counter!($name, "channel" => "tcp").increment($n),
        }
    };
}

/// A link to a member node completed its handshake.
pub(crate) fn link_up(kind: ChannelKind) {
    per_channel!(kind, "weft_transport_links_up_total", 1);
    match kind {
        ChannelKind::Inproc => {
            metrics::gauge!("weft_transport_links", "channel" => "inproc").increment(1.0)
        }
        ChannelKind::Shm => {
            metrics::gauge!("weft_transport_links", "channel" => "shm").increment(1.0)
        }
        ChannelKind::Tcp => {
            metrics::gauge!("weft_transport_links", "channel" => "tcp").increment(1.0)
        }
    }
}

/// A link to a member node that was up closed, for `cause`.
pub(crate) fn link_down(kind: ChannelKind, cause: Status) {
    match kind {
        ChannelKind::Inproc => {
            metrics::gauge!("weft_transport_links", "channel" => "inproc").decrement(1.0)
        }
        ChannelKind::Shm => {
            metrics::gauge!("weft_transport_links", "channel" => "shm").decrement(1.0)
        }
        ChannelKind::Tcp => {
            metrics::gauge!("weft_transport_links", "channel" => "tcp").decrement(1.0)
        }
    }
    if exporting() {
        metrics::counter!("weft_transport_links_down_total",
            "channel" => kind.name(), "cause" => cause.name())
        .increment(1);
    }
}
