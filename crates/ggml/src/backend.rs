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
        Buffer::from_raw(ptr).ok_or_else(|| GgmlError::OutOfMemory {
            what: format!("{} tensors in CPU memory", ctx.n_tensors()),
        })
    }

    /// Takes ownership of a buffer ggml allocated (`None` for null: allocation failed).
    pub(crate) fn from_raw(ptr: *mut sys::ggml_backend_buffer) -> Option<Buffer> {
        NonNull::new(ptr).map(|ptr| Buffer { ptr })
    }

    /// Marks the buffer as holding weights, as llama.cpp marks its weight buffers: the
    /// backend scheduler runs an op where its weights are (and may offload it to a
    /// faster device for large batches), and keeps other tensors out of weight memory.
    pub fn mark_weights(&mut self) {
        // SAFETY: valid buffer; sets a flag.
        unsafe { sys::ggml_backend_buffer_set_usage(self.ptr.as_ptr(), sys::GGML_BACKEND_BUFFER_USAGE_WEIGHTS) }
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
        let ptr = NonNull::new(ptr).ok_or_else(|| GgmlError::OutOfMemory {
            what: format!("a CPU buffer over a mapping of {} bytes", bytes.len()),
        })?;
        Ok(MappedBuffer { ptr, file })
    }

    /// Marks the buffer as holding weights (see [`Buffer::mark_weights`]).
    pub fn mark_weights(&mut self) {
        // SAFETY: valid buffer; sets a flag.
        unsafe { sys::ggml_backend_buffer_set_usage(self.ptr.as_ptr(), sys::GGML_BACKEND_BUFFER_USAGE_WEIGHTS) }
    }

    /// Points `tensor` at `offset..offset + tensor.n_bytes()` of the mapped file.
    /// The tensor must not be used after this buffer is dropped.
    pub fn place(&self, tensor: Tensor<'_>, offset: usize) -> Result<(), GgmlError> {
        let len = self.file.bytes().len();
        let end = offset.checked_add(tensor.n_bytes());
        if end.is_none_or(|end| end > len) {
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
            Err(GgmlError::OutOfMemory {
                what: format!("the compute buffer of a graph of {} nodes", graph.n_nodes()),
            })
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
