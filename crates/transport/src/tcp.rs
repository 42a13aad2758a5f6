//! The TCP channel: length-prefixed frames (the wire header carries the
//! length) over non-blocking sockets with TCP_NODELAY, driven by the tokio
//! reactor through `AsyncFd`.
//!
//! Sending writes straight to the socket from the sender's context when the
//! socket is idle (no task hop on the fast path); while a write is in
//! progress, other frames are appended to one buffer and go out together in
//! the next write (small frames coalesced under load). A writer task takes
//! over only when the kernel buffer is full. Receiving reads until a short
//! read shows the socket drained and only then waits for readiness again, so
//! a message costs one `recv`, not a second one that fails with EAGAIN.
//! Owns sockets, never protocol state.

use std::io::{self, Read, Write};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use bytes::{Buf, BytesMut};
use parking_lot::Mutex;
use tokio::io::unix::AsyncFd;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;
use weft_wire::{decode_frame, encode_message, Failure, Frame, Limits, NodeId, Status};

use crate::channel::{io_error, ChannelKind, IoError, LinkIo};
use crate::endpoint::Inner;
use crate::handshake::Side;
use crate::link::Link;

/// Most bytes buffered for one link before senders get `Full`.
const MAX_BUFFERED: usize = 256 << 20;

/// Who is writing to the socket. Exactly one writer at a time; others only
/// append to the buffer, and the writer takes what they appended.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Writer {
    /// Nobody: the next sender writes inline.
    Idle,
    /// A sender, inline on its own thread; it never waits for the socket.
    Sender,
    /// The writer task, waiting for room in a full socket.
    Task,
}

struct WriteState {
    buf: BytesMut,
    writer: Writer,
}

/// Bytes read from the socket in one `recv`.
const READ_CHUNK: usize = 64 * 1024;

/// One end of a TCP link.
pub(crate) struct TcpIo {
    stream: AsyncFd<std::net::TcpStream>,
    write: Mutex<WriteState>,
    flush: Notify,
    peer_max_frame: AtomicUsize,
    peer_max_message: AtomicUsize,
    next_message_id: AtomicU64,
    closed: AtomicBool,
    desc: String,
}

impl TcpIo {
    fn new(stream: TcpStream, limits: &Limits, desc: String) -> io::Result<Arc<TcpIo>> {
        let std = stream.into_std()?;
        std.set_nonblocking(true)?;
        // SAFETY: the AsyncFd owns the TcpStream, which owns its descriptor:
        // the descriptor stays open and is the same one for as long as the
        // AsyncFd lives (we never take the stream out or swap it), which is
        // what `register` requires. Every TCP test runs through here.
        let stream = unsafe { AsyncFd::register(std) }.map_err(io::Error::from)?;
        Ok(Arc::new(TcpIo {
            stream,
            write: Mutex::new(WriteState {
                buf: BytesMut::with_capacity(8192),
                writer: Writer::Idle,
            }),
            flush: Notify::new(),
            peer_max_frame: AtomicUsize::new(limits.max_frame),
            peer_max_message: AtomicUsize::new(limits.max_message),
            next_message_id: AtomicU64::new(1),
            closed: AtomicBool::new(false),
            desc,
        }))
    }

