//! Unix-domain socket links through the public interface: frames both ways, TLS and the
//! token handshake inside it, and socket files left behind by workers that died.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use baton_proto::{Message, RefusalCode, Role};

use crate::{client_handshake, connect, server_handshake, LinkOptions, Listener, NetError, TlsConfig};

/// A fresh private directory for socket files; removed by the caller's `Drop` guard.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> TempDir {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos();
        let dir = std::env::temp_dir().join(format!("baton-net-{tag}-{}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }

    fn addr(&self, name: &str) -> String {
        format!("unix:{}", self.0.join(name).display())
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn tls_options() -> LinkOptions {
    let made = rcgen::generate_simple_self_signed(vec!["baton-cluster".to_string()]).unwrap();
    let (cert, key) = (made.cert.pem(), made.signing_key.serialize_pem());
    LinkOptions {
        tls: Some(Arc::new(TlsConfig::pinning(&cert, &key, &cert))),
        read_timeout: Some(Duration::from_secs(10)),
        ..LinkOptions::default()
    }
}

/// Connects to a fresh listener at `addr` with `opts` on both ends, runs the token
/// handshake, and sends frames both ways over split halves.
fn round_trip(addr: &str, opts: LinkOptions) {
    let listener = Listener::bind(addr).unwrap();
    assert_eq!(listener.local_addr(), addr);
    let server_opts = opts.clone();
    let server = std::thread::spawn(move || {
        let incoming = listener.accept().unwrap();
        assert_eq!(incoming.local_addr(), listener.local_addr());
        let mut link = incoming.into_link(&server_opts).unwrap();
        assert_eq!(server_handshake(link.as_mut(), Some(b"k")).unwrap(), Role::Ring);
        let (mut tx, mut rx) = link.split().unwrap();
        while let Ok(msg) = rx.recv() {
            tx.send(msg).unwrap();
        }
    });
    let mut link = connect(addr, &opts).unwrap();
    assert_eq!(
        client_handshake(link.as_mut(), Role::Ring, Some(b"k")).unwrap(),
        Role::Worker
    );
    let (sent_before, received_before) = (link.counters().sent(), link.counters().received());
    let closer = link.closer().unwrap();
    let (mut tx, mut rx) = link.split().unwrap();
    for i in 0..100u32 {
        let msg = Message::TensorChunk {
            index: i,
            offset: 0,
            data: vec![i as u8; (i as usize * 1021) % 70_000],
        };
        tx.send(msg.clone()).unwrap();
        assert_eq!(rx.recv().unwrap(), msg);
    }
    let sent = tx.counters().sent() - sent_before;
    let received = rx.counters().received() - received_before;
    closer.close();
    server.join().unwrap();
    assert!(sent > 2_500_000, "{sent}");
    assert_eq!(received, sent, "the echo comes back frame for frame");
}

#[test]
fn frames_cross_a_unix_socket_both_ways_plain_and_inside_tls() {
    let dir = TempDir::new("frames");
    round_trip(&dir.addr("plain.sock"), LinkOptions::default());
    round_trip(&dir.addr("tls.sock"), tls_options());
}

#[test]
fn a_plain_peer_of_a_tls_node_on_a_unix_socket_is_told_why() {
    let dir = TempDir::new("tls-refused");
    let addr = dir.addr("w.sock");
    let listener = Listener::bind(&addr).unwrap();
    let server = std::thread::spawn(move || listener.accept_link(&tls_options()).map(drop));
    let mut link = connect(&addr, &LinkOptions::default()).unwrap();
    let err = client_handshake(link.as_mut(), Role::Head, None).unwrap_err();
    assert_eq!(err.refusal(), Some(RefusalCode::TlsRequired), "{err}");
    let err = server.join().unwrap().unwrap_err();
    assert!(matches!(err, NetError::Tls { .. }), "{err}");
}

#[test]
fn a_stale_socket_file_is_taken_over_but_a_live_one_is_not() {
    let dir = TempDir::new("stale");
    let addr = dir.addr("w.sock");
    let path = dir.0.join("w.sock");

    // A worker killed without cleaning up leaves its socket file: bind it with std and
    // drop the listener (the file stays, and nothing accepts on it).
    drop(std::os::unix::net::UnixListener::bind(&path).unwrap());
    assert!(path.exists());
    let err = connect(&addr, &LinkOptions::default()).err().expect("nothing listens");
    assert!(err.to_string().contains("nothing listens on that socket"), "{err}");
    let first = Listener::bind(&addr).expect("a stale socket file is taken over");

    // While it listens, a second worker on the same path is refused, and the first
    // keeps its socket.
    let err = Listener::bind(&addr).err().expect("a live socket is not stolen");
    assert!(
        matches!(&err, NetError::Bind { addr: a, source } if a == &addr && source.kind() == std::io::ErrorKind::AddrInUse),
        "{err}"
    );
    assert!(err.to_string().contains("another process listens"), "{err}");
    let accepting = std::thread::spawn(move || {
        let incoming = first.accept().unwrap();
        drop(incoming);
        first
    });
    drop(connect(&addr, &LinkOptions::default()).expect("the first listener still answers"));
    let first = accepting.join().unwrap();

    // Its file goes with it.
    drop(first);
    assert!(!path.exists());

    // Anything that is not a socket is never removed.
    std::fs::write(&path, "not a socket").unwrap();
    let err = Listener::bind(&addr).err().expect("not a socket");
    assert!(err.to_string().contains("is not a socket"), "{err}");
    assert_eq!(std::fs::read_to_string(&path).unwrap(), "not a socket");
}

#[test]
fn a_missing_socket_is_unreachable_with_its_address() {
    let dir = TempDir::new("missing");
    let addr = dir.addr("nobody.sock");
    let err = connect(&addr, &LinkOptions::default()).err().expect("unreachable");
    assert!(
        matches!(&err, NetError::Unreachable { peer, .. } if peer == &addr),
        "{err}"
    );
    assert!(err.to_string().contains("no socket at that path"), "{err}");
    // A relative path is made absolute, so that nodes in other directories reach it.
    let listener = Listener::bind("unix:relative-test.sock");
    let listener = listener.unwrap();
    assert!(listener.local_addr().starts_with("unix:/"), "{}", listener.local_addr());
}
