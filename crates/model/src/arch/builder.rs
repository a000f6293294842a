//! The graph builder every layer function gets, with the small shared pieces: norms,
//! projections, gated feed-forward blocks, and the last layer's output rows.

use std::sync::Arc;

use baton_ggml::{batching, Batching, Context, Graph, HostOp, Product, Tensor, Whole};

use super::attention::SparseMask;
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
    /// Cells of the sliding-window layers' own cache the new keys/values go to, i64
    /// `[n_tokens]`, when the stage has those layers and they have their own cache.
    pub kv_slots_swa: Option<Tensor<'g>>,
    /// Rows that attend together, in row order, with their masks.
    pub spans: Vec<SpanInputs<'g>>,
    /// Rows that need logits, i32 `[n_out]`, on the stage that owns the model's last layer.
    pub out_rows: Option<Tensor<'g>>,
    /// Attention temperature of each row, f32 `[1, 1, n_tokens]`, for models that have it.
    pub attn_temp: Option<Tensor<'g>>,
    /// The batch's token ids, i32 `[n_tokens]`, on a first stage (DeepSeek V4's
    /// hash-routed layers choose experts by them).
    pub tokens: Option<Tensor<'g>>,
    /// DeepSeek V4's compressed layers: for each compression ratio of the stage's
    /// layers, each row's slot in its block (its position mod the ratio), i32
    /// `[n_tokens]`.
    pub block_slots: Vec<(usize, Tensor<'g>)>,
    /// Tokens in the batch.
    pub n_tokens: usize,
    /// Rows that continue one sequence's recurrent state each, in row order (stages
    /// with recurrent layers).
    pub state_runs: Vec<StateRunInputs<'g>>,
    /// Whether every row is a decode row (a batch of decode steps, or a token and its
    /// drafts): products whose kernels change with the number of rows then compute
    /// each row as alone, so a step gives the same bits in any such batch as on its own.
    pub decode_rows: bool,
}

/// Rows of the batch that attend together over a range of cache cells.
pub struct SpanInputs<'g> {
    /// The rows and cells.
    pub span: AttnSpan,
    /// Causal mask, f16 `[cells, rows]`, when the stage has full-attention layers.
    pub mask: Option<Tensor<'g>>,
    /// Sliding-window mask, f16 `[window cells, rows]`, when the stage has
    /// sliding-window layers.
    pub mask_swa: Option<Tensor<'g>>,
    /// GLM-5 next's k-pool indexer: the complete blocks of the span's sequence, its
    /// first `blocks × kpool` cells (0 for other models).
    pub blocks: usize,
    /// MiniMax sparse attention's maps between the span's positions and cells, when
    /// the stage has its layers (the span's rows are then of one sequence).
    pub msa: Option<MsaInputs<'g>>,
    /// DeepSeek V4's compressed attention: one per compression ratio of the stage's
    /// layers.
    pub compressed: Vec<CompressedInputs<'g>>,
}

impl<'g> SpanInputs<'g> {
    /// DeepSeek V4's inputs for the layers that compress `ratio` to 1.
    pub fn compressed(&self, ratio: usize) -> &CompressedInputs<'g> {
        self.compressed
            .iter()
            .find(|c| c.ratio == ratio)
            .expect("the stage creates the inputs of its compressed layers")
    }
}

/// DeepSeek V4's compressed attention: what a span's rows see of its sequence's
/// compressed keys of one ratio (as llama.cpp's `llm_graph_input_dsv4` holds it for one
/// stream).
#[derive(Clone, Copy)]
pub struct CompressedInputs<'g> {
    /// Positions each block covers.
    pub ratio: usize,
    /// The complete blocks of the span's sequence, its first `blocks × ratio` cells.
    pub blocks: usize,
    /// f16 `[keys, rows]`: 0 on the complete blocks each row sees (those that end at or
    /// before it), -inf elsewhere, over the keys llama.cpp pads to (see
    /// [`compressed_keys_len`](super::hca::compressed_keys_len)).
    pub mask: Tensor<'g>,
    /// i32 `[blocks]`: the first position of each complete block (the compressed key's
    /// RoPE position); `None` before the first block completes.
    pub positions: Option<Tensor<'g>>,
}

