//! The graph builder every layer function gets, with the small shared pieces: norms,
//! projections, gated feed-forward blocks, and the last layer's output rows.

use std::sync::Arc;

use baton_ggml::{Context, Graph, HostOp, Tensor};

use crate::hparams::HParams;
use crate::kv::{AttnSpan, KvCache};
use crate::names::FfnTensors;
use crate::recurrent::RecurrentCache;
use crate::weights::{LayerTensors, StageWeights};

/// The per-step inputs every layer reads.
pub struct StepInputs<'g> {
    /// Positions of the batch's tokens, i32 `[n_tokens]`.
    pub positions: Tensor<'g>,
    /// Cells the new keys/values go to, i64 `[n_tokens]`.
    pub kv_slots: Tensor<'g>,
    /// Rows that attend together, in row order, with their masks.
    pub spans: Vec<SpanInputs<'g>>,
    /// Rows that need logits, i32 `[n_out]`, on the stage that owns the model's last layer.
    pub out_rows: Option<Tensor<'g>>,
    /// Attention temperature of each row, f32 `[1, 1, n_tokens]`, for models that have it.
    pub attn_temp: Option<Tensor<'g>>,
    /// Tokens in the batch.
    pub n_tokens: usize,
    /// Rows that continue one sequence's recurrent state each, in row order (stages
    /// with recurrent layers).
    pub state_runs: Vec<StateRunInputs<'g>>,
    /// Whether every row is the only one of its sequence (a batch of decode steps):
    /// ops whose kernels change with the number of rows then compute each row alone,
    /// so a step gives the same bits in any such batch as on its own.
    pub decode_rows: bool,
}

/// Rows of the batch that attend together over a range of cache cells.
pub struct SpanInputs<'g> {
    /// The rows and cells.
    pub span: AttnSpan,
    /// Causal mask, f16 `[cells, rows]`, when the stage has full-attention layers.
    pub mask: Option<Tensor<'g>>,
    /// Sliding-window mask (same shape), when the stage has sliding-window layers.
    pub mask_swa: Option<Tensor<'g>>,
}

/// Rows of the batch that continue one sequence's recurrent state.
#[derive(Clone)]
pub struct StateRunInputs<'g> {
    /// Consecutive rows of the batch.
    pub rows: std::ops::Range<usize>,
    /// Row of the state tensors the run starts from, i32 `[1]`.
    pub source: Tensor<'g>,
    /// Rows the states after its last tokens go to, newest first, i64
    /// `[min(rows, KEPT_STATES)]`.
    pub targets: Tensor<'g>,
}

/// Builds one step's graph: holds the graph context and everything layers share.
pub struct Builder<'g> {
    pub ctx: &'g Context,
    pub graph: Graph<'g>,
    pub hp: &'g HParams,
    pub weights: &'g StageWeights,
    pub kv: &'g KvCache,
    pub rs: &'g RecurrentCache,
    pub inputs: StepInputs<'g>,
    /// Whether a layer already kept only the rows that need logits.
    pub outputs_selected: bool,
    /// The group's sums, when this stage is one member of a tensor-parallel group.
    pub tp: Option<TpOps>,
}

/// The host ops a tensor-parallel member's graph joins the members' slices with.
#[derive(Clone)]
pub struct TpOps {
    /// The heads' attention outputs: `[d_v × its heads, n_tokens]` in (any tensor of
    /// `n_tokens` rows for a member without heads), `[d_v × n_head, n_tokens]` out.
    pub heads: Gather,
    /// The FFN's activations: its share of the inner dimension in, all of it out.
    pub ff: Gather,
    /// Each chosen expert's activations: its share of an expert's inner dimension in
    /// (one row per token and chosen expert), all of it out.
    pub ff_exp: Gather,
    /// The shared experts' activations: its share of their inner dimension in, all of
    /// it out.
    pub ff_shexp: Gather,
    /// Output projections: its share of `n_embd` in, `[n_embd, n_tokens]` out.
    pub embd: Gather,
}

/// One all-gather of a tensor-parallel group, as a host op.
#[derive(Clone)]
pub struct Gather {
    /// Gathers this member's slice with the others'.
    pub op: Arc<HostOp>,
    /// Width of the gathered rows.
    pub width: usize,
}

/// Which slices a [`Builder::gather`] joins.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Shard {
    /// Attention heads.
    Heads,
    /// The FFN's inner dimension.
    Ff,
    /// A routed expert's inner dimension.
    FfExp,
    /// The shared experts' inner dimension.
    FfShexp,
    /// The hidden size.
    Embd,
}

