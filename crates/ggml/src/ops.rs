//! The ggml ops that mixture-of-experts layers, attention sinks and the other
//! architectures beyond llama need: routing (softmax, sigmoid, top-k), expert matmuls
//! (`mul_mat_id`), per-expert biases, and the shape ops around them.
//!
//! Soundness is the same as for the ops in `graph.rs`: an op only records a node in the
//! context's arena, and ggml checks shapes with `GGML_ASSERT` (an abort, never memory
//! corruption). Callers validate the shapes that come from files before building.

use llama_cpp_sys_2 as sys;

use crate::graph::{Context, Tensor};
use crate::DType;

impl Context {
    /// Expert matmul: `experts [k, n, n_expert]`, `b [k, n_b, n_tokens]` (`n_b` is 1 or
    /// the number of selected experts), `ids` i32 `[n_used, n_tokens]` naming the expert
    /// of each output row. Returns `[n, n_used, n_tokens]`: row `(e, t)` is
    /// `experts[ids[e, t]] · b[:, e % n_b, t]`.
    pub fn mul_mat_id<'t>(&'t self, experts: Tensor<'t>, b: Tensor<'t>, ids: Tensor<'t>) -> Tensor<'t> {
        // SAFETY: records a node over three valid tensors (see module docs).
        unsafe { self.wrap(sys::ggml_mul_mat_id(self.raw(), experts.raw(), b.raw(), ids.raw())) }
    }

    /// `a + b[:, ids]`: adds to each row `(e, t)` of `a [n, n_used, n_tokens]` the row of
    /// `b [n, n_expert]` that `ids [n_used, n_tokens]` names (per-expert biases).
    pub fn add_id<'t>(&'t self, a: Tensor<'t>, b: Tensor<'t>, ids: Tensor<'t>) -> Tensor<'t> {
        // SAFETY: records a node (see module docs).
        unsafe { self.wrap(sys::ggml_add_id(self.raw(), a.raw(), b.raw(), ids.raw())) }
    }

    /// Softmax over dim 0.
    pub fn soft_max<'t>(&'t self, a: Tensor<'t>) -> Tensor<'t> {
        // SAFETY: records a node (see module docs).
        unsafe { self.wrap(sys::ggml_soft_max(self.raw(), a.raw())) }
    }

    /// Logistic sigmoid element-wise.
    pub fn sigmoid<'t>(&'t self, a: Tensor<'t>) -> Tensor<'t> {
        // SAFETY: records a node (see module docs).
        unsafe { self.wrap(sys::ggml_sigmoid(self.raw(), a.raw())) }
    }

