//! Capturing an unmodified program's file changes: each directory named with
//! `--fs` is covered, for the program only, by an overlay mount in a private
//! mount namespace; the program writes into the overlay's upper directory,
//! a private scratch directory, and the directories themselves stay as they
//! were. After the program exits, [`Capture::changes`] reads the upper
//! directory back as a list of [`Change`]s (new and modified files,
//! deletions from whiteouts, replaced directories from opaque markers); the
//! caller applies them in its transaction, or drops them.
//!
//! Owns the scratch directories (one per run, locked by the `weft run` that
//! made it, removed when it ends, and removed by the next run when a crash
//! left one), the namespace and mount set-up done in the child between fork
//! and exec, and the reading of overlayfs' upper-directory format. Must
//! never write into a captured directory itself, and never do anything in
//! the forked child but system calls on memory prepared before the fork.

use std::ffi::{CString, OsStr};
use std::fs::File;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::time::SystemTime;

/// Most directories one run may capture.
pub const MAX_DIRS: usize = 16;

/// Most changes one run may produce (each is one file operation in the
/// transaction): beyond it the run fails instead of building an unbounded
/// list.
pub const MAX_CHANGES: usize = 1_000_000;

/// Why capturing failed.
#[derive(Debug, thiserror::Error)]
pub enum CaptureError {
    /// A `--fs` directory is unusable (missing, not a directory, nested in
    /// another one, too many).
    #[error("{0}")]
    BadDir(String),
    /// The scratch area could not be made or read.
    #[error("scratch directory {path}: {source}")]
    Scratch {
        /// The path.
        path: PathBuf,
        /// The error.
        source: io::Error,
    },
    /// The program made something a volume cannot hold (a device, a fifo,
    /// a socket).
    #[error("{path}: the program made a {kind}, which a weft volume cannot hold")]
    Unsupported {
        /// The path, relative to its directory.
        path: PathBuf,
        /// What it is.
        kind: &'static str,
    },
    /// More than [`MAX_CHANGES`] changes.
    #[error("the program made more than {MAX_CHANGES} file changes")]
    TooMany,
}

impl CaptureError {
    fn scratch(path: &Path, source: io::Error) -> CaptureError {
        CaptureError::Scratch {
            path: path.to_path_buf(),
            source,
        }
    }
}

/// One change a program made inside a captured directory. Paths are
/// relative to that directory. Applied in order, they turn the directory as
/// it was into the directory as the program left it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Change {
    /// Remove the entry (a file, or a directory with all it holds).
    Remove(PathBuf),
    /// Remove everything inside the directory (the program removed it and
    /// made a new one under the same name).
    Clear(PathBuf),
    /// Make a directory.
    Mkdir(PathBuf),
    /// Make a symbolic link (the name is free: a removal comes first when
    /// it was taken).
    Symlink {
        /// The link.
        path: PathBuf,
        /// What it points to, as the program wrote it.
        target: PathBuf,
    },
    /// Make the file hold exactly the contents of `from` (a file in the
    /// scratch area), creating it if needed.
    Write {
        /// The file.
        path: PathBuf,
        /// Its new contents.
        from: PathBuf,
        /// Their length.
        len: u64,
    },
}

impl Change {
    /// The path the change is about.
    pub fn path(&self) -> &Path {
        match self {
            Change::Remove(p) | Change::Clear(p) | Change::Mkdir(p) => p,
            Change::Write { path, .. } | Change::Symlink { path, .. } => path,
        }
    }
}

/// One captured directory.
#[derive(Debug)]
pub struct CapturedDir {
    /// The directory (canonical path).
    pub dir: PathBuf,
    upper: PathBuf,
    work: PathBuf,
}

/// The scratch area and mounts of one run.
#[derive(Debug)]
pub struct Capture {
    /// The captured directories.
    pub dirs: Vec<CapturedDir>,
    scratch: PathBuf,
    /// Held while the run lives: the next run removes scratch areas whose
    /// lock is free (their run crashed).
    _lock: File,
    started: SystemTime,
}

/// The scratch area root for the volume directory `dir`: beside it, so that
/// the upper directory is on the same file system and a crash leaves it
/// where the next run on that directory looks.
pub fn scratch_root(dir: &Path) -> PathBuf {
    weft_dir(dir).join("run")
}

