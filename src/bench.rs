//! `baton bench`: prompt processing (pp) and generation (tg) speed of baton's
//! in-process stages against libllama single-process, in the same run, same threads.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use baton_engine::Head;
use baton_engine::{Draft, DraftMode, EngineConfig, Event, Job};
use baton_ggml::{Device, LlamaContext, LlamaModel};
use baton_model::ModelFile;
use baton_proto::{Payload, StartSeq};
use baton_sample::{argmax, SamplingParams};
use clap::Args;

use crate::draft::DraftArgs;
use crate::ring::{ClusterArgs, Ring};
use crate::StageArgs;

/// Arguments of `baton bench`.
#[derive(Args, Debug)]
pub struct BenchArgs {
    #[command(flatten)]
    stages: StageArgs,
    #[command(flatten)]
    cluster: ClusterArgs,
    /// Prompt tokens for the pp test (one batch).
    #[arg(long, default_value_t = 128)]
    pp: usize,
    /// Tokens generated one at a time for the tg test.
    #[arg(long, default_value_t = 64)]
    tg: usize,
    /// Repetitions of each test (the median is reported); baton and libllama alternate.
    #[arg(long, short = 'r', default_value_t = 3)]
    reps: usize,
    /// Also write the table to this file (Markdown).
    #[arg(long)]
    out: Option<std::path::PathBuf>,
    /// llama.cpp's own `llama-bench` binary, run on the same model with the same threads
    /// for a third column (its compiler flags are llama.cpp's, not ours, so a build
    /// regression on our side shows). Default: bench/peer/build/bin/llama-bench when it
    /// exists (built by bench/peer/setup); `none` to skip.
    #[arg(long)]
    llama_bench: Option<std::path::PathBuf>,
    /// With --draft: also generation on a code-editing chat prompt through the engine,
    /// with and without drafted tokens (greedy; the text must be the same).
    #[command(flatten)]
    draft: DraftArgs,
}

/// A code-editing request (the answer repeats much of the prompt, where prompt lookup
/// drafts hit), as ChatML.
const CODE_EDIT: &str = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHere is a \
Python function:\n\n```python\ndef summarize(orders):\n    total = 0\n    count = 0\n    largest = None\n    for \
order in orders:\n        amount = order[\"amount\"]\n        total = total + amount\n        count = count + 1\n        \
if largest is None or amount > largest:\n            largest = amount\n    average = total / count if count else 0\n    \
return {\"total\": total, \"count\": count, \"largest\": largest, \"average\": average}\n```\n\nRename the variable \
`total` to `revenue` everywhere and return the whole function.<|im_end|>\n<|im_start|>assistant\n";

