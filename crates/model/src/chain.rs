//! Several stages behind one worker: consecutive layer ranges, each on its own device
//! (say a GPU and the CPU), computed one after another in one thread. The hidden state
//! goes from one to the next in host memory (read back from one device, written to the
//! next), never over a socket.

use crate::stage::{Batch, Stage, StageInput, StageOutput};
use crate::weights::StageSpan;
use crate::ModelError;

/// Stages of consecutive layer ranges, run in order as one.
pub struct StageChain {
    stages: Vec<Stage>,
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
        Ok(StageChain { stages, span })
    }

    /// The layers and roles of the whole chain.
    pub fn span(&self) -> &StageSpan {
        &self.span
    }

    /// The stages, in layer order.
    pub fn stages(&self) -> &[Stage] {
        &self.stages
    }

    /// Whether any stage copied weights into repacked layouts.
    pub fn repacked(&self) -> bool {
        self.stages.iter().any(Stage::repacked)
    }

    /// Forgets a sequence's cells from position `len` on, in every stage.
    pub fn truncate_seq(&mut self, seq: u32, len: usize) {
        self.stages.iter_mut().for_each(|s| s.truncate_seq(seq, len));
    }

    /// Forgets a sequence in every stage.
    pub fn clear_seq(&mut self, seq: u32) {
        self.stages.iter_mut().for_each(|s| s.clear_seq(seq));
    }

    /// KV cells in use (every stage holds the same positions; the first is asked).
    pub fn kv_used(&self) -> usize {
        self.stages[0].kv().n_used()
    }

    /// Bytes the stages hold now, on their devices and in host memory together.
    pub fn resident_bytes(&self) -> u64 {
        self.stages.iter().map(Stage::resident_bytes).sum()
    }

    /// Runs the batch through every stage in order. When a later stage fails, the cells
    /// the earlier ones claimed for the batch are given back (by position, as the
    /// worker forgets rows it computed before a failure).
    pub fn forward(&mut self, batch: &Batch<'_>) -> Result<StageOutput, ModelError> {
        self.run(batch, Stage::forward)
    }

    /// [`forward`](Self::forward) on a chain ending the model, returning each logit
    /// row's arg-max token only ([`Stage::forward_best`]).
    pub fn forward_best(&mut self, batch: &Batch<'_>) -> Result<Vec<u32>, ModelError> {
        self.run(batch, Stage::forward_best)
    }

    /// Members in the tensor-parallel group of the chain's last stage (1: none).
    pub fn last_tp_size(&self) -> usize {
        self.stages.last().map_or(1, Stage::tp_size)
    }

    /// The batch through every stage but the last, then `last` on the last.
    fn run<T>(
        &mut self,
        batch: &Batch<'_>,
        last: impl FnOnce(&mut Stage, &Batch<'_>) -> Result<T, ModelError>,
    ) -> Result<T, ModelError> {
        let n = self.stages.len();
        let mut hidden: Option<Vec<f32>> = None;
        for i in 0..n {
            let step = Batch {
                input: match &hidden {
                    Some(h) => StageInput::Hidden(h),
                    None => batch.input,
                },
                logit_rows: if i + 1 == n { batch.logit_rows } else { &[] },
                ..*batch
            };
            let result = match i + 1 == n {
                true => return last(&mut self.stages[i], &step).inspect_err(|_| self.forget(i, batch)),
                false => self.stages[i].forward(&step),
            };
            match result {
                Ok(StageOutput::Hidden(h)) => hidden = Some(h),
                Ok(StageOutput::Logits(_)) => {
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
        let span = stage.span().clone();
        StageChain {
            stages: vec![stage],
            span,
        }
    }
}
