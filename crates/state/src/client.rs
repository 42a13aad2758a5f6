//! The client side: a node's cache of segments, and locks taken inside
//! transactions through the transaction metadata table.
//!
//! Owns the cached copies of this node and the lock protocol of InterWeave
//! §3.2 against the TMT in the transaction's baggage: a lock already held by
//! the transaction is granted locally (no message when the copy is at the
//! transaction's version), a clash between processes of one transaction
//! aborts it, an upgrade or first acquire asks the home (which bounds its
//! wait and answers LockConflict). A read lock whose cached copy is recent
//! enough under the caller's coherence model sends no message. A write
//! critical section runs against copy-on-first-write twins; its diff is
//! submitted to the home, which holds it until the root transaction ends.
//! Must never hold the cache's mutex across an `.await`, or let a copy that
//! holds one transaction's uncommitted diffs serve another transaction.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use parking_lot::Mutex;
use weft_rpc::Rpc;
use weft_wire::ids::{Address, NodeId, Tid};
use weft_wire::status::{Failure, Status};
use weft_wire::txctx::{Baggage, BaggageItem, TxContext};
use weft_wire::Payload;

use crate::core::codec;
use crate::core::coherence::{CacheView, Coherence};
use crate::core::error::StateError;
use crate::core::mip::SegUrl;
use crate::core::segment::{check_consistent, SegLimits, Segment};
use crate::core::tmt::{LockCase, LockMode, Tmt, BAGGAGE_KEY};
use crate::core::twin::{collect, Twins, Writer};
use crate::service::{HomeReply, HomeRequest, WireRefresh, SERVICE};

/// Most segments one node caches.
pub const MAX_CACHED: usize = 1024;
/// Longest refresh (diff or image) accepted from a home, in bytes.
pub const MAX_REFRESH_BYTES: usize = 256 << 20;

struct Cached {
    seg: Segment,
    secret: Vec<u8>,
    /// Newest master version heard of, and when.
    known_master: Option<u64>,
    known_at: Instant,
    /// Set while the copy holds this transaction's uncommitted diffs.
    tentative_of: Option<Tid>,
}

/// The secret, the cached version, and whose uncommitted diffs it holds.
type Have = (Vec<u8>, Option<u64>, Option<Tid>);

/// Counters of what the cache saved and moved.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ClientStats {
    /// Read locks served from the cache with no message.
    pub local_grants: u64,
    /// Lock messages sent to homes.
    pub lock_messages: u64,
    /// Refresh bytes received (diffs and images).
    pub refresh_bytes: u64,
    /// Diff bytes submitted.
    pub submitted_bytes: u64,
}

struct Inner {
    rpc: Rpc,
    me: String,
    limits: SegLimits,
    cache: Mutex<HashMap<SegUrl, Cached>>,
    stats: Mutex<ClientStats>,
}

/// A node's shared-state client.
#[derive(Clone)]
pub struct StateClient(Arc<Inner>);

fn fail(e: StateError) -> Failure {
    Failure::new(e.status(), e.to_string())
}

/// Drops a copy's contents (it holds writes that never reached the home):
/// the next lock fetches the whole segment. The segment stays open.
fn forget(e: &mut Cached) {
    e.seg = Segment::new(e.seg.url().clone(), *e.seg.limits());
    e.known_master = None;
    e.tentative_of = None;
}

/// True when a cached copy may be used with no message. The home sends no
/// version notices yet, so what the client knows of the master is only as
/// new as its last reply: Temporal (age since the copy was known current)
/// and user predicates (which see that age) can be decided locally; Delta
/// and Diff cannot be guaranteed without notices, so they ask the home (like
/// Full) rather than risk a copy older than their bound.
fn usable_without_message(model: &Coherence, v: &CacheView) -> bool {
    v.known_master.is_some()
        && matches!(model, Coherence::Temporal(_) | Coherence::User(_))
        && model.recent_enough(v)
}

fn home_addr(url: &SegUrl) -> Result<Address, Failure> {
    let node: u32 = url.node.parse().map_err(|_| {
        Failure::new(
            Status::AddrError,
            format!("{url}: the home must be a node id"),
        )
    })?;
    Address::new(SERVICE, NodeId(node)).map_err(|e| Failure::new(Status::AddrError, e.to_string()))
}

impl StateClient {
    /// A client making its calls through `rpc` (the node's).
    pub fn new(rpc: Rpc) -> Self {
        let me = format!("n{}", rpc.node_id().0);
        StateClient(Arc::new(Inner {
            rpc,
            me,
            limits: SegLimits::default(),
            cache: Mutex::new(HashMap::new()),
            stats: Mutex::new(ClientStats::default()),
        }))
    }