/// Generation tok/s on [`CODE_EDIT`] through an engine over `ring`'s head, without and
/// with drafts (median of `reps`), and the tokens drafted and kept.
fn bench_drafting(
    ring: &mut Ring,
    model: &Path,
    n_ctx: usize,
    tg: usize,
    reps: usize,
    draft: Draft,
    drafter: Option<Box<dyn baton_engine::Drafter>>,
) -> anyhow::Result<(f64, f64, u64, u64)> {
    let vocab = std::sync::Arc::new(crate::load_tokenizer(model)?);
    let prompt = vocab.tokenize(CODE_EDIT, true, true)?;
    let hp = crate::model_hparams(model)?;
    let config = EngineConfig {
        n_slots: 1,
        slot_ctx: n_ctx,
        chunk: n_ctx,
        n_stages: ring.ranges().len().max(1),
        max_decode_seqs: baton_engine::MAX_DECODE_SEQS,
        max_queue: 1,
        recovery_timeout: Duration::from_secs(30),
        step_timeout: Duration::from_secs(600),
        prefix_reuse: baton_engine::prefix_reuse(&hp),
        max_draft: baton_engine::max_draft(&hp),
        n_embd: hp.n_embd,
    };
    let engine = ring.engine(vocab.clone(), config, |_| Ok(drafter))?;
    let generate = |draft: Draft| -> anyhow::Result<(f64, Vec<u32>)> {
        let (events, mut receiver) = tokio::sync::mpsc::unbounded_channel();
        engine.submit(Job {
            prompt: prompt.clone(),
            params: SamplingParams::greedy(),
            max_tokens: tg,
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
        let (mut first, mut tokens) = (None, Vec::new());
        while let Some(event) = receiver.blocking_recv() {
            match event {
                Event::Token(t) => {
                    first.get_or_insert_with(Instant::now);
                    tokens.push(t.id);
                }
                Event::Finished(_) => break,
                Event::Failed(why) => anyhow::bail!(why),
            }
        }
        let secs = first.map_or(0.0, |f| f.elapsed().as_secs_f64());
        Ok(((tokens.len().saturating_sub(1)) as f64 / secs.max(1e-9), tokens))
    };
    let (mut plain, mut drafted) = (Vec::new(), Vec::new());
    for _ in 0..reps {
        let (rate, off) = generate(Draft::OFF)?;
        plain.push(rate);
        let (rate, on) = generate(draft)?;
        drafted.push(rate);
        anyhow::ensure!(on == off, "drafting changed the text: a bug (please report it)");
    }
    let counters = engine.counters();
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    Ok((
        median(plain),
        median(drafted),
        counters.draft_tokens.load(std::sync::atomic::Ordering::Relaxed),
        counters.draft_accepted.load(std::sync::atomic::Ordering::Relaxed),
    ))
}

/// pp and tg tokens per second measured by llama.cpp's `llama-bench`, one process.
fn peer_llama_bench(
    bin: &Path,
    model: &Path,
    threads: usize,
    accelerator: Option<baton_ggml::Device>,
    pp: usize,
    tg: usize,
    reps: usize,
) -> anyhow::Result<(f64, f64)> {
    let mut cmd = std::process::Command::new(bin);
    match accelerator {
        Some(device) => cmd.args(["-ngl", "999", "-dev", &device.name()]),
        None => cmd.args(["-ngl", "0"]),
    };
    let out = cmd
        .arg("-m")
        .arg(model)
        .args(["-t", &threads.to_string(), "-p", &pp.to_string(), "-n", &tg.to_string()])
        .args(["-r", &reps.to_string(), "-fa", "on", "-o", "json"])
        .output()
        .with_context(|| format!("running {}", bin.display()))?;
    anyhow::ensure!(
        out.status.success(),
        "{} failed: {}",
        bin.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let rows: Vec<serde_json::Value> =
        serde_json::from_slice(&out.stdout).with_context(|| format!("reading {}'s JSON", bin.display()))?;
    let rate = |key: &str| {
        rows.iter()
            .find(|r| r[key].as_u64().is_some_and(|n| n > 0))
            .and_then(|r| r["avg_ts"].as_f64())
            .with_context(|| format!("no {key} row in llama-bench's output"))
    };
    Ok((rate("n_prompt")?, rate("n_gen")?))
}

/// Deterministic pseudo-random token ids (as llama-bench, the content does not matter).
fn tokens(n: usize, n_vocab: usize) -> Vec<u32> {
    let mut state = 0x2545_F491_4F6C_DD1Du64;
    (0..n)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 33) % n_vocab as u64) as u32
        })
        .collect()
}

fn median(mut times: Vec<Duration>) -> Duration {
    times.sort();
    times[times.len() / 2]
}

/// One pp run through the ring: a single batch, the last row sampled.
fn baton_pp(head: &mut Head, prompt: &[u32]) -> anyhow::Result<Duration> {
    head.control(StartSeq::new(0, SamplingParams::greedy(), Vec::new()).into())?;
    let start = Instant::now();
    let positions = (0..prompt.len() as i32).collect();
    head.forward(
        Payload::Tokens(prompt.to_vec()),
        positions,
        vec![0; prompt.len()],
        vec![prompt.len() as u32 - 1],
    )?;
    let elapsed = start.elapsed();
    head.control(baton_proto::Ring::EndSeq { seq: 0 })?;
    Ok(elapsed)
}

/// One tg run through the ring: `n` single-token steps from an empty context, each
/// sampled greedily on the last stage and fed back.
fn baton_tg(head: &mut Head, first: u32, n: usize) -> anyhow::Result<Duration> {
    head.control(StartSeq::new(0, SamplingParams::greedy(), Vec::new()).into())?;
    let start = Instant::now();
    let mut token = first;
    for pos in 0..n {
        let sampled = head.forward(Payload::Tokens(vec![token]), vec![pos as i32], vec![0], vec![0])?;
        token = sampled.first().context("no token sampled")?.token;
    }
    let elapsed = start.elapsed();
    head.control(baton_proto::Ring::EndSeq { seq: 0 })?;
    Ok(elapsed)
}

fn llama_pp(ctx: &mut LlamaContext<'_>, prompt: &[u32]) -> anyhow::Result<Duration> {
    ctx.clear();
    let start = Instant::now();
    let logits = ctx.decode(prompt)?;
    argmax(&logits);
    Ok(start.elapsed())
}

