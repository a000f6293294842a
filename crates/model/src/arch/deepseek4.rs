//! DeepSeek V4 (`deepseek4`), as llama.cpp's `deepseek4.cpp` builds it for generation:
//!
//! - the residual stream is four copies of the hidden state, mixed around every block
//!   by hyper-connections (see [`hyper`]);
//! - attention has one key-and-value head per token (`attn_kv`, normed, its last
//!   `n_rot` dimensions rotated), queries through DeepSeek's low-rank compression
//!   (`attn_q_a`, `attn_q_b`, as V3; see [`deepseek2`]) each head RMS-normed, attention
//!   sinks, a sliding window over the raw keys in every layer, the heads' outputs
//!   rotated back and projected by a grouped low-rank output (`attn_output_a` per group
//!   of heads, then `attn_output_b`);
//! - experts scored by `sqrt(softplus(·))`, the first `hash_layer_count` layers routed
//!   by a table of expert ids per token instead of the router's choice, SwiGLU clamped
//!   per layer (`swiglu_clamp_exp`, `swiglu_clamp_shexp`), one shared expert;
//! - multi-token-prediction layers after the trunk, which generation skips (baton never
//!   loads them).
//!
//! Layers may also compress their keys (`attention.compress_ratios`), attended after
//! the window: 128 for heavily compressed attention, blocks of 128 positions pooled into
//! one key each (see [`hca`]); 4 for compressed sparse attention, overlapping blocks of 4
//! chosen by a lightning indexer over compressed keys of its own (see [`csa`]).

use baton_ggml::Tensor;
use baton_gguf::Value;

use super::attention::{KeyValues, SpanKeys};
use super::builder::Act;
use super::hyper::{self, Head, Hyper, Site};
use super::moe::{DownInput, ExpertAct, Gating, Routing, SwigluClamps};
use super::{csa, deepseek2, hca, Architecture, Builder, LayerSizes, Rope, Shape};
use crate::hparams::{Dsv4, HParams, Keys, SwaType, CSA_RATIO, HCA_RATIO};
use crate::names::{LayerTensor as T, FFN_SHEXP};
use crate::tensors::{self, LayerPlan, Split, Use};
use crate::weights::LayerTensors;
use crate::ModelError;

