//! A stage keeps resident only the weights of its own layers.

mod common;

use baton_model::{mapped_rss, LogitReply, ModelFile, Stage, StageConfig, StageSpan};
use common::{model, QWEN2};

#[test]
fn a_third_of_the_layers_is_resident_for_about_a_third_of_the_layer_bytes() {
    for repack in [false, true] {
        check_middle_third(repack);
    }
}

/// Drops the file's pages from the page cache (clean pages no process maps). A file
/// read sequentially (copied, downloaded, hashed) sits in the page cache in large folios,
/// and Linux maps a whole folio into a mapping on a fault inside it: the mapping's
/// resident set then grows by neighbouring bytes the stage never touched, and weights it
/// copied and released come back with their neighbours (measured on Linux 6.18: 5% over
/// its own layers without repacking, 17% with, after `cat FILE > /dev/null`). Read back
/// through faults, the file is cached page by page and the resident set measures what
/// the stage touched.
fn uncache(path: &std::path::Path) {
    use std::os::fd::AsRawFd;
    let file = std::fs::File::open(path).unwrap();
    // SAFETY: a valid descriptor; the advice only drops cached clean pages.
    let rc = unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    assert_eq!(rc, 0, "posix_fadvise");
}

fn check_middle_third(repack: bool) {
    let path = model(QWEN2);
    uncache(&path);
    let file = ModelFile::open(&path).unwrap();
    let n_layer = file.hparams().n_layer;
    let all_layers: u64 = (0..n_layer).map(|l| file.layer_bytes(l)).sum();
    let middle = n_layer / 3..2 * n_layer / 3;
    let own: u64 = middle.clone().map(|l| file.layer_bytes(l)).sum();
    // Parsing the header touched its pages (metadata and tensor index: a few MB).
    let baseline = mapped_rss(file.map_address()).expect("smaps reports the mapping");

    let span = StageSpan {
        layers: middle,
        first: false,
        last: false,
    };
    let config = StageConfig {
        n_ctx: 64,
        n_threads: 2,
        repack,
        n_seq: 0,
        kv_types: Default::default(),
        n_ubatch: baton_model::DEFAULT_UBATCH,
    };
    let mut stage = Stage::load(file.clone(), span, &config).unwrap();
    if !repack {
        assert_eq!(
            mapped_rss(file.map_address()),
            Some(baseline),
            "loading alone reads no weights"
        );
    }
    // Run hidden states through it so every weight it owns is touched.
    let hidden = vec![0.01f32; file.hparams().n_embd * 4];
    let batch = baton_model::Batch {
        input: baton_model::StageInput::Hidden(&hidden),
        positions: &[0, 1, 2, 3],
        seq_ids: &[0; 4],
        logit_rows: &[],
        decode: false,
    };
    stage.forward(&batch, LogitReply::Logits).unwrap();

    // Weights are either mapped pages or repacked copies (whose pages were released).
    let repacked = stage.weights().repacked_bytes() as u64;
    let resident = mapped_rss(file.map_address()).unwrap() - baseline + repacked;
    let ratio = resident as f64 / all_layers as f64;
    println!("repack {repack}: stage resident {resident} bytes ({repacked} repacked), own layers {own}, all layers {all_layers}, ratio {ratio:.3}");
    assert!(
        resident as f64 >= 0.95 * own as f64,
        "resident {resident} < own layer bytes {own}"
    );
    assert!(
        resident as f64 <= 1.10 * own as f64,
        "resident {resident} far above own {own}"
    );
    assert!(stage.resident_bytes() >= resident);
}

