//! The home node: serves its segments as the weft service `state` and takes
//! part in transactions as a two-phase resource.
//!
//! Owns the async shell around [`crate::core::home::HomeSegment`]: the
//! service's requests (open/create with an access secret, lock, fetch,
//! submit, list), bounded lock waits (LockConflict at the bound, never a
//! wait forever), prepare (collects the diffs the transaction's writers
//! hold, through its root, and appends them to the node's log; the
//! transaction manager forces it), commit (tells subscribed caching nodes of
//! the new version, waits for them or their lease, then applies the diffs
//! to the master),
//! abort and sub-transaction abort, checkpoints of every segment to files,
//! and recovery (checkpoint images, then committed diffs from the log).
//! Must never hold its mutex across an `.await`, apply an uncommitted diff to
//! a master, or let a peer's bad diff touch one.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::future::BoxFuture;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use tokio::sync::Notify;
use weft_log::{Log, LogRecord, Lsn, RecordTag};
use weft_rpc::{CallContext, Plugin, Rpc, ServiceOptions};
use weft_tx::{ParticipationClass, Recovered, Resource, TxManager, Vote};
use weft_wire::ids::{Address, NodeId, SubPath, Tid};
use weft_wire::status::{Failure, Status};
use weft_wire::Payload;

use crate::core::codec::{self, FrameKind};
use crate::core::error::StateError;
use crate::core::home::{HomeLimits, HomeSegment, Refresh};
use crate::core::mip::SegUrl;
use crate::core::segment::{SegLimits, Segment};
use crate::core::tmt::LockMode;
use crate::peer::{PeerReply, PeerRequest, PEER_SERVICE};

/// The service name.
pub const SERVICE: &str = "state";
/// The log record tag of the shared-state layer.
pub const STATE_RECORD_TAG: RecordTag = RecordTag(0x0A00);

/// A request to a home node.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum HomeRequest {
    /// Opens a segment, creating it when `create` and absent.
    Open {
        /// The segment's path.
        path: String,
        /// Its access secret.
        secret: Vec<u8>,
        /// Create when absent.
        create: bool,
    },
    /// Locks a segment in the caller's transaction and refreshes the caller
    /// from version `have` (none: no copy) to the transaction's version.
    Lock {
        /// The segment's path.
        path: String,
        /// Its access secret.
        secret: Vec<u8>,
        /// Read or write.
        mode: LockMode,
        /// The caller's cached version.
        have: Option<u64>,
        /// The transaction whose uncommitted diffs the cached copy holds.
        tentative_of: Option<Tid>,
        /// The caller serves [`crate::peer::PEER_SERVICE`]: it holds its
        /// diffs until the root ends (the home collects them at prepare)
        /// and takes version notices.
        peer: bool,
    },
    /// Refreshes from `have` to the master's committed version (no lock).
    Fetch {
        /// The segment's path.
        path: String,
        /// Its access secret.
        secret: Vec<u8>,
        /// The caller's cached version.
        have: Option<u64>,
        /// The transaction whose uncommitted diffs the cached copy holds.
        tentative_of: Option<Tid>,
        /// The caller serves [`crate::peer::PEER_SERVICE`] and takes
        /// version notices.
        peer: bool,
    },
    /// Submits a diff (wire form) written under the transaction's write lock.
    Submit {
        /// The segment's path.
        path: String,
        /// The diff.
        diff: Vec<u8>,
    },
    /// Lists the segments.
    List,
}

/// How a reply brings a copy up to date.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum WireRefresh {
    /// Nothing to do.
    Current,
    /// Apply this diff (wire form).
    Diff(Bytes),
    /// Replace by this image (wire form).
    Image(Bytes),
}

/// One segment in a listing.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct SegmentInfo {
    /// Its URL.
    pub url: String,
    /// Committed version.
    pub version: u64,
    /// Live blocks.
    pub blocks: u64,
    /// Units.
    pub units: u64,
    /// Transactions holding a lock.
    pub holders: u64,
}

/// A reply from a home node.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum HomeReply {
    /// Opened: the committed version.
    Opened {
        /// Committed version.
        version: u64,
    },
    /// A refresh to `version`; for a lock, `tentative` brings it on to the
    /// transaction's uncommitted version.
    Refresh {
        /// Master version.
        version: u64,
        /// How to reach it.
        refresh: WireRefresh,
        /// The transaction's uncommitted diffs past the master (locks only).
        tentative: Option<Bytes>,
        /// The version the transaction sees.
        tx_version: u64,
        /// The identifier of the diff that produced the master version (0:
        /// unknown).
        tag: u64,
        /// A caller that serves the peer service hears of every new master
        /// version for this long from when it sent the request (0: no
        /// notices).
        lease_ms: u64,
    },
    /// The diff was accepted; the transaction's version.
    Submitted {
        /// The transaction's version.
        version: u64,
    },
    /// The segments.
    List(Vec<SegmentInfo>),
}

