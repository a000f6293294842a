//! GLM-5 next's k-pool indexer: DeepSeek sparse attention (see [`super::dsa`]) that
//! scores and chooses blocks of tokens instead of tokens, as llama.cpp's
//! `glm5-next.cpp` (`build_kpool_select`) and its `llama_memory_hybrid_idx` compute it.
//!
//! - Each token's indexer key (`indexer.attn_k`, a layer norm with bias; no RoPE, no
//!   Walsh-Hadamard rotation) and its gate scores (`indexer_compressor_gate`) go to
//!   the layer's indexer cache side by side, in the token's cell.
//! - A sequence's positions from its first are cut into blocks of `kpool`. A complete
//!   block pools its tokens' keys into one: per dimension, a softmax over the block of
//!   the gate scores plus each slot's bias (`indexer_compressor_ape`) weighs the keys.
//!   llama.cpp stores each pooled key back in the cache (in the cache's type) when its
//!   block completes and reads it from there; it is a function of the block's cached
//!   rows alone, so baton pools every complete block again at each step and rounds it
//!   through the cache's type, which gives the same values.
//! - A query scores the blocks with the lightning indexer (the blocks padded as
//!   llama.cpp pads them, to a multiple of 64 with one to spare, so that `ggml_top_k`
//!   breaks ties over the same row), masked to the complete blocks that end at or
//!   before it, and attends to the tokens of the `top_k / kpool` best of them that it
//!   sees, and (`kpool_select_tail`) to those of its own incomplete block.
//!
//! llama.cpp also has a gathered form of the attention for micro-batches of at most 16
//! tokens; its contexts with larger micro-batches (the oracle's, and llama-server's
//! default) mask the whole cache as this does.

use baton_ggml::{DType, Tensor};

use super::attention::SparseMask;
use super::Builder;
use crate::names::LayerTensor as T;
use crate::weights::LayerTensors;

/// Blocks llama.cpp's score rows pad to a multiple of, with one unused block at the end.
const PAD_BLOCKS: usize = 64;

/// The blocks of a score row for `n_blocks` complete blocks (llama.cpp's `kpool_pad`).
pub fn padded_blocks(n_blocks: usize) -> usize {
    (n_blocks + 1).div_ceil(PAD_BLOCKS).max(1) * PAD_BLOCKS
}

/// The masks of layer `layer`'s sparse attention, one per span, from the layer input
/// `x` `[n_embd, n_tokens]` and the normalised compressed query `q_compressed`
/// `[n_lora_q, n_tokens]` (the batch's keys and gate scores stored in the layer's
/// indexer cache).
pub(super) fn select<'g>(
    b: &mut Builder<'g>,
    w: &LayerTensors<'g>,
    layer: usize,
    x: Tensor<'g>,
    q_compressed: Tensor<'g>,
) -> Vec<SparseMask<'g>> {
    let ctx = b.ctx;
    let ix = b.hp.indexer().expect("sparse attention has an indexer");
    let kpool = ix.kpool.expect("a k-pool indexer");
    let n_tokens = b.inputs.n_tokens as i64;
    let (head, n_head) = (ix.head_dim as i64, ix.n_head as i64);
    let named = |t: Tensor<'g>, name: &str| t.named(&format!("{name}-{layer}"));

    let q = b.mm(w.get(T::IndexerAttnQB), q_compressed); // [head × n_head, n_tokens]
    let q = named(ctx.reshape_3d(q, head, n_head, n_tokens), "indexer_q");
    let k = named(super::dsa::keys(b, w, x), "indexer_k"); // [head, n_tokens]
    let gate = named(b.mm(w.get(T::IndexerCompressorGate), x), "indexer_gate"); // [head, n_tokens]
    let cache = b.kv.indexer_k(layer).expect("a full indexer layer has its key cache");
    b.graph
        .expand(ctx.set_rows(cache, ctx.concat(k, gate, 0), b.inputs.kv_slots));

    let weights = super::dsa::head_weights(b, w, x); // [n_head, n_tokens]

    let ape = w.get(T::IndexerCompressorApe);
    let mut masks = Vec::with_capacity(b.inputs.spans.len());
    for span in &b.inputs.spans {
        let rows = &span.span.rows;
        let (n_rows, n_kv) = (rows.len() as i64, span.span.cells.len());
        let causal = span
            .mask
            .expect("the stage creates the causal mask of attention layers");
        let n_blocks = span.blocks;
        let n_pool = padded_blocks(n_blocks);
        let keys = pooled_keys(b, cache, ape, span.span.cells.start, n_blocks, n_pool);
        let visible = visible_blocks(b, causal, kpool.size, n_blocks, n_pool); // f32 [n_pool, rows]
        let q_rows = ctx.view_3d(q, [head, n_head, n_rows], q.nb()[1], q.nb()[2], rows.start * q.nb()[2]);
        let w_rows = ctx.view_2d(weights, n_head, n_rows, weights.nb()[1], rows.start * weights.nb()[1]);
        let scores = ctx.lightning_indexer(q_rows, keys, w_rows, ctx.cast(visible, DType::F16)); // [n_pool, rows]
        let n_top = (ix.top_k / kpool.size).min(n_pool);
        let top = ctx.cont(ctx.top_k(scores, n_top)); // i32 [n_top, rows]
        let mask = unmask_blocks(b, causal, visible, top, kpool.size, kpool.select_tail, n_kv);
        let tail = if kpool.select_tail { kpool.size - 1 } else { 0 };
        masks.push(SparseMask {
            mask: named(mask, "indexer_sel"),
            n_kv_max: n_top * kpool.size + tail,
        });
    }
    masks
}

