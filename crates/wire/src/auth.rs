//! Proof of the cluster secret exchanged in the link handshake.
//!
//! Owns the exact bytes that are MACed, so every implementation (Rust or a
//! client in another language) computes the same proof. Must never put the
//! secret itself on the wire.

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::frame::{Hello, PeerRole};

/// Domain-separation prefix of every proof.
pub const PROOF_CONTEXT: &[u8] = b"weft-auth-v1";

/// The MAC over one end's identity and both nonces (see [`proof`]).
fn mac_for(secret: &[u8], sender: &Hello, receiver_nonce: &[u8; 16]) -> Hmac<Sha256> {
    let mut mac =
        <Hmac<Sha256> as Mac>::new_from_slice(secret).expect("HMAC accepts keys of any length");
    mac.update(PROOF_CONTEXT);
    mac.update(&[match sender.role {
        PeerRole::Node => 0,
        PeerRole::Client => 1,
    }]);
    mac.update(&sender.node.0.to_le_bytes());
    mac.update(&sender.incarnation.0.to_le_bytes());
    mac.update(&sender.nonce);
    mac.update(receiver_nonce);
    mac
}

/// The proof a link end sends in its `Auth` frame: HMAC-SHA256 keyed with the
/// cluster secret over `PROOF_CONTEXT || role || node (u32 LE) ||
/// incarnation (u32 LE) || own nonce || peer nonce`, where role is 0 for a
/// node and 1 for a client, and node/incarnation/own nonce come from the
/// sender's own `Hello`.
pub fn proof(secret: &[u8], own: &Hello, peer_nonce: &[u8; 16]) -> [u8; 32] {
    mac_for(secret, own, peer_nonce)
        .finalize()
        .into_bytes()
        .into()
}

/// Checks a peer's proof in constant time: `peer` is the peer's `Hello`,
/// `own_nonce` the nonce this end sent. Returns false for a wrong secret.
pub fn verify(secret: &[u8], peer: &Hello, own_nonce: &[u8; 16], proof_bytes: &[u8; 32]) -> bool {
    mac_for(secret, peer, own_nonce)
        .verify_slice(proof_bytes)
        .is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::{Incarnation, NodeId};

    fn hello(node: u32, nonce: u8) -> Hello {
        Hello {
            node: NodeId(node),
            incarnation: Incarnation(1),
            role: PeerRole::Node,
            nonce: [nonce; 16],
            max_frame: 1 << 20,
            max_message: 1 << 26,
        }
    }

    #[test]
    fn right_secret_verifies_wrong_does_not() {
        let a = hello(1, 7);
        let b = hello(2, 9);
        let p = proof(b"s3cret", &a, &b.nonce);
        assert!(verify(b"s3cret", &a, &b.nonce, &p));
        assert!(!verify(b"other", &a, &b.nonce, &p));
        assert!(
            !verify(b"s3cret", &b, &a.nonce, &p),
            "proof is bound to the sender"
        );
        assert!(
            !verify(b"s3cret", &a, &[0; 16], &p),
            "proof is bound to the nonce"
        );
    }
}
