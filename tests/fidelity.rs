//! Baton's split model computes what llama.cpp computes: last-token logits of 1-, 2-
//! and 3-stage chains match libllama's full model, and greedy continuations through
//! the in-process ring are token-for-token identical.

mod common;

use baton_engine::{GenerateRequest, LocalRing};
use baton_ggml::{LlamaContext, LlamaModel};
use baton_model::{CacheType, KvTypes, ModelFile, StageConfig};
use baton_sample::SamplingParams;
use common::fidelity::{check_prompts, check_stages, reference, Setup, MAX_NMSE, N_GREEDY, SHORT};
use common::{model, nmse, Chain, GEMMA3, PROMPTS, QWEN2};

/// One test at a time: each runs ggml threads that spin while they wait, and tests side
/// by side on two cores starve each other (this file: 402 s in parallel, 51 s one after
/// another, measured on this 2-core machine).
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn check_model(name: &str) {
    check_stages(&model(name), name);
}

#[test]
fn qwen2_matches_llama_cpp_with_1_2_3_stages() {
    let _serial = serial();
    check_model(QWEN2);
}

#[test]
fn gemma3_matches_llama_cpp_with_1_2_3_stages() {
    let _serial = serial();
    check_model(GEMMA3);
}

/// Edge cases of the split: one-layer stages at both ends, a very uneven split, and
/// prompts fed in several chunks (positions continuing across forward calls).
#[test]
fn uneven_and_one_layer_splits_match_llama_cpp() {
    let _serial = serial();
    let path = model(QWEN2);
    let file = ModelFile::open(&path).unwrap();
    let oracle = LlamaModel::load_full(&path, true).unwrap();
    let prompt = oracle.tokenize(PROMPTS[2], true, true).unwrap();
    let (ref_logits, _) = reference(&oracle, &prompt);
    for split in ["1,22,1", "1,1,22", "20,4", "23,1", "1,23"] {
        let ranges = baton_plan::parse_split(split, 24).unwrap();
        let mut chain = Chain::load(&file, &ranges, 256);
        let err = nmse(&chain.logits(0, &prompt, 0), &ref_logits);
        assert!(err <= MAX_NMSE, "split {split}: NMSE {err:e}");
    }
    // The prompt in three chunks (positions continuing across calls) against llama.cpp
    // fed the same chunks. (Chunking changes which matmul kernels run, so it is
    // compared with llama.cpp chunked the same way, not with the one-batch logits.)
    let (a, rest) = prompt.split_at(5);
    let (b, c) = rest.split_at(4);
    let mut ctx = LlamaContext::new(&oracle, 256, 256, 2).unwrap();
    for chunk in [a, b] {
        ctx.decode(chunk).unwrap();
    }
    let chunked_ref = ctx.decode(c).unwrap();
    let mut chain = Chain::load(&file, &baton_plan::even_split(24, 2).unwrap(), 256);
    chain.logits(0, a, 0);
    chain.logits(0, b, 5);
    let err = nmse(&chain.logits(0, c, 9), &chunked_ref);
    assert!(err <= MAX_NMSE, "chunked prompt: NMSE {err:e}");
}

/// Two sequences in one batch see only their own tokens.
#[test]
fn sequences_in_one_cache_do_not_see_each_other() {
    let _serial = serial();
    let path = model(QWEN2);
    let file = ModelFile::open(&path).unwrap();
    let oracle = LlamaModel::load_full(&path, true).unwrap();
    let p0 = oracle.tokenize(PROMPTS[0], true, true).unwrap();
    let p1 = oracle.tokenize(PROMPTS[1], true, true).unwrap();
    let (ref0, _) = reference(&oracle, &p0);
    let (ref1, _) = reference(&oracle, &p1);
    let mut chain = Chain::load(&file, &baton_plan::even_split(24, 2).unwrap(), 256);
    let l0 = chain.logits(7, &p0, 0);
    let l1 = chain.logits(3, &p1, 0);
    assert!(nmse(&l0, &ref0) <= MAX_NMSE);
    assert!(nmse(&l1, &ref1) <= MAX_NMSE);
    // Truncating sequence 7 back to its prompt minus one token and recomputing that
    // token gives the same logits again.
    for stage in &mut chain.stages {
        stage.truncate_seq(7, p0.len() - 1);
    }
    let again = chain.logits(7, &p0[p0.len() - 1..], p0.len() as i32 - 1);
    assert!(nmse(&again, &ref0) <= MAX_NMSE);
}

