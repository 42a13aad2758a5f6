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
//! While a [`crate::BusyPoll`] waits, it may read and deliver in the reader
//! task's place ([`poll`]), under the same lock, so frames keep their order.
//!
//! Every socket is bounded in time and space: both tasks of a link end when
//! it closes (they hold the descriptor); frames before the handshake are at
//! most `HANDSHAKE_MAX_FRAME` and judged by kind first; a frame begun must
//! finish within the reassembly timeout; a peer that stops reading loses
//! its link after `write_stall_timeout`; at most `max_handshaking` accepted
//! connections handshake at once; the accept loop backs off when the
//! process is out of descriptors. Owns sockets, never protocol state.
//!
//! With TLS configured ([`crate::tls`]), a connection first completes a
//! mutual-TLS handshake (accepted ones in their own task, under the
//! handshaking bound and the handshake timeout) and only then becomes a link;
//! the same paths then write and read through the rustls state, which
//! encrypts in the sender's context as plaintext TCP writes there. TLS
//! control records rustls wants to send on its own (an alert, a key update
//! answer) leave with the next write, at the latest the next heartbeat.
//! Frames inside TLS still carry their CRC32C, so the bytes stay those of
//! `docs/wire.md` for any client, but a TLS link does not check it
//! ([`Integrity::Trusted`] on receipt): the AEAD tag of every record
//! authenticates each byte already.

pub(crate) mod poll;

use std::io::{self, BufRead, Read, Write};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use bytes::{Buf, BytesMut};
use parking_lot::Mutex;
use tokio::io::unix::{AsyncFd, AsyncFdReadyGuard};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;
use weft_wire::{
    decode_frame_with, encode_frame, encode_message_with, peek_kind, Failure, Frame, FrameKind,
    Integrity, Limits, NodeId, Refused, Status,
};

use crate::channel::{io_error, ChannelKind, IoError, LinkIo};
use crate::endpoint::Inner;
use crate::handshake::Side;
use crate::link::Link;
use crate::tls;

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

/// The read side of a link: the bytes read and not yet framed. Held by
/// whoever reads the socket at the moment, the link's reader task or a
/// [`crate::BusyPoll`]: a read and the delivery of the frames it completes
/// happen under it, so frames are delivered in the order they came.
struct ReadState {
    buf: BytesMut,
    chunk: Box<[u8]>,
    /// When the frame at the front of `buf` began to arrive, if one is
    /// incomplete: a peer that starts a frame and stops (slowloris) must
    /// not hold the buffer forever, so a frame gets as long as a
    /// fragmented message does (before the handshake, its bound applies).
    partial_since: Option<tokio::time::Instant>,
}

/// What one pass over the socket (see [`TcpIo::pass`]) came to.
enum Pass {
    /// Nothing to read: the socket is drained.
    Empty,
    /// Read and delivered what came; `drained` when the read was short.
    Read { drained: bool },
    /// The link's inbox is full: read no more until it has room.
    InboxFull,
    /// The link is over (closed, failed or refused): stop reading.
    Over,
}

/// What [`TcpIo::take_frames`] came to when it did not end the link.
enum Taken {
    /// Every whole frame was delivered.
    Delivered,
    /// It stopped at a full inbox, frames may be left whole in the buffer.
    InboxFull,
}

/// One end of a TCP link.
pub(crate) struct TcpIo {
    stream: AsyncFd<std::net::TcpStream>,
    write: Mutex<WriteState>,
    read: Mutex<ReadState>,
    /// Wakes the reader task when a busy poller stopped at a full inbox or
    /// ended the link.
    resume: Notify,
    flush: Notify,
    peer_max_frame: AtomicUsize,
    peer_max_message: AtomicUsize,
    next_message_id: AtomicU64,
    closed: AtomicBool,
    /// Longest wait for room in a full socket; see
    /// [`crate::TransportConfig::write_stall_timeout`].
    stall: Duration,
    desc: String,
    /// The TLS state of a TLS link: every byte in and out goes through it.
    tls: Option<Mutex<rustls::Connection>>,
    /// Whether received frames' CRC32C is checked: on plain TCP it is;
    /// inside TLS it is not, as every record's AEAD tag already
    /// authenticates each byte (a damaged or altered record fails to
    /// decrypt and ends the link), so the check could catch nothing and
    /// would cost a pass over every frame. Sent frames always carry it.
    integrity: Integrity,
}

