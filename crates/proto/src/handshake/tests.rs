//! Every path of the handshake, with both sides run against each other in memory (or
//! against scripted messages), deterministic nonces, and no I/O.

use super::*;

const NONCE_C: [u8; 32] = [0xc1; 32];
const NONCE_S: [u8; 32] = [0x5e; 32];

/// How one side's handshake ended: the peer's role, or the error.
type Outcome = Result<Role, HandshakeError>;

/// Runs a client as `role` against a server until both are done or one fails, as a
/// transport would: each side's messages are fed to the other in order. After its
/// handshake the client sends `first` (what a head, ring link or heartbeat sends next),
/// and the server screens the first message after its own handshake for a stray
/// `Auth`, as a worker does. Returns both outcomes and every message, tagged with its
/// sender.
fn exchange(
    role: Role,
    client_token: Option<&[u8]>,
    server_token: Option<&[u8]>,
    first: Message,
) -> (Outcome, Outcome, Vec<(char, Message)>) {
    let (mut client, hello) = Client::start(role, client_token, NONCE_C);
    let mut server = Server::new(server_token, NONCE_S);
    let mut transcript = Vec::new();
    let mut to_server = vec![Message::from(hello)];
    let mut to_client: Vec<Message> = Vec::new();
    let (mut client_out, mut server_out): (Option<Outcome>, Option<Outcome>) = (None, None);
    for _ in 0..10 {
        for msg in std::mem::take(&mut to_server) {
            transcript.push(('c', msg.clone()));
            if server_out.is_some() {
                // The worker's session (or heartbeat) reads what follows the handshake.
                if let (Some(Ok(_)), Message::Auth { .. }) = (&server_out, &msg) {
                    let failure = stray_auth();
                    to_client.extend(failure.send.into_iter().map(Message::from));
                    server_out = Some(Err(failure.error));
                }
                continue;
            }
            match server.handle(msg) {
                Ok(Step::Continue(send)) => to_client.extend(send.into_iter().map(Message::from)),
                Ok(Step::Done { send, peer }) => {
                    to_client.extend(send.into_iter().map(Message::from));
                    server_out = Some(Ok(peer));
                }
                Err(failure) => {
                    to_client.extend(failure.send.into_iter().map(Message::from));
                    server_out = Some(Err(failure.error));
                }
            }
        }
        for msg in std::mem::take(&mut to_client) {
            transcript.push(('s', msg.clone()));
            if client_out.is_some() {
                continue;
            }
            match client.handle(msg) {
                Ok(Step::Continue(send)) => to_server.extend(send.into_iter().map(Message::from)),
                Ok(Step::Done { send, peer }) => {
                    to_server.extend(send.into_iter().map(Message::from));
                    to_server.push(first.clone());
                    client_out = Some(Ok(peer));
                }
                Err(failure) => {
                    to_server.extend(failure.send.into_iter().map(Message::from));
                    client_out = Some(Err(failure.error));
                }
            }
        }
        if to_server.is_empty() && to_client.is_empty() {
            break;
        }
    }
    let pending = || {
        Err(HandshakeError::Unexpected {
            expected: "an end",
            got: "nothing",
        })
    };
    (
        client_out.unwrap_or_else(pending),
        server_out.unwrap_or_else(pending),
        transcript,
    )
}

fn auth(reason: &str) -> HandshakeError {
    HandshakeError::Auth { reason: reason.into() }
}

fn refused(code: RefusalCode, reason: &str) -> HandshakeError {
    HandshakeError::Refused {
        code,
        reason: reason.into(),
    }
}

const WRONG_TOKEN: &str = "wrong token: the proof does not match this worker's --token";
const NEEDS_TOKEN: &str = "this worker requires a token (--token), but the peer sent Describe instead";
const NO_TOKEN: &str = "this worker runs without a token, but the peer sent one";

/// A table row: case, the client's role, client token, server token, and the outcome
/// on the client and on the server.
type Case = (
    &'static str,
    Role,
    Option<&'static [u8]>,
    Option<&'static [u8]>,
    Outcome,
    Outcome,
);

