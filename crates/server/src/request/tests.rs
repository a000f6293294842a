//! Request bodies: what a good one becomes, and the status, field and message of each
//! refusal.

use axum::http::StatusCode;
use serde_json::json;

use super::*;

const MODEL: &str = "qwen2.5-coder-0.5b-instruct-q4_k_m";
const N_VOCAB: usize = 151_936;

fn chat_err(body: &str) -> (StatusCode, Option<&'static str>, String) {
    let err = chat(body.as_bytes(), MODEL).expect_err(body);
    (err.status(), err.field(), err.message().to_string())
}

fn completion_err(body: &str) -> (StatusCode, Option<&'static str>, String) {
    let err = completion(body.as_bytes(), MODEL, N_VOCAB).expect_err(body);
    (err.status(), err.field(), err.message().to_string())
}

#[test]
fn a_chat_request_from_the_openai_reference_is_accepted() {
    let body = json!({
        "model": MODEL,
        "messages": [
            {"role": "developer", "content": "You are a helpful assistant."},
            {"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "!"}]},
            {"role": "assistant", "content": null},
        ],
        "temperature": 0.2,
        "top_p": 0.9,
        "seed": 7,
        "max_completion_tokens": 16,
        "stop": "\n\n",
        "logprobs": true,
        "top_logprobs": 3,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    let req = chat(body.to_string().as_bytes(), MODEL).unwrap();
    let messages: Vec<_> = req
        .messages
        .iter()
        .map(|m| (m.role.as_str(), m.content.as_str()))
        .collect();
    assert_eq!(
        messages,
        [
            ("system", "You are a helpful assistant."),
            ("user", "Hello!"),
            ("assistant", "")
        ]
    );
    let g = req.generation;
    assert_eq!((g.params.temperature, g.params.top_p, g.params.seed), (0.2, 0.9, 7));
    assert_eq!(g.stop, ["\n\n"]);
    assert_eq!(g.max_tokens, Some(16));
    assert_eq!(
        (g.logprobs, g.top_logprobs, g.stream, g.include_usage),
        (true, 3, true, true)
    );
}

#[test]
fn a_completion_request_takes_text_one_text_or_tokens() {
    let prompt = |value: serde_json::Value| {
        let body = json!({"model": MODEL, "prompt": value, "max_tokens": 4, "logprobs": 2});
        let req = completion(body.to_string().as_bytes(), MODEL, N_VOCAB).unwrap();
        assert_eq!(req.generation.max_tokens, Some(4));
        assert_eq!((req.generation.logprobs, req.generation.top_logprobs), (true, 2));
        req.prompt
    };
    assert_eq!(
        prompt(json!("Say this is a test")),
        CompletionPrompt::Text("Say this is a test".into())
    );
    assert_eq!(prompt(json!(["once"])), CompletionPrompt::Text("once".into()));
    assert_eq!(prompt(json!([1, 2, 3])), CompletionPrompt::Tokens(vec![1, 2, 3]));
}

#[test]
fn chat_refusals_name_the_field() {
    let user = json!([{"role": "user", "content": "x"}]);
    let with = |extra: serde_json::Value| {
        let mut body = json!({"messages": user});
        body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        body.to_string()
    };
    let cases: Vec<(String, StatusCode, Option<&str>, &str)> = vec![
        ("{not json".into(), StatusCode::BAD_REQUEST, None, "malformed JSON"),
        (
            r#"{"messages": "hi"}"#.into(),
            StatusCode::BAD_REQUEST,
            None,
            "invalid request",
        ),
        (
            r#"{"messages": []}"#.into(),
            StatusCode::BAD_REQUEST,
            Some("messages"),
            "must not be empty",
        ),
        (
            json!({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}).to_string(),
            StatusCode::BAD_REQUEST,
            Some("messages"),
            "'image_url' are not supported",
        ),
        (
            with(json!({"top_logprobs": 2})),
            StatusCode::BAD_REQUEST,
            Some("top_logprobs"),
            "requires logprobs",
        ),
        (
            with(json!({"logprobs": true, "top_logprobs": 21})),
            StatusCode::BAD_REQUEST,
            Some("top_logprobs"),
            "0 and 20",
        ),
        (
            with(json!({"model": "gpt-4"})),
            StatusCode::NOT_FOUND,
            Some("model"),
            "'gpt-4' does not exist",
        ),
        (with(json!({"n": 2})), StatusCode::BAD_REQUEST, Some("n"), "n = 1"),
        (
            with(json!({"temperature": 2.5})),
            StatusCode::BAD_REQUEST,
            Some("temperature"),
            "between 0 and 2",
        ),
        (
            with(json!({"top_p": 0})),
            StatusCode::BAD_REQUEST,
            Some("top_p"),
            "(0, 1]",
        ),
        (
            with(json!({"presence_penalty": -3})),
            StatusCode::BAD_REQUEST,
            Some("presence_penalty"),
            "-2 and 2",
        ),
        (
            with(json!({"frequency_penalty": 3})),
            StatusCode::BAD_REQUEST,
            Some("frequency_penalty"),
            "-2 and 2",
        ),
        (
            with(json!({"stop": ["a", "b", "c", "d", "e"]})),
            StatusCode::BAD_REQUEST,
            Some("stop"),
            "at most 4",
        ),
        (with(json!({"min_p": 1.5})), StatusCode::BAD_REQUEST, None, "min_p"),
        (
            with(json!({"max_tokens": 0})),
            StatusCode::BAD_REQUEST,
            Some("max_tokens"),
            "at least 1",
        ),
    ];
    for (body, status, field, needle) in cases {
        let (got_status, got_field, message) = chat_err(&body);
        assert_eq!((got_status, got_field), (status, field), "{body}: {message}");
        assert!(message.contains(needle), "{body}: {message}");
    }
}

#[test]
fn completion_refusals_name_the_field() {
    let cases: Vec<(serde_json::Value, Option<&str>, &str)> = vec![
        (
            json!({"prompt": "x", "echo": true}),
            Some("echo"),
            "echo is not supported",
        ),
        (json!({"prompt": ["a", "b"]}), Some("prompt"), "only one prompt"),
        (json!({"prompt": []}), Some("prompt"), "the prompt is empty"),
        (
            json!({"prompt": [1, 151936]}),
            Some("prompt"),
            "token 151936 is outside the vocabulary of 151936",
        ),
        (
            json!({"prompt": "x", "logprobs": 6}),
            Some("logprobs"),
            "between 0 and 5",
        ),
        (
            json!({"prompt": "x", "max_completion_tokens": 0}),
            Some("max_tokens"),
            "at least 1",
        ),
        (
            json!({"prompt": "x", "temperature": -1}),
            Some("temperature"),
            "between 0 and 2",
        ),
    ];
    for (body, field, needle) in cases {
        let (status, got_field, message) = completion_err(&body.to_string());
        assert_eq!(
            (status, got_field),
            (StatusCode::BAD_REQUEST, field),
            "{body}: {message}"
        );
        assert!(message.contains(needle), "{body}: {message}");
    }
}

fn generation_with_max_tokens(max_tokens: Option<u64>) -> Generation {
    let body = json!({"prompt": "x", "max_tokens": max_tokens});
    completion(body.to_string().as_bytes(), MODEL, N_VOCAB)
        .unwrap()
        .generation
}

#[test]
fn fit_slot_gives_the_rest_of_the_slot_or_refuses() {
    let fit = |max_tokens, prompt_len| fit_slot(&generation_with_max_tokens(max_tokens), prompt_len, 512);
    assert_eq!(fit(None, 12).unwrap(), 500);
    assert_eq!(fit(Some(500), 12).unwrap(), 500);
    for (max_tokens, prompt_len) in [(Some(501), 12), (None, 512), (None, 600), (Some(1), 512)] {
        let err = fit(max_tokens, prompt_len).unwrap_err();
        assert_eq!((err.status(), err.field()), (StatusCode::BAD_REQUEST, Some("messages")));
        assert!(
            err.message().contains("context per sequence is 512 tokens"),
            "{}",
            err.message()
        );
    }
}

/// `max_tokens` near 2^64 wrapped the engine's `prompt + max_tokens > slot_ctx` check
/// (release builds do not check overflow), so the request was accepted and generated
/// until its sequence's KV region was full, where the stage's error fails the whole
/// step: every other request batched with it.
#[test]
fn max_tokens_near_u64_max_is_too_long_not_wrapped() {
    for max_tokens in [u64::MAX, u64::MAX - 11, 1 << 63] {
        let err = fit_slot(&generation_with_max_tokens(Some(max_tokens)), 12, 512).unwrap_err();
        assert_eq!(err.status(), StatusCode::BAD_REQUEST);
        assert!(
            err.message().contains(&format!("plus {max_tokens} to generate")),
            "{}",
            err.message()
        );
    }
}

/// Thinking switches: `reasoning_format`, `chat_template_kwargs` (given to the
/// template, `enable_thinking` always among them) and `reasoning_effort`.
#[test]
fn thinking_switches_are_read_and_checked() {
    let chat_of = |extra: serde_json::Value| {
        let mut body = json!({"messages": [{"role": "user", "content": "Hi"}]});
        body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        chat(body.to_string().as_bytes(), MODEL)
    };
    let plain = chat_of(json!({})).unwrap();
    assert_eq!(plain.reasoning, ReasoningFormat::Separate);
    assert_eq!(Value::Object(plain.template_kwargs), json!({"enable_thinking": true}));
    let off = chat_of(json!({"reasoning_format": "none", "chat_template_kwargs": {"enable_thinking": false, "x": 1}}))
        .unwrap();
    assert_eq!(off.reasoning, ReasoningFormat::Inline);
    assert_eq!(
        Value::Object(off.template_kwargs),
        json!({"enable_thinking": false, "x": 1})
    );
    let minimal = chat_of(json!({"reasoning_effort": "minimal"})).unwrap();
    assert_eq!(
        Value::Object(minimal.template_kwargs),
        json!({"reasoning_effort": "low", "enable_thinking": false})
    );
    let high = chat_of(json!({"reasoning_effort": "high"})).unwrap();
    assert_eq!(
        Value::Object(high.template_kwargs),
        json!({"reasoning_effort": "high", "enable_thinking": true})
    );
    let refused = |extra: serde_json::Value, field: &str, says: &str| {
        let e = chat_of(extra.clone()).expect_err(&extra.to_string());
        assert_eq!(e.field(), Some(field), "{extra}");
        assert!(e.message().contains(says), "{}", e.message());
    };
    refused(
        json!({"reasoning_format": "deepseek-legacy"}),
        "reasoning_format",
        "'deepseek-legacy'",
    );
    refused(
        json!({"chat_template_kwargs": {"enable_thinking": "no"}}),
        "chat_template_kwargs",
        "true or false",
    );
    refused(json!({"reasoning_effort": "max"}), "reasoning_effort", "'max'");
    // The thinking budget: llama.cpp's two names, -1 for no limit.
    assert_eq!(plain.reasoning_budget, None);
    let budget = |extra| chat_of(extra).unwrap().reasoning_budget;
    assert_eq!(budget(json!({"reasoning_budget_tokens": 256})), Some(256));
    assert_eq!(budget(json!({"thinking_budget_tokens": 0})), Some(0));
    assert_eq!(budget(json!({"reasoning_budget_tokens": -1})), None);
    refused(
        json!({"reasoning_budget_tokens": -5}),
        "reasoning_budget_tokens",
        "-5 is not -1",
    );
}

/// llama.cpp's `grammar` extension: checked like a response format's, not both at once.
#[test]
fn a_grammar_is_checked_and_not_taken_with_a_response_format() {
    let body = json!({"messages": [{"role": "user", "content": "Hi"}], "grammar": "root ::= \"<think>\" [a-z]+"});
    let req = chat(body.to_string().as_bytes(), MODEL).unwrap();
    assert_eq!(req.generation.grammar.as_deref(), Some("root ::= \"<think>\" [a-z]+"));
    let both = json!({"messages": [{"role": "user", "content": "Hi"}], "grammar": "root ::= \"a\"",
        "response_format": {"type": "json_object"}});
    let (status, field, _) = chat_err(&both.to_string());
    assert_eq!((status, field), (StatusCode::BAD_REQUEST, Some("grammar")));
    let broken = json!({"messages": [{"role": "user", "content": "Hi"}], "grammar": "root ::= ("});
    let (status, field, message) = chat_err(&broken.to_string());
    assert_eq!((status, field), (StatusCode::BAD_REQUEST, Some("grammar")), "{message}");
}

/// `POST /v1/embeddings`: each shape of `input`, the encodings, and each refusal's field.
#[test]
fn embeddings_inputs_are_each_a_sequence_and_refusals_name_the_field() {
    let parse = |body: serde_json::Value| embeddings(body.to_string().as_bytes(), MODEL, N_VOCAB, 896);
    let text = |t: &str| CompletionPrompt::Text(t.into());
    let ok = parse(json!({"input": "hi"})).unwrap();
    assert_eq!(
        ok,
        Embeddings {
            inputs: vec![text("hi")],
            base64: false
        }
    );
    assert_eq!(
        parse(json!({"input": ["a", "b"], "encoding_format": "base64"}))
            .unwrap()
            .inputs,
        vec![text("a"), text("b")]
    );
    assert!(
        parse(json!({"input": "a", "encoding_format": "base64"}))
            .unwrap()
            .base64
    );
    assert_eq!(
        parse(json!({"input": [1, 2]})).unwrap().inputs,
        vec![CompletionPrompt::Tokens(vec![1, 2])]
    );
    assert_eq!(
        parse(json!({"input": [[1], [2, 3]], "model": MODEL, "dimensions": 896, "user": "u"}))
            .unwrap()
            .inputs,
        vec![CompletionPrompt::Tokens(vec![1]), CompletionPrompt::Tokens(vec![2, 3])]
    );
    let refused = |body: serde_json::Value, status: StatusCode, field: Option<&str>, says: &str| {
        let e = parse(body.clone()).expect_err(&body.to_string());
        assert_eq!((e.status(), e.field()), (status, field), "{body}: {}", e.message());
        assert!(e.message().contains(says), "{body}: {}", e.message());
    };
    let bad = StatusCode::BAD_REQUEST;
    refused(json!({"input": []}), bad, Some("input"), "must not be empty");
    refused(json!({"input": ""}), bad, Some("input"), "empty text");
    refused(json!({"input": ["a", ""]}), bad, Some("input"), "empty text");
    refused(json!({"input": [[1], []]}), bad, Some("input"), "no tokens");
    refused(
        json!({"input": [N_VOCAB]}),
        bad,
        Some("input"),
        "outside the vocabulary",
    );
    refused(
        json!({"input": vec!["a"; MAX_EMBEDDING_INPUTS + 1]}),
        bad,
        Some("input"),
        "2049 items",
    );
    refused(
        json!({"input": "a", "encoding_format": "hex"}),
        bad,
        Some("encoding_format"),
        "\"hex\"",
    );
    refused(json!({"input": "a", "dimensions": 64}), bad, Some("dimensions"), "896");
    refused(
        json!({"input": "a", "model": "other"}),
        StatusCode::NOT_FOUND,
        Some("model"),
        "'other'",
    );
    refused(json!({"input": [1, "a"]}), bad, None, "invalid request");
    refused(json!({}), bad, None, "input");
}
