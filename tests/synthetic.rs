//! Architectures whose real models are too large for CI, on synthetic models (random
//! weights, a real tokenizer, quantized by libllama): 1, 2 and 3 in-process stages and
//! 2 TCP workers reproduce libllama, and batching other sequences changes nothing.

mod common;

use baton_cluster::{connect_cluster, ClusterOptions};
use baton_ggml::{FileType, LlamaContext, LlamaModel};
use baton_gguf::Value;
use baton_model::{CacheType, KvTypes, ModelFile, StageConfig};
use common::fidelity::{check_prompts, check_stages, check_stages_with, Setup, SHORT, THREADS};
use common::synth::{llama4_prompts, synth_dir, synthetic, synthetic_with, LLAMA4_SETUP};
use common::worker::{greedy_in, reference_in, WorkerProc};
use common::{nmse, Chain, PROMPTS};

/// One test at a time: each runs ggml threads that spin while they wait, and tests side
/// by side on two cores starve each other (the whole file: 855 s in parallel, 90 s one
/// after another, measured on this 2-core machine).
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// libllama's logits after each of `chunks` (a prompt's batches), then after each of
/// `n_decode` greedy steps, and the greedy tokens.
fn libllama_steps(ctx: &mut LlamaContext, chunks: &[&[u32]], n_decode: usize) -> (Vec<Vec<f32>>, Vec<u32>) {
    let mut logits: Vec<Vec<f32>> = chunks.iter().map(|chunk| ctx.decode(chunk).unwrap()).collect();
    let mut tokens = Vec::new();
    for _ in 0..n_decode {
        let next = baton_sample::argmax(logits.last().unwrap()).unwrap();
        tokens.push(next);
        logits.push(ctx.decode(&[next]).unwrap());
    }
    (logits, tokens)
}

fn stages(arch: &str, file_type: FileType) {
    let path = synthetic(arch, file_type);
    let worst = check_stages(&path, &format!("{arch} {}", file_type.name()));
    println!("{arch} {}: worst NMSE {worst:.3e}", file_type.name());
}

fn two_workers(arch: &str, file_type: FileType) {
    let path = synthetic(arch, file_type);
    let oracle = LlamaModel::load_vocab(&path).unwrap();
    let prompts: Vec<(String, Vec<u32>)> = PROMPTS
        .iter()
        .map(|text| (format!("{text:?}"), oracle.tokenize(text, true, true).unwrap()))
        .collect();
    two_workers_on(arch, &path, &prompts, SHORT);
}

/// Greedy continuations of `prompts` through 2 TCP workers against libllama's, in
/// contexts of `setup`.
fn two_workers_on(arch: &str, path: &std::path::Path, prompts: &[(String, Vec<u32>)], setup: Setup) {
    const TOKEN: &str = "synthetic-secret";
    let oracle = LlamaModel::load_full(path, true).unwrap();
    let w0 = WorkerProc::start(&synth_dir(), Some(TOKEN), &[]);
    let w1 = WorkerProc::start(&synth_dir(), Some(TOKEN), &[]);
    let options = ClusterOptions {
        token: Some(TOKEN.into()),
        n_ctx: setup.n_ctx,
        kv_types: setup.kv_types,
        repack: true,
        ..Default::default()
    };
    let mut ring = connect_cluster(path, &[w0.addr.clone(), w1.addr.clone()], &options).unwrap();
    assert_eq!(ring.plan.stages.len(), 2);
    assert!(
        ring.workers.iter().all(|w| w.streamed == 0),
        "both workers hold the file"
    );
    for (prompt_text, prompt) in prompts {
        let expected = reference_in(&oracle, prompt, 32, setup);
        println!(
            "{arch} {prompt_text}: {} tokens {:?}",
            expected.len(),
            oracle.detokenize(&expected, false)
        );
        assert_eq!(
            greedy_in(&mut ring, prompt, 32, &oracle, setup.n_batch),
            expected,
            "{arch}: {prompt_text}"
        );
    }
}

/// A hybrid (gated DeltaNet and attention layers) with a quantized KV cache: its
/// attention layers cache keys as q8_0 and values as q4_0, its recurrent states stay
/// f32, and 1 and 2 stages (logits bit for bit) and 2 TCP workers (the types travel in
/// the head's plan) give libllama's tokens with the same `-ctk q8_0 -ctv q4_0`; every
/// other type llama.cpp takes matches it too (one stage each).
#[test]
fn qwen35_with_a_quantized_kv_cache_matches_llama_cpp() {
    let _serial = serial();
    let path = synthetic("qwen35", FileType::Q4KM);
    let oracle = LlamaModel::load_vocab(&path).unwrap();
    let text = PROMPTS[2];
    let prompts = [(format!("{text:?}"), oracle.tokenize(text, true, true).unwrap())];
    let setup = Setup {
        kv_types: KvTypes {
            k: CacheType::Q8_0,
            v: CacheType::Q4_0,
        },
        ..SHORT
    };
    let worst = check_prompts(&path, "qwen35 q8_0/q4_0", &[1, 2], &prompts, setup);
    assert_eq!(worst, 0.0, "the logits are llama.cpp's bit for bit");
    two_workers_on("qwen35 q8_0/q4_0", &path, &prompts, setup);
    // The other types llama.cpp's -ctk/-ctv take, one stage each: f32 (read as f16 by
    // flash attention on both sides), bf16, and the other quantized ones.
    for (k, v) in [
        (CacheType::F32, CacheType::Bf16),
        (CacheType::Q5_1, CacheType::Iq4Nl),
        (CacheType::Q4_1, CacheType::Q5_0),
    ] {
        let setup = Setup {
            kv_types: KvTypes { k, v },
            ..SHORT
        };
        let worst = check_prompts(&path, &format!("qwen35 {k}/{v}"), &[1], &prompts, setup);
        assert_eq!(worst, 0.0, "{k}/{v}: the logits are llama.cpp's bit for bit");
    }
}

#[test]
fn qwen35_matches_llama_cpp_with_1_2_3_stages() {
    let _serial = serial();
    stages("qwen35", FileType::Q4KM);
}

#[test]
fn qwen35moe_matches_llama_cpp_with_1_2_3_stages() {
    let _serial = serial();
    stages("qwen35moe", FileType::Q4KM);
}

