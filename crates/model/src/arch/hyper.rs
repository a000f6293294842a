//! Manifold-constrained hyper-connections (mHC; DeepSeek V4, GLM-5 Next), as
//! llama.cpp's `build_hc_pre`, `build_hc_post`, `build_hc_head` and `build_hc_mean`
//! compute them with ggml's fused `dsv4_hc_*` ops (which its context enables on every
//! backend that has them).
//!
//! The residual stream is `n_stream` copies of the hidden state (`[n_embd, n_stream,
//! n_tokens]`) instead of one. Before each block, a token's streams are scored from
//! their RMS-normed concatenation (`hc_*_fn`, a `(2 + n) n` matrix): `n` weights collapse
//! the streams into the block's input ([`pre`]), `n` more weigh the block's output into
//! each stream, and an `n × n` matrix, made doubly stochastic by Sinkhorn iterations,
//! mixes the old streams into the new ([`post`]). The output end collapses the streams
//! once more, with weights of its own or their mean ([`collapse`]).
//!
//! Between layers, and between stages, the hidden state is the streams flattened:
//! `[n_embd × n_stream, n_tokens]` ([`HParams::hidden_width`] values per token).

use baton_ggml::{Context, Tensor};
use baton_gguf::Value;

use super::Builder;
use crate::hparams::{HParams, Keys};
use crate::names::{EndTensor, LayerTensor as T};
use crate::tensors::{LayerPlan, Split, Use};
use crate::weights::LayerTensors;
use crate::ModelError;

/// The streams ggml's fused ops are written for (llama.cpp asserts the same).
const STREAMS: usize = 4;

/// Hyper-connections' sizes (`hyper_connection.*`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Hyper {
    /// Copies of the hidden state in the residual stream (`hyper_connection.count`).
    pub n_stream: usize,
    /// Sinkhorn iterations that make the mixing matrix doubly stochastic
    /// (`hyper_connection.sinkhorn_iterations`).
    pub sinkhorn_iters: usize,
    /// Added to the weights and the normalisers (`hyper_connection.epsilon`).
    pub eps: f32,
    /// How the output end collapses the streams.
    pub head: Head,
}

/// How the output end collapses the streams into one hidden state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Head {
    /// Weighted as before a block, by `output_hc_fn`, `output_hc_base` and
    /// `output_hc_scale` (DeepSeek V4's `build_hc_head`).
    Weighted,
    /// Their mean (GLM-5 Next's `build_hc_mean`).
    Mean,
}

impl Hyper {
    /// Reads `hyper_connection.{count, sinkhorn_iterations, epsilon}`, refusing what
    /// ggml's fused ops would abort on: other than 4 streams, no Sinkhorn iteration, an
    /// epsilon that is not finite.
    pub fn read(keys: &Keys<'_>, head: Head) -> Result<Hyper, ModelError> {
        let n_stream = keys.u32("hyper_connection.count")?;
        if n_stream != STREAMS {
            return Err(ModelError::BadHParams(format!(
                "{} is {n_stream}: llama.cpp's hyper-connections (and ggml's fused ops) have {STREAMS} streams",
                keys.name("hyper_connection.count")
            )));
        }
        let sinkhorn_iters = keys.u32("hyper_connection.sinkhorn_iterations")?;
        if !(1..=1 << 16).contains(&sinkhorn_iters) {
            return Err(ModelError::BadHParams(format!(
                "{} is {sinkhorn_iters}: the mixing matrix needs between 1 and 65536 iterations",
                keys.name("hyper_connection.sinkhorn_iterations")
            )));
        }
        let eps = keys.f32("hyper_connection.epsilon")?;
        if !eps.is_finite() {
            return Err(ModelError::BadHParams(format!(
                "{} is {eps}; it must be finite",
                keys.name("hyper_connection.epsilon")
            )));
        }
        Ok(Hyper {
            n_stream,
            sinkhorn_iters,
            eps,
            head,
        })
    }

    /// Scores per token before a block: `n` collapse weights, `n` output weights and
    /// the `n × n` mixing matrix.
    pub fn n_mix(&self) -> usize {
        (2 + self.n_stream) * self.n_stream
    }
}

