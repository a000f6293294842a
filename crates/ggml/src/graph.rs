//! Building ggml compute graphs from safe code.
//!
//! A [`Context`] owns one `ggml_context` created with `no_alloc`: it holds tensor and
//! graph metadata only, never tensor data (that lives in backend buffers). Tensors are
//! `Copy` handles whose lifetime is tied to the context that made them, so a handle
//! cannot outlive its metadata.
//!
//! Why the op methods are sound: a ggml op only records a node (shape, sources, op
//! parameters) in the context's arena. ggml checks shapes with `GGML_ASSERT`, which
//! aborts rather than corrupting memory; callers validate shapes that come from files
//! before building graphs, so those asserts are invariants, not input checks.

use std::marker::PhantomData;
use std::ptr::NonNull;

use llama_cpp_sys_2 as sys;

use crate::{DType, GgmlError};

/// A handle to a tensor's metadata in some ggml context that lives for `'a`.
#[derive(Clone, Copy, Debug)]
pub struct Tensor<'a> {
    ptr: NonNull<sys::ggml_tensor>,
    _ctx: PhantomData<&'a ()>,
}

impl<'a> Tensor<'a> {
    /// # Safety
    /// `ptr` must point to a tensor of a context that lives for `'a`.
    pub(crate) unsafe fn from_raw(ptr: *mut sys::ggml_tensor) -> Tensor<'a> {
        Tensor {
            ptr: NonNull::new(ptr).expect("ggml returned a null tensor (context out of memory)"),
            _ctx: PhantomData,
        }
    }

    pub(crate) fn raw(self) -> *mut sys::ggml_tensor {
        self.ptr.as_ptr()
    }

    fn meta(&self) -> &sys::ggml_tensor {
        // SAFETY: the pointer is valid for 'a (constructor contract) and ggml never
        // mutates a tensor's shape after creation.
        unsafe { self.ptr.as_ref() }
    }

    /// Elements per dimension (`ne[0]` is the innermost).
    pub fn ne(&self) -> [i64; 4] {
        self.meta().ne
    }

    /// Bytes per step in each dimension.
    pub fn nb(&self) -> [usize; 4] {
        self.meta().nb
    }

    /// Total number of elements.
    pub fn n_elements(&self) -> i64 {
        self.ne().iter().product()
    }

    /// Size of the tensor's data in bytes.
    pub fn n_bytes(&self) -> usize {
        // SAFETY: valid tensor (see `meta`).
        unsafe { sys::ggml_nbytes(self.raw()) }
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        DType(self.meta().type_)
    }

    /// Whether the elements lie in memory in order, without gaps (not a strided view).
    pub fn is_contiguous(&self) -> bool {
        // SAFETY: only reads the tensor's metadata.
        unsafe { sys::ggml_is_contiguous(self.raw()) }
    }

    /// Gives the tensor a name (shown in graph dumps and ggml errors).
    pub fn named(self, name: &str) -> Self {
        let name = std::ffi::CString::new(name).unwrap_or_default();
        // SAFETY: ggml copies at most GGML_MAX_NAME bytes out of the C string.
        unsafe { sys::ggml_set_name(self.raw(), name.as_ptr()) };
        self
    }

    /// Marks the tensor as a graph input, so the allocator gives it its own memory.
    pub fn set_input(self) -> Self {
        // SAFETY: sets a flag on a valid tensor.
        unsafe { sys::ggml_set_input(self.raw()) };
        self
    }

    /// Marks the tensor as a graph output, so the allocator never reuses its memory.
    pub fn set_output(self) -> Self {
        // SAFETY: sets a flag on a valid tensor.
        unsafe { sys::ggml_set_output(self.raw()) };
        self
    }

    /// Whether the tensor has memory (a graph input that no node reads gets none).
    pub fn has_data(&self) -> bool {
        !self.meta().data.is_null()
    }

    /// Copies `data` into the tensor's backend memory.
    pub fn write<T: Copy>(&self, data: &[T]) -> Result<(), GgmlError> {
        let bytes = std::mem::size_of_val(data);
        if bytes != self.n_bytes() || self.meta().data.is_null() {
            return Err(GgmlError::Io {
                tensor: self.name(),
                bytes,
                expected: self.n_bytes(),
            });
        }
        // SAFETY: the tensor is allocated (data non-null) and the sizes match exactly.
        unsafe { sys::ggml_backend_tensor_set(self.raw(), data.as_ptr().cast(), 0, bytes) };
        Ok(())
    }

    /// Copies raw bytes (the tensor's on-disk encoding) into its backend memory; a
    /// repacking buffer converts them to its own layout on the way in.
    pub fn write_bytes(&self, bytes: &[u8]) -> Result<(), GgmlError> {
        self.write(bytes)
    }

    /// Copies `out.len()` bytes of the tensor's backend memory from byte `offset` into
    /// `out` (a part of a cache, e.g. one sequence's row).
    pub fn read_bytes_at(&self, offset: usize, out: &mut [u8]) -> Result<(), GgmlError> {
        self.check_range(offset, out.len())?;
        // SAFETY: the tensor is allocated and `offset..offset + out.len()` lies inside it.
        unsafe { sys::ggml_backend_tensor_get(self.raw(), out.as_mut_ptr().cast(), offset, out.len()) };
        Ok(())
    }

    /// Copies `data` into the tensor's backend memory from byte `offset` on.
    pub fn write_bytes_at(&self, offset: usize, data: &[u8]) -> Result<(), GgmlError> {
        self.check_range(offset, data.len())?;
        // SAFETY: the tensor is allocated and `offset..offset + data.len()` lies inside it.
        unsafe { sys::ggml_backend_tensor_set(self.raw(), data.as_ptr().cast(), offset, data.len()) };
        Ok(())
    }

    /// Refuses a byte range outside the tensor, or a tensor without memory.
    fn check_range(&self, offset: usize, len: usize) -> Result<(), GgmlError> {
        let inside = offset.checked_add(len).is_some_and(|end| end <= self.n_bytes());
        if !inside || self.meta().data.is_null() {
            return Err(GgmlError::Io {
                tensor: self.name(),
                bytes: len,
                expected: self.n_bytes().saturating_sub(offset),
            });
        }
        Ok(())
    }

    /// Copies the tensor's backend memory into `out`.
    pub fn read<T: Copy>(&self, out: &mut [T]) -> Result<(), GgmlError> {
        let bytes = std::mem::size_of_val(out);
        if bytes != self.n_bytes() || self.meta().data.is_null() {
            return Err(GgmlError::Io {
                tensor: self.name(),
                bytes,
                expected: self.n_bytes(),
            });
        }
        // SAFETY: the tensor is allocated and `out` has exactly its size.
        unsafe { sys::ggml_backend_tensor_get(self.raw(), out.as_mut_ptr().cast(), 0, bytes) };
        Ok(())
    }

    /// The tensor's name.
    pub fn name(&self) -> String {
        let name = &self.meta().name;
        let bytes: Vec<u8> = name.iter().take_while(|&&c| c != 0).map(|&c| c as u8).collect();
        String::from_utf8_lossy(&bytes).into_owned()
    }
}

