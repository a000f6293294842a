//! Hyper-parameters of a model, all read from GGUF metadata: the keys every
//! architecture shares here (as llama.cpp's `llama_model_base::load_hparams` reads
//! them), the rest by each architecture's own `hparams` function.

use std::ops::Range;

use baton_ggml::RopeParams;
use baton_gguf::Gguf;

use crate::arch::hyper::Hyper;
use crate::arch::moe::MoeParams;
use crate::arch::{self, Architecture, LayerSizes};
use crate::cache_type::KvTypes;
use crate::names::EndTensor;
use crate::ModelError;

/// The key of every RMS norm's epsilon (without the `{arch}.` prefix).
const RMS_EPS: &str = "attention.layer_norm_rms_epsilon";

/// Most layers llama.cpp accepts (`LLAMA_MAX_LAYERS`).
const MAX_LAYERS: usize = 512;

/// Everything the graph builders need to know about a model.
#[derive(Clone, Debug, PartialEq)]
pub struct HParams {
    /// Architecture.
    pub arch: &'static Architecture,
    /// Number of transformer layers the model computes (multi-token-prediction blocks
    /// stored after them are not counted).
    pub n_layer: usize,
    /// Multi-token-prediction layers stored after the trunk (`nextn_predict_layers`),
    /// which generation skips.
    pub n_layer_nextn: usize,
    /// Hidden size.
    pub n_embd: usize,
    /// Query heads.
    pub n_head: usize,
    /// Key/value heads (grouped-query attention when fewer than `n_head`).
    pub n_head_kv: usize,
    /// Dimension of each key (and query) head.
    pub head_dim_k: usize,
    /// Dimension of each value head.
    pub head_dim_v: usize,
    /// Feed-forward inner size of dense layers (0 when the model has none).
    pub n_ff: usize,
    /// Vocabulary size (rows of the token embedding).
    pub n_vocab: usize,
    /// Context length the model was trained with.
    pub n_ctx_train: usize,
    /// Epsilon of every RMS norm.
    pub rms_eps: f32,
    /// RoPE for full-attention layers.
    pub rope: RopeParams,
    /// RoPE for sliding-window layers (some models use another base there).
    pub rope_swa: RopeParams,
    /// Scale applied to attention scores (`q·k * scale`).
    pub attn_scale: f32,
    /// Scale applied to queries before attention (gemma), 1.0 otherwise.
    pub query_scale: f32,
    /// Sliding-window size (0: no sliding window).
    pub n_swa: usize,
    /// How sliding-window layers limit what a token sees (see [`HParams::window`]).
    pub swa_type: SwaType,
    /// Per layer: whether it uses the sliding window.
    pub swa_layers: Vec<bool>,
    /// `tanh` soft-capping of the final logits (0: none), for architectures whose
    /// output end applies it (gemma).
    pub final_logit_softcap: f32,
    /// `tanh` soft-capping of attention scores (0: none).
    pub attn_logit_softcap: f32,
    /// Mixture-of-experts routing (`n_expert == 0`: every layer is dense).
    pub moe: MoeParams,
    /// YaRN settings that decide RoPE's attention factor.
    pub yarn: Yarn,
    /// Multi-head latent attention (DeepSeek): keys and values compressed to one
    /// latent row per token, which is all the KV cache holds.
    pub mla: Option<Mla>,
    /// Attention temperature tuning (Llama 4 style, Ministral 3): queries scaled by a
    /// factor growing with the position.
    pub attn_temp: Option<AttnTemp>,
    /// Which of the whole model's heads a tensor-parallel member holds (`None` outside
    /// a group, where `n_head` and `n_head_kv` are all of them).
    pub tp_heads: Option<TpHeads>,
    /// The sizes of recurrent layers (gated DeltaNet or Mamba2), for models that have them.
    pub ssm: Option<Ssm>,
    /// Per layer: whether it is recurrent (keeps a fixed-size state per sequence
    /// instead of keys and values).
    pub recurrent_layers: Vec<bool>,
    /// Per layer: its key/value heads (`n_head_kv`, or 0 where the file says the
    /// layer does not attend: Nemotron-H's recurrent and FFN-only layers).
    pub layer_kv_heads: Vec<usize>,
    /// Per layer: the inner size of its dense FFN (`n_ff`, or 0 where the file says
    /// it has none: Nemotron-H's recurrent and attention layers).
    pub layer_ff: Vec<usize>,
    /// Multi-section RoPE (Qwen's M-RoPE): dimensions rotated by each of a token's four
    /// position coordinates; text tokens use `[p, p, p, 0]`.
    pub rope_sections: Option<[i32; 4]>,
    /// The heads of sliding-window layers where they differ from the other layers'
    /// (Gemma 4); `None`: every attention layer has `n_head_kv` heads of `head_dim_k`
    /// and `head_dim_v` (see [`HParams::layer_heads`]).
    pub swa_heads: Option<LayerHeads>,
    /// What Kimi K3 adds to Kimi Linear (`None` for every other architecture).
    pub kimi_k3: Option<KimiK3>,
    /// The KDA decay's lower bound (`kda.gate_lower_bound`, Kimi K3 and GLM-5 next):
    /// when set, the decay is `bound · sigmoid(exp(A_log) · (f_b(f_a(x)) + dt))`
    /// instead of Kimi Linear's softplus form.
    pub kda_gate_lower_bound: Option<f32>,
    /// No layer applies RoPE and the file says so with `rope.dimension_count` 0
    /// (GLM-5 next, whose MLA keys have no RoPE part).
    pub unrotated: bool,
    /// Hyper-connections (DeepSeek V4, GLM-5 Next): the residual stream is several
    /// copies of the hidden state (see [`crate::arch::hyper`]); `None`: one.
    pub hyper: Option<Hyper>,
    /// DeepSeek V4's sizes (`None` for every other architecture).
    pub dsv4: Option<Dsv4>,
    /// MiniMax sparse attention (`minimax-m3`; `None` for every other architecture).
    pub msa: Option<Msa>,
}

/// DeepSeek V4's sizes beyond the common ones, as llama.cpp's `deepseek4` reads them.
#[derive(Clone, Debug, PartialEq)]
pub struct Dsv4 {
    /// Rank of the query compression (`attention.q_lora_rank`).
    pub n_lora_q: usize,
    /// Groups of heads the output projection compresses separately
    /// (`attention.output_group_count`).
    pub o_groups: usize,
    /// Rank of each group's compression (`attention.output_lora_rank`).
    pub o_lora_rank: usize,
    /// Leading layers whose experts are chosen by token id (`hash_layer_count`).
    pub hash_layers: usize,
    /// The lightning indexer's heads and their width (`attention.indexer.*`; only
    /// compressed sparse attention uses them).
    pub indexer_heads: (usize, usize),
    /// The compressed blocks the lightning indexer chooses for each query
    /// (`attention.indexer.top_k`).
    pub top_k: usize,
    /// Each trunk layer's key compression (`attention.compress_ratios`): 0 for the raw
    /// window alone, [`CSA_RATIO`] for compressed sparse attention, [`HCA_RATIO`] for
    /// heavily compressed attention.
    pub compress_ratios: Vec<usize>,
    /// RoPE of the compressed layers: the model's YaRN settings over
    /// `attention.compress_rope_freq_base` (the raw window's layers have none).
    pub compress_rope: RopeParams,
}

