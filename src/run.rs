//! `baton run`: one prompt through an in-process ring.

use std::io::Write;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use baton_engine::GenerateRequest;
use baton_engine::{Draft, DraftMode, EngineConfig, Event, Job};
use baton_sample::SamplingParams;
use clap::Args;

use crate::draft::DraftArgs;
use crate::ring::{ClusterArgs, Ring};
use crate::StageArgs;

/// Arguments of `baton run`.
#[derive(Args, Debug)]
pub struct RunArgs {
    #[command(flatten)]
    stages: StageArgs,
    #[command(flatten)]
    cluster: ClusterArgs,
    #[command(flatten)]
    draft: DraftArgs,
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
    let model_path = args.stages.one_model()?;
    let vocab = std::sync::Arc::new(crate::load_tokenizer(model_path)?);
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
    let draft = args.draft.settings()?;
    let started = std::time::Instant::now();
    // One sequence with a region of its own: sliding-window layers then keep a window
    // and one batch of rows (`baton_model::HParams::window_cells`), which takes
    // batches of at most `DEFAULT_UBATCH` rows; a larger -b keeps a cell per token.
    let n_seq = usize::from(args.batch_size <= baton_model::DEFAULT_UBATCH);
    let mut ring = Ring::start(model_path, &args.stages, &args.cluster, n_seq)?;
    let ready = started.elapsed();
    let ranges = ring.ranges();
    let mut stdout = std::io::stdout().lock();
    print!("{}", args.prompt);
    let mut pending = Vec::new();
    let mut print = |t: u32| {
        // Pieces may split a UTF-8 character; print only complete text.
        pending.extend(vocab.token_bytes(t, false));
        let valid = match std::str::from_utf8(&pending) {
            Ok(_) => pending.len(),
            Err(e) => e.valid_up_to(),
        };
        let _ = stdout.write_all(&pending[..valid]);
        let _ = stdout.flush();
        pending.drain(..valid);
    };
    let generated = if draft.mode == DraftMode::Off {
        let req = GenerateRequest {
            seq: 0,
            prompt: &prompt,
            params,
            max_tokens: args.n_predict,
            n_batch: args.batch_size,
            logprobs: false,
        };
        // A token id outside the vocabulary (a faulty or hostile last stage) ends the
        // generation before libllama sees it: its lookups throw across the C boundary.
        let n_vocab = vocab.n_vocab();
        let outside = std::cell::Cell::new(None);
        let is_end = |t: u32| {
            if t as usize >= n_vocab {
                outside.set(Some(t));
                return true;
            }
            vocab.is_end_of_generation(t)
        };
        let generation = ring.head()?.generate(&req, is_end, &mut print)?;
        if let Some(t) = outside.get() {
            anyhow::bail!("the last stage sampled token {t}, outside the vocabulary of {n_vocab}");
        }
        let resident = ring.head()?.resident_bytes()?;
        Generated {
            n_tokens: generation.tokens.len(),
            prompt_time: generation.prompt_time,
            gen_time: generation.gen_time,
            resident,
            drafts: None,
        }
    } else {
        generate_drafting(&mut ring, &args, &vocab, prompt.clone(), params, draft, &mut print)?
    };
    println!("{}", String::from_utf8_lossy(&pending));

    let resident = &generated.resident;
    let n_gen = generated.n_tokens;
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
        generated.prompt_time.as_secs_f64(),
        prompt.len() as f64 / generated.prompt_time.as_secs_f64()
    );
    // The first generated token comes with the prompt; the rest each take one step.
    let steps = n_gen.saturating_sub(1);
    eprintln!(
        "generation: {} tokens, {:.1} tok/s",
        n_gen,
        if steps > 0 {
            steps as f64 / generated.gen_time.as_secs_f64()
        } else {
            0.0
        }
    );
    if let Some((sent, kept)) = generated.drafts {
        eprintln!("drafts: {sent} tokens drafted, {kept} kept");
    }
    if let Some(why) = ring.plan_why() {
        eprintln!("plan: {why}");
    }
    if let Some(stages) = ring.describe_stages() {
        eprintln!("stages: {}", stages.join("; "));
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

/// What a generation produced, however it ran.
struct Generated {
    n_tokens: usize,
    prompt_time: Duration,
    gen_time: Duration,
    /// Each stage's resident bytes.
    resident: Vec<u64>,
    /// Tokens drafted and kept, when drafting.
    drafts: Option<(u64, u64)>,
}

/// Runs the prompt through the engine (which drafts), printing tokens as they come.
fn generate_drafting(
    ring: &mut Ring,
    args: &RunArgs,
    vocab: &std::sync::Arc<baton_ggml::LlamaModel>,
    prompt: Vec<u32>,
    params: SamplingParams,
    draft: Draft,
    print: &mut dyn FnMut(u32),
) -> anyhow::Result<Generated> {
    let slot_ctx = ring.n_ctx().context("a ring formed by `baton run` knows its context")?;
    anyhow::ensure!(
        prompt.len() + args.n_predict <= slot_ctx,
        "the prompt ({} tokens) and -n {} do not fit the context of {slot_ctx} tokens (--ctx-size)",
        prompt.len(),
        args.n_predict
    );
    let repack = !args.stages.no_repack;
    let chunk = args.batch_size.max(1);
    let hp = crate::model_hparams(args.stages.one_model()?)?;
    let config = EngineConfig {
        n_slots: 1,
        slot_ctx,
        chunk,
        n_stages: ring.ranges().len().max(1),
        max_decode_seqs: baton_engine::MAX_DECODE_SEQS,
        max_queue: 1,
        recovery_timeout: Duration::from_secs(30),
        step_timeout: Duration::from_secs(600),
        prefix_reuse: baton_engine::prefix_reuse(&hp),
        max_draft: baton_engine::max_draft(&hp),
        n_embd: hp.n_embd,
    };
    let (draft_args, n_vocab, threads) = (args.draft.clone(), vocab.n_vocab(), args.stages.threads());
    let drafter = move |slot_ctx| draft_args.load_model(n_vocab, 1, slot_ctx, chunk, threads, repack);
    let engine = ring.engine(vocab.clone(), config, drafter)?;
    let (events, mut receiver) = tokio::sync::mpsc::unbounded_channel();
    let started = Instant::now();
    engine.submit(Job {
        prompt,
        params,
        max_tokens: args.n_predict,
        logprobs: false,
        top_logprobs: 0,
        stop: Vec::new(),
        draft,
        grammar: None,
        budget: None,
        show: Vec::new(),
        end: None,
        pooling: None,
        events,
    })?;
    let mut first = None;
    let mut n_tokens = 0;
    while let Some(event) = receiver.blocking_recv() {
        match event {
            Event::Token(token) => {
                first.get_or_insert_with(Instant::now);
                n_tokens += 1;
                print(token.id);
            }
            Event::Finished(_) => break,
            Event::Failed(why) => anyhow::bail!(why),
        }
    }
    let done = Instant::now();
    let first = first.unwrap_or(done);
    let counters = engine.counters();
    let drafts = (
        counters.draft_tokens.load(Ordering::Relaxed),
        counters.draft_accepted.load(Ordering::Relaxed),
    );
    let stats = tokio::runtime::Builder::new_current_thread()
        .build()?
        .block_on(engine.stage_stats())
        .map_err(|e| anyhow::anyhow!(e))?;
    Ok(Generated {
        n_tokens,
        prompt_time: first - started,
        gen_time: done - first,
        resident: stats.ring.resident,
        drafts: Some(drafts),
    })
}
