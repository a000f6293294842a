//! How many rows ggml may multiply by a weight at once while every row still gets the
//! bits it gets alone.
//!
//! ggml's CPU backend picks its matmul kernel by the number of rows: a dot product per
//! element for one row, and from some row count on a batched kernel (tinyBLAS, the
//! repacked 4-row gemm, the tiled K-quant kernel) that may sum in another order. Which
//! kernels agree depends on the type, on where the weight lives (repacked or not), and
//! on the CPU's instruction sets, so it is measured here, on this CPU, once per kind
//! of weight: a weight of the same type, width and buffer type, random values, each row
//! count up to [`MAX_ROWS`] against each row alone. Measured on an AMD EPYC with
//! AVX-512: q4_0, q5_0, q8_0 and mxfp4 agree at every count, K-quants up to 7 rows (3
//! repacked), f32, f16 and a plain iq4_nl only at 1.
//!
//! Pieces of a few rows read the weight once per piece. Two ways avoid that for the
//! K-quants, each taken only where the probe finds it gives every row its bits alone
//! at every count ([`Whole`]): a plain weight multiplied by rows laid out as planes of
//! one row each (ggml then takes its one-row dot product for every row, and its tiling
//! still reads each block of weight rows once for all of them), and a q4_K weight
//! repacked for AVX2 multiplied by baton's kernel (`rows.rs`).

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use llama_cpp_sys_2 as sys;

use crate::backend::{Allocator, Buffer, CpuBackend};
use crate::device::Device;
use crate::graph::{Context, Tensor};
use crate::rows;
use crate::DType;

/// The most rows a probe tries; a batch of more rows is cut into pieces of at most this.
pub const MAX_ROWS: usize = 64;

/// How a weight is used.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Product {
    /// `ggml_mul_mat(weight, x)`.
    MulMat,
    /// `ggml_mul_mat_id(experts, x, ids)`: each row through some of the experts.
    MulMatId,
}

/// What decides the kernel: the weight's type, row width, buffer type, the residue of
/// its row count (repacking needs a multiple of 4 or 8 rows), and the product.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Kind {
    dtype: u32,
    width: i64,
    rows_mod: i64,
    buft: usize,
    product: Product,
}

/// A product computing a whole batch of rows, each row as alone, whatever the count.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Whole {
    /// ggml's product over rows laid out as planes of one row (`[width, 1, rows]`).
    Planes,
    /// baton's kernel for q4_K repacked in groups of 8 rows ([`Context::q4_k_rows`]).
    Q4kRows,
}

/// How a product with one kind of weight takes a batch of decode rows, each row
/// computed bit for bit as alone.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Batching {
    /// The most rows, at most [`MAX_ROWS`], ggml's product takes at once: each count
    /// from 1 to this was checked.
    pub rows: usize,
    /// A product taking any number of rows at once, where one agrees on this CPU.
    pub whole: Option<Whole>,
}

impl Whole {
    /// Whether these products take `x`: 2-d f32 rows, each contiguous.
    pub fn takes(x: Tensor<'_>) -> bool {
        let [_, _, ne2, ne3] = x.ne();
        x.dtype() == DType::F32 && ne2 == 1 && ne3 == 1 && x.nb()[0] == std::mem::size_of::<f32>()
    }
}

impl Context {
    /// `w x` for activations `x` that [`Whole::takes`], computed as `whole` says.
    pub fn mul_mat_whole<'t>(&'t self, w: Tensor<'t>, x: Tensor<'t>, whole: Whole) -> Tensor<'t> {
        match whole {
            Whole::Planes => {
                let [k, n, _, _] = x.ne();
                let nb1 = x.nb()[1];
                let out = self.mul_mat(w, self.view_3d(x, [k, 1, n], nb1, nb1, 0));
                self.reshape_2d(out, w.ne()[1], n)
            }
            Whole::Q4kRows => self.q4_k_rows(w, x),
        }
    }
}

