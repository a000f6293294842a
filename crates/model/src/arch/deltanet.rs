//! The pieces of Qwen's hybrid models (qwen35, qwen35moe, qwen3next): gated DeltaNet
//! layers, which keep a recurrent state per sequence (see [`crate::RecurrentCache`]),
//! and the gated attention layers between them, as llama.cpp's `delta-net-base.cpp`,
//! `qwen35.cpp` and `qwen3next.cpp` build them with its fused delta-rule kernel.
//!
//! A DeltaNet layer: the input is projected to queries, keys and values (one fused
//! `attn_qkv`), which pass through a short causal convolution (over the sequence's last
//! `d_conv - 1` inputs, kept in its state) and SiLU; queries and keys are L2-normalised;
//! the delta rule then updates each value head's `d_state × d_state` matrix token by
//! token, decayed by `exp(g)` (`g = softplus(alpha + dt) · a`) and written with strength
//! `beta`; its outputs are RMS-normed, gated by `silu(z)` and projected back.

use baton_ggml::Tensor;
use baton_gguf::Value;

use super::attention::KeyValues;
use super::builder::concat_all;
use super::{Builder, Shape, StateRunInputs};
use crate::hparams::{HParams, Keys};
use crate::names::LayerTensor as T;
use crate::recurrent::KEPT_STATES;
use crate::tensors::{LayerPlan, Split};
use crate::weights::LayerTensors;
use crate::ModelError;

/// Reads what a hybrid Qwen model adds to the common keys: the DeltaNet sizes, which
/// layers are recurrent (`attention.recurrent_layers`, else every layer but each
/// `full_attention_interval`-th, 4 by default) and, with `mrope`, the RoPE sections.
pub fn read_hparams(hp: &mut HParams, keys: &Keys<'_>, mrope: bool) -> Result<(), ModelError> {
    hp.ssm = Some(crate::hparams::Ssm::read(keys, crate::hparams::SsmKind::GatedDeltaNet)?);
    super::llama::require_equal_heads(hp)?;
    hp.recurrent_layers = match keys.opt_bool_array("attention.recurrent_layers")? {
        Some(flags) if flags.len() >= hp.n_layer => flags[..hp.n_layer].to_vec(),
        Some(flags) => {
            return Err(ModelError::BadHParams(format!(
                "{} has {} entries for {} layers",
                keys.name("attention.recurrent_layers"),
                flags.len(),
                hp.n_layer
            )))
        }
        None => {
            let interval = keys.opt_u32("full_attention_interval")?.unwrap_or(4);
            if interval == 0 {
                return Err(ModelError::BadHParams("full_attention_interval 0".into()));
            }
            (0..hp.n_layer).map(|l| !(l + 1).is_multiple_of(interval)).collect()
        }
    };
    if !mrope {
        return Ok(());
    }
    let sections = keys
        .opt_u32_array("rope.dimension_sections")?
        .ok_or_else(|| ModelError::BadHParams(format!("{} is missing", keys.name("rope.dimension_sections"))))?;
    if sections.is_empty() || sections.len() > 4 {
        return Err(ModelError::BadHParams(format!(
            "rope.dimension_sections has {} entries, expected up to 4",
            sections.len()
        )));
    }
    let mut four = [0i32; 4];
    for (slot, &n) in four.iter_mut().zip(&sections) {
        *slot = i32::try_from(n).map_err(|_| ModelError::BadHParams(format!("RoPE section of {n} dimensions")))?;
    }
    let total: i64 = four.iter().map(|&n| n as i64).sum();
    if total * 2 > hp.head_dim_k as i64 {
        return Err(ModelError::BadHParams(format!(
            "RoPE sections {four:?} rotate more than the head's {} dimensions",
            hp.head_dim_k
        )));
    }
    hp.rope_sections = Some(four);
    Ok(())
}

/// How a DeltaNet layer projects its write strengths (beta) and decays (alpha).
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum BetaAlpha {
    /// `ssm_beta` and `ssm_alpha` (qwen35).
    Separate,
    /// One `ssm_ba`: per key head, its value heads' betas then their alphas (qwen3next).
    Fused,
}