/// The keys of an example model (`baton synth`): 4 streams, a few Sinkhorn iterations.
pub fn example() -> Vec<(&'static str, Value)> {
    vec![
        ("hyper_connection.count", Value::U32(STREAMS as u32)),
        ("hyper_connection.sinkhorn_iterations", Value::U32(3)),
        ("hyper_connection.epsilon", Value::F32(1e-6)),
    ]
}

/// Where in a layer the streams are mixed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Site {
    /// Around the attention (`hc_attn_*`).
    Attn,
    /// Around the FFN (`hc_ffn_*`).
    Ffn,
}

impl Site {
    /// Its scoring matrix, bias and the three scales (collapse, output, mixing).
    fn tensors(self) -> [T; 3] {
        match self {
            Site::Attn => [T::HcAttnFn, T::HcAttnBase, T::HcAttnScale],
            Site::Ffn => [T::HcFfnFn, T::HcFfnBase, T::HcFfnScale],
        }
    }
}

/// The hyper-parameters' streams (every caller's model has them).
fn hyper(hp: &HParams) -> Hyper {
    hp.hyper.expect("an architecture with hyper-connections reads them")
}

/// A layer's tensors of both sites: `hc_{attn,ffn}_fn [n_embd n, (2 + n) n]`,
/// `hc_{attn,ffn}_base [(2 + n) n]`, `hc_{attn,ffn}_scale [3]`.
pub fn tensors(t: &mut LayerPlan<'_>) {
    let hc = hyper(t.hp);
    let width = t.hp.hidden_width();
    for site in [Site::Attn, Site::Ffn] {
        let [scores, base, scale] = site.tensors();
        t.mat(scores, &[width, hc.n_mix()], Split::Whole);
        t.vec(base, &[hc.n_mix()], Split::Whole);
        t.vec(scale, &[3], Split::Whole);
    }
}

/// The output end's tensors (the last stage's), with their shapes and uses: DeepSeek
/// V4's `output_hc_{fn,base,scale}`, nothing for a mean.
pub fn end_tensors(hp: &HParams) -> Vec<(EndTensor, Vec<i64>, Use)> {
    match hp.hyper.map(|h| (h, h.head)) {
        Some((hc, Head::Weighted)) => vec![
            (
                EndTensor::OutputHcFn,
                vec![hp.hidden_width() as i64, hc.n_stream as i64],
                Use::MulMat,
            ),
            (EndTensor::OutputHcBase, vec![hc.n_stream as i64], Use::Elementwise),
            (EndTensor::OutputHcScale, vec![1], Use::Elementwise),
        ],
        _ => Vec::new(),
    }
}

/// The token embeddings `[n_embd, n_tokens]` copied into every stream:
/// `[n_embd n, n_tokens]` (llama.cpp's `hc_init`).
pub fn expand<'g>(b: &Builder<'g>, embd: Tensor<'g>) -> Tensor<'g> {
    let ctx = b.ctx;
    let [n_embd, n_tokens, _, _] = embd.ne();
    let n = hyper(b.hp).n_stream as i64;
    let rows = ctx.reshape_3d(embd, n_embd, 1, n_tokens);
    let streams = ctx.repeat_4d(rows, [n_embd, n, n_tokens, 1]);
    ctx.reshape_2d(streams, n_embd * n, n_tokens).named("hc_init")
}

/// What [`pre`] computed for one block: its input, and what [`post`] needs to write
/// its output back into the streams.
#[derive(Clone, Copy)]
pub struct Mix<'g> {
    /// The block's input: the streams collapsed, `[n_embd, n_tokens]`.
    pub input: Tensor<'g>,
    /// The streams before the block, `[n_embd, n, n_tokens]`.
    pub residual: Tensor<'g>,
    /// Each stream's weight of the block's output, `[n, n_tokens]`.
    pub post: Tensor<'g>,
    /// The mixing matrix, `[n (to), n (from), n_tokens]`.
    pub comb: Tensor<'g>,
}

/// The streams `[n_embd n, n_tokens]` before `site`'s block of layer `layer`: scored
/// from their RMS-normed concatenation, collapsed into the block's input.
pub fn pre<'g>(b: &Builder<'g>, w: &LayerTensors<'g>, site: Site, layer: usize, streams: Tensor<'g>) -> Mix<'g> {
    let shape = Streams::of(b.hp);
    let mm = |w, x| b.mm(w, x);
    shape.pre(b.ctx, &mm, site.tensors().map(|t| w.get(t)), streams, layer)
}

