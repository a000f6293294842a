//! Llama 1/2/3 and Mistral-style models (`llama`), and Mixtral (`llama` with experts):
//! pre-norm attention, then a SwiGLU FFN or routed experts, each with a residual.

use baton_ggml::Tensor;
use baton_gguf::Value;

use super::builder::Act;
use super::moe::{DownInput, ExpertAct, Gating, Routing};
use super::{Architecture, Builder, LayerSizes, Rope, Shape};
use crate::hparams::{HParams, Keys};
use crate::names::{LayerTensor as T, FFN};
use crate::tensors::{self, Dim, LayerPlan, Presence, Split};
use crate::weights::LayerTensors;
use crate::ModelError;

pub static ARCH: Architecture = Architecture {
    name: "llama",
    aliases: &["mistral"],
    rope: Rope::Norm,
    rope_freqs: Some(Presence::Optional),
    own_output: false,
    layer_sizes: LayerSizes::Uniform,
    hparams,
    tensors,
    layer,
    embed: super::ends::embed,
    logits: super::ends::logits,
    example,
};

fn hparams(hp: &mut HParams, _keys: &Keys<'_>) -> Result<(), ModelError> {
    require_plain_heads(hp)?;
    // Mixtral: experts as large as the dense FFN would be, weights normalised.
    hp.moe.n_ff_exp = hp.n_ff;
    Ok(())
}

/// llama.cpp's llama-style graphs assume one head size for keys, values and RoPE.
pub(super) fn require_plain_heads(hp: &HParams) -> Result<(), ModelError> {
    if hp.head_dim_v != hp.head_dim_k || hp.rope.n_dims as usize != hp.head_dim_k {
        return Err(ModelError::BadHParams(format!(
            "{} needs key, value and RoPE dimensions equal (key {}, value {}, rope {})",
            hp.arch.name, hp.head_dim_k, hp.head_dim_v, hp.rope.n_dims
        )));
    }
    Ok(())
}

/// Refuses key and value heads of different widths (which llama.cpp's graphs of the
/// hybrid models assume equal).
pub(super) fn require_equal_heads(hp: &HParams) -> Result<(), ModelError> {
    if hp.head_dim_k != hp.head_dim_v {
        return Err(ModelError::BadHParams(format!(
            "{}: key and value heads of {} and {} values; llama.cpp needs them equal",
            hp.arch.name, hp.head_dim_k, hp.head_dim_v
        )));
    }
    Ok(())
}

fn tensors(t: &mut LayerPlan<'_>) {
    let hp = t.hp;
    t.norm(T::AttnNorm, hp.n_embd);
    tensors::attention(t, Presence::Optional);
    t.vec(T::AttnOutputBias, &[hp.n_embd], Split::Rows(Dim::Embd))
        .optional();
    t.norm(T::FfnNorm, hp.n_embd);
    if hp.is_moe(t.layer) {
        tensors::experts(t, hp.moe.n_ff_exp, false);
    } else {
        tensors::ffn(t, &FFN, hp.n_ff, true);
    }
}

pub(super) fn layer<'g>(b: &mut Builder<'g>, w: &LayerTensors<'g>, layer: usize, hidden: Tensor<'g>) -> Tensor<'g> {
    let cur = b.norm(hidden, w.get(T::AttnNorm));
    let cur = b.attention(w, layer, cur);
    let (cur, residual) = b.select_outputs(layer, cur, hidden);
    let ffn_in = b.ctx.add(cur, residual); // [n_embd, n_tokens]

    let cur = b.norm(ffn_in, w.get(T::FfnNorm));
    let cur = if b.hp.is_moe(layer) {
        let routing = Routing {
            gating: Gating::Softmax,
            norm_weights: true,
            scale: b.hp.moe.weights_scale,
            act: ExpertAct::Silu,
            down_input: DownInput::Backend,
        };
        b.moe(w, layer, cur, routing)
    } else {
        b.ffn(w, &FFN, Act::Silu, cur)
    };
    b.ctx.add(cur, ffn_in)
}

fn example(shape: &Shape) -> Vec<(&'static str, Value)> {
    if shape.n_expert == 0 {
        return Vec::new();
    }
    // Mixtral's experts are `feed_forward_length` wide.
    vec![
        ("expert_count", Value::U32(shape.n_expert as u32)),
        ("expert_used_count", Value::U32(shape.n_expert_used as u32)),
        ("feed_forward_length", Value::U32(shape.n_ff_exp as u32)),
    ]
}
