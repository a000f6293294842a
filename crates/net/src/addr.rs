//! Addresses, connecting and listening, whatever the transport: callers pass an address
//! string and get a [`Link`]; only this file knows which transports exist.
//!
//! - `host:port`: TCP (`TCP_NODELAY`, optional kernel buffer sizes);
//! - `unix:/path/to/socket`: a Unix-domain socket on this host.
//!
//! Either may carry TLS ([`LinkOptions::tls`]).

use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use crate::framed::{FramedLink, LinkCloser, LinkOptions};
use crate::unix::SocketFile;
use crate::{Link, NetError};

/// The prefix of a Unix-domain socket address.
const UNIX_PREFIX: &str = "unix:";

/// Where a node listens or is reached. More transports may come: match with a
/// wildcard arm.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Addr {
    /// `host:port` over TCP.
    Tcp(String),
    /// `unix:PATH`: a Unix-domain socket on this host.
    Unix(PathBuf),
}

impl Addr {
    /// Reads `unix:PATH` as a Unix-domain socket and anything else as TCP `host:port`.
    pub fn parse(text: &str) -> Result<Addr, NetError> {
        match text.strip_prefix(UNIX_PREFIX) {
            Some("") => Err(NetError::BadAddress {
                addr: text.to_string(),
                reason: "a unix: address needs a socket path, e.g. unix:/run/baton/w0.sock".into(),
            }),
            Some(path) => Ok(Addr::Unix(PathBuf::from(path))),
            None => Ok(Addr::Tcp(text.to_string())),
        }
    }

    /// Whether only this host can reach the address: a Unix-domain socket, or TCP on a
    /// loopback interface (a TCP name is resolved).
    pub fn is_local(&self) -> Result<bool, NetError> {
        match self {
            Addr::Unix(_) => Ok(true),
            Addr::Tcp(addr) => {
                let resolved = addr.to_socket_addrs().map_err(|e| NetError::BadAddress {
                    addr: addr.clone(),
                    reason: format!("cannot resolve it ({e})"),
                })?;
                Ok(resolved.into_iter().all(|a| a.ip().is_loopback()))
            }
        }
    }
}

impl std::fmt::Display for Addr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Addr::Tcp(addr) => f.write_str(addr),
            Addr::Unix(path) => write!(f, "{UNIX_PREFIX}{}", path.display()),
        }
    }
}

/// Connects to `addr` (see [`Addr::parse`]); with `opts.tls`, runs the client side of
/// the TLS handshake. No baton handshake yet: see [`client_handshake`](crate::client_handshake).
pub fn connect(addr: &str, opts: &LinkOptions) -> Result<Box<dyn Link>, NetError> {
    connect_until(addr, opts, None)
}

/// Like [`connect`], but nothing waits past `deadline`: not the connection, not the TLS
/// handshake, and no read of the link until [`Link::set_deadline`] clears it (so the
/// baton handshake that follows is bounded too).
pub fn connect_by(addr: &str, opts: &LinkOptions, deadline: Instant) -> Result<Box<dyn Link>, NetError> {
    connect_until(addr, opts, Some(deadline))
}

fn connect_until(addr: &str, opts: &LinkOptions, deadline: Option<Instant>) -> Result<Box<dyn Link>, NetError> {
    Ok(match Addr::parse(addr)? {
        Addr::Tcp(tcp) => Box::new(crate::tcp::connect(&tcp, opts, deadline)?),
        Addr::Unix(path) => Box::new(crate::unix::connect(&path, addr, opts, deadline)?),
    })
}

/// A listening socket of any transport.
pub struct Listener {
    socket: ListenerSocket,
    /// The bound address, as peers should dial it (port 0 resolved, socket path absolute).
    addr: String,
}

enum ListenerSocket {
    Tcp(TcpListener),
    Unix {
        listener: UnixListener,
        /// Removes the socket file when the listener goes.
        _file: SocketFile,
        /// Connections accepted so far, to name their (anonymous) peers.
        accepted: AtomicU64,
    },
}

