//! GLM-5 next (`glm5-next`: GLM-5.3-Flash): a hybrid of Kimi Delta Attention layers
//! (see [`super::kda`]) and multi-head latent attention layers without RoPE whose
//! attention is sparse, chosen by a k-pool lightning indexer over blocks of tokens (see
//! [`super::kpool`]); the residual stream is four hyper-connected streams (see
//! [`super::hyper`]), collapsed by their mean at the output; DeepSeek-style experts
//! (dense leading layers, routed experts with a selection bias, a shared expert), as
//! llama.cpp's `glm5-next.cpp` builds them. The file says which layers are recurrent:
//! those with no key/value heads (`attention.head_count_kv` 0; 1 on the MLA layers).
//!
//! Its multi-token-prediction block is not run (llama.cpp's trunk graph does not run it
//! either).

use baton_ggml::Tensor;
use baton_gguf::Value;

use super::deepseek2::{self, mla_attention, mla_tensors, MlaRope};
use super::hyper::{self, Head, Hyper, Site};
use super::moe::{DownInput, Gating, SwigluClamps};
use super::{dsa, kda, Architecture, Builder, LayerSizes, Rope, Shape};
use crate::hparams::{HParams, Keys, Kpool, Mla, Ssm};
use crate::names::LayerTensor as T;
use crate::tensors::{LayerPlan, Presence};
use crate::weights::LayerTensors;
use crate::ModelError;

pub static ARCH: Architecture = Architecture {
    name: "glm5-next",
    aliases: &[],
    // No layer rotates (llama.cpp's rope type none, and its MLA asserts no RoPE part).
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

/// As `llama_model_glm5_next::load_arch_hparams` reads them.
fn hparams(hp: &mut HParams, keys: &Keys<'_>) -> Result<(), ModelError> {
    let n_layer_all = keys.u32("block_count")?;
    if hp.rope.n_dims != 0 {
        // llama.cpp defaults it to the key length, then asserts it is 0.
        return Err(ModelError::BadHParams(format!(
            "{} is {} (or missing): GLM-5 next's MLA heads have no RoPE part and llama.cpp \
             asserts 0",
            keys.name("rope.dimension_count"),
            hp.rope.n_dims
        )));
    }
    hp.unrotated = true;
    hp.ssm = Some(Ssm::kda(keys, hp.n_head)?);
    hp.kda_gate_lower_bound = kda::read_gate_lower_bound(keys)?;
    hp.recurrent_layers = hp.layer_kv_heads.iter().map(|&n| n == 0).collect();

    let n_lora_q = keys.u32("attention.q_lora_rank")?;
    let n_lora_kv = keys.u32("attention.kv_lora_rank")?;
    let head_dim_k = keys.u32("attention.key_length_mla")?;
    let head_dim_v = keys.u32("attention.value_length_mla")?;
    if hp.n_head_kv != 1 || hp.head_dim_k != n_lora_kv || n_lora_q == 0 || head_dim_k == 0 || head_dim_v == 0 {
        return Err(ModelError::BadHParams(format!(
            "glm5-next MLA sizes do not fit: {} key heads of {} for a latent of {n_lora_kv} \
             (one head of the latent's width), a query rank of {n_lora_q}, heads of \
             {head_dim_k} and values of {head_dim_v} (none 0)",
            hp.n_head_kv, hp.head_dim_k
        )));
    }
    // The cache holds the latent; its values are the latent rows.
    hp.head_dim_v = n_lora_kv;
    hp.mla = Some(Mla {
        n_lora_q,
        n_lora_kv,
        head_dim_k,
        head_dim_v,
        indexer: None,
    });

    let n_ff = hp.n_ff;
    hp.moe.read_ff_exp(keys, n_layer_all, n_ff, true)?;
    hp.moe.read_routing(keys, true, Gating::Sigmoid)?;
    if hp.moe.n_expert_shared == 0 {
        return Err(ModelError::BadHParams(format!(
            "{} is 0: glm5-next's layers always add a shared expert",
            keys.name("expert_shared_count")
        )));
    }
    // Plain SwiGLU unless set; the shared experts' clamps default to the routed ones'.
    hp.moe.swiglu_clamps = SwigluClamps::read(keys, n_layer_all)?;

    let kpool = read_kpool(keys)?;
    let n = hp.n_layer;
    let types = keys.opt_per_layer_u32("attention.indexer.types", n)?;
    let mla_full = |l: usize| types.as_ref().is_none_or(|t| t[l] != 0);
    if let Some(first) = (0..n).find(|&l| !hp.recurrent_layers[l]).filter(|&l| !mla_full(l)) {
        // llama.cpp asserts: the first MLA layer has no earlier choice to reuse.
        return Err(ModelError::BadHParams(format!(
            "{}: layer {first}, the first MLA layer, must have its own indexer (type 1), as it \
             has no earlier layer's choice to reuse",
            keys.name("attention.indexer.types")
        )));
    }
    // A recurrent layer counts as sharing when the next MLA layer does: a stage that
    // starts there would reach that layer without the choice it reuses.
    let full_layers = (0..n)
        .map(|l| (l..n).find(|&m| !hp.recurrent_layers[m]).is_none_or(mla_full))
        .collect();
    let key_norm_eps = keys.opt_f32("attention.layer_norm_epsilon")?.unwrap_or(0.0);
    dsa::read_indexer(hp, keys, Rope::Norm.mode(), key_norm_eps, full_layers, Some(kpool))?;

    hp.hyper = Some(Hyper::read(keys, Head::Mean)?);
    hp.moe.require_experts(hp.arch.name)
}

/// `attention.indexer.kpool` and `kpool_select_tail`: blocks of at least 2 tokens
/// that divide `top_k` (llama.cpp asserts both).
fn read_kpool(keys: &Keys<'_>) -> Result<Kpool, ModelError> {
    let size = keys.u32("attention.indexer.kpool")?;
    let top_k = keys.u32("attention.indexer.top_k")?;
    if size < 2 || !top_k.is_multiple_of(size) {
        return Err(ModelError::BadHParams(format!(
            "{} is {size}: blocks of at least 2 tokens that divide {} ({top_k})",
            keys.name("attention.indexer.kpool"),
            keys.name("attention.indexer.top_k")
        )));
    }
    let select_tail = keys.opt_bool("attention.indexer.kpool_select_tail")?.unwrap_or(false);
    Ok(Kpool { size, select_tail })
}

/// As `llama_model_glm5_next::load_arch_tensors` lists them.
fn tensors(t: &mut LayerPlan<'_>) {
    let hp = t.hp;
    let embd = hp.n_embd;
    hyper::tensors(t);
    t.norm(T::AttnNorm, embd);
    if hp.is_recurrent(t.layer) {
        kda::tensors(t);
    } else {
        mla_tensors(t);
        dsa::tensors(t);
    }
    t.norm(T::FfnNorm, embd);
    deepseek2::ffn_tensors(t, false, Presence::Required);
}

/// Streams in: collapsed → norm → KDA or sparse MLA → written back into the streams;
/// collapsed → norm → experts and the shared expert (a dense FFN in the leading
/// layers) → written back. `streams` `[n_embd × 4, n_tokens]` in and out.
fn layer<'g>(b: &mut Builder<'g>, w: &LayerTensors<'g>, layer: usize, streams: Tensor<'g>) -> Tensor<'g> {
    let mix = hyper::pre(b, w, Site::Attn, layer, streams);
    let cur = b.norm(mix.input, w.get(T::AttnNorm));
    let cur = if b.hp.is_recurrent(layer) {
        b.kda(w, layer, cur)
    } else {
        mla_attention(b, w, layer, cur, MlaRope::Unrotated)
    };
    let streams = hyper::post(b, &mix, cur);

    let mix = hyper::pre(b, w, Site::Ffn, layer, streams);
    let cur = b.norm(mix.input, w.get(T::FfnNorm));
    let cur = deepseek2::ffn(b, w, layer, cur, DownInput::Backend);
    hyper::post(b, &mix, cur)
}

