//! The postmaster process: spawn, signal, wait, reap.
//!
//! Owns: one spawned `postgres` process, the thread that waits for it, and the rule that makes
//! signalling it safe — a signal is only sent while the process is known not to have been reaped,
//! so its pid cannot have been reused by a stranger. Must never: signal a pid it did not spawn, or
//! let the postmaster outlive the harness process (it is spawned with a parent-death signal).

use std::io;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, ExitStatus};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

/// How a supervised process ended, as far as we know.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Exit {
    /// Still running, or exited but not yet reaped: its pid is still ours.
    Running,
    /// Reaped; `None` when the status could not be collected.
    Exited(Option<ExitStatus>),
}

#[derive(Debug)]
struct Shared {
    exit: Mutex<Exit>,
    changed: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Exit> {
        self.exit.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// A running (or just ended) postmaster, in its own process group (away from the terminal's).
///
/// Its supervisor thread is the postmaster's parent: the thread blocks until the postmaster has
/// exited, and only then reaps it, while holding the lock that [`Postmaster::signal`] takes.
#[derive(Debug)]
pub(crate) struct Postmaster {
    pid: u32,
    shared: Arc<Shared>,
    supervisor: Option<JoinHandle<()>>,
}

impl Postmaster {
    /// Spawns `cmd` in a new process group, with SIGKILL as its parent-death signal, from a
    /// dedicated thread that lives exactly as long as the process does (the parent-death signal
    /// fires when the *thread* that forked the child ends, so that thread must not be a pooled
    /// one that could retire early).
    pub(crate) fn spawn(mut cmd: Command) -> io::Result<Postmaster> {
        cmd.process_group(0);
        #[cfg(target_os = "linux")]
        {
            let harness = std::process::id();
            // SAFETY: the closure runs in the forked child, after the uid/gid switch and before
            // exec. It only calls prctl and getppid, both async-signal-safe, and allocates
            // nothing (io::Error from an errno code is not heap-allocated).
            unsafe {
                cmd.pre_exec(move || {
                    let sig = libc::SIGKILL as libc::c_ulong;
                    if libc::prctl(libc::PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0 {
                        return Err(io::Error::last_os_error());
                    }
                    // The harness died between fork and prctl: the signal will never come.
                    if libc::getppid() as u32 != harness {
                        return Err(io::Error::from_raw_os_error(libc::ESRCH));
                    }
                    Ok(())
                });
            }
        }

        let shared = Arc::new(Shared {
            exit: Mutex::new(Exit::Running),
            changed: Condvar::new(),
        });
        let (spawned_tx, spawned_rx) = mpsc::channel();
        let thread_shared = Arc::clone(&shared);
        let supervisor = thread::Builder::new()
            .name("weft-pg-postmaster".into())
            .spawn(move || {
                let mut child = match cmd.spawn() {
                    Ok(child) => child,
                    Err(e) => {
                        let _ = spawned_tx.send(Err(e));
                        return;
                    }
                };
                let pid = child.id();
                let _ = spawned_tx.send(Ok(pid));
                wait_exited_without_reaping(pid);
                let mut exit = thread_shared.lock();
                *exit = Exit::Exited(child.wait().ok());
                thread_shared.changed.notify_all();
            })?;
        match spawned_rx.recv() {
            Ok(Ok(pid)) => Ok(Postmaster {
                pid,
                shared,
                supervisor: Some(supervisor),
            }),
            Ok(Err(e)) => {
                let _ = supervisor.join();
                Err(e)
            }
            Err(_) => {
                let _ = supervisor.join();
                Err(io::Error::other("postmaster supervisor thread died"))
            }
        }
    }

    /// The postmaster's pid, which is also its process group id.
    pub(crate) fn pid(&self) -> u32 {
        self.pid
    }

    /// Whether the process is still ours (running, or exited and not reaped yet).
    pub(crate) fn exit(&self) -> Exit {
        *self.shared.lock()
    }

    /// Waits up to `timeout` for the postmaster to exit; `Exit::Running` on timeout.
    pub(crate) fn wait_exit(&self, timeout: Duration) -> Exit {
        let deadline = Instant::now() + timeout;
        let mut exit = self.shared.lock();
        loop {
            if let Exit::Exited(_) = *exit {
                return *exit;
            }
            let now = Instant::now();
            if now >= deadline {
                return Exit::Running;
            }
            exit = self
                .shared
                .changed
                .wait_timeout(exit, deadline - now)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }

    /// Sends `sig` to the postmaster; `false` if it has already been reaped.
    pub(crate) fn signal(&self, sig: libc::c_int) -> bool {
        let exit = self.shared.lock();
        if let Exit::Exited(_) = *exit {
            return false;
        }
        // SAFETY: kill has no memory-safety preconditions. The lock is held and the postmaster
        // is not reaped, so its pid still names it.
        unsafe { libc::kill(self.pid as libc::pid_t, sig) == 0 }
    }

    /// Kills the postmaster and every process it forked with SIGKILL, as a power cut would, and
    /// returns the children it killed (empty if the postmaster was already reaped).
    ///
    /// A group kill is not enough: each PostgreSQL backend makes itself a session leader
    /// (`setsid`), leaving the postmaster's process group. So the postmaster is stopped first
    /// (SIGSTOP: it can fork no more, and it cannot reap, so its children's pids stay theirs),
    /// then each child and the child's own group is killed, then the postmaster.
    pub(crate) fn kill_tree(&self) -> Vec<ProcessId> {
        let exit = self.shared.lock();
        if let Exit::Exited(_) = *exit {
            return Vec::new();
        }
        let pid = self.pid as libc::pid_t;
        // SAFETY: kill has no memory-safety preconditions. The lock is held and the postmaster
        // is not reaped, so `pid` is still our postmaster.
        unsafe { libc::kill(pid, libc::SIGSTOP) };
        // The stop takes effect when the postmaster next leaves the kernel; a fork in flight
        // finishes first. List the children only once it has stopped.
        let deadline = Instant::now() + Duration::from_secs(5);
        while read_stat(self.pid).is_some_and(|stat| stat.state != 'T') && Instant::now() < deadline
        {
            thread::yield_now();
        }
        let children = children_of(self.pid);
        for child in &children {
            let child = child.pid as libc::pid_t;
            // SAFETY: as above; `child` is an unreaped child of the stopped postmaster, so its
            // pid (and the group it leads, if it called setsid) cannot have been reused.
            unsafe {
                libc::kill(-child, libc::SIGKILL);
                libc::kill(child, libc::SIGKILL);
            }
        }
        // SAFETY: as above. SIGKILL also ends a stopped process.
        unsafe {
            libc::kill(-pid, libc::SIGKILL);
            libc::kill(pid, libc::SIGKILL);
        }
        children
    }
}

impl Drop for Postmaster {
    fn drop(&mut self) {
        // Owners stop or crash the postmaster before dropping it; this is the last line of
        // defence so that no server outlives its handle.
        if let Exit::Running = self.exit() {
            let children = self.kill_tree();
            self.wait_exit(Duration::from_secs(10));
            wait_gone(&children, Duration::from_secs(10));
        }
        if let Exit::Exited(_) = self.exit() {
            if let Some(thread) = self.supervisor.take() {
                let _ = thread.join();
            }
        }
    }
}

/// Blocks until child `pid` has exited, leaving it a zombie so that its pid stays reserved until
/// the caller reaps it under the lock.
fn wait_exited_without_reaping(pid: u32) {
    loop {
        // SAFETY: `siginfo_t` is plain old data; all-zero is a valid value.
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        // SAFETY: `info` is a valid out-pointer for the duration of the call; WNOWAIT leaves
        // the child reapable by `Child::wait`.
        let rc = unsafe {
            libc::waitid(
                libc::P_PID,
                pid as libc::id_t,
                &mut info,
                libc::WEXITED | libc::WNOWAIT,
            )
        };
        if rc == 0 || io::Error::last_os_error().kind() != io::ErrorKind::Interrupted {
            // On any error other than EINTR, `Child::wait` reports it.
            return;
        }
    }
}

/// A process as of one moment: its pid and its start time (in clock ticks since boot), so a
/// later look can tell it from an unrelated process that reused the pid.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ProcessId {
    pid: u32,
    start_time: u64,
}

/// The fields of `/proc/<pid>/stat` this module reads.
struct Stat {
    state: char,
    ppid: u32,
    start_time: u64,
}

fn read_stat(pid: u32) -> Option<Stat> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // "pid (comm) state ppid pgrp session tty_nr tpgid flags minflt cminflt majflt cmajflt
    //  utime stime cutime cstime priority nice num_threads itrealvalue starttime ..."
    // comm may contain spaces and parentheses, so split after the last ')'.
    let fields: Vec<&str> = text[text.rfind(')')? + 1..].split_whitespace().collect();
    Some(Stat {
        state: fields.first()?.chars().next()?,
        ppid: fields.get(1)?.parse().ok()?,
        start_time: fields.get(19)?.parse().ok()?,
    })
}

/// The live children of `parent`, from `/proc` (empty where there is no `/proc`).
fn children_of(parent: u32) -> Vec<ProcessId> {
    let Ok(entries) = std::fs::read_dir(Path::new("/proc")) else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|entry| entry.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(|pid| {
            let stat = read_stat(pid)?;
            (stat.ppid == parent).then_some(ProcessId {
                pid,
                start_time: stat.start_time,
            })
        })
        .collect()
}

/// Whether `process` still runs: it exists, is the same process, and is not a zombie (a zombie
/// holds no memory, so no shared memory attachment either).
fn is_alive(process: &ProcessId) -> bool {
    match read_stat(process.pid) {
        None => false,
        Some(stat) => stat.start_time == process.start_time && !matches!(stat.state, 'Z' | 'X'),
    }
}

/// Waits up to `timeout` until none of `processes` is alive; returns whether they all ended.
pub(crate) fn wait_gone(processes: &[ProcessId], timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if !processes.iter().any(is_alive) {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        thread::sleep(Duration::from_millis(2));
    }
}
