//! Properties of ggml's CPU kernels that baton relies on.

use llama_cpp_sys_2 as sys;

use crate::invariant::{noise, quantized};
use crate::{Allocator, Context, CpuBackend, DType};

/// `w x` for the first `n` columns of `x` on 2 threads; returns column 0 of the result.
fn first_column(w_type: u32, w: &[u8], x: &[f32], k: i64, m: i64, n: i64) -> Vec<f32> {
    let ctx = Context::new(4, 4);
    let wt = ctx.new_tensor(DType(w_type), &[k, m]).set_input();
    let xt = ctx.new_tensor(DType::F32, &[k, n]).set_input();
    let y = ctx.mul_mat(wt, xt).set_output();
    let mut graph = ctx.new_graph();
    graph.expand(y);
    let mut alloc = Allocator::new_cpu();
    alloc.alloc(&graph).unwrap();
    wt.write_bytes(w).unwrap();
    xt.write(&x[..(k * n) as usize]).unwrap();
    CpuBackend::new(2).compute(&graph).unwrap();
    let mut out = vec![0f32; (m * n) as usize];
    y.read(&mut out).unwrap();
    out.truncate(m as usize);
    out
}

/// The server batches up to 7 decode rows and never mixes them with prompt chunks
/// because a row multiplied by quantized weights gives the same bits in a batch of up
/// to 7 rows as alone. From 8 rows, K-quants take ggml's tiled kernel, which rounds
/// differently (printed here, not asserted: a kernel may become batch-invariant).
#[test]
fn quantized_mul_mat_rows_are_batch_invariant_below_8() {
    let (k, m) = (1024i64, 64i64);
    let weights = noise((k * m) as usize, 1);
    let x = noise((k * 16) as usize, 2);
    for (w_type, name) in [
        (sys::GGML_TYPE_Q4_0, "q4_0"),
        (sys::GGML_TYPE_Q5_0, "q5_0"),
        (sys::GGML_TYPE_Q8_0, "q8_0"),
        (sys::GGML_TYPE_Q4_K, "q4_K"),
        (sys::GGML_TYPE_Q6_K, "q6_K"),
    ] {
        let w = quantized(DType(w_type), &weights, k);
        let alone = first_column(w_type, &w, &x, k, m, 1);
        for n in 2..=7 {
            assert_eq!(first_column(w_type, &w, &x, k, m, n), alone, "{name}: batch of {n}");
        }
        let same_at_8 = first_column(w_type, &w, &x, k, m, 8) == alone;
        println!(
            "{name}: batch of 8 {} alone",
            if same_at_8 { "equals" } else { "differs from" }
        );
    }
}

/// llama.cpp inside baton is compiled as Release (-O3) whatever the Rust profile:
/// `debug = 1` in our release profile once made llama-cpp-sys-2 configure it as
/// RelWithDebInfo (-O2), 22% slower on prompts (issue 12).
#[test]
fn llama_cpp_is_built_as_release() {
    assert_eq!(crate::LLAMA_BUILD_TYPE, "Release");
}

/// Expert matmul (`mul_mat_id`) of `n` tokens, each routed to two of 8 experts `[k, m]`
/// quantized as `w_type`; token 0 to experts 3 and 5, token `t` to `route(t)`. Returns
/// token 0's two output rows.
fn first_token_experts(
    w_type: u32,
    w: &[u8],
    x: &[f32],
    k: i64,
    m: i64,
    n: i64,
    route: impl Fn(i64) -> [i32; 2],
) -> Vec<f32> {
    const N_EXPERT: i64 = 8;
    let ctx = Context::new(4, 4);
    let wt = ctx.new_tensor(DType(w_type), &[k, m, N_EXPERT]).set_input();
    // One input row per token, shared by both of its experts (as the up/gate matmuls of
    // a MoE layer read it).
    let xt = ctx.new_tensor(DType::F32, &[k, 1, n]).set_input();
    let ids = ctx.new_tensor(DType::I32, &[2, n]).set_input();
    let y = ctx.mul_mat_id(wt, xt, ids).set_output(); // [m, 2, n]
    let mut graph = ctx.new_graph();
    graph.expand(y);
    let mut alloc = Allocator::new_cpu();
    alloc.alloc(&graph).unwrap();
    wt.write_bytes(w).unwrap();
    xt.write(&x[..(k * n) as usize]).unwrap();
    let routes: Vec<i32> = (0..n).flat_map(|t| if t == 0 { [3, 5] } else { route(t) }).collect();
    ids.write(&routes).unwrap();
    CpuBackend::new(2).compute(&graph).unwrap();
    let mut out = vec![0f32; (m * 2 * n) as usize];
    y.read(&mut out).unwrap();
    out.truncate(2 * m as usize);
    out
}