/// DeepSeek V4's heavily compressed attention: each block of this many positions
/// becomes one compressed key.
pub const HCA_RATIO: usize = 128;

/// DeepSeek V4's compressed sparse attention: each block of this many positions (and
/// the block before it) becomes one compressed key, and a lightning indexer chooses
/// among them.
pub const CSA_RATIO: usize = 4;

impl Dsv4 {
    /// Whether layer `layer` attends over compressed blocks beside its window.
    pub fn is_hca(&self, layer: usize) -> bool {
        self.compress_ratios.get(layer) == Some(&HCA_RATIO)
    }

    /// Whether layer `layer` attends over indexer-chosen compressed blocks beside its
    /// window.
    pub fn is_csa(&self, layer: usize) -> bool {
        self.compress_ratios.get(layer) == Some(&CSA_RATIO)
    }

    /// The compression ratios of `layers` that compress, in increasing order.
    pub fn ratios_in(&self, layers: Range<usize>) -> Vec<usize> {
        let mut ratios: Vec<usize> = layers
            .filter_map(|l| self.compress_ratios.get(l).copied())
            .filter(|&r| r != 0)
            .collect();
        ratios.sort_unstable();
        ratios.dedup();
        ratios
    }
}

/// MiniMax sparse attention (MSA), as llama.cpp's `minimax-m3` reads it: on every layer
/// after the dense lead, an indexer (one head per key/value head, one key per token,
/// kept in the KV cache beside the token's keys and values) scores the sequence's
/// positions in blocks of `block_size`; each query attends to the positions of its
/// head group's `top_k` best blocks, the `local_blocks` blocks ending at its own always
/// among them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Msa {
    /// Indexer query heads (one per key/value head).
    pub n_head: usize,
    /// Width of each indexer head (its first `n_rot` values rotate).
    pub head_dim: usize,
    /// Blocks each query attends to.
    pub top_k: usize,
    /// Positions per block.
    pub block_size: usize,
    /// Blocks ending at the query's own that are always chosen.
    pub local_blocks: usize,
}

/// Kimi K3's sizes beyond Kimi Linear's, as llama.cpp's `kimi-k3` reads them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct KimiK3 {
    /// Cross-layer residual attention (`attn_res.block_size`; 0: none): every layer
    /// `l` with `l % block == 0` banks its raw input, and each layer's attention and
    /// FFN (and the output) read a softmax-weighted mix of the banked inputs and the
    /// running residual.
    pub res_block: usize,
    /// situ's gate scale (`activation.situ_beta`).
    pub situ_beta: f32,
    /// situ's up scale (`activation.situ_linear_beta`; 0 or less: the up branch as it is).
    pub situ_linear_beta: f32,
    /// Width the routed experts run at (`expert_latent_length`; 0: `n_embd`, no
    /// projections around them).
    pub n_expert_latent: usize,
}

/// The key/value heads of one layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayerHeads {
    /// Key/value heads.
    pub n_head_kv: usize,
    /// Dimension of each key (and query) head.
    pub head_dim_k: usize,
    /// Dimension of each value head.
    pub head_dim_v: usize,
}

/// Which recurrent layer a model's `ssm_*` keys size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SsmKind {
    /// Qwen's gated DeltaNet: the delta rule with one `d_state × d_state` state per
    /// value head (`d_inner` is the value heads' width together).
    GatedDeltaNet,
    /// Mamba2 (Nemotron-H): a selective scan with one `d_state × head_dim` state per
    /// head, `head_dim = d_inner / n_heads`; `B` and `C` in `n_groups` groups.
    Mamba2,
    /// Kimi Delta Attention (Kimi Linear): the delta rule with a decay per key dimension
    /// rather than per head; as many query and key heads as value heads
    /// (`n_groups == n_heads`), each `d_state` wide.
    Kda,
}

/// The sizes of a recurrent layer (llama.cpp's `ssm_*` keys): a causal convolution over
/// the projected inputs (`d_inner` channels and two groups of `n_groups × d_state`:
/// keys and queries, or Mamba2's `B` and `C`), then a recurrence whose state is
/// `d_state × d_inner` per sequence.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ssm {
    /// Which recurrence.
    pub kind: SsmKind,
    /// Width of the convolution kernel (`ssm.conv_kernel`).
    pub d_conv: usize,
    /// Width of all heads together (`ssm.inner_size`).
    pub d_inner: usize,
    /// State size per channel (`ssm.state_size`): DeltaNet's key and value head width.
    pub d_state: usize,
    /// Heads (`ssm.time_step_rank`): DeltaNet's value heads, Mamba2's heads.
    pub n_heads: usize,
    /// Groups (`ssm.group_count`): DeltaNet's key heads (each serves
    /// `n_heads / n_groups` value heads), Mamba2's groups of `B` and `C`.
    pub n_groups: usize,
}

impl Ssm {
    /// Channels the convolution runs over: `d_inner` and two groups of
    /// `n_groups × d_state` (DeltaNet's queries and keys, Mamba2's `B` and `C`).
    pub fn conv_channels(&self) -> usize {
        self.d_inner + 2 * self.n_groups * self.d_state
    }

    /// Floats of one sequence's convolution state (the last `d_conv - 1` inputs of
    /// every channel).
    pub fn conv_state_len(&self) -> usize {
        (self.d_conv - 1) * self.conv_channels()
    }

    /// Floats of one sequence's recurrent state: `d_state × d_inner` (DeltaNet: a
    /// `d_state × d_state` matrix per value head; Mamba2: `d_state × head_dim` per head).
    pub fn state_len(&self) -> usize {
        self.d_state * self.d_inner
    }

    /// Width of each Mamba2 head.
    pub fn head_dim(&self) -> usize {
        self.d_inner / self.n_heads
    }

