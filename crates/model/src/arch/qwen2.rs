//! Qwen 2 / 2.5 (`qwen2`): the llama layer with q, k and v biases and NeoX RoPE.

use baton_gguf::Value;

use super::{Architecture, LayerSizes, Rope, Shape};
use crate::hparams::{HParams, Keys};
use crate::names::{LayerTensor as T, FFN};
use crate::tensors::{self, LayerPlan, Presence};
use crate::ModelError;

pub static ARCH: Architecture = Architecture {
    name: "qwen2",
    aliases: &[],
    rope: Rope::Neox,
    rope_freqs: None,
    own_output: false,
    layer_sizes: LayerSizes::Uniform,
    hparams,
    tensors,
    layer: super::llama::layer,
    embed: super::ends::embed,
    logits: super::ends::logits,
    example,
};

fn hparams(hp: &mut HParams, _keys: &Keys<'_>) -> Result<(), ModelError> {
    super::llama::require_plain_heads(hp)
}

fn tensors(t: &mut LayerPlan<'_>) {
    let embd = t.hp.n_embd;
    t.norm(T::AttnNorm, embd);
    tensors::attention(t, Presence::Usual);
    t.norm(T::FfnNorm, embd);
    tensors::ffn(t, &FFN, t.hp.n_ff, false);
}

fn example(_shape: &Shape) -> Vec<(&'static str, Value)> {
    Vec::new()
}
