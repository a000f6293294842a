//! A stage: a contiguous layer range of one model on one ggml device, with its own
//! KV cache. The first stage embeds tokens; the last produces logits.

use std::sync::{Arc, Mutex};

use baton_ggml::{Context, DType, Device, GraphId, HostOp, Tensor, TensorId};

use crate::arch::{Builder, CompressedInputs, Gather, MsaInputs, SpanInputs, StateRunInputs, StepInputs, TpOps};
use crate::cache_type::KvTypes;
use crate::hparams::HParams;
use crate::kv::{AttnSpan, KvCache, Slots};
use crate::recurrent::{RecurrentCache, StateRun};
use crate::runner::Runner;
use crate::tp::{Collective, CollectiveError, TpSplit};
use crate::weights::{ModelFile, StageSpan, StageWeights};
use crate::ModelError;

/// How a stage is set up.
#[derive(Clone, Debug)]
pub struct StageConfig {
    /// KV cells (tokens, summed over all sequences) the stage can hold.
    pub n_ctx: usize,
    /// CPU threads for graph computation.
    pub n_threads: usize,
    /// Copy the weights ggml can repack into its faster layouts (llama.cpp's default;
    /// off = every weight read straight from the mapping, like llama.cpp `--no-repack`).
    pub repack: bool,
    /// Sequences with a region of the cache each (`n_ctx / n_seq` cells); 0: all
    /// sequences share every cell (see [`crate::KvCache::new`]).
    pub n_seq: usize,
    /// Element types of the cached keys and values (recurrent states stay f32).
    pub kv_types: KvTypes,
    /// Most rows of one sequence in one batch; with `n_seq > 0` it sizes the
    /// sliding-window layers' caches (see [`HParams::window_cells`]), which refuse
    /// batches of more.
    pub n_ubatch: usize,
}

impl StageConfig {
    /// `n_ctx` cells, `n_threads` threads, repacking on (llama.cpp's defaults).
    pub fn new(n_ctx: usize, n_threads: usize) -> StageConfig {
        StageConfig {
            n_ctx,
            n_threads,
            repack: true,
            n_seq: 0,
            kv_types: KvTypes::default(),
            n_ubatch: crate::kv::DEFAULT_UBATCH,
        }
    }
}

/// What enters a stage.
#[derive(Clone, Copy, Debug)]
pub enum StageInput<'a> {
    /// Token ids (first stage only).
    Tokens(&'a [u32]),
    /// Hidden states `[hidden_width, n_tokens]` (see [`HParams::hidden_width`]),
    /// row-major by token.
    Hidden(&'a [f32]),
}

/// One step's tokens: for each, its sequence and position; and which rows need logits.
#[derive(Clone, Copy, Debug)]
pub struct Batch<'a> {
    /// The tokens or hidden states.
    pub input: StageInput<'a>,
    /// Position of each token in its sequence.
    pub positions: &'a [i32],
    /// Sequence of each token.
    pub seq_ids: &'a [u32],
    /// Rows (indices into the batch) whose logits the last stage returns.
    pub logit_rows: &'a [u32],
    /// Whether every row is a decode row (a sequence's next token, and the tokens
    /// drafted after it), each to be computed with the bits it gets in a one-token step.
    /// A batch with one row per sequence is computed so whatever this says.
    pub decode: bool,
}

impl Batch<'_> {
    /// Tokens in the batch.
    pub fn n_tokens(&self) -> usize {
        self.positions.len()
    }
}

/// What a last stage returns for the batch's logit rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogitReply {
    /// The logits ([`StageOutput::Logits`]).
    Logits,
    /// Each row's best logit and its token ([`StageOutput::Best`]): enough for greedy
    /// sampling without penalties, and a few bytes instead of a row of the vocabulary.
    Best,
    /// The rows after the output norm, before the output projection
    /// ([`StageOutput::Normed`]): what embeddings pool, as llama.cpp's `t_embd`.
    Normed,
}

/// What leaves a stage.
#[derive(Clone, Debug, PartialEq)]
pub enum StageOutput {
    /// Hidden states `[hidden_width, n_tokens]` for the next stage (see
    /// [`HParams::hidden_width`]).
    Hidden(Vec<f32>),
    /// Logits, `n_vocab` per requested row, in the order of `logit_rows`; a
    /// tensor-parallel member's share of the vocabulary per row.
    Logits(Vec<f32>),
    /// Each requested row's best ([`LogitReply::Best`]), in the order of `logit_rows`;
    /// `None` for a row of only NaN. A tensor-parallel member's is the best of its share.
    Best(Vec<Option<RowBest>>),
    /// The requested rows after the output norm ([`LogitReply::Normed`]), `n_embd`
    /// per row, in the order of `logit_rows`.
    Normed(Vec<f32>),
}

/// The largest logit of a row (or of a member's share of it) and its token, the lowest
/// of equal maxima (as `baton_sample::argmax`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RowBest {
    /// A token id of the whole vocabulary.
    pub token: u32,
    /// Its logit (never NaN).
    pub logit: f32,
}

impl RowBest {
    /// Each row's best of `logits` (`n_rows` rows of equal width), whose first column
    /// is token `first_token`.
    pub fn of_rows(logits: &[f32], n_rows: usize, first_token: u32) -> Vec<Option<RowBest>> {
        let width = logits.len() / n_rows.max(1);
        logits
            .chunks_exact(width.max(1))
            .take(n_rows)
            .map(|row| {
                baton_sample::argmax_value(row).map(|(token, logit)| RowBest {
                    token: first_token + token,
                    logit,
                })
            })
            .collect()
    }

