//! The file store of a node: its volumes as one two-phase participant, its
//! RPC service (`fs`, QuickSilver's DFS: a volume used from another node in
//! the same transaction), its recovery and checkpoints, and the client
//! handle ([`VolumeRef`]) that reaches a volume locally or remotely with the
//! same operations.
//!
//! Owns the glue between volumes and the transaction manager: prepare logs
//! one record per changed volume (the TM forces it), commit applies, abort
//! and recovery clean. Must never vote Yes for a branch whose plan is not in
//! the log, nor let a service take calls before recovery ran.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use bytes::Bytes;
use futures::future::BoxFuture;
use weft_log::{Log, LogRecord, Lsn};
use weft_rpc::{CallContext, Plugin, Rpc, ServiceOptions};
use weft_tx::{ParticipationClass, Recovered, Resource, TxManager, Vote};
use weft_wire::{Address, Failure, NodeId, Payload, Status, SubPath, Tid, TxContext, Xid};

use crate::api::{
    DirEntry, FsError, FsOp, FsRecord, FsReply, FsRequest, FsResponse, Meta, ReadMode,
    FS_RECORD_TAG,
};
use crate::volume::{CommitHook, Prepared, Published, Volume, VolumeLimits};

/// The name the service registers under.
pub const SERVICE: &str = "fs";

/// Largest chunk a remote streaming write or read moves per call.
pub const REMOTE_CHUNK: usize = 512 << 10;

/// Settings of a node's file store.
#[derive(Clone, Default)]
pub struct FsConfig {
    /// (name, directory) of each volume.
    pub volumes: Vec<(String, PathBuf)>,
    /// Bounds shared by every volume.
    pub limits: VolumeLimits,
    /// Test hook called between the steps of applying a commit.
    pub commit_hook: Option<CommitHook>,
}

impl std::fmt::Debug for FsConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FsConfig")
            .field("volumes", &self.volumes)
            .field("limits", &self.limits)
            .finish()
    }
}

impl FsConfig {
    /// Adds a volume. `spec` is `DIR` (named after its last component) or
    /// `NAME=DIR`.
    ///
    /// Fails with BadPath when no name can be derived.
    pub fn volume_spec(mut self, spec: &str) -> Result<FsConfig, FsError> {
        let (name, dir) = match spec.split_once('=') {
            Some((n, d)) => (n.to_string(), PathBuf::from(d)),
            None => {
                let dir = PathBuf::from(spec);
                let name = std::fs::canonicalize(&dir)
                    .ok()
                    .and_then(|d| d.file_name().map(|n| n.to_string_lossy().to_string()))
                    .or_else(|| dir.file_name().map(|n| n.to_string_lossy().to_string()))
                    .ok_or_else(|| FsError::BadPath(format!("{spec:?}: cannot name a volume")))?;
                (name, dir)
            }
        };
        if name.is_empty() || name.contains('/') {
            return Err(FsError::BadPath(format!(
                "{spec:?}: bad volume name {name:?}"
            )));
        }
        self.volumes.push((name, dir));
        Ok(self)
    }

    /// Adds the volume `name` at `dir`.
    pub fn volume(mut self, name: &str, dir: impl Into<PathBuf>) -> FsConfig {
        self.volumes.push((name.to_string(), dir.into()));
        self
    }
}

struct FsInner {
    volumes: BTreeMap<String, Volume>,
    hook: Option<CommitHook>,
    tm: OnceLock<TxManager>,
    log: OnceLock<Log>,
}

/// A node's transactional file store. Cheap to clone; add it to a node as a
/// [`Plugin`] (`Node::builder(..).plugin(Arc::new(fs.clone()))`).
#[derive(Clone)]
pub struct Fs {
    inner: Arc<FsInner>,
    /// The one participant object: the transaction manager enlists a
    /// resource once per object, so every enlistment must reuse it.
    participant: Arc<dyn Resource>,
}

/// The two-phase participant registered with the transaction manager.
struct Participant(Arc<FsInner>);

