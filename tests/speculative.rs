//! Speculative decoding through the ring: drafted tokens travel with each token, the
//! last stage keeps those its own sampling agrees with. The text must be exactly what
//! decoding without drafts gives (greedy and seeded), whatever the draft source, alone
//! or beside other requests.

mod common;

use common::server::{lock, Server};
use common::{model, QWEN2};
use serde_json::{json, Value};

/// A code-editing prompt: the answer repeats much of it, so prompt lookup hits.
const CODE: &str = "Here is a Python function:\n\ndef add_numbers(first, second):\n    total = first + second\n    \
                    print(\"the total is\", total)\n    return total\n\nRewrite it with the parameters renamed to a \
                    and b:\n\n";

/// Text, per-token log-probabilities and finish reason of a completion.
#[derive(Debug, PartialEq)]
struct Answer {
    text: String,
    logprobs: Value,
    finish: Value,
}

fn complete(server: &Server, prompt: &str, extra: Value) -> Answer {
    let mut body = json!({"model": server.model_id(), "prompt": prompt, "max_tokens": 64, "logprobs": 2});
    for (key, value) in extra.as_object().unwrap() {
        body[key] = value.clone();
    }
    let reply = server.post("/v1/completions", &body);
    let choice = &reply["choices"][0];
    Answer {
        text: choice["text"].as_str().unwrap().to_string(),
        logprobs: choice["logprobs"]["token_logprobs"].clone(),
        finish: choice["finish_reason"].clone(),
    }
}

