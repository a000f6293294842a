//! DeepSeek V3.2 (`deepseek32`): DeepSeek V3's layer (see [`deepseek2`]) whose MLA
//! attends sparsely: a lightning indexer chooses the `top_k` cached tokens each query
//! attends to (see [`dsa`](super::dsa)), keeping its own key per token in the KV
//! cache. Experts' gating function must be given (llama.cpp has no default for it).

use baton_ggml::Tensor;
use baton_gguf::Value;

use super::deepseek2;
use super::moe::DownInput;
use super::{dsa, Architecture, Builder, LayerSizes, Rope, Shape};
use crate::hparams::{HParams, Keys};
use crate::tensors::LayerPlan;
use crate::weights::LayerTensors;
use crate::ModelError;

pub static ARCH: Architecture = Architecture {
    name: "deepseek32",
    aliases: &[],
    rope: Rope::Norm,
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

/// As `llama_model_deepseek32::load_arch_hparams` reads them: deepseek2's keys (the
/// YaRN log multiplier is not also the mscale: llama.cpp special-cases only
/// `deepseek2`; no attention temperature), a required gating function, the indexer's keys (NeoX RoPE, every
/// layer its own selection).
fn hparams(hp: &mut HParams, keys: &Keys<'_>) -> Result<(), ModelError> {
    deepseek2::read_hparams(hp, keys, "deepseek32")?;
    // llama.cpp's deepseek32 reads no attention temperature.
    hp.attn_temp = None;
    if keys.u32("expert_gating_func")? == 0 {
        // llama.cpp would build no gating and abort.
        return Err(ModelError::BadHParams(format!(
            "{} is 0 (none): deepseek32's experts need softmax or sigmoid gating",
            keys.name("expert_gating_func")
        )));
    }
    let full_layers = vec![true; hp.n_layer];
    dsa::read_indexer(hp, keys, Rope::Neox.mode(), 1e-6, full_layers, None)
}

/// deepseek2's tensors and the indexer's.
pub(super) fn tensors(t: &mut LayerPlan<'_>) {
    deepseek2::tensors(t);
    dsa::tensors(t);
}

/// deepseek2's layer, its attention sparse.
pub(super) fn layer<'g>(b: &mut Builder<'g>, w: &LayerTensors<'g>, layer: usize, hidden: Tensor<'g>) -> Tensor<'g> {
    deepseek2::layer_with(b, w, layer, hidden, DownInput::Backend)
}

fn example(shape: &Shape) -> Vec<(&'static str, Value)> {
    let mut keys = deepseek2::example(shape);
    // llama.cpp's deepseek32 has no attention temperature.
    keys.retain(|(key, _)| !key.starts_with("attention.temperature"));
    keys.extend(dsa::example());
    keys
}
