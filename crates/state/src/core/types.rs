//! Type descriptors and primitive units.
//!
//! Owns the vocabulary every segment stores about itself: a [`TypeDesc`]
//! (primitives, fixed arrays, records, strings, machine-independent pointers)
//! and the [`Unit`], one primitive value. A block of type `T` is a flat
//! sequence of `T.units()` units in declaration order (records field by field,
//! arrays element by element); offsets in MIPs and diffs count these units,
//! never bytes, so they mean the same on every machine and in every language.
//!
//! Must never depend on the host's layout (sizes, alignment, endianness) and
//! never accept a descriptor deeper, wider or larger than [`TypeLimits`].

use serde::{Deserialize, Serialize};

use super::error::StateError;
use super::mip::Mip;

/// The kind of one primitive unit.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Serialize, Deserialize, Hash)]
pub enum PrimKind {
    /// `true` / `false`.
    Bool,
    /// Signed 8-bit integer.
    I8,
    /// Signed 16-bit integer.
    I16,
    /// Signed 32-bit integer.
    I32,
    /// Signed 64-bit integer.
    I64,
    /// Unsigned 8-bit integer.
    U8,
    /// Unsigned 16-bit integer.
    U16,
    /// Unsigned 32-bit integer.
    U32,
    /// Unsigned 64-bit integer.
    U64,
    /// IEEE-754 binary32.
    F32,
    /// IEEE-754 binary64.
    F64,
    /// A UTF-8 string of at most [`TypeLimits::max_string_bytes`] bytes; one unit.
    Str,
    /// A machine-independent pointer (`weft://node/path#block#offset`); one unit.
    Mip,
}

impl PrimKind {
    /// The name used in `weft state cat` and in docs/state.md.
    pub fn name(self) -> &'static str {
        match self {
            PrimKind::Bool => "bool",
            PrimKind::I8 => "i8",
            PrimKind::I16 => "i16",
            PrimKind::I32 => "i32",
            PrimKind::I64 => "i64",
            PrimKind::U8 => "u8",
            PrimKind::U16 => "u16",
            PrimKind::U32 => "u32",
            PrimKind::U64 => "u64",
            PrimKind::F32 => "f32",
            PrimKind::F64 => "f64",
            PrimKind::Str => "string",
            PrimKind::Mip => "mip",
        }
    }

    /// The zero value of this kind (new blocks start zeroed).
    pub fn zero(self) -> Unit {
        match self {
            PrimKind::Bool => Unit::Bool(false),
            PrimKind::I8 => Unit::I8(0),
            PrimKind::I16 => Unit::I16(0),
            PrimKind::I32 => Unit::I32(0),
            PrimKind::I64 => Unit::I64(0),
            PrimKind::U8 => Unit::U8(0),
            PrimKind::U16 => Unit::U16(0),
            PrimKind::U32 => Unit::U32(0),
            PrimKind::U64 => Unit::U64(0),
            PrimKind::F32 => Unit::F32(0.0),
            PrimKind::F64 => Unit::F64(0.0),
            PrimKind::Str => Unit::Str(String::new()),
            PrimKind::Mip => Unit::Null,
        }
    }
}

/// One field of a record.
#[derive(Clone, PartialEq, Eq, Debug, Hash)]
pub struct Field {
    /// The field's name (as in the source language).
    pub name: String,
    /// Its type.
    pub ty: TypeDesc,
}

/// A type descriptor, stored with every block. It has no serde form on
/// purpose: on the wire and disk it travels flattened (see [`super::codec`]),
/// so decoding never recurses on untrusted input.
#[derive(Clone, PartialEq, Eq, Debug, Hash)]
pub enum TypeDesc {
    /// One primitive unit.
    Prim(PrimKind),
    /// `len` elements of `elem`, laid out one after another.
    Array {
        /// The element type.
        elem: Box<TypeDesc>,
        /// Number of elements.
        len: u32,
    },
    /// Named fields in declaration order.
    Record {
        /// The record's type name.
        name: String,
        /// Its fields.
        fields: Vec<Field>,
    },
}

