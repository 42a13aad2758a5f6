//! Applying a diff straight from its wire form (docs/state.md, "Diff").
//!
//! Owns the receiving side's fast path, with no intermediate
//! [`Diff`](super::segment::Diff). A diff of `Write`s only (the common
//! refresh) is checked and applied in one pass over its bytes, each unit
//! written as it is read with its old value kept in an undo record; when
//! anything is refused or malformed, the record puts every unit back and
//! the diff goes the general way. That way has two passes: the first
//! decodes every op, checks it against the segment and the limits (each
//! `Write` unit is checked against the layout's kind as it is read, and
//! dropped); the second, only when the first found nothing wrong, decodes
//! the `Write` runs again straight into the blocks. Either way it accepts
//! and refuses exactly what [`decode_diff`](super::codec::decode_diff)
//! followed by [`Segment::apply`] does, with the same status.
//!
//! Must leave a segment that refuses a diff exactly as it was (all or
//! nothing: unchanged, or every change undone), and never trust a length
//! before reading what it counts.

use std::collections::VecDeque;

use serde::Deserialize;

use super::codec::{deps_from, resolve_types, ty_at, WireType};
use super::error::StateError;
use super::mip::{Mip, SegUrl};
use super::segment::{Block, DiffOp, Overlay, Segment};
use super::types::{PrimKind, TypeDesc, TypeLimits, Unit};

/// Longest repeating layout kept to check a block's units by offset.
const MAX_PERIOD: u64 = 1 << 16;

/// The kinds of a block's units as one repeating period (an array's
/// element, or the whole type when short): the kind at offset `o` is
/// `period[o % period.len()]`. `None` when the period would be too long.
fn period_of(ty: &TypeDesc) -> Option<Vec<PrimKind>> {
    let one = match ty {
        TypeDesc::Array { elem, .. } => &**elem,
        t => t,
    };
    if one.units() == 0 || one.units() > MAX_PERIOD {
        return None;
    }
    let mut kinds = Vec::new();
    one.layout(&mut kinds);
    Some(kinds)
}

fn short() -> StateError {
    StateError::Decode("diff: unexpected end of input".into())
}

fn bad(what: &str) -> StateError {
    StateError::Decode(format!("diff: {what}"))
}

