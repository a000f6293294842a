//! Round trips of every message, and hostile input: each must give its error, none may
//! panic.

use baton_sample::SamplingParams;
use rand::rngs::StdRng;
use rand::{Rng, RngCore, SeedableRng};

use super::*;
use crate::{
    Capabilities, DeviceCaps, DeviceRange, Forward, HeldModel, LoadPlan, Message, ModelRef, Payload, SampledToken,
    StartSeq, Stats, TensorEntry,
};

fn model_ref() -> ModelRef {
    ModelRef {
        file_name: "Qwen3-0.6B-Q8_0.gguf".into(),
        identity: nonce(3),
        size: 639_447_552,
    }
}

fn nonce(seed: u8) -> [u8; 32] {
    std::array::from_fn(|i| seed.wrapping_mul(31).wrapping_add(i as u8 * 7))
}

fn params() -> SamplingParams {
    SamplingParams {
        temperature: 0.7,
        top_k: -1,
        top_p: 0.9,
        min_p: 0.0,
        repeat_penalty: 1.1,
        repeat_last_n: 256,
        frequency_penalty: -0.5,
        presence_penalty: 0.25,
        seed: u64::MAX - 5,
    }
}

fn forward(payload: Payload, rows: usize) -> Forward {
    Forward {
        step: 1 << 40,
        payload,
        positions: (0..rows as i32).map(|p| p + 17).collect(),
        seq_ids: (0..rows as u32).map(|r| r % 2 + 4).collect(),
        sample_rows: vec![rows as u32 - 1],
        row_tokens: vec![],
    }
}

