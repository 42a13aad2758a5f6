//! CPU time of a process and of its threads, read from `/proc` (Linux): the
//! figures behind "CPU per transaction" in `weft demo --processes`, set
//! beside Raid's own (seed 000, section 2.2: 267 ms of system time per
//! transaction, over 92% of it communication).
//!
//! Owns reading `/proc/<pid>/stat` and reading and grouping
//! `/proc/<pid>/task/<tid>/stat`. Must never
//! fail a run: a process or thread that is gone, or a `/proc` that cannot be
//! read, yields what could be read.

use std::collections::BTreeMap;
use std::path::Path;

/// User and system seconds, summed over threads.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Cpu {
    pub user_s: f64,
    pub system_s: f64,
}

impl Cpu {
    pub fn total_s(&self) -> f64 {
        self.user_s + self.system_s
    }

    fn minus(self, earlier: Cpu) -> Cpu {
        Cpu {
            user_s: (self.user_s - earlier.user_s).max(0.0),
            system_s: (self.system_s - earlier.system_s).max(0.0),
        }
    }
}

/// A process's CPU time so far, by thread group (see [`thread_group`]).
#[derive(Clone, Debug, Default)]
pub struct CpuSample {
    pub by_group: BTreeMap<&'static str, Cpu>,
}

impl CpuSample {
    /// CPU time spent between `earlier` and this sample, by group. A thread
    /// that ended in between takes its time with it (an underestimate,
    /// never a negative figure).
    pub fn since(&self, earlier: &CpuSample) -> CpuSample {
        let by_group = self
            .by_group
            .iter()
            .map(|(g, now)| {
                (
                    *g,
                    now.minus(earlier.by_group.get(g).copied().unwrap_or_default()),
                )
            })
            .collect();
        CpuSample { by_group }
    }

    /// The whole process.
    pub fn total(&self) -> Cpu {
        self.by_group.values().fold(Cpu::default(), |a, c| Cpu {
            user_s: a.user_s + c.user_s,
            system_s: a.system_s + c.system_s,
        })
    }

    /// The share of the process's CPU time spent in its transport threads.
    pub fn transport_share(&self) -> f64 {
        let total = self.total().total_s();
        let transport = self.by_group.get(TRANSPORT).map_or(0.0, Cpu::total_s);
        if total > 0.0 {
            transport / total
        } else {
            0.0
        }
    }
}

/// The group of the shared-memory reader threads (`weft-shm-<node>-<link>`):
/// weft's transport threads. TCP links have none: their frames are read and
/// written by the runtime's workers.
pub const TRANSPORT: &str = "transport (shm readers)";

/// The group a thread's name (`comm`, at most 15 bytes) belongs to.
pub fn thread_group(comm: &str) -> &'static str {
    if comm.starts_with("weft-shm-") {
        TRANSPORT
    } else if comm.starts_with("tokio-r") {
        // tokio-runtime-worker, or tokio-rt-worker in later versions.
        "runtime workers"
    } else if comm.starts_with("weft-log-flush") {
        "log flusher"
    } else if comm == "weft" {
        // The main thread, which runs the runtime's block_on.
        "main thread"
    } else {
        "other"
    }
}

/// Reads every thread of process `pid` (`"self"` for this one).
pub fn sample(pid: &str) -> CpuSample {
    let mut out = CpuSample::default();
    let ticks = clock_ticks();
    let dir = Path::new("/proc").join(pid).join("task");
    let Ok(entries) = std::fs::read_dir(&dir) else {
        return out;
    };
    for entry in entries.flatten() {
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        if let Some((comm, user, system)) = parse_stat(&stat) {
            let cpu = out.by_group.entry(thread_group(comm)).or_default();
            cpu.user_s += user as f64 / ticks;
            cpu.system_s += system as f64 / ticks;
        }
    }
    out
}

/// The whole CPU time of process `pid` (`"self"` for this one), threads that
/// ended included, from `/proc/<pid>/stat`; `None` where it cannot be read.
pub fn process(pid: &str) -> Option<Cpu> {
    let stat = std::fs::read_to_string(Path::new("/proc").join(pid).join("stat")).ok()?;
    let (_, user, system) = parse_stat(&stat)?;
    let ticks = clock_ticks();
    Some(Cpu {
        user_s: user as f64 / ticks,
        system_s: system as f64 / ticks,
    })
}

/// `(comm, utime, stime)` of a `/proc/.../stat` line: the name sits in
/// parentheses (and may hold spaces or parentheses itself), utime and stime
/// are the 12th and 13th fields after it.
fn parse_stat(stat: &str) -> Option<(&str, u64, u64)> {
    let open = stat.find('(')?;
    let close = stat.rfind(')')?;
    let comm = stat.get(open + 1..close)?;
    let mut rest = stat.get(close + 1..)?.split_whitespace();
    let user = rest.nth(11)?.parse().ok()?;
    let system = rest.next()?.parse().ok()?;
    Some((comm, user, system))
}

fn clock_ticks() -> f64 {
    // SAFETY: sysconf only reads a configuration value; it has no
    // preconditions and touches no memory of ours.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if ticks > 0 {
        ticks as f64
    } else {
        100.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stat_line_gives_its_name_and_times_even_with_parentheses_in_the_name() {
        let line = "4242 (weft-shm-1-3) S 1 2 3 4 5 6 7 8 9 10 1234 567 0 0 20 0 9 0 1 2 3";
        assert_eq!(parse_stat(line), Some(("weft-shm-1-3", 1234, 567)));
        let odd = "7 (a) b (c) R 1 2 3 4 5 6 7 8 9 10 11 12 13";
        assert_eq!(parse_stat(odd), Some(("a) b (c", 11, 12)));
        assert_eq!(parse_stat("7 (x) R 1 2"), None);
    }

    #[test]
    fn this_process_spends_time_in_its_threads_and_groups_them() {
        // Burn some CPU in a named thread of each kind, then sample.
        let before = sample("self");
        std::thread::Builder::new()
            .name("weft-shm-9-9".into())
            .spawn(|| {
                let started = std::time::Instant::now();
                let mut x = 0u64;
                while started.elapsed() < std::time::Duration::from_millis(300) {
                    x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
                }
                std::hint::black_box(x);
                // Sample while this thread still exists: its time leaves with it.
                sample("self")
            })
            .unwrap()
            .join()
            .map(|during| {
                let spent = during.since(&before);
                let transport = spent.by_group.get(TRANSPORT).copied().unwrap_or_default();
                assert!(transport.total_s() > 0.0, "{spent:?}");
                assert!(spent.transport_share() > 0.0 && spent.transport_share() <= 1.0);
                assert!(spent.total().total_s() >= transport.total_s());
            })
            .unwrap();
        let whole = process("self").expect("this process's stat");
        assert!(whole.total_s() >= before.total().total_s());
        assert_eq!(thread_group("tokio-runtime-w"), "runtime workers");
        assert_eq!(thread_group("tokio-rt-worker"), "runtime workers");
        assert_eq!(thread_group("weft-log-flushe"), "log flusher");
    }
}
