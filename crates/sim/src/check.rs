//! The workloads' plans and the checkers.
//!
//! Owns: what each transaction intends to do (bank transfer, read-only bank check, Raid
//! DebitCredit written to every replica), what every node applied (commit or abort of each
//! branch) and what clients were told, and the checks: atomicity (no transaction both
//! committed and aborted anywhere), durability (every acknowledged commit, and every commit
//! applied anywhere, is in the final committed state of every node it wrote, exactly once),
//! isolation (a committed read-only check saw the bank's constant total; the DebitCredit audit
//! holds on every replica and the replicas agree). Must never look at uncommitted state to
//! decide a check.

use std::collections::{BTreeMap, BTreeSet};

use bytes::Bytes;
use rand::Rng;
use rand_chacha::ChaCha8Rng;
use weft_kv::store::{Committed, Image, Store};
use weft_kv::{int_value, parse_int};
use weft_raid::audit::{Audit, SiteAudit};
use weft_raid::rc::{Replicas, PLACEMENT_KEY};
use weft_raid::schema::{balance, tuple, HistoryRow, Item, Relation};
use weft_tx::Outcome;
use weft_wire::{NodeId, Tid};

use crate::config::SimConfig;
use crate::report::Violation;
use crate::world::{dc_image, history};

/// What a transaction of the workload does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// Moves an amount between two bank accounts (on the same or different nodes).
    Transfer,
    /// Reads every bank account and checks the total (read-only).
    Check,
    /// Raid DebitCredit: account, teller and branch updated and a history row inserted on
    /// every replica.
    DebitCredit,
}

/// One operation of a call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Op {
    /// Read an integer (shared lock).
    Read(Bytes),
    /// Add to an integer (exclusive lock).
    AddInt(Bytes, i64),
    /// Add to a Raid balance tuple (exclusive lock).
    AddTuple(Bytes, i64),
    /// Insert a value (exclusive lock).
    Insert(Bytes, Bytes),
}

/// What a transaction does at each node (by node index).
pub type Plan = Vec<(usize, Vec<Op>)>;

/// The key of bank account `idx` held by node `node` (0-based).
pub fn bank_key(node: usize, idx: u8) -> Bytes {
    Bytes::from(vec![b'B', node as u8, idx])
}

/// The committed pairs of a simulated node's store. The simulator runs the KV store's memory
/// engine (its snapshots go through the simulated disk); the disk engine's own crash points are
/// enumerated by `weft_kv`'s tests.
pub fn committed_map(store: &Store) -> &BTreeMap<Bytes, Bytes> {
    match store.committed_data() {
        Committed::Memory(m) => m,
        Committed::Disk(_) => unreachable!("the simulator runs the KV store's memory engine"),
    }
}

/// Raid's per-copy audit over a store's committed state (as `weft_raid::audit::audit_store`
/// does over a KV service).
pub fn site_audit(store: &Store) -> SiteAudit {
    let mut a = SiteAudit::default();
    if let Some(b) = committed_map(store).get(&Bytes::from_static(PLACEMENT_KEY)) {
        match Replicas::decode_placement(b) {
            Some(sites) => a.placement = sites,
            None => a.malformed += 1,
        }
    }
    for rel in Relation::BALANCES {
        a.balances.insert(rel.name().to_string(), (0, 0));
        a.history_sums.insert(rel.name().to_string(), 0);
    }
    for (k, v) in committed_map(store) {
        let Some(&p) = k.first() else { continue };
        if k.len() != 9 {
            continue; // not a Raid item (bank keys, the placement)
        }
        if let Some(rel) = Relation::BALANCES.iter().find(|r| r.prefix() == p) {
            match balance(v) {
                Some(b) => {
                    let e = a.balances.entry(rel.name().to_string()).or_default();
                    e.0 += 1;
                    e.1 = e.1.wrapping_add(b);
                }
                None => a.malformed += 1,
            }
        } else if p == Relation::History.prefix() {
            let Some(row) = HistoryRow::decode(v) else {
                a.malformed += 1;
                continue;
            };
            a.history_rows += 1;
            for rel in Relation::BALANCES {
                *a.history_sums.entry(rel.name().to_string()).or_default() += row.delta;
            }
        }
    }
    a
}

/// Everything the checkers learn during a run.
pub(crate) struct Checker {
    nodes: usize,
    accounts: u8,
    initial_balance: i64,
    dc_accounts: u64,
    dc_tellers: u64,
    dc: Image,
    intents: BTreeMap<Tid, (Kind, Plan)>,
    committed_at: BTreeMap<Tid, BTreeSet<usize>>,
    aborted_at: BTreeMap<Tid, BTreeSet<usize>>,
    acked: BTreeSet<Tid>,
    pub(crate) violations: Vec<Violation>,
    pub(crate) committed: u64,
    pub(crate) aborted: u64,
    pub(crate) unknown: u64,
    pub(crate) checks: u64,
    pub(crate) audits: u64,
}