/// `.NAME.weft` beside `dir` (the directory itself for `/`).
pub fn weft_dir(dir: &Path) -> PathBuf {
    match (dir.parent(), dir.file_name()) {
        (Some(parent), Some(name)) => {
            let mut n = std::ffi::OsString::from(".");
            n.push(name);
            n.push(".weft");
            parent.join(n)
        }
        _ => dir.join(".weft"),
    }
}

impl Capture {
    /// Makes a fresh scratch area under `root` for `dirs` (each must exist
    /// and be a directory; none may contain another), after removing the
    /// areas crashed runs left there.
    ///
    /// Fails with BadDir for an unusable directory, Scratch when the area
    /// cannot be made.
    pub fn prepare(root: &Path, dirs: &[PathBuf]) -> Result<Capture, CaptureError> {
        if dirs.len() > MAX_DIRS {
            return Err(CaptureError::BadDir(format!(
                "{} directories (at most {MAX_DIRS})",
                dirs.len()
            )));
        }
        let mut canon = Vec::new();
        for d in dirs {
            let c = std::fs::canonicalize(d)
                .map_err(|e| CaptureError::BadDir(format!("{}: {e}", d.display())))?;
            if !c.is_dir() {
                return Err(CaptureError::BadDir(format!(
                    "{} is not a directory",
                    d.display()
                )));
            }
            canon.push(c);
        }
        for (i, a) in canon.iter().enumerate() {
            for (j, b) in canon.iter().enumerate() {
                if i != j && b.starts_with(a) {
                    return Err(CaptureError::BadDir(format!(
                        "{} is inside {} (name each directory once)",
                        b.display(),
                        a.display()
                    )));
                }
            }
            if root.starts_with(a) {
                return Err(CaptureError::BadDir(format!(
                    "the scratch area {} is inside {}",
                    root.display(),
                    a.display()
                )));
            }
        }
        std::fs::create_dir_all(root).map_err(|e| CaptureError::scratch(root, e))?;
        clean_stale(root);
        let scratch = root.join(format!(
            "{}-{}",
            std::process::id(),
            SystemTime::now()
                .duration_since(SystemTime::UNIX_EPOCH)
                .map(|d| d.as_nanos())
                .unwrap_or(0)
        ));
        std::fs::create_dir(&scratch).map_err(|e| CaptureError::scratch(&scratch, e))?;
        let lock_path = scratch.join("lock");
        let lock = File::create(&lock_path).map_err(|e| CaptureError::scratch(&lock_path, e))?;
        lock.try_lock()
            .map_err(|e| CaptureError::scratch(&lock_path, io::Error::other(e.to_string())))?;
        // The start as the file system's clock sees it (coarse, like the
        // change times it is compared with).
        let started = lock
            .metadata()
            .and_then(|m| m.modified())
            .map_err(|e| CaptureError::scratch(&lock_path, e))?;
        let mut out = Vec::new();
        for (i, dir) in canon.into_iter().enumerate() {
            let upper = scratch.join(format!("upper{i}"));
            let work = scratch.join(format!("work{i}"));
            for p in [&upper, &work] {
                std::fs::create_dir(p).map_err(|e| CaptureError::scratch(p, e))?;
            }
            out.push(CapturedDir { dir, upper, work });
        }
        Ok(Capture {
            dirs: out,
            scratch,
            _lock: lock,
            started,
        })
    }

    /// When the run began, by the file system's clock: a captured file whose
    /// change time is not before it was changed by someone else while the
    /// program ran.
    pub fn started(&self) -> SystemTime {
        self.started
    }

