//! Gemma 4 (`gemma4`), its text models: scaled embeddings; sliding-window and
//! global layers in a per-layer pattern, each kind with heads of its own (the 31B: 16
//! key/value heads of 256 on sliding-window layers, 4 of 512 on global ones) and its own
//! RoPE (the global layers' frequencies scaled by `rope_freqs`); q/k norms, values
//! RMS-normalised without a weight, keys reused as values where a layer has no
//! `attn_v`; unscaled attention; a norm after attention and after the FFN; GeGLU; each
//! layer's output scaled by one factor; soft-capped logits. With experts (26B-A4B),
//! every layer runs them beside its dense MLP, each side with norms of its own, routed
//! by the attention output (normalised without a weight and scaled), GeGLU experts
//! with an output scale each.
//!
//! Not computed (refused with the key named): per-layer embeddings and layers that
//! reuse an earlier layer's keys and values (E2B, E4B).

use baton_ggml::Tensor;
use baton_gguf::Value;

use super::attention::KeyValues;
use super::builder::Act;
use super::moe::{DownInput, ExpertAct, Gating, Routing};
use super::{Architecture, Builder, LayerSizes, Rope, Shape};
use crate::hparams::{HParams, Keys, LayerHeads};
use crate::names::{EndTensor, LayerTensor as T, FFN};
use crate::tensors::{self, Dim, LayerPlan, Presence, Split};
use crate::weights::LayerTensors;
use crate::ModelError;

pub static ARCH: Architecture = Architecture {
    name: "gemma4",
    aliases: &[],
    rope: Rope::Neox,
    rope_freqs: Some(Presence::Required),
    own_output: false,
    layer_sizes: LayerSizes::KvHeadsPerLayer,
    hparams,
    tensors,
    layer,
    embed: super::gemma2::embed,
    logits: super::gemma2::logits,
    example,
};

/// As llama.cpp's `llama_model_gemma4` reads them.
fn hparams(hp: &mut HParams, keys: &Keys<'_>) -> Result<(), ModelError> {
    let unsupported = |key: &str, value: usize, what: &str, models: &str| {
        Err(ModelError::BadHParams(format!(
            "{} {value}: {what} (Gemma 4 {models}) are not supported yet",
            keys.name(key)
        )))
    };
    // llama.cpp requires the key; 0 means no per-layer embeddings.
    let per_layer_input = keys.u32("embedding_length_per_layer_input")?;
    if per_layer_input > 0 {
        return unsupported(
            "embedding_length_per_layer_input",
            per_layer_input,
            "per-layer embeddings",
            "E2B, E4B",
        );
    }
    let shared_kv = keys.opt_u32("attention.shared_kv_layers")?.unwrap_or(0);
    if shared_kv > 0 {
        return unsupported(
            "attention.shared_kv_layers",
            shared_kv,
            "layers that reuse an earlier layer's keys and values",
            "E2B, E4B",
        );
    }
    if hp.moe.n_expert > 0 {
        // Experts in every layer (llama.cpp: every layer with a router), as wide as
        // the file says (llama.cpp sizes them by nothing else).
        let n_layer_all = keys.u32("block_count")?;
        let n_ff = hp.n_ff;
        hp.moe.read_ff_exp(keys, n_layer_all, n_ff, true)?;
    }

    // Queries and scores unscaled (the q/k norms take the place of 1/sqrt(d)).
    hp.attn_scale = 1.0;
    hp.final_logit_softcap = keys.opt_f32("final_logit_softcapping")?.unwrap_or(0.0);
    // The window and the per-layer pattern are required (an array, one flag a layer).
    keys.u32("attention.sliding_window")?;
    let pattern = "attention.sliding_window_pattern";
    if !matches!(keys.get(pattern), Some(Value::Array(_))) {
        return Err(ModelError::BadHParams(format!(
            "{} must be an array of one flag per layer",
            keys.name(pattern)
        )));
    }
    hp.read_sliding_window(keys, 0, 0, Some(10_000.0))?;
    hp.rope_swa.freq_scale = 1.0;
    hp.rope_swa.n_dims = keys
        .opt_u32("rope.dimension_count_swa")?
        .map_or(hp.rope.n_dims, |n| n as i32);

    // One key/value head count for the sliding-window layers, one for the global ones.
    let kv_heads = |swa: bool| -> Result<Option<usize>, ModelError> {
        let mut counts = (0..hp.n_layer)
            .filter(|&layer| hp.is_swa(layer) == swa)
            .map(|layer| hp.layer_kv_heads[layer]);
        let first = counts.next();
        match first {
            Some(n) if n == 0 || !hp.n_head.is_multiple_of(n) || counts.any(|c| c != n) => {
                Err(ModelError::BadHParams(format!(
                    "{} {:?}: baton needs one positive count dividing the {} query heads for the \
                     sliding-window layers and one for the global layers",
                    keys.name("attention.head_count_kv"),
                    hp.layer_kv_heads,
                    hp.n_head
                )))
            }
            _ => Ok(first),
        }
    };
    let swa_kv_heads = kv_heads(true)?;
    if let Some(n) = kv_heads(false)? {
        hp.n_head_kv = n;
    }
    let swa = LayerHeads {
        n_head_kv: swa_kv_heads.unwrap_or(hp.n_head_kv),
        head_dim_k: keys.u32("attention.key_length_swa")?,
        head_dim_v: keys.u32("attention.value_length_swa")?,
    };
    if hp.head_dim_k != hp.head_dim_v || swa.head_dim_k != swa.head_dim_v {
        return Err(ModelError::BadHParams(format!(
            "Gemma 4 needs keys and values of one width: {} {} and {} {}, {} {} and {} {}",
            keys.name("attention.key_length"),
            hp.head_dim_k,
            keys.name("attention.value_length"),
            hp.head_dim_v,
            keys.name("attention.key_length_swa"),
            swa.head_dim_k,
            keys.name("attention.value_length_swa"),
            swa.head_dim_v
        )));
    }
    hp.swa_heads = Some(swa);
    Ok(())
}

