//! Where the PostgreSQL binaries are and which OS user runs them.
//!
//! Owns: the search order for the binary directory and the root-to-`postgres` user switch for
//! every PostgreSQL program the harness runs. Must never: run a PostgreSQL program as root
//! (PostgreSQL refuses to), or pick binaries from a directory that lacks `postgres` or `initdb`.

use std::ffi::{CString, OsStr, OsString};
use std::io;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use super::ServerError;

/// Environment variable that names the PostgreSQL binary directory, overriding the search.
pub const BIN_ENV: &str = "WEFT_PG_BIN";

/// The binary directory of the supported release on Debian and Ubuntu, tried first.
pub const DEFAULT_BIN_DIR: &str = "/usr/lib/postgresql/15/bin";

/// Where Debian and Ubuntu install every other PostgreSQL release (`<root>/<major>/bin`).
const VERSIONS_ROOT: &str = "/usr/lib/postgresql";

/// The OS user PostgreSQL runs as when the harness runs as root; also the database superuser.
pub const SUPERUSER: &str = "postgres";

/// Programs a directory must hold to be a PostgreSQL server installation.
const REQUIRED: [&str; 2] = ["postgres", "initdb"];

/// Finds the PostgreSQL binary directory: `explicit` (from [`super::ServerOptions::bin_dir`]),
/// else `$WEFT_PG_BIN`, else [`DEFAULT_BIN_DIR`], else the newest `/usr/lib/postgresql/*/bin`,
/// else the directory of a `postgres` found on `$PATH` (symlinks resolved).
pub(crate) fn find_bin_dir(explicit: Option<&Path>) -> Result<PathBuf, ServerError> {
    find_bin_dir_in(
        explicit,
        std::env::var_os(BIN_ENV),
        Path::new(DEFAULT_BIN_DIR),
        Path::new(VERSIONS_ROOT),
        std::env::var_os("PATH").as_deref(),
    )
}

/// [`find_bin_dir`] with every input passed in, so the search order is testable without
/// touching the process environment or the file system outside a test directory.
pub(crate) fn find_bin_dir_in(
    explicit: Option<&Path>,
    env_override: Option<OsString>,
    default_dir: &Path,
    versions_root: &Path,
    path_var: Option<&OsStr>,
) -> Result<PathBuf, ServerError> {
    // An explicit choice that is wrong is an error, never a silent fallback to another release.
    if let Some(dir) = explicit {
        return check_dir(dir)
            .map(|()| dir.to_path_buf())
            .map_err(|missing| ServerError::NotFound {
                detail: format!("ServerOptions::bin_dir {} has no {missing}", dir.display()),
            });
    }
    if let Some(dir) = env_override.filter(|v| !v.is_empty()) {
        let dir = PathBuf::from(dir);
        return match check_dir(&dir) {
            Ok(()) => Ok(dir),
            Err(missing) => Err(ServerError::NotFound {
                detail: format!("{BIN_ENV}={} has no {missing}", dir.display()),
            }),
        };
    }
    if check_dir(default_dir).is_ok() {
        return Ok(default_dir.to_path_buf());
    }
    if let Some(dir) = newest_versioned_dir(versions_root) {
        return Ok(dir);
    }
    if let Some(dir) = search_path(path_var) {
        return Ok(dir);
    }
    Err(ServerError::NotFound {
        detail: format!(
            "searched {}, {}/*/bin and $PATH",
            default_dir.display(),
            versions_root.display()
        ),
    })
}

/// `Ok` when `dir` holds every required program, else the name of the first missing one.
fn check_dir(dir: &Path) -> Result<(), &'static str> {
    match REQUIRED.iter().find(|p| !is_executable(&dir.join(p))) {
        Some(missing) => Err(missing),
        None => Ok(()),
    }
}

fn is_executable(path: &Path) -> bool {
    std::fs::metadata(path)
        .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        .unwrap_or(false)
}

/// The `bin` directory of the highest major version under `root` that is complete.
fn newest_versioned_dir(root: &Path) -> Option<PathBuf> {
    let mut versions: Vec<(Vec<u32>, PathBuf)> = std::fs::read_dir(root)
        .ok()?
        .flatten()
        .filter_map(|entry| {
            let name = entry.file_name().into_string().ok()?;
            let key = name
                .split('.')
                .map(|part| part.parse::<u32>().ok())
                .collect::<Option<Vec<u32>>>()?;
            Some((key, entry.path().join("bin")))
        })
        .filter(|(_, bin)| check_dir(bin).is_ok())
        .collect();
    versions.sort();
    versions.pop().map(|(_, bin)| bin)
}

/// The real directory of the first `postgres` on `path_var` that has an `initdb` beside it.
fn search_path(path_var: Option<&OsStr>) -> Option<PathBuf> {
    std::env::split_paths(path_var?).find_map(|dir| {
        let postgres = dir.join("postgres");
        if !is_executable(&postgres) {
            return None;
        }
        // /usr/local/bin/postgres is often a symlink into the real installation; initdb must
        // come from the same release, so resolve before looking for it.
        let real = std::fs::canonicalize(&postgres).ok()?;
        let real_dir = real.parent()?.to_path_buf();
        [real_dir, dir].into_iter().find(|d| check_dir(d).is_ok())
    })
}

/// The identity PostgreSQL programs run under when the harness itself runs as root.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RunAs {
    pub(crate) uid: u32,
    pub(crate) gid: u32,
}