    /// The tokens of whole rows' bests; a row of only NaN has none and is refused.
    pub fn tokens(best: &[Option<RowBest>]) -> Result<Vec<u32>, ModelError> {
        best.iter()
            .map(|b| {
                b.map(|b| b.token)
                    .ok_or_else(|| ModelError::BadBatch("a logit row of only NaN".into()))
            })
            .collect()
    }
}

/// Where a stage's memory is, in bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StageMemory {
    /// On the stage's device (0 on the CPU): weights copied there, the KV cache, the
    /// device's compute buffer.
    pub device: u64,
    /// In host memory: mapped weight pages this process has resident, repacked
    /// weights, and (on the CPU) the KV cache and compute buffer.
    pub host: u64,
}

/// A layer range of a model, ready to compute: the whole of each layer, or one member's
/// slice of it ([`Stage::load_member`]). Member 0 of a tensor-parallel group leads the
/// others through a [`crate::StageGroup`].
pub struct Stage {
    span: StageSpan,
    /// The hyper-parameters the graph is built with (a member's: its heads, its FFN).
    hp: HParams,
    tp: Option<Member>,
    device: Device,
    // Declared before `weights` so the compute state is freed first.
    runner: Runner,
    /// The metadata of the step graph, reused every step (see `compute`).
    step_ctx: Option<Context>,
    /// The last step's graph, in `step_ctx`, computed again by a step of its shape.
    step: Option<StepGraph>,
    kv: KvCache,
    rs: RecurrentCache,
    weights: StageWeights,
    repacked: bool,
}

/// What a tensor-parallel member exchanges with.
struct Member {
    split: TpSplit,
    collective: Arc<dyn Collective>,
    ops: TpOps,
    /// The first failure of an exchange during the current computation.
    error: Arc<Mutex<Option<CollectiveError>>>,
}

impl Member {
    /// Member `split.rank` of a group over a model of `hp` (the whole model's).
    fn new(hp: &HParams, split: TpSplit, collective: Arc<dyn Collective>) -> Result<Member, ModelError> {
        let error: Arc<Mutex<Option<CollectiveError>>> = Arc::default();
        let all = (0..split.size)
            .map(|rank| TpSplit::new(hp, rank, split.size))
            .collect::<Result<Vec<_>, _>>()?;
        let gather = |width: &dyn Fn(&TpSplit) -> usize| {
            let widths: Vec<usize> = all.iter().map(width).collect();
            let total = widths.iter().sum();
            let (collective, error, rank) = (collective.clone(), error.clone(), split.rank);
            let op = HostOp::new(move |input: &[f32], out: &mut [f32]| {
                let rows = out.len() / total;
                // A member without heads gives nothing; its input only carries the shape.
                let mine = if widths[rank] == 0 { &[][..] } else { input };
                let gathered = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    collective.all_gather(mine, &widths, rows, &mut *out)
                }))
                .unwrap_or_else(|_| Err(CollectiveError::Aborted("an exchange panicked".into())));
                if let Err(e) = gathered {
                    out.fill(0.0);
                    if let Ok(mut slot) = error.lock() {
                        slot.get_or_insert(e);
                    }
                }
            });
            Gather { op, width: total }
        };
        let ops = TpOps {
            heads: gather(&|s| s.heads_width(hp)),
            ff: gather(&|s| s.ff.len()),
            ff_exp: gather(&|s| s.ff_exp.len()),
            ff_shexp: gather(&|s| s.ff_shexp.len()),
            embd: gather(&|s| s.embd.len()),
        };
        Ok(Member {
            split,
            collective,
            ops,
            error,
        })
    }
}

impl Stage {
    /// Loads the tensors of `span` from `file` and allocates the KV cache, on the CPU.
    pub fn load(file: Arc<ModelFile>, span: StageSpan, config: &StageConfig) -> Result<Stage, ModelError> {
        Stage::load_on(file, span, config, Device::cpu())
    }

    /// Loads the tensors of `span` from `file` into `device`'s memory (those it can
    /// use; the token embedding and weights of ops it lacks stay with the CPU) and
    /// allocates the KV cache there.
    pub fn load_on(
        file: Arc<ModelFile>,
        span: StageSpan,
        config: &StageConfig,
        device: Device,
    ) -> Result<Stage, ModelError> {
        Stage::load_member_on(file, span, config, device, None)
    }

    /// Loads one member of a tensor-parallel group on the CPU: its slice of every
    /// layer of `span` (see [`crate::tp`]), exchanging through `collective` with the
    /// other members, which must be loaded with the same span and configuration.
    /// `None`: the whole layers ([`Stage::load`]).
    pub fn load_member(
        file: Arc<ModelFile>,
        span: StageSpan,
        config: &StageConfig,
        member: Option<(TpSplit, Arc<dyn Collective>)>,
    ) -> Result<Stage, ModelError> {
        Stage::load_member_on(file, span, config, Device::cpu(), member)
    }

