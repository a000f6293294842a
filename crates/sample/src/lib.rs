//! Token sampling on the last pipeline stage, behaving like llama.cpp's default chain
//! (`common/sampling`): penalties → top-k → top-p → min-p → temperature → draw, or the
//! arg-max after penalties when the temperature is zero or negative.
//!
//! Vocabularies run to 262k entries and this runs once per token, so the row of logits
//! is never copied: penalties replace the values of the few ids in the recent window
//! (`row`), greedy is a single pass, and truncation selects survivors rather than
//! sorting the vocabulary (`select`).
//!
//! ```
//! use baton_sample::{Sampler, SamplingParams};
//!
//! let mut sampler = Sampler::new(SamplingParams { seed: 42, ..Default::default() })?;
//! for token in [1, 2, 3] {
//!     sampler.accept(token); // the prompt, so that penalties see it
//! }
//! let logits = [0.1, 2.0, -1.0, 0.5];
//! let token = sampler.sample(&logits)?;
//! sampler.accept(token);
//! # Ok::<(), baton_sample::SamplingError>(())
//! ```
#![deny(unsafe_code)]

mod budget;
mod math;
mod params;
mod row;
mod sampler;
mod select;

pub use budget::{utf8_complete, BudgetTracker, ReasoningBudget, MAX_BUDGET_ENDS, MAX_BUDGET_SEQ};
pub use params::SamplingParams;
pub use row::{argmax, argmax_value};
pub use sampler::{Sampled, Sampler};

/// Why a token could not be sampled, or why parameters were refused.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SamplingError {
    /// A parameter outside the range llama.cpp accepts (or NaN).
    #[error("invalid sampling parameter {field} = {value}: {expected}")]
    InvalidParameter {
        /// The field of [`SamplingParams`], as spelled there.
        field: &'static str,
        /// The value that was refused.
        value: f32,
        /// What the field accepts.
        expected: &'static str,
    },
    /// A row of logits with no entries.
    #[error("cannot sample from an empty row of logits")]
    EmptyLogits,
    /// Every logit in the row is NaN, so no token can be preferred over another.
    #[error("all {n_vocab} logits are NaN")]
    AllNan {
        /// Length of the row.
        n_vocab: usize,
    },
    /// A row longer than 32-bit token ids can index.
    #[error("a row of {n_vocab} logits is too long for 32-bit token ids")]
    VocabTooLarge {
        /// Length of the row.
        n_vocab: usize,
    },
}
