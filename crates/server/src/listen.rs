//! Accepting HTTP connections with limits a stranger cannot wear down: at most
//! `max_connections` at once and `per_source` from one source (an IPv4 address, an IPv6
//! /64), so one address cannot hold every connection; the next is answered 503 and
//! closed, not left waiting, by at most [`MAX_REFUSING`] refusals at once (more are
//! closed at once). A deadline for each request's headers (a slow-header client is
//! dropped) and for every write (a client that stops reading loses its connection).
//! Bodies have their own deadline where they are read ([`crate::api`]).
//!
//! HTTP/1.1 only, served by hyper with axum's router as the service.

use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio::time::Sleep;

/// Refusals (503 answers to connections over a limit) in progress at once; each reads
/// what the client goes on sending for up to 2 s. Past this, a refused connection is
/// closed at once.
pub const MAX_REFUSING: usize = 32;

/// What one server accepts.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Open connections at once.
    pub max_connections: usize,
    /// Open connections at once from one source (an IPv4 address, an IPv6 /64).
    pub per_source: usize,
    /// Longest a client may take to send a request's headers.
    pub header_timeout: Duration,
    /// Longest one write to a client may wait for it to read.
    pub write_timeout: Duration,
    /// Longest in-flight requests get to finish once shutdown starts.
    pub shutdown_grace: Duration,
}

/// Serves `app` on `listener` until `shutdown` completes.
///
/// Cancel safety: dropping the future stops accepting; connections already accepted
/// run on in their own tasks until they end.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: Limits,
    shutdown: impl Future<Output = ()>,
) -> std::io::Result<()> {
    let permits = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let refusing = Arc::new(Semaphore::new(MAX_REFUSING));
    let sources = Arc::new(Sources::default());
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    tokio::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                // Out of file descriptors and the like: wait, do not spin.
                Err(e) => {
                    tracing::warn!("accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let _ = stream.set_nodelay(true);
        let source = baton_net::source_of(&peer);
        let held = sources.take(&source, limits.per_source.max(1));
        let permit = permits.clone().try_acquire_owned();
        let (Some(held), Ok(permit)) = (held, permit) else {
            let why = match permits.available_permits() {
                0 => format!("the server has {} connections open, its limit", limits.max_connections),
                _ => format!(
                    "{source} has {} connections open, the most one address may hold",
                    limits.per_source
                ),
            };
            match refusing.clone().try_acquire_owned() {
                Ok(refusal) => {
                    tokio::spawn(async move {
                        refuse(stream, &why).await;
                        drop(refusal);
                    });
                }
                Err(_) => tracing::debug!(%peer, "closing a connection at once: {why}"),
            }
            continue;
        };
        // Handlers that need the client's address (a worker joining) find it in each
        // request's extensions: one small wrapper per connection around the router.
        let app = tower_layer::Layer::layer(&axum::Extension(axum::extract::ConnectInfo(peer)), app.clone());
        let service = TowerToHyperService::new(app);
        let connection = http1::Builder::new()
            .timer(TokioTimer::new())
            .header_read_timeout(limits.header_timeout)
            .serve_connection(TokioIo::new(WriteDeadline::new(stream, limits.write_timeout)), service);
        let connection = graceful.watch(connection);
        tokio::spawn(async move {
            let _ = connection.await;
            drop((permit, held));
        });
    }
    drop(listener);
    let _ = tokio::time::timeout(limits.shutdown_grace, graceful.shutdown()).await;
    Ok(())
}

/// Tells a client over a connection limit why, in OpenAI's error shape, and closes.
///
/// The close lingers: what the client goes on sending (its request) is read and
/// dropped until it closes too, for at most 2 s and 64 KiB. Closing with its request
/// unread would reset the connection, and a reset can reach the client before it has
/// read the answer, or fail its writes (seen in tests/http.rs as a broken pipe).
async fn refuse(mut stream: TcpStream, why: &str) {
    let body = serde_json::json!({"error": {
        "message": format!("{why}; retry later"),
        "type": "server_error", "param": null, "code": "too_many_connections"}})
    .to_string();
    let response = format!(
        "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\
         Retry-After: 1\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = tokio::time::timeout(Duration::from_secs(2), async {
        let _ = stream.write_all(response.as_bytes()).await;
        let _ = stream.shutdown().await;
        let mut sink = [0u8; 4096];
        let mut left = 64usize << 10;
        while left > 0 {
            match stream.read(&mut sink).await {
                Ok(0) | Err(_) => break,
                Ok(n) => left = left.saturating_sub(n),
            }
        }
    })
    .await;
}

