//! The stage side of the ring: apply each message to the local stage and pass the
//! result on. The logic is in [`StageWorker::handle`], which does no I/O; [`run`]
//! drives it over any transport.

use std::collections::HashMap;

use baton_model::{Batch, Stage, StageInput, StageOutput};
use baton_net::{Rx, Tx};
use baton_proto::{Forward, Message, Payload, SampledToken};
use baton_sample::Sampler;

use crate::engine::max_decode_rows;
use crate::NodeError;

/// A stage plus, on the last stage, one sampler per live sequence.
pub struct StageWorker {
    stage: Stage,
    samplers: HashMap<u32, SeqSampler>,
    wire_f16: bool,
}

/// A sequence's sampler and whether it wants log-probabilities.
struct SeqSampler {
    sampler: Sampler,
    logprobs: bool,
    /// Alternatives to report with each token.
    n_top: usize,
}

impl StageWorker {
    /// Wraps `stage`.
    pub fn new(stage: Stage) -> StageWorker {
        StageWorker {
            stage,
            samplers: HashMap::new(),
            wire_f16: false,
        }
    }

    /// Sends hidden states on as f16 (half the bytes; the next stage widens them back).
    pub fn with_wire_f16(mut self, wire_f16: bool) -> StageWorker {
        self.wire_f16 = wire_f16;
        self
    }

    /// The stage.
    pub fn stage(&self) -> &Stage {
        &self.stage
    }

    /// Handles one message; returns what goes to the next hop (the next stage, or the
    /// head after the last stage). Errors become `Message::Error` so the ring never
    /// stalls on a bad message.
    pub fn handle(&mut self, msg: Message) -> Message {
        let last = self.stage.span().last;
        let reply = match msg {
            Message::StartSeq {
                seq,
                keep,
                params,
                history,
                top_logprobs,
                logprobs,
                drawn,
            } => {
                self.stage.truncate_seq(seq, keep as usize);
                if last {
                    match Sampler::new(params.clone()) {
                        Ok(mut sampler) => {
                            history.iter().for_each(|&t| sampler.accept(t));
                            sampler.skip_draws(drawn);
                            let n_top = if logprobs { top_logprobs as usize } else { 0 };
                            self.samplers.insert(
                                seq,
                                SeqSampler {
                                    sampler,
                                    logprobs,
                                    n_top,
                                },
                            );
                        }
                        Err(e) => return self.error(e.to_string()),
                    }
                }
                Message::StartSeq {
                    seq,
                    keep,
                    params,
                    history,
                    top_logprobs,
                    logprobs,
                    drawn,
                }
            }
            Message::TruncateSeq { seq, len } => {
                self.stage.truncate_seq(seq, len as usize);
                Message::TruncateSeq { seq, len }
            }
            Message::EndSeq { seq } => {
                self.stage.clear_seq(seq);
                self.samplers.remove(&seq);
                Message::EndSeq { seq }
            }
            Message::Forward(forward) => {
                let span = tracing::debug_span!("step", step = forward.step, rows = forward.positions.len());
                let _entered = span.enter();
                let started = std::time::Instant::now();
                let reply = match self.forward(forward) {
                    Ok(msg) => msg,
                    Err(message) => self.error(message),
                };
                tracing::debug!(ms = started.elapsed().as_secs_f64() * 1e3, "computed");
                return reply;
            }
            Message::Stats {
                mut resident,
                mut kv_used,
            } => {
                resident.push(self.stage.resident_bytes());
                kv_used.push(self.stage.kv().n_used() as u32);
                return Message::Stats { resident, kv_used };
            }
            // Replies and errors from upstream pass through untouched.
            other @ (Message::Sampled { .. } | Message::Done | Message::Error { .. } | Message::Shutdown) => {
                return other
            }
            // Handshake and control messages never travel the ring.
            other => return self.error(format!("{} is not a ring message", other.kind())),
        };
        if last {
            Message::Done
        } else {
            reply
        }
    }

    fn error(&self, message: String) -> Message {
        Message::Error {
            first_layer: self.stage.span().layers.start as u32,
            message,
        }
    }

