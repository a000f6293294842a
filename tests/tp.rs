//! Tensor parallelism computes what llama.cpp computes: groups of 2 and 3 members
//! (threads, or processes over TCP) give libllama's logits (bit-identical: every weight
//! is sliced by rows, see `baton_model::tp`) after each prompt and after every greedy
//! step, and the same greedy tokens, alone and as pipeline stages of a ring: qwen2 and
//! gemma3 (real models), qwen3moe and Mixtral (synthetic, their experts split by rows).
//!
//! Kept within CI's budget (two cores): libllama's answers are computed once and shared,
//! the groups run one at a time, and each prompt continues for [`N_STEPS`] tokens. A
//! wrong split still fails at once: the all-reduce form measured NMSE 1.6e-4 on the first
//! prompt's logits and left libllama's text after two tokens (docs/tensor-parallel.md).

mod common;

use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use baton_engine::{GenerateRequest, LocalRing};
use baton_ggml::{LlamaContext, LlamaModel};
use baton_model::{Batch, LogitReply, ModelFile, Stage, StageConfig, StageGroup, StageInput, StageOutput, StageSpan};
use baton_sample::{argmax, Sampler, SamplingParams};
use common::{model, nmse, PROMPTS, QWEN2};

/// The project's bound (docs/fidelity.md); measured: 0 (bit-identical). Issue 19 asked
/// for 1e-5, expecting the all-reduce form, which measured 1.2e-4 to 1.6e-4 here.
const MAX_TP_NMSE: f64 = common::fidelity::MAX_NMSE;
/// Largest difference of a chosen token's log-probability from the one libllama's logits
/// give (measured: 0).
const MAX_LOGPROB_ERROR: f32 = 1e-5;
/// Greedy tokens checked after each prompt (each with its logits).
const N_STEPS: usize = 16;
/// Context of every stage and of libllama's reference.
const N_CTX: usize = 512;

/// One test at a time, its libllama references included: on two cores, two groups'
/// threads computing at once keep each other waiting at every exchange, and spinning
/// ggml threads starve each other (this file: 144 s with the references computed side by
/// side, 50 s one test after another).
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

/// libllama's answer to one prompt: the logits after the prompt and after each greedy
/// token fed back, with their argmax (the last may be an end of generation).
struct Case {
    text: String,
    prompt: Vec<u32>,
    steps: Vec<(Vec<f32>, u32)>,
}

/// A model, libllama over it, and its answers to [`PROMPTS`].
struct Fixture {
    path: std::path::PathBuf,
    file: Arc<ModelFile>,
    oracle: LlamaModel,
    cases: Vec<Case>,
    /// Context of libllama's reference and of the stages that check against it.
    n_ctx: usize,
}

impl Fixture {
    fn load(path: std::path::PathBuf) -> Fixture {
        let oracle = LlamaModel::load_vocab(&path).unwrap();
        let prompts = PROMPTS
            .iter()
            .map(|&text| (format!("{text:?}"), oracle.tokenize(text, true, true).unwrap()))
            .collect();
        Fixture::load_with(path, prompts, N_CTX)
    }

    /// libllama's answers to `prompts` (a label and the tokens of each) in a context
    /// of `n_ctx`.
    fn load_with(path: std::path::PathBuf, prompts: Vec<(String, Vec<u32>)>, n_ctx: usize) -> Fixture {
        let file = ModelFile::open(&path).unwrap();
        let oracle = LlamaModel::load_full(&path, true).unwrap();
        let cases = prompts
            .into_iter()
            .map(|(text, prompt)| reference(&oracle, text, prompt, n_ctx))
            .collect();
        Fixture {
            path,
            file,
            oracle,
            cases,
            n_ctx,
        }
    }
}

/// qwen2's, loaded once for every test.
fn fixture() -> &'static Fixture {
    static FIXTURE: OnceLock<Fixture> = OnceLock::new();
    FIXTURE.get_or_init(|| Fixture::load(model(QWEN2)))
}

fn reference(oracle: &LlamaModel, text: String, prompt: Vec<u32>, n_ctx: usize) -> Case {
    let mut ctx = LlamaContext::new(oracle, n_ctx as u32, n_ctx as u32, 2).unwrap();
    let mut logits = ctx.decode(&prompt).unwrap();
    let mut steps = Vec::new();
    loop {
        let token = argmax(&logits).unwrap();
        steps.push((logits, token));
        if steps.len() == N_STEPS || oracle.is_end_of_generation(token) {
            break;
        }
        logits = ctx.decode(&[token]).unwrap();
    }
    Case { text, prompt, steps }
}

