//! Applying captured changes to a volume of the run's node, in the run's
//! transaction: through the file store's own handle when the node is
//! embedded in this process (files are copied by the kernel into its
//! staging area), through the `fs` service otherwise (files travel in
//! bounded chunks).
//!
//! Owns the mapping from a directory to a volume (the nearest enclosing
//! directory holding the store's reserved `.weft-fs` area, named after
//! itself as `weft node --volume DIR` names it), the order of the
//! operations (removals and directories first, then the files, several at
//! a time), the check that no one else changed a file while the program ran
//! (first committer wins), and waiting after the commit until the volume
//! shows it. Must never touch a volume directory except through the store.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use futures::StreamExt;
use weft_fs::{FileKind, FsConfig, FsOp, FsReply, FsRequest, FsResponse, ReadMode};
use weft_wire::{Address, Failure, NodeId, ServiceName, Status, TxContext};

use super::capture::Change;
use super::Session;

/// Files written at once.
pub const PARALLEL: usize = 16;

/// Bytes per write request to a remote volume.
pub const CHUNK: usize = weft_fs::REMOTE_CHUNK;

/// Most files in one batch to a remote volume.
const BATCH_FILES: usize = 128;

/// Most bytes of file data in one batch to a remote volume (a larger file
/// travels alone, in [`CHUNK`]s).
const BATCH_BYTES: u64 = CHUNK as u64;

/// Batches to a remote volume in flight at once.
const BATCHES_IN_FLIGHT: usize = 4;

/// The file store's reserved area at the root of a volume: never part of a
/// program's changes.
const RESERVED: &str = ".weft-fs";

/// Where a captured directory is on the node: a volume and a path in it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Place {
    /// The volume's name.
    pub volume: String,
    /// The directory's path inside it ("" for its root).
    pub prefix: String,
}

impl Place {
    fn path(&self, rel: &Path) -> Result<String, Failure> {
        let rel = rel.to_str().ok_or_else(|| {
            Failure::new(
                Status::BadRequest,
                format!("{rel:?}: a volume holds UTF-8 names only"),
            )
        })?;
        Ok(match (self.prefix.is_empty(), rel.is_empty()) {
            (true, _) => rel.to_string(),
            (false, true) => self.prefix.clone(),
            (false, false) => format!("{}/{rel}", self.prefix),
        })
    }
}

/// The root of the volume holding `dir`: its nearest enclosing directory
/// (itself included) that holds the store's reserved area, else `dir`
/// itself (a volume the embedded node will make).
pub fn volume_root(dir: &Path) -> PathBuf {
    dir.ancestors()
        .find(|a| a.join(RESERVED).is_dir())
        .unwrap_or(dir)
        .to_path_buf()
}

/// Where `dir` (canonical) is: the volume holding it (the name its node
/// recorded, else its root's name), and the
/// path under the root.
pub fn place_of(dir: &Path) -> Result<Place, Failure> {
    let root = volume_root(dir);
    // The name the serving node recorded (`--volume NAME=DIR`), else the
    // root's own name (how an embedded node names it).
    let recorded = std::fs::read_to_string(root.join(RESERVED).join(weft_fs::volume::NAME_FILE))
        .ok()
        .map(|n| n.trim().to_string())
        .filter(|n| !n.is_empty());
    let volume = match recorded {
        Some(n) => n,
        None => root
            .file_name()
            .and_then(|n| n.to_str())
            .ok_or_else(|| {
                Failure::new(
                    Status::BadRequest,
                    format!("{}: cannot name a volume after it", root.display()),
                )
            })?
            .to_string(),
    };
    let prefix = dir
        .strip_prefix(&root)
        .ok()
        .and_then(|p| p.to_str())
        .ok_or_else(|| {
            Failure::new(
                Status::BadRequest,
                format!("{}: a volume holds UTF-8 names only", dir.display()),
            )
        })?
        .to_string();
    Ok(Place { volume, prefix })
}