#[test]
fn qwen3next_matches_llama_cpp_with_1_2_3_stages() {
    let _serial = serial();
    stages("qwen3next", FileType::Q4KM);
}

#[test]
fn qwen3next_on_two_workers_matches_llama_cpp() {
    let _serial = serial();
    two_workers("qwen3next", FileType::Q4KM);
}

/// Other hybrid shapes: 5 layers (attention in layers 1 and 3, so stages end on either
/// kind and the last layer is recurrent) and 8 value heads sharing 2 key heads, in both
/// ways of sharing them (qwen35 alternates, qwen3next repeats each key head).
#[test]
fn hybrid_models_of_other_shapes_match_llama_cpp() {
    let _serial = serial();
    for arch in ["qwen35", "qwen3next"] {
        let path = synthetic_with(arch, FileType::Q4KM, |spec| {
            spec.shape.n_layer = 5;
            spec.shape.n_head = 8;
            spec.shape.n_head_kv = 2;
        });
        let worst = check_stages(&path, &format!("{arch} 5 layers, 8 heads"));
        println!("{arch} 5 layers, 8 heads: worst NMSE {worst:.3e}");
    }
}

/// Kimi Linear: Kimi Delta Attention in layers 0 and 2, MLA without RoPE in 1 and 3
/// (so every split of 2 or 3 stages has a boundary between the two kinds), experts
/// after the dense layer 0; then 5 layers (the last one KDA) of 8 heads, and 3 layers
/// with heads of 32. Logits bit for bit, greedy tokens equal.
#[test]
fn kimi_linear_matches_llama_cpp_with_1_2_3_stages() {
    let _serial = serial();
    let path = synthetic("kimi-linear", FileType::Q4KM);
    let worst = check_stages(&path, "kimi-linear");
    assert_eq!(worst, 0.0, "kimi-linear: the logits are llama.cpp's bit for bit");
    for (label, n_layer, n_head, head_dim) in [("5 layers, 8 heads", 5, 8, 64), ("3 layers, heads of 32", 3, 4, 32)] {
        let path = synthetic_with("kimi-linear", FileType::Q4KM, |spec| {
            spec.shape.n_layer = n_layer;
            spec.shape.n_head = n_head;
            spec.shape.head_dim = head_dim;
        });
        let worst = check_stages(&path, &format!("kimi-linear {label}"));
        assert_eq!(
            worst, 0.0,
            "kimi-linear {label}: the logits are llama.cpp's bit for bit"
        );
    }
}

/// Kimi K3: Kimi Linear's layers (KDA in 0 and 2, MLA in 1 and 3) with residual
/// attention banking layers 0 and 2's inputs (which travel with the hidden state to a
/// later stage), experts at half the model's width, situ, MLA output gates and full-rank
/// KDA gates; without residual attention (`attn_res.block_size` 0), also with experts at
/// the model's width, situ's up branch untouched and the decay's softplus form. On 1, 2
/// and 3 stages, logits bit for bit.
#[test]
fn kimi_k3_matches_llama_cpp_with_1_2_3_stages() {
    let _serial = serial();
    let path = synthetic("kimi-k3", FileType::Q4KM);
    let worst = check_stages(&path, "kimi-k3");
    assert_eq!(worst, 0.0, "kimi-k3: the logits are llama.cpp's bit for bit");
    let path = synthetic_with("kimi-k3", FileType::Q4KM, |spec| {
        spec.keys.push(("kimi-k3.attn_res.block_size".into(), Value::U32(0)));
    });
    let worst = check_stages(&path, "kimi-k3 without residual attention");
    assert_eq!(
        worst, 0.0,
        "kimi-k3 without residual attention: the logits are llama.cpp's bit for bit"
    );
    // The other forms: experts at the model's width (no latent projections), situ's up
    // branch as it is, the decay's softplus form (llama.cpp's unset bound is -inf).
    let path = synthetic_with("kimi-k3", FileType::Q4KM, |spec| {
        for (key, value) in [
            ("attn_res.block_size", Value::U32(0)),
            ("expert_latent_length", Value::U32(0)),
            ("activation.situ_linear_beta", Value::F32(0.0)),
            ("kda.gate_lower_bound", Value::F32(f32::NEG_INFINITY)),
        ] {
            spec.keys.push((format!("kimi-k3.{key}"), value));
        }
    });
    let worst = check_stages(&path, "kimi-k3 without latent experts or a decay bound");
    assert_eq!(
        worst, 0.0,
        "kimi-k3 without latent experts or a decay bound: the logits are llama.cpp's bit for bit"
    );
}

/// Kimi K3 with residual attention on 2 TCP workers: the planner may start the second
/// stage anywhere, and the inputs banked on the first travel to it with the hidden state.
#[test]
fn kimi_k3_on_two_workers_matches_llama_cpp() {
    let _serial = serial();
    let path = synthetic("kimi-k3", FileType::Q4KM);
    let file = ModelFile::open(&path).unwrap();
    let cost = baton_cluster::model_cost(&file, 256, 1, KvTypes::default());
    assert!(cost.no_stage_start.is_empty(), "{:?}", cost.no_stage_start);
    two_workers("kimi-k3", FileType::Q4KM);
}

/// DeepSeek V4's hash-routed layers choose experts by the batch's token ids, which only
/// the first stage has: with 3 of them, no stage starts at layer 1 or 2, a `--split`
/// there is refused with the reason, one after them is planned.
#[test]
fn deepseek4_plans_no_stage_inside_its_hash_routed_layers() {
    use baton_plan::{plan_with_split, NodeOffer};
    let nodes = [
        NodeOffer::single("a", 1 << 40, 1.0),
        NodeOffer::single("b", 1 << 40, 1.0),
    ];
    let path = synthetic_with("deepseek4", FileType::Q4KM, |spec| {
        spec.keys.push(("deepseek4.hash_layer_count".into(), Value::U32(3)));
    });
    let cost = baton_cluster::model_cost(&ModelFile::open(&path).unwrap(), 256, 1, KvTypes::default());
    assert_eq!(cost.no_stage_start, [1, 2]);
    assert_eq!(
        plan_with_split(&cost, &nodes, &[2, 2]).unwrap_err().to_string(),
        "--split starts b's stage at layer 2, which reuses the batch's token ids (deepseek4's hash-routed \
         experts choose by them; only the first stage has them) and must stay on that layer's stage"
    );
    let plan = plan_with_split(&cost, &nodes, &[3, 1]).unwrap();
    assert_eq!(plan.stages[1].layers, 3..4);
}

