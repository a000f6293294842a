//! The first frames on every connection: versions, roles, and (with a cluster token)
//! mutual proof of the token by HMAC challenge–response. The token itself never
//! crosses the wire.
//!
//! ```text
//! client                         server
//!   Hello{version, role, nonce_c} →
//!                                ← Hello{version, Worker, nonce_s}
//!   Auth{proof_c}                 →        (only when the client has a token)
//!                                ← Auth{proof_s} | Refused{reason}
//! ```
//! A server with a token refuses a client that sends anything but `Auth` next; a
//! server without one refuses a client that sends `Auth`. Both say why in `Refused`.

use baton_proto::auth::{new_nonce, proof, verify};
use baton_proto::{Message, Role, PROTOCOL_VERSION};

use crate::tcp::TcpLink;
use crate::NetError;

/// Runs the client side; returns the server's role.
pub fn client_handshake(link: &mut TcpLink, role: Role, token: Option<&[u8]>) -> Result<Role, NetError> {
    let nonce = new_nonce();
    link.send(&Message::Hello {
        version: PROTOCOL_VERSION,
        role,
        nonce,
    })?;
    let (peer_role, peer_nonce) = match link.recv()? {
        Message::Hello { version, role, nonce } => {
            check_version(link, version)?;
            (role, nonce)
        }
        Message::Refused { reason } => return Err(refused(link, reason)),
        other => return Err(unexpected(link, "Hello", &other)),
    };
    if let Some(token) = token {
        link.send(&Message::Auth {
            proof: proof(token, &peer_nonce, &nonce, role),
        })?;
        match link.recv()? {
            Message::Auth { proof } => {
                if !verify(token, &nonce, &peer_nonce, peer_role, &proof) {
                    let reason = "the worker's proof of the token is wrong: it has another token".to_string();
                    let _ = link.send(&Message::Refused { reason: reason.clone() });
                    return Err(NetError::Auth {
                        peer: link.peer().to_string(),
                        reason,
                    });
                }
            }
            Message::Refused { reason } => return Err(refused(link, reason)),
            other => return Err(unexpected(link, "Auth", &other)),
        }
    }
    Ok(peer_role)
}

/// Runs the server side; returns the client's role. After an error the caller drops
/// the connection (a `Refused` has already told the client why, where it could).
pub fn server_handshake(link: &mut TcpLink, token: Option<&[u8]>) -> Result<Role, NetError> {
    let (peer_role, peer_nonce) = match link.recv()? {
        Message::Hello { version, role, nonce } => {
            if version != PROTOCOL_VERSION {
                let reason =
                    format!("protocol version {version} is not supported (this worker speaks {PROTOCOL_VERSION})");
                let _ = link.send(&Message::Refused { reason: reason.clone() });
                return Err(NetError::Version {
                    peer: link.peer().to_string(),
                    reason,
                });
            }
            (role, nonce)
        }
        other => return Err(unexpected(link, "Hello", &other)),
    };
    let nonce = new_nonce();
    link.send(&Message::Hello {
        version: PROTOCOL_VERSION,
        role: Role::Worker,
        nonce,
    })?;
    let Some(token) = token else {
        return Ok(peer_role);
    };
    match link.recv()? {
        Message::Auth { proof: their } => {
            if !verify(token, &nonce, &peer_nonce, peer_role, &their) {
                let reason = "wrong token: the proof does not match this worker's --token".to_string();
                let _ = link.send(&Message::Refused { reason: reason.clone() });
                return Err(NetError::Auth {
                    peer: link.peer().to_string(),
                    reason,
                });
            }
            link.send(&Message::Auth {
                proof: proof(token, &peer_nonce, &nonce, Role::Worker),
            })?;
            Ok(peer_role)
        }
        other => {
            let reason = format!(
                "this worker requires a token (--token), but the peer sent {} instead",
                other.kind()
            );
            let _ = link.send(&Message::Refused { reason: reason.clone() });
            Err(NetError::Auth {
                peer: link.peer().to_string(),
                reason,
            })
        }
    }
}

/// A server without a token answers a client's `Auth` with this refusal.
pub fn refuse_unexpected_auth(link: &mut TcpLink) -> NetError {
    let reason = "this worker runs without a token, but the peer sent one".to_string();
    let _ = link.send(&Message::Refused { reason: reason.clone() });
    NetError::Auth {
        peer: link.peer().to_string(),
        reason,
    }
}

fn check_version(link: &TcpLink, version: u32) -> Result<(), NetError> {
    if version == PROTOCOL_VERSION {
        return Ok(());
    }
    Err(NetError::Version {
        peer: link.peer().to_string(),
        reason: format!("peer speaks protocol version {version}, this node {PROTOCOL_VERSION}"),
    })
}

fn refused(link: &TcpLink, reason: String) -> NetError {
    NetError::Refused {
        peer: link.peer().to_string(),
        reason,
    }
}

fn unexpected(link: &TcpLink, expected: &str, got: &Message) -> NetError {
    NetError::Unexpected {
        peer: link.peer().to_string(),
        expected: expected.to_string(),
        got: got.kind().to_string(),
    }
}