/// A ggml context holding tensor and graph metadata (no tensor data).
pub struct Context {
    ptr: NonNull<sys::ggml_context>,
    /// Unique per context, so a [`TensorId`] can be checked against its owner.
    id: u64,
    /// Node capacity of the one graph this context may hold (0: none).
    graph_size: usize,
    /// Tensors it has room for.
    n_tensors: usize,
    /// Host ops whose nodes point at them (see [`Context::host_op`]): freed with the
    /// context (or at a reset), after its nodes.
    kept: std::cell::RefCell<Vec<std::sync::Arc<dyn std::any::Any + Send + Sync>>>,
}

/// A lifetime-free name for a tensor of a long-lived context (model weights), turned
/// back into a [`Tensor`] in O(1) by [`Context::tensor`]. Looking weights up by name
/// every step costs a string scan per tensor; ids avoid that.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TensorId {
    ptr: NonNull<sys::ggml_tensor>,
    ctx: u64,
}

// SAFETY: an id is inert data; it is only dereferenced through the owning Context,
// after checking that it belongs to it.
unsafe impl Send for TensorId {}
// SAFETY: as above.
unsafe impl Sync for TensorId {}

/// A lifetime-free name for a graph of a context, turned back into a [`Graph`] by
/// [`Context::graph`] (a step graph kept to be computed again).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GraphId {
    ptr: NonNull<sys::ggml_cgraph>,
    ctx: u64,
}

