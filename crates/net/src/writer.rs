//! The peer's writer, shared by SMA's stream and the 2CA proxy: released
//! bytes go to the peer's socket in the order they were handed over.
//!
//! Owns the write half of the peer's socket, a writer task and its bounded
//! queue, and the fast path: when nothing is queued, bytes are written at
//! once in the caller's task, as far as the socket takes them without
//! waiting, so a commit's release usually costs no wake-up of another task;
//! what the socket does not take at once is queued behind. Must never let a
//! byte overtake one handed over before it.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use parking_lot::Mutex;
use tokio::io::AsyncWriteExt;
use tokio::net::tcp::OwnedWriteHalf;
use tokio::sync::{mpsc, oneshot};

enum Msg {
    Bytes(Bytes),
    Close(Option<oneshot::Sender<()>>),
}

struct Inner {
    wr: tokio::sync::Mutex<OwnedWriteHalf>,
    /// Chunks handed to the task and not yet written. Decremented with the
    /// socket locked, after the chunk was written.
    queued: AtomicUsize,
    /// Set when a write failed.
    error: Mutex<Option<String>>,
}

/// See the module comment.
pub(crate) struct PeerWriter {
    inner: Arc<Inner>,
    tx: mpsc::Sender<Msg>,
    order: tokio::sync::Mutex<()>,
    /// A close was handed over: nothing more is written.
    closed: std::sync::atomic::AtomicBool,
}

impl PeerWriter {
    /// Starts the writer task for `wr` with a queue of `queue` chunks;
    /// `ended` runs when the task ends (after a close, a failed write, or
    /// the last handle dropped), once the socket's sending side is shut.
    pub(crate) fn spawn(
        wr: OwnedWriteHalf,
        queue: usize,
        ended: impl FnOnce() + Send + 'static,
    ) -> PeerWriter {
        let inner = Arc::new(Inner {
            wr: tokio::sync::Mutex::new(wr),
            queued: AtomicUsize::new(0),
            error: Mutex::new(None),
        });
        let (tx, mut rx) = mpsc::channel::<Msg>(queue);
        let w = Arc::clone(&inner);
        tokio::spawn(async move {
            let mut done = None;
            while let Some(m) = rx.recv().await {
                match m {
                    Msg::Bytes(b) => {
                        let mut wr = w.wr.lock().await;
                        let res = wr.write_all(&b).await;
                        w.queued.fetch_sub(1, Ordering::SeqCst);
                        if let Err(e) = res {
                            *w.error.lock() = Some(e.to_string());
                            break;
                        }
                    }
                    Msg::Close(signal) => {
                        done = signal;
                        break;
                    }
                }
            }
            let _ = w.wr.lock().await.shutdown().await;
            if let Some(d) = done {
                let _ = d.send(());
            }
            ended();
        });
        PeerWriter {
            inner,
            tx,
            order: tokio::sync::Mutex::new(()),
            closed: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// Hands `b` over for the peer.
    ///
    /// Fails with the reason when the writer stopped (a write failed or the
    /// connection was closed).
    pub(crate) async fn send(&self, mut b: Bytes) -> Result<(), String> {
        if let Some(e) = self.error() {
            return Err(e);
        }
        // Hand-overs one at a time, so that they keep their order between
        // the fast path and the queue.
        let _order = self.order.lock().await;
        if self.closed.load(Ordering::SeqCst) {
            return Err("the connection was closed".to_string());
        }
        if self.inner.queued.load(Ordering::SeqCst) == 0 {
            if let Ok(wr) = self.inner.wr.try_lock() {
                // Nothing queued is left unwritten (the task counts a chunk
                // out only after writing it, with the socket locked).
                while !b.is_empty() {
                    match wr.try_write(&b) {
                        Ok(n) => {
                            let _ = b.split_to(n);
                        }
                        // Full (or failed: the task reports it on its write).
                        Err(_) => break,
                    }
                }
                if b.is_empty() {
                    return Ok(());
                }
            }
        }
        self.inner.queued.fetch_add(1, Ordering::SeqCst);
        if self.tx.send(Msg::Bytes(b)).await.is_err() {
            self.inner.queued.fetch_sub(1, Ordering::SeqCst);
            return Err(self
                .error()
                .unwrap_or_else(|| "the connection's writer stopped".to_string()));
        }
        Ok(())
    }

    /// Closes the sending side after what was handed over; waits for it
    /// when `wait`.
    pub(crate) async fn close(&self, wait: bool) {
        let (signal, done) = if wait {
            let (s, d) = oneshot::channel();
            (Some(s), Some(d))
        } else {
            (None, None)
        };
        let _order = self.order.lock().await;
        self.closed.store(true, Ordering::SeqCst);
        if self.tx.send(Msg::Close(signal)).await.is_ok() {
            if let Some(d) = done {
                let _ = d.await;
            }
        }
    }

    /// Why a write failed, if one did.
    pub(crate) fn error(&self) -> Option<String> {
        self.inner.error.lock().clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncReadExt;
    use tokio::net::{TcpListener, TcpStream};

    /// Chunks large enough to fill the socket (so that some go through the
    /// queue while later ones find it empty again) arrive whole and in order.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn bytes_arrive_in_the_order_handed_over_through_both_paths() {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let mut peer = TcpStream::connect(l.local_addr().unwrap()).await.unwrap();
        let (srv, _) = l.accept().await.unwrap();
        let (_rd, wr) = srv.into_split();
        let (ended_tx, ended) = oneshot::channel();
        let w = PeerWriter::spawn(wr, 4, move || {
            let _ = ended_tx.send(());
        });
        let mut want = Vec::new();
        let reader = tokio::spawn(async move {
            let mut got = Vec::new();
            peer.read_to_end(&mut got).await.unwrap();
            got
        });
        for i in 0u32..300 {
            // 1 byte to 400 KB: the large ones overflow the socket buffer.
            let len = 1 + (i as usize * 7919) % (400 * 1024);
            let chunk: Vec<u8> = (0..len).map(|j| (i as usize + j) as u8).collect();
            want.extend_from_slice(&chunk);
            w.send(Bytes::from(chunk)).await.unwrap();
        }
        w.close(true).await;
        assert!(w.send(Bytes::from_static(b"late")).await.is_err());
        ended.await.unwrap();
        let got = reader.await.unwrap();
        assert_eq!(got.len(), want.len());
        assert!(got == want, "bytes out of order");
    }
}
