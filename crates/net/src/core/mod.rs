//! The logger core: one TCP connection's transactional state (the paper's
//! Fig. 1, PRE_TRANS → IN_TRANS → COMMIT), as a pure state machine.
//!
//! Owns, per connection: the log of peer→server bytes (for replay to a
//! restarted transaction, and the bytes that arrived before a TX_START), the
//! server→peer bytes a transaction holds until its commit, the positions
//! (byte offsets) that tie control events to the two byte streams, aging out
//! of unclaimed bytes, and the bounds on all of it. Must never do I/O, read a
//! clock (time comes in with each event) or release a byte of a transaction
//! that has not committed; never hold more than its configured limits.
//!
//! Positions: peer→server bytes are numbered from 0 as the peer sent them
//! (`in` positions); server→peer bytes are numbered from 0 as the server wrote
//! them (`out` positions, bytes of aborted transactions included). A control
//! event names positions so that it cannot race the bytes: a TX_START says
//! where the transaction's input and output begin, its end says where they
//! end (the paper's sequence-number offsets in TX_START and TX_COMMIT).
//!
//! The shells drive it: [`crate::sma`] (the stream inside the server
//! process) and [`crate::tca`] (the 2CA proxy logger).

#[cfg(test)]
mod tests;

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use weft_wire::{Failure, Status, Tid};

/// Bounds and aging of one connection's logger.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LoggerConfig {
    /// Most server→peer bytes one transaction may hold until its commit; a
    /// write past it fails with NoBuffer (nothing of it is held or sent).
    /// Also the most peer→server bytes one transaction may read (they are
    /// kept for replay).
    pub max_hold: usize,
    /// Most peer→server bytes kept while no transaction claims them (bytes
    /// the server was handed outside a transaction, or by an aborted one that
    /// has not restarted); the oldest are aged out past it.
    pub max_unclaimed: usize,
    /// How long unclaimed bytes are kept before they age out.
    pub unclaimed_ttl: Duration,
    /// Most peer→server bytes received and not yet handed to the server
    /// (the receive window the shell keeps; it stops reading the peer when
    /// full).
    pub max_rx: usize,
}

impl Default for LoggerConfig {
    fn default() -> Self {
        LoggerConfig {
            max_hold: 4 << 20,
            max_unclaimed: 1 << 20,
            unclaimed_ttl: Duration::from_secs(30),
            max_rx: 1 << 20,
        }
    }
}

/// The connection's state at the logger (Fig. 1).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum ConnState {
    /// No transaction runs; peer bytes are logged for the next one.
    PreTrans,
    /// A transaction runs: its output is held, its input kept.
    InTrans,
    /// The transaction's end is known; it waits for its last bytes and the
    /// decision.
    Commit,
}

impl std::fmt::Display for ConnState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ConnState::PreTrans => "PRE_TRANS",
            ConnState::InTrans => "IN_TRANS",
            ConnState::Commit => "COMMIT",
        })
    }
}

/// What happens to a connection.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    /// Bytes from the peer arrived (at the next `in` position).
    PeerData(Bytes),
    /// The server side takes up to `max` peer bytes from the current read
    /// position (SMA: a read; 2CA: forwarding to the server).
    ServerRead {
        /// Most bytes to hand over.
        max: usize,
    },
    /// The server wrote bytes (at the next `out` position).
    ServerData {
        /// The bytes.
        data: Bytes,
        /// True when the write can still be refused (SMA: nothing is held or
        /// sent and the write fails with NoBuffer); false when the bytes
        /// already left the server (2CA: past the limit they are dropped and
        /// the transaction is doomed to vote no).
        refusable: bool,
    },
    /// TX_START: `tx` begins; its input starts at `in_from` (what the server
    /// had consumed), its output at `out_from` (what it had written).
    Start {
        /// The transaction.
        tx: Tid,
        /// First peer byte of the transaction.
        in_from: u64,
        /// First server byte of the transaction.
        out_from: u64,
    },
    /// TX_RESTART: `tx` re-executes the last aborted transaction: the server
    /// is handed that transaction's input again from its first byte.
    Restart {
        /// The new attempt.
        tx: Tid,
        /// First server byte of the new attempt.
        out_from: u64,
    },
    /// The server ends `tx`'s work on this connection: its input ends at
    /// `in_end`, its output at `out_end` (IN_TRANS → COMMIT).
    End {
        /// The transaction.
        tx: Tid,
        /// End of the input it consumed.
        in_end: u64,
        /// End of the output it wrote.
        out_end: u64,
    },
    /// TX_COMMIT decided: release the held output, purge the input.
    Commit {
        /// The transaction.
        tx: Tid,
    },
    /// TX_ABORT decided: drop the held output, keep the input for a restart.
    Abort {
        /// The transaction.
        tx: Tid,
    },
    /// Outside a transaction after an abort whose output end was not known:
    /// the server's next byte is at `out_from` (earlier ones were the aborted
    /// transaction's tail).
    Sync {
        /// The server's write position.
        out_from: u64,
    },
    /// Time passed (aging).
    Tick,
}