/// Bounds on descriptors (TigerStyle: a limit on everything).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TypeLimits {
    /// Deepest nesting of arrays and records.
    pub max_depth: u32,
    /// Most fields in one record.
    pub max_fields: u32,
    /// Most units in one block.
    pub max_block_units: u64,
    /// Longest string value, in bytes.
    pub max_string_bytes: usize,
    /// Longest name (record, field, block), in bytes.
    pub max_name_bytes: usize,
}

impl Default for TypeLimits {
    fn default() -> Self {
        TypeLimits {
            max_depth: 16,
            max_fields: 256,
            max_block_units: 1 << 22,
            max_string_bytes: 4096,
            max_name_bytes: 64,
        }
    }
}

impl TypeDesc {
    /// Number of primitive units a value of this type occupies (saturating).
    pub fn units(&self) -> u64 {
        match self {
            TypeDesc::Prim(_) => 1,
            TypeDesc::Array { elem, len } => elem.units().saturating_mul(u64::from(*len)),
            TypeDesc::Record { fields, .. } => fields
                .iter()
                .fold(0u64, |a, f| a.saturating_add(f.ty.units())),
        }
    }

    /// Checks the descriptor against `limits`: depth, field counts, names and
    /// total size. Fails with [`StateError::BadType`].
    pub fn validate(&self, limits: &TypeLimits) -> Result<(), StateError> {
        self.validate_at(limits, 0)?;
        let u = self.units();
        if u == 0 {
            return Err(StateError::BadType(
                "a block type must have at least one unit".into(),
            ));
        }
        if u > limits.max_block_units {
            return Err(StateError::BadType(format!(
                "type has {u} units, more than the limit {}",
                limits.max_block_units
            )));
        }
        Ok(())
    }

    fn validate_at(&self, limits: &TypeLimits, depth: u32) -> Result<(), StateError> {
        if depth > limits.max_depth {
            return Err(StateError::BadType(format!(
                "type nests deeper than {}",
                limits.max_depth
            )));
        }
        match self {
            TypeDesc::Prim(_) => Ok(()),
            TypeDesc::Array { elem, .. } => elem.validate_at(limits, depth + 1),
            TypeDesc::Record { name, fields } => {
                check_name(name, limits)?;
                if fields.len() > limits.max_fields as usize {
                    return Err(StateError::BadType(format!(
                        "record {name} has {} fields, more than {}",
                        fields.len(),
                        limits.max_fields
                    )));
                }
                for f in fields {
                    check_name(&f.name, limits)?;
                    f.ty.validate_at(limits, depth + 1)?;
                }
                Ok(())
            }
        }
    }

    /// The kind of the unit at `offset`, or `None` past the end. Walks the
    /// descriptor, so it costs its depth, not its size.
    pub fn kind_at(&self, offset: u64) -> Option<PrimKind> {
        match self {
            TypeDesc::Prim(k) => (offset == 0).then_some(*k),
            TypeDesc::Array { elem, len } => {
                let eu = elem.units();
                if eu == 0 || offset >= eu.saturating_mul(u64::from(*len)) {
                    return None;
                }
                elem.kind_at(offset % eu)
            }
            TypeDesc::Record { fields, .. } => {
                let mut rest = offset;
                for f in fields {
                    let fu = f.ty.units();
                    if rest < fu {
                        return f.ty.kind_at(rest);
                    }
                    rest -= fu;
                }
                None
            }
        }
    }