#[test]
fn kimi_linear_on_two_workers_matches_llama_cpp() {
    let _serial = serial();
    two_workers("kimi-linear", FileType::Q4KM);
}

/// What a hybrid stage holds for a 32k context is what the planner counts
/// (`HParams::layer_cache_bytes`): keys and values (kimi-linear: latent rows) of every
/// cell for its attention layers, each sequence's kept states for its recurrent ones.
#[test]
fn hybrid_memory_per_stage_is_what_the_planner_counts() {
    let _serial = serial();
    for arch in ["qwen35moe", "kimi-linear"] {
        hybrid_memory_is_counted(arch);
    }
}

fn hybrid_memory_is_counted(arch: &str) {
    let path = synthetic(arch, FileType::Q4KM);
    let file = ModelFile::open(&path).unwrap();
    let hp = file.hparams().clone();
    for n_seq in [1, 4] {
        let n_ctx = 32768;
        for layers in baton_plan::even_split(hp.n_layer, 2).unwrap() {
            let span = baton_model::StageSpan {
                first: layers.start == 0,
                last: layers.end == hp.n_layer,
                layers: layers.clone(),
            };
            let config = StageConfig {
                n_ctx,
                n_threads: 1,
                repack: true,
                n_seq,
                kv_types: Default::default(),
                n_ubatch: baton_model::DEFAULT_UBATCH,
            };
            let stage = baton_model::Stage::load(file.clone(), span, &config).unwrap();
            let held = (stage.kv().bytes() + stage.recurrent().bytes()) as u64;
            let counted: u64 = layers
                .clone()
                .map(|l| hp.layer_cache_bytes(l, n_ctx, n_seq, Default::default()))
                .sum();
            println!(
                "{arch} layers {layers:?}, {n_seq} sequences, {n_ctx} cells: KV {} bytes, states {} bytes, planner {counted}",
                stage.kv().bytes(),
                stage.recurrent().bytes()
            );
            // Buffers are rounded up to ggml's alignment (at most 64 bytes a tensor).
            assert!(
                held >= counted && held <= counted + 64 * 2 * layers.len() as u64,
                "{held} vs {counted}"
            );
        }
    }
}

/// A tensor-parallel group of a hybrid model is refused, and the refusal says why.
#[test]
fn hybrid_models_refuse_tensor_parallelism_with_the_reason() {
    let _serial = serial();
    for arch in ["qwen35moe", "kimi-linear"] {
        let path = synthetic(arch, FileType::Q4KM);
        let file = ModelFile::open(&path).unwrap();
        let err = baton_model::TpSplit::new(file.hparams(), 0, 2).unwrap_err().to_string();
        assert!(
            err.contains("recurrent") && err.contains("pipeline stages"),
            "{arch}: {err}"
        );
    }
}

#[test]
fn qwen35_on_two_workers_matches_llama_cpp() {
    let _serial = serial();
    two_workers("qwen35", FileType::Q4KM);
}

#[test]
fn qwen35moe_on_two_workers_matches_llama_cpp() {
    let _serial = serial();
    two_workers("qwen35moe", FileType::Q4KM);
}

/// Nemotron-H with 4 layers (Mamba2, MLP, attention, Mamba2) and with 7 (two of each
/// block and a third Mamba2), so that stages start and end on every kind of block.
fn nemotron_stages(arch: &str) {
    stages(arch, FileType::Q4KM);
    let path = synthetic_with(arch, FileType::Q4KM, |spec| spec.shape.n_layer = 7);
    let worst = check_stages(&path, &format!("{arch} 7 layers"));
    println!("{arch} 7 layers: worst NMSE {worst:.3e}");
}

#[test]
fn nemotron_h_matches_llama_cpp_with_1_2_3_stages() {
    let _serial = serial();
    nemotron_stages("nemotron_h");
}

#[test]
fn nemotron_h_moe_matches_llama_cpp_with_1_2_3_stages() {
    let _serial = serial();
    nemotron_stages("nemotron_h_moe");
}

#[test]
fn nemotron_h_on_two_workers_matches_llama_cpp() {
    let _serial = serial();
    two_workers("nemotron_h", FileType::Q4KM);
}

#[test]
fn nemotron_h_moe_on_two_workers_matches_llama_cpp() {
    let _serial = serial();
    two_workers("nemotron_h_moe", FileType::Q4KM);
}

#[test]
fn qwen3moe_matches_llama_cpp_with_1_2_3_stages() {
    let _serial = serial();
    stages("qwen3moe", FileType::Q4KM);
    stages("qwen3moe", FileType::Q8_0);
}

#[test]
fn qwen3moe_on_two_workers_matches_llama_cpp() {
    let _serial = serial();
    two_workers("qwen3moe", FileType::Q4KM);
}

#[test]
fn mixtral_matches_llama_cpp_with_1_2_3_stages() {
    let _serial = serial();
    stages("mixtral", FileType::Q4KM);
    stages("mixtral", FileType::Q8_0);
}

#[test]
fn mixtral_on_two_workers_matches_llama_cpp() {
    let _serial = serial();
    two_workers("mixtral", FileType::Q4KM);
}

/// What the server relies on, for experts too: a decode step of one sequence gives the
/// same bits alone and batched with the steps of up to 6 other sequences (each expert
/// then multiplies up to 7 rows; `mul_mat_id` rows are batch-invariant below 8, see
/// crates/ggml; the f32 router multiplies each row of such a batch alone), and a
/// sequence's greedy tokens are the same alone and beside others. Every MoE family:
/// routers with selection biases and groups, shared experts, MLA, sinks and windows,
/// experts weighted before their FFN (llama4), recurrent layers (qwen35moe's DeltaNet,
/// nemotron_h_moe's Mamba2, kimi-linear's KDA), experts routed by another input than
/// theirs (gemma4), latent experts and residual attention whose banked inputs cross the
/// stage boundary (kimi-k3).
#[test]
fn batching_other_sequences_changes_nothing_for_experts() {
    let _serial = serial();
    for arch in [
        "qwen3moe",
        "mixtral",
        "glm4moe",
        "gpt-oss",
        "deepseek2",
        "minimax-m2",
        "llama4",
        "qwen35moe",
        "qwen3next",
        "nemotron_h_moe",
        "gemma4-moe",
        "kimi-linear",
        "kimi-k3",
    ] {
        let file_type = if arch == "gpt-oss" {
            FileType::Mxfp4Moe
        } else {
            FileType::Q4KM
        };
        batching_changes_nothing(arch, file_type);
    }
}

