//! What a run reports: violations found by the checkers, and coverage of the crash points and
//! fault kinds the run reached.
//!
//! Owns the names of crash points and fault kinds and their counters. Must never decide
//! whether a run passed beyond "no violation".

use std::collections::BTreeMap;
use std::fmt;

/// A named crash point: the commit protocol's (`weft_tx::node::CrashPoint`, emitted by the
/// node core), plus the points the simulator adds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum CrashPoint {
    /// One of the commit protocol's named points, reached by the node core.
    Protocol(weft_tx::node::CrashPoint),
    /// A participant executed a call and has not answered it.
    ParticipantAfterCall,
    /// A node is writing a checkpoint (snapshot written, log not yet truncated).
    Checkpoint,
}

impl CrashPoint {
    /// Every point, for coverage reports: the protocol's, then the simulator's.
    pub const ALL: [CrashPoint; 8] = {
        let tm = weft_tx::node::CrashPoint::ALL;
        [
            CrashPoint::Protocol(tm[0]),
            CrashPoint::Protocol(tm[1]),
            CrashPoint::Protocol(tm[2]),
            CrashPoint::Protocol(tm[3]),
            CrashPoint::Protocol(tm[4]),
            CrashPoint::Protocol(tm[5]),
            CrashPoint::ParticipantAfterCall,
            CrashPoint::Checkpoint,
        ]
    };

    /// The point's name (the node core's names for the commit protocol's points).
    pub fn name(self) -> &'static str {
        match self {
            CrashPoint::Protocol(p) => p.name(),
            CrashPoint::ParticipantAfterCall => "participant-after-call",
            CrashPoint::Checkpoint => "checkpoint",
        }
    }
}

impl From<weft_tx::node::CrashPoint> for CrashPoint {
    fn from(p: weft_tx::node::CrashPoint) -> Self {
        CrashPoint::Protocol(p)
    }
}

/// A kind of injected fault.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum FaultKind {
    /// A message was dropped.
    NetDrop,
    /// A message was delivered twice.
    NetDuplicate,
    /// A message was lost to a partition.
    NetPartition,
    /// A partition was healed.
    NetHeal,
    /// A node crashed at a random instant.
    CrashRandom,
    /// A node crashed at a named crash point.
    CrashAtPoint,
    /// An fdatasync/fsync failed with EIO (the node stops).
    FsyncFailure,
    /// A directory fsync failed with EIO (the node stops).
    DirSyncFailure,
    /// A crash discarded unsynced writes.
    LostUnsyncedWrite,
    /// A crash kept only a prefix of an unsynced write.
    TornWrite,
    /// A crash kept an unsynced write whole.
    KeptUnsyncedWrite,
    /// A crash undid a directory entry that was not synced.
    LostDirEntry,
    /// Recovery cut a torn or corrupt log tail.
    LogTailCut,
}

impl FaultKind {
    /// Every kind.
    pub const ALL: [FaultKind; 13] = [
        FaultKind::NetDrop,
        FaultKind::NetDuplicate,
        FaultKind::NetPartition,
        FaultKind::NetHeal,
        FaultKind::CrashRandom,
        FaultKind::CrashAtPoint,
        FaultKind::FsyncFailure,
        FaultKind::DirSyncFailure,
        FaultKind::LostUnsyncedWrite,
        FaultKind::TornWrite,
        FaultKind::KeptUnsyncedWrite,
        FaultKind::LostDirEntry,
        FaultKind::LogTailCut,
    ];

    /// The disk fault kinds the CI batch must reach.
    pub const DISK: [FaultKind; 6] = [
        FaultKind::FsyncFailure,
        FaultKind::DirSyncFailure,
        FaultKind::LostUnsyncedWrite,
        FaultKind::TornWrite,
        FaultKind::LostDirEntry,
        FaultKind::LogTailCut,
    ];

    /// The kind's name.
    pub fn name(self) -> &'static str {
        match self {
            FaultKind::NetDrop => "net-drop",
            FaultKind::NetDuplicate => "net-duplicate",
            FaultKind::NetPartition => "net-partition",
            FaultKind::NetHeal => "net-heal",
            FaultKind::CrashRandom => "crash-random",
            FaultKind::CrashAtPoint => "crash-at-point",
            FaultKind::FsyncFailure => "disk-fsync-eio",
            FaultKind::DirSyncFailure => "disk-dirsync-eio",
            FaultKind::LostUnsyncedWrite => "disk-lost-unsynced-write",
            FaultKind::TornWrite => "disk-torn-write",
            FaultKind::KeptUnsyncedWrite => "disk-kept-unsynced-write",
            FaultKind::LostDirEntry => "disk-lost-dir-entry",
            FaultKind::LogTailCut => "log-tail-cut",
        }
    }
}

