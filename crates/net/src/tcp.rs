//! TCP links: one frame per message, written with one vectored write (header and
//! payload together), `TCP_NODELAY` so a hidden state leaves at once, bounded reads.
//! With [`LinkOptions::tls`] the same frames travel inside TLS (see `tls.rs`).

use std::io::{IoSlice, Read, Write};
use std::net::{Shutdown, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use baton_proto::{decode, encode_payload, header, parse_header, Message, DEFAULT_MAX_FRAME, HEADER_LEN};

use crate::tls::{close_gently, looks_like_tls, TlsConfig, TlsSession};
use crate::{NetError, Rx, Tx};

/// Settings of a TCP link.
#[derive(Clone, Debug)]
pub struct LinkOptions {
    /// Largest frame accepted from the peer; larger length fields drop the link.
    pub max_frame: usize,
    /// Kernel send buffer size (`SO_SNDBUF`), if set.
    pub send_buffer: Option<usize>,
    /// Kernel receive buffer size (`SO_RCVBUF`), if set.
    pub recv_buffer: Option<usize>,
    /// How long a read may wait (`None`: forever).
    pub read_timeout: Option<Duration>,
    /// TLS with the cluster certificate on every link (`None`: plain TCP). A node with
    /// TLS refuses peers without it, and the other way round.
    pub tls: Option<Arc<TlsConfig>>,
}

impl Default for LinkOptions {
    fn default() -> Self {
        LinkOptions {
            max_frame: DEFAULT_MAX_FRAME,
            send_buffer: None,
            recv_buffer: None,
            read_timeout: None,
            tls: None,
        }
    }
}

/// Bytes that crossed a link, both ways, including frame headers (frame bytes: with
/// TLS, the records' own overhead is not counted).
#[derive(Debug, Default)]
pub struct Counters {
    sent: AtomicU64,
    received: AtomicU64,
}

impl Counters {
    /// Bytes written to the peer.
    pub fn sent(&self) -> u64 {
        self.sent.load(Ordering::Relaxed)
    }

    /// Bytes read from the peer.
    pub fn received(&self) -> u64 {
        self.received.load(Ordering::Relaxed)
    }
}

/// A connected, framed TCP link.
pub struct TcpLink {
    stream: TcpStream,
    /// The TLS connection, when the link has one.
    tls: Option<TlsSession>,
    peer: String,
    max_frame: usize,
    counters: Arc<Counters>,
    buf: Vec<u8>,
}

/// Why a connection could not be made, in words (the OS error once, at the end).
fn connect_failure(e: &std::io::Error) -> String {
    use std::io::ErrorKind;
    let what = match e.kind() {
        ErrorKind::ConnectionRefused => "nothing listens on that port",
        ErrorKind::TimedOut | ErrorKind::WouldBlock => "no answer within 10 s",
        ErrorKind::HostUnreachable | ErrorKind::NetworkUnreachable => "no route to the host",
        ErrorKind::AddrNotAvailable => "the address is not available",
        _ => "the connection failed",
    };
    format!("{what} ({e})")
}

impl TcpLink {
    /// Connects to `addr` (and runs the client side of the TLS handshake, with TLS).
    pub fn connect(addr: &str, opts: &LinkOptions) -> Result<TcpLink, NetError> {
        let unreachable = |reason: String| NetError::Unreachable {
            peer: addr.to_string(),
            reason,
        };
        let addrs: Vec<_> = addr
            .to_socket_addrs()
            .map_err(|e| unreachable(format!("cannot resolve the address ({e})")))?
            .collect();
        let mut last = None;
        for a in addrs {
            match TcpStream::connect_timeout(&a, Duration::from_secs(10)) {
                Ok(stream) => {
                    let mut link = TcpLink::plain(stream, addr.to_string(), opts)?;
                    if let Some(tls) = &opts.tls {
                        let session = TlsSession::client(&mut link.stream, tls, addr, opts.read_timeout)?;
                        link.tls = Some(session);
                    }
                    return Ok(link);
                }
                Err(e) => last = Some(e),
            }
        }
        Err(unreachable(match last {
            None => "the address resolved to nothing".to_string(),
            Some(e) => connect_failure(&e),
        }))
    }

    /// Wraps an accepted stream; with TLS, runs the server side of the handshake. A
    /// peer that does not speak what this end speaks (TLS or not) is refused with an
    /// error saying so; a plain peer of a TLS node is told why in a `Refused` frame.
    pub fn accept(stream: TcpStream, peer: String, opts: &LinkOptions) -> Result<TcpLink, NetError> {
        let mut link = TcpLink::plain(stream, peer, opts)?;
        let mut head = [0u8; 3];
        let n = link.stream.peek(&mut head).map_err(|e| read_error(&link.peer, e))?;
        if n == 0 {
            return Err(NetError::Closed { peer: link.peer });
        }
        match (&opts.tls, looks_like_tls(&head[..n])) {
            (None, false) => Ok(link),
            (Some(tls), true) => match TlsSession::server(&mut link.stream, tls, &link.peer, opts.read_timeout) {
                Ok(session) => {
                    link.tls = Some(session);
                    Ok(link)
                }
                Err(e) => {
                    close_gently(&mut link.stream);
                    Err(e)
                }
            },
            (Some(_), false) => {
                let _ = link.send(&Message::Refused {
                    reason: "this worker requires TLS: give the connecting node the cluster certificate \
                             (--tls-cert and --tls-key)"
                        .into(),
                });
                close_gently(&mut link.stream);
                Err(NetError::Tls {
                    peer: link.peer,
                    reason: "the peer speaks plain TCP, but this node requires TLS (--tls-cert)".into(),
                })
            }
            (None, true) => {
                close_gently(&mut link.stream);
                Err(NetError::Tls {
                    peer: link.peer,
                    reason: "the peer started a TLS handshake, but this node runs without TLS (no --tls-cert)".into(),
                })
            }
        }
    }

    /// Wraps a connected stream as a plain link, running no handshake of any kind (fuzz
    /// targets and tests drive one over it). With `opts.tls` set this is an error: a
    /// link that should be encrypted must come from `connect` or `accept`.
    pub fn new(stream: TcpStream, peer: String, opts: &LinkOptions) -> Result<TcpLink, NetError> {
        if opts.tls.is_some() {
            return Err(NetError::Tls {
                peer,
                reason: "TcpLink::new makes plain links only; use connect or accept for TLS".into(),
            });
        }
        TcpLink::plain(stream, peer, opts)
    }

    /// Sets the socket options; no TLS yet.
    fn plain(stream: TcpStream, peer: String, opts: &LinkOptions) -> Result<TcpLink, NetError> {
        let io = |source| NetError::Io {
            peer: peer.clone(),
            source,
        };
        stream.set_nodelay(true).map_err(io)?;
        stream.set_read_timeout(opts.read_timeout).map_err(io)?;
        let sock = socket2::SockRef::from(&stream);
        if let Some(size) = opts.send_buffer {
            sock.set_send_buffer_size(size).map_err(io)?;
        }
        if let Some(size) = opts.recv_buffer {
            sock.set_recv_buffer_size(size).map_err(io)?;
        }
        Ok(TcpLink {
            stream,
            tls: None,
            peer,
            max_frame: opts.max_frame,
            counters: Arc::default(),
            buf: Vec::new(),
        })
    }

    /// The peer's address as given or accepted.
    pub fn peer(&self) -> &str {
        &self.peer
    }

    /// This link's byte counters (shared with its halves after `split`).
    pub fn counters(&self) -> Arc<Counters> {
        self.counters.clone()
    }

    /// Changes the largest frame accepted from the peer (e.g. small until the peer has
    /// authenticated, so a stranger cannot make this node allocate much).
    pub fn set_max_frame(&mut self, max_frame: usize) {
        self.max_frame = max_frame;
    }

    /// Changes how long a read may wait.
    pub fn set_read_timeout(&self, timeout: Option<Duration>) -> Result<(), NetError> {
        self.stream.set_read_timeout(timeout).map_err(|source| NetError::Io {
            peer: self.peer.clone(),
            source,
        })
    }

    /// Sends one message as one frame.
    pub fn send(&mut self, msg: &Message) -> Result<(), NetError> {
        self.buf.clear();
        let kind = encode_payload(msg, &mut self.buf);
        let head = header(kind, self.buf.len());
        let mut slices = [IoSlice::new(&head), IoSlice::new(&self.buf)];
        let total = HEADER_LEN + self.buf.len();
        if let Some(tls) = &mut self.tls {
            tls.send(&mut self.stream, &slices, &self.peer)?;
            self.counters.sent.fetch_add(total as u64, Ordering::Relaxed);
            return Ok(());
        }
        let mut slices: &mut [IoSlice] = &mut slices;
        while !slices.is_empty() {
            let n = self.stream.write_vectored(slices).map_err(|source| NetError::Io {
                peer: self.peer.clone(),
                source,
            })?;
            if n == 0 {
                return Err(NetError::Closed {
                    peer: self.peer.clone(),
                });
            }
            IoSlice::advance_slices(&mut slices, n);
        }
        self.counters.sent.fetch_add(total as u64, Ordering::Relaxed);
        Ok(())
    }

    /// Receives one message. Any malformed frame is an error; the caller drops the link.
    pub fn recv(&mut self) -> Result<Message, NetError> {
        let mut head = [0u8; HEADER_LEN];
        self.read_exact(&mut head)?;
        let (kind, len) = parse_header(&head, self.max_frame).map_err(|e| self.proto(e))?;
        self.buf.clear();
        self.buf.resize(len, 0);
        let mut payload = std::mem::take(&mut self.buf);
        let read = self.read_exact(&mut payload);
        let msg = read.and_then(|()| decode(kind, &payload).map_err(|e| self.proto(e)));
        self.buf = payload;
        self.counters
            .received
            .fetch_add((HEADER_LEN + len) as u64, Ordering::Relaxed);
        msg
    }

    fn proto(&self, error: baton_proto::ProtoError) -> NetError {
        NetError::Protocol {
            peer: self.peer.clone(),
            error,
        }
    }

    fn read_exact(&mut self, buf: &mut [u8]) -> Result<(), NetError> {
        match &mut self.tls {
            Some(tls) => tls.read_exact(&mut self.stream, buf, &self.peer),
            None => self.stream.read_exact(buf).map_err(|e| read_error(&self.peer, e)),
        }
    }

    /// Two halves over the same connection, for a reader and a writer thread.
    pub fn split(self) -> Result<(TcpTx, TcpRx), NetError> {
        let clone = self.stream.try_clone().map_err(|source| NetError::Io {
            peer: self.peer.clone(),
            source,
        })?;
        let tx = TcpLink {
            stream: clone,
            tls: self.tls.as_ref().map(TlsSession::half),
            peer: self.peer.clone(),
            max_frame: self.max_frame,
            counters: self.counters.clone(),
            buf: Vec::new(),
        };
        Ok((TcpTx(tx), TcpRx(self)))
    }

    /// Closes both directions (without TLS's close_notify: the peer sees the link end
    /// as it would without TLS). A reader blocked on the link wakes up with `Closed`.
    pub fn close(&self) {
        let _ = self.stream.shutdown(Shutdown::Both);
    }

    /// A handle that closes this link from another thread, like [`close`](Self::close),
    /// while the link itself is in use (a reader blocked on it wakes up with `Closed`).
    pub fn closer(&self) -> Result<LinkCloser, NetError> {
        self.stream.try_clone().map(LinkCloser).map_err(|source| NetError::Io {
            peer: self.peer.clone(),
            source,
        })
    }
}

/// Closes a link from another thread (see [`TcpLink::closer`]).
#[derive(Debug)]
pub struct LinkCloser(TcpStream);

impl LinkCloser {
    /// Shuts both directions of the link's socket down.
    pub fn close(&self) {
        let _ = self.0.shutdown(Shutdown::Both);
    }
}

/// The sending half of a TCP link.
pub struct TcpTx(TcpLink);

/// The receiving half of a TCP link.
pub struct TcpRx(TcpLink);

impl TcpTx {
    /// Byte counters of the link.
    pub fn counters(&self) -> Arc<Counters> {
        self.0.counters()
    }
}

impl TcpRx {
    /// Byte counters of the link.
    pub fn counters(&self) -> Arc<Counters> {
        self.0.counters()
    }
}

impl Tx for TcpTx {
    fn send(&mut self, msg: Message) -> Result<(), NetError> {
        self.0.send(&msg)
    }
}

impl Rx for TcpRx {
    fn recv(&mut self) -> Result<Message, NetError> {
        self.0.recv()
    }
}

/// A failed socket read, as the link reports it.
pub(crate) fn read_error(peer: &str, source: std::io::Error) -> NetError {
    match source.kind() {
        std::io::ErrorKind::UnexpectedEof => NetError::Closed { peer: peer.to_string() },
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => NetError::Timeout { peer: peer.to_string() },
        _ => NetError::Io {
            peer: peer.to_string(),
            source,
        },
    }
}
