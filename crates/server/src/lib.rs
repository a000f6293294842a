//! The OpenAI-compatible HTTP API of `baton serve`: requests become sequences for the
//! head's engine; chat messages become prompts through the model's chat template.
#![deny(unsafe_code)]

mod api;
mod openai;
pub mod request;
pub mod template;

pub use api::{router, ApiError, AppState, ServerConfig};