    fn load_member_on(
        file: Arc<ModelFile>,
        span: StageSpan,
        config: &StageConfig,
        device: Device,
        member: Option<(TpSplit, Arc<dyn Collective>)>,
    ) -> Result<Stage, ModelError> {
        let full = file.hparams();
        if span.layers.start >= span.layers.end || span.layers.end > full.n_layer {
            return Err(ModelError::BadConfig(format!(
                "layer range {:?} is not a non-empty part of the model's {} layers",
                span.layers, full.n_layer
            )));
        }
        if let Some(why) = full.stage_start_refusal(span.layers.start) {
            return Err(ModelError::BadConfig(why));
        }
        // The exchanges are host ops reading and writing the member's activations in
        // host memory, which only the CPU backend gives them.
        if member.is_some() && !device.is_cpu() {
            return Err(ModelError::BadConfig(format!(
                "tensor parallelism runs on the CPU only; {device:?} cannot hold a tensor-parallel member"
            )));
        }
        let split = member.as_ref().map(|(split, _)| split);
        let hp = split.map_or_else(|| full.clone(), |split| split.hparams(full));
        let runner = Runner::new(device, config.n_threads)?;
        let weights = StageWeights::load_split(file.clone(), &span, config.repack, device, split)?;
        let own = (!device.is_cpu()).then(|| device.buffer_type());
        let kv = KvCache::new_in(
            &hp,
            span.layers.clone(),
            config.n_ctx,
            config.n_seq,
            config.n_ubatch,
            config.kv_types,
            own,
        )?;
        let rs = RecurrentCache::new_in(&hp, span.layers.clone(), config.n_seq, own)?;
        let tp = member
            .map(|(split, collective)| Member::new(full, split, collective))
            .transpose()?;
        tracing::debug!(layers = ?span.layers, first = span.first, last = span.last, ?device, weight_bytes = weights.bytes(), device_bytes = weights.device_bytes(), tp = ?tp.as_ref().map(|m| &m.split), "stage loaded");
        Ok(Stage {
            span,
            hp,
            tp,
            device,
            runner,
            step_ctx: None,
            step: None,
            kv,
            rs,
            weights,
            repacked: config.repack,
        })
    }

    /// The member's place in its tensor-parallel group (`None` for a whole stage).
    pub fn tp_split(&self) -> Option<&TpSplit> {
        self.tp.as_ref().map(|m| &m.split)
    }

    /// Tells the other members of its group that this one will not exchange any more.
    pub fn abort_group(&self, reason: &str) {
        if let Some(member) = &self.tp {
            member.collective.abort(reason);
        }
    }

    /// Forgets every token of `seq`.
    pub fn clear_seq(&mut self, seq: u32) {
        self.truncate_seq(seq, 0);
    }

    /// Keeps only the tokens of `seq` at positions below `len`.
    pub fn truncate_seq(&mut self, seq: u32, len: usize) {
        self.kv.truncate_seq(seq, len);
        self.rs.truncate_seq(seq, len);
    }

    /// Keeps a copy of `seq`'s recurrent states after `len` positions (see
    /// [`RecurrentCache::checkpoint_seq`]); nothing for a stage without recurrent layers.
    pub fn checkpoint_seq(&mut self, seq: u32, len: usize) -> Result<(), ModelError> {
        self.rs.checkpoint_seq(seq, len)
    }

    /// The recurrent states (for inspection).
    pub fn recurrent(&self) -> &RecurrentCache {
        &self.rs
    }

    /// The device the stage computes on.
    pub fn device(&self) -> Device {
        self.device
    }

    /// The layers and roles of this stage.
    pub fn span(&self) -> &StageSpan {
        &self.span
    }

    /// Whether its weights were repacked for the CPU (llama.cpp's default), which
    /// decides from how many rows ggml switches to batched kernels.
    pub fn repacked(&self) -> bool {
        self.repacked
    }

    /// The KV cache (for inspection).
    pub fn kv(&self) -> &KvCache {
        &self.kv
    }

    /// The weights.
    pub fn weights(&self) -> &StageWeights {
        &self.weights
    }

    /// Bytes this stage (this member, in a tensor-parallel group) holds now, on its
    /// device and in host memory (see [`StageMemory`]).
    pub fn memory(&self) -> StageMemory {
        let mapped = crate::resident::mapped_rss(self.weights.file().map_address()).unwrap_or(0);
        let compute = self.runner.bytes();
        let kv = (self.kv.bytes() + self.rs.bytes()) as u64;
        let (kv_device, kv_host) = if self.device.is_cpu() { (0, kv) } else { (kv, 0) };
        StageMemory {
            device: self.weights.device_bytes() as u64 + kv_device + compute.device as u64,
            host: mapped + self.weights.repacked_bytes() as u64 + kv_host + compute.host as u64,
        }
    }

    /// Bytes this stage has resident now, wherever they are: the pages of its mapping
    /// that are in memory, its copied weights, its KV cache and its compute buffers.
    pub fn resident_bytes(&self) -> u64 {
        let memory = self.memory();
        memory.device + memory.host
    }

    /// Runs the stage's layers over one batch; a last stage answers its logit rows as
    /// `reply` asks (a tensor-parallel member: of its share of the vocabulary, the
    /// tokens global ids).
    pub fn forward(&mut self, batch: &Batch<'_>, reply: LogitReply) -> Result<StageOutput, ModelError> {
        self.check(batch)?;
        let runs = self.rs.plan(batch.seq_ids, batch.positions)?;
        let slots = self.kv.claim(batch.seq_ids, batch.positions)?;
        let result = self.compute(batch, &slots, &runs, reply == LogitReply::Normed);
        match &result {
            Ok(_) => self.rs.commit(&runs),
            Err(e) => {
                self.rs.fail(&runs);
                self.kv.release(&slots);
                // The other members may wait for this one's sums: let them go.
                self.abort_group(&e.to_string());
            }
        }
        match result? {
            StageOutput::Logits(logits) if reply == LogitReply::Best => {
                let first = self.tp_split().map_or(0, |split| split.vocab.start as u32);
                Ok(StageOutput::Best(RowBest::of_rows(
                    &logits,
                    batch.logit_rows.len(),
                    first,
                )))
            }
            out => Ok(out),
        }
    }