    fn forward(&mut self, forward: Forward) -> Result<Message, String> {
        let Forward {
            step,
            payload,
            positions,
            seq_ids,
            sample_rows,
            row_tokens,
        } = forward;
        let widened: Vec<f32>;
        let input = match &payload {
            Payload::Tokens(tokens) => StageInput::Tokens(tokens),
            Payload::Hidden(hidden) => StageInput::Hidden(hidden),
            Payload::HiddenF16 { .. } => {
                widened = payload.widen_f16().unwrap_or_default();
                StageInput::Hidden(&widened)
            }
        };
        match self.compute(input, &positions, &seq_ids, &sample_rows)? {
            StageOutput::Hidden(hidden) => Ok(Message::Forward(Forward {
                step,
                payload: if self.wire_f16 {
                    Payload::f16_rows(&hidden, positions.len())
                } else {
                    Payload::Hidden(hidden)
                },
                positions,
                seq_ids,
                sample_rows,
                row_tokens,
            })),
            StageOutput::Logits(logits) => {
                let tokens = self.sample(&positions, &seq_ids, &sample_rows, &row_tokens, &logits)?;
                Ok(Message::Sampled { step, tokens })
            }
        }
    }

    /// Runs the batch through the stage. A batch whose every row is sampled is decode
    /// rows (single tokens, or a token and its drafts): it is computed in pieces of at
    /// most [`max_decode_rows`] rows, each of which ggml computes exactly as one row
    /// alone, so a drafted token's row gives the bits a one-token step would have.
    /// Prompt chunks are computed whole, as cut.
    fn compute(
        &mut self,
        input: StageInput<'_>,
        positions: &[i32],
        seq_ids: &[u32],
        sample_rows: &[u32],
    ) -> Result<StageOutput, String> {
        let last = self.stage.span().last;
        let n = positions.len();
        let cap = max_decode_rows(self.stage.repacked());
        let all_sampled = sample_rows.len() == n && sample_rows.iter().enumerate().all(|(i, &r)| r as usize == i);
        if !all_sampled || n <= cap {
            let batch = Batch {
                input,
                positions,
                seq_ids,
                logit_rows: if last { sample_rows } else { &[] },
            };
            return self.stage.forward(&batch).map_err(|e| e.to_string());
        }
        let width = match input {
            StageInput::Tokens(_) => 1,
            StageInput::Hidden(hidden) => hidden.len() / n,
        };
        let mut out = Vec::new();
        for start in (0..n).step_by(cap) {
            let end = (start + cap).min(n);
            let piece = match input {
                StageInput::Tokens(tokens) => StageInput::Tokens(&tokens[start..end]),
                StageInput::Hidden(hidden) => StageInput::Hidden(&hidden[start * width..end * width]),
            };
            let rows: Vec<u32> = (0..(end - start) as u32).collect();
            let batch = Batch {
                input: piece,
                positions: &positions[start..end],
                seq_ids: &seq_ids[start..end],
                logit_rows: if last { &rows } else { &[] },
            };
            match self.stage.forward(&batch) {
                Ok(StageOutput::Hidden(h) | StageOutput::Logits(h)) => out.extend_from_slice(&h),
                Err(e) => {
                    // Rows already computed hold cells: forget them with the failure.
                    for (&seq, &pos) in seq_ids[..start].iter().zip(&positions[..start]) {
                        self.stage.truncate_seq(seq, pos as usize);
                    }
                    return Err(e.to_string());
                }
            }
        }
        Ok(if last {
            StageOutput::Logits(out)
        } else {
            StageOutput::Hidden(out)
        })
    }

