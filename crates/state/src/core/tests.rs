//! Unit tests of segments, twins, diffs, MIPs and the codec together.

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::core::codec::{decode_diff, decode_image, encode_diff, encode_image};
use crate::core::error::StateError;
use crate::core::mip::{BlockRef, Mip, SegUrl};
use crate::core::record::Typed;
use crate::core::segment::{check_consistent, Diff, DiffOp, SegLimits, Segment};
use crate::core::twin::{collect, Twins, Writer};
use crate::core::types::{PrimKind, TypeDesc, Unit};

crate::state_record! {
    #[derive(Debug, Clone, PartialEq)]
    pub struct Rec { pub id: u64, pub score: f64, pub tags: [i16; 3], pub label: String }
}

crate::state_record! {
    #[derive(Debug, Clone, PartialEq)]
    struct Node { value: i32, next: Option<Mip> }
}

fn url(p: &str) -> SegUrl {
    SegUrl {
        node: "1".into(),
        path: p.into(),
    }
}

fn rec(i: u64) -> Rec {
    Rec {
        id: i,
        score: i as f64 / 2.0,
        tags: [1, 2, i as i16],
        label: format!("r{i}"),
    }
}

/// A segment with `n` records in one named array block plus a scalar block.
fn seeded(n: usize) -> (Segment, u32) {
    let mut seg = Segment::new(url("s"), SegLimits::default());
    let mut tw = Twins::new(&seg);
    let mut w = Writer::new(&mut seg, &mut tw).unwrap();
    let ty = TypeDesc::Array {
        elem: Box::new(Rec::desc()),
        len: n as u32,
    };
    let b = w.alloc_zeroed(Some("recs"), ty).unwrap();
    for i in 0..n {
        w.write_at(&BlockRef::Serial(b), (i as u64) * 6, &rec(i as u64))
            .unwrap();
    }
    w.alloc(Some("count"), &(n as u64)).unwrap();
    let d = collect(&mut seg, tw);
    assert_eq!(d.base, 0);
    assert_eq!(seg.version(), 1);
    (seg, b)
}

#[test]
fn native_values_round_trip_through_blocks() {
    let (seg, b) = seeded(10);
    assert_eq!(Rec::desc().units(), 6);
    for i in 0..10u64 {
        assert_eq!(
            seg.read_at::<Rec>(&BlockRef::Serial(b), i * 6).unwrap(),
            rec(i)
        );
    }
    assert_eq!(
        seg.read::<u64>(&BlockRef::Name("count".into())).unwrap(),
        10
    );
    assert!(matches!(
        seg.read::<i64>(&BlockRef::Name("count".into())),
        Err(StateError::TypeMismatch { .. })
    ));
    assert!(matches!(
        seg.read_at::<Rec>(&BlockRef::Serial(b), 1),
        Err(StateError::TypeMismatch { .. })
    ));
    assert!(matches!(
        seg.read_at::<Rec>(&BlockRef::Serial(b), 60),
        Err(StateError::OffsetOutOfRange { .. })
    ));
}

#[test]
fn a_diff_carries_only_what_changed_and_replays_exactly() {
    let (mut master, b) = seeded(1000);
    let mut replica = Segment::from_image(master.image(), SegLimits::default()).unwrap();
    assert_eq!(replica, master);

    let mut tw = Twins::new(&master);
    let mut w = Writer::new(&mut master, &mut tw).unwrap();
    w.write_at(&BlockRef::Serial(b), 6 * 500 + 1, &99.5f64)
        .unwrap();
    w.write_at(&BlockRef::Serial(b), 6 * 501, &rec(7)).unwrap();
    // Writing a value equal to the old one costs nothing in the diff.
    w.write_at(&BlockRef::Serial(b), 6 * 900, &rec(900))
        .unwrap();
    let d = collect(&mut master, tw);
    assert_eq!(d.base, 1);
    assert_eq!(d.target, 2);
    // score of 500, then the changed units of record 501 (id, score, tags[2], label).
    assert_eq!(d.units(), 5, "{d:?}");
    let bytes = encode_diff(&d);
    let back = decode_diff(&bytes, 1 << 20).unwrap();
    assert_eq!(back, d);
    replica.apply(&back).unwrap();
    assert_eq!(replica, master);
    // The same diff again no longer fits the replica's version.
    assert!(matches!(
        replica.apply(&back),
        Err(StateError::VersionMismatch { base: 1, have: 2 })
    ));
}

