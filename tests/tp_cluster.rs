//! Tensor-parallel groups of `baton worker` processes (issue 19), formed and planned by
//! the head: four workers on loopback as two groups of two chained as pipeline stages,
//! and three workers as one group of three. Each member loads its row slices from its
//! own copy of the GGUF (no weight bytes on the wire); the ring's greedy tokens are
//! libllama's, and so are their log-probabilities, bit for bit (the only trace of the
//! logits a ring returns: equal log-probabilities of every chosen token after every
//! prompt and step). gemma3 and a synthetic qwen3moe (experts split by rows) likewise
//! on a group of two. `--tp auto` over loopback workers chooses a group and says why.

mod common;

use std::sync::Mutex;

use baton_cluster::{connect_cluster, ClusterOptions, RemoteRing};
use baton_engine::GenerateRequest;
use baton_ggml::{LlamaContext, LlamaModel};
use baton_plan::TpDegree;
use baton_sample::{argmax, Sampler, SamplingParams};
use common::worker::WorkerProc;
use common::{model, PROMPTS, QWEN2};

const TOKEN: &str = "tp-cluster-test-secret";
/// Greedy tokens checked after each prompt.
const N_STEPS: usize = 16;
const N_CTX: usize = 512;

/// One cluster at a time: the workers share two cores.
static SERIAL: Mutex<()> = Mutex::new(());

fn options(tp: TpDegree) -> ClusterOptions {
    ClusterOptions {
        token: Some(TOKEN.into()),
        n_ctx: N_CTX,
        repack: true,
        tp,
        ..Default::default()
    }
}

/// libllama's greedy tokens after `prompt` and the log-probability its logits give each.
fn reference(oracle: &LlamaModel, prompt: &[u32]) -> (Vec<u32>, Vec<f32>) {
    let mut ctx = LlamaContext::new(oracle, N_CTX as u32, N_CTX as u32, 1).unwrap();
    let mut sampler = Sampler::new(SamplingParams::greedy()).unwrap();
    let mut logits = ctx.decode(prompt).unwrap();
    let (mut tokens, mut logprobs) = (Vec::new(), Vec::new());
    while tokens.len() < N_STEPS {
        let token = argmax(&logits).unwrap();
        if oracle.is_end_of_generation(token) {
            break;
        }
        logprobs.push(sampler.sample_with_logprobs(&logits, 0).unwrap().logprob);
        tokens.push(token);
        logits = ctx.decode(&[token]).unwrap();
    }
    (tokens, logprobs)
}

/// Every test prompt through the ring: libllama's tokens and log-probabilities, exactly.
fn check_against_llama_cpp(ring: &mut RemoteRing, oracle: &LlamaModel, label: &str) {
    for text in PROMPTS {
        let prompt = oracle.tokenize(text, true, true).unwrap();
        let (tokens, logprobs) = reference(oracle, &prompt);
        let req = GenerateRequest {
            seq: 0,
            prompt: &prompt,
            params: SamplingParams::greedy(),
            max_tokens: N_STEPS,
            n_batch: N_CTX,
            logprobs: true,
        };
        let generation = ring
            .head()
            .unwrap()
            .generate(&req, |t| oracle.is_end_of_generation(t), |_| {})
            .unwrap();
        assert_eq!(generation.tokens, tokens, "{label}, {text:?}");
        // Bit for bit: the same logits give the same log-probabilities.
        assert_eq!(generation.logprobs, logprobs, "{label}, {text:?}");
    }
}

fn workers(n: usize) -> Vec<WorkerProc> {
    workers_in(n, model(QWEN2).parent().unwrap())
}

/// `n` workers serving the models in `dir`.
fn workers_in(n: usize, dir: &std::path::Path) -> Vec<WorkerProc> {
    (0..n).map(|_| WorkerProc::start(dir, Some(TOKEN), &[])).collect()
}

/// The model at `path` on one group of two workers serving `dir`: libllama's tokens and
/// log-probabilities.
fn one_group_of_two(path: &std::path::Path, dir: &std::path::Path, label: &str) {
    let oracle = LlamaModel::load_full(path, true).unwrap();
    let workers = workers_in(2, dir);
    let addrs: Vec<String> = workers.iter().map(|w| w.addr.clone()).collect();
    let mut ring = connect_cluster(path, &addrs, &options(TpDegree::Fixed(2))).unwrap();
    assert_eq!(ring.plan.stages.len(), 1, "{}", ring.plan.why);
    assert!(
        ring.workers.iter().all(|w| w.streamed == 0),
        "no weight bytes on the wire"
    );
    check_against_llama_cpp(&mut ring, &oracle, label);
}