/// With repacking off on both sides (llama.cpp `--no-repack`), every weight is read
/// from the mapping and the results are identical too.
#[test]
fn without_repacking_matches_llama_cpp_without_repacking() {
    let _serial = serial();
    let path = model(GEMMA3);
    let file = ModelFile::open(&path).unwrap();
    let oracle = LlamaModel::load_full(&path, false).unwrap();
    let prompt = oracle.tokenize(PROMPTS[1], true, true).unwrap();
    let (ref_logits, ref_tokens) = reference(&oracle, &prompt);
    let ranges = baton_plan::even_split(file.hparams().n_layer, 2).unwrap();
    let config = StageConfig {
        n_ctx: 256,
        n_threads: 2,
        repack: false,
        n_seq: 0,
        kv_types: Default::default(),
        n_ubatch: baton_model::DEFAULT_UBATCH,
    };
    let mut chain = Chain::load_with(&file, &ranges, &config);
    let err = nmse(&chain.logits(0, &prompt, 0), &ref_logits);
    assert!(err <= MAX_NMSE, "no repack: NMSE {err:e}");
    let mut ring = LocalRing::start(file.clone(), &ranges, &config).unwrap();
    let req = GenerateRequest {
        seq: 0,
        prompt: &prompt,
        params: SamplingParams::greedy(),
        max_tokens: N_GREEDY,
        n_batch: 512,
        logprobs: false,
    };
    let generation = ring
        .head()
        .unwrap()
        .generate(&req, |t| oracle.is_end_of_generation(t), |_| {})
        .unwrap();
    assert_eq!(generation.tokens, ref_tokens);
}

/// What `--wire-dtype f16` costs: hidden states rounded to f16 between 3 stages.
/// The bound is the measured worst case (docs/fidelity.md) with a margin.
#[test]
fn f16_wire_costs_little_fidelity() {
    let _serial = serial();
    const MAX_F16_NMSE: f64 = 5e-3;
    for name in [QWEN2, GEMMA3] {
        let path = model(name);
        let file = ModelFile::open(&path).unwrap();
        let oracle = LlamaModel::load_full(&path, true).unwrap();
        let ranges = baton_plan::even_split(file.hparams().n_layer, 3).unwrap();
        let mut chain = Chain::load(&file, &ranges, 512);
        chain.wire_f16 = true;
        for prompt_text in PROMPTS {
            let prompt = oracle.tokenize(prompt_text, true, true).unwrap();
            let (ref_logits, _) = reference(&oracle, &prompt);
            chain.stages.iter_mut().for_each(|s| s.clear_seq(0));
            let err = nmse(&chain.logits(0, &prompt, 0), &ref_logits);
            println!("{name} f16 wire {prompt_text:?}: nmse {err:.3e}");
            assert!(err > 0.0, "rounding to f16 must change something");
            assert!(
                err <= MAX_F16_NMSE,
                "{name} {prompt_text:?}: f16 wire NMSE {err:e} > {MAX_F16_NMSE:e}"
            );
        }
    }
}

/// A batch of decode steps, one per sequence, as `baton serve` forms them for many
/// concurrent requests: each row's logits are the bits of that sequence's step alone,
/// at every batch size up to [`baton_engine::MAX_DECODE_SEQS`], with weights repacked
/// for the CPU or not. Each weight's product takes the rows in a way that computes each
/// as alone (`Builder::mm`): most of qwen2's and gemma3's weights (q5_0, q8_0) through
/// ggml's product with all rows at once, their K-quants through baton's repacked q4_K
/// kernel or as one-row planes (pieces of 3 or 7 rows where neither agrees).
#[test]
fn a_decode_batch_of_many_sequences_gives_each_row_its_bits_alone() {
    let _serial = serial();
    const SEQS: usize = 24;
    for (name, repack) in [(QWEN2, true), (QWEN2, false), (GEMMA3, true)] {
        let path = model(name);
        let file = ModelFile::open(&path).unwrap();
        let oracle = LlamaModel::load_vocab(&path).unwrap();
        let prompts = common::numbered_prompts(&oracle, SEQS);
        let config = StageConfig {
            n_ctx: 64 * SEQS,
            n_threads: 2,
            repack,
            n_seq: SEQS,
            kv_types: Default::default(),
            n_ubatch: baton_model::DEFAULT_UBATCH,
        };
        let ranges = baton_plan::even_split(file.hparams().n_layer, 2).unwrap();
        let mut chain = Chain::load_with(&file, &ranges, &config);
        let lens = chain.prefill_all(&prompts);
        let reset = |chain: &mut Chain| chain.truncate_all(&lens);
        let token = |seq: usize| 42 + 7 * seq as u32;
        let alone: Vec<Vec<f32>> = (0..SEQS)
            .map(|seq| {
                let logits = chain.forward(&[token(seq)], &[lens[seq]], &[seq as u32], &[0], false);
                reset(&mut chain);
                logits
            })
            .collect();
        for rows in [2usize, 4, 5, 8, 9, 17, SEQS] {
            // The last `rows` sequences, newest first: rows meet other neighbours and
            // other row numbers than in the smaller batches.
            let seqs: Vec<usize> = (SEQS - rows..SEQS).rev().collect();
            let tokens: Vec<u32> = seqs.iter().map(|&s| token(s)).collect();
            let positions: Vec<i32> = seqs.iter().map(|&s| lens[s]).collect();
            let seq_ids: Vec<u32> = seqs.iter().map(|&s| s as u32).collect();
            let all: Vec<u32> = (0..rows as u32).collect();
            let batched = chain.forward(&tokens, &positions, &seq_ids, &all, false);
            reset(&mut chain);
            let n_vocab = batched.len() / rows;
            for (row, &seq) in seqs.iter().enumerate() {
                let err = nmse(&batched[row * n_vocab..(row + 1) * n_vocab], &alone[seq]);
                assert_eq!(
                    err, 0.0,
                    "{name}, repack {repack}: sequence {seq} as row {row} of a batch of {rows}"
                );
            }
            println!("{name}, repack {repack}: batch of {rows} sequences, every row NMSE 0 against its step alone");
        }
    }
}