/// `None` when the harness is not root (programs run as the current user), else the
/// [`SUPERUSER`] OS user's ids.
pub(crate) fn server_user() -> Result<Option<RunAs>, ServerError> {
    // SAFETY: geteuid has no preconditions, touches no memory and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        return Ok(None);
    }
    match lookup_user(SUPERUSER) {
        Ok(Some(user)) => Ok(Some(user)),
        Ok(None) => Err(ServerError::NoServerUser),
        Err(source) => Err(ServerError::Io {
            context: format!("looking up the `{SUPERUSER}` OS user"),
            source,
        }),
    }
}

/// Looks `name` up in the user database (NSS included) with the reentrant `getpwnam_r`.
fn lookup_user(name: &str) -> io::Result<Option<RunAs>> {
    let cname = CString::new(name).map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    let mut buf: Vec<libc::c_char> = vec![0; 1024];
    loop {
        // SAFETY: `passwd` is plain old data (integers and raw pointers); all-zero is a valid
        // value, and getpwnam_r overwrites it before we read it.
        let mut pwd: libc::passwd = unsafe { std::mem::zeroed() };
        let mut result: *mut libc::passwd = std::ptr::null_mut();
        // SAFETY: every pointer is valid for the duration of the call and `buf.len()` is the
        // true size of `buf`; the strings `pwd` points into live in `buf`, which we do not read.
        let rc = unsafe {
            libc::getpwnam_r(
                cname.as_ptr(),
                &mut pwd,
                buf.as_mut_ptr(),
                buf.len(),
                &mut result,
            )
        };
        if rc == libc::ERANGE && buf.len() < 1 << 20 {
            let bigger = buf.len() * 2;
            buf.resize(bigger, 0);
            continue;
        }
        if rc != 0 {
            return Err(io::Error::from_raw_os_error(rc));
        }
        if result.is_null() {
            return Ok(None);
        }
        return Ok(Some(RunAs {
            uid: pwd.pw_uid,
            gid: pwd.pw_gid,
        }));
    }
}

/// A [`Command`] for PostgreSQL program `program` from `bin_dir`, run as `run_as` when given,
/// in directory `home` (also its `$HOME`), with a C locale and no inherited `PG*` variables so
/// nothing from the caller's environment redirects it to another server.
pub(crate) fn program_command(
    bin_dir: &Path,
    program: &str,
    run_as: Option<RunAs>,
    home: &Path,
) -> Command {
    let mut cmd = Command::new(bin_dir.join(program));
    cmd.current_dir(home)
        .env("HOME", home)
        .env("LC_ALL", "C")
        .stdin(Stdio::null());
    for (key, _) in std::env::vars_os() {
        if key.to_string_lossy().starts_with("PG") {
            cmd.env_remove(key);
        }
    }
    if let Some(user) = run_as {
        // std drops the supplementary groups when switching away from root.
        cmd.uid(user.uid).gid(user.gid);
    }
    cmd
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;

    fn fake_install(dir: &Path, programs: &[&str]) {
        fs::create_dir_all(dir).unwrap();
        for p in programs {
            let path = dir.join(p);
            fs::write(&path, "#!/bin/sh\n").unwrap();
            fs::set_permissions(&path, fs::Permissions::from_mode(0o755)).unwrap();
        }
    }

    #[test]
    fn explicit_and_env_override_win_and_are_checked() {
        let tmp = tempfile::tempdir().unwrap();
        let good = tmp.path().join("good");
        let bad = tmp.path().join("bad");
        fake_install(&good, &REQUIRED);
        fake_install(&bad, &["postgres"]);
        let none = tmp.path().join("none");

        let found = find_bin_dir_in(Some(&good), None, &none, &none, None).unwrap();
        assert_eq!(found, good);
        let found = find_bin_dir_in(
            None,
            Some(good.clone().into_os_string()),
            &none,
            &none,
            None,
        )
        .unwrap();
        assert_eq!(found, good);

        let err = find_bin_dir_in(None, Some(bad.clone().into_os_string()), &good, &none, None)
            .unwrap_err()
            .to_string();
        assert!(err.starts_with("PostgreSQL not found: install postgresql-15 or set WEFT_PG_BIN"));
        assert!(
            err.contains("WEFT_PG_BIN=") && err.contains("has no initdb"),
            "{err}"
        );
    }

    #[test]
    fn falls_back_to_newest_versioned_dir_then_path() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("lib");
        fake_install(&root.join("9.6/bin"), &REQUIRED);
        fake_install(&root.join("14/bin"), &REQUIRED);
        fake_install(&root.join("16/bin"), &["postgres"]); // incomplete: skipped
        let missing_default = tmp.path().join("nope");
        let found = find_bin_dir_in(None, None, &missing_default, &root, None).unwrap();
        assert_eq!(found, root.join("14/bin"));

        // Nothing versioned: a symlinked `postgres` on PATH resolves to its real directory.
        let real = tmp.path().join("real/bin");
        fake_install(&real, &REQUIRED);
        let on_path = tmp.path().join("local-bin");
        fs::create_dir_all(&on_path).unwrap();
        std::os::unix::fs::symlink(real.join("postgres"), on_path.join("postgres")).unwrap();
        let path_var = std::env::join_paths([tmp.path().join("empty"), on_path]).unwrap();
        let found = find_bin_dir_in(
            None,
            None,
            &missing_default,
            &missing_default,
            Some(&path_var),
        )
        .unwrap();
        assert_eq!(found, fs::canonicalize(real).unwrap());
    }

    #[test]
    fn nothing_found_is_a_clear_error() {
        let tmp = tempfile::tempdir().unwrap();
        let none = tmp.path().join("none");
        let err = find_bin_dir_in(None, None, &none, &none, Some(OsStr::new("")))
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with("PostgreSQL not found: install postgresql-15 or set WEFT_PG_BIN"),
            "{err}"
        );
    }
}
