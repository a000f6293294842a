//! The head's engine: many sequences in flight through the ring at once.
//!
//! Requests wait in a queue for a *slot* (a sequence id with its own share of every
//! stage's KV cache). Each step gathers work into a micro-batch: the next token of some
//! decoding sequences, or a chunk of a prompt. Several micro-batches travel the ring
//! at once, one per stage, so every stage has work: while the last stage samples for one
//! group of sequences, the first stage computes the next group, or the next chunk of a
//! long prompt. The ring is FIFO, so replies come back in the order steps were sent and
//! control messages (start, end) take effect exactly between the steps around them.
//!
//! A finished sequence's cache stays in its slot; a request whose prompt begins with
//! what a free slot holds (the next turn of a chat) reuses that prefix on every stage
//! and computes only the rest. A request whose client went away is ended on every stage.
//!
//! When the ring breaks (a node died, hung, or closed a link), an engine with a
//! [`RingSource`] forms a new ring over the nodes that remain and rebuilds every
//! running sequence on it: each one's tokens so far (prompt and generated) are sent
//! again in exactly the batches they first went in (prompt chunks alone, generated
//! tokens as single decode rows), so the new stages hold bit-identical caches, and the
//! last stage's sampler skips the random draws already made. Generation then goes on
//! where it was: a client sees neither a repeated nor a missing token. When no ring can
//! be formed (the nodes left cannot hold the model), running requests fail with a
//! clear error at once, and the engine waits for the lost node to come back.
//!
//! The engine drives a ring through its two ends ([`RingEnds`]); [`Head`] drives one
//! a request at a time, [`LocalRing`] is a ring of stages on threads of this process.
//!
//! Layout: [`types`] (what users see), `slots` (slots and the prefix cache), `batch`
//! (the pure choice of the next micro-batch), `core` (every decision, no I/O: time is an
//! argument, messages go to an outbox), `shell` (the engine thread: links, clock, the
//! ring reader) and `recovery` (the thread that forms a new ring).

#![deny(unsafe_code)]

mod batch;
mod core;
pub mod draft;
mod draft_model;
mod head;
mod local;
mod recovery;
mod shell;
mod slots;
mod text;
pub mod types;

#[cfg(test)]
mod tests;

use std::sync::atomic::Ordering;
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;

use tokio::sync::oneshot;

pub use baton_proto::Pooling;
pub use baton_stage::{max_decode_rows, MAX_DECODE_SEQS};
pub use draft::{Draft, DraftMode, Drafter};
pub use draft_model::ModelDrafter;
pub use head::{GenerateRequest, Generation, Head, RingEnds};
pub use local::LocalRing;
pub use text::{Piece, TextStream};
pub use types::{max_draft, prefix_reuse, PrefixReuse};
pub use types::{
    Better, Cause, Counters, EndCheck, EngineConfig, Event, Failure, Finish, FinishReason, FormError, Formed, Health,
    Job, OnLost, RingSource, StageStats, StatsError, SubmitError, TokenOut, Vocab, WorkerLink,
};

use self::core::Core;
use shell::{Inbox, Shell};

/// Makes a draft model for slots of the given number of tokens (`None`: no draft model),
/// or says why it cannot.
pub type DraftFor = Box<dyn FnOnce(usize) -> Result<Option<Box<dyn Drafter>>, String>>;

/// Why a supervised engine did not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// No first ring could be formed.
    #[error("{}", match .0 { FormError::Capacity(why) | FormError::Retry(why) => why })]
    Form(FormError),
    /// The draft model could not be made.
    #[error("{0}")]
    Draft(String),
}

/// The running engine; dropping it stops the ring.
pub struct Engine {
    inbox: mpsc::Sender<Inbox>,
    counters: Arc<Counters>,
    config: EngineConfig,
    health: Arc<Mutex<Health>>,
    workers: Arc<Mutex<Vec<WorkerLink>>>,
    thread: Option<JoinHandle<()>>,
}

impl Engine {
    /// Drives the ring whose ends are `ends`; if it breaks, every request fails.
    pub fn start(
        ends: RingEnds,
        vocab: Arc<dyn Vocab>,
        config: EngineConfig,
        draft_model: Option<Box<dyn Drafter>>,
    ) -> Engine {
        let formed = Formed {
            ends,
            stages: Vec::new(),
            lost: Vec::new(),
            workers: Vec::new(),
            n_ctx: None,
        };
        let (inbox, receiver) = mpsc::channel();
        Engine::launch(inbox, receiver, formed, None, vocab, config, draft_model)
    }

