//! Measuring tools for the shm channel, and the helper process they (and the
//! two-process tests) run.
//!
//! Owns the helper's command language. Must never be needed by a node in
//! production: nothing here runs unless a benchmark or a test asks.
//!
//! ## How `weft bench rpc` uses it
//!
//! The helper process is the benchmark's own binary started again with
//! [`PEER_ARG`] as its first argument. The CLI's `main` must hand such an
//! invocation over before parsing its flags:
//!
//! ```ignore
//! let args: Vec<String> = std::env::args().collect();
//! if args.get(1).map(String::as_str) == Some(weft_transport::shm::bench::PEER_ARG) {
//!     std::process::exit(weft_transport::shm::bench::peer_main(args[2..].to_vec()));
//! }
//! ```
//!
//! Then [`raw_spin_pingpong`]`(&`[`PeerCommand::current_exe`]`()?, rounds)` gives
//! the physical floor, [`cpu_time`] / [`cpu_percent`] the idle cost, and
//! [`BusyPoll`](crate::BusyPoll) drives calls without kernel wake-ups.
//!
//! ## Helper modes (`peer_main` arguments)
//!
//! - `spin --fd N`: the far end of the raw ping-pong on inherited segment N.
//! - `node --id N [--join ADDR] [--secret S] [--no-shm] [--ring-bytes B]
//!   [--heartbeat-ms H] [--dead-ms D]`: a transport endpoint serving `echo`
//!   (answers with the request's payload) and `hang` (never answers). It
//!   prints `READY <node> <tcp addr> <pid> <rendezvous|->`, then obeys lines
//!   on stdin, answering each with one line:
//!   `call <node> <service> <count> <in-flight> <payload-bytes>` →
//!   `CALLS ok=<n> failed=<n> status=<first failure status or ->`;
//!   `route <node>` → `ROUTE <node> <inproc|shm|tcp|none>`;
//!   `wait-route <node> <kind> <ms>` → the same, once the route is that kind
//!   or the time is up; `wait-member <node> <ms>` → `MEMBER <node> yes|no`
//!   once the node is a known live member or the time is up; `quit` (or end
//!   of input) shuts down and exits 0.
//! - `hostile --connect PATH --attack A`: a hostile shm initiator (see
//!   [`Attack`]); prints `HOSTILE <outcome>` and waits for end of input.

use std::io::{self, BufRead, Write};
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use weft_wire::{Failure, Incarnation, NodeId, Payload, Request, Response, ServiceName, Status};

use super::mem::{self, Segment, PAGE};
use super::ring::{Layout, Producer};
use crate::channel::ChannelKind;
use crate::config::{ChannelSet, TransportConfig};
use crate::endpoint::{Endpoint, RequestHandler, Responder, Seed};
use crate::link::PeerRef;

/// First argument that turns a binary into the shm helper process.
pub const PEER_ARG: &str = "__weft-shm-peer";

/// How to start the helper process: a program and the arguments that come
/// before the mode (e.g. `[PEER_ARG]` when the program is the CLI itself).
#[derive(Clone, Debug)]
pub struct PeerCommand {
    /// The program.
    pub program: PathBuf,
    /// Arguments before the helper's mode.
    pub args: Vec<String>,
}

impl PeerCommand {
    /// This very binary, started with [`PEER_ARG`].
    ///
    /// Fails when the running executable cannot be found.
    pub fn current_exe() -> io::Result<PeerCommand> {
        Ok(PeerCommand {
            program: std::env::current_exe()?,
            args: vec![PEER_ARG.to_string()],
        })
    }

    /// A command for the helper in `mode` with `args`.
    pub fn command(&self, mode: &str, args: &[String]) -> Command {
        let mut c = Command::new(&self.program);
        c.args(&self.args).arg(mode).args(args);
        c
    }
}

/// Round trips measured by [`raw_spin_pingpong`].
#[derive(Clone, Debug)]
pub struct RoundTrips {
    /// Each measured round trip.
    pub samples: Vec<Duration>,
    /// Wall time of the measured rounds.
    pub elapsed: Duration,
}