/// The pooled key of each of the `n_blocks` complete blocks from cell `first` of
/// `cache` (rows of key and gate scores), then zeros to `n_pool`: f32 `[head, 1,
/// n_pool]`.
fn pooled_keys<'g>(
    b: &Builder<'g>,
    cache: Tensor<'g>,
    ape: Tensor<'g>,
    first: usize,
    n_blocks: usize,
    n_pool: usize,
) -> Tensor<'g> {
    let ctx = b.ctx;
    let [head, size, _, _] = ape.ne();
    let pad = |n: i64| ctx.fill(ctx.new_tensor(DType::F32, &[head, n]), 0.0);
    if n_blocks == 0 {
        return ctx.reshape_3d(pad(n_pool as i64), head, 1, n_pool as i64);
    }
    let n = n_blocks as i64;
    let cell = cache.nb()[1];
    // The blocks' cached rows as f32, `[2 head, size, n]` (llama.cpp gathers them so).
    let rows = ctx.view_2d(cache, 2 * head, n * size, cell, first * cell);
    let rows = ctx.reshape_3d(ctx.cast(rows, DType::F32), 2 * head, size, n);
    let f32_size = std::mem::size_of::<f32>();
    let part = |i: usize| {
        ctx.view_3d(
            rows,
            [head, size, n],
            rows.nb()[1],
            rows.nb()[2],
            i * head as usize * f32_size,
        )
    };
    let (keys, gates) = (part(0), part(1));
    // Per dimension, a softmax over the block's slots: `[size, head, n]`.
    let logits = ctx.cont(ctx.permute(ctx.add(gates, ape), [1, 0, 2, 3]));
    let probs = ctx.soft_max(ctx.reshape_2d(logits, size, head * n));
    let probs = ctx.reshape_3d(probs, size, head, n);
    let keys = ctx.cont(ctx.permute(keys, [1, 0, 2, 3]));
    let pooled = ctx.sum_rows(ctx.mul(probs, keys)); // [1, head, n]
    let pooled = ctx.reshape_2d(pooled, head, n);
    // Stored in and read from the cache's type by llama.cpp.
    let pooled = match cache.dtype() {
        DType::F32 => pooled,
        dtype => ctx.cast(ctx.cast(pooled, dtype), DType::F32),
    };
    let pooled = match n_pool as i64 - n {
        0 => pooled,
        rest => ctx.concat(pooled, pad(rest), 1),
    };
    ctx.reshape_3d(pooled, head, 1, n_pool as i64)
}

/// Which of `n_pool` blocks each row of the f16 causal mask `causal` `[cells, rows]`
/// sees: the complete blocks whose last token it sees. f32 `[n_pool, rows]`, 0 or -inf.
fn visible_blocks<'g>(b: &Builder<'g>, causal: Tensor<'g>, size: usize, n_blocks: usize, n_pool: usize) -> Tensor<'g> {
    let ctx = b.ctx;
    let n_rows = causal.ne()[1];
    let hidden = |n: usize| ctx.fill(ctx.new_tensor(DType::F32, &[n as i64, n_rows]), f32::NEG_INFINITY);
    if n_blocks == 0 {
        return hidden(n_pool);
    }
    let elt = causal.nb()[0];
    let last = ctx.view_3d(
        causal,
        [1, n_blocks as i64, n_rows],
        size * elt,
        causal.nb()[1],
        (size - 1) * elt,
    );
    let last = ctx.cast(ctx.cont(last), DType::F32);
    let last = ctx.reshape_2d(last, n_blocks as i64, n_rows);
    match n_pool - n_blocks {
        0 => last,
        rest => ctx.concat(last, hidden(rest), 0),
    }
}

/// The attention mask f16 `[n_kv, rows]`: -inf except the tokens of the chosen blocks
/// `top` (i32 `[n_top, rows]`) that a row sees (`visible`), and with `tail` those of
/// its own incomplete block; the causal mask added, as llama.cpp's scatter does.
fn unmask_blocks<'g>(
    b: &Builder<'g>,
    causal: Tensor<'g>,
    visible: Tensor<'g>,
    top: Tensor<'g>,
    size: usize,
    tail: bool,
    n_kv: usize,
) -> Tensor<'g> {
    let ctx = b.ctx;
    let [n_pool, n_rows, _, _] = visible.ne();
    let n_top = top.ne()[0];
    // Blocks of `size` cells, enough for every cell of the span.
    let n_base = n_pool.max(n_kv.div_ceil(size) as i64);
    let size = size as i64;
    let base = ctx.new_tensor(DType::F16, &[size, n_base, n_rows]);
    let base = ctx.fill(base, f32::NEG_INFINITY);
    // A chosen block a row does not see (a row sees fewer blocks than it chooses)
    // stays hidden: its cells take the block's own mask value.
    let chosen = ctx.get_rows(ctx.reshape_3d(visible, 1, n_pool, n_rows), top); // [1, n_top, rows]
    let chosen = ctx.repeat_4d(chosen, [size, n_top, n_rows, 1]);
    let mut blocks = ctx.set_rows(base, chosen, top);
    if tail {
        // A row's incomplete block follows the blocks it sees; those of its cells
        // after the row are hidden by the causal mask.
        let n_seen = ctx.sum_rows(ctx.exp(ctx.reshape_3d(visible, n_pool, 1, n_rows))); // [1, 1, rows]
        let own = ctx.cast(ctx.reshape_2d(n_seen, 1, n_rows), DType::I32);
        let zeros = ctx.fill(ctx.new_tensor(DType::F32, &[size, 1, n_rows]), 0.0);
        blocks = ctx.set_rows(blocks, zeros, own);
    }
    let cells = ctx.view_2d(blocks, n_kv as i64, n_rows, blocks.nb()[2], 0);
    ctx.add(cells, causal)
}
