//! Segments, their typed blocks, and diffs between versions.
//!
//! Owns one copy of a segment (the master at its home, or a client's cache):
//! numbered and optionally named blocks, each with its stored [`TypeDesc`], the
//! segment's version, and the versions of other segments it was made from
//! (for the cross-segment check). Applying a [`Diff`] is all-or-nothing: every
//! op is checked first against the segment and the limits, and a refused diff
//! leaves the copy untouched.
//!
//! Must never reuse a block serial (a MIP to a freed block must dangle, not
//! point at a newcomer), exceed [`SegLimits`], or do I/O.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use super::error::StateError;
use super::mip::{BlockRef, Mip, SegUrl};
use super::record::Typed;
use super::types::{check_name, TypeDesc, TypeLimits, Unit};

/// Limits on one segment and on the diffs it accepts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SegLimits {
    /// Limits on each block's type.
    pub types: TypeLimits,
    /// Most units in the whole segment.
    pub max_units: u64,
    /// Most live blocks.
    pub max_blocks: u32,
    /// Most units carried by one diff (writes plus allocations).
    pub max_diff_units: u64,
    /// Most ops in one diff.
    pub max_diff_ops: usize,
    /// Most other segments one version may depend on.
    pub max_deps: usize,
}

impl Default for SegLimits {
    fn default() -> Self {
        SegLimits {
            types: TypeLimits::default(),
            max_units: 1 << 23,
            max_blocks: 1 << 18,
            max_diff_units: 1 << 23,
            max_diff_ops: 1 << 20,
            max_deps: 64,
        }
    }
}

/// One typed block.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Block {
    /// Its optional name, unique in the segment.
    pub name: Option<String>,
    /// Its stored type.
    pub ty: Arc<TypeDesc>,
    /// Its value, `ty.units()` units in layout order.
    pub data: Vec<Unit>,
}

/// One change inside a [`Diff`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DiffOp {
    /// A new block with its whole value; `serial` is at least the segment's
    /// next serial (serials only grow).
    Alloc {
        /// The new block's serial.
        serial: u32,
        /// Its optional name.
        name: Option<String>,
        /// Its type.
        ty: Arc<TypeDesc>,
        /// Its value.
        data: Vec<Unit>,
    },
    /// The block is freed; its serial is never used again.
    Free {
        /// The freed block.
        serial: u32,
    },
    /// A run of changed units: `units` replace the block's units from `start`.
    Write {
        /// The block written.
        serial: u32,
        /// First unit replaced, in primitive units.
        start: u64,
        /// The new units (at least one).
        units: Vec<Unit>,
    },
}

/// The changes that take a segment from version `base` to version `target`.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct Diff {
    /// The version this diff applies to.
    pub base: u64,
    /// The version it produces (greater than `base`).
    pub target: u64,
    /// Versions of other segments the writer had in use (cross-segment check).
    pub deps: BTreeMap<SegUrl, u64>,
    /// The writer's next block serial (0: no claim): serials of blocks
    /// allocated and freed inside one critical section stay spent.
    pub next_serial: u32,
    /// The changes, applied in order.
    pub ops: Vec<DiffOp>,
}

impl Diff {
    /// Units carried (writes plus allocated values): the diff's cost.
    pub fn units(&self) -> u64 {
        self.ops
            .iter()
            .map(|op| match op {
                DiffOp::Alloc { data, .. } => data.len() as u64,
                DiffOp::Free { .. } => 0,
                DiffOp::Write { units, .. } => units.len() as u64,
            })
            .sum()
    }

    /// True when the diff changes nothing.
    pub fn is_empty(&self) -> bool {
        self.ops.is_empty()
    }

    /// Appends `next` (which must start where this one ends) so that applying
    /// the result equals applying both in order. Fails with
    /// [`StateError::VersionMismatch`] when they do not chain.
    pub fn chain(&mut self, next: &Diff) -> Result<(), StateError> {
        if next.base != self.target {
            return Err(StateError::VersionMismatch {
                base: next.base,
                have: self.target,
            });
        }
        self.target = next.target;
        self.next_serial = self.next_serial.max(next.next_serial);
        self.ops.extend(next.ops.iter().cloned());
        for (u, v) in &next.deps {
            let e = self.deps.entry(u.clone()).or_insert(0);
            *e = (*e).max(*v);
        }
        Ok(())
    }
}

