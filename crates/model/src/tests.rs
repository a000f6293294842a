//! Fast tests on tiny GGUF files the tests write themselves: every architecture builds
//! and runs a graph, a split chain equals one stage, and every loader error is clear.

use std::path::PathBuf;
use std::sync::Arc;

use baton_gguf::{GgmlType, GgufWriter, Value};

use crate::example::{example_gguf, ExampleOptions};
use crate::{
    Batch, KvTypes, LogitReply, ModelError, ModelFile, RowBest, Shape, Stage, StageChain, StageConfig, StageGroup,
    StageInput, StageOutput, StageSpan, ARCHITECTURES,
};

const N_LAYER: usize = 3;
const N_EMBD: u64 = 32;
const N_VOCAB: u64 = 40;

/// The shape of every tiny test model: 3 layers, the last two routed through 4
/// experts where the architecture has experts and leading dense layers.
fn shape() -> Shape {
    Shape {
        n_layer: N_LAYER,
        n_embd: N_EMBD as usize,
        n_head: 4,
        n_head_kv: 2,
        head_dim: 8,
        n_ff: 48,
        n_expert: 4,
        n_expert_used: 2,
        n_ff_exp: 16,
        n_expert_shared: 1,
        n_dense_lead: 1,
        n_swa: 2,
        n_ctx: 256,
    }
}

/// A tiny model of architecture `arch` (`mixtral`: llama with experts; `gemma4` dense,
/// `gemma4-moe` with experts); `edit` may
/// change the writer before it is saved.
fn tiny_model(arch: &str, edit: impl FnOnce(GgufWriter) -> GgufWriter) -> Vec<u8> {
    let mut shape = shape();
    if arch == "llama" || arch == "gemma4" {
        shape.n_expert = 0;
    }
    let arch = crate::arch::find(match arch {
        "mixtral" => "llama",
        "gemma4-moe" => "gemma4",
        other => other,
    })
    .unwrap();
    let options = ExampleOptions {
        n_vocab: N_VOCAB as usize,
        seed: 7,
        tied_output: arch.name != "llama",
        optional_tensors: true,
    };
    edit(example_gguf(arch, &shape, &options, Vec::new()).unwrap()).to_bytes()
}

/// Every architecture, and llama and gemma4 both dense and with experts.
fn cases() -> Vec<&'static str> {
    let mut cases: Vec<&'static str> = ARCHITECTURES.iter().map(|a| a.name).collect();
    cases.push("mixtral");
    cases.push("gemma4-moe");
    cases
}

/// Writes `bytes` to a fresh temporary file. Each call gets a path of its own: tests run in
/// parallel, and rewriting a file another test has mapped kills the process with SIGBUS.
fn write_temp(name: &str, bytes: &[u8]) -> PathBuf {
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("baton-model-tests-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(format!("{n}-{name}"));
    std::fs::write(&path, bytes).unwrap();
    path
}

fn open(name: &str, bytes: &[u8]) -> Result<Arc<ModelFile>, ModelError> {
    ModelFile::open(&write_temp(name, bytes))
}

fn config() -> StageConfig {
    StageConfig::new(64, 1)
}

/// Layers `layers` of `file` loaded as a last stage that is not the first.
fn load_tail(file: &Arc<ModelFile>, layers: std::ops::Range<usize>) -> Result<Stage, ModelError> {
    let span = StageSpan {
        layers,
        first: false,
        last: true,
    };
    Stage::load(file.clone(), span, &config())
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
            .forward(
                &Batch {
                    input,
                    positions: &positions,
                    seq_ids: &seqs,
                    logit_rows: rows,
                    decode: false,
                },
                LogitReply::Logits,
            )
            .unwrap()
        {
            StageOutput::Hidden(h) => hidden = h,
            StageOutput::Logits(l) => return l,
            StageOutput::Best(_) | StageOutput::Normed(_) => unreachable!("logits were asked for"),
        }
    }
    unreachable!()
}

