//! The link handshake as a pure state machine: Hello both ways, then proofs of
//! the cluster secret (see `docs/wire.md`, "Link handshake").
//!
//! Owns the decision to trust a link: the proofs, the checks on a Hello and
//! the rule for identity claims ([`admit`]). Must never let a frame other than Hello,
//! Auth or Refused through before both proofs are verified, and never do I/O:
//! it returns the frames to send.

use weft_wire::{auth, Auth, Frame, Hello, Incarnation, NodeId, PeerRole, Refused, Status};

use crate::channel::ChannelKind;

/// Which end of the link this is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Side {
    /// Opened the connection; speaks first.
    Initiator,
    /// Accepted the connection.
    Acceptor,
}

/// What the handshake wants done.
#[derive(Debug, PartialEq)]
pub(crate) enum Step {
    /// Send this frame to the peer.
    Send(Frame),
    /// The peer is authenticated; its Hello.
    Established(Hello),
    /// The handshake failed; close the link.
    Fail(Status, String),
}

/// Handshake state of one link.
pub(crate) struct Handshake {
    side: Side,
    own: Hello,
    secret: std::sync::Arc<[u8]>,
    expected_peer: Option<NodeId>,
    accept_clients: bool,
    peer: Option<Hello>,
    done: bool,
    failed: bool,
}

impl Handshake {
    /// A handshake for one link end. `expected_peer` is the node an initiator
    /// meant to reach (a different node answering is a Mismatch);
    /// `accept_clients` lets an acceptor admit non-member clients.
    pub(crate) fn new(
        side: Side,
        own: Hello,
        secret: std::sync::Arc<[u8]>,
        expected_peer: Option<NodeId>,
        accept_clients: bool,
    ) -> Self {
        Handshake {
            side,
            own,
            secret,
            expected_peer,
            accept_clients,
            peer: None,
            done: false,
            failed: false,
        }
    }

    /// The first frames to send: the initiator's Hello, nothing for an acceptor.
    pub(crate) fn start(&self) -> Vec<Step> {
        match self.side {
            Side::Initiator => vec![Step::Send(Frame::Hello(self.own.clone()))],
            Side::Acceptor => Vec::new(),
        }
    }

    /// True once the peer is authenticated.
    #[cfg(test)]
    pub(crate) fn is_done(&self) -> bool {
        self.done
    }

    fn fail(&mut self, status: Status, reason: String, tell_peer: bool) -> Vec<Step> {
        self.failed = true;
        let mut out = Vec::new();
        if tell_peer {
            out.push(Step::Send(Frame::Refused(Refused {
                status,
                reason: reason.clone(),
            })));
        }
        out.push(Step::Fail(status, reason));
        out
    }