/// One copy of a segment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Segment {
    url: SegUrl,
    version: u64,
    blocks: BTreeMap<u32, Block>,
    names: BTreeMap<String, u32>,
    next_serial: u32,
    units: u64,
    deps: BTreeMap<SegUrl, u64>,
    limits: SegLimits,
}

/// Mirror of the facts a diff check needs, so a diff can be checked without
/// touching (or cloning) the segment.
pub(crate) struct Overlay<'a> {
    seg: &'a Segment,
    added: BTreeMap<u32, (Arc<TypeDesc>, Option<String>)>,
    freed: BTreeSet<u32>,
    names_gone: BTreeSet<String>,
    next_serial: u32,
    units: u64,
    blocks: u64,
}

/// What a segment would be after some checked diffs, kept as the facts a
/// diff check needs (no unit values): the home keeps one per writing
/// transaction instead of a copy of the master, so accepting a diff costs
/// what the diff carries, not what the segment holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ahead {
    added: BTreeMap<u32, (Arc<TypeDesc>, Option<String>)>,
    freed: BTreeSet<u32>,
    names_gone: BTreeSet<String>,
    next_serial: u32,
    units: u64,
    blocks: u64,
    version: u64,
}

impl Ahead {
    /// Nothing ahead of `seg` yet.
    pub fn new(seg: &Segment) -> Self {
        Ahead {
            added: BTreeMap::new(),
            freed: BTreeSet::new(),
            names_gone: BTreeSet::new(),
            next_serial: seg.next_serial,
            units: seg.units,
            blocks: seg.blocks.len() as u64,
            version: seg.version,
        }
    }

    /// The version the checked diffs lead to.
    pub fn version(&self) -> u64 {
        self.version
    }
}

impl<'a> Overlay<'a> {
    pub(crate) fn new(seg: &'a Segment) -> Self {
        Self::resume(seg, Ahead::new(seg))
    }

    fn resume(seg: &'a Segment, a: Ahead) -> Self {
        Overlay {
            seg,
            added: a.added,
            freed: a.freed,
            names_gone: a.names_gone,
            next_serial: a.next_serial,
            units: a.units,
            blocks: a.blocks,
        }
    }

    fn into_ahead(self, version: u64) -> Ahead {
        Ahead {
            added: self.added,
            freed: self.freed,
            names_gone: self.names_gone,
            next_serial: self.next_serial,
            units: self.units,
            blocks: self.blocks,
            version,
        }
    }

    /// Checks a diff's ops in order, recording what they change.
    fn check_ops(&mut self, ops: &[DiffOp]) -> Result<(), StateError> {
        let lim = &self.seg.limits.types;
        for op in ops {
            match op {
                DiffOp::Alloc {
                    serial,
                    name,
                    ty,
                    data,
                } => self.check_alloc(*serial, name, ty, data)?,
                DiffOp::Free { serial } => self.check_free(*serial)?,
                DiffOp::Write {
                    serial,
                    start,
                    units,
                } => {
                    let ty = self.write_type(*serial, *start, units.len() as u64)?;
                    let mut each = units.iter();
                    let seen = ty.walk_kinds(*start, units.len() as u64, &mut |k| {
                        each.next().map_or(Ok(()), |u| u.check(k, lim))
                    })?;
                    if seen != units.len() as u64 {
                        return Err(StateError::BadDiff("write past the end".to_string()));
                    }
                }
            }
        }
        Ok(())
    }

    /// Checks an `Alloc` op and records its block.
    pub(crate) fn check_alloc(
        &mut self,
        serial: u32,
        name: &Option<String>,
        ty: &Arc<TypeDesc>,
        data: &[Unit],
    ) -> Result<(), StateError> {
        let limits = &self.seg.limits;
        if serial < self.next_serial || serial == u32::MAX {
            return Err(StateError::BadDiff(format!(
                "allocation reuses serial {serial}"
            )));
        }
        ty.validate(&limits.types)?;
        if data.len() as u64 != ty.units() {
            return Err(StateError::BadDiff(format!(
                "block {serial}: {} units for a type of {}",
                data.len(),
                ty.units()
            )));
        }
        let mut kinds = Vec::with_capacity(data.len());
        ty.layout(&mut kinds);
        for (u, k) in data.iter().zip(kinds) {
            u.check(k, &limits.types)?;
        }
        if let Some(n) = name {
            check_name(n, &limits.types)?;
            if self.name_taken(n) {
                return Err(StateError::NameInUse(n.clone()));
            }
        }
        self.units += data.len() as u64;
        self.blocks += 1;
        if self.units > limits.max_units {
            return Err(StateError::LimitExceeded(format!(
                "segment would hold {} units, more than {}",
                self.units, limits.max_units
            )));
        }
        if self.blocks > u64::from(limits.max_blocks) {
            return Err(StateError::LimitExceeded(format!(
                "segment would hold {} blocks, more than {}",
                self.blocks, limits.max_blocks
            )));
        }
        self.next_serial = serial + 1;
        self.added.insert(serial, (ty.clone(), name.clone()));
        Ok(())
    }

