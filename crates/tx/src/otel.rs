//! Trace context of transactions for OpenTelemetry (feature `otel`): the
//! trace every node derives from a Tid, the `traceparent` forms of a span
//! context, and the spans of the commit protocol.
//!
//! A node that traces a transaction sends [`TxMsg::TracedPrepare`] instead
//! of Prepare, carrying the span that sent it (the coordinator's `commit`,
//! or a participant's own `tx.prepare` for its children). The receiver's
//! `tx.prepare` span (handling the Prepare) and `tx.outcome` span (handling
//! the Decision or the abort) are children of that span; without one (an
//! untraced sender, or a node without this feature), of the trace derived
//! from the Tid, which every node computes alike.
//!
//! Owns the derivation, the text and binary forms, and the per-transaction
//! table of carried contexts ([`Traces`]). Must never change what the
//! protocol does: without a tracing layer that records the transaction
//! manager's spans, every function here returns at the span's
//! `is_disabled` check and the table stays empty; a malformed context is
//! ignored.
//!
//! [`TxMsg::TracedPrepare`]: crate::TxMsg::TracedPrepare

use std::collections::HashMap;

use opentelemetry::trace::{SpanContext, SpanId, TraceContextExt, TraceFlags, TraceId, TraceState};
use opentelemetry::Context;
use parking_lot::Mutex;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use weft_wire::Tid;

use crate::msg::{TraceParent, TxMsg};

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

/// A remote parent context for `sc`.
pub fn parent(sc: SpanContext) -> Context {
    Context::new().with_remote_span_context(sc)
}

/// `traceparent` text of a span context.
pub fn format(sc: &SpanContext) -> String {
    format!(
        "00-{}-{}-{:02x}",
        sc.trace_id(),
        sc.span_id(),
        sc.trace_flags().to_u8()
    )
}

/// Parses `traceparent` text; `None` unless well formed and valid.
pub fn parse(text: &[u8]) -> Option<SpanContext> {
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
    remote(trace, span, flags)
}

fn remote(trace: TraceId, span: SpanId, flags: u8) -> Option<SpanContext> {
    let sc = SpanContext::new(
        trace,
        span,
        TraceFlags::new(flags),
        true,
        TraceState::default(),
    );
    sc.is_valid().then_some(sc)
}

/// The binary form a [`TxMsg::TracedPrepare`] carries.
pub fn to_wire(sc: &SpanContext) -> TraceParent {
    TraceParent {
        trace_id: sc.trace_id().to_bytes(),
        span_id: sc.span_id().to_bytes(),
        flags: sc.trace_flags().to_u8(),
    }
}

/// The span context of a carried [`TraceParent`]; `None` when invalid (an
/// all-zero id).
pub fn from_wire(t: &TraceParent) -> Option<SpanContext> {
    remote(
        TraceId::from_bytes(t.trace_id),
        SpanId::from_bytes(t.span_id),
        t.flags,
    )
}

/// The span context of the current span when it belongs to a trace.
fn current() -> Option<SpanContext> {
    let sc = tracing::Span::current()
        .context()
        .span()
        .span_context()
        .clone();
    sc.is_valid().then_some(sc)
}