/// How a product with `weight` takes a batch of decode rows (see [`Batching`]),
/// measured once per kind of weight on this CPU. `None` for a weight outside the CPU's
/// memory.
pub fn batching(weight: Tensor<'_>, product: Product) -> Option<Batching> {
    // SAFETY: reads the metadata of a valid tensor; a weight's buffer, when it has one,
    // is alive as long as the weight.
    let buft = unsafe {
        let buffer = (*weight.raw()).buffer;
        if buffer.is_null() {
            return None;
        }
        sys::ggml_backend_buffer_get_type(buffer)
    };
    // SAFETY: buffer types are static singletons.
    // (ggml's plain CPU buffer type names no device; its extra ones name the CPU.)
    let on_cpu = unsafe {
        sys::ggml_backend_buft_is_host(buft) || sys::ggml_backend_buft_get_device(buft) == Device::cpu().raw()
    };
    if !on_cpu {
        return None;
    }
    let ne = weight.ne();
    let kind = Kind {
        dtype: weight.dtype().0,
        width: ne[0],
        rows_mod: ne[1] % 16,
        buft: buft as usize,
        product,
    };
    static KNOWN: OnceLock<Mutex<HashMap<Kind, Batching>>> = OnceLock::new();
    let known = KNOWN.get_or_init(Default::default);
    if let Some(&measured) = known.lock().unwrap_or_else(|e| e.into_inner()).get(&kind) {
        return Some(measured);
    }
    let measured = probe(kind, buft);
    known.lock().unwrap_or_else(|e| e.into_inner()).insert(kind, measured);
    Some(measured)
}

/// Deterministic values in [-0.5, 0.5).
pub(crate) fn noise(n: usize, mut seed: u64) -> Vec<f32> {
    (0..n)
        .map(|_| {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        })
        .collect()
}

/// `values` (rows of `k`) in `dtype`'s encoding, without an importance matrix.
pub(crate) fn quantized(dtype: DType, values: &[f32], k: i64) -> Vec<u8> {
    let rows = values.len() as i64 / k;
    let mut bytes = vec![0u8; dtype.row_bytes(k as usize) * rows as usize];
    // SAFETY: `values` holds `rows` rows of `k` floats and `bytes` room for as many rows
    // of the type; the types probed and tested need no importance matrix.
    unsafe {
        sys::ggml_quantize_chunk(
            dtype.0,
            values.as_ptr(),
            bytes.as_mut_ptr().cast(),
            0,
            rows,
            k,
            std::ptr::null(),
        );
    }
    bytes
}

/// Experts in a probe of `mul_mat_id`; each row goes through the first two, so every
/// expert meets every row, as many rows as the batch has.
const PROBE_EXPERTS: i64 = 3;
const PROBE_USED: i64 = 2;

/// Measures [`batching`] for one kind of weight.
fn probe(kind: Kind, buft: sys::ggml_backend_buffer_type_t) -> Batching {
    let alone = Batching { rows: 1, whole: None };
    let dtype = DType(kind.dtype);
    let (k, m) = (kind.width, 16 + kind.rows_mod);
    let n_mats = match kind.product {
        Product::MulMat => 1,
        Product::MulMatId => PROBE_EXPERTS,
    };
    let bytes = quantized(dtype, &noise((k * m * n_mats) as usize, 1), k);
    let weights = Context::new(1, 0);
    let w = match kind.product {
        Product::MulMat => weights.new_tensor(dtype, &[k, m]),
        Product::MulMatId => weights.new_tensor(dtype, &[k, m, PROBE_EXPERTS]),
    };
    // SAFETY: allocates the probe's one weight in the weight's own buffer type.
    let buffer = unsafe { sys::ggml_backend_alloc_ctx_tensors_from_buft(weights.raw(), buft) };
    let Some(_buffer) = Buffer::from_raw(buffer) else {
        return alone;
    };
    if w.write_bytes(&bytes).is_err() {
        return alone;
    }
    let x = noise(k as usize * MAX_ROWS, 2);
    let rows = products(w, kind.product, &x, None).unwrap_or(1);
    if rows == MAX_ROWS || kind.product != Product::MulMat {
        return Batching { rows, whole: None };
    }
    // SAFETY: buffer types are static singletons with static names.
    let (name, host) = unsafe {
        let name = std::ffi::CStr::from_ptr(sys::ggml_backend_buft_name(buft));
        (
            name.to_string_lossy().into_owned(),
            sys::ggml_backend_buft_is_host(buft),
        )
    };
    let candidate = if dtype == DType(sys::GGML_TYPE_Q4_K) && name == "CPU_REPACK" && m % 8 == 0 && rows::available() {
        Some(Whole::Q4kRows)
    } else if host {
        Some(Whole::Planes)
    } else {
        None
    };
    let whole = candidate.filter(|&whole| products(w, kind.product, &x, Some(whole)) == Some(MAX_ROWS));
    Batching { rows, whole }
}