/// The tensors of a hybrid Qwen layer before its FFN: the norms around the mixer, then a
/// DeltaNet layer's (its beta and alpha projected as `beta_alpha` says) or a gated
/// attention layer's own. Tensor parallelism does not split these models (see
/// [`crate::TpSplit::new`]), so every tensor is whole.
pub fn mixer_tensors(t: &mut LayerPlan<'_>, beta_alpha: BetaAlpha) {
    let hp = t.hp;
    let embd = hp.n_embd;
    t.norm(T::AttnNorm, embd);
    t.norm(T::PostAttentionNorm, embd);
    if hp.is_recurrent(t.layer) {
        let ssm = hp.ssm.as_ref().expect("hybrid models read their DeltaNet sizes");
        let channels = ssm.conv_channels();
        let heads = ssm.n_heads;
        t.mat(T::AttnQkv, &[embd, channels], Split::Whole);
        t.mat(T::AttnGate, &[embd, ssm.d_inner], Split::Whole);
        t.vec(T::SsmConv1d, &[ssm.d_conv, channels], Split::Whole);
        t.vec(T::SsmDt, &[heads], Split::Whole);
        t.vec(T::SsmA, &[heads], Split::Whole);
        match beta_alpha {
            BetaAlpha::Fused => {
                t.mat(T::SsmBa, &[embd, 2 * heads], Split::Whole);
            }
            BetaAlpha::Separate => {
                t.mat(T::SsmBeta, &[embd, heads], Split::Whole);
                t.mat(T::SsmAlpha, &[embd, heads], Split::Whole);
            }
        }
        t.norm(T::SsmNorm, ssm.d_state);
        t.mat(T::SsmOut, &[ssm.d_inner, embd], Split::Whole);
    } else {
        let (d, n_head) = (hp.head_dim_k, hp.n_head);
        // The query projection carries each head's output gate after its query.
        t.mat(T::AttnQ, &[embd, 2 * d * n_head], Split::Whole);
        t.mat(T::AttnK, &[embd, hp.n_embd_k_gqa()], Split::Whole);
        t.mat(T::AttnV, &[embd, hp.n_embd_v_gqa()], Split::Whole);
        t.mat(T::AttnOutput, &[d * n_head, embd], Split::Whole);
        t.vec(T::AttnQNorm, &[d], Split::Whole);
        t.vec(T::AttnKNorm, &[d], Split::Whole);
    }
}

/// The layer of a hybrid Qwen model around its FFN `ffn`: norm → DeltaNet or gated
/// attention → residual → post-attention norm → FFN → residual.
pub fn layer<'g>(
    b: &mut Builder<'g>,
    w: &LayerTensors<'g>,
    layer: usize,
    hidden: Tensor<'g>,
    ffn: impl FnOnce(&mut Builder<'g>, Tensor<'g>) -> Tensor<'g>,
) -> Tensor<'g> {
    let cur = b.norm(hidden, w.get(T::AttnNorm));
    let cur = if b.hp.is_recurrent(layer) {
        b.gated_delta_net(w, layer, cur)
    } else {
        b.gated_attention(w, layer, cur)
    };
    // Every row goes through the last layer, as in llama.cpp (the rows that need logits
    // are kept after it): an FFN of fewer rows would round otherwise.
    let ffn_in = b.ctx.add(cur, hidden);
    let cur = b.norm(ffn_in, w.get(T::PostAttentionNorm));
    let cur = ffn(b, cur);
    b.ctx.add(cur, ffn_in)
}

/// A DeltaNet layer's projections of its input.
struct DeltaInputs<'g> {
    /// Queries, keys and values before the convolution, `[channels, n_tokens]`.
    qkv: Tensor<'g>,
    /// The output gate, `[d_inner, n_tokens]`.
    z: Tensor<'g>,
    /// Write strength (after the sigmoid), `[n_v_heads, n_tokens]`.
    beta: Tensor<'g>,
    /// Log decay, `[n_v_heads, n_tokens]`.
    g: Tensor<'g>,
}

/// How value heads share key heads.
#[derive(Clone, Copy)]
enum KeyHeads {
    /// Value head `i` reads key head `i % n_k_heads` (the fused kernel's broadcast;
    /// qwen35).
    Tiled,
    /// Value head `i` reads key head `i / (n_v_heads / n_k_heads)` (qwen3next).
    Interleaved,
}

