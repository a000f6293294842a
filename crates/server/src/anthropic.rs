//! Anthropic's Messages API (`POST /v1/messages`) in terms of the chat endpoint: a
//! request is translated into the chat request it means and checked by the same code,
//! so both endpoints share one set of limits, one prompt and one engine job; only the
//! shapes of the answer differ (see `api/messages.rs`).
//!
//! Supported: `system` (text or text blocks), `messages` with text, `tool_use` and
//! `tool_result` blocks, `max_tokens` (required, as Anthropic requires it),
//! `stop_sequences`, `temperature`, `top_p`, `top_k`, `stream`, `tools` (custom tools
//! with an `input_schema`), `tool_choice` (`auto`, `any`, `tool`, `none`,
//! `disable_parallel_tool_use`), `thinking` (`enabled` or `adaptive`: the template's
//! `enable_thinking` on and the model's thinking sent as `thinking` blocks, as it is
//! without the field; with `enabled`, `budget_tokens` (10000 when absent, as llama.cpp's
//! server takes it) limits the thinking: `</think>` is forced when it is spent; `disabled`:
//! `enable_thinking` off and any thinking the model writes anyway left out), and
//! `thinking` blocks in assistant messages (dropped: templates show a model only its
//! answers of earlier turns). Refused with a 400 that names the field: images and
//! documents, server tools (web search and the like).

use serde_json::{json, Map, Value};

use crate::api::ApiError;

/// The chat request (`POST /v1/chat/completions` body) that Anthropic request `body`
/// asks for.
pub fn to_chat(body: &Value) -> Result<Value, ApiError> {
    let object = body
        .as_object()
        .ok_or_else(|| ApiError::invalid("the request body must be a JSON object"))?;
    let mut chat = Map::new();
    let max_tokens = object
        .get("max_tokens")
        .ok_or_else(|| ApiError::invalid("max_tokens is required").param("max_tokens"))?;
    chat.insert("max_tokens".into(), max_tokens.clone());
    // `grammar` is the chat endpoint's extension, as llama.cpp's server takes it.
    for key in ["model", "temperature", "top_p", "top_k", "stream", "grammar"] {
        if let Some(value) = object.get(key) {
            chat.insert(key.into(), value.clone());
        }
    }
    if let Some(stop) = object.get("stop_sequences") {
        chat.insert("stop".into(), stop.clone());
    }
    if let Some(thinks) = thinking(object.get("thinking"))? {
        chat.insert("chat_template_kwargs".into(), json!({"enable_thinking": thinks}));
    }
    // llama.cpp's server limits only `enabled` thinking, to `budget_tokens` or 10000.
    let thinking = object.get("thinking");
    if thinking.and_then(|t| t.get("type")).and_then(Value::as_str) == Some("enabled") {
        let budget = thinking.and_then(|t| t.get("budget_tokens")).and_then(Value::as_u64);
        chat.insert("thinking_budget_tokens".into(), json!(budget.unwrap_or(10_000)));
    }
    let mut messages = Vec::new();
    if let Some(system) = object.get("system") {
        messages.push(json!({"role": "system", "content": text_of(system, "system")?}));
    }
    let given = object
        .get("messages")
        .and_then(Value::as_array)
        .ok_or_else(|| ApiError::invalid("messages must be a list").param("messages"))?;
    for message in given {
        messages.extend(translate_message(message)?);
    }
    chat.insert("messages".into(), Value::Array(messages));
    if let Some(tools) = object.get("tools") {
        let tools = tools
            .as_array()
            .ok_or_else(|| ApiError::invalid("tools must be a list").param("tools"))?;
        let functions = tools.iter().map(translate_tool).collect::<Result<Vec<_>, _>>()?;
        chat.insert("tools".into(), Value::Array(functions));
    }
    if let Some(choice) = object.get("tool_choice") {
        let (choice, parallel) = translate_tool_choice(choice)?;
        chat.insert("tool_choice".into(), choice);
        if let Some(parallel) = parallel {
            chat.insert("parallel_tool_calls".into(), Value::Bool(parallel));
        }
    }
    Ok(Value::Object(chat))
}

/// Whether `thinking` (`{"type": "enabled" | "adaptive" | "disabled"}`) turns thinking
/// on or off; `None` when absent.
fn thinking(thinking: Option<&Value>) -> Result<Option<bool>, ApiError> {
    let Some(thinking) = thinking.filter(|t| !t.is_null()) else {
        return Ok(None);
    };
    let bad = |message: &str| ApiError::invalid(message.to_string()).param("thinking");
    if thinking
        .get("budget_tokens")
        .is_some_and(|b| !b.is_null() && b.as_u64().is_none())
    {
        return Err(bad("thinking.budget_tokens must be a positive integer"));
    }
    match thinking.get("type").and_then(Value::as_str) {
        Some("enabled" | "adaptive") => Ok(Some(true)),
        Some("disabled") => Ok(Some(false)),
        _ => Err(bad("thinking.type must be enabled, adaptive or disabled")),
    }
}

/// Whether request `body` turned thinking off (`thinking: {"type": "disabled"}`): then
/// thinking the model writes anyway is not sent.
pub fn thinking_disabled(body: &Value) -> bool {
    matches!(thinking(body.get("thinking")), Ok(Some(false)))
}

/// The text of `value`: a string, or a list of `text` blocks joined.
fn text_of(value: &Value, field: &'static str) -> Result<String, ApiError> {
    match value {
        Value::String(text) => Ok(text.clone()),
        Value::Array(blocks) => {
            let mut text = String::new();
            for block in blocks {
                match block_type(block) {
                    "text" => text.push_str(block.get("text").and_then(Value::as_str).unwrap_or_default()),
                    other => return Err(unsupported_block(other, field)),
                }
            }
            Ok(text)
        }
        _ => Err(ApiError::invalid(format!("{field} must be a string or a list of text blocks")).param(field)),
    }
}