/// Counters of what a run (or many) reached.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Coverage {
    /// Crashes made at each named point.
    pub crash_points: BTreeMap<CrashPoint, u64>,
    /// Times each point was passed (crash or not).
    pub points_reached: BTreeMap<CrashPoint, u64>,
    /// Faults of each kind.
    pub faults: BTreeMap<FaultKind, u64>,
    /// Transactions committed (acknowledged to their client).
    pub committed: u64,
    /// Transactions aborted (reported to their client).
    pub aborted: u64,
    /// Transactions whose client died with its coordinator.
    pub unknown: u64,
    /// Read-only bank checks that committed (each one checked).
    pub checks: u64,
    /// DebitCredit audits run on a replica.
    pub audits: u64,
    /// Node restarts (each one a recovery from the simulated disk).
    pub recoveries: u64,
    /// Simulated time, microseconds.
    pub sim_micros: u64,
}

impl Coverage {
    /// Adds `n` faults of `kind`.
    pub fn fault(&mut self, kind: FaultKind, n: u64) {
        if n > 0 {
            *self.faults.entry(kind).or_default() += n;
        }
    }

    /// Adds another run's counters.
    pub fn merge(&mut self, o: &Coverage) {
        for (k, v) in &o.crash_points {
            *self.crash_points.entry(*k).or_default() += v;
        }
        for (k, v) in &o.points_reached {
            *self.points_reached.entry(*k).or_default() += v;
        }
        for (k, v) in &o.faults {
            *self.faults.entry(*k).or_default() += v;
        }
        self.committed += o.committed;
        self.aborted += o.aborted;
        self.unknown += o.unknown;
        self.checks += o.checks;
        self.audits += o.audits;
        self.recoveries += o.recoveries;
        self.sim_micros += o.sim_micros;
    }

    /// Crash points never crashed at, and disk fault kinds never reached.
    pub fn gaps(&self) -> Vec<String> {
        let mut out = Vec::new();
        for p in CrashPoint::ALL {
            if self.crash_points.get(&p).copied().unwrap_or(0) == 0 {
                out.push(format!("crash point {} never crashed at", p.name()));
            }
        }
        for k in FaultKind::DISK {
            if self.faults.get(&k).copied().unwrap_or(0) == 0 {
                out.push(format!("disk fault {} never reached", k.name()));
            }
        }
        out
    }
}

impl fmt::Display for Coverage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "transactions: {} committed, {} aborted, {} lost with their client; {} bank checks, \
             {} audits, {} recoveries",
            self.committed, self.aborted, self.unknown, self.checks, self.audits, self.recoveries
        )?;
        writeln!(f, "crash points (crashed at / reached):")?;
        for p in CrashPoint::ALL {
            writeln!(
                f,
                "  {:34} {:>8} / {}",
                p.name(),
                self.crash_points.get(&p).copied().unwrap_or(0),
                self.points_reached.get(&p).copied().unwrap_or(0)
            )?;
        }
        writeln!(f, "faults:")?;
        for k in FaultKind::ALL {
            writeln!(
                f,
                "  {:34} {:>8}",
                k.name(),
                self.faults.get(&k).copied().unwrap_or(0)
            )?;
        }
        Ok(())
    }
}

/// A checker's finding.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Violation {
    /// Which property: atomicity, durability, isolation, audit, liveness, recovery.
    pub property: &'static str,
    /// What was seen.
    pub detail: String,
    /// Simulated time it was found at, microseconds.
    pub at_micros: u64,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "[{}] at {:.3}s: {}",
            self.property,
            self.at_micros as f64 / 1e6,
            self.detail
        )
    }
}

/// The result of one seed.
#[derive(Clone, Debug)]
pub struct SeedReport {
    /// The seed.
    pub seed: u64,
    /// What the checkers found (empty: the run passed).
    pub violations: Vec<Violation>,
    /// What the run reached.
    pub coverage: Coverage,
    /// The last events before the end (tracing prints all of them as they happen).
    pub history: Vec<String>,
}

impl SeedReport {
    /// True when no checker found anything.
    pub fn passed(&self) -> bool {
        self.violations.is_empty()
    }

    /// The failure text: seed, violations, how to replay, and the event history.
    pub fn failure_text(&self) -> String {
        let mut s = format!(
            "seed {} FAILED ({} violation(s)); replay with `weft sim --seeds 1 --from {} --trace`\n",
            self.seed,
            self.violations.len(),
            self.seed
        );
        for v in &self.violations {
            s.push_str(&format!("  {v}\n"));
        }
        s.push_str("event history (last events):\n");
        for h in &self.history {
            s.push_str("  ");
            s.push_str(h);
            s.push('\n');
        }
        s
    }
}