/// The file store of an embedded node serving the volumes that hold
/// `dirs` (each becomes one when none holds it yet).
///
/// Fails when two volumes would share a name, or a volume cannot be
/// opened.
pub fn embedded_fs(dirs: &[PathBuf]) -> anyhow::Result<weft_fs::Fs> {
    let mut cfg = FsConfig::default();
    let mut roots: Vec<PathBuf> = Vec::new();
    for d in dirs {
        let d = std::fs::canonicalize(d).map_err(|e| {
            anyhow::Error::new(Failure::new(
                Status::BadRequest,
                format!("--fs {}: {e}", d.display()),
            ))
        })?;
        let root = volume_root(&d);
        if roots.contains(&root) {
            continue;
        }
        let place = place_of(&d)?;
        cfg = cfg.volume(&place.volume, &root);
        roots.push(root);
    }
    Ok(weft_fs::Fs::new(cfg).map_err(Failure::from)?)
}

/// One volume as the run uses it.
enum Vol<'a> {
    /// On the embedded node: the store's own handle.
    Local(weft_fs::VolumeRef),
    /// On another process: calls to its `fs` service.
    Remote {
        session: &'a Session,
        node: NodeId,
        volume: String,
    },
}

impl Vol<'_> {
    async fn call(&self, ctx: &TxContext, op: FsOp) -> Result<FsReply, Failure> {
        match self {
            Vol::Local(v) => Ok(match op {
                FsOp::Stat { path, mode } => FsReply::Meta(v.stat(ctx, &path, mode).await?),
                FsOp::List { path } => FsReply::Entries(v.list(ctx, &path).await?),
                FsOp::Delete { path } => {
                    v.delete(ctx, &path).await?;
                    FsReply::Done
                }
                FsOp::Rmdir { path } => {
                    v.rmdir(ctx, &path).await?;
                    FsReply::Done
                }
                FsOp::Mkdir { path } => {
                    v.mkdir(ctx, &path).await?;
                    FsReply::Done
                }
                FsOp::Symlink { path, target } => {
                    v.symlink(ctx, &path, &target).await?;
                    FsReply::Done
                }
                other => {
                    return Err(Failure::new(
                        Status::Internal,
                        format!("weft run does not send {other:?}"),
                    ))
                }
            }),
            Vol::Remote {
                session,
                node,
                volume,
            } => {
                let addr = Address {
                    service: ServiceName::new(weft_fs::SERVICE).expect("valid"),
                    instance: 0,
                    node: *node,
                };
                let req = FsRequest {
                    volume: volume.clone(),
                    op,
                };
                let r: FsResponse = session.client.call(&addr, req, Some(ctx.clone())).await?;
                r.map_err(Failure::from)
            }
        }
    }

    async fn stat(
        &self,
        ctx: &TxContext,
        path: String,
        mode: ReadMode,
    ) -> Result<Option<weft_fs::Meta>, Failure> {
        match self.call(ctx, FsOp::Stat { path, mode }).await? {
            FsReply::Meta(m) => Ok(m),
            r => Err(unexpected(r)),
        }
    }

    async fn list(&self, ctx: &TxContext, path: String) -> Result<Vec<String>, Failure> {
        match self.call(ctx, FsOp::List { path }).await? {
            FsReply::Entries(e) => Ok(e.into_iter().map(|e| e.name).collect()),
            r => Err(unexpected(r)),
        }
    }

    /// Makes `path` hold the local file `from` (a file of the scratch area:
    /// the embedded node's store takes it by rename).
    async fn put_file(&self, ctx: &TxContext, path: String, from: &Path) -> Result<(), Failure> {
        match self {
            Vol::Local(v) => {
                // The scratch area is beside the volume: a rename.
                v.take_file(ctx, &path, from).await?;
            }
            Vol::Remote { .. } => {
                use std::io::Read;
                self.call(
                    ctx,
                    FsOp::Create {
                        path: path.clone(),
                        exclusive: false,
                    },
                )
                .await?;
                let mut f = std::fs::File::open(from).map_err(|e| {
                    Failure::new(Status::Internal, format!("reading {}: {e}", from.display()))
                })?;
                let mut buf = vec![0u8; CHUNK];
                let mut offset = 0u64;
                loop {
                    let n = f.read(&mut buf).map_err(|e| {
                        Failure::new(Status::Internal, format!("reading {}: {e}", from.display()))
                    })?;
                    if n == 0 {
                        break;
                    }
                    self.call(
                        ctx,
                        FsOp::Write {
                            path: path.clone(),
                            offset,
                            data: bytes::Bytes::copy_from_slice(&buf[..n]),
                        },
                    )
                    .await?;
                    offset += n as u64;
                }
            }
        }
        Ok(())
    }

    /// Removes a file, or a directory and everything in it.
    async fn remove(&self, ctx: &TxContext, place: &Place, rel: &Path) -> Result<(), Failure> {
        // Depth first without recursion: (path, listed yet).
        let mut stack = vec![(rel.to_path_buf(), false)];
        while let Some((p, listed)) = stack.pop() {
            let path = place.path(&p)?;
            match self.stat(ctx, path.clone(), ReadMode::NoLock).await? {
                None => {}
                Some(m) if m.kind == FileKind::Dir => {
                    if listed {
                        self.call(ctx, FsOp::Rmdir { path }).await?;
                    } else {
                        let children = self.list(ctx, path).await?;
                        stack.push((p.clone(), true));
                        stack.extend(children.into_iter().map(|c| (p.join(c), false)));
                    }
                }
                Some(_) => {
                    self.call(ctx, FsOp::Delete { path }).await?;
                }
            }
        }
        Ok(())
    }
}

