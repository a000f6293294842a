//! Models as stages: hyper-parameters from GGUF metadata, one graph builder per
//! architecture, partial loading of a layer range, and a KV cache per stage.
#![deny(unsafe_code)]

mod arch;
mod cache_type;
mod chain;
pub mod example;
mod group;
mod hparams;
mod kv;
pub mod names;
mod pool;
mod recurrent;
mod resident;
mod runner;
mod stage;
mod tensors;
pub mod tp;
mod tp_group;
mod weights;

#[cfg(test)]
mod tests;

use std::path::PathBuf;

pub use arch::hyper::{self, Head as HyperHead, Hyper};
pub use arch::moe::{Gating, MoeParams};
pub use arch::{find as find_architecture, supported_names, Architecture, Shape, ARCHITECTURES};
pub use cache_type::{CacheType, KvTypes, UnknownCacheType};
pub use chain::StageChain;
pub use group::StageGroup;
pub use hparams::{
    AttnTemp, Dsv4, HParams, Indexer, Keys, KimiK3, Mla, Msa, Ssm, SsmKind, SwaType, TpHeads, Window, Yarn,
};
pub use kv::{AttnSpan, KvCache, Slots, DEFAULT_UBATCH};
pub use names::{EndTensor, LayerTensor};
pub use pool::mean_rows;
pub use recurrent::{RecurrentCache, StateRun, CHECKPOINTS, KEPT_STATES};
pub use resident::mapped_rss;
pub use runner::ComputeBytes;
pub use stage::{
    one_row_per_sequence, Batch, LogitReply, RowBest, Stage, StageConfig, StageInput, StageMemory, StageOutput,
};
pub use tensors::{Dim, Presence, Split, TensorKind, TensorSpec, Use};
pub use tp::{Collective, CollectiveError, LocalGroup, TpSplit};
pub use tp_group::{decode_best, encode_best, join_logits, splits as tp_splits, GroupMember};
pub use weights::{stage_tensor_sources, LayerTensors, ModelFile, StageSpan, StageWeights};

/// Every tensor of a whole model of `hp` as its architecture lists them (both ends and
/// every layer), optional ones included; `in_file(name)` answers for tensors that
/// come in alternative forms (fused or separate). What `baton synth` writes from.
pub fn model_tensors(hp: &HParams, in_file: &dyn Fn(&str) -> bool) -> Vec<TensorSpec> {
    let mut specs = tensors::ends(hp, true, true, in_file);
    for layer in 0..hp.n_layer {
        let has = |name: &str| in_file(&format!("blk.{layer}.{name}"));
        specs.extend(tensors::layer(hp, layer, &has));
    }
    specs.extend(arch::prediction_layer_tensors(hp));
    specs
}

/// Everything that can go wrong loading or running a stage.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// The model file could not be read.
    #[error("cannot read model file {path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    /// The file is not a well-formed GGUF.
    #[error(transparent)]
    Gguf(#[from] baton_gguf::GgufError),
    /// The GGUF's architecture is not one baton implements.
    #[error("unsupported model architecture '{name}' (baton runs: {supported})")]
    UnsupportedArch { name: String, supported: String },
    /// A layer tensor the architecture does not use: computing without it would not
    /// give what llama.cpp computes.
    #[error("tensor '{tensor}' is not part of baton's {arch} architecture; refusing to compute without it")]
    UnknownTensor { tensor: String, arch: &'static str },
    /// Hyper-parameters are inconsistent.
    #[error("bad hyper-parameters: {0}")]
    BadHParams(String),
    /// A tensor the stage needs is not in the file.
    #[error("tensor '{0}' is missing from the model file")]
    MissingTensor(String),
    /// A tensor has another shape than the hyper-parameters imply.
    #[error("tensor '{tensor}' has shape {found:?}, expected {expected:?}")]
    WrongShape {
        tensor: String,
        expected: Vec<i64>,
        found: Vec<i64>,
    },
    /// A tensor's type is one ggml cannot compute with here.
    #[error("tensor '{tensor}' has type {dtype}; baton needs {expected} there")]
    UnsupportedType {
        tensor: String,
        dtype: String,
        expected: &'static str,
    },
    /// The stage configuration is invalid.
    #[error("bad stage configuration: {0}")]
    BadConfig(String),
    /// A batch is malformed.
    #[error("bad batch: {0}")]
    BadBatch(String),
    /// The KV cache has no room.
    #[error("KV cache is full: {need} cells needed, {free} free of {capacity} (raise --ctx-size)")]
    CacheFull { need: usize, free: usize, capacity: usize },
    /// ggml failed.
    #[error(transparent)]
    Ggml(#[from] baton_ggml::GgmlError),
    /// What was asked is valid but this stage does not compute it.
    #[error("{0} is not supported")]
    Unsupported(String),
    /// A tensor-parallel sum failed (a member or its link).
    #[error(transparent)]
    Collective(#[from] tp::CollectiveError),
}
