//! Backends (where graphs run), buffers (where tensor data lives) and the graph allocator.

use std::path::Path;
use std::ptr::NonNull;
use std::sync::Arc;

use llama_cpp_sys_2 as sys;

use crate::graph::{Context, Graph, Tensor};
use crate::GgmlError;

/// The CPU backend with a fixed number of threads.
pub struct CpuBackend {
    ptr: NonNull<sys::ggml_backend>,
}

// SAFETY: a ggml backend may be used from any thread, one at a time; `compute` takes
// `&mut self`, so the Rust wrapper never shares it between threads concurrently.
unsafe impl Send for CpuBackend {}

impl CpuBackend {
    /// A CPU backend computing with `n_threads` threads.
    pub fn new(n_threads: usize) -> CpuBackend {
        crate::init();
        // SAFETY: plain constructor; null means allocation failure.
        let ptr = unsafe { sys::ggml_backend_cpu_init() };
        let ptr = NonNull::new(ptr).expect("ggml_backend_cpu_init failed");
        // SAFETY: a valid CPU backend.
        unsafe { sys::ggml_backend_cpu_set_n_threads(ptr.as_ptr(), n_threads.max(1) as i32) };
        CpuBackend { ptr }
    }

    /// Runs every node of `graph`. All its tensors must be allocated.
    pub fn compute(&mut self, graph: &Graph<'_>) -> Result<(), GgmlError> {
        // SAFETY: valid backend and graph; the allocator placed every tensor.
        let status = unsafe { sys::ggml_backend_graph_compute(self.ptr.as_ptr(), graph.raw()) };
        if status != sys::GGML_STATUS_SUCCESS {
            return Err(GgmlError::Compute(status));
        }
        Ok(())
    }
}

impl Drop for CpuBackend {
    fn drop(&mut self) {
        // SAFETY: we own the backend.
        unsafe { sys::ggml_backend_free(self.ptr.as_ptr()) }
    }
}

/// A backend buffer that owns memory for tensors.
pub struct Buffer {
    ptr: NonNull<sys::ggml_backend_buffer>,
}

// SAFETY: a backend buffer is plain memory; access is ordered by the owners' &mut use.
unsafe impl Send for Buffer {}

impl Buffer {
    /// Allocates CPU memory for every tensor in `ctx` (used for KV caches).
    pub fn alloc_cpu(ctx: &Context) -> Result<Buffer, GgmlError> {
        // SAFETY: the CPU buffer type is a static singleton.
        let buft = unsafe { sys::ggml_backend_cpu_buffer_type() };
        // SAFETY: allocates and places all tensors of a valid context.
        let ptr = unsafe { sys::ggml_backend_alloc_ctx_tensors_from_buft(ctx.raw(), buft) };
        NonNull::new(ptr)
            .map(|ptr| Buffer { ptr })
            .ok_or(GgmlError::OutOfMemory)
    }

    /// Sets every byte of the buffer to `value`.
    pub fn clear(&mut self, value: u8) {
        // SAFETY: valid buffer.
        unsafe { sys::ggml_backend_buffer_clear(self.ptr.as_ptr(), value) }
    }

    /// Size in bytes.
    pub fn size(&self) -> usize {
        // SAFETY: valid buffer.
        unsafe { sys::ggml_backend_buffer_get_size(self.ptr.as_ptr()) }
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        // SAFETY: we own the buffer; tensors placed in it are not used after this
        // (owners drop the contexts and buffers together).
        unsafe { sys::ggml_backend_buffer_free(self.ptr.as_ptr()) }
    }
}

/// A read-only memory map of a whole file (a GGUF model).
pub struct MappedFile {
    map: memmap2::Mmap,
}

impl MappedFile {
    /// Maps `path` read-only.
    pub fn open(path: &Path) -> std::io::Result<MappedFile> {
        let file = std::fs::File::open(path)?;
        // SAFETY: mapping is unsound only if another process truncates or rewrites the
        // file while it is mapped. Model files are read-only inputs to baton (documented);
        // baton itself never writes a file it has mapped.
        let map = unsafe { memmap2::Mmap::map(&file)? };
        Ok(MappedFile { map })
    }