    /// Writes as much of `chunk` as the socket takes without blocking.
    /// Returns true when all of it was written.
    fn write_now(&self, chunk: &mut BytesMut) -> io::Result<bool> {
        while !chunk.is_empty() {
            match self.stream.get_ref().write(chunk) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => chunk.advance(n),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
                Err(e) => return Err(e),
            }
        }
        Ok(true)
    }

    /// Puts an unwritten remainder back in front of whatever was appended
    /// meanwhile.
    fn requeue(st: &mut WriteState, mut rest: BytesMut) {
        let newer = std::mem::take(&mut st.buf);
        rest.unsplit(newer);
        st.buf = rest;
    }

    /// Shuts the socket down (both ways); the reader then sees it closed.
    /// Only the writer of the moment, or [`LinkIo::close`] when nobody
    /// writes, calls this, so queued frames are never cut off mid-write.
    fn shut(&self) {
        let _ = self.stream.get_ref().shutdown(std::net::Shutdown::Both);
    }

    /// The writer of the moment found the socket broken: marks the link
    /// closed (later sends fail at once) and shuts the socket down.
    fn abandon(&self) {
        self.closed.store(true, Ordering::Release);
        self.shut();
    }

    /// The writer's last act once the link is closed: best effort, whatever
    /// the kernel takes now of what is queued (such as the Refused frame
    /// that says why) goes out, then the socket is shut down. Never waits
    /// for a slow peer.
    fn finish(&self, mut rest: BytesMut) {
        let _ = self.write_now(&mut rest);
        self.shut();
    }

    /// Writes what senders queued while the socket was full. Owns the socket
    /// only while the state says [`Writer::Task`]; a close wakes it.
    async fn writer_task(self: Arc<Self>, link: Weak<Link>) {
        loop {
            self.flush.notified().await;
            loop {
                let mut chunk = {
                    let mut st = self.write.lock();
                    if st.writer != Writer::Task {
                        break; // woken by a close while a sender writes
                    }
                    if self.closed.load(Ordering::Acquire) {
                        let rest = st.buf.split();
                        drop(st);
                        self.finish(rest);
                        return;
                    }
                    if st.buf.is_empty() {
                        st.writer = Writer::Idle;
                        break;
                    }
                    st.buf.split()
                };
                match self.write_now(&mut chunk) {
                    Ok(true) => {}
                    Ok(false) => {
                        Self::requeue(&mut self.write.lock(), chunk);
                        tokio::select! {
                            // The kernel buffer was full: wait for room.
                            ready = self.stream.writable() => match ready {
                                Ok(mut ready) => ready.clear_ready(),
                                Err(_) => {
                                    self.abandon();
                                    self.fail(&link, "socket not writable");
                                    return;
                                }
                            },
                            // The link closed: stop waiting for a slow peer.
                            _ = self.flush.notified() => {}
                        }
                    }
                    Err(e) => {
                        self.abandon();
                        self.fail(&link, &format!("write failed: {e}"));
                        return;
                    }
                }
            }
        }
    }

    fn fail(&self, link: &Weak<Link>, reason: &str) {
        if let Some(link) = link.upgrade() {
            link.on_closed(reason);
        }
    }

    async fn reader_task(self: Arc<Self>, link: Weak<Link>, limits: Limits) {
        let mut buf = BytesMut::with_capacity(READ_CHUNK);
        let mut chunk = vec![0u8; READ_CHUNK];
        loop {
            if self.closed.load(Ordering::Acquire) {
                return;
            }
            let mut ready = match self.stream.readable().await {
                Ok(r) => r,
                Err(e) => {
                    self.fail(&link, &format!("read failed: {e}"));
                    return;
                }
            };
            match ready.get_inner().read(&mut chunk) {
                Ok(0) => {
                    self.fail(&link, "connection closed by peer");
                    return;
                }
                Ok(n) => {
                    if n < chunk.len() {
                        // A short read drained the socket: wait for the
                        // next readiness event instead of trying again.
                        ready.clear_ready();
                    }
                    drop(ready);
                    buf.extend_from_slice(&chunk[..n]);
                    loop {
                        match decode_frame(&mut buf, &limits) {
                            Ok(Some(frame)) => match link.upgrade() {
                                Some(l) => l.on_frame(frame),
                                None => return,
                            },
                            Ok(None) => break,
                            Err(e) => match link.upgrade() {
                                Some(l) if l.on_malformed(&e, "malformed frame") => {}
                                _ => return,
                            },
                        }
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => ready.clear_ready(),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    self.fail(&link, &format!("read failed: {e}"));
                    return;
                }
            }
        }
    }
}

impl LinkIo for TcpIo {
    fn send(&self, frame: Frame) -> Result<(), IoError> {
        if self.closed.load(Ordering::Acquire) {
            return Err(IoError::Closed);
        }
        let mut chunk = {
            let mut st = self.write.lock();
            if st.buf.len() > MAX_BUFFERED {
                return Err(IoError::Full);
            }
            let max = self.peer_max_frame.load(Ordering::Relaxed);
            let max_message = self.peer_max_message.load(Ordering::Relaxed);
            let id = self.next_message_id.fetch_add(1, Ordering::Relaxed);
            encode_message(&frame, max, max_message, id, &mut st.buf).map_err(io_error)?;
            if st.writer != Writer::Idle {
                return Ok(()); // the writer of the moment picks it up
            }
            st.writer = Writer::Sender;
            st.buf.split()
        };
        loop {
            match self.write_now(&mut chunk) {
                Ok(true) => {
                    let mut st = self.write.lock();
                    if !st.buf.is_empty() {
                        chunk = st.buf.split();
                        continue;
                    }
                    // Checked under the lock `close` takes, so exactly one of
                    // us shuts the socket down once the link is closed.
                    if self.closed.load(Ordering::Acquire) {
                        drop(st);
                        self.shut();
                    } else {
                        st.writer = Writer::Idle;
                    }
                    return Ok(());
                }
                Ok(false) => {
                    let mut st = self.write.lock();
                    Self::requeue(&mut st, chunk);
                    if self.closed.load(Ordering::Acquire) {
                        drop(st);
                        self.shut();
                    } else {
                        st.writer = Writer::Task;
                        drop(st);
                        self.flush.notify_one();
                    }
                    return Ok(());
                }
                Err(_) => {
                    // The reader notices the broken socket and closes the link.
                    self.abandon();
                    return Err(IoError::Closed);
                }
            }
        }
    }

