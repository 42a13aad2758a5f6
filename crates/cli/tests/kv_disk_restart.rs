//! A Raid site whose copy lives in the disk engine is killed with SIGKILL
//! after a load larger than the engine's overlay bound (so the load spilled)
//! and a checkpoint, with DebitCredit work in the log tail; it restarts from
//! its data directory by opening the engine and replaying the tail, knows it
//! is loaded, and its audit passes.
//!
//! Scale 3 (300 011 tuples) by default; the ten-million-key figure of the
//! report is this test at scale 100, in a release build:
//! `WEFT_KV_RESTART_SCALE=100 cargo test --release -p weft-cli --test kv_disk_restart -- --nocapture`.

mod common;

use std::net::TcpListener;
use std::process::{Child, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::{run, weft};

const SECRET: &str = "kv-restart";

fn free_port() -> String {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().to_string()
}

/// A `weft raid site` process, killed when dropped.
struct Site {
    child: Child,
    lines: mpsc::Receiver<String>,
}

impl Site {
    fn spawn(listen: &str, data: &str) -> Site {
        let mut child = weft()
            .args(["--log", "weft_kv=info,warn"])
            .args(["raid", "site", "--id", "1", "--listen", listen])
            .args(["--data-dir", data, "--secret", SECRET])
            .args(["--checkpoint-every", "1s", "--kv-engine", "disk"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("weft raid site starts");
        let (tx, rx) = mpsc::channel();
        for stream in [
            Box::new(child.stdout.take().expect("stdout")) as Box<dyn std::io::Read + Send>,
            Box::new(child.stderr.take().expect("stderr")),
        ] {
            let tx = tx.clone();
            std::thread::spawn(move || {
                use std::io::BufRead;
                for line in std::io::BufReader::new(stream).lines() {
                    let Ok(line) = line else { return };
                    let line = plain(&line);
                    eprintln!("site: {line}");
                    let _ = tx.send(line);
                }
            });
        }
        Site { child, lines: rx }
    }

    /// Waits (bounded) for a line for which `want` holds.
    fn wait(&self, what: &str, limit: Duration, want: impl Fn(&str) -> bool) -> String {
        let deadline = Instant::now() + limit;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(l) if want(&l) => return l,
                Ok(_) => continue,
                Err(e) => panic!("the site never printed {what} ({e})"),
            }
        }
    }
}

impl Drop for Site {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `line` without its terminal colour sequences (ESC [ ... m).
fn plain(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// The number after `name=` in a log line.
fn field(line: &str, name: &str) -> Option<u64> {
    let rest = line.split(&format!("{name}=")).nth(1)?;
    rest.split(|c: char| !c.is_ascii_digit())
        .next()?
        .parse()
        .ok()
}

#[test]
fn a_site_killed_after_a_large_load_reopens_its_engine_and_passes_its_audit() {
    let scale: u32 = std::env::var("WEFT_KV_RESTART_SCALE")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(3);
    let tuples = 100_011 * u64::from(scale);
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("site1").to_string_lossy().into_owned();
    let listen = free_port();
    let site = Site::spawn(&listen, &data);
    site.wait("its ready line", Duration::from_secs(30), |l| {
        l.contains(" listening on ")
    });
    let scale_s = scale.to_string();
    let t = Instant::now();
    let (code, out, err) = run(
        &[
            "raid", "load", "--node", &listen, "--secret", SECRET, "--scale", &scale_s,
        ],
        &[],
    );
    assert_eq!(code, 0, "load failed: {out}{err}");
    assert!(out.contains(&format!("loaded {tuples} tuples")), "{out}");
    println!(
        "loaded {tuples} tuples in {:.1} s",
        t.elapsed().as_secs_f64()
    );
    // A checkpoint begun after the load ended: the engine then holds the
    // whole copy durably. A checkpoint with nothing new in the log is
    // skipped, so each wait follows a short run that appends: the first
    // checkpoint logged after the first run ends after the load did, and the
    // one logged after the second run began after that one ended. A third
    // run leaves work in the log tail past it.
    let raid_run = || {
        let (code, out, err) = run(
            &[
                "raid",
                "run",
                "--node",
                &listen,
                "--secret",
                SECRET,
                "--scale",
                &scale_s,
                "--clients",
                "4",
                "--duration",
                "1s",
            ],
            &[],
        );
        assert_eq!(code, 0, "run failed: {out}{err}");
    };
    for _ in 0..2 {
        while site.lines.try_recv().is_ok() {}
        raid_run();
        site.wait(
            "a checkpoint after the load",
            Duration::from_secs(600),
            |l| l.contains("kv checkpoint written") && field(l, "lsn").is_some(),
        );
    }
    raid_run();
    drop(site); // SIGKILL

    let t = Instant::now();
    let site = Site::spawn(&listen, &data);
    let ready = site.wait(
        "its ready line after the kill",
        Duration::from_secs(600),
        |l| l.contains(" listening on "),
    );
    println!(
        "restart with {tuples} keys: serving after {:.2} s ({ready})",
        t.elapsed().as_secs_f64()
    );
    let (code, out, err) = run(
        &["raid", "audit", "--node", &listen, "--secret", SECRET],
        &[],
    );
    assert_eq!(code, 0, "audit failed after the restart: {out}{err}");
    assert!(out.contains("audit PASSED"), "{out}");
    // The copy knows it is loaded: a second load writes nothing.
    let (code, out, err) = run(
        &[
            "raid", "load", "--node", &listen, "--secret", SECRET, "--scale", &scale_s,
        ],
        &[],
    );
    assert_eq!(code, 0, "reload failed: {out}{err}");
    assert!(out.contains("loaded 0 tuples"), "{out}");
}
