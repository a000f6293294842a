//! Gemma 2 (`gemma2`): scaled embeddings, queries pre-scaled, sliding-window attention
//! on every second layer, soft-capped attention scores and logits, a norm after
//! attention and after the FFN, and GeGLU; the output reuses the token embedding.

use baton_ggml::Tensor;
use baton_gguf::Value;

use super::builder::Act;
use super::{Architecture, Builder, LayerSizes, Rope, Shape};
use crate::hparams::{HParams, Keys};
use crate::names::{LayerTensor as T, FFN};
use crate::tensors::{self, LayerPlan, Presence};
use crate::weights::LayerTensors;
use crate::ModelError;

pub static ARCH: Architecture = Architecture {
    name: "gemma2",
    aliases: &[],
    rope: Rope::Neox,
    rope_freqs: None,
    own_output: false,
    layer_sizes: LayerSizes::Uniform,
    hparams,
    tensors,
    layer,
    embed,
    logits,
    example,
};

/// As llama.cpp's `llama_model_gemma2` reads them.
fn hparams(hp: &mut HParams, keys: &Keys<'_>) -> Result<(), ModelError> {
    // The 27B (46 layers) scales queries by n_embd / n_head instead of the head size.
    hp.query_scale = if hp.n_layer == 46 {
        1.0 / ((hp.n_embd / hp.n_head) as f32).sqrt()
    } else {
        1.0 / (hp.head_dim_k as f32).sqrt()
    };
    hp.attn_scale = 1.0;
    hp.attn_logit_softcap = keys.opt_f32("attn_logit_softcapping")?.unwrap_or(50.0);
    hp.final_logit_softcap = keys.opt_f32("final_logit_softcapping")?.unwrap_or(30.0);
    // A window of 4096 unless the file says otherwise.
    hp.read_sliding_window(keys, 4096, 2, None)?;
    Ok(())
}

fn tensors(t: &mut LayerPlan<'_>) {
    let embd = t.hp.n_embd;
    t.norm(T::AttnNorm, embd);
    tensors::attention(t, Presence::Optional);
    t.norm(T::PostAttentionNorm, embd);
    t.norm(T::FfnNorm, embd);
    tensors::ffn(t, &FFN, t.hp.n_ff, false);
    t.norm(T::PostFfwNorm, embd);
}

fn layer<'g>(b: &mut Builder<'g>, w: &LayerTensors<'g>, layer: usize, hidden: Tensor<'g>) -> Tensor<'g> {
    let cur = b.norm(hidden, w.get(T::AttnNorm));
    let cur = b.attention(w, layer, cur);
    let (cur, residual) = b.select_outputs(layer, cur, hidden);
    let cur = b.norm(cur, w.get(T::PostAttentionNorm));
    let attn_out = b.ctx.add(cur, residual);

    let cur = b.norm(attn_out, w.get(T::FfnNorm));
    let cur = b.ffn(w, &FFN, Act::Gelu, cur);
    let cur = b.norm(cur, w.get(T::PostFfwNorm));
    b.ctx.add(cur, attn_out)
}

/// Gemma's input end: the token embedding scaled by `sqrt(n_embd)`.
pub(super) fn embed<'g>(b: &Builder<'g>, tokens: Tensor<'g>) -> Tensor<'g> {
    let embd = super::ends::embed(b, tokens); // [n_embd, n_tokens]
    b.ctx.scale(embd, (b.hp.n_embd as f32).sqrt())
}

/// Gemma's output end: logits soft-capped by `tanh` at `final_logit_softcapping`
/// (none when that is 0).
pub(super) fn logits<'g>(b: &Builder<'g>, hidden: Tensor<'g>) -> Tensor<'g> {
    let logits = super::ends::logits(b, hidden); // [n_vocab, n_out]
    let cap = b.hp.final_logit_softcap;
    if cap <= 0.0 {
        return logits;
    }
    let ctx = b.ctx;
    ctx.scale(ctx.tanh(ctx.scale(logits, 1.0 / cap)), cap)
}

fn example(shape: &Shape) -> Vec<(&'static str, Value)> {
    vec![
        ("attention.sliding_window", Value::U32(shape.n_swa as u32)),
        ("attn_logit_softcapping", Value::F32(50.0)),
        ("final_logit_softcapping", Value::F32(30.0)),
    ]
}