/// [`CODE`] again (a server with `--chunk 8` that computed it before) takes every whole
/// chunk of 8 before its last from the cache.
fn assert_reuses_whole_chunks_of_8(server: &Server) {
    let body = json!({"model": server.model_id(), "prompt": CODE, "max_tokens": 4, "temperature": 0});
    let reply = server.post("/v1/completions", &body);
    let cached = reply["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or(0);
    let prompt = reply["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(
        cached,
        (prompt - 1) / 8 * 8,
        "reused up to the last whole chunk: {reply}"
    );
}

fn drafts(server: &Server) -> (u64, u64) {
    let stats = server.stats();
    (
        stats["draft_tokens"].as_u64().unwrap(),
        stats["draft_accepted"].as_u64().unwrap(),
    )
}

#[test]
fn prompt_lookup_drafts_give_the_undrafted_text() {
    let _serial = lock();
    let server = Server::start(&["--draft", "ngram", "--draft-max", "6", "--draft-fixed"]);
    let greedy = json!({"temperature": 0});
    let plain = complete(&server, CODE, json!({"temperature": 0, "draft": "off"}));
    assert_eq!(drafts(&server), (0, 0), "draft off sends no drafts");
    let drafted = complete(&server, CODE, greedy.clone());
    let (sent, kept) = drafts(&server);
    println!("greedy: {sent} tokens drafted, {kept} kept; {:?}", drafted.text);
    assert!(
        kept > 0 && sent > kept,
        "prompt lookup drafts and some are kept: {sent}/{kept}"
    );
    assert_eq!(
        drafted, plain,
        "greedy text and log-probabilities with drafts vs without"
    );

    // Seeded sampling: each sample makes the same random draw with or without a draft,
    // so the text is the same too (and the same run after run).
    let seeded = json!({"temperature": 0.8, "seed": 1234, "top_k": 40});
    let mut off = seeded.clone();
    off["draft"] = json!("off");
    let plain = complete(&server, CODE, off);
    let drafted = complete(&server, CODE, seeded.clone());
    let again = complete(&server, CODE, seeded);
    assert_eq!(drafted, plain, "seeded text with drafts vs without");
    assert_eq!(again, drafted, "seeded text run after run");
    let (sent_after, kept_after) = drafts(&server);
    assert!(sent_after > sent && kept_after > kept, "seeded requests drafted too");
}

#[test]
fn concurrent_drafting_requests_produce_what_each_produces_alone() {
    let _serial = lock();
    let server = Server::start(&[
        "--parallel",
        "4",
        "--draft",
        "ngram",
        "--draft-max",
        "4",
        "--draft-fixed",
    ]);
    let prompts = [
        CODE.to_string(),
        CODE.replace("add_numbers", "sum_two"),
        "def fibonacci(n):".to_string(),
        "The capital of France is".to_string(),
    ];
    let greedy = json!({"temperature": 0, "draft": "off"});
    let alone: Vec<Answer> = prompts.iter().map(|p| complete(&server, p, greedy.clone())).collect();
    let together: Vec<Answer> = std::thread::scope(|scope| {
        let handles: Vec<_> = prompts
            .iter()
            .map(|p| scope.spawn(|| complete(&server, p, json!({"temperature": 0}))))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let (sent, kept) = drafts(&server);
    println!("4 concurrent requests: {sent} tokens drafted, {kept} kept");
    assert!(kept > 0);
    for (i, (a, t)) in alone.iter().zip(&together).enumerate() {
        assert_eq!(a, t, "prompt {i}: alone without drafts vs together with drafts");
    }
}

/// The model as its own draft model: the draft computes every row as the ring does, so
/// every drafted token is kept.
#[test]
fn the_model_as_its_own_draft_has_every_draft_accepted() {
    let _serial = lock();
    let path = model(QWEN2);
    let server = Server::start(&[
        "--draft-model",
        path.to_str().unwrap(),
        "--draft-max",
        "4",
        "--draft-fixed",
        "--chunk",
        "16",
    ]);
    let plain = complete(&server, CODE, json!({"temperature": 0, "draft": "off"}));
    let drafted = complete(&server, CODE, json!({"temperature": 0}));
    let (sent, kept) = drafts(&server);
    println!("self-draft: {sent} tokens drafted, {kept} kept");
    assert!(sent > 0);
    assert_eq!(kept, sent, "every drafted token is the model's own greedy choice");
    assert_eq!(drafted, plain);
    // A second request reuses the draft model's cache of the first (same slot).
    let again = complete(&server, CODE, json!({"temperature": 0}));
    assert_eq!(again, plain);
    let (sent2, kept2) = drafts(&server);
    assert_eq!(kept2 - kept, sent2 - sent);
}

#[test]
fn bad_draft_settings_are_refused() {
    let _serial = lock();
    let server = Server::start(&["--draft", "ngram"]);
    let body = json!({"model": server.model_id(), "prompt": "x", "max_tokens": 2, "draft": "model"});
    let (status, text) = server.request("POST", "/v1/completions", Some(&body), Some(common::server::KEY));
    assert_eq!(status, 400, "{text}");
    assert!(text.contains("--draft-model"), "{text}");
    let body = json!({"model": server.model_id(), "prompt": "x", "max_tokens": 2, "draft": "telepathy"});
    let (status, text) = server.request("POST", "/v1/completions", Some(&body), Some(common::server::KEY));
    assert_eq!(status, 400, "{text}");
    assert!(text.contains("unknown draft source 'telepathy'"), "{text}");
    let body = json!({"model": server.model_id(), "prompt": "x", "max_tokens": 2, "draft_max": 99});
    let (status, text) = server.request("POST", "/v1/completions", Some(&body), Some(common::server::KEY));
    assert_eq!(status, 400, "{text}");
}

/// A small random model sharing the tokenizer (a synthetic qwen2 with the whole
/// vocabulary) drafts tokens the model rarely agrees with: few are kept, and the text
/// is the model's own.
#[test]
fn a_small_unrelated_draft_model_changes_nothing_but_speed() {
    let _serial = lock();
    let draft = common::synth::synthetic_with("qwen2", baton_ggml::FileType::Q8_0, |spec| spec.vocab = None);
    let server = Server::start(&[
        "--draft-model",
        draft.to_str().unwrap(),
        "--draft-max",
        "3",
        "--draft-fixed",
    ]);
    let plain = complete(&server, CODE, json!({"temperature": 0, "draft": "off"}));
    let drafted = complete(&server, CODE, json!({"temperature": 0}));
    let (sent, kept) = drafts(&server);
    println!("synthetic draft: {sent} tokens drafted, {kept} kept");
    assert!(sent > 0, "the draft model drafted");
    assert!(
        kept * 2 < sent,
        "an unrelated model's drafts are mostly rejected ({kept} of {sent})"
    );
    assert_eq!(drafted, plain);
}

/// A server of the model at `path` in chunks of 8 with `draft`: greedy and seeded, the
/// drafted text equals the undrafted one, and so does the same prompt again (from the
/// stages' checkpoint after its last whole chunk).
fn drafts_change_no_text(path: &std::path::Path, draft: &[&str]) -> Server {
    let mut args = draft.to_vec();
    args.extend(["--chunk", "8"]);
    let server = Server::start_path(path, &args);
    for sampling in [
        json!({"temperature": 0}),
        json!({"temperature": 1.0, "seed": 7, "top_k": 40}),
    ] {
        let mut off = sampling.clone();
        off["draft"] = json!("off");
        let plain = complete(&server, CODE, off);
        let drafted = complete(&server, CODE, sampling.clone());
        assert_eq!(drafted, plain, "{draft:?} {sampling}: text with drafts vs without");
        let again = complete(&server, CODE, sampling.clone());
        assert_eq!(again, plain, "{draft:?} {sampling}: the prompt again");
    }
    server
}

/// A hybrid model (synthetic qwen35: recurrent states in half its layers): a rejected
/// draft rolls each state back to a kept position, so the drafted text equals the
/// undrafted one, greedy and seeded, with prompt lookup and with another random qwen35
/// (its own output untied) as the draft model, whose drafts the seeded samples often
/// reject (its own states rolled back too); a repeated prompt starts from the stages'
/// checkpoint of the states after its last whole chunk (of 8) and gives the same text.
#[test]
fn a_hybrid_models_drafts_and_repeated_prompts_give_the_undrafted_text() {
    let _serial = lock();
    let path = common::synth::synthetic("qwen35", baton_ggml::FileType::Q4KM);
    let other = common::synth::synthetic_with("qwen35", baton_ggml::FileType::Q4KM, |spec| {
        spec.seed = 2;
        spec.tied_output = false;
    });
    for draft in [
        vec!["--draft", "ngram", "--draft-max", "16", "--draft-fixed"],
        vec![
            "--draft-model",
            other.to_str().unwrap(),
            "--draft-max",
            "6",
            "--draft-fixed",
        ],
    ] {
        let server = drafts_change_no_text(&path, &draft);
        let (sent, kept) = drafts(&server);
        println!("{draft:?}: {sent} tokens drafted, {kept} kept");
        assert!(sent > 0, "{draft:?} drafted");
        if draft[0] == "--draft-model" {
            assert!(
                sent > kept,
                "another model's drafts are rejected at times: {sent}/{kept}"
            );
        }
        assert_reuses_whole_chunks_of_8(&server);
    }
}

/// Kimi Linear (synthetic kimi-linear: KDA states in half its layers, MLA rows in the
/// others): a rejected draft rolls each KDA state back to a kept position and truncates
/// the latent rows, so the drafted text equals the undrafted one, greedy and seeded,
/// with prompt lookup and with the model itself as the draft model (the head computes it
/// in other batch shapes, so some of its drafts are kept and others rejected: rollbacks
/// land at several depths; its own states are rolled back too); a
/// repeated prompt starts from the stages' checkpoint of the states after its last
/// whole chunk (of 8) and gives the same text. (This random model's text does not
/// repeat itself within 64 tokens, so prompt lookup finds nothing to draft.)
#[test]
fn kimi_linear_drafts_and_repeated_prompts_give_the_undrafted_text() {
    let _serial = lock();
    let path = common::synth::synthetic("kimi-linear", baton_ggml::FileType::Q4KM);
    for draft in [
        vec!["--draft", "ngram", "--draft-max", "8", "--draft-fixed"],
        vec![
            "--draft-model",
            path.to_str().unwrap(),
            "--draft-max",
            "6",
            "--draft-fixed",
        ],
    ] {
        let server = drafts_change_no_text(&path, &draft);
        let (sent, kept) = drafts(&server);
        println!("kimi-linear {draft:?}: {sent} tokens drafted, {kept} kept");
        if draft[0] == "--draft-model" {
            assert!(
                kept > 0 && sent > kept,
                "the drafts are kept at times and rejected at others: {sent}/{kept}"
            );
        }
        assert_reuses_whole_chunks_of_8(&server);
    }
}

/// DeepSeek V3.2's sparse attention (synthetic deepseek32, each query attending to the
/// 8 tokens its indexer chooses): the indexer's keys live in the KV cache's cells, so a
/// rejected draft's go with its latent rows and a repeated prompt reuses them. Drafted
/// text equals the undrafted one, greedy and seeded; the prompt again (in chunks of 8)
/// reuses every whole chunk before its last and gives the same text; two requests at
/// once give each the text it gives alone.
#[test]
fn sparse_attention_drafts_repeated_and_concurrent_prompts_give_the_undrafted_text() {
    let _serial = lock();
    let path = common::synth::synthetic("deepseek32", baton_ggml::FileType::Q4KM);
    let server = Server::start_path(
        &path,
        &["--draft", "ngram", "--draft-max", "8", "--draft-fixed", "--chunk", "8"],
    );
    let other = "Once upon a time, in a small village by the sea, there lived an old fisherman who";
    for sampling in [
        json!({"temperature": 0}),
        json!({"temperature": 1.0, "seed": 7, "top_k": 40}),
    ] {
        let mut off = sampling.clone();
        off["draft"] = json!("off");
        let plain = complete(&server, CODE, off.clone());
        let drafted = complete(&server, CODE, sampling.clone());
        assert_eq!(drafted, plain, "{sampling}: text with drafts vs without");
        let again = complete(&server, CODE, sampling.clone());
        assert_eq!(again, plain, "{sampling}: the prompt again");
        assert_reuses_whole_chunks_of_8(&server);
        let other_alone = complete(&server, other, off);
        let (code, story) = std::thread::scope(|s| {
            let code = s.spawn(|| complete(&server, CODE, sampling.clone()));
            let story = s.spawn(|| complete(&server, other, sampling.clone()));
            (code.join().unwrap(), story.join().unwrap())
        });
        assert_eq!(code, plain, "{sampling}: beside another request");
        assert_eq!(story, other_alone, "{sampling}: the other request beside it");
    }
    let (sent, kept) = drafts(&server);
    println!("deepseek32: {sent} tokens drafted, {kept} kept");
    assert!(sent > kept, "drafts were sent and some rejected: {sent}/{kept}");
}
