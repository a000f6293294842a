//! A product of a repacked q4_K weight with a batch of rows in which every row gets
//! exactly the bits ggml's one-row kernel gives it, while each weight block is read once
//! for the whole batch.
//!
//! On x86-64 with AVX2, ggml repacks q4_K weights into groups of 8 interleaved rows
//! (`block_q4_Kx8`, ggml-cpu/repack.cpp) and multiplies them by one row of activations
//! with `ggml_gemv_q4_K_8x8_q8_K`, by 4 or more with `ggml_gemm_q4_K_8x8_q8_K`. The two
//! sum in different orders, so a row computed in a batch of 4 differs from the same row
//! alone. The kernel below does, for each row, the gemv's integer and floating-point
//! operations in the gemv's order (so each row's result is the gemv's, bit for bit), but
//! walks the weight once: for each group of 8 weight rows and each super-block, the
//! nibbles are unpacked and interleaved once and then multiplied by up to 4 rows of
//! activations, whose accumulators stay in registers.
//!
//! The activations are quantized to q8_K as ggml quantizes them for the gemv
//! (`quantize_row_q8_K_ref`). Whether the whole agrees with ggml on this CPU and build is
//! not assumed: [`crate::invariant`] compares the kernel with ggml's one-row product on a
//! repacked weight before any stage uses it, and keeps cutting batches into pieces where
//! it does not agree.

use std::sync::Arc;

use llama_cpp_sys_2 as sys;

use crate::graph::{Context, Tensor};
use crate::DType;

/// ggml's `GGML_N_TASKS_MAX`: a custom op run on all of the graph's threads.
const GGML_N_TASKS_MAX: i32 = -1;

/// Elements per K-quant super-block.
const QK_K: usize = 256;
/// Weight rows interleaved in one repacked block.
const COLS: usize = 8;

/// ggml's `block_q8_K`: one super-block of activations.
#[repr(C)]
#[derive(Clone, Copy)]
struct BlockQ8K {
    d: f32,
    qs: [i8; QK_K],
    bsums: [i16; QK_K / 16],
}

/// ggml's `block_q4_Kx8`: one super-block of 8 interleaved q4_K rows.
#[repr(C)]
struct BlockQ4Kx8 {
    d: [u16; COLS],
    dmin: [u16; COLS],
    scales: [u8; 96],
    qs: [u8; 1024],
}

const _: () = assert!(std::mem::size_of::<BlockQ8K>() == 292);
const _: () = assert!(std::mem::size_of::<BlockQ4Kx8>() == 1152);

/// True when this CPU runs the kernel (AVX2, FMA and F16C, as ggml's gemv needs).
pub fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
            && std::arch::is_x86_feature_detected!("f16c")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// The repacked weight a product node reads: where its data lives and its shape. The
/// data belongs to the model's weight buffer, which outlives every graph built over it.
struct Weight {
    data: *const u8,
    width: usize,
    rows: usize,
}

// SAFETY: the pointer is only read, by the graph's threads, while the weight's buffer
// lives (see `Weight`).
unsafe impl Send for Weight {}
// SAFETY: as above; nothing writes through it.
unsafe impl Sync for Weight {}

