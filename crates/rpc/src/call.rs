//! Calls: the caller side (typed and raw calls carrying the transaction
//! context) and the callee side (dispatch to services, joining the caller's
//! transaction, relaying for clients).
//!
//! Owns the mapping between a call and the participant tree: an outgoing call
//! under T makes the callee a child of this node in T; an incoming one makes
//! this node a participant of T. Must never hold a lock across a handler or a
//! transport call, nor let a handler's panic escape: a handler runs inline
//! on the transport's receive path (and, in process, on the caller's own
//! thread), so a panic is caught where it is polled and answered Internal.

use rustc_hash::FxBuildHasher;
use std::any::Any;
use std::collections::HashMap;
use std::future::Future;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::pin::Pin;
use std::sync::{Arc, Weak};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use parking_lot::RwLock;
use serde::de::DeserializeOwned;
use serde::Serialize;
use tracing::Instrument;
use weft_transport::{Endpoint, PeerRef, RequestHandler, Responder};
use weft_tx::{ParticipationClass, Resource, TxManager};
use weft_wire::{
    Address, Failure, NodeId, Payload, PeerRole, Request, Response, ServiceName, Status, Tid,
    TxContext,
};

use crate::service::{Handler, Service, ServiceInfo, ServiceOptions};
use crate::transaction::Transaction;

/// Configuration of the RPC layer.
#[derive(Clone, Debug)]
pub struct RpcConfig {
    /// Deadline of a call made without one (bounded further by its
    /// transaction's deadline).
    pub default_timeout: Duration,
}

impl Default for RpcConfig {
    fn default() -> Self {
        RpcConfig {
            default_timeout: Duration::from_secs(10),
        }
    }
}

struct RpcInner {
    endpoint: Endpoint,
    tm: TxManager,
    cfg: RpcConfig,
    services: RwLock<ServiceTable>,
}

/// The services of a node by name, then instance: a request's name looks its
/// service up without being cloned into a key. Hashed with FxHash: the keys
/// are names this node registered (a caller's name can only miss), and
/// SipHash cost a twentieth of a same-host call.
type ServiceTable = HashMap<ServiceName, HashMap<u32, Arc<Service>, FxBuildHasher>, FxBuildHasher>;

/// A node's RPC layer: its services and its calls. Cheap to clone.
#[derive(Clone)]
pub struct Rpc {
    inner: Arc<RpcInner>,
}

/// What a handler knows about the call it serves, and how it calls others on
/// behalf of the same transaction.
#[derive(Clone)]
pub struct CallContext {
    rpc: Rpc,
    caller: PeerRef,
    tx: Option<TxContext>,
    deadline: Option<Instant>,
}

impl CallContext {
    /// Who called.
    pub fn caller(&self) -> PeerRef {
        self.caller
    }

    /// The caller's transaction context, if the call was made on behalf of a
    /// transaction.
    pub fn tx(&self) -> Option<&TxContext> {
        self.tx.as_ref()
    }

    /// The transaction id, if any.
    pub fn tid(&self) -> Option<Tid> {
        self.tx.as_ref().map(|t| t.tid)
    }

    /// When the caller gives up.
    pub fn deadline(&self) -> Option<Instant> {
        self.deadline
    }

    /// The node's RPC layer (to make calls outside the transaction).
    pub fn rpc(&self) -> &Rpc {
        &self.rpc
    }

    /// Calls another service on behalf of the same transaction (and within
    /// this call's deadline): the callee becomes this node's child in it.
    ///
    /// Fails like [`Rpc::call`].
    pub async fn call<Req, Resp>(&self, addr: &Address, request: Req) -> Result<Resp, Failure>
    where
        Req: Serialize + Send + 'static,
        Resp: DeserializeOwned + Send + 'static,
    {
        let payload = self
            .rpc
            .call_payload(
                self.tx.as_ref(),
                addr,
                Payload::local(request),
                self.deadline,
            )
            .await?;
        decode_response(addr, payload)
    }

    /// Aborts the caller's transaction from inside a handler (any participant
    /// may). No effect without a transaction.
    pub async fn abort(&self, reason: &str) {
        if let Some(tx) = &self.tx {
            let _ = self.rpc.inner.tm.abort(tx.tid, reason).await;
        }
    }
}

