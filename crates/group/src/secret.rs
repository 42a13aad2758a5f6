//! Group secrets (T-Shoshin's control passwords), kept so that the secret
//! itself never crosses the wire and the table pushed to every node cannot be
//! used to forge a destroy.
//!
//! For each group the creator draws a random salt (unique per group, so a key
//! is bound to its group) and derives
//! `key = HMAC-SHA256(secret, "weft-group-key-v1" || salt)`; the
//! directory and every node keep only `check = SHA256("weft-group-check-v1"
//! || salt || key)`. A node verifies a secret locally by recomputing `check`;
//! an operation the directory must authorise (destroy, a node's first member)
//! carries `key`, which the directory verifies against `check`. The key is
//! never pushed, so a node holding the table cannot derive it.
//!
//! Owns the derivation and the constant-time comparison. Must never log or
//! store a secret or a key.

use std::fmt;

use hmac::{Hmac, Mac};
use rand::RngCore;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

const KEY_CONTEXT: &[u8] = b"weft-group-key-v1";
const CHECK_CONTEXT: &[u8] = b"weft-group-check-v1";

/// A key derived from a group's secret and salt; proves knowledge of the
/// secret to the directory without revealing it.
#[derive(Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct GroupKey(pub [u8; 32]);

impl fmt::Debug for GroupKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("GroupKey(..)")
    }
}

/// What the directory and every node keep about a group's secret: a salt and
/// a one-way check value.
#[derive(Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Verifier {
    /// Random salt drawn when the group was created.
    pub salt: [u8; 16],
    /// `SHA256(context || salt || key)`.
    pub check: [u8; 32],
}

impl fmt::Debug for Verifier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Verifier(..)")
    }
}

/// Derives the key of `secret` with a group's `salt`.
pub fn derive_key(secret: &[u8], salt: &[u8; 16]) -> GroupKey {
    let mut mac =
        <Hmac<Sha256> as Mac>::new_from_slice(secret).expect("HMAC accepts keys of any length");
    mac.update(KEY_CONTEXT);
    mac.update(salt);
    GroupKey(mac.finalize().into_bytes().into())
}

fn check_of(salt: &[u8; 16], key: &GroupKey) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(CHECK_CONTEXT);
    h.update(salt);
    h.update(key.0);
    h.finalize().into()
}

fn ct_eq(a: &[u8; 32], b: &[u8; 32]) -> bool {
    a.iter()
        .zip(b.iter())
        .fold(0u8, |acc, (x, y)| acc | (x ^ y))
        == 0
}

impl Verifier {
    /// A verifier for `secret` with a fresh random salt.
    pub fn new(secret: &[u8]) -> Verifier {
        let mut salt = [0u8; 16];
        rand::thread_rng().fill_bytes(&mut salt);
        Verifier::with_salt(secret, salt)
    }

    /// A verifier for `secret` with a given salt (tests).
    pub fn with_salt(secret: &[u8], salt: [u8; 16]) -> Verifier {
        let key = derive_key(secret, &salt);
        Verifier {
            salt,
            check: check_of(&salt, &key),
        }
    }

    /// The key `secret` gives for this group (whether or not it is right).
    pub fn key_for(&self, secret: &[u8]) -> GroupKey {
        derive_key(secret, &self.salt)
    }

    /// True when `key` was derived from the group's secret (constant time).
    pub fn verify_key(&self, key: &GroupKey) -> bool {
        ct_eq(&check_of(&self.salt, key), &self.check)
    }

    /// True when `secret` is the group's secret.
    pub fn verify_secret(&self, secret: &[u8]) -> bool {
        self.verify_key(&self.key_for(secret))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn right_secret_verifies_wrong_does_not() {
        let v = Verifier::new(b"pw");
        assert!(v.verify_secret(b"pw"));
        assert!(!v.verify_secret(b"pw2"));
        assert!(!v.verify_secret(b""));
        assert!(v.verify_key(&v.key_for(b"pw")));
        assert!(!v.verify_key(&GroupKey(v.check)), "the check is not a key");
        let other = Verifier::new(b"pw");
        assert_ne!(other.salt, v.salt, "salts are drawn fresh");
        assert!(
            !v.verify_key(&other.key_for(b"pw")),
            "a key is bound to its group's salt"
        );
        let empty = Verifier::new(b"");
        assert!(empty.verify_secret(b""), "an empty secret is allowed");
    }
}
