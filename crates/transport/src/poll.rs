//! Busy polling: a latency-critical thread reads this process's channels
//! itself while it waits (the shared-memory rings and the TCP sockets), so
//! that a response completes its call without a kernel wake-up.
//!
//! A channel's reader (a ring's reader thread, a socket's reader task on the
//! runtime) delivers a response by completing the caller's future; if the
//! caller's thread sleeps, waking it costs a cross-core kernel wake-up
//! (~22 µs on one reference machine, ~60 µs on a VM whose halted vCPU must
//! be woken; a shared-memory round trip is under 1 µs, a loopback TCP one
//! about 4 µs). A [`BusyPoll`] turns the waiting thread into the reader: it
//! polls its future, and between polls services every shared-memory channel
//! and every TCP link of the process ([`crate::shm`]'s `Rings`,
//! [`crate::tcp`]'s `Sockets`). It is bounded and off when idle: after the
//! idle-spin limit without anything moving it sleeps until its future is
//! woken, and no thread spins while no `block_on` runs.
//!
//! Owns the waiting thread's loop. Must never run on a runtime worker (it
//! would keep the worker from its tasks) and never hold a channel's lock
//! across a poll of the future.

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};
use std::thread::Thread;
use std::time::{Duration, Instant};

use crate::shm::poll::{Active, Idle, Rings};
use crate::tcp::poll::Sockets;

/// A busy poller that saw nothing move for this long yields the CPU once.
const YIELD_EVERY: Duration = Duration::from_micros(5);

/// Wakes the busy poller's thread.
struct Signal {
    woken: AtomicBool,
    thread: Thread,
}

impl Wake for Signal {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.woken.store(true, Ordering::Release);
        self.thread.unpark();
    }
}

/// A thread that waits by spinning: [`BusyPoll::block_on`] runs a future to
/// completion on the calling thread and, while the future waits, services
/// every shared-memory channel and every TCP link of this process itself, so
/// a call to another node completes without a kernel wake-up on this side
/// (and on neither side when both nodes live in this process).
///
/// Meant for latency-critical loops (benchmarks, a client hammering a
/// service). While a `block_on` runs, the shared-memory reader threads stand
/// aside and look at their rings only every 2 ms; they take over again
/// within that time once no `block_on` runs. TCP links keep their reader
/// tasks, which read whatever the poller leaves. A `block_on` reads each TCP
/// link once per round (one `recv` each), so it suits a process with few
/// links. A `block_on` that sees nothing move for the idle-spin limit stops
/// spinning and sleeps until its future is woken, handing the channels back
/// to their readers meanwhile. A `block_on` that finds a shared-memory peer
/// it should make room for (see the channel's placement rule) spinning on
/// its own CPU moves its thread to another CPU the thread is allowed on; the
/// allowed set is left as it was.
///
/// Use it inside a tokio runtime context but not on a runtime worker thread:
/// e.g. in `Runtime::block_on`'s thread, in `spawn_blocking`, or after
/// `Handle::enter`. Handlers run by the channels it services may spawn tasks
/// on that runtime.
pub struct BusyPoll {
    rings: Rings,
    sockets: Sockets,
    handle: Option<tokio::runtime::Handle>,
    idle_spin: Duration,
    /// Reused by every `block_on` (it names this thread: a BusyPoll stays on
    /// the thread that made it).
    signal: Arc<Signal>,
    waker: Waker,
    _not_send: std::marker::PhantomData<*const ()>,
}

impl BusyPoll {
    /// Idle spin before a `block_on` sleeps, by default.
    pub const DEFAULT_IDLE_SPIN: Duration = Duration::from_millis(1);

    /// A busy poller for the calling thread.
    pub fn new() -> BusyPoll {
        let signal = Arc::new(Signal {
            woken: AtomicBool::new(false),
            thread: std::thread::current(),
        });
        BusyPoll {
            rings: Rings::new(),
            sockets: Sockets::new(),
            handle: tokio::runtime::Handle::try_current().ok(),
            idle_spin: Self::DEFAULT_IDLE_SPIN,
            waker: Waker::from(signal.clone()),
            signal,
            _not_send: std::marker::PhantomData,
        }
    }

    /// Sets how long `block_on` spins without anything moving before it
    /// sleeps until woken.
    pub fn with_idle_spin(mut self, idle_spin: Duration) -> BusyPoll {
        self.idle_spin = idle_spin;
        self
    }

    /// Services every shared-memory channel and TCP link of this process
    /// once: reads and delivers what waits, pushes what waits to be sent.
    /// Returns true when anything moved.
    pub fn poll_once(&mut self) -> bool {
        service_all(&mut self.rings, &mut self.sockets)
    }

    /// Runs `fut` to completion on this thread, servicing the channels
    /// between polls (see the type's documentation).
    pub fn block_on<F: Future>(&mut self, fut: F) -> F::Output {
        // Field by field: the runtime stays entered (borrowing the handle)
        // while the channel list is refreshed.
        let BusyPoll {
            rings,
            sockets,
            handle,
            idle_spin,
            signal,
            waker,
            ..
        } = self;
        let _runtime = handle.as_ref().map(|h| h.enter());
        let _active = Active::enter();
        let mut fut = std::pin::pin!(fut);
        signal.woken.store(true, Ordering::Relaxed);
        let mut cx = Context::from_waker(waker);
        let mut idle_since: Option<Instant> = None;
        let mut next_yield = YIELD_EVERY;
        let mut spins: u32 = 0;
        loop {
            // Looked at before it is cleared: a swap is a locked
            // instruction, and this loop runs it while it spins.
            if signal.woken.load(Ordering::Acquire) && signal.woken.swap(false, Ordering::AcqRel) {
                if let Poll::Ready(v) = fut.as_mut().poll(&mut cx) {
                    return v;
                }
            }
            if service_all(rings, sockets) {
                idle_since = None;
                next_yield = YIELD_EVERY;
                continue;
            }
            if signal.woken.load(Ordering::Acquire) {
                continue;
            }
            std::hint::spin_loop();
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(64) {
                let now = Instant::now();
                let since = *idle_since.get_or_insert(now);
                let idle = now.duration_since(since);
                if idle >= next_yield || rings.colocated() {
                    // The peer may be waiting for this very CPU (two
                    // spinners on one CPU only alternate at the scheduler's
                    // tick otherwise).
                    std::thread::yield_now();
                    next_yield = idle + YIELD_EVERY;
                }
                if idle >= *idle_spin {
                    // Hand the channels back to their readers and sleep.
                    let idle = Idle::enter();
                    while !signal.woken.load(Ordering::Acquire) {
                        std::thread::park_timeout(Duration::from_millis(100));
                    }
                    drop(idle);
                    idle_since = None;
                    next_yield = YIELD_EVERY;
                }
            }
        }
    }
}

impl Default for BusyPoll {
    fn default() -> Self {
        BusyPoll::new()
    }
}

/// Services every ring and then every socket once. True when anything moved.
fn service_all(rings: &mut Rings, sockets: &mut Sockets) -> bool {
    // Both, always: a socket must not wait for the rings to go quiet.
    rings.service() | sockets.service()
}