/// Reads postcard 1.x's primitive forms from a byte slice (the rules
/// postcard's own deserializer applies, so both accept the same bytes).
struct Cursor<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Cursor<'a> {
    #[inline]
    fn byte(&mut self) -> Result<u8, StateError> {
        let v = *self.b.get(self.at).ok_or_else(short)?;
        self.at += 1;
        Ok(v)
    }

    #[inline]
    fn take(&mut self, n: usize) -> Result<&'a [u8], StateError> {
        let end = self
            .at
            .checked_add(n)
            .filter(|e| *e <= self.b.len())
            .ok_or_else(short)?;
        let s = &self.b[self.at..end];
        self.at = end;
        Ok(s)
    }

    /// An unsigned LEB128 varint of at most `max` bytes, whose last byte
    /// (the `max`th) carries at most `last` (the bits the type has left).
    #[inline]
    fn varint(&mut self, max: u32, last: u8) -> Result<u64, StateError> {
        // One byte (every tag and most lengths): `max` is at least 3, so the
        // last-byte rule cannot apply to it.
        if let Some(&v) = self.b.get(self.at) {
            if v & 0x80 == 0 {
                self.at += 1;
                return Ok(u64::from(v));
            }
        }
        self.varint_long(max, last)
    }

    #[inline(never)]
    fn varint_long(&mut self, max: u32, last: u8) -> Result<u64, StateError> {
        let mut out = 0u64;
        for i in 0..max {
            let v = self.byte()?;
            out |= u64::from(v & 0x7f) << (7 * i);
            if v & 0x80 == 0 {
                if i == max - 1 && v > last {
                    return Err(bad("bad varint"));
                }
                return Ok(out);
            }
        }
        Err(bad("bad varint"))
    }

    #[inline]
    fn u16(&mut self) -> Result<u16, StateError> {
        Ok(self.varint(3, 0b11)? as u16)
    }

    #[inline]
    fn u32(&mut self) -> Result<u32, StateError> {
        Ok(self.varint(5, 0b1111)? as u32)
    }

    #[inline]
    fn u64(&mut self) -> Result<u64, StateError> {
        self.varint(10, 0b1)
    }

    #[inline]
    fn len(&mut self) -> Result<usize, StateError> {
        usize::try_from(self.u64()?).map_err(|_| bad("length out of range"))
    }

    #[inline]
    fn bytes<const N: usize>(&mut self) -> Result<[u8; N], StateError> {
        let s = self.take(N)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    /// A postcard value of a type with serde's derive (the rare, nested parts).
    fn value<T: Deserialize<'a>>(&mut self) -> Result<T, StateError> {
        let (v, rest) = postcard::take_from_bytes::<T>(&self.b[self.at..])
            .map_err(|e| StateError::Decode(format!("diff: {e}")))?;
        self.at = self.b.len() - rest.len();
        Ok(v)
    }

    /// One [`Unit`] (the enum's variants in declaration order).
    fn unit(&mut self) -> Result<Unit, StateError> {
        let tag = self.u32()?;
        self.unit_body(tag)
    }

    /// The value of a [`Unit`] whose variant index `tag` was just read.
    fn unit_body(&mut self, tag: u32) -> Result<Unit, StateError> {
        Ok(match tag {
            0 => Unit::Bool(self.bool()?),
            1 => Unit::I8(self.byte()? as i8),
            2 => Unit::I16(unzigzag16(self.u16()?)),
            3 => Unit::I32(unzigzag32(self.u32()?)),
            4 => Unit::I64(unzigzag64(self.u64()?)),
            5 => Unit::U8(self.byte()?),
            6 => Unit::U16(self.u16()?),
            7 => Unit::U32(self.u32()?),
            8 => Unit::U64(self.u64()?),
            9 => Unit::F32(f32::from_le_bytes(self.bytes()?)),
            10 => Unit::F64(f64::from_le_bytes(self.bytes()?)),
            11 => {
                let n = self.len()?;
                let s = std::str::from_utf8(self.take(n)?).map_err(|_| bad("bad UTF-8"))?;
                Unit::Str(s.to_string())
            }
            12 => Unit::Mip(Box::new(self.value::<Mip>()?)),
            13 => Unit::Null,
            v => return Err(bad(&format!("unit variant {v}"))),
        })
    }

    #[inline]
    fn bool(&mut self) -> Result<bool, StateError> {
        match self.byte()? {
            0 => Ok(false),
            1 => Ok(true),
            _ => Err(bad("bad bool")),
        }
    }

    /// Checks the next unit where the layout stores `kind`, reading it as
    /// [`Cursor::unit`] would but building no value when its variant is
    /// the kind's own fixed-size one (the common case). `Ok(Some(e))`: the
    /// bytes are well formed but the unit does not fit (`Unit::check`'s
    /// error); `Err`: the bytes are malformed.
    #[inline]
    fn check_unit(
        &mut self,
        kind: PrimKind,
        lim: &TypeLimits,
    ) -> Result<Option<StateError>, StateError> {
        let tag = self.u32()?;
        match (tag, kind) {
            (0, PrimKind::Bool) => {
                self.bool()?;
            }
            (1, PrimKind::I8) | (5, PrimKind::U8) => {
                self.byte()?;
            }
            (2, PrimKind::I16) | (6, PrimKind::U16) => {
                self.u16()?;
            }
            (3, PrimKind::I32) | (7, PrimKind::U32) => {
                self.u32()?;
            }
            (4, PrimKind::I64) | (8, PrimKind::U64) => {
                self.u64()?;
            }
            (9, PrimKind::F32) => {
                self.take(4)?;
            }
            (10, PrimKind::F64) => {
                self.take(8)?;
            }
            _ => return Ok(self.unit_body(tag)?.check(kind, lim).err()),
        }
        Ok(None)
    }

    /// Reads the value of a unit tagged `tag` into `slot` in place when the
    /// slot holds that same fixed-size variant (no value built, none
    /// dropped); false, reading nothing, otherwise.
    #[inline]
    fn fixed_into(&mut self, tag: u32, slot: &mut Unit) -> Result<bool, StateError> {
        match (tag, slot) {
            (0, Unit::Bool(x)) => *x = self.bool()?,
            (1, Unit::I8(x)) => *x = self.byte()? as i8,
            (2, Unit::I16(x)) => *x = unzigzag16(self.u16()?),
            (3, Unit::I32(x)) => *x = unzigzag32(self.u32()?),
            (4, Unit::I64(x)) => *x = unzigzag64(self.u64()?),
            (5, Unit::U8(x)) => *x = self.byte()?,
            (6, Unit::U16(x)) => *x = self.u16()?,
            (7, Unit::U32(x)) => *x = self.u32()?,
            (8, Unit::U64(x)) => *x = self.u64()?,
            (9, Unit::F32(x)) => *x = f32::from_le_bytes(self.bytes()?),
            (10, Unit::F64(x)) => *x = f64::from_le_bytes(self.bytes()?),
            _ => return Ok(false),
        }
        Ok(true)
    }

    /// Reads the next unit into `slot`, in place when the slot already
    /// holds the same fixed-size variant (no value built, none dropped).
    #[inline]
    fn unit_into(&mut self, slot: &mut Unit) -> Result<(), StateError> {
        let tag = self.u32()?;
        if !self.fixed_into(tag, slot)? {
            *slot = self.unit_body(tag)?;
        }
        Ok(())
    }

    /// Reads the next unit over `slot` when it is of the slot's kind (and
    /// within the limits), keeping the old value in `undo`. Fails (with
    /// nothing written for this unit) when the bytes are malformed or the
    /// unit is of another kind; the error says no more than that.
    #[inline]
    fn unit_over(
        &mut self,
        slot: &mut Unit,
        undo: &mut Undo,
        lim: &TypeLimits,
    ) -> Result<(), StateError> {
        let tag = self.u32()?;
        let old = bits_of(slot);
        if self.fixed_into(tag, slot)? {
            // Written in place: the slot keeps its fixed-size variant.
            undo.bits.push(old.unwrap_or(0));
            return Ok(());
        }
        match slot {
            Unit::Str(_) | Unit::Mip(_) | Unit::Null => {
                let u = self.unit_body(tag)?;
                u.check(slot.kind(), lim)?;
                undo.bits.push(0);
                undo.whole.push(std::mem::replace(slot, u));
                Ok(())
            }
            _ => Err(bad("a unit of another kind")),
        }
    }
}

