//! Kimi Linear (`kimi-linear`: Kimi-Linear-48B-A3B): a hybrid of Kimi Delta Attention
//! layers (see [`super::kda`]) and multi-head latent attention layers without positional
//! encoding (deepseek2's MLA, the RoPE part of each head left unrotated), each followed
//! by DeepSeek-style experts (dense leading layers, routed experts with a selection bias,
//! a shared expert). The file says which layers are recurrent: those with no key/value
//! heads (`attention.head_count_kv` 0; 1 on the MLA layers).

use baton_ggml::Tensor;
use baton_gguf::{GgufError, Value};

use super::builder::Act;
use super::deepseek2::{mla_attention, MlaRope};
use super::moe::{DownInput, ExpertAct, Gating, Routing};
use super::{kda, Architecture, Builder, LayerSizes, Rope, Shape};
use crate::hparams::{HParams, Keys, Mla, Ssm};
use crate::names::{LayerTensor as T, FFN, FFN_SHEXP};
use crate::tensors::{self, LayerPlan, Split};
use crate::weights::LayerTensors;
use crate::ModelError;

pub static ARCH: Architecture = Architecture {
    name: "kimi-linear",
    aliases: &[],
    // No layer rotates (llama.cpp's rope type none); MLA's RoPE part stays as projected.
    rope: Rope::Norm,
    rope_freqs: None,
    own_output: true,
    layer_sizes: LayerSizes::Blocks,
    hparams,
    tensors,
    layer,
    embed: super::ends::embed,
    logits: super::ends::logits,
    example,
};

/// As `llama_model_kimi_linear::load_arch_hparams` reads them (and
/// `llama_model_kimi_k3`'s, which [`super::kimi_k3`] reads after these).
pub(super) fn hparams(hp: &mut HParams, keys: &Keys<'_>) -> Result<(), ModelError> {
    let n_layer_all = keys.u32("block_count")?;
    hp.ssm = Some(Ssm::kda(keys, hp.n_head)?);
    hp.recurrent_layers = hp.layer_kv_heads.iter().map(|&n| n == 0).collect();
    let n_lora_kv = keys.u32("attention.kv_lora_rank")?;
    let head_dim_k = keys.u32("attention.key_length_mla")?;
    let head_dim_v = keys.u32("attention.value_length_mla")?;
    let n_rot = hp.rope.n_dims as usize;
    if hp.n_head_kv != 1 || hp.head_dim_k != n_lora_kv + n_rot || head_dim_k <= n_rot {
        return Err(ModelError::BadHParams(format!(
            "{} MLA sizes do not fit: {} key heads of {} for a latent of {n_lora_kv} plus \
             {n_rot} RoPE dims; heads of {head_dim_k}",
            hp.arch.name, hp.n_head_kv, hp.head_dim_k
        )));
    }
    // The cache's values are its latent rows. Converters do not write
    // `attention.value_length` for Kimi Linear (llama.cpp then takes `n_embd / n_head`,
    // and never reads it: its MLA cache holds keys only).
    hp.head_dim_v = n_lora_kv;
    // Queries are projected directly (llama.cpp's graph reads `attn_q` only).
    hp.mla = Some(Mla {
        n_lora_q: 0,
        n_lora_kv,
        head_dim_k,
        head_dim_v,
        indexer: None,
    });
    let n_ff = hp.n_ff;
    hp.moe.read_ff_exp(keys, n_layer_all, n_ff, true)?;
    hp.moe.read_routing(keys, true, Gating::Softmax)?;
    // llama.cpp requires the gating function and always normalises the chosen weights.
    hp.moe.gating = match keys.opt_u32("expert_gating_func")? {
        None => return Err(GgufError::MissingKey(keys.name("expert_gating_func")).into()),
        Some(id) => Gating::from_id(id)?.ok_or_else(|| {
            ModelError::BadHParams(format!(
                "{} is 0 (none): the router has no gating function",
                keys.name("expert_gating_func")
            ))
        })?,
    };
    hp.moe.weights_norm = true;
    hp.moe.require_experts(hp.arch.name)
}

/// As `llama_model_kimi_linear::load_arch_tensors` lists them (split `attn_k_b` and
/// `attn_v_b`; no query compression).
fn tensors(t: &mut LayerPlan<'_>) {
    let hp = t.hp;
    let embd = hp.n_embd;
    t.norm(T::AttnNorm, embd);
    if hp.is_recurrent(t.layer) {
        kda::tensors(t);
    } else {
        mla_tensors(t, false);
    }
    t.norm(T::FfnNorm, embd);
    if hp.is_moe(t.layer) {
        tensors::experts(t, hp.moe.n_ff_exp, false);
        t.vec(T::ExpProbsBias, &[hp.moe.n_expert], Split::Whole);
        // llama.cpp's graph always adds the shared expert, at least one expert wide.
        tensors::ffn(t, &FFN_SHEXP, hp.moe.n_ff_exp * hp.moe.n_expert_shared.max(1), false);
    } else {
        tensors::ffn(t, &FFN, hp.n_ff, false);
    }
}

