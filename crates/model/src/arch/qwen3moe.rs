//! Qwen 3 MoE (`qwen3moe`: Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder): qwen3's
//! attention (q/k norms, NeoX RoPE), then routed experts with softmax gating and
//! normalised weights in every layer.

use baton_ggml::Tensor;
use baton_gguf::Value;

use super::moe::{DownInput, ExpertAct, Gating, Routing};
use super::{Architecture, Builder, LayerSizes, Rope, Shape};
use crate::hparams::{HParams, Keys};
use crate::names::LayerTensor as T;
use crate::tensors::{self, LayerPlan, Presence};
use crate::weights::LayerTensors;
use crate::ModelError;

pub static ARCH: Architecture = Architecture {
    name: "qwen3moe",
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

fn hparams(hp: &mut HParams, keys: &Keys<'_>) -> Result<(), ModelError> {
    super::llama::require_plain_heads(hp)?;
    let n_layer_all = keys.u32("block_count")?;
    let n_ff = hp.n_ff;
    hp.moe.read_ff_exp(keys, n_layer_all, n_ff, false)?;
    hp.moe.require_experts("qwen3moe")
}

fn tensors(t: &mut LayerPlan<'_>) {
    let embd = t.hp.n_embd;
    t.norm(T::AttnNorm, embd);
    tensors::attention(t, Presence::Optional);
    tensors::qk_norms(t, Presence::Required);
    t.norm(T::FfnNorm, embd);
    tensors::experts(t, t.hp.moe.n_ff_exp, false);
}

fn layer<'g>(b: &mut Builder<'g>, w: &LayerTensors<'g>, layer: usize, hidden: Tensor<'g>) -> Tensor<'g> {
    let cur = b.norm(hidden, w.get(T::AttnNorm));
    let cur = b.attention(w, layer, cur);
    let (cur, residual) = b.select_outputs(layer, cur, hidden);
    let ffn_in = b.ctx.add(cur, residual); // [n_embd, n_tokens]

    let cur = b.norm(ffn_in, w.get(T::FfnNorm));
    // The GGUF's expert_weights_scale is not read for qwen3moe (llama.cpp neither).
    let routing = Routing {
        gating: Gating::Softmax,
        norm_weights: true,
        scale: 0.0,
        act: ExpertAct::Silu,
        down_input: DownInput::Backend,
    };
    let cur = b.moe(w, layer, cur, routing);
    b.ctx.add(cur, ffn_in)
}

fn example(shape: &Shape) -> Vec<(&'static str, Value)> {
    vec![
        ("expert_count", Value::U32(shape.n_expert as u32)),
        ("expert_used_count", Value::U32(shape.n_expert_used as u32)),
        ("expert_feed_forward_length", Value::U32(shape.n_ff_exp as u32)),
    ]
}
