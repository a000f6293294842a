//! The model's two ends as most architectures compute them: token ids to hidden states
//! on the first stage, the output norm and projection to logits on the last. An
//! architecture whose ends differ (gemma's scaled embedding and soft-capped logits)
//! names its own functions in its [`Architecture`](super::Architecture) entry.

use baton_ggml::Tensor;

use super::{hyper, Builder};
use crate::names::EndTensor;

/// Token ids i32 `[n_tokens]` → their rows of the token embedding `[n_embd, n_tokens]`
/// (with hyper-connections, copied into every stream: `[n_embd n, n_tokens]`).
pub fn embed<'g>(b: &Builder<'g>, tokens: Tensor<'g>) -> Tensor<'g> {
    let embd = b.ctx.get_rows(b.weights.end_required(EndTensor::TokenEmbd), tokens);
    match b.hp.hyper {
        Some(_) => hyper::expand(b, embd),
        None => embd,
    }
}

/// Hidden states `[n_embd, n_out]` of the rows that need logits → logits
/// `[n_vocab, n_out]` (a tensor-parallel member: its share of the vocabulary):
/// `output (rms_norm(hidden) * output_norm)`.
pub fn logits<'g>(b: &Builder<'g>, hidden: Tensor<'g>) -> Tensor<'g> {
    b.mm(b.weights.end_required(EndTensor::Output), normed(b, hidden))
}

/// Hidden states `[n_embd, n_out]` → the output norm's rows `[n_embd, n_out]`, what
/// the output projection reads and what embeddings pool (llama.cpp's `result_norm`).
/// With hyper-connections the streams `[n_embd n, n_out]` are collapsed first.
pub fn normed<'g>(b: &Builder<'g>, hidden: Tensor<'g>) -> Tensor<'g> {
    let hidden = match b.hp.hyper {
        Some(_) => hyper::collapse(b, hidden),
        None => hidden,
    };
    b.norm(hidden, b.weights.end_required(EndTensor::OutputNorm))
        .named("result_norm")
}
