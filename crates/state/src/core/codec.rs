//! The machine-independent wire and disk forms of diffs and segment images.
//!
//! Owns the bytes another language must produce and read (specified in
//! docs/state.md): postcard encoding (varints, zigzag for signed integers,
//! little-endian IEEE floats, length-prefixed UTF-8) of flat structures in
//! which type descriptors travel as a table of nodes, each referring only to
//! earlier nodes — decoding never recurses on untrusted input. On disk a
//! body is framed with a magic, a kind, its length and a CRC-32C.
//!
//! Must never trust a length, a reference or a descriptor before checking it,
//! and never materialize a descriptor larger than [`MAX_TYPE_NODES`].

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::error::StateError;
use super::mip::SegUrl;
use super::segment::{Block, Diff, DiffOp, Segment, SegmentImage};
use super::types::{Field, PrimKind, TypeDesc, Unit};

/// Most nodes in one materialized type descriptor.
pub const MAX_TYPE_NODES: u64 = 4096;
/// Most entries in a type table.
pub const MAX_TYPE_TABLE: usize = 4096;
/// Deepest descriptor accepted from the wire (before the segment's own limits).
pub const MAX_WIRE_DEPTH: u32 = 32;
/// Disk frame magic.
pub const FRAME_MAGIC: [u8; 4] = *b"WSEG";
/// Disk frame format version.
pub const FRAME_VERSION: u8 = 1;
/// Bytes before a frame's body.
pub const FRAME_HEADER: usize = 4 + 1 + 1 + 4 + 4;

/// A type table node: refers to earlier nodes by index.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum WireType {
    /// A primitive.
    Prim(PrimKind),
    /// An array of node `elem`.
    Array {
        /// Element node index.
        elem: u32,
        /// Length.
        len: u32,
    },
    /// A record whose fields are (name, node index).
    Record {
        /// Type name.
        name: String,
        /// Fields.
        fields: Vec<(String, u32)>,
    },
}

#[derive(Serialize, Deserialize)]
enum WireOp {
    Alloc {
        serial: u32,
        name: Option<String>,
        ty: u32,
        data: Vec<Unit>,
    },
    Free {
        serial: u32,
    },
    Write {
        serial: u32,
        start: u64,
        units: Vec<Unit>,
    },
}

#[derive(Serialize, Deserialize)]
struct WireDiff {
    base: u64,
    target: u64,
    deps: Vec<(SegUrl, u64)>,
    next_serial: u32,
    types: Vec<WireType>,
    ops: Vec<WireOp>,
}

#[derive(Serialize, Deserialize)]
struct WireBlock {
    serial: u32,
    name: Option<String>,
    ty: u32,
    data: Vec<Unit>,
}

#[derive(Serialize, Deserialize)]
struct WireImage {
    url: SegUrl,
    version: u64,
    next_serial: u32,
    deps: Vec<(SegUrl, u64)>,
    types: Vec<WireType>,
    blocks: Vec<WireBlock>,
}

#[derive(Default)]
struct Interner {
    nodes: Vec<WireType>,
    seen: HashMap<TypeDesc, u32>,
}

impl Interner {
    fn intern(&mut self, t: &TypeDesc) -> u32 {
        if let Some(i) = self.seen.get(t) {
            return *i;
        }
        let node = match t {
            TypeDesc::Prim(k) => WireType::Prim(*k),
            TypeDesc::Array { elem, len } => WireType::Array {
                elem: self.intern(elem),
                len: *len,
            },
            TypeDesc::Record { name, fields } => WireType::Record {
                name: name.clone(),
                fields: fields
                    .iter()
                    .map(|f| (f.name.clone(), self.intern(&f.ty)))
                    .collect(),
            },
        };
        let i = self.nodes.len() as u32;
        self.nodes.push(node);
        self.seen.insert(t.clone(), i);
        i
    }
}

