//! `POST /v1/embeddings` on real servers: the pooled vectors the ring computes are
//! libllama's own (`llama_get_embeddings_seq`, normalized as llama-server does) bit for
//! bit, on 1 and 2 in-process stages, on 2 workers over TCP and on local workers (Unix
//! sockets), for mean, cls and last pooling,
//! on the test model and a `baton synth` model; a batch gives each input the vector it
//! gets alone; inputs longer than a chunk are pooled across chunks; embeddings leave
//! chat text and the prefix cache as they were; and, where `bench/peer` has built it,
//! llama-server's `/v1/embeddings` gives the same vectors.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use baton_ggml::{FileType, LlamaContext, LlamaModel, LlamaPooling};
use serde_json::{json, Value};

use common::server::{lock, Server, KEY};
use common::synth::synthetic;
use common::worker::WorkerProc;
use common::{model, GEMMA3, PROMPTS, QWEN2};

/// Inputs of several lengths: 6 to about 90 tokens with the test model's tokenizer.
fn texts() -> Vec<String> {
    let mut texts: Vec<String> = PROMPTS.iter().map(|p| p.to_string()).collect();
    texts.push("fn main() { println!(\"hello\"); }".into());
    texts.push(PROMPTS.join(" ").repeat(2));
    texts
}

/// libllama's pooled vectors for `prompts`, each decoded alone in one micro-batch,
/// normalized as llama-server normalizes them (`common_embd_normalize(.., 2)`).
fn oracle(path: &Path, pooling: LlamaPooling, prompts: &[Vec<u32>]) -> Vec<Vec<f32>> {
    let model = LlamaModel::load_full(path, true).unwrap();
    let mut ctx = LlamaContext::for_embeddings(&model, 1024, 512, 1, pooling).unwrap();
    prompts
        .iter()
        .map(|p| llama_server_normalized(&ctx.embed(p).unwrap()))
        .collect()
}

/// llama.cpp's `common_embd_normalize(inp, out, n, 2)`, transcribed.
fn llama_server_normalized(values: &[f32]) -> Vec<f32> {
    let mut sum = 0.0f64;
    for &x in values {
        sum += f64::from(x * x);
    }
    let sum = sum.sqrt();
    let norm = if sum > 0.0 { (1.0 / sum) as f32 } else { 0.0 };
    values.iter().map(|&x| x * norm).collect()
}

/// The tokens the server makes of `text` (special tokens added and parsed).
fn tokenize(path: &Path, texts: &[String]) -> Vec<Vec<u32>> {
    let vocab = LlamaModel::load_vocab(path).unwrap();
    texts.iter().map(|t| vocab.tokenize(t, true, true).unwrap()).collect()
}

/// The vectors of one request's `data`, in order of `index`, decoding base64 ones.
fn vectors(answer: &Value) -> Vec<Vec<f32>> {
    let data = answer["data"].as_array().expect("data is a list");
    data.iter()
        .enumerate()
        .map(|(i, item)| {
            assert_eq!(item["index"], i, "{item}");
            assert_eq!(item["object"], "embedding");
            match &item["embedding"] {
                Value::Array(values) => values.iter().map(|v| v.as_f64().unwrap() as f32).collect(),
                Value::String(b64) => base64_f32(b64),
                other => panic!("an embedding of {other}"),
            }
        })
        .collect()
}

/// Little-endian f32 values from standard base64.
fn base64_f32(text: &str) -> Vec<f32> {
    const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut bits = 0u32;
    let mut n_bits = 0;
    let mut bytes = Vec::new();
    for c in text.bytes().filter(|&c| c != b'=') {
        let value = ALPHABET.iter().position(|&a| a == c).expect("a base64 character") as u32;
        bits = (bits << 6) | value;
        n_bits += 6;
        if n_bits >= 8 {
            n_bits -= 8;
            bytes.push((bits >> n_bits) as u8);
        }
    }
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(x, y)| f64::from(*x) * f64::from(*y)).sum();
    let norm = |v: &[f32]| v.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt();
    dot / (norm(a) * norm(b))
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