/// An MLA layer's attention tensors (no query compression, `attn_k_b` and `attn_v_b`
/// split), with Kimi K3's output gate when `gated`.
pub(super) fn mla_tensors(t: &mut LayerPlan<'_>, gated: bool) {
    let hp = t.hp;
    let embd = hp.n_embd;
    let mla = hp.mla.as_ref().expect("MLA hyper-parameters are always read");
    let (n_head, n_rot) = (hp.n_head, hp.rope.n_dims as usize);
    t.mat(T::AttnQ, &[embd, n_head * mla.head_dim_k], Split::Whole);
    t.vec(T::AttnKvANorm, &[mla.n_lora_kv], Split::Whole);
    t.mat(T::AttnKvAMqa, &[embd, mla.n_lora_kv + n_rot], Split::Whole);
    t.mat(
        T::AttnKB,
        &[mla.head_dim_k - n_rot, mla.n_lora_kv, n_head],
        Split::Whole,
    );
    t.mat(T::AttnVB, &[mla.n_lora_kv, mla.head_dim_v, n_head], Split::Whole);
    if gated {
        t.mat(T::AttnGate, &[embd, n_head * mla.head_dim_v], Split::Whole)
            .usual();
    }
    t.mat(T::AttnOutput, &[n_head * mla.head_dim_v, embd], Split::Whole);
}

/// norm → KDA or MLA → residual → norm → experts and the shared expert (a dense FFN in
/// the leading layers) → residual.
fn layer<'g>(b: &mut Builder<'g>, w: &LayerTensors<'g>, layer: usize, hidden: Tensor<'g>) -> Tensor<'g> {
    let cur = b.norm(hidden, w.get(T::AttnNorm));
    let cur = if b.hp.is_recurrent(layer) {
        b.kda(w, layer, cur)
    } else {
        mla_attention(b, w, layer, cur, MlaRope::Unrotated)
    };
    let (cur, residual) = b.select_outputs(layer, cur, hidden);
    let ffn_in = b.ctx.add(cur, residual); // [n_embd, n_tokens]

    let cur = b.norm(ffn_in, w.get(T::FfnNorm));
    let routing = Routing {
        gating: b.hp.moe.gating,
        norm_weights: true,
        scale: b.hp.moe.weights_scale,
        act: ExpertAct::Silu,
        down_input: DownInput::Backend,
    };
    let cur = b.routed_and_shared(w, layer, cur, routing, Act::Silu);
    b.ctx.add(cur, ffn_in)
}

/// KDA in the even layers and MLA in the odd ones (Kimi-Linear-48B-A3B has three KDA
/// layers to one MLA), so every split of 2 or 3 stages has a boundary between the two
/// kinds. KDA heads as wide as the attention heads; MLA as deepseek2's example (a
/// latent as wide as the model, a RoPE part of half a head) without query compression,
/// and, as converted files, no value length of its own (`attention.value_length` is the
/// head size every example writes).
pub(super) fn example(shape: &Shape) -> Vec<(&'static str, Value)> {
    let n_lora = shape.n_embd as u32;
    let n_rot = (shape.head_dim / 2) as u32;
    let head = shape.head_dim as u32;
    let kv_heads = (0..shape.n_layer).map(|l| Value::U32((l % 2) as u32)).collect();
    vec![
        ("attention.head_count_kv", Value::Array(kv_heads)),
        ("attention.key_length", Value::U32(n_lora + n_rot)),
        ("attention.key_length_mla", Value::U32(head + n_rot)),
        ("attention.value_length_mla", Value::U32(head)),
        ("attention.kv_lora_rank", Value::U32(n_lora)),
        ("rope.dimension_count", Value::U32(n_rot)),
        ("kda.head_dim", Value::U32(head)),
        ("ssm.conv_kernel", Value::U32(4)),
        ("expert_count", Value::U32(shape.n_expert as u32)),
        ("expert_used_count", Value::U32(shape.n_expert_used as u32)),
        ("expert_feed_forward_length", Value::U32(shape.n_ff_exp as u32)),
        ("expert_shared_count", Value::U32(shape.n_expert_shared as u32)),
        ("leading_dense_block_count", Value::U32(shape.n_dense_lead as u32)),
        ("expert_weights_scale", Value::F32(2.5)),
        ("expert_gating_func", Value::U32(2)),
    ]
}
