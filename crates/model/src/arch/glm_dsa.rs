//! GLM-5 (`glm-dsa`): DeepSeek V3.2's layer (MLA with DeepSeek sparse attention, see
//! [`deepseek32`](super::deepseek32) and [`dsa`](super::dsa)) with llama.cpp's
//! differences for GLM: the indexer rotates consecutive pairs (not NeoX halves), its
//! key norm has no epsilon (GLM's loader sets none), the experts default to sigmoid
//! gating, no YaRN log multiplier is read; and GLM-5.2's shared indexer layers, which
//! reuse the previous full layer's choice of tokens (`attention.indexer.types`, or
//! llama.cpp's default pattern for models trained on 1M-token contexts).

use baton_gguf::Value;

use super::moe::Gating;
use super::{deepseek2, deepseek32, dsa, Architecture, LayerSizes, Rope, Shape};
use crate::hparams::{HParams, Keys};
use crate::ModelError;

pub static ARCH: Architecture = Architecture {
    name: "glm-dsa",
    aliases: &[],
    rope: Rope::Norm,
    rope_freqs: None,
    own_output: false,
    layer_sizes: LayerSizes::Uniform,
    hparams,
    tensors: deepseek32::tensors,
    layer: deepseek32::layer,
    embed: super::ends::embed,
    logits: super::ends::logits,
    example,
};

/// GLM-5 and 5.1 (trained on fewer than 1M tokens of context) have an indexer in every
/// layer unless the file says otherwise.
const SHARED_INDEXERS_FROM_CTX: usize = 1_048_576;

/// As `llama_model_glm_dsa::load_arch_hparams` reads them.
fn hparams(hp: &mut HParams, keys: &Keys<'_>) -> Result<(), ModelError> {
    deepseek2::read_hparams(hp, keys, "glm-dsa")?;
    // Neither read by llama.cpp's glm-dsa.
    hp.attn_temp = None;
    hp.yarn.log_mul = 0.0;
    if keys.opt_u32("expert_gating_func")?.unwrap_or(0) == 0 {
        hp.moe.gating = Gating::Sigmoid;
    }
    let n = hp.n_layer;
    let full_layers = match keys.opt_per_layer_u32("attention.indexer.types", n)? {
        Some(types) => types.iter().map(|&t| t != 0).collect(),
        None if hp.n_ctx_train < SHARED_INDEXERS_FROM_CTX => vec![true; n],
        // llama.cpp's GLM-5.2 default: layers 0, 1 and every 4th from 2 have their own
        // indexer (for its 78 layers; none after).
        None => (0..n).map(|l| l < 78 && (l < 2 || (l - 2) % 4 == 0)).collect(),
    };
    dsa::read_indexer(hp, keys, Rope::Norm.mode(), 0.0, full_layers, None)
}

/// deepseek32's example without a gating function (sigmoid by default) and, with 4
/// layers or more, a shared indexer in layer 1 (reusing layer 0's choice): every even
/// split into 2 or 3 stages starts its stages at layers with their own indexer.
fn example(shape: &Shape) -> Vec<(&'static str, Value)> {
    let mut keys = deepseek2::example(shape);
    keys.retain(|(key, _)| !key.starts_with("attention.temperature") && *key != "expert_gating_func");
    keys.extend(dsa::example());
    if shape.n_layer >= 4 {
        let types = (0..shape.n_layer).map(|l| Value::U32(u32::from(l != 1))).collect();
        keys.push(("attention.indexer.types", Value::Array(types)));
    }
    keys
}