#[test]
fn two_groups_of_two_workers_match_llama_cpp() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let path = model(QWEN2);
    let oracle = LlamaModel::load_full(&path, true).unwrap();
    let workers = workers(4);
    let addrs: Vec<String> = workers.iter().map(|w| w.addr.clone()).collect();
    let mut ring = connect_cluster(&path, &addrs, &options(TpDegree::Fixed(2))).unwrap();
    assert_eq!(ring.plan.stages.len(), 2, "{}", ring.plan.why);
    let places: Vec<Option<(usize, usize)>> = ring.workers.iter().map(|w| w.tp).collect();
    assert_eq!(places, vec![Some((0, 2)), Some((1, 2)), Some((0, 2)), Some((1, 2))]);
    // Consecutive workers form the groups; the groups chain as pipeline stages.
    assert_eq!(
        ring.node_names[ring.plan.stages[0].node],
        format!("{}+{}", addrs[0], addrs[1])
    );
    assert_eq!(
        ring.node_names[ring.plan.stages[1].node],
        format!("{}+{}", addrs[2], addrs[3])
    );
    assert_eq!(ring.plan.stages[0].layers.start, 0);
    assert_eq!(ring.plan.stages[1].layers.end, 24);
    assert!(
        ring.workers.iter().all(|w| w.streamed == 0),
        "no weight bytes on the wire"
    );
    check_against_llama_cpp(&mut ring, &oracle, "2 groups of 2 workers");
    drop(ring);
    for w in workers {
        assert!(w.log().contains("linked with the tensor-parallel group"), "{}", w.log());
    }
}

#[test]
fn one_group_of_three_workers_matches_llama_cpp() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let path = model(QWEN2);
    let oracle = LlamaModel::load_full(&path, true).unwrap();
    let workers = workers(3);
    let addrs: Vec<String> = workers.iter().map(|w| w.addr.clone()).collect();
    let mut ring = connect_cluster(&path, &addrs, &options(TpDegree::Fixed(3))).unwrap();
    assert_eq!(ring.plan.stages.len(), 1, "{}", ring.plan.why);
    let places: Vec<Option<(usize, usize)>> = ring.workers.iter().map(|w| w.tp).collect();
    assert_eq!(places, vec![Some((0, 3)), Some((1, 3)), Some((2, 3))]);
    // qwen2 0.5B has two key/value heads: the third member computes no attention, only
    // its rows of the FFN, the projections and the vocabulary.
    check_against_llama_cpp(&mut ring, &oracle, "1 group of 3 workers");
}

/// What crosses the member link of a group of two per decode step, for qwen2 (n_embd
/// 896, 14 heads of 64 over 2 key/value heads, n_ff 4864, vocabulary 151,936): each
/// member's slices of the four gathers of every layer (7 heads x 64, 448 rows of the
/// attention output, 2432 of the FFN's activations, 448 of its output: 3776 values, in
/// four frames of 36 bytes besides), both ways; member 0's `Forward` to member 1; and
/// from member 1 to member 0 the best of its half of the vocabulary when the sampler is
/// a plain arg-max (one value and its token), else its half of the logits (75,968 values).
#[test]
fn per_token_traffic_between_members_is_their_slices_and_the_logits() {
    use baton_proto::{Payload, StartSeq};
    use common::proxy::DelayProxy;
    use std::sync::atomic::Ordering;
    use std::time::Duration;

    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let path = model(QWEN2);
    let dir = path.parent().unwrap();
    // Member 1 dials member 0 at the address member 0 advertises: a counting proxy.
    let mut proxy = DelayProxy::bind(Duration::ZERO);
    let w0 = WorkerProc::start(dir, Some(TOKEN), &["--advertise", &proxy.addr]);
    let w1 = WorkerProc::start(dir, Some(TOKEN), &[]);
    proxy.forward_to(w0.addr.clone());
    let mut ring = connect_cluster(&path, &[w0.addr.clone(), w1.addr.clone()], &options(TpDegree::Fixed(2))).unwrap();
    // Starts sequence `seq` with `params` on a 3-token prompt; its first token.
    let start = |ring: &mut RemoteRing, seq: u32, params: SamplingParams| {
        let head = ring.head().unwrap();
        head.control(StartSeq::new(seq, params, vec![]).into()).unwrap();
        head.forward(Payload::Tokens(vec![1, 2, 3]), vec![0, 1, 2], vec![seq; 3], vec![2])
            .unwrap()[0]
            .token
    };
    let counted = || {
        // The proxy counts a chunk once written: let the last step's frames arrive.
        std::thread::sleep(Duration::from_millis(200));
        (
            proxy.from_target.load(Ordering::Relaxed),
            proxy.to_target.load(Ordering::Relaxed),
        )
    };
    // Per decode step over `STEPS` steps of sequence `seq`: (member 0 -> member 1,
    // member 1 -> member 0) bytes.
    const STEPS: u64 = 20;
    let per_token = |ring: &mut RemoteRing, seq: u32, mut token: u32| {
        let (from0, to0) = counted();
        for pos in 3..3 + STEPS as i32 {
            token = ring
                .head()
                .unwrap()
                .forward(Payload::Tokens(vec![token]), vec![pos], vec![seq], vec![0])
                .unwrap()[0]
                .token;
        }
        let (from1, to1) = counted();
        ((from1 - from0) / STEPS, (to1 - to0) / STEPS)
    };
    // 24 layers x (3776 values x 4 bytes + 4 frames x (8 header + 12 payload + 16 seal)).
    let slices = 24 * (3776 * 4 + 4 * 36);
    let check = |what: &str, (from_member0, to_member0): (u64, u64), answer: u64| {
        println!(
            "per token, {what}: member 0 -> member 1 {from_member0} bytes, member 1 -> member 0 {to_member0} bytes"
        );
        assert!(
            (slices..slices + 200).contains(&from_member0),
            "{what}: member 0 sends its slices and a Forward: {from_member0} bytes, expected {slices} + a Forward"
        );
        assert_eq!(
            to_member0,
            slices + answer,
            "{what}: member 1 sends its slices and its answer"
        );
    };
    let token = start(&mut ring, 0, SamplingParams::greedy());
    check("greedy", per_token(&mut ring, 0, token), 2 * 4 + 36);

    // A sampler that draws needs the whole row: member 1 sends its half of the logits.
    let token = start(&mut ring, 1, SamplingParams::default());
    check("temperature 0.8", per_token(&mut ring, 1, token), 75_968 * 4 + 36);
}

