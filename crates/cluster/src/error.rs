//! Why the head could not form a ring of workers.

use baton_model::ModelError;
use baton_proto::RefusalCode;
use baton_stage::NodeError;

/// Why [`connect_cluster`](crate::connect_cluster) formed no ring: each variant names
/// the step that failed; the text is the step's own error (a worker's address, its
/// refusal, the plan's numbers).
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    /// No workers were given.
    #[error("no workers given")]
    NoWorkers,
    /// The head could not open its copy of the model.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// A worker could not be reached or measured, refused the head, or holds another
    /// file (or a damaged copy) under the model's name.
    #[error(transparent)]
    Reach(NodeError),
    /// No worker answered (only with `skip_unreachable`): each, and why.
    #[error("no worker answered ({})", answers(.0))]
    NoneAnswered(Vec<(String, NodeError)>),
    /// No plan fits the nodes that answered, or the plan asked for cannot be made
    /// (`--tp`, `--split`).
    #[error(transparent)]
    Plan(NodeError),
    /// A worker or the head's own stage could not load its layers, or tensors could
    /// not be streamed to a worker that lacks them.
    #[error(transparent)]
    Load(NodeError),
    /// The loaded stages could not be linked into a ring.
    #[error(transparent)]
    Link(NodeError),
}

impl ClusterError {
    /// The refusal code, when a worker refused the head (during the handshake or
    /// after it).
    pub fn refusal(&self) -> Option<RefusalCode> {
        match self {
            ClusterError::Reach(e) | ClusterError::Plan(e) | ClusterError::Load(e) | ClusterError::Link(e) => {
                e.refusal()
            }
            ClusterError::NoWorkers | ClusterError::Model(_) | ClusterError::NoneAnswered(_) => None,
        }
    }
}

/// Each worker that did not answer, and why, for people.
fn answers(unreachable: &[(String, NodeError)]) -> String {
    let why: Vec<String> = unreachable.iter().map(|(a, e)| format!("{a}: {e}")).collect();
    why.join("; ")
}