fn tensors(t: &mut LayerPlan<'_>) {
    let hp = t.hp;
    let embd = hp.n_embd;
    let heads = hp.layer_heads(t.layer);
    let d = heads.head_dim_k;
    let (q, kv) = (d * hp.n_head, d * heads.n_head_kv);
    let (q_rows, kv_rows) = (Split::Rows(Dim::QHeads(d)), Split::Rows(Dim::KvHeads(d)));
    t.norm(T::AttnNorm, embd);
    t.mat(T::AttnQ, &[embd, q], q_rows);
    t.mat(T::AttnK, &[embd, kv], kv_rows.clone());
    // The global layers of the larger models take their values from the keys' projection.
    let values = if hp.is_swa(t.layer) {
        Presence::Usual
    } else {
        Presence::Optional
    };
    t.mat(T::AttnV, &[embd, kv], kv_rows).presence(values);
    t.mat(T::AttnOutput, &[q, embd], Split::Rows(Dim::Embd));
    tensors::qk_norms_of(t, d, Presence::Required);
    t.norm(T::PostAttentionNorm, embd);
    t.norm(T::FfnNorm, embd);
    tensors::ffn(t, &FFN, hp.n_ff, false);
    if hp.is_moe(t.layer) {
        t.norm(T::PostFfwNorm1, embd);
        t.norm(T::FfnPreNorm2, embd);
        t.vec(T::FfnGateInpScale, &[embd], Split::Whole);
        tensors::experts(t, hp.moe.n_ff_exp, true);
        t.vec(T::FfnDownExpsScale, &[hp.moe.n_expert], Split::Whole).usual();
        t.norm(T::PostFfwNorm2, embd);
    }
    t.norm(T::PostFfwNorm, embd);
    t.vec(T::LayerOutputScale, &[1], Split::Whole).usual();
}

fn layer<'g>(b: &mut Builder<'g>, w: &LayerTensors<'g>, layer: usize, hidden: Tensor<'g>) -> Tensor<'g> {
    // Every row goes through the last layer: llama.cpp keeps the rows that need logits
    // only after it (the stage does the same).
    let cur = b.norm(hidden, w.get(T::AttnNorm));
    let cur = attention(b, w, layer, cur);
    let cur = b.norm(cur, w.get(T::PostAttentionNorm));
    let attn_out = b.ctx.add(cur, hidden); // [n_embd, n_tokens]

    let cur = if b.hp.is_moe(layer) {
        mlp_and_experts(b, w, layer, attn_out)
    } else {
        let cur = b.norm(attn_out, w.get(T::FfnNorm));
        b.ffn(w, &FFN, Act::Gelu, cur)
    };
    let cur = b.norm(cur, w.get(T::PostFfwNorm));
    let out = b.ctx.add(cur, attn_out);
    match w.opt(T::LayerOutputScale) {
        Some(scale) => b.ctx.mul(out, scale),
        None => out,
    }
}

/// The dense MLP and the experts side by side, each between norms of its own, summed.
/// The router scores the attention output `attn_out` (`[n_embd, n_tokens]`)
/// normalised without a weight, scaled by `1/sqrt(n_embd)` and `ffn_gate_inp.scale`.
fn mlp_and_experts<'g>(b: &mut Builder<'g>, w: &LayerTensors<'g>, layer: usize, attn_out: Tensor<'g>) -> Tensor<'g> {
    let ctx = b.ctx;
    let hp = b.hp;
    let mlp = b.norm(attn_out, w.get(T::FfnNorm));
    let mlp = b.ffn(w, &FFN, Act::Gelu, mlp);
    let mlp = b.norm(mlp, w.get(T::PostFfwNorm1)).named(&format!("ffn_mlp-{layer}"));

    let experts_in = b.norm(attn_out, w.get(T::FfnPreNorm2));
    let router_in = ctx.rms_norm(attn_out, hp.rms_eps);
    let router_in = ctx.scale(router_in, 1.0 / (hp.n_embd as f32).sqrt());
    let router_in = ctx.mul(router_in, w.get(T::FfnGateInpScale));
    let logits = b.router_logits(w, router_in); // [n_expert, n_tokens]
    let routing = Routing {
        gating: Gating::Softmax,
        norm_weights: true,
        scale: 1.0,
        act: ExpertAct::Gelu,
        down_input: DownInput::Backend,
    };
    let experts = b.moe_with_logits(w, layer, experts_in, logits, routing);
    let experts = b
        .norm(experts, w.get(T::PostFfwNorm2))
        .named(&format!("ffn_moe-{layer}"));
    ctx.add(mlp, experts)
}

