//! DeepSeek V2/V3/R1 and Kimi K2 (`deepseek2`): multi-head latent attention (MLA) with
//! the absorbed projections llama.cpp uses, so the KV cache holds one compressed row
//! per token; dense leading layers, then routed experts (softmax or sigmoid scores,
//! selection bias, expert groups) beside shared experts.
//!
//! Mistral Large 3's attention temperature tuning is applied as llama.cpp applies it.
//! Mistral 4 (`mistral4`) reads, holds and computes the same; its file reuses these
//! pieces. Only GGUFs with the split `attn_k_b`/`attn_v_b` projections (every conversion since
//! llama.cpp added MLA) are supported: older files with one `attn_kv_b` run as plain
//! multi-head attention in llama.cpp, which baton does not implement.

use baton_ggml::Tensor;
use baton_gguf::Value;

use super::attention::{KeyValues, SpanKeys};
use super::builder::{Act, Shard};
use super::moe::{DownInput, ExpertAct, Gating, Routing};
use super::{Architecture, Builder, LayerSizes, Rope, Shape};
use crate::hparams::{AttnTemp, HParams, Keys, Mla};
use crate::names::{LayerTensor as T, FFN, FFN_SHEXP};
use crate::tensors::{self, Dim, LayerPlan, Presence, Split};
use crate::weights::LayerTensors;
use crate::ModelError;

