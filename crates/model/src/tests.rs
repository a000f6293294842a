//! Fast tests on tiny GGUF files the tests write themselves: every architecture builds
//! and runs a graph, a split chain equals one stage, and every loader error is clear.

use std::path::PathBuf;
use std::sync::Arc;

use baton_gguf::{GgmlType, GgufWriter, Value};

use crate::{Batch, ModelError, ModelFile, Stage, StageConfig, StageInput, StageOutput, StageSpan};

const N_LAYER: usize = 3;
const N_EMBD: u64 = 32;
const N_HEAD: u64 = 4;
const N_HEAD_KV: u64 = 2;
const HEAD_DIM: u64 = 8;
const N_FF: u64 = 48;
const N_VOCAB: u64 = 40;

/// Small deterministic pseudo-random weights (kept small so activations stay tame).
fn weights(seed: u64, n: u64) -> Vec<f32> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            ((state % 2001) as f32 / 1000.0 - 1.0) * 0.2
        })
        .collect()
}

/// A tiny model of architecture `arch`; `edit` may change the writer before it is saved.
fn tiny_model(arch: &str, edit: impl FnOnce(GgufWriter) -> GgufWriter) -> Vec<u8> {
    let key = |k: &str| format!("{arch}.{k}");
    let mut w = GgufWriter::new()
        .kv_str("general.architecture", arch)
        .kv_u32(key("block_count"), N_LAYER as u32)
        .kv_u32(key("embedding_length"), N_EMBD as u32)
        .kv_u32(key("feed_forward_length"), N_FF as u32)
        .kv_u32(key("attention.head_count"), N_HEAD as u32)
        .kv_u32(key("attention.head_count_kv"), N_HEAD_KV as u32)
        .kv_u32(key("attention.key_length"), HEAD_DIM as u32)
        .kv_u32(key("attention.value_length"), HEAD_DIM as u32)
        .kv_u32(key("context_length"), 256)
        .kv_f32(key("attention.layer_norm_rms_epsilon"), 1e-6)
        .kv_f32(key("rope.freq_base"), 10000.0);
    if arch == "gemma3" {
        // Window 2 with a pattern of 2: layers 0 and 2 slide, layer 1 is global.
        w = w
            .kv_u32("gemma3.attention.sliding_window", 2)
            .kv_u32("gemma3.attention.sliding_window_pattern", 2);
    }
    let mut seed = 1;
    let mut t = |w: &mut GgufWriter, name: &str, dims: &[u64]| {
        seed += 1;
        let n = dims.iter().product();
        let mut data = weights(seed, n);
        if name.contains("norm") {
            data.iter_mut().for_each(|x| *x += 1.0);
        }
        *w = std::mem::take(w).tensor_f32(name, dims, &data);
    };
    t(&mut w, "token_embd.weight", &[N_EMBD, N_VOCAB]);
    t(&mut w, "output_norm.weight", &[N_EMBD]);
    if arch == "llama" {
        t(&mut w, "output.weight", &[N_EMBD, N_VOCAB]);
    }
    let (q, kv) = (N_HEAD * HEAD_DIM, N_HEAD_KV * HEAD_DIM);
    for layer in 0..N_LAYER {
        let b = |n: &str| format!("blk.{layer}.{n}");
        t(&mut w, &b("attn_norm.weight"), &[N_EMBD]);
        t(&mut w, &b("attn_q.weight"), &[N_EMBD, q]);
        t(&mut w, &b("attn_k.weight"), &[N_EMBD, kv]);
        t(&mut w, &b("attn_v.weight"), &[N_EMBD, kv]);
        t(&mut w, &b("attn_output.weight"), &[q, N_EMBD]);
        t(&mut w, &b("ffn_norm.weight"), &[N_EMBD]);
        t(&mut w, &b("ffn_gate.weight"), &[N_EMBD, N_FF]);
        t(&mut w, &b("ffn_up.weight"), &[N_EMBD, N_FF]);
        t(&mut w, &b("ffn_down.weight"), &[N_FF, N_EMBD]);
        match arch {
            "qwen2" => {
                t(&mut w, &b("attn_q.bias"), &[q]);
                t(&mut w, &b("attn_k.bias"), &[kv]);
                t(&mut w, &b("attn_v.bias"), &[kv]);
            }
            "qwen3" | "gemma3" => {
                t(&mut w, &b("attn_q_norm.weight"), &[HEAD_DIM]);
                t(&mut w, &b("attn_k_norm.weight"), &[HEAD_DIM]);
                if arch == "gemma3" {
                    t(&mut w, &b("post_attention_norm.weight"), &[N_EMBD]);
                    t(&mut w, &b("post_ffw_norm.weight"), &[N_EMBD]);
                }
            }
            _ => {}
        }
    }
    edit(w).to_bytes()
}

/// Writes `bytes` to a fresh temporary file.
fn write_temp(name: &str, bytes: &[u8]) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("baton-model-tests-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    std::fs::write(&path, bytes).unwrap();
    path
}

fn open(name: &str, bytes: &[u8]) -> Result<Arc<ModelFile>, ModelError> {
    ModelFile::open(&write_temp(name, bytes))
}

fn config() -> StageConfig {
    StageConfig::new(64, 1)
}