/// `prec_f32_input` records what llama.cpp's `ggml_prec_set_src(node, GGML_PREC_F32, 1)`
/// records (op parameter 3 of a matmul), which device backends read; the CPU backend
/// does not, so an expert matmul gives the same bits with it.
#[test]
fn f32_input_is_recorded_and_changes_nothing_on_the_cpu() {
    let (k, m, n, n_expert) = (256i64, 32i64, 3i64, 4i64);
    let weights = noise((k * m * n_expert) as usize, 7);
    let x: Vec<f32> = noise((k * 2 * n) as usize, 8).iter().map(|v| v * 1e5).collect();
    let run = |f32_input: bool| -> (i32, Vec<f32>) {
        let ctx = Context::new(4, 4);
        let wt = ctx.new_tensor(DType::F32, &[k, m, n_expert]).set_input();
        let xt = ctx.new_tensor(DType::F32, &[k, 2, n]).set_input();
        let ids = ctx.new_tensor(DType::I32, &[2, n]).set_input();
        let mut y = ctx.mul_mat_id(wt, xt, ids);
        if f32_input {
            y = y.prec_f32_input();
        }
        let y = y.set_output(); // [m, 2, n]
                                // SAFETY: `y` is a valid node of `ctx`; op parameters are plain integers.
        let param = unsafe { (*y.raw()).op_params[3] };
        let mut graph = ctx.new_graph();
        graph.expand(y);
        let mut alloc = Allocator::new_cpu();
        alloc.alloc(&graph).unwrap();
        wt.write(&weights).unwrap();
        xt.write(&x).unwrap();
        ids.write(&[0, 3, 2, 1, 3, 2]).unwrap();
        CpuBackend::new(2).compute(&graph).unwrap();
        let mut out = vec![0f32; (m * 2 * n) as usize];
        y.read(&mut out).unwrap();
        (param, out)
    };
    let (param, plain) = run(false);
    assert_eq!(param, sys::GGML_PREC_DEFAULT as i32);
    let (param, f32_input) = run(true);
    assert_eq!(param, sys::GGML_PREC_F32 as i32);
    assert!(plain.iter().any(|&v| v.abs() > 65504.0), "rows beyond f16's range");
    assert_eq!(f32_input, plain);
}

/// The batching invariance of `quantized_mul_mat_rows_are_batch_invariant_below_8`
/// holds for mixture-of-experts layers too: a token's expert rows are the same bits
/// whether it is alone or batched with up to 6 others, both when the others pick the
/// same experts (up to 7 rows per expert) and when they pick others.
#[test]
fn quantized_mul_mat_id_rows_are_batch_invariant_below_8() {
    let (k, m) = (512i64, 64i64);
    let weights = noise((k * m * 8) as usize, 3);
    let x = noise((k * 16) as usize, 4);
    let same = |_t: i64| [3, 5];
    let mixed = |t: i64| [(t % 8) as i32, ((t * 3 + 1) % 8) as i32];
    for (w_type, name) in [
        (sys::GGML_TYPE_Q4_0, "q4_0"),
        (sys::GGML_TYPE_Q8_0, "q8_0"),
        (sys::GGML_TYPE_Q4_K, "q4_K"),
        (sys::GGML_TYPE_Q6_K, "q6_K"),
        (sys::GGML_TYPE_MXFP4, "mxfp4"),
    ] {
        let w = quantized(DType(w_type), &weights, k);
        let alone = first_token_experts(w_type, &w, &x, k, m, 1, same);
        assert!(alone.iter().any(|&v| v != 0.0), "{name}: expert rows are computed");
        for n in 2..=7 {
            assert_eq!(
                first_token_experts(w_type, &w, &x, k, m, n, same),
                alone,
                "{name}: {n} tokens on the same experts"
            );
            assert_eq!(
                first_token_experts(w_type, &w, &x, k, m, n, mixed),
                alone,
                "{name}: {n} tokens on mixed experts"
            );
        }
        let same_at_8 = first_token_experts(w_type, &w, &x, k, m, 8, same) == alone;
        println!(
            "{name}: 8 tokens on the same experts {} alone",
            if same_at_8 { "equal" } else { "differ from" }
        );
    }
}