impl Fs {
    /// Opens every volume of `cfg`.
    ///
    /// Fails with BadPath for two volumes of one name, and like
    /// [`Volume::open`].
    pub fn new(cfg: FsConfig) -> Result<Fs, FsError> {
        let mut volumes = BTreeMap::new();
        for (name, dir) in &cfg.volumes {
            let v = Volume::open(name, dir, cfg.limits.clone())?;
            if volumes.insert(name.clone(), v).is_some() {
                return Err(FsError::BadPath(format!("two volumes named {name:?}")));
            }
        }
        let inner = Arc::new(FsInner {
            volumes,
            hook: cfg.commit_hook,
            tm: OnceLock::new(),
            log: OnceLock::new(),
        });
        Ok(Fs {
            participant: Arc::new(Participant(Arc::clone(&inner))),
            inner,
        })
    }

    /// The volume `name`.
    ///
    /// Fails with NoSuchVolume.
    pub fn volume(&self, name: &str) -> Result<&Volume, FsError> {
        self.inner
            .volumes
            .get(name)
            .ok_or_else(|| FsError::NoSuchVolume(name.to_string()))
    }

    /// Every volume, by name.
    pub fn volumes(&self) -> impl Iterator<Item = &Volume> {
        self.inner.volumes.values()
    }

    /// Waits until `done(self)` holds, checking it again each time a branch
    /// ends on one of the volumes ([`Volume::ended_branches`]); a state
    /// reached only by branches ending (commits applied, locks released,
    /// staging removed) is seen as soon as it is reached. Returns at once
    /// when the store has no volume. Never fails; bound it with a timeout
    /// where the state might never come.
    pub async fn wait_until(&self, done: impl Fn(&Fs) -> bool) {
        let mut ended: Vec<_> = self.volumes().map(Volume::ended_branches).collect();
        loop {
            for rx in &mut ended {
                rx.borrow_and_update();
            }
            if done(self) || ended.is_empty() {
                return; // done, or no volume whose branches could change it
            }
            let changes = ended.iter_mut().map(|rx| Box::pin(rx.changed()));
            // The senders live in the volumes `self` holds, so a change is
            // the only way this returns.
            let _ = futures::future::select_all(changes).await;
        }
    }

    /// The volume whose root holds `dir` (a directory given to `weft run
    /// --fs DIR`) and `dir`'s path inside it.
    ///
    /// Fails with NotFound when `dir` does not exist, NoSuchVolume when no
    /// volume holds it.
    pub fn volume_of(&self, dir: &Path) -> Result<(&Volume, String), FsError> {
        let d = std::fs::canonicalize(dir).map_err(|e| FsError::io(dir.display(), &e))?;
        for v in self.inner.volumes.values() {
            if let Ok(rest) = d.strip_prefix(v.root()) {
                return Ok((v, rest.to_string_lossy().to_string()));
            }
        }
        Err(FsError::NoSuchVolume(format!(
            "no volume holds {}",
            d.display()
        )))
    }

    /// The participant to enlist for local operations.
    pub fn resource(&self) -> Arc<dyn Resource> {
        Arc::clone(&self.participant)
    }

    /// A handle on the local volume `name` for transactions of this node.
    ///
    /// Fails with NoSuchVolume.
    pub fn local(&self, name: &str) -> Result<VolumeRef, FsError> {
        self.volume(name)?;
        Ok(VolumeRef {
            volume: name.to_string(),
            target: Target::Local(self.clone()),
        })
    }

    fn enlist(&self, tid: Tid) -> Result<(), FsError> {
        let tm = self.inner.tm.get().ok_or_else(|| {
            FsError::Tx(Failure::new(
                Status::Unavailable,
                "the file store is not attached to a node",
            ))
        })?;
        tm.enlist(tid, self.resource())?;
        Ok(())
    }

    /// Runs one operation for `xid` on a local volume (the caller made this
    /// node a participant: the service did, or [`VolumeRef`] enlisted).
    ///
    /// Fails with the operation's [`FsError`].
    pub async fn execute(&self, xid: &Xid, req: FsRequest) -> FsResponse {
        let v = self.volume(&req.volume)?;
        match req.op {
            FsOp::Batch { ops } => {
                let mut replies = Vec::with_capacity(ops.len());
                for op in ops {
                    replies.push(Self::execute_one(v, xid, op).await?);
                }
                Ok(FsReply::Batch(replies))
            }
            op => Self::execute_one(v, xid, op).await,
        }
    }

