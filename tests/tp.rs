//! Tensor parallelism computes what llama.cpp computes: groups of 2 and 3 members
//! (threads, or processes over TCP) give libllama's last-token logits (bit-identical:
//! every weight is sliced by rows, see `baton_model::tp`) and the same greedy tokens,
//! alone and as pipeline stages of a ring.

mod common;

use std::sync::Arc;

use baton_ggml::LlamaModel;
use baton_model::{Batch, ModelFile, Stage, StageConfig, StageInput, StageOutput, StageSpan};
use baton_node::{GenerateRequest, LocalRing};
use baton_sample::{argmax, SamplingParams};
use common::fidelity::{reference, N_GREEDY};
use common::{model, nmse, PROMPTS, QWEN2};

/// The project's bound (docs/fidelity.md); measured: 0 (bit-identical). Issue 19 asked
/// for 1e-5, expecting the all-reduce form, which measured 1.2e-4 to 1.6e-4 here.
const MAX_TP_NMSE: f64 = common::fidelity::MAX_NMSE;

fn whole_model(file: &ModelFile) -> StageSpan {
    StageSpan {
        layers: 0..file.hparams().n_layer,
        first: true,
        last: true,
    }
}

/// Runs `tokens` from position `start` of sequence 0; the last row's logits.
fn last_logits(stage: &mut Stage, tokens: &[u32], start: i32) -> Vec<f32> {
    let positions: Vec<i32> = (start..start + tokens.len() as i32).collect();
    let seq_ids = vec![0; tokens.len()];
    let batch = Batch {
        input: StageInput::Tokens(tokens),
        positions: &positions,
        seq_ids: &seq_ids,
        logit_rows: &[tokens.len() as u32 - 1],
    };
    match stage.forward(&batch).unwrap() {
        StageOutput::Logits(l) => l,
        StageOutput::Hidden(_) => panic!("a last stage returns logits"),
    }
}

fn check_group(file: &Arc<ModelFile>, oracle: &LlamaModel, n: usize) -> f64 {
    let mut worst = 0f64;
    let mut stage = Stage::load_tp(file.clone(), whole_model(file), &StageConfig::new(512, 1), n).unwrap();
    assert_eq!(stage.tp_size(), n);
    for prompt_text in PROMPTS {
        let prompt = oracle.tokenize(prompt_text, true, true).unwrap();
        let (ref_logits, ref_tokens) = reference(oracle, &prompt);
        stage.clear_seq(0);
        let logits = last_logits(&mut stage, &prompt, 0);
        let err = nmse(&logits, &ref_logits);
        println!("qwen2 tp {n} {prompt_text:?}: nmse {err:.3e}");
        worst = worst.max(err);
        assert!(err <= MAX_TP_NMSE, "tp {n}, {prompt_text:?}: NMSE {err:e}");
        // Greedy continuation, one token per step as a decode would run.
        let mut tokens = Vec::new();
        let mut next = argmax(&logits).unwrap();
        while tokens.len() < N_GREEDY && !oracle.is_end_of_generation(next) {
            tokens.push(next);
            let pos = (prompt.len() + tokens.len() - 1) as i32;
            next = argmax(&last_logits(&mut stage, &[next], pos)).unwrap();
        }
        assert_eq!(
            tokens,
            ref_tokens,
            "tp {n}, {prompt_text:?}:\n ours: {:?}\n llama.cpp: {:?}",
            oracle.detokenize(&tokens, false),
            oracle.detokenize(&ref_tokens, false)
        );
    }
    worst
}

#[test]
fn qwen2_tp_2_and_3_match_llama_cpp() {
    let path = model(QWEN2);
    let file = ModelFile::open(&path).unwrap();
    let oracle = LlamaModel::load_full(&path, true).unwrap();
    for n in [2, 3] {
        let worst = check_group(&file, &oracle, n);
        println!("qwen2 tp {n}: worst nmse {worst:.3e}");
    }
}

