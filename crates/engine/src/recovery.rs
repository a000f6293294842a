//! The thread that forms a new ring after a loss: it asks the [`RingSource`] again and
//! again, with backoff, reporting each failure, until a ring forms or the engine stops.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use super::shell::Inbox;
use super::types::{OnLost, RingSource};

/// Hands `source` to a thread that forms ring number `gen`; it sends the result (and the
/// source back) to `inbox`, and gives up when `stop` is set.
pub(crate) fn start_forming(
    mut source: Box<dyn RingSource>,
    inbox: mpsc::Sender<Inbox>,
    gen: u64,
    stop: Arc<AtomicBool>,
) {
    let spawned = std::thread::Builder::new().name("recovery".into()).spawn(move || {
        let mut backoff = Duration::from_millis(200);
        loop {
            let span = tracing::info_span!("forming ring", gen);
            let formed = span.in_scope(|| source.form(lost_reporter(&inbox, gen)));
            match formed {
                Ok(formed) => {
                    let _ = inbox.send(Inbox::Formed(source, formed));
                    return;
                }
                Err(error) => {
                    tracing::warn!("cannot form a ring yet: {error:?}");
                    if inbox.send(Inbox::FormFailed(error)).is_err() {
                        return;
                    }
                }
            }
            let until = Instant::now() + backoff;
            while Instant::now() < until {
                if stop.load(Ordering::SeqCst) {
                    return;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            backoff = (backoff * 2).min(Duration::from_secs(5));
        }
    });
    if let Err(e) = spawned {
        tracing::error!("cannot start the recovery thread: {e}");
    }
}

/// Tells the engine that a node of ring `gen` is lost.
pub(crate) fn lost_reporter(inbox: &mpsc::Sender<Inbox>, gen: u64) -> OnLost {
    let inbox = inbox.clone();
    Arc::new(move |addr: &str, why: &str| {
        let _ = inbox.send(Inbox::Lost(gen, format!("worker {addr} was lost: {why}")));
    })
}
