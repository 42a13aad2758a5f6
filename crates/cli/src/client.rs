//! Talking to a running node from the command line: a client link (not a
//! cluster member) to one node, which relays calls to the others.
//!
//! Owns connection options (address, secret, TLS files), typed calls, reconnecting
//! after the node restarts ([`Redial`]) and the exit code of a failure.
//! Must never join the cluster, and never lose a failure's status on the
//! way to the exit code.

use std::net::{SocketAddr, ToSocketAddrs};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, Context};
use serde::de::DeserializeOwned;
use serde::Serialize;
use weft_transport::{Endpoint, TlsConfig, TransportConfig};
use weft_wire::{
    Address, Failure, Incarnation, NodeId, Payload, Request, ServiceName, Status, TxContext,
};

/// How to reach a node.
#[derive(clap::Args, Clone, Debug)]
pub struct ClientOpts {
    /// The node to talk to (host:port).
    #[arg(long, env = "WEFT_NODE", default_value = "127.0.0.1:7000")]
    pub node: String,
    /// The cluster secret.
    #[arg(
        long,
        env = "WEFT_CLUSTER_SECRET",
        default_value = "",
        hide_env_values = true
    )]
    pub secret: String,
    /// How long to wait for an answer.
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    pub timeout: Duration,
    /// TLS files, when the cluster runs TLS.
    #[command(flatten)]
    pub tls: TlsOpts,
}

/// Mutual TLS on TCP links: this end's certificate and key, and the
/// cluster's CA. The same three flags on `weft node` and every client
/// command; give all three or none (see docs/tls.md).
#[derive(clap::Args, Clone, Debug, Default)]
pub struct TlsOpts {
    /// This end's certificate (PEM, signed by the cluster's CA); turns TLS on.
    #[arg(long, env = "WEFT_TLS_CERT")]
    pub tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert (PEM).
    #[arg(long, env = "WEFT_TLS_KEY")]
    pub tls_key: Option<PathBuf>,
    /// The cluster's CA certificate (PEM): peers must present a certificate
    /// it signed.
    #[arg(long, env = "WEFT_TLS_CA")]
    pub tls_ca: Option<PathBuf>,
}

impl TlsOpts {
    /// The TLS settings the flags name; `None` when none is given.
    ///
    /// Fails when only some of the three are given, or a file cannot be
    /// read or does not hold what it should.
    pub fn load(&self) -> anyhow::Result<Option<TlsConfig>> {
        match (&self.tls_cert, &self.tls_key, &self.tls_ca) {
            (None, None, None) => Ok(None),
            (Some(cert), Some(key), Some(ca)) => TlsConfig::from_files(cert, key, ca)
                .map(Some)
                .map_err(|e| anyhow!("{e}")),
            _ => Err(anyhow!(
                "TLS needs all three of --tls-cert, --tls-key and --tls-ca \
                 (or WEFT_TLS_CERT, WEFT_TLS_KEY, WEFT_TLS_CA)"
            )),
        }
    }
}

/// Parses durations like `250ms`, `10s`, `2m`, `1.5s` (a bare number means
/// seconds).
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let (num, unit) = match s.find(|c: char| c.is_ascii_alphabetic()) {
        Some(i) => (&s[..i], &s[i..]),
        None => (s, "s"),
    };
    let v: f64 = num
        .trim()
        .parse()
        .map_err(|_| format!("bad duration {s:?}"))?;
    if !(v.is_finite() && v >= 0.0) {
        return Err(format!("bad duration {s:?}"));
    }
    let secs = match unit {
        "us" => v / 1e6,
        "ms" => v / 1e3,
        "s" => v,
        "m" => v * 60.0,
        "h" => v * 3600.0,
        _ => return Err(format!("bad duration unit in {s:?} (use us, ms, s, m, h)")),
    };
    Ok(Duration::from_secs_f64(secs))
}

/// Resolves `host:port` to a socket address.
pub fn resolve(addr: &str) -> anyhow::Result<SocketAddr> {
    addr.to_socket_addrs()
        .with_context(|| format!("cannot resolve {addr}"))?
        .next()
        .ok_or_else(|| anyhow!("{addr} resolves to no address"))
}

/// A connection to one node.
pub struct Client {
    ep: Endpoint,
    gateway: NodeId,
    timeout: Duration,
    /// Set once a call failed because the link itself is gone.
    broken: AtomicBool,
}

/// True for a status the client's own endpoint gives when its link to the
/// node is gone (not a status the node answered with).
fn link_lost(status: Status) -> bool {
    matches!(
        status,
        Status::ProcDead | Status::HostDead | Status::AddrError | Status::ShuttingDown
    )
}