fn whole_model(file: &ModelFile) -> StageSpan {
    StageSpan {
        layers: 0..file.hparams().n_layer,
        first: true,
        last: true,
    }
}

/// Runs `tokens` from position `start` of sequence 0; the last row's logits.
fn last_logits(stage: &mut StageGroup, tokens: &[u32], start: usize) -> Vec<f32> {
    let positions: Vec<i32> = (start..start + tokens.len()).map(|p| p as i32).collect();
    let seq_ids = vec![0; tokens.len()];
    let batch = Batch {
        input: StageInput::Tokens(tokens),
        positions: &positions,
        seq_ids: &seq_ids,
        logit_rows: &[tokens.len() as u32 - 1],
        decode: false,
    };
    match stage.forward(&batch, LogitReply::Logits).unwrap() {
        StageOutput::Logits(l) => l,
        StageOutput::Hidden(_) | StageOutput::Best(_) | StageOutput::Normed(_) => panic!("a last stage returns logits"),
    }
}

/// Every prompt through `stage`, then its greedy steps one token at a time as a decode
/// runs them: each step's logits within [`MAX_TP_NMSE`] of libllama's and the same token.
fn check_against_llama_cpp(stage: &mut StageGroup, label: &str) {
    check_model(fixture(), stage, label);
}

/// [`check_against_llama_cpp`] on `fixture`'s model; returns the worst NMSE.
fn check_model(fixture: &Fixture, stage: &mut StageGroup, label: &str) -> f64 {
    let mut worst = 0f64;
    for case in &fixture.cases {
        stage.clear_seq(0);
        let mut logits = last_logits(stage, &case.prompt, 0);
        let mut tokens = Vec::new();
        for (step, (expected_logits, expected)) in case.steps.iter().enumerate() {
            let err = nmse(&logits, expected_logits);
            worst = worst.max(err);
            assert!(err <= MAX_TP_NMSE, "{label}, {}, step {step}: NMSE {err:e}", case.text);
            tokens.push(argmax(&logits).unwrap());
            assert_eq!(
                tokens.last(),
                Some(expected),
                "{label}, {}, step {step}:\n ours: {:?}",
                case.text,
                fixture.oracle.detokenize(&tokens, false)
            );
            if step + 1 < case.steps.len() {
                logits = last_logits(stage, &[*expected], case.prompt.len() + step);
            }
        }
    }
    println!("{label}: worst nmse {worst:.3e}");
    worst
}

#[test]
fn qwen2_tp_2_and_3_match_llama_cpp() {
    let _serial = serial();
    let fixture = fixture();
    for n in [2, 3] {
        let config = StageConfig::new(N_CTX, 1);
        let mut stage = StageGroup::load_tp(fixture.file.clone(), whole_model(&fixture.file), &config, n).unwrap();
        assert_eq!(stage.size(), n);
        check_against_llama_cpp(&mut stage, &format!("qwen2 tp {n}"));
    }
}

/// Two pipeline stages, each a group of two: the ring's greedy tokens are libllama's, and
/// so are their log-probabilities (the only trace of the logits a ring returns).
#[test]
fn tp_groups_chain_as_pipeline_stages() {
    let _serial = serial();
    let fixture = fixture();
    let ranges = baton_plan::even_split(fixture.file.hparams().n_layer, 2).unwrap();
    let mut ring = LocalRing::start_tp(fixture.file.clone(), &ranges, &StageConfig::new(N_CTX, 1), 2).unwrap();
    let is_end = |t| fixture.oracle.is_end_of_generation(t);
    let case = &fixture.cases[0];
    let mut sampler = Sampler::new(SamplingParams::greedy()).unwrap();
    let (expected_tokens, expected_logprobs): (Vec<u32>, Vec<f32>) = case
        .steps
        .iter()
        .take_while(|&&(_, t)| !is_end(t))
        .map(|(logits, t)| (*t, sampler.sample_with_logprobs(logits, 0).unwrap().logprob))
        .unzip();
    let req = GenerateRequest {
        seq: 0,
        prompt: &case.prompt,
        params: SamplingParams::greedy(),
        max_tokens: N_STEPS,
        n_batch: N_CTX,
        logprobs: true,
    };
    let generation = ring.head().unwrap().generate(&req, is_end, |_| {}).unwrap();
    assert_eq!(generation.tokens, expected_tokens, "{}", case.text);
    for (step, (ours, expected)) in generation.logprobs.iter().zip(&expected_logprobs).enumerate() {
        assert!(
            (ours - expected).abs() <= MAX_LOGPROB_ERROR,
            "{}, step {step}: logprob {ours}, llama.cpp's logits give {expected}",
            case.text
        );
    }
}