#[test]
fn every_architecture_runs_and_a_split_chain_equals_one_stage() {
    let tokens = [1, 5, 9, 2, 7, 3];
    for arch in cases() {
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

/// Several devices behind one worker run as a `StageChain`: stages of consecutive
/// layers chained in one thread give what the same stages give one by one, keep
/// their caches in step, and refuse stages that do not chain.
#[test]
fn a_stage_chain_equals_its_stages_run_one_by_one() {
    let tokens = [1, 5, 9, 2, 7, 3];
    let file = open("chain.gguf", &tiny_model("llama", |w| w)).unwrap();
    let expected = chain_logits(&file, &[1, 2], &tokens);
    let load = |layers: std::ops::Range<usize>, first, last| {
        Stage::load(file.clone(), StageSpan { layers, first, last }, &config()).unwrap()
    };
    let mut chain = StageChain::new(vec![load(0..1, true, false), load(1..3, false, true)]).unwrap();
    assert_eq!(chain.span().layers, 0..3);
    let positions: Vec<i32> = (0..tokens.len() as i32).collect();
    let batch = Batch {
        input: StageInput::Tokens(&tokens),
        positions: &positions,
        seq_ids: &[0; 6],
        logit_rows: &[5],
        decode: false,
    };
    assert_eq!(
        chain.forward(&batch, LogitReply::Logits).unwrap(),
        StageOutput::Logits(expected)
    );
    assert_eq!(chain.kv_used(), tokens.len());
    chain.truncate_seq(0, 2);
    assert!(chain.stages().all(|s| s.kv().n_used() == 2));

    let gap = StageChain::new(vec![load(0..1, true, false), load(2..3, false, true)]);
    let err = gap.err().expect("refused").to_string();
    assert!(err.contains("do not chain"), "{err}");
}

/// A tensor-parallel group of two led by member 0 answers like a whole stage: the
/// whole vocabulary's logits (up to summation order) or, asked for each row's best,
/// the arg-max token of those logits. A group of one is its stage.
#[test]
fn a_group_answers_a_whole_stages_logits_or_each_rows_best() {
    let tokens = [1, 5, 9, 2, 7, 3];
    let file = open("group.gguf", &tiny_model("llama", |w| w)).unwrap();
    let span = StageSpan {
        layers: 0..N_LAYER,
        first: true,
        last: true,
    };
    let positions: Vec<i32> = (0..tokens.len() as i32).collect();
    let batch = Batch {
        input: StageInput::Tokens(&tokens),
        positions: &positions,
        seq_ids: &[0; 6],
        logit_rows: &[2, 5],
        decode: false,
    };
    let whole = chain_logits(&file, &[N_LAYER], &tokens);
    for n in [1, 2] {
        let mut group = StageGroup::load_tp(file.clone(), span.clone(), &config(), n).unwrap();
        assert_eq!(group.size(), n);
        let StageOutput::Logits(logits) = group.forward(&batch, LogitReply::Logits).unwrap() else {
            panic!("a last stage answers logits when asked for them")
        };
        let last = &logits[N_VOCAB as usize..];
        let diff = whole.iter().zip(last).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        assert!(diff < 1e-4, "group of {n}: max diff {diff}");
        group.clear_seq(0);
        let StageOutput::Best(best) = group.forward(&batch, LogitReply::Best).unwrap() else {
            panic!("a last stage answers each row's best when asked for it")
        };
        let argmax: Vec<u32> = logits
            .chunks_exact(N_VOCAB as usize)
            .map(|row| baton_sample::argmax(row).unwrap())
            .collect();
        assert_eq!(RowBest::tokens(&best).unwrap(), argmax, "group of {n}");
    }
}

#[test]
fn incremental_decoding_equals_one_batch() {
    // Same tokens, once as a batch and once token by token: the KV cache must make
    // them agree (this covers positions, cache writes and the causal/sliding masks).
    let tokens = [4u32, 8, 15, 16, 23, 3];
    for arch in cases() {
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
                decode: false,
            };
            if let StageOutput::Logits(l) = stage.forward(&batch, LogitReply::Logits).unwrap() {
                last = l;
            }
        }
        // Relative: matmuls of one row and of six round differently (up to ~2e-4 seen);
        // a wrong mask or position moves logits by their own size.
        let scale = whole.iter().map(|x| x.abs()).fold(0f32, f32::max);
        let diff = whole.iter().zip(&last).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max) / scale;
        assert!(diff < 1e-3, "{arch}: incremental vs batch relative max diff {diff}");
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
                .unwrap_or_else(|| panic!("loading {name} must fail"))
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
    assert_eq!(
        err_text("arch.gguf", &unknown),
        "unsupported model architecture 'mamba9' (baton runs: llama, mistral, qwen2, qwen3, qwen3moe, gemma3, glm4moe, gpt-oss, deepseek2, mistral3, phi3, gemma2, minimax-m2, mistral4, llama4, qwen35, qwen35moe, qwen3next, nemotron_h, nemotron_h_moe, gemma4, deepseek32, glm-dsa, kimi-linear, kimi-k3, deepseek4, glm5-next, minimax-m3)"
    );

    // Per-layer head counts: the same in every layer, except that Nemotron-H's layers
    // without attention say 0 (and those with it must still agree).
    let per_layer = |values: [u32; 3]| Value::Array(values.map(Value::U32).to_vec());
    let uneven = tiny_model("llama", |w| {
        w.without_kv("llama.attention.head_count_kv")
            .kv("llama.attention.head_count_kv", per_layer([2, 0, 2]))
    });
    assert_eq!(
        err_text("uneven.gguf", &uneven),
        "bad hyper-parameters: llama.attention.head_count_kv differs between layers ([2, 0, 2]); baton needs one value for all"
    );
    let uneven = tiny_model("nemotron_h", |w| {
        w.without_kv("nemotron_h.attention.head_count_kv")
            .kv("nemotron_h.attention.head_count_kv", per_layer([0, 1, 2]))
    });
    assert_eq!(
        err_text("uneven-nemotron.gguf", &uneven),
        "bad hyper-parameters: nemotron_h.attention.head_count_kv differs between the layers that have the block \
         ([0, 1, 2]); baton needs one value for all"
    );

    // Nemotron-H's RMS norms fall back to the plain norm's epsilon, as llama.cpp's do;
    // other architectures need the RMS key.
    let eps = Value::F32(1e-5);
    let plain = tiny_model("nemotron_h", |w| {
        w.without_kv("nemotron_h.attention.layer_norm_rms_epsilon")
            .without_kv("nemotron_h.attention.layer_norm_epsilon")
            .kv("nemotron_h.attention.layer_norm_epsilon", eps.clone())
    });
    assert_eq!(open("eps-nemotron.gguf", &plain).unwrap().hparams().rms_eps, 1e-5);
    let plain = tiny_model("qwen3", |w| {
        w.without_kv("qwen3.attention.layer_norm_rms_epsilon")
            .kv("qwen3.attention.layer_norm_epsilon", eps)
    });
    let err = err_text("eps-qwen3.gguf", &plain);
    assert!(err.contains("qwen3.attention.layer_norm_rms_epsilon"), "{err}");

    // A tensor the architecture does not use would be silently skipped: refused.
    let extra = tiny_model("qwen3", |w| w.tensor_f32("blk.1.attn_gate.weight", &[4], &[0.0; 4]));
    assert_eq!(
        err_text("extra.gguf", &extra),
        "tensor 'blk.1.attn_gate.weight' is not part of baton's qwen3 architecture; refusing to compute without it"
    );
    let extra = tiny_model("qwen2", |w| {
        w.tensor_f32("output.bias", &[N_VOCAB], &[0.0; N_VOCAB as usize])
    });
    assert!(err_text("extra-end.gguf", &extra).contains("'output.bias' is not part of"));

    let no_experts = tiny_model("qwen3moe", |w| w.without_kv("qwen3moe.expert_count"));
    let text = err_text("experts.gguf", &no_experts);
    assert_eq!(
        text,
        "bad hyper-parameters: expert_used_count 2 but the model has no experts (expert_count 0)"
    );
    let no_ff_exp = tiny_model("qwen3moe", |w| {
        w.without_kv("qwen3moe.expert_feed_forward_length")
            .without_kv("qwen3moe.feed_forward_length")
    });
    let text = err_text("ff-exp.gguf", &no_ff_exp);
    assert!(text.contains("qwen3moe needs experts"), "{text}");

    // minimax-m2: its selection bias is required, its gating function must be named
    // (llama.cpp has none without the key and aborts), and a fused q/k/v projection is
    // not one of its forms.
    let no_bias = tiny_model("minimax-m2", |w| w.without_tensor("blk.2.exp_probs_b.bias"));
    assert_eq!(
        err_text("mm-bias.gguf", &no_bias),
        "tensor 'blk.2.exp_probs_b.bias' is missing from the model file"
    );
    let no_gating = tiny_model("minimax-m2", |w| w.without_kv("minimax-m2.expert_gating_func"));
    let text = err_text("mm-gating.gguf", &no_gating);
    assert!(text.contains("minimax-m2.expert_gating_func"), "{text}");
    let none = tiny_model("minimax-m2", |w| {
        w.without_kv("minimax-m2.expert_gating_func")
            .kv_u32("minimax-m2.expert_gating_func", 0)
    });
    assert_eq!(
        err_text("mm-none.gguf", &none),
        "bad hyper-parameters: minimax-m2.expert_gating_func is 0 (none): the router has no gating function"
    );
    let unknown_gating = tiny_model("minimax-m2", |w| {
        w.without_kv("minimax-m2.expert_gating_func")
            .kv_u32("minimax-m2.expert_gating_func", 5)
    });
    let text = err_text("mm-gating.gguf", &unknown_gating);
    assert!(text.contains("expert_gating_func 5 is not supported"), "{text}");
    let fused = tiny_model("minimax-m2", |w| {
        w.tensor_f32("blk.0.attn_qkv.weight", &[N_EMBD, 64], &[0.0; 32 * 64])
    });
    assert_eq!(
        err_text("mm-qkv.gguf", &fused),
        "tensor 'blk.0.attn_qkv.weight' is not part of baton's minimax-m2 architecture; refusing to compute without it"
    );

    // llama4: without chunked attention llama.cpp aborts (its temperature input has no
    // scale); the interleave step is required; experts are too (llama.cpp refuses a
    // llama4 file without); a dense layer with a router is not llama4's.
    let unchunked = tiny_model("llama4", |w| w.kv_u32("llama4.attention.sliding_window", 0));
    assert_eq!(
        err_text("l4-window.gguf", &unchunked),
        "bad hyper-parameters: llama4.attention.sliding_window 0 (llama4 without chunked attention) is not supported: llama.cpp aborts computing it"
    );
    let no_step = tiny_model("llama4", |w| w.without_kv("llama4.interleave_moe_layer_step"));
    let text = err_text("l4-step.gguf", &no_step);
    assert!(text.contains("llama4.interleave_moe_layer_step"), "{text}");
    let no_experts = tiny_model("llama4", |w| {
        w.without_kv("llama4.expert_count")
            .without_kv("llama4.expert_used_count")
    });
    let text = err_text("l4-experts.gguf", &no_experts);
    assert!(text.contains("llama4 needs experts"), "{text}");
    let router_in_dense = tiny_model("llama4", |w| {
        w.tensor_f32("blk.0.ffn_gate_inp.weight", &[N_EMBD, 4], &[0.0; 32 * 4])
    });
    assert_eq!(
        err_text("l4-router.gguf", &router_in_dense),
        "tensor 'blk.0.ffn_gate_inp.weight' is not part of baton's llama4 architecture; refusing to compute without it"
    );

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

    // Values ggml asserts on (it aborts the process) are refused before a graph is built.
    let rope = tiny_model("phi3", |w| {
        w.without_kv("phi3.rope.dimension_count")
            .kv_u32("phi3.rope.dimension_count", 10)
    });
    assert_eq!(
        err_text("rope.gguf", &rope),
        "bad hyper-parameters: rope dimension count 10 must be even, positive and at most the head size 8"
    );
    let odd = tiny_model("phi3", |w| {
        w.without_kv("phi3.rope.dimension_count")
            .kv_u32("phi3.rope.dimension_count", 7)
    });
    assert!(err_text("odd-rope.gguf", &odd).contains("must be even"));
    let head = tiny_model("qwen2", |w| {
        w.without_kv("qwen2.attention.key_length")
            .kv_u32("qwen2.attention.key_length", 0)
    });
    let text = err_text("head.gguf", &head);
    assert!(
        text.starts_with("bad hyper-parameters: ") && text.contains("key 0"),
        "{text}"
    );
    let base = tiny_model("llama", |w| {
        w.without_kv("llama.rope.freq_base")
            .kv("llama.rope.freq_base", Value::F32(f32::NAN))
    });
    let text = err_text("base.gguf", &base);
    assert!(text.contains("must be finite"), "{text}");
}

