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

/// Vocabularies up to this size send each row's best as `[value, token]` in f32 (a
/// token id is exact in an f32 below 2^24); larger ones send whole rows.
pub const BEST_MAX_VOCAB: usize = 1 << 24;

/// A member's share of each logit row reduced to its best: `[value, token]` per row,
/// the token a global id (`first_token` is the share's first), or `[-inf, -1]` for a
/// share of only NaN. Member 0 joins these with [`join_best`].
pub fn encode_best(logits: &[f32], n_rows: usize, first_token: u32) -> Vec<f32> {
    let width = logits.len() / n_rows.max(1);
    let mut best = Vec::with_capacity(2 * n_rows);
    for row in logits.chunks_exact(width.max(1)).take(n_rows) {
        match baton_sample::argmax_value(row) {
            Some((token, value)) => best.extend([value, (first_token + token) as f32]),
            None => best.extend([f32::NEG_INFINITY, -1.0]),
        }
    }
    best
}

/// Each row's arg-max over the whole vocabulary from the members' bests (in rank order,
/// so shares in vocabulary order): the largest value, the lowest token among equal ones,
/// exactly what the arg-max of the joined row gives. A part that is not `n_rows` pairs
/// of a value (not NaN) and a whole token below `n_vocab` is refused (it may have come
/// from another process).
pub fn join_best(parts: &[Vec<f32>], n_rows: usize, n_vocab: usize) -> Result<Vec<u32>, ModelError> {
    let bad = |why: String| ModelError::Collective(CollectiveError::Aborted(why));
    let mut best: Vec<Option<(u32, f32)>> = vec![None; n_rows];
    for (rank, part) in parts.iter().enumerate() {
        if part.len() != 2 * n_rows {
            return Err(bad(format!(
                "member {rank} sent {} values for the best of {n_rows} rows",
                part.len()
            )));
        }
        for (row, pair) in part.chunks_exact(2).enumerate() {
            let (value, token) = (pair[0], pair[1]);
            if token == -1.0 {
                continue;
            }
            if value.is_nan() || token.fract() != 0.0 || !(0.0..n_vocab as f32).contains(&token) {
                return Err(bad(format!("member {rank} sent ({value}, {token}) as a row's best")));
            }
            let token = token as u32;
            match best[row] {
                Some((_, held)) if value <= held => {}
                _ => best[row] = Some((token, value)),
            }
        }
    }
    best.into_iter()
        .map(|b| {
            b.map(|(token, _)| token)
                .ok_or_else(|| bad("a logit row of only NaN".into()))
        })
        .collect()
}

/// What a member of a last stage's group answers for the batch's logit rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogitReply {
    /// Its share of each row's logits, for member 0 to join.
    Share,
    /// Each row's best of its share, `[value, token]` ([`encode_best`]): enough for
    /// greedy sampling without penalties, and a few bytes instead of the share.
    Best,
}

/// A batch that owns its data, to send to another thread.
struct OwnedBatch {
    tokens: Option<Vec<u32>>,
    hidden: Option<Vec<f32>>,
    positions: Vec<i32>,
    seq_ids: Vec<u32>,
    logit_rows: Vec<u32>,
    /// What to answer for the logit rows.
    reply: LogitReply,
}

enum Job {
    Forward(Box<OwnedBatch>),
    Truncate { seq: u32, len: usize },
}

/// Another member of a stage's tensor-parallel group, driven by member 0: a thread of
/// this process ([`Stage::load_tp`]) or a process behind a link. For each batch member 0
/// calls [`send_forward`](Self::send_forward) on every member, computes its own share
/// (the members sum with each other meanwhile), then [`recv`](Self::recv) on every
/// member, in rank order.
pub trait GroupMember: Send {
    /// Starts the member on `batch`; its logit rows (on a last stage) are to come back
    /// as `reply` says.
    fn send_forward(&mut self, batch: &Batch<'_>, reply: LogitReply) -> Result<(), ModelError>;
    /// The member's output for the batch last sent: its logit rows on a last stage (as
    /// asked), else the hidden state (which member 0 has too, and drops).
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
                            let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                                stage.forward_share(&batch, b.reply)
                            }))
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
    fn send_forward(&mut self, batch: &Batch<'_>, reply: LogitReply) -> Result<(), ModelError> {
        let (tokens, hidden) = match batch.input {
            StageInput::Tokens(t) => (Some(t.to_vec()), None),
            StageInput::Hidden(h) => (None, Some(h.to_vec())),
        };
        let job = Job::Forward(Box::new(OwnedBatch {
            tokens,
            hidden,
            positions: batch.positions.to_vec(),
            seq_ids: batch.seq_ids.to_vec(),
            logit_rows: batch.logit_rows.to_vec(),
            reply,
        }));
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

    /// The joined bests are the arg-max of the joined rows, ties to the lower token
    /// (the first share's), a share of only NaN skipped, a row of only -inf its first.
    #[test]
    fn members_bests_join_to_the_rows_arg_max() {
        let nan = f32::NAN;
        let ninf = f32::NEG_INFINITY;
        // Three rows over a vocabulary of 5: member 0 holds [0, 2), member 1 [2, 5).
        let rows: [[f32; 5]; 4] = [
            [0.5, 3.0, 1.0, 3.0, 2.0],
            [nan, nan, 1.0, -2.0, 7.0],
            [ninf, ninf, ninf, ninf, ninf],
            [9.0, nan, 9.5, nan, 9.5],
        ];
        let share = |range: std::ops::Range<usize>| -> Vec<f32> {
            rows.iter().flat_map(|r| r[range.clone()].to_vec()).collect()
        };
        let parts = vec![encode_best(&share(0..2), 4, 0), encode_best(&share(2..5), 4, 2)];
        let joined = join_best(&parts, 4, 5).unwrap();
        let whole: Vec<u32> = rows.iter().map(|r| baton_sample::argmax(r).unwrap()).collect();
        assert_eq!(joined, whole);
        assert_eq!(joined, vec![1, 4, 0, 2]);
        // What another process sends is checked.
        for bad in [
            vec![1.0, 7.0],
            vec![nan, 1.0],
            vec![1.0, 2.5],
            vec![1.0, -3.0],
            vec![1.0],
        ] {
            let err = join_best(std::slice::from_ref(&bad), 1, 5).unwrap_err().to_string();
            assert!(err.contains("member 0 sent"), "{bad:?}: {err}");
        }
        let err = join_best(&[vec![ninf, -1.0]], 1, 5).unwrap_err().to_string();
        assert!(err.contains("only NaN"), "{err}");
    }

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
