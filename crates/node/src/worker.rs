//! The stage side of the ring: apply each message to the local stage and pass the
//! result on. The logic is in [`StageWorker::handle`], which does no I/O; [`run`]
//! drives it over any transport.

use std::collections::HashMap;

use baton_model::{Batch, Stage, StageInput, StageOutput};
use baton_net::{NetError, Rx, Tx};
use baton_proto::{Forward, Message, Payload, SampledToken};
use baton_sample::Sampler;

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
                self.stage.kv_mut().truncate_seq(seq, keep as usize);
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
                self.stage.kv_mut().truncate_seq(seq, len as usize);
                Message::TruncateSeq { seq, len }
            }
            Message::EndSeq { seq } => {
                self.stage.kv_mut().clear_seq(seq);
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
        let last = self.stage.span().last;
        let logit_rows: &[u32] = if last { &sample_rows } else { &[] };
        let batch = Batch {
            input,
            positions: &positions,
            seq_ids: &seq_ids,
            logit_rows,
        };
        match self.stage.forward(&batch).map_err(|e| e.to_string())? {
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
            })),
            StageOutput::Logits(logits) => {
                let n_vocab = if sample_rows.is_empty() {
                    1
                } else {
                    logits.len() / sample_rows.len()
                };
                let mut tokens = Vec::with_capacity(sample_rows.len());
                for (&row, row_logits) in sample_rows.iter().zip(logits.chunks_exact(n_vocab)) {
                    let seq = seq_ids[row as usize];
                    let seq_sampler = self
                        .samplers
                        .get_mut(&seq)
                        .ok_or_else(|| format!("sequence {seq} has no sampler: StartSeq must come first"))?;
                    let sampler = &mut seq_sampler.sampler;
                    let (token, logprob, top) = if seq_sampler.logprobs {
                        let n_top = seq_sampler.n_top;
                        let sampled = sampler
                            .sample_with_logprobs(row_logits, n_top)
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
                }
                Ok(Message::Sampled { step, tokens })
            }
        }
    }
}

/// Serves `worker` until `Shutdown` or a closed link: receive, handle, send on.
/// `Shutdown` is forwarded so every stage of the ring stops.
pub fn run(mut worker: StageWorker, mut rx: impl Rx, mut tx: impl Tx) -> Result<(), NetError> {
    let span = tracing::debug_span!("stage", layers = ?worker.stage.span().layers);
    let _entered = span.enter();
    loop {
        let msg = rx.recv()?;
        let stop = matches!(msg, Message::Shutdown);
        let out = worker.handle(msg);
        tx.send(out)?;
        if stop {
            return Ok(());
        }
    }
}
