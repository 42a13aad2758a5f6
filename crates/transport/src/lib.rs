//! weft's messaging layer: one [`Endpoint`] per node moves frames to peers over
//! the cheapest channel that reaches them (in-process hand-off, shared memory,
//! TCP, optionally inside mutual TLS), authenticates every link with the cluster secret, keeps the cluster
//! directory (naming), detects dead peers with heartbeats, and can inject
//! faults for tests.

pub mod certs;
pub mod channel;
pub mod config;
pub mod fault;
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod fuzzing;
pub mod host;
pub mod metrics;
pub mod naming;
pub mod shm;
pub mod tls;

mod calls;
mod detector;
mod endpoint;
mod handshake;
mod inproc;
mod link;
mod poll;
mod tcp;

pub use channel::{ChannelKind, IoError, LinkIo};
pub use config::{ChannelSet, TransportConfig};
pub use endpoint::{
    ClusterView, Endpoint, MembershipEvent, NodeStatus, PortHandler, RequestHandler, Responder,
    Seed, StartError, StatsSnapshot,
};
pub use fault::{FaultPlan, FaultScope, LinkFaults, Verdict};
pub use inproc::InprocHub;
pub use link::PeerRef;
pub use naming::{NamingMsg, NodeInfo};
pub use poll::BusyPoll;
pub use shm::{ShmConfig, SpinPolicy};
pub use tls::{TlsConfig, TlsError};
