//! MiniMax M2 / M2.1 (`minimax-m2`): attention whose q/k RMS norms span all heads at
//! once (not each head), partial NeoX RoPE (64 of 128 dimensions in the real model),
//! then routed experts in every layer, chosen by router scores (sigmoid in the real
//! model) plus a selection bias, their weights normalised. No shared experts, no
//! dense layers.

use baton_ggml::Tensor;
use baton_gguf::{GgufError, Value};

use super::moe::{DownInput, ExpertAct, Gating, Routing};
use super::{Architecture, Builder, LayerSizes, Rope, Shape};
use crate::hparams::{HParams, Keys};
use crate::names::LayerTensor as T;
use crate::tensors::{self, LayerPlan, Split};
use crate::weights::LayerTensors;
use crate::ModelError;

pub static ARCH: Architecture = Architecture {
    name: "minimax-m2",
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

/// As llama.cpp's `llama_model_minimax_m2` reads them.
fn hparams(hp: &mut HParams, keys: &Keys<'_>) -> Result<(), ModelError> {
    equal_heads(hp)?;
    // llama.cpp requires `expert_feed_forward_length` but shapes the experts by
    // `feed_forward_length` (the two are equal in MiniMax's files); so does baton.
    let n_layer_all = keys.u32("block_count")?;
    hp.moe.read_ff_exp(keys, n_layer_all, hp.n_ff, true)?;
    if hp.n_ff == 0 {
        return Err(GgufError::MissingKey(keys.name("feed_forward_length")).into());
    }
    hp.moe.n_ff_exp = hp.n_ff;
    hp.moe.gating = required_gating(keys)?;
    // llama.cpp reads neither `expert_weights_scale` nor `expert_weights_norm` here:
    // weights are always normalised and never scaled.
    hp.moe.weights_norm = true;
    hp.moe.weights_scale = 0.0;
    hp.moe.require_experts("minimax-m2")
}

/// MiniMax's attention (M2 and M3) has key and value heads of one size (llama.cpp
/// asserts it).
pub(super) fn equal_heads(hp: &HParams) -> Result<(), ModelError> {
    if hp.head_dim_v != hp.head_dim_k {
        return Err(ModelError::BadHParams(format!(
            "{} needs equal key and value head sizes ({} and {})",
            hp.arch.name, hp.head_dim_k, hp.head_dim_v
        )));
    }
    Ok(())
}

/// MiniMax's routers (M2 and M3) score experts by `expert_gating_func`, which the file
/// must have: without it llama.cpp has no gating function and aborts building the graph.
pub(super) fn required_gating(keys: &Keys<'_>) -> Result<Gating, ModelError> {
    match keys.opt_u32("expert_gating_func")? {
        None => Err(GgufError::MissingKey(keys.name("expert_gating_func")).into()),
        Some(id) => Gating::from_id(id)?.ok_or_else(|| {
            ModelError::BadHParams(format!(
                "{} is 0 (none): the router has no gating function",
                keys.name("expert_gating_func")
            ))
        }),
    }
}

fn tensors(t: &mut LayerPlan<'_>) {
    let hp = t.hp;
    t.norm(T::AttnNorm, hp.n_embd);
    tensors::attention_whole_qk_norms(t);
    t.norm(T::FfnNorm, hp.n_embd);
    tensors::experts(t, hp.moe.n_ff_exp, false);
    t.vec(T::ExpProbsBias, &[hp.moe.n_expert], Split::Whole);
}

fn layer<'g>(b: &mut Builder<'g>, w: &LayerTensors<'g>, layer: usize, hidden: Tensor<'g>) -> Tensor<'g> {
    let cur = b.norm(hidden, w.get(T::AttnNorm));
    let cur = b.attention_whole_qk_norms(w, layer, cur);
    let (cur, residual) = b.select_outputs(layer, cur, hidden);
    let ffn_in = b.ctx.add(cur, residual); // [n_embd, n_tokens]

    let cur = b.norm(ffn_in, w.get(T::FfnNorm));
    let routing = Routing {
        gating: b.hp.moe.gating,
        norm_weights: b.hp.moe.weights_norm,
        scale: b.hp.moe.weights_scale,
        act: ExpertAct::Silu,
        down_input: DownInput::Backend,
    };
    let cur = b.moe(w, layer, cur, routing);
    b.ctx.add(cur, ffn_in)
}

/// Also the base of MiniMax M3's example (its routing keys and partial rotation).
pub(super) fn example(shape: &Shape) -> Vec<(&'static str, Value)> {
    vec![
        // Half of each head rotates, as in the real model (64 of 128).
        ("rope.dimension_count", Value::U32(shape.head_dim as u32 / 2)),
        ("feed_forward_length", Value::U32(shape.n_ff_exp as u32)),
        ("expert_count", Value::U32(shape.n_expert as u32)),
        ("expert_used_count", Value::U32(shape.n_expert_used as u32)),
        ("expert_feed_forward_length", Value::U32(shape.n_ff_exp as u32)),
        ("expert_gating_func", Value::U32(2)),
    ]
}
