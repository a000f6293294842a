//! MiniMax sparse attention (MSA; minimax-m3), as llama.cpp's `src/models/minimax-m3.cpp`
//! builds it over its `llama_kv_cache_msa` (flash attention on, one sequence per
//! stream):
//!
//! - an indexer per sparse layer: one query head per key/value head (`q_proj`), one key
//!   per token (`k_proj`), each RMS-normed and rotated like the attention's heads; the
//!   keys go to the layer's indexer cache, in the same cells as the token's keys and
//!   values (see [`KvCache::indexer_k`](crate::KvCache::indexer_k));
//! - blocks are defined over the sequence's positions `0..n_pos` (one past its highest,
//!   padded to 256 and then to whole blocks): each query head scores every position it
//!   sees (unscaled, in f32), a block scores its best position, and the
//!   `local_blocks` blocks ending at the query's own are forced first (+1e30);
//!   `ggml_top_k` keeps the best `top_k` blocks per head group;
//! - a span of several rows (a prompt) attends over all its cells with a mask per head
//!   group: -inf outside its chosen blocks, plus the causal mask; a span of one row (a
//!   decode step) gathers the keys and values of its chosen blocks' positions (in the
//!   order `top_k` returns them) and attends over those only.
//!
//! Both follow llama.cpp op for op, so the bits are its own. Each span is one
//! sequence's rows (one llama.cpp stream), so a sequence's choice never depends on what
//! else is in the batch, and in a decode batch each row is a span of its own, computed
//! as in a step of its own (see [`one_row_spans`]). llama.cpp counts the positions up to
//! the highest of any sequence in the cache; baton up to the span's highest row, the
//! same for one sequence (the oracle's setting) whose batches come in order.

use std::ops::Range;

use baton_ggml::{Context, DType, Tensor};
use baton_gguf::Value;

use super::builder::concat_all;
use super::{Builder, MsaInputs};
use crate::hparams::{HParams, Keys, Msa};
use crate::kv::AttnSpan;
use crate::names::LayerTensor as T;
use crate::tensors::{LayerPlan, Split};
use crate::weights::LayerTensors;
use crate::ModelError;

/// What llama.cpp pads the positions blocks cover to before whole blocks (its
/// `get_n_pos`, so that graphs keep their shape).
const POS_PAD: usize = 256;

/// The score added to a row's forced blocks, so that they rank first.
const FORCED: f32 = 1e30;

/// The indexer's keys (`attention.indexer.*`), as llama.cpp's `minimax-m3` reads them.
/// Refuses what llama.cpp cannot compute: a block size or top-k of 0 (it divides by the
/// first and asserts), indexer heads other than one per key/value head (it asserts),
/// heads narrower than the RoPE part.
pub(super) fn read(hp: &mut HParams, keys: &Keys<'_>) -> Result<(), ModelError> {
    let n_head = keys.u32("attention.indexer.head_count")?;
    let head_dim = keys.u32("attention.indexer.key_length")?;
    let top_k = keys.u32("attention.indexer.top_k")?;
    let block_size = keys.u32("attention.indexer.block_size")?;
    let local_blocks = keys.u32("attention.indexer.local_blocks")?;
    super::dsa::check_indexer(
        hp,
        keys,
        &[("key_length", head_dim), ("top_k", top_k), ("block_size", block_size)],
    )?;
    if n_head != hp.n_head_kv {
        return Err(ModelError::BadHParams(format!(
            "{} is {n_head}: MiniMax sparse attention has one indexer head per key/value head ({})",
            keys.name("attention.indexer.head_count"),
            hp.n_head_kv
        )));
    }
    hp.msa = Some(Msa {
        n_head,
        head_dim,
        top_k,
        block_size,
        local_blocks,
    });
    Ok(())
}

/// The indexer's keys of an example model: heads of 64 in blocks of 4 positions, 2
/// blocks chosen of which the query's own is forced, so that test prompts attend to a
/// few of their blocks.
pub(super) fn example(n_head_kv: usize) -> Vec<(&'static str, Value)> {
    vec![
        ("attention.indexer.head_count", Value::U32(n_head_kv as u32)),
        ("attention.indexer.key_length", Value::U32(64)),
        ("attention.indexer.top_k", Value::U32(2)),
        ("attention.indexer.block_size", Value::U32(4)),
        ("attention.indexer.local_blocks", Value::U32(1)),
    ]
}

