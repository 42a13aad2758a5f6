//! Native Rust values as blocks, with no hand-written serialization.
//!
//! Owns the [`Typed`] trait (a type's descriptor plus its flattening into
//! primitive units and back) for primitives, `String`, `Option<Mip>`, fixed
//! arrays, and records declared through [`crate::state_record!`].
//!
//! Why a declarative macro and not a proc-macro crate: the mapping is
//! mechanical (one line per field), a `macro_rules!` expands it with no
//! `syn`/`quote` build on a shared two-core machine, and the whole mapping
//! stays readable in one file. The price: the struct is written inside the
//! macro. Must never depend on the host's memory layout.

use super::mip::Mip;
use super::types::{PrimKind, TypeDesc, Unit};

/// A Rust type that can be stored as a block or part of one.
pub trait Typed: Sized {
    /// The type descriptor stored with the block.
    fn desc() -> TypeDesc;
    /// Appends this value's units, in layout order.
    fn put(&self, out: &mut Vec<Unit>);
    /// Takes this value's units from `it`; `None` when a unit has the wrong kind
    /// or the iterator ends early.
    fn take(it: &mut std::slice::Iter<'_, Unit>) -> Option<Self>;

    /// This value as a unit vector.
    fn to_units(&self) -> Vec<Unit> {
        let mut v = Vec::new();
        self.put(&mut v);
        v
    }
}

macro_rules! prim {
    ($t:ty, $k:ident) => {
        impl Typed for $t {
            fn desc() -> TypeDesc {
                TypeDesc::Prim(PrimKind::$k)
            }
            fn put(&self, out: &mut Vec<Unit>) {
                out.push(Unit::$k(self.clone()));
            }
            fn take(it: &mut std::slice::Iter<'_, Unit>) -> Option<Self> {
                match it.next()? {
                    Unit::$k(v) => Some(v.clone()),
                    _ => None,
                }
            }
        }
    };
}

prim!(bool, Bool);
prim!(i8, I8);
prim!(i16, I16);
prim!(i32, I32);
prim!(i64, I64);
prim!(u8, U8);
prim!(u16, U16);
prim!(u32, U32);
prim!(u64, U64);
prim!(f32, F32);
prim!(f64, F64);

impl Typed for String {
    fn desc() -> TypeDesc {
        TypeDesc::Prim(PrimKind::Str)
    }
    fn put(&self, out: &mut Vec<Unit>) {
        out.push(Unit::Str(self.clone()));
    }
    fn take(it: &mut std::slice::Iter<'_, Unit>) -> Option<Self> {
        match it.next()? {
            Unit::Str(v) => Some(v.clone()),
            _ => None,
        }
    }
}

/// A pointer unit: `None` is the null pointer.
impl Typed for Option<Mip> {
    fn desc() -> TypeDesc {
        TypeDesc::Prim(PrimKind::Mip)
    }
    fn put(&self, out: &mut Vec<Unit>) {
        out.push(match self {
            Some(m) => Unit::Mip(Box::new(m.clone())),
            None => Unit::Null,
        });
    }
    fn take(it: &mut std::slice::Iter<'_, Unit>) -> Option<Self> {
        match it.next()? {
            Unit::Mip(m) => Some(Some((**m).clone())),
            Unit::Null => Some(None),
            _ => None,
        }
    }
}

impl<T: Typed, const N: usize> Typed for [T; N] {
    fn desc() -> TypeDesc {
        TypeDesc::Array {
            elem: Box::new(T::desc()),
            len: N as u32,
        }
    }
    fn put(&self, out: &mut Vec<Unit>) {
        for v in self {
            v.put(out);
        }
    }
    fn take(it: &mut std::slice::Iter<'_, Unit>) -> Option<Self> {
        let mut v = Vec::with_capacity(N);
        for _ in 0..N {
            v.push(T::take(it)?);
        }
        <[T; N]>::try_from(v).ok()
    }
}

/// Declares a struct and implements [`Typed`] for it, field by field, so its
/// values can be stored in blocks with no hand-written serialization.
///
/// ```
/// weft_state::state_record! {
///     #[derive(Debug, Clone, PartialEq)]
///     pub struct Account { pub id: u64, pub balance: i64, pub owner: String }
/// }
/// use weft_state::Typed;
/// assert_eq!(Account::desc().render(), "Account{id:u64,balance:i64,owner:string}");
/// ```
#[macro_export]
macro_rules! state_record {
    ($(#[$m:meta])* $vis:vis struct $name:ident {
        $($(#[$fm:meta])* $fvis:vis $field:ident : $ty:ty),* $(,)?
    }) => {
        $(#[$m])* $vis struct $name { $($(#[$fm])* $fvis $field: $ty),* }
        impl $crate::Typed for $name {
            fn desc() -> $crate::TypeDesc {
                $crate::TypeDesc::Record {
                    name: stringify!($name).to_string(),
                    fields: vec![$($crate::Field {
                        name: stringify!($field).to_string(),
                        ty: <$ty as $crate::Typed>::desc(),
                    }),*],
                }
            }
            fn put(&self, out: &mut Vec<$crate::Unit>) {
                $( <$ty as $crate::Typed>::put(&self.$field, out); )*
            }
            fn take(it: &mut std::slice::Iter<'_, $crate::Unit>) -> Option<Self> {
                Some($name { $($field: <$ty as $crate::Typed>::take(it)?),* })
            }
        }
    };
}