impl Context {
    /// `w x` for a q4_K weight `w` repacked by ggml for AVX2 (8 interleaved rows,
    /// `CPU_REPACK`) and f32 activations `x` (`[width, rows]`), each row computed as
    /// ggml computes it alone. Two nodes: the rows quantized to q8_K, then the product.
    /// The caller checks that this agrees with ggml here ([`crate::invariant`]).
    ///
    /// # Panics
    /// When `w` is not q4_K with a multiple of 8 rows and of 256 columns, or `x` is not
    /// 2-d f32 rows of `w`'s width, each contiguous (a bug in the caller).
    pub(crate) fn q4_k_rows<'t>(&'t self, w: Tensor<'t>, x: Tensor<'t>) -> Tensor<'t> {
        let [width, rows, ..] = w.ne();
        let [xw, n, ..] = x.ne();
        assert!(
            w.dtype() == DType(sys::GGML_TYPE_Q4_K)
                && rows % COLS as i64 == 0
                && width % QK_K as i64 == 0
                && crate::Whole::takes(x)
                && xw == width,
            "q4_k_rows multiplies a repacked q4_K weight by f32 rows"
        );
        // SAFETY: reads the data pointer of a weight allocated in its buffer.
        let data = unsafe { (*w.raw()).data as *const u8 };
        let weight = Arc::new(Weight {
            data,
            width: width as usize,
            rows: rows as usize,
        });
        let row_bytes = (width as usize / QK_K * std::mem::size_of::<BlockQ8K>()) as i64;
        let quantized = self.custom(DType(sys::GGML_TYPE_I8), [row_bytes, n], x, quantize_rows, None);
        self.custom(DType::F32, [rows, n], quantized, multiply_rows, Some(weight))
    }

    /// A custom node over `a` computing `op` on all of the graph's threads; `userdata`
    /// (kept alive by the context) is handed to `op`.
    fn custom<'t>(
        &'t self,
        dtype: DType,
        ne: [i64; 2],
        a: Tensor<'t>,
        op: unsafe extern "C" fn(*mut sys::ggml_tensor, i32, i32, *mut std::ffi::c_void),
        userdata: Option<Arc<Weight>>,
    ) -> Tensor<'t> {
        let ptr = userdata
            .as_ref()
            .map_or(std::ptr::null_mut(), |w| Arc::as_ptr(w) as *mut std::ffi::c_void);
        if let Some(weight) = userdata {
            self.keep(weight);
        }
        let mut args = [a.raw()];
        // SAFETY: records a node over a valid tensor (ggml copies the source list);
        // `op` upholds ggml's custom-op contract and its userdata is kept alive.
        unsafe {
            self.wrap(sys::ggml_custom_4d(
                self.raw(),
                dtype.0,
                ne[0],
                ne[1],
                1,
                1,
                args.as_mut_ptr(),
                1,
                Some(op),
                GGML_N_TASKS_MAX,
                ptr,
            ))
        }
    }
}

/// The share `[start, end)` of `n` items thread `ith` of `nth` takes.
fn share(n: usize, ith: i32, nth: i32) -> std::ops::Range<usize> {
    let (ith, nth) = (ith.max(0) as usize, nth.max(1) as usize);
    n * ith / nth..n * (ith + 1) / nth
}

/// Quantizes this thread's share of the f32 rows of `dst`'s source into `dst` (q8_K).
unsafe extern "C" fn quantize_rows(dst: *mut sys::ggml_tensor, ith: i32, nth: i32, _: *mut std::ffi::c_void) {
    // SAFETY: `q4_k_rows` made `dst` an i8 tensor of one q8_K row per f32 row of its
    // source; ggml allocated both before computing, and each thread writes its own rows.
    unsafe {
        let src = (*dst).src[0];
        let width = (*src).ne[0] as usize;
        let blocks = width / QK_K;
        for row in share((*src).ne[1] as usize, ith, nth) {
            let x = std::slice::from_raw_parts(((*src).data as *const u8).add(row * (*src).nb[1]) as *const f32, width);
            let y = ((*dst).data as *mut u8).add(row * (*dst).nb[1]) as *mut BlockQ8K;
            quantize_q8_k(x, std::slice::from_raw_parts_mut(y, blocks));
        }
    }
}

/// `x` in q8_K, as ggml's `quantize_row_q8_K_ref` writes it: per super-block the value
/// of largest magnitude maps to -127, the others are rounded to nearest (ties as the
/// float adder rounds) and capped at 127; `bsums` holds sums of 16.
fn quantize_q8_k(x: &[f32], y: &mut [BlockQ8K]) {
    for (x, y) in x.chunks_exact(QK_K).zip(y) {
        let (mut max, mut amax) = (0f32, 0f32);
        for &v in x {
            if v.abs() > amax {
                amax = v.abs();
                max = v;
            }
        }
        if amax == 0.0 {
            *y = BlockQ8K {
                d: 0.0,
                qs: [0; QK_K],
                bsums: [0; QK_K / 16],
            };
            continue;
        }
        let iscale = -127.0 / max;
        for (q, &v) in y.qs.iter_mut().zip(x) {
            *q = nearest_int(iscale * v).min(127) as i8;
        }
        for (sum, qs) in y.bsums.iter_mut().zip(y.qs.chunks_exact(16)) {
            *sum = qs.iter().map(|&q| q as i32).sum::<i32>() as i16;
        }
        y.d = 1.0 / iscale;
    }
}