/// MiniMax sparse attention's inputs of one span, over positions `0..n_pos` of its
/// sequence (as llama.cpp's `llm_graph_input_msa` holds them for one stream).
#[derive(Clone, Copy)]
pub struct MsaInputs<'g> {
    /// Positions the blocks cover: one past the sequence's highest, padded to 256 and
    /// then to whole blocks.
    pub n_pos: usize,
    /// f32 `[n_pos / block, rows]`: 1e30 on the blocks each row always attends to
    /// (its own and the `local_blocks - 1` before it), 0 elsewhere.
    pub local: Tensor<'g>,
    /// f32 `[n_pos, rows]`: 0 at the positions each row sees, -inf elsewhere.
    pub pos_mask: Tensor<'g>,
    /// i32 `[n_pos]`: the cell (from the span's first) holding each position, 0 where
    /// none does.
    pub pos_cells: Tensor<'g>,
    /// i32 `[cells]`: the block of each cell's position, for a span of several rows
    /// (which masks the cells outside its chosen blocks).
    pub cell_blocks: Option<Tensor<'g>>,
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
    /// DeepSeek sparse attention: the last layer's choice of tokens (one mask per
    /// span), for the layers after it that reuse it (GLM-5.2's shared indexer layers).
    pub selection: Option<Vec<SparseMask<'g>>>,
    /// Kimi K3's cross-layer residual attention: the raw inputs its stage's layers
    /// banked so far, `[n_embd, n_banked, n_tokens]`.
    pub banked: Option<Tensor<'g>>,
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
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Act {
    /// `silu(gate) * up` (SwiGLU).
    Silu,
    /// `gelu(gate) * up` (GeGLU).
    Gelu,
    /// Kimi K3's situ (see [`situ`]).
    Situ { beta: f32, linear_beta: f32 },
    /// gpt-oss's clamped SwiGLU (MiniMax M3's dense and shared FFNs).
    SwigluOai,
    /// SwiGLU clamped at `limit` (see [`swiglu_clamped`]).
    SiluClamp { limit: f32 },
}

/// DeepSeek V4's SwiGLU as llama.cpp builds it for `swiglu_clamp_*`: clamped
/// (`silu(min(gate, limit)) · clamp(up, ±limit)`) when `limit` is over 1e-6, plain
/// otherwise.
pub fn swiglu_clamped<'g>(ctx: &'g Context, gate: Tensor<'g>, up: Tensor<'g>, limit: f32) -> Tensor<'g> {
    if limit > 1e-6 {
        ctx.swiglu_clamp(gate, up, limit)
    } else {
        ctx.swiglu_split(gate, up)
    }
}

/// situ, as llama.cpp computes it: `β tanh(gate / β) · sigmoid(gate) · λ tanh(up / λ)`
/// (the up branch as it is when `λ ≤ 0`).
pub fn situ<'g>(ctx: &'g Context, gate: Tensor<'g>, up: Tensor<'g>, beta: f32, linear_beta: f32) -> Tensor<'g> {
    let act = ctx.scale(ctx.tanh(ctx.scale(gate, 1.0 / beta)), beta);
    let act = ctx.mul(act, ctx.sigmoid(gate));
    let up = if linear_beta > 0.0 {
        ctx.scale(ctx.tanh(ctx.scale(up, 1.0 / linear_beta)), linear_beta)
    } else {
        up
    };
    ctx.mul(act, up)
}