    /// Checks a `Free` op and records it.
    pub(crate) fn check_free(&mut self, serial: u32) -> Result<(), StateError> {
        let ty = self.live_type(serial)?;
        self.units -= ty.units();
        self.blocks -= 1;
        if self.added.remove(&serial).is_none() {
            if let Some(Some(n)) = self.seg.blocks.get(&serial).map(|b| &b.name) {
                self.names_gone.insert(n.clone());
            }
        }
        self.freed.insert(serial);
        Ok(())
    }

    /// The type of the block a `Write` of `n` units at `start` changes,
    /// after checking that it is live and the run is inside it and not
    /// empty (the units' kinds are the caller's to check).
    pub(crate) fn write_type(
        &self,
        serial: u32,
        start: u64,
        n: u64,
    ) -> Result<Arc<TypeDesc>, StateError> {
        let ty = self.live_type(serial)?;
        let end = start.checked_add(n);
        if n == 0 || end.is_none_or(|e| e > ty.units()) {
            return Err(StateError::BadDiff(format!(
                "write of {n} units at {start} outside block {serial} of {}",
                ty.units()
            )));
        }
        Ok(ty)
    }

    fn live_type(&self, serial: u32) -> Result<Arc<TypeDesc>, StateError> {
        if self.freed.contains(&serial) {
            return Err(StateError::BadDiff(format!("block {serial} is freed")));
        }
        if let Some((t, _)) = self.added.get(&serial) {
            return Ok(t.clone());
        }
        self.seg
            .blocks
            .get(&serial)
            .map(|b| b.ty.clone())
            .ok_or_else(|| StateError::BadDiff(format!("no block {serial}")))
    }

    fn name_taken(&self, name: &str) -> bool {
        (self.seg.names.contains_key(name) && !self.names_gone.contains(name))
            || self.added.values().any(|(_, n)| n.as_deref() == Some(name))
    }
}

impl Segment {
    /// An empty segment at version 0.
    pub fn new(url: SegUrl, limits: SegLimits) -> Self {
        Segment {
            url,
            version: 0,
            blocks: BTreeMap::new(),
            names: BTreeMap::new(),
            next_serial: 1,
            units: 0,
            deps: BTreeMap::new(),
            limits,
        }
    }

    /// The segment's URL.
    pub fn url(&self) -> &SegUrl {
        &self.url
    }

    /// The version this copy holds.
    pub fn version(&self) -> u64 {
        self.version
    }

    /// Total units in live blocks.
    pub fn units(&self) -> u64 {
        self.units
    }

    /// Number of live blocks.
    pub fn block_count(&self) -> usize {
        self.blocks.len()
    }

    /// The serial the next allocation gets.
    pub fn next_serial(&self) -> u32 {
        self.next_serial
    }

    /// The limits this copy enforces.
    pub fn limits(&self) -> &SegLimits {
        &self.limits
    }

    /// Versions of other segments this version was made from.
    pub fn deps(&self) -> &BTreeMap<SegUrl, u64> {
        &self.deps
    }

    /// Live blocks by serial.
    pub fn blocks(&self) -> impl Iterator<Item = (u32, &Block)> {
        self.blocks.iter().map(|(s, b)| (*s, b))
    }

    /// The serial `r` names. Fails with [`StateError::BlockFreed`] for a freed
    /// serial and [`StateError::NoSuchBlock`] for one never allocated or an
    /// unknown name.
    pub fn lookup(&self, r: &BlockRef) -> Result<u32, StateError> {
        match r {
            BlockRef::Serial(s) if self.blocks.contains_key(s) => Ok(*s),
            BlockRef::Serial(s) if *s > 0 && *s < self.next_serial => {
                Err(StateError::BlockFreed(*s))
            }
            BlockRef::Serial(s) => Err(StateError::NoSuchBlock(s.to_string())),
            BlockRef::Name(n) => self
                .names
                .get(n)
                .copied()
                .ok_or_else(|| StateError::NoSuchBlock(n.clone())),
        }
    }

