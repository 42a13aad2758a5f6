//! Busy polling: a latency-critical thread drains this process's rings itself
//! while it waits, so that a response completes its call without any kernel
//! wake-up.
//!
//! The reader thread of a channel delivers a response by completing the
//! caller's future; if the caller's thread sleeps, waking it costs a
//! cross-core kernel wake-up (~22 µs on the reference machine, two orders of
//! magnitude above a shared-memory round trip). A [`BusyPoll`] turns the
//! waiting thread into the reader: it polls its future, and between polls
//! services every shared-memory channel of the process. While one is active,
//! the reader threads stand aside (they would otherwise spin too and, on a
//! two-CPU machine, take the CPU the peer process needs).
//!
//! Owns the process-wide registry of channels and the count of active
//! pollers. Must never hold the registry lock while servicing a channel.

use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::task::{Context, Poll, Wake, Waker};
use std::thread::Thread;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::channel::Channel;
use super::wait::Placement;

static REGISTRY: Mutex<Vec<Weak<Channel>>> = Mutex::new(Vec::new());
static GENERATION: AtomicU64 = AtomicU64::new(0);
static ACTIVE: AtomicUsize = AtomicUsize::new(0);

/// A busy poller that saw nothing move for this long yields the CPU once.
const YIELD_EVERY: Duration = Duration::from_micros(5);

/// Makes a started channel visible to busy pollers.
pub(crate) fn register(ch: &Arc<Channel>) {
    let mut reg = REGISTRY.lock();
    reg.retain(|w| w.upgrade().is_some_and(|c| !c.is_finished()));
    reg.push(Arc::downgrade(ch));
    GENERATION.fetch_add(1, Ordering::Release);
}

/// Tells busy pollers that a channel closed (they drop it from their list).
pub(crate) fn changed() {
    GENERATION.fetch_add(1, Ordering::Release);
}

/// True while some thread of this process busy-polls the rings.
pub(crate) fn pollers_active() -> bool {
    ACTIVE.load(Ordering::Acquire) > 0
}

fn live_channels() -> Vec<Arc<Channel>> {
    REGISTRY
        .lock()
        .iter()
        .filter_map(Weak::upgrade)
        .filter(|c| !c.is_finished())
        .collect()
}

fn wake_readers() {
    for c in live_channels() {
        c.unpark_reader();
    }
}

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
/// every shared-memory channel of this process itself, so a call to a
/// same-host node completes without a kernel wake-up on either side.
///
/// Meant for latency-critical loops (benchmarks, a client hammering a
/// same-host service). While a `block_on` runs, the channels' reader threads
/// stand aside and look at their rings only every 2 ms; they take
/// over again within that time once no `block_on` runs. A `block_on` that
/// sees nothing move for the idle-spin limit stops spinning and sleeps until
/// its future is woken, handing the rings back to the reader threads
/// meanwhile. A `block_on` that finds a peer it should make room for (see
/// the channel's placement rule) spinning on its own CPU moves its thread
/// to another CPU the thread is allowed on; the allowed set is left as it
/// was.
///
/// Use it inside a tokio runtime context but not on a runtime worker thread:
/// e.g. in `Runtime::block_on`'s thread, in `spawn_blocking`, or after
/// `Handle::enter`. Handlers run by the channels it services may spawn tasks
/// on that runtime.
pub struct BusyPoll {
    channels: Vec<Arc<Channel>>,
    generation: u64,
    handle: Option<tokio::runtime::Handle>,
    idle_spin: Duration,
    placement: Placement,
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
            channels: Vec::new(),
            generation: u64::MAX,
            handle: tokio::runtime::Handle::try_current().ok(),
            idle_spin: Self::DEFAULT_IDLE_SPIN,
            placement: Placement::default(),
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

    /// Services every shared-memory channel of this process once: reads and
    /// delivers what waits, pushes what waits to be sent. Returns true when
    /// anything moved.
    pub fn poll_once(&mut self) -> bool {
        service_all(&mut self.channels, &mut self.generation)
    }

