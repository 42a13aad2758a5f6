//! CPU-only cost of the pieces of a Fig. 3 refresh (no network): applying
//! an x% diff from its wire bytes to a reader's copy, against postcard
//! encode + decode of the same records natively. `cargo run --release -p
//! weft-state --example apply_cost [PCT]`.

use std::time::Instant;

use serde::{Deserialize, Serialize};
use weft_state::core::apply::apply_diff_bytes;
use weft_state::core::mip::BlockRef;
use weft_state::{collect, encode_diff, SegLimits, Segment, Twins, TypeDesc, Typed, Writer};

weft_state::state_record! {
    #[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
    pub struct Rec { pub id: u64, pub a: i64, pub b: f64, pub c: u32 }
}

fn main() {
    let pct: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(100);
    let n = 32768usize;
    let url: weft_state::SegUrl = "weft://1/bench".parse().expect("url");
    let mut seg = Segment::new(url, SegLimits::default());
    let mut tw = Twins::new(&seg);
    {
        let mut w = Writer::new(&mut seg, &mut tw).expect("writer");
        let ty = TypeDesc::Array {
            elem: Box::new(Rec::desc()),
            len: n as u32,
        };
        w.alloc_zeroed(Some("records"), ty).expect("alloc");
    }
    let _ = collect(&mut seg, tw);
    let base = seg.clone();
    let mut tw = Twins::new(&seg);
    let step = 100 / pct;
    let t = Instant::now();
    {
        let mut w = Writer::new(&mut seg, &mut tw).expect("writer");
        for i in (0..n).step_by(step) {
            let r = Rec {
                id: 0,
                a: 7,
                b: 7.0,
                c: 7,
            };
            w.write_at(&BlockRef::Name("records".into()), (i * 4) as u64, &r)
                .expect("write");
        }
    }
    let write = t.elapsed();
    let t = Instant::now();
    let d = collect(&mut seg, tw);
    let coll = t.elapsed();
    let t = Instant::now();
    let bytes = encode_diff(&d);
    let enc = t.elapsed();
    println!(
        "{pct}%: {} ops, {} bytes; write {:?} collect {:?} encode {:?}",
        d.ops.len(),
        bytes.len(),
        write,
        coll,
        enc
    );
    let recs: Vec<Rec> = (0..n)
        .map(|i| Rec {
            id: i as u64,
            a: i as i64,
            b: i as f64,
            c: i as u32,
        })
        .collect();
    let (mut ap, mut cl, mut native) = (Vec::new(), Vec::new(), Vec::new());
    let mut copy = base.clone();
    for _ in 0..21 {
        let t = Instant::now();
        let c2 = base.clone();
        cl.push(t.elapsed());
        copy = c2;
        let t = Instant::now();
        apply_diff_bytes(&mut copy, &bytes, usize::MAX).expect("apply");
        ap.push(t.elapsed());
        let t = Instant::now();
        let b = postcard::to_allocvec(&recs).expect("enc");
        let back: Vec<Rec> = postcard::from_bytes(&b).expect("dec");
        native.push(t.elapsed());
        assert_eq!(back.len(), n);
    }
    drop(copy);
    // The same apply to a copy out of the caches (as in the benchmark, where
    // the reader's copy was last touched one refresh ago): 64 MiB streamed
    // between the clone and the apply.
    let mut cold = Vec::new();
    let mut sweep = vec![0u8; 64 << 20];
    for r in 0..21u8 {
        let mut c2 = base.clone();
        sweep
            .iter_mut()
            .step_by(64)
            .for_each(|b| *b = b.wrapping_add(r));
        let t = Instant::now();
        apply_diff_bytes(&mut c2, &bytes, usize::MAX).expect("apply");
        cold.push(t.elapsed());
    }
    std::hint::black_box(&sweep);
    for v in [&mut ap, &mut cl, &mut native, &mut cold] {
        v.sort();
    }
    println!(
        "  min/median of 21: apply to a copy out of the caches {:?}/{:?}",
        cold[0], cold[10]
    );
    println!(
        "  min/median of 21: apply from bytes {:?}/{:?}; clone of the segment {:?}/{:?}; native encode+decode {:?}/{:?}",
        ap[0], ap[10], cl[0], cl[10], native[0], native[10]
    );
}