/// Why MoE routers (left in f32 by llama.cpp's quantizer) are multiplied row by row in
/// decode batches: f32 weights take ggml's tiled kernel from 2 rows, whose rows are the
/// same bits in any batch of 2 or more, and a dot product for a lone row, which rounds
/// differently (printed: a future ggml may make them agree). x86-64 only: ggml's f32
/// kernels for armv8-a (the aarch64 build, run under qemu-aarch64) give a row of a
/// batch of 4 other bits than the same row in a batch of 2; routers are multiplied row
/// by row there too, so nothing relies on it.
#[test]
#[cfg(target_arch = "x86_64")]
fn f32_mul_mat_rows_agree_from_2_rows_on() {
    let (k, m) = (1024i64, 64i64);
    let weights = noise((k * m) as usize, 5);
    let x = noise((k * 16) as usize, 6);
    let w: Vec<u8> = weights.iter().flat_map(|v| v.to_le_bytes()).collect();
    let two = first_column(sys::GGML_TYPE_F32, &w, &x, k, m, 2);
    for n in 3..=16 {
        assert_eq!(
            first_column(sys::GGML_TYPE_F32, &w, &x, k, m, n),
            two,
            "f32: batch of {n}"
        );
    }
    let alone = first_column(sys::GGML_TYPE_F32, &w, &x, k, m, 1);
    println!(
        "f32: a lone row {} the same row in a batch",
        if alone == two { "equals" } else { "differs from" }
    );
}

