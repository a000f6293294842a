//! Safe handles over ggml and libllama (through `llama-cpp-sys-2`).
//!
//! This is the only crate of baton with `unsafe` code. Every handle frees what it owns
//! on drop; every `unsafe` block says why it is sound.

mod backend;
pub mod cpu;
mod device;
mod graph;
mod host;
mod invariant;
mod llama;
mod ops;
mod quantize;
pub(crate) mod rows;
mod sched;
#[cfg(test)]
mod tests;

use std::sync::Once;

use llama_cpp_sys_2 as sys;

pub use backend::{Allocator, Buffer, CpuBackend, MappedBuffer, MappedFile};
pub use device::{BufferType, Device, DeviceKind, DeviceMemory, WeightOp};
pub use graph::{Context, Graph, GraphId, RopeParams, Tensor, TensorId};
pub use host::{HostFn, HostOp};
pub use invariant::{batching, Batching, Product, Whole, MAX_ROWS};
pub use llama::{LlamaContext, LlamaModel, LlamaPooling};
pub use quantize::{quantize, FileType};
pub use sched::Scheduler;

/// Accelerator backends compiled into this binary (by crate features).
pub const BACKENDS: &[&str] = &[
    #[cfg(feature = "cuda")]
    "CUDA",
    #[cfg(feature = "metal")]
    "Metal",
    #[cfg(feature = "vulkan")]
    "Vulkan",
];

/// How llama.cpp inside this binary was configured (CMake build type, read back from
/// its CMake cache by this crate's build script): "Release" means -O3.
pub const LLAMA_BUILD_TYPE: &str = env!("BATON_LLAMA_BUILD_TYPE");

/// A ggml element type (its numeric id is the GGUF tensor type id).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DType(pub u32);

impl DType {
    /// 32-bit float.
    pub const F32: DType = DType(sys::GGML_TYPE_F32);
    /// 16-bit float.
    pub const F16: DType = DType(sys::GGML_TYPE_F16);
    /// 32-bit signed integer.
    pub const I32: DType = DType(sys::GGML_TYPE_I32);
    /// 64-bit signed integer.
    pub const I64: DType = DType(sys::GGML_TYPE_I64);
    /// bfloat16.
    pub const BF16: DType = DType(sys::GGML_TYPE_BF16);
    /// 8-bit blocks of 32 with an f16 scale.
    pub const Q8_0: DType = DType(sys::GGML_TYPE_Q8_0);
    /// 4-bit blocks of 32 with an f16 scale.
    pub const Q4_0: DType = DType(sys::GGML_TYPE_Q4_0);
    /// 4-bit blocks of 32 with an f16 scale and minimum.
    pub const Q4_1: DType = DType(sys::GGML_TYPE_Q4_1);
    /// 5-bit blocks of 32 with an f16 scale.
    pub const Q5_0: DType = DType(sys::GGML_TYPE_Q5_0);
    /// 5-bit blocks of 32 with an f16 scale and minimum.
    pub const Q5_1: DType = DType(sys::GGML_TYPE_Q5_1);
    /// 4-bit non-linear blocks of 32.
    pub const IQ4_NL: DType = DType(sys::GGML_TYPE_IQ4_NL);

    /// Whether the type stores blocks of quantized values (not a float or integer type).
    pub fn is_quantized(self) -> bool {
        // SAFETY: pure lookup in ggml's static type table (ids past the end read false).
        self.0 < sys::GGML_TYPE_COUNT && unsafe { sys::ggml_is_quantized(self.0) }
    }

    /// Whether the CPU backend can multiply by a matrix of this type (weights).
    pub fn can_mul_mat(self) -> bool {
        if self.0 >= sys::GGML_TYPE_COUNT
            || matches!(
                self.0,
                sys::GGML_TYPE_I8 | sys::GGML_TYPE_I16 | sys::GGML_TYPE_I32 | sys::GGML_TYPE_I64
            )
        {
            return false;
        }
        cpu_has_vec_dot(self.0)
    }
}

/// Whether ggml's CPU backend has a dot product for weights of type `t`.
#[cfg(not(feature = "dynamic-backends"))]
fn cpu_has_vec_dot(t: sys::ggml_type) -> bool {
    // SAFETY: in-range type id; returns a pointer to a static traits table.
    let traits = unsafe { sys::ggml_get_type_traits_cpu(t) };
    // SAFETY: non-null pointer to a static table entry.
    !traits.is_null() && unsafe { (*traits).vec_dot }.is_some()
}

/// Whether ggml's CPU backend has a dot product for weights of type `t`. With backends
/// loaded at run time the CPU's traits table is not linked: the types of that table
/// without `vec_dot` (activation-only types) are named here, and types ggml removed
/// (block size 0) are refused.
#[cfg(feature = "dynamic-backends")]
fn cpu_has_vec_dot(t: sys::ggml_type) -> bool {
    // SAFETY: in-range type id (checked by the caller); static traits table.
    let traits = unsafe { sys::ggml_get_type_traits(t) };
    // SAFETY: non-null pointer to a static table entry.
    !traits.is_null() && unsafe { (*traits).blck_size } > 0 && !matches!(t, sys::GGML_TYPE_Q8_1 | sys::GGML_TYPE_Q8_K)
}