    fn check(&self, batch: &Batch<'_>) -> Result<(), ModelError> {
        let hp = self.weights.file().hparams();
        let n = batch.n_tokens();
        let bad = |msg: String| Err(ModelError::BadBatch(msg));
        if n == 0 {
            return bad("empty batch".into());
        }
        if batch.seq_ids.len() != n {
            return bad(format!("{} sequence ids for {n} positions", batch.seq_ids.len()));
        }
        match batch.input {
            StageInput::Tokens(tokens) => {
                if !self.span.first {
                    return bad(format!("stage {:?} takes hidden states, not tokens", self.span.layers));
                }
                if tokens.len() != n {
                    return bad(format!("{} tokens for {n} positions", tokens.len()));
                }
                if let Some(&t) = tokens.iter().find(|&&t| t as usize >= hp.n_vocab) {
                    return bad(format!("token id {t} is outside the vocabulary of {}", hp.n_vocab));
                }
            }
            StageInput::Hidden(hidden) => {
                if self.span.first {
                    return bad("the first stage takes tokens, not hidden states".into());
                }
                let width = hp.carried_width(self.span.layers.start);
                if hidden.len() != n * width {
                    return bad(format!(
                        "hidden state of {} floats, expected {n} x {width}",
                        hidden.len()
                    ));
                }
            }
        }
        if !self.span.last && !batch.logit_rows.is_empty() {
            return bad("only the last stage produces logits".into());
        }
        if let Some(&row) = batch.logit_rows.iter().find(|&&r| r as usize >= n) {
            return bad(format!("logit row {row} is outside the batch of {n}"));
        }
        Ok(())
    }

    /// Whether a batch of decode steps (one row per sequence) is computed whole, every
    /// row as alone: on the CPU, where each product cuts the rows into pieces its
    /// kernels compute as alone (`Builder::mm`). A GPU's kernels are not probed, so its
    /// stage gets such batches in pieces that small (see `baton_stage::max_decode_rows`).
    pub fn whole_decode_batches(&self) -> bool {
        self.device.is_cpu()
    }

    /// The positions each span's sequence holds from its first cell, in order, for the
    /// layers that cut a sequence into blocks of positions: GLM-5 next's k-pool indexer
    /// and DeepSeek V4's compressed layers (empty for other models, and for a stage
    /// without those layers).
    /// Each count is rounded down to a whole block of the smallest size these layers cut
    /// (every size is a multiple of it): the graph depends only on the complete blocks,
    /// and as part of the step's key the count then changes once per block, not once
    /// per token.
    fn held(&self, seq_ids: &[u32], spans: &[AttnSpan]) -> Result<Vec<usize>, ModelError> {
        let attends = self.span.layers.clone().any(|l| !self.hp.is_recurrent(l));
        let kpool = self.hp.indexer().and_then(|ix| ix.kpool).filter(|_| attends);
        let ratios = self.ratios();
        let (who, unit) = match (kpool, ratios.iter().min()) {
            (Some(kpool), _) => ("the k-pool indexer cuts", kpool.size),
            (None, Some(&ratio)) => ("DeepSeek V4's compressed attention cuts", ratio),
            (None, None) => return Ok(Vec::new()),
        };
        debug_assert!(
            ratios.iter().all(|r| r % unit == 0),
            "block sizes are multiples of the smallest"
        );
        spans
            .iter()
            .map(|span| {
                let seq = seq_ids[span.rows.start];
                let n = self.kv.positions_in_order(seq, span.cells.clone()).ok_or_else(|| {
                    ModelError::BadBatch(format!(
                        "sequence {seq} does not hold its positions in order from the first cell \
                         of its span; {who} a sequence into blocks of positions (run it with a \
                         region per sequence)"
                    ))
                })?;
                Ok(n - n % unit.max(1))
            })
            .collect()
    }

    /// The compression ratios of this stage's DeepSeek V4 layers that compress.
    fn ratios(&self) -> Vec<usize> {
        self.hp
            .dsv4
            .as_ref()
            .map_or(Vec::new(), |v4| v4.ratios_in(self.span.layers.clone()))
    }

    fn compute(
        &mut self,
        batch: &Batch<'_>,
        slots: &Slots,
        runs: &[StateRun],
        normed: bool,
    ) -> Result<StageOutput, ModelError> {
        let n_tokens = batch.n_tokens();
        let mut spans = self.kv.attention_spans(batch.seq_ids);
        let decode_rows = batch.decode || one_row_per_sequence(batch.seq_ids);
        let msa = self
            .hp
            .msa
            .filter(|_| self.span.layers.clone().any(|l| self.hp.is_msa(l)));
        if let (Some(_), true) = (msa, decode_rows) {
            spans = crate::arch::msa::one_row_spans(spans);
        }
        // MiniMax sparse attention: the positions each span's blocks cover.
        let msa_positions = match msa {
            Some(msa) => spans
                .iter()
                .map(|s| crate::arch::msa::span_positions(&batch.positions[s.rows.clone()], msa.block_size))
                .collect(),
            None => Vec::new(),
        };
        let held = self.held(batch.seq_ids, &spans)?;
        let key = StepKey {
            msa_positions,
            tokens: matches!(batch.input, StageInput::Tokens(_)),
            n_tokens,
            decode_rows,
            spans: spans
                .iter()
                .map(|s| (s.rows.clone(), s.cells.clone(), s.window_cells.clone()))
                .collect(),
            logit_rows: batch.logit_rows.len(),
            normed: normed && self.span.last && !batch.logit_rows.is_empty(),
            state_runs: runs.iter().map(|r| r.rows.clone()).collect(),
            ratios: self.ratios(),
            held,
        };
        // A step shaped like the last one computes the last one's graph again: only its
        // inputs change. Building about a thousand nodes and splitting them between
        // backends is skipped, as llama.cpp skips it when it reuses its graph.
        if self.step.as_ref().is_none_or(|step| step.key != key) {
            self.step = None;
            self.build_step(key, spans)?;
        }
        self.write_inputs(batch, slots, runs)?;
        let ctx = self.step_ctx.as_ref().expect("built above");
        let step = self.step.as_ref().expect("built above");
        let out = ctx.tensor(step.out);
        let graph = ctx.graph(step.graph);
        if let Err(e) = self.runner.compute(&graph) {
            self.step = None;
            return Err(e);
        }
        if let Some(e) = self.tp.as_ref().and_then(|m| m.error.lock().ok()?.take()) {
            self.step = None;
            return Err(e.into());
        }

        let want_logits = self.span.last && !batch.logit_rows.is_empty();
        if want_logits {
            // [n_vocab, n_out] (a tensor-parallel member's share of the vocabulary), or
            // [n_embd, n_out] normed rows.
            let mut values = vec![0f32; out.ne()[0] as usize * batch.logit_rows.len()];
            out.read(&mut values)?;
            Ok(match step.key.normed {
                true => StageOutput::Normed(values),
                false => StageOutput::Logits(values),
            })
        } else if self.span.last {
            Ok(StageOutput::Logits(Vec::new()))
        } else {
            let mut hidden = vec![0f32; self.hp.carried_width(self.span.layers.end) * n_tokens];
            out.read(&mut hidden)?;
            Ok(StageOutput::Hidden(hidden))
        }
    }

