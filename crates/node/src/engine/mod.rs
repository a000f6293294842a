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

mod text;

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use baton_ggml::LlamaModel;
use baton_net::{Rx, Tx};
use baton_proto::{Forward, Message, Payload, SampledToken};
use baton_sample::SamplingParams;
use tokio::sync::{mpsc::UnboundedSender, oneshot};

pub use text::{Piece, TextStream};

use crate::head::Head;

/// How the engine shares the ring.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Sequences computed at once (`--parallel`).
    pub n_slots: usize,
    /// KV cache cells per slot: prompt plus generated tokens of one request.
    pub slot_ctx: usize,
    /// Most prompt tokens per micro-batch; a longer prompt goes in chunks back to back.
    pub chunk: usize,
    /// Stages in the ring: decoding sequences are split into this many groups.
    pub n_stages: usize,
    /// Most decode rows in one micro-batch: as many as ggml computes with the kernel it
    /// uses for a single row, so that a sequence generates the same beside others as
    /// alone ([`max_decode_rows`]).
    pub max_decode_rows: usize,
    /// Requests allowed to wait for a slot before new ones are refused.
    pub max_queue: usize,
    /// Longest the engine tries to form a new ring after losing a node before running
    /// requests fail (it keeps trying for new ones).
    pub recovery_timeout: Duration,
    /// Longest the ring may take to answer one message before it counts as broken
    /// (a stage stuck in its computation, which heartbeats do not see).
    pub step_timeout: Duration,
}

/// Called (from any thread) with a node's address and why it is lost.
pub type OnLost = Arc<dyn Fn(&str, &str) + Send + Sync>;

/// Forms rings for the engine: once at the start, and again whenever a node is lost.
pub trait RingSource: Send {
    /// Closes the current ring, if any, and forms a new one over the nodes that answer
    /// now. `on_lost` is called when a node of the new ring stops answering.
    fn form(&mut self, on_lost: OnLost) -> Result<Formed, FormError>;
    /// Whether a node that was lost answers again (a better ring may be formed).
    fn returned(&self) -> bool;
}

/// A ring just formed.
pub struct Formed {
    /// Its two ends.
    pub head: Head,
    /// Each stage, in ring order, described for people (node and layers).
    pub stages: Vec<String>,
    /// Nodes out of the ring because they were lost, and why.
    pub lost: Vec<(String, String)>,
}

/// Why no ring could be formed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FormError {
    /// The nodes that answer cannot hold the model: nothing runs until one returns.
    Capacity(String),
    /// Something else failed; trying again may work.
    Retry(String),
}

/// What the engine can do now, for `/health` and the logs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Health {
    /// Computing over these stages; `lost` nodes are out of the ring.
    Serving {
        /// Each stage (node and layers).
        stages: Vec<String>,
        /// Nodes lost and why.
        lost: Vec<(String, String)>,
    },
    /// A node was lost; a new ring is being formed, running requests wait.
    Recovering {
        /// What was lost.
        reason: String,
    },
    /// No ring can be formed until a lost node returns; requests are refused.
    Waiting {
        /// Why, and what is awaited.
        reason: String,
    },
    /// The ring broke and cannot be formed again (an in-process ring).
    Failed {
        /// Why.
        reason: String,
    },
}

/// One request for the engine.
#[derive(Debug)]
pub struct Job {
    /// Prompt tokens (not empty).
    pub prompt: Vec<u32>,
    /// Sampler settings.
    pub params: SamplingParams,
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// Report each token's log-probability.
    pub logprobs: bool,
    /// And this many alternatives (with `logprobs`).
    pub top_logprobs: u8,
    /// Generation stops before any of these strings; they are never sent.
    pub stop: Vec<String>,
    /// Where the engine reports; dropping the receiver cancels the request.
    pub events: UnboundedSender<Event>,
}

/// What the engine reports about a request.
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    /// A generated token and the text it releases (possibly empty: text that could
    /// still become a stop string, or half a character, waits for later tokens).
    Token(TokenOut),
    /// The request ended normally.
    Finished(Finish),
    /// The request failed.
    Failed(String),
}

/// One generated token.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenOut {
    /// Token id.
    pub id: u32,
    /// Text released with this token.
    pub text: String,
    /// Log-probability (NaN unless asked for).
    pub logprob: f32,
    /// Best alternatives with their log-probabilities.
    pub top: Vec<(u32, f32)>,
}

/// Why generation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-generation token or a stop string.
    Stop,
    /// `max_tokens` reached.
    Length,
}

/// The end of a request.
#[derive(Clone, Debug, PartialEq)]
pub struct Finish {
    /// Why it ended.
    pub reason: FinishReason,
    /// Text held back until the end (a possible stop string that did not complete).
    pub tail: String,
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Prompt tokens whose cache was reused instead of computed.
    pub cached_tokens: usize,
    /// Generated tokens (an end-of-generation token is not counted).
    pub completion_tokens: usize,
}