    /// Runs one operation that is not a batch (a nested batch is refused:
    /// Unsupported).
    async fn execute_one(v: &Volume, xid: &Xid, op: FsOp) -> FsResponse {
        Ok(match op {
            FsOp::Batch { .. } => {
                return Err(FsError::Unsupported("a batch inside a batch".into()))
            }
            FsOp::Put { path, data } => {
                v.put_bytes(xid, &path, &data).await?;
                FsReply::Done
            }
            FsOp::Create { path, exclusive } => {
                v.create(xid, &path, exclusive).await?;
                FsReply::Done
            }
            FsOp::Write { path, offset, data } => {
                v.write(xid, &path, offset, &data).await?;
                FsReply::Done
            }
            FsOp::Truncate { path, len } => {
                v.truncate(xid, &path, len).await?;
                FsReply::Done
            }
            FsOp::Delete { path } => {
                v.delete(xid, &path).await?;
                FsReply::Done
            }
            FsOp::Rename { from, to } => {
                v.rename(xid, &from, &to).await?;
                FsReply::Done
            }
            FsOp::Mkdir { path } => {
                v.mkdir(xid, &path).await?;
                FsReply::Done
            }
            FsOp::Rmdir { path } => {
                v.rmdir(xid, &path).await?;
                FsReply::Done
            }
            FsOp::Symlink { path, target } => {
                v.symlink(xid, &path, &target).await?;
                FsReply::Done
            }
            FsOp::Stat { path, mode } => FsReply::Meta(v.stat(xid, &path, mode).await?),
            FsOp::List { path } => FsReply::Entries(v.list(xid, &path).await?),
            FsOp::Read {
                path,
                offset,
                len,
                mode,
            } => FsReply::Data(v.read(xid, &path, offset, len, mode).await?),
            FsOp::Open { path } => {
                v.open_file(xid, &path).await?;
                FsReply::Done
            }
            FsOp::Close { path } => {
                v.close_file(xid, &path)?;
                FsReply::Done
            }
        })
    }

    async fn serve_call(&self, ctx: CallContext, req: FsRequest) -> Result<FsResponse, Failure> {
        match ctx.tx() {
            Some(tx) => Ok(self.execute(&tx.xid(), req).await),
            None => Err(Failure::new(
                Status::BadRequest,
                "fs: every file operation runs inside a transaction",
            )),
        }
    }
}

impl Resource for Participant {
    fn name(&self) -> &str {
        SERVICE
    }

    fn class(&self) -> ParticipationClass {
        ParticipationClass::TwoPhase
    }

    fn prepare<'a>(&'a self, tid: Tid, log: &'a Log) -> BoxFuture<'a, Vote> {
        Box::pin(async move {
            let mut any = false;
            for v in self.0.volumes.values() {
                match v.prepare(tid) {
                    Ok(Prepared::ReadOnly) => {}
                    Ok(Prepared::Already) => any = true,
                    Ok(Prepared::Plan(plan)) => {
                        let rec = FsRecord::Prepared {
                            tid,
                            volume: v.name().to_string(),
                            plan,
                        };
                        let appended = postcard::to_allocvec(&rec)
                            .map_err(|e| e.to_string())
                            .and_then(|b| log.append(FS_RECORD_TAG, &b).map_err(|e| e.to_string()));
                        match appended {
                            Ok(lsn) => {
                                if let FsRecord::Prepared { plan, .. } = rec {
                                    v.prepared_at(tid, plan, lsn.get());
                                }
                                any = true;
                            }
                            Err(e) => {
                                for v in self.0.volumes.values() {
                                    v.abort(tid);
                                }
                                return Vote::No(format!(
                                    "fs volume {}: cannot log the prepare record: {e}",
                                    v.name()
                                ));
                            }
                        }
                    }
                    Err(why) => {
                        for v in self.0.volumes.values() {
                            v.abort(tid);
                        }
                        return Vote::No(why);
                    }
                }
            }
            if any {
                Vote::Yes { durable: true }
            } else {
                Vote::ReadOnly
            }
        })
    }

