//! The head's side of a cluster of workers: forming a ring from a plan (capabilities,
//! planning, loading, streaming weights to workers that lack them, linking stages and
//! tensor-parallel groups), watching each worker over its heartbeat, and forming a new
//! ring when one is lost ([`Supervisor`], the engine's [`baton_engine::RingSource`]).
#![deny(unsafe_code)]

mod error;
mod form;
mod groups;
mod stream;
mod supervise;
mod watch;

pub use error::ClusterError;
pub use form::{
    connect_cluster, model_cost, model_ref, ClusterOptions, ContextFit, RemoteRing, RemoteWorker, CONTEXT_STEP,
};
pub use supervise::{Members, Supervisor, MAX_WORKERS};