fn embed(server: &Server, input: Value) -> Value {
    server.post("/v1/embeddings", &json!({ "input": input, "model": server.model_id() }))
}

/// Asks `server` for every text alone and all of them in one batch, checks that the
/// batch gives each text its solo vector, the usage counts every token, and base64 is
/// the same bits; returns the solo vectors.
fn solo_and_batch(server: &Server, texts: &[String], prompts: &[Vec<u32>]) -> Vec<Vec<f32>> {
    let solo: Vec<Vec<f32>> = texts
        .iter()
        .map(|t| vectors(&embed(server, json!(t))).remove(0))
        .collect();
    let batch = embed(server, json!(texts));
    let n_tokens: usize = prompts.iter().map(Vec::len).sum();
    assert_eq!(batch["usage"]["prompt_tokens"], n_tokens, "{}", batch["usage"]);
    assert_eq!(
        vectors(&batch),
        solo,
        "a batch gives each input the vector it gets alone"
    );
    let as_tokens = embed(server, json!(prompts));
    assert_eq!(vectors(&as_tokens), solo, "token ids give the vectors their text gives");
    let b64 = server.post(
        "/v1/embeddings",
        &json!({ "input": texts, "encoding_format": "base64" }),
    );
    assert_eq!(vectors(&b64), solo, "base64 carries the same bits");
    solo
}

/// Baton's vectors against libllama's: bit-identical (each input here fits one chunk,
/// so every row is computed in the shape libllama computes it).
fn check_identical(label: &str, ours: &[Vec<f32>], reference: &[Vec<f32>]) {
    assert_eq!(ours.len(), reference.len());
    for (i, (a, b)) in ours.iter().zip(reference).enumerate() {
        assert_eq!(a.len(), b.len(), "{label}: input {i}'s width");
        eprintln!(
            "{label}: input {i}: cosine {:.9}, max difference {:e}",
            cosine(a, b),
            max_diff(a, b)
        );
        assert!(
            a == b,
            "{label}: input {i} differs from libllama's (max {:e})",
            max_diff(a, b)
        );
    }
}

#[test]
fn pooled_vectors_are_libllamas_on_one_and_two_stages_on_workers_and_in_tensor_parallel_groups() {
    let _serial = lock();
    let path = model(QWEN2);
    let texts = texts();
    let prompts = tokenize(&path, &texts);
    // Two workers over TCP, a stage each.
    const TOKEN: &str = "test-embeddings-secret";
    let models = path.parent().unwrap();
    let workers = [
        WorkerProc::start(models, Some(TOKEN), &[]),
        WorkerProc::start(models, Some(TOKEN), &[]),
    ];
    let addrs = format!("{},{}", workers[0].addr, workers[1].addr);
    let over_tcp = [
        "--workers",
        &addrs,
        "--token",
        TOKEN,
        "--no-head-stage",
        "--split",
        "12,12",
    ];
    // The same two workers as one tensor-parallel group: member 0 pools.
    let group_over_tcp = ["--workers", &addrs, "--token", TOKEN, "--tp", "2"];
    let setups: [(&[&str], &str, LlamaPooling); 7] = [
        (&["--stages", "1"], "mean", LlamaPooling::Mean),
        (&["--stages", "2"], "mean", LlamaPooling::Mean),
        (&over_tcp, "mean", LlamaPooling::Mean),
        (&over_tcp, "last", LlamaPooling::Last),
        (&["--local-workers", "2"], "cls", LlamaPooling::Cls),
        (&["--stages", "1", "--tp", "2"], "mean", LlamaPooling::Mean),
        (&group_over_tcp, "last", LlamaPooling::Last),
    ];
    for (cluster, pooling, oracle_pooling) in setups {
        let label = format!("{} {} {pooling}", cluster[0], cluster[1]);
        let server = Server::start_on(&path, cluster, &["--pooling", pooling, "--chunk", "512"]);
        let ours = solo_and_batch(&server, &texts, &prompts);
        drop(server);
        check_identical(&label, &ours, &oracle(&path, oracle_pooling, &prompts));
    }
}

