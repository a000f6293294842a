//! Decoding. The payload comes from a peer, so every read is bounds-checked, every count
//! is compared with the bytes that remain before anything is allocated, and nothing here
//! may panic.

use baton_sample::{ReasoningBudget, SamplingParams, MAX_BUDGET_ENDS, MAX_BUDGET_SEQ};

use super::{kind, kind_name, role_from_byte, ProtoError, MAX_STRING};
use crate::{
    Capabilities, DeviceCaps, DeviceRange, Forward, HeldModel, LoadPlan, Message, ModelRef, Payload, SampledToken,
    StartSeq, Stats, TensorEntry, TpPlace, MAX_TP_MEMBERS,
};

/// Decodes the payload of one frame of message `kind` (as returned by
/// [`parse_header`](super::parse_header)).
///
/// One arm per message kind, in the order of the kind table: the whole wire layout reads
/// top to bottom here, beside `encode_payload`'s, which is why it is one long match.
pub fn decode(kind: u16, payload: &[u8]) -> Result<Message, ProtoError> {
    let name = kind_name(kind).ok_or(ProtoError::UnknownKind(kind))?;
    let mut r = Reader {
        rest: payload,
        kind: name,
    };
    let msg = match kind {
        kind::HELLO => Message::Hello {
            version: r.u32("version")?,
            role: r.role()?,
            nonce: r.array32("nonce")?,
        },
        kind::AUTH => Message::Auth {
            proof: r.array32("proof")?,
        },
        kind::REFUSED => Message::Refused {
            reason: r.str("reason")?,
            code: r.refusal_code()?,
        },
        kind::DESCRIBE => Message::Describe { model: r.model_ref()? },
        kind::CAPABILITIES => Message::Capabilities(r.capabilities()?),
        kind::LOAD_PLAN => Message::LoadPlan(Box::new(r.load_plan()?)),
        kind::STREAM_START => {
            let header = r.bytes("header")?;
            let n = r.count("tensors", TENSOR_ENTRY_MIN)?;
            let tensors = (0..n).map(|_| r.tensor_entry()).collect::<Result<_, _>>()?;
            Message::StreamStart { header, tensors }
        }
        kind::TENSOR_CHUNK => Message::TensorChunk {
            index: r.u32("index")?,
            offset: r.u64("offset")?,
            data: r.bytes("data")?,
        },
        kind::FETCH_FROM => Message::FetchFrom {
            peer: r.str("peer")?,
            tensors: r.array("tensors", u32::from_le_bytes)?,
        },
        kind::LOADED => Message::Loaded {
            resident: r.u64("resident")?,
            received: r.u64("received")?,
        },
        kind::START_SEQ => Message::StartSeq(StartSeq {
            seq: r.u32("seq")?,
            keep: r.u32("keep")?,
            params: r.sampling()?,
            history: r.array("history", u32::from_le_bytes)?,
            top_logprobs: r.u8("top_logprobs")?,
            logprobs: r.bool("logprobs")?,
            drawn: r.u32("drawn")?,
            grammar: match r.present("grammar")? {
                false => None,
                true => Some(r.str("grammar")?),
            },
            pooling: r.pooling()?,
            budget: match r.present("budget")? {
                false => None,
                true => Some(Box::new(r.budget()?)),
            },
        }),
        kind::TRUNCATE_SEQ => Message::TruncateSeq {
            seq: r.u32("seq")?,
            len: r.u32("len")?,
        },
        kind::END_SEQ => Message::EndSeq { seq: r.u32("seq")? },
        kind::CHECKPOINT => Message::Checkpoint {
            seq: r.u32("seq")?,
            len: r.u32("len")?,
        },
        kind::FORWARD => Message::Forward(r.forward()?),
        kind::FORWARD_BEST => Message::ForwardBest(r.forward()?),
        kind::SAMPLED => {
            let step = r.u64("step")?;
            let n = r.count("tokens", SAMPLED_TOKEN_LEN)?;
            let tokens = (0..n).map(|_| r.sampled_token()).collect::<Result<_, _>>()?;
            Message::Sampled { step, tokens }
        }
        kind::POOLED => {
            let step = r.u64("step")?;
            let seq = r.u32("seq")?;
            let values = r.array("values", f32::from_le_bytes)?;
            if values.is_empty() || values.len() > crate::MAX_POOLED_WIDTH {
                let why = format!("{} values, expected 1 to {}", values.len(), crate::MAX_POOLED_WIDTH);
                return Err(r.invalid("values", why));
            }
            if values.iter().any(|x| x.is_nan()) {
                return Err(r.invalid("values", "a pooled vector contains NaN".into()));
            }
            Message::Pooled { step, seq, values }
        }
        kind::DONE => Message::Done,
        kind::ERROR => Message::Error {
            first_layer: r.u32("first_layer")?,
            fault: r.fault()?,
            message: r.str("message")?,
        },
        kind::STATS => Message::Stats(Stats {
            resident: r.array("resident", u64::from_le_bytes)?,
            kv_used: r.array("kv_used", u32::from_le_bytes)?,
            busy_us: r.array("busy_us", u64::from_le_bytes)?,
            rows: r.array("rows", u64::from_le_bytes)?,
            link_sent: r.array("link_sent", u64::from_le_bytes)?,
            link_rtt_us: r.array("link_rtt_us", u64::from_le_bytes)?,
        }),
        kind::SHUTDOWN => Message::Shutdown,
        kind::PING => Message::Ping {
            timeout_ms: r.u32("timeout_ms")?,
            session: r.u64("session")?,
        },
        kind::PONG => Message::Pong,
        kind::PARTIAL => {
            let sum = r.u64("sum")?;
            let values = r.array("values", f32::from_le_bytes)?;
            if values.iter().any(|x| x.is_nan()) {
                return Err(r.invalid("values", "partial sums contain NaN".into()));
            }
            Message::Partial { sum, values }
        }
        kind::SHARE => {
            let step = r.u64("step")?;
            let values = r.array("values", f32::from_le_bytes)?;
            if values.iter().any(|x| x.is_nan()) {
                return Err(r.invalid("values", "a member's share contains NaN".into()));
            }
            Message::Share { step, values }
        }
        kind::JOIN_GROUP => Message::JoinGroup {
            group: r.u64("group")?,
            rank: r.u32("rank")?,
        },
        kind::PROBE => Message::Probe { data: r.bytes("data")? },
        kind::JOIN_RING => Message::JoinRing {
            session: r.u64("session")?,
        },
        // `kind_name` accepted it, so a number is missing above.
        _ => return Err(ProtoError::UnknownKind(kind)),
    };
    r.finish()?;
    Ok(msg)
}

