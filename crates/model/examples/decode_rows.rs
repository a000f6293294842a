//! What one batch of decode rows costs on one CPU stage holding a whole model, against
//! as many one-row steps: a token with the tokens drafted after it (rows of one
//! sequence, a verify step of speculative decoding), and one row each of several
//! sequences (concurrent requests). Every row gets the bits of its step alone
//! (`Builder::mm`); this measures what that costs. Used by bench/decode-rows.
//!
//! Usage: decode_rows MODEL [THREADS] [REPS] [--no-repack]

use std::time::Instant;

use baton_ggml::Device;
use baton_model::{Batch, LogitReply, ModelFile, Stage, StageConfig, StageInput, StageSpan, DEFAULT_UBATCH};

/// Sequences prefilled; the most rows measured.
const SEQS: usize = 32;
/// Prompt tokens per sequence before the measured steps.
const PROMPT: usize = 64;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let path = args
        .first()
        .expect("usage: decode_rows MODEL [THREADS] [REPS] [--no-repack]");
    let number = |i: usize, default: usize| args.get(i).and_then(|a| a.parse().ok()).unwrap_or(default);
    let (threads, reps) = (number(1, 2), number(2, 5));
    let repack = !args.iter().any(|a| a == "--no-repack");
    let file = ModelFile::open(std::path::Path::new(path)).expect("the model opens");
    let config = StageConfig {
        n_ctx: SEQS * (PROMPT + 32),
        n_threads: threads,
        repack,
        n_seq: SEQS,
        kv_types: Default::default(),
        n_ubatch: DEFAULT_UBATCH,
    };
    let span = StageSpan {
        layers: 0..file.hparams().n_layer,
        first: true,
        last: true,
    };
    let mut stage = Stage::load_on(file, span, &config, Device::cpu()).expect("the stage loads");
    for seq in 0..SEQS as u32 {
        let tokens: Vec<u32> = (0..PROMPT as u32).map(|i| 200 + 13 * i + seq).collect();
        let positions: Vec<i32> = (0..PROMPT as i32).collect();
        run(&mut stage, &tokens, &positions, &vec![seq; PROMPT], false);
    }
    // The median time of `reps` runs of one batch, each undone after.
    let mut time = |tokens: &[u32], positions: &[i32], seqs: &[u32]| {
        let mut times: Vec<f64> = (0..reps + 1)
            .map(|_| {
                let start = Instant::now();
                run(&mut stage, tokens, positions, seqs, true);
                let took = start.elapsed().as_secs_f64() * 1e3;
                for &seq in seqs {
                    stage.truncate_seq(seq, PROMPT);
                }
                took
            })
            .skip(1)
            .collect();
        times.sort_by(f64::total_cmp);
        times[times.len() / 2]
    };
    let one = time(&[500], &[PROMPT as i32], &[0]);
    println!(
        "Repacking {}: one row {one:.1} ms ({:.1} tokens/s).",
        if repack { "on" } else { "off" },
        1e3 / one
    );
    println!();
    println!(
        "| rows | one sequence (token + drafts) ms | / rows x one row | as many sequences ms | / rows x one row | \
         sequences tokens/s |"
    );
    println!("|---:|---:|---:|---:|---:|---:|");
    for rows in [2usize, 4, 8, 9, 16, 32] {
        let tokens: Vec<u32> = (0..rows as u32).map(|i| 500 + 7 * i).collect();
        let along: Vec<i32> = (0..rows as i32).map(|i| PROMPT as i32 + i).collect();
        let drafts = time(&tokens, &along, &vec![0; rows]);
        let seqs: Vec<u32> = (0..rows as u32).collect();
        let company = time(&tokens, &vec![PROMPT as i32; rows], &seqs);
        let ratio = |ms: f64| ms / (rows as f64 * one);
        println!(
            "| {rows} | {drafts:.1} | {:.2} | {company:.1} | {:.2} | {:.1} |",
            ratio(drafts),
            ratio(company),
            rows as f64 * 1e3 / company
        );
    }
}

/// One batch through the stage, logits of every row when `decode` (decode rows), of the
/// last otherwise (a prompt).
fn run(stage: &mut Stage, tokens: &[u32], positions: &[i32], seq_ids: &[u32], decode: bool) {
    let rows: Vec<u32> = if decode {
        (0..tokens.len() as u32).collect()
    } else {
        vec![tokens.len() as u32 - 1]
    };
    let batch = Batch {
        input: StageInput::Tokens(tokens),
        positions,
        seq_ids,
        logit_rows: &rows,
        decode,
    };
    stage.forward(&batch, LogitReply::Logits).expect("the batch computes");
}