/// True when the current span belongs to a trace.
pub fn in_a_trace() -> bool {
    current().is_some()
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

/// The span context of `span` when it is recorded in a trace.
fn context_of(span: &tracing::Span) -> Option<SpanContext> {
    if span.is_disabled() {
        return None;
    }
    let sc = span.context().span().span_context().clone();
    sc.is_valid().then_some(sc)
}

/// What a node remembers of one traced transaction.
#[derive(Default)]
struct Entry {
    /// The span its Prepares go out under (its `commit` or `tx.prepare`),
    /// for Prepares resent outside it.
    own: Option<SpanContext>,
    /// The span a traced Prepare named: the parent of the `tx.outcome`.
    parent: Option<SpanContext>,
}

/// The trace contexts of the transactions a node traces, until it forgets
/// them. Empty while nothing is traced.
#[derive(Default)]
pub struct Traces(Mutex<HashMap<Tid, Entry>>);

impl Traces {
    /// `span` (not entered yet) is the coordinator's `commit` of `tid`:
    /// rooted in the Tid's trace unless the caller's span is traced, and
    /// remembered for the Prepares sent under it.
    pub fn commit(&self, span: &tracing::Span, tid: Tid) {
        root(span, tid);
        if let Some(sc) = context_of(span) {
            self.0.lock().entry(tid).or_default().own = Some(sc);
        }
    }

    /// The span that handles a message received for its transaction, with
    /// its parent set: `tx.prepare` for a Prepare, `tx.outcome` for a
    /// Decision or an abort notice, `None` for the others (and when tracing
    /// is off, in which case nothing else is done).
    pub fn on_receive(&self, node: weft_wire::NodeId, msg: &TxMsg) -> Option<tracing::Span> {
        let tid = msg.tid();
        let (span, carried) = match msg {
            TxMsg::Prepare { .. } | TxMsg::DelegatedPrepare { .. } => {
                (tracing::debug_span!("tx.prepare", %tid, %node), None)
            }
            TxMsg::TracedPrepare { trace, .. } => (
                tracing::debug_span!("tx.prepare", %tid, %node),
                from_wire(trace),
            ),
            TxMsg::Decision { commit, .. } => {
                let outcome = if *commit { "commit" } else { "abort" };
                (
                    tracing::debug_span!("tx.outcome", %tid, %node, outcome),
                    None,
                )
            }
            TxMsg::Abort { .. } => (
                tracing::debug_span!("tx.outcome", %tid, %node, outcome = "abort"),
                None,
            ),
            _ => return None,
        };
        if span.is_disabled() {
            return None;
        }
        let parent_sc = if matches!(msg, TxMsg::Decision { .. } | TxMsg::Abort { .. }) {
            self.0.lock().get(&tid).and_then(|e| e.parent.clone())
        } else {
            carried.clone()
        };
        let _ = span.set_parent(parent(parent_sc.unwrap_or_else(|| tid_span_context(tid))));
        if matches!(
            msg,
            TxMsg::Prepare { .. } | TxMsg::TracedPrepare { .. } | TxMsg::DelegatedPrepare { .. }
        ) {
            let own = context_of(&span);
            let mut map = self.0.lock();
            let e = map.entry(tid).or_default();
            e.own = own;
            if carried.is_some() {
                e.parent = carried;
            }
        }
        Some(span)
    }

    /// `msg`, about to be sent: a Prepare of a traced transaction becomes a
    /// TracedPrepare naming the current span (or, sent outside it, the span
    /// this node's Prepares of it went out under).
    pub fn on_send(&self, msg: TxMsg) -> TxMsg {
        if !matches!(msg, TxMsg::Prepare { .. }) || !tracing::enabled!(tracing::Level::DEBUG) {
            return msg;
        }
        let TxMsg::Prepare {
            tid,
            incarnation,
            aborted_subs,
        } = msg
        else {
            return msg;
        };
        let sc = current().or_else(|| {
            let map = self.0.lock();
            if map.is_empty() {
                return None;
            }
            map.get(&tid).and_then(|e| e.own.clone())
        });
        match sc {
            Some(sc) => TxMsg::TracedPrepare {
                tid,
                incarnation,
                aborted_subs,
                trace: to_wire(&sc),
            },
            None => TxMsg::Prepare {
                tid,
                incarnation,
                aborted_subs,
            },
        }
    }

    /// `tid` was forgotten here: its contexts go.
    pub fn forget(&self, tid: Tid) {
        let mut map = self.0.lock();
        if !map.is_empty() {
            map.remove(&tid);
        }
    }

    /// Transactions remembered (tests).
    pub fn len(&self) -> usize {
        self.0.lock().len()
    }

    /// True when no transaction is remembered.
    pub fn is_empty(&self) -> bool {
        self.0.lock().is_empty()
    }
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
        assert_eq!(from_wire(&to_wire(&sc)), Some(sc.clone()));
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
        let zero = TraceParent {
            trace_id: [0; 16],
            span_id: [1; 8],
            flags: 1,
        };
        assert_eq!(from_wire(&zero), None);
    }

    #[test]
    fn without_a_layer_nothing_is_traced_or_remembered() {
        let tid = Tid {
            node: NodeId(1),
            incarnation: Incarnation(1),
            seq: 1,
        };
        let traces = Traces::default();
        let prepare = TxMsg::Prepare {
            tid,
            incarnation: Incarnation(1),
            aborted_subs: vec![],
        };
        assert!(traces.on_receive(NodeId(2), &prepare).is_none());
        assert_eq!(traces.on_send(prepare.clone()), prepare);
        traces.commit(&tracing::Span::none(), tid);
        assert!(traces.is_empty());
    }
}
