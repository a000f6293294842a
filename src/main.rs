//! The `baton` binary: parses arguments, starts things, nothing else.

mod bench;
mod cert;
mod devices;
mod draft;
mod invite;
mod local_workers;
mod ring;
mod run;
mod serve;
mod status;
mod synth;
mod token;
mod tp_member;
mod worker;

use std::path::{Path, PathBuf};

use anyhow::Context as _;
use clap::{Args, Parser, Subcommand};

/// Distributed inference for GGUF language models.
#[derive(Parser)]
#[command(name = "baton", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run a prompt through N in-process stages and print the generated text.
    Run(run::RunArgs),
    /// Compare baton's stages with libllama single-process (prompt and generation speed).
    Bench(bench::BenchArgs),
    /// Serve the OpenAI-compatible API, computing on in-process stages or workers.
    Serve(serve::ServeArgs),
    /// Serve stages of a cluster: load the layers a head asks for, join its ring.
    Worker(worker::WorkerArgs),
    /// Be member 1.. of a tensor-parallel group across processes (member 0 is
    /// `baton run|bench|serve --tp N --tp-members ...`).
    TpMember(tp_member::TpMemberArgs),
    /// Make a cluster certificate for TLS on every link (cluster.crt, cluster.key).
    Cert(cert::CertArgs),
    /// Write a synthetic model of any supported architecture (random weights, a real
    /// tokenizer, quantized by libllama), for tests and benchmarks.
    Synth(synth::SynthArgs),
    /// List the devices stages can compute on (CPU, GPUs), with their memory.
    Devices(devices::DevicesArgs),
    /// Show what a running `baton serve` is doing: its ring's stages, memory, link
    /// round trips, tokens per second, and the workers that joined or were lost.
    Status(status::StatusArgs),
    /// Print a one-time code with which a worker on any network that reaches this
    /// head's API joins the cluster (`baton worker --join CODE`), no token copied.
    Invite(invite::InviteArgs),
}

/// How the model is split into in-process stages.
#[derive(Args, Clone, Debug)]
pub struct StageArgs {
    /// GGUF model file. `baton serve` takes several (repeat --model): each model gets its
    /// own plan over the same workers, and requests choose one by their `model` field.
    #[arg(long, short = 'm', default_value = "models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf")]
    pub model: Vec<PathBuf>,
    /// Number of stages (layers are split evenly unless --split is given).
    #[arg(long, default_value_t = 2)]
    pub stages: usize,
    /// Layers per stage, e.g. 8,8,8 (overrides the even split). With workers: layers per
    /// node in order, the head first unless --no-head-stage; 0 leaves a node out.
    #[arg(long)]
    pub split: Option<String>,
    /// CPU threads per stage (default: the machine's cores divided among the stages).
    #[arg(long, short = 't')]
    pub threads: Option<usize>,
    /// KV cache cells per stage, shared by `baton serve`'s --parallel sequences.
    /// Default: the model's trained context for each sequence when the memory of the
    /// nodes holds it (each worker's --memory or free memory, this process's
    /// --head-memory or available memory, with the cache type chosen), else the most
    /// that fits (a multiple of 256 per sequence). A size given that does not fit is
    /// refused with the numbers.
    #[arg(long, short = 'c')]
    pub ctx_size: Option<usize>,
    /// Read every weight straight from the mapped file instead of copying the ones ggml
    /// can repack into faster layouts (llama.cpp's `--no-repack`).
    #[arg(long)]
    pub no_repack: bool,
    /// Element type of the cached keys, on every stage of the ring (llama.cpp's
    /// `-ctk`): f32, f16, bf16, q8_0, q4_0, q4_1, iq4_nl, q5_0, q5_1.
    #[arg(long, visible_alias = "ctk", default_value = "f16", value_parser = parse_cache_type)]
    pub cache_type_k: baton_model::CacheType,
    /// Element type of the cached values (llama.cpp's `-ctv`), as --cache-type-k.
    #[arg(long, visible_alias = "ctv", default_value = "f16", value_parser = parse_cache_type)]
    pub cache_type_v: baton_model::CacheType,
    /// Members of each stage's tensor-parallel group: each holds a slice of every layer
    /// of the stage (heads, FFN, vocabulary) and they gather their slices four times per
    /// layer. In this process, members are threads; with --workers or --local-workers,
    /// workers taken in order N at a time, each group one pipeline stage. `auto` (with
    /// workers): the planner chooses N and the split from the workers' speed and memory
    /// and the measured links, and says why (docs/tensor-parallel.md).
    #[arg(long, default_value = "1", value_parser = parse_tp)]
    pub tp: baton_plan::TpDegree,
    /// Devices of the in-process stages, in order, e.g. Vulkan0,CPU (`baton devices`
    /// lists them): one per stage; stages past the end of the list go to the CPU when it
    /// is last. Default: the accelerators, one stage each, then the CPU. With workers,
    /// the devices of the head's own stage (default: the first accelerator, else the
    /// CPU), each given a layer range by the plan like a worker's devices.
    #[arg(long, value_delimiter = ',')]
    pub device: Vec<String>,
}

