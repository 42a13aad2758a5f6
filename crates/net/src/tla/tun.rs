//! TUN devices for TLA: opening one by name, optionally inside a named
//! network namespace (`ip netns`), as a file of whole IP packets.
//!
//! Owns the two system calls this needs (TUNSETIFF, setns) and nothing of
//! the device's configuration (addresses, routes, link state: `ip` does
//! that, see docs/net.md). Must never change the namespace of a thread other
//! than the short-lived one it spawns for the purpose.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;

const TUNSETIFF: libc::c_ulong = 0x4004_54ca;
const IFF_TUN: libc::c_short = 0x0001;
const IFF_NO_PI: libc::c_short = 0x1000;

#[repr(C)]
struct IfReq {
    name: [libc::c_char; libc::IFNAMSIZ],
    flags: libc::c_short,
    _pad: [u8; 22],
}

/// Opens (creating if absent) the TUN device `name` in this thread's
/// network namespace, or in the namespace `/var/run/netns/<netns>`.
///
/// Fails with InvalidInput for an empty or too long name, and with the
/// system's error otherwise (PermissionDenied without CAP_NET_ADMIN, NotFound
/// for an unknown namespace or a missing /dev/net/tun).
pub fn open(name: &str, netns: Option<&str>) -> io::Result<File> {
    if name.is_empty() || name.len() >= libc::IFNAMSIZ || name.contains('/') {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("bad TUN device name {name:?}"),
        ));
    }
    let Some(ns) = netns else {
        return open_here(name);
    };
    let ns_path = format!("/var/run/netns/{ns}");
    let name = name.to_string();
    // setns changes the calling thread only: a thread of its own, which
    // ends right after opening the device (the descriptor stays valid).
    std::thread::spawn(move || {
        let nsf = File::open(&ns_path)?;
        // SAFETY: setns takes a valid descriptor (nsf is open for the whole
        // call) and a namespace type flag; it only changes this thread's
        // network namespace, and this thread ends after opening the device.
        let r = unsafe { libc::setns(nsf.as_raw_fd(), libc::CLONE_NEWNET) };
        if r != 0 {
            return Err(io::Error::last_os_error());
        }
        open_here(&name)
    })
    .join()
    .map_err(|_| io::Error::other("the namespace thread panicked"))?
}

fn open_here(name: &str) -> io::Result<File> {
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/net/tun")?;
    let mut req = IfReq {
        name: [0; libc::IFNAMSIZ],
        flags: IFF_TUN | IFF_NO_PI,
        _pad: [0; 22],
    };
    for (d, s) in req.name.iter_mut().zip(name.bytes()) {
        *d = s as libc::c_char;
    }
    // SAFETY: TUNSETIFF reads and writes a `struct ifreq`; IfReq has its
    // layout (a NUL-terminated name of IFNAMSIZ bytes, the flags, padding to
    // the union's 24 bytes) and lives for the whole call; the descriptor is
    // open.
    let r = unsafe { libc::ioctl(f.as_raw_fd(), TUNSETIFF as _, &mut req as *mut IfReq) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(f)
}

/// Connects a TCP socket created inside the network namespace
/// `/var/run/netns/<netns>` to `addr` (blocking; for tools and benchmarks
/// that play the peer from the logger's own process).
///
/// Fails with the system's error (NotFound for an unknown namespace,
/// PermissionDenied without CAP_SYS_ADMIN, the connect's error).
pub fn connect_in_netns(
    netns: &str,
    addr: std::net::SocketAddr,
) -> io::Result<std::net::TcpStream> {
    let ns_path = format!("/var/run/netns/{netns}");
    std::thread::spawn(move || {
        let nsf = File::open(&ns_path)?;
        // SAFETY: as in `open`: a valid descriptor, a namespace flag, and
        // only this short-lived thread changes namespace.
        let r = unsafe { libc::setns(nsf.as_raw_fd(), libc::CLONE_NEWNET) };
        if r != 0 {
            return Err(io::Error::last_os_error());
        }
        std::net::TcpStream::connect(addr)
    })
    .join()
    .map_err(|_| io::Error::other("the namespace thread panicked"))?
}

/// True when this process may create TUN devices and namespaces (root).
pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::process::Command;

    #[test]
    fn bad_names_are_refused_before_any_system_call() {
        for n in ["", "a/b", "0123456789abcdefg"] {
            assert_eq!(
                open(n, None).unwrap_err().kind(),
                io::ErrorKind::InvalidInput
            );
        }
    }

    #[test]
    fn a_tun_in_a_namespace_carries_packets_both_ways() {
        if !is_root() {
            eprintln!("SKIP a_tun_in_a_namespace_carries_packets_both_ways: needs root (TUN devices and network namespaces)");
            return;
        }
        let ns = format!("wtun{}", std::process::id());
        let ip = |args: &[&str]| {
            let s = Command::new("ip").args(args).status().expect("ip");
            assert!(s.success(), "ip {args:?}");
        };
        ip(&["netns", "add", &ns]);
        let res = std::panic::catch_unwind(|| {
            let f = open("wtun0", Some(&ns)).expect("open the TUN in the namespace");
            ip(&["-n", &ns, "addr", "add", "10.99.0.1/24", "dev", "wtun0"]);
            ip(&["-n", &ns, "link", "set", "wtun0", "up"]);
            // A reader thread hands IPv4 UDP packets over; the test waits
            // for one with a deadline instead of blocking on the device.
            let (tx, rx) = std::sync::mpsc::channel();
            let mut rf = f.try_clone().unwrap();
            std::thread::spawn(move || {
                let mut buf = vec![0u8; 2048];
                while let Ok(n) = rf.read(&mut buf) {
                    if n >= 20 && buf[0] >> 4 == 4 && buf[9] == 17 {
                        let _ = tx.send(buf[..n].to_vec());
                    }
                }
            });
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
            let pkt = loop {
                // A datagram sent from inside the namespace leaves through the TUN.
                let s = Command::new("ip")
                    .args(["netns", "exec", &ns, "python3", "-c",
                        "import socket; socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'x', ('10.99.0.2', 9))"])
                    .status()
                    .expect("python3");
                assert!(s.success());
                if let Ok(p) = rx.recv_timeout(std::time::Duration::from_millis(500)) {
                    break p;
                }
                assert!(
                    std::time::Instant::now() < deadline,
                    "no packet came out of the TUN"
                );
            };
            assert_eq!(&pkt[12..16], &[10, 99, 0, 1]);
            assert_eq!(&pkt[16..20], &[10, 99, 0, 2]);
            // Writing a packet back is accepted by the device.
            (&f).write_all(&pkt).expect("write to the TUN");
        });
        ip(&["netns", "del", &ns]);
        if let Err(p) = res {
            std::panic::resume_unwind(p);
        }
    }
}