    /// The block `r` names (see [`Segment::lookup`] for failures).
    pub fn block(&self, r: &BlockRef) -> Result<&Block, StateError> {
        let s = self.lookup(r)?;
        Ok(&self.blocks[&s])
    }

    /// Turns a MIP into a local reference (block serial, unit offset). Fails
    /// with [`StateError::BadAddress`] when the MIP names another segment,
    /// the [`Segment::lookup`] statuses, or [`StateError::OffsetOutOfRange`].
    pub fn resolve(&self, mip: &Mip) -> Result<(u32, u64), StateError> {
        if mip.seg != self.url {
            return Err(StateError::BadAddress(format!(
                "{mip} is not in {}",
                self.url
            )));
        }
        let s = self.lookup(&mip.block)?;
        let units = self.blocks[&s].data.len() as u64;
        if mip.offset >= units {
            return Err(StateError::OffsetOutOfRange {
                block: s,
                offset: mip.offset,
                units,
            });
        }
        Ok((s, mip.offset))
    }

    /// Turns a local reference into a MIP (by serial; stable across renames).
    /// Fails like [`Segment::resolve`].
    pub fn mip(&self, serial: u32, offset: u64) -> Result<Mip, StateError> {
        let m = Mip {
            seg: self.url.clone(),
            block: BlockRef::Serial(serial),
            offset,
        };
        self.resolve(&m)?;
        Ok(m)
    }

    /// The unit a MIP points at.
    pub fn unit(&self, mip: &Mip) -> Result<&Unit, StateError> {
        let (s, o) = self.resolve(mip)?;
        Ok(&self.blocks[&s].data[o as usize])
    }

    /// Reads a whole block as a native value. Fails with
    /// [`StateError::TypeMismatch`] when `T`'s descriptor is not the stored one.
    pub fn read<T: Typed>(&self, r: &BlockRef) -> Result<T, StateError> {
        let b = self.block(r)?;
        let want = T::desc();
        if *b.ty != want {
            return Err(StateError::TypeMismatch {
                stored: b.ty.render(),
                asked: want.render(),
            });
        }
        T::take(&mut b.data.iter()).ok_or_else(|| StateError::TypeMismatch {
            stored: b.ty.render(),
            asked: want.render(),
        })
    }

    /// Reads a native value stored at `offset` inside a block (e.g. one
    /// record of an array). Fails with [`StateError::TypeMismatch`] when the
    /// units there are not of `T`'s layout, or [`StateError::OffsetOutOfRange`].
    pub fn read_at<T: Typed>(&self, r: &BlockRef, offset: u64) -> Result<T, StateError> {
        let s = self.lookup(r)?;
        let b = &self.blocks[&s];
        let want = T::desc();
        let n = want.units();
        let end = offset
            .checked_add(n)
            .filter(|e| *e <= b.data.len() as u64)
            .ok_or(StateError::OffsetOutOfRange {
                block: s,
                offset,
                units: b.data.len() as u64,
            })?;
        let slice = &b.data[offset as usize..end as usize];
        T::take(&mut slice.iter()).ok_or_else(|| StateError::TypeMismatch {
            stored: format!("{} at {offset}", b.ty.render()),
            asked: want.render(),
        })
    }

    /// Checks `diff` against this copy and the limits without changing
    /// anything. Fails with [`StateError::VersionMismatch`],
    /// [`StateError::BadDiff`] or [`StateError::LimitExceeded`].
    pub fn check(&self, diff: &Diff) -> Result<(), StateError> {
        self.check_head(
            diff.base,
            diff.target,
            diff.ops.len(),
            diff.units(),
            diff.next_serial,
            &diff.deps,
        )?;
        Overlay::new(self).check_ops(&diff.ops)
    }

    /// Checks `diff` against this copy with the diffs `ahead` stands for
    /// applied (what [`Segment::check`] of a copy with them applied says,
    /// without the copy) and, when it fits, moves `ahead` past it. Nothing
    /// changes on failure.
    pub fn check_ahead(&self, ahead: &mut Ahead, diff: &Diff) -> Result<(), StateError> {
        self.check_head_at(
            ahead.version,
            diff.base,
            diff.target,
            diff.ops.len(),
            diff.units(),
            diff.next_serial,
            &diff.deps,
        )?;
        let mut ov = Overlay::resume(self, ahead.clone());
        ov.check_ops(&diff.ops)?;
        let mut next = ov.into_ahead(diff.target);
        next.next_serial = next.next_serial.max(diff.next_serial);
        *ahead = next;
        Ok(())
    }