fn unzigzag16(n: u16) -> i16 {
    ((n >> 1) as i16) ^ (-((n & 1) as i16))
}

fn unzigzag32(n: u32) -> i32 {
    ((n >> 1) as i32) ^ (-((n & 1) as i32))
}

fn unzigzag64(n: u64) -> i64 {
    ((n >> 1) as i64) ^ (-((n & 1) as i64))
}

/// The fields of a diff before its ops (postcard encodes a struct as its
/// fields in order, so this prefix decodes on its own).
#[derive(Deserialize)]
struct Head {
    base: u64,
    target: u64,
    deps: Vec<(SegUrl, u64)>,
    next_serial: u32,
    types: Vec<WireType>,
}

/// Why a unit check stopped: the bytes are malformed (the diff is refused
/// at once) or the unit does not fit (reported once the bytes are known
/// well formed, as a decode-then-check would).
enum Stop {
    Decode(StateError),
    Check(StateError),
}

/// Applies the wire form of a diff of at most `max_bytes` to `seg`, all or
/// nothing. Fails with [`StateError::LimitExceeded`] or
/// [`StateError::Decode`] for the bytes, then the [`Segment::check`]
/// statuses; `seg` is untouched on failure.
pub fn apply_diff_bytes(
    seg: &mut Segment,
    bytes: &[u8],
    max_bytes: usize,
) -> Result<(), StateError> {
    if bytes.len() > max_bytes {
        return Err(StateError::LimitExceeded(format!(
            "diff of {} bytes, more than {max_bytes}",
            bytes.len()
        )));
    }
    UNDO.with(|u| {
        let mut undo = u.take();
        let done = apply_writes_in_one_pass(seg, bytes, &mut undo);
        undo.clear();
        if undo.is_small() {
            u.set(undo);
        }
        if done {
            Ok(())
        } else {
            apply_in_two_passes(seg, bytes)
        }
    })
}

