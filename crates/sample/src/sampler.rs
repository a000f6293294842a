//! The per-sequence sampler: history for penalties, a seeded generator, scratch space.

use std::collections::{BTreeMap, VecDeque};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::math;
use crate::row::{PenalizedRow, Piece};
use crate::select::{self, Candidate};
use crate::{SamplingError, SamplingParams};

/// Chooses tokens for one sequence. Create one per sequence, [`accept`](Self::accept)
/// the prompt and every generated token, and call [`sample`](Self::sample) once per
/// step with the last row of logits.
///
/// Draws are reproducible for a given seed, parameters and history with the same
/// version of `rand` (its `StdRng` algorithm may change between major versions).
#[derive(Debug)]
pub struct Sampler {
    params: SamplingParams,
    rng: StdRng,
    /// The last `repeat_last_n` accepted tokens, oldest first.
    window: VecDeque<u32>,
    /// How often each token occurs in `window`. Ordered so that the penalized ids come
    /// out ascending, which is what `PenalizedRow` walks.
    counts: BTreeMap<u32, u32>,
    /// Scratch kept across calls so that the per-token path does not allocate.
    overrides: Vec<(u32, f32)>,
    candidates: Vec<Candidate>,
    weights: Vec<f32>,
}

/// A sampled token with log-probabilities from the model's distribution.
#[derive(Clone, Debug, PartialEq)]
pub struct Sampled {
    /// The chosen token.
    pub token: u32,
    /// Its log-probability under the penalized logits, before truncation and
    /// temperature (what OpenAI's `logprobs` reports).
    pub logprob: f32,
    /// The most likely tokens and their log-probabilities, most likely first, ties by
    /// lower id.
    pub top: Vec<(u32, f32)>,
}

impl Sampler {
    /// A sampler with an empty history, after checking `params`.
    pub fn new(params: SamplingParams) -> Result<Self, SamplingError> {
        params.validate()?;
        // Capped: `repeat_last_n` may come from a request, and the window grows on
        // demand anyway.
        let window = VecDeque::with_capacity(params.repeat_last_n.min(4096));
        Ok(Self {
            rng: StdRng::seed_from_u64(params.seed),
            params,
            window,
            counts: BTreeMap::new(),
            overrides: Vec::new(),
            candidates: Vec::new(),
            weights: Vec::new(),
        })
    }

    /// The parameters this sampler was made with.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Records a token as part of the sequence's history (prompt tokens and generated
    /// ones), for the penalties.
    pub fn accept(&mut self, token: u32) {
        let capacity = self.params.repeat_last_n;
        if capacity == 0 {
            return;
        }
        if self.window.len() == capacity {
            if let Some(oldest) = self.window.pop_front() {
                if let Some(count) = self.counts.get_mut(&oldest) {
                    *count -= 1;
                    if *count == 0 {
                        self.counts.remove(&oldest);
                    }
                }
            }
        }
        self.window.push_back(token);
        *self.counts.entry(token).or_insert(0) += 1;
    }

    /// Skips `n` draws of the generator, as if `n` tokens had been sampled: a sequence
    /// rebuilt elsewhere continues the random stream where it was (every non-greedy
    /// sample makes exactly one draw; greedy ones make none).
    pub fn skip_draws(&mut self, n: u32) {
        if self.params.is_greedy() {
            return;
        }
        for _ in 0..n {
            let _ = self.rng.random::<f64>();
        }
    }

    /// Forgets the history; the generator carries on where it was.
    pub fn reset_history(&mut self) {
        self.window.clear();
        self.counts.clear();
    }

    /// Chooses the next token from one row of logits (length `n_vocab`). The token is
    /// not accepted; call [`accept`](Self::accept) if it becomes part of the sequence.
    pub fn sample(&mut self, logits: &[f32]) -> Result<u32, SamplingError> {
        check_row(logits)?;
        self.penalize(logits);
        let row = PenalizedRow::new(logits, &self.overrides);
        choose(
            &row,
            &self.params,
            &mut self.rng,
            &mut self.candidates,
            &mut self.weights,
        )
    }

