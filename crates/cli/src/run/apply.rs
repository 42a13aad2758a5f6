//! Applying a program's captured changes: through the `fs` service of the
//! run's node, in the run's transaction (a volume), or, for a directory an
//! enclosing `weft run` captures, as plain file operations into that run's
//! private view of it (a nested run: its changes pass to its parent, which
//! keeps them or drops them with its own).
//!
//! Owns the choice between the two, and the plain application. Must never
//! apply to a volume but through the `fs` service (see `volume`).

use std::path::{Path, PathBuf};
use std::time::Duration;

use weft_wire::{Failure, Status, TxContext};

use super::capture::{Capture, CaptureError, Change};
use super::Session;

impl From<CaptureError> for Failure {
    fn from(e: CaptureError) -> Failure {
        let status = match e {
            CaptureError::BadDir(_) | CaptureError::Unsupported { .. } => Status::BadRequest,
            CaptureError::TooMany => Status::TooLarge,
            CaptureError::Scratch { .. } => Status::Internal,
        };
        Failure::new(status, e.to_string())
    }
}

/// Applies every captured directory's changes.
///
/// Fails with the first failure: BadRequest for something a volume cannot
/// hold, LockConflict when another transaction holds or changed a file the
/// program changed, the `fs` service's status otherwise.
pub async fn apply_all(
    s: &Session,
    capture: &Capture,
    ctx: &TxContext,
    enclosing: &[PathBuf],
    _timeout: Duration,
) -> Result<(), Failure> {
    let all = capture.changes()?;
    for (d, changes) in capture.dirs.iter().zip(all) {
        if enclosing.iter().any(|e| d.dir.starts_with(e)) {
            plain(&d.dir, &changes).map_err(|e| {
                Failure::new(
                    Status::Internal,
                    format!("applying into the enclosing run's {}: {e}", d.dir.display()),
                )
            })?;
        } else {
            super::volume::apply(s, ctx, &d.dir, &changes, capture.started()).await?;
        }
    }
    Ok(())
}

/// Applies `changes` into `dir` with plain file operations.
fn plain(dir: &Path, changes: &[Change]) -> std::io::Result<()> {
    fn remove(p: &Path) -> std::io::Result<()> {
        match std::fs::symlink_metadata(p) {
            Ok(m) if m.is_dir() => std::fs::remove_dir_all(p),
            Ok(_) => std::fs::remove_file(p),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(e),
        }
    }
    for c in changes {
        let p = dir.join(c.path());
        match c {
            Change::Remove(_) => remove(&p)?,
            Change::Clear(_) => {
                for e in std::fs::read_dir(&p)? {
                    remove(&e?.path())?;
                }
            }
            Change::Mkdir(_) => match std::fs::create_dir(&p) {
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && p.is_dir() => {}
                r => r?,
            },
            Change::Write { from, .. } => {
                std::fs::copy(from, &p)?;
            }
            Change::Symlink { target, .. } => std::os::unix::fs::symlink(target, &p)?,
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_application_turns_the_old_tree_into_the_new() {
        let t = tempfile::tempdir().unwrap();
        let dir = t.path().join("d");
        let src = t.path().join("src");
        std::fs::create_dir_all(dir.join("old/deep")).unwrap();
        std::fs::create_dir_all(dir.join("kept")).unwrap();
        std::fs::write(dir.join("old/deep/f"), b"x").unwrap();
        std::fs::write(dir.join("kept/stale"), b"x").unwrap();
        std::fs::write(dir.join("c"), b"x").unwrap();
        std::fs::write(&src, b"new").unwrap();
        plain(
            &dir,
            &[
                Change::Remove("c".into()),
                Change::Remove("old".into()),
                Change::Clear("kept".into()),
                Change::Mkdir("n".into()),
                Change::Write {
                    path: "n/f".into(),
                    from: src.clone(),
                    len: 3,
                },
            ],
        )
        .unwrap();
        assert!(!dir.join("c").exists());
        assert!(!dir.join("old").exists());
        assert_eq!(std::fs::read_dir(dir.join("kept")).unwrap().count(), 0);
        assert_eq!(std::fs::read(dir.join("n/f")).unwrap(), b"new");
    }
}
