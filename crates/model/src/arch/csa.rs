//! DeepSeek V4's compressed sparse attention (`attention.compress_ratios` 4), as
//! llama.cpp's `deepseek4.cpp` computes it (`build_overlap_compressed_kv_from_state`,
//! `build_lid_top_k`, `build_csa_lid_attention`):
//!
//! - the compressor of [`super::hca`] over blocks of 4 positions that overlap: each
//!   token's rows are twice as wide, and a block's key pools the first halves of the
//!   block before it (none before the first block) with the second halves of its own,
//!   8 slots per dimension;
//! - a lightning indexer with a compressor of its own (`indexer_compressor_*`, the same
//!   overlapping blocks over its heads' width) and its own queries from the compressed
//!   query (`indexer.attn_q_b`, RoPE as the compressed keys', both multiplied by a
//!   Walsh-Hadamard matrix of the head), weighed per head (`indexer.proj`), scores the
//!   compressed blocks a query sees; the query attends to its raw window and to the
//!   `attention.indexer.top_k` best blocks (ggml's `top_k`, as llama.cpp picks them).
//!
//! The rows are kept and the blocks compressed again at each step as in [`super::hca`].

use baton_ggml::{DType, Tensor};

use super::attention::ExtraKeys;
use super::hca::{as_keys, compressed_keys_len, pool, store_rows};
use super::Builder;
use crate::hparams::CSA_RATIO;
use crate::names::LayerTensor as T;
use crate::weights::LayerTensors;

/// Stores the batch's compressor rows of layer `layer` (from its input `x` `[n_embd,
/// n_tokens]`) and its indexer's, and returns each span's compressed keys with the
/// mask of the blocks its indexer chose (`q_compressed`: the normed compressed query,
/// `[n_lora_q, n_tokens]`).
pub(super) fn sparse_keys<'g>(
    b: &mut Builder<'g>,
    w: &LayerTensors<'g>,
    layer: usize,
    x: Tensor<'g>,
    q_compressed: Tensor<'g>,
) -> Vec<ExtraKeys<'g>> {
    let ctx = b.ctx;
    let hp = b.hp;
    let v4 = hp.dsv4.as_ref().expect("a compressed layer is DeepSeek V4's");
    let d = hp.head_dim_k;
    let (n_head, head) = v4.indexer_heads;
    let n_tokens = b.inputs.n_tokens as i64;
    let cache =
        b.kv.compressor(layer)
            .expect("a compressed layer has its compressor rows");
    let ix_cache =
        b.kv.indexer_compressor(layer)
            .expect("a compressed sparse layer has its indexer's compressor rows");
    let rotation =
        b.kv.compressor_rotation()
            .expect("a stage with compressed sparse layers has the indexer's rotation");
    let weights = [T::AttnCompressorKv, T::AttnCompressorGate, T::AttnCompressorApe].map(|t| w.get(t));
    store_rows(b, weights, CSA_RATIO, x, cache, &format!("csa-{layer}"));
    let weights = [
        T::IndexerCompressorKv,
        T::IndexerCompressorGate,
        T::IndexerCompressorApe,
    ]
    .map(|t| w.get(t));
    store_rows(b, weights, CSA_RATIO, x, ix_cache, &format!("lid-{layer}"));

    // The indexer's queries `[head, n_head, n_tokens]` and head weights `[n_head, n_tokens]`.
    let q = b.mm(w.get(T::IndexerAttnQB), q_compressed);
    let q = ctx.reshape_3d(q, head as i64, n_head as i64, n_tokens);
    let q = ctx
        .rope(q, b.inputs.positions, None, &v4.compress_rope)
        .rope_offset(head - hp.rope.n_dims as usize);
    let q = ctx.mul_mat_hadamard(rotation, q).named(&format!("lid_q_rot-{layer}"));
    let head_weights = b.mm(w.get(T::IndexerProj), x);
    let head_weights = ctx.scale(head_weights, 1.0 / ((head * n_head) as f32).sqrt());

    let mut keys = Vec::with_capacity(b.inputs.spans.len());
    for span in &b.inputs.spans {
        let csa = span.compressed(CSA_RATIO);
        let n_keys = compressed_keys_len(csa.blocks);
        let first = span.span.cells.start;
        let pooled = |cache: Tensor<'g>, norm: T, width: usize| {
            csa.positions.map(|positions| {
                let (values, scores) = overlapping_blocks(b, cache, first, width, csa.blocks);
                pool(b, values, scores, w.get(norm), positions)
            })
        };
        let csa_keys = as_keys(b, pooled(cache, T::AttnCompressorNorm, d), d, n_keys);
        let ix_keys = pooled(ix_cache, T::IndexerCompressorNorm, head).map(|k| ctx.mul_mat_hadamard(rotation, k));
        let ix_keys = ctx.reshape_3d(as_keys(b, ix_keys, head, n_keys), head as i64, 1, n_keys as i64);

        let rows = &span.span.rows;
        let n_rows = rows.len() as i64;
        let q_rows = ctx.view_3d(
            q,
            [head as i64, n_head as i64, n_rows],
            q.nb()[1],
            q.nb()[2],
            rows.start * q.nb()[2],
        );
        let w_rows = ctx.view_2d(
            head_weights,
            n_head as i64,
            n_rows,
            head_weights.nb()[1],
            rows.start * head_weights.nb()[1],
        );
        let scores = ctx.lightning_indexer(q_rows, ix_keys, w_rows, csa.mask); // [n_keys, rows]
        let n_top = v4.top_k.min(n_keys);
        let top = ctx.cont(ctx.top_k(scores, n_top)); // i32 [n_top, rows]

        // -inf except the chosen blocks, then the blocks each row sees.
        let hidden = ctx.fill(
            ctx.new_tensor(DType::F16, &[1, n_keys as i64, n_rows]),
            f32::NEG_INFINITY,
        );
        let zeros = ctx.fill(ctx.new_tensor(DType::F16, &[1, n_top as i64, n_rows]), 0.0);
        let chosen = ctx.reshape_2d(ctx.set_rows(hidden, zeros, top), n_keys as i64, n_rows);
        let mask = ctx.add(chosen, csa.mask).named(&format!("csa_top_k_mask-{layer}"));
        let window = span.span.window_cells.len().min(hp.n_swa);
        keys.push(ExtraKeys {
            keys: csa_keys,
            mask,
            n_kv_max: Some(window + n_top),
        });
    }
    keys
}

