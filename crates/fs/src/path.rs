//! Volume-relative paths: parsing, normalizing and refusing escapes.
//!
//! Owns the rule of what names a client may use: relative, `/`-separated,
//! no `..`, no NUL, not inside the reserved `.weft-fs` area, bounded length.
//! Must never produce a path that names something outside its volume
//! (symbolic links are checked where the disk is read, in `volume`).

use crate::api::FsError;

/// The reserved directory at a volume's root: staging areas live there.
pub const RESERVED: &str = ".weft-fs";

/// Longest path accepted, in bytes.
pub const MAX_PATH: usize = 4096;

/// A normalized volume-relative path: components joined by `/`, no empty,
/// `.` or `..` components; "" is the volume's root.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct VPath(String);

impl VPath {
    /// The volume's root.
    pub fn root() -> VPath {
        VPath(String::new())
    }

    /// Parses a client's path. `.` and empty components are dropped.
    ///
    /// Fails with Escape for an absolute path, a `..` component or a name in
    /// the reserved area, BadPath for NUL bytes or a path past [`MAX_PATH`].
    pub fn parse(s: &str) -> Result<VPath, FsError> {
        if s.len() > MAX_PATH {
            return Err(FsError::BadPath(format!(
                "a {}-byte path (at most {MAX_PATH})",
                s.len()
            )));
        }
        if s.contains('\0') {
            return Err(FsError::BadPath(format!("{s:?} contains NUL")));
        }
        if s.starts_with('/') {
            return Err(FsError::Escape(format!("{s:?} is absolute")));
        }
        let mut parts = Vec::new();
        for c in s.split('/') {
            match c {
                "" | "." => {}
                ".." => return Err(FsError::Escape(format!("{s:?} contains '..'"))),
                c => parts.push(c),
            }
        }
        if parts.first() == Some(&RESERVED) {
            return Err(FsError::Escape(format!(
                "{s:?} is in the volume's reserved area {RESERVED}"
            )));
        }
        Ok(VPath(parts.join("/")))
    }

    /// Like [`VPath::parse`], refusing the root (a name is needed).
    ///
    /// Fails like `parse`, and with BadPath for the root.
    pub fn parse_name(s: &str) -> Result<VPath, FsError> {
        let p = VPath::parse(s)?;
        if p.is_root() {
            return Err(FsError::BadPath(format!("{s:?} names the volume's root")));
        }
        Ok(p)
    }

    /// True for the volume's root.
    pub fn is_root(&self) -> bool {
        self.0.is_empty()
    }

    /// The text form.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The containing directory (the root's parent is the root).
    pub fn parent(&self) -> VPath {
        match self.0.rfind('/') {
            Some(i) => VPath(self.0[..i].to_string()),
            None => VPath::root(),
        }
    }

    /// The last component ("" for the root).
    pub fn name(&self) -> &str {
        match self.0.rfind('/') {
            Some(i) => &self.0[i + 1..],
            None => &self.0,
        }
    }

    /// `self/name`.
    pub fn join(&self, name: &str) -> VPath {
        if self.is_root() {
            VPath(name.to_string())
        } else {
            VPath(format!("{}/{name}", self.0))
        }
    }

    /// True when `self` is `other` or lies under it.
    pub fn is_within(&self, other: &VPath) -> bool {
        other.is_root()
            || self.0 == other.0
            || (self.0.starts_with(&other.0) && self.0.as_bytes().get(other.0.len()) == Some(&b'/'))
    }

    /// Number of components.
    pub fn depth(&self) -> usize {
        if self.is_root() {
            0
        } else {
            self.0.matches('/').count() + 1
        }
    }
}

impl std::fmt::Display for VPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.is_root() {
            f.write_str("/")
        } else {
            f.write_str(&self.0)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn escapes_are_refused() {
        for bad in [
            "../x",
            "a/../../x",
            "/etc/passwd",
            "a/..",
            ".weft-fs/stage",
            "./.weft-fs",
        ] {
            assert!(
                matches!(VPath::parse(bad), Err(FsError::Escape(_))),
                "{bad} accepted"
            );
        }
        assert!(matches!(VPath::parse("a\0b"), Err(FsError::BadPath(_))));
        assert!(matches!(
            VPath::parse(&"a".repeat(MAX_PATH + 1)),
            Err(FsError::BadPath(_))
        ));
        assert!(matches!(VPath::parse_name(""), Err(FsError::BadPath(_))));
    }

    #[test]
    fn normalizes() {
        assert_eq!(VPath::parse("a//b/./c/").unwrap().as_str(), "a/b/c");
        assert_eq!(VPath::parse("./").unwrap(), VPath::root());
        let p = VPath::parse("a/b/c").unwrap();
        assert_eq!(p.parent().as_str(), "a/b");
        assert_eq!(p.name(), "c");
        assert_eq!(p.depth(), 3);
        assert!(p.is_within(&VPath::parse("a").unwrap()));
        assert!(!VPath::parse("ab")
            .unwrap()
            .is_within(&VPath::parse("a").unwrap()));
        assert_eq!(VPath::root().join("x").as_str(), "x");
        assert!(
            VPath::parse("a/.weft-fs").is_ok(),
            "only the root's is reserved"
        );
    }

    proptest! {
        /// Whatever a client sends, an accepted path has no escaping
        /// component and is stable under re-parsing.
        #[test]
        fn accepted_paths_stay_inside(s in "[a-z./\\\\]{0,24}") {
            if let Ok(p) = VPath::parse(&s) {
                prop_assert!(!p.as_str().starts_with('/'));
                prop_assert!(p.as_str().split('/').all(|c| c != ".." && c != "." && (p.is_root() || !c.is_empty())));
                prop_assert_eq!(VPath::parse(p.as_str()).unwrap(), p);
            }
        }
    }
}
