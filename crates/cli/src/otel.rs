//! `--otlp URL` (feature `otel`): weft's tracing spans exported to an
//! OpenTelemetry collector over OTLP/HTTP, batched off the nodes' threads.
//!
//! Owns the exporter's set-up and its flush at exit. Must never make the
//! command fail: a collector that cannot be set up is reported once and the
//! command runs without export.

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::{SpanExporter, WithExportConfig};
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing::{Level, Subscriber};
use tracing_subscriber::filter::Targets;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::Layer;

/// Flushes and stops the exporter when dropped.
pub struct Guard(Option<SdkTracerProvider>);

impl Drop for Guard {
    fn drop(&mut self) {
        if let Some(p) = self.0.take() {
            let _ = p.shutdown();
        }
    }
}

/// Installs `registry` as the global subscriber, with an OTLP exporter of
/// weft's spans when `endpoint` is given.
pub fn install<S>(registry: S, endpoint: Option<&str>) -> Guard
where
    S: Subscriber + for<'a> LookupSpan<'a> + Send + Sync + 'static,
{
    let Some(url) = endpoint else {
        registry.init();
        return Guard(None);
    };
    let exporter = match SpanExporter::builder()
        .with_http()
        .with_endpoint(url)
        .build()
    {
        Ok(e) => e,
        Err(e) => {
            registry.init();
            eprintln!("weft: no OTLP export to {url}: {e}");
            return Guard(None);
        }
    };
    let provider = SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .build();
    // The spans of calls, serves, commits and group sends are debug spans.
    let spans = Targets::new()
        .with_default(Level::INFO)
        .with_target("weft_rpc", Level::DEBUG)
        .with_target("weft_tx", Level::DEBUG)
        .with_target("weft_group", Level::DEBUG);
    let layer = tracing_opentelemetry::layer()
        .with_tracer(provider.tracer("weft"))
        .with_filter(spans);
    registry.with(layer).init();
    Guard(Some(provider))
}
