//! Twins and diff collection: finding what a writer changed.
//!
//! Owns the write side of a lock critical section. The first write to a chunk
//! of [`CHUNK_UNITS`] units of a pre-existing block saves a copy of the chunk
//! (its twin); [`collect`] compares only twinned chunks with their current
//! units and emits runs of changed units, so the cost of a diff follows what
//! was touched, not the segment's size. Copy on first write was chosen over
//! page protection: it needs no `unsafe`, no signal handler and no
//! page-aligned layout, and a typed write already goes through this API.
//!
//! Must never let a write change a unit's kind, write outside a block, or
//! change the segment without a twin to diff against.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use super::error::StateError;
use super::mip::{BlockRef, Mip, SegUrl};
use super::record::Typed;
use super::segment::{Diff, DiffOp, Segment};
use super::types::{TypeDesc, Unit};

/// Units per twin chunk (the "page" of copy on first write).
pub const CHUNK_UNITS: u64 = 256;

/// What a writer has touched since its lock was taken.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Twins {
    base: u64,
    saved: BTreeMap<(u32, u64), Vec<Unit>>,
    allocs: BTreeSet<u32>,
    frees: BTreeSet<u32>,
    deps: BTreeMap<SegUrl, u64>,
    /// A block was allocated and freed again: its serial is spent.
    spent: bool,
}

impl Twins {
    /// Fresh twins for a writer starting at `seg`'s current version.
    pub fn new(seg: &Segment) -> Self {
        Twins {
            base: seg.version(),
            ..Twins::default()
        }
    }

    /// Records that the writer has `url` at `version` in use (for the
    /// cross-segment check of whoever later uses this version).
    pub fn depend_on(&mut self, url: SegUrl, version: u64) {
        self.deps.insert(url, version);
    }

    /// Units copied into twins so far (the price of copy on first write).
    pub fn twinned_units(&self) -> u64 {
        self.saved.values().map(|c| c.len() as u64).sum()
    }

    /// True when nothing was written, allocated or freed.
    pub fn is_clean(&self) -> bool {
        self.saved.is_empty() && self.allocs.is_empty() && self.frees.is_empty() && !self.spent
    }
}

/// Mutating access to a segment under a writer lock.
pub struct Writer<'a> {
    seg: &'a mut Segment,
    twins: &'a mut Twins,
}

impl<'a> Writer<'a> {
    /// Starts (or continues) writing `seg`, twinning into `twins`. Fails with
    /// [`StateError::VersionMismatch`] when the twins were made for another version.
    pub fn new(seg: &'a mut Segment, twins: &'a mut Twins) -> Result<Self, StateError> {
        if twins.base != seg.version() {
            return Err(StateError::VersionMismatch {
                base: twins.base,
                have: seg.version(),
            });
        }
        Ok(Writer { seg, twins })
    }

    /// The segment as written so far.
    pub fn segment(&self) -> &Segment {
        self.seg
    }

    /// Allocates a block holding `value`, optionally named; returns its serial.
    /// Fails with [`StateError::BadName`], [`StateError::NameInUse`],
    /// [`StateError::BadType`] or [`StateError::LimitExceeded`].
    pub fn alloc<T: Typed>(&mut self, name: Option<&str>, value: &T) -> Result<u32, StateError> {
        self.alloc_units(name, Arc::new(T::desc()), value.to_units())
    }

    /// Allocates a zeroed block of type `ty`; returns its serial.
    pub fn alloc_zeroed(&mut self, name: Option<&str>, ty: TypeDesc) -> Result<u32, StateError> {
        let data = ty.zeroed();
        self.alloc_units(name, Arc::new(ty), data)
    }

    fn alloc_units(
        &mut self,
        name: Option<&str>,
        ty: Arc<TypeDesc>,
        data: Vec<Unit>,
    ) -> Result<u32, StateError> {
        let serial = self.seg.next_serial();
        let op = DiffOp::Alloc {
            serial,
            name: name.map(str::to_string),
            ty,
            data,
        };
        let v = self.seg.version();
        self.seg.check(&Diff {
            base: v,
            target: v + 1,
            deps: BTreeMap::new(),
            next_serial: 0,
            ops: vec![op.clone()],
        })?;
        self.seg.apply_op(&op);
        self.twins.allocs.insert(serial);
        Ok(serial)
    }

    /// Frees a block. Fails with the [`Segment::lookup`] statuses.
    pub fn free(&mut self, r: &BlockRef) -> Result<(), StateError> {
        let serial = self.seg.lookup(r)?;
        self.seg.apply_op(&DiffOp::Free { serial });
        if self.twins.allocs.remove(&serial) {
            self.twins.spent = true;
        } else {
            self.twins.frees.insert(serial);
        }
        self.twins.saved.retain(|(s, _), _| *s != serial);
        Ok(())
    }

    /// Replaces a whole block by `value`. Fails with [`StateError::TypeMismatch`]
    /// when `T` is not the block's stored type.
    pub fn write<T: Typed>(&mut self, r: &BlockRef, value: &T) -> Result<(), StateError> {
        let serial = self.seg.lookup(r)?;
        let want = T::desc();
        let stored = self.seg.block(&BlockRef::Serial(serial))?.ty.clone();
        if *stored != want {
            return Err(StateError::TypeMismatch {
                stored: stored.render(),
                asked: want.render(),
            });
        }
        self.write_units(serial, 0, &value.to_units())
    }