    /// Builds and allocates the graph of steps shaped as `key` (the architecture's input
    /// end on a first stage, its layers, its output end on a last stage), in the reused
    /// step context, and keeps it as `self.step`.
    fn build_step(&mut self, key: StepKey, spans: Vec<AttnSpan>) -> Result<(), ModelError> {
        let hp = &self.hp;
        // About 40 nodes per attention layer plus 10 per span, about 50 for experts, plus
        // the pieces of a decode batch's products (views included); generous so no model
        // runs short.
        // DeepSeek sparse attention: the indexer's 3 products, about 20 nodes per layer
        // and 12 per span (its scores, choice and mask).
        // A k-pool indexer (GLM-5 next) pools its blocks and builds its masks per span:
        // about 40 more. MiniMax sparse attention: about 50 nodes per span (its scores,
        // choice, mask or gather).
        let (per_span, piece_nodes) = match (hp.indexer(), hp.msa) {
            (Some(ix), _) if ix.kpool.is_some() => (72, PIECE_NODES + 12),
            (Some(_), _) => (32, PIECE_NODES + 12),
            (None, Some(_)) => (80, PIECE_NODES + 12),
            // DeepSeek V4's heavily compressed layers compress their blocks and join
            // their keys and masks per span: about 30 more.
            (None, None) if hp.dsv4.is_some() => (48, PIECE_NODES),
            (None, None) => (16, PIECE_NODES),
        };
        let per_row = if key.decode_rows { piece_nodes * key.n_tokens } else { 0 };
        // A recurrent layer: about 40 per run, 3 per state it keeps.
        let per_run = (40 + 3 * crate::recurrent::KEPT_STATES) * key.state_runs.len();
        let n_nodes =
            (160 + per_span * spans.len() + per_row + per_run) * self.span.layers.len() + 64 + 4 * spans.len();
        // The same context every step, reset: the graph's tensors keep their addresses,
        // so a device that records graphs (CUDA) replays the step's instead of recording
        // a new one each token (without this, measured on an H100: 0.30x libllama's
        // generation speed, docs/devices.md).
        if !self.step_ctx.as_ref().is_some_and(|c| c.fits(n_nodes, n_nodes)) {
            self.step_ctx = Some(Context::new(n_nodes, n_nodes));
        }
        let ctx = self.step_ctx.as_mut().expect("made above");
        ctx.reset();
        let ctx: &Context = ctx;

        let want_logits = self.span.last && key.logit_rows > 0;
        let window_cache = self.kv.window_capacity().is_some();
        let (inputs, input) = new_inputs(ctx, hp, &self.span, &key, spans, window_cache);
        let (positions, kv_slots, kv_slots_swa, out_rows, attn_temp, block_slots) = (
            inputs.positions,
            inputs.kv_slots,
            inputs.kv_slots_swa,
            inputs.out_rows,
            inputs.attn_temp,
            inputs.block_slots.clone(),
        );
        let mut b = Builder {
            ctx,
            graph: ctx.new_graph(),
            hp,
            weights: &self.weights,
            kv: &self.kv,
            rs: &self.rs,
            inputs,
            outputs_selected: false,
            selection: None,
            banked: None,
            tp: self.tp.as_ref().map(|m| m.ops.clone()),
        };
        let mut hidden = match input {
            StepInput::Tokens(tokens) => (hp.arch.embed)(&b, tokens), // [n_embd, n_tokens]
            StepInput::Hidden(carried) => unpack_carried(&mut b, carried, self.span.layers.start),
        };
        for layer in self.span.layers.clone() {
            let w = self.weights.layer(layer);
            hidden = (hp.arch.layer)(&mut b, &w, layer, hidden).named(&format!("l_out-{layer}"));
        }
        // Architectures that compute every row through the last layer (gpt-oss) keep
        // the rows that need logits here, as llama.cpp does.
        if let (Some(rows), false) = (out_rows, b.outputs_selected) {
            if self.span.layers.end == hp.n_layer {
                hidden = ctx.get_rows(hidden, rows);
            }
        }
        let out = if want_logits && key.normed {
            crate::arch::ends::normed(&b, hidden) // [n_embd, n_out]
        } else if want_logits {
            (hp.arch.logits)(&b, hidden) // [n_vocab, n_out]
        } else if self.span.last {
            hidden
        } else {
            pack_carried(&b, hidden)
        };
        let out = out.named("stage_out").set_output();
        let mut graph = b.graph;
        let spans = b.inputs.spans;
        let state_runs = b.inputs.state_runs;
        graph.expand(out);

        self.runner.alloc(&graph)?;
        let (tokens_in, hidden_in) = match input {
            StepInput::Tokens(t) => (Some(ctx.id_of(t)), None),
            StepInput::Hidden(h) => (None, Some(ctx.id_of(h))),
        };
        self.step = Some(StepGraph {
            key,
            graph: ctx.graph_id(&graph),
            positions: ctx.id_of(positions),
            kv_slots: ctx.id_of(kv_slots),
            kv_slots_swa: kv_slots_swa.map(|t| ctx.id_of(t)),
            masks: spans
                .iter()
                .map(|s| (s.mask.map(|m| ctx.id_of(m)), s.mask_swa.map(|m| ctx.id_of(m))))
                .collect(),
            msa: spans
                .iter()
                .map(|s| {
                    s.msa.map(|m| MsaIds {
                        local: ctx.id_of(m.local),
                        pos_mask: ctx.id_of(m.pos_mask),
                        pos_cells: ctx.id_of(m.pos_cells),
                        cell_blocks: m.cell_blocks.map(|t| ctx.id_of(t)),
                    })
                })
                .collect(),
            compressed: spans
                .iter()
                .map(|s| {
                    s.compressed
                        .iter()
                        .map(|c| (ctx.id_of(c.mask), c.positions.map(|t| ctx.id_of(t))))
                        .collect()
                })
                .collect(),
            out_rows: out_rows.map(|t| ctx.id_of(t)),
            state_runs: state_runs
                .iter()
                .map(|r| (ctx.id_of(r.source), ctx.id_of(r.targets)))
                .collect(),
            attn_temp: attn_temp.map(|t| ctx.id_of(t)),
            block_slots: block_slots.iter().map(|&(_, t)| ctx.id_of(t)).collect(),
            tokens_in,
            hidden_in,
            out: ctx.id_of(out),
        });
        Ok(())
    }