/// What the shell must do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Send these bytes to the peer, in order.
    ToPeer(Bytes),
    /// Hand these peer bytes (starting at `in` position `pos`) to the server.
    ToServer {
        /// Position of the first byte.
        pos: u64,
        /// The bytes.
        data: Bytes,
    },
}

/// Why an event was refused (the connection's state is unchanged).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CoreError {
    /// A limit would be passed.
    #[error("no buffer: {0}")]
    NoBuffer(String),
    /// The event does not fit the connection's state.
    #[error("{event} in state {state}")]
    WrongState {
        /// The event.
        event: &'static str,
        /// The state.
        state: ConnState,
    },
    /// The event names another transaction than the connection's.
    #[error("{got} is not the connection's transaction ({running:?})")]
    WrongTx {
        /// Named.
        got: Tid,
        /// Running.
        running: Option<Tid>,
    },
    /// A position outside what the logger saw.
    #[error("bad offset: {0}")]
    BadOffset(String),
    /// The bytes a transaction needs were aged out.
    #[error("aged out: {0}")]
    AgedOut(String),
    /// The transaction's output did not all arrive yet (2CA: wait).
    #[error("{0}: output still arriving")]
    Incomplete(Tid),
    /// The previous transaction is still undecided (wait for its outcome).
    #[error("{0} is still undecided on this connection")]
    Busy(Tid),
    /// The server's output after an abort could not be kept until it was
    /// resynchronised: the connection can no longer be used.
    #[error("connection desynchronised: {0}")]
    Broken(String),
}

impl CoreError {
    /// The weft status of this error.
    pub fn status(&self) -> Status {
        match self {
            CoreError::NoBuffer(_) => Status::NoBuffer,
            CoreError::WrongState { .. } | CoreError::WrongTx { .. } => Status::Mismatch,
            CoreError::BadOffset(_) => Status::BadRequest,
            CoreError::AgedOut(_) => Status::Aborted,
            CoreError::Incomplete(_) | CoreError::Busy(_) => Status::Unavailable,
            CoreError::Broken(_) => Status::ProtocolError,
        }
    }
}

impl From<CoreError> for Failure {
    fn from(e: CoreError) -> Failure {
        Failure::new(e.status(), format!("net: {e}"))
    }
}

/// Counters and sizes of one connection (for `weft net ls`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConnStats {
    /// Server→peer bytes held for the running transaction.
    pub held_bytes: u64,
    /// Peer→server bytes kept (log and receive window).
    pub logged_bytes: u64,
    /// Transactions committed.
    pub committed: u64,
    /// Transactions aborted.
    pub aborted: u64,
    /// Restarts (replays).
    pub restarted: u64,
    /// Bytes released to the peer.
    pub released_bytes: u64,
    /// Server bytes dropped (aborted transactions).
    pub dropped_bytes: u64,
    /// Peer bytes aged out unclaimed.
    pub aged_out_bytes: u64,
}

/// Most aborted transactions whose output may still be in flight at once.
const MAX_DISCARD_RANGES: usize = 64;

const DEST_DISCARD: usize = 0;
const DEST_PEER: usize = 1;
const DEST_HOLD: usize = 2;
const DEST_AFTER: usize = 3;
const DEST_LIMBO: usize = 4;

#[derive(Clone, Debug)]
struct Chunk {
    pos: u64,
    data: Bytes,
    at: Instant,
}

