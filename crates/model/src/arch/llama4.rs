//! Llama 4 Scout and Maverick (`llama4`): the llama layer with chunked attention on
//! three layers of four (a token sees only the earlier tokens of its own chunk of 8192
//! positions), every fourth layer without RoPE (NoPE) and with attention temperature
//! tuning instead, L2-normalised queries and keys after RoPE (Scout), and experts in
//! every `interleave_moe_layer_step`-th layer: sigmoid routing on the raw logits, the
//! weight applied to each expert's input, beside one shared expert. The other layers
//! have a dense FFN.

use baton_ggml::Tensor;
use baton_gguf::Value;

use super::builder::{Act, Shard};
use super::{Architecture, Builder, LayerSizes, Rope, Shape};
use crate::hparams::{AttnTemp, HParams, Keys, SwaType};
use crate::names::{LayerTensor as T, FFN, FFN_SHEXP};
use crate::tensors::{self, LayerPlan, Presence};
use crate::weights::LayerTensors;
use crate::ModelError;

pub static ARCH: Architecture = Architecture {
    name: "llama4",
    aliases: &[],
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

/// Positions per attention chunk. llama.cpp fixes it (Llama 4's `attention_chunk_size`);
/// no GGUF key sets it.
const CHUNK: usize = 8192;

/// Every this-many-th layer has no RoPE; llama.cpp fixes it too.
const NO_ROPE_LAYER_STEP: usize = 4;

/// Maverick's expert count: llama.cpp skips the q/k L2 norms for that model.
const MAVERICK_EXPERTS: usize = 128;

/// As llama.cpp's `llama_model_llama4` reads them.
fn hparams(hp: &mut HParams, keys: &Keys<'_>) -> Result<(), ModelError> {
    super::llama::require_plain_heads(hp)?;
    if keys.opt_u32("attention.sliding_window")? == Some(0) {
        // llama.cpp then attends fully everywhere but still scales the last layer's
        // queries by a temperature input it has no scale for, and aborts.
        return Err(ModelError::BadHParams(format!(
            "{} 0 (llama4 without chunked attention) is not supported: llama.cpp aborts computing it",
            keys.name("attention.sliding_window")
        )));
    }
    let n_layer_all = keys.u32("block_count")?;
    let n_ff = hp.n_ff;
    hp.moe.read_ff_exp(keys, n_layer_all, n_ff, true)?;
    hp.moe.require_experts("llama4")?;
    hp.moe.layer_step = keys.u32("interleave_moe_layer_step")?;
    // One shared expert as wide as a routed one.
    hp.moe.n_expert_shared = 1;
    // Three chunked layers, then a global one (or the file's pattern).
    hp.read_sliding_window(keys, CHUNK, 4, None)?;
    hp.n_swa = CHUNK;
    hp.swa_type = SwaType::Chunked;
    hp.attn_temp = Some(AttnTemp {
        scale: 0.1,
        floor_scale: CHUNK,
        offset: 1.0,
    });
    Ok(())
}

/// Whether layer `layer` rotates its queries and keys.
fn uses_rope(layer: usize) -> bool {
    !(layer + 1).is_multiple_of(NO_ROPE_LAYER_STEP)
}

fn tensors(t: &mut LayerPlan<'_>) {
    let hp = t.hp;
    t.norm(T::AttnNorm, hp.n_embd);
    tensors::attention(t, Presence::Optional);
    t.norm(T::FfnNorm, hp.n_embd);
    if hp.is_moe(t.layer) {
        tensors::experts(t, hp.moe.n_ff_exp, false);
        tensors::ffn(t, &FFN_SHEXP, hp.moe.n_ff_exp, false);
    } else {
        tensors::ffn(t, &FFN, hp.n_ff, false);
    }
}

fn layer<'g>(b: &mut Builder<'g>, w: &LayerTensors<'g>, layer: usize, hidden: Tensor<'g>) -> Tensor<'g> {
    let cur = b.norm(hidden, w.get(T::AttnNorm));
    let cur = attention(b, w, layer, cur);
    let (cur, residual) = b.select_outputs(layer, cur, hidden);
    let ffn_in = b.ctx.add(cur, residual); // [n_embd, n_tokens]

    let cur = b.norm(ffn_in, w.get(T::FfnNorm));
    let cur = if b.hp.is_moe(layer) {
        let routed = b.moe_weighted_inputs(w, layer, cur);
        let shared = b.ffn(w, &FFN_SHEXP, Act::Silu, cur);
        b.ctx.add(routed, shared)
    } else {
        b.ffn(w, &FFN, Act::Silu, cur)
    };
    b.ctx.add(cur, ffn_in)
}

/// RoPE layers rotate queries and keys, then (all but Maverick) L2-normalise each head;
/// NoPE layers scale the queries by the position's temperature instead. Then the cache
/// (chunked masks on the sliding-window layers) and the output projection.
/// `x`: `[n_embd, n_tokens]` in and out.
fn attention<'g>(b: &mut Builder<'g>, w: &LayerTensors<'g>, layer: usize, x: Tensor<'g>) -> Tensor<'g> {
    let hp = b.hp;
    if hp.n_head == 0 {
        // A tensor-parallel member without heads: only the others' heads.
        let out = b.gather(x, Shard::Heads);
        return b.attn_output(w, out);
    }
    let ctx = b.ctx;
    let (q, k, v) = b.qkv(w, x); // [d, heads, n_tokens]
    let (q, k) = if uses_rope(layer) {
        let rope = if hp.is_swa(layer) { &hp.rope_swa } else { &hp.rope };
        let factors = b.weights.end(crate::names::EndTensor::RopeFreqs);
        let q = ctx
            .rope(q, b.inputs.positions, factors, rope)
            .named(&format!("Qcur-{layer}"));
        let k = ctx
            .rope(k, b.inputs.positions, factors, rope)
            .named(&format!("Kcur-{layer}"));
        if hp.moe.n_expert != MAVERICK_EXPERTS {
            let q = ctx.rms_norm(q, hp.rms_eps).named(&format!("Qcur_normed-{layer}"));
            let k = ctx.rms_norm(k, hp.rms_eps).named(&format!("Kcur_normed-{layer}"));
            (q, k)
        } else {
            (q, k)
        }
    } else {
        let temp = b.inputs.attn_temp.expect("llama4 has an attention temperature");
        (ctx.mul(q, temp).named(&format!("Qcur-{layer}")), k)
    };
    let kv = super::attention::KeyValues {
        k,
        v: Some(v),
        d_v: hp.head_dim_v,
    };
    let out = b.attend(layer, q, kv, None, hp.attn_scale); // [d_v, n_head, n_tokens]
    let out = ctx.reshape_2d(out, (hp.head_dim_v * hp.n_head) as i64, b.inputs.n_tokens as i64);
    let out = b.gather(out, Shard::Heads);
    b.attn_output(w, out)
}

fn example(shape: &Shape) -> Vec<(&'static str, Value)> {
    // Experts in every second layer; a context of more than one chunk, so that tests
    // can cross the chunk boundary (and the temperature's first step) at 8192.
    vec![
        ("context_length", Value::U32(shape.n_ctx.max(2 * CHUNK) as u32)),
        ("expert_count", Value::U32(shape.n_expert as u32)),
        ("expert_used_count", Value::U32(shape.n_expert_used as u32)),
        ("expert_feed_forward_length", Value::U32(shape.n_ff_exp as u32)),
        ("interleave_moe_layer_step", Value::U32(2)),
    ]
}
