//! Messages that travel between baton's nodes. This crate holds their types, their
//! encoding into frames and the authentication arithmetic; no I/O (transports live
//! in `baton-net`, which drives what is defined here).
//!
//! Every link carries one conversation, a type with exactly the messages that may
//! cross it ([`Handshake`], [`Control`], [`Fetch`], [`Heartbeat`], [`Ring`], [`Group`]);
//! [`Message`] is the union the frames encode, and a receiver turns each frame into its
//! link's conversation, so a frame of another is one [`WrongConversation`] error:
//! - the **ring**: head → first stage → … → last stage → head (`StartSeq`, `Forward`,
//!   `Sampled`, …), one frame per step per hop;
//! - the **control** conversation between the head and each worker when a cluster
//!   forms (`Describe`, `Capabilities`, `LoadPlan`, tensor streaming, `Loaded`);
//! - the **group**'s exchanges between the members of a tensor-parallel group, the
//!   **heartbeat**, a worker's **fetch** of tensors from another, and the **handshake**
//!   that opens every connection.
#![deny(unsafe_code)]

pub mod auth;
mod codec;
mod conversation;
pub mod handshake;
pub mod invite;

pub use codec::{decode, encode, encode_payload, header, parse_header, ProtoError, DEFAULT_MAX_FRAME, HEADER_LEN};
pub use conversation::{Control, Conversation, Fetch, Group, Handshake, Heartbeat, Ring, WrongConversation};

use baton_sample::{ReasoningBudget, SamplingParams};

/// Version of the wire protocol; peers with another version are refused.
/// 4: `Refused` carries a [`RefusalCode`]; a version refusal follows the server's `Hello`.
/// 5: after a handshake with a token every frame is sealed ([`auth::FrameSeal`]);
/// `Capabilities` names the head's session and `Ping` the session it watches.
/// 6: `StartSeq` carries an optional grammar; `Stats` carries each stage's busy time,
/// computed rows and bytes sent to the next hop.
/// 7: `Partial` (kind 21), the slices tensor-parallel members exchange.
/// 8: `Stats` carries the round trip of each stage's link to the next hop.
/// 9: `Capabilities` offers each device with its memory and speed; `LoadPlan` gives
/// each device its layers, and ends with the worker's place in its tensor-parallel
/// group ([`TpPlace`]); members link to each other as [`Role::Member`] and introduce
/// themselves with `JoinGroup` (kind 22); `Probe` (kind 23) times the head's link to a
/// worker before the plan.
/// 10: `ForwardBest` (kind 24): a last stage's member answers each logit row with the
/// best of its vocabulary share only.
/// 11: `Share` (kind 25): a member's answer to a step, where `Partial` numbered
/// `u64::MAX - step` stood for it.
/// 12: `Error` says what kind of failure it reports ([`Fault`]).
/// 13: `Checkpoint` (kind 26): stages keep a copy of a sequence's recurrent states.
/// 14: `LoadPlan` ends with the element types of the KV cache (`cache_type_k`,
/// `cache_type_v`), one setting for the whole ring.
/// 15: `StartSeq` ends with the sequence's [`Pooling`] (an embedding: the last stage
/// pools its rows instead of sampling) and `Pooled` (kind 27) carries the vector back.
/// Refusal code 7, `Leaving`: a draining worker refuses new heads and answers the head's
/// heartbeat with it. `FetchFrom` (kind 28): a worker receiving a stage fetches some of
/// its tensors from another worker that holds the file, on a [`Role::Fetch`] link (its
/// `StreamStart` asks, `TensorChunk`s answer).
/// Version 16: a worker serves one head per model at once (a server of several models
/// plans each over the same workers). A ring link's first frame is `JoinRing` (kind 29)
/// naming the session it joins, told the dialing stage in `LoadPlan::next_session`.
/// 17: `StartSeq` ends with the sequence's thinking budget
/// ([`ReasoningBudget`](baton_sample::ReasoningBudget)), which the last stage enforces.
pub const PROTOCOL_VERSION: u32 = 17;

/// Most workers one `StreamStart` may send a worker to with `FetchFrom` (the head
/// shares a stage among at most this many holders; a worker refuses more).
pub const MAX_FETCH_PEERS: usize = 16;

/// Most values a `Pooled` vector may carry: far above any model's width (the head
/// also checks it equals its model's `n_embd`).
pub const MAX_POOLED_WIDTH: usize = 1 << 16;