/// The values and scores `[2 ratio, width, n]` of `n` overlapping blocks from the rows
/// of `cache` from cell `first` (each `[values | scores]`, both `2 width` wide): block
/// `j`'s slots are the first halves of block `j - 1`'s tokens (zero values, -inf
/// scores for the first block), then the second halves of its own.
fn overlapping_blocks<'g>(
    b: &Builder<'g>,
    cache: Tensor<'g>,
    first: usize,
    width: usize,
    n: usize,
) -> (Tensor<'g>, Tensor<'g>) {
    let ctx = b.ctx;
    let (cell, f32_size) = (cache.nb()[1], std::mem::size_of::<f32>());
    let half = |blocks: usize, block: usize, part: usize| {
        let view = ctx.view_3d(
            cache,
            [width as i64, CSA_RATIO as i64, blocks as i64],
            cell,
            CSA_RATIO * cell,
            (first + block * CSA_RATIO) * cell + part * width * f32_size,
        );
        ctx.cont(view)
    };
    let before_first = |value: f32| ctx.fill(ctx.new_tensor(DType::F32, &[width as i64, CSA_RATIO as i64, 1]), value);
    let slots = |prev_part: usize, own_part: usize, missing: f32| {
        let prev = match n {
            1 => before_first(missing),
            _ => ctx.concat(before_first(missing), half(n - 1, 0, prev_part), 2),
        };
        let all = ctx.concat(prev, half(n, 0, own_part), 1); // [width, 2 ratio, n]
        ctx.cont(ctx.permute(all, [1, 0, 2, 3]))
    };
    (slots(0, 1, 0.0), slots(2, 3, f32::NEG_INFINITY))
}