pub static ARCH: Architecture = Architecture {
    name: "deepseek4",
    aliases: &[],
    rope: Rope::Norm,
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

/// llama.cpp's `expert_gating_func` number of `sqrt(softplus(·))`, the only scoring its
/// deepseek4 loader accepts.
const SQRT_SOFTPLUS: usize = 4;

/// As `llama_model_deepseek4::load_arch_hparams` reads them. Keys llama.cpp requires
/// but only compressed layers use (the indexer's, the compressor's RoPE base) are
/// required here too, so a file libllama refuses is refused.
fn hparams(hp: &mut HParams, keys: &Keys<'_>) -> Result<(), ModelError> {
    let n_layer_all = keys.u32("block_count")?;
    let bad = |why: String| Err(ModelError::BadHParams(why));
    let n_lora_q = keys.u32("attention.q_lora_rank")?;
    hp.n_swa = keys.u32("attention.sliding_window")?;
    if hp.n_swa == 0 {
        return bad(format!(
            "{} is 0: every deepseek4 layer attends over a window",
            keys.name("attention.sliding_window")
        ));
    }
    hp.swa_type = SwaType::Sliding;
    hp.swa_layers = vec![true; hp.n_layer];
    // Compressed layers keep the model's YaRN settings over their own base.
    let mut compress_rope = hp.rope.clone();
    if compress_rope.ext_factor != 0.0 {
        compress_rope.attn_factor = 1.0 / (1.0 + 0.1 * (1.0 / compress_rope.freq_scale).ln());
    }
    // No layer of the trunk scales RoPE (llama.cpp passes none of YaRN's settings to
    // uncompressed layers).
    hp.rope.freq_scale = 1.0;
    hp.rope.ext_factor = 0.0;
    hp.rope.n_ctx_orig = 0;
    hp.rope.beta_fast = 0.0;
    hp.rope.beta_slow = 0.0;
    hp.yarn.attn_factor = 1.0;
    hp.rope_swa = hp.rope.clone();

    let n_ff = hp.n_ff;
    hp.moe.read_ff_exp(keys, n_layer_all, n_ff, true)?;
    hp.moe.n_expert_shared = keys.u32("expert_shared_count")?;
    hp.moe.weights_scale = keys.f32("expert_weights_scale")?;
    hp.moe.weights_norm = keys
        .opt_bool("expert_weights_norm")?
        .ok_or_else(|| keys.missing("expert_weights_norm"))?;
    let gating = keys.u32("expert_gating_func")?;
    if gating != SQRT_SOFTPLUS {
        return bad(format!(
            "{} is {gating}: llama.cpp's deepseek4 scores experts by sqrt(softplus) ({SQRT_SOFTPLUS}) only",
            keys.name("expert_gating_func")
        ));
    }
    hp.moe.gating = Gating::SqrtSoftplus;
    hp.moe.require_experts("deepseek4")?;

    // llama.cpp requires the routed experts' clamps; the shared experts' default to them.
    if keys.get("swiglu_clamp_exp").is_none() {
        return Err(keys.missing("swiglu_clamp_exp"));
    }
    hp.moe.swiglu_clamps = SwigluClamps::read(keys, n_layer_all)?;

    // Read (and required) as llama.cpp reads them; only compressed layers use them.
    let indexer_n_head = keys.u32("attention.indexer.head_count")?;
    let top_k = keys.u32("attention.indexer.top_k")?;
    let indexer_head = keys.u32("attention.indexer.key_length")?;
    if indexer_head == hp.head_dim_k {
        // llama.cpp's cache then rotates the raw keys (and queries) by a Walsh-Hadamard
        // matrix whatever their type, meant for the lightning indexer's keys.
        return bad(format!(
            "{} equals {} ({indexer_head}): llama.cpp then rotates the raw window's keys by a \
             Hadamard matrix, which baton does not",
            keys.name("attention.indexer.key_length"),
            keys.name("attention.key_length")
        ));
    }
    compress_rope.freq_base = keys.f32("attention.compress_rope_freq_base")?;

    let o_groups = keys.u32("attention.output_group_count")?;
    let o_lora_rank = keys.u32("attention.output_lora_rank")?;
    hp.hyper = Some(Hyper::read(keys, Head::Weighted)?);
    let hash_layers = keys.u32("hash_layer_count")?;

    let ratios_key = "attention.compress_ratios";
    let ratios = keys
        .opt_u32_array(ratios_key)?
        .ok_or_else(|| keys.missing(ratios_key))?;
    if ratios.len() < n_layer_all {
        return bad(format!(
            "{} has {} entries for {n_layer_all} layers",
            keys.name(ratios_key),
            ratios.len()
        ));
    }
    let compress_ratios: Vec<usize> = ratios[..hp.n_layer].iter().map(|&r| r as usize).collect();
    if let Some((layer, &ratio)) = compress_ratios
        .iter()
        .enumerate()
        .find(|(_, &r)| ![0, CSA_RATIO, HCA_RATIO].contains(&r))
    {
        return bad(format!(
            "{}[{layer}] is {ratio}: a compression ratio llama.cpp does not know either (it takes 0, 4 and 128)",
            keys.name(ratios_key)
        ));
    }
    let whole_rotation = indexer_head >= 64 && (indexer_head / 64).is_power_of_two() && indexer_head % 64 == 0;
    if compress_ratios.contains(&CSA_RATIO) && (top_k == 0 || indexer_n_head == 0) {
        return bad(format!(
            "{} {top_k} and {} {indexer_n_head}: compressed sparse layers choose blocks with at \
             least one indexer head, and at least one block",
            keys.name("attention.indexer.top_k"),
            keys.name("attention.indexer.head_count")
        ));
    }
    if compress_ratios.contains(&CSA_RATIO) && !whole_rotation {
        return bad(format!(
            "{} is {indexer_head}: llama.cpp multiplies the lightning indexer's heads by a \
             Walsh-Hadamard matrix, which baton takes of the whole head only (64 times a power \
             of two)",
            keys.name("attention.indexer.key_length")
        ));
    }

    let d = hp.head_dim_k;
    let n_rot = hp.rope.n_dims as usize;
    if hp.n_head_kv != 1 || hp.head_dim_v != d || n_rot > d || !(d - n_rot).is_multiple_of(2) {
        return bad(format!(
            "deepseek4 attends with one key-and-value head: attention.head_count_kv {} must be 1, \
             attention.value_length {} equal to attention.key_length {d}, and rope.dimension_count \
             {n_rot} at most that, an even number of dimensions before it",
            hp.n_head_kv, hp.head_dim_v
        ));
    }
    if o_groups == 0 || !hp.n_head.is_multiple_of(o_groups) || o_lora_rank == 0 || n_lora_q == 0 {
        return bad(format!(
            "{} {o_groups} must divide the {} heads, and {} {o_lora_rank} and {} {n_lora_q} must not be 0",
            keys.name("attention.output_group_count"),
            hp.n_head,
            keys.name("attention.output_lora_rank"),
            keys.name("attention.q_lora_rank")
        ));
    }
    hp.attn_scale = 1.0 / (d as f32).sqrt();
    hp.dsv4 = Some(Dsv4 {
        n_lora_q,
        o_groups,
        o_lora_rank,
        hash_layers,
        indexer_heads: (indexer_n_head, indexer_head),
        top_k,
        compress_ratios,
        compress_rope,
    });
    Ok(())
}

fn dsv4(hp: &HParams) -> &Dsv4 {
    hp.dsv4.as_ref().expect("read with the hyper-parameters")
}

/// As `llama_model_deepseek4::load_arch_tensors` lists a trunk layer's: a heavily
/// compressed layer's compressor besides the window's tensors.
fn tensors(t: &mut LayerPlan<'_>) {
    let hp = t.hp;
    let v4 = dsv4(hp);
    let (embd, n_head, d) = (hp.n_embd, hp.n_head, hp.head_dim_k);
    let (n_expert, n_used) = (hp.moe.n_expert, hp.moe.n_expert_used);
    t.norm(T::AttnNorm, embd);
    t.vec(T::AttnSinks, &[n_head], Split::Whole);
    t.mat(T::AttnQA, &[embd, v4.n_lora_q], Split::Whole);
    t.norm(T::AttnQANorm, v4.n_lora_q);
    t.mat(T::AttnQB, &[v4.n_lora_q, n_head * d], Split::Whole);
    t.mat(T::AttnKv, &[embd, d], Split::Whole);
    t.norm(T::AttnKvANorm, d);
    // The file holds each group's projection side by side; the graph views it per group.
    t.mat(
        T::AttnOutputA,
        &[n_head * d / v4.o_groups, v4.o_lora_rank * v4.o_groups],
        Split::Whole,
    );
    t.mat(T::AttnOutputB, &[v4.o_groups * v4.o_lora_rank, embd], Split::Whole);
    if v4.is_hca(t.layer) || v4.is_csa(t.layer) {
        compressor_tensors(t, v4.compress_ratios[t.layer]);
    }
    hyper::tensors(t);
    tensors::experts(t, hp.moe.n_ff_exp, false);
    if t.layer < v4.hash_layers {
        let spec = t.vec(T::FfnGateTid2eid, &[n_used, hp.n_vocab], Split::Whole);
        spec.usage = Use::ExpertIds;
    } else {
        t.vec(T::ExpProbsBias, &[n_expert], Split::Whole);
    }
    // Used for image tokens only, which baton does not take: text runs without it, as
    // in llama.cpp.
    t.vec(T::ExpProbsBiasVl, &[n_expert], Split::Whole).optional();
    t.norm(T::FfnNorm, embd);
    tensors::ffn(t, &FFN_SHEXP, hp.moe.n_ff_exp * hp.moe.n_expert_shared, false);
}

/// A compressed layer's compressor (over `2 × key_length` with overlapping blocks, ratio
/// 4) and, with compressed sparse attention, the lightning indexer's with its compressor,
/// as llama.cpp lists them.
fn compressor_tensors(t: &mut LayerPlan<'_>, ratio: usize) {
    let hp = t.hp;
    let v4 = dsv4(hp);
    let (embd, d) = (hp.n_embd, hp.head_dim_k);
    let (ix_heads, ix_d) = v4.indexer_heads;
    let overlap = if ratio == CSA_RATIO { 2 } else { 1 };
    let mut compressor = |[kv, gate, ape, norm]: [T; 4], width: usize| {
        t.mat(kv, &[embd, overlap * width], Split::Whole);
        t.mat(gate, &[embd, overlap * width], Split::Whole);
        t.mat(ape, &[overlap * width, ratio], Split::Whole);
        t.norm(norm, width);
    };
    use T::*;
    compressor(
        [
            AttnCompressorKv,
            AttnCompressorGate,
            AttnCompressorApe,
            AttnCompressorNorm,
        ],
        d,
    );
    if ratio == CSA_RATIO {
        t.mat(IndexerProj, &[embd, ix_heads], Split::Whole);
        t.mat(IndexerAttnQB, &[v4.n_lora_q, ix_heads * ix_d], Split::Whole);
        let mut indexer = |[kv, gate, ape, norm]: [T; 4], width: usize| {
            t.mat(kv, &[embd, 2 * width], Split::Whole);
            t.mat(gate, &[embd, 2 * width], Split::Whole);
            t.mat(ape, &[2 * width, ratio], Split::Whole);
            t.norm(norm, width);
        };
        indexer(
            [
                IndexerCompressorKv,
                IndexerCompressorGate,
                IndexerCompressorApe,
                IndexerCompressorNorm,
            ],
            ix_d,
        );
    }
}

/// The multi-token-prediction layers after the trunk, as llama.cpp lists them with
/// compressed sparse attention (ratio 4; see [`example`]): a trunk layer's tensors, the
/// compressors' and the indexer's, and the prediction block's projection and norms.
/// libllama loads a file only with them (and skips them when generating); baton never
/// reads them.
pub(super) fn prediction_layer_tensors(hp: &HParams) -> Vec<crate::tensors::TensorSpec> {
    let embd = hp.n_embd;
    let no_file = |_: &str| false;
    (hp.n_layer..hp.n_layer + hp.n_layer_nextn)
        .flat_map(|layer| {
            let mut t = LayerPlan::new(hp, layer, &no_file);
            tensors(&mut t);
            compressor_tensors(&mut t, CSA_RATIO);
            t.mat(T::NextnEhProj, &[2 * embd, embd], Split::Whole);
            t.norm(T::NextnEnorm, embd);
            t.norm(T::NextnHnorm, embd);
            t.into_specs()
        })
        .collect()
}

/// Streams collapse → norm → attention → streams mix; streams collapse → norm →
/// routed and shared experts → streams mix. `hidden`: the streams, `[n_embd 4, n_tokens]`.
fn layer<'g>(b: &mut Builder<'g>, w: &LayerTensors<'g>, layer: usize, hidden: Tensor<'g>) -> Tensor<'g> {
    let mix = hyper::pre(b, w, Site::Attn, layer, hidden);
    let cur = b.norm(mix.input, w.get(T::AttnNorm));
    let cur = attention(b, w, layer, cur);
    let hidden = hyper::post(b, &mix, cur).named(&format!("hc_attn_post-{layer}"));

    let mix = hyper::pre(b, w, Site::Ffn, layer, hidden);
    let cur = b.norm(mix.input, w.get(T::FfnNorm));
    let cur = experts(b, w, layer, cur);
    hyper::post(b, &mix, cur)
}

