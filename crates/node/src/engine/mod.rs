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

mod text;

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::Duration;

use baton_ggml::LlamaModel;
use baton_net::Tx;
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
    /// Requests allowed to wait for a slot before new ones are refused.
    pub max_queue: usize,
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
    Reply(Result<Message, String>),
    Shutdown,
}

/// The running engine; dropping it stops the ring.
pub struct Engine {
    inbox: mpsc::Sender<Inbox>,
    counters: Arc<Counters>,
    config: EngineConfig,
    failed: Arc<std::sync::Mutex<Option<String>>>,
    thread: Option<JoinHandle<()>>,
    reader: Option<JoinHandle<()>>,
}

impl Engine {
    /// Takes over `head`'s ring.
    pub fn start(head: Head, vocab: Arc<LlamaModel>, config: EngineConfig) -> Engine {
        let (tx, mut rx) = head.into_parts();
        let (inbox, receiver) = mpsc::channel();
        let replies = inbox.clone();
        let reader = std::thread::Builder::new()
            .name("ring-reader".into())
            .spawn(move || loop {
                let reply = rx.recv().map_err(|e| e.to_string());
                let last = !matches!(reply, Ok(ref m) if !matches!(m, Message::Shutdown));
                if replies.send(Inbox::Reply(reply)).is_err() || last {
                    return;
                }
            })
            .expect("a thread can be started");
        let counters = Arc::new(Counters::default());
        let failed = Arc::new(std::sync::Mutex::new(None));
        let mut sched = Sched::new(tx, vocab, config.clone(), counters.clone(), failed.clone());
        let thread = std::thread::Builder::new()
            .name("engine".into())
            .spawn(move || sched.run(receiver))
            .expect("a thread can be started");
        Engine {
            inbox,
            counters,
            config,
            failed,
            thread: Some(thread),
            reader: Some(reader),
        }
    }

    /// Queues a request; its events arrive on `job.events`.
    pub fn submit(&self, job: Job) -> Result<(), SubmitError> {
        if let Some(reason) = self.failed.lock().unwrap_or_else(|p| p.into_inner()).clone() {
            return Err(SubmitError::Unavailable(reason));
        }
        if job.prompt.is_empty() {
            return Err(SubmitError::EmptyPrompt);
        }
        if job.prompt.len() + job.max_tokens > self.config.slot_ctx {
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

    /// Why the engine stopped computing, if it did.
    pub fn failure(&self) -> Option<String> {
        self.failed.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        let _ = self.inbox.send(Inbox::Shutdown);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
        if let Some(reader) = self.reader.take() {
            let _ = reader.join();
        }
    }
}

/// A sequence id with its share of the KV cache.
struct Slot {
    /// Tokens whose cache every stage holds for this slot (when no request runs in it).
    cached: Vec<u32>,
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
    /// A row of this sequence that will be sampled is in the ring.
    waiting: bool,
    generated: usize,
    text: TextStream,
    /// Step counter when this sequence last went into a batch (fairness).
    last_batch: u64,
}

impl Active {
    fn ready(&self) -> bool {
        !self.waiting && self.n_sent < self.tokens.len()
    }

    fn decoding(&self) -> bool {
        self.n_sent >= self.n_prompt
    }
}

/// Most decode rows in one micro-batch: from 8 rows on, ggml multiplies by K-quant
/// weights with a tiled kernel whose rounding differs from the one-row kernel's, so a
/// sequence would generate differently in a big batch than alone.
const MAX_DECODE_ROWS: usize = 7;

/// A message in the ring, waiting for its reply.
enum Pending {
    Control,
    Stats(oneshot::Sender<Result<StageStats, String>>),
    /// A micro-batch: `(slot, epoch, sampled)` per sequence in it.
    Step(Vec<(usize, u64, bool)>),
    Shutdown,
}

struct Sched {
    tx: Box<dyn Tx>,
    vocab: Arc<LlamaModel>,
    config: EngineConfig,
    counters: Arc<Counters>,
    failed: Arc<std::sync::Mutex<Option<String>>>,
    slots: Vec<Slot>,
    queue: VecDeque<Box<Job>>,
    pending: VecDeque<Pending>,
    steps_in_flight: usize,
    /// The last micro-batch carried decode rows (the next goes to a waiting prompt).
    last_batch_decoded: bool,
    next_step: u64,
    next_epoch: u64,
    stopping: bool,
}

impl Sched {
    fn new(
        tx: Box<dyn Tx>,
        vocab: Arc<LlamaModel>,
        config: EngineConfig,
        counters: Arc<Counters>,
        failed: Arc<std::sync::Mutex<Option<String>>>,
    ) -> Sched {
        let slots = (0..config.n_slots)
            .map(|_| Slot {
                cached: Vec::new(),
                last_used: 0,
                active: None,
            })
            .collect();
        Sched {
            tx,
            vocab,
            config,
            counters,
            failed,
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
                    let msg = Message::Stats {
                        resident: Vec::new(),
                        kv_used: Vec::new(),
                    };
                    if self.send(msg, Pending::Stats(reply)).is_err() {
                        continue;
                    }
                }
                Some(Inbox::Reply(Ok(Message::Shutdown))) => return,
                Some(Inbox::Reply(Ok(reply))) => self.on_reply(reply),
                Some(Inbox::Reply(Err(e))) => {
                    self.fail_all(&format!("the ring broke: {e}"));
                    if self.stopping {
                        return;
                    }
                }
                Some(Inbox::Shutdown) => {
                    self.stopping = true;
                    if self.send(Message::Shutdown, Pending::Shutdown).is_err() {
                        return;
                    }
                }
                None => {}
            }
            if self.stopping || self.is_failed() {
                continue;
            }
            self.drop_abandoned();
            self.admit();
            self.schedule();
        }
    }

