//! DeepSeek sparse attention (DSA; deepseek32, glm-dsa): a lightning indexer scores
//! every cached token for each query and the query attends to the `top_k` best only.
//! As llama.cpp's `src/models/deepseek32.cpp` builds it, with the fused
//! `ggml_lightning_indexer` it uses on every backend:
//!
//! - indexer queries from the compressed query (`indexer.attn_q_b`), one key per token
//!   from the layer input (`indexer.attn_k`, then a layer norm with bias), both
//!   rotated by RoPE over their first `n_rot` values and multiplied by a Walsh-Hadamard
//!   matrix; the keys go to the layer's indexer cache, in the same cells as the latent
//!   rows (see [`KvCache::indexer_k`](crate::KvCache::indexer_k));
//! - per-head weights from the layer input (`indexer.proj`), pre-scaled by
//!   `1/sqrt(head_dim × n_head)`;
//! - scores `Σ_h relu(q_h · k) × w_h` plus the causal mask, over the span's cells;
//!   `ggml_top_k` picks the best `top_k` cells of each row (ties fall as in llama.cpp,
//!   over the same number of cells), and the attention mask is -inf everywhere except
//!   those cells, added to the causal mask.

use baton_ggml::{DType, RopeParams, Tensor};

use super::attention::SparseMask;
use super::Builder;
use crate::hparams::{HParams, Indexer, Keys, Kpool};
use crate::names::LayerTensor as T;
use crate::tensors::{LayerPlan, Presence, Split};
use crate::weights::LayerTensors;
use crate::ModelError;

/// The indexer's keys (`attention.indexer.*`), as llama.cpp reads them, onto the MLA
/// hyper-parameters `hp` already holds; `rope_mode` is how its RoPE rotates,
/// `key_norm_eps` its key norm's epsilon and `full_layers` which layers compute their
/// own selection, `kpool` GLM-5 next's blocks (its indexer neither rotates nor
/// multiplies by a Walsh-Hadamard matrix). Refuses what llama.cpp
/// cannot compute: no heads or no tokens to keep, heads narrower than the RoPE part
/// (llama.cpp asserts), or heads whose Walsh-Hadamard matrix would not span them (its
/// product then fails).
pub(super) fn read_indexer(
    hp: &mut HParams,
    keys: &Keys<'_>,
    rope_mode: i32,
    key_norm_eps: f32,
    full_layers: Vec<bool>,
    kpool: Option<Kpool>,
) -> Result<(), ModelError> {
    if full_layers.first() == Some(&false) {
        // llama.cpp asserts: the first layer has no earlier choice to reuse.
        return Err(ModelError::BadHParams(format!(
            "{}: layer 0 must have its own indexer (type 1), as it has no earlier layer's \
             choice to reuse",
            keys.name("attention.indexer.types")
        )));
    }
    let n_head = keys.u32("attention.indexer.head_count")?;
    let head_dim = keys.u32("attention.indexer.key_length")?;
    let top_k = keys.u32("attention.indexer.top_k")?;
    check_indexer(
        hp,
        keys,
        &[("head_count", n_head), ("key_length", head_dim), ("top_k", top_k)],
    )?;
    let indexer = Indexer {
        n_head,
        head_dim,
        top_k,
        rope_mode,
        key_norm_eps,
        full_layers,
        kpool,
    };
    if kpool.is_none() && indexer.rotation() != head_dim {
        return Err(ModelError::BadHParams(format!(
            "{} is {head_dim}: llama.cpp rotates indexer heads by a Walsh-Hadamard matrix \
             of {}, which must be the whole head (64 times a power of two)",
            keys.name("attention.indexer.key_length"),
            indexer.rotation()
        )));
    }
    let mla = hp.mla.as_mut().expect("MLA hyper-parameters are read first");
    if mla.n_lora_q == 0 {
        // The indexer reads the compressed query: these models always have one.
        mla.n_lora_q = keys.u32("attention.q_lora_rank")?;
    }
    mla.indexer = Some(indexer);
    Ok(())
}

/// Refuses indexer keys (`attention.indexer.*`) llama.cpp cannot compute with, of
/// DeepSeek's and MiniMax's sparse attention alike: any of `nonzero` that is 0, and a
/// `key_length` (which `nonzero` holds) narrower than the RoPE part it rotates.
pub(super) fn check_indexer(hp: &HParams, keys: &Keys<'_>, nonzero: &[(&str, usize)]) -> Result<(), ModelError> {
    if let Some((key, _)) = nonzero.iter().find(|(_, value)| *value == 0) {
        return Err(ModelError::BadHParams(format!(
            "{} must not be 0",
            keys.name(&format!("attention.indexer.{key}"))
        )));
    }
    let head_dim = nonzero
        .iter()
        .find(|(key, _)| *key == "key_length")
        .map_or(0, |&(_, v)| v);
    let n_rot = hp.rope.n_dims as usize;
    if head_dim < n_rot {
        return Err(ModelError::BadHParams(format!(
            "{} is {head_dim}, narrower than the {n_rot} RoPE dimensions it rotates",
            keys.name("attention.indexer.key_length")
        )));
    }
    Ok(())
}