/// The indexer's tensors, on sparse layers. Tensor parallelism is refused for these
/// models, so they are whole.
pub(super) fn tensors(t: &mut LayerPlan<'_>) {
    let hp = t.hp;
    let Some(msa) = hp.msa.filter(|_| hp.is_msa(t.layer)) else {
        return;
    };
    let (embd, head) = (hp.n_embd, msa.head_dim);
    t.mat(T::IndexerQProj, &[embd, msa.n_head * head], Split::WithHeads);
    t.mat(T::IndexerKProj, &[embd, head], Split::WithHeads);
    t.vec(T::IndexerQNorm, &[head], Split::WithHeads);
    t.vec(T::IndexerKNorm, &[head], Split::WithHeads);
}

/// Positions the blocks of a span whose rows are at `positions` cover: one past the
/// highest, padded to [`POS_PAD`], then to whole blocks. The span's rows are its
/// sequence's last (a prompt's chunk, a decode step), so this is what llama.cpp counts
/// from the cache for one sequence.
pub fn span_positions(positions: &[i32], block: usize) -> usize {
    let end = positions.iter().max().map_or(0, |&p| p.max(-1) + 1) as usize;
    let padded = end.div_ceil(POS_PAD).max(1) * POS_PAD;
    padded.div_ceil(block) * block
}

/// The spans of a decode batch (a sequence's next token and its drafts), one row each:
/// a row then chooses and gathers exactly as in a step of its own, where llama.cpp's
/// one-token graph gathers (a span of several rows would mask instead, another sum).
pub fn one_row_spans(spans: Vec<AttnSpan>) -> Vec<AttnSpan> {
    spans
        .into_iter()
        .flat_map(|span| {
            span.rows.clone().map(move |row| AttnSpan {
                rows: row..row + 1,
                ..span.clone()
            })
        })
        .collect()
}

/// f32 `[n_blocks, rows]`: [`FORCED`] on the `local` blocks ending at each row's own
/// (those that exist), 0 elsewhere.
pub fn local_blocks(positions: &[i32], n_blocks: usize, block: usize, local: usize) -> Vec<f32> {
    let mut bias = vec![0.0; n_blocks * positions.len()];
    for (row, &pos) in bias.chunks_exact_mut(n_blocks).zip(positions) {
        let own = pos.max(0) as usize / block;
        for b in (own + 1).saturating_sub(local)..=own {
            if let Some(value) = row.get_mut(b) {
                *value = FORCED;
            }
        }
    }
    bias
}