pub static ARCH: Architecture = Architecture {
    name: "deepseek2",
    aliases: &[],
    rope: Rope::Norm,
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

/// As llama.cpp's `llama_model_deepseek2` reads them.
fn hparams(hp: &mut HParams, keys: &Keys<'_>) -> Result<(), ModelError> {
    let has_log_mul = read_hparams(hp, keys, "deepseek2")?;
    // llama.cpp's context special-cases DeepSeek V2 by architecture: its log multiplier
    // is also the mscale (`mistral4` is not special-cased).
    hp.yarn.mscale_from_log_mul = has_log_mul;
    Ok(())
}

/// What `llama_model_deepseek2::load_arch_hparams` reads, for `arch` (its name in
/// errors); returns whether the file has a YaRN log multiplier.
pub(super) fn read_hparams(hp: &mut HParams, keys: &Keys<'_>, arch: &str) -> Result<bool, ModelError> {
    let n_layer_all = keys.u32("block_count")?;
    // DeepSeek-V2-Lite and its relatives project queries directly.
    let lite = hp.n_layer == 27 || hp.n_layer == 26 || (hp.n_layer == 48 && hp.n_vocab == 128_256);
    let n_lora_q = if lite { 0 } else { keys.u32("attention.q_lora_rank")? };
    let n_lora_kv = keys.u32("attention.kv_lora_rank")?;
    let (Some(head_dim_k), Some(head_dim_v)) = (
        keys.opt_u32("attention.key_length_mla")?,
        keys.opt_u32("attention.value_length_mla")?,
    ) else {
        return Err(ModelError::BadHParams(format!(
            "{arch} GGUF without attention.key_length_mla (converted before MLA): re-convert it \
             with a current llama.cpp"
        )));
    };
    let n_rot = hp.rope.n_dims as usize;
    if hp.n_head_kv != 1 || hp.head_dim_k != n_lora_kv + n_rot || hp.head_dim_v != n_lora_kv || head_dim_k <= n_rot {
        return Err(ModelError::BadHParams(format!(
            "{arch} MLA sizes do not fit: {} key heads of {} and values of {} for a latent of \
             {n_lora_kv} plus {n_rot} RoPE dims; heads of {head_dim_k}",
            hp.n_head_kv, hp.head_dim_k, hp.head_dim_v
        )));
    }
    // Mistral Large 3 tunes the attention temperature.
    if let Some(scale) = keys.opt_f32("attention.temperature_scale")?.filter(|&s| s != 0.0) {
        hp.attn_temp = Some(AttnTemp {
            scale,
            floor_scale: positive(keys, "attention.temperature_length")?,
            offset: 0.0,
        });
    }
    hp.mla = Some(Mla {
        n_lora_q,
        n_lora_kv,
        head_dim_k,
        head_dim_v,
        indexer: None,
    });
    let n_ff = hp.n_ff;
    hp.moe.read_ff_exp(keys, n_layer_all, n_ff, true)?;
    // Files without a gating function are DeepSeek V2/V2.5 (softmax), or GLM 4.7 Lite.
    let default_gating = if (hp.n_layer == 47 || hp.n_layer == 48) && hp.n_vocab == 154_880 {
        Gating::Sigmoid
    } else {
        Gating::Softmax
    };
    hp.moe.read_routing(keys, true, default_gating)?;
    hp.moe.require_experts(arch)?;
    // The converter multiplied the YaRN log multiplier by 0.1; llama.cpp divides it back
    // out.
    let log_mul = keys.opt_f32("rope.scaling.yarn_log_multiplier")?;
    if let Some(log_mul) = log_mul {
        hp.yarn.log_mul = log_mul / 0.1;
    }
    Ok(log_mul.is_some())
}

/// A required key that must not be 0.
fn positive(keys: &Keys<'_>, key: &str) -> Result<usize, ModelError> {
    match keys.u32(key)? {
        0 => Err(ModelError::BadHParams(format!("{} must not be 0", keys.name(key)))),
        n => Ok(n),
    }
}

/// As `llama_model_deepseek2::load_arch_tensors` lists them (MLA files).
pub(super) fn tensors(t: &mut LayerPlan<'_>) {
    let hp = t.hp;
    let embd = hp.n_embd;
    t.norm(T::AttnNorm, embd);
    mla_tensors(t);
    t.norm(T::FfnNorm, embd);
    ffn_tensors(t, true, Presence::Usual);
}

/// The tensors of [`ffn`]: routed experts (gate and up fused when `fused_gate_up` and
/// the file has them so), the selection bias (`probs_bias`), the shared experts; or a
/// dense FFN.
pub(super) fn ffn_tensors(t: &mut LayerPlan<'_>, fused_gate_up: bool, probs_bias: Presence) {
    let hp = t.hp;
    if hp.is_moe(t.layer) {
        tensors::experts(t, hp.moe.n_ff_exp, fused_gate_up);
        t.vec(T::ExpProbsBias, &[hp.moe.n_expert], Split::Whole)
            .presence(probs_bias);
        tensors::ffn(t, &FFN_SHEXP, hp.moe.n_ff_exp * hp.moe.n_expert_shared, false);
    } else {
        tensors::ffn(t, &FFN, hp.n_ff, false);
    }
}

/// An MLA layer's attention tensors (with query compression when the model has it).
pub(super) fn mla_tensors(t: &mut LayerPlan<'_>) {
    let hp = t.hp;
    let mla = hp.mla.as_ref().expect("MLA hyper-parameters are always read");
    let (embd, n_head, n_rot) = (hp.n_embd, hp.n_head, hp.rope.n_dims as usize);
    let n_nope = mla.head_dim_k - n_rot;
    // Tensor parallelism: every member with heads computes the compressed rows whole
    // (each head reads all of them); the query heads, with their matrices, are shared out.
    let q_heads = Split::Rows(Dim::QHeads(mla.head_dim_k));
    if mla.n_lora_q > 0 {
        t.vec(T::AttnQANorm, &[mla.n_lora_q], Split::WithHeads);
        t.mat(T::AttnQA, &[embd, mla.n_lora_q], Split::WithHeads);
        t.mat(T::AttnQB, &[mla.n_lora_q, n_head * mla.head_dim_k], q_heads);
    } else {
        t.mat(T::AttnQ, &[embd, n_head * mla.head_dim_k], q_heads);
    }
    t.vec(T::AttnKvANorm, &[mla.n_lora_kv], Split::WithHeads);
    t.mat(T::AttnKvAMqa, &[embd, mla.n_lora_kv + n_rot], Split::WithHeads);
    t.mat(T::AttnKB, &[n_nope, mla.n_lora_kv, n_head], Split::HeadMatrices);
    t.mat(T::AttnVB, &[mla.n_lora_kv, mla.head_dim_v, n_head], Split::HeadMatrices);
    t.mat(T::AttnOutput, &[n_head * mla.head_dim_v, embd], Split::Rows(Dim::Embd));
}

fn layer<'g>(b: &mut Builder<'g>, w: &LayerTensors<'g>, layer: usize, hidden: Tensor<'g>) -> Tensor<'g> {
    layer_with(b, w, layer, hidden, DownInput::Backend)
}

