//! The head's heartbeat on each worker: a connection of its own on which the head sends
//! `Ping` every quarter of the timeout and expects `Pong` within the timeout. A worker
//! that dies closes it at once; one that hangs (stopped, swapping, wedged in a driver)
//! stops answering, and either way the watch reports it lost. Each answer's round trip
//! is recorded in the counters of the head's control link to the worker (the same path):
//! when that link carries the ring (into the first stage, back from the last), its
//! round trip stays current.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use baton_net::{client_handshake, connect_by, Counters, Link, LinkOptions};
use baton_proto::Role;

use baton_stage::NodeError;

pub use baton_engine::OnLost;
use baton_stage::probe::{ping, sleep_until};

/// A running heartbeat; dropping it stops the pings, and the worker then ends the
/// session it was watching.
pub struct Watch {
    addr: String,
    round_trip: Arc<Counters>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Watch {
    /// Opens the heartbeat connection to `addr` and starts pinging it on behalf of
    /// `session` (the one the worker opened for this head: only that one ends when the
    /// pings stop); each answer's round trip goes to `round_trip`.
    pub fn start(
        addr: &str,
        link: &LinkOptions,
        token: Option<&[u8]>,
        session: u64,
        timeout: Duration,
        round_trip: Arc<Counters>,
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
            let round_trip = round_trip.clone();
            std::thread::Builder::new()
                .name("heartbeat".into())
                .spawn(move || {
                    if let Some(why) = beat(conn.as_mut(), session, timeout, &round_trip, &stop) {
                        if !stop.load(Ordering::SeqCst) {
                            on_lost(&addr, &why);
                        }
                    }
                })
                .map_err(|e| NodeError::Protocol(format!("cannot start a heartbeat thread: {e}")))?
        };
        Ok(Watch {
            addr: addr.to_string(),
            round_trip,
            stop,
            thread: Some(thread),
        })
    }

    /// The worker's address.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// Where its round trips go (the head's control link's counters).
    pub fn round_trip(&self) -> Arc<Counters> {
        self.round_trip.clone()
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // The thread notices within one interval; nobody needs to wait for it.
        drop(self.thread.take());
    }
}

/// Pings until stopped, recording each round trip; returns why the worker is lost, if
/// it is.
fn beat(
    conn: &mut dyn Link,
    session: u64,
    timeout: Duration,
    round_trip: &Counters,
    stop: &AtomicBool,
) -> Option<String> {
    let interval = timeout / 4;
    while !stop.load(Ordering::SeqCst) {
        let sent = Instant::now();
        match ping(conn, session, timeout) {
            Ok(took) => round_trip.record_round_trip(took),
            Err(why) => return Some(why.to_string()),
        }
        sleep_until(sent + interval, stop);
    }
    None
}