/// A sparse layer's attention, `x` `[n_embd, n_tokens]` (the normed layer input) in
/// and out: projections, per-head q/k RMS norms, RoPE, the indexer, the cache writes,
/// each span's choice and attention, the output projection.
pub(super) fn attention<'g>(b: &mut Builder<'g>, w: &LayerTensors<'g>, layer: usize, x: Tensor<'g>) -> Tensor<'g> {
    let hp = b.hp;
    let ctx = b.ctx;
    let msa = hp.msa.expect("a sparse layer's model has MSA");
    let n_tokens = b.inputs.n_tokens as i64;
    let positions = b.inputs.positions;

    let (q, k, v) = b.qkv(w, x);
    let q = b.norm(q, w.get(T::AttnQNorm)).named(&format!("Qcur_normed-{layer}"));
    let k = b.norm(k, w.get(T::AttnKNorm)).named(&format!("Kcur_normed-{layer}"));
    let mut q = ctx.rope(q, positions, None, &hp.rope).named(&format!("Qcur-{layer}")); // [d, n_head, n_tokens]
    let mut k = ctx.rope(k, positions, None, &hp.rope).named(&format!("Kcur-{layer}")); // [d, n_head_kv, n_tokens]
    let mut v = v;

    // The indexer: queries [head, n_head_kv, n_tokens], one key per token.
    let (head, n_idx) = (msa.head_dim as i64, msa.n_head as i64);
    let iq = ctx.reshape_3d(b.mm(w.get(T::IndexerQProj), x), head, n_idx, n_tokens);
    let ik = ctx.reshape_3d(b.mm(w.get(T::IndexerKProj), x), head, 1, n_tokens);
    let iq = b.norm(iq, w.get(T::IndexerQNorm));
    let ik = b.norm(ik, w.get(T::IndexerKNorm));
    let iq = ctx
        .rope(iq, positions, None, &hp.rope)
        .named(&format!("indexer_q-{layer}"));
    let ik = ctx
        .rope(ik, positions, None, &hp.rope)
        .named(&format!("indexer_k-{layer}"));
    let ik_cache = b.kv.indexer_k(layer).expect("a sparse layer has its indexer key cache");
    let slots = b.inputs.kv_slots;
    b.graph
        .expand(ctx.set_rows(ik_cache, ctx.view_2d(ik, head, n_tokens, ik.nb()[2], 0), slots));

    // Before a quantized cache, as llama.cpp rotates them (see `Builder::attend`).
    if let Some(rot) = b.kv.k_rotation() {
        q = ctx.mul_mat_hadamard(rot, q);
        k = ctx.mul_mat_hadamard(rot, k);
    }
    let v_rotation = b.kv.v_rotation();
    if let Some(rot) = v_rotation {
        v = ctx.mul_mat_hadamard(rot, v);
    }
    let (d, n_head_kv) = (hp.head_dim_k as i64, hp.n_head_kv as i64);
    let (k_cache, v_cache) = (b.kv.k(layer), b.kv.v(layer));
    b.graph
        .expand(ctx.set_rows(k_cache, ctx.view_2d(k, d * n_head_kv, n_tokens, k.nb()[2], 0), slots));
    b.graph
        .expand(ctx.set_rows(v_cache, ctx.view_2d(v, d * n_head_kv, n_tokens, v.nb()[2], 0), slots));

    let mut parts = Vec::with_capacity(b.inputs.spans.len());
    for span in &b.inputs.spans {
        let rows = &span.span.rows;
        let q_rows = ctx.view_3d(
            q,
            [d, hp.n_head as i64, rows.len() as i64],
            q.nb()[1],
            q.nb()[2],
            rows.start * q.nb()[2],
        );
        let iq_rows = ctx.view_3d(
            iq,
            [head, n_idx, rows.len() as i64],
            iq.nb()[1],
            iq.nb()[2],
            rows.start * iq.nb()[2],
        );
        let sparse = SpanMsa {
            ctx,
            hp,
            msa,
            inputs: span.msa.expect("the stage creates MSA inputs for its spans"),
            cells: span.span.cells.clone(),
            causal: span.mask,
            k: k_cache,
            v: v_cache,
            ik: ik_cache,
        };
        let chosen = sparse.choose(iq_rows); // [top k, n_idx, rows]
        let part = match rows.len() {
            1 => sparse.gather_chosen(q_rows, chosen),
            _ => sparse.mask_unchosen(q_rows, chosen),
        };
        parts.push(part); // [d × n_head, rows]
    }
    let mut out = concat_all(ctx, parts, 1).named(&format!("kqv_out-{layer}"));
    if let Some(rot) = v_rotation {
        out = ctx.mul_mat_hadamard(rot, out);
    }
    b.attn_output(w, out)
}

/// What one span's sparse attention reads: its inputs and cells, and the layer's caches
/// (keys and values `[d × n_head_kv, cells]`, indexer keys `[head, cells]`).
struct SpanMsa<'g> {
    ctx: &'g Context,
    hp: &'g HParams,
    msa: Msa,
    inputs: MsaInputs<'g>,
    cells: Range<usize>,
    /// The span's causal mask, f16 `[cells, rows]`.
    causal: Option<Tensor<'g>>,
    k: Tensor<'g>,
    v: Tensor<'g>,
    ik: Tensor<'g>,
}

