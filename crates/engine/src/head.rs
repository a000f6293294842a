//! The head side of the ring: it feeds the first stage and hears back from the last.

use std::time::{Duration, Instant};

use baton_net::{Rx, RxExt, Tx};
use baton_proto::{Conversation, Forward, Payload, Ring, SampledToken, StartSeq, Stats, StepId};
use baton_sample::SamplingParams;

use baton_stage::NodeError;

/// The head's two ends of a ring: where it sends to the first stage and where it hears
/// from the last. Whoever holds them drives the ring: a [`Head`] one request at a time,
/// or the engine with many steps in flight.
pub struct RingEnds {
    /// Into the first stage.
    pub tx: Box<dyn Tx>,
    /// From the last stage.
    pub rx: Box<dyn Rx>,
}

/// Drives a ring one message at a time: a request, then its reply.
pub struct Head {
    tx: Box<dyn Tx>,
    rx: Box<dyn Rx>,
    next_step: StepId,
}

/// One finished generation.
#[derive(Clone, Debug)]
pub struct Generation {
    /// Generated token ids (the end-of-generation token excluded).
    pub tokens: Vec<u32>,
    /// Log-probability of each generated token (NaN unless asked for).
    pub logprobs: Vec<f32>,
    /// Whether generation stopped at an end-of-generation token (else at the limit).
    pub stopped: bool,
    /// Time to process the prompt and sample the first token.
    pub prompt_time: Duration,
    /// Time for the remaining tokens.
    pub gen_time: Duration,
}

/// What one generation asks for.
#[derive(Clone, Debug)]
pub struct GenerateRequest<'a> {
    /// Sequence slot to use.
    pub seq: u32,
    /// Prompt tokens.
    pub prompt: &'a [u32],
    /// Sampler settings.
    pub params: SamplingParams,
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// Most prompt tokens per forward step.
    pub n_batch: usize,
    /// Whether to compute log-probabilities.
    pub logprobs: bool,
}

impl Head {
    /// A head driving the ring whose ends are `ends`.
    pub fn new(ends: RingEnds) -> Head {
        Head {
            tx: ends.tx,
            rx: ends.rx,
            next_step: 0,
        }
    }

    /// Sends a control message around the ring and waits for the last stage's `Done`.
    pub fn control(&mut self, msg: Ring) -> Result<(), NodeError> {
        self.tx.send(msg.into())?;
        match self.rx.recv_as::<Ring>()? {
            Ring::Done => Ok(()),
            other => Err(unexpected(other)),
        }
    }

    /// Sends one batch and waits for the tokens sampled for its `sample_rows`.
    pub fn forward(
        &mut self,
        payload: Payload,
        positions: Vec<i32>,
        seq_ids: Vec<u32>,
        sample_rows: Vec<u32>,
    ) -> Result<Vec<SampledToken>, NodeError> {
        let step = self.next_step;
        self.next_step += 1;
        self.tx.send(
            Ring::Forward(Forward {
                step,
                payload,
                positions,
                seq_ids,
                sample_rows,
                row_tokens: vec![],
            })
            .into(),
        )?;
        match self.rx.recv_as::<Ring>()? {
            Ring::Sampled { step: got, tokens } if got == step => Ok(tokens),
            other => Err(unexpected(other)),
        }
    }

    /// Runs one sequence: the prompt in chunks of `n_batch` (only the last chunk is
    /// sampled), then one token per step until `is_end(token)` or `max_tokens`.
    /// `on_token` sees each token as it arrives.
    pub fn generate(
        &mut self,
        req: &GenerateRequest<'_>,
        is_end: impl Fn(u32) -> bool,
        mut on_token: impl FnMut(u32),
    ) -> Result<Generation, NodeError> {
        if req.prompt.is_empty() {
            return Err(NodeError::Request("the prompt is empty".into()));
        }
        let seq = req.seq;
        let start = Instant::now();
        self.control(
            StartSeq::new(seq, req.params.clone(), req.prompt.to_vec())
                .with_logprobs(req.logprobs, 0)
                .into(),
        )?;
        let n_batch = req.n_batch.max(1);
        let mut sampled = Vec::new();
        let chunks = req.prompt.chunks(n_batch);
        let n_chunks = chunks.len();
        for (i, chunk) in chunks.enumerate() {
            let first_pos = i * n_batch;
            let positions = (first_pos..first_pos + chunk.len()).map(|p| p as i32).collect();
            let rows = if i + 1 == n_chunks {
                vec![chunk.len() as u32 - 1]
            } else {
                Vec::new()
            };
            sampled = self.forward(Payload::Tokens(chunk.to_vec()), positions, vec![seq; chunk.len()], rows)?;
        }
        let prompt_time = start.elapsed();
        let gen_start = Instant::now();

        let mut out = Generation {
            tokens: Vec::new(),
            logprobs: Vec::new(),
            stopped: false,
            prompt_time,
            gen_time: Duration::ZERO,
        };
        let mut pos = req.prompt.len();
        while out.tokens.len() < req.max_tokens {
            let Some(next) = sampled.first().cloned() else {
                return Err(NodeError::Request("the last stage sampled no token".into()));
            };
            if is_end(next.token) {
                out.stopped = true;
                break;
            }
            on_token(next.token);
            out.tokens.push(next.token);
            out.logprobs.push(next.logprob);
            if out.tokens.len() == req.max_tokens {
                break;
            }
            sampled = self.forward(Payload::Tokens(vec![next.token]), vec![pos as i32], vec![seq], vec![0])?;
            pos += 1;
        }
        out.gen_time = gen_start.elapsed();
        self.control(Ring::EndSeq { seq })?;
        Ok(out)
    }

    /// Resident bytes of each stage, in ring order.
    pub fn resident_bytes(&mut self) -> Result<Vec<u64>, NodeError> {
        Ok(self.stats()?.0)
    }

    /// Resident bytes and KV cache cells in use of each stage, in ring order.
    pub fn stats(&mut self) -> Result<(Vec<u64>, Vec<u32>), NodeError> {
        self.tx.send(Ring::Stats(Stats::default()).into())?;
        match self.rx.recv_as::<Ring>()? {
            Ring::Stats(stats) => Ok((stats.resident, stats.kv_used)),
            other => Err(unexpected(other)),
        }
    }

    /// The ring's ends, for a driver that keeps several steps in flight.
    pub fn into_ends(self) -> RingEnds {
        RingEnds {
            tx: self.tx,
            rx: self.rx,
        }
    }

    /// Stops every stage of the ring.
    pub fn shutdown(&mut self) -> Result<(), NodeError> {
        self.tx.send(Ring::Shutdown.into())?;
        match self.rx.recv_as::<Ring>()? {
            Ring::Shutdown => Ok(()),
            other => Err(unexpected(other)),
        }
    }
}

fn unexpected(msg: Ring) -> NodeError {
    match msg {
        Ring::Error {
            first_layer,
            fault,
            message,
        } => NodeError::Stage {
            first_layer,
            fault,
            message,
        },
        other => NodeError::Protocol(format!("unexpected reply {}", other.kind())),
    }
}