/// `batching` measures each kind of weight once, on random values: rows cut into
/// pieces of `rows` give every row its bits alone for other values, another width and
/// far more rows too, and so does the whole batch at once where a `whole` product was
/// found. The K-quants get one on x86-64: planes when plain, baton's kernel when q4_K is
/// repacked for AVX2. Prints the measure for each type, plain and repacked.
#[test]
fn decode_batches_compute_every_row_as_alone() {
    let (k, m, n) = (2048i64, 24i64, 100usize);
    let weights = noise((k * m) as usize, 3);
    let x = noise(k as usize * n, 4);
    let extras = crate::BufferType::cpu_extra();
    for (w_type, name) in [
        (sys::GGML_TYPE_Q4_0, "q4_0"),
        (sys::GGML_TYPE_Q8_0, "q8_0"),
        (sys::GGML_TYPE_IQ4_NL, "iq4_nl"),
        (sys::GGML_TYPE_Q2_K, "q2_K"),
        (sys::GGML_TYPE_Q4_K, "q4_K"),
        (sys::GGML_TYPE_Q5_K, "q5_K"),
        (sys::GGML_TYPE_Q6_K, "q6_K"),
        (sys::GGML_TYPE_F16, "f16"),
        (sys::GGML_TYPE_F32, "f32"),
    ] {
        let w = quantized(DType(w_type), &weights, k);
        for extra in [None, extras.first()] {
            let wctx = Context::new(1, 0);
            let wt = wctx.new_tensor(DType(w_type), &[k, m]);
            if extra.is_some_and(|e| !e.supports(wt, crate::WeightOp::MulMat)) {
                continue;
            }
            let _buffer = match extra {
                Some(e) => e.alloc(&wctx).unwrap(),
                None => crate::Buffer::alloc_cpu(&wctx).unwrap(),
            };
            wt.write_bytes(&w).unwrap();
            let batching = crate::batching(wt, crate::Product::MulMat).expect("a weight in the CPU's memory");
            let rows = batching.rows;
            let place = extra.map_or("CPU".into(), |e| e.name());
            println!("{name:7} {place:10} {rows} rows, whole batches: {:?}", batching.whole);
            assert!((1..=crate::MAX_ROWS).contains(&rows));
            let k_quant = [
                sys::GGML_TYPE_Q2_K,
                sys::GGML_TYPE_Q4_K,
                sys::GGML_TYPE_Q5_K,
                sys::GGML_TYPE_Q6_K,
            ]
            .contains(&w_type);
            if cfg!(target_arch = "x86_64") && k_quant && rows < crate::MAX_ROWS {
                let expected = match extra {
                    None => Some(crate::Whole::Planes),
                    Some(_) if w_type == sys::GGML_TYPE_Q4_K && crate::rows::available() => Some(crate::Whole::Q4kRows),
                    Some(_) => None,
                };
                assert_eq!(batching.whole, expected, "{name} in {place}");
            }

            let ctx = Context::new(4 * n + 8, 4 * n + 8);
            let input = ctx.new_tensor(DType::F32, &[k, n as i64]).set_input();
            let row_bytes = DType::F32.row_bytes(k as usize);
            let times = |first: usize, count: usize| {
                let view = ctx.view_2d(input, k, count as i64, row_bytes, first * row_bytes);
                ctx.mul_mat(wt, view).set_output()
            };
            let alone: Vec<_> = (0..n).map(|row| times(row, 1)).collect();
            let pieces: Vec<_> = (0..n)
                .step_by(rows)
                .map(|first| times(first, rows.min(n - first)))
                .collect();
            let whole = batching
                .whole
                .map(|whole| ctx.mul_mat_whole(wt, input, whole).set_output());
            let mut graph = ctx.new_graph();
            for &t in alone.iter().chain(&pieces).chain(&whole) {
                graph.expand(t);
            }
            let mut alloc = Allocator::new_cpu();
            alloc.alloc(&graph).unwrap();
            input.write(&x).unwrap();
            CpuBackend::new(2).compute(&graph).unwrap();
            let read = |t: crate::Tensor<'_>| {
                let mut v = vec![0f32; t.ne().iter().product::<i64>() as usize];
                t.read(&mut v).unwrap();
                v
            };
            let batched: Vec<f32> = pieces.into_iter().flat_map(read).collect();
            let whole = whole.map(read);
            for (row, t) in alone.into_iter().enumerate() {
                let alone = read(t);
                let range = row * m as usize..(row + 1) * m as usize;
                assert_eq!(
                    &batched[range.clone()],
                    &alone[..],
                    "{name} in {place}: row {row} in pieces of {rows}"
                );
                if let Some(whole) = &whole {
                    assert_eq!(&whole[range], &alone[..], "{name} in {place}: row {row} of {n} at once");
                }
            }
        }
    }
}

/// The delta rule as ggml's CPU kernel computes it, for one sequence: `q`, `k`, `v`
/// `[s, h, t]`, the decay `g` `[g_width, h, t]` (1: one per head; `s`: one per key
/// dimension, Kimi Delta Attention's), `beta` `[h, t]`. Returns the outputs
/// `[s, h, t]` and the state after each token, `[t][h][s × s]` (column-major: element
/// `j × s + i` is row `i`, column `j`).
fn delta_rule_reference(
    (s, h, t): (usize, usize, usize),
    [q, k, v]: [&[f32]; 3],
    g: &[f32],
    g_width: usize,
    beta: &[f32],
) -> (Vec<f32>, Vec<Vec<f32>>) {
    let mut state = vec![0f32; h * s * s];
    let mut out = vec![0f32; s * h * t];
    let mut states = Vec::new();
    let scale = 1.0 / (s as f32).sqrt();
    for token in 0..t {
        for head in 0..h {
            let at = |x: &[f32], i: usize| x[(token * h + head) * s + i];
            let m = &mut state[head * s * s..(head + 1) * s * s];
            for j in 0..s {
                for i in 0..s {
                    let decay = g[(token * h + head) * g_width + if g_width == 1 { 0 } else { i }];
                    m[j * s + i] *= decay.exp();
                }
            }
            let b = beta[token * h + head];
            let delta: Vec<f32> = (0..s)
                .map(|j| (at(v, j) - (0..s).map(|i| m[j * s + i] * at(k, i)).sum::<f32>()) * b)
                .collect();
            for j in 0..s {
                for i in 0..s {
                    m[j * s + i] += at(k, i) * delta[j];
                }
            }
            for j in 0..s {
                out[(token * h + head) * s + j] = (0..s).map(|i| m[j * s + i] * at(q, i)).sum::<f32>() * scale;
            }
        }
        states.push(state.clone());
    }
    (out, states)
}

