//! Setting up shared-memory links: the rendezvous every node listens on, the
//! exchange that hands a fresh segment to the peer, and resolution (when a
//! peer is reached through shared memory at all).
//!
//! The rendezvous is a Unix stream socket (mode 0600, in `ShmConfig::dir`,
//! named `weft-shm-<uid>-<pid>-<node>-<n>.sock`). To open a link, the
//! initiator connects, checks the listener's credentials (same user, the pid
//! the node announced), creates a sealed memfd segment, sends it with the
//! socket (SCM_RIGHTS) and waits for one acknowledgement byte. The acceptor
//! checks the connecting user, the seals, the size and the header first.
//! Both then run the ordinary link handshake (cluster secret proofs) through
//! the rings. The connection stays open for the link's life: the kernel
//! closes it when either process exits, which is how death is noticed.
//!
//! Owns the rendezvous files (removed when the listener stops; those left by
//! dead processes are removed at the next start). Must never trust what the
//! peer sends before the handshake, nor fall back silently when the peer's
//! process is gone (that is ProcDead, not a reason to try TCP).

use std::collections::HashSet;
use std::io;
use std::os::fd::AsFd;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Once};
use std::time::Duration;

use parking_lot::Mutex;
use tokio::io::Interest;
use tokio::net::{UnixListener, UnixStream};
use weft_wire::{Failure, NodeId, PeerRole, Status};

use super::channel::{Channel, ShmIo, ToLink};
use super::mem::{self, Segment};
use super::ring::Layout;
use super::ShmConfig;
use crate::channel::ChannelKind;
use crate::endpoint::Inner;
use crate::handshake::Side;
use crate::link::Link;
use crate::naming::NodeInfo;

/// What the initiator sends with the segment.
const SETUP_MAGIC: &[u8; 8] = b"WEFTSHM1";
/// The acceptor's acknowledgement.
const ACK: u8 = 0x5a;
/// File name prefix of rendezvous sockets.
const PREFIX: &str = "weft-shm-";
/// Longest rendezvous path (a Unix socket address holds 108 bytes).
const MAX_PATH: usize = 100;

static NEXT_RENDEZVOUS: AtomicU64 = AtomicU64::new(1);
static SWEPT: Once = Once::new();
/// Upgrades in progress, by (endpoint, peer).
static UPGRADING: Mutex<Option<HashSet<(usize, NodeId)>>> = Mutex::new(None);

/// The directory rendezvous live in: the configured one, or the system's
/// temporary directory when that does not exist.
fn rendezvous_dir(cfg: &ShmConfig) -> PathBuf {
    if cfg.dir.is_dir() {
        cfg.dir.clone()
    } else {
        std::env::temp_dir()
    }
}

/// Removes rendezvous files of this user whose process is gone. Returns how
/// many were removed.
pub(crate) fn sweep_stale(dir: &Path) -> usize {
    let own = format!("{PREFIX}{}-", mem::uid());
    let mut removed = 0;
    for entry in super::leftovers_of_dead_processes(dir, &own) {
        let owned = entry
            .metadata()
            .map(|m| m.uid() == mem::uid())
            .unwrap_or(false);
        if owned && std::fs::remove_file(entry.path()).is_ok() {
            removed += 1;
        }
    }
    if removed > 0 {
        tracing::info!(dir = %dir.display(), removed, "removed stale shm rendezvous files");
    }
    removed
}

/// Removes the rendezvous file when the listener stops.
struct RemoveOnDrop(PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Binds this node's rendezvous and starts accepting shm links on it.
/// Returns the rendezvous to announce in naming.
///
/// Fails when the socket cannot be bound or its path is too long.
pub(crate) async fn listen(ep: &Arc<Inner>) -> io::Result<String> {
    let dir = rendezvous_dir(&ep.cfg.shm);
    SWEPT.call_once(|| {
        sweep_stale(&dir);
    });
    let name = format!(
        "{PREFIX}{}-{}-{}-{}.sock",
        mem::uid(),
        std::process::id(),
        ep.cfg.node.0,
        NEXT_RENDEZVOUS.fetch_add(1, Ordering::Relaxed)
    );
    let path = dir.join(name);
    let text = path
        .to_str()
        .filter(|s| s.len() <= MAX_PATH)
        .ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("rendezvous path {} unusable", path.display()),
            )
        })?
        .to_string();
    let listener = UnixListener::bind(&path)?;
    let guard = RemoveOnDrop(path.clone());
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))?;
    let weak = Arc::downgrade(ep);
    ep.spawn(async move {
        let _guard = guard;
        loop {
            let stream = match listener.accept().await {
                Ok((s, _)) => s,
                Err(e) => {
                    tracing::warn!("shm accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                }
            };
            let Some(ep) = weak.upgrade() else { return };
            if ep.is_crashed() || ep.is_closing() {
                return;
            }
            let ep2 = Arc::clone(&ep);
            ep.spawn(async move {
                let timeout = ep2.cfg.connect_timeout;
                match tokio::time::timeout(timeout, accept(&ep2, stream)).await {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => tracing::warn!(node = %ep2.cfg.node, "shm link refused: {e}"),
                    Err(_) => tracing::warn!(node = %ep2.cfg.node, "shm link setup timed out"),
                }
            });
        }
    });
    Ok(text)
}

/// Receives the setup message: the magic and exactly one descriptor.
async fn recv_setup(stream: &UnixStream) -> io::Result<std::os::fd::OwnedFd> {
    let mut buf = [0u8; 16];
    loop {
        stream.readable().await?;
        let got = stream.try_io(Interest::READABLE, || {
            mem::recv_with_fd(stream.as_fd(), &mut buf)
        });
        match got {
            Ok((n, fds)) => {
                if n == 0 {
                    return Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "peer hung up before sending a segment",
                    ));
                }
                if &buf[..n] != SETUP_MAGIC || fds.len() != 1 {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        format!("bad setup message ({n} bytes, {} descriptors)", fds.len()),
                    ));
                }
                return fds
                    .into_iter()
                    .next()
                    .ok_or_else(|| io::Error::other("no fd"));
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(e),
        }
    }
}