fn decode_response<Resp: DeserializeOwned + Send + 'static>(
    addr: &Address,
    payload: Payload,
) -> Result<Resp, Failure> {
    payload.decode::<Resp>().map_err(|e| {
        Failure::new(
            Status::Mismatch,
            format!("response of {addr} is not the expected type: {e}"),
        )
    })
}

/// Whole microseconds from `now` until `deadline` (0 once past).
fn micros_until(deadline: Instant, now: Instant) -> u64 {
    deadline
        .saturating_duration_since(now)
        .as_micros()
        .min(u64::MAX as u128) as u64
}

impl Rpc {
    /// Creates the RPC layer of a node and installs it as the endpoint's
    /// request handler. Registers the built-in `echo` service.
    pub fn new(endpoint: Endpoint, tm: TxManager, cfg: RpcConfig) -> Rpc {
        let rpc = Rpc {
            inner: Arc::new(RpcInner {
                endpoint: endpoint.clone(),
                tm,
                cfg,
                services: RwLock::new(HashMap::default()),
            }),
        };
        endpoint.set_request_handler(Arc::new(Dispatch(Arc::downgrade(&rpc.inner))));
        rpc.register_raw("echo", ServiceOptions::no_state(), |_ctx, payload| {
            let fut: BoxFuture<'static, Result<Payload, Failure>> =
                Box::pin(async move { Ok(payload) });
            fut
        })
        .expect("echo registers on a fresh node");
        rpc
    }

    /// The node's transport endpoint.
    pub fn endpoint(&self) -> &Endpoint {
        &self.inner.endpoint
    }

    /// The node's transaction manager.
    pub fn tm(&self) -> &TxManager {
        &self.inner.tm
    }

    /// This node's id.
    pub fn node_id(&self) -> NodeId {
        self.inner.endpoint.node_id()
    }

    /// Registers an untyped service.
    ///
    /// Fails with BadRequest for an invalid name, a one- or two-phase class
    /// without a participant, or a name and instance already registered.
    pub fn register_raw(
        &self,
        name: &str,
        opts: ServiceOptions,
        handler: impl Handler,
    ) -> Result<(), Failure> {
        let name =
            ServiceName::new(name).map_err(|e| Failure::new(Status::BadRequest, e.to_string()))?;
        if opts.class != ParticipationClass::NoState && opts.participant.is_none() {
            return Err(Failure::new(
                Status::BadRequest,
                format!("a {} service needs a participant", opts.class),
            ));
        }
        {
            let mut services = self.inner.services.write();
            let instances = services.entry(name.clone()).or_default();
            if instances.contains_key(&opts.instance) {
                return Err(Failure::new(
                    Status::BadRequest,
                    format!("service {name}.{} is already registered", opts.instance),
                ));
            }
            instances.insert(
                opts.instance,
                Arc::new(Service {
                    name,
                    instance: opts.instance,
                    class: opts.class,
                    participant: opts.participant,
                    handler: Arc::new(handler),
                    served_ok: Default::default(),
                }),
            );
        }
        self.advertise();
        Ok(())
    }

