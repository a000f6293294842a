//! `baton serve` as a real process, on a head + 2 local workers: the official `openai`
//! Python and Node clients, the official `anthropic` Python client against it, the web page in Chromium, curl streaming, concurrent requests, prefix reuse across
//! chat turns, cancellation on disconnect, errors in OpenAI's shape, one tool call under
//! `parallel_tool_calls: false`, and each link's round trip in /metrics with one link
//! delayed.

mod common;

use std::io::{BufRead, BufReader, Read};
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use common::proxy::DelayProxy;
use common::server::{lock, parse_metrics, sample, split_response, Server, KEY};
use common::worker::WorkerProc;

#[test]
fn the_openai_python_client_works_against_the_server() {
    let _serial = lock();
    let server = Server::start(&["--parallel", "4", "-c", "4096", "--pooling", "mean"]);
    assert!(
        server.pytest("tests/openai"),
        "the openai client tests failed (output above)"
    );
}

/// The official `anthropic` Python client against `/v1/messages` (tests/anthropic):
/// text as chat answers it, streaming in Anthropic's events, max_tokens and stop
/// sequences, a forced tool call and its result, errors as the client's exceptions.
#[test]
fn the_anthropic_python_client_works_against_the_server() {
    let _serial = lock();
    let server = Server::start(&["--parallel", "2", "-c", "4096"]);
    assert!(
        server.pytest("tests/anthropic"),
        "the anthropic client tests failed (output above)"
    );
}

/// `parallel_tool_calls: false` under `tool_choice: auto` with both official clients,
/// whole and streamed (tests/openai/one_tool_call.py, tests/node/one_tool_call.mjs):
/// a model that calls twice when allowed gets one call back, and generation ends with it.
/// On gemma-3-270m, which follows the calls in its prompt (the files say why not Qwen).
#[test]
fn parallel_tool_calls_false_gives_one_call_under_auto() {
    let _serial = lock();
    let server = Server::start_model(common::GEMMA3, &["--parallel", "2", "-c", "2048"]);
    assert!(
        server.pytest("tests/openai/one_tool_call.py"),
        "the Python client's one-call tests failed (output above)"
    );
    let status = server.node_tests(&["one_tool_call.mjs"]).status().expect("node runs");
    assert!(
        status.success(),
        "the Node client's one-call test failed (output above)"
    );
}

/// The official `openai` Node client (tests/node/client.test.mjs) and the web page in
/// headless Chromium (tests/node/page.test.mjs); scripts/setup installs both.
#[test]
fn the_openai_node_client_and_the_web_page_work_against_the_server() {
    let _serial = lock();
    // The page draws each link of the ring with its round trip: a split that keeps
    // workers in the ring, whatever the planner would choose on this machine's timings.
    let server = Server::start(&["--parallel", "4", "-c", "2048", "--split", "12,6,6"]);
    let screenshot = concat!(env!("CARGO_TARGET_TMPDIR"), "/page.png");
    let status = server
        .node_tests(&["client.test.mjs", "responses.test.mjs", "page.test.mjs"])
        .env("BATON_SCREENSHOT", screenshot)
        .status()
        .expect("node runs (scripts/setup installs tests/node)");
    assert!(status.success(), "the Node tests failed (output above)");
}

