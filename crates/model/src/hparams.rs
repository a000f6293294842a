//! Hyper-parameters of a model, all read from GGUF metadata.

use baton_ggml::RopeParams;
use baton_gguf::Gguf;

use crate::ModelError;

/// The architectures baton can run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    /// Llama 1/2/3 and Mistral-style GGUFs.
    Llama,
    /// Qwen 2 / 2.5 (biases on q, k, v).
    Qwen2,
    /// Qwen 3 (RMS norm on q and k).
    Qwen3,
    /// Gemma 3 (sliding-window layers, post norms, GeGLU, scaled embeddings).
    Gemma3,
}

impl Arch {
    /// The architecture named by `general.architecture`.
    pub fn from_name(name: &str) -> Result<Arch, ModelError> {
        match name {
            "llama" | "mistral" => Ok(Arch::Llama),
            "qwen2" => Ok(Arch::Qwen2),
            "qwen3" => Ok(Arch::Qwen3),
            "gemma3" => Ok(Arch::Gemma3),
            other => Err(ModelError::UnsupportedArch(other.to_string())),
        }
    }

    /// The GGUF metadata prefix (`{prefix}.block_count`, ...).
    fn key_prefix(self, name: &str) -> String {
        name.to_string()
    }

    /// RoPE mode: llama rotates interleaved pairs, the others rotate halves (NeoX).
    fn rope_mode(self) -> i32 {
        match self {
            Arch::Llama => 0,
            Arch::Qwen2 | Arch::Qwen3 | Arch::Gemma3 => 2,
        }
    }
}

/// Everything the graph builders need to know about a model.
#[derive(Clone, Debug, PartialEq)]
pub struct HParams {
    /// Architecture.
    pub arch: Arch,
    /// Number of transformer layers.
    pub n_layer: usize,
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
    /// Feed-forward inner size.
    pub n_ff: usize,
    /// Vocabulary size (rows of the token embedding).
    pub n_vocab: usize,
    /// Context length the model was trained with.
    pub n_ctx_train: usize,
    /// Epsilon of every RMS norm.
    pub rms_eps: f32,
    /// RoPE for full-attention layers.
    pub rope: RopeParams,
    /// RoPE for sliding-window layers (gemma3 uses another base there).
    pub rope_swa: RopeParams,
    /// Scale applied to attention scores (`q·k * scale`).
    pub attn_scale: f32,
    /// Scale applied to queries before attention (gemma3), 1.0 otherwise.
    pub query_scale: f32,
    /// Multiplier of the token embeddings (gemma: sqrt(n_embd)), 1.0 otherwise.
    pub embd_scale: f32,
    /// Sliding-window size (0: no sliding window).
    pub n_swa: usize,
    /// Per layer: whether it uses the sliding window.
    pub swa_layers: Vec<bool>,
    /// `tanh` soft-capping of the final logits (0: none).
    pub final_logit_softcap: f32,
    /// `tanh` soft-capping of attention scores (0: none).
    pub attn_logit_softcap: f32,
}

