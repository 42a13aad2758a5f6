//! Services: what a node offers under a name.
//!
//! Owns the registry entry of a service (name, instance, participation
//! class, the participant that takes part in commit, the handler). Must never
//! run a handler itself: dispatch is the call module's.

use std::sync::Arc;

use futures::future::BoxFuture;
use serde::{Deserialize, Serialize};
use weft_tx::{ParticipationClass, Resource};
use weft_wire::{Failure, Payload, ServiceName};

use crate::call::CallContext;

/// Handles the calls of one service.
pub trait Handler: Send + Sync + 'static {
    /// Serves one call. Returns the response payload, or a failure whose
    /// status travels back to the caller (AppError for application-level
    /// errors, BadRequest for undecodable requests...). A handler that
    /// panics, before or while its future runs, is answered Internal.
    fn call(
        &self,
        ctx: CallContext,
        payload: Payload,
    ) -> BoxFuture<'static, Result<Payload, Failure>>;
}

impl<F> Handler for F
where
    F: Fn(CallContext, Payload) -> BoxFuture<'static, Result<Payload, Failure>>
        + Send
        + Sync
        + 'static,
{
    fn call(
        &self,
        ctx: CallContext,
        payload: Payload,
    ) -> BoxFuture<'static, Result<Payload, Failure>> {
        self(ctx, payload)
    }
}

/// How a service is registered.
#[derive(Clone)]
pub struct ServiceOptions {
    /// The server instance (default 0).
    pub instance: u32,
    /// How the service takes part in the end of transactions.
    pub class: ParticipationClass,
    /// The participant told about the end of transactions that called the
    /// service: required for one-phase and two-phase services.
    pub participant: Option<Arc<dyn Resource>>,
}

impl ServiceOptions {
    /// A stateless service (instance 0): never contacted at the end.
    pub fn no_state() -> Self {
        ServiceOptions {
            instance: 0,
            class: ParticipationClass::NoState,
            participant: None,
        }
    }

    /// A service whose `participant` takes part in the end of transactions
    /// with the participant's own class.
    pub fn with_participant(participant: Arc<dyn Resource>) -> Self {
        ServiceOptions {
            instance: 0,
            class: participant.class(),
            participant: Some(participant),
        }
    }

    /// The same options for another instance.
    pub fn instance(mut self, instance: u32) -> Self {
        self.instance = instance;
        self
    }
}

/// A registered service.
pub(crate) struct Service {
    pub(crate) name: ServiceName,
    pub(crate) instance: u32,
    pub(crate) class: ParticipationClass,
    pub(crate) participant: Option<Arc<dyn Resource>>,
    pub(crate) handler: Arc<dyn Handler>,
    /// `weft_rpc_calls_total{service=<name>,status="Ok",channel}` by
    /// channel, registered at the first such call while exporting and kept:
    /// counting a call answered Ok then builds no label and looks up no key.
    pub(crate) served_ok: [std::sync::OnceLock<metrics::Counter>; 3],
}

/// A service as listed by `weft status`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServiceInfo {
    /// The service name.
    pub name: String,
    /// The instance.
    pub instance: u32,
    /// Its participation class.
    pub class: ParticipationClass,
}