/// Gemma 4's layers of two kinds (each kind's heads and window) in batches of decode
/// steps of up to 7 sequences: the same bits and greedy tokens as alone.
#[test]
fn gemma4_batching_other_sequences_changes_nothing() {
    let _serial = serial();
    batching_changes_nothing("gemma4", FileType::Q4KM);
}

/// Sparse attention (DeepSeek's: deepseek32, glm-dsa with a shared indexer layer,
/// glm5-next's blocks of tokens beside its KDA layers; MiniMax's: minimax-m3) in batches
/// of decode steps of up to 7 sequences: each row's indexer scores, choice and attention
/// cover its own sequence's cells only (prompts of 11 to 26 tokens; 8 tokens chosen, or
/// 2 blocks of 4 positions), so the same bits and greedy tokens as alone.
#[test]
fn sparse_attention_batching_other_sequences_changes_nothing() {
    let _serial = serial();
    for arch in ["deepseek32", "glm-dsa", "glm5-next", "minimax-m3"] {
        batching_changes_nothing(arch, FileType::Q4KM);
    }
}

/// DeepSeek V4 in batches of decode steps of up to 7 sequences: each sequence's own
/// window of 16 raw keys (prompts of 11 to 26 tokens, 12 decoded), hash routing by
/// each row's own token, the streams of each row on their own: the same bits and greedy
/// tokens as alone, and after truncating back to the prompts (prefix reuse).
#[test]
fn deepseek4_batching_other_sequences_changes_nothing() {
    let _serial = serial();
    batching_changes_nothing("deepseek4", FileType::Q4KM);
}

/// A decode step of one sequence alone and beside the steps of up to 6 others, on 2
/// stages of the synthetic `arch`: the same bits; and sequence 0's greedy tokens alone
/// and beside the others: the same tokens.
fn batching_changes_nothing(arch: &str, file_type: FileType) {
    const N_SEQ: usize = 7;
    let path = synthetic(arch, file_type);
    let file = ModelFile::open(&path).unwrap();
    let oracle = LlamaModel::load_vocab(&path).unwrap();
    let prompts = common::numbered_prompts(&oracle, N_SEQ);
    let config = StageConfig {
        n_ctx: 256 * N_SEQ,
        n_threads: 2,
        repack: false,
        n_seq: N_SEQ,
        kv_types: Default::default(),
        n_ubatch: baton_model::DEFAULT_UBATCH,
    };
    let ranges = baton_plan::even_split(file.hparams().n_layer, 2).unwrap();
    let mut chain = Chain::load_with(&file, &ranges, &config);
    let lens = chain.prefill_all(&prompts);
    let reset = |chain: &mut Chain| chain.truncate_all(&lens);
    let alone = chain.forward(&[42], &[lens[0]], &[0], &[0], false);
    reset(&mut chain);
    for rows in 2..=N_SEQ {
        let seq_ids: Vec<u32> = (0..rows as u32).collect();
        let positions: Vec<i32> = lens[..rows].to_vec();
        let tokens: Vec<u32> = (0..rows as u32).map(|r| 42 + 7 * r).collect();
        let batched = chain.forward(&tokens, &positions, &seq_ids, &[0], false);
        reset(&mut chain);
        assert_eq!(nmse(&batched, &alone), 0.0, "{arch}: batch of {rows}");
    }

    // Greedy decoding of sequence 0 alone, then beside the others decoding in the
    // same batches: the same tokens. Steps a recurrent state can be rolled back
    // over (it keeps its last KEPT_STATES positions), 12 elsewhere.
    let steps = if file.hparams().ssm.is_some() {
        baton_model::KEPT_STATES - 1
    } else {
        12
    };
    let decode = |chain: &mut Chain, seqs: &[u32]| -> Vec<u32> {
        let mut next: Vec<u32> = vec![42; seqs.len()];
        let mut pos: Vec<i32> = seqs.iter().map(|&s| lens[s as usize]).collect();
        let mut first = Vec::new();
        for _ in 0..steps {
            let rows: Vec<u32> = (0..seqs.len() as u32).collect();
            let logits = chain.forward(&next, &pos, seqs, &rows, false);
            let n_vocab = logits.len() / seqs.len();
            for (i, row) in logits.chunks_exact(n_vocab).enumerate() {
                next[i] = baton_sample::argmax(row).unwrap();
                pos[i] += 1;
            }
            first.push(next[0]);
        }
        first
    };
    let alone = decode(&mut chain, &[0]);
    reset(&mut chain);
    let beside = decode(&mut chain, &[0, 1, 2, 3, 4, 5, 6]);
    assert_eq!(alone, beside, "{arch}: sequence 0's greedy tokens");
}

/// GLM-5 next: Kimi Delta Attention in layers 0 and 2, MLA without RoPE in 1 and 3
/// whose k-pool indexer chooses 2 blocks of 4 tokens and the row's own incomplete
/// block (prompts of 6 to 21 tokens, 32 more decoded), four hyper-connected streams
/// between layers and stages, experts after the dense layer 0. Logits bit for bit,
/// greedy tokens equal.
#[test]
fn glm5_next_matches_llama_cpp_with_1_2_3_stages() {
    let _serial = serial();
    let path = synthetic("glm5-next", FileType::Q4KM);
    let worst = check_stages(&path, "glm5-next");
    assert_eq!(worst, 0.0, "glm5-next: the logits are llama.cpp's bit for bit");
    // Layer 3 reusing layer 1's choice (so on one stage), the decay bounded, no
    // incomplete block attended, SwiGLU clamped at 0.8: the routed experts' in every
    // layer, the dense FFN's and the shared experts' in layers 0 and 2.
    let path = synthetic_with("glm5-next", FileType::Q4KM, |spec| {
        let types = Value::Array([1, 1, 1, 0].map(Value::U32).to_vec());
        let shexp = Value::Array([0.8, 0.0, 0.8, 0.0].map(Value::F32).to_vec());
        for (key, value) in [
            ("attention.indexer.types", types),
            ("attention.indexer.kpool_select_tail", Value::Bool(false)),
            ("kda.gate_lower_bound", Value::F32(-5.0)),
            ("swiglu_clamp_exp", Value::F32(0.8)),
            ("swiglu_clamp_shexp", shexp),
        ] {
            spec.keys.push((format!("glm5-next.{key}"), value));
        }
    });
    let label = "glm5-next with a shared indexer, a decay bound, no tail, clamps";
    let worst = check_stages_with(&path, label, &[1]);
    assert_eq!(worst, 0.0, "{label}: the logits are llama.cpp's bit for bit");
}