/// Two pipeline stages, each a group of two: the ring's greedy tokens are libllama's.
#[test]
fn tp_groups_chain_as_pipeline_stages() {
    let path = model(QWEN2);
    let file = ModelFile::open(&path).unwrap();
    let oracle = LlamaModel::load_full(&path, true).unwrap();
    let ranges = baton_plan::even_split(file.hparams().n_layer, 2).unwrap();
    for prompt_text in PROMPTS {
        let mut ring = LocalRing::start_tp(file.clone(), &ranges, &StageConfig::new(512, 1), 2).unwrap();
        let prompt = oracle.tokenize(prompt_text, true, true).unwrap();
        let (_, ref_tokens) = reference(&oracle, &prompt);
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
        assert_eq!(generation.tokens, ref_tokens, "{prompt_text:?}");
    }
}

/// A model baton cannot split says so instead of computing something else.
#[test]
fn tp_refuses_architectures_it_cannot_split() {
    let path = model(common::GEMMA3);
    let file = ModelFile::open(&path).unwrap();
    let err = Stage::load_tp(file.clone(), whole_model(&file), &StageConfig::new(64, 1), 2)
        .err()
        .expect("gemma3 is not split");
    assert!(err.to_string().contains("gemma3 is not one"), "{err}");
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
    use baton_node::tp_net::{dial_members, MeshCollective, RemoteMember};
    use std::process::{Command, Stdio};

    let path = model(QWEN2);
    let file = ModelFile::open(&path).unwrap();
    let oracle = LlamaModel::load_full(&path, true).unwrap();
    for n in [2, 3] {
        let addrs = free_addrs(n - 1);
        let mut children: Vec<_> = (1..n)
            .map(|rank| {
                Command::new(env!("CARGO_BIN_EXE_baton"))
                    .args([
                        "tp-member",
                        "--threads",
                        "1",
                        "--ctx-size",
                        "512",
                        "--rank",
                        &rank.to_string(),
                    ])
                    .args(["--members", &addrs.join(","), "--model"])
                    .arg(&path)
                    .env_remove("BATON_TOKEN")
                    .stdout(Stdio::null())
                    .spawn()
                    .expect("tp-member starts")
            })
            .collect();
        let peers = dial_members(&addrs, None, &Default::default()).unwrap();
        let span = whole_model(&file);
        let split = baton_model::tp_splits(&file, n).unwrap().remove(0);
        let collective = Arc::new(MeshCollective::new(0, peers.clone()));
        let members: Vec<Box<dyn baton_model::GroupMember>> = peers
            .into_iter()
            .map(|p| Box::new(RemoteMember::new(p)) as Box<dyn baton_model::GroupMember>)
            .collect();
        let mut stage = Stage::load_member(file.clone(), span, &StageConfig::new(512, 1), Some((split, collective)))
            .unwrap()
            .driving(members);
        for prompt_text in PROMPTS {
            let prompt = oracle.tokenize(prompt_text, true, true).unwrap();
            let (ref_logits, ref_tokens) = reference(&oracle, &prompt);
            stage.clear_seq(0);
            let logits = last_logits(&mut stage, &prompt, 0);
            let err = nmse(&logits, &ref_logits);
            println!("qwen2 tp {n} over TCP {prompt_text:?}: nmse {err:.3e}");
            assert!(err <= MAX_TP_NMSE, "tp {n} over TCP, {prompt_text:?}: NMSE {err:e}");
            let mut tokens = Vec::new();
            let mut next = argmax(&logits).unwrap();
            while tokens.len() < N_GREEDY && !oracle.is_end_of_generation(next) {
                tokens.push(next);
                let pos = (prompt.len() + tokens.len() - 1) as i32;
                next = argmax(&last_logits(&mut stage, &[next], pos)).unwrap();
            }
            assert_eq!(tokens, ref_tokens, "tp {n} over TCP, {prompt_text:?}");
        }
        drop(stage);
        for child in &mut children {
            let status = child.wait().unwrap();
            assert!(status.success(), "a member ended with {status}");
        }
    }
}