    /// Writes `value` at `offset` inside a block (e.g. one record of an array).
    /// Fails with [`StateError::TypeMismatch`] or [`StateError::OffsetOutOfRange`].
    pub fn write_at<T: Typed>(
        &mut self,
        r: &BlockRef,
        offset: u64,
        value: &T,
    ) -> Result<(), StateError> {
        let serial = self.seg.lookup(r)?;
        self.write_units(serial, offset, &value.to_units())
    }

    /// Writes one unit where `mip` points.
    pub fn set(&mut self, mip: &Mip, unit: Unit) -> Result<(), StateError> {
        let (serial, offset) = self.seg.resolve(mip)?;
        self.write_units(serial, offset, std::slice::from_ref(&unit))
    }

    /// Writes `units` from `start` in block `serial`, twinning every chunk it
    /// touches on first write. Kinds must match the stored layout.
    pub fn write_units(
        &mut self,
        serial: u32,
        start: u64,
        units: &[Unit],
    ) -> Result<(), StateError> {
        let block = self.seg.block(&BlockRef::Serial(serial))?;
        let len = block.data.len() as u64;
        let end = start
            .checked_add(units.len() as u64)
            .filter(|e| *e <= len)
            .ok_or(StateError::OffsetOutOfRange {
                block: serial,
                offset: start,
                units: len,
            })?;
        let limits = self.seg.limits().types;
        let mut at = start;
        let mut each = units.iter();
        let seen = block.ty.walk_kinds(start, units.len() as u64, &mut |k| {
            let Some(u) = each.next() else {
                return Ok(());
            };
            u.check(k, &limits).map_err(|_| StateError::TypeMismatch {
                stored: format!("{} at {at}", k.name()),
                asked: u.kind().name().to_string(),
            })?;
            at += 1;
            Ok(())
        })?;
        if seen != units.len() as u64 {
            return Err(StateError::OffsetOutOfRange {
                block: serial,
                offset: start + seen,
                units: len,
            });
        }
        if units.is_empty() {
            return Ok(());
        }
        let data = self.seg.block_data_mut(serial).expect("looked up above");
        if !self.twins.allocs.contains(&serial) {
            let first = start / CHUNK_UNITS;
            let last = (end - 1) / CHUNK_UNITS;
            for c in first..=last {
                self.twins.saved.entry((serial, c)).or_insert_with(|| {
                    let lo = (c * CHUNK_UNITS) as usize;
                    let hi = ((c + 1) * CHUNK_UNITS).min(len) as usize;
                    data[lo..hi].to_vec()
                });
            }
        }
        data[start as usize..end as usize].clone_from_slice(units);
        Ok(())
    }
}

/// Ends a writer's critical section: compares every twin with the current
/// units and returns the diff from the twins' base version, in primitive
/// units. A non-empty diff moves `seg` to `base + 1` (the writer's tentative
/// version); an empty one leaves it where it was.
pub fn collect(seg: &mut Segment, twins: Twins) -> Diff {
    let base = twins.base;
    let mut ops = Vec::new();
    for s in &twins.frees {
        ops.push(DiffOp::Free { serial: *s });
    }
    // (serial, start, units) of the run being built.
    let mut run: Option<(u32, u64, Vec<Unit>)> = None;
    for ((serial, chunk), old) in &twins.saved {
        let Ok(b) = seg.block(&BlockRef::Serial(*serial)) else {
            continue;
        };
        let lo = chunk * CHUNK_UNITS;
        for (i, was) in old.iter().enumerate() {
            let at = lo + i as u64;
            let now = &b.data[at as usize];
            if now == was {
                continue;
            }
            match &mut run {
                Some((s, st, us)) if *s == *serial && *st + us.len() as u64 == at => {
                    us.push(now.clone())
                }
                _ => {
                    if let Some((s, st, us)) = run.take() {
                        ops.push(DiffOp::Write {
                            serial: s,
                            start: st,
                            units: us,
                        });
                    }
                    run = Some((*serial, at, vec![now.clone()]));
                }
            }
        }
    }
    if let Some((s, st, us)) = run.take() {
        ops.push(DiffOp::Write {
            serial: s,
            start: st,
            units: us,
        });
    }
    for s in &twins.allocs {
        if let Ok(b) = seg.block(&BlockRef::Serial(*s)) {
            ops.push(DiffOp::Alloc {
                serial: *s,
                name: b.name.clone(),
                ty: b.ty.clone(),
                data: b.data.clone(),
            });
        }
    }
    let next_serial = if twins.spent { seg.next_serial() } else { 0 };
    if ops.is_empty() && next_serial == 0 {
        return Diff {
            base,
            target: base,
            deps: BTreeMap::new(),
            next_serial,
            ops,
        };
    }
    seg.set_version(base + 1);
    seg.merge_deps(&twins.deps);
    Diff {
        base,
        target: base + 1,
        deps: twins.deps,
        next_serial,
        ops,
    }
}