    /// Like [`sample`](Self::sample), also returning the chosen token's log-probability
    /// and the `n_top` most likely tokens, from the log-softmax of the penalized logits
    /// before truncation and temperature (the model's distribution, as OpenAI reports).
    pub fn sample_with_logprobs(&mut self, logits: &[f32], n_top: usize) -> Result<Sampled, SamplingError> {
        check_row(logits)?;
        self.penalize(logits);
        let row = PenalizedRow::new(logits, &self.overrides);
        let token = choose(
            &row,
            &self.params,
            &mut self.rng,
            &mut self.candidates,
            &mut self.weights,
        )?;
        let norm = row
            .log_softmax()
            .ok_or(SamplingError::AllNan { n_vocab: logits.len() })?;
        select::top_k(&row, n_top, f32::NEG_INFINITY, &mut self.candidates);
        self.candidates.sort_unstable_by(select::rank);
        let top = self
            .candidates
            .iter()
            .map(|candidate| (candidate.token, norm.logprob(candidate.logit)))
            .collect();
        Ok(Sampled {
            token,
            logprob: norm.logprob(row.get(token)),
            top,
        })
    }

    /// Fills `overrides` with the penalized logits of the tokens in the window, as
    /// llama.cpp's penalties sampler computes them.
    fn penalize(&mut self, logits: &[f32]) {
        self.overrides.clear();
        if !self.params.has_penalties() {
            return;
        }
        let params = &self.params;
        for (&token, &count) in &self.counts {
            // Ascending ids: once one is outside the vocabulary, all the rest are.
            let Some(&logit) = logits.get(token as usize) else {
                break;
            };
            let repeated = if logit <= 0.0 {
                logit * params.repeat_penalty
            } else {
                logit / params.repeat_penalty
            };
            let penalized = repeated - count as f32 * params.frequency_penalty - params.presence_penalty;
            self.overrides.push((token, penalized));
        }
    }
}

fn check_row(logits: &[f32]) -> Result<(), SamplingError> {
    if logits.is_empty() {
        return Err(SamplingError::EmptyLogits);
    }
    if u32::try_from(logits.len()).is_err() {
        return Err(SamplingError::VocabTooLarge { n_vocab: logits.len() });
    }
    Ok(())
}

/// The chain after penalties: arg-max when greedy, otherwise top-k → top-p → min-p →
/// temperature → draw.
fn choose(
    row: &PenalizedRow,
    params: &SamplingParams,
    rng: &mut StdRng,
    candidates: &mut Vec<Candidate>,
    weights: &mut Vec<f32>,
) -> Result<u32, SamplingError> {
    if params.is_greedy() {
        let (token, _) = row.argmax().ok_or(SamplingError::AllNan { n_vocab: row.len() })?;
        return Ok(token);
    }
    let temperature = params.temperature;
    // One draw per call whatever survives, so the stream of draws depends only on the
    // number of calls.
    let u = rng.random::<f64>();

    if top_k_len(params) >= row.len() && params.top_p >= 1.0 && params.min_p <= 0.0 {
        // Nothing to truncate: weigh the row in place, token id = index into `weights`.
        let (_, max) = row.argmax().ok_or(SamplingError::AllNan { n_vocab: row.len() })?;
        if max.is_finite() {
            let weight = |logit: f32| {
                // Computed before the test, so the loop is a select the compiler can
                // vectorise rather than a branch.
                let weight = math::exp((logit - max) / temperature);
                if logit.is_nan() {
                    0.0
                } else {
                    weight
                }
            };
            weights.clear();
            weights.resize(row.len(), 0.0);
            for piece in row.pieces() {
                match piece {
                    Piece::Stretch { first, logits } => {
                        let first = first as usize;
                        let out = &mut weights[first..first + logits.len()];
                        for (out, &logit) in out.iter_mut().zip(logits) {
                            *out = weight(logit);
                        }
                    }
                    Piece::One { token, logit } => weights[token as usize] = weight(logit),
                }
            }
            return Ok(math::draw(weights, u) as u32);
        }
    }

    let max = truncate(row, params, candidates)?;
    // The maximum always survives truncation, so `max` still anchors the softmax.
    weights.clear();
    weights.resize(candidates.len(), 0.0);
    for (weight, candidate) in weights.iter_mut().zip(candidates.iter()) {
        *weight = math::exp((candidate.logit - max) / temperature);
    }
    Ok(candidates[math::draw(weights, u)].token)
}

