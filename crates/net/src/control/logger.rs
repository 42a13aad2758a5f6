//! The logger's side of the control stream, shared by the 2CA proxy
//! ([`crate::tca::proxy`]) and the TLA logger ([`crate::tla::logger`]): the
//! parts that do not depend on how the connection's bytes reach the logger.
//!
//! Owns: waiting at TX_START for the previous transaction's outcome
//! ([`when_free`]); the prepare vote, which waits for the transaction's last
//! server byte and logs its held output ([`prepare`], [`prepare_check`]);
//! the record that committed output was released ([`log_released`]); and
//! recovery's list of output that a previous run prepared and never
//! released ([`undeliverable`]); and the crash tests' hook that holds a
//! transaction at a point of its commit ([`PauseHook`]). Must never vote yes before the
//! transaction's every server byte reached the logger and its output was
//! appended to the log (the transaction manager's forced prepare record
//! then covers it).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::future::BoxFuture;

use tokio::sync::Notify;
use weft_log::{Log, LogRecord};
use weft_rpc::CallContext;
use weft_tx::{Recovered, TxManager, Vote};
use weft_wire::{Failure, Status, Tid};

use super::{ConnName, NetRecord, NET_RECORD_TAG};
use crate::core::{ConnState, LoggerCore};

/// Output a previous run of the logger prepared and never released: its
/// peer connection (2CA) or its connection's mapping (TLA) ended with that
/// run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Undeliverable {
    /// The transaction.
    pub tid: Tid,
    /// Its connection.
    pub conn: ConnName,
    /// Bytes it held.
    pub bytes: usize,
    /// True when recovery knows it committed; false when in doubt (its
    /// outcome arrives later).
    pub committed: bool,
}

/// Where a [`PauseHook`] may hold a transaction at the logger.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PausePoint {
    /// Prepare (or a one-phase prepare) arrived; the logger has not voted,
    /// so nothing of the transaction is forced yet.
    BeforeVote,
    /// The decision is commit (durable here or at the coordinator); the
    /// held output is not released and, at a logger that decided, the
    /// decision has not been sent to the server (it leaves after the
    /// release).
    BeforeRelease,
}

impl PausePoint {
    /// The name used on command lines (`before-vote`, `before-release`).
    pub fn name(self) -> &'static str {
        match self {
            PausePoint::BeforeVote => "before-vote",
            PausePoint::BeforeRelease => "before-release",
        }
    }
}

impl std::str::FromStr for PausePoint {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        [PausePoint::BeforeVote, PausePoint::BeforeRelease]
            .into_iter()
            .find(|p| p.name() == s)
            .ok_or_else(|| format!("unknown pause point {s:?}"))
    }
}

/// A test hook: awaited by the logger at each [`PausePoint`] of every
/// transaction; the future it returns holds the transaction there until it
/// completes (crash tests kill a process meanwhile). Unlike a crash point
/// of the transaction manager, the transaction goes on afterwards.
#[derive(Clone)]
pub struct PauseHook(pub Arc<dyn Fn(PausePoint, Tid) -> BoxFuture<'static, ()> + Send + Sync>);

impl std::fmt::Debug for PauseHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PauseHook")
    }
}

/// Awaits `hook` (if any) at `point` of `tid`.
pub(crate) async fn pause(hook: Option<&PauseHook>, point: PausePoint, tid: Tid) {
    if let Some(h) = hook {
        (h.0)(point, tid).await;
    }
}

/// The transaction a control call runs in.
///
/// Fails with BadRequest outside a transaction.
pub(crate) fn need_tx(ctx: &CallContext, who: &str) -> Result<Tid, Failure> {
    ctx.tid().ok_or_else(|| {
        Failure::new(
            Status::BadRequest,
            format!("{who}: this control message must be sent within a transaction"),
        )
    })
}

/// Tries `attempt` until it stops answering busy (`Ok(None)`: the previous
/// transaction on `conn` is undecided), waking on `progress`.
///
/// Fails with what `attempt` fails with, and Unavailable after `wait`.
pub(crate) async fn when_free<T>(
    who: &str,
    conn: &str,
    wait: Duration,
    progress: &Notify,
    mut attempt: impl FnMut() -> Result<Option<T>, Failure>,
) -> Result<T, Failure> {
    let give_up = Instant::now() + wait;
    loop {
        let notified = progress.notified();
        if let Some(t) = attempt()? {
            return Ok(t);
        }
        if tokio::time::timeout_at(give_up.into(), notified)
            .await
            .is_err()
        {
            return Err(Failure::new(
                Status::Unavailable,
                format!(
                    "{who}: the previous transaction on {conn} is still undecided after {wait:?}"
                ),
            ));
        }
    }
}

/// What prepare makes of a connection's state now.
pub(crate) enum Check {
    /// Not all of the transaction's server bytes arrived yet.
    Wait,
    /// The vote (no).
    Vote(Vote),
    /// Ready: log this record and vote yes.
    Ready(NetRecord),
}