/// [`HomeReply`] with its byte fields borrowed from the bytes it is decoded
/// from: the same postcard form (variants and fields in the same order; a
/// `Bytes` and a `&[u8]` both travel as a length and the bytes).
#[derive(Deserialize)]
enum HomeReplyRef<'a> {
    Opened {
        version: u64,
    },
    Refresh {
        version: u64,
        #[serde(borrow)]
        refresh: WireRefreshRef<'a>,
        #[serde(borrow)]
        tentative: Option<&'a [u8]>,
        tx_version: u64,
        tag: u64,
        lease_ms: u64,
    },
    Submitted {
        version: u64,
    },
    List(Vec<SegmentInfo>),
}

/// [`WireRefresh`], borrowed (see [`HomeReplyRef`]).
#[derive(Deserialize)]
enum WireRefreshRef<'a> {
    Current,
    Diff(&'a [u8]),
    Image(&'a [u8]),
}

impl HomeReply {
    /// Decodes a reply from its payload. The bytes of a refresh (a diff or
    /// an image: up to the whole segment) are not copied out of the
    /// payload: they stay a slice of the buffer the reply arrived in.
    ///
    /// Fails with the decoder's complaint when the bytes are not one whole
    /// reply, or the payload holds a local value of another type.
    pub fn from_payload(p: Payload) -> Result<HomeReply, String> {
        let b = match p {
            Payload::Bytes(b) => b,
            local => return local.decode::<HomeReply>().map_err(|e| e.to_string()),
        };
        let r = match postcard::take_from_bytes::<HomeReplyRef<'_>>(&b) {
            Ok((r, [])) => r,
            Ok((_, rest)) => return Err(format!("{} trailing bytes", rest.len())),
            Err(e) => return Err(e.to_string()),
        };
        Ok(match r {
            HomeReplyRef::Opened { version } => HomeReply::Opened { version },
            HomeReplyRef::Refresh {
                version,
                refresh,
                tentative,
                tx_version,
                tag,
                lease_ms,
            } => HomeReply::Refresh {
                version,
                refresh: match refresh {
                    WireRefreshRef::Current => WireRefresh::Current,
                    WireRefreshRef::Diff(d) => WireRefresh::Diff(b.slice_ref(d)),
                    WireRefreshRef::Image(i) => WireRefresh::Image(b.slice_ref(i)),
                },
                tentative: tentative.map(|t| b.slice_ref(t)),
                tx_version,
                tag,
                lease_ms,
            },
            HomeReplyRef::Submitted { version } => HomeReply::Submitted { version },
            HomeReplyRef::List(l) => HomeReply::List(l),
        })
    }
}

/// The home's configuration.
#[derive(Clone, Debug)]
pub struct HomeConfig {
    /// How long a lock request waits for a conflicting holder.
    pub lock_wait: Duration,
    /// Limits on each segment.
    pub limits: SegLimits,
    /// Limits on each segment's bookkeeping.
    pub home: HomeLimits,
    /// Most segments on this node.
    pub max_segments: usize,
    /// Longest diff or image accepted, in bytes.
    pub max_bytes: usize,
    /// Where checkpoints go (default: `state/` beside the log directory).
    pub dir: Option<PathBuf>,
    /// How long a caching node hears of new versions after it last asked
    /// (its copies' recency is decided locally meanwhile); a commit waits
    /// for the notice to be acknowledged, or for the lease of a node that
    /// does not answer to run out, before the new version is applied.
    pub notice_lease: Duration,
}

impl Default for HomeConfig {
    fn default() -> Self {
        HomeConfig {
            lock_wait: Duration::from_millis(500),
            limits: SegLimits::default(),
            home: HomeLimits::default(),
            max_segments: 4096,
            max_bytes: 64 << 20,
            dir: None,
            notice_lease: Duration::from_secs(1),
        }
    }
}

struct Entry {
    secret: [u8; 32],
    core: HomeSegment,
    /// Nodes that hear of new versions, until when.
    subs: BTreeMap<NodeId, Instant>,
}

impl Entry {
    fn new(secret: [u8; 32], core: HomeSegment) -> Self {
        Entry {
            secret,
            core,
            subs: BTreeMap::new(),
        }
    }

    /// Notes that `node` asked (at `now`): it hears of new versions until
    /// `now + lease`.
    fn subscribe(&mut self, node: NodeId, now: Instant, lease: Duration) {
        if lease.is_zero() {
            return;
        }
        self.subs.retain(|_, until| *until > now);
        if self.subs.len() < MAX_SUBSCRIBERS || self.subs.contains_key(&node) {
            self.subs.insert(node, now + lease);
        }
    }
}

/// Most nodes that hear of one segment's new versions.
pub const MAX_SUBSCRIBERS: usize = 1024;

#[derive(Serialize, Deserialize)]
enum StateRecord {
    Created {
        path: String,
        secret: [u8; 32],
    },
    Prepared {
        tid: Tid,
        segs: Vec<(String, Vec<Vec<u8>>)>,
    },
}

