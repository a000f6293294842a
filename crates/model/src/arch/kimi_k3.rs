//! Kimi K3 (`kimi-k3`): Kimi Linear's hybrid of KDA and MLA layers (see
//! [`super::kimi_linear`]) with five changes, as llama.cpp's `kimi-k3.cpp` builds them:
//!
//! 1. cross-layer residual attention (`attn_res.block_size` b > 0): layers 0, b, 2b, …
//!    bank their raw input and restart the residual stream from their attention output;
//!    every attention and FFN input (and the output's) is a softmax-weighted mix of the
//!    banked inputs and the running residual, scored by `rms_norm(·) · score`;
//! 2. latent experts: the routed experts run at `expert_latent_length`, between a down
//!    projection, a norm and an up projection; router and shared experts read the full
//!    input;
//! 3. situ instead of SwiGLU in every FFN (see [`super::builder::situ`]);
//! 4. a sigmoid gate of the normed layer input on the MLA heads' outputs before `o_proj`;
//! 5. a full-rank KDA output gate, and the decay's lower-bound form (see [`super::kda`]).
//!
//! The inputs banked before a stage travel to it after the hidden state
//! ([`HParams::carried_width`](crate::HParams::carried_width); `stage.rs` unpacks them
//! into the builder's banked inputs and packs them again at the stage's end), so a model
//! with residual attention splits anywhere, as one without it does.

use baton_ggml::Tensor;
use baton_gguf::Value;

use super::builder::Act;
use super::deepseek2::{mla_attention, MlaRope};
use super::moe::{DownInput, ExpertAct, Routing};
use super::{kda, kimi_linear, Architecture, Builder, LayerSizes, Rope, Shape};
use crate::hparams::{HParams, Keys, KimiK3};
use crate::names::{EndTensor, LayerTensor as T, FFN, FFN_SHEXP};
use crate::tensors::{self, LayerPlan, Split};
use crate::weights::LayerTensors;
use crate::ModelError;