/// The KV cache holds what llama.cpp's holds: keys and values of `head_dim × n_head_kv`
/// per token and layer, except with MLA (deepseek2), where one compressed row of
/// `kv_lora_rank + n_rot` per token and layer is all there is (with sparse attention,
/// plus the indexer's key).
#[test]
fn kv_cache_is_sized_per_architecture() {
    let n_ctx = 64;
    let span = StageSpan {
        layers: 0..N_LAYER,
        first: true,
        last: true,
    };
    for (arch, row_bytes) in [
        // keys and values of 2 heads of 8, f16
        ("llama", 2 * (2 * 8) * 2),
        // one latent of 32 (the model's width) plus 4 RoPE dims (half a head), f16
        ("deepseek2", (32 + 4) * 2),
    ] {
        let file = open(&format!("kv-{arch}.gguf"), &tiny_model(arch, |w| w)).unwrap();
        assert_eq!(
            file.hparams().kv_cell_bytes(KvTypes::default()),
            row_bytes,
            "{arch}: what the planner counts"
        );
        let stage = Stage::load(file, span.clone(), &StageConfig::new(n_ctx, 1)).unwrap();
        assert_eq!(stage.kv().bytes(), N_LAYER * n_ctx * row_bytes, "{arch}");
    }

    // Nemotron-H's layers are Mamba2, MLP and attention: only the last has a KV cache,
    // only the first recurrent states, and the MLP nothing.
    let file = open("kv-nemotron_h.gguf", &tiny_model("nemotron_h", |w| w)).unwrap();
    let hp = file.hparams().clone();
    let row_bytes = 2 * (2 * 8) * 2;
    let ssm = hp.ssm.clone().unwrap();
    let states = crate::recurrent::state_rows(1) * (ssm.conv_state_len() + ssm.state_len()) * 4;
    let per_layer: Vec<u64> = (0..N_LAYER)
        .map(|l| hp.layer_cache_bytes(l, n_ctx, 1, KvTypes::default()))
        .collect();
    assert_eq!(per_layer, [states as u64, 0, (n_ctx * row_bytes) as u64]);
    let stage = Stage::load(file, span.clone(), &StageConfig::new(n_ctx, 1)).unwrap();
    assert_eq!(stage.kv().bytes(), n_ctx * row_bytes);

    // DeepSeek sparse attention: beside each latent row, the indexer's key (one head of
    // 64, f16), and one 64 × 64 f32 rotation for the stage.
    let file = open("kv-deepseek32.gguf", &tiny_model("deepseek32", |w| w)).unwrap();
    let row_bytes = (32 + 4) * 2 + 64 * 2;
    let hp = file.hparams().clone();
    for layer in 0..N_LAYER {
        assert_eq!(hp.layer_kv_cell_bytes(layer, KvTypes::default()), row_bytes);
    }
    let stage = Stage::load(file, span, &StageConfig::new(n_ctx, 1)).unwrap();
    assert_eq!(stage.kv().bytes(), N_LAYER * n_ctx * row_bytes + 64 * 64 * 4);
}

/// Gemma 4's sliding-window layers (0 and 2 of the tiny model) cache 2 heads of 8 per
/// token, its global layer 1 head of 32; the planner counts each layer at its size; a
/// tensor-parallel group is refused with the reason. Its variants baton does not
/// compute are refused with the key named, and experts without their width too.
#[test]
fn gemma4_layers_of_each_kind_have_their_own_heads() {
    let n_ctx = 64;
    let file = open("kv-gemma4.gguf", &tiny_model("gemma4", |w| w)).unwrap();
    let hp = file.hparams().clone();
    let (swa, global) = ((2 * (2 * 8) * 2 * n_ctx) as u64, (2 * 32 * 2 * n_ctx) as u64);
    // Sequences sharing every cell (as the stage below): a cell per token everywhere.
    let per_layer: Vec<u64> = (0..N_LAYER)
        .map(|l| hp.layer_cache_bytes(l, n_ctx, 0, Default::default()))
        .collect();
    assert_eq!(per_layer, [swa, global, swa]);
    let span = StageSpan {
        layers: 0..N_LAYER,
        first: true,
        last: true,
    };
    let stage = Stage::load(file, span, &StageConfig::new(n_ctx, 1)).unwrap();
    assert_eq!(stage.kv().bytes() as u64, 2 * swa + global);
    let err = crate::TpSplit::new(&hp, 0, 2).unwrap_err().to_string();
    assert!(
        err.contains("gemma4's sliding-window layers have heads of their own (2 key/value heads of 8, the global layers 1 of 32)")
            && err.contains("run it as pipeline stages"),
        "{err}"
    );

    let refused = |name: &str, key: &str, value: Value| {
        let bytes = tiny_model("gemma4", |w| w.without_kv(key).kv(key, value));
        err_text(name, &bytes)
    };
    assert_eq!(
        refused("ple.gguf", "gemma4.embedding_length_per_layer_input", Value::U32(256)),
        "bad hyper-parameters: gemma4.embedding_length_per_layer_input 256: per-layer embeddings \
         (Gemma 4 E2B, E4B) are not supported yet"
    );
    assert_eq!(
        refused("shared-kv.gguf", "gemma4.attention.shared_kv_layers", Value::U32(2)),
        "bad hyper-parameters: gemma4.attention.shared_kv_layers 2: layers that reuse an earlier \
         layer's keys and values (Gemma 4 E2B, E4B) are not supported yet"
    );
    let experts = tiny_model("gemma4-moe", |w| w.without_kv("gemma4.expert_feed_forward_length"));
    let err = err_text("experts.gguf", &experts);
    assert!(err.contains("gemma4.expert_feed_forward_length"), "{err}");
    assert_eq!(
        refused("pattern.gguf", "gemma4.attention.sliding_window_pattern", Value::U32(2)),
        "bad hyper-parameters: gemma4.attention.sliding_window_pattern must be an array of one flag per layer"
    );
}