/// Another architecture (gemma3: scaled embedding, its own norms) and a `baton synth`
/// model give libllama's vectors too.
#[test]
fn gemma3_and_a_synthetic_models_pooled_vectors_are_libllamas() {
    let _serial = lock();
    let texts = texts();
    for (label, path, cluster) in [
        (
            "synthetic qwen2 mean",
            synthetic("qwen2", FileType::Q4KM),
            ["--local-workers", "2"],
        ),
        ("gemma3 mean", model(GEMMA3), ["--stages", "2"]),
    ] {
        let prompts = tokenize(&path, &texts);
        let server = Server::start_on(&path, &cluster, &["--pooling", "mean", "--chunk", "512"]);
        let ours = solo_and_batch(&server, &texts, &prompts);
        drop(server);
        check_identical(label, &ours, &oracle(&path, LlamaPooling::Mean, &prompts));
    }
}

/// Inputs longer than a chunk are prefilled in chunks and pooled over all of them.
/// libllama pools within one micro-batch only, so its reference here is its rows after
/// the output norm (no pooling) fed in the same chunks, pooled as it pools: the first
/// row, the last, or the mean by the product its mean pooling computes
/// (`baton_model::mean_rows`, equal to libllama's own above). Against libllama's
/// unchunked vectors (other shapes, other kernels) the cosines are printed.
#[test]
fn inputs_longer_than_a_chunk_are_pooled_across_their_chunks() {
    let _serial = lock();
    let path = model(QWEN2);
    let texts = texts();
    let prompts = tokenize(&path, &texts);
    let chunk = 16;
    assert!(prompts.iter().any(|p| p.len() > 4 * chunk) && prompts.iter().any(|p| p.len() <= chunk));
    let llama = LlamaModel::load_full(&path, true).unwrap();
    let mut rows_ctx = LlamaContext::for_embeddings(&llama, 1024, chunk as u32, 1, LlamaPooling::None).unwrap();
    let rows: Vec<Vec<f32>> = prompts
        .iter()
        .map(|p| rows_ctx.embed_rows(&p.chunks(chunk).collect::<Vec<_>>()).unwrap())
        .collect();
    drop(rows_ctx);
    let n_embd = 896;
    let pooled = |pooling: &str, rows: &[f32]| -> Vec<f32> {
        let vector = match pooling {
            "mean" => baton_model::mean_rows(rows, n_embd, 1).unwrap(),
            "cls" => rows[..n_embd].to_vec(),
            _ => rows[rows.len() - n_embd..].to_vec(),
        };
        llama_server_normalized(&vector)
    };
    for (pooling, oracle_pooling) in [
        ("mean", LlamaPooling::Mean),
        ("cls", LlamaPooling::Cls),
        ("last", LlamaPooling::Last),
    ] {
        let server = Server::start_on(&path, &["--stages", "2"], &["--pooling", pooling, "--chunk", "16"]);
        let ours = vectors(&embed(&server, json!(texts)));
        drop(server);
        let unchunked = oracle(&path, oracle_pooling, &prompts);
        for (i, (a, b)) in ours.iter().zip(&unchunked).enumerate() {
            let (cos, diff) = (cosine(a, b), max_diff(a, b));
            eprintln!(
                "{pooling}, chunks of {chunk}: input {i} ({} tokens) against libllama unchunked: cosine {cos:.9}, \
                 max difference {diff:e}",
                prompts[i].len()
            );
            assert!(cos >= 0.999, "{pooling}: input {i}: cosine {cos}");
            let same_chunks = pooled(pooling, &rows[i]);
            assert!(
                *a == same_chunks,
                "{pooling}: input {i} differs from libllama's rows in the same chunks (max {:e})",
                max_diff(a, &same_chunks)
            );
        }
    }
}

