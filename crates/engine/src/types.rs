//! What the engine's users see: its configuration, requests and their events, refusals,
//! counters, health, and the interface through which it gets rings to run on.

use std::sync::atomic::{AtomicU64, AtomicUsize};
use std::sync::Arc;
use std::time::Duration;

use baton_sample::{ReasoningBudget, SamplingParams};
use tokio::sync::mpsc::UnboundedSender;

use crate::head::RingEnds;

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
    /// Most decoding sequences in one micro-batch ([`MAX_DECODE_SEQS`]): each row
    /// computed as alone, so a sequence generates the same beside others as alone.
    pub max_decode_seqs: usize,
    /// Requests allowed to wait for a slot before new ones are refused.
    pub max_queue: usize,
    /// Longest the engine tries to form a new ring after losing a node before running
    /// requests fail (it keeps trying for new ones).
    pub recovery_timeout: Duration,
    /// Longest the ring may take to answer one message before it counts as broken
    /// (a stage stuck in its computation, which heartbeats do not see).
    pub step_timeout: Duration,
    /// Where a prompt may start from the prefix its slot's cache holds
    /// ([`prefix_reuse`]).
    pub prefix_reuse: PrefixReuse,
    /// Most tokens drafted for one step: [`MAX_DRAFT`](crate::draft::MAX_DRAFT), fewer
    /// where a rejected draft must roll recurrent states back ([`max_draft`]).
    pub max_draft: usize,
    /// Width of the model's hidden state: a pooled vector (an embedding) from the last
    /// stage must have exactly this many values.
    pub n_embd: usize,
}

/// Most tokens the engine may draft per step for a model: as many as a rejected draft
/// can be rolled back over (recurrent states keep only their last
/// [`KEPT_STATES`](baton_model::KEPT_STATES) positions).
pub fn max_draft(hp: &baton_model::HParams) -> usize {
    match prefix_reuse(hp) {
        PrefixReuse::Anywhere | PrefixReuse::Recent(_) => crate::draft::MAX_DRAFT,
        PrefixReuse::Checkpoints => crate::draft::MAX_DRAFT.min(baton_model::KEPT_STATES - 1),
    }
}

/// Where a request may take a cached prefix of its prompt from its slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PrefixReuse {
    /// At any chunk boundary: KV caches can be cut back anywhere.
    Anywhere,
    /// Only where the stages keep a copy of the recurrent states: a model with
    /// recurrent layers, whose states cannot be cut back. The engine asks every stage
    /// to keep them at the end of each whole prompt chunk (`Message::Checkpoint`; the
    /// newest [`CHECKPOINTS`](baton_model::CHECKPOINTS) per sequence are kept) and
    /// reuses a prefix up to the last of those within what could be reused anywhere.
    Checkpoints,
    /// At a chunk boundary at most this many tokens before the end of what the slot
    /// holds, else nowhere: a model with sliding-window layers, whose window-sized
    /// caches keep a sequence's window and one batch (see
    /// [`HParams::window_cells`](baton_model::HParams::window_cells)), so a sequence
    /// cut back further than that has lost tokens it would see. Such a prompt is
    /// computed from the start.
    Recent(usize),
}

/// Where a model's cached prefixes may be reused: anywhere, at checkpoints of its
/// recurrent states, or near the end of what a slot holds when sliding-window layers
/// keep window-sized caches (the stages' default batch of
/// [`DEFAULT_UBATCH`](baton_model::DEFAULT_UBATCH) rows is the least slack those
/// caches have).
pub fn prefix_reuse(hp: &baton_model::HParams) -> PrefixReuse {
    if hp.recurrent_layers.iter().any(|&r| r) {
        PrefixReuse::Checkpoints
    } else if (0..hp.n_layer).any(|l| hp.is_swa(l)) {
        PrefixReuse::Recent(baton_model::DEFAULT_UBATCH)
    } else {
        PrefixReuse::Anywhere
    }
}

