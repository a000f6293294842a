//! The request and response shapes of OpenAI's API, as far as baton serves them.

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// `stop`: one string or several.
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    /// One stop string.
    One(String),
    /// Up to four.
    Many(Vec<String>),
}

impl Stop {
    /// The strings.
    pub fn into_vec(self) -> Vec<String> {
        match self {
            Stop::One(s) => vec![s],
            Stop::Many(v) => v,
        }
    }
}

/// `stream_options`.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct StreamOptions {
    /// Send a last chunk with the token counts.
    #[serde(default)]
    pub include_usage: bool,
}

/// Fields shared by both generation endpoints.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct Sampling {
    /// Model id (must be the served model's).
    pub model: Option<String>,
    /// Most tokens to generate.
    pub max_tokens: Option<u64>,
    /// Same, newer name (chat).
    pub max_completion_tokens: Option<u64>,
    /// 0..2; 0 is greedy.
    pub temperature: Option<f32>,
    /// Nucleus sampling.
    pub top_p: Option<f32>,
    /// Extension: keep the K most likely tokens.
    pub top_k: Option<i32>,
    /// Extension: drop tokens less likely than P × the best.
    pub min_p: Option<f32>,
    /// Extension: llama.cpp's repetition penalty.
    pub repeat_penalty: Option<f32>,
    /// -2..2.
    pub presence_penalty: Option<f32>,
    /// -2..2.
    pub frequency_penalty: Option<f32>,
    /// Sampling seed.
    pub seed: Option<u64>,
    /// Stop strings.
    pub stop: Option<Stop>,
    /// Number of choices (only 1).
    pub n: Option<u64>,
    /// Stream with server-sent events.
    #[serde(default)]
    pub stream: bool,
    /// Streaming options.
    pub stream_options: Option<StreamOptions>,
    /// Extension: speculative decoding for this request, `"off"`, `"ngram"` (prompt
    /// lookup) or `"model"` (the server's `--draft-model`); default: the server's `--draft`.
    pub draft: Option<String>,
    /// Extension: most tokens drafted per step (default: the server's `--draft-max`).
    pub draft_max: Option<u32>,
}

/// One message's content: text, or a list of parts.
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum Content {
    /// Plain text.
    Text(String),
    /// Typed parts; only `text` parts are supported.
    Parts(Vec<ContentPart>),
}

/// A typed part of a message.
#[derive(Clone, Debug, Deserialize)]
pub struct ContentPart {
    /// `text` (others are refused).
    #[serde(rename = "type")]
    pub kind: String,
    /// The text of a `text` part.
    pub text: Option<String>,
}

/// A chat message from the client.
#[derive(Clone, Debug, Deserialize)]
pub struct MessageIn {
    /// system, developer, user, assistant, tool.
    pub role: String,
    /// Its content (may be null for assistant messages with tool calls).
    pub content: Option<Content>,
    /// An assistant message's calls: `{"id", "type": "function", "function": {"name", "arguments"}}`.
    pub tool_calls: Option<Vec<Value>>,
    /// A `tool` message: the call it answers.
    pub tool_call_id: Option<String>,
    /// A `tool` message: the function's name (older clients).
    pub name: Option<String>,
}

/// `POST /v1/chat/completions`.
#[derive(Clone, Debug, Deserialize)]
pub struct ChatRequest {
    /// The conversation.
    pub messages: Vec<MessageIn>,
    /// Return log-probabilities of the generated tokens.
    #[serde(default)]
    pub logprobs: bool,
    /// And this many alternatives per token (0..=20).
    pub top_logprobs: Option<u8>,
    /// Functions the model may call: `{"type": "function", "function": {"name", "description", "parameters"}}`.
    pub tools: Option<Vec<Value>>,
    /// `"auto"`, `"none"`, `"required"` or `{"type": "function", "function": {"name"}}`.
    pub tool_choice: Option<Value>,
    /// Whether several calls may come in one answer (default true).
    pub parallel_tool_calls: Option<bool>,
    /// `{"type": "text" | "json_object" | "json_schema", "json_schema": {"schema", …}}`.
    pub response_format: Option<Value>,
    /// Extension (llama.cpp's): a GBNF grammar the answer must follow.
    pub grammar: Option<String>,
    /// Extension (llama.cpp's): `auto` or `deepseek` (thinking in `reasoning_content`,
    /// the default) or `none` (thinking left in `content`).
    pub reasoning_format: Option<String>,
    /// Extension (llama.cpp's): variables for the chat template (`enable_thinking`).
    pub chat_template_kwargs: Option<serde_json::Map<String, Value>>,
    /// `none`, `minimal`, `low`, `medium`, `high`: given to the template as
    /// `reasoning_effort` (gpt-oss reads it); `none` and `minimal` turn thinking off.
    pub reasoning_effort: Option<String>,
    /// Extension (llama.cpp's): most tokens the thinking may take (-1: no limit); when
    /// spent, `</think>` is forced. `thinking_budget_tokens` is the same (Anthropic's
    /// `thinking.budget_tokens` arrives as it).
    #[serde(alias = "thinking_budget_tokens")]
    pub reasoning_budget_tokens: Option<i64>,
    /// Shared fields.
    #[serde(flatten)]
    pub sampling: Sampling,
}

/// `prompt` of a completion: text, one text in a list, or token ids.
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    /// Text.
    Text(String),
    /// Token ids.
    Tokens(Vec<u32>),
    /// A batch of texts (only one is supported).
    Texts(Vec<String>),
}

/// `POST /v1/completions`.
#[derive(Clone, Debug, Deserialize)]
pub struct CompletionRequest {
    /// The prompt.
    pub prompt: Prompt,
    /// Log-probabilities of this many best tokens per position (0..=5).
    pub logprobs: Option<u8>,
    /// Echo the prompt (not supported).
    #[serde(default)]
    pub echo: bool,
    /// Shared fields.
    #[serde(flatten)]
    pub sampling: Sampling,
}

/// Token counts.
#[derive(Clone, Debug, Serialize)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
    pub prompt_tokens_details: PromptTokensDetails,
}

/// Prompt tokens served from cache.
#[derive(Clone, Debug, Serialize)]
pub struct PromptTokensDetails {
    pub cached_tokens: usize,
}

/// OpenAI's error body.
#[derive(Clone, Debug, Serialize)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

/// The error itself.
#[derive(Clone, Debug, Serialize)]
pub struct ErrorDetail {
    pub message: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub param: Option<&'static str>,
    pub code: Option<&'static str>,
}
