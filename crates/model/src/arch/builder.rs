//! The graph builder every layer function gets, with the small shared pieces: norms,
//! projections, gated feed-forward blocks, and the last layer's output rows.

use baton_ggml::{Context, Graph, Tensor};

use crate::hparams::HParams;
use crate::kv::{AttnSpan, KvCache};
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
    /// Tokens in the batch.
    pub n_tokens: usize,
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

/// Builds one step's graph: holds the graph context and everything layers share.
pub struct Builder<'g> {
    pub ctx: &'g Context,
    pub graph: Graph<'g>,
    pub hp: &'g HParams,
    pub weights: &'g StageWeights,
    pub kv: &'g KvCache,
    pub inputs: StepInputs<'g>,
    /// Whether a layer already kept only the rows that need logits.
    pub outputs_selected: bool,
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
    /// `ffn_{gate,up,down}{suffix}` weights and whichever biases it has.
    pub fn ffn(&self, w: &LayerTensors<'g>, suffix: &str, act: Act, x: Tensor<'g>) -> Tensor<'g> {
        let t = |kind: &str, part: &str| w.opt(&format!("ffn_{kind}{suffix}.{part}"));
        let weight = |kind: &str| w.get(&format!("ffn_{kind}{suffix}.weight"));
        let up = self.linear(weight("up"), t("up", "bias"), x);
        let gate = self.linear(weight("gate"), t("gate", "bias"), x);
        let hidden = match act {
            Act::Silu => self.ctx.swiglu_split(gate, up),
            Act::Gelu => self.ctx.geglu_split(gate, up),
        };
        self.linear(weight("down"), t("down", "bias"), hidden)
    }
}
