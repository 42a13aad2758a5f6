//! A temporary PostgreSQL server for tests and benchmarks.
//!
//! Owns: finding the PostgreSQL binaries, a temporary directory holding a fresh cluster
//! (`initdb`) or a streaming standby of another temporary server (`pg_basebackup`), the
//! server's settings, and the postmaster's life — start, fast stop, `kill -9` crash, restart
//! from the same data directory — plus running PostgreSQL's own programs (`pgbench`, `psql`)
//! against it as the right OS user.
//!
//! Must never: touch a cluster or data directory it did not create, signal a process it did not
//! spawn, run a PostgreSQL program as root, or leave a server running once its
//! [`TempPostgres`] is gone — drop stops it, and if the whole harness process dies the kernel
//! kills the postmaster (parent-death signal) and its backends follow.
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use weft_pg::{client, ServerOptions, TempPostgres};
//! let server = TempPostgres::start(ServerOptions::default().fsync(false))?;
//! let db = client::connect(&server, "postgres").await?;
//! db.batch_execute("CREATE TABLE t (id int PRIMARY KEY)").await?;
//! # Ok(()) }
//! ```

mod install;
mod postmaster;

use std::fmt::Write as _;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Read as _, Seek as _, SeekFrom};
use std::net::{Ipv4Addr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

pub use install::{BIN_ENV, DEFAULT_BIN_DIR, SUPERUSER};

use install::RunAs;
use postmaster::{Exit, Postmaster};

/// The address the server listens on for TCP connections.
pub const HOST: &str = "127.0.0.1";

/// How many freshly picked ports [`TempPostgres::start`] tries when another process takes the
/// port between our probe and the server's bind.
pub const MAX_PORT_ATTEMPTS: usize = 8;

/// How many lines of the server log a startup error carries.
pub const LOG_TAIL_LINES: usize = 40;

/// PostgreSQL's upper bound for `max_connections` and `max_prepared_transactions`.
const MAX_BACKENDS: u32 = 262_143;

/// Longest identifier PostgreSQL keeps (NAMEDATALEN - 1).
const MAX_IDENTIFIER_BYTES: usize = 63;

/// Failure of a [`TempPostgres`] operation.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ServerError {
    /// No usable PostgreSQL installation was found.
    #[error("PostgreSQL not found: install postgresql-15 or set WEFT_PG_BIN ({detail})")]
    NotFound {
        /// Where we looked, or what was wrong with the directory we were told to use.
        detail: String,
    },
    /// The harness runs as root and there is no `postgres` OS user to run the server as.
    #[error(
        "running as root, but there is no `postgres` OS user to run PostgreSQL as \
         (PostgreSQL refuses to run as root); install postgresql-15 or create the user"
    )]
    NoServerUser,
    /// A [`ServerOptions`] value or a name passed in is out of range.
    #[error("invalid option: {0}")]
    InvalidOption(String),
    /// A file-system or process operation failed.
    #[error("{context}: {source}")]
    Io {
        /// What we were doing.
        context: String,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// `initdb` exited unsuccessfully.
    #[error("initdb failed ({status}):\n{output}")]
    Initdb {
        /// initdb's exit status.
        status: ExitStatus,
        /// initdb's stdout and stderr.
        output: String,
    },
    /// `pg_basebackup` of a primary, for a standby, exited unsuccessfully.
    #[error("pg_basebackup failed ({status}):\n{output}")]
    Basebackup {
        /// pg_basebackup's exit status.
        status: ExitStatus,
        /// pg_basebackup's stdout and stderr.
        output: String,
    },
    /// The server did not come up; the log tail usually says why.
    #[error("PostgreSQL failed to start: {reason}\n--- last lines of {} ---\n{log_tail}", .log.display())]
    Start {
        /// What went wrong, as seen by the harness.
        reason: String,
        /// The server log file.
        log: PathBuf,
        /// The last [`LOG_TAIL_LINES`] lines the server wrote during this attempt.
        log_tail: String,
    },
    /// A fast shutdown did not finish in time; the server was killed instead.
    #[error("PostgreSQL did not shut down within {waited:?}, so it was killed")]
    StopTimeout {
        /// How long we waited for the fast shutdown.
        waited: Duration,
    },
    /// The operation needs a running server.
    #[error("the PostgreSQL server is not running")]
    NotRunning,
    /// A SQL command issued by the harness failed.
    #[error("SQL error: {}", crate::client::describe_error(.0))]
    Sql(#[from] tokio_postgres::Error),
}

/// Settings for a [`TempPostgres`]; start from [`ServerOptions::default`] and chain setters.
///
/// The default is what benchmarks need: `fsync` on, `synchronous_commit` on, 128 prepared
/// transactions, 200 connections, 128 MB of shared buffers. Tests may turn `fsync` off for speed.
#[derive(Debug, Clone)]
pub struct ServerOptions {
    bin_dir: Option<PathBuf>,
    fsync: bool,
    max_prepared_transactions: u32,
    max_connections: u32,
    shared_buffers_mb: u32,
    start_timeout: Duration,
    stop_timeout: Duration,
    settings: Vec<(String, String)>,
}

impl Default for ServerOptions {
    fn default() -> Self {
        ServerOptions {
            bin_dir: None,
            fsync: true,
            max_prepared_transactions: 128,
            max_connections: 200,
            shared_buffers_mb: 128,
            start_timeout: Duration::from_secs(60),
            stop_timeout: Duration::from_secs(30),
            settings: Vec::new(),
        }
    }
}

impl ServerOptions {
    /// Uses the PostgreSQL binaries in `dir`, skipping the search (and `$WEFT_PG_BIN`).
    pub fn bin_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.bin_dir = Some(dir.into());
        self
    }

    /// Turns `fsync` on (default; required for meaningful benchmark numbers) or off.
    pub fn fsync(mut self, on: bool) -> Self {
        self.fsync = on;
        self
    }

    /// Sets `max_prepared_transactions` (default 128; 0 disables `PREPARE TRANSACTION`).
    pub fn max_prepared_transactions(mut self, n: u32) -> Self {
        self.max_prepared_transactions = n;
        self
    }

    /// Sets `max_connections` (default 200).
    pub fn max_connections(mut self, n: u32) -> Self {
        self.max_connections = n;
        self
    }

    /// Sets `shared_buffers` in megabytes (default 128).
    pub fn shared_buffers_mb(mut self, mb: u32) -> Self {
        self.shared_buffers_mb = mb;
        self
    }

    /// How long a start or restart may take before it fails (default 60 s; crash recovery of a
    /// large WAL can be slow).
    pub fn start_timeout(mut self, timeout: Duration) -> Self {
        self.start_timeout = timeout;
        self
    }

    /// How long a fast shutdown may take before the server is killed (default 30 s).
    pub fn stop_timeout(mut self, timeout: Duration) -> Self {
        self.stop_timeout = timeout;
        self
    }

    /// Adds any other `postgresql.conf` setting; the value is quoted for you. Later settings
    /// override earlier ones and the typed setters.
    pub fn setting(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.settings.push((name.into(), value.into()));
        self
    }

    /// Whether `fsync` will be on.
    pub fn fsync_enabled(&self) -> bool {
        self.fsync
    }

    /// The configured `max_prepared_transactions`.
    pub fn prepared_transactions(&self) -> u32 {
        self.max_prepared_transactions
    }

    /// The configured `max_connections`.
    pub fn connections(&self) -> u32 {
        self.max_connections
    }

    fn validate(&self) -> Result<(), ServerError> {
        let invalid = |msg: String| Err(ServerError::InvalidOption(msg));
        if !(1..=MAX_BACKENDS).contains(&self.max_connections) {
            return invalid(format!(
                "max_connections {} not in 1..={MAX_BACKENDS}",
                self.max_connections
            ));
        }
        if self.max_prepared_transactions > MAX_BACKENDS {
            return invalid(format!(
                "max_prepared_transactions {} exceeds {MAX_BACKENDS}",
                self.max_prepared_transactions
            ));
        }
        if !(1..=1 << 20).contains(&self.shared_buffers_mb) {
            return invalid(format!(
                "shared_buffers_mb {} not in 1..=1048576",
                self.shared_buffers_mb
            ));
        }
        if self.start_timeout.is_zero() || self.stop_timeout.is_zero() {
            return invalid("start and stop timeouts must be positive".into());
        }
        for (name, value) in &self.settings {
            let ok_name = !name.is_empty()
                && name
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'.');
            if !ok_name {
                return invalid(format!("setting name {name:?}"));
            }
            if value.contains(['\n', '\r', '\0']) {
                return invalid(format!(
                    "setting {name} has a line break or NUL in its value"
                ));
            }
        }
        Ok(())
    }

    /// The `weft.conf` the data directory's `postgresql.conf` includes.
    fn render(&self, port: u16, socket_dir: &Path) -> String {
        let on_off = |b: bool| if b { "on" } else { "off" };
        let mut conf = String::from(
            "# Written by weft-pg for a throwaway server; rewritten on every start.\n",
        );
        let mut set = |name: &str, value: &str| {
            let _ = writeln!(conf, "{name} = '{}'", value.replace('\'', "''"));
        };
        set("listen_addresses", HOST);
        set("port", &port.to_string());
        set("unix_socket_directories", &socket_dir.to_string_lossy());
        set("max_connections", &self.max_connections.to_string());
        set(
            "max_prepared_transactions",
            &self.max_prepared_transactions.to_string(),
        );
        set("fsync", on_off(self.fsync));
        set("synchronous_commit", "on");
        set("full_page_writes", "on");
        set("shared_buffers", &format!("{}MB", self.shared_buffers_mb));
        set("logging_collector", "off");
        set("log_destination", "stderr");
        set("log_line_prefix", "%m [%p] ");
        for (name, value) in &self.settings {
            set(name, value);
        }
        conf
    }
}

