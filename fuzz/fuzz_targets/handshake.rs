//! Fuzz target: the link handshake state machine (`weft_transport`'s `handshake`), one end
//! ("the subject") talking to an honest peer (the real state machine too) through a network
//! the fuzzer controls: it delivers, drops and replays the peer's frames, and injects its own,
//! either built from fields or decoded from raw bytes with the handshake's frame limits.
//!
//! Checked beyond "no panic":
//! - the subject only ever sends Hello (its own, once), Auth and Refused;
//! - it reports Established at most once, only for the first Hello it accepted, only after an
//!   Auth that proves the cluster secret for that Hello and its own nonce, and only for a Hello
//!   that passes the checks (member id or admitted client, size floors, expected node);
//! - a failed handshake says nothing more; a Refused it sends carries its failure's status;
//! - with the same secret, compatible ends and an honest network, both ends establish.
#![no_main]

use std::collections::VecDeque;
use std::sync::Arc;

use arbitrary::{Result, Unstructured};
use bytes::BytesMut;
use libfuzzer_sys::fuzz_target;
use weft_transport::fuzzing::{Handshake, Side, Step};
use weft_wire::codec::MIN_MAX_FRAME;
use weft_wire::{
    auth, decode_frame_with, Auth, Frame, Goodbye, Heartbeat, Hello, Incarnation, Integrity,
    Limits, NodeId, PeerRole, Refused, Status,
};

const SUBJECT: NodeId = NodeId(2);
const PEER: NodeId = NodeId(3);

fn hello(node: NodeId, role: PeerRole, nonce: [u8; 16]) -> Hello {
    Hello {
        node,
        incarnation: Incarnation(7),
        role,
        nonce,
        max_frame: 1 << 20,
        max_message: 1 << 26,
    }
}

/// What the subject has been fed and has said.
#[derive(Default)]
struct Watch {
    first_hello: Option<Hello>,
    proven: bool,
    failed: bool,
    established: Option<Hello>,
    sent_hello: bool,
}

struct Rules {
    side: Side,
    own: Hello,
    secret: Arc<[u8]>,
    expected: Option<NodeId>,
    accept_clients: bool,
}

impl Rules {
    fn admissible(&self, h: &Hello) -> bool {
        let id_ok = match h.role {
            PeerRole::Node => h.node.is_member(),
            PeerRole::Client => {
                h.node.is_client() && self.side == Side::Acceptor && self.accept_clients
            }
        };
        id_ok
            && h.max_frame as usize >= MIN_MAX_FRAME
            && h.max_message >= MIN_MAX_FRAME as u64
            && self.expected.is_none_or(|e| e == h.node)
    }
}

/// Feeds `frame` to the subject and checks what it answers; returns the frames it sends.
fn feed(subject: &mut Handshake, rules: &Rules, w: &mut Watch, frame: Frame) -> Vec<Frame> {
    let was_failed = w.failed;
    let was_established = w.established.is_some();
    match &frame {
        Frame::Hello(h) if w.first_hello.is_none() && !was_established => {
            w.first_hello = Some(h.clone())
        }
        Frame::Auth(a) => {
            if let Some(h) = &w.first_hello {
                if auth::verify(&rules.secret, h, &rules.own.nonce, &a.proof) {
                    w.proven = true;
                }
            }
        }
        _ => {}
    }
    let steps = subject.on_frame(frame);
    if was_failed {
        assert!(
            steps.is_empty(),
            "a failed handshake spoke again: {steps:?}"
        );
    }
    check_steps(&steps, rules, w);
    if was_established && !was_failed {
        assert!(
            matches!(steps.last(), Some(Step::Fail(Status::ProtocolError, _))),
            "a frame after the handshake must fail it: {steps:?}"
        );
    }
    sends(steps)
}