/// At least one sample of every variant, with values that would show a swapped or
/// truncated field (extremes, non-ASCII text, empty and non-empty collections, NaN).
pub(crate) fn samples() -> Vec<Message> {
    let held = |name: &str, complete: bool| HeldModel {
        file_name: name.into(),
        identity: nonce(9),
        size: 12,
        complete,
        content: complete.then(|| nonce(3)),
    };
    let plan = LoadPlan {
        model: model_ref(),
        layer_start: 7,
        layer_end: 28,
        first: false,
        last: true,
        n_ctx: 4096,
        n_seq: 8,
        next: None,
        next_session: 0,
        stream: true,
        wire_f16: false,
        repack: true,
        devices: vec![
            DeviceRange {
                device: "CUDA0".into(),
                layer_end: 20,
            },
            DeviceRange {
                device: "CPU".into(),
                layer_end: 28,
            },
        ],
        tp: None,
        cache_type_k: "q8_0".into(),
        cache_type_v: "f16".into(),
    };
    let tensor = |name: &str, offset| TensorEntry {
        name: name.into(),
        offset,
        len: 4096,
        sha256: nonce(5),
    };
    vec![
        Message::Hello {
            version: crate::PROTOCOL_VERSION,
            role: crate::Role::Head,
            nonce: nonce(1),
        },
        Message::Hello {
            version: u32::MAX,
            role: crate::Role::Worker,
            nonce: nonce(2),
        },
        Message::Hello {
            version: 0,
            role: crate::Role::Ring,
            nonce: [0; 32],
        },
        Message::Hello {
            version: 3,
            role: crate::Role::Heartbeat,
            nonce: nonce(3),
        },
        Message::Hello {
            version: 9,
            role: crate::Role::Member,
            nonce: nonce(4),
        },
        Message::Auth { proof: nonce(4) },
        Message::Refused {
            code: crate::RefusalCode::Auth,
            reason: "wrong token — ünïcode ✓".into(),
        },
        Message::Refused {
            code: crate::RefusalCode::LoadFailed,
            reason: String::new(),
        },
        Message::Describe { model: model_ref() },
        Message::Capabilities(Capabilities {
            devices: vec![
                DeviceCaps {
                    name: "CUDA0".into(),
                    memory: 24 << 30,
                    secs_per_layer: Some(0.000_02),
                },
                DeviceCaps {
                    name: "CPU".into(),
                    memory: 64 << 30,
                    secs_per_layer: Some(0.000_25),
                },
            ],
            threads: 16,
            models: vec![held("a.gguf", true), held("b.gguf", false)],
            ring_addr: "10.0.0.2:7311".into(),
            session: u64::MAX,
        }),
        Message::Capabilities(Capabilities {
            devices: vec![DeviceCaps {
                name: "CPU".into(),
                memory: 0,
                secs_per_layer: None,
            }],
            threads: 1,
            models: vec![],
            ring_addr: "[::1]:0".into(),
            session: 0,
        }),
        Message::LoadPlan(Box::new(plan.clone())),
        Message::LoadPlan(Box::new(LoadPlan {
            next: Some("10.0.0.3:7311".into()),
            next_session: 7,
            first: true,
            last: false,
            tp: Some(crate::TpPlace {
                group: u64::MAX - 3,
                rank: 2,
                members: vec!["10.0.0.3:7311".into(), "unix:/tmp/w1.sock".into(), "[::1]:7".into()],
            }),
            ..plan
        })),
        Message::StreamStart {
            header: b"GGUF\x03\0\0\0".to_vec(),
            tensors: vec![tensor("blk.0.attn_q.weight", 1 << 33), tensor("", 0)],
        },
        Message::StreamStart {
            header: vec![],
            tensors: vec![],
        },
        Message::TensorChunk {
            index: 3,
            offset: u64::MAX - 1,
            data: (0..=255).collect(),
        },
        Message::Loaded {
            resident: 1 << 31,
            received: 5,
        },
        Message::StartSeq(StartSeq {
            seq: 9,
            keep: 7,
            top_logprobs: 5,
            params: params(),
            history: vec![1, 2, u32::MAX],
            logprobs: true,
            drawn: 17,
            grammar: Some("root ::= \"a\"".into()),
            pooling: None,
            budget: Some(Box::new(baton_sample::ReasoningBudget {
                tokens: 1024,
                start: vec![151_667],
                ends: vec![vec![151_668], vec![522, 26865, 29]],
                forced: vec![198, 151_668],
                prefill: vec![151_667, 198],
            })),
        }),
        Message::StartSeq(StartSeq {
            seq: 0,
            keep: 0,
            top_logprobs: 0,
            params: SamplingParams::greedy(),
            history: vec![],
            logprobs: false,
            drawn: 0,
            grammar: None,
            pooling: Some(crate::Pooling::Last),
            budget: None,
        }),
        Message::TruncateSeq { seq: 9, len: 100 },
        Message::EndSeq { seq: u32::MAX },
        Message::Forward(forward(Payload::Tokens(vec![151_643, 0, 42]), 3)),
        Message::Forward(forward(
            Payload::Hidden(vec![1.5, -0.0, f32::MAX, f32::MIN_POSITIVE, 3.0, -2.25, 1e-30, 7.0]),
            2,
        )),
        Message::Forward(forward(Payload::Hidden(vec![f32::INFINITY; 1024]), 1)),
        // A token and two drafted tokens of one sequence, every row sampled.
        Message::Forward(Forward {
            seq_ids: vec![3, 3, 3],
            sample_rows: vec![0, 1, 2],
            row_tokens: vec![7, 151_642, 0],
            ..forward(Payload::Tokens(vec![7, 151_642, 0]), 3)
        }),
        Message::Forward(forward(
            Payload::HiddenF16 {
                values: vec![0x3c00, 0x8000, 0x7bff],
                row_exps: vec![3],
            },
            1,
        )),
        Message::Sampled {
            step: 77,
            tokens: vec![
                SampledToken {
                    seq: 1,
                    token: 2,
                    logprob: f32::NAN,
                    top: vec![],
                },
                SampledToken {
                    seq: 3,
                    token: 4,
                    logprob: -0.125,
                    top: vec![(4, -0.125), (u32::MAX, -7.5)],
                },
            ],
        },
        Message::Sampled {
            step: 0,
            tokens: vec![],
        },
        Message::Done,
        Message::Error {
            first_layer: 2,
            fault: crate::Fault::Compute,
            message: "stage 2: out of memory".into(),
        },
        Message::Error {
            first_layer: 0,
            fault: crate::Fault::CacheFull,
            message: String::new(),
        },
        Message::Stats(Stats {
            resident: vec![1, u64::MAX, 0],
            kv_used: vec![0, 4096, u32::MAX],
            busy_us: vec![5, 0, u64::MAX],
            rows: vec![7, 8, 9],
            link_sent: vec![0, 1 << 40, 3],
            link_rtt_us: vec![0, 1_500, u64::MAX],
        }),
        Message::Shutdown,
        Message::Ping {
            timeout_ms: 2000,
            session: 1 << 63,
        },
        Message::Pong,
        Message::Partial {
            sum: 47,
            values: vec![1.5, -0.0, f32::INFINITY, 1e-30],
        },
        Message::Partial {
            sum: u64::MAX,
            values: vec![],
        },
        Message::JoinGroup {
            group: 0x0123_4567_89ab_cdef,
            rank: 3,
        },
        Message::Probe { data: vec![0xa5; 300] },
        Message::Probe { data: vec![] },
        Message::ForwardBest(forward(Payload::Hidden(vec![0.5, -1.0, 2.0, 3.0]), 2)),
        Message::Share {
            step: 7,
            values: vec![1.5, f32::NEG_INFINITY, -1.0],
        },
        Message::Checkpoint { seq: 3, len: 512 },
        Message::Pooled {
            step: 12,
            seq: 2,
            values: vec![0.5, -0.0, f32::INFINITY, 1e-30],
        },
        Message::FetchFrom {
            peer: "10.0.0.2:7070".into(),
            tensors: vec![0, 3, 4],
        },
        Message::FetchFrom {
            peer: String::new(),
            tensors: vec![],
        },
        Message::JoinRing {
            session: 0x1234_5678_9abc,
        },
    ]
}

