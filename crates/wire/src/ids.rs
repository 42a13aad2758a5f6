//! Identifiers: nodes, incarnations, transactions, sub-transaction paths, service
//! addresses and group ids.
//!
//! Owns the printable and parseable forms of every name that crosses a process
//! boundary. Must never do I/O or consult clocks: identifiers are plain values.

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

/// Maximum length of a service name, a group class or a group name, in bytes.
pub const MAX_NAME_LEN: usize = 64;

/// Failure to parse an identifier from text.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid {what} {input:?}: {reason}")]
pub struct ParseIdError {
    /// Which kind of identifier was being parsed ("node id", "tid", ...).
    pub what: &'static str,
    /// The text that failed to parse.
    pub input: String,
    /// Why it failed.
    pub reason: &'static str,
}

impl ParseIdError {
    fn new(what: &'static str, input: &str, reason: &'static str) -> Self {
        ParseIdError {
            what,
            input: input.to_string(),
            reason,
        }
    }
}

/// One weft runtime (usually one OS process). `NodeId(0)` is reserved for
/// clients that talk to a node without joining the cluster (the CLI).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, Default)]
pub struct NodeId(pub u32);

impl NodeId {
    /// The id a non-member client presents.
    pub const CLIENT: NodeId = NodeId(0);

    /// True for the reserved client id.
    pub fn is_client(self) -> bool {
        self == Self::CLIENT
    }

    /// True for an id a member may use: 1 to `u32::MAX − 1`. 0 is the
    /// clients' id and `u32::MAX` is reserved (never a node), so that no
    /// arithmetic bound or sentinel can collide with a real member.
    pub fn is_member(self) -> bool {
        self.0 != 0 && self.0 != u32::MAX
    }
}

impl fmt::Display for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

impl fmt::Debug for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "n{}", self.0)
    }
}

impl FromStr for NodeId {
    type Err = ParseIdError;
    /// Accepts `3` or `n3`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let digits = s.strip_prefix('n').unwrap_or(s);
        digits
            .parse::<u32>()
            .map(NodeId)
            .map_err(|_| ParseIdError::new("node id", s, "expected a number like 3 or n3"))
    }
}

/// Which life of a node: incremented (or freshly drawn) every time a node starts,
/// so that peers can tell a restarted node from the one they knew.
#[derive(
    Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, Default, Debug,
)]
pub struct Incarnation(pub u32);

impl fmt::Display for Incarnation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// A transaction id: (coordinator node, node incarnation, sequence). Unique
/// forever; printed `t<node>.<incarnation>.<seq>`, e.g. `t3.1.1042`. Human
/// readable formats (JSON) carry that text; binary ones the three numbers.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Tid {
    /// The node that created the transaction and coordinates its commit.
    pub node: NodeId,
    /// The coordinator's incarnation when it created the transaction.
    pub incarnation: Incarnation,
    /// Sequence number within that incarnation.
    pub seq: u64,
}

impl Tid {
    /// Builds a Tid from its parts.
    pub fn new(node: NodeId, incarnation: Incarnation, seq: u64) -> Self {
        Tid {
            node,
            incarnation,
            seq,
        }
    }

    /// The coordinating node.
    pub fn coordinator(&self) -> NodeId {
        self.node
    }
}

impl Serialize for Tid {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        if s.is_human_readable() {
            s.collect_str(self)
        } else {
            (self.node, self.incarnation, self.seq).serialize(s)
        }
    }
}

impl<'de> Deserialize<'de> for Tid {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        if d.is_human_readable() {
            let text = String::deserialize(d)?;
            text.parse().map_err(serde::de::Error::custom)
        } else {
            let (node, incarnation, seq) = <(NodeId, Incarnation, u64)>::deserialize(d)?;
            Ok(Tid {
                node,
                incarnation,
                seq,
            })
        }
    }
}

impl fmt::Display for Tid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "t{}.{}.{}", self.node.0, self.incarnation.0, self.seq)
    }
}

impl fmt::Debug for Tid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl FromStr for Tid {
    type Err = ParseIdError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = |reason| ParseIdError::new("tid", s, reason);
        let rest = s
            .strip_prefix('t')
            .ok_or_else(|| bad("must start with 't'"))?;
        let mut parts = rest.split('.');
        let (Some(n), Some(i), Some(q), None) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Err(bad("expected t<node>.<incarnation>.<seq>"));
        };
        let node = n.parse::<u32>().map_err(|_| bad("node is not a number"))?;
        let inc = i
            .parse::<u32>()
            .map_err(|_| bad("incarnation is not a number"))?;
        let seq = q
            .parse::<u64>()
            .map_err(|_| bad("sequence is not a number"))?;
        Ok(Tid::new(NodeId(node), Incarnation(inc), seq))
    }
}

