//! Self-attention over the KV cache, as llama.cpp's `build_qkv` and `build_attn` build
//! it with flash attention: which optional pieces a layer has (fused qkv, biases, q/k
//! norms, attention sinks) follows from the tensors its architecture lists.

use baton_ggml::{DType, Tensor};

use super::builder::{concat_all, Shard};
use super::Builder;
use crate::names::{EndTensor, LayerTensor as T};
use crate::weights::LayerTensors;

/// Keys and values of the batch for one layer, before they enter the cache.
pub struct KeyValues<'g> {
    /// Keys `[d_k, n_head_kv, n_tokens]` (rows contiguous per head).
    pub k: Tensor<'g>,
    /// Values `[d_v, n_head_kv, n_tokens]`, or `None` when the values are the first
    /// `d_v` entries of each key row (MLA's compressed cache holds keys only).
    pub v: Option<Tensor<'g>>,
    /// Width of the values (`d_v`).
    pub d_v: usize,
}

/// One span's attention mask chosen by a sparse-attention indexer.
#[derive(Clone, Copy)]
pub struct SparseMask<'g> {
    /// f16 `[cells, rows]`: 0 on the cells each row attends to, -inf elsewhere.
    pub mask: Tensor<'g>,
    /// At most this many cells of each row are 0.
    pub n_kv_max: usize,
}

/// Keys a span attends to after its cache cells, which are also their values
/// (DeepSeek V4's compressed keys).
#[derive(Clone, Copy)]
pub struct ExtraKeys<'g> {
    /// f16 `[d_k, n, 1]`.
    pub keys: Tensor<'g>,
    /// f16 `[n, rows]`: 0 on the keys each row sees, -inf elsewhere.
    pub mask: Tensor<'g>,
    /// At most this many of the extra keys and the cells' are seen by a row, when the
    /// extra keys are a sparse choice.
    pub n_kv_max: Option<usize>,
}

/// What each span of an attention layer attends with beside its cells' keys and mask
/// (one per span, in span order).
#[derive(Clone, Copy)]
pub enum SpanKeys<'a, 'g> {
    /// Its cells under its own mask.
    Cells,
    /// Its cells under a sparse-attention indexer's mask.
    Sparse(&'a [SparseMask<'g>]),
    /// Its cells, then keys that are also values (DeepSeek V4's compressed keys).
    Extra(&'a [ExtraKeys<'g>]),
}

