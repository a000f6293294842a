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
pub fn compressed_keys_len(n_blocks: usize) -> usize {
    n_blocks.div_ceil(KEYS_PAD).max(1) * KEYS_PAD
}

/// The f16 mask `[n_keys, rows]` of rows at `positions` over blocks of `ratio`
/// positions: row `i` sees the blocks that end at or before its position.
pub fn compressed_mask(positions: &[i32], ratio: usize, n_keys: usize) -> Vec<u16> {
    const KEEP: u16 = 0x0000;
    const DROP: u16 = 0xFC00;
    positions
        .iter()
        .flat_map(|&pos| {
            let seen = (pos.max(-1) + 1) as usize / ratio;
            (0..n_keys).map(move |key| if key < seen { KEEP } else { DROP })
        })
        .collect()
}

/// The block slot of each row (position mod `ratio`), i32 `[n_tokens]`.
pub(super) fn block_slots<'g>(b: &Builder<'g>, ratio: usize) -> Tensor<'g> {
    b.inputs
        .block_slots
        .iter()
        .find(|(r, _)| *r == ratio)
        .map(|&(_, t)| t)
        .expect("the stage creates the block slots of its compressed layers")
}

/// Stores the batch's compressor rows (from `x` `[n_embd, n_tokens]`: the values
/// `wkv · x` and the scores `wgate · x` plus the bias of each row's slot, `ape`) in the
/// cells of `cache`.
pub(super) fn store_rows<'g>(
    b: &mut Builder<'g>,
    [wkv, wgate, ape]: [Tensor<'g>; 3],
    ratio: usize,
    x: Tensor<'g>,
    cache: Tensor<'g>,
    name: &str,
) {
    let ctx = b.ctx;
    let values = b.mm(wkv, x).named(&format!("{name}_state_kv")); // [width, n_tokens]
    let ape = ctx.get_rows(ape, block_slots(b, ratio)); // [width, n_tokens]
    let scores = ctx.add(b.mm(wgate, x), ape).named(&format!("{name}_state_score_ape"));
    b.graph
        .expand(ctx.set_rows(cache, ctx.concat(values, scores, 0), b.inputs.kv_slots));
}

/// Compressed keys `[d, 1, n]` from the values and scores of `n` blocks (`[slots, d,
/// n]` each, a block's slots along the rows): per dimension a softmax of the scores
/// weighs the values; the result RMS-normed by `norm` and rotated at `positions` by the
/// compressed layers' RoPE over its last `n_rot` dimensions.
pub(super) fn pool<'g>(
    b: &Builder<'g>,
    values: Tensor<'g>,
    scores: Tensor<'g>,
    norm: Tensor<'g>,
    positions: Tensor<'g>,
) -> Tensor<'g> {
    let ctx = b.ctx;
    let hp = b.hp;
    let v4 = hp.dsv4.as_ref().expect("a compressed layer is DeepSeek V4's");
    let d = values.ne()[1] as usize;
    let weights = ctx.soft_max(scores);
    let pooled = ctx.sum_rows(ctx.mul(values, weights)); // [1, d, n]
    let pooled = ctx.cont(ctx.permute(pooled, [1, 0, 2, 3])); // [d, 1, n]
    let pooled = b.norm(pooled, norm);
    ctx.rope(pooled, positions, None, &v4.compress_rope)
        .rope_offset(d - hp.rope.n_dims as usize)
}

/// Compressed keys `[d, 1, n]` (f32) as the f16 keys `[d, n_keys, 1]` attention reads,
/// zeros after them: llama.cpp stores them in a cache of keys, f16 (as DeepSeek V4's
/// keys are kept; see `KvTypes::check`), zeroed where nothing was written (masked).
pub(super) fn as_keys<'g>(b: &Builder<'g>, pooled: Option<Tensor<'g>>, d: usize, n_keys: usize) -> Tensor<'g> {
    let ctx = b.ctx;
    let zeros = |n: usize| ctx.fill(ctx.new_tensor(DType::F16, &[d as i64, 1, n as i64]), 0.0);
    let keys = match pooled {
        None => zeros(n_keys),
        Some(pooled) => {
            let pooled = ctx.cast(pooled, DType::F16);
            match n_keys as i64 - pooled.ne()[2] {
                0 => pooled,
                rest => ctx.concat(pooled, zeros(rest as usize), 2),
            }
        }
    };
    ctx.reshape_3d(keys, d as i64, n_keys as i64, 1)
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
    let d = b.hp.head_dim_k;
    let cache =
        b.kv.compressor(layer)
            .expect("a compressed layer has its compressor rows");
    let weights = [T::AttnCompressorKv, T::AttnCompressorGate, T::AttnCompressorApe].map(|t| w.get(t));
    store_rows(b, weights, HCA_RATIO, x, cache, &format!("hca-{layer}"));

    let cell = cache.nb()[1];
    let mut keys = Vec::with_capacity(b.inputs.spans.len());
    for span in &b.inputs.spans {
        let hca = span.compressed(HCA_RATIO);
        let n_keys = compressed_keys_len(hca.blocks);
        let pooled = hca.positions.map(|positions| {
            let first = span.span.cells.start * cell;
            // A block's values (or scores) `[HCA_RATIO, d, n]`.
            let part = |offset: usize| {
                let rows = ctx.view_3d(
                    cache,
                    [d as i64, HCA_RATIO as i64, hca.blocks as i64],
                    cell,
                    HCA_RATIO * cell,
                    first + offset,
                );
                ctx.cont(ctx.permute(rows, [1, 0, 2, 3]))
            };
            let (values, scores) = (part(0), part(d * std::mem::size_of::<f32>()));
            let pooled = pool(b, values, scores, w.get(T::AttnCompressorNorm), positions);
            pooled.named(&format!("hca_comp_k-{layer}"))
        });
        keys.push(ExtraKeys {
            keys: as_keys(b, pooled, d, n_keys),
            mask: hca.mask,
            n_kv_max: None,
        });
    }
    keys
}