    /// Calls `f` with the kind of each unit of `start..start + count`, in
    /// order, stopping at its first error; returns how many units that range
    /// has inside the type (less than `count` when it runs past the end).
    /// Walks the descriptor once per range, not once per unit, so checking a
    /// run of units costs about one descriptor walk plus one call per unit.
    pub fn walk_kinds<E>(
        &self,
        start: u64,
        count: u64,
        f: &mut impl FnMut(PrimKind) -> Result<(), E>,
    ) -> Result<u64, E> {
        if count == 0 {
            return Ok(0);
        }
        match self {
            TypeDesc::Prim(k) => {
                if start != 0 {
                    return Ok(0);
                }
                f(*k)?;
                Ok(1)
            }
            TypeDesc::Array { elem, len } => {
                let eu = elem.units();
                if eu == 0 {
                    return Ok(0);
                }
                let mut i = start / eu;
                let mut off = start % eu;
                let mut done = 0u64;
                while done < count && i < u64::from(*len) {
                    let take = (eu - off).min(count - done);
                    let got = elem.walk_kinds(off, take, f)?;
                    done += got;
                    if got < take {
                        break;
                    }
                    off = 0;
                    i += 1;
                }
                Ok(done)
            }
            TypeDesc::Record { fields, .. } => {
                let mut at = 0u64;
                let mut done = 0u64;
                for fd in fields {
                    let fu = fd.ty.units();
                    let pos = start + done;
                    if pos < at.saturating_add(fu) {
                        let take = (at + fu - pos).min(count - done);
                        let got = fd.ty.walk_kinds(pos - at, take, f)?;
                        done += got;
                        if got < take || done == count {
                            break;
                        }
                    }
                    at = at.saturating_add(fu);
                }
                Ok(done)
            }
        }
    }

    /// Appends the kind of every unit, in order (the flat layout).
    pub fn layout(&self, out: &mut Vec<PrimKind>) {
        match self {
            TypeDesc::Prim(k) => out.push(*k),
            TypeDesc::Array { elem, len } => {
                let mut one = Vec::new();
                elem.layout(&mut one);
                for _ in 0..*len {
                    out.extend_from_slice(&one);
                }
            }
            TypeDesc::Record { fields, .. } => {
                for f in fields {
                    f.ty.layout(out);
                }
            }
        }
    }

    /// A zeroed value of this type.
    pub fn zeroed(&self) -> Vec<Unit> {
        let mut kinds = Vec::new();
        self.layout(&mut kinds);
        kinds.into_iter().map(PrimKind::zero).collect()
    }

    /// A one-line rendering (`Point{x:f64,y:f64}`, `[i32;4]`).
    pub fn render(&self) -> String {
        match self {
            TypeDesc::Prim(k) => k.name().to_string(),
            TypeDesc::Array { elem, len } => format!("[{};{len}]", elem.render()),
            TypeDesc::Record { name, fields } => {
                let inner: Vec<String> = fields
                    .iter()
                    .map(|f| format!("{}:{}", f.name, f.ty.render()))
                    .collect();
                format!("{name}{{{}}}", inner.join(","))
            }
        }
    }
}

/// Checks a record, field or block name: 1..=max bytes, `[A-Za-z_][A-Za-z0-9_.-]*`.
pub fn check_name(name: &str, limits: &TypeLimits) -> Result<(), StateError> {
    let ok_first = name
        .chars()
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_');
    let ok_rest = name
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-'));
    if !ok_first || !ok_rest || name.len() > limits.max_name_bytes {
        return Err(StateError::BadName(name.to_string()));
    }
    Ok(())
}

/// One primitive value. Floats compare by their bits, so a diff sees a
/// change from `NaN` to the same `NaN` as no change and `0.0` → `-0.0` as one.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum Unit {
    /// A `bool`.
    Bool(bool),
    /// An `i8`.
    I8(i8),
    /// An `i16`.
    I16(i16),
    /// An `i32`.
    I32(i32),
    /// An `i64`.
    I64(i64),
    /// A `u8`.
    U8(u8),
    /// A `u16`.
    U16(u16),
    /// A `u32`.
    U32(u32),
    /// A `u64`.
    U64(u64),
    /// An `f32`.
    F32(f32),
    /// An `f64`.
    F64(f64),
    /// A string.
    Str(String),
    /// A pointer (boxed: a MIP is large and rare, and every unit of a
    /// segment is as large as the largest variant).
    Mip(Box<Mip>),
    /// The null pointer (a MIP unit that points nowhere).
    Null,
}