/// Called (from any thread) with a node's address and why it is lost.
pub type OnLost = Arc<dyn Fn(&str, &str) + Send + Sync>;

/// Forms rings for the engine: once at the start, and again whenever a node is lost.
pub trait RingSource: Send {
    /// Closes the current ring, if any, and forms a new one over the nodes that answer
    /// now. `on_lost` is called when a node of the new ring stops answering.
    fn form(&mut self, on_lost: OnLost) -> Result<Formed, FormError>;
    /// Whether a better ring than the one running may be formed, and why.
    fn better(&self) -> Option<Better>;
}

/// Why a better ring may be formed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Better {
    /// A node that was lost answers again: the engine moves to the better plan when
    /// nothing runs.
    Returned,
    /// A node joined the cluster: the engine forms a ring with it at once, replaying
    /// what runs on the new ring (the same text, as after a loss), so that a busy
    /// server still takes in a new node.
    Joined,
}

/// A ring just formed.
pub struct Formed {
    /// Its two ends.
    pub ends: RingEnds,
    /// Each stage, in ring order, described for people (node and layers).
    pub stages: Vec<String>,
    /// Nodes out of the ring because they were lost, and why.
    pub lost: Vec<(String, String)>,
    /// KV cells of each stage when the formation chose them from the nodes' memory
    /// (the engine's first ring then sets each slot's context: the cells shared by its
    /// slots); `None`: the configuration's context.
    pub n_ctx: Option<usize>,
    /// The workers the head watches, each with the counters of the head's link to it
    /// (whose round trip the heartbeat keeps current); empty for an in-process ring.
    pub workers: Vec<WorkerLink>,
}

/// A worker of the ring as the head sees it.
#[derive(Clone, Debug)]
pub struct WorkerLink {
    /// Its address.
    pub addr: String,
    /// The head's control link to it: its round trip is the heartbeat's latest.
    pub counters: Arc<baton_net::Counters>,
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
    /// Speculative decoding: where drafted tokens come from, and how many at most.
    pub draft: super::draft::Draft,
    /// GBNF grammar the generated text must follow, enforced by the last stage's
    /// sampling (structured output, forced tool calls).
    pub grammar: Option<String>,
    /// A budget of thinking tokens, enforced by the last stage's sampling (it forces
    /// the end tag when the budget is spent).
    pub budget: Option<ReasoningBudget>,
    /// Control tokens whose text is part of the output (the tool-call markers a parser
    /// reads, such as Mistral's `[TOOL_CALLS]`); other control tokens render as nothing.
    pub show: Vec<u32>,
    /// Decides from the text that generation is complete (one tool call written, with
    /// `parallel_tool_calls: false`).
    pub end: Option<Box<dyn EndCheck>>,
    /// An embedding instead of generated text: the last stage pools the prompt's rows
    /// this way and the request finishes with the vector ([`Finish::embedding`]), nothing
    /// generated (`max_tokens` 0). Its cells are freed at once and its prompt is never
    /// kept as a cached prefix.
    pub pooling: Option<baton_proto::Pooling>,
    /// Where the engine reports; dropping the receiver cancels the request.
    pub events: UnboundedSender<Event>,
}

/// Decides from a request's text that its generation is complete. It runs on the
/// engine's thread as each token is taken, so nothing after the end is computed or sent
/// (the server ends a request that allows one tool call as soon as the call is written).
pub trait EndCheck: Send + std::fmt::Debug {
    /// Sees the text each generated token released, in order (what the request's events
    /// carry); true ends generation after this token, with [`FinishReason::Stop`].
    fn ends_after(&mut self, text: &str) -> bool;
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
    Failed(Failure),
}

/// Why a request failed: whose failure it is, and what happened.
#[derive(Clone, Debug, PartialEq)]
pub struct Failure {
    pub cause: Cause,
    pub reason: String,
}

