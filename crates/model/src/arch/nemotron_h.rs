//! NVIDIA Nemotron-H (`nemotron_h`: 4B to 56B): a hybrid whose layers each hold one
//! block, by a per-layer pattern: Mamba2 (see [`super::mamba2`]), attention without
//! positional encoding, or an MLP of squared ReLU; each is pre-normed and added to the
//! residual. The file says which with per-layer arrays: a layer with neither KV heads
//! nor an FFN (`attention.head_count_kv`, `feed_forward_length` 0) is Mamba2, one with
//! KV heads and no FFN attends, the others are MLPs (`nemotron_h_moe`: experts).
//! Multi-token-prediction blocks stored after the layers are not computed.

use baton_ggml::Tensor;
use baton_gguf::Value;

use super::attention::KeyValues;
use super::{mamba2, Architecture, Builder, LayerSizes, Rope, Shape};
use crate::hparams::{HParams, Keys, Ssm, SsmKind};
use crate::names::LayerTensor as T;
use crate::tensors::{self, Dim, LayerPlan, Presence, Split};
use crate::weights::LayerTensors;
use crate::ModelError;

pub static ARCH: Architecture = Architecture {
    name: "nemotron_h",
    aliases: &[],
    rope: Rope::Norm,
    rope_freqs: None,
    own_output: false,
    layer_sizes: LayerSizes::Blocks,
    hparams: read_hparams,
    tensors,
    layer,
    embed: super::ends::embed,
    logits: super::ends::logits,
    example,
};

/// The block a Nemotron-H layer holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Block {
    Mamba2,
    Attention,
    /// The MLP, or in `nemotron_h_moe` the experts.
    Ffn,
}

/// The block of layer `layer`, as llama.cpp decides it from the per-layer arrays
/// (recurrent: no KV heads and no FFN).
pub fn block(hp: &HParams, layer: usize) -> Block {
    if hp.is_recurrent(layer) {
        Block::Mamba2
    } else if hp.layer_ff[layer] == 0 {
        Block::Attention
    } else {
        Block::Ffn
    }
}

/// Reads the Mamba2 sizes and which layers are Mamba2.
pub fn read_hparams(hp: &mut HParams, keys: &Keys<'_>) -> Result<(), ModelError> {
    hp.ssm = Some(Ssm::read(keys, SsmKind::Mamba2)?);
    if hp.rms_eps.is_nan() {
        // Files may carry only the plain norm's epsilon, which llama.cpp then takes for
        // its RMS norms too.
        hp.rms_eps = keys.f32("attention.layer_norm_epsilon")?;
    }
    hp.recurrent_layers = (0..hp.n_layer)
        .map(|l| hp.layer_kv_heads[l] == 0 && hp.layer_ff[l] == 0)
        .collect();
    super::llama::require_equal_heads(hp)
}

/// The tensors of a Nemotron-H layer whose FFN block is `ffn`: the input norm, then the
/// layer's block.
pub fn layer_tensors(t: &mut LayerPlan<'_>, ffn: impl FnOnce(&mut LayerPlan<'_>)) {
    t.norm(T::AttnNorm, t.hp.n_embd);
    match block(t.hp, t.layer) {
        Block::Mamba2 => mamba2::tensors(t),
        Block::Attention => {
            tensors::attention(t, Presence::Optional);
            t.vec(T::AttnOutputBias, &[t.hp.n_embd], Split::Rows(Dim::Embd))
                .optional();
        }
        Block::Ffn => ffn(t),
    }
}

fn tensors(t: &mut LayerPlan<'_>) {
    layer_tensors(t, |t| {
        let n_ff = t.hp.layer_ff[t.layer];
        up_down_tensors(t, &MLP, n_ff, Dim::Ff);
    });
}

/// A Nemotron-H layer whose FFN block is `ffn`: norm → the layer's block → residual.
pub fn layer_with<'g>(
    b: &mut Builder<'g>,
    w: &LayerTensors<'g>,
    layer: usize,
    hidden: Tensor<'g>,
    ffn: impl FnOnce(&mut Builder<'g>, Tensor<'g>) -> Tensor<'g>,
) -> Tensor<'g> {
    let cur = b.norm(hidden, w.get(T::AttnNorm)).named(&format!("attn_norm-{layer}"));
    let cur = match block(b.hp, layer) {
        Block::Mamba2 => b.mamba2(w, layer, cur),
        Block::Attention => attention(b, w, layer, cur),
        Block::Ffn => ffn(b, cur),
    };
    let (cur, hidden) = b.select_outputs(layer, cur, hidden);
    b.ctx.add(cur, hidden).named(&format!("nemotron_h_block_out-{layer}"))
}