impl Client {
    /// Connects and authenticates.
    ///
    /// Fails with the connection's failure (its status decides the exit
    /// code: ProcDead/HostDead/TimedOut exit 3, WrongSecret 5).
    pub async fn connect(opts: &ClientOpts) -> anyhow::Result<Client> {
        Client::dial(opts)
            .await
            .map_err(|f| anyhow::Error::new(f).context(format!("cannot connect to {}", opts.node)))
    }

    /// Connects and authenticates, failing with a status: AddrError when
    /// the address does not resolve, BadRequest when the TLS files cannot be
    /// loaded, Refused when TLS is refused (either end), else the link's.
    pub async fn dial(opts: &ClientOpts) -> Result<Client, Failure> {
        let addr =
            resolve(&opts.node).map_err(|e| Failure::new(Status::AddrError, format!("{e:#}")))?;
        let tls = opts
            .tls
            .load()
            .map_err(|e| Failure::new(Status::BadRequest, format!("{e:#}")))?;
        let cfg = TransportConfig {
            secret: opts.secret.as_bytes().to_vec(),
            tls,
            connect_timeout: opts.timeout.min(Duration::from_secs(5)),
            ..TransportConfig::client(Incarnation(std::process::id()))
        };
        let ep = Endpoint::connect_client(cfg, addr).await?;
        let Some(gateway) = ep.gateway() else {
            ep.shutdown().await;
            return Err(Failure::new(
                Status::ProcDead,
                format!("connected to {addr} but no node answered"),
            ));
        };
        Ok(Client {
            ep,
            gateway,
            timeout: opts.timeout,
            broken: AtomicBool::new(false),
        })
    }

    /// True once a call failed because the link to the node is gone: the
    /// client must connect again.
    pub fn is_broken(&self) -> bool {
        self.broken.load(Ordering::Relaxed)
    }

    /// The node this client is connected to.
    pub fn gateway(&self) -> NodeId {
        self.gateway
    }

    /// Calls `addr` (relayed by the gateway when it is another node).
    pub async fn call_payload(
        &self,
        addr: &Address,
        payload: Payload,
        tx: Option<TxContext>,
    ) -> Result<Payload, Failure> {
        let request = Request {
            call_id: 0,
            service: addr.service.clone(),
            instance: addr.instance,
            node: addr.node,
            budget_us: None,
            tx: tx.map(Box::new),
            flags: 0,
            payload,
        };
        let resp = self
            .ep
            .call(addr.node, request, Some(Instant::now() + self.timeout))
            .await
            .inspect_err(|f| {
                if link_lost(f.status) {
                    self.broken.store(true, Ordering::Relaxed);
                }
            })?;
        if resp.status == Status::Ok {
            Ok(resp.payload)
        } else {
            Err(Failure::new(resp.status, resp.detail))
        }
    }

    /// Typed call.
    pub async fn call<Req, Resp>(
        &self,
        addr: &Address,
        req: Req,
        tx: Option<TxContext>,
    ) -> Result<Resp, Failure>
    where
        Req: Serialize + Send + 'static,
        Resp: DeserializeOwned + Send + 'static,
    {
        let p = self.call_payload(addr, Payload::local(req), tx).await?;
        p.decode::<Resp>()
            .map_err(|e| Failure::new(Status::Mismatch, e.to_string()))
    }

    /// Typed call of `service` on the gateway node itself.
    pub async fn call_here<Req, Resp>(&self, service: &str, req: Req) -> Result<Resp, Failure>
    where
        Req: Serialize + Send + 'static,
        Resp: DeserializeOwned + Send + 'static,
    {
        let addr = Address {
            service: ServiceName::new(service)
                .map_err(|e| Failure::new(Status::BadRequest, e.to_string()))?,
            instance: 0,
            node: self.gateway,
        };
        self.call(&addr, req, None).await
    }

    /// Closes the link.
    pub async fn close(self) {
        self.ep.shutdown().await;
    }
}

/// First and longest wait between two attempts of a [`Redial`] to connect.
pub const REDIAL_BACKOFF: (Duration, Duration) =
    (Duration::from_millis(50), Duration::from_secs(1));

/// A client link to one node that connects again, with backoff, once the
/// link is gone (the node restarted): calls then resume instead of failing
/// for good. Calls made while it is down wait for the next attempt and
/// fail with that attempt's status when it fails, so callers are paced by
/// the backoff (50 ms doubling to 1 s).
pub struct Redial {
    opts: ClientOpts,
    what: String,
    state: tokio::sync::Mutex<RedialState>,
}

