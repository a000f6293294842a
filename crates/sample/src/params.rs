//! Sampling parameters, with llama.cpp's defaults and meanings of "disabled".

use crate::SamplingError;

/// How one sequence chooses its tokens. Field meanings follow llama.cpp's
/// `common_params_sampling`, including the values that switch a stage off.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// Divides the logits before the draw; zero or negative means greedy (arg-max after
    /// penalties), as in llama.cpp.
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens; zero or negative disables it.
    pub top_k: i32,
    /// Keep the smallest set of most likely tokens whose probability reaches `top_p`;
    /// 1.0 disables it.
    pub top_p: f32,
    /// Drop tokens less likely than `min_p` times the most likely one; 0 disables it.
    pub min_p: f32,
    /// Repetition penalty for tokens in the window: a positive logit is divided by it,
    /// any other multiplied; 1.0 disables it.
    pub repeat_penalty: f32,
    /// How many of the most recent accepted tokens the penalties look at; 0 disables
    /// all penalties.
    pub repeat_last_n: usize,
    /// Subtracted from a token's logit once per occurrence in the window; 0 disables it.
    pub frequency_penalty: f32,
    /// Subtracted once from the logit of any token present in the window; 0 disables it.
    pub presence_penalty: f32,
    /// Seed of the sequence's random number generator.
    pub seed: u64,
}

impl Default for SamplingParams {
    /// llama.cpp's defaults: temperature 0.8, top-k 40, top-p 0.95, min-p 0.05, no
    /// penalties over a 64-token window.
    fn default() -> Self {
        Self {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.05,
            repeat_penalty: 1.0,
            repeat_last_n: 64,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            seed: 0,
        }
    }
}

impl SamplingParams {
    /// Arg-max decoding: the defaults with temperature 0.
    pub fn greedy() -> Self {
        Self {
            temperature: 0.0,
            ..Self::default()
        }
    }

    /// Whether tokens are chosen by arg-max rather than drawn.
    pub fn is_greedy(&self) -> bool {
        self.temperature <= 0.0
    }

    /// Whether a token is the plain arg-max of its row: greedy, no penalties. Such a row
    /// needs only its best logit and token, not the whole row.
    pub fn is_plain_argmax(&self) -> bool {
        self.is_greedy() && !self.has_penalties()
    }

    /// Whether any penalty would change a logit.
    pub fn has_penalties(&self) -> bool {
        self.repeat_last_n > 0
            && (self.repeat_penalty != 1.0 || self.frequency_penalty != 0.0 || self.presence_penalty != 0.0)
    }

    /// Checks every field against the ranges llama.cpp accepts. The error names the
    /// field and its value, since these usually come straight from an API request.
    pub fn validate(&self) -> Result<(), SamplingError> {
        // Written as "accepted if" so that NaN, which fails every comparison, is refused.
        check(
            "temperature",
            self.temperature,
            self.temperature.is_finite(),
            "must be a finite number (zero or negative means greedy)",
        )?;
        check(
            "top_p",
            self.top_p,
            self.top_p > 0.0 && self.top_p <= 1.0,
            "must be in (0, 1] (1 disables it)",
        )?;
        check(
            "min_p",
            self.min_p,
            (0.0..=1.0).contains(&self.min_p),
            "must be in [0, 1] (0 disables it)",
        )?;
        check(
            "repeat_penalty",
            self.repeat_penalty,
            self.repeat_penalty.is_finite() && self.repeat_penalty > 0.0,
            "must be a positive finite number (1 disables it)",
        )?;
        check(
            "frequency_penalty",
            self.frequency_penalty,
            self.frequency_penalty.is_finite(),
            "must be a finite number (0 disables it)",
        )?;
        check(
            "presence_penalty",
            self.presence_penalty,
            self.presence_penalty.is_finite(),
            "must be a finite number (0 disables it)",
        )
    }
}

fn check(field: &'static str, value: f32, accepted: bool, expected: &'static str) -> Result<(), SamplingError> {
    if accepted {
        Ok(())
    } else {
        Err(SamplingError::InvalidParameter { field, value, expected })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid_and_match_llama_cpp() {
        let params = SamplingParams::default();
        params.validate().unwrap();
        assert_eq!(params.temperature, 0.8);
        assert_eq!(params.top_k, 40);
        assert_eq!(params.top_p, 0.95);
        assert_eq!(params.min_p, 0.05);
        assert_eq!(params.repeat_last_n, 64);
        assert!(!params.is_greedy());
        assert!(!params.has_penalties());
        assert!(SamplingParams::greedy().is_greedy());
    }

    #[test]
    fn negative_temperature_means_greedy_and_is_valid() {
        let params = SamplingParams {
            temperature: -1.0,
            ..Default::default()
        };
        params.validate().unwrap();
        assert!(params.is_greedy());
    }

    #[test]
    fn boundary_values_are_accepted() {
        for params in [
            SamplingParams {
                top_p: 1.0,
                ..Default::default()
            },
            SamplingParams {
                min_p: 0.0,
                ..Default::default()
            },
            SamplingParams {
                min_p: 1.0,
                ..Default::default()
            },
            SamplingParams {
                top_k: -1,
                ..Default::default()
            },
            SamplingParams {
                frequency_penalty: -2.0,
                presence_penalty: 2.0,
                ..Default::default()
            },
        ] {
            params.validate().unwrap();
        }
    }

    #[test]
    fn bad_values_are_refused_with_the_field_named() {
        let bad = [
            (
                SamplingParams {
                    temperature: f32::NAN,
                    ..Default::default()
                },
                "temperature = NaN",
            ),
            (
                SamplingParams {
                    temperature: f32::INFINITY,
                    ..Default::default()
                },
                "temperature = inf",
            ),
            (
                SamplingParams {
                    top_p: 0.0,
                    ..Default::default()
                },
                "top_p = 0",
            ),
            (
                SamplingParams {
                    top_p: 1.5,
                    ..Default::default()
                },
                "top_p = 1.5",
            ),
            (
                SamplingParams {
                    top_p: f32::NAN,
                    ..Default::default()
                },
                "top_p = NaN",
            ),
            (
                SamplingParams {
                    min_p: -0.1,
                    ..Default::default()
                },
                "min_p = -0.1",
            ),
            (
                SamplingParams {
                    min_p: 1.1,
                    ..Default::default()
                },
                "min_p = 1.1",
            ),
            (
                SamplingParams {
                    repeat_penalty: 0.0,
                    ..Default::default()
                },
                "repeat_penalty = 0",
            ),
            (
                SamplingParams {
                    repeat_penalty: -1.0,
                    ..Default::default()
                },
                "repeat_penalty = -1",
            ),
            (
                SamplingParams {
                    repeat_penalty: f32::NAN,
                    ..Default::default()
                },
                "repeat_penalty = NaN",
            ),
            (
                SamplingParams {
                    frequency_penalty: f32::NAN,
                    ..Default::default()
                },
                "frequency_penalty = NaN",
            ),
            (
                SamplingParams {
                    presence_penalty: f32::NAN,
                    ..Default::default()
                },
                "presence_penalty = NaN",
            ),
        ];
        for (params, needle) in bad {
            let message = params.validate().unwrap_err().to_string();
            assert!(message.contains(needle), "{message:?} should contain {needle:?}");
        }
        let message = SamplingParams {
            top_p: 1.5,
            ..Default::default()
        }
        .validate()
        .unwrap_err()
        .to_string();
        assert_eq!(
            message,
            "invalid sampling parameter top_p = 1.5: must be in (0, 1] (1 disables it)"
        );
    }
}
