use baton_engine::EndCheck;

use super::*;
use crate::template::{ChatMessage, ChatTemplate};
use crate::tools::ToolCall;

/// Consecutive pieces of the same kind joined, empty ones dropped.
fn joined(pieces: Vec<Piece>) -> Vec<Piece> {
    let mut out: Vec<Piece> = Vec::new();
    for piece in pieces {
        match (out.last_mut(), piece) {
            (_, Piece::Reasoning(t) | Piece::Answer(t)) if t.is_empty() => {}
            (Some(Piece::Reasoning(a)), Piece::Reasoning(b)) | (Some(Piece::Answer(a)), Piece::Answer(b)) => {
                a.push_str(&b)
            }
            (_, piece) => out.push(piece),
        }
    }
    out
}

/// `text` through a splitter in pieces cut at `cuts` (byte offsets on char boundaries).
fn split_at(start: Start, text: &str, cuts: &[usize]) -> Vec<Piece> {
    let mut splitter = ThinkSplitter::new(start);
    let mut out = Vec::new();
    let mut from = 0;
    for &cut in cuts.iter().chain([text.len()].iter()) {
        out.extend(splitter.push(&text[from..cut]));
        from = cut;
    }
    out.extend(splitter.finish());
    joined(out)
}

/// `text` cut everywhere it can be into two and into three pieces, and one char at a
/// time: every way must give `expected`.
fn every_cut(start: Start, text: &str, expected: &[Piece]) {
    let bounds: Vec<usize> = (1..text.len()).filter(|&i| text.is_char_boundary(i)).collect();
    assert_eq!(split_at(start, text, &[]), expected, "whole: {text:?}");
    assert_eq!(split_at(start, text, &bounds), expected, "a char at a time: {text:?}");
    for (n, &a) in bounds.iter().enumerate() {
        assert_eq!(split_at(start, text, &[a]), expected, "cut at {a}: {text:?}");
        for &b in &bounds[n + 1..] {
            assert_eq!(split_at(start, text, &[a, b]), expected, "cut at {a}, {b}: {text:?}");
        }
    }
}

fn reasoning(text: &str) -> Piece {
    Piece::Reasoning(text.into())
}

fn answer(text: &str) -> Piece {
    Piece::Answer(text.into())
}

#[test]
fn tags_split_across_pieces_are_found_and_the_whitespace_around_thinking_dropped() {
    every_cut(
        Start::Open,
        "\n<think>\nThe capital, é.\n\n</think>\n\nParis.\n",
        &[reasoning("The capital, é."), answer("Paris.\n")],
    );
    // A second <think> is the answer's text.
    every_cut(
        Start::Open,
        "<think>a</think>b<think>c",
        &[reasoning("a"), answer("b<think>c")],
    );
}

/// Qwen3's and DeepSeek R1's generation prompt opens `<think>`: the output starts inside.
#[test]
fn output_that_starts_inside_the_thinking_only_closes_it() {
    every_cut(
        Start::InThinking,
        "Short one.\n</think>\n\nFour.",
        &[reasoning("Short one."), answer("Four.")],
    );
    // The model closes at once (Qwen3 with thinking turned off writes nothing inside).
    every_cut(Start::InThinking, "\n\n</think>\n\nFour.", &[answer("Four.")]);
}

#[test]
fn thinking_never_closed_is_all_reasoning() {
    every_cut(
        Start::Open,
        "<think>Still thinking ab",
        &[reasoning("Still thinking ab")],
    );
    every_cut(
        Start::InThinking,
        "Still thinking </thi",
        &[reasoning("Still thinking </thi")],
    );
}

/// Thinking turned off, or a model that does not think: the output is the answer, as
/// it came, leading whitespace and a tag later in the text included.
#[test]
fn output_without_thinking_is_the_answer_untouched() {
    every_cut(
        Start::Open,
        "  Hello <think>x</think>",
        &[answer("  Hello <think>x</think>")],
    );
    every_cut(Start::Open, "<thinking>", &[answer("<thinking>")]);
    every_cut(Start::Open, "<thi", &[answer("<thi")]);
    every_cut(Start::Open, " \n", &[answer(" \n")]);
    // Nothing is held once the output cannot open with <think>.
    let mut splitter = ThinkSplitter::new(Start::Open);
    assert_eq!(splitter.push("<"), []);
    assert_eq!(splitter.push("tool"), [answer("<tool")]);
    assert_eq!(splitter.push("_call>"), [answer("_call>")]);
}

/// A Qwen3-style template: the generation prompt opens `<think>`, or writes an empty
/// thinking with `enable_thinking` false.
const QWEN3_LIKE: &str = "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}\
{%- if add_generation_prompt %}<|im_start|>assistant\n\
{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}\
{%- endif %}";