#[derive(Serialize, Deserialize)]
struct CheckpointFile {
    path: String,
    secret: [u8; 32],
    image: Vec<u8>,
}

struct Inner {
    cfg: HomeConfig,
    segs: Mutex<BTreeMap<String, Entry>>,
    /// Prepared, undecided transactions and their prepare records.
    prepared: Mutex<BTreeMap<Tid, Lsn>>,
    released: Notify,
    /// Transactions whose writers hold their diffs, and a node that asked
    /// for the write lock (asked at prepare if the root cannot answer).
    holders: Mutex<BTreeMap<Tid, NodeId>>,
    /// Aborted sub-transactions of running transactions.
    aborted: Mutex<BTreeMap<Tid, Vec<SubPath>>>,
    rpc: OnceLock<Rpc>,
    node: OnceLock<String>,
    log: OnceLock<Log>,
    dir: OnceLock<PathBuf>,
}

/// The shared-state home of one node: a [`Plugin`] to add with
/// `NodeBuilder::plugin`.
#[derive(Clone)]
pub struct StateHome(Arc<Inner>);

struct HomeResource(Arc<Inner>);

fn fail(e: StateError) -> Failure {
    Failure::new(e.status(), e.to_string())
}

fn hash(secret: &[u8]) -> [u8; 32] {
    Sha256::digest(secret).into()
}

impl StateHome {
    /// A home with `cfg`.
    pub fn new(cfg: HomeConfig) -> Self {
        StateHome(Arc::new(Inner {
            cfg,
            segs: Mutex::new(BTreeMap::new()),
            prepared: Mutex::new(BTreeMap::new()),
            released: Notify::new(),
            holders: Mutex::new(BTreeMap::new()),
            aborted: Mutex::new(BTreeMap::new()),
            rpc: OnceLock::new(),
            node: OnceLock::new(),
            log: OnceLock::new(),
            dir: OnceLock::new(),
        }))
    }

    /// The committed master copy of `path`, if any (a clone).
    pub fn master(&self, path: &str) -> Option<Segment> {
        self.0
            .segs
            .lock()
            .get(path)
            .map(|e| e.core.master().clone())
    }

    /// The segments of this home.
    pub fn list(&self) -> Vec<SegmentInfo> {
        self.0.list()
    }

    /// The version transaction `tid` sees of `path` (its uncommitted diffs
    /// included), if the segment exists.
    pub fn tx_version(&self, path: &str, tid: Tid) -> Option<u64> {
        self.0
            .segs
            .lock()
            .get(path)
            .map(|e| e.core.tentative_version(tid))
    }
}

impl Inner {
    fn list(&self) -> Vec<SegmentInfo> {
        self.segs
            .lock()
            .values()
            .map(|e| {
                let m = e.core.master();
                SegmentInfo {
                    url: m.url().to_string(),
                    version: m.version(),
                    blocks: m.block_count() as u64,
                    units: m.units(),
                    holders: e.core.holders() as u64,
                }
            })
            .collect()
    }

    fn url(&self, path: &str) -> Result<SegUrl, Failure> {
        let node = self.node.get().cloned().unwrap_or_default();
        format!("weft://{node}/{path}").parse().map_err(fail)
    }

    fn check_secret(&self, path: &str, secret: &[u8]) -> Result<(), Failure> {
        match self.segs.lock().get(path) {
            None => Err(Failure::new(
                Status::AddrError,
                format!("no segment {path}"),
            )),
            Some(e) if e.secret != hash(secret) => Err(Failure::new(
                Status::WrongSecret,
                format!("wrong secret for {path}"),
            )),
            Some(_) => Ok(()),
        }
    }

    async fn open(
        &self,
        path: String,
        secret: Vec<u8>,
        create: bool,
    ) -> Result<HomeReply, Failure> {
        let url = self.url(&path)?;
        let h = hash(&secret);
        let lsn = {
            let mut segs = self.segs.lock();
            if let Some(e) = segs.get(&path) {
                if e.secret != h {
                    return Err(Failure::new(
                        Status::WrongSecret,
                        format!("wrong secret for {path}"),
                    ));
                }
                return Ok(HomeReply::Opened {
                    version: e.core.master().version(),
                });
            }
            if !create {
                return Err(Failure::new(Status::AddrError, format!("no segment {url}")));
            }
            if segs.len() >= self.cfg.max_segments {
                return Err(Failure::new(
                    Status::TooLarge,
                    "too many segments on this node",
                ));
            }
            let lsn = match self.log.get() {
                Some(log) => {
                    let rec = postcard::to_allocvec(&StateRecord::Created {
                        path: path.clone(),
                        secret: h,
                    })
                    .expect("encodes");
                    Some((
                        log.clone(),
                        log.append(STATE_RECORD_TAG, &rec).map_err(|e| {
                            Failure::new(Status::Unavailable, format!("state: log append: {e}"))
                        })?,
                    ))
                }
                None => None,
            };
            segs.insert(
                path.clone(),
                Entry::new(
                    h,
                    HomeSegment::new(Segment::new(url, self.cfg.limits), self.cfg.home),
                ),
            );
            lsn
        };
        if let Some((log, lsn)) = lsn {
            log.force(lsn)
                .await
                .map_err(|e| Failure::new(Status::Unavailable, format!("state: log force: {e}")))?;
        }
        Ok(HomeReply::Opened { version: 0 })
    }

