//! OpenAI's Responses API (`POST /v1/responses`) in terms of the chat endpoint, as
//! `crate::anthropic` does for Anthropic's: the request becomes the chat request it
//! means and is checked by the same code; `api/responses.rs` answers in the Responses
//! shapes.
//!
//! Supported: `input` (text, or items: messages with text parts, `function_call` and
//! `function_call_output`), `instructions`, `max_output_tokens`, `temperature`, `top_p`,
//! `stream`, function `tools`, `tool_choice`, `parallel_tool_calls`, `text.format`
//! (`text`, `json_object`, `json_schema`), `reasoning.effort` (the chat endpoint's
//! `reasoning_effort`: the template's `reasoning_effort`, and `none` or `minimal` turn
//! its `enable_thinking` off); `reasoning` input items are accepted and dropped
//! (templates show a model only its answers of earlier turns). Refused with a 400 that
//! names the field: `previous_response_id` and `conversation` (the server keeps no
//! responses), images and files, tools other than functions. `store`, `metadata`,
//! `reasoning.summary`, `include`, `truncation` and `user` are ignored.

use serde_json::{json, Map, Value};

use crate::api::ApiError;

/// The chat request that Responses request `body` asks for.
pub fn to_chat(body: &Value) -> Result<Value, ApiError> {
    let object = body
        .as_object()
        .ok_or_else(|| ApiError::invalid("the request body must be a JSON object"))?;
    for key in ["previous_response_id", "conversation"] {
        if object.get(key).is_some_and(|v| !v.is_null()) {
            return Err(ApiError::invalid(format!(
                "{key} is not supported: this server keeps no responses; send the whole conversation as input"
            ))
            .param(key));
        }
    }
    let mut chat = Map::new();
    // `grammar` is the chat endpoint's extension, as llama.cpp's server takes it.
    for key in [
        "model",
        "temperature",
        "top_p",
        "stream",
        "parallel_tool_calls",
        "grammar",
    ] {
        if let Some(value) = object.get(key).filter(|v| !v.is_null()) {
            chat.insert(key.into(), value.clone());
        }
    }
    if let Some(effort) = body.pointer("/reasoning/effort").filter(|v| !v.is_null()) {
        chat.insert("reasoning_effort".into(), effort.clone());
    }
    if let Some(max) = object.get("max_output_tokens").filter(|v| !v.is_null()) {
        chat.insert("max_tokens".into(), max.clone());
    }
    let mut messages = Vec::new();
    if let Some(instructions) = object.get("instructions").and_then(Value::as_str) {
        messages.push(json!({"role": "system", "content": instructions}));
    }
    match object.get("input") {
        Some(Value::String(text)) => messages.push(json!({"role": "user", "content": text})),
        Some(Value::Array(items)) => {
            for item in items {
                add_item(&mut messages, item)?;
            }
        }
        _ => return Err(ApiError::invalid("input must be text or a list of items").param("input")),
    }
    chat.insert("messages".into(), Value::Array(messages));
    if let Some(tools) = object.get("tools").filter(|v| !v.is_null()) {
        let tools = tools
            .as_array()
            .ok_or_else(|| ApiError::invalid("tools must be a list").param("tools"))?;
        let functions = tools.iter().map(translate_tool).collect::<Result<Vec<_>, _>>()?;
        chat.insert("tools".into(), Value::Array(functions));
    }
    if let Some(choice) = object.get("tool_choice").filter(|v| !v.is_null()) {
        let choice = match choice {
            Value::String(_) => choice.clone(),
            _ => match (choice.get("type").and_then(Value::as_str), choice.get("name")) {
                (Some("function"), Some(name)) => json!({"type": "function", "function": {"name": name}}),
                _ => {
                    return Err(
                        ApiError::invalid("tool_choice must be auto, none, required or a function by name")
                            .param("tool_choice"),
                    )
                }
            },
        };
        chat.insert("tool_choice".into(), choice);
    }
    if let Some(format) = body.pointer("/text/format").filter(|v| !v.is_null()) {
        chat.insert("response_format".into(), translate_format(format)?);
    }
    Ok(Value::Object(chat))
}

/// Adds input item `item` to the chat messages: a message, or a call (joined to the
/// assistant message before it when that one carries calls already), or a call's output.
fn add_item(messages: &mut Vec<Value>, item: &Value) -> Result<(), ApiError> {
    let bad = |message: String| ApiError::invalid(message).param("input");
    match item.get("type").and_then(Value::as_str).unwrap_or("message") {
        "message" => {
            let role = item.get("role").and_then(Value::as_str).unwrap_or_default();
            if !matches!(role, "user" | "assistant" | "system" | "developer") {
                return Err(bad(format!(
                    "message role '{role}' is not user, assistant, system or developer"
                )));
            }
            let content = match item.get("content") {
                Some(Value::String(text)) => text.clone(),
                Some(Value::Array(parts)) => {
                    let mut text = String::new();
                    for part in parts {
                        match part.get("type").and_then(Value::as_str).unwrap_or_default() {
                            "input_text" | "output_text" | "text" => {
                                text.push_str(part.get("text").and_then(Value::as_str).unwrap_or_default())
                            }
                            other => {
                                return Err(bad(format!(
                                    "content parts of type '{other}' are not supported (input_text and output_text are)"
                                )))
                            }
                        }
                    }
                    text
                }
                _ => return Err(bad("a message's content must be text or a list of parts".into())),
            };
            messages.push(json!({"role": role, "content": content}));
        }
        "function_call" => {
            let call = json!({
                "id": item.get("call_id").cloned().unwrap_or(Value::Null),
                "type": "function",
                "function": {
                    "name": item.get("name").cloned().unwrap_or(Value::Null),
                    "arguments": item.get("arguments").cloned().unwrap_or_else(|| json!("{}")),
                },
            });
            match messages.last_mut() {
                Some(last) if last["role"] == "assistant" && last.get("tool_calls").is_some() => {
                    if let Some(calls) = last["tool_calls"].as_array_mut() {
                        calls.push(call);
                    }
                }
                _ => messages.push(json!({"role": "assistant", "content": "", "tool_calls": [call]})),
            }
        }
        // The model's own earlier reasoning: templates drop it from earlier turns.
        "reasoning" => {}
        "function_call_output" => {
            let output = match item.get("output") {
                Some(Value::String(text)) => text.clone(),
                Some(other) => other.to_string(),
                None => String::new(),
            };
            messages.push(json!({
                "role": "tool",
                "tool_call_id": item.get("call_id").cloned().unwrap_or(Value::Null),
                "content": output,
            }));
        }
        other => return Err(bad(format!("input items of type '{other}' are not supported"))),
    }
    Ok(())
}

