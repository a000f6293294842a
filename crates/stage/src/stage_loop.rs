//! The stage side of the ring: apply each message to the local stage and pass the
//! result on. The logic is in [`StageWorker::handle`], which does no I/O; [`run`]
//! drives it over any transport.

use std::collections::HashMap;
use std::sync::Arc;

use baton_grammar::{Grammar, GrammarError, Matcher, TokenTable};
use baton_model::{one_row_per_sequence, Batch, LogitReply, ModelError, RowBest, StageChain, StageInput, StageOutput};
use baton_net::{Rx, Tx};
use baton_proto::{Conversation, Fault, Forward, Message, Payload, Pooling, Ring, SampledToken, StartSeq};
use baton_sample::{utf8_complete, BudgetTracker, Sampler, SamplingError};

use crate::max_decode_rows;
use crate::NodeError;

/// A stage (or a chain of stages on several devices) plus, on the last stage, one
/// sampler per live sequence.
pub struct StageWorker {
    stage: StageChain,
    samplers: HashMap<u32, SeqSampler>,
    /// On the last stage, the sequences that pool their rows (embeddings).
    pools: HashMap<u32, SeqPool>,
    wire_f16: bool,
    /// The vocabulary as grammars see it, read from the model file the first time a
    /// sequence brings a grammar.
    tokens: Option<Arc<TokenTable>>,
    /// Time spent computing, and token rows computed (for `Stats`).
    busy: std::time::Duration,
    rows: u64,
    /// Why the stage cannot compute any more: its tensor-parallel group lost a member
    /// or fell out of step. [`run`] then ends the loop instead of answering, so the
    /// ring breaks and its head forms a new one (or reports it).
    broken: Option<String>,
}

/// A sequence's sampler and whether it wants log-probabilities.
struct SeqSampler {
    sampler: Sampler,
    logprobs: bool,
    /// Alternatives to report with each token.
    n_top: usize,
    /// Where the sequence is in its grammar, if it has one.
    grammar: Option<Matcher>,
    /// Scratch for grammar masks.
    allowed: Vec<bool>,
    masked: Vec<f32>,
    /// The sequence's thinking budget, if it has one.
    budget: Option<BudgetTracker>,
    /// Scratch for the row its budget forces a token in.
    forced: Vec<f32>,
}

impl StageWorker {
    /// Wraps `stage`: a stage, member 0 of a tensor-parallel group leading the
    /// others, or stages on several devices that compute one layer range together.
    pub fn new(stage: impl Into<StageChain>) -> StageWorker {
        StageWorker {
            stage: stage.into(),
            samplers: HashMap::new(),
            pools: HashMap::new(),
            wire_f16: false,
            tokens: None,
            busy: std::time::Duration::ZERO,
            rows: 0,
            broken: None,
        }
    }

    /// Sends hidden states on as f16 (half the bytes; the next stage widens them back).
    pub fn with_wire_f16(mut self, wire_f16: bool) -> StageWorker {
        self.wire_f16 = wire_f16;
        self
    }

    /// The stage (or stages).
    pub fn stage(&self) -> &StageChain {
        &self.stage
    }

