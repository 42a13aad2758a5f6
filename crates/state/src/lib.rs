//! weft's shared state (InterWeave, seed 003): segments named by URL whose
//! home node keeps the master copy; typed, self-descriptive blocks read and
//! written as native Rust values; machine-independent pointers; twins and
//! diffs in primitive units; coherence models; and the transaction metadata
//! table that rides in the transaction's baggage.
//!
//! The sans-IO [`core`] decides; [`service`] (the home node) and [`client`]
//! (a node's cache, locks and held diffs) run it over weft's RPC, and
//! [`peer`] is what clients say to each other. The wire and disk forms are
//! specified in `docs/state.md`.

pub mod core;

pub use crate::core::codec::{decode_diff, decode_image, encode_diff, encode_image};
pub use crate::core::coherence::{CacheView, Coherence};
pub use crate::core::error::StateError;
pub use crate::core::mip::{BlockRef, Mip, SegUrl};
pub use crate::core::record::Typed;
pub use crate::core::segment::{
    check_consistent, Block, Diff, DiffOp, SegLimits, Segment, SegmentImage,
};
pub use crate::core::tmt::{LockCase, LockMode, Tmt, TmtEntry};
pub use crate::core::twin::{collect, Twins, Writer};
pub use crate::core::types::{Field, PrimKind, TypeDesc, TypeLimits, Unit};
pub mod client;
pub mod peer;
pub mod service;

pub use client::StateClient;
pub use service::{HomeConfig, StateHome, SERVICE};
