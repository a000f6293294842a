//! Drives the handshake state machines of `baton_proto::handshake` over a link: receive,
//! feed, send what they return. All the decisions (versions, tokens, refusals and their
//! reasons) are theirs; this file only moves messages, and keys the link's frames when
//! a handshake with a token completes.

use std::time::Instant;

use baton_proto::auth::new_nonce;
use baton_proto::handshake::{stray_auth, turn_away, Client, Failure, HandshakeError, Server, Step};
use baton_proto::{Handshake, Message, Role};

use crate::{Link, NetError};

/// Runs the client side as `role`; returns the server's role (always a worker: any
/// other is refused). With a token, the link's frames are tagged from here on.
///
/// The first exchange (`Hello` out, the server's first answer back) is timed and
/// recorded as the link's round trip ([`Counters::round_trip`](crate::Counters::round_trip)):
/// the server answers it at once, so it is the path's round trip plus a moment of the
/// server's time, measured on the link itself, through whatever relays it.
pub fn client_handshake(link: &mut dyn Link, role: Role, token: Option<&[u8]>) -> Result<Role, NetError> {
    let (mut client, hello) = Client::start(role, token, new_nonce());
    let sent = Instant::now();
    link.send(hello.into())?;
    let mut first = true;
    loop {
        let msg = link.recv()?;
        if std::mem::take(&mut first) {
            link.counters().record_round_trip(sent.elapsed());
        }
        if let Some((send, peer)) = drive(link, client.handle(msg))? {
            send_all(link, send)?;
            if let Some(keys) = client.take_frame_keys() {
                link.authenticate_frames(keys);
            }
            return Ok(peer);
        }
    }
}

/// Runs the server side; returns the client's role. After an error the caller drops
/// the connection (a `Refused` has already told the client why, where it could).
pub fn server_handshake(link: &mut dyn Link, token: Option<&[u8]>) -> Result<Role, NetError> {
    let first = link.recv()?;
    server_handshake_admitting(link, token, first, |_| Ok::<(), NetError>(())).map(|(role, ())| role)
}

/// Runs the server side from the client's `first` message (already read: a worker looks
/// at it before it gives the connection a slot), and once the client has proved the
/// token (or announced itself, without one) asks `admit` whether this connection may be
/// served. `admit` returns what the caller keeps while it serves the connection (a
/// slot, say), or its error saying why it cannot; the client is then told that error's
/// text in a `Busy` refusal instead of this side's last handshake message, never just
/// cut off. With a token, the link's frames are tagged from here on.
pub fn server_handshake_admitting<T, E: std::fmt::Display>(
    link: &mut dyn Link,
    token: Option<&[u8]>,
    first: Message,
    admit: impl FnOnce(Role) -> Result<T, E>,
) -> Result<(Role, T), NetError> {
    let mut server = Server::new(token, new_nonce());
    let mut next = Some(first);
    loop {
        let msg = match next.take() {
            Some(msg) => msg,
            None => link.recv()?,
        };
        if let Some((send, peer)) = drive(link, server.handle(msg))? {
            let admitted = match admit(peer) {
                Ok(admitted) => admitted,
                Err(why) => return Err(fail(link, turn_away(why.to_string()))),
            };
            // The last handshake message goes untagged, like every one before it.
            send_all(link, send)?;
            if let Some(keys) = server.take_frame_keys() {
                link.authenticate_frames(keys);
            }
            return Ok((peer, admitted));
        }
    }
}

/// A server without a token answers a client's `Auth` with this refusal (the first
/// message after the handshake; see `baton_proto::handshake`).
pub fn refuse_unexpected_auth(link: &mut dyn Link) -> NetError {
    fail(link, stray_auth())
}

/// Sends what a step that continues asks for; when the handshake is complete, returns
/// what is left to send and the peer's role, for the caller to finish with.
fn drive(link: &mut dyn Link, step: Result<Step, Failure>) -> Result<Option<(Vec<Handshake>, Role)>, NetError> {
    match step {
        Ok(Step::Continue(send)) => {
            send_all(link, send)?;
            Ok(None)
        }
        Ok(Step::Done { send, peer }) => Ok(Some((send, peer))),
        Err(failure) => Err(fail(link, failure)),
    }
}

/// Sends a side's messages, in order.
fn send_all(link: &mut dyn Link, send: Vec<Handshake>) -> Result<(), NetError> {
    send.into_iter().try_for_each(|msg| link.send(msg.into()))
}

/// Tells the peer why (as far as it still listens) and returns the error.
fn fail(link: &mut dyn Link, failure: Failure) -> NetError {
    let refused = !failure.send.is_empty();
    if refused && send_all(link, failure.send).is_ok() {
        link.close_gently();
    }
    let peer = link.peer().to_string();
    match failure.error {
        HandshakeError::Refused { code, reason } => NetError::Refused { peer, code, reason },
        HandshakeError::Auth { reason } => NetError::Auth { peer, reason },
        HandshakeError::Version { theirs, reason } => NetError::Version { peer, theirs, reason },
        HandshakeError::Unexpected { expected, got } => NetError::Unexpected { peer, expected, got },
        error @ HandshakeError::Role { .. } => NetError::Auth {
            peer,
            reason: error.to_string(),
        },
        HandshakeError::TurnedAway { reason } => NetError::TurnedAway { peer, reason },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{local_pair, LocalLink};
    use baton_proto::{Message, RefusalCode};
    use std::time::Duration;

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

    #[test]
    fn the_client_records_the_first_exchange_as_the_links_round_trip() {
        for token in [Some(&b"k"[..]), None] {
            let (mut client, mut server) = local_pair("client", "worker");
            assert_eq!(client.counters().round_trip(), None);
            let serving = std::thread::spawn(move || {
                let first = server.recv().unwrap();
                // The reply leaves 50 ms after the Hello arrived: the round trip is at
                // least that, whenever this thread ran.
                std::thread::sleep(Duration::from_millis(50));
                server_handshake_admitting(&mut server, token, first, |_| Ok::<(), NetError>(())).unwrap();
            });
            client_handshake(&mut client, Role::Ring, token).unwrap();
            serving.join().unwrap();
            let round_trip = client.counters().round_trip().expect("measured");
            assert!(
                round_trip >= Duration::from_millis(50) && round_trip < Duration::from_secs(5),
                "{round_trip:?}"
            );
        }
    }

    #[test]
    fn a_server_that_cannot_admit_the_client_tells_it_why_with_and_without_a_token() {
        for token in [Some(&b"k"[..]), None] {
            let (mut client, mut server) = local_pair("client", "worker");
            let serving = std::thread::spawn(move || {
                let first = server.recv().unwrap();
                server_handshake_admitting(&mut server, token, first, |role| {
                    assert_eq!(role, Role::Heartbeat, "asked once the peer is known");
                    Err::<(), _>("too many connections: 4 are open".to_string())
                })
                .map(|(role, ())| role)
            });
            let err = client_handshake(&mut client, Role::Heartbeat, token).unwrap_err();
            assert_eq!(err.refusal(), Some(RefusalCode::Busy), "{err}");
            assert_eq!(
                err.to_string(),
                "worker refused the connection: too many connections: 4 are open"
            );
            let served = serving.join().unwrap().unwrap_err().to_string();
            assert_eq!(served, "turned client away: too many connections: 4 are open");
        }
    }
}
