//! A row of logits as the sampler sees it: the model's values, with the few tokens in
//! the penalty window replaced by their penalized values. Penalties touch tens of ids
//! out of ~10^5, so the row is never copied; readers walk the untouched stretches as
//! plain slices and the replaced ids one at a time.

/// Logits plus penalized replacements for a few ids.
pub(crate) struct PenalizedRow<'a> {
    logits: &'a [f32],
    /// `(token, penalized logit)`, strictly ascending by token, every token in range.
    overrides: &'a [(u32, f32)],
}

/// A piece of a [`PenalizedRow`], in ascending token order.
pub(crate) enum Piece<'a> {
    /// Untouched logits; the first one belongs to token `first`.
    Stretch { first: u32, logits: &'a [f32] },
    /// One replaced logit.
    One { token: u32, logit: f32 },
}

impl<'a> PenalizedRow<'a> {
    /// `overrides` must be strictly ascending by token and within `logits`; the sampler
    /// builds them from an ordered map, so this only guards against refactoring slips.
    pub(crate) fn new(logits: &'a [f32], overrides: &'a [(u32, f32)]) -> Self {
        debug_assert!(overrides.windows(2).all(|pair| pair[0].0 < pair[1].0));
        debug_assert!(overrides.iter().all(|&(token, _)| (token as usize) < logits.len()));
        Self { logits, overrides }
    }

    /// Number of tokens in the row.
    pub(crate) fn len(&self) -> usize {
        self.logits.len()
    }

    /// The (possibly penalized) logit of `token`, which must be in range.
    pub(crate) fn get(&self, token: u32) -> f32 {
        match self.overrides.binary_search_by_key(&token, |&(id, _)| id) {
            Ok(at) => self.overrides[at].1,
            Err(_) => self.logits[token as usize],
        }
    }

    /// The row as stretches of untouched logits and single replaced ones, ascending.
    pub(crate) fn pieces(&self) -> impl Iterator<Item = Piece<'a>> + 'a {
        let logits = self.logits;
        let mut start = 0usize;
        let mut overrides = self.overrides.iter();
        let mut pending: Option<(u32, f32)> = None;
        std::iter::from_fn(move || {
            if let Some((token, logit)) = pending.take() {
                return Some(Piece::One { token, logit });
            }
            match overrides.next() {
                Some(&(token, logit)) => {
                    let end = token as usize;
                    let stretch = &logits[start..end];
                    let first = start as u32;
                    start = end + 1;
                    if stretch.is_empty() {
                        Some(Piece::One { token, logit })
                    } else {
                        pending = Some((token, logit));
                        Some(Piece::Stretch { first, logits: stretch })
                    }
                }
                None if start < logits.len() => {
                    let first = start as u32;
                    let stretch = &logits[start..];
                    start = logits.len();
                    Some(Piece::Stretch { first, logits: stretch })
                }
                None => None,
            }
        })
    }

    /// Calls `visit(token, logit)` for every token in ascending order.
    #[inline]
    pub(crate) fn for_each(&self, mut visit: impl FnMut(u32, f32)) {
        for piece in self.pieces() {
            match piece {
                Piece::Stretch { first, logits } => {
                    for (offset, &logit) in logits.iter().enumerate() {
                        visit(first + offset as u32, logit);
                    }
                }
                Piece::One { token, logit } => visit(token, logit),
            }
        }
    }

    /// The first token with the highest logit, NaN never winning; `None` if all are NaN.
    pub(crate) fn argmax(&self) -> Option<(u32, f32)> {
        let mut best: Option<(u32, f32)> = None;
        for piece in self.pieces() {
            let found = match piece {
                Piece::Stretch { first, logits } => argmax_slice(logits).map(|(at, logit)| (first + at as u32, logit)),
                Piece::One { token, logit } => (!logit.is_nan()).then_some((token, logit)),
            };
            // Pieces come in ascending token order, so a strict comparison keeps the
            // lowest id among equal maxima.
            if let Some((token, logit)) = found {
                if best.is_none_or(|(_, best_logit)| logit > best_logit) {
                    best = Some((token, logit));
                }
            }
        }
        best
    }

    /// `Σ exp(logit - max)` over the row, NaN counting as 0. `max` must be finite.
    pub(crate) fn sum_exp(&self, max: f32) -> f64 {
        let mut sum = 0.0f64;
        for piece in self.pieces() {
            sum += match piece {
                Piece::Stretch { logits, .. } => crate::math::sum_exp(logits, max),
                Piece::One { logit, .. } if logit.is_nan() => 0.0,
                Piece::One { logit, .. } => f64::from(crate::math::exp(logit - max)),
            };
        }
        sum
    }

