//! DeepSeek V4's heavily compressed attention (`attention.compress_ratios` 128), as
//! llama.cpp's `deepseek4.cpp` computes it (`build_hca_compressed_kv_from_state`,
//! `build_hca_attention`):
//!
//! - each token's compressor rows: a value `attn_compressor_kv · x` and a score
//!   `attn_compressor_gate · x` plus the bias of its slot in the block
//!   (`attn_compressor_ape`, by position mod 128);
//! - a sequence's positions from its first are cut into blocks of 128; a complete
//!   block becomes one compressed key: per dimension, its values weighed by a softmax
//!   of its scores, RMS-normed (`attn_compressor_norm`) and rotated at the block's
//!   first position with the compressed layers' RoPE;
//! - a query attends to the raw window and, after it, to the compressed keys of the
//!   blocks that end at or before it (keys are also values).
//!
//! llama.cpp keeps the scores and values of a sequence's incomplete block as state and
//! writes each compressed key to a cache of its own when its block completes. baton keeps
//! every token's rows in the cache cells of the full cache instead (see
//! [`KvCache::compressor`](crate::KvCache::compressor)) and compresses every complete block
//! again at each step, as GLM-5 next's k-pool does: a compressed key is a function of
//! its block's rows alone, so it comes out the same, and truncating a sequence (prefix
//! reuse, rejected drafts) drops the rows with its tokens, leaving nothing to restore.

use baton_ggml::{DType, Tensor};

use super::attention::ExtraKeys;
use super::Builder;
use crate::hparams::HCA_RATIO;
use crate::names::LayerTensor as T;
use crate::weights::LayerTensors;

/// llama.cpp pads the compressed keys a step attends over to a multiple of this (at
/// least one), so that its graphs keep their shape.
const KEYS_PAD: usize = 256;

/// The compressed keys a span with `n_blocks` complete blocks attends over: padded as
/// llama.cpp pads them (the same count keeps flash attention on the same path).
pub fn hca_keys(n_blocks: usize) -> usize {
    n_blocks.div_ceil(KEYS_PAD).max(1) * KEYS_PAD
}

/// The f16 mask `[n_keys, rows]` of rows at `positions`: row `i` sees the blocks that
/// end at or before its position.
pub fn hca_mask(positions: &[i32], n_keys: usize) -> Vec<u16> {
    const KEEP: u16 = 0x0000;
    const DROP: u16 = 0xFC00;
    positions
        .iter()
        .flat_map(|&pos| {
            let seen = (pos.max(-1) + 1) as usize / HCA_RATIO;
            (0..n_keys).map(move |key| if key < seen { KEEP } else { DROP })
        })
        .collect()
}

/// Stores the batch's compressor rows of layer `layer` (from its input `x` `[n_embd,
/// n_tokens]`) in their cells, and returns each span's compressed keys with their mask.
pub(super) fn compressed_keys<'g>(
    b: &mut Builder<'g>,
    w: &LayerTensors<'g>,
    layer: usize,
    x: Tensor<'g>,
) -> Vec<ExtraKeys<'g>> {
    let ctx = b.ctx;
    let hp = b.hp;
    let v4 = hp.dsv4.as_ref().expect("a compressed layer is DeepSeek V4's");
    let d = hp.head_dim_k;
    let n_nope = d - hp.rope.n_dims as usize;
    let named = |t: Tensor<'g>, name: &str| t.named(&format!("{name}-{layer}"));

    let values = named(b.mm(w.get(T::AttnCompressorKv), x), "hca_state_kv"); // [d, n_tokens]
    let slots = b
        .inputs
        .block_slots
        .expect("the stage creates the block slots of compressed layers");
    let ape = ctx.get_rows(w.get(T::AttnCompressorApe), slots); // [d, n_tokens]
    let scores = named(
        ctx.add(b.mm(w.get(T::AttnCompressorGate), x), ape),
        "hca_state_score_ape",
    );
    let cache =
        b.kv.compressor(layer)
            .expect("a compressed layer has its compressor rows");
    b.graph
        .expand(ctx.set_rows(cache, ctx.concat(values, scores, 0), b.inputs.kv_slots));

    let mut keys = Vec::with_capacity(b.inputs.spans.len());
    for span in &b.inputs.spans {
        let hca = span.hca.expect("the stage creates the inputs of compressed layers");
        let n_blocks = span.blocks;
        let n_keys = hca_keys(n_blocks);
        let zeros = |n: usize| ctx.fill(ctx.new_tensor(DType::F16, &[d as i64, 1, n as i64]), 0.0);
        let compressed = match hca.positions {
            None => zeros(n_keys),
            Some(positions) => {
                let n = n_blocks as i64;
                let cell = cache.nb()[1];
                let first = span.span.cells.start * cell;
                let part = |offset: usize| {
                    let rows = ctx.view_3d(
                        cache,
                        [d as i64, HCA_RATIO as i64, n],
                        cell,
                        HCA_RATIO * cell,
                        first + offset,
                    );
                    ctx.cont(ctx.permute(rows, [1, 0, 2, 3])) // [HCA_RATIO, d, n]
                };
                let (block_values, block_scores) = (part(0), part(d * std::mem::size_of::<f32>()));
                // Per dimension, a softmax over the block's slots weighs its values.
                let weights = ctx.soft_max(block_scores);
                let pooled = ctx.sum_rows(ctx.mul(block_values, weights)); // [1, d, n]
                let pooled = ctx.cont(ctx.permute(pooled, [1, 0, 2, 3])); // [d, 1, n]
                let pooled = b.norm(pooled, w.get(T::AttnCompressorNorm));
                let pooled = ctx.rope(pooled, positions, None, &v4.compress_rope).rope_offset(n_nope);
                // llama.cpp stores them in its cache of keys, f16 (as DeepSeek V4's
                // keys are kept; see `KvTypes::check`).
                let pooled = named(ctx.cast(pooled, DType::F16), "hca_comp_k");
                match n_keys - n_blocks {
                    0 => pooled,
                    rest => ctx.concat(pooled, zeros(rest), 2),
                }
            }
        };
        keys.push(ExtraKeys {
            keys: ctx.reshape_3d(compressed, d as i64, n_keys as i64, 1),
            mask: hca.mask,
        });
    }
    keys
}
