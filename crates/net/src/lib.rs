//! Transports that carry messages between nodes, behind one interface: a [`Link`] sends
//! and receives [`Message`]s and splits into a [`Tx`] and an [`Rx`] half, so stage code
//! and cluster forming do not know what carries them. Links come from an address
//! ([`connect`], [`Listener`]): TCP (`host:port`) or a Unix-domain socket
//! (`unix:/path`), either optionally inside TLS; or from [`local_pair`] and
//! [`local_link`] in one process. A new transport is a new arm in `addr.rs` and an
//! implementation of the crate's `Stream` trait (or of [`Link`]); nothing outside this
//! crate changes.
//!
//! The socket transports use blocking sockets and a thread per link rather than async
//! I/O: a ring link carries one frame per step in strict order, so there is nothing for
//! an executor to interleave, and a blocking read has the lowest latency.
#![deny(unsafe_code)]

mod addr;
pub mod discovery;
mod framed;
mod handshake;
mod local;
mod tcp;
mod tls;
mod unix;

use std::sync::Arc;
use std::time::{Duration, Instant};

use baton_proto::auth::FrameKeys;
use baton_proto::{Conversation, Message, ProtoError, RefusalCode, WrongConversation};

pub use addr::{connect, connect_by, source_of, Addr, Incoming, Listener};
pub use framed::{Counters, LinkCloser, LinkOptions};
pub use handshake::{client_handshake, refuse_unexpected_auth, server_handshake, server_handshake_admitting};
pub use local::{local_link, local_pair, LocalLink, LocalRx, LocalTx};
pub use tls::{TlsConfig, TlsError};

/// Transport failures; each names the peer (or the address).
#[derive(Debug, thiserror::Error)]
pub enum NetError {
    /// The other end is gone.
    #[error("link to {peer} is closed")]
    Closed { peer: String },
    /// A socket operation failed.
    #[error("I/O error on the link to {peer}: {source}")]
    Io { peer: String, source: std::io::Error },
    /// No connection could be made: nothing listens there, no route, or the name does
    /// not resolve (`reason` says which, in words).
    #[error("cannot reach {peer}: {reason}")]
    Unreachable { peer: String, reason: String },
    /// Nothing could listen on `addr`.
    #[error("cannot listen on {addr}: {source}")]
    Bind { addr: String, source: std::io::Error },
    /// Not an address this crate can use.
    #[error("bad address {addr}: {reason}")]
    BadAddress { addr: String, reason: String },
    /// Nothing arrived in time.
    #[error("timed out waiting for {peer}")]
    Timeout { peer: String },
    /// The peer sent a malformed frame.
    #[error("bad frame from {peer}: {error}")]
    Protocol { peer: String, error: ProtoError },
    /// Authentication failed (wrong or missing token).
    #[error("authentication with {peer} failed: {reason}")]
    Auth { peer: String, reason: String },
    /// The peer speaks protocol version `theirs`.
    #[error("{peer}: {reason}")]
    Version { peer: String, theirs: u32, reason: String },
    /// TLS could not be set up or broke (another certificate, no TLS on one end).
    #[error("TLS with {peer} failed: {reason}")]
    Tls { peer: String, reason: String },
    /// The peer refused us and said why.
    #[error("{peer} refused the connection: {reason}")]
    Refused {
        peer: String,
        code: RefusalCode,
        reason: String,
    },
    /// The peer sent a valid message that does not belong here.
    #[error("{peer} sent {got} where {expected} was expected")]
    Unexpected {
        peer: String,
        expected: &'static str,
        got: &'static str,
    },
    /// The peer sent a message of another conversation than the link carries.
    #[error("{peer} sent {got}, which does not belong on a {conversation} link")]
    WrongConversation {
        peer: String,
        conversation: &'static str,
        got: &'static str,
    },
    /// A frame's tag did not check out: something between the two nodes changed,
    /// dropped, replayed or added a frame (or the peer holds another token's keys).
    #[error(
        "frame {frame} from {peer} failed authentication (its tag does not match): something between \
         the nodes changed, dropped or injected a frame"
    )]
    Tampered { peer: String, frame: u64 },
    /// This node authenticated the peer but turned it away, telling it why.
    #[error("turned {peer} away: {reason}")]
    TurnedAway { peer: String, reason: String },
}

impl NetError {
    /// The peer's refusal code, when the peer refused us.
    pub fn refusal(&self) -> Option<RefusalCode> {
        match self {
            NetError::Refused { code, .. } => Some(*code),
            _ => None,
        }
    }
}

/// A link's two halves: sending and receiving.
pub type Halves = (Box<dyn Tx>, Box<dyn Rx>);

