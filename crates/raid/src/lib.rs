//! The Raid distributed database on weft, and the DebitCredit benchmark.
//!
//! Raid (Bhargava et al.) splits transaction processing into servers: the
//! action driver (AD) runs a client's transactions, the concurrency
//! controller (CC) enforces strict two-phase locking, the access manager (AM)
//! stores relations, the replication controller (RC) keeps copies
//! consistent (read one, write all), and the atomicity controller (AC)
//! commits. Here each site is a weft node: the AM is a weft KV store, the
//! CC a lock table, the RC the placement rule plus each site's executor, and
//! the AC is weft's transaction manager (presumed-abort two-phase commit down
//! the tree the AD's calls build), not a copy of it.

pub mod ad;
pub mod audit;
pub mod cc;
pub mod cluster;
pub mod load;
pub mod marker;
pub mod rc;
pub mod schema;
pub mod site;
pub mod violation;
pub mod workload;

pub use ad::{Action, Ad, AdReply, AdRequest, Shipped, ShippedReply};
pub use audit::{Audit, SiteAudit};
pub use cluster::{ClusterOptions, Counters, RaidCluster};
pub use load::{LoadReply, LoadRequest};
pub use marker::MarkerLimits;
pub use rc::Replicas;
pub use schema::{Item, Relation, Sizes};
pub use site::{
    Bookkeeping, CheckpointStats, RaidSite, SiteConfig, AD_SERVICE, AUDIT_SERVICE, LOAD_SERVICE,
    SITE_SERVICE,
};
pub use workload::{run_closed, Mode, RunReport, Workload};