    /// What brings a copy at `have` to the master's version (a lone diff
    /// is sent in the bytes it arrived in, or encoded where it lies).
    fn refresh_for(core: &HomeSegment, have: Option<u64>) -> WireRefresh {
        if let Some(b) = have.and_then(|h| core.only_wire_since(h)) {
            return WireRefresh::Diff(b);
        }
        if let Some(d) = have.and_then(|h| core.only_diff_since(h)) {
            return WireRefresh::Diff(codec::encode_diff(d).into());
        }
        Self::encode_refresh(core.refresh(have), core.master())
    }

    fn encode_refresh(r: Refresh, master: &Segment) -> WireRefresh {
        match r {
            Refresh::Current => WireRefresh::Current,
            Refresh::Diff(d) => WireRefresh::Diff(codec::encode_diff(&d).into()),
            Refresh::Whole => WireRefresh::Image(codec::encode_segment(master).into()),
        }
    }

    #[allow(clippy::too_many_arguments)]
    async fn lock(
        &self,
        tid: Tid,
        path: String,
        secret: Vec<u8>,
        mode: LockMode,
        have: Option<u64>,
        tentative_of: Option<Tid>,
        caller: NodeId,
        peer: bool,
    ) -> Result<HomeReply, Failure> {
        self.check_secret(&path, &secret)?;
        let deadline = Instant::now() + self.cfg.lock_wait;
        loop {
            let notified = self.released.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let mut segs = self.segs.lock();
                let e = segs
                    .get_mut(&path)
                    .ok_or_else(|| Failure::new(Status::AddrError, format!("no segment {path}")))?;
                if e.core.try_lock(tid, mode).map_err(fail)? {
                    let lease_ms = if peer {
                        e.subscribe(caller, Instant::now(), self.cfg.notice_lease);
                        if mode == LockMode::Write {
                            self.holders.lock().entry(tid).or_insert(caller);
                        }
                        self.cfg.notice_lease.as_millis() as u64
                    } else {
                        0
                    };
                    let version = e.core.master().version();
                    let tx_version = e.core.tentative_version(tid);
                    // A copy past the master holds this transaction's
                    // uncommitted diffs (or an aborted sub's): start it over
                    // from the master then.
                    // Whether a copy holding another transaction's diffs
                    // can be refreshed by diff is decided now, when granted:
                    // a request that waited for that transaction to release
                    // the lock finds it committed (deciding before the wait
                    // sent the whole segment to every caller that came while
                    // the last commit's phase two was still running).
                    let have = match tentative_of {
                        None => have,
                        Some(t) if t == tid => None,
                        Some(t) => have.filter(|_| e.core.committed_linear(t)),
                    };
                    let base = have.filter(|h| *h <= version);
                    let refresh = Self::refresh_for(&e.core, base);
                    let tentative = e
                        .core
                        .pending_since(tid, version)
                        .map(|d| Bytes::from(codec::encode_diff(&d)));
                    return Ok(HomeReply::Refresh {
                        version,
                        refresh,
                        tentative,
                        tx_version,
                        tag: e.core.tag(),
                        lease_ms,
                    });
                }
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(Failure::new(
                    Status::LockConflict,
                    format!(
                        "{path}: {mode:?} lock not granted within {:?}",
                        self.cfg.lock_wait
                    ),
                ));
            }
            let _ = tokio::time::timeout(deadline - now, notified).await;
        }
    }

    /// The cached version worth refreshing from: a copy holding another
    /// transaction's uncommitted diffs counts only when that transaction
    /// committed them all, in order (else: send the whole segment).
    fn trusted(&self, path: &str, have: Option<u64>, tentative_of: Option<Tid>) -> Option<u64> {
        match tentative_of {
            None => have,
            Some(t) => {
                let segs = self.segs.lock();
                segs.get(path)
                    .filter(|e| e.core.committed_linear(t))
                    .and(have)
            }
        }
    }

    fn fetch(
        &self,
        path: &str,
        secret: &[u8],
        have: Option<u64>,
        subscriber: Option<NodeId>,
    ) -> Result<HomeReply, Failure> {
        self.check_secret(path, secret)?;
        let mut segs = self.segs.lock();
        let e = segs
            .get_mut(path)
            .ok_or_else(|| Failure::new(Status::AddrError, path.to_string()))?;
        let lease_ms = match subscriber {
            Some(n) => {
                e.subscribe(n, Instant::now(), self.cfg.notice_lease);
                self.cfg.notice_lease.as_millis() as u64
            }
            None => 0,
        };
        let version = e.core.master().version();
        Ok(HomeReply::Refresh {
            version,
            refresh: Self::refresh_for(&e.core, have.filter(|h| *h <= version)),
            tentative: None,
            tx_version: version,
            tag: e.core.tag(),
            lease_ms,
        })
    }

    fn submit(
        &self,
        tid: Tid,
        sub: SubPath,
        path: &str,
        bytes: Vec<u8>,
    ) -> Result<HomeReply, Failure> {
        let diff = codec::decode_diff(&bytes, self.cfg.max_bytes).map_err(fail)?;
        let mut segs = self.segs.lock();
        let e = segs
            .get_mut(path)
            .ok_or_else(|| Failure::new(Status::AddrError, path.to_string()))?;
        let version = e
            .core
            .submit_wire(tid, sub, diff, 0, Some(Bytes::from(bytes)))
            .map_err(fail)?;
        Ok(HomeReply::Submitted { version })
    }

    async fn handle(&self, ctx: CallContext, req: HomeRequest) -> Result<HomeReply, Failure> {
        let tx = || {
            ctx.tx().cloned().ok_or_else(|| {
                Failure::new(
                    Status::BadRequest,
                    "state: locks and diffs need a transaction",
                )
            })
        };
        match req {
            HomeRequest::Open {
                path,
                secret,
                create,
            } => self.open(path, secret, create).await,
            HomeRequest::Lock {
                path,
                secret,
                mode,
                have,
                tentative_of,
                peer,
            } => {
                let tid = tx()?.tid;
                let caller = ctx.caller().node;
                self.lock(tid, path, secret, mode, have, tentative_of, caller, peer)
                    .await
            }
            HomeRequest::Fetch {
                path,
                secret,
                have,
                tentative_of,
                peer,
            } => {
                let have = self.trusted(&path, have, tentative_of);
                let sub = peer.then(|| ctx.caller().node);
                self.fetch(&path, &secret, have, sub)
            }
            HomeRequest::Submit { path, diff } => {
                let t = tx()?;
                self.submit(t.tid, t.path.clone(), &path, diff)
            }
            HomeRequest::List => Ok(HomeReply::List(self.list())),
        }
    }

    fn release_all(&self, tid: Tid, commit: bool) {
        {
            let mut segs = self.segs.lock();
            for e in segs.values_mut() {
                if commit {
                    e.core.commit(tid);
                } else {
                    e.core.abort(tid);
                }
            }
            self.prepared.lock().remove(&tid);
        }
        self.holders.lock().remove(&tid);
        self.aborted.lock().remove(&tid);
        self.released.notify_waiters();
    }

    /// At prepare: when `tid`'s writers hold their diffs, asks the root (or
    /// else the node that took the write lock) for every diff of the
    /// segments `tid` write-locked here, and checks them into its tentative
    /// copies (a diff of an aborted sub-transaction is skipped). Fails with
    /// the reason to vote No.
    async fn collect_held(&self, tid: Tid) -> Result<(), String> {
        let Some(asker) = self.holders.lock().remove(&tid) else {
            return Ok(());
        };
        let segs: Vec<(SegUrl, [u8; 32])> = self
            .segs
            .lock()
            .values()
            .filter(|e| e.core.held(tid) == Some(LockMode::Write))
            .map(|e| (e.core.master().url().clone(), e.secret))
            .collect();
        if segs.is_empty() {
            return Ok(());
        }
        let rpc = self.rpc.get().ok_or("state: not serving")?;
        let req = PeerRequest::Collect { tid, segs };
        let mut got = Err(String::from("state: nobody to collect diffs from"));
        let mut asked = vec![tid.node];
        if asker != tid.node {
            asked.push(asker);
        }
        for node in asked {
            let addr = Address::new(PEER_SERVICE, node).map_err(|e| e.to_string())?;
            let r = rpc
                .call_payload(None, &addr, Payload::local(req.clone()), None)
                .await
                .and_then(|p| {
                    p.decode::<PeerReply>()
                        .map_err(|e| Failure::new(Status::Mismatch, e.to_string()))
                });
            match r {
                Ok(PeerReply::Collected(v)) => {
                    got = Ok(v);
                    break;
                }
                Ok(_) => got = Err(format!("state: {addr} answered a collect oddly")),
                Err(e) => got = Err(format!("state: collecting diffs from {addr}: {e}")),
            }
        }
        let got = got?;
        let aborted = self.aborted.lock().get(&tid).cloned().unwrap_or_default();
        let mut segs = self.segs.lock();
        for (url, diffs) in got {
            let e = segs
                .get_mut(&url.path)
                .ok_or_else(|| format!("state: diffs for unknown segment {url}"))?;
            if e.core.held(tid) != Some(LockMode::Write) {
                return Err(format!("state: diffs for {url}, not write-locked"));
            }
            for (id, sub, bytes) in diffs {
                if aborted.iter().any(|a| a.is_ancestor_or_self(&sub)) {
                    continue;
                }
                let d = codec::decode_diff(&bytes, self.cfg.max_bytes)
                    .map_err(|e| format!("state: held diff of {url}: {e}"))?;
                e.core
                    .submit_wire(tid, sub, d, id, Some(Bytes::from(bytes)))
                    .map_err(|e| format!("state: held diff of {url}: {e}"))?;
            }
        }
        Ok(())
    }

    /// Commits `tid`, first telling every node caching a segment `tid`
    /// changes of its new version and waiting for each to acknowledge (or
    /// for the lease of one that does not to run out). The last check for
    /// nodes not yet told and the apply happen under one lock, so a node
    /// that subscribed meanwhile is told too, and no copy is ever judged
    /// against an older master than exists.
    async fn commit_notified(&self, tid: Tid) {
        let mut told: BTreeSet<(String, NodeId)> = BTreeSet::new();
        loop {
            let now = Instant::now();
            let mut sends = Vec::new();
            {
                let mut segs = self.segs.lock();
                for (path, e) in segs.iter_mut() {
                    let Some((since, version, changed)) = e.core.pending_summary(tid) else {
                        continue;
                    };
                    e.subs.retain(|_, until| *until > now);
                    for (node, until) in &e.subs {
                        if told.insert((path.clone(), *node)) {
                            sends.push((
                                *node,
                                *until,
                                PeerRequest::Notice {
                                    url: e.core.master().url().clone(),
                                    since,
                                    version,
                                    changed,
                                },
                            ));
                        }
                    }
                }
                if sends.is_empty() || self.rpc.get().is_none() {
                    for e in segs.values_mut() {
                        e.core.commit(tid);
                    }
                    self.prepared.lock().remove(&tid);
                    break;
                }
            }
            let rpc = self.rpc.get().expect("checked");
            let calls = sends.into_iter().map(|(node, until, req)| async move {
                let Ok(addr) = Address::new(PEER_SERVICE, node) else {
                    return;
                };
                let acked = tokio::time::timeout_at(
                    until.into(),
                    rpc.call_payload(None, &addr, Payload::local(req), Some(until)),
                )
                .await;
                if !matches!(acked, Ok(Ok(_))) {
                    // It may still trust its copy until its lease runs out.
                    tokio::time::sleep_until(until.into()).await;
                }
            });
            futures::future::join_all(calls).await;
        }
        self.holders.lock().remove(&tid);
        self.aborted.lock().remove(&tid);
        self.released.notify_waiters();
    }

    fn checkpoint_dir(&self) -> Option<&PathBuf> {
        self.dir.get()
    }

    /// Writes every master image; returns the lowest prepare record still
    /// needed. Images and that position are taken under the segments' lock,
    /// which prepare (append + note) and commit (apply + forget) also hold,
    /// so every transaction is either in an image or at/after the position.
    ///
    /// Commits are applied once their record is appended (early lock
    /// release), so the log is forced up to the last record seen before the
    /// images are written: a checkpoint never outlives what it holds.
    fn write_checkpoint(&self, dir: &Path, log: &Log) -> Result<Option<Lsn>, String> {
        std::fs::create_dir_all(dir).map_err(|e| e.to_string())?;
        let (files, low, last) = {
            let segs = self.segs.lock();
            let last = log.last_lsn();
            let low = self.prepared.lock().values().min().copied();
            let files: Vec<(String, Vec<u8>)> = segs
                .iter()
                .map(|(p, e)| {
                    let body = postcard::to_allocvec(&CheckpointFile {
                        path: p.clone(),
                        secret: e.secret,
                        image: codec::encode_image(&e.core.master().image()),
                    })
                    .expect("encodes");
                    (file_name(p), codec::frame(FrameKind::Image, &body))
                })
                .collect();
            (files, low, last)
        };
        if last > log.durable_lsn() {
            log.force_blocking(last).map_err(|e| e.to_string())?;
        }
        for (name, bytes) in files {
            let tmp = dir.join(format!("{name}.tmp"));
            let write = || -> std::io::Result<()> {
                use std::io::Write;
                let mut f = std::fs::File::create(&tmp)?;
                f.write_all(&bytes)?;
                f.sync_data()?;
                std::fs::rename(&tmp, dir.join(&name))
            };
            write().map_err(|e| e.to_string())?;
        }
        if let Ok(d) = std::fs::File::open(dir) {
            let _ = d.sync_all();
        }
        Ok(low)
    }
}

