//! Nodes in separate processes: the worker server and the head that forms a cluster
//! of workers over TCP.

mod head;
mod models;
mod speed;
mod stream;
mod worker;

pub use head::{connect_cluster, model_cost, model_ref, ClusterOptions, RemoteRing, RemoteWorker};
pub use models::{identity_of, ModelDir};
pub use worker::{Worker, WorkerConfig};