#[test]
fn glm5_next_on_two_workers_matches_llama_cpp() {
    let _serial = serial();
    two_workers("glm5-next", FileType::Q4KM);
}

#[test]
fn glm4moe_matches_llama_cpp_with_1_2_3_stages() {
    let _serial = serial();
    stages("glm4moe", FileType::Q4KM);
}

#[test]
fn glm4moe_on_two_workers_matches_llama_cpp() {
    let _serial = serial();
    two_workers("glm4moe", FileType::Q4KM);
}

#[test]
fn gpt_oss_matches_llama_cpp_with_1_2_3_stages() {
    let _serial = serial();
    stages("gpt-oss", FileType::Mxfp4Moe);
    stages("gpt-oss", FileType::Q8_0);
}

#[test]
fn gpt_oss_on_two_workers_matches_llama_cpp() {
    let _serial = serial();
    two_workers("gpt-oss", FileType::Mxfp4Moe);
}

#[test]
fn deepseek2_matches_llama_cpp_with_1_2_3_stages() {
    let _serial = serial();
    stages("deepseek2", FileType::Q4KM);
}

#[test]
fn deepseek2_on_two_workers_matches_llama_cpp() {
    let _serial = serial();
    two_workers("deepseek2", FileType::Q4KM);
}

/// DeepSeek V3.2's sparse attention: each query attends to the 8 tokens its indexer
/// scores best (the prompts have 6 to 21 tokens, and 32 more are decoded; attending to
/// every token instead gives other greedy tokens on the first prompt).
#[test]
fn deepseek32_matches_llama_cpp_with_1_2_3_stages() {
    let _serial = serial();
    stages("deepseek32", FileType::Q4KM);
}

#[test]
fn deepseek32_on_two_workers_matches_llama_cpp() {
    let _serial = serial();
    two_workers("deepseek32", FileType::Q4KM);
}

/// DeepSeek V4 with every layer on its raw window (16 tokens; the prompts and their
/// continuations run past it), layers 1 and 3 with compressed sparse attention (blocks
/// of 4, the indexer choosing 4 of them), layer 2 heavily compressed (blocks of 128,
/// none complete in these prompts): four hyper-connection streams between layers and
/// stages, one key-and-value head with sinks, the grouped low-rank output,
/// sqrt-softplus experts, the first layer routed by token id, SwiGLU clamps.
///
/// A decode step attends over its window's 256 cells and 256 compressed keys: from 512
/// keys on, flash attention splits them between threads, so the ring runs as many
/// threads as libllama.
#[test]
fn deepseek4_matches_llama_cpp_with_1_2_3_stages() {
    let _serial = serial();
    let path = synthetic("deepseek4", FileType::Q4KM);
    let oracle = LlamaModel::load_vocab(&path).unwrap();
    let prompts: Vec<(String, Vec<u32>)> = PROMPTS
        .iter()
        .map(|text| (format!("{text:?}"), oracle.tokenize(text, true, true).unwrap()))
        .collect();
    let setup = Setup {
        ring_threads: THREADS,
        ..SHORT
    };
    let worst = check_prompts(&path, "deepseek4", &[1, 2, 3], &prompts, setup);
    assert_eq!(worst, 0.0, "deepseek4: the logits are llama.cpp's bit for bit");
}

/// DeepSeek V4's compressed attention past its blocks of 128 positions (layers 1 and 3
/// with compressed sparse attention, 2 heavily compressed, 0 on its window alone), on
/// 1, 2 and 3 stages against libllama: a prompt
/// in two chunks (the second completes block 0 from rows the first cached), 8 decode
/// steps that complete block 1 at position 255, and the last 4 steps again as one
/// decode batch (a token and its drafts, the block completing inside it): every step's
/// and row's logits are libllama's bit for bit.
#[test]
fn deepseek4_compressed_blocks_match_llama_cpp_bit_for_bit() {
    let _serial = serial();
    const N_PROMPT: usize = 250;
    const N_DECODE: usize = 8;
    let path = synthetic("deepseek4", FileType::Q4KM);
    let file = ModelFile::open(&path).unwrap();
    let oracle = LlamaModel::load_full(&path, true).unwrap();
    let text = PROMPTS.join("\n").repeat(12);
    let prompt = oracle.tokenize(&text, true, true).unwrap()[..N_PROMPT].to_vec();
    let (first, rest) = prompt.split_at(100);

    // One thread each side: under 512 cells the count changes no bit (see `THREADS`).
    let mut ctx = LlamaContext::new(&oracle, 512, 512, 1).unwrap();
    let (expected, tokens) = libllama_steps(&mut ctx, &[first, rest], N_DECODE);

    for n_stages in [1, 2, 3] {
        let ranges = baton_plan::even_split(file.hparams().n_layer, n_stages).unwrap();
        let mut chain = Chain::load_with(&file, &ranges, &StageConfig::new(512, 1));
        let label = format!("deepseek4 on {n_stages} stage(s)");
        assert_eq!(
            nmse(&chain.logits(0, first, 0), &expected[0]),
            0.0,
            "{label}: the prompt's first chunk"
        );
        let ours = chain.logits(0, rest, first.len() as i32);
        assert_eq!(nmse(&ours, &expected[1]), 0.0, "{label}: the prompt's second chunk");
        for (step, &token) in tokens.iter().enumerate() {
            let pos = (N_PROMPT + step) as i32;
            let ours = chain.logits(0, &[token], pos);
            assert_eq!(
                nmse(&ours, &expected[2 + step]),
                0.0,
                "{label}: decode step at position {pos}"
            );
        }
        let end = (N_PROMPT + N_DECODE) as i32;
        chain.truncate_all(&[end - 4]);
        let positions: Vec<i32> = (end - 4..end).collect();
        let rows = chain.forward(&tokens[N_DECODE - 4..], &positions, &[0; 4], &[0, 1, 2, 3], true);
        for (i, row) in rows.chunks_exact(expected[0].len()).enumerate() {
            let want = &expected[2 + N_DECODE - 4 + i];
            assert_eq!(
                nmse(row, want),
                0.0,
                "{label}: drafted row {i} at position {}",
                positions[i]
            );
        }
    }
}