impl RoundTrips {
    /// The `q` quantile (0.0..=1.0) in microseconds.
    pub fn quantile_us(&self, q: f64) -> f64 {
        if self.samples.is_empty() {
            return 0.0;
        }
        let mut s = self.samples.clone();
        s.sort_unstable();
        let i = ((s.len() - 1) as f64 * q.clamp(0.0, 1.0)).round() as usize;
        s[i].as_secs_f64() * 1e6
    }

    /// Round trips per second.
    pub fn per_second(&self) -> f64 {
        self.samples.len() as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }
}

/// Kills the helper if the measurement is abandoned.
struct KillOnDrop(Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        if let Ok(None) = self.0.try_wait() {
            let _ = self.0.kill();
        }
        let _ = self.0.wait();
    }
}

// Words of the raw ping-pong page, one cache line each.
const SPIN_PING: usize = 8;
const SPIN_PONG: usize = 16;
const SPIN_READY: usize = 24;
const SPIN_STOP: usize = 32;
const SPIN_CPU: [usize; 2] = [40, 48];

/// Publishes this side's CPU and yields if the other side last ran on the
/// same one (two spinners on one CPU would otherwise alternate only at the
/// scheduler's tick).
fn spin_courtesy(w: &[std::sync::atomic::AtomicU64], me: usize) {
    let cpu = u64::from(mem::current_cpu());
    w[SPIN_CPU[me]].store(cpu, Ordering::Relaxed);
    if w[SPIN_CPU[1 - me]].load(Ordering::Relaxed) == cpu {
        std::thread::yield_now();
    }
}

/// The physical floor: a bare shared-memory ping-pong between this process
/// and a helper process (both spinning on one cache line each, no ring, no
/// codec), `rounds` measured round trips after a tenth as warm-up. A side
/// that spins for long on the CPU the other one last ran on yields it.
///
/// Fails when the helper cannot be started, does not answer within seconds,
/// or the segment cannot be created.
pub fn raw_spin_pingpong(peer: &PeerCommand, rounds: usize) -> io::Result<RoundTrips> {
    let seg = Segment::create("weft-spin", PAGE)?;
    let w = seg.words();
    mem::set_inheritable(seg.fd(), true)?;
    let spawned = peer
        .command("spin", &["--fd".into(), seg.fd().as_raw_fd().to_string()])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .spawn();
    mem::set_inheritable(seg.fd(), false)?;
    let mut child = KillOnDrop(spawned?);
    let deadline = Instant::now() + Duration::from_secs(10);
    while w[SPIN_READY].load(Ordering::Acquire) == 0 {
        if Instant::now() > deadline || child.0.try_wait()?.is_some() {
            return Err(io::Error::other("the spin helper did not start"));
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    let warm = rounds / 10;
    let mut samples = Vec::with_capacity(rounds);
    let mut started = Instant::now();
    for i in 1..=(warm + rounds) as u64 {
        if i == warm as u64 + 1 {
            started = Instant::now();
        }
        let t = Instant::now();
        w[SPIN_PING].store(i, Ordering::Release);
        let mut n: u32 = 0;
        while w[SPIN_PONG].load(Ordering::Acquire) != i {
            std::hint::spin_loop();
            n = n.wrapping_add(1);
            if n.is_multiple_of(1024) {
                spin_courtesy(w, 0);
                if n.is_multiple_of(1 << 20) && t.elapsed() > Duration::from_secs(5) {
                    return Err(io::Error::other("the spin helper stopped answering"));
                }
            }
        }
        if i > warm as u64 {
            samples.push(t.elapsed());
        }
    }
    let elapsed = started.elapsed();
    w[SPIN_STOP].store(1, Ordering::Release);
    let deadline = Instant::now() + Duration::from_secs(5);
    while child.0.try_wait()?.is_none() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(1));
    }
    Ok(RoundTrips { samples, elapsed })
}