    /// Reads the `ssm.*` keys of a `kind` layer, refusing sizes ggml would abort on.
    pub fn read(keys: &Keys<'_>, kind: SsmKind) -> Result<Ssm, ModelError> {
        let ssm = Ssm {
            kind,
            d_conv: keys.u32("ssm.conv_kernel")?,
            d_inner: keys.u32("ssm.inner_size")?,
            d_state: keys.u32("ssm.state_size")?,
            n_heads: keys.u32("ssm.time_step_rank")?,
            n_groups: keys.u32("ssm.group_count")?,
        };
        const MAX: usize = 1 << 16;
        let sizes = [ssm.d_conv, ssm.d_inner, ssm.d_state, ssm.n_heads, ssm.n_groups];
        let fits =
            sizes.iter().all(|&n| n > 0 && n <= MAX) && ssm.d_conv >= 2 && ssm.n_heads.is_multiple_of(ssm.n_groups);
        let (fits, needs) = match kind {
            SsmKind::GatedDeltaNet => (
                fits && ssm.d_inner == ssm.d_state * ssm.n_heads,
                "inner_size time_step_rank x state_size",
            ),
            SsmKind::Mamba2 => (
                fits && ssm.d_inner.is_multiple_of(ssm.n_heads),
                "inner_size a multiple of time_step_rank",
            ),
            SsmKind::Kda => (
                fits && ssm.d_inner == ssm.d_state * ssm.n_heads && ssm.n_groups == ssm.n_heads,
                "inner_size time_step_rank x state_size and group_count time_step_rank",
            ),
        };
        if !fits {
            return Err(ModelError::BadHParams(format!(
                "recurrent layer sizes {ssm:?}: each must be between 1 and {MAX}, the kernel at least 2, \
                 time_step_rank a multiple of group_count and {needs}"
            )));
        }
        Ok(ssm)
    }

    /// The sizes of a Kimi Delta Attention layer, as llama.cpp's `kimi-linear` reads
    /// them: `n_head` heads of `kda.head_dim` for queries, keys and values alike, and a
    /// convolution of `ssm.conv_kernel` over all three.
    pub fn kda(keys: &Keys<'_>, n_head: usize) -> Result<Ssm, ModelError> {
        let head_dim = keys.u32("kda.head_dim")?;
        let d_conv = keys.u32("ssm.conv_kernel")?;
        const MAX: usize = 1 << 16;
        if !(1..=MAX).contains(&head_dim) || !(2..=MAX).contains(&d_conv) || head_dim * n_head > MAX {
            return Err(ModelError::BadHParams(format!(
                "{} {head_dim} and {} {d_conv}: the head must be between 1 and {MAX} wide ({MAX} for \
                 all {n_head} heads together), the kernel between 2 and {MAX}",
                keys.name("kda.head_dim"),
                keys.name("ssm.conv_kernel")
            )));
        }
        Ok(Ssm {
            kind: SsmKind::Kda,
            d_conv,
            d_inner: head_dim * n_head,
            d_state: head_dim,
            n_heads: n_head,
            n_groups: n_head,
        })
    }
}

/// How a sliding-window layer limits the positions a token sees (llama.cpp's
/// `llama_swa_type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SwaType {
    /// The last `n_swa` positions, its own included (gemma, gpt-oss).
    Sliding,
    /// The positions of its own chunk of `n_swa` (Llama 4's chunked attention).
    Chunked,
}

/// What a token of a sliding-window layer sees of its sequence's earlier positions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Window {
    /// Positions less than `n` back: `pos - n < past <= pos`.
    Sliding(usize),
    /// Positions of its own chunk of `n`: `n·⌊pos/n⌋ <= past <= pos`.
    Chunked(usize),
}

impl Window {
    /// Whether a token at `pos` must not see position `past` (not after `pos`), as
    /// llama.cpp's `llama_hparams::is_masked_swa` decides.
    pub fn hides(self, pos: i32, past: i32) -> bool {
        match self {
            Window::Sliding(n) => (pos - past) as i64 >= n as i64,
            Window::Chunked(n) => {
                let n = n as i64;
                (past as i64) < (pos as i64 / n) * n
            }
        }
    }

    /// The first position a token at `pos` sees (its own when it sees no earlier one).
    pub fn first_visible(self, pos: i32) -> i32 {
        match self {
            Window::Sliding(n) => (pos as i64 - n as i64 + 1).max(0) as i32,
            Window::Chunked(n) => ((pos as i64 / n as i64) * n as i64) as i32,
        }
    }
}

/// A tensor-parallel member's heads among the whole model's: a layer that normalises
/// all heads' projections at once (minimax-m2's q/k norms) computes every head's and
/// keeps these.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TpHeads {
    /// Its query heads.
    pub q: Range<usize>,
    /// Its key/value heads.
    pub kv: Range<usize>,
}

/// Queries at position `p` are multiplied by
/// `ln(floor((p + offset) / floor_scale) + 1) · scale + 1` (llama.cpp's
/// `llm_graph_input_attn_temp`).
#[derive(Clone, Debug, PartialEq)]
pub struct AttnTemp {
    /// How much the factor grows per doubling of positions.
    pub scale: f32,
    /// Positions per step of the factor.
    pub floor_scale: usize,
    /// Added to each position first.
    pub offset: f32,
}

impl AttnTemp {
    /// The factor of each position, computed as llama.cpp computes it (the step in
    /// f32, the logarithm in f64).
    pub fn factors(&self, positions: &[i32]) -> Vec<f32> {
        positions
            .iter()
            .map(|&p| {
                let steps = ((p as f32 + self.offset) / self.floor_scale as f32).floor() as f64;
                ((steps + 1.0).ln() * self.scale as f64 + 1.0) as f32
            })
            .collect()
    }
}

/// The sizes of multi-head latent attention. The cache row of a token is its
/// compressed latent (`n_lora_kv`) followed by its RoPE part (`rope.n_dims`); queries
/// are projected into the same space, so attention runs as one shared key head
/// (`head_dim_k = n_lora_kv + n_rot`) whose values are the latent (`head_dim_v`).
#[derive(Clone, Debug, PartialEq)]
pub struct Mla {
    /// Rank of the query compression (0: queries are projected directly).
    pub n_lora_q: usize,
    /// Rank of the key/value compression (the latent's width).
    pub n_lora_kv: usize,
    /// Width of each query/key head before absorption (its non-RoPE part plus RoPE).
    pub head_dim_k: usize,
    /// Width of each value head after decompression.
    pub head_dim_v: usize,
    /// DeepSeek sparse attention (deepseek32, glm-dsa): the lightning indexer that
    /// chooses the cached tokens each query attends to; `None`: dense MLA.
    pub indexer: Option<Indexer>,
}