    /// `x [n, k, n_tokens]`, `weights [k, n_tokens]` → `[n, n_tokens]`: each token's `k`
    /// rows summed with its weights, in order, in f32 (ggml's `dsv4_hc_pre`).
    pub fn weighted_rows_sum<'t>(&'t self, x: Tensor<'t>, weights: Tensor<'t>) -> Tensor<'t> {
        // SAFETY: records a node (see module docs).
        unsafe { self.wrap(sys::ggml_dsv4_hc_pre(self.raw(), x.raw(), weights.raw())) }
    }

    /// Square root element-wise.
    pub fn sqrt<'t>(&'t self, a: Tensor<'t>) -> Tensor<'t> {
        // SAFETY: records a node (see module docs).
        unsafe { self.wrap(sys::ggml_sqrt(self.raw(), a.raw())) }
    }

    /// DeepSeek V4's clamped SwiGLU on separate gate and up halves (ggml's
    /// `swiglu_clamp`): `silu(min(gate, limit)) · clamp(up, -limit, limit)`.
    pub fn swiglu_clamp<'t>(&'t self, gate: Tensor<'t>, up: Tensor<'t>, limit: f32) -> Tensor<'t> {
        // SAFETY: records a node (see module docs).
        unsafe { self.wrap(sys::ggml_swiglu_clamp(self.raw(), gate.raw(), up.raw(), limit)) }
    }

    /// `a * s + b` element-wise.
    pub fn scale_bias<'t>(&'t self, a: Tensor<'t>, s: f32, b: f32) -> Tensor<'t> {
        // SAFETY: records a node (see module docs).
        unsafe { self.wrap(sys::ggml_scale_bias(self.raw(), a.raw(), s, b)) }
    }

    /// A 1-d view of `ne0` elements of `a` from byte `offset`.
    pub fn view_1d<'t>(&'t self, a: Tensor<'t>, ne0: i64, offset: usize) -> Tensor<'t> {
        // SAFETY: records a view node; ggml asserts the view stays inside `a`.
        unsafe { self.wrap(sys::ggml_view_1d(self.raw(), a.raw(), ne0, offset)) }
    }

    /// Hyper-connections' stream mixing matrix (ggml's `dsv4_hc_comb`, 4 streams): from
    /// `mixes [24, n_tokens]`, `scale [3]` and `base [24]` (f32), per token the
    /// `[dst, src]` matrix `mixes[8 + dst + 4 src] · scale[2] + base[8 + dst + 4 src]`,
    /// softmaxed over `dst`, `eps` added, then normalised over `src` and `n_iter - 1`
    /// more times over `dst` and `src` (Sinkhorn): `[4, 4, n_tokens]`.
    pub fn hc_comb<'t>(
        &'t self,
        mixes: Tensor<'t>,
        scale: Tensor<'t>,
        base: Tensor<'t>,
        eps: f32,
        n_iter: i32,
    ) -> Tensor<'t> {
        // SAFETY: records a node (see module docs); ggml asserts the shapes, types and
        // `n_iter > 0` (callers read them from checked hyper-parameters).
        unsafe {
            self.wrap(sys::ggml_dsv4_hc_comb(
                self.raw(),
                mixes.raw(),
                scale.raw(),
                base.raw(),
                eps,
                n_iter,
            ))
        }
    }

    /// Hyper-connections' write back (ggml's `dsv4_hc_post`): `x [n, n_tokens]`,
    /// `residual [n, hc, n_tokens]`, `post [hc, n_tokens]`, `comb [hc, hc, n_tokens]` →
    /// `[n, hc, n_tokens]` with `out[i, d, t] = x[i, t] post[d, t] + Σ_s residual[i, s, t]
    /// comb[d, s, t]`.
    pub fn hc_post<'t>(
        &'t self,
        x: Tensor<'t>,
        residual: Tensor<'t>,
        post: Tensor<'t>,
        comb: Tensor<'t>,
    ) -> Tensor<'t> {
        // SAFETY: records a node (see module docs); ggml asserts the shapes and types.
        unsafe {
            self.wrap(sys::ggml_dsv4_hc_post(
                self.raw(),
                x.raw(),
                residual.raw(),
                post.raw(),
                comb.raw(),
            ))
        }
    }

    /// Sums over dim 0: `[n, ...]` to `[1, ...]`.
    pub fn sum_rows<'t>(&'t self, a: Tensor<'t>) -> Tensor<'t> {
        // SAFETY: records a node (see module docs).
        unsafe { self.wrap(sys::ggml_sum_rows(self.raw(), a.raw())) }
    }

    /// Element-wise `a / b`, `b` broadcast over `a`.
    pub fn div<'t>(&'t self, a: Tensor<'t>, b: Tensor<'t>) -> Tensor<'t> {
        // SAFETY: records a node (see module docs).
        unsafe { self.wrap(sys::ggml_div(self.raw(), a.raw(), b.raw())) }
    }

    /// Each element clamped to `[min, max]`.
    pub fn clamp<'t>(&'t self, a: Tensor<'t>, min: f32, max: f32) -> Tensor<'t> {
        // SAFETY: records a node (see module docs).
        unsafe { self.wrap(sys::ggml_clamp(self.raw(), a.raw(), min, max)) }
    }

    /// The largest of each `k` consecutive values along dim 0 (a 1 × `k` max pool with
    /// stride `k`, as ggml's `pool_2d` computes it; f32 out).
    pub fn max_pool_rows<'t>(&'t self, a: Tensor<'t>, k: usize) -> Tensor<'t> {
        let k = k as i32;
        // SAFETY: records a node (see module docs); ggml sizes the output from `a`.
        unsafe {
            self.wrap(sys::ggml_pool_2d(
                self.raw(),
                a.raw(),
                sys::GGML_OP_POOL_MAX,
                k,
                1,
                k,
                1,
                0.0,
                0.0,
            ))
        }
    }

    /// f32 `[start, start + step, …]` below `stop`.
    pub fn arange(&self, start: f32, stop: f32, step: f32) -> Tensor<'_> {
        // SAFETY: records a node (see module docs); ggml asserts stop > start.
        unsafe { self.wrap(sys::ggml_arange(self.raw(), start, stop, step)) }
    }

    /// Indices (i32) of the `k` largest values of each row (dim 0), largest first.
    pub fn argsort_top_k<'t>(&'t self, a: Tensor<'t>, k: usize) -> Tensor<'t> {
        // SAFETY: records a node (see module docs); ggml asserts k <= ne[0].
        unsafe { self.wrap(sys::ggml_argsort_top_k(self.raw(), a.raw(), k as i32)) }
    }

    /// Indices (i32) of the `k` largest values of each row (dim 0), in no particular
    /// order: ggml's `top_k` (a partial sort; llama.cpp's lightning indexer selects with
    /// it, so ties fall as they fall there).
    pub fn top_k<'t>(&'t self, a: Tensor<'t>, k: usize) -> Tensor<'t> {
        // SAFETY: records a node (see module docs); ggml asserts k <= ne[0].
        unsafe { self.wrap(sys::ggml_top_k(self.raw(), a.raw(), k as i32)) }
    }

    /// DeepSeek's lightning indexer: for queries `q` `[d, n_head, n_rows]` (f32), one
    /// key head `k` `[d, 1, n_kv]` (the cache's type), head weights `weights`
    /// `[n_head, n_rows]` (f32, pre-scaled) and an f16 `mask` `[n_kv, n_rows]`, the
    /// scores `[n_kv, n_rows]`: `Σ_h relu(q_h · k) × w_h + mask`.
    pub fn lightning_indexer<'t>(
        &'t self,
        q: Tensor<'t>,
        k: Tensor<'t>,
        weights: Tensor<'t>,
        mask: Tensor<'t>,
    ) -> Tensor<'t> {
        // SAFETY: records a node (see module docs); ggml asserts the shapes and types.
        unsafe {
            self.wrap(sys::ggml_lightning_indexer(
                self.raw(),
                q.raw(),
                k.raw(),
                weights.raw(),
                mask.raw(),
            ))
        }
    }

    /// Layer normalisation over dim 0 (mean removed, then scaled to unit variance; no
    /// weight or bias).
    pub fn layer_norm<'t>(&'t self, a: Tensor<'t>, eps: f32) -> Tensor<'t> {
        // SAFETY: records a node (see module docs).
        unsafe { self.wrap(sys::ggml_norm(self.raw(), a.raw(), eps)) }
    }

    /// A tensor of `a`'s shape filled with `value`.
    pub fn fill<'t>(&'t self, a: Tensor<'t>, value: f32) -> Tensor<'t> {
        // SAFETY: records a node (see module docs).
        unsafe { self.wrap(sys::ggml_fill(self.raw(), a.raw(), value)) }
    }

    /// gpt-oss's gated activation on separate gate and up halves:
    /// `min(g, limit) · sigmoid(alpha · min(g, limit)) · (clamp(u, -limit, limit) + 1)`.
    pub fn swiglu_oai<'t>(&'t self, gate: Tensor<'t>, up: Tensor<'t>, alpha: f32, limit: f32) -> Tensor<'t> {
        // SAFETY: records a node (see module docs).
        unsafe { self.wrap(sys::ggml_swiglu_oai(self.raw(), gate.raw(), up.raw(), alpha, limit)) }
    }

    /// Same data seen with a new 4-d shape (the source must be contiguous).
    pub fn reshape_4d<'t>(&'t self, a: Tensor<'t>, ne: [i64; 4]) -> Tensor<'t> {
        // SAFETY: records a node (see module docs).
        unsafe { self.wrap(sys::ggml_reshape_4d(self.raw(), a.raw(), ne[0], ne[1], ne[2], ne[3])) }
    }

    /// A strided 2-d view into `a` (`nb1` and `offset` in bytes).
    pub fn view_2d<'t>(&'t self, a: Tensor<'t>, ne0: i64, ne1: i64, nb1: usize, offset: usize) -> Tensor<'t> {
        // SAFETY: records a view node; ggml asserts the view stays inside `a`.
        unsafe { self.wrap(sys::ggml_view_2d(self.raw(), a.raw(), ne0, ne1, nb1, offset)) }
    }

    /// `a` repeated to the shape `ne` (each dimension a multiple of `a`'s).
    pub fn repeat_4d<'t>(&'t self, a: Tensor<'t>, ne: [i64; 4]) -> Tensor<'t> {
        // SAFETY: records a node (see module docs).
        unsafe { self.wrap(sys::ggml_repeat_4d(self.raw(), a.raw(), ne[0], ne[1], ne[2], ne[3])) }
    }

    /// GELU (tanh approximation) element-wise.
    pub fn gelu<'t>(&'t self, a: Tensor<'t>) -> Tensor<'t> {
        // SAFETY: records a node (see module docs).
        unsafe { self.wrap(sys::ggml_gelu(self.raw(), a.raw())) }
    }

    /// SiLU element-wise.
    pub fn silu<'t>(&'t self, a: Tensor<'t>) -> Tensor<'t> {
        // SAFETY: records a node (see module docs).
        unsafe { self.wrap(sys::ggml_silu(self.raw(), a.raw())) }
    }

    /// `silu(a[:n/2]) * a[n/2:]` over dim 0 (SwiGLU with gate and up fused in one row).
    pub fn swiglu<'t>(&'t self, a: Tensor<'t>) -> Tensor<'t> {
        // SAFETY: records a node (see module docs).
        unsafe { self.wrap(sys::ggml_swiglu(self.raw(), a.raw())) }
    }

    /// `max(a, 0)` element-wise.
    pub fn relu<'t>(&'t self, a: Tensor<'t>) -> Tensor<'t> {
        // SAFETY: records a node (see module docs).
        unsafe { self.wrap(sys::ggml_relu(self.raw(), a.raw())) }
    }

    /// `a²` element-wise.
    pub fn sqr<'t>(&'t self, a: Tensor<'t>) -> Tensor<'t> {
        // SAFETY: records a node (see module docs).
        unsafe { self.wrap(sys::ggml_sqr(self.raw(), a.raw())) }
    }

    /// `log(1 + exp(a))` element-wise.
    pub fn softplus<'t>(&'t self, a: Tensor<'t>) -> Tensor<'t> {
        // SAFETY: records a node (see module docs).
        unsafe { self.wrap(sys::ggml_softplus(self.raw(), a.raw())) }
    }

    /// A strided 4-d view into `a` (`nb` and `offset` in bytes).
    pub fn view_4d<'t>(&'t self, a: Tensor<'t>, ne: [i64; 4], nb: [usize; 3], offset: usize) -> Tensor<'t> {
        // SAFETY: records a view node; ggml asserts the view stays inside `a`.
        unsafe {
            self.wrap(sys::ggml_view_4d(
                self.raw(),
                a.raw(),
                ne[0],
                ne[1],
                ne[2],
                ne[3],
                nb[0],
                nb[1],
                nb[2],
                offset,
            ))
        }
    }

    /// Multi-section RoPE (Qwen's M-RoPE; `mode` says which layout, e.g. 40 for the
    /// interleaved one) of `a` `[head_dim, n_head, n_tokens]` at i32 `positions`
    /// `[4 × n_tokens]` (section-major: every token's first coordinate, then every
    /// token's second, ...); `sections` dimensions rotate by each coordinate.
    pub fn rope_multi<'t>(
        &'t self,
        a: Tensor<'t>,
        positions: Tensor<'t>,
        sections: [i32; 4],
        rope: &crate::RopeParams,
    ) -> Tensor<'t> {
        let mut sections = sections;
        // SAFETY: records a node; ggml reads the four sections and asserts that the
        // positions hold four per token.
        unsafe {
            self.wrap(sys::ggml_rope_multi(
                self.raw(),
                a.raw(),
                positions.raw(),
                std::ptr::null_mut(),
                rope.n_dims,
                sections.as_mut_ptr(),
                rope.mode,
                rope.n_ctx_orig,
                rope.freq_base,
                rope.freq_scale,
                rope.ext_factor,
                rope.attn_factor,
                rope.beta_fast,
                rope.beta_slow,
            ))
        }
    }

    /// The depthwise causal convolution of state-space layers: `sx`
    /// `[d_conv - 1 + n_tokens, channels, n_seqs]` (each channel's previous inputs, then
    /// the batch's) with the kernel `c` `[d_conv, channels]`; returns
    /// `[channels, n_tokens, n_seqs]`.
    pub fn ssm_conv<'t>(&'t self, sx: Tensor<'t>, c: Tensor<'t>) -> Tensor<'t> {
        // SAFETY: records a node (see module docs); ggml asserts the shapes.
        unsafe { self.wrap(sys::ggml_ssm_conv(self.raw(), sx.raw(), c.raw())) }
    }

    /// The gated delta rule over a batch, token by token (ggml's fused kernel):
    /// `q`, `k` `[S, H_k, n_tokens, n_seqs]`, `v` `[S, H, n_tokens, n_seqs]`, the decay
    /// `g` `[1, H, n_tokens, n_seqs]` (one per head, gated DeltaNet) or `[S, H, n_tokens,
    /// n_seqs]` (one per key dimension, Kimi Delta Attention), `beta` `[1, H, n_tokens,
    /// n_seqs]`, the initial state `[S, S, H, n_seqs]`.
    /// Returns one tensor holding the outputs `[S, H, n_tokens, n_seqs]` followed by
    /// `keep` states, the newest first (slot `j` is the state `j` tokens before the
    /// end; only the first `min(n_tokens, keep)` are written).
    #[allow(clippy::too_many_arguments)] // the op's own six inputs and its count
    pub fn gated_delta_net<'t>(
        &'t self,
        q: Tensor<'t>,
        k: Tensor<'t>,
        v: Tensor<'t>,
        g: Tensor<'t>,
        beta: Tensor<'t>,
        state: Tensor<'t>,
        keep: usize,
    ) -> Tensor<'t> {
        // SAFETY: records a node (see module docs); ggml asserts the shapes and keep >= 1.
        unsafe {
            self.wrap(sys::ggml_gated_delta_net(
                self.raw(),
                q.raw(),
                k.raw(),
                v.raw(),
                g.raw(),
                beta.raw(),
                state.raw(),
                keep as i64,
            ))
        }
    }

    /// Mamba2's selective scan over a batch, token by token (ggml's kernel, a sequential
    /// loop over the tokens of each head): the states `s` `[d_state, head_dim, n_head,
    /// rows]`, of which row `ids[i]` (i32 `[n_seqs]`) is sequence `i`'s initial state;
    /// `x` `[head_dim, n_head, n_tokens, n_seqs]`, `dt` `[n_head, n_tokens, n_seqs]`
    /// (contiguous; softplus is applied inside), the decay `a` `[1, n_head]`, `b` and `c`
    /// `[d_state, n_group, n_tokens, n_seqs]`. Returns one tensor holding the outputs
    /// `[head_dim, n_head, n_tokens, n_seqs]` followed by `keep` states per sequence, the
    /// newest first (slot `j` is the state `j` tokens before the end; only the first
    /// `min(n_tokens, keep)` are written).
    #[allow(clippy::too_many_arguments)] // the op's own seven inputs and its count
    pub fn ssm_scan<'t>(
        &'t self,
        s: Tensor<'t>,
        x: Tensor<'t>,
        dt: Tensor<'t>,
        a: Tensor<'t>,
        b: Tensor<'t>,
        c: Tensor<'t>,
        ids: Tensor<'t>,
        keep: usize,
    ) -> Tensor<'t> {
        // SAFETY: records a node (see module docs); ggml asserts the shapes and keep >= 1.
        unsafe {
            self.wrap(sys::ggml_ssm_scan(
                self.raw(),
                s.raw(),
                x.raw(),
                dt.raw(),
                a.raw(),
                b.raw(),
                c.raw(),
                ids.raw(),
                keep as i64,
            ))
        }
    }

    /// `a` converted to `dtype` (a new contiguous tensor of the same shape).
    pub fn cast<'t>(&'t self, a: Tensor<'t>, dtype: DType) -> Tensor<'t> {
        // SAFETY: records a node (see module docs).
        unsafe { self.wrap(sys::ggml_cast(self.raw(), a.raw(), dtype.0)) }
    }

    /// `rot × b` where `rot` (`[n, n]`, f32) is a Walsh-Hadamard matrix, marked so that
    /// the CPU backend computes it as a fast transform (llama.cpp's
    /// `llama_mul_mat_hadamard`): `b` of any shape, `n` values at a time.
    pub fn mul_mat_hadamard<'t>(&'t self, rot: Tensor<'t>, b: Tensor<'t>) -> Tensor<'t> {
        let n = rot.ne()[0];
        let rows = if b.is_contiguous() {
            self.reshape_2d(b, n, b.n_elements() / n)
        } else {
            self.cont_2d(b, n, b.n_elements() / n)
        };
        // SAFETY: records a node over valid tensors and sets an op parameter of the
        // matmul node (ggml asserts the op).
        let product = unsafe {
            let out = sys::ggml_mul_mat(self.raw(), rot.raw(), rows.raw());
            sys::ggml_mul_mat_set_hint(out, sys::GGML_HINT_SRC0_IS_HADAMARD);
            self.wrap(out)
        };
        self.reshape_4d(product, b.ne())
    }

    /// A contiguous copy of `a` with the 2-d shape `[ne0, ne1]`.
    pub fn cont_2d<'t>(&'t self, a: Tensor<'t>, ne0: i64, ne1: i64) -> Tensor<'t> {
        // SAFETY: records a node (see module docs).
        unsafe { self.wrap(sys::ggml_cont_2d(self.raw(), a.raw(), ne0, ne1)) }
    }

    /// A contiguous copy of `a` with the 3-d shape `ne`.
    pub fn cont_3d<'t>(&'t self, a: Tensor<'t>, ne: [i64; 3]) -> Tensor<'t> {
        // SAFETY: records a node (see module docs).
        unsafe { self.wrap(sys::ggml_cont_3d(self.raw(), a.raw(), ne[0], ne[1], ne[2])) }
    }
}