impl<'g> Builder<'g> {
    /// The standard attention block: projections (fused or separate, with biases when
    /// the layer has them), q/k norms when the layer has them, RoPE, the cache, flash
    /// attention (with sinks when the layer has them), and the output projection with
    /// its bias. `x`: `[n_embd, n_tokens]` in and out.
    pub fn attention(&mut self, w: &LayerTensors<'g>, layer: usize, x: Tensor<'g>) -> Tensor<'g> {
        let out = if self.hp.n_head == 0 {
            // A tensor-parallel member without heads: only the others' heads.
            self.gather(x, Shard::Heads)
        } else {
            let (q, k, v) = self.qkv(w, x);
            let (q, k) = match (w.opt(T::AttnQNorm), w.opt(T::AttnKNorm)) {
                (Some(qn), Some(kn)) => (self.norm(q, qn), self.norm(k, kn)),
                _ => (q, k),
            };
            let out = self.rope_and_attend(layer, q, k, v, w.opt(T::AttnSinks));
            self.gather(out, Shard::Heads)
        };
        self.attn_output(w, out)
    }

    /// Attention whose q/k RMS norms span all heads' projections at once
    /// (`attn_q_norm` of `d_k × n_head` values, `attn_k_norm` of `d_k × n_head_kv`;
    /// MiniMax M2) rather than each head. The norms need every head's values, so a
    /// tensor-parallel member gathers all heads' queries (each computes its own heads'
    /// rows), computes all key heads itself, normalises both whole and keeps its own
    /// heads (see [`tensors::attention_whole_qk_norms`](crate::tensors::attention_whole_qk_norms)).
    /// Separate q, k, v projections with optional biases. `x`: `[n_embd, n_tokens]` in
    /// and out.
    pub fn attention_whole_qk_norms(&mut self, w: &LayerTensors<'g>, layer: usize, x: Tensor<'g>) -> Tensor<'g> {
        let hp = self.hp;
        if hp.n_head == 0 {
            // A member without heads joins both gathers of the heads with nothing; the
            // second reads the first so that they run in the same order as elsewhere.
            let queries = self.gather(x, Shard::Heads);
            let out = self.gather(queries, Shard::Heads);
            return self.attn_output(w, out);
        }
        // The queries' gather carries `d_k` per head where the heads' carries `d_v`.
        debug_assert_eq!(hp.head_dim_k, hp.head_dim_v);
        let ctx = self.ctx;
        let n_tokens = self.inputs.n_tokens as i64;
        let (d_k, d_v) = (hp.head_dim_k, hp.head_dim_v as i64);
        let q = self.linear(w.get(T::AttnQ), w.opt(T::AttnQBias), x); // [d_k × its heads, n_tokens]
        let q = self.gather(q, Shard::Heads); // [d_k × n_head, n_tokens]
        let q = self.norm(q, w.get(T::AttnQNorm)).named(&format!("Qcur_normed-{layer}"));
        let k = self.linear(w.get(T::AttnK), w.opt(T::AttnKBias), x); // [d_k × n_head_kv, n_tokens], every head
        let k = self.norm(k, w.get(T::AttnKNorm)).named(&format!("Kcur_normed-{layer}"));
        let v = self.linear(w.get(T::AttnV), w.opt(T::AttnVBias), x); // [d_v × its kv heads, n_tokens]
        let (q_first, kv_first) = hp.tp_heads.as_ref().map_or((0, 0), |h| (h.q.start, h.kv.start));
        let q = self.heads(q, d_k, q_first, hp.n_head); // [d_k, its heads, n_tokens]
        let k = self.heads(k, d_k, kv_first, hp.n_head_kv);
        let v = ctx.reshape_3d(v, d_v, hp.n_head_kv as i64, n_tokens);
        let out = self.rope_and_attend(layer, q, k, v, None);
        let out = self.gather(out, Shard::Heads);
        self.attn_output(w, out)
    }

    /// Heads `first..first + n` of `rows` (`[d × all heads, n_tokens]`) as
    /// `[d, n, n_tokens]`: the whole tensor reshaped when it holds just those, else a view.
    fn heads(&self, rows: Tensor<'g>, d: usize, first: usize, n: usize) -> Tensor<'g> {
        let ctx = self.ctx;
        let [width, n_tokens, _, _] = rows.ne();
        if first == 0 && (d * n) as i64 == width {
            return ctx.reshape_3d(rows, d as i64, n as i64, n_tokens);
        }
        let elt = rows.nb()[0];
        ctx.view_3d(
            rows,
            [d as i64, n as i64, n_tokens],
            elt * d,
            rows.nb()[1],
            elt * d * first,
        )
    }

    /// The output projection (with its bias) of the heads' outputs
    /// `[d_v × n_head, n_tokens]`, joined across a tensor-parallel group.
    pub fn attn_output(&self, w: &LayerTensors<'g>, heads: Tensor<'g>) -> Tensor<'g> {
        let out = self.linear(w.get(T::AttnOutput), w.opt(T::AttnOutputBias), heads);
        self.gather(out, Shard::Embd)
    }

    /// RoPE on queries `[d_k, n_head, n_tokens]` and keys, the attention temperature
    /// and query scale where the model has them, then [`attend`](Self::attend) (with
    /// `sinks` if any): the heads' outputs `[d_v × n_head, n_tokens]`.
    fn rope_and_attend(
        &mut self,
        layer: usize,
        q: Tensor<'g>,
        k: Tensor<'g>,
        v: Tensor<'g>,
        sinks: Option<Tensor<'g>>,
    ) -> Tensor<'g> {
        let hp = self.hp;
        let ctx = self.ctx;
        let rope = if hp.is_swa(layer) { &hp.rope_swa } else { &hp.rope };
        let factors = self.weights.end(EndTensor::RopeFreqs);
        let mut q = ctx
            .rope(q, self.inputs.positions, factors, rope)
            .named(&format!("Qcur-{layer}"));
        let k = ctx
            .rope(k, self.inputs.positions, factors, rope)
            .named(&format!("Kcur-{layer}"));
        if let Some(temp) = self.inputs.attn_temp {
            q = ctx.mul(q, temp);
        }
        if hp.query_scale != 1.0 {
            q = ctx.scale(q, hp.query_scale);
        }
        let kv = KeyValues {
            k,
            v: Some(v),
            d_v: hp.head_dim_v,
        };
        let out = self.attend(layer, q, kv, sinks, hp.attn_scale);
        ctx.reshape_2d(out, (hp.head_dim_v * hp.n_head) as i64, self.inputs.n_tokens as i64)
    }

    /// Queries `[d_k, n_head, n_tokens]`, keys `[d_k, n_head_kv, n_tokens]` and values
    /// `[d_v, n_head_kv, n_tokens]` of `x`, from `attn_qkv` or `attn_q`/`attn_k`/`attn_v`.
    pub fn qkv(&self, w: &LayerTensors<'g>, x: Tensor<'g>) -> (Tensor<'g>, Tensor<'g>, Tensor<'g>) {
        let hp = self.hp;
        let ctx = self.ctx;
        let n_tokens = self.inputs.n_tokens as i64;
        let (d_k, d_v) = (hp.head_dim_k as i64, hp.head_dim_v as i64);
        let (n_head, n_head_kv) = (hp.n_head as i64, hp.n_head_kv as i64);
        if let Some(wqkv) = w.opt(T::AttnQkv) {
            let mut qkv = self.mm(wqkv, x);
            if let Some(b) = w.opt(T::AttnQkvBias) {
                qkv = ctx.add(qkv, b);
            } else if let (Some(bq), Some(bk), Some(bv)) =
                (w.opt(T::AttnQBias), w.opt(T::AttnKBias), w.opt(T::AttnVBias))
            {
                qkv = ctx.add(qkv, ctx.concat(ctx.concat(bq, bk, 0), bv, 0));
            }
            let elt = qkv.nb()[0];
            let row = qkv.nb()[1];
            let (n_q, n_k) = ((d_k * n_head) as usize, (d_k * n_head_kv) as usize);
            let q = ctx.view_3d(qkv, [d_k, n_head, n_tokens], elt * d_k as usize, row, 0);
            let k = ctx.view_3d(qkv, [d_k, n_head_kv, n_tokens], elt * d_k as usize, row, elt * n_q);
            let v = ctx.view_3d(
                qkv,
                [d_v, n_head_kv, n_tokens],
                elt * d_v as usize,
                row,
                elt * (n_q + n_k),
            );
            return (q, k, v);
        }
        let q = self.linear(w.get(T::AttnQ), w.opt(T::AttnQBias), x);
        let k = self.linear(w.get(T::AttnK), w.opt(T::AttnKBias), x);
        let v = self.linear(w.get(T::AttnV), w.opt(T::AttnVBias), x);
        (
            ctx.reshape_3d(q, d_k, n_head, n_tokens),
            ctx.reshape_3d(k, d_k, n_head_kv, n_tokens),
            ctx.reshape_3d(v, d_v, n_head_kv, n_tokens),
        )
    }

    /// Stores the batch's keys and values in layer `layer`'s cache cells, then attends:
    /// `q [d_k, n_head, n_tokens]` over the cache, with optional per-head `sinks`.
    /// Returns `[d_v, n_head, n_tokens]`.
    ///
    /// Before a quantized cache, queries and keys (and values) are rotated by a
    /// Walsh-Hadamard matrix, and the output rotated back, as llama.cpp does (see
    /// [`KvTypes::k_rotation`](crate::KvTypes::k_rotation)); an f32 cache is read as
    /// f16 by flash attention, as llama.cpp does too.
    pub fn attend(
        &mut self,
        layer: usize,
        q: Tensor<'g>,
        kv: KeyValues<'g>,
        sinks: Option<Tensor<'g>>,
        scale: f32,
    ) -> Tensor<'g> {
        self.attend_masked(layer, q, kv, sinks, scale, SpanKeys::Cells)
    }

    /// [`attend`](Self::attend), each span with what `with` says beside its cells:
    /// DeepSeek sparse attention's masks in place of the spans' own, or DeepSeek V4's
    /// compressed keys after the cells (as llama.cpp joins them to the raw window's).
    pub fn attend_masked(
        &mut self,
        layer: usize,
        mut q: Tensor<'g>,
        mut kv: KeyValues<'g>,
        sinks: Option<Tensor<'g>>,
        scale: f32,
        with: SpanKeys<'_, 'g>,
    ) -> Tensor<'g> {
        if let SpanKeys::Extra(_) = with {
            assert!(kv.v.is_none(), "extra keys are their own values");
        }
        let hp = self.hp;
        let ctx = self.ctx;
        let n_tokens = self.inputs.n_tokens as i64;
        let [d_k, n_head_kv, _, _] = kv.k.ne();
        let d_v = kv.d_v as i64;
        if let Some(rot) = self.kv.k_rotation() {
            q = ctx.mul_mat_hadamard(rot, q);
            kv.k = ctx.mul_mat_hadamard(rot, kv.k);
        }
        let v_rotation = self.kv.v_rotation();
        if let (Some(rot), Some(v)) = (v_rotation, kv.v) {
            kv.v = Some(ctx.mul_mat_hadamard(rot, v));
        }

        // Store this batch's keys and values in their cells (a sliding-window layer's
        // in its own cache, when it has one); expanding the writes now orders them
        // before the attention that reads the cache.
        let swa = hp.is_swa(layer);
        let slots = match self.inputs.kv_slots_swa {
            Some(slots) if swa => slots,
            _ => self.inputs.kv_slots,
        };
        let k_cache = self.kv.k(layer);
        let k_rows = ctx.view_2d(kv.k, d_k * n_head_kv, n_tokens, kv.k.nb()[2], 0);
        let k_store = ctx.set_rows(k_cache, k_rows, slots);
        self.graph.expand(k_store);
        let v_cache = match kv.v {
            Some(v) => {
                let v_cache = self.kv.v(layer);
                let v_rows = ctx.view_2d(v, d_v * n_head_kv, n_tokens, v.nb()[2], 0);
                self.graph.expand(ctx.set_rows(v_cache, v_rows, slots));
                Some(v_cache)
            }
            None => None,
        };

        // Each span attends on its own (see `KvCache::attention_spans`); the outputs
        // `[d_v, n_head, rows]` join back in row order.
        let k_head = k_cache.dtype().row_bytes(d_k as usize);
        let row_bytes = q.nb()[2];
        let mut parts = Vec::with_capacity(self.inputs.spans.len());
        for (index, span) in self.inputs.spans.iter().enumerate() {
            let rows = &span.span.rows;
            let cells = if swa { &span.span.window_cells } else { &span.span.cells };
            let n_kv = cells.len() as i64;
            // `[d, n_kv, n_head_kv]` over the span's cells, heads `head_stride` apart.
            let cache_view = |cache: Tensor<'g>, d: i64, head_stride: usize| {
                let view = ctx.view_3d(
                    cache,
                    [d, n_head_kv, n_kv],
                    head_stride,
                    cache.nb()[1],
                    cells.start * cache.nb()[1],
                );
                let view = ctx.permute(view, [0, 2, 1, 3]);
                match cache.dtype() {
                    DType::F32 => ctx.cast(view, DType::F16),
                    _ => view,
                }
            };
            let keys = cache_view(k_cache, d_k, k_head);
            let values = match v_cache {
                Some(v_cache) => cache_view(v_cache, d_v, v_cache.dtype().row_bytes(d_v as usize)),
                None => cache_view(k_cache, d_v, k_head),
            };
            let q_rows = ctx.view_3d(
                q,
                [q.ne()[0], q.ne()[1], rows.len() as i64],
                q.nb()[1],
                row_bytes,
                rows.start * row_bytes,
            );
            let q_rows = ctx.permute(q_rows, [0, 2, 1, 3]); // [d_k, rows, n_head]
            let mask = if swa { span.mask_swa } else { span.mask };
            let mask = mask.expect("the stage creates the mask of every kind of layer it has");
            let (keys, values, mask, n_kv_max) = match with {
                SpanKeys::Cells => (keys, values, mask, None),
                SpanKeys::Sparse(sparse) => (keys, values, sparse[index].mask, Some(sparse[index].n_kv_max)),
                SpanKeys::Extra(extra) => {
                    let extra = extra[index];
                    let keys = ctx.concat(keys, extra.keys, 1);
                    (keys, keys, ctx.concat(mask, extra.mask, 0), extra.n_kv_max)
                }
            };
            let mut part = ctx.flash_attn(q_rows, keys, values, mask, scale, hp.attn_logit_softcap);
            if let Some(n_kv_max) = n_kv_max {
                part = part.with_n_kv_max(n_kv_max);
            }
            if let Some(sinks) = sinks {
                part = part.with_sinks(sinks);
            }
            parts.push(part); // [d_v, n_head, rows]
        }
        let out = concat_all(ctx, parts, 2);
        match v_rotation {
            Some(rot) => ctx.mul_mat_hadamard(rot, out),
            None => out,
        }
    }
}
