use std::sync::Arc;

use baton_grammar::{Grammar, Matcher, TokenTable};

use baton_engine::EndCheck;

use super::*;
use crate::reasoning::{FirstCallEnds, ReasoningFormat, Start};

/// Feeds `pieces` one at a time; returns everything released, in order.
fn parse(format: ToolFormat, pieces: &[&str]) -> Vec<Out> {
    let mut parser = ToolParser::new(format, true);
    let mut out: Vec<Out> = pieces.iter().flat_map(|p| parser.push(p)).collect();
    out.extend(parser.finish());
    merged(out)
}

/// Adjacent content pieces read as one.
fn merged(out: Vec<Out>) -> Vec<Out> {
    let mut merged: Vec<Out> = Vec::new();
    for item in out {
        match (merged.last_mut(), item) {
            (Some(Out::Content(a)), Out::Content(b)) => a.push_str(&b),
            (Some(Out::Reasoning(a)), Out::Reasoning(b)) => a.push_str(&b),
            (_, item) => merged.push(item),
        }
    }
    merged
}

fn call(name: &str, arguments: &str) -> Out {
    Out::Call(ToolCall {
        name: name.into(),
        arguments: arguments.into(),
    })
}

fn content(text: &str) -> Out {
    Out::Content(text.into())
}

/// Every split of `text` into two pieces gives the same result as the whole.
fn same_for_every_split(format: ToolFormat, text: &str) -> Vec<Out> {
    let whole = parse(format, &[text]);
    for (at, _) in text.char_indices() {
        assert_eq!(
            parse(format, &[&text[..at], &text[at..]]),
            whole,
            "split at {at} of {text:?}"
        );
    }
    whole
}

