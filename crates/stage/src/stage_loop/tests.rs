//! Grammar-constrained sampling on a real last stage (all of Qwen2.5-0.5B in one stage):
//! greedy text kept inside a grammar, drafted rows that advance the grammar only over
//! the tokens kept, and a sequence rebuilt mid-way whose grammar replays what it generated.

use std::path::Path;

use baton_ggml::LlamaModel;
use baton_model::{ModelFile, Stage, StageConfig, StageSpan};
use baton_proto::{Forward, Message, Payload, Ring, StartSeq};
use baton_sample::{ReasoningBudget, SamplingParams};

use super::StageWorker;

const QWEN: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
);
/// A number in an object, and nothing else; Qwen left alone answers in prose.
const GRAMMAR: &str = r#"root ::= "{\"n\": " [1-9] [0-9]{0,3} "}""#;

fn worker() -> StageWorker {
    let file = ModelFile::open(Path::new(QWEN)).expect("scripts/fetch-models puts qwen2 in models/");
    let n_layer = file.hparams().n_layer;
    let span = StageSpan {
        layers: 0..n_layer,
        first: true,
        last: true,
    };
    let config = StageConfig {
        n_seq: 4,
        ..StageConfig::new(1024, 2)
    };
    StageWorker::new(Stage::load(file, span, &config).expect("stage loads"))
}

fn prompt(vocab: &LlamaModel) -> Vec<u32> {
    let text = "<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n";
    vocab.tokenize(text, false, true).unwrap()
}

fn start(worker: &mut StageWorker, seq: u32, history: Vec<u32>, drawn: u32, grammar: Option<&str>) -> Ring {
    let msg = StartSeq::new(seq, SamplingParams::greedy(), history)
        .with_drawn(drawn)
        .with_grammar(grammar.map(str::to_string));
    worker.handle(msg.into())
}

/// Computes `tokens` at `start..` of `seq`; samples the last row, or every row when
/// the tokens after the first are a draft.
fn step(worker: &mut StageWorker, seq: u32, tokens: &[u32], start: i32, drafted: bool) -> Vec<u32> {
    let n = tokens.len() as u32;
    let forward = Forward {
        step: 0,
        payload: Payload::Tokens(tokens.to_vec()),
        positions: (start..start + n as i32).collect(),
        seq_ids: vec![seq; tokens.len()],
        sample_rows: if drafted { (0..n).collect() } else { vec![n - 1] },
        row_tokens: if drafted { tokens.to_vec() } else { Vec::new() },
    };
    match worker.handle(Ring::Forward(forward)) {
        Ring::Sampled { tokens, .. } => tokens.iter().map(|t| t.token).collect(),
        other => panic!("expected Sampled, got {other:?}"),
    }
}

/// Greedy generation of `seq` after `prompt`, up to an end token or `max` tokens.
fn generate(worker: &mut StageWorker, vocab: &LlamaModel, seq: u32, prompt: &[u32], max: usize) -> Vec<u32> {
    let mut out = step(worker, seq, prompt, 0, false);
    while out.len() < max && !vocab.is_end_of_generation(*out.last().unwrap()) {
        let at = (prompt.len() + out.len() - 1) as i32;
        out.extend(step(worker, seq, &[*out.last().unwrap()], at, false));
    }
    out
}

