//! Host identity: a string equal for every process on one machine (one boot),
//! different across machines. Used to find same-host peers for the shm channel.
//!
//! Owns how the identity is derived. Must never fail: a machine without the
//! kernel's boot id falls back to the hostname.

/// This host's identity: `<hostname>/<kernel boot id>`.
pub fn host_id() -> String {
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| s.trim().to_string())
        .unwrap_or_default();
    let name = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "localhost".to_string());
    format!("{name}/{boot}")
}