/// The planner weighs a mixture-of-experts model by what its layers really hold and
/// read, and a stage it plans stays within the bytes planned for it: a synthetic
/// deepseek2 (a dense leading layer, then layers of 16 experts of which a token uses 2,
/// MLA's compressed cache), 3 stages; the middle one loaded on a mapping of its own.
#[test]
fn a_planned_moe_stage_stays_within_its_plan() {
    use baton_cluster::model_cost;
    use baton_ggml::FileType;
    use baton_plan::NodeOffer;

    let path = common::synth::synthetic_with("deepseek2", FileType::Q4KM, |spec| {
        spec.shape.n_layer = 6;
        spec.shape.n_expert = 16;
    });
    let n_ctx = 256;
    let file = ModelFile::open(&path).unwrap();
    let hp = file.hparams().clone();
    let cost = model_cost(&file, n_ctx, 0, Default::default());
    println!(
        "layer bytes {:?}\nread per token {:?}\nkv {:?}",
        cost.layer_bytes, cost.layer_work_bytes, cost.kv_bytes
    );
    // The dense leading layer holds far less than an expert layer, and a token reads
    // a fraction of an expert layer.
    assert!(
        cost.layer_bytes[0] * 3 < cost.layer_bytes[1],
        "dense layer {} vs MoE {}",
        cost.layer_bytes[0],
        cost.layer_bytes[1]
    );
    assert!(cost.layer_work_bytes[1] * 3 < cost.layer_bytes[1]);
    assert_eq!(
        cost.layer_work_bytes[0], cost.layer_bytes[0],
        "a dense layer is read whole"
    );
    // MLA: one f16 row of latent plus RoPE part per token and layer, no values.
    let mla = hp.mla.as_ref().unwrap();
    let row = (mla.n_lora_kv + hp.rope.n_dims as usize) * 2;
    assert!(
        cost.kv_bytes.iter().all(|&kv| kv == (row * n_ctx) as u64),
        "{:?}",
        cost.kv_bytes
    );

    let nodes: Vec<NodeOffer> = (0..3)
        .map(|i| NodeOffer::single(format!("n{i}"), 1 << 30, 1.0))
        .collect();
    let plan = baton_plan::partition(&cost, &nodes).unwrap();
    assert_eq!(plan.stages.len(), 3, "{plan:?}");
    let middle = &plan.stages[1];
    let ranges: Vec<_> = plan.stages.iter().map(|s| s.layers.clone()).collect();

    // Hidden states of a prompt after the first stage (on its own mapping).
    let prompt: Vec<u32> = (0..64).map(|i| (i * 37 + 11) % 8000).collect();
    let positions: Vec<i32> = (0..64).collect();
    let seqs = vec![0u32; 64];
    let first_file = ModelFile::open(&path).unwrap();
    let span = StageSpan {
        layers: ranges[0].clone(),
        first: true,
        last: false,
    };
    let mut first = Stage::load(first_file, span, &StageConfig::new(n_ctx, 2)).unwrap();
    let baton_model::StageOutput::Hidden(hidden) = first
        .forward(
            &baton_model::Batch {
                input: baton_model::StageInput::Tokens(&prompt),
                positions: &positions,
                seq_ids: &seqs,
                logit_rows: &[],
                decode: false,
            },
            LogitReply::Logits,
        )
        .unwrap()
    else {
        panic!("the first stage returns hidden states")
    };

    for repack in [false, true] {
        let own_file = ModelFile::open(&path).unwrap();
        let baseline = mapped_rss(own_file.map_address()).unwrap();
        let span = StageSpan {
            layers: middle.layers.clone(),
            first: false,
            last: false,
        };
        let config = StageConfig {
            n_ctx,
            n_threads: 2,
            repack,
            n_seq: 0,
            kv_types: Default::default(),
            n_ubatch: baton_model::DEFAULT_UBATCH,
        };
        // Pages are mapped whole: a tensor's first and last page may hold its neighbours.
        let page_slack = 2 * 4096 * baton_model::stage_tensor_sources(&own_file, &span).len() as u64;
        let mut stage = Stage::load(own_file.clone(), span, &config).unwrap();
        stage
            .forward(
                &baton_model::Batch {
                    input: baton_model::StageInput::Hidden(&hidden),
                    positions: &positions,
                    seq_ids: &seqs,
                    logit_rows: &[],
                    decode: false,
                },
                LogitReply::Logits,
            )
            .unwrap();
        let weights = mapped_rss(own_file.map_address()).unwrap() - baseline + stage.weights().repacked_bytes() as u64;
        let kv = stage.kv().bytes() as u64;
        let own: u64 = middle.layers.clone().map(|l| cost.layer_bytes[l]).sum();
        println!(
            "repack {repack}: layers {:?}, weights resident {weights} of {own}, kv {kv}, planned {} (+ compute buffer {})",
            middle.layers,
            middle.bytes,
            stage.resident_bytes() - weights - kv
        );
        assert_eq!(
            kv,
            middle.layers.clone().map(|l| cost.kv_bytes[l]).sum::<u64>(),
            "the cache is what was planned"
        );
        assert!(
            weights + kv <= middle.bytes + page_slack,
            "weights {weights} + kv {kv} over the plan {} (+ {page_slack} for partial pages)",
            middle.bytes
        );
        if repack {
            // Every expert is copied into the repacked layout: all of them are resident.
            assert!(
                weights as f64 >= 0.9 * own as f64,
                "resident {weights} < own layer bytes {own}"
            );
        }
    }
}