/// A checkpoint file's name: the path's hex, so any path is a safe name.
fn file_name(path: &str) -> String {
    let hex: String = path.bytes().map(|b| format!("{b:02x}")).collect();
    format!("{hex}.seg")
}

impl Resource for HomeResource {
    fn name(&self) -> &str {
        SERVICE
    }

    fn class(&self) -> ParticipationClass {
        ParticipationClass::TwoPhase
    }

    fn commits_from_this_log(&self) -> bool {
        true
    }

    fn prepare<'a>(&'a self, tid: Tid, log: &'a Log) -> BoxFuture<'a, Vote> {
        Box::pin(async move {
            if let Err(e) = self.0.collect_held(tid).await {
                self.0.release_all(tid, false);
                return Vote::No(e);
            }
            // Collect, append and note under the segments' lock (see
            // `write_checkpoint`).
            let appended = {
                let all = self.0.segs.lock();
                let segs: Vec<(String, Vec<Vec<u8>>)> = all
                    .iter()
                    .map(|(p, e)| (p.clone(), e.core.prepared_wire(tid)))
                    .filter(|(_, d)| !d.is_empty())
                    .map(|(p, d)| (p, d.iter().map(|b| b.to_vec()).collect()))
                    .collect();
                if segs.is_empty() {
                    None
                } else {
                    let rec = postcard::to_allocvec(&StateRecord::Prepared { tid, segs })
                        .expect("encodes");
                    let r = log.append(STATE_RECORD_TAG, &rec);
                    if let Ok(lsn) = &r {
                        self.0.prepared.lock().insert(tid, *lsn);
                    }
                    Some(r)
                }
            };
            match appended {
                None => {
                    self.0.release_all(tid, false);
                    Vote::ReadOnly
                }
                Some(Ok(_)) => Vote::Yes { durable: true },
                Some(Err(e)) => {
                    self.0.release_all(tid, false);
                    Vote::No(format!("state: cannot log the prepare record: {e}"))
                }
            }
        })
    }

