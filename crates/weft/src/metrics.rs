//! Prometheus metrics: the process's metrics recorder (the
//! `metrics-exporter-prometheus` crate renders the text exposition format)
//! and a small HTTP listener that serves it at `/metrics`.
//!
//! The layers count where their events happen, with the `metrics` facade
//! (transactions in the transaction manager's driver, forces in the log's
//! flusher, calls in the RPC dispatcher, frames and links in the transport,
//! group sends and replies in the group runtime, lock waits in the lock
//! manager); names and labels are listed in docs/metrics.md. This module
//! owns installing the recorder (once per process), the histogram buckets,
//! the descriptions, the gauges sampled from the nodes at each scrape
//! ([`MetricsServer::watch`]) and the listener. Must never bind anything but
//! the address it is given (callers default to loopback), never hold more
//! than [`MAX_CONNECTIONS`] connections or read more than [`MAX_REQUEST`]
//! bytes of a request, and never let a slow client hold a connection past
//! [`REQUEST_TIMEOUT`].

use std::net::SocketAddr;
use std::sync::{Arc, OnceLock, Weak};
use std::time::Duration;

use metrics::{Counter, Gauge, Histogram, Key, KeyName, Metadata, Recorder, SharedString, Unit};
use metrics_exporter_prometheus::{
    Matcher, PrometheusBuilder, PrometheusHandle, PrometheusRecorder,
};
use parking_lot::Mutex;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::node::{Node, NodeInner};

/// Connections served at once; more wait in the kernel's backlog.
pub const MAX_CONNECTIONS: usize = 16;
/// Longest request head read (request line and headers).
pub const MAX_REQUEST: usize = 8 * 1024;
/// How long a client may take to send its request and read the answer.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// How often histograms are drained when nobody scrapes (bounds their memory).
const UPKEEP_EVERY: Duration = Duration::from_secs(5);

/// Upper bounds of the buckets of every `_seconds` histogram: 50 µs to 10 s.
pub const SECONDS_BUCKETS: &[f64] = &[
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
    2.5, 5.0, 10.0,
];
/// Upper bounds of the buckets of `weft_log_records_per_force`.
pub const RECORDS_BUCKETS: &[f64] = &[1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 1024.0];

/// Why metrics could not be served.
#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    /// Another metrics recorder (not weft's) is installed in this process.
    #[error("another metrics recorder is already installed in this process")]
    OtherRecorder,
    /// The exporter could not be configured.
    #[error("metrics exporter: {0}")]
    Build(String),
    /// The listening address could not be bound.
    #[error("cannot listen for metrics on {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// Why.
        source: std::io::Error,
    },
}

/// The installed recorder, behind the process-wide switch of
/// [`weft_transport::metrics::exporting`]: while it is off every metric
/// handed out is a no-op, so a benchmark can compare runs with and without
/// metrics in one process.
struct Switched(PrometheusRecorder);

impl Recorder for Switched {
    fn describe_counter(&self, key: KeyName, unit: Option<Unit>, description: SharedString) {
        self.0.describe_counter(key, unit, description)
    }
    fn describe_gauge(&self, key: KeyName, unit: Option<Unit>, description: SharedString) {
        self.0.describe_gauge(key, unit, description)
    }
    fn describe_histogram(&self, key: KeyName, unit: Option<Unit>, description: SharedString) {
        self.0.describe_histogram(key, unit, description)
    }
    fn register_counter(&self, key: &Key, metadata: &Metadata<'_>) -> Counter {
        if weft_transport::metrics::exporting() {
            self.0.register_counter(key, metadata)
        } else {
            Counter::noop()
        }
    }
    fn register_gauge(&self, key: &Key, metadata: &Metadata<'_>) -> Gauge {
        if weft_transport::metrics::exporting() {
            self.0.register_gauge(key, metadata)
        } else {
            Gauge::noop()
        }
    }
    fn register_histogram(&self, key: &Key, metadata: &Metadata<'_>) -> Histogram {
        if weft_transport::metrics::exporting() {
            self.0.register_histogram(key, metadata)
        } else {
            Histogram::noop()
        }
    }
}

static HANDLE: OnceLock<Result<PrometheusHandle, String>> = OnceLock::new();

