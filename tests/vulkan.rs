//! Stages on a Vulkan device against libllama on the same device (in CI: Mesa's
//! lavapipe, `GGML_VK_VISIBLE_DEVICES=0`, see scripts/vulkan-cargo). Built only with
//! `--features vulkan`.
//!
//! On a GPU the kernels differ from the CPU's, and llama.cpp's graph differs from
//! baton's in small ways (which node runs where when the device lacks an op), so the
//! logits are compared by NMSE, with a bound from the measured worst case
//! (docs/devices.md); the greedy continuations must be identical.
#![cfg(feature = "vulkan")]

mod common;

use baton_ggml::{Device, LlamaContext, LlamaModel};
use baton_model::{ModelFile, Stage, StageConfig, StageSpan};
use baton_node::{GenerateRequest, LocalRing};
use baton_sample::{argmax, SamplingParams};
use common::{model, nmse, Chain, GEMMA3, PROMPTS, QWEN2};

/// Bound on the NMSE of logits on Vulkan0 against libllama on Vulkan0 (measured: 0,
/// bit-identical; docs/devices.md).
const MAX_VULKAN_NMSE: f64 = 1e-4;

/// Greedy tokens compared per prompt. Fewer than the CPU tests' 32: a token step on
/// lavapipe costs about as much as a CPU step of a model 5x larger, and at 32 this file
/// took 16 minutes of CI's 2 cores.
const N_GREEDY: usize = 12;

fn vulkan0() -> Device {
    Device::by_name("Vulkan0").unwrap_or_else(|| {
        panic!(
            "no Vulkan0 device (devices: {:?}); on a machine without a GPU install lavapipe \
             (scripts/setup-vulkan) and set GGML_VK_VISIBLE_DEVICES=0 (scripts/vulkan-cargo does)",
            Device::all()
        )
    })
}

/// libllama's last-token logits and greedy tokens, every layer on `device`.
fn reference_on(oracle: &LlamaModel, prompt: &[u32]) -> (Vec<f32>, Vec<u32>) {
    let mut ctx = LlamaContext::new(oracle, 512, 512, 2).unwrap();
    let logits = ctx.decode(prompt).unwrap();
    let mut tokens = Vec::new();
    let mut next = argmax(&logits).unwrap();
    while tokens.len() < N_GREEDY && !oracle.is_end_of_generation(next) {
        tokens.push(next);
        next = argmax(&ctx.decode(&[next]).unwrap()).unwrap();
    }
    (logits, tokens)
}

fn greedy(ring: &mut LocalRing, oracle: &LlamaModel, prompt: &[u32]) -> Vec<u32> {
    let req = GenerateRequest {
        seq: 0,
        prompt,
        params: SamplingParams::greedy(),
        max_tokens: N_GREEDY,
        n_batch: 512,
        logprobs: false,
    };
    let head = ring.head().unwrap();
    head.generate(&req, |t| oracle.is_end_of_generation(t), |_| {})
        .unwrap()
        .tokens
}

/// 1 and 2 stages on Vulkan0 against libllama with every layer on Vulkan0: logits
/// within [`MAX_VULKAN_NMSE`] and the same argmax; the ring's greedy tokens the same
/// as libllama's. Returns the largest NMSE.
fn check_on_vulkan(name: &str) -> f64 {
    let device = vulkan0();
    let path = model(name);
    let file = ModelFile::open(&path).unwrap();
    let oracle = LlamaModel::load_full_on(&path, true, device).unwrap();
    let n_layer = file.hparams().n_layer;
    let mut worst = 0f64;
    for prompt_text in PROMPTS {
        let prompt = oracle.tokenize(prompt_text, true, true).unwrap();
        let (ref_logits, ref_tokens) = reference_on(&oracle, &prompt);
        for n_stages in [1, 2] {
            let ranges = baton_plan::even_split(n_layer, n_stages).unwrap();
            let on_vulkan: Vec<_> = ranges.iter().map(|r| (r.clone(), device)).collect();
            // Chained in this thread: two stages of one device on two threads are refused.
            let mut chain = Chain::load_on(&file, &on_vulkan, &StageConfig::new(512, 2));
            let logits = chain.logits(0, &prompt, 0);
            let err = nmse(&logits, &ref_logits);
            worst = worst.max(err);
            println!("{name} on Vulkan0, {n_stages} stage(s), {prompt_text:?}: nmse {err:.3e}");
            assert!(
                err <= MAX_VULKAN_NMSE,
                "{name}, {n_stages} stages on Vulkan0, {prompt_text:?}: NMSE {err:e}"
            );
            assert_eq!(argmax(&logits), argmax(&ref_logits));
        }
        // The ring: one stage per device and process (see `LocalRing::start_on`).
        let whole = vec![(0..n_layer, device)];
        let mut ring = LocalRing::start_on(file.clone(), &whole, &StageConfig::new(512, 1)).unwrap();
        let tokens = greedy(&mut ring, &oracle, &prompt);
        assert_eq!(
            tokens,
            ref_tokens,
            "{name} on Vulkan0, {prompt_text:?}:\n ours: {:?}\n llama.cpp: {:?}",
            oracle.detokenize(&tokens, false),
            oracle.detokenize(&ref_tokens, false)
        );
    }
    worst
}