impl Chunk {
    fn end(&self) -> u64 {
        self.pos + self.data.len() as u64
    }
}

/// A byte queue with a length.
#[derive(Clone, Debug, Default)]
struct Queue {
    parts: VecDeque<Bytes>,
    len: usize,
}

impl Queue {
    fn push(&mut self, b: Bytes) {
        if !b.is_empty() {
            self.len += b.len();
            self.parts.push_back(b);
        }
    }
    fn take(&mut self) -> Vec<Bytes> {
        self.len = 0;
        self.parts.drain(..).collect()
    }
    /// Splits off everything after the first `keep` bytes.
    fn split_off(&mut self, keep: usize) -> Queue {
        let mut rest = Queue::default();
        let mut seen = 0;
        let mut i = 0;
        while i < self.parts.len() {
            let n = self.parts[i].len();
            if seen + n <= keep {
                seen += n;
                i += 1;
                continue;
            }
            let cut = keep - seen;
            let tail = self.parts[i].slice(cut..);
            self.parts[i].truncate(cut);
            rest.push(tail);
            for b in self.parts.drain(i + 1..) {
                rest.push(b);
            }
            if self.parts[i].is_empty() {
                self.parts.remove(i);
            }
            break;
        }
        self.len -= rest.len;
        rest
    }
}

/// One connection's logger (see the module comment).
#[derive(Clone, Debug)]
pub struct LoggerCore {
    cfg: LoggerConfig,
    state: ConnState,
    tx: Option<Tid>,
    // Peer→server.
    log: VecDeque<Chunk>,
    in_base: u64,
    in_recv: u64,
    in_fwd: u64,
    in_tx_from: u64,
    in_tx_end: Option<u64>,
    replay_from: Option<u64>,
    // Server→peer.
    out_recv: u64,
    out_tx_from: u64,
    out_tx_end: Option<u64>,
    held: Queue,
    after: Queue,
    /// After an abort whose output end is unknown: where the aborted
    /// transaction's unreceived output begins, and the bytes from there.
    limbo: Option<(u64, Queue)>,
    /// Ranges of server positions that belong to aborted transactions.
    discard: VecDeque<(u64, u64)>,
    doomed: bool,
    broken: Option<String>,
    stats: ConnStats,
}

impl LoggerCore {
    /// A new connection, in PRE_TRANS.
    pub fn new(cfg: LoggerConfig) -> Self {
        LoggerCore {
            cfg,
            state: ConnState::PreTrans,
            tx: None,
            log: VecDeque::new(),
            in_base: 0,
            in_recv: 0,
            in_fwd: 0,
            in_tx_from: 0,
            in_tx_end: None,
            replay_from: None,
            out_recv: 0,
            out_tx_from: 0,
            out_tx_end: None,
            held: Queue::default(),
            after: Queue::default(),
            limbo: None,
            discard: VecDeque::new(),
            doomed: false,
            broken: None,
            stats: ConnStats::default(),
        }
    }

    /// The configuration.
    pub fn config(&self) -> &LoggerConfig {
        &self.cfg
    }

    /// The state.
    pub fn state(&self) -> ConnState {
        self.state
    }

    /// The running transaction.
    pub fn tx(&self) -> Option<Tid> {
        self.tx
    }

    /// Room in the receive window: how many peer bytes the shell may read
    /// from the peer now.
    pub fn peer_room(&self) -> usize {
        self.cfg
            .max_rx
            .saturating_sub((self.in_recv - self.in_fwd) as usize)
    }

    /// Peer bytes received and not yet handed to the server.
    pub fn unread(&self) -> usize {
        (self.in_recv - self.in_fwd) as usize
    }

    /// Position of the next peer byte the server is handed.
    pub fn in_read_pos(&self) -> u64 {
        self.in_fwd
    }

    /// Position of the next server byte.
    pub fn out_pos(&self) -> u64 {
        self.out_recv
    }

    /// True when the transaction's end is known and all its output arrived.
    pub fn is_complete(&self) -> bool {
        self.state == ConnState::Commit && self.out_tx_end.is_some_and(|e| self.out_recv >= e)
    }

    /// True when the running transaction lost output past its limit and
    /// must abort (2CA).
    pub fn is_doomed(&self) -> bool {
        self.doomed
    }