/// Installs weft's Prometheus recorder in this process (the first call;
/// later calls return the same handle) and turns recording on.
///
/// Fails with [`MetricsError::OtherRecorder`] when another recorder was
/// installed first, [`MetricsError::Build`] when the exporter rejects its
/// configuration.
pub fn install() -> Result<PrometheusHandle, MetricsError> {
    let installed = HANDLE.get_or_init(|| {
        let builder = PrometheusBuilder::new()
            .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), SECONDS_BUCKETS)
            .and_then(|b| {
                b.set_buckets_for_metric(
                    Matcher::Full("weft_log_records_per_force".into()),
                    RECORDS_BUCKETS,
                )
            })
            .map_err(|e| format!("build: {e}"))?;
        let recorder = builder.build_recorder();
        let handle = recorder.handle();
        metrics::set_global_recorder(Switched(recorder)).map_err(|_| "other".to_string())?;
        weft_transport::metrics::set_exporting(true);
        describe();
        Ok(handle)
    });
    match installed {
        Ok(h) => {
            weft_transport::metrics::set_exporting(true);
            Ok(h.clone())
        }
        Err(e) if e == "other" => Err(MetricsError::OtherRecorder),
        Err(e) => Err(MetricsError::Build(e.clone())),
    }
}

/// Turns recording off or back on (after [`install`]): while off, every
/// metric update is a no-op, as if no recorder were installed. Benchmarks
/// use it to compare runs with and without metrics in one process.
pub fn set_recording(on: bool) {
    weft_transport::metrics::set_exporting(on && HANDLE.get().is_some_and(|h| h.is_ok()));
}

/// Every metric weft records: name, kind, unit and help text (rendered as
/// `# HELP` lines; the list docs/metrics.md documents). Counters without
/// labels are created at zero, so that a scrape shows them before their
/// first event.
fn describe() {
    use metrics::{describe_counter, describe_gauge, describe_histogram};
    let counters: &[(&'static str, &'static str)] = &[
        ("weft_tx_begun_total", "Transactions begun at this node (it coordinates them)."),
        ("weft_tx_committed_total", "Transactions this node coordinated that committed (read-only ones included)."),
        ("weft_tx_committed_read_only_total", "Of the committed transactions, those that wrote no log record here."),
        ("weft_log_appends_total", "Records appended to the node's log."),
        ("weft_log_appended_bytes_total", "Payload bytes appended to the node's log."),
        ("weft_log_forces_total", "fdatasync calls on the log's segment files (each a group commit, or a rollover)."),
        ("weft_group_deliveries_total", "Members a group send was delivered to (queued at the member), summed over sends."),
        ("weft_lock_waits_total", "Lock requests that had to queue behind a conflicting holder."),
        ("weft_lock_conflicts_total", "Lock requests refused with LockConflict (try-lock refusals and waits that reached their bound)."),
    ];
    for (name, help) in counters {
        describe_counter!(*name, Unit::Count, *help);
        metrics::counter!(*name).absolute(0);
    }
    describe_counter!("weft_tx_aborted_total", Unit::Count, "Transactions this node coordinated that aborted, by cause (the status the commit answers: Aborted, TimedOut, HostDead, ProcDead, NoBuffer...).");
    describe_counter!("weft_rpc_calls_total", Unit::Count, "Calls served by this node, by service, status and the channel they came over (service=\"_unknown\" for services it does not have).");
    describe_counter!(
        "weft_group_sends_total",
        Unit::Count,
        "Group sends from this node, by status."
    );
    describe_counter!("weft_group_replies_total", Unit::Count, "Group replies taken by senders at this node, by status (a member that will never reply yields its failure status).");
    describe_counter!(
        "weft_transport_frames_sent_total",
        Unit::Count,
        "Frames handed to a link, by channel."
    );
    describe_counter!(
        "weft_transport_frames_received_total",
        Unit::Count,
        "Frames received from a link, by channel."
    );
    describe_counter!(
        "weft_transport_sent_bytes_total",
        Unit::Bytes,
        "Encoded bytes written to shared-memory rings and TCP sockets, by channel."
    );
    describe_counter!(
        "weft_transport_received_bytes_total",
        Unit::Bytes,
        "Bytes read from shared-memory rings and TCP sockets, by channel."
    );
    describe_counter!(
        "weft_transport_links_up_total",
        Unit::Count,
        "Links to member nodes that completed their handshake, by channel."
    );
    describe_counter!(
        "weft_transport_links_down_total",
        Unit::Count,
        "Links to member nodes that closed, by channel and cause."
    );
    describe_gauge!(
        "weft_transport_links",
        Unit::Count,
        "Links to member nodes up now, by channel."
    );
    describe_gauge!(
        "weft_tx_in_flight",
        Unit::Count,
        "Transactions live at the node now (coordinated here or joined), sampled at the scrape."
    );
    describe_gauge!("weft_tx_in_doubt", Unit::Count, "Transactions prepared at the node and waiting for their outcome now, sampled at the scrape.");
    describe_gauge!(
        "weft_tx_oldest_in_doubt_seconds",
        Unit::Seconds,
        "Age of the oldest in-doubt transaction at the node (0 when none), sampled at the scrape."
    );
    describe_histogram!(
        "weft_tx_commit_duration_seconds",
        Unit::Seconds,
        "Time from a commit call at the coordinator to its successful answer."
    );
    describe_histogram!(
        "weft_log_force_duration_seconds",
        Unit::Seconds,
        "Duration of each fdatasync of the log."
    );
    describe_histogram!(
        "weft_log_records_per_force",
        Unit::Count,
        "Records made durable by each group-commit sync of the log."
    );
    describe_histogram!(
        "weft_lock_wait_duration_seconds",
        Unit::Seconds,
        "How long queued lock requests waited (granted or not)."
    );
}

