//! Speculative decoding on the head: where drafted tokens come from, and how many to
//! send through the ring with a sequence's next token.
//!
//! A decode step normally carries one token per sequence. With a draft, it carries the
//! token and up to K tokens guessed to follow it; the last stage samples each row in
//! turn and keeps the drafted tokens its own samples agree with (see
//! `StageWorker::sample`), so one pass through the ring can yield up to K + 1 tokens.
//! The samples are the ones decoding without a draft would draw (each row is computed
//! in the shape a one-token step has, and each sample makes the same random draw), so
//! the text is the same with or without speculation, greedy or seeded.

use std::collections::HashMap;

/// Where a request's drafted tokens come from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DraftMode {
    /// No speculation.
    #[default]
    Off,
    /// Prompt lookup: the tokens that followed the latest earlier occurrence of the
    /// sequence's last few tokens in its own context (no extra model).
    Ngram,
    /// A small model with the same vocabulary, run greedily by the head.
    Model,
}

impl std::fmt::Display for DraftMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            DraftMode::Off => "off",
            DraftMode::Ngram => "ngram",
            DraftMode::Model => "model",
        })
    }
}

impl std::str::FromStr for DraftMode {
    type Err = String;

    fn from_str(s: &str) -> Result<DraftMode, String> {
        match s {
            "off" => Ok(DraftMode::Off),
            "ngram" => Ok(DraftMode::Ngram),
            "model" => Ok(DraftMode::Model),
            other => Err(format!("unknown draft source '{other}': expected off, ngram or model")),
        }
    }
}

/// A request's speculation settings.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Draft {
    /// Where drafts come from.
    pub mode: DraftMode,
    /// Most drafted tokens per step (the engine sends fewer where they do not pay).
    pub max: usize,
    /// Always draft `max` tokens (where the source has them) instead of what the
    /// measured times and acceptance say pays (for tests and measurements).
    pub fixed: bool,
}

impl Draft {
    /// No speculation.
    pub const OFF: Draft = Draft {
        mode: DraftMode::Off,
        max: 0,
        fixed: false,
    };
}

/// Most tokens drafted per step, whatever is asked.
pub const MAX_DRAFT: usize = 16;

/// A source of drafted tokens that keeps state per sequence (a draft model's cache).
pub trait Drafter: Send {
    /// Up to `max` tokens likely to follow `tokens` (the whole sequence so far, its
    /// first `n_prompt` the prompt) in sequence `seq`.
    fn draft(&mut self, seq: u32, tokens: &[u32], n_prompt: usize, max: usize) -> Vec<u32>;
    /// Sequence `seq` is over (its slot may start another).
    fn forget(&mut self, seq: u32);
}

/// The longest n-gram, from `MAX_NGRAM` down to `MIN_NGRAM` tokens, that ends the
/// context and occurred before: the tokens that followed its latest earlier occurrence.
pub fn ngram_draft(tokens: &[u32], max: usize) -> Vec<u32> {
    const MIN_NGRAM: usize = 2;
    const MAX_NGRAM: usize = 4;
    let len = tokens.len();
    if max == 0 {
        return Vec::new();
    }
    for n in (MIN_NGRAM..=MAX_NGRAM).rev() {
        if len <= n {
            continue;
        }
        let suffix = &tokens[len - n..];
        if let Some(start) = (0..len - n).rev().find(|&s| &tokens[s..s + n] == suffix) {
            let follow = &tokens[start + n..(start + n + max).min(len)];
            if !follow.is_empty() {
                return follow.to_vec();
            }
        }
    }
    Vec::new()
}

/// How many tokens to draft: what maximizes expected tokens per second, from the
/// measured time of decode steps by their number of rows and the acceptance rate.
///
/// A step of `r` rows takes `T(r)`: the ring's latency plus the stages' compute, which
/// grows with the rows. With acceptance rate `a` per drafted token, a draft of `k`
/// yields `E(k) = 1 + a + … + a^k` tokens on average, so the best `k` maximizes
/// `E(k) / T(k + 1)`; 0 when drafting does not pay (low acceptance, compute-bound
/// stages). Times are smoothed per row count; a count not measured yet is estimated
/// from the nearest measured ones, and tried once the estimate makes it look best.
#[derive(Debug, Default)]
pub struct DraftPolicy {
    /// Smoothed seconds per decode step, by rows in the step (index = rows).
    step_secs: Vec<Option<f64>>,
    /// Smoothed acceptance of drafted tokens per mode, the prior of a new sequence.
    acceptance: HashMap<DraftModeKey, f64>,
}

