//! Mamba2 layers (Nemotron-H's), as llama.cpp's `build_mamba2_layer` builds them with
//! ggml's selective-scan kernel; each keeps a recurrent state per sequence (see
//! [`crate::RecurrentCache`]).
//!
//! One projection gives the gate `z`, the convolution's input `xBC` and the time steps
//! `dt`; `xBC` passes through a short causal convolution (over the sequence's last
//! `d_conv - 1` inputs, kept in its state), a bias and SiLU, and splits into `x`
//! (`n_heads` heads of `head_dim`), `B` and `C` (`n_groups` groups of `d_state`). The
//! scan updates each head's `d_state × head_dim` state token by token, decayed by
//! `exp(softplus(dt) · A)`; its output plus `D · x` is gated by `silu(z)`, RMS-normed
//! per group and projected back.
//!
//! The scan is a sequential loop over a run's tokens and writes the states after the
//! run's last `KEPT_STATES` tokens, so a run of any length leaves the states a rejected
//! draft rolls back to, in the same bits as the tokens one by one.

use baton_ggml::Tensor;

use super::builder::concat_all;
use super::Builder;
use crate::names::LayerTensor as T;
use crate::recurrent::KEPT_STATES;
use crate::tensors::{LayerPlan, Split};
use crate::weights::LayerTensors;

/// The tensors of a Mamba2 layer (after its input norm). Tensor parallelism does not
/// split these models (see [`crate::TpSplit::new`]), so every tensor is whole.
pub fn tensors(t: &mut LayerPlan<'_>) {
    let hp = t.hp;
    let ssm = hp.ssm.as_ref().expect("Mamba2 models read their sizes");
    let embd = hp.n_embd;
    let channels = ssm.conv_channels();
    let heads = ssm.n_heads;
    let in_proj = ssm.d_inner + channels + heads; // z, xBC, dt
    t.mat(T::SsmIn, &[embd, in_proj], Split::Whole);
    t.vec(T::SsmConv1d, &[ssm.d_conv, channels], Split::Whole);
    t.vec(T::SsmConv1dBias, &[channels], Split::Whole);
    t.vec(T::SsmDt, &[heads], Split::Whole);
    t.vec(T::SsmA, &[1, heads], Split::Whole);
    t.vec(T::SsmD, &[1, heads], Split::Whole);
    t.vec(T::SsmNorm, &[ssm.d_inner / ssm.n_groups, ssm.n_groups], Split::Whole);
    t.mat(T::SsmOut, &[ssm.d_inner, embd], Split::Whole);
}

impl<'g> Builder<'g> {
    /// A Mamba2 layer over `x [n_embd, n_tokens]`: each run of a sequence's rows
    /// continues that sequence's convolution and scan states and leaves the states
    /// after its last tokens in the cache. Returns `[n_embd, n_tokens]`.
    pub fn mamba2(&mut self, w: &LayerTensors<'g>, layer: usize, x: Tensor<'g>) -> Tensor<'g> {
        let hp = self.hp;
        let ctx = self.ctx;
        let ssm = hp.ssm.as_ref().expect("a recurrent layer has Mamba2 sizes");
        let (d_state, n_heads, n_groups) = (ssm.d_state as i64, ssm.n_heads as i64, ssm.n_groups as i64);
        let (d_inner, head_dim) = (ssm.d_inner as i64, ssm.head_dim() as i64);
        let channels = ssm.conv_channels() as i64;
        let n_tokens = x.ne()[1];
        let f32_size = std::mem::size_of::<f32>();
        let named = |t: Tensor<'g>, name: &str| t.named(&format!("{name}-{layer}"));

        let zxbcdt = self.mm(w.get(T::SsmIn), x); // [d_inner + channels + n_heads, n_tokens]
        let row = zxbcdt.nb()[1];
        let z = ctx.view_3d(
            zxbcdt,
            [head_dim, n_heads, n_tokens],
            head_dim as usize * f32_size,
            row,
            0,
        );
        let xbc = ctx.view_2d(zxbcdt, channels, n_tokens, row, d_inner as usize * f32_size);
        let dt = ctx.view_2d(zxbcdt, n_heads, n_tokens, row, (d_inner + channels) as usize * f32_size);
        let dt = ctx.add(ctx.cont(dt), w.get(T::SsmDt)); // [n_heads, n_tokens]

        let state_all = self.rs.state(layer);
        let states = ctx.reshape_4d(state_all, [d_state, head_dim, n_heads, state_all.ne()[1]]);
        let mut outs = Vec::new();
        // Each run's graph writes states through `self`, so the runs are copied first.
        for run in &self.inputs.state_runs.clone() {
            let (r0, n) = (run.rows.start, run.rows.len() as i64);
            let conv_in = self.conv_input(layer, xbc, run);
            let conv = ctx.ssm_conv(conv_in, w.get(T::SsmConv1d));
            let conv = ctx.silu(ctx.add(conv, w.get(T::SsmConv1dBias))); // [channels, n, 1]

            let conv_row = conv.nb()[1];
            let split = |width: i64, count: i64, offset: i64| {
                ctx.view_4d(
                    conv,
                    [width, count, n, 1],
                    [width as usize * f32_size, conv_row, conv_row * n as usize],
                    offset as usize * f32_size,
                )
            };
            let xs = split(head_dim, n_heads, 0);
            let b = split(d_state, n_groups, d_inner);
            let c = split(d_state, n_groups, d_inner + n_groups * d_state);
            let run_dt = ctx.reshape_3d(ctx.view_2d(dt, n_heads, n, dt.nb()[1], r0 * dt.nb()[1]), n_heads, n, 1);
            let out = ctx.ssm_scan(states, xs, run_dt, w.get(T::SsmA), b, c, run.source, KEPT_STATES);
            let y = self.unpack_recurrence(out, head_dim, n_heads, state_all, run);
            let y = ctx.add(y, ctx.mul(xs, w.get(T::SsmD))); // the skip connection
            outs.push(y);
        }
        assert!(
            !outs.is_empty(),
            "a stage with recurrent layers plans a run for every row"
        );
        let y = concat_all(ctx, outs, 2); // [head_dim, n_heads, n_tokens, 1]
        let y = named(ctx.swiglu_split(ctx.cont(z), y), "mamba2_gated");
        let groups = ctx.reshape_3d(y, d_inner / n_groups, n_groups, n_tokens);
        let normed = self.norm(groups, w.get(T::SsmNorm));
        let flat = ctx.reshape_2d(normed, d_inner, n_tokens);
        named(self.mm(w.get(T::SsmOut), flat), "mamba_out")
    }
}
