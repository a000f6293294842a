//! The OpenAI-compatible HTTP API of `baton serve`: requests become sequences for the
//! head's engine; chat messages become prompts through the model's chat template.
#![deny(unsafe_code)]

mod anthropic;
mod api;
mod description;
pub mod listen;
mod metrics;
mod openai;
mod page;
pub mod reasoning;
pub mod request;
mod responses;
pub mod template;
pub mod tools;

pub use api::{router, router_for, ApiError, AppState, Joining, ServerConfig};