impl<'g> SpanMsa<'g> {
    /// The block scores of a span's rows: queries `iq` `[head, n_idx, rows]` against the
    /// indexer keys of its sequence's positions, in f32, -inf where a row sees no
    /// position; a block's score its best position's, its forced blocks +[`FORCED`].
    /// Returns the chosen blocks, i32 `[k, n_idx, rows]`.
    fn choose(&self, iq: Tensor<'g>) -> Tensor<'g> {
        let (ctx, msa, inputs) = (self.ctx, self.msa, self.inputs);
        let [head, n_idx, n_rows, _] = iq.ne();
        let cells = &self.cells;
        let (n_pos, block) = (inputs.n_pos as i64, msa.block_size);
        let n_blocks = n_pos / block as i64;
        let n_top = (msa.top_k as i64).min(n_blocks);
        let cell = self.ik.nb()[1];
        let keys = ctx.view_2d(self.ik, head, cells.len() as i64, cell, cells.start * cell);
        let keys = ctx.get_rows(keys, inputs.pos_cells); // [head, n_pos]
        let scores = ctx.mul_mat(keys, ctx.reshape_2d(iq, head, n_idx * n_rows)).prec_f32();
        let scores = ctx.reshape_3d(scores, n_pos, n_idx, n_rows);
        let pos_mask = ctx.reshape_3d(inputs.pos_mask, n_pos, 1, n_rows);
        let scores = ctx.add(scores, pos_mask);
        let blocks = ctx.max_pool_rows(scores, block); // [n_blocks, n_idx, rows]
        let forced = ctx.reshape_3d(inputs.local, n_blocks, 1, n_rows);
        let blocks = ctx.add(blocks, forced);
        ctx.top_k(blocks, n_top as usize)
    }

    /// One flash attention over every head group: queries `q` `[d, n_head, rows]`, keys and
    /// values `[d, n_kv, 1, groups]`, an f16 mask `[n_kv, rows, 1, groups]` (llama.cpp's
    /// `build_attn_msa_fa`). Returns `[d × n_head, rows]`.
    fn attend_groups(&self, q: Tensor<'g>, k: Tensor<'g>, v: Tensor<'g>, mask: Tensor<'g>) -> Tensor<'g> {
        let ctx = self.ctx;
        let [d, n_head, n_rows, _] = q.ne();
        let groups = k.ne()[3];
        let per_group = n_head / groups;
        let q = ctx.reshape_4d(q, [d, per_group, groups, n_rows]);
        let q = ctx.permute(q, [0, 2, 3, 1]); // [d, rows, per_group, groups]
        let out = ctx.flash_attn(q, k, v, mask, self.hp.attn_scale, 0.0); // [d, per_group, rows, groups]
        let out = ctx.permute(out, [0, 1, 3, 2]);
        let out = if out.is_contiguous() { out } else { ctx.cont(out) };
        ctx.reshape_2d(out, d * n_head, n_rows)
    }

    /// A span of several rows: attention over all its cells, each head group's mask -inf
    /// outside its chosen blocks (through each cell's block) plus the causal mask.
    fn mask_unchosen(&self, q: Tensor<'g>, chosen: Tensor<'g>) -> Tensor<'g> {
        let (ctx, inputs) = (self.ctx, self.inputs);
        let [n_top, n_idx, n_rows, _] = chosen.ne();
        let n_blocks = inputs.local.ne()[0];

        // -inf (f16) everywhere, 0 written at each head group's chosen blocks.
        let forced = ctx.reshape_3d(inputs.local, n_blocks, 1, n_rows);
        let hidden = ctx.cast(ctx.scale_bias(forced, 0.0, -FORCED), DType::F16);
        let hidden = ctx.repeat_4d(hidden, [n_blocks, n_idx, n_rows, 1]);
        let zeros = ctx.scale(ctx.cast(chosen, DType::F32), 0.0);
        let blocks = ctx.set_rows(
            ctx.reshape_3d(hidden, 1, n_blocks, n_idx * n_rows),
            ctx.reshape_3d(zeros, 1, n_top, n_idx * n_rows),
            ctx.reshape_2d(chosen, n_top, n_idx * n_rows),
        );
        let blocks = ctx.reshape_3d(blocks, n_blocks, n_idx, n_rows);
        let blocks = ctx.cont(ctx.permute(blocks, [0, 2, 1, 3])); // [n_blocks, rows, n_idx]

