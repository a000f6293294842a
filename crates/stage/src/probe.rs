//! Keeps a ring link's round trip current. A ring link carries frames one way only, so
//! nothing on it can be timed after its handshake; the stage that dialed it opens a
//! heartbeat connection of its own to the same address and times a `Ping` every
//! [`PROBE_INTERVAL`], recording each round trip in the ring link's counters. The probe
//! is bare (it names no session, so it ends nothing on the next stage), takes the path
//! the hidden states take (whatever relays it), and costs one small frame each way per
//! interval.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use baton_net::{client_handshake, connect_by, Counters, Link, LinkExt, LinkOptions, NetError};
use baton_proto::{Conversation, Heartbeat, RefusalCode, Role};

/// Time between two probes.
const PROBE_INTERVAL: Duration = Duration::from_secs(2);

/// Longest a probe (connecting included) may wait for its answer; the next stage is
/// told to expect the next ping within this too.
const PROBE_TIMEOUT: Duration = Duration::from_secs(6);

/// A running probe; dropping it stops the probing (within a moment, or at the end of a
/// ping still waiting for its answer).
pub struct LinkProbe {
    stop: Arc<AtomicBool>,
}

impl LinkProbe {
    /// Starts probing `addr` (the address the ring link was dialed at, with the same
    /// link options and token) on a thread of its own, recording round trips in
    /// `counters` (the ring link's). A probe that cannot connect or gets no answer
    /// leaves the last figure and tries again an interval later.
    pub fn start(addr: &str, link: &LinkOptions, token: Option<&[u8]>, counters: Arc<Counters>) -> LinkProbe {
        let stop = Arc::new(AtomicBool::new(false));
        let probe = Probe {
            addr: addr.to_string(),
            opts: LinkOptions {
                read_timeout: Some(PROBE_TIMEOUT),
                ..link.clone()
            },
            token: token.map(<[u8]>::to_vec),
            counters,
            stop: stop.clone(),
        };
        let spawned = std::thread::Builder::new()
            .name("link-probe".into())
            .spawn(move || probe.run());
        if let Err(e) = spawned {
            tracing::warn!(%addr, "cannot start a thread to probe the link: {e}");
        }
        LinkProbe { stop }
    }
}

impl Drop for LinkProbe {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

/// What the probe's thread holds.
struct Probe {
    addr: String,
    opts: LinkOptions,
    token: Option<Vec<u8>>,
    counters: Arc<Counters>,
    stop: Arc<AtomicBool>,
}

impl Probe {
    fn run(self) {
        while !self.stop.load(Ordering::SeqCst) {
            let started = Instant::now();
            if let Err(why) = self.probe_until_failure() {
                tracing::debug!(addr = %self.addr, "probing the ring link: {why}");
            }
            sleep_until(started + PROBE_INTERVAL, &self.stop);
        }
    }