/// Whose failure ended a request (an HTTP client is told 400, 503 or 500).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cause {
    /// The request cannot be served as asked (its grammar, its sampling parameters).
    Request,
    /// No room for it now (a stage's KV cache was full): it may succeed later.
    Capacity,
    /// The server failed (a stage's computation, the ring).
    Server,
}

impl Failure {
    /// A failure of the server's own (the ring, a stage).
    pub fn server(reason: impl Into<String>) -> Failure {
        Failure {
            cause: Cause::Server,
            reason: reason.into(),
        }
    }

    /// The failure a stage reported with `fault`.
    pub fn from_stage(fault: baton_proto::Fault, first_layer: u32, message: &str) -> Failure {
        let cause = match fault {
            baton_proto::Fault::Request => Cause::Request,
            baton_proto::Fault::CacheFull => Cause::Capacity,
            baton_proto::Fault::Compute | baton_proto::Fault::Protocol => Cause::Server,
        };
        Failure {
            cause,
            reason: format!("the stage from layer {first_layer}: {message}"),
        }
    }
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.reason)
    }
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
    /// An end-of-generation token, a stop string, or the job's [`EndCheck`].
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
    /// The stop string that ended the text, if one did.
    pub stop_string: Option<String>,
    /// A pooled request's embedding ([`Job::pooling`]): `n_embd` values, L2-normalized.
    pub embedding: Option<Vec<f32>>,
}

/// Why the stages' figures could not be had.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum StatsError {
    /// The cluster is forming a new ring.
    #[error("the cluster is forming a new ring")]
    Forming,
    /// A stage answered the question with an error.
    #[error("the stage from layer {first_layer}: {message}")]
    Stage {
        first_layer: u32,
        fault: baton_proto::Fault,
        message: String,
    },
    /// The ring was lost, or failed for good, before it answered.
    #[error("{0}")]
    Lost(String),
    /// The engine has stopped.
    #[error("the engine has stopped")]
    Stopped,
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
    /// Drafted tokens sent through the ring (speculative decoding).
    pub draft_tokens: AtomicU64,
    /// Drafted tokens the last stage's sampling agreed with.
    pub draft_accepted: AtomicU64,
    /// Times the ring broke or a node of it stopped answering.
    pub workers_lost: AtomicU64,
    /// Times a lost worker answered again and the ring was formed again with it.
    pub workers_returned: AtomicU64,
    /// Nodes that joined the cluster while it served.
    pub workers_joined: AtomicU64,
    /// Microseconds from sending each answered micro-batch to its answer, summed (divide
    /// by `steps` answered for the mean round trip).
    pub round_trip_us: AtomicU64,
}

/// One of the engine's [`Counters`], as the core names it in [`Output::Count`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Figure {
    PromptComputed,
    PromptReused,
    Completion,
    Finished,
    Cancelled,
    Failed,
    Steps,
    Active,
    Queued,
    RingsFormed,
    Replayed,
    DraftTokens,
    DraftAccepted,
    WorkersLost,
    WorkersReturned,
    WorkersJoined,
    RoundTripUs,
}

impl Counters {
    /// Adds `by` to `figure` (a negative `by` takes away).
    pub(crate) fn add(&self, figure: Figure, by: i64) {
        use std::sync::atomic::Ordering::Relaxed;
        let counter = match figure {
            Figure::Active | Figure::Queued => {
                let value = if figure == Figure::Active {
                    &self.active
                } else {
                    &self.queued
                };
                let magnitude = by.unsigned_abs() as usize;
                // Never below zero, whatever a caller miscounts.
                let _ = value.fetch_update(Relaxed, Relaxed, |v| {
                    Some(if by >= 0 {
                        v.saturating_add(magnitude)
                    } else {
                        v.saturating_sub(magnitude)
                    })
                });
                return;
            }
            Figure::PromptComputed => &self.prompt_tokens_computed,
            Figure::PromptReused => &self.prompt_tokens_reused,
            Figure::Completion => &self.completion_tokens,
            Figure::Finished => &self.requests_finished,
            Figure::Cancelled => &self.requests_cancelled,
            Figure::Failed => &self.requests_failed,
            Figure::Steps => &self.steps,
            Figure::RingsFormed => &self.rings_formed,
            Figure::Replayed => &self.tokens_replayed,
            Figure::DraftTokens => &self.draft_tokens,
            Figure::DraftAccepted => &self.draft_accepted,
            Figure::WorkersLost => &self.workers_lost,
            Figure::WorkersReturned => &self.workers_returned,
            Figure::WorkersJoined => &self.workers_joined,
            Figure::RoundTripUs => &self.round_trip_us,
        };
        let _ = counter.fetch_update(Relaxed, Relaxed, |v| Some(v.saturating_add_signed(by)));
    }
}