// SAFETY: inert data, dereferenced only through the owning Context after a check.
unsafe impl Send for GraphId {}
// SAFETY: as above.
unsafe impl Sync for GraphId {}

static NEXT_CONTEXT_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

// SAFETY: a ggml_context is plain memory with no thread affinity; &mut/& discipline
// of the Rust wrapper prevents concurrent mutation.
unsafe impl Send for Context {}

impl Context {
    /// A metadata-only context with room for `n_tensors` tensors and, when `graph_size`
    /// is not 0, one graph of up to `graph_size` nodes.
    pub fn new(n_tensors: usize, graph_size: usize) -> Context {
        // SAFETY: pure size computations.
        let mut mem_size = unsafe { sys::ggml_tensor_overhead() } * n_tensors;
        if graph_size > 0 {
            // SAFETY: pure size computation.
            mem_size += unsafe { sys::ggml_graph_overhead_custom(graph_size, false) };
        }
        let params = sys::ggml_init_params {
            mem_size,
            mem_buffer: std::ptr::null_mut(),
            no_alloc: true,
        };
        // SAFETY: ggml allocates its own arena of `mem_size` bytes.
        let ptr = unsafe { sys::ggml_init(params) };
        Context {
            ptr: NonNull::new(ptr).expect("ggml_init failed to allocate its arena"),
            id: NEXT_CONTEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            graph_size,
            n_tensors,
            kept: std::cell::RefCell::new(Vec::new()),
        }
    }

    /// Whether a context made by `Context::new(n_tensors, graph_size)` fits in this one
    /// (after [`Context::reset`]).
    pub fn fits(&self, n_tensors: usize, graph_size: usize) -> bool {
        n_tensors <= self.n_tensors && graph_size <= self.graph_size && (graph_size == 0) == (self.graph_size == 0)
    }

    /// Forgets every tensor and graph of the context, keeping its memory: the next ones
    /// are laid out at the same addresses when made in the same order. A step graph
    /// rebuilt this way is the same graph to a backend that caches graphs by their
    /// tensors' addresses (CUDA graphs in ggml-cuda), which then replays it instead of
    /// recording it again every step.
    /// Ids of its tensors and graphs made before are no longer valid (using one panics).
    pub fn reset(&mut self) {
        // SAFETY: `&mut self`: no tensor or graph of this context is borrowed.
        unsafe { sys::ggml_reset(self.raw()) }
        self.id = NEXT_CONTEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        // No node points at the host ops any more.
        self.kept.get_mut().clear();
    }

    /// The id of `graph`, one of this context's.
    pub fn graph_id(&self, graph: &Graph<'_>) -> GraphId {
        GraphId {
            ptr: graph.ptr,
            ctx: self.id,
        }
    }

