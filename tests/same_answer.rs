//! The same request gets the same answer whatever the server ran before: fresh, with its
//! prompt cached, after its slot was partly taken by another request, streamed or not;
//! and that answer is what `baton run` and single-process llama.cpp give for the prompt
//! cut the same way.
//!
//! Regression (issue 12): a fresh `baton serve` answered "Write a Python function that
//! reverses a string." with "Here's a Python function to reverse a string...", every
//! later identical request with "Here's a simple Python function...": a cached prefix
//! left only the last prompt token to compute, as a one-row step, where the fresh run had
//! computed it inside a prompt chunk, and ggml rounds the two shapes differently.

mod common;

use std::process::Command;

use baton_ggml::{LlamaContext, LlamaModel};
use baton_sample::argmax;
use common::server::{lock, Server};
use common::{model, QWEN2};
use serde_json::{json, Value};

const CHUNK: usize = 16;
const MAX_TOKENS: usize = 40;
const QUESTION: &str = "Write a Python function that reverses a string.";

/// What a greedy answer is made of: its text and each token's two best log-probabilities
/// (equal log-probabilities to the last bit mean equal logits for the tokens that matter).
#[derive(Debug, PartialEq)]
struct Answer {
    text: String,
    logprobs: Vec<Value>,
    cached: u64,
}

fn chat_body(server: &Server, content: &str, stream: bool) -> Value {
    json!({
        "model": server.model_id(),
        "messages": [{"role": "user", "content": content}],
        "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": true, "top_logprobs": 2,
        "stream": stream, "stream_options": {"include_usage": true},
    })
}

fn ask(server: &Server, content: &str) -> Answer {
    let reply = server.post("/v1/chat/completions", &chat_body(server, content, false));
    let choice = &reply["choices"][0];
    Answer {
        text: choice["message"]["content"].as_str().unwrap().to_string(),
        logprobs: choice["logprobs"]["content"].as_array().unwrap().clone(),
        cached: reply["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap(),
    }
}

fn ask_streamed(server: &Server, content: &str) -> Answer {
    let events = server.stream("/v1/chat/completions", &chat_body(server, content, true));
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"), "{events:?}");
    let mut answer = Answer {
        text: String::new(),
        logprobs: Vec::new(),
        cached: 0,
    };
    for event in &events[..events.len() - 1] {
        let chunk: Value = serde_json::from_str(event).unwrap();
        if let Some(cached) = chunk["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64() {
            answer.cached = cached;
        }
        let Some(choice) = chunk["choices"].get(0) else {
            continue;
        };
        answer.text.push_str(choice["delta"]["content"].as_str().unwrap_or(""));
        if let Some(content) = choice["logprobs"]["content"].as_array() {
            answer.logprobs.extend(content.iter().cloned());
        }
    }
    answer
}

#[test]
fn the_same_request_gets_the_same_answer_whatever_the_cache_holds() {
    let _serial = lock();
    let server = Server::start(&["--chunk", "16", "--parallel", "2"]);
    let fresh = ask(&server, QUESTION);
    assert_eq!(fresh.cached, 0);
    assert_eq!(fresh.logprobs.len(), MAX_TOKENS, "{fresh:?}");

    let cached = ask(&server, QUESTION);
    println!("cached: {} prompt tokens reused", cached.cached);

    // Another question shares the template's opening chunks: it takes the slot holding
    // QUESTION's cache (the other slot shares nothing) and keeps only those chunks.
    ask(&server, "What is the capital of France?");
    let evicted = ask(&server, QUESTION);
    println!("after partial eviction: {} prompt tokens reused", evicted.cached);

    let streamed = ask_streamed(&server, QUESTION);
    for (what, answer) in [
        ("cached", &cached),
        ("after eviction", &evicted),
        ("streamed", &streamed),
    ] {
        assert_eq!(answer.text, fresh.text, "{what} vs fresh: text");
        assert_eq!(answer.logprobs, fresh.logprobs, "{what} vs fresh: log-probabilities");
    }
    assert!(cached.cached > 0, "the second request reuses the first one's prompt");
    assert_eq!(cached.cached % CHUNK as u64, 0, "only whole chunks are reused");
    assert!(
        evicted.cached > 0 && evicted.cached < cached.cached,
        "the slot was partly evicted ({} reused, {} before)",
        evicted.cached,
        cached.cached
    );
}

/// The server's answer to a raw prompt (cut in chunks of 16) equals `baton run` with
/// batches of 16 and libllama fed the same chunks.
#[test]
fn the_server_answers_as_baton_run_and_llama_cpp_do() {
    let _serial = lock();
    let path = model(QWEN2);
    let prompt = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n\
                  Write a Python function that reverses a string.<|im_end|>\n<|im_start|>assistant\n";

    let server = Server::start(&["--chunk", "16"]);
    let body = json!({"model": server.model_id(), "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0});
    let served = server.post("/v1/completions", &body)["choices"][0]["text"]
        .as_str()
        .unwrap()
        .to_string();
    drop(server);

    let run = Command::new(env!("CARGO_BIN_EXE_baton"))
        .args([
            "run",
            "--stages",
            "2",
            "--threads",
            "1",
            "-b",
            "16",
            "-n",
            "40",
            "--prompt",
            prompt,
            "--model",
        ])
        .arg(&path)
        .output()
        .expect("baton run starts");
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    let stdout = String::from_utf8(run.stdout).unwrap();
    let ran = stdout.strip_prefix(prompt).expect("run prints the prompt first");
    let ran = ran.strip_suffix('\n').unwrap_or(ran);

    let oracle = LlamaModel::load_full(&path, true).unwrap();
    let tokens = oracle.tokenize(prompt, true, true).unwrap();
    let mut ctx = LlamaContext::new(&oracle, 512, CHUNK as u32, 1).unwrap();
    let mut logits = Vec::new();
    for chunk in tokens.chunks(CHUNK) {
        logits = ctx.decode(chunk).unwrap();
    }
    let mut generated = Vec::new();
    for _ in 0..MAX_TOKENS {
        let token = argmax(&logits).unwrap();
        if oracle.is_end_of_generation(token) {
            break;
        }
        generated.push(token);
        logits = ctx.decode(&[token]).unwrap();
    }
    let llama = oracle.detokenize(&generated, false);

    println!("served: {served:?}");
    assert_eq!(served, ran, "baton serve vs baton run");
    assert_eq!(served, llama, "baton serve vs libllama");
}