    fn commit(&self, tid: Tid) -> BoxFuture<'_, ()> {
        Box::pin(async move { self.0.commit_notified(tid).await })
    }

    fn abort(&self, tid: Tid) -> BoxFuture<'_, ()> {
        Box::pin(async move { self.0.release_all(tid, false) })
    }

    fn held(&self) -> Vec<(Tid, String)> {
        self.0
            .prepared
            .lock()
            .keys()
            .map(|t| (*t, "prepared state diffs".to_string()))
            .collect()
    }

    fn sub_ended(&self, tid: Tid, path: &SubPath, committed: bool) {
        if !committed {
            for e in self.0.segs.lock().values_mut() {
                e.core.sub_aborted(tid, path);
            }
            let mut ab = self.0.aborted.lock();
            let v = ab.entry(tid).or_default();
            if v.len() < 1024 {
                v.push(path.clone());
            }
        }
    }
}

fn plugin_failure(e: impl std::fmt::Display) -> Failure {
    Failure::new(Status::Internal, format!("state: {e}"))
}

impl Plugin for StateHome {
    fn name(&self) -> &str {
        SERVICE
    }

    fn attach(&self, tm: &TxManager, log: &Log) -> Result<(), Failure> {
        let dir = self.0.cfg.dir.clone().unwrap_or_else(|| {
            log.dir()
                .parent()
                .map(|p| p.join("state"))
                .unwrap_or_else(|| log.dir().join("state"))
        });
        let _ = self.0.dir.set(dir);
        let _ = self.0.log.set(log.clone());
        let _ = self.0.node.set(tm.node_id().0.to_string());
        tm.register_resource(Arc::new(HomeResource(Arc::clone(&self.0))));
        Ok(())
    }

