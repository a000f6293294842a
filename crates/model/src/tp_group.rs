//! The other members of a tensor-parallel group as member 0 sees them
//! ([`GroupMember`]): threads of this process ([`crate::StageGroup::load_tp`]) or
//! processes behind links; and how their answers join. Every member claims the same
//! cache cells for the same batches (its cache bookkeeping is a replica of member 0's),
//! so only the batch goes out and only logits (or each row's best) come back.

use std::sync::mpsc::{channel, Receiver, Sender};
use std::thread::JoinHandle;

use crate::stage::{Batch, LogitReply, RowBest, Stage, StageInput, StageOutput};
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

/// Vocabularies up to this size have their members send each row's best (a member
/// behind a link sends it as `[logit, token]` in f32, and a token id is exact in an f32
/// below 2^24); larger ones send their shares of the logits.
pub const BEST_MAX_VOCAB: usize = 1 << 24;

/// Rows' bests as a member behind a link sends them: `[logit, token]` per row, and
/// `[-inf, -1]` for a row of only NaN. [`decode_best`] reads them back.
pub fn encode_best(best: &[Option<RowBest>]) -> Vec<f32> {
    best.iter()
        .flat_map(|b| match b {
            Some(b) => [b.logit, b.token as f32],
            None => [f32::NEG_INFINITY, -1.0],
        })
        .collect()
}

/// The bests of `n_rows` rows from what member `rank` sent ([`encode_best`]). Anything
/// but `n_rows` pairs of a logit (not NaN) and a whole token id (or `[-inf, -1]`) is
/// refused: it comes from another process.
pub fn decode_best(values: &[f32], n_rows: usize, rank: usize) -> Result<Vec<Option<RowBest>>, CollectiveError> {
    if values.len() != 2 * n_rows {
        return Err(bad_best(
            rank,
            format!("{} values for the best of {n_rows} rows", values.len()),
        ));
    }
    values
        .chunks_exact(2)
        .map(|pair| match (pair[0], pair[1]) {
            (_, -1.0) => Ok(None),
            (logit, token) if !logit.is_nan() && token.fract() == 0.0 && (0.0..16_777_216.0).contains(&token) => {
                Ok(Some(RowBest {
                    token: token as u32,
                    logit,
                }))
            }
            (logit, token) => Err(bad_best(rank, format!("({logit}, {token}) as a row's best"))),
        })
        .collect()
}

fn bad_best(rank: usize, what: String) -> CollectiveError {
    CollectiveError::Aborted(format!("member {rank} sent {what}"))
}

/// Each row's best over the whole vocabulary from the members' bests (in rank order, so
/// shares in vocabulary order): the largest logit, the lowest token among equal ones,
/// exactly what the arg-max of the joined row gives; `None` where every share was only
/// NaN. A part of another length than `n_rows`, or with a token outside `n_vocab`, is
/// refused.
pub fn join_best(
    parts: &[Vec<Option<RowBest>>],
    n_rows: usize,
    n_vocab: usize,
) -> Result<Vec<Option<RowBest>>, CollectiveError> {
    let mut best: Vec<Option<RowBest>> = vec![None; n_rows];
    for (rank, part) in parts.iter().enumerate() {
        if part.len() != n_rows {
            return Err(bad_best(rank, format!("{} bests for {n_rows} rows", part.len())));
        }
        for (held, theirs) in best.iter_mut().zip(part) {
            let Some(theirs) = theirs else { continue };
            if theirs.token as usize >= n_vocab || theirs.logit.is_nan() {
                let (logit, token) = (theirs.logit, theirs.token);
                return Err(bad_best(rank, format!("({logit}, {token}) as a row's best")));
            }
            if held.is_none_or(|held| theirs.logit > held.logit) {
                *held = Some(*theirs);
            }
        }
    }
    Ok(best)
}

/// A batch that owns its data, to send to another thread.
struct OwnedBatch {
    tokens: Option<Vec<u32>>,
    hidden: Option<Vec<f32>>,
    positions: Vec<i32>,
    seq_ids: Vec<u32>,
    logit_rows: Vec<u32>,
    decode: bool,
    /// What to answer for the logit rows.
    reply: LogitReply,
}

enum Job {
    Forward(Box<OwnedBatch>),
    Truncate { seq: u32, len: usize },
}

/// Another member of a stage's tensor-parallel group, driven by member 0: a thread of
/// this process ([`crate::StageGroup::load_tp`]) or a process behind a link. For each
/// batch member 0 calls [`send_forward`](Self::send_forward) on every member, computes its own share
/// (the members sum with each other meanwhile), then [`recv`](Self::recv) on every
/// member, in rank order.
pub trait GroupMember: Send {
    /// Starts the member on `batch`; its logit rows (on a last stage) are to come back
    /// as `reply` says.
    fn send_forward(&mut self, batch: &Batch<'_>, reply: LogitReply) -> Result<(), ModelError>;
    /// The member's output for the batch last sent: its share of the logit rows, or of
    /// each row's best, on a last stage (as asked), else the hidden state (which member
    /// 0 has too, and drops).
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
                                decode: b.decode,
                            };
                            let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                                stage.forward(&batch, b.reply)
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
            decode: batch.decode,
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
        // Each member's bests cross a link: encoded, then read back.
        let sent = |range: std::ops::Range<usize>, rank: usize| {
            let best = RowBest::of_rows(&share(range.clone()), 4, range.start as u32);
            decode_best(&encode_best(&best), 4, rank).unwrap()
        };
        let parts = vec![sent(0..2, 0), sent(2..5, 1)];
        let joined = RowBest::tokens(&join_best(&parts, 4, 5).unwrap()).unwrap();
        let whole: Vec<u32> = rows.iter().map(|r| baton_sample::argmax(r).unwrap()).collect();
        assert_eq!(joined, whole);
        assert_eq!(joined, vec![1, 4, 0, 2]);
        // What another process sends is checked.
        for bad in [vec![nan, 1.0], vec![1.0, 2.5], vec![1.0, -3.0], vec![1.0]] {
            let err = decode_best(&bad, 1, 0).unwrap_err().to_string();
            assert!(err.contains("member 0 sent"), "{bad:?}: {err}");
        }
        let outside = decode_best(&[1.0, 7.0], 1, 0).unwrap();
        let err = join_best(&[outside], 1, 5).unwrap_err().to_string();
        assert!(err.contains("member 0 sent"), "{err}");
        let only_nan = join_best(&[decode_best(&[ninf, -1.0], 1, 0).unwrap()], 1, 5).unwrap();
        let err = RowBest::tokens(&only_nan).unwrap_err().to_string();
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