    /// The file's bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.map
    }

    /// Drops the pages wholly inside `offset..offset + len` from this process's resident
    /// set (the file's page cache keeps them); used after copying weights elsewhere.
    pub fn release(&self, offset: usize, len: usize) {
        const PAGE: usize = 4096;
        let start = offset.div_ceil(PAGE) * PAGE;
        let end = (offset.saturating_add(len) / PAGE * PAGE).min(self.map.len());
        if end > start {
            // SAFETY: MADV_DONTNEED on a read-only shared file mapping only unmaps pages;
            // later reads fault them back in from the file, unchanged. Nothing holds
            // references into the range: its tensors were copied out.
            let _ = unsafe {
                self.map
                    .unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, start, end - start)
            };
        }
    }

    /// Start address of the mapping (to find it in /proc/self/smaps).
    pub fn address(&self) -> usize {
        self.map.as_ptr() as usize
    }
}

/// A CPU buffer over a mapped file: tensors placed in it read their weights straight
/// from the mapping, so only the pages a stage touches become resident.
pub struct MappedBuffer {
    ptr: NonNull<sys::ggml_backend_buffer>,
    // Keeps the memory alive for as long as ggml may read it.
    file: Arc<MappedFile>,
}

// SAFETY: see `Buffer`; the mapped memory is read-only for ggml (weights).
unsafe impl Send for MappedBuffer {}

impl MappedBuffer {
    /// Wraps the whole of `file` as a ggml CPU buffer.
    pub fn new(file: Arc<MappedFile>) -> Result<MappedBuffer, GgmlError> {
        let bytes = file.bytes();
        // SAFETY: the buffer holds an Arc to the mapping, so the memory outlives it;
        // ggml only reads weight memory.
        let ptr = unsafe { sys::ggml_backend_cpu_buffer_from_ptr(bytes.as_ptr() as *mut _, bytes.len()) };
        let ptr = NonNull::new(ptr).ok_or(GgmlError::OutOfMemory)?;
        Ok(MappedBuffer { ptr, file })
    }

    /// Points `tensor` at `offset..offset + tensor.n_bytes()` of the mapped file.
    /// The tensor must not be used after this buffer is dropped.
    pub fn place(&self, tensor: Tensor<'_>, offset: usize) -> Result<(), GgmlError> {
        let len = self.file.bytes().len();
        let end = offset.checked_add(tensor.n_bytes()).ok_or(GgmlError::OutOfMemory)?;
        if end > len {
            return Err(GgmlError::Place {
                tensor: tensor.name(),
                offset,
                len,
            });
        }
        let addr = self.file.bytes()[offset..].as_ptr() as *mut std::ffi::c_void;
        // SAFETY: offset..end is inside the mapping (checked above).
        let status = unsafe { sys::ggml_backend_tensor_alloc(self.ptr.as_ptr(), tensor.raw(), addr) };
        if status != sys::GGML_STATUS_SUCCESS {
            return Err(GgmlError::Place {
                tensor: tensor.name(),
                offset,
                len,
            });
        }
        Ok(())
    }
}

impl Drop for MappedBuffer {
    fn drop(&mut self) {
        // SAFETY: we own the buffer object; freeing a from_ptr buffer does not free the memory.
        unsafe { sys::ggml_backend_buffer_free(self.ptr.as_ptr()) }
    }
}

/// Places the intermediate tensors of graphs in one reusable CPU buffer.
pub struct Allocator {
    ptr: NonNull<sys::ggml_gallocr>,
}

// SAFETY: plain allocator state, used through &mut self only.
unsafe impl Send for Allocator {}

impl Allocator {
    /// An allocator for the CPU buffer type.
    pub fn new_cpu() -> Allocator {
        // SAFETY: static buffer type; null means allocation failure.
        let ptr = unsafe { sys::ggml_gallocr_new(sys::ggml_backend_cpu_buffer_type()) };
        Allocator {
            ptr: NonNull::new(ptr).expect("ggml_gallocr_new failed"),
        }
    }

    /// Allocates every tensor of `graph` that has no data yet (growing the buffer when needed).
    pub fn alloc(&mut self, graph: &Graph<'_>) -> Result<(), GgmlError> {
        // SAFETY: valid allocator and graph.
        if unsafe { sys::ggml_gallocr_alloc_graph(self.ptr.as_ptr(), graph.raw()) } {
            Ok(())
        } else {
            Err(GgmlError::OutOfMemory)
        }
    }

    /// Bytes held by the allocator's compute buffer.
    pub fn size(&self) -> usize {
        // SAFETY: valid allocator; buffer 0 is the only one.
        unsafe { sys::ggml_gallocr_get_buffer_size(self.ptr.as_ptr(), 0) }
    }
}

impl Drop for Allocator {
    fn drop(&mut self) {
        // SAFETY: we own the allocator.
        unsafe { sys::ggml_gallocr_free(self.ptr.as_ptr()) }
    }
}