    /// Registers a typed service: requests are decoded as `Req` (a local
    /// value is passed as is) and responses encoded from `Resp` only when
    /// they leave the process.
    ///
    /// Fails like [`Rpc::register_raw`].
    pub fn register<Req, Resp, F, Fut>(
        &self,
        name: &str,
        opts: ServiceOptions,
        f: F,
    ) -> Result<(), Failure>
    where
        Req: DeserializeOwned + Send + 'static,
        Resp: Serialize + Send + 'static,
        F: Fn(CallContext, Req) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Resp, Failure>> + Send + 'static,
    {
        let f = Arc::new(f);
        let svc = name.to_string();
        self.register_raw(name, opts, move |ctx: CallContext, payload: Payload| {
            let f = Arc::clone(&f);
            let svc = svc.clone();
            let fut: BoxFuture<'static, Result<Payload, Failure>> = Box::pin(async move {
                let req = payload.decode::<Req>().map_err(|e| {
                    Failure::new(Status::BadRequest, format!("bad request for {svc}: {e}"))
                })?;
                f(ctx, req).await.map(Payload::local)
            });
            fut
        })
    }

    /// Removes a service. Returns false if it was not registered.
    pub fn unregister(&self, name: &str, instance: u32) -> bool {
        let Ok(name) = ServiceName::new(name) else {
            return false;
        };
        let removed = {
            let mut services = self.inner.services.write();
            let removed = services
                .get_mut(&name)
                .and_then(|instances| instances.remove(&instance))
                .is_some();
            if services.get(&name).is_some_and(|i| i.is_empty()) {
                services.remove(&name);
            }
            removed
        };
        if removed {
            self.advertise();
        }
        removed
    }

    /// The services of this node.
    pub fn services(&self) -> Vec<ServiceInfo> {
        let mut v: Vec<ServiceInfo> = self
            .inner
            .services
            .read()
            .values()
            .flat_map(|instances| instances.values())
            .map(|s| ServiceInfo {
                name: s.name.to_string(),
                instance: s.instance,
                class: s.class,
            })
            .collect();
        v.sort_by(|a, b| (&a.name, a.instance).cmp(&(&b.name, b.instance)));
        v
    }

    fn advertise(&self) {
        let names = self
            .inner
            .services
            .read()
            .iter()
            .flat_map(|(n, instances)| {
                instances.keys().map(move |i| {
                    if *i == 0 {
                        n.to_string()
                    } else {
                        format!("{n}.{i}")
                    }
                })
            })
            .collect();
        self.inner.endpoint.set_services(names);
    }

    /// Begins a transaction coordinated by this node.
    pub fn begin(&self) -> Transaction {
        self.begin_with_timeout(None)
    }

    /// Begins a transaction that aborts if not committed within `timeout`.
    pub fn begin_with_timeout(&self, timeout: Option<Duration>) -> Transaction {
        let ctx = self.inner.tm.begin(timeout);
        Transaction::new(self.clone(), ctx)
    }

    /// Calls a service outside any transaction, with the default deadline.
    ///
    /// Fails with the callee's status (NoSuchService, BadRequest, AppError,
    /// ...), TimedOut at the deadline, HostDead/ProcDead when the node dies,
    /// AddrError for an unknown node, Mismatch when the response is not a
    /// `Resp`.
    pub async fn call<Req, Resp>(&self, addr: &Address, request: Req) -> Result<Resp, Failure>
    where
        Req: Serialize + Send + 'static,
        Resp: DeserializeOwned + Send + 'static,
    {
        let payload = self
            .call_payload(None, addr, Payload::local(request), None)
            .await?;
        decode_response(addr, payload)
    }

    /// The untyped call every other call goes through: `tx` is the
    /// transaction to call on behalf of (the callee joins it), `deadline`
    /// when to give up (default: the configured timeout, never past the
    /// transaction's deadline).
    ///
    /// Fails like [`Rpc::call`], and with Aborted when the transaction is no
    /// longer active here.
    pub async fn call_payload(
        &self,
        tx: Option<&TxContext>,
        addr: &Address,
        payload: Payload,
        deadline: Option<Instant>,
    ) -> Result<Payload, Failure> {
        let inner = &self.inner;
        let now = Instant::now();
        // Without a deadline of its own the call gets the default timeout,
        // which is its budget too, until a transaction shortens it.
        let (mut deadline, mut budget_us) = match deadline {
            Some(d) => (d, micros_until(d, now)),
            None => (
                now + inner.cfg.default_timeout,
                inner.cfg.default_timeout.as_micros().min(u64::MAX as u128) as u64,
            ),
        };
        // The context sent is made under one look at the transaction: the
        // callee becomes a child, the baggage is this node's, and the budget
        // (a context's is relative to when it was made) is recomputed from
        // the transaction's deadline as this node knows it.
        #[cfg_attr(not(feature = "otel"), allow(unused_mut))]
        let mut ctx = match tx {
            Some(tx) => {
                let (ctx, tx_deadline) = inner.tm.call_out_context(tx, addr.node, now)?;
                if let Some(tx_deadline) = tx_deadline.filter(|d| *d < deadline) {
                    deadline = tx_deadline;
                    budget_us = micros_until(deadline, now);
                }
                Some(ctx)
            }
            None => None,
        };
        let tid = ctx.as_ref().map(|c| c.tid);
        let span = match tid {
            Some(t) => tracing::debug_span!("call", tid = %t, to = %addr),
            None => tracing::debug_span!("call", to = %addr),
        };
        #[cfg(feature = "otel")]
        if let Some(ctx) = ctx.as_mut() {
            crate::otel::inject(&span, ctx.tid, &mut ctx.baggage);
        }
        let request = Request {
            call_id: 0,
            service: addr.service.clone(),
            instance: addr.instance,
            node: addr.node,
            budget_us: Some(budget_us),
            tx: ctx.map(Box::new),
            flags: 0,
            payload,
        };
        let resp = inner
            .endpoint
            .call(addr.node, request, Some(deadline))
            .instrument(span)
            .await?;
        self.finish_call(tid, resp).await
    }

    async fn finish_call(&self, tid: Option<Tid>, resp: Response) -> Result<Payload, Failure> {
        if let (Some(tid), Some(ret)) = (tid, resp.tx.as_ref()) {
            if !ret.baggage.is_empty() {
                self.inner.tm.merge_baggage(tid, &ret.baggage);
            }
            if ret.aborted {
                let _ = self
                    .inner
                    .tm
                    .abort(tid, "a participant aborted the transaction")
                    .await;
            }
        }
        if resp.status == Status::Ok {
            Ok(resp.payload)
        } else {
            Err(Failure::new(resp.status, resp.detail))
        }
    }

    fn service(&self, name: &ServiceName, instance: u32) -> Option<Arc<Service>> {
        self.inner
            .services
            .read()
            .get(name)
            .and_then(|instances| instances.get(&instance))
            .cloned()
    }

    fn no_such_service(&self, name: &ServiceName, instance: u32) -> Failure {
        let have: Vec<String> = self.services().into_iter().map(|s| s.name).collect();
        Failure::new(
            Status::NoSuchService,
            format!(
                "no service {name}.{instance} at node {} (it has: {})",
                self.node_id(),
                have.join(", ")
            ),
        )
    }

    /// Serves one request: joins its transaction, runs the handler, builds
    /// the response.
    /// `served_by` is set to the service found, for the caller's count.
    async fn serve(
        self,
        from: PeerRef,
        req: Request,
        served_by: &mut Option<Arc<Service>>,
    ) -> Response {
        let deadline = req
            .budget_us
            .map(|us| Instant::now() + Duration::from_micros(us));
        let relay = from.role == PeerRole::Client && req.node != self.node_id();
        let service = if relay {
            None
        } else {
            self.service(&req.service, req.instance)
        };
        if !relay && service.is_none() {
            return Response::failure(0, self.no_such_service(&req.service, req.instance));
        }
        served_by.clone_from(&service);
        let participant: Option<(Arc<dyn Resource>, ParticipationClass)> = service
            .as_ref()
            .and_then(|s| s.participant.clone().map(|p| (p, s.class)));
        let guard = match &req.tx {
            Some(ctx) => match self.inner.tm.on_call_in(ctx, from, participant).await {
                Ok(g) => Some(g),
                Err(f) => return Response::failure(0, f),
            },
            None => None,
        };
        let result = if relay {
            // A client asked this node to call another: this node calls on
            // the client's behalf (and takes part in its transaction).
            let addr = Address {
                service: req.service.clone(),
                instance: req.instance,
                node: req.node,
            };
            self.call_payload(req.tx.as_deref(), &addr, req.payload, deadline)
                .await
        } else {
            let service = service.expect("checked above");
            let ctx = CallContext {
                rpc: self.clone(),
                caller: from,
                tx: req.tx.map(|ctx| *ctx),
                deadline,
            };
            let mut fut = run_handler(service, ctx, req.payload);
            // A handler ready at its first poll (an inline one) is answered
            // without arming the deadline's timer; one that must wait runs
            // under it.
            match std::future::poll_fn(|cx| Poll::Ready(Pin::new(&mut fut).poll(cx))).await {
                Poll::Ready(result) => result,
                Poll::Pending => match deadline {
                    Some(d) => tokio::time::timeout_at(d.into(), fut)
                        .await
                        .unwrap_or_else(|_| Err(handler_timed_out())),
                    None => fut.await,
                },
            }
        };
        let tx_return = guard.map(|g| Box::new(g.finish()));
        Response {
            tx: tx_return,
            ..plain_response(result)
        }
    }
}