fn unexpected(r: FsReply) -> Failure {
    Failure::new(Status::Mismatch, format!("unexpected fs reply {r:?}"))
}

fn vol<'a>(s: &'a Session, ctx: &TxContext, place: &Place) -> Result<Vol<'a>, Failure> {
    Ok(match &s.fs {
        Some(fs) => Vol::Local(fs.local(&place.volume)?),
        None => Vol::Remote {
            session: s,
            node: ctx.tid.node,
            volume: place.volume.clone(),
        },
    })
}

/// Applies `changes` to the volume holding `dir`, in `ctx`. The volume is
/// served by the transaction's own node, whose commit returns once the
/// changes are published (visible to every reader), so nothing need be
/// waited for after it.
///
/// Fails with AddrError when the node serves no volume holding `dir`,
/// LockConflict when another transaction holds, or changed while the
/// program ran, a file the program changed, the store's status otherwise.
pub async fn apply(
    s: &Session,
    ctx: &TxContext,
    dir: &Path,
    changes: &[Change],
    started: SystemTime,
) -> Result<(), Failure> {
    let place = place_of(dir)?;
    let v = vol(s, ctx, &place)?;
    // The directory must be one the node serves.
    match v
        .stat(ctx, place.path(Path::new(""))?, ReadMode::NoLock)
        .await
    {
        Ok(Some(m)) if m.kind == FileKind::Dir => {}
        Ok(_) => {
            return Err(Failure::new(
                Status::AddrError,
                format!(
                    "{} is not a directory of volume {}",
                    dir.display(),
                    place.volume
                ),
            ))
        }
        Err(f) if f.status == Status::AddrError => {
            return Err(Failure::new(
                Status::AddrError,
                format!(
                    "the node serves no volume {:?} holding {} (start it with --volume {})",
                    place.volume,
                    dir.display(),
                    volume_root(dir).display()
                ),
            ))
        }
        Err(f) => return Err(f),
    }
    let changes: Vec<&Change> = changes
        .iter()
        .filter(|c| !(place.prefix.is_empty() && c.path().starts_with(RESERVED)))
        .collect();
    let check = |rel: &Path| changed_since(&dir.join(rel), started);
    // Directories this transaction made (their mkdir found no name): nothing
    // committed lies under them, so a file written there needs no check.
    let mut made: HashSet<&Path> = HashSet::new();
    let others: Vec<&Change> = changes
        .iter()
        .copied()
        .filter(|c| !matches!(c, Change::Write { .. }))
        .collect();
    let mut i = 0;
    while i < others.len() {
        let c = others[i];
        i += 1;
        // To a remote volume, a run of directories made goes in one batch
        // (a tree copied in makes dozens); should one exist already, the
        // run is made again one by one, which tolerates that.
        if let (Vol::Remote { .. }, Change::Mkdir(first)) = (&v, c) {
            let mut dirs = vec![first];
            while let Some(Change::Mkdir(p)) = others.get(i) {
                dirs.push(p);
                i += 1;
            }
            if dirs.len() > 1 {
                let ops = dirs
                    .iter()
                    .map(|p| {
                        Ok(FsOp::Mkdir {
                            path: place.path(p)?,
                        })
                    })
                    .collect::<Result<Vec<_>, Failure>>()?;
                if let Ok(FsReply::Batch(_)) = v.call(ctx, FsOp::Batch { ops }).await {
                    made.extend(dirs.iter().map(|p| p.as_path()));
                    continue;
                }
            }
            for p in dirs {
                mkdir(&v, ctx, &place, p, &mut made).await?;
            }
            continue;
        }
        match c {
            Change::Remove(p) => {
                v.remove(ctx, &place, p).await?;
                check(p)?;
            }
            Change::Clear(p) => {
                for e in v.list(ctx, place.path(p)?).await? {
                    v.remove(ctx, &place, &p.join(&e)).await?;
                    check(&p.join(&e))?;
                }
            }
            Change::Mkdir(p) => mkdir(&v, ctx, &place, p, &mut made).await?,
            Change::Symlink { path, target } => {
                let target = target.to_str().ok_or_else(|| {
                    Failure::new(
                        Status::BadRequest,
                        format!("{}: a link target must be UTF-8", path.display()),
                    )
                })?;
                v.call(
                    ctx,
                    FsOp::Symlink {
                        path: place.path(path)?,
                        target: target.to_string(),
                    },
                )
                .await?;
                check(path)?;
            }
            Change::Write { .. } => {}
        }
    }
    let (v, place, made) = (&v, &place, &made);
    let check_new = |path: &Path| {
        if path.ancestors().skip(1).any(|a| made.contains(a)) {
            return Ok(());
        }
        check(path)
    };
    let check_new = &check_new;
    let mut writes: Vec<(&PathBuf, &PathBuf)> = Vec::new();
    // To a remote volume, small files travel many to a request (`Put`s in
    // a `Batch`): one round trip for dozens of files instead of two each.
    let mut batches: Vec<Vec<(&PathBuf, &PathBuf)>> = Vec::new();
    let mut batch_bytes = 0u64;
    for c in &changes {
        let Change::Write { path, from, len } = c else {
            continue;
        };
        if matches!(v, Vol::Local(_)) || *len > BATCH_BYTES {
            writes.push((path, from));
            continue;
        }
        match batches.last_mut() {
            Some(b) if b.len() < BATCH_FILES && batch_bytes + len <= BATCH_BYTES => {
                b.push((path, from));
                batch_bytes += len;
            }
            _ => {
                batches.push(vec![(path, from)]);
                batch_bytes = *len;
            }
        }
    }
    let mut pending = futures::stream::iter(batches.into_iter().map(|batch| async move {
        let mut ops = Vec::with_capacity(batch.len());
        for (path, from) in &batch {
            let data = std::fs::read(from).map_err(|e| {
                Failure::new(Status::Internal, format!("reading {}: {e}", from.display()))
            })?;
            ops.push(FsOp::Put {
                path: place.path(path)?,
                data: data.into(),
            });
        }
        match v.call(ctx, FsOp::Batch { ops }).await? {
            FsReply::Batch(_) => {}
            r => return Err(unexpected(r)),
        }
        for (path, _) in &batch {
            check_new(path)?;
        }
        Ok(())
    }))
    .buffer_unordered(BATCHES_IN_FLIGHT);
    while let Some(r) = pending.next().await {
        r?;
    }
    let mut pending = futures::stream::iter(writes.into_iter().map(|(path, from)| async move {
        v.put_file(ctx, place.path(path)?, from).await?;
        check_new(path)
    }))
    .buffer_unordered(PARALLEL);
    while let Some(r) = pending.next().await {
        r?;
    }
    Ok(())
}