    /// Samples the batch's sampled rows, in order, each with its sequence's sampler.
    /// With `row_tokens`, a sequence's rows after its first are drafted tokens: each is
    /// kept only while the sample of the row before it equals it, so the sequence gets
    /// the longest prefix of its draft that its own sampling agrees with, plus one
    /// token, and the same random draws as without a draft. The cells of rejected rows
    /// are dropped here at once (the head tells the other stages).
    fn sample(
        &mut self,
        positions: &[i32],
        seq_ids: &[u32],
        sample_rows: &[u32],
        row_tokens: &[u32],
        logits: &[f32],
    ) -> Result<Vec<SampledToken>, String> {
        if sample_rows.is_empty() {
            return Ok(Vec::new());
        }
        let n_vocab = logits.len() / sample_rows.len();
        if n_vocab == 0 {
            return Err(format!(
                "{} logits for {} sampled rows",
                logits.len(),
                sample_rows.len()
            ));
        }
        let mut tokens = Vec::with_capacity(sample_rows.len());
        // Sequences whose draft was rejected: their later rows are not sampled.
        let mut stopped: Vec<u32> = Vec::new();
        for (i, (&row, row_logits)) in sample_rows.iter().zip(logits.chunks_exact(n_vocab)).enumerate() {
            let seq = seq_ids[row as usize];
            if stopped.contains(&seq) {
                continue;
            }
            let seq_sampler = self
                .samplers
                .get_mut(&seq)
                .ok_or_else(|| format!("sequence {seq} has no sampler: StartSeq must come first"))?;
            let sampler = &mut seq_sampler.sampler;
            let (token, logprob, top) = if seq_sampler.logprobs {
                let sampled = sampler
                    .sample_with_logprobs(row_logits, seq_sampler.n_top)
                    .map_err(|e| e.to_string())?;
                (sampled.token, sampled.logprob, sampled.top)
            } else {
                (
                    sampler.sample(row_logits).map_err(|e| e.to_string())?,
                    f32::NAN,
                    Vec::new(),
                )
            };
            sampler.accept(token);
            tokens.push(SampledToken {
                seq,
                token,
                logprob,
                top,
            });
            // The sequence's next sampled row, if any, is its next drafted token.
            let next = sample_rows[i + 1..].iter().find(|&&r| seq_ids[r as usize] == seq);
            if let Some(&next) = next {
                let drafted = row_tokens.get(next as usize).ok_or_else(|| {
                    format!("sequence {seq} has several sampled rows but the batch carries no row tokens")
                })?;
                if *drafted != token {
                    stopped.push(seq);
                    self.stage.truncate_seq(seq, positions[next as usize] as usize);
                }
            }
        }
        Ok(tokens)
    }
}

/// Serves `worker` until `Shutdown` or a closed link: receive, handle, send on.
/// `Shutdown` is forwarded so every stage of the ring stops. A panic while handling a
/// message ends the loop with an error ([`NodeError::Stage`]) after passing a
/// `Message::Error` on, so the head fails what was in flight instead of waiting; the
/// stage's state is suspect after a panic, so it serves nothing more.
pub fn run(mut worker: StageWorker, rx: impl Rx, tx: impl Tx) -> Result<(), NodeError> {
    let span = tracing::debug_span!("stage", layers = ?worker.stage.span().layers);
    let _entered = span.enter();
    let first_layer = worker.stage.span().layers.start as u32;
    serve(|msg| worker.handle(msg), first_layer, rx, tx)
}

/// The loop of [`run`] over any handler.
fn serve(
    mut handle: impl FnMut(Message) -> Message,
    first_layer: u32,
    mut rx: impl Rx,
    mut tx: impl Tx,
) -> Result<(), NodeError> {
    loop {
        let msg = rx.recv()?;
        let stop = matches!(msg, Message::Shutdown);
        let kind = msg.kind();
        let out = match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| handle(msg))) {
            Ok(out) => out,
            Err(panic) => {
                let message = format!("the stage panicked handling {kind}: {}", panic_text(&panic));
                tracing::error!(first_layer, "{message}");
                let _ = tx.send(Message::Error {
                    first_layer,
                    message: message.clone(),
                });
                return Err(NodeError::Stage { first_layer, message });
            }
        };
        tx.send(out)?;
        if stop {
            return Ok(());
        }
    }
}

/// What a panic said, when it said it with a string.
fn panic_text(panic: &Box<dyn std::any::Any + Send>) -> &str {
    panic
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("(no message)")
}

#[cfg(test)]
mod tests {
    use baton_net::local_link;

    use super::*;

    /// Issue 16: a panic in a session's thread left the worker wedged. The stage loop
    /// turns it into an error for that session, and tells the next hop.
    #[test]
    fn a_panic_while_handling_a_message_ends_the_loop_with_an_error_passed_on() {
        let (mut to_stage, stage_rx) = local_link("stage");
        let (stage_tx, mut from_stage) = local_link("next");
        to_stage.send(Message::EndSeq { seq: 1 }).unwrap();
        to_stage.send(Message::EndSeq { seq: 2 }).unwrap();
        let handler = |msg: Message| match msg {
            Message::EndSeq { seq: 2 } => panic!("seq 2 broke the stage"),
            other => other,
        };
        let result = serve(handler, 12, stage_rx, stage_tx);
        let Err(NodeError::Stage { first_layer, message }) = result else {
            panic!("{result:?}")
        };
        assert_eq!(first_layer, 12);
        assert_eq!(message, "the stage panicked handling EndSeq: seq 2 broke the stage");
        assert_eq!(from_stage.recv().unwrap(), Message::EndSeq { seq: 1 });
        assert_eq!(
            from_stage.recv().unwrap(),
            Message::Error {
                first_layer: 12,
                message: message.clone()
            }
        );
    }
}
