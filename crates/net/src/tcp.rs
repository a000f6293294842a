//! TCP: `TCP_NODELAY` so a hidden state leaves at once, optional kernel buffer sizes,
//! connecting with a timeout to every address a name resolves to.

use std::io;
use std::net::{Shutdown, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use crate::framed::{FramedLink, LinkOptions, Stream};
use crate::NetError;

/// Longest a connection attempt to one address may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

impl Stream for TcpStream {
    fn try_clone(&self) -> io::Result<TcpStream> {
        TcpStream::try_clone(self)
    }

    fn shutdown(&self, how: Shutdown) -> io::Result<()> {
        TcpStream::shutdown(self, how)
    }

    fn set_read_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        TcpStream::set_read_timeout(self, timeout)
    }

    fn configure(&self, opts: &LinkOptions) -> io::Result<()> {
        self.set_nodelay(true)?;
        set_buffers(socket2::SockRef::from(self), opts)
    }
}

/// Applies the kernel buffer sizes of `opts` to a socket of any family.
pub(crate) fn set_buffers(sock: socket2::SockRef<'_>, opts: &LinkOptions) -> io::Result<()> {
    if let Some(size) = opts.send_buffer {
        sock.set_send_buffer_size(size)?;
    }
    if let Some(size) = opts.recv_buffer {
        sock.set_recv_buffer_size(size)?;
    }
    Ok(())
}

/// Why a connection could not be made, in words (the OS error once, at the end).
fn connect_failure(e: &io::Error) -> String {
    use io::ErrorKind;
    let what = match e.kind() {
        ErrorKind::ConnectionRefused => "nothing listens on that port",
        ErrorKind::TimedOut | ErrorKind::WouldBlock => "no answer within 10 s",
        ErrorKind::HostUnreachable | ErrorKind::NetworkUnreachable => "no route to the host",
        ErrorKind::AddrNotAvailable => "the address is not available",
        _ => "the connection failed",
    };
    format!("{what} ({e})")
}

/// Connects to `addr` (`host:port`), trying each address it resolves to; with a
/// `deadline`, no attempt (nor the TLS handshake) waits past it.
pub(crate) fn connect(
    addr: &str,
    opts: &LinkOptions,
    deadline: Option<Instant>,
) -> Result<FramedLink<TcpStream>, NetError> {
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
        let timeout = match deadline {
            Some(deadline) => CONNECT_TIMEOUT.min(deadline.saturating_duration_since(Instant::now())),
            None => CONNECT_TIMEOUT,
        };
        if timeout.is_zero() {
            last = Some(io::ErrorKind::TimedOut.into());
            break;
        }
        match TcpStream::connect_timeout(&a, timeout) {
            Ok(stream) => return FramedLink::connected(stream, addr.to_string(), opts, deadline),
            Err(e) => last = Some(e),
        }
    }
    Err(unreachable(match last {
        None => "the address resolved to nothing".to_string(),
        Some(e) => connect_failure(&e),
    }))
}

impl FramedLink<TcpStream> {
    /// Connects to `addr` (`host:port`); see [`connect`].
    #[cfg(test)]
    pub(crate) fn connect(addr: &str, opts: &LinkOptions) -> Result<FramedLink<TcpStream>, NetError> {
        connect(addr, opts, None)
    }
}

/// Binds a TCP listener on `addr` (`host:port`; port 0 picks a free one).
pub(crate) fn bind(addr: &str) -> Result<TcpListener, NetError> {
    TcpListener::bind(addr).map_err(|source| NetError::Bind {
        addr: addr.to_string(),
        source,
    })
}