/// Makes the directory `p` (one that exists already is fine), noting it in
/// `made` when this transaction made it.
async fn mkdir<'p>(
    v: &Vol<'_>,
    ctx: &TxContext,
    place: &Place,
    p: &'p Path,
    made: &mut HashSet<&'p Path>,
) -> Result<(), Failure> {
    match v
        .call(
            ctx,
            FsOp::Mkdir {
                path: place.path(p)?,
            },
        )
        .await
    {
        Ok(_) => {
            made.insert(p);
            Ok(())
        }
        Err(f) if f.detail.contains("already exists") => Ok(()),
        Err(f) => Err(f),
    }
}

/// LockConflict when `path` (in the volume's directory) changed at or after
/// `started`: another transaction committed a change to it while the
/// program ran, so applying ours would lose theirs. Called once this
/// transaction holds the file's write lock, so no commit can slip in after.
fn changed_since(path: &Path, started: SystemTime) -> Result<(), Failure> {
    use std::os::unix::fs::MetadataExt;
    let Ok(m) = std::fs::symlink_metadata(path) else {
        return Ok(());
    };
    let ctime = SystemTime::UNIX_EPOCH
        + Duration::new(
            m.ctime().max(0) as u64,
            m.ctime_nsec().clamp(0, 999_999_999) as u32,
        );
    if ctime >= started {
        return Err(Failure::new(
            Status::LockConflict,
            format!(
                "{} was changed by another transaction while the program ran",
                path.display()
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_changed_after_the_start_is_a_conflict() {
        let t = tempfile::tempdir().unwrap();
        let f = t.path().join("f");
        std::fs::write(&f, b"x").unwrap();
        let before = SystemTime::now() - Duration::from_secs(3600);
        let e = changed_since(&f, before).unwrap_err();
        assert_eq!(e.status, Status::LockConflict);
        let after = SystemTime::now() + Duration::from_secs(3600);
        changed_since(&f, after).unwrap();
        changed_since(&t.path().join("absent"), before).unwrap();
    }

    #[test]
    fn a_directory_is_placed_in_the_nearest_volume_holding_it() {
        let t = tempfile::tempdir().unwrap();
        let root = t.path().join("vol");
        std::fs::create_dir_all(root.join(".weft-fs")).unwrap();
        std::fs::create_dir_all(root.join("a/b")).unwrap();
        assert_eq!(
            place_of(&root.join("a/b")).unwrap(),
            Place {
                volume: "vol".into(),
                prefix: "a/b".into()
            }
        );
        assert_eq!(place_of(&root).unwrap().prefix, "");
        // Not in any volume yet: it will be one.
        let other = t.path().join("other");
        std::fs::create_dir_all(&other).unwrap();
        assert_eq!(
            place_of(&other).unwrap(),
            Place {
                volume: "other".into(),
                prefix: "".into()
            }
        );
        let p = place_of(&root.join("a")).unwrap();
        assert_eq!(p.path(Path::new("x/y")).unwrap(), "a/x/y");
        assert_eq!(p.path(Path::new("")).unwrap(), "a");
    }
}
