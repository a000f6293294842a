//! Stages on an accelerator against libllama on the same device: Vulkan0 by default (in
//! CI: Mesa's lavapipe, `GGML_VK_VISIBLE_DEVICES=0`, see scripts/vulkan-cargo), or the
//! device `BATON_TEST_DEVICE` names (`CUDA0` on a GPU machine, with a build whose
//! backends load at run time: scripts/dyn-cargo, scripts/gpu-check). Built only with an
//! accelerator feature. `BATON_TEST_MODELS` (two paths, comma-separated: a qwen2 and a
//! gemma3 file) replaces the test models where they cannot be fetched.
//!
//! On a GPU the kernels differ from the CPU's, and llama.cpp's graph differs from
//! baton's in small ways (which node runs where when the device lacks an op), so the
//! logits are compared by NMSE, with a bound from the measured worst case
//! (docs/devices.md); the greedy continuations must be identical.
#![cfg(any(feature = "vulkan", feature = "cuda", feature = "dynamic-backends"))]

mod common;

use baton_engine::{GenerateRequest, LocalRing};
use baton_ggml::{Device, LlamaModel};
use baton_model::{ModelFile, Stage, StageConfig, StageSpan};
use baton_sample::{argmax, SamplingParams};
use common::fidelity::reference_n;
use common::{model, nmse, Chain, GEMMA3, PROMPTS, QWEN2};

/// Bound on the NMSE of logits on the device against libllama on the same device
/// (measured: 0, bit-identical, on Vulkan0 and CUDA0; docs/devices.md).
const MAX_DEVICE_NMSE: f64 = 1e-4;

/// Greedy tokens compared per prompt. Fewer than the CPU tests' 32: a token step on
/// lavapipe costs about as much as a CPU step of a model 5x larger, and at 32 this file
/// took 16 minutes of CI's 2 cores.
const N_GREEDY: usize = 12;

/// The accelerator under test: `BATON_TEST_DEVICE`, else Vulkan0.
fn accelerator() -> Device {
    let name = std::env::var("BATON_TEST_DEVICE").unwrap_or_else(|_| "Vulkan0".to_string());
    Device::by_name(&name).unwrap_or_else(|| {
        panic!(
            "no {name} device (devices: {:?}); on a machine without a GPU install lavapipe \
             (scripts/setup-vulkan) and set GGML_VK_VISIBLE_DEVICES=0 (scripts/vulkan-cargo does)",
            Device::all()
        )
    })
}