    /// Writes `batch` (and the cache cells `slots` it goes to) into the inputs of the
    /// step graph built for its shape.
    fn write_inputs(&self, batch: &Batch<'_>, slots: &Slots, runs: &[StateRun]) -> Result<(), ModelError> {
        let hp = &self.hp;
        let ctx = self.step_ctx.as_ref().expect("built before its inputs are written");
        let step = self.step.as_ref().expect("built before its inputs are written");
        let tensor = |id: TensorId| ctx.tensor(id);
        let (positions, kv_slots) = (tensor(step.positions), tensor(step.kv_slots));
        // A tensor-parallel member without heads reads no positions, cells or masks.
        if positions.has_data() {
            if hp.n_pos_per_token() == 1 {
                positions.write(batch.positions)?;
            } else {
                // Multi-section RoPE: `[p, p, p, 0]` for text, section-major.
                let p = batch.positions;
                let zeros = vec![0; p.len()];
                positions.write(&[p, p, p, &zeros[..]].concat())?;
            }
        }
        for (run, &(source, targets)) in runs.iter().zip(&step.state_runs) {
            tensor(source).write(&[run.source])?;
            tensor(targets).write(&run.targets)?;
        }
        if kv_slots.has_data() {
            kv_slots.write(&slots.full)?;
        }
        if let (Some(t), Some(window)) = (step.kv_slots_swa.map(tensor).filter(Tensor::has_data), &slots.window) {
            t.write(window)?;
        }
        for ((rows, cells, window_cells), (mask, mask_swa)) in step.key.spans.iter().zip(&step.masks) {
            let (seq_ids, positions) = (&batch.seq_ids[rows.clone()], &batch.positions[rows.clone()]);
            if let Some(m) = mask.map(tensor).filter(Tensor::has_data) {
                m.write(&self.kv.mask(seq_ids, positions, cells.clone(), None))?;
            }
            if let Some(m) = mask_swa.map(tensor).filter(Tensor::has_data) {
                m.write(&self.kv.window_mask(seq_ids, positions, window_cells.clone()))?;
            }
        }
        if let Some(msa) = hp.msa {
            let spans = step.key.spans.iter().zip(&step.msa).zip(&step.key.msa_positions);
            for (((rows, cells, _), ids), &n_pos) in spans {
                let Some(ids) = ids.as_ref().filter(|ids| tensor(ids.pos_mask).has_data()) else {
                    continue;
                };
                let (seq_ids, positions) = (&batch.seq_ids[rows.clone()], &batch.positions[rows.clone()]);
                let seq = seq_ids[0];
                let block = msa.block_size;
                tensor(ids.local).write(&crate::arch::msa::local_blocks(
                    positions,
                    n_pos / block,
                    block,
                    msa.local_blocks,
                ))?;
                tensor(ids.pos_mask).write(&self.kv.pos_mask(seq_ids, positions, cells.clone(), n_pos))?;
                tensor(ids.pos_cells).write(&self.kv.pos_cells(seq, cells.clone(), n_pos))?;
                if let Some(t) = ids.cell_blocks.map(tensor) {
                    t.write(&self.kv.cell_blocks(seq, cells.clone(), block))?;
                }
            }
        }
        for (&ratio, &id) in step.key.ratios.iter().zip(&step.block_slots) {
            let t = tensor(id);
            if t.has_data() {
                let slots: Vec<i32> = batch.positions.iter().map(|&p| p % ratio as i32).collect();
                t.write(&slots)?;
            }
        }
        let spans = step.key.spans.iter().zip(&step.compressed).zip(&step.key.held);
        for (((rows, _, _), ids), &held) in spans {
            for (&ratio, &(mask, block_pos)) in step.key.ratios.iter().zip(ids) {
                let n_blocks = held / ratio;
                let (mask, n_keys) = (tensor(mask), crate::arch::hca::compressed_keys_len(n_blocks));
                if mask.has_data() {
                    let positions = &batch.positions[rows.clone()];
                    mask.write(&crate::arch::hca::compressed_mask(positions, ratio, n_keys))?;
                }
                if let Some(t) = block_pos.map(tensor).filter(Tensor::has_data) {
                    let first: Vec<i32> = (0..n_blocks).map(|j| (j * ratio) as i32).collect();
                    t.write(&first)?;
                }
            }
        }
        if let (Some(t), Some(temp)) = (step.attn_temp.map(tensor).filter(Tensor::has_data), &hp.attn_temp) {
            t.write(&temp.factors(batch.positions))?;
        }
        if let Some(rows) = step.out_rows.map(tensor) {
            let ids: Vec<i32> = batch.logit_rows.iter().map(|&r| r as i32).collect();
            rows.write(&ids)?;
        }
        match batch.input {
            StageInput::Tokens(tokens) => {
                let ids: Vec<i32> = tokens.iter().map(|&t| t as i32).collect();
                step.tokens_in.map(|t| tensor(t).write(&ids)).transpose()?;
            }
            StageInput::Hidden(hidden) => {
                step.hidden_in.map(|t| tensor(t).write(hidden)).transpose()?;
            }
        }
        Ok(())
    }
}

