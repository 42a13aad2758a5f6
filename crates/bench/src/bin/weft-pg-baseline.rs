//! Runs one PostgreSQL peer baseline on a fresh temporary server (fsync on) and prints its
//! report as JSON. `weft bench` calls the library directly; this is for running a baseline by
//! hand or from CI.
//!
//! ```text
//! weft-pg-baseline pg2pc   [--clients 64] [--secs 5]
//! weft-pg-baseline pgbench [--scale 1] [--clients 8] [--secs 10]
//! ```

use std::process::ExitCode;
use std::time::Duration;

use weft_bench::{pg2pc, pgbench};
use weft_pg::{ServerOptions, TempPostgres};

const USAGE: &str = "usage: weft-pg-baseline pg2pc [--clients N] [--secs S]\n       \
                     weft-pg-baseline pgbench [--scale N] [--clients N] [--secs S]";

struct Args {
    which: String,
    clients: Option<u32>,
    secs: Option<u64>,
    scale: Option<u32>,
}

fn parse_args() -> Result<Args, String> {
    let mut argv = std::env::args().skip(1);
    let which = argv.next().ok_or("missing benchmark name")?;
    let mut args = Args {
        which,
        clients: None,
        secs: None,
        scale: None,
    };
    while let Some(flag) = argv.next() {
        let value = argv.next().ok_or(format!("{flag} needs a value"))?;
        let number = |v: &str| {
            v.parse::<u64>()
                .map_err(|_| format!("{flag}: {v:?} is not a number"))
        };
        match flag.as_str() {
            "--clients" => {
                args.clients = Some(u32::try_from(number(&value)?).map_err(|e| e.to_string())?)
            }
            "--secs" => args.secs = Some(number(&value)?),
            "--scale" => {
                args.scale = Some(u32::try_from(number(&value)?).map_err(|e| e.to_string())?)
            }
            _ => return Err(format!("unknown flag {flag}")),
        }
    }
    Ok(args)
}

async fn run(args: Args) -> Result<String, Box<dyn std::error::Error>> {
    let server = TempPostgres::start(ServerOptions::default().fsync(true))?;
    let json = match args.which.as_str() {
        "pg2pc" => {
            let clients = args.clients.unwrap_or(64) as usize;
            let duration = Duration::from_secs(args.secs.unwrap_or(5));
            serde_json::to_string_pretty(&pg2pc::run(&server, clients, duration).await?)?
        }
        "pgbench" => {
            let duration = Duration::from_secs(args.secs.unwrap_or(10));
            let report = pgbench::run(
                &server,
                args.scale.unwrap_or(1),
                args.clients.unwrap_or(8),
                duration,
            )
            .await?;
            serde_json::to_string_pretty(&report)?
        }
        other => return Err(format!("unknown benchmark {other:?}\n{USAGE}").into()),
    };
    Ok(json)
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(args) => args,
        Err(e) => {
            eprintln!("{e}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    match run(args).await {
        Ok(json) => {
            println!("{json}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("weft-pg-baseline: {e}");
            ExitCode::FAILURE
        }
    }
}