/// A token and the 8 tokens drafted after it, verified in one batch of decode rows
/// (`Batch::decode`, as the stage loop sends drafts on the CPU): each row's logits are
/// the bits of the one-token step at its position. Without the flag the same 9 rows
/// go through ggml's batched kernels whole, as a prompt chunk does (printed).
#[test]
fn a_token_and_its_drafts_in_one_batch_give_the_bits_of_one_token_steps() {
    let _serial = serial();
    for (name, repack) in [(QWEN2, true), (GEMMA3, true), (QWEN2, false)] {
        let path = model(name);
        let file = ModelFile::open(&path).unwrap();
        let oracle = LlamaModel::load_vocab(&path).unwrap();
        let prompt = oracle.tokenize(PROMPTS[1], true, true).unwrap();
        let config = StageConfig {
            n_ctx: 256,
            n_threads: 2,
            repack,
            n_seq: 1,
            kv_types: Default::default(),
            n_ubatch: baton_model::DEFAULT_UBATCH,
        };
        let ranges = baton_plan::even_split(file.hparams().n_layer, 2).unwrap();
        let mut chain = Chain::load_with(&file, &ranges, &config);
        chain.logits(0, &prompt, 0);
        let len = prompt.len() as i32;
        let drafted: Vec<u32> = (0..9).map(|i| 300 + 11 * i).collect();
        let positions: Vec<i32> = (len..len + 9).collect();
        let steps: Vec<Vec<f32>> = drafted
            .iter()
            .zip(&positions)
            .map(|(&token, &pos)| chain.forward(&[token], &[pos], &[0], &[0], false))
            .collect();
        let truncate = |chain: &mut Chain| chain.stages.iter_mut().for_each(|s| s.truncate_seq(0, len as usize));
        truncate(&mut chain);
        let rows: Vec<u32> = (0..9).collect();
        let verified = chain.forward(&drafted, &positions, &[0; 9], &rows, true);
        truncate(&mut chain);
        let n_vocab = verified.len() / 9;
        for (row, step) in steps.iter().enumerate() {
            let err = nmse(&verified[row * n_vocab..(row + 1) * n_vocab], step);
            assert_eq!(
                err, 0.0,
                "{name}, repack {repack}: drafted row {row} against its one-token step"
            );
        }
        let whole = chain.forward(&drafted, &positions, &[0; 9], &rows, false);
        truncate(&mut chain);
        let worst = (0..9)
            .map(|row| nmse(&whole[row * n_vocab..(row + 1) * n_vocab], &steps[row]))
            .fold(0.0f64, f64::max);
        println!("{name}, repack {repack}: 9 drafted rows as decode rows NMSE 0; as one plain batch, worst row NMSE {worst:.3e}");
    }
}

