//! Gemma 3 layers: q/k norms, queries pre-scaled, sliding-window attention on most
//! layers (chosen in the shared attention from the hyper-parameters), a norm after
//! attention and after the FFN, and GeGLU.

use baton_ggml::Tensor;

use super::{AttnOptions, Builder};
use crate::weights::LayerTensors;

/// One gemma3 layer. `hidden`: `[n_embd, n_tokens]`.
pub fn layer<'g>(b: &mut Builder<'g>, w: &LayerTensors<'g>, layer: usize, hidden: Tensor<'g>) -> Tensor<'g> {
    let cur = b.norm(hidden, w.attn_norm);
    let cur = b.attention(w, layer, cur, AttnOptions { qk_norm: true });
    let (cur, residual) = b.select_outputs(layer, cur, hidden);
    let cur = b.norm_opt(cur, w.attn_post_norm);
    let attn_out = b.ctx.add(cur, residual);

    let cur = b.norm(attn_out, w.ffn_norm);
    let cur = b.ffn_geglu(w, cur);
    let cur = b.norm_opt(cur, w.ffn_post_norm);
    b.ctx.add(cur, attn_out)
}
