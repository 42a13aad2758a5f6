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
//! Owns the baggage key and the derivation. Must never change what a call
//! does: without an OpenTelemetry layer installed every function here is a
//! no-op, and a malformed entry is ignored. Wire compatible: the entry is an
//! ordinary baggage item, which a node without this feature carries along
//! like any other.

use opentelemetry::trace::{SpanContext, SpanId, TraceContextExt, TraceFlags, TraceId, TraceState};
use opentelemetry::Context;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use weft_wire::{Baggage, Tid, TxContext};

/// The baggage key of a call's trace context.
pub const TRACE_KEY: &str = "weft.traceparent";

/// 64-bit FNV-1a of `bytes`, started from `seed`.
fn fnv(seed: u64, bytes: &[u8]) -> u64 {
    let mut h = seed;
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// The trace (and root span) every node derives for `tid`.
pub fn tid_span_context(tid: Tid) -> SpanContext {
    let mut key = Vec::with_capacity(16);
    key.extend_from_slice(&tid.node.0.to_le_bytes());
    key.extend_from_slice(&tid.incarnation.0.to_le_bytes());
    key.extend_from_slice(&tid.seq.to_le_bytes());
    let hi = fnv(0xcbf2_9ce4_8422_2325, &key);
    let lo = fnv(0x6c62_272e_07bb_0142, &key);
    let span = fnv(0x8422_2325_cbf2_9ce4, &key) | 1; // never the invalid 0
    let trace = (u128::from(hi) << 64 | u128::from(lo)).max(1);
    SpanContext::new(
        TraceId::from(trace),
        SpanId::from(span),
        TraceFlags::SAMPLED,
        true,
        TraceState::default(),
    )
}

fn parent(sc: SpanContext) -> Context {
    Context::new().with_remote_span_context(sc)
}

/// `traceparent` text of a span context.
fn format(sc: &SpanContext) -> String {
    format!(
        "00-{}-{}-{:02x}",
        sc.trace_id(),
        sc.span_id(),
        sc.trace_flags().to_u8()
    )
}

/// Parses `traceparent` text; `None` unless well formed and valid.
fn parse(text: &[u8]) -> Option<SpanContext> {
    let text = std::str::from_utf8(text).ok()?;
    let mut parts = text.split('-');
    let (version, trace, span, flags) =
        (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
    if version != "00" || parts.next().is_some() || trace.len() != 32 || span.len() != 16 {
        return None;
    }
    let trace = TraceId::from_hex(trace).ok()?;
    let span = SpanId::from_hex(span).ok()?;
    let flags = u8::from_str_radix(flags, 16).ok()?;
    let sc = SpanContext::new(
        trace,
        span,
        TraceFlags::new(flags),
        true,
        TraceState::default(),
    );
    sc.is_valid().then_some(sc)
}

/// True when the current span belongs to a trace.
fn in_a_trace() -> bool {
    tracing::Span::current()
        .context()
        .span()
        .span_context()
        .is_valid()
}

/// Roots `span` (not entered yet) in the trace of `tid` unless the current
/// span is traced already. For spans of a transaction that begin on this
/// node (a call out, a commit).
pub fn root(span: &tracing::Span, tid: Tid) {
    if span.is_disabled() || in_a_trace() {
        return;
    }
    let _ = span.set_parent(parent(tid_span_context(tid)));
}

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
    fn traceparent_round_trips_and_junk_is_ignored() {
        let tid = Tid {
            node: NodeId(3),
            incarnation: Incarnation(2),
            seq: 99,
        };
        let sc = tid_span_context(tid);
        assert!(sc.is_valid());
        assert_eq!(parse(format(&sc).as_bytes()), Some(sc.clone()));
        // Every node derives the same trace for a Tid, another Tid another.
        assert_eq!(tid_span_context(tid), sc);
        let other = Tid { seq: 100, ..tid };
        assert_ne!(tid_span_context(other).trace_id(), sc.trace_id());
        for junk in [
            &b""[..],
            b"00-zz-11-01",
            b"01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            b"00-00000000000000000000000000000000-b7ad6b7169203331-01",
            b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-x",
            b"\xff\xfe",
        ] {
            assert_eq!(parse(junk), None, "{junk:?}");
        }
    }

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