/// A greedy completion's text is the same alone, beside a stream of embedding batches,
/// and after them; an embedding of the very same prompt leaves nothing in the prefix
/// cache (the completion after it reuses no tokens, the one after that does).
#[test]
fn embeddings_leave_chat_text_and_the_prefix_cache_alone() {
    let _serial = lock();
    let prompt = PROMPTS[2];
    let completion = json!({ "prompt": prompt, "max_tokens": 24, "temperature": 0, "seed": 1 });
    let text = |answer: &Value| answer["choices"][0]["text"].as_str().unwrap().to_string();
    let cached = |answer: &Value| {
        answer["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or(0)
    };

    // One slot: the embedding and the completions share it.
    let server = Server::start_on(
        &model(QWEN2),
        &["--local-workers", "2"],
        &["--pooling", "mean", "--parallel", "1", "--chunk", "8"],
    );
    embed(&server, json!(prompt));
    let after_embedding = server.post("/v1/completions", &completion);
    assert_eq!(
        cached(&after_embedding),
        0,
        "the embedding's prompt was kept as a prefix"
    );
    let again = server.post("/v1/completions", &completion);
    assert!(
        cached(&again) > 0,
        "a completion's prompt is kept (the check above can fail)"
    );
    assert_eq!(text(&again), text(&after_embedding));
    drop(server);

    let server = Server::start_on(
        &model(QWEN2),
        &["--local-workers", "2"],
        &["--pooling", "last", "--parallel", "4", "--chunk", "8"],
    );
    let alone = text(&server.post("/v1/completions", &completion));
    let done = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|scope| {
        let embedder = scope.spawn(|| {
            let mut batches = 0;
            while !done.load(std::sync::atomic::Ordering::Relaxed) || batches == 0 {
                embed(&server, json!([prompt, PROMPTS[0], PROMPTS[1], prompt]));
                batches += 1;
            }
            batches
        });
        for _ in 0..2 {
            let beside = server.post("/v1/completions", &completion);
            assert_eq!(text(&beside), alone, "a completion beside embeddings");
        }
        done.store(true, std::sync::atomic::Ordering::Relaxed);
        let batches = embedder.join().unwrap();
        eprintln!("{batches} embedding batches ran beside the completions");
    });
    assert_eq!(
        text(&server.post("/v1/completions", &completion)),
        alone,
        "a completion after embeddings"
    );
}

/// Requests `/v1/embeddings` refuses, each with a 400 naming the problem.
#[test]
fn embeddings_refusals_name_the_problem() {
    let _serial = lock();
    let refused = |server: &Server, body: Value| {
        let (status, text) = server.request("POST", "/v1/embeddings", Some(&body), Some(KEY));
        (status, serde_json::from_str::<Value>(&text).unwrap()["error"].clone())
    };
    // No pooling in the GGUF (Qwen2.5 names none) and none given.
    let server = Server::start_on(&model(QWEN2), &["--stages", "1"], &["-c", "256", "--parallel", "2"]);
    let (status, error) = refused(&server, json!({ "input": "hi" }));
    assert_eq!(status, 400, "{error}");
    assert_eq!(error["code"], "embeddings_unsupported");
    assert!(error["message"].as_str().unwrap().contains("--pooling"), "{error}");
    drop(server);

    let server = Server::start_on(
        &model(QWEN2),
        &["--stages", "1"],
        &["-c", "256", "--parallel", "2", "--pooling", "mean"],
    );
    let long = "word ".repeat(200);
    let (status, error) = refused(&server, json!({ "input": ["hi", long] }));
    assert_eq!(status, 400, "{error}");
    assert_eq!(error["code"], "context_length_exceeded");
    assert!(
        error["message"].as_str().unwrap().contains("128 tokens"),
        "names the limit: {error}"
    );
    for (body, param) in [
        (json!({ "input": [] }), "input"),
        (json!({ "input": "" }), "input"),
        (json!({ "input": [[]] }), "input"),
        (json!({ "input": [1, 999999999] }), "input"),
        (json!({ "input": "hi", "encoding_format": "hex" }), "encoding_format"),
        (json!({ "input": "hi", "dimensions": 12 }), "dimensions"),
    ] {
        let (status, error) = refused(&server, body.clone());
        assert_eq!(status, 400, "{body}: {error}");
        assert_eq!(error["param"], param, "{body}: {error}");
    }
    let (status, error) = refused(&server, json!({ "input": "hi", "model": "another" }));
    assert_eq!(status, 404, "{error}");
    assert_eq!(error["code"], "model_not_found");
    let (status, error) = refused(&server, json!({ "input": [1, "two"] }));
    assert_eq!(status, 400, "{error}");
    // The server still answers.
    assert_eq!(vectors(&embed(&server, json!("hi")))[0].len(), 896);
}

