//! `weft bench fs`: transactional files against plain files, in one run
//! (QuickSilver's Table 2): create 100 small files in one transaction and in
//! one transaction per file, against plain writes with and without an
//! fsync per file; read 256 KiB files inside a transaction against plain
//! reads.
//!
//! Owns the measuring loops and the JSON keys `create100_*` and
//! `read256k_*`. Must never compare figures taken in different runs.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use serde_json::{json, Map, Value};
use weft::Node;
use weft_fs::{Fs, FsConfig, ReadMode, VolumeRef};

use super::{check, r2, write_json, Latency};

/// Flags of `weft bench fs`.
#[derive(clap::Args, Debug)]
pub struct FsArgs {
    /// Write the results as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Directory on the disk to measure (a temporary directory under it is
    /// used and removed). Default: the current directory.
    #[arg(long, default_value = ".")]
    pub dir: PathBuf,
    /// Size of each small file, in bytes.
    #[arg(long, default_value_t = 1024)]
    pub file_bytes: usize,
    /// Rounds of each create measurement (the median is reported).
    #[arg(long, default_value_t = 5)]
    pub rounds: usize,
    /// Reads of the 256 KiB file per configuration.
    #[arg(long, default_value_t = 400)]
    pub reads: usize,
}

/// Runs `weft bench fs`.
pub async fn run(args: FsArgs) -> anyhow::Result<()> {
    let tmp = tempfile::Builder::new()
        .prefix(".weft-bench-fs-")
        .tempdir_in(&args.dir)?;
    let mut out = Map::new();
    measure_files(&args, tmp.path(), &mut out).await?;
    println!("weft bench fs (machine load is not controlled: compare ratios within this run)");
    for (k, v) in &out {
        println!("  {k:<36} {v}");
    }
    println!("targets:");
    let f = |k: &str| out.get(k).and_then(Value::as_f64).unwrap_or(f64::NAN);
    let mut ok = true;
    ok &= check(
        "create100_one_tx_ms / create100_plain_fsync_ms",
        f("create100_one_tx_ms") / f("create100_plain_fsync_ms"),
        "<=",
        0.5,
    );
    ok &= check(
        "create100_one_tx_ms / create100_plain_ms",
        f("create100_one_tx_ms") / f("create100_plain_ms"),
        "<=",
        2.4,
    );
    ok &= check(
        "read256k_tx_us / read256k_plain_us",
        f("read256k_tx_us") / f("read256k_plain_us"),
        "<=",
        1.05,
    );
    out.insert("fs_targets_met".into(), json!(ok));
    if let Some(p) = &args.json {
        write_json(p, &Value::Object(out))?;
    }
    Ok(())
}