/// gemma3 (one key/value head: the second member computes no attention; norms after
/// attention and after the FFN, on the gathered rows) in groups of 2 and 3.
#[test]
fn gemma3_tp_2_and_3_match_llama_cpp() {
    let _serial = serial();
    let fixture = Fixture::load(model(common::GEMMA3));
    for n in [2, 3] {
        let config = StageConfig::new(N_CTX, 1);
        let mut stage = StageGroup::load_tp(fixture.file.clone(), whole_model(&fixture.file), &config, n).unwrap();
        let worst = check_model(&fixture, &mut stage, &format!("gemma3 tp {n}"));
        assert_eq!(worst, 0.0, "gemma3 tp {n}: the logits are libllama's bits");
    }
}

/// Routed experts split by rows of every expert (qwen3moe, Mixtral, glm4moe with its
/// shared expert, dense leading layer and selection bias, gpt-oss with its expert
/// biases, attention sinks and MXFP4 experts, and deepseek2 with MLA attention, whose
/// compressed row every member caches whole, its query heads two at a time (a member
/// of a group of 3 over 4 heads gets none), mistral4 the same with YaRN; synthetic):
/// the router is
/// whole on every member, so all choose the same experts, and the logits are
/// libllama's bits, in groups of 2 and 3.
#[test]
fn experts_tp_2_and_3_match_llama_cpp() {
    let _serial = serial();
    use baton_ggml::FileType;
    for arch in ["qwen3moe", "mixtral", "glm4moe", "gpt-oss", "deepseek2", "mistral4"] {
        let file_type = if arch == "gpt-oss" {
            FileType::Mxfp4Moe
        } else {
            FileType::Q4KM
        };
        let fixture = Fixture::load(common::synth::synthetic(arch, file_type));
        for n in [2, 3] {
            let config = StageConfig::new(N_CTX, 1);
            let mut stage = StageGroup::load_tp(fixture.file.clone(), whole_model(&fixture.file), &config, n).unwrap();
            let split = stage.stage().tp_split().unwrap().clone();
            assert!(
                !split.ff_exp.is_empty(),
                "{arch}: every member holds a share of each expert"
            );
            let worst = check_model(&fixture, &mut stage, &format!("{arch} tp {n}"));
            assert_eq!(worst, 0.0, "{arch} tp {n}: the logits are libllama's bits");
        }
    }
}

/// DeepSeek sparse attention (synthetic deepseek32, and glm-dsa with a shared indexer
/// layer): every member with query heads computes the lightning indexer whole (its
/// heads score each token for all query heads), caches the indexer keys beside its
/// whole compressed rows, and so chooses the same tokens as the others; a member of a
/// group of 3 over 4 heads gets none and computes no selection. The logits are
/// libllama's bits in groups of 2 and 3.
#[test]
fn sparse_attention_tp_2_and_3_match_llama_cpp() {
    let _serial = serial();
    for arch in ["deepseek32", "glm-dsa"] {
        let fixture = Fixture::load(common::synth::synthetic(arch, baton_ggml::FileType::Q4KM));
        for n in [2, 3] {
            let config = StageConfig::new(N_CTX, 1);
            let mut stage = StageGroup::load_tp(fixture.file.clone(), whole_model(&fixture.file), &config, n).unwrap();
            let worst = check_model(&fixture, &mut stage, &format!("{arch} tp {n}"));
            assert_eq!(worst, 0.0, "{arch} tp {n}: the logits are libllama's bits");
        }
    }
}