    /// Arranges for `cmd`, between fork and exec, to enter a private mount
    /// namespace (a user namespace too when not root), mount the overlays
    /// and go (back) to `cwd` through them.
    ///
    /// Fails with BadDir when a path holds a NUL byte.
    pub fn install(
        &self,
        cmd: &mut tokio::process::Command,
        cwd: &Path,
    ) -> Result<(), CaptureError> {
        let mut mounts = Vec::new();
        for d in &self.dirs {
            let opts = |userxattr: bool, volatile: bool| {
                let mut o = b"lowerdir=".to_vec();
                o.extend_from_slice(&escape(&d.dir));
                o.extend_from_slice(b",upperdir=");
                o.extend_from_slice(&escape(&d.upper));
                o.extend_from_slice(b",workdir=");
                o.extend_from_slice(&escape(&d.work));
                // Renamed directories are copied (no redirects: rename(2)
                // of a lower directory answers EXDEV, and mv copies), so the
                // upper directory holds plain files and whiteouts only. In a
                // user namespace `off` may mean `follow`, which userxattr
                // refuses; `nofollow` neither makes nor follows redirects.
                if userxattr {
                    o.extend_from_slice(b",redirect_dir=nofollow,index=off,metacopy=off,userxattr");
                } else {
                    o.extend_from_slice(b",redirect_dir=off,index=off,metacopy=off");
                }
                // `volatile`: the overlay never syncs its upper directory.
                // Without it, unmounting the overlay (when the program's
                // mount namespace dies) syncs the whole file system under
                // the scratch area: every dirty page of every process on
                // it, tens of milliseconds on a busy disk. Nothing needs
                // that sync: what the run keeps is taken out of the upper
                // directory and forced by the file store at prepare; the
                // rest is thrown away, and a crashed run's scratch area is
                // removed unread (a volatile upper directory is unusable
                // after a crash, and never reused).
                if volatile {
                    o.extend_from_slice(b",volatile");
                }
                o
            };
            let c = |userxattr, volatile| cstring(OsStr::from_bytes(&opts(userxattr, volatile)));
            mounts.push(MountSpec {
                target: cstring(d.dir.as_os_str())?,
                opts_root: [c(false, true)?, c(false, false)?],
                opts_user: [c(true, true)?, c(true, false)?],
            });
        }
        let setup = ChildSetup {
            mounts,
            cwd: cstring(cwd.as_os_str())?,
            // SAFETY: getuid/getgid have no preconditions and cannot fail.
            uid_map: CString::new(format!("0 {} 1\n", unsafe { libc::getuid() })).expect("no NUL"),
            // SAFETY: as above.
            gid_map: CString::new(format!("0 {} 1\n", unsafe { libc::getgid() })).expect("no NUL"),
        };
        // SAFETY: the closure runs in the forked child before exec. It
        // only makes system calls (unshare, mount, open, write, close,
        // chdir, prctl) on memory prepared above and owned by the closure;
        // it allocates nothing, takes no lock and touches no state shared
        // with the parent's other threads, so it is async-signal-safe.
        // Exercised by every test in crates/cli/tests/run_*.rs.
        unsafe {
            cmd.pre_exec(move || setup.enter());
        }
        Ok(())
    }

    /// The changes the program made, directory by directory (same order as
    /// [`Capture::dirs`]), read from the upper directories.
    ///
    /// Fails with Scratch when the upper directory cannot be read,
    /// Unsupported for an entry a volume cannot hold, TooMany beyond
    /// [`MAX_CHANGES`].
    pub fn changes(&self) -> Result<Vec<Vec<Change>>, CaptureError> {
        let mut total = 0;
        let mut all = Vec::new();
        for d in &self.dirs {
            let mut out = Vec::new();
            walk(&d.upper, &d.dir, Path::new(""), &mut out, &mut total)?;
            all.push(out);
        }
        Ok(all)
    }

    /// Removes the scratch area.
    pub fn discard(self) {
        remove_scratch(&self.scratch);
    }
}

/// Removes a scratch area; overlayfs leaves its work directory (and, for a
/// volatile overlay, the `incompat/volatile` directories in it) without
/// permissions, so those are restored first where needed.
fn remove_scratch(path: &Path) {
    if std::fs::remove_dir_all(path).is_ok() {
        return;
    }
    open_up(path);
    if let Err(e) = std::fs::remove_dir_all(path) {
        tracing::warn!("cannot remove the scratch area {}: {e}", path.display());
    }
}

/// Gives every directory under `dir` (not following links) its owner's
/// permissions, so that it can be listed and emptied.
fn open_up(dir: &Path) {
    use std::os::unix::fs::PermissionsExt;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let _ = std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o700));
        if let Ok(entries) = std::fs::read_dir(&d) {
            stack.extend(
                entries
                    .flatten()
                    .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
                    .map(|e| e.path()),
            );
        }
    }
}

/// Removes scratch areas under `root` whose run is gone (their lock is
/// free).
fn clean_stale(root: &Path) {
    let Ok(entries) = std::fs::read_dir(root) else {
        return;
    };
    for e in entries.flatten() {
        let p = e.path();
        let stale = match File::open(p.join("lock")) {
            Ok(f) => f.try_lock().is_ok(),
            // No lock file: a run that crashed before making it.
            Err(_) => true,
        };
        if stale {
            tracing::info!("removing the scratch area {} of a crashed run", p.display());
            remove_scratch(&p);
        }
    }
}

