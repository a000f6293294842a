//! Challenge–response proof of a shared cluster secret, and the hashes that identify
//! models and tensors.
//!
//! Both sides send `Hello` with a fresh [`new_nonce`]; each then sends
//! `Auth { proof(secret, peer_nonce, own_nonce, own_role) }` and checks the other's with
//! [`verify`]. The secret never travels. Signing the verifier's nonce makes a recorded
//! proof useless on a later connection; signing the prover's own nonce and role as well
//! means a proof cannot be sent back to the side that made it (reflection), since that
//! side would expect its peer's nonce and role in that place.
//!
//! The proofs alone authenticate the first frames only: anyone a node dials could relay
//! a real worker's `Hello` and `Auth` and then read, drop or rewrite what follows. So a
//! handshake with a token also derives a key per direction from the token and both
//! nonces ([`frame_keys`]), and every later frame carries a tag ([`FrameMac`]) over its
//! bytes and its sequence number in that direction: a relay can pass frames on
//! unchanged (it reads them unless TLS hides them), and nothing else.

use hmac::{Hmac, Mac};
use rand::RngCore;
use sha2::{Digest, Sha256};

use crate::codec::role_byte;
use crate::Role;

/// Domain separation: these proofs cannot be confused with any other use of the secret.
const AUTH_CONTEXT: &[u8] = b"baton-auth-v1";

/// Domain separation of the frame keys (one per direction).
const FRAME_KEY_CONTEXT: &[u8] = b"baton-frame-key-v1";

/// Bytes of the tag that follows every frame after a handshake with a token: HMAC-SHA256
/// truncated to 128 bits, as in TLS 1.2's and IPsec's HMAC suites.
pub const TAG_LEN: usize = 16;

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

/// Shortest cluster token accepted, in bytes. Anyone who records one handshake can try
/// tokens offline against its proofs, so a token must be long and random (32 random
/// bytes, as hex, is what the docs suggest); an empty or short one is refused.
pub const MIN_TOKEN_LEN: usize = 12;

/// Why a cluster token cannot be used.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum TokenError {
    /// The token is empty (an unset variable, an empty file).
    #[error("the cluster token is empty: give a long random secret (e.g. `openssl rand -hex 32`)")]
    Empty,
    /// The token is shorter than [`MIN_TOKEN_LEN`].
    #[error(
        "the cluster token is {len} bytes long, shorter than the {MIN_TOKEN_LEN} allowed: anyone who \
         records a handshake could guess it offline; use a long random secret (e.g. `openssl rand -hex 32`)"
    )]
    Short { len: usize },
}

/// Checks that `token` is long enough to be a cluster secret.
pub fn check_token(token: &[u8]) -> Result<(), TokenError> {
    match token.len() {
        0 => Err(TokenError::Empty),
        len if len < MIN_TOKEN_LEN => Err(TokenError::Short { len }),
        _ => Ok(()),
    }
}

/// Which end of a connection this is, for [`frame_keys`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    /// The end that dialed (sent the first `Hello`).
    Client,
    /// The end that accepted.
    Server,
}

/// Tags the frames of one direction of one connection: HMAC-SHA256 under that
/// direction's key over the frame's sequence number (u64, little-endian, from 0), its
/// header and its payload, truncated to [`TAG_LEN`]. The sequence number is not sent:
/// both ends count, so a frame replayed, dropped or moved breaks every later tag.
#[derive(Clone)]
pub struct FrameMac {
    /// HMAC keyed with this direction's key, before any input (cloned per frame, so the
    /// key schedule runs once per connection, not once per frame).
    keyed: Hmac<Sha256>,
    seq: u64,
}

impl std::fmt::Debug for FrameMac {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The key stays out of logs.
        f.debug_struct("FrameMac")
            .field("seq", &self.seq)
            .finish_non_exhaustive()
    }
}

impl FrameMac {
    fn new(key: &[u8; 32]) -> FrameMac {
        FrameMac {
            keyed: <Hmac<Sha256> as Mac>::new_from_slice(key).expect("HMAC accepts keys of any length"),
            seq: 0,
        }
    }

    /// The tag of the next frame sent (`header` then `payload`).
    pub fn tag(&mut self, header: &[u8], payload: &[u8]) -> [u8; TAG_LEN] {
        let full = self.next(header, payload).finalize().into_bytes();
        let mut tag = [0; TAG_LEN];
        tag.copy_from_slice(&full[..TAG_LEN]);
        tag
    }