fn spin_peer(fd: i32) -> io::Result<()> {
    let fd = mem::adopt_inherited_fd(fd)?;
    let seg = Segment::open(fd, PAGE, PAGE).map_err(|e| io::Error::other(e.to_string()))?;
    let w = seg.words();
    let parent = std::os::unix::process::parent_id();
    w[SPIN_READY].store(1, Ordering::Release);
    let mut last = 0;
    let mut n: u32 = 0;
    loop {
        let p = w[SPIN_PING].load(Ordering::Acquire);
        if p != last {
            w[SPIN_PONG].store(p, Ordering::Release);
            last = p;
        }
        std::hint::spin_loop();
        n = n.wrapping_add(1);
        if n.is_multiple_of(1024) {
            if w[SPIN_STOP].load(Ordering::Acquire) != 0 {
                return Ok(());
            }
            spin_courtesy(w, 1);
        }
        if n.is_multiple_of(1 << 22) && std::os::unix::process::parent_id() != parent {
            return Ok(()); // orphaned: the benchmark died
        }
    }
}

/// CPU time (user + system, all threads) process `pid` used so far.
///
/// Fails when there is no such process.
pub fn cpu_time(pid: u32) -> io::Result<Duration> {
    mem::process_cpu_time(pid)
}

/// CPU used by the processes `pids` together over `window` (this thread
/// sleeps meanwhile), as a percentage of one core.
///
/// Fails when a process does not exist.
pub fn cpu_percent(pids: &[u32], window: Duration) -> io::Result<f64> {
    let before: io::Result<Vec<Duration>> = pids.iter().map(|p| cpu_time(*p)).collect();
    let before = before?;
    let t = Instant::now();
    std::thread::sleep(window);
    let wall = t.elapsed();
    let mut used = Duration::ZERO;
    for (p, b) in pids.iter().zip(before) {
        used += cpu_time(*p)?.saturating_sub(b);
    }
    Ok(100.0 * used.as_secs_f64() / wall.as_secs_f64())
}

/// What a hostile helper does to the node it connects to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Attack {
    /// A well-formed record of bytes that are not a weft frame.
    Garbage,
    /// A record header with the wrong tag.
    BadRecord,
    /// Random words over the whole segment, control words included.
    Scribble,
    /// A segment whose size is not sealed.
    Unsealed,
    /// A sealed segment with a wrong header.
    BadHeader,
    /// Try to shrink the segment under the peer after it mapped it.
    Truncate,
}

impl std::str::FromStr for Attack {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Ok(match s {
            "garbage" => Attack::Garbage,
            "bad-record" => Attack::BadRecord,
            "scribble" => Attack::Scribble,
            "unsealed" => Attack::Unsealed,
            "bad-header" => Attack::BadHeader,
            "truncate" => Attack::Truncate,
            other => return Err(format!("unknown attack {other}")),
        })
    }
}

/// Runs the helper process; returns its exit code (see the module
/// documentation for the modes).
pub fn peer_main(args: Vec<String>) -> i32 {
    let (mode, rest) = match args.split_first() {
        Some((m, r)) => (m.as_str(), r),
        None => {
            eprintln!("weft shm helper: missing mode");
            return 2;
        }
    };
    let opts = match Opts::parse(rest) {
        Ok(o) => o,
        Err(e) => {
            eprintln!("weft shm helper: {e}");
            return 2;
        }
    };
    let result = match mode {
        "spin" => opts.int("fd").and_then(|fd| spin_peer(fd as i32)),
        "node" => run_async(node_peer(opts)),
        "hostile" => run_async(hostile_peer(opts)),
        other => Err(io::Error::other(format!("unknown mode {other}"))),
    };
    match result {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("weft shm helper: {e}");
            1
        }
    }
}

fn run_async(fut: impl std::future::Future<Output = io::Result<()>>) -> io::Result<()> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?
        .block_on(fut)
}

struct Opts(Vec<(String, String)>);

impl Opts {
    fn parse(args: &[String]) -> Result<Opts, String> {
        let mut out = Vec::new();
        let mut it = args.iter();
        while let Some(a) = it.next() {
            let key = a
                .strip_prefix("--")
                .ok_or_else(|| format!("unexpected argument {a}"))?;
            if key == "no-shm" {
                out.push((key.to_string(), String::new()));
                continue;
            }
            let v = it.next().ok_or_else(|| format!("--{key} needs a value"))?;
            out.push((key.to_string(), v.clone()));
        }
        Ok(Opts(out))
    }

