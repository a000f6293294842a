//! Tagged frames and handshake deadlines over real loopback sockets: a relay that
//! changes, adds or replays a byte after the handshake is caught; a peer that drips
//! bytes cannot stretch a read (or a TLS handshake) past its deadline.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use baton_proto::{Message, Role};

use crate::{client_handshake, connect, server_handshake, LinkOptions, Listener, NetError, TlsConfig};

const TOKEN: &[u8] = b"framed-test-secret";

/// Relays one connection from a listener to `target` byte for byte, and lets the test
/// change the client-to-server stream: `edit` sees every chunk with the count of bytes
/// relayed before it, and may rewrite it.
type Edit = Box<dyn FnMut(u64, &mut Vec<u8>) + Send>;

fn relay(target: String, mut edit: Edit) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    std::thread::spawn(move || {
        let (client, _) = listener.accept().unwrap();
        let server = TcpStream::connect(target).unwrap();
        let (mut from_server, mut to_client) = (server.try_clone().unwrap(), client.try_clone().unwrap());
        std::thread::spawn(move || {
            let _ = std::io::copy(&mut from_server, &mut to_client);
            let _ = to_client.shutdown(Shutdown::Both);
        });
        let (mut from_client, mut to_server) = (client, server);
        let mut seen = 0u64;
        let mut buf = vec![0u8; 1 << 16];
        while let Ok(n) = from_client.read(&mut buf) {
            if n == 0 {
                break;
            }
            let mut chunk = buf[..n].to_vec();
            edit(seen, &mut chunk);
            seen += n as u64;
            if to_server.write_all(&chunk).is_err() {
                break;
            }
        }
        let _ = to_server.shutdown(Shutdown::Both);
    });
    addr
}

/// A worker-side listener that runs the server handshake with `token` and then returns
/// whatever its first `recv` gives.
fn serve_one(token: Option<&'static [u8]>) -> (String, std::thread::JoinHandle<Result<Message, NetError>>) {
    let listener = Listener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().to_string();
    let thread = std::thread::spawn(move || {
        let mut link = listener.accept_link(&LinkOptions::default())?;
        server_handshake(link.as_mut(), token)?;
        link.recv()
    });
    (addr, thread)
}

/// Bytes the client sends before its first frame after the handshake: its `Hello`
/// (8 + 37) and its `Auth` (8 + 32).
const HANDSHAKE_BYTES: u64 = 45 + 40;

#[test]
fn a_relay_that_changes_a_byte_after_the_handshake_is_caught() {
    let (worker, served) = serve_one(Some(TOKEN));
    // Flip the last payload byte of the first frame after the handshake: an EndSeq's
    // sequence number (8-byte header, 4-byte payload).
    let addr = relay(
        worker,
        Box::new(|seen, chunk| {
            let target = HANDSHAKE_BYTES + 8 + 3;
            if (seen..seen + chunk.len() as u64).contains(&target) {
                chunk[(target - seen) as usize] ^= 1;
            }
        }),
    );
    let mut link = connect(&addr, &LinkOptions::default()).unwrap();
    client_handshake(link.as_mut(), Role::Head, Some(TOKEN)).unwrap();
    link.send(Message::EndSeq { seq: 4 }).unwrap();
    let got = served.join().unwrap();
    assert!(matches!(got, Err(NetError::Tampered { frame: 0, .. })), "{got:?}");
    assert!(got.unwrap_err().to_string().contains("failed authentication"));
}

#[test]
fn a_frame_injected_or_replayed_after_the_handshake_is_caught() {
    // Injected: the relay writes a whole frame of its own (`Shutdown`) before the
    // client's first one.
    let (worker, served) = serve_one(Some(TOKEN));
    let mut injected = Vec::new();
    baton_proto::encode(&Message::Shutdown, &mut injected);
    let addr = relay(
        worker,
        Box::new(move |seen, chunk| {
            if seen + chunk.len() as u64 > HANDSHAKE_BYTES && seen <= HANDSHAKE_BYTES {
                let at = (HANDSHAKE_BYTES - seen) as usize;
                chunk.splice(at..at, injected.iter().copied());
            }
        }),
    );
    let mut link = connect(&addr, &LinkOptions::default()).unwrap();
    client_handshake(link.as_mut(), Role::Head, Some(TOKEN)).unwrap();
    link.send(Message::Done).unwrap();
    let got = served.join().unwrap();
    assert!(matches!(got, Err(NetError::Tampered { .. })), "{got:?}");

    // Replayed: the client's first tagged frame, sent twice, fails the second time
    // (its sequence number has moved on).
    let listener = Listener::bind("127.0.0.1:0").unwrap();
    let worker = listener.local_addr().to_string();
    let served = std::thread::spawn(move || {
        let mut link = listener.accept_link(&LinkOptions::default()).unwrap();
        server_handshake(link.as_mut(), Some(TOKEN)).unwrap();
        (link.recv(), link.recv())
    });
    let first: Arc<Mutex<Vec<u8>>> = Arc::default();
    let copy = first.clone();
    let addr = relay(
        worker,
        Box::new(move |seen, chunk| {
            // The first tagged frame: a Done (8-byte header, 16-byte tag).
            let frame = HANDSHAKE_BYTES..HANDSHAKE_BYTES + 24;
            let mut kept = copy.lock().unwrap();
            for (i, byte) in chunk.clone().iter().enumerate() {
                if frame.contains(&(seen + i as u64)) {
                    kept.push(*byte);
                }
            }
            if kept.len() == 24 && seen + chunk.len() as u64 >= frame.end {
                chunk.extend_from_slice(&kept.clone());
                kept.push(0); // once
            }
        }),
    );
    let mut link = connect(&addr, &LinkOptions::default()).unwrap();
    client_handshake(link.as_mut(), Role::Head, Some(TOKEN)).unwrap();
    link.send(Message::Done).unwrap();
    let (once, twice) = served.join().unwrap();
    assert_eq!(once.unwrap(), Message::Done);
    assert!(matches!(twice, Err(NetError::Tampered { frame: 1, .. })), "{twice:?}");
    assert_eq!(first.lock().unwrap().len(), 25);
}