/// KDA in the even layers and sparse MLA in the odd ones, so every split of 2 or 3
/// stages has a boundary between the two kinds; KDA heads as wide as the attention
/// heads, the decay in its softplus form; MLA as deepseek2's example (a latent and a
/// query rank as wide as the model) without RoPE; the indexer's 4 heads choosing 2
/// blocks of 4 tokens and the row's own incomplete block, so that test prompts attend to
/// a few of their tokens; 4 hyper-connected streams.
fn example(shape: &Shape) -> Vec<(&'static str, Value)> {
    let n_lora = shape.n_embd as u32;
    let head = shape.head_dim as u32;
    let kv_heads = (0..shape.n_layer).map(|l| Value::U32((l % 2) as u32)).collect();
    let mut keys = vec![
        ("attention.head_count_kv", Value::Array(kv_heads)),
        ("attention.key_length", Value::U32(n_lora)),
        ("attention.value_length", Value::U32(n_lora)),
        ("attention.key_length_mla", Value::U32(head)),
        ("attention.value_length_mla", Value::U32(head)),
        ("attention.q_lora_rank", Value::U32(n_lora)),
        ("attention.kv_lora_rank", Value::U32(n_lora)),
        ("attention.layer_norm_epsilon", Value::F32(1e-6)),
        ("rope.dimension_count", Value::U32(0)),
        ("kda.head_dim", Value::U32(head)),
        ("ssm.conv_kernel", Value::U32(4)),
        ("expert_count", Value::U32(shape.n_expert as u32)),
        ("expert_used_count", Value::U32(shape.n_expert_used as u32)),
        ("expert_feed_forward_length", Value::U32(shape.n_ff_exp as u32)),
        ("expert_shared_count", Value::U32(shape.n_expert_shared.max(1) as u32)),
        ("leading_dense_block_count", Value::U32(shape.n_dense_lead as u32)),
        ("expert_weights_norm", Value::Bool(true)),
        ("expert_weights_scale", Value::F32(2.5)),
        ("attention.indexer.kpool", Value::U32(4)),
        ("attention.indexer.kpool_select_tail", Value::Bool(true)),
    ];
    keys.extend(dsa::example());
    keys.extend(hyper::example());
    keys
}
