//! `baton worker`: a node that serves one head per model at once. For each it describes
//! itself, loads the layer range the head's plan gives it from its own copy of the model
//! (or receives just those tensors once), links into the ring and, when the plan places
//! it in a tensor-parallel group, with the other members, and runs its stage until the
//! head goes. It builds on [`baton_stage`] and never imports the head's crates.
#![deny(unsafe_code)]

mod error;
mod group;
mod receive;
mod server;

pub use error::WorkerError;
pub use server::{Leave, Worker, WorkerConfig};
