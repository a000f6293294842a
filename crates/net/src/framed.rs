//! Framed links over a byte stream (TCP, a Unix-domain socket): one frame per message,
//! written with one vectored write (header and payload together), bounded reads. With
//! [`LinkOptions::tls`] the same frames travel inside TLS (see `tls.rs`). The stream kind
//! only decides how the socket is set up (`Stream`); framing, TLS, halves and closing
//! are the same for every kind.
//!
//! After a handshake with a token ([`Link::authenticate_frames`]) every frame's payload
//! is sealed in place and its tag written after it, in the same vectored write; a frame
//! whose tag does not check out is not decoded and ends the link. While a deadline is set
//! ([`Link::set_deadline`]), every read waits at most until then, however the peer
//! spaces its bytes: a handshake cannot be stretched by a byte every few seconds.

use std::io::{self, IoSlice, Read, Write};
use std::net::Shutdown;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use baton_proto::auth::{FrameKeys, FrameSeal, TAG_LEN};
use baton_proto::{decode, encode_payload, header, parse_header, Message, RefusalCode, DEFAULT_MAX_FRAME, HEADER_LEN};

use crate::tls::{looks_like_tls, TlsConfig, TlsSession};
use crate::{Halves, Link, NetError, Rx, Tx};

/// Settings of a link.
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
    /// TLS with the cluster certificate on every link (`None`: plain). A node with TLS
    /// refuses peers without it, and the other way round.
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

/// What a link measured: the bytes that crossed it, both ways, including frame headers
/// and tags (frame bytes: with TLS, the records' own overhead is not counted;
/// in-process links count nothing), and the latest round trip to its peer.
#[derive(Debug, Default)]
pub struct Counters {
    sent: AtomicU64,
    received: AtomicU64,
    /// Microseconds, at least 1 once measured (0: never).
    round_trip_us: AtomicU64,
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

    /// The latest round trip measured to the peer, if any was: the first exchange of
    /// the handshake on a link this end dialed ([`client_handshake`](crate::client_handshake)),
    /// then whatever keeps it current (a heartbeat or a probe on the same path).
    pub fn round_trip(&self) -> Option<Duration> {
        match self.round_trip_us.load(Ordering::Relaxed) {
            0 => None,
            us => Some(Duration::from_micros(us)),
        }
    }

    /// [`round_trip`](Self::round_trip) in microseconds, 0 when none was measured (as
    /// `Stats` carries it).
    pub fn round_trip_us(&self) -> u64 {
        self.round_trip_us.load(Ordering::Relaxed)
    }

    /// Records a round trip to the peer (what [`round_trip`](Self::round_trip) says next).
    pub fn record_round_trip(&self, round_trip: Duration) {
        let us = u64::try_from(round_trip.as_micros()).unwrap_or(u64::MAX).max(1);
        self.round_trip_us.store(us, Ordering::Relaxed);
    }
}

/// Closes a link from another thread while the link itself is in use: a reader blocked
/// on it wakes up with `Closed`, and later sends fail.
pub struct LinkCloser(Box<dyn Fn() + Send + Sync>);

impl LinkCloser {
    /// A closer that runs `close`.
    pub(crate) fn new(close: impl Fn() + Send + Sync + 'static) -> LinkCloser {
        LinkCloser(Box::new(close))
    }

    /// Closes the link (both directions; without TLS's close_notify, so the peer sees the
    /// link end as it would without TLS). Closing twice does nothing more.
    pub fn close(&self) {
        (self.0)();
    }
}

impl std::fmt::Debug for LinkCloser {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("LinkCloser")
    }
}

/// A connected byte stream a link can run on: what differs between TCP and Unix-domain
/// sockets. A new stream transport implements this and nothing else of the framing.
pub(crate) trait Stream: Read + Write + Send + Sync + Sized + 'static {
    /// A second handle to the same connection (for the other half of a split link).
    fn try_clone(&self) -> io::Result<Self>;
    /// Shuts one or both directions down.
    fn shutdown(&self, how: Shutdown) -> io::Result<()>;
    /// How long a read may wait (`None`: forever).
    fn set_read_timeout(&self, timeout: Option<Duration>) -> io::Result<()>;
    /// Applies the link's socket settings (buffer sizes; `TCP_NODELAY` on TCP).
    fn configure(&self, opts: &LinkOptions) -> io::Result<()>;
}

