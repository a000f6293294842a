//! Where a stage's graphs run: on the CPU backend alone (the CPU path, unchanged since
//! it is what the CPU fidelity tests pin), or through ggml's backend scheduler on
//! another device with the CPU as the fallback for ops the device lacks.

use baton_ggml::{Allocator, CpuBackend, Device, Graph, Scheduler};

use crate::ModelError;

/// Allocates and computes one stage's graphs on its device.
pub enum Runner {
    /// The CPU backend with a plain compute allocator.
    Cpu { backend: CpuBackend, alloc: Allocator },
    /// A device other than the CPU, through the scheduler.
    Device(Scheduler),
}

/// Bytes of compute memory a stage holds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ComputeBytes {
    /// On the device (0 for the CPU).
    pub device: usize,
    /// In host memory.
    pub host: usize,
}

impl Runner {
    /// A runner for `device` computing with `n_threads` CPU threads.
    pub fn new(device: Device, n_threads: usize) -> Result<Runner, ModelError> {
        Ok(if device.is_cpu() {
            Runner::Cpu {
                backend: CpuBackend::new(n_threads),
                alloc: Allocator::new_cpu(),
            }
        } else {
            Runner::Device(Scheduler::new(device, n_threads)?)
        })
    }

    /// Gives every tensor of `graph` without memory its place (inputs included, so
    /// they are written after this).
    pub fn alloc(&mut self, graph: &Graph<'_>) -> Result<(), ModelError> {
        match self {
            Runner::Cpu { alloc, .. } => alloc.alloc(graph)?,
            Runner::Device(sched) => sched.alloc(graph)?,
        }
        Ok(())
    }

    /// Runs `graph` to the end.
    pub fn compute(&mut self, graph: &Graph<'_>) -> Result<(), ModelError> {
        match self {
            Runner::Cpu { backend, .. } => backend.compute(graph)?,
            Runner::Device(sched) => sched.compute(graph)?,
        }
        Ok(())
    }

    /// Compute memory held now.
    pub fn bytes(&self) -> ComputeBytes {
        match self {
            Runner::Cpu { alloc, .. } => ComputeBytes {
                device: 0,
                host: alloc.size(),
            },
            Runner::Device(sched) => {
                let (device, host) = sched.buffer_bytes();
                ComputeBytes { device, host }
            }
        }
    }
}
