//! Invites: how a machine that does not hold the cluster token joins a cluster, from
//! any network that reaches the head's API.
//!
//! `baton invite` asks the running head for an invite and prints its code: the head's
//! URL, the invite's id, a random 32-byte secret, and, when the cluster runs TLS, the
//! SHA-256 fingerprint of its certificate. `baton worker --join CODE` proves it knows the
//! secret (an HMAC over a fresh nonce and the port it listens on: the secret itself never
//! crosses the network) and gets back the cluster token (and TLS certificate and key)
//! sealed with AES-256-GCM under a key derived from the secret and its nonce. The API
//! may be plain HTTP: whoever watches it sees neither secret nor token. An invite is
//! spent by its first join, and expires.

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine as _;
use hmac::{Hmac, Mac};
use rand::RngCore;
use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_256_GCM, NONCE_LEN};
use sha2::Sha256;

use crate::auth::{hex, unhex};

/// What a code starts with (and its format's version).
const PREFIX: &str = "baton-invite-1.";
/// Longest code accepted (a URL of a few hundred bytes, the rest fixed).
pub const MAX_CODE_LEN: usize = 2048;

/// Why a code cannot be read.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
#[error("not a baton invite code: {0}")]
pub struct InviteError(String);

/// An invite, as its code carries it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Invite {
    /// The head's API (`http://host:port`).
    pub url: String,
    /// Names the invite to the head.
    pub id: String,
    /// What the joining machine proves it knows.
    pub secret: [u8; 32],
    /// SHA-256 of the cluster's TLS certificate (hexadecimal), when it runs TLS: the
    /// joining machine checks the certificate it is given against it.
    pub fingerprint: Option<String>,
}

impl Invite {
    /// A new invite to the head at `url`, with a random id and secret.
    pub fn new(url: &str, fingerprint: Option<String>) -> Invite {
        let mut secret = [0u8; 32];
        rand::rng().fill_bytes(&mut secret);
        let mut id = [0u8; 8];
        rand::rng().fill_bytes(&mut id);
        Invite {
            url: url.trim_end_matches('/').to_string(),
            id: hex(&id),
            secret,
            fingerprint,
        }
    }

    /// The code to give the joining machine.
    pub fn code(&self) -> String {
        let text = format!(
            "{}\n{}\n{}\n{}",
            self.url,
            self.id,
            hex(&self.secret),
            self.fingerprint.as_deref().unwrap_or("")
        );
        format!("{PREFIX}{}", URL_SAFE_NO_PAD.encode(text))
    }

    /// Reads a code (surrounding whitespace ignored).
    pub fn parse(code: &str) -> Result<Invite, InviteError> {
        let code = code.trim();
        if code.len() > MAX_CODE_LEN {
            return Err(InviteError(format!("longer than {MAX_CODE_LEN} bytes")));
        }
        let body = code
            .strip_prefix(PREFIX)
            .ok_or_else(|| InviteError(format!("it does not start with {PREFIX}")))?;
        let bytes = URL_SAFE_NO_PAD
            .decode(body)
            .map_err(|e| InviteError(format!("bad base64: {e}")))?;
        let text = String::from_utf8(bytes).map_err(|_| InviteError("not UTF-8".into()))?;
        let fields: Vec<&str> = text.split('\n').collect();
        let [url, id, secret, fingerprint] = fields[..] else {
            return Err(InviteError(format!("{} fields, not 4", fields.len())));
        };
        if !(url.starts_with("http://") || url.starts_with("https://")) || url.chars().any(char::is_control) {
            return Err(InviteError(format!("bad head URL {url:?}")));
        }
        let is_hex = |s: &str, len: usize| s.len() == len && s.bytes().all(|b| b.is_ascii_hexdigit());
        if !is_hex(id, 16) {
            return Err(InviteError("bad invite id".into()));
        }
        if !is_hex(secret, 64) {
            return Err(InviteError("bad secret".into()));
        }
        if !(fingerprint.is_empty() || is_hex(fingerprint, 64)) {
            return Err(InviteError("bad certificate fingerprint".into()));
        }
        let secret: [u8; 32] = unhex(secret).and_then(|s| s.try_into().ok()).expect("checked hex");
        Ok(Invite {
            url: url.to_string(),
            id: id.to_ascii_lowercase(),
            secret,
            fingerprint: (!fingerprint.is_empty()).then(|| fingerprint.to_ascii_lowercase()),
        })
    }
}

/// What an invite names a TLS cluster's certificate by: SHA-256 of its PEM text, in
/// hexadecimal. The head writes it into the code; the joining worker checks the
/// certificate it is given against it.
pub fn fingerprint(cert_pem: &str) -> String {
    use sha2::Digest as _;
    hex(&Sha256::digest(cert_pem.as_bytes()))
}

fn mac(secret: &[u8; 32], label: &[u8], nonce: &[u8; 32]) -> Hmac<Sha256> {
    let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(secret).expect("HMAC takes keys of any length");
    mac.update(label);
    mac.update(nonce);
    mac
}

/// The joining machine's proof that it holds the invite's secret, bound to its nonce
/// and the port it listens on (so a proof seen on the way cannot send the head to
/// another port).
pub fn join_proof(secret: &[u8; 32], nonce: &[u8; 32], port: u16) -> [u8; 32] {
    let mut mac = mac(secret, b"baton join proof v1", nonce);
    mac.update(&port.to_le_bytes());
    mac.finalize().into_bytes().into()
}

/// Whether `proof` is [`join_proof`]'s (compared in constant time).
pub fn verify_join(secret: &[u8; 32], nonce: &[u8; 32], port: u16, proof: &[u8]) -> bool {
    let mut mac = mac(secret, b"baton join proof v1", nonce);
    mac.update(&port.to_le_bytes());
    mac.verify_slice(proof).is_ok()
}

