//! Several stages behind one worker: consecutive layer ranges, each on its own device
//! (say a GPU and the CPU), computed one after another in one thread. The hidden state
//! goes from one to the next in host memory (read back from one device, written to the
//! next), never over a socket. Each stage may be a tensor-parallel group's member 0
//! leading the others ([`StageGroup`]).

use std::sync::Arc;

use crate::group::StageGroup;
use crate::stage::{Batch, LogitReply, Stage, StageInput, StageOutput};
use crate::weights::{ModelFile, StageSpan};
use crate::ModelError;

/// Stages of consecutive layer ranges, run in order as one.
pub struct StageChain {
    stages: Vec<StageGroup>,
    span: StageSpan,
}

impl StageChain {
    /// Chains `stages`, which must cover consecutive layers: the first embeds tokens
    /// when the chain is first, the last produces logits when the chain is last.
    pub fn new(stages: Vec<Stage>) -> Result<StageChain, ModelError> {
        let (Some(first), Some(last)) = (stages.first(), stages.last()) else {
            return Err(ModelError::BadConfig("a stage chain needs at least one stage".into()));
        };
        for pair in stages.windows(2) {
            let (a, b) = (pair[0].span(), pair[1].span());
            if a.layers.end != b.layers.start || a.last || b.first {
                return Err(ModelError::BadConfig(format!(
                    "stages {:?} and {:?} do not chain (consecutive layers, only the first embedding, \
                     only the last with logits)",
                    a.layers, b.layers
                )));
            }
        }
        let span = StageSpan {
            layers: first.span().layers.start..last.span().layers.end,
            first: first.span().first,
            last: last.span().last,
        };
        let stages = stages.into_iter().map(StageGroup::from).collect();
        Ok(StageChain { stages, span })
    }

    /// The layers and roles of the whole chain.
    pub fn span(&self) -> &StageSpan {
        &self.span
    }

    /// The stages (of a tensor-parallel group, member 0's), in layer order.
    pub fn stages(&self) -> impl ExactSizeIterator<Item = &Stage> {
        self.stages.iter().map(StageGroup::stage)
    }

    /// The model file, as the first stage mapped it.
    pub fn file(&self) -> &Arc<ModelFile> {
        self.stages[0].stage().weights().file()
    }

    /// Whether any stage copied weights into repacked layouts.
    pub fn repacked(&self) -> bool {
        self.stages().any(Stage::repacked)
    }

    /// Whether every stage computes a batch of decode steps whole
    /// ([`Stage::whole_decode_batches`]).
    pub fn whole_decode_batches(&self) -> bool {
        self.stages().all(Stage::whole_decode_batches)
    }

    /// Whether any stage is a tensor-parallel group of several members.
    pub fn tensor_parallel(&self) -> bool {
        self.stages.iter().any(|g| g.size() > 1)
    }

    /// Forgets a sequence's cells from position `len` on, in every stage.
    pub fn truncate_seq(&mut self, seq: u32, len: usize) {
        self.stages.iter_mut().for_each(|s| s.truncate_seq(seq, len));
    }

    /// Keeps a copy of a sequence's recurrent states after `len` positions, in every
    /// stage; the first failure is the answer.
    pub fn checkpoint_seq(&mut self, seq: u32, len: usize) -> Result<(), crate::ModelError> {
        self.stages.iter_mut().try_for_each(|s| s.checkpoint_seq(seq, len))
    }

    /// Forgets a sequence in every stage.
    pub fn clear_seq(&mut self, seq: u32) {
        self.stages.iter_mut().for_each(|s| s.clear_seq(seq));
    }

    /// KV cells in use (every stage holds the same positions; the first is asked).
    pub fn kv_used(&self) -> usize {
        self.stages[0].stage().kv().n_used()
    }

    /// Bytes the stages (member 0 of a group) hold now, on their devices and in host
    /// memory together.
    pub fn resident_bytes(&self) -> u64 {
        self.stages().map(Stage::resident_bytes).sum()
    }

    /// Members in the tensor-parallel group of the chain's last stage (1: none).
    pub fn last_tp_size(&self) -> usize {
        self.stages.last().map_or(1, StageGroup::size)
    }

    /// Runs the batch through every stage in order; the last answers the logit rows as
    /// `reply` asks. When a later stage fails, the cells the earlier ones claimed for the
    /// batch are given back (by position, as the worker forgets rows it computed before
    /// a failure).
    pub fn forward(&mut self, batch: &Batch<'_>, reply: LogitReply) -> Result<StageOutput, ModelError> {
        let n = self.stages.len();
        let mut hidden: Option<Vec<f32>> = None;
        for i in 0..n {
            let last = i + 1 == n;
            let step = Batch {
                input: match &hidden {
                    Some(h) => StageInput::Hidden(h),
                    None => batch.input,
                },
                logit_rows: if last { batch.logit_rows } else { &[] },
                ..*batch
            };
            match self.stages[i].forward(&step, reply) {
                Ok(out) if last => return Ok(out),
                Ok(StageOutput::Hidden(h)) => hidden = Some(h),
                Ok(StageOutput::Logits(_) | StageOutput::Best(_) | StageOutput::Normed(_)) => {
                    self.forget(i + 1, batch);
                    return Err(ModelError::BadBatch(
                        "a stage before the chain's last produced logits".into(),
                    ));
                }
                Err(e) => {
                    self.forget(i, batch);
                    return Err(e);
                }
            }
        }
        unreachable!("a chain has at least one stage and its last returns")
    }

    /// Gives back the cells the first `n` stages claimed for `batch`.
    fn forget(&mut self, n: usize, batch: &Batch<'_>) {
        for stage in &mut self.stages[..n] {
            for (&seq, &pos) in batch.seq_ids.iter().zip(batch.positions) {
                stage.truncate_seq(seq, pos.max(0) as usize);
            }
        }
    }
}

impl From<Stage> for StageChain {
    fn from(stage: Stage) -> StageChain {
        StageChain::from(StageGroup::from(stage))
    }
}

impl From<StageGroup> for StageChain {
    fn from(group: StageGroup) -> StageChain {
        let span = group.stage().span().clone();
        StageChain {
            stages: vec![group],
            span,
        }
    }
}
