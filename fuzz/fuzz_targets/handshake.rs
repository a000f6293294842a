//! The connection handshake's state machines (`baton_proto::handshake`), fed the frames
//! a peer could send; no socket, so every input runs in microseconds and the same input
//! always takes the same path (but for the random nonce of the side under test, which
//! the peer cannot know, exactly as on a real connection).
//!
//! The first byte picks the side under test: its two low bits the side (a worker's
//! server side; or a client as head, ring or heartbeat), bit 2 whether it holds a cluster
//! token. The rest is the peer's bytes: frames, each an 8-byte header and the payload it
//! announces, read as a transport reads them (the worker's frame limit before
//! authentication, the strict decoder). Each decoded message goes to the side; what the
//! side sends back is encoded, as a transport would, and not fed anywhere. Input ends,
//! a frame that does not decode, and the side finishing or failing end the run.
//!
//! Checked: nothing panics; a side holding a token never succeeds (the peer cannot
//! prove a token over our random challenge, so success would be a bypass); a failure
//! that tells the peer why sends at most a version's `Hello` and one `Refused`.
#![no_main]

use baton_proto::auth::new_nonce;
use baton_proto::handshake::{Client, Server, Step};
use baton_proto::{decode, encode, parse_header, Handshake, Message, Role, HEADER_LEN};
use libfuzzer_sys::fuzz_target;

const TOKEN: &[u8] = b"fuzz cluster token";

/// The worker's frame limit before authentication (`HANDSHAKE_MAX_FRAME` in
/// crates/worker/src/server.rs).
const HANDSHAKE_MAX_FRAME: usize = 64 << 10;

/// One side of the handshake, whichever it is.
enum Side {
    Server(Server),
    Client(Client),
}

impl Side {
    fn handle(&mut self, msg: Message) -> Result<Step, baton_proto::handshake::Failure> {
        match self {
            Side::Server(server) => server.handle(msg),
            Side::Client(client) => client.handle(msg),
        }
    }
}

/// The next frame of `bytes` as a message, or `None` when the input ends or the frame
/// would make a transport drop the connection.
fn next_message(bytes: &mut &[u8]) -> Option<Message> {
    let (head, rest) = bytes.split_first_chunk::<HEADER_LEN>()?;
    let (kind, len) = parse_header(head, HANDSHAKE_MAX_FRAME).ok()?;
    let (payload, rest) = rest.split_at_checked(len)?;
    *bytes = rest;
    decode(kind, payload).ok()
}

/// Encodes what the side sends, as a transport would.
fn send(messages: &[Handshake]) {
    let mut out = Vec::new();
    messages.iter().for_each(|m| encode(&m.clone().into(), &mut out));
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, mut peer_bytes)) = data.split_first() else {
        return;
    };
    let token = (mode & 0b100 != 0).then_some(TOKEN);
    let mut side = match mode & 0b11 {
        0 => Side::Server(Server::new(token, new_nonce())),
        n => {
            let role = [Role::Head, Role::Ring, Role::Heartbeat][usize::from(n) - 1];
            let (client, hello) = Client::start(role, token, new_nonce());
            send(&[hello]);
            Side::Client(client)
        }
    };
    while let Some(msg) = next_message(&mut peer_bytes) {
        match side.handle(msg) {
            Ok(Step::Continue(messages)) => send(&messages),
            Ok(Step::Done { send: messages, peer }) => {
                send(&messages);
                assert!(
                    token.is_none(),
                    "a handshake with a token succeeded against a peer that cannot know it ({peer:?})"
                );
                return;
            }
            Err(failure) => {
                let refusals = failure
                    .send
                    .iter()
                    .filter(|m| matches!(m, Handshake::Refused { .. }))
                    .count();
                assert!(refusals <= 1 && failure.send.len() <= 2, "{failure:?}");
                send(&failure.send);
                return;
            }
        }
    }
});
