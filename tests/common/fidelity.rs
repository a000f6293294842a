//! The comparison every architecture passes: baton's stages against libllama on the
//! same file, last-token logits and greedy continuations.

use std::path::Path;

use baton_engine::{GenerateRequest, LocalRing};
use baton_ggml::{LlamaContext, LlamaModel};
use baton_model::{CacheType, KvTypes, ModelFile, StageConfig};
use baton_sample::{argmax, SamplingParams};

use super::{nmse, Chain, PROMPTS};

/// Bound on the logits' normalised mean squared error (see docs/fidelity.md for the
/// numbers behind it).
pub const MAX_NMSE: f64 = 1e-6;
/// Tokens of each greedy continuation.
pub const N_GREEDY: usize = 32;

/// libllama's last-token logits of `prompt` and up to [`N_GREEDY`] greedy tokens.
pub fn reference(oracle: &LlamaModel, prompt: &[u32]) -> (Vec<f32>, Vec<u32>) {
    reference_n(oracle, prompt, N_GREEDY)
}

/// The context size of a comparison, and the batch its prompts are computed in
/// (both sides compute each prompt as one batch, so it bounds the prompts).
#[derive(Clone, Copy, Debug)]
pub struct Setup {
    pub n_ctx: usize,
    pub n_batch: usize,
    /// Threads of each stage of the in-process ring: [`THREADS`] where a decode step
    /// attends over 512 cells or more; below that the count changes no bit, and one
    /// thread keeps two tests side by side from oversubscribing CI's two cores (ggml's
    /// threads spin while they wait).
    pub ring_threads: usize,
    /// Element types of the KV cache, on both sides (llama.cpp's `-ctk`/`-ctv`).
    pub kv_types: KvTypes,
}

/// CPU threads of libllama's context and of baton's stages. The same on both sides:
/// a decode step over 512 cached cells or more splits the cells among the threads
/// (ggml's split-KV flash attention), and its sums then round by the thread count.
pub const THREADS: usize = 2;

/// What the comparisons use unless a model needs longer prompts.
pub const SHORT: Setup = Setup {
    n_ctx: 512,
    n_batch: 512,
    ring_threads: 1,
    kv_types: KvTypes {
        k: CacheType::F16,
        v: CacheType::F16,
    },
};

/// libllama's last-token logits of `prompt` and up to `n` greedy tokens.
pub fn reference_n(oracle: &LlamaModel, prompt: &[u32], n: usize) -> (Vec<f32>, Vec<u32>) {
    reference_in(oracle, prompt, n, SHORT)
}

/// [`reference_n`] in a context of `setup`.
pub fn reference_in(oracle: &LlamaModel, prompt: &[u32], n: usize, setup: Setup) -> (Vec<f32>, Vec<u32>) {
    let types = [setup.kv_types.k.dtype(), setup.kv_types.v.dtype()];
    let mut ctx =
        LlamaContext::with_cache_types(oracle, setup.n_ctx as u32, setup.n_batch as u32, THREADS, types).unwrap();
    let logits = ctx.decode(prompt).unwrap();
    let mut tokens = Vec::new();
    let mut next = argmax(&logits).unwrap();
    while tokens.len() < n && !oracle.is_end_of_generation(next) {
        tokens.push(next);
        next = argmax(&ctx.decode(&[next]).unwrap()).unwrap();
    }
    (logits, tokens)
}

/// 1, 2 and 3 in-process stages on the model at `path`, every prompt: logits within
/// [`MAX_NMSE`] of libllama's and the same argmax, and the ring's greedy tokens equal
/// to libllama's. Returns the largest NMSE seen.
pub fn check_stages(path: &Path, label: &str) -> f64 {
    check_stages_with(path, label, &[1, 2, 3])
}

/// [`check_stages`] with `stage_counts` stages.
pub fn check_stages_with(path: &Path, label: &str, stage_counts: &[usize]) -> f64 {
    let oracle = LlamaModel::load_vocab(path).unwrap();
    let prompts: Vec<(String, Vec<u32>)> = PROMPTS
        .iter()
        .map(|text| (format!("{text:?}"), oracle.tokenize(text, true, true).unwrap()))
        .collect();
    check_prompts(path, label, stage_counts, &prompts, SHORT)
}

/// [`check_stages_with`] on `prompts` (a label and the tokens of each) in contexts of
/// `setup`.
pub fn check_prompts(
    path: &Path,
    label: &str,
    stage_counts: &[usize],
    prompts: &[(String, Vec<u32>)],
    setup: Setup,
) -> f64 {
    let file = ModelFile::open(path).unwrap();
    let oracle = LlamaModel::load_full(path, true).unwrap();
    let n_layer = file.hparams().n_layer;
    let mut worst = 0f64;
    for (prompt_text, prompt) in prompts {
        assert!(prompt.len() <= setup.n_batch, "{label}: a prompt longer than its batch");
        let (ref_logits, ref_tokens) = reference_in(&oracle, prompt, N_GREEDY, setup);
        for &n_stages in stage_counts {
            let ranges = baton_plan::even_split(n_layer, n_stages).unwrap();
            let stage_config = StageConfig {
                kv_types: setup.kv_types,
                ..StageConfig::new(setup.n_ctx, 2)
            };
            let mut chain = Chain::load_with(&file, &ranges, &stage_config);
            let logits = chain.logits(0, prompt, 0);
            let err = nmse(&logits, &ref_logits);
            worst = worst.max(err);
            println!("{label} {n_stages} stage(s) {prompt_text}: nmse {err:.3e}");
            assert!(
                err <= MAX_NMSE,
                "{label}, {n_stages} stages, prompt {prompt_text}: NMSE {err:e} > {MAX_NMSE:e}"
            );
            assert_eq!(argmax(&logits), argmax(&ref_logits));

            let config = StageConfig {
                kv_types: setup.kv_types,
                ..StageConfig::new(setup.n_ctx, setup.ring_threads)
            };
            let mut ring = LocalRing::start(file.clone(), &ranges, &config).unwrap();
            let req = GenerateRequest {
                seq: 0,
                prompt,
                params: SamplingParams::greedy(),
                max_tokens: N_GREEDY,
                n_batch: setup.n_batch,
                logprobs: false,
            };
            let generation = ring
                .head()
                .unwrap()
                .generate(&req, |t| oracle.is_end_of_generation(t), |_| {})
                .unwrap();
            assert_eq!(
                generation.tokens,
                ref_tokens,
                "{label}, {n_stages} stages, prompt {prompt_text}:\n ours: {:?}\n llama.cpp: {:?}",
                oracle.detokenize(&generation.tokens, false),
                oracle.detokenize(&ref_tokens, false)
            );
        }
    }
    worst
}
