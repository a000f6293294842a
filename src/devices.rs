//! `baton devices`: the devices this binary can compute on, with their memory, the CPU
//! code ggml runs here (its variant, its features, AMX), and optionally a check that a
//! one-stage generation on this machine gives libllama's greedy text.

use std::path::PathBuf;

use anyhow::Context as _;
use baton_engine::{GenerateRequest, LocalRing};
use baton_ggml::{cpu, Device, DeviceKind, LlamaContext, LlamaModel};
use baton_model::{ModelFile, StageConfig};
use baton_sample::{argmax, SamplingParams};
use clap::Args;

/// Arguments of `baton devices`.
#[derive(Args, Clone, Debug)]
pub struct DevicesArgs {
    /// Also generate greedily from this model in one stage on the CPU and with libllama,
    /// and fail unless the texts are the same (checks this machine's CPU code, AMX
    /// included, against llama.cpp's).
    #[arg(long, value_name = "MODEL")]
    check: Option<PathBuf>,
    /// Prompt of the check.
    #[arg(long, default_value = "The capital of France is")]
    prompt: String,
    /// Tokens the check generates.
    #[arg(short = 'n', long, default_value_t = 16)]
    n_predict: usize,
}

/// Prints one line per device, in the order `--device` defaults to, then the CPU code.
pub fn devices(args: DevicesArgs) -> anyhow::Result<()> {
    let mib = |bytes: u64| bytes as f64 / (1 << 20) as f64;
    println!(
        "{:<10} {:<14} {:>12} {:>12}  DESCRIPTION",
        "DEVICE", "KIND", "FREE MiB", "TOTAL MiB"
    );
    for device in Device::all() {
        let memory = device.memory();
        let kind = match device.kind() {
            DeviceKind::Cpu => "cpu",
            DeviceKind::Gpu => "gpu",
            DeviceKind::IntegratedGpu => "integrated gpu",
            DeviceKind::Other => "other",
        };
        println!(
            "{:<10} {:<14} {:>12.0} {:>12.0}  {}",
            device.name(),
            kind,
            mib(memory.free),
            mib(memory.total),
            device.description()
        );
    }
    let backends: Vec<&str> = std::iter::once("CPU")
        .chain(baton_ggml::BACKENDS.iter().copied())
        .collect();
    println!("backends in this binary: {}", backends.join(", "));
    let vulkan_devices = Device::all().iter().filter(|d| d.name().starts_with("Vulkan")).count();
    if baton_ggml::BACKENDS.contains(&"Vulkan") && vulkan_devices == 0 {
        println!(
            "no Vulkan device: ggml skips CPU-type Vulkan devices (Mesa's lavapipe) unless \
             GGML_VK_VISIBLE_DEVICES lists them, e.g. GGML_VK_VISIBLE_DEVICES=0"
        );
    }
    print_cpu_code();
    match &args.check {
        Some(model) => check(model, &args),
        None => Ok(()),
    }
}

/// Which CPU code ggml runs here and whether AMX is in use.
fn print_cpu_code() {
    match cpu::cpu_backend_library() {
        Some(library) => {
            let variant = library
                .trim_start_matches("libggml-cpu-")
                .trim_end_matches(".so")
                .to_string();
            let how = match std::env::var("BATON_CPU_VARIANT") {
                Ok(_) => "forced by BATON_CPU_VARIANT",
                Err(_) => "the best of the variants beside the program for this CPU",
            };
            println!("CPU variant: {variant} ({library}, {how})");
        }
        None => println!("CPU variant: linked in (compiled for this build's target CPU)"),
    }
    let features: Vec<String> = cpu::cpu_backend_features()
        .into_iter()
        .filter_map(|f| f.strip_suffix("=1").map(str::to_string))
        .collect();
    println!("CPU features ggml uses: {}", features.join(" "));
    let compiler = format!(
        "llama.cpp compiled by {}; tile configuration {}",
        cpu::LLAMA_CXX_COMPILER,
        cpu::AMX_TILE_CONFIG
    );
    let amx = if cpu::amx_in_use() {
        format!("used ({compiler})")
    } else if cpu::cpu_has_amx() {
        format!(
            "not used: this CPU has AMX, this build's CPU code has no AMX kernels or the \
             kernel refused the tile state ({compiler})"
        )
    } else {
        "not on this CPU".to_string()
    };
    println!("AMX: {amx}");
}

/// Greedy text of one baton stage (all layers, CPU, repacking on) against libllama's.
fn check(path: &std::path::Path, args: &DevicesArgs) -> anyhow::Result<()> {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let oracle = LlamaModel::load_full(path, true).with_context(|| format!("loading {}", path.display()))?;
    let prompt = oracle.tokenize(&args.prompt, true, true)?;
    let mut ctx = LlamaContext::new(&oracle, 512, 512, threads)?;
    let mut reference = Vec::new();
    let mut next = argmax(&ctx.decode(&prompt)?).context("no logits")?;
    while reference.len() < args.n_predict && !oracle.is_end_of_generation(next) {
        reference.push(next);
        next = argmax(&ctx.decode(&[next])?).context("no logits")?;
    }
    drop(ctx);

    let file = ModelFile::open(path)?;
    let n_layer = file.hparams().n_layer;
    let mut ring = LocalRing::start(
        file,
        std::slice::from_ref(&(0..n_layer)),
        &StageConfig::new(512, threads),
    )?;
    let req = GenerateRequest {
        seq: 0,
        prompt: &prompt,
        params: SamplingParams::greedy(),
        max_tokens: args.n_predict,
        n_batch: 512,
        logprobs: false,
    };
    let head = ring.head().context("the ring has no head")?;
    let generation = head.generate(&req, |t| oracle.is_end_of_generation(t), |_| {})?;
    let ours = oracle.detokenize(&generation.tokens, false);
    let theirs = oracle.detokenize(&reference, false);
    println!("baton (1 stage):  {}{}", args.prompt, ours.escape_debug());
    println!("libllama:         {}{}", args.prompt, theirs.escape_debug());
    anyhow::ensure!(
        generation.tokens == reference,
        "baton's greedy tokens differ from libllama's: {:?} vs {:?}",
        generation.tokens,
        reference
    );
    println!("check: same {} greedy tokens as libllama", reference.len());
    Ok(())
}
