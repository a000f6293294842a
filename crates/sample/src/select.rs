//! Truncation stages (top-k, top-p, min-p) over candidate tokens.
//!
//! Candidates are ranked by logit, then by lower id. The id tie-break makes the order
//! total, so which tokens survive never depends on the selection algorithm or on how
//! much of the list happened to be sorted.

use std::cmp::Ordering;

use crate::math;
use crate::row::{PenalizedRow, Piece};

/// A token still in the running, with its (penalized) logit. Never NaN.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Candidate {
    pub(crate) token: u32,
    pub(crate) logit: f32,
}

/// Best first: higher logit, then lower id.
pub(crate) fn rank(a: &Candidate, b: &Candidate) -> Ordering {
    // Candidates are never NaN, so `Equal` is only reached for equal logits (0.0 and
    // -0.0 included, as in the comparisons `TopK` makes against its threshold).
    b.logit
        .partial_cmp(&a.logit)
        .unwrap_or(Ordering::Equal)
        .then(a.token.cmp(&b.token))
}

/// Replaces `out` with the `k` best non-NaN tokens of `row` whose logit is at least
/// `floor` (all of them when `k` is at least the row length), in no particular order.
pub(crate) fn top_k(row: &PenalizedRow, k: usize, floor: f32, out: &mut Vec<Candidate>) {
    out.clear();
    if k == 0 {
        return;
    }
    let mut selector = TopK::new(k, floor, out);
    for piece in row.pieces() {
        match piece {
            Piece::Stretch { first, logits } => selector.offer_stretch(first, logits),
            Piece::One { token, logit } => selector.offer(token, logit),
        }
    }
    selector.finish();
}

/// Streaming top-k: collect into a buffer of a few times `k`; when it fills, keep the
/// best `k` and from then on refuse anything not strictly above the k-th logit. For
/// a peaked row nearly the whole vocabulary is refused, in blocks tested at once.
struct TopK<'a> {
    k: usize,
    capacity: usize,
    out: &'a mut Vec<Candidate>,
    /// The floor until the first prune, then the logit of the k-th best so far.
    threshold: f32,
    /// Whether `threshold` is the k-th best, which admits only strictly greater logits.
    pruned: bool,
}

impl<'a> TopK<'a> {
    fn new(k: usize, floor: f32, out: &'a mut Vec<Candidate>) -> Self {
        let capacity = k.saturating_mul(2).max(k.saturating_add(256));
        Self {
            k,
            capacity,
            out,
            threshold: floor,
            pruned: false,
        }
    }

    #[inline]
    fn offer(&mut self, token: u32, logit: f32) {
        // Tokens arrive in ascending id order, so one equal to the k-th best ranks below
        // it and can be refused. Both tests are false for NaN.
        let wanted = if self.pruned {
            logit > self.threshold
        } else {
            logit >= self.threshold
        };
        if wanted {
            self.out.push(Candidate { token, logit });
            if self.out.len() >= self.capacity {
                self.prune();
            }
        }
    }

    fn offer_stretch(&mut self, first: u32, logits: &[f32]) {
        const BLOCK: usize = 16;
        let mut blocks = logits.chunks_exact(BLOCK);
        let mut at = 0;
        for block in &mut blocks {
            // `|` rather than `any` so the test has no early exit and vectorises. `>=`
            // in both phases lets through a superset of what `offer` keeps.
            let threshold = self.threshold;
            if block.iter().fold(false, |seen, &logit| seen | (logit >= threshold)) {
                for (offset, &logit) in block.iter().enumerate() {
                    self.offer(first + (at + offset) as u32, logit);
                }
            }
            at += BLOCK;
        }
        for (offset, &logit) in blocks.remainder().iter().enumerate() {
            self.offer(first + (at + offset) as u32, logit);
        }
    }

    fn prune(&mut self) {
        self.out.select_nth_unstable_by(self.k - 1, rank);
        self.out.truncate(self.k);
        self.threshold = self.out[self.k - 1].logit;
        self.pruned = true;
    }

    fn finish(mut self) {
        if self.out.len() > self.k {
            self.prune();
        }
    }
}

/// Keeps the shortest best-first prefix of `candidates` whose probability reaches `p`,
/// like llama.cpp's top-p (the token that crosses `p` stays). Probabilities are
/// `exp(logit - max) / sum`, with `sum` taken over the candidates top-p was given, which
/// may be more than `candidates` holds now (min-p may have run first). Leaves the
/// survivors sorted best first. Only as much of the list is sorted as the prefix
/// needs: a few dozen tokens for a peaked distribution instead of the whole vocabulary.
pub(crate) fn top_p(candidates: &mut Vec<Candidate>, p: f32, max: f32, sum: f64) {
    let p = f64::from(p);
    let len = candidates.len();
    let mut cumulative = 0.0f64;
    let mut sorted = 0usize;
    let mut chunk = 64usize;
    while sorted < len {
        let end = sorted.saturating_add(chunk).min(len);
        if end < len {
            candidates[sorted..].select_nth_unstable_by(end - sorted - 1, rank);
        }
        candidates[sorted..end].sort_unstable_by(rank);
        for at in sorted..end {
            cumulative += f64::from(math::exp(candidates[at].logit - max)) / sum;
            if cumulative >= p {
                candidates.truncate(at + 1);
                return;
            }
        }
        sorted = end;
        chunk = chunk.saturating_mul(4);
    }
}