/// Most members a tensor-parallel group may have (the head never plans more; a
/// `LoadPlan` naming more is refused at decoding).
pub const MAX_TP_MEMBERS: usize = 64;

/// The longest heartbeat timeout a head may ask of a worker (`Ping::timeout_ms`): an hour.
pub const MAX_HEARTBEAT_MS: u32 = 3_600_000;

/// Identifies one forward step so replies can be matched to requests.
pub type StepId = u64;

/// What a stage computes on: token ids (into the first stage) or hidden states.
#[derive(Clone, Debug, PartialEq)]
pub enum Payload {
    /// Token ids, one per batch row.
    Tokens(Vec<u32>),
    /// Hidden states `[width, n_tokens]`, f32, row-major by token: the model's
    /// hidden width between stages (`n_embd`, times the streams of a model with
    /// hyper-connections).
    Hidden(Vec<f32>),
    /// Hidden states as f16 (`--wire-dtype f16`: half the bytes). Row `r` holds
    /// `x / 2^row_exps[r]` so that rows beyond f16's range (gemma3's residual stream
    /// passes 65504) stay finite; built by [`Payload::f16_rows`].
    HiddenF16 {
        /// f16 bit patterns, row-major by token.
        values: Vec<u16>,
        /// Power-of-two scale of each row (0 for rows that fit f16 as they are).
        row_exps: Vec<u8>,
    },
}

/// Largest row scale accepted (2^40 × 65504 is far beyond any activation).
pub const MAX_ROW_EXP: u8 = 40;

impl Payload {
    /// Hidden states `[n_embd, n_rows]` as scaled f16 rows. A row whose largest
    /// magnitude fits below 2^15 goes unscaled (bit-identical to plain f16); a larger
    /// one is divided by the power of two that brings it there, which costs no
    /// precision beyond f16's own.
    pub fn f16_rows(hidden: &[f32], n_rows: usize) -> Payload {
        let n_embd = hidden.len() / n_rows.max(1);
        let mut values = Vec::with_capacity(hidden.len());
        let mut row_exps = Vec::with_capacity(n_rows);
        for row in hidden.chunks(n_embd.max(1)) {
            let max = row.iter().fold(0f32, |m, x| m.max(x.abs()));
            let exp = if max.is_finite() && max > 32768.0 {
                ((max / 32768.0).log2().ceil() as u8).min(MAX_ROW_EXP)
            } else {
                0
            };
            let scale = (-(exp as f32)).exp2();
            values.extend(row.iter().map(|&x| half::f16::from_f32(x * scale).to_bits()));
            row_exps.push(exp);
        }
        Payload::HiddenF16 { values, row_exps }
    }

    /// Widens `HiddenF16` rows back to f32 (`None` for other payloads).
    pub fn widen_f16(&self) -> Option<Vec<f32>> {
        let Payload::HiddenF16 { values, row_exps } = self else {
            return None;
        };
        let n_embd = values.len() / row_exps.len().max(1);
        let mut out = Vec::with_capacity(values.len());
        for (row, &exp) in values.chunks(n_embd.max(1)).zip(row_exps) {
            let scale = (exp as f32).exp2();
            out.extend(row.iter().map(|&bits| half::f16::from_bits(bits).to_f32() * scale));
        }
        Some(out)
    }
}

/// One batch going through the stages.
#[derive(Clone, Debug, PartialEq)]
pub struct Forward {
    /// Step identifier chosen by the head.
    pub step: StepId,
    /// Tokens or hidden states.
    pub payload: Payload,
    /// Position of each row in its sequence.
    pub positions: Vec<i32>,
    /// Sequence of each row.
    pub seq_ids: Vec<u32>,
    /// Rows the last stage samples a token for (each row's sequence's sampler is used).
    pub sample_rows: Vec<u32>,
    /// The token each row stands for, when some sequence has drafted tokens to verify
    /// (empty otherwise): a sequence with several sampled rows, in order, is a draft.
    /// The last stage samples its rows one after another and stops at the first sample
    /// that differs from the next row's token; every sample up to there is returned.
    pub row_tokens: Vec<u32>,
}