fn grant_key(secret: &[u8; 32], nonce: &[u8; 32]) -> LessSafeKey {
    let key: [u8; 32] = mac(secret, b"baton join grant v1", nonce)
        .finalize()
        .into_bytes()
        .into();
    LessSafeKey::new(UnboundKey::new(&AES_256_GCM, &key).expect("a 32-byte key"))
}

/// Seals what the head grants a joining machine (the token, TLS files) for the holder
/// of `secret` who sent `nonce`: a random AES-GCM nonce, then the ciphertext and tag.
pub fn seal_grant(secret: &[u8; 32], nonce: &[u8; 32], plaintext: &[u8]) -> Vec<u8> {
    let mut iv = [0u8; NONCE_LEN];
    rand::rng().fill_bytes(&mut iv);
    let mut sealed = plaintext.to_vec();
    grant_key(secret, nonce)
        .seal_in_place_append_tag(Nonce::assume_unique_for_key(iv), Aad::empty(), &mut sealed)
        .expect("a grant is far below AES-GCM's length limit");
    [&iv[..], &sealed].concat()
}

/// Opens [`seal_grant`]'s output; `None` when it was changed or sealed for another.
pub fn open_grant(secret: &[u8; 32], nonce: &[u8; 32], sealed: &[u8]) -> Option<Vec<u8>> {
    if sealed.len() < NONCE_LEN {
        return None;
    }
    let (iv, body) = sealed.split_at(NONCE_LEN);
    let iv = Nonce::try_assume_unique_for_key(iv).ok()?;
    let mut body = body.to_vec();
    let plain = grant_key(secret, nonce)
        .open_in_place(iv, Aad::empty(), &mut body)
        .ok()?
        .len();
    body.truncate(plain);
    Some(body)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_code_carries_the_invite_and_nothing_else_reads_as_one() {
        let invite = Invite::new("http://10.0.0.1:8080/", Some("ab".repeat(32)));
        assert_eq!(invite.url, "http://10.0.0.1:8080");
        let code = invite.code();
        assert!(code.starts_with(PREFIX) && code.is_ascii() && !code.contains(char::is_whitespace));
        assert_eq!(Invite::parse(&format!("  {code}\n")).unwrap(), invite);
        let plain = Invite::new("https://head.example:443", None);
        assert_eq!(Invite::parse(&plain.code()).unwrap(), plain);

        assert!(Invite::parse("").is_err());
        assert!(Invite::parse(&code[1..]).is_err());
        assert!(Invite::parse(&format!("{code}x")).is_err(), "bad base64 or fields");
        let forged = |text: &str| format!("{PREFIX}{}", URL_SAFE_NO_PAD.encode(text));
        let secret = "00".repeat(32);
        assert!(Invite::parse(&forged(&format!("ftp://h\n{}\n{secret}\n", "0".repeat(16)))).is_err());
        assert!(Invite::parse(&forged(&format!("http://h\n{}\n{secret}\n", "0".repeat(15)))).is_err());
        assert!(Invite::parse(&forged(&format!("http://h\n{}\n{}\n", "0".repeat(16), "0".repeat(63)))).is_err());
        assert!(Invite::parse(&forged(&format!("http://h\n{}\n{secret}\nxyz", "0".repeat(16)))).is_err());
        assert!(Invite::parse(&forged(&format!("http://h\r\n{}\n{secret}\n", "0".repeat(16)))).is_err());
        assert!(Invite::parse(&forged(&format!("http://h\n{}\n{secret}\n\n", "0".repeat(16)))).is_err());
        assert!(Invite::parse(&forged("http://h\n")).is_err());
        assert!(Invite::parse(&"a".repeat(MAX_CODE_LEN + 1)).is_err());
    }

    #[test]
    fn a_proof_binds_secret_nonce_and_port() {
        let invite = Invite::new("http://h:1", None);
        let nonce = crate::auth::new_nonce();
        let proof = join_proof(&invite.secret, &nonce, 7070);
        assert!(verify_join(&invite.secret, &nonce, 7070, &proof));
        assert!(!verify_join(&invite.secret, &nonce, 7071, &proof), "another port");
        assert!(
            !verify_join(&invite.secret, &crate::auth::new_nonce(), 7070, &proof),
            "another nonce"
        );
        let other = Invite::new("http://h:1", None);
        assert!(!verify_join(&other.secret, &nonce, 7070, &proof), "another secret");
        assert!(!verify_join(&invite.secret, &nonce, 7070, &proof[..31]), "cut short");
    }

    #[test]
    fn a_grant_opens_only_for_the_secret_and_nonce_it_was_sealed_for() {
        let invite = Invite::new("http://h:1", None);
        let nonce = crate::auth::new_nonce();
        let sealed = seal_grant(&invite.secret, &nonce, b"the cluster token");
        assert!(
            !sealed.windows(17).any(|w| w == b"the cluster token"),
            "sealed, not shown"
        );
        assert_eq!(
            open_grant(&invite.secret, &nonce, &sealed).unwrap(),
            b"the cluster token"
        );
        assert!(open_grant(&invite.secret, &crate::auth::new_nonce(), &sealed).is_none());
        assert!(open_grant(&Invite::new("http://h:1", None).secret, &nonce, &sealed).is_none());
        let mut changed = sealed.clone();
        *changed.last_mut().unwrap() ^= 1;
        assert!(open_grant(&invite.secret, &nonce, &changed).is_none());
        assert!(open_grant(&invite.secret, &nonce, &sealed[..5]).is_none());
    }
}
