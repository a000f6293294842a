//! The first frames on every connection, as two state machines that do no I/O: the
//! transport feeds each side the messages it receives (whatever arrived) and sends
//! what the side returns (only [`Handshake`] messages).
//! Nonces come in as arguments, so every path is a plain function of its inputs.
//!
//! ```text
//! client                         server
//!   Hello{version, role, nonce_c} →
//!                                ← Hello{version, Worker, nonce_s}
//!   Auth{proof_c}                 →        (only when the client has a token)
//!                                ← Auth{proof_s} | Refused{Auth, reason}
//! ```
//!
//! Versions and tokens (see [`auth`](crate::auth)) are checked on both sides. A server
//! refuses a `Hello` of another version after sending its own `Hello`, whose layout never
//! changes: a client of any version learns which version this end speaks from it, even
//! when it cannot decode this version's `Refused`. A server with a token refuses a client
//! that sends anything but `Auth` next. A server without one has finished after its
//! `Hello`; if the client then sends `Auth` (it holds a token this end lacks), the server
//! refuses that first message with [`stray_auth`].
//!
//! A client accepts only a server that announces itself as a worker (checked once the
//! server has proved the token, when there is one): two clients relayed into each other
//! would otherwise each take the other's proof for a worker's. After a handshake with a
//! token both sides hold the connection's frame keys ([`Client::take_frame_keys`],
//! [`Server::take_frame_keys`]); the transport tags every later frame with them. A
//! server that has authenticated a peer but cannot take one more connection sends
//! [`turn_away`]'s refusal in place of its last handshake message.

use crate::auth::{frame_keys, proof, verify, FrameKeys, Side};
use crate::{Handshake, Message, RefusalCode, Role, PROTOCOL_VERSION};

/// Why a handshake failed, from this side's point of view.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum HandshakeError {
    /// The peer refused us (its code and reason).
    #[error("{reason}")]
    Refused { code: RefusalCode, reason: String },
    /// A token proof failed, or only one side has a token.
    #[error("{reason}")]
    Auth { reason: String },
    /// The peer speaks protocol version `theirs`.
    #[error("{reason}")]
    Version { theirs: u32, reason: String },
    /// The peer sent a valid message that does not belong at this point.
    #[error("{got} where {expected} was expected")]
    Unexpected { expected: &'static str, got: &'static str },
    /// The server announced a role other than worker.
    #[error("the peer announced itself as {got:?} where a worker was expected")]
    Role { got: Role },
    /// This server authenticated the peer but cannot take another connection.
    #[error("{reason}")]
    TurnedAway { reason: String },
}

/// A failed handshake: why, and what to send the peer before closing the connection
/// (a `Refused` that tells it why, where it can be told; nothing otherwise).
#[derive(Clone, Debug, PartialEq)]
pub struct Failure {
    /// Why it failed.
    pub error: HandshakeError,
    /// Messages to send, in order, before closing.
    pub send: Vec<Handshake>,
}

impl Failure {
    /// A failure that tells the peer why with a `Refused` of `code`.
    fn refusing(code: RefusalCode, error: HandshakeError) -> Failure {
        let reason = error.to_string();
        Failure {
            error,
            send: vec![Handshake::Refused { code, reason }],
        }
    }

    /// A failure the peer is not told about (it refused us, or it is not a peer that
    /// could make sense of an answer).
    fn silent(error: HandshakeError) -> Failure {
        Failure {
            error,
            send: Vec::new(),
        }
    }
}

/// What a side wants after a message it was fed.
#[derive(Clone, Debug, PartialEq)]
pub enum Step {
    /// Send these (possibly none) and feed the peer's next message.
    Continue(Vec<Handshake>),
    /// Send these (possibly none): the handshake is complete, the peer announced `peer`.
    Done { send: Vec<Handshake>, peer: Role },
}

/// The side that opens the connection (a head, a ring link, a heartbeat).
#[derive(Debug)]
pub struct Client {
    role: Role,
    token: Option<Vec<u8>>,
    nonce: [u8; 32],
    state: ClientState,
    keys: Option<FrameKeys>,
}