/// The qwen2 (`0`) or gemma3 (`1`) test model, or its stand-in from `BATON_TEST_MODELS`.
fn test_model(which: usize) -> std::path::PathBuf {
    match std::env::var("BATON_TEST_MODELS") {
        Ok(list) => list.split(',').nth(which).expect("BATON_TEST_MODELS: two paths").into(),
        Err(_) => model([QWEN2, GEMMA3][which]),
    }
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

/// 1 and 2 stages on the device against libllama with every layer on it: logits
/// within [`MAX_DEVICE_NMSE`] and the same argmax; the ring's greedy tokens the same
/// as libllama's. Returns the largest NMSE.
fn check_on_device(which: usize) -> f64 {
    let device = accelerator();
    let path = test_model(which);
    let name = path.file_name().unwrap().to_string_lossy().into_owned();
    let file = ModelFile::open(&path).unwrap();
    let oracle = LlamaModel::load_full_on(&path, true, device).unwrap();
    let n_layer = file.hparams().n_layer;
    let mut worst = 0f64;
    for prompt_text in PROMPTS {
        let prompt = oracle.tokenize(prompt_text, true, true).unwrap();
        let (ref_logits, ref_tokens) = reference_n(&oracle, &prompt, N_GREEDY);
        for n_stages in [1, 2] {
            let ranges = baton_plan::even_split(n_layer, n_stages).unwrap();
            let on_device: Vec<_> = ranges.iter().map(|r| (r.clone(), device)).collect();
            // Chained in this thread: two stages of one device on two threads are refused.
            let mut chain = Chain::load_on(&file, &on_device, &StageConfig::new(512, 2));
            let logits = chain.logits(0, &prompt, 0);
            let err = nmse(&logits, &ref_logits);
            worst = worst.max(err);
            println!("{name} on {device:?}, {n_stages} stage(s), {prompt_text:?}: nmse {err:.3e}");
            assert!(
                err <= MAX_DEVICE_NMSE,
                "{name}, {n_stages} stages on {device:?}, {prompt_text:?}: NMSE {err:e}"
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
            "{name} on {device:?}, {prompt_text:?}:\n ours: {:?}\n llama.cpp: {:?}",
            oracle.detokenize(&tokens, false),
            oracle.detokenize(&ref_tokens, false)
        );
    }
    worst
}

/// Two stages of one accelerator on two threads are refused with the reason.
#[test]
fn two_stages_on_one_device_in_one_ring_are_refused() {
    let device = accelerator();
    let file = ModelFile::open(&test_model(1)).unwrap();
    let n_layer = file.hparams().n_layer;
    let stages = vec![(0..n_layer / 2, device), (n_layer / 2..n_layer, device)];
    let err = LocalRing::start_on(file, &stages, &StageConfig::new(64, 1))
        .err()
        .expect("refused")
        .to_string();
    assert!(
        err.contains(&format!("{device:?} is given more than one stage")),
        "{err}"
    );
}

#[test]
fn qwen2_on_the_device_matches_llama_cpp_on_it() {
    check_on_device(0);
}

#[test]
fn gemma3_on_the_device_matches_llama_cpp_on_it() {
    check_on_device(1);
}

/// A stage on the device then a stage on the CPU (one process, the hidden state handed
/// over in memory): logits close to both references, and the greedy text equal to
/// libllama's on the CPU wherever libllama on the device agrees with it.
#[test]
fn device_then_cpu_stages_match_llama_cpp() {
    let device = accelerator();
    let path = test_model(0);
    let file = ModelFile::open(&path).unwrap();
    let cpu_oracle = LlamaModel::load_full(&path, true).unwrap();
    let dev_oracle = LlamaModel::load_full_on(&path, true, device).unwrap();
    let ranges = baton_plan::even_split(file.hparams().n_layer, 2).unwrap();
    let stages = vec![(ranges[0].clone(), device), (ranges[1].clone(), Device::cpu())];
    for prompt_text in PROMPTS {
        let prompt = cpu_oracle.tokenize(prompt_text, true, true).unwrap();
        let (cpu_logits, cpu_tokens) = reference_n(&cpu_oracle, &prompt, N_GREEDY);
        let (dev_logits, dev_tokens) = reference_n(&dev_oracle, &prompt, N_GREEDY);
        let mut chain = Chain::load_on(&file, &stages, &StageConfig::new(512, 2));
        let logits = chain.logits(0, &prompt, 0);
        let (to_cpu, to_dev) = (nmse(&logits, &cpu_logits), nmse(&logits, &dev_logits));
        let apart = nmse(&dev_logits, &cpu_logits);
        println!(
            "{device:?} + CPU {prompt_text:?}: nmse {to_cpu:.3e} to the CPU, {to_dev:.3e} to {device:?} \
             (libllama on {device:?} to libllama on the CPU: {apart:.3e})"
        );
        assert!(to_cpu <= 1e-2 && to_dev <= 1e-2);
        drop(chain);
        let mut ring = LocalRing::start_on(file.clone(), &stages, &StageConfig::new(512, 1)).unwrap();
        let tokens = greedy(&mut ring, &cpu_oracle, &prompt);
        if dev_tokens == cpu_tokens {
            assert_eq!(tokens, cpu_tokens, "{prompt_text:?}");
        } else {
            println!("{prompt_text:?}: libllama on {device:?} and on the CPU disagree; not compared");
        }
    }
}

/// A stage on the device keeps its weights and KV cache in the device's memory: host
/// memory holds only the embedding rows it read and the CPU's share of the compute
/// buffers.
#[test]
fn stage_memory_is_on_the_device() {
    let device = accelerator();
    let file = ModelFile::open(&test_model(0)).unwrap();
    let layers = 0..file.hparams().n_layer / 2;
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
        "{device:?} stage: device {} B, host {} B, layers {layer_bytes} B, KV {kv} B",
        memory.device, memory.host
    );
    assert_eq!(stage.device(), device);
    assert!(memory.device >= layer_bytes + kv, "{memory:?}");
    assert!(memory.host < layer_bytes / 4, "{memory:?}: weights left on the host");
}

/// Issue 15: a real `baton worker --device <accelerator>,CPU` process offers both
/// devices (each with its memory and measured speed), loads the ranges the head's plan
/// gives them (not an even split of its own), and the ring's text is libllama's on the
/// CPU wherever libllama on the device agrees with it.
#[test]
fn a_worker_process_over_the_device_and_the_cpu() {
    use baton_cluster::{connect_cluster, ClusterOptions};
    use common::worker::{greedy as ring_greedy, WorkerProc};

    const TOKEN: &str = "accelerator-test-secret";
    let device = accelerator();
    let path = test_model(0);
    let devices = format!("{},CPU", device.name());
    let worker = WorkerProc::start(path.parent().unwrap(), Some(TOKEN), &["--device", &devices]);
    let opts = ClusterOptions {
        token: Some(TOKEN.into()),
        n_ctx: 512,
        repack: true,
        ..Default::default()
    };
    let mut ring = connect_cluster(&path, std::slice::from_ref(&worker.addr), &opts).unwrap();
    let offered = &ring.workers[0].caps.devices;
    let names: Vec<&str> = offered.iter().map(|d| d.name.as_str()).collect();
    assert_eq!(names, [device.name().as_str(), "CPU"]);
    assert!(
        offered.iter().all(|d| d.memory > 0 && d.secs_per_layer.is_some()),
        "{offered:?}"
    );
    let stage = ring.plan.stages[0].clone();
    let on: Vec<String> = stage
        .parts
        .iter()
        .map(|p| format!("{} {:?}", names[p.device], p.layers))
        .collect();
    println!("plan: {} ({})", on.join(", "), ring.plan.why);
    let log = worker.log();
    assert!(log.contains(&format!("devices={}", on.join(", "))), "{log}");

    let cpu_oracle = LlamaModel::load_full(&path, true).unwrap();
    let dev_oracle = LlamaModel::load_full_on(&path, true, device).unwrap();
    let prompt = cpu_oracle.tokenize(PROMPTS[0], true, true).unwrap();
    let (_, cpu_tokens) = reference_n(&cpu_oracle, &prompt, N_GREEDY);
    let (_, dev_tokens) = reference_n(&dev_oracle, &prompt, N_GREEDY);
    let tokens = ring_greedy(&mut ring, &prompt, N_GREEDY, &cpu_oracle);
    let on_device = stage.parts.iter().any(|p| p.device == 0);
    if !on_device || dev_tokens == cpu_tokens {
        assert_eq!(tokens, cpu_tokens, "plan {on:?}");
    } else {
        println!("libllama on {device:?} and on the CPU disagree; not compared");
    }
}