#[test]
fn hermes_calls_are_parsed_across_any_split() {
    let text =
        "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n\
                <tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>\n";
    assert_eq!(
        same_for_every_split(ToolFormat::Hermes, text),
        [
            content("Let me check."),
            call("get_weather", r#"{"city":"Paris"}"#),
            call("get_time", "{}"),
        ]
    );
}

#[test]
fn text_that_is_not_a_call_stays_content() {
    for text in [
        "Use <tool_call> tags like this: <tool_call>not json</tool_call> ok",
        "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 1}",
        "A < B and <tool_",
    ] {
        let out = same_for_every_split(ToolFormat::Hermes, text);
        let joined: String = out
            .iter()
            .map(|o| match o {
                Out::Content(t) => t.clone(),
                other => panic!("{text:?}: unexpected {other:?}"),
            })
            .collect();
        assert_eq!(joined, text);
    }
    // An unterminated block that parses is still a call (the model stopped early).
    assert_eq!(
        parse(
            ToolFormat::Hermes,
            &["<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 1}}"]
        ),
        [call("f", r#"{"a":1}"#)]
    );
}

#[test]
fn llama3_and_mistral_calls_are_the_whole_answer() {
    assert_eq!(
        same_for_every_split(
            ToolFormat::Llama3,
            "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Oslo\"}}; {\"name\": \"f\", \"parameters\": {}}"
        ),
        [call("get_weather", r#"{"city":"Oslo"}"#), call("f", "{}")]
    );
    assert_eq!(
        same_for_every_split(ToolFormat::Llama3, "Hello {there}"),
        [content("Hello {there}")]
    );
    assert_eq!(
        same_for_every_split(ToolFormat::Llama3, "{not a call}"),
        [content("{not a call}")]
    );
    assert_eq!(
        same_for_every_split(
            ToolFormat::Mistral,
            "[TOOL_CALLS][{\"name\": \"a\", \"arguments\": {\"x\": 1}}, {\"name\": \"b\", \"arguments\": \"{\\\"y\\\": 2}\"}]"
        ),
        [call("a", r#"{"x":1}"#), call("b", r#"{"y":2}"#)]
    );
    assert_eq!(
        same_for_every_split(ToolFormat::Mistral, "[TOOL_CALLS]get_weather[ARGS]{\"city\": \"Rome\"}"),
        [call("get_weather", r#"{"city":"Rome"}"#)]
    );
    assert_eq!(
        same_for_every_split(ToolFormat::Mistral, "[1, 2] are numbers"),
        [content("[1, 2] are numbers")]
    );
}

#[test]
fn harmony_channels_become_reasoning_content_and_calls() {
    let text = "<|channel|>analysis<|message|>Need weather.<|start|>assistant<|channel|>commentary \
                to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Lima\"}";
    assert_eq!(
        same_for_every_split(ToolFormat::Harmony, text),
        [
            Out::Reasoning("Need weather.".into()),
            call("get_weather", r#"{"city":"Lima"}"#)
        ]
    );
    // Without tools the final channel streams as content, token by token.
    let answer = "<|channel|>analysis<|message|>Easy.<|start|>assistant<|channel|>final<|message|>Four.";
    assert_eq!(
        same_for_every_split(ToolFormat::Harmony, answer),
        [Out::Reasoning("Easy.".into()), content("Four.")]
    );
    let mut parser = ToolParser::new(ToolFormat::Harmony, false);
    assert_eq!(
        parser.push(&answer[..answer.len() - 3]),
        [Out::Reasoning("Easy.".into()), content("Fo")]
    );
    assert_eq!(parser.push("ur."), [content("ur.")]);
    assert_eq!(parse(ToolFormat::Harmony, &["plain"]), [content("plain")]);
}

#[test]
fn formats_are_detected_from_templates() {
    for (template, format) in [
        (
            "{{ '<|im_start|>' }}{% if tools %}<tools></tools><tool_call>{% endif %}",
            ToolFormat::Hermes,
        ),
        ("<|start_header_id|>ipython{% if tools %}", ToolFormat::Llama3),
        ("[AVAILABLE_TOOLS]{{ tools }}[TOOL_CALLS]", ToolFormat::Mistral),
        ("<|start|>{{ role }}<|channel|>", ToolFormat::Harmony),
        ("{{ messages }}", ToolFormat::Hermes),
    ] {
        assert_eq!(ToolFormat::detect(template), format, "{template}");
    }
}

/// Characters as tokens, so that forced grammars can be walked by text.
fn chars() -> TokenTable {
    let mut tokens: Vec<(Vec<u8>, bool)> = (0u8..128).map(|b| (vec![b], false)).collect();
    tokens.push((Vec::new(), false)); // 128: a control token ([TOOL_CALLS])
    tokens.push((Vec::new(), true)); // 129: end
    TokenTable::new(tokens)
}

fn takes(grammar: &str, tokens: &[u32]) -> bool {
    let table = chars();
    let mut m = Matcher::new(Arc::new(
        Grammar::parse(grammar).unwrap_or_else(|e| panic!("{e}\n{grammar}")),
    ))
    .unwrap();
    tokens.iter().all(|&t| m.accept(t, &table).is_ok()) && m.is_complete()
}

fn text(s: &str) -> Vec<u32> {
    s.bytes().map(u32::from).collect()
}

#[test]
fn forced_grammars_take_exactly_calls_in_the_format() {
    let tools = functions(&[
        json!({"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
            "properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": false}}}),
        json!({"type": "function", "function": {"name": "ping"}}),
    ])
    .unwrap();
    let hermes = forced_grammar(ToolFormat::Hermes, &tools, true, None).unwrap();
    let one = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
    let two = format!("{one}\n<tool_call>\n{{\"name\": \"ping\", \"arguments\": {{}}}}\n</tool_call>");
    assert!(takes(&hermes, &text(one)));
    assert!(takes(&hermes, &text(&two)));
    assert!(!takes(&hermes, &text("Sure! <tool_call>")));
    assert!(!takes(&hermes, &text(&one.replace("city", "town"))));
    let single = forced_grammar(ToolFormat::Hermes, &tools, false, None).unwrap();
    assert!(takes(&single, &text(one)) && !takes(&single, &text(&two)));
    assert_eq!(parse(ToolFormat::Hermes, &[&two]).len(), 2);

    let llama = forced_grammar(ToolFormat::Llama3, &tools[1..], false, None).unwrap();
    assert!(takes(
        &llama,
        &text("{\"name\": \"ping\", \"parameters\": {\"any\": [1]}}")
    ));

    let mistral = forced_grammar(ToolFormat::Mistral, &tools, true, Some(128)).unwrap();
    let mut tokens = vec![128];
    tokens.extend(text("[{\"name\": \"ping\", \"arguments\": {}}]"));
    assert!(takes(&mistral, &tokens));
    assert!(!takes(&mistral, &tokens[1..]), "the control token comes first");

    let harmony = forced_grammar(ToolFormat::Harmony, &tools[..1], false, None).unwrap();
    let call_text = "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"X\"}";
    assert!(takes(&harmony, &text(call_text)));
    assert_eq!(
        parse(ToolFormat::Harmony, &[call_text]),
        [call("get_weather", r#"{"city":"X"}"#)]
    );
}

#[test]
fn bad_tools_are_refused_naming_the_entry() {
    for (tools, needle) in [
        (json!([{"type": "retrieval"}]), "tools[0]: type"),
        (json!([{"type": "function", "function": {}}]), "tools[0]: function.name"),
        (
            json!([{"type": "function", "function": {"name": "a b"}}]),
            "only letters",
        ),
        (
            json!([{"type": "function", "function": {"name": "a", "parameters": 3}}]),
            "JSON Schema object",
        ),
        (
            json!([{"type": "function", "function": {"name": "a"}}, {"type": "function", "function": {"name": "a"}}]),
            "tools[1]: function names must be unique",
        ),
    ] {
        let err = functions(tools.as_array().unwrap()).unwrap_err();
        assert!(err.message().contains(needle), "{}", err.message());
        assert_eq!(err.field(), Some("tools"));
    }
    let tools = functions(&[
        json!({"type": "function", "function": {"name": "f", "parameters": {"type": "object",
        "properties": {"x": {"type": "string", "pattern": "a+"}}}}}),
    ])
    .unwrap();
    let err = forced_grammar(ToolFormat::Hermes, &tools, true, None).unwrap_err();
    assert!(
        err.message().contains("tool 'f' parameters") && err.message().contains("pattern"),
        "{}",
        err.message()
    );
}

/// Feeds `pieces` as the engine would with `parallel_tool_calls: false`: each to the
/// end check and then to the response's parser, stopping after the piece that ends
/// generation. Returns what was released and how many pieces were generated.
fn one_call(format: ToolFormat, pieces: &[&str]) -> (Vec<Out>, usize) {
    let mut ends = FirstCallEnds::new(format, ReasoningFormat::Separate, Start::Open);
    let mut parser = ToolParser::new(format, true).one_call(true);
    let mut out = Vec::new();
    let mut generated = 0;
    for piece in pieces {
        generated += 1;
        let end = ends.ends_after(piece);
        out.extend(parser.push(piece));
        if end {
            break;
        }
    }
    out.extend(parser.finish());
    out.retain(|o| !matches!(o, Out::Content(text) if text.is_empty()));
    (merged(out), generated)
}

#[test]
fn with_one_call_generation_ends_at_the_token_that_completes_the_first_call() {
    use ToolFormat::{Harmony, Hermes, Llama3, Mistral};
    let weather = || call("get_weather", r#"{"city":"Paris"}"#);
    // Format, the pieces the model would write, what comes back, and how many pieces
    // are generated before the end.
    let cases: Vec<(ToolFormat, Vec<&str>, Vec<Out>, usize)> = vec![
        // Hermes: the second block is never generated.
        (
            Hermes,
            vec![
                "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", ",
                "\"arguments\": {\"city\": \"Paris\"}}\n</tool_",
                "call>\n",
                "<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>",
            ],
            vec![content("Let me check."), weather()],
            3,
        ),
        // A block that is not a call is content, and the model may still write one.
        (
            Hermes,
            vec![
                "<tool_call>oops</tool_call>",
                " <tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>",
                "never",
            ],
            vec![content("<tool_call>oops</tool_call>"), weather()],
            2,
        ),
        // Text in the same piece after the call is content, not lost; no second call.
        (
            Hermes,
            vec!["<tool_call>{\"name\": \"a\", \"arguments\": {}}</tool_call> and <tool_call>{\"name\": \"b\"}</tool_call>"],
            vec![call("a", "{}"), content(" and <tool_call>{\"name\": \"b\"}</tool_call>")],
            1,
        ),
        // Llama 3: the first object, as soon as it closes.
        (
            Llama3,
            vec![
                "{\"name\": \"get_weather\", \"parameters\": {\"city\": ",
                "\"Paris\"}}",
                "; {\"name\": \"f\", \"parameters\": {}}",
            ],
            vec![weather()],
            2,
        ),
        (Llama3, vec!["{not", " a call}", " at all"], vec![content("{not a call} at all")], 3),
        // Mistral: the list's first call (its separator is the list's), or name[ARGS]{…}.
        (
            Mistral,
            vec![
                "[TOOL_",
                "CALLS][{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}",
                ", {\"name\": \"b\", \"arguments\": {}}]",
            ],
            vec![weather()],
            2,
        ),
        (
            Mistral,
            vec!["[TOOL_CALLS][{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}]"],
            vec![weather()],
            1,
        ),
        (
            Mistral,
            vec!["[TOOL_CALLS]get_weather[ARGS]{\"city\": ", "\"Paris\"}", "[TOOL_CALLS]f[ARGS]{}"],
            vec![weather()],
            2,
        ),
        (Mistral, vec!["[1, 2] are numbers"], vec![content("[1, 2] are numbers")], 1),
        // Harmony: the call ends with its message; later channels are still channels.
        (
            Harmony,
            vec![
                "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Paris\"}",
                "<|start|>assistant",
                "<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{}",
            ],
            vec![weather()],
            2,
        ),
    ];
    for (format, pieces, expected, generated) in cases {
        assert_eq!(
            one_call(format, &pieces),
            (expected, generated),
            "{format:?} {pieces:?}"
        );
    }
}

#[test]
fn with_one_call_a_whole_answer_parses_as_its_pieces_do() {
    // The response's parser gets a whole answer at once when it is not streamed.
    let text = "Sure.\n<tool_call>\n{\"name\": \"a\", \"arguments\": {\"x\": 1}}\n</tool_call>\n";
    let mut whole = ToolParser::new(ToolFormat::Hermes, true).one_call(true);
    let mut out = whole.push(text);
    out.extend(whole.finish());
    assert_eq!(out, [content("Sure."), call("a", r#"{"x":1}"#)]);
    for (at, _) in text.char_indices() {
        let (pieces, _) = one_call(ToolFormat::Hermes, &[&text[..at], &text[at..]]);
        assert_eq!(pieces, out, "split at {at}");
    }
}