/// DeepSeek sparse attention's lightning indexer: per token, its own queries
/// (`n_head` heads of `head_dim`) score every cached indexer key (one head of
/// `head_dim` per token, kept in the KV cache beside the latent rows); each query then
/// attends to the `top_k` best-scored tokens only.
#[derive(Clone, Debug, PartialEq)]
pub struct Indexer {
    /// Query heads of the indexer.
    pub n_head: usize,
    /// Width of each indexer head (its first `n_rot` values rotate).
    pub head_dim: usize,
    /// Tokens each query attends to.
    pub top_k: usize,
    /// How the indexer's RoPE rotates (NeoX for DeepSeek V3.2, consecutive pairs for
    /// GLM-5).
    pub rope_mode: i32,
    /// Epsilon of the indexer keys' layer norm (llama.cpp's `f_norm_eps`: 1e-6 for
    /// DeepSeek V3.2; GLM-5's loader sets none, so 0).
    pub key_norm_eps: f32,
    /// Per layer: whether it computes its own selection (`false`: it reuses the
    /// previous full layer's, GLM-5.2's shared indexer layers).
    pub full_layers: Vec<bool>,
    /// GLM-5 next's k-pool indexer: keys pooled over blocks of consecutive tokens,
    /// scored and chosen as whole blocks, without RoPE or a Walsh-Hadamard rotation;
    /// `None`: one key per token (DeepSeek V3.2, GLM-5).
    pub kpool: Option<Kpool>,
}

/// GLM-5 next's k-pool indexer (`attention.indexer.kpool*`): each block of `size`
/// consecutive positions of a sequence (from its first) pools its tokens' indexer keys
/// into one, weighted per dimension by a softmax over the block of the tokens' gate
/// scores plus a learnt bias per slot; a query scores the complete blocks it sees and
/// attends to the tokens of the `top_k / size` best, and, with `select_tail`, to those
/// of its own incomplete block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Kpool {
    /// Tokens per block (`attention.indexer.kpool`, at least 2, dividing `top_k`).
    pub size: usize,
    /// Whether a query also attends to its own incomplete block
    /// (`attention.indexer.kpool_select_tail`).
    pub select_tail: bool,
}

impl Indexer {
    /// Size of the Walsh-Hadamard matrix llama.cpp rotates indexer queries and keys by:
    /// 64, doubled while it divides the head (the whole head for the sizes accepted);
    /// 0 for a k-pool indexer, which is not rotated.
    pub fn rotation(&self) -> usize {
        if self.kpool.is_some() {
            return 0;
        }
        let mut n = 64;
        while self.head_dim.is_multiple_of(2 * n) {
            n *= 2;
        }
        n
    }

    /// Width of a cached indexer row: the token's key, and with a k-pool its gate
    /// scores after it.
    pub fn cache_width(&self) -> usize {
        match self.kpool {
            Some(_) => 2 * self.head_dim,
            None => self.head_dim,
        }
    }
}

/// How RoPE positions are scaled beyond the trained context.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum RopeScaling {
    None,
    Linear,
    Yarn,
}

/// The YaRN settings llama.cpp turns into RoPE's attention factor.
#[derive(Clone, Debug, PartialEq)]
pub struct Yarn {
    /// `rope.scaling.attn_factor` (a final multiplier, 1 by default).
    pub attn_factor: f32,
    /// `rope.scaling.yarn_log_multiplier` as the architecture reads it (0: none).
    pub log_mul: f32,
    /// DeepSeek V2's special case: the log multiplier is also the `mscale`.
    pub mscale_from_log_mul: bool,
}

/// The metadata keys of one architecture (`{arch}.{key}`), for its `hparams` function.
pub struct Keys<'a> {
    gguf: &'a Gguf,
    prefix: &'a str,
}

impl<'a> Keys<'a> {
    /// Keys `{prefix}.*` of `gguf`.
    pub fn new(gguf: &'a Gguf, prefix: &'a str) -> Keys<'a> {
        Keys { gguf, prefix }
    }

    /// The full key name of `key`.
    pub fn name(&self, key: &str) -> String {
        format!("{}.{key}", self.prefix)
    }

    /// A required integer.
    pub fn u32(&self, key: &str) -> Result<usize, ModelError> {
        Ok(self.gguf.get_u32(&self.name(key))? as usize)
    }

    /// An optional integer.
    pub fn opt_u32(&self, key: &str) -> Result<Option<usize>, ModelError> {
        Ok(self.gguf.opt_u32(&self.name(key))?.map(|v| v as usize))
    }

    /// An optional float.
    pub fn opt_f32(&self, key: &str) -> Result<Option<f32>, ModelError> {
        Ok(self.gguf.opt_f32(&self.name(key))?)
    }

    /// A required float.
    pub fn f32(&self, key: &str) -> Result<f32, ModelError> {
        Ok(self.gguf.get_f32(&self.name(key))?)
    }

    /// An optional boolean.
    pub fn opt_bool(&self, key: &str) -> Result<Option<bool>, ModelError> {
        Ok(self.gguf.opt_bool(&self.name(key))?)
    }

    /// An optional string.
    pub fn opt_str(&self, key: &str) -> Result<Option<&'a str>, ModelError> {
        Ok(self.gguf.opt_str(&self.name(key))?)
    }

    /// The raw value, if present.
    pub fn get(&self, key: &str) -> Option<&'a baton_gguf::Value> {
        self.gguf.get(&self.name(key))
    }

    /// An optional array of integers.
    pub fn opt_u32_array(&self, key: &str) -> Result<Option<Vec<u32>>, ModelError> {
        let full = self.name(key);
        match self.gguf.get(&full) {
            None => Ok(None),
            Some(_) => Ok(Some(self.gguf.get_u32_array(&full)?)),
        }
    }

    /// An optional array of booleans.
    pub fn opt_bool_array(&self, key: &str) -> Result<Option<Vec<bool>>, ModelError> {
        let full = self.name(key);
        match self.gguf.get(&full) {
            None => Ok(None),
            Some(_) => Ok(Some(self.gguf.get_bool_array(&full)?)),
        }
    }

    /// A per-layer float as llama.cpp's `get_key_or_arr` reads it: one value for every
    /// layer, or an array of at least `n` (DeepSeek V4's also cover its prediction
    /// layers); missing gives `None`.
    pub fn opt_per_layer_f32(&self, key: &str, n: usize) -> Result<Option<Vec<f32>>, ModelError> {
        match self.get(key) {
            None => Ok(None),
            Some(baton_gguf::Value::Array(values)) => {
                let values: Option<Vec<f32>> = values
                    .iter()
                    .map(|v| match v {
                        baton_gguf::Value::F32(x) => Some(*x),
                        _ => None,
                    })
                    .collect();
                match values {
                    Some(values) if values.len() >= n => Ok(Some(values)),
                    _ => Err(ModelError::BadHParams(format!(
                        "{} must be one float or an array of at least {n} floats",
                        self.name(key)
                    ))),
                }
            }
            Some(_) => Ok(Some(vec![self.f32(key)?; n])),
        }
    }

    /// The error of a required key the file lacks.
    pub fn missing(&self, key: &str) -> ModelError {
        ModelError::Gguf(baton_gguf::GgufError::MissingKey(self.name(key)))
    }

    /// A per-layer integer as llama.cpp's `get_key_or_arr` reads it: one value for
    /// every layer, or an array of `n` values; missing gives `None`.
    pub fn opt_per_layer_u32(&self, key: &str, n: usize) -> Result<Option<Vec<usize>>, ModelError> {
        let full = self.name(key);
        if self.gguf.get(&full).is_none() {
            return Ok(None);
        }
        let values = self.gguf.get_u32_per_layer(&full, n)?;
        Ok(Some(values.into_iter().map(|v| v as usize).collect()))
    }

    /// A per-layer integer (see [`Keys::opt_per_layer_u32`]) that baton's layers share:
    /// an array must hold the same value throughout; missing gives `None`.
    pub fn opt_uniform_u32(&self, key: &str, n: usize) -> Result<Option<usize>, ModelError> {
        let Some(values) = self.opt_per_layer_u32(key, n)? else {
            return Ok(None);
        };
        match values.split_first() {
            Some((&first, rest)) if rest.iter().all(|&v| v == first) => Ok(Some(first)),
            Some(_) => Err(ModelError::BadHParams(format!(
                "{} differs between layers ({values:?}); baton needs one value for all",
                self.name(key)
            ))),
            None => Ok(None),
        }
    }

    /// A per-layer size whose 0 means the layer lacks the block (Nemotron-H's
    /// `attention.head_count_kv` and `feed_forward_length`): the value the layers
    /// that have the block share (0 if none has it) and each layer's. Layers that have
    /// it must agree; missing gives `None`.
    pub fn opt_per_layer_blocks(&self, key: &str, n: usize) -> Result<Option<(usize, Vec<usize>)>, ModelError> {
        let Some(values) = self.opt_per_layer_u32(key, n)? else {
            return Ok(None);
        };
        let mut present = values.iter().copied().filter(|&v| v > 0);
        let first = present.next().unwrap_or(0);
        if present.any(|v| v != first) {
            return Err(ModelError::BadHParams(format!(
                "{} differs between the layers that have the block ({values:?}); baton needs one value for all",
                self.name(key)
            )));
        }
        Ok(Some((first, values)))
    }
}

