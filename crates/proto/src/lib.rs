//! Messages that travel around the ring: head → first stage → … → last stage → head.
//! This crate holds their types only; no I/O (transports live in `baton-net`).
#![deny(unsafe_code)]

use baton_sample::SamplingParams;

/// Identifies one forward step so replies can be matched to requests.
pub type StepId = u64;

/// What a stage computes on: token ids (into the first stage) or hidden states.
#[derive(Clone, Debug, PartialEq)]
pub enum Payload {
    /// Token ids, one per batch row.
    Tokens(Vec<u32>),
    /// Hidden states `[n_embd, n_tokens]`, f32, row-major by token.
    Hidden(Vec<f32>),
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
}

/// A token chosen by the last stage for one sampled row.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SampledToken {
    /// Sequence the token belongs to.
    pub seq: u32,
    /// The token id.
    pub token: u32,
    /// Log-probability of the token under the model (before truncation and temperature);
    /// NaN unless the sequence asked for log-probabilities.
    pub logprob: f32,
}

/// Every message of the ring protocol.
#[derive(Clone, Debug, PartialEq)]
pub enum Message {
    /// Start (or restart) sequence `seq`: forget its cache on every stage; the last stage
    /// creates its sampler with `params`, seeding penalties with `history`, and computes
    /// log-probabilities of sampled tokens only when `logprobs` is set (it costs a pass
    /// over the vocabulary per token).
    StartSeq {
        seq: u32,
        params: SamplingParams,
        history: Vec<u32>,
        logprobs: bool,
    },
    /// Keep only the first `len` tokens of `seq` on every stage.
    TruncateSeq { seq: u32, len: u32 },
    /// Forget `seq` on every stage (cache and sampler).
    EndSeq { seq: u32 },
    /// A batch to compute.
    Forward(Forward),
    /// The last stage's answer to a `Forward`: one token per sampled row.
    Sampled { step: StepId, tokens: Vec<SampledToken> },
    /// The last stage's answer to a control message.
    Done,
    /// A stage failed to handle a message; the ring drops it and reports this.
    Error { stage: u32, message: String },
    /// Each stage appends its resident bytes and passes the message on; the head gets
    /// one entry per stage, in ring order.
    Stats { resident: Vec<u64> },
    /// Stop the stage's loop.
    Shutdown,
}
