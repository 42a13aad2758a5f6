//! Helpers for tests that run real `weft` processes.

#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// The `weft` binary under test.
pub fn weft() -> Command {
    Command::new(env!("CARGO_BIN_EXE_weft"))
}

/// A running `weft node` process, killed when dropped.
pub struct NodeProc {
    pub child: Child,
    pub id: u32,
    pub addr: String,
    /// Lines the node printed on stdout after the ready line.
    pub lines: mpsc::Receiver<String>,
}

impl NodeProc {
    /// Starts `weft node --id ID --listen 127.0.0.1:0 [extra...]` and waits for
    /// its ready line.
    pub fn start(id: u32, extra: &[&str]) -> NodeProc {
        NodeProc::start_at(id, "127.0.0.1:0", extra)
    }

    /// Starts `weft node --id ID --listen LISTEN [extra...]` and waits for its
    /// ready line.
    pub fn start_at(id: u32, listen: &str, extra: &[&str]) -> NodeProc {
        let mut child = weft()
            .args(["node", "--id", &id.to_string(), "--listen", listen])
            .args(["--heartbeat", "50ms", "--dead-after", "500ms"])
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("weft node starts");
        let stdout = child.stdout.take().expect("piped stdout");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                match line {
                    Ok(l) => {
                        if tx.send(l).is_err() {
                            return;
                        }
                    }
                    Err(_) => return,
                }
            }
        });
        let ready = rx
            .recv_timeout(Duration::from_secs(20))
            .expect("node prints its ready line");
        let addr = ready
            .split(" listening on ")
            .nth(1)
            .and_then(|rest| rest.split_whitespace().next())
            .unwrap_or_else(|| panic!("unexpected ready line: {ready}"))
            .to_string();
        NodeProc {
            child,
            id,
            addr,
            lines: rx,
        }
    }

    /// Kills the process with SIGKILL and reaps it.
    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Sends SIGTERM and waits for a clean exit.
    pub fn terminate(&mut self) -> std::process::ExitStatus {
        // SIGTERM through the kill(1) utility keeps the test free of unsafe.
        let _ = Command::new("kill")
            .arg("-TERM")
            .arg(self.child.id().to_string())
            .status();
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(status) = self.child.try_wait().expect("wait") {
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "node {} did not exit on SIGTERM",
                self.id
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Waits for a stdout line containing `needle`.
    pub fn wait_line(&self, needle: &str, limit: Duration) -> String {
        let deadline = Instant::now() + limit;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(l) if l.contains(needle) => return l,
                Ok(_) => continue,
                Err(_) => panic!("node {} never printed {needle:?}", self.id),
            }
        }
    }
}

impl Drop for NodeProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs `weft ARGS` and returns (exit code, stdout, stderr).
pub fn run(args: &[&str], env: &[(&str, &str)]) -> (i32, String, String) {
    let mut cmd = weft();
    cmd.args(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("weft runs");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Polls `f` until it returns `Some`, or panics after `limit`.
pub fn eventually<T>(what: &str, limit: Duration, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Waits until transaction `tid` is no longer live at `node` (`weft tx
/// list`): its phase two ended, every node it had to tell acknowledged
/// the decision. The minute is a hang guard, not a speed bound.
pub fn wait_forgotten(node: &str, tid: &str, env: &[(&str, &str)]) {
    eventually(
        &format!("{tid} to be forgotten at {node}"),
        Duration::from_secs(60),
        || {
            let (code, out, err) = run(&["tx", "list", "--node", node], env);
            assert_eq!(code, 0, "weft tx list --node {node}: {err}");
            (!out.contains(tid)).then_some(())
        },
    );
}

/// A TCP port on loopback that was free a moment ago.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The tid at the end of a process's `PAUSED`/`CRASHPOINT`/`COMMITTED`
/// line.
pub fn tid_of(line: &str) -> String {
    line.split_whitespace().last().unwrap().to_string()
}

/// A temporary data directory path under `base` for node `id`.
pub fn data_dir(base: &Path, id: u32) -> String {
    base.join(format!("n{id}")).display().to_string()
}