#[test]
fn grammar_keeps_greedy_text_inside_it_with_drafts_and_after_a_rebuild() {
    let vocab = LlamaModel::load_vocab(Path::new(QWEN)).unwrap();
    let mut worker = worker();
    let prompt = prompt(&vocab);

    assert_eq!(start(&mut worker, 0, prompt.clone(), 0, None), Ring::Done);
    let free = generate(&mut worker, &vocab, 0, &prompt, 12);
    assert!(
        !vocab.detokenize(&free, false).starts_with("{\"n\""),
        "the test needs a prompt the grammar changes"
    );

    assert_eq!(start(&mut worker, 1, prompt.clone(), 0, Some(GRAMMAR)), Ring::Done);
    let constrained = generate(&mut worker, &vocab, 1, &prompt, 16);
    assert!(
        vocab.is_end_of_generation(*constrained.last().unwrap()),
        "the grammar ends: {constrained:?}"
    );
    let text = vocab.detokenize(&constrained, false);
    let value: serde_json::Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text:?}"));
    assert!(value["n"].as_u64().is_some_and(|n| n >= 1), "{text}");
    let n = constrained.len();
    assert!(n >= 4, "{constrained:?}");

    // The same sequence with its generated tokens as a draft: the samples agree with
    // every drafted token, then give the next; a wrong draft token stops the rows there.
    assert_eq!(start(&mut worker, 2, prompt.clone(), 0, Some(GRAMMAR)), Ring::Done);
    assert_eq!(step(&mut worker, 2, &prompt, 0, false), constrained[..1]);
    let at = prompt.len() as i32;
    assert_eq!(step(&mut worker, 2, &constrained[..3], at, true), constrained[1..4]);
    assert_eq!(start(&mut worker, 3, prompt.clone(), 0, Some(GRAMMAR)), Ring::Done);
    step(&mut worker, 3, &prompt, 0, false);
    let wrong = vocab.tokenize("zzz", false, false).unwrap()[0];
    let sampled = step(&mut worker, 3, &[constrained[0], constrained[1], wrong], at, true);
    assert_eq!(sampled, constrained[1..3], "kept up to the wrong draft, plus one");
    let rest = step(&mut worker, 3, &[constrained[2]], at + 2, false);
    assert_eq!(rest, constrained[3..4], "the grammar advanced only over kept tokens");

    // Rebuilt after 2 generated tokens: the grammar replays them.
    let mut history = prompt.clone();
    history.extend_from_slice(&constrained[..2]);
    assert_eq!(start(&mut worker, 3, history.clone(), 2, Some(GRAMMAR)), Ring::Done);
    let rebuilt = step(&mut worker, 3, &history, 0, false);
    assert_eq!(rebuilt, constrained[2..3]);
    // A history the grammar does not allow is refused, naming why.
    history.push(wrong);
    match start(&mut worker, 3, history, 3, Some(GRAMMAR)) {
        Ring::Error { message, .. } => assert!(message.contains("replaying"), "{message}"),
        other => panic!("expected an error, got {other:?}"),
    }
    match start(&mut worker, 3, prompt, 0, Some("root ::= nothing")) {
        Ring::Error { message, .. } => assert!(message.contains("'nothing'"), "{message}"),
        other => panic!("expected an error, got {other:?}"),
    }
}