    fn set_peer_limits(&self, max_frame: usize, max_message: usize) {
        self.peer_max_frame.store(max_frame, Ordering::Relaxed);
        self.peer_max_message.store(max_message, Ordering::Relaxed);
    }

    fn close(&self) {
        if self.closed.swap(true, Ordering::AcqRel) {
            return;
        }
        // Whoever writes at this moment sends what is queued (such as the
        // Refused frame that says why) and shuts the socket down: shutting it
        // under a sender's feet would lose the frames queued behind its write.
        let mut st = self.write.lock();
        match st.writer {
            Writer::Idle => {
                st.writer = Writer::Sender; // nobody writes after us
                let rest = st.buf.split();
                drop(st);
                self.finish(rest);
            }
            Writer::Sender => {} // it sees `closed` when its write returns
            Writer::Task => {
                drop(st);
                self.flush.notify_one(); // wakes it from waiting for room
            }
        }
    }

    fn kind(&self) -> ChannelKind {
        ChannelKind::Tcp
    }

    fn describe(&self) -> String {
        self.desc.clone()
    }
}

/// Wraps an accepted or connected socket in a link and starts its tasks.
fn attach(
    ep: &Arc<Inner>,
    stream: TcpStream,
    side: Side,
    expected: Option<NodeId>,
) -> io::Result<Arc<Link>> {
    stream.set_nodelay(true)?;
    let desc = match (stream.local_addr(), stream.peer_addr()) {
        (Ok(l), Ok(p)) => format!("tcp {l} -> {p}"),
        _ => "tcp".to_string(),
    };
    let io = TcpIo::new(stream, &ep.cfg.limits, desc)?;
    let link = Link::new(ep, side, ChannelKind::Tcp, expected);
    link.attach(io.clone());
    ep.register_link(&link);
    ep.spawn(io.clone().reader_task(Arc::downgrade(&link), ep.cfg.limits));
    ep.spawn(io.writer_task(Arc::downgrade(&link)));
    Ok(link)
}

/// Binds the listener and spawns the accept loop. Returns the bound address.
pub(crate) async fn listen(ep: &Arc<Inner>, addr: SocketAddr) -> io::Result<SocketAddr> {
    let listener = TcpListener::bind(addr).await?;
    let bound = listener.local_addr()?;
    let weak = Arc::downgrade(ep);
    ep.spawn(async move {
        loop {
            let (stream, _) = match listener.accept().await {
                Ok(s) => s,
                Err(e) => {
                    tracing::warn!("accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                }
            };
            let Some(ep) = weak.upgrade() else { return };
            if ep.is_crashed() || ep.is_closing() {
                return;
            }
            match attach(&ep, stream, Side::Acceptor, None) {
                Ok(link) => ep.spawn(link.handshake_deadline(ep.cfg.handshake_timeout)),
                Err(e) => tracing::warn!("cannot set up an accepted connection: {e}"),
            }
        }
    });
    Ok(bound)
}

/// Connects to `addr` and starts the handshake. The returned link may still
/// be handshaking; see [`Link::established`].
///
/// Fails with ProcDead when the connection is refused (the host answers, no
/// process listens), HostDead when it times out, AddrError otherwise.
pub(crate) async fn connect(
    ep: &Arc<Inner>,
    addr: SocketAddr,
    expected: Option<NodeId>,
) -> Result<Arc<Link>, Failure> {
    let stream = match tokio::time::timeout(ep.cfg.connect_timeout, TcpStream::connect(addr)).await
    {
        Ok(Ok(s)) => s,
        Ok(Err(e)) if e.kind() == io::ErrorKind::ConnectionRefused => {
            return Err(Failure::new(
                Status::ProcDead,
                format!("connection to {addr} refused: no process listening"),
            ))
        }
        Ok(Err(e)) => {
            return Err(Failure::new(
                Status::HostDead,
                format!("cannot connect to {addr}: {e}"),
            ))
        }
        Err(_) => {
            return Err(Failure::new(
                Status::HostDead,
                format!(
                    "connecting to {addr} timed out after {:?}",
                    ep.cfg.connect_timeout
                ),
            ))
        }
    };
    let link = attach(ep, stream, Side::Initiator, expected).map_err(|e| {
        Failure::new(
            Status::ProcDead,
            format!("cannot set up the connection to {addr}: {e}"),
        )
    })?;
    link.start();
    Ok(link)
}