/// A PostgreSQL server running from a temporary directory, stopped and deleted on drop.
///
/// Connect over TCP to [`TempPostgres::host`]:[`TempPostgres::port`] (or the Unix socket in
/// [`TempPostgres::socket_dir`]) as user [`SUPERUSER`]; every local connection is trusted.
#[must_use = "dropping a TempPostgres stops the server and deletes its data"]
#[derive(Debug)]
pub struct TempPostgres {
    /// Last field but one dropped: holds `data/`, `server.log` and the sockets.
    root: tempfile::TempDir,
    data_dir: PathBuf,
    log_path: PathBuf,
    bin_dir: PathBuf,
    run_as: Option<RunAs>,
    port: u16,
    options: ServerOptions,
    postmaster: Option<Postmaster>,
    /// The last run ended by a kill, which leaves a (tiny) System V shared memory segment that
    /// only the next start of this data directory would remove.
    killed: bool,
}

impl TempPostgres {
    /// Creates a fresh cluster in a new temporary directory and starts a server on it.
    ///
    /// Picks a free TCP port on 127.0.0.1 (retrying up to [`MAX_PORT_ATTEMPTS`] times if another
    /// process takes it first) and waits until the server accepts connections.
    ///
    /// # Errors
    /// [`ServerError::NotFound`] if no PostgreSQL installation is found,
    /// [`ServerError::NoServerUser`] when running as root without a `postgres` user,
    /// [`ServerError::InvalidOption`], [`ServerError::Initdb`], [`ServerError::Io`], or
    /// [`ServerError::Start`] with the tail of the server log.
    pub fn start(options: ServerOptions) -> Result<TempPostgres, ServerError> {
        options.validate()?;
        let bin_dir = install::find_bin_dir(options.bin_dir.as_deref())?;
        let run_as = install::server_user()?;
        let mut server = TempPostgres::create_root(bin_dir, run_as, options)?;
        server.initdb()?;
        server.launch(None)?;
        Ok(server)
    }