/// The endpoint's request handler: dispatches to the RPC layer.
struct Dispatch(Weak<RpcInner>);

impl RequestHandler for Dispatch {
    #[cfg_attr(not(feature = "otel"), allow(unused_mut))]
    fn handle(&self, from: PeerRef, mut request: Request, responder: Responder) {
        let Some(inner) = self.0.upgrade() else {
            responder.fail(Failure::new(Status::ShuttingDown, "node is shutting down"));
            return;
        };
        let rpc = Rpc { inner };
        let relay = from.role == PeerRole::Client && request.node != rpc.node_id();
        if request.tx.is_none() && !relay {
            rpc.serve_plain(from, request, responder);
            return;
        }
        let span = match &request.tx {
            Some(t) => tracing::debug_span!(
                "serve",
                tid = %t.tid,
                service = %request.service,
                node = %rpc.node_id()
            ),
            None => tracing::debug_span!("serve", service = %request.service),
        };
        // A relayed call is counted by the node that serves it.
        let counted =
            (!relay && weft_transport::metrics::exporting()).then(|| request.service.clone());
        #[cfg(feature = "otel")]
        if let Some(ctx) = request.tx.as_deref_mut() {
            crate::otel::extract(&span, ctx);
        }
        let fut: Pin<Box<dyn Future<Output = ()> + Send>> = Box::pin(
            async move {
                let mut served_by = None;
                let resp = rpc.serve(from, request, &mut served_by).await;
                if let Some(name) = counted {
                    count_call(served_by.as_deref(), &name, resp.status, from.channel);
                }
                responder.respond(resp);
            }
            .instrument(span),
        );
        run_inline_then_spawn(fut);
    }
}