#[test]
fn allocation_free_and_reuse_of_names_replay() {
    let (mut master, b) = seeded(4);
    let mut replica = master.clone();
    let mut tw = Twins::new(&master);
    let mut w = Writer::new(&mut master, &mut tw).unwrap();
    w.write_at(&BlockRef::Serial(b), 0, &5u64).unwrap();
    w.free(&BlockRef::Name("count".into())).unwrap();
    let c = w.alloc(Some("count"), &-3i32).unwrap();
    let tmp = w.alloc(None, &1u8).unwrap();
    w.free(&BlockRef::Serial(tmp)).unwrap();
    let d = collect(&mut master, tw);
    replica.apply(&d).unwrap();
    assert_eq!(replica, master);
    assert_eq!(
        replica
            .read::<i32>(&BlockRef::Name("count".into()))
            .unwrap(),
        -3
    );
    assert!(c > b);
    // The temporary block's serial is spent and never reused.
    assert!(matches!(
        replica.lookup(&BlockRef::Serial(tmp)),
        Err(StateError::BlockFreed(_))
    ));
    assert!(replica.next_serial() > tmp);
}

#[test]
fn mips_resolve_across_segments_and_report_freed_or_missing_blocks() {
    let mut a = Segment::new(url("a"), SegLimits::default());
    let mut bseg = Segment::new(url("b"), SegLimits::default());
    let mut tb = Twins::new(&bseg);
    let mut wb = Writer::new(&mut bseg, &mut tb).unwrap();
    let target = wb.alloc(Some("arr"), &[10i32, 20, 30]).unwrap();
    collect(&mut bseg, tb);
    let m = bseg.mip(target, 2).unwrap();
    assert_eq!(m.to_string(), format!("weft://1/b#{target}#2"));

    let mut ta = Twins::new(&a);
    let mut wa = Writer::new(&mut a, &mut ta).unwrap();
    let n = wa
        .alloc(
            Some("head"),
            &Node {
                value: 1,
                next: Some(m.clone()),
            },
        )
        .unwrap();
    collect(&mut a, ta);

    // Follow the pointer stored in a into b.
    let node: Node = a.read(&BlockRef::Serial(n)).unwrap();
    let next = node.next.unwrap();
    let text: Mip = next.to_string().parse().unwrap();
    assert_eq!(bseg.unit(&text).unwrap(), &Unit::I32(30));
    // A MIP for one segment does not resolve in another.
    assert!(matches!(a.resolve(&text), Err(StateError::BadAddress(_))));
    // Offsets count units, not bytes.
    let past = Mip {
        offset: 3,
        ..text.clone()
    };
    assert!(matches!(
        bseg.resolve(&past),
        Err(StateError::OffsetOutOfRange { units: 3, .. })
    ));
    // By name works as well.
    let named: Mip = "weft://1/b#arr#1".parse().unwrap();
    assert_eq!(bseg.unit(&named).unwrap(), &Unit::I32(20));
    let missing: Mip = "weft://1/b#nope#0".parse().unwrap();
    assert!(matches!(
        bseg.resolve(&missing),
        Err(StateError::NoSuchBlock(_))
    ));
    let never: Mip = "weft://1/b#999#0".parse().unwrap();
    assert!(matches!(
        bseg.resolve(&never),
        Err(StateError::NoSuchBlock(_))
    ));
    // Free the target: the MIP dangles with a clear status.
    let mut tb = Twins::new(&bseg);
    Writer::new(&mut bseg, &mut tb)
        .unwrap()
        .free(&BlockRef::Serial(target))
        .unwrap();
    collect(&mut bseg, tb);
    assert!(matches!(bseg.resolve(&text), Err(StateError::BlockFreed(s)) if s == target));
    assert_eq!(
        StateError::BlockFreed(target).status(),
        weft_wire::status::Status::AddrError
    );
}