/// minimax-m2's q/k norms span all heads at once: each member computes its query
/// heads' rows and all are gathered before the norm, every member with heads computes
/// every key head, and each keeps its own heads after the norms (a member of a group of
/// 3 over 2 key/value heads has none and only joins the gathers). Synthetic; the
/// logits are libllama's bits in groups of 2 and 3.
#[test]
fn minimax_m2_tp_2_and_3_match_llama_cpp() {
    let _serial = serial();
    let fixture = Fixture::load(common::synth::synthetic("minimax-m2", baton_ggml::FileType::Q4KM));
    for n in [2, 3] {
        let config = StageConfig::new(N_CTX, 1);
        let mut stage = StageGroup::load_tp(fixture.file.clone(), whole_model(&fixture.file), &config, n).unwrap();
        let splits = baton_model::tp_splits(&fixture.file, n).unwrap();
        assert_eq!(
            splits.iter().any(|s| s.q_heads.is_empty()),
            n == 3,
            "a group of 3 has a member without heads"
        );
        let worst = check_model(&fixture, &mut stage, &format!("minimax-m2 tp {n}"));
        assert_eq!(worst, 0.0, "minimax-m2 tp {n}: the logits are libllama's bits");
    }
}

/// Llama 4 (synthetic): each member L2-normalises its own heads after RoPE and scales
/// its NoPE layers' queries by the temperature, its experts run on inputs weighted by
/// the router (whole on every member) and the shared expert is split like a dense FFN.
/// On the short prompts and on the 8180-token one, whose greedy steps cross the chunk
/// boundary at 8192 (a member of a group of 3 over 2 key/value heads has none).
/// The logits are libllama's bits in groups of 2 and 3.
#[test]
fn llama4_tp_2_and_3_match_llama_cpp() {
    let _serial = serial();
    let path = common::synth::synthetic("llama4", baton_ggml::FileType::Q4KM);
    let short = Fixture::load(path.clone());
    let oracle = LlamaModel::load_vocab(&path).unwrap();
    let crossing = common::synth::llama4_prompts(&oracle).swap_remove(0);
    let long = Fixture::load_with(path, vec![crossing], common::synth::LLAMA4_SETUP.n_ctx);
    // Each member with libllama's 2 threads on the long prompt: a decode step over 512
    // cells or more splits them among the threads (ggml's split-KV flash attention),
    // whose sums round by the thread count.
    for (fixture, n_threads) in [(&short, 1), (&long, 2)] {
        for n in [2, 3] {
            let config = StageConfig::new(fixture.n_ctx, n_threads);
            let mut stage = StageGroup::load_tp(fixture.file.clone(), whole_model(&fixture.file), &config, n).unwrap();
            let worst = check_model(fixture, &mut stage, &format!("llama4 tp {n}"));
            assert_eq!(worst, 0.0, "llama4 tp {n}: the logits are libllama's bits");
        }
    }
}

/// Dense architectures with more to them (synthetic): gemma2's attention and final
/// logit soft-capping and sliding windows, mistral3's YaRN attention temperature,
/// phi3's fused q/k/v and gate/up projections (each member's rows of each part).
#[test]
fn gemma2_mistral3_and_phi3_tp_2_and_3_match_llama_cpp() {
    let _serial = serial();
    use baton_ggml::FileType;
    for arch in ["gemma2", "mistral3", "phi3"] {
        let fixture = Fixture::load(common::synth::synthetic(arch, FileType::Q4KM));
        for n in [2, 3] {
            let config = StageConfig::new(N_CTX, 1);
            let mut stage = StageGroup::load_tp(fixture.file.clone(), whole_model(&fixture.file), &config, n).unwrap();
            let worst = check_model(&fixture, &mut stage, &format!("{arch} tp {n}"));
            assert_eq!(worst, 0.0, "{arch} tp {n}: the logits are libllama's bits");
        }
    }
}