    /// Handles one message; returns what goes to the next hop (the next stage, or the
    /// head after the last stage). Errors become a ring `Error` so the ring never
    /// stalls on a bad message.
    pub fn handle(&mut self, msg: Ring) -> Ring {
        let last = self.stage.span().last;
        let reply = match msg {
            Ring::StartSeq(start) => {
                if let Err(e) = self.start_seq(&start) {
                    return self.error(e);
                }
                Ring::StartSeq(start)
            }
            Ring::TruncateSeq { seq, len } => {
                self.stage.truncate_seq(seq, len as usize);
                if let Some(pool) = self.pools.get_mut(&seq) {
                    pool.truncate(len as usize, self.stage.file().hparams().n_embd);
                }
                Ring::TruncateSeq { seq, len }
            }
            Ring::Checkpoint { seq, len } => {
                if let Err(e) = self.stage.checkpoint_seq(seq, len as usize) {
                    return self.error(StageError::Model(e));
                }
                Ring::Checkpoint { seq, len }
            }
            Ring::EndSeq { seq } => {
                self.stage.clear_seq(seq);
                self.samplers.remove(&seq);
                self.pools.remove(&seq);
                Ring::EndSeq { seq }
            }
            Ring::Forward(forward) => {
                let span = tracing::debug_span!("step", step = forward.step, rows = forward.positions.len());
                let _entered = span.enter();
                let started = std::time::Instant::now();
                let rows = forward.positions.len() as u64;
                let reply = match self.forward(forward) {
                    Ok(msg) => msg,
                    Err(e) => self.error(e),
                };
                self.busy += started.elapsed();
                self.rows += rows;
                tracing::debug!(ms = started.elapsed().as_secs_f64() * 1e3, "computed");
                return reply;
            }
            Ring::Stats(mut stats) => {
                stats.resident.push(self.stage.resident_bytes());
                stats.kv_used.push(self.stage.kv_used() as u32);
                stats.busy_us.push(self.busy.as_micros() as u64);
                stats.rows.push(self.rows);
                // `run` appends the link's figures: only it holds the link.
                return Ring::Stats(stats);
            }
            // Replies and errors from upstream pass through untouched.
            other @ (Ring::Sampled { .. } | Ring::Pooled { .. } | Ring::Done | Ring::Error { .. } | Ring::Shutdown) => {
                return other
            }
            Ring::JoinRing { .. } => return self.error(StageError::Protocol("JoinRing only opens a ring link".into())),
        };
        if last {
            Ring::Done
        } else {
            reply
        }
    }

    /// Starts (or restarts) a sequence: keeps `keep` cached tokens and, on the last stage,
    /// makes its pool or its sampler (seeded with its history, past the draws it made,
    /// with its grammar).
    fn start_seq(&mut self, start: &StartSeq) -> Result<(), StageError> {
        let StartSeq {
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
            ..
        } = start;
        let (seq, keep) = (*seq, *keep);
        self.stage.truncate_seq(seq, keep as usize);
        self.pools.remove(&seq);
        if !self.stage.span().last {
            return Ok(());
        }
        if let Some(pooling) = pooling {
            self.samplers.remove(&seq);
            if keep > 0 {
                let why = format!("pooled sequence {seq} must start from an empty cache, not {keep} tokens");
                return Err(StageError::Protocol(why));
            }
            self.pools.insert(seq, SeqPool::new(*pooling));
            return Ok(());
        }
        let generated = &history[history.len().saturating_sub(*drawn as usize)..];
        let matcher = match grammar.as_deref().map(|g| self.matcher(g, generated)).transpose() {
            Ok(matcher) => matcher,
            Err(e) => {
                self.samplers.remove(&seq);
                return Err(e);
            }
        };
        let mut sampler = Sampler::new(params.clone()).map_err(StageError::Sampling)?;
        history.iter().for_each(|&t| sampler.accept(t));
        sampler.skip_draws(*drawn);
        let budget = match budget {
            Some(budget) => {
                let tokens = self.tokens()?;
                let mut tracker = BudgetTracker::new((**budget).clone());
                for &token in generated {
                    tracker.accept(token, complete(Some(&tokens), token));
                }
                Some(tracker)
            }
            None => None,
        };
        let n_top = if *logprobs { *top_logprobs as usize } else { 0 };
        self.samplers.insert(
            seq,
            SeqSampler {
                sampler,
                logprobs: *logprobs,
                n_top,
                grammar: matcher,
                allowed: Vec::new(),
                masked: Vec::new(),
                budget,
                forced: Vec::new(),
            },
        );
        Ok(())
    }

    /// A matcher for `gbnf`, advanced past the tokens the sequence already generated.
    fn matcher(&mut self, gbnf: &str, generated: &[u32]) -> Result<Matcher, StageError> {
        let grammar = Grammar::parse(gbnf)?;
        let tokens = self.tokens()?;
        let mut matcher = Matcher::new(Arc::new(grammar))?;
        for &token in generated {
            matcher.accept(token, &tokens).map_err(StageError::Replay)?;
        }
        Ok(matcher)
    }