fn layer<'g>(b: &mut Builder<'g>, w: &LayerTensors<'g>, layer: usize, hidden: Tensor<'g>) -> Tensor<'g> {
    layer_with(b, w, layer, hidden, |b, x| relu_sqr_ffn(b, w, &MLP, x))
}

/// Attention without positional encoding: the projections (biases when the layer has
/// them), the cache, and the output projection.
fn attention<'g>(b: &mut Builder<'g>, w: &LayerTensors<'g>, layer: usize, x: Tensor<'g>) -> Tensor<'g> {
    let hp = b.hp;
    let (q, k, v) = b.qkv(w, x);
    let kv = KeyValues {
        k: k.named(&format!("Kcur-{layer}")),
        v: Some(v),
        d_v: hp.head_dim_v,
    };
    let out = b.attend(layer, q.named(&format!("Qcur-{layer}")), kv, None, hp.attn_scale);
    let out = b
        .ctx
        .reshape_2d(out, (hp.head_dim_v * hp.n_head) as i64, b.inputs.n_tokens as i64);
    b.attn_output(w, out)
}

/// The tensors of an MLP without a gate: up and down, and their biases when it has
/// them.
pub struct UpDown {
    pub up: T,
    pub down: T,
    pub biases: Option<[T; 2]>,
}

/// The MLP layers' block (biases optional).
const MLP: UpDown = UpDown {
    up: T::FfnUp,
    down: T::FfnDown,
    biases: Some([T::FfnUpBias, T::FfnDownBias]),
};

/// `down(relu(up x + b)²) + b` over `ffn` (llama.cpp's `LLM_FFN_RELU_SQR` without a
/// gate).
pub fn relu_sqr_ffn<'g>(b: &Builder<'g>, w: &LayerTensors<'g>, ffn: &UpDown, x: Tensor<'g>) -> Tensor<'g> {
    let [up_b, down_b] = ffn.biases.map_or([None; 2], |[up, down]| [w.opt(up), w.opt(down)]);
    let hidden = b.linear(w.get(ffn.up), up_b, x);
    let hidden = b.ctx.sqr(b.ctx.relu(hidden));
    b.linear(w.get(ffn.down), down_b, hidden)
}

/// Lists `ffn` of inner size `n_ff` (biases optional).
pub fn up_down_tensors(t: &mut LayerPlan<'_>, ffn: &UpDown, n_ff: usize, inner: Dim) {
    let embd = t.hp.n_embd;
    t.mat(ffn.up, &[embd, n_ff], Split::Rows(inner));
    t.mat(ffn.down, &[n_ff, embd], Split::Rows(Dim::Embd));
    if let Some([up_b, down_b]) = ffn.biases {
        t.vec(up_b, &[n_ff], Split::Rows(inner)).optional();
        t.vec(down_b, &[embd], Split::Rows(Dim::Embd)).optional();
    }
}

/// Which block each layer of an example model holds: Mamba2, MLP, attention, again
/// and again (4 layers: one attention layer; 7: two of each and a third Mamba2).
pub fn example_blocks(n_layer: usize) -> Vec<Block> {
    (0..n_layer)
        .map(|l| [Block::Mamba2, Block::Ffn, Block::Attention][l % 3])
        .collect()
}

/// The keys of an example Nemotron-H model of `shape`: the blocks of [`example_blocks`], Mamba2 heads of the attention head size
/// (twice as many as query heads) in as many groups as key/value heads, a state of the
/// head size and a kernel of 4.
pub fn example(shape: &Shape) -> Vec<(&'static str, Value)> {
    let blocks = example_blocks(shape.n_layer);
    let per_layer = |of: Block, n: usize| {
        let values = blocks.iter().map(|&b| Value::U32(if b == of { n as u32 } else { 0 }));
        Value::Array(values.collect())
    };
    let n_heads = 2 * shape.n_head;
    vec![
        ("attention.head_count_kv", per_layer(Block::Attention, shape.n_head_kv)),
        ("feed_forward_length", per_layer(Block::Ffn, shape.n_ff)),
        // llama.cpp requires it (the multi-token-prediction head's norm).
        ("attention.layer_norm_epsilon", Value::F32(1e-5)),
        ("ssm.conv_kernel", Value::U32(4)),
        ("ssm.state_size", Value::U32(shape.head_dim as u32)),
        ("ssm.time_step_rank", Value::U32(n_heads as u32)),
        ("ssm.group_count", Value::U32(shape.n_head_kv as u32)),
        ("ssm.inner_size", Value::U32((n_heads * shape.head_dim) as u32)),
    ]
}