#[derive(Debug)]
enum ClientState {
    AwaitHello,
    AwaitAuth { peer: Role, peer_nonce: [u8; 32] },
    Finished,
}

impl Client {
    /// Starts the client side as `role`, challenging the server with `nonce` (fresh and
    /// random: [`auth::new_nonce`](crate::auth::new_nonce)); returns the `Hello` to send.
    pub fn start(role: Role, token: Option<&[u8]>, nonce: [u8; 32]) -> (Client, Handshake) {
        let hello = Handshake::Hello {
            version: PROTOCOL_VERSION,
            role,
            nonce,
        };
        let client = Client {
            role,
            token: token.map(<[u8]>::to_vec),
            nonce,
            state: ClientState::AwaitHello,
            keys: None,
        };
        (client, hello)
    }

    /// Feeds the server's next message (whatever arrived: a message of another
    /// conversation fails the handshake like one out of place).
    pub fn handle(&mut self, msg: impl Into<Message>) -> Result<Step, Failure> {
        let state = std::mem::replace(&mut self.state, ClientState::Finished);
        let msg = msg.into();
        let got = msg.kind();
        match (state, Handshake::try_from(msg)) {
            (_, Ok(Handshake::Refused { code, reason })) => {
                Err(Failure::silent(HandshakeError::Refused { code, reason }))
            }
            (ClientState::AwaitHello, Ok(Handshake::Hello { version, role, nonce })) => {
                if version != PROTOCOL_VERSION {
                    return Err(Failure::silent(HandshakeError::Version {
                        theirs: version,
                        reason: format!("peer speaks protocol version {version}, this node {PROTOCOL_VERSION}"),
                    }));
                }
                let Some(token) = &self.token else {
                    expect_worker(role)?;
                    return Ok(Step::Done {
                        send: Vec::new(),
                        peer: role,
                    });
                };
                let auth = Handshake::Auth {
                    proof: proof(token, &nonce, &self.nonce, self.role),
                };
                self.state = ClientState::AwaitAuth {
                    peer: role,
                    peer_nonce: nonce,
                };
                Ok(Step::Continue(vec![auth]))
            }
            (ClientState::AwaitAuth { peer, peer_nonce }, Ok(Handshake::Auth { proof })) => {
                // Only `AwaitAuth` is reached with a token.
                let token = self.token.as_deref().unwrap_or_default();
                if !verify(token, &self.nonce, &peer_nonce, peer, &proof) {
                    let reason = "the worker's proof of the token is wrong: it has another token".to_string();
                    return Err(Failure::refusing(RefusalCode::Auth, HandshakeError::Auth { reason }));
                }
                expect_worker(peer)?;
                self.keys = Some(frame_keys(token, &self.nonce, &peer_nonce, Side::Client));
                Ok(Step::Done { send: Vec::new(), peer })
            }
            (state, _) => Err(Failure::silent(HandshakeError::Unexpected {
                expected: match state {
                    ClientState::AwaitHello => "Hello",
                    ClientState::AwaitAuth { .. } => "Auth",
                    ClientState::Finished => "nothing (the handshake is over)",
                },
                got,
            })),
        }
    }
}

impl Client {
    /// The connection's frame keys, once the handshake has completed with a token
    /// (`None` before, without a token, and after the first call).
    pub fn take_frame_keys(&mut self) -> Option<FrameKeys> {
        self.keys.take()
    }
}

/// Servers are workers; a client accepts no other role (see the module documentation).
fn expect_worker(role: Role) -> Result<(), Failure> {
    match role {
        Role::Worker => Ok(()),
        got => Err(Failure::silent(HandshakeError::Role { got })),
    }
}

/// The side that accepts the connection (a worker).
#[derive(Debug)]
pub struct Server {
    token: Option<Vec<u8>>,
    nonce: [u8; 32],
    state: ServerState,
    keys: Option<FrameKeys>,
}

#[derive(Debug)]
enum ServerState {
    AwaitHello,
    AwaitAuth { peer: Role, peer_nonce: [u8; 32] },
    Finished,
}

