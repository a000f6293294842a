//! Qwen3-Next (`qwen3next`: 80B-A3B): the hybrid that Qwen 3.5's MoE models grew from,
//! computed as qwen35moe computes it (see [`super::qwen35moe`]) but for three things:
//! plain NeoX RoPE instead of M-RoPE, one fused projection of each key head's value
//! heads' write strengths and decays (`ssm_ba`), and key heads repeated for consecutive
//! value heads (qwen35's kernel broadcast alternates them). GGUFs converted before
//! llama.cpp split `ssm_in` into `attn_qkv` and `attn_gate` are refused (their layers
//! lack `attn_qkv`); convert them again.

use baton_gguf::Value;

use super::{deltanet, qwen35moe, Architecture, LayerSizes, Rope, Shape};
use crate::hparams::{HParams, Keys};
use crate::tensors::LayerPlan;
use crate::ModelError;

pub static ARCH: Architecture = Architecture {
    name: "qwen3next",
    aliases: &[],
    rope: Rope::Neox,
    rope_freqs: None,
    own_output: false,
    layer_sizes: LayerSizes::Uniform,
    hparams,
    tensors,
    layer: qwen35moe::layer,
    embed: super::ends::embed,
    logits: super::ends::logits,
    example,
};

fn hparams(hp: &mut HParams, keys: &Keys<'_>) -> Result<(), ModelError> {
    qwen35moe::read_hparams(hp, keys, false)
}

fn tensors(t: &mut LayerPlan<'_>) {
    deltanet::mixer_tensors(t, deltanet::BetaAlpha::Fused);
    qwen35moe::ffn_tensors(t);
}

fn example(shape: &Shape) -> Vec<(&'static str, Value)> {
    let mut keys: Vec<_> = deltanet::example(shape)
        .into_iter()
        .filter(|(key, _)| *key != "rope.dimension_sections")
        .collect();
    keys.extend(qwen35moe::expert_keys(shape));
    keys
}