/// Measures the `create100_*` and `read256k_*` figures under `base` and
/// adds them to `out`.
///
/// Fails when the node or a file operation fails.
pub async fn measure_files(
    args: &FsArgs,
    base: &Path,
    out: &mut Map<String, Value>,
) -> anyhow::Result<()> {
    let vol = base.join("vol");
    let plain = base.join("plain");
    std::fs::create_dir_all(&vol)?;
    std::fs::create_dir_all(&plain)?;
    let fs = Fs::new(FsConfig::default().volume("v", &vol))?;
    let node = Node::builder(1)
        .data_dir(base.join("node"))
        .plugin(Arc::new(fs.clone()))
        .start()
        .await?;
    let v = fs.local("v")?;
    let data = Bytes::from(vec![b'x'; args.file_bytes]);
    let pb = super::progress("create 100 files");
    let rounds = args.rounds.max(1);
    let (mut one, mut one_applied, mut per, mut fsync, mut nosync) =
        (vec![], vec![], vec![], vec![], vec![]);
    for round in 0..rounds {
        // One transaction for the lot: one log force.
        let dir = format!("one{round}");
        let t = Instant::now();
        let tx = node.begin();
        let c = tx.context().clone();
        v.mkdir(&c, &dir).await?;
        for i in 0..100 {
            let p = format!("{dir}/f{i}");
            v.create(&c, &p, true).await?;
            v.write(&c, &p, 0, data.clone()).await?;
        }
        tx.commit().await?;
        one.push(ms(t.elapsed()));
        applied(&fs).await;
        one_applied.push(ms(t.elapsed()));
        // One transaction per file.
        let dir = format!("per{round}");
        let tx = node.begin();
        v.mkdir(tx.context(), &dir).await?;
        tx.commit().await?;
        applied(&fs).await;
        let t = Instant::now();
        for i in 0..100 {
            let tx = node.begin();
            let c = tx.context().clone();
            let p = format!("{dir}/f{i}");
            v.create(&c, &p, true).await?;
            v.write(&c, &p, 0, data.clone()).await?;
            tx.commit().await?;
        }
        per.push(ms(t.elapsed()));
        applied(&fs).await;
        // Plain files, an fsync per file, then none.
        let d = plain.join(format!("fsync{round}"));
        std::fs::create_dir_all(&d)?;
        let t = Instant::now();
        for i in 0..100 {
            use std::io::Write;
            let mut f = std::fs::File::create(d.join(format!("f{i}")))?;
            f.write_all(&data)?;
            f.sync_all()?;
        }
        fsync.push(ms(t.elapsed()));
        let d = plain.join(format!("nosync{round}"));
        std::fs::create_dir_all(&d)?;
        let t = Instant::now();
        for i in 0..100 {
            std::fs::write(d.join(format!("f{i}")), &data)?;
        }
        nosync.push(ms(t.elapsed()));
    }
    pb.set_message("read 256 KiB files");
    let file = vol.join("r256k");
    std::fs::write(&file, vec![7u8; 256 << 10])?;
    let (tx_read, tx_whole, plain_read) = reads(&node, &v, &file, args.reads).await?;
    pb.finish_and_clear();
    node.shutdown().await;
    out.insert("create100_one_tx_ms".into(), json!(median(&mut one)));
    out.insert(
        "create100_one_tx_applied_ms".into(),
        json!(median(&mut one_applied)),
    );
    out.insert("create100_per_file_tx_ms".into(), json!(median(&mut per)));
    out.insert("create100_plain_fsync_ms".into(), json!(median(&mut fsync)));
    out.insert("create100_plain_ms".into(), json!(median(&mut nosync)));
    out.insert("read256k_tx_us".into(), json!(tx_read.p50()));
    out.insert("read256k_tx_begin_commit_us".into(), json!(tx_whole.p50()));
    out.insert("read256k_plain_us".into(), json!(plain_read.p50()));
    out.insert("create100_file_bytes".into(), json!(args.file_bytes));
    Ok(())
}

/// Reads of a 256 KiB file: inside one transaction (each read takes and
/// releases its degree-2 lock), in a transaction of its own each (begin,
/// read, read-only commit), and plainly; interleaved so that load hits all
/// three alike.
async fn reads(
    node: &Node,
    v: &VolumeRef,
    file: &Path,
    n: usize,
) -> anyhow::Result<(Latency, Latency, Latency)> {
    let (mut inside, mut whole, mut plain) =
        (Latency::default(), Latency::default(), Latency::default());
    let tx = node.begin();
    let c = tx.context().clone();
    let len = 256u64 << 10;
    for _ in 0..n.max(1) {
        let t = Instant::now();
        let d = v.read(&c, "r256k", 0, len, ReadMode::Degree2).await?;
        inside.record(t.elapsed());
        anyhow::ensure!(d.len() as u64 == len, "short read");
        let t = Instant::now();
        let d = std::fs::read(file)?;
        plain.record(t.elapsed());
        anyhow::ensure!(d.len() as u64 == len, "short read");
        let t = Instant::now();
        let one = node.begin();
        let d = v
            .read(one.context(), "r256k", 0, len, ReadMode::Degree2)
            .await?;
        one.commit().await?;
        whole.record(t.elapsed());
        anyhow::ensure!(d.len() as u64 == len, "short read");
    }
    tx.commit().await?;
    Ok((inside, whole, plain))
}

/// Waits until every commit is applied (phase two runs after commit
/// returns).
async fn applied(fs: &Fs) {
    while fs.volumes().any(|v| v.stats().prepared > 0) {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    r2(v[v.len() / 2])
}
