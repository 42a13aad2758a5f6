//! The action driver (AD): runs one client's transactions. It begins a weft
//! transaction at its site (which coordinates it: the atomicity controller is
//! weft's transaction manager), sends each copy's site its operations through
//! the replication rule, and commits.
//!
//! A transaction that writes runs at the site of the first copy (the one
//! every writer locks first): an AD elsewhere ships it to that site's AD.
//! Conflicting writers then share one coordinator, whose log orders their
//! commit records: a transaction that used a prepared writer's values (see
//! [`crate::violation`]) is decided right after it, in the same force,
//! instead of one force later.
//!
//! Shipping runs each request exactly once: a shipped request carries an id,
//! and its transaction first claims a marker item under that id (on every
//! copy, with the answer). When the shipping call's answer is lost, the AD
//! sends the request again; a repeat finds the marker of a committed run
//! (and returns its answer), waits for a run still deciding, or runs the
//! request when no run committed. A repeat that fails for good leaves a
//! marker saying so, so that an earlier copy still on its way cannot run
//! after the client was told it failed.
//!
//! Markers do not last forever: the first copy reclaims a marker once no
//! repeat of its request can arrive any more (see [`crate::marker`]), and
//! refuses with Refused a request sent at or before the reclaimed
//! horizon; the shipping AD then tells its client InDoubt (an earlier run
//! may have committed), never that it failed.
//!
//! Owns the shape of a DebitCredit transaction. Must never write fewer than
//! all copies, and must abort what it cannot finish (so no history row is
//! left behind by a failed attempt).

use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use weft_rpc::{Rpc, Transaction};
use weft_wire::{Address, Failure, NodeId, Payload, Status};

use crate::marker::{self, Batch, HORIZON_KEY};
use crate::rc::Replicas;
use crate::schema::{HistoryRow, Item, Relation};
use crate::site::{
    RaidSite, SiteConfig, SiteOp, SiteReply, SiteRequest, AD_HERE_SERVICE, SITE_SERVICE,
};

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

impl AdRequest {
    /// True when the transaction writes (every tpcb one; a raid one with an
    /// update).
    pub fn writes(&self) -> bool {
        match self {
            AdRequest::Tpcb { .. } => true,
            AdRequest::Raid { actions } => actions.iter().any(|a| matches!(a, Action::Update(..))),
        }
    }
}

/// A request shipped to the first copy's AD, with the id that makes a
/// repeat of it harmless.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Shipped {
    /// Chosen at random by the shipping AD (never 0); the same for every
    /// repeat.
    pub id: u64,
    /// When the shipping AD first sent it, ms since the Unix epoch by its
    /// clock; the same for every repeat. Decides when its marker may be
    /// reclaimed (see [`crate::marker`]).
    pub sent_ms: u64,
    /// 0 for the first sending, then 1, 2, ... for repeats.
    pub attempt: u32,
    /// The sites holding a copy, as the shipping AD's placement names
    /// them: the first copy's AD runs the request only when its own
    /// placement names the same sites (and it is the first).
    pub sites: Vec<NodeId>,
    /// The transaction.
    pub req: AdRequest,
}

/// The first copy's AD's answer to a shipped request.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ShippedReply {
    /// The request ran (now or before) to this end.
    Done(Result<i64, Failure>),
    /// Another run of the same request holds its marker: ask again.
    Busy,
}

/// The marker value of a request whose run failed for good (a balance
/// never reaches it: additions are checked against overflow).
const FAILED: i64 = i64::MIN;

/// What claiming a shipped request's marker found.
enum Claimed {
    /// No run committed; the marker is locked for this run's transaction.
    Fresh(Transaction),
    /// Settled already (or busy): the answer to give.
    Settled(ShippedReply),
}