/// Two stages of one accelerator on two threads are refused with the reason.
#[test]
fn two_stages_on_one_vulkan_device_in_one_ring_are_refused() {
    let device = vulkan0();
    let file = ModelFile::open(&model(GEMMA3)).unwrap();
    let stages = vec![(0..9, device), (9..18, device)];
    let err = LocalRing::start_on(file, &stages, &StageConfig::new(64, 1))
        .err()
        .expect("refused")
        .to_string();
    assert!(err.contains("Vulkan0 is given more than one stage"), "{err}");
}

#[test]
fn qwen2_on_vulkan_matches_llama_cpp_on_vulkan() {
    check_on_vulkan(QWEN2);
}

#[test]
fn gemma3_on_vulkan_matches_llama_cpp_on_vulkan() {
    check_on_vulkan(GEMMA3);
}

/// A stage on Vulkan0 then a stage on the CPU (one process, the hidden state handed
/// over in memory): logits close to both references, and the greedy text equal to
/// libllama's on the CPU wherever libllama on Vulkan0 agrees with it.
#[test]
fn vulkan_then_cpu_stages_match_llama_cpp() {
    let device = vulkan0();
    let path = model(QWEN2);
    let file = ModelFile::open(&path).unwrap();
    let cpu_oracle = LlamaModel::load_full(&path, true).unwrap();
    let vk_oracle = LlamaModel::load_full_on(&path, true, device).unwrap();
    let ranges = baton_plan::even_split(file.hparams().n_layer, 2).unwrap();
    let stages = vec![(ranges[0].clone(), device), (ranges[1].clone(), Device::cpu())];
    for prompt_text in PROMPTS {
        let prompt = cpu_oracle.tokenize(prompt_text, true, true).unwrap();
        let (cpu_logits, cpu_tokens) = reference_on(&cpu_oracle, &prompt);
        let (vk_logits, vk_tokens) = reference_on(&vk_oracle, &prompt);
        let mut chain = Chain::load_on(&file, &stages, &StageConfig::new(512, 2));
        let logits = chain.logits(0, &prompt, 0);
        let (to_cpu, to_vk) = (nmse(&logits, &cpu_logits), nmse(&logits, &vk_logits));
        let apart = nmse(&vk_logits, &cpu_logits);
        println!(
            "Vulkan0 + CPU {prompt_text:?}: nmse {to_cpu:.3e} to the CPU, {to_vk:.3e} to Vulkan0 \
             (libllama on Vulkan0 to libllama on the CPU: {apart:.3e})"
        );
        assert!(to_cpu <= 1e-2 && to_vk <= 1e-2);
        drop(chain);
        let mut ring = LocalRing::start_on(file.clone(), &stages, &StageConfig::new(512, 1)).unwrap();
        let tokens = greedy(&mut ring, &cpu_oracle, &prompt);
        if vk_tokens == cpu_tokens {
            assert_eq!(tokens, cpu_tokens, "{prompt_text:?}");
        } else {
            println!("{prompt_text:?}: libllama on Vulkan0 and on the CPU disagree; not compared");
        }
    }
}

/// A stage on Vulkan0 keeps its weights and KV cache in the device's memory: host
/// memory holds only the embedding rows it read and the CPU's share of the compute
/// buffers.
#[test]
fn vulkan_stage_memory_is_on_the_device() {
    let device = vulkan0();
    let file = ModelFile::open(&model(QWEN2)).unwrap();
    let layers = 0..12;
    let layer_bytes: u64 = layers.clone().map(|l| file.layer_bytes(l)).sum();
    let span = StageSpan {
        layers,
        first: true,
        last: false,
    };
    let mut config = StageConfig::new(1024, 2);
    config.repack = true;
    let stage = Stage::load_on(file.clone(), span, &config, device).unwrap();
    let memory = stage.memory();
    let kv = stage.kv().bytes() as u64;
    println!(
        "Vulkan0 stage: device {} B, host {} B, layers {layer_bytes} B, KV {kv} B",
        memory.device, memory.host
    );
    assert_eq!(stage.device(), device);
    assert!(memory.device >= layer_bytes + kv, "{memory:?}");
    assert!(memory.host < layer_bytes / 4, "{memory:?}: weights left on the host");
}