/// What travels into a stage, `[carried_width, n_tokens]`: the hidden state, and the
/// inputs banked before the stage's first layer (see [`HParams::carried_width`]), which
/// become the builder's banked inputs again.
fn unpack_carried<'g>(b: &mut Builder<'g>, carried: Tensor<'g>, start: usize) -> Tensor<'g> {
    let n_banked = b.hp.banked_before(start);
    if n_banked == 0 {
        return carried;
    }
    let ctx = b.ctx;
    let [_, n_tokens, _, _] = carried.ne();
    let (width, n_embd) = (b.hp.hidden_width(), b.hp.n_embd);
    let row = carried.nb()[1];
    let hidden = ctx.cont_2d(
        ctx.view_2d(carried, width as i64, n_tokens, row, 0),
        width as i64,
        n_tokens,
    );
    let f32_size = std::mem::size_of::<f32>();
    let banked = ctx.view_3d(
        carried,
        [n_embd as i64, n_banked as i64, n_tokens],
        n_embd * f32_size,
        row,
        width * f32_size,
    );
    b.banked = Some(ctx.cont_3d(banked, [n_embd as i64, n_banked as i64, n_tokens]));
    hidden
}

/// What leaves a stage that is not the last, `[carried_width, n_tokens]`: the hidden
/// state and, after it, the inputs banked so far (see [`unpack_carried`]).
fn pack_carried<'g>(b: &Builder<'g>, hidden: Tensor<'g>) -> Tensor<'g> {
    let Some(banked) = b.banked else {
        return hidden;
    };
    let ctx = b.ctx;
    let [width, n_tokens, _, _] = hidden.ne();
    let [n_embd, n_banked, _, _] = banked.ne();
    let rows = ctx.concat(
        ctx.reshape_3d(hidden, width, 1, n_tokens),
        ctx.reshape_3d(banked, n_embd, n_banked, n_tokens),
        1,
    );
    ctx.reshape_2d(rows, width + n_embd * n_banked, n_tokens)
}

/// What enters a step graph: token ids i32 `[n_tokens]` (first stage) or hidden states
/// f32 `[n_embd, n_tokens]`.
#[derive(Clone, Copy)]
enum StepInput<'g> {
    Tokens(Tensor<'g>),
    Hidden(Tensor<'g>),
}

/// The input tensors of a step graph shaped as `key` for a stage of `span` (their data
/// is written after allocation, by `write_inputs`).
fn new_inputs<'g>(
    ctx: &'g Context,
    hp: &HParams,
    span: &StageSpan,
    key: &StepKey,
    spans: Vec<AttnSpan>,
    window_cache: bool,
) -> (StepInputs<'g>, StepInput<'g>) {
    let n_tokens = key.n_tokens as i64;
    let input = |dtype: DType, shape: &[i64], name: &str| ctx.new_tensor(dtype, shape).named(name).set_input();
    let positions = input(DType::I32, &[n_tokens * hp.n_pos_per_token() as i64], "inp_pos");
    let kv_slots = input(DType::I64, &[n_tokens], "kv_slots");
    // A mask is an input only if some layer of this stage reads it (an input that is not
    // in the graph gets no memory).
    let has_swa = span.layers.clone().any(|l| hp.is_swa(l));
    let has_full = span.layers.clone().any(|l| !hp.is_swa(l));
    let kv_slots_swa = (has_swa && window_cache).then(|| input(DType::I64, &[n_tokens], "kv_slots_swa"));
    let new_mask = |rows: &std::ops::Range<usize>, cells: &std::ops::Range<usize>, name: &str| {
        let shape = [cells.len() as i64, rows.len() as i64];
        input(DType::F16, &shape, &format!("{name}-{}", rows.start))
    };
    let msa_inputs = |span: &AttnSpan, n_pos: usize| {
        let block = hp.msa.expect("positions are counted for MSA models only").block_size;
        let (n_rows, first) = (span.rows.len() as i64, span.rows.start);
        let n_pos_i = n_pos as i64;
        let one_row = n_rows == 1;
        MsaInputs {
            n_pos,
            local: input(
                DType::F32,
                &[n_pos_i / block as i64, n_rows],
                &format!("msa_local-{first}"),
            ),
            pos_mask: input(DType::F32, &[n_pos_i, n_rows], &format!("msa_pos_mask-{first}")),
            pos_cells: input(DType::I32, &[n_pos_i, 1], &format!("msa_pos_cells-{first}")),
            cell_blocks: (!one_row).then(|| {
                input(
                    DType::I32,
                    &[span.cells.len() as i64, 1],
                    &format!("msa_cell_blocks-{first}"),
                )
            }),
        }
    };
    let spans: Vec<SpanInputs> = spans
        .into_iter()
        .enumerate()
        .map(|(index, span)| SpanInputs {
            mask: has_full.then(|| new_mask(&span.rows, &span.cells, "kq_mask")),
            mask_swa: has_swa.then(|| new_mask(&span.rows, &span.window_cells, "kq_mask_swa")),
            blocks: match (key.held.get(index), hp.indexer().and_then(|ix| ix.kpool)) {
                (Some(&held), Some(kpool)) => held / kpool.size,
                _ => 0,
            },
            msa: key.msa_positions.get(index).map(|&n_pos| msa_inputs(&span, n_pos)),
            compressed: key
                .ratios
                .iter()
                .map(|&ratio| {
                    let n_blocks = key.held[index] / ratio;
                    let first = span.rows.start;
                    CompressedInputs {
                        ratio,
                        blocks: n_blocks,
                        mask: input(
                            DType::F16,
                            &[
                                crate::arch::hca::compressed_keys_len(n_blocks) as i64,
                                span.rows.len() as i64,
                            ],
                            &format!("comp{ratio}_kq_mask-{first}"),
                        ),
                        positions: (n_blocks > 0)
                            .then(|| input(DType::I32, &[n_blocks as i64], &format!("comp{ratio}_pos-{first}"))),
                    }
                })
                .collect(),
            span,
        })
        .collect();
    let want_logits = span.last && key.logit_rows > 0;
    let out_rows = want_logits.then(|| input(DType::I32, &[key.logit_rows as i64], "out_rows"));
    let attn_temp = hp
        .attn_temp
        .as_ref()
        .map(|_| input(DType::F32, &[1, 1, n_tokens], "inp_attn_scale"));
    let step_input = if key.tokens {
        StepInput::Tokens(input(DType::I32, &[n_tokens], "inp_tokens"))
    } else {
        let width = hp.carried_width(span.layers.start);
        StepInput::Hidden(input(DType::F32, &[width as i64, n_tokens], "inp_hidden"))
    };
    let state_runs = key
        .state_runs
        .iter()
        .map(|rows| StateRunInputs {
            source: input(DType::I32, &[1], &format!("rs_source-{}", rows.start)),
            targets: input(
                DType::I64,
                &[rows.len().min(crate::recurrent::KEPT_STATES) as i64],
                &format!("rs_targets-{}", rows.start),
            ),
            rows: rows.clone(),
        })
        .collect();
    let inputs = StepInputs {
        positions,
        state_runs,
        kv_slots,
        kv_slots_swa,
        spans,
        out_rows,
        attn_temp,
        tokens: match step_input {
            StepInput::Tokens(tokens) => Some(tokens),
            StepInput::Hidden(_) => None,
        },
        block_slots: key
            .ratios
            .iter()
            .map(|&ratio| {
                (
                    ratio,
                    input(DType::I32, &[n_tokens], &format!("comp{ratio}_block_slots")),
                )
            })
            .collect(),
        n_tokens: key.n_tokens,
        decode_rows: key.decode_rows,
    };
    (inputs, step_input)
}

