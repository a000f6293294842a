//! Graphs on a device other than the CPU: ggml's backend scheduler over the device's
//! backend and the CPU's. Each op runs where its weights are; ops the device cannot run
//! fall back to the CPU, and the scheduler copies their inputs across.

use std::ptr::NonNull;

use llama_cpp_sys_2 as sys;

use crate::device::Device;
use crate::graph::Graph;
use crate::GgmlError;

/// A backend (a device's compute stream) that this crate owns.
struct Backend {
    ptr: NonNull<sys::ggml_backend>,
}

impl Backend {
    fn new(device: Device, n_threads: usize) -> Result<Backend, GgmlError> {
        // SAFETY: valid device; no parameters; null means the device could not start.
        let ptr = unsafe { sys::ggml_backend_dev_init(device.raw(), std::ptr::null()) };
        let ptr = NonNull::new(ptr).ok_or_else(|| GgmlError::Device {
            device: device.name(),
            message: format!("the backend did not start: {}", crate::take_logged_errors()),
        })?;
        if device.is_cpu() {
            // SAFETY: a CPU backend (the device says so).
            unsafe { sys::ggml_backend_cpu_set_n_threads(ptr.as_ptr(), n_threads.max(1) as i32) };
        }
        Ok(Backend { ptr })
    }
}

impl Drop for Backend {
    fn drop(&mut self) {
        // SAFETY: we own the backend; the scheduler using it is freed first.
        unsafe { sys::ggml_backend_free(self.ptr.as_ptr()) }
    }
}

/// Runs graphs on one device, with the CPU for the ops the device lacks.
pub struct Scheduler {
    /// The scheduler and the graph size it was made for. Declared first: it is freed
    /// before the backends it uses.
    sched: Option<(NonNull<sys::ggml_backend_sched>, usize)>,
    /// `[device, CPU]`: the scheduler prefers earlier backends.
    backends: Vec<Backend>,
    bufts: Vec<sys::ggml_backend_buffer_type_t>,
    device: Device,
    n_threads: usize,
}

// SAFETY: the scheduler and its backends are used from one thread at a time (`&mut self`).
unsafe impl Send for Scheduler {}

/// Tensors (nodes and leaves) the first scheduler of a stage is made for: a graph that
/// needs more makes a new scheduler, and new backends with it.
const FIRST_GRAPH_SIZE: usize = 8192;

impl Scheduler {
    /// A scheduler for `device` (not the CPU), with a CPU backend of `n_threads` threads
    /// for the rest.
    pub fn new(device: Device, n_threads: usize) -> Result<Scheduler, GgmlError> {
        crate::init();
        // As llama.cpp: the CPU's share of the compute memory is the device's pinned host
        // memory when it has some (faster copies to and from the device).
        // SAFETY: valid device; buffer types are static singletons (null: none).
        let host = unsafe { sys::ggml_backend_dev_host_buffer_type(device.raw()) };
        let cpu_buft = if host.is_null() {
            // SAFETY: static singleton.
            unsafe { sys::ggml_backend_cpu_buffer_type() }
        } else {
            host
        };
        let mut scheduler = Scheduler {
            sched: None,
            backends: Vec::new(),
            bufts: vec![device.buffer_type().raw(), cpu_buft],
            device,
            n_threads,
        };
        scheduler.recreate(FIRST_GRAPH_SIZE)?;
        Ok(scheduler)
    }

    /// The device graphs run on.
    pub fn device(&self) -> Device {
        self.device
    }