/// Why a request is refused before it starts.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SubmitError {
    /// Prompt plus `max_tokens` do not fit a slot.
    #[error(
        "this model's context per sequence is {slot_ctx} tokens, but the request needs {prompt} prompt \
         tokens plus {max_tokens} to generate"
    )]
    TooLong {
        slot_ctx: usize,
        prompt: usize,
        max_tokens: usize,
    },
    /// The prompt has no tokens.
    #[error("the prompt is empty")]
    EmptyPrompt,
    /// Every slot is busy and the queue is full.
    #[error("the server is overloaded: {queued} requests are already waiting; retry later")]
    Overloaded { queued: usize },
    /// The ring failed; nothing can be computed.
    #[error("the cluster is unavailable: {0}")]
    Unavailable(String),
}

/// Counters a test or an operator can read at any time.
#[derive(Debug, Default)]
pub struct Counters {
    /// Prompt tokens computed on the stages.
    pub prompt_tokens_computed: AtomicU64,
    /// Prompt tokens whose cache was reused.
    pub prompt_tokens_reused: AtomicU64,
    /// Tokens generated.
    pub completion_tokens: AtomicU64,
    /// Requests that finished normally.
    pub requests_finished: AtomicU64,
    /// Requests ended because their client went away.
    pub requests_cancelled: AtomicU64,
    /// Requests that failed.
    pub requests_failed: AtomicU64,
    /// Micro-batches sent into the ring.
    pub steps: AtomicU64,
    /// Sequences being computed now.
    pub active: AtomicUsize,
    /// Requests waiting for a slot.
    pub queued: AtomicUsize,
    /// Rings formed after the first (a node lost, or back).
    pub rings_formed: AtomicU64,
    /// Tokens computed again to rebuild sequences on a new ring.
    pub tokens_replayed: AtomicU64,
}

/// Per-stage figures, in ring order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StageStats {
    /// Resident bytes.
    pub resident: Vec<u64>,
    /// KV cache cells holding a token.
    pub kv_used: Vec<u32>,
}

enum Inbox {
    Job(Box<Job>),
    Stats(oneshot::Sender<Result<StageStats, String>>),
    /// A reply from the ring formed `gen`-th.
    Reply(u64, Result<Message, String>),
    /// A node of ring `gen` stopped answering.
    Lost(u64, String),
    /// The recovery thread formed a ring (and hands the source back).
    Formed(Box<dyn RingSource>, Formed),
    /// The recovery thread could not form a ring yet (it keeps trying).
    FormFailed(FormError),
    Shutdown,
}

/// The running engine; dropping it stops the ring.
pub struct Engine {
    inbox: mpsc::Sender<Inbox>,
    counters: Arc<Counters>,
    config: EngineConfig,
    health: Arc<Mutex<Health>>,
    thread: Option<JoinHandle<()>>,
}

impl Engine {
    /// Takes over `head`'s ring; if it breaks, every request fails.
    pub fn start(head: Head, vocab: Arc<LlamaModel>, config: EngineConfig) -> Engine {
        let formed = Formed {
            head,
            stages: Vec::new(),
            lost: Vec::new(),
        };
        let (inbox, receiver) = mpsc::channel();
        Engine::launch(inbox, receiver, formed, None, vocab, config)
    }

    /// Has `source` form the first ring and takes it over; when a node is lost,
    /// `source` forms the next one and running requests are rebuilt on it.
    pub fn start_supervised(
        mut source: Box<dyn RingSource>,
        vocab: Arc<LlamaModel>,
        config: EngineConfig,
    ) -> Result<Engine, FormError> {
        let (inbox, receiver) = mpsc::channel();
        let formed = source.form(lost_reporter(&inbox, 0))?;
        Ok(Engine::launch(inbox, receiver, formed, Some(source), vocab, config))
    }

