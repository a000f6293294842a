//! `baton run`: one prompt through an in-process ring.

use std::io::Write;

use baton_node::GenerateRequest;
use baton_sample::SamplingParams;
use clap::Args;

use crate::ring::{ClusterArgs, Ring};
use crate::StageArgs;

/// Arguments of `baton run`.
#[derive(Args, Debug)]
pub struct RunArgs {
    #[command(flatten)]
    stages: StageArgs,
    #[command(flatten)]
    cluster: ClusterArgs,
    /// The prompt (raw text; no chat template is applied).
    #[arg(long, short = 'p', default_value = "The capital of France is")]
    prompt: String,
    /// Tokens to generate.
    #[arg(short = 'n', long = "n-predict", default_value_t = 64)]
    n_predict: usize,
    /// Sampling temperature; 0 is greedy.
    #[arg(long = "temp", default_value_t = 0.0)]
    temperature: f32,
    /// Keep only the K most likely tokens (0: off).
    #[arg(long, default_value_t = 40)]
    top_k: i32,
    /// Keep the smallest set of tokens whose probability reaches P (1: off).
    #[arg(long, default_value_t = 0.95)]
    top_p: f32,
    /// Drop tokens less likely than P times the most likely one (0: off).
    #[arg(long, default_value_t = 0.05)]
    min_p: f32,
    /// Penalise tokens seen in the last 64 (1: off).
    #[arg(long, default_value_t = 1.0)]
    repeat_penalty: f32,
    /// Subtract count × this from seen tokens' logits.
    #[arg(long, default_value_t = 0.0)]
    frequency_penalty: f32,
    /// Subtract this from seen tokens' logits.
    #[arg(long, default_value_t = 0.0)]
    presence_penalty: f32,
    /// Random seed for sampling.
    #[arg(long, short = 's', default_value_t = 0)]
    seed: u64,
    /// Most prompt tokens per forward step.
    #[arg(long, short = 'b', default_value_t = 512)]
    batch_size: usize,
}

/// Runs the prompt and prints the text as it is generated, then timings on stderr.
pub fn run(args: RunArgs) -> anyhow::Result<()> {
    let model_path = &args.stages.model;
    let vocab = crate::load_tokenizer(model_path)?;
    let params = SamplingParams {
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
        min_p: args.min_p,
        repeat_penalty: args.repeat_penalty,
        frequency_penalty: args.frequency_penalty,
        presence_penalty: args.presence_penalty,
        seed: args.seed,
        ..SamplingParams::default()
    };
    params.validate()?;

    let prompt = vocab.tokenize(&args.prompt, true, true)?;
    let started = std::time::Instant::now();
    let mut ring = Ring::start(model_path, &args.stages, &args.cluster, 0)?;
    let ready = started.elapsed();
    let ranges = ring.ranges();
    let req = GenerateRequest {
        seq: 0,
        prompt: &prompt,
        params,
        max_tokens: args.n_predict,
        n_batch: args.batch_size,
        logprobs: false,
    };
    let mut stdout = std::io::stdout().lock();
    print!("{}", args.prompt);
    let mut pending = Vec::new();
    let generation = ring.head().generate(
        &req,
        |t| vocab.is_end_of_generation(t),
        |t| {
            // Pieces may split a UTF-8 character; print only complete text.
            pending.extend(vocab.token_bytes(t, false));
            let valid = match std::str::from_utf8(&pending) {
                Ok(_) => pending.len(),
                Err(e) => e.valid_up_to(),
            };
            let _ = stdout.write_all(&pending[..valid]);
            let _ = stdout.flush();
            pending.drain(..valid);
        },
    )?;
    println!("{}", String::from_utf8_lossy(&pending));

    let resident = ring.head().resident_bytes()?;
    let n_gen = generation.tokens.len();
    eprintln!();
    let split: Vec<String> = ranges.iter().map(|r| format!("{}..{}", r.start, r.end)).collect();
    eprintln!(
        "stages: {}  split: {}  ready in {:.2} s",
        ranges.len(),
        split.join(" "),
        ready.as_secs_f64()
    );
    eprintln!(
        "prompt: {} tokens in {:.3} s ({:.1} tok/s)",
        prompt.len(),
        generation.prompt_time.as_secs_f64(),
        prompt.len() as f64 / generation.prompt_time.as_secs_f64()
    );
    // The first generated token comes with the prompt; the rest each take one step.
    let steps = n_gen.saturating_sub(1);
    eprintln!(
        "generation: {} tokens, {:.1} tok/s",
        n_gen,
        if steps > 0 {
            steps as f64 / generation.gen_time.as_secs_f64()
        } else {
            0.0
        }
    );
    if let Some(why) = ring.plan_why() {
        eprintln!("plan: {why}");
    }
    for (i, bytes) in resident.iter().enumerate() {
        eprintln!(
            "stage {i} ({:?}): resident {:.1} MiB",
            ranges[i],
            *bytes as f64 / (1 << 20) as f64
        );
    }
    Ok(())
}