impl Listener {
    /// Listens on `addr` (see [`Addr::parse`]; TCP port 0 picks a free port). A Unix
    /// socket path left behind by a process that has stopped is taken over; one a live
    /// process listens on is an error.
    pub fn bind(addr: &str) -> Result<Listener, NetError> {
        match Addr::parse(addr)? {
            Addr::Tcp(tcp) => {
                let listener = crate::tcp::bind(&tcp)?;
                let bound = listener.local_addr().map_err(|source| NetError::Bind {
                    addr: addr.to_string(),
                    source,
                })?;
                Ok(Listener {
                    socket: ListenerSocket::Tcp(listener),
                    addr: bound.to_string(),
                })
            }
            Addr::Unix(path) => {
                // Other nodes dial the advertised path from their own directories.
                let path = std::path::absolute(&path).map_err(|source| NetError::Bind {
                    addr: addr.to_string(),
                    source,
                })?;
                let (listener, file) = crate::unix::bind(&path, addr)?;
                Ok(Listener {
                    socket: ListenerSocket::Unix {
                        listener,
                        _file: file,
                        accepted: AtomicU64::new(0),
                    },
                    addr: Addr::Unix(path).to_string(),
                })
            }
        }
    }

    /// The address peers dial to reach this listener (`127.0.0.1:40123`,
    /// `unix:/run/baton/w0.sock`).
    pub fn local_addr(&self) -> &str {
        &self.addr
    }

    /// Waits for the next connection. It is not a link yet: [`Incoming::into_link`] runs
    /// the TLS side of accepting, which may wait on the peer, so it belongs on the
    /// connection's own thread and not on the accepting one.
    pub fn accept(&self) -> Result<Incoming, NetError> {
        let io = |source| NetError::Io {
            peer: self.addr.clone(),
            source,
        };
        match &self.socket {
            ListenerSocket::Tcp(listener) => {
                let (stream, peer) = listener.accept().map_err(io)?;
                let local = stream
                    .local_addr()
                    .map_or_else(|_| self.addr.clone(), |a| a.to_string());
                Ok(Incoming {
                    stream: IncomingStream::Tcp(stream),
                    peer: peer.to_string(),
                    source: source_of(&peer),
                    local,
                })
            }
            ListenerSocket::Unix { listener, accepted, .. } => {
                let (stream, _) = listener.accept().map_err(io)?;
                let n = accepted.fetch_add(1, Ordering::Relaxed) + 1;
                Ok(Incoming {
                    stream: IncomingStream::Unix(stream),
                    peer: format!("peer {n} of {}", self.addr),
                    // Whoever may open the socket file is one local party.
                    source: format!("local socket {}", self.addr),
                    local: self.addr.clone(),
                })
            }
        }
    }

    /// Accepts the next connection and makes it a link at once (see [`Listener::accept`]).
    pub fn accept_link(&self, opts: &LinkOptions) -> Result<Box<dyn Link>, NetError> {
        self.accept()?.into_link(opts)
    }
}

/// An accepted connection, before it is a link.
pub struct Incoming {
    stream: IncomingStream,
    peer: String,
    source: String,
    local: String,
}

/// The party behind a TCP peer address, as far as an address tells: the IPv4 address,
/// or the /64 network of an IPv6 one (one host or site gets a whole /64, so counting
/// single IPv6 addresses would count nothing).
pub fn source_of(peer: &SocketAddr) -> String {
    match peer.ip() {
        IpAddr::V4(ip) => ip.to_string(),
        IpAddr::V6(ip) => match ip.to_ipv4_mapped() {
            Some(v4) => v4.to_string(),
            None => {
                let s = ip.segments();
                format!("{:x}:{:x}:{:x}:{:x}::/64", s[0], s[1], s[2], s[3])
            }
        },
    }
}

enum IncomingStream {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Incoming {
    /// Who connected, for logs: the peer's address on TCP; on a Unix socket, whose
    /// peers have no address, its number and the socket.
    pub fn peer(&self) -> &str {
        &self.peer
    }

    /// Who is behind the connection, for per-source limits: the peer's IPv4 address or
    /// IPv6 /64 network on TCP; the socket itself on a Unix socket (anyone allowed to
    /// open it).
    pub fn source(&self) -> &str {
        &self.source
    }

