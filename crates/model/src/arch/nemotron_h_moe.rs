//! NVIDIA Nemotron-H MoE (`nemotron_h_moe`: Nemotron 3 Nano 30B-A3B and Super):
//! Nemotron-H's pattern of Mamba2, attention and FFN layers (see [`super::nemotron_h`])
//! with routed experts in the FFN layers: a sigmoid router whose selection is biased,
//! experts of squared ReLU without a gate, and one shared expert of the same kind.
//! Models whose experts work in a smaller latent space (`moe_latent_size`) are refused.

use baton_ggml::Tensor;
use baton_gguf::Value;

use super::moe::{DownInput, ExpertAct, Gating, Routing};
use super::nemotron_h::{self, UpDown};
use super::{Architecture, Builder, LayerSizes, Rope, Shape};
use crate::hparams::{HParams, Keys};
use crate::names::LayerTensor as T;
use crate::tensors::{Dim, LayerPlan, Split};
use crate::weights::LayerTensors;
use crate::ModelError;

pub static ARCH: Architecture = Architecture {
    name: "nemotron_h_moe",
    aliases: &[],
    rope: Rope::Norm,
    rope_freqs: None,
    own_output: false,
    layer_sizes: LayerSizes::Blocks,
    hparams,
    tensors,
    layer,
    embed: super::ends::embed,
    logits: super::ends::logits,
    example,
};

fn hparams(hp: &mut HParams, keys: &Keys<'_>) -> Result<(), ModelError> {
    nemotron_h::read_hparams(hp, keys)?;
    if let Some(n) = keys.opt_u32("moe_latent_size")?.filter(|&n| n > 0) {
        return Err(ModelError::BadHParams(format!(
            "nemotron_h_moe with experts in a latent space of {n} (moe_latent_size) is not supported yet"
        )));
    }
    let n_layer_all = keys.u32("block_count")?;
    let n_ff = hp.n_ff;
    hp.moe.read_ff_exp(keys, n_layer_all, n_ff, false)?;
    hp.moe.require_experts("nemotron_h_moe")?;
    hp.moe.n_ff_shexp = keys.opt_u32("expert_shared_feed_forward_length")?.unwrap_or(0);
    if hp.moe.n_ff_shexp == 0 {
        return Err(ModelError::BadHParams(
            "nemotron_h_moe needs a shared expert: expert_shared_feed_forward_length is missing or 0".into(),
        ));
    }
    hp.moe.weights_norm = keys.opt_bool("expert_weights_norm")?.unwrap_or(false);
    hp.moe.weights_scale = keys.opt_f32("expert_weights_scale")?.unwrap_or(0.0);
    hp.moe.gating = Gating::Sigmoid;
    Ok(())
}

/// The shared expert: up and down, no biases.
const SHARED: UpDown = UpDown {
    up: T::FfnUpShexp,
    down: T::FfnDownShexp,
    biases: None,
};

fn tensors(t: &mut LayerPlan<'_>) {
    nemotron_h::layer_tensors(t, |t| {
        let hp = t.hp;
        let (embd, n_expert, n_ff_exp) = (hp.n_embd, hp.moe.n_expert, hp.moe.n_ff_exp);
        t.mat(T::FfnGateInp, &[embd, n_expert], Split::Whole);
        t.vec(T::ExpProbsBias, &[n_expert], Split::Whole);
        t.experts(T::FfnUpExps, &[embd, n_ff_exp, n_expert], Split::Rows(Dim::FfExp));
        t.experts(T::FfnDownExps, &[n_ff_exp, embd, n_expert], Split::Rows(Dim::Embd));
        nemotron_h::up_down_tensors(t, &SHARED, hp.moe.n_ff_shexp, Dim::FfShexp);
    });
}

fn layer<'g>(b: &mut Builder<'g>, w: &LayerTensors<'g>, layer: usize, hidden: Tensor<'g>) -> Tensor<'g> {
    nemotron_h::layer_with(b, w, layer, hidden, |b, x| {
        let moe = &b.hp.moe;
        let routing = Routing {
            gating: Gating::Sigmoid,
            norm_weights: moe.weights_norm,
            scale: moe.weights_scale,
            act: ExpertAct::ReluSqr,
            down_input: DownInput::Backend,
        };
        let routed = b.moe(w, layer, x, routing);
        let shared = nemotron_h::relu_sqr_ffn(b, w, &SHARED, x);
        b.ctx.add(routed, shared)
    })
}

/// Nemotron-H's example keys with experts in the FFN layers (their router weights
/// normalised and scaled by 2.5, as Nemotron 3 Nano's).
fn example(shape: &Shape) -> Vec<(&'static str, Value)> {
    let mut keys = nemotron_h::example(shape);
    keys.extend([
        ("expert_count", Value::U32(shape.n_expert as u32)),
        ("expert_used_count", Value::U32(shape.n_expert_used as u32)),
        ("expert_feed_forward_length", Value::U32(shape.n_ff_exp as u32)),
        (
            "expert_shared_feed_forward_length",
            Value::U32((shape.n_ff_exp * shape.n_expert_shared.max(1)) as u32),
        ),
        ("expert_weights_norm", Value::Bool(true)),
        ("expert_weights_scale", Value::F32(2.5)),
    ]);
    keys
}