    /// Has `source` form the first ring and takes it over; when a node is lost,
    /// `source` forms the next one and running requests are rebuilt on it. The ring's
    /// context is chosen as it forms: `draft_model` makes the draft model (if any) for
    /// the tokens each slot then holds.
    pub fn start_supervised(
        mut source: Box<dyn RingSource>,
        vocab: Arc<dyn Vocab>,
        config: EngineConfig,
        draft_model: DraftFor,
    ) -> Result<Engine, StartError> {
        let (inbox, receiver) = mpsc::channel();
        let formed = source
            .form(recovery::lost_reporter(&inbox, 0))
            .map_err(StartError::Form)?;
        let slot_ctx = formed.n_ctx.map_or(config.slot_ctx, |n| n / config.n_slots.max(1));
        let draft_model = draft_model(slot_ctx).map_err(StartError::Draft)?;
        Ok(Engine::launch(
            inbox,
            receiver,
            formed,
            Some(source),
            vocab,
            config,
            draft_model,
        ))
    }

    fn launch(
        inbox: mpsc::Sender<Inbox>,
        receiver: mpsc::Receiver<Inbox>,
        formed: Formed,
        source: Option<Box<dyn RingSource>>,
        vocab: Arc<dyn Vocab>,
        config: EngineConfig,
        draft_model: Option<Box<dyn Drafter>>,
    ) -> Engine {
        let counters = Arc::new(Counters::default());
        let health = Arc::new(Mutex::new(Health::Serving {
            stages: formed.stages.clone(),
            lost: formed.lost.clone(),
        }));
        let mut config = config;
        if let Some(n_ctx) = formed.n_ctx {
            config.slot_ctx = n_ctx / config.n_slots.max(1);
        }
        let core = Core::new(
            config.clone(),
            vocab,
            source.is_some(),
            draft::Drafters { model: draft_model },
        );
        let workers = Arc::new(Mutex::new(Vec::new()));
        let outputs = (counters.clone(), health.clone());
        let mut shell = Shell::new(core, inbox.clone(), source, workers.clone(), outputs);
        shell.install(formed);
        let thread = std::thread::Builder::new()
            .name("engine".into())
            .spawn(move || shell.run(receiver))
            .expect("a thread can be started");
        Engine {
            inbox,
            counters,
            config,
            health,
            workers,
            thread: Some(thread),
        }
    }

    /// Queues a request; its events arrive on `job.events`.
    pub fn submit(&self, job: Job) -> Result<(), SubmitError> {
        if let Some(reason) = self.failure() {
            return Err(SubmitError::Unavailable(reason));
        }
        if job.prompt.is_empty() {
            return Err(SubmitError::EmptyPrompt);
        }
        if job
            .prompt
            .len()
            .checked_add(job.max_tokens)
            .is_none_or(|n| n > self.config.slot_ctx)
        {
            return Err(SubmitError::TooLong {
                slot_ctx: self.config.slot_ctx,
                prompt: job.prompt.len(),
                max_tokens: job.max_tokens,
            });
        }
        let queued = self.counters.queued.load(Ordering::Relaxed);
        let active = self.counters.active.load(Ordering::Relaxed);
        if active >= self.config.n_slots && queued >= self.config.max_queue {
            return Err(SubmitError::Overloaded { queued });
        }
        self.counters.queued.fetch_add(1, Ordering::Relaxed);
        self.inbox
            .send(Inbox::Job(Box::new(job)))
            .map_err(|_| SubmitError::Unavailable("the engine has stopped".into()))
    }

    /// Asks every stage for its resident bytes and KV cache use.
    pub async fn stage_stats(&self) -> Result<StageStats, StatsError> {
        let (reply, answer) = oneshot::channel();
        self.inbox.send(Inbox::Stats(reply)).map_err(|_| StatsError::Stopped)?;
        answer.await.map_err(|_| StatsError::Stopped)?
    }

    /// The engine's counters.
    pub fn counters(&self) -> &Counters {
        &self.counters
    }

    /// Tokens a request may hold (prompt plus generated).
    pub fn slot_ctx(&self) -> usize {
        self.config.slot_ctx
    }

    /// Width of the model's hidden state: the length of its embeddings.
    pub fn n_embd(&self) -> usize {
        self.config.n_embd
    }

    /// Sequences computed at once (`--parallel`).
    pub fn n_slots(&self) -> usize {
        self.config.n_slots
    }

    /// The latest round trip between the head and each worker of the ring, by address:
    /// the heartbeat's (until its first answer, the control link's handshake).
    pub fn heartbeats(&self) -> Vec<(String, Option<std::time::Duration>)> {
        let workers = self.workers.lock().unwrap_or_else(|p| p.into_inner());
        workers
            .iter()
            .map(|w| (w.addr.clone(), w.counters.round_trip()))
            .collect()
    }

    /// What the engine can do now.
    pub fn health(&self) -> Health {
        self.health.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Why the engine refuses new requests, if it does (a ring being formed again
    /// still takes them: they wait in the queue).
    pub fn failure(&self) -> Option<String> {
        match self.health() {
            Health::Serving { .. } | Health::Recovering { .. } => None,
            Health::Waiting { reason } | Health::Failed { reason } => Some(reason),
        }
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        let _ = self.inbox.send(Inbox::Shutdown);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}
