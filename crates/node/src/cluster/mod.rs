//! Nodes in separate processes: the worker server and the head that forms a cluster
//! of workers over `baton_net` links (TCP or Unix-domain sockets, optionally in TLS).

mod admission;
mod form;
pub(crate) mod gate;
mod groups;
mod models;
mod probe;
mod speed;
mod stream;
mod supervise;
mod watch;
mod worker_server;
mod worker_tp;

pub use form::{connect_cluster, model_cost, model_ref, ClusterOptions, RemoteRing, RemoteWorker};
pub use models::{identity_of, ModelDir};
pub use supervise::Supervisor;
pub use worker_server::{Worker, WorkerConfig};

use std::ops::Range;
use std::sync::Arc;

use baton_ggml::Device;
use baton_model::{ModelFile, Stage, StageChain, StageConfig, StageSpan};

use crate::NodeError;

/// `devices`, or the CPU when none are given: what a stage computes on.
pub(crate) fn or_cpu(devices: &[Device]) -> Vec<Device> {
    match devices.is_empty() {
        true => vec![Device::cpu()],
        false => devices.to_vec(),
    }
}

/// `span` cut into consecutive parts (a layer range on a device each): the first part
/// embeds when the span does, the last produces logits when the span does.
pub(crate) fn part_spans(span: &StageSpan, parts: Vec<(Range<usize>, Device)>) -> Vec<(StageSpan, Device)> {
    let n = parts.len();
    parts
        .into_iter()
        .enumerate()
        .map(|(i, (layers, device))| {
            let part = StageSpan {
                layers,
                first: span.first && i == 0,
                last: span.last && i + 1 == n,
            };
            (part, device)
        })
        .collect()
}

/// Loads each part on its device and chains them (the hidden state passes from one to
/// the next in memory).
pub(crate) fn load_chain(
    file: &Arc<ModelFile>,
    parts: Vec<(StageSpan, Device)>,
    config: &StageConfig,
) -> Result<StageChain, NodeError> {
    let stages = parts
        .into_iter()
        .map(|(span, device)| Stage::load_on(file.clone(), span, config, device))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(StageChain::new(stages)?)
}

/// Bytes offered on each of `devices`: a device's free memory, the host's available
/// memory shared between the CPU devices (a stage's weights, KV cache and compute
/// buffers go where it computes; the host holds only the embedding rows it reads for
/// the others). `limit` (`--memory`) is what the worker offers in all, each device
/// keeping its share.
pub(crate) fn device_memory(devices: &[Device], limit: Option<u64>) -> Vec<u64> {
    let n_cpu = devices.iter().filter(|d| d.is_cpu()).count().max(1) as u64;
    let host = available_memory() / n_cpu;
    let free: Vec<u64> = devices
        .iter()
        .map(|d| if d.is_cpu() { host } else { d.memory().free })
        .collect();
    match limit {
        Some(limit) => shares(&free, limit),
        None => free,
    }
}

/// `total` divided in proportion to `weights` (evenly when they are all 0).
fn shares(weights: &[u64], total: u64) -> Vec<u64> {
    let sum: u128 = weights.iter().map(|&w| u128::from(w)).sum();
    weights
        .iter()
        .map(|&w| match sum {
            0 => total / weights.len().max(1) as u64,
            _ => (u128::from(w) * u128::from(total) / sum) as u64,
        })
        .collect()
}

/// `MemAvailable` from /proc/meminfo (Linux); a conservative 1 GiB elsewhere.
pub fn available_memory() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .find_map(|l| l.strip_prefix("MemAvailable:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })
        .map_or(1 << 30, |kb| kb * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_limits_are_shared_in_proportion() {
        assert_eq!(shares(&[30, 10], 8), vec![6, 2]);
        assert_eq!(shares(&[5], 1000), vec![1000]);
        assert_eq!(shares(&[0, 0], 10), vec![5, 5]);
        assert_eq!(shares(&[u64::MAX, u64::MAX], u64::MAX), vec![u64::MAX / 2; 2]);
    }
}
