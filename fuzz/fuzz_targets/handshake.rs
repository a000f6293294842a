//! The connection handshake over a real loopback `TcpLink`, against a peer that sends
//! the input's bytes and then closes its sending side.
//!
//! The first byte picks the side under test: its two low bits the side (a worker's
//! server side, `TcpLink::accept` then `server_handshake`; or a client as head, ring or
//! heartbeat), bit 2 whether it holds a cluster token. The rest is the peer's bytes,
//! written before the handshake starts (they fit in the socket's buffer, so no thread
//! is needed), then end-of-stream: every read returns data or end-of-file at once, and a
//! short read timeout guards against a handshake that waits anyway.
//!
//! Checked: nothing panics; a side holding a token never succeeds (the peer cannot
//! prove a token over our random challenge, so success would be a bypass).
#![no_main]

use std::io::Write;
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::OnceLock;
use std::time::Duration;

use baton_net::{client_handshake, server_handshake, LinkOptions, TcpLink};
use baton_proto::Role;
use libfuzzer_sys::fuzz_target;

/// Peer bytes beyond this are dropped: a handshake reads at most three frames, and the
/// bytes must fit in the loopback socket's buffers since nothing reads them concurrently.
const MAX_PEER_BYTES: usize = 16 << 10;

const TOKEN: &[u8] = b"fuzz cluster token";

/// The worker's frame limit before authentication. With the 64 MiB default instead,
/// `TcpLink::recv` allocates and zeroes whatever an 8-byte header announces before
/// reading it: ~100 ms per such input here.
const HANDSHAKE_MAX_FRAME: usize = 64 << 10;

/// One listener for the whole process; every input gets a fresh connection to it.
fn listener() -> &'static TcpListener {
    static LISTENER: OnceLock<TcpListener> = OnceLock::new();
    LISTENER.get_or_init(|| TcpListener::bind("127.0.0.1:0").expect("bind a loopback listener"))
}

/// A connected pair: (the fuzzed peer's end, the end the handshake runs on).
fn connection() -> (TcpStream, TcpStream) {
    let listener = listener();
    let peer = TcpStream::connect(listener.local_addr().expect("listener address")).expect("connect");
    // Closing with a reset leaves no TIME_WAIT behind, so thousands of connections a
    // second do not run out of ports.
    socket2::SockRef::from(&peer)
        .set_linger(Some(Duration::ZERO))
        .expect("set SO_LINGER");
    let (ours, _) = listener.accept().expect("accept");
    (peer, ours)
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, peer_bytes)) = data.split_first() else {
        return;
    };
    let peer_bytes = &peer_bytes[..peer_bytes.len().min(MAX_PEER_BYTES)];
    let token = (mode & 0b100 != 0).then_some(TOKEN);

    let (mut peer, ours) = connection();
    peer.write_all(peer_bytes).expect("write the peer's bytes");
    peer.shutdown(Shutdown::Write)
        .expect("shut down the peer's sending side");

    // What a worker's link has until the peer authenticates (its frame limit is
    // `HANDSHAKE_MAX_FRAME` in crates/node/src/cluster/worker.rs), with a read timeout
    // short enough for fuzzing.
    let opts = LinkOptions {
        max_frame: HANDSHAKE_MAX_FRAME,
        read_timeout: Some(Duration::from_millis(500)),
        ..LinkOptions::default()
    };
    // The server side starts as a worker's connection does (`accept` refuses a peer that
    // opens with a TLS record when the node has no TLS); a client's link is plain.
    let link = match mode & 0b11 {
        0 => TcpLink::accept(ours, "fuzz peer".into(), &opts),
        _ => Ok(TcpLink::new(ours, "fuzz peer".into(), &opts).expect("wrap the connected stream")),
    };
    let Ok(mut link) = link else {
        return;
    };
    let result = match mode & 0b11 {
        0 => server_handshake(&mut link, token),
        1 => client_handshake(&mut link, Role::Head, token),
        2 => client_handshake(&mut link, Role::Ring, token),
        _ => client_handshake(&mut link, Role::Heartbeat, token),
    };
    if let Ok(role) = result {
        assert!(
            token.is_none(),
            "a handshake with a token succeeded against a peer that cannot know it ({role:?})"
        );
    }
    drop(peer);
    drop(link);
});