impl TcpIo {
    fn new(
        stream: TcpStream,
        limits: &Limits,
        stall: Duration,
        desc: String,
        tls: Option<rustls::Connection>,
    ) -> io::Result<Arc<TcpIo>> {
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
            read: Mutex::new(ReadState {
                buf: BytesMut::new(),
                chunk: vec![0u8; READ_CHUNK].into_boxed_slice(),
                partial_since: None,
            }),
            resume: Notify::new(),
            flush: Notify::new(),
            peer_max_frame: AtomicUsize::new(limits.max_frame),
            peer_max_message: AtomicUsize::new(limits.max_message),
            next_message_id: AtomicU64::new(1),
            closed: AtomicBool::new(false),
            stall,
            desc,
            integrity: if tls.is_some() {
                Integrity::Trusted
            } else {
                Integrity::Checksummed
            },
            tls: tls.map(Mutex::new),
        }))
    }

    /// Writes as much of `chunk` as the socket takes without blocking.
    /// Returns true when all of it was written.
    fn write_now(&self, chunk: &mut BytesMut) -> io::Result<bool> {
        if let Some(tls) = &self.tls {
            return self.write_tls(&mut tls.lock(), chunk);
        }
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

    /// [`Self::write_now`] through TLS: first what rustls holds encrypted
    /// already, then `chunk`, as much as rustls buffers at once. True once
    /// all of it (and everything rustls held) went to the socket.
    fn write_tls(&self, conn: &mut rustls::Connection, chunk: &mut BytesMut) -> io::Result<bool> {
        let mut sock = SendSocket(self.stream.get_ref());
        loop {
            while conn.wants_write() {
                match conn.write_tls(&mut sock) {
                    Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                    Ok(_) => {}
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
                    Err(e) => return Err(e),
                }
            }
            if chunk.is_empty() {
                return Ok(true);
            }
            // Takes at most what fits under rustls's buffer limit; the
            // loop sends it and comes back for the rest.
            let n = conn.writer().write(chunk)?;
            chunk.advance(n);
        }
    }

    /// Reads what the socket has (one `recv` of at most `chunk`'s size) and
    /// appends its plaintext to `buf`. Returns `None` at the end of the
    /// stream, else whether the read was short (the socket is drained).
    /// Through TLS, the records read are decrypted at once, and a read may
    /// append nothing (a record not whole yet, a TLS control message).
    fn read_some(&self, chunk: &mut [u8], buf: &mut BytesMut) -> io::Result<Option<bool>> {
        let n = self.stream.get_ref().read(chunk)?;
        if n == 0 {
            return Ok(None);
        }
        let drained = n < chunk.len();
        let Some(tls) = &self.tls else {
            buf.extend_from_slice(&chunk[..n]);
            return Ok(Some(drained));
        };
        let mut conn = tls.lock();
        let mut records = &chunk[..n];
        while !records.is_empty() {
            // rustls takes at most 4 KiB per `read_tls` (up to a whole
            // record): feed it until it is full or the bytes run out, then
            // decrypt everything whole at once, rather than trying to
            // decrypt after every 4 KiB.
            let mut fed = false;
            while !records.is_empty() {
                match conn.read_tls(&mut records) {
                    Ok(0) => break, // close_notify seen: nothing more is read
                    Ok(_) => fed = true,
                    // Its buffer is full: decrypt what it holds first.
                    Err(_) if fed => break,
                    Err(e) => return Err(e),
                }
            }
            if !fed {
                break;
            }
            if let Err(e) = conn.process_new_packets() {
                // rustls queued an alert saying why: best effort.
                let _ = conn.write_tls(&mut self.stream.get_ref());
                return Err(io::Error::new(io::ErrorKind::InvalidData, e));
            }
            // The plaintext goes straight from rustls's buffer to ours.
            let mut reader = conn.reader();
            loop {
                match reader.fill_buf() {
                    // The peer said close_notify: the stream ends here.
                    Ok([]) => return Ok(None),
                    Ok(plain) => {
                        let taken = plain.len();
                        buf.extend_from_slice(plain);
                        reader.consume(taken);
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                    Err(e) => return Err(e),
                }
            }
        }
        Ok(Some(drained))
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
        // A later `close` finds the link closed already and returns early:
        // the writer task must learn of it here, or it waits forever and
        // keeps the descriptor open.
        self.flush.notify_one();
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
    /// only while the state says [`Writer::Task`]. Every close wakes it, and
    /// it ends once the link is closed: it holds the socket, so a task that
    /// outlived its link would hold the descriptor forever.
    async fn writer_task(self: Arc<Self>, link: Weak<Link>) {
        loop {
            self.flush.notified().await;
            loop {
                let mut chunk = {
                    let mut st = self.write.lock();
                    if st.writer != Writer::Task {
                        if self.closed.load(Ordering::Acquire) {
                            // Closed while idle or while a sender wrote:
                            // that end shuts the socket; nothing left to do.
                            return;
                        }
                        break;
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
                            // The kernel buffer was full: wait for room, but
                            // not forever for a peer that stopped reading.
                            ready = tokio::time::timeout(self.stall, self.stream.writable()) => {
                                match ready {
                                    Ok(Ok(mut ready)) => ready.clear_ready(),
                                    Ok(Err(_)) => {
                                        self.abandon();
                                        self.fail(&link, "socket not writable");
                                        return;
                                    }
                                    Err(_) => {
                                        self.abandon();
                                        if let Some(link) = link.upgrade() {
                                            link.close(
                                                Status::TimedOut,
                                                &format!(
                                                    "the peer read nothing for {:?}",
                                                    self.stall
                                                ),
                                            );
                                        }
                                        return;
                                    }
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

    /// Reads frames until the link closes. `preread` holds what was read
    /// already (plaintext a TLS handshake decrypted along with its end).
    /// While the link is up, busy pollers may read and deliver in its place
    /// ([`poll`]); readiness is cleared only on this task's own short or
    /// empty read, so no arrival is missed whoever reads it.
    async fn reader_task(self: Arc<Self>, link: Weak<Link>, limits: Limits, preread: BytesMut) {
        // Frames read along with the TLS handshake are delivered before
        // any wait.
        let mut pass_first = !preread.is_empty();
        {
            let mut rs = self.read.lock();
            rs.buf = preread;
            rs.buf.reserve(READ_CHUNK);
        }
        let _pollable = poll::register(&self, &link, limits);
        loop {
            if self.closed.load(Ordering::Acquire) {
                return;
            }
            let mut ready = if std::mem::take(&mut pass_first) {
                None
            } else {
                match self.ready(&link, limits).await {
                    Some(ready) => ready,
                    None => return,
                }
            };
            let pass = self.pass(&mut self.read.lock(), &link, limits);
            match pass {
                // A short read drained the socket: wait for the next
                // readiness event instead of trying again.
                Pass::Empty | Pass::Read { drained: true } => {
                    if let Some(ready) = ready.as_mut() {
                        ready.clear_ready();
                    }
                }
                Pass::Read { drained: false } => {}
                Pass::InboxFull => {
                    // Stop reading until the node catches up: the peer's
                    // sends back up to it. The readiness is left set, so
                    // the next pass delivers what waits in the buffer first.
                    match link.upgrade() {
                        Some(l) => l.inbox_room().await,
                        None => return,
                    }
                }
                Pass::Over => return,
            }
        }
    }

    /// Waits until the socket is readable (`Some(Some(guard))`), or a busy
    /// poller hands the link back to this task (`Some(None)`: frames wait in
    /// the buffer for room, or the link is over), or the reader must stop
    /// (`None`: a frame begun too long ago is still incomplete, or the wait
    /// failed; the link is closed with the reason).
    async fn ready(
        &self,
        link: &Weak<Link>,
        limits: Limits,
    ) -> Option<Option<AsyncFdReadyGuard<'_, std::net::TcpStream>>> {
        loop {
            let since = self.read.lock().partial_since;
            let readable = async {
                tokio::select! {
                    r = self.stream.readable() => Some(r),
                    _ = self.resume.notified() => None,
                }
            };
            let ready = match since {
                None => readable.await,
                Some(since) => {
                    let until = since + limits.reassembly_timeout;
                    match tokio::time::timeout_at(until, readable).await {
                        Ok(r) => r,
                        // A busy poller may have read on meanwhile.
                        Err(_) if self.read.lock().partial_since != Some(since) => continue,
                        Err(_) => {
                            if let Some(l) = link.upgrade() {
                                l.refuse(
                                    Status::TimedOut,
                                    &format!(
                                        "a frame begun {:?} ago is still incomplete",
                                        limits.reassembly_timeout
                                    ),
                                );
                            }
                            return None;
                        }
                    }
                }
            };
            return match ready {
                Some(Ok(guard)) => Some(Some(guard)),
                Some(Err(e)) => {
                    self.fail(link, &format!("read failed: {e}"));
                    None
                }
                None => Some(None),
            };
        }
    }

    /// One pass over the socket: delivers the frames a full inbox left
    /// whole in the buffer, reads once (one `recv`) and delivers every frame
    /// that completed. A read that fails, or the end of the stream, ends the
    /// link here (`Pass::Over`).
    fn pass(&self, rs: &mut ReadState, link: &Weak<Link>, limits: Limits) -> Pass {
        let ReadState {
            buf,
            chunk,
            partial_since,
        } = rs;
        match self.take_frames(buf, partial_since, link, limits) {
            None => return Pass::Over,
            Some(Taken::InboxFull) => return Pass::InboxFull,
            Some(Taken::Delivered) => {}
        }
        let before = buf.len();
        match self.read_some(chunk, buf) {
            Ok(None) => {
                self.fail(link, "connection closed by peer");
                Pass::Over
            }
            Ok(Some(drained)) => {
                crate::metrics::bytes_received(ChannelKind::Tcp, buf.len() - before);
                match self.take_frames(buf, partial_since, link, limits) {
                    None => Pass::Over,
                    Some(Taken::InboxFull) => Pass::InboxFull,
                    Some(Taken::Delivered) => Pass::Read { drained },
                }
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => Pass::Empty,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => Pass::Read { drained: false },
            Err(e) if self.tls.is_some() && e.kind() == io::ErrorKind::InvalidData => {
                let (status, reason) = tls::stream_failure(&e);
                if let Some(l) = link.upgrade() {
                    tracing::warn!(link = %self.desc, "{reason}");
                    l.close(status, &reason);
                }
                Pass::Over
            }
            Err(e) => {
                self.fail(link, &format!("read failed: {e}"));
                Pass::Over
            }
        }
    }

    /// Hands every whole frame at the front of `buf` to the link, stopping
    /// early when the link's inbox is full, and notes when an incomplete
    /// frame left at the front began to arrive. Returns `None` when the
    /// reader must stop (link gone or closed, or the stream refused).
    fn take_frames(
        &self,
        buf: &mut BytesMut,
        partial_since: &mut Option<tokio::time::Instant>,
        link: &Weak<Link>,
        limits: Limits,
    ) -> Option<Taken> {
        let handshake_limits = limits.handshake();
        let mut whole = false;
        loop {
            if self.closed.load(Ordering::Acquire) {
                return None;
            }
            let l = link.upgrade()?;
            // The phase is judged first: before the handshake
            // completes, a frame of any kind but Hello, Auth
            // and Refused is refused by its header alone, and
            // frames may be no larger than a handshake needs.
            let up = l.is_up();
            if !up && self.tls.is_none() && buf.first() == Some(&tls::TLS_HANDSHAKE_BYTE) {
                l.refuse(Status::Refused, tls::TLS_TO_PLAINTEXT);
                return None;
            }
            if !up {
                if let Some(kind) = peek_kind(buf).filter(|k| {
                    !matches!(k, FrameKind::Hello | FrameKind::Auth | FrameKind::Refused)
                }) {
                    l.refuse(
                        Status::ProtocolError,
                        &format!("{kind:?} frame before the handshake completed"),
                    );
                    return None;
                }
            }
            if l.inbox_full() {
                return Some(Taken::InboxFull);
            }
            drop(l);
            let limits = if up { limits } else { handshake_limits };
            match decode_frame_with(buf, &limits, self.integrity) {
                Ok(Some(frame)) => {
                    whole = true;
                    link.upgrade()?.on_frame(frame);
                }
                Ok(None) => break,
                Err(e) => match link.upgrade() {
                    Some(l) if l.on_malformed(&e, "malformed frame") => {}
                    _ => return None,
                },
            }
        }
        *partial_since = match (buf.is_empty(), whole, *partial_since) {
            (true, _, _) => None,
            (false, false, Some(since)) => Some(since),
            (false, _, _) => Some(tokio::time::Instant::now()),
        };
        Some(Taken::Delivered)
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
            let before = st.buf.len();
            // Always checksummed: a peer written from docs/wire.md may check.
            encode_message_with(
                &frame,
                Integrity::Checksummed,
                max,
                max_message,
                id,
                &mut st.buf,
            )
            .map_err(io_error)?;
            crate::metrics::bytes_sent(ChannelKind::Tcp, st.buf.len() - before);
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
            Writer::Sender => drop(st), // it sees `closed` when its write returns
            Writer::Task => drop(st),   // it sees `closed` once woken below
        }
        // Whatever the writer task is doing (waiting for work, or for room in
        // a full socket) it wakes, sees the link closed and ends; a permit
        // is stored if it is not waiting yet.
        self.flush.notify_one();
    }

    fn kind(&self) -> ChannelKind {
        ChannelKind::Tcp
    }

    fn describe(&self) -> String {
        self.desc.clone()
    }
}

/// The socket as rustls writes to it: one record (a frame or a few, the
/// common case) goes out with `send`, as plaintext TCP's frames do, and
/// only several records at once with `writev`, which costs more per call
/// (rustls always hands its records over as a vectored write).
struct SendSocket<'a>(&'a std::net::TcpStream);

impl Write for SendSocket<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        (&mut &*self.0).write(buf)
    }

    fn write_vectored(&mut self, bufs: &[io::IoSlice<'_>]) -> io::Result<usize> {
        let mut full = bufs.iter().filter(|b| !b.is_empty());
        match (full.next(), full.next()) {
            (None, _) => Ok(0),
            (Some(one), None) => (&mut &*self.0).write(one),
            _ => (&mut &*self.0).write_vectored(bufs),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Wraps an accepted or connected socket in a link and starts its tasks.
fn attach(
    ep: &Arc<Inner>,
    stream: TcpStream,
    side: Side,
    expected: Option<NodeId>,
    tls: Option<(rustls::Connection, BytesMut)>,
) -> io::Result<Arc<Link>> {
    stream.set_nodelay(true)?;
    let what = if tls.is_some() { "tcp+tls" } else { "tcp" };
    let desc = match (stream.local_addr(), stream.peer_addr()) {
        (Ok(l), Ok(p)) => format!("{what} {l} -> {p}"),
        _ => what.to_string(),
    };
    let (conn, preread) = match tls {
        Some((conn, preread)) => (Some(conn), preread),
        None => (None, BytesMut::new()),
    };
    let io = TcpIo::new(
        stream,
        &ep.cfg.limits,
        ep.cfg.write_stall_timeout,
        desc,
        conn,
    )?;
    let link = Link::new(ep, side, ChannelKind::Tcp, expected);
    link.attach(io.clone());
    ep.register_link(&link);
    ep.spawn(
        io.clone()
            .reader_task(Arc::downgrade(&link), ep.cfg.limits, preread),
    );
    ep.spawn(io.writer_task(Arc::downgrade(&link)));
    Ok(link)
}

/// Binds the listener and spawns the accept loop. Returns the bound address.
pub(crate) async fn listen(ep: &Arc<Inner>, addr: SocketAddr) -> io::Result<SocketAddr> {
    let listener = TcpListener::bind(addr).await?;
    let bound = listener.local_addr()?;
    let weak = Arc::downgrade(ep);
    ep.spawn(accept_loop(listener, weak));
    Ok(bound)
}

/// First and largest pause after an accept that failed for want of
/// resources (descriptors, memory).
const ACCEPT_BACKOFF: (Duration, Duration) = (Duration::from_millis(10), Duration::from_secs(1));

/// Accepts connections until the node closes. Survives running out of
/// descriptors or memory: it logs once per episode and backs off (the
/// connection waits in the kernel's backlog) instead of spinning or dying.
/// At most `max_handshaking` accepted connections handshake at once; more
/// are told Unavailable and closed at once.
async fn accept_loop(listener: TcpListener, weak: Weak<Inner>) {
    let handshaking = Arc::new(AtomicUsize::new(0));
    let mut backoff = ACCEPT_BACKOFF.0;
    let mut starved = false;
    loop {
        let accepted = listener.accept().await;
        let Some(ep) = weak.upgrade() else { return };
        if ep.is_crashed() || ep.is_closing() {
            return;
        }
        let stream = match accepted {
            Ok((s, _)) => {
                if starved {
                    tracing::info!(node = %ep.cfg.node, "accepting connections again");
                    starved = false;
                }
                backoff = ACCEPT_BACKOFF.0;
                s
            }
            Err(e) if is_resource_exhaustion(&e) => {
                ep.accept_starved.fetch_add(1, Ordering::Relaxed);
                if !starved {
                    tracing::error!(node = %ep.cfg.node,
                        "accept failed: {e}; backing off until resources free up");
                    starved = true;
                }
                drop(ep);
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(ACCEPT_BACKOFF.1);
                continue;
            }
            Err(e) => {
                // The connection went away before it was accepted
                // (ECONNABORTED and the like): nothing to back off from.
                tracing::debug!(node = %ep.cfg.node, "accept failed: {e}");
                continue;
            }
        };
        if handshaking.load(Ordering::Acquire) >= ep.cfg.max_handshaking {
            turn_away(&stream, ep.cfg.max_handshaking);
            continue;
        }
        if let Some(cfg) = ep.cfg.tls.clone() {
            // The TLS handshake runs in its own task, under the same bound
            // and deadline as the weft handshake that follows it.
            handshaking.fetch_add(1, Ordering::AcqRel);
            let count = Arc::clone(&handshaking);
            let timeout = ep.cfg.handshake_timeout;
            let weak = Arc::downgrade(&ep);
            ep.spawn(async move {
                let started = tokio::time::Instant::now();
                let peer = stream
                    .peer_addr()
                    .map(|a| a.to_string())
                    .unwrap_or_else(|_| "?".into());
                match tokio::time::timeout(timeout, tls::accept(&cfg, stream)).await {
                    Ok(Ok(tls::Established {
                        stream,
                        conn,
                        preread,
                    })) => {
                        let attached = match weak.upgrade() {
                            Some(ep) if !(ep.is_crashed() || ep.is_closing()) => {
                                attach(&ep, stream, Side::Acceptor, None, Some((conn, preread)))
                            }
                            _ => Err(io::ErrorKind::NotConnected.into()),
                        };
                        match attached {
                            Ok(link) => {
                                let left = timeout.saturating_sub(started.elapsed());
                                link.handshake_deadline(left).await;
                            }
                            Err(e) => {
                                tracing::warn!("cannot set up an accepted connection: {e}")
                            }
                        }
                    }
                    Ok(Err(reason)) => refused(&weak, &peer, &reason),
                    Err(_) => refused(
                        &weak,
                        &peer,
                        &format!("no TLS handshake within {timeout:?}"),
                    ),
                }
                count.fetch_sub(1, Ordering::AcqRel);
            });
            continue;
        }
        match attach(&ep, stream, Side::Acceptor, None, None) {
            Ok(link) => {
                handshaking.fetch_add(1, Ordering::AcqRel);
                let count = Arc::clone(&handshaking);
                let timeout = ep.cfg.handshake_timeout;
                ep.spawn(async move {
                    link.handshake_deadline(timeout).await;
                    count.fetch_sub(1, Ordering::AcqRel);
                });
            }
            Err(e) => tracing::warn!("cannot set up an accepted connection: {e}"),
        }
    }
}

/// Logs a connection refused before it became a link (its TLS handshake
/// failed) and keeps it for [`crate::Endpoint::refusals`].
fn refused(ep: &Weak<Inner>, peer: &str, reason: &str) {
    tracing::warn!("refused a connection from {peer}: {reason}");
    if let Some(ep) = ep.upgrade() {
        ep.note_refusal(format!("Refused on tcp+tls from {peer}: {reason}"));
    }
}

/// True for the accept errors that mean this process or host is out of
/// something (descriptors, memory), as opposed to one connection failing.
fn is_resource_exhaustion(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM)
    )
}

/// Tells a connection over the handshaking bound why it is closed (best
/// effort, never waits) and drops it.
fn turn_away(stream: &TcpStream, max: usize) {
    let mut out = BytesMut::new();
    let refused = Frame::Refused(Refused {
        status: Status::Unavailable,
        reason: format!("{max} connections are already handshaking; try again later"),
    });
    if encode_frame(&refused, &mut out).is_ok() {
        let _ = stream.try_write(&out);
    }
    tracing::debug!("turned away a connection: {max} already handshaking");
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
    let (stream, tls) = match &ep.cfg.tls {
        None => (stream, None),
        Some(cfg) => {
            let connecting = tls::connect(cfg, stream, addr);
            match tokio::time::timeout(ep.cfg.connect_timeout, connecting).await {
                Ok(Ok(est)) => (est.stream, Some((est.conn, est.preread))),
                Ok(Err((status, reason))) => return Err(Failure::new(status, reason)),
                Err(_) => {
                    return Err(Failure::new(
                        Status::HostDead,
                        format!(
                            "TLS handshake with {addr} timed out after {:?}",
                            ep.cfg.connect_timeout
                        ),
                    ))
                }
            }
        }
    };
    let link = attach(ep, stream, Side::Initiator, expected, tls).map_err(|e| {
        Failure::new(
            Status::ProcDead,
            format!("cannot set up the connection to {addr}: {e}"),
        )
    })?;
    link.start();
    Ok(link)
}