/// Materializes a type table, checking references, depth and size.
pub(crate) fn resolve_types(nodes: &[WireType]) -> Result<Vec<Arc<TypeDesc>>, StateError> {
    if nodes.len() > MAX_TYPE_TABLE {
        return Err(StateError::Decode(format!(
            "type table of {} nodes",
            nodes.len()
        )));
    }
    let mut out: Vec<Arc<TypeDesc>> = Vec::with_capacity(nodes.len());
    // (materialized node count, depth) per entry.
    let mut size: Vec<(u64, u32)> = Vec::with_capacity(nodes.len());
    let earlier = |i: u32, n: usize| -> Result<usize, StateError> {
        if (i as usize) < n {
            Ok(i as usize)
        } else {
            Err(StateError::Decode(format!(
                "type node refers forward to {i}"
            )))
        }
    };
    for (n, node) in nodes.iter().enumerate() {
        let (t, sz, depth) = match node {
            WireType::Prim(k) => (TypeDesc::Prim(*k), 1u64, 0u32),
            WireType::Array { elem, len } => {
                let e = earlier(*elem, n)?;
                (
                    TypeDesc::Array {
                        elem: Box::new((*out[e]).clone()),
                        len: *len,
                    },
                    size[e].0 + 1,
                    size[e].1 + 1,
                )
            }
            WireType::Record { name, fields } => {
                let mut sz = 1u64;
                let mut depth = 0u32;
                for (_, f) in fields {
                    let e = earlier(*f, n)?;
                    sz = sz.saturating_add(size[e].0);
                    depth = depth.max(size[e].1 + 1);
                }
                if sz > MAX_TYPE_NODES {
                    return Err(StateError::Decode(format!(
                        "type of more than {MAX_TYPE_NODES} nodes"
                    )));
                }
                let fields = fields
                    .iter()
                    .map(|(fname, f)| Field {
                        name: fname.clone(),
                        ty: (*out[*f as usize]).clone(),
                    })
                    .collect();
                (
                    TypeDesc::Record {
                        name: name.clone(),
                        fields,
                    },
                    sz,
                    depth,
                )
            }
        };
        if sz > MAX_TYPE_NODES || depth > MAX_WIRE_DEPTH {
            return Err(StateError::Decode(
                "type descriptor too large or deep".into(),
            ));
        }
        out.push(Arc::new(t));
        size.push((sz, depth));
    }
    Ok(out)
}

pub(crate) fn ty_at(types: &[Arc<TypeDesc>], i: u32) -> Result<Arc<TypeDesc>, StateError> {
    types
        .get(i as usize)
        .cloned()
        .ok_or_else(|| StateError::Decode(format!("no type node {i}")))
}

pub(crate) fn deps_from(v: Vec<(SegUrl, u64)>) -> Result<BTreeMap<SegUrl, u64>, StateError> {
    let n = v.len();
    let m: BTreeMap<_, _> = v.into_iter().collect();
    if m.len() != n {
        return Err(StateError::Decode("duplicate dependency".into()));
    }
    Ok(m)
}

fn decode_body<'a, T: Deserialize<'a>>(
    bytes: &'a [u8],
    max: usize,
    what: &str,
) -> Result<T, StateError> {
    if bytes.len() > max {
        return Err(StateError::LimitExceeded(format!(
            "{what} of {} bytes, more than {max}",
            bytes.len()
        )));
    }
    let (v, rest) =
        postcard::take_from_bytes(bytes).map_err(|e| StateError::Decode(format!("{what}: {e}")))?;
    if !rest.is_empty() {
        return Err(StateError::Decode(format!(
            "{what}: {} trailing bytes",
            rest.len()
        )));
    }
    Ok(v)
}

#[derive(Serialize)]
enum WireOpRef<'a> {
    Alloc {
        serial: u32,
        name: &'a Option<String>,
        ty: u32,
        data: &'a [Unit],
    },
    Free {
        serial: u32,
    },
    Write {
        serial: u32,
        start: u64,
        units: &'a [Unit],
    },
}

#[derive(Serialize)]
struct WireDiffRef<'a> {
    base: u64,
    target: u64,
    deps: Vec<(&'a SegUrl, u64)>,
    next_serial: u32,
    types: Vec<WireType>,
    ops: Vec<WireOpRef<'a>>,
}