/// One graph computing `w` times each row of `x` alone and times its first `n` rows
/// for every `n` from 2 to [`MAX_ROWS`] (with ggml's product, or as `whole` says):
/// the largest `n` up to which every batched row equals the row alone (`None` when
/// ggml could not compute the graph).
fn products(w: Tensor<'_>, product: Product, x: &[f32], whole: Option<Whole>) -> Option<usize> {
    let k = w.ne()[0];
    // At most 6 nodes per product, 2 MAX_ROWS products.
    let ctx = Context::new(12 * MAX_ROWS + 8, 12 * MAX_ROWS + 8);
    let input = ctx.new_tensor(DType::F32, &[k, MAX_ROWS as i64]).set_input();
    let ids = ctx.new_tensor(DType::I32, &[PROBE_USED, MAX_ROWS as i64]).set_input();
    let row_bytes = DType::F32.row_bytes(k as usize);
    let times = |first: usize, n: usize, whole: Option<Whole>| {
        let rows = ctx.view_2d(input, k, n as i64, row_bytes, first * row_bytes);
        let out = match product {
            Product::MulMat => match whole {
                Some(whole) => ctx.mul_mat_whole(w, rows, whole),
                None => ctx.mul_mat(w, rows),
            },
            Product::MulMatId => {
                let rows = ctx.reshape_3d(ctx.cont(rows), k, 1, n as i64);
                let wide = ctx.repeat_4d(rows, [k, PROBE_USED, n as i64, 1]);
                let ids = ctx.view_2d(ids, PROBE_USED, n as i64, ids.nb()[1], 0);
                ctx.mul_mat_id(w, wide, ids)
            }
        };
        out.set_output()
    };
    let alone: Vec<Tensor<'_>> = (0..MAX_ROWS).map(|row| times(row, 1, None)).collect();
    let batched: Vec<Tensor<'_>> = (2..=MAX_ROWS).map(|n| times(0, n, whole)).collect();
    let mut graph = ctx.new_graph();
    for &out in alone.iter().chain(&batched) {
        graph.expand(out);
    }
    let mut alloc = Allocator::new_cpu();
    alloc.alloc(&graph).ok()?;
    input.write(x).ok()?;
    // Every row through the first `PROBE_USED` experts, so each meets every row.
    let chosen: Vec<i32> = (0..MAX_ROWS).flat_map(|_| 0..PROBE_USED as i32).collect();
    if product == Product::MulMatId {
        ids.write(&chosen).ok()?;
    }
    CpuBackend::new(2).compute(&graph).ok()?;
    let read = |t: Tensor<'_>| {
        let mut values = vec![0f32; t.ne().iter().product::<i64>() as usize];
        t.read(&mut values).ok().map(|()| values)
    };
    let alone: Vec<Vec<f32>> = alone.into_iter().map(read).collect::<Option<_>>()?;
    for (out, n) in batched.into_iter().zip(2..) {
        let out = read(out)?;
        if !out
            .chunks_exact(out.len() / n)
            .zip(&alone)
            .all(|(row, alone)| row == alone)
        {
            return Some(n - 1);
        }
    }
    Some(MAX_ROWS)
}
