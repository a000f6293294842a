//! A stage of a ring and what every node needs to run one: the stage loop
//! ([`StageWorker`], no I/O, and [`run`] over any link), the links of a
//! tensor-parallel group ([`tp_net`]), the door a listening node lets peers in by
//! ([`gate`]), a node's model files ([`models`]), and loading its layers on its devices.
//! The head's engine ([`baton_engine`](../baton_engine)), the worker
//! ([`baton_worker`](../baton_worker)) and the head's cluster forming
//! ([`baton_cluster`](../baton_cluster)) build on it; it imports none of them.
#![deny(unsafe_code)]

mod admission;
pub mod gate;
pub mod models;
pub mod probe;
pub mod speed;
mod stage_loop;
pub mod tp_net;

pub use models::{identity_of, ModelDir};
pub use stage_loop::{run, StageError, StageWorker};

use std::ops::Range;
use std::sync::Arc;

use baton_ggml::Device;
use baton_model::{ModelFile, Stage, StageChain, StageConfig, StageSpan};

/// Most sequences in one batch of decode steps. A stage on the CPU computes such a batch
/// whole, each product cutting its rows into pieces that its kernels compute as alone
/// (`baton_model::Stage::whole_decode_batches`); a GPU stage cuts it into pieces of
/// [`max_decode_rows`].
pub const MAX_DECODE_SEQS: usize = baton_ggml::MAX_ROWS;

/// Most decode rows in one micro-batch that ggml computes exactly as it computes one
/// row alone. With weights repacked for the CPU (`CPU_REPACK`, the default) ggml takes
/// its 4-row gemm kernel from 4 rows on (ggml-cpu/repack.cpp: "more than three rows in
/// src1, use gemm"); on plain quantized weights the tiled kernel for K-quants starts at 8
/// rows. Either rounds differently from the one-row kernel, and a sequence would then
/// generate differently in company than alone.
pub fn max_decode_rows(repack: bool) -> usize {
    if repack {
        3
    } else {
        7
    }
}

/// Errors seen by the head or a worker loop.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    /// A stage could not be loaded.
    #[error(transparent)]
    Model(#[from] baton_model::ModelError),
    /// The cluster token cannot be used (empty, too short).
    #[error(transparent)]
    Token(#[from] baton_proto::auth::TokenError),
    /// A link failed.
    #[error(transparent)]
    Net(#[from] baton_net::NetError),
    /// A stage (named by its first layer) reported an error for a message; `fault`
    /// says what kind (a request that cannot be served, a full KV cache, a failed
    /// computation such as a broken tensor-parallel group).
    #[error("the stage from layer {first_layer}: {message}")]
    Stage {
        first_layer: u32,
        fault: baton_proto::Fault,
        message: String,
    },
    /// A peer broke the protocol.
    #[error("protocol error: {0}")]
    Protocol(String),
    /// The request cannot be served.
    #[error("{0}")]
    Request(String),
    /// No plan fits the cluster.
    #[error(transparent)]
    Plan(#[from] baton_plan::PlanError),
    /// A worker refused the head (`code` says why to programs, `reason` to people).
    #[error("{}", refused_text(worker, *code, reason))]
    Refused {
        worker: String,
        code: baton_proto::RefusalCode,
        reason: String,
    },
    /// A worker could not be reached at all.
    #[error(
        "worker {worker} could not be reached: {reason}; check that `baton worker --listen` runs there \
         on this address and port, and that no firewall blocks it"
    )]
    Unreachable { worker: String, reason: String },
    /// A file or directory could not be used.
    #[error("cannot {action} {}: {source}", path.display())]
    File {
        path: std::path::PathBuf,
        /// What was tried, e.g. "open" or "use models directory".
        action: &'static str,
        source: std::io::Error,
    },
    /// A file is not a GGUF model that can be read.
    #[error("{}: {source}", path.display())]
    Gguf {
        path: std::path::PathBuf,
        source: baton_gguf::GgufError,
    },
}

impl NodeError {
    /// The refusal code, when a worker refused this node (during the handshake or
    /// after it).
    pub fn refusal(&self) -> Option<baton_proto::RefusalCode> {
        match self {
            NodeError::Refused { code, .. } => Some(*code),
            NodeError::Net(e) => e.refusal(),
            _ => None,
        }
    }
}

fn refused_text(worker: &str, code: baton_proto::RefusalCode, reason: &str) -> String {
    match code {
        baton_proto::RefusalCode::LoadFailed => format!("worker {worker} could not load: {reason}"),
        _ => format!("worker {worker} refused: {reason}"),
    }
}

/// `devices`, or the CPU when none are given: what a stage computes on.
pub fn or_cpu(devices: &[Device]) -> Vec<Device> {
    match devices.is_empty() {
        true => vec![Device::cpu()],
        false => devices.to_vec(),
    }
}

/// `span` cut into consecutive parts (a layer range on a device each): the first part
/// embeds when the span does, the last produces logits when the span does.
pub fn part_spans(span: &StageSpan, parts: Vec<(Range<usize>, Device)>) -> Vec<(StageSpan, Device)> {
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
pub fn load_chain(
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
pub fn device_memory(devices: &[Device], limit: Option<u64>) -> Vec<u64> {
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