impl Checker {
    pub(crate) fn new(cfg: &SimConfig) -> Checker {
        Checker {
            nodes: cfg.nodes as usize,
            accounts: cfg.accounts_per_node,
            initial_balance: cfg.initial_balance,
            dc_accounts: cfg.dc_accounts,
            dc_tellers: cfg.dc_tellers,
            dc: dc_image(cfg),
            intents: BTreeMap::new(),
            committed_at: BTreeMap::new(),
            aborted_at: BTreeMap::new(),
            acked: BTreeSet::new(),
            violations: Vec::new(),
            committed: 0,
            aborted: 0,
            unknown: 0,
            checks: 0,
            audits: 0,
        }
    }

    fn total(&self) -> i64 {
        self.nodes as i64 * i64::from(self.accounts) * self.initial_balance
    }

    /// Node `i`'s committed state before any transaction.
    pub(crate) fn initial_image(&self, i: usize) -> Image {
        let mut img = Image {
            committed: self.dc.committed.clone(),
            prepared: Vec::new(),
        };
        for a in 0..self.accounts {
            img.committed
                .insert(bank_key(i, a), int_value(self.initial_balance));
        }
        img
    }

    /// Chooses the next transaction and records what it will do, per node.
    pub(crate) fn plan(&mut self, rng: &mut ChaCha8Rng, tid: Tid, nodes: usize) -> (Kind, Plan) {
        let mut by_node: BTreeMap<usize, Vec<Op>> = BTreeMap::new();
        let r: f64 = rng.gen();
        let kind = if r < 0.5 {
            Kind::Transfer
        } else if r < 0.62 {
            Kind::Check
        } else {
            Kind::DebitCredit
        };
        match kind {
            Kind::Transfer => {
                let from = (rng.gen_range(0..nodes), rng.gen_range(0..self.accounts));
                let mut to = (rng.gen_range(0..nodes), rng.gen_range(0..self.accounts));
                if to == from {
                    to.1 = (to.1 + 1) % self.accounts;
                }
                let amount = rng.gen_range(1..20);
                by_node
                    .entry(from.0)
                    .or_default()
                    .push(Op::AddInt(bank_key(from.0, from.1), -amount));
                by_node
                    .entry(to.0)
                    .or_default()
                    .push(Op::AddInt(bank_key(to.0, to.1), amount));
            }
            Kind::Check => {
                for n in 0..nodes {
                    for a in 0..self.accounts {
                        by_node.entry(n).or_default().push(Op::Read(bank_key(n, a)));
                    }
                }
            }
            Kind::DebitCredit => {
                let aid = rng.gen_range(0..self.dc_accounts);
                let teller = rng.gen_range(0..self.dc_tellers);
                let delta = rng.gen_range(-99..100);
                let (hk, hv) = history(tid, aid, teller, delta);
                for n in 0..nodes {
                    let ops = by_node.entry(n).or_default();
                    for (rel, key) in [
                        (Relation::Account, aid),
                        (Relation::Teller, teller),
                        (Relation::Branch, 0),
                    ] {
                        ops.push(Op::AddTuple(Item { rel, key }.kv_key(), delta));
                    }
                    ops.push(Op::Insert(hk.clone(), hv.clone()));
                }
            }
        }
        let plan: Plan = by_node.into_iter().collect();
        self.intents.insert(tid, (kind, plan.clone()));
        (kind, plan)
    }

    /// The kind of a planned transaction.
    pub(crate) fn kind(&self, tid: Tid) -> Option<Kind> {
        self.intents.get(&tid).map(|(k, _)| *k)
    }

    fn violation(&mut self, property: &'static str, detail: String, at: u64) {
        self.violations.push(Violation {
            property,
            detail,
            at_micros: at,
        });
    }

    /// Node `i` applied the outcome of `tid` to its resources (commit or abort).
    pub(crate) fn applied(&mut self, i: usize, tid: Tid, commit: bool, at: u64) {
        let (mine, other) = if commit {
            (&mut self.committed_at, &self.aborted_at)
        } else {
            (&mut self.aborted_at, &self.committed_at)
        };
        mine.entry(tid).or_default().insert(i);
        if let Some(nodes) = other.get(&tid) {
            let nodes = nodes.clone();
            self.violation(
                "atomicity",
                format!(
                    "{tid} {} at n{} but {} at {:?}",
                    if commit { "committed" } else { "aborted" },
                    i + 1,
                    if commit { "aborted" } else { "committed" },
                    nodes.iter().map(|n| n + 1).collect::<Vec<_>>()
                ),
                at,
            );
        }
    }