/// Recurrent layers are not split between tensor-parallel members: the group is
/// refused with the kind of layer named.
#[test]
fn tensor_parallelism_refuses_recurrent_layers() {
    for (arch, kind) in [("nemotron_h", "Mamba2"), ("qwen35", "gated DeltaNet")] {
        let file = open(&format!("tp-{arch}.gguf"), &tiny_model(arch, |w| w)).unwrap();
        let err = crate::TpSplit::new(file.hparams(), 0, 2).unwrap_err().to_string();
        assert!(err.contains(&format!("{arch} has recurrent ({kind}) layers")), "{err}");
        assert!(err.contains("run it as pipeline stages"), "{err}");
    }
}

/// DeepSeek sparse attention that baton (or llama.cpp) cannot compute is refused before
/// loading, the key or tensor named: a missing indexer tensor, a gating function that
/// is missing or none (deepseek32), indexer heads the Hadamard rotation does not span,
/// no tokens to choose, and (glm-dsa) a first layer without its own indexer. A stage
/// may not start at a layer that reuses an earlier layer's choice.
#[test]
fn sparse_attention_variants_are_refused_with_the_key_named() {
    let text = |arch: &str, edit: &dyn Fn(GgufWriter) -> GgufWriter| {
        err_text(&format!("dsa-{arch}.gguf"), &tiny_model(arch, edit))
    };
    let set = |key: &'static str, value: Value| move |w: GgufWriter| w.without_kv(key).kv(key, value.clone());
    assert_eq!(
        text("deepseek32", &|w| w.without_tensor("blk.1.indexer.proj.weight")),
        "tensor 'blk.1.indexer.proj.weight' is missing from the model file"
    );
    assert_eq!(
        text("deepseek32", &|w| w.without_kv("deepseek32.expert_gating_func")),
        "GGUF metadata key 'deepseek32.expert_gating_func' is missing"
    );
    assert_eq!(
        text("deepseek32", &set("deepseek32.expert_gating_func", Value::U32(0))),
        "bad hyper-parameters: deepseek32.expert_gating_func is 0 (none): deepseek32's experts need softmax or sigmoid gating"
    );
    assert_eq!(
        text("deepseek32", &set("deepseek32.expert_gating_func", Value::U32(5))),
        "bad hyper-parameters: expert_gating_func 5 is not supported (1 softmax, 2 sigmoid, 3 softmax of the chosen, 4 square root of softplus)"
    );
    assert_eq!(
        text("deepseek32", &set("deepseek32.attention.indexer.key_length", Value::U32(96))),
        "bad hyper-parameters: deepseek32.attention.indexer.key_length is 96: llama.cpp rotates indexer heads by a Walsh-Hadamard matrix of 64, which must be the whole head (64 times a power of two)"
    );
    assert_eq!(
        text("glm-dsa", &set("glm-dsa.attention.indexer.top_k", Value::U32(0))),
        "bad hyper-parameters: glm-dsa.attention.indexer.top_k must not be 0"
    );
    let types = |t: [u32; 3]| Value::Array(t.map(Value::U32).to_vec());
    assert_eq!(
        text("glm-dsa", &set("glm-dsa.attention.indexer.types", types([0, 1, 1]))),
        "bad hyper-parameters: glm-dsa.attention.indexer.types: layer 0 must have its own indexer (type 1), as it has no earlier layer's choice to reuse"
    );

    // Layer 1 reuses layer 0's choice: a stage of layers 1..3 is refused, the whole
    // model runs.
    let shared = tiny_model("glm-dsa", set("glm-dsa.attention.indexer.types", types([1, 0, 1])));
    let file = open("dsa-shared.gguf", &shared).unwrap();
    let err = load_tail(&file, 1..N_LAYER).err().unwrap().to_string();
    assert_eq!(err, "bad stage configuration: a stage cannot start at layer 1: it reuses layer 0's choice of tokens (a shared indexer layer); start stages at layers that have their own indexer (e.g. with --split)");
    assert!(load_tail(&file, 2..N_LAYER).is_ok());
    let logits = chain_logits(&file, &[N_LAYER], &[1, 5, 9, 2, 7, 3]);
    assert!(logits.iter().all(|x| x.is_finite()));
}

/// MiniMax sparse attention that llama.cpp cannot compute is refused before loading,
/// the key or tensor named: indexer heads other than one per key/value head, no
/// blocks to choose or positions per block, heads narrower than their RoPE part, a
/// missing key or indexer tensor, no gating function; and so is splitting it between
/// tensor-parallel members.
#[test]
fn minimax_m3_variants_are_refused_with_the_key_named() {
    let text = |edit: &dyn Fn(GgufWriter) -> GgufWriter| err_text("msa-m3.gguf", &tiny_model("minimax-m3", edit));
    let set = |key: &str, value: u32| {
        let key = format!("minimax-m3.attention.indexer.{key}");
        move |w: GgufWriter| w.without_kv(&key).kv(key.clone(), Value::U32(value))
    };
    assert_eq!(
        text(&set("head_count", 1)),
        "bad hyper-parameters: minimax-m3.attention.indexer.head_count is 1: MiniMax sparse attention has one indexer head per key/value head (2)"
    );
    for key in ["top_k", "block_size", "key_length"] {
        assert_eq!(
            text(&set(key, 0)),
            format!("bad hyper-parameters: minimax-m3.attention.indexer.{key} must not be 0")
        );
    }
    assert_eq!(
        text(&set("key_length", 2)),
        "bad hyper-parameters: minimax-m3.attention.indexer.key_length is 2, narrower than the 4 RoPE dimensions it rotates"
    );
    assert_eq!(
        text(&|w| w.without_kv("minimax-m3.attention.indexer.local_blocks")),
        "GGUF metadata key 'minimax-m3.attention.indexer.local_blocks' is missing"
    );
    assert_eq!(
        text(&|w| w.without_kv("minimax-m3.expert_gating_func")),
        "GGUF metadata key 'minimax-m3.expert_gating_func' is missing"
    );
    assert_eq!(
        text(&|w| w.without_tensor("blk.2.indexer.q_proj.weight")),
        "tensor 'blk.2.indexer.q_proj.weight' is missing from the model file"
    );
    let file = open("tp-minimax-m3.gguf", &tiny_model("minimax-m3", |w| w)).unwrap();
    let err = crate::TpSplit::new(file.hparams(), 0, 2).unwrap_err().to_string();
    assert_eq!(err, "bad stage configuration: minimax-m3's sparse attention (MSA) chooses blocks per key/value head from indexer heads that baton does not split between tensor-parallel members; run it as pipeline stages");
}

