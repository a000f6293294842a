//! Per-architecture layer graphs over shared building blocks.
//!
//! Each architecture file reads like its paper: norm → attention → residual → norm →
//! FFN → residual. The shared pieces (RMS norm, attention with RoPE and the KV cache,
//! gated FFNs) live here, as methods of [`Builder`].

mod gemma3;
mod llama;

use baton_ggml::{Context, Graph, Tensor};

use crate::hparams::{Arch, HParams};
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
}

/// Options of one attention block that vary per architecture.
pub struct AttnOptions {
    /// RMS-normalise each query/key head with the layer's `q_norm`/`k_norm` weights.
    pub qk_norm: bool,
}

impl<'g> Builder<'g> {
    /// The layer's computation for this model's architecture: hidden in, hidden out,
    /// both `[n_embd, n_tokens]` (fewer rows after the model's last layer).
    pub fn layer(&mut self, w: &LayerTensors<'g>, layer: usize, hidden: Tensor<'g>) -> Tensor<'g> {
        match self.hp.arch {
            Arch::Llama | Arch::Qwen2 => llama::layer(self, w, layer, hidden, AttnOptions { qk_norm: false }),
            Arch::Qwen3 => llama::layer(self, w, layer, hidden, AttnOptions { qk_norm: true }),
            Arch::Gemma3 => gemma3::layer(self, w, layer, hidden),
        }
    }

    /// `rms_norm(x) * weight`.
    pub fn norm(&self, x: Tensor<'g>, weight: Tensor<'g>) -> Tensor<'g> {
        let normed = self.ctx.rms_norm(x, self.hp.rms_eps);
        self.ctx.mul(normed, weight)
    }

    /// `rms_norm(x) * weight` when the layer has that norm (the loader guarantees it
    /// for the architectures that need it), `x` otherwise.
    pub fn norm_opt(&self, x: Tensor<'g>, weight: Option<Tensor<'g>>) -> Tensor<'g> {
        weight.map_or(x, |w| self.norm(x, w))
    }

    /// `w x (+ b)`.
    pub fn linear(&self, w: Tensor<'g>, b: Option<Tensor<'g>>, x: Tensor<'g>) -> Tensor<'g> {
        let y = self.ctx.mul_mat(w, x);
        match b {
            Some(b) => self.ctx.add(y, b),
            None => y,
        }
    }

    /// Self-attention over the KV cache: projects q, k, v; applies RoPE; stores k and v
    /// in the cache; attends; projects out. `[n_embd, n_tokens]` in and out.
    pub fn attention(&mut self, w: &LayerTensors<'g>, layer: usize, x: Tensor<'g>, opts: AttnOptions) -> Tensor<'g> {
        let hp = self.hp;
        let ctx = self.ctx;
        let n_tokens = self.inputs.n_tokens as i64;
        let (d_k, d_v) = (hp.head_dim_k as i64, hp.head_dim_v as i64);

        let q = self.linear(w.wq, w.bq, x);
        let k = self.linear(w.wk, w.bk, x);
        let v = self.linear(w.wv, w.bv, x);
        let mut q = ctx.reshape_3d(q, d_k, hp.n_head as i64, n_tokens); // [d_k, n_head, n_tokens]
        let mut k = ctx.reshape_3d(k, d_k, hp.n_head_kv as i64, n_tokens); // [d_k, n_head_kv, n_tokens]
        if opts.qk_norm {
            if let (Some(qn), Some(kn)) = (w.q_norm, w.k_norm) {
                q = self.norm(q, qn);
                k = self.norm(k, kn);
            }
        }
        let swa = hp.is_swa(layer);
        let rope = if swa { &hp.rope_swa } else { &hp.rope };
        let factors = self.weights.rope_freqs();
        let mut q = ctx
            .rope(q, self.inputs.positions, factors, rope)
            .named(&format!("Qcur-{layer}"));
        let k = ctx
            .rope(k, self.inputs.positions, factors, rope)
            .named(&format!("Kcur-{layer}"));
        if hp.query_scale != 1.0 {
            q = ctx.scale(q, hp.query_scale);
        }

        // Store this batch's keys and values in their cells; expanding the writes now
        // orders them before the attention that reads the cache.
        let k_cache = self.kv.k(layer);
        let v_cache = self.kv.v(layer);
        let k_rows = ctx.reshape_2d(k, hp.n_embd_k_gqa() as i64, n_tokens);
        let v_rows = ctx.reshape_2d(v, hp.n_embd_v_gqa() as i64, n_tokens);
        let k_store = ctx.set_rows(k_cache, k_rows, self.inputs.kv_slots);
        let v_store = ctx.set_rows(v_cache, v_rows, self.inputs.kv_slots);
        self.graph.expand(k_store);
        self.graph.expand(v_store);

        // Each span attends on its own (see `KvCache::attention_spans`); the outputs
        // `[d_v, n_head, rows]` join back in row order.
        let row_bytes = q.nb()[2];
        let mut out: Option<Tensor<'g>> = None;
        for span in &self.inputs.spans {
            let (rows, cells) = (&span.span.rows, &span.span.cells);
            let n_kv = cells.len() as i64;
            let cache_view = |cache: Tensor<'g>, d: i64| {
                let view = ctx.view_3d(
                    cache,
                    [d, hp.n_head_kv as i64, n_kv],
                    cache.nb()[0] * d as usize,
                    cache.nb()[1],
                    cells.start * cache.nb()[1],
                );
                ctx.permute(view, [0, 2, 1, 3]) // [d, n_kv, n_head_kv]
            };
            let q_rows = ctx.view_3d(
                q,
                [d_k, hp.n_head as i64, rows.len() as i64],
                q.nb()[1],
                row_bytes,
                rows.start * row_bytes,
            );
            let q_rows = ctx.permute(q_rows, [0, 2, 1, 3]); // [d_k, rows, n_head]
            let mask = if swa { span.mask_swa } else { span.mask };
            let mask = mask.expect("the stage creates the mask of every kind of layer it has");
            let part = ctx.flash_attn(
                q_rows,
                cache_view(k_cache, d_k),
                cache_view(v_cache, d_v),
                mask,
                hp.attn_scale,
                hp.attn_logit_softcap,
            ); // [d_v, n_head, rows]
            out = Some(match out {
                Some(done) => ctx.concat(done, part, 2),
                None => part,
            });
        }
        let out = out.expect("a batch has at least one row, so one span");
        let out = ctx.reshape_2d(out, d_v * hp.n_head as i64, n_tokens);
        self.linear(w.wo, w.bo, out)
    }

    /// On the model's last layer, keeps only the rows that need logits (of both the
    /// block output and the residual), so the rest of the graph skips the others.
    pub fn select_outputs(&self, layer: usize, cur: Tensor<'g>, residual: Tensor<'g>) -> (Tensor<'g>, Tensor<'g>) {
        match self.inputs.out_rows {
            Some(rows) if layer + 1 == self.hp.n_layer => {
                (self.ctx.get_rows(cur, rows), self.ctx.get_rows(residual, rows))
            }
            _ => (cur, residual),
        }
    }

    /// `down(silu(gate x) * up x)`.
    pub fn ffn_swiglu(&self, w: &LayerTensors<'g>, x: Tensor<'g>) -> Tensor<'g> {
        let gate = self.ctx.mul_mat(w.ffn_gate, x);
        let up = self.ctx.mul_mat(w.ffn_up, x);
        self.ctx.mul_mat(w.ffn_down, self.ctx.swiglu_split(gate, up))
    }

    /// `down(gelu(gate x) * up x)`.
    pub fn ffn_geglu(&self, w: &LayerTensors<'g>, x: Tensor<'g>) -> Tensor<'g> {
        let gate = self.ctx.mul_mat(w.ffn_gate, x);
        let up = self.ctx.mul_mat(w.ffn_up, x);
        self.ctx.mul_mat(w.ffn_down, self.ctx.geglu_split(gate, up))
    }
}