fn payload_of(msg: &Message) -> (u16, Vec<u8>) {
    let mut payload = Vec::new();
    let kind = encode_payload(msg, &mut payload);
    (kind, payload)
}

/// Payload bytes built by hand, for layouts the encoder would never produce.
#[derive(Default)]
struct Bytes(Vec<u8>);

impl Bytes {
    fn u8(mut self, v: u8) -> Self {
        self.0.push(v);
        self
    }
    fn u32(mut self, v: u32) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn u64(mut self, v: u64) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn raw(mut self, v: &[u8]) -> Self {
        self.0.extend_from_slice(v);
        self
    }
}

fn invalid_reason(result: Result<Message, ProtoError>) -> String {
    match result {
        Err(ProtoError::Invalid { reason, .. }) => reason,
        other => panic!("expected Invalid, got {other:?}"),
    }
}

#[test]
fn every_sample_round_trips() {
    for msg in samples() {
        let (kind, payload) = payload_of(&msg);
        assert_eq!(kind_name(kind), Some(msg.kind()), "kind number of {msg:?}");
        let decoded = decode(kind, &payload).unwrap_or_else(|e| panic!("{msg:?}: {e}"));
        // Debug text, not ==, because NaN log-probabilities are not equal to themselves.
        assert_eq!(format!("{decoded:?}"), format!("{msg:?}"));
        assert_eq!(payload_of(&decoded), (kind, payload.clone()), "re-encoding {msg:?}");

        let mut frame = vec![0xaa]; // `encode` appends; what was there stays
        encode(&msg, &mut frame);
        let head: [u8; HEADER_LEN] = frame[1..1 + HEADER_LEN].try_into().unwrap();
        assert_eq!(parse_header(&head, DEFAULT_MAX_FRAME), Ok((kind, payload.len())));
        assert_eq!(frame[0], 0xaa);
        assert_eq!(&frame[1 + HEADER_LEN..], &payload[..]);
    }
}

#[test]
fn samples_cover_every_kind() {
    let mut kinds: Vec<u16> = samples().iter().map(|m| payload_of(m).0).collect();
    kinds.sort();
    kinds.dedup();
    assert_eq!(kinds, (1..=KIND_NAMES.len() as u16).collect::<Vec<_>>());
}

