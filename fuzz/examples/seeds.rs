//! Writes the binary seed inputs of the `frame`, `handshake`, `gguf` and `stage_plan`
//! targets with the real encoders, so that fuzzing starts from valid inputs of every
//! shape:
//!
//! ```text
//! cargo run --manifest-path fuzz/Cargo.toml --example seeds -- fuzz/seeds
//! ```
//!
//! The `http_body` seeds are JSON written by hand (from OpenAI's API reference).

use std::path::{Path, PathBuf};

use baton_gguf::{GgmlType, GgufWriter, Value};
use baton_proto::auth::proof;
use baton_proto::{
    encode, Capabilities, DeviceCaps, DeviceRange, Forward, HeldModel, LoadPlan, Message, ModelRef, Payload,
    RefusalCode, Role, SampledToken, StartSeq, Stats, TensorEntry, PROTOCOL_VERSION,
};
use baton_sample::SamplingParams;

fn main() -> std::io::Result<()> {
    let root = PathBuf::from(std::env::args().nth(1).unwrap_or_else(|| "fuzz/seeds".into()));
    for (name, message) in messages() {
        let mut frame = Vec::new();
        encode(&message, &mut frame);
        write(&root.join("frame"), &name, &frame)?;
    }
    for (name, bytes) in handshakes() {
        write(&root.join("handshake"), name, &bytes)?;
    }
    for (name, bytes) in ggufs() {
        write(&root.join("gguf"), name, &bytes)?;
    }
    for (name, bytes) in stage_plans() {
        write(&root.join("stage_plan"), &name, &bytes)?;
    }
    Ok(())
}

fn write(dir: &Path, name: &str, bytes: &[u8]) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    std::fs::write(dir.join(name), bytes)
}

fn nonce(seed: u8) -> [u8; 32] {
    std::array::from_fn(|i| seed.wrapping_mul(31).wrapping_add(i as u8 * 7))
}

fn model() -> ModelRef {
    ModelRef {
        file_name: "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf".into(),
        identity: nonce(3),
        size: 491_400_032,
    }
}