    /// Runs `fut` to completion on this thread, servicing the channels
    /// between polls (see the type's documentation).
    pub fn block_on<F: Future>(&mut self, fut: F) -> F::Output {
        // Field by field: the runtime stays entered (borrowing the handle)
        // while the channel list is refreshed.
        let BusyPoll {
            channels,
            generation,
            handle,
            idle_spin,
            placement,
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
            if service_all(channels, generation) {
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
                if idle >= next_yield || colocated(channels, placement) {
                    // The peer may be waiting for this very CPU (two
                    // spinners on one CPU only alternate at the scheduler's
                    // tick otherwise).
                    std::thread::yield_now();
                    next_yield = idle + YIELD_EVERY;
                }
                if idle >= *idle_spin {
                    // Hand the rings back to the reader threads and sleep.
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

/// Services every channel in `channels` once, first refreshing the list
/// when channels came or went since `generation`. Returns true when anything
/// moved.
fn service_all(channels: &mut Vec<Arc<Channel>>, generation: &mut u64) -> bool {
    let now = GENERATION.load(Ordering::Acquire);
    if now != *generation {
        *channels = live_channels();
        *generation = now;
    }
    let mut progress = false;
    for c in channels.iter() {
        progress |= c.service();
    }
    progress
}

/// Announces this thread's CPU on every channel it services (their peers
/// then know where the consumer runs) and tells whether one of the peers
/// runs on the same CPU (then spinning only keeps it from running). When
/// this end is the one to step aside from such a peer, first moves to
/// another CPU. Used by busy pollers and by a channel's own reader thread.
pub(crate) fn colocated(channels: &[Arc<Channel>], placement: &mut Placement) -> bool {
    let announce = |cpu: u32| {
        let (mut same, mut mover) = (false, false);
        for c in channels {
            c.publish_cpu(cpu);
            let here = c.peer_on_cpu(cpu);
            same |= here;
            mover |= here && c.steps_aside();
        }
        (same, mover)
    };
    let cpu = super::mem::current_cpu();
    let (same, mover) = announce(cpu);
    if !mover {
        return same;
    }
    match placement.step_aside(cpu) {
        Some(moved) => announce(moved).0,
        None => same,
    }
}

/// Counts this thread among the active busy pollers while it lives.
struct Active;

impl Active {
    fn enter() -> Active {
        ACTIVE.fetch_add(1, Ordering::AcqRel);
        Active
    }
}

impl Drop for Active {
    fn drop(&mut self) {
        ACTIVE.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A sleeping busy poller: not counted, and the reader threads are woken so
/// they take over at once.
struct Idle;

impl Idle {
    fn enter() -> Idle {
        ACTIVE.fetch_sub(1, Ordering::AcqRel);
        wake_readers();
        Idle
    }
}

impl Drop for Idle {
    fn drop(&mut self) {
        ACTIVE.fetch_add(1, Ordering::AcqRel);
    }
}

impl Default for BusyPoll {
    fn default() -> Self {
        BusyPoll::new()
    }
}

#[cfg(test)]
mod tests {
    use super::super::channel::tests::{cfg, pair};
    use super::*;
    use weft_wire::{Frame, Heartbeat};

    #[test]
    fn block_on_runs_plain_futures_and_services_channels() {
        let _serial = super::super::tests::SERIAL.lock();
        let mut bp = BusyPoll::new().with_idle_spin(Duration::from_micros(50));
        assert_eq!(bp.block_on(async { 7 }), 7);
        let (a, _pa, b, pb) = pair(&cfg(8192));
        b.start("weft-test-bp".into()).unwrap();
        a.send(&Frame::Heartbeat(Heartbeat {
            seq: 9,
            reply: false,
        }))
        .unwrap();
        // The reader thread stands aside: the poller delivers.
        let deadline = Instant::now() + Duration::from_secs(10);
        while pb.frames.lock().is_empty() {
            bp.poll_once();
            assert!(Instant::now() < deadline);
        }
        // A future that needs another thread's wake-up: block_on sleeps, then
        // returns.
        let flag = Arc::new(AtomicBool::new(false));
        let mut spawned = false;
        let waiter = futures::future::poll_fn(|cx| {
            if flag.load(Ordering::Acquire) {
                return Poll::Ready(());
            }
            if !spawned {
                spawned = true;
                let (w, f) = (cx.waker().clone(), flag.clone());
                std::thread::spawn(move || {
                    std::thread::sleep(Duration::from_millis(5));
                    f.store(true, Ordering::Release);
                    w.wake();
                });
            }
            Poll::Pending
        });
        bp.block_on(waiter);
        drop(bp);
        a.close();
        b.close();
    }
}
