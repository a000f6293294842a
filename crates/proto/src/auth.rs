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
//! nonces ([`frame_keys`]), and every later frame is sealed ([`FrameSeal`]): its tag
//! covers its bytes and its sequence number in that direction, so a relay can pass
//! frames on unchanged, and nothing else.

use hmac::{Hmac, Mac};
use rand::RngCore;
use ring::aead::{Aad, LessSafeKey, Nonce, Tag, UnboundKey, AES_256_GCM};
use sha2::{Digest, Sha256};

use crate::codec::role_byte;
use crate::Role;

/// Domain separation: these proofs cannot be confused with any other use of the secret.
const AUTH_CONTEXT: &[u8] = b"baton-auth-v1";

/// Domain separation of the frame keys (one per direction).
const FRAME_KEY_CONTEXT: &[u8] = b"baton-frame-key-v1";

/// Bytes of the tag that follows every frame after a handshake with a token (an
/// AES-256-GCM tag; see [`FrameSeal`]).
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

/// Seals the frames of one direction of one connection with AES-256-GCM under that
/// direction's key: the header is authenticated, the payload encrypted in place, and
/// the 16-byte tag goes after it. The nonce is the frame's sequence number in that
/// direction (u64, little-endian, from 0, in 12 bytes): it is never sent, both ends
/// count, so a frame replayed, dropped or moved breaks every later tag; and a key is
/// used for one direction of one connection only, so no nonce repeats under a key.
///
/// Why an AEAD rather than an HMAC over the frame: AES-GCM's tag is a MAC like any
/// other, and with AES and carry-less multiply instructions (x86-64, most ARMv8) it
/// costs a fifth of HMAC-SHA256 (10 GB/s against 2 GB/s on the development machine);
/// hiding the payload from whoever lacks the token comes with it. See
/// `docs/cluster.md` for what it does not give (forward secrecy: that is TLS's job).
#[derive(Clone)]
pub struct FrameSeal {
    key: LessSafeKey,
    seq: u64,
}

impl std::fmt::Debug for FrameSeal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The key stays out of logs.
        f.debug_struct("FrameSeal")
            .field("seq", &self.seq)
            .finish_non_exhaustive()
    }
}

impl FrameSeal {
    fn new(key: &[u8; 32]) -> FrameSeal {
        let key = UnboundKey::new(&AES_256_GCM, key).expect("a 32-byte key fits AES-256");
        FrameSeal {
            key: LessSafeKey::new(key),
            seq: 0,
        }
    }

    fn nonce(&mut self) -> Nonce {
        let mut nonce = [0u8; 12];
        nonce[4..].copy_from_slice(&self.seq.to_le_bytes());
        self.seq += 1;
        Nonce::assume_unique_for_key(nonce)
    }

    /// Seals the next frame sent: encrypts `payload` in place (the length does not
    /// change) and returns the tag that authenticates it and `header`.
    pub fn seal(&mut self, header: &[u8], payload: &mut [u8]) -> [u8; TAG_LEN] {
        let nonce = self.nonce();
        let tag = self
            .key
            .seal_in_place_separate_tag(nonce, Aad::from(header), payload)
            .expect("frames are far below AES-GCM's length limit");
        let mut out = [0u8; TAG_LEN];
        out.copy_from_slice(tag.as_ref());
        out
    }

    /// Opens the next frame received: checks `tag` against `header` and the sealed
    /// `payload`, and decrypts the payload in place. `false` (the payload then holds
    /// nothing usable) when anything was changed, added, dropped or reordered.
    pub fn open(&mut self, header: &[u8], payload: &mut [u8], tag: &[u8]) -> bool {
        let nonce = self.nonce();
        let Ok(tag) = <[u8; TAG_LEN]>::try_from(tag) else {
            return false;
        };
        self.key
            .open_in_place_separate_tag(nonce, Aad::from(header), Tag::from(tag), payload, 0..)
            .is_ok()
    }

    /// Frames sealed or opened so far.
    pub fn frames(&self) -> u64 {
        self.seq
    }
}