    /// Log-softmax normaliser over the whole row.
    pub(crate) fn log_softmax(&self) -> Option<LogSoftmax> {
        let (_, max) = self.argmax()?;
        if max.is_infinite() {
            // exp(l - max) is NaN at the maximum itself; the limit of the distribution
            // is uniform over the tokens that hold it.
            let mut n_at_max = 0usize;
            self.for_each(|_, logit| n_at_max += usize::from(logit == max));
            return Some(LogSoftmax {
                max,
                log_sum: (n_at_max as f64).ln(),
            });
        }
        let sum = self.sum_exp(max);
        Some(LogSoftmax { max, log_sum: sum.ln() })
    }
}

/// `log p(token) = (logit - max) - ln Σ exp(logit_i - max)` over one row.
#[derive(Clone, Copy, Debug)]
pub(crate) struct LogSoftmax {
    max: f32,
    /// `ln Σ exp(logit_i - max)`; when `max` is infinite, `ln` of how many tokens hold it.
    log_sum: f64,
}

impl LogSoftmax {
    /// Log-probability of a token whose (penalized) logit is `logit`.
    pub(crate) fn logprob(&self, logit: f32) -> f32 {
        if logit.is_nan() {
            f32::NEG_INFINITY
        } else if self.max.is_infinite() {
            if logit == self.max {
                -self.log_sum as f32
            } else {
                f32::NEG_INFINITY
            }
        } else {
            (f64::from(logit - self.max) - self.log_sum) as f32
        }
    }
}

/// Index of the first maximum of `logits`; NaN never wins. `None` if `logits` is empty
/// or all NaN, or longer than 32-bit token ids can index. A row of only `-inf` yields
/// its first index.
pub fn argmax(logits: &[f32]) -> Option<u32> {
    argmax_value(logits).map(|(at, _)| at)
}

/// [`argmax`] with the maximum's value: `(index, value)`. A tensor-parallel group's
/// members each take it over their share of the vocabulary, and the best of those (the
/// lowest index among equal values, as here) is the whole row's arg-max.
pub fn argmax_value(logits: &[f32]) -> Option<(u32, f32)> {
    if u32::try_from(logits.len()).is_err() {
        return None;
    }
    argmax_slice(logits).map(|(at, value)| (at as u32, value))
}