    fn commit(&self, tid: Tid) -> BoxFuture<'_, ()> {
        let inner = Arc::clone(&self.0);
        Box::pin(async move {
            let publish = {
                let inner = Arc::clone(&inner);
                move || {
                    inner
                        .volumes
                        .values()
                        .filter_map(|v| v.publish(tid, inner.hook.as_ref()).map(|p| (v.clone(), p)))
                        .collect::<Vec<_>>()
                }
            };
            let finish = move |published: Vec<(Volume, Published)>| {
                for (v, p) in published {
                    v.finish(p, inner.hook.as_ref(), inner.log.get());
                }
            };
            // The commit record is durable. The changes are published
            // (renamed in, written in place: visible to every reader) before
            // this returns, so the transaction manager answers the
            // committer only once they show; making them durable (forces of
            // every file and directory, then the Applied record) runs in
            // the background. The branch keeps its locks until then, so the
            // next transaction touching these files waits for it.
            match tokio::runtime::Handle::try_current() {
                Ok(h) => {
                    let published = h.spawn_blocking(publish).await.unwrap_or_default();
                    h.spawn_blocking(move || finish(published));
                }
                Err(_) => finish(publish()),
            }
        })
    }

    fn abort(&self, tid: Tid) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            for v in self.0.volumes.values() {
                v.abort(tid);
            }
        })
    }

    fn held(&self) -> Vec<(Tid, String)> {
        self.0.volumes.values().flat_map(Volume::held).collect()
    }

    fn sub_ended(&self, tid: Tid, path: &SubPath, committed: bool) {
        for v in self.0.volumes.values() {
            v.sub_ended(tid, path, committed);
        }
    }
}

fn failure(e: impl std::fmt::Display) -> Failure {
    Failure::new(Status::Internal, format!("fs: {e}"))
}

impl Plugin for Fs {
    fn name(&self) -> &str {
        SERVICE
    }

    fn attach(&self, tm: &TxManager, log: &Log) -> Result<(), Failure> {
        let _ = self.inner.tm.set(tm.clone());
        let _ = self.inner.log.set(log.clone());
        tm.register_resource(self.resource());
        Ok(())
    }

    fn recover(&self, tm: &TxManager, records: &[LogRecord]) -> Result<(), Failure> {
        let (mut redone, mut dropped, mut in_doubt) = (0, 0, 0);
        let mut decoded = Vec::new();
        let mut applied = std::collections::HashSet::new();
        for r in records.iter().filter(|r| r.tag == FS_RECORD_TAG) {
            let rec: FsRecord = postcard::from_bytes(&r.payload)
                .map_err(|e| failure(format!("undecodable record at {}: {e}", r.lsn)))?;
            match rec {
                FsRecord::Applied { tid, volume } => {
                    applied.insert((tid, volume));
                }
                FsRecord::Prepared { tid, volume, plan } => {
                    decoded.push((r.lsn, tid, volume, plan))
                }
            }
        }
        for (lsn, tid, volume, plan) in decoded {
            if applied.contains(&(tid, volume.clone())) {
                continue;
            }
            let Some(v) = self.inner.volumes.get(&volume) else {
                tracing::error!(%tid, volume, "fs: a prepared transaction names a volume this node no longer serves; its changes stay unapplied");
                continue;
            };
            match tm.recovered(tid) {
                Some(Recovered::Committed) => {
                    v.redo(tid, &plan, self.inner.log.get()).map_err(failure)?;
                    redone += 1;
                }
                Some(Recovered::InDoubt) => {
                    v.keep_in_doubt(tid, plan, lsn.get()).map_err(failure)?;
                    in_doubt += 1;
                }
                Some(Recovered::Aborted) | None => dropped += 1,
            }
        }
        let mut orphans = 0;
        for v in self.inner.volumes.values() {
            orphans += v.clean_orphans().map_err(failure)?;
        }
        tracing::info!(redone, dropped, in_doubt, orphans, "fs recovered");
        Ok(())
    }

    fn serve(&self, rpc: &Rpc) -> Result<(), Failure> {
        let fs = self.clone();
        rpc.register(
            SERVICE,
            ServiceOptions::with_participant(self.resource()),
            move |ctx, req: FsRequest| {
                let fs = fs.clone();
                async move { fs.serve_call(ctx, req).await }
            },
        )
    }

    fn checkpoint(&self, _log: &Log) -> Result<Option<Lsn>, Failure> {
        Ok(self
            .inner
            .volumes
            .values()
            .filter_map(Volume::oldest_prepared)
            .min()
            .map(Lsn))
    }
}

#[derive(Clone)]
enum Target {
    Local(Fs),
    Remote { rpc: Rpc, addr: Address },
}

/// A volume as a transaction uses it: on this node ([`Fs::local`]) or on
/// another through weft RPC ([`VolumeRef::remote`]); the operations are the
/// same. Each takes the transaction's context: the volume's node becomes a
/// participant, its changes commit or abort with the transaction, and its
/// locks belong to the transaction (every process of it shares them).
#[derive(Clone)]
pub struct VolumeRef {
    volume: String,
    target: Target,
}

