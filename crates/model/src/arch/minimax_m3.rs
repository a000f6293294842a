//! MiniMax M3 (`minimax-m3`): M2's grouped-query attention with per-head q/k RMS norms
//! and partial NeoX RoPE, sparse (MiniMax sparse attention, see [`super::msa`]) on every
//! layer after the dense lead; DeepSeek-style FFNs (dense leading layers, then routed
//! experts chosen by gated scores plus a selection bias, beside a shared expert), every
//! one with gpt-oss's clamped SwiGLU.

use baton_ggml::Tensor;
use baton_gguf::Value;

use super::builder::Act;
use super::moe::{DownInput, ExpertAct, Routing};
use super::{minimax_m2, msa, Architecture, Builder, LayerSizes, Rope, Shape};
use crate::hparams::{HParams, Keys};
use crate::names::{LayerTensor as T, FFN, FFN_SHEXP};
use crate::tensors::{self, LayerPlan, Presence, Split};
use crate::weights::LayerTensors;
use crate::ModelError;

pub static ARCH: Architecture = Architecture {
    name: "minimax-m3",
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

/// As llama.cpp's `llama_model_minimax_m3` reads them.
fn hparams(hp: &mut HParams, keys: &Keys<'_>) -> Result<(), ModelError> {
    minimax_m2::equal_heads(hp)?;
    let n_layer_all = keys.u32("block_count")?;
    hp.moe.read_ff_exp(keys, n_layer_all, hp.n_ff, true)?;
    hp.moe.read_routing(keys, true, super::moe::Gating::Softmax)?;
    hp.moe.gating = minimax_m2::required_gating(keys)?;
    hp.moe.require_experts("minimax-m3")?;
    msa::read(hp, keys)
}

/// As `llama_model_minimax_m3::load_arch_tensors` lists them.
fn tensors(t: &mut LayerPlan<'_>) {
    let hp = t.hp;
    t.norm(T::AttnNorm, hp.n_embd);
    tensors::attention(t, Presence::Optional);
    tensors::qk_norms(t, Presence::Required);
    t.norm(T::FfnNorm, hp.n_embd);
    if hp.is_moe(t.layer) {
        tensors::experts(t, hp.moe.n_ff_exp, false);
        t.vec(T::ExpProbsBias, &[hp.moe.n_expert], Split::Whole);
        tensors::ffn(t, &FFN_SHEXP, hp.moe.n_ff_exp * hp.moe.n_expert_shared, false);
    } else {
        tensors::ffn(t, &FFN, hp.n_ff, false);
    }
    msa::tensors(t);
}

fn layer<'g>(b: &mut Builder<'g>, w: &LayerTensors<'g>, layer: usize, hidden: Tensor<'g>) -> Tensor<'g> {
    let cur = b.norm(hidden, w.get(T::AttnNorm));
    let cur = match b.hp.is_msa(layer) {
        true => msa::attention(b, w, layer, cur),
        false => b.attention(w, layer, cur),
    };
    let (cur, residual) = b.select_outputs(layer, cur, hidden);
    let ffn_in = b.ctx.add(cur, residual); // [n_embd, n_tokens]

    let cur = b.norm(ffn_in, w.get(T::FfnNorm));
    let routing = Routing {
        gating: b.hp.moe.gating,
        norm_weights: b.hp.moe.weights_norm,
        scale: b.hp.moe.weights_scale,
        act: ExpertAct::SwigluOai,
        down_input: DownInput::Backend,
    };
    let cur = b.routed_and_shared(w, layer, cur, routing, Act::SwigluOai);
    b.ctx.add(cur, ffn_in)
}

fn example(shape: &Shape) -> Vec<(&'static str, Value)> {
    let mut keys = minimax_m2::example(shape);
    keys.extend([
        ("feed_forward_length", Value::U32(shape.n_ff as u32)),
        ("expert_shared_count", Value::U32(shape.n_expert_shared as u32)),
        ("leading_dense_block_count", Value::U32(shape.n_dense_lead as u32)),
        ("expert_weights_norm", Value::Bool(true)),
        ("expert_weights_scale", Value::F32(2.5)),
    ]);
    keys.extend(msa::example(shape.n_head_kv));
    keys
}