    /// The graph named by `id`; panics if `id` comes from another context (or from
    /// this one before a reset).
    pub fn graph(&self, id: GraphId) -> Graph<'_> {
        assert_eq!(id.ctx, self.id, "graph id used with a context that did not create it");
        Graph {
            ptr: id.ptr,
            _ctx: PhantomData,
        }
    }

    /// Keeps `op` alive as long as this context.
    pub(crate) fn keep(&self, op: std::sync::Arc<dyn std::any::Any + Send + Sync>) {
        self.kept.borrow_mut().push(op);
    }

    pub(crate) fn raw(&self) -> *mut sys::ggml_context {
        self.ptr.as_ptr()
    }

    /// # Safety
    /// `ptr` must be a tensor returned by a ggml op on this context (or a tensor that
    /// outlives it); ggml ops never return dangling pointers.
    pub(crate) unsafe fn wrap(&self, ptr: *mut sys::ggml_tensor) -> Tensor<'_> {
        Tensor::from_raw(ptr)
    }

    /// A new tensor with up to four dimensions (`ne[0]` first).
    pub fn new_tensor(&self, dtype: DType, ne: &[i64]) -> Tensor<'_> {
        assert!((1..=4).contains(&ne.len()), "tensors have 1 to 4 dimensions");
        // SAFETY: `ne` has ne.len() entries; the context has room (sized at creation).
        unsafe { self.wrap(sys::ggml_new_tensor(self.raw(), dtype.0, ne.len() as i32, ne.as_ptr())) }
    }

    /// The tensor named `name` in this context, if any.
    pub fn get_tensor(&self, name: &str) -> Option<Tensor<'_>> {
        let name = std::ffi::CString::new(name).ok()?;
        // SAFETY: valid context and C string; null when absent.
        let ptr = unsafe { sys::ggml_get_tensor(self.raw(), name.as_ptr()) };
        // SAFETY: non-null tensors of this context live as long as it.
        (!ptr.is_null()).then(|| unsafe { self.wrap(ptr) })
    }

    /// The id of `tensor`, which must belong to this context.
    pub fn id_of(&self, tensor: Tensor<'_>) -> TensorId {
        TensorId {
            ptr: tensor.ptr,
            ctx: self.id,
        }
    }

    /// Whether `id` names a tensor of this context.
    pub fn owns(&self, id: TensorId) -> bool {
        id.ctx == self.id
    }

    /// The tensor named by `id`; panics if `id` comes from another context (or from
    /// this one before a reset).
    pub fn tensor(&self, id: TensorId) -> Tensor<'_> {
        assert_eq!(id.ctx, self.id, "tensor id used with a context that did not create it");
        // SAFETY: the id was made by this context (checked), whose tensors live as long as it.
        unsafe { self.wrap(id.ptr.as_ptr()) }
    }

    /// Number of tensors (and views) created in this context so far.
    pub fn n_tensors(&self) -> usize {
        let mut n = 0;
        // SAFETY: walks the context's own tensor list; each pointer is valid while it lives.
        unsafe {
            let mut t = sys::ggml_get_first_tensor(self.raw());
            while !t.is_null() {
                n += 1;
                t = sys::ggml_get_next_tensor(self.raw(), t);
            }
        }
        n
    }

    /// A new, empty graph in this context; add nodes with [`Graph::expand`].
    pub fn new_graph(&self) -> Graph<'_> {
        assert!(self.graph_size > 0, "this context was created without room for a graph");
        // SAFETY: the context was created with room for one graph of `graph_size` nodes.
        let graph = unsafe { sys::ggml_new_graph_custom(self.raw(), self.graph_size, false) };
        Graph {
            ptr: NonNull::new(graph).expect("graph allocation failed"),
            _ctx: PhantomData,
        }
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: we own the context; tensors borrowing it cannot outlive `self`.
        unsafe { sys::ggml_free(self.raw()) }
    }
}

/// A computation graph whose nodes live in a [`Context`].
pub struct Graph<'a> {
    ptr: NonNull<sys::ggml_cgraph>,
    _ctx: PhantomData<&'a ()>,
}

impl Graph<'_> {
    pub(crate) fn raw(&self) -> *mut sys::ggml_cgraph {
        self.ptr.as_ptr()
    }

    /// Adds `tensor` and everything it depends on, in dependency order, after the nodes
    /// already in the graph (so a cache write expanded first runs before later reads).
    pub fn expand(&mut self, tensor: Tensor<'_>) {
        // SAFETY: valid graph and tensor.
        unsafe { sys::ggml_build_forward_expand(self.raw(), tensor.raw()) };
    }

    /// Number of nodes (ops) in the graph.
    pub fn n_nodes(&self) -> i32 {
        // SAFETY: valid graph.
        unsafe { sys::ggml_graph_n_nodes(self.raw()) }
    }

    /// Most nodes the graph can hold.
    pub fn capacity(&self) -> usize {
        // SAFETY: valid graph.
        unsafe { sys::ggml_graph_size(self.raw()) as usize }
    }
}

/// Generates a method per binary op: `fn op(&self, a, b) -> Tensor`.
macro_rules! binary_ops {
    ($($(#[$doc:meta])* $name:ident => $sys:ident;)*) => {$(
        $(#[$doc])*
        pub fn $name<'t>(&'t self, a: Tensor<'t>, b: Tensor<'t>) -> Tensor<'t> {
            // SAFETY: records a node over two valid tensors (see module docs).
            unsafe { self.wrap(sys::$sys(self.raw(), a.raw(), b.raw())) }
        }
    )*};
}

