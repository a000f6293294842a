//! A draft model run by the head: a small model with the target's vocabulary, all its
//! layers in one stage with a KV region per slot, drafting greedily.
//!
//! It computes every row in the shape the target computes it (prompts in the same
//! chunks, generated tokens in groups of at most `max_decode_rows`), so a draft model
//! that *is* the target drafts exactly what the target then samples.

use std::collections::HashMap;
use std::path::Path;

use baton_model::{Batch, LogitReply, ModelError, ModelFile, Stage, StageConfig, StageInput, StageOutput, StageSpan};
use baton_sample::argmax;

use super::draft::Drafter;
use super::max_decode_rows;
use super::slots::common_prefix;

/// The head's draft model.
pub struct ModelDrafter {
    stage: Stage,
    /// Per sequence, the tokens whose cells the draft cache holds.
    fed: HashMap<u32, Vec<u32>>,
    chunk: usize,
    cap: usize,
}

impl ModelDrafter {
    /// Loads the model at `path` for `n_slots` sequences of up to `slot_ctx` tokens,
    /// cutting prompts in chunks of `chunk` as the engine does; its vocabulary must have
    /// `n_vocab` tokens, as the target's.
    pub fn load(
        path: &Path,
        n_vocab: usize,
        n_slots: usize,
        slot_ctx: usize,
        chunk: usize,
        threads: usize,
        repack: bool,
    ) -> Result<ModelDrafter, ModelError> {
        let file = ModelFile::open(path)?;
        let hp = file.hparams();
        if hp.n_vocab != n_vocab {
            return Err(ModelError::BadConfig(format!(
                "the draft model {} has a vocabulary of {} tokens, the model {n_vocab}: a draft model must \
                 share the model's tokenizer",
                path.display(),
                hp.n_vocab
            )));
        }
        let span = StageSpan {
            layers: 0..hp.n_layer,
            first: true,
            last: true,
        };
        let config = StageConfig {
            n_ctx: slot_ctx * n_slots,
            n_threads: threads,
            repack,
            n_seq: n_slots,
            kv_types: Default::default(),
            n_ubatch: baton_model::DEFAULT_UBATCH.max(chunk),
        };
        Ok(ModelDrafter {
            stage: Stage::load(file, span, &config)?,
            fed: HashMap::new(),
            chunk: chunk.max(1),
            cap: max_decode_rows(repack),
        })
    }

    /// Runs `tokens` at positions `start..` of `seq` in one batch; the last row's logits.
    fn step(&mut self, seq: u32, tokens: &[u32], start: usize) -> Result<Vec<f32>, ModelError> {
        let positions: Vec<i32> = (start..start + tokens.len()).map(|p| p as i32).collect();
        let seq_ids = vec![seq; tokens.len()];
        let batch = Batch {
            input: StageInput::Tokens(tokens),
            positions: &positions,
            seq_ids: &seq_ids,
            logit_rows: &[tokens.len() as u32 - 1],
            decode: false,
        };
        match self.stage.forward(&batch, LogitReply::Logits)? {
            StageOutput::Logits(logits) => Ok(logits),
            StageOutput::Hidden(_) | StageOutput::Best(_) | StageOutput::Normed(_) => {
                Err(ModelError::BadConfig("the draft stage returned no logits".into()))
            }
        }
    }

    /// Brings the cache of `seq` to `tokens`: keeps the cached prefix (down to a chunk
    /// boundary inside the prompt), computes the rest in the target's shapes, and returns
    /// the last token's logits.
    fn catch_up(&mut self, seq: u32, tokens: &[u32], n_prompt: usize) -> Result<Vec<f32>, ModelError> {
        let fed = self.fed.remove(&seq).unwrap_or_default();
        let mut keep = common_prefix(&fed, tokens).min(tokens.len() - 1);
        if keep < n_prompt {
            keep -= keep % self.chunk;
        }
        // A draft model with recurrent layers returns only to a state it kept (a draft's
        // rollback); elsewhere it computes the sequence again.
        if !self.stage.recurrent().has_state(seq, keep) {
            keep = 0;
        }
        self.stage.truncate_seq(seq, keep);
        let mut logits = Vec::new();
        let mut at = keep;
        while at < tokens.len() {
            let end = if at < n_prompt {
                ((at / self.chunk + 1) * self.chunk).min(n_prompt)
            } else {
                (at + self.cap).min(tokens.len())
            };
            logits = self.step(seq, &tokens[at..end], at)?;
            at = end;
        }
        self.fed.insert(seq, tokens.to_vec());
        Ok(logits)
    }

    fn try_draft(&mut self, seq: u32, tokens: &[u32], n_prompt: usize, max: usize) -> Result<Vec<u32>, ModelError> {
        let mut logits = self.catch_up(seq, tokens, n_prompt)?;
        let mut drafted = Vec::with_capacity(max);
        while drafted.len() < max {
            let Some(token) = argmax(&logits) else { break };
            drafted.push(token);
            if drafted.len() == max {
                break;
            }
            let at = tokens.len() + drafted.len() - 1;
            logits = self.step(seq, &[token], at)?;
            if let Some(fed) = self.fed.get_mut(&seq) {
                fed.push(token);
            }
        }
        Ok(drafted)
    }
}

impl Drafter for ModelDrafter {
    fn draft(&mut self, seq: u32, tokens: &[u32], n_prompt: usize, max: usize) -> Vec<u32> {
        if tokens.is_empty() || max == 0 {
            return Vec::new();
        }
        match self.try_draft(seq, tokens, n_prompt, max) {
            Ok(drafted) => drafted,
            Err(e) => {
                // No draft is always a correct answer; the sequence's cache is rebuilt
                // from scratch next time.
                tracing::warn!(seq, "the draft model failed: {e}");
                self.forget(seq);
                Vec::new()
            }
        }
    }

    fn forget(&mut self, seq: u32) {
        self.fed.remove(&seq);
        self.stage.clear_seq(seq);
    }
}