/// Attention over the raw window, and in heavily compressed layers over the compressed
/// keys after it (see [`hca`]): `x [n_embd, n_tokens]` in and out.
fn attention<'g>(b: &mut Builder<'g>, w: &LayerTensors<'g>, layer: usize, x: Tensor<'g>) -> Tensor<'g> {
    let ctx = b.ctx;
    let hp = b.hp;
    let v4 = dsv4(hp);
    let n_tokens = b.inputs.n_tokens as i64;
    let (n_head, d) = (hp.n_head as i64, hp.head_dim_k as i64);
    let n_nope = hp.head_dim_k - hp.rope.n_dims as usize;
    // Uncompressed layers rotate with the model's RoPE, which `hparams` left without
    // YaRN; compressed layers with their own.
    let ratio = v4.compress_ratios[layer];
    let rope = if ratio != 0 { &v4.compress_rope } else { &hp.rope };
    let positions = b.inputs.positions;

    let qr = deepseek2::q_compressed(b, w, x); // [n_lora_q, n_tokens]
    let q = b.mm(w.get(T::AttnQB), qr);
    let q = ctx.rms_norm(ctx.reshape_3d(q, d, n_head, n_tokens), hp.rms_eps);
    let q = ctx
        .rope(q, positions, None, rope)
        .rope_offset(n_nope)
        .named(&format!("q-{layer}"));

    let kv = b.norm(b.mm(w.get(T::AttnKv), x), w.get(T::AttnKvANorm));
    let kv = ctx.reshape_3d(kv, d, 1, n_tokens);
    let kv = ctx
        .rope(kv, positions, None, rope)
        .rope_offset(n_nope)
        .named(&format!("kv-{layer}"));

    let keys = KeyValues {
        k: kv,
        v: None,
        d_v: hp.head_dim_k,
    };
    let sinks = Some(w.get(T::AttnSinks));
    let extra = match ratio {
        HCA_RATIO => Some(hca::compressed_keys(b, w, layer, x)),
        CSA_RATIO => Some(csa::sparse_keys(b, w, layer, x, qr)),
        _ => None,
    };
    let out = match extra {
        Some(extra) => b.attend_masked(layer, q, keys, sinks, hp.attn_scale, SpanKeys::Extra(&extra)),
        None => b.attend(layer, q, keys, sinks, hp.attn_scale),
    }; // [d, n_head, n_tokens]
    let out = ctx.reshape_3d(out, d, n_head, n_tokens);
    let out = ctx
        .rope_back(out, positions, None, rope)
        .rope_offset(n_nope)
        .named(&format!("attn_derope-{layer}"));

    // Each group of heads through its own low-rank projection, then all of them out.
    let (groups, rank) = (v4.o_groups as i64, v4.o_lora_rank as i64);
    let group_dim = d * n_head / groups;
    let out = ctx.permute(ctx.reshape_3d(out, group_dim, groups, n_tokens), [0, 2, 1, 3]); // [group_dim, n_tokens, groups]
    let wo_a = ctx.reshape_3d(w.get(T::AttnOutputA), group_dim, rank, groups);
    let low = b.mm(wo_a, out); // [rank, n_tokens, groups]
    let low = ctx.cont_2d(ctx.permute(low, [0, 2, 1, 3]), rank * groups, n_tokens);
    b.mm(w.get(T::AttnOutputB), low)
}

