//! Phi-3 and Phi-4 (`phi3`): fused q/k/v projection, queries pre-scaled, a fused
//! gate-and-up projection with SwiGLU. llama.cpp ignores Phi's sliding window, and so
//! does baton; LongRoPE models (`rope_factors_long`/`_short`, the 128k variants) are
//! refused by the loader (their factors depend on the context size).

use baton_ggml::Tensor;
use baton_gguf::Value;

use super::builder::Shard;
use super::{Architecture, Builder, LayerSizes, Rope, Shape};
use crate::hparams::{HParams, Keys};
use crate::names::LayerTensor as T;
use crate::tensors::{Dim, LayerPlan, Split};
use crate::weights::LayerTensors;
use crate::ModelError;

pub static ARCH: Architecture = Architecture {
    name: "phi3",
    aliases: &[],
    rope: Rope::Neox,
    rope_freqs: None,
    own_output: false,
    layer_sizes: LayerSizes::Uniform,
    hparams,
    tensors,
    layer,
    embed: super::ends::embed,
    logits: super::ends::logits,
    example,
};

/// As llama.cpp's `llama_model_phi3` reads them.
fn hparams(hp: &mut HParams, _keys: &Keys<'_>) -> Result<(), ModelError> {
    if hp.head_dim_v != hp.head_dim_k || hp.head_dim_k * hp.n_head != hp.n_embd {
        return Err(ModelError::BadHParams(format!(
            "phi3 needs heads that tile the model's width ({} heads of {} and {} for {})",
            hp.n_head, hp.head_dim_k, hp.head_dim_v, hp.n_embd
        )));
    }
    hp.query_scale = 1.0 / (hp.head_dim_k as f32).sqrt();
    hp.attn_scale = 1.0;
    Ok(())
}

fn tensors(t: &mut LayerPlan<'_>) {
    let hp = t.hp;
    let (embd, kv) = (hp.n_embd, hp.n_embd_k_gqa());
    let d = hp.head_dim_k;
    t.norm(T::AttnNorm, embd);
    // Phi files fuse q, k and v; separate ones are taken when a file has them.
    if t.file_has(T::AttnQ) {
        t.mat(T::AttnQ, &[embd, embd], Split::Rows(Dim::QHeads(d)));
        t.mat(T::AttnK, &[embd, kv], Split::Rows(Dim::KvHeads(d)));
        t.mat(T::AttnV, &[embd, kv], Split::Rows(Dim::KvHeads(d)));
    } else {
        let qkv = vec![Dim::QHeads(d), Dim::KvHeads(d), Dim::KvHeads(d)];
        t.mat(T::AttnQkv, &[embd, embd + 2 * kv], Split::Fused(qkv));
    }
    t.mat(T::AttnOutput, &[embd, embd], Split::Rows(Dim::Embd));
    t.norm(T::FfnNorm, embd);
    // Gate and up fused: `[gate | up]` rows.
    t.mat(T::FfnUp, &[embd, 2 * hp.n_ff], Split::Fused(vec![Dim::Ff, Dim::Ff]));
    t.mat(T::FfnDown, &[hp.n_ff, embd], Split::Rows(Dim::Embd));
}

fn layer<'g>(b: &mut Builder<'g>, w: &LayerTensors<'g>, layer: usize, hidden: Tensor<'g>) -> Tensor<'g> {
    let cur = b.norm(hidden, w.get(T::AttnNorm));
    let cur = b.attention(w, layer, cur);
    let (cur, residual) = b.select_outputs(layer, cur, hidden);
    let ffn_in = b.ctx.add(cur, residual); // [n_embd, n_tokens]

    let cur = b.norm(ffn_in, w.get(T::FfnNorm));
    let gate_up = b.mm(w.get(T::FfnUp), cur); // [2 n_ff, n_tokens]

    // A tensor-parallel member: its rows of gate and of up, its rows of the output.
    let hidden = b.gather(b.ctx.swiglu(gate_up), Shard::Ff);
    let cur = b.gather(b.mm(w.get(T::FfnDown), hidden), Shard::Embd);
    b.ctx.add(ffn_in, cur)
}

fn example(_shape: &Shape) -> Vec<(&'static str, Value)> {
    Vec::new()
}
