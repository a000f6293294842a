//! A stage as the ring sees it: one [`Stage`], or member 0 of a tensor-parallel group
//! leading the others. Member 0 sends each batch to every other member, computes its
//! own slice meanwhile (the members exchange inside each layer through their
//! [`crate::Collective`]), then gathers the members' shares of the logit rows and joins
//! them. A group of one is its stage alone.

use std::sync::Arc;

use crate::stage::{Batch, LogitReply, RowBest, Stage, StageConfig, StageOutput};
use crate::tp::CollectiveError;
use crate::tp_group::{join_best, join_logits, GroupMember, Helper, BEST_MAX_VOCAB};
use crate::weights::{ModelFile, StageSpan};
use crate::ModelError;

/// A stage led by member 0 of its tensor-parallel group (or a whole stage: a group of
/// one), computing like one whole stage would (up to summation order).
pub struct StageGroup {
    /// Members 1.., in rank order: threads of this process or processes behind links.
    /// Declared first so they stop before member 0's state goes.
    others: Vec<Box<dyn GroupMember>>,
    stage: Stage,
}

impl From<Stage> for StageGroup {
    /// A whole stage, or a member that leads no one.
    fn from(stage: Stage) -> StageGroup {
        StageGroup::new(stage, Vec::new())
    }
}

impl StageGroup {
    /// Member 0 `stage` leading `others` (ranks 1.., in order), each loaded with the
    /// same span and configuration.
    pub fn new(stage: Stage, others: Vec<Box<dyn GroupMember>>) -> StageGroup {
        StageGroup { others, stage }
    }

    /// A group of `n` members in this process on the CPU, each with
    /// `config.n_threads` threads: member 0 computes on the calling thread, members
    /// 1.. on threads of their own. Each member maps the file on its own. `n <= 1`: a
    /// whole stage ([`Stage::load`]).
    pub fn load_tp(
        file: Arc<ModelFile>,
        span: StageSpan,
        config: &StageConfig,
        n: usize,
    ) -> Result<StageGroup, ModelError> {
        if n <= 1 {
            return Stage::load(file, span, config).map(StageGroup::from);
        }
        let splits = crate::tp_group::splits(&file, n)?;
        let collectives = crate::tp::LocalGroup::members(n);
        let mut members: Vec<Stage> = std::thread::scope(|scope| {
            let loads: Vec<_> = splits
                .into_iter()
                .zip(collectives)
                .map(|(split, collective)| {
                    let (span, path) = (span.clone(), file.path().to_path_buf());
                    scope.spawn(move || {
                        let file = ModelFile::open(&path)?;
                        Stage::load_member(file, span, config, Some((split, collective)))
                    })
                })
                .collect();
            loads
                .into_iter()
                .map(|h| h.join().expect("member loader panicked"))
                .collect::<Result<_, _>>()
        })?;
        let others = members
            .drain(1..)
            .map(|m| Helper::start(m).map(|h| Box::new(h) as Box<dyn GroupMember>))
            .collect::<Result<Vec<_>, _>>()?;
        let first = members.pop().expect("n > 1 members were loaded");
        Ok(StageGroup::new(first, others))
    }

    /// Member 0's stage (the whole stage in a group of one).
    pub fn stage(&self) -> &Stage {
        &self.stage
    }

    /// Members of the group, member 0 included.
    pub fn size(&self) -> usize {
        1 + self.others.len()
    }

    /// Forgets every token of `seq`, in every member's cache.
    pub fn clear_seq(&mut self, seq: u32) {
        self.truncate_seq(seq, 0);
    }

    /// Keeps only the tokens of `seq` at positions below `len`, in every member's cache.
    pub fn truncate_seq(&mut self, seq: u32, len: usize) {
        for member in &mut self.others {
            if let Err(e) = member.truncate_seq(seq, len) {
                // The next forward fails on that member and says why.
                tracing::debug!(error = %e, "tensor-parallel member did not truncate");
            }
        }
        self.stage.truncate_seq(seq, len);
    }