/// Prepare's look at `core` (the connection `conn`) for `tid`; `server_gone`
/// when the server's side of the connection ended.
pub(crate) fn prepare_check(
    who: &str,
    core: &LoggerCore,
    server_gone: bool,
    tid: Tid,
    conn: &str,
) -> Check {
    if core.tx() != Some(tid) {
        return Check::Vote(Vote::No(format!("{who}: {tid} no longer runs on {conn}")));
    }
    if core.is_doomed() {
        return Check::Vote(Vote::No(format!(
            "{who}: {tid} wrote more than {} bytes on {conn}",
            core.config().max_hold
        )));
    }
    if core.state() != ConnState::Commit {
        return Check::Vote(Vote::No(format!(
            "{who}: the server did not end {tid}'s bytes on {conn}"
        )));
    }
    if core.is_complete() {
        let mut bytes = Vec::with_capacity(core.stats().held_bytes as usize);
        for b in core.held() {
            bytes.extend_from_slice(b);
        }
        return Check::Ready(NetRecord::Prepared {
            tid,
            conn: conn.to_string(),
            bytes,
        });
    }
    if server_gone {
        return Check::Vote(Vote::No(format!(
            "{who}: the server closed {conn} before {tid}'s last byte"
        )));
    }
    Check::Wait
}

/// Phase one at a logger: waits (at most `wait`, waking on `progress`)
/// until `check` is not [`Check::Wait`]; appends a ready transaction's held
/// output to `log` and votes yes.
pub(crate) async fn prepare(
    who: &str,
    tid: Tid,
    log: &Log,
    wait: Duration,
    progress: &Notify,
    mut check: impl FnMut() -> Check,
) -> Vote {
    let give_up = Instant::now() + wait;
    loop {
        let notified = progress.notified();
        match check() {
            Check::Vote(v) => return v,
            Check::Ready(rec) => {
                let payload = match postcard::to_allocvec(&rec) {
                    Ok(p) => p,
                    Err(e) => return Vote::No(format!("{who}: {e}")),
                };
                // Made durable by the transaction manager's forced prepare
                // record, which follows it.
                return match log.append(NET_RECORD_TAG, &payload) {
                    Ok(_) => Vote::Yes { durable: true },
                    Err(e) => Vote::No(format!("{who}: cannot log the held output: {e}")),
                };
            }
            Check::Wait => {}
        }
        if tokio::time::timeout_at(give_up.into(), notified)
            .await
            .is_err()
        {
            return Vote::No(format!(
                "{who}: {tid}'s last server bytes did not arrive within {wait:?}"
            ));
        }
    }
}

/// How long a released record may wait for another record's force before
/// the log is asked to sync it on its own.
const RELEASED_SYNC_AFTER: Duration = Duration::from_millis(200);

/// Records that `tid`'s output was handed on to the peer. Not forced on
/// the commit path (recovery only uses it to leave the output out of
/// [`undeliverable`]): the next transaction's forced record usually covers
/// it; when none came within [`RELEASED_SYNC_AFTER`], the log syncs it on
/// its own (within its lazy flush interval), so a busy connection costs no
/// extra sync and an idle one's last release is durable after about
/// 200 ms. A logger killed before then reports the output as undeliverable
/// although it left.
pub(crate) fn log_released(log: Option<&Log>, tid: Tid) {
    if let Some(log) = log {
        if let Ok(p) = postcard::to_allocvec(&NetRecord::Released { tid }) {
            if let Ok(lsn) = log.append(NET_RECORD_TAG, &p) {
                let log = log.clone();
                tokio::spawn(async move {
                    tokio::time::sleep(RELEASED_SYNC_AFTER).await;
                    let _ = log.when_durable(lsn).await;
                });
            }
        }
    }
}

/// Recovery: the output a previous run prepared and did not release, of
/// transactions that committed or are in doubt.
///
/// Fails with Internal on an undecodable record.
pub(crate) fn undeliverable(
    who: &str,
    tm: &TxManager,
    records: &[LogRecord],
) -> Result<Vec<Undeliverable>, Failure> {
    let mut prepared: HashMap<Tid, (ConnName, usize)> = HashMap::new();
    for r in records.iter().filter(|r| r.tag == NET_RECORD_TAG) {
        let rec: NetRecord = postcard::from_bytes(&r.payload).map_err(|e| {
            Failure::new(
                Status::Internal,
                format!("{who}: undecodable record at {}: {e}", r.lsn),
            )
        })?;
        match rec {
            NetRecord::Prepared { tid, conn, bytes } => {
                prepared.insert(tid, (conn, bytes.len()));
            }
            NetRecord::Released { tid } => {
                prepared.remove(&tid);
            }
        }
    }
    let mut out = Vec::new();
    for (tid, (conn, bytes)) in prepared {
        let committed = match tm.recovered(tid) {
            Some(Recovered::Committed) => true,
            Some(Recovered::InDoubt) => false,
            _ => continue,
        };
        tracing::warn!(%tid, %conn, bytes, committed, "{who}: output of a transaction lost with its connection (the logger died before releasing it)");
        out.push(Undeliverable {
            tid,
            conn,
            bytes,
            committed,
        });
    }
    Ok(out)
}
