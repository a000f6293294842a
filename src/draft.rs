//! `--draft`, `--draft-max` and `--draft-model`: speculative decoding flags shared by
//! `run`, `bench` and `serve`.

use std::path::PathBuf;

use anyhow::Context as _;
use baton_engine::draft::MAX_DRAFT;
use baton_engine::{Draft, DraftMode, Drafter, ModelDrafter};
use clap::Args;

/// Speculative decoding settings.
#[derive(Args, Clone, Debug)]
pub struct DraftArgs {
    /// Speculative decoding: send tokens guessed by `ngram` (prompt lookup in the
    /// sequence's own context) or `model` (--draft-model) through the ring with each
    /// token, and keep those the model agrees with; `off` sends one token per pass. The
    /// text is the same either way. Default: `model` with --draft-model, else `off`.
    #[arg(long, value_parser = parse_mode)]
    pub draft: Option<DraftMode>,
    /// Most tokens drafted per pass (fewer are sent where they do not pay).
    #[arg(long, default_value_t = 8)]
    pub draft_max: usize,
    /// A small GGUF model sharing the model's tokenizer, run by the head to draft.
    #[arg(long)]
    pub draft_model: Option<PathBuf>,
    /// Always draft --draft-max tokens instead of as many as measured step times and
    /// acceptance say pay (for tests and measurements).
    #[arg(long)]
    pub draft_fixed: bool,
}

fn parse_mode(s: &str) -> Result<DraftMode, String> {
    s.parse()
}

impl DraftArgs {
    /// The settings requests get unless they say otherwise.
    pub fn settings(&self) -> anyhow::Result<Draft> {
        anyhow::ensure!(
            self.draft_max <= MAX_DRAFT,
            "--draft-max must be between 0 and {MAX_DRAFT}"
        );
        let mode = match (self.draft, &self.draft_model) {
            (Some(DraftMode::Model), None) => anyhow::bail!("--draft model needs --draft-model FILE"),
            (Some(mode), _) => mode,
            (None, Some(_)) => DraftMode::Model,
            (None, None) => DraftMode::Off,
        };
        Ok(Draft {
            mode,
            max: self.draft_max,
            fixed: self.draft_fixed,
        })
    }

    /// Whether a draft model is given (--draft-model).
    pub fn has_model(&self) -> bool {
        self.draft_model.is_some()
    }

    /// Loads the draft model, if one is given, for `n_slots` sequences of `slot_ctx`
    /// tokens whose prompts are cut in chunks of `chunk`.
    pub fn load_model(
        &self,
        n_vocab: usize,
        n_slots: usize,
        slot_ctx: usize,
        chunk: usize,
        threads: usize,
        repack: bool,
    ) -> anyhow::Result<Option<Box<dyn Drafter>>> {
        let Some(path) = &self.draft_model else {
            return Ok(None);
        };
        let drafter = ModelDrafter::load(path, n_vocab, n_slots, slot_ctx, chunk, threads, repack)
            .with_context(|| format!("loading the draft model {}", path.display()))?;
        Ok(Some(Box::new(drafter)))
    }
}