fn translate_tool(tool: &Value) -> Result<Value, ApiError> {
    let kind = tool.get("type").and_then(Value::as_str).unwrap_or_default();
    if kind != "function" {
        return Err(
            ApiError::invalid(format!("tools of type '{kind}' are not supported (function is)")).param("tools"),
        );
    }
    let mut function = Map::new();
    for key in ["name", "description", "parameters"] {
        if let Some(value) = tool.get(key).filter(|v| !v.is_null()) {
            function.insert(key.into(), value.clone());
        }
    }
    Ok(json!({"type": "function", "function": function}))
}

/// `text.format` as the chat endpoint's `response_format`.
fn translate_format(format: &Value) -> Result<Value, ApiError> {
    match format.get("type").and_then(Value::as_str) {
        Some("text") => Ok(json!({"type": "text"})),
        Some("json_object") => Ok(json!({"type": "json_object"})),
        Some("json_schema") => {
            let schema = format
                .get("schema")
                .ok_or_else(|| ApiError::invalid("text.format json_schema needs a schema").param("text"))?;
            Ok(json!({"type": "json_schema", "json_schema": {"name": format.get("name"), "schema": schema}}))
        }
        other => Err(ApiError::invalid(format!(
            "text.format type {other:?} is not text, json_object or json_schema"
        ))
        .param("text")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn items_become_the_chat_conversation_they_mean() {
        let body = json!({
            "model": "m", "instructions": "Be brief.", "max_output_tokens": 50, "temperature": 0,
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris and Rome?"}]},
                {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": "{\"city\":\"Paris\"}"},
                {"type": "function_call", "call_id": "c2", "name": "weather", "arguments": "{\"city\":\"Rome\"}"},
                {"type": "function_call_output", "call_id": "c1", "output": "18 C"},
                {"type": "function_call_output", "call_id": "c2", "output": "21 C"},
            ],
            "tools": [{"type": "function", "name": "weather", "parameters": {"type": "object"}, "strict": true}],
            "tool_choice": {"type": "function", "name": "weather"},
            "text": {"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}}},
        });
        let call = |id: &str, city: &str| json!({"id": id, "type": "function", "function": {"name": "weather", "arguments": format!("{{\"city\":\"{city}\"}}")}});
        assert_eq!(
            to_chat(&body).unwrap(),
            json!({
                "model": "m", "max_tokens": 50, "temperature": 0,
                "messages": [
                    {"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "Weather in Paris and Rome?"},
                    {"role": "assistant", "content": "", "tool_calls": [call("c1", "Paris"), call("c2", "Rome")]},
                    {"role": "tool", "tool_call_id": "c1", "content": "18 C"},
                    {"role": "tool", "tool_call_id": "c2", "content": "21 C"},
                ],
                "tools": [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}],
                "tool_choice": {"type": "function", "function": {"name": "weather"}},
                "response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "object"}}},
            })
        );
        assert_eq!(
            to_chat(&json!({"input": "hi"})).unwrap(),
            json!({"messages": [{"role": "user", "content": "hi"}]})
        );
        let reasoning = json!({
            "input": [
                {"role": "user", "content": "hi"},
                {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Greet."}]},
                {"role": "assistant", "content": [{"type": "output_text", "text": "Hello."}]},
            ],
            "reasoning": {"effort": "minimal", "summary": "auto"},
        });
        assert_eq!(
            to_chat(&reasoning).unwrap(),
            json!({
                "reasoning_effort": "minimal",
                "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello."}],
            })
        );
    }

    #[test]
    fn what_is_not_supported_is_refused_by_name() {
        let refused = |body: Value, field: &str| {
            let e = to_chat(&body).unwrap_err();
            assert_eq!(e.field(), Some(field), "{body}: {}", e.message());
        };
        refused(
            json!({"input": "hi", "previous_response_id": "resp_1"}),
            "previous_response_id",
        );
        refused(
            json!({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}),
            "input",
        );
        refused(json!({"input": "hi", "tools": [{"type": "web_search"}]}), "tools");
        refused(json!({"input": "hi", "text": {"format": {"type": "xml"}}}), "text");
        refused(json!({"input": 5}), "input");
    }
}
