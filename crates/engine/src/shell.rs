//! The engine thread: the only place where the engine meets links, the clock and other
//! threads. It feeds what happens to the [`Core`] and carries out what the core asks.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Instant;

use baton_net::{NetError, Rx, RxExt, Tx};
use baton_proto::Ring;
use tokio::sync::oneshot;

use super::core::{Action, Core, EndCounters, POLL_INTERVAL};
use super::recovery::start_forming;
use super::types::{Counters, FormError, Formed, Health, Job, RingSource, StageStats, StatsError, WorkerLink};

/// What reaches the engine thread.
pub(crate) enum Inbox {
    Job(Box<Job>),
    Stats(oneshot::Sender<Result<StageStats, StatsError>>),
    /// A reply from the ring formed `gen`-th.
    Reply(u64, Result<Ring, NetError>),
    /// A node of ring `gen` stopped answering.
    Lost(u64, String),
    /// The recovery thread formed a ring (and hands the source back).
    Formed(Box<dyn RingSource>, Formed),
    /// The recovery thread could not form a ring yet (it keeps trying).
    FormFailed(FormError),
    Shutdown,
}

/// The engine thread's state around the core.
pub(crate) struct Shell {
    core: Core,
    /// The first stage's end of the current ring (`None` while none is formed).
    tx: Option<Box<dyn Tx>>,
    inbox: mpsc::Sender<Inbox>,
    /// Forms new rings; `None` for an in-process ring, or while a recovery thread
    /// holds it.
    source: Option<Box<dyn RingSource>>,
    /// Tells a recovery thread to give up (the engine is stopping).
    stop_recovery: Arc<AtomicBool>,
    /// The current ring's workers, shared with the [`Engine`](super::Engine).
    workers: Arc<Mutex<Vec<WorkerLink>>>,
    /// Where the core's outputs go: the counters and health the engine's users read.
    counters: Arc<Counters>,
    health: Arc<Mutex<Health>>,
}

impl Shell {
    pub fn new(
        core: Core,
        inbox: mpsc::Sender<Inbox>,
        source: Option<Box<dyn RingSource>>,
        workers: Arc<Mutex<Vec<WorkerLink>>>,
        (counters, health): (Arc<Counters>, Arc<Mutex<Health>>),
    ) -> Shell {
        Shell {
            core,
            tx: None,
            inbox,
            source,
            stop_recovery: Arc::default(),
            workers,
            counters,
            health,
        }
    }

    /// Takes `formed` as the current ring: starts reading its replies, and has the core
    /// rebuild every running sequence on it.
    pub fn install(&mut self, formed: Formed) {
        let Formed {
            ends,
            stages,
            lost,
            workers,
            n_ctx: _,
        } = formed;
        let counters = EndCounters {
            into_first: ends.tx.counters(),
            from_last: ends.rx.counters(),
        };
        spawn_reader(ends.rx, self.inbox.clone(), self.core.gen());
        self.tx = Some(ends.tx);
        *self.workers.lock().unwrap_or_else(|p| p.into_inner()) = workers;
        let n_stages = stages.len();
        tracing::info!(gen = self.core.gen(), ?stages, "ring installed");
        self.core
            .installed(n_stages, Health::Serving { stages, lost }, counters, Instant::now());
        self.carry_out();
    }

    /// Runs until the engine is dropped (and the ring has shut down).
    pub fn run(&mut self, inbox: mpsc::Receiver<Inbox>) {
        loop {
            let msg = match inbox.recv_timeout(POLL_INTERVAL) {
                Ok(msg) => Some(msg),
                Err(mpsc::RecvTimeoutError::Timeout) => None,
                Err(mpsc::RecvTimeoutError::Disconnected) => return,
            };
            let now = Instant::now();
            let stopping = self.core.stopping();
            match msg {
                Some(Inbox::Job(job)) => self.core.submit(job),
                Some(Inbox::Stats(reply)) => self.core.stats(reply, now),
                Some(Inbox::Reply(gen, reply)) if gen == self.core.gen() => match reply {
                    Ok(Ring::Shutdown) if stopping => return,
                    Ok(reply) => self.core.reply(gen, reply, now),
                    Err(_) if stopping => return,
                    Err(e) => self.core.lost(gen, &format!("the ring broke: {e}"), now),
                },
                Some(Inbox::Lost(gen, why)) => self.core.lost(gen, &why, now),
                Some(Inbox::Reply(..)) => {}
                Some(Inbox::Formed(source, formed)) => {
                    self.source = Some(source);
                    if stopping {
                        return;
                    }
                    self.install(formed);
                }
                Some(Inbox::FormFailed(error)) => self.core.form_failed(error),
                Some(Inbox::Shutdown) => {
                    self.stop_recovery.store(true, Ordering::SeqCst);
                    self.core.shutdown(now);
                    self.carry_out();
                    if !self.core.connected() {
                        return;
                    }
                }
                None => {}
            }
            let better = self.source.as_ref().and_then(|s| s.better());
            self.core.poll(now, better);
            self.carry_out();
        }
    }

    /// Does what the core asked, feeding failures back to it until nothing is left,
    /// and delivers what it told (tokens to clients, counters, health).
    fn carry_out(&mut self) {
        loop {
            let actions = self.core.actions();
            if actions.is_empty() {
                self.deliver();
                return;
            }
            for action in actions {
                match action {
                    Action::Send(msg) => {
                        let Some(tx) = self.tx.as_mut() else { continue };
                        if let Err(e) = tx.send(msg.into()) {
                            self.core.send_failed(&e.to_string(), Instant::now());
                            // The core has dropped the rest; its new actions follow.
                            break;
                        }
                    }
                    Action::FormRing { gen } => {
                        // Dropping the first stage's end closes the old ring.
                        self.tx = None;
                        if let Some(source) = self.source.take() {
                            start_forming(source, self.inbox.clone(), gen, self.stop_recovery.clone());
                        }
                    }
                }
            }
            self.deliver();
        }
    }

    /// Delivers the core's outputs, in the order it gave them.
    fn deliver(&mut self) {
        for output in self.core.outputs() {
            output.deliver(&self.counters, &self.health);
        }
    }
}

/// Reads the replies of ring `gen` into the engine's inbox until the ring closes.
fn spawn_reader(mut rx: Box<dyn Rx>, inbox: mpsc::Sender<Inbox>, gen: u64) {
    let reader_inbox = inbox.clone();
    let spawned = std::thread::Builder::new()
        .name("ring-reader".into())
        .spawn(move || loop {
            let inbox = &reader_inbox;
            let reply = rx.recv_as::<Ring>();
            let last = !matches!(reply, Ok(ref m) if !matches!(m, Ring::Shutdown));
            if inbox.send(Inbox::Reply(gen, reply)).is_err() || last {
                return;
            }
        });
    if let Err(e) = spawned {
        let _ = inbox.send(Inbox::Lost(gen, format!("cannot start the ring reader: {e}")));
    }
}
