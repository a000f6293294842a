//! Encoding. Infallible: every message value has an encoding. Values a receiver refuses
//! (a string over 64 KiB, an inconsistent `Forward`) are still written, so the refusal
//! and its reason come from the peer's decoder in one place.

use baton_sample::{ReasoningBudget, SamplingParams};

use super::{kind_of, role_byte, HEADER_LEN};
use crate::{
    Capabilities, Forward, HeldModel, LoadPlan, Message, ModelRef, Payload, Pooling, SampledToken, StartSeq, Stats,
    TensorEntry,
};

/// Appends one whole frame (header and payload) for `msg` to `out`.
pub fn encode(msg: &Message, out: &mut Vec<u8>) {
    let start = out.len();
    out.extend_from_slice(&[0; HEADER_LEN]);
    let kind = encode_payload(msg, out);
    let len = out.len() - start - HEADER_LEN;
    out[start..start + HEADER_LEN].copy_from_slice(&header(kind, len));
}

/// The frame header for a payload of `len` bytes of message `kind`.
///
/// # Panics
/// If `len` exceeds `u32::MAX`: no transport accepts such a frame, so it is a bug in the
/// sender, and writing a wrapped length would desynchronise the stream.
pub fn header(kind: u16, len: usize) -> [u8; HEADER_LEN] {
    let len = u32::try_from(len).expect("frame payloads are limited to u32::MAX bytes");
    let mut head = [0; HEADER_LEN];
    head[0..4].copy_from_slice(&len.to_le_bytes());
    head[4..6].copy_from_slice(&kind.to_le_bytes());
    // Bytes 6..8 are the flags, zero in this version.
    head
}

/// Appends the payload of `msg` to `payload` and returns its kind number, for callers that
/// write header and payload separately (one vectored write, no copy of the payload).
///
/// One arm per message kind, in the order of the kind table: the whole wire layout reads
/// top to bottom here, beside `decode`'s, which is why it is one long match.
pub fn encode_payload(msg: &Message, payload: &mut Vec<u8>) -> u16 {
    let mut w = Writer(payload);
    match msg {
        Message::Hello { version, role, nonce } => {
            w.u32(*version);
            w.u8(role_byte(*role));
            w.raw(nonce);
        }
        Message::Auth { proof } => {
            w.raw(proof);
        }
        Message::Refused { code, reason } => {
            // The reason first: the layout of versions 1 to 3 is a prefix of this one.
            w.str(reason);
            w.u16(code.number());
        }
        Message::Describe { model } => {
            w.model_ref(model);
        }
        Message::Capabilities(caps) => {
            w.capabilities(caps);
        }
        Message::LoadPlan(plan) => {
            w.load_plan(plan);
        }
        Message::StreamStart { header, tensors } => {
            w.bytes(header);
            w.count(tensors.len());
            tensors.iter().for_each(|t| w.tensor_entry(t));
        }
        Message::TensorChunk { index, offset, data } => {
            w.u32(*index);
            w.u64(*offset);
            w.bytes(data);
        }
        Message::FetchFrom { peer, tensors } => {
            w.str(peer);
            w.array(tensors, u32::to_le_bytes);
        }
        Message::Loaded { resident, received } => {
            w.u64(*resident);
            w.u64(*received);
        }
        Message::StartSeq(StartSeq {
            seq,
            keep,
            params,
            history,
            top_logprobs,
            logprobs,
            drawn,
            grammar,
            pooling,
            budget,
        }) => {
            w.u32(*seq);
            w.u32(*keep);
            w.sampling(params);
            w.array(history, u32::to_le_bytes);
            w.u8(*top_logprobs);
            w.bool(*logprobs);
            w.u32(*drawn);
            w.opt_str(grammar.as_deref());
            w.u8(pooling.map_or(0, Pooling::number));
            match budget {
                None => w.u8(0),
                Some(budget) => {
                    w.u8(1);
                    w.budget(budget);
                }
            }
        }
        Message::TruncateSeq { seq, len } | Message::Checkpoint { seq, len } => {
            w.u32(*seq);
            w.u32(*len);
        }
        Message::EndSeq { seq } => {
            w.u32(*seq);
        }
        Message::Forward(forward) | Message::ForwardBest(forward) => {
            w.forward(forward);
        }
        Message::Sampled { step, tokens } => {
            w.u64(*step);
            w.count(tokens.len());
            tokens.iter().for_each(|t| w.sampled_token(t));
        }
        Message::Pooled { step, seq, values } => {
            w.u64(*step);
            w.u32(*seq);
            w.array(values, f32::to_le_bytes);
        }
        Message::Done | Message::Shutdown | Message::Pong => {}
        Message::Error {
            first_layer,
            fault,
            message,
        } => {
            w.u32(*first_layer);
            w.u16(fault.number());
            w.str(message);
        }
        Message::Stats(Stats {
            resident,
            kv_used,
            busy_us,
            rows,
            link_sent,
            link_rtt_us,
        }) => {
            w.array(resident, u64::to_le_bytes);
            w.array(kv_used, u32::to_le_bytes);
            w.array(busy_us, u64::to_le_bytes);
            w.array(rows, u64::to_le_bytes);
            w.array(link_sent, u64::to_le_bytes);
            w.array(link_rtt_us, u64::to_le_bytes);
        }
        Message::Ping { timeout_ms, session } => {
            w.u32(*timeout_ms);
            w.u64(*session);
        }
        Message::Partial { sum, values } => {
            w.u64(*sum);
            w.array(values, f32::to_le_bytes);
        }
        Message::Share { step, values } => {
            w.u64(*step);
            w.array(values, f32::to_le_bytes);
        }
        Message::JoinGroup { group, rank } => {
            w.u64(*group);
            w.u32(*rank);
        }
        Message::Probe { data } => {
            w.bytes(data);
        }
        Message::JoinRing { session } => {
            w.u64(*session);
        }
    }
    kind_of(msg)
}