    /// The vocabulary for grammars: libllama's, from the stage's own model file, so
    /// that token texts are exactly the ones the head detokenizes.
    fn tokens(&mut self) -> Result<Arc<TokenTable>, StageError> {
        if let Some(tokens) = &self.tokens {
            return Ok(tokens.clone());
        }
        let path = self.stage.file().path().to_path_buf();
        let started = std::time::Instant::now();
        let vocab = baton_ggml::LlamaModel::load_vocab(&path).map_err(|e| StageError::Vocabulary(e.to_string()))?;
        let tokens = Arc::new(TokenTable::new(
            (0..vocab.n_vocab() as u32).map(|t| (vocab.token_bytes(t, false), vocab.is_end_of_generation(t))),
        ));
        tracing::debug!(
            ms = started.elapsed().as_secs_f64() * 1e3,
            "vocabulary read for grammars"
        );
        self.tokens = Some(tokens.clone());
        Ok(tokens)
    }

    fn error(&self, e: StageError) -> Ring {
        Ring::Error {
            first_layer: self.stage.span().layers.start as u32,
            fault: e.fault(),
            message: e.to_string(),
        }
    }

    fn forward(&mut self, forward: Forward) -> Result<Ring, StageError> {
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
        if self.stage.span().last && seq_ids.iter().any(|seq| self.pools.contains_key(seq)) {
            return self.pool(step, input, &positions, &seq_ids, &sample_rows);
        }
        let reply = match self.best_only(&seq_ids, &sample_rows) {
            true => LogitReply::Best,
            false => LogitReply::Logits,
        };
        match self.compute(input, &positions, &seq_ids, &sample_rows, reply)? {
            StageOutput::Hidden(hidden) => Ok(Ring::Forward(Forward {
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
                let tokens = self.sample(&positions, &seq_ids, &sample_rows, &row_tokens, Rows::Logits(&logits))?;
                Ok(Ring::Sampled { step, tokens })
            }
            StageOutput::Best(best) => {
                let best = RowBest::tokens(&best).map_err(|e| self.failed(e))?;
                let tokens = self.sample(&positions, &seq_ids, &sample_rows, &row_tokens, Rows::Best(&best))?;
                Ok(Ring::Sampled { step, tokens })
            }
            StageOutput::Normed(_) => Err(StageError::Protocol("normed rows where logits were asked for".into())),
        }
    }

    /// A batch of a pooled sequence on the last stage: a chunk of its rows, computed
    /// whole as the head cut it, each row after the output norm kept; the chunk that
    /// samples the sequence's last row ends it, and is answered with the pooled vector,
    /// L2-normalized. A batch must hold that one sequence only (the head sends a
    /// prompt's chunks alone), in order.
    fn pool(
        &mut self,
        step: u64,
        input: StageInput<'_>,
        positions: &[i32],
        seq_ids: &[u32],
        sample_rows: &[u32],
    ) -> Result<Ring, StageError> {
        let seq = seq_ids[0];
        if seq_ids.iter().any(|&s| s != seq) {
            return Err(StageError::Protocol(format!(
                "a batch holds pooled sequence {seq} and others"
            )));
        }
        let n_embd = self.stage.file().hparams().n_embd;
        let pool = self.pools.get(&seq).expect("the caller found the sequence's pool");
        let at = pool.n_rows;
        if positions.iter().enumerate().any(|(i, &p)| p as usize != at + i) {
            return Err(StageError::Protocol(format!(
                "pooled sequence {seq} holds {at} rows; the batch's positions do not continue it"
            )));
        }
        let ends = match sample_rows {
            [] => false,
            [row] if *row as usize + 1 == positions.len() => true,
            _ => {
                return Err(StageError::Protocol(format!(
                    "pooled sequence {seq} samples only its last row"
                )))
            }
        };
        let rows: Vec<u32> = (0..positions.len() as u32).collect();
        let batch = Batch {
            input,
            positions,
            seq_ids,
            logit_rows: &rows,
            decode: false,
        };
        let normed = match self.run(&batch, LogitReply::Normed)? {
            StageOutput::Normed(normed) if normed.len() == rows.len() * n_embd => normed,
            _ => return Err(StageError::Protocol("the stage did not answer with normed rows".into())),
        };
        let pool = self.pools.get_mut(&seq).expect("checked above");
        pool.add(&normed, n_embd);
        if !ends {
            return Ok(Ring::Sampled {
                step,
                tokens: Vec::new(),
            });
        }
        let pool = self.pools.remove(&seq).expect("checked above");
        let pooled = match pool.pooling {
            Pooling::Mean => baton_model::mean_rows(&pool.rows, n_embd, POOL_THREADS)?,
            Pooling::Cls | Pooling::Last if pool.rows.len() == n_embd => pool.rows,
            Pooling::Cls | Pooling::Last => {
                return Err(StageError::Protocol(format!(
                    "pooled sequence {seq} lost its first row (cut back to none, then continued)"
                )))
            }
        };
        let values = normalize(&pooled);
        if values.iter().any(|x| !x.is_finite()) {
            return Err(StageError::Model(ModelError::BadBatch(format!(
                "the pooled vector of sequence {seq} is not finite"
            ))));
        }
        Ok(Ring::Pooled { step, seq, values })
    }

    /// Whether every sampled row is a plain arg-max (greedy, no penalties, no
    /// log-probabilities, no grammar) on a last stage whose tensor-parallel group can
    /// then send member 0 each row's best instead of its share of the logits.
    fn best_only(&self, seq_ids: &[u32], sample_rows: &[u32]) -> bool {
        self.stage.span().last
            && self.stage.last_tp_size() > 1
            && !sample_rows.is_empty()
            && sample_rows.iter().all(|&row| {
                let sampler = seq_ids.get(row as usize).and_then(|seq| self.samplers.get(seq));
                sampler.is_some_and(|s| {
                    s.sampler.params().is_plain_argmax() && !s.logprobs && s.grammar.is_none() && s.budget.is_none()
                })
            })
    }

    /// Runs the batch through the stage. A batch whose every row is sampled is decode
    /// rows (single tokens, or a token and its drafts). Stages on the CPU compute it
    /// whole, each product cutting the rows as its kernels need (`Builder::mm`), so a
    /// drafted token's row gives the bits a one-token step would have; a
    /// tensor-parallel group does so for one row per sequence only (its members take
    /// their pieces from the sequences they see). Otherwise it is computed in pieces of
    /// at most [`max_decode_rows`] rows, each of which ggml computes exactly as one row
    /// alone. Prompt chunks are computed whole, as cut. With [`LogitReply::Best`] the
    /// sampled rows come back as their bests.
    fn compute(
        &mut self,
        input: StageInput<'_>,
        positions: &[i32],
        seq_ids: &[u32],
        sample_rows: &[u32],
        reply: LogitReply,
    ) -> Result<StageOutput, StageError> {
        let last = self.stage.span().last;
        let n = positions.len();
        let cap = max_decode_rows(self.stage.repacked());
        let all_sampled = sample_rows.len() == n && sample_rows.iter().enumerate().all(|(i, &r)| r as usize == i);
        // Only decode rows are checked: a prompt chunk of hundreds of rows skips the sort.
        let whole_decode = all_sampled
            && self.stage.whole_decode_batches()
            && (!self.stage.tensor_parallel() || one_row_per_sequence(seq_ids));
        if !all_sampled || n <= cap || whole_decode {
            let batch = Batch {
                input,
                positions,
                seq_ids,
                logit_rows: if last { sample_rows } else { &[] },
                decode: whole_decode,
            };
            return self.run(&batch, reply);
        }
        let width = match input {
            StageInput::Tokens(_) => 1,
            StageInput::Hidden(hidden) => hidden.len() / n,
        };
        let (mut values, mut best) = (Vec::new(), Vec::new());
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
                decode: false,
            };
            match self.run(&batch, reply) {
                Ok(StageOutput::Hidden(h) | StageOutput::Logits(h) | StageOutput::Normed(h)) => {
                    values.extend_from_slice(&h)
                }
                Ok(StageOutput::Best(rows)) => best.extend_from_slice(&rows),
                Err(e) => {
                    // Rows already computed hold cells: forget them with the failure.
                    for (&seq, &pos) in seq_ids[..start].iter().zip(&positions[..start]) {
                        self.stage.truncate_seq(seq, pos as usize);
                    }
                    return Err(e);
                }
            }
        }
        Ok(match (reply, last) {
            (LogitReply::Best, true) => StageOutput::Best(best),
            (LogitReply::Logits, true) => StageOutput::Logits(values),
            (LogitReply::Normed, true) => StageOutput::Normed(values),
            (_, false) => StageOutput::Hidden(values),
        })
    }