    /// What the cache saved and moved so far.
    pub fn stats(&self) -> ClientStats {
        *self.0.stats.lock()
    }

    async fn call(
        &self,
        tx: Option<&TxContext>,
        url: &SegUrl,
        req: HomeRequest,
    ) -> Result<HomeReply, Failure> {
        let addr = home_addr(url)?;
        let p = self
            .0
            .rpc
            .call_payload(tx, &addr, Payload::local(req), None)
            .await?;
        p.decode::<HomeReply>().map_err(|e| {
            Failure::new(
                Status::Mismatch,
                format!("state: bad reply from {addr}: {e}"),
            )
        })
    }

    /// Opens (or, with `create`, creates) the segment `url` with `secret` and
    /// caches its committed version. Returns the version.
    ///
    /// Fails with WrongSecret, AddrError (no such segment, bad URL), TooLarge
    /// (the home's segment limit, the cache's), HostDead/TimedOut when the
    /// home cannot be reached.
    pub async fn open(&self, url: &SegUrl, secret: &[u8], create: bool) -> Result<u64, Failure> {
        let req = HomeRequest::Open {
            path: url.path.clone(),
            secret: secret.to_vec(),
            create,
        };
        match self.call(None, url, req).await? {
            HomeReply::Opened { .. } => {}
            _ => {
                return Err(Failure::new(
                    Status::Mismatch,
                    "state: unexpected reply to open",
                ))
            }
        }
        {
            let mut c = self.0.cache.lock();
            if !c.contains_key(url) {
                if c.len() >= MAX_CACHED {
                    return Err(Failure::new(Status::TooLarge, "state: cache full"));
                }
                c.insert(
                    url.clone(),
                    Cached {
                        seg: Segment::new(url.clone(), self.0.limits),
                        secret: secret.to_vec(),
                        known_master: None,
                        known_at: Instant::now(),
                        tentative_of: None,
                    },
                );
            }
        }
        self.refresh(url).await
    }

    /// Brings the cached copy to the master's committed version (no lock).
    /// Returns the version. Fails like [`StateClient::open`].
    pub async fn refresh(&self, url: &SegUrl) -> Result<u64, Failure> {
        let (secret, have, tentative_of) = self.have(url)?;
        let req = HomeRequest::Fetch {
            path: url.path.clone(),
            secret,
            have,
            tentative_of,
        };
        let sent = Instant::now();
        let reply = self.call(None, url, req).await?;
        self.apply_reply(url, None, reply, sent)
    }

    /// The secret, the cached version, and whose uncommitted diffs it holds.
    fn have(&self, url: &SegUrl) -> Result<Have, Failure> {
        let c = self.0.cache.lock();
        let e = c
            .get(url)
            .ok_or_else(|| Failure::new(Status::AddrError, format!("{url} is not open here")))?;
        Ok((e.secret.clone(), Some(e.seg.version()), e.tentative_of))
    }

    /// Applies a home's reply; `sent` is when the request left (the copy is
    /// known current as of then, never later: a conservative age).
    fn apply_reply(
        &self,
        url: &SegUrl,
        tid: Option<Tid>,
        reply: HomeReply,
        sent: Instant,
    ) -> Result<u64, Failure> {
        let HomeReply::Refresh {
            version,
            refresh,
            tentative,
            tx_version,
        } = reply
        else {
            return Err(Failure::new(Status::Mismatch, "state: unexpected reply"));
        };
        let mut moved = 0u64;
        let mut c = self.0.cache.lock();
        let e = c
            .get_mut(url)
            .ok_or_else(|| Failure::new(Status::AddrError, url.to_string()))?;
        let max = MAX_REFRESH_BYTES;
        match refresh {
            WireRefresh::Current => {}
            WireRefresh::Diff(b) => {
                moved += b.len() as u64;
                let d = codec::decode_diff(&b, max).map_err(fail)?;
                if e.seg.apply_owned(d).is_err() {
                    // Our copy was not what we said: take the image next time.
                    e.seg = Segment::new(url.clone(), self.0.limits);
                    e.known_master = None;
                    e.tentative_of = None;
                    return Err(Failure::new(
                        Status::Mismatch,
                        format!("{url}: refresh did not fit"),
                    ));
                }
            }
            WireRefresh::Image(b) => {
                moved += b.len() as u64;
                let img = codec::decode_image(&b, max).map_err(fail)?;
                e.seg = Segment::from_image(img, self.0.limits).map_err(fail)?;
            }
        }
        e.tentative_of = None;
        e.known_master = Some(version);
        e.known_at = sent;
        if let (Some(t), Some(b)) = (tid, tentative) {
            moved += b.len() as u64;
            let d = codec::decode_diff(&b, max).map_err(fail)?;
            e.seg.apply_owned(d).map_err(fail)?;
            e.tentative_of = Some(t);
        }
        let v = e.seg.version();
        drop(c);
        self.0.stats.lock().refresh_bytes += moved;
        debug_assert!(tid.is_none() || v == tx_version);
        Ok(v)
    }