    fn launch(
        inbox: mpsc::Sender<Inbox>,
        receiver: mpsc::Receiver<Inbox>,
        formed: Formed,
        source: Option<Box<dyn RingSource>>,
        vocab: Arc<LlamaModel>,
        config: EngineConfig,
    ) -> Engine {
        let counters = Arc::new(Counters::default());
        let health = Arc::new(Mutex::new(Health::Serving {
            stages: formed.stages.clone(),
            lost: formed.lost.clone(),
        }));
        let mut sched = Sched::new(
            inbox.clone(),
            vocab,
            config.clone(),
            counters.clone(),
            health.clone(),
            source,
        );
        sched.install(formed);
        let thread = std::thread::Builder::new()
            .name("engine".into())
            .spawn(move || sched.run(receiver))
            .expect("a thread can be started");
        Engine {
            inbox,
            counters,
            config,
            health,
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
    pub async fn stage_stats(&self) -> Result<StageStats, String> {
        let (reply, answer) = oneshot::channel();
        self.inbox
            .send(Inbox::Stats(reply))
            .map_err(|_| "the engine has stopped".to_string())?;
        answer.await.map_err(|_| "the engine has stopped".to_string())?
    }

    /// The engine's counters.
    pub fn counters(&self) -> &Counters {
        &self.counters
    }

    /// Tokens a request may hold (prompt plus generated).
    pub fn slot_ctx(&self) -> usize {
        self.config.slot_ctx
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

/// A sequence id with its share of the KV cache.
struct Slot {
    /// Tokens whose cache every stage holds for this slot (when no request runs in it).
    cached: Vec<u32>,
    /// The batches `cached` went into the ring in (token counts, in order).
    cached_runs: Vec<u32>,
    /// When it was last given out (for least-recently-used choice).
    last_used: u64,
    active: Option<Active>,
}

/// A request running in a slot.
struct Active {
    /// Distinguishes this request from earlier ones in the same slot (stale replies).
    epoch: u64,
    job: Box<Job>,
    /// Prompt, then generated tokens.
    tokens: Vec<u32>,
    n_prompt: usize,
    n_reused: usize,
    /// Tokens sent into the ring (their cache exists once the steps are through).
    n_sent: usize,
    /// How many tokens each send carried, covering `tokens[..n_sent]`: what a rebuild
    /// on a new ring repeats, batch for batch.
    runs: Vec<u32>,
    /// Sends still to repeat after a rebuild.
    replay: VecDeque<u32>,
    /// A row of this sequence that will be sampled is in the ring.
    waiting: bool,
    generated: usize,
    text: TextStream,
    /// Step counter when this sequence last went into a batch (fairness).
    last_batch: u64,
}

impl Active {
    /// What the sequence sends next, if anything: `(tokens, alone)`. A prompt chunk
    /// (or a repeated one) goes alone in its micro-batch; a single token goes as a
    /// decode row beside other sequences' rows.
    fn next_send(&self, chunk: usize) -> Option<(usize, bool)> {
        if self.waiting || self.n_sent >= self.tokens.len() {
            return None;
        }
        if let Some(&n) = self.replay.front() {
            return Some((n as usize, n > 1));
        }
        if self.n_sent < self.n_prompt {
            return Some((chunk.min(self.n_prompt - self.n_sent), true));
        }
        Some((1, false))
    }

    fn decoding(&self) -> bool {
        match self.replay.front() {
            Some(&n) => n == 1,
            None => self.n_sent >= self.n_prompt,
        }
    }
}

/// Most decode rows in one micro-batch that ggml computes exactly as it computes one
/// row alone. With weights repacked for the CPU (`CPU_REPACK`, the default) ggml takes
/// its 4-row gemm kernel from 4 rows on (ggml-cpu/repack.cpp: "more than three rows in
/// src1, use gemm"); on plain quantized weights the tiled kernel for K-quants starts at 8
/// rows. Either rounds differently from the one-row kernel, and a sequence would then
/// generate differently in company than alone.
pub fn max_decode_rows(repack: bool) -> usize {
    if repack {
        3
    } else {
        7
    }
}

/// A message in the ring, waiting for its reply.
enum Pending {
    Control,
    Stats(oneshot::Sender<Result<StageStats, String>>),
    /// A micro-batch: `(slot, epoch, sampled)` per sequence in it.
    Step(Vec<(usize, u64, bool)>),
    Shutdown,
}

/// A ring being formed again.
struct Recovery {
    since: Instant,
    reason: String,
    /// Running requests were already failed (no capacity, or out of time).
    gave_up: bool,
}

struct Sched {
    /// The first stage's end of the current ring (`None` while none is formed).
    tx: Option<Box<dyn Tx>>,
    /// Number of the current ring (or of the one being formed); replies and losses of
    /// older rings are ignored.
    gen: u64,
    inbox: mpsc::Sender<Inbox>,
    vocab: Arc<LlamaModel>,
    config: EngineConfig,
    counters: Arc<Counters>,
    health: Arc<Mutex<Health>>,
    /// Forms new rings; `None` for an in-process ring, or while a recovery thread
    /// holds it.
    source: Option<Box<dyn RingSource>>,
    supervised: bool,
    recovery: Option<Recovery>,
    /// Tells a recovery thread to give up (the engine is stopping).
    stop_recovery: Arc<AtomicBool>,
    slots: Vec<Slot>,
    queue: VecDeque<Box<Job>>,
    /// Messages in the ring, oldest first, with when they were sent.
    pending: VecDeque<(Instant, Pending)>,
    steps_in_flight: usize,
    /// The last micro-batch carried decode rows (the next goes to a waiting prompt).
    last_batch_decoded: bool,
    next_step: u64,
    next_epoch: u64,
    stopping: bool,
}

impl Sched {
    fn new(
        inbox: mpsc::Sender<Inbox>,
        vocab: Arc<LlamaModel>,
        config: EngineConfig,
        counters: Arc<Counters>,
        health: Arc<Mutex<Health>>,
        source: Option<Box<dyn RingSource>>,
    ) -> Sched {
        let slots = (0..config.n_slots)
            .map(|_| Slot {
                cached: Vec::new(),
                cached_runs: Vec::new(),
                last_used: 0,
                active: None,
            })
            .collect();
        Sched {
            tx: None,
            gen: 0,
            inbox,
            vocab,
            config,
            counters,
            health,
            supervised: source.is_some(),
            source,
            recovery: None,
            stop_recovery: Arc::default(),
            slots,
            queue: VecDeque::new(),
            pending: VecDeque::new(),
            steps_in_flight: 0,
            last_batch_decoded: false,
            next_step: 0,
            next_epoch: 1,
            stopping: false,
        }
    }

    fn run(&mut self, inbox: mpsc::Receiver<Inbox>) {
        loop {
            let msg = match inbox.recv_timeout(Duration::from_millis(100)) {
                Ok(msg) => Some(msg),
                Err(mpsc::RecvTimeoutError::Timeout) => None,
                Err(mpsc::RecvTimeoutError::Disconnected) => return,
            };
            match msg {
                Some(Inbox::Job(job)) => self.queue.push_back(job),
                Some(Inbox::Stats(reply)) => {
                    if self.tx.is_none() {
                        let _ = reply.send(Err("the cluster is forming a new ring".into()));
                    } else {
                        let msg = Message::Stats {
                            resident: Vec::new(),
                            kv_used: Vec::new(),
                        };
                        let _ = self.send(msg, Pending::Stats(reply));
                    }
                }
                Some(Inbox::Reply(gen, reply)) if gen == self.gen => match reply {
                    Ok(Message::Shutdown) if self.stopping => return,
                    Ok(reply) => self.on_reply(reply),
                    Err(e) => {
                        if self.stopping {
                            return;
                        }
                        self.lose_ring(&format!("the ring broke: {e}"));
                    }
                },
                Some(Inbox::Lost(gen, why)) if gen == self.gen && !self.stopping => self.lose_ring(&why),
                Some(Inbox::Reply(..) | Inbox::Lost(..)) => {}
                Some(Inbox::Formed(source, formed)) => {
                    self.source = Some(source);
                    if self.stopping {
                        return;
                    }
                    self.install(formed);
                }
                Some(Inbox::FormFailed(error)) => self.on_form_failed(error),
                Some(Inbox::Shutdown) => {
                    self.stopping = true;
                    self.stop_recovery.store(true, Ordering::SeqCst);
                    if self.tx.is_none() || self.send(Message::Shutdown, Pending::Shutdown).is_err() {
                        return;
                    }
                }
                None => {}
            }
            if self.stopping {
                continue;
            }
            self.check_recovery_time();
            self.check_step_time();
            if self.tx.is_none() {
                self.drop_abandoned();
                continue;
            }
            self.drop_abandoned();
            self.move_back_if_idle();
            self.admit();
            self.schedule();
        }
    }

    /// Takes `formed` as the current ring: starts reading its replies, and rebuilds
    /// every running sequence on it.
    fn install(&mut self, formed: Formed) {
        let Formed { head, stages, lost } = formed;
        let (tx, rx) = head.into_parts();
        spawn_reader(rx, self.inbox.clone(), self.gen);
        self.tx = Some(tx);
        self.pending.clear();
        self.steps_in_flight = 0;
        self.last_batch_decoded = false;
        if !stages.is_empty() {
            self.config.n_stages = stages.len();
        }
        let rebuilding = self.recovery.is_some();
        if let Some(recovery) = self.recovery.take() {
            self.counters.rings_formed.fetch_add(1, Ordering::Relaxed);
            tracing::info!(
                secs = recovery.since.elapsed().as_secs_f32(),
                stages = ?stages,
                "formed a new ring after: {}",
                recovery.reason
            );
        }
        *self.health.lock().unwrap_or_else(|p| p.into_inner()) = Health::Serving { stages, lost };
        if rebuilding {
            self.rebuild();
        }
    }

    /// Starts every running sequence again on the new ring, to be sent again batch for
    /// batch; slots' cached prefixes are gone with the old stages.
    fn rebuild(&mut self) {
        for seq in 0..self.slots.len() {
            let slot = &mut self.slots[seq];
            slot.cached.clear();
            slot.cached_runs.clear();
            let Some(active) = slot.active.as_mut() else { continue };
            active.replay = active.runs.drain(..).collect();
            self.counters
                .tokens_replayed
                .fetch_add(active.n_sent as u64, Ordering::Relaxed);
            active.n_sent = 0;
            active.waiting = false;
            let start = Message::StartSeq {
                seq: seq as u32,
                keep: 0,
                params: active.job.params.clone(),
                history: active.tokens.clone(),
                top_logprobs: active.job.top_logprobs,
                logprobs: active.job.logprobs,
                drawn: active.generated as u32,
            };
            if self.send(start, Pending::Control).is_err() {
                return;
            }
        }
    }

    /// The current ring is gone. With a source, a recovery thread forms the next one
    /// while requests wait; without one, every request fails.
    fn lose_ring(&mut self, reason: &str) {
        self.tx = None;
        // What the old ring still says is stale from now on.
        self.gen += 1;
        for (_, pending) in self.pending.drain(..) {
            if let Pending::Stats(reply) = pending {
                let _ = reply.send(Err(reason.to_string()));
            }
        }
        self.steps_in_flight = 0;
        if !self.supervised {
            self.fail_all(reason);
            *self.health.lock().unwrap_or_else(|p| p.into_inner()) = Health::Failed {
                reason: reason.to_string(),
            };
            return;
        }
        tracing::warn!("{reason}: forming a new ring");
        *self.health.lock().unwrap_or_else(|p| p.into_inner()) = Health::Recovering {
            reason: reason.to_string(),
        };
        if self.recovery.is_none() {
            self.recovery = Some(Recovery {
                since: Instant::now(),
                reason: reason.to_string(),
                gave_up: false,
            });
        }
        self.start_forming();
    }

    /// Hands the source to a thread that forms a ring, retrying with backoff, and
    /// reports each failure and the success.
    fn start_forming(&mut self) {
        let Some(mut source) = self.source.take() else { return };
        let inbox = self.inbox.clone();
        let stop = self.stop_recovery.clone();
        let next_gen = self.gen;
        let _ = std::thread::Builder::new().name("recovery".into()).spawn(move || {
            let mut backoff = Duration::from_millis(200);
            loop {
                match source.form(lost_reporter(&inbox, next_gen)) {
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
    }

    fn on_form_failed(&mut self, error: FormError) {
        match error {
            FormError::Capacity(reason) => {
                *self.health.lock().unwrap_or_else(|p| p.into_inner()) = Health::Waiting { reason: reason.clone() };
                if let Some(recovery) = self.recovery.as_mut() {
                    if !recovery.gave_up {
                        recovery.gave_up = true;
                        let message = format!("{}, and {reason}", recovery.reason);
                        self.fail_requests(&message);
                    }
                }
            }
            FormError::Retry(reason) => {
                if let Some(recovery) = self.recovery.as_ref() {
                    let reason = format!("{}; forming a new ring failed: {reason}", recovery.reason);
                    *self.health.lock().unwrap_or_else(|p| p.into_inner()) = Health::Recovering { reason };
                }
            }
        }
    }

    /// Running and queued requests fail once recovery has taken longer than allowed.
    fn check_recovery_time(&mut self) {
        let Some(recovery) = self.recovery.as_mut() else { return };
        if recovery.gave_up || recovery.since.elapsed() < self.config.recovery_timeout {
            return;
        }
        recovery.gave_up = true;
        let reason = format!(
            "{}, and no new ring could be formed within {} s",
            recovery.reason,
            self.config.recovery_timeout.as_secs_f32()
        );
        *self.health.lock().unwrap_or_else(|p| p.into_inner()) = Health::Waiting { reason: reason.clone() };
        self.fail_requests(&reason);
    }

    /// A ring whose oldest message has gone unanswered for `step_timeout` is stuck
    /// somewhere a heartbeat cannot see (a stage wedged in its computation).
    fn check_step_time(&mut self) {
        let Some((sent, _)) = self.pending.front() else { return };
        if self.tx.is_some() && sent.elapsed() > self.config.step_timeout {
            let secs = self.config.step_timeout.as_secs_f32();
            self.lose_ring(&format!("the ring did not answer a step within {secs} s"));
        }
    }

    /// When a lost node answers again and nothing runs, forms the ring again so the
    /// planner can use it.
    fn move_back_if_idle(&mut self) {
        let idle = self.slots.iter().all(|s| s.active.is_none()) && self.queue.is_empty() && self.pending.is_empty();
        if !idle || !self.source.as_ref().is_some_and(|s| s.returned()) {
            return;
        }
        self.lose_ring("a lost worker is back: moving to the better plan");
    }

    /// Sends `msg` into the ring, remembering what its reply answers.
    fn send(&mut self, msg: Message, pending: Pending) -> Result<(), ()> {
        let Some(tx) = self.tx.as_mut() else {
            if let Pending::Stats(reply) = pending {
                let _ = reply.send(Err("the cluster is forming a new ring".into()));
            }
            return Err(());
        };
        match tx.send(msg) {
            Ok(()) => {
                self.pending.push_back((Instant::now(), pending));
                Ok(())
            }
            Err(e) => {
                if let Pending::Stats(reply) = pending {
                    let _ = reply.send(Err(e.to_string()));
                }
                self.lose_ring(&format!("cannot reach the first stage: {e}"));
                Err(())
            }
        }
    }

    /// Every running and waiting request fails with `reason`; slots forget their cache.
    fn fail_requests(&mut self, reason: &str) {
        tracing::error!("{reason}");
        for slot in &mut self.slots {
            if let Some(active) = slot.active.take() {
                let _ = active.job.events.send(Event::Failed(reason.to_string()));
                self.counters.requests_failed.fetch_add(1, Ordering::Relaxed);
            }
            slot.cached.clear();
            slot.cached_runs.clear();
        }
        for job in self.queue.drain(..) {
            let _ = job.events.send(Event::Failed(reason.to_string()));
            self.counters.requests_failed.fetch_add(1, Ordering::Relaxed);
        }
        self.counters.active.store(0, Ordering::Relaxed);
        self.counters.queued.store(0, Ordering::Relaxed);
    }

    /// The ring is gone for good: every request fails, and so will every new one.
    fn fail_all(&mut self, reason: &str) {
        self.fail_requests(reason);
        for (_, pending) in self.pending.drain(..) {
            if let Pending::Stats(reply) = pending {
                let _ = reply.send(Err(reason.to_string()));
            }
        }
    }

    /// Requests whose client went away: queued ones are dropped, running ones ended on
    /// every stage (the `EndSeq` follows their steps in flight, so it lands after them).
    fn drop_abandoned(&mut self) {
        let before = self.queue.len();
        self.queue.retain(|job| !job.events.is_closed());
        let dropped = before - self.queue.len();
        if dropped > 0 {
            self.counters.queued.fetch_sub(dropped, Ordering::Relaxed);
            self.counters
                .requests_cancelled
                .fetch_add(dropped as u64, Ordering::Relaxed);
        }
        for seq in 0..self.slots.len() {
            if self.slots[seq]
                .active
                .as_ref()
                .is_some_and(|a| a.job.events.is_closed())
            {
                self.cancel(seq);
            }
        }
    }

    fn cancel(&mut self, seq: usize) {
        let slot = &mut self.slots[seq];
        if slot.active.take().is_none() {
            return;
        }
        slot.cached.clear();
        slot.cached_runs.clear();
        self.counters.active.fetch_sub(1, Ordering::Relaxed);
        self.counters.requests_cancelled.fetch_add(1, Ordering::Relaxed);
        tracing::debug!(seq, "client went away: ending the sequence on every stage");
        let _ = self.send(Message::EndSeq { seq: seq as u32 }, Pending::Control);
    }

    /// Gives free slots to waiting requests, preferring the slot whose cache shares the
    /// longest prefix with the prompt.
    fn admit(&mut self) {
        while !self.queue.is_empty() {
            let Some(job) = self.queue.front() else { break };
            let chunk = self.config.chunk.max(1);
            let free = (0..self.slots.len()).filter(|&i| self.slots[i].active.is_none());
            let best = free.max_by_key(|&i| {
                let slot = &self.slots[i];
                (
                    reusable_prefix(&slot.cached, &slot.cached_runs, &job.prompt, chunk),
                    common_prefix(&slot.cached, &job.prompt),
                    std::cmp::Reverse(slot.last_used),
                )
            });
            let Some(seq) = best else { break };
            let job = self.queue.pop_front().expect("the queue is not empty");
            self.counters.queued.fetch_sub(1, Ordering::Relaxed);
            self.counters.active.fetch_add(1, Ordering::Relaxed);
            let slot = &self.slots[seq];
            let n_reused = reusable_prefix(&slot.cached, &slot.cached_runs, &job.prompt, chunk);
            self.counters
                .prompt_tokens_reused
                .fetch_add(n_reused as u64, Ordering::Relaxed);
            self.counters
                .prompt_tokens_computed
                .fetch_add((job.prompt.len() - n_reused) as u64, Ordering::Relaxed);
            let start = Message::StartSeq {
                seq: seq as u32,
                keep: n_reused as u32,
                params: job.params.clone(),
                history: job.prompt.clone(),
                top_logprobs: job.top_logprobs,
                logprobs: job.logprobs,
                drawn: 0,
            };
            let epoch = self.next_epoch;
            self.next_epoch += 1;
            let slot = &mut self.slots[seq];
            slot.last_used = epoch;
            slot.cached.clear();
            let runs = runs_prefix(&std::mem::take(&mut slot.cached_runs), n_reused);
            slot.active = Some(Active {
                epoch,
                tokens: job.prompt.clone(),
                n_prompt: job.prompt.len(),
                n_reused,
                n_sent: n_reused,
                runs,
                replay: VecDeque::new(),
                waiting: false,
                generated: 0,
                text: TextStream::new(&job.stop),
                last_batch: 0,
                job,
            });
            if self.send(start, Pending::Control).is_err() {
                return;
            }
        }
    }

    /// Fills the ring: up to one micro-batch per stage (plus one waiting at the first).
    fn schedule(&mut self) {
        while self.steps_in_flight <= self.config.n_stages {
            if !self.send_batch() {
                break;
            }
        }
    }

    /// Builds and sends one micro-batch; false when nothing is ready. A micro-batch is
    /// either the next token of some decoding sequences or one chunk of one prompt,
    /// alternating when both wait: mixed into one batch, a sequence's rows would meet
    /// kernels that round differently from those it meets alone (ggml multiplies 8+
    /// rows by K-quant weights with a tiled kernel), and a request would generate
    /// differently in company. Chunks start where the prompt's last chunk ended, so a
    /// prompt is cut the same way whatever else runs.
    fn send_batch(&mut self) -> bool {
        let step = self.next_step;
        let n_decoding = self
            .slots
            .iter()
            .filter_map(|s| s.active.as_ref())
            .filter(|a| a.decoding())
            .count();
        let group = n_decoding
            .div_ceil(self.config.n_stages.max(1))
            .clamp(1, self.config.max_decode_rows.max(1));

        let chunk = self.config.chunk.max(1);
        let next = |i: usize| self.slots[i].active.as_ref().and_then(|a| a.next_send(chunk));
        let mut decoding: Vec<usize> = (0..self.slots.len())
            .filter(|&i| matches!(next(i), Some((_, false))))
            .collect();
        decoding.sort_by_key(|&i| self.slots[i].active.as_ref().map_or(0, |a| a.last_batch));
        decoding.truncate(group);
        let prefilling = (0..self.slots.len())
            .filter_map(|i| match next(i) {
                Some((n, true)) => Some((self.slots[i].active.as_ref()?.epoch, i, n)),
                _ => None,
            })
            .min();

        let work: Vec<(usize, usize)> = match prefilling {
            Some((_, seq, n)) if decoding.is_empty() || self.last_batch_decoded => {
                self.last_batch_decoded = false;
                vec![(seq, n)]
            }
            _ if !decoding.is_empty() => {
                self.last_batch_decoded = true;
                decoding.iter().map(|&seq| (seq, 1)).collect()
            }
            _ => return false,
        };
        let (mut tokens, mut positions, mut seq_ids, mut sample_rows) = (vec![], vec![], vec![], vec![]);
        let mut members = Vec::new();
        for (seq, n) in work {
            let active = self.slots[seq].active.as_mut().expect("chosen slots are active");
            let start = active.n_sent;
            tokens.extend_from_slice(&active.tokens[start..start + n]);
            positions.extend((start..start + n).map(|p| p as i32));
            seq_ids.extend(std::iter::repeat_n(seq as u32, n));
            active.n_sent += n;
            active.runs.push(n as u32);
            active.replay.pop_front();
            active.last_batch = step + 1;
            let sampled = active.n_sent == active.tokens.len();
            if sampled {
                active.waiting = true;
                sample_rows.push(tokens.len() as u32 - 1);
            }
            members.push((seq, active.epoch, sampled));
        }
        self.next_step += 1;
        self.steps_in_flight += 1;
        self.counters.steps.fetch_add(1, Ordering::Relaxed);
        let forward = Forward {
            step,
            payload: Payload::Tokens(tokens),
            positions,
            seq_ids,
            sample_rows,
        };
        self.send(Message::Forward(forward), Pending::Step(members)).is_ok()
    }

    fn on_reply(&mut self, reply: Message) {
        let Some((_, pending)) = self.pending.pop_front() else {
            self.fail_all(&format!("the last stage sent {} that nothing asked for", reply.kind()));
            return;
        };
        match (pending, reply) {
            (Pending::Control, Message::Done) => {}
            (Pending::Control, Message::Error { stage, message }) => {
                tracing::warn!(stage, "a control message failed: {message}");
            }
            (Pending::Stats(answer), Message::Stats { resident, kv_used }) => {
                let _ = answer.send(Ok(StageStats { resident, kv_used }));
            }
            (Pending::Stats(answer), Message::Error { stage, message }) => {
                let _ = answer.send(Err(format!("stage {stage}: {message}")));
            }
            (Pending::Step(members), Message::Sampled { tokens, .. }) => {
                self.steps_in_flight -= 1;
                for (seq, epoch, sampled) in members {
                    if !sampled {
                        continue;
                    }
                    let token = tokens.iter().find(|t| t.seq as usize == seq);
                    match token {
                        Some(token) => self.on_token(seq, epoch, token),
                        None => self.fail_seq(seq, epoch, "the last stage sampled no token for the sequence"),
                    }
                }
            }
            (Pending::Step(members), Message::Error { stage, message }) => {
                self.steps_in_flight -= 1;
                let reason = format!("stage {stage}: {message}");
                for (seq, epoch, _) in members {
                    self.fail_seq(seq, epoch, &reason);
                }
            }
            (Pending::Shutdown, _) => {}
            (_, other) => self.fail_all(&format!("the ring answered out of order with {}", other.kind())),
        }
    }

    fn current(&mut self, seq: usize, epoch: u64) -> Option<&mut Active> {
        self.slots.get_mut(seq)?.active.as_mut().filter(|a| a.epoch == epoch)
    }

    fn fail_seq(&mut self, seq: usize, epoch: u64, reason: &str) {
        let Some(active) = self.current(seq, epoch) else { return };
        let _ = active.job.events.send(Event::Failed(reason.to_string()));
        self.slots[seq].active = None;
        self.slots[seq].cached.clear();
        self.slots[seq].cached_runs.clear();
        self.counters.active.fetch_sub(1, Ordering::Relaxed);
        self.counters.requests_failed.fetch_add(1, Ordering::Relaxed);
        let _ = self.send(Message::EndSeq { seq: seq as u32 }, Pending::Control);
    }

    fn on_token(&mut self, seq: usize, epoch: u64, sampled: &SampledToken) {
        let vocab = self.vocab.clone();
        let Some(active) = self.current(seq, epoch) else { return };
        active.waiting = false;
        let end = if vocab.is_end_of_generation(sampled.token) {
            Some((FinishReason::Stop, active.text.finish()))
        } else {
            active.tokens.push(sampled.token);
            active.generated += 1;
            let (text, stopped) = match active.text.push(&vocab.token_bytes(sampled.token, false)) {
                Piece::Text(text) => (text, false),
                Piece::Stop(text) => (text, true),
            };
            let out = TokenOut {
                id: sampled.token,
                text,
                logprob: sampled.logprob,
                top: sampled.top.clone(),
            };
            if active.job.events.send(Event::Token(out)).is_err() {
                self.cancel(seq);
                return;
            }
            if stopped {
                Some((FinishReason::Stop, String::new()))
            } else if active.generated >= active.job.max_tokens {
                Some((FinishReason::Length, active.text.finish()))
            } else {
                None
            }
        };
        if let Some((reason, tail)) = end {
            self.finish(seq, reason, tail);
        }
    }

    fn finish(&mut self, seq: usize, reason: FinishReason, tail: String) {
        let slot = &mut self.slots[seq];
        let Some(mut active) = slot.active.take() else { return };
        // Everything sent is in every stage's cache; the last sampled token is not.
        active.tokens.truncate(active.n_sent);
        slot.cached = active.tokens;
        slot.cached_runs = std::mem::take(&mut active.runs);
        self.counters.active.fetch_sub(1, Ordering::Relaxed);
        self.counters.requests_finished.fetch_add(1, Ordering::Relaxed);
        self.counters
            .completion_tokens
            .fetch_add(active.generated as u64, Ordering::Relaxed);
        let _ = active.job.events.send(Event::Finished(Finish {
            reason,
            tail,
            prompt_tokens: active.n_prompt,
            cached_tokens: active.n_reused,
            completion_tokens: active.generated,
        }));
    }
}

/// The runs that cover the first `n` tokens of `runs` (the last one cut short if `n`
/// falls inside it).
fn runs_prefix(runs: &[u32], n: usize) -> Vec<u32> {
    let mut out = Vec::new();
    let mut left = n;
    for &run in runs {
        if left == 0 {
            break;
        }
        let take = (run as usize).min(left);
        out.push(take as u32);
        left -= take;
    }
    if left > 0 {
        // Cannot happen (the runs cover the cache), but a rebuild must cover every token.
        out.push(left as u32);
    }
    out
}

/// Tells the engine that a node of ring `gen` is lost.
fn lost_reporter(inbox: &mpsc::Sender<Inbox>, gen: u64) -> OnLost {
    let inbox = inbox.clone();
    Arc::new(move |addr: &str, why: &str| {
        let _ = inbox.send(Inbox::Lost(gen, format!("worker {addr} was lost: {why}")));
    })
}

/// Reads the replies of ring `gen` into the engine's inbox until the ring closes.
fn spawn_reader(mut rx: Box<dyn Rx>, inbox: mpsc::Sender<Inbox>, gen: u64) {
    let _ = std::thread::Builder::new()
        .name("ring-reader".into())
        .spawn(move || loop {
            let reply = rx.recv().map_err(|e| e.to_string());
            let last = !matches!(reply, Ok(ref m) if !matches!(m, Message::Shutdown));
            if inbox.send(Inbox::Reply(gen, reply)).is_err() || last {
                return;
            }
        });
}

/// How many leading tokens of `prompt` may be taken from a slot's cache (`cached`, sent
/// in `runs`) so that every row the request computes is bit-identical to a fresh run.
///
/// A fresh prompt is cut into chunks of `chunk` tokens from position 0, the last chunk
/// holding the rest; ggml rounds a row differently in batches of different shapes, so a
/// cached cell is as good as a fresh one only if it was computed in the same chunk as a
/// fresh run computes it: reuse stops at the first run that was not a whole chunk (a
/// short last prompt chunk, a generated token), at the first chunk whose tokens differ,
/// and before the prompt's own last chunk (the one sampled). What follows is computed
/// exactly as a fresh run computes it.
fn reusable_prefix(cached: &[u32], runs: &[u32], prompt: &[u32], chunk: usize) -> usize {
    let chunk = chunk.max(1);
    let last_chunk_start = (prompt.len().saturating_sub(1) / chunk) * chunk;
    let common = common_prefix(cached, prompt);
    let whole = runs.iter().take_while(|&&run| run as usize == chunk).count() * chunk;
    let reusable = whole.min(common).min(last_chunk_start);
    reusable - reusable % chunk
}

/// Length of the common prefix of two token lists.
fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reuse_is_cut_where_a_fresh_prompt_is_cut() {
        let prompt: Vec<u32> = (0..40).collect();
        // (cached tokens, their runs, chunk, prompt) -> reusable
        let cases: [(&[u32], &[u32], usize, &[u32], usize); 8] = [
            // turn 1 computed 2 whole chunks of 8, a short last chunk, then decoded 3
            (&prompt[..23], &[8, 8, 4, 1, 1, 1], 8, &prompt, 16),
            // the same, but the new prompt differs inside the second chunk
            (
                &prompt[..23],
                &[8, 8, 4, 1, 1, 1],
                8,
                &[&prompt[..12], &[99]].concat(),
                8,
            ),
            // a fresh prompt's last chunk is always computed, even when all is cached
            (&prompt[..32], &[8, 8, 8, 8], 8, &prompt[..32], 24),
            (&prompt[..32], &[8, 8, 8, 8], 8, &prompt[..33], 32),
            // nothing cached, or nothing in common
            (&[], &[], 8, &prompt, 0),
            (&[7, 7, 7, 7, 7, 7, 7, 7, 7], &[8, 1], 8, &prompt, 0),
            // decoded tokens are never whole chunks (unless a chunk is one token)
            (
                &prompt[..20],
                &[4, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1],
                8,
                &prompt,
                0,
            ),
            (&prompt[..5], &[1, 1, 1, 1, 1], 1, &prompt[..10], 5),
        ];
        for (i, (cached, runs, chunk, prompt, want)) in cases.into_iter().enumerate() {
            assert_eq!(reusable_prefix(cached, runs, prompt, chunk), want, "case {i}");
        }
    }

    #[test]
    fn repacked_weights_allow_fewer_decode_rows() {
        assert_eq!(max_decode_rows(true), 3);
        assert_eq!(max_decode_rows(false), 7);
    }
}