    /// The held output of the running transaction (2CA logs it at prepare).
    pub fn held(&self) -> impl Iterator<Item = &Bytes> {
        self.held.parts.iter()
    }

    /// Counters and sizes.
    pub fn stats(&self) -> ConnStats {
        let mut s = self.stats.clone();
        s.held_bytes = self.held.len as u64;
        s.logged_bytes = self.in_recv - self.in_base;
        s
    }

    /// Applies `event` at time `now`.
    ///
    /// Fails (leaving the state unchanged, except for aging) with the
    /// [`CoreError`] that says why: NoBuffer past a limit, WrongState /
    /// WrongTx for an event that does not fit, BadOffset for positions the
    /// logger never saw, AgedOut when a restart's bytes are gone, Incomplete
    /// for a commit whose output is still arriving, Busy for a start while
    /// the previous transaction is undecided, Broken once desynchronised.
    pub fn step(&mut self, now: Instant, event: Event) -> Result<Vec<Action>, CoreError> {
        if let Some(why) = &self.broken {
            return Err(CoreError::Broken(why.clone()));
        }
        let mut out = Vec::new();
        match event {
            Event::PeerData(data) => self.on_peer_data(now, data)?,
            Event::ServerRead { max } => self.on_server_read(max, &mut out)?,
            Event::ServerData { data, refusable } => {
                self.on_server_data(data, refusable, &mut out)?
            }
            Event::Start {
                tx,
                in_from,
                out_from,
            } => self.on_start(tx, in_from, out_from)?,
            Event::Restart { tx, out_from } => {
                let Some(from) = self.replay_from else {
                    return Err(CoreError::WrongState {
                        event: "TX_RESTART without an aborted transaction",
                        state: self.state,
                    });
                };
                if from < self.in_base {
                    return Err(CoreError::AgedOut(format!(
                        "the aborted transaction's input from {from} was aged out (log starts at {})",
                        self.in_base
                    )));
                }
                self.check_start(tx, out_from)?;
                self.in_fwd = from;
                self.stats.restarted += 1;
                self.on_start(tx, from, out_from)?;
            }
            Event::End {
                tx,
                in_end,
                out_end,
            } => self.on_end(tx, in_end, out_end)?,
            Event::Commit { tx } => self.on_commit(tx, &mut out)?,
            Event::Abort { tx } => self.on_abort(tx, &mut out),
            Event::Sync { out_from } => self.on_sync(out_from, &mut out)?,
            Event::Tick => {}
        }
        self.age(now);
        self.check_invariants();
        Ok(out)
    }

    fn check_invariants(&self) {
        debug_assert!(self.in_base <= self.in_fwd && self.in_fwd <= self.in_recv);
        debug_assert_eq!(
            self.log.iter().map(|c| c.data.len() as u64).sum::<u64>(),
            self.in_recv - self.in_base
        );
        debug_assert!(self.held.len <= self.cfg.max_hold);
        debug_assert!(self.after.len <= self.cfg.max_hold);
        debug_assert!(self.unread() <= self.cfg.max_rx + self.cfg.max_hold);
    }

    fn on_peer_data(&mut self, now: Instant, data: Bytes) -> Result<(), CoreError> {
        if data.len() > self.peer_room() {
            return Err(CoreError::NoBuffer(format!(
                "{} peer bytes with room for {} (receive window {})",
                data.len(),
                self.peer_room(),
                self.cfg.max_rx
            )));
        }
        if data.is_empty() {
            return Ok(());
        }
        let pos = self.in_recv;
        self.in_recv += data.len() as u64;
        self.log.push_back(Chunk { pos, data, at: now });
        Ok(())
    }

    fn on_server_read(&mut self, max: usize, out: &mut Vec<Action>) -> Result<(), CoreError> {
        let mut max = max.min(self.unread());
        if self.state != ConnState::PreTrans {
            // The transaction's input is kept for replay: bounded.
            let claimed = (self.in_fwd - self.in_tx_from) as usize;
            let room = self.cfg.max_hold.saturating_sub(claimed);
            if room == 0 && max > 0 {
                return Err(CoreError::NoBuffer(format!(
                    "the transaction already read {claimed} bytes (at most {})",
                    self.cfg.max_hold
                )));
            }
            max = max.min(room);
        }
        while max > 0 {
            let i = self.log.partition_point(|c| c.end() <= self.in_fwd);
            let c = &self.log[i];
            let off = (self.in_fwd - c.pos) as usize;
            let n = (c.data.len() - off).min(max);
            out.push(Action::ToServer {
                pos: self.in_fwd,
                data: c.data.slice(off..off + n),
            });
            self.in_fwd += n as u64;
            max -= n;
        }
        Ok(())
    }