impl<'g> Builder<'g> {
    /// A gated DeltaNet layer over `x [n_embd, n_tokens]`: each run of a sequence's rows
    /// continues that sequence's convolution and delta-rule states and leaves the
    /// states after its last tokens in the cache. Returns `[n_embd, n_tokens]`.
    pub fn gated_delta_net(&mut self, w: &LayerTensors<'g>, layer: usize, x: Tensor<'g>) -> Tensor<'g> {
        let ctx = self.ctx;
        let ssm = self.hp.ssm.as_ref().expect("a recurrent layer has DeltaNet sizes");
        let (h_k, h_v) = (ssm.n_groups as i64, ssm.n_heads as i64);
        let n_tokens = x.ne()[1];
        let qkv = self
            .mm(w.get(T::AttnQkv), x)
            .named(&format!("linear_attn_qkv_mixed-{layer}")); // [channels, n_tokens]
        let z = self.mm(w.get(T::AttnGate), x).named(&format!("z-{layer}")); // [d_inner, n_tokens]
        let (beta, alpha, heads) = match w.opt(T::SsmBa) {
            // Qwen3-Next: per key head, its value heads' beta then their alpha; its key
            // heads serve runs of consecutive value heads.
            Some(ba) => {
                let ba = ctx.reshape_3d(self.mm(ba, x), 2 * h_v / h_k, h_k, n_tokens);
                let per_key = h_v / h_k;
                let elt = ba.nb()[0];
                let part = |offset: usize| ctx.view_3d(ba, [per_key, h_k, n_tokens], ba.nb()[1], ba.nb()[2], offset);
                let beta = ctx.reshape_2d(ctx.cont(part(0)), h_v, n_tokens);
                let alpha = ctx.cont_2d(part(per_key as usize * elt), h_v, n_tokens);
                (beta, alpha, KeyHeads::Interleaved)
            }
            None => {
                let beta = self.mm(w.get(T::SsmBeta), x);
                let alpha = self.mm(w.get(T::SsmAlpha), x);
                (beta, alpha, KeyHeads::Tiled)
            }
        };
        let beta = ctx.sigmoid(beta); // [h_v, n_tokens]
        let decay = ctx.softplus(ctx.add(alpha, w.get(T::SsmDt)));
        let g = ctx.mul(decay, w.get(T::SsmA)).named(&format!("gate-{layer}")); // [h_v, n_tokens]
        self.delta_rule(w, layer, DeltaInputs { qkv, z, beta, g }, heads)
    }

    /// The convolution, the delta rule and the gated output of a DeltaNet layer over
    /// its projected `inputs`, key heads shared among value heads as `heads` says.
    fn delta_rule(
        &mut self,
        w: &LayerTensors<'g>,
        layer: usize,
        inputs: DeltaInputs<'g>,
        heads: KeyHeads,
    ) -> Tensor<'g> {
        let hp = self.hp;
        let ctx = self.ctx;
        let ssm = hp.ssm.as_ref().expect("a recurrent layer has DeltaNet sizes");
        let (s, h_k, h_v) = (ssm.d_state as i64, ssm.n_groups as i64, ssm.n_heads as i64);
        let DeltaInputs { qkv, z, beta, g } = inputs;
        let n_tokens = qkv.ne()[1];
        let named = |t: Tensor<'g>, name: &str| t.named(&format!("{name}-{layer}"));

        let state_all = self.rs.state(layer);
        let f32_size = std::mem::size_of::<f32>();
        let mut outs = Vec::new();
        // Each run's graph writes states through `self`, so the runs are copied first.
        for run in &self.inputs.state_runs.clone() {
            let (r0, n) = (run.rows.start, run.rows.len() as i64);
            let conv_in = self.conv_input(layer, qkv, run);
            let conv = ctx.silu(ctx.ssm_conv(conv_in, w.get(T::SsmConv1d))); // [channels, n, 1]
            let row = conv.nb()[1];
            let head_views = |n_heads: i64, offset: i64| {
                ctx.view_4d(
                    conv,
                    [s, n_heads, n, 1],
                    [s as usize * f32_size, row, row * n as usize],
                    offset as usize * f32_size,
                )
            };
            let q = self.l2_norm(head_views(h_k, 0));
            let k = self.l2_norm(head_views(h_k, s * h_k));
            let v = head_views(h_v, 2 * s * h_k);
            let (q, k) = match heads {
                KeyHeads::Tiled => (q, k),
                KeyHeads::Interleaved if h_k == h_v => (q, k),
                KeyHeads::Interleaved => {
                    // Each key head repeated for its value heads, as llama.cpp repeats them.
                    let repeat = |t: Tensor<'g>| {
                        let one = ctx.reshape_4d(t, [s, 1, h_k, n]);
                        ctx.reshape_4d(ctx.repeat_4d(one, [s, h_v / h_k, h_k, n]), [s, h_v, n, 1])
                    };
                    (repeat(q), repeat(k))
                }
            };
            let run_rows = |t: Tensor<'g>| {
                let view = ctx.view_2d(t, h_v, n, t.nb()[1], r0 * t.nb()[1]);
                ctx.reshape_4d(view, [1, h_v, n, 1])
            };
            let state = ctx.reshape_4d(ctx.get_rows(state_all, run.source), [s, s, h_v, 1]);
            let packed = ctx.gated_delta_net(q, k, v, run_rows(g), run_rows(beta), state, KEPT_STATES);
            let o = self.unpack_recurrence(packed, s, h_v, state_all, run);
            outs.push(o);
        }
        assert!(
            !outs.is_empty(),
            "a stage with recurrent layers plans a run for every row"
        );
        let out = concat_all(ctx, outs, 2); // [s, h_v, n_tokens, 1]
        let z = ctx.reshape_4d(z, [s, h_v, n_tokens, 1]);
        let normed = ctx.mul(self.norm(out, w.get(T::SsmNorm)), ctx.silu(z));
        let flat = ctx.reshape_2d(normed, s * h_v, n_tokens);
        named(self.mm(w.get(T::SsmOut), flat), "linear_attn_out")
    }

    /// The causal convolution's input for `run` in recurrent layer `layer`: the
    /// sequence's last `d_conv - 1` inputs, then the run's rows of `x`
    /// `[channels, n_tokens]`, as `[d_conv - 1 + n, channels, 1]`. The convolution
    /// states after the run's kept positions (the last `d_conv - 1` inputs up to each)
    /// go to its target rows.
    pub(super) fn conv_input(&mut self, layer: usize, x: Tensor<'g>, run: &StateRunInputs<'g>) -> Tensor<'g> {
        let ctx = self.ctx;
        let ssm = self.hp.ssm.as_ref().expect("a recurrent layer has its sizes");
        let (d_conv, channels) = (ssm.d_conv as i64, ssm.conv_channels() as i64);
        let (r0, n) = (run.rows.start, run.rows.len() as i64);
        let conv_all = self.rs.conv(layer);
        let previous = ctx.reshape_3d(ctx.get_rows(conv_all, run.source), d_conv - 1, channels, 1);
        let run_x = ctx.view_2d(x, channels, n, x.nb()[1], r0 * x.nb()[1]);
        let conv_in = ctx.concat(previous, ctx.transpose(run_x), 0);
        let conv_len = ssm.conv_state_len() as i64;
        let snapshots = (0..n.min(KEPT_STATES as i64))
            .map(|j| {
                let view = ctx.view_3d(
                    conv_in,
                    [d_conv - 1, channels, 1],
                    conv_in.nb()[1],
                    conv_in.nb()[2],
                    (n - j) as usize * conv_in.nb()[0],
                );
                ctx.reshape_2d(ctx.cont(view), conv_len, 1)
            })
            .reduce(|done, next| ctx.concat(done, next, 1))
            .expect("a run has at least one row");
        self.graph.expand(ctx.set_rows(conv_all, snapshots, run.targets));
        conv_in
    }

    /// The outputs `[d, heads, n, 1]` that a fused recurrence (the delta rule's or the
    /// selective scan's) packed for `run`, before the states after its kept positions
    /// (newest first), which go to the run's target rows of `state_all`.
    pub(super) fn unpack_recurrence(
        &mut self,
        packed: Tensor<'g>,
        d: i64,
        heads: i64,
        state_all: Tensor<'g>,
        run: &StateRunInputs<'g>,
    ) -> Tensor<'g> {
        let ctx = self.ctx;
        let f32_size = std::mem::size_of::<f32>();
        let n = run.rows.len() as i64;
        let outputs = (d * heads * n) as usize * f32_size;
        let state_row = state_all.nb()[1];
        let n_kept = run.rows.len().min(KEPT_STATES) as i64;
        let states = ctx.view_2d(packed, state_all.ne()[0], n_kept, state_row, outputs);
        self.graph.expand(ctx.set_rows(state_all, states, run.targets));
        let row = d as usize * f32_size;
        ctx.view_4d(packed, [d, heads, n, 1], [row, row * heads as usize, outputs], 0)
    }

    /// `x / max(‖x‖, ε)` over dim 0, as llama.cpp's `build_gdn_l2_norm` computes it: an
    /// RMS norm with `ε / n`, scaled by `1 / √n`.
    pub(super) fn l2_norm(&self, x: Tensor<'g>) -> Tensor<'g> {
        let n = x.ne()[0] as f32;
        self.ctx
            .scale(self.ctx.rms_norm(x, self.hp.rms_eps / n), 1.0 / n.sqrt())
    }

    /// Qwen's gated attention over `x [n_embd, n_tokens]`: the query projection gives
    /// each head's query and an output gate; queries and keys are RMS-normed per head
    /// and rotated (by M-RoPE where the model has sections); the heads' outputs are multiplied by `sigmoid(gate)`
    /// before the output projection.
    pub fn gated_attention(&mut self, w: &LayerTensors<'g>, layer: usize, x: Tensor<'g>) -> Tensor<'g> {
        let hp = self.hp;
        let ctx = self.ctx;
        let n_tokens = x.ne()[1];
        let (d, n_head, n_head_kv) = (hp.head_dim_k as i64, hp.n_head as i64, hp.n_head_kv as i64);
        let q_full = self.mm(w.get(T::AttnQ), x); // [2 d n_head, n_tokens]
        let elt = q_full.nb()[0];
        let (head, row) = (elt * 2 * d as usize, q_full.nb()[1]);
        let q = ctx.view_3d(q_full, [d, n_head, n_tokens], head, row, 0);
        let q = self.norm(q, w.get(T::AttnQNorm));
        let k = ctx.reshape_3d(self.mm(w.get(T::AttnK), x), d, n_head_kv, n_tokens);
        let k = self.norm(k, w.get(T::AttnKNorm));
        let gate = ctx.view_3d(q_full, [d, n_head, n_tokens], head, row, elt * d as usize);
        let gate = ctx.cont_2d(gate, d * n_head, n_tokens);
        let v = ctx.reshape_3d(self.mm(w.get(T::AttnV), x), d, n_head_kv, n_tokens);
        let positions = self.inputs.positions;
        let rope = |t: Tensor<'g>| match hp.rope_sections {
            Some(sections) => ctx.rope_multi(t, positions, sections, &hp.rope),
            None => ctx.rope(t, positions, None, &hp.rope),
        };
        let q = rope(q).named(&format!("Qcur-{layer}"));
        let k = rope(k).named(&format!("Kcur-{layer}"));
        let kv = KeyValues {
            k,
            v: Some(v),
            d_v: hp.head_dim_v,
        };
        let out = self.attend(layer, q, kv, None, hp.attn_scale);
        let out = ctx.reshape_2d(out, d * n_head, n_tokens);
        let out = ctx.mul(out, ctx.sigmoid(gate));
        self.attn_output(w, out)
    }
}