    /// Connects and pings every interval until stopped or until something fails.
    fn probe_until_failure(&self) -> Result<(), ProbeError> {
        let mut conn = connect_by(&self.addr, &self.opts, Instant::now() + PROBE_TIMEOUT)?;
        client_handshake(conn.as_mut(), Role::Heartbeat, self.token.as_deref())?;
        conn.set_deadline(None)?;
        while !self.stop.load(Ordering::SeqCst) {
            let sent = Instant::now();
            // Session 0 is never a session: the next stage answers and ends nothing.
            let took = ping(conn.as_mut(), 0, PROBE_TIMEOUT)?;
            self.counters.record_round_trip(took);
            sleep_until(sent + PROBE_INTERVAL, &self.stop);
        }
        Ok(())
    }
}

/// Why a probe stopped: its connection could not be opened, or a ping failed.
#[derive(Debug, thiserror::Error)]
enum ProbeError {
    #[error(transparent)]
    Connect(#[from] NetError),
    #[error(transparent)]
    Ping(#[from] PingError),
}

/// Why a worker did not answer a heartbeat ([`ping`]); the text is what the head says
/// of a lost worker.
#[derive(Debug, thiserror::Error)]
pub enum PingError {
    /// The heartbeat connection failed (sending, or reading the answer).
    #[error("its heartbeat connection failed: {0}")]
    Link(#[source] NetError),
    /// The worker refused the heartbeat (it is leaving, say, or knows no such session).
    #[error("{reason}")]
    Refused { code: RefusalCode, reason: String },
    /// The worker answered with another message (named).
    #[error("it answered a heartbeat with {0}")]
    Unexpected(&'static str),
    /// No answer came within the timeout.
    #[error("it did not answer a heartbeat within {} ms", .0.as_millis())]
    Timeout(Duration),
    /// The worker closed the heartbeat connection.
    #[error("it closed its heartbeat connection")]
    Closed,
}

/// One heartbeat on `conn`: a `Ping` for `session` telling the worker to expect the
/// next within `timeout`, and its `Pong`; returns the round trip, or why the worker
/// did not answer.
pub fn ping(conn: &mut dyn Link, session: u64, timeout: Duration) -> Result<Duration, PingError> {
    let timeout_ms = u32::try_from(timeout.as_millis()).map_or(baton_proto::MAX_HEARTBEAT_MS, |ms| {
        ms.min(baton_proto::MAX_HEARTBEAT_MS)
    });
    let sent = Instant::now();
    conn.send(Heartbeat::Ping { timeout_ms, session }.into())
        .map_err(PingError::Link)?;
    match conn.recv_as::<Heartbeat>() {
        Ok(Heartbeat::Pong) => Ok(sent.elapsed()),
        Ok(Heartbeat::Refused { code, reason }) => Err(PingError::Refused { code, reason }),
        Ok(other) => Err(PingError::Unexpected(other.kind())),
        Err(NetError::Timeout { .. }) => Err(PingError::Timeout(timeout)),
        Err(NetError::Closed { .. }) => Err(PingError::Closed),
        Err(e) => Err(PingError::Link(e)),
    }
}

/// Sleeps until `until`, or until `stop` is set (checked every 20 ms).
pub fn sleep_until(until: Instant, stop: &AtomicBool) {
    while !stop.load(Ordering::SeqCst) {
        let left = until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return;
        }
        std::thread::sleep(left.min(Duration::from_millis(20)));
    }
}

#[cfg(test)]
mod tests {
    use baton_net::local_pair;
    use baton_proto::Message;

    use super::*;

    #[test]
    fn a_ping_tells_a_refusal_from_silence_and_from_an_answer() {
        let (mut head, mut worker) = local_pair("head", "worker");
        worker.send(Heartbeat::Pong.into()).unwrap();
        assert!(ping(&mut head, 3, Duration::from_secs(5)).is_ok());

        worker
            .send(
                Heartbeat::Refused {
                    code: RefusalCode::Leaving,
                    reason: "this worker is leaving".into(),
                }
                .into(),
            )
            .unwrap();
        let err = ping(&mut head, 3, Duration::from_secs(5)).unwrap_err();
        assert!(
            matches!(
                err,
                PingError::Refused {
                    code: RefusalCode::Leaving,
                    ..
                }
            ),
            "{err:?}"
        );
        assert_eq!(err.to_string(), "this worker is leaving");

        head.set_read_timeout(Some(Duration::from_millis(20))).unwrap();
        let err = ping(&mut head, 3, Duration::from_millis(20)).unwrap_err();
        assert!(matches!(err, PingError::Timeout(_)), "{err:?}");
        assert_eq!(err.to_string(), "it did not answer a heartbeat within 20 ms");
        // Every ping reached the worker.
        for _ in 0..3 {
            assert!(matches!(worker.recv().unwrap(), Message::Ping { session: 3, .. }));
        }
    }
}