    fn on_server_data(
        &mut self,
        data: Bytes,
        refusable: bool,
        out: &mut Vec<Action>,
    ) -> Result<(), CoreError> {
        let start = self.out_recv;
        let len = data.len() as u64;
        let plan = self.plan_out(start, len);
        if self.held.len + plan[DEST_HOLD] > self.cfg.max_hold
            || self.after.len + plan[DEST_AFTER] > self.cfg.max_hold
        {
            if refusable {
                return Err(CoreError::NoBuffer(format!(
                    "a {len}-byte write would hold {} bytes (at most {})",
                    self.held.len + plan[DEST_HOLD] + self.after.len + plan[DEST_AFTER],
                    self.cfg.max_hold
                )));
            }
            // Already sent by the server: drop it; the transaction must abort.
            self.out_recv += len;
            self.doomed = true;
            self.stats.dropped_bytes += len;
            return Ok(());
        }
        if let Some((_, limbo)) = &self.limbo {
            if limbo.len + plan[DEST_LIMBO] > self.cfg.max_hold {
                let why = format!(
                    "{} bytes written after an abort before the server said where they start",
                    limbo.len + plan[DEST_LIMBO]
                );
                self.broken = Some(why.clone());
                return Err(CoreError::Broken(why));
            }
        }
        self.out_recv += len;
        // Walk the chunk's ranges in order.
        let mut pos = start;
        let mut rest = data;
        while !rest.is_empty() {
            let (dest, n) = self.range_at(pos, rest.len());
            let part = rest.slice(..n);
            match dest {
                DEST_DISCARD => self.stats.dropped_bytes += n as u64,
                DEST_PEER => {
                    self.stats.released_bytes += n as u64;
                    out.push(Action::ToPeer(part));
                }
                DEST_HOLD => self.held.push(part),
                DEST_AFTER => self.after.push(part),
                _ => self.limbo.as_mut().expect("limbo").1.push(part),
            }
            rest = rest.slice(n..);
            pos += n as u64;
        }
        while self.discard.front().is_some_and(|r| r.1 <= self.out_recv) {
            self.discard.pop_front();
        }
        Ok(())
    }

    /// Where the server byte at `pos` goes, and for how many bytes (at most
    /// `len`) that holds.
    fn range_at(&self, pos: u64, len: usize) -> (usize, usize) {
        let mut len = len;
        let upto = |end: u64, len: usize| (end.saturating_sub(pos)).min(len as u64) as usize;
        if let Some(r) = self.discard.iter().find(|r| r.1 > pos) {
            if pos >= r.0 {
                return (DEST_DISCARD, upto(r.1, len));
            }
            len = upto(r.0, len);
        }
        if let Some((from, _)) = &self.limbo {
            if pos >= *from {
                return (DEST_LIMBO, len);
            }
            return (DEST_PEER, upto(*from, len));
        }
        let upto = |end: u64| upto(end, len);
        match self.state {
            ConnState::PreTrans => (DEST_PEER, len),
            _ if pos < self.out_tx_from => (DEST_PEER, upto(self.out_tx_from)),
            ConnState::InTrans => (DEST_HOLD, len),
            ConnState::Commit => {
                let end = self.out_tx_end.expect("COMMIT knows its end");
                if pos < end {
                    (DEST_HOLD, upto(end))
                } else {
                    (DEST_AFTER, len)
                }
            }
        }
    }

    /// How many of the `len` server bytes at `start` go to each destination.
    fn plan_out(&self, start: u64, len: u64) -> [usize; 5] {
        let mut plan = [0usize; 5];
        let (mut pos, mut left) = (start, len as usize);
        while left > 0 {
            let (dest, n) = self.range_at(pos, left);
            plan[dest] += n;
            pos += n as u64;
            left -= n;
        }
        plan
    }