/// A token chosen by the last stage for one sampled row.
#[derive(Clone, Debug, PartialEq)]
pub struct SampledToken {
    /// Sequence the token belongs to.
    pub seq: u32,
    /// The token id.
    pub token: u32,
    /// Log-probability of the token under the model (before truncation and temperature);
    /// NaN unless the sequence asked for log-probabilities.
    pub logprob: f32,
    /// The most likely tokens and their log-probabilities, best first (as many as the
    /// sequence's `top_logprobs`; empty otherwise).
    pub top: Vec<(u32, f32)>,
}

/// Why a node refused a connection or a request, as programs tell the cases apart (the
/// `Refused` message's reason says it for people). The numbers are stable on the wire: a
/// new code takes a new number and a retired one is never reused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RefusalCode {
    /// The worker cannot take this connection now: it serves another head, or holds as
    /// many connections as it allows (the reason says which; it may be free again in a
    /// moment).
    Busy,
    /// The token proof failed, or only one of the two sides has a token.
    Auth,
    /// The peer speaks another protocol version.
    Version,
    /// This node runs with TLS and the peer spoke plain TCP.
    TlsRequired,
    /// A message or role that does not belong at this point of the conversation.
    BadRequest,
    /// The worker could not load the stage it was told to (file missing or damaged,
    /// streamed tensors wrong, not enough memory).
    LoadFailed,
    /// The worker is leaving the cluster (it was told to stop and drains): the head
    /// forms its ring without it.
    Leaving,
}

impl RefusalCode {
    /// Every code, in wire-number order.
    pub const ALL: [RefusalCode; 7] = [
        RefusalCode::Busy,
        RefusalCode::Auth,
        RefusalCode::Version,
        RefusalCode::TlsRequired,
        RefusalCode::BadRequest,
        RefusalCode::LoadFailed,
        RefusalCode::Leaving,
    ];

    /// The code's number on the wire.
    pub fn number(self) -> u16 {
        match self {
            RefusalCode::Busy => 1,
            RefusalCode::Auth => 2,
            RefusalCode::Version => 3,
            RefusalCode::TlsRequired => 4,
            RefusalCode::BadRequest => 5,
            RefusalCode::LoadFailed => 6,
            RefusalCode::Leaving => 7,
        }
    }

    /// The code with wire number `number`, if there is one.
    pub fn from_number(number: u16) -> Option<RefusalCode> {
        RefusalCode::ALL.into_iter().find(|code| code.number() == number)
    }
}

/// What kind of failure a stage reports in `Error`, so that the head can answer a
/// request that cannot be served differently from a stage that is unwell. The numbers
/// are stable on the wire: a new kind takes a new number and a retired one is never
/// reused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Fault {
    /// This request cannot be served as asked (its grammar, its sampling parameters, a
    /// token outside the vocabulary): it fails; the ring is fine.
    Request,
    /// The stage's KV cache has no room for the batch: the request fails; the ring is
    /// fine and may take it again when load is lower.
    CacheFull,
    /// The computation itself failed (ggml, a device, a tensor-parallel exchange).
    Compute,
    /// The message was malformed or did not belong at this point.
    Protocol,
}

impl Fault {
    /// Every kind, in wire-number order.
    pub const ALL: [Fault; 4] = [Fault::Request, Fault::CacheFull, Fault::Compute, Fault::Protocol];

    /// The kind's number on the wire.
    pub fn number(self) -> u16 {
        match self {
            Fault::Request => 1,
            Fault::CacheFull => 2,
            Fault::Compute => 3,
            Fault::Protocol => 4,
        }
    }

    /// The kind with wire number `number`, if there is one.
    pub fn from_number(number: u16) -> Option<Fault> {
        Fault::ALL.into_iter().find(|fault| fault.number() == number)
    }
}

/// How the last stage turns a sequence's rows into one vector (an embedding), as
/// llama.cpp's pooling types: each row is the last layer's output after the output norm
/// (before the output projection). The numbers are stable on the wire; 0 means the
/// sequence generates (it is sampled, not pooled).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Pooling {
    /// The mean of every row of the sequence.
    Mean,
    /// The first row (the `[CLS]` token of encoder models).
    Cls,
    /// The last row.
    Last,
}

impl Pooling {
    /// Every pooling, in wire-number order.
    pub const ALL: [Pooling; 3] = [Pooling::Mean, Pooling::Cls, Pooling::Last];