impl PartialEq for Unit {
    fn eq(&self, other: &Self) -> bool {
        use Unit::*;
        match (self, other) {
            (Bool(a), Bool(b)) => a == b,
            (I8(a), I8(b)) => a == b,
            (I16(a), I16(b)) => a == b,
            (I32(a), I32(b)) => a == b,
            (I64(a), I64(b)) => a == b,
            (U8(a), U8(b)) => a == b,
            (U16(a), U16(b)) => a == b,
            (U32(a), U32(b)) => a == b,
            (U64(a), U64(b)) => a == b,
            (F32(a), F32(b)) => a.to_bits() == b.to_bits(),
            (F64(a), F64(b)) => a.to_bits() == b.to_bits(),
            (Str(a), Str(b)) => a == b,
            (Mip(a), Mip(b)) => a == b,
            (Null, Null) => true,
            _ => false,
        }
    }
}

impl Eq for Unit {}

impl Unit {
    /// The kind this value belongs to (`Null` is a MIP).
    pub fn kind(&self) -> PrimKind {
        match self {
            Unit::Bool(_) => PrimKind::Bool,
            Unit::I8(_) => PrimKind::I8,
            Unit::I16(_) => PrimKind::I16,
            Unit::I32(_) => PrimKind::I32,
            Unit::I64(_) => PrimKind::I64,
            Unit::U8(_) => PrimKind::U8,
            Unit::U16(_) => PrimKind::U16,
            Unit::U32(_) => PrimKind::U32,
            Unit::U64(_) => PrimKind::U64,
            Unit::F32(_) => PrimKind::F32,
            Unit::F64(_) => PrimKind::F64,
            Unit::Str(_) => PrimKind::Str,
            Unit::Mip(_) | Unit::Null => PrimKind::Mip,
        }
    }

    /// Checks that this value may be stored where `kind` is expected, within
    /// `limits` (string length). Fails with [`StateError::BadDiff`].
    pub fn check(&self, kind: PrimKind, limits: &TypeLimits) -> Result<(), StateError> {
        if self.kind() != kind {
            return Err(StateError::BadDiff(format!(
                "a {} value where a {} is stored",
                self.kind().name(),
                kind.name()
            )));
        }
        if let Unit::Str(s) = self {
            if s.len() > limits.max_string_bytes {
                return Err(StateError::BadDiff(format!(
                    "string of {} bytes, more than {}",
                    s.len(),
                    limits.max_string_bytes
                )));
            }
        }
        Ok(())
    }