/// llama.cpp's deepseek2 layer, its experts' down projection reading `down_input`.
pub(super) fn layer_with<'g>(
    b: &mut Builder<'g>,
    w: &LayerTensors<'g>,
    layer: usize,
    hidden: Tensor<'g>,
    down_input: DownInput,
) -> Tensor<'g> {
    let cur = b.norm(hidden, w.get(T::AttnNorm));
    let cur = mla_attention(b, w, layer, cur, MlaRope::Rotated);
    let (cur, residual) = b.select_outputs(layer, cur, hidden);
    let ffn_in = b.ctx.add(cur, residual); // [n_embd, n_tokens]

    let cur = b.norm(ffn_in, w.get(T::FfnNorm));
    let cur = ffn(b, w, layer, cur, down_input);
    b.ctx.add(cur, ffn_in)
}

/// DeepSeek's FFN of layer `layer` over `x` `[n_embd, n_tokens]`: the routed experts
/// (the file's gating, weight normalisation and scale; their down projection reading
/// `down_input`) plus the shared experts, or a dense FFN in the leading layers; SwiGLU
/// clamped where the model has clamps (GLM-5 next).
pub(super) fn ffn<'g>(
    b: &mut Builder<'g>,
    w: &LayerTensors<'g>,
    layer: usize,
    x: Tensor<'g>,
    down_input: DownInput,
) -> Tensor<'g> {
    let (expert_act, act) = match &b.hp.moe.swiglu_clamps {
        Some(clamps) => (
            ExpertAct::SiluClamp {
                limit: clamps.exp[layer],
            },
            Act::SiluClamp {
                limit: clamps.shexp[layer],
            },
        ),
        None => (ExpertAct::Silu, Act::Silu),
    };
    let routing = Routing {
        gating: b.hp.moe.gating,
        norm_weights: b.hp.moe.weights_norm,
        scale: b.hp.moe.weights_scale,
        act: expert_act,
        down_input,
    };
    b.routed_and_shared(w, layer, x, routing, act)
}

/// DeepSeek's compressed query (V3 on): `rms_norm(attn_q_a x) · attn_q_a_norm`,
/// `[n_lora_q, n_tokens]`, which `attn_q_b` expands into the heads.
pub(super) fn q_compressed<'g>(b: &Builder<'g>, w: &LayerTensors<'g>, x: Tensor<'g>) -> Tensor<'g> {
    b.norm(b.mm(w.get(T::AttnQA), x), w.get(T::AttnQANorm))
}

/// What an MLA layer does with the RoPE part of its queries and keys.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum MlaRope {
    /// Rotated by position; scores scaled by YaRN's mscale² / √head (DeepSeek).
    Rotated,
    /// Left as projected, scores scaled by 1 / √head (Kimi Linear's MLA layers, which
    /// have no positional encoding).
    Unrotated,
}