fn cstring(s: &OsStr) -> Result<CString, CaptureError> {
    CString::new(s.as_bytes()).map_err(|_| CaptureError::BadDir(format!("{s:?} holds a NUL byte")))
}

/// Escapes the characters overlayfs' option parser treats specially.
fn escape(p: &Path) -> Vec<u8> {
    let mut out = Vec::new();
    for &b in p.as_os_str().as_bytes() {
        if matches!(b, b',' | b':' | b'\\') {
            out.push(b'\\');
        }
        out.push(b);
    }
    out
}

struct MountSpec {
    target: CString,
    /// Mount options as root, with `volatile` then without (a kernel
    /// before 5.10 refuses it with EINVAL).
    opts_root: [CString; 2],
    /// The same in a user namespace (`userxattr`).
    opts_user: [CString; 2],
}

/// Everything the child needs between fork and exec, prepared before the
/// fork.
struct ChildSetup {
    mounts: Vec<MountSpec>,
    cwd: CString,
    uid_map: CString,
    gid_map: CString,
}

impl ChildSetup {
    /// Runs in the forked child: system calls only.
    fn enter(&self) -> io::Result<()> {
        // SAFETY (whole function): every pointer passed is to a
        // NUL-terminated CString owned by `self`, or null where the call
        // allows it; no call here allocates or locks.
        unsafe {
            // The program dies with `weft run`: a crashed run must not leave
            // it writing into a scratch area the next run removes.
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong) != 0 {
                return Err(io::Error::last_os_error());
            }
            let mut userns = false;
            if libc::unshare(libc::CLONE_NEWNS) != 0 {
                let e = io::Error::last_os_error();
                if e.raw_os_error() != Some(libc::EPERM) {
                    return Err(e);
                }
                // Not root: a user namespace of our own maps us to its root.
                if libc::unshare(libc::CLONE_NEWUSER | libc::CLONE_NEWNS) != 0 {
                    return Err(io::Error::last_os_error());
                }
                write_proc(c"/proc/self/setgroups", c"deny\n")?;
                write_proc(c"/proc/self/uid_map", &self.uid_map)?;
                write_proc(c"/proc/self/gid_map", &self.gid_map)?;
                userns = true;
            }
            // Nothing mounted here may show outside.
            if libc::mount(
                std::ptr::null(),
                c"/".as_ptr(),
                std::ptr::null(),
                libc::MS_REC | libc::MS_PRIVATE,
                std::ptr::null(),
            ) != 0
            {
                return Err(io::Error::last_os_error());
            }
            for m in &self.mounts {
                let opts = if userns { &m.opts_user } else { &m.opts_root };
                let mount = |o: &CString| {
                    libc::mount(
                        c"overlay".as_ptr(),
                        m.target.as_ptr(),
                        c"overlay".as_ptr(),
                        0,
                        o.as_ptr().cast(),
                    )
                };
                if mount(&opts[0]) != 0 {
                    let e = io::Error::last_os_error();
                    if e.raw_os_error() != Some(libc::EINVAL) {
                        return Err(e);
                    }
                    if mount(&opts[1]) != 0 {
                        return Err(io::Error::last_os_error());
                    }
                }
            }
            // The working directory was entered before the mounts: enter it
            // again through them.
            if libc::chdir(self.cwd.as_ptr()) != 0 {
                return Err(io::Error::last_os_error());
            }
        }
        Ok(())
    }
}

