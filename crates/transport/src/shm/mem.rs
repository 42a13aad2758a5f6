//! Everything of the shm channel that needs `unsafe`: memfd segments and
//! their shared mappings, futex waits and wakes, passing a descriptor over a
//! Unix socket, process liveness, CPU clocks and moving a thread off a CPU.
//!
//! Owns every `unsafe` block of the shm channel, each with a `// SAFETY:`
//! comment. Must never hand out a Rust reference to shared memory other than
//! `&[AtomicU64]`: the peer process may write the segment at any moment, and
//! only atomics may be read and written while another party mutates them.
//! Everything above this module (ring, channel, bench) is safe code.

use std::ffi::CString;
use std::io;
use std::mem::{size_of, MaybeUninit};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::ptr::{self, NonNull};
use std::sync::atomic::AtomicU64;
use std::time::Duration;

/// The page size the segment layout assumes; [`Segment`] checks it.
pub(crate) const PAGE: usize = 4096;

/// Seals a received segment must carry: it can neither shrink (an access past
/// the end would raise SIGBUS) nor grow, and no seal can be added any more
/// (a later write seal would make our own mapping's writes fail).
const REQUIRED_SEALS: i32 = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;

/// Most descriptors accepted in one message (more are closed and refused).
const MAX_FDS: usize = 4;

/// Why a segment received from a peer was not mapped.
#[derive(Debug, thiserror::Error)]
pub(crate) enum SegmentError {
    /// A system call failed (for a descriptor that is not a memfd, F_GET_SEALS
    /// fails with EINVAL).
    #[error("{0}")]
    Io(#[from] io::Error),
    /// The segment lacks the seals that keep its size fixed.
    #[error("segment not sealed against resizing (seals {0:#x})")]
    NotSealed(i32),
    /// The segment's size is out of bounds or not a whole number of pages.
    #[error("segment of {0} bytes is not acceptable")]
    BadSize(u64),
}

/// A shared-memory segment: a sealed memfd mapped read-write and shared.
///
/// Seen from safe code only as a slice of `AtomicU64` words.
pub(crate) struct Segment {
    base: NonNull<AtomicU64>,
    words: usize,
    fd: OwnedFd,
}

// SAFETY: a Segment hands out only `&[AtomicU64]` (atomics are Sync) and the
// descriptor; the mapping lives until Drop, which needs exclusive access, so
// it can be used and dropped from any thread.
unsafe impl Send for Segment {}
// SAFETY: as above: every access through `&Segment` is an atomic operation or
// a read of immutable fields.
unsafe impl Sync for Segment {}

fn cvt(r: libc::c_int) -> io::Result<libc::c_int> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

fn check_page_size() -> io::Result<()> {
    // SAFETY: sysconf has no memory-safety preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if page <= 0 || !PAGE.is_multiple_of(page as usize) {
        return Err(io::Error::other(format!(
            "page size {page} does not divide the segment layout's {PAGE}"
        )));
    }
    Ok(())
}

