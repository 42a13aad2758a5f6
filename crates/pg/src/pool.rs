//! A bounded pool of PostgreSQL connections.
//!
//! Owns opening connections (without TLS, each driven by its own task), keeping idle ones, the
//! bound on how many exist at once, and closing them all at once when the participant stops —
//! which aborts the connection tasks, so PostgreSQL sees the sockets close exactly as when a
//! process dies. Must never hand out a connection known to be closed, nor exceed its bound.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::task::AbortHandle;
use tokio_postgres::{Client, NoTls};

/// Why no connection could be had.
#[derive(Debug)]
pub(crate) enum PoolError {
    /// Every connection is in use and none came free within the wait.
    Exhausted { size: usize, waited: Duration },
    /// Opening a new connection failed.
    Connect(tokio_postgres::Error),
    /// The pool was closed.
    Closed,
}

/// A connection taken from a [`Pool`]: give it back with [`Pool::put`]; dropping it closes it.
pub(crate) struct Pooled {
    pub(crate) client: Client,
    _permit: OwnedSemaphorePermit,
}

pub(crate) struct Pool {
    what: &'static str,
    pg: tokio_postgres::Config,
    size: usize,
    permits: Arc<Semaphore>,
    idle: Mutex<Vec<Client>>,
    tasks: Mutex<Vec<AbortHandle>>,
    closed: AtomicBool,
}

impl Pool {
    pub(crate) fn new(what: &'static str, pg: tokio_postgres::Config, size: usize) -> Pool {
        assert!(size > 0, "a pool of no connections");
        Pool {
            what,
            pg,
            size,
            permits: Arc::new(Semaphore::new(size)),
            idle: Mutex::new(Vec::new()),
            tasks: Mutex::new(Vec::new()),
            closed: AtomicBool::new(false),
        }
    }

    /// Takes a connection, waiting at most `wait` for one to come free (forever when `None`),
    /// reusing an idle one or opening a new one.
    pub(crate) async fn get(&self, wait: Option<Duration>) -> Result<Pooled, PoolError> {
        if self.is_closed() {
            return Err(PoolError::Closed);
        }
        let acquire = Arc::clone(&self.permits).acquire_owned();
        let permit = match wait {
            None => acquire.await.map_err(|_| PoolError::Closed)?,
            Some(wait) => match tokio::time::timeout(wait, acquire).await {
                Ok(permit) => permit.map_err(|_| PoolError::Closed)?,
                Err(_) => {
                    return Err(PoolError::Exhausted {
                        size: self.size,
                        waited: wait,
                    })
                }
            },
        };
        loop {
            let Some(client) = self.idle.lock().pop() else {
                break;
            };
            if !client.is_closed() {
                return Ok(Pooled {
                    client,
                    _permit: permit,
                });
            }
        }
        let (client, connection) = self.pg.connect(NoTls).await.map_err(PoolError::Connect)?;
        let what = self.what;
        let task = tokio::spawn(async move {
            if let Err(error) = connection.await {
                tracing::debug!(pool = what, %error, "postgres connection ended with an error");
            }
        });
        {
            let mut tasks = self.tasks.lock();
            tasks.retain(|t| !t.is_finished());
            tasks.push(task.abort_handle());
        }
        if self.is_closed() {
            // Closed while we connected: this connection must not outlive the close.
            task.abort();
            return Err(PoolError::Closed);
        }
        Ok(Pooled {
            client,
            _permit: permit,
        })
    }

    /// Gives a connection back; it is kept for reuse unless it is closed or the pool is.
    pub(crate) fn put(&self, conn: Pooled) {
        if !self.is_closed() && !conn.client.is_closed() {
            self.idle.lock().push(conn.client);
        }
    }

    /// Closes the pool: no more connections are handed out and every connection it opened is
    /// cut at once, whoever holds it.
    pub(crate) fn close(&self) {
        self.closed.store(true, Ordering::Release);
        self.permits.close();
        self.idle.lock().clear();
        for task in self.tasks.lock().drain(..) {
            task.abort();
        }
    }

    pub(crate) fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }
}