struct RedialState {
    client: Option<Arc<Client>>,
    backoff: Duration,
    next_try: Instant,
}

impl Redial {
    /// Wraps `client`, connected with `opts`; `what` names the node in
    /// messages ("site 3").
    pub fn new(opts: ClientOpts, what: String, client: Option<Client>) -> Redial {
        Redial {
            opts,
            what,
            state: tokio::sync::Mutex::new(RedialState {
                client: client.map(Arc::new),
                backoff: REDIAL_BACKOFF.0,
                next_try: Instant::now(),
            }),
        }
    }

    /// The live client, connecting again when the link is gone (at most
    /// one attempt per backoff step).
    ///
    /// Fails with the failed attempt's status.
    async fn client(&self) -> Result<Arc<Client>, Failure> {
        let mut st = self.state.lock().await;
        if let Some(c) = &st.client {
            if !c.is_broken() {
                return Ok(c.clone());
            }
            eprintln!("weft: lost the link to {}; connecting again", self.what);
            let old = st.client.take().expect("checked");
            tokio::spawn(async move { old.ep.shutdown().await });
            st.backoff = REDIAL_BACKOFF.0;
            st.next_try = Instant::now();
        }
        tokio::time::sleep_until(st.next_try.into()).await;
        match Client::dial(&self.opts).await {
            Ok(c) => {
                eprintln!("weft: connected to {} at {}", self.what, self.opts.node);
                let c = Arc::new(c);
                st.client = Some(c.clone());
                st.backoff = REDIAL_BACKOFF.0;
                Ok(c)
            }
            Err(f) => {
                st.next_try = Instant::now() + st.backoff;
                st.backoff = (st.backoff * 2).min(REDIAL_BACKOFF.1);
                Err(Failure::new(
                    f.status,
                    format!(
                        "{} at {} is unreachable: {}",
                        self.what, self.opts.node, f.detail
                    ),
                ))
            }
        }
    }

    /// Typed call through the live link (see [`Client::call`]).
    pub async fn call<Req, Resp>(
        &self,
        addr: &Address,
        req: Req,
        tx: Option<TxContext>,
    ) -> Result<Resp, Failure>
    where
        Req: Serialize + Send + 'static,
        Resp: DeserializeOwned + Send + 'static,
    {
        self.client().await?.call(addr, req, tx).await
    }

    /// Closes the link.
    pub async fn close(&self) {
        if let Some(c) = self.state.lock().await.client.take() {
            c.ep.shutdown().await;
        }
    }
}

/// The exit code for an error: that of the first failure status in its
/// chain, 1 when it carries none.
pub fn exit_code_of(e: &anyhow::Error) -> i32 {
    e.chain()
        .find_map(|c| c.downcast_ref::<Failure>())
        .map(|f| exit_code(f.status))
        .unwrap_or(1)
}

/// The process exit code for a failure status (so scripts can tell them
/// apart): 2 for usage-like errors, 3 for dead peers, 4 for aborts and
/// conflicts, 1 otherwise.
pub fn exit_code(status: Status) -> i32 {
    match status {
        Status::BadRequest | Status::AddrError | Status::NoSuchService | Status::Mismatch => 2,
        Status::HostDead | Status::ProcDead | Status::TimedOut => 3,
        Status::Aborted | Status::LockConflict | Status::NoSuchTransaction | Status::InDoubt => 4,
        Status::WrongSecret | Status::Refused => 5,
        _ => 1,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failure_anywhere_in_the_chain_sets_the_exit_code() {
        let refused = anyhow::Error::new(Failure::new(Status::ProcDead, "connection refused"))
            .context("cannot connect to 127.0.0.1:1");
        assert_eq!(exit_code_of(&refused), 3);
        let secret = anyhow::Error::new(Failure::new(Status::WrongSecret, "no"))
            .context("a")
            .context("b");
        assert_eq!(exit_code_of(&secret), 5);
        assert_eq!(exit_code_of(&anyhow!("the audit failed")), 1);
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("250ms").unwrap(), Duration::from_millis(250));
        assert_eq!(parse_duration("2").unwrap(), Duration::from_secs(2));
        assert_eq!(parse_duration("1.5s").unwrap(), Duration::from_millis(1500));
        assert_eq!(parse_duration("2m").unwrap(), Duration::from_secs(120));
        assert!(parse_duration("fast").is_err());
        assert!(parse_duration("3 weeks").is_err());
        assert!(parse_duration("-1s").is_err());
    }
}