impl<'g> Builder<'g> {
    /// `rms_norm(x) * weight`.
    pub fn norm(&self, x: Tensor<'g>, weight: Tensor<'g>) -> Tensor<'g> {
        let normed = self.ctx.rms_norm(x, self.hp.rms_eps);
        self.ctx.mul(normed, weight)
    }

    /// `w x (+ b)`.
    pub fn linear(&self, w: Tensor<'g>, b: Option<Tensor<'g>>, x: Tensor<'g>) -> Tensor<'g> {
        let y = self.mm(w, x);
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

    /// `w x` for a weight `w` and activations `x` (`[n, n_tokens]`, or `[n, n_tokens,
    /// k]` for a product per head). In a batch of decode steps each row must get the
    /// bits it gets alone, and ggml's CPU kernels change with the number of rows: the
    /// rows go all at once for most quantized types, through a product that computes
    /// each row as alone for the K-quants (one-row planes, or baton's repacked q4_K
    /// kernel), else in pieces of as many as ggml computes alone with this kind of
    /// weight ([`batching`], measured on this CPU). Otherwise (prompt chunks, weights
    /// on a GPU) all rows at once, as llama.cpp does.
    pub fn mm(&self, w: Tensor<'g>, x: Tensor<'g>) -> Tensor<'g> {
        let ctx = self.ctx;
        match self.decode_batching(w, Product::MulMat, x.ne()[1]) {
            None => ctx.mul_mat(w, x),
            Some(Batching { whole: Some(whole), .. }) if Whole::takes(x) => ctx.mul_mat_whole(w, x, whole),
            Some(Batching { rows: piece, .. }) => {
                let piece = piece as i64;
                let [n, _, k, _] = x.ne();
                let [_, nb1, nb2, _] = x.nb();
                let parts = pieces(x.ne()[1], piece)
                    .map(|(first, rows)| ctx.mul_mat(w, ctx.view_3d(x, [n, rows, k], nb1, nb2, first as usize * nb1)))
                    .collect();
                concat_all(ctx, parts, 1)
            }
        }
    }

    /// `mul_mat_id(experts, x, ids)` (`x` `[n, n_used or 1, n_tokens]`, `ids` `[n_used,
    /// n_tokens]`), with the rows of a decode batch in pieces as [`Builder::mm`] cuts them.
    pub fn mm_id(&self, experts: Tensor<'g>, x: Tensor<'g>, ids: Tensor<'g>) -> Tensor<'g> {
        let ctx = self.ctx;
        match self.decode_batching(experts, Product::MulMatId, x.ne()[2]) {
            None => ctx.mul_mat_id(experts, x, ids),
            Some(Batching { rows: piece, .. }) => {
                let piece = piece as i64;
                let [n, used, _, _] = x.ne();
                let [_, nb1, nb2, _] = x.nb();
                let n_used = ids.ne()[0];
                let ids_nb1 = ids.nb()[1];
                let parts = pieces(x.ne()[2], piece)
                    .map(|(first, rows)| {
                        let x = ctx.view_3d(x, [n, used, rows], nb1, nb2, first as usize * nb2);
                        let ids = ctx.view_2d(ids, n_used, rows, ids_nb1, first as usize * ids_nb1);
                        ctx.mul_mat_id(experts, x, ids)
                    })
                    .collect();
                concat_all(ctx, parts, 2)
            }
        }
    }

    /// How a product with `w` takes a decode batch of `n_rows`, when ggml's product
    /// cannot take them all at once: `None` outside decode batches, for a weight whose
    /// kernels are not probed, and when ggml computes all `n_rows` as alone.
    fn decode_batching(&self, w: Tensor<'g>, product: Product, n_rows: i64) -> Option<Batching> {
        if !self.inputs.decode_rows || n_rows < 2 {
            return None;
        }
        batching(w, product).filter(|b| (b.rows as i64) < n_rows)
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
            Act::Situ { beta, linear_beta } => situ(self.ctx, gate, up, beta, linear_beta),
            Act::SiluClamp { limit } => swiglu_clamped(self.ctx, gate, up, limit),
            Act::SwigluOai => self
                .ctx
                .swiglu_oai(gate, up, super::moe::OAI_ALPHA, super::moe::OAI_LIMIT),
        };
        let shard = if ffn.shared_experts { Shard::FfShexp } else { Shard::Ff };
        let hidden = self.gather(hidden, shard);
        let out = self.linear(w.get(ffn.down), down_b, hidden);
        self.gather(out, Shard::Embd)
    }
}

/// `(first row, rows)` of consecutive pieces of at most `piece` rows covering `n` rows.
fn pieces(n: i64, piece: i64) -> impl Iterator<Item = (i64, i64)> {
    (0..n)
        .step_by(piece as usize)
        .map(move |first| (first, piece.min(n - first)))
}

/// `parts` joined in order along `dim`, pairwise so each value is copied about
/// log2(parts) times rather than once per part after it.
pub(super) fn concat_all<'g>(ctx: &'g Context, mut parts: Vec<Tensor<'g>>, dim: i32) -> Tensor<'g> {
    while parts.len() > 1 {
        parts = parts
            .chunks(2)
            .map(|pair| match *pair {
                [a, b] => ctx.concat(a, b, dim),
                [a] => a,
                _ => unreachable!("chunks of at most 2"),
            })
            .collect();
    }
    parts.pop().expect("at least one piece")
}