impl Segment {
    /// Creates an owner-only (mode 0600) memfd of `bytes` bytes (a whole
    /// number of pages), seals its size and maps it.
    ///
    /// Fails with the OS error of memfd_create, ftruncate, fcntl or mmap.
    pub(crate) fn create(name: &str, bytes: usize) -> io::Result<Segment> {
        check_page_size()?;
        if bytes == 0 || !bytes.is_multiple_of(PAGE) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("segment size {bytes} is not a positive multiple of {PAGE}"),
            ));
        }
        let cname =
            CString::new(name).map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
        // SAFETY: `cname` is a valid NUL-terminated string that outlives the call.
        let raw = cvt(unsafe {
            libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING)
        })?;
        // SAFETY: memfd_create just returned this descriptor; nothing else owns it.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: plain system calls on a descriptor we own; no pointers involved.
        unsafe {
            cvt(libc::fchmod(fd.as_raw_fd(), 0o600))?;
            cvt(libc::ftruncate(fd.as_raw_fd(), bytes as libc::off_t))?;
            cvt(libc::fcntl(
                fd.as_raw_fd(),
                libc::F_ADD_SEALS,
                REQUIRED_SEALS,
            ))?;
        }
        Segment::map(fd, bytes)
    }

    /// Creates a memfd like [`Segment::create`] but without seals: only the
    /// hostile-peer helper uses it, to check that such a segment is refused.
    ///
    /// Fails with the OS error of memfd_create, ftruncate or mmap.
    pub(crate) fn create_unsealed(name: &str, bytes: usize) -> io::Result<Segment> {
        let cname =
            CString::new(name).map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
        // SAFETY: `cname` is a valid NUL-terminated string that outlives the call.
        let raw = cvt(unsafe { libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC) })?;
        // SAFETY: memfd_create just returned this descriptor; nothing else owns it.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: a plain system call on a descriptor we own.
        cvt(unsafe { libc::ftruncate(fd.as_raw_fd(), bytes as libc::off_t) })?;
        Segment::map(fd, bytes)
    }

    /// Maps a segment a peer sent, after checking that it is a memfd sealed
    /// against resizing and that its size is a whole number of pages within
    /// `min..=max` bytes.
    ///
    /// Fails with [`SegmentError`] when any check fails (the descriptor is
    /// then closed).
    pub(crate) fn open(fd: OwnedFd, min: usize, max: usize) -> Result<Segment, SegmentError> {
        check_page_size()?;
        // SAFETY: plain fcntl on a descriptor we own.
        let seals = cvt(unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) })?;
        if seals & REQUIRED_SEALS != REQUIRED_SEALS {
            return Err(SegmentError::NotSealed(seals));
        }
        let mut st = MaybeUninit::<libc::stat>::uninit();
        // SAFETY: fstat writes a whole `stat` into the buffer we pass and
        // nothing else; we read it only after it reported success.
        let st = unsafe {
            cvt(libc::fstat(fd.as_raw_fd(), st.as_mut_ptr()))?;
            st.assume_init()
        };
        let size = st.st_size as u64;
        if st.st_mode & libc::S_IFMT != libc::S_IFREG
            || size < min as u64
            || size > max as u64
            || !size.is_multiple_of(PAGE as u64)
        {
            return Err(SegmentError::BadSize(size));
        }
        Ok(Segment::map(fd, size as usize)?)
    }

    fn map(fd: OwnedFd, bytes: usize) -> io::Result<Segment> {
        // SAFETY: asks the kernel for a fresh shared mapping at an address of
        // its choosing (no existing Rust object is aliased) covering `bytes`
        // bytes of a file at least that long whose size is sealed.
        let p = unsafe {
            libc::mmap(
                ptr::null_mut(),
                bytes,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_POPULATE,
                fd.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let base = NonNull::new(p.cast::<AtomicU64>())
            .ok_or_else(|| io::Error::other("mmap returned a null mapping"))?;
        Ok(Segment {
            base,
            words: bytes / size_of::<u64>(),
            fd,
        })
    }

    /// The whole segment as 64-bit words.
    pub(crate) fn words(&self) -> &[AtomicU64] {
        // SAFETY: `base` is the start of a live mapping of `words * 8` bytes,
        // readable and writable, page-aligned (so aligned for AtomicU64), that
        // stays mapped until Drop, which cannot run while this borrow lives.
        // AtomicU64 has the size and alignment of u64 and allows concurrent
        // mutation, so the peer process writing any of these words at any time
        // is never a data race in Rust's model: it changes values, never the
        // validity of the memory. The size is sealed (checked in `open`, set in
        // `create`), so no access within the slice can fault.
        unsafe { std::slice::from_raw_parts(self.base.as_ptr(), self.words) }
    }

    /// The segment's descriptor (to send it to the peer).
    pub(crate) fn fd(&self) -> BorrowedFd<'_> {
        use std::os::fd::AsFd;
        self.fd.as_fd()
    }

    /// Size in bytes.
    pub(crate) fn len_bytes(&self) -> usize {
        self.words * size_of::<u64>()
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the mapping made in `map`; `&mut self` proves
        // no borrow of `words()` is alive. The memory goes away for this
        // process only; the peer keeps its own mapping.
        unsafe {
            libc::munmap(self.base.as_ptr().cast(), self.len_bytes());
        }
    }
}