    fn recover(&self, tm: &TxManager, records: &[LogRecord]) -> Result<(), Failure> {
        let inner = &self.0;
        // 1. Checkpoint images.
        if let Some(dir) = inner.checkpoint_dir() {
            if let Ok(rd) = std::fs::read_dir(dir) {
                for ent in rd.flatten() {
                    let p = ent.path();
                    if p.extension().and_then(|e| e.to_str()) != Some("seg") {
                        continue;
                    }
                    let bytes = std::fs::read(&p).map_err(plugin_failure)?;
                    let (_, body) = codec::unframe(&bytes).map_err(plugin_failure)?;
                    let f: CheckpointFile = postcard::from_bytes(body).map_err(plugin_failure)?;
                    let img = codec::decode_image(&f.image, usize::MAX).map_err(plugin_failure)?;
                    let seg = Segment::from_image(img, inner.cfg.limits).map_err(plugin_failure)?;
                    inner.segs.lock().insert(
                        f.path,
                        Entry::new(f.secret, HomeSegment::new(seg, inner.cfg.home)),
                    );
                }
            }
        }
        // 2. The log: creations, then committed diffs in log order.
        let (mut redone, mut in_doubt) = (0, 0);
        for r in records.iter().filter(|r| r.tag == STATE_RECORD_TAG) {
            let rec: StateRecord = postcard::from_bytes(&r.payload)
                .map_err(|e| plugin_failure(format!("undecodable record at {}: {e}", r.lsn)))?;
            match rec {
                StateRecord::Created { path, secret } => {
                    let url = inner.url(&path)?;
                    inner.segs.lock().entry(path).or_insert_with(|| {
                        Entry::new(
                            secret,
                            HomeSegment::new(Segment::new(url, inner.cfg.limits), inner.cfg.home),
                        )
                    });
                }
                StateRecord::Prepared { tid, segs } => {
                    let outcome = tm.recovered(tid);
                    if !matches!(
                        outcome,
                        Some(Recovered::Committed) | Some(Recovered::InDoubt)
                    ) {
                        continue;
                    }
                    let mut all = inner.segs.lock();
                    for (path, diffs) in segs {
                        let e = all.get_mut(&path).ok_or_else(|| {
                            plugin_failure(format!("diffs for unknown segment {path}"))
                        })?;
                        let diffs = diffs
                            .iter()
                            .map(|b| codec::decode_diff(b, usize::MAX))
                            .collect::<Result<Vec<_>, _>>()
                            .map_err(plugin_failure)?;
                        if outcome == Some(Recovered::Committed) {
                            for d in &diffs {
                                e.core.redo(d).map_err(plugin_failure)?;
                            }
                        } else {
                            e.core
                                .restore_in_doubt(tid, diffs)
                                .map_err(plugin_failure)?;
                        }
                    }
                    if outcome == Some(Recovered::Committed) {
                        redone += 1;
                    } else {
                        in_doubt += 1;
                        inner.prepared.lock().insert(tid, r.lsn);
                    }
                }
            }
        }
        tracing::info!(
            segments = inner.segs.lock().len(),
            redone,
            in_doubt,
            "state recovered"
        );
        Ok(())
    }