/// On loopback TP pays (docs/tensor-parallel.md): `--tp auto` measures each link,
/// chooses one group of both workers, and says why with the model's numbers.
#[test]
fn tp_auto_on_loopback_chooses_a_group_and_says_why() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let path = model(QWEN2);
    let oracle = LlamaModel::load_full(&path, true).unwrap();
    let workers = workers(2);
    let addrs: Vec<String> = workers.iter().map(|w| w.addr.clone()).collect();
    let mut ring = connect_cluster(&path, &addrs, &options(TpDegree::Auto)).unwrap();
    let why = &ring.plan.why;
    assert!(why.starts_with("--tp auto chose tp 2 with 1 stage(s)"), "{why}");
    assert!(
        why.contains("tp 1 ") && why.contains("tp 2 "),
        "both layouts weighed: {why}"
    );
    for w in &ring.workers {
        let link = w.link.expect("measured");
        assert!(link.latency > 0.0 && link.latency < 5e-3, "{link:?}");
        assert!(link.bandwidth > 10e6, "{link:?}");
    }
    let prompt = oracle.tokenize(PROMPTS[0], true, true).unwrap();
    let expected = common::worker::reference(&oracle, &prompt, 8);
    assert_eq!(common::worker::greedy(&mut ring, &prompt, 8, &oracle), expected);
}

#[test]
fn gemma3_on_a_group_of_two_workers_matches_llama_cpp() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let path = model(common::GEMMA3);
    one_group_of_two(&path, path.parent().unwrap(), "gemma3 on a group of 2 workers");
}

#[test]
fn experts_on_a_group_of_two_workers_match_llama_cpp() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let path = common::synth::synthetic("qwen3moe", baton_ggml::FileType::Q4KM);
    one_group_of_two(&path, &common::synth::synth_dir(), "qwen3moe on a group of 2 workers");
}

/// A group larger than the protocol allows is refused by the head before any worker
/// gets a plan, and the workers serve the next head.
#[test]
fn tp_on_workers_refuses_a_group_too_large() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let path = model(QWEN2);
    let workers = workers(2);
    let addrs: Vec<String> = workers.iter().map(|w| w.addr.clone()).collect();
    let err = connect_cluster(&path, &addrs, &options(TpDegree::Fixed(65)))
        .err()
        .expect("a group of 65 is refused");
    assert!(
        err.to_string().contains("--tp 65: a group has at most 64 members"),
        "{err}"
    );
    // The workers may still be closing the refused head's sessions for a moment.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(3);
    let ring = loop {
        match connect_cluster(&path, &addrs, &options(TpDegree::Fixed(2))) {
            Err(e) if e.refusal() == Some(baton_proto::RefusalCode::Busy) && std::time::Instant::now() < deadline => {
                std::thread::sleep(std::time::Duration::from_millis(100))
            }
            other => break other,
        }
    };
    assert!(ring.is_ok(), "{:?}", ring.err());
}