/// The indexer's keys of an example model: 4 heads of 64 (the smallest head llama.cpp
/// takes), choosing 8 tokens, so that test prompts attend to a few of their tokens.
pub(super) fn example() -> Vec<(&'static str, baton_gguf::Value)> {
    use baton_gguf::Value;
    vec![
        ("attention.indexer.head_count", Value::U32(4)),
        ("attention.indexer.key_length", Value::U32(64)),
        ("attention.indexer.top_k", Value::U32(8)),
    ]
}

/// The indexer's tensors: required on layers that compute their own selection. Tensor
/// parallelism: every member with heads computes the whole selection (it needs every
/// indexer head), as it computes the compressed rows whole.
pub(super) fn tensors(t: &mut LayerPlan<'_>) {
    let hp = t.hp;
    let (Some(mla), Some(ix)) = (hp.mla.as_ref(), hp.indexer()) else {
        return;
    };
    // A layer that reuses an earlier choice may still have them (llama.cpp loads and
    // ignores them).
    let presence = if ix.full_layers[t.layer] {
        Presence::Required
    } else {
        Presence::Optional
    };
    let (embd, head, n_head) = (hp.n_embd, ix.head_dim, ix.n_head);
    t.vec(T::IndexerKNorm, &[head], Split::WithHeads).presence(presence);
    t.vec(T::IndexerKNormBias, &[head], Split::WithHeads).presence(presence);
    t.mat(T::IndexerProj, &[embd, n_head], Split::WithHeads)
        .presence(presence);
    t.mat(T::IndexerAttnK, &[embd, head], Split::WithHeads)
        .presence(presence);
    t.mat(T::IndexerAttnQB, &[mla.n_lora_q, n_head * head], Split::WithHeads)
        .presence(presence);
    // GLM-5 next's blocks: the gate scores' projection and each slot's bias.
    if let Some(kpool) = ix.kpool {
        t.mat(T::IndexerCompressorGate, &[embd, head], Split::WithHeads)
            .presence(presence);
        t.vec(T::IndexerCompressorApe, &[head, kpool.size], Split::WithHeads)
            .presence(presence);
    }
}