/// A two-way connection to one peer, whatever carries it.
pub trait Link: Send {
    /// Sends one message, in order.
    fn send(&mut self, msg: Message) -> Result<(), NetError>;
    /// Waits for the next message (at most the read timeout). Any malformed frame is an
    /// error, after which the link is dropped.
    fn recv(&mut self) -> Result<Message, NetError>;
    /// The peer, as dialed or accepted, for logs and errors.
    fn peer(&self) -> &str;
    /// Changes how long a read may wait (`None`: forever).
    fn set_read_timeout(&mut self, timeout: Option<Duration>) -> Result<(), NetError>;
    /// Makes every read wait at most until `deadline`, however the peer spaces its
    /// bytes (`None`: only the read timeout again). Handshakes run under one, so that a
    /// peer cannot hold a connection by sending a byte every few seconds.
    fn set_deadline(&mut self, deadline: Option<Instant>) -> Result<(), NetError>;
    /// Seals every frame from now on, both ways, with the keys of a handshake that
    /// proved a token (see [`baton_proto::auth::FrameSeal`]); a frame whose tag does not
    /// check out fails with [`NetError::Tampered`]. In-process links carry values that
    /// nothing between the ends can touch, and ignore this.
    fn authenticate_frames(&mut self, keys: FrameKeys);
    /// Changes the largest frame accepted from the peer (e.g. small until the peer has
    /// authenticated, so a stranger cannot make this node allocate much).
    fn set_max_frame(&mut self, max_frame: usize);
    /// Bytes that crossed the link (shared with its halves after [`split`](Link::split)).
    fn counters(&self) -> Arc<Counters>;
    /// A handle that closes the link from another thread.
    fn closer(&self) -> Result<LinkCloser, NetError>;
    /// Ends the link so that what this end sent last (a `Refused`) reaches the peer:
    /// stops sending, then reads and drops what the peer still sends for a moment. Just
    /// dropping the link could lose the message: a peer that sends once more before it
    /// reads fails at once on a Unix socket, and TCP may answer it with a reset that
    /// discards what was not read yet.
    fn close_gently(&mut self);
    /// Two halves over the same connection, for a reader and a writer thread.
    fn split(self: Box<Self>) -> Result<Halves, NetError>;
}

/// The sending half of a link.
pub trait Tx: Send {
    /// Sends one message, in order.
    fn send(&mut self, msg: Message) -> Result<(), NetError>;
    /// Bytes that crossed the link (shared by both halves). A half that carries no
    /// bytes, like a test double, counts nothing.
    fn counters(&self) -> Arc<Counters> {
        Arc::default()
    }
}

/// The receiving half of a link.
pub trait Rx: Send {
    /// Waits for the next message.
    fn recv(&mut self) -> Result<Message, NetError>;
    /// The peer, for errors (a test double may leave it unnamed).
    fn peer(&self) -> &str {
        "the peer"
    }
    /// Bytes that crossed the link (shared by both halves). A half that carries no
    /// bytes, like a test double, counts nothing.
    fn counters(&self) -> Arc<Counters> {
        Arc::default()
    }
}

impl<T: Tx + ?Sized> Tx for Box<T> {
    fn send(&mut self, msg: Message) -> Result<(), NetError> {
        (**self).send(msg)
    }

    fn counters(&self) -> Arc<Counters> {
        (**self).counters()
    }
}

impl<T: Rx + ?Sized> Rx for Box<T> {
    fn recv(&mut self) -> Result<Message, NetError> {
        (**self).recv()
    }

    fn peer(&self) -> &str {
        (**self).peer()
    }

    fn counters(&self) -> Arc<Counters> {
        (**self).counters()
    }
}

/// `msg` as a message of conversation `C`, from `peer`: a message of another
/// conversation is [`NetError::WrongConversation`].
pub fn expect<C: Conversation>(peer: &str, msg: Message) -> Result<C, NetError> {
    C::try_from(msg).map_err(|wrong: WrongConversation| NetError::WrongConversation {
        peer: peer.to_string(),
        conversation: wrong.conversation,
        got: wrong.message.kind(),
    })
}

/// Receiving one conversation's messages on a link: what the link's receiver matches
/// on names only what may arrive.
pub trait LinkExt {
    /// Waits for the next message, which must belong to conversation `C`.
    fn recv_as<C: Conversation>(&mut self) -> Result<C, NetError>;
}

impl<L: Link + ?Sized> LinkExt for L {
    fn recv_as<C: Conversation>(&mut self) -> Result<C, NetError> {
        let msg = self.recv()?;
        expect(self.peer(), msg)
    }
}

/// Receiving one conversation's messages on a link's receiving half.
pub trait RxExt {
    /// Waits for the next message, which must belong to conversation `C`.
    fn recv_as<C: Conversation>(&mut self) -> Result<C, NetError>;
}

impl<R: Rx + ?Sized> RxExt for R {
    fn recv_as<C: Conversation>(&mut self) -> Result<C, NetError> {
        let msg = self.recv()?;
        expect(self.peer(), msg)
    }
}