/// ggml's `nearest_int`: rounds through the float adder (|v| < 2^22).
fn nearest_int(v: f32) -> i32 {
    let bits = (v + 12582912.0).to_bits() as i32;
    (bits & 0x007f_ffff) - 0x0040_0000
}

/// Multiplies this thread's share of the weight's row groups by every quantized row.
unsafe extern "C" fn multiply_rows(dst: *mut sys::ggml_tensor, ith: i32, nth: i32, userdata: *mut std::ffi::c_void) {
    // SAFETY: `q4_k_rows` made `dst` f32 `[weight rows, n]` over one q8_K row per
    // activation row, with the `Weight` (kept alive by the context) as userdata; each
    // thread writes its own groups of 8 columns.
    unsafe {
        let weight = &*(userdata as *const Weight);
        let src = (*dst).src[0];
        let n = (*src).ne[1] as usize;
        let blocks = weight.width / QK_K;
        let row = |r: usize| ((*src).data as *const u8).add(r * (*src).nb[1]) as *const BlockQ8K;
        let out = |r: usize| ((*dst).data as *mut u8).add(r * (*dst).nb[1]) as *mut f32;
        for group in share(weight.rows / COLS, ith, nth) {
            let w = (weight.data as *const BlockQ4Kx8).add(group * blocks);
            // Up to 4 rows at a time: their accumulators fill the vector registers.
            for first in (0..n).step_by(4) {
                let take = (n - first).min(4);
                let a: [*const BlockQ8K; 4] = std::array::from_fn(|i| row(first + i.min(take - 1)));
                let o: [*mut f32; 4] = std::array::from_fn(|i| out(first + i.min(take - 1)));
                rows_group(blocks, w, &a[..take], &o[..take], group * COLS);
            }
        }
    }
}