/// The activation of a gated feed-forward block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Act {
    /// `silu(gate) * up` (SwiGLU).
    Silu,
    /// `gelu(gate) * up` (GeGLU).
    Gelu,
}

impl<'g> Builder<'g> {
    /// `rms_norm(x) * weight`.
    pub fn norm(&self, x: Tensor<'g>, weight: Tensor<'g>) -> Tensor<'g> {
        let normed = self.ctx.rms_norm(x, self.hp.rms_eps);
        self.ctx.mul(normed, weight)
    }

    /// `w x (+ b)`.
    pub fn linear(&self, w: Tensor<'g>, b: Option<Tensor<'g>>, x: Tensor<'g>) -> Tensor<'g> {
        let y = self.ctx.mul_mat(w, x);
        match b {
            Some(b) => self.ctx.add(y, b),
            None => y,
        }
    }

    /// In a tensor-parallel member, its slice `part` (`[its share, n_tokens]`) joined
    /// with the other members' into the whole `[width, n_tokens]`; elsewhere `part`
    /// itself (which is whole already).
    pub fn gather(&self, part: Tensor<'g>, shard: Shard) -> Tensor<'g> {
        let Some(tp) = &self.tp else {
            return part;
        };
        let gather = match shard {
            Shard::Heads => &tp.heads,
            Shard::Ff => &tp.ff,
            Shard::FfExp => &tp.ff_exp,
            Shard::FfShexp => &tp.ff_shexp,
            Shard::Embd => &tp.embd,
        };
        self.ctx
            .host_op(part, gather.width, gather.op.clone())
            .named("tp_gather")
    }

    /// `w x` for a weight whose matmul kernel depends on the number of rows: f32 (and
    /// f16) weights go through ggml's tiled kernel from 2 rows and its dot product for 1,
    /// which round differently. In a batch of decode steps each row is multiplied on
    /// its own, as it would be alone; otherwise all rows at once, as llama.cpp does.
    pub fn mul_mat_rowwise(&self, w: Tensor<'g>, x: Tensor<'g>) -> Tensor<'g> {
        let ctx = self.ctx;
        let [n, n_rows, _, _] = x.ne();
        if !self.inputs.decode_rows || n_rows < 2 {
            return ctx.mul_mat(w, x);
        }
        let row = |i: i64| ctx.mul_mat(w, ctx.view_2d(x, n, 1, x.nb()[1], i as usize * x.nb()[1]));
        (1..n_rows).fold(row(0), |done, i| ctx.concat(done, row(i), 1))
    }

    /// On the model's last layer, keeps only the rows that need logits (of both the
    /// block output and the residual), so the rest of the graph skips the others.
    pub fn select_outputs(&mut self, layer: usize, cur: Tensor<'g>, residual: Tensor<'g>) -> (Tensor<'g>, Tensor<'g>) {
        match self.inputs.out_rows {
            Some(rows) if layer + 1 == self.hp.n_layer => {
                self.outputs_selected = true;
                (self.ctx.get_rows(cur, rows), self.ctx.get_rows(residual, rows))
            }
            _ => (cur, residual),
        }
    }

    /// A gated feed-forward block as llama.cpp's `build_ffn` computes it with parallel
    /// gate and up projections: `down(act(gate x + b) * (up x + b)) + b`, over the layer's
    /// `ffn` tensors (the dense FFN's or the shared experts') and whichever biases it has.
    pub fn ffn(&self, w: &LayerTensors<'g>, ffn: &FfnTensors, act: Act, x: Tensor<'g>) -> Tensor<'g> {
        let [gate_b, up_b, down_b] = match ffn.biases {
            Some([gate, up, down]) => [w.opt(gate), w.opt(up), w.opt(down)],
            None => [None; 3],
        };
        let up = self.linear(w.get(ffn.up), up_b, x);
        let gate = self.linear(w.get(ffn.gate), gate_b, x);
        let hidden = match act {
            Act::Silu => self.ctx.swiglu_split(gate, up),
            Act::Gelu => self.ctx.geglu_split(gate, up),
        };
        let shard = if ffn.shared_experts { Shard::FfShexp } else { Shard::Ff };
        let hidden = self.gather(hidden, shard);
        let out = self.linear(w.get(ffn.down), down_b, hidden);
        self.gather(out, Shard::Embd)
    }
}
