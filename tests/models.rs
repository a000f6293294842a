//! Several models on one server (issue 32): `baton serve --model A --model B` plans each
//! model over the same workers, routes requests by their `model` field, and every model
//! answers with libllama's tokens, alone or while the other computes. A worker serves
//! one head per model at once, and still refuses a second head for the same model. The
//! page offers every model.

mod common;

use std::time::Duration;

use baton_cluster::{connect_cluster, ClusterOptions};
use baton_ggml::LlamaModel;
use serde_json::{json, Value};

use common::server::{lock, parse_metrics, Server, KEY};
use common::worker::{greedy, models_dir, reference, WorkerProc};
use common::{model, GEMMA3, PROMPTS, QWEN2};

/// The greedy continuation of `prompt` (as tokens) by libllama, as text.
fn expected_text(oracle: &LlamaModel, prompt: &str, n: usize) -> String {
    let tokens = oracle.tokenize(prompt, true, true).unwrap();
    oracle.detokenize(&reference(oracle, &tokens, n), false)
}

/// A greedy completion of `prompt` by the model called `id`.
fn complete(server: &Server, id: &str, prompt: &str, n: usize) -> String {
    let answer = server.post(
        "/v1/completions",
        &json!({ "model": id, "prompt": prompt, "max_tokens": n, "temperature": 0 }),
    );
    assert_eq!(answer["model"], id, "{answer}");
    answer["choices"][0]["text"].as_str().unwrap().to_string()
}