    /// Keeps a copy of `seq`'s recurrent states after `len` positions. A
    /// tensor-parallel group holds none (models with recurrent layers are refused
    /// one), so only the stage's own are kept.
    pub fn checkpoint_seq(&mut self, seq: u32, len: usize) -> Result<(), ModelError> {
        self.stage.checkpoint_seq(seq, len)
    }

    /// Runs the group over one batch and returns what a whole stage would: its logit
    /// rows on a last stage as `reply` asks (whole rows, or each row's best of the
    /// whole vocabulary).
    pub fn forward(&mut self, batch: &Batch<'_>, reply: LogitReply) -> Result<StageOutput, ModelError> {
        if self.others.is_empty() {
            return self.stage.forward(batch, reply);
        }
        let n_vocab = self.stage.weights().file().hparams().n_vocab;
        let asked = match reply {
            LogitReply::Best | LogitReply::Normed if n_vocab <= BEST_MAX_VOCAB => LogitReply::Best,
            _ => LogitReply::Logits,
        };
        let sent: Vec<_> = self.others.iter_mut().map(|m| m.send_forward(batch, asked)).collect();
        if let Some(Err(e)) = sent.into_iter().find(Result::is_err) {
            self.stage.abort_group(&e.to_string());
            return Err(e);
        }
        // Embeddings: every member holds the whole hidden state after the last layer's
        // exchange, so member 0 alone applies the output norm; the others, which compute
        // their layers' shares with it, answer with their share of the logits (the least
        // they can say), which is dropped.
        let mine = match reply {
            LogitReply::Normed => self.stage.forward(batch, LogitReply::Normed),
            _ => self.stage.forward(batch, asked),
        };
        let theirs: Vec<_> = self.others.iter_mut().map(|m| m.recv()).collect();
        let mine = mine?;
        let theirs = theirs.into_iter().collect::<Result<Vec<_>, _>>()?;
        if let StageOutput::Normed(normed) = mine {
            return Ok(StageOutput::Normed(normed));
        }
        let n_rows = batch.logit_rows.len();
        let joined = match mine {
            StageOutput::Logits(logits) if n_rows > 0 => {
                let parts = std::iter::once(Ok(logits))
                    .chain(theirs.into_iter().enumerate().map(|(i, out)| match out {
                        StageOutput::Logits(share) => Ok(share),
                        other => Err(unexpected(i + 1, &other, "its share of the logits")),
                    }))
                    .collect::<Result<Vec<_>, _>>()?;
                StageOutput::Logits(join_logits(&parts, n_rows))
            }
            StageOutput::Best(best) if n_rows > 0 => {
                let parts = std::iter::once(Ok(best))
                    .chain(theirs.into_iter().enumerate().map(|(i, out)| match out {
                        StageOutput::Best(best) => Ok(best),
                        other => Err(unexpected(i + 1, &other, "its best of each row")),
                    }))
                    .collect::<Result<Vec<_>, _>>()?;
                StageOutput::Best(join_best(&parts, n_rows, n_vocab)?)
            }
            // A middle stage's members each hold the whole hidden state: member 0's goes on.
            out => out,
        };
        Ok(match (reply, joined) {
            (LogitReply::Best, StageOutput::Logits(logits)) => StageOutput::Best(RowBest::of_rows(&logits, n_rows, 0)),
            (_, out) => out,
        })
    }
}

/// A member answered with something other than what member 0 asked for.
fn unexpected(rank: usize, got: &StageOutput, due: &str) -> ModelError {
    let got = match got {
        StageOutput::Hidden(_) => "a hidden state",
        StageOutput::Logits(_) => "logits",
        StageOutput::Best(_) => "row bests",
        StageOutput::Normed(_) => "normed rows",
    };
    ModelError::Collective(CollectiveError::Peer {
        peer: rank,
        reason: format!("{got} where {due} was due"),
    })
}