/// MiniMax sparse attention's inputs: blocks over positions padded as llama.cpp pads
/// them, a row's own block and the `local - 1` before it forced, and without regions each
/// run of one sequence's rows a span of its own (its blocks are its sequence's), with
/// the maps between its positions and cells.
#[test]
fn minimax_m3_spans_and_maps_follow_each_sequence() {
    use crate::arch::msa::{local_blocks, span_positions};
    let n_pos = |end: i32, block| span_positions(&[end - 1], block);
    assert_eq!(
        (n_pos(1, 4), n_pos(256, 64), n_pos(257, 4), n_pos(10, 96)),
        (256, 256, 512, 288)
    );
    assert_eq!(
        local_blocks(&[0, 9], 4, 4, 2),
        [1e30, 0.0, 0.0, 0.0, 0.0, 1e30, 1e30, 0.0]
    );

    let file = open("msa-spans.gguf", &tiny_model("minimax-m3", |w| w)).unwrap();
    let mut kv = crate::KvCache::new(file.hparams(), 0..N_LAYER, 64, 0).unwrap();
    // Sequence 0 at positions 0..3, sequence 1 at 0..2, interleaved in the cells.
    kv.claim(&[0, 1, 0, 1, 0], &[0, 0, 1, 1, 2]).unwrap();
    let spans = kv.attention_spans(&[0, 0, 1, 0]);
    let rows: Vec<_> = spans.iter().map(|s| s.rows.clone()).collect();
    assert_eq!(rows, [0..2, 2..3, 3..4]);
    assert!(spans.iter().all(|s| s.cells == (0..64)));
    assert_eq!(kv.pos_cells(1, 0..64, 4), [1, 3, 0, 0]);
    assert_eq!(&kv.cell_blocks(0, 0..64, 2)[..5], [0, 0, 0, 0, 1]);
    let inf = f32::NEG_INFINITY;
    assert_eq!(kv.pos_mask(&[0, 1], &[1, 1], 0..64, 3), [0.0, 0.0, inf, 0.0, 0.0, inf]);
}

/// GLM-5.2's shared indexer layers without `attention.indexer.types`: llama.cpp's
/// default pattern for a model trained on 1M-token contexts (layers 0, 1 and every 4th
/// from 2 have their own indexer); GLM-5 and 5.1 (shorter contexts) have one in every
/// layer.
#[test]
fn glm_dsa_without_indexer_types_takes_llama_cpps_default() {
    let arch = crate::arch::find("glm-dsa").unwrap();
    let shape = Shape { n_layer: 11, ..shape() };
    let full_layers = |n_ctx: u32| {
        let mut writer = GgufWriter::new();
        for (key, value) in crate::example::example_metadata(arch, &shape) {
            writer = writer.without_kv(&key).kv(key, value);
        }
        let writer = writer
            .without_kv("glm-dsa.attention.indexer.types")
            .without_kv("glm-dsa.context_length")
            .kv("glm-dsa.context_length", Value::U32(n_ctx));
        let header = baton_gguf::Gguf::parse(&writer.to_bytes()).unwrap();
        let hp = crate::HParams::from_metadata(&header, N_VOCAB as usize).unwrap();
        hp.indexer().unwrap().full_layers.clone()
    };
    let (t, s) = (true, false);
    assert_eq!(full_layers(1 << 20), [t, t, t, s, s, s, t, s, s, s, t]);
    assert_eq!(full_layers((1 << 20) - 1), [t; 11]);
}

/// Kimi Linear's tiny model: KDA in layers 0 and 2, MLA in layer 1. Each KDA layer keeps
/// states (the convolution's last 3 inputs of its queries', keys' and values' 3 × 32
/// channels, and 4 heads of 8 × 8), the MLA layer one latent row of 32 plus 4 RoPE
/// dims (f16) per cell; a tensor-parallel group is refused with the reason.
#[test]
fn kimi_linear_caches_states_and_latent_rows_by_layer_kind() {
    let n_ctx = 64;
    let file = open("kv-kimi-linear.gguf", &tiny_model("kimi-linear", |w| w)).unwrap();
    let hp = file.hparams().clone();
    let ssm = hp.ssm.clone().unwrap();
    assert_eq!((ssm.conv_state_len(), ssm.state_len()), (3 * 3 * 32, 4 * 8 * 8));
    let states = (crate::recurrent::state_rows(1) * (ssm.conv_state_len() + ssm.state_len()) * 4) as u64;
    let row_bytes = (32 + 4) * 2;
    let per_layer: Vec<u64> = (0..N_LAYER)
        .map(|l| hp.layer_cache_bytes(l, n_ctx, 1, KvTypes::default()))
        .collect();
    assert_eq!(per_layer, [states, (n_ctx * row_bytes) as u64, states]);
    let span = StageSpan {
        layers: 0..N_LAYER,
        first: true,
        last: true,
    };
    let stage = Stage::load(file.clone(), span, &StageConfig::new(n_ctx, 1)).unwrap();
    assert_eq!(stage.kv().bytes(), n_ctx * row_bytes);
    assert!(stage.recurrent().bytes() as u64 >= 2 * states);

    let err = crate::TpSplit::new(&hp, 0, 2).unwrap_err().to_string();
    assert!(
        err.contains("kimi-linear has recurrent (Kimi Delta Attention) layers") && err.contains("pipeline stages"),
        "{err}"
    );
}

/// Convolution weights with the trailing dimension a converter may write
/// (`[d_conv, 1, channels, 1]`) and `ssm_a` as `[1, n_head, 1, 1]`, which llama.cpp
/// takes too: the same values, the same logits.
#[test]
fn kimi_linear_takes_convolutions_with_trailing_dimensions_of_1() {
    let tokens = [1, 5, 9, 2, 7, 3];
    let plain = tiny_model("kimi-linear", |w| w);
    let header = baton_gguf::Gguf::parse(&plain).unwrap();
    let four_d = tiny_model("kimi-linear", |mut w| {
        for info in header
            .tensors
            .iter()
            .filter(|t| t.name.contains("ssm_conv1d") || t.name.ends_with(".ssm_a"))
        {
            let values: Vec<f32> = header
                .tensor_data(&plain, &info.name)
                .unwrap()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                .collect();
            let mut dims = info.dims.clone();
            dims.resize(4, 1);
            w = w
                .without_tensor(&info.name)
                .tensor_f32(info.name.clone(), &dims, &values);
        }
        w
    });
    let four_d_file = open("kimi-linear-4d.gguf", &four_d).unwrap();
    let conv = four_d_file.gguf().tensor("blk.0.ssm_conv1d_q.weight").unwrap();
    assert_eq!(conv.dims, [4, 1, 32, 1]);
    let plain_file = open("kimi-linear-3d.gguf", &plain).unwrap();
    assert_eq!(
        chain_logits(&four_d_file, &[N_LAYER], &tokens),
        chain_logits(&plain_file, &[N_LAYER], &tokens)
    );

    // Another shape is still refused, the tensor named.
    let wrong = tiny_model("kimi-linear", |w| {
        w.without_tensor("blk.2.ssm_conv1d_v.weight")
            .tensor_f32("blk.2.ssm_conv1d_v.weight", &[4, 2, 16], &[0.0; 128])
    });
    assert_eq!(
        err_text("kimi-linear-wrong.gguf", &wrong),
        "tensor 'blk.2.ssm_conv1d_v.weight' has shape [4, 2, 16], expected [4, 1, 32]"
    );
}