/// What the core tells the world beside the ring, for the shell to deliver: a
/// request's event to its client, a change to the counters, the health, an answer to
/// a question for the stages' figures. The core itself touches nothing shared.
#[derive(Debug)]
pub(crate) enum Output {
    /// A request's event, for its client.
    Tell(tokio::sync::mpsc::UnboundedSender<Event>, Event),
    /// A counter changed by this much.
    Count(Figure, i64),
    /// The engine's health is now this.
    Health(Health),
    /// The stages' figures, or why there are none.
    Stats(
        tokio::sync::oneshot::Sender<Result<StageStats, StatsError>>,
        Result<StageStats, StatsError>,
    ),
}

impl Output {
    /// Delivers the output to the counters, the health and the clients it names (a
    /// client gone away is not told: the core notices it was dropped on its next
    /// poll).
    pub(crate) fn deliver(self, counters: &Counters, health: &std::sync::Mutex<Health>) {
        match self {
            Output::Tell(client, event) => {
                let _ = client.send(event);
            }
            Output::Count(figure, by) => counters.add(figure, by),
            Output::Health(now) => *health.lock().unwrap_or_else(|p| p.into_inner()) = now,
            Output::Stats(asker, answer) => {
                let _ = asker.send(answer);
            }
        }
    }
}

/// Per-stage figures, in ring order, and the head's own link.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StageStats {
    /// What each stage appended as the ring's `Stats` passed it (since the stage
    /// loaded). The stage that dialed a link measured its round trip and keeps it
    /// current; the last stage's link to the head is the head's own measurement.
    pub ring: baton_proto::Stats,
    /// Latest round trip of the head's link into the first stage, in microseconds (0:
    /// in process, when the head runs the first stage itself).
    pub head_link_rtt_us: u64,
}

/// What the engine needs of a tokenizer: when generation ends, and each token's bytes.
/// libllama's vocabulary in production; a table in tests.
pub trait Vocab: Send + Sync {
    /// Whether `token` ends generation (end-of-sequence, end-of-turn, ...).
    fn is_end_of_generation(&self, token: u32) -> bool;
    /// The bytes `token` stands for in generated text (special tokens render empty).
    fn token_bytes(&self, token: u32) -> Vec<u8>;
    /// The text of `token` with control tokens rendered too (see [`Job::show`]).
    fn special_bytes(&self, token: u32) -> Vec<u8> {
        self.token_bytes(token)
    }
    /// Tokens in the vocabulary: a larger id from a stage is a fault, never looked up.
    fn n_vocab(&self) -> usize;
}

impl Vocab for baton_ggml::LlamaModel {
    fn is_end_of_generation(&self, token: u32) -> bool {
        baton_ggml::LlamaModel::is_end_of_generation(self, token)
    }

    fn token_bytes(&self, token: u32) -> Vec<u8> {
        baton_ggml::LlamaModel::token_bytes(self, token, false)
    }

    fn special_bytes(&self, token: u32) -> Vec<u8> {
        baton_ggml::LlamaModel::token_bytes(self, token, true)
    }

    fn n_vocab(&self) -> usize {
        baton_ggml::LlamaModel::n_vocab(self)
    }
}
