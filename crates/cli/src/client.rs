//! Talking to a running node from the command line: a client link (not a
//! cluster member) to one node, which relays calls to the others.
//!
//! Owns connection options (address, secret) and typed calls. Must never
//! join the cluster.

use std::net::{SocketAddr, ToSocketAddrs};
use std::time::{Duration, Instant};

use anyhow::{anyhow, Context};
use serde::de::DeserializeOwned;
use serde::Serialize;
use weft_transport::{Endpoint, TransportConfig};
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
}

impl Client {
    /// Connects and authenticates.
    pub async fn connect(opts: &ClientOpts) -> anyhow::Result<Client> {
        let addr = resolve(&opts.node)?;
        let cfg = TransportConfig {
            secret: opts.secret.as_bytes().to_vec(),
            connect_timeout: opts.timeout.min(Duration::from_secs(5)),
            ..TransportConfig::client(Incarnation(std::process::id()))
        };
        let ep = Endpoint::connect_client(cfg, addr)
            .await
            .map_err(|f| anyhow!("cannot connect to {addr}: {f}"))?;
        let gateway = ep
            .gateway()
            .ok_or_else(|| anyhow!("connected to {addr} but no node answered"))?;
        Ok(Client {
            ep,
            gateway,
            timeout: opts.timeout,
        })
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
            .await?;
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
