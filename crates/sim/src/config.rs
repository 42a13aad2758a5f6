//! The knobs of a simulated run: cluster size, workload, fault rates, phase lengths.
//!
//! Owns the defaults ("the full fault mix") and their bounds. Must never hold run state.

/// Configuration of one simulated run. The seed picks every random choice; the same seed and
/// configuration replay the same run.
#[derive(Clone, Debug)]
pub struct SimConfig {
    /// Nodes in the cluster (2..=8).
    pub nodes: u32,
    /// Bank accounts held by each node (Jepsen-style bank, partitioned by node).
    pub accounts_per_node: u8,
    /// Starting balance of each bank account.
    pub initial_balance: i64,
    /// DebitCredit accounts (replicated on every node, Raid's write-all).
    pub dc_accounts: u64,
    /// DebitCredit tellers.
    pub dc_tellers: u64,
    /// Length of the phase with workload and faults, microseconds.
    pub fault_micros: u64,
    /// Longest quiet phase after it (faults healed, nodes restarted, no new work), in which
    /// every transaction must end; microseconds.
    pub quiet_micros: u64,
    /// Mean gap between transactions started (cluster-wide), microseconds.
    pub tx_gap_micros: u64,
    /// Probability that a message is dropped.
    pub drop: f64,
    /// Probability that a message is delivered twice.
    pub duplicate: f64,
    /// Message delay bounds, microseconds (messages reorder within them).
    pub latency: (u64, u64),
    /// Mean gap between random node crashes during the fault phase, microseconds (0: none).
    pub crash_gap_micros: u64,
    /// Probability of crashing at a named crash point each time one is passed.
    pub crash_point_p: f64,
    /// Mean gap between partitions (one link cut for a while), microseconds (0: none).
    pub partition_gap_micros: u64,
    /// Mean gap between injected disk sync failures (per cluster), microseconds (0: none).
    pub disk_fault_gap_micros: u64,
    /// Mean gap between checkpoints of a node, microseconds.
    pub checkpoint_gap_micros: u64,
    /// Log segment size (small, so segments roll and checkpoints delete them).
    pub segment_size: u64,
    /// Keep every event line (for `--trace`), not just the last ones.
    pub trace: bool,
    /// A bug planted in the simulated nodes' driver, to show that the checkers catch it.
    pub sabotage: Sabotage,
}

/// A deliberate bug in how the simulator drives the nodes (never in a real run): the
/// checkers must catch each one.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Sabotage {
    /// No bug.
    #[default]
    None,
    /// A participant votes Yes without forcing its prepare record (the force is skipped and
    /// reported done).
    SkipPrepareForce,
    /// A node answers Committed to an inquiry about a transaction it has no record of.
    CommitForgotten,
}

impl Default for SimConfig {
    /// The full fault mix.
    fn default() -> Self {
        SimConfig {
            nodes: 3,
            accounts_per_node: 6,
            initial_balance: 100,
            dc_accounts: 8,
            dc_tellers: 4,
            fault_micros: 3_000_000,
            quiet_micros: 60_000_000,
            tx_gap_micros: 20_000,
            drop: 0.03,
            duplicate: 0.02,
            latency: (200, 8_000),
            crash_gap_micros: 700_000,
            crash_point_p: 0.05,
            partition_gap_micros: 900_000,
            disk_fault_gap_micros: 400_000,
            checkpoint_gap_micros: 400_000,
            segment_size: 8 << 10,
            trace: false,
            sabotage: Sabotage::None,
        }
    }
}

impl SimConfig {
    /// No fault of any kind: only the workload (a sanity baseline).
    pub fn calm() -> Self {
        SimConfig {
            drop: 0.0,
            duplicate: 0.0,
            crash_gap_micros: 0,
            crash_point_p: 0.0,
            partition_gap_micros: 0,
            disk_fault_gap_micros: 0,
            ..SimConfig::default()
        }
    }

    /// Checks the values. Returns why they do not fit.
    pub fn validate(&self) -> Result<(), String> {
        if !(2..=8).contains(&self.nodes) {
            return Err(format!("nodes must be 2..=8, not {}", self.nodes));
        }
        if self.accounts_per_node == 0 || self.dc_accounts == 0 || self.dc_tellers == 0 {
            return Err("every table needs at least one row".into());
        }
        for p in [self.drop, self.duplicate, self.crash_point_p] {
            if !(0.0..1.0).contains(&p) {
                return Err(format!("probability {p} outside [0, 1)"));
            }
        }
        if self.latency.0 > self.latency.1 || self.latency.1 == 0 {
            return Err("latency bounds must be ordered and positive".into());
        }
        if self.tx_gap_micros == 0 || self.checkpoint_gap_micros == 0 {
            return Err("gaps must be positive".into());
        }
        Ok(())
    }
}