#[test]
fn truncation_at_every_byte_is_reported() {
    for msg in samples() {
        let (kind, payload) = payload_of(&msg);
        for cut in 0..payload.len() {
            match decode(kind, &payload[..cut]) {
                Err(ProtoError::Truncated { kind: name, .. }) => assert_eq!(name, msg.kind()),
                other => panic!("{msg:?} cut at {cut}: expected Truncated, got {other:?}"),
            }
        }
    }
}

#[test]
fn trailing_bytes_are_refused() {
    for msg in samples() {
        let (kind, mut payload) = payload_of(&msg);
        payload.extend_from_slice(&[0, 0, 0]);
        assert_eq!(
            decode(kind, &payload),
            Err(ProtoError::TrailingBytes {
                kind: msg.kind(),
                extra: 3
            })
        );
    }
}

#[test]
fn header_checks_length_flags_and_kind() {
    let head = |len: u32, kind: u16, flags: u16| {
        let mut h = [0; HEADER_LEN];
        h[..4].copy_from_slice(&len.to_le_bytes());
        h[4..6].copy_from_slice(&kind.to_le_bytes());
        h[6..].copy_from_slice(&flags.to_le_bytes());
        h
    };
    let err = parse_header(&head(u32::MAX, 13, 0), DEFAULT_MAX_FRAME).unwrap_err();
    assert_eq!(
        err,
        ProtoError::FrameTooLarge {
            len: u32::MAX as usize,
            max: DEFAULT_MAX_FRAME
        }
    );
    assert_eq!(
        err.to_string(),
        "frame of 4294967295 bytes exceeds the maximum of 67108864"
    );
    assert_eq!(
        parse_header(&head(1001, 13, 0), 1000),
        Err(ProtoError::FrameTooLarge { len: 1001, max: 1000 })
    );
    assert_eq!(parse_header(&head(1000, 13, 0), 1000), Ok((13, 1000)));

    let err = parse_header(&head(0, 999, 0), DEFAULT_MAX_FRAME).unwrap_err();
    assert_eq!(err.to_string(), "unknown message kind 999");
    assert_eq!(parse_header(&head(0, 0, 0), 100), Err(ProtoError::UnknownKind(0)));
    assert_eq!(parse_header(&head(0, 30, 0), 100), Err(ProtoError::UnknownKind(30)));
    assert_eq!(parse_header(&head(0, 15, 1), 100), Err(ProtoError::BadFlags(1)));
    assert_eq!(decode(999, &[]), Err(ProtoError::UnknownKind(999)));
}

#[test]
fn huge_counts_fail_before_allocating() {
    let max = u32::MAX;
    let cases: [(u16, Bytes, &str, &str); 7] = [
        (kind::STATS, Bytes::default().u32(max), "Stats", "resident"),
        (
            kind::STREAM_START,
            Bytes::default().u32(max).u8(0),
            "StreamStart",
            "header",
        ),
        (
            kind::STREAM_START,
            Bytes::default().u32(0).u32(max).raw(&[0; 40]),
            "StreamStart",
            "tensors",
        ),
        (
            kind::CAPABILITIES,
            Bytes::default().u32(max).raw(&[0; 12]),
            "Capabilities",
            "devices",
        ),
        (
            kind::SAMPLED,
            Bytes::default().u64(1).u32(max).raw(&[0; 11]),
            "Sampled",
            "tokens",
        ),
        (
            kind::FORWARD,
            Bytes::default().u64(1).u8(1).u32(max).raw(&[0; 8]),
            "Forward",
            "hidden",
        ),
        (
            kind::ERROR,
            Bytes::default().u32(0).raw(&[1, 0]).u32(10),
            "Error",
            "message",
        ),
    ];
    for (kind, bytes, name, what) in cases {
        assert_eq!(decode(kind, &bytes.0), Err(ProtoError::Truncated { kind: name, what }));
    }
    let positions = Bytes::default().u64(1).u8(0).u32(1).u32(5).u32(1);
    let err = decode(kind::FORWARD, &positions.0).unwrap_err();
    assert_eq!(err.to_string(), "message Forward is truncated while reading positions");
}