/// How a weight is used, for [`ExtraBufferType::supports`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightOp {
    /// Multiplied by activations with `mul_mat`.
    MulMat,
    /// Expert matrices, multiplied with `mul_mat_id` selecting `n_used` per token.
    MulMatId { n_used: usize },
}

/// A buffer type of the CPU device other than plain memory: ggml's "extra" buffer
/// types, which repack weights into layouts its fastest matmul kernels read
/// (llama.cpp puts every weight a repack type supports into one, by default).
#[derive(Clone, Copy, Debug)]
pub struct ExtraBufferType {
    buft: sys::ggml_backend_buffer_type_t,
    dev: sys::ggml_backend_dev_t,
}

// SAFETY: buffer types and devices are process-wide static singletons in ggml.
unsafe impl Send for ExtraBufferType {}
// SAFETY: as above; they are only read.
unsafe impl Sync for ExtraBufferType {}

impl ExtraBufferType {
    /// The CPU device's extra buffer types, in llama.cpp's order of preference.
    pub fn cpu() -> Vec<ExtraBufferType> {
        crate::init();
        // SAFETY: device and registry lookups return static singletons or null.
        unsafe {
            let dev = sys::ggml_backend_dev_by_type(sys::GGML_BACKEND_DEVICE_TYPE_CPU);
            if dev.is_null() {
                return Vec::new();
            }
            let reg = sys::ggml_backend_dev_backend_reg(dev);
            let name = c"ggml_backend_dev_get_extra_bufts";
            let proc = sys::ggml_backend_reg_get_proc_address(reg, name.as_ptr());
            if proc.is_null() {
                return Vec::new();
            }
            // The registry returns this function under exactly this name and type.
            let get: sys::ggml_backend_dev_get_extra_bufts_t = std::mem::transmute(proc);
            let Some(get) = get else { return Vec::new() };
            let mut list = get(dev);
            let mut out = Vec::new();
            while !list.is_null() && !(*list).is_null() {
                out.push(ExtraBufferType { buft: *list, dev });
                list = list.add(1);
            }
            out
        }
    }

    /// The buffer type's name (e.g. `CPU_REPACK`).
    pub fn name(&self) -> String {
        // SAFETY: static NUL-terminated name of a valid buffer type.
        unsafe { std::ffi::CStr::from_ptr(sys::ggml_backend_buft_name(self.buft)) }
            .to_string_lossy()
            .into_owned()
    }

    /// Whether a weight like `weight` can live in this buffer type and be used there by
    /// `op`, decided as llama.cpp decides it: a dummy op over a 512-token batch.
    pub fn supports(&self, weight: Tensor<'_>, op: WeightOp) -> bool {
        let ctx = Context::new(8, 0);
        let probe = ctx.new_tensor(weight.dtype(), &weight.ne());
        let ne = weight.ne();
        let node = match op {
            WeightOp::MulMat => {
                let batch = ctx.new_tensor(crate::DType::F32, &[ne[0], 512, ne[2], ne[3]]);
                ctx.mul_mat(probe, batch)
            }
            WeightOp::MulMatId { n_used } => {
                let n_used = n_used.max(1) as i64;
                let batch = ctx.new_tensor(crate::DType::F32, &[ne[0], n_used, 512]);
                let ids = ctx.new_tensor(crate::DType::I32, &[n_used, 512]);
                ctx.mul_mat_id(probe, batch, ids)
            }
        };
        // SAFETY: `probe` is a fresh tensor of our context; it borrows a zero-size
        // buffer of this type only for the check and gives it back before returning.
        unsafe {
            let dummy = sys::ggml_backend_buft_alloc_buffer(self.buft, 0);
            if dummy.is_null() {
                return false;
            }
            (*probe.raw()).buffer = dummy;
            let supported = sys::ggml_backend_dev_supports_op(self.dev, node.raw());
            (*probe.raw()).buffer = std::ptr::null_mut();
            sys::ggml_backend_buffer_free(dummy);
            supported
        }
    }

    /// Allocates memory of this type for every tensor of `ctx`.
    pub fn alloc(&self, ctx: &Context) -> Result<Buffer, GgmlError> {
        // SAFETY: allocates and places all tensors of a valid context.
        let ptr = unsafe { sys::ggml_backend_alloc_ctx_tensors_from_buft(ctx.raw(), self.buft) };
        NonNull::new(ptr)
            .map(|ptr| Buffer { ptr })
            .ok_or(GgmlError::OutOfMemory)
    }
}