    /// A rendering for `weft state cat` (JSON-compatible).
    pub fn render(&self) -> String {
        match self {
            Unit::Bool(v) => v.to_string(),
            Unit::I8(v) => v.to_string(),
            Unit::I16(v) => v.to_string(),
            Unit::I32(v) => v.to_string(),
            Unit::I64(v) => v.to_string(),
            Unit::U8(v) => v.to_string(),
            Unit::U16(v) => v.to_string(),
            Unit::U32(v) => v.to_string(),
            Unit::U64(v) => v.to_string(),
            Unit::F32(v) => v.to_string(),
            Unit::F64(v) => v.to_string(),
            Unit::Str(s) => format!("{s:?}"),
            Unit::Mip(m) => format!("\"{m}\""),
            Unit::Null => "null".into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn point() -> TypeDesc {
        TypeDesc::Record {
            name: "Point".into(),
            fields: vec![
                Field {
                    name: "x".into(),
                    ty: TypeDesc::Prim(PrimKind::F64),
                },
                Field {
                    name: "tag".into(),
                    ty: TypeDesc::Prim(PrimKind::Str),
                },
                Field {
                    name: "v".into(),
                    ty: TypeDesc::Array {
                        elem: Box::new(TypeDesc::Prim(PrimKind::I32)),
                        len: 3,
                    },
                },
            ],
        }
    }

    #[test]
    fn units_and_kinds_follow_declaration_order() {
        let t = TypeDesc::Array {
            elem: Box::new(point()),
            len: 2,
        };
        assert_eq!(t.units(), 10);
        assert_eq!(t.kind_at(0), Some(PrimKind::F64));
        assert_eq!(t.kind_at(1), Some(PrimKind::Str));
        assert_eq!(t.kind_at(4), Some(PrimKind::I32));
        assert_eq!(t.kind_at(5), Some(PrimKind::F64));
        assert_eq!(t.kind_at(10), None);
        let mut l = Vec::new();
        t.layout(&mut l);
        assert_eq!(l.len(), 10);
        for (i, k) in l.iter().enumerate() {
            assert_eq!(t.kind_at(i as u64), Some(*k));
        }
        assert_eq!(t.render(), "[Point{x:f64,tag:string,v:[i32;3]};2]");
    }

    #[test]
    fn walking_a_range_of_kinds_matches_the_flat_layout() {
        let t = TypeDesc::Record {
            name: "Outer".into(),
            fields: vec![
                Field {
                    name: "none".into(),
                    ty: TypeDesc::Array {
                        elem: Box::new(TypeDesc::Prim(PrimKind::U8)),
                        len: 0,
                    },
                },
                Field {
                    name: "pts".into(),
                    ty: TypeDesc::Array {
                        elem: Box::new(point()),
                        len: 3,
                    },
                },
                Field {
                    name: "last".into(),
                    ty: TypeDesc::Prim(PrimKind::Bool),
                },
            ],
        };
        let mut flat = Vec::new();
        t.layout(&mut flat);
        let n = flat.len() as u64;
        assert_eq!(n, t.units());
        for start in 0..=n + 1 {
            for count in 0..=n + 2 - start {
                let mut seen = Vec::new();
                let got = t
                    .walk_kinds(start, count, &mut |k| {
                        seen.push(k);
                        Ok::<(), ()>(())
                    })
                    .unwrap();
                let lo = start.min(n) as usize;
                let hi = (start + count).min(n) as usize;
                assert_eq!(seen, flat[lo..hi], "start {start} count {count}");
                assert_eq!(got, (hi - lo) as u64, "start {start} count {count}");
            }
        }
        // The first error stops the walk.
        let mut calls = 0;
        let r = t.walk_kinds(0, n, &mut |_| {
            calls += 1;
            if calls == 3 {
                Err("stop")
            } else {
                Ok(())
            }
        });
        assert_eq!((r, calls), (Err("stop"), 3));
    }

    #[test]
    fn limits_refuse_deep_wide_and_empty_types() {
        let lim = TypeLimits {
            max_depth: 2,
            ..TypeLimits::default()
        };
        let mut t = TypeDesc::Prim(PrimKind::U8);
        for _ in 0..4 {
            t = TypeDesc::Array {
                elem: Box::new(t),
                len: 2,
            };
        }
        assert!(matches!(t.validate(&lim), Err(StateError::BadType(_))));
        let empty = TypeDesc::Array {
            elem: Box::new(TypeDesc::Prim(PrimKind::U8)),
            len: 0,
        };
        assert!(matches!(
            empty.validate(&TypeLimits::default()),
            Err(StateError::BadType(_))
        ));
        let huge = TypeDesc::Array {
            elem: Box::new(TypeDesc::Prim(PrimKind::U8)),
            len: u32::MAX,
        };
        assert!(matches!(
            huge.validate(&TypeLimits::default()),
            Err(StateError::BadType(_))
        ));
        let bad = TypeDesc::Record {
            name: "1x".into(),
            fields: vec![],
        };
        assert!(matches!(
            bad.validate(&TypeLimits::default()),
            Err(StateError::BadName(_))
        ));
    }

    #[test]
    fn a_unit_stays_small() {
        // Every unit of a segment, a twin and a diff is this large: a MIP is
        // boxed so that a segment of integers does not pay for pointers.
        assert!(
            std::mem::size_of::<Unit>() <= 32,
            "{}",
            std::mem::size_of::<Unit>()
        );
    }

    #[test]
    fn floats_compare_by_bits() {
        assert_eq!(Unit::F64(f64::NAN), Unit::F64(f64::NAN));
        assert_ne!(Unit::F64(0.0), Unit::F64(-0.0));
        assert_ne!(Unit::I32(1), Unit::I64(1));
    }
}