/// The keys of an example hybrid model of `shape`: DeltaNet heads of half the attention
/// head size, as many value heads as query heads and key heads as key/value heads, a
/// kernel of 4, attention every second layer, and M-RoPE over a quarter of each head in
/// sections shaped like Qwen 3.5's (`[11, 11, 10, 0]` of 64).
pub fn example(shape: &Shape) -> Vec<(&'static str, Value)> {
    let d_state = (shape.head_dim / 2).max(1);
    let n_rot = (shape.head_dim / 4).max(2) & !1;
    let half = n_rot / 2;
    let (t, h) = (half * 3 / 8, half * 3 / 8);
    let sections = [t, h, half - t - h, 0].map(|n| Value::U32(n as u32));
    vec![
        ("ssm.conv_kernel", Value::U32(4)),
        ("ssm.state_size", Value::U32(d_state as u32)),
        ("ssm.time_step_rank", Value::U32(shape.n_head as u32)),
        ("ssm.group_count", Value::U32(shape.n_head_kv as u32)),
        ("ssm.inner_size", Value::U32((d_state * shape.n_head) as u32)),
        ("full_attention_interval", Value::U32(2)),
        ("rope.dimension_count", Value::U32(n_rot as u32)),
        ("rope.dimension_sections", Value::Array(sections.to_vec())),
    ]
}