type DraftModeKey = u8;

fn key(mode: DraftMode) -> DraftModeKey {
    mode as u8
}

/// Weight of a new measurement in the smoothed values.
const SMOOTHING: f64 = 0.2;
/// Acceptance assumed before anything was measured (optimistic, so drafts get tried).
const PRIOR_ACCEPTANCE: f64 = 0.6;

impl DraftPolicy {
    /// A decode step of `rows` rows took `secs` from send to reply.
    pub fn record_step(&mut self, rows: usize, secs: f64) {
        if rows == 0 || !secs.is_finite() || secs <= 0.0 {
            return;
        }
        if self.step_secs.len() <= rows {
            self.step_secs.resize(rows + 1, None);
        }
        let slot = &mut self.step_secs[rows];
        *slot = Some(slot.map_or(secs, |old| old + SMOOTHING * (secs - old)));
    }

    /// `accepted` of `drafted` tokens of a `mode` draft were kept.
    pub fn record_draft(&mut self, mode: DraftMode, drafted: usize, accepted: usize) {
        if drafted == 0 {
            return;
        }
        let rate = accepted as f64 / drafted as f64;
        let entry = self.acceptance.entry(key(mode)).or_insert(PRIOR_ACCEPTANCE);
        *entry += SMOOTHING * (rate - *entry);
    }

    /// The acceptance a new sequence drafting with `mode` starts from.
    pub fn prior(&self, mode: DraftMode) -> f64 {
        self.acceptance.get(&key(mode)).copied().unwrap_or(PRIOR_ACCEPTANCE)
    }

    /// Estimated seconds of a step of `rows` rows; `None` before any step was measured.
    pub fn estimate(&self, rows: usize) -> Option<f64> {
        let known: Vec<(usize, f64)> = self
            .step_secs
            .iter()
            .enumerate()
            .filter_map(|(r, t)| t.map(|t| (r, t)))
            .collect();
        if let Some(&(_, t)) = known.iter().find(|(r, _)| *r == rows) {
            return Some(t);
        }
        let below = known.iter().rev().find(|(r, _)| *r < rows).copied();
        let above = known.iter().find(|(r, _)| *r > rows).copied();
        match (below, above) {
            (Some((r0, t0)), Some((r1, t1))) => Some(t0 + (t1 - t0) * (rows - r0) as f64 / (r1 - r0) as f64),
            // Only fewer rows measured: extrapolate the slope of the two largest, or
            // assume nothing is gained per row past what is known (optimistic: the
            // step gets tried and measured).
            (Some((r0, t0)), None) => {
                let slope = known
                    .iter()
                    .rev()
                    .nth(1)
                    .map_or(0.0, |&(r, t)| ((t0 - t) / (r0 - r) as f64).max(0.0));
                Some(t0 + slope * (rows - r0) as f64)
            }
            (None, Some((r1, t1))) => Some(t1 * rows as f64 / r1 as f64),
            (None, None) => None,
        }
    }

    /// How many tokens to draft (at most `max`) for a sequence whose drafts are kept at
    /// rate `acceptance`.
    pub fn choose(&self, acceptance: f64, max: usize) -> usize {
        let Some(one) = self.estimate(1) else {
            // Nothing measured yet: a step without a draft first.
            return 0;
        };
        let a = acceptance.clamp(0.0, 0.999);
        let mut best = (1.0 / one, 0);
        let mut expected = 1.0;
        let mut power = 1.0;
        for k in 1..=max.min(MAX_DRAFT) {
            power *= a;
            expected += power;
            let Some(secs) = self.estimate(k + 1) else { break };
            let rate = expected / secs;
            // A draft must pay clearly, or the noise of the timing decides.
            if rate > best.0 * 1.02 {
                best = (rate, k);
            }
        }
        best.1
    }
}

/// A sequence's drafting state on the head.
#[derive(Debug, Clone, Copy)]
pub struct SeqDraft {
    /// The request's settings.
    pub draft: Draft,
    /// Smoothed share of drafted tokens kept.
    pub acceptance: f64,
}

impl SeqDraft {
    /// Records that `accepted` of `drafted` tokens were kept.
    pub fn record(&mut self, drafted: usize, accepted: usize) {
        if drafted > 0 {
            let rate = accepted as f64 / drafted as f64;
            self.acceptance += 0.3 * (rate - self.acceptance);
        }
    }
}

/// All draft sources of an engine.
pub struct Drafters {
    /// The head's draft model, if it has one.
    pub model: Option<Box<dyn Drafter>>,
}