/// Normed queries and keys rotated by the layer's RoPE (on global layers scaled by
/// `rope_freqs`), values normalised without a weight (the keys' projection where the
/// layer has no `attn_v`), the cache with the layer's mask, unscaled scores, and the
/// output projection. `x`: `[n_embd, n_tokens]` in and out.
fn attention<'g>(b: &mut Builder<'g>, w: &LayerTensors<'g>, layer: usize, x: Tensor<'g>) -> Tensor<'g> {
    let hp = b.hp;
    let ctx = b.ctx;
    let heads = hp.layer_heads(layer);
    let d = heads.head_dim_k as i64;
    let (n_head, n_head_kv, n_tokens) = (hp.n_head as i64, heads.n_head_kv as i64, b.inputs.n_tokens as i64);
    let (rope, factors) = if hp.is_swa(layer) {
        (&hp.rope_swa, None)
    } else {
        (&hp.rope, b.weights.end(EndTensor::RopeFreqs))
    };
    let positions = b.inputs.positions;

    let q = ctx.mul_mat(w.get(T::AttnQ), x); // [d × n_head, n_tokens]
    let q = ctx.reshape_3d(q, d, n_head, n_tokens);
    let q = b.norm(q, w.get(T::AttnQNorm)).named(&format!("Qcur_normed-{layer}"));
    let q = ctx
        .rope(q, positions, factors, rope)
        .named(&format!("Qcur_pos-{layer}"));

    let k = ctx.mul_mat(w.get(T::AttnK), x); // [d × n_head_kv, n_tokens]
    let v = w.opt(T::AttnV).map_or(k, |wv| ctx.mul_mat(wv, x));
    let k = ctx.reshape_3d(k, d, n_head_kv, n_tokens);
    let v = ctx.reshape_3d(v, d, n_head_kv, n_tokens);
    let k = b.norm(k, w.get(T::AttnKNorm)).named(&format!("Kcur_normed-{layer}"));
    let v = ctx.rms_norm(v, hp.rms_eps).named(&format!("Vcur_normed-{layer}"));
    let k = ctx
        .rope(k, positions, factors, rope)
        .named(&format!("Kcur_pos-{layer}"));

    let kv = KeyValues {
        k,
        v: Some(v),
        d_v: heads.head_dim_v,
    };
    let out = b.attend(layer, q, kv, None, hp.attn_scale); // [d, n_head, n_tokens]
    let out = ctx.reshape_2d(out, d * n_head, n_tokens);
    b.attn_output(w, out)
}

fn example(shape: &Shape) -> Vec<(&'static str, Value)> {
    // Sliding-window and global layers in turn; the global layers' heads four times as
    // wide and half as many (the real models' are wider and fewer; so the two kinds'
    // cache rows differ), RoPE over all of each head with another base.
    let global_head = 4 * shape.head_dim;
    let global_kv_heads = (shape.n_head_kv / 2).max(1);
    let swa: Vec<bool> = (0..shape.n_layer).map(|layer| layer % 2 == 0).collect();
    let kv_heads = swa
        .iter()
        .map(|&swa| Value::U32(if swa { shape.n_head_kv } else { global_kv_heads } as u32))
        .collect();
    let mut keys = vec![
        ("attention.sliding_window", Value::U32(shape.n_swa as u32)),
        (
            "attention.sliding_window_pattern",
            Value::Array(swa.into_iter().map(Value::Bool).collect()),
        ),
        ("attention.head_count_kv", Value::Array(kv_heads)),
        ("attention.key_length", Value::U32(global_head as u32)),
        ("attention.value_length", Value::U32(global_head as u32)),
        ("attention.key_length_swa", Value::U32(shape.head_dim as u32)),
        ("attention.value_length_swa", Value::U32(shape.head_dim as u32)),
        ("rope.dimension_count", Value::U32(global_head as u32)),
        ("rope.dimension_count_swa", Value::U32(shape.head_dim as u32)),
        ("rope.freq_base", Value::F32(1_000_000.0)),
        ("rope.freq_base_swa", Value::F32(10_000.0)),
        ("embedding_length_per_layer_input", Value::U32(0)),
        ("final_logit_softcapping", Value::F32(30.0)),
    ];
    if shape.n_expert > 0 {
        keys.extend([
            ("expert_count", Value::U32(shape.n_expert as u32)),
            ("expert_used_count", Value::U32(shape.n_expert_used as u32)),
            ("expert_feed_forward_length", Value::U32(shape.n_ff_exp as u32)),
        ]);
    }
    keys
}
