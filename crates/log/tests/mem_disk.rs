//! The log over the simulated disk ([`MemDisk`]): what was forced survives a crash, a failed
//! fdatasync poisons the log, and the real recovery code cuts a torn tail, for many seeded
//! crash choices.

use rand::{Rng, SeedableRng};
use weft_log::{DiskFault, Log, LogConfig, LogError, MemDisk, RecordTag};

fn config(disk: &MemDisk) -> LogConfig {
    LogConfig::new("/node/log")
        .durability(disk.durability())
        .segment_size(4096)
        .max_record_size(512)
        .max_buffered_bytes(1 << 16)
        .write_behind_bytes(1 << 16)
        .group_commit_max_delay(std::time::Duration::ZERO)
}

#[test]
fn forced_records_survive_every_crash_and_a_failed_sync_poisons() {
    for seed in 0..40u64 {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let disk = MemDisk::new();
        // Every record appended so far in order, and how many of them a force confirmed.
        let mut written: Vec<Vec<u8>> = Vec::new();
        let mut must = 0;
        for round in 0..4 {
            let (log, rec) =
                Log::open(config(&disk)).unwrap_or_else(|e| panic!("seed {seed}: {e}"));
            let got: Vec<Vec<u8>> = rec.records.iter().map(|r| r.payload.to_vec()).collect();
            assert!(
                got.len() >= must && got[..] == written[..got.len()],
                "seed {seed} round {round}: recovered {} records, {must} were forced",
                got.len()
            );
            written = got;
            must = written.len();
            if rng.gen_bool(0.5) {
                disk.inject(DiskFault::FailFileSync(rng.gen_range(1..4)));
            }
            for i in 0..rng.gen_range(1..60) {
                let len = rng.gen_range(1..300);
                let payload = vec![(round * 64 + i) as u8; len];
                let Ok(lsn) = log.append(RecordTag(7), &payload) else {
                    break;
                };
                written.push(payload);
                if rng.gen_bool(0.3) {
                    match log.force_blocking(lsn) {
                        Ok(()) => must = written.len(),
                        Err(e) => {
                            assert!(matches!(e, LogError::Poisoned { .. }), "seed {seed}: {e}");
                            assert!(log.append(RecordTag(7), b"x").is_err());
                            break;
                        }
                    }
                }
            }
            log.crash();
            disk.crash(&mut |n| rng.gen_range(0..n));
        }
    }
}

#[test]
fn a_torn_tail_is_cut_by_recovery() {
    let mut torn = 0;
    for seed in 0..200u64 {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let disk = MemDisk::new();
        let (log, _) = Log::open(config(&disk)).unwrap();
        let first = log.append(RecordTag(1), &[1; 100]).unwrap();
        log.force_blocking(first).unwrap();
        disk.inject(DiskFault::FailFileSync(1));
        let second = log.append(RecordTag(1), &[2; 200]).unwrap();
        assert!(log.force_blocking(second).is_err());
        log.crash();
        torn += disk.crash(&mut |n| rng.gen_range(0..n)).torn_writes;
        let (_log, rec) = Log::open(config(&disk)).unwrap();
        assert!(
            !rec.records.is_empty(),
            "seed {seed}: the forced record is gone"
        );
        assert_eq!(&rec.records[0].payload[..], &[1; 100][..], "seed {seed}");
        assert!(rec.records.len() <= 2);
        if rec.records.len() == 1 {
            assert_eq!(
                rec.end_lsn.get(),
                first.get() + weft_log::encoded_len(100) as u64
            );
        }
    }
    assert!(torn > 0, "200 seeds never tore the unsynced write");
}