impl HParams {
    /// Reads the hyper-parameters of `gguf`, failing with the key that is missing or wrong.
    pub fn from_gguf(gguf: &Gguf) -> Result<HParams, ModelError> {
        let arch_name = gguf.architecture()?;
        let arch = Arch::from_name(arch_name)?;
        let p = arch.key_prefix(arch_name);
        let key = |k: &str| format!("{p}.{k}");

        let n_layer = gguf.get_u32(&key("block_count"))? as usize;
        let n_embd = gguf.get_u32(&key("embedding_length"))? as usize;
        let n_ff = gguf.get_u32(&key("feed_forward_length"))? as usize;
        let n_head = gguf.get_u32(&key("attention.head_count"))? as usize;
        let n_head_kv = gguf
            .opt_u32(&key("attention.head_count_kv"))?
            .map_or(n_head, |v| v as usize);
        if n_layer == 0 || n_embd == 0 || n_head == 0 || n_head_kv == 0 || !n_head.is_multiple_of(n_head_kv) {
            return Err(ModelError::BadHParams(format!(
                "n_layer {n_layer}, n_embd {n_embd}, n_head {n_head}, n_head_kv {n_head_kv}: \
                 all must be positive and n_head a multiple of n_head_kv"
            )));
        }
        // Every layer has tensors: a block count beyond the tensor index is a broken (or
        // hostile) file, and must not size anything.
        if n_layer > gguf.tensors.len() {
            return Err(ModelError::BadHParams(format!(
                "block_count {n_layer} is more than the file's {} tensors",
                gguf.tensors.len()
            )));
        }
        let head_dim_k = gguf
            .opt_u32(&key("attention.key_length"))?
            .map_or(n_embd / n_head, |v| v as usize);
        let head_dim_v = gguf
            .opt_u32(&key("attention.value_length"))?
            .map_or(n_embd / n_head, |v| v as usize);
        let n_ctx_train = gguf.opt_u32(&key("context_length"))?.unwrap_or(2048) as usize;
        let rms_eps = gguf.get_f32(&key("attention.layer_norm_rms_epsilon"))?;
        let n_vocab = gguf
            .tensor("token_embd.weight")
            .and_then(|t| t.dims.get(1).copied())
            .ok_or_else(|| ModelError::MissingTensor("token_embd.weight".into()))? as usize;

        let n_rot = gguf
            .opt_u32(&key("rope.dimension_count"))?
            .map_or(head_dim_k, |v| v as usize);
        let freq_base = gguf.opt_f32(&key("rope.freq_base"))?.unwrap_or(10_000.0);
        let scaling = gguf.opt_str(&key("rope.scaling.type"))?.unwrap_or("none");
        let factor = gguf.opt_f32(&key("rope.scaling.factor"))?.unwrap_or(0.0);
        let freq_scale = match scaling {
            "none" => 1.0,
            "linear" if factor > 0.0 => 1.0 / factor,
            "linear" => 1.0,
            other => {
                return Err(ModelError::BadHParams(format!(
                    "RoPE scaling type '{other}' is not supported"
                )))
            }
        };
        let n_ctx_orig = gguf
            .opt_u32(&key("rope.scaling.original_context_length"))?
            .map_or(n_ctx_train, |v| v as usize);
        let rope = RopeParams {
            n_dims: n_rot as i32,
            mode: arch.rope_mode(),
            n_ctx_orig: n_ctx_orig as i32,
            freq_base,
            freq_scale,
            ext_factor: 0.0,
            attn_factor: 1.0,
            beta_fast: 32.0,
            beta_slow: 1.0,
        };

        let mut hp = HParams {
            arch,
            n_layer,
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
            embd_scale: 1.0,
            n_swa: 0,
            swa_layers: vec![false; n_layer],
            final_logit_softcap: gguf.opt_f32(&key("final_logit_softcapping"))?.unwrap_or(0.0),
            attn_logit_softcap: gguf.opt_f32(&key("attn_logit_softcapping"))?.unwrap_or(0.0),
        };
        if arch == Arch::Gemma3 {
            hp.gemma3(gguf, &key)?;
        }
        Ok(hp)
    }

    /// Gemma 3 specifics, as llama.cpp's `llama_model_gemma3` reads them.
    fn gemma3(&mut self, gguf: &Gguf, key: &dyn Fn(&str) -> String) -> Result<(), ModelError> {
        self.embd_scale = (self.n_embd as f32).sqrt();
        // Queries are pre-scaled by 1/sqrt(head_dim) (1/sqrt(n_embd/n_head) for the 27B);
        // the attention itself then uses scale 1.
        self.query_scale = if self.n_layer == 62 {
            1.0 / ((self.n_embd / self.n_head) as f32).sqrt()
        } else {
            1.0 / (self.head_dim_k as f32).sqrt()
        };
        self.attn_scale = 1.0;
        self.n_swa = gguf.opt_u32(&key("attention.sliding_window"))?.unwrap_or(0) as usize;
        if self.n_swa > 0 {
            let pattern = match gguf.get(&key("attention.sliding_window_pattern")) {
                Some(baton_gguf::Value::Array(_)) => {
                    let flags = gguf.get_bool_array(&key("attention.sliding_window_pattern"))?;
                    if flags.len() < self.n_layer {
                        return Err(ModelError::BadHParams(format!(
                            "sliding_window_pattern has {} entries for {} layers",
                            flags.len(),
                            self.n_layer
                        )));
                    }
                    self.swa_layers = flags[..self.n_layer].to_vec();
                    None
                }
                _ => Some(gguf.opt_u32(&key("attention.sliding_window_pattern"))?.unwrap_or(6) as usize),
            };
            if let Some(n) = pattern {
                // Every n-th layer is global, the others slide (n = 0: all slide).
                self.swa_layers = (0..self.n_layer).map(|layer| n == 0 || layer % n < n - 1).collect();
            }
            self.rope_swa.freq_base = gguf.opt_f32(&key("rope.freq_base_swa"))?.unwrap_or(10_000.0);
            self.rope_swa.freq_scale = 1.0;
        }
        Ok(())
    }

    /// Width of the key rows of one layer's cache (`head_dim_k * n_head_kv`).
    pub fn n_embd_k_gqa(&self) -> usize {
        self.head_dim_k * self.n_head_kv
    }

    /// Width of the value rows of one layer's cache.
    pub fn n_embd_v_gqa(&self) -> usize {
        self.head_dim_v * self.n_head_kv
    }

    /// Whether layer `layer` uses sliding-window attention.
    pub fn is_swa(&self, layer: usize) -> bool {
        self.n_swa > 0 && self.swa_layers.get(layer).copied().unwrap_or(false)
    }
}