/// Smallest encodings, used to cap counts: a hostile count must fail before it allocates.
const STR_MIN: usize = 4;
const HELD_MODEL_MIN: usize = STR_MIN + 32 + 8 + 1;
const TENSOR_ENTRY_MIN: usize = STR_MIN + 8 + 8 + 32;
const DEVICE_CAPS_MIN: usize = STR_MIN + 8 + 1;
const DEVICE_RANGE_MIN: usize = STR_MIN + 4;
const SAMPLED_TOKEN_LEN: usize = 16;

/// A cursor over the unread part of a payload; its errors name the message and field.
struct Reader<'a> {
    rest: &'a [u8],
    kind: &'static str,
}

impl<'a> Reader<'a> {
    fn truncated(&self, what: &'static str) -> ProtoError {
        ProtoError::Truncated { kind: self.kind, what }
    }

    fn invalid(&self, what: &'static str, reason: String) -> ProtoError {
        ProtoError::Invalid {
            kind: self.kind,
            what,
            reason,
        }
    }

    fn finish(&self) -> Result<(), ProtoError> {
        match self.rest.len() {
            0 => Ok(()),
            extra => Err(ProtoError::TrailingBytes { kind: self.kind, extra }),
        }
    }

    fn take(&mut self, n: usize, what: &'static str) -> Result<&'a [u8], ProtoError> {
        let Some((head, rest)) = self.rest.split_at_checked(n) else {
            return Err(self.truncated(what));
        };
        self.rest = rest;
        Ok(head)
    }

    fn fixed<const N: usize>(&mut self, what: &'static str) -> Result<[u8; N], ProtoError> {
        let Some((head, rest)) = self.rest.split_first_chunk::<N>() else {
            return Err(self.truncated(what));
        };
        self.rest = rest;
        Ok(*head)
    }

    fn u8(&mut self, what: &'static str) -> Result<u8, ProtoError> {
        Ok(self.fixed::<1>(what)?[0])
    }

    fn u16(&mut self, what: &'static str) -> Result<u16, ProtoError> {
        self.fixed(what).map(u16::from_le_bytes)
    }

    fn u32(&mut self, what: &'static str) -> Result<u32, ProtoError> {
        self.fixed(what).map(u32::from_le_bytes)
    }

    fn u64(&mut self, what: &'static str) -> Result<u64, ProtoError> {
        self.fixed(what).map(u64::from_le_bytes)
    }

    fn i32(&mut self, what: &'static str) -> Result<i32, ProtoError> {
        self.fixed(what).map(i32::from_le_bytes)
    }

    fn f32(&mut self, what: &'static str) -> Result<f32, ProtoError> {
        self.fixed(what).map(f32::from_le_bytes)
    }

    /// A float that may not be NaN (only log-probabilities may).
    fn number(&mut self, what: &'static str) -> Result<f32, ProtoError> {
        let value = self.f32(what)?;
        if value.is_nan() {
            return Err(self.invalid(what, "NaN is not allowed here".into()));
        }
        Ok(value)
    }

    fn array32(&mut self, what: &'static str) -> Result<[u8; 32], ProtoError> {
        self.fixed(what)
    }

    fn bool(&mut self, what: &'static str) -> Result<bool, ProtoError> {
        match self.u8(what)? {
            0 => Ok(false),
            1 => Ok(true),
            other => Err(self.invalid(what, format!("boolean byte {other} is neither 0 nor 1"))),
        }
    }

    /// The presence byte of an `opt<T>`.
    fn present(&mut self, what: &'static str) -> Result<bool, ProtoError> {
        match self.u8(what)? {
            0 => Ok(false),
            1 => Ok(true),
            other => Err(self.invalid(what, format!("option tag {other} is neither 0 nor 1"))),
        }
    }

    fn role(&mut self) -> Result<crate::Role, ProtoError> {
        let byte = self.u8("role")?;
        role_from_byte(byte).ok_or_else(|| self.invalid("role", format!("unknown role byte {byte}")))
    }

    fn refusal_code(&mut self) -> Result<crate::RefusalCode, ProtoError> {
        let number = self.u16("code")?;
        crate::RefusalCode::from_number(number)
            .ok_or_else(|| self.invalid("code", format!("unknown refusal code {number}")))
    }

    fn fault(&mut self) -> Result<crate::Fault, ProtoError> {
        let number = self.u16("fault")?;
        crate::Fault::from_number(number).ok_or_else(|| self.invalid("fault", format!("unknown fault {number}")))
    }

    /// A sequence's pooling: 0 for none (it generates), else [`crate::Pooling`]'s number.
    fn pooling(&mut self) -> Result<Option<crate::Pooling>, ProtoError> {
        match self.u8("pooling")? {
            0 => Ok(None),
            number => crate::Pooling::from_number(number)
                .map(Some)
                .ok_or_else(|| self.invalid("pooling", format!("unknown pooling {number}"))),
        }
    }

    /// An element count, refused when even the smallest `min_size`-byte elements could
    /// not fit in what remains.
    fn count(&mut self, what: &'static str, min_size: usize) -> Result<usize, ProtoError> {
        let n = self.u32(what)? as usize;
        match n.checked_mul(min_size) {
            Some(bytes) if bytes <= self.rest.len() => Ok(n),
            _ => Err(self.truncated(what)),
        }
    }

    fn bytes(&mut self, what: &'static str) -> Result<Vec<u8>, ProtoError> {
        let n = self.count(what, 1)?;
        Ok(self.take(n, what)?.to_vec())
    }

    fn str(&mut self, what: &'static str) -> Result<String, ProtoError> {
        let len = self.u32(what)? as usize;
        if len > MAX_STRING {
            return Err(ProtoError::TooLong {
                kind: self.kind,
                what,
                len,
                max: MAX_STRING,
            });
        }
        let bytes = self.take(len, what)?;
        match std::str::from_utf8(bytes) {
            Ok(text) => Ok(text.to_owned()),
            Err(_) => Err(ProtoError::BadUtf8 { kind: self.kind, what }),
        }
    }

    /// A count and `N`-byte elements, converted in one pass into an exactly sized Vec.
    fn array<T, const N: usize>(
        &mut self,
        what: &'static str,
        from_le: impl Fn([u8; N]) -> T,
    ) -> Result<Vec<T>, ProtoError> {
        let n = self.count(what, N)?;
        let (chunks, _) = self.take(n * N, what)?.as_chunks::<N>();
        Ok(chunks.iter().map(|&chunk| from_le(chunk)).collect())
    }

    fn model_ref(&mut self) -> Result<ModelRef, ProtoError> {
        Ok(ModelRef {
            file_name: self.str("file_name")?,
            identity: self.array32("identity")?,
            size: self.u64("size")?,
        })
    }

    fn held_model(&mut self) -> Result<HeldModel, ProtoError> {
        Ok(HeldModel {
            file_name: self.str("file_name")?,
            identity: self.array32("identity")?,
            size: self.u64("size")?,
            complete: self.bool("complete")?,
            content: match self.bool("has_content")? {
                true => Some(self.array32("content")?),
                false => None,
            },
        })
    }

    fn device_caps(&mut self) -> Result<DeviceCaps, ProtoError> {
        let name = self.str("device")?;
        let memory = self.u64("memory")?;
        let secs_per_layer = match self.present("secs_per_layer")? {
            false => None,
            true => {
                let secs = self.number("secs_per_layer")?;
                // The planner divides work by speed; a negative or infinite time would
                // hand this device everything or nothing.
                if !(secs.is_finite() && secs >= 0.0) {
                    return Err(self.invalid("secs_per_layer", format!("{secs} is not a finite, non-negative time")));
                }
                Some(secs)
            }
        };
        Ok(DeviceCaps {
            name,
            memory,
            secs_per_layer,
        })
    }

    fn capabilities(&mut self) -> Result<Capabilities, ProtoError> {
        let n = self.count("devices", DEVICE_CAPS_MIN)?;
        let devices: Vec<DeviceCaps> = (0..n).map(|_| self.device_caps()).collect::<Result<_, _>>()?;
        if devices.is_empty() {
            return Err(self.invalid("devices", "a worker offers at least one device".into()));
        }
        let threads = self.u32("threads")?;
        let n = self.count("models", HELD_MODEL_MIN)?;
        let models = (0..n).map(|_| self.held_model()).collect::<Result<_, _>>()?;
        let ring_addr = self.str("ring_addr")?;
        let session = self.u64("session")?;
        Ok(Capabilities {
            devices,
            threads,
            models,
            ring_addr,
            session,
        })
    }

    fn load_plan(&mut self) -> Result<LoadPlan, ProtoError> {
        let model = self.model_ref()?;
        let layer_start = self.u32("layer_start")?;
        let layer_end = self.u32("layer_end")?;
        let first = self.bool("first")?;
        let last = self.bool("last")?;
        let n_ctx = self.u32("n_ctx")?;
        let n_seq = self.u32("n_seq")?;
        let next = match self.present("next")? {
            false => None,
            true => Some(self.str("next")?),
        };
        let next_session = self.u64("next_session")?;
        let plan = LoadPlan {
            model,
            layer_start,
            layer_end,
            first,
            last,
            n_ctx,
            n_seq,
            next,
            next_session,
            stream: self.bool("stream")?,
            wire_f16: self.bool("wire_f16")?,
            repack: self.bool("repack")?,
            devices: {
                let n = self.count("devices", DEVICE_RANGE_MIN)?;
                (0..n)
                    .map(|_| {
                        Ok(DeviceRange {
                            device: self.str("device")?,
                            layer_end: self.u32("layer_end")?,
                        })
                    })
                    .collect::<Result<_, ProtoError>>()?
            },
            tp: match self.present("tp")? {
                false => None,
                true => Some(self.tp_place()?),
            },
            cache_type_k: self.str("cache_type_k")?,
            cache_type_v: self.str("cache_type_v")?,
        };
        if plan.layer_start > plan.layer_end {
            let reason = format!("layer_start {} is after layer_end {}", plan.layer_start, plan.layer_end);
            return Err(self.invalid("layers", reason));
        }
        // Each device's range starts where the one before it ended, is not empty, and
        // the last ends with the stage.
        let mut start = plan.layer_start;
        for range in &plan.devices {
            if range.layer_end <= start || range.layer_end > plan.layer_end {
                let reason = format!(
                    "device {} ends at layer {}, outside {}..{}",
                    range.device, range.layer_end, start, plan.layer_end
                );
                return Err(self.invalid("devices", reason));
            }
            start = range.layer_end;
        }
        if plan.devices.last().is_some_and(|r| r.layer_end != plan.layer_end) {
            let reason = format!("the devices' ranges end at {}, the stage at {}", start, plan.layer_end);
            return Err(self.invalid("devices", reason));
        }
        Ok(plan)
    }

    fn tp_place(&mut self) -> Result<TpPlace, ProtoError> {
        let group = self.u64("tp group")?;
        let rank = self.u32("tp rank")?;
        let n = self.count("tp members", STR_MIN)?;
        if !(2..=MAX_TP_MEMBERS).contains(&n) {
            return Err(self.invalid("tp members", format!("{n} members; a group has 2 to {MAX_TP_MEMBERS}")));
        }
        let members = (0..n).map(|_| self.str("tp member")).collect::<Result<Vec<_>, _>>()?;
        if rank as usize >= n {
            return Err(self.invalid("tp rank", format!("rank {rank} in a group of {n}")));
        }
        Ok(TpPlace { group, rank, members })
    }

    fn tensor_entry(&mut self) -> Result<TensorEntry, ProtoError> {
        let entry = TensorEntry {
            name: self.str("tensor name")?,
            offset: self.u64("tensor offset")?,
            len: self.u64("tensor length")?,
            sha256: self.array32("tensor sha256")?,
        };
        if entry.offset.checked_add(entry.len).is_none() {
            let reason = format!(
                "{}: offset {} plus length {} overflows",
                entry.name, entry.offset, entry.len
            );
            return Err(self.invalid("tensor entry", reason));
        }
        Ok(entry)
    }

    /// A thinking budget: its token count, start sequence, end sequences, forced
    /// sequence and prefill, each sequence at most `MAX_BUDGET_SEQ` tokens and at most
    /// `MAX_BUDGET_ENDS` end sequences (the last stage matches each against every token).
    fn budget(&mut self) -> Result<ReasoningBudget, ProtoError> {
        let tokens = self.u32("budget tokens")?;
        let seq = |r: &mut Self, what: &'static str| {
            let seq = r.array(what, u32::from_le_bytes)?;
            match seq.len() <= MAX_BUDGET_SEQ {
                true => Ok(seq),
                false => Err(r.invalid(what, format!("{} tokens, more than {MAX_BUDGET_SEQ}", seq.len()))),
            }
        };
        let start = seq(self, "budget start")?;
        let n_ends = self.count("budget ends", 4)?;
        if n_ends > MAX_BUDGET_ENDS {
            return Err(self.invalid(
                "budget ends",
                format!("{n_ends} sequences, more than {MAX_BUDGET_ENDS}"),
            ));
        }
        let ends = (0..n_ends).map(|_| seq(self, "budget end")).collect::<Result<_, _>>()?;
        Ok(ReasoningBudget {
            tokens,
            start,
            ends,
            forced: seq(self, "budget forced")?,
            prefill: seq(self, "budget prefill")?,
        })
    }