/// The wire form of a diff (encoded straight from it: no unit is copied).
pub fn encode_diff(d: &Diff) -> Vec<u8> {
    let mut it = Interner::default();
    let ops = d
        .ops
        .iter()
        .map(|op| match op {
            DiffOp::Alloc {
                serial,
                name,
                ty,
                data,
            } => WireOpRef::Alloc {
                serial: *serial,
                name,
                ty: it.intern(ty),
                data,
            },
            DiffOp::Free { serial } => WireOpRef::Free { serial: *serial },
            DiffOp::Write {
                serial,
                start,
                units,
            } => WireOpRef::Write {
                serial: *serial,
                start: *start,
                units,
            },
        })
        .collect();
    let w = WireDiffRef {
        base: d.base,
        target: d.target,
        deps: d.deps.iter().map(|(u, v)| (u, *v)).collect(),
        next_serial: d.next_serial,
        types: it.nodes,
        ops,
    };
    // Sized up front (a unit is at most 10 bytes unless it is a string or a
    // MIP, an op's header about 8): a large diff is not copied as it grows.
    let guess = 64 + d.ops.len() * 8 + (d.units() as usize).saturating_mul(10);
    postcard::to_extend(&w, Vec::with_capacity(guess.min(1 << 26))).expect("a diff always encodes")
}

/// Decodes a diff of at most `max_bytes`. Fails with
/// [`StateError::LimitExceeded`] or [`StateError::Decode`]; the diff's fit to
/// a segment is checked when it is applied.
pub fn decode_diff(bytes: &[u8], max_bytes: usize) -> Result<Diff, StateError> {
    let w: WireDiff = decode_body(bytes, max_bytes, "diff")?;
    let types = resolve_types(&w.types)?;
    let mut ops = Vec::with_capacity(w.ops.len());
    for op in w.ops {
        ops.push(match op {
            WireOp::Alloc {
                serial,
                name,
                ty,
                data,
            } => DiffOp::Alloc {
                serial,
                name,
                ty: ty_at(&types, ty)?,
                data,
            },
            WireOp::Free { serial } => DiffOp::Free { serial },
            WireOp::Write {
                serial,
                start,
                units,
            } => DiffOp::Write {
                serial,
                start,
                units,
            },
        });
    }
    Ok(Diff {
        base: w.base,
        target: w.target,
        deps: deps_from(w.deps)?,
        next_serial: w.next_serial,
        ops,
    })
}

/// The wire form of a whole segment.
pub fn encode_image(img: &SegmentImage) -> Vec<u8> {
    let mut it = Interner::default();
    let blocks = img
        .blocks
        .iter()
        .map(|(s, b)| WireBlock {
            serial: *s,
            name: b.name.clone(),
            ty: it.intern(&b.ty),
            data: b.data.clone(),
        })
        .collect();
    let w = WireImage {
        url: img.url.clone(),
        version: img.version,
        next_serial: img.next_serial,
        deps: img.deps.iter().map(|(u, v)| (u.clone(), *v)).collect(),
        types: it.nodes,
        blocks,
    };
    postcard::to_allocvec(&w).expect("an image always encodes")
}

#[derive(Serialize)]
struct WireBlockRef<'a> {
    serial: u32,
    name: &'a Option<String>,
    ty: u32,
    data: &'a [Unit],
}

#[derive(Serialize)]
struct WireImageRef<'a> {
    url: &'a SegUrl,
    version: u64,
    next_serial: u32,
    deps: Vec<(&'a SegUrl, u64)>,
    types: Vec<WireType>,
    blocks: Vec<WireBlockRef<'a>>,
}

/// The wire form of a whole segment, encoded straight from a copy (the same
/// bytes as [`encode_image`] of its image, without copying its blocks).
pub fn encode_segment(seg: &Segment) -> Vec<u8> {
    let mut it = Interner::default();
    let blocks = seg
        .blocks()
        .map(|(s, b)| WireBlockRef {
            serial: s,
            name: &b.name,
            ty: it.intern(&b.ty),
            data: &b.data,
        })
        .collect();
    let w = WireImageRef {
        url: seg.url(),
        version: seg.version(),
        next_serial: seg.next_serial(),
        deps: seg.deps().iter().map(|(u, v)| (u, *v)).collect(),
        types: it.nodes,
        blocks,
    };
    postcard::to_allocvec(&w).expect("a segment always encodes")
}

