//! Challenge–response proof of a shared cluster secret, and the hashes that identify
//! models and tensors.
//!
//! Both sides send `Hello` with a fresh [`new_nonce`]; each then sends
//! `Auth { proof(secret, peer_nonce, own_nonce, own_role) }` and checks the other's with
//! [`verify`]. The secret never travels. Signing the verifier's nonce makes a recorded
//! proof useless on a later connection; signing the prover's own nonce and role as well
//! means a proof cannot be sent back to the side that made it (reflection), since that
//! side would expect its peer's nonce and role in that place.

use hmac::{Hmac, Mac};
use rand::RngCore;
use sha2::{Digest, Sha256};

use crate::codec::role_byte;
use crate::Role;

/// Domain separation: these proofs cannot be confused with any other use of the secret.
const AUTH_CONTEXT: &[u8] = b"baton-auth-v1";

/// A fresh random challenge for `Hello`, from a generator seeded by the operating system.
pub fn new_nonce() -> [u8; 32] {
    let mut nonce = [0; 32];
    rand::rng().fill_bytes(&mut nonce);
    nonce
}

/// The proof this side sends: HMAC-SHA256 keyed by `secret` over the context string,
/// `peer_nonce` (the challenge the peer sent us), `own_nonce` (the one we sent) and
/// our role.
pub fn proof(secret: &[u8], peer_nonce: &[u8; 32], own_nonce: &[u8; 32], own_role: Role) -> [u8; 32] {
    mac(secret, peer_nonce, own_nonce, own_role)
        .finalize()
        .into_bytes()
        .into()
}

/// Checks the peer's proof in constant time. The arguments are those the peer passed to
/// [`proof`], seen from here: `own_nonce` is the challenge we sent (the prover's
/// `peer_nonce`), `peer_nonce` and `peer_role` the ones the peer announced.
///
/// A peer that echoes our own nonce and role back in its `Hello` is refused: it could
/// otherwise return our proof as its own. Two honest random nonces never coincide.
pub fn verify(secret: &[u8], own_nonce: &[u8; 32], peer_nonce: &[u8; 32], peer_role: Role, proof: &[u8; 32]) -> bool {
    own_nonce != peer_nonce
        && mac(secret, own_nonce, peer_nonce, peer_role)
            .verify_slice(proof)
            .is_ok()
}

/// The HMAC state over everything a proof binds, in the order [`proof`] documents.
fn mac(secret: &[u8], challenge: &[u8; 32], prover_nonce: &[u8; 32], prover_role: Role) -> Hmac<Sha256> {
    // HMAC takes keys of any length (long ones are hashed first), so this cannot fail.
    let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(secret).expect("HMAC accepts keys of any length");
    mac.update(AUTH_CONTEXT);
    mac.update(challenge);
    mac.update(prover_nonce);
    mac.update(&[role_byte(prover_role)]);
    mac
}

/// SHA-256 of `bytes`: identifies a model (over its header and tensor index) and checks
/// streamed tensors.
pub fn identity_hash(bytes: &[u8]) -> [u8; 32] {
    Sha256::digest(bytes).into()
}

/// Lower-case hexadecimal, for logs and file names.
pub fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut text = String::with_capacity(bytes.len() * 2);
    for &byte in bytes {
        text.push(DIGITS[usize::from(byte >> 4)] as char);
        text.push(DIGITS[usize::from(byte & 0x0f)] as char);
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECRET: &[u8] = b"cluster secret";

    /// A handshake between A (head) and B (worker) as the transports run it.
    struct Exchange {
        nonce_a: [u8; 32],
        nonce_b: [u8; 32],
        proof_a: [u8; 32],
        proof_b: [u8; 32],
    }

    fn exchange(secret_a: &[u8], secret_b: &[u8]) -> Exchange {
        let (nonce_a, nonce_b) = (new_nonce(), new_nonce());
        Exchange {
            nonce_a,
            nonce_b,
            proof_a: proof(secret_a, &nonce_b, &nonce_a, Role::Head),
            proof_b: proof(secret_b, &nonce_a, &nonce_b, Role::Worker),
        }
    }

    #[test]
    fn same_secret_verifies_both_ways() {
        let x = exchange(SECRET, SECRET);
        assert!(
            verify(SECRET, &x.nonce_b, &x.nonce_a, Role::Head, &x.proof_a),
            "B accepts A"
        );
        assert!(
            verify(SECRET, &x.nonce_a, &x.nonce_b, Role::Worker, &x.proof_b),
            "A accepts B"
        );
    }

    #[test]
    fn wrong_secret_fails() {
        let x = exchange(b"another secret", SECRET);
        assert!(!verify(SECRET, &x.nonce_b, &x.nonce_a, Role::Head, &x.proof_a));
        let x = exchange(SECRET, b"");
        assert!(!verify(SECRET, &x.nonce_a, &x.nonce_b, Role::Worker, &x.proof_b));
    }

    #[test]
    fn swapped_nonces_fail() {
        let x = exchange(SECRET, SECRET);
        assert!(!verify(SECRET, &x.nonce_a, &x.nonce_b, Role::Head, &x.proof_a));
        assert!(!verify(SECRET, &x.nonce_b, &x.nonce_a, Role::Worker, &x.proof_b));
    }

    #[test]
    fn reflected_proof_fails() {
        // B does not know the secret, so it sends A's own proof back to A. A checks it as
        // B's proof and must refuse it, even when B claims A's role.
        let x = exchange(SECRET, SECRET);
        for claimed_role in [Role::Worker, Role::Head, Role::Ring] {
            assert!(!verify(SECRET, &x.nonce_a, &x.nonce_b, claimed_role, &x.proof_a));
        }
    }

    #[test]
    fn echoed_nonce_fails() {
        // A server that answers A's Hello with A's own nonce and role gets a proof over
        // (nonce_a, nonce_a, Head), exactly what A would expect from it; `verify` must
        // still refuse to accept it back.
        let nonce_a = new_nonce();
        let proof_a = proof(SECRET, &nonce_a, &nonce_a, Role::Head);
        assert!(!verify(SECRET, &nonce_a, &nonce_a, Role::Head, &proof_a));
    }

    #[test]
    fn nonces_differ() {
        assert_ne!(new_nonce(), new_nonce());
    }

    #[test]
    fn hashes_and_hex_match_known_values() {
        assert_eq!(
            hex(&identity_hash(b"abc")),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        assert_eq!(hex(&[0x00, 0x0f, 0xa0, 0xff]), "000fa0ff");
        assert_eq!(hex(&[]), "");
    }
}
