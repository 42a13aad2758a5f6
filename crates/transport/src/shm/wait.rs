//! How a thread waits for shared-memory traffic: spin briefly, then yield,
//! then park (on a futex, done by the caller), with a spin budget that adapts
//! to what waiting has been paying off; and where it spins: off the CPU its
//! peer spins on ([`Placement`]).
//!
//! Owns the adaptation rule and the placement rule. Must never sleep
//! itself: parking is the caller's, because only the caller knows what to
//! park on.

use std::time::{Duration, Instant};

use super::SpinPolicy;

/// An adaptive spinner. Traffic that comes soon after a sleep began (within
/// the largest budget) proves sleeping wrong: the budget jumps back to the
/// largest. A sleep that lasted longer than that means the pair went quiet:
/// the budget shrinks by a quarter, so a few stalls of a busy peer barely
/// matter while an idle pair soon spins only the smallest budget.
///
/// While spinning it also yields the CPU now and then: on a machine with few
/// CPUs, a thread this one just woke (a caller whose response it delivered)
/// may be waiting for exactly this CPU.
#[derive(Debug)]
pub(crate) struct AdaptiveSpin {
    policy: SpinPolicy,
    budget: Duration,
}

/// Spin this long between two yields of the CPU.
const YIELD_EVERY: Duration = Duration::from_micros(5);

impl AdaptiveSpin {
    /// A spinner starting at the policy's largest budget.
    pub(crate) fn new(policy: SpinPolicy) -> Self {
        AdaptiveSpin {
            budget: policy.max_spin,
            policy,
        }
    }

    /// The current spin budget.
    #[cfg(test)]
    pub(crate) fn budget(&self) -> Duration {
        self.budget
    }

    /// Spins up to the budget (yielding every few microseconds, and at once
    /// whenever `colocated()` says the peer runs on this very CPU), then
    /// yields the CPU `policy.yields` times, until `ready()` holds. Returns
    /// true when it did (the caller goes on), false when the caller should
    /// park.
    pub(crate) fn wait(
        &mut self,
        mut ready: impl FnMut() -> bool,
        mut colocated: impl FnMut() -> bool,
    ) -> bool {
        let start = Instant::now();
        let mut next_yield = YIELD_EVERY;
        let mut i: u32 = 0;
        loop {
            if ready() {
                return true;
            }
            std::hint::spin_loop();
            i = i.wrapping_add(1);
            if i.is_multiple_of(16) {
                let spun = start.elapsed();
                if spun >= self.budget {
                    break;
                }
                if spun >= next_yield || colocated() {
                    std::thread::yield_now();
                    next_yield = spun + YIELD_EVERY;
                }
            }
        }
        for _ in 0..self.policy.yields {
            std::thread::yield_now();
            if ready() {
                return true;
            }
        }
        false
    }

    /// The caller parked for `slept` and was woken, with work waiting or not.
    pub(crate) fn parked(&mut self, slept: Duration, for_work: bool) {
        self.budget = if for_work && slept < self.policy.max_spin {
            self.policy.max_spin
        } else {
            (self.budget * 3 / 4).clamp(self.policy.min_spin, self.policy.max_spin)
        };
    }
}

/// Moves a spinning thread off the CPU its peer spins on.
///
/// Two threads that spin waiting for each other on one CPU only take turns
/// (each yield hands the CPU over), a context switch per message. The
/// kernel's balancer does not separate them even with another CPU idle:
/// both always ran a moment ago, so both count as cache-hot and neither is
/// migrated. So one of the two, the peer that the channel designates, steps
/// aside itself.
///
/// Where there are more spinners than CPUs no placement keeps them apart,
/// and moving only costs migrations: a thread that finds itself sharing a
/// CPU again soon after a move waits twice as long before the next one (up
/// to [`MOVE_EVERY_MAX`]); a move that held for a while resets the wait to
/// [`MOVE_EVERY`].
#[derive(Debug)]
pub(crate) struct Placement {
    last_move: Option<Instant>,
    every: Duration,
}

/// A thread steps aside at most this often.
const MOVE_EVERY: Duration = Duration::from_millis(5);

/// The longest wait between two moves, when moves do not help.
const MOVE_EVERY_MAX: Duration = Duration::from_millis(320);