/// A thinking budget, as llama.cpp's server enforces one: the generation prompt opens
/// `<think>` (its tail read first, so the newline after the tag counts), the budget's
/// tokens are greedy as without it, then `</think>` is forced token by token and
/// generation goes on after it; a sequence rebuilt in the middle of the forced tag
/// replays the budget and forces the rest.
#[test]
fn a_thinking_budget_forces_the_end_tag_once_spent() {
    let vocab = LlamaModel::load_vocab(Path::new(QWEN)).unwrap();
    let mut worker = worker();
    // Qwen2.5 has no thinking tokens: its `<think>` is a few text tokens, which the
    // prompt ends with as a thinking model's generation prompt does.
    let open = vocab.tokenize("<think>", false, true).unwrap();
    let close = vocab.tokenize("</think>", false, true).unwrap();
    let mut prompt = prompt(&vocab);
    let at = prompt.len();
    prompt.extend(&open);
    prompt.extend(vocab.tokenize("\n", false, true).unwrap());
    let budget = ReasoningBudget {
        tokens: 4,
        start: open,
        ends: vec![close.clone()],
        forced: close.clone(),
        prefill: prompt[at..].to_vec(),
    };
    let with_budget = |seq, history: Vec<u32>, drawn| {
        StartSeq::new(seq, SamplingParams::greedy(), history)
            .with_drawn(drawn)
            .with_budget(Some(budget.clone()))
    };

    assert_eq!(start(&mut worker, 0, prompt.clone(), 0, None), Ring::Done);
    let free = generate(&mut worker, &vocab, 0, &prompt, 6);
    assert_eq!(worker.handle(with_budget(1, prompt.clone(), 0).into()), Ring::Done);
    let n = 3 + close.len() + 4;
    let limited = generate(&mut worker, &vocab, 1, &prompt, n);
    // 4 tokens of budget, the prompt's newline after `<think>` one of them.
    assert_eq!(limited[..3], free[..3], "the budget's tokens are the model's own");
    assert_ne!(
        free[3..3 + close.len()],
        close[..],
        "the test needs a model that does not close by itself"
    );
    assert_eq!(limited[3..3 + close.len()], close[..], "then the end tag, forced");

    // The same tokens fed one by one without a budget give the same continuation.
    assert_eq!(start(&mut worker, 2, prompt.clone(), 0, None), Ring::Done);
    let mut fed = step(&mut worker, 2, &prompt, 0, false);
    for (i, &token) in limited[..3 + close.len()].iter().enumerate() {
        fed = step(&mut worker, 2, &[token], (prompt.len() + i) as i32, false);
    }
    assert_eq!(fed[0], limited[3 + close.len()]);

    // Rebuilt after the first token of the tag: the rest of it is forced.
    let kept = 4;
    let mut history = prompt.clone();
    history.extend_from_slice(&limited[..kept]);
    assert_eq!(
        worker.handle(with_budget(3, history.clone(), kept as u32).into()),
        Ring::Done
    );
    assert_eq!(step(&mut worker, 3, &history, 0, false), limited[kept..kept + 1]);
}

/// Issue 16: a panic in a session's thread left the worker wedged. The stage loop
/// turns it into an error for that session, and tells the next hop.
/// A stage's failures say whose they are: the request's (a grammar that does not
/// parse), the cache's (no room for the batch) or the protocol's (a step for a sequence
/// never started, a message that does not travel the ring); the head answers 400, 503
/// or 500 by them.
#[test]
fn a_failure_names_its_fault() {
    use baton_proto::Fault;
    let file = ModelFile::open(Path::new(QWEN)).expect("scripts/fetch-models puts qwen2 in models/");
    let span = StageSpan {
        layers: 0..file.hparams().n_layer,
        first: true,
        last: true,
    };
    let mut worker = StageWorker::new(Stage::load(file, span, &StageConfig::new(64, 2)).expect("stage loads"));
    let fault = |reply: Ring| match reply {
        Ring::Error { fault, message, .. } => (fault, message),
        other => panic!("expected an error, got {other:?}"),
    };
    let (got, message) = fault(start(&mut worker, 0, vec![1, 2], 0, Some("root ::= (")));
    assert_eq!(got, Fault::Request, "{message}");
    assert_eq!(start(&mut worker, 0, vec![1, 2], 0, None), Ring::Done);
    let forward = |tokens: Vec<u32>, seq: u32| {
        let n = tokens.len() as u32;
        Ring::Forward(Forward {
            step: 0,
            payload: Payload::Tokens(tokens),
            positions: (0..n as i32).collect(),
            seq_ids: vec![seq; n as usize],
            sample_rows: vec![n - 1],
            row_tokens: Vec::new(),
        })
    };
    let (got, message) = fault(worker.handle(forward(vec![11; 65], 0)));
    assert_eq!(got, Fault::CacheFull, "{message}");
    assert!(message.contains("KV cache is full"), "{message}");
    let (got, message) = fault(worker.handle(forward(vec![11], 3)));
    assert_eq!(got, Fault::Protocol, "{message}");
    assert!(message.contains("no sampler"), "{message}");
}