/// One or more messages of every kind, named `<kind>-<n>`.
fn messages() -> Vec<(String, Message)> {
    let plan = LoadPlan {
        model: model(),
        layer_start: 12,
        layer_end: 24,
        first: false,
        last: true,
        n_ctx: 4096,
        n_seq: 4,
        next: Some("10.0.0.2:7301".into()),
        next_session: 0x5eed,
        stream: true,
        wire_f16: true,
        repack: false,
        devices: vec![DeviceRange {
            device: "CPU".into(),
            layer_end: 24,
        }],
        tp: None,
        cache_type_k: "f16".into(),
        cache_type_v: "f16".into(),
    };
    let forward = |payload| Forward {
        step: 42,
        payload,
        positions: vec![7, 8],
        seq_ids: vec![1, 1],
        sample_rows: vec![1],
        row_tokens: vec![],
    };
    let messages = vec![
        Message::Hello {
            version: PROTOCOL_VERSION,
            role: Role::Head,
            nonce: nonce(1),
        },
        Message::Hello {
            version: PROTOCOL_VERSION,
            role: Role::Heartbeat,
            nonce: nonce(2),
        },
        Message::Auth { proof: nonce(4) },
        Message::Refused {
            code: RefusalCode::Auth,
            reason: "wrong token: the proof does not match this worker's --token".into(),
        },
        Message::Describe { model: model() },
        Message::Capabilities(Capabilities {
            devices: vec![DeviceCaps::cpu(8 << 30, Some(0.0004))],
            threads: 2,
            models: vec![HeldModel {
                file_name: model().file_name,
                identity: nonce(3),
                size: model().size,
                complete: true,
                content: Some(nonce(5)),
            }],
            ring_addr: "10.0.0.3:7301".into(),
            session: 0x5e55_1000,
        }),
        Message::LoadPlan(Box::new(plan.clone())),
        Message::LoadPlan(Box::new(LoadPlan {
            next: None,
            next_session: 0,
            first: true,
            layer_start: 0,
            cache_type_k: "q8_0".into(),
            cache_type_v: "q4_0".into(),
            ..plan.clone()
        })),
        Message::LoadPlan(Box::new(LoadPlan {
            tp: Some(baton_proto::TpPlace {
                group: 0x6e0_0001,
                rank: 1,
                members: vec!["10.0.0.2:7301".into(), "10.0.0.3:7301".into()],
            }),
            ..plan
        })),
        Message::StreamStart {
            header: b"GGUF\x03\x00\x00\x00".to_vec(),
            tensors: vec![TensorEntry {
                name: "blk.12.attn_q.weight".into(),
                offset: 1 << 20,
                len: 4096,
                sha256: nonce(6),
            }],
        },
        Message::TensorChunk {
            index: 0,
            offset: 0,
            data: vec![0xAB; 64],
        },
        Message::Loaded {
            resident: 250 << 20,
            received: 0,
        },
        StartSeq::new(1, SamplingParams::default(), vec![151644, 872])
            .with_logprobs(true, 2)
            .with_grammar(Some("root ::= [a-z]+".into()))
            .with_budget(Some(baton_sample::ReasoningBudget {
                tokens: 256,
                start: vec![151667],
                ends: vec![vec![151668]],
                forced: vec![151668],
                prefill: vec![151667, 198],
            }))
            .into(),
        StartSeq::new(2, SamplingParams::greedy(), vec![])
            .with_pooling(Some(baton_proto::Pooling::Mean))
            .into(),
        Message::TruncateSeq { seq: 1, len: 12 },
        Message::Checkpoint { seq: 1, len: 8 },
        Message::EndSeq { seq: 1 },
        Message::Forward(forward(Payload::Tokens(vec![151644, 872]))),
        Message::Forward(forward(Payload::Hidden(vec![0.5, -1.0, 2.0, 0.25]))),
        Message::Forward(forward(Payload::f16_rows(&[0.5, -1.0, 70000.0, 0.25], 2))),
        Message::Sampled {
            step: 42,
            tokens: vec![SampledToken {
                seq: 1,
                token: 9707,
                logprob: -0.25,
                top: vec![(9707, -0.25), (13, -1.5)],
            }],
        },
        Message::Done,
        Message::Error {
            first_layer: 1,
            fault: baton_proto::Fault::Protocol,
            message: "sequence 3 is not started".into(),
        },
        Message::Stats(Stats {
            resident: vec![250 << 20, 260 << 20],
            kv_used: vec![17, 17],
            busy_us: vec![1000, 2000],
            rows: vec![10, 10],
            link_sent: vec![0, 4096],
            link_rtt_us: vec![0, 250],
        }),
        Message::Shutdown,
        Message::Ping {
            timeout_ms: 2000,
            session: 0x5e55_1000,
        },
        Message::Pong,
        Message::Partial {
            sum: 3,
            values: vec![0.5, -1.0],
        },
        Message::JoinGroup { group: 0x6e0_0001, rank: 1 },
        Message::Probe { data: vec![0; 64] },
        Message::ForwardBest(forward(Payload::Hidden(vec![0.5, -1.0, 2.0, 0.25]))),
        Message::Share {
            step: 3,
            values: vec![2.5, 17.0, f32::NEG_INFINITY, -1.0],
        },
        Message::Pooled {
            step: 4,
            seq: 2,
            values: vec![0.6, -0.8, 0.0, 0.0],
        },
        Message::JoinRing { session: 0x5e55_1000 },
    ];
    let mut named: Vec<(String, Message)> = Vec::new();
    for message in messages {
        let n = named.iter().filter(|(_, m)| m.kind() == message.kind()).count();
        named.push((format!("{}-{n}", message.kind()), message));
    }
    named
}

