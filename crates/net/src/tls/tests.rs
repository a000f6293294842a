//! TLS links over real loopback sockets: both halves at once, large frames, timeouts,
//! a peer with another certificate or without TLS, bad certificate files.

use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use baton_proto::{Message, Role};

use super::TlsConfig;
use crate::{client_handshake, server_handshake, LinkOptions, NetError, Rx, Tx};

/// The framed link over TCP, as these tests were first written against it.
type TcpLink = crate::framed::FramedLink<TcpStream>;

/// A fresh self-signed certificate and key, as `baton cert` makes them (PEM).
fn cluster_cert() -> (String, String) {
    let made = rcgen::generate_simple_self_signed(vec!["baton-cluster".to_string()]).unwrap();
    (made.cert.pem(), made.signing_key.serialize_pem())
}

fn config(cert: &(String, String)) -> Arc<TlsConfig> {
    Arc::new(TlsConfig::pinning(&cert.0, &cert.1, &cert.0))
}

fn with_tls(tls: Option<Arc<TlsConfig>>) -> LinkOptions {
    LinkOptions {
        tls,
        read_timeout: Some(Duration::from_secs(10)),
        ..LinkOptions::default()
    }
}

/// Accepts one connection on a thread with `opts`; returns the address to connect to
/// and the accepted link (or the error that refused it).
fn serve_one(opts: LinkOptions) -> (String, JoinHandle<Result<TcpLink, NetError>>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let thread = std::thread::spawn(move || {
        let (stream, peer) = listener.accept().unwrap();
        TcpLink::accept(stream, peer.to_string(), &opts)
    });
    (addr, thread)
}

fn chunk(index: u32, len: usize) -> Message {
    Message::TensorChunk {
        index,
        offset: 0,
        data: (0..len).map(|i| (i as u32).wrapping_mul(index + 7) as u8).collect(),
    }
}

#[test]
fn split_halves_carry_frames_both_ways_at_once_with_the_token_handshake_inside() {
    let cert = cluster_cert();
    let (addr, server) = serve_one(with_tls(Some(config(&cert))));
    let mut client = TcpLink::connect(&addr, &with_tls(Some(config(&cert)))).unwrap();
    let token = Some(&b"secret"[..]);
    let handshake = std::thread::spawn(move || {
        let mut link = server.join().unwrap().unwrap();
        assert_eq!(server_handshake(&mut link, token).unwrap(), Role::Head);
        link
    });
    assert_eq!(client_handshake(&mut client, Role::Head, token).unwrap(), Role::Worker);
    let server = handshake.join().unwrap();

    // Each side sends 200 frames while it receives the other's 200: the two halves of
    // one TLS connection work from two threads at the same time.
    const N: u32 = 200;
    let exchange = |link: TcpLink| {
        let (mut tx, mut rx) = link.split().unwrap();
        let writer = std::thread::spawn(move || {
            for i in 0..N {
                tx.send(chunk(i, 1 + (i as usize * 97) % 5000)).unwrap();
            }
            tx
        });
        for i in 0..N {
            assert_eq!(rx.recv().unwrap(), chunk(i, 1 + (i as usize * 97) % 5000));
        }
        let tx = writer.join().unwrap();
        (tx.counters().sent(), rx.counters().received())
    };
    let other = std::thread::spawn(move || exchange(server));
    let (sent, received) = exchange(client);
    let (other_sent, other_received) = other.join().unwrap();
    // The counters count frame bytes, the same with TLS as without.
    assert_eq!(sent, other_received);
    assert_eq!(received, other_sent);
}