impl VolumeRef {
    /// The volume `volume` served by node `node`, reached through `rpc`.
    pub fn remote(rpc: &Rpc, node: NodeId, volume: &str) -> VolumeRef {
        VolumeRef {
            volume: volume.to_string(),
            target: Target::Remote {
                rpc: rpc.clone(),
                addr: Address::new(SERVICE, node).expect("\"fs\" is a valid service name"),
            },
        }
    }

    /// The volume's name.
    pub fn name(&self) -> &str {
        &self.volume
    }

    async fn run(&self, tx: &TxContext, op: FsOp) -> Result<FsReply, FsError> {
        let req = FsRequest {
            volume: self.volume.clone(),
            op,
        };
        match &self.target {
            Target::Local(fs) => {
                fs.enlist(tx.tid)?;
                fs.execute(&tx.xid(), req).await
            }
            Target::Remote { rpc, addr } => {
                let payload = rpc
                    .call_payload(Some(tx), addr, Payload::local(req), None)
                    .await?;
                let resp: FsResponse = payload.decode().map_err(|e| {
                    FsError::Tx(Failure::new(
                        Status::Mismatch,
                        format!("response of {addr} is not an fs response: {e}"),
                    ))
                })?;
                resp
            }
        }
    }

    async fn done(&self, tx: &TxContext, op: FsOp) -> Result<(), FsError> {
        match self.run(tx, op).await? {
            FsReply::Done => Ok(()),
            other => Err(unexpected(other)),
        }
    }

    /// Creates an empty file (or empties one, unless `exclusive`).
    ///
    /// Fails with [`FsError`]: Escape/BadPath, NotFound (no directory),
    /// AlreadyExists, IsADirectory, LockConflict, TooLarge, NoSpace, Io, or
    /// Tx (not joined, aborted, host dead...).
    pub async fn create(&self, tx: &TxContext, path: &str, exclusive: bool) -> Result<(), FsError> {
        self.done(
            tx,
            FsOp::Create {
                path: path.into(),
                exclusive,
            },
        )
        .await
    }

    /// Writes `data` at `offset` of an existing file.
    ///
    /// Fails like [`VolumeRef::create`], and NotFound for a missing file.
    pub async fn write(
        &self,
        tx: &TxContext,
        path: &str,
        offset: u64,
        data: Bytes,
    ) -> Result<(), FsError> {
        self.done(
            tx,
            FsOp::Write {
                path: path.into(),
                offset,
                data,
            },
        )
        .await
    }

    /// Sets a file's length.
    ///
    /// Fails like [`VolumeRef::write`].
    pub async fn truncate(&self, tx: &TxContext, path: &str, len: u64) -> Result<(), FsError> {
        self.done(
            tx,
            FsOp::Truncate {
                path: path.into(),
                len,
            },
        )
        .await
    }

    /// Deletes a file.
    ///
    /// Fails with NotFound, IsADirectory, and like [`VolumeRef::create`].
    pub async fn delete(&self, tx: &TxContext, path: &str) -> Result<(), FsError> {
        self.done(tx, FsOp::Delete { path: path.into() }).await
    }

    /// Renames a file (also across directories; replaces a file at `to`).
    ///
    /// Fails with NotFound, Unsupported (a directory), IsADirectory (`to`),
    /// and like [`VolumeRef::create`].
    pub async fn rename(&self, tx: &TxContext, from: &str, to: &str) -> Result<(), FsError> {
        self.done(
            tx,
            FsOp::Rename {
                from: from.into(),
                to: to.into(),
            },
        )
        .await
    }

    /// Creates a directory.
    ///
    /// Fails with AlreadyExists, NotFound, and like [`VolumeRef::create`].
    pub async fn mkdir(&self, tx: &TxContext, path: &str) -> Result<(), FsError> {
        self.done(tx, FsOp::Mkdir { path: path.into() }).await
    }

    /// Runs `ops` in order in one request (one round trip to a remote
    /// volume); returns one reply per op.
    ///
    /// Fails with the first op's error (the ops before it stay done in the
    /// transaction), Unsupported for a batch inside the batch.
    pub async fn batch(&self, tx: &TxContext, ops: Vec<FsOp>) -> Result<Vec<FsReply>, FsError> {
        match self.run(tx, FsOp::Batch { ops }).await? {
            FsReply::Batch(r) => Ok(r),
            r => Err(FsError::Tx(Failure::new(
                Status::Mismatch,
                format!("unexpected reply {r:?}"),
            ))),
        }
    }