    /// Checks the tag of the next frame received, in constant time. Only a whole tag
    /// passes (`verify_truncated_left` alone would accept a one-byte prefix).
    pub fn verify(&mut self, header: &[u8], payload: &[u8], tag: &[u8]) -> bool {
        let mac = self.next(header, payload);
        tag.len() == TAG_LEN && mac.verify_truncated_left(tag).is_ok()
    }

    /// Frames tagged or checked so far.
    pub fn frames(&self) -> u64 {
        self.seq
    }

    fn next(&mut self, header: &[u8], payload: &[u8]) -> Hmac<Sha256> {
        let mut mac = self.keyed.clone();
        mac.update(&self.seq.to_le_bytes());
        mac.update(header);
        mac.update(payload);
        self.seq += 1;
        mac
    }
}

/// The two directions' tags of one connection, from one end's point of view.
#[derive(Clone, Debug)]
pub struct FrameKeys {
    /// Tags what this end sends.
    pub send: FrameMac,
    /// Checks what this end receives.
    pub recv: FrameMac,
}

/// The frame keys of a connection whose handshake proved `secret` on both sides:
/// HMAC-SHA256 keyed by the secret over a context string, the direction, and both
/// nonces (client's first). Each connection and direction gets its own key, so a frame
/// cannot be replayed on another connection or reflected back to its sender.
pub fn frame_keys(secret: &[u8], client_nonce: &[u8; 32], server_nonce: &[u8; 32], side: Side) -> FrameKeys {
    let key = |direction: &[u8]| -> [u8; 32] {
        let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(secret).expect("HMAC accepts keys of any length");
        mac.update(FRAME_KEY_CONTEXT);
        mac.update(direction);
        mac.update(client_nonce);
        mac.update(server_nonce);
        mac.finalize().into_bytes().into()
    };
    let to_server = FrameMac::new(&key(b"client to server"));
    let to_client = FrameMac::new(&key(b"server to client"));
    match side {
        Side::Client => FrameKeys {
            send: to_server,
            recv: to_client,
        },
        Side::Server => FrameKeys {
            send: to_client,
            recv: to_server,
        },
    }
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
    fn frame_tags_check_out_in_order_and_only_in_their_direction() {
        let (nonce_c, nonce_s) = (new_nonce(), new_nonce());
        let mut client = frame_keys(SECRET, &nonce_c, &nonce_s, Side::Client);
        let mut server = frame_keys(SECRET, &nonce_c, &nonce_s, Side::Server);
        let frames: [(&[u8], &[u8]); 3] = [(b"head1", b"payload one"), (b"head2", b""), (b"head3", b"three")];
        let tags: Vec<_> = frames.iter().map(|(h, p)| client.send.tag(h, p)).collect();
        // A frame checked out of order fails, and so does every frame after it.
        let mut reordered = server.recv.clone();
        assert!(!reordered.verify(frames[1].0, frames[1].1, &tags[1]));
        for ((h, p), tag) in frames.iter().zip(&tags) {
            assert!(server.recv.verify(h, p, tag));
        }
        assert_eq!(server.recv.frames(), 3);
        // Another byte, another tag; the same tag sent back the other way is refused.
        let tag = server.send.tag(b"head1", b"payload one");
        assert_ne!(tag, tags[0], "each direction has its own key");
        let mut flipped = client.recv.clone();
        assert!(!flipped.verify(b"head1", b"payload onE", &tag));
        assert!(!client.clone().recv.verify(b"head1", b"payload one", &tags[0]));
        assert!(client.recv.verify(b"head1", b"payload one", &tag));
        // Another connection (other nonces) or another token: other keys.
        let mut other = frame_keys(SECRET, &new_nonce(), &nonce_s, Side::Server);
        assert!(!other.recv.verify(frames[0].0, frames[0].1, &tags[0]));
        let mut other = frame_keys(b"another secret", &nonce_c, &nonce_s, Side::Server);
        assert!(!other.recv.verify(frames[0].0, frames[0].1, &tags[0]));
        // Short or empty tags never pass.
        let mut fresh = frame_keys(SECRET, &nonce_c, &nonce_s, Side::Server);
        assert!(!fresh.recv.verify(frames[0].0, frames[0].1, &tags[0][..8]));
        assert!(!fresh.recv.verify(frames[0].0, frames[0].1, &[]));
    }

    #[test]
    fn empty_and_short_tokens_are_refused() {
        assert_eq!(check_token(b""), Err(TokenError::Empty));
        assert_eq!(check_token(b"secret"), Err(TokenError::Short { len: 6 }));
        assert_eq!(check_token(b"0123456789a"), Err(TokenError::Short { len: 11 }));
        assert_eq!(check_token(b"0123456789ab"), Ok(()));
        assert!(TokenError::Short { len: 6 }.to_string().contains("6 bytes long"));
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
