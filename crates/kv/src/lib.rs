//! weft's transactional key-value service.
//!
//! For now this crate holds the lock manager ([`lock`]) shared by the KV
//! service and the Raid concurrency controller: strict two-phase locking with
//! nested transactions, as a sans-IO lock table plus a thin async shell.
pub mod lock;