    /// The checks of a diff as a whole (everything but its ops), in the order
    /// [`Segment::check`] makes them.
    pub(crate) fn check_head(
        &self,
        base: u64,
        target: u64,
        ops: usize,
        units: u64,
        next_serial: u32,
        deps: &BTreeMap<SegUrl, u64>,
    ) -> Result<(), StateError> {
        self.check_head_at(self.version, base, target, ops, units, next_serial, deps)
    }

    #[allow(clippy::too_many_arguments)]
    fn check_head_at(
        &self,
        version: u64,
        base: u64,
        target: u64,
        ops: usize,
        units: u64,
        next_serial: u32,
        deps: &BTreeMap<SegUrl, u64>,
    ) -> Result<(), StateError> {
        if base != version {
            return Err(StateError::VersionMismatch {
                base,
                have: version,
            });
        }
        if target <= base {
            return Err(StateError::BadDiff(format!(
                "target version {target} is not after base {base}"
            )));
        }
        if ops > self.limits.max_diff_ops {
            return Err(StateError::LimitExceeded(format!("{ops} ops in one diff")));
        }
        if units > self.limits.max_diff_units {
            return Err(StateError::LimitExceeded(format!(
                "diff of {units} units, more than {}",
                self.limits.max_diff_units
            )));
        }
        if next_serial == u32::MAX {
            return Err(StateError::BadDiff("next serial out of range".into()));
        }
        if deps.len() > self.limits.max_deps || deps.contains_key(&self.url) {
            return Err(StateError::BadDiff("bad dependency list".into()));
        }
        Ok(())
    }

    /// Applies `diff` after [`Segment::check`]; on any failure nothing changes.
    pub fn apply(&mut self, diff: &Diff) -> Result<(), StateError> {
        self.check(diff)?;
        for op in &diff.ops {
            self.apply_op(op);
        }
        self.version = diff.target;
        self.next_serial = self.next_serial.max(diff.next_serial);
        for (u, v) in &diff.deps {
            let e = self.deps.entry(u.clone()).or_insert(0);
            *e = (*e).max(*v);
        }
        Ok(())
    }

    /// Like [`Segment::apply`], moving the diff's values in instead of
    /// copying them (refreshes and images, which are used once).
    pub fn apply_owned(&mut self, diff: Diff) -> Result<(), StateError> {
        self.check(&diff)?;
        for op in diff.ops {
            match op {
                DiffOp::Alloc {
                    serial,
                    name,
                    ty,
                    data,
                } => {
                    if let Some(n) = &name {
                        self.names.insert(n.clone(), serial);
                    }
                    self.units += data.len() as u64;
                    self.next_serial = serial + 1;
                    self.blocks.insert(serial, Block { name, ty, data });
                }
                DiffOp::Write {
                    serial,
                    start,
                    units,
                } => {
                    if let Some(b) = self.blocks.get_mut(&serial) {
                        let s = start as usize;
                        for (slot, u) in b.data[s..s + units.len()].iter_mut().zip(units) {
                            *slot = u;
                        }
                    }
                }
                free @ DiffOp::Free { .. } => self.apply_op(&free),
            }
        }
        self.version = diff.target;
        self.next_serial = self.next_serial.max(diff.next_serial);
        for (u, v) in &diff.deps {
            let e = self.deps.entry(u.clone()).or_insert(0);
            *e = (*e).max(*v);
        }
        Ok(())
    }

    /// Applies one op that [`Segment::check`] accepted.
    pub(crate) fn apply_op(&mut self, op: &DiffOp) {
        match op {
            DiffOp::Alloc {
                serial,
                name,
                ty,
                data,
            } => {
                if let Some(n) = name {
                    self.names.insert(n.clone(), *serial);
                }
                self.units += data.len() as u64;
                self.next_serial = serial + 1;
                self.blocks.insert(
                    *serial,
                    Block {
                        name: name.clone(),
                        ty: ty.clone(),
                        data: data.clone(),
                    },
                );
            }
            DiffOp::Free { serial } => {
                if let Some(b) = self.blocks.remove(serial) {
                    self.units -= b.data.len() as u64;
                    if let Some(n) = b.name {
                        self.names.remove(&n);
                    }
                }
            }
            DiffOp::Write {
                serial,
                start,
                units,
            } => {
                if let Some(b) = self.blocks.get_mut(serial) {
                    let s = *start as usize;
                    b.data[s..s + units.len()].clone_from_slice(units);
                }
            }
        }
    }