#[test]
fn tags_cost_sixteen_bytes_a_frame_and_only_with_a_token() {
    for (token, tag) in [(Some(TOKEN), 16u64), (None, 0)] {
        let listener = Listener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().to_string();
        let served = std::thread::spawn(move || {
            let mut link = listener.accept_link(&LinkOptions::default()).unwrap();
            server_handshake(link.as_mut(), token).unwrap();
            let before = link.counters().received();
            let msg = link.recv().unwrap();
            (msg, link.counters().received() - before)
        });
        let mut link = connect(&addr, &LinkOptions::default()).unwrap();
        client_handshake(link.as_mut(), Role::Ring, token).unwrap();
        let before = link.counters().sent();
        link.send(Message::EndSeq { seq: 9 }).unwrap();
        let sent = link.counters().sent() - before;
        let (msg, received) = served.join().unwrap();
        assert_eq!(msg, Message::EndSeq { seq: 9 });
        assert_eq!((sent, received), (8 + 4 + tag, 8 + 4 + tag), "token {token:?}");
    }
}

/// A peer that sends `bytes` one at a time, `every` apart, then waits.
fn drip(addr: &str, bytes: Vec<u8>, every: Duration) -> std::thread::JoinHandle<()> {
    let mut stream = TcpStream::connect(addr).unwrap();
    std::thread::spawn(move || {
        for byte in bytes {
            if stream.write_all(&[byte]).is_err() {
                return;
            }
            std::thread::sleep(every);
        }
    })
}

#[test]
fn a_dripping_peer_cannot_stretch_a_read_past_the_deadline() {
    let listener = Listener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().to_string();
    // A Hello, one byte every 100 ms: each read gets a byte long before the read
    // timeout (1 s), so only a deadline ends it.
    let mut hello = Vec::new();
    baton_proto::encode(
        &Message::Hello {
            version: baton_proto::PROTOCOL_VERSION,
            role: Role::Head,
            nonce: [1; 32],
        },
        &mut hello,
    );
    let _peer = drip(&addr, hello, Duration::from_millis(100));
    let opts = LinkOptions {
        read_timeout: Some(Duration::from_secs(1)),
        ..LinkOptions::default()
    };
    let started = Instant::now();
    let mut link = listener
        .accept()
        .unwrap()
        .into_link_by(&opts, started + Duration::from_millis(700))
        .unwrap();
    let got = server_handshake(link.as_mut(), Some(TOKEN));
    let took = started.elapsed();
    assert!(matches!(got, Err(NetError::Timeout { .. })), "{got:?}");
    assert!(took < Duration::from_millis(1000), "{took:?}");
}

#[test]
fn a_dripping_peer_cannot_stretch_a_tls_handshake_past_the_deadline() {
    let made = rcgen::generate_simple_self_signed(vec!["baton-cluster".to_string()]).unwrap();
    let (cert, key) = (made.cert.pem(), made.signing_key.serialize_pem());
    let tls = Arc::new(TlsConfig::pinning(&cert, &key, &cert));
    let listener = Listener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().to_string();
    // A TLS handshake record announcing 512 bytes, sent a byte every 100 ms: rustls
    // keeps reading, and before deadlines bounded each read, so did the worker.
    let mut record = vec![0x16, 0x03, 0x01, 0x02, 0x00, 0x01, 0x00, 0x01, 0xfc, 0x03, 0x03];
    record.extend(std::iter::repeat_n(0x42, 100));
    let _peer = drip(&addr, record, Duration::from_millis(100));
    let opts = LinkOptions {
        read_timeout: Some(Duration::from_secs(1)),
        tls: Some(tls),
        ..LinkOptions::default()
    };
    let started = Instant::now();
    let got = listener
        .accept()
        .unwrap()
        .into_link_by(&opts, started + Duration::from_millis(700));
    let took = started.elapsed();
    assert!(matches!(got, Err(NetError::Timeout { .. })), "{:?}", got.err());
    assert!(took < Duration::from_millis(1000), "{took:?}");
}

#[test]
fn clearing_the_deadline_restores_the_read_timeout() {
    let listener = Listener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().to_string();
    let client = std::thread::spawn(move || {
        let mut link = connect(&addr, &LinkOptions::default()).unwrap();
        client_handshake(link.as_mut(), Role::Head, Some(TOKEN)).unwrap();
        std::thread::sleep(Duration::from_millis(600));
        link.send(Message::Pong).unwrap();
        link
    });
    let opts = LinkOptions {
        read_timeout: Some(Duration::from_secs(5)),
        ..LinkOptions::default()
    };
    let deadline = Instant::now() + Duration::from_millis(300);
    let mut link = listener.accept().unwrap().into_link_by(&opts, deadline).unwrap();
    server_handshake(link.as_mut(), Some(TOKEN)).unwrap();
    link.set_deadline(None).unwrap();
    // The Pong comes after the old deadline, well within the read timeout.
    assert_eq!(link.recv().unwrap(), Message::Pong);
    let _client = client.join().unwrap();
}