#[test]
fn client_and_server_agree_or_refuse_with_a_reason() {
    let describe = || Message::Describe {
        model: crate::ModelRef {
            file_name: "m.gguf".into(),
            identity: [1; 32],
            size: 1,
        },
    };
    let cases: Vec<Case> = vec![
        ("no tokens", Role::Head, None, None, Ok(Role::Worker), Ok(Role::Head)),
        (
            "same token",
            Role::Head,
            Some(b"k"),
            Some(b"k"),
            Ok(Role::Worker),
            Ok(Role::Head),
        ),
        (
            "same token, ring",
            Role::Ring,
            Some(b"k"),
            Some(b"k"),
            Ok(Role::Worker),
            Ok(Role::Ring),
        ),
        (
            "same token, heartbeat",
            Role::Heartbeat,
            Some(b"k"),
            Some(b"k"),
            Ok(Role::Worker),
            Ok(Role::Heartbeat),
        ),
        (
            "wrong token",
            Role::Head,
            Some(b"other"),
            Some(b"k"),
            Err(refused(RefusalCode::Auth, WRONG_TOKEN)),
            Err(auth(WRONG_TOKEN)),
        ),
        (
            "empty token against a token",
            Role::Head,
            Some(b""),
            Some(b"k"),
            Err(refused(RefusalCode::Auth, WRONG_TOKEN)),
            Err(auth(WRONG_TOKEN)),
        ),
        (
            "client without a token",
            Role::Head,
            None,
            Some(b"k"),
            // The client thinks it is through; its first request is refused.
            Ok(Role::Worker),
            Err(auth(NEEDS_TOKEN)),
        ),
        (
            "server without a token",
            Role::Head,
            Some(b"k"),
            None,
            Err(refused(RefusalCode::Auth, NO_TOKEN)),
            Err(auth(NO_TOKEN)),
        ),
    ];
    for (case, role, client_token, server_token, client_expected, server_expected) in cases {
        let (client, server, transcript) = exchange(role, client_token, server_token, describe());
        assert_eq!(client, client_expected, "{case}: client\n{transcript:#?}");
        assert_eq!(server, server_expected, "{case}: server\n{transcript:#?}");
        // Whoever refuses says why, with the code, in one `Refused`.
        let refusals: Vec<_> = transcript
            .iter()
            .filter(|(_, m)| matches!(m, Message::Refused { .. }))
            .collect();
        let refused = server.is_err() || client.is_err();
        assert_eq!(refusals.len(), usize::from(refused), "{case}\n{transcript:#?}");
    }
}

#[test]
fn the_token_never_travels_and_each_side_proves_it_once() {
    let (_, _, transcript) = exchange(
        Role::Head,
        Some(b"cluster secret"),
        Some(b"cluster secret"),
        Message::Pong,
    );
    let kinds: Vec<(char, &str)> = transcript.iter().map(|(from, m)| (*from, m.kind())).collect();
    assert_eq!(
        kinds,
        [
            ('c', "Hello"),
            ('s', "Hello"),
            ('c', "Auth"),
            ('s', "Auth"),
            ('c', "Pong")
        ]
    );
    let mut bytes = Vec::new();
    for (_, msg) in &transcript {
        crate::encode(msg, &mut bytes);
    }
    assert!(!bytes.windows(14).any(|w| w == b"cluster secret"));
}

#[test]
fn a_hello_of_another_version_is_answered_with_this_versions_hello_then_refused() {
    let mut server = Server::new(Some(b"k"), NONCE_S);
    let failure = server
        .handle(Message::Hello {
            version: PROTOCOL_VERSION - 1,
            role: Role::Head,
            nonce: NONCE_C,
        })
        .unwrap_err();
    let reason = format!(
        "protocol version {} is not supported (this worker speaks {PROTOCOL_VERSION})",
        PROTOCOL_VERSION - 1
    );
    assert_eq!(
        failure.error,
        HandshakeError::Version {
            theirs: PROTOCOL_VERSION - 1,
            reason: reason.clone()
        }
    );
    assert_eq!(
        failure.send,
        [
            Handshake::Hello {
                version: PROTOCOL_VERSION,
                role: Role::Worker,
                nonce: NONCE_S
            },
            Handshake::Refused {
                code: RefusalCode::Version,
                reason
            },
        ]
    );

    // A client reads the version from that Hello and stops there.
    let (mut client, _) = Client::start(Role::Head, None, NONCE_C);
    let failure = client
        .handle(Message::Hello {
            version: PROTOCOL_VERSION + 1,
            role: Role::Worker,
            nonce: NONCE_S,
        })
        .unwrap_err();
    assert_eq!(failure.send, []);
    assert_eq!(
        failure.error.to_string(),
        format!(
            "peer speaks protocol version {}, this node {PROTOCOL_VERSION}",
            PROTOCOL_VERSION + 1
        )
    );
}