#[test]
fn large_frames_cross_intact_in_both_directions_at_once() {
    // Both writers send more than the kernel buffers hold while both readers read: a
    // writer that held the TLS lock while blocked on its socket would deadlock here.
    let cert = cluster_cert();
    let (addr, server) = serve_one(with_tls(Some(config(&cert))));
    let client = TcpLink::connect(&addr, &with_tls(Some(config(&cert)))).unwrap();
    let server = server.join().unwrap().unwrap();
    let big = |i| chunk(i, 24 << 20);
    let exchange = move |link: TcpLink| {
        let (mut tx, mut rx) = link.split().unwrap();
        let writer = std::thread::spawn(move || {
            for i in 0..2 {
                tx.send(big(i)).unwrap();
            }
        });
        for i in 0..2 {
            assert!(rx.recv().unwrap() == big(i), "frame {i} arrived damaged");
        }
        writer.join().unwrap();
    };
    let other = std::thread::spawn(move || exchange(server));
    exchange(client);
    other.join().unwrap();
}

#[test]
fn a_read_timeout_is_a_timeout_and_the_link_still_works_after_it() {
    let cert = cluster_cert();
    let (addr, server) = serve_one(with_tls(Some(config(&cert))));
    let opts = LinkOptions {
        read_timeout: Some(Duration::from_millis(100)),
        ..with_tls(Some(config(&cert)))
    };
    let client = TcpLink::connect(&addr, &opts).unwrap();
    let mut server = server.join().unwrap().unwrap();
    let (_tx, mut rx) = client.split().unwrap();
    let err = rx.recv().unwrap_err();
    assert!(matches!(err, NetError::Timeout { .. }), "{err}");
    server.send(&Message::Done).unwrap();
    assert_eq!(rx.recv().unwrap(), Message::Done);

    // Changed later, as the worker does after the handshake.
    server.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
    let err = server.recv().unwrap_err();
    assert!(matches!(err, NetError::Timeout { .. }), "{err}");
}

#[test]
fn shutting_the_socket_down_wakes_a_blocked_reader_with_closed() {
    // The worker keeps a clone of the accepted socket to end a session from another
    // thread; with TLS the reader must not be holding anything that blocks this.
    let cert = cluster_cert();
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let opts = with_tls(Some(config(&cert)));
    let client_opts = opts.clone();
    let client = std::thread::spawn(move || TcpLink::connect(&addr, &client_opts).unwrap());
    let (stream, peer) = listener.accept().unwrap();
    let handle = stream.try_clone().unwrap();
    let server = TcpLink::accept(
        stream,
        peer.to_string(),
        &LinkOptions {
            read_timeout: None,
            ..opts
        },
    )
    .unwrap();
    let _client = client.join().unwrap();
    let (mut tx, mut rx) = server.split().unwrap();
    let reader = std::thread::spawn(move || rx.recv());
    std::thread::sleep(Duration::from_millis(100));
    handle.shutdown(std::net::Shutdown::Both).unwrap();
    let err = reader.join().unwrap().unwrap_err();
    assert!(matches!(err, NetError::Closed { .. }), "{err}");
    assert!(tx.send(Message::Done).is_err());
}

#[test]
fn a_peer_with_another_certificate_is_refused_on_both_sides() {
    let (ours, theirs) = (cluster_cert(), cluster_cert());
    let (addr, server) = serve_one(with_tls(Some(config(&ours))));
    let err = TcpLink::connect(&addr, &with_tls(Some(config(&theirs))))
        .err()
        .expect("refused")
        .to_string();
    assert!(err.contains(&addr) && err.contains("not this cluster's"), "{err}");
    let err = server.join().unwrap().err().expect("refused").to_string();
    assert!(err.contains("refused this node's certificate"), "{err}");
}

#[test]
fn a_client_presenting_another_certificate_is_refused_by_the_server() {
    // This client accepts the server's certificate but presents its own: only the
    // server's check can catch it. In TLS 1.3 the client learns after its handshake.
    let (ours, theirs) = (cluster_cert(), cluster_cert());
    let (addr, server) = serve_one(with_tls(Some(config(&ours))));
    let impostor = Arc::new(TlsConfig::pinning(&theirs.0, &theirs.1, &ours.0));
    let client = TcpLink::connect(&addr, &with_tls(Some(impostor)));
    let err = server.join().unwrap().err().expect("refused").to_string();
    assert!(err.contains("not this cluster's"), "{err}");
    let err = client
        .and_then(|mut link| client_handshake(&mut link, Role::Head, None))
        .expect_err("refused")
        .to_string();
    assert!(err.contains("refused this node's certificate"), "{err}");
}

