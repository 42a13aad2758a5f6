//! Where the disk engine's merges run: on a thread of their own, at a lower
//! CPU priority, one at a time in the process.
//!
//! Owns the process-wide merge gate and the merge threads (CPU nice 10, I/O
//! class idle). A merge rewrites
//! the leaves of the merged table that its deltas touch (at ten million
//! keys, about one leaf per changed key: seconds of CPU and hundreds of MB
//! written). It changes no content, so nothing waits for it but the next
//! merge; run at the priority of the commits, and with every store of the
//! process merging at once (their checkpoints run in step), it took the
//! CPU from them: a 3-site DebitCredit at scale 100 fell from ~1,100 to
//! ~250 commits/s for the 15 s its merges took. The foreground keeps its
//! share this way, as RocksDB's low-priority compaction pool does.
//!
//! Must never run a merge at a higher priority than the caller's, nor hold
//! the gate while it waits for anything but the merge it runs (which takes
//! its own store's merge lock first, held by that store's bulk import).

use parking_lot::Mutex;

/// One merge at a time among the stores of this process.
static GATE: Mutex<()> = Mutex::new(());

/// The nice value merge threads run at (0 is the default; 19 the lowest).
pub const MERGE_NICE: i32 = 10;

/// Runs `merge` in the background: on a new thread when there is a tokio
/// runtime (the caller is a node), else here and now (a tool or a test that
/// drives the store by hand and expects the merge done on return). Either
/// way it waits for the process's merge gate first.
///
/// Fails with the OS error when no thread can be started (a process at its
/// limit); `merge` is then dropped unrun, which is harmless: the deltas stay
/// read as they are, and a later call merges them.
pub fn spawn_merge(merge: impl FnOnce() + Send + 'static) -> std::io::Result<()> {
    let gated = move || {
        let _gate = GATE.lock();
        merge();
    };
    if tokio::runtime::Handle::try_current().is_err() {
        gated();
        return Ok(());
    }
    std::thread::Builder::new()
        .name("kv-merge".into())
        .spawn(move || {
            if let Err(e) = lower_priority(MERGE_NICE) {
                tracing::debug!(error = %e, "kv: the merge thread keeps its priority");
            }
            gated();
        })
        .map(drop)
}

/// The idle I/O class (Linux's `IOPRIO_CLASS_IDLE`): served when no other
/// class waits (mq-deadline and BFQ; mq-deadline ages a starved request
/// after `prio_aging_expire`, 10 s by default).
#[cfg(target_os = "linux")]
const IOPRIO_CLASS_IDLE: libc::c_long = 3;
#[cfg(target_os = "linux")]
const IOPRIO_CLASS_SHIFT: u32 = 13;
#[cfg(target_os = "linux")]
const IOPRIO_WHO_PROCESS: libc::c_long = 1;

/// The calling thread's nice value, from `/proc/thread-self/stat` (field
/// 19; the command name, field 2, is in parentheses and may hold spaces).
///
/// Fails with the I/O error when the file cannot be read, or InvalidData
/// when it does not hold the field.
#[cfg(target_os = "linux")]
fn thread_nice() -> std::io::Result<i32> {
    let stat = std::fs::read_to_string("/proc/thread-self/stat")?;
    stat.rfind(')')
        .and_then(|i| stat.get(i + 2..))
        .and_then(|after| after.split(' ').nth(16))
        .and_then(|f| f.parse().ok())
        .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::InvalidData, "no nice field"))
}