impl Rpc {
    /// Serves a request that carries no transaction and is not relayed, the
    /// common case, with what [`Rpc::serve`] does for it and nothing more:
    /// the handler's future is polled once right here and, when it is ready
    /// (an inline handler), answered at once; only a handler that must wait
    /// is spawned, under the call's deadline. No transaction means nothing to
    /// join and nothing to return but the payload or the status.
    fn serve_plain(self, from: PeerRef, req: Request, responder: Responder) {
        let span = tracing::debug_span!("serve", service = %req.service);
        let _entered = span.enter();
        let Some(service) = self.service(&req.service, req.instance) else {
            count_call(None, &req.service, Status::NoSuchService, from.channel);
            responder.respond(Response::failure(
                0,
                self.no_such_service(&req.service, req.instance),
            ));
            return;
        };
        let counted = weft_transport::metrics::exporting().then(|| service.clone());
        let deadline = req
            .budget_us
            .map(|us| Instant::now() + Duration::from_micros(us));
        let ctx = CallContext {
            rpc: self,
            caller: from,
            tx: None,
            deadline,
        };
        let mut fut = run_handler(service, ctx, req.payload);
        let mut cx = Context::from_waker(futures::task::noop_waker_ref());
        if let Poll::Ready(result) = Pin::new(&mut fut).poll(&mut cx) {
            let resp = plain_response(result);
            if let Some(service) = &counted {
                count_call(Some(service), &service.name, resp.status, from.channel);
            }
            responder.respond(resp);
            return;
        }
        drop(_entered);
        tokio::spawn(
            async move {
                let result = match deadline {
                    Some(d) => tokio::time::timeout_at(d.into(), fut)
                        .await
                        .unwrap_or_else(|_| Err(handler_timed_out())),
                    None => fut.await,
                };
                let resp = plain_response(result);
                if let Some(service) = &counted {
                    count_call(Some(service), &service.name, resp.status, from.channel);
                }
                responder.respond(resp);
            }
            .instrument(span),
        );
    }
}

