//! The rings a [`crate::BusyPoll`] drains: every started channel is
//! registered here, and a busy poller services them all while it waits.
//! While one is active, the channels' reader threads stand aside (they
//! would otherwise spin too and, on a two-CPU machine, take the CPU the
//! peer process needs).
//!
//! Owns the process-wide registry of channels and the count of active
//! pollers. Must never hold the registry lock while servicing a channel.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};

use parking_lot::Mutex;

use super::channel::Channel;
use super::wait::Placement;

static REGISTRY: Mutex<Vec<Weak<Channel>>> = Mutex::new(Vec::new());
static GENERATION: AtomicU64 = AtomicU64::new(0);
static ACTIVE: AtomicUsize = AtomicUsize::new(0);

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

/// A busy poller's view of the rings: its copy of the registry (refreshed
/// when channels come or go) and where its thread should spin.
pub(crate) struct Rings {
    channels: Vec<Arc<Channel>>,
    generation: u64,
    placement: Placement,
}

impl Rings {
    pub(crate) fn new() -> Rings {
        Rings {
            channels: Vec::new(),
            generation: u64::MAX,
            placement: Placement::default(),
        }
    }

    /// Services every channel once. True when anything moved.
    pub(crate) fn service(&mut self) -> bool {
        service_all(&mut self.channels, &mut self.generation)
    }

    /// See [`colocated`].
    pub(crate) fn colocated(&mut self) -> bool {
        colocated(&self.channels, &mut self.placement)
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
pub(crate) struct Active;

impl Active {
    pub(crate) fn enter() -> Active {
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
pub(crate) struct Idle;

impl Idle {
    pub(crate) fn enter() -> Idle {
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

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicBool;
    use std::task::Poll;
    use std::time::{Duration, Instant};

    use super::super::channel::tests::{cfg, pair};
    use super::*;
    use crate::BusyPoll;
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
