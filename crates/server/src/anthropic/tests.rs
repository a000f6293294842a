use serde_json::json;

use super::*;

#[test]
fn a_request_becomes_the_chat_request_it_means() {
    let body = json!({
        "model": "m", "max_tokens": 64, "temperature": 0, "top_k": 5, "stop_sequences": ["END"], "stream": true,
        "system": [{"type": "text", "text": "Be brief."}],
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [
                {"type": "text", "text": "Let me look."},
                {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Paris"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "18 C"}]},
                {"type": "text", "text": "And tomorrow?"}]},
        ],
        "tools": [{"name": "weather", "description": "Weather now", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": true},
    });
    let chat = to_chat(&body).unwrap();
    assert_eq!(
        chat,
        json!({
            "model": "m", "max_tokens": 64, "temperature": 0, "top_k": 5, "stop": ["END"], "stream": true,
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "Let me look.", "tool_calls": [
                    {"id": "toolu_1", "type": "function", "function": {"name": "weather", "arguments": "{\"city\":\"Paris\"}"}}]},
                {"role": "tool", "tool_call_id": "toolu_1", "content": "18 C"},
                {"role": "user", "content": "And tomorrow?"},
            ],
            "tools": [{"type": "function", "function": {"name": "weather", "description": "Weather now", "parameters": {"type": "object"}}}],
            "tool_choice": "required",
            "parallel_tool_calls": false,
        })
    );
    let named =
        to_chat(&json!({"max_tokens": 1, "messages": [], "tool_choice": {"type": "tool", "name": "weather"}})).unwrap();
    assert_eq!(
        named["tool_choice"],
        json!({"type": "function", "function": {"name": "weather"}})
    );
}

#[test]
fn what_is_not_supported_is_refused_by_name() {
    let refused = |body: Value, field: &str, says: &str| {
        let e = to_chat(&body).unwrap_err();
        assert_eq!(e.field(), Some(field), "{body}");
        assert!(e.message().contains(says), "{}", e.message());
    };
    let user = |content: Value| json!({"max_tokens": 8, "messages": [{"role": "user", "content": content}]});
    refused(json!({"messages": []}), "max_tokens", "required");
    refused(user(json!([{"type": "image", "source": {}}])), "messages", "'image'");
    refused(
        user(json!([{"type": "tool_use", "id": "x", "name": "f", "input": {}}])),
        "messages",
        "user message cannot hold",
    );
    refused(
        json!({"max_tokens": 8, "messages": [{"role": "system", "content": "x"}]}),
        "messages",
        "role 'system'",
    );
    refused(
        json!({"max_tokens": 8, "messages": [], "tools": [{"type": "web_search_20250305", "name": "web_search"}]}),
        "tools",
        "web_search",
    );
    refused(
        json!({"max_tokens": 8, "messages": [], "tool_choice": {"type": "sometimes"}}),
        "tool_choice",
        "sometimes",
    );
    refused(
        json!({"max_tokens": 8, "messages": [], "thinking": {"type": "sometimes"}}),
        "thinking",
        "enabled, adaptive or disabled",
    );
    refused(
        json!({"max_tokens": 8, "messages": [], "thinking": {"type": "enabled", "budget_tokens": "lots"}}),
        "thinking",
        "budget_tokens",
    );
    refused(
        json!({"max_tokens": 8, "messages": [], "system": [{"type": "image"}]}),
        "system",
        "'image'",
    );
}

#[test]
fn stop_reasons_and_errors_in_anthropics_terms() {
    assert_eq!(stop_reason(true, None, false), "max_tokens");
    assert_eq!(stop_reason(false, None, true), "tool_use");
    assert_eq!(stop_reason(false, Some("END"), false), "stop_sequence");
    assert_eq!(stop_reason(false, None, false), "end_turn");
    assert_eq!(error_body(400, "bad")["error"]["type"], "invalid_request_error");
    assert_eq!(error_body(503, "busy")["error"]["type"], "overloaded_error");
    assert_eq!(
        error_body(500, "x"),
        json!({"type": "error", "error": {"type": "api_error", "message": "x"}})
    );
}

/// `thinking` becomes the template's `enable_thinking`; thinking the model wrote in an
/// earlier turn is dropped, not refused.
#[test]
fn thinking_turns_the_templates_switch() {
    let body = |thinking: Value| {
        json!({"max_tokens": 8, "thinking": thinking, "messages": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "Greet back.", "signature": "s"},
                {"type": "text", "text": "Hello."}]},
            {"role": "user", "content": "Bye"},
        ]})
    };
    let enabled = body(json!({"type": "enabled", "budget_tokens": 1024}));
    let chat = to_chat(&enabled).unwrap();
    assert_eq!(chat["chat_template_kwargs"], json!({"enable_thinking": true}));
    assert_eq!(chat["messages"][1], json!({"role": "assistant", "content": "Hello."}));
    assert_eq!(
        chat["thinking_budget_tokens"],
        json!(1024),
        "enabled thinking is limited"
    );
    assert!(!thinking_disabled(&enabled));
    let unbudgeted = to_chat(&body(json!({"type": "enabled"}))).unwrap();
    assert_eq!(
        unbudgeted["thinking_budget_tokens"],
        json!(10_000),
        "llama.cpp's default"
    );
    let adaptive = to_chat(&body(json!({"type": "adaptive", "budget_tokens": 64}))).unwrap();
    assert_eq!(
        adaptive.get("thinking_budget_tokens"),
        None,
        "only enabled thinking is limited"
    );
    let disabled = body(json!({"type": "disabled"}));
    assert_eq!(
        to_chat(&disabled).unwrap()["chat_template_kwargs"],
        json!({"enable_thinking": false})
    );
    assert!(thinking_disabled(&disabled));
    let absent = to_chat(&json!({"max_tokens": 8, "messages": []})).unwrap();
    assert_eq!(absent.get("chat_template_kwargs"), None);
}