/// Appends primitives and structures in the layout documented in `codec`.
struct Writer<'a>(&'a mut Vec<u8>);

impl Writer<'_> {
    fn raw(&mut self, bytes: &[u8]) {
        self.0.extend_from_slice(bytes);
    }

    fn u8(&mut self, value: u8) {
        self.0.push(value);
    }

    fn u16(&mut self, value: u16) {
        self.raw(&value.to_le_bytes());
    }

    fn u32(&mut self, value: u32) {
        self.raw(&value.to_le_bytes());
    }

    fn u64(&mut self, value: u64) {
        self.raw(&value.to_le_bytes());
    }

    fn bool(&mut self, value: bool) {
        self.u8(u8::from(value));
    }

    /// A length or element count.
    fn count(&mut self, n: usize) {
        // A count over u32::MAX cannot fit in any frame; `header` reports it.
        self.u32(u32::try_from(n).unwrap_or(u32::MAX));
    }

    fn bytes(&mut self, bytes: &[u8]) {
        self.count(bytes.len());
        self.raw(bytes);
    }

    fn str(&mut self, text: &str) {
        self.bytes(text.as_bytes());
    }

    fn opt_str(&mut self, text: Option<&str>) {
        match text {
            None => self.u8(0),
            Some(text) => {
                self.u8(1);
                self.str(text);
            }
        }
    }

    /// A count and then each element's bytes. Hidden states go through here every token:
    /// growing the Vec once and filling fixed-size chunks (rather than pushing element by
    /// element) lets the compiler turn the loop into a plain copy on little-endian machines.
    fn array<T: Copy, const N: usize>(&mut self, values: &[T], to_le: impl Fn(T) -> [u8; N]) {
        self.count(values.len());
        let start = self.0.len();
        self.0.resize(start + values.len() * N, 0);
        let (chunks, _) = self.0[start..].as_chunks_mut::<N>();
        for (chunk, &value) in chunks.iter_mut().zip(values) {
            *chunk = to_le(value);
        }
    }

    fn model_ref(&mut self, model: &ModelRef) {
        self.str(&model.file_name);
        self.raw(&model.identity);
        self.u64(model.size);
    }

    fn held_model(&mut self, model: &HeldModel) {
        self.str(&model.file_name);
        self.raw(&model.identity);
        self.u64(model.size);
        self.bool(model.complete);
        self.bool(model.content.is_some());
        if let Some(content) = &model.content {
            self.raw(content);
        }
    }

    fn capabilities(&mut self, caps: &Capabilities) {
        self.count(caps.devices.len());
        for device in &caps.devices {
            self.str(&device.name);
            self.u64(device.memory);
            match device.secs_per_layer {
                None => self.u8(0),
                Some(secs) => {
                    self.u8(1);
                    self.raw(&secs.to_le_bytes());
                }
            }
        }
        self.u32(caps.threads);
        self.count(caps.models.len());
        caps.models.iter().for_each(|m| self.held_model(m));
        self.str(&caps.ring_addr);
        self.u64(caps.session);
    }

    fn load_plan(&mut self, plan: &LoadPlan) {
        self.model_ref(&plan.model);
        self.u32(plan.layer_start);
        self.u32(plan.layer_end);
        self.bool(plan.first);
        self.bool(plan.last);
        self.u32(plan.n_ctx);
        self.u32(plan.n_seq);
        self.opt_str(plan.next.as_deref());
        self.u64(plan.next_session);
        self.bool(plan.stream);
        self.bool(plan.wire_f16);
        self.bool(plan.repack);
        self.count(plan.devices.len());
        for range in &plan.devices {
            self.str(&range.device);
            self.u32(range.layer_end);
        }
        match &plan.tp {
            None => self.u8(0),
            Some(place) => {
                self.u8(1);
                self.u64(place.group);
                self.u32(place.rank);
                self.count(place.members.len());
                place.members.iter().for_each(|m| self.str(m));
            }
        }
        self.str(&plan.cache_type_k);
        self.str(&plan.cache_type_v);
    }

    fn tensor_entry(&mut self, entry: &TensorEntry) {
        self.str(&entry.name);
        self.u64(entry.offset);
        self.u64(entry.len);
        self.raw(&entry.sha256);
    }

    fn budget(&mut self, budget: &ReasoningBudget) {
        self.u32(budget.tokens);
        self.array(&budget.start, u32::to_le_bytes);
        self.count(budget.ends.len());
        for end in &budget.ends {
            self.array(end, u32::to_le_bytes);
        }
        self.array(&budget.forced, u32::to_le_bytes);
        self.array(&budget.prefill, u32::to_le_bytes);
    }

    fn sampling(&mut self, params: &SamplingParams) {
        self.raw(&params.temperature.to_le_bytes());
        self.raw(&params.top_k.to_le_bytes());
        self.raw(&params.top_p.to_le_bytes());
        self.raw(&params.min_p.to_le_bytes());
        self.raw(&params.repeat_penalty.to_le_bytes());
        // usize travels as u64 so 32- and 64-bit peers agree on the layout.
        self.u64(params.repeat_last_n as u64);
        self.raw(&params.frequency_penalty.to_le_bytes());
        self.raw(&params.presence_penalty.to_le_bytes());
        self.u64(params.seed);
    }

    fn forward(&mut self, forward: &Forward) {
        self.u64(forward.step);
        match &forward.payload {
            Payload::Tokens(tokens) => {
                self.u8(0);
                self.array(tokens, u32::to_le_bytes);
            }
            Payload::Hidden(hidden) => {
                self.u8(1);
                self.array(hidden, f32::to_le_bytes);
            }
            Payload::HiddenF16 { values, row_exps } => {
                self.u8(2);
                self.array(values, u16::to_le_bytes);
                self.array(row_exps, u8::to_le_bytes);
            }
        }
        self.array(&forward.positions, i32::to_le_bytes);
        self.array(&forward.seq_ids, u32::to_le_bytes);
        self.array(&forward.sample_rows, u32::to_le_bytes);
        self.array(&forward.row_tokens, u32::to_le_bytes);
    }

    fn sampled_token(&mut self, token: &SampledToken) {
        self.u32(token.seq);
        self.u32(token.token);
        self.raw(&token.logprob.to_le_bytes());
        self.count(token.top.len());
        for &(id, logprob) in &token.top {
            self.u32(id);
            self.raw(&logprob.to_le_bytes());
        }
    }
}
