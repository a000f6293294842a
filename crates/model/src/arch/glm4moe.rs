//! GLM-4.5 / 4.6 (`glm4moe`): attention with q/k/v biases (and q/k norms on some
//! sizes), a norm after attention that feeds the FFN, dense leading layers, then routed
//! experts chosen by sigmoid scores plus a selection bias, beside shared experts.
//! Multi-token-prediction blocks stored after the layers are not computed.

use baton_ggml::Tensor;
use baton_gguf::Value;

use super::builder::Act;
use super::moe::{DownInput, ExpertAct, Gating, Routing};
use super::{Architecture, Builder, LayerSizes, Rope, Shape};
use crate::hparams::{HParams, Keys};
use crate::names::{LayerTensor as T, FFN, FFN_SHEXP};
use crate::tensors::{self, LayerPlan, Presence, Split};
use crate::weights::LayerTensors;
use crate::ModelError;

pub static ARCH: Architecture = Architecture {
    name: "glm4moe",
    aliases: &[],
    rope: Rope::Neox,
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

/// As llama.cpp's `llama_model_glm4_moe` reads them.
fn hparams(hp: &mut HParams, keys: &Keys<'_>) -> Result<(), ModelError> {
    if hp.head_dim_v != hp.head_dim_k {
        return Err(ModelError::BadHParams(format!(
            "glm4moe needs equal key and value head sizes ({} and {})",
            hp.head_dim_k, hp.head_dim_v
        )));
    }
    // Multimodal GLM (rope sections) rotates positions in several dimensions.
    if keys.get("rope.dimension_sections").is_some() {
        return Err(ModelError::BadHParams(
            "glm4moe with rope.dimension_sections (multimodal M-RoPE) is not supported".into(),
        ));
    }
    let n_layer_all = keys.u32("block_count")?;
    let n_ff = hp.n_ff;
    hp.moe.read_ff_exp(keys, n_layer_all, n_ff, true)?;
    hp.moe.read_routing(keys, true, Gating::Sigmoid)?;
    hp.moe.require_experts("glm4moe")
}

fn tensors(t: &mut LayerPlan<'_>) {
    let hp = t.hp;
    let embd = hp.n_embd;
    t.norm(T::AttnNorm, embd);
    tensors::attention(t, Presence::Usual);
    tensors::qk_norms(t, Presence::Optional);
    t.norm(T::PostAttentionNorm, embd);
    if hp.is_moe(t.layer) {
        tensors::experts(t, hp.moe.n_ff_exp, false);
        t.vec(T::ExpProbsBias, &[hp.moe.n_expert], Split::Whole);
        if hp.moe.n_expert_shared > 0 {
            tensors::ffn(t, &FFN_SHEXP, hp.moe.n_ff_exp * hp.moe.n_expert_shared, false);
        }
    } else {
        tensors::ffn(t, &FFN, hp.n_ff, false);
    }
}

fn layer<'g>(b: &mut Builder<'g>, w: &LayerTensors<'g>, layer: usize, hidden: Tensor<'g>) -> Tensor<'g> {
    // llama.cpp asks for f32 accumulation in glm4moe's output and down projections;
    // the CPU backend always accumulates in f32.
    let cur = b.norm(hidden, w.get(T::AttnNorm));
    let cur = b.attention(w, layer, cur);
    let (cur, residual) = b.select_outputs(layer, cur, hidden);
    let ffn_in = b.ctx.add(cur, residual); // [n_embd, n_tokens]

    let cur = b.norm(ffn_in, w.get(T::PostAttentionNorm));
    let cur = if b.hp.is_moe(layer) {
        let routing = Routing {
            gating: b.hp.moe.gating,
            norm_weights: b.hp.moe.weights_norm,
            scale: b.hp.moe.weights_scale,
            act: ExpertAct::Silu,
            down_input: DownInput::Backend,
        };
        let routed = b.moe(w, layer, cur, routing);
        if b.hp.moe.n_expert_shared > 0 {
            let shared = b.ffn(w, &FFN_SHEXP, Act::Silu, cur);
            b.ctx.add(routed, shared)
        } else {
            routed
        }
    } else {
        b.ffn(w, &FFN, Act::Silu, cur)
    };
    b.ctx.add(cur, ffn_in)
}

fn example(shape: &Shape) -> Vec<(&'static str, Value)> {
    vec![
        ("expert_count", Value::U32(shape.n_expert as u32)),
        ("expert_used_count", Value::U32(shape.n_expert_used as u32)),
        ("expert_feed_forward_length", Value::U32(shape.n_ff_exp as u32)),
        ("expert_shared_count", Value::U32(shape.n_expert_shared as u32)),
        ("leading_dense_block_count", Value::U32(shape.n_dense_lead as u32)),
        ("expert_weights_norm", Value::Bool(true)),
        ("expert_weights_scale", Value::F32(2.5)),
        ("expert_gating_func", Value::U32(2)),
        ("nextn_predict_layers", Value::U32(0)),
    ]
}
