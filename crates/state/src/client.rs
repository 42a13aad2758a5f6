//! The client side: a node's cache of segments, the uncommitted diffs its
//! processes wrote, and locks taken inside transactions through the
//! transaction metadata table.
//!
//! Owns the cached copies of this node, the diffs written here (held until
//! the root transaction ends: the home collects them at prepare, other
//! processes of the transaction fetch them on demand), the lock protocol of
//! InterWeave §3.2 against the TMT in the transaction's baggage, proactive
//! diffs, and the peer service ([`crate::peer`]). A lock already held by the
//! transaction is granted locally: the copy is brought to the transaction's
//! version from the proactive buffer, else from the diffs' holders. A clash
//! between processes of one transaction aborts it; an upgrade or first
//! acquire asks the home (which bounds its wait and answers LockConflict). A
//! read lock whose cached copy is recent enough under the caller's coherence
//! model sends no message: the home tells this node of every new version
//! while its lease lasts. Once one node fetched a segment's diffs from here
//! three times in a row, later diffs of the segment ride in the baggage
//! (key [`PUSH_KEY`]) of every call and return.
//! Must never hold the cache's mutex across an `.await`, or let a copy that
//! holds one transaction's uncommitted diffs serve another transaction.

use std::collections::{BTreeMap, HashMap};
use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::future::BoxFuture;
use parking_lot::Mutex;
use sha2::{Digest, Sha256};
use weft_rpc::{Rpc, ServiceOptions};
use weft_tx::{Outcome, ParticipationClass, Resource};
use weft_wire::ids::{Address, NodeId, SubPath, Tid};
use weft_wire::status::{Failure, Status};
use weft_wire::txctx::{Baggage, BaggageItem, TxContext};
use weft_wire::Payload;

use crate::core::apply::apply_diff_bytes;
use crate::core::codec;
use crate::core::coherence::{CacheView, Coherence};
use crate::core::error::StateError;
use crate::core::mip::SegUrl;
use crate::core::segment::{check_consistent, SegLimits, Segment};
use crate::core::tmt::{DiffLoc, LockCase, LockMode, Tmt, BAGGAGE_KEY};
use crate::core::twin::{collect, Twins, Writer};
use crate::peer::{PeerReply, PeerRequest, WireHeld, PEER_SERVICE};
use crate::service::{HomeReply, HomeRequest, WireRefresh, SERVICE};

/// Most segments one node caches.
pub const MAX_CACHED: usize = 1024;
/// Longest refresh (diff or image) accepted from a home, in bytes.
pub const MAX_REFRESH_BYTES: usize = 256 << 20;
/// The baggage key of proactive diffs.
pub const PUSH_KEY: &str = "state.pd";
/// Fetches in a row by one node after which a segment's diffs are pushed.
pub const PUSH_AFTER: u32 = 3;
/// Most bytes of diffs pushed in one transaction's baggage.
pub const MAX_PUSH_BYTES: usize = 1 << 20;
/// The TMT's name for diffs that went to the home (a process that serves no
/// peer service submits them).
pub const AT_HOME: &str = "home";

struct Cached {
    seg: Segment,
    secret: Vec<u8>,
    secret_hash: [u8; 32],
    /// Newest master version heard of, and when the copy was last known
    /// current.
    known_master: Option<u64>,
    known_at: Instant,
    /// Units the master changed since the copy's version (from notices).
    changed: u64,
    /// Until when the home tells this node of every new version.
    lease_until: Option<Instant>,
    /// Set while the copy holds this transaction's uncommitted diffs.
    tentative_of: Option<Tid>,
    /// The identifier of the diff that produced the copy's version (0:
    /// unknown).
    tag: u64,
    /// The home did not answer when last asked.
    stale: bool,
}

/// One diff written here and held until the root transaction ends.
#[derive(Clone)]
struct Held {
    id: u64,
    sub: SubPath,
    bytes: Arc<Vec<u8>>,
}

#[derive(Default)]
struct TxHeld {
    segs: HashMap<SegUrl, Vec<Held>>,
    /// Sub-transactions known here to have aborted.
    aborted: Vec<SubPath>,
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
    /// Diff bytes submitted (to homes) or held here.
    pub submitted_bytes: u64,
    /// Requests for uncommitted diffs sent to their holders.
    pub peer_fetches: u64,
    /// Uncommitted diffs found in the proactive buffer.
    pub pushed_used: u64,
    /// Version notices received.
    pub notices: u64,
    /// Time spent checking and applying refreshes to cached copies, in
    /// nanoseconds (what a refresh costs beyond its message).
    pub apply_ns: u64,
}