#[test]
fn curl_streams_a_chat_completion() {
    let _serial = lock();
    let server = Server::start(&[]);
    let body = json!({
        "model": server.model_id(),
        "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": 8, "temperature": 0, "stream": true,
    });
    let output = Command::new("curl")
        .args(["-sN", "--fail-with-body", "-H", "Content-Type: application/json"])
        .args(["-H", &format!("Authorization: Bearer {KEY}"), "-d", &body.to_string()])
        .arg(format!("{}/v1/chat/completions", server.url()))
        .output()
        .expect("curl runs");
    assert!(
        output.status.success(),
        "curl: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let text = String::from_utf8(output.stdout).unwrap();
    let data: Vec<&str> = text.lines().filter_map(|l| l.strip_prefix("data: ")).collect();
    assert_eq!(data.last(), Some(&"[DONE]"), "{text}");
    let chunks: Vec<Value> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let content: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect::<Vec<_>>()
        .concat();
    assert!(!content.is_empty(), "{text}");
    let finished: Vec<&Value> = chunks
        .iter()
        .filter(|c| !c["choices"][0]["finish_reason"].is_null())
        .collect();
    assert_eq!(finished.len(), 1, "{text}");
}

/// Each link's round trip is timed on the link itself, where the node that dialed it
/// sits, and kept current. Worker 0 reaches worker 1 through a proxy that delays each
/// way by 50 ms: /metrics, read by Prometheus' own parser, shows that link's round trip
/// at about 100 ms, and the head's links and heartbeats (straight to the workers) well
/// under it. When the proxy's delay drops to 20 ms, the figure follows.
#[test]
fn a_delayed_link_shows_its_round_trip_in_metrics_and_the_others_stay_small() {
    let _serial = lock();
    const TOKEN: &str = "test-link-latency-secret";
    let models = common::model(common::QWEN2).parent().unwrap().to_path_buf();
    let mut proxy = DelayProxy::bind(Duration::from_millis(50));
    let w0 = WorkerProc::start(&models, Some(TOKEN), &[]);
    let w1 = WorkerProc::start(&models, Some(TOKEN), &["--advertise", &proxy.addr]);
    proxy.forward_to(w1.addr.clone());
    let workers = [w0.addr.clone(), w1.addr.clone()];
    let server = Server::start_on_workers(&workers, TOKEN, &["--no-head-stage", "--parallel", "1", "-c", "512"]);
    // Hidden states go through the proxy.
    let answer = server.post(
        "/v1/completions",
        &json!({"model": server.model_id(), "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}),
    );
    assert_eq!(answer["usage"]["completion_tokens"], 4, "{answer}");

    // The figures are the latest measured: on a busy 2-core machine one heartbeat may
    // be late, so the scrape is repeated (for at most 20 s) until the idle ring's hold.
    let expect_hop = |delay: Duration| {
        let delayed = 2.0 * delay.as_secs_f64();
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let (status, text) = server.request("GET", "/metrics", None, Some(KEY));
            assert_eq!(status, 200, "{text}");
            let samples = parse_metrics(&text);
            let link = |stage: &str| sample(&samples, "baton_link_round_trip_seconds", &[("stage", stage)]);
            let heartbeat = |addr: &str| sample(&samples, "baton_heartbeat_round_trip_seconds", &[("worker", addr)]);
            // The head into worker 0, worker 0 into worker 1 (the proxy), worker 1 back
            // to the head; the head's heartbeat to each worker.
            let figures = [
                link("head"),
                link("0"),
                link("1"),
                heartbeat(&w0.addr),
                heartbeat(&w1.addr),
            ];
            if let [Some(head), Some(hop), Some(back), Some(beat0), Some(beat1)] = figures {
                let small = [head, back, beat0, beat1].iter().all(|&s| s < 0.015);
                if small && hop >= delayed && hop < delayed + 0.03 {
                    println!(
                        "{delay:?} each way: round trips head->w0 {head} s, w0->w1 {hop} s, w1->head {back} s; \
                         heartbeats {beat0} s, {beat1} s"
                    );
                    return;
                }
            }
            assert!(
                Instant::now() < deadline,
                "expected the proxied link at {delayed} s (+30 ms at most) and the others under 15 ms; \
                 [head, 0, 1, heartbeat w0, heartbeat w1] = {figures:?}\n{text}"
            );
            std::thread::sleep(Duration::from_millis(500));
        }
    };
    expect_hop(Duration::from_millis(50));
    // The ring link itself is not dialed again: the stage's probe measures the change.
    proxy.set_delay(Duration::from_millis(20));
    expect_hop(Duration::from_millis(20));
}

/// Generated tokens with the top two log-probabilities at each position.
struct Streamed {
    text: String,
    tokens: Vec<(String, f64, f64)>,
    /// Prompt tokens the server took from its cache.
    cached: u64,
}

fn stream_greedy(server: &Server, prompt: &str, n: usize) -> Streamed {
    let body = json!({
        "model": server.model_id(), "prompt": prompt, "max_tokens": n, "temperature": 0,
        "stream": true, "logprobs": 2, "stream_options": {"include_usage": true},
    });
    let events = server.stream("/v1/completions", &body);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"), "{events:?}");
    let mut out = Streamed {
        text: String::new(),
        tokens: Vec::new(),
        cached: 0,
    };
    for event in &events[..events.len() - 1] {
        let chunk: Value = serde_json::from_str(event).unwrap();
        if let Some(cached) = chunk["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64() {
            out.cached = cached;
        }
        let choice = &chunk["choices"][0];
        out.text.push_str(choice["text"].as_str().unwrap_or(""));
        let logprobs = &choice["logprobs"];
        if let Some(tokens) = logprobs["tokens"].as_array() {
            for (i, token) in tokens.iter().enumerate() {
                let mut top: Vec<f64> = logprobs["top_logprobs"][i]
                    .as_object()
                    .unwrap()
                    .values()
                    .map(|v| v.as_f64().unwrap())
                    .collect();
                top.sort_by(|a, b| b.total_cmp(a));
                out.tokens.push((
                    token.as_str().unwrap().to_string(),
                    top[0],
                    top.get(1).copied().unwrap_or(f64::MIN),
                ));
            }
        }
    }
    out
}

/// Regression: with weights repacked for the CPU (the default) a decode row beside 3 or
/// more others took ggml's 4-row gemm kernel, and 8 concurrent greedy requests answered
/// differently from each alone (the test ran with `--no-repack` and allowed near-ties).
#[test]
fn concurrent_streams_produce_exactly_what_they_produce_alone() {
    let _serial = lock();
    let server = Server::start(&["--parallel", "8", "-c", "4096"]);
    let prompts = [
        "The capital of France is",
        "def fibonacci(n):",
        "Once upon a time",
        "The three primary colors are",
        "import numpy as np\n",
        "Water boils at",
        "My favourite book is",
        "SELECT * FROM",
    ];
    const N: usize = 24;
    let alone: Vec<Streamed> = prompts.iter().map(|p| stream_greedy(&server, p, N)).collect();
    let steps_before = server.stats()["steps"].as_u64().unwrap();
    let together: Vec<Streamed> = std::thread::scope(|scope| {
        let handles: Vec<_> = prompts
            .iter()
            .map(|p| scope.spawn(|| stream_greedy(&server, p, N)))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let steps = server.stats()["steps"].as_u64().unwrap() - steps_before;
    println!("8 concurrent streams of {N} tokens took {steps} micro-batches");
    assert!(
        steps < 8 * N as u64,
        "concurrent sequences must share micro-batches ({steps} steps)"
    );
    for (i, (a, t)) in alone.iter().zip(&together).enumerate() {
        assert_eq!(a.text, t.text, "prompt {i}: text alone vs together");
        assert_eq!(
            a.tokens, t.tokens,
            "prompt {i}: tokens and log-probabilities alone vs together"
        );
    }
}

/// A second chat turn takes the first turn's whole prompt chunks from the cache and
/// computes the rest exactly as a fresh server would: the same answer as turn 2 sent
/// to a fresh server (regression: reusing every cached token made the answer depend on
/// what the server had run before).
#[test]
fn a_second_chat_turn_reuses_whole_chunks_and_answers_as_a_fresh_server_does() {
    let _serial = lock();
    const CHUNK: u64 = 16;
    let args = ["--chunk", "16"];
    let server = Server::start(&args);
    let model_id = server.model_id();
    let chat = |messages: &[Value]| {
        json!({"model": model_id, "messages": messages, "max_tokens": 12, "temperature": 0,
               "logprobs": true, "top_logprobs": 2})
    };
    let mut messages = vec![json!({"role": "user", "content": "Name a colour of the rainbow."})];
    let first = server.post("/v1/chat/completions", &chat(&messages));
    let reply = first["choices"][0]["message"]["content"].as_str().unwrap().to_string();
    let first_prompt = first["usage"]["prompt_tokens"].as_u64().unwrap();
    messages.push(json!({"role": "assistant", "content": reply}));
    messages.push(json!({"role": "user", "content": "And another one?"}));
    let computed_before = server.stats()["prompt_tokens_computed"].as_u64().unwrap();
    let second = server.post("/v1/chat/completions", &chat(&messages));
    let computed = server.stats()["prompt_tokens_computed"].as_u64().unwrap() - computed_before;
    let prompt = second["usage"]["prompt_tokens"].as_u64().unwrap();
    let cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    println!("turn 2: {prompt} prompt tokens, {cached} reused, {computed} computed (turn 1 had {first_prompt})");
    assert_eq!(cached % CHUNK, 0, "only whole chunks are reused");
    assert_eq!(
        cached,
        first_prompt / CHUNK * CHUNK,
        "every whole chunk of the first prompt is reused"
    );
    assert_eq!(computed, prompt - cached, "the rest is computed");
    drop(server);

    let fresh = Server::start(&args);
    let again = fresh.post("/v1/chat/completions", &chat(&messages));
    assert_eq!(again["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    assert_eq!(
        second["choices"][0], again["choices"][0],
        "turn 2 with turn 1 cached vs sent to a fresh server"
    );
}

#[test]
fn a_client_that_disconnects_frees_its_sequence_on_every_stage() {
    let _serial = lock();
    let server = Server::start(&[]);
    let body = json!({"model": server.model_id(), "prompt": "Write a long story about a dragon.",
                      "max_tokens": 400, "temperature": 0, "stream": true});
    let stream = server.send("POST", "/v1/completions", Some(&body.to_string()), Some(KEY));
    let mut reader = BufReader::new(stream);
    let mut seen = 0;
    let mut line = String::new();
    while seen < 5 && reader.read_line(&mut line).unwrap() > 0 {
        seen += usize::from(line.starts_with("data: "));
        line.clear();
    }
    assert_eq!(seen, 5);
    let busy = server.stats();
    assert_eq!(busy["active"], 1, "{busy}");
    assert!(
        busy["stages"]
            .as_array()
            .unwrap()
            .iter()
            .all(|s| s["kv_cells_used"].as_u64().unwrap() > 0),
        "{busy}"
    );
    drop(reader);

    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let stats = server.stats();
        let stages = stats["stages"].as_array().unwrap();
        if stats["requests_cancelled"] == 1 && stages.iter().all(|s| s["kv_cells_used"] == 0) {
            assert_eq!(stats["active"], 0);
            assert!(stats["completion_tokens"].as_u64().unwrap() < 400);
            break;
        }
        assert!(Instant::now() < deadline, "the sequence was not freed: {stats}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn bad_requests_get_openai_shaped_errors() {
    let _serial = lock();
    let server = Server::start(&["--parallel", "1", "--max-queue", "0", "-c", "512"]);
    let model = server.model_id();
    let cases: Vec<(&str, String, u16, &str)> = vec![
        ("/v1/chat/completions", "{not json".into(), 400, "malformed JSON"),
        (
            "/v1/chat/completions",
            json!({"model": model, "messages": "hi"}).to_string(),
            400,
            "invalid",
        ),
        (
            "/v1/chat/completions",
            json!({"model": model, "messages": []}).to_string(),
            400,
            "messages",
        ),
        (
            "/v1/chat/completions",
            json!({"model": model, "messages": [{"role": "user", "content": "x"}], "temperature": "hot"}).to_string(),
            400,
            "invalid type",
        ),
        (
            "/v1/chat/completions",
            json!({"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]}).to_string(),
            404,
            "gpt-4",
        ),
        (
            "/v1/chat/completions",
            json!({"model": model, "messages": [{"role": "user", "content": "x"}], "n": 3}).to_string(),
            400,
            "n = 1",
        ),
        (
            "/v1/completions",
            json!({"model": model, "prompt": "word ".repeat(600)}).to_string(),
            400,
            "context",
        ),
        (
            "/v1/completions",
            json!({"model": model, "prompt": [999999999]}).to_string(),
            400,
            "vocabulary",
        ),
        ("/v1/nothing", "{}".into(), 404, "Unknown request URL"),
    ];
    for (path, body, status, needle) in cases {
        let mut stream = server.send("POST", path, Some(&body), Some(KEY));
        let mut response = String::new();
        stream.read_to_string(&mut response).unwrap();
        let (got, text) = split_response(&response);
        assert_eq!(got, status, "{path} {body}: {text}");
        let error: Value = serde_json::from_str(&text).unwrap_or_else(|_| panic!("not JSON: {text}"));
        let message = error["error"]["message"].as_str().unwrap_or_default();
        assert!(message.contains(needle), "{body}: {message}");
        assert!(error["error"]["type"].is_string(), "{text}");
    }
    let (status, text) = server.request("GET", "/v1/models", None, Some("wrong"));
    assert_eq!(status, 401, "{text}");
    let (status, _) = server.request("GET", "/v1/models", None, None);
    assert_eq!(status, 401);

    // One slot, no queue: a second request while the first runs is refused, not queued.
    let long = json!({"model": model, "prompt": "Write a long story.", "max_tokens": 200, "stream": true});
    let mut first = BufReader::new(server.send("POST", "/v1/completions", Some(&long.to_string()), Some(KEY)));
    let mut line = String::new();
    while !line.starts_with("data: ") {
        line.clear();
        first.read_line(&mut line).unwrap();
    }
    let (status, text) = server.request(
        "POST",
        "/v1/completions",
        Some(&json!({"model": model, "prompt": "Hi", "max_tokens": 2})),
        Some(KEY),
    );
    assert_eq!(status, 503, "{text}");
    assert!(text.contains("overloaded"), "{text}");
    drop(first);

    let (status, text) = server.request("GET", "/health", None, Some(KEY));
    assert_eq!(status, 200, "{text}");
}

/// `context_length` of the served model in /v1/models.
fn served_context(server: &Server) -> u64 {
    let (status, text) = server.request("GET", "/v1/models", None, Some(KEY));
    assert_eq!(status, 200, "{text}");
    let models: Value = serde_json::from_str(&text).unwrap();
    models["data"][0]["context_length"].as_u64().unwrap()
}

/// Without --ctx-size, a sequence gets the model's trained context (qwen2.5-coder:
/// 32768) when the workers' memory holds it, and /v1/models says so; a request beyond
/// it is refused with the numbers. (q8_0 keys and values: 204 MiB of cache instead of
/// 384.)
#[test]
fn the_default_context_is_the_trained_one_when_memory_holds_it() {
    let _serial = lock();
    let server = Server::start_sized_by_baton(
        &["--local-workers", "2"],
        &["--parallel", "1", "--cache-type-k", "q8_0", "--cache-type-v", "q8_0"],
    );
    assert_eq!(served_context(&server), 32768);
    let body = json!({
        "model": server.model_id(),
        "prompt": "Hello",
        "max_tokens": 32768,
    });
    let (status, text) = server.request("POST", "/v1/completions", Some(&body), Some(KEY));
    assert_eq!(status, 400, "{text}");
    assert!(
        text.contains(
            "this model's context per sequence is 32768 tokens, but the request needs 1 prompt tokens plus 32768"
        ),
        "{text}"
    );
}

/// With less memory than the trained context needs, the default context is the most
/// that fits, a multiple of 256 per sequence: in-process stages offered the weights and
/// 100 MiB (--head-memory) hold 8533 cells of qwen2's 12 KiB each (f16), so each of
/// --parallel 2 sequences gets 4096.
#[test]
fn the_default_context_shrinks_to_the_memory_given() {
    use baton_model::{KvTypes, ModelFile};
    let _serial = lock();
    let file = ModelFile::open(&common::model(common::QWEN2)).unwrap();
    let cost = |n| {
        let cost = baton_cluster::model_cost(&file, n, 2, KvTypes::default());
        cost.stage_bytes(&(0..cost.layer_bytes.len()))
    };
    let memory = cost(0) + (100 << 20);
    let per_cell = cost(1) - cost(0);
    assert_eq!(
        per_cell,
        24 * 2 * 128 * 2,
        "qwen2: 24 layers, keys and values of 128 f16"
    );
    let server = Server::start_sized_by_baton(
        &["--stages", "1"],
        &["--parallel", "2", "--head-memory", &memory.to_string()],
    );
    assert_eq!((100 << 20) / per_cell, 8533);
    assert_eq!(served_context(&server), 4096);
}

/// On workers that offer little memory (--memory), the default context is the most
/// the planner finds room for: below the trained 32768, a multiple of 256, and every
/// stage's weights and cache within its worker's offer.
#[test]
fn the_default_context_on_workers_fits_their_memory() {
    use baton_model::{KvTypes, ModelFile};
    let _serial = lock();
    const TOKEN: &str = "test-context-fit-secret";
    let models = common::model(common::QWEN2).parent().unwrap().to_path_buf();
    let file = ModelFile::open(&common::model(common::QWEN2)).unwrap();
    let weights = {
        let cost = baton_cluster::model_cost(&file, 0, 1, KvTypes::default());
        cost.stage_bytes(&(0..cost.layer_bytes.len()))
    };
    // Each offers half the weights and 100 MiB: about 200 MiB of cache in all.
    let memory = (weights / 2 + (100 << 20)).to_string();
    let w0 = WorkerProc::start(&models, Some(TOKEN), &["--memory", &memory]);
    let w1 = WorkerProc::start(&models, Some(TOKEN), &["--memory", &memory]);
    let workers = format!("{},{}", w0.addr, w1.addr);
    let server = Server::start_sized_by_baton(
        &["--workers", &workers, "--token", TOKEN, "--no-head-stage"],
        &["--parallel", "1"],
    );
    let context = served_context(&server);
    println!("context on two workers of {memory} bytes: {context}");
    assert!(
        (256..32768).contains(&context) && context.is_multiple_of(256),
        "{context}"
    );
    // 12 KiB a cell: the cache takes most of the 200 MiB the weights leave.
    assert!(context * 12 * 1024 > 150 << 20, "{context}");
    let body = json!({"model": server.model_id(), "prompt": "def add(a, b):", "max_tokens": 4});
    let (status, text) = server.request("POST", "/v1/completions", Some(&body), Some(KEY));
    assert_eq!(status, 200, "{text}");
}
