//! Mistral 4 (`mistral4`): DeepSeek V3's layer (MLA attention with the compressed KV
//! cache, dense leading layers, routed experts with shared ones), read, held and
//! computed as `deepseek2` is. llama.cpp's `llama_model_mistral4` derives from its
//! deepseek2 model and differs in two places:
//!
//! - the experts' down projection keeps its input in f32 on device backends, which
//!   would otherwise convert it to f16 and overflow (`build_moe_ffn`);
//! - the YaRN log multiplier is not DeepSeek V2's `mscale` as well (`llama_context`
//!   special-cases `deepseek2` by name).

use baton_ggml::Tensor;
use baton_gguf::Value;

use super::deepseek2;
use super::moe::DownInput;
use super::{Architecture, Builder, LayerSizes, Rope, Shape};
use crate::hparams::{HParams, Keys};
use crate::weights::LayerTensors;
use crate::ModelError;

pub static ARCH: Architecture = Architecture {
    name: "mistral4",
    aliases: &[],
    rope: Rope::Norm,
    rope_freqs: None,
    own_output: false,
    layer_sizes: LayerSizes::Uniform,
    hparams,
    tensors: deepseek2::tensors,
    layer,
    embed: super::ends::embed,
    logits: super::ends::logits,
    example,
};

/// deepseek2's keys, without its DeepSeek V2 case (the log multiplier is not the mscale).
fn hparams(hp: &mut HParams, keys: &Keys<'_>) -> Result<(), ModelError> {
    deepseek2::read_hparams(hp, keys, "mistral4")?;
    Ok(())
}

fn layer<'g>(b: &mut Builder<'g>, w: &LayerTensors<'g>, layer: usize, hidden: Tensor<'g>) -> Tensor<'g> {
    deepseek2::layer_with(b, w, layer, hidden, DownInput::F32)
}

fn example(shape: &Shape) -> Vec<(&'static str, Value)> {
    // deepseek2's example with YaRN over a trained context of 8 tokens and a log
    // multiplier of 0.707 (0.0707 as converters write it), where reading it as
    // DeepSeek V2 does would change RoPE's attention factor.
    let mut keys = deepseek2::example(shape);
    keys.extend([
        ("rope.scaling.type", Value::Str("yarn".into())),
        ("rope.scaling.factor", Value::F32(16.0)),
        ("rope.scaling.original_context_length", Value::U32(8)),
        ("rope.scaling.yarn_beta_fast", Value::F32(32.0)),
        ("rope.scaling.yarn_beta_slow", Value::F32(1.0)),
        ("rope.scaling.yarn_log_multiplier", Value::F32(0.0707)),
    ]);
    keys
}