/// Longest undo record (in units, or runs) a thread keeps for the next
/// apply: a larger one, left by a rare huge diff, is freed.
const KEEP_UNDO_UNITS: usize = 1 << 20;

thread_local! {
    /// The undo record's buffers, kept from one apply to the next: a
    /// refresh of a whole segment writes hundreds of KB of them, and fresh
    /// memory for each would cost its page faults every time.
    static UNDO: std::cell::Cell<Undo> = std::cell::Cell::new(Undo::default());
}

/// What a one-pass apply overwrote, to put back when a later part of the
/// diff is refused.
#[derive(Default)]
struct Undo {
    /// `(serial, start, units written)` of each run, in order.
    runs: Vec<(u32, usize, usize)>,
    /// One entry per unit written, in order: the old value's bits for a
    /// fixed-size unit (0 for a string or MIP).
    bits: Vec<u64>,
    /// The old values of the strings and MIPs written, in order.
    whole: Vec<Unit>,
}

impl Undo {
    /// True when its buffers are worth keeping (at most 8 MiB of bits,
    /// 24 MiB of runs and 32 MiB of strings' and MIPs' slots).
    fn is_small(&self) -> bool {
        self.bits.capacity() <= KEEP_UNDO_UNITS
            && self.runs.capacity() <= KEEP_UNDO_UNITS
            && self.whole.capacity() <= KEEP_UNDO_UNITS
    }

    fn clear(&mut self) {
        self.runs.clear();
        self.bits.clear();
        self.whole.clear();
    }

    /// Puts back every unit written, newest first (a diff chained from
    /// several may write a unit twice): `seg` is again what it was.
    fn restore(&mut self, seg: &mut Segment) {
        for &(serial, start, n) in self.runs.iter().rev() {
            let data = seg
                .block_data_mut(serial)
                .expect("a block written to is still there");
            for slot in data[start..start + n].iter_mut().rev() {
                let b = self.bits.pop().expect("one entry per unit written");
                if !set_bits(slot, b) {
                    *slot = self.whole.pop().expect("one value per string or MIP");
                }
            }
        }
        self.clear();
    }
}

/// The bits of a fixed-size unit (`None` for a string or MIP).
#[inline]
fn bits_of(u: &Unit) -> Option<u64> {
    Some(match *u {
        Unit::Bool(x) => u64::from(x),
        Unit::I8(x) => x as u8 as u64,
        Unit::I16(x) => x as u16 as u64,
        Unit::I32(x) => x as u32 as u64,
        Unit::I64(x) => x as u64,
        Unit::U8(x) => u64::from(x),
        Unit::U16(x) => u64::from(x),
        Unit::U32(x) => u64::from(x),
        Unit::U64(x) => x,
        Unit::F32(x) => u64::from(x.to_bits()),
        Unit::F64(x) => x.to_bits(),
        Unit::Str(_) | Unit::Mip(_) | Unit::Null => return None,
    })
}

/// Sets a fixed-size unit from [`bits_of`]'s form, keeping its variant;
/// `false` (nothing done) for a string or MIP.
#[inline]
fn set_bits(u: &mut Unit, b: u64) -> bool {
    match u {
        Unit::Bool(x) => *x = b != 0,
        Unit::I8(x) => *x = b as u8 as i8,
        Unit::I16(x) => *x = b as u16 as i16,
        Unit::I32(x) => *x = b as u32 as i32,
        Unit::I64(x) => *x = b as i64,
        Unit::U8(x) => *x = b as u8,
        Unit::U16(x) => *x = b as u16,
        Unit::U32(x) => *x = b as u32,
        Unit::U64(x) => *x = b,
        Unit::F32(x) => *x = f32::from_bits(b as u32),
        Unit::F64(x) => *x = f64::from_bits(b),
        Unit::Str(_) | Unit::Mip(_) | Unit::Null => return false,
    }
    true
}

