//! The `weft run` half of `weft bench fs` (QuickSilver's Table 2 and its
//! Andrew benchmark): the null program under `weft run` against spawning it
//! plainly, and an Andrew-like script (copy a source tree of ~1,000 files,
//! stat every file, read every file with grep and wc, write derived files)
//! under `weft run` against the same script run plainly, in one run.
//!
//! Owns only the measurement (and the synthetic source tree); `weft run`
//! itself is measured as a separate process, the way a user runs it.
//! Progress goes to stderr.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context;
use rand::{Rng, SeedableRng};
use serde_json::json;

use super::{check, r2, write_json};
use crate::child::ChildNode;

/// Flags of the `weft run` part of `weft bench fs`.
#[derive(clap::Args, Debug, Clone)]
pub struct FsRunArgs {
    /// Null-program runs of each kind (the median is reported).
    #[arg(long, default_value_t = 30)]
    pub null_runs: u32,
    /// Andrew runs of each kind (the median is reported).
    #[arg(long, default_value_t = 3)]
    pub andrew_runs: u32,
    /// Files in the Andrew source tree.
    #[arg(long, default_value_t = 1000)]
    pub files: u32,
    /// Where the volumes go (temporary, removed).
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// Write the results as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// The Andrew-like script, run in a directory holding `src/`: copy, stat,
/// read (grep, wc), write derived files.
const ANDREW: &str = r#"set -e
cp -r src copy
find copy -type f -exec stat -c '%s %n' {} + > /dev/null
grep -r -c weft copy > /dev/null || true
find copy -type f -exec wc {} + > wc.txt
mkdir derived
for d in copy/*/; do
  n=$(basename "$d")
  cat "$d"* | sort > "derived/$n.sorted"
  wc -l "$d"* > "derived/$n.count"
done
"#;

/// Runs the `weft run` benchmarks and returns their JSON keys
/// (`null_run_ms`, `null_run_fs_ms`, `null_plain_ms`, `andrew_run_s`,
/// `andrew_plain_s`, and where the null run's time goes: `weft_version_ms`,
/// `weft_status_ms`).
pub async fn measure(args: FsRunArgs) -> anyhow::Result<serde_json::Value> {
    tokio::task::spawn_blocking(move || measure_blocking(&args)).await?
}

/// Runs `weft bench fs-run`.
pub async fn run(args: FsRunArgs) -> anyhow::Result<()> {
    let json_path = args.json.clone();
    let v = measure(args).await?;
    let f = |k: &str| v[k].as_f64().unwrap_or(f64::NAN);
    println!("weft bench fs (weft run part); machine load not controlled");
    println!(
        "  null program: plain {:.2} ms, weft run (node) {:.2} ms, weft run --fs (embedded node) {:.2} ms",
        f("null_plain_ms"),
        f("null_run_ms"),
        f("null_run_fs_ms")
    );
    println!(
        "  where the time goes: starting weft at all {:.2} ms, one call to a node (weft status) {:.2} ms",
        f("weft_version_ms"),
        f("weft_status_ms")
    );
    println!(
        "  Andrew-like script: plain {:.3} s, weft run --fs (embedded node) {:.3} s, \
         weft run --node --fs (resident node) {:.3} s",
        f("andrew_plain_s"),
        f("andrew_run_s"),
        f("andrew_run_node_s")
    );
    check(
        "null_run_ms / null_plain_ms",
        f("null_run_ms") / f("null_plain_ms"),
        "<=",
        1.85,
    );
    check(
        "andrew_run_s / andrew_plain_s",
        f("andrew_run_s") / f("andrew_plain_s"),
        "<=",
        1.10,
    );
    check(
        "andrew_run_node_s / andrew_plain_s",
        f("andrew_run_node_s") / f("andrew_plain_s"),
        "<=",
        1.10,
    );
    if let Some(p) = json_path {
        write_json(&p, &v)?;
    }
    Ok(())
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn weft_exe() -> anyhow::Result<PathBuf> {
    std::env::current_exe().context("locating the weft binary")
}

/// Spawns `cmd` and waits; fails unless it exits 0.
fn timed(cmd: &mut Command) -> anyhow::Result<Duration> {
    let t = Instant::now();
    let st = cmd
        .stdout(Stdio::null())
        .status()
        .with_context(|| format!("running {cmd:?}"))?;
    let took = t.elapsed();
    anyhow::ensure!(st.success(), "{cmd:?} failed: {st}");
    Ok(took)
}

/// Times the Andrew-like script in `dir` under `weft run [extra] --fs dir`
/// and checks that its output is in the volume.
fn andrew_under_weft(extra: &[&str], dir: &Path) -> anyhow::Result<Duration> {
    let took = timed(
        weft_cmd()?
            .arg("run")
            .args(extra)
            .arg("--fs")
            .arg(dir)
            .args(["--", "sh", "-c", ANDREW])
            .current_dir(dir),
    )?;
    anyhow::ensure!(
        dir.join("derived").is_dir() && dir.join("wc.txt").is_file(),
        "weft run {} did not leave the script's output in the volume",
        extra.join(" ")
    );
    Ok(took)
}

/// A `weft` command with no weft environment inherited.
fn weft_cmd() -> anyhow::Result<Command> {
    let mut c = Command::new(weft_exe()?);
    for k in [
        "WEFT_TX",
        "WEFT_NODE",
        "WEFT_NOTIFY_TX",
        "WEFT_RUN_OVERLAYS",
        "WEFT_CLUSTER_SECRET",
    ] {
        c.env_remove(k);
    }
    Ok(c)
}

/// Writes the synthetic source tree: `files` text files of 1-8 KiB in
/// directories of 25, from a fixed seed.
fn make_tree(root: &Path, files: u32) -> anyhow::Result<()> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(20);
    let words = [
        "weft", "fn", "let", "match", "commit", "abort", "volume", "lock", "page", "log",
    ];
    for i in 0..files {
        let dir = root.join(format!("d{:03}", i / 25));
        std::fs::create_dir_all(&dir)?;
        let len = rng.gen_range(1024..8192);
        let mut text = String::with_capacity(len + 16);
        while text.len() < len {
            text.push_str(words[rng.gen_range(0..words.len())]);
            text.push(if rng.gen_range(0..8) == 0 { '\n' } else { ' ' });
        }
        std::fs::write(dir.join(format!("f{i:04}.rs")), text)?;
    }
    Ok(())
}

fn measure_blocking(args: &FsRunArgs) -> anyhow::Result<serde_json::Value> {
    anyhow::ensure!(
        args.null_runs > 0 && args.andrew_runs > 0,
        "runs must be > 0"
    );
    let base = match &args.dir {
        Some(d) => d.clone(),
        None => std::env::current_dir()?,
    };
    let tmp = tempfile::Builder::new()
        .prefix(".weft-bench-fs-run-")
        .tempdir_in(&base)?;
    // The null program, three ways, interleaved so load hits all alike.
    let node = ChildNode::start(
        "the benchmark node",
        &[
            "node".into(),
            "--id".into(),
            "1".into(),
            "--listen".into(),
            "127.0.0.1:0".into(),
            "--data-dir".into(),
            tmp.path().join("node").display().to_string(),
        ],
    )?;
    let empty = tmp.path().join("empty");
    std::fs::create_dir_all(&empty)?;
    eprintln!("null program: {} runs of each kind", args.null_runs);
    let (mut plain, mut run, mut run_fs) = (Vec::new(), Vec::new(), Vec::new());
    // Where the time goes: starting the weft binary at all, and one call
    // to the node (connect, authenticate, ask).
    let (mut exe, mut call) = (Vec::new(), Vec::new());
    for _ in 0..args.null_runs {
        plain.push(timed(&mut Command::new("true"))?);
        exe.push(timed(weft_cmd()?.arg("--version"))?);
        call.push(timed(weft_cmd()?.args(["status", "--node", &node.addr]))?);
        run.push(timed(
            weft_cmd()?.args(["run", "--node", &node.addr, "--", "true"]),
        )?);
        run_fs.push(timed(
            weft_cmd()?
                .arg("run")
                .arg("--fs")
                .arg(&empty)
                .args(["--", "true"]),
        )?);
    }
    node.terminate(Duration::from_secs(5));
    let ms = |d: Duration| r2(d.as_secs_f64() * 1e3);
    let null_plain_ms = ms(median(plain));
    let null_run_ms = ms(median(run));
    let null_run_fs_ms = ms(median(run_fs));
    let weft_exe_ms = ms(median(exe));
    let weft_status_ms = ms(median(call));
    // Andrew: a fresh volume holding the source tree for every run.
    eprintln!(
        "Andrew-like script over {} files: {} runs of each kind",
        args.files, args.andrew_runs
    );
    // A resident node serving one volume (QuickSilver measured Andrew with
    // its file system and transaction manager resident): each run's tree
    // is a fresh directory inside that volume.
    let node_vol = tmp.path().join("nodevol");
    std::fs::create_dir_all(&node_vol)?;
    let node = ChildNode::start(
        "the benchmark's volume node",
        &[
            "node".into(),
            "--id".into(),
            "1".into(),
            "--listen".into(),
            "127.0.0.1:0".into(),
            "--data-dir".into(),
            tmp.path().join("node2").display().to_string(),
            "--volume".into(),
            node_vol.display().to_string(),
        ],
    )?;
    let (mut plain, mut run, mut run_node) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..args.andrew_runs {
        let p = tmp.path().join(format!("plain{i}"));
        let v = tmp.path().join(format!("vol{i}"));
        make_tree(&p.join("src"), args.files)?;
        make_tree(&v.join("src"), args.files)?;
        plain.push(timed(
            Command::new("sh").args(["-c", ANDREW]).current_dir(&p),
        )?);
        run.push(andrew_under_weft(&[], &v)?);
        let n = node_vol.join(format!("run{i}"));
        make_tree(&n.join("src"), args.files)?;
        run_node.push(andrew_under_weft(&["--node", &node.addr], &n)?);
    }
    node.terminate(Duration::from_secs(5));
    let s = |d: Duration| (d.as_secs_f64() * 1e3).round() / 1e3;
    Ok(json!({
        "null_plain_ms": null_plain_ms,
        "null_run_ms": null_run_ms,
        "null_run_fs_ms": null_run_fs_ms,
        "weft_version_ms": weft_exe_ms,
        "weft_status_ms": weft_status_ms,
        "andrew_plain_s": s(median(plain)),
        "andrew_run_s": s(median(run)),
        "andrew_run_node_s": s(median(run_node)),
        "andrew_files": args.files,
    }))
}