fn check_steps(steps: &[Step], rules: &Rules, w: &mut Watch) {
    let refused = steps.iter().find_map(|s| match s {
        Step::Send(Frame::Refused(r)) => Some(r.status),
        _ => None,
    });
    for s in steps {
        match s {
            Step::Send(Frame::Hello(h)) => {
                assert_eq!(h, &rules.own, "sent a Hello not its own");
                assert!(!w.sent_hello, "sent its Hello twice");
                w.sent_hello = true;
            }
            Step::Send(Frame::Auth(_)) => assert!(w.first_hello.is_some(), "Auth before Hello"),
            Step::Send(Frame::Refused(_)) => {}
            Step::Send(other) => panic!("the handshake sent a {:?} frame", other.kind()),
            Step::Established(h) => {
                assert!(w.established.is_none(), "established twice");
                assert!(!w.failed, "established after failing");
                assert_eq!(Some(h), w.first_hello.as_ref(), "established another Hello");
                assert!(w.proven, "established without a valid proof");
                assert!(
                    rules.admissible(h),
                    "established an inadmissible Hello {h:?}"
                );
                w.established = Some(h.clone());
            }
            Step::Fail(status, _) => {
                w.failed = true;
                if let Some(r) = refused {
                    assert_eq!(r, *status, "Refused and Fail disagree");
                }
            }
        }
    }
}

fn sends(steps: Vec<Step>) -> Vec<Frame> {
    steps
        .into_iter()
        .filter_map(|s| match s {
            Step::Send(f) => Some(f),
            _ => None,
        })
        .collect()
}

fn peer_steps(steps: Vec<Step>, to_subject: &mut VecDeque<Frame>, peer_ok: &mut bool) {
    for s in steps {
        match s {
            Step::Send(f) => to_subject.push_back(f),
            Step::Established(_) => *peer_ok = true,
            Step::Fail(..) => {}
        }
    }
}

fn made_frame(u: &mut Unstructured, rules: &Rules, peer_hello: &Hello, w: &Watch) -> Result<Frame> {
    Ok(match u.int_in_range(0..=7)? {
        0 => Frame::Hello(Hello {
            node: NodeId(u.arbitrary()?),
            incarnation: Incarnation(u.arbitrary()?),
            role: if u.arbitrary()? {
                PeerRole::Node
            } else {
                PeerRole::Client
            },
            nonce: u.arbitrary()?,
            max_frame: u.arbitrary()?,
            max_message: u.arbitrary()?,
        }),
        1 => {
            let mut h = peer_hello.clone();
            match u.int_in_range(0..=3)? {
                0 => h.node = NodeId(u.int_in_range(0..=4)?),
                1 => h.max_frame = u.int_in_range(1000..=1030)?,
                2 => h.max_message = u.int_in_range(1000..=1030)?,
                _ => h.nonce = u.arbitrary()?,
            }
            Frame::Hello(h)
        }
        2 => Frame::Auth(Auth {
            proof: u.arbitrary()?,
        }),
        // A proof made with the subject's secret for the Hello it holds: whoever knows the
        // secret may complete the handshake, but only in order.
        3 => {
            let h = w.first_hello.clone().unwrap_or_else(|| peer_hello.clone());
            let secret: &[u8] = if u.arbitrary()? {
                &rules.secret
            } else {
                b"other"
            };
            // The proof binds the prover's Hello and the verifier's nonce.
            Frame::Auth(Auth {
                proof: auth::proof(secret, &h, &rules.own.nonce),
            })
        }
        4 => Frame::Refused(Refused {
            status: Status::from_code(u.arbitrary()?),
            reason: u.arbitrary()?,
        }),
        5 => Frame::Heartbeat(Heartbeat {
            seq: u.arbitrary()?,
            reply: u.arbitrary()?,
        }),
        6 => Frame::Goodbye(Goodbye {
            reason: u.arbitrary()?,
        }),
        _ => Frame::Hello(rules.own.clone()), // a reflection of its own Hello
    })
}

