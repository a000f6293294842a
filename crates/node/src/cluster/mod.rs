//! Nodes in separate processes: the worker server and the head that forms a cluster
//! of workers over `baton_net` links (TCP or Unix-domain sockets, optionally in TLS).

mod admission;
mod form;
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