/// ggml's fused delta rule (`Context::gated_delta_net`) with a decay per key dimension
/// (`g` `[s, h, t, 1]`, Kimi Delta Attention) computes the delta rule of the reference
/// above, outputs and kept states (newest first), and not what one decay per head
/// (each head's first) would give.
#[test]
fn gated_delta_net_decays_each_key_dimension_by_its_own_gate() {
    let (s, h, t, keep) = (8usize, 2usize, 5usize, 3usize);
    let n = s * h * t;
    let unit = |x: Vec<f32>| -> Vec<f32> {
        // Queries and keys L2-normalised per head, as the layers feed them.
        x.chunks(s)
            .flat_map(|head| {
                let norm = head.iter().map(|a| a * a).sum::<f32>().sqrt();
                head.iter().map(move |a| a / norm).collect::<Vec<_>>()
            })
            .collect()
    };
    let (q, k, v) = (unit(noise(n, 1)), unit(noise(n, 2)), noise(n, 3));
    let g: Vec<f32> = noise(n, 4).iter().map(|x| -x.abs() * 2.0).collect();
    let beta: Vec<f32> = noise(h * t, 5).iter().map(|x| x + 0.5).collect();

    let ctx = Context::new(8, 8);
    let shape = [s as i64, h as i64, t as i64, 1];
    let qt = ctx.new_tensor(DType::F32, &shape).set_input();
    let kt = ctx.new_tensor(DType::F32, &shape).set_input();
    let vt = ctx.new_tensor(DType::F32, &shape).set_input();
    let gt = ctx.new_tensor(DType::F32, &shape).set_input();
    let bt = ctx.new_tensor(DType::F32, &[1, h as i64, t as i64, 1]).set_input();
    let st = ctx
        .new_tensor(DType::F32, &[s as i64, s as i64, h as i64, 1])
        .set_input();
    let y = ctx.gated_delta_net(qt, kt, vt, gt, bt, st, keep).set_output();
    let mut graph = ctx.new_graph();
    graph.expand(y);
    let mut alloc = Allocator::new_cpu();
    alloc.alloc(&graph).unwrap();
    for (tensor, values) in [(qt, &q), (kt, &k), (vt, &v), (gt, &g)] {
        tensor.write(values).unwrap();
    }
    bt.write(&beta).unwrap();
    st.write(&vec![0f32; s * s * h]).unwrap();
    CpuBackend::new(2).compute(&graph).unwrap();
    let mut packed = vec![0f32; n + keep * s * s * h];
    y.read(&mut packed).unwrap();

    let close = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| (x - y).abs() <= 1e-5 * (1.0 + y.abs()));
    let (out, states) = delta_rule_reference((s, h, t), [&q, &k, &v], &g, s, &beta);
    assert!(close(&packed[..n], &out), "outputs {:?} vs {out:?}", &packed[..n]);
    for slot in 0..keep {
        let got = &packed[n + slot * s * s * h..n + (slot + 1) * s * s * h];
        assert!(close(got, &states[t - 1 - slot]), "kept state {slot}");
    }
    let per_head: Vec<f32> = g.chunks(s).map(|head| head[0]).collect();
    let (other, _) = delta_rule_reference((s, h, t), [&q, &k, &v], &per_head, 1, &beta);
    assert!(!close(&packed[..n], &other), "one decay per head gives other outputs");
}