    /// The pooling's number on the wire.
    pub fn number(self) -> u8 {
        match self {
            Pooling::Mean => 1,
            Pooling::Cls => 2,
            Pooling::Last => 3,
        }
    }

    /// The pooling with wire number `number`, if there is one.
    pub fn from_number(number: u8) -> Option<Pooling> {
        Pooling::ALL.into_iter().find(|p| p.number() == number)
    }

    /// The name llama.cpp's `--pooling` and GGUF's `pooling_type` use: `mean`, `cls`, `last`.
    pub fn name(self) -> &'static str {
        match self {
            Pooling::Mean => "mean",
            Pooling::Cls => "cls",
            Pooling::Last => "last",
        }
    }
}

/// Who opens a connection, announced in `Hello`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// The head, connecting to a worker to plan and drive it.
    Head,
    /// A worker, answering a connection.
    Worker,
    /// A stage connecting to the next stage of the ring (its first frame is
    /// `JoinRing`; hidden states flow on it).
    Ring,
    /// The head watching a worker: `Ping` / `Pong` on a connection of their own, so a
    /// worker busy computing still answers, and a hung one is noticed.
    Heartbeat,
    /// A member of a tensor-parallel group connecting to another member of its group
    /// (its first frame is `JoinGroup`); the group's exchanges flow on it.
    Member,
    /// A worker fetching tensors from another worker that holds the model file: it sends
    /// `StreamStart` with the model's header and the tensors it wants, and gets
    /// `TensorChunk`s back.
    Fetch,
}

/// A model as the head names it to workers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelRef {
    /// File name (no directories: workers resolve it inside their models directory).
    pub file_name: String,
    /// Hash over the GGUF header and tensor index (cheap, identifies the model).
    pub identity: [u8; 32],
    /// Size of the file in bytes.
    pub size: u64,
}

/// A GGUF file a worker holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HeldModel {
    /// File name inside the worker's models directory.
    pub file_name: String,
    /// Header-and-index hash (see [`ModelRef::identity`]).
    pub identity: [u8; 32],
    /// Size in bytes.
    pub size: u64,
    /// Whether every tensor is present (a file received by streaming may hold only
    /// the tensors of the stage the worker ran before).
    pub complete: bool,
    /// SHA-256 of the whole file, once the worker has computed it: it hashes a file in
    /// the background the first time it lists it, and keeps the result on its disk.
    pub content: Option<[u8; 32]>,
}

/// One device a worker offers; the head plans a layer range for each.
#[derive(Clone, Debug, PartialEq)]
pub struct DeviceCaps {
    /// The backend device's name, e.g. `CPU`, `Vulkan0`, `CUDA0`.
    pub name: String,
    /// Bytes of memory the worker offers on it.
    pub memory: u64,
    /// Measured seconds per token per layer for the described model on this device
    /// (generation, one token), when the worker holds the model; cached on its disk.
    pub secs_per_layer: Option<f32>,
}

/// What a worker offers, sent once in answer to `Describe`.
#[derive(Clone, Debug, PartialEq)]
pub struct Capabilities {
    /// Its devices, in the order its stages chain; at least one.
    pub devices: Vec<DeviceCaps>,
    /// Compute threads.
    pub threads: u32,
    /// GGUF files in the worker's models directory.
    pub models: Vec<HeldModel>,
    /// Address other stages reach this worker's ring port at.
    pub ring_addr: String,
    /// The session this head's connection opened on the worker (random): the head's
    /// heartbeat names it in every `Ping`, so that a heartbeat ends only its own session.
    pub session: u64,
}

impl DeviceCaps {
    /// The CPU, offering `memory` bytes at `secs_per_layer`.
    pub fn cpu(memory: u64, secs_per_layer: Option<f32>) -> DeviceCaps {
        DeviceCaps {
            name: "CPU".into(),
            memory,
            secs_per_layer,
        }
    }
}

impl Capabilities {
    /// Bytes the worker offers on all its devices together.
    pub fn memory(&self) -> u64 {
        self.devices.iter().map(|d| d.memory).fold(0, u64::saturating_add)
    }
}

/// The layers of a stage that one of the worker's devices computes: from where the
/// device before it stopped (or the stage's first layer) to `layer_end`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceRange {
    /// A device the worker offered.
    pub device: String,
    /// One past the device's last layer.
    pub layer_end: u32,
}

