//! Running stages as a ring: the stage worker loop, the head that drives generation,
//! and an in-process ring of several stages.
#![deny(unsafe_code)]

pub mod cluster;
pub mod engine;
mod head;
mod local;
mod worker;

pub use head::{GenerateRequest, Generation, Head};
pub use local::LocalRing;
pub use worker::{run, StageWorker};

/// Errors seen by the head or a worker loop.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    /// A stage could not be loaded.
    #[error(transparent)]
    Model(#[from] baton_model::ModelError),
    /// A link failed.
    #[error(transparent)]
    Net(#[from] baton_net::NetError),
    /// A stage (named by its first layer) reported an error for a message.
    #[error("the stage from layer {first_layer}: {message}")]
    Stage { first_layer: u32, message: String },
    /// A peer broke the protocol.
    #[error("protocol error: {0}")]
    Protocol(String),
    /// The request cannot be served.
    #[error("{0}")]
    Request(String),
    /// No plan fits the cluster.
    #[error(transparent)]
    Plan(#[from] baton_plan::PlanError),
}