/// A frame that does not travel the ring (a heartbeat's `Pong`) is answered with a
/// protocol `Error`, and the stage serves on.
#[test]
fn a_frame_of_another_conversation_is_answered_with_a_protocol_error() {
    use super::serve;
    use baton_net::{local_link, Rx, Tx};
    use baton_proto::Fault;

    let (mut to_stage, stage_rx) = local_link("stage");
    let (stage_tx, mut from_stage) = local_link("next");
    to_stage.send(Message::Pong).unwrap();
    to_stage.send(Message::Shutdown).unwrap();
    serve(Ok, 12, stage_rx, stage_tx).unwrap();
    assert_eq!(
        from_stage.recv().unwrap(),
        Message::Error {
            first_layer: 12,
            fault: Fault::Protocol,
            message: "Pong is not a ring message".into()
        }
    );
    assert_eq!(from_stage.recv().unwrap(), Message::Shutdown);
}

#[test]
fn a_panic_while_handling_a_message_ends_the_loop_with_an_error_passed_on() {
    use super::{serve, NodeError};
    use baton_net::{local_link, Rx, Tx};

    let (mut to_stage, stage_rx) = local_link("stage");
    let (stage_tx, mut from_stage) = local_link("next");
    to_stage.send(Message::EndSeq { seq: 1 }).unwrap();
    to_stage.send(Message::EndSeq { seq: 2 }).unwrap();
    let handler = |msg: Ring| match msg {
        Ring::EndSeq { seq: 2 } => panic!("seq 2 broke the stage"),
        other => Ok(other),
    };
    let result = serve(handler, 12, stage_rx, stage_tx);
    let Err(NodeError::Stage {
        first_layer,
        fault: baton_proto::Fault::Compute,
        message,
    }) = result
    else {
        panic!("{result:?}")
    };
    assert_eq!(first_layer, 12);
    assert_eq!(message, "the stage panicked handling EndSeq: seq 2 broke the stage");
    assert_eq!(from_stage.recv().unwrap(), Message::EndSeq { seq: 1 });
    assert_eq!(
        from_stage.recv().unwrap(),
        Message::Error {
            first_layer: 12,
            fault: baton_proto::Fault::Compute,
            message: message.clone()
        }
    );
}

/// A stage whose tensor-parallel group broke stops without answering: its links close
/// and the head sees the ring lost (and rebuilds its requests on a new one), where an
/// `Error` would have failed them.
#[test]
fn a_broken_group_ends_the_loop_without_an_answer() {
    use super::{serve, NodeError};
    use baton_net::{local_link, NetError, Rx, Tx};

    let (mut to_stage, stage_rx) = local_link("stage");
    let (stage_tx, mut from_stage) = local_link("next");
    to_stage.send(Message::EndSeq { seq: 1 }).unwrap();
    to_stage.send(Message::EndSeq { seq: 2 }).unwrap();
    to_stage.send(Message::EndSeq { seq: 3 }).unwrap();
    let handler = |msg: Ring| match msg {
        Ring::EndSeq { seq: 2 } => Err(NodeError::Stage {
            first_layer: 12,
            fault: baton_proto::Fault::Compute,
            message: "tensor-parallel group aborted: member 1 left".into(),
        }),
        other => Ok(other),
    };
    let result = serve(handler, 12, stage_rx, stage_tx);
    assert!(
        matches!(&result, Err(NodeError::Stage { message, .. }) if message.contains("member 1 left")),
        "{result:?}"
    );
    assert_eq!(from_stage.recv().unwrap(), Message::EndSeq { seq: 1 });
    assert!(
        matches!(from_stage.recv(), Err(NetError::Closed { .. })),
        "nothing follows: the link closed"
    );
}