/// MLA with absorption, as llama.cpp's deepseek2 graph builds it: queries are mapped
/// into the latent space (`attn_k_b`), so every head attends over the cached latent rows
/// as one shared key head; the attended latent is decompressed per head (`attn_v_b`).
/// The RoPE part of each head is rotated or not as `rope` says.
pub(super) fn mla_attention<'g>(
    b: &mut Builder<'g>,
    w: &LayerTensors<'g>,
    layer: usize,
    x: Tensor<'g>,
    rope: MlaRope,
) -> Tensor<'g> {
    let ctx = b.ctx;
    let hp = b.hp;
    let mla = hp.mla.as_ref().expect("MLA hyper-parameters are always read");
    let n_tokens = b.inputs.n_tokens as i64;
    let n_head = hp.n_head as i64;
    let n_rot = hp.rope.n_dims as i64;
    let (head_k, n_lora_kv) = (mla.head_dim_k as i64, mla.n_lora_kv as i64);
    let n_nope = head_k - n_rot;
    if n_head == 0 {
        // A tensor-parallel member without heads: only the others' heads, its rows of
        // the projection.
        let out = b.gather(x, Shard::Heads);
        return b.gather(b.mm(w.get(T::AttnOutput), out), Shard::Embd);
    }

    // DeepSeek sparse attention chooses each query's tokens from the compressed query.
    let (q, sparse) = match w.opt(T::AttnQA) {
        Some(_) => {
            let q = q_compressed(b, w, x);
            let sparse = hp.indexer().map(|_| super::dsa::select(b, w, layer, x, q));
            (b.mm(w.get(T::AttnQB), q), sparse)
        }
        None => (b.mm(w.get(T::AttnQ), x), None),
    };
    let q = ctx.reshape_3d(q, head_k, n_head, n_tokens); // [head_k, n_head, n_tokens]

    let kv_pe = b.mm(w.get(T::AttnKvAMqa), x); // [n_lora_kv + n_rot, n_tokens]
    let elt = kv_pe.nb()[0];
    let row = kv_pe.nb()[1];
    let kv = ctx.view_2d(kv_pe, n_lora_kv, n_tokens, row, 0);
    let k_pe = ctx.view_3d(kv_pe, [n_rot, 1, n_tokens], row, row, elt * n_lora_kv as usize);
    let rotate = |t: Tensor<'g>| match rope {
        MlaRope::Rotated => ctx.rope(t, b.inputs.positions, None, &hp.rope),
        MlaRope::Unrotated => t,
    };
    let k_pe = rotate(k_pe);
    let kv = b.norm(kv, w.get(T::AttnKvANorm));

    let q_elt = q.nb()[0];
    let q_nope = ctx.view_3d(q, [n_nope, n_head, n_tokens], q.nb()[1], q.nb()[2], 0);
    let q_pe = ctx.view_3d(
        q,
        [n_rot, n_head, n_tokens],
        q.nb()[1],
        q.nb()[2],
        q_elt * n_nope as usize,
    );
    let q_pe = rotate(q_pe);
    let q_nope = ctx.permute(q_nope, [0, 2, 1, 3]); // [n_nope, n_tokens, n_head]
    let q_absorbed = b.mm(w.get(T::AttnKB), q_nope); // [n_lora_kv, n_tokens, n_head]
    let q_absorbed = ctx.permute(q_absorbed, [0, 2, 1, 3]); // [n_lora_kv, n_head, n_tokens]

    // RoPE part last, so a cache row is [latent, rope] (GLM-5 next's heads have none).
    let kv = ctx.reshape_3d(kv, n_lora_kv, 1, n_tokens);
    let (q, k) = match n_rot {
        0 => (ctx.cont(q_absorbed), kv),
        _ => (ctx.concat(q_absorbed, q_pe, 0), ctx.concat(kv, k_pe, 0)),
    };
    let mut q = q.named(&format!("Qcur-{layer}")); // [n_lora_kv + n_rot, n_head, n_tokens]
    if let Some(temp) = b.inputs.attn_temp {
        q = ctx.mul(q, temp);
    }
    let k = k.named(&format!("Kcur-{layer}")); // [n_lora_kv + n_rot, 1, n_tokens]

    // llama.cpp pre-scales the score scale for YaRN (its attention factor, undone).
    let freq_scale = hp.rope.freq_scale;
    let attn_factor = hp.rope.attn_factor * (1.0 + 0.1 * (1.0 / freq_scale).ln());
    let mscale = attn_factor * (1.0 + 0.1 * hp.yarn.log_mul * (1.0 / freq_scale).ln());
    let scale = match rope {
        MlaRope::Rotated => mscale * mscale / (head_k as f32).sqrt(),
        MlaRope::Unrotated => 1.0 / (head_k as f32).sqrt(),
    };

    let keys = KeyValues {
        k,
        v: None,
        d_v: mla.n_lora_kv,
    };
    let out = b.attend_masked(
        layer,
        q,
        keys,
        None,
        scale,
        sparse.as_deref().map_or(SpanKeys::Cells, SpanKeys::Sparse),
    ); // [n_lora_kv, n_head, n_tokens]
    let out = ctx.permute(out, [0, 2, 1, 3]); // [n_lora_kv, n_tokens, n_head]
    let out = b.mm(w.get(T::AttnVB), out); // [head_dim_v, n_tokens, n_head]
    let out = ctx.cont(ctx.permute(out, [0, 2, 1, 3])); // [head_dim_v, n_head, n_tokens]
    let out = ctx.reshape_2d(out, mla.head_dim_v as i64 * n_head, n_tokens);
    // A tensor-parallel member: its heads' outputs joined with the others', then its rows
    // of the projection joined too.
    let out = b.gather(out, Shard::Heads);
    // Kimi K3 gates the heads' outputs by its normed input before the projection.
    let out = match w.opt(T::AttnGate) {
        Some(gate) => ctx
            .mul(out, ctx.sigmoid(b.mm(gate, x)))
            .named(&format!("mla_gated-{layer}")),
        None => out,
    };
    b.gather(b.mm(w.get(T::AttnOutput), out), Shard::Embd)
}