        // Block → cell through each cell's block, then the causal mask added.
        let by_block = ctx.cont(ctx.transpose(ctx.reshape_2d(blocks, n_blocks, n_rows * n_idx)));
        let cell_blocks = inputs.cell_blocks.expect("a span of several rows maps cells to blocks");
        let by_cell = ctx.get_rows(by_block, cell_blocks); // [rows × n_idx, n_kv] f32
        let n_kv = self.cells.len() as i64;
        let by_cell = ctx.reshape_3d(ctx.cont(ctx.transpose(by_cell)), n_kv, n_rows, n_idx);
        let causal = self
            .causal
            .expect("the stage creates the causal mask of attention layers");
        let causal = ctx.reshape_3d(ctx.cast(causal, DType::F32), n_kv, n_rows, 1);
        let mask = ctx.add(by_cell, causal);
        let mask = ctx.cast(ctx.reshape_4d(mask, [n_kv, n_rows, 1, n_idx]), DType::F16);

        // The span's cells with the head groups on dim 3.
        let cells = &self.cells;
        let view = |cache: Tensor<'g>| {
            let d = self.hp.head_dim_k as i64;
            let (head_bytes, cell) = (cache.dtype().row_bytes(d as usize), cache.nb()[1]);
            let view = ctx.view_4d(
                cache,
                [d, n_idx, n_kv, 1],
                [head_bytes, cell, cell * n_kv as usize],
                cells.start * cell,
            );
            ctx.permute(view, [0, 3, 1, 2]) // [d, n_kv, 1, n_idx]
        };
        self.attend_groups(q, view(self.k), view(self.v), mask)
    }

    /// A span of one row: its chosen blocks' positions → cells → key/value rows gathered
    /// (in the order of the choice), attended with the row's mask at those positions.
    fn gather_chosen(&self, q: Tensor<'g>, chosen: Tensor<'g>) -> Tensor<'g> {
        let (ctx, hp, inputs) = (self.ctx, self.hp, self.inputs);
        let [n_top, n_idx, _, _] = chosen.ne();
        let block = self.msa.block_size as i64;
        let n_pos = inputs.n_pos as i64;

        // Positions: block × chosen + 0..block.
        let first = ctx.scale(ctx.cast(chosen, DType::F32), block as f32);
        let first = ctx.reshape_4d(first, [1, n_top, n_idx, 1]);
        let offsets = ctx.reshape_3d(ctx.arange(0.0, block as f32, 1.0), block, 1, 1);
        let positions = ctx.add(ctx.repeat_4d(first, [block, n_top, n_idx, 1]), offsets);
        let n_keys = block * n_top;
        let positions = ctx.cast(ctx.reshape_2d(positions, n_keys * n_idx, 1), DType::I32);

        // Cells, then the rows of each head group's key/value head.
        let pos_cells = ctx.cast(inputs.pos_cells, DType::F32); // small integers: exact
        let cells = ctx.get_rows(ctx.reshape_3d(pos_cells, 1, n_pos, 1), positions);
        let cells = ctx.reshape_4d(cells, [block, n_top, n_idx, 1]);
        let heads = ctx.reshape_3d(ctx.arange(0.0, n_idx as f32, 1.0), 1, 1, n_idx);
        let kv_rows = ctx.add(ctx.scale(cells, n_idx as f32), heads);
        let kv_rows = ctx.cast(ctx.reshape_2d(kv_rows, n_keys * n_idx, 1), DType::I32);

        let span_cells = &self.cells;
        let d = hp.head_dim_k as i64;
        let n_kv = span_cells.len() as i64;
        let gather = |cache: Tensor<'g>| {
            let (head_bytes, cell) = (cache.dtype().row_bytes(d as usize), cache.nb()[1]);
            let rows = ctx.view_3d(
                cache,
                [d, n_idx * n_kv, 1],
                head_bytes,
                cell * n_kv as usize,
                span_cells.start * cell,
            );
            let gathered = ctx.reshape_4d(ctx.get_rows(rows, kv_rows), [d, n_keys, 1, n_idx]);
            // Flash attention reads the cache's type, f16 for a quantized one.
            let dtype = match cache.dtype() {
                t if t.is_quantized() => DType::F16,
                t => t,
            };
            match gathered.dtype() == dtype {
                true => gathered,
                false => ctx.cast(gathered, dtype),
            }
        };
        let (k, v) = (gather(self.k), gather(self.v));
        let mask = ctx.get_rows(ctx.reshape_3d(inputs.pos_mask, 1, n_pos, 1), positions);
        let mask = ctx.cast(ctx.reshape_4d(mask, [n_keys, 1, 1, n_idx]), DType::F16);
        self.attend_groups(q, k, v, mask)
    }
}