/// A pooled sequence on a last stage: its chunks are kept and the one that samples its
/// last row is answered with a unit vector of the model's width (the last row's, here:
/// the same whether the sequence came in one chunk or two only when the chunks are the
/// same, so only its shape is checked); a truncated pool continues; frames that break
/// the rules (a cached prefix, another sequence in the batch, positions that skip, a
/// sampled row that is not the last) are refused without touching the pool.
#[test]
fn a_pooled_sequence_is_answered_with_its_vector_and_bad_frames_are_refused() {
    use baton_proto::{Fault, Pooling};
    let mut worker = worker();
    let pooled = |seq: u32, keep: u32| {
        StartSeq::new(seq, SamplingParams::greedy(), Vec::new())
            .keeping(keep)
            .with_pooling(Some(Pooling::Last))
            .into()
    };
    let chunk = |seq_ids: Vec<u32>, start: i32, sample_rows: Vec<u32>| {
        let n = seq_ids.len();
        Ring::Forward(Forward {
            step: 7,
            payload: Payload::Tokens((0..n as u32).map(|t| 100 + t).collect()),
            positions: (start..start + n as i32).collect(),
            seq_ids,
            sample_rows,
            row_tokens: Vec::new(),
        })
    };
    let refused = |reply: Ring, says: &str| match reply {
        Ring::Error { fault, message, .. } => {
            assert_eq!(fault, Fault::Protocol, "{message}");
            assert!(message.contains(says), "{message}");
        }
        other => panic!("expected an error, got {other:?}"),
    };
    refused(worker.handle(pooled(0, 3)), "empty cache");
    assert_eq!(worker.handle(pooled(0, 0)), Ring::Done);
    assert_eq!(worker.handle(pooled(1, 0)), Ring::Done);
    let first = worker.handle(chunk(vec![0; 4], 0, vec![]));
    assert_eq!(
        first,
        Ring::Sampled {
            step: 7,
            tokens: vec![]
        }
    );
    refused(worker.handle(chunk(vec![0, 0, 1], 4, vec![])), "and others");
    refused(worker.handle(chunk(vec![0; 2], 5, vec![])), "do not continue");
    refused(worker.handle(chunk(vec![0; 2], 4, vec![0])), "only its last row");
    // Cut back to 2 rows, then the rest: 5 rows in all, the last one sampled.
    assert_eq!(worker.handle(Ring::TruncateSeq { seq: 0, len: 2 }), Ring::Done);
    match worker.handle(chunk(vec![0; 3], 2, vec![2])) {
        Ring::Pooled { step, seq, values } => {
            assert_eq!((step, seq, values.len()), (7, 0, 896));
            let norm: f64 = values.iter().map(|&x| f64::from(x).powi(2)).sum::<f64>().sqrt();
            assert!((norm - 1.0).abs() < 1e-5, "{norm}");
        }
        other => panic!("expected Pooled, got {other:?}"),
    }
    // The pool ended with its vector: the sequence is neither pooled nor sampled now.
    refused(worker.handle(chunk(vec![0], 5, vec![0])), "no sampler");
    // A one-row sequence is its own vector.
    assert!(matches!(
        worker.handle(chunk(vec![1], 0, vec![0])),
        Ring::Pooled { seq: 1, .. }
    ));
}

#[test]
fn vectors_are_normalized_as_llama_server_normalizes_them() {
    assert_eq!(super::normalize(&[3.0, 4.0]), [0.6, 0.8]);
    assert_eq!(super::normalize(&[0.0, 0.0]), [0.0, 0.0]);
    let v = super::normalize(&[1e-10, -2e-10, 3e-10]);
    assert!((v.iter().map(|x| x * x).sum::<f32>() - 1.0).abs() < 1e-6, "{v:?}");
    // Squares are taken in f32, as llama.cpp takes them: these underflow to a zero norm.
    assert_eq!(super::normalize(&[1e-30, 2e-30]), [0.0, 0.0]);
}
