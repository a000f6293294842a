//! Writes the binary seed inputs of the `frame`, `handshake` and `gguf` targets with the
//! real encoders, so that fuzzing starts from valid inputs of every shape:
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
    encode, Capabilities, Forward, HeldModel, LoadPlan, Message, ModelRef, Payload, RefusalCode, Role, SampledToken,
    TensorEntry, PROTOCOL_VERSION,
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
        stream: true,
        wire_f16: true,
        repack: false,
    };
    let forward = |payload| Forward {
        step: 42,
        payload,
        positions: vec![7, 8],
        seq_ids: vec![1, 1],
        sample_rows: vec![1],
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
            devices: vec!["CPU".into()],
            memory: 8 << 30,
            threads: 2,
            secs_per_layer: Some(0.0004),
            models: vec![HeldModel {
                file_name: model().file_name,
                identity: nonce(3),
                size: model().size,
                complete: true,
                content: Some(nonce(5)),
            }],
            ring_addr: "10.0.0.3:7301".into(),
        }),
        Message::LoadPlan(plan.clone()),
        Message::LoadPlan(LoadPlan {
            next: None,
            first: true,
            layer_start: 0,
            ..plan
        }),
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
        Message::StartSeq {
            seq: 1,
            keep: 0,
            params: SamplingParams::default(),
            history: vec![151644, 872],
            top_logprobs: 2,
            logprobs: true,
            drawn: 0,
            grammar: Some("root ::= [a-z]+".into()),
        },
        Message::TruncateSeq { seq: 1, len: 12 },
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
            message: "sequence 3 is not started".into(),
        },
        Message::Stats {
            resident: vec![250 << 20, 260 << 20],
            kv_used: vec![17, 17],
            busy_us: vec![1000, 2000],
            rows: vec![10, 10],
            link_sent: vec![0, 4096],
        },
        Message::Shutdown,
        Message::Ping { timeout_ms: 2000 },
        Message::Pong,
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