/// The routed experts (chosen by token id in the hash-routed layers) plus the shared
/// expert, each SwiGLU clamped as the layer says: `x [n_embd, n_tokens]` in and out.
fn experts<'g>(b: &mut Builder<'g>, w: &LayerTensors<'g>, layer: usize, x: Tensor<'g>) -> Tensor<'g> {
    let clamps =
        b.hp.moe
            .swiglu_clamps
            .as_ref()
            .expect("deepseek4 requires clamps (read with the hyper-parameters)");
    let (limit_exp, limit_shexp) = (clamps.exp[layer], clamps.shexp[layer]);
    let routing = Routing {
        gating: b.hp.moe.gating,
        norm_weights: b.hp.moe.weights_norm,
        scale: b.hp.moe.weights_scale,
        act: ExpertAct::SiluClamp { limit: limit_exp },
        down_input: DownInput::Backend,
    };
    let routed = match w.opt(T::FfnGateTid2eid) {
        Some(table) => {
            let tokens = b
                .inputs
                .tokens
                .expect("a stage that holds a hash-routed layer is a first stage (checked at load)");
            let chosen = b.ctx.get_rows(table, tokens); // [n_used, n_tokens]
            b.moe_chosen(w, layer, x, chosen, routing)
        }
        None => b.moe(w, layer, x, routing),
    };
    let shared = b.ffn(w, &FFN_SHEXP, Act::SiluClamp { limit: limit_shexp }, x);
    b.ctx.add(routed, shared)
}