impl HParams {
    /// Reads the hyper-parameters of `gguf`, failing with the key that is missing or wrong.
    pub fn from_gguf(gguf: &Gguf) -> Result<HParams, ModelError> {
        // The architecture first: a model baton does not run is named as such, whatever
        // else it lacks.
        let arch_name = gguf.architecture()?;
        arch::find(arch_name)?;
        let token_embd = EndTensor::TokenEmbd.name();
        let n_vocab = gguf
            .tensor(token_embd)
            .and_then(|t| t.dims.get(1).copied())
            .ok_or_else(|| ModelError::MissingTensor(token_embd.into()))? as usize;
        // Every layer has tensors: a block count beyond the tensor index is a broken (or
        // hostile) file, and must not size anything.
        let n_layer_all = gguf.get_u32(&format!("{arch_name}.block_count"))? as usize;
        if n_layer_all > gguf.tensors.len() {
            return Err(ModelError::BadHParams(format!(
                "block_count {n_layer_all} is more than the file's {} tensors",
                gguf.tensors.len()
            )));
        }
        Self::from_metadata(gguf, n_vocab)
    }

    /// Reads the hyper-parameters from metadata alone, for a vocabulary of `n_vocab`.
    pub fn from_metadata(gguf: &Gguf, n_vocab: usize) -> Result<HParams, ModelError> {
        let arch_name = gguf.architecture()?;
        let arch = arch::find(arch_name)?;
        let keys = Keys::new(gguf, arch_name);

        let n_layer_all = keys.u32("block_count")?;
        if n_layer_all > MAX_LAYERS {
            return Err(ModelError::BadHParams(format!(
                "block_count {n_layer_all} is more than llama.cpp's limit of {MAX_LAYERS} layers"
            )));
        }
        let n_layer_nextn = keys.opt_u32("nextn_predict_layers")?.unwrap_or(0);
        let n_layer = n_layer_all.saturating_sub(n_layer_nextn);
        let n_embd = keys.u32("embedding_length")?;
        // One value for every layer, or with per-layer blocks one for the layers that
        // have the block and 0 for the others.
        let per_layer = |key: &str| -> Result<Option<(usize, Vec<usize>)>, ModelError> {
            if arch.layer_sizes == LayerSizes::Blocks {
                keys.opt_per_layer_blocks(key, n_layer_all)
            } else {
                Ok(keys
                    .opt_uniform_u32(key, n_layer_all)?
                    .map(|n| (n, vec![n; n_layer_all])))
            }
        };
        let n_head = per_layer("attention.head_count")?.map_or(0, |(n, _)| n);
        let kv_heads = if arch.layer_sizes == LayerSizes::KvHeadsPerLayer {
            // Each layer's own; the architecture says which value `n_head_kv` is.
            keys.opt_per_layer_u32("attention.head_count_kv", n_layer_all)?
                .map(|heads| (heads.first().copied().unwrap_or(0), heads))
        } else {
            per_layer("attention.head_count_kv")?
        };
        let (n_head_kv, mut layer_kv_heads) = kv_heads.unwrap_or((n_head, vec![n_head; n_layer_all]));
        if n_layer == 0 || n_embd == 0 || n_head == 0 || n_head_kv == 0 || !n_head.is_multiple_of(n_head_kv) {
            return Err(ModelError::BadHParams(format!(
                "n_layer {n_layer}, n_embd {n_embd}, n_head {n_head}, n_head_kv {n_head_kv}: \
                 all must be positive and n_head a multiple of n_head_kv"
            )));
        }
        let (n_ff, mut layer_ff) = per_layer("feed_forward_length")?.unwrap_or((0, vec![0; n_layer_all]));
        layer_kv_heads.truncate(n_layer);
        layer_ff.truncate(n_layer);
        let head_dim_k = keys.opt_u32("attention.key_length")?.unwrap_or(n_embd / n_head);
        let head_dim_v = keys.opt_u32("attention.value_length")?.unwrap_or(n_embd / n_head);
        let n_ctx_train = keys.opt_u32("context_length")?.unwrap_or(2048);
        // Missing: NaN until the architecture's own keys say otherwise (Nemotron-H falls
        // back to another key); still NaN after them, the key is missing.
        let rms_eps = keys.opt_f32(RMS_EPS)?.unwrap_or(f32::NAN);
        let moe = MoeParams::read(&keys, n_layer_all)?;

        let n_rot = keys.opt_u32("rope.dimension_count")?.unwrap_or(head_dim_k);
        let freq_base = keys.opt_f32("rope.freq_base")?.unwrap_or(10_000.0);
        let scaling = match keys.opt_str("rope.scaling.type")?.unwrap_or("linear") {
            "none" => RopeScaling::None,
            "linear" => RopeScaling::Linear,
            "yarn" => RopeScaling::Yarn,
            other => {
                return Err(ModelError::BadHParams(format!(
                    "RoPE scaling type '{other}' is not supported"
                )))
            }
        };
        let factor = keys
            .opt_f32("rope.scaling.factor")?
            .or(keys.opt_f32("rope.scale_linear")?)
            .unwrap_or(0.0);
        // llama.cpp never scales when the type says none.
        let freq_scale = match scaling {
            RopeScaling::None => 1.0,
            _ if factor == 0.0 => 1.0,
            _ => 1.0 / factor,
        };
        let n_ctx_orig = keys
            .opt_u32("rope.scaling.original_context_length")?
            .unwrap_or(n_ctx_train);
        let rope = RopeParams {
            n_dims: n_rot as i32,
            mode: arch.rope.mode(),
            n_ctx_orig: n_ctx_orig as i32,
            freq_base,
            freq_scale,
            ext_factor: if scaling == RopeScaling::Yarn { 1.0 } else { 0.0 },
            attn_factor: 1.0,
            beta_fast: 32.0,
            beta_slow: 1.0,
        };
        let yarn = Yarn {
            attn_factor: keys.opt_f32("rope.scaling.attn_factor")?.unwrap_or(1.0),
            log_mul: 0.0,
            mscale_from_log_mul: false,
        };

        let mut hp = HParams {
            arch,
            n_layer,
            n_layer_nextn: n_layer_all - n_layer,
            n_embd,
            n_head,
            n_head_kv,
            head_dim_k,
            head_dim_v,
            n_ff,
            n_vocab,
            n_ctx_train,
            rms_eps,
            rope_swa: rope.clone(),
            rope,
            attn_scale: 1.0 / (head_dim_k as f32).sqrt(),
            query_scale: 1.0,
            n_swa: 0,
            swa_type: SwaType::Sliding,
            swa_layers: vec![false; n_layer],
            // Soft-capping is each architecture's to read (llama.cpp ignores the keys
            // elsewhere).
            final_logit_softcap: 0.0,
            attn_logit_softcap: 0.0,
            moe,
            yarn,
            mla: None,
            attn_temp: None,
            tp_heads: None,
            ssm: None,
            recurrent_layers: vec![false; n_layer],
            layer_kv_heads,
            layer_ff,
            rope_sections: None,
            swa_heads: None,
            kimi_k3: None,
            kda_gate_lower_bound: None,
            unrotated: false,
            hyper: None,
            dsv4: None,
            msa: None,
        };
        (arch.hparams)(&mut hp, &keys)?;
        if hp.rms_eps.is_nan() {
            return Err(ModelError::Gguf(baton_gguf::GgufError::MissingKey(keys.name(RMS_EPS))));
        }
        hp.finish_rope();
        hp.check()?;
        Ok(hp)
    }