/// Through 2 TCP workers (layers 0-1 and 2-3, compressed layers on both), a prompt of
/// 200 tokens (block 0 compressed) and its greedy continuation are libllama's.
#[test]
fn deepseek4_on_two_workers_matches_llama_cpp() {
    let _serial = serial();
    let path = synthetic("deepseek4", FileType::Q4KM);
    let oracle = LlamaModel::load_vocab(&path).unwrap();
    let text = PROMPTS.join("\n").repeat(12);
    let prompt = oracle.tokenize(&text, true, true).unwrap()[..200].to_vec();
    two_workers_on("deepseek4", &path, &[("200 tokens".into(), prompt)], SHORT);
}

/// GLM-5's sparse attention: deepseek32's with consecutive-pair RoPE in the indexer,
/// no epsilon in its key norm, sigmoid gating by default, and a shared indexer in
/// layer 1 (it attends to the tokens layer 0 chose).
#[test]
fn glm_dsa_matches_llama_cpp_with_1_2_3_stages() {
    let _serial = serial();
    stages("glm-dsa", FileType::Q4KM);
}

#[test]
fn glm_dsa_on_two_workers_matches_llama_cpp() {
    let _serial = serial();
    two_workers("glm-dsa", FileType::Q4KM);
}

#[test]
fn mistral4_matches_llama_cpp_with_1_2_3_stages() {
    let _serial = serial();
    stages("mistral4", FileType::Q4KM);
}

#[test]
fn mistral4_on_two_workers_matches_llama_cpp() {
    let _serial = serial();
    two_workers("mistral4", FileType::Q4KM);
}

#[test]
fn mistral3_matches_llama_cpp_with_1_2_3_stages() {
    let _serial = serial();
    stages("mistral3", FileType::Q4KM);
}

#[test]
fn mistral3_on_two_workers_matches_llama_cpp() {
    let _serial = serial();
    two_workers("mistral3", FileType::Q4KM);
}

#[test]
fn phi3_matches_llama_cpp_with_1_2_3_stages() {
    let _serial = serial();
    stages("phi3", FileType::Q4KM);
}

#[test]
fn phi3_on_two_workers_matches_llama_cpp() {
    let _serial = serial();
    two_workers("phi3", FileType::Q4KM);
}

#[test]
fn gemma2_matches_llama_cpp_with_1_2_3_stages() {
    let _serial = serial();
    stages("gemma2", FileType::Q4KM);
}

#[test]
fn gemma2_on_two_workers_matches_llama_cpp() {
    let _serial = serial();
    two_workers("gemma2", FileType::Q4KM);
}

/// Gemma 4's synthetic model: sliding-window layers 0 and 2 (2 key/value heads of 64,
/// a window of 16), global layers 1 and 3 (1 key/value head of 256, keys as values,
/// another RoPE base), so every split has both kinds on each side of a boundary.
#[test]
fn gemma4_matches_llama_cpp_with_1_2_3_stages() {
    let _serial = serial();
    stages("gemma4", FileType::Q4KM);
}

#[test]
fn gemma4_on_two_workers_matches_llama_cpp() {
    let _serial = serial();
    two_workers("gemma4", FileType::Q4KM);
}

/// Gemma 4 with experts (as the 26B-A4B): 8 experts of 256, 2 used, in every layer
/// beside the dense MLP.
#[test]
fn gemma4_moe_matches_llama_cpp_with_1_2_3_stages() {
    let _serial = serial();
    stages("gemma4-moe", FileType::Q4KM);
}

#[test]
fn gemma4_moe_on_two_workers_matches_llama_cpp() {
    let _serial = serial();
    two_workers("gemma4-moe", FileType::Q4KM);
}

#[test]
fn minimax_m2_matches_llama_cpp_with_1_2_3_stages() {
    let _serial = serial();
    stages("minimax-m2", FileType::Q4KM);
}

#[test]
fn minimax_m2_on_two_workers_matches_llama_cpp() {
    let _serial = serial();
    two_workers("minimax-m2", FileType::Q4KM);
}

/// MiniMax M3's sparse attention (blocks of 4 positions, 2 chosen, the query's own
/// forced): prompts of 5 to 20 tokens take the masked path, each decode step the
/// gathered one over the blocks of up to 52 positions; the logits are libllama's bit
/// for bit.
#[test]
fn minimax_m3_matches_llama_cpp_with_1_2_3_stages() {
    let _serial = serial();
    let path = synthetic("minimax-m3", FileType::Q4KM);
    let worst = check_stages(&path, "minimax-m3");
    assert_eq!(worst, 0.0, "minimax-m3: the logits are llama.cpp's bit for bit");
}