    /// Starts a streaming-replication standby of `primary` in a new temporary directory: a
    /// `pg_basebackup` of the running primary (WAL streamed during the copy), then a server
    /// in standby mode that connects back to it as `application_name`, the name the primary's
    /// `synchronous_standby_names` refers to. The standby's own settings are `options` (its
    /// `fsync` as given) plus `primary_conninfo`; the primary needs nothing beyond the
    /// defaults (`wal_level = replica`, trusted local replication connections).
    ///
    /// # Errors
    /// [`ServerError::InvalidOption`] for an `application_name` that is empty, longer than 63
    /// bytes or not made of ASCII letters, digits and `_`; [`ServerError::NotRunning`] if the
    /// primary is down; [`ServerError::Basebackup`] (with its output) if the copy fails;
    /// otherwise as [`TempPostgres::start`].
    pub fn start_standby(
        primary: &TempPostgres,
        application_name: &str,
        options: ServerOptions,
    ) -> Result<TempPostgres, ServerError> {
        check_standby_name(application_name)?;
        if !primary.is_running() {
            return Err(ServerError::NotRunning);
        }
        let conninfo = format!(
            "host={HOST} port={} user={SUPERUSER} application_name={application_name}",
            primary.port
        );
        let options = options.setting("primary_conninfo", conninfo);
        options.validate()?;
        let mut server =
            TempPostgres::create_root(primary.bin_dir.clone(), primary.run_as, options)?;
        let mut cmd = server.command("pg_basebackup");
        cmd.args(["-h", HOST, "-p", &primary.port.to_string(), "-U", SUPERUSER])
            .arg("-D")
            .arg(&server.data_dir)
            .args(["-X", "stream", "--checkpoint=fast", "--no-sync"]);
        server.run_to_success(cmd, "pg_basebackup", |status, output| {
            ServerError::Basebackup { status, output }
        })?;
        let signal = server.data_dir.join("standby.signal");
        File::create(&signal).map_err(io_err(format!("creating {}", signal.display())))?;
        if let Some(user) = server.run_as {
            std::os::unix::fs::chown(&signal, Some(user.uid), Some(user.gid))
                .map_err(io_err(format!("handing {} to postgres", signal.display())))?;
        }
        server.launch(None)?;
        Ok(server)
    }

