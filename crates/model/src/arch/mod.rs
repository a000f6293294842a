//! The architectures baton runs, one file each, and the table that lists them.
//!
//! An architecture file holds everything baton knows about it: the GGUF keys it reads
//! beyond the common ones, its layer tensors, its layer graph (which reads like the
//! paper: norm → attention → residual → norm → FFN → residual, over the shared pieces
//! in [`builder`], [`attention`] and [`moe`]), and the metadata of a small example model
//! for `baton synth`. Adding an architecture is one new file and one entry in
//! [`ARCHITECTURES`].

pub mod attention;
pub mod builder;
pub mod deltanet;
pub mod ends;
pub mod hyper;
pub mod kda;
pub mod mamba2;
pub mod moe;
pub mod msa;

mod csa;
mod deepseek2;
mod deepseek32;
mod deepseek4;
mod dsa;
mod gemma2;
mod gemma3;
mod gemma4;
mod glm4moe;
mod glm5_next;
mod glm_dsa;
mod gpt_oss;
pub(crate) mod hca;
mod kimi_k3;
mod kimi_linear;
mod kpool;
mod llama;
mod llama4;
mod minimax_m2;
mod minimax_m3;
mod mistral3;
mod mistral4;
mod nemotron_h;
mod nemotron_h_moe;
mod phi3;
mod qwen2;
mod qwen3;
mod qwen35;
mod qwen35moe;
mod qwen3moe;
mod qwen3next;

use baton_ggml::Tensor;
use baton_gguf::Value;

pub use builder::{Builder, CompressedInputs, Gather, MsaInputs, SpanInputs, StateRunInputs, StepInputs, TpOps};

use crate::hparams::{HParams, Keys};
use crate::tensors::{LayerPlan, Presence};
use crate::weights::LayerTensors;
use crate::ModelError;

/// Every architecture baton runs.
#[rustfmt::skip]
pub static ARCHITECTURES: &[&Architecture] = &[
    &llama::ARCH,
    &qwen2::ARCH,
    &qwen3::ARCH,
    &qwen3moe::ARCH,
    &gemma3::ARCH,
    &glm4moe::ARCH,
    &gpt_oss::ARCH,
    &deepseek2::ARCH,
    &mistral3::ARCH,
    &phi3::ARCH,
    &gemma2::ARCH,
    &minimax_m2::ARCH,
    &mistral4::ARCH,
    &llama4::ARCH,
    &qwen35::ARCH,
    &qwen35moe::ARCH,
    &qwen3next::ARCH,
    &nemotron_h::ARCH,
    &nemotron_h_moe::ARCH,
    &gemma4::ARCH,
    &deepseek32::ARCH,
    &glm_dsa::ARCH,
    &kimi_linear::ARCH,
    &kimi_k3::ARCH,
    &deepseek4::ARCH,
    &glm5_next::ARCH,
    &minimax_m3::ARCH,
];

/// How RoPE rotates a head.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rope {
    /// Consecutive pairs (llama's "normal" RoPE).
    Norm,
    /// The two halves of the head (GPT-NeoX style).
    Neox,
    /// Qwen's interleaved multi-section RoPE (`rope_multi`, NeoX pairs; a text token's
    /// sections all rotate by its position).
    Imrope,
}

impl Rope {
    /// ggml's mode number.
    pub fn mode(self) -> i32 {
        match self {
            Rope::Norm => 0,
            Rope::Neox => 2,
            Rope::Imrope => 40,
        }
    }
}

/// How the per-layer sizes `attention.head_count_kv` and `feed_forward_length` may
/// vary between an architecture's layers (llama.cpp reads each as one value or an array).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayerSizes {
    /// The same in every layer.
    Uniform,
    /// The same in the layers that have the block; 0 for a layer that lacks attention or
    /// a dense FFN (Nemotron-H).
    Blocks,
    /// Key/value heads per layer, which the architecture's `hparams` makes sense of
    /// (Gemma 4: one count for its sliding-window layers, another for its global ones);
    /// the FFN the same in every layer.
    KvHeadsPerLayer,
}

/// One layer's graph: hidden `[hidden_width, n_tokens]` in, hidden out (fewer rows after
/// the model's last layer when it keeps only the rows that need logits). The width is
/// `n_embd`, or with hyper-connections the streams flattened (see
/// [`HParams::hidden_width`]).
pub type LayerFn = for<'g> fn(&mut Builder<'g>, &LayerTensors<'g>, usize, Tensor<'g>) -> Tensor<'g>;