/// A decode step computed alone, or in one batch with other sequences' steps: the logits
/// are bit-identical for batches of up to `max_decode_rows(repack)` rows (3 with weights
/// repacked for the CPU, 7 without), so concurrent requests generate what they generate
/// alone (the server's scheduler keeps decode batches that small and never mixes them
/// with prompt chunks). From 4 rows ggml multiplies repacked weights with its 4-row gemm
/// kernel, and from 8 rows plain K-quant weights with a tiled kernel: results move
/// (printed below; llama.cpp's own server has the same property). See docs/fidelity.md.
///
/// With a region per sequence (as `baton serve` runs) the sequences here are long
/// enough to attend over 512 cells, where ggml's attention kernel for a lone row
/// differs from the one for several rows: the stage attends per sequence.
#[test]
fn batching_with_other_sequences_changes_nothing_up_to_the_decode_row_cap() {
    let _serial = serial();
    let cases = [
        (QWEN2, false, 0),
        (QWEN2, false, 4),
        (GEMMA3, false, 4),
        (QWEN2, true, 0),
        (QWEN2, true, 4),
        (GEMMA3, true, 4),
    ];
    for (name, repack, n_seq) in cases {
        let path = model(name);
        let file = ModelFile::open(&path).unwrap();
        let oracle = LlamaModel::load_vocab(&path).unwrap();
        let prompts: Vec<Vec<u32>> = PROMPTS
            .iter()
            .map(|p| {
                // With regions, about 300 tokens each: past 256 cells, so each sequence
                // attends over 512.
                let text = if n_seq == 0 { p.to_string() } else { p.repeat(40) };
                let mut tokens = oracle.tokenize(&text, true, true).unwrap();
                tokens.truncate(300);
                tokens
            })
            .collect();
        let config = StageConfig {
            n_ctx: if n_seq == 0 { 512 } else { 2048 },
            n_threads: 2,
            repack,
            n_seq,
            kv_types: Default::default(),
            n_ubatch: baton_model::DEFAULT_UBATCH,
        };
        let ranges = baton_plan::even_split(file.hparams().n_layer, 2).unwrap();
        let mut chain = Chain::load_with(&file, &ranges, &config);
        let lens = chain.prefill_all(&prompts);
        let reset = |chain: &mut Chain| chain.truncate_all(&lens);
        let alone = chain.forward(&[42], &[lens[0]], &[0], &[0], false);
        reset(&mut chain);
        for rows in [2usize, 3, 4, 7, 8] {
            // Rows round-robin over the three sequences, each continuing where it is.
            let seq_ids: Vec<u32> = (0..rows as u32).map(|r| r % 3).collect();
            let mut next = lens.clone();
            let positions: Vec<i32> = seq_ids
                .iter()
                .map(|&s| {
                    next[s as usize] += 1;
                    next[s as usize] - 1
                })
                .collect();
            let tokens: Vec<u32> = (0..rows as u32).map(|r| 42 + 7 * r).collect();
            let batched = chain.forward(&tokens, &positions, &seq_ids, &[0], false);
            reset(&mut chain);
            let err = nmse(&batched, &alone);
            println!(
                "{name}, repack {repack}, {n_seq} regions, batch of {rows}: NMSE {err:.3e} against the step alone"
            );
            if rows <= baton_engine::max_decode_rows(repack) {
                assert_eq!(err, 0.0, "{name}: batch of {rows}, repack {repack}, {n_seq} regions");
            }
        }
    }
}

/// Keys and values cached as q8_0 or q4_0 (llama.cpp's `-ctk`/`-ctv`): the same
/// logits, bit for bit, and tokens as libllama with the same cache types, with 1 and 2
/// stages. Both sides rotate queries, keys and values by a Walsh-Hadamard matrix before
/// a quantized cache; without the rotation the logits part from llama.cpp's. Each
/// type, model and stage count appears once (every further combination costs CI half a
/// minute).
#[test]
fn quantized_kv_caches_match_llama_cpp() {
    let _serial = serial();
    for (name, t, stages) in [
        (QWEN2, CacheType::Q8_0, &[1, 2][..]),
        (QWEN2, CacheType::Q4_0, &[2]),
        (GEMMA3, CacheType::Q8_0, &[2]),
        (GEMMA3, CacheType::Q4_0, &[1]),
    ] {
        let path = model(name);
        let oracle = LlamaModel::load_vocab(&path).unwrap();
        let text = PROMPTS[2];
        let prompts = [(format!("{text:?}"), oracle.tokenize(text, true, true).unwrap())];
        let setup = Setup {
            kv_types: KvTypes::both(t),
            ..SHORT
        };
        let worst = check_prompts(&path, &format!("{name} {t}/{t}"), stages, &prompts, setup);
        assert_eq!(worst, 0.0, "{name} {t}/{t}: the logits are llama.cpp's bit for bit");
    }
}
