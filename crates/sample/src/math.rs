//! Numerics for passes over the whole vocabulary, written so the compiler can vectorise
//! them: `f32::exp` is a libm call per element and an f64 running sum is one long
//! dependency chain, which together cost about a millisecond per 262k-entry row.

/// `e^x`, branch-free so that loops over it vectorise; exactly 0 for `x < -87.3`
/// (so a `-inf` logit keeps zero weight) and saturating near `e^88.3`. Within a few
/// ulp of `f32::exp` (Cephes' `expf` polynomial). NaN gives NaN.
#[inline(always)]
pub(crate) fn exp(x: f32) -> f32 {
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    let clamped = x.clamp(-87.3, 88.3);
    // x = n ln 2 + r with |r| <= ln 2 / 2, then e^x = 2^n e^r.
    let n = (clamped * std::f32::consts::LOG2_E + 0.5).floor();
    let r = clamped - n * LN2_HI - n * LN2_LO;
    let poly = ((((1.987_569_1e-4 * r + 1.398_199_9e-3) * r + 8.333_452e-3) * r + 4.166_579_6e-2) * r + 1.666_666_5e-1)
        * r
        + 0.5;
    let e_r = poly * r * r + r + 1.0;
    // 2^n from its exponent bits. The clamp keeps n + 127 in [1, 254]; adding 2^23
    // leaves that integer in the low mantissa bits, and the shift drops the rest.
    // (`n as i32` would be a saturating conversion, which does not vectorise.)
    let two_n = f32::from_bits((n + (127.0 + 8_388_608.0)).to_bits() << 23);
    if x < -87.3 {
        0.0
    } else {
        e_r * two_n
    }
}

const LANES: usize = 8;

/// `Σ exp(value - max)` over `values`, NaN counting as 0, accumulated in f64.
pub(crate) fn sum_exp(values: &[f32], max: f32) -> f64 {
    sum_mapped(values, |value| if value.is_nan() { 0.0 } else { exp(value - max) })
}

/// `Σ f(value)` in f64, in a fixed order so the result is the same on every call.
#[inline(always)]
pub(crate) fn sum_mapped<T: Copy>(values: &[T], f: impl Fn(T) -> f32) -> f64 {
    // Mapping a block into a buffer is a loop the compiler vectorises; a reduction it
    // will not reorder on its own, hence the f64 lanes.
    const BLOCK: usize = 256;
    let mut mapped = [0.0f32; BLOCK];
    let mut lanes = [0.0f64; LANES];
    for block in values.chunks(BLOCK) {
        let mapped = &mut mapped[..block.len()];
        for (out, &value) in mapped.iter_mut().zip(block) {
            *out = f(value);
        }
        let chunks = mapped.chunks_exact(LANES);
        let tail = chunks.remainder();
        for chunk in chunks {
            for lane in 0..LANES {
                lanes[lane] += f64::from(chunk[lane]);
            }
        }
        for (lane, &value) in tail.iter().enumerate() {
            lanes[lane] += f64::from(value);
        }
    }
    lanes.iter().sum()
}

/// Index drawn with probability proportional to `weights` (finite, non-negative, not
/// all zero), given `u` uniform in [0, 1). Zero weights are never drawn.
pub(crate) fn draw(weights: &[f32], u: f64) -> usize {
    // Two levels: whole blocks are skipped by their (vectorised) sums, and only the
    // block holding the target is walked element by element. `total` is the sum of the
    // same block sums in the same order, so the walk reaches it exactly.
    const BLOCK: usize = 64;
    let block_sum = |block: &[f32]| sum_mapped(block, |weight| weight);
    let total: f64 = weights.chunks(BLOCK).map(block_sum).fold(0.0, |sum, block| sum + block);
    let target = u * total;
    let mut before = 0.0f64;
    for (index, block) in weights.chunks(BLOCK).enumerate() {
        let after = before + block_sum(block);
        if after > target {
            let mut running = before;
            for (offset, &weight) in block.iter().enumerate() {
                running += f64::from(weight);
                if running > target {
                    return index * BLOCK + offset;
                }
            }
            // Summed in another order, the block fell just short; its last token with
            // weight is the one the target lies in.
            return index * BLOCK + last_positive(block).unwrap_or(block.len() - 1);
        }
        before = after;
    }
    // Only when `u * total` rounded up to `total`.
    last_positive(weights).unwrap_or(0)
}

fn last_positive(weights: &[f32]) -> Option<usize> {
    weights.iter().rposition(|&weight| weight > 0.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_is_close_to_std() {
        let mut worst = 0.0f64;
        let mut x = -87.0f32;
        while x < 88.0 {
            let relative = (f64::from(exp(x)) - f64::from(x).exp()).abs() / f64::from(x).exp();
            worst = worst.max(relative);
            x += 0.001_3;
        }
        assert!(worst < 3e-7, "worst relative error {worst}");
        assert_eq!(exp(0.0), 1.0);
    }

    #[test]
    fn exp_edges() {
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(-100.0), 0.0);
        assert!(exp(f32::NAN).is_nan());
        assert!(exp(-87.0) > 0.0);
    }

    #[test]
    fn draw_follows_the_weights_and_never_picks_zero_weight() {
        let mut weights = vec![0.0f32; 300];
        weights[5] = 1.0;
        weights[130] = 2.0;
        weights[299] = 1.0;
        let picks: Vec<usize> = (0..1000).map(|i| draw(&weights, f64::from(i) / 1000.0)).collect();
        let count = |at: usize| picks.iter().filter(|&&pick| pick == at).count();
        assert_eq!(count(5) + count(130) + count(299), 1000);
        assert_eq!((count(5), count(130), count(299)), (250, 500, 250));
        assert_eq!(draw(&weights, 0.999_999_999_999), 299);
        assert_eq!(draw(&weights, 0.0), 5);
        assert_eq!(draw(&[0.0, 0.0, 3.0, 0.0], 0.0), 2);
    }

    #[test]
    fn sums_skip_nan() {
        let values = [0.0f32, f32::NAN, 0.0, f32::NEG_INFINITY, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0];
        assert!((sum_exp(&values, 0.0) - 8.0).abs() < 1e-12);
    }
}