#[test]
fn a_plain_peer_of_a_tls_node_is_told_why() {
    let cert = cluster_cert();
    let (addr, server) = serve_one(with_tls(Some(config(&cert))));
    let mut client = TcpLink::connect(&addr, &with_tls(None)).unwrap();
    let err = client_handshake(&mut client, Role::Head, None).unwrap_err().to_string();
    assert!(err.contains("refused") && err.contains("requires TLS"), "{err}");
    let err = server.join().unwrap().err().expect("refused").to_string();
    assert!(err.contains("plain TCP"), "{err}");
}

#[test]
fn a_tls_peer_of_a_plain_node_gets_a_clear_error() {
    let cert = cluster_cert();
    let (addr, server) = serve_one(with_tls(None));
    let err = TcpLink::connect(&addr, &with_tls(Some(config(&cert))))
        .err()
        .expect("refused")
        .to_string();
    assert!(err.contains("TLS") && err.contains("without TLS"), "{err}");
    let err = server.join().unwrap().err().expect("refused").to_string();
    assert!(err.contains("started a TLS handshake"), "{err}");
}

#[test]
fn plain_links_are_unchanged() {
    let (addr, server) = serve_one(with_tls(None));
    let mut client = TcpLink::connect(&addr, &with_tls(None)).unwrap();
    // The accepting side looks at the first bytes before it returns.
    client.send(&chunk(3, 100_000)).unwrap();
    let mut server = server.join().unwrap().unwrap();
    assert_eq!(server.recv().unwrap(), chunk(3, 100_000));
    // `new` never sets up TLS, so it refuses options that ask for it.
    let stream = TcpStream::connect(&addr);
    if let Ok(stream) = stream {
        let err = TcpLink::new(stream, "x".into(), &with_tls(Some(config(&cluster_cert()))))
            .err()
            .expect("refused");
        assert!(matches!(err, NetError::Tls { .. }), "{err}");
    }
}

#[test]
fn bad_certificate_files_are_errors_that_name_the_file() {
    let dir = std::env::temp_dir().join(format!("baton-tls-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (cert, key) = cluster_cert();
    let (_, other_key) = cluster_cert();
    let write = |name: &str, text: &str| {
        let path = dir.join(name);
        std::fs::write(&path, text).unwrap();
        path
    };
    let cert_path = write("cluster.crt", &cert);
    let key_path = write("cluster.key", &key);
    let other_key_path = write("other.key", &other_key);
    let garbage = write("garbage.pem", "not a certificate\n");
    let load = |c: &Path, k: &Path| TlsConfig::from_pem_files(c, k).err().map(|e| e.to_string());

    assert_eq!(load(&cert_path, &key_path), None);
    let err = load(&dir.join("missing.crt"), &key_path).unwrap();
    assert!(err.contains("cannot read") && err.contains("missing.crt"), "{err}");
    let err = load(&garbage, &key_path).unwrap();
    assert!(
        err.contains("garbage.pem") && err.contains("no PEM certificate"),
        "{err}"
    );
    let err = load(&cert_path, &garbage).unwrap();
    assert!(
        err.contains("garbage.pem") && err.contains("no PEM private key"),
        "{err}"
    );
    // A certificate where the key should be.
    let err = load(&cert_path, &cert_path).unwrap();
    assert!(err.contains("no PEM private key"), "{err}");
    let err = load(&cert_path, &other_key_path).unwrap();
    assert!(
        err.contains("does not belong") && err.contains("other.key") && err.contains("cluster.crt"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