    fn load_tmt(&self, tid: Tid) -> Result<Tmt, Failure> {
        match self
            .0
            .rpc
            .tm()
            .baggage(tid)
            .as_ref()
            .and_then(|b| b.get(BAGGAGE_KEY))
        {
            Some(v) => Tmt::decode(v).map_err(fail),
            None => Ok(Tmt::default()),
        }
    }

    fn save_tmt(&self, tid: Tid, tmt: &Tmt) {
        let b = Baggage(vec![BaggageItem {
            key: BAGGAGE_KEY.to_string(),
            value: Bytes::from(tmt.encode()),
        }]);
        self.0.rpc.tm().merge_baggage(tid, &b);
    }

    /// Takes `mode` on `url` for `tx` (§3.2's four cases) and brings the
    /// cached copy to the version the transaction sees.
    async fn lock(
        &self,
        tx: &TxContext,
        url: &SegUrl,
        mode: LockMode,
        model: &Coherence,
    ) -> Result<Tmt, Failure> {
        let tid = tx.tid;
        let mut tmt = self.load_tmt(tid)?;
        match tmt.lock_case(url, &self.0.me, mode) {
            LockCase::Clash => {
                let _ = self
                    .0
                    .rpc
                    .tm()
                    .abort(tid, "state: incompatible locks in one transaction")
                    .await;
                return Err(fail(StateError::TxLockClash(url.to_string())));
            }
            LockCase::Local => {
                let want = tmt.get(url).map_or(0, |e| e.latest);
                let ok = {
                    let c = self.0.cache.lock();
                    c.get(url).is_some_and(|e| {
                        e.seg.version() == want && e.tentative_of.is_none_or(|t| t == tid)
                    })
                };
                if ok {
                    self.0.stats.lock().local_grants += 1;
                } else {
                    self.lock_at_home(tx, url, mode, &mut tmt).await?;
                }
            }
            LockCase::Acquire if mode == LockMode::Read => {
                let view = {
                    let c = self.0.cache.lock();
                    c.get(url)
                        .filter(|e| e.tentative_of.is_none())
                        .map(|e| CacheView {
                            cached_version: e.seg.version(),
                            known_master: e.known_master,
                            changed_units: 0,
                            total_units: e.seg.units(),
                            age: e.known_at.elapsed(),
                        })
                };
                match view {
                    Some(v) if usable_without_message(model, &v) => {
                        self.0.stats.lock().local_grants += 1;
                        tmt.granted(url, LockMode::Read, v.cached_version)
                            .map_err(fail)?;
                    }
                    _ => self.lock_at_home(tx, url, mode, &mut tmt).await?,
                }
            }
            LockCase::Acquire | LockCase::Upgrade => {
                self.lock_at_home(tx, url, mode, &mut tmt).await?
            }
        }
        // Cross-segment check against the other segments in use.
        let in_use: BTreeMap<SegUrl, u64> = tmt
            .entries
            .iter()
            .filter(|e| &e.url != url)
            .map(|e| (e.url.clone(), e.latest))
            .collect();
        {
            let c = self.0.cache.lock();
            if let Some(e) = c.get(url) {
                check_consistent(&in_use, &e.seg).map_err(fail)?;
            }
        }
        self.save_tmt(tid, &tmt);
        Ok(tmt)
    }

    async fn lock_at_home(
        &self,
        tx: &TxContext,
        url: &SegUrl,
        mode: LockMode,
        tmt: &mut Tmt,
    ) -> Result<(), Failure> {
        let (secret, have, tentative_of) = self.have(url)?;
        self.0.stats.lock().lock_messages += 1;
        let req = HomeRequest::Lock {
            path: url.path.clone(),
            secret,
            mode,
            have,
            tentative_of,
        };
        let sent = Instant::now();
        let reply = self.call(Some(tx), url, req).await?;
        let master = match &reply {
            HomeReply::Refresh { version, .. } => *version,
            _ => 0,
        };
        let v = self.apply_reply(url, Some(tx.tid), reply, sent)?;
        tmt.granted(url, mode, master).map_err(fail)?;
        if let Some(e) = tmt.get_mut(url) {
            // The home is the authority on what the transaction wrote (an
            // aborted sub-transaction's versions are gone).
            e.latest = v;
        }
        Ok(())
    }