/// The first stage's input end: token ids i32 `[n_tokens]` in, hidden
/// `[hidden_width, n_tokens]` out (see [`ends::embed`]).
pub type EmbedFn = for<'g> fn(&Builder<'g>, Tensor<'g>) -> Tensor<'g>;

/// The last stage's output end: hidden `[hidden_width, n_out]` of the rows that need
/// logits in, logits `[n_vocab, n_out]` out (see [`ends::logits`]).
pub type LogitsFn = for<'g> fn(&Builder<'g>, Tensor<'g>) -> Tensor<'g>;

/// Everything baton knows about one architecture.
pub struct Architecture {
    /// `general.architecture` as llama.cpp writes it.
    pub name: &'static str,
    /// Other names that mean the same architecture.
    pub aliases: &'static [&'static str],
    /// How RoPE rotates.
    pub rope: Rope,
    /// Whether layers scale RoPE frequencies with a global `rope_freqs.weight`, and
    /// whether the file must have it (`None`: the architecture takes none).
    pub rope_freqs: Option<Presence>,
    /// Whether the model always has its own `output.weight` (never tied to the token
    /// embedding).
    pub own_output: bool,
    /// How `attention.head_count_kv` and `feed_forward_length` may vary between layers.
    pub layer_sizes: LayerSizes,
    /// Reads the architecture's own keys after the common ones.
    pub hparams: fn(&mut HParams, &Keys<'_>) -> Result<(), ModelError>,
    /// Lists one layer's tensors.
    pub tensors: fn(&mut LayerPlan<'_>),
    /// Builds one layer's graph.
    pub layer: LayerFn,
    /// Embeds tokens (first stage).
    pub embed: EmbedFn,
    /// Turns the last layer's hidden states into logits (last stage).
    pub logits: LogitsFn,
    /// The architecture's own keys (without the `{arch}.` prefix) of a small example
    /// model of `shape`, beyond those every model has (see [`Shape`]).
    pub example: fn(&Shape) -> Vec<(&'static str, Value)>,
}

impl std::fmt::Debug for Architecture {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name)
    }
}

impl PartialEq for Architecture {
    fn eq(&self, other: &Self) -> bool {
        self.name == other.name
    }
}

/// The tensors of the multi-token-prediction layers after the trunk, for the
/// architectures whose files libllama loads only with them (deepseek4); baton never
/// reads them. Empty for the others.
pub fn prediction_layer_tensors(hp: &HParams) -> Vec<crate::tensors::TensorSpec> {
    match hp.dsv4 {
        Some(_) => deepseek4::prediction_layer_tensors(hp),
        None => Vec::new(),
    }
}

/// The architecture named `name` (by `general.architecture`).
pub fn find(name: &str) -> Result<&'static Architecture, ModelError> {
    ARCHITECTURES
        .iter()
        .copied()
        .find(|a| a.name == name || a.aliases.contains(&name))
        .ok_or_else(|| ModelError::UnsupportedArch {
            name: name.to_string(),
            supported: supported_names(),
        })
}

/// The names baton accepts, comma-separated, for error messages and `--help`.
pub fn supported_names() -> String {
    ARCHITECTURES
        .iter()
        .flat_map(|a| std::iter::once(a.name).chain(a.aliases.iter().copied()))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The shape of an example model (`baton synth`): the keys every model has are written
/// from it; each architecture adds its own from the fields it uses.
#[derive(Clone, Debug, PartialEq)]
pub struct Shape {
    /// Transformer layers.
    pub n_layer: usize,
    /// Hidden size.
    pub n_embd: usize,
    /// Query heads.
    pub n_head: usize,
    /// Key/value heads.
    pub n_head_kv: usize,
    /// Dimension of each head.
    pub head_dim: usize,
    /// Inner size of dense feed-forward blocks.
    pub n_ff: usize,
    /// Routed experts per MoE layer (0: a dense model where the architecture has both).
    pub n_expert: usize,
    /// Experts each token uses.
    pub n_expert_used: usize,
    /// Inner size of each expert.
    pub n_ff_exp: usize,
    /// Shared experts per MoE layer (architectures that have them).
    pub n_expert_shared: usize,
    /// Dense layers before the first MoE layer (architectures that have them).
    pub n_dense_lead: usize,
    /// Sliding-window size (architectures with sliding-window layers).
    pub n_swa: usize,
    /// Context length the model claims to be trained with.
    pub n_ctx: usize,
}
