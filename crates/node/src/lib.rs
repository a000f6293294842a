//! Running stages as a ring: the stage worker loop, the head that drives generation,
//! and an in-process ring of several stages.
#![deny(unsafe_code)]

pub mod cluster;
pub mod engine;
mod head;
mod local;
mod stage_loop;
pub mod tp_net;

pub use head::{GenerateRequest, Generation, Head, RingEnds};
pub use local::LocalRing;
pub use stage_loop::{run, StageWorker};

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