/// Generates a method per unary op: `fn op(&self, a) -> Tensor`.
macro_rules! unary_ops {
    ($($(#[$doc:meta])* $name:ident => $sys:ident;)*) => {$(
        $(#[$doc])*
        pub fn $name<'t>(&'t self, a: Tensor<'t>) -> Tensor<'t> {
            // SAFETY: records a node over a valid tensor (see module docs).
            unsafe { self.wrap(sys::$sys(self.raw(), a.raw())) }
        }
    )*};
}

/// ggml's `rope_ext` and `rope_ext_back`, which take the same arguments.
type RopeFn = unsafe extern "C" fn(
    *mut sys::ggml_context,
    *mut sys::ggml_tensor,
    *mut sys::ggml_tensor,
    *mut sys::ggml_tensor,
    std::os::raw::c_int,
    std::os::raw::c_int,
    std::os::raw::c_int,
    f32,
    f32,
    f32,
    f32,
    f32,
    f32,
) -> *mut sys::ggml_tensor;

/// Ops. Shapes follow ggml: `mul_mat(w [k, n], x [k, m]) -> [n, m]`.
impl Context {
    binary_ops! {
        /// `w^T x`: weights `[k, n]` times activations `[k, m]` gives `[n, m]`.
        mul_mat => ggml_mul_mat;
        /// Element-wise sum, `b` broadcast over `a`.
        add => ggml_add;
        /// Element-wise product, `b` broadcast over `a`.
        mul => ggml_mul;
        /// Rows of `a` selected by the i32 indices in `b`.
        get_rows => ggml_get_rows;
        /// `silu(a) * b` (SwiGLU with separate gate and up projections).
        swiglu_split => ggml_swiglu_split;
        /// `gelu(a) * b` (GeGLU with separate gate and up projections).
        geglu_split => ggml_geglu_split;
    }

    unary_ops! {
        /// A contiguous copy of a (possibly strided) view.
        cont => ggml_cont;
        /// `tanh` element-wise.
        tanh => ggml_tanh;
        /// A view with dims 0 and 1 swapped.
        transpose => ggml_transpose;
        /// `e^a` element-wise.
        exp => ggml_exp;
    }

    /// `a * s`.
    pub fn scale<'t>(&'t self, a: Tensor<'t>, s: f32) -> Tensor<'t> {
        // SAFETY: records a node (see module docs).
        unsafe { self.wrap(sys::ggml_scale(self.raw(), a.raw(), s)) }
    }

    /// RMS normalisation over dim 0 (no weight).
    pub fn rms_norm<'t>(&'t self, a: Tensor<'t>, eps: f32) -> Tensor<'t> {
        // SAFETY: records a node (see module docs).
        unsafe { self.wrap(sys::ggml_rms_norm(self.raw(), a.raw(), eps)) }
    }

    /// Rotary position embedding of `a` `[head_dim, n_head, n_tokens]` at i32 `positions`,
    /// with optional per-dimension frequency factors (llama 3 style scaling).
    pub fn rope<'t>(
        &'t self,
        a: Tensor<'t>,
        positions: Tensor<'t>,
        freq_factors: Option<Tensor<'t>>,
        rope: &RopeParams,
    ) -> Tensor<'t> {
        self.rope_op(sys::ggml_rope_ext, a, positions, freq_factors, rope)
    }

    /// The inverse rotation of [`Context::rope`] (ggml's `rope_ext_back`: by the negated
    /// angles), with the same parameters.
    pub fn rope_back<'t>(
        &'t self,
        a: Tensor<'t>,
        positions: Tensor<'t>,
        freq_factors: Option<Tensor<'t>>,
        rope: &RopeParams,
    ) -> Tensor<'t> {
        self.rope_op(sys::ggml_rope_ext_back, a, positions, freq_factors, rope)
    }

    fn rope_op<'t>(
        &'t self,
        op: RopeFn,
        a: Tensor<'t>,
        positions: Tensor<'t>,
        freq_factors: Option<Tensor<'t>>,
        rope: &RopeParams,
    ) -> Tensor<'t> {
        let factors = freq_factors.map_or(std::ptr::null_mut(), |t| t.raw());
        // SAFETY: records a node; `factors` is a valid tensor or null (optional in ggml).
        unsafe {
            self.wrap(op(
                self.raw(),
                a.raw(),
                positions.raw(),
                factors,
                rope.n_dims,
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

    /// Writes the rows of `src` into `dst` at the i64 row indices `rows`; returns the
    /// updated view of `dst` (depend on it to order the write before reads).
    pub fn set_rows<'t>(&'t self, dst: Tensor<'t>, src: Tensor<'t>, rows: Tensor<'t>) -> Tensor<'t> {
        // SAFETY: records a node (see module docs).
        unsafe { self.wrap(sys::ggml_set_rows(self.raw(), dst.raw(), src.raw(), rows.raw())) }
    }

    /// Same data seen with a new 2-d shape (the source must be contiguous).
    pub fn reshape_2d<'t>(&'t self, a: Tensor<'t>, ne0: i64, ne1: i64) -> Tensor<'t> {
        // SAFETY: records a node (see module docs).
        unsafe { self.wrap(sys::ggml_reshape_2d(self.raw(), a.raw(), ne0, ne1)) }
    }

    /// Same data seen with a new 3-d shape (the source must be contiguous).
    pub fn reshape_3d<'t>(&'t self, a: Tensor<'t>, ne0: i64, ne1: i64, ne2: i64) -> Tensor<'t> {
        // SAFETY: records a node (see module docs).
        unsafe { self.wrap(sys::ggml_reshape_3d(self.raw(), a.raw(), ne0, ne1, ne2)) }
    }

    /// A strided 3-d view into `a` (`nb1`, `nb2` in bytes; `offset` in bytes).
    #[allow(clippy::too_many_arguments)]
    pub fn view_3d<'t>(&'t self, a: Tensor<'t>, ne: [i64; 3], nb1: usize, nb2: usize, offset: usize) -> Tensor<'t> {
        // SAFETY: records a view node; ggml asserts the view stays inside `a`.
        unsafe {
            self.wrap(sys::ggml_view_3d(
                self.raw(),
                a.raw(),
                ne[0],
                ne[1],
                ne[2],
                nb1,
                nb2,
                offset,
            ))
        }
    }

    /// `a` and `b` joined along dimension `dim` (other dimensions equal).
    pub fn concat<'t>(&'t self, a: Tensor<'t>, b: Tensor<'t>, dim: i32) -> Tensor<'t> {
        // SAFETY: records a node (see module docs); ggml asserts the shapes match.
        unsafe { self.wrap(sys::ggml_concat(self.raw(), a.raw(), b.raw(), dim)) }
    }

    /// Dimension permutation (ggml semantics: axis `i` of `a` goes to position `axes[i]`).
    pub fn permute<'t>(&'t self, a: Tensor<'t>, axes: [i32; 4]) -> Tensor<'t> {
        // SAFETY: records a view node (see module docs).
        unsafe {
            self.wrap(sys::ggml_permute(
                self.raw(),
                a.raw(),
                axes[0],
                axes[1],
                axes[2],
                axes[3],
            ))
        }
    }

    /// Fused attention: `q [d, n_tokens, n_head]`, `k`/`v` `[d, n_kv, n_head_kv]` (f16),
    /// `mask [n_kv, n_tokens]` (f16). Returns `[d, n_head, n_tokens]`.
    pub fn flash_attn<'t>(
        &'t self,
        q: Tensor<'t>,
        k: Tensor<'t>,
        v: Tensor<'t>,
        mask: Tensor<'t>,
        scale: f32,
        softcap: f32,
    ) -> Tensor<'t> {
        // SAFETY: records a node (see module docs); precision flag on a valid tensor.
        unsafe {
            let out = sys::ggml_flash_attn_ext(self.raw(), q.raw(), k.raw(), v.raw(), mask.raw(), scale, 0.0, softcap);
            sys::ggml_prec_set_acc(out, sys::GGML_PREC_F32);
            self.wrap(out)
        }
    }
}

/// Rotary embedding parameters, as llama.cpp passes them to `ggml_rope_ext`.
#[derive(Clone, Debug, PartialEq)]
pub struct RopeParams {
    /// Number of dimensions of each head that rotate.
    pub n_dims: i32,
    /// 0 = normal (interleaved pairs, llama), 2 = NeoX (halves, qwen/gemma).
    pub mode: i32,
    /// Context length the model was trained with (used by YaRN).
    pub n_ctx_orig: i32,
    /// Base frequency θ.
    pub freq_base: f32,
    /// Linear scaling factor (1 / scaling factor from the GGUF).
    pub freq_scale: f32,
    /// YaRN extrapolation mix (0 disables YaRN).
    pub ext_factor: f32,
    /// Magnitude scaling.
    pub attn_factor: f32,
    /// YaRN low correction dim.
    pub beta_fast: f32,
    /// YaRN high correction dim.
    pub beta_slow: f32,
}