/// Writes `data` to a /proc file (system calls only).
///
/// # Safety
/// Only calls open/write/close on the given NUL-terminated strings.
unsafe fn write_proc(path: &std::ffi::CStr, data: &std::ffi::CStr) -> io::Result<()> {
    // SAFETY: both pointers are NUL-terminated strings that outlive the
    // calls; the length passed to write is that of `data`.
    unsafe {
        let fd = libc::open(path.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        let bytes = data.to_bytes();
        let n = libc::write(fd, bytes.as_ptr().cast(), bytes.len());
        let e = io::Error::last_os_error();
        libc::close(fd);
        if n != bytes.len() as isize {
            return Err(e);
        }
    }
    Ok(())
}

/// True when `dir` (in an upper directory) carries overlayfs' opaque mark:
/// it replaced a directory of the same name, whose contents are gone.
fn is_opaque(dir: &Path) -> bool {
    let Ok(path) = CString::new(dir.as_os_str().as_bytes()) else {
        return false;
    };
    for name in [c"trusted.overlay.opaque", c"user.overlay.opaque"] {
        let mut buf = [0u8; 4];
        // SAFETY: `path` and `name` are NUL-terminated; `buf` is a live
        // buffer of the length passed.
        let n = unsafe {
            libc::lgetxattr(
                path.as_ptr(),
                name.as_ptr(),
                buf.as_mut_ptr().cast(),
                buf.len(),
            )
        };
        if n >= 1 && buf[0] == b'y' {
            return true;
        }
    }
    false
}

/// True when the copied-up file `up` holds the same bytes as the file
/// `low` below it. Overlayfs keeps a file's modification time when it
/// copies it up and every write changes it, so only a file of the same
/// length and time is compared (whole), and any other is taken as changed.
fn unchanged(up: &Path, um: &std::fs::Metadata, low: &Path, lm: &std::fs::Metadata) -> bool {
    if um.len() != lm.len() || um.mtime() != lm.mtime() || um.mtime_nsec() != lm.mtime_nsec() {
        return false;
    }
    let (Ok(mut a), Ok(mut b)) = (File::open(up), File::open(low)) else {
        return false;
    };
    let (mut x, mut y) = (vec![0u8; 64 << 10], vec![0u8; 64 << 10]);
    loop {
        use std::io::Read;
        let n = match a.read(&mut x) {
            Ok(n) => n,
            Err(_) => return false,
        };
        if n == 0 {
            return matches!(b.read(&mut y[..1]), Ok(0));
        }
        if b.read_exact(&mut y[..n]).is_err() || x[..n] != y[..n] {
            return false;
        }
    }
}

/// Reads the upper directory `upper` (at `rel` under the captured
/// directory `lower`) into changes, depth first, removals of a directory's
/// entries before anything made in it.
fn walk(
    upper: &Path,
    lower: &Path,
    rel: &Path,
    out: &mut Vec<Change>,
    total: &mut usize,
) -> Result<(), CaptureError> {
    let here = upper.join(rel);
    let mut entries: Vec<_> = std::fs::read_dir(&here)
        .map_err(|e| CaptureError::scratch(&here, e))?
        .map(|e| e.map(|e| e.file_name()))
        .collect::<Result<_, _>>()
        .map_err(|e| CaptureError::scratch(&here, e))?;
    entries.sort();
    fn push(out: &mut Vec<Change>, total: &mut usize, c: Change) -> Result<(), CaptureError> {
        *total += 1;
        if *total > MAX_CHANGES {
            return Err(CaptureError::TooMany);
        }
        out.push(c);
        Ok(())
    }
    let mut later = Vec::new();
    for name in entries {
        let r = rel.join(&name);
        let up = upper.join(&r);
        let meta = std::fs::symlink_metadata(&up).map_err(|e| CaptureError::scratch(&up, e))?;
        let ft = meta.file_type();
        if ft.is_char_device() && meta.rdev() == 0 {
            // A whiteout: the program removed this name.
            push(out, total, Change::Remove(r))?;
        } else {
            later.push((r, up, meta));
        }
    }
    for (r, up, meta) in later {
        let ft = meta.file_type();
        let below = std::fs::symlink_metadata(lower.join(&r)).ok();
        if ft.is_dir() {
            match below {
                Some(b) if b.is_dir() => {
                    if is_opaque(&up) {
                        push(out, total, Change::Clear(r.clone()))?;
                    }
                }
                Some(_) => {
                    push(out, total, Change::Remove(r.clone()))?;
                    push(out, total, Change::Mkdir(r.clone()))?;
                }
                None => push(out, total, Change::Mkdir(r.clone()))?,
            }
            walk(upper, lower, &r, out, total)?;
        } else if ft.is_file() {
            if below.as_ref().is_some_and(|b| b.is_dir()) {
                push(out, total, Change::Remove(r.clone()))?;
            }
            if let Some(b) = below.as_ref().filter(|b| b.is_file()) {
                if unchanged(&up, &meta, &lower.join(&r), b) {
                    // Copied up without a change of its bytes (opened for
                    // writing, its mode or times changed): nothing to apply.
                    continue;
                }
            }
            push(
                out,
                total,
                Change::Write {
                    path: r,
                    from: up,
                    len: meta.len(),
                },
            )?;
        } else if ft.is_symlink() {
            let target = std::fs::read_link(&up).map_err(|e| CaptureError::scratch(&up, e))?;
            if below.is_some() {
                push(out, total, Change::Remove(r.clone()))?;
            }
            push(out, total, Change::Symlink { path: r, target })?;
        } else {
            let kind = if ft.is_fifo() {
                "fifo"
            } else if ft.is_socket() {
                "socket"
            } else {
                "device"
            };
            return Err(CaptureError::Unsupported { path: r, kind });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_weft_dir_sits_beside_the_volume() {
        assert_eq!(
            weft_dir(Path::new("/data/vol")),
            PathBuf::from("/data/.vol.weft")
        );
        assert_eq!(weft_dir(Path::new("/")), PathBuf::from("/.weft"));
    }

    #[test]
    fn overlay_options_escape_separators() {
        assert_eq!(escape(Path::new("/a,b:c\\d")), b"/a\\,b\\:c\\\\d".to_vec());
    }

    #[test]
    fn an_upper_directory_reads_back_as_changes() {
        // A hand-made upper directory in overlayfs' format (the whiteout
        // needs mknod, so root; the real mounts are tested end to end in
        // tests/run_*.rs).
        let t = tempfile::tempdir().unwrap();
        let lower = t.path().join("lower");
        let upper = t.path().join("upper");
        std::fs::create_dir_all(lower.join("kept")).unwrap();
        std::fs::create_dir_all(lower.join("was_file_parent")).unwrap();
        std::fs::write(lower.join("gone"), b"x").unwrap();
        std::fs::write(lower.join("f2d"), b"x").unwrap();
        std::fs::create_dir_all(upper.join("kept")).unwrap();
        std::fs::write(upper.join("kept/new"), b"hello").unwrap();
        std::fs::create_dir_all(upper.join("fresh/sub")).unwrap();
        std::fs::create_dir_all(upper.join("f2d")).unwrap();
        let whiteout = CString::new(upper.join("gone").as_os_str().as_bytes()).unwrap();
        // SAFETY: a NUL-terminated path; mknod of a 0/0 character device
        // (overlayfs' whiteout).
        let rc = unsafe { libc::mknod(whiteout.as_ptr(), libc::S_IFCHR | 0o600, 0) };
        if rc != 0 {
            eprintln!("skipping the whiteout part: mknod needs root here");
        }
        let mut out = Vec::new();
        let mut total = 0;
        walk(&upper, &lower, Path::new(""), &mut out, &mut total).unwrap();
        let mut want = Vec::new();
        if rc == 0 {
            want.push(Change::Remove("gone".into()));
        }
        want.extend([
            Change::Remove("f2d".into()),
            Change::Mkdir("f2d".into()),
            Change::Mkdir("fresh".into()),
            Change::Mkdir("fresh/sub".into()),
            Change::Write {
                path: "kept/new".into(),
                from: upper.join("kept/new"),
                len: 5,
            },
        ]);
        assert_eq!(out, want);
    }

    #[test]
    fn a_file_copied_up_without_a_change_is_not_applied() {
        let t = tempfile::tempdir().unwrap();
        let (lower, upper) = (t.path().join("lower"), t.path().join("upper"));
        std::fs::create_dir_all(&lower).unwrap();
        std::fs::create_dir_all(&upper).unwrap();
        let when = SystemTime::UNIX_EPOCH + std::time::Duration::new(1_700_000_000, 123);
        let write = |dir: &Path, name: &str, data: &[u8], at: SystemTime| {
            std::fs::write(dir.join(name), data).unwrap();
            File::options()
                .write(true)
                .open(dir.join(name))
                .unwrap()
                .set_modified(at)
                .unwrap();
        };
        // Copied up as is (same bytes, same time): skipped.
        write(&lower, "same", b"abc", when);
        write(&upper, "same", b"abc", when);
        // Same length and time, other bytes: applied (compared, not trusted).
        write(&lower, "bytes", b"abc", when);
        write(&upper, "bytes", b"abd", when);
        // Written (a new time): applied.
        write(&lower, "time", b"abc", when);
        write(
            &upper,
            "time",
            b"abc",
            when + std::time::Duration::from_secs(1),
        );
        let mut out = Vec::new();
        walk(&upper, &lower, Path::new(""), &mut out, &mut 0).unwrap();
        let paths: Vec<&Path> = out.iter().map(Change::path).collect();
        assert_eq!(paths, [Path::new("bytes"), Path::new("time")]);
    }

    #[test]
    fn symlinks_are_kept_and_fifos_refused() {
        let t = tempfile::tempdir().unwrap();
        let lower = t.path().join("lower");
        let upper = t.path().join("upper");
        std::fs::create_dir_all(&lower).unwrap();
        std::fs::create_dir_all(&upper).unwrap();
        std::fs::write(lower.join("taken"), b"x").unwrap();
        std::os::unix::fs::symlink("b", upper.join("l")).unwrap();
        std::os::unix::fs::symlink("c", upper.join("taken")).unwrap();
        let mut out = Vec::new();
        walk(&upper, &lower, Path::new(""), &mut out, &mut 0).unwrap();
        assert_eq!(
            out,
            vec![
                Change::Symlink {
                    path: "l".into(),
                    target: "b".into()
                },
                Change::Remove("taken".into()),
                Change::Symlink {
                    path: "taken".into(),
                    target: "c".into()
                },
            ]
        );
        let status = std::process::Command::new("mkfifo")
            .arg(upper.join("f"))
            .status()
            .unwrap();
        assert!(status.success());
        let err = walk(&upper, &lower, Path::new(""), &mut Vec::new(), &mut 0).unwrap_err();
        assert!(matches!(err, CaptureError::Unsupported { .. }), "{err}");
    }

    #[test]
    fn nested_or_missing_directories_are_refused() {
        let t = tempfile::tempdir().unwrap();
        let a = t.path().join("a");
        std::fs::create_dir_all(a.join("b")).unwrap();
        let root = t.path().join("scratch");
        let e = Capture::prepare(&root, &[a.clone(), a.join("b")]).unwrap_err();
        assert!(matches!(e, CaptureError::BadDir(_)), "{e}");
        let e = Capture::prepare(&root, &[t.path().join("nope")]).unwrap_err();
        assert!(matches!(e, CaptureError::BadDir(_)), "{e}");
        let e = Capture::prepare(&a.join("b/scratch"), std::slice::from_ref(&a)).unwrap_err();
        assert!(matches!(e, CaptureError::BadDir(_)), "{e}");
    }

    #[test]
    fn directories_without_permissions_are_opened_up_for_removal() {
        use std::os::unix::fs::PermissionsExt;
        let t = tempfile::tempdir().unwrap();
        let work = t.path().join("work0/work");
        std::fs::create_dir_all(work.join("incompat/volatile")).unwrap();
        std::fs::write(work.join("incompat/volatile/f"), b"x").unwrap();
        for d in [
            "work0/work/incompat/volatile",
            "work0/work/incompat",
            "work0/work",
        ] {
            std::fs::set_permissions(t.path().join(d), std::fs::Permissions::from_mode(0o000))
                .unwrap();
        }
        open_up(t.path());
        for d in [
            "work0/work",
            "work0/work/incompat",
            "work0/work/incompat/volatile",
        ] {
            let mode = std::fs::metadata(t.path().join(d))
                .unwrap()
                .permissions()
                .mode();
            assert_eq!(mode & 0o777, 0o700, "{d}");
        }
        remove_scratch(&t.path().join("work0"));
        assert!(!t.path().join("work0").exists());
    }

    #[test]
    fn a_crashed_runs_scratch_area_is_removed_by_the_next() {
        let t = tempfile::tempdir().unwrap();
        let a = t.path().join("a");
        std::fs::create_dir_all(&a).unwrap();
        let root = t.path().join("scratch");
        std::fs::create_dir_all(root.join("123-4/upper0")).unwrap();
        std::fs::write(root.join("123-4/lock"), b"").unwrap();
        let live = Capture::prepare(&root, std::slice::from_ref(&a)).unwrap();
        assert!(!root.join("123-4").exists());
        // A live run's area stays.
        let other = Capture::prepare(&root, std::slice::from_ref(&a)).unwrap();
        assert!(live.scratch.exists());
        live.discard();
        other.discard();
        assert_eq!(std::fs::read_dir(&root).unwrap().count(), 0);
    }
}