/// Address of the 32-bit futex word inside a 64-bit atomic: its low half.
fn futex_word(word: &AtomicU64) -> *const u32 {
    let p = word.as_ptr().cast::<u32>().cast_const();
    if cfg!(target_endian = "big") {
        p.wrapping_add(1)
    } else {
        p
    }
}

/// Sleeps while the low 32 bits of `word` equal `expected`, until woken by
/// [`futex_wake`] (from this or another process mapping the same segment),
/// a signal, or `timeout`. Spurious returns are possible: callers re-check.
pub(crate) fn futex_wait(word: &AtomicU64, expected: u32, timeout: Duration) {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs().min(i32::MAX as u64) as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: the futex address is the aligned low half of an AtomicU64
    // borrowed for the whole call (the kernel only reads it atomically and
    // keeps no reference after returning); `ts` outlives the call. The futex is
    // shared (no FUTEX_PRIVATE_FLAG) because the other process waits on or
    // wakes the same physical page.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            futex_word(word),
            libc::FUTEX_WAIT,
            expected,
            &ts as *const libc::timespec,
            ptr::null::<u32>(),
            0u32,
        );
    }
}

/// Wakes up to `n` waiters sleeping in [`futex_wait`] on `word`.
pub(crate) fn futex_wake(word: &AtomicU64, n: i32) {
    // SAFETY: as in `futex_wait`: an aligned address inside a live borrow;
    // FUTEX_WAKE does not even read the word.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            futex_word(word),
            libc::FUTEX_WAKE,
            n,
            ptr::null::<libc::timespec>(),
            ptr::null::<u32>(),
            0u32,
        );
    }
}

/// A control-message buffer aligned for `cmsghdr`, large enough for
/// [`MAX_FDS`] descriptors.
#[repr(C, align(8))]
struct CmsgBuf([u8; 64]);

/// Sends `data` with one descriptor attached (SCM_RIGHTS) on a connected Unix
/// socket, without blocking.
///
/// Fails with WouldBlock when the socket buffer is full, or the OS error.
pub(crate) fn send_with_fd(
    sock: BorrowedFd<'_>,
    data: &[u8],
    fd: BorrowedFd<'_>,
) -> io::Result<usize> {
    let mut cbuf = CmsgBuf([0; 64]);
    let raw: RawFd = fd.as_raw_fd();
    // SAFETY: CMSG_SPACE/CMSG_LEN are pure arithmetic.
    let (space, len) = unsafe {
        (
            libc::CMSG_SPACE(size_of::<RawFd>() as u32) as usize,
            libc::CMSG_LEN(size_of::<RawFd>() as u32) as usize,
        )
    };
    debug_assert!(space <= cbuf.0.len());
    let mut iov = libc::iovec {
        iov_base: data.as_ptr() as *mut libc::c_void,
        iov_len: data.len(),
    };
    // SAFETY: an all-zero msghdr is a valid "empty" message header.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.0.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    // SAFETY: `msg` points at `cbuf`, which is aligned for cmsghdr and at
    // least CMSG_SPACE(4) bytes long, so CMSG_FIRSTHDR returns a pointer to a
    // whole header inside it, and CMSG_DATA points at 4 writable bytes in it.
    // sendmsg only reads `data` (through `iov`) and `cbuf`, both alive for
    // the call; the kernel duplicates the descriptor, we keep ours.
    unsafe {
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        if cmsg.is_null() {
            return Err(io::Error::other("no room for the control message"));
        }
        (*cmsg).cmsg_level = libc::SOL_SOCKET;
        (*cmsg).cmsg_type = libc::SCM_RIGHTS;
        (*cmsg).cmsg_len = len as _;
        ptr::write_unaligned(libc::CMSG_DATA(cmsg).cast::<RawFd>(), raw);
        let n = libc::sendmsg(
            sock.as_raw_fd(),
            &msg,
            libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
        );
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(n as usize)
    }
}

