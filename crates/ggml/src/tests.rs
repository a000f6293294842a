//! Properties of ggml's CPU kernels that baton relies on.

use llama_cpp_sys_2 as sys;

use crate::{Allocator, Context, CpuBackend, DType};

/// Deterministic values in [-0.5, 0.5).
fn noise(n: usize, mut seed: u64) -> Vec<f32> {
    (0..n)
        .map(|_| {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        })
        .collect()
}

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
        // SAFETY: pure size computation for a valid type.
        let row = unsafe { sys::ggml_row_size(w_type, k) };
        let mut w = vec![0u8; row * m as usize];
        // SAFETY: `weights` holds m rows of k floats; `w` has room for m quantized rows;
        // these types need no importance matrix.
        unsafe {
            sys::ggml_quantize_chunk(
                w_type,
                weights.as_ptr(),
                w.as_mut_ptr().cast(),
                0,
                m,
                k,
                std::ptr::null(),
            );
        }
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