/// What the head tells a worker to load.
#[derive(Clone, Debug, PartialEq)]
pub struct LoadPlan {
    /// The model.
    pub model: ModelRef,
    /// First global layer of the stage.
    pub layer_start: u32,
    /// One past its last layer.
    pub layer_end: u32,
    /// Whether the stage embeds tokens.
    pub first: bool,
    /// Whether the stage produces logits and samples.
    pub last: bool,
    /// KV cache cells.
    pub n_ctx: u32,
    /// Sequences with a region of `n_ctx / n_seq` cells each; 0: shared cells.
    pub n_seq: u32,
    /// Ring address of the next stage; `None` for the last stage (it answers the head).
    pub next: Option<String>,
    /// The session the next stage's worker opened for this head: the ring link names it
    /// in its `JoinRing`, so that a worker serving several heads (one per model) knows
    /// whose ring the link is. 0 with no next stage.
    pub next_session: u64,
    /// Whether the head streams the stage's tensors (the worker lacks them).
    pub stream: bool,
    /// Send hidden states as f16.
    pub wire_f16: bool,
    /// Copy repackable weights (llama.cpp's default).
    pub repack: bool,
    /// How the stage's layers lie on the worker's devices, in order; the last ends at
    /// `layer_end`. Empty: the worker splits them evenly between its devices.
    pub devices: Vec<DeviceRange>,
    /// The worker's place in a tensor-parallel group that computes this stage together
    /// (`None`: it computes the whole stage alone). Every member gets the same layers;
    /// member 0 sits in the ring (`next` is its), the others answer member 0 only.
    pub tp: Option<TpPlace>,
    /// Element type of the cached keys, as llama.cpp's `-ctk` names it (`f16`, `q8_0`):
    /// the head chooses one setting for the whole ring, and the worker refuses a name
    /// it does not know.
    pub cache_type_k: String,
    /// Element type of the cached values (`-ctv`).
    pub cache_type_v: String,
}

/// A worker's place in a tensor-parallel group (see [`LoadPlan::tp`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TpPlace {
    /// The group, named by a random number the head chose for this ring: a member
    /// link that names another group is refused.
    pub group: u64,
    /// This worker's rank in the group (0 drives the others and sits in the ring).
    pub rank: u32,
    /// Every member's address (where other workers reach its listener), by rank;
    /// 2 to [`MAX_TP_MEMBERS`] of them.
    pub members: Vec<String>,
}

/// One tensor the head will stream, with the hash the worker must verify.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorEntry {
    /// Tensor name.
    pub name: String,
    /// Absolute offset of its bytes in the GGUF file.
    pub offset: u64,
    /// Length in bytes.
    pub len: u64,
    /// SHA-256 of its bytes.
    pub sha256: [u8; 32],
}

/// Every message of the protocol: what a frame encodes, whichever link it crosses.
/// Receivers match on their link's conversation ([`Ring`], [`Control`], …), which
/// holds only the messages that may arrive there.
#[derive(Clone, Debug, PartialEq)]
pub enum Message {
    // --- handshake (first frames on every connection) ---
    /// Opens a connection: protocol version, role, and a fresh random challenge.
    Hello { version: u32, role: Role, nonce: [u8; 32] },
    /// Proof of the cluster secret: HMAC over the peer's challenge (see [`auth`]).
    Auth { proof: [u8; 32] },
    /// The peer refuses the connection or a request, says why in words for people and
    /// in a code for programs (then closes the connection).
    Refused { code: RefusalCode, reason: String },

    // --- control: head ↔ worker ---
    /// Head → worker: describe yourself for this model.
    Describe { model: ModelRef },
    /// Worker → head.
    Capabilities(Capabilities),
    /// Head → worker: load this.
    LoadPlan(Box<LoadPlan>),
    /// Head → worker (streaming): the file's header and tensor index, and the tensors
    /// that will follow.
    StreamStart { header: Vec<u8>, tensors: Vec<TensorEntry> },
    /// Head → worker (streaming): bytes of tensor `index` of `StreamStart`, at `offset`
    /// within that tensor.
    TensorChunk { index: u32, offset: u64, data: Vec<u8> },
    /// Head → worker (streaming, after the worker's `StreamStart`): fetch tensors
    /// `tensors` (indices into the head's `StreamStart`) from the worker at `peer`, which
    /// holds the file, while the head sends the others. At most one per peer.
    FetchFrom { peer: String, tensors: Vec<u32> },
    /// Worker → head: the stage is loaded and its ring links are up.
    Loaded { resident: u64, received: u64 },