/// Logits of the last token of `tokens` through stages of the given sizes.
fn chain_logits(file: &Arc<ModelFile>, sizes: &[usize], tokens: &[u32]) -> Vec<f32> {
    let mut start = 0;
    let mut hidden = Vec::new();
    let positions: Vec<i32> = (0..tokens.len() as i32).collect();
    let seqs = vec![0; tokens.len()];
    let last_row = [tokens.len() as u32 - 1];
    for (i, &n) in sizes.iter().enumerate() {
        let span = StageSpan {
            layers: start..start + n,
            first: i == 0,
            last: i + 1 == sizes.len(),
        };
        start += n;
        let mut stage = Stage::load(file.clone(), span, &config()).unwrap();
        let input = if i == 0 {
            StageInput::Tokens(tokens)
        } else {
            StageInput::Hidden(&hidden)
        };
        let rows: &[u32] = if i + 1 == sizes.len() { &last_row } else { &[] };
        match stage
            .forward(&Batch {
                input,
                positions: &positions,
                seq_ids: &seqs,
                logit_rows: rows,
            })
            .unwrap()
        {
            StageOutput::Hidden(h) => hidden = h,
            StageOutput::Logits(l) => return l,
        }
    }
    unreachable!()
}

#[test]
fn every_architecture_runs_and_a_split_chain_equals_one_stage() {
    let tokens = [1, 5, 9, 2, 7, 3];
    for arch in ["llama", "qwen2", "qwen3", "gemma3"] {
        let file = open(&format!("{arch}.gguf"), &tiny_model(arch, |w| w)).unwrap();
        let whole = chain_logits(&file, &[3], &tokens);
        assert_eq!(whole.len(), N_VOCAB as usize);
        assert!(whole.iter().all(|x| x.is_finite()), "{arch}: non-finite logits");
        assert!(whole.iter().any(|&x| x != whole[0]), "{arch}: constant logits");
        for sizes in [&[1, 2][..], &[2, 1], &[1, 1, 1]] {
            let split = chain_logits(&file, sizes, &tokens);
            let diff = whole
                .iter()
                .zip(&split)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(diff < 1e-5, "{arch} split {sizes:?}: max diff {diff}");
        }
    }
}

#[test]
fn incremental_decoding_equals_one_batch() {
    // Same tokens, once as a batch and once token by token: the KV cache must make
    // them agree (this covers positions, cache writes and the causal/sliding masks).
    let tokens = [4u32, 8, 15, 16, 23, 3];
    for arch in ["llama", "gemma3"] {
        let file = open(&format!("inc-{arch}.gguf"), &tiny_model(arch, |w| w)).unwrap();
        let whole = chain_logits(&file, &[3], &tokens);
        let span = StageSpan {
            layers: 0..3,
            first: true,
            last: true,
        };
        let mut stage = Stage::load(file.clone(), span, &config()).unwrap();
        let mut last = Vec::new();
        for (pos, token) in tokens.iter().enumerate() {
            let batch = Batch {
                input: StageInput::Tokens(std::slice::from_ref(token)),
                positions: &[pos as i32],
                seq_ids: &[0],
                logit_rows: &[0],
            };
            if let StageOutput::Logits(l) = stage.forward(&batch).unwrap() {
                last = l;
            }
        }
        let diff = whole.iter().zip(&last).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        assert!(diff < 1e-4, "{arch}: incremental vs batch max diff {diff}");
    }
}

fn err_text(name: &str, bytes: &[u8]) -> String {
    match open(name, bytes) {
        Ok(file) => {
            let span = StageSpan {
                layers: 0..N_LAYER,
                first: true,
                last: true,
            };
            Stage::load(file, span, &config())
                .err()
                .expect("load must fail")
                .to_string()
        }
        Err(e) => e.to_string(),
    }
}

#[test]
fn loader_errors_are_clear() {
    let good = tiny_model("llama", |w| w);

    let truncated = err_text("truncated.gguf", &good[..good.len() - 100]);
    assert!(truncated.contains("truncated"), "{truncated}");

    let mut bad_magic = good.clone();
    bad_magic[..4].copy_from_slice(b"GGML");
    let text = err_text("magic.gguf", &bad_magic);
    assert!(text.contains("not a GGUF file"), "{text}");

    let missing = tiny_model("llama", |w| w.without_tensor("blk.1.ffn_up.weight"));
    assert_eq!(
        err_text("missing.gguf", &missing),
        "tensor 'blk.1.ffn_up.weight' is missing from the model file"
    );

    let wrong = tiny_model("llama", |w| {
        w.without_tensor("blk.2.attn_k.weight")
            .tensor_f32("blk.2.attn_k.weight", &[N_EMBD, 8], &[0.0; 256])
    });
    assert_eq!(
        err_text("shape.gguf", &wrong),
        "tensor 'blk.2.attn_k.weight' has shape [32, 8], expected [32, 16]"
    );

    let unknown = tiny_model("llama", |w| {
        w.without_kv("general.architecture")
            .kv("general.architecture", Value::Str("mamba9".into()))
    });
    let text = err_text("arch.gguf", &unknown);
    assert!(text.contains("unsupported model architecture 'mamba9'"), "{text}");

    let odd_type = tiny_model("llama", |w| {
        w.without_tensor("blk.0.attn_norm.weight").tensor_raw(
            "blk.0.attn_norm.weight",
            &[N_EMBD],
            GgmlType::I8,
            vec![0; N_EMBD as usize],
        )
    });
    let text = err_text("type.gguf", &odd_type);
    assert!(text.contains("blk.0.attn_norm.weight") && text.contains("i8"), "{text}");

    let no_key = tiny_model("llama", |w| w.without_kv("llama.embedding_length"));
    let text = err_text("key.gguf", &no_key);
    assert!(text.contains("llama.embedding_length"), "{text}");

    // A block count no tensor index could hold sizes nothing (found reading the code
    // the fuzzers cover: it sized a per-layer table straight from the file).
    let huge = tiny_model("llama", |w| {
        w.without_kv("llama.block_count").kv_u32("llama.block_count", u32::MAX)
    });
    let text = err_text("blocks.gguf", &huge);
    assert!(text.contains("block_count 4294967295 is more than"), "{text}");
}
