//! Gemma 3 (`gemma3`): scaled embeddings, q/k norms, queries pre-scaled, sliding-window
//! attention on most layers, a norm after attention and after the FFN, and GeGLU.

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
    name: "gemma3",
    aliases: &[],
    rope: Rope::Neox,
    rope_freqs: None,
    own_output: false,
    layer_sizes: LayerSizes::Uniform,
    hparams,
    tensors,
    layer,
    embed: super::gemma2::embed,
    logits: super::gemma2::logits,
    example,
};

/// As llama.cpp's `llama_model_gemma3` reads them.
fn hparams(hp: &mut HParams, keys: &Keys<'_>) -> Result<(), ModelError> {
    // Queries are pre-scaled by 1/sqrt(head_dim) (1/sqrt(n_embd/n_head) for the 27B);
    // the attention itself then uses scale 1.
    hp.query_scale = if hp.n_layer == 62 {
        1.0 / ((hp.n_embd / hp.n_head) as f32).sqrt()
    } else {
        1.0 / (hp.head_dim_k as f32).sqrt()
    };
    hp.attn_scale = 1.0;
    hp.final_logit_softcap = keys.opt_f32("final_logit_softcapping")?.unwrap_or(0.0);
    hp.read_sliding_window(keys, 0, 6, Some(10_000.0))?;
    if hp.n_swa > 0 {
        hp.rope_swa.freq_scale = 1.0;
    }
    Ok(())
}

fn tensors(t: &mut LayerPlan<'_>) {
    let embd = t.hp.n_embd;
    t.norm(T::AttnNorm, embd);
    tensors::attention(t, Presence::Optional);
    tensors::qk_norms(t, Presence::Required);
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

fn example(shape: &Shape) -> Vec<(&'static str, Value)> {
    // Every second layer global, so a few layers have both kinds.
    vec![
        ("attention.sliding_window", Value::U32(shape.n_swa as u32)),
        ("attention.sliding_window_pattern", Value::U32(2)),
    ]
}