/// Window-sized caches in a tensor-parallel group: each member keeps its heads of the
/// sliding-window layers in a window cache of its own (256 cells per sequence here), and
/// gemma2's group of 2 and 3 gives libllama's logits bit for bit (`swa_full` off, the same
/// `n_ubatch`) for a 500-token prompt in batches of 64 and 32 greedy steps, past the
/// window and around the cells twice.
#[test]
fn window_caches_in_tp_groups_match_llama_cpp() {
    let _serial = serial();
    const N_CTX: usize = 1024;
    const N_BATCH: usize = 64;
    let path = common::synth::synthetic("gemma2", baton_ggml::FileType::Q4KM);
    let file = ModelFile::open(&path).unwrap();
    let oracle = LlamaModel::load_full(&path, true).unwrap();
    let text = PROMPTS.join("\n").repeat(40);
    let prompt = oracle.tokenize(&text, true, true).unwrap()[..500].to_vec();
    // One thread on both sides: a decode step over 512 cells splits them among threads.
    let mut ctx = LlamaContext::with_window_cache(&oracle, N_CTX as u32, N_BATCH as u32, 1).unwrap();
    let mut expected: Vec<Vec<f32>> = prompt.chunks(N_BATCH).map(|c| ctx.decode(c).unwrap()).collect();
    let mut tokens = Vec::new();
    for _ in 0..32 {
        tokens.push(argmax(expected.last().unwrap()).unwrap());
        expected.push(ctx.decode(&tokens[tokens.len() - 1..]).unwrap());
    }
    for n in [2, 3] {
        let config = baton_model::StageConfig {
            n_seq: 1,
            n_ubatch: N_BATCH,
            ..StageConfig::new(N_CTX, 1)
        };
        let mut group = StageGroup::load_tp(file.clone(), whole_model(&file), &config, n).unwrap();
        let mut got = Vec::new();
        for (i, chunk) in prompt.chunks(N_BATCH).enumerate() {
            got.push(last_logits(&mut group, chunk, i * N_BATCH));
        }
        for (i, &token) in tokens.iter().enumerate() {
            got.push(last_logits(&mut group, &[token], prompt.len() + i));
        }
        for (step, (ours, theirs)) in got.iter().zip(&expected).enumerate() {
            assert!(ours == theirs, "tp {n}, step {step}: NMSE {:e}", nmse(ours, theirs));
        }
    }
}

/// A group a model cannot be split into says so instead of computing something else.
#[test]
fn tp_refuses_groups_a_model_cannot_be_split_into() {
    let _serial = serial();
    let path = common::synth::synthetic("qwen3moe", baton_ggml::FileType::Q4KM);
    let file = ModelFile::open(&path).unwrap();
    let err = StageGroup::load_tp(file.clone(), whole_model(&file), &StageConfig::new(64, 1), 300)
        .err()
        .expect("256 values a row are not split 300 ways");
    assert!(err.to_string().contains("cannot be split 300 ways"), "{err}");
}

/// Free loopback ports for members that must know each other's address up front.
fn free_addrs(n: usize) -> Vec<String> {
    let listeners: Vec<_> = (0..n)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0").unwrap())
        .collect();
    listeners.iter().map(|l| l.local_addr().unwrap().to_string()).collect()
}

/// Members 1.. as `baton tp-member` processes over TCP, member 0 here: the same logits
/// as libllama (bit for bit) and the same greedy tokens, for groups of 2 and 3.
#[test]
fn tp_over_tcp_matches_llama_cpp() {
    let _serial = serial();
    use baton_stage::tp_net::{dial_members, MeshCollective, RemoteMember};
    use std::process::{Command, Stdio};

    let fixture = fixture();
    for n in [2, 3] {
        let addrs = free_addrs(n - 1);
        let mut children: Vec<_> = (1..n)
            .map(|rank| {
                Command::new(env!("CARGO_BIN_EXE_baton"))
                    .args(["tp-member", "--threads", "1", "--ctx-size", &N_CTX.to_string()])
                    .args(["--rank", &rank.to_string(), "--members", &addrs.join(","), "--model"])
                    .arg(&fixture.path)
                    .env_remove("BATON_TOKEN")
                    .stdout(Stdio::null())
                    .spawn()
                    .expect("tp-member starts")
            })
            .collect();
        let peers = dial_members(&addrs, None, &Default::default()).unwrap();
        let file = &fixture.file;
        let split = baton_model::tp_splits(file, n).unwrap().remove(0);
        let collective = Arc::new(MeshCollective::new(0, peers.clone()));
        let members: Vec<Box<dyn baton_model::GroupMember>> = peers
            .into_iter()
            .map(|p| Box::new(RemoteMember::new(p)) as Box<dyn baton_model::GroupMember>)
            .collect();
        let config = StageConfig::new(N_CTX, 1);
        let member0 = Stage::load_member(file.clone(), whole_model(file), &config, Some((split, collective))).unwrap();
        let mut stage = StageGroup::new(member0, members);
        check_against_llama_cpp(&mut stage, &format!("qwen2 tp {n} over TCP"));
        drop(stage);
        for child in &mut children {
            let status = child.wait().unwrap();
            assert!(status.success(), "a member ended with {status}");
        }
    }
}