/// The common refresh, a diff of `Write`s only, checked and applied in one
/// pass over its bytes: each unit is written as it is read, its old value
/// kept in `undo`. `true`: the whole diff was well formed, fitted, and is
/// applied. `false`: `seg` is as before (anything written was put back)
/// and the diff is for [`apply_in_two_passes`] to apply or refuse, with the
/// status it gives: one holding an `Alloc` or `Free`, refused, or malformed.
///
/// A slot holds a value of its layout's kind (every path into a segment
/// checks it), so a unit of the slot's own variant is of the layout's
/// kind: the layout is not walked.
fn apply_writes_in_one_pass(seg: &mut Segment, bytes: &[u8], undo: &mut Undo) -> bool {
    let Ok((head, rest)) = postcard::take_from_bytes::<Head>(bytes) else {
        return false;
    };
    let mut cur = Cursor {
        b: bytes,
        at: bytes.len() - rest.len(),
    };
    let Ok(nops) = cur.len() else {
        return false;
    };
    if resolve_types(&head.types).is_err() {
        return false;
    }
    let Ok(deps) = deps_from(head.deps) else {
        return false;
    };
    // A diff that does not apply to this version goes no further (the
    // units' limit is checked once they are counted).
    if seg
        .check_head(head.base, head.target, nops, 0, head.next_serial, &deps)
        .is_err()
    {
        return false;
    }
    let lim = seg.limits().types;
    let mut units = 0u64;
    let mut whole = true;
    // The block the last run wrote to (a refresh's runs are mostly in one
    // block: one lookup, not one per run).
    let mut block: Option<(u32, &mut Vec<Unit>)> = None;
    for _ in 0..nops {
        if !matches!(cur.u32(), Ok(2)) {
            whole = false;
            break;
        }
        // (Three `Result`s in one tuple are copied about whole on every run.)
        let run = (|| Some((cur.u32().ok()?, cur.len().ok()?, cur.len().ok()?)))();
        let Some((serial, start, n)) = run else {
            whole = false;
            break;
        };
        units = units.saturating_add(n as u64);
        if block.as_ref().is_none_or(|(s, _)| *s != serial) {
            block = seg.block_data_mut(serial).map(|d| (serial, d));
        }
        // Every unit takes at least one byte: a count past what is left
        // cannot be whole (and must not size the undo record).
        let left = bytes.len() - cur.at;
        let fits = |len: usize| n > 0 && n <= left && n <= len && start <= len - n;
        let Some((_, data)) = block.as_mut().filter(|(_, d)| fits(d.len())) else {
            whole = false;
            break;
        };
        undo.bits.reserve(n);
        let mut written = 0;
        for slot in &mut data[start..start + n] {
            if cur.unit_over(slot, undo, &lim).is_err() {
                break;
            }
            written += 1;
        }
        undo.runs.push((serial, start, written));
        if written < n {
            whole = false;
            break;
        }
    }
    if !whole
        || cur.at != bytes.len()
        || seg
            .check_head(head.base, head.target, nops, units, head.next_serial, &deps)
            .is_err()
    {
        undo.restore(seg);
        return false;
    }
    seg.finish_diff(head.target, head.next_serial, &deps);
    true
}