/// Position of a sub-transaction under its top-level transaction: the empty
/// path is the top-level transaction itself, `[2]` its second child, `[2, 1]`
/// that child's first child. Printed `/2/1` after the Tid.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, Default)]
pub struct SubPath(pub Vec<u32>);

impl SubPath {
    /// The top-level path.
    pub const fn top() -> Self {
        SubPath(Vec::new())
    }

    /// True for the top-level transaction.
    pub fn is_top(&self) -> bool {
        self.0.is_empty()
    }

    /// The path of child number `n` of this (sub-)transaction.
    pub fn child(&self, n: u32) -> SubPath {
        let mut v = self.0.clone();
        v.push(n);
        SubPath(v)
    }

    /// The parent path, or `None` for the top level.
    pub fn parent(&self) -> Option<SubPath> {
        if self.0.is_empty() {
            None
        } else {
            Some(SubPath(self.0[..self.0.len() - 1].to_vec()))
        }
    }

    /// True if `self` is `other` or one of its ancestors.
    pub fn is_ancestor_or_self(&self, other: &SubPath) -> bool {
        other.0.len() >= self.0.len() && other.0[..self.0.len()] == self.0[..]
    }

    /// Nesting depth (0 for the top level).
    pub fn depth(&self) -> usize {
        self.0.len()
    }
}

impl fmt::Display for SubPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for n in &self.0 {
            write!(f, "/{n}")?;
        }
        Ok(())
    }
}

impl fmt::Debug for SubPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.is_empty() {
            write!(f, "<top>")
        } else {
            fmt::Display::fmt(self, f)
        }
    }
}

/// A (sub-)transaction: a top-level Tid plus a path. Printed `t3.1.1042/2/1`.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Xid {
    /// The top-level transaction.
    pub tid: Tid,
    /// The sub-transaction path under it (empty for the top level).
    pub path: SubPath,
}

impl Xid {
    /// The top-level transaction `tid` itself.
    pub fn top(tid: Tid) -> Self {
        Xid {
            tid,
            path: SubPath::top(),
        }
    }
}

impl fmt::Display for Xid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{}", self.tid, self.path)
    }
}

impl fmt::Debug for Xid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl FromStr for Xid {
    type Err = ParseIdError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let mut parts = s.split('/');
        let tid: Tid = parts.next().unwrap_or_default().parse()?;
        let mut path = Vec::new();
        for p in parts {
            path.push(
                p.parse::<u32>()
                    .map_err(|_| ParseIdError::new("xid", s, "path element is not a number"))?,
            );
        }
        Ok(Xid {
            tid,
            path: SubPath(path),
        })
    }
}

fn valid_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= MAX_NAME_LEN
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// A service name: 1 to 64 characters of `[A-Za-z0-9_-]`. Names starting with
/// `_` are reserved for weft's built-in services. Shared: cloning one (every
/// call copies its address's name into the request) copies no bytes.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Deserialize)]
#[serde(try_from = "String")]
pub struct ServiceName(Arc<str>);

/// Written as the string it is (borrowed: encoding a name copies nothing).
impl Serialize for ServiceName {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.0)
    }
}

impl ServiceName {
    /// Validates and wraps a service name.
    ///
    /// Fails with [`ParseIdError`] when the name is empty, longer than
    /// [`MAX_NAME_LEN`] or contains a character outside `[A-Za-z0-9_-]`.
    pub fn new(s: impl Into<String>) -> Result<Self, ParseIdError> {
        let s = s.into();
        if valid_name(&s) {
            Ok(ServiceName(Arc::from(s)))
        } else {
            Err(ParseIdError::new(
                "service name",
                &s,
                "1-64 characters of [A-Za-z0-9_-]",
            ))
        }
    }

    /// The name as a string slice.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// A name from raw bytes (a frame's), or `None` when they are not a
    /// valid name: the decoder's fast path, which leaves the error to the
    /// general one.
    ///
    /// A node hears the same few names over and over, so the names this
    /// thread decoded last are kept ([`RECENT_NAMES`]) and a name seen again
    /// is shared, not validated and allocated anew.
    pub(crate) fn from_bytes(b: &[u8]) -> Option<ServiceName> {
        RECENT.with(|recent| {
            let mut recent = recent.borrow_mut();
            if let Some(hit) = recent.find(b) {
                return Some(hit);
            }
            let s = std::str::from_utf8(b).ok()?;
            let name = valid_name(s).then(|| ServiceName(Arc::from(s)))?;
            recent.remember(&name);
            Some(name)
        })
    }
}