impl<'a> Tensor<'a> {
    /// Makes this RoPE node (from [`Context::rope`] or [`Context::rope_back`]) rotate the
    /// `n_dims` dimensions from `offset` instead of the first ones (ggml's
    /// `rope_set_offset`; DeepSeek V4 rotates the tail of each head).
    pub fn rope_offset(self, offset: usize) -> Self {
        assert!(offset.is_multiple_of(2), "a RoPE offset must be even, not {offset}");
        // SAFETY: sets an op parameter of a valid node; ggml asserts it is a RoPE node of
        // a mode that takes an offset (the callers' normal mode does).
        unsafe { sys::ggml_rope_set_offset(self.raw(), offset as i32) };
        self
    }

    /// Asks backends to accumulate this matmul in f32 (llama.cpp does for some layers of
    /// some models; the CPU backend always does, so it changes nothing there).
    pub fn prec_f32(self) -> Self {
        // SAFETY: sets an op parameter of a valid node.
        unsafe { sys::ggml_prec_set_acc(self.raw(), sys::GGML_PREC_F32) };
        self
    }

    /// Asks backends to multiply this matmul's input (its `b`, ggml's src 1) as f32
    /// rather than convert it to f16 first (llama.cpp does where activations can exceed
    /// f16's range); the CPU backend converts as its kernels need, so nothing changes
    /// there. Only `mul_mat` and `mul_mat_id` nodes take it.
    pub fn prec_f32_input(self) -> Self {
        // SAFETY: sets an op parameter of a valid node; source index 1 is below
        // GGML_MAX_SRC, as ggml asserts, and any other op is left as it is.
        let set = unsafe { sys::ggml_prec_set_src(self.raw(), sys::GGML_PREC_F32, 1) };
        debug_assert!(set, "an f32 input asked of a node that is not a matmul");
        self
    }

    /// Tells backends that each row of this `flash_attn` node's mask has at most
    /// `n_kv_max` finite entries (a sparse set of keys, DeepSeek's sparse attention), as
    /// llama.cpp does; the CPU backend reads every entry either way.
    pub fn with_n_kv_max(self, n_kv_max: usize) -> Self {
        // SAFETY: sets an op parameter of a valid flash-attention node; ggml asserts the
        // node's op and that the count is not negative.
        unsafe { sys::ggml_flash_attn_ext_set_n_kv_max(self.raw(), n_kv_max.min(i32::MAX as usize) as i32) };
        self
    }

    /// Adds per-head attention sinks `[n_head]` (f32 logits that join every softmax
    /// denominator, gpt-oss) to this `flash_attn` node.
    pub fn with_sinks(self, sinks: Tensor<'a>) -> Self {
        // SAFETY: sets the sinks source of a valid flash-attention node; ggml asserts the
        // node's op and the sinks' type.
        unsafe { sys::ggml_flash_attn_ext_add_sinks(self.raw(), sinks.raw()) };
        self
    }
}