/// [`apply_diff_bytes`] for any diff, in two passes: decode and check
/// everything, then (only when nothing was refused) apply.
fn apply_in_two_passes(seg: &mut Segment, bytes: &[u8]) -> Result<(), StateError> {
    let (head, rest) = postcard::take_from_bytes::<Head>(bytes)
        .map_err(|e| StateError::Decode(format!("diff: {e}")))?;
    let mut cur = Cursor {
        b: bytes,
        at: bytes.len() - rest.len(),
    };
    let nops = cur.len()?;
    let ops_at = cur.at;
    let types = resolve_types(&head.types)?;
    let lim = seg.limits().types;

    // Pass 1: decode and check everything; keep only the allocations.
    let mut allocs = VecDeque::new();
    let mut units = 0u64;
    let mut refused: Option<StateError> = None;
    let mut ov = Overlay::new(seg);
    // The block the last write checked, its units and layout period (reset
    // by every Alloc and Free, which change what is live).
    let mut last: Option<(u32, u64, Option<Vec<PrimKind>>)> = None;
    for _ in 0..nops {
        let op = cur.u32()?;
        if op != 2 {
            last = None;
        }
        match op {
            0 => {
                let (serial, name, ty, data) =
                    cur.value::<(u32, Option<String>, u32, Vec<Unit>)>()?;
                let ty = ty_at(&types, ty)?;
                units = units.saturating_add(data.len() as u64);
                if refused.is_none() {
                    refused = ov.check_alloc(serial, &name, &ty, &data).err();
                }
                allocs.push_back((cur.at, serial, Block { name, ty, data }));
            }
            1 => {
                let serial = cur.u32()?;
                if refused.is_none() {
                    refused = ov.check_free(serial).err();
                }
            }
            2 => {
                let serial = cur.u32()?;
                let start = cur.u64()?;
                let n = cur.len()? as u64;
                units = units.saturating_add(n);
                let mut read = 0u64;
                let fits = |units: u64| n > 0 && start.checked_add(n).is_some_and(|e| e <= units);
                let cached = match &last {
                    Some((s, units, Some(period))) if *s == serial && fits(*units) => Some(period),
                    _ => None,
                };
                if let (None, Some(period)) = (&refused, cached) {
                    // The same block as the last write: check by period.
                    let p = period.len() as u64;
                    let mut at = start % p;
                    while read < n {
                        let misfit = cur.check_unit(period[at as usize], &lim)?;
                        read += 1;
                        if misfit.is_some() {
                            refused = misfit;
                            break;
                        }
                        at += 1;
                        if at == p {
                            at = 0;
                        }
                    }
                } else if refused.is_none() {
                    match ov.write_type(serial, start, n) {
                        Ok(ty) => {
                            let walked = ty.walk_kinds(start, n, &mut |k| {
                                let u = cur.unit().map_err(Stop::Decode)?;
                                read += 1;
                                u.check(k, &lim).map_err(Stop::Check)
                            });
                            last = Some((serial, ty.units(), period_of(&ty)));
                            match walked {
                                Ok(seen) if seen == n => {}
                                Ok(_) => {
                                    refused = Some(StateError::BadDiff("write past the end".into()))
                                }
                                Err(Stop::Decode(e)) => return Err(e),
                                Err(Stop::Check(e)) => refused = Some(e),
                            }
                        }
                        Err(e) => refused = Some(e),
                    }
                }
                // What was not checked is still read: the bytes must be whole.
                for _ in read..n {
                    cur.unit()?;
                }
            }
            v => return Err(bad(&format!("op variant {v}"))),
        }
    }
    if cur.at != bytes.len() {
        return Err(bad(&format!("{} trailing bytes", bytes.len() - cur.at)));
    }
    let deps = deps_from(head.deps)?;
    seg.check_head(head.base, head.target, nops, units, head.next_serial, &deps)?;
    if let Some(e) = refused {
        return Err(e);
    }

    // Pass 2: the same ops again, applied. Every read below succeeded in
    // pass 1 on the same bytes, so none of its `?` can leave a half-applied
    // diff behind.
    let mut cur = Cursor {
        b: bytes,
        at: ops_at,
    };
    let fail = || StateError::Decode("diff: changed between passes".into());
    for _ in 0..nops {
        match cur.u32()? {
            0 => {
                let (end, serial, block) = allocs.pop_front().ok_or_else(fail)?;
                cur.at = end;
                seg.insert_block(serial, block);
            }
            1 => {
                let serial = cur.u32()?;
                seg.apply_op(&DiffOp::Free { serial });
            }
            _ => {
                let serial = cur.u32()?;
                let start = cur.u64()? as usize;
                let n = cur.len()?;
                let data = seg.block_data_mut(serial).ok_or_else(fail)?;
                for slot in &mut data[start..start + n] {
                    cur.unit_into(slot)?;
                }
            }
        }
    }
    seg.finish_diff(head.target, head.next_serial, &deps);
    Ok(())
}