impl Default for Placement {
    fn default() -> Self {
        Placement {
            last_move: None,
            every: MOVE_EVERY,
        }
    }
}

impl Placement {
    /// The calling thread runs on `cpu` together with its peer: moves it
    /// elsewhere unless its last move was too recent (see the type).
    /// Returns the CPU it runs on afterwards, or `None` when it did not move.
    pub(crate) fn step_aside(&mut self, cpu: u32) -> Option<u32> {
        self.step_aside_at(cpu, Instant::now())
    }

    fn step_aside_at(&mut self, cpu: u32, now: Instant) -> Option<u32> {
        if let Some(last) = self.last_move {
            let since = now.duration_since(last);
            if since < self.every {
                return None;
            }
            self.every = if since < self.every * 2 {
                (self.every * 2).min(MOVE_EVERY_MAX)
            } else {
                MOVE_EVERY
            };
        }
        self.last_move = Some(now);
        super::mem::move_off_cpu(cpu).filter(|&c| c != cpu)
    }

    /// The current wait between two moves.
    #[cfg(test)]
    fn every(&self) -> Duration {
        self.every
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy() -> SpinPolicy {
        SpinPolicy {
            min_spin: Duration::from_micros(2),
            max_spin: Duration::from_micros(64),
            yields: 1,
            park_timeout: Duration::from_millis(100),
        }
    }

    #[test]
    fn idle_shrinks_the_budget_and_quick_wakeups_restore_it() {
        let mut s = AdaptiveSpin::new(policy());
        assert_eq!(s.budget(), Duration::from_micros(64));
        s.parked(Duration::from_millis(5), true);
        assert_eq!(
            s.budget(),
            Duration::from_micros(48),
            "one stall: a quarter off"
        );
        for _ in 0..20 {
            s.parked(Duration::from_millis(200), false);
        }
        assert_eq!(
            s.budget(),
            Duration::from_micros(2),
            "idle: down to the floor"
        );
        s.parked(Duration::from_micros(10), true);
        assert_eq!(
            s.budget(),
            Duration::from_micros(64),
            "woken soon: spin fully again"
        );
        s.parked(Duration::from_micros(10), false);
        assert_eq!(s.budget(), Duration::from_micros(48), "woken for nothing");
    }

    #[test]
    fn stepping_aside_moves_at_most_once_per_period_and_backs_off_when_it_does_not_help() {
        std::thread::spawn(|| {
            let ms = Duration::from_millis;
            let mut p = Placement::default();
            let two_cpus = std::thread::available_parallelism().map_or(1, |n| n.get()) >= 2;
            let here = crate::shm::mem::current_cpu();
            let t0 = Instant::now();
            let first = p.step_aside_at(here, t0);
            if two_cpus {
                assert!(first.is_some_and(|c| c != here), "moved off {here}");
            }
            let cpu = crate::shm::mem::current_cpu;
            assert_eq!(p.step_aside_at(cpu(), t0 + ms(3)), None, "too soon");
            assert_eq!(p.every(), MOVE_EVERY);
            // Sharing a CPU again right after each move: the wait doubles.
            p.step_aside_at(cpu(), t0 + ms(6));
            assert_eq!(p.every(), ms(10));
            p.step_aside_at(cpu(), t0 + ms(17));
            assert_eq!(p.every(), ms(20));
            assert_eq!(p.step_aside_at(cpu(), t0 + ms(30)), None, "too soon");
            let mut t = t0 + ms(17);
            for _ in 0..10 {
                t += p.every();
                p.step_aside_at(cpu(), t);
            }
            assert_eq!(p.every(), MOVE_EVERY_MAX, "capped");
            // A move that held for a while: back to the shortest wait.
            p.step_aside_at(cpu(), t0 + MOVE_EVERY_MAX * 100);
            assert_eq!(p.every(), MOVE_EVERY);
        })
        .join()
        .unwrap();
    }

    #[test]
    fn wait_returns_true_when_ready_and_false_after_the_budget() {
        let mut s = AdaptiveSpin::new(policy());
        let mut n = 0;
        assert!(s.wait(
            || {
                n += 1;
                n > 100
            },
            || false
        ));
        let t = Instant::now();
        assert!(!s.wait(|| false, || true));
        assert!(t.elapsed() >= s.budget().min(Duration::from_micros(2)));
    }
}