    /// Runs `f` on the copy of `url` under a read lock of `tx`, recent enough
    /// under `model` (Full asks the home; the others may use the cache with
    /// no message). Sees the transaction's own uncommitted updates, from
    /// this or any other process of the transaction.
    ///
    /// Fails with LockConflict (a writer held it past the home's bound),
    /// Aborted (another process of the transaction holds it for writing),
    /// Mismatch (cross-segment inconsistency: refresh and retry), AddrError
    /// (not open here), HostDead/TimedOut (home unreachable).
    pub async fn read<R>(
        &self,
        tx: &TxContext,
        url: &SegUrl,
        model: &Coherence,
        f: impl FnOnce(&Segment) -> R,
    ) -> Result<R, Failure> {
        self.lock(tx, url, LockMode::Read, model).await?;
        let c = self.0.cache.lock();
        let e = c
            .get(url)
            .ok_or_else(|| Failure::new(Status::AddrError, url.to_string()))?;
        Ok(f(&e.seg))
    }

    /// Runs `f` on the copy of `url` under a write lock of `tx`; the changes
    /// it makes are collected as a diff and sent to the home, which holds it
    /// until the root transaction commits (or drops it at abort, or when the
    /// sub-transaction that wrote it aborts).
    ///
    /// Fails like [`StateClient::read`], with `f`'s error (the copy is then
    /// dropped from the cache, nothing is sent), and with BadRequest /
    /// TooLarge when the home refuses the diff.
    pub async fn write<R>(
        &self,
        tx: &TxContext,
        url: &SegUrl,
        f: impl FnOnce(&mut Writer<'_>) -> Result<R, StateError>,
    ) -> Result<R, Failure> {
        let mut tmt = self
            .lock(tx, url, LockMode::Write, &Coherence::Full)
            .await?;
        let deps: Vec<(SegUrl, u64)> = tmt
            .entries
            .iter()
            .filter(|e| &e.url != url)
            .map(|e| (e.url.clone(), e.latest))
            .collect();
        let (r, diff) = {
            let mut c = self.0.cache.lock();
            let e = c
                .get_mut(url)
                .ok_or_else(|| Failure::new(Status::AddrError, url.to_string()))?;
            let mut twins = Twins::new(&e.seg);
            for (u, v) in deps {
                twins.depend_on(u, v);
            }
            let r = {
                let mut w = Writer::new(&mut e.seg, &mut twins).map_err(fail)?;
                f(&mut w)
            };
            match r {
                Ok(r) => {
                    let d = collect(&mut e.seg, twins);
                    if !d.is_empty() || d.target != d.base {
                        e.tentative_of = Some(tx.tid);
                    }
                    (r, d)
                }
                Err(err) => {
                    forget(e);
                    return Err(fail(err));
                }
            }
        };
        if diff.target == diff.base {
            return Ok(r);
        }
        let bytes = codec::encode_diff(&diff);
        self.0.stats.lock().submitted_bytes += bytes.len() as u64;
        let req = HomeRequest::Submit {
            path: url.path.clone(),
            diff: bytes,
        };
        match self.call(Some(tx), url, req).await {
            Ok(HomeReply::Submitted { version }) => {
                tmt.created_diff(url, version, &url.node).map_err(fail)?;
                self.save_tmt(tx.tid, &tmt);
                Ok(r)
            }
            Ok(_) => Err(Failure::new(
                Status::Mismatch,
                "state: unexpected reply to submit",
            )),
            Err(e) => {
                if let Some(e) = self.0.cache.lock().get_mut(url) {
                    forget(e);
                }
                Err(e)
            }
        }
    }

    /// Runs `f` on the cached copy outside any transaction, refreshing it
    /// first unless it is recent enough under `model`. Returns `f`'s result
    /// and the bytes the refresh moved.
    ///
    /// Fails like [`StateClient::refresh`].
    pub async fn peek<R>(
        &self,
        url: &SegUrl,
        model: &Coherence,
        f: impl FnOnce(&Segment) -> R,
    ) -> Result<(R, u64), Failure> {
        let fresh = {
            let c = self.0.cache.lock();
            let e = c
                .get(url)
                .ok_or_else(|| Failure::new(Status::AddrError, url.to_string()))?;
            e.tentative_of.is_none()
                && usable_without_message(
                    model,
                    &CacheView {
                        cached_version: e.seg.version(),
                        known_master: e.known_master,
                        changed_units: 0,
                        total_units: e.seg.units(),
                        age: e.known_at.elapsed(),
                    },
                )
        };
        let before = self.stats().refresh_bytes;
        if !fresh {
            self.refresh(url).await?;
        }
        let moved = self.stats().refresh_bytes - before;
        let c = self.0.cache.lock();
        let e = c
            .get(url)
            .ok_or_else(|| Failure::new(Status::AddrError, url.to_string()))?;
        Ok((f(&e.seg), moved))
    }
}