/// Single-pass arg-max returning `(index, value)`.
fn argmax_slice(logits: &[f32]) -> Option<(usize, f32)> {
    // Independent lanes break the loop-carried dependency of a scalar arg-max, which lets
    // the compiler keep the lanes in vector registers; each lane keeps its first maximum
    // (strict `>`), and merging prefers the lower index on ties.
    const LANES: usize = 16;
    let mut best = [f32::NEG_INFINITY; LANES];
    let mut at = [u32::MAX; LANES];
    let chunks = logits.chunks_exact(LANES);
    let tail = chunks.remainder();
    let tail_start = logits.len() - tail.len();
    for (chunk_index, chunk) in chunks.enumerate() {
        let base = (chunk_index * LANES) as u32;
        for lane in 0..LANES {
            let take = chunk[lane] > best[lane];
            best[lane] = if take { chunk[lane] } else { best[lane] };
            at[lane] = if take { base + lane as u32 } else { at[lane] };
        }
    }
    let mut winner: Option<(usize, f32)> = None;
    for lane in 0..LANES {
        if at[lane] == u32::MAX {
            continue;
        }
        let (index, value) = (at[lane] as usize, best[lane]);
        let better = match winner {
            None => true,
            Some((w_index, w_value)) => value > w_value || (value == w_value && index < w_index),
        };
        if better {
            winner = Some((index, value));
        }
    }
    for (offset, &value) in tail.iter().enumerate() {
        // Like the lanes, only values above -inf count here; see the fallback below.
        if value > winner.map_or(f32::NEG_INFINITY, |(_, w_value)| w_value) {
            winner = Some((tail_start + offset, value));
        }
    }
    // Nothing beat -inf: the row is NaN and -inf only, and the first -inf is the answer.
    match winner {
        Some(found) => Some(found),
        None => logits
            .iter()
            .position(|value| !value.is_nan())
            .map(|at| (at, logits[at])),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive_argmax(logits: &[f32]) -> Option<usize> {
        let mut best: Option<usize> = None;
        for (i, &v) in logits.iter().enumerate() {
            if v.is_nan() {
                continue;
            }
            if best.is_none_or(|b| v > logits[b]) {
                best = Some(i);
            }
        }
        best
    }

    #[test]
    fn argmax_picks_the_first_maximum() {
        assert_eq!(argmax(&[1.0, 3.0, 2.0]), Some(1));
        assert_eq!(argmax(&[3.0, 1.0, 3.0]), Some(0));
        assert_eq!(argmax(&[]), None);
    }

    #[test]
    fn argmax_ignores_nan() {
        assert_eq!(argmax(&[f32::NAN, 1.0, f32::NAN, 0.5]), Some(1));
        assert_eq!(argmax(&[f32::NAN, f32::NAN]), None);
        assert_eq!(argmax(&[f32::NAN, f32::NEG_INFINITY, f32::NEG_INFINITY]), Some(1));
        assert_eq!(argmax(&[f32::NEG_INFINITY, f32::INFINITY, f32::INFINITY]), Some(1));
    }

    #[test]
    fn lane_argmax_matches_a_scalar_one_at_every_length_and_position() {
        // Lengths around the lane width and ties spread over different lanes.
        for len in 0..70usize {
            for max_at in 0..len {
                for tie_at in [None, Some((max_at + 17) % len), Some((max_at + 1) % len)] {
                    let mut logits: Vec<f32> = (0..len).map(|i| ((i * 7919) % 13) as f32 * 0.1).collect();
                    if len > 3 {
                        logits[(max_at + 3) % len] = f32::NAN;
                    }
                    logits[max_at] = 5.0;
                    if let Some(tie) = tie_at {
                        logits[tie] = 5.0;
                    }
                    assert_eq!(
                        argmax_slice(&logits).map(|(i, _)| i),
                        naive_argmax(&logits),
                        "{logits:?}"
                    );
                }
            }
        }
    }

    #[test]
    fn pieces_cover_the_row_in_order_with_overrides_applied() {
        let logits = [0.0, 1.0, 2.0, 3.0, 4.0, 5.0];
        for overrides in [
            vec![],
            vec![(0, -1.0)],
            vec![(5, -1.0)],
            vec![(0, -1.0), (1, -2.0), (5, -3.0)],
            vec![(2, -1.0), (4, -2.0)],
        ] {
            let row = PenalizedRow::new(&logits, &overrides);
            let mut seen = Vec::new();
            row.for_each(|token, logit| seen.push((token, logit)));
            let expected: Vec<(u32, f32)> = (0..logits.len() as u32).map(|t| (t, row.get(t))).collect();
            assert_eq!(seen, expected);
            for &(token, logit) in &overrides {
                assert_eq!(seen[token as usize].1, logit);
            }
        }
    }

    #[test]
    fn row_argmax_sees_overrides_and_keeps_the_lowest_id_on_ties() {
        let logits = [1.0, 9.0, 2.0, 2.0];
        let overrides = [(1, 2.0)];
        let row = PenalizedRow::new(&logits, &overrides);
        // Token 1 now ties with 2 and 3 at 2.0; it is the lowest.
        assert_eq!(row.argmax(), Some((1, 2.0)));
        let overrides = [(1, 0.0)];
        assert_eq!(PenalizedRow::new(&logits, &overrides).argmax(), Some((2, 2.0)));
    }

    #[test]
    fn log_softmax_normalises() {
        let logits = [0.0, 2.0_f32.ln(), 3.0_f32.ln(), f32::NAN, f32::NEG_INFINITY];
        let row = PenalizedRow::new(&logits, &[]);
        let norm = row.log_softmax().unwrap();
        let probs: Vec<f32> = logits.iter().map(|&l| norm.logprob(l).exp()).collect();
        let expected = [1.0 / 6.0, 2.0 / 6.0, 3.0 / 6.0, 0.0, 0.0];
        for (p, e) in probs.iter().zip(expected) {
            assert!((p - e).abs() < 1e-6, "{probs:?}");
        }
    }

    #[test]
    fn log_softmax_with_infinite_logits_is_uniform_over_them() {
        let logits = [1.0, f32::INFINITY, f32::INFINITY];
        let norm = PenalizedRow::new(&logits, &[]).log_softmax().unwrap();
        assert_eq!(norm.logprob(1.0), f32::NEG_INFINITY);
        assert!((norm.logprob(f32::INFINITY) - 0.5f32.ln()).abs() < 1e-6);
    }
}
