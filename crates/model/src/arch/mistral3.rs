//! Ministral 3 and Devstral 2 (`mistral3`): the llama layer (dense, or with experts)
//! with YaRN RoPE and attention temperature tuning: queries scaled by a factor that
//! grows with the position.

use baton_gguf::Value;

use super::{Architecture, LayerSizes, Rope, Shape};
use crate::hparams::{AttnTemp, HParams, Keys};
use crate::tensors::{LayerPlan, Presence};
use crate::ModelError;

pub static ARCH: Architecture = Architecture {
    name: "mistral3",
    aliases: &[],
    rope: Rope::Norm,
    rope_freqs: Some(Presence::Optional),
    own_output: false,
    layer_sizes: LayerSizes::Uniform,
    hparams,
    tensors,
    layer: super::llama::layer,
    embed: super::ends::embed,
    logits: super::ends::logits,
    example,
};

/// As llama.cpp's `llama_model_mistral3` reads them.
fn hparams(hp: &mut HParams, keys: &Keys<'_>) -> Result<(), ModelError> {
    super::llama::require_plain_heads(hp)?;
    hp.moe.n_ff_exp = hp.n_ff;
    if let Some(beta) = keys.opt_f32("rope.scaling.yarn_beta_fast")? {
        hp.rope.beta_fast = beta;
    }
    if let Some(beta) = keys.opt_f32("rope.scaling.yarn_beta_slow")? {
        hp.rope.beta_slow = beta;
    }
    hp.rope_swa = hp.rope.clone();
    hp.yarn.log_mul = keys.opt_f32("rope.scaling.yarn_log_multiplier")?.unwrap_or(0.0);
    if let Some(scale) = keys.opt_f32("attention.temperature_scale")?.filter(|&s| s != 0.0) {
        // Steps of the trained context length.
        let floor_scale = hp.rope.n_ctx_orig as usize;
        if floor_scale == 0 {
            return Err(ModelError::BadHParams(
                "mistral3 attention temperature needs a trained context length".into(),
            ));
        }
        hp.attn_temp = Some(AttnTemp {
            scale,
            floor_scale,
            offset: 0.0,
        });
    }
    Ok(())
}

/// The llama layer's tensors.
fn tensors(t: &mut LayerPlan<'_>) {
    (super::llama::ARCH.tensors)(t)
}

fn example(shape: &Shape) -> Vec<(&'static str, Value)> {
    // YaRN as Ministral 3 has it, over a trained context short enough that the test
    // prompts cross several temperature steps.
    let mut keys = vec![
        ("rope.freq_base", Value::F32(1_000_000.0)),
        ("rope.scaling.type", Value::Str("yarn".into())),
        ("rope.scaling.factor", Value::F32(16.0)),
        ("rope.scaling.original_context_length", Value::U32(8)),
        ("rope.scaling.yarn_beta_fast", Value::F32(32.0)),
        ("rope.scaling.yarn_beta_slow", Value::F32(1.0)),
        ("rope.scaling.yarn_log_multiplier", Value::F32(1.0)),
        ("attention.temperature_scale", Value::F32(0.1)),
    ];
    keys.extend((super::llama::ARCH.example)(shape));
    keys
}