#[test]
fn strings_must_be_short_utf8() {
    let bad = Bytes::default().u32(2).raw(&[0xff, 0xfe]);
    let err = decode(kind::REFUSED, &bad.0).unwrap_err();
    assert_eq!(
        err,
        ProtoError::BadUtf8 {
            kind: "Refused",
            what: "reason"
        }
    );
    assert_eq!(err.to_string(), "message Refused: reason is not valid UTF-8");

    let long = "x".repeat(MAX_STRING + 1);
    let (kind, payload) = payload_of(&Message::Error {
        first_layer: 0,
        fault: crate::Fault::Request,
        message: long,
    });
    let too_long = ProtoError::TooLong {
        kind: "Error",
        what: "message",
        len: MAX_STRING + 1,
        max: MAX_STRING,
    };
    assert_eq!(decode(kind, &payload), Err(too_long));
    let (kind, payload) = payload_of(&Message::Refused {
        code: crate::RefusalCode::Busy,
        reason: "x".repeat(MAX_STRING),
    });
    assert!(decode(kind, &payload).is_ok(), "exactly the maximum is allowed");
}

#[test]
fn unknown_role_and_tags_are_refused() {
    let hello = Bytes::default().u32(1).u8(6).raw(&[0; 32]);
    assert_eq!(invalid_reason(decode(kind::HELLO, &hello.0)), "unknown role byte 6");

    let (kind, mut payload) = payload_of(&Message::StartSeq(StartSeq {
        seq: 1,
        keep: 0,
        top_logprobs: 0,
        params: params(),
        history: vec![],
        logprobs: true,
        drawn: 0,
        grammar: None,
        pooling: None,
        budget: None,
    }));
    // The logprobs byte, before the 4-byte `drawn`, the 1-byte absent `grammar`, the
    // 1-byte `pooling` and the 1-byte absent `budget`.
    let at = payload.len() - 8;
    payload[at] = 2;
    assert_eq!(
        invalid_reason(decode(kind, &payload)),
        "boolean byte 2 is neither 0 nor 1"
    );
    payload[at] = 1;
    let pooling = payload.len() - 2;
    payload[pooling] = 4;
    assert_eq!(invalid_reason(decode(kind, &payload)), "unknown pooling 4");
    payload[pooling] = 0;

    // A budget whose sequences are longer, or more, than a stage matches.
    let with_budget = |budget: baton_sample::ReasoningBudget| {
        payload_of(&Message::StartSeq(StartSeq {
            seq: 1,
            keep: 0,
            top_logprobs: 0,
            params: params(),
            history: vec![],
            logprobs: false,
            drawn: 0,
            grammar: None,
            pooling: None,
            budget: Some(Box::new(budget)),
        }))
    };
    let (kind, long) = with_budget(baton_sample::ReasoningBudget {
        forced: vec![7; baton_sample::MAX_BUDGET_SEQ + 1],
        ..Default::default()
    });
    assert_eq!(invalid_reason(decode(kind, &long)), "65 tokens, more than 64");
    let (kind, many) = with_budget(baton_sample::ReasoningBudget {
        ends: vec![vec![1]; baton_sample::MAX_BUDGET_ENDS + 1],
        ..Default::default()
    });
    assert_eq!(invalid_reason(decode(kind, &many)), "9 sequences, more than 8");

    // A pooled vector: empty, wider than any model, or with NaN.
    let pooled = |values: &[f32]| {
        payload_of(&Message::Pooled {
            step: 1,
            seq: 0,
            values: values.to_vec(),
        })
        .1
    };
    assert_eq!(
        invalid_reason(decode(kind::POOLED, &pooled(&[]))),
        format!("0 values, expected 1 to {}", crate::MAX_POOLED_WIDTH)
    );
    assert!(
        invalid_reason(decode(kind::POOLED, &pooled(&vec![0.5; crate::MAX_POOLED_WIDTH + 1])))
            .contains("expected 1 to")
    );
    assert!(decode(kind::POOLED, &pooled(&vec![0.5; crate::MAX_POOLED_WIDTH])).is_ok());
    assert_eq!(
        invalid_reason(decode(kind::POOLED, &pooled(&[1.0, f32::NAN]))),
        "a pooled vector contains NaN"
    );

    let forward = Bytes::default().u64(1).u8(3).u32(0);
    assert_eq!(
        invalid_reason(decode(kind::FORWARD, &forward.0)),
        "unknown payload tag 3"
    );

    // One device: an empty name, memory 1, then the option tag of its speed.
    let caps = Bytes::default().u32(1).u32(0).u64(1).u8(2);
    assert_eq!(
        invalid_reason(decode(kind::CAPABILITIES, &caps.0)),
        "option tag 2 is neither 0 nor 1"
    );
}