/// Accepts one shm link on the rendezvous.
async fn accept(ep: &Arc<Inner>, stream: UnixStream) -> io::Result<()> {
    let cred = stream.peer_cred()?;
    if cred.uid() != mem::uid() {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!(
                "connection from user {} (only {} may connect)",
                cred.uid(),
                mem::uid()
            ),
        ));
    }
    let fd = recv_setup(&stream).await?;
    let seg = Segment::open(fd, Layout::min_segment_bytes(), Layout::max_segment_bytes())
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e.to_string()))?;
    let layout = Layout::read(seg.words())
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e.to_string()))?;
    loop {
        stream.writable().await?;
        match stream.try_write(&[ACK]) {
            Ok(1) => break,
            Ok(_) => return Err(io::ErrorKind::WriteZero.into()),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(e),
        }
    }
    let pid = cred.pid().unwrap_or(0);
    let desc = format!(
        "shm from pid {pid} ({} KiB rings)",
        layout.ring_bytes() >> 10
    );
    attach(ep, seg, layout, Side::Acceptor, stream, None, desc)?;
    Ok(())
}

/// Wraps a set-up segment in a channel and a link, starts the reader thread
/// and the death watch.
fn attach(
    ep: &Arc<Inner>,
    seg: Segment,
    layout: Layout,
    side: Side,
    stream: UnixStream,
    expected: Option<NodeId>,
    desc: String,
) -> io::Result<Arc<Link>> {
    let index = match side {
        Side::Initiator => 0,
        Side::Acceptor => 1,
    };
    let ch = Channel::new(
        seg,
        layout,
        index,
        ep.cfg.limits,
        &ep.cfg.shm,
        Some(Arc::new(stream)),
        desc,
    );
    let link = Link::new(ep, side, ChannelKind::Shm, expected);
    ch.attach(Box::new(ToLink(Arc::downgrade(&link))));
    link.attach(Arc::new(ShmIo(Arc::clone(&ch))));
    ep.register_link(&link);
    let name = format!("weft-shm-{}-{}", ep.cfg.node.0, link.id);
    if let Err(e) = ch.start(name) {
        link.close(Status::Internal, "cannot start the shm reader thread");
        return Err(e);
    }
    ep.spawn(Arc::clone(&ch).watch_peer());
    Ok(link)
}

/// True when `info` is a node this endpoint should reach through shared
/// memory: shm enabled here and there, same host, another process.
fn applies(ep: &Inner, info: &NodeInfo) -> bool {
    ep.cfg.channels.shm
        && ep.cfg.role == PeerRole::Node
        && info.id != ep.cfg.node
        && info.shm.is_some()
        && info.host == ep.cfg.host_id
        && info.pid != std::process::id()
}

fn soft(reason: String) -> Failure {
    Failure::new(Status::Unavailable, reason)
}