/// How many decoded service names each thread keeps for reuse.
pub(crate) const RECENT_NAMES: usize = 8;

/// The service names a thread decoded last, replaced round-robin. Every
/// entry is a valid name, so bytes equal to one are that name.
#[derive(Default)]
struct RecentNames {
    names: [Option<ServiceName>; RECENT_NAMES],
    next: usize,
}

impl RecentNames {
    fn find(&self, b: &[u8]) -> Option<ServiceName> {
        self.names
            .iter()
            .flatten()
            .find(|n| n.0.as_bytes() == b)
            .cloned()
    }

    fn remember(&mut self, name: &ServiceName) {
        self.names[self.next] = Some(name.clone());
        self.next = (self.next + 1) % RECENT_NAMES;
    }
}

thread_local! {
    static RECENT: std::cell::RefCell<RecentNames> = std::cell::RefCell::default();
}

impl TryFrom<String> for ServiceName {
    type Error = ParseIdError;
    fn try_from(s: String) -> Result<Self, Self::Error> {
        ServiceName::new(s)
    }
}

impl From<ServiceName> for String {
    fn from(s: ServiceName) -> String {
        s.0.to_string()
    }
}

impl fmt::Display for ServiceName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for ServiceName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.0)
    }
}

impl FromStr for ServiceName {
    type Err = ParseIdError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        ServiceName::new(s)
    }
}

/// Where a call goes: `service.instance@node` (Raid's cluster/site/server
/// type/server instance tuple in modern dress). `echo@2` means instance 0.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Address {
    /// The service (server type).
    pub service: ServiceName,
    /// The server instance at that node.
    pub instance: u32,
    /// The node (site) that runs it.
    pub node: NodeId,
}

impl Address {
    /// Builds an address of instance 0 of `service` at `node`.
    ///
    /// Fails when `service` is not a valid [`ServiceName`].
    pub fn new(service: &str, node: NodeId) -> Result<Self, ParseIdError> {
        Ok(Address {
            service: ServiceName::new(service)?,
            instance: 0,
            node,
        })
    }

    /// The same address with another instance number.
    pub fn with_instance(mut self, instance: u32) -> Self {
        self.instance = instance;
        self
    }
}

impl fmt::Display for Address {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}@{}", self.service, self.instance, self.node)
    }
}

impl fmt::Debug for Address {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl FromStr for Address {
    type Err = ParseIdError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (left, node) = s
            .rsplit_once('@')
            .ok_or_else(|| ParseIdError::new("address", s, "expected service[.instance]@node"))?;
        let node: NodeId = node.parse()?;
        let (service, instance) = match left.rsplit_once('.') {
            Some((svc, inst)) => (
                svc,
                inst.parse::<u32>()
                    .map_err(|_| ParseIdError::new("address", s, "instance is not a number"))?,
            ),
            None => (left, 0),
        };
        Ok(Address {
            service: ServiceName::new(service)?,
            instance,
            node,
        })
    }
}

/// A process group: `class:name` (T-Shoshin), or `tx:<tid>`, the group of every
/// node participating in a transaction (Raid's transaction multicast).
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum GroupId {
    /// A named group created with a secret.
    Named {
        /// The group class (e.g. `raid`).
        class: String,
        /// The group name within the class.
        name: String,
    },
    /// The participants of a transaction; needs no set-up.
    Tx(Tid),
}

impl GroupId {
    /// Builds a named group id, validating both parts.
    ///
    /// Fails when a part is empty, too long, has a character outside
    /// `[A-Za-z0-9_-]`, or when the class is the reserved `tx`.
    pub fn named(class: &str, name: &str) -> Result<Self, ParseIdError> {
        let full = format!("{class}:{name}");
        if class == "tx" {
            return Err(ParseIdError::new(
                "group id",
                &full,
                "class 'tx' is reserved",
            ));
        }
        if !valid_name(class) || !valid_name(name) {
            return Err(ParseIdError::new(
                "group id",
                &full,
                "class and name are 1-64 characters of [A-Za-z0-9_-]",
            ));
        }
        Ok(GroupId::Named {
            class: class.to_string(),
            name: name.to_string(),
        })
    }
}

