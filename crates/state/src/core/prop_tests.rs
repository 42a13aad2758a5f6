//! Property tests: random typed edits → diff → wire → apply round-trips, and
//! malformed diffs are refused with the replica untouched. proptest prints
//! the failing case and persists its seed.

use proptest::prelude::*;

use crate::core::apply::apply_diff_bytes;
use crate::core::codec::{decode_diff, encode_diff};
use crate::core::mip::{BlockRef, SegUrl};
use crate::core::segment::{Ahead, Diff, DiffOp, SegLimits, Segment};
use crate::core::twin::{collect, Twins, Writer};
use crate::core::types::{Field, PrimKind, TypeDesc, Unit};

const KINDS: [PrimKind; 13] = [
    PrimKind::Bool,
    PrimKind::I8,
    PrimKind::I16,
    PrimKind::I32,
    PrimKind::I64,
    PrimKind::U8,
    PrimKind::U16,
    PrimKind::U32,
    PrimKind::U64,
    PrimKind::F32,
    PrimKind::F64,
    PrimKind::Str,
    PrimKind::Mip,
];

fn types() -> Vec<TypeDesc> {
    let rec = TypeDesc::Record {
        name: "R".into(),
        fields: vec![
            Field {
                name: "a".into(),
                ty: TypeDesc::Prim(PrimKind::I64),
            },
            Field {
                name: "b".into(),
                ty: TypeDesc::Prim(PrimKind::Str),
            },
            Field {
                name: "c".into(),
                ty: TypeDesc::Array {
                    elem: Box::new(TypeDesc::Prim(PrimKind::F32)),
                    len: 3,
                },
            },
            Field {
                name: "p".into(),
                ty: TypeDesc::Prim(PrimKind::Mip),
            },
        ],
    };
    let mut v: Vec<TypeDesc> = KINDS.iter().map(|k| TypeDesc::Prim(*k)).collect();
    v.push(TypeDesc::Array {
        elem: Box::new(TypeDesc::Prim(PrimKind::U16)),
        len: 700,
    });
    v.push(TypeDesc::Array {
        elem: Box::new(rec.clone()),
        len: 90,
    });
    v.push(rec);
    v
}

/// A value of `kind` derived from `seed`.
fn unit(kind: PrimKind, seed: u64) -> Unit {
    match kind {
        PrimKind::Bool => Unit::Bool(seed & 1 == 1),
        PrimKind::I8 => Unit::I8(seed as i8),
        PrimKind::I16 => Unit::I16(seed as i16),
        PrimKind::I32 => Unit::I32(seed as i32),
        PrimKind::I64 => Unit::I64(seed as i64),
        PrimKind::U8 => Unit::U8(seed as u8),
        PrimKind::U16 => Unit::U16(seed as u16),
        PrimKind::U32 => Unit::U32(seed as u32),
        PrimKind::U64 => Unit::U64(seed),
        PrimKind::F32 => Unit::F32(f32::from_bits(seed as u32)),
        PrimKind::F64 => Unit::F64(f64::from_bits(seed)),
        PrimKind::Str => Unit::Str("s".repeat((seed % 7) as usize)),
        PrimKind::Mip => {
            if seed.is_multiple_of(3) {
                Unit::Null
            } else {
                Unit::Mip(Box::new(
                    format!("weft://n{}/p#{}#{}", seed % 5, seed % 11 + 1, seed % 13)
                        .parse()
                        .unwrap(),
                ))
            }
        }
    }
}

#[derive(Clone, Debug)]
enum Edit {
    /// Write `len` units at a point chosen by `at` in a block chosen by `block`.
    Write {
        block: usize,
        at: u64,
        len: u8,
        seed: u64,
    },
    Alloc {
        ty: usize,
        named: bool,
    },
    Free {
        block: usize,
    },
}

fn edit() -> impl Strategy<Value = Edit> {
    prop_oneof![
        6 => (any::<usize>(), any::<u64>(), 1u8..20, any::<u64>())
            .prop_map(|(block, at, len, seed)| Edit::Write { block, at, len, seed }),
        2 => (0usize..16, any::<bool>()).prop_map(|(ty, named)| Edit::Alloc { ty, named }),
        1 => any::<usize>().prop_map(|block| Edit::Free { block }),
    ]
}

