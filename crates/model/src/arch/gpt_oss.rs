//! gpt-oss (`gpt-oss`: gpt-oss-20b, gpt-oss-120b): attention with biases and per-head
//! sinks, sliding-window layers alternating with global ones, YaRN RoPE; every layer
//! routes through experts with biases, softmax over the chosen experts' logits and
//! gpt-oss's clamped SwiGLU. Every row runs through all layers; the rows that need
//! logits are kept only before the output norm, as llama.cpp does.

use baton_ggml::Tensor;
use baton_gguf::Value;

use super::moe::{DownInput, ExpertAct, Gating, Routing};
use super::{Architecture, Builder, LayerSizes, Rope, Shape};
use crate::hparams::{HParams, Keys};
use crate::names::LayerTensor as T;
use crate::tensors::{self, Dim, LayerPlan, Presence, Split};
use crate::weights::LayerTensors;
use crate::ModelError;

pub static ARCH: Architecture = Architecture {
    name: "gpt-oss",
    aliases: &[],
    rope: Rope::Neox,
    rope_freqs: None,
    own_output: true,
    layer_sizes: LayerSizes::Uniform,
    hparams,
    tensors,
    layer,
    embed: super::ends::embed,
    logits: super::ends::logits,
    example,
};

/// As llama.cpp's `llama_model_openai_moe` reads them.
fn hparams(hp: &mut HParams, keys: &Keys<'_>) -> Result<(), ModelError> {
    let n_rot = hp.rope.n_dims as usize;
    if hp.head_dim_k != n_rot || hp.head_dim_v != n_rot {
        return Err(ModelError::BadHParams(format!(
            "gpt-oss needs heads as wide as RoPE (key {}, value {}, rope {n_rot})",
            hp.head_dim_k, hp.head_dim_v
        )));
    }
    let n_layer_all = keys.u32("block_count")?;
    let n_ff = hp.n_ff;
    hp.moe.read_ff_exp(keys, n_layer_all, n_ff, true)?;
    hp.moe.require_experts("gpt-oss")?;
    // The window is required; every second layer slides unless the file says otherwise.
    keys.u32("attention.sliding_window")?;
    hp.read_sliding_window(keys, 0, 2, None)?;
    hp.attn_scale = 1.0 / (n_rot as f32).sqrt();
    Ok(())
}

fn tensors(t: &mut LayerPlan<'_>) {
    let hp = t.hp;
    let (embd, n_ff_exp, n_expert) = (hp.n_embd, hp.moe.n_ff_exp, hp.moe.n_expert);
    t.norm(T::AttnNorm, embd);
    tensors::attention(t, Presence::Usual);
    t.vec(T::AttnOutputBias, &[embd], Split::Rows(Dim::Embd));
    // One sink per query head.
    t.vec(T::AttnSinks, &[hp.n_head], Split::Rows(Dim::QHeads(1)));
    t.norm(T::PostAttentionNorm, embd);
    tensors::experts(t, n_ff_exp, false);
    t.vec(T::FfnGateInpBias, &[n_expert], Split::Whole);
    t.vec(T::FfnGateExpsBias, &[n_ff_exp, n_expert], Split::EachRow(Dim::FfExp));
    t.vec(T::FfnUpExpsBias, &[n_ff_exp, n_expert], Split::EachRow(Dim::FfExp));
    t.vec(T::FfnDownExpsBias, &[embd, n_expert], Split::EachRow(Dim::Embd));
}

fn layer<'g>(b: &mut Builder<'g>, w: &LayerTensors<'g>, layer: usize, hidden: Tensor<'g>) -> Tensor<'g> {
    let cur = b.norm(hidden, w.get(T::AttnNorm));
    let cur = b.attention(w, layer, cur); // biases and sinks: the layer has them
    let ffn_in = b.ctx.add(cur, hidden); // [n_embd, n_tokens]

    let cur = b.norm(ffn_in, w.get(T::PostAttentionNorm));
    let routing = Routing {
        gating: Gating::SoftmaxWeight,
        norm_weights: false,
        scale: b.hp.moe.weights_scale,
        act: ExpertAct::SwigluOai,
        down_input: DownInput::Backend,
    };
    let cur = b.moe(w, layer, cur, routing);
    b.ctx.add(cur, ffn_in)
}

fn example(shape: &Shape) -> Vec<(&'static str, Value)> {
    // YaRN as the real models have it (factor 32 over 4096 trained positions).
    vec![
        ("expert_count", Value::U32(shape.n_expert as u32)),
        ("expert_used_count", Value::U32(shape.n_expert_used as u32)),
        ("expert_feed_forward_length", Value::U32(shape.n_ff_exp as u32)),
        ("attention.sliding_window", Value::U32(shape.n_swa as u32)),
        ("rope.freq_base", Value::F32(150_000.0)),
        ("rope.scaling.type", Value::Str("yarn".into())),
        ("rope.scaling.factor", Value::F32(32.0)),
        ("rope.scaling.original_context_length", Value::U32(4096)),
    ]
}