fn llama_tg(ctx: &mut LlamaContext<'_>, first: u32, n: usize) -> anyhow::Result<Duration> {
    ctx.clear();
    let start = Instant::now();
    let mut token = first;
    for _ in 0..n {
        let logits = ctx.decode(&[token])?;
        token = argmax(&logits).context("no logits")?;
    }
    Ok(start.elapsed())
}

/// How the stages run (`", each a tensor-parallel group…"` or nothing) and where
/// (in process, or worker processes over Unix sockets or TCP), for the table's heading.
fn where_stages_run(
    ring: &Ring,
    args: &BenchArgs,
    stage_args: &StageArgs,
    local_devices: &[Device],
) -> (String, String) {
    let place = match ring {
        Ring::Local { .. } => format!("in-process stages on {local_devices:?}"),
        Ring::Remote { .. } | Ring::Supervised { .. } => {
            let unix = |w: &String| matches!(baton_net::Addr::parse(w), Ok(baton_net::Addr::Unix(_)));
            if args.cluster.local_workers.is_some() || args.cluster.workers.iter().all(unix) {
                "worker processes over Unix sockets".to_string()
            } else {
                "worker processes over TCP".to_string()
            }
        }
    };
    let tp = match (ring, stage_args.tp_size(), args.cluster.tp_members.is_empty()) {
        (Ring::Remote { .. } | Ring::Supervised { .. }, _, _) => String::new(),
        (_, 0 | 1, _) => String::new(),
        (_, n, true) => format!(", each a tensor-parallel group of {n} threads"),
        (_, n, false) => format!(", one tensor-parallel group of {n} processes over links"),
    };
    (tp, place)
}

/// The table of rates: baton's, libllama's and llama-bench's tokens per second per test.
fn rate_table(rows: &[(String, f64, f64, Option<f64>)]) -> String {
    let mut table = String::from(
        "| test | baton tok/s | libllama tok/s | llama-bench tok/s | baton / libllama | baton / llama-bench |\n\
         |---|---:|---:|---:|---:|---:|\n",
    );
    for (test, baton, llama, peer) in rows {
        let (peer, ratio) = match peer {
            Some(p) => (format!("{p:.2}"), format!("{:.3}", baton / p)),
            None => ("-".to_string(), "-".to_string()),
        };
        table.push_str(&format!(
            "| {test} | {baton:.2} | {llama:.2} | {peer} | {:.3} | {ratio} |\n",
            baton / llama
        ));
    }
    table
}

/// The drafting rows: greedy generation of a code-editing chat through the engine, without
/// and with the draft `draft` (median of the repetitions).
#[allow(clippy::too_many_arguments)]
fn draft_table(
    ring: &mut Ring,
    args: &BenchArgs,
    path: &Path,
    n_vocab: usize,
    n_ctx: usize,
    threads: usize,
    draft: Draft,
) -> anyhow::Result<String> {
    let reps = args.reps.max(1);
    let repack = !args.stages.no_repack;
    let drafter = args.draft.load_model(n_vocab, 1, n_ctx, n_ctx, threads, repack)?;
    let (plain, drafted, sent, kept) = bench_drafting(ring, path, n_ctx, args.tg, reps, draft, drafter)?;
    Ok(format!(
        "\ncode-editing chat prompt, greedy, through the engine (median of {reps}):\n\n\
         | test | tok/s | vs no draft | drafted | kept |\n|---|---:|---:|---:|---:|\n\
         | tg{tg} no draft | {plain:.2} | 1.000 | | |\n\
         | tg{tg} draft {mode}, up to {max}{fixed} | {drafted:.2} | {:.3} | {sent} | {kept} |\n",
        drafted / plain,
        tg = args.tg,
        mode = draft.mode,
        max = draft.max,
        fixed = if draft.fixed { " (fixed)" } else { "" },
    ))
}