/// The block's output `out [n_embd, n_tokens]` written back: each new stream its
/// weighted output plus its mix of the old ones, `[n_embd n, n_tokens]`.
pub fn post<'g>(b: &Builder<'g>, mix: &Mix<'g>, out: Tensor<'g>) -> Tensor<'g> {
    Streams::post(b.ctx, mix, out)
}

/// The output end's collapse of the streams `[n_embd n, n_out]` into one hidden state
/// `[n_embd, n_out]` (what the output norm reads): weighted by the output's own scores
/// (an unfused sum, as llama.cpp builds it there), or the mean.
pub fn collapse<'g>(b: &Builder<'g>, streams: Tensor<'g>) -> Tensor<'g> {
    let shape = Streams::of(b.hp);
    let mm = |w, x| b.mm(w, x);
    let end = |t: EndTensor| b.weights.end_required(t);
    let weights = match shape.hc.head {
        Head::Weighted => Some([EndTensor::OutputHcFn, EndTensor::OutputHcBase, EndTensor::OutputHcScale].map(end)),
        Head::Mean => None,
    };
    shape.collapse(b.ctx, &mm, weights, streams)
}

/// A product `w x` as the stage computes it ([`Builder::mm`]).
type MulMat<'a, 'g> = &'a dyn Fn(Tensor<'g>, Tensor<'g>) -> Tensor<'g>;

/// The graphs of [`pre`], [`post`] and [`collapse`] over explicit tensors.
struct Streams {
    hc: Hyper,
    n_embd: i64,
    rms_eps: f32,
}

impl Streams {
    fn of(hp: &HParams) -> Streams {
        Streams {
            hc: hyper(hp),
            n_embd: hp.n_embd as i64,
            rms_eps: hp.rms_eps,
        }
    }

    fn pre<'g>(
        &self,
        ctx: &'g Context,
        mm: MulMat<'_, 'g>,
        [scores, base, scale]: [Tensor<'g>; 3],
        streams: Tensor<'g>,
        layer: usize,
    ) -> Mix<'g> {
        let (hc, n) = (self.hc, self.hc.n_stream as i64);
        let n_tokens = streams.ne()[1];
        let f = std::mem::size_of::<f32>();
        let normed = ctx.rms_norm(streams, self.rms_eps);
        let mixes = mm(scores, normed).named(&format!("hc_mixes-{layer}")); // [(2 + n) n, n_tokens]
                                                                            // Part `part` (0: collapse, 1: output) of the scores, scaled, biased, squashed.
        let affine = |part: usize| {
            let cols = ctx.view_2d(mixes, n, n_tokens, mixes.nb()[1], part * n as usize * f);
            let cur = ctx.mul(cols, ctx.view_1d(scale, 1, part * f));
            ctx.sigmoid(ctx.add(cur, ctx.view_1d(base, n, part * n as usize * f)))
        };
        let weights = ctx.scale_bias(affine(0), 1.0, hc.eps).named(&format!("hc_pre-{layer}")); // [n, n_tokens]
        let post = ctx.scale(affine(1), 2.0).named(&format!("hc_post-{layer}"));
        let comb = ctx
            .hc_comb(mixes, scale, base, hc.eps, hc.sinkhorn_iters as i32)
            .named(&format!("hc_comb-{layer}")); // [n, n, n_tokens]
        let residual = ctx.reshape_3d(streams, self.n_embd, n, n_tokens);
        let input = ctx.weighted_rows_sum(residual, weights); // [n_embd, n_tokens]
        Mix {
            input,
            residual,
            post,
            comb,
        }
    }

    fn post<'g>(ctx: &'g Context, mix: &Mix<'g>, out: Tensor<'g>) -> Tensor<'g> {
        let streams = ctx.hc_post(out, mix.residual, mix.post, mix.comb); // [n_embd, n, n_tokens]
        let [n_embd, n, n_tokens, _] = streams.ne();
        ctx.reshape_2d(streams, n_embd * n, n_tokens)
    }

    /// `weights`: the output's scores, bias and scale; `None`: the mean.
    fn collapse<'g>(
        &self,
        ctx: &'g Context,
        mm: MulMat<'_, 'g>,
        weights: Option<[Tensor<'g>; 3]>,
        streams: Tensor<'g>,
    ) -> Tensor<'g> {
        let (n, n_embd) = (self.hc.n_stream as i64, self.n_embd);
        let n_out = streams.ne()[1];
        let x = ctx.reshape_3d(streams, n_embd, n, n_out);
        let stream = |s: i64| ctx.view_2d(x, n_embd, n_out, x.nb()[2], s as usize * x.nb()[1]);
        let collapsed = match weights {
            None => {
                let sum = (1..n).fold(stream(0), |acc, s| ctx.add(acc, stream(s)));
                ctx.scale(sum, 1.0 / n as f32)
            }
            Some([scores, base, scale]) => {
                let normed = ctx.rms_norm(streams, self.rms_eps);
                let mixes = mm(scores, normed); // [n, n_out]
                let cur = ctx.add(ctx.mul(mixes, scale), base);
                let weights = ctx.scale_bias(ctx.sigmoid(cur), 1.0, self.hc.eps).named("hc_head_pre");
                let weight = |s: i64| ctx.view_2d(weights, 1, n_out, weights.nb()[1], s as usize * weights.nb()[0]);
                (1..n).fold(ctx.mul(stream(0), weight(0)), |acc, s| {
                    ctx.add(acc, ctx.mul(stream(s), weight(s)))
                })
            }
        };
        collapsed.named("hc_head")
    }
}