    /// Refuses values ggml would abort the process on (it asserts on shapes rather than
    /// returning errors), so that a hostile or broken file fails to load instead: head
    /// sizes, RoPE dimensions, the sliding window. Tensor shapes are checked against
    /// these values when the weights load.
    fn check(&self) -> Result<(), ModelError> {
        let bad = |why: String| Err(ModelError::BadHParams(why));
        const MAX_HEAD_DIM: usize = 1 << 14;
        for (name, dim) in [("key_length", self.head_dim_k), ("value_length", self.head_dim_v)] {
            if dim == 0 || dim > MAX_HEAD_DIM {
                return bad(format!("attention.{name} {dim} must be between 1 and {MAX_HEAD_DIM}"));
            }
        }
        if let Some(swa) = &self.swa_heads {
            for (name, dim) in [("key_length_swa", swa.head_dim_k), ("value_length_swa", swa.head_dim_v)] {
                if dim == 0 || dim > MAX_HEAD_DIM {
                    return bad(format!("attention.{name} {dim} must be between 1 and {MAX_HEAD_DIM}"));
                }
            }
        }
        let swa_head_dim = self.swa_heads.map_or(self.head_dim_k, |h| h.head_dim_k);
        for (name, rope, head_dim) in [
            ("rope", &self.rope, self.head_dim_k),
            ("sliding-window rope", &self.rope_swa, swa_head_dim),
        ] {
            let n_dims = rope.n_dims;
            if n_dims == 0 && self.unrotated {
                continue;
            }
            if n_dims <= 0 || n_dims % 2 != 0 || n_dims as usize > head_dim {
                return bad(format!(
                    "{name} dimension count {n_dims} must be even, positive and at most the head size {head_dim}"
                ));
            }
            if !(rope.freq_base.is_finite() && rope.freq_base > 0.0 && rope.freq_scale.is_finite()) {
                return bad(format!(
                    "{name} frequency base {} and scale {} must be finite and the base positive",
                    rope.freq_base, rope.freq_scale
                ));
            }
        }
        if !(self.rms_eps.is_finite() && self.rms_eps >= 0.0) {
            return bad(format!(
                "layer norm epsilon {} must be finite and not negative",
                self.rms_eps
            ));
        }
        if self.swa_layers.iter().any(|&swa| swa) && self.n_swa == 0 {
            return bad("sliding-window layers with a window of 0 tokens".into());
        }
        Ok(())
    }

    /// The attention factor RoPE scales by, as llama.cpp's context computes it from
    /// the YaRN settings (after the architecture read its own).
    fn finish_rope(&mut self) {
        let mut attn_factor = 1.0f32;
        if self.rope.ext_factor != 0.0 {
            let mscale = |scale: f32, m: f32| if scale <= 1.0 { 1.0 } else { 0.1 * m * scale.ln() + 1.0 };
            let factor = 1.0 / self.rope.freq_scale;
            attn_factor = if self.yarn.log_mul != 0.0 {
                let all_dims = self.yarn.log_mul;
                let m = if self.yarn.mscale_from_log_mul && all_dims != 1.0 {
                    all_dims
                } else {
                    1.0
                };
                mscale(factor, m) / mscale(factor, all_dims)
            } else {
                mscale(factor, 1.0)
            };
            // ggml's YaRN multiplies by this again; llama.cpp cancels it here.
            attn_factor *= 1.0 / (1.0 + 0.1 * factor.ln());
        }
        attn_factor *= self.yarn.attn_factor;
        self.rope.attn_factor = attn_factor;
        self.rope_swa.attn_factor = attn_factor;
    }

