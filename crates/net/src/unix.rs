//! Unix-domain sockets, for nodes on the same host: no TCP/IP stack on the way, and the
//! socket file's permissions decide who may connect. A worker killed without cleaning up
//! leaves its socket file behind; binding the same path again removes such a stale file,
//! but never one a live process still listens on.

use std::fs;
use std::io;
use std::net::Shutdown;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::framed::{FramedLink, LinkOptions, Stream};
use crate::NetError;

impl Stream for UnixStream {
    fn try_clone(&self) -> io::Result<UnixStream> {
        UnixStream::try_clone(self)
    }

    fn shutdown(&self, how: Shutdown) -> io::Result<()> {
        UnixStream::shutdown(self, how)
    }

    fn set_read_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        UnixStream::set_read_timeout(self, timeout)
    }

    fn configure(&self, opts: &LinkOptions) -> io::Result<()> {
        crate::tcp::set_buffers(socket2::SockRef::from(self), opts)
    }
}

/// Connects to the socket at `path`; `addr` (`unix:PATH`) names it in errors. With a
/// `deadline`, the TLS handshake (and the link's reads until it is cleared) end by then.
pub(crate) fn connect(
    path: &Path,
    addr: &str,
    opts: &LinkOptions,
    deadline: Option<std::time::Instant>,
) -> Result<FramedLink<UnixStream>, NetError> {
    let stream = UnixStream::connect(path).map_err(|e| {
        use io::ErrorKind;
        let what = match e.kind() {
            ErrorKind::NotFound => "no socket at that path",
            ErrorKind::ConnectionRefused => "nothing listens on that socket (its worker has stopped)",
            ErrorKind::PermissionDenied => "this user may not open that socket",
            _ => "the connection failed",
        };
        NetError::Unreachable {
            peer: addr.to_string(),
            reason: format!("{what} ({e})"),
        }
    })?;
    FramedLink::connected(stream, addr.to_string(), opts, deadline)
}

/// The socket file a listener made; removed when dropped, unless another listener has
/// replaced it since.
#[derive(Debug)]
pub(crate) struct SocketFile {
    path: PathBuf,
    /// Device and inode of the file this listener made.
    id: (u64, u64),
}

impl Drop for SocketFile {
    fn drop(&mut self) {
        if let Ok(meta) = fs::symlink_metadata(&self.path) {
            if (meta.dev(), meta.ino()) == self.id {
                let _ = fs::remove_file(&self.path);
            }
        }
    }
}

/// Binds a listener at `path`; `addr` (`unix:PATH`) names it in errors. A stale socket
/// file (nothing accepts on it) is removed first; a live one, or a file that is not a
/// socket, is an error.
pub(crate) fn bind(path: &Path, addr: &str) -> Result<(UnixListener, SocketFile), NetError> {
    let error = |source| NetError::Bind {
        addr: addr.to_string(),
        source,
    };
    let listener = match UnixListener::bind(path) {
        Ok(listener) => listener,
        Err(e) if e.kind() == io::ErrorKind::AddrInUse => {
            remove_stale(path).map_err(error)?;
            UnixListener::bind(path).map_err(error)?
        }
        Err(e) => return Err(error(e)),
    };
    let meta = fs::symlink_metadata(path).map_err(error)?;
    let file = SocketFile {
        path: path.to_path_buf(),
        id: (meta.dev(), meta.ino()),
    };
    Ok((listener, file))
}

/// Removes the socket file at `path` if no process accepts connections on it.
fn remove_stale(path: &Path) -> io::Result<()> {
    let meta = fs::symlink_metadata(path)?;
    if !meta.file_type().is_socket() {
        return Err(io::Error::new(
            io::ErrorKind::AlreadyExists,
            "the path exists and is not a socket (baton leaves it alone)",
        ));
    }
    match UnixStream::connect(path) {
        Ok(_) => Err(io::Error::new(
            io::ErrorKind::AddrInUse,
            "another process listens on this socket",
        )),
        // Two workers reclaiming the same stale path at once could both get here; the
        // second would remove the first's new socket. Paths are per worker, so a race
        // means two workers were told to share one, which is an error anyway.
        Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => fs::remove_file(path),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests;