/// Opens an shm link to `to` and starts its handshake (the returned link may
/// still be handshaking).
///
/// Fails with ProcDead when the node's process is gone, Unavailable when
/// shared memory cannot be used with it (the caller may use TCP).
async fn connect(ep: &Arc<Inner>, to: NodeId, info: &NodeInfo) -> Result<Arc<Link>, Failure> {
    let Some(path) = info.shm.as_deref() else {
        return Err(soft(format!("node {to} announces no shm rendezvous")));
    };
    let timeout = ep.cfg.connect_timeout;
    let stream = match tokio::time::timeout(timeout, UnixStream::connect(path)).await {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => {
            if !mem::process_alive(info.pid) {
                return Err(Failure::new(
                    Status::ProcDead,
                    format!("node {to} (pid {}) is gone: {e}", info.pid),
                ));
            }
            return Err(soft(format!("cannot reach node {to} at {path}: {e}")));
        }
        Err(_) => return Err(soft(format!("connecting to {path} timed out"))),
    };
    let cred = stream
        .peer_cred()
        .map_err(|e| soft(format!("no credentials on {path}: {e}")))?;
    if cred.uid() != mem::uid() || cred.pid() != i32::try_from(info.pid).ok() {
        return Err(soft(format!(
            "{path} belongs to pid {:?} of user {}, not node {to} (pid {})",
            cred.pid(),
            cred.uid(),
            info.pid
        )));
    }
    let layout = Layout::new(ep.cfg.shm.ring_bytes).map_err(soft)?;
    let seg = Segment::create("weft-shm", layout.segment_bytes())
        .map_err(|e| soft(format!("cannot create a segment: {e}")))?;
    layout.init(seg.words(), std::process::id());
    let handover = async {
        loop {
            stream.writable().await?;
            match stream.try_io(Interest::WRITABLE, || {
                mem::send_with_fd(stream.as_fd(), SETUP_MAGIC, seg.fd())
            }) {
                Ok(n) if n == SETUP_MAGIC.len() => break,
                Ok(_) => return Err(io::Error::other("setup message cut short")),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) => return Err(e),
            }
        }
        let mut ack = [0u8; 1];
        loop {
            stream.readable().await?;
            match stream.try_read(&mut ack) {
                Ok(1) if ack[0] == ACK => return Ok(()),
                Ok(_) => return Err(io::Error::other("the node refused the segment")),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) => return Err(e),
            }
        }
    };
    match tokio::time::timeout(timeout, handover).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => return Err(soft(format!("shm setup with node {to} failed: {e}"))),
        Err(_) => return Err(soft(format!("shm setup with node {to} timed out"))),
    }
    let desc = format!(
        "shm to node {to} pid {} ({} KiB rings)",
        info.pid,
        layout.ring_bytes() >> 10
    );
    let link = attach(ep, seg, layout, Side::Initiator, stream, Some(to), desc)
        .map_err(|e| soft(format!("cannot start the shm link: {e}")))?;
    link.start();
    Ok(link)
}

/// Resolution's shm step, called by `connect_peer` for a peer with no link:
/// `None` when shared memory does not apply or cannot be used (go on with
/// TCP), else the outcome of the shm link's handshake.
pub(crate) async fn resolve(
    ep: &Arc<Inner>,
    to: NodeId,
    info: &NodeInfo,
) -> Option<Result<(), Failure>> {
    if !applies(ep, info) {
        return None;
    }
    match connect(ep, to, info).await {
        Ok(link) => Some(link.established(ep.cfg.connect_timeout).await.map(|_| ())),
        Err(f) if f.status == Status::ProcDead || !ep.cfg.channels.tcp => Some(Err(f)),
        Err(f) => {
            tracing::debug!(node = %ep.cfg.node, peer = %to, "shm unavailable, using tcp: {f}");
            None
        }
    }
}

/// Called when a member's information arrives: if the cheapest live link to
/// it is TCP while shared memory reaches it, opens an shm link in the
/// background (the link table prefers it once up). Of two nodes, the one with
/// the lower id upgrades, so a pair gets one segment.
pub(crate) fn consider_upgrade(ep: &Arc<Inner>, info: &NodeInfo, best: Option<ChannelKind>) {
    if best != Some(ChannelKind::Tcp) || !applies(ep, info) || ep.cfg.node >= info.id {
        return;
    }
    if ep.is_closing() || ep.is_crashed() {
        return;
    }
    let key = (Arc::as_ptr(ep) as usize, info.id);
    if !UPGRADING
        .lock()
        .get_or_insert_with(HashSet::new)
        .insert(key)
    {
        return;
    }
    let me = Arc::clone(ep);
    let info = info.clone();
    ep.spawn(async move {
        let result = match connect(&me, info.id, &info).await {
            Ok(link) => link.established(me.cfg.connect_timeout).await.map(|_| ()),
            Err(f) => Err(f),
        };
        if let Some(set) = UPGRADING.lock().as_mut() {
            set.remove(&key);
        }
        match result {
            Ok(()) => tracing::debug!(node = %me.cfg.node, peer = %info.id, "link upgraded to shm"),
            Err(f) => {
                tracing::debug!(node = %me.cfg.node, peer = %info.id, "shm upgrade failed: {f}")
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stale_rendezvous_of_dead_processes_are_swept() {
        let dir = std::env::temp_dir().join(format!("weft-sweep-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let uid = mem::uid();
        // A pid that cannot exist (above the kernel's pid limit).
        let dead = dir.join(format!("{PREFIX}{uid}-4194305-1-1.sock"));
        let mine = dir.join(format!("{PREFIX}{uid}-{}-1-1.sock", std::process::id()));
        let other = dir.join("unrelated-file");
        for p in [&dead, &mine, &other] {
            std::fs::write(p, b"").unwrap();
        }
        assert_eq!(sweep_stale(&dir), 1);
        assert!(!dead.exists());
        assert!(mine.exists() && other.exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
