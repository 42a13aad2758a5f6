//! Network namespaces for tests that partition real processes: one
//! namespace per node, each with a veth pair into a bridge of the test's own
//! in the root namespace (which holds an address on it too, so that clients
//! run there reach every node). A partition between two nodes is a pair of
//! blackhole routes, one in each node's namespace: packets between them
//! vanish, links to everyone else (and to the root namespace) stay up.
//!
//! Owns the namespaces, the bridge and the routes it creates. Must remove
//! all of them when dropped, even when the test fails, and must never touch
//! an interface, namespace or process it did not create (except the
//! leftovers of an earlier run of this module whose process is gone: their
//! namespaces, bridge, and the processes still in those namespaces).

#![allow(dead_code)]

use std::collections::BTreeSet;
use std::process::Command;

/// Prefix of every namespace this module creates: `wchaos-<pid>-<node>`.
const NS_PREFIX: &str = "wchaos-";

/// A bridge and one namespace per node, removed when dropped.
pub struct Net {
    pid: u32,
    nodes: usize,
    /// The /24 the nodes live on: `10.<a>.<b>`.
    net: String,
    /// Cut pairs (lower id first).
    cut: BTreeSet<(usize, usize)>,
}

/// Runs `ip ARGS`; the error says what failed.
fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("cannot run ip: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "`ip {}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

fn bridge_of(pid: u32) -> String {
    format!("wcb{pid}")
}

fn veth_of(pid: u32, node: usize) -> String {
    format!("wcv{pid}-{node}")
}

impl Net {
    /// Creates the namespaces of nodes 1..=`nodes`.
    ///
    /// Fails with the reason (not root, no `ip`, no namespace support); what
    /// was created by then is removed.
    pub fn create(nodes: usize) -> Result<Net, String> {
        assert!((1..=9).contains(&nodes), "1 to 9 nodes");
        remove_leftovers();
        let pid = std::process::id();
        let net = format!("10.{}.{}", 100 + pid % 100, (pid / 100) % 250);
        // From here on, Drop removes whatever exists.
        let n = Net {
            pid,
            nodes,
            net,
            cut: BTreeSet::new(),
        };
        let br = bridge_of(pid);
        ip(&["link", "add", &br, "type", "bridge"])?;
        ip(&["addr", "add", &format!("{}.254/24", n.net), "dev", &br])?;
        ip(&["link", "set", &br, "up"])?;
        for node in 1..=nodes {
            let ns = n.ns(node);
            let veth = veth_of(pid, node);
            ip(&["netns", "add", &ns])?;
            ip(&["-n", &ns, "link", "set", "lo", "up"])?;
            ip(&[
                "link", "add", &veth, "type", "veth", "peer", "name", "eth0", "netns", &ns,
            ])?;
            ip(&["link", "set", &veth, "master", &br])?;
            ip(&["link", "set", &veth, "up"])?;
            ip(&[
                "-n",
                &ns,
                "addr",
                "add",
                &format!("{}/24", n.addr(node)),
                "dev",
                "eth0",
            ])?;
            ip(&["-n", &ns, "link", "set", "eth0", "up"])?;
        }
        Ok(n)
    }

    /// The namespace of `node`.
    pub fn ns(&self, node: usize) -> String {
        format!("{NS_PREFIX}{}-{node}", self.pid)
    }

    /// The address of `node` (reachable from the root namespace).
    pub fn addr(&self, node: usize) -> String {
        format!("{}.{node}", self.net)
    }

    /// Cuts the path between nodes `a` and `b` both ways.
    ///
    /// Fails when a route cannot be added.
    pub fn cut(&mut self, a: usize, b: usize) -> Result<(), String> {
        let pair = (a.min(b), a.max(b));
        if !self.cut.insert(pair) {
            return Ok(());
        }
        for (from, to) in [(a, b), (b, a)] {
            ip(&[
                "-n",
                &self.ns(from),
                "route",
                "add",
                "blackhole",
                &format!("{}/32", self.addr(to)),
            ])?;
        }
        Ok(())
    }

    /// Cuts `node` from every other node (not from the root namespace).
    ///
    /// Fails like [`Net::cut`].
    pub fn isolate(&mut self, node: usize) -> Result<(), String> {
        for other in 1..=self.nodes {
            if other != node {
                self.cut(node, other)?;
            }
        }
        Ok(())
    }

    /// Removes every cut.
    ///
    /// Fails when a route cannot be removed.
    pub fn heal(&mut self) -> Result<(), String> {
        let pairs = std::mem::take(&mut self.cut);
        let mut first_err = Ok(());
        for (a, b) in pairs {
            for (from, to) in [(a, b), (b, a)] {
                let r = ip(&[
                    "-n",
                    &self.ns(from),
                    "route",
                    "del",
                    "blackhole",
                    &format!("{}/32", self.addr(to)),
                ]);
                if first_err.is_ok() {
                    first_err = r;
                }
            }
        }
        first_err
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        remove_of(self.pid);
    }
}

/// Removes the namespaces and bridge of run `pid` (best effort: what does
/// not exist is skipped), after killing what still runs in them (processes
/// of a test that was itself killed). Deleting a namespace deletes its veth
/// end, which deletes the pair.
fn remove_of(pid: u32) {
    for ns in namespaces() {
        if owner(&ns) == Some(pid) {
            if let Ok(out) = Command::new("ip").args(["netns", "pids", &ns]).output() {
                for p in String::from_utf8_lossy(&out.stdout).split_whitespace() {
                    let _ = Command::new("kill").args(["-KILL", p]).status();
                }
            }
            let _ = ip(&["netns", "del", &ns]);
        }
    }
    let _ = ip(&["link", "del", &bridge_of(pid)]);
}

fn namespaces() -> Vec<String> {
    let Ok(out) = Command::new("ip").args(["netns", "list"]).output() else {
        return Vec::new();
    };
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|n| n.starts_with(NS_PREFIX))
        .map(str::to_string)
        .collect()
}

/// The pid in `wchaos-<pid>-<node>`.
fn owner(ns: &str) -> Option<u32> {
    ns.strip_prefix(NS_PREFIX)?.split('-').next()?.parse().ok()
}

/// Removes what earlier runs left behind when their process died before
/// their Drop ran (SIGKILL of the test binary).
fn remove_leftovers() {
    let dead: BTreeSet<u32> = namespaces()
        .iter()
        .filter_map(|ns| owner(ns))
        .filter(|pid| !std::path::Path::new(&format!("/proc/{pid}")).exists())
        .collect();
    for pid in dead {
        remove_of(pid);
    }
}