/// The masks of layer `layer`'s sparse attention, one per span: on a full indexer
/// layer the indexer's choice for each row from the layer input `x` `[n_embd,
/// n_tokens]` and the normalised compressed query `q_compressed` `[n_lora_q,
/// n_tokens]` (the batch's indexer keys stored in the layer's cache); on a layer that
/// shares an earlier layer's indexer, that layer's choice.
pub(super) fn select<'g>(
    b: &mut Builder<'g>,
    w: &LayerTensors<'g>,
    layer: usize,
    x: Tensor<'g>,
    q_compressed: Tensor<'g>,
) -> Vec<SparseMask<'g>> {
    let ctx = b.ctx;
    let hp = b.hp;
    let ix = hp.indexer().expect("sparse attention has an indexer");
    if !ix.full_layers[layer] {
        // A stage never starts at such a layer (refused at load).
        return b
            .selection
            .clone()
            .expect("a shared indexer layer follows a full one on its stage");
    }
    if ix.kpool.is_some() {
        let masks = super::kpool::select(b, w, layer, x, q_compressed);
        b.selection = Some(masks.clone());
        return masks;
    }
    let n_tokens = b.inputs.n_tokens as i64;
    let (head, n_head) = (ix.head_dim as i64, ix.n_head as i64);
    let rope = RopeParams {
        mode: ix.rope_mode,
        ..hp.rope.clone()
    };
    let positions = b.inputs.positions;

    let q = b.mm(w.get(T::IndexerAttnQB), q_compressed); // [head × n_head, n_tokens]
    let q = ctx.reshape_3d(q, head, n_head, n_tokens);
    let q = ctx.rope(q, positions, None, &rope).named(&format!("indexer_q-{layer}"));

    let k = ctx.reshape_3d(keys(b, w, x), head, 1, n_tokens);
    let k = ctx.rope(k, positions, None, &rope).named(&format!("indexer_k-{layer}"));

    // A plain product with the matrix (no fast-transform hint), as llama.cpp's graph
    // multiplies: one slice of `n_head` (or 1) columns per token, the same in any batch.
    let rot =
        b.kv.indexer_rotation()
            .expect("a cache with an indexer holds its rotation");
    let q = ctx.mul_mat(rot, q); // [head, n_head, n_tokens]
    let k = ctx.mul_mat(rot, k); // [head, 1, n_tokens]

    let cache = b.kv.indexer_k(layer).expect("a full indexer layer has its key cache");
    let k_rows = ctx.view_2d(k, head, n_tokens, k.nb()[2], 0);
    b.graph.expand(ctx.set_rows(cache, k_rows, b.inputs.kv_slots));

    let weights = head_weights(b, w, x);

    let cell = cache.nb()[1];
    let mut masks = Vec::with_capacity(b.inputs.spans.len());
    for span in &b.inputs.spans {
        let (rows, cells) = (&span.span.rows, &span.span.cells);
        let (n_rows, n_kv) = (rows.len() as i64, cells.len() as i64);
        let causal = span
            .mask
            .expect("the stage creates the causal mask of attention layers");
        let keys = ctx.view_3d(cache, [head, 1, n_kv], cell, cell, cells.start * cell);
        let q_rows = ctx.view_3d(q, [head, n_head, n_rows], q.nb()[1], q.nb()[2], rows.start * q.nb()[2]);
        let w_rows = ctx.view_2d(weights, n_head, n_rows, weights.nb()[1], rows.start * weights.nb()[1]);
        let scores = ctx.lightning_indexer(q_rows, keys, w_rows, causal); // [n_kv, rows]
        let n_top = ix.top_k.min(n_kv as usize);
        let top = ctx.cont(ctx.top_k(scores, n_top)); // i32 [n_top, rows]
        masks.push(SparseMask {
            mask: unmask(b, causal, top, n_top as i64),
            n_kv_max: n_top,
        });
    }
    b.selection = Some(masks.clone());
    masks
}

/// The indexer key of each token of the layer input `x` `[n_embd, n_tokens]`:
/// `indexer.attn_k`, then a layer norm with weight and bias. `[head_dim, n_tokens]`.
pub(super) fn keys<'g>(b: &Builder<'g>, w: &LayerTensors<'g>, x: Tensor<'g>) -> Tensor<'g> {
    let ctx = b.ctx;
    let ix = b.hp.indexer().expect("sparse attention has an indexer");
    let k = b.mm(w.get(T::IndexerAttnK), x);
    let k = ctx.layer_norm(k, ix.key_norm_eps);
    ctx.add(ctx.mul(k, w.get(T::IndexerKNorm)), w.get(T::IndexerKNormBias))
}

/// Each token's weights of the indexer heads' scores, from the layer input `x`:
/// `indexer.proj`, pre-scaled by `1/sqrt(head_dim × n_head)`. `[n_head, n_tokens]`.
pub(super) fn head_weights<'g>(b: &Builder<'g>, w: &LayerTensors<'g>, x: Tensor<'g>) -> Tensor<'g> {
    let ix = b.hp.indexer().expect("sparse attention has an indexer");
    let weights = b.mm(w.get(T::IndexerProj), x);
    b.ctx.scale(weights, 1.0 / ((ix.head_dim * ix.n_head) as f32).sqrt())
}

/// `causal` (f16 `[n_kv, rows]`) with every cell -inf except the `n_top` cells of each
/// row that `top` (i32 `[n_top, rows]`) names, as llama.cpp's `build_attn` makes it:
/// a mask of -inf, zeros written at those cells, the causal mask added.
fn unmask<'g>(b: &Builder<'g>, causal: Tensor<'g>, top: Tensor<'g>, n_top: i64) -> Tensor<'g> {
    let ctx = b.ctx;
    let [n_kv, n_rows, _, _] = causal.ne();
    let nb = causal.nb();
    let hidden = ctx.fill(causal, f32::NEG_INFINITY);
    // One-value rows, so that each chosen cell is a row `set_rows` writes.
    let cells = ctx.view_4d(hidden, [1, n_kv, n_rows, 1], [nb[0], nb[1], nb[2]], 0);
    let zeros = ctx.fill(ctx.new_tensor(DType::F32, &[1, n_top, n_rows, 1]), 0.0);
    let chosen = ctx.set_rows(cells, zeros, top);
    let chosen = ctx.view_4d(chosen, [n_kv, n_rows, 1, 1], [nb[1], nb[2], nb[2]], 0);
    ctx.add(chosen, causal)
}