fn assert_refused(seg: &Segment, d: &Diff) -> StateError {
    let mut copy = seg.clone();
    let e = copy.apply(d).expect_err("a malformed diff must be refused");
    assert_eq!(&copy, seg, "a refused diff changed the segment");
    e
}

#[test]
fn malformed_diffs_are_refused_and_leave_the_segment_untouched() {
    let (seg, b) = seeded(4);
    let v = seg.version();
    let mk = |ops: Vec<DiffOp>| Diff {
        base: v,
        target: v + 1,
        deps: BTreeMap::new(),
        next_serial: 0,
        ops,
    };
    let w = |start: u64, units: Vec<Unit>| DiffOp::Write {
        serial: b,
        start,
        units,
    };
    // A valid op first, so refusing must undo nothing because nothing was done.
    let good = w(0, vec![Unit::U64(77)]);
    let cases = vec![
        mk(vec![good.clone(), w(0, vec![Unit::I64(1)])]),
        mk(vec![
            good.clone(),
            w(23, vec![Unit::Str("x".into()), Unit::U64(1)]),
        ]),
        mk(vec![good.clone(), w(24, vec![Unit::U64(1)])]),
        mk(vec![good.clone(), w(u64::MAX, vec![Unit::U64(1)])]),
        mk(vec![good.clone(), w(0, vec![])]),
        mk(vec![
            good.clone(),
            DiffOp::Write {
                serial: 99,
                start: 0,
                units: vec![Unit::U64(1)],
            },
        ]),
        mk(vec![good.clone(), DiffOp::Free { serial: 99 }]),
        mk(vec![DiffOp::Free { serial: b }, good.clone()]),
        mk(vec![DiffOp::Alloc {
            serial: b,
            name: None,
            ty: Arc::new(TypeDesc::Prim(PrimKind::U8)),
            data: vec![Unit::U8(1)],
        }]),
        mk(vec![DiffOp::Alloc {
            serial: 50,
            name: Some("count".into()),
            ty: Arc::new(TypeDesc::Prim(PrimKind::U8)),
            data: vec![Unit::U8(1)],
        }]),
        mk(vec![DiffOp::Alloc {
            serial: 50,
            name: None,
            ty: Arc::new(TypeDesc::Prim(PrimKind::U8)),
            data: vec![Unit::U8(1), Unit::U8(2)],
        }]),
        mk(vec![w(5, vec![Unit::Str("x".repeat(5000))])]),
        Diff {
            base: v,
            target: v,
            deps: BTreeMap::new(),
            next_serial: 0,
            ops: vec![good.clone()],
        },
        Diff {
            base: v + 1,
            target: v + 2,
            deps: BTreeMap::new(),
            next_serial: 0,
            ops: vec![good.clone()],
        },
    ];
    for d in &cases {
        let e = assert_refused(&seg, d);
        assert!(
            matches!(
                e,
                StateError::BadDiff(_)
                    | StateError::NameInUse(_)
                    | StateError::VersionMismatch { .. }
                    | StateError::BadType(_)
            ),
            "{d:?} -> {e:?}"
        );
    }
}

