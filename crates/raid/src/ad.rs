//! The action driver (AD): runs one client's transactions. It begins a weft
//! transaction at its site (which coordinates it: the atomicity controller is
//! weft's transaction manager), sends each copy's site its operations through
//! the replication rule, and commits.
//!
//! Owns the shape of a DebitCredit transaction. Must never write fewer than
//! all copies, and must abort what it cannot finish (so no history row is
//! left behind by a failed attempt).

use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use weft_rpc::{Rpc, Transaction};
use weft_wire::{Address, Failure, NodeId, Payload, Status};

use crate::rc::Replicas;
use crate::schema::{HistoryRow, Item, Relation};
use crate::site::{SiteConfig, SiteOp, SiteReply, SiteRequest, SITE_SERVICE};

/// One action of a Raid-mode transaction.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Action {
    /// Read a tuple's balance (one copy).
    Read(Item),
    /// Add to a tuple's balance and log a history row (every copy).
    Update(Item, i64),
}

/// A transaction for an action driver.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum AdRequest {
    /// The TPC-B-like transaction (pgbench's default script): add `delta` to
    /// an account and read it back, add it to a teller and a branch, append a
    /// history row.
    Tpcb {
        /// Account.
        aid: u64,
        /// Teller.
        teller: u64,
        /// Branch.
        branch: u64,
        /// Amount.
        delta: i64,
    },
    /// A Raid-mode transaction: actions run one at a time, each its own
    /// exchange with the sites, each bounded by the action timeout.
    Raid {
        /// The actions in order.
        actions: Vec<Action>,
    },
}

/// What a transaction returns: the account balance read (tpcb) or the sum of
/// the balances read (raid).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AdReply(pub i64);

/// An action driver at one site.
#[derive(Clone)]
pub struct Ad {
    rpc: Rpc,
    replicas: Replicas,
    cfg: SiteConfig,
}

impl Ad {
    pub(crate) fn new(rpc: Rpc, replicas: Replicas, cfg: SiteConfig) -> Ad {
        Ad { rpc, replicas, cfg }
    }

    /// The site this driver runs at.
    pub fn site(&self) -> NodeId {
        self.rpc.node_id()
    }

    /// The copies it writes to.
    pub fn replicas(&self) -> &Replicas {
        &self.replicas
    }

    /// Runs one transaction to its end.
    ///
    /// Fails with the status that ended it: LockConflict (a lock not granted
    /// within the action timeout), HostDead/ProcDead (a copy's site is down),
    /// Aborted (a participant aborted it), TimedOut; the transaction is
    /// aborted in every case, leaving nothing behind.
    pub async fn run(&self, req: AdRequest) -> Result<i64, Failure> {
        let tx = self.rpc.begin_with_timeout(Some(self.cfg.tx_timeout));
        let work = match &req {
            AdRequest::Tpcb {
                aid,
                teller,
                branch,
                delta,
            } => self.tpcb(&tx, *aid, *teller, *branch, *delta).await,
            AdRequest::Raid { actions } => self.raid(&tx, actions).await,
        };
        match work {
            Ok(v) => tx.commit().await.map(|()| v),
            Err(f) => {
                let _ = tx.abort(&f.detail).await;
                Err(f)
            }
        }
    }

    async fn call_site(
        &self,
        tx: &Transaction,
        site: NodeId,
        ops: Vec<SiteOp>,
    ) -> Result<Vec<i64>, Failure> {
        let addr = Address::new(SITE_SERVICE, site)
            .map_err(|e| Failure::new(Status::BadRequest, e.to_string()))?;
        // A lock wait ends at the action timeout; leave the answer time to
        // come back before giving up on the site.
        let deadline = Instant::now() + self.cfg.action_timeout + Duration::from_secs(1);
        tracing::trace!(tid = %tx.tid(), %site, "site call");
        let payload = self
            .rpc
            .call_payload(
                Some(tx.context()),
                &addr,
                Payload::local(SiteRequest(ops)),
                Some(deadline),
            )
            .await?;
        tracing::trace!(tid = %tx.tid(), %site, "site call done");
        let reply: SiteReply = payload
            .decode()
            .map_err(|e| Failure::new(Status::Mismatch, format!("site {site} answered: {e}")))?;
        Ok(reply.0)
    }

    /// Writes to every copy: the first copy alone (transactions meet at its
    /// locks first, so they cannot deadlock across copies), then the others
    /// at once. Returns the first copy's answers.
    async fn write_all(&self, tx: &Transaction, ops: Vec<SiteOp>) -> Result<Vec<i64>, Failure> {
        let first = self
            .call_site(tx, self.replicas.first(), ops.clone())
            .await?;
        let rest = futures::future::join_all(
            self.replicas
                .rest()
                .iter()
                .map(|s| self.call_site(tx, *s, ops.clone())),
        )
        .await;
        for r in rest {
            r?;
        }
        Ok(first)
    }

    async fn tpcb(
        &self,
        tx: &Transaction,
        aid: u64,
        teller: u64,
        branch: u64,
        delta: i64,
    ) -> Result<i64, Failure> {
        let tid = tx.tid();
        let row = HistoryRow {
            tid,
            rel: Relation::History,
            aid,
            tid_key: teller,
            bid: branch,
            delta,
        };
        let ops = vec![
            SiteOp::Update(
                Item {
                    rel: Relation::Account,
                    key: aid,
                },
                delta,
            ),
            SiteOp::Update(
                Item {
                    rel: Relation::Teller,
                    key: teller,
                },
                delta,
            ),
            SiteOp::Update(
                Item {
                    rel: Relation::Branch,
                    key: branch,
                },
                delta,
            ),
            SiteOp::Insert(
                Item {
                    rel: Relation::History,
                    key: HistoryRow::key(tid, 0),
                },
                row.encode(),
            ),
        ];
        // The account's new balance is the transaction's read (every copy
        // answers the same).
        Ok(self.write_all(tx, ops).await?[0])
    }

    async fn raid(&self, tx: &Transaction, actions: &[Action]) -> Result<i64, Failure> {
        let tid = tx.tid();
        let mut sum = 0i64;
        for (i, action) in actions.iter().enumerate() {
            match action {
                Action::Read(item) => {
                    let v = self
                        .call_site(tx, self.replicas.read_site(), vec![SiteOp::Read(*item)])
                        .await?;
                    sum = sum.wrapping_add(v[0]);
                }
                Action::Update(item, delta) => {
                    let row = HistoryRow {
                        tid,
                        rel: item.rel,
                        aid: item.key,
                        tid_key: 0,
                        bid: 0,
                        delta: *delta,
                    };
                    let history = Item {
                        rel: Relation::History,
                        key: HistoryRow::key(tid, i as u32),
                    };
                    self.write_all(
                        tx,
                        vec![
                            SiteOp::Update(*item, *delta),
                            SiteOp::Insert(history, row.encode()),
                        ],
                    )
                    .await?;
                }
            }
        }
        Ok(sum)
    }
}