/// A failed call to `site`'s copy, with the status a dead copy's site
/// gets: a site the caller does not know (not joined yet, or gone) is
/// HostDead; one whose process does not serve its copy (its Raid services
/// absent, still starting, or its copy not loaded) is ProcDead. Other
/// failures keep their status.
pub(crate) fn copy_unavailable(site: NodeId, f: Failure) -> Failure {
    let status = match f.status {
        Status::AddrError => Status::HostDead,
        Status::NoSuchService | Status::Unavailable => Status::ProcDead,
        _ => return f,
    };
    Failure::new(
        status,
        format!(
            "site {site}'s copy is not available ({}: {})",
            f.status, f.detail
        ),
    )
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
    /// The site it runs at, whose marker index shipped requests use.
    site: Option<RaidSite>,
}

impl Ad {
    pub(crate) fn new(rpc: Rpc, replicas: Replicas, cfg: SiteConfig, site: Option<RaidSite>) -> Ad {
        Ad {
            rpc,
            replicas,
            cfg,
            site,
        }
    }

    /// The site this driver runs at.
    pub fn site(&self) -> NodeId {
        self.rpc.node_id()
    }

    /// The copies it writes to.
    pub fn replicas(&self) -> &Replicas {
        &self.replicas
    }

    /// Runs one transaction to its end: here, or, when it writes and the
    /// first copy is at another site, at that site's AD.
    ///
    /// Fails with the status that ended it: LockConflict (a lock not granted
    /// within the action timeout), HostDead/ProcDead (a copy's site is down),
    /// Aborted (a participant aborted it), TimedOut; the transaction is
    /// aborted in every case, leaving nothing behind.
    ///
    /// A shipped request whose answer cannot be had within the transaction
    /// timeout (the first copy's site unreachable all along) fails with
    /// InDoubt: it may have committed.
    pub async fn run(&self, req: AdRequest) -> Result<i64, Failure> {
        let primary = self.replicas.first();
        if primary == self.site() || !req.writes() {
            return self.run_here(req).await;
        }
        let mut shipped = Shipped {
            id: rand::random::<u64>().max(1),
            sent_ms: marker::now_ms(),
            attempt: 0,
            sites: self.replicas.all().to_vec(),
            req,
        };
        let give_up = Instant::now() + self.cfg.retry_window();
        loop {
            let addr = Address::new(AD_HERE_SERVICE, primary)
                .map_err(|e| Failure::new(Status::BadRequest, e.to_string()))?;
            let deadline =
                (Instant::now() + self.cfg.tx_timeout + Duration::from_secs(1)).min(give_up);
            let answer = self
                .rpc
                .call_payload(None, &addr, Payload::local(shipped.clone()), Some(deadline))
                .await;
            let lost = match answer {
                Ok(payload) => match payload.decode::<ShippedReply>() {
                    // Refused as too old for its marker to be kept: an
                    // earlier sending may have committed.
                    Ok(ShippedReply::Done(Err(f)))
                        if f.status == Status::Refused && shipped.attempt > 0 =>
                    {
                        return Err(Failure::new(
                            Status::InDoubt,
                            format!(
                                "request {:016x} shipped to {primary}: {}",
                                shipped.id, f.detail
                            ),
                        ))
                    }
                    Ok(ShippedReply::Done(result)) => return result,
                    Ok(ShippedReply::Busy) => None,
                    Err(e) => {
                        return Err(Failure::new(
                            Status::Mismatch,
                            format!("the AD at {primary} answered: {e}"),
                        ))
                    }
                },
                // The answer was lost, or never came: the run may have
                // committed. Ask again (the marker makes it safe).
                Err(f)
                    if matches!(
                        f.status,
                        Status::HostDead
                            | Status::ProcDead
                            | Status::TimedOut
                            | Status::Unavailable
                    ) =>
                {
                    Some(f)
                }
                Err(f) => return Err(copy_unavailable(primary, f)),
            };
            if Instant::now() >= give_up {
                let why = lost.map(|f| f.to_string()).unwrap_or_else(|| "busy".into());
                return Err(Failure::new(
                    Status::InDoubt,
                    format!(
                        "request {:016x} shipped to {primary}: no answer before the timeout ({why}); it may have committed",
                        shipped.id
                    ),
                ));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
            shipped.attempt += 1;
        }
    }

    /// Runs a shipped request at this site, exactly once per id: its
    /// transaction claims the request's marker at the first copy; a marker
    /// found committed answers with the recorded result, a marker held by
    /// another run answers Busy.
    ///
    /// A request shipped to a site that is not the first copy, or by an AD
    /// whose placement names other sites, fails with Mismatch without
    /// running: a writing transaction runs at the first copy or not at all.
    pub async fn run_shipped(&self, shipped: Shipped) -> ShippedReply {
        if let Err(f) = self.check_shipped(&shipped) {
            return ShippedReply::Done(Err(f));
        }
        let Some(site) = &self.site else {
            return ShippedReply::Done(Err(Failure::new(
                Status::Internal,
                "this action driver has no site to keep shipped-request markers",
            )));
        };
        let marker = Item {
            rel: Relation::Request,
            key: shipped.id,
        };
        let sent_ms = shipped.sent_ms;
        let tx = match self.admit_and_claim(site, &shipped).await {
            Claimed::Fresh(tx) => tx,
            Claimed::Settled(reply) => return reply,
        };
        let work = match &shipped.req {
            AdRequest::Tpcb {
                aid,
                teller,
                branch,
                delta,
            } => {
                self.tpcb(&tx, *aid, *teller, *branch, *delta, Some((marker, sent_ms)))
                    .await
            }
            AdRequest::Raid { actions } => match self.raid(&tx, actions).await {
                Ok(sum) => self
                    .write_all(&tx, vec![SiteOp::Mark(marker, Some(sum), sent_ms)])
                    .await
                    .map(|_| sum),
                Err(f) => Err(f),
            },
        };
        let failure = match work {
            Ok(v) => match tx.commit().await {
                Ok(()) => return ShippedReply::Done(Ok(v)),
                Err(f) => f,
            },
            Err(f) => {
                let _ = tx.abort(&f.detail).await;
                f
            }
        };
        if shipped.attempt == 0 {
            // Sent once: no other copy of it can arrive.
            return ShippedReply::Done(Err(failure));
        }
        // A repeat failed: an earlier copy may still be on its way. Leave a
        // marker that says the request failed, unless a run committed in
        // the meantime.
        match self.admit_and_claim(site, &shipped).await {
            Claimed::Settled(reply) => reply,
            Claimed::Fresh(tx) => {
                let burned = self
                    .write_all(&tx, vec![SiteOp::Mark(marker, Some(FAILED), sent_ms)])
                    .await;
                match burned {
                    Ok(_) => match tx.commit().await {
                        Ok(()) => ShippedReply::Done(Err(failure)),
                        Err(_) => ShippedReply::Busy,
                    },
                    Err(f) => {
                        let _ = tx.abort(&f.detail).await;
                        ShippedReply::Busy
                    }
                }
            }
        }
    }

    /// Fails with Mismatch unless this site is the first copy and the
    /// shipping AD's placement is this site's.
    fn check_shipped(&self, shipped: &Shipped) -> Result<(), Failure> {
        let me = self.site();
        let mut theirs = shipped.sites.clone();
        theirs.sort();
        theirs.dedup();
        if self.replicas.first() != me {
            return Err(Failure::new(
                Status::Mismatch,
                format!(
                    "request {:016x} shipped to site {me}, but the first copy is at site {}",
                    shipped.id,
                    self.replicas.first()
                ),
            ));
        }
        if theirs != self.replicas.all() {
            return Err(Failure::new(
                Status::Mismatch,
                format!(
                    "request {:016x} was shipped for copies at {theirs:?}, site {me} has them at {:?}",
                    shipped.id,
                    self.replicas.all()
                ),
            ));
        }
        Ok(())
    }

    /// Admits a shipped request (its marker cannot have been reclaimed) and
    /// claims its marker in a new transaction, with no horizon raise in
    /// between.
    async fn admit_and_claim(&self, site: &RaidSite, shipped: &Shipped) -> Claimed {
        site.ensure_markers_scanned();
        let markers = site.markers();
        let gate = markers.admission().await;
        if let Err(f) = markers.admit(shipped.id, shipped.sent_ms) {
            return Claimed::Settled(ShippedReply::Done(Err(f)));
        }
        let marker = Item {
            rel: Relation::Request,
            key: shipped.id,
        };
        let tx = self.rpc.begin_with_timeout(Some(self.cfg.tx_timeout));
        self.claim(tx, marker, shipped.id, gate).await
    }

    /// Deletes a batch of reclaimed markers from every copy and stores the
    /// batch's horizon, in one transaction.
    ///
    /// Fails with the status that ended the transaction.
    pub(crate) async fn reclaim(&self, batch: &Batch) -> Result<(), Failure> {
        let tx = self.rpc.begin_with_timeout(Some(self.cfg.tx_timeout));
        let mut ops: Vec<SiteOp> = batch
            .ids
            .iter()
            .map(|id| {
                SiteOp::Remove(Item {
                    rel: Relation::Request,
                    key: *id,
                })
            })
            .collect();
        ops.push(SiteOp::Mark(
            Item {
                rel: Relation::Request,
                key: HORIZON_KEY,
            },
            Some(0),
            batch.horizon,
        ));
        match self.write_all(&tx, ops).await {
            Ok(_) => tx.commit().await,
            Err(f) => {
                let _ = tx.abort(&f.detail).await;
                Err(f)
            }
        }
    }

    /// Claims a shipped request's marker at the first copy within `tx`.
    /// `Fresh` when no run committed (the caller holds the marker's lock);
    /// otherwise the answer to give, and `tx` is finished.
    ///
    /// `gate` (the admission guard) is released once the marker is locked:
    /// a horizon raise then cannot slip between the admission and the
    /// claim, and does not wait for the rest of this run.
    async fn claim<G>(&self, tx: Transaction, marker: Item, id: u64, gate: G) -> Claimed {
        let first = self.replicas.first();
        let claimed = self
            .call_site(&tx, first, vec![SiteOp::Claim(marker)])
            .await;
        drop(gate);
        match claimed {
            Ok(a) if a.first() == Some(&1) => {
                // Ran before: its answer, once that run's outcome is known
                // here (committing this read waits for it).
                let read = self
                    .call_site(&tx, first, vec![SiteOp::Answer(marker)])
                    .await;
                Claimed::Settled(match (read, tx.commit().await) {
                    (Ok(v), Ok(())) if v[0] == FAILED => ShippedReply::Done(Err(Failure::new(
                        Status::Aborted,
                        format!("request {id:016x} failed in an earlier run"),
                    ))),
                    (Ok(v), Ok(())) => ShippedReply::Done(Ok(v[0])),
                    _ => ShippedReply::Busy,
                })
            }
            Ok(_) => Claimed::Fresh(tx),
            Err(f) => {
                let _ = tx.abort(&f.detail).await;
                Claimed::Settled(match f.status {
                    Status::LockConflict | Status::Aborted => ShippedReply::Busy,
                    _ => ShippedReply::Done(Err(f)),
                })
            }
        }
    }

    /// Runs one transaction to its end at this site, coordinated here.
    ///
    /// Fails like [`Ad::run`].
    pub async fn run_here(&self, req: AdRequest) -> Result<i64, Failure> {
        let tx = self.rpc.begin_with_timeout(Some(self.cfg.tx_timeout));
        let work = match &req {
            AdRequest::Tpcb {
                aid,
                teller,
                branch,
                delta,
            } => self.tpcb(&tx, *aid, *teller, *branch, *delta, None).await,
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
            .await
            .map_err(|f| copy_unavailable(site, f))?;
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
        marker: Option<(Item, u64)>,
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
        let mut ops = vec![
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
        if let Some((m, sent_ms)) = marker {
            // Recorded with the account's new balance, on every copy.
            ops.push(SiteOp::Mark(m, None, sent_ms));
        }
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
