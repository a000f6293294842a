//! The wire layout of every message as data, checked against the codec and against the
//! tables in the module documentation: each sample message's encoding must be walked by
//! its layout to exactly its last byte, and the tables rendered from the layouts must be
//! the ones `codec.rs` documents (the failure prints the tables to paste).

use super::tests::samples;
use super::{encode_payload, KIND_NAMES};

/// A field's type on the wire, as the tables write it.
enum Ty {
    U8,
    U16,
    U32,
    U64,
    I32,
    F32,
    Bool,
    Role,
    /// 32 raw bytes.
    Raw32,
    Str,
    Bytes,
    Opt(&'static Ty),
    List(&'static Ty),
    Struct(&'static Layout),
    /// A `u8` tag, then the fields of the variant it names.
    Union(&'static [(u8, &'static str, &'static [Field])]),
}

/// A message or structure: its name and fields in order.
struct Layout {
    name: &'static str,
    fields: &'static [Field],
}

struct Field(&'static str, Ty);

const MODEL_REF: Layout = Layout {
    name: "ModelRef",
    fields: &[
        Field("file_name", Ty::Str),
        Field("identity", Ty::Raw32),
        Field("size", Ty::U64),
    ],
};
const HELD_MODEL: Layout = Layout {
    name: "HeldModel",
    fields: &[
        Field("file_name", Ty::Str),
        Field("identity", Ty::Raw32),
        Field("size", Ty::U64),
        Field("complete", Ty::Bool),
        Field("content", Ty::Opt(&Ty::Raw32)),
    ],
};
const DEVICE_CAPS: Layout = Layout {
    name: "DeviceCaps",
    fields: &[
        Field("name", Ty::Str),
        Field("memory", Ty::U64),
        Field("secs_per_layer", Ty::Opt(&Ty::F32)),
    ],
};
const DEVICE_RANGE: Layout = Layout {
    name: "DeviceRange",
    fields: &[Field("device", Ty::Str), Field("layer_end", Ty::U32)],
};
const TENSOR_ENTRY: Layout = Layout {
    name: "TensorEntry",
    fields: &[
        Field("name", Ty::Str),
        Field("offset", Ty::U64),
        Field("len", Ty::U64),
        Field("sha256", Ty::Raw32),
    ],
};
const REASONING_BUDGET: Layout = Layout {
    name: "ReasoningBudget",
    fields: &[
        Field("tokens", Ty::U32),
        Field("start", Ty::List(&Ty::U32)),
        Field("ends", Ty::List(&Ty::List(&Ty::U32))),
        Field("forced", Ty::List(&Ty::U32)),
        Field("prefill", Ty::List(&Ty::U32)),
    ],
};

const SAMPLING_PARAMS: Layout = Layout {
    name: "SamplingParams",
    fields: &[
        Field("temperature", Ty::F32),
        Field("top_k", Ty::I32),
        Field("top_p", Ty::F32),
        Field("min_p", Ty::F32),
        Field("repeat_penalty", Ty::F32),
        Field("repeat_last_n", Ty::U64),
        Field("frequency_penalty", Ty::F32),
        Field("presence_penalty", Ty::F32),
        Field("seed", Ty::U64),
    ],
};
const PAYLOAD: Layout = Layout {
    name: "Payload",
    fields: &[Field(
        "",
        Ty::Union(&[
            (0, "Tokens", &[Field("tokens", Ty::List(&Ty::U32))]),
            (1, "Hidden", &[Field("hidden", Ty::List(&Ty::F32))]),
            (
                2,
                "HiddenF16",
                &[
                    Field("values", Ty::List(&Ty::U16)),
                    Field("row_exps", Ty::List(&Ty::U8)),
                ],
            ),
        ]),
    )],
};
const SAMPLED_TOKEN: Layout = Layout {
    name: "SampledToken",
    fields: &[
        Field("seq", Ty::U32),
        Field("token", Ty::U32),
        Field("logprob", Ty::F32),
        Field("top", Ty::List(&Ty::Struct(&TOP_LOGPROB))),
    ],
};
const TP_PLACE: Layout = Layout {
    name: "TpPlace",
    fields: &[
        Field("group", Ty::U64),
        Field("rank", Ty::U32),
        Field("members", Ty::List(&Ty::Str)),
    ],
};
const TOP_LOGPROB: Layout = Layout {
    name: "TopLogprob",
    fields: &[Field("token", Ty::U32), Field("logprob", Ty::F32)],
};

/// Structures, in the order the second table lists them.
const STRUCTURES: [&Layout; 11] = [
    &MODEL_REF,
    &HELD_MODEL,
    &DEVICE_CAPS,
    &DEVICE_RANGE,
    &TENSOR_ENTRY,
    &SAMPLING_PARAMS,
    &REASONING_BUDGET,
    &PAYLOAD,
    &SAMPLED_TOKEN,
    &TOP_LOGPROB,
    &TP_PLACE,
];

/// Messages, in kind-number order.
const MESSAGES: [Layout; 29] = [
    Layout {
        name: "Hello",
        fields: &[
            Field("version", Ty::U32),
            Field("role", Ty::Role),
            Field("nonce", Ty::Raw32),
        ],
    },
    Layout {
        name: "Auth",
        fields: &[Field("proof", Ty::Raw32)],
    },
    Layout {
        name: "Refused",
        fields: &[Field("reason", Ty::Str), Field("code", Ty::U16)],
    },
    Layout {
        name: "Describe",
        fields: &[Field("model", Ty::Struct(&MODEL_REF))],
    },
    Layout {
        name: "Capabilities",
        fields: &[
            Field("devices", Ty::List(&Ty::Struct(&DEVICE_CAPS))),
            Field("threads", Ty::U32),
            Field("models", Ty::List(&Ty::Struct(&HELD_MODEL))),
            Field("ring_addr", Ty::Str),
            Field("session", Ty::U64),
        ],
    },
    Layout {
        name: "LoadPlan",
        fields: &[
            Field("model", Ty::Struct(&MODEL_REF)),
            Field("layer_start", Ty::U32),
            Field("layer_end", Ty::U32),
            Field("first", Ty::Bool),
            Field("last", Ty::Bool),
            Field("n_ctx", Ty::U32),
            Field("n_seq", Ty::U32),
            Field("next", Ty::Opt(&Ty::Str)),
            Field("next_session", Ty::U64),
            Field("stream", Ty::Bool),
            Field("wire_f16", Ty::Bool),
            Field("repack", Ty::Bool),
            Field("devices", Ty::List(&Ty::Struct(&DEVICE_RANGE))),
            Field("tp", Ty::Opt(&Ty::Struct(&TP_PLACE))),
            Field("cache_type_k", Ty::Str),
            Field("cache_type_v", Ty::Str),
        ],
    },
    Layout {
        name: "StreamStart",
        fields: &[
            Field("header", Ty::Bytes),
            Field("tensors", Ty::List(&Ty::Struct(&TENSOR_ENTRY))),
        ],
    },
    Layout {
        name: "TensorChunk",
        fields: &[
            Field("index", Ty::U32),
            Field("offset", Ty::U64),
            Field("data", Ty::Bytes),
        ],
    },
    Layout {
        name: "Loaded",
        fields: &[Field("resident", Ty::U64), Field("received", Ty::U64)],
    },
    Layout {
        name: "StartSeq",
        fields: &[
            Field("seq", Ty::U32),
            Field("keep", Ty::U32),
            Field("params", Ty::Struct(&SAMPLING_PARAMS)),
            Field("history", Ty::List(&Ty::U32)),
            Field("top_logprobs", Ty::U8),
            Field("logprobs", Ty::Bool),
            Field("drawn", Ty::U32),
            Field("grammar", Ty::Opt(&Ty::Str)),
            Field("pooling", Ty::U8),
            Field("budget", Ty::Opt(&Ty::Struct(&REASONING_BUDGET))),
        ],
    },
    Layout {
        name: "TruncateSeq",
        fields: &[Field("seq", Ty::U32), Field("len", Ty::U32)],
    },
    Layout {
        name: "EndSeq",
        fields: &[Field("seq", Ty::U32)],
    },
    Layout {
        name: "Forward",
        fields: FORWARD_FIELDS,
    },
    Layout {
        name: "Sampled",
        fields: &[
            Field("step", Ty::U64),
            Field("tokens", Ty::List(&Ty::Struct(&SAMPLED_TOKEN))),
        ],
    },
    Layout {
        name: "Done",
        fields: &[],
    },
    Layout {
        name: "Error",
        fields: &[
            Field("first_layer", Ty::U32),
            Field("fault", Ty::U16),
            Field("message", Ty::Str),
        ],
    },
    Layout {
        name: "Stats",
        fields: &[
            Field("resident", Ty::List(&Ty::U64)),
            Field("kv_used", Ty::List(&Ty::U32)),
            Field("busy_us", Ty::List(&Ty::U64)),
            Field("rows", Ty::List(&Ty::U64)),
            Field("link_sent", Ty::List(&Ty::U64)),
            Field("link_rtt_us", Ty::List(&Ty::U64)),
        ],
    },
    Layout {
        name: "Shutdown",
        fields: &[],
    },
    Layout {
        name: "Ping",
        fields: &[Field("timeout_ms", Ty::U32), Field("session", Ty::U64)],
    },
    Layout {
        name: "Pong",
        fields: &[],
    },
    Layout {
        name: "Partial",
        fields: &[Field("sum", Ty::U64), Field("values", Ty::List(&Ty::F32))],
    },
    Layout {
        name: "JoinGroup",
        fields: &[Field("group", Ty::U64), Field("rank", Ty::U32)],
    },
    Layout {
        name: "Probe",
        fields: &[Field("data", Ty::Bytes)],
    },
    Layout {
        name: "ForwardBest",
        fields: FORWARD_FIELDS,
    },
    Layout {
        name: "Share",
        fields: &[Field("step", Ty::U64), Field("values", Ty::List(&Ty::F32))],
    },
    Layout {
        name: "Checkpoint",
        fields: &[Field("seq", Ty::U32), Field("len", Ty::U32)],
    },
    Layout {
        name: "Pooled",
        fields: &[
            Field("step", Ty::U64),
            Field("seq", Ty::U32),
            Field("values", Ty::List(&Ty::F32)),
        ],
    },
    Layout {
        name: "FetchFrom",
        fields: &[Field("peer", Ty::Str), Field("tensors", Ty::List(&Ty::U32))],
    },
    Layout {
        name: "JoinRing",
        fields: &[Field("session", Ty::U64)],
    },
];

/// `Forward` and `ForwardBest` are laid out alike.
const FORWARD_FIELDS: &[Field] = &[
    Field("step", Ty::U64),
    Field("payload", Ty::Struct(&PAYLOAD)),
    Field("positions", Ty::List(&Ty::I32)),
    Field("seq_ids", Ty::List(&Ty::U32)),
    Field("sample_rows", Ty::List(&Ty::U32)),
    Field("row_tokens", Ty::List(&Ty::U32)),
];

impl Ty {
    /// How the tables write the type.
    fn name(&self) -> String {
        match self {
            Ty::U8 => "u8".into(),
            Ty::U16 => "u16".into(),
            Ty::U32 => "u32".into(),
            Ty::U64 => "u64".into(),
            Ty::I32 => "i32".into(),
            Ty::F32 => "f32".into(),
            Ty::Bool => "bool".into(),
            Ty::Role => "role".into(),
            Ty::Raw32 => "[32]".into(),
            Ty::Str => "str".into(),
            Ty::Bytes => "bytes".into(),
            Ty::Opt(inner) => format!("opt<{}>", inner.name()),
            Ty::List(inner) => format!("[{}]", inner.name()),
            Ty::Struct(layout) => layout.name.into(),
            Ty::Union(_) => "union".into(),
        }
    }

    /// Consumes one value of this type from `bytes`.
    fn walk(&self, bytes: &mut &[u8]) -> Result<(), String> {
        let fixed = |bytes: &mut &[u8], n: usize| -> Result<Vec<u8>, String> {
            let (head, rest) = bytes.split_at_checked(n).ok_or("ran out of bytes")?;
            *bytes = rest;
            Ok(head.to_vec())
        };
        let count = |bytes: &mut &[u8]| -> Result<usize, String> {
            let b = fixed(bytes, 4)?;
            Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize)
        };
        match self {
            Ty::U8 | Ty::Bool | Ty::Role => fixed(bytes, 1).map(drop),
            Ty::U16 => fixed(bytes, 2).map(drop),
            Ty::U32 | Ty::I32 | Ty::F32 => fixed(bytes, 4).map(drop),
            Ty::U64 => fixed(bytes, 8).map(drop),
            Ty::Raw32 => fixed(bytes, 32).map(drop),
            Ty::Str | Ty::Bytes => {
                let n = count(bytes)?;
                fixed(bytes, n).map(drop)
            }
            Ty::Opt(inner) => match fixed(bytes, 1)?[0] {
                0 => Ok(()),
                1 => inner.walk(bytes),
                other => Err(format!("option byte {other}")),
            },
            Ty::List(inner) => (0..count(bytes)?).try_for_each(|_| inner.walk(bytes)),
            Ty::Struct(layout) => layout.walk(bytes),
            Ty::Union(variants) => {
                let tag = fixed(bytes, 1)?[0];
                let (_, _, fields) = variants
                    .iter()
                    .find(|(t, _, _)| *t == tag)
                    .ok_or(format!("tag {tag}"))?;
                fields.iter().try_for_each(|Field(_, ty)| ty.walk(bytes))
            }
        }
    }
}

impl Layout {
    fn walk(&self, bytes: &mut &[u8]) -> Result<(), String> {
        self.fields.iter().try_for_each(|Field(_, ty)| ty.walk(bytes))
    }

    /// The fields as one table cell: `name type`, or `name: Structure` for a structure.
    fn describe(&self) -> String {
        if self.fields.is_empty() {
            return "(empty)".into();
        }
        let field = |Field(name, ty): &Field| match ty {
            Ty::Struct(_) => format!("{name}: {}", ty.name()),
            Ty::Union(variants) => {
                let arms: Vec<String> = variants
                    .iter()
                    .map(|(tag, variant, fields)| {
                        let fields: Vec<String> =
                            fields.iter().map(|Field(n, t)| format!("{n} {}", t.name())).collect();
                        format!("{tag}: {variant} ({})", fields.join(", "))
                    })
                    .collect();
                format!("tag u8, then {}", arms.join(", "))
            }
            _ if *name == ty.name() => name.to_string(),
            _ => format!("{name} {}", ty.name()),
        };
        self.fields.iter().map(field).collect::<Vec<_>>().join(", ")
    }
}

/// A table with its header, cells wrapped after a comma to fit `width`.
fn table(headers: &[&str], widths: &[usize], rows: &[Vec<String>]) -> Vec<String> {
    let line = |cells: &[&str]| {
        let padded: Vec<String> = cells.iter().zip(widths).map(|(c, w)| format!(" {c:<w$} ")).collect();
        format!("|{}|", padded.join("|"))
    };
    let mut out = vec![
        line(headers),
        format!(
            "|{}|",
            widths.iter().map(|w| "-".repeat(w + 2)).collect::<Vec<_>>().join("|")
        ),
    ];
    for row in rows {
        // Only the last cell wraps.
        let (last, first) = row.split_last().expect("a row has cells");
        let mut pieces = vec![String::new()];
        for part in last.split_inclusive(", ") {
            let current = pieces.last_mut().expect("one piece at least");
            if !current.is_empty() && current.trim_end().len() + part.trim_end().len() + 1 > widths[first.len()] {
                let done = current.trim_end().to_string();
                *current = done;
                pieces.push(String::new());
            }
            pieces.last_mut().expect("one piece at least").push_str(part);
        }
        for (i, piece) in pieces.iter().enumerate() {
            let mut cells: Vec<&str> = if i == 0 {
                first.iter().map(String::as_str).collect()
            } else {
                vec![""; first.len()]
            };
            cells.push(piece.trim_end());
            out.push(line(&cells));
        }
    }
    out
}

/// The two tables, as `codec.rs` documents them.
fn render() -> String {
    let messages: Vec<Vec<String>> = MESSAGES
        .iter()
        .enumerate()
        .map(|(i, layout)| vec![(i + 1).to_string(), layout.name.to_string(), layout.describe()])
        .collect();
    let structures: Vec<Vec<String>> = STRUCTURES
        .iter()
        .map(|layout| vec![layout.name.to_string(), layout.describe()])
        .collect();
    let mut lines = table(&["kind", "message", "payload, in order"], &[4, 12, 72], &messages);
    lines.push(String::new());
    lines.extend(table(&["structure", "fields, in order"], &[14, 75], &structures));
    lines.push(String::new());
    let codes: Vec<String> = crate::RefusalCode::ALL
        .iter()
        .map(|code| format!("{} {code:?}", code.number()))
        .collect();
    lines.push(format!("Refusal codes (Refused.code): {}", codes.join(", ")));
    let faults: Vec<String> = crate::Fault::ALL
        .iter()
        .map(|fault| format!("{} {fault:?}", fault.number()))
        .collect();
    lines.push(format!("Stage faults (Error.fault): {}", faults.join(", ")));
    let poolings: Vec<String> = crate::Pooling::ALL
        .iter()
        .map(|pooling| format!("{} {pooling:?}", pooling.number()))
        .collect();
    lines.push(format!("Poolings (StartSeq.pooling): 0 none, {}", poolings.join(", ")));
    lines.push(String::new());
    let conversations: Vec<Vec<String>> = crate::conversation::CONVERSATIONS
        .iter()
        .map(|(name, kinds)| vec![name.to_string(), kinds.join(", ")])
        .collect();
    lines.extend(table(
        &["conversation", "messages that may cross it"],
        &[12, 77],
        &conversations,
    ));
    lines.join("\n")
}

#[test]
fn every_sample_is_walked_to_its_last_byte_by_its_documented_layout() {
    let names: Vec<&str> = MESSAGES.iter().map(|l| l.name).collect();
    assert_eq!(names, KIND_NAMES, "one layout per kind, in kind-number order");
    for msg in samples() {
        let mut payload = Vec::new();
        let kind = encode_payload(&msg, &mut payload);
        let layout = &MESSAGES[usize::from(kind) - 1];
        let mut rest = &payload[..];
        let walked = layout.walk(&mut rest);
        assert!(
            walked.is_ok() && rest.is_empty(),
            "{} does not match its layout ({walked:?}, {} bytes left): {msg:?}",
            layout.name,
            rest.len()
        );
    }
}

#[test]
fn the_documented_tables_are_the_layouts() {
    let documented: String = include_str!("../codec.rs")
        .lines()
        .filter_map(|line| line.strip_prefix("//!"))
        .map(|line| line.strip_prefix(' ').unwrap_or(line))
        .collect::<Vec<_>>()
        .join("\n");
    let rendered = render();
    assert!(
        documented.contains(&rendered),
        "the tables in codec.rs differ from the layouts; they should read:\n\n{rendered}\n"
    );
}