    /// Removes an empty directory.
    ///
    /// Fails with NotFound, NotADirectory, DirectoryNotEmpty, and like
    /// [`VolumeRef::create`].
    pub async fn rmdir(&self, tx: &TxContext, path: &str) -> Result<(), FsError> {
        self.done(tx, FsOp::Rmdir { path: path.into() }).await
    }

    /// Creates a symbolic link `path` -> `target` (stored as given, never
    /// followed by weft).
    ///
    /// Fails with AlreadyExists, NotFound, BadPath (target), and like
    /// [`VolumeRef::create`].
    pub async fn symlink(&self, tx: &TxContext, path: &str, target: &str) -> Result<(), FsError> {
        self.done(
            tx,
            FsOp::Symlink {
                path: path.into(),
                target: target.into(),
            },
        )
        .await
    }

    /// Describes a name (None when absent).
    ///
    /// Fails with Escape/BadPath, LockConflict, Io, Tx.
    pub async fn stat(
        &self,
        tx: &TxContext,
        path: &str,
        mode: ReadMode,
    ) -> Result<Option<Meta>, FsError> {
        match self
            .run(
                tx,
                FsOp::Stat {
                    path: path.into(),
                    mode,
                },
            )
            .await?
        {
            FsReply::Meta(m) => Ok(m),
            other => Err(unexpected(other)),
        }
    }

    /// Lists a directory ("" for the root), without locks.
    ///
    /// Fails with NotFound, NotADirectory, Escape/BadPath, Io, Tx.
    pub async fn list(&self, tx: &TxContext, path: &str) -> Result<Vec<DirEntry>, FsError> {
        match self.run(tx, FsOp::List { path: path.into() }).await? {
            FsReply::Entries(e) => Ok(e),
            other => Err(unexpected(other)),
        }
    }

    /// Reads up to `len` bytes at `offset`.
    ///
    /// Fails with NotFound, IsADirectory, TooLarge (past the read limit),
    /// LockConflict, Io, Tx.
    pub async fn read(
        &self,
        tx: &TxContext,
        path: &str,
        offset: u64,
        len: u64,
        mode: ReadMode,
    ) -> Result<Bytes, FsError> {
        match self
            .run(
                tx,
                FsOp::Read {
                    path: path.into(),
                    offset,
                    len,
                    mode,
                },
            )
            .await?
        {
            FsReply::Data(d) => Ok(d),
            other => Err(unexpected(other)),
        }
    }

    /// Holds a read lock on a file until [`VolumeRef::close_file`] (degree 2
    /// across several reads).
    ///
    /// Fails with LockConflict, Escape/BadPath, TooLarge, Tx.
    pub async fn open_file(&self, tx: &TxContext, path: &str) -> Result<(), FsError> {
        self.done(tx, FsOp::Open { path: path.into() }).await
    }

    /// Releases one [`VolumeRef::open_file`].
    ///
    /// Fails with Escape/BadPath, Tx.
    pub async fn close_file(&self, tx: &TxContext, path: &str) -> Result<(), FsError> {
        self.done(tx, FsOp::Close { path: path.into() }).await
    }

    /// Writes everything `reader` yields into the existing file `path` from
    /// `offset`, in bounded chunks. Returns the bytes written.
    ///
    /// Fails like [`VolumeRef::write`], and with Io when `reader` fails.
    pub async fn write_from(
        &self,
        tx: &TxContext,
        path: &str,
        offset: u64,
        reader: &mut (dyn Read + Send),
    ) -> Result<u64, FsError> {
        if let Target::Local(fs) = &self.target {
            fs.enlist(tx.tid)?;
            return fs
                .volume(&self.volume)?
                .write_from(&tx.xid(), path, offset, reader)
                .await;
        }
        let mut buf = vec![0u8; REMOTE_CHUNK];
        let mut total = 0u64;
        loop {
            let n =
                fill(reader, &mut buf).map_err(|e| FsError::io(format!("{path}: source"), &e))?;
            if n == 0 {
                return Ok(total);
            }
            self.write(tx, path, offset + total, Bytes::copy_from_slice(&buf[..n]))
                .await?;
            total += n as u64;
        }
    }