    fn is_failed(&self) -> bool {
        self.failed.lock().unwrap_or_else(|p| p.into_inner()).is_some()
    }

    /// Sends `msg` into the ring, remembering what its reply answers.
    fn send(&mut self, msg: Message, pending: Pending) -> Result<(), ()> {
        match self.tx.send(msg) {
            Ok(()) => {
                self.pending.push_back(pending);
                Ok(())
            }
            Err(e) => {
                if let Pending::Stats(reply) = pending {
                    let _ = reply.send(Err(e.to_string()));
                }
                self.fail_all(&format!("cannot reach the first stage: {e}"));
                Err(())
            }
        }
    }

    /// The ring is gone: every request fails, and so will every new one.
    fn fail_all(&mut self, reason: &str) {
        tracing::error!("{reason}");
        *self.failed.lock().unwrap_or_else(|p| p.into_inner()) = Some(reason.to_string());
        for slot in &mut self.slots {
            if let Some(active) = slot.active.take() {
                let _ = active.job.events.send(Event::Failed(reason.to_string()));
                self.counters.requests_failed.fetch_add(1, Ordering::Relaxed);
            }
            slot.cached.clear();
        }
        for job in self.queue.drain(..) {
            let _ = job.events.send(Event::Failed(reason.to_string()));
            self.counters.requests_failed.fetch_add(1, Ordering::Relaxed);
        }
        for pending in self.pending.drain(..) {
            if let Pending::Stats(reply) = pending {
                let _ = reply.send(Err(reason.to_string()));
            }
        }
        self.counters.active.store(0, Ordering::Relaxed);
        self.counters.queued.store(0, Ordering::Relaxed);
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
            let free = (0..self.slots.len()).filter(|&i| self.slots[i].active.is_none());
            let best = free.max_by_key(|&i| {
                let slot = &self.slots[i];
                (
                    common_prefix(&slot.cached, &job.prompt),
                    std::cmp::Reverse(slot.last_used),
                )
            });
            let Some(seq) = best else { break };
            let job = self.queue.pop_front().expect("the queue is not empty");
            self.counters.queued.fetch_sub(1, Ordering::Relaxed);
            self.counters.active.fetch_add(1, Ordering::Relaxed);
            // At least the last prompt token is computed: its logits are needed.
            let n_reused = common_prefix(&self.slots[seq].cached, &job.prompt).min(job.prompt.len() - 1);
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
            };
            let epoch = self.next_epoch;
            self.next_epoch += 1;
            let slot = &mut self.slots[seq];
            slot.last_used = epoch;
            slot.cached.clear();
            slot.active = Some(Active {
                epoch,
                tokens: job.prompt.clone(),
                n_prompt: job.prompt.len(),
                n_reused,
                n_sent: n_reused,
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
            .clamp(1, MAX_DECODE_ROWS);

        let mut decoding: Vec<usize> = (0..self.slots.len())
            .filter(|&i| self.slots[i].active.as_ref().is_some_and(|a| a.ready() && a.decoding()))
            .collect();
        decoding.sort_by_key(|&i| self.slots[i].active.as_ref().map_or(0, |a| a.last_batch));
        decoding.truncate(group);
        let prefilling = (0..self.slots.len())
            .filter_map(|i| {
                let active = self.slots[i].active.as_ref()?;
                (active.ready() && !active.decoding()).then_some((active.epoch, i))
            })
            .min()
            .map(|(_, seq)| seq);

        let work: Vec<(usize, usize)> = match prefilling {
            Some(seq) if decoding.is_empty() || self.last_batch_decoded => {
                let active = self.slots[seq].active.as_ref().expect("chosen slots are active");
                self.last_batch_decoded = false;
                vec![(seq, self.config.chunk.max(1).min(active.n_prompt - active.n_sent))]
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
        let Some(pending) = self.pending.pop_front() else {
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

/// Length of the common prefix of two token lists.
fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}