/// Kimi Linear files llama.cpp cannot compute are refused before loading, the key or
/// tensor named: no gating function or none (llama.cpp requires one), no KDA head size,
/// compressed queries (llama.cpp's graph reads `attn_q` only), the MLA projections of
/// files converted before MLA (one `attn_kv_b`).
#[test]
fn kimi_linear_variants_are_refused_with_the_key_or_tensor_named() {
    let text = |name: &str, edit: &dyn Fn(GgufWriter) -> GgufWriter| {
        err_text(&format!("kimi-{name}.gguf"), &tiny_model("kimi-linear", edit))
    };
    assert_eq!(
        text("gating", &|w| w.without_kv("kimi-linear.expert_gating_func")),
        "GGUF metadata key 'kimi-linear.expert_gating_func' is missing"
    );
    assert_eq!(
        text("gating-0", &|w| w
            .without_kv("kimi-linear.expert_gating_func")
            .kv("kimi-linear.expert_gating_func", Value::U32(0))),
        "bad hyper-parameters: kimi-linear.expert_gating_func is 0 (none): the router has no gating function"
    );
    assert_eq!(
        text("head", &|w| w.without_kv("kimi-linear.kda.head_dim")),
        "GGUF metadata key 'kimi-linear.kda.head_dim' is missing"
    );
    assert_eq!(
        text("q-a", &|w| w.tensor_f32("blk.1.attn_q_a.weight", &[N_EMBD, 8], &[0.0; 256])),
        "tensor 'blk.1.attn_q_a.weight' is not part of baton's kimi-linear architecture; refusing to compute without it"
    );
    assert_eq!(
        text("kv-b", &|w| w.without_tensor("blk.1.attn_k_b.weight")),
        "tensor 'blk.1.attn_k_b.weight' is missing from the model file"
    );
}

/// Kimi K3's tiny model (KDA, MLA, KDA; residual attention banking layers 0 and 2's
/// inputs): the banked inputs travel with the hidden state, so a stage starting at layer
/// 1 or 2 takes one more row of `n_embd` per token than the hidden state, and every split
/// gives the logits of the whole model; without residual attention (`attn_res.block_size`
/// 0) nothing but the hidden state travels. A tensor-parallel group is refused with the
/// reason; files llama.cpp cannot read or baton cannot compute are refused with the key
/// or tensor named.
#[test]
fn kimi_k3_carries_its_banked_inputs_between_stages_and_refuses_variants_it_cannot_compute() {
    let file = open("kimi-k3.gguf", &tiny_model("kimi-k3", |w| w)).unwrap();
    let hp = file.hparams();
    let carried: Vec<usize> = (0..=N_LAYER).map(|l| hp.carried_width(l) / hp.n_embd).collect();
    assert_eq!(carried, [1, 2, 2, 3]);
    let tokens = [1, 5, 9, 2, 7, 3];
    let whole = chain_logits(&file, &[N_LAYER], &tokens);
    assert!(whole.iter().all(|x| x.is_finite()));
    for sizes in [&[1, 2][..], &[2, 1], &[1, 1, 1]] {
        assert_eq!(chain_logits(&file, sizes, &tokens), whole, "stages of {sizes:?}");
    }

    let plain = tiny_model("kimi-k3", |w| {
        let w = w
            .without_kv("kimi-k3.attn_res.block_size")
            .kv("kimi-k3.attn_res.block_size", Value::U32(0))
            .without_tensor("output_res_score.weight");
        (0..N_LAYER).fold(w, |w, l| {
            w.without_tensor(&format!("blk.{l}.attn_res_score.weight"))
                .without_tensor(&format!("blk.{l}.ffn_res_score.weight"))
        })
    });
    let plain = open("kimi-k3-plain.gguf", &plain).unwrap();
    let hp = plain.hparams();
    assert!((0..=N_LAYER).all(|l| hp.carried_width(l) == hp.n_embd));
    let whole = chain_logits(&plain, &[N_LAYER], &tokens);
    assert_eq!(chain_logits(&plain, &[1, 2], &tokens), whole);
    assert_eq!(chain_logits(&plain, &[1, 1, 1], &tokens), whole);

    let err = crate::TpSplit::new(file.hparams(), 0, 2).unwrap_err().to_string();
    assert!(
        err.contains("kimi-k3 has recurrent (Kimi Delta Attention) layers") && err.contains("pipeline stages"),
        "{err}"
    );

    let text = |name: &str, edit: &dyn Fn(GgufWriter) -> GgufWriter| {
        err_text(&format!("kimi-k3-{name}.gguf"), &tiny_model("kimi-k3", edit))
    };
    assert_eq!(
        text("res", &|w| w.without_kv("kimi-k3.attn_res.block_size")),
        "GGUF metadata key 'kimi-k3.attn_res.block_size' is missing"
    );
    assert_eq!(
        text("situ", &|w| w.without_kv("kimi-k3.activation.situ_linear_beta")),
        "GGUF metadata key 'kimi-k3.activation.situ_linear_beta' is missing"
    );
    assert_eq!(
        text("situ-0", &|w| w
            .without_kv("kimi-k3.activation.situ_beta")
            .kv("kimi-k3.activation.situ_beta", Value::F32(0.0))),
        "bad hyper-parameters: kimi-k3.activation.situ_beta 0 and kimi-k3.activation.situ_linear_beta 2: situ divides by both (the first must be positive, both finite)"
    );
    assert_eq!(
        text("low-rank-gate", &|w| w.tensor_f32(
            "blk.0.ssm_g_a.weight",
            &[N_EMBD, 8],
            &[0.0; 256]
        )),
        "tensor 'blk.0.ssm_g_a.weight' is not part of baton's kimi-k3 architecture; refusing to compute without it"
    );
    assert_eq!(
        text("kv-b", &|w| w.without_tensor("blk.1.attn_k_b.weight")),
        "tensor 'blk.1.attn_k_b.weight' is missing from the model file"
    );
    // Residual scores in a file without residual attention (llama.cpp counts them as
    // tensors it did not create).
    assert_eq!(
        text("scores", &|w| w
            .without_kv("kimi-k3.attn_res.block_size")
            .kv("kimi-k3.attn_res.block_size", Value::U32(0))),
        "tensor 'output_res_score.weight' is not part of baton's kimi-k3 architecture; refusing to compute without it"
    );
}