/// Receives bytes into `buf` and any descriptors sent with them (opened
/// close-on-exec) from a Unix socket, without blocking.
///
/// Fails with WouldBlock when nothing is waiting, InvalidData when more
/// descriptors than accepted were sent (all of them are closed), or the OS
/// error.
pub(crate) fn recv_with_fd(
    sock: BorrowedFd<'_>,
    buf: &mut [u8],
) -> io::Result<(usize, Vec<OwnedFd>)> {
    let mut cbuf = CmsgBuf([0; 64]);
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    // SAFETY: an all-zero msghdr is a valid "empty" message header.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.0.as_mut_ptr().cast();
    msg.msg_controllen = cbuf.0.len() as _;
    // SAFETY: recvmsg writes at most `buf.len()` bytes into `buf` and at most
    // `cbuf.len()` bytes into `cbuf`, both exclusively borrowed for the call.
    let n = unsafe {
        libc::recvmsg(
            sock.as_raw_fd(),
            &mut msg,
            libc::MSG_DONTWAIT | libc::MSG_CMSG_CLOEXEC,
        )
    };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut fds = Vec::new();
    // SAFETY: the kernel filled `cbuf` with `msg_controllen` bytes of
    // well-formed control messages; CMSG_FIRSTHDR/CMSG_NXTHDR stay within
    // them and return null at the end. Each SCM_RIGHTS payload holds
    // `(cmsg_len - CMSG_LEN(0)) / 4` descriptors freshly installed in this
    // process for us alone, so wrapping each in an OwnedFd is sound; they are
    // read unaligned because the payload carries no alignment promise.
    unsafe {
        let header_len = libc::CMSG_LEN(0) as usize;
        let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
        while !cmsg.is_null() {
            if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                let count =
                    ((*cmsg).cmsg_len as usize).saturating_sub(header_len) / size_of::<RawFd>();
                let data = libc::CMSG_DATA(cmsg).cast::<RawFd>();
                for i in 0..count {
                    let raw = ptr::read_unaligned(data.add(i));
                    if raw >= 0 {
                        fds.push(OwnedFd::from_raw_fd(raw));
                    }
                }
            }
            cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
        }
    }
    if msg.msg_flags & libc::MSG_CTRUNC != 0 || fds.len() > MAX_FDS {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "too many descriptors in one message",
        ));
    }
    Ok((n as usize, fds))
}

/// Tries to shrink the file behind `fd` to nothing (the hostile-peer helper
/// checks that a sealed segment refuses).
///
/// Fails with EPERM for a sealed segment, else the OS error.
pub(crate) fn try_shrink(fd: BorrowedFd<'_>) -> io::Result<()> {
    // SAFETY: a plain system call on a borrowed descriptor; no pointers.
    cvt(unsafe { libc::ftruncate(fd.as_raw_fd(), 0) }).map(|_| ())
}

/// True when process `pid` exists (possibly owned by another user).
pub(crate) fn process_alive(pid: u32) -> bool {
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return false;
    };
    if pid <= 0 {
        // 0 and negative pids name process groups, never one process.
        return false;
    }
    // SAFETY: signal 0 performs only the existence and permission check on
    // the one process `pid > 0` names; nothing is delivered.
    let r = unsafe { libc::kill(pid, 0) };
    r == 0 || io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

/// The CPU the calling thread runs on right now (`u32::MAX` if unknown).
pub(crate) fn current_cpu() -> u32 {
    // SAFETY: sched_getcpu has no preconditions (a vDSO call on Linux).
    let cpu = unsafe { libc::sched_getcpu() };
    u32::try_from(cpu).unwrap_or(u32::MAX)
}

/// The CPUs the calling thread may run on, or `None` if the kernel would
/// not say.
fn allowed_cpus() -> Option<libc::cpu_set_t> {
    // SAFETY: cpu_set_t is a plain bit array, for which all zeroes is a
    // valid (empty) set; sched_getaffinity writes at most `size_of` bytes
    // into the set it is given a pointer to, which lives for the call.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        let r = libc::sched_getaffinity(0, size_of::<libc::cpu_set_t>(), &mut set);
        (r == 0).then_some(set)
    }
}