    fn check_hello(&self, h: &Hello) -> Result<(), (Status, String)> {
        match h.role {
            PeerRole::Node if !h.node.is_member() => {
                return Err((
                    Status::ProtocolError,
                    format!(
                        "node id {} is not a member id (1 to {})",
                        h.node,
                        u32::MAX - 1
                    ),
                ))
            }
            PeerRole::Client if !h.node.is_client() => {
                return Err((
                    Status::ProtocolError,
                    format!("a client must present node id 0, not {}", h.node),
                ))
            }
            PeerRole::Client if !(self.side == Side::Acceptor && self.accept_clients) => {
                return Err((Status::Refused, "this end does not accept clients".into()))
            }
            _ => {}
        }
        if (h.max_frame as usize) < weft_wire::codec::MIN_MAX_FRAME {
            return Err((
                Status::ProtocolError,
                format!(
                    "max_frame {} is below the minimum of {} bytes",
                    h.max_frame,
                    weft_wire::codec::MIN_MAX_FRAME
                ),
            ));
        }
        if h.max_message < weft_wire::codec::MIN_MAX_MESSAGE as u64 {
            return Err((
                Status::ProtocolError,
                format!(
                    "max_message {} is below the minimum of {} bytes (a whole frame, header included)",
                    h.max_message,
                    weft_wire::codec::MIN_MAX_MESSAGE
                ),
            ));
        }
        if let Some(want) = self.expected_peer {
            if h.node != want {
                return Err((
                    Status::Mismatch,
                    format!(
                        "expected node {want} at this address, found node {}",
                        h.node
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Feeds one received frame; returns what to do.
    pub(crate) fn on_frame(&mut self, frame: Frame) -> Vec<Step> {
        if self.failed {
            return Vec::new(); // the link is closing; nothing more to say
        }
        if self.done {
            return self.fail(
                Status::ProtocolError,
                "handshake frame after handshake".into(),
                true,
            );
        }
        match frame {
            Frame::Refused(r) => {
                let reason = format!("refused by peer: {}", peer_text(&r.reason));
                self.fail(r.status, reason, false)
            }
            Frame::Hello(h) => {
                if self.peer.is_some() {
                    return self.fail(Status::ProtocolError, "second Hello".into(), true);
                }
                if let Err((status, reason)) = self.check_hello(&h) {
                    return self.fail(status, reason, true);
                }
                let proof = auth::proof(&self.secret, &self.own, &h.nonce);
                self.peer = Some(h);
                match self.side {
                    // The acceptor answers with its Hello and its proof at once.
                    Side::Acceptor => vec![
                        Step::Send(Frame::Hello(self.own.clone())),
                        Step::Send(Frame::Auth(Auth { proof })),
                    ],
                    // The initiator proves itself only after the acceptor has.
                    Side::Initiator => Vec::new(),
                }
            }
            Frame::Auth(a) => {
                let Some(peer) = self.peer.clone() else {
                    return self.fail(Status::ProtocolError, "Auth before Hello".into(), true);
                };
                if !auth::verify(&self.secret, &peer, &self.own.nonce, &a.proof) {
                    let who = match peer.role {
                        PeerRole::Node => format!("node {}", peer.node),
                        PeerRole::Client => "client".to_string(),
                    };
                    return self.fail(
                        Status::WrongSecret,
                        format!("{who} presented a wrong cluster secret"),
                        true,
                    );
                }
                self.done = true;
                let mut out = Vec::new();
                if self.side == Side::Initiator {
                    let proof = auth::proof(&self.secret, &self.own, &peer.nonce);
                    out.push(Step::Send(Frame::Auth(Auth { proof })));
                }
                out.push(Step::Established(peer));
                out
            }
            other => self.fail(
                Status::ProtocolError,
                format!("{:?} frame before the handshake completed", other.kind()),
                true,
            ),
        }
    }
}

/// Most characters of a peer's free text (a Refused or Goodbye reason) kept
/// in this node's logs, refusal list and membership events.
pub(crate) const MAX_PEER_TEXT: usize = 256;

/// A peer's free text made fit to keep: at most [`MAX_PEER_TEXT`]
/// characters, control characters (newlines, escapes) replaced, so a peer
/// can neither grow this node's memory through its reasons nor forge log
/// lines.
pub(crate) fn peer_text(text: &str) -> String {
    let mut out: String = text
        .chars()
        .take(MAX_PEER_TEXT)
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    if text.chars().nth(MAX_PEER_TEXT).is_some() {
        out.push('…');
    }
    out
}

/// Whether an authenticated peer's identity claim may be trusted on this
/// node (docs/wire.md, "Identity claims"). `own` is this node's id and
/// incarnation; `live` is the incarnation of the live peer this node knows
/// under the claimed id, if any.
///
/// - A member may not claim this node's own id, except over the in-process
///   link a node opens to itself (same id, same incarnation).
/// - A member may not claim an incarnation older than that of the live node
///   known by that id: it is a stale process (incarnations only grow), and
///   serving it would let it act as the node that replaced it. The same
///   incarnation is the same node opening another link (another channel,
///   a reconnect); a newer one is that node restarted, which replaces the
///   old incarnation's links.
/// - An id this node does not know is admitted: a joining node's first link
///   reaches the directory before it is a member.
///
/// These checks stop confusion (a stale process, a node configured with a
/// taken id), not a malicious holder of the cluster secret: whoever knows
/// the secret can claim a newer incarnation, and the secret is the trust
/// boundary of a cluster.
pub(crate) fn admit(
    claim: &Hello,
    own: (NodeId, Incarnation),
    channel: ChannelKind,
    live: Option<Incarnation>,
) -> Result<(), (Status, String)> {
    if claim.role != PeerRole::Node {
        return Ok(());
    }
    if claim.node == own.0 {
        if channel == ChannelKind::Inproc && claim.incarnation == own.1 {
            return Ok(()); // this node's link to itself
        }
        return Err((
            Status::Refused,
            format!("node id {} is this node's own", claim.node),
        ));
    }
    match live {
        Some(known) if claim.incarnation < known => Err((
            Status::Refused,
            format!(
                "node {} incarnation {} is older than the live incarnation {}: a stale process",
                claim.node, claim.incarnation.0, known.0
            ),
        )),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hello(node: u32, role: PeerRole, nonce: u8) -> Hello {
        Hello {
            node: NodeId(node),
            incarnation: Incarnation(1),
            role,
            nonce: [nonce; 16],
            max_frame: 1 << 20,
            max_message: 1 << 26,
        }
    }

    fn pair(sa: &[u8], sb: &[u8]) -> (Handshake, Handshake) {
        let a = Handshake::new(
            Side::Initiator,
            hello(1, PeerRole::Node, 1),
            sa.into(),
            Some(NodeId(2)),
            false,
        );
        let b = Handshake::new(
            Side::Acceptor,
            hello(2, PeerRole::Node, 2),
            sb.into(),
            None,
            true,
        );
        (a, b)
    }

    /// Runs both ends to completion, returning each end's non-send steps.
    fn run(mut a: Handshake, mut b: Handshake) -> (Vec<Step>, Vec<Step>) {
        let mut to_b: Vec<Frame> = Vec::new();
        let mut to_a: Vec<Frame> = Vec::new();
        let (mut out_a, mut out_b) = (Vec::new(), Vec::new());
        let route = |steps: Vec<Step>, q: &mut Vec<Frame>, out: &mut Vec<Step>| {
            for s in steps {
                match s {
                    Step::Send(f) => q.push(f),
                    other => out.push(other),
                }
            }
        };
        route(a.start(), &mut to_b, &mut out_a);
        while !to_a.is_empty() || !to_b.is_empty() {
            for f in std::mem::take(&mut to_b) {
                route(b.on_frame(f), &mut to_a, &mut out_b);
            }
            for f in std::mem::take(&mut to_a) {
                route(a.on_frame(f), &mut to_b, &mut out_a);
            }
        }
        (out_a, out_b)
    }

    #[test]
    fn same_secret_establishes_both_ends() {
        let (a, b) = pair(b"s", b"s");
        let (out_a, out_b) = run(a, b);
        assert!(matches!(&out_a[..], [Step::Established(h)] if h.node == NodeId(2)));
        assert!(matches!(&out_b[..], [Step::Established(h)] if h.node == NodeId(1)));
    }

    #[test]
    fn wrong_secret_is_refused_on_both_sides() {
        let (a, b) = pair(b"right", b"wrong");
        let (out_a, out_b) = run(a, b);
        assert!(
            matches!(&out_a[..], [Step::Fail(Status::WrongSecret, _)]),
            "{out_a:?}"
        );
        assert!(
            matches!(&out_b[..], [Step::Fail(Status::WrongSecret, _)]),
            "{out_b:?}"
        );
    }

    #[test]
    fn data_before_auth_is_a_protocol_error() {
        let (_, mut b) = pair(b"s", b"s");
        let steps = b.on_frame(Frame::Heartbeat(weft_wire::Heartbeat {
            seq: 1,
            reply: false,
        }));
        assert!(matches!(
            steps.last(),
            Some(Step::Fail(Status::ProtocolError, _))
        ));
        assert!(!b.is_done());
    }

    #[test]
    fn unexpected_node_is_a_mismatch() {
        let a = Handshake::new(
            Side::Initiator,
            hello(1, PeerRole::Node, 1),
            b"s"[..].into(),
            Some(NodeId(9)),
            false,
        );
        let b = Handshake::new(
            Side::Acceptor,
            hello(2, PeerRole::Node, 2),
            b"s"[..].into(),
            None,
            true,
        );
        let (out_a, out_b) = run(a, b);
        assert!(
            matches!(&out_a[..], [Step::Fail(Status::Mismatch, _)]),
            "{out_a:?}"
        );
        assert!(
            matches!(&out_b[..], [Step::Fail(Status::Mismatch, _)]),
            "{out_b:?}"
        );
    }

    #[test]
    fn clients_only_where_accepted() {
        let a = Handshake::new(
            Side::Initiator,
            hello(0, PeerRole::Client, 1),
            b"s"[..].into(),
            None,
            false,
        );
        let b = Handshake::new(
            Side::Acceptor,
            hello(2, PeerRole::Node, 2),
            b"s"[..].into(),
            None,
            false,
        );
        let (_, out_b) = run(a, b);
        assert!(
            matches!(&out_b[..], [Step::Fail(Status::Refused, _)]),
            "{out_b:?}"
        );
    }

    fn acceptor() -> Handshake {
        Handshake::new(
            Side::Acceptor,
            hello(2, PeerRole::Node, 2),
            b"s"[..].into(),
            None,
            true,
        )
    }

    fn refused_with(steps: &[Step]) -> Option<(Status, &str)> {
        steps.iter().find_map(|s| match s {
            Step::Fail(status, reason) => Some((*status, reason.as_str())),
            _ => None,
        })
    }

    #[test]
    fn a_hello_below_the_floors_or_with_a_bad_id_is_refused_before_any_answer() {
        let cases = [
            (
                Hello {
                    max_message: 16,
                    ..hello(0, PeerRole::Client, 1)
                },
                "max_message 16",
            ),
            (
                Hello {
                    max_frame: 512,
                    ..hello(0, PeerRole::Client, 1)
                },
                "max_frame 512",
            ),
            (hello(7, PeerRole::Client, 1), "node id 0"),
            (hello(u32::MAX, PeerRole::Node, 1), "not a member id"),
            (hello(0, PeerRole::Node, 1), "not a member id"),
        ];
        for (h, why) in cases {
            let steps = acceptor().on_frame(Frame::Hello(h));
            assert!(
                matches!(&steps[0], Step::Send(Frame::Refused(r)) if r.status == Status::ProtocolError),
                "{why}: {steps:?}"
            );
            let (status, reason) = refused_with(&steps).expect("fails");
            assert_eq!(status, Status::ProtocolError, "{why}");
            assert!(reason.contains(why), "{why}: {reason}");
        }
        // Exactly the floors are fine.
        let steps = acceptor().on_frame(Frame::Hello(Hello {
            max_frame: 1024,
            max_message: 1024,
            ..hello(0, PeerRole::Client, 1)
        }));
        assert!(refused_with(&steps).is_none(), "{steps:?}");
    }

    #[test]
    fn identity_claims_follow_the_admission_rule() {
        let own = (NodeId(2), Incarnation(5));
        let claim = |node: u32, inc: u32| Hello {
            incarnation: Incarnation(inc),
            ..hello(node, PeerRole::Node, 9)
        };
        use ChannelKind::*;
        // This node's own id: only its own in-process link to itself.
        assert!(admit(&claim(2, 5), own, Inproc, None).is_ok());
        assert_eq!(
            admit(&claim(2, 5), own, Tcp, None).unwrap_err().0,
            Status::Refused
        );
        assert_eq!(
            admit(&claim(2, 6), own, Inproc, None).unwrap_err().0,
            Status::Refused
        );
        // Another node: older than the live one is stale; same or newer is fine.
        let live = Some(Incarnation(4));
        assert_eq!(
            admit(&claim(3, 3), own, Tcp, live).unwrap_err().0,
            Status::Refused
        );
        assert!(admit(&claim(3, 4), own, Tcp, live).is_ok());
        assert!(admit(&claim(3, 5), own, Tcp, live).is_ok());
        assert!(admit(&claim(3, 1), own, Tcp, None).is_ok());
        // Clients are not members: nothing to check here.
        assert!(admit(&hello(0, PeerRole::Client, 1), own, Tcp, live).is_ok());
    }

    #[test]
    fn a_peers_text_is_cut_and_kept_on_one_line() {
        assert_eq!(peer_text("bye"), "bye");
        assert_eq!(peer_text("a\nb\x1b[31m"), "a b [31m");
        let long = peer_text(&"é".repeat(10_000));
        assert_eq!(long.chars().count(), MAX_PEER_TEXT + 1);
        assert!(long.ends_with('…'));
    }
}
