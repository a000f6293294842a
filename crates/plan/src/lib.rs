//! Partitioning a model's layers into stages. Pure functions, tested with tables.
#![deny(unsafe_code)]

use std::ops::Range;

/// Why a partition cannot be made.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    /// No stages asked for.
    #[error("at least one stage is needed")]
    NoStages,
    /// More stages than layers.
    #[error("{stages} stages for {layers} layers: every stage needs at least one layer")]
    TooManyStages { stages: usize, layers: usize },
    /// A `--split` list that is not comma-separated positive integers.
    #[error("bad --split '{0}': expected comma-separated positive layer counts, e.g. 8,8,8")]
    BadSplit(String),
    /// A `--split` list whose counts do not add up to the model's layers.
    #[error("--split {split} covers {covered} layers, but the model has {layers}")]
    SplitMismatch {
        split: String,
        covered: usize,
        layers: usize,
    },
}

/// Splits `n_layers` into `n_stages` contiguous ranges whose sizes differ by at most
/// one; earlier stages get the extra layers (the first also embeds, the last samples,
/// so neither end is systematically lighter).
pub fn even_split(n_layers: usize, n_stages: usize) -> Result<Vec<Range<usize>>, PlanError> {
    if n_stages == 0 {
        return Err(PlanError::NoStages);
    }
    if n_stages > n_layers {
        return Err(PlanError::TooManyStages {
            stages: n_stages,
            layers: n_layers,
        });
    }
    let base = n_layers / n_stages;
    let extra = n_layers % n_stages;
    let sizes: Vec<usize> = (0..n_stages).map(|i| base + usize::from(i < extra)).collect();
    Ok(ranges(&sizes))
}

/// Parses `--split 8,8,8` (layer counts per stage) and checks it covers `n_layers`.
pub fn parse_split(split: &str, n_layers: usize) -> Result<Vec<Range<usize>>, PlanError> {
    let sizes = split
        .split(',')
        .map(|s| s.trim().parse::<usize>().ok().filter(|&n| n > 0))
        .collect::<Option<Vec<usize>>>()
        .ok_or_else(|| PlanError::BadSplit(split.to_string()))?;
    let covered: usize = sizes.iter().sum();
    if covered != n_layers {
        return Err(PlanError::SplitMismatch {
            split: split.to_string(),
            covered,
            layers: n_layers,
        });
    }
    Ok(ranges(&sizes))
}

fn ranges(sizes: &[usize]) -> Vec<Range<usize>> {
    let mut start = 0;
    sizes
        .iter()
        .map(|&n| {
            let range = start..start + n;
            start += n;
            range
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[allow(clippy::single_range_in_vec_init)] // one stage holding every layer is the case
    fn even_split_table() {
        let cases: &[(usize, usize, &[Range<usize>])] = &[
            (24, 1, &[0..24]),
            (24, 2, &[0..12, 12..24]),
            (24, 3, &[0..8, 8..16, 16..24]),
            (18, 4, &[0..5, 5..10, 10..14, 14..18]),
            (3, 3, &[0..1, 1..2, 2..3]),
            (5, 2, &[0..3, 3..5]),
        ];
        for (layers, stages, expected) in cases {
            assert_eq!(
                even_split(*layers, *stages).unwrap(),
                expected.to_vec(),
                "{layers} layers / {stages} stages"
            );
        }
    }

    #[test]
    fn even_split_errors() {
        assert_eq!(even_split(24, 0), Err(PlanError::NoStages));
        assert_eq!(even_split(2, 3), Err(PlanError::TooManyStages { stages: 3, layers: 2 }));
    }

    #[test]
    fn parse_split_table() {
        assert_eq!(parse_split("8,8,8", 24).unwrap(), vec![0..8, 8..16, 16..24]);
        assert_eq!(parse_split("1, 23", 24).unwrap(), vec![0..1, 1..24]);
        assert_eq!(parse_split("24", 24).unwrap(), vec![0..24]);
        for bad in ["", "8,,8", "8,0,16", "a,b", "-1,25"] {
            assert_eq!(parse_split(bad, 24), Err(PlanError::BadSplit(bad.into())), "{bad:?}");
        }
        assert_eq!(
            parse_split("8,8", 24).unwrap_err().to_string(),
            "--split 8,8 covers 16 layers, but the model has 24"
        );
    }
}