/// Counts a served call in `weft_rpc_calls_total{service,status,channel}`
/// (docs/metrics.md), only while an exporter is installed: the service's
/// label is built from its name. A call to a service this node does not
/// have counts as `service="_unknown"`, so that a caller cannot grow the
/// registry by inventing names. `service` is the service that served it, if
/// any: a call it answered Ok is counted through the handle it keeps (one
/// atomic add, no label built, no key looked up), as most calls are.
fn count_call(
    service: Option<&Service>,
    name: &ServiceName,
    status: Status,
    channel: weft_transport::ChannelKind,
) {
    if !weft_transport::metrics::exporting() {
        return;
    }
    if let (Some(s), Status::Ok) = (service, status) {
        s.served_ok[channel as usize]
            .get_or_init(|| {
                metrics::counter!("weft_rpc_calls_total",
                    "service" => s.name.as_str().to_string(), "status" => "Ok",
                    "channel" => channel.name())
            })
            .increment(1);
        return;
    }
    let service = if status == Status::NoSuchService {
        "_unknown".to_string()
    } else {
        name.as_str().to_string()
    };
    metrics::counter!("weft_rpc_calls_total",
        "service" => service, "status" => status.name(), "channel" => channel.name())
    .increment(1);
}

/// The response carrying a handler's result, with no transaction return
/// (a transactional call adds its own).
fn plain_response(result: Result<Payload, Failure>) -> Response {
    match result {
        Ok(payload) => Response {
            call_id: 0,
            status: Status::Ok,
            detail: String::new(),
            tx: None,
            payload,
        },
        Err(f) => Response::failure(0, f),
    }
}

/// Starts `service`'s handler on a call, with its panics caught: one that
/// panics before it returns its future, or while it is polled, ends the call
/// with Internal instead of unwinding through the transport (or, in process,
/// through the caller).
fn run_handler(service: Arc<Service>, ctx: CallContext, payload: Payload) -> CatchPanic {
    let fut = catch_unwind(AssertUnwindSafe(|| service.handler.call(ctx, payload)));
    match fut {
        Ok(fut) => CatchPanic {
            fut: Some(fut),
            service,
        },
        Err(panic) => {
            let failure = handler_panicked(&service, panic);
            CatchPanic {
                fut: Some(Box::pin(std::future::ready(Err(failure)))),
                service,
            }
        }
    }
}

/// A handler's future whose panics become an Internal failure. Polled again
/// after it panicked (or finished) it answers Internal rather than touching
/// a future left in an unknown state.
struct CatchPanic {
    fut: Option<BoxFuture<'static, Result<Payload, Failure>>>,
    service: Arc<Service>,
}

impl Future for CatchPanic {
    type Output = Result<Payload, Failure>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let Some(fut) = self.fut.as_mut() else {
            return Poll::Ready(Err(Failure::new(
                Status::Internal,
                format!(
                    "the handler of {} was polled after it ended",
                    self.service.name
                ),
            )));
        };
        match catch_unwind(AssertUnwindSafe(|| fut.as_mut().poll(cx))) {
            Ok(Poll::Pending) => Poll::Pending,
            Ok(Poll::Ready(result)) => {
                self.fut = None;
                Poll::Ready(result)
            }
            Err(panic) => {
                // Its locals were dropped by the unwind; a drop that panics
                // again is caught too.
                let fut = self.fut.take();
                let _ = catch_unwind(AssertUnwindSafe(move || drop(fut)));
                Poll::Ready(Err(handler_panicked(&self.service, panic)))
            }
        }
    }
}

fn handler_panicked(service: &Service, panic: Box<dyn Any + Send>) -> Failure {
    let what = panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a non-string payload".to_string());
    tracing::error!(service = %service.name, instance = service.instance, panic = %what, "a service handler panicked");
    Failure::new(
        Status::Internal,
        format!(
            "the handler of {}.{} panicked: {what}",
            service.name, service.instance
        ),
    )
}

fn handler_timed_out() -> Failure {
    Failure::new(Status::TimedOut, "the handler ran past the deadline")
}

/// Polls a future once in the caller's context (direct control passing: a
/// handler that does not wait finishes without any task switch) and spawns
/// it if it must wait.
fn run_inline_then_spawn(mut fut: Pin<Box<dyn Future<Output = ()> + Send>>) {
    let mut cx = Context::from_waker(futures::task::noop_waker_ref());
    if fut.as_mut().poll(&mut cx).is_pending() {
        tokio::spawn(fut);
    }
}
