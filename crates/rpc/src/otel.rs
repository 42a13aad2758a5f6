//! Trace context of transactions for OpenTelemetry (feature `otel`): the
//! spans of one transaction on every node form one trace.
//!
//! A call that carries a transaction context puts its own span's context in
//! the context's baggage under [`TRACE_KEY`] (W3C `traceparent` text); the
//! callee takes it out before anything else sees the baggage and makes it
//! the parent of its `serve` span. A span with no traced parent (no span of
//! the application around the transaction, or a peer without this feature)
//! joins the trace derived from the Tid, which every node computes alike, so
//! the transaction is still one trace.
//!
//! Owns the baggage key (the derivation and the `traceparent` forms are
//! `weft_tx::otel`'s, shared with the commit protocol's spans). Must never change what a call
//! does: without an OpenTelemetry layer installed every function here is a
//! no-op, and a malformed entry is ignored. Wire compatible: the entry is an
//! ordinary baggage item, which a node without this feature carries along
//! like any other.

use opentelemetry::trace::TraceContextExt;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use weft_tx::otel::{format, parent, parse};
pub use weft_tx::otel::{root, tid_span_context};
use weft_wire::{Baggage, Tid, TxContext};

/// The baggage key of a call's trace context.
pub const TRACE_KEY: &str = "weft.traceparent";

/// Makes `span` (a call out, not entered yet) a span of the transaction's
/// trace and writes its context into the baggage the call carries.
pub fn inject(span: &tracing::Span, tid: Tid, baggage: &mut Baggage) {
    if span.is_disabled() {
        return;
    }
    root(span, tid);
    let cx = span.context();
    let sc = cx.span().span_context().clone();
    if sc.is_valid() {
        baggage.set(TRACE_KEY, format(&sc).into_bytes().into());
    }
}

/// Takes the caller's trace context out of `ctx` (so it is never merged
/// into this node's baggage) and makes it the parent of `span` (a serve,
/// not entered yet); without one, the transaction's derived trace.
pub fn extract(span: &tracing::Span, ctx: &mut TxContext) {
    let carried = ctx.baggage.get(TRACE_KEY).and_then(|v| parse(v));
    ctx.baggage.0.retain(|i| i.key != TRACE_KEY);
    if span.is_disabled() {
        return;
    }
    let sc = carried.unwrap_or_else(|| tid_span_context(ctx.tid));
    let _ = span.set_parent(parent(sc));
}

#[cfg(test)]
mod tests {
    use super::*;
    use weft_wire::{Incarnation, NodeId};

    #[test]
    fn extract_removes_the_entry_without_a_layer() {
        let tid = Tid {
            node: NodeId(1),
            incarnation: Incarnation(1),
            seq: 1,
        };
        let mut ctx = TxContext::new(tid);
        ctx.baggage.set(
            TRACE_KEY,
            format(&tid_span_context(tid)).into_bytes().into(),
        );
        ctx.baggage.set("other", bytes::Bytes::from_static(b"kept"));
        extract(&tracing::Span::none(), &mut ctx);
        assert_eq!(ctx.baggage.get(TRACE_KEY), None);
        assert!(ctx.baggage.get("other").is_some());
    }
}
