//! The shared-memory channel: nodes on one host, in different processes,
//! exchange frames through a segment per pair of nodes holding two
//! single-producer single-consumer rings (Raidcomm V.3's shared memory plus
//! direct control passing, Raid §4.3; the channel resolution picks it for a
//! same-host peer, Raid §5.1).
//!
//! - `mem`: the only module with `unsafe` (memfd, mmap, futex, descriptor
//!   passing, process liveness, moving a thread off a CPU).
//! - `wait`: how a waiting thread spins (the adaptive budget) and where it
//!   spins (one end of a pair spinning on one CPU moves to another).
//! - `ring`: the segment layout and the byte ring, safe code over atomics,
//!   hostile-peer proof (every index masked, every value checked).
//! - `channel`: one link end: sending, the reader thread (spin, yield, futex
//!   park, adaptive), orderly close and death.
//! - `setup`: the rendezvous socket, the segment hand-over, resolution and
//!   the upgrade of same-host TCP links.
//! - `poll`: the rings a [`crate::BusyPoll`] drains, and the count of active
//!   pollers the reader threads stand aside for.
//! - [`bench`](mod@bench): the helper process and the measuring tools of `weft bench`.
//!
//! Owns everything shared-memory. Must never trust the segment's contents
//! and never leave a rendezvous file behind on an orderly stop.

pub mod bench;
mod channel;
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod fuzzing;
mod mem;
pub(crate) mod poll;
mod ring;
mod setup;
mod wait;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

pub(crate) use setup::{consider_upgrade, listen, resolve};

/// This process's real user id. Never fails.
pub fn current_uid() -> u32 {
    mem::uid()
}

/// The entries of `dir` named `<prefix><pid>-...` whose process `pid` is
/// gone (never this process's own): the leftovers of killed processes,
/// for the caller to remove. An unreadable directory has none.
pub fn leftovers_of_dead_processes(dir: &Path, prefix: &str) -> Vec<std::fs::DirEntry> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter(|entry| {
            let name = entry.file_name();
            let Some(rest) = name.to_str().and_then(|n| n.strip_prefix(prefix)) else {
                return false;
            };
            let Some(pid) = rest.split('-').next().and_then(|p| p.parse::<u32>().ok()) else {
                return false;
            };
            pid != std::process::id() && !mem::process_alive(pid)
        })
        .collect()
}

use crate::channel::ChannelKind;
use crate::endpoint::Endpoint;
use weft_wire::{Failure, Limits, NodeId, Status};

/// How a thread waits for shared-memory traffic: spin for an adaptive budget
/// between `min_spin` and `max_spin`, then yield the CPU `yields` times, then
/// sleep on a futex until the peer rings (or `park_timeout` passes, a safety
/// net: a lost wake-up costs at most that).
///
/// The budget grows when traffic comes while spinning or soon after a sleep
/// began, and shrinks when spinning was in vain, so a busy pair never enters
/// the kernel and an idle one costs almost nothing. A spin budget near the
/// cost of a kernel wake-up (~22 µs on the reference machine) wastes at most
/// that much per idle period.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SpinPolicy {
    /// Smallest spin budget.
    pub min_spin: Duration,
    /// Largest spin budget (zero: never spin).
    pub max_spin: Duration,
    /// `sched_yield` rounds between spinning and sleeping.
    pub yields: u32,
    /// Longest futex sleep before looking again.
    pub park_timeout: Duration,
}

impl Default for SpinPolicy {
    fn default() -> Self {
        SpinPolicy {
            min_spin: Duration::from_micros(2),
            max_spin: Duration::from_micros(50),
            yields: 2,
            park_timeout: Duration::from_millis(250),
        }
    }
}

/// Settings of the shared-memory channel.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShmConfig {
    /// Directory of the rendezvous sockets (`/dev/shm` by default; the
    /// system's temporary directory when it does not exist).
    pub dir: PathBuf,
    /// Bytes of each ring (one per direction), a power of two between 4 KiB
    /// and 256 MiB. The segment is one page plus two rings. Chosen by the
    /// side that opens the link.
    pub ring_bytes: usize,
    /// Encoded bytes allowed to wait for room in a full ring before sends
    /// fail with NoBuffer.
    pub max_pending_bytes: usize,
    /// How reader threads wait.
    pub spin: SpinPolicy,
}

impl Default for ShmConfig {
    fn default() -> Self {
        ShmConfig {
            dir: PathBuf::from("/dev/shm"),
            ring_bytes: 1 << 20,
            max_pending_bytes: 256 << 20,
            spin: SpinPolicy::default(),
        }
    }
}

impl ShmConfig {
    /// Checks the settings against the frame limits.
    ///
    /// Fails with a message naming the first bad setting.
    pub fn validate(&self, limits: &Limits) -> Result<(), String> {
        ring::Layout::new(self.ring_bytes)?;
        if self.max_pending_bytes < limits.max_message {
            return Err(format!(
                "shm max_pending_bytes ({}) must hold the largest message ({})",
                self.max_pending_bytes, limits.max_message
            ));
        }
        let s = &self.spin;
        if s.min_spin > s.max_spin || s.max_spin > Duration::from_millis(10) {
            return Err("shm spin budget must satisfy min <= max <= 10ms".into());
        }
        if s.yields > 1000 {
            return Err("shm yields must be at most 1000".into());
        }
        if s.park_timeout < Duration::from_millis(1) || s.park_timeout > Duration::from_secs(10) {
            return Err("shm park timeout must be between 1ms and 10s".into());
        }
        Ok(())
    }
}

/// Waits until this node's link to `node` runs over `kind` (e.g. until a
/// same-host TCP link was upgraded to shared memory), polling the cluster
/// view.
///
/// Fails with TimedOut when it does not happen within `within`.
pub async fn wait_for_channel(
    ep: &Endpoint,
    node: NodeId,
    kind: ChannelKind,
    within: Duration,
) -> Result<(), Failure> {
    let deadline = Instant::now() + within;
    loop {
        let now_kind = ep
            .view()
            .nodes
            .into_iter()
            .find(|n| n.info.id == node)
            .and_then(|n| n.channel);
        if now_kind == Some(kind) {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(Failure::new(
                Status::TimedOut,
                format!("link to node {node} runs over {now_kind:?}, not {kind}, after {within:?}"),
            ));
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

#[cfg(test)]
pub(crate) mod tests {
    /// Unit tests that start reader threads or busy pollers run one at a
    /// time (a busy poller makes every reader thread of the process stand
    /// aside).
    pub(crate) static SERIAL: parking_lot::Mutex<()> = parking_lot::Mutex::new(());

    use super::*;

    #[test]
    fn config_bounds() {
        let l = Limits::default();
        assert!(ShmConfig::default().validate(&l).is_ok());
        let bad_ring = ShmConfig {
            ring_bytes: 5000,
            ..ShmConfig::default()
        };
        assert!(bad_ring.validate(&l).is_err());
        let small_pending = ShmConfig {
            max_pending_bytes: 10,
            ..ShmConfig::default()
        };
        assert!(small_pending.validate(&l).is_err());
        let mut spin = ShmConfig::default();
        spin.spin.min_spin = Duration::from_millis(1);
        spin.spin.max_spin = Duration::from_micros(1);
        assert!(spin.validate(&l).is_err());
    }
}