/// A connected, framed link over stream `S`.
pub(crate) struct FramedLink<S: Stream> {
    stream: S,
    /// The TLS connection, when the link has one.
    tls: Option<TlsSession>,
    peer: String,
    max_frame: usize,
    counters: Arc<Counters>,
    buf: Vec<u8>,
    /// Bytes read while telling TLS from plain frames, to be read again first.
    pending: Vec<u8>,
    /// How long one read may wait (`None`: forever), as last set.
    read_timeout: Option<Duration>,
    /// No read waits past this (the end of the handshake), when set.
    deadline: Option<Instant>,
    /// Seals frames sent, once the handshake has keyed them.
    send_seal: Option<FrameSeal>,
    /// Opens frames received, once the handshake has keyed them.
    recv_seal: Option<FrameSeal>,
    /// `link{peer}`: every frame sent or received is a trace event inside it, so
    /// `BATON_LOG=trace` shows what crossed each link, in order.
    span: tracing::Span,
}

impl<S: Stream> FramedLink<S> {
    /// Runs the client side of the TLS handshake on a connected stream when `opts` asks
    /// for TLS, finished by `deadline` (when given: the link's reads then stay bounded by
    /// it until [`Link::set_deadline`] clears it), or else within the read timeout.
    pub(crate) fn connected(
        stream: S,
        peer: String,
        opts: &LinkOptions,
        deadline: Option<Instant>,
    ) -> Result<FramedLink<S>, NetError> {
        let mut link = FramedLink::plain(stream, peer, opts)?;
        link.deadline = deadline;
        if let Some(tls) = &opts.tls {
            let until = deadline.unwrap_or_else(|| tls_deadline(opts));
            let session = TlsSession::client(&mut link.stream, tls, &link.peer, until, opts.read_timeout)?;
            link.tls = Some(session);
        }
        Ok(link)
    }

    /// [`accept_until`](FramedLink::accept_until) without a deadline.
    #[cfg(test)]
    pub(crate) fn accept(stream: S, peer: String, opts: &LinkOptions) -> Result<FramedLink<S>, NetError> {
        FramedLink::accept_until(stream, peer, opts, None)
    }

