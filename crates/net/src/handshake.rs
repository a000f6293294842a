//! Drives the handshake state machines of `baton_proto::handshake` over a link: receive,
//! feed, send what they return. All the decisions (versions, tokens, refusals and their
//! reasons) are theirs; this file only moves messages.

use baton_proto::auth::new_nonce;
use baton_proto::handshake::{stray_auth, Client, Failure, HandshakeError, Server, Step};
use baton_proto::Role;

use crate::{Link, NetError};

/// Runs the client side as `role`; returns the server's role.
pub fn client_handshake(link: &mut dyn Link, role: Role, token: Option<&[u8]>) -> Result<Role, NetError> {
    let (mut client, hello) = Client::start(role, token, new_nonce());
    link.send(hello)?;
    loop {
        let msg = link.recv()?;
        if let Some(peer) = drive(link, client.handle(msg))? {
            return Ok(peer);
        }
    }
}

/// Runs the server side; returns the client's role. After an error the caller drops
/// the connection (a `Refused` has already told the client why, where it could).
pub fn server_handshake(link: &mut dyn Link, token: Option<&[u8]>) -> Result<Role, NetError> {
    let mut server = Server::new(token, new_nonce());
    loop {
        let msg = link.recv()?;
        if let Some(peer) = drive(link, server.handle(msg))? {
            return Ok(peer);
        }
    }
}

/// A server without a token answers a client's `Auth` with this refusal (the first
/// message after the handshake; see `baton_proto::handshake`).
pub fn refuse_unexpected_auth(link: &mut dyn Link) -> NetError {
    fail(link, stray_auth())
}

/// Sends what one step asks for; `Some(role)` when the handshake is complete.
fn drive(link: &mut dyn Link, step: Result<Step, Failure>) -> Result<Option<Role>, NetError> {
    match step {
        Ok(Step::Continue(send)) => {
            send.into_iter().try_for_each(|msg| link.send(msg))?;
            Ok(None)
        }
        Ok(Step::Done { send, peer }) => {
            send.into_iter().try_for_each(|msg| link.send(msg))?;
            Ok(Some(peer))
        }
        Err(failure) => Err(fail(link, failure)),
    }
}

/// Tells the peer why (as far as it still listens) and returns the error.
fn fail(link: &mut dyn Link, failure: Failure) -> NetError {
    let refused = !failure.send.is_empty();
    if refused && failure.send.into_iter().try_for_each(|msg| link.send(msg)).is_ok() {
        link.close_gently();
    }
    let peer = link.peer().to_string();
    match failure.error {
        HandshakeError::Refused { code, reason } => NetError::Refused { peer, code, reason },
        HandshakeError::Auth { reason } => NetError::Auth { peer, reason },
        HandshakeError::Version { theirs, reason } => NetError::Version { peer, theirs, reason },
        HandshakeError::Unexpected { expected, got } => NetError::Unexpected { peer, expected, got },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{local_pair, LocalLink};
    use baton_proto::{Message, RefusalCode};

    /// Runs both sides over an in-process link, each on its own thread.
    fn both(
        role: Role,
        client_token: Option<&'static [u8]>,
        server_token: Option<&'static [u8]>,
    ) -> (Result<Role, NetError>, Result<Role, NetError>, LocalLink, LocalLink) {
        let (mut client, mut server) = local_pair("client", "worker");
        let serving = std::thread::spawn(move || {
            let result = server_handshake(&mut server, server_token);
            (result, server)
        });
        let client_result = client_handshake(&mut client, role, client_token);
        let (server_result, server) = serving.join().unwrap();
        (client_result, server_result, client, server)
    }

    #[test]
    fn the_drivers_complete_a_handshake_and_report_refusals_as_typed_errors() {
        let (client, server, _, _) = both(Role::Ring, Some(b"k"), Some(b"k"));
        assert_eq!(client.unwrap(), Role::Worker);
        assert_eq!(server.unwrap(), Role::Ring);

        let (client, server, _, _) = both(Role::Head, Some(b"x"), Some(b"k"));
        assert!(
            matches!(
                client,
                Err(NetError::Refused {
                    code: RefusalCode::Auth,
                    ..
                })
            ),
            "{client:?}"
        );
        let server = server.unwrap_err().to_string();
        assert_eq!(
            server,
            "authentication with client failed: wrong token: the proof does not match this worker's --token"
        );

        // Without a token on the server, the client's proof arrives as the first message
        // after the handshake; the worker refuses it with the stray-auth refusal.
        let (mut client, mut server) = local_pair("client", "worker");
        let serving = std::thread::spawn(move || {
            server_handshake(&mut server, None).unwrap();
            assert!(matches!(server.recv().unwrap(), Message::Auth { .. }));
            refuse_unexpected_auth(&mut server)
        });
        let err = client_handshake(&mut client, Role::Head, Some(b"k")).unwrap_err();
        assert_eq!(
            err.to_string(),
            "worker refused the connection: this worker runs without a token, but the peer sent one"
        );
        assert_eq!(err.refusal(), Some(RefusalCode::Auth));
        assert!(matches!(serving.join().unwrap(), NetError::Auth { .. }));
    }
}