/// Loads ggml's backends (CPU, CUDA, Vulkan, ...) from shared libraries: from
/// `BATON_BACKEND_DIR` when set, else from the program's directory (and the directory
/// the build named). Of several CPU variants (`libggml-cpu-haswell.so`, ...) ggml loads
/// the one that scores best on this CPU's features, never one the CPU cannot run;
/// `BATON_CPU_VARIANT=haswell` loads that one instead (to compare variants, e.g. AMX
/// against the same CPU without it), refused with an error if the CPU cannot run it.
/// Only in builds with backends loaded at run time.
#[cfg(feature = "dynamic-backends")]
fn load_backends() {
    use std::os::unix::ffi::OsStrExt;
    let dir = std::env::var_os("BATON_BACKEND_DIR").map(std::path::PathBuf::from);
    if let Some(variant) = std::env::var_os("BATON_CPU_VARIANT") {
        let dir = dir
            .clone()
            .or_else(|| std::env::current_exe().ok()?.parent().map(|p| p.to_path_buf()));
        let base = dir.unwrap_or_default();
        let path = base.join(format!("libggml-cpu-{}.so", variant.to_string_lossy()));
        let c_path = std::ffi::CString::new(path.as_os_str().as_bytes()).expect("path holds a NUL byte");
        // SAFETY: a NUL-terminated path; ggml checks the library's score (0: this CPU
        // cannot run it) before registering it.
        let reg = unsafe { sys::ggml_backend_load(c_path.as_ptr()) };
        if reg.is_null() {
            eprintln!(
                "error: BATON_CPU_VARIANT={}: {} is missing or cannot run on this CPU",
                variant.to_string_lossy(),
                path.display()
            );
            std::process::exit(1);
        }
        for accelerator in ["cuda", "vulkan", "metal"] {
            let path = base.join(format!("libggml-{accelerator}.so"));
            if path.exists() {
                let c_path = std::ffi::CString::new(path.as_os_str().as_bytes()).expect("path holds a NUL byte");
                // SAFETY: as above.
                unsafe { sys::ggml_backend_load(c_path.as_ptr()) };
            }
        }
        return;
    }
    match dir {
        Some(dir) => {
            let dir = std::ffi::CString::new(dir.as_os_str().as_bytes()).expect("BATON_BACKEND_DIR holds a NUL byte");
            // SAFETY: a NUL-terminated path; ggml only reads it.
            unsafe { sys::ggml_backend_load_all_from_path(dir.as_ptr()) }
        }
        // SAFETY: global registry initialisation, once.
        None => unsafe { sys::ggml_backend_load_all() },
    }
}

/// Errors from ggml or libllama calls.
#[derive(Debug, thiserror::Error)]
pub enum GgmlError {
    /// A graph computation failed.
    #[error("ggml graph computation failed with status {0}")]
    Compute(i32),
    /// A buffer or compute allocation failed.
    #[error("ggml could not allocate memory for {what}")]
    OutOfMemory { what: String },
    /// A device name that is not one of this machine's (or this build's).
    #[error("no device '{name}' here (devices: {known}); `baton devices` lists them")]
    UnknownDevice { name: String, known: String },
    /// A tensor does not fit where it was to be placed.
    #[error("tensor '{tensor}' at offset {offset} does not fit in a mapped region of {len} bytes")]
    Place { tensor: String, offset: usize, len: usize },
    /// A host copy had the wrong size or the tensor had no memory.
    #[error("copy of {bytes} bytes to/from tensor '{tensor}' of {expected} bytes (or unallocated)")]
    Io {
        tensor: String,
        bytes: usize,
        expected: usize,
    },
    /// A device could not be used.
    #[error("device {device}: {message}")]
    Device { device: String, message: String },
    /// libllama refused an operation.
    #[error("libllama: {0}")]
    Llama(String),
}

static INIT: Once = Once::new();

/// Initialises ggml/libllama once per process and routes their logs to `log_sink`.
pub fn init() {
    INIT.call_once(|| {
        // SAFETY: one-time global initialisation, guarded by `Once`; the callback is a
        // plain function that lives for the whole program.
        unsafe {
            sys::llama_log_set(Some(log_sink), std::ptr::null_mut());
            sys::ggml_log_set(Some(log_sink), std::ptr::null_mut());
        }
        // Before libllama's initialisation, which loads every backend from the default
        // places when none is registered yet (the best CPU variant among them), and
        // then BATON_BACKEND_DIR's or BATON_CPU_VARIANT's would come second.
        #[cfg(feature = "dynamic-backends")]
        load_backends();
        // SAFETY: as above.
        unsafe { sys::llama_backend_init() };
    });
}

std::thread_local! {
    /// The error lines ggml and libllama logged on this thread since the last
    /// [`take_logged_errors`]: what a failed call said, for its error message.
    static LOGGED_ERRORS: std::cell::RefCell<String> = const { std::cell::RefCell::new(String::new()) };
}

/// Most bytes of logged error text kept per thread.
const MAX_LOGGED_ERRORS: usize = 4096;

/// The error lines logged on this thread since the last call, trimmed.
pub(crate) fn take_logged_errors() -> String {
    LOGGED_ERRORS.with(|errors| std::mem::take(&mut *errors.borrow_mut()).trim().to_string())
}

/// Keeps ggml's and libllama's log off stderr unless `BATON_GGML_LOG` is set. Error
/// lines are kept (per thread) so that the failing call can put them in its error.
extern "C" fn log_sink(level: sys::ggml_log_level, text: *const std::os::raw::c_char, _user: *mut std::ffi::c_void) {
    if text.is_null() {
        return;
    }
    // SAFETY: ggml passes a NUL-terminated string valid for the call.
    let text = unsafe { std::ffi::CStr::from_ptr(text) }.to_string_lossy();
    if level == sys::GGML_LOG_LEVEL_ERROR {
        LOGGED_ERRORS.with(|errors| {
            let mut errors = errors.borrow_mut();
            if errors.len() + text.len() <= MAX_LOGGED_ERRORS {
                errors.push_str(&text);
            }
        });
    }
    if std::env::var_os("BATON_GGML_LOG").is_some() {
        eprint!("{text}");
    }
}