/// Performs `edits` in one writer critical section and returns its diff.
fn run(seg: &mut Segment, edits: &[Edit], names: &mut u32) -> Diff {
    let tys = types();
    let mut tw = Twins::new(seg);
    let mut w = Writer::new(seg, &mut tw).unwrap();
    for e in edits {
        let live: Vec<u32> = w.segment().blocks().map(|(s, _)| s).collect();
        match e {
            Edit::Write {
                block,
                at,
                len,
                seed,
            } if !live.is_empty() => {
                let s = live[block % live.len()];
                let b = w.segment().block(&BlockRef::Serial(s)).unwrap();
                let n = b.data.len() as u64;
                let start = at % n;
                let end = (start + u64::from(*len)).min(n);
                let units: Vec<Unit> = (start..end)
                    .map(|o| unit(b.ty.kind_at(o).unwrap(), seed.wrapping_add(o)))
                    .collect();
                w.write_units(s, start, &units).unwrap();
            }
            Edit::Write { .. } => {}
            Edit::Alloc { ty, named } => {
                let name = named.then(|| {
                    *names += 1;
                    format!("b{names}")
                });
                w.alloc_zeroed(name.as_deref(), tys[ty % tys.len()].clone())
                    .unwrap();
            }
            Edit::Free { block } if !live.is_empty() => {
                w.free(&BlockRef::Serial(live[block % live.len()])).unwrap();
            }
            Edit::Free { .. } => {}
        }
    }
    collect(seg, tw)
}

/// Applies `bytes` to copies of `base` both ways, decode then apply and
/// straight from the bytes: both accept (with the same result) or both
/// refuse with the same error kind and leave the copy untouched.
fn same_both_ways(base: &Segment, bytes: &[u8]) -> Result<(), TestCaseError> {
    let mut a = base.clone();
    let old = decode_diff(bytes, 1 << 20).and_then(|d| a.apply(&d));
    let mut b = base.clone();
    let new = apply_diff_bytes(&mut b, bytes, 1 << 20);
    match (&old, &new) {
        (Ok(()), Ok(())) => prop_assert_eq!(&a, &b),
        (Err(x), Err(y)) => {
            prop_assert_eq!(
                std::mem::discriminant(x),
                std::mem::discriminant(y),
                "{} / {}",
                x,
                y
            );
            prop_assert_eq!(&b, base);
        }
        _ => prop_assert!(false, "decode+apply {:?}, from the bytes {:?}", old, new),
    }
    Ok(())
}