/// MiniMax M3 step by step on 2 stages against libllama, with f16 keys and values and
/// with quantized and f32/bf16 ones (`-ctk`/`-ctv` on both sides): a prompt in two
/// chunks (the second's masked choice over cells the first filled), then 16 decode steps
/// (each gathering its chosen blocks' keys and values): every step's logits are
/// libllama's bit for bit.
#[test]
fn minimax_m3_decode_steps_match_llama_cpp_bit_for_bit() {
    let _serial = serial();
    let path = synthetic("minimax-m3", FileType::Q4KM);
    let file = ModelFile::open(&path).unwrap();
    let oracle = LlamaModel::load_full(&path, true).unwrap();
    let prompt = oracle.tokenize(common::PROMPTS[2], true, true).unwrap();
    let ranges = baton_plan::even_split(file.hparams().n_layer, 2).unwrap();
    for (k, v) in [
        (CacheType::F16, CacheType::F16),
        (CacheType::Q8_0, CacheType::Q4_0),
        (CacheType::F32, CacheType::Bf16),
    ] {
        let kv_types = KvTypes { k, v };
        // One thread each: under 512 cells the count changes no bit (see `THREADS`).
        let mut ctx = LlamaContext::with_cache_types(&oracle, 512, 512, 1, [k.dtype(), v.dtype()]).unwrap();
        let config = StageConfig {
            kv_types,
            ..StageConfig::new(512, 1)
        };
        let mut chain = Chain::load_with(&file, &ranges, &config);
        let (first, rest) = prompt.split_at(9);
        let mut expected = ctx.decode(first).unwrap();
        let mut ours = chain.logits(0, first, 0);
        assert_eq!(
            nmse(&ours, &expected),
            0.0,
            "minimax-m3 {k}/{v}: the prompt's first chunk"
        );
        expected = ctx.decode(rest).unwrap();
        ours = chain.logits(0, rest, first.len() as i32);
        assert_eq!(
            nmse(&ours, &expected),
            0.0,
            "minimax-m3 {k}/{v}: the prompt's second chunk"
        );
        let mut pos = prompt.len() as i32;
        let mut steps = Vec::new();
        for step in 0..16 {
            let next = baton_sample::argmax(&expected).unwrap();
            expected = ctx.decode(&[next]).unwrap();
            ours = chain.logits(0, &[next], pos);
            assert_eq!(
                nmse(&ours, &expected),
                0.0,
                "minimax-m3 {k}/{v}: decode step {step} at position {pos}"
            );
            steps.push((next, expected.clone()));
            pos += 1;
        }
        // The last 4 steps again as one decode batch (a token and its drafts): each
        // row's logits are its step's.
        let first = pos - 4;
        chain.truncate_all(&[first]);
        let tokens: Vec<u32> = steps[12..].iter().map(|(t, _)| *t).collect();
        let positions: Vec<i32> = (first..pos).collect();
        let rows = chain.forward(&tokens, &positions, &[0; 4], &[0, 1, 2, 3], true);
        for (i, row) in rows.chunks_exact(steps[0].1.len()).enumerate() {
            assert_eq!(nmse(row, &steps[12 + i].1), 0.0, "minimax-m3 {k}/{v}: drafted row {i}");
        }
    }
}

/// MiniMax M3 past 256 positions: a prompt of 300 tokens (blocks over 512 positions,
/// its attention over 512 cells) and 8 decode steps on 2 stages, one thread each side
/// (the same count, so split-KV flash attention rounds alike): every step's logits are
/// libllama's bit for bit.
#[test]
fn minimax_m3_long_prompt_matches_llama_cpp_bit_for_bit() {
    let _serial = serial();
    let path = synthetic("minimax-m3", FileType::Q4KM);
    let file = ModelFile::open(&path).unwrap();
    let oracle = LlamaModel::load_full(&path, true).unwrap();
    let text = common::PROMPTS.join("\n").repeat(12);
    let prompt = oracle.tokenize(&text, true, true).unwrap()[..300].to_vec();
    let ranges = baton_plan::even_split(file.hparams().n_layer, 2).unwrap();
    let mut ctx = LlamaContext::new(&oracle, 1024, 512, 1).unwrap();
    let mut chain = Chain::load_with(&file, &ranges, &StageConfig::new(1024, 1));
    let mut expected = ctx.decode(&prompt).unwrap();
    let ours = chain.logits(0, &prompt, 0);
    assert_eq!(nmse(&ours, &expected), 0.0, "minimax-m3: a prompt of 300 tokens");
    for pos in 300..308 {
        let next = baton_sample::argmax(&expected).unwrap();
        expected = ctx.decode(&[next]).unwrap();
        let ours = chain.logits(0, &[next], pos);
        assert_eq!(nmse(&ours, &expected), 0.0, "minimax-m3: decode step at position {pos}");
    }
}

#[test]
fn minimax_m3_on_two_workers_matches_llama_cpp() {
    let _serial = serial();
    two_workers("minimax-m3", FileType::Q4KM);
}

/// The paths real files rarely take, against libllama too: every optional tensor an
/// architecture takes (llama's q/k/v/o and FFN biases, the others' q/k/v biases
/// (minimax-m2's and llama4's too), glm4moe's q/k norms, gemma4's values on its global
/// layers) and mistral3 with experts. libllama loading each file also
/// checks that it takes those tensors.
#[test]
fn optional_tensors_and_rarer_variants_match_llama_cpp() {
    let _serial = serial();
    for arch in [
        "llama",
        "mixtral",
        "qwen3",
        "qwen3moe",
        "gemma3",
        "glm4moe",
        "mistral3",
        "gemma2",
        "minimax-m2",
        "llama4",
        "gemma4",
    ] {
        let path = synthetic_with(arch, FileType::Q8_0, |spec| spec.optional_tensors = true);
        let worst = check_stages_with(&path, &format!("{arch} with optional tensors"), &[1, 3]);
        println!("{arch} with optional tensors: worst NMSE {worst:.3e}");
    }
    let path = synthetic_with("mistral3", FileType::Q4KM, |spec| spec.shape.n_expert = 8);
    let worst = check_stages_with(&path, "mistral3 with experts", &[1, 3]);
    println!("mistral3 with experts: worst NMSE {worst:.3e}");
}

/// The 8180-token prompt crosses the chunk boundary while decoding (the decode-step
/// test below and tests/tp.rs take it); the 8200- and 8240-token ones cross it inside
/// the prompt, which one of them shows: each 8k prompt costs CI about half a minute.
#[test]
fn llama4_matches_llama_cpp_with_1_2_3_stages() {
    let _serial = serial();
    let path = synthetic("llama4", FileType::Q4KM);
    let oracle = LlamaModel::load_vocab(&path).unwrap();
    let worst = check_prompts(
        &path,
        "llama4 Q4_K_M",
        &[1, 2, 3],
        &llama4_prompts(&oracle)[1..2],
        LLAMA4_SETUP,
    );
    println!("llama4 Q4_K_M: worst NMSE {worst:.3e}");
}

#[test]
fn llama4_on_two_workers_matches_llama_cpp() {
    let _serial = serial();
    let path = synthetic("llama4", FileType::Q4KM);
    let oracle = LlamaModel::load_vocab(&path).unwrap();
    two_workers_on("llama4", &path, &llama4_prompts(&oracle)[1..2], LLAMA4_SETUP);
}