impl Drafters {
    /// Up to `max` drafted tokens for `seq` from the source `mode` names.
    pub fn draft(&mut self, mode: DraftMode, seq: u32, tokens: &[u32], n_prompt: usize, max: usize) -> Vec<u32> {
        let mut drafted = match mode {
            DraftMode::Off => Vec::new(),
            DraftMode::Ngram => ngram_draft(tokens, max),
            DraftMode::Model => match self.model.as_mut() {
                Some(model) => model.draft(seq, tokens, n_prompt, max),
                None => Vec::new(),
            },
        };
        drafted.truncate(max);
        drafted
    }

    /// Sequence `seq` is over.
    pub fn forget(&mut self, seq: u32) {
        if let Some(model) = self.model.as_mut() {
            model.forget(seq);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ngram_drafts_follow_the_latest_earlier_occurrence() {
        // (context, max) -> draft
        let cases: [(&[u32], usize, &[u32]); 7] = [
            (&[1, 2, 3, 4, 9, 1, 2, 3], 4, &[4, 9, 1, 2]),
            (&[1, 2, 3, 4, 9, 1, 2, 3], 2, &[4, 9]),
            // The latest occurrence wins.
            (&[5, 6, 7, 5, 6, 8, 5, 6], 3, &[8, 5, 6]),
            // A longer match beats a more recent shorter one.
            (&[1, 2, 3, 7, 9, 2, 3, 8, 1, 2, 3], 1, &[7]),
            // Nothing repeats, or only single tokens repeat.
            (&[1, 2, 3, 4], 4, &[]),
            (&[1, 2, 1, 3, 1], 4, &[]),
            (&[1, 2, 1, 2], 0, &[]),
        ];
        for (context, max, want) in cases {
            assert_eq!(ngram_draft(context, max), want, "{context:?} max {max}");
        }
    }

    fn policy(steps: &[(usize, f64)]) -> DraftPolicy {
        let mut policy = DraftPolicy::default();
        for &(rows, secs) in steps {
            policy.record_step(rows, secs);
        }
        policy
    }

    #[test]
    #[allow(clippy::type_complexity)] // a table of cases
    fn drafts_pay_where_the_link_dominates_and_not_where_compute_does() {
        // (measured steps, acceptance, max) -> draft length
        let cases: [(&[(usize, f64)], f64, usize, usize); 7] = [
            // Nothing measured: a plain step first.
            (&[], 0.9, 8, 0),
            // A slow link (45 ms a pass), compute 20 ms a step, +5 ms per extra row.
            (&[(1, 0.065), (5, 0.085)], 0.9, 8, 8),
            (&[(1, 0.065), (5, 0.085)], 0.5, 8, 2),
            // Nothing is ever accepted: no draft.
            (&[(1, 0.065), (5, 0.085)], 0.0, 8, 0),
            // Compute-bound (loopback, CPU): each row costs a step.
            (&[(1, 0.020), (5, 0.100)], 0.9, 8, 0),
            // Only one-row steps measured: drafting is tried (optimistic estimate).
            (&[(1, 0.065)], 0.6, 4, 4),
            // A cap is a cap.
            (&[(1, 0.065), (5, 0.085)], 0.9, 2, 2),
        ];
        for (i, (steps, acceptance, max, want)) in cases.into_iter().enumerate() {
            assert_eq!(policy(steps).choose(acceptance, max), want, "case {i}");
        }
    }

    #[test]
    fn step_times_are_smoothed_and_interpolated() {
        let mut p = policy(&[(1, 0.010), (5, 0.030)]);
        assert!((p.estimate(3).unwrap() - 0.020).abs() < 1e-12, "interpolated");
        assert!((p.estimate(7).unwrap() - 0.040).abs() < 1e-12, "extrapolated");
        p.record_step(1, 0.020);
        assert!((p.estimate(1).unwrap() - 0.012).abs() < 1e-12);
        assert_eq!(DraftPolicy::default().estimate(1), None);
    }

    #[test]
    fn acceptance_priors_follow_what_was_measured() {
        let mut p = DraftPolicy::default();
        assert_eq!(p.prior(DraftMode::Ngram), PRIOR_ACCEPTANCE);
        for _ in 0..50 {
            p.record_draft(DraftMode::Ngram, 4, 0);
        }
        assert!(p.prior(DraftMode::Ngram) < 0.01);
        assert_eq!(p.prior(DraftMode::Model), PRIOR_ACCEPTANCE, "per mode");
    }
}