    /// The client of `tid` was told `outcome`.
    pub(crate) fn finished(
        &mut self,
        tid: Tid,
        outcome: Outcome,
        kind: Kind,
        reads: &[i64],
        at: u64,
    ) {
        match outcome {
            Outcome::Committed => {
                self.committed += 1;
                self.acked.insert(tid);
                if kind == Kind::Check {
                    self.checks += 1;
                    let total: i64 = reads.iter().sum();
                    if total != self.total() || reads.len() != self.nodes * self.accounts as usize {
                        self.violation(
                            "isolation",
                            format!(
                                "read-only check {tid} committed having seen a total of {total} \
                                 over {} accounts; the bank holds {}",
                                reads.len(),
                                self.total()
                            ),
                            at,
                        );
                    }
                }
            }
            Outcome::Aborted => self.aborted += 1,
        }
    }

    /// The client of `tid` died with its coordinator: it never learns the outcome.
    pub(crate) fn client_lost(&mut self, _tid: Tid) {
        self.unknown += 1;
    }

    /// End-of-run checks over every node's final committed state.
    pub(crate) fn final_checks(&self, stores: &[(NodeId, &Store)]) -> Vec<(&'static str, String)> {
        let mut out = Vec::new();
        for tid in &self.acked {
            // A read-only transaction commits with no resource applying anything.
            if self.kind(*tid) != Some(Kind::Check) && !self.committed_at.contains_key(tid) {
                out.push((
                    "durability",
                    format!("{tid} was acknowledged as committed but no node applied it"),
                ));
            }
        }
        let committed: BTreeSet<Tid> = self
            .committed_at
            .keys()
            .chain(self.acked.iter())
            .copied()
            .collect();
        for (id, store) in stores {
            let i = id.0 as usize - 1;
            let mut model = self.initial_image(i).committed;
            for tid in &committed {
                let Some((_, plan)) = self.intents.get(tid) else {
                    continue;
                };
                for (_, ops) in plan.iter().filter(|(n, _)| *n == i) {
                    for op in ops {
                        apply(&mut model, op);
                    }
                }
            }
            let actual: BTreeMap<Bytes, Bytes> = committed_map(store).clone();
            let keys: BTreeSet<&Bytes> = model.keys().chain(actual.keys()).collect();
            let mut wrong = 0;
            for k in keys {
                let (m, a) = (model.get(k), actual.get(k));
                if m != a {
                    wrong += 1;
                    if wrong <= 5 {
                        out.push((
                            "durability",
                            format!(
                                "n{}: key {:?} is {} but the committed transactions make it {}",
                                i + 1,
                                k,
                                show(a),
                                show(m)
                            ),
                        ));
                    }
                }
            }
            if wrong > 5 {
                out.push(("durability", format!("n{}: {} keys differ", i + 1, wrong)));
            }
        }
        let total: i64 = stores
            .iter()
            .flat_map(|(id, s)| {
                let i = id.0 as usize - 1;
                (0..self.accounts).filter_map(move |a| {
                    committed_map(s)
                        .get(&bank_key(i, a))
                        .and_then(|v| parse_int(v))
                })
            })
            .sum();
        if stores.len() == self.nodes && total != self.total() {
            out.push((
                "isolation",
                format!("the bank's final total is {total}, not {}", self.total()),
            ));
        }
        let audit = Audit {
            sites: stores.iter().map(|(id, s)| (*id, site_audit(s))).collect(),
            missing: Vec::new(),
        };
        for p in audit.problems() {
            out.push(("audit", p));
        }
        out
    }
}

fn apply(model: &mut BTreeMap<Bytes, Bytes>, op: &Op) {
    match op {
        Op::Read(_) => {}
        Op::AddInt(k, d) => {
            let v = model.get(k).and_then(|v| parse_int(v)).unwrap_or(0) + d;
            model.insert(k.clone(), int_value(v));
        }
        Op::AddTuple(k, d) => {
            let v = model.get(k).and_then(|v| balance(v)).unwrap_or(0) + d;
            model.insert(k.clone(), tuple(v));
        }
        Op::Insert(k, v) => {
            model.insert(k.clone(), v.clone());
        }
    }
}

fn show(v: Option<&Bytes>) -> String {
    match v {
        None => "absent".into(),
        Some(b) => match (parse_int(b), balance(b)) {
            (Some(i), _) => i.to_string(),
            (_, Some(bal)) => format!("balance {bal}"),
            _ => format!("{} bytes", b.len()),
        },
    }
}
