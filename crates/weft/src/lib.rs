//! weft: a transactional fabric for distributed programs.
//!
//! Remote calls, group messages, shared state and resources such as a
//! key-value store or PostgreSQL rows commit or roll back together, across
//! processes and machines. This facade crate is what a program depends on:
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use weft::{Address, Node, ServiceOptions};
//! let node = weft::Node::builder(1).start().await?;
//! node.register("greet", ServiceOptions::no_state(), |_ctx, name: String| async move {
//!     Ok(format!("hello, {name}"))
//! })?;
//! let tx = node.begin();
//! let reply: String = tx.call(&"greet@1".parse::<Address>()?, "weft".to_string()).await?;
//! tx.commit().await?;
//! # let _ = reply; Ok(()) }
//! ```

pub mod admin;
pub mod metrics;
mod node;

pub use node::{Node, NodeBuilder, NodeError};
pub use weft_group as group;
pub use weft_kv as kv;
pub use weft_log::{Durability, Log, LogConfig, Lsn, PowerLoss};
pub use weft_rpc::{
    CallContext, Handler, ParticipationClass, Plugin, Rpc, RpcConfig, ServiceInfo, ServiceOptions,
    SubTransaction, Transaction,
};
pub use weft_transport::{
    BusyPoll, ChannelKind, ChannelSet, ClusterView, Endpoint, FaultPlan, FaultScope, InprocHub,
    LinkFaults, MembershipEvent, NodeInfo, Seed, TlsConfig,
};
pub use weft_tx::{Outcome, Resource, TmConfig, TxManager, TxStatus, Vote};
pub use weft_wire::{
    Address, Failure, GroupId, Incarnation, NodeId, Payload, Status, SubPath, Tid, TxContext,
};