fn run(u: &mut Unstructured) -> Result<()> {
    let cfg: u8 = u.arbitrary()?;
    let side = if cfg & 1 == 0 {
        Side::Acceptor
    } else {
        Side::Initiator
    };
    let accept_clients = cfg & 2 != 0;
    let peer_is_client = cfg & 4 != 0 && side == Side::Acceptor;
    let same_secret = cfg & 8 == 0;
    let expect_right = cfg & 16 == 0;
    let secret: Arc<[u8]> = Arc::from(&b"cluster secret"[..]);
    let peer_secret: Arc<[u8]> = if same_secret {
        secret.clone()
    } else {
        Arc::from(&b"another secret"[..])
    };
    let own = hello(SUBJECT, PeerRole::Node, u.arbitrary()?);
    let peer_hello = if peer_is_client {
        hello(NodeId::CLIENT, PeerRole::Client, u.arbitrary()?)
    } else {
        hello(PEER, PeerRole::Node, u.arbitrary()?)
    };
    let expected = (side == Side::Initiator).then_some(if expect_right { PEER } else { NodeId(9) });
    let rules = Rules {
        side,
        own: own.clone(),
        secret: secret.clone(),
        expected,
        accept_clients,
    };
    let mut subject = Handshake::new(side, own, secret, expected, accept_clients);
    let peer_side = match side {
        Side::Acceptor => Side::Initiator,
        Side::Initiator => Side::Acceptor,
    };
    let peer_expects = (peer_side == Side::Initiator).then_some(SUBJECT);
    let mut peer = Handshake::new(
        peer_side,
        peer_hello.clone(),
        peer_secret,
        peer_expects,
        true,
    );

    let mut w = Watch::default();
    let mut to_subject: VecDeque<Frame> = VecDeque::new();
    let mut to_peer: VecDeque<Frame> = VecDeque::new();
    let mut delivered: Vec<Frame> = Vec::new();
    let mut peer_ok = false;
    let mut tampered = false;

    let first = subject.start();
    check_steps(&first, &rules, &mut w);
    to_peer.extend(sends(first));
    peer_steps(peer.start(), &mut to_subject, &mut peer_ok);

    let limits = Limits::default().handshake();
    for _ in 0..64 {
        if u.is_empty() {
            break;
        }
        match u.int_in_range(0..=6)? {
            0 | 1 => {
                if let Some(f) = to_subject.pop_front() {
                    delivered.push(f.try_clone().expect("handshake frames are plain"));
                    to_peer.extend(feed(&mut subject, &rules, &mut w, f));
                }
            }
            2 => {
                if let Some(f) = to_peer.pop_front() {
                    peer_steps(peer.on_frame(f), &mut to_subject, &mut peer_ok);
                }
            }
            3 => {
                tampered = true;
                let f = made_frame(u, &rules, &peer_hello, &w)?;
                feed(&mut subject, &rules, &mut w, f);
            }
            4 => {
                tampered = true;
                let n = u.int_in_range(0..=128)?;
                let mut buf = BytesMut::from(u.bytes(n)?);
                if let Ok(Some(f)) = decode_frame_with(&mut buf, &limits, Integrity::Trusted) {
                    feed(&mut subject, &rules, &mut w, f);
                }
            }
            5 => {
                tampered = true;
                to_subject.pop_front();
            }
            _ => {
                if !delivered.is_empty() {
                    tampered = true;
                    let i = u.choose_index(delivered.len())?;
                    let f = delivered[i].try_clone().expect("plain");
                    feed(&mut subject, &rules, &mut w, f);
                }
            }
        }
    }
    // The network delivers whatever is left, in order.
    while !to_subject.is_empty() || !to_peer.is_empty() {
        if let Some(f) = to_subject.pop_front() {
            to_peer.extend(feed(&mut subject, &rules, &mut w, f));
        }
        if let Some(f) = to_peer.pop_front() {
            peer_steps(peer.on_frame(f), &mut to_subject, &mut peer_ok);
        }
    }
    let compatible =
        same_secret && expected.is_none_or(|e| e == PEER) && (!peer_is_client || accept_clients);
    if !tampered {
        assert_eq!(
            w.established.is_some(),
            compatible,
            "honest handshake: subject established {:?}, expected {compatible}",
            w.established
        );
        assert_eq!(peer_ok, compatible, "honest handshake: peer");
    }
    if !same_secret {
        assert!(!peer_ok, "the peer established with a wrong secret");
    }
    Ok(())
}

fuzz_target!(|data: &[u8]| {
    let _ = run(&mut Unstructured::new(data));
});