/// Decodes a segment image of at most `max_bytes` (checked further by
/// [`super::segment::Segment::from_image`]).
pub fn decode_image(bytes: &[u8], max_bytes: usize) -> Result<SegmentImage, StateError> {
    let w: WireImage = decode_body(bytes, max_bytes, "image")?;
    let types = resolve_types(&w.types)?;
    let mut blocks = Vec::with_capacity(w.blocks.len());
    let mut last = 0u32;
    for b in w.blocks {
        if b.serial <= last {
            return Err(StateError::Decode("image blocks out of order".into()));
        }
        last = b.serial;
        blocks.push((
            b.serial,
            Block {
                name: b.name,
                ty: ty_at(&types, b.ty)?,
                data: b.data,
            },
        ));
    }
    Ok(SegmentImage {
        url: w.url,
        version: w.version,
        next_serial: w.next_serial,
        deps: deps_from(w.deps)?,
        blocks,
    })
}

/// What a disk frame holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FrameKind {
    /// A segment image (checkpoint).
    Image = 1,
    /// A diff.
    Diff = 2,
}

/// Frames `body` for disk: magic, version, kind, length (u32 LE), CRC-32C of
/// the body (u32 LE), body.
pub fn frame(kind: FrameKind, body: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(FRAME_HEADER + body.len());
    out.extend_from_slice(&FRAME_MAGIC);
    out.push(FRAME_VERSION);
    out.push(kind as u8);
    out.extend_from_slice(&(body.len() as u32).to_le_bytes());
    out.extend_from_slice(&crc32c::crc32c(body).to_le_bytes());
    out.extend_from_slice(body);
    out
}

/// Checks a disk frame and returns its kind and body. Fails with
/// [`StateError::Decode`] on a bad magic, version, kind, length or checksum.
pub fn unframe(bytes: &[u8]) -> Result<(FrameKind, &[u8]), StateError> {
    let bad = |w: &str| StateError::Decode(format!("frame: {w}"));
    if bytes.len() < FRAME_HEADER || bytes[..4] != FRAME_MAGIC {
        return Err(bad("magic"));
    }
    if bytes[4] != FRAME_VERSION {
        return Err(bad("version"));
    }
    let kind = match bytes[5] {
        1 => FrameKind::Image,
        2 => FrameKind::Diff,
        _ => return Err(bad("kind")),
    };
    let len = u32::from_le_bytes(bytes[6..10].try_into().expect("4 bytes")) as usize;
    let crc = u32::from_le_bytes(bytes[10..14].try_into().expect("4 bytes"));
    let body = &bytes[FRAME_HEADER..];
    if body.len() != len {
        return Err(bad("length"));
    }
    if crc32c::crc32c(body) != crc {
        return Err(bad("checksum"));
    }
    Ok((kind, body))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forward_and_exploding_type_tables_are_refused() {
        let fwd = vec![WireType::Array { elem: 0, len: 1 }];
        assert!(resolve_types(&fwd).is_err());
        // Each record doubles the previous: 2^40 nodes if materialized.
        let mut t = vec![WireType::Prim(PrimKind::U8)];
        for i in 0..40u32 {
            t.push(WireType::Record {
                name: "R".into(),
                fields: vec![("a".into(), i), ("b".into(), i)],
            });
        }
        assert!(matches!(resolve_types(&t), Err(StateError::Decode(_))));
    }

    #[test]
    fn frames_detect_corruption() {
        let f = frame(FrameKind::Diff, b"hello");
        assert_eq!(unframe(&f).unwrap(), (FrameKind::Diff, &b"hello"[..]));
        for i in 0..f.len() {
            let mut g = f.clone();
            g[i] ^= 0x40;
            assert!(unframe(&g).is_err(), "flip at {i}");
        }
        assert!(unframe(&f[..f.len() - 1]).is_err());
    }
}