/// How long the last write critical section spent in each phase.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WritePhases {
    /// Taking the lock (and bringing the copy to the transaction's version).
    pub lock: Duration,
    /// Running the caller's closure.
    pub local: Duration,
    /// Collecting and encoding the diff (and pushing it).
    pub collect: Duration,
}

struct Inner {
    rpc: Rpc,
    me: String,
    limits: SegLimits,
    cache: Mutex<HashMap<SegUrl, Cached>>,
    stats: Mutex<ClientStats>,
    txs: Mutex<HashMap<Tid, TxHeld>>,
    /// Per segment: the node that fetched its diffs from here last, and
    /// how many times in a row.
    fetchers: Mutex<HashMap<SegUrl, (NodeId, u32)>>,
    proactive: AtomicBool,
    /// True when this client serves the peer service of its node.
    serving: bool,
    id_seed: u64,
    next_id: AtomicU64,
    phases: Mutex<WritePhases>,
    resource: Arc<dyn Resource>,
}

/// A node's shared-state client.
#[derive(Clone)]
pub struct StateClient(Arc<Inner>);

/// Ends what this node holds for a transaction: the one-phase resource a
/// client enlists in every transaction it locks in.
struct TxEnd(Weak<Inner>);

impl Resource for TxEnd {
    fn name(&self) -> &str {
        "state.client"
    }

    fn class(&self) -> ParticipationClass {
        ParticipationClass::OnePhase
    }

    fn ended(&self, tid: Tid, _outcome: Outcome) -> BoxFuture<'_, ()> {
        if let Some(inner) = self.0.upgrade() {
            inner.txs.lock().remove(&tid);
        }
        Box::pin(async {})
    }

    fn abort(&self, tid: Tid) -> BoxFuture<'_, ()> {
        if let Some(inner) = self.0.upgrade() {
            inner.txs.lock().remove(&tid);
        }
        Box::pin(async {})
    }

    fn held(&self) -> Vec<(Tid, String)> {
        self.0
            .upgrade()
            .map(|inner| {
                inner
                    .txs
                    .lock()
                    .keys()
                    .map(|t| (*t, "held state diffs".to_string()))
                    .collect()
            })
            .unwrap_or_default()
    }

    fn sub_ended(&self, tid: Tid, path: &SubPath, committed: bool) {
        if committed {
            return;
        }
        let Some(inner) = self.0.upgrade() else {
            return;
        };
        {
            let mut txs = inner.txs.lock();
            let t = txs.entry(tid).or_default();
            if t.aborted.len() < 1024 {
                t.aborted.push(path.clone());
            }
            for held in t.segs.values_mut() {
                if let Some(cut) = held.iter().position(|h| path.is_ancestor_or_self(&h.sub)) {
                    held.truncate(cut);
                }
            }
        }
        // A copy may hold the aborted diffs: the next lock rebuilds it.
        for e in inner.cache.lock().values_mut() {
            if e.tentative_of == Some(tid) {
                forget(e);
            }
        }
    }
}

fn fail(e: StateError) -> Failure {
    Failure::new(e.status(), e.to_string())
}

fn unexpected(what: &str) -> Failure {
    Failure::new(
        Status::Mismatch,
        format!("state: unexpected reply to {what}"),
    )
}

fn home_unreachable(s: Status) -> bool {
    matches!(
        s,
        Status::HostDead | Status::ProcDead | Status::TimedOut | Status::Unavailable
    )
}

/// Drops a copy's contents (it holds writes that never reached the home):
/// the next lock fetches the whole segment. The segment stays open.
fn forget(e: &mut Cached) {
    e.seg = Segment::new(e.seg.url().clone(), *e.seg.limits());
    e.known_master = None;
    e.tentative_of = None;
    e.tag = 0;
    e.changed = 0;
}

impl Cached {
    fn view(&self, now: Instant) -> (CacheView, bool) {
        let leased = self.lease_until.is_some_and(|u| u > now);
        let current = leased && self.known_master == Some(self.seg.version());
        (
            CacheView {
                cached_version: self.seg.version(),
                known_master: self.known_master,
                changed_units: self.changed,
                total_units: self.seg.units(),
                age: if current {
                    Duration::ZERO
                } else {
                    now.saturating_duration_since(self.known_at)
                },
            },
            leased,
        )
    }
}