    /// A handle that closes the connection from another thread (its reads end at once),
    /// whatever becomes of it.
    pub fn closer(&self) -> Result<LinkCloser, NetError> {
        let io = |source| NetError::Io {
            peer: self.peer.clone(),
            source,
        };
        Ok(match &self.stream {
            IncomingStream::Tcp(stream) => {
                let stream = stream.try_clone().map_err(io)?;
                LinkCloser::new(move || {
                    let _ = stream.shutdown(Shutdown::Both);
                })
            }
            IncomingStream::Unix(stream) => {
                let stream = stream.try_clone().map_err(io)?;
                LinkCloser::new(move || {
                    let _ = stream.shutdown(Shutdown::Both);
                })
            }
        })
    }

    /// Where the peer reached this node: the address by which nodes that reach it the
    /// same way can reach it too (the interface and port on TCP, the socket path).
    pub fn local_addr(&self) -> &str {
        &self.local
    }

    /// Makes the connection a link: with `opts.tls`, runs the server side of the TLS
    /// handshake; a peer that speaks TLS when this end does not (or the other way round)
    /// is refused with an error that says so.
    pub fn into_link(self, opts: &LinkOptions) -> Result<Box<dyn Link>, NetError> {
        self.into_link_until(opts, None)
    }

    /// Like [`into_link`](Incoming::into_link), but nothing waits past `deadline`: not
    /// the first bytes, not the TLS handshake, and no read of the link until
    /// [`Link::set_deadline`] clears it (so the baton handshake that follows is bounded
    /// too, however the peer spaces its bytes).
    pub fn into_link_by(self, opts: &LinkOptions, deadline: Instant) -> Result<Box<dyn Link>, NetError> {
        self.into_link_until(opts, Some(deadline))
    }

    fn into_link_until(self, opts: &LinkOptions, deadline: Option<Instant>) -> Result<Box<dyn Link>, NetError> {
        Ok(match self.stream {
            IncomingStream::Tcp(stream) => Box::new(FramedLink::accept_until(stream, self.peer, opts, deadline)?),
            IncomingStream::Unix(stream) => Box::new(FramedLink::accept_until(stream, self.peer, opts, deadline)?),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_parse_by_their_prefix_and_print_back() {
        let cases = [
            ("127.0.0.1:7070", Addr::Tcp("127.0.0.1:7070".into())),
            ("[::1]:0", Addr::Tcp("[::1]:0".into())),
            ("gpu-box:7070", Addr::Tcp("gpu-box:7070".into())),
            ("unix:/run/baton/w0.sock", Addr::Unix("/run/baton/w0.sock".into())),
            ("unix:w.sock", Addr::Unix("w.sock".into())),
        ];
        for (text, addr) in cases {
            assert_eq!(Addr::parse(text).unwrap(), addr, "{text}");
            assert_eq!(addr.to_string(), text);
        }
        let err = Addr::parse("unix:").unwrap_err().to_string();
        assert!(err.contains("needs a socket path"), "{err}");
    }

    #[test]
    fn sources_are_ipv4_addresses_and_ipv6_networks() {
        let cases = [
            ("127.0.0.1:5000", "127.0.0.1"),
            ("10.1.2.3:1", "10.1.2.3"),
            ("[2001:db8:1:2:aaaa::1]:7070", "2001:db8:1:2::/64"),
            ("[2001:db8:1:2:bbbb::9]:7071", "2001:db8:1:2::/64"),
            ("[::ffff:192.0.2.7]:80", "192.0.2.7"),
        ];
        for (peer, source) in cases {
            assert_eq!(source_of(&peer.parse().unwrap()), source, "{peer}");
        }
    }

    #[test]
    fn unix_sockets_and_loopback_are_local() {
        assert!(Addr::parse("unix:/tmp/x.sock").unwrap().is_local().unwrap());
        assert!(Addr::parse("127.0.0.1:7070").unwrap().is_local().unwrap());
        assert!(Addr::parse("localhost:7070").unwrap().is_local().unwrap());
        assert!(!Addr::parse("0.0.0.0:7070").unwrap().is_local().unwrap());
        assert!(!Addr::parse("10.1.2.3:7070").unwrap().is_local().unwrap());
    }
}
