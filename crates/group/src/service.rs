//! The group layer inside a weft node, and from outside it: [`GroupPlugin`]
//! starts a node's [`Groups`] runtime and registers the `_group` service,
//! through which [`GroupClient`] (the `weft group` command) creates,
//! destroys, lists, sends to and listens on groups without joining the
//! cluster.
//!
//! A client never sends a group secret: it fetches the group's salt, derives
//! the key itself and sends the key (creation sends the salted verifier).
//! A client listening on a group holds a lease on a member at the node it
//! talks to; if it stops polling, the lease expires and the member is
//! dropped (a process death: ProcDead for communications waiting on it).
//!
//! Owns the `_group` request and reply types. Must never bypass the
//! runtime: the service drives [`Groups`] exactly as a program would.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use weft_rpc::{Plugin, Rpc, ServiceOptions};
use weft_transport::{Endpoint, TransportConfig};
use weft_wire::{Failure, GroupId, Incarnation, NodeId, Payload, Request, ServiceName, Status};

use crate::config::GroupConfig;
use crate::core::origin::Delivery;
use crate::ids::{MemberId, SenderId, Tag};
use crate::runtime::{Credential, GroupInfo, Groups, Incoming, Member};
use crate::secret::{GroupKey, Verifier};

/// Name of the group administration service.
pub const GROUP_SERVICE: &str = "_group";

/// How long a listening client's member lives without a poll.
pub const LISTEN_LEASE: Duration = Duration::from_secs(30);

/// Longest a single `Next` poll waits.
pub const MAX_POLL: Duration = Duration::from_secs(10);

/// Messages a listening session holds for replies before refusing more.
const MAX_HELD: usize = 1024;

/// Requests of `_group`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum AdminRequest {
    /// The salt and check of a group's secret (to derive its key).
    Verifier {
        /// The group.
        gid: GroupId,
    },
    /// Create a group.
    Create {
        /// The group.
        gid: GroupId,
        /// Its secret's verifier (computed by the client).
        verifier: Verifier,
    },
    /// Destroy a group.
    Destroy {
        /// The group.
        gid: GroupId,
        /// Derived from the secret.
        key: GroupKey,
    },
    /// Every group (from the directory; the node's cache when
    /// `cached_only`).
    List {
        /// Skip the directory.
        cached_only: bool,
    },
    /// Send a message and collect replies.
    Send {
        /// The group.
        gid: GroupId,
        /// Tag for selective receives.
        tag: u32,
        /// The message bytes.
        body: Vec<u8>,
        /// Replies wanted (all delivered members when `None`).
        replies: Option<u32>,
        /// How long to wait for replies, in milliseconds.
        timeout_ms: u64,
    },
    /// Become a member of a group (a leased member at the answering node).
    Listen {
        /// The group.
        gid: GroupId,
        /// Derived from the secret.
        key: GroupKey,
    },
    /// Wait for the next message of a listening session.
    Next {
        /// The session.
        session: u64,
        /// How long to wait, in milliseconds (at most [`MAX_POLL`]).
        wait_ms: u64,
    },
    /// Reply to a message a session received.
    Reply {
        /// The session.
        session: u64,
        /// The message (as numbered by `Next`).
        message: u64,
        /// The reply bytes.
        body: Vec<u8>,
    },
    /// Leave the group and end the session.
    Unlisten {
        /// The session.
        session: u64,
        /// Derived from the secret.
        key: GroupKey,
    },
}

/// One reply collected by `Send`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplyReport {
    /// The member that replied.
    pub from: MemberId,
    /// Its reply.
    pub body: Vec<u8>,
}

/// What `Send` did.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SendReport {
    /// Members the message was delivered to.
    pub delivered: usize,
    /// Members whose queue was full, and nodes not reached.
    pub delivery: Delivery,
    /// Replies, in arrival order.
    pub replies: Vec<ReplyReport>,
    /// Members that will never reply, with why.
    pub failures: Vec<(String, Status)>,
    /// How the communication ended: Ok when every wanted reply came (or none
    /// was wanted), else TimedOut, NoMembers, NoBuffer...
    pub status: Status,
    /// Explanation of `status`.
    pub detail: String,
}

