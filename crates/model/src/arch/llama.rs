//! Llama-family layers: pre-norm attention and a SwiGLU FFN, each with a residual.
//!
//! Qwen 2 and Qwen 3 share this layer; what differs lives elsewhere: qwen2's q/k/v
//! biases are in its weights, its NeoX RoPE in the hyper-parameters, and qwen3's
//! per-head q/k norms are the `qk_norm` option.

use baton_ggml::Tensor;

use super::{AttnOptions, Builder};
use crate::weights::LayerTensors;

/// One layer. `hidden`: `[n_embd, n_tokens]`.
pub fn layer<'g>(
    b: &mut Builder<'g>,
    w: &LayerTensors<'g>,
    layer: usize,
    hidden: Tensor<'g>,
    attn: AttnOptions,
) -> Tensor<'g> {
    let cur = b.norm(hidden, w.attn_norm);
    let cur = b.attention(w, layer, cur, attn);
    let (cur, residual) = b.select_outputs(layer, cur, hidden);
    let ffn_in = b.ctx.add(cur, residual); // [n_embd, n_tokens]

    let cur = b.norm(ffn_in, w.ffn_norm);
    let cur = b.ffn_swiglu(w, cur);
    b.ctx.add(cur, ffn_in)
}