    fn check_start(&self, tx: Tid, out_from: u64) -> Result<(), CoreError> {
        match self.state {
            ConnState::PreTrans => {}
            ConnState::Commit => return Err(CoreError::Busy(self.tx.expect("a COMMIT has a tx"))),
            ConnState::InTrans => {
                return Err(CoreError::WrongState {
                    event: "TX_START",
                    state: self.state,
                })
            }
        }
        let _ = tx;
        if self.limbo.is_none() && out_from < self.out_recv {
            return Err(CoreError::BadOffset(format!(
                "output starts at {out_from}, but {} server bytes already arrived",
                self.out_recv
            )));
        }
        if let Some(r) = self.discard.back().filter(|r| out_from < r.1) {
            return Err(CoreError::BadOffset(format!(
                "output starts at {out_from}, inside an aborted transaction's ({}..{})",
                r.0, r.1
            )));
        }
        Ok(())
    }

    fn on_start(&mut self, tx: Tid, in_from: u64, out_from: u64) -> Result<(), CoreError> {
        self.check_start(tx, out_from)?;
        // An `in_from` below the log's start is accepted: the transaction
        // runs, but cannot be restarted (TX_RESTART then fails with AgedOut).
        if in_from > self.in_fwd {
            return Err(CoreError::BadOffset(format!(
                "input starts at {in_from}, but the server was handed only {}",
                self.in_fwd
            )));
        }
        self.purge_input(in_from);
        if self.limbo.is_some() {
            // Bytes already past the new start are the new transaction's.
            for b in self.resolve_limbo(out_from) {
                self.held.push(b);
            }
        }
        self.replay_from = None;
        self.state = ConnState::InTrans;
        self.tx = Some(tx);
        self.in_tx_from = in_from;
        self.in_tx_end = None;
        self.out_tx_from = out_from;
        self.out_tx_end = None;
        self.doomed = false;
        Ok(())
    }

    /// Limbo bytes below `out_from` were the aborted transaction's tail;
    /// bytes still to come below it too. Those from `out_from` on are the
    /// server's new output (sent now; a start then holds what follows).
    fn resolve_limbo(&mut self, out_from: u64) -> Vec<Bytes> {
        let mut rest = Vec::new();
        let (limbo_from, limbo) = self.limbo.take().expect("limbo");
        let mut pos = limbo_from;
        for b in limbo.parts {
            let n = b.len() as u64;
            if pos + n <= out_from {
                self.stats.dropped_bytes += n;
            } else {
                let cut = out_from.saturating_sub(pos) as usize;
                self.stats.dropped_bytes += cut as u64;
                rest.push(b.slice(cut..));
            }
            pos += n;
        }
        if out_from > self.out_recv {
            self.push_discard(limbo_from.max(self.out_recv), out_from);
        }
        rest
    }

    fn push_discard(&mut self, from: u64, to: u64) {
        if from < to {
            self.discard.push_back((from, to));
            if self.discard.len() > MAX_DISCARD_RANGES {
                self.broken = Some(format!(
                    "more than {MAX_DISCARD_RANGES} aborted transactions' output still in flight"
                ));
            }
        }
    }

    fn purge_input(&mut self, upto: u64) {
        while let Some(c) = self.log.front_mut() {
            if c.end() <= upto {
                self.in_base = c.end();
                self.log.pop_front();
            } else {
                if c.pos < upto {
                    let cut = (upto - c.pos) as usize;
                    c.data = c.data.slice(cut..);
                    c.pos = upto;
                    self.in_base = upto;
                }
                break;
            }
        }
        if self.log.is_empty() {
            self.in_base = self.in_recv;
        }
    }

