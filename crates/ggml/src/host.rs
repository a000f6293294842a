//! Host code inside a graph: an op that hands a tensor's values to a Rust closure
//! (tensor parallelism gathers the members' slices there, between the ops before and
//! after it, without splitting the graph), and the per-type facts that slicing
//! quantized weights needs.

use std::sync::Arc;

use llama_cpp_sys_2 as sys;

use crate::graph::{Context, Tensor};
use crate::DType;

/// The body of a host op: reads its input, writes its output (f32 both).
/// Errors cannot travel through ggml: the closure records them itself and must leave
/// finite values in `out`.
pub type HostFn = dyn Fn(&[f32], &mut [f32]) + Send + Sync;

/// A Rust closure run as one node of a graph, on one thread, when the graph computes.
pub struct HostOp {
    body: Box<HostFn>,
}

impl HostOp {
    /// An op running `body`.
    pub fn new(body: impl Fn(&[f32], &mut [f32]) + Send + Sync + 'static) -> Arc<HostOp> {
        Arc::new(HostOp { body: Box::new(body) })
    }
}

/// Called by ggml's CPU backend for each thread of the node; `n_tasks` is 1, so only
/// thread 0 gets here with work.
unsafe extern "C" fn run_host_op(
    dst: *mut sys::ggml_tensor,
    ith: std::os::raw::c_int,
    _nth: std::os::raw::c_int,
    userdata: *mut std::ffi::c_void,
) {
    if ith != 0 {
        return;
    }
    // SAFETY: `host_op` made `dst` a new contiguous f32 tensor whose one source is a
    // contiguous f32 tensor; ggml allocated both before computing (non-null data of
    // `ggml_nelements` floats each, in distinct buffers: a custom op is never computed
    // in place); `userdata` is the `HostOp` the graph's context keeps alive
    // (`Context::keep`) as long as the node exists.
    let (input, out, op) = unsafe {
        let a = (*dst).src[0];
        let input = std::slice::from_raw_parts((*a).data as *const f32, sys::ggml_nelements(a) as usize);
        let out = std::slice::from_raw_parts_mut((*dst).data as *mut f32, sys::ggml_nelements(dst) as usize);
        (input, out, &*(userdata as *const HostOp))
    };
    // A panic must not unwind into C.
    if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| (op.body)(input, &mut *out))).is_err() {
        out.fill(0.0);
    }
}

impl Context {
    /// A node computing `op` over `a` (a contiguous f32 `[n, rows]` tensor) into a new
    /// f32 tensor `[out_n, rows]`. The context keeps `op` alive.
    ///
    /// # Panics
    /// When `a` is not a contiguous 2-d f32 tensor (a bug in the graph builder).
    pub fn host_op<'t>(&'t self, a: Tensor<'t>, out_n: usize, op: Arc<HostOp>) -> Tensor<'t> {
        let [_, rows, ne2, ne3] = a.ne();
        // SAFETY: `ggml_is_contiguous` only reads the tensor's metadata.
        let contiguous = unsafe { sys::ggml_is_contiguous(a.raw()) };
        assert!(
            a.dtype() == DType::F32 && contiguous && ne2 == 1 && ne3 == 1 && out_n > 0,
            "a host op reads a contiguous 2-d f32 tensor"
        );
        let userdata = Arc::as_ptr(&op) as *mut std::ffi::c_void;
        self.keep(op);
        let mut args = [a.raw()];
        // SAFETY: records a node over a valid tensor (ggml copies the one-entry source
        // list); the callback's contract is upheld by `run_host_op` and the kept `op`.
        unsafe {
            self.wrap(sys::ggml_custom_4d(
                self.raw(),
                sys::GGML_TYPE_F32,
                out_n as i64,
                rows,
                1,
                1,
                args.as_mut_ptr(),
                1,
                Some(run_host_op),
                1,
                userdata,
            ))
        }
    }
}

impl DType {
    /// Elements per quantization block (1 for float types).
    pub fn block_size(self) -> usize {
        // SAFETY: pure lookup in ggml's static type table.
        unsafe { sys::ggml_blck_size(self.0) as usize }
    }

    /// Bytes of a row of `n` elements (`n` a multiple of the block size).
    pub fn row_bytes(self, n: usize) -> usize {
        // SAFETY: pure computation over ggml's static type table.
        unsafe { sys::ggml_row_size(self.0, n as i64) }
    }

    /// ggml's name of the type (`q4_K`, `f32`).
    pub fn name(self) -> String {
        // SAFETY: returns a static C string (or null for unknown ids).
        let ptr = unsafe { sys::ggml_type_name(self.0) };
        if ptr.is_null() {
            return format!("type {}", self.0);
        }
        // SAFETY: non-null static NUL-terminated string.
        unsafe { std::ffi::CStr::from_ptr(ptr) }.to_string_lossy().into_owned()
    }
}
