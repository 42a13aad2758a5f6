//! Property tests: random records round-trip through append and reopen, and cutting or
//! damaging the tail at any byte recovers a prefix of what was written — never a corrupt
//! record, never a panic. proptest prints the failing input and persists its seed.

mod common;

use std::path::Path;

use common::*;
use proptest::prelude::*;
use weft_log::{Log, LogConfig, LogError, Lsn, RecordTag};

type Written = Vec<(Lsn, RecordTag, Vec<u8>)>;

fn config(dir: &Path, preallocate: bool) -> LogConfig {
    LogConfig::new(dir)
        .segment_size(2048)
        .max_record_size(700)
        .preallocate(preallocate)
}

/// Appends the records, forcing after the ones marked, then closes.
fn write(config: &LogConfig, records: &[(u16, Vec<u8>, bool)]) -> Written {
    let (log, _) = Log::open(config.clone()).unwrap();
    let mut written = Vec::new();
    for (tag, payload, force) in records {
        let lsn = log.append(RecordTag(*tag), payload).unwrap();
        if *force {
            log.force_blocking(lsn).unwrap();
        }
        written.push((lsn, RecordTag(*tag), payload.clone()));
    }
    log.close().unwrap();
    written
}

/// Checks that the recovered records are exactly a prefix of `written`; returns its length.
fn assert_prefix(got: &[weft_log::LogRecord], written: &Written) -> Result<usize, TestCaseError> {
    prop_assert!(got.len() <= written.len());
    for (g, w) in got.iter().zip(written) {
        prop_assert_eq!(g.lsn, w.0);
        prop_assert_eq!(g.tag, w.1);
        prop_assert_eq!(&g.payload[..], &w.2[..]);
    }
    Ok(got.len())
}

fn records() -> impl Strategy<Value = Vec<(u16, Vec<u8>, bool)>> {
    prop::collection::vec(
        (
            any::<u16>(),
            prop_oneof![
                prop::collection::vec(any::<u8>(), 0..16),
                prop::collection::vec(any::<u8>(), 0..700),
            ],
            prop::bool::weighted(0.2),
        ),
        1..40,
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(40))]

    #[test]
    fn random_records_round_trip(recs in records(), preallocate in any::<bool>()) {
        let dir = tempfile::tempdir().unwrap();
        let cfg = config(dir.path(), preallocate);
        let written = write(&cfg, &recs);
        let (log, rec) = Log::open(cfg.clone()).unwrap();
        prop_assert_eq!(&rec.tail_error, &None);
        prop_assert_eq!(assert_prefix(&rec.records, &written)?, written.len());
        // And once more after appending on top of the recovered log.
        let more = log.append(RecordTag(7), b"more").unwrap();
        prop_assert!(more > written.last().unwrap().0);
        drop(log);
        let (_log, rec) = Log::open(cfg).unwrap();
        prop_assert_eq!(rec.records.len(), written.len() + 1);
    }

    #[test]
    fn cutting_the_last_segment_anywhere_recovers_a_prefix(
        recs in records(),
        preallocate in any::<bool>(),
        cut_fraction in 0.0f64..=1.0,
    ) {
        let dir = tempfile::tempdir().unwrap();
        let cfg = config(dir.path(), preallocate);
        let written = write(&cfg, &recs);
        let bases = segment_bases(dir.path());
        let last = *bases.last().unwrap();
        let path = segment_path(dir.path(), last);
        let end_in_last = {
            // Bytes of the last segment that hold data (its header plus records).
            let (_log, rec) = Log::open(cfg.clone()).unwrap();
            rec.end_lsn.get() - last.get()
        };
        let cut = (end_in_last as f64 * cut_fraction) as u64;
        truncate_file(&path, cut);

        let (log, rec) = Log::open(cfg.clone()).unwrap();
        let kept = assert_prefix(&rec.records, &written)?;
        // Everything in earlier segments survives; whole records before the cut survive.
        let whole_before_cut = written
            .iter()
            .filter(|w| w.0 < last || w.0.get() + weft_log::encoded_len(w.2.len()) as u64 <= last.get() + cut)
            .count();
        prop_assert_eq!(kept, whole_before_cut, "cut at {} of {}", cut, end_in_last);
        // A cut exactly between records looks like a clean end; anything else is reported.
        if kept == written.len() && cut >= weft_log::SEGMENT_HEADER_LEN {
            prop_assert_eq!(&rec.tail_error, &None);
        }

        // Appends continue from the cut and survive another reopen.
        let next = log.append(RecordTag(1), b"after the cut").unwrap();
        log.force_blocking(next).unwrap();
        drop(log);
        let (_log, again) = Log::open(cfg).unwrap();
        prop_assert_eq!(&again.tail_error, &None);
        prop_assert_eq!(again.records.len(), kept + 1);
        prop_assert_eq!(again.records.last().unwrap().lsn, next);
    }

    #[test]
    fn flipping_any_byte_recovers_a_prefix_or_refuses(
        recs in records(),
        position_fraction in 0.0f64..1.0,
        mask in 1u8..=255,
    ) {
        let dir = tempfile::tempdir().unwrap();
        let cfg = config(dir.path(), true);
        let written = write(&cfg, &recs);
        let end = {
            let (_log, rec) = Log::open(cfg.clone()).unwrap();
            rec.end_lsn.get()
        };
        // A byte anywhere in the written log stream (headers included).
        let pos = Lsn((end as f64 * position_fraction) as u64);
        let base = *segment_bases(dir.path()).iter().rev().find(|b| **b <= pos).unwrap();
        flip_byte(&segment_path(dir.path(), base), pos.get() - base.get(), mask);

        match Log::open(cfg) {
            Ok((_log, rec)) => {
                let kept = assert_prefix(&rec.records, &written)?;
                // Records wholly before the damaged byte survive.
                let intact = written
                    .iter()
                    .filter(|w| w.0.get() + weft_log::encoded_len(w.2.len()) as u64 <= pos.get())
                    .count();
                prop_assert!(kept >= intact.min(written.len()), "kept {} intact {}", kept, intact);
            }
            // Only damage to the header of the first segment, in front of records, is refused.
            Err(LogError::Corrupt { lsn, .. }) => {
                prop_assert_eq!(lsn, Lsn::ZERO);
                prop_assert!(pos.get() < weft_log::SEGMENT_HEADER_LEN);
            }
            Err(e) => prop_assert!(false, "unexpected error {}", e),
        }
    }
}