/// A message delivered to a listening session.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ListenedMessage {
    /// Its number in the session (to reply to it).
    pub id: u64,
    /// The group.
    pub gid: GroupId,
    /// The sender.
    pub sender: SenderId,
    /// The tag.
    pub tag: u32,
    /// The message bytes (a typed value's encoding).
    pub body: Vec<u8>,
}

/// Replies of `_group`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum AdminReply {
    /// A group's verifier.
    Verifier(Verifier),
    /// Done.
    Done,
    /// The groups.
    List(Vec<GroupInfo>),
    /// A send's report.
    Sent(SendReport),
    /// A listening session started.
    Listening {
        /// The session.
        session: u64,
        /// The member it holds.
        member: MemberId,
    },
    /// The next message (`None` when the wait ended first).
    Message(Option<ListenedMessage>),
}

struct Session {
    member: Member,
    gid: GroupId,
    last: Mutex<Instant>,
    held: Mutex<HashMap<u64, Incoming>>,
    next: AtomicU64,
}

#[derive(Default)]
struct Sessions {
    map: Mutex<HashMap<u64, Arc<Session>>>,
    next: AtomicU64,
}

impl Sessions {
    fn get(&self, id: u64) -> Result<Arc<Session>, Failure> {
        let s = self.map.lock().get(&id).cloned().ok_or_else(|| {
            Failure::new(
                Status::NoComm,
                format!("no listening session {id} (expired?)"),
            )
        })?;
        *s.last.lock() = Instant::now();
        Ok(s)
    }

    fn expire(&self, lease: Duration) {
        let now = Instant::now();
        self.map
            .lock()
            .retain(|_, s| now.saturating_duration_since(*s.last.lock()) < lease);
    }
}

/// Runs a node's group layer: starts [`Groups`] when the node opens its
/// services and registers `_group`. Keep the `Arc` to reach the runtime with
/// [`GroupPlugin::groups`].
pub struct GroupPlugin {
    cfg: GroupConfig,
    groups: OnceLock<Groups>,
    sessions: Arc<Sessions>,
}

impl GroupPlugin {
    /// A plugin with this configuration.
    pub fn new(cfg: GroupConfig) -> Arc<GroupPlugin> {
        Arc::new(GroupPlugin {
            cfg,
            groups: OnceLock::new(),
            sessions: Arc::new(Sessions::default()),
        })
    }

    /// The node's group runtime, once the node started.
    pub fn groups(&self) -> Option<Groups> {
        self.groups.get().cloned()
    }
}

impl Plugin for GroupPlugin {
    fn name(&self) -> &str {
        "group"
    }

    fn serve(&self, rpc: &Rpc) -> Result<(), Failure> {
        let groups = Groups::start(
            rpc.endpoint().clone(),
            Some(rpc.tm().clone()),
            self.cfg.clone(),
        )?;
        install(rpc, &groups, self.sessions.clone())?;
        let _ = self.groups.set(groups);
        Ok(())
    }
}

/// Registers `_group` on `rpc` for `groups` (what [`GroupPlugin`] does).
///
/// Fails when the service is already registered.
pub fn install_service(rpc: &Rpc, groups: &Groups) -> Result<(), Failure> {
    install(rpc, groups, Arc::new(Sessions::default()))
}

fn install(rpc: &Rpc, groups: &Groups, sessions: Arc<Sessions>) -> Result<(), Failure> {
    let weak = Arc::downgrade(&sessions);
    tokio::spawn(async move {
        let mut ticker = tokio::time::interval(Duration::from_secs(1));
        loop {
            ticker.tick().await;
            let Some(s) = weak.upgrade() else { return };
            s.expire(LISTEN_LEASE);
        }
    });
    let groups = groups.clone();
    rpc.register(
        GROUP_SERVICE,
        ServiceOptions::no_state(),
        move |_ctx, req: AdminRequest| {
            let groups = groups.clone();
            let sessions = sessions.clone();
            async move { serve(&groups, &sessions, req).await }
        },
    )
}