#[test]
fn inconsistent_forwards_are_refused() {
    let base = || forward(Payload::Tokens(vec![1, 2]), 2);
    let cases = [
        (
            Forward {
                positions: vec![],
                seq_ids: vec![],
                sample_rows: vec![],
                ..base()
            },
            "at least one row",
        ),
        (
            Forward {
                seq_ids: vec![0],
                ..base()
            },
            "2 positions but 1 sequence ids",
        ),
        (
            Forward {
                row_tokens: vec![5],
                ..base()
            },
            "1 row tokens for 2 rows",
        ),
        (
            Forward {
                payload: Payload::Tokens(vec![1, 2, 3]),
                ..base()
            },
            "3 tokens for 2 rows",
        ),
        (
            Forward {
                sample_rows: vec![0, 2],
                ..base()
            },
            "sample row 2 is out of range for 2 rows",
        ),
        (
            Forward {
                payload: Payload::Hidden(vec![0.0; 5]),
                ..base()
            },
            "5 hidden values do not divide into 2 rows",
        ),
        (
            Forward {
                payload: Payload::Hidden(vec![]),
                ..base()
            },
            "0 hidden values",
        ),
        (
            Forward {
                payload: Payload::HiddenF16 {
                    values: vec![0; 3],
                    row_exps: vec![0; 2],
                },
                ..base()
            },
            "3 hidden values",
        ),
        (
            Forward {
                payload: Payload::HiddenF16 {
                    values: vec![0; 4],
                    row_exps: vec![0],
                },
                ..base()
            },
            "1 row scales for 2 rows",
        ),
        (
            Forward {
                payload: Payload::HiddenF16 {
                    values: vec![0; 4],
                    row_exps: vec![0, 41],
                },
                ..base()
            },
            "row scale beyond",
        ),
        (
            Forward {
                payload: Payload::Hidden(vec![0.0, f32::NAN]),
                ..base()
            },
            "NaN",
        ),
        (
            Forward {
                payload: Payload::HiddenF16 {
                    values: vec![0, 0x7e00],
                    row_exps: vec![0, 0],
                },
                ..base()
            },
            "NaN",
        ),
    ];
    for (forward, expected) in cases {
        let (kind, payload) = payload_of(&Message::Forward(forward.clone()));
        let reason = invalid_reason(decode(kind, &payload));
        assert!(reason.contains(expected), "{forward:?}: {reason:?} lacks {expected:?}");
    }
    // f16 infinities are numbers, not NaN.
    let inf = Forward {
        payload: Payload::HiddenF16 {
            values: vec![0x7c00, 0xfc00],
            row_exps: vec![0, 0],
        },
        ..base()
    };
    let (kind, payload) = payload_of(&Message::Forward(inf));
    assert!(decode(kind, &payload).is_ok());
}