    fn get(&self, key: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    fn int(&self, key: &str) -> io::Result<u64> {
        self.get(key)
            .ok_or_else(|| io::Error::other(format!("--{key} missing")))?
            .parse()
            .map_err(|e| io::Error::other(format!("--{key}: {e}")))
    }
}

/// `echo` answers with the payload; `hang` keeps the request unanswered
/// until the process dies.
struct HelperService;

impl RequestHandler for HelperService {
    fn handle(&self, _from: PeerRef, req: Request, responder: Responder) {
        match req.service.as_str() {
            "echo" => responder.respond(Response {
                call_id: 0,
                status: Status::Ok,
                detail: String::new(),
                tx: None,
                payload: req.payload,
            }),
            "hang" => std::mem::forget(responder),
            other => responder.fail(Failure::new(Status::NoSuchService, other.to_string())),
        }
    }
}

fn say(line: &str) {
    let mut out = io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

async fn node_peer(opts: Opts) -> io::Result<()> {
    let id = opts.int("id")? as u32;
    let mut cfg = TransportConfig {
        listen: Some("127.0.0.1:0".parse().expect("valid address")),
        secret: opts.get("secret").unwrap_or("").as_bytes().to_vec(),
        hub: Some(crate::InprocHub::new()),
        channels: ChannelSet {
            inproc: true,
            shm: opts.get("no-shm").is_none(),
            tcp: true,
        },
        ..TransportConfig::node(NodeId(id), Incarnation(std::process::id()))
    };
    if let Ok(b) = opts.int("ring-bytes") {
        cfg.shm.ring_bytes = b as usize;
    }
    if let (Ok(hb), Ok(dead)) = (opts.int("heartbeat-ms"), opts.int("dead-ms")) {
        cfg.heartbeat_interval = Duration::from_millis(hb);
        cfg.dead_after = Duration::from_millis(dead);
    }
    let ep = Endpoint::start(cfg)
        .await
        .map_err(|e| io::Error::other(e.to_string()))?;
    ep.set_request_handler(Arc::new(HelperService));
    if let Some(join) = opts.get("join") {
        let addr = join
            .parse()
            .map_err(|e| io::Error::other(format!("--join: {e}")))?;
        ep.join(Seed::Tcp(addr))
            .await
            .map_err(|f| io::Error::other(f.to_string()))?;
    }
    let info = ep.info();
    say(&format!(
        "READY {} {} {} {}",
        id,
        info.addr.as_deref().unwrap_or("-"),
        std::process::id(),
        info.shm.as_deref().unwrap_or("-")
    ));
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<String>();
    std::thread::spawn(move || {
        for line in io::stdin().lock().lines() {
            match line {
                Ok(l) => {
                    if tx.send(l).is_err() {
                        return;
                    }
                }
                Err(_) => return,
            }
        }
    });
    while let Some(line) = rx.recv().await {
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["call", node, service, count, in_flight, size] => {
                let parsed = (
                    node.parse::<u32>(),
                    count.parse::<usize>(),
                    in_flight.parse::<usize>(),
                    size.parse::<usize>(),
                );
                let (Ok(node), Ok(count), Ok(in_flight), Ok(size)) = parsed else {
                    say("ERROR bad call command");
                    continue;
                };
                let r = call_many(&ep, NodeId(node), service, count, in_flight, size).await;
                say(&format!(
                    "CALLS ok={} failed={} status={}",
                    r.ok,
                    r.failed,
                    r.first_failure.map(|s| s.to_string()).unwrap_or("-".into())
                ));
            }
            ["route", node] => {
                let node = NodeId(node.parse().unwrap_or(0));
                say(&format!(
                    "ROUTE {} {}",
                    node.0,
                    route_name(route(&ep, node))
                ));
            }
            ["wait-route", node, kind, ms] => {
                let node = NodeId(node.parse().unwrap_or(0));
                let deadline = Instant::now() + Duration::from_millis(ms.parse().unwrap_or(0));
                loop {
                    let r = route(&ep, node);
                    if route_name(r) == *kind || Instant::now() >= deadline {
                        say(&format!("ROUTE {} {}", node.0, route_name(r)));
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
            }
            ["wait-member", node, ms] => {
                let node = NodeId(node.parse().unwrap_or(0));
                let deadline = Instant::now() + Duration::from_millis(ms.parse().unwrap_or(0));
                while ep.peer_status(node).is_some() && Instant::now() < deadline {
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
                let known = if ep.peer_status(node).is_none() {
                    "yes"
                } else {
                    "no"
                };
                say(&format!("MEMBER {} {known}", node.0));
            }
            ["quit"] => break,
            _ => say("ERROR unknown command"),
        }
    }
    ep.shutdown().await;
    Ok(())
}

fn route(ep: &Endpoint, node: NodeId) -> Option<ChannelKind> {
    ep.view()
        .nodes
        .into_iter()
        .find(|n| n.info.id == node)
        .and_then(|n| n.channel)
}

fn route_name(r: Option<ChannelKind>) -> &'static str {
    match r {
        Some(ChannelKind::Inproc) => "inproc",
        Some(ChannelKind::Shm) => "shm",
        Some(ChannelKind::Tcp) => "tcp",
        None => "none",
    }
}

/// Outcome of [`call_many`].
#[derive(Debug, Default)]
struct CallsOutcome {
    ok: usize,
    failed: usize,
    first_failure: Option<Status>,
}

/// Makes `count` calls of `size`-byte payloads with `in_flight` at a time,
/// checking that `echo` answers carry the payload back intact.
async fn call_many(
    ep: &Endpoint,
    to: NodeId,
    service: &str,
    count: usize,
    in_flight: usize,
    size: usize,
) -> CallsOutcome {
    use futures::stream::{FuturesUnordered, StreamExt};
    let Ok(service) = ServiceName::new(service) else {
        return CallsOutcome {
            failed: count,
            first_failure: Some(Status::BadRequest),
            ..CallsOutcome::default()
        };
    };
    let next = AtomicU64::new(0);
    let one = |i: u64| {
        let body: Vec<u8> = (0..size).map(|k| (k as u64 ^ i) as u8).collect();
        let req = Request {
            call_id: 0,
            service: service.clone(),
            instance: 0,
            node: to,
            budget_us: None,
            tx: None,
            flags: 0,
            payload: Payload::bytes(body.clone()),
        };
        let ep = ep.clone();
        async move {
            let deadline = Instant::now() + Duration::from_secs(30);
            match ep.call(to, req, Some(deadline)).await {
                Ok(r) if r.status == Status::Ok => match r.payload.into_bytes() {
                    Ok(b) if b[..] == body[..] => Ok(()),
                    _ => Err(Status::Mismatch),
                },
                Ok(r) => Err(r.status),
                Err(f) => Err(f.status),
            }
        }
    };
    let mut running = FuturesUnordered::new();
    let mut out = CallsOutcome::default();
    let mut started = 0;
    while started < count.min(in_flight.max(1)) {
        running.push(one(next.fetch_add(1, Ordering::Relaxed)));
        started += 1;
    }
    while let Some(r) = running.next().await {
        match r {
            Ok(()) => out.ok += 1,
            Err(s) => {
                out.failed += 1;
                out.first_failure.get_or_insert(s);
            }
        }
        if started < count {
            running.push(one(next.fetch_add(1, Ordering::Relaxed)));
            started += 1;
        }
    }
    out
}

async fn hostile_peer(opts: Opts) -> io::Result<()> {
    use std::os::fd::AsFd;
    use tokio::io::Interest;
    use tokio::net::UnixStream;

    let path = opts
        .get("connect")
        .ok_or_else(|| io::Error::other("--connect missing"))?
        .to_string();
    let attack: Attack = opts
        .get("attack")
        .ok_or_else(|| io::Error::other("--attack missing"))?
        .parse()
        .map_err(io::Error::other)?;
    let stream = UnixStream::connect(&path).await?;
    let layout = Layout::new(8192).map_err(io::Error::other)?;
    let seg = match attack {
        Attack::Unsealed => Segment::create_unsealed("weft-hostile", layout.segment_bytes())?,
        _ => Segment::create("weft-hostile", layout.segment_bytes())?,
    };
    if attack != Attack::BadHeader {
        layout.init(seg.words(), std::process::id());
    }
    loop {
        stream.writable().await?;
        match stream.try_io(Interest::WRITABLE, || {
            mem::send_with_fd(stream.as_fd(), b"WEFTSHM1", seg.fd())
        }) {
            Ok(_) => break,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(e),
        }
    }
    let mut ack = [0u8; 1];
    let accepted = loop {
        stream.readable().await?;
        match stream.try_read(&mut ack) {
            Ok(1) => break true,
            Ok(_) => break false,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(_) => break false,
        }
    };
    if !accepted {
        say("HOSTILE refused");
        return wait_for_eof().await;
    }
    let words = seg.words();
    let ring = layout.ring(words, 0);
    let outcome = match attack {
        Attack::Garbage => {
            let mut p = Producer::default();
            p.write(&ring, b"\x00\x01 definitely not a weft frame \xff\xfe")
                .map_err(|e| io::Error::other(e.to_string()))?;
            wake_side(&layout, words, 1);
            "wrote garbage".to_string()
        }
        Attack::BadRecord => {
            ring_word_zero(&layout, words).store(0xdead_beef_0000_0010, Ordering::Release);
            wake_side(&layout, words, 1);
            "wrote a bad record header".to_string()
        }
        Attack::Scribble => {
            let mut x: u64 = 0x2545_f491_4f6c_dd1d ^ u64::from(std::process::id());
            for _ in 0..4096 {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                words[(x as usize) % words.len()].store(x, Ordering::Relaxed);
            }
            wake_side(&layout, words, 1);
            "scribbled".to_string()
        }
        Attack::Truncate => match mem::try_shrink(seg.fd()) {
            Ok(()) => "truncated".to_string(),
            Err(e) => format!("truncate refused: {e}"),
        },
        Attack::Unsealed | Attack::BadHeader => "accepted".to_string(),
    };
    say(&format!("HOSTILE {outcome}"));
    wait_for_eof().await
}

/// The first data word of ring 0 (where the first record header goes).
fn ring_word_zero<'a>(
    layout: &Layout,
    words: &'a [std::sync::atomic::AtomicU64],
) -> &'a std::sync::atomic::AtomicU64 {
    let start = super::ring::HEADER_BYTES / 8;
    let _ = layout;
    &words[start]
}

fn wake_side(layout: &Layout, words: &[std::sync::atomic::AtomicU64], side: usize) {
    let bell = layout.doorbell(words, side);
    bell.store(0, Ordering::Relaxed);
    mem::futex_wake(bell, i32::MAX);
}

/// Keeps the process (and its end of the connection) alive until stdin
/// closes.
async fn wait_for_eof() -> io::Result<()> {
    tokio::task::spawn_blocking(|| {
        let mut sink = String::new();
        while io::stdin()
            .lock()
            .read_line(&mut sink)
            .map(|n| n > 0)
            .unwrap_or(false)
        {
            sink.clear();
        }
    })
    .await
    .map_err(io::Error::other)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_parse_and_quantiles() {
        let o = Opts::parse(&["--id".into(), "3".into(), "--no-shm".into()]).unwrap();
        assert_eq!(o.int("id").unwrap(), 3);
        assert!(o.get("no-shm").is_some());
        assert!(Opts::parse(&["--id".into()]).is_err());
        assert!(Opts::parse(&["id".into()]).is_err());
        let r = RoundTrips {
            samples: (1..=100).map(Duration::from_micros).collect(),
            elapsed: Duration::from_millis(10),
        };
        assert!((r.quantile_us(0.5) - 50.0).abs() <= 1.0);
        assert!((r.per_second() - 10_000.0).abs() < 1.0);
        assert_eq!(peer_main(vec![]), 2);
        assert_eq!(peer_main(vec!["nope".into()]), 1);
        assert!("scribble".parse::<Attack>().is_ok());
    }

    #[test]
    fn own_cpu_time_is_measurable() {
        let a = cpu_time(std::process::id()).unwrap();
        let t = Instant::now();
        while t.elapsed() < Duration::from_millis(20) {
            std::hint::spin_loop();
        }
        assert!(cpu_time(std::process::id()).unwrap() > a);
    }
}