async fn serve(
    groups: &Groups,
    sessions: &Sessions,
    req: AdminRequest,
) -> Result<AdminReply, Failure> {
    match req {
        AdminRequest::Verifier { gid } => Ok(AdminReply::Verifier(groups.verifier(&gid).await?)),
        AdminRequest::Create { gid, verifier } => {
            groups.create_verified(&gid, verifier).await?;
            Ok(AdminReply::Done)
        }
        AdminRequest::Destroy { gid, key } => {
            groups.destroy_with(&gid, Credential::Key(key)).await?;
            Ok(AdminReply::Done)
        }
        AdminRequest::List { cached_only } => Ok(AdminReply::List(if cached_only {
            groups.cached()
        } else {
            groups.list().await?
        })),
        AdminRequest::Send {
            gid,
            tag,
            body,
            replies,
            timeout_ms,
        } => Ok(AdminReply::Sent(
            send_and_collect(
                groups,
                &gid,
                Tag(tag),
                body,
                replies,
                Duration::from_millis(timeout_ms),
            )
            .await,
        )),
        AdminRequest::Listen { gid, key } => {
            let member = groups.member()?;
            member.join_with(&gid, Credential::Key(key)).await?;
            let id = sessions.next.fetch_add(1, Ordering::Relaxed) + 1;
            let mid = member.id();
            sessions.map.lock().insert(
                id,
                Arc::new(Session {
                    member,
                    gid,
                    last: Mutex::new(Instant::now()),
                    held: Mutex::new(HashMap::new()),
                    next: AtomicU64::new(1),
                }),
            );
            Ok(AdminReply::Listening {
                session: id,
                member: mid,
            })
        }
        AdminRequest::Next { session, wait_ms } => {
            let s = sessions.get(session)?;
            let wait = Duration::from_millis(wait_ms).min(MAX_POLL);
            let deadline = tokio::time::Instant::now() + wait;
            loop {
                let got = tokio::time::timeout_at(deadline, s.member.recv(&s.gid, None)).await;
                let mut incoming = match got {
                    Err(_) => return Ok(AdminReply::Message(None)),
                    Ok(Err(f)) if f.status == Status::NoComm => continue,
                    Ok(Err(f)) => return Err(f),
                    Ok(Ok(i)) => i,
                };
                let body = incoming
                    .take_payload()
                    .map(|p| p.into_bytes().map(|b| b.to_vec()))
                    .transpose()
                    .map_err(|e| Failure::new(Status::Mismatch, e.to_string()))?
                    .unwrap_or_default();
                let id = s.next.fetch_add(1, Ordering::Relaxed);
                let msg = ListenedMessage {
                    id,
                    gid: incoming.gid().clone(),
                    sender: incoming.sender(),
                    tag: incoming.tag().0,
                    body,
                };
                let mut held = s.held.lock();
                if held.len() >= MAX_HELD {
                    held.clear(); // never replied to: forget the oldest batch
                }
                held.insert(id, incoming);
                return Ok(AdminReply::Message(Some(msg)));
            }
        }
        AdminRequest::Reply {
            session,
            message,
            body,
        } => {
            let s = sessions.get(session)?;
            let reply = {
                let held = s.held.lock().remove(&message).ok_or_else(|| {
                    Failure::new(
                        Status::Mismatch,
                        format!("session {session} holds no message {message}"),
                    )
                })?;
                held.reply(Payload::bytes(body))
            };
            reply.await?;
            Ok(AdminReply::Done)
        }
        AdminRequest::Unlisten { session, key } => {
            let s = sessions.get(session)?;
            s.member.leave_with(&s.gid, Credential::Key(key)).await?;
            sessions.map.lock().remove(&session);
            Ok(AdminReply::Done)
        }
    }
}

/// Sends `body` to `gid` from a fresh sender, lowers the replies wanted to
/// `replies` and collects them until `timeout`.
pub async fn send_and_collect(
    groups: &Groups,
    gid: &GroupId,
    tag: Tag,
    body: Vec<u8>,
    replies: Option<u32>,
    timeout: Duration,
) -> SendReport {
    let sender = groups.sender();
    let mut report = SendReport {
        delivered: 0,
        delivery: Delivery::default(),
        replies: Vec::new(),
        failures: Vec::new(),
        status: Status::Ok,
        detail: String::new(),
    };
    let sent = sender.send_tagged(gid, tag, Payload::bytes(body)).await;
    report.delivery = sender.delivery(gid).unwrap_or_default();
    match sent {
        Err(f) => {
            report.status = f.status;
            report.detail = f.detail;
            return report;
        }
        Ok(n) => report.delivered = n,
    }
    if let Some(r) = replies {
        if let Err(f) = sender.set_replies(gid, r as usize) {
            report.status = f.status;
            report.detail = f.detail;
            return report;
        }
        if r == 0 {
            report.detail = "no replies wanted".into();
            return report;
        }
    }
    let deadline = crate::runtime::deadline_after(Instant::now(), timeout);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match sender.next_reply(gid, left).await {
            Ok(r) => {
                let body = r
                    .payload
                    .into_bytes()
                    .map(|b| b.to_vec())
                    .unwrap_or_default();
                report.replies.push(ReplyReport { from: r.from, body });
            }
            Err(f) if f.status == Status::NoComm => {
                report.detail = format!("{} replies", report.replies.len());
                return report;
            }
            Err(f) if f.status == Status::TimedOut => {
                report.status = Status::TimedOut;
                report.detail = f.detail;
                return report;
            }
            Err(f) => report.failures.push((f.detail, f.status)),
        }
    }
}