/// GLM-5 next variants baton (or llama.cpp) cannot compute are refused before loading,
/// the key or tensor named: RoPE in its MLA heads (llama.cpp asserts none), blocks that
/// do not divide the tokens chosen or of fewer than 2 tokens, no block size, no shared
/// expert, a missing k-pool tensor, a first MLA layer that reuses a choice. Its SwiGLU
/// clamps are read as llama.cpp reads them.
#[test]
fn glm5_next_variants_are_refused_with_the_key_or_tensor_named() {
    let text = |name: &str, edit: &dyn Fn(GgufWriter) -> GgufWriter| {
        err_text(&format!("glm5-next-{name}.gguf"), &tiny_model("glm5-next", edit))
    };
    let set = |key: &'static str, value: Value| move |w: GgufWriter| w.without_kv(key).kv(key, value.clone());
    assert_eq!(
        text("rope", &set("glm5-next.rope.dimension_count", Value::U32(8))),
        "bad hyper-parameters: glm5-next.rope.dimension_count is 8 (or missing): GLM-5 next's MLA heads have no RoPE part and llama.cpp asserts 0"
    );
    assert_eq!(
        text("kpool-3", &set("glm5-next.attention.indexer.kpool", Value::U32(3))),
        "bad hyper-parameters: glm5-next.attention.indexer.kpool is 3: blocks of at least 2 tokens that divide glm5-next.attention.indexer.top_k (8)"
    );
    assert_eq!(
        text("kpool-1", &set("glm5-next.attention.indexer.kpool", Value::U32(1))),
        "bad hyper-parameters: glm5-next.attention.indexer.kpool is 1: blocks of at least 2 tokens that divide glm5-next.attention.indexer.top_k (8)"
    );
    assert_eq!(
        text("kpool-none", &|w| w.without_kv("glm5-next.attention.indexer.kpool")),
        "GGUF metadata key 'glm5-next.attention.indexer.kpool' is missing"
    );
    assert_eq!(
        text("shexp", &set("glm5-next.expert_shared_count", Value::U32(0))),
        "bad hyper-parameters: glm5-next.expert_shared_count is 0: glm5-next's layers always add a shared expert"
    );
    assert_eq!(
        text("gate", &|w| w.without_tensor("blk.1.indexer_compressor_gate.weight")),
        "tensor 'blk.1.indexer_compressor_gate.weight' is missing from the model file"
    );
    let types = Value::Array([1, 0, 1].map(Value::U32).to_vec());
    assert_eq!(
        text("types", &set("glm5-next.attention.indexer.types", types)),
        "bad hyper-parameters: glm5-next.attention.indexer.types: layer 1, the first MLA layer, must have its own indexer (type 1), as it has no earlier layer's choice to reuse"
    );
    // SwiGLU clamps: one value for every layer, the shared experts' (and dense FFNs')
    // the routed experts' unless given, per layer.
    let clamps = |edit: &dyn Fn(GgufWriter) -> GgufWriter| {
        let file = open("glm5-next-clamps.gguf", &tiny_model("glm5-next", edit)).unwrap();
        file.hparams().moe.swiglu_clamps.clone()
    };
    assert_eq!(clamps(&|w| w), None);
    let exp = set("glm5-next.swiglu_clamp_exp", Value::F32(7.0));
    let both = clamps(&exp).unwrap();
    assert_eq!((both.exp, both.shexp), (vec![7.0; N_LAYER], vec![7.0; N_LAYER]));
    let shexp = Value::Array(vec![Value::F32(0.0), Value::F32(0.0), Value::F32(10.0)]);
    let shexp = set("glm5-next.swiglu_clamp_shexp", shexp);
    let own = clamps(&|w| shexp(exp(w))).unwrap();
    assert_eq!((own.exp, own.shexp), (vec![7.0; N_LAYER], vec![0.0, 0.0, 10.0]));
}

/// GLM-5 next with 5 layers (KDA, MLA, KDA, MLA, KDA), layer 3 reusing layer 1's choice
/// of tokens: a stage may not start at layer 2 or 3 (it would reach layer 3 without
/// the choice), it may at 4; the whole model runs. Each MLA layer with its own indexer
/// caches a key and its gate scores per token.
#[test]
fn glm5_next_shared_indexer_layers_keep_their_choice_on_their_stage() {
    let arch = crate::arch::find("glm5-next").unwrap();
    let shape = Shape { n_layer: 5, ..shape() };
    let options = ExampleOptions {
        n_vocab: N_VOCAB as usize,
        seed: 7,
        tied_output: true,
        optional_tensors: true,
    };
    let key = "glm5-next.attention.indexer.types";
    let types = Value::Array([1, 1, 1, 0, 1].map(Value::U32).to_vec());
    let bytes = example_gguf(arch, &shape, &options, Vec::new())
        .unwrap()
        .without_kv(key)
        .kv(key, types)
        .to_bytes();
    let file = open("glm5-next-shared.gguf", &bytes).unwrap();
    let hp = file.hparams();
    let ix = hp.indexer().unwrap();
    assert_eq!(ix.full_layers, [true, true, false, false, true]);
    let types = KvTypes::default();
    assert_eq!(hp.indexer_cell_bytes(1, types), types.k.row_bytes(2 * ix.head_dim));
    assert_eq!(hp.indexer_cell_bytes(3, types), 0);
    for start in [2, 3] {
        let err = load_tail(&file, start..5).err().unwrap().to_string();
        assert!(err.contains(&format!("a stage cannot start at layer {start}")), "{err}");
    }
    assert!(load_tail(&file, 4..5).is_ok());
    let logits = chain_logits(&file, &[5], &[1, 5, 9, 2, 7, 3, 4, 8, 6]);
    assert!(logits.iter().all(|x| x.is_finite()));
}

/// DeepSeek V4's residual stream is four copies of the hidden state (hyper-connections):
/// that is what a stage sends and takes, and a stage refuses one copy's width.
#[test]
fn deepseek4_stages_pass_all_four_streams() {
    let file = open("deepseek4-streams.gguf", &tiny_model("deepseek4", |w| w)).unwrap();
    assert_eq!(file.hparams().hidden_width(), 4 * N_EMBD as usize);
    let tokens = [1u32, 5, 9];
    let positions = [0, 1, 2];
    let first = StageSpan {
        layers: 0..1,
        first: true,
        last: false,
    };
    let mut stage = Stage::load(file.clone(), first, &config()).unwrap();
    let batch = |input| Batch {
        input,
        positions: &positions,
        seq_ids: &[0; 3],
        logit_rows: &[],
        decode: false,
    };
    let StageOutput::Hidden(hidden) = stage
        .forward(&batch(StageInput::Tokens(&tokens)), LogitReply::Logits)
        .unwrap()
    else {
        panic!("a first stage sends hidden states")
    };
    assert_eq!(hidden.len(), 3 * 4 * N_EMBD as usize);
    let rest = StageSpan {
        layers: 1..N_LAYER,
        first: false,
        last: false,
    };
    let mut stage = Stage::load(file, rest, &config()).unwrap();
    let one_stream = &hidden[..3 * N_EMBD as usize];
    let err = stage
        .forward(&batch(StageInput::Hidden(one_stream)), LogitReply::Logits)
        .unwrap_err()
        .to_string();
    assert!(err.contains("hidden state of 96 floats, expected 3 x 128"), "{err}");
    assert!(stage
        .forward(&batch(StageInput::Hidden(&hidden)), LogitReply::Logits)
        .is_ok());
}

/// DeepSeek V4's compressed layers (1: compressed sparse attention, 2: heavily
/// compressed, in the tiny model) keep each token's compressor rows (and layer 1 its
/// indexer's), f32 in a cell of every token, beside their window's keys: a stage holds
/// what the planner counts, with and without regions per sequence.
#[test]
fn deepseek4_compressor_rows_are_what_the_planner_counts() {
    let file = open("deepseek4-counted.gguf", &tiny_model("deepseek4", |w| w)).unwrap();
    let hp = file.hparams().clone();
    for n_seq in [0, 2] {
        let config = StageConfig { n_seq, ..config() };
        let span = StageSpan {
            layers: 0..N_LAYER,
            first: true,
            last: true,
        };
        let stage = Stage::load(file.clone(), span, &config).unwrap();
        let kv = stage.kv();
        let with_rows: Vec<bool> = (0..N_LAYER).map(|l| kv.compressor(l).is_some()).collect();
        assert_eq!(with_rows, [false, true, true]);
        let (d, ix) = (hp.head_dim_k, hp.dsv4.as_ref().unwrap().indexer_heads.1);
        assert_eq!(kv.indexer_compressor(1).map(|t| t.ne()[0]), Some(4 * ix as i64));
        assert!(kv.indexer_compressor(2).is_none() && kv.compressor_rotation().is_some());
        let rows = (4 * d + 4 * ix + 2 * d) * std::mem::size_of::<f32>() * config.n_ctx;
        let counted: u64 = (0..N_LAYER)
            .map(|l| hp.layer_cache_bytes(l, config.n_ctx, n_seq, config.kv_types))
            .sum();
        let keys = (0..N_LAYER)
            .map(|l| hp.layer_cache_bytes(l, config.n_ctx, n_seq, config.kv_types))
            .next()
            .unwrap();
        assert_eq!(counted, 3 * keys + rows as u64, "{n_seq} sequences");
        // Besides: the indexer's Walsh-Hadamard matrix, once per stage.
        let held = kv.bytes() as u64 - (ix * ix * std::mem::size_of::<f32>()) as u64;
        assert!(
            held >= counted && held <= counted + 64 * 3 * N_LAYER as u64,
            "{n_seq} sequences: {held} held, {counted} counted"
        );
    }
}