/// The two directions' seals of one connection, from one end's point of view.
#[derive(Clone, Debug)]
pub struct FrameKeys {
    /// Seals what this end sends.
    pub send: FrameSeal,
    /// Opens what this end receives.
    pub recv: FrameSeal,
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
    let to_server = FrameSeal::new(&key(b"client to server"));
    let to_client = FrameSeal::new(&key(b"server to client"));
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

/// The name a cluster goes by on the local network (workers announce it, a head looks
/// for it): an HMAC of a fixed label under the token, so that it tells nothing of the
/// token, and members of other clusters on the same network are told apart. 16 bytes
/// in hexadecimal.
pub fn cluster_id(token: &[u8]) -> String {
    let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(token).expect("HMAC takes keys of any length");
    mac.update(b"baton cluster id v1");
    hex(&mac.finalize().into_bytes()[..16])
}

/// The bytes of hexadecimal `text` (either case); `None` when it is not that.
pub fn unhex(text: &str) -> Option<Vec<u8>> {
    // `from_str_radix` alone would take "+1".
    if !text.len().is_multiple_of(2) || !text.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(text.get(i..i + 2)?, 16).ok())
        .collect()
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
    fn hex_reads_back() {
        assert_eq!(unhex(&hex(&[0, 1, 0xab, 0xff])), Some(vec![0, 1, 0xab, 0xff]));
        assert_eq!(unhex("ABcd"), Some(vec![0xab, 0xcd]));
        assert_eq!(unhex(""), Some(vec![]));
        for bad in ["a", "0g", "+1", "é0"] {
            assert_eq!(unhex(bad), None, "{bad}");
        }
    }

    #[test]
    fn a_cluster_id_names_its_token_and_tells_nothing_of_it() {
        let id = cluster_id(SECRET);
        assert_eq!(id.len(), 32);
        assert!(id.bytes().all(|b| b.is_ascii_hexdigit()));
        assert_eq!(id, cluster_id(SECRET), "the same token, the same id");
        assert_ne!(id, cluster_id(b"another secret"));
        assert!(!id.contains(&hex(SECRET)));
        assert_ne!(id, hex(&identity_hash(SECRET))[..32], "not a plain hash of the token");
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

    /// Seals `payload` as the next frame of `seal`; returns the sealed bytes and tag.
    fn sealed(seal: &mut FrameSeal, header: &[u8], payload: &[u8]) -> (Vec<u8>, [u8; TAG_LEN]) {
        let mut bytes = payload.to_vec();
        let tag = seal.seal(header, &mut bytes);
        (bytes, tag)
    }

    #[test]
    fn frames_open_in_order_and_only_in_their_direction() {
        let (nonce_c, nonce_s) = (new_nonce(), new_nonce());
        let mut client = frame_keys(SECRET, &nonce_c, &nonce_s, Side::Client);
        let mut server = frame_keys(SECRET, &nonce_c, &nonce_s, Side::Server);
        let frames: [(&[u8], &[u8]); 3] = [(b"head1", b"payload one"), (b"head2", b""), (b"head3", b"three")];
        let sent: Vec<_> = frames.iter().map(|(h, p)| sealed(&mut client.send, h, p)).collect();
        assert_ne!(sent[0].0, b"payload one", "the payload does not travel in the clear");
        // A frame opened out of order fails.
        let mut reordered = server.recv.clone();
        assert!(!reordered.open(frames[1].0, &mut sent[1].0.clone(), &sent[1].1));
        for ((h, p), (bytes, tag)) in frames.iter().zip(&sent) {
            let mut bytes = bytes.clone();
            assert!(server.recv.open(h, &mut bytes, tag));
            assert_eq!(&bytes, p);
        }
        assert_eq!(server.recv.frames(), 3);
        // A changed header or payload byte fails; so does the frame sent back the other
        // way (each direction has its own key).
        let (bytes, tag) = sealed(&mut server.send, b"head1", b"payload one");
        let mut flipped = bytes.clone();
        flipped[3] ^= 1;
        assert!(!client.recv.clone().open(b"head1", &mut flipped, &tag));
        assert!(!client.recv.clone().open(b"heaD1", &mut bytes.clone(), &tag));
        assert!(!client.recv.clone().open(b"head1", &mut sent[0].0.clone(), &sent[0].1));
        assert!(client.recv.open(b"head1", &mut bytes.clone(), &tag));
        // Another connection (other nonces) or another token: other keys.
        let mut other = frame_keys(SECRET, &new_nonce(), &nonce_s, Side::Server);
        assert!(!other.recv.open(frames[0].0, &mut sent[0].0.clone(), &sent[0].1));
        let mut other = frame_keys(b"another secret", &nonce_c, &nonce_s, Side::Server);
        assert!(!other.recv.open(frames[0].0, &mut sent[0].0.clone(), &sent[0].1));
        // Short or empty tags never pass.
        let mut fresh = frame_keys(SECRET, &nonce_c, &nonce_s, Side::Server);
        assert!(!fresh
            .recv
            .clone()
            .open(frames[0].0, &mut sent[0].0.clone(), &sent[0].1[..8]));
        assert!(!fresh.recv.open(frames[0].0, &mut sent[0].0.clone(), &[]));
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
