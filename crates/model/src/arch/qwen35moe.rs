//! Qwen 3.5 / 3.6 MoE (`qwen35moe`: 35B-A3B, 122B-A10B, 397B-A17B): qwen35's hybrid of
//! gated DeltaNet and gated attention layers (see [`super::deltanet`]), with routed
//! experts (softmax, normalised weights) and one shared expert whose output is scaled
//! by a sigmoid gate of its own in every layer.

use baton_ggml::Tensor;
use baton_gguf::Value;

use super::builder::Act;
use super::deltanet::{self, BetaAlpha};
use super::moe::{DownInput, ExpertAct, Gating, Routing};
use super::{Architecture, Builder, LayerSizes, Rope, Shape};
use crate::hparams::{HParams, Keys};
use crate::names::{FfnTensors, LayerTensor as T, FFN_SHEXP};
use crate::tensors::{self, LayerPlan, Split};
use crate::weights::LayerTensors;
use crate::ModelError;

pub static ARCH: Architecture = Architecture {
    name: "qwen35moe",
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
    read_hparams(hp, keys, true)
}

/// qwen35moe's keys (and qwen3next's, whose RoPE has no sections: `mrope` false).
pub(super) fn read_hparams(hp: &mut HParams, keys: &Keys<'_>, mrope: bool) -> Result<(), ModelError> {
    deltanet::read_hparams(hp, keys, mrope)?;
    let n_layer_all = keys.u32("block_count")?;
    let n_ff = hp.n_ff;
    hp.moe.read_ff_exp(keys, n_layer_all, n_ff, false)?;
    hp.moe.require_experts(hp.arch.name)?;
    // The shared expert's width; llama.cpp falls back to the FFN length.
    hp.moe.n_ff_shexp = keys.opt_u32("expert_shared_feed_forward_length")?.unwrap_or(n_ff);
    if hp.moe.n_ff_shexp == 0 {
        return Err(ModelError::BadHParams(format!(
            "{} needs a shared expert: expert_shared_feed_forward_length (or feed_forward_length) is 0",
            hp.arch.name
        )));
    }
    Ok(())
}

/// The shared expert: its FFN, and the gate of its output.
const SHARED: FfnTensors = FFN_SHEXP;

fn tensors(t: &mut LayerPlan<'_>) {
    deltanet::mixer_tensors(t, BetaAlpha::Separate);
    ffn_tensors(t);
}

/// The FFN's tensors: routed experts, the shared expert and its gate.
pub(super) fn ffn_tensors(t: &mut LayerPlan<'_>) {
    tensors::experts(t, t.hp.moe.n_ff_exp, true);
    tensors::ffn(t, &SHARED, t.hp.moe.n_ff_shexp, false);
    t.vec(T::FfnGateInpShexp, &[t.hp.n_embd], Split::Whole);
}

pub(super) fn layer<'g>(b: &mut Builder<'g>, w: &LayerTensors<'g>, layer: usize, hidden: Tensor<'g>) -> Tensor<'g> {
    deltanet::layer(b, w, layer, hidden, |b, x| {
        let routing = Routing {
            gating: Gating::Softmax,
            norm_weights: true,
            scale: 0.0,
            act: ExpertAct::Silu,
            down_input: DownInput::Backend,
        };
        let routed = b.moe(w, layer, x, routing);
        let shared = b.ffn(w, &SHARED, Act::Silu, x);
        let gate = b.ctx.sigmoid(b.mm(w.get(T::FfnGateInpShexp), x)); // [1, n_tokens]
        b.ctx.add(routed, b.ctx.mul(shared, gate))
    })
}

fn example(shape: &Shape) -> Vec<(&'static str, Value)> {
    let mut keys = deltanet::example(shape);
    keys.extend(expert_keys(shape));
    keys
}

/// The expert keys of an example model of `shape` (one shared expert of the routed
/// experts' width times `n_expert_shared`).
pub(super) fn expert_keys(shape: &Shape) -> Vec<(&'static str, Value)> {
    vec![
        ("expert_count", Value::U32(shape.n_expert as u32)),
        ("expert_used_count", Value::U32(shape.n_expert_used as u32)),
        ("expert_feed_forward_length", Value::U32(shape.n_ff_exp as u32)),
        (
            "expert_shared_feed_forward_length",
            Value::U32((shape.n_ff_exp * shape.n_expert_shared.max(1)) as u32),
        ),
    ]
}