    /// Reads `attention.sliding_window` (`default_window` when missing) and the layers
    /// that use it: every `n`-th layer is global and the others slide, `n` from
    /// `attention.sliding_window_pattern` (an integer, `default_pattern` when missing),
    /// or that key as one flag per layer.
    /// Sliding layers get RoPE base `rope.freq_base_swa` when set, `swa_freq_base`
    /// otherwise (None: the base of the other layers).
    pub fn read_sliding_window(
        &mut self,
        keys: &Keys<'_>,
        default_window: usize,
        default_pattern: usize,
        swa_freq_base: Option<f32>,
    ) -> Result<(), ModelError> {
        self.n_swa = keys.opt_u32("attention.sliding_window")?.unwrap_or(default_window);
        if self.n_swa == 0 {
            return Ok(());
        }
        let key = "attention.sliding_window_pattern";
        if let Some(baton_gguf::Value::Array(_)) = keys.get(key) {
            let flags = keys.gguf.get_bool_array(&keys.name(key))?;
            if flags.len() < self.n_layer {
                return Err(ModelError::BadHParams(format!(
                    "{} has {} entries for {} layers",
                    keys.name(key),
                    flags.len(),
                    self.n_layer
                )));
            }
            self.swa_layers = flags[..self.n_layer].to_vec();
        } else {
            let n = keys.opt_u32(key)?.unwrap_or(default_pattern);
            // Every n-th layer is global, the others slide (n = 0: all slide).
            self.swa_layers = (0..self.n_layer).map(|layer| n == 0 || layer % n < n - 1).collect();
        }
        let base = swa_freq_base.unwrap_or(self.rope.freq_base);
        self.rope_swa.freq_base = keys.opt_f32("rope.freq_base_swa")?.unwrap_or(base);
        Ok(())
    }

    /// Values per token of the hidden state between layers and between stages:
    /// `n_embd`, times the streams with hyper-connections (llama.cpp's `n_embd_out`).
    pub fn hidden_width(&self) -> usize {
        self.n_embd * self.hyper.map_or(1, |h| h.n_stream)
    }

    /// Inputs banked by the layers before `layer` (Kimi K3's cross-layer residual
    /// attention: layers 0, b, 2b, … bank their raw input), which later layers and the
    /// output still read; 0 for every other architecture.
    pub fn banked_before(&self, layer: usize) -> usize {
        match self.kimi_k3 {
            Some(k3) if k3.res_block > 0 => layer.min(self.n_layer).div_ceil(k3.res_block),
            _ => 0,
        }
    }

    /// Values per token that travel to a stage starting at `layer`: the hidden state
    /// ([`hidden_width`](Self::hidden_width)) and, after it, each input banked before
    /// `layer` (`n_embd` each, oldest first).
    pub fn carried_width(&self, layer: usize) -> usize {
        self.hidden_width() + self.n_embd * self.banked_before(layer)
    }

    /// Width of the key rows of one layer's cache (`head_dim_k * n_head_kv`).
    pub fn n_embd_k_gqa(&self) -> usize {
        self.head_dim_k * self.n_head_kv
    }

    /// Width of the value rows of one layer's cache.
    pub fn n_embd_v_gqa(&self) -> usize {
        self.head_dim_v * self.n_head_kv
    }

    /// Bytes one token takes in one layer's KV cache: keys and values of `types`
    /// (ggml's row size of each), or with MLA only the compressed row (see
    /// [`crate::KvCache`]).
    pub fn kv_cell_bytes(&self, types: KvTypes) -> usize {
        let values = if self.keys_only() {
            0
        } else {
            types.v.row_bytes(self.n_embd_v_gqa())
        };
        types.k.row_bytes(self.n_embd_k_gqa()) + values
    }

    /// Bytes one token takes in layer `layer`'s KV cache with cache types `types` (see
    /// [`HParams::layer_heads`]).
    pub fn layer_kv_cell_bytes(&self, layer: usize, types: KvTypes) -> usize {
        match self.swa_heads {
            Some(_) if self.is_swa(layer) => {
                let heads = self.layer_heads(layer);
                types.k.row_bytes(heads.n_head_kv * heads.head_dim_k)
                    + types.v.row_bytes(heads.n_head_kv * heads.head_dim_v)
            }
            _ => self.kv_cell_bytes(types) + self.indexer_cell_bytes(layer, types),
        }
    }

    /// Bytes one token takes in layer `layer`'s indexer key cache (DeepSeek sparse
    /// attention; 0 for other models and for layers that reuse an earlier selection).
    pub fn indexer_cell_bytes(&self, layer: usize, types: KvTypes) -> usize {
        self.indexer_key_dim(layer).map_or(0, |dim| types.k.row_bytes(dim))
    }

    /// Width of the f32 row DeepSeek V4's compressor keeps per token of layer `layer`
    /// (its value and its score, side by side; a compressed sparse layer's twice as
    /// wide, its blocks overlapping), in a cell of every token even where the layer's
    /// keys keep a window only; `None` on layers without a compressor.
    pub fn compressor_dim(&self, layer: usize) -> Option<usize> {
        let v4 = self.dsv4.as_ref()?;
        match v4.compress_ratios.get(layer) {
            Some(&HCA_RATIO) => Some(2 * self.head_dim_k),
            Some(&CSA_RATIO) => Some(4 * self.head_dim_k),
            _ => None,
        }
    }

    /// Width of the f32 row the compressor of DeepSeek V4's lightning indexer keeps per
    /// token of a compressed sparse layer (as [`HParams::compressor_dim`]'s, over the
    /// indexer's heads); `None` on other layers.
    pub fn indexer_compressor_dim(&self, layer: usize) -> Option<usize> {
        let v4 = self.dsv4.as_ref()?;
        v4.is_csa(layer).then_some(4 * v4.indexer_heads.1)
    }

    /// Width of the indexer row layer `layer` caches per token: DeepSeek sparse
    /// attention's (GLM-5 next's with its gate scores) on layers with their own indexer, MiniMax sparse attention's on its
    /// sparse layers; `None` elsewhere.
    pub fn indexer_key_dim(&self, layer: usize) -> Option<usize> {
        if let Some(ix) = self.indexer() {
            return (ix.full_layers.get(layer) == Some(&true)).then_some(ix.cache_width());
        }
        self.msa.filter(|_| self.is_msa(layer)).map(|msa| msa.head_dim)
    }

    /// Whether layer `layer` attends through MiniMax sparse attention (every layer
    /// after the dense lead of a model that has it).
    pub fn is_msa(&self, layer: usize) -> bool {
        self.msa.is_some() && layer >= self.moe.n_layer_dense_lead && layer < self.n_layer
    }

    /// Whether the cache keeps keys only, the values being a view of them (MLA's latent
    /// rows, DeepSeek V4's single key-and-value head).
    pub fn keys_only(&self) -> bool {
        self.mla.is_some() || self.dsv4.is_some()
    }

    /// The lightning indexer of DeepSeek sparse attention, for models that have it.
    pub fn indexer(&self) -> Option<&Indexer> {
        self.mla.as_ref().and_then(|mla| mla.indexer.as_ref())
    }