pub static ARCH: Architecture = Architecture {
    name: "kimi-k3",
    aliases: &[],
    // No layer rotates (llama.cpp's K3 MLA is nope-only); the RoPE part stays as projected.
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

/// As `llama_model_kimi_k3::load_arch_hparams` reads them: Kimi Linear's, then K3's.
fn hparams(hp: &mut HParams, keys: &Keys<'_>) -> Result<(), ModelError> {
    kimi_linear::hparams(hp, keys)?;
    // Unlike Kimi Linear, K3 normalises the chosen weights only when the file says so.
    hp.moe.weights_norm = keys.opt_bool("expert_weights_norm")?.unwrap_or(false);
    let situ_beta = keys.f32("activation.situ_beta")?;
    let situ_linear_beta = keys.f32("activation.situ_linear_beta")?;
    if !(situ_beta > 0.0 && situ_beta.is_finite() && situ_linear_beta.is_finite()) {
        return Err(ModelError::BadHParams(format!(
            "{} {situ_beta} and {} {situ_linear_beta}: situ divides by both (the first must be \
             positive, both finite)",
            keys.name("activation.situ_beta"),
            keys.name("activation.situ_linear_beta")
        )));
    }
    const MAX_LATENT: usize = 1 << 16;
    let n_expert_latent = keys.opt_u32("expert_latent_length")?.unwrap_or(0);
    if n_expert_latent > MAX_LATENT {
        return Err(ModelError::BadHParams(format!(
            "{} {n_expert_latent} is over {MAX_LATENT}",
            keys.name("expert_latent_length")
        )));
    }
    hp.kimi_k3 = Some(KimiK3 {
        res_block: keys.u32("attn_res.block_size")?,
        situ_beta,
        situ_linear_beta,
        n_expert_latent,
    });
    hp.kda_gate_lower_bound = kda::read_gate_lower_bound(keys)?;
    Ok(())
}

/// As `llama_model_kimi_k3::load_arch_tensors` lists them (split `attn_k_b` and
/// `attn_v_b`, no query compression, as for Kimi Linear).
fn tensors(t: &mut LayerPlan<'_>) {
    let hp = t.hp;
    let k3 = hp.kimi_k3.expect("read with the hyper-parameters");
    let embd = hp.n_embd;
    t.norm(T::AttnNorm, embd);
    if k3.res_block > 0 {
        t.vec(T::AttnResScore, &[embd], Split::Whole);
        t.vec(T::FfnResScore, &[embd], Split::Whole);
    }
    if hp.is_recurrent(t.layer) {
        kda::tensors(t);
    } else {
        kimi_linear::mla_tensors(t, true);
    }
    t.norm(T::FfnNorm, embd);
    if hp.is_moe(t.layer) {
        let moe = &hp.moe;
        let latent = if k3.n_expert_latent > 0 {
            k3.n_expert_latent
        } else {
            embd
        };
        t.mat(T::FfnGateInp, &[embd, moe.n_expert], Split::Whole);
        t.vec(T::ExpProbsBias, &[moe.n_expert], Split::Whole);
        for gate_up in [T::FfnGateExps, T::FfnUpExps] {
            t.experts(gate_up, &[latent, moe.n_ff_exp, moe.n_expert], Split::Whole);
        }
        t.experts(T::FfnDownExps, &[moe.n_ff_exp, latent, moe.n_expert], Split::Whole);
        if k3.n_expert_latent > 0 {
            t.mat(T::FfnRoutedDown, &[embd, latent], Split::Whole);
            t.mat(T::FfnRoutedUp, &[latent, embd], Split::Whole);
            t.norm(T::FfnRoutedNorm, latent).usual();
        }
        let n_ff_shexp = moe.n_ff_exp * moe.n_expert_shared.max(1);
        for (tensor, shape) in [
            (T::FfnGateShexp, [embd, n_ff_shexp]),
            (T::FfnUpShexp, [embd, n_ff_shexp]),
            (T::FfnDownShexp, [n_ff_shexp, embd]),
        ] {
            t.mat(tensor, &shape, Split::Whole).usual();
        }
    } else {
        tensors::ffn(t, &FFN, hp.n_ff, false);
    }
}

/// Residual mix → norm → KDA or MLA → residual (restarted on a banking layer) →
/// residual mix → norm → latent experts and the shared expert (a dense FFN in the
/// leading layers) → residual; after the last layer, the output's residual mix.
fn layer<'g>(b: &mut Builder<'g>, w: &LayerTensors<'g>, layer: usize, hidden: Tensor<'g>) -> Tensor<'g> {
    let ctx = b.ctx;
    let k3 = b.hp.kimi_k3.expect("read with the hyper-parameters");
    let mixing = k3.res_block > 0;
    let cur = if mixing {
        res_mix(b, hidden, w.get(T::AttnResScore), layer)
    } else {
        hidden
    };
    let banks = mixing && layer.is_multiple_of(k3.res_block);
    if banks {
        bank(b, hidden);
    }

    let cur = b.norm(cur, w.get(T::AttnNorm));
    let cur = if b.hp.is_recurrent(layer) {
        b.kda(w, layer, cur)
    } else {
        mla_attention(b, w, layer, cur, MlaRope::Unrotated)
    };
    let sum = if banks { cur } else { ctx.add(hidden, cur) }; // [n_embd, n_tokens]

    let cur = if mixing {
        res_mix(b, sum, w.get(T::FfnResScore), layer)
    } else {
        sum
    };
    let cur = b.norm(cur, w.get(T::FfnNorm));
    let situ = Act::Situ {
        beta: k3.situ_beta,
        linear_beta: k3.situ_linear_beta,
    };
    let cur = if b.hp.is_moe(layer) {
        latent_moe(b, w, layer, cur, &k3)
    } else {
        b.ffn(w, &FFN, situ, cur)
    };
    let out = ctx.add(sum, cur);
    if mixing && layer + 1 == b.hp.n_layer {
        // The rows that need logits are kept after this (stage.rs), as llama.cpp does.
        let score = b.weights.end_required(EndTensor::OutputResScore);
        res_mix(b, out, score, layer)
    } else {
        out
    }
}