/// What baton cannot compute of DeepSeek V4 (compressed attention) and what llama.cpp
/// refuses too is refused before loading, with the key, layer or tensor named; a stage
/// cannot start inside the hash-routed layers; tensor parallelism refuses the streams.
#[test]
fn deepseek4_variants_are_refused_with_the_key_or_tensor_named() {
    let text = |name: &str, edit: &dyn Fn(GgufWriter) -> GgufWriter| {
        err_text(&format!("deepseek4-{name}.gguf"), &tiny_model("deepseek4", edit))
    };
    let set = |key: &'static str, value: Value| move |w: GgufWriter| w.without_kv(key).kv(key, value.clone());
    // 3 trunk layers and the prediction layer (ratio 4 in the example).
    let ratios = |r: [u32; 4]| Value::Array(r.map(Value::U32).to_vec());
    let ratios_key = "deepseek4.attention.compress_ratios";
    // Compressed layers need their compressor (and the indexer's): layer 0 (ratio 0
    // in the file) made a compressed one lacks it.
    assert_eq!(
        text("hca", &set(ratios_key, ratios([128, 4, 128, 4]))),
        "tensor 'blk.0.attn_compressor_kv.weight' is missing from the model file"
    );
    assert_eq!(
        text("csa", &set(ratios_key, ratios([4, 4, 128, 4]))),
        "tensor 'blk.0.attn_compressor_kv.weight' is missing from the model file"
    );
    assert_eq!(
        text("csa-indexer", &|w| w
            .without_tensor("blk.1.indexer_compressor_ape.weight")),
        "tensor 'blk.1.indexer_compressor_ape.weight' is missing from the model file"
    );
    assert!(
        text("csa-top-k", &set("deepseek4.attention.indexer.top_k", Value::U32(0)))
            .contains("compressed sparse layers choose blocks with at least one indexer head, and at least one block")
    );
    assert_eq!(
        text(
            "csa-rotation",
            &set("deepseek4.attention.indexer.key_length", Value::U32(96))
        ),
        "bad hyper-parameters: deepseek4.attention.indexer.key_length is 96: llama.cpp multiplies the \
         lightning indexer's heads by a Walsh-Hadamard matrix, which baton takes of the whole head only \
         (64 times a power of two)"
    );
    assert!(text("ratio", &set(ratios_key, ratios([0, 0, 7, 4])))
        .contains("compress_ratios[2] is 7: a compression ratio llama.cpp does not know either"));
    assert_eq!(
        text("short", &set(ratios_key, Value::Array(vec![Value::U32(0); 3]))),
        "bad hyper-parameters: deepseek4.attention.compress_ratios has 3 entries for 4 layers"
    );
    assert_eq!(
        text("gating", &set("deepseek4.expert_gating_func", Value::U32(2))),
        "bad hyper-parameters: deepseek4.expert_gating_func is 2: llama.cpp's deepseek4 scores experts by sqrt(softplus) (4) only"
    );
    assert!(
        text("kv-heads", &set("deepseek4.attention.head_count_kv", Value::U32(2)))
            .contains("attention.head_count_kv 2 must be 1")
    );
    assert_eq!(
        text(
            "rotation",
            &set("deepseek4.attention.indexer.key_length", Value::U32(8))
        ),
        "bad hyper-parameters: deepseek4.attention.indexer.key_length equals deepseek4.attention.key_length (8): \
         llama.cpp then rotates the raw window's keys by a Hadamard matrix, which baton does not"
    );
    assert_eq!(
        text("clamp", &|w| w.without_kv("deepseek4.swiglu_clamp_exp")),
        "GGUF metadata key 'deepseek4.swiglu_clamp_exp' is missing"
    );
    assert_eq!(
        text("streams", &set("deepseek4.hyper_connection.count", Value::U32(2))),
        "bad hyper-parameters: deepseek4.hyper_connection.count is 2: llama.cpp's hyper-connections (and ggml's fused ops) have 4 streams"
    );
    assert_eq!(
        text("hash", &|w| w.without_tensor("blk.0.ffn_gate_tid2eid.weight")),
        "tensor 'blk.0.ffn_gate_tid2eid.weight' is missing from the model file"
    );
    let table = text("hash-f32", &|w| {
        w.without_tensor("blk.0.ffn_gate_tid2eid.weight").tensor_f32(
            "blk.0.ffn_gate_tid2eid.weight",
            &[2, N_VOCAB],
            &[0.0; 2 * N_VOCAB as usize],
        )
    });
    assert!(
        table.contains("blk.0.ffn_gate_tid2eid.weight") && table.contains("i32"),
        "{table}"
    );
    assert_eq!(
        text("out-a", &|w| w.without_tensor("blk.2.attn_output_a.weight")),
        "tensor 'blk.2.attn_output_a.weight' is missing from the model file"
    );
    assert_eq!(
        text("compressor", &|w| w.tensor_f32("blk.0.attn_compressor_kv.weight", &[N_EMBD, 16], &[0.0; 32 * 16])),
        "tensor 'blk.0.attn_compressor_kv.weight' is not part of baton's deepseek4 architecture; refusing to compute without it"
    );

    // Two hash-routed layers: a stage starting at layer 1 would lack the token ids.
    let hashed = tiny_model("deepseek4", |w| {
        let w = set("deepseek4.hash_layer_count", Value::U32(2))(w).without_tensor("blk.1.exp_probs_b.bias");
        let ids: Vec<u8> = (0..2 * N_VOCAB as i32).flat_map(|i| (i % 4).to_le_bytes()).collect();
        w.tensor_raw("blk.1.ffn_gate_tid2eid.weight", &[2, N_VOCAB], GgmlType::I32, ids)
    });
    let file = open("deepseek4-hashed.gguf", &hashed).unwrap();
    let err = load_tail(&file, 1..N_LAYER).err().unwrap().to_string();
    assert_eq!(
        err,
        "bad stage configuration: a stage cannot start at layer 1: deepseek4's first 2 layers (hash_layer_count) \
         choose experts by the token ids, which only the first stage has; start stages at layer 0 or from layer 2"
    );
    assert!(load_tail(&file, 2..N_LAYER).is_ok());
    let tokens = [1, 5, 9, 2, 7, 3];
    assert_eq!(
        chain_logits(&file, &[2, 1], &tokens),
        chain_logits(&file, &[N_LAYER], &tokens)
    );

    let err = crate::TpSplit::new(file.hparams(), 0, 2).unwrap_err().to_string();
    assert!(
        err.contains("4 copies of the hidden state (hyper-connections)"),
        "{err}"
    );
}