/// Moves the calling thread off `cpu` onto another CPU it may run on, and
/// leaves the set of CPUs it may run on as it was: the kernel migrates a
/// thread at once when its own affinity excludes the CPU it runs on, and
/// widening the set again does not move it back.
///
/// Returns the CPU the thread runs on afterwards, or `None` (nothing
/// changed) when `cpu` is not one it may run on, there is no other, or the
/// kernel refused.
pub(crate) fn move_off_cpu(cpu: u32) -> Option<u32> {
    let cpu = usize::try_from(cpu).ok()?;
    if cpu >= libc::CPU_SETSIZE as usize {
        return None;
    }
    let allowed = allowed_cpus()?;
    let mut elsewhere = allowed;
    // SAFETY: `cpu` is below CPU_SETSIZE (checked above), so the macros
    // index within the set; sched_setaffinity only reads the set it is
    // given, which lives for the call.
    unsafe {
        if !libc::CPU_ISSET(cpu, &allowed) {
            return None;
        }
        libc::CPU_CLR(cpu, &mut elsewhere);
        if libc::CPU_COUNT(&elsewhere) == 0 {
            return None;
        }
        let size = size_of::<libc::cpu_set_t>();
        if libc::sched_setaffinity(0, size, &elsewhere) != 0 {
            return None;
        }
        // Failing to widen the set again would leave the thread pinned off
        // one CPU: harmless, and nothing better could be done.
        let _ = libc::sched_setaffinity(0, size, &allowed);
    }
    Some(current_cpu())
}

/// This process's real user id.
pub(crate) fn uid() -> u32 {
    // SAFETY: getuid has no preconditions and cannot fail.
    unsafe { libc::getuid() }
}

/// Sets or clears close-on-exec on `fd` (a child process inherits the
/// descriptors without it).
///
/// Fails with the OS error of fcntl.
pub(crate) fn set_inheritable(fd: BorrowedFd<'_>, inheritable: bool) -> io::Result<()> {
    // SAFETY: plain fcntl calls on a descriptor borrowed for the call.
    unsafe {
        let flags = cvt(libc::fcntl(fd.as_raw_fd(), libc::F_GETFD))?;
        let flags = if inheritable {
            flags & !libc::FD_CLOEXEC
        } else {
            flags | libc::FD_CLOEXEC
        };
        cvt(libc::fcntl(fd.as_raw_fd(), libc::F_SETFD, flags))?;
    }
    Ok(())
}

/// Takes ownership of descriptor `raw`, inherited from the parent process
/// (its number came on the command line).
///
/// Fails with EBADF when no such descriptor is open, InvalidInput for the
/// standard streams.
pub(crate) fn adopt_inherited_fd(raw: RawFd) -> io::Result<OwnedFd> {
    if raw <= 2 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "refusing to adopt a standard stream",
        ));
    }
    // SAFETY: F_GETFD only checks that the descriptor is open.
    cvt(unsafe { libc::fcntl(raw, libc::F_GETFD) })?;
    // SAFETY: the descriptor is open, and in this freshly started helper
    // process nothing else owns it: the parent passed it for our use alone.
    Ok(unsafe { OwnedFd::from_raw_fd(raw) })
}