    // --- ring ---
    /// Start (or restart) a sequence (see [`StartSeq`]).
    StartSeq(StartSeq),
    /// Keep only the first `len` tokens of `seq` on every stage.
    TruncateSeq { seq: u32, len: u32 },
    /// Keep a copy of `seq`'s recurrent states after its first `len` tokens on every
    /// stage (models with recurrent layers; the others have none), which a later
    /// `StartSeq` or `TruncateSeq` to `len` continues from.
    Checkpoint { seq: u32, len: u32 },
    /// Forget `seq` on every stage (cache and sampler).
    EndSeq { seq: u32 },
    /// A batch to compute.
    Forward(Forward),
    /// The last stage's answer to a `Forward`: one token per sampled row.
    Sampled { step: StepId, tokens: Vec<SampledToken> },
    /// The last stage's answer to a `Forward` that ends a pooled sequence (the only
    /// sequence whose row it samples): the pooled rows, L2-normalized, `n_embd` values
    /// (at most [`MAX_POOLED_WIDTH`]); NaN is refused.
    Pooled { step: StepId, seq: u32, values: Vec<f32> },
    /// The last stage's answer to a control message.
    Done,
    /// A stage failed to handle a message; the ring drops it and reports this. The
    /// stage is named by the first (global) layer it holds, which every node knows
    /// without knowing the ring's order; `fault` says what failed to programs,
    /// `message` to people.
    Error {
        first_layer: u32,
        fault: Fault,
        message: String,
    },
    /// Each stage appends its figures and passes the message on; the head gets one
    /// entry per stage in each list, in ring order.
    Stats(Stats),
    /// Stop the stage's loop.
    Shutdown,

    // --- heartbeat: head ↔ worker, on a connection of its own ---
    /// Head → worker: are you there? The worker ends session `session` (from
    /// [`Capabilities::session`]) when no `Ping` comes within `timeout_ms` (the head is
    /// gone or hung). A heartbeat that names no current session (0, or one that ended)
    /// is answered and ends nothing: a bare probe of whether the worker is up.
    /// `timeout_ms` is at most [`MAX_HEARTBEAT_MS`]: a worker refuses a longer one, which
    /// would hold a connection slot for weeks.
    Ping { timeout_ms: u32, session: u64 },
    /// Worker → head: yes.
    Pong,

    // --- tensor parallelism: member ↔ member ---
    /// A member's partial result for its group's collective number `sum`: `n_embd`
    /// values per row to be gathered or summed (after attention, after the FFN). NaN is
    /// refused, as in hidden states.
    /// (Only members of a tensor-parallel group send it; older nodes never see one.)
    Partial { sum: u64, values: Vec<f32> },
    /// The first frame on a [`Role::Member`] link: the dialing member's group (from its
    /// [`TpPlace`]) and rank.
    JoinGroup { group: u64, rank: u32 },
    /// The first frame on a [`Role::Ring`] link: the session of the worker it joins
    /// (the head's [`LoadPlan::next_session`] for the dialing stage).
    JoinRing { session: u64 },
    /// Member 0 → another member of a last stage's group: a `Forward` whose logit rows
    /// are to be answered with each row's best of the member's share only (`Partial`
    /// values `[value, token]` per row, the token a whole number in f32, `[-inf, -1]`
    /// for a share of only NaN): what greedy sampling without penalties needs.
    ForwardBest(Forward),
    /// Another member → member 0, on a last stage: its answer to step `step`'s
    /// `Forward` (its share of each logit row's vocabulary) or `ForwardBest` (each
    /// row's best of that share, as `[value, token]`). NaN is refused.
    Share { step: u64, values: Vec<f32> },

    // --- link measurement: head ↔ worker, before the plan ---
    /// Head → worker, between `Describe` and `LoadPlan`: `data` is filler whose time on
    /// the wire the head measures; the worker answers with an empty `Probe` at once.
    Probe { data: Vec<u8> },
}