/// How many tokens top-k keeps; `usize::MAX` when it is disabled.
fn top_k_len(params: &SamplingParams) -> usize {
    usize::try_from(params.top_k)
        .ok()
        .filter(|&k| k > 0)
        .unwrap_or(usize::MAX)
}

/// Leaves in `candidates` the tokens that top-k, top-p and min-p let through (not
/// necessarily in order) and returns the logit the softmax is anchored to: the
/// maximum, or 0 where infinite logits were replaced.
fn truncate(
    row: &PenalizedRow,
    params: &SamplingParams,
    candidates: &mut Vec<Candidate>,
) -> Result<f32, SamplingError> {
    let all_nan = || SamplingError::AllNan { n_vocab: row.len() };
    let k = top_k_len(params);
    let mut floor = f32::NEG_INFINITY;
    let mut row_sum = None;
    if k >= row.len() && (params.min_p > 0.0 || params.top_p < 1.0) {
        // Without top-k every token is a candidate. Floors that min-p and top-p are
        // sure to apply spare gathering (and sorting) most of the vocabulary.
        let (_, max) = row.argmax().ok_or_else(all_nan)?;
        if max.is_finite() {
            if params.min_p > 0.0 {
                floor = max + params.min_p.ln();
            }
            if params.top_p < 1.0 {
                let sum = row.sum_exp(max);
                // A token of probability q <= (1 - p) / n has at most n q <= 1 - p of
                // mass at or below it, so more than p lies above it and top-p drops it.
                // Halved, so that rounding in the cumulative sum cannot matter.
                let n_vocab = row.len() as f64;
                let least = (1.0 - f64::from(params.top_p)) / (2.0 * n_vocab) * sum;
                floor = floor.max(max + least.ln() as f32);
                row_sum = Some(sum);
            }
        }
    }
    select::top_k(row, k, floor, candidates);
    if candidates.is_empty() {
        return Err(all_nan());
    }
    let mut max = candidates.iter().map(|c| c.logit).fold(f32::NEG_INFINITY, f32::max);
    if max.is_infinite() {
        // `logit - max` would be NaN at the maximum; the limiting distribution is
        // uniform over the tokens holding it (for -inf: over everything left).
        candidates.retain(|c| c.logit == max);
        candidates.iter_mut().for_each(|c| c.logit = 0.0);
        max = 0.0;
    }

    // top-p normalises over what top-k left, so the sum is taken before min-p. Running
    // min-p first is equivalent (both keep a best-first prefix, and the result is the
    // shorter one) and spares top-p from ordering tokens min-p would drop.
    let top_p_sum = match row_sum {
        Some(sum) => Some(sum),
        None => (params.top_p < 1.0).then(|| select::exp_sum(candidates, max)),
    };
    if params.min_p > 0.0 {
        select::min_p(candidates, params.min_p, max);
    }
    if let Some(sum) = top_p_sum {
        select::top_p(candidates, params.top_p, max, sum);
    }
    Ok(max)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn greedy() -> Sampler {
        Sampler::new(SamplingParams::greedy()).unwrap()
    }

    /// Stochastic sampling with every truncation stage off.
    fn unfiltered(temperature: f32, seed: u64) -> SamplingParams {
        SamplingParams {
            temperature,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed,
            ..Default::default()
        }
    }

    /// llama.cpp's chain written the slow, obvious way: sort everything, softmax in
    /// f64, cut. Returns the survivors best first.
    fn reference_survivors(logits: &[f32], params: &SamplingParams) -> Vec<u32> {
        let mut all: Vec<Candidate> = logits
            .iter()
            .enumerate()
            .filter(|(_, logit)| !logit.is_nan())
            .map(|(token, &logit)| Candidate {
                token: token as u32,
                logit,
            })
            .collect();
        all.sort_by(select::rank);
        if params.top_k > 0 {
            all.truncate(params.top_k as usize);
        }
        let max = all[0].logit;
        if params.top_p < 1.0 {
            let sum: f64 = all.iter().map(|c| f64::from(c.logit - max).exp()).sum();
            let mut cumulative = 0.0;
            let cut = all
                .iter()
                .position(|c| {
                    cumulative += f64::from(c.logit - max).exp() / sum;
                    cumulative >= f64::from(params.top_p)
                })
                .map_or(all.len(), |at| at + 1);
            all.truncate(cut);
        }
        if params.min_p > 0.0 {
            all.retain(|c| c.logit >= max + params.min_p.ln());
        }
        all.iter().map(|c| c.token).collect()
    }

    /// Rows with a spread of shapes: peaked, flat, quantised (ties), with NaN and -inf.
    fn random_row(n_vocab: usize, seed: u64) -> Vec<f32> {
        let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 11) as f64 / (1u64 << 53) as f64
        };
        let scale = [0.3, 1.0, 3.0, 8.0][(seed % 4) as usize];
        let quantised = seed.is_multiple_of(3);
        (0..n_vocab)
            .map(|_| {
                let roll = next();
                if roll < 0.01 {
                    f32::NAN
                } else if roll < 0.02 {
                    f32::NEG_INFINITY
                } else {
                    let logit = (next() * 2.0 - 1.0) * scale + if next() < 0.001 { 10.0 } else { 0.0 };
                    if quantised {
                        ((logit * 4.0).round() / 4.0) as f32
                    } else {
                        logit as f32
                    }
                }
            })
            .collect()
    }

    #[test]
    fn truncation_matches_the_obvious_implementation() {
        let mut candidates = Vec::new();
        let mut checked = 0;
        for seed in 0..24u64 {
            let logits = random_row(3000, seed);
            for top_k in [0, 1, 7, 40, 2999, 5000] {
                for top_p in [0.3, 0.9, 0.95, 1.0] {
                    for min_p in [0.0, 0.05, 0.5] {
                        let params = SamplingParams {
                            top_k,
                            top_p,
                            min_p,
                            ..Default::default()
                        };
                        truncate(&PenalizedRow::new(&logits, &[]), &params, &mut candidates).unwrap();
                        candidates.sort_by(select::rank);
                        let ours: Vec<u32> = candidates.iter().map(|c| c.token).collect();
                        assert_eq!(ours, reference_survivors(&logits, &params), "seed {seed} {params:?}");
                        checked += 1;
                    }
                }
            }
        }
        assert_eq!(checked, 24 * 6 * 4 * 3);
    }

    #[test]
    fn truncation_sees_penalized_logits() {
        let logits = random_row(3000, 5);
        let best = argmax_of(&logits);
        let overrides = [(best, -50.0)];
        let mut penalized = logits.clone();
        penalized[best as usize] = -50.0;
        let mut candidates = Vec::new();
        for params in [
            SamplingParams::default(),
            SamplingParams {
                top_k: 0,
                ..Default::default()
            },
            SamplingParams {
                top_k: 0,
                min_p: 0.0,
                top_p: 0.5,
                ..Default::default()
            },
        ] {
            truncate(&PenalizedRow::new(&logits, &overrides), &params, &mut candidates).unwrap();
            candidates.sort_by(select::rank);
            let ours: Vec<u32> = candidates.iter().map(|c| c.token).collect();
            assert_eq!(ours, reference_survivors(&penalized, &params), "{params:?}");
            assert!(!ours.contains(&best));
        }
    }

    #[test]
    fn greedy_picks_the_argmax() {
        assert_eq!(greedy().sample(&[0.1, 2.5, -1.0, 2.4]).unwrap(), 1);
    }

    #[test]
    fn greedy_ties_pick_the_lowest_id() {
        assert_eq!(greedy().sample(&[1.0, 3.0, 0.0, 3.0, 3.0]).unwrap(), 1);
        let mut row = vec![0.0f32; 100_000];
        row[77_777] = 1.0;
        row[12_345] = 1.0;
        assert_eq!(greedy().sample(&row).unwrap(), 12_345);
    }

    #[test]
    fn nan_logits_are_ignored() {
        let row = [f32::NAN, 0.5, f32::NAN, 0.7, f32::NAN];
        assert_eq!(greedy().sample(&row).unwrap(), 3);
        let mut sampler = Sampler::new(SamplingParams {
            seed: 3,
            ..unfiltered(1.0, 3)
        })
        .unwrap();
        for _ in 0..200 {
            let token = sampler.sample(&row).unwrap();
            assert!(token == 1 || token == 3, "drew NaN token {token}");
        }
    }

    #[test]
    fn empty_or_all_nan_rows_are_errors() {
        for params in [SamplingParams::greedy(), SamplingParams::default()] {
            let mut sampler = Sampler::new(params).unwrap();
            assert_eq!(sampler.sample(&[]), Err(SamplingError::EmptyLogits));
            assert_eq!(
                sampler.sample(&[f32::NAN, f32::NAN]),
                Err(SamplingError::AllNan { n_vocab: 2 })
            );
            assert!(sampler.sample_with_logprobs(&[f32::NAN], 3).is_err());
        }
    }

    #[test]
    fn new_refuses_invalid_params() {
        let err = Sampler::new(SamplingParams {
            top_p: 2.0,
            ..Default::default()
        })
        .unwrap_err();
        assert!(err.to_string().contains("top_p = 2"));
    }

    #[test]
    fn repeat_penalty_divides_positive_and_multiplies_negative_logits() {
        let params = SamplingParams {
            repeat_penalty: 2.0,
            ..SamplingParams::greedy()
        };
        // Token 0: 3.0 / 2 = 1.5 < 2.0, so token 1 wins once 0 is in the window.
        let mut sampler = Sampler::new(params.clone()).unwrap();
        assert_eq!(sampler.sample(&[3.0, 2.0]).unwrap(), 0);
        sampler.accept(0);
        assert_eq!(sampler.sample(&[3.0, 2.0]).unwrap(), 1);
        // Token 1: -1.0 * 2 = -2.0 < -1.5, so token 0 wins once 1 is in the window.
        let mut sampler = Sampler::new(params.clone()).unwrap();
        assert_eq!(sampler.sample(&[-1.5, -1.0]).unwrap(), 1);
        sampler.accept(1);
        assert_eq!(sampler.sample(&[-1.5, -1.0]).unwrap(), 0);
        // 4.0 / 2 = 2.0 ties with token 1 at 2.0; the lower id still wins.
        let mut sampler = Sampler::new(params).unwrap();
        sampler.accept(0);
        assert_eq!(sampler.sample(&[4.0, 2.0]).unwrap(), 0);
        assert_eq!(sampler.sample(&[4.01, 2.0]).unwrap(), 0);
        assert_eq!(sampler.sample(&[3.99, 2.0]).unwrap(), 1);
    }

    #[test]
    fn frequency_penalty_scales_with_count_and_presence_penalty_does_not() {
        let row = [5.0, 4.0];
        // Frequency 0.4: token 0 seen twice → 5.0 - 0.8 = 4.2 > 4.0; three times → 3.8.
        let mut sampler = Sampler::new(SamplingParams {
            frequency_penalty: 0.4,
            ..SamplingParams::greedy()
        })
        .unwrap();
        sampler.accept(0);
        sampler.accept(0);
        assert_eq!(sampler.sample(&row).unwrap(), 0);
        sampler.accept(0);
        assert_eq!(sampler.sample(&row).unwrap(), 1);
        // Presence 0.9: 5.0 - 0.9 = 4.1 however often token 0 occurred.
        let mut sampler = Sampler::new(SamplingParams {
            presence_penalty: 0.9,
            ..SamplingParams::greedy()
        })
        .unwrap();
        for _ in 0..10 {
            sampler.accept(0);
        }
        assert_eq!(sampler.sample(&row).unwrap(), 0);
        let mut sampler = Sampler::new(SamplingParams {
            presence_penalty: 1.1,
            ..SamplingParams::greedy()
        })
        .unwrap();
        sampler.accept(0);
        assert_eq!(sampler.sample(&row).unwrap(), 1);
    }

    #[test]
    fn penalties_combine_in_llama_cpp_order() {
        // 6.0 / 1.5 - 2 * 0.25 - 0.5 = 3.0, against 3.1 and 2.9.
        let params = SamplingParams {
            repeat_penalty: 1.5,
            frequency_penalty: 0.25,
            presence_penalty: 0.5,
            ..SamplingParams::greedy()
        };
        let mut sampler = Sampler::new(params).unwrap();
        sampler.accept(0);
        sampler.accept(0);
        assert_eq!(sampler.sample(&[6.0, 3.1]).unwrap(), 1);
        assert_eq!(sampler.sample(&[6.0, 2.9]).unwrap(), 0);
        let sampled = sampler.sample_with_logprobs(&[6.0, 3.0], 2).unwrap();
        // Both at 3.0: equal probability, tie to the lower id.
        assert_eq!(sampled.token, 0);
        assert!((sampled.logprob - 0.5f32.ln()).abs() < 1e-6);
    }

    #[test]
    fn penalties_only_see_the_last_repeat_last_n_tokens() {
        let params = SamplingParams {
            repeat_penalty: 10.0,
            repeat_last_n: 2,
            ..SamplingParams::greedy()
        };
        let mut sampler = Sampler::new(params).unwrap();
        let row = [3.0, 2.0, 1.0, 0.5];
        sampler.accept(0);
        assert_eq!(sampler.sample(&row).unwrap(), 1);
        sampler.accept(2);
        sampler.accept(3);
        // Token 0 has left the window.
        assert_eq!(sampler.sample(&row).unwrap(), 0);
        sampler.reset_history();
        sampler.accept(0);
        sampler.accept(1);
        assert_eq!(sampler.sample(&row).unwrap(), 2);
    }

    #[test]
    fn penalties_ignore_tokens_outside_the_vocabulary_and_zero_window() {
        let params = SamplingParams {
            repeat_penalty: 10.0,
            ..SamplingParams::greedy()
        };
        let mut sampler = Sampler::new(params.clone()).unwrap();
        sampler.accept(1_000_000);
        sampler.accept(0);
        assert_eq!(sampler.sample(&[3.0, 2.0]).unwrap(), 1);
        let mut sampler = Sampler::new(SamplingParams {
            repeat_last_n: 0,
            ..params
        })
        .unwrap();
        sampler.accept(0);
        assert_eq!(sampler.sample(&[3.0, 2.0]).unwrap(), 0);
    }

    #[test]
    fn top_k_one_is_greedy_at_any_temperature() {
        let row: Vec<f32> = (0..1000).map(|i| ((i * 37) % 101) as f32 * 0.01).collect();
        let best = argmax_of(&row);
        for temperature in [0.1, 1.0, 5.0, 100.0] {
            let params = SamplingParams {
                temperature,
                top_k: 1,
                ..unfiltered(temperature, 9)
            };
            let mut sampler = Sampler::new(params).unwrap();
            for _ in 0..100 {
                assert_eq!(sampler.sample(&row).unwrap(), best);
            }
        }
    }

    fn argmax_of(row: &[f32]) -> u32 {
        crate::argmax(row).unwrap()
    }

    #[test]
    fn small_top_p_keeps_only_the_top_token() {
        let row = [1.0, 1.2, 0.8, 1.1];
        let params = SamplingParams {
            top_p: 0.01,
            ..unfiltered(10.0, 5)
        };
        let mut sampler = Sampler::new(params).unwrap();
        for _ in 0..200 {
            assert_eq!(sampler.sample(&row).unwrap(), 1);
        }
    }

    #[test]
    fn min_p_filters_unlikely_tokens() {
        // Probabilities proportional to 1, 0.5, 0.09, 0.01; min_p 0.1 keeps tokens 0 and 1.
        let row: Vec<f32> = [1.0f32, 0.5, 0.09, 0.01].iter().map(|w| w.ln()).collect();
        let params = SamplingParams {
            min_p: 0.1,
            ..unfiltered(1.0, 11)
        };
        let mut sampler = Sampler::new(params).unwrap();
        let mut seen = [0usize; 4];
        for _ in 0..2000 {
            seen[sampler.sample(&row).unwrap() as usize] += 1;
        }
        assert_eq!(seen[2] + seen[3], 0, "{seen:?}");
        assert!(seen[0] > 0 && seen[1] > 0, "{seen:?}");
        // Without the filter the third token does come up.
        let mut sampler = Sampler::new(unfiltered(1.0, 11)).unwrap();
        let drawn: Vec<u32> = (0..2000).map(|_| sampler.sample(&row).unwrap()).collect();
        assert!(drawn.contains(&2));
    }

    #[test]
    fn top_k_keeps_only_the_k_best() {
        let row = [0.0, 3.0, 1.0, 2.0, 2.0];
        let params = SamplingParams {
            top_k: 3,
            ..unfiltered(100.0, 2)
        };
        let mut sampler = Sampler::new(params).unwrap();
        let mut seen = [0usize; 5];
        for _ in 0..3000 {
            seen[sampler.sample(&row).unwrap() as usize] += 1;
        }
        // Top 3 by logit then id: 1, 3, 4 — at temperature 100 nearly uniform.
        assert_eq!(seen[0] + seen[2], 0, "{seen:?}");
        assert!(seen[1] > 800 && seen[3] > 800 && seen[4] > 800, "{seen:?}");
    }

    #[test]
    fn same_seed_repeats_and_different_seed_differs() {
        let flat = vec![0.0f32; 1000];
        let draws = |seed: u64| {
            let mut sampler = Sampler::new(unfiltered(1.0, seed)).unwrap();
            (0..200).map(|_| sampler.sample(&flat).unwrap()).collect::<Vec<_>>()
        };
        assert_eq!(draws(42), draws(42));
        assert_ne!(draws(42), draws(43));
        // Default chain (top-k 40 etc.) is also deterministic.
        let row: Vec<f32> = (0..5000).map(|i| ((i * 7919) % 1000) as f32 * 0.005).collect();
        let draws = |seed: u64| {
            let mut sampler = Sampler::new(SamplingParams {
                seed,
                ..Default::default()
            })
            .unwrap();
            (0..200).map(|_| sampler.sample(&row).unwrap()).collect::<Vec<_>>()
        };
        assert_eq!(draws(7), draws(7));
    }

    #[test]
    fn a_rebuilt_sampler_continues_the_same_stream() {
        // A sequence moved to a new last stage: history accepted again, draws skipped.
        let row: Vec<f32> = (0..3000).map(|i| ((i * 7919) % 1000) as f32 * 0.004).collect();
        let params = SamplingParams {
            seed: 11,
            repeat_penalty: 1.3,
            ..Default::default()
        };
        let mut whole = Sampler::new(params.clone()).unwrap();
        let mut tokens = Vec::new();
        for _ in 0..40 {
            let token = whole.sample(&row).unwrap();
            whole.accept(token);
            tokens.push(token);
        }
        let mut rebuilt = Sampler::new(params).unwrap();
        tokens[..25].iter().for_each(|&t| rebuilt.accept(t));
        rebuilt.skip_draws(25);
        let rest: Vec<u32> = (0..15)
            .map(|_| {
                let token = rebuilt.sample(&row).unwrap();
                rebuilt.accept(token);
                token
            })
            .collect();
        assert_eq!(rest, tokens[25..]);
    }

    #[test]
    fn empirical_frequencies_match_softmax() {
        let row = [0.0, 2.0f32.ln(), 3.0f32.ln()];
        let mut sampler = Sampler::new(unfiltered(1.0, 1234)).unwrap();
        let n = 20_000;
        let mut seen = [0usize; 3];
        for _ in 0..n {
            seen[sampler.sample(&row).unwrap() as usize] += 1;
        }
        for (count, expected) in seen.iter().zip([1.0 / 6.0, 2.0 / 6.0, 3.0 / 6.0]) {
            let frequency = *count as f64 / n as f64;
            assert!((frequency - expected).abs() < 0.02, "{seen:?}");
        }
    }

    #[test]
    fn temperature_sharpens_and_flattens() {
        let row = [0.0, 1.0];
        let frequency_of_1 = |temperature: f32| {
            let mut sampler = Sampler::new(unfiltered(temperature, 77)).unwrap();
            (0..10_000).filter(|_| sampler.sample(&row).unwrap() == 1).count() as f64 / 10_000.0
        };
        // p(1) = 1 / (1 + e^(-1/T)).
        for temperature in [0.5f32, 1.0, 2.0] {
            let expected = 1.0 / (1.0 + (-1.0 / f64::from(temperature)).exp());
            assert!((frequency_of_1(temperature) - expected).abs() < 0.02, "T {temperature}");
        }
    }

    #[test]
    fn infinite_logits_do_not_poison_the_draw() {
        let mut sampler = Sampler::new(unfiltered(1.0, 1)).unwrap();
        for _ in 0..50 {
            assert_eq!(sampler.sample(&[0.0, f32::INFINITY, 1.0]).unwrap(), 1);
            let token = sampler
                .sample(&[f32::NEG_INFINITY, f32::NAN, f32::NEG_INFINITY])
                .unwrap();
            assert!(token == 0 || token == 2);
            assert_eq!(sampler.sample(&[f32::NEG_INFINITY, 2.0, f32::NEG_INFINITY]).unwrap(), 1);
        }
    }

    #[test]
    fn logprobs_are_normalised_and_the_top_list_is_sorted() {
        let row: Vec<f32> = (0..50_000).map(|i| ((i * 7919) % 997) as f32 * 0.01 - 5.0).collect();
        for params in [
            SamplingParams::greedy(),
            SamplingParams {
                seed: 3,
                ..Default::default()
            },
        ] {
            let mut sampler = Sampler::new(params).unwrap();
            let sampled = sampler.sample_with_logprobs(&row, 10).unwrap();
            let norm = PenalizedRow::new(&row, &[]).log_softmax().unwrap();
            let total: f64 = row.iter().map(|&l| f64::from(norm.logprob(l)).exp()).sum();
            assert!((total - 1.0).abs() < 1e-4, "{total}");
            assert_eq!(sampled.top.len(), 10);
            assert!(
                sampled.top.windows(2).all(|pair| pair[0].1 >= pair[1].1),
                "{:?}",
                sampled.top
            );
            assert!(sampled
                .top
                .iter()
                .all(|&(token, lp)| lp == norm.logprob(row[token as usize])));
            assert_eq!(sampled.logprob, norm.logprob(row[sampled.token as usize]));
            assert_eq!(sampled.top[0].0, argmax_of(&row));
        }
    }

    #[test]
    fn logprobs_of_a_small_row_are_exact() {
        let row = [0.0, 2.0f32.ln(), 3.0f32.ln(), f32::NAN];
        let mut sampler = greedy();
        let sampled = sampler.sample_with_logprobs(&row, 10).unwrap();
        assert_eq!(sampled.token, 2);
        assert!((sampled.logprob - 0.5f32.ln()).abs() < 1e-6);
        let tokens: Vec<u32> = sampled.top.iter().map(|&(token, _)| token).collect();
        // NaN is not a token the model could produce, so it is not listed.
        assert_eq!(tokens, [2, 1, 0]);
        let sum: f32 = sampled.top.iter().map(|&(_, lp)| lp.exp()).sum();
        assert!((sum - 1.0).abs() < 1e-6);
        assert!(sampler.sample_with_logprobs(&row, 0).unwrap().top.is_empty());
    }

    #[test]
    fn logprobs_use_penalized_logits_and_do_not_change_the_draw() {
        let row = [2.0, 1.0, 0.0];
        let params = SamplingParams {
            repeat_penalty: 2.0,
            ..unfiltered(1.0, 5)
        };
        let mut with = Sampler::new(params.clone()).unwrap();
        let mut without = Sampler::new(params).unwrap();
        with.accept(0);
        without.accept(0);
        for _ in 0..100 {
            let sampled = with.sample_with_logprobs(&row, 1).unwrap();
            assert_eq!(sampled.token, without.sample(&row).unwrap());
            // Token 0 penalized to 1.0: it ties with token 1 and wins the tie.
            assert_eq!(sampled.top[0].0, 0);
            let expected = 1.0 - (2.0 * 1.0f64.exp() + 1.0).ln();
            assert!((f64::from(sampled.top[0].1) - expected).abs() < 1e-6);
        }
    }

    #[test]
    fn large_vocabulary_default_chain_matches_greedy_on_a_peaked_row() {
        let mut row = vec![-10.0f32; 262_144];
        row[200_000] = 20.0;
        let mut sampler = Sampler::new(SamplingParams::default()).unwrap();
        assert_eq!(sampler.sample(&row).unwrap(), 200_000);
        let mut sampler = Sampler::new(unfiltered(0.8, 0)).unwrap();
        assert_eq!(sampler.sample(&row).unwrap(), 200_000);
    }
}