/// True when a cached copy may be used with no message. While its lease
/// lasts the home tells this node of every new version before applying it,
/// so what the client knows of the master is exact and Delta and Diff are
/// decided locally; past it only Temporal (age since the copy was known
/// current) and user predicates can be, and the others ask the home.
fn usable_without_message(model: &Coherence, v: &CacheView, leased: bool) -> bool {
    if v.known_master.is_none() {
        return false;
    }
    match model {
        Coherence::Full => false,
        Coherence::Temporal(_) | Coherence::User(_) => model.recent_enough(v),
        Coherence::Delta(_) | Coherence::Diff(_) => leased && model.recent_enough(v),
    }
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

/// The peer service of the process a TMT names (`n<id>`).
fn peer_addr(at: &str) -> Result<Address, Failure> {
    let node: u32 = at
        .strip_prefix('n')
        .and_then(|n| n.parse().ok())
        .ok_or_else(|| Failure::new(Status::AddrError, format!("state: no process {at}")))?;
    Address::new(PEER_SERVICE, NodeId(node))
        .map_err(|e| Failure::new(Status::AddrError, e.to_string()))
}

fn hash(secret: &[u8]) -> [u8; 32] {
    Sha256::digest(secret).into()
}

/// The proactive buffer: pushed diffs per segment, by identifier.
type Pushed = Vec<(SegUrl, Vec<(u64, Vec<u8>)>)>;

impl StateClient {
    /// A client making its calls through `rpc` (the node's). The first
    /// client of a node serves the node's peer service; a later one submits
    /// its diffs to the homes instead of holding them.
    pub fn new(rpc: Rpc) -> Self {
        let me = format!("n{}", rpc.node_id().0);
        let mut h = std::collections::hash_map::DefaultHasher::new();
        (
            rpc.node_id().0,
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos()),
            std::process::id(),
        )
            .hash(&mut h);
        let id_seed = h.finish();
        let inner = Arc::new_cyclic(|weak: &Weak<Inner>| {
            let w = weak.clone();
            let registered = rpc.register(
                PEER_SERVICE,
                ServiceOptions::no_state(),
                move |ctx: weft_rpc::CallContext, req: PeerRequest| {
                    let w = w.clone();
                    async move {
                        let inner = w.upgrade().ok_or_else(|| {
                            Failure::new(Status::Unavailable, "state: client gone")
                        })?;
                        StateClient(inner).serve_peer(ctx.caller().node, req).await
                    }
                },
            );
            if let Err(e) = &registered {
                tracing::debug!(error = %e, "state: another client serves this node's peers");
            }
            let serving = registered.is_ok();
            Inner {
                rpc,
                me,
                limits: SegLimits::default(),
                cache: Mutex::new(HashMap::new()),
                stats: Mutex::new(ClientStats::default()),
                txs: Mutex::new(HashMap::new()),
                fetchers: Mutex::new(HashMap::new()),
                proactive: AtomicBool::new(true),
                serving,
                id_seed,
                next_id: AtomicU64::new(1),
                phases: Mutex::new(WritePhases::default()),
                resource: Arc::new(TxEnd(weak.clone())),
            }
        });
        StateClient(inner)
    }

    /// What the cache saved and moved so far.
    pub fn stats(&self) -> ClientStats {
        *self.0.stats.lock()
    }

    /// How long the last write critical section spent in each phase.
    pub fn last_write_phases(&self) -> WritePhases {
        *self.0.phases.lock()
    }

    /// Turns proactive diffs on (the default) or off (diffs then always
    /// travel on demand).
    pub fn set_proactive(&self, on: bool) {
        self.0.proactive.store(on, Ordering::Relaxed);
        if !on {
            self.0.fetchers.lock().clear();
        }
    }

    /// True when the home of `url` did not answer the last time it was
    /// asked: the cached copy may be older than its model allows.
    pub fn is_stale(&self, url: &SegUrl) -> bool {
        self.0.cache.lock().get(url).is_some_and(|e| e.stale)
    }

    fn new_id(&self) -> u64 {
        let n = self.0.next_id.fetch_add(1, Ordering::Relaxed);
        // An odd multiplier makes the map from counter to id one-to-one.
        (self.0.id_seed ^ n.wrapping_mul(0x9E37_79B9_7F4A_7C15)).max(1)
    }

    async fn call(
        &self,
        tx: Option<&TxContext>,
        url: &SegUrl,
        req: HomeRequest,
    ) -> Result<HomeReply, Failure> {
        let addr = home_addr(url)?;
        let r = self
            .0
            .rpc
            .call_payload(tx, &addr, Payload::local(req), None)
            .await;
        let p = match r {
            Ok(p) => p,
            Err(e) => {
                if home_unreachable(e.status) {
                    if let Some(c) = self.0.cache.lock().get_mut(url) {
                        c.stale = true;
                    }
                }
                return Err(e);
            }
        };
        HomeReply::from_payload(p).map_err(|e| {
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
            _ => return Err(unexpected("open")),
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
                        secret_hash: hash(secret),
                        known_master: None,
                        known_at: Instant::now(),
                        changed: 0,
                        lease_until: None,
                        tentative_of: None,
                        tag: 0,
                        stale: false,
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
            peer: self.0.serving,
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
    /// known current as of then, never later: a conservative age and lease).
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
            tag,
            lease_ms,
        } = reply
        else {
            return Err(unexpected("a lock or fetch"));
        };
        let mut moved = 0u64;
        let mut c = self.0.cache.lock();
        let e = c
            .get_mut(url)
            .ok_or_else(|| Failure::new(Status::AddrError, url.to_string()))?;
        let max = MAX_REFRESH_BYTES;
        let applying = Instant::now();
        match refresh {
            WireRefresh::Current => {}
            WireRefresh::Diff(b) => {
                moved += b.len() as u64;
                if let Err(err) = apply_diff_bytes(&mut e.seg, &b, max) {
                    if matches!(err, StateError::Decode(_) | StateError::LimitExceeded(_)) {
                        return Err(fail(err));
                    }
                    // Our copy was not what we said: take the image next time.
                    forget(e);
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
        // A notice may have overtaken this reply: what is known only grows.
        let newest = e.known_master.map_or(version, |k| k.max(version));
        if newest == version {
            e.changed = 0;
        }
        e.known_master = Some(newest);
        e.known_at = sent;
        e.tag = tag;
        e.stale = false;
        e.lease_until = (lease_ms > 0).then(|| sent + Duration::from_millis(lease_ms));
        if let (Some(t), Some(b)) = (tid, tentative) {
            moved += b.len() as u64;
            apply_diff_bytes(&mut e.seg, &b, max).map_err(fail)?;
            e.tentative_of = Some(t);
            e.tag = 0;
        }
        let v = e.seg.version();
        drop(c);
        let took = applying.elapsed().as_nanos() as u64;
        let mut st = self.0.stats.lock();
        st.refresh_bytes += moved;
        st.apply_ns += took;
        debug_assert!(tid.is_none() || v == tx_version);
        Ok(v)
    }

    /// The transaction's TMT at this node, without the diffs of
    /// sub-transactions known here to have aborted.
    fn load_tmt(&self, tid: Tid) -> Result<Tmt, Failure> {
        let mut tmt = match self
            .0
            .rpc
            .tm()
            .baggage(tid)
            .as_ref()
            .and_then(|b| b.get(BAGGAGE_KEY))
        {
            Some(v) => Tmt::decode(v).map_err(fail)?,
            None => Tmt::default(),
        };
        if let Some(t) = self.0.txs.lock().get(&tid) {
            if !t.aborted.is_empty() {
                tmt.prune(&t.aborted);
            }
        }
        Ok(tmt)
    }

    fn save_tmt(&self, tid: Tid, tmt: &Tmt) {
        let b = Baggage(vec![BaggageItem {
            key: BAGGAGE_KEY.to_string(),
            value: Bytes::from(tmt.encode()),
        }]);
        self.0.rpc.tm().merge_baggage(tid, &b);
    }

    fn load_pushed(&self, tid: Tid) -> Pushed {
        self.0
            .rpc
            .tm()
            .baggage(tid)
            .as_ref()
            .and_then(|b| b.get(PUSH_KEY))
            .and_then(|v| postcard::from_bytes(v).ok())
            .unwrap_or_default()
    }

    /// Enlists this client in `tid` at this node (once), so what it holds
    /// for `tid` is dropped when the transaction ends and a sub-transaction
    /// abort reaches it.
    fn enlist(&self, tid: Tid) {
        let _ = self.0.rpc.tm().enlist(tid, Arc::clone(&self.0.resource));
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
                let entry = tmt.get(url).expect("a local case has an entry");
                if entry.diffs.is_empty() && entry.mode == LockMode::Read {
                    let want = entry.latest;
                    let ok = {
                        let c = self.0.cache.lock();
                        c.get(url).is_some_and(|e| {
                            e.seg.version() == want && e.tentative_of.is_none_or(|t| t == tid)
                        })
                    };
                    if ok {
                        self.0.stats.lock().local_grants += 1;
                    } else {
                        self.enlist(tid);
                        self.lock_at_home(tx, url, mode, &mut tmt).await?;
                    }
                } else if entry.diffs.iter().any(|d| d.at == AT_HOME) {
                    self.enlist(tid);
                    self.lock_at_home(tx, url, mode, &mut tmt).await?;
                } else {
                    self.enlist(tid);
                    self.catch_up(tid, url, &tmt).await?;
                }
            }
            LockCase::Acquire if mode == LockMode::Read => {
                let now = Instant::now();
                let view = {
                    let c = self.0.cache.lock();
                    c.get(url)
                        .filter(|e| e.tentative_of.is_none())
                        .map(|e| (e.view(now), e.tag))
                };
                match view {
                    Some(((v, leased), tag)) if usable_without_message(model, &v, leased) => {
                        self.0.stats.lock().local_grants += 1;
                        tmt.granted(url, LockMode::Read, v.cached_version, tag)
                            .map_err(fail)?;
                    }
                    _ => {
                        self.enlist(tid);
                        self.lock_at_home(tx, url, mode, &mut tmt).await?
                    }
                }
            }
            LockCase::Acquire | LockCase::Upgrade => {
                self.enlist(tid);
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
        if !in_use.is_empty() {
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
            peer: self.0.serving,
        };
        let sent = Instant::now();
        let reply = self.call(Some(tx), url, req).await?;
        let (master, tag) = match &reply {
            HomeReply::Refresh { version, tag, .. } => (*version, *tag),
            _ => (0, 0),
        };
        let v = self.apply_reply(url, Some(tx.tid), reply, sent)?;
        tmt.granted(url, mode, master, tag).map_err(fail)?;
        if let Some(e) = tmt.get_mut(url) {
            if e.diffs.iter().all(|d| d.at == AT_HOME) {
                // The home is the authority on what the transaction
                // submitted (an aborted sub-transaction's versions are gone).
                e.latest = v;
            }
        }
        Ok(())
    }

    /// Brings the cached copy of `url` (locked by the transaction) to the
    /// transaction's latest version: from the master (asking the home only
    /// when the copy is not on the transaction's chain), then the diffs it
    /// lacks, from the proactive buffer first, else from their holders.
    async fn catch_up(&self, tid: Tid, url: &SegUrl, tmt: &Tmt) -> Result<(), Failure> {
        let e = tmt.get(url).expect("locked");
        let on_chain = |c: &Cached| -> bool {
            let v = c.seg.version();
            if c.known_master.is_none() && v == 0 {
                return false;
            }
            if v == e.master_version && c.tentative_of.is_none() {
                return true;
            }
            c.tag != 0 && tmt.tag_at(url, v) == Some(c.tag)
        };
        let (at_chain, version) = {
            let c = self.0.cache.lock();
            let ce = c.get(url).ok_or_else(|| {
                Failure::new(Status::AddrError, format!("{url} is not open here"))
            })?;
            (on_chain(ce), ce.seg.version())
        };
        if at_chain && version == e.latest {
            self.0.stats.lock().local_grants += 1;
            return Ok(());
        }
        if !at_chain {
            // The transaction holds the lock: the master is still the
            // version it was locked at.
            let v = self.refresh(url).await?;
            if v != e.master_version {
                return Err(Failure::new(
                    Status::Mismatch,
                    format!(
                        "{url}: master at {v}, the transaction locked {}",
                        e.master_version
                    ),
                ));
            }
        }
        let have = self.0.cache.lock().get(url).map_or(0, |c| c.seg.version());
        let missing: Vec<DiffLoc> = tmt.missing(url, have);
        let mut got: HashMap<u64, Arc<Vec<u8>>> = HashMap::new();
        // 1. The proactive buffer.
        let pushed = self.load_pushed(tid);
        if let Some((_, diffs)) = pushed.iter().find(|(u, _)| u == url) {
            let mut used = 0;
            for (id, b) in diffs {
                if missing.iter().any(|d| d.id == *id) {
                    got.insert(*id, Arc::new(b.clone()));
                    used += 1;
                }
            }
            self.0.stats.lock().pushed_used += used;
        }
        // 2. Held here.
        if let Some(t) = self.0.txs.lock().get(&tid) {
            if let Some(held) = t.segs.get(url) {
                for h in held {
                    if missing.iter().any(|d| d.id == h.id) {
                        got.entry(h.id).or_insert_with(|| Arc::clone(&h.bytes));
                    }
                }
            }
        }
        // 3. Their holders, one request per holder.
        let mut by_holder: BTreeMap<&str, Vec<u64>> = BTreeMap::new();
        for d in missing.iter().filter(|d| !got.contains_key(&d.id)) {
            by_holder.entry(d.at.as_str()).or_default().push(d.id);
        }
        let secret = self
            .0
            .cache
            .lock()
            .get(url)
            .map(|c| c.secret_hash)
            .unwrap_or_default();
        for (at, ids) in by_holder {
            for (id, _, b) in self.fetch_held(at, tid, url, secret, ids).await? {
                got.insert(id, Arc::new(b));
            }
        }
        // Apply in version order.
        let mut c = self.0.cache.lock();
        let ce = c
            .get_mut(url)
            .ok_or_else(|| Failure::new(Status::AddrError, url.to_string()))?;
        for d in &missing {
            let applied = got
                .get(&d.id)
                .ok_or_else(|| {
                    StateError::BadDiff(format!("diff {} to v{} not found", d.id, d.target))
                })
                .and_then(|b| codec::decode_diff(b, MAX_REFRESH_BYTES))
                .and_then(|diff| {
                    if diff.target != d.target {
                        return Err(StateError::BadDiff(format!(
                            "diff {} is to v{}, not v{}",
                            d.id, diff.target, d.target
                        )));
                    }
                    ce.seg.apply_owned(diff)
                });
            if let Err(err) = applied {
                forget(ce);
                return Err(fail(err));
            }
            ce.tentative_of = Some(tid);
            ce.tag = d.id;
        }
        Ok(())
    }

    async fn fetch_held(
        &self,
        at: &str,
        tid: Tid,
        url: &SegUrl,
        secret: [u8; 32],
        ids: Vec<u64>,
    ) -> Result<Vec<WireHeld>, Failure> {
        let addr = peer_addr(at)?;
        self.0.stats.lock().peer_fetches += 1;
        let req = PeerRequest::Diffs {
            tid,
            url: url.clone(),
            secret,
            ids: ids.clone(),
        };
        let reply = self
            .0
            .rpc
            .call_payload(None, &addr, Payload::local(req), None)
            .await?
            .decode::<PeerReply>()
            .map_err(|e| Failure::new(Status::Mismatch, e.to_string()))?;
        match reply {
            PeerReply::Diffs(v) if v.len() == ids.len() => Ok(v),
            _ => Err(unexpected("a diff fetch")),
        }
    }

    /// Answers another process (see [`crate::peer`]).
    async fn serve_peer(&self, from: NodeId, req: PeerRequest) -> Result<PeerReply, Failure> {
        match req {
            PeerRequest::Diffs {
                tid,
                url,
                secret,
                ids,
            } => {
                self.check_peer_secret(&url, &secret, false)?;
                let out = self.held_diffs(tid, &url, &ids)?;
                if self.0.proactive.load(Ordering::Relaxed) {
                    let mut f = self.0.fetchers.lock();
                    let e = f.entry(url).or_insert((from, 0));
                    if e.0 == from {
                        e.1 = e.1.saturating_add(1);
                    } else {
                        *e = (from, 1);
                    }
                }
                Ok(PeerReply::Diffs(out))
            }
            PeerRequest::Collect { tid, segs } => {
                let tmt = self.load_tmt(tid)?;
                let pushed = self.load_pushed(tid);
                let mut out = Vec::new();
                for (url, secret) in segs {
                    self.check_peer_secret(&url, &secret, true)?;
                    let Some(e) = tmt.get(&url) else {
                        out.push((url, Vec::new()));
                        continue;
                    };
                    let mut diffs: Vec<Option<WireHeld>> = vec![None; e.diffs.len()];
                    let mut by_holder: BTreeMap<String, Vec<(usize, u64)>> = BTreeMap::new();
                    let held = self
                        .0
                        .txs
                        .lock()
                        .get(&tid)
                        .and_then(|t| t.segs.get(&url).cloned());
                    let pushed = pushed.iter().find(|(u, _)| *u == url).map(|(_, d)| d);
                    for (i, d) in e.diffs.iter().enumerate() {
                        if let Some(h) = held.as_ref().and_then(|h| h.iter().find(|h| h.id == d.id))
                        {
                            diffs[i] = Some((h.id, h.sub.clone(), (*h.bytes).clone()));
                        } else if let Some((_, b)) =
                            pushed.and_then(|p| p.iter().find(|(id, _)| *id == d.id))
                        {
                            diffs[i] = Some((d.id, d.sub.clone(), b.clone()));
                        } else {
                            by_holder.entry(d.at.clone()).or_default().push((i, d.id));
                        }
                    }
                    for (at, want) in by_holder {
                        let ids = want.iter().map(|(_, id)| *id).collect();
                        let got = self.fetch_held(&at, tid, &url, secret, ids).await?;
                        for ((i, id), (gid, _, b)) in want.into_iter().zip(got) {
                            if gid != id {
                                return Err(unexpected("a diff fetch"));
                            }
                            diffs[i] = Some((id, e.diffs[i].sub.clone(), b));
                        }
                    }
                    out.push((url, diffs.into_iter().flatten().collect()));
                }
                Ok(PeerReply::Collected(out))
            }
            PeerRequest::Notice {
                url,
                since,
                version,
                changed,
            } => {
                let mut c = self.0.cache.lock();
                if let Some(e) = c.get_mut(&url) {
                    if e.known_master.is_none_or(|m| m < version) {
                        e.known_master = Some(version);
                        // Counted whole even when the copy already holds
                        // part of it (`since` below its version): the
                        // estimate never falls short.
                        let _ = since;
                        e.changed = e.changed.saturating_add(changed);
                    }
                }
                drop(c);
                self.0.stats.lock().notices += 1;
                Ok(PeerReply::Ack)
            }
        }
    }

    fn check_peer_secret(
        &self,
        url: &SegUrl,
        secret: &[u8; 32],
        absent_ok: bool,
    ) -> Result<(), Failure> {
        match self.0.cache.lock().get(url) {
            Some(e) if &e.secret_hash == secret => Ok(()),
            Some(_) => Err(Failure::new(
                Status::WrongSecret,
                format!("wrong secret for {url}"),
            )),
            None if absent_ok => Ok(()),
            None => Err(Failure::new(
                Status::AddrError,
                format!("{url} is not open here"),
            )),
        }
    }

    fn held_diffs(&self, tid: Tid, url: &SegUrl, ids: &[u64]) -> Result<Vec<WireHeld>, Failure> {
        let txs = self.0.txs.lock();
        let held = txs.get(&tid).and_then(|t| t.segs.get(url));
        ids.iter()
            .map(|id| {
                held.and_then(|h| h.iter().find(|h| h.id == *id))
                    .map(|h| (h.id, h.sub.clone(), (*h.bytes).clone()))
                    .ok_or_else(|| {
                        Failure::new(
                            Status::Mismatch,
                            format!("state: diff {id} of {url} is not held here (its sub-transaction aborted?)"),
                        )
                    })
            })
            .collect()
    }

    /// Puts every diff of `url` held here for `tid` into the transaction's
    /// proactive buffer (once a node fetched them [`PUSH_AFTER`] times in a
    /// row).
    fn push(&self, tid: Tid, url: &SegUrl) {
        let wanted = self
            .0
            .fetchers
            .lock()
            .get(url)
            .is_some_and(|(_, n)| *n >= PUSH_AFTER);
        if !wanted {
            return;
        }
        let held: Vec<(u64, Vec<u8>)> =
            match self.0.txs.lock().get(&tid).and_then(|t| t.segs.get(url)) {
                Some(h) => h.iter().map(|h| (h.id, (*h.bytes).clone())).collect(),
                None => return,
            };
        let mut pushed = self.load_pushed(tid);
        match pushed.iter_mut().find(|(u, _)| u == url) {
            Some((_, d)) => {
                for (id, b) in held {
                    if !d.iter().any(|(x, _)| *x == id) {
                        d.push((id, b));
                    }
                }
            }
            None => pushed.push((url.clone(), held)),
        }
        let Ok(bytes) = postcard::to_allocvec(&pushed) else {
            return;
        };
        if bytes.len() > MAX_PUSH_BYTES {
            return;
        }
        let b = Baggage(vec![BaggageItem {
            key: PUSH_KEY.to_string(),
            value: Bytes::from(bytes),
        }]);
        self.0.rpc.tm().merge_baggage(tid, &b);
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
        let t0 = Instant::now();
        let mut tmt = self
            .lock(tx, url, LockMode::Write, &Coherence::Full)
            .await?;
        let deps: Vec<(SegUrl, u64)> = tmt
            .entries
            .iter()
            .filter(|e| &e.url != url)
            .map(|e| (e.url.clone(), e.latest))
            .collect();
        let t1 = Instant::now();
        let (r, diff, t2) = {
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
            let t2 = Instant::now();
            match r {
                Ok(r) => {
                    let d = collect(&mut e.seg, twins);
                    if !d.is_empty() || d.target != d.base {
                        e.tentative_of = Some(tx.tid);
                    }
                    (r, d, t2)
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
        if self.0.serving {
            // Held here until the root ends; the TMT says where.
            let id = self.new_id();
            if let Some(e) = self.0.cache.lock().get_mut(url) {
                e.tag = id;
            }
            self.0
                .txs
                .lock()
                .entry(tx.tid)
                .or_default()
                .segs
                .entry(url.clone())
                .or_default()
                .push(Held {
                    id,
                    sub: tx.path.clone(),
                    bytes: Arc::new(bytes),
                });
            tmt.created_diff(url, diff.target, &self.0.me, id, &tx.path)
                .map_err(fail)?;
            self.save_tmt(tx.tid, &tmt);
            if self.0.proactive.load(Ordering::Relaxed) {
                self.push(tx.tid, url);
            }
            *self.0.phases.lock() = WritePhases {
                lock: t1 - t0,
                local: t2 - t1,
                collect: t2.elapsed(),
            };
            return Ok(r);
        }
        let req = HomeRequest::Submit {
            path: url.path.clone(),
            diff: bytes,
        };
        match self.call(Some(tx), url, req).await {
            Ok(HomeReply::Submitted { version }) => {
                if let Some(e) = self.0.cache.lock().get_mut(url) {
                    e.tag = 0;
                }
                tmt.created_diff(url, version, AT_HOME, 0, &tx.path)
                    .map_err(fail)?;
                self.save_tmt(tx.tid, &tmt);
                Ok(r)
            }
            Ok(_) => Err(unexpected("submit")),
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
    /// and the bytes the refresh moved. When the home cannot be reached,
    /// a relaxed model (anything but Full) still reads the cached copy, and
    /// the copy is marked stale ([`StateClient::is_stale`]).
    ///
    /// Fails like [`StateClient::refresh`] (Full, or no copy yet).
    pub async fn peek<R>(
        &self,
        url: &SegUrl,
        model: &Coherence,
        f: impl FnOnce(&Segment) -> R,
    ) -> Result<(R, u64), Failure> {
        let (fresh, has_copy) = {
            let c = self.0.cache.lock();
            let e = c
                .get(url)
                .ok_or_else(|| Failure::new(Status::AddrError, url.to_string()))?;
            let (v, leased) = e.view(Instant::now());
            (
                e.tentative_of.is_none() && usable_without_message(model, &v, leased),
                e.known_master.is_some() && e.tentative_of.is_none(),
            )
        };
        let before = self.stats().refresh_bytes;
        if !fresh {
            if let Err(e) = self.refresh(url).await {
                let relaxed = !matches!(model, Coherence::Full);
                if !(relaxed && has_copy && home_unreachable(e.status)) {
                    return Err(e);
                }
            }
        }
        let moved = self.stats().refresh_bytes - before;
        let c = self.0.cache.lock();
        let e = c
            .get(url)
            .ok_or_else(|| Failure::new(Status::AddrError, url.to_string()))?;
        Ok((f(&e.seg), moved))
    }
}