    fn sampling(&mut self) -> Result<SamplingParams, ProtoError> {
        let params = SamplingParams {
            temperature: self.f32("temperature")?,
            top_k: self.i32("top_k")?,
            top_p: self.f32("top_p")?,
            min_p: self.f32("min_p")?,
            repeat_penalty: self.f32("repeat_penalty")?,
            repeat_last_n: {
                let n = self.u64("repeat_last_n")?;
                usize::try_from(n).map_err(|_| self.invalid("repeat_last_n", format!("{n} does not fit in usize")))?
            },
            frequency_penalty: self.f32("frequency_penalty")?,
            presence_penalty: self.f32("presence_penalty")?,
            seed: self.u64("seed")?,
        };
        // `validate` refuses NaN in every float field.
        params
            .validate()
            .map_err(|e| self.invalid("sampling parameters", e.to_string()))?;
        Ok(params)
    }

    fn forward(&mut self) -> Result<Forward, ProtoError> {
        let step = self.u64("step")?;
        let payload = match self.u8("payload tag")? {
            0 => Payload::Tokens(self.array("tokens", u32::from_le_bytes)?),
            1 => Payload::Hidden(self.array("hidden", f32::from_le_bytes)?),
            2 => Payload::HiddenF16 {
                values: self.array("hidden", u16::from_le_bytes)?,
                row_exps: self.array("row scales", u8::from_le_bytes)?,
            },
            tag => return Err(self.invalid("payload", format!("unknown payload tag {tag}"))),
        };
        let forward = Forward {
            step,
            payload,
            positions: self.array("positions", i32::from_le_bytes)?,
            seq_ids: self.array("seq_ids", u32::from_le_bytes)?,
            sample_rows: self.array("sample_rows", u32::from_le_bytes)?,
            row_tokens: self.array("row_tokens", u32::from_le_bytes)?,
        };
        check_forward(&forward).map_err(|reason| self.invalid("batch", reason))?;
        Ok(forward)
    }