/// A small DeepSeek V4: one key-and-value head of `head_dim` (RoPE on its second half),
/// queries through a rank of half the model, two output groups, every layer on the
/// window and all but the first heavily compressed too, the first layer hash-routed,
/// clamps that bite in alternate layers.
///
/// One multi-token-prediction layer follows, with compressed sparse attention: libllama
/// sizes the indexer's cache by the layers with that attention and fails on a model
/// without one, even where generation never computes it.
fn example(shape: &Shape) -> Vec<(&'static str, Value)> {
    let n = shape.n_layer + 1;
    let clamps = |first: f32| {
        Value::Array(
            (0..n)
                .map(|l| Value::F32(if l % 2 == 0 { first } else { 0.8 - first }))
                .collect(),
        )
    };
    // The first layer on its window alone, then compressed sparse and heavily
    // compressed layers in turn.
    let mut ratios: Vec<Value> = (0..shape.n_layer)
        .map(|l| match l {
            0 => Value::U32(0),
            l if l % 2 == 1 => Value::U32(CSA_RATIO as u32),
            _ => Value::U32(HCA_RATIO as u32),
        })
        .collect();
    ratios.push(Value::U32(4));
    let mut keys = vec![
        ("block_count", Value::U32(n as u32)),
        ("nextn_predict_layers", Value::U32(1)),
        ("attention.head_count_kv", Value::U32(1)),
        ("attention.q_lora_rank", Value::U32((shape.n_embd / 2) as u32)),
        ("attention.sliding_window", Value::U32(shape.n_swa as u32)),
        ("rope.dimension_count", Value::U32((shape.head_dim / 2) as u32)),
        ("expert_count", Value::U32(shape.n_expert as u32)),
        ("expert_used_count", Value::U32(shape.n_expert_used as u32)),
        ("expert_feed_forward_length", Value::U32(shape.n_ff_exp as u32)),
        ("expert_shared_count", Value::U32(shape.n_expert_shared as u32)),
        ("expert_weights_scale", Value::F32(1.5)),
        ("expert_weights_norm", Value::Bool(true)),
        ("expert_gating_func", Value::U32(SQRT_SOFTPLUS as u32)),
        ("swiglu_clamp_exp", clamps(0.8)),
        ("swiglu_clamp_shexp", clamps(0.0)),
        ("attention.indexer.head_count", Value::U32(2)),
        // Wider than the head: llama.cpp rotates the raw keys by a Hadamard matrix when
        // the two are equal; 64 times a power of two, the indexer's matrix.
        (
            "attention.indexer.key_length",
            Value::U32((2 * shape.head_dim).next_power_of_two().max(64) as u32),
        ),
        ("attention.indexer.top_k", Value::U32(4)),
        ("attention.output_group_count", Value::U32(2)),
        ("attention.output_lora_rank", Value::U32((shape.n_embd / 4) as u32)),
        ("attention.compress_rope_freq_base", Value::F32(160_000.0)),
        ("attention.compress_ratios", Value::Array(ratios)),
        ("hash_layer_count", Value::U32(1)),
    ];
    keys.extend(hyper::example());
    keys
}
