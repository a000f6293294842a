//! An in-process tensor-parallel group: members 1.. of a stage on threads of their
//! own, driven by member 0 ([`crate::Stage::load_tp`]). Every member claims the same
//! cache cells for the same batches (its cache bookkeeping is a replica of member 0's),
//! so only the batch goes out and only logits come back.

use std::sync::mpsc::{channel, Receiver, Sender};
use std::thread::JoinHandle;

use crate::stage::{Batch, Stage, StageInput, StageOutput};
use crate::tp::{CollectiveError, TpSplit};
use crate::weights::ModelFile;
use crate::ModelError;

/// The splits of a group of `n` over a model of `file` (every member computes the same).
pub fn splits(file: &ModelFile, n: usize) -> Result<Vec<TpSplit>, ModelError> {
    (0..n).map(|rank| TpSplit::new(file.hparams(), rank, n)).collect()
}

/// The members' logits (each `[its vocabulary rows, n_rows]`, in rank order) joined
/// into `[n_vocab, n_rows]`.
pub fn join_logits(parts: &[Vec<f32>], n_rows: usize) -> Vec<f32> {
    let widths: Vec<usize> = parts.iter().map(|p| p.len() / n_rows.max(1)).collect();
    let mut joined = Vec::with_capacity(parts.iter().map(Vec::len).sum());
    for row in 0..n_rows {
        for (part, &width) in parts.iter().zip(&widths) {
            joined.extend_from_slice(&part[row * width..(row + 1) * width]);
        }
    }
    joined
}

/// A batch that owns its data, to send to another thread.
struct OwnedBatch {
    tokens: Option<Vec<u32>>,
    hidden: Option<Vec<f32>>,
    positions: Vec<i32>,
    seq_ids: Vec<u32>,
    logit_rows: Vec<u32>,
}

enum Job {
    Forward(OwnedBatch),
    Truncate { seq: u32, len: usize },
}

/// Another member of a stage's tensor-parallel group, driven by member 0: a thread of
/// this process ([`Stage::load_tp`]) or a process behind a link. For each batch member 0
/// calls [`send_forward`](Self::send_forward) on every member, computes its own share
/// (the members sum with each other meanwhile), then [`recv`](Self::recv) on every
/// member, in rank order.
pub trait GroupMember: Send {
    /// Starts the member on `batch`.
    fn send_forward(&mut self, batch: &Batch<'_>) -> Result<(), ModelError>;
    /// The member's output for the batch last sent: logits of its vocabulary share on a
    /// last stage, else the hidden state (which member 0 has too, and drops).
    fn recv(&mut self) -> Result<StageOutput, ModelError>;
    /// Keeps only the tokens of `seq` below position `len` in the member's cache.
    fn truncate_seq(&mut self, seq: u32, len: usize) -> Result<(), ModelError>;
}

/// A member of the group on its own thread.
pub(crate) struct Helper {
    jobs: Option<Sender<Job>>,
    results: Receiver<Result<StageOutput, ModelError>>,
    thread: Option<JoinHandle<()>>,
}

impl Helper {
    /// Moves `stage` (a member) to a thread of its own.
    pub(crate) fn start(mut stage: Stage) -> Result<Helper, ModelError> {
        let (jobs, inbox) = channel::<Job>();
        let (outbox, results) = channel();
        let rank = stage.tp_split().map_or(0, |s| s.rank);
        let thread = std::thread::Builder::new()
            .name(format!("tp-member-{rank}"))
            .spawn(move || {
                for job in inbox {
                    match job {
                        Job::Forward(b) => {
                            let input = match (&b.tokens, &b.hidden) {
                                (Some(tokens), _) => StageInput::Tokens(tokens),
                                (None, Some(hidden)) => StageInput::Hidden(hidden),
                                (None, None) => unreachable!("send_forward sets one input"),
                            };
                            let batch = Batch {
                                input,
                                positions: &b.positions,
                                seq_ids: &b.seq_ids,
                                logit_rows: &b.logit_rows,
                            };
                            let result =
                                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| stage.forward_member(&batch)))
                                    .unwrap_or_else(|_| {
                                        // Release the members waiting for this one's slices.
                                        stage.abort_group("a member thread panicked");
                                        Err(ModelError::Collective(CollectiveError::Aborted(format!(
                                            "tensor-parallel member {rank} panicked"
                                        ))))
                                    });
                            if outbox.send(result).is_err() {
                                return;
                            }
                        }
                        Job::Truncate { seq, len } => stage.truncate_seq(seq, len),
                    }
                }
            })
            .map_err(|e| ModelError::BadConfig(format!("cannot start a tensor-parallel member thread: {e}")))?;
        Ok(Helper {
            jobs: Some(jobs),
            results,
            thread: Some(thread),
        })
    }
}

impl GroupMember for Helper {
    fn send_forward(&mut self, batch: &Batch<'_>) -> Result<(), ModelError> {
        let (tokens, hidden) = match batch.input {
            StageInput::Tokens(t) => (Some(t.to_vec()), None),
            StageInput::Hidden(h) => (None, Some(h.to_vec())),
        };
        let job = Job::Forward(OwnedBatch {
            tokens,
            hidden,
            positions: batch.positions.to_vec(),
            seq_ids: batch.seq_ids.to_vec(),
            logit_rows: batch.logit_rows.to_vec(),
        });
        // A member thread only ends when its channel closes (or it panicked, which
        // `recv` reports).
        let _ = self.jobs.as_ref().map(|jobs| jobs.send(job));
        Ok(())
    }

    fn recv(&mut self) -> Result<StageOutput, ModelError> {
        self.results.recv().map_err(|_| {
            ModelError::Collective(CollectiveError::Aborted("a tensor-parallel member thread ended".into()))
        })?
    }

    fn truncate_seq(&mut self, seq: u32, len: usize) -> Result<(), ModelError> {
        let _ = self.jobs.as_ref().map(|jobs| jobs.send(Job::Truncate { seq, len }));
        Ok(())
    }
}

impl Drop for Helper {
    fn drop(&mut self) {
        self.jobs.take();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logits_join_row_by_row_in_rank_order() {
        // Two rows; member 0 has vocabulary [0, 2), member 1 [2, 5).
        let parts = vec![vec![0., 1., 10., 11.], vec![2., 3., 4., 12., 13., 14.]];
        assert_eq!(
            join_logits(&parts, 2),
            vec![0., 1., 2., 3., 4., 10., 11., 12., 13., 14.]
        );
    }
}