fn block_type(block: &Value) -> &str {
    block.get("type").and_then(Value::as_str).unwrap_or("(none)")
}

fn unsupported_block(kind: &str, field: &'static str) -> ApiError {
    ApiError::invalid(format!(
        "content blocks of type '{kind}' are not supported here (text, tool_use and tool_result are)"
    ))
    .param(field)
}

/// One Anthropic message as chat messages: its text and calls as one message, and each
/// `tool_result` block as a `tool` message of its own (before the text that follows
/// them, as the results answer the calls of the turn before).
fn translate_message(message: &Value) -> Result<Vec<Value>, ApiError> {
    let role = message.get("role").and_then(Value::as_str).unwrap_or_default();
    if role != "user" && role != "assistant" {
        return Err(ApiError::invalid(format!("message role '{role}' is not user or assistant")).param("messages"));
    }
    let blocks = match message.get("content") {
        Some(Value::String(text)) => return Ok(vec![json!({"role": role, "content": text})]),
        Some(Value::Array(blocks)) => blocks,
        _ => {
            return Err(ApiError::invalid("a message's content must be a string or a list of blocks").param("messages"))
        }
    };
    let mut out = Vec::new();
    let mut text = String::new();
    let mut calls = Vec::new();
    for block in blocks {
        match (block_type(block), role) {
            ("text", _) => text.push_str(block.get("text").and_then(Value::as_str).unwrap_or_default()),
            ("tool_use", "assistant") => {
                let name = block.get("name").and_then(Value::as_str).unwrap_or_default();
                let input = block.get("input").cloned().unwrap_or_else(|| json!({}));
                calls.push(json!({
                    "id": block.get("id").cloned().unwrap_or(Value::Null),
                    "type": "function",
                    "function": {"name": name, "arguments": input.to_string()},
                }));
            }
            // The model's own earlier thinking: templates drop it from earlier turns.
            ("thinking" | "redacted_thinking", "assistant") => {}
            ("tool_result", "user") => {
                let content = match block.get("content") {
                    None | Some(Value::Null) => String::new(),
                    Some(content) => text_of(content, "messages")?,
                };
                out.push(json!({
                    "role": "tool",
                    "tool_call_id": block.get("tool_use_id").cloned().unwrap_or(Value::Null),
                    "content": content,
                }));
            }
            (kind @ ("tool_use" | "tool_result"), _) => {
                return Err(ApiError::invalid(format!("a {role} message cannot hold a {kind} block")).param("messages"))
            }
            (other, _) => return Err(unsupported_block(other, "messages")),
        }
    }
    if !text.is_empty() || !calls.is_empty() || out.is_empty() {
        let mut message = json!({"role": role, "content": text});
        if !calls.is_empty() {
            message["tool_calls"] = Value::Array(calls);
        }
        out.push(message);
    }
    Ok(out)
}

/// A custom tool as a chat function.
fn translate_tool(tool: &Value) -> Result<Value, ApiError> {
    if let Some(kind) = tool.get("type").and_then(Value::as_str).filter(|k| *k != "custom") {
        return Err(
            ApiError::invalid(format!("tools of type '{kind}' are not supported (custom tools are)")).param("tools"),
        );
    }
    let name = tool
        .get("name")
        .and_then(Value::as_str)
        .ok_or_else(|| ApiError::invalid("a tool needs a name").param("tools"))?;
    let mut function = json!({"name": name});
    if let Some(description) = tool.get("description") {
        function["description"] = description.clone();
    }
    if let Some(schema) = tool.get("input_schema") {
        function["parameters"] = schema.clone();
    }
    Ok(json!({"type": "function", "function": function}))
}

/// `tool_choice` as the chat endpoint's, and `parallel_tool_calls` when it says.
fn translate_tool_choice(choice: &Value) -> Result<(Value, Option<bool>), ApiError> {
    let bad = |message: String| ApiError::invalid(message).param("tool_choice");
    let parallel = choice
        .get("disable_parallel_tool_use")
        .and_then(Value::as_bool)
        .map(|disable| !disable);
    let choice = match choice.get("type").and_then(Value::as_str) {
        Some("auto") => json!("auto"),
        Some("any") => json!("required"),
        Some("none") => json!("none"),
        Some("tool") => {
            let name = choice
                .get("name")
                .and_then(Value::as_str)
                .ok_or_else(|| bad("tool_choice of type tool needs a name".into()))?;
            json!({"type": "function", "function": {"name": name}})
        }
        other => {
            return Err(bad(format!(
                "tool_choice type {other:?} is not auto, any, tool or none"
            )))
        }
    };
    Ok((choice, parallel))
}

/// Anthropic's `stop_reason` for how generation ended.
pub fn stop_reason(length: bool, stop_sequence: Option<&str>, called: bool) -> &'static str {
    match (length, stop_sequence, called) {
        (true, _, _) => "max_tokens",
        (false, _, true) => "tool_use",
        (false, Some(_), false) => "stop_sequence",
        (false, None, false) => "end_turn",
    }
}

/// The error body Anthropic's clients read, for an error of `status` with `message`.
pub fn error_body(status: u16, message: &str) -> Value {
    let kind = match status {
        400 | 408 | 422 => "invalid_request_error",
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 | 529 => "overloaded_error",
        _ => "api_error",
    };
    json!({"type": "error", "error": {"type": kind, "message": message}})
}

#[cfg(test)]
mod tests;