    /// One batch through the stage, its logit rows answered as `reply` asks.
    fn run(&mut self, batch: &Batch<'_>, reply: LogitReply) -> Result<StageOutput, StageError> {
        self.stage.forward(batch, reply).map_err(|e| self.failed(e))
    }

    /// A failed computation; a failed exchange of a tensor-parallel group also marks
    /// the stage broken (the members' exchanges are out of step for good).
    fn failed(&mut self, e: ModelError) -> StageError {
        if matches!(e, ModelError::Collective(_)) {
            self.broken.get_or_insert_with(|| e.to_string());
        }
        StageError::Model(e)
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
        rows: Rows<'_>,
    ) -> Result<Vec<SampledToken>, StageError> {
        if sample_rows.is_empty() {
            return Ok(Vec::new());
        }
        let n_vocab = rows.len() / sample_rows.len();
        let whole = match rows {
            Rows::Logits(_) => n_vocab > 0,
            Rows::Best(best) => best.len() == sample_rows.len(),
        };
        if !whole {
            let why = format!("{} values for {} sampled rows", rows.len(), sample_rows.len());
            return Err(StageError::Protocol(why));
        }
        let mut tokens = Vec::with_capacity(sample_rows.len());
        // Sequences whose draft was rejected: their later rows are not sampled.
        let mut stopped: Vec<u32> = Vec::new();
        for (i, &row) in sample_rows.iter().enumerate() {
            let seq = seq_ids[row as usize];
            if stopped.contains(&seq) {
                continue;
            }
            let seq_sampler = self.samplers.get_mut(&seq).ok_or_else(|| {
                StageError::Protocol(format!("sequence {seq} has no sampler: StartSeq must come first"))
            })?;
            let (token, logprob, top) = match rows {
                Rows::Logits(logits) => {
                    seq_sampler.sample(&logits[i * n_vocab..(i + 1) * n_vocab], self.tokens.as_deref())?
                }
                // The row's arg-max, which a plain greedy sampler takes (`best_only`).
                Rows::Best(best) => (best[i], f32::NAN, Vec::new()),
            };
            seq_sampler.sampler.accept(token);
            if let Some(budget) = seq_sampler.budget.as_mut() {
                budget.accept(token, complete(self.tokens.as_deref(), token));
            }
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
                    StageError::Protocol(format!(
                        "sequence {seq} has several sampled rows but the batch carries no row tokens"
                    ))
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

/// Why a stage could not handle a message. The head gets its [`Fault`] (what kind of
/// failure, for programs) and its text (for people) in a ring `Error`.
#[derive(Debug, thiserror::Error)]
pub enum StageError {
    /// The computation failed, or the KV cache had no room for the batch.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// The request's grammar cannot be used.
    #[error(transparent)]
    Grammar(#[from] GrammarError),
    /// The request's grammar refuses a token its sequence already generated.
    #[error("replaying the sequence's tokens: {0}")]
    Replay(GrammarError),
    /// The request's grammar allows no token at this point.
    #[error("the grammar allows no token here")]
    DeadEnd,
    /// The request's sampling parameters or the row's logits cannot be sampled.
    #[error(transparent)]
    Sampling(#[from] SamplingError),
    /// The vocabulary for grammars could not be read from the stage's own model file.
    #[error("loading the vocabulary for a grammar: {0}")]
    Vocabulary(String),
    /// The message broke the ring's protocol.
    #[error("{0}")]
    Protocol(String),
}

impl StageError {
    /// What kind of failure this is, for the head.
    pub fn fault(&self) -> Fault {
        match self {
            StageError::Model(ModelError::CacheFull { .. }) => Fault::CacheFull,
            StageError::Model(ModelError::BadBatch(_)) | StageError::Protocol(_) => Fault::Protocol,
            StageError::Model(ModelError::Unsupported(_)) => Fault::Request,
            StageError::Model(_) | StageError::Vocabulary(_) => Fault::Compute,
            StageError::Grammar(_) | StageError::Replay(_) | StageError::DeadEnd | StageError::Sampling(_) => {
                Fault::Request
            }
        }
    }
}

/// Threads for a pooled mean (one dot product per value: its bits do not depend on them).
const POOL_THREADS: usize = 2;

/// A pooled sequence on the last stage: how it pools, how many rows it has had, and the
/// rows it needs (after the output norm, `n_embd` each): every one for the mean (computed
/// once over all of them, as libllama computes it: `n_embd` × 4 bytes per token held
/// until the vector is sent), the first for cls, the latest chunk's last for last.
struct SeqPool {
    pooling: Pooling,
    n_rows: usize,
    rows: Vec<f32>,
}

impl SeqPool {
    fn new(pooling: Pooling) -> SeqPool {
        SeqPool {
            pooling,
            n_rows: 0,
            rows: Vec::new(),
        }
    }

    /// Takes the next chunk's rows.
    fn add(&mut self, normed: &[f32], n_embd: usize) {
        match self.pooling {
            Pooling::Mean => self.rows.extend_from_slice(normed),
            Pooling::Cls if self.n_rows == 0 => self.rows = normed[..n_embd].to_vec(),
            Pooling::Cls => {}
            Pooling::Last => self.rows = normed[normed.len() - n_embd..].to_vec(),
        }
        self.n_rows += normed.len() / n_embd.max(1);
    }

    /// Keeps the first `len` rows (the last row is the next chunk's).
    fn truncate(&mut self, len: usize, n_embd: usize) {
        if len >= self.n_rows {
            return;
        }
        self.n_rows = len;
        match self.pooling {
            Pooling::Mean => self.rows.truncate(len.saturating_mul(n_embd)),
            Pooling::Cls if len > 0 => {}
            Pooling::Cls | Pooling::Last => self.rows.clear(),
        }
    }
}

/// `values` scaled to unit Euclidean length, exactly as llama.cpp's
/// `common_embd_normalize(.., 2)` (llama-server's default): squares summed in f64, each
/// value times the f32 reciprocal of the norm; a zero vector stays zero.
pub fn normalize(values: &[f32]) -> Vec<f32> {
    let sum: f64 = values.iter().map(|&x| f64::from(x * x)).sum::<f64>().sqrt();
    let norm = if sum > 0.0 { (1.0 / sum) as f32 } else { 0.0 };
    values.iter().map(|&x| x * norm).collect()
}

/// The sampled rows: their logits, `n_vocab` each, or their arg-max tokens.
#[derive(Clone, Copy)]
enum Rows<'a> {
    Logits(&'a [f32]),
    Best(&'a [u32]),
}

impl Rows<'_> {
    fn len(&self) -> usize {
        match self {
            Rows::Logits(logits) => logits.len(),
            Rows::Best(best) => best.len(),
        }
    }
}

/// Whether `token`'s text ends on a whole character (a thinking budget waits for one;
/// the vocabulary is read when a sequence with a budget starts).
fn complete(tokens: Option<&TokenTable>, token: u32) -> bool {
    tokens.and_then(|t| t.bytes(token)).is_none_or(utf8_complete)
}

impl SeqSampler {
    /// The next token from one row of logits: within the grammar, if the sequence has
    /// one. Greedy without log-probabilities first tries the unconstrained choice (the
    /// arg-max of the masked row whenever the grammar allows it, as it usually does), so
    /// the mask over the whole vocabulary is computed only when that fails.
    fn sample(&mut self, logits: &[f32], tokens: Option<&TokenTable>) -> Result<Drawn, StageError> {
        // The thinking budget masks first, as llama.cpp applies it before the chain.
        let logits = match &self.budget {
            Some(budget) if budget.forced().is_some() => {
                self.forced.clear();
                self.forced.extend_from_slice(logits);
                budget.mask(&mut self.forced);
                &self.forced[..]
            }
            _ => logits,
        };
        let Some(matcher) = self.grammar.as_mut() else {
            return Ok(draw(&mut self.sampler, logits, self.logprobs, self.n_top)?);
        };
        let tokens = tokens.ok_or_else(|| StageError::Vocabulary("a grammar without a vocabulary".into()))?;
        if self.sampler.params().is_greedy() && !self.logprobs {
            let token = self.sampler.sample(logits)?;
            if matcher.allows(token, tokens) {
                matcher.accept(token, tokens)?;
                return Ok((token, f32::NAN, Vec::new()));
            }
        }
        matcher.fill_allowed(tokens, &mut self.allowed)?;
        if !self.allowed.iter().any(|&a| a) {
            return Err(StageError::DeadEnd);
        }
        self.masked.clear();
        self.masked.extend(logits.iter().enumerate().map(|(token, &logit)| {
            if self.allowed.get(token).copied().unwrap_or(false) {
                logit
            } else {
                f32::NEG_INFINITY
            }
        }));
        let sampled = draw(&mut self.sampler, &self.masked, self.logprobs, self.n_top)?;
        matcher.accept(sampled.0, tokens)?;
        Ok(sampled)
    }
}

/// A sampled token, its log-probability and the best alternatives.
type Drawn = (u32, f32, Vec<(u32, f32)>);

/// One draw from `logits`, with log-probabilities when asked.
fn draw(sampler: &mut Sampler, logits: &[f32], logprobs: bool, n_top: usize) -> Result<Drawn, SamplingError> {
    if logprobs {
        let sampled = sampler.sample_with_logprobs(logits, n_top)?;
        Ok((sampled.token, sampled.logprob, sampled.top))
    } else {
        Ok((sampler.sample(logits)?, f32::NAN, Vec::new()))
    }
}

/// Serves `worker` until `Shutdown` or a closed link: receive, handle, send on.
/// `Shutdown` is forwarded so every stage of the ring stops. A panic while handling a
/// message ends the loop with an error ([`NodeError::Stage`]) after passing a
/// ring `Error` on, so the head fails what was in flight instead of waiting; the
/// stage's state is suspect after a panic, so it serves nothing more. A stage whose
/// tensor-parallel group broke ends the loop with an error and sends nothing more: its
/// links close, the ring is lost, and a supervised head forms a new one and rebuilds
/// the requests in flight on it (an `Error` would fail them instead).
pub fn run(mut worker: StageWorker, rx: impl Rx, tx: impl Tx) -> Result<(), NodeError> {
    let span = tracing::debug_span!("stage", layers = ?worker.stage.span().layers);
    let _entered = span.enter();
    let first_layer = worker.stage.span().layers.start as u32;
    let handle = |msg| {
        let out = worker.handle(msg);
        match worker.broken.take() {
            Some(message) => Err(NodeError::Stage {
                first_layer,
                fault: Fault::Compute,
                message,
            }),
            None => Ok(out),
        }
    };
    serve(handle, first_layer, rx, tx)
}

/// The loop of [`run`] over any handler; an `Err` from the handler ends it at once. A
/// frame of another conversation than the ring's is answered with a protocol `Error`
/// (the ring never stalls on a bad message).
fn serve(
    mut handle: impl FnMut(Ring) -> Result<Ring, NodeError>,
    first_layer: u32,
    mut rx: impl Rx,
    mut tx: impl Tx,
) -> Result<(), NodeError> {
    loop {
        let msg = match Ring::try_from(rx.recv()?) {
            Ok(msg) => msg,
            Err(wrong) => {
                let message = format!("{} is not a ring message", wrong.message.kind());
                tx.send(Message::Error {
                    first_layer,
                    fault: Fault::Protocol,
                    message,
                })?;
                continue;
            }
        };
        let stop = matches!(msg, Ring::Shutdown);
        let kind = msg.kind();
        let mut out = match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| handle(msg))) {
            Ok(Ok(out)) => out,
            Ok(Err(e)) => {
                tracing::warn!(first_layer, "the stage stops: {e}");
                return Err(e);
            }
            Err(panic) => {
                let message = format!("the stage panicked handling {kind}: {}", panic_text(&panic));
                tracing::error!(first_layer, "{message}");
                let _ = tx.send(Message::Error {
                    first_layer,
                    fault: Fault::Compute,
                    message: message.clone(),
                });
                return Err(NodeError::Stage {
                    first_layer,
                    fault: Fault::Compute,
                    message,
                });
            }
        };
        if let Ring::Stats(stats) = &mut out {
            let counters = tx.counters();
            stats.link_sent.push(counters.sent());
            stats.link_rtt_us.push(counters.round_trip_us());
        }
        tx.send(out.into())?;
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
mod tests;