#[test]
fn unexpected_messages_end_the_handshake() {
    let pong = Message::Pong;
    let hello = |role| Message::Hello {
        version: PROTOCOL_VERSION,
        role,
        nonce: NONCE_S,
    };
    // (case, the messages before, the one that does not belong, what was expected)
    let client_cases = [
        ("client awaiting Hello", vec![], pong.clone(), "Hello"),
        (
            "client awaiting Auth",
            vec![hello(Role::Worker)],
            hello(Role::Worker),
            "Auth",
        ),
    ];
    for (case, before, wrong, expected) in client_cases {
        let (mut client, _) = Client::start(Role::Head, Some(b"k"), NONCE_C);
        for msg in before {
            client.handle(msg).unwrap();
        }
        let failure = client.handle(wrong).unwrap_err();
        assert!(
            matches!(failure.error, HandshakeError::Unexpected { expected: e, .. } if e == expected),
            "{case}: {failure:?}"
        );
        assert_eq!(failure.send, [], "{case}: the client does not answer a confused server");
    }

    // A server tells the peer what it expected.
    let mut server = Server::new(None, NONCE_S);
    let failure = server.handle(pong.clone()).unwrap_err();
    assert_eq!(failure.error.to_string(), "Pong where Hello was expected");
    assert_eq!(
        failure.send,
        [Handshake::Refused {
            code: RefusalCode::BadRequest,
            reason: "Pong where Hello was expected".into()
        }]
    );
    // Once finished (here: done without a token) a side takes nothing more.
    let mut server = Server::new(None, NONCE_S);
    assert!(matches!(server.handle(hello(Role::Head)), Ok(Step::Done { .. })));
    assert!(server.handle(hello(Role::Head)).is_err());
    let (mut client, _) = Client::start(Role::Head, None, NONCE_C);
    assert!(matches!(client.handle(hello(Role::Worker)), Ok(Step::Done { .. })));
    assert!(client.handle(hello(Role::Worker)).is_err());
}

#[test]
fn a_refusal_carries_its_code_to_the_client_at_any_step() {
    let busy = Message::Refused {
        code: RefusalCode::Busy,
        reason: "another head is already connected to this worker".into(),
    };
    let (mut client, _) = Client::start(Role::Head, None, NONCE_C);
    let failure = client.handle(busy.clone()).unwrap_err();
    assert_eq!(
        failure.error,
        refused(RefusalCode::Busy, "another head is already connected to this worker")
    );
    assert_eq!(failure.send, []);

    let (mut client, _) = Client::start(Role::Ring, Some(b"k"), NONCE_C);
    client
        .handle(Message::Hello {
            version: PROTOCOL_VERSION,
            role: Role::Worker,
            nonce: NONCE_S,
        })
        .unwrap();
    let tls = Message::Refused {
        code: RefusalCode::TlsRequired,
        reason: "this worker requires TLS".into(),
    };
    assert!(matches!(
        client.handle(tls).unwrap_err().error,
        HandshakeError::Refused {
            code: RefusalCode::TlsRequired,
            ..
        }
    ));
}

#[test]
fn a_server_that_reflects_the_clients_challenge_or_proof_is_refused() {
    let token: &[u8] = b"k";
    // Echoing the client's nonce and role back: the server could then return the
    // client's own proof as its own.
    let (mut client, hello) = Client::start(Role::Head, Some(token), NONCE_C);
    let Handshake::Hello { nonce, .. } = hello else {
        panic!("{hello:?}")
    };
    let step = client
        .handle(Message::Hello {
            version: PROTOCOL_VERSION,
            role: Role::Head,
            nonce,
        })
        .unwrap();
    let Step::Continue(sent) = step else { panic!("{step:?}") };
    let [Handshake::Auth { proof: own }] = sent[..] else {
        panic!("{sent:?}")
    };
    let failure = client.handle(Message::Auth { proof: own }).unwrap_err();
    assert!(matches!(failure.error, HandshakeError::Auth { .. }), "{failure:?}");
    assert!(matches!(
        failure.send[..],
        [Handshake::Refused {
            code: RefusalCode::Auth,
            ..
        }]
    ));
}

#[test]
fn refusal_codes_have_stable_distinct_numbers() {
    let numbers: Vec<u16> = RefusalCode::ALL.iter().map(|c| c.number()).collect();
    assert_eq!(numbers, [1, 2, 3, 4, 5, 6, 7]);
    for code in RefusalCode::ALL {
        assert_eq!(RefusalCode::from_number(code.number()), Some(code));
    }
    assert_eq!(RefusalCode::from_number(0), None);
    assert_eq!(RefusalCode::from_number(8), None);
}