    /// The whole segment as a diff from an empty segment (what a new or very
    /// stale reader receives). Freed serials past the last live block are
    /// kept by [`SegmentImage::next_serial`].
    pub fn image(&self) -> SegmentImage {
        SegmentImage {
            url: self.url.clone(),
            version: self.version,
            next_serial: self.next_serial,
            deps: self.deps.clone(),
            blocks: self.blocks.iter().map(|(s, b)| (*s, b.clone())).collect(),
        }
    }

    /// Rebuilds a segment from an image, checking everything as a diff would.
    /// Fails with [`StateError::BadDiff`] / [`StateError::LimitExceeded`].
    pub fn from_image(img: SegmentImage, limits: SegLimits) -> Result<Segment, StateError> {
        let mut seg = Segment::new(img.url.clone(), limits);
        let diff = Diff {
            base: 0,
            target: img.version.max(1),
            deps: img.deps,
            next_serial: 0,
            ops: img
                .blocks
                .into_iter()
                .map(|(serial, b)| DiffOp::Alloc {
                    serial,
                    name: b.name,
                    ty: b.ty,
                    data: b.data,
                })
                .collect(),
        };
        seg.apply_owned(diff)?;
        if img.next_serial < seg.next_serial {
            return Err(StateError::BadDiff(
                "image's next serial is below a live block".into(),
            ));
        }
        seg.next_serial = img.next_serial;
        seg.version = img.version;
        Ok(seg)
    }

    /// Replaces this copy by `img` (a refresh that moved the whole segment).
    pub fn replace(&mut self, img: SegmentImage) -> Result<(), StateError> {
        if img.url != self.url {
            return Err(StateError::BadDiff(format!(
                "image of {} for {}",
                img.url, self.url
            )));
        }
        *self = Segment::from_image(img, self.limits)?;
        Ok(())
    }

    /// Inserts a block an `Alloc` op that [`Segment::check`] (or its
    /// [`Overlay`]) accepted brings.
    pub(crate) fn insert_block(&mut self, serial: u32, block: Block) {
        if let Some(n) = &block.name {
            self.names.insert(n.clone(), serial);
        }
        self.units += block.data.len() as u64;
        self.next_serial = serial + 1;
        self.blocks.insert(serial, block);
    }

    /// Ends applying a checked diff: its version, serial claim and
    /// dependencies.
    pub(crate) fn finish_diff(
        &mut self,
        target: u64,
        next_serial: u32,
        deps: &BTreeMap<SegUrl, u64>,
    ) {
        self.version = target;
        self.next_serial = self.next_serial.max(next_serial);
        self.merge_deps(deps);
    }

    pub(crate) fn block_data_mut(&mut self, serial: u32) -> Option<&mut Vec<Unit>> {
        self.blocks.get_mut(&serial).map(|b| &mut b.data)
    }

    pub(crate) fn set_version(&mut self, v: u64) {
        self.version = v;
    }

    pub(crate) fn merge_deps(&mut self, deps: &BTreeMap<SegUrl, u64>) {
        for (u, v) in deps {
            let e = self.deps.entry(u.clone()).or_insert(0);
            *e = (*e).max(*v);
        }
    }
}

/// A whole segment (checkpoints, and refreshes where a diff would be larger).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SegmentImage {
    /// The segment.
    pub url: SegUrl,
    /// Its version.
    pub version: u64,
    /// The serial the next allocation gets.
    pub next_serial: u32,
    /// Versions of other segments this version was made from.
    pub deps: BTreeMap<SegUrl, u64>,
    /// Live blocks by serial, ascending.
    pub blocks: Vec<(u32, Block)>,
}

impl SegmentImage {
    /// Units in the image.
    pub fn units(&self) -> u64 {
        self.blocks.iter().map(|(_, b)| b.data.len() as u64).sum()
    }
}

/// Cross-segment consistency check (InterWeave section 2.3): `seg` may be
/// used beside the segments already `in_use` (URL → version in use) only if
/// it was not made from a newer version of any of them. Fails with
/// [`StateError::Inconsistent`]; the transaction can refresh and retry.
pub fn check_consistent(in_use: &BTreeMap<SegUrl, u64>, seg: &Segment) -> Result<(), StateError> {
    for (url, used) in in_use {
        if let Some(dep) = seg.deps().get(url) {
            if dep > used {
                return Err(StateError::Inconsistent(format!(
                    "{} v{} was made from {url} v{dep}, but v{used} is in use",
                    seg.url(),
                    seg.version()
                )));
            }
        }
    }
    Ok(())
}