    fn on_end(&mut self, tx: Tid, in_end: u64, out_end: u64) -> Result<(), CoreError> {
        if self.state != ConnState::InTrans {
            return Err(CoreError::WrongState {
                event: "end of transaction",
                state: self.state,
            });
        }
        if self.tx != Some(tx) {
            return Err(CoreError::WrongTx {
                got: tx,
                running: self.tx,
            });
        }
        if in_end < self.in_tx_from || in_end > self.in_fwd {
            return Err(CoreError::BadOffset(format!(
                "input ends at {in_end}, outside [{}, {}]",
                self.in_tx_from, self.in_fwd
            )));
        }
        if out_end < self.out_tx_from {
            return Err(CoreError::BadOffset(format!(
                "output ends at {out_end}, before it starts ({})",
                self.out_tx_from
            )));
        }
        let excess = self.out_recv.saturating_sub(out_end.max(self.out_tx_from)) as usize;
        if excess > 0 {
            let keep = self.held.len.saturating_sub(excess);
            let rest = self.held.split_off(keep);
            for b in rest.parts {
                self.after.push(b);
            }
        }
        self.in_tx_end = Some(in_end);
        self.out_tx_end = Some(out_end);
        self.state = ConnState::Commit;
        Ok(())
    }

    fn on_commit(&mut self, tx: Tid, out: &mut Vec<Action>) -> Result<(), CoreError> {
        if self.tx != Some(tx) {
            return Err(CoreError::WrongTx {
                got: tx,
                running: self.tx,
            });
        }
        if self.state != ConnState::Commit {
            return Err(CoreError::WrongState {
                event: "TX_COMMIT before the transaction's end",
                state: self.state,
            });
        }
        if !self.is_complete() {
            return Err(CoreError::Incomplete(tx));
        }
        for b in self.held.take() {
            self.stats.released_bytes += b.len() as u64;
            out.push(Action::ToPeer(b));
        }
        for b in self.after.take() {
            self.stats.released_bytes += b.len() as u64;
            out.push(Action::ToPeer(b));
        }
        self.purge_input(self.in_tx_end.expect("COMMIT knows its end"));
        self.stats.committed += 1;
        self.finish();
        Ok(())
    }

    fn on_abort(&mut self, tx: Tid, out: &mut Vec<Action>) {
        if self.tx != Some(tx) {
            return; // an abort for a transaction this connection does not run
        }
        self.stats.dropped_bytes += self.held.len as u64;
        self.held.take();
        match self.out_tx_end {
            Some(end) => {
                // The output's end is known: what follows it is not the
                // aborted transaction's.
                self.push_discard(self.out_tx_from.max(self.out_recv), end);
                for b in self.after.take() {
                    self.stats.released_bytes += b.len() as u64;
                    out.push(Action::ToPeer(b));
                }
            }
            None => {
                // Bytes still arriving may be the aborted transaction's: keep
                // them aside until the server says where its output resumes.
                self.limbo = Some((self.out_tx_from.max(self.out_recv), Queue::default()));
            }
        }
        self.replay_from = Some(self.in_tx_from);
        self.stats.aborted += 1;
        self.finish();
    }

    fn on_sync(&mut self, out_from: u64, out: &mut Vec<Action>) -> Result<(), CoreError> {
        if self.state != ConnState::PreTrans {
            return Err(CoreError::WrongState {
                event: "output resynchronisation",
                state: self.state,
            });
        }
        if self.limbo.is_some() {
            for b in self.resolve_limbo(out_from) {
                self.stats.released_bytes += b.len() as u64;
                out.push(Action::ToPeer(b));
            }
        }
        Ok(())
    }

    fn finish(&mut self) {
        self.state = ConnState::PreTrans;
        self.tx = None;
        self.in_tx_end = None;
        self.out_tx_end = None;
        self.doomed = false;
    }

    /// Ages out unclaimed peer bytes: in PRE_TRANS, bytes the server was
    /// already handed, oldest first, past the size bound or the time bound.
    fn age(&mut self, now: Instant) {
        if self.state != ConnState::PreTrans {
            return;
        }
        loop {
            let unclaimed = (self.in_fwd - self.in_base) as usize;
            let Some(c) = self.log.front() else { break };
            if c.pos >= self.in_fwd {
                break;
            }
            let old = now.saturating_duration_since(c.at) >= self.cfg.unclaimed_ttl;
            let over = unclaimed > self.cfg.max_unclaimed;
            if !old && !over {
                break;
            }
            let cut_to = if old {
                c.end().min(self.in_fwd)
            } else {
                (self.in_base + (unclaimed - self.cfg.max_unclaimed) as u64).min(c.end())
            };
            self.stats.aged_out_bytes += cut_to - self.in_base;
            self.purge_input(cut_to);
        }
    }
}