#[test]
fn enable_thinking_reaches_the_template_and_decides_where_the_output_starts() {
    let template = ChatTemplate::new(Some(QWEN3_LIKE), "", "").unwrap();
    let messages = [ChatMessage::new("user", "2+2?")];
    let render = |kwargs: serde_json::Value| {
        let kwargs = kwargs.as_object().cloned().unwrap_or_default();
        template.render_with_kwargs(&messages, None, &kwargs, true).unwrap()
    };
    let on = render(serde_json::json!({"enable_thinking": true}));
    assert!(on.ends_with("assistant\n<think>\n"), "{on:?}");
    assert_eq!(Start::after(&on), Start::InThinking);
    let off = render(serde_json::json!({"enable_thinking": false}));
    assert!(off.ends_with("<think>\n\n</think>\n\n"), "{off:?}");
    assert_eq!(Start::after(&off), Start::Open);
    // Template variables cannot be replaced by kwargs.
    let kept = render(serde_json::json!({"messages": [], "add_generation_prompt": false}));
    assert_eq!(kept, on);
}

fn outs(splitter: &mut OutputSplitter, pieces: &[&str]) -> Vec<Out> {
    let mut out = Vec::new();
    for piece in pieces {
        out.extend(splitter.push(piece));
    }
    out.extend(splitter.finish());
    let mut merged: Vec<Out> = Vec::new();
    for item in out {
        match (merged.last_mut(), item) {
            (_, Out::Content(t) | Out::Reasoning(t)) if t.is_empty() => {}
            (Some(Out::Content(a)), Out::Content(b)) | (Some(Out::Reasoning(a)), Out::Reasoning(b)) => a.push_str(&b),
            (_, item) => merged.push(item),
        }
    }
    merged
}

const HARMONY: &[&str] = &[
    "<|channel|>analysis",
    "<|message|>Need the",
    " capital.",
    "<|start|>assistant<|channel|>final<|message|>",
    "Paris.",
];

/// gpt-oss: the analysis channel is the reasoning, the final channel the answer; with
/// `reasoning_format: none` both are content, and hidden thinking is dropped.
#[test]
fn harmony_analysis_is_the_reasoning() {
    let split = |reasoning| {
        let mut splitter = OutputSplitter::new(
            ToolFormat::Harmony,
            Some(ToolParser::new(ToolFormat::Harmony, false)),
            reasoning,
            Start::Open,
        )
        .unwrap();
        outs(&mut splitter, HARMONY)
    };
    assert_eq!(
        split(ReasoningFormat::Separate),
        [
            Out::Reasoning("Need the capital.".into()),
            Out::Content("Paris.".into())
        ]
    );
    assert_eq!(
        split(ReasoningFormat::Inline),
        [Out::Content("Need the capital.Paris.".into())]
    );
    assert_eq!(split(ReasoningFormat::Hidden), [Out::Content("Paris.".into())]);
}

const THINK_THEN_CALL: &[&str] = &[
    "<th",
    "ink>Maybe <tool_call>{\"name\": \"no\"}</tool_call>? Yes.</th",
    "ink>\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}",
    "\n</tool_call>",
];

/// A call written while thinking is not a call; the one after the thinking is.
#[test]
fn tool_calls_are_parsed_after_the_thinking_only() {
    let splitter = |reasoning| {
        OutputSplitter::new(
            ToolFormat::Hermes,
            Some(ToolParser::new(ToolFormat::Hermes, true)),
            reasoning,
            Start::Open,
        )
        .unwrap()
    };
    let call = Out::Call(ToolCall {
        name: "get_weather".into(),
        arguments: r#"{"city":"Paris"}"#.into(),
    });
    assert_eq!(
        outs(&mut splitter(ReasoningFormat::Separate), THINK_THEN_CALL),
        [
            Out::Reasoning("Maybe <tool_call>{\"name\": \"no\"}</tool_call>? Yes.".into()),
            call.clone()
        ]
    );
    assert_eq!(outs(&mut splitter(ReasoningFormat::Hidden), THINK_THEN_CALL), [call]);
    // parallel_tool_calls: false ends generation at the call after the thinking.
    let mut ends = FirstCallEnds::new(ToolFormat::Hermes, ReasoningFormat::Separate, Start::Open);
    let ended: Vec<bool> = THINK_THEN_CALL.iter().map(|p| ends.ends_after(p)).collect();
    assert_eq!(ended, [false, false, false, true]);
}

/// `reasoning_format: none`: nothing is split, the tags stay in the content.
#[test]
fn inline_reasoning_leaves_the_text_as_written() {
    assert!(OutputSplitter::new(ToolFormat::Hermes, None, ReasoningFormat::Inline, Start::Open).is_none());
    let mut splitter =
        OutputSplitter::new(ToolFormat::Hermes, None, ReasoningFormat::Separate, Start::InThinking).unwrap();
    assert_eq!(
        outs(&mut splitter, &["Hm.</think>", "Four."]),
        [Out::Reasoning("Hm.".into()), Out::Content("Four.".into())]
    );
}

#[test]
fn reasoning_format_names_are_llama_cpps() {
    assert_eq!(ReasoningFormat::parse("auto"), Some(ReasoningFormat::Separate));
    assert_eq!(ReasoningFormat::parse("deepseek"), Some(ReasoningFormat::Separate));
    assert_eq!(ReasoningFormat::parse("none"), Some(ReasoningFormat::Inline));
    assert_eq!(ReasoningFormat::parse("deepseek-legacy"), None);
}
