//! Kimi Delta Attention (KDA), the recurrent layer of Kimi Linear (`kimi-linear`) and of
//! the models built on it, as llama.cpp's `kimi-linear.cpp` builds it over its fused
//! delta-rule kernel (see [`super::deltanet`] for the gated DeltaNet it extends).
//!
//! The input is projected to queries, keys and values (`n_head` heads of `d_state` each),
//! which pass through a causal convolution of their own (over the sequence's last
//! `d_conv - 1` inputs, kept in its state) and SiLU; queries and keys are L2-normalised.
//! The delta rule then updates each head's `d_state × d_state` matrix token by token,
//! decayed per key dimension by `exp(g)`, `g = softplus(f_b(f_a(x)) + dt) · a` (a
//! low-rank projection; gated DeltaNet has one decay per head), and written with
//! strength `beta = sigmoid(b(x))`. Its outputs are RMS-normed per head, gated by
//! `sigmoid(g_b(g_a(x)))` and projected back.
//!
//! Kimi K3 (`kimi-k3`) gates at full rank (`sigmoid(g(x))`), keeps `a` as a plain
//! `[n_head]` vector, and, when its file sets `kda.gate_lower_bound`, decays by
//! `g = bound · sigmoid(-a · (f_b(f_a(x)) + dt))` (`-a = exp(A_log)`).
//!
//! The three convolutions run as one over the queries', keys' and values' channels
//! side by side (each channel is convolved alone, so this computes the same values), and
//! their state is one row per sequence in [`crate::RecurrentCache`], as for the other
//! recurrent layers.

use baton_ggml::Tensor;

use super::builder::concat_all;
use super::Builder;
use crate::hparams::Keys;
use crate::names::LayerTensor as T;
use crate::recurrent::KEPT_STATES;
use crate::tensors::{LayerPlan, Split};
use crate::weights::LayerTensors;
use crate::ModelError;

/// The tensors of a KDA layer (after the layer's input norm), as llama.cpp's
/// `kimi-linear` lists them: separate q, k and v projections, their convolutions
/// (`[d_conv, 1, channels]`, as quantized files hold them), the decay's and the output
/// gate's low-rank projections, the write strength, `a` (`-exp(A_log)`, `[1, n_head]`),
/// the decay's bias, the output norm and projection (Kimi K3: `a` `[n_head]` and one
/// full-rank gate). Tensor parallelism does not split
/// recurrent layers (see [`crate::TpSplit::new`]), so every tensor is whole.
pub fn tensors(t: &mut LayerPlan<'_>) {
    let hp = t.hp;
    let ssm = hp.ssm.as_ref().expect("a KDA model reads its sizes");
    let (embd, d, heads, inner) = (hp.n_embd, ssm.d_state, ssm.n_heads, ssm.d_inner);
    for projection in [T::AttnQ, T::AttnK, T::AttnV] {
        t.mat(projection, &[embd, inner], Split::Whole);
    }
    for conv in [T::SsmConv1dQ, T::SsmConv1dK, T::SsmConv1dV] {
        t.vec(conv, &[ssm.d_conv, 1, inner], Split::Whole);
    }
    t.mat(T::SsmFA, &[embd, d], Split::Whole);
    t.mat(T::SsmFB, &[d, inner], Split::Whole);
    t.mat(T::SsmBeta, &[embd, heads], Split::Whole);
    let k3 = hp.kimi_k3.is_some();
    // Kimi Linear's converter keeps `a` as `[1, n_head]`; the later models' as `[n_head]`.
    if hp.arch.name == super::kimi_linear::ARCH.name {
        t.vec(T::SsmA, &[1, heads], Split::Whole);
    } else {
        t.vec(T::SsmA, &[heads], Split::Whole);
    }
    t.vec(T::SsmDt, &[inner], Split::Whole);
    if k3 {
        t.mat(T::SsmG, &[embd, inner], Split::Whole);
    } else {
        t.mat(T::SsmGA, &[embd, d], Split::Whole);
        t.mat(T::SsmGB, &[d, inner], Split::Whole);
    }
    t.norm(T::SsmNorm, d);
    t.mat(T::AttnOutput, &[inner, embd], Split::Whole);
}

/// The KDA decay's lower bound (`kda.gate_lower_bound`), as Kimi K3 and GLM-5 next
/// read it: llama.cpp's default, -inf, means none.
pub fn read_gate_lower_bound(keys: &Keys<'_>) -> Result<Option<f32>, ModelError> {
    Ok(keys.opt_f32("kda.gate_lower_bound")?.filter(|&b| b > f32::NEG_INFINITY))
}

