//! Qwen 3.5 / 3.6 dense (`qwen35`: 0.8B to 27B): a hybrid of gated DeltaNet layers and,
//! every few layers, gated attention with M-RoPE (see [`super::deltanet`]); each layer's
//! mixer is followed by a post-attention norm and a SwiGLU FFN. Multi-token-prediction
//! blocks stored after the layers are not computed.

use baton_ggml::Tensor;
use baton_gguf::Value;

use super::builder::Act;
use super::{deltanet, Architecture, Builder, LayerSizes, Rope, Shape};
use crate::hparams::{HParams, Keys};
use crate::names::FFN;
use crate::tensors::{self, LayerPlan};
use crate::weights::LayerTensors;
use crate::ModelError;

pub static ARCH: Architecture = Architecture {
    name: "qwen35",
    aliases: &[],
    rope: Rope::Imrope,
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
    deltanet::read_hparams(hp, keys, true)
}

fn tensors(t: &mut LayerPlan<'_>) {
    deltanet::mixer_tensors(t, deltanet::BetaAlpha::Separate);
    tensors::ffn(t, &FFN, t.hp.n_ff, false);
}

fn layer<'g>(b: &mut Builder<'g>, w: &LayerTensors<'g>, layer: usize, hidden: Tensor<'g>) -> Tensor<'g> {
    deltanet::layer(b, w, layer, hidden, |b, x| b.ffn(w, &FFN, Act::Silu, x))
}

fn example(shape: &Shape) -> Vec<(&'static str, Value)> {
    deltanet::example(shape)
}