/// The decode steps of a llama4 continuation that crosses the chunk boundary give
/// libllama's logits bit for bit, step by step (greedy tokens alone would not show it:
/// the synthetic model repeats itself after the long filler).
#[test]
fn llama4_decode_steps_across_the_chunk_boundary_match_llama_cpp() {
    let _serial = serial();
    let path = synthetic("llama4", FileType::Q4KM);
    let file = ModelFile::open(&path).unwrap();
    let oracle = LlamaModel::load_full(&path, true).unwrap();
    let (_, prompt) = llama4_prompts(&oracle).swap_remove(0);
    let setup = LLAMA4_SETUP;
    let mut reference = LlamaContext::new(&oracle, setup.n_ctx as u32, setup.n_batch as u32, THREADS).unwrap();
    let ranges = baton_plan::even_split(file.hparams().n_layer, 2).unwrap();
    let mut chain = Chain::load(&file, &ranges, setup.n_ctx);
    let mut expected = reference.decode(&prompt).unwrap();
    let mut ours = chain.logits(0, &prompt, 0);
    let mut pos = prompt.len();
    // Positions 8180..8204: the boundary at 8192, the temperature's step at 8191.
    while pos < 8204 {
        assert_eq!(nmse(&ours, &expected), 0.0, "llama4: logits at position {}", pos - 1);
        let next = baton_sample::argmax(&expected).unwrap();
        expected = reference.decode(&[next]).unwrap();
        ours = chain.logits(0, &[next], pos as i32);
        pos += 1;
    }
    assert_eq!(nmse(&ours, &expected), 0.0, "llama4: logits at position {}", pos - 1);
}

/// Window-sized caches for sliding-window layers (sequences with regions): prompts well
/// past the window and past the window cache's 256 cells (500 tokens in batches of 64,
/// then 32 decode steps: positions wrap around the cells twice, and the steps at 512..527
/// see windows split across the wrap, visited in cell order) give libllama's logits bit
/// for bit with its window-sized cache (`swa_full` off, the same `n_ubatch`), on 1, 2 and
/// 3 stages, and each stage keeps 256 cells for each window layer. gpt-oss adds sinks,
/// gemma4 window layers with heads of their own. (Against libllama's full-size cache the
/// step at position 512 differs: NMSE 6e-5 for gemma2.) Cut back to the last prompt
/// chunk and computed again, a sequence gets the same bits (prefix reuse).
#[test]
fn window_caches_match_llama_cpp_past_the_window() {
    let _serial = serial();
    const N_CTX: usize = 1024;
    const N_BATCH: usize = 64;
    const N_PROMPT: usize = 500;
    const N_DECODE: usize = 32;
    for arch in ["gemma2", "gemma3", "gpt-oss", "gemma4"] {
        let path = synthetic(arch, FileType::Q4KM);
        let file = ModelFile::open(&path).unwrap();
        let hp = file.hparams().clone();
        let oracle = LlamaModel::load_full(&path, true).unwrap();
        let text = PROMPTS.join("\n").repeat(40);
        let prompt = oracle.tokenize(&text, true, true).unwrap()[..N_PROMPT].to_vec();

        // libllama: the prompt in batches of 64, then greedy steps; every step's logits.
        let mut ctx = LlamaContext::with_window_cache(&oracle, N_CTX as u32, N_BATCH as u32, THREADS).unwrap();
        let chunks: Vec<&[u32]> = prompt.chunks(N_BATCH).collect();
        let (expected, tokens) = libllama_steps(&mut ctx, &chunks, N_DECODE);

        for n_stages in [1, 2, 3] {
            let ranges = baton_plan::even_split(hp.n_layer, n_stages).unwrap();
            let config = StageConfig {
                n_seq: 1,
                n_ubatch: N_BATCH,
                ..StageConfig::new(N_CTX, THREADS)
            };
            let mut chain = Chain::load_with(&file, &ranges, &config);
            for (stage, range) in chain.stages.iter().zip(&ranges) {
                let swa = range.clone().filter(|&l| hp.is_swa(l)).count();
                let window = stage.kv().window_capacity();
                assert_eq!(window, (swa > 0).then_some(256), "{arch} stage {range:?}");
                let counted: u64 = range
                    .clone()
                    .map(|l| hp.layer_cache_bytes(l, N_CTX, 1, Default::default()))
                    .sum();
                assert!(
                    swa == 0 || stage.kv().bytes() as u64 <= counted,
                    "{arch}: the planner counts no less"
                );
            }
            let mut got = Vec::new();
            let mut at = 0;
            for chunk in prompt.chunks(N_BATCH) {
                got.push(chain.logits(0, chunk, at));
                at += chunk.len() as i32;
            }
            for &token in &tokens {
                got.push(chain.logits(0, &[token], at));
                at += 1;
            }
            let n_chunks = N_PROMPT.div_ceil(N_BATCH);
            for (step, (ours, theirs)) in got.iter().zip(&expected).enumerate() {
                let position = match step < n_chunks {
                    true => ((step + 1) * N_BATCH).min(N_PROMPT) - 1,
                    false => N_PROMPT + step - n_chunks,
                };
                let err = nmse(ours, theirs);
                assert!(
                    ours == theirs,
                    "{arch}, {n_stages} stage(s), position {position}: NMSE {err:e}"
                );
            }
            println!(
                "{arch} {n_stages} stage(s): {} steps bit-identical to libllama",
                got.len()
            );
            if n_stages == 2 {
                // Cut back 84 positions, to the last prompt chunk (within the slack of
                // 256 - 16 + 1), and computed again: the same bits as the fresh run.
                let last_chunk = (N_PROMPT - 1) / N_BATCH * N_BATCH;
                chain.truncate_all(&[last_chunk as i32]);
                let mut again = vec![chain.logits(0, &prompt[last_chunk..], last_chunk as i32)];
                for (i, &token) in tokens.iter().enumerate() {
                    again.push(chain.logits(0, &[token], (N_PROMPT + i) as i32));
                }
                let n_chunks = N_PROMPT.div_ceil(N_BATCH);
                assert!(again == got[n_chunks - 1..], "{arch}: recomputed after a cut");
            }
        }
    }
}