#[cfg(test)]
// The reference indexes its matrices `[dst][src]` as the paper writes them.
#[allow(clippy::needless_range_loop)]
mod tests {
    use baton_ggml::{Allocator, Context, CpuBackend, DType, Tensor};

    use baton_gguf::{Gguf, GgufWriter};

    use super::{Head, Hyper, Streams};
    use crate::hparams::Keys;

    const N_EMBD: usize = 8;
    const N: usize = 4;
    const N_TOKENS: usize = 3;
    const N_MIX: usize = (2 + N) * N;
    const EPS: f32 = 1e-3;
    const RMS_EPS: f32 = 1e-6;

    /// Values in [-1, 1) from a small LCG, deterministic per seed.
    fn noise(n: usize, seed: u64) -> Vec<f32> {
        let mut state = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (0..n)
            .map(|_| {
                state = state
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    fn streams_of(head: Head, sinkhorn_iters: usize) -> Streams {
        Streams {
            hc: Hyper {
                n_stream: N,
                sinkhorn_iters,
                eps: EPS,
                head,
            },
            n_embd: N_EMBD as i64,
            rms_eps: RMS_EPS,
        }
    }

    /// Computes the graph whose inputs are `inputs` (shape, values) and whose outputs
    /// `build` returns; the outputs' values.
    fn compute(
        inputs: &[(&[i64], &[f32])],
        build: impl for<'g> Fn(&'g Context, &[Tensor<'g>]) -> Vec<Tensor<'g>>,
    ) -> Vec<Vec<f32>> {
        let ctx = Context::new(256, 256);
        let tensors: Vec<Tensor> = inputs
            .iter()
            .map(|(shape, _)| ctx.new_tensor(DType::F32, shape).set_input())
            .collect();
        let outs: Vec<Tensor> = build(&ctx, &tensors).into_iter().map(|t| t.set_output()).collect();
        let mut graph = ctx.new_graph();
        for &out in &outs {
            graph.expand(out);
        }
        let mut alloc = Allocator::new_cpu();
        alloc.alloc(&graph).unwrap();
        for (t, (_, values)) in tensors.iter().zip(inputs) {
            t.write(values).unwrap();
        }
        CpuBackend::new(2).compute(&graph).unwrap();
        outs.iter()
            .map(|t| {
                let mut v = vec![0f32; t.n_elements() as usize];
                t.read(&mut v).unwrap();
                v
            })
            .collect()
    }

    /// A token's streams `[N_EMBD, N]` RMS-normed as one row, times `w [N_EMBD N, rows]`.
    fn scores(x: &[f32], w: &[f32], rows: usize) -> Vec<f64> {
        let ms = x.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / x.len() as f64;
        let inv = 1.0 / (ms + RMS_EPS as f64).sqrt();
        (0..rows)
            .map(|j| {
                (0..x.len())
                    .map(|k| w[k + x.len() * j] as f64 * x[k] as f64 * inv)
                    .sum()
            })
            .collect()
    }

    fn sigmoid(v: f64) -> f64 {
        1.0 / (1.0 + (-v).exp())
    }

    fn assert_close(got: &[f32], want: &[f64], what: &str) {
        assert_eq!(got.len(), want.len(), "{what}");
        for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
            assert!(
                (g as f64 - w).abs() <= 1e-4 * (1.0 + w.abs()),
                "{what}[{i}]: {g} vs {w}"
            );
        }
    }

    /// One block's mixing as the paper writes it: the collapse weights
    /// `sigmoid(s0 m + b) + eps`, the output weights `2 sigmoid(s1 m + b)`, the mixing
    /// matrix softmaxed over its destinations and made doubly stochastic; the block's
    /// input is the weighted sum of the streams, and each new stream its weighted share
    /// of the block's output plus its mix of the old streams.
    #[test]
    fn a_block_mixes_its_streams_as_the_reference_does() {
        let iters = 3;
        let x = noise(N_EMBD * N * N_TOKENS, 1);
        let w = noise(N_EMBD * N * N_MIX, 2);
        let base = noise(N_MIX, 3);
        let scale = [0.7f32, -1.3, 2.1];
        let out = noise(N_EMBD * N_TOKENS, 4);
        let width = (N_EMBD * N) as i64;
        let shape = streams_of(Head::Weighted, iters);
        let got = compute(
            &[
                (&[width, N_TOKENS as i64], &x),
                (&[width, N_MIX as i64], &w),
                (&[N_MIX as i64], &base),
                (&[3], &scale),
                (&[N_EMBD as i64, N_TOKENS as i64], &out),
            ],
            |ctx, t| {
                let mm = |w, x| ctx.mul_mat(w, x);
                let mix = shape.pre(ctx, &mm, [t[1], t[2], t[3]], t[0], 0);
                vec![mix.input, mix.comb, Streams::post(ctx, &mix, t[4])]
            },
        );
        let (mut input, mut comb, mut streams) = (Vec::new(), Vec::new(), Vec::new());
        for token in 0..N_TOKENS {
            let xt = &x[token * N_EMBD * N..][..N_EMBD * N];
            let m = scores(xt, &w, N_MIX);
            let b = |i: usize| base[i] as f64;
            let pre: Vec<f64> = (0..N)
                .map(|h| sigmoid(m[h] * scale[0] as f64 + b(h)) + EPS as f64)
                .collect();
            let post: Vec<f64> = (0..N)
                .map(|h| 2.0 * sigmoid(m[N + h] * scale[1] as f64 + b(N + h)))
                .collect();
            // c[dst][src]
            let mut c = [[0f64; N]; N];
            for src in 0..N {
                let logits: Vec<f64> = (0..N)
                    .map(|dst| m[2 * N + dst + N * src] * scale[2] as f64 + b(2 * N + dst + N * src))
                    .collect();
                let max = logits.iter().cloned().fold(f64::MIN, f64::max);
                let sum: f64 = logits.iter().map(|l| (l - max).exp()).sum();
                for dst in 0..N {
                    c[dst][src] = (logits[dst] - max).exp() / sum + EPS as f64;
                }
            }
            let eps = EPS as f64;
            let norm_over_src = |c: &mut [[f64; N]; N]| {
                for row in c.iter_mut() {
                    let sum = row.iter().sum::<f64>() + eps;
                    row.iter_mut().for_each(|v| *v /= sum);
                }
            };
            let norm_over_dst = |c: &mut [[f64; N]; N]| {
                for src in 0..N {
                    let sum = (0..N).map(|dst| c[dst][src]).sum::<f64>() + eps;
                    (0..N).for_each(|dst| c[dst][src] /= sum);
                }
            };
            norm_over_src(&mut c);
            for _ in 1..iters {
                norm_over_dst(&mut c);
                norm_over_src(&mut c);
            }
            for src in 0..N {
                for dst in 0..N {
                    comb.push(c[dst][src]);
                }
            }
            let xs = |i: usize, s: usize| xt[i + N_EMBD * s] as f64;
            input.extend((0..N_EMBD).map(|i| (0..N).map(|h| xs(i, h) * pre[h]).sum::<f64>()));
            for dst in 0..N {
                for i in 0..N_EMBD {
                    let y = out[token * N_EMBD + i] as f64 * post[dst];
                    streams.push(y + (0..N).map(|s| xs(i, s) * c[dst][s]).sum::<f64>());
                }
            }
        }
        assert_close(&got[0], &input, "block input");
        assert_close(&got[1], &comb, "mixing matrix");
        assert_close(&got[2], &streams, "new streams");
    }

    /// The output end collapses a token's streams by its own weights
    /// (`sigmoid(s m + b) + eps`, DeepSeek V4) or by their mean (GLM-5 Next).
    #[test]
    fn the_output_collapses_the_streams_by_weights_or_mean() {
        let x = noise(N_EMBD * N * N_TOKENS, 5);
        let w = noise(N_EMBD * N * N, 6);
        let base = noise(N, 7);
        let scale = [1.7f32];
        let width = (N_EMBD * N) as i64;
        let inputs: [(&[i64], &[f32]); 4] = [
            (&[width, N_TOKENS as i64], &x),
            (&[width, N as i64], &w),
            (&[N as i64], &base),
            (&[1], &scale),
        ];
        let weighted = streams_of(Head::Weighted, 1);
        let mean = streams_of(Head::Mean, 1);
        let got = compute(&inputs, |ctx, t| {
            let mm = |w, x| ctx.mul_mat(w, x);
            vec![
                weighted.collapse(ctx, &mm, Some([t[1], t[2], t[3]]), t[0]),
                mean.collapse(ctx, &mm, None, t[0]),
            ]
        });
        let (mut by_weights, mut by_mean) = (Vec::new(), Vec::new());
        for token in 0..N_TOKENS {
            let xt = &x[token * N_EMBD * N..][..N_EMBD * N];
            let m = scores(xt, &w, N);
            let pre: Vec<f64> = (0..N)
                .map(|h| sigmoid(m[h] * scale[0] as f64 + base[h] as f64) + EPS as f64)
                .collect();
            let xs = |i: usize, s: usize| xt[i + N_EMBD * s] as f64;
            by_weights.extend((0..N_EMBD).map(|i| (0..N).map(|h| xs(i, h) * pre[h]).sum::<f64>()));
            by_mean.extend((0..N_EMBD).map(|i| (0..N).map(|h| xs(i, h)).sum::<f64>() / N as f64));
        }
        assert_close(&got[0], &by_weights, "weighted collapse");
        assert_close(&got[1], &by_mean, "mean");
    }

    /// What ggml's fused ops would abort on is refused with the key named.
    #[test]
    fn streams_other_than_four_and_no_sinkhorn_iteration_are_refused() {
        let read = |count: u32, iters: u32, eps: f32| {
            let bytes = GgufWriter::new()
                .kv_u32("m.hyper_connection.count", count)
                .kv_u32("m.hyper_connection.sinkhorn_iterations", iters)
                .kv_f32("m.hyper_connection.epsilon", eps)
                .to_bytes();
            let gguf = Gguf::parse(&bytes).unwrap();
            Hyper::read(&Keys::new(&gguf, "m"), Head::Mean).map_err(|e| e.to_string())
        };
        let hc = read(4, 20, 1e-6).unwrap();
        assert_eq!((hc.n_stream, hc.sinkhorn_iters, hc.n_mix()), (4, 20, 24));
        let err = read(2, 20, 1e-6).unwrap_err();
        assert!(err.contains("m.hyper_connection.count is 2"), "{err}");
        let err = read(4, 0, 1e-6).unwrap_err();
        assert!(err.contains("m.hyper_connection.sinkhorn_iterations is 0"), "{err}");
        let err = read(4, 20, f32::NAN).unwrap_err();
        assert!(err.contains("m.hyper_connection.epsilon is NaN"), "{err}");
    }
}