impl fmt::Display for GroupId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GroupId::Named { class, name } => write!(f, "{class}:{name}"),
            GroupId::Tx(tid) => write!(f, "tx:{tid}"),
        }
    }
}

impl fmt::Debug for GroupId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl FromStr for GroupId {
    type Err = ParseIdError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (class, name) = s
            .split_once(':')
            .ok_or_else(|| ParseIdError::new("group id", s, "expected class:name or tx:<tid>"))?;
        if class == "tx" {
            return Ok(GroupId::Tx(name.parse()?));
        }
        GroupId::named(class, name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decoded_names_are_shared_while_recent_and_never_wrongly_matched() {
        let a = ServiceName::from_bytes(b"echo").unwrap();
        let b = ServiceName::from_bytes(b"echo").unwrap();
        assert!(Arc::ptr_eq(&a.0, &b.0), "a name decoded again is shared");
        assert_eq!(ServiceName::from_bytes(b"ech").unwrap().as_str(), "ech");
        assert_eq!(ServiceName::from_bytes(b"echo2").unwrap().as_str(), "echo2");
        assert!(
            ServiceName::from_bytes(b"ec ho").is_none(),
            "still validated"
        );
        assert!(ServiceName::from_bytes(b"").is_none());
        // More names than the cache holds: the oldest is replaced, and
        // decoding it again gives an equal (new) name.
        for i in 0..RECENT_NAMES {
            ServiceName::from_bytes(format!("svc{i}").as_bytes()).unwrap();
        }
        let c = ServiceName::from_bytes(b"echo").unwrap();
        assert_eq!(c, a);
        assert!(!Arc::ptr_eq(&a.0, &c.0), "evicted, so allocated anew");
    }

    #[test]
    fn tid_prints_and_parses() {
        let t = Tid::new(NodeId(3), Incarnation(1), 1042);
        assert_eq!(t.to_string(), "t3.1.1042");
        assert_eq!("t3.1.1042".parse::<Tid>().unwrap(), t);
        for bad in [
            "",
            "t",
            "3.1.1042",
            "t3.1",
            "t3.1.1042.5",
            "tx.1.2",
            "t3.1.-1",
        ] {
            assert!(bad.parse::<Tid>().is_err(), "{bad} should not parse");
        }
    }

    #[test]
    fn xid_prints_and_parses() {
        let x = Xid {
            tid: Tid::new(NodeId(3), Incarnation(1), 7),
            path: SubPath(vec![2, 1]),
        };
        assert_eq!(x.to_string(), "t3.1.7/2/1");
        assert_eq!("t3.1.7/2/1".parse::<Xid>().unwrap(), x);
        assert_eq!("t3.1.7".parse::<Xid>().unwrap(), Xid::top(x.tid));
        assert!("t3.1.7/x".parse::<Xid>().is_err());
    }

    #[test]
    fn address_prints_and_parses() {
        let a: Address = "echo@2".parse().unwrap();
        assert_eq!(a, Address::new("echo", NodeId(2)).unwrap());
        assert_eq!(a.to_string(), "echo.0@2");
        let b: Address = "kv.3@n7".parse().unwrap();
        assert_eq!(
            (b.service.as_str(), b.instance, b.node),
            ("kv", 3, NodeId(7))
        );
        for bad in ["echo", "@2", "echo@", "e cho@2", "echo.x@2", "echo@two"] {
            assert!(bad.parse::<Address>().is_err(), "{bad} should not parse");
        }
    }

    #[test]
    fn group_ids() {
        let g: GroupId = "raid:ac".parse().unwrap();
        assert_eq!(g.to_string(), "raid:ac");
        let t: GroupId = "tx:t1.2.3".parse().unwrap();
        assert_eq!(t, GroupId::Tx(Tid::new(NodeId(1), Incarnation(2), 3)));
        assert!("tx:nope".parse::<GroupId>().is_err());
        assert!("noclass".parse::<GroupId>().is_err());
        assert!(GroupId::named("tx", "x").is_err());
        assert!(GroupId::named("a", "b:c").is_err());
    }

    #[test]
    fn sub_paths() {
        let top = SubPath::top();
        let c = top.child(2).child(1);
        assert!(top.is_ancestor_or_self(&c));
        assert!(c.parent().unwrap().is_ancestor_or_self(&c));
        assert!(!c.is_ancestor_or_self(&top));
        assert!(!SubPath(vec![3]).is_ancestor_or_self(&c));
        assert_eq!(c.parent().unwrap().parent(), Some(top));
    }
}
