//! Host identity: a string equal for processes that may share memory *and*
//! share one network (one kernel boot, one network namespace), different
//! otherwise. Used to find same-host peers for the shm channel.
//!
//! Two processes in different network namespaces of one kernel (containers,
//! `ip netns`) could map the same memory, but a link between them over shared
//! memory would ignore the network between them: a partition would not cut
//! it. So the network namespace is part of the identity, and such peers link
//! over TCP like peers on other machines (docs/membership.md).
//!
//! Owns how the identity is derived. Must never fail: a machine without the
//! kernel's boot id or namespace files falls back to what it has (the
//! hostname at least).

/// This host's identity: `<hostname>/<kernel boot id>/<network namespace>`,
/// the namespace as the kernel names it (`net:[4026531840]`).
pub fn host_id() -> String {
    let read = |path: &str| {
        std::fs::read_to_string(path)
            .map(|s| s.trim().to_string())
            .unwrap_or_default()
    };
    let name = Some(read("/proc/sys/kernel/hostname"))
        .filter(|n| !n.is_empty())
        .unwrap_or_else(|| "localhost".to_string());
    let netns = std::fs::read_link("/proc/self/ns/net")
        .map(|p| p.to_string_lossy().into_owned())
        .unwrap_or_default();
    compose(&name, &read("/proc/sys/kernel/random/boot_id"), &netns)
}

/// The identity of a host named `name`, booted as `boot`, seen from network
/// namespace `netns`.
fn compose(name: &str, boot: &str, netns: &str) -> String {
    format!("{name}/{boot}/{netns}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_network_namespace_is_part_of_the_host() {
        let a = compose("vm", "b00t", "net:[4026531833]");
        assert_eq!(a, compose("vm", "b00t", "net:[4026531833]"));
        assert_ne!(a, compose("vm", "b00t", "net:[4026532395]"));
        assert_ne!(a, compose("vm", "other-boot", "net:[4026531833]"));
        if let Ok(ns) = std::fs::read_link("/proc/self/ns/net") {
            assert!(host_id().ends_with(&*ns.to_string_lossy()), "{}", host_id());
        }
    }

    /// A process in a new network namespace (`unshare -rn`, unprivileged
    /// where user namespaces are allowed) computes another host identity,
    /// so it is never offered shared memory. Skipped, saying so, where
    /// `unshare` cannot run.
    #[test]
    fn a_process_in_another_network_namespace_is_another_host() {
        const CHILD: &str = "WEFT_HOST_ID_CHILD";
        const NAME: &str = "host::tests::a_process_in_another_network_namespace_is_another_host";
        if std::env::var_os(CHILD).is_some() {
            println!("\nHOST_ID={}", host_id());
            return;
        }
        let exe = std::env::current_exe().expect("test binary");
        let out = std::process::Command::new("unshare")
            .arg("-rn")
            .arg(exe)
            .args(["--exact", NAME, "--nocapture", "--test-threads=1"])
            .env(CHILD, "1")
            .output();
        let out = match out {
            Ok(o) if o.status.success() => o,
            Ok(o) => {
                eprintln!(
                    "skipped: unshare -rn failed here: {}",
                    String::from_utf8_lossy(&o.stderr)
                );
                return;
            }
            Err(e) => {
                eprintln!("skipped: cannot run unshare: {e}");
                return;
            }
        };
        let stdout = String::from_utf8_lossy(&out.stdout);
        let child = stdout
            .lines()
            .find_map(|l| l.split_once("HOST_ID=").map(|(_, id)| id.trim()))
            .unwrap_or_else(|| panic!("no HOST_ID line in {stdout}"));
        let mine = host_id();
        assert_ne!(child, mine, "another network namespace, same host id");
        let machine = |id: &str| id.rsplit_once('/').map(|(m, _)| m.to_string());
        assert_eq!(machine(child), machine(&mine), "same kernel, same boot");
    }
}