/// llama-server from bench/peer (`bench/peer/setup` builds it), if it is there.
fn llama_server() -> Option<PathBuf> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("bench/peer/build/bin/llama-server");
    path.exists().then_some(path)
}

/// A llama-server process, killed on drop.
struct LlamaServer(Child, String);

impl LlamaServer {
    fn start(binary: &Path, model: &Path, pooling: &str) -> LlamaServer {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let child = Command::new(binary)
            .args([
                "--embeddings",
                "--pooling",
                pooling,
                "-c",
                "2048",
                "-np",
                "1",
                "-t",
                "1",
                "--port",
            ])
            .arg(port.to_string())
            .arg("-m")
            .arg(model)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("llama-server starts");
        let server = LlamaServer(child, format!("127.0.0.1:{port}"));
        let started = Instant::now();
        while started.elapsed() < Duration::from_secs(120) {
            if server.get("/health").0 == 200 {
                return server;
            }
            std::thread::sleep(Duration::from_millis(300));
        }
        panic!("llama-server did not come up");
    }

    fn get(&self, path: &str) -> (u16, String) {
        self.request("GET", path, "")
    }

    fn request(&self, method: &str, path: &str, body: &str) -> (u16, String) {
        use std::io::{Read, Write};
        let Ok(mut stream) = std::net::TcpStream::connect(&self.1) else {
            return (0, String::new());
        };
        let _ = write!(
            stream,
            "{method} {path} HTTP/1.0\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        );
        let mut response = String::new();
        let _ = stream.read_to_string(&mut response);
        common::server::split_response(&response)
    }

    fn embed(&self, text: &str) -> Vec<f32> {
        let (status, body) = self.request("POST", "/v1/embeddings", &json!({ "input": text }).to_string());
        assert_eq!(status, 200, "{body}");
        vectors(&serde_json::from_str(&body).unwrap()).remove(0)
    }
}

impl Drop for LlamaServer {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The same model and pooling through llama-server's `/v1/embeddings`, one input per
/// request (llama-server pools a batch of inputs sharing a micro-batch differently
/// from each alone: bench/results/2026-11-27-embeddings.md): the same bits.
#[test]
fn vectors_equal_llama_servers() {
    let Some(binary) = llama_server() else {
        eprintln!("skipped: bench/peer/build/bin/llama-server is not built (bench/peer/setup builds it)");
        return;
    };
    let _serial = lock();
    let path = model(QWEN2);
    let texts = texts();
    for pooling in ["mean", "last"] {
        let server = Server::start_on(
            &path,
            &["--local-workers", "2"],
            &["--pooling", pooling, "--chunk", "512"],
        );
        let ours: Vec<Vec<f32>> = texts
            .iter()
            .map(|t| vectors(&embed(&server, json!(t))).remove(0))
            .collect();
        drop(server);
        let peer = LlamaServer::start(&binary, &path, pooling);
        for (i, (text, a)) in texts.iter().zip(&ours).enumerate() {
            let b = peer.embed(text);
            let (cos, diff) = (cosine(a, &b), max_diff(a, &b));
            eprintln!("llama-server {pooling}: input {i}: cosine {cos:.9}, max difference {diff:e}");
            assert!(cos >= 0.9999, "{pooling}: input {i}: cosine {cos}");
            assert!(
                *a == b,
                "{pooling}: input {i} differs from llama-server's (max {diff:e})"
            );
        }
    }
}
