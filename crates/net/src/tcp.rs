//! TCP links: one frame per message, written with one vectored write (header and
//! payload together), `TCP_NODELAY` so a hidden state leaves at once, bounded reads.

use std::io::{IoSlice, Read, Write};
use std::net::{Shutdown, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use baton_proto::{decode, encode_payload, header, parse_header, Message, DEFAULT_MAX_FRAME, HEADER_LEN};

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
}

impl Default for LinkOptions {
    fn default() -> Self {
        LinkOptions {
            max_frame: DEFAULT_MAX_FRAME,
            send_buffer: None,
            recv_buffer: None,
            read_timeout: None,
        }
    }
}

/// Bytes that crossed a link, both ways, including frame headers.
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
    peer: String,
    max_frame: usize,
    counters: Arc<Counters>,
    buf: Vec<u8>,
}

impl TcpLink {
    /// Connects to `addr`.
    pub fn connect(addr: &str, opts: &LinkOptions) -> Result<TcpLink, NetError> {
        let io = |source| NetError::Io {
            peer: addr.to_string(),
            source,
        };
        let addrs: Vec<_> = addr.to_socket_addrs().map_err(io)?.collect();
        let mut last = None;
        for a in addrs {
            match TcpStream::connect_timeout(&a, Duration::from_secs(10)) {
                Ok(stream) => return TcpLink::new(stream, addr.to_string(), opts),
                Err(e) => last = Some(e),
            }
        }
        Err(io(last.unwrap_or_else(|| {
            std::io::Error::other("address resolved to nothing")
        })))
    }

    /// Wraps an accepted stream.
    pub fn new(stream: TcpStream, peer: String, opts: &LinkOptions) -> Result<TcpLink, NetError> {
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
        let mut slices: &mut [IoSlice] = &mut slices;
        let total = HEADER_LEN + self.buf.len();
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
        self.stream.read_exact(buf).map_err(|source| match source.kind() {
            std::io::ErrorKind::UnexpectedEof => NetError::Closed {
                peer: self.peer.clone(),
            },
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => NetError::Timeout {
                peer: self.peer.clone(),
            },
            _ => NetError::Io {
                peer: self.peer.clone(),
                source,
            },
        })
    }

    /// Two halves over the same connection, for a reader and a writer thread.
    pub fn split(self) -> Result<(TcpTx, TcpRx), NetError> {
        let clone = self.stream.try_clone().map_err(|source| NetError::Io {
            peer: self.peer.clone(),
            source,
        })?;
        let tx = TcpLink {
            stream: clone,
            peer: self.peer.clone(),
            max_frame: self.max_frame,
            counters: self.counters.clone(),
            buf: Vec::new(),
        };
        Ok((TcpTx(tx), TcpRx(self)))
    }

    /// Closes both directions.
    pub fn close(&self) {
        let _ = self.stream.shutdown(Shutdown::Both);
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