#[test]
fn invalid_values_are_refused() {
    let nan_temperature = SamplingParams {
        temperature: f32::NAN,
        ..params()
    };
    let msg = Message::StartSeq(StartSeq {
        seq: 1,
        keep: 0,
        top_logprobs: 0,
        params: nan_temperature,
        history: vec![],
        logprobs: false,
        drawn: 0,
        grammar: None,
        pooling: None,
        budget: None,
    });
    let (kind, payload) = payload_of(&msg);
    let err = decode(kind, &payload).unwrap_err();
    assert!(
        matches!(
            err,
            ProtoError::Invalid {
                kind: "StartSeq",
                what: "sampling parameters",
                ..
            }
        ),
        "{err:?}"
    );
    assert!(err.to_string().contains("temperature"), "{err}");

    let top_p = Message::StartSeq(StartSeq {
        seq: 1,
        keep: 0,
        top_logprobs: 0,
        params: SamplingParams { top_p: 0.0, ..params() },
        history: vec![],
        logprobs: false,
        drawn: 0,
        grammar: None,
        pooling: None,
        budget: None,
    });
    assert!(invalid_reason(decode(kind, &payload_of(&top_p).1)).contains("top_p"));

    for secs in [f32::NAN, -1.0, f32::INFINITY] {
        let caps = Capabilities {
            devices: vec![DeviceCaps {
                name: "CPU".into(),
                memory: 0,
                secs_per_layer: Some(secs),
            }],
            threads: 1,
            models: vec![],
            ring_addr: String::new(),
            session: 7,
        };
        let (kind, payload) = payload_of(&Message::Capabilities(caps));
        assert!(
            matches!(
                decode(kind, &payload),
                Err(ProtoError::Invalid {
                    what: "secs_per_layer",
                    ..
                })
            ),
            "{secs}"
        );
    }

    let overflow = TensorEntry {
        name: "t".into(),
        offset: u64::MAX,
        len: 1,
        sha256: [0; 32],
    };
    let (kind, payload) = payload_of(&Message::StreamStart {
        header: vec![],
        tensors: vec![overflow],
    });
    assert!(invalid_reason(decode(kind, &payload)).contains("overflows"));

    let plan = LoadPlan {
        model: model_ref(),
        layer_start: 5,
        layer_end: 4,
        first: true,
        last: true,
        n_ctx: 1,
        n_seq: 0,
        next: None,
        next_session: 0,
        stream: false,
        wire_f16: false,
        repack: false,
        devices: vec![],
        tp: None,
        cache_type_k: "f16".into(),
        cache_type_v: "f16".into(),
    };
    let (kind, payload) = payload_of(&Message::LoadPlan(Box::new(plan.clone())));
    assert_eq!(
        invalid_reason(decode(kind, &payload)),
        "layer_start 5 is after layer_end 4"
    );

    // Issue 15: the devices' ranges tile the stage, in order, none empty.
    let range = |device: &str, layer_end| DeviceRange {
        device: device.into(),
        layer_end,
    };
    let cases = [
        (vec![range("CPU", 2)], "device CPU ends at layer 2, outside 4..10"),
        (
            vec![range("CUDA0", 6), range("CPU", 6)],
            "device CPU ends at layer 6, outside 6..10",
        ),
        (vec![range("CUDA0", 11)], "device CUDA0 ends at layer 11, outside 4..10"),
        (
            vec![range("CUDA0", 6), range("CPU", 8)],
            "the devices' ranges end at 8, the stage at 10",
        ),
    ];
    for (devices, reason) in cases {
        let plan = LoadPlan {
            layer_start: 4,
            layer_end: 10,
            devices,
            ..plan.clone()
        };
        let (kind, payload) = payload_of(&Message::LoadPlan(Box::new(plan)));
        assert_eq!(invalid_reason(decode(kind, &payload)), reason);
    }
    let caps = Capabilities {
        devices: vec![],
        threads: 1,
        models: vec![],
        ring_addr: String::new(),
        session: 7,
    };
    let (kind, payload) = payload_of(&Message::Capabilities(caps));
    assert_eq!(
        invalid_reason(decode(kind, &payload)),
        "a worker offers at least one device"
    );
}

#[test]
fn random_payloads_never_panic() {
    let mut rng = StdRng::seed_from_u64(0xba70);
    let mut payload = Vec::new();
    for _ in 0..20_000 {
        let kind = rng.random_range(0..=KIND_NAMES.len() as u16 + 1);
        payload.resize(rng.random_range(0..96), 0);
        rng.fill_bytes(&mut payload);
        // Small counts now and then, so decoding gets past the first length field.
        if payload.len() >= 12 && rng.random_bool(0.5) {
            payload[8..12].copy_from_slice(&rng.random_range(0u32..4).to_le_bytes());
        }
        let _ = decode(kind, &payload);
    }
}