/// Issue 16: a relay that dials no worker at all but hands two clients each other's
/// `Hello` and `Auth` made each take the other's proof for a worker's (both prove the
/// same token over the same two nonces).
#[test]
fn two_clients_relayed_into_each_other_both_refuse() {
    let token: &[u8] = b"cluster secret";
    let (mut a, hello_a) = Client::start(Role::Head, Some(token), NONCE_C);
    let (mut b, hello_b) = Client::start(Role::Ring, Some(token), NONCE_S);
    let Step::Continue(auth_a) = a.handle(hello_b).unwrap() else {
        panic!("a answers a Hello with its proof")
    };
    let Step::Continue(auth_b) = b.handle(hello_a).unwrap() else {
        panic!("b answers a Hello with its proof")
    };
    let a_end = a.handle(auth_b[0].clone()).unwrap_err();
    let b_end = b.handle(auth_a[0].clone()).unwrap_err();
    assert_eq!(a_end.error, HandshakeError::Role { got: Role::Ring });
    assert_eq!(b_end.error, HandshakeError::Role { got: Role::Head });
    assert_eq!(
        a_end.error.to_string(),
        "the peer announced itself as Ring where a worker was expected"
    );
    assert!(a.take_frame_keys().is_none() && b.take_frame_keys().is_none());

    // Without tokens the role is all there is to check.
    let (mut a, _) = Client::start(Role::Head, None, NONCE_C);
    let failure = a
        .handle(Message::Hello {
            version: PROTOCOL_VERSION,
            role: Role::Heartbeat,
            nonce: NONCE_S,
        })
        .unwrap_err();
    assert_eq!(failure.error, HandshakeError::Role { got: Role::Heartbeat });
    assert_eq!(failure.send, []);
}

#[test]
fn a_handshake_with_a_token_leaves_both_sides_matching_frame_keys() {
    let token: &[u8] = b"cluster secret";
    let (mut client, hello) = Client::start(Role::Head, Some(token), NONCE_C);
    let mut server = Server::new(Some(token), NONCE_S);
    let Step::Continue(server_hello) = server.handle(hello).unwrap() else {
        panic!()
    };
    assert!(server.take_frame_keys().is_none(), "no keys before the proof");
    let Step::Continue(client_auth) = client.handle(server_hello[0].clone()).unwrap() else {
        panic!()
    };
    let Step::Done { send, .. } = server.handle(client_auth[0].clone()).unwrap() else {
        panic!()
    };
    assert!(matches!(client.handle(send[0].clone()).unwrap(), Step::Done { .. }));
    let mut c = client.take_frame_keys().expect("client keys");
    let mut s = server.take_frame_keys().expect("server keys");
    assert!(client.take_frame_keys().is_none(), "taken once");
    let mut payload = b"payload".to_vec();
    let tag = c.send.seal(b"header", &mut payload);
    assert!(s.recv.open(b"header", &mut payload, &tag));
    assert_eq!(payload, b"payload");
    let mut reply = b"reply".to_vec();
    let tag = s.send.seal(b"header", &mut reply);
    assert!(c.recv.open(b"header", &mut reply, &tag));

    // Without tokens there is nothing to key frames with.
    let (mut client, hello) = Client::start(Role::Head, None, NONCE_C);
    let mut server = Server::new(None, NONCE_S);
    let Step::Done { send, .. } = server.handle(hello).unwrap() else {
        panic!()
    };
    client.handle(send[0].clone()).unwrap();
    assert!(client.take_frame_keys().is_none() && server.take_frame_keys().is_none());
}

#[test]
fn a_peer_turned_away_is_told_why_with_a_busy_refusal() {
    let failure = turn_away("too many connections: 64 are open".into());
    assert_eq!(
        failure.send,
        [Handshake::Refused {
            code: RefusalCode::Busy,
            reason: "too many connections: 64 are open".into()
        }]
    );
    // A client waiting for the server's proof (or its Hello) reads it as a refusal.
    let (mut client, _) = Client::start(Role::Head, None, NONCE_C);
    let error = client.handle(failure.send[0].clone()).unwrap_err().error;
    assert_eq!(error, refused(RefusalCode::Busy, "too many connections: 64 are open"));
}