/// Start (or restart) sequence `seq`: keep only the first `keep` tokens of its cache
/// on every stage (0 forgets it; more reuses a prefix); the last stage creates its
/// sampler with `params`, seeding penalties with `history`, and computes
/// log-probabilities of sampled tokens (and the `top_logprobs` best alternatives) only
/// when `logprobs` is set (it costs a pass over the vocabulary per token). With
/// `pooling` the sequence is an embedding instead: the last stage keeps its rows and
/// answers the `Forward` that samples its last row with `Pooled`.
///
/// Outside this crate the one way to build one is [`StartSeq::new`] and what follows
/// it: a fresh sequence with its sampler settings and history, then what differs.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct StartSeq {
    /// The sequence.
    pub seq: u32,
    /// Cached tokens kept.
    pub keep: u32,
    /// The sampler's settings.
    pub params: SamplingParams,
    /// Tokens that seed the penalties.
    pub history: Vec<u32>,
    /// Alternatives returned with each sampled token's log-probability.
    pub top_logprobs: u8,
    /// Whether sampled tokens carry log-probabilities.
    pub logprobs: bool,
    /// Random draws the sequence's sampler already made (it skips them): a sequence
    /// rebuilt after a node was lost continues the same random stream.
    pub drawn: u32,
    /// GBNF grammar the generated text must follow (the last stage masks every token it
    /// does not allow); the last `drawn` tokens of `history` were already generated
    /// under it.
    pub grammar: Option<String>,
    /// Pool the sequence's rows into one vector instead of sampling.
    pub pooling: Option<Pooling>,
    /// A budget of thinking tokens the last stage enforces (it forces the end tag when
    /// the budget is spent, as llama.cpp's server does); replayed over the last `drawn`
    /// tokens of `history` (boxed: most sequences have none).
    pub budget: Option<Box<ReasoningBudget>>,
}

/// The figures each stage appends to a `Stats` message as it passes it on, one entry
/// per stage in each list, in ring order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    /// Resident bytes.
    pub resident: Vec<u64>,
    /// KV cache cells in use.
    pub kv_used: Vec<u32>,
    /// Microseconds spent computing.
    pub busy_us: Vec<u64>,
    /// Token rows computed.
    pub rows: Vec<u64>,
    /// Bytes sent to the next hop.
    pub link_sent: Vec<u64>,
    /// The latest round trip measured on the link to the next hop, in microseconds (0
    /// where none was: in process, or the stage did not dial the link).
    pub link_rtt_us: Vec<u64>,
}

impl StartSeq {
    /// Sequence `seq` from an empty cache, sampling with `params`, penalties seeded with
    /// `history`; no log-probabilities, no random draws made yet.
    pub fn new(seq: u32, params: SamplingParams, history: Vec<u32>) -> StartSeq {
        StartSeq {
            seq,
            keep: 0,
            params,
            history,
            top_logprobs: 0,
            logprobs: false,
            drawn: 0,
            grammar: None,
            pooling: None,
            budget: None,
        }
    }

    /// Keeps the first `keep` cached tokens (a reused prefix).
    pub fn keeping(mut self, keep: u32) -> StartSeq {
        self.keep = keep;
        self
    }

    /// Computes log-probabilities (and `top` alternatives) of sampled tokens.
    pub fn with_logprobs(mut self, logprobs: bool, top: u8) -> StartSeq {
        self.logprobs = logprobs;
        self.top_logprobs = if logprobs { top } else { 0 };
        self
    }

    /// Skips `drawn` random draws (a sequence rebuilt on a new ring).
    pub fn with_drawn(mut self, drawn: u32) -> StartSeq {
        self.drawn = drawn;
        self
    }

    /// Constrains the generated text to a GBNF grammar.
    pub fn with_grammar(mut self, grammar: Option<String>) -> StartSeq {
        self.grammar = grammar;
        self
    }

    /// Pools the sequence's rows into an embedding instead of sampling.
    pub fn with_pooling(mut self, pooling: Option<Pooling>) -> StartSeq {
        self.pooling = pooling;
        self
    }

    /// Limits the sequence's thinking to a budget of tokens.
    pub fn with_budget(mut self, budget: Option<ReasoningBudget>) -> StartSeq {
        self.budget = budget.map(Box::new);
        self
    }
}

impl From<StartSeq> for Message {
    fn from(s: StartSeq) -> Message {
        Message::StartSeq(s)
    }
}

impl Message {
    /// The message's name, for logs and errors.
    pub fn kind(&self) -> &'static str {
        codec::name_of(self)
    }
}