#[test]
fn limits_give_statuses() {
    let lim = SegLimits {
        max_units: 10,
        max_blocks: 2,
        max_diff_units: 8,
        ..SegLimits::default()
    };
    let mut seg = Segment::new(url("l"), lim);
    let mut tw = Twins::new(&seg);
    let mut w = Writer::new(&mut seg, &mut tw).unwrap();
    w.alloc(None, &[0u8; 6]).unwrap();
    assert!(matches!(
        w.alloc(None, &[0u8; 5]),
        Err(StateError::LimitExceeded(_))
    ));
    w.alloc(None, &[0u8; 2]).unwrap();
    assert!(matches!(
        w.alloc(None, &0u8),
        Err(StateError::LimitExceeded(_))
    ));
    assert!(matches!(
        w.alloc(None, &[0u8; 9]),
        Err(StateError::LimitExceeded(_))
    ));
    let d = collect(&mut seg, tw);
    // 8 units in one diff is the limit; a replica with a smaller diff limit refuses it.
    let small = SegLimits {
        max_diff_units: 7,
        ..lim
    };
    let mut r = Segment::new(url("l"), small);
    assert!(matches!(r.apply(&d), Err(StateError::LimitExceeded(_))));
    assert_eq!(
        StateError::LimitExceeded(String::new()).status(),
        weft_wire::status::Status::TooLarge
    );
}

#[test]
fn images_round_trip_through_the_wire_form() {
    let (seg, _) = seeded(20);
    let bytes = encode_image(&seg.image());
    assert_eq!(
        bytes,
        crate::core::codec::encode_segment(&seg),
        "one form, two encoders"
    );
    let img = decode_image(&bytes, 1 << 20).unwrap();
    let back = Segment::from_image(img, SegLimits::default()).unwrap();
    assert_eq!(back, seg);
    assert!(matches!(
        decode_image(&bytes, 10),
        Err(StateError::LimitExceeded(_))
    ));
    assert!(decode_image(&bytes[..bytes.len() - 1], 1 << 20).is_err());
    let mut trailing = bytes.clone();
    trailing.push(0);
    assert!(decode_image(&trailing, 1 << 20).is_err());
}

#[test]
fn cross_segment_inconsistency_is_detected() {
    // A writer had segment a at version 5 in use when it made b's version.
    let mut b = Segment::new(url("b"), SegLimits::default());
    let mut tw = Twins::new(&b);
    tw.depend_on(url("a"), 5);
    Writer::new(&mut b, &mut tw)
        .unwrap()
        .alloc(None, &1u32)
        .unwrap();
    let d = collect(&mut b, tw);
    assert_eq!(d.deps.get(&url("a")), Some(&5));
    let mut in_use = BTreeMap::new();
    in_use.insert(url("a"), 4u64);
    let e = check_consistent(&in_use, &b).unwrap_err();
    assert!(matches!(e, StateError::Inconsistent(_)));
    assert_eq!(e.status(), weft_wire::status::Status::Mismatch);
    in_use.insert(url("a"), 5);
    check_consistent(&in_use, &b).unwrap();
    // The dependency survives the wire and replay.
    let mut r = Segment::new(url("b"), SegLimits::default());
    r.apply(&decode_diff(&encode_diff(&d), 1 << 20).unwrap())
        .unwrap();
    assert_eq!(r.deps(), b.deps());
}

#[test]
fn twins_copy_only_touched_chunks() {
    let (mut seg, b) = seeded(2000);
    let mut tw = Twins::new(&seg);
    let mut w = Writer::new(&mut seg, &mut tw).unwrap();
    w.write_at(&BlockRef::Serial(b), 6 * 1000, &7u64).unwrap();
    assert_eq!(tw.twinned_units(), crate::core::twin::CHUNK_UNITS);
    let d = collect(&mut seg, tw);
    assert_eq!(d.units(), 1);
    // Writing after collect without new twins is refused.
    let mut stale = Twins::default();
    assert!(Writer::new(&mut seg, &mut stale).is_err());
}

#[test]
fn the_wire_example_of_docs_state_md_holds() {
    let d = Diff {
        base: 1,
        target: 2,
        deps: BTreeMap::new(),
        next_serial: 0,
        ops: vec![DiffOp::Write {
            serial: 3,
            start: 5,
            units: vec![Unit::I32(-2)],
        }],
    };
    let bytes = encode_diff(&d);
    assert_eq!(bytes, [1, 2, 0, 0, 0, 1, 2, 3, 5, 1, 3, 3]);
    assert_eq!(decode_diff(&bytes, 64).unwrap(), d);
}
