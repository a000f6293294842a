//! The head's heartbeat on each worker: a connection of its own on which the head sends
//! `Ping` every quarter of the timeout and expects `Pong` within the timeout. A worker
//! that dies closes it at once; one that hangs (stopped, swapping, wedged in a driver)
//! stops answering, and either way the watch reports it lost.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use baton_net::{client_handshake, connect_by, Link, LinkOptions, NetError};
use baton_proto::{Message, Role};

use crate::NodeError;

pub use crate::engine::OnLost;

/// A running heartbeat; dropping it stops the pings, and the worker then ends the
/// session it was watching.
pub struct Watch {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Watch {
    /// Opens the heartbeat connection to `addr` and starts pinging it on behalf of
    /// `session` (the one the worker opened for this head: only that one ends when the
    /// pings stop).
    pub fn start(
        addr: &str,
        link: &LinkOptions,
        token: Option<&[u8]>,
        session: u64,
        timeout: Duration,
        on_lost: OnLost,
    ) -> Result<Watch, NodeError> {
        let opts = LinkOptions {
            read_timeout: Some(timeout),
            ..link.clone()
        };
        let mut conn = connect_by(addr, &opts, Instant::now() + timeout)?;
        client_handshake(conn.as_mut(), Role::Heartbeat, token)?;
        conn.set_deadline(None)?;
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let stop = stop.clone();
            let addr = addr.to_string();
            std::thread::Builder::new()
                .name("heartbeat".into())
                .spawn(move || {
                    if let Some(why) = beat(conn.as_mut(), session, timeout, &stop) {
                        if !stop.load(Ordering::SeqCst) {
                            on_lost(&addr, &why);
                        }
                    }
                })
                .map_err(|e| NodeError::Protocol(format!("cannot start a heartbeat thread: {e}")))?
        };
        Ok(Watch {
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // The thread notices within one interval; nobody needs to wait for it.
        drop(self.thread.take());
    }
}

/// Pings until stopped; returns why the worker is lost, if it is.
fn beat(conn: &mut dyn Link, session: u64, timeout: Duration, stop: &AtomicBool) -> Option<String> {
    let interval = timeout / 4;
    let timeout_ms = u32::try_from(timeout.as_millis()).unwrap_or(u32::MAX);
    while !stop.load(Ordering::SeqCst) {
        let sent = Instant::now();
        if let Err(e) = conn.send(Message::Ping { timeout_ms, session }) {
            return Some(format!("its heartbeat connection failed: {e}"));
        }
        match conn.recv() {
            Ok(Message::Pong) => {}
            Ok(other) => return Some(format!("it answered a heartbeat with {}", other.kind())),
            Err(NetError::Timeout { .. }) => {
                return Some(format!(
                    "it did not answer a heartbeat within {} ms",
                    timeout.as_millis()
                ))
            }
            Err(NetError::Closed { .. }) => return Some("it closed its heartbeat connection".into()),
            Err(e) => return Some(format!("its heartbeat connection failed: {e}")),
        }
        let next = sent + interval;
        while !stop.load(Ordering::SeqCst) && Instant::now() < next {
            std::thread::sleep(Duration::from_millis(20).min(interval));
        }
    }
    None
}