    /// Makes `path` a copy of the local file `source` (created or
    /// replaced). Locally the kernel copies it into the staging area; remotely
    /// it travels in bounded chunks. Returns the bytes copied.
    ///
    /// Fails like [`VolumeRef::create`], and with NotFound/Io when `source`
    /// cannot be read.
    pub async fn put_file(
        &self,
        tx: &TxContext,
        path: &str,
        source: &Path,
    ) -> Result<u64, FsError> {
        if let Target::Local(fs) = &self.target {
            fs.enlist(tx.tid)?;
            return fs
                .volume(&self.volume)?
                .put_file(&tx.xid(), path, source)
                .await;
        }
        let mut f = std::fs::File::open(source).map_err(|e| FsError::io(source.display(), &e))?;
        self.create(tx, path, false).await?;
        self.write_from(tx, path, 0, &mut f).await
    }

    /// Makes `path` hold the local file `source`, which is consumed: on a
    /// local volume it is moved into the staging area (renamed when on the
    /// volume's file system, nothing copied); remotely it is streamed like
    /// [`VolumeRef::put_file`] and then removed. Returns the bytes.
    ///
    /// Fails like [`VolumeRef::put_file`].
    pub async fn take_file(
        &self,
        tx: &TxContext,
        path: &str,
        source: &Path,
    ) -> Result<u64, FsError> {
        if let Target::Local(fs) = &self.target {
            fs.enlist(tx.tid)?;
            return fs
                .volume(&self.volume)?
                .take_file(&tx.xid(), path, source)
                .await;
        }
        let n = self.put_file(tx, path, source).await?;
        let _ = std::fs::remove_file(source);
        Ok(n)
    }

    /// Streams the file `path` into `out` in bounded chunks. Returns the
    /// bytes read. Remotely each chunk is a read under `mode`; hold
    /// [`VolumeRef::open_file`] around it for one degree-2 lock over the whole.
    ///
    /// Fails like [`VolumeRef::read`], and with Io when `out` fails.
    pub async fn read_to(
        &self,
        tx: &TxContext,
        path: &str,
        mode: ReadMode,
        out: &mut (dyn Write + Send),
    ) -> Result<u64, FsError> {
        if let Target::Local(fs) = &self.target {
            fs.enlist(tx.tid)?;
            return fs
                .volume(&self.volume)?
                .read_to(&tx.xid(), path, mode, out)
                .await;
        }
        let mut off = 0u64;
        loop {
            let chunk = self.read(tx, path, off, REMOTE_CHUNK as u64, mode).await?;
            if chunk.is_empty() {
                return Ok(off);
            }
            out.write_all(&chunk)
                .map_err(|e| FsError::io(format!("{path}: destination"), &e))?;
            off += chunk.len() as u64;
        }
    }
}

fn unexpected(r: FsReply) -> FsError {
    FsError::Tx(Failure::new(
        Status::Mismatch,
        format!("fs: unexpected reply {r:?}"),
    ))
}

fn fill(r: &mut (dyn Read + Send), buf: &mut [u8]) -> std::io::Result<usize> {
    let mut done = 0;
    while done < buf.len() {
        match r.read(&mut buf[done..]) {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(done)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn volumes_are_named_and_found_by_directory() {
        let a = tempfile::tempdir().unwrap();
        let b = tempfile::tempdir().unwrap();
        std::fs::create_dir(b.path().join("sub")).unwrap();
        let cfg = FsConfig::default()
            .volume_spec(&a.path().display().to_string())
            .unwrap()
            .volume_spec(&format!("named={}", b.path().display()))
            .unwrap();
        let fs = Fs::new(cfg).unwrap();
        let a_name = a.path().file_name().unwrap().to_string_lossy().to_string();
        assert!(fs.volume(&a_name).is_ok());
        assert!(matches!(fs.volume("nope"), Err(FsError::NoSuchVolume(_))));
        let (v, rest) = fs.volume_of(&b.path().join("sub")).unwrap();
        assert_eq!((v.name(), rest.as_str()), ("named", "sub"));
        let elsewhere = tempfile::tempdir().unwrap();
        assert!(matches!(
            fs.volume_of(elsewhere.path()),
            Err(FsError::NoSuchVolume(_))
        ));
        assert!(matches!(
            FsConfig::default().volume_spec("=/x"),
            Err(FsError::BadPath(_))
        ));
        let dup = FsConfig::default()
            .volume("x", a.path())
            .volume("x", b.path());
        assert!(matches!(Fs::new(dup), Err(FsError::BadPath(_))));
    }
}