    /// Why no stage may start at `layer`, when none may: a layer that reuses an earlier
    /// layer's choice of tokens (GLM-5.2's shared indexer layers) needs that layer on
    /// its stage (the choice does not travel), and DeepSeek V4's hash-routed layers
    /// choose experts by the batch's token ids, which only the first stage has.
    pub fn stage_start_refusal(&self, layer: usize) -> Option<String> {
        if let Some(ix) = self.indexer().filter(|ix| !ix.full_layers[layer]) {
            let full_layer = (0..layer).rev().find(|&l| ix.full_layers[l]).unwrap_or(0);
            return Some(format!(
                "a stage cannot start at layer {layer}: it reuses layer {full_layer}'s choice of tokens (a \
                 shared indexer layer); start stages at layers that have their own indexer (e.g. with --split)"
            ));
        }
        let hash = self.dsv4.as_ref().map_or(0, |d| d.hash_layers);
        (layer > 0 && layer < hash).then(|| {
            format!(
                "a stage cannot start at layer {layer}: deepseek4's first {hash} layers (hash_layer_count) \
                 choose experts by the token ids, which only the first stage has; start stages at layer 0 \
                 or from layer {hash}"
            )
        })
    }

    /// The layers no stage may start at ([`HParams::stage_start_refusal`]) and, in a
    /// few words for the planner's messages, what they need from the layers before.
    pub fn no_stage_start(&self) -> (Vec<usize>, &'static str) {
        let layers: Vec<usize> = (1..self.n_layer)
            .filter(|&l| self.stage_start_refusal(l).is_some())
            .collect();
        let hashed = self.dsv4.as_ref().is_some_and(|d| d.hash_layers > 1);
        let why = if hashed {
            "the batch's token ids (deepseek4's hash-routed experts choose by them; only the first stage has them)"
        } else {
            "an earlier layer's choice of tokens (a shared indexer layer)"
        };
        (layers, why)
    }

    /// The key/value heads of layer `layer`: those of [`HParams::swa_heads`] on a
    /// sliding-window layer of a model that has them, else the model's.
    pub fn layer_heads(&self, layer: usize) -> LayerHeads {
        match self.swa_heads {
            Some(heads) if self.is_swa(layer) => heads,
            _ => LayerHeads {
                n_head_kv: self.n_head_kv,
                head_dim_k: self.head_dim_k,
                head_dim_v: self.head_dim_v,
            },
        }
    }

    /// Bytes layer `layer`'s cache takes on a stage of `n_ctx` cells for `n_seq`
    /// sequences: keys and values (of `types`) of every cell for an attention layer
    /// (a sliding-window layer's window cells, see [`HParams::window_cells`], with
    /// [`crate::DEFAULT_UBATCH`] rows per batch); for a recurrent layer, each
    /// sequence's kept states (f32, see [`crate::RecurrentCache`]), whatever the
    /// context; nothing for a layer that does neither.
    pub fn layer_cache_bytes(&self, layer: usize, n_ctx: usize, n_seq: usize, types: KvTypes) -> u64 {
        match &self.ssm {
            Some(ssm) if self.is_recurrent(layer) => {
                let rows = crate::recurrent::state_rows(n_seq) as u64;
                rows * ((ssm.conv_state_len() + ssm.state_len()) * std::mem::size_of::<f32>()) as u64
            }
            _ if self.has_kv(layer) => {
                let cells = match self.window_cells(n_ctx, n_seq, crate::DEFAULT_UBATCH) {
                    Some(per_seq) if self.is_swa(layer) => per_seq.saturating_mul(n_seq),
                    _ => n_ctx,
                };
                let widths = self.compressor_dim(layer).unwrap_or(0) + self.indexer_compressor_dim(layer).unwrap_or(0);
                let compressor = widths * std::mem::size_of::<f32>();
                (self.layer_kv_cell_bytes(layer, types) as u64)
                    .saturating_mul(cells as u64)
                    .saturating_add((compressor as u64).saturating_mul(n_ctx as u64))
            }
            _ => 0,
        }
    }

    /// Cells each sequence has in the cache of the sliding-window layers when a stage
    /// of `n_ctx` cells gives each of `n_seq` sequences a region and computes at most
    /// `n_ubatch` rows of a sequence in one batch: its window plus one batch, padded to
    /// 256, at most its share of the context (padded too), as llama.cpp sizes its
    /// sliding-window cache (`llama_kv_cache_iswa` without `swa_full`, one stream per
    /// sequence). `None` when those layers keep a cell for every token: a model without
    /// windows, or sequences sharing all cells (`n_seq` 0).
    pub fn window_cells(&self, n_ctx: usize, n_seq: usize, n_ubatch: usize) -> Option<usize> {
        if self.n_swa == 0 || n_seq == 0 || !self.swa_layers.iter().any(|&swa| swa) {
            return None;
        }
        let per_seq = (n_ctx / n_seq).min(self.n_swa.saturating_add(n_ubatch));
        Some(per_seq.div_ceil(256).saturating_mul(256))
    }

    /// What a token of a sliding-window layer sees (its window or chunk).
    pub fn window(&self) -> Window {
        match self.swa_type {
            SwaType::Sliding => Window::Sliding(self.n_swa),
            SwaType::Chunked => Window::Chunked(self.n_swa),
        }
    }

    /// Whether layer `layer` is recurrent (see [`HParams::recurrent_layers`]).
    pub fn is_recurrent(&self, layer: usize) -> bool {
        self.recurrent_layers.get(layer).copied().unwrap_or(false)
    }

    /// Whether layer `layer` attends, keeping keys and values in the KV cache: every
    /// layer but the recurrent ones and those without KV heads (see
    /// [`HParams::layer_kv_heads`]).
    pub fn has_kv(&self, layer: usize) -> bool {
        !self.is_recurrent(layer) && self.layer_kv_heads.get(layer).is_some_and(|&n| n > 0)
    }

    /// Position coordinates per token the graph's position input holds: 4 with
    /// multi-section RoPE, else 1.
    pub fn n_pos_per_token(&self) -> usize {
        if self.rope_sections.is_some() {
            4
        } else {
            1
        }
    }

    /// Whether layer `layer` uses sliding-window attention.
    pub fn is_swa(&self, layer: usize) -> bool {
        self.n_swa > 0 && self.swa_layers.get(layer).copied().unwrap_or(false)
    }

    /// Whether layer `layer` routes its tokens to experts (dense leading layers do not,
    /// nor, with an interleave step `s`, layers other than every `s`-th).
    pub fn is_moe(&self, layer: usize) -> bool {
        // `is_multiple_of(0)` is false for every layer: step 0 has no MoE layers.
        self.moe.n_expert > 0 && layer >= self.moe.n_layer_dense_lead && (layer + 1).is_multiple_of(self.moe.layer_step)
    }
}