/// A running `/metrics` listener. Dropping it stops the listener.
#[must_use = "the listener stops when this is dropped"]
pub struct MetricsServer {
    addr: SocketAddr,
    watched: Arc<Mutex<Vec<Weak<NodeInner>>>>,
    task: tokio::task::JoinHandle<()>,
    upkeep: tokio::task::JoinHandle<()>,
}

impl MetricsServer {
    /// The bound address (the real port when port 0 was asked for).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Samples `node`'s gauges (transactions in flight and in doubt) at
    /// each scrape, for as long as the node lives.
    pub fn watch(&self, node: &Node) {
        let mut w = self.watched.lock();
        w.retain(|n| n.strong_count() > 0);
        w.push(node.downgrade());
    }
}

impl Drop for MetricsServer {
    fn drop(&mut self) {
        self.task.abort();
        self.upkeep.abort();
    }
}

/// Installs the recorder (see [`install`]) and serves `/metrics` on `addr`
/// (the caller chooses the address: weft's command line defaults to
/// loopback). Must be called inside a tokio runtime.
///
/// Fails like [`install`], or with [`MetricsError::Bind`] when `addr`
/// cannot be bound.
pub async fn serve(addr: SocketAddr) -> Result<MetricsServer, MetricsError> {
    let handle = install()?;
    let listener = TcpListener::bind(addr)
        .await
        .map_err(|source| MetricsError::Bind { addr, source })?;
    let bound = listener
        .local_addr()
        .map_err(|source| MetricsError::Bind { addr, source })?;
    let watched: Arc<Mutex<Vec<Weak<NodeInner>>>> = Arc::default();
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    let task = {
        let handle = handle.clone();
        let watched = watched.clone();
        tokio::spawn(async move {
            loop {
                let Ok(permit) = slots.clone().acquire_owned().await else {
                    return;
                };
                let stream = match listener.accept().await {
                    Ok((s, _)) => s,
                    Err(e) => {
                        tracing::warn!("metrics listener: accept failed: {e}");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                };
                let handle = handle.clone();
                let watched = watched.clone();
                tokio::spawn(async move {
                    let served =
                        tokio::time::timeout(REQUEST_TIMEOUT, answer(stream, &handle, &watched))
                            .await;
                    if let Ok(Err(e)) = served {
                        tracing::debug!("metrics request: {e}");
                    }
                    drop(permit);
                });
            }
        })
    };
    let upkeep = {
        let handle = handle.clone();
        tokio::spawn(async move {
            let mut every = tokio::time::interval(UPKEEP_EVERY);
            loop {
                every.tick().await;
                handle.run_upkeep();
            }
        })
    };
    Ok(MetricsServer {
        addr: bound,
        watched,
        task,
        upkeep,
    })
}

/// Sets the sampled gauges from the watched nodes (summed over them).
fn sample(watched: &Mutex<Vec<Weak<NodeInner>>>) {
    let nodes: Vec<Node> = watched.lock().iter().filter_map(Node::upgrade).collect();
    let (mut live, mut in_doubt, mut oldest_ms) = (0usize, 0usize, 0u64);
    for n in &nodes {
        let list = n.tm().list();
        live += list.len();
        for t in list.iter().filter(|t| t.in_doubt) {
            in_doubt += 1;
            oldest_ms = oldest_ms.max(t.age_ms);
        }
    }
    // Counters the transaction manager and the log keep anyway (`weft
    // status` shows them), read here rather than counted twice on the
    // commit path. They only grow (`absolute` keeps the maximum).
    let (mut begun, mut committed, mut read_only, mut appends, mut bytes) = (0, 0, 0, 0, 0);
    for n in &nodes {
        let tm = n.tm().stats();
        begun += tm.begun;
        committed += tm.committed;
        read_only += tm.committed_read_only;
        let log = n.log().stats();
        appends += log.appends;
        bytes += log.bytes_appended;
    }
    if !nodes.is_empty() {
        metrics::counter!("weft_tx_begun_total").absolute(begun);
        metrics::counter!("weft_tx_committed_total").absolute(committed);
        metrics::counter!("weft_tx_committed_read_only_total").absolute(read_only);
        metrics::counter!("weft_log_appends_total").absolute(appends);
        metrics::counter!("weft_log_appended_bytes_total").absolute(bytes);
    }
    metrics::gauge!("weft_tx_in_flight").set(live as f64);
    metrics::gauge!("weft_tx_in_doubt").set(in_doubt as f64);
    metrics::gauge!("weft_tx_oldest_in_doubt_seconds").set(oldest_ms as f64 / 1000.0);
}

/// What a request asks for.
#[derive(Debug, PartialEq, Eq)]
enum Asked {
    /// `GET /metrics` (or `HEAD`).
    Metrics { head: bool },
    /// Another path.
    NotFound,
    /// Another method.
    BadMethod,
    /// Not an HTTP request line.
    Malformed,
}

/// Parses the request line of `head`.
fn parse_request(head: &[u8]) -> Asked {
    let line = head.split(|b| *b == b'\n').next().unwrap_or_default();
    let Ok(line) = std::str::from_utf8(line) else {
        return Asked::Malformed;
    };
    let mut parts = line.trim_end_matches('\r').split(' ');
    let (Some(method), Some(target), Some(version)) = (parts.next(), parts.next(), parts.next())
    else {
        return Asked::Malformed;
    };
    if !version.starts_with("HTTP/1.") || parts.next().is_some() {
        return Asked::Malformed;
    }
    let path = target.split('?').next().unwrap_or_default();
    match (method, path) {
        ("GET", "/metrics") => Asked::Metrics { head: false },
        ("HEAD", "/metrics") => Asked::Metrics { head: true },
        ("GET" | "HEAD", _) => Asked::NotFound,
        _ => Asked::BadMethod,
    }
}

/// Reads one request and answers it; the connection then closes.
async fn answer(
    mut stream: TcpStream,
    handle: &PrometheusHandle,
    watched: &Mutex<Vec<Weak<NodeInner>>>,
) -> std::io::Result<()> {
    let mut head = Vec::with_capacity(1024);
    let mut buf = [0u8; 1024];
    loop {
        let n = stream.read(&mut buf).await?;
        if n == 0 {
            return Ok(());
        }
        head.extend_from_slice(&buf[..n]);
        if head.windows(4).any(|w| w == b"\r\n\r\n") || head.windows(2).any(|w| w == b"\n\n") {
            break;
        }
        if head.len() > MAX_REQUEST {
            return respond(
                &mut stream,
                "431 Request Header Fields Too Large",
                "",
                false,
            )
            .await;
        }
    }
    match parse_request(&head) {
        Asked::Metrics { head } => {
            sample(watched);
            let body = handle.render();
            respond(&mut stream, "200 OK", &body, head).await
        }
        Asked::NotFound => {
            respond(
                &mut stream,
                "404 Not Found",
                "weft serves /metrics only\n",
                false,
            )
            .await
        }
        Asked::BadMethod => respond(&mut stream, "405 Method Not Allowed", "", false).await,
        Asked::Malformed => respond(&mut stream, "400 Bad Request", "", false).await,
    }
}

async fn respond(
    stream: &mut TcpStream,
    status: &str,
    body: &str,
    head_only: bool,
) -> std::io::Result<()> {
    let content_type = if status.starts_with("200") {
        "text/plain; version=0.0.4; charset=utf-8"
    } else {
        "text/plain; charset=utf-8"
    };
    let mut out = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    if !head_only {
        out.extend_from_slice(body.as_bytes());
    }
    stream.write_all(&out).await?;
    stream.shutdown().await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_get_of_slash_metrics_is_served() {
        assert_eq!(
            parse_request(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"),
            Asked::Metrics { head: false }
        );
        assert_eq!(
            parse_request(b"HEAD /metrics?x=1 HTTP/1.0\r\n\r\n"),
            Asked::Metrics { head: true }
        );
        assert_eq!(parse_request(b"GET / HTTP/1.1\r\n\r\n"), Asked::NotFound);
        assert_eq!(
            parse_request(b"POST /metrics HTTP/1.1\r\n\r\n"),
            Asked::BadMethod
        );
        assert_eq!(parse_request(b"GET /metrics\r\n\r\n"), Asked::Malformed);
        assert_eq!(parse_request(b"\xff\xfe\r\n\r\n"), Asked::Malformed);
        assert_eq!(
            parse_request(b"GET /metrics SPDY/3 x\r\n\r\n"),
            Asked::Malformed
        );
    }
}