    fn sampled_token(&mut self) -> Result<SampledToken, ProtoError> {
        Ok(SampledToken {
            seq: self.u32("token seq")?,
            token: self.u32("token id")?,
            logprob: self.f32("logprob")?,
            top: {
                let n = self.count("top logprobs", 8)?;
                (0..n)
                    .map(|_| Ok((self.u32("top token")?, self.f32("top logprob")?)))
                    .collect::<Result<_, ProtoError>>()?
            },
        })
    }
}

/// The rows of a batch must agree with each other; stages index by them.
fn check_forward(forward: &Forward) -> Result<(), String> {
    let rows = forward.positions.len();
    if rows == 0 {
        return Err("a batch needs at least one row".into());
    }
    if forward.seq_ids.len() != rows {
        return Err(format!("{rows} positions but {} sequence ids", forward.seq_ids.len()));
    }
    let (values, nan) = match &forward.payload {
        Payload::Tokens(tokens) if tokens.len() != rows => {
            return Err(format!("{} tokens for {rows} rows", tokens.len()));
        }
        Payload::Tokens(_) => (rows, false),
        Payload::Hidden(hidden) => (hidden.len(), hidden.iter().any(|x| x.is_nan())),
        Payload::HiddenF16 { row_exps, .. } if row_exps.len() != rows => {
            return Err(format!("{} row scales for {rows} rows", row_exps.len()));
        }
        Payload::HiddenF16 { row_exps, .. } if row_exps.iter().any(|&e| e > crate::MAX_ROW_EXP) => {
            return Err(format!("a row scale beyond 2^{}", crate::MAX_ROW_EXP));
        }
        // f16 NaN: all exponent bits set and a non-zero mantissa.
        Payload::HiddenF16 { values, .. } => (values.len(), values.iter().any(|&x| x & 0x7fff > 0x7c00)),
    };
    if values == 0 || values % rows != 0 {
        return Err(format!("{values} hidden values do not divide into {rows} rows"));
    }
    if nan {
        return Err("hidden states contain NaN".into());
    }
    if let Some(row) = forward.sample_rows.iter().find(|&&row| row as usize >= rows) {
        return Err(format!("sample row {row} is out of range for {rows} rows"));
    }
    if !forward.row_tokens.is_empty() && forward.row_tokens.len() != rows {
        return Err(format!("{} row tokens for {rows} rows", forward.row_tokens.len()));
    }
    Ok(())
}
