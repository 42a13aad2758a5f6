//! A minimal weft node with a group member or sender, for tests that need a
//! real process to kill (`crates/group/tests/process.rs`). Not a tool: the
//! `weft` binary is.
//!
//! ```text
//! weft-group-node --id N --join HOST:PORT --secret S --group G --group-secret P
//!                 --mode member-hold|member-echo|sender
//! ```
//!
//! Prints `READY <addr>` once joined. `member-hold` prints `GOT <comm>` for
//! each message and never replies; `member-echo` replies with the message;
//! `sender` sends the line it reads on stdin and prints `SENT <count>`,
//! then `REPLY <bytes>` for each reply.

use std::io::{BufRead, Write};
use std::time::Duration;

use weft_group::config::GroupConfig;
use weft_group::runtime::Groups;
use weft_transport::{ChannelSet, Endpoint, Seed, TransportConfig};
use weft_wire::{GroupId, Incarnation, NodeId, Payload};

struct Args {
    id: u32,
    join: Option<String>,
    secret: String,
    group: GroupId,
    group_secret: String,
    mode: String,
}

fn usage(why: &str) -> ! {
    eprintln!("weft-group-node: {why}");
    eprintln!("usage: weft-group-node --id N [--join HOST:PORT] --secret S --group G --group-secret P --mode member-hold|member-echo|sender");
    std::process::exit(2);
}

fn parse() -> Args {
    let mut it = std::env::args().skip(1);
    let (mut id, mut join, mut secret, mut group, mut group_secret, mut mode) =
        (None, None, String::new(), None, String::new(), None);
    while let Some(flag) = it.next() {
        let value = it
            .next()
            .unwrap_or_else(|| usage(&format!("{flag} needs a value")));
        match flag.as_str() {
            "--id" => id = value.parse().ok(),
            "--join" => join = Some(value),
            "--secret" => secret = value,
            "--group" => group = Some(value.parse().unwrap_or_else(|e| usage(&format!("{e}")))),
            "--group-secret" => group_secret = value,
            "--mode" => mode = Some(value),
            other => usage(&format!("unknown flag {other}")),
        }
    }
    Args {
        id: id.unwrap_or_else(|| usage("--id is required")),
        join,
        secret,
        group: group.unwrap_or_else(|| usage("--group is required")),
        group_secret,
        mode: mode.unwrap_or_else(|| usage("--mode is required")),
    }
}

fn say(line: String) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args = parse();
    let cfg = TransportConfig {
        secret: args.secret.as_bytes().to_vec(),
        listen: Some(std::net::SocketAddr::from(([127, 0, 0, 1], 0))),
        channels: ChannelSet {
            inproc: true,
            shm: false,
            tcp: true,
        },
        heartbeat_interval: Duration::from_millis(50),
        dead_after: Duration::from_millis(500),
        ..TransportConfig::node(NodeId(args.id), Incarnation(std::process::id()))
    };
    let ep = Endpoint::start(cfg)
        .await
        .unwrap_or_else(|e| usage(&e.to_string()));
    let groups = Groups::start(ep.clone(), None, GroupConfig::default())
        .unwrap_or_else(|f| usage(&f.to_string()));
    if let Some(join) = &args.join {
        let addr = join
            .parse()
            .unwrap_or_else(|_| usage("--join takes HOST:PORT"));
        ep.join(Seed::Tcp(addr))
            .await
            .unwrap_or_else(|f| usage(&f.to_string()));
    }
    let addr = ep.listen_addr().map(|a| a.to_string()).unwrap_or_default();
    match args.mode.as_str() {
        "member-hold" | "member-echo" => {
            let member = groups
                .join(&args.group, &args.group_secret)
                .await
                .unwrap_or_else(|f| usage(&format!("join: {f}")));
            say(format!("READY {addr}"));
            let mut held = Vec::new();
            loop {
                match member.recv(&args.group, None).await {
                    Ok(mut i) => {
                        say(format!("GOT {}", i.comm()));
                        if args.mode == "member-echo" {
                            let body = i.take_payload().unwrap_or_default();
                            let _ = i.reply(body).await;
                        } else {
                            held.push(i);
                        }
                    }
                    Err(f) => say(format!("ERR {}", f.status)),
                }
            }
        }
        "sender" => {
            let sender = groups.sender();
            say(format!("READY {addr}"));
            let (tx, mut lines) = tokio::sync::mpsc::unbounded_channel::<String>();
            std::thread::spawn(move || {
                for line in std::io::stdin().lock().lines().map_while(Result::ok) {
                    if tx.send(line).is_err() {
                        return;
                    }
                }
            });
            while let Some(line) = lines.recv().await {
                match sender
                    .send(&args.group, Payload::bytes(line.into_bytes()))
                    .await
                {
                    Ok(n) => say(format!("SENT {n}")),
                    Err(f) => say(format!("ERR {}", f.status)),
                }
                while let Ok(r) = sender
                    .next_reply(&args.group, Duration::from_secs(3600))
                    .await
                {
                    let body = r.payload.into_bytes().unwrap_or_default();
                    say(format!("REPLY {}", String::from_utf8_lossy(&body)));
                }
            }
        }
        other => usage(&format!("unknown mode {other}")),
    }
}