    /// Splits `graph` between the backends and allocates its tensors that have no
    /// memory yet; write the inputs after this, then [`compute`](Self::compute).
    pub fn alloc(&mut self, graph: &Graph<'_>) -> Result<(), GgmlError> {
        // The scheduler's tables hold every tensor of a graph: nodes and leaves, each
        // up to the graph's capacity.
        let needed = 2 * graph.capacity();
        let sched = match self.sched {
            Some((sched, size)) if size >= needed => sched,
            _ => self.recreate(needed.next_power_of_two())?,
        };
        // SAFETY: valid scheduler and graph; reset forgets the previous graph's split.
        let ok = unsafe {
            sys::ggml_backend_sched_reset(sched.as_ptr());
            sys::ggml_backend_sched_alloc_graph(sched.as_ptr(), graph.raw())
        };
        if !ok {
            return Err(GgmlError::OutOfMemory {
                what: format!(
                    "the compute buffers of a graph of {} nodes on {}: {}",
                    graph.n_nodes(),
                    self.device.name(),
                    crate::take_logged_errors()
                ),
            });
        }
        Ok(())
    }

    /// A new scheduler for graphs of up to `graph_size` tensors, over new backends: a
    /// new scheduler over backends that computed for an old one corrupted memory in
    /// ggml's Vulkan backend (lavapipe, Mesa 22.3).
    fn recreate(&mut self, graph_size: usize) -> Result<NonNull<sys::ggml_backend_sched>, GgmlError> {
        if let Some((old, _)) = self.sched.take() {
            // SAFETY: we own it; no graph of it is in use between calls.
            unsafe { sys::ggml_backend_sched_free(old.as_ptr()) };
        }
        self.backends.clear();
        self.backends = vec![
            Backend::new(self.device, self.n_threads)?,
            Backend::new(Device::cpu(), self.n_threads)?,
        ];
        let mut backends: Vec<sys::ggml_backend_t> = self.backends.iter().map(|b| b.ptr.as_ptr()).collect();
        // SAFETY: arrays of n_backends valid backends and buffer types that outlive the
        // scheduler (it is freed before them). One copy of each tensor (no pipeline
        // parallelism); op offload on, as llama.cpp has it.
        let ptr = unsafe {
            sys::ggml_backend_sched_new(
                backends.as_mut_ptr(),
                self.bufts.as_mut_ptr(),
                backends.len() as i32,
                graph_size,
                false,
                true,
            )
        };
        let sched = NonNull::new(ptr).ok_or_else(|| GgmlError::OutOfMemory {
            what: format!("a scheduler for graphs of {graph_size} tensors"),
        })?;
        self.sched = Some((sched, graph_size));
        Ok(sched)
    }

    /// Runs `graph`, allocated by [`alloc`](Self::alloc); returns when it is done.
    pub fn compute(&mut self, graph: &Graph<'_>) -> Result<(), GgmlError> {
        let Some((sched, _)) = self.sched else {
            return Err(GgmlError::Compute(sys::GGML_STATUS_FAILED));
        };
        // SAFETY: valid scheduler; the graph was allocated by it and its inputs written.
        let status = unsafe { sys::ggml_backend_sched_graph_compute(sched.as_ptr(), graph.raw()) };
        if status != sys::GGML_STATUS_SUCCESS {
            return Err(GgmlError::Compute(status));
        }
        Ok(())
    }

    /// Bytes of compute memory held on the device and on the host.
    pub fn buffer_bytes(&self) -> (usize, usize) {
        let Some((sched, _)) = self.sched else { return (0, 0) };
        let size = |backend: &Backend| {
            // SAFETY: valid scheduler and one of its backends.
            unsafe { sys::ggml_backend_sched_get_buffer_size(sched.as_ptr(), backend.ptr.as_ptr()) }
        };
        (size(&self.backends[0]), size(&self.backends[1]))
    }

    /// Graph splits of the last graph (a split per change of backend: 1 when the device
    /// ran everything but the inputs).
    pub fn n_splits(&self) -> usize {
        let Some((sched, _)) = self.sched else { return 0 };
        // SAFETY: valid scheduler.
        unsafe { sys::ggml_backend_sched_get_n_splits(sched.as_ptr()) as usize }
    }
}

impl Drop for Scheduler {
    fn drop(&mut self) {
        if let Some((sched, _)) = self.sched.take() {
            // SAFETY: we own it; the backends it points to are freed after this.
            unsafe { sys::ggml_backend_sched_free(sched.as_ptr()) };
        }
    }
}
