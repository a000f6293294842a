//! Devices as ggml's backend registry lists them (the CPU, and GPUs of the backends
//! compiled in: CUDA, Metal, Vulkan), and the buffer types weights can live in.

use std::ffi::CStr;
use std::ptr::NonNull;

use llama_cpp_sys_2 as sys;

use crate::backend::Buffer;
use crate::graph::{Context, Tensor};
use crate::GgmlError;

/// What kind of device ggml says a device is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceKind {
    /// The CPU (system memory).
    Cpu,
    /// A GPU with memory of its own (Mesa's lavapipe reports itself as one too).
    Gpu,
    /// A GPU that shares the host's memory.
    IntegratedGpu,
    /// Something else (an accelerator that only assists the CPU, a meta device).
    Other,
}

/// Free and total memory of a device, in bytes, as its backend reports them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceMemory {
    /// Bytes free now.
    pub free: u64,
    /// Bytes in all.
    pub total: u64,
}

/// A device of ggml's registry: a process-wide singleton, so the handle is `Copy`.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Device {
    dev: NonNull<sys::ggml_backend_device>,
}

// SAFETY: devices are static singletons of ggml's registry; their methods used here
// (names, memory, buffer types, op support) only read them.
unsafe impl Send for Device {}
// SAFETY: as above.
unsafe impl Sync for Device {}

impl Device {
    /// The devices baton can run a stage on, accelerators first (in ggml's order), the
    /// CPU last. Devices that only assist the CPU (BLAS, AMX) are not listed.
    pub fn all() -> Vec<Device> {
        crate::init();
        // SAFETY: registry enumeration; indices below the count are valid.
        let count = unsafe { sys::ggml_backend_dev_count() };
        let devices: Vec<Device> = (0..count)
            // SAFETY: index in range; the registry returns a static device.
            .filter_map(|i| NonNull::new(unsafe { sys::ggml_backend_dev_get(i) }))
            .map(|dev| Device { dev })
            .collect();
        let accelerators = devices
            .iter()
            .filter(|d| matches!(d.kind(), DeviceKind::Gpu | DeviceKind::IntegratedGpu));
        let cpu = devices.iter().filter(|d| d.kind() == DeviceKind::Cpu);
        accelerators.chain(cpu).copied().collect()
    }

    /// The CPU device (always compiled in).
    pub fn cpu() -> Device {
        crate::init();
        // SAFETY: registry lookup of a static device.
        let dev = unsafe { sys::ggml_backend_dev_by_type(sys::GGML_BACKEND_DEVICE_TYPE_CPU) };
        Device {
            dev: NonNull::new(dev).expect("ggml always registers its CPU device"),
        }
    }

    /// The device called `name` (as `baton devices` lists them; case does not matter).
    pub fn by_name(name: &str) -> Option<Device> {
        Device::all().into_iter().find(|d| d.name().eq_ignore_ascii_case(name))
    }

    /// The devices named in `names`, in that order; the error names the unknown one
    /// and lists the devices there are.
    pub fn parse_list(names: &[String]) -> Result<Vec<Device>, GgmlError> {
        names
            .iter()
            .map(|name| {
                Device::by_name(name.trim()).ok_or_else(|| GgmlError::UnknownDevice {
                    name: name.clone(),
                    known: Device::all().iter().map(Device::name).collect::<Vec<_>>().join(", "),
                })
            })
            .collect()
    }

    /// What a stage runs on when nothing is said: the first accelerator, else the CPU.
    pub fn preferred() -> Device {
        Device::all().into_iter().next().unwrap_or_else(Device::cpu)
    }

    pub(crate) fn raw(&self) -> sys::ggml_backend_dev_t {
        self.dev.as_ptr()
    }

    /// ggml's name for the device (`CPU`, `Vulkan0`, `CUDA0`, `MTL0`).
    pub fn name(&self) -> String {
        // SAFETY: static NUL-terminated name of a valid device.
        unsafe { CStr::from_ptr(sys::ggml_backend_dev_name(self.raw())) }
            .to_string_lossy()
            .into_owned()
    }

