//! `weft bench kvstore`: the KV store's disk engine at a small and a large
//! size in the same run: a checkpoint after the same number of updates (its
//! cost must not follow the database's size), the background merge of that
//! checkpoint's delta into the main table (reported, not a target: it is
//! the B-tree's upkeep, off the checkpoint's path), a reopen, and random
//! reads.
//!
//! Owns only the measurement; the engine is `weft_kv::disk`. Progress goes
//! to stderr one line a phase, on a terminal or not.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use bytes::Bytes;
use rand::{Rng, SeedableRng};
use serde_json::json;
use weft::kv::disk::{self, DiskOptions, DiskStore};
use weft::Durability;

use super::{check, r2, write_json};

/// Flags of `weft bench kvstore`.
#[derive(clap::Args, Debug)]
pub struct KvStoreArgs {
    /// Keys of the small database (scale 1: 100 000 accounts).
    #[arg(long, default_value_t = 100_000)]
    pub small: u64,
    /// Keys of the large database (scale 100: ten million accounts).
    #[arg(long, default_value_t = 10_000_000)]
    pub large: u64,
    /// Updates (random keys) before each measured checkpoint.
    #[arg(long, default_value_t = 100_000)]
    pub updates: u64,
    /// Measured checkpoints per size (the median is reported).
    #[arg(long, default_value_t = 3)]
    pub checkpoints: u32,
    /// Page cache of the engine, in MiB.
    #[arg(long, default_value_t = 64)]
    pub cache_mib: usize,
    /// Load the stores through spills of a million keys each (as a load
    /// through transactions does) instead of the engine's bulk import: the
    /// delta file then grows to the store's size before the measured
    /// checkpoints.
    #[arg(long)]
    pub load_by_spills: bool,
    /// Where the engine files go (temporary, removed).
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// Write the results as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

struct Figures {
    load_s: f64,
    checkpoint_ms: f64,
    /// A background merge of one round's delta into the main table.
    merge_ms: f64,
    open_ms: f64,
    get_us: f64,
    file_mib: f64,
}

fn key(i: u64) -> Bytes {
    // Raid's account keys: a relation byte, then the key big-endian.
    let mut k = Vec::with_capacity(9);
    k.push(b'a');
    k.extend_from_slice(&i.to_be_bytes());
    Bytes::from(k)
}

fn value(v: i64) -> Bytes {
    Bytes::copy_from_slice(&v.to_le_bytes())
}

fn checkpoint(store: &mut DiskStore, lsn: u64) -> anyhow::Result<Duration> {
    let t = Instant::now();
    let job = store
        .begin_flush()
        .ok_or_else(|| anyhow::anyhow!("a flush is already running"))?;
    let res = job.write(Some((lsn, &[])));
    store.end_flush(&job);
    res?;
    Ok(t.elapsed())
}

/// Merges the deltas into the main table, as the service does in the
/// background between checkpoints.
fn merge(store: &mut DiskStore) -> anyhow::Result<Duration> {
    let t = Instant::now();
    if let Some(job) = store.begin_merge()? {
        let res = job.write();
        store.end_merge(&job);
        res?;
    }
    Ok(t.elapsed())
}

fn measure(args: &KvStoreArgs, keys: u64, base: &std::path::Path) -> anyhow::Result<Figures> {
    let dir = tempfile::Builder::new()
        .prefix(".weft-bench-kvstore-")
        .tempdir_in(base)?;
    let opts = DiskOptions {
        cache_bytes: args.cache_mib << 20,
        ..DiskOptions::default()
    };
    let dur = Durability::new();
    let mut store = DiskStore::open(dir.path(), &dur, opts.clone())?.store;
    // The load goes straight into the main file through the engine's bulk
    // import (sorted, one durable commit), as a restored or freshly loaded
    // store would be: the delta file then holds only checkpoints, as in a
    // steady state, not the load's spills.
    let t = Instant::now();
    let mut lsn = 1;
    if args.load_by_spills {
        let chunk = 1_000_000u64;
        for start in (1..=keys).step_by(chunk as usize) {
            for i in start..(start + chunk).min(keys + 1) {
                store.apply(key(i), Some(value(0)));
            }
            let job = store.begin_flush().expect("no flush runs");
            let res = job.write(None);
            store.end_flush(&job);
            res?;
        }
        checkpoint(&mut store, lsn)?;
        merge(&mut store)?;
    } else {
        disk::import(&mut store, (1..=keys).map(|i| (key(i), value(0))), lsn, &[])?;
    }
    eprintln!("  {keys} keys: loaded ({:.0} s)", t.elapsed().as_secs_f64());
    let load_s = t.elapsed().as_secs_f64();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(keys);
    let mut times = Vec::new();
    let mut merges = Vec::new();
    for round in 0..args.checkpoints.max(1) {
        for _ in 0..args.updates {
            let k = rng.gen_range(1..=keys);
            store.apply(key(k), Some(value(rng.gen_range(-5000..=5000))));
        }
        lsn += 1;
        let d = checkpoint(&mut store, lsn)?;
        eprintln!(
            "  {keys} keys: checkpoint {} of {} updates: {:.1} ms",
            round + 1,
            args.updates,
            d.as_secs_f64() * 1000.0
        );
        times.push(d.as_secs_f64() * 1000.0);
        let m = merge(&mut store)?;
        eprintln!(
            "  {keys} keys: merge of that checkpoint's delta: {:.1} ms",
            m.as_secs_f64() * 1000.0
        );
        merges.push(m.as_secs_f64() * 1000.0);
    }
    times.sort_by(f64::total_cmp);
    merges.sort_by(f64::total_cmp);
    let checkpoint_ms = times[times.len() / 2];
    let merge_ms = merges[merges.len() / 2];
    // Random reads through the page cache (hits and misses as the size
    // makes them).
    let reads = 100_000;
    let t = Instant::now();
    for _ in 0..reads {
        let k = rng.gen_range(1..=keys);
        anyhow::ensure!(store.get(&key(k))?.is_some(), "key {k} missing");
    }
    let get_us = t.elapsed().as_secs_f64() * 1e6 / reads as f64;
    let file_mib = (std::fs::metadata(store.file())?.len()
        + std::fs::metadata(store.main_file())?.len()) as f64
        / (1 << 20) as f64;
    drop(store);
    let t = Instant::now();
    let opened = DiskStore::open(dir.path(), &dur, opts)?;
    anyhow::ensure!(opened.lsn == Some(lsn), "reopened at {:?}", opened.lsn);
    anyhow::ensure!(opened.store.get(&key(keys))?.is_some(), "last key missing");
    let open_ms = t.elapsed().as_secs_f64() * 1000.0;
    Ok(Figures {
        load_s,
        checkpoint_ms,
        merge_ms,
        open_ms,
        get_us,
        file_mib,
    })
}

/// Runs `weft bench kvstore`.
pub async fn run(args: KvStoreArgs) -> anyhow::Result<()> {
    tokio::task::spawn_blocking(move || run_blocking(args)).await?
}

fn run_blocking(args: KvStoreArgs) -> anyhow::Result<()> {
    let base = args.dir.clone().unwrap_or_else(std::env::temp_dir);
    let mut figs = Vec::new();
    for keys in [args.small, args.large] {
        eprintln!("weft bench kvstore: {keys} keys");
        figs.push((keys, measure(&args, keys, &base)?));
    }
    println!(
        "weft bench kvstore: checkpoint after {} random updates, {} MiB cache",
        args.updates, args.cache_mib
    );
    println!(
        "{:>12} {:>9} {:>14} {:>9} {:>9} {:>9} {:>9}",
        "keys", "load s", "checkpoint ms", "merge ms", "open ms", "get us", "file MiB"
    );
    let mut report = serde_json::Map::new();
    for (keys, f) in &figs {
        println!(
            "{:>12} {:>9.1} {:>14.1} {:>9.1} {:>9.1} {:>9.2} {:>9.0}",
            keys, f.load_s, f.checkpoint_ms, f.merge_ms, f.open_ms, f.get_us, f.file_mib
        );
        let tag = if *keys == args.small {
            "small"
        } else {
            "large"
        };
        report.insert(format!("keys_{tag}"), json!(keys));
        report.insert(format!("checkpoint_ms_{tag}"), json!(r2(f.checkpoint_ms)));
        report.insert(format!("merge_ms_{tag}"), json!(r2(f.merge_ms)));
        report.insert(format!("open_ms_{tag}"), json!(r2(f.open_ms)));
        report.insert(format!("get_us_{tag}"), json!(r2(f.get_us)));
        report.insert(format!("load_s_{tag}"), json!(r2(f.load_s)));
        report.insert(format!("file_mib_{tag}"), json!(r2(f.file_mib)));
    }
    let ratio = figs[1].1.checkpoint_ms / figs[0].1.checkpoint_ms.max(1e-9);
    println!("targets:");
    let met = check(
        "checkpoint_ms_large / checkpoint_ms_small",
        ratio,
        "<=",
        2.0,
    );
    report.insert("checkpoint_ratio".into(), json!(r2(ratio)));
    report.insert(
        "open_ratio".into(),
        json!(r2(figs[1].1.open_ms / figs[0].1.open_ms.max(1e-9))),
    );
    report.insert("updates".into(), json!(args.updates));
    report.insert("targets_met".into(), json!({ "checkpoint_ratio": met }));
    if let Some(path) = &args.json {
        write_json(path, &serde_json::Value::Object(report))?;
    }
    Ok(())
}