/// Runs both systems and prints the table.
pub fn bench(args: BenchArgs) -> anyhow::Result<()> {
    let path = args.stages.one_model()?;
    let file = ModelFile::open(path).with_context(|| format!("loading {}", path.display()))?;
    let n_vocab = file.hparams().n_vocab;
    drop(file);
    let draft = args.draft.settings()?;
    // Room for the code-editing prompt (about 250 tokens) and its answer when drafting.
    let spec_ctx = if draft.mode == DraftMode::Off { 0 } else { 512 + args.tg };
    let n_ctx = (args.pp.max(args.tg) + 16).max(spec_ctx).next_power_of_two();
    let mut stage_args = args.stages.clone();
    stage_args.ctx_size = Some(n_ctx);
    let threads = match args.cluster.local_workers {
        Some(n) => stage_args.threads_for(n),
        None => stage_args.threads(),
    };
    let prompt = tokens(args.pp.max(1), n_vocab);
    let reps = args.reps.max(1);

    let started = Instant::now();
    let mut ring = Ring::start(path, &stage_args, &args.cluster, 0)?;
    let ready = started.elapsed();
    let ranges = ring.ranges();
    // libllama and llama-bench compute where baton's stages do when every stage is on one
    // accelerator (all layers offloaded to it); otherwise on the CPU.
    let local_devices = match &ring {
        Ring::Local { .. } => stage_args.stage_devices(ranges.len())?,
        _ => Vec::new(),
    };
    let accelerator = local_devices
        .first()
        .copied()
        .filter(|d| !d.is_cpu() && local_devices.iter().all(|e| e == d));
    let oracle = match accelerator {
        Some(device) => LlamaModel::load_full_on(path, !args.stages.no_repack, device)?,
        None => LlamaModel::load_full(path, !args.stages.no_repack)?,
    };
    // libllama caches keys and values as the stages do (llama.cpp's -ctk/-ctv).
    let types = stage_args.kv_types();
    let mut ctx = LlamaContext::with_cache_types(
        &oracle,
        n_ctx as u32,
        args.pp.max(1) as u32,
        threads,
        [types.k.dtype(), types.v.dtype()],
    )?;

    // Warm-up: fault in the weights of both and size the compute buffers.
    baton_pp(ring.head()?, &prompt)?;
    llama_pp(&mut ctx, &prompt)?;

    let (mut b_pp, mut l_pp, mut b_tg, mut l_tg) = (vec![], vec![], vec![], vec![]);
    for _ in 0..reps {
        b_pp.push(baton_pp(ring.head()?, &prompt)?);
        l_pp.push(llama_pp(&mut ctx, &prompt)?);
        b_tg.push(baton_tg(ring.head()?, prompt[0], args.tg)?);
        l_tg.push(llama_tg(&mut ctx, prompt[0], args.tg)?);
    }
    drop(ctx);
    drop(oracle);
    let peer_bin = match &args.llama_bench {
        Some(bin) if bin.as_os_str() == "none" => None,
        Some(bin) => Some(bin.clone()),
        None => Some(std::path::PathBuf::from("bench/peer/build/bin/llama-bench")).filter(|p| p.exists()),
    };
    let peer = match &peer_bin {
        Some(bin) => Some(peer_llama_bench(
            bin,
            path,
            threads,
            accelerator,
            args.pp,
            args.tg,
            reps,
        )?),
        None => None,
    };
    let rate = |n: usize, t: Duration| n as f64 / t.as_secs_f64();
    let rows = [
        (
            format!("pp{}", args.pp),
            rate(args.pp, median(b_pp)),
            rate(args.pp, median(l_pp)),
            peer.map(|p| p.0),
        ),
        (
            format!("tg{}", args.tg),
            rate(args.tg, median(b_tg)),
            rate(args.tg, median(l_tg)),
            peer.map(|p| p.1),
        ),
    ];

    let model_name = path
        .file_name()
        .map_or_else(|| path.display().to_string(), |n| n.to_string_lossy().into_owned());
    let split: Vec<String> = ranges.iter().map(|r| format!("{}..{}", r.start, r.end)).collect();
    let (tp, place) = where_stages_run(&ring, &args, &stage_args, &local_devices);
    let mut table = format!(
        "model: {model_name}\nstages: {} ({}){tp}, {place}, {threads} thread(s) per stage (member), ready in {:.2} s; \
         libllama: 1 process, {threads} thread(s), on {}, built as {}; llama-bench: {}; median of {reps}\n\n",
        ranges.len(),
        split.join(" "),
        ready.as_secs_f64(),
        accelerator.map_or("the CPU".to_string(), |d| format!("{d:?} (every layer)")),
        baton_ggml::LLAMA_BUILD_TYPE,
        peer_bin
            .as_ref()
            .map_or("not run (bench/peer/setup builds it)".to_string(), |b| format!(
                "{}, 1 process, {threads} thread(s), mean of {reps}",
                b.display()
            )),
    );
    if let Some(why) = ring.plan_why() {
        table.push_str(&format!("plan: {why}\n\n"));
    }
    table.push_str(&rate_table(&rows));
    if draft.mode != DraftMode::Off {
        table.push_str(&draft_table(&mut ring, &args, path, n_vocab, n_ctx, threads, draft)?);
    }
    print!("{table}");
    if let Some(out) = &args.out {
        std::fs::write(out, &table).with_context(|| format!("writing {}", out.display()))?;
    }
    Ok(())
}