impl<'g> Builder<'g> {
    /// A KDA layer over `x [n_embd, n_tokens]`: each run of a sequence's rows continues
    /// that sequence's convolution and delta-rule states and leaves the states after its
    /// last tokens in the cache. Returns `[n_embd, n_tokens]`.
    pub fn kda(&mut self, w: &LayerTensors<'g>, layer: usize, x: Tensor<'g>) -> Tensor<'g> {
        let ctx = self.ctx;
        let ssm = self.hp.ssm.as_ref().expect("a recurrent layer has KDA sizes");
        let (s, h, d_conv) = (ssm.d_state as i64, ssm.n_heads as i64, ssm.d_conv as i64);
        let inner = s * h;
        let n_tokens = x.ne()[1];
        let named = |t: Tensor<'g>, name: &str| t.named(&format!("{name}-{layer}"));

        // Queries, keys and values side by side, and their kernels likewise.
        let qkv = [T::AttnQ, T::AttnK, T::AttnV].map(|p| self.mm(w.get(p), x));
        let qkv = named(concat_all(ctx, qkv.to_vec(), 0), "kda_qkv"); // [3 inner, n_tokens]
        let kernels = [T::SsmConv1dQ, T::SsmConv1dK, T::SsmConv1dV].map(|c| ctx.reshape_2d(w.get(c), d_conv, inner));
        let kernel = concat_all(ctx, kernels.to_vec(), 1); // [d_conv, 3 inner]

        // The decay of each key dimension: softplus(f_b(f_a(x)) + dt) · a, or with a
        // lower bound (Kimi K3), bound · sigmoid(-(f_b(f_a(x)) + dt) · a).
        let f = self.mm(w.get(T::SsmFB), self.mm(w.get(T::SsmFA), x)); // [inner, n_tokens]
        let f = ctx.add(f, w.get(T::SsmDt));
        let a = ctx.reshape_3d(w.get(T::SsmA), 1, h, 1);
        let g = match self.hp.kda_gate_lower_bound {
            Some(bound) => {
                let g = ctx.mul(ctx.reshape_3d(f, s, h, n_tokens), a);
                ctx.scale(ctx.sigmoid(ctx.scale(g, -1.0)), bound)
            }
            None => ctx.mul(ctx.reshape_3d(ctx.softplus(f), s, h, n_tokens), a),
        };
        let g = named(ctx.reshape_2d(g, inner, n_tokens), "kda_g"); // [inner, n_tokens]
        let beta = ctx.sigmoid(self.mm(w.get(T::SsmBeta), x)); // [h, n_tokens]

        let state_all = self.rs.state(layer);
        let f32_size = std::mem::size_of::<f32>();
        let mut outs = Vec::new();
        // Each run's graph writes states through `self`, so the runs are copied first.
        for run in &self.inputs.state_runs.clone() {
            let (r0, n) = (run.rows.start, run.rows.len() as i64);
            let conv_in = self.conv_input(layer, qkv, run);
            let conv = ctx.silu(ctx.ssm_conv(conv_in, kernel)); // [3 inner, n, 1]
            let row = conv.nb()[1];
            let heads = |part: i64| {
                ctx.view_4d(
                    conv,
                    [s, h, n, 1],
                    [s as usize * f32_size, row, row * n as usize],
                    (part * inner) as usize * f32_size,
                )
            };
            let q = self.l2_norm(heads(0));
            let k = self.l2_norm(heads(1));
            let v = heads(2);
            let run_rows = |t: Tensor<'g>, per_head: i64| {
                let view = ctx.view_2d(t, per_head * h, n, t.nb()[1], r0 * t.nb()[1]);
                ctx.reshape_4d(view, [per_head, h, n, 1])
            };
            let state = ctx.reshape_4d(ctx.get_rows(state_all, run.source), [s, s, h, 1]);
            let packed = ctx.gated_delta_net(q, k, v, run_rows(g, s), run_rows(beta, 1), state, KEPT_STATES);
            outs.push(self.unpack_recurrence(packed, s, h, state_all, run));
        }
        assert!(
            !outs.is_empty(),
            "a stage with recurrent layers plans a run for every row"
        );
        let out = concat_all(ctx, outs, 2); // [s, h, n_tokens, 1]

        // RMS-normed per head, gated by sigmoid(g_b(g_a(x))) (Kimi K3: sigmoid(g(x))).
        let gate = match w.opt(T::SsmG) {
            Some(g) => self.mm(g, x),
            None => self.mm(w.get(T::SsmGB), self.mm(w.get(T::SsmGA), x)),
        }; // [inner, n_tokens]
        let gate = ctx.sigmoid(ctx.reshape_4d(gate, [s, h, n_tokens, 1]));
        let gated = ctx.mul(self.norm(out, w.get(T::SsmNorm)), gate);
        let flat = ctx.cont_2d(gated, inner, n_tokens);
        named(self.mm(w.get(T::AttnOutput), flat), "kda_out")
    }
}
