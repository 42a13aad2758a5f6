//! Metric handles for hot paths, shared by every weft layer (the `metrics`
//! facade; names and labels in docs/metrics.md), and the process-wide switch
//! that says a metrics exporter is installed.
//!
//! It lives in the log crate because the log is the lowest weft crate that
//! records metrics (the flusher's forces): the transport re-exports it and
//! the layers above use it through either, so there is one switch and one
//! kind of kept handle in the process, and no dependency points up.
//!
//! Owns [`set_exporting`] / [`exporting`], [`FixedCounter`] and
//! [`FixedHistogram`]. Must never allocate, lock, hash a key or build a label
//! on an update: a handle is looked up in the registry once, at its first
//! update while exporting, and kept; every later update is one relaxed load
//! and, while exporting, the recorder's own update (an atomic add for a
//! counter; for a histogram of the Prometheus exporter, a push into its
//! lock-free bucket of samples, which the exporter buckets at each scrape).
//! Without an exporter an update is one relaxed load.
//!
//! A handle is registered only while exporting, so it is the exporter's
//! (unless recording is switched off at the very moment of its first use);
//! turning recording off later ([`set_exporting`]) stops its updates at the
//! same relaxed load.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

use metrics::{Counter, Histogram};

static EXPORTING: AtomicBool = AtomicBool::new(false);

/// Says that a metrics exporter is installed in this process (or no longer
/// is): metrics whose labels are built from run-time strings (a service's
/// name, a status) are only recorded while it is on, so that a process
/// without an exporter never pays for building them.
pub fn set_exporting(on: bool) {
    EXPORTING.store(on, Ordering::Relaxed);
}

/// True while a metrics exporter is installed (see [`set_exporting`]).
#[inline]
pub fn exporting() -> bool {
    EXPORTING.load(Ordering::Relaxed)
}

/// A counter with a fixed key (a name and no labels), for events on a hot
/// path (a commit, a force): registered on first use while exporting and
/// kept, so an update is one relaxed load and, while exporting, one atomic
/// add, with no key hashed or looked up in the registry.
///
/// Declare it `static`: `static FORCES: FixedCounter = FixedCounter::new("...")`.
pub struct FixedCounter {
    name: &'static str,
    handle: OnceLock<Counter>,
}

impl FixedCounter {
    /// The counter `name`, not registered yet.
    pub const fn new(name: &'static str) -> FixedCounter {
        FixedCounter {
            name,
            handle: OnceLock::new(),
        }
    }

    /// Adds `n`, if exporting.
    #[inline]
    pub fn increment(&self, n: u64) {
        if exporting() {
            self.handle
                .get_or_init(|| metrics::counter!(self.name))
                .increment(n);
        }
    }
}

/// A histogram with a fixed key, kept like [`FixedCounter`].
pub struct FixedHistogram {
    name: &'static str,
    handle: OnceLock<Histogram>,
}

impl FixedHistogram {
    /// The histogram `name`, not registered yet.
    pub const fn new(name: &'static str) -> FixedHistogram {
        FixedHistogram {
            name,
            handle: OnceLock::new(),
        }
    }

    /// Records `value`, if exporting.
    #[inline]
    pub fn record(&self, value: f64) {
        if exporting() {
            self.handle
                .get_or_init(|| metrics::histogram!(self.name))
                .record(value);
        }
    }
}