/// A client of a node's `_group` service (the `weft group` command): not a
/// cluster member, it talks to one node that acts for it.
pub struct GroupClient {
    ep: Endpoint,
    node: NodeId,
    timeout: Duration,
}

impl GroupClient {
    /// Connects to the node at `addr` with the cluster `secret`; calls wait
    /// up to `timeout` (plus the time a send collects replies).
    ///
    /// Fails with WrongSecret for a wrong cluster secret, ProcDead/HostDead
    /// when the node cannot be reached.
    pub async fn connect(
        addr: SocketAddr,
        secret: &[u8],
        timeout: Duration,
    ) -> Result<GroupClient, Failure> {
        GroupClient::connect_tls(addr, secret, None, timeout).await
    }

    /// [`GroupClient::connect`] over mutual TLS when `tls` is given (the
    /// node must run TLS too; see `docs/tls.md`).
    ///
    /// Fails as [`GroupClient::connect`], or with Refused when either end
    /// refuses the other's TLS (or its lack).
    pub async fn connect_tls(
        addr: SocketAddr,
        secret: &[u8],
        tls: Option<weft_transport::TlsConfig>,
        timeout: Duration,
    ) -> Result<GroupClient, Failure> {
        let cfg = TransportConfig {
            secret: secret.to_vec(),
            tls,
            connect_timeout: timeout.min(Duration::from_secs(5)),
            ..TransportConfig::client(Incarnation(std::process::id()))
        };
        let ep = Endpoint::connect_client(cfg, addr).await?;
        let node = ep
            .gateway()
            .ok_or_else(|| Failure::new(Status::ProcDead, format!("no node answered at {addr}")))?;
        Ok(GroupClient { ep, node, timeout })
    }

    /// The node this client talks to.
    pub fn node(&self) -> NodeId {
        self.node
    }

    async fn call(&self, req: AdminRequest, extra: Duration) -> Result<AdminReply, Failure> {
        let request = Request {
            call_id: 0,
            service: ServiceName::new(GROUP_SERVICE)
                .map_err(|e| Failure::new(Status::Internal, e.to_string()))?,
            instance: 0,
            node: self.node,
            budget_us: None,
            tx: None,
            flags: 0,
            payload: Payload::local(req),
        };
        let deadline = Instant::now() + self.timeout + extra;
        let resp = self.ep.call(self.node, request, Some(deadline)).await?;
        if resp.status != Status::Ok {
            return Err(Failure::new(resp.status, resp.detail));
        }
        resp.payload
            .decode::<AdminReply>()
            .map_err(|e| Failure::new(Status::Mismatch, e.to_string()))
    }

    async fn key(&self, gid: &GroupId, secret: &str) -> Result<GroupKey, Failure> {
        match self
            .call(AdminRequest::Verifier { gid: gid.clone() }, Duration::ZERO)
            .await?
        {
            AdminReply::Verifier(v) => {
                let key = v.key_for(secret.as_bytes());
                if !v.verify_key(&key) {
                    return Err(Failure::new(
                        Status::WrongSecret,
                        format!("wrong secret for group {gid}"),
                    ));
                }
                Ok(key)
            }
            other => Err(bad_reply(&other)),
        }
    }

    /// Creates `gid` with `secret`.
    ///
    /// Fails like [`Groups::create`].
    pub async fn create(&self, gid: &GroupId, secret: &str) -> Result<(), Failure> {
        let verifier = Verifier::new(secret.as_bytes());
        self.call(
            AdminRequest::Create {
                gid: gid.clone(),
                verifier,
            },
            Duration::ZERO,
        )
        .await
        .map(|_| ())
    }