fn fresh() -> Segment {
    Segment::new(
        SegUrl {
            node: "1".into(),
            path: "p".into(),
        },
        SegLimits::default(),
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Several critical sections of random typed edits: each diff, through
    /// the wire form, turns a replica into the writer's copy; the chained
    /// diffs turn the oldest replica into it as well.
    #[test]
    fn random_edits_round_trip(rounds in prop::collection::vec(prop::collection::vec(edit(), 0..30), 1..5)) {
        let mut master = fresh();
        let mut replica = fresh();
        let old = fresh();
        let mut chained: Option<Diff> = None;
        let mut names = 0;
        for edits in &rounds {
            let d = run(&mut master, edits, &mut names);
            if d.target == d.base {
                prop_assert!(d.ops.is_empty());
                continue;
            }
            let bytes = encode_diff(&d);
            let back = decode_diff(&bytes, 64 << 20).unwrap();
            prop_assert_eq!(&back, &d);
            same_both_ways(&replica, &bytes)?;
            replica.apply(&back).unwrap();
            prop_assert_eq!(&replica, &master);
            match &mut chained {
                None => chained = Some(back),
                Some(c) => c.chain(&back).unwrap(),
            }
        }
        if let Some(c) = chained {
            let mut o = old.clone();
            o.apply(&c).unwrap();
            prop_assert_eq!(&o, &master);
        }
    }

    /// The home checks a transaction's diffs against the master with the
    /// earlier ones applied, without a copy of it (`check_ahead`): it
    /// accepts and refuses exactly what applying them in turn to a copy
    /// does, with the same error kind, and reaches the same version.
    #[test]
    fn checking_ahead_matches_a_tentative_copy(rounds in prop::collection::vec(prop::collection::vec(edit(), 0..20), 1..5), pick in any::<usize>(), op in any::<usize>(), how in 0u8..7, seed in any::<u64>()) {
        let mut base = fresh();
        let mut names = 0;
        let setup = vec![Edit::Alloc { ty: 14, named: true }, Edit::Alloc { ty: 15, named: false }];
        run(&mut base, &setup, &mut names);
        let mut writer = base.clone();
        let mut diffs = Vec::new();
        for edits in &rounds {
            let d = run(&mut writer, edits, &mut names);
            if d.target != d.base {
                diffs.push(d);
            }
        }
        prop_assume!(!diffs.is_empty());
        let k = pick % diffs.len();
        let d = &mut diffs[k];
        if !d.ops.is_empty() {
            let i = op % d.ops.len();
            match (&mut d.ops[i], how) {
                (DiffOp::Write { units, .. }, 0) => {
                    let at = KINDS.iter().position(|x| *x == units[0].kind()).unwrap();
                    units[0] = unit(KINDS[(at + 1 + (seed as usize % 12)) % 13], seed);
                }
                (DiffOp::Write { start, .. }, 1) => *start = u64::MAX - (seed % 4),
                (DiffOp::Write { serial, .. }, 2) | (DiffOp::Free { serial }, 2) => *serial = 10_000 + (seed as u32 % 100),
                (DiffOp::Alloc { data, .. }, 3) => data.push(Unit::Bool(true)),
                (DiffOp::Alloc { serial, .. }, 4) => *serial = 1,
                (_, 5) => d.base += 1 + seed % 3,
                _ => {}
            }
        }
        let mut copy = base.clone();
        let mut ahead = Ahead::new(&base);
        for d in &diffs {
            let a = copy.apply(d);
            let b = base.check_ahead(&mut ahead, d);
            match (&a, &b) {
                (Ok(()), Ok(())) => {}
                (Err(x), Err(y)) => prop_assert_eq!(std::mem::discriminant(x), std::mem::discriminant(y), "{} / {}", x, y),
                _ => prop_assert!(false, "copy {:?}, ahead {:?}", a, b),
            }
            prop_assert_eq!(ahead.version(), copy.version());
        }
    }

    /// A valid diff damaged in one place is refused, and the replica that
    /// refused it is exactly as before.
    #[test]
    fn damaged_diffs_are_refused(edits in prop::collection::vec(edit(), 1..30), pick in any::<usize>(), how in 0u8..6, seed in any::<u64>()) {
        let mut base = fresh();
        let mut names = 0;
        let setup = vec![Edit::Alloc { ty: 14, named: true }, Edit::Alloc { ty: 15, named: false }];
        run(&mut base, &setup, &mut names);
        let mut master = base.clone();
        let mut d = run(&mut master, &edits, &mut names);
        prop_assume!(!d.ops.is_empty());
        let i = pick % d.ops.len();
        let valid = match (&mut d.ops[i], how) {
            (DiffOp::Write { units, .. }, 0) => {
                let k = units[0].kind();
                let other = KINDS[(KINDS.iter().position(|x| *x == k).unwrap() + 1 + (seed as usize % 12)) % 13];
                units[0] = unit(other, seed);
                false
            }
            (DiffOp::Write { start, .. }, 1) => { *start = u64::MAX - (seed % 4); false }
            (DiffOp::Write { serial, .. }, 2) | (DiffOp::Free { serial }, 2) => { *serial = 10_000 + (seed as u32 % 100); false }
            (DiffOp::Alloc { data, .. }, 3) => { data.push(Unit::Bool(true)); false }
            (DiffOp::Alloc { serial, .. }, 4) => { *serial = 1; false }
            (_, 5) => { d.base += 1 + seed % 3; false }
            _ => true,
        };
        prop_assume!(!valid);
        let mut r = base.clone();
        prop_assert!(r.apply(&d).is_err());
        prop_assert_eq!(&r, &base);
        let bytes = encode_diff(&d);
        prop_assert!(apply_diff_bytes(&mut r, &bytes, 1 << 20).is_err());
        prop_assert_eq!(&r, &base);
        same_both_ways(&base, &bytes)?;
    }

    /// Random bytes or a flipped byte in a diff's wire form never panic and
    /// never half-apply: either it decodes into a diff that is refused whole,
    /// or applies whole.
    #[test]
    fn corrupt_bytes_never_half_apply(edits in prop::collection::vec(edit(), 1..20), flip in any::<usize>(), bit in 0u8..8, junk in prop::collection::vec(any::<u8>(), 0..200)) {
        let mut base = fresh();
        let mut names = 0;
        run(&mut base, &[Edit::Alloc { ty: 15, named: false }], &mut names);
        let mut master = base.clone();
        let d = run(&mut master, &edits, &mut names);
        let mut bytes = encode_diff(&d);
        let i = flip % bytes.len();
        bytes[i] ^= 1 << bit;
        for b in [bytes, junk] {
            same_both_ways(&base, &b)?;
            if let Ok(dd) = decode_diff(&b, 1 << 20) {
                let mut r = base.clone();
                match r.apply(&dd) {
                    Ok(()) => prop_assert_eq!(r.version(), dd.target),
                    Err(_) => prop_assert_eq!(&r, &base),
                }
            }
        }
    }

    /// Several damaged bytes, a cut or an insertion anywhere in a diff's
    /// wire form: applying straight from the bytes accepts and refuses
    /// exactly what decoding then applying does.
    #[test]
    fn bytes_path_matches_decode_then_apply(edits in prop::collection::vec(edit(), 1..20), hits in prop::collection::vec((any::<usize>(), any::<u8>()), 0..4), cut in any::<usize>(), how in 0u8..3) {
        let mut base = fresh();
        let mut names = 0;
        run(&mut base, &[Edit::Alloc { ty: 15, named: true }, Edit::Alloc { ty: 14, named: false }], &mut names);
        let mut master = base.clone();
        let d = run(&mut master, &edits, &mut names);
        let mut bytes = encode_diff(&d);
        for (i, v) in &hits {
            let i = i % bytes.len();
            bytes[i] = *v;
        }
        let at = cut % (bytes.len() + 1);
        match how {
            0 => bytes.truncate(at),
            1 => bytes.insert(at, (cut >> 8) as u8),
            _ => {}
        }
        same_both_ways(&base, &bytes)?;
    }

    /// Diffs of writes only (the refresh the one-pass apply takes), chained
    /// so that a unit may be written twice, then damaged late (a unit of
    /// another kind in the last op, a byte, a cut, another base): applying
    /// straight from the bytes accepts and refuses exactly what decoding
    /// then applying does, and a copy that refused is exactly as before
    /// (what the first ops wrote is put back).
    #[test]
    fn write_only_diffs_apply_or_leave_the_copy_as_it_was(
        rounds in prop::collection::vec(prop::collection::vec((any::<usize>(), any::<u64>(), 1u8..40, any::<u64>()), 1..12), 1..4),
        how in 0u8..5,
        at in any::<usize>(),
        seed in any::<u64>(),
    ) {
        let mut base = fresh();
        let mut names = 0;
        let setup: Vec<Edit> = [14, 15, 16, 11, 12, 9]
            .iter()
            .map(|ty| Edit::Alloc { ty: *ty, named: false })
            .collect();
        run(&mut base, &setup, &mut names);
        let mut master = base.clone();
        let mut chained: Option<Diff> = None;
        for edits in &rounds {
            let edits: Vec<Edit> = edits
                .iter()
                .map(|&(block, at, len, seed)| Edit::Write { block, at, len, seed })
                .collect();
            let d = run(&mut master, &edits, &mut names);
            if d.target == d.base {
                continue;
            }
            match &mut chained {
                None => chained = Some(d),
                Some(c) => c.chain(&d).unwrap(),
            }
        }
        let Some(mut d) = chained else { return Ok(()) };
        let writes_only = d.ops.iter().all(|o| matches!(o, DiffOp::Write { .. }));
        prop_assert!(writes_only);
        if how == 0 {
            if let Some(DiffOp::Write { units, .. }) = d.ops.last_mut() {
                let i = at % units.len();
                let k = units[i].kind();
                let other = KINDS[(KINDS.iter().position(|x| *x == k).unwrap() + 1 + (seed as usize % 12)) % 13];
                units[i] = unit(other, seed);
            }
        }
        if how == 1 {
            d.base += 1 + seed % 3;
        }
        let mut bytes = encode_diff(&d);
        let n = bytes.len();
        match how {
            2 => bytes[n - 1 - at % n.min(16)] = seed as u8,
            3 => bytes.truncate(n - 1 - at % n.min(16)),
            _ => {}
        }
        same_both_ways(&base, &bytes)?;
        if how == 4 {
            let mut r = base.clone();
            apply_diff_bytes(&mut r, &bytes, 1 << 20).unwrap();
            prop_assert_eq!(&r, &master);
        }
    }
}