impl Server {
    /// A server side that challenges the client with `nonce` (fresh and random).
    pub fn new(token: Option<&[u8]>, nonce: [u8; 32]) -> Server {
        Server {
            token: token.map(<[u8]>::to_vec),
            nonce,
            state: ServerState::AwaitHello,
            keys: None,
        }
    }

    fn hello(&self) -> Handshake {
        Handshake::Hello {
            version: PROTOCOL_VERSION,
            role: Role::Worker,
            nonce: self.nonce,
        }
    }

    /// Feeds the client's next message (whatever arrived: a message of another
    /// conversation fails the handshake like one out of place).
    pub fn handle(&mut self, msg: impl Into<Message>) -> Result<Step, Failure> {
        let state = std::mem::replace(&mut self.state, ServerState::Finished);
        let msg = msg.into();
        let got = msg.kind();
        match (state, Handshake::try_from(msg)) {
            (ServerState::AwaitHello, Ok(Handshake::Hello { version, role, nonce })) => {
                if version != PROTOCOL_VERSION {
                    let reason =
                        format!("protocol version {version} is not supported (this worker speaks {PROTOCOL_VERSION})");
                    return Err(Failure {
                        send: vec![
                            self.hello(),
                            Handshake::Refused {
                                code: RefusalCode::Version,
                                reason: reason.clone(),
                            },
                        ],
                        error: HandshakeError::Version {
                            theirs: version,
                            reason,
                        },
                    });
                }
                if self.token.is_none() {
                    return Ok(Step::Done {
                        send: vec![self.hello()],
                        peer: role,
                    });
                }
                self.state = ServerState::AwaitAuth {
                    peer: role,
                    peer_nonce: nonce,
                };
                Ok(Step::Continue(vec![self.hello()]))
            }
            (ServerState::AwaitAuth { peer, peer_nonce }, Ok(Handshake::Auth { proof: theirs })) => {
                let token = self.token.as_deref().unwrap_or_default();
                if !verify(token, &self.nonce, &peer_nonce, peer, &theirs) {
                    let reason = "wrong token: the proof does not match this worker's --token".to_string();
                    return Err(Failure::refusing(RefusalCode::Auth, HandshakeError::Auth { reason }));
                }
                self.keys = Some(frame_keys(token, &peer_nonce, &self.nonce, Side::Server));
                Ok(Step::Done {
                    send: vec![Handshake::Auth {
                        proof: proof(token, &peer_nonce, &self.nonce, Role::Worker),
                    }],
                    peer,
                })
            }
            (ServerState::AwaitAuth { .. }, _) => {
                let reason = format!("this worker requires a token (--token), but the peer sent {got} instead");
                Err(Failure::refusing(RefusalCode::Auth, HandshakeError::Auth { reason }))
            }
            (state, _) => {
                let expected = match state {
                    ServerState::AwaitHello => "Hello",
                    _ => "nothing (the handshake is over)",
                };
                Err(Failure::refusing(
                    RefusalCode::BadRequest,
                    HandshakeError::Unexpected { expected, got },
                ))
            }
        }
    }
}

impl Server {
    /// The connection's frame keys, once the handshake has completed with a token
    /// (`None` before, without a token, and after the first call).
    pub fn take_frame_keys(&mut self) -> Option<FrameKeys> {
        self.keys.take()
    }
}

/// What a server sends in place of its last handshake message (its `Hello` without a
/// token, its `Auth` with one) when it has authenticated the peer but cannot take the
/// connection: a `Busy` refusal that says why, so the peer is told instead of reset.
pub fn turn_away(reason: String) -> Failure {
    Failure::refusing(RefusalCode::Busy, HandshakeError::TurnedAway { reason })
}

/// What a server without a token answers when the first message after its handshake is
/// an `Auth`: the client holds a token and expects this end to prove one too.
pub fn stray_auth() -> Failure {
    let reason = "this worker runs without a token, but the peer sent one".to_string();
    Failure::refusing(RefusalCode::Auth, HandshakeError::Auth { reason })
}

#[cfg(test)]
mod tests;