pub(super) fn example(shape: &Shape) -> Vec<(&'static str, Value)> {
    // A latent as wide as the model, RoPE on half a head, heads of a non-RoPE part of
    // `head_dim` plus the RoPE part; values `head_dim` wide.
    let n_lora = shape.n_embd as u32;
    let n_rot = (shape.head_dim / 2) as u32;
    let head = shape.head_dim as u32;
    // Expert groups of two (DeepSeek V3's group-limited routing), half of them used.
    let n_group = (shape.n_expert as u32 / 2).min(4);
    vec![
        ("attention.head_count_kv", Value::U32(1)),
        ("attention.key_length", Value::U32(n_lora + n_rot)),
        ("attention.value_length", Value::U32(n_lora)),
        ("attention.key_length_mla", Value::U32(head + n_rot)),
        ("attention.value_length_mla", Value::U32(head)),
        ("attention.q_lora_rank", Value::U32(n_lora)),
        ("attention.kv_lora_rank", Value::U32(n_lora)),
        ("rope.dimension_count", Value::U32(n_rot)),
        ("expert_count", Value::U32(shape.n_expert as u32)),
        ("expert_used_count", Value::U32(shape.n_expert_used as u32)),
        ("expert_feed_forward_length", Value::U32(shape.n_ff_exp as u32)),
        ("expert_shared_count", Value::U32(shape.n_expert_shared as u32)),
        ("leading_dense_block_count", Value::U32(shape.n_dense_lead as u32)),
        ("expert_weights_norm", Value::Bool(true)),
        ("expert_weights_scale", Value::F32(2.5)),
        ("expert_gating_func", Value::U32(2)),
        ("expert_group_count", Value::U32(n_group)),
        ("expert_group_used_count", Value::U32(n_group / 2)),
        // Temperature steps every 8 positions, so the test prompts see several.
        ("attention.temperature_scale", Value::F32(0.1)),
        ("attention.temperature_length", Value::U32(8)),
    ]
}