    /// Destroys `gid`.
    ///
    /// Fails like [`Groups::destroy`].
    pub async fn destroy(&self, gid: &GroupId, secret: &str) -> Result<(), Failure> {
        let key = self.key(gid, secret).await?;
        self.call(
            AdminRequest::Destroy {
                gid: gid.clone(),
                key,
            },
            Duration::ZERO,
        )
        .await
        .map(|_| ())
    }

    /// Every group (the node's cache when `cached_only`).
    ///
    /// Fails when the directory cannot be reached.
    pub async fn list(&self, cached_only: bool) -> Result<Vec<GroupInfo>, Failure> {
        match self
            .call(AdminRequest::List { cached_only }, Duration::ZERO)
            .await?
        {
            AdminReply::List(v) => Ok(v),
            other => Err(bad_reply(&other)),
        }
    }

    /// Sends `body` to `gid`, wanting `replies` replies (all when `None`)
    /// within `timeout`. The report carries the delivery count, the replies
    /// and the final status; a send that reached nobody is a report with
    /// that status, not an error.
    ///
    /// Fails only when the node cannot be asked.
    pub async fn send(
        &self,
        gid: &GroupId,
        tag: u32,
        body: Vec<u8>,
        replies: Option<u32>,
        timeout: Duration,
    ) -> Result<SendReport, Failure> {
        let req = AdminRequest::Send {
            gid: gid.clone(),
            tag,
            body,
            replies,
            timeout_ms: timeout.as_millis().min(u64::MAX as u128) as u64,
        };
        match self.call(req, timeout).await? {
            AdminReply::Sent(r) => Ok(r),
            other => Err(bad_reply(&other)),
        }
    }

    /// Joins `gid` through a leased member at the node; take messages with
    /// [`Listening::next`].
    ///
    /// Fails like [`Member::join`].
    pub async fn listen(&self, gid: &GroupId, secret: &str) -> Result<Listening<'_>, Failure> {
        let key = self.key(gid, secret).await?;
        match self
            .call(
                AdminRequest::Listen {
                    gid: gid.clone(),
                    key,
                },
                Duration::ZERO,
            )
            .await?
        {
            AdminReply::Listening { session, member } => Ok(Listening {
                client: self,
                session,
                member,
                key,
            }),
            other => Err(bad_reply(&other)),
        }
    }

    /// Closes the link.
    pub async fn close(self) {
        self.ep.shutdown().await;
    }
}

/// A listening session: a member at the node, held for this client.
pub struct Listening<'a> {
    client: &'a GroupClient,
    session: u64,
    member: MemberId,
    key: GroupKey,
}

impl Listening<'_> {
    /// The member the node holds for this session.
    pub fn member(&self) -> MemberId {
        self.member
    }

    /// The next message, waiting up to `wait` (at most [`MAX_POLL`];
    /// `None` when nothing came).
    ///
    /// Fails with NoComm when the session expired, or the node's status.
    pub async fn next(&self, wait: Duration) -> Result<Option<ListenedMessage>, Failure> {
        let wait = wait.min(MAX_POLL);
        let req = AdminRequest::Next {
            session: self.session,
            wait_ms: wait.as_millis() as u64,
        };
        match self.client.call(req, wait).await? {
            AdminReply::Message(m) => Ok(m),
            other => Err(bad_reply(&other)),
        }
    }

    /// Replies to message `message`.
    ///
    /// Fails like [`Incoming::reply`], Mismatch for an unknown message.
    pub async fn reply(&self, message: u64, body: Vec<u8>) -> Result<(), Failure> {
        let req = AdminRequest::Reply {
            session: self.session,
            message,
            body,
        };
        self.client.call(req, Duration::ZERO).await.map(|_| ())
    }

    /// Leaves the group and ends the session.
    ///
    /// Fails when the node cannot be asked (the lease then expires).
    pub async fn close(self) -> Result<(), Failure> {
        let req = AdminRequest::Unlisten {
            session: self.session,
            key: self.key,
        };
        self.client.call(req, Duration::ZERO).await.map(|_| ())
    }
}

fn bad_reply(r: &AdminReply) -> Failure {
    Failure::new(
        Status::ProtocolError,
        format!("unexpected answer from _group: {r:?}"),
    )
}
