//! Per-token cost of the sampler on vocabulary-sized rows. Prints a table; run with
//! `cargo run --release -p baton-sample --example bench`.

use std::hint::black_box;
use std::time::Instant;

use baton_sample::{argmax, Sampler, SamplingParams};

/// Logits shaped like a language model's: mostly a broad bulk, a few strong tokens.
fn row(n_vocab: usize, seed: u64) -> Vec<f32> {
    let mut state = seed | 1;
    (0..n_vocab)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            // Sum of uniforms: roughly normal, sd ≈ 2.
            let bulk: f32 = (0..4).map(|i| ((state >> (i * 16)) & 0xffff) as f32 / 65536.0).sum();
            let spike = if state.is_multiple_of(20_000) { 12.0 } else { 0.0 };
            (bulk - 2.0) * 3.5 + spike
        })
        .collect()
}

fn time_per_call(iterations: usize, mut call: impl FnMut()) -> f64 {
    call();
    let start = Instant::now();
    for _ in 0..iterations {
        call();
    }
    start.elapsed().as_secs_f64() * 1e6 / iterations as f64
}

fn main() {
    let penalized = |params: SamplingParams| SamplingParams {
        repeat_penalty: 1.1,
        frequency_penalty: 0.1,
        presence_penalty: 0.1,
        ..params
    };
    let cases: Vec<(&str, SamplingParams)> = vec![
        ("greedy", SamplingParams::greedy()),
        ("greedy + penalties", penalized(SamplingParams::greedy())),
        ("default chain", SamplingParams::default()),
        ("default + penalties", penalized(SamplingParams::default())),
        (
            "top_k off, top_p 0.95",
            SamplingParams {
                top_k: 0,
                ..Default::default()
            },
        ),
        (
            "all filters off",
            SamplingParams {
                top_k: 0,
                top_p: 1.0,
                min_p: 0.0,
                ..Default::default()
            },
        ),
    ];
    println!(
        "{:<28} {:>10} {:>12} {:>12}",
        "case", "n_vocab", "sample µs", "+logprobs µs"
    );
    for n_vocab in [151_936usize, 262_144] {
        let logits = row(n_vocab, n_vocab as u64);
        let bare = time_per_call(200, || {
            black_box(argmax(black_box(&logits)));
        });
        println!("{:<28} {:>10} {:>12.1} {:>12}", "argmax (free fn)", n_vocab, bare, "-");
        for (name, params) in &cases {
            let mut sampler = Sampler::new(params.clone()).unwrap();
            for token in 0..64u32 {
                sampler.accept(token * 997 % n_vocab as u32);
            }
            let sample = time_per_call(100, || {
                black_box(sampler.sample(black_box(&logits)).unwrap());
            });
            let with_logprobs = time_per_call(100, || {
                black_box(sampler.sample_with_logprobs(black_box(&logits), 5).unwrap());
            });
            println!("{name:<28} {n_vocab:>10} {sample:>12.1} {with_logprobs:>12.1}");
        }
    }
}