/// CPU time (user + system, all threads, exited ones included) used so far by
/// process `pid` (0 for this process).
///
/// Fails with ESRCH when the process does not exist.
pub(crate) fn process_cpu_time(pid: u32) -> io::Result<Duration> {
    let pid = libc::pid_t::try_from(pid)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "pid out of range"))?;
    let mut clock: libc::clockid_t = 0;
    // SAFETY: clock_getcpuclockid writes one clockid_t into `clock`.
    let r = unsafe { libc::clock_getcpuclockid(pid, &mut clock) };
    if r != 0 {
        return Err(io::Error::from_raw_os_error(r));
    }
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec into `ts`.
    cvt(unsafe { libc::clock_gettime(clock, &mut ts) })?;
    Ok(Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;
    use std::sync::atomic::Ordering;

    #[test]
    fn created_segment_is_sealed_private_and_shared_between_mappings() {
        let a = Segment::create("weft-test", 2 * PAGE).expect("memfd");
        let dup = a.fd().try_clone_to_owned().expect("dup");
        let b = Segment::open(dup, PAGE, 4 * PAGE).expect("reopen");
        a.words()[3].store(0xfeed, Ordering::Release);
        assert_eq!(b.words()[3].load(Ordering::Acquire), 0xfeed);
        assert_eq!(b.words().len(), 2 * PAGE / 8);
        // Neither side can shrink it any more.
        // SAFETY (test): ftruncate on a descriptor we own.
        let r = unsafe { libc::ftruncate(a.fd().as_raw_fd(), 0) };
        assert!(r < 0, "a sealed segment must refuse to shrink");
        let meta = std::fs::metadata(format!("/proc/self/fd/{}", a.fd().as_raw_fd())).unwrap();
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(meta.permissions().mode() & 0o777, 0o600);
    }

    #[test]
    fn unsealed_or_odd_sized_segments_are_refused() {
        let file = tempfile_fd();
        assert!(matches!(
            Segment::open(file, PAGE, 4 * PAGE),
            Err(SegmentError::Io(_)) | Err(SegmentError::NotSealed(_))
        ));
        let a = Segment::create("weft-test", PAGE).expect("memfd");
        let dup = a.fd().try_clone_to_owned().unwrap();
        assert!(matches!(
            Segment::open(dup, 2 * PAGE, 4 * PAGE),
            Err(SegmentError::BadSize(4096))
        ));
    }

    fn tempfile_fd() -> OwnedFd {
        let path = std::env::temp_dir().join(format!("weft-mem-test-{}", std::process::id()));
        let f = std::fs::File::create(&path).unwrap();
        f.set_len(PAGE as u64).unwrap();
        let _ = std::fs::remove_file(&path);
        f.into()
    }

    #[test]
    fn futex_wait_returns_on_value_change_and_timeout() {
        let w = AtomicU64::new(1);
        // Value differs: returns at once.
        futex_wait(&w, 0, Duration::from_secs(5));
        // Same value: times out.
        let t = std::time::Instant::now();
        futex_wait(&w, 1, Duration::from_millis(5));
        assert!(t.elapsed() >= Duration::from_millis(4));
        futex_wake(&w, 1);
    }

    #[test]
    fn descriptors_travel_over_a_socket_pair() {
        let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        let seg = Segment::create("weft-test", PAGE).unwrap();
        seg.words()[1].store(42, Ordering::Relaxed);
        assert_eq!(send_with_fd(a.as_fd(), b"hello", seg.fd()).unwrap(), 5);
        let mut buf = [0u8; 16];
        let (n, fds) = recv_with_fd(b.as_fd(), &mut buf).unwrap();
        assert_eq!(&buf[..n], b"hello");
        assert_eq!(fds.len(), 1);
        let other = Segment::open(fds.into_iter().next().unwrap(), PAGE, PAGE).unwrap();
        assert_eq!(other.words()[1].load(Ordering::Relaxed), 42);
        // Nothing more waiting: WouldBlock, not a hang.
        let e = recv_with_fd(b.as_fd(), &mut buf).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::WouldBlock);
    }

    #[test]
    fn moving_off_a_cpu_lands_elsewhere_and_keeps_the_allowed_set() {
        // In a thread of its own: the test harness's threads keep theirs.
        std::thread::spawn(|| {
            let before = allowed_cpus().expect("affinity readable");
            // SAFETY (test): reading a set the kernel filled.
            let usable = unsafe { libc::CPU_COUNT(&before) };
            let here = current_cpu();
            let moved = move_off_cpu(here);
            if usable >= 2 {
                let there = moved.expect("another CPU is allowed");
                assert_ne!(there, here, "the thread left its CPU");
            } else {
                assert_eq!(moved, None, "nowhere else to go");
            }
            let after = allowed_cpus().unwrap();
            // SAFETY (test): indices below CPU_SETSIZE.
            let same = (0..libc::CPU_SETSIZE as usize)
                .all(|c| unsafe { libc::CPU_ISSET(c, &before) == libc::CPU_ISSET(c, &after) });
            assert!(same, "the allowed set is unchanged");
            assert_eq!(move_off_cpu(u32::MAX), None);
            assert_eq!(move_off_cpu(libc::CPU_SETSIZE as u32), None);
        })
        .join()
        .unwrap();
    }

    #[test]
    fn liveness_and_cpu_clock() {
        assert!(current_cpu() < 4096);
        assert!(process_alive(std::process::id()));
        assert!(!process_alive(0));
        assert!(!process_alive(u32::MAX));
        let t = process_cpu_time(std::process::id()).unwrap();
        assert!(t > Duration::ZERO);
        assert!(adopt_inherited_fd(1).is_err());
        assert!(adopt_inherited_fd(987_654).is_err());
    }
}
