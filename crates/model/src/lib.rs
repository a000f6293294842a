//! Models as stages: hyper-parameters from GGUF metadata, one graph builder per
//! architecture, partial loading of a layer range, and a KV cache per stage.
#![deny(unsafe_code)]

mod arch;
mod hparams;
mod kv;
mod resident;
mod stage;
mod weights;

#[cfg(test)]
mod tests;

use std::path::PathBuf;

pub use hparams::{Arch, HParams};
pub use kv::{AttnSpan, KvCache};
pub use resident::mapped_rss;
pub use stage::{Batch, Stage, StageConfig, StageInput, StageOutput};
pub use weights::{stage_tensor_sources, LayerTensors, LayerWeights, ModelFile, StageSpan, StageWeights};

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
    #[error("unsupported model architecture '{0}' (baton runs llama, mistral, qwen2, qwen3, gemma3)")]
    UnsupportedArch(String),
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
}