    /// Wraps an accepted stream; with TLS, runs the server side of the handshake. A
    /// peer that does not speak what this end speaks (TLS or not) is refused with an
    /// error saying so; a plain peer of a TLS node is told why in a `Refused` frame.
    /// With a `deadline`, nothing here (nor any read of the link until
    /// [`Link::set_deadline`] clears it) waits past it.
    pub(crate) fn accept_until(
        stream: S,
        peer: String,
        opts: &LinkOptions,
        deadline: Option<Instant>,
    ) -> Result<FramedLink<S>, NetError> {
        let mut link = FramedLink::plain(stream, peer, opts)?;
        link.deadline = deadline;
        // The first bytes tell a TLS handshake from a frame. They are read, not peeked
        // (not every stream can peek), and handed to whichever reads next.
        let mut head = [0u8; 3];
        let n = loop {
            let read = match deadline {
                Some(deadline) => Bounded::new(&mut link.stream, deadline, opts.read_timeout).read(&mut head),
                None => link.stream.read(&mut head),
            };
            match read {
                Ok(0) => return Err(NetError::Closed { peer: link.peer }),
                Ok(n) => break n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(read_error(&link.peer, e)),
            }
        };
        let head = &head[..n];
        match (&opts.tls, looks_like_tls(head)) {
            (None, false) => {
                link.pending = head.to_vec();
                Ok(link)
            }
            (Some(tls), true) => match TlsSession::server(
                &mut link.stream,
                tls,
                &link.peer,
                deadline.unwrap_or_else(|| tls_deadline(opts)),
                opts.read_timeout,
                head,
            ) {
                Ok(session) => {
                    link.tls = Some(session);
                    Ok(link)
                }
                // A peer out of time has had its chance: no lingering for it.
                Err(e @ NetError::Timeout { .. }) => Err(e),
                Err(e) => {
                    close_gently(&mut link.stream);
                    Err(e)
                }
            },
            (Some(_), false) => {
                let _ = link.send(&Message::Refused {
                    code: RefusalCode::TlsRequired,
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

    /// Wraps a connected stream as a plain link, running no handshake of any kind (tests
    /// drive one over it). With `opts.tls` set this is an error: a link that should be
    /// encrypted must come from `connected` or `accept`.
    #[cfg(test)]
    pub(crate) fn new(stream: S, peer: String, opts: &LinkOptions) -> Result<FramedLink<S>, NetError> {
        if opts.tls.is_some() {
            return Err(NetError::Tls {
                peer,
                reason: "TcpLink::new makes plain links only; use connect or accept for TLS".into(),
            });
        }
        FramedLink::plain(stream, peer, opts)
    }

    /// Sets the socket options; no TLS yet.
    fn plain(stream: S, peer: String, opts: &LinkOptions) -> Result<FramedLink<S>, NetError> {
        let io = |source| NetError::Io {
            peer: peer.clone(),
            source,
        };
        stream.configure(opts).map_err(io)?;
        stream.set_read_timeout(opts.read_timeout).map_err(io)?;
        Ok(FramedLink {
            stream,
            tls: None,
            max_frame: opts.max_frame,
            counters: Arc::default(),
            buf: Vec::new(),
            pending: Vec::new(),
            read_timeout: opts.read_timeout,
            deadline: None,
            send_seal: None,
            recv_seal: None,
            span: tracing::debug_span!("link", peer = %peer),
            peer,
        })
    }

    /// This link's byte counters (shared with its halves after `split`).
    pub(crate) fn counters(&self) -> Arc<Counters> {
        self.counters.clone()
    }

    /// Changes how long a read may wait.
    pub(crate) fn set_read_timeout(&mut self, timeout: Option<Duration>) -> Result<(), NetError> {
        self.read_timeout = timeout;
        self.stream.set_read_timeout(timeout).map_err(|source| NetError::Io {
            peer: self.peer.clone(),
            source,
        })
    }

    /// Bounds every read by `deadline` (`None`: only the read timeout again).
    pub(crate) fn set_deadline(&mut self, deadline: Option<Instant>) -> Result<(), NetError> {
        self.deadline = deadline;
        if deadline.is_none() {
            // A bounded read left a shorter timeout on the socket.
            self.set_read_timeout(self.read_timeout)?;
        }
        Ok(())
    }

    /// Seals every frame from now on (both directions) with `keys`.
    pub(crate) fn authenticate_frames(&mut self, keys: FrameKeys) {
        self.send_seal = Some(keys.send);
        self.recv_seal = Some(keys.recv);
    }

    /// Sends one message as one frame (sealed, with its tag, once frames are sealed).
    pub(crate) fn send(&mut self, msg: &Message) -> Result<(), NetError> {
        self.buf.clear();
        let kind = encode_payload(msg, &mut self.buf);
        let head = header(kind, self.buf.len());
        let tag = self.send_seal.as_mut().map(|seal| seal.seal(&head, &mut self.buf));
        let tag: &[u8] = tag.as_ref().map_or(&[], |t| t);
        let mut slices = [IoSlice::new(&head), IoSlice::new(&self.buf), IoSlice::new(tag)];
        let total = HEADER_LEN + self.buf.len() + tag.len();
        self.span
            .in_scope(|| tracing::trace!(kind = msg.kind(), bytes = total, "sent"));
        if let Some(tls) = &mut self.tls {
            tls.send(&mut self.stream, &slices, &self.peer)?;
            self.counters.sent.fetch_add(total as u64, Ordering::Relaxed);
            return Ok(());
        }
        let mut slices: &mut [IoSlice] = &mut slices;
        while !slices.is_empty() {
            let n = match self.stream.write_vectored(slices) {
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(source) => {
                    return Err(NetError::Io {
                        peer: self.peer.clone(),
                        source,
                    })
                }
            };
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

    /// Receives one message. Any malformed frame, or one whose tag does not check out,
    /// is an error; the caller drops the link. An untrusted frame is never decoded.
    pub(crate) fn recv(&mut self) -> Result<Message, NetError> {
        let mut head = [0u8; HEADER_LEN];
        self.read_exact(&mut head)?;
        let (kind, len) = parse_header(&head, self.max_frame).map_err(|e| self.proto(e))?;
        self.buf.clear();
        self.buf.resize(len, 0);
        let mut payload = std::mem::take(&mut self.buf);
        let read = self
            .read_exact(&mut payload)
            .and_then(|()| self.open(&head, &mut payload));
        let msg = read.and_then(|()| decode(kind, &payload).map_err(|e| self.proto(e)));
        self.buf = payload;
        let tag_len = if self.recv_seal.is_some() { TAG_LEN } else { 0 };
        self.counters
            .received
            .fetch_add((HEADER_LEN + len + tag_len) as u64, Ordering::Relaxed);
        if let Ok(msg) = &msg {
            let bytes = HEADER_LEN + len + tag_len;
            self.span
                .in_scope(|| tracing::trace!(kind = msg.kind(), bytes, "received"));
        }
        msg
    }

    /// Once frames are sealed: reads the tag that follows a frame, checks it, and
    /// decrypts the payload in place.
    fn open(&mut self, head: &[u8], payload: &mut [u8]) -> Result<(), NetError> {
        if self.recv_seal.is_none() {
            return Ok(());
        }
        let mut tag = [0u8; TAG_LEN];
        self.read_exact(&mut tag)?;
        let seal = self.recv_seal.as_mut().expect("checked above");
        if seal.open(head, payload, &tag) {
            return Ok(());
        }
        Err(NetError::Tampered {
            peer: self.peer.clone(),
            frame: seal.frames() - 1,
        })
    }

    fn proto(&self, error: baton_proto::ProtoError) -> NetError {
        NetError::Protocol {
            peer: self.peer.clone(),
            error,
        }
    }

    fn read_exact(&mut self, buf: &mut [u8]) -> Result<(), NetError> {
        let from_pending = self.pending.len().min(buf.len());
        buf[..from_pending].copy_from_slice(&self.pending[..from_pending]);
        self.pending.drain(..from_pending);
        let rest = &mut buf[from_pending..];
        match (&mut self.tls, self.deadline) {
            (Some(tls), None) => tls.read_exact(&mut self.stream, rest, &self.peer),
            (Some(tls), Some(deadline)) => tls.read_exact(
                &mut Bounded::new(&mut self.stream, deadline, self.read_timeout),
                rest,
                &self.peer,
            ),
            (None, None) => self.stream.read_exact(rest).map_err(|e| read_error(&self.peer, e)),
            (None, Some(deadline)) => Bounded::new(&mut self.stream, deadline, self.read_timeout)
                .read_exact(rest)
                .map_err(|e| read_error(&self.peer, e)),
        }
    }

    /// Two halves over the same connection, for a reader and a writer thread.
    pub(crate) fn split(self) -> Result<(FramedTx<S>, FramedRx<S>), NetError> {
        let clone = self.stream.try_clone().map_err(|source| NetError::Io {
            peer: self.peer.clone(),
            source,
        })?;
        let mut rx = self;
        let tx = FramedLink {
            stream: clone,
            tls: rx.tls.as_ref().map(TlsSession::half),
            peer: rx.peer.clone(),
            max_frame: rx.max_frame,
            counters: rx.counters.clone(),
            buf: Vec::new(),
            pending: Vec::new(),
            read_timeout: rx.read_timeout,
            deadline: None,
            send_seal: rx.send_seal.take(),
            recv_seal: None,
            span: rx.span.clone(),
        };
        Ok((FramedTx(tx), FramedRx(rx)))
    }

    /// A handle that closes this link from another thread.
    pub(crate) fn closer(&self) -> Result<LinkCloser, NetError> {
        let stream = self.stream.try_clone().map_err(|source| NetError::Io {
            peer: self.peer.clone(),
            source,
        })?;
        Ok(LinkCloser::new(move || {
            let _ = stream.shutdown(Shutdown::Both);
        }))
    }
}

impl<S: Stream> Link for FramedLink<S> {
    fn send(&mut self, msg: Message) -> Result<(), NetError> {
        FramedLink::send(self, &msg)
    }

    fn recv(&mut self) -> Result<Message, NetError> {
        FramedLink::recv(self)
    }

    fn peer(&self) -> &str {
        &self.peer
    }

    fn set_read_timeout(&mut self, timeout: Option<Duration>) -> Result<(), NetError> {
        FramedLink::set_read_timeout(self, timeout)
    }

    fn set_deadline(&mut self, deadline: Option<Instant>) -> Result<(), NetError> {
        FramedLink::set_deadline(self, deadline)
    }

    fn authenticate_frames(&mut self, keys: FrameKeys) {
        FramedLink::authenticate_frames(self, keys);
    }

    fn set_max_frame(&mut self, max_frame: usize) {
        self.max_frame = max_frame;
    }

    fn counters(&self) -> Arc<Counters> {
        self.counters.clone()
    }

    fn closer(&self) -> Result<LinkCloser, NetError> {
        FramedLink::closer(self)
    }

    fn close_gently(&mut self) {
        close_gently(&mut self.stream);
    }

    fn split(self: Box<Self>) -> Result<Halves, NetError> {
        let (tx, rx) = FramedLink::split(*self)?;
        Ok((Box::new(tx), Box::new(rx)))
    }
}

/// The sending half of a framed link.
pub(crate) struct FramedTx<S: Stream>(FramedLink<S>);

/// The receiving half of a framed link.
pub(crate) struct FramedRx<S: Stream>(FramedLink<S>);

impl<S: Stream> Tx for FramedTx<S> {
    fn send(&mut self, msg: Message) -> Result<(), NetError> {
        self.0.send(&msg)
    }

    fn counters(&self) -> Arc<Counters> {
        self.0.counters()
    }
}

impl<S: Stream> Rx for FramedRx<S> {
    fn recv(&mut self) -> Result<Message, NetError> {
        self.0.recv()
    }

    fn peer(&self) -> &str {
        &self.0.peer
    }

    fn counters(&self) -> Arc<Counters> {
        self.0.counters()
    }
}

/// Closes a refused connection so that what was last sent to the peer reaches it: read
/// and drop what it still sends (briefly), so that the close is a FIN and not a reset
/// that could discard our last words, and the peer's next write does not fail before
/// it has read them.
pub(crate) fn close_gently<S: Stream>(stream: &mut S) {
    let _ = stream.shutdown(Shutdown::Write);
    let deadline = Instant::now() + Duration::from_secs(1);
    let mut sink = [0u8; 4096];
    let mut left: usize = 1 << 20;
    while left > 0 {
        let wait = deadline
            .saturating_duration_since(Instant::now())
            .min(Duration::from_millis(200));
        if wait.is_zero() || stream.set_read_timeout(Some(wait)).is_err() {
            break;
        }
        match stream.read(&mut sink) {
            Ok(0) | Err(_) => break,
            Ok(n) => left = left.saturating_sub(n),
        }
    }
}

/// When a TLS handshake without a deadline of its own must be done: within the link's
/// read timeout, or [`HANDSHAKE_TIMEOUT`](crate::tls::HANDSHAKE_TIMEOUT).
fn tls_deadline(opts: &LinkOptions) -> Instant {
    Instant::now() + opts.read_timeout.unwrap_or(crate::tls::HANDSHAKE_TIMEOUT)
}

/// A stream whose reads give up at `deadline`: a read never waits past it, however the
/// peer spaces its bytes, so a peer that sends a byte every few seconds cannot keep a
/// read (or a TLS handshake, which reads many times) going. The socket's timeout is set
/// to the time left (at most the link's own read timeout) when a read could otherwise
/// outlast the deadline by more than [`Bounded::SLACK`]; a handshake that moves along
/// sets it once. Writes go straight through.
pub(crate) struct Bounded<'a, S: Stream> {
    stream: &'a mut S,
    deadline: Instant,
    timeout: Option<Duration>,
    /// The latest a read started now could end with the socket timeout last set here.
    armed: Option<(Instant, Duration)>,
}

impl<'a, S: Stream> Bounded<'a, S> {
    /// How far past the deadline a read may end before the socket timeout is set again.
    const SLACK: Duration = Duration::from_millis(20);

    pub(crate) fn new(stream: &'a mut S, deadline: Instant, timeout: Option<Duration>) -> Bounded<'a, S> {
        Bounded {
            stream,
            deadline,
            timeout,
            armed: None,
        }
    }
}

impl<S: Stream> Read for Bounded<'_, S> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let now = Instant::now();
        let left = self.deadline.saturating_duration_since(now);
        if left.is_zero() {
            return Err(io::ErrorKind::TimedOut.into());
        }
        let wait = self.timeout.map_or(left, |t| t.min(left));
        let fresh = match self.armed {
            Some((_, set)) => now + set > self.deadline + Self::SLACK || set < wait,
            None => true,
        };
        if fresh {
            self.stream.set_read_timeout(Some(wait))?;
            self.armed = Some((now, wait));
        }
        self.stream.read(buf)
    }
}

impl<S: Stream> Write for Bounded<'_, S> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.stream.write(buf)
    }

    /// rustls writes queued records with one vectored write, and after an error only
    /// once: the default (first buffer only) would drop the alert behind a
    /// ChangeCipherSpec, and the peer would see the connection end with no reason.
    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        self.stream.write_vectored(bufs)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.stream.flush()
    }
}

/// A failed socket read, as the link reports it.
pub(crate) fn read_error(peer: &str, source: io::Error) -> NetError {
    match source.kind() {
        io::ErrorKind::UnexpectedEof => NetError::Closed { peer: peer.to_string() },
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => NetError::Timeout { peer: peer.to_string() },
        _ => NetError::Io {
            peer: peer.to_string(),
            source,
        },
    }
}

#[cfg(test)]
mod tests;