/// Open connections per source.
#[derive(Default)]
struct Sources(Mutex<HashMap<String, usize>>);

/// One connection counted against its source; uncounted when dropped.
struct SourceHeld {
    sources: Arc<Sources>,
    source: String,
}

impl Sources {
    /// Counts a connection from `source`, unless it holds `most` already.
    fn take(self: &Arc<Self>, source: &str, most: usize) -> Option<SourceHeld> {
        let mut open = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let count = open.entry(source.to_string()).or_default();
        if *count >= most {
            return None;
        }
        *count += 1;
        Some(SourceHeld {
            sources: self.clone(),
            source: source.to_string(),
        })
    }
}

impl Drop for SourceHeld {
    fn drop(&mut self) {
        let mut open = self.sources.0.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(count) = open.get_mut(&self.source) {
            *count -= 1;
            if *count == 0 {
                open.remove(&self.source);
            }
        }
    }
}

/// A stream whose writes fail with `TimedOut` when the peer reads nothing for
/// `timeout`: a client that stops reading a response (a stream of tokens, say) would
/// otherwise hold its connection, and the request's slot, for ever.
struct WriteDeadline<S> {
    inner: S,
    timeout: Duration,
    /// Armed while a write waits on the peer.
    waiting: Option<Pin<Box<Sleep>>>,
}

impl<S> WriteDeadline<S> {
    fn new(inner: S, timeout: Duration) -> WriteDeadline<S> {
        WriteDeadline {
            inner,
            timeout,
            waiting: None,
        }
    }

    /// What a write that returned `poll` means, with the deadline applied.
    fn deadline<T>(&mut self, cx: &mut Context<'_>, poll: Poll<io::Result<T>>) -> Poll<io::Result<T>> {
        if poll.is_ready() {
            self.waiting = None;
            return poll;
        }
        let timeout = self.timeout;
        let sleep = self
            .waiting
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(timeout)));
        match sleep.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("the client read nothing for {} s", timeout.as_secs_f32()),
            ))),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for WriteDeadline<S> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for WriteDeadline<S> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let poll = Pin::new(&mut self.inner).poll_write(cx, buf);
        self.deadline(cx, poll)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let poll = Pin::new(&mut self.inner).poll_flush(cx);
        self.deadline(cx, poll)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let poll = Pin::new(&mut self.inner).poll_shutdown(cx);
        self.deadline(cx, poll)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let poll = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        self.deadline(cx, poll)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A client that stops reading: the server's writes fill the socket's buffers, and
    /// the write that finds them full fails after the deadline instead of waiting.
    #[tokio::test]
    async fn a_write_the_peer_never_reads_fails_at_the_deadline() {
        let (ours, _theirs) = tokio::io::duplex(1024);
        let mut stream = WriteDeadline::new(ours, Duration::from_millis(200));
        let started = std::time::Instant::now();
        let chunk = vec![7u8; 4096];
        let err = loop {
            if let Err(e) = stream.write_all(&chunk).await {
                break e;
            }
        };
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        let waited = started.elapsed();
        assert!(
            waited >= Duration::from_millis(200) && waited < Duration::from_secs(5),
            "{waited:?}"
        );
    }

    #[test]
    fn each_source_holds_at_most_its_share_and_gets_it_back() {
        let sources = Arc::new(Sources::default());
        let held: Vec<_> = (0..3).map(|_| sources.take("10.0.0.1", 3).unwrap()).collect();
        assert!(sources.take("10.0.0.1", 3).is_none());
        assert!(sources.take("10.0.0.2", 3).is_some(), "another source is not affected");
        drop(held);
        assert!(sources.take("10.0.0.1", 3).is_some());
        assert!(
            sources.0.lock().unwrap().get("10.0.0.2").is_none(),
            "emptied sources are forgotten"
        );
    }
}
