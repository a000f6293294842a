//! Transports that carry messages between nodes. Every transport implements the same
//! two halves, [`Tx`] and [`Rx`], so stage code does not know what carries it:
//! in-process channels (tests, co-located stages) and TCP, optionally inside TLS.
//!
//! The TCP side uses blocking sockets and a thread per link rather than async I/O:
//! a ring link carries one frame per step in strict order, so there is nothing for
//! an executor to interleave, and a blocking read has the lowest latency.
#![deny(unsafe_code)]

mod handshake;
mod tcp;
mod tls;

use std::sync::mpsc;

use baton_proto::{Message, ProtoError};

pub use handshake::{client_handshake, refuse_unexpected_auth, server_handshake};
pub use tcp::{Counters, LinkCloser, LinkOptions, TcpLink, TcpRx, TcpTx};
pub use tls::{TlsConfig, TlsError};

/// Transport failures; each names the peer.
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
    /// Nothing arrived in time.
    #[error("timed out waiting for {peer}")]
    Timeout { peer: String },
    /// The peer sent a malformed frame.
    #[error("bad frame from {peer}: {error}")]
    Protocol { peer: String, error: ProtoError },
    /// Authentication failed (wrong or missing token).
    #[error("authentication with {peer} failed: {reason}")]
    Auth { peer: String, reason: String },
    /// The peer speaks another protocol version.
    #[error("{peer}: {reason}")]
    Version { peer: String, reason: String },
    /// TLS could not be set up or broke (another certificate, no TLS on one end).
    #[error("TLS with {peer} failed: {reason}")]
    Tls { peer: String, reason: String },
    /// The peer refused us and said why.
    #[error("{peer} refused the connection: {reason}")]
    Refused { peer: String, reason: String },
    /// The peer sent a valid message that does not belong here.
    #[error("{peer} sent {got} where {expected} was expected")]
    Unexpected {
        peer: String,
        expected: String,
        got: String,
    },
}

/// The sending half of a link.
pub trait Tx: Send {
    /// Sends one message, in order.
    fn send(&mut self, msg: Message) -> Result<(), NetError>;
}

/// The receiving half of a link.
pub trait Rx: Send {
    /// Waits for the next message.
    fn recv(&mut self) -> Result<Message, NetError>;
}

/// In-process sending half: a channel to a stage in the same process.
pub struct LocalTx {
    inner: mpsc::Sender<Message>,
    peer: String,
}

/// In-process receiving half.
pub struct LocalRx {
    inner: mpsc::Receiver<Message>,
    peer: String,
}

/// A one-way in-process link; `peer` names the receiving end in errors.
pub fn local_link(peer: &str) -> (LocalTx, LocalRx) {
    let (tx, rx) = mpsc::channel();
    (
        LocalTx {
            inner: tx,
            peer: peer.to_string(),
        },
        LocalRx {
            inner: rx,
            peer: peer.to_string(),
        },
    )
}

impl Tx for LocalTx {
    fn send(&mut self, msg: Message) -> Result<(), NetError> {
        self.inner.send(msg).map_err(|_| NetError::Closed {
            peer: self.peer.clone(),
        })
    }
}

impl Rx for LocalRx {
    fn recv(&mut self) -> Result<Message, NetError> {
        self.inner.recv().map_err(|_| NetError::Closed {
            peer: self.peer.clone(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn local_link_delivers_in_order_and_reports_a_closed_peer() {
        let (mut tx, mut rx) = local_link("stage 1");
        tx.send(Message::Done).unwrap();
        tx.send(Message::Shutdown).unwrap();
        assert_eq!(rx.recv().unwrap(), Message::Done);
        assert_eq!(rx.recv().unwrap(), Message::Shutdown);
        drop(rx);
        let err = tx.send(Message::Done).unwrap_err().to_string();
        assert_eq!(err, "link to stage 1 is closed");
    }
}