/// Banks `hidden [n_embd, n_tokens]` as the newest of the stage's banked inputs.
fn bank<'g>(b: &mut Builder<'g>, hidden: Tensor<'g>) {
    let [n_embd, n_tokens, _, _] = hidden.ne();
    let row = b.ctx.reshape_3d(hidden, n_embd, 1, n_tokens);
    b.banked = Some(match b.banked {
        Some(banked) => b.ctx.concat(banked, row, 1),
        None => row,
    });
}

/// The residual attention's mix for `cur [n_embd, n_tokens]`: the banked inputs and
/// `cur` weighted by the softmax of their scores `sum(rms_norm(·) · score)` (the
/// banked inputs themselves summed raw). `cur` as it is before anything is banked.
fn res_mix<'g>(b: &Builder<'g>, cur: Tensor<'g>, score: Tensor<'g>, layer: usize) -> Tensor<'g> {
    let Some(banked) = b.banked else {
        return cur;
    };
    let ctx = b.ctx;
    let [_, n_banked, n_tokens, _] = banked.ne();
    let scored = |t: Tensor<'g>| ctx.sum_rows(ctx.mul(ctx.rms_norm(t, b.hp.rms_eps), score));
    let banked_scores = ctx.reshape_2d(scored(banked), n_banked, n_tokens); // [n_banked, n_tokens]
    let scores = ctx.concat(banked_scores, scored(cur), 0); // [n_banked + 1, n_tokens]
    let probs = ctx.soft_max(scores).named(&format!("res_probs-{layer}"));
    let row = probs.nb()[1];
    let p_banked = ctx.cont(ctx.view_2d(probs, n_banked, n_tokens, row, 0));
    let p_cur = ctx.cont(ctx.view_2d(probs, 1, n_tokens, row, probs.nb()[0] * n_banked as usize));
    ctx.add(ctx.weighted_rows_sum(banked, p_banked), ctx.mul(cur, p_cur))
}

/// The routed experts in the latent space (down-projected, then normed and projected
/// back), routed by the full-width input, plus the shared experts on that input.
fn latent_moe<'g>(b: &mut Builder<'g>, w: &LayerTensors<'g>, layer: usize, x: Tensor<'g>, k3: &KimiK3) -> Tensor<'g> {
    let (beta, linear_beta) = (k3.situ_beta, k3.situ_linear_beta);
    let routed_in = match w.opt(T::FfnRoutedDown) {
        Some(down) => b.mm(down, x), // [n_expert_latent, n_tokens]
        None => x,
    };
    let logits = b.router_logits(w, x);
    let routing = Routing {
        gating: b.hp.moe.gating,
        norm_weights: b.hp.moe.weights_norm,
        scale: b.hp.moe.weights_scale,
        act: ExpertAct::Situ { beta, linear_beta },
        down_input: DownInput::Backend,
    };
    let mut out = b.moe_with_logits(w, layer, routed_in, logits, routing);
    if let Some(norm) = w.opt(T::FfnRoutedNorm) {
        out = b.norm(out, norm);
    }
    if let Some(up) = w.opt(T::FfnRoutedUp) {
        out = b.mm(up, out); // [n_embd, n_tokens]
    }
    if w.opt(T::FfnGateShexp).is_some() {
        let shared = b.ffn(w, &FFN_SHEXP, Act::Situ { beta, linear_beta }, x);
        out = b.ctx.add(out, shared);
    }
    out
}

/// Kimi Linear's example (KDA in the even layers, MLA in the odd ones) with K3's keys:
/// residual attention banking every second layer's input, experts at half the model's
/// width, situ's scales small enough that tanh bends, the decay's lower bound set.
fn example(shape: &Shape) -> Vec<(&'static str, Value)> {
    let mut keys = kimi_linear::example(shape);
    keys.extend([
        ("attn_res.block_size", Value::U32(2)),
        ("activation.situ_beta", Value::F32(1.5)),
        ("activation.situ_linear_beta", Value::F32(2.0)),
        ("expert_latent_length", Value::U32((shape.n_embd / 2) as u32)),
        ("kda.gate_lower_bound", Value::F32(-5.0)),
    ]);
    keys
}