/// `--cache-type-k`, `--cache-type-v`: a type llama.cpp's `-ctk` accepts.
fn parse_cache_type(s: &str) -> Result<baton_model::CacheType, String> {
    baton_model::CacheType::parse(s).map_err(|e| e.to_string())
}

/// `--tp`: a group size of 1 or more, or `auto`.
fn parse_tp(s: &str) -> Result<baton_plan::TpDegree, String> {
    match s {
        "auto" => Ok(baton_plan::TpDegree::Auto),
        _ => match s.parse::<usize>() {
            Ok(n) if (1..=baton_proto::MAX_TP_MEMBERS).contains(&n) => Ok(baton_plan::TpDegree::Fixed(n)),
            _ => Err(format!(
                "'{s}' is neither a group size from 1 to {} nor auto",
                baton_proto::MAX_TP_MEMBERS
            )),
        },
    }
}

impl StageArgs {
    /// The model of a command that runs one.
    pub fn one_model(&self) -> anyhow::Result<&Path> {
        match self.model.as_slice() {
            [one] => Ok(one),
            _ => anyhow::bail!("this command runs one model: give --model once (baton serve takes several)"),
        }
    }

    /// Threads per stage.
    pub fn threads(&self) -> usize {
        self.threads_for(self.stages * self.tp_size())
    }

    /// Element types of the cached keys and values.
    pub fn kv_types(&self) -> baton_model::KvTypes {
        baton_model::KvTypes {
            k: self.cache_type_k,
            v: self.cache_type_v,
        }
    }

    /// Members of each in-process group (1 for `--tp auto`, which only workers take).
    pub fn tp_size(&self) -> usize {
        match self.tp {
            baton_plan::TpDegree::Fixed(n) => n.max(1),
            baton_plan::TpDegree::Auto => 1,
        }
    }

    /// Whether the stages are split into tensor-parallel groups (or may be: `auto`).
    pub fn tp_wanted(&self) -> bool {
        self.tp != baton_plan::TpDegree::Fixed(1)
    }

    /// Threads per stage when `n` stages share this machine.
    pub fn threads_for(&self, n: usize) -> usize {
        self.threads.unwrap_or_else(|| {
            let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
            (cores / n.max(1)).max(1)
        })
    }

    /// The device of each of `n` in-process stages (see `--device`).
    pub fn stage_devices(&self, n: usize) -> anyhow::Result<Vec<baton_ggml::Device>> {
        let given = baton_ggml::Device::parse_list(&self.device)?;
        assign_devices(&given, &baton_ggml::Device::all(), n)
    }

    /// The layer range of each stage.
    pub fn ranges(&self, n_layers: usize) -> anyhow::Result<Vec<std::ops::Range<usize>>> {
        Ok(match &self.split {
            Some(split) => baton_plan::parse_split(split, n_layers)?,
            None => baton_plan::even_split(n_layers, self.stages)?,
        })
    }
}

