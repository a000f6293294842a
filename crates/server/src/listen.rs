//! Accepting HTTP connections with limits a stranger cannot wear down: at most
//! `max_connections` at once (the next is answered 503 and closed, not left waiting), and
//! a deadline for each request's headers (a slow-header client is dropped). Bodies have
//! their own deadline where they are read ([`crate::api`]).
//!
//! HTTP/1.1 only, served by hyper with axum's router as the service.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;

/// What one server accepts.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Open connections at once.
    pub max_connections: usize,
    /// Longest a client may take to send a request's headers.
    pub header_timeout: Duration,
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
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    tokio::pin!(shutdown);
    loop {
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
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
        let Ok(permit) = permits.clone().try_acquire_owned() else {
            tokio::spawn(refuse(stream, limits.max_connections));
            continue;
        };
        let service = TowerToHyperService::new(app.clone());
        let connection = http1::Builder::new()
            .timer(TokioTimer::new())
            .header_read_timeout(limits.header_timeout)
            .serve_connection(TokioIo::new(stream), service);
        let connection = graceful.watch(connection);
        tokio::spawn(async move {
            let _ = connection.await;
            drop(permit);
        });
    }
    drop(listener);
    let _ = tokio::time::timeout(limits.shutdown_grace, graceful.shutdown()).await;
    Ok(())
}

/// Tells a client over the connection limit so, in OpenAI's error shape, and closes.
///
/// The close lingers: what the client goes on sending (its request) is read and
/// dropped until it closes too, for at most 2 s and 64 KiB. Closing with its request
/// unread would reset the connection, and a reset can reach the client before it has
/// read the answer, or fail its writes (seen in tests/http.rs as a broken pipe).
async fn refuse(mut stream: TcpStream, max: usize) {
    let body = serde_json::json!({"error": {
        "message": format!("the server has {max} connections open, its limit; retry later"),
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
