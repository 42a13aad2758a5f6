//! TEMPORARY until the fs crate lands.
use super::capture::Change;
use super::Session;
use std::path::{Path, PathBuf};
use std::time::SystemTime;
use weft::NodeBuilder;
use weft_wire::{Failure, Status, TxContext};
pub async fn apply(
    _: &Session,
    _: &TxContext,
    _: &Path,
    _: &[Change],
    _: SystemTime,
) -> Result<(), Failure> {
    Err(Failure::new(Status::AddrError, "no volumes yet"))
}
pub fn with_volumes(b: NodeBuilder, _: &[PathBuf]) -> anyhow::Result<NodeBuilder> {
    Ok(b)
}