/// What decides a step graph's shape: two steps with the same key build the same graph.
#[derive(Clone, Debug, PartialEq, Eq)]
struct StepKey {
    /// Tokens in (the first stage), else hidden states.
    tokens: bool,
    n_tokens: usize,
    decode_rows: bool,
    /// Rows, cells and sliding-window cells of each attention span.
    spans: Vec<(std::ops::Range<usize>, std::ops::Range<usize>, std::ops::Range<usize>)>,
    /// MiniMax sparse attention: the positions each span's blocks cover (empty for
    /// other models and stages without its layers).
    msa_positions: Vec<usize>,
    /// Rows that need logits (or normed rows).
    logit_rows: usize,
    /// The output rows are the output norm's, not logits ([`LogitReply::Normed`]).
    normed: bool,
    /// Rows of each run that continues a recurrent state.
    state_runs: Vec<std::ops::Range<usize>>,
    /// The positions each span's sequence holds in order (see `Stage::held`).
    held: Vec<usize>,
    /// The compression ratios of the stage's DeepSeek V4 layers that compress.
    ratios: Vec<usize>,
}

/// A built and allocated step graph and its inputs and output, by id.
struct StepGraph {
    key: StepKey,
    graph: GraphId,
    positions: TensorId,
    kv_slots: TensorId,
    kv_slots_swa: Option<TensorId>,
    /// `(mask, sliding-window mask)` of each span of `key.spans`.
    masks: Vec<(Option<TensorId>, Option<TensorId>)>,
    /// MiniMax sparse attention's inputs of each span.
    msa: Vec<Option<MsaIds>>,
    /// DeepSeek V4's compressed attention: each span's mask and block positions, for
    /// each ratio of `key.ratios`.
    compressed: Vec<Vec<(TensorId, Option<TensorId>)>>,
    out_rows: Option<TensorId>,
    /// `(source, targets)` of each run of `key.state_runs`.
    state_runs: Vec<(TensorId, TensorId)>,
    attn_temp: Option<TensorId>,
    /// Each row's slot in its block, for each ratio of `key.ratios`.
    block_slots: Vec<TensorId>,
    tokens_in: Option<TensorId>,
    hidden_in: Option<TensorId>,
    out: TensorId,
}

/// The ids of a span's [`MsaInputs`].
struct MsaIds {
    local: TensorId,
    pos_mask: TensorId,
    pos_cells: TensorId,
    cell_blocks: Option<TensorId>,
}

/// Graph nodes one row of a decode batch may add per layer: up to about 16 products a
/// layer, each cut into pieces as small as one row (a view, the product, a concat).
const PIECE_NODES: usize = 48;

/// Whether every row of a batch is the only one of its sequence (a batch of decode
/// steps, no drafted tokens).
pub fn one_row_per_sequence(seq_ids: &[u32]) -> bool {
    let mut seqs = seq_ids.to_vec();
    seqs.sort_unstable();
    seqs.dedup();
    seqs.len() == seq_ids.len()
}