#[test]
fn two_models_on_the_same_workers_answer_by_name_with_libllamas_tokens() {
    let _serial = lock();
    let gemma = model(GEMMA3);
    let server = Server::start_on(
        &model(QWEN2),
        &["--local-workers", "2", "--no-head-stage"],
        &[
            "--model",
            gemma.to_str().unwrap(),
            "--alias",
            "qwen",
            "--alias",
            "gemma",
        ],
    );
    let qwen_oracle = LlamaModel::load_full(&model(QWEN2), true).unwrap();
    let gemma_oracle = LlamaModel::load_full(&gemma, true).unwrap();

    // Both listed, in the order given.
    let (status, text) = server.request("GET", "/v1/models", None, Some(KEY));
    assert_eq!(status, 200, "{text}");
    let listed: Value = serde_json::from_str(&text).unwrap();
    let ids: Vec<&str> = listed["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["qwen", "gemma"]);

    // Each answers by name, with libllama's tokens; at once, as alone.
    let expected = [
        ("qwen", expected_text(&qwen_oracle, PROMPTS[0], 12)),
        ("gemma", expected_text(&gemma_oracle, PROMPTS[0], 12)),
    ];
    for (id, want) in &expected {
        assert_eq!(&complete(&server, id, PROMPTS[0], 12), want, "{id} alone");
    }
    std::thread::scope(|scope| {
        let running: Vec<_> = expected
            .iter()
            .map(|(id, want)| (id, want, scope.spawn(|| complete(&server, id, PROMPTS[0], 12))))
            .collect();
        for (id, want, answer) in running {
            assert_eq!(&answer.join().unwrap(), want, "{id} beside the other");
        }
    });
    // A request that names no model goes to the first.
    let unnamed = server.post(
        "/v1/completions",
        &json!({ "prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0 }),
    );
    assert_eq!(unnamed["model"], "qwen");
    assert_eq!(unnamed["choices"][0]["text"], expected[0].1.as_str());

    // An unknown model: 404 naming what is served, on every endpoint that takes one.
    for path in [
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/embeddings",
        "/v1/messages",
    ] {
        let body = json!({ "model": "nope", "prompt": "x", "input": "x", "max_tokens": 1,
                           "messages": [{"role": "user", "content": "x"}] });
        let (status, text) = server.request("POST", path, Some(&body), Some(KEY));
        assert_eq!(status, 404, "{path}: {text}");
        let error: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(error["error"]["code"], "model_not_found", "{path}: {text}");
        let message = error["error"]["message"].as_str().unwrap();
        assert!(message.contains("'qwen', 'gemma'"), "{message}");
    }

    // Health: both serve, each on both workers.
    let (status, text) = server.request("GET", "/health", None, Some(KEY));
    assert_eq!(status, 200, "{text}");
    let health: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(health["status"], "ok");
    let models = health["models"].as_array().unwrap();
    assert_eq!(models.len(), 2, "{health}");
    for m in models {
        assert_eq!(m["status"], "ok", "{health}");
        let stages: Vec<&str> = m["stages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s.as_str().unwrap())
            .collect();
        assert!(
            stages.len() == 2 && stages[0].contains("w0.sock") && stages[1].contains("w1.sock"),
            "{health}"
        );
    }

    // Stats by model, and metrics labelled by model.
    let (status, text) = server.request("GET", "/stats?model=gemma", None, Some(KEY));
    assert_eq!(status, 200, "{text}");
    let stats: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(stats["model"], "gemma");
    assert_eq!(stats["models"], json!(["qwen", "gemma"]));
    assert!(stats["completion_tokens"].as_u64().unwrap() >= 24, "{stats}");
    let (status, _) = server.request("GET", "/stats?model=nope", None, Some(KEY));
    assert_eq!(status, 404);
    let (status, text) = server.request("GET", "/metrics", None, Some(KEY));
    assert_eq!(status, 200);
    let samples = parse_metrics(&text);
    for id in ["qwen", "gemma"] {
        let generated = samples
            .iter()
            .find(|s| s.name == "baton_generated_tokens_total" && s.labels.get("model").map(String::as_str) == Some(id))
            .unwrap_or_else(|| panic!("no generated tokens for {id}:\n{text}"));
        assert!(generated.value >= 24.0, "{id}: {}", generated.value);
    }

    // The page offers both, and chats with the one chosen (headless Chromium).
    let status = server
        .node_tests(&["page_models.test.mjs"])
        .status()
        .expect("node runs (scripts/setup installs tests/node)");
    assert!(status.success(), "the page test failed (output above)");
}

const TOKEN: &str = "test-models-secret";

fn options() -> ClusterOptions {
    ClusterOptions {
        head_stage: false,
        ..common::worker::options(TOKEN)
    }
}

/// A worker holds a head's session for each model at once, with each ring's links kept
/// apart (`JoinRing`), and refuses a second head for a model it serves already.
#[test]
fn a_worker_serves_one_head_per_model_at_once() {
    let worker = [
        WorkerProc::start(&models_dir(), Some(TOKEN), &[]),
        WorkerProc::start(&models_dir(), Some(TOKEN), &[]),
    ];
    let addrs: Vec<String> = worker.iter().map(|w| w.addr.clone()).collect();
    let (qwen, gemma) = (model(QWEN2), model(GEMMA3));
    let qwen_oracle = LlamaModel::load_full(&qwen, true).unwrap();
    let gemma_oracle = LlamaModel::load_full(&gemma, true).unwrap();
    let mut qwen_ring = connect_cluster(&qwen, &addrs, &options()).unwrap();
    let mut gemma_ring = connect_cluster(&gemma, &addrs, &options()).unwrap();
    // Each ring crosses both workers (its ring link between them named by session).
    for ring in [&qwen_ring, &gemma_ring] {
        let on = ring.describe_stages().join("; ");
        assert!(addrs.iter().all(|a| on.contains(a.as_str())), "{on}: {}", ring.plan.why);
    }

    let second = connect_cluster(&qwen, &addrs, &options())
        .err()
        .expect("a second head for the same model is refused");
    assert_eq!(second.refusal(), Some(baton_proto::RefusalCode::Busy), "{second}");
    assert!(second.to_string().contains("another head"), "{second}");

    for prompt in PROMPTS {
        let q = qwen_oracle.tokenize(prompt, true, true).unwrap();
        let g = gemma_oracle.tokenize(prompt, true, true).unwrap();
        assert_eq!(
            greedy(&mut qwen_ring, &q, 12, &qwen_oracle),
            reference(&qwen_oracle, &q, 12)
        );
        assert_eq!(
            greedy(&mut gemma_ring, &g, 12, &gemma_oracle),
            reference(&gemma_oracle, &g, 12)
        );
    }
    // When one head goes, the other's ring keeps computing; the model is free again.
    drop(qwen_ring);
    let g = gemma_oracle.tokenize(PROMPTS[1], true, true).unwrap();
    assert_eq!(
        greedy(&mut gemma_ring, &g, 8, &gemma_oracle),
        reference(&gemma_oracle, &g, 8)
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let mut again = loop {
        match connect_cluster(&qwen, &addrs, &options()) {
            Ok(ring) => break ring,
            Err(e) if std::time::Instant::now() < deadline => {
                assert_eq!(e.refusal(), Some(baton_proto::RefusalCode::Busy), "{e}");
                std::thread::sleep(Duration::from_millis(100));
            }
            Err(e) => panic!("the model's worker was not freed: {e}"),
        }
    };
    let q = qwen_oracle.tokenize(PROMPTS[2], true, true).unwrap();
    assert_eq!(greedy(&mut again, &q, 8, &qwen_oracle), reference(&qwen_oracle, &q, 8));
}
