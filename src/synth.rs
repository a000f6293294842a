//! `baton synth`: write a synthetic model of any supported architecture (random
//! weights, a real tokenizer, quantized by libllama) for tests and benchmarks.

use std::path::PathBuf;

use anyhow::Context as _;
use baton_ggml::FileType;
use baton_model::Shape;
use baton_synth::{synthesize, SynthSpec, Value};
use clap::Args;

/// Arguments of `baton synth`.
#[derive(Args, Debug)]
pub struct SynthArgs {
    /// Architecture (`general.architecture`), one of those `baton` runs.
    #[arg(long)]
    arch: String,
    /// Where to write the GGUF.
    #[arg(long, short = 'o')]
    out: PathBuf,
    /// File type: F32, Q8_0, Q4_K_M or MXFP4_MOE (experts in MXFP4, the rest Q8_0).
    #[arg(long, default_value = "Q4_K_M")]
    quant: String,
    /// GGUF whose tokenizer the model gets.
    #[arg(long, default_value = "models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf")]
    tokenizer: PathBuf,
    /// Keep only this many ordinary tokens of the tokenizer (its special tokens stay);
    /// 0 keeps the whole vocabulary.
    #[arg(long, default_value_t = 8192)]
    vocab: usize,
    /// Transformer layers.
    #[arg(long, default_value_t = 4)]
    layers: usize,
    /// Hidden size (a multiple of 256 lets k-quants apply everywhere).
    #[arg(long, default_value_t = 256)]
    embd: usize,
    /// Query heads.
    #[arg(long, default_value_t = 4)]
    heads: usize,
    /// Key/value heads.
    #[arg(long, default_value_t = 2)]
    kv_heads: usize,
    /// Dimension of each head.
    #[arg(long, default_value_t = 64)]
    head_dim: usize,
    /// Inner size of dense feed-forward blocks.
    #[arg(long, default_value_t = 512)]
    ff: usize,
    /// Routed experts per MoE layer (for llama: 0 makes a dense model).
    #[arg(long, default_value_t = 8)]
    experts: usize,
    /// Experts each token uses.
    #[arg(long, default_value_t = 2)]
    experts_used: usize,
    /// Inner size of each expert.
    #[arg(long, default_value_t = 256)]
    expert_ff: usize,
    /// Shared experts (architectures that have them).
    #[arg(long, default_value_t = 1)]
    shared_experts: usize,
    /// Dense layers before the MoE layers (architectures that have them).
    #[arg(long, default_value_t = 1)]
    dense_lead: usize,
    /// Sliding-window size (architectures with sliding-window layers).
    #[arg(long, default_value_t = 16)]
    swa: usize,
    /// Context length written in the metadata.
    #[arg(long, default_value_t = 4096)]
    ctx: usize,
    /// Seed of the weights.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Write a separate output projection instead of reusing the token embedding.
    #[arg(long)]
    untied: bool,
    /// Also write the tensors the architecture takes when present but real files
    /// usually lack (llama's biases, glm4moe's q/k norms, ...).
    #[arg(long)]
    optional_tensors: bool,
    /// A metadata key of the architecture set to a value (`attn_res.block_size=0`:
    /// integers as u32, decimals as f32, `true`/`false` as booleans, integers separated
    /// by commas as an array of u32, e.g. deepseek4's
    /// `attention.compress_ratios=0,4,128,4,4` with a ratio per layer and one for the
    /// prediction layer), over the example's; repeatable.
    #[arg(long = "key", value_name = "NAME=VALUE")]
    keys: Vec<String>,
}

/// `NAME=VALUE` → the full key (`{arch}.NAME`) and its typed value.
fn parse_key(arch: &str, text: &str) -> anyhow::Result<(String, Value)> {
    let (name, value) = text
        .split_once('=')
        .with_context(|| format!("--key {text}: expected NAME=VALUE"))?;
    let value = if let Ok(n) = value.parse::<u32>() {
        Value::U32(n)
    } else if let Some(list) = value
        .contains(',')
        .then(|| value.split(',').map(|v| v.parse::<u32>().map(Value::U32)).collect())
        .and_then(Result::ok)
    {
        Value::Array(list)
    } else if let Ok(x) = value.parse::<f32>() {
        Value::F32(x)
    } else if let Ok(b) = value.parse::<bool>() {
        Value::Bool(b)
    } else {
        anyhow::bail!(
            "--key {text}: the value is not an integer, a number, true/false or integers separated by commas"
        );
    };
    Ok((format!("{arch}.{name}"), value))
}

/// Writes the model.
pub fn synth(args: SynthArgs) -> anyhow::Result<()> {
    let arch = baton_model::find_architecture(&args.arch)?;
    let file_type = FileType::from_name(&args.quant).with_context(|| {
        let names: Vec<&str> = FileType::ALL.iter().map(|t| t.name()).collect();
        format!("unknown --quant {}; one of {}", args.quant, names.join(", "))
    })?;
    let shape = Shape {
        n_layer: args.layers,
        n_embd: args.embd,
        n_head: args.heads,
        n_head_kv: args.kv_heads,
        head_dim: args.head_dim,
        n_ff: args.ff,
        n_expert: args.experts,
        n_expert_used: args.experts_used,
        n_ff_exp: args.expert_ff,
        n_expert_shared: args.shared_experts,
        n_dense_lead: args.dense_lead,
        n_swa: args.swa,
        n_ctx: args.ctx,
    };
    let spec = SynthSpec {
        vocab: (args.vocab > 0).then_some(args.vocab),
        seed: args.seed,
        tied_output: !args.untied,
        optional_tensors: args.optional_tensors,
        keys: args
            .keys
            .iter()
            .map(|k| parse_key(arch.name, k))
            .collect::<anyhow::Result<_>>()?,
        ..SynthSpec::new(arch, shape, file_type, args.tokenizer)
    };
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let n_vocab = synthesize(&spec, &args.out, threads)?;
    let size = std::fs::metadata(&args.out)?.len();
    println!(
        "{}: {} {} with {n_vocab} tokens, {size} bytes",
        args.out.display(),
        arch.name,
        file_type.name()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_take_scalars_and_lists_of_integers() {
        let key = |text| parse_key("deepseek4", text).map_err(|e| e.to_string());
        assert_eq!(
            key("attention.compress_ratios=0,4,128").unwrap(),
            (
                "deepseek4.attention.compress_ratios".to_string(),
                Value::Array(vec![Value::U32(0), Value::U32(4), Value::U32(128)])
            )
        );
        assert_eq!(key("hash_layer_count=2").unwrap().1, Value::U32(2));
        assert_eq!(key("expert_weights_norm=true").unwrap().1, Value::Bool(true));
        assert!(key("attention.compress_ratios=0,x")
            .unwrap_err()
            .contains("integers separated by commas"));
    }
}
