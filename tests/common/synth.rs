//! Synthetic models of every architecture for the end-to-end tests: small random
//! weights, the qwen2 test model's tokenizer cut to 8192 ordinary tokens, quantized by
//! libllama. Made once into the tests' target directory and reused.

use std::path::PathBuf;

use baton_ggml::{FileType, LlamaModel};
use baton_model::Shape;
use baton_synth::SynthSpec;

use super::fidelity::Setup;
use super::{model, PROMPTS, QWEN2};

/// Where the synthetic models are kept (a worker serves this directory).
pub fn synth_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("synth-models")
}

/// The shape every synthetic test model has: 4 layers of width 256 (k-quants apply
/// everywhere), 8 experts of which 2 are used, 1 shared expert and 1 dense leading
/// layer where the architecture has them, a window of 16 where it slides.
pub fn test_shape() -> Shape {
    Shape {
        n_layer: 4,
        n_embd: 256,
        n_head: 4,
        n_head_kv: 2,
        head_dim: 64,
        n_ff: 512,
        n_expert: 8,
        n_expert_used: 2,
        n_ff_exp: 256,
        n_expert_shared: 1,
        n_dense_lead: 1,
        n_swa: 16,
        n_ctx: 4096,
    }
}

/// The synthetic model of `arch` (`mixtral`: llama with experts; `gemma4-moe`: gemma4
/// with experts; `llama`, `mistral3` and `gemma4`: dense) quantized as `file_type`, with [`test_shape`], the spec changed by
/// `edit`.
pub fn synthetic_with(arch: &str, file_type: FileType, edit: impl FnOnce(&mut SynthSpec)) -> PathBuf {
    let mut shape = test_shape();
    if arch == "llama" || arch == "mistral3" || arch == "gemma4" {
        shape.n_expert = 0;
    }
    let name = match arch {
        "mixtral" => "llama",
        "gemma4-moe" => "gemma4",
        other => other,
    };
    let architecture = baton_model::find_architecture(name).unwrap();
    let mut spec = SynthSpec::new(architecture, shape, file_type, model(QWEN2));
    edit(&mut spec);
    baton_synth::cached(&spec, &synth_dir()).unwrap()
}

/// The synthetic model of `arch` with [`test_shape`].
pub fn synthetic(arch: &str, file_type: FileType) -> PathBuf {
    synthetic_with(arch, file_type, |_| {})
}

/// Llama 4's attention chunks are 8192 positions (llama.cpp fixes the size), so its
/// prompts are long: a filler, then each test prompt, 8180, 8200 and 8240 tokens. The
/// first crosses the chunk boundary (and the NoPE layers' first temperature step, at
/// 8191) while decoding its continuation, the others inside the prompt's batch.
pub fn llama4_prompts(oracle: &LlamaModel) -> Vec<(String, Vec<u32>)> {
    let filler_text = PROMPTS.join("\n").repeat(300);
    let filler = oracle.tokenize(&filler_text, true, true).unwrap();
    PROMPTS
        .iter()
        .zip([8180, 8200, 8240])
        .map(|(text, len)| {
            let tail = oracle.tokenize(text, false, true).unwrap();
            let mut prompt = filler[..len - tail.len()].to_vec();
            prompt.extend(tail);
            assert_eq!(prompt.len(), len);
            (format!("{len} tokens ending {text:?}"), prompt)
        })
        .collect()
}

/// Every llama4 prompt in one batch, in a context that holds it and its continuation.
pub const LLAMA4_SETUP: Setup = Setup {
    n_ctx: 8448,
    n_batch: 8448,
    ring_threads: super::fidelity::THREADS,
    kv_types: super::fidelity::SHORT.kv_types,
};