/// Mode byte (see the target) then the peer's side of a valid exchange.
fn handshakes() -> Vec<(&'static str, Vec<u8>)> {
    const TOKEN: &[u8] = b"fuzz cluster token";
    let frames = |mode: u8, messages: &[Message]| {
        let mut bytes = vec![mode];
        messages.iter().for_each(|m| encode(m, &mut bytes));
        bytes
    };
    let hello = |role| Message::Hello {
        version: PROTOCOL_VERSION,
        role,
        nonce: nonce(9),
    };
    // The proof cannot match the handshake's fresh challenge, but it has the right shape.
    let auth = |role| Message::Auth {
        proof: proof(TOKEN, &nonce(1), &nonce(9), role),
    };
    let refused = Message::Refused {
        code: RefusalCode::Busy,
        reason: "another head is already connected to this worker".into(),
    };
    vec![
        ("server-head", frames(0, &[hello(Role::Head)])),
        ("server-ring", frames(0, &[hello(Role::Ring)])),
        ("server-token", frames(4, &[hello(Role::Head), auth(Role::Head)])),
        ("server-old-version", {
            let mut bytes = vec![0];
            encode(
                &Message::Hello {
                    version: PROTOCOL_VERSION - 1,
                    role: Role::Head,
                    nonce: nonce(9),
                },
                &mut bytes,
            );
            bytes
        }),
        ("client-head", frames(1, &[hello(Role::Worker)])),
        (
            "client-ring-token",
            frames(6, &[hello(Role::Worker), auth(Role::Worker)]),
        ),
        ("client-heartbeat", frames(3, &[hello(Role::Worker)])),
        ("client-refused", frames(5, &[hello(Role::Worker), refused.clone()])),
        ("client-refused-at-once", frames(1, &[refused])),
    ]
}

/// The tiny files the crate's tests write.
fn ggufs() -> Vec<(&'static str, Vec<u8>)> {
    let small = GgufWriter::new()
        .kv_str("general.architecture", "llama")
        .tensor_f32("x", &[8], &[0.5; 8]);
    let sample = GgufWriter::new()
        .kv_str("general.architecture", "llama")
        .kv_u32("llama.block_count", 2)
        .kv_f32("llama.attention.layer_norm_rms_epsilon", 1e-5)
        .kv_bool("general.flag", true)
        .kv("u8", Value::U8(7))
        .kv("i8", Value::I8(-7))
        .kv("u16", Value::U16(700))
        .kv("i16", Value::I16(-700))
        .kv("i32", Value::I32(-70_000))
        .kv("u64", Value::U64(1 << 40))
        .kv("i64", Value::I64(-(1 << 40)))
        .kv("f64", Value::F64(0.25))
        .kv("tokens", vec!["a", "bc", ""])
        .kv("heads", vec![4i32, 8])
        .kv("nested", vec![vec![1u8, 2], vec![]])
        .kv("empty", Value::Array(vec![]))
        .tensor_f32("output_norm.weight", &[4, 2], &[0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0])
        .tensor_raw("blk.0.attn_q.weight", &[32, 2], GgmlType::Q4_0, vec![0xAB; 36]);
    let aligned = GgufWriter::new()
        .kv_u32("general.alignment", 64)
        .kv("tokenizer.ggml.scores", vec![0.0f32, -1.5, f32::NAN])
        .tensor_raw("token_embd.weight", &[256, 1], GgmlType::Q4K, vec![0x11; 144])
        .tensor_f32("output_norm.weight", &[2], &[1.0, 1.0]);
    vec![
        ("small", small.to_bytes()),
        ("sample", sample.to_bytes()),
        ("aligned", aligned.to_bytes()),
        ("empty", GgufWriter::new().to_bytes()),
    ]
}