/// Drops candidates less likely than `p` times the most likely one, by llama.cpp's test
/// on logits: keep `logit >= max + ln p`.
pub(crate) fn min_p(candidates: &mut Vec<Candidate>, p: f32, max: f32) {
    let threshold = max + p.ln();
    candidates.retain(|candidate| candidate.logit >= threshold);
}

/// `Σ exp(logit - max)` over the candidates, in f64 because it may sum 262k terms.
pub(crate) fn exp_sum(candidates: &[Candidate], max: f32) -> f64 {
    math::sum_mapped(candidates, |candidate| math::exp(candidate.logit - max))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sorted_top(logits: &[f32], k: usize) -> Vec<Candidate> {
        let mut all: Vec<Candidate> = logits
            .iter()
            .enumerate()
            .filter(|(_, l)| !l.is_nan())
            .map(|(token, &logit)| Candidate {
                token: token as u32,
                logit,
            })
            .collect();
        all.sort_by(rank);
        all.truncate(k);
        all
    }

    /// Small deterministic pseudo-random logits with many ties.
    fn logits(len: usize, levels: u64, seed: u64) -> Vec<f32> {
        let mut state = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (0..len)
            .map(|_| {
                state = state
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let level = (state >> 33) % levels;
                if level == 0 {
                    f32::NAN
                } else {
                    level as f32 * 0.25 - 3.0
                }
            })
            .collect()
    }

    #[test]
    fn top_k_matches_a_full_sort_including_ties() {
        for (len, levels) in [(10, 3), (1000, 5), (5000, 40), (3000, 1000)] {
            let logits = logits(len, levels, len as u64);
            for k in [1, 2, 5, 40, 300, len - 1, len, len + 5] {
                let mut out = Vec::new();
                top_k(&PenalizedRow::new(&logits, &[]), k, f32::NEG_INFINITY, &mut out);
                out.sort_by(rank);
                assert_eq!(out, sorted_top(&logits, k), "len {len} levels {levels} k {k}");
            }
        }
    }

    #[test]
    fn top_k_sees_overrides() {
        let logits = [5.0, 4.0, 3.0, 2.0];
        let overrides = [(0, 1.0)];
        let mut out = Vec::new();
        top_k(&PenalizedRow::new(&logits, &overrides), 2, f32::NEG_INFINITY, &mut out);
        out.sort_by(rank);
        assert_eq!(
            out,
            [Candidate { token: 1, logit: 4.0 }, Candidate { token: 2, logit: 3.0 }]
        );
    }

    #[test]
    fn top_p_keeps_the_token_that_crosses_p() {
        // Probabilities 0.5, 0.3, 0.2 (in scrambled order).
        let mut candidates: Vec<Candidate> = [(0, 0.2f32), (1, 0.5), (2, 0.3)]
            .iter()
            .map(|&(token, p)| Candidate { token, logit: p.ln() })
            .collect();
        let max = 0.5f32.ln();
        let sum = exp_sum(&candidates, max);
        let mut kept = candidates.clone();
        top_p(&mut kept, 0.5, max, sum);
        assert_eq!(kept.iter().map(|c| c.token).collect::<Vec<_>>(), [1]);
        let mut kept = candidates.clone();
        top_p(&mut kept, 0.6, max, sum);
        assert_eq!(kept.iter().map(|c| c.token).collect::<Vec<_>>(), [1, 2]);
        top_p(&mut candidates, 0.95, max, sum);
        assert_eq!(candidates.iter().map(|c| c.token).collect::<Vec<_>>(), [1, 2, 0]);
    }

    #[test]
    fn top_p_over_many_candidates_matches_a_full_sort() {
        let logits = logits(20_000, 200, 7);
        let mut all = Vec::new();
        top_k(
            &PenalizedRow::new(&logits, &[]),
            usize::MAX,
            f32::NEG_INFINITY,
            &mut all,
        );
        let max = all.iter().map(|c| c.logit).fold(f32::NEG_INFINITY, f32::max);
        let sum = exp_sum(&all, max);
        for p in [0.01, 0.3, 0.9, 0.999, 1.0] {
            let mut expected = all.clone();
            expected.sort_by(rank);
            let mut cumulative = 0.0;
            let cut = expected
                .iter()
                .position(|c| {
                    cumulative += f64::from(math::exp(c.logit - max)) / sum;
                    cumulative >= f64::from(p)
                })
                .map_or(expected.len(), |at| at + 1);
            expected.truncate(cut);
            let mut kept = all.clone();
            top_p(&mut kept, p, max, sum);
            assert_eq!(kept, expected, "p {p}");
        }
    }

    #[test]
    fn min_p_keeps_tokens_at_least_p_times_the_best() {
        // Probabilities proportional to 1, 0.5, 0.1, 0.04.
        let mut candidates: Vec<Candidate> = [1.0f32, 0.5, 0.1, 0.04]
            .iter()
            .enumerate()
            .map(|(token, &weight)| Candidate {
                token: token as u32,
                logit: weight.ln(),
            })
            .collect();
        min_p(&mut candidates, 0.05, 0.0);
        assert_eq!(candidates.iter().map(|c| c.token).collect::<Vec<_>>(), [0, 1, 2]);
        min_p(&mut candidates, 0.4, 0.0);
        assert_eq!(candidates.iter().map(|c| c.token).collect::<Vec<_>>(), [0, 1]);
    }
}