    fn serve(&self, rpc: &Rpc) -> Result<(), Failure> {
        let _ = self.0.rpc.set(rpc.clone());
        let inner = Arc::clone(&self.0);
        let res: Arc<dyn Resource> = Arc::new(HomeResource(Arc::clone(&self.0)));
        rpc.register(
            SERVICE,
            ServiceOptions::with_participant(res),
            move |ctx, req: HomeRequest| {
                let inner = Arc::clone(&inner);
                async move { inner.handle(ctx, req).await }
            },
        )
    }

    fn checkpoint(&self, log: &Log) -> Result<Option<Lsn>, Failure> {
        let dir = self
            .0
            .checkpoint_dir()
            .cloned()
            .ok_or_else(|| plugin_failure("not attached"))?;
        self.0.write_checkpoint(&dir, log).map_err(plugin_failure)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refresh(r: WireRefresh, tentative: Option<Bytes>) -> HomeReply {
        HomeReply::Refresh {
            version: 300,
            refresh: r,
            tentative,
            tx_version: 301,
            tag: u64::MAX,
            lease_ms: 1000,
        }
    }

    /// The borrowed decoder reads exactly what the owned one does, and
    /// leaves a refresh's bytes in the buffer they came in.
    #[test]
    fn replies_decode_from_payload_like_postcard_without_copying_the_refresh() {
        let info = SegmentInfo {
            url: "weft://1/a".into(),
            version: 7,
            blocks: 2,
            units: 9,
            holders: 1,
        };
        let diff = Bytes::from(vec![7u8; 1000]);
        let cases = [
            HomeReply::Opened { version: 5 },
            HomeReply::Submitted { version: 6 },
            HomeReply::List(vec![info.clone(), info]),
            refresh(WireRefresh::Current, None),
            refresh(
                WireRefresh::Diff(diff.clone()),
                Some(Bytes::from_static(b"t")),
            ),
            refresh(WireRefresh::Image(diff), Some(Bytes::new())),
        ];
        for reply in cases {
            let wire = Bytes::from(postcard::to_allocvec(&reply).expect("encode"));
            let owned: HomeReply = postcard::from_bytes(&wire).expect("decode");
            let got = HomeReply::from_payload(Payload::Bytes(wire.clone())).expect("decode");
            assert_eq!(format!("{got:?}"), format!("{owned:?}"));
            if let HomeReply::Refresh {
                refresh: WireRefresh::Diff(d) | WireRefresh::Image(d),
                ..
            } = &got
            {
                let inside = wire.as_ptr_range();
                assert!(inside.contains(&d.as_ptr()), "the refresh was copied");
            }
            // A truncated or padded reply is refused, as postcard refuses it.
            let short = wire.slice(..wire.len() - 1);
            assert!(HomeReply::from_payload(Payload::Bytes(short)).is_err());
            let mut long = wire.to_vec();
            long.push(0);
            assert!(HomeReply::from_payload(Payload::Bytes(long.into())).is_err());
        }
        // A local reply (same process) is taken as it is.
        let got = HomeReply::from_payload(Payload::local(HomeReply::Opened { version: 9 }));
        assert!(matches!(got, Ok(HomeReply::Opened { version: 9 })));
    }
}