    /// Makes every commit on this (primary) server wait for all of `standbys` (application
    /// names of [`TempPostgres::start_standby`] standbys): sets `synchronous_standby_names` to
    /// `FIRST n (...)` with `n` the number of standbys, reloads, and returns once the primary
    /// reports each of them as a synchronous standby. An empty list turns synchronous
    /// replication off.
    ///
    /// # Errors
    /// [`ServerError::InvalidOption`] for a name that [`TempPostgres::start_standby`] would
    /// refuse, [`ServerError::Sql`] if the settings cannot be changed, and
    /// [`ServerError::Start`] (with this server's log tail) if the standbys are not all
    /// synchronous within the start timeout.
    pub async fn make_standbys_synchronous(&self, standbys: &[&str]) -> Result<(), ServerError> {
        for name in standbys {
            check_standby_name(name)?;
        }
        let names = if standbys.is_empty() {
            String::new()
        } else {
            format!("FIRST {} ({})", standbys.len(), standbys.join(", "))
        };
        let client = crate::client::connect(self, "postgres").await?;
        client
            .batch_execute(&format!(
                "ALTER SYSTEM SET synchronous_standby_names = '{names}'"
            ))
            .await?;
        client.batch_execute("SELECT pg_reload_conf()").await?;
        let deadline = Instant::now() + self.options.start_timeout;
        loop {
            let rows = client
                .query(
                    "SELECT application_name FROM pg_stat_replication WHERE sync_state = 'sync'",
                    &[],
                )
                .await?;
            let synchronous: Vec<String> = rows.iter().map(|r| r.get(0)).collect();
            if standbys.iter().all(|s| synchronous.iter().any(|n| n == s)) {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(ServerError::Start {
                    reason: format!(
                        "standbys {standbys:?} not all synchronous after {:?} (synchronous: {synchronous:?})",
                        self.options.start_timeout
                    ),
                    log: self.log_path.clone(),
                    log_tail: self.log_tail(LOG_TAIL_LINES),
                });
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// A server handle over a new, empty temporary directory (with its log file, both owned by
    /// the server's OS user); nothing is started.
    fn create_root(
        bin_dir: PathBuf,
        run_as: Option<RunAs>,
        options: ServerOptions,
    ) -> Result<TempPostgres, ServerError> {
        let root = tempfile::Builder::new()
            .prefix("weft-pg-")
            .tempdir()
            .map_err(io_err("creating the temporary directory"))?;
        let data_dir = root.path().join("data");
        let log_path = root.path().join("server.log");
        File::create(&log_path).map_err(io_err("creating the server log"))?;
        if let Some(user) = run_as {
            for path in [root.path(), log_path.as_path()] {
                std::os::unix::fs::chown(path, Some(user.uid), Some(user.gid))
                    .map_err(io_err(format!("handing {} to postgres", path.display())))?;
            }
        }
        Ok(TempPostgres {
            root,
            data_dir,
            log_path,
            bin_dir,
            run_as,
            port: 0,
            options,
            postmaster: None,
            killed: false,
        })
    }

    /// The TCP port the server listens on (it may change across [`TempPostgres::restart`] only
    /// if another process took the old port meanwhile).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The address the server listens on: always `127.0.0.1`.
    pub fn host(&self) -> &str {
        HOST
    }

    /// The database superuser every connection should use: [`SUPERUSER`].
    pub fn user(&self) -> &str {
        SUPERUSER
    }

    /// The directory holding the server's Unix socket (`.s.PGSQL.<port>`).
    pub fn socket_dir(&self) -> &Path {
        self.root.path()
    }

    /// The cluster's data directory (inside the temporary directory).
    pub fn data_dir(&self) -> &Path {
        &self.data_dir
    }

    /// The directory of the PostgreSQL binaries in use.
    pub fn bin_dir(&self) -> &Path {
        &self.bin_dir
    }

    /// The server log file.
    pub fn log_path(&self) -> &Path {
        &self.log_path
    }

    /// The options the server was started with.
    pub fn options(&self) -> &ServerOptions {
        &self.options
    }

    /// The postmaster's pid while the server runs, `None` after stop or crash.
    pub fn pid(&self) -> Option<u32> {
        self.postmaster
            .as_ref()
            .filter(|pm| matches!(pm.exit(), Exit::Running))
            .map(Postmaster::pid)
    }

    /// Whether the postmaster is running.
    pub fn is_running(&self) -> bool {
        self.pid().is_some()
    }

    /// A libpq-style connection string for database `dbname` over TCP, e.g.
    /// `host=127.0.0.1 port=54321 user=postgres dbname='bank'`.
    pub fn connection_string(&self, dbname: &str) -> String {
        let quoted = dbname.replace('\\', "\\\\").replace('\'', "\\'");
        format!(
            "host={HOST} port={} user={SUPERUSER} dbname='{quoted}'",
            self.port
        )
    }

    /// A tokio-postgres configuration for database `dbname` over TCP, with a 10 s connect
    /// timeout. [`crate::client::connect`] uses it.
    pub fn client_config(&self, dbname: &str) -> tokio_postgres::Config {
        let mut config = tokio_postgres::Config::new();
        config
            .host(HOST)
            .port(self.port)
            .user(SUPERUSER)
            .dbname(dbname)
            .application_name("weft-pg")
            .connect_timeout(Duration::from_secs(10));
        config
    }

    /// Creates database `name` (owned by the superuser).
    ///
    /// # Errors
    /// [`ServerError::InvalidOption`] for an empty name, one longer than 63 bytes or containing
    /// NUL; [`ServerError::Sql`] if connecting fails or the database already exists.
    pub async fn create_database(&self, name: &str) -> Result<(), ServerError> {
        if name.is_empty() || name.len() > MAX_IDENTIFIER_BYTES || name.contains('\0') {
            return Err(ServerError::InvalidOption(format!(
                "database name {name:?} must be 1..={MAX_IDENTIFIER_BYTES} bytes without NUL"
            )));
        }
        let client = crate::client::connect(self, "postgres").await?;
        let ident = format!("\"{}\"", name.replace('"', "\"\""));
        client
            .batch_execute(&format!("CREATE DATABASE {ident}"))
            .await?;
        Ok(())
    }

    /// A [`Command`] for PostgreSQL program `program` (e.g. `"pgbench"`, `"psql"`) from
    /// [`TempPostgres::bin_dir`], set up to run as the `postgres` OS user when the harness is
    /// root, in the temporary directory, with `LC_ALL=C` and no inherited `PG*` variables.
    /// Connection arguments are the caller's: `-h`, `-p`, `-U` from this handle.
    pub fn command(&self, program: &str) -> Command {
        install::program_command(&self.bin_dir, program, self.run_as, self.root.path())
    }

    /// The last `lines` lines of the server log (empty if it cannot be read).
    pub fn log_tail(&self, lines: usize) -> String {
        read_log_tail(&self.log_path, 0, lines)
    }

    /// Stops the server with a fast shutdown (what `pg_ctl stop -m fast` does: SIGINT, which
    /// rolls back open transactions, keeps prepared ones, and checkpoints). Does nothing if the
    /// server is not running.
    ///
    /// # Errors
    /// [`ServerError::StopTimeout`] if the shutdown takes longer than the stop timeout; the
    /// server has then been killed, so it is stopped either way.
    pub fn stop(&mut self) -> Result<(), ServerError> {
        let Some(pm) = self.postmaster.take() else {
            return Ok(());
        };
        pm.signal(libc::SIGINT);
        let waited = self.options.stop_timeout;
        if let Exit::Exited(_) = pm.wait_exit(waited) {
            return Ok(());
        }
        kill_all(&pm);
        self.killed = true;
        Err(ServerError::StopTimeout { waited })
    }

    /// Crashes the server: `kill -9` of the postmaster and of every backend and auxiliary process
    /// it forked (the postmaster is stopped first so none escapes), as a power cut would. Returns
    /// once all of them are gone, so that [`TempPostgres::restart`] runs crash recovery on the
    /// same data directory.
    ///
    /// # Errors
    /// [`ServerError::NotRunning`] if the server was not running.
    pub fn crash(&mut self) -> Result<(), ServerError> {
        let pm = self.postmaster.take().ok_or(ServerError::NotRunning)?;
        kill_all(&pm);
        self.killed = true;
        Ok(())
    }

    /// Starts the server again from the same data directory (after [`TempPostgres::stop`] or
    /// [`TempPostgres::crash`]; a running server is stopped first). Tries the same port first.
    ///
    /// # Errors
    /// As for [`TempPostgres::stop`] and [`TempPostgres::start`].
    pub fn restart(&mut self) -> Result<(), ServerError> {
        self.stop()?;
        self.launch(Some(self.port))
    }

    /// Runs `cmd` (PostgreSQL's `program`) to its end; a failure to start it is
    /// [`ServerError::Io`], an unsuccessful exit `failed(status, stdout + stderr)`.
    fn run_to_success(
        &self,
        mut cmd: Command,
        program: &str,
        failed: impl FnOnce(ExitStatus, String) -> ServerError,
    ) -> Result<(), ServerError> {
        let out = cmd.output().map_err(io_err(format!(
            "running {}",
            self.bin_dir.join(program).display()
        )))?;
        if out.status.success() {
            return Ok(());
        }
        let mut output = String::from_utf8_lossy(&out.stdout).into_owned();
        output.push_str(&String::from_utf8_lossy(&out.stderr));
        Err(failed(out.status, output))
    }

    fn initdb(&self) -> Result<(), ServerError> {
        let mut cmd = self.command("initdb");
        cmd.arg("-D")
            .arg(&self.data_dir)
            .args(["-U", SUPERUSER, "--auth=trust", "--encoding=UTF8"])
            .args(["--locale=C", "--no-sync"]);
        self.run_to_success(cmd, "initdb", |status, output| ServerError::Initdb {
            status,
            output,
        })?;
        let conf = self.data_dir.join("postgresql.conf");
        let mut file = OpenOptions::new()
            .append(true)
            .open(&conf)
            .map_err(io_err(format!("opening {}", conf.display())))?;
        io::Write::write_all(&mut file, b"\n# weft-pg\ninclude 'weft.conf'\n")
            .map_err(io_err(format!("writing {}", conf.display())))?;
        Ok(())
    }

    /// Writes `weft.conf` and starts the postmaster, on `first_port` if given and then on fresh
    /// free ports while the failure is a port collision.
    fn launch(&mut self, first_port: Option<u16>) -> Result<(), ServerError> {
        debug_assert!(self.postmaster.is_none(), "launch over a live postmaster");
        let mut last_error = None;
        for attempt in 0..MAX_PORT_ATTEMPTS {
            let port = match (attempt, first_port) {
                (0, Some(port)) => port,
                _ => free_port()?,
            };
            self.write_settings(port)?;
            match self.spawn_and_wait_ready() {
                Ok(pm) => {
                    self.port = port;
                    self.postmaster = Some(pm);
                    // A successful start removes the shared memory a kill left behind.
                    self.killed = false;
                    tracing::debug!(port, data_dir = %self.data_dir.display(), "postgres ready");
                    return Ok(());
                }
                Err(Failure::PortInUse(error)) => {
                    tracing::debug!(port, "postgres port taken, retrying on another");
                    last_error = Some(error);
                }
                Err(Failure::Fatal(error)) => return Err(error),
            }
        }
        Err(last_error.unwrap_or(ServerError::NotRunning))
    }

    fn write_settings(&self, port: u16) -> Result<(), ServerError> {
        let path = self.data_dir.join("weft.conf");
        fs::write(&path, self.options.render(port, self.root.path()))
            .map_err(io_err(format!("writing {}", path.display())))?;
        if let Some(user) = self.run_as {
            std::os::unix::fs::chown(&path, Some(user.uid), Some(user.gid))
                .map_err(io_err(format!("handing {} to postgres", path.display())))?;
        }
        Ok(())
    }

    fn spawn_and_wait_ready(&mut self) -> Result<Postmaster, Failure> {
        let log_start = fs::metadata(&self.log_path).map(|m| m.len()).unwrap_or(0);
        let log_file = OpenOptions::new()
            .append(true)
            .open(&self.log_path)
            .map_err(io_err("opening the server log"))?;
        let log_file2 = log_file
            .try_clone()
            .map_err(io_err("opening the server log"))?;
        let mut cmd = self.command("postgres");
        cmd.arg("-D")
            .arg(&self.data_dir)
            .stdout(Stdio::from(log_file))
            .stderr(Stdio::from(log_file2));
        let pm = Postmaster::spawn(cmd).map_err(io_err(format!(
            "spawning {}",
            self.bin_dir.join("postgres").display()
        )))?;

        let fail = |reason: String| {
            let log_tail = read_log_tail(&self.log_path, log_start, LOG_TAIL_LINES);
            let port_in_use = log_tail.contains("could not bind")
                || log_tail.contains("could not create any TCP/IP sockets");
            let error = ServerError::Start {
                reason,
                log: self.log_path.clone(),
                log_tail,
            };
            if port_in_use {
                Failure::PortInUse(error)
            } else {
                Failure::Fatal(error)
            }
        };

        let timeout = self.options.start_timeout;
        let deadline = Instant::now() + timeout;
        loop {
            if let Exit::Exited(status) = pm.wait_exit(Duration::from_millis(10)) {
                let status = status.map_or_else(|| "unknown status".into(), |s| s.to_string());
                return Err(fail(format!("postgres exited during startup ({status})")));
            }
            if postmaster_ready(&self.data_dir, pm.pid()) {
                return Ok(pm);
            }
            if Instant::now() >= deadline {
                kill_all(&pm);
                self.killed = true;
                return Err(fail(format!("not ready after {timeout:?}; killed it")));
            }
        }
    }
}

impl Drop for TempPostgres {
    fn drop(&mut self) {
        if let Err(error) = self.stop() {
            tracing::warn!(%error, "stopping temporary postgres");
        }
        if self.killed {
            remove_orphaned_shared_memory(&self.data_dir);
        }
        // `root` (the TempDir) is dropped after this, deleting the cluster.
    }
}

/// Why one start attempt failed.
enum Failure {
    /// Another process holds the port: try another.
    PortInUse(ServerError),
    /// Anything else: give up.
    Fatal(ServerError),
}

impl From<ServerError> for Failure {
    fn from(error: ServerError) -> Self {
        Failure::Fatal(error)
    }
}

/// A standby's `application_name` must be a plain identifier: it is written unquoted into
/// `primary_conninfo` and `synchronous_standby_names`.
fn check_standby_name(name: &str) -> Result<(), ServerError> {
    let ok = !name.is_empty()
        && name.len() <= MAX_IDENTIFIER_BYTES
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_');
    if ok {
        Ok(())
    } else {
        Err(ServerError::InvalidOption(format!(
            "standby name {name:?} must be 1..={MAX_IDENTIFIER_BYTES} ASCII letters, digits or _"
        )))
    }
}

/// Kills the postmaster and every process it forked, then waits until they are all gone, so
/// that nothing is attached to the server's shared memory any more.
fn kill_all(pm: &Postmaster) {
    let children = pm.kill_tree();
    if let Exit::Running = pm.wait_exit(Duration::from_secs(10)) {
        tracing::warn!(pid = pm.pid(), "postmaster survived SIGKILL for 10 s");
    }
    if !postmaster::wait_gone(&children, Duration::from_secs(10)) {
        tracing::warn!(
            pid = pm.pid(),
            "postgres backends survived SIGKILL for 10 s"
        );
    }
}

/// Whether `postmaster.pid` in `data_dir` names `pid` and says `ready` (line 8), which the
/// postmaster writes once it accepts connections, or `standby`, which a standby writes once
/// it accepts read-only ones — the same check `pg_ctl start -w` makes.
fn postmaster_ready(data_dir: &Path, pid: u32) -> bool {
    let Ok(text) = fs::read_to_string(data_dir.join("postmaster.pid")) else {
        return false;
    };
    let lines: Vec<&str> = text.lines().collect();
    lines.first().and_then(|l| l.trim().parse::<u32>().ok()) == Some(pid)
        && matches!(lines.get(7).map(|l| l.trim()), Some("ready" | "standby"))
}

/// After a kill, PostgreSQL leaves its small System V segment (key and id on line 7 of
/// `postmaster.pid`) for the next start to reclaim. When there will be no next start, remove it
/// — only if it still carries the same key and nobody is attached.
pub(crate) fn remove_orphaned_shared_memory(data_dir: &Path) {
    let Ok(text) = fs::read_to_string(data_dir.join("postmaster.pid")) else {
        return;
    };
    let Some(line) = text.lines().nth(6) else {
        return;
    };
    let mut fields = line.split_whitespace().map(str::parse::<i64>);
    let (Some(Ok(key)), Some(Ok(shmid))) = (fields.next(), fields.next()) else {
        return;
    };
    let Ok(shmid) = libc::c_int::try_from(shmid) else {
        return;
    };
    // SAFETY: `shmid_ds` is plain old data; all-zero is a valid value.
    let mut ds: libc::shmid_ds = unsafe { std::mem::zeroed() };
    // SAFETY: `ds` is a valid out-pointer for IPC_STAT.
    if unsafe { libc::shmctl(shmid, libc::IPC_STAT, &mut ds) } != 0 {
        return;
    }
    if i64::from(ds.shm_perm.__key) == key && ds.shm_nattch == 0 {
        // SAFETY: IPC_RMID takes no buffer; the segment is the orphan of our own server.
        unsafe { libc::shmctl(shmid, libc::IPC_RMID, std::ptr::null_mut()) };
    }
}

/// A TCP port on 127.0.0.1 that was free a moment ago (bind port 0, read it, release it).
fn free_port() -> Result<u16, ServerError> {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .map_err(io_err("binding 127.0.0.1:0 to find a free port"))?;
    let port = listener
        .local_addr()
        .map_err(io_err("reading a probe socket's address"))?
        .port();
    Ok(port)
}

/// The last `lines` lines of the log written after byte `from`.
fn read_log_tail(path: &Path, from: u64, lines: usize) -> String {
    let mut text = String::new();
    if let Ok(mut file) = File::open(path) {
        if file.seek(SeekFrom::Start(from)).is_ok() {
            let mut bytes = Vec::new();
            let _ = file.read_to_end(&mut bytes);
            text = String::from_utf8_lossy(&bytes).into_owned();
        }
    }
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

fn io_err(context: impl Into<String>) -> impl FnOnce(io::Error) -> ServerError {
    let context = context.into();
    move |source| ServerError::Io { context, source }
}