/// Lowers the calling thread's CPU priority to `nice` (never raises it: a
/// thread already nicer keeps its value) and its I/O priority
/// to the idle class (Linux: both are per thread), so that the reads a merge
/// makes of the merged table's leaves and the write-back its commit forces
/// queue behind the log's forces. A thread can always lower its own
/// priority; raising it again needs privileges, which is why merges get
/// threads of their own and never borrow a pool's.
///
/// Fails with the OS error when the kernel refuses (never on Linux for a
/// lower priority; a kernel without I/O priorities keeps the CPU part);
/// elsewhere than Linux, does nothing.
pub fn lower_priority(nice: i32) -> std::io::Result<()> {
    #[cfg(target_os = "linux")]
    {
        // A privileged process could raise a thread that inherited a nicer
        // value than `nice`; keep the nicer one.
        let nice = nice.max(thread_nice()?);
        // SAFETY: gettid, setpriority and the ioprio_set system call take
        // plain integers, touch no memory of ours, and only change the
        // calling thread's own scheduling attributes; no invariant of the
        // program depends on a thread's priorities.
        let (cpu, io) = unsafe {
            let tid = libc::gettid();
            let cpu = libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, nice);
            let io = libc::syscall(
                libc::SYS_ioprio_set,
                IOPRIO_WHO_PROCESS,
                libc::c_long::from(tid),
                IOPRIO_CLASS_IDLE << IOPRIO_CLASS_SHIFT,
            );
            (cpu, io)
        };
        if cpu != 0 || io != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = nice;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    #[cfg(target_os = "linux")]
    fn own_nice() -> i32 {
        thread_nice().unwrap()
    }

    #[cfg(target_os = "linux")]
    fn own_io_class() -> libc::c_long {
        // SAFETY: ioprio_get takes plain integers and reads the calling
        // thread's own I/O priority.
        let v = unsafe {
            libc::syscall(
                libc::SYS_ioprio_get,
                IOPRIO_WHO_PROCESS,
                libc::c_long::from(libc::gettid()),
            )
        };
        assert!(v >= 0, "ioprio_get: {}", std::io::Error::last_os_error());
        v >> IOPRIO_CLASS_SHIFT
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn a_lowered_thread_runs_at_the_merge_priorities_and_others_keep_theirs() {
        let (nice, class) = (own_nice(), own_io_class());
        let inside = std::thread::spawn(|| {
            lower_priority(MERGE_NICE).unwrap();
            (own_nice(), own_io_class())
        })
        .join()
        .unwrap();
        assert_eq!(inside, (MERGE_NICE.max(nice), IOPRIO_CLASS_IDLE));
        assert_eq!(
            (own_nice(), own_io_class()),
            (nice, class),
            "only the merge thread was lowered"
        );
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn a_thread_already_nicer_than_the_merge_nice_keeps_its_value() {
        let inside = std::thread::spawn(|| {
            lower_priority(MERGE_NICE + 5).unwrap();
            lower_priority(MERGE_NICE).unwrap();
            own_nice()
        })
        .join()
        .unwrap();
        assert!(inside >= MERGE_NICE + 5, "raised back to {inside}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn merges_of_a_process_run_one_at_a_time() {
        let running = Arc::new(AtomicUsize::new(0));
        let most = Arc::new(AtomicUsize::new(0));
        let (done_tx, mut done_rx) = tokio::sync::mpsc::unbounded_channel();
        for _ in 0..6 {
            let (running, most, done) = (running.clone(), most.clone(), done_tx.clone());
            spawn_merge(move || {
                let now = running.fetch_add(1, Ordering::SeqCst) + 1;
                most.fetch_max(now, Ordering::SeqCst);
                // Give another merge every chance to overlap.
                for _ in 0..50 {
                    std::thread::yield_now();
                }
                running.fetch_sub(1, Ordering::SeqCst);
                done.send(()).unwrap();
            })
            .unwrap();
        }
        for _ in 0..6 {
            done_rx.recv().await.unwrap();
        }
        assert_eq!(most.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn without_a_runtime_the_merge_is_done_on_return() {
        let done = Arc::new(AtomicUsize::new(0));
        let d = done.clone();
        spawn_merge(move || {
            d.fetch_add(1, Ordering::SeqCst);
        })
        .unwrap();
        assert_eq!(done.load(Ordering::SeqCst), 1);
    }
}
