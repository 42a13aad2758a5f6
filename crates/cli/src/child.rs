//! Child `weft` processes started by this binary (the demo's site processes,
//! the benchmark's second node): start one, wait for its ready line, stop it.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context;

/// A child `weft` process that printed its ready line; killed when dropped.
pub struct ChildNode {
    child: Child,
    /// The address it listens on, from its ready line.
    pub addr: String,
}

impl ChildNode {
    /// Starts this binary with `args` (e.g. `["node", "--id", "2", ...]`) and
    /// waits for the ready line (`... listening on <addr> ...`) on its
    /// stdout.
    ///
    /// Fails when the binary cannot be found or started, or when it exits or
    /// prints something else before its ready line.
    pub fn start(what: &str, args: &[String]) -> anyhow::Result<ChildNode> {
        let exe = std::env::current_exe().context("locating the weft binary")?;
        let mut child = Command::new(exe)
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .with_context(|| format!("starting {what}"))?;
        let stdout = child.stdout.take().expect("piped stdout");
        let mut line = String::new();
        let read = BufReader::new(stdout).read_line(&mut line);
        let addr = read
            .ok()
            .and_then(|_| line.split(" listening on ").nth(1))
            .and_then(|r| r.split_whitespace().next())
            .map(str::to_string);
        match addr {
            Some(addr) => Ok(ChildNode { child, addr }),
            None => {
                let _ = child.kill();
                let _ = child.wait();
                anyhow::bail!("{what} did not start: {line:?}")
            }
        }
    }

    /// The child's process id.
    pub fn id(&self) -> u32 {
        self.child.id()
    }

    /// Asks the child to stop with SIGTERM (so it removes its temporary data
    /// directory) and waits up to `within` before killing it.
    pub fn terminate(mut self, within: Duration) {
        // kill(1) keeps this binary free of unsafe signal calls.
        let _ = Command::new("kill")
            .arg("-TERM")
            .arg(self.child.id().to_string())
            .status();
        let deadline = Instant::now() + within;
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        // Dropping kills it.
    }
}

impl Drop for ChildNode {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
    }
}