    /// What the device is, in words (e.g. the GPU's model).
    pub fn description(&self) -> String {
        // SAFETY: static NUL-terminated description of a valid device.
        unsafe { CStr::from_ptr(sys::ggml_backend_dev_description(self.raw())) }
            .to_string_lossy()
            .into_owned()
    }

    /// The kind of device.
    pub fn kind(&self) -> DeviceKind {
        // SAFETY: valid device.
        match unsafe { sys::ggml_backend_dev_type(self.raw()) } {
            sys::GGML_BACKEND_DEVICE_TYPE_CPU => DeviceKind::Cpu,
            sys::GGML_BACKEND_DEVICE_TYPE_GPU => DeviceKind::Gpu,
            sys::GGML_BACKEND_DEVICE_TYPE_IGPU => DeviceKind::IntegratedGpu,
            _ => DeviceKind::Other,
        }
    }

    /// Whether this is the CPU.
    pub fn is_cpu(&self) -> bool {
        self.kind() == DeviceKind::Cpu
    }

    /// Free and total memory now.
    pub fn memory(&self) -> DeviceMemory {
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: valid device; the two out-pointers are valid for writes.
        unsafe { sys::ggml_backend_dev_memory(self.raw(), &mut free, &mut total) };
        DeviceMemory {
            free: free as u64,
            total: total as u64,
        }
    }

    /// The device's own memory, where its weights and KV cache go.
    pub fn buffer_type(&self) -> BufferType {
        // SAFETY: valid device; its default buffer type is a static singleton.
        let buft = unsafe { sys::ggml_backend_dev_buffer_type(self.raw()) };
        BufferType { buft, dev: self.raw() }
    }
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.name())
    }
}

/// How a weight is used, for [`BufferType::supports`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightOp {
    /// Multiplied by activations with `mul_mat`.
    MulMat,
    /// Expert matrices, multiplied with `mul_mat_id` selecting `n_used` per token.
    MulMatId { n_used: usize },
    /// Multiplied element-wise into activations (norm weights; biases are added, which
    /// every backend that multiplies can do too).
    Elementwise,
}

/// A kind of memory tensors can live in: a device's own memory, or one of the CPU's
/// "extra" buffer types, which repack weights into layouts its fastest matmul kernels
/// read (llama.cpp puts every weight a repack type supports into one, by default).
#[derive(Clone, Copy, Debug)]
pub struct BufferType {
    buft: sys::ggml_backend_buffer_type_t,
    dev: sys::ggml_backend_dev_t,
}

// SAFETY: buffer types and devices are process-wide static singletons in ggml.
unsafe impl Send for BufferType {}
// SAFETY: as above; they are only read.
unsafe impl Sync for BufferType {}

impl BufferType {
    /// The CPU device's extra buffer types, in llama.cpp's order of preference.
    pub fn cpu_extra() -> Vec<BufferType> {
        let dev = Device::cpu().raw();
        // SAFETY: registry lookups return static singletons or null.
        unsafe {
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
                out.push(BufferType { buft: *list, dev });
                list = list.add(1);
            }
            out
        }
    }

    pub(crate) fn raw(&self) -> sys::ggml_backend_buffer_type_t {
        self.buft
    }

    /// The buffer type's name (e.g. `CPU_REPACK`, `Vulkan0`).
    pub fn name(&self) -> String {
        // SAFETY: static NUL-terminated name of a valid buffer type.
        unsafe { CStr::from_ptr(sys::ggml_backend_buft_name(self.buft)) }
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
            WeightOp::Elementwise => {
                let batch = ctx.new_tensor(crate::DType::F32, &[ne[0], 512, ne[2], ne[3]]);
                ctx.mul(batch, probe)
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
        Buffer::from_raw(ptr).ok_or_else(|| GgmlError::OutOfMemory {
            what: format!("{} tensors in {}", ctx.n_tensors(), self.name()),
        })
    }
}