#[test]
fn mutated_samples_never_panic_and_stay_canonical() {
    // Flipping bytes of valid messages reaches the deeper checks that random bytes rarely
    // do. Whatever still decodes must encode to exactly the bytes it came from.
    let mut rng = StdRng::seed_from_u64(7);
    for msg in samples() {
        let (kind, payload) = payload_of(&msg);
        if payload.is_empty() {
            continue;
        }
        for _ in 0..500 {
            let mut mutated = payload.clone();
            for _ in 0..rng.random_range(1..4) {
                let at = rng.random_range(0..mutated.len());
                mutated[at] = rng.random();
            }
            if let Ok(decoded) = decode(kind, &mutated) {
                assert_eq!(payload_of(&decoded), (kind, mutated), "{decoded:?}");
            }
        }
    }
}

#[test]
fn f16_rows_keep_large_rows_finite_and_small_rows_exact_to_f16() {
    let small = [1.5f32, -0.25, 1000.0, 3.0e-3];
    let large = [98407.5f32, -1.0, 12.0, 40000.0];
    let hidden: Vec<f32> = small.iter().chain(&large).copied().collect();
    let payload = Payload::f16_rows(&hidden, 2);
    let Payload::HiddenF16 { row_exps, .. } = &payload else {
        panic!("f16 payload")
    };
    assert_eq!(row_exps, &vec![0, 2]);
    let back = payload.widen_f16().unwrap();
    for (x, y) in small.iter().zip(&back[..4]) {
        assert_eq!(half::f16::from_f32(*x).to_f32(), *y, "an unscaled row is plain f16");
    }
    for (x, y) in large.iter().zip(&back[4..]) {
        assert!(
            y.is_finite() && (x - y).abs() <= x.abs() / 1024.0,
            "{x} came back as {y}"
        );
    }
}

#[test]
fn refusals_carry_a_known_code_after_the_reason() {
    let (kind, payload) = payload_of(&Message::Refused {
        code: crate::RefusalCode::TlsRequired,
        reason: "tls".into(),
    });
    assert_eq!(payload, [3, 0, 0, 0, b't', b'l', b's', 4, 0]);
    let unknown = Bytes::default().u32(0).raw(&[99, 0]);
    assert_eq!(invalid_reason(decode(kind, &unknown.0)), "unknown refusal code 99");
    // A stage's failure says its kind; an unknown kind is refused.
    let unknown = Bytes::default().u32(0).raw(&[99, 0]).u32(0);
    assert_eq!(invalid_reason(decode(kind::ERROR, &unknown.0)), "unknown fault 99");
    for fault in crate::Fault::ALL {
        assert_eq!(crate::Fault::from_number(fault.number()), Some(fault));
    }
    // A refusal as versions 1 to 3 wrote it (no code) is short.
    let old = Bytes::default().u32(3).raw(b"old");
    assert_eq!(
        decode(kind, &old.0),
        Err(ProtoError::Truncated {
            kind: "Refused",
            what: "code"
        })
    );
}

#[test]
fn tp_places_outside_their_group_are_refused() {
    let place = |rank: u32, members: usize| LoadPlan {
        model: model_ref(),
        layer_start: 0,
        layer_end: 4,
        first: true,
        last: false,
        n_ctx: 64,
        n_seq: 0,
        next: None,
        next_session: 0,
        stream: false,
        wire_f16: false,
        repack: true,
        devices: vec![],
        tp: Some(crate::TpPlace {
            group: 7,
            rank,
            members: (0..members).map(|m| format!("w{m}:1")).collect(),
        }),
        cache_type_k: "f16".into(),
        cache_type_v: "f16".into(),
    };
    let reason = |plan: LoadPlan| {
        let (kind, payload) = payload_of(&Message::LoadPlan(Box::new(plan)));
        invalid_reason(decode(kind, &payload))
    };
    assert_eq!(reason(place(2, 2)), "rank 2 in a group of 2");
    assert_eq!(reason(place(0, 1)), "1 members; a group has 2 to 64");
    assert_eq!(reason(place(0, 65)), "65 members; a group has 2 to 64");
    let (kind, payload) = payload_of(&Message::LoadPlan(Box::new(place(1, 64))));
    assert!(decode(kind, &payload).is_ok(), "64 members are allowed");
}