/// One group of 8 weight rows times 1 to 4 activation rows (see `x86::group`).
///
/// # Safety
/// As `x86::group`'s; only called where [`available`] said so.
unsafe fn rows_group(blocks: usize, w: *const BlockQ4Kx8, a: &[*const BlockQ8K], out: &[*mut f32], col: usize) {
    // SAFETY: the caller's contract is `x86::group`'s.
    #[cfg(target_arch = "x86_64")]
    unsafe {
        match a.len() {
            4 => x86::group::<4>(blocks, w, a, out, col),
            3 => x86::group::<3>(blocks, w, a, out, col),
            2 => x86::group::<2>(blocks, w, a, out, col),
            _ => x86::group::<1>(blocks, w, a, out, col),
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (blocks, w, a, out, col);
        unreachable!("the q4_K kernel runs only on x86-64 CPUs with AVX2");
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{BlockQ4Kx8, BlockQ8K};

    /// Broadcasts 16 bytes to both halves of a 256-bit vector.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn both_halves(bytes: &[i8]) -> __m256i {
        assert!(bytes.len() >= 16);
        // SAFETY: 16 readable bytes, checked above.
        let v = unsafe { _mm256_castsi128_si256(_mm_loadu_si128(bytes.as_ptr().cast())) };
        _mm256_permute2f128_si256::<0>(v, v)
    }

    /// The 6-bit scales and mins of one sub-block of the 8 rows, as ggml's gemv unpacks
    /// them from 12 bytes: (scales widened to 16 bits in the gemv's lane order, the
    /// packed mins-and-scales vector).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn scales(bytes: &[u8]) -> (__m256i, __m128i) {
        const KMASK1: u32 = 0x3f3f3f3f;
        const KMASK2: u32 = 0x0f0f0f0f;
        const KMASK3: u32 = 0x03030303;
        let word = |i: usize| u32::from_le_bytes([bytes[4 * i], bytes[4 * i + 1], bytes[4 * i + 2], bytes[4 * i + 3]]);
        let mut u = [word(0), word(1), word(2), 0];
        u[3] = ((u[2] >> 4) & KMASK2) | (((u[1] >> 6) & KMASK3) << 4);
        let aux = u[1] & KMASK1;
        u[1] = (u[2] & KMASK2) | (((u[0] >> 6) & KMASK3) << 4);
        u[2] = aux;
        u[0] &= KMASK1;
        let scalemask = _mm_set_epi8(7, 7, 3, 3, 6, 6, 2, 2, 5, 5, 1, 1, 4, 4, 0, 0);
        let packed = _mm_set_epi32(u[3] as i32, u[2] as i32, u[1] as i32, u[0] as i32);
        (_mm256_cvtepu8_epi16(_mm_shuffle_epi8(packed, scalemask)), packed)
    }

    /// One group of 8 weight rows times `R` activation rows: `out[r][col..col + 8]` gets
    /// what `ggml_gemv_q4_K_8x8_q8_K` writes for row `r` (same operations, same order).
    ///
    /// # Safety
    /// `w` points at `blocks` repacked blocks, each `a[r]` at `blocks` q8_K blocks, each
    /// `out[r] + col` at 8 writable floats; the CPU has AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn group<const R: usize>(
        blocks: usize,
        w: *const BlockQ4Kx8,
        a: &[*const BlockQ8K],
        out: &[*mut f32],
        col: usize,
    ) {
        let deltamask = _mm_set_epi8(15, 14, 7, 6, 13, 12, 5, 4, 11, 10, 3, 2, 9, 8, 1, 0);
        let finalpermutemask = _mm256_set_epi32(7, 5, 3, 1, 6, 4, 2, 0);
        let m4b = _mm256_set1_epi8(0x0F);
        let mut acc_row = [_mm256_setzero_ps(); R];
        let mut acc_min = [_mm256_setzero_ps(); R];
        for b in 0..blocks {
            // SAFETY: within the blocks the caller vouches for.
            let (wb, ab): (&BlockQ4Kx8, [&BlockQ8K; R]) =
                unsafe { (&*w.add(b), std::array::from_fn(|r| &*a[r].add(b))) };
            // SAFETY: 16 bytes each: the 8 f16 scales and the 8 f16 mins.
            let (col_scale, col_dmin) = unsafe {
                (
                    _mm256_cvtph_ps(_mm_shuffle_epi8(_mm_loadu_si128(wb.d.as_ptr().cast()), deltamask)),
                    _mm256_cvtph_ps(_mm_loadu_si128(wb.dmin.as_ptr().cast())),
                )
            };
            let mut iacc_b = [_mm256_setzero_si256(); R];
            let mut iacc_min_b = [_mm256_setzero_si256(); R];
            // SAFETY: 32 bytes of bsums per row.
            let mut q8s: [__m256i; R] = std::array::from_fn(|r| unsafe {
                let sums = _mm256_loadu_si256(ab[r].bsums.as_ptr().cast());
                let s = _mm256_castsi128_si256(_mm_hadd_epi16(
                    _mm256_castsi256_si128(sums),
                    _mm256_extracti128_si256::<1>(sums),
                ));
                _mm256_permute2f128_si256::<0>(s, s)
            });
            for sb in 0..4 {
                // The 8 rows' nibbles of two sub-blocks, low nibbles (first sub-block)
                // and high nibbles (second), each as the gemv interleaves them for its
                // multiplies: `mixed[half][4 * i + 2 * j + k]`.
                // SAFETY: 256 bytes of quants per sub-block pair.
                let raw: [__m256i; 8] = std::array::from_fn(|j| unsafe {
                    _mm256_loadu_si256(wb.qs.as_ptr().add(sb * 256 + 32 * j).cast())
                });
                let halves = [
                    raw.map(|v| _mm256_and_si256(v, m4b)),
                    raw.map(|v| _mm256_and_si256(_mm256_srli_epi16::<4>(v), m4b)),
                ];
                let mixed = halves.map(|h| {
                    let mut m = [_mm256_setzero_si256(); 8];
                    for i in 0..4 {
                        let (v0123, v4567) = (h[2 * i], h[2 * i + 1]);
                        m[2 * i] = _mm256_blend_epi32::<170>(v0123, _mm256_shuffle_epi32::<177>(v4567));
                        m[2 * i + 1] = _mm256_blend_epi32::<170>(_mm256_shuffle_epi32::<177>(v0123), v4567);
                    }
                    m
                });
                let (scales_0, packed_0) = scales(&wb.scales[24 * sb..24 * sb + 12]);
                let (scales_1, packed_1) = scales(&wb.scales[12 + 24 * sb..24 * sb + 24]);
                let mins_01 = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(
                    _mm_shuffle_epi32::<78>(packed_0),
                    _mm_shuffle_epi32::<78>(packed_1),
                ));
                for r in 0..R {
                    let qs = &ab[r].qs[sb * 64..sb * 64 + 64];
                    let lhs = [
                        both_halves(&qs[..16]),
                        both_halves(&qs[16..32]),
                        both_halves(&qs[32..48]),
                        both_halves(&qs[48..]),
                    ];
                    let dot = |m: &[__m256i; 8], l0: __m256i, l1: __m256i, scales: __m256i| {
                        let mut acc = _mm256_setzero_si256();
                        acc = _mm256_add_epi16(acc, _mm256_maddubs_epi16(m[0], _mm256_shuffle_epi32::<0>(l0)));
                        acc = _mm256_add_epi16(acc, _mm256_maddubs_epi16(m[1], _mm256_shuffle_epi32::<85>(l0)));
                        acc = _mm256_add_epi16(acc, _mm256_maddubs_epi16(m[2], _mm256_shuffle_epi32::<170>(l0)));
                        acc = _mm256_add_epi16(acc, _mm256_maddubs_epi16(m[3], _mm256_shuffle_epi32::<255>(l0)));
                        acc = _mm256_add_epi16(acc, _mm256_maddubs_epi16(m[4], _mm256_shuffle_epi32::<0>(l1)));
                        acc = _mm256_add_epi16(acc, _mm256_maddubs_epi16(m[5], _mm256_shuffle_epi32::<85>(l1)));
                        acc = _mm256_add_epi16(acc, _mm256_maddubs_epi16(m[6], _mm256_shuffle_epi32::<170>(l1)));
                        acc = _mm256_add_epi16(acc, _mm256_maddubs_epi16(m[7], _mm256_shuffle_epi32::<255>(l1)));
                        _mm256_madd_epi16(acc, scales)
                    };
                    let iacc_0 = dot(&mixed[0], lhs[0], lhs[1], scales_0);
                    let iacc_1 = dot(&mixed[1], lhs[2], lhs[3], scales_1);
                    let iacc_sb = _mm256_add_epi32(iacc_0, iacc_1);
                    let iacc_min_sb = _mm256_madd_epi16(_mm256_shuffle_epi32::<0>(q8s[r]), mins_01);
                    q8s[r] = _mm256_bsrli_epi128::<4>(q8s[r]);
                    iacc_b[r] = _mm256_add_epi32(iacc_b[r], iacc_sb);
                    iacc_min_b[r] = _mm256_add_epi32(iacc_min_b[r], iacc_min_sb);
                }
            }
            for r in 0..R {
                let row_scale = _mm256_set1_ps(ab[r].d);
                acc_row[r] = _mm256_fmadd_ps(
                    _mm256_cvtepi32_ps(iacc_b[r]),
                    _mm256_mul_ps(col_scale, row_scale),
                    acc_row[r],
                );
                acc_min[r] = _mm256_fmadd_ps(
                    _mm256_cvtepi32_ps(iacc_min_b[r]),
                    _mm256_mul_ps(col_dmin, row_scale),
                    acc_min[r],
                );
            }
        }
        for r in 0..R {
            let sorted = _mm256_permutevar8x32_ps(acc_row[r], finalpermutemask);
            // SAFETY: 8 writable floats per row at `col`.
            unsafe { _mm256_storeu_ps(out[r].add(col), _mm256_sub_ps(sorted, acc_min[r])) };
        }
    }
}