/// Devices for `n` stages: `given` in order (stages past its end go to its last device
/// when that is the CPU); without `given`, the accelerators of `available` one stage
/// each, then the CPU. A device other than the CPU takes one stage (see
/// `baton_engine::LocalRing::start_on`).
fn assign_devices(
    given: &[baton_ggml::Device],
    available: &[baton_ggml::Device],
    n: usize,
) -> anyhow::Result<Vec<baton_ggml::Device>> {
    let cpu = baton_ggml::Device::cpu();
    let mut devices: Vec<baton_ggml::Device> = if given.is_empty() {
        available.iter().copied().filter(|d| !d.is_cpu()).take(n).collect()
    } else {
        given.to_vec()
    };
    anyhow::ensure!(
        devices.len() <= n,
        "--device names {} devices for {n} stages (give --stages {})",
        devices.len(),
        devices.len()
    );
    let fill = match devices.last() {
        _ if given.is_empty() => cpu,
        Some(last) if last.is_cpu() => cpu,
        _ if devices.len() == n => cpu,
        Some(last) => anyhow::bail!(
            "--device names {} devices for {n} stages, and {last:?} can take only one (a device \
             other than the CPU computes one stage per process): name one per stage, or end \
             the list with CPU",
            devices.len()
        ),
        None => cpu,
    };
    devices.resize(n, fill);
    Ok(devices)
}

fn main() -> std::process::ExitCode {
    // Before anything else: code compiled for a newer CPU than this one would die with
    // `Illegal instruction` somewhere inside; say which instruction set is missing.
    baton_ggml::cpu::require_instruction_sets();
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_env("BATON_LOG").unwrap_or_else(|_| "warn".into()))
        .with_writer(std::io::stderr)
        // Colour codes only for a person at a terminal, not in files and pipes.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Run(args) => run::run(args),
        Command::Bench(args) => bench::bench(args),
        Command::Serve(args) => serve::serve(args),
        Command::Worker(args) => worker::worker(args),
        Command::TpMember(args) => tp_member::tp_member(args),
        Command::Cert(args) => cert::cert(args),
        Command::Synth(args) => synth::synth(args),
        Command::Devices(args) => devices::devices(args),
        Command::Status(args) => status::status(args),
        Command::Invite(args) => invite::invite(args),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", error_chain(&e));
            std::process::ExitCode::FAILURE
        }
    }
}

/// Checks `path` with baton's own GGUF reader (missing file, not a GGUF, truncated,
/// unsupported architecture: each said plainly), then loads its tokenizer through
/// libllama.
/// The hyper-parameters of the model at `path` (what the engine's limits depend on).
pub fn model_hparams(path: &Path) -> anyhow::Result<baton_model::HParams> {
    let file = baton_model::ModelFile::open(path)?;
    Ok(file.hparams().clone())
}

pub fn load_tokenizer(path: &Path) -> anyhow::Result<baton_ggml::LlamaModel> {
    let file = baton_model::ModelFile::open(path)?;
    let vocab = baton_ggml::LlamaModel::load_vocab(path)
        .with_context(|| format!("loading the tokenizer of {}", path.display()))?;
    // Every id the tokenizer can produce must have an embedding row, and every logit a
    // token: a file where they disagree would index outside a tensor or a table.
    let rows = file.hparams().n_vocab;
    anyhow::ensure!(
        vocab.n_vocab() == rows,
        "{}: the tokenizer has {} tokens but the token embedding has {rows} rows",
        path.display(),
        vocab.n_vocab()
    );
    Ok(vocab)
}

/// An error and its causes on one line, each cause once: errors that already print their
/// source (thiserror's `{source}`) would otherwise repeat it
/// ("Connection refused (os error 111): Connection refused (os error 111)").
fn error_chain(error: &anyhow::Error) -> String {
    let mut text = String::new();
    for cause in error.chain() {
        let cause = cause.to_string();
        if text.contains(&cause) {
            continue;
        }
        if !text.is_empty() {
            text.push_str(": ");
        }
        text.push_str(&cause);
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stages_past_the_device_list_go_to_the_cpu() {
        let cpu = baton_ggml::Device::cpu();
        assert_eq!(assign_devices(&[], &[cpu], 3).unwrap(), vec![cpu; 3]);
        assert_eq!(assign_devices(&[cpu], &[cpu], 2).unwrap(), vec![cpu; 2]);
        let err = assign_devices(&[cpu, cpu, cpu], &[cpu], 2).unwrap_err().to_string();
        assert!(err.contains("3 devices for 2 stages"), "{err}");
    }

    #[test]
    fn error_chains_name_each_cause_once() {
        let io = std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
        let inner = baton_net::NetError::Io {
            peer: "w:1".into(),
            source: io,
        };
        let error = anyhow::Error::new(inner).context("starting the ring");
        let text = error_chain(&error);
        assert_eq!(text.matches("refused").count(), 1, "{text}");
        assert!(
            text.starts_with("starting the ring: I/O error on the link to w:1"),
            "{text}"
        );
    }
}