/// The planner counts a quantized KV cache by ggml's row size of its type, and a stage
/// holds what it counts: q8_0 stores each block of 32 values in 34 bytes (8.5 bits a
/// value against f16's 16), q4_0 in 18 (4.5 bits); a 32k-token context of qwen2
/// 0.5B's 24 layers takes 384 MiB in f16, 204 MiB in q8_0 and 108 MiB in q4_0. The
/// cache of a quantized type also holds the two rotation matrices (64 × 64 f32 each
/// for qwen2's heads of 64).
#[test]
fn quantized_kv_caches_shrink_what_the_planner_counts() {
    use baton_cluster::model_cost;
    use baton_model::{CacheType, KvTypes};

    let file = ModelFile::open(&model(QWEN2)).unwrap();
    let kv_total =
        |t: CacheType, n_ctx: usize| -> u64 { model_cost(&file, n_ctx, 0, KvTypes::both(t)).kv_bytes.iter().sum() };
    let n_ctx = 32768;
    let f16 = kv_total(CacheType::F16, n_ctx);
    assert_eq!(f16, 384 << 20, "24 layers × 2 × 128 values × 2 bytes × 32768 cells");
    assert_eq!(
        kv_total(CacheType::Q8_0, n_ctx) * 64,
        f16 * 34,
        "q8_0: 34 bytes per 64 of f16"
    );
    assert_eq!(
        kv_total(CacheType::Q4_0, n_ctx) * 64,
        f16 * 18,
        "q4_0: 18 bytes per 64 of f16"
    );
    assert_eq!(kv_total(CacheType::F32, n_ctx), 2 * f16);
    let mixed = model_cost(
        &file,
        n_ctx,
        0,
        KvTypes {
            k: CacheType::Q8_0,
            v: CacheType::Q4_0,
        },
    );
    assert_eq!(mixed.kv_bytes.iter().sum::<u64>() * 128, f16 * (34 + 18));

    let span = StageSpan {
        layers: 0..4,
        first: true,
        last: false,
    };
    for t in [CacheType::F16, CacheType::Q8_0, CacheType::Q4_0] {
        let config = StageConfig {
            kv_types: KvTypes::both(t),
            ..StageConfig::new(256, 1)
        };
        let stage = Stage::load(file.clone(), span.clone(), &config).unwrap();
        let counted: u64 = model_cost(&file, 256, 0, KvTypes::both(t)).kv_bytes[0..4].iter().sum();
        let rotations = if t.is_quantized() { 2 * 64 * 64 * 4 } else { 0 };
        assert_eq!(stage.kv().bytes() as u64, counted + rotations, "{t}");
    }
}

/// gemma3 (270m) at 32k context, one sequence: its 15 sliding-window layers keep a
/// window of 512 and one batch of 512 rows (1024 cells) and its 3 global layers every
/// token, the 111 MiB llama.cpp's KV cache takes (llama-server -c 32768 -np 1: 96 MiB
/// in 32768 cells of 3 layers, 15 MiB in 1024 cells of 15 layers), where a cell per
/// token in every layer takes 576 MiB; on each of 1, 2 and 3 stages the planner counts
/// what the stage holds.
#[test]
fn gemma3_at_32k_keeps_the_kv_cache_llama_cpp_keeps() {
    const N_CTX: usize = 32768;
    const MIB: u64 = 1 << 20;
    let file = ModelFile::open(&model(common::GEMMA3)).unwrap();
    let hp = file.hparams().clone();
    for (n_seq, expected) in [(1, 111 * MIB), (0, 576 * MIB)] {
        for n_stages in [1, 2, 3] {
            let ranges = baton_plan::even_split(hp.n_layer, n_stages).unwrap();
            let mut total = 0;
            for (i, layers) in ranges.iter().enumerate() {
                let span = StageSpan {
                    layers: layers.clone(),
                    first: i == 0,
                    last: i + 1 == ranges.len(),
                };
                let config = StageConfig {
                    n_seq,
                    ..StageConfig::new(N_CTX, 1)
                };
                let stage = Stage::load(file.clone(), span, &config).unwrap();
                let kv = stage.kv().bytes() as u64;
                let counted: u64 = layers
                    .clone()
                    .map(|l| hp.layer_cache_bytes(l, N_CTX, n_seq, Default::default()))
                    .sum();
                assert_eq!(
                    kv, counted,
                    "{n_stages} stages, layers {layers:?}: the planner counts the cache"
                );
                println!(
                    "n_seq {n_seq}, {n_stages} stage(s), layers {layers:?}: KV {:.1} MiB",
                    kv as f64 / MIB as f64
                );
                total += kv;
            }
            assert_eq!(total, expected, "n_seq {n_seq}, {n_stages} stages");
        }
    }
}