/// A tiny model of `arch` (every key and tensor its loader reads, zero weights):
/// `n_layer` layers of width 16, 2 heads of 8, 1 KV head, vocabulary 32.
fn tiny_model(arch: &str, n_layer: u32) -> Vec<u8> {
    let key = |k: &str| format!("{arch}.{k}");
    let (embd, ff, vocab, head_dim, heads, kv_heads) = (16u64, 32u64, 32u64, 8u64, 2u64, 1u64);
    let mut w = GgufWriter::new()
        .kv_str("general.architecture", arch)
        .kv_u32(key("block_count"), n_layer)
        .kv_u32(key("embedding_length"), embd as u32)
        .kv_u32(key("feed_forward_length"), ff as u32)
        .kv_u32(key("attention.head_count"), heads as u32)
        .kv_u32(key("attention.head_count_kv"), kv_heads as u32)
        .kv_u32(key("attention.key_length"), head_dim as u32)
        .kv_u32(key("attention.value_length"), head_dim as u32)
        .kv_u32(key("context_length"), 256)
        .kv_f32(key("attention.layer_norm_rms_epsilon"), 1e-6)
        .kv_f32(key("rope.freq_base"), 10000.0);
    if arch == "gemma3" {
        w = w
            .kv_u32("gemma3.attention.sliding_window", 2)
            .kv_u32("gemma3.attention.sliding_window_pattern", 2);
    }
    let t = |w: GgufWriter, name: &str, dims: &[u64]| {
        let n: u64 = dims.iter().product();
        w.tensor_f32(name, dims, &vec![0.0; n as usize])
    };
    w = t(w, "token_embd.weight", &[embd, vocab]);
    w = t(w, "output_norm.weight", &[embd]);
    if arch == "llama" {
        w = t(w, "output.weight", &[embd, vocab]);
    }
    let (q, kv) = (heads * head_dim, kv_heads * head_dim);
    for layer in 0..n_layer {
        let b = |n: &str| format!("blk.{layer}.{n}");
        w = t(w, &b("attn_norm.weight"), &[embd]);
        w = t(w, &b("attn_q.weight"), &[embd, q]);
        w = t(w, &b("attn_k.weight"), &[embd, kv]);
        w = t(w, &b("attn_v.weight"), &[embd, kv]);
        w = t(w, &b("attn_output.weight"), &[q, embd]);
        w = t(w, &b("ffn_norm.weight"), &[embd]);
        w = t(w, &b("ffn_gate.weight"), &[embd, ff]);
        w = t(w, &b("ffn_up.weight"), &[embd, ff]);
        w = t(w, &b("ffn_down.weight"), &[ff, embd]);
        match arch {
            "qwen2" => {
                w = t(w, &b("attn_q.bias"), &[q]);
                w = t(w, &b("attn_k.bias"), &[kv]);
                w = t(w, &b("attn_v.bias"), &[kv]);
            }
            "qwen3" | "gemma3" => {
                w = t(w, &b("attn_q_norm.weight"), &[head_dim]);
                w = t(w, &b("attn_k_norm.weight"), &[head_dim]);
                if arch == "gemma3" {
                    w = t(w, &b("post_attention_norm.weight"), &[embd]);
                    w = t(w, &b("post_ffw_norm.weight"), &[embd]);
                }
            }
            _ => {}
        }
    }
    w.to_bytes()
}

/// `stage_plan` inputs: 8 bytes of cluster (node count and context size, then each
/// node's memory and speed), then a tiny model of each architecture.
fn stage_plans() -> Vec<(String, Vec<u8>)> {
    let clusters: [(&str, [u8; 8]); 3] = [
        ("one-node", [0x00, 0x1f, 0, 0, 0, 0, 0, 0]),
        ("three-nodes", [0x22, 0x14, 0x34, 0x54, 0, 0, 0, 0]),
        ("four-tight-nodes", [0x53, 0x01, 0x02, 0x01, 0x03, 0, 0, 0]),
    ];
    let mut seeds = Vec::new();
    for arch in ["llama", "qwen2", "qwen3", "gemma3"] {
        for (name, cluster) in clusters {
            let mut bytes = cluster.to_vec();
            bytes.extend(tiny_model(arch, 3));
            seeds.push((format!("{arch}-{name}"), bytes));
        }
    }
    seeds
}
