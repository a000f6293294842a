//! Tool calling: which format the model writes calls in (from its chat template), the
//! grammar that forces a call (`tool_choice: required` or a named function), and the
//! parser that turns generated text into OpenAI `tool_calls`, streamed or whole.
//!
//! | format  | models                   | a call as the model writes it                                       |
//! |---------|--------------------------|----------------------------------------------------------------------|
//! | Hermes  | Qwen2.5/3, Hermes, other | `<tool_call>\n{"name": N, "arguments": {…}}\n</tool_call>`, repeated  |
//! | Llama3  | Llama 3.1–3.3            | `{"name": N, "parameters": {…}}` as the whole answer                  |
//! | Mistral | Mistral, Mixtral         | `[TOOL_CALLS][{"name": N, "arguments": {…}}, …]` or `[TOOL_CALLS]N[ARGS]{…}` |
//! | Harmony | gpt-oss                  | `<|channel|>commentary to=functions.N <|constrain|>json<|message|>{…}<|call|>` |
//!
//! Text that does not parse as a call is returned as content: nothing is lost.
//!
//! With `parallel_tool_calls: false` the parser releases the first call as soon as it is
//! complete and parses no other ([`ToolParser::one_call`]); [`crate::reasoning::FirstCallEnds`] runs the
//! same parser on the engine's thread, which ends generation at that token, so the
//! model writes nothing after the call. (llama.cpp's server gets the same from a lazy
//! grammar that, once a call starts, admits one call and then only the end; the ring's
//! grammars are not lazy, so baton ends generation instead. A call the model writes
//! wrong is content, and the model may still write a good one.)

use baton_grammar::schema::{literal, Builder};
use serde_json::{json, Value};

use crate::api::ApiError;

/// How a model writes tool calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ToolFormat {
    /// `<tool_call>` JSON `</tool_call>` blocks (also what models without a tool-aware
    /// template are told to write).
    Hermes,
    /// One JSON object with `name` and `parameters` as the whole answer.
    Llama3,
    /// `[TOOL_CALLS]` and a JSON list of calls (or `name[ARGS]{…}`).
    Mistral,
    /// gpt-oss channels.
    Harmony,
}

impl ToolFormat {
    /// The format a chat template expects, from its text.
    pub fn detect(template: &str) -> ToolFormat {
        if template.contains("<|channel|>") {
            ToolFormat::Harmony
        } else if template.contains("[TOOL_CALLS]") || template.contains("[AVAILABLE_TOOLS]") {
            ToolFormat::Mistral
        } else if template.contains("<tool_call>") {
            ToolFormat::Hermes
        } else if template.contains("<|start_header_id|>") && template.contains("tools") {
            ToolFormat::Llama3
        } else {
            ToolFormat::Hermes
        }
    }
}

/// `tool_choice`, checked.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ToolChoice {
    /// The model decides (the default with tools).
    Auto,
    /// No tool is offered; the model answers in text.
    None,
    /// The model must call at least one tool.
    Required,
    /// The model must call this function.
    Function(String),
}

/// A call parsed from the output.
#[derive(Clone, Debug, PartialEq)]
pub struct ToolCall {
    /// The function's name.
    pub name: String,
    /// Its arguments, as JSON text (OpenAI sends a string).
    pub arguments: String,
}

/// A checked `tools` entry's function.
#[derive(Clone, Debug, PartialEq)]
pub struct Function {
    /// Its name.
    pub name: String,
    /// JSON Schema of its arguments (any object when absent).
    pub parameters: Option<Value>,
}

/// Checks `tools`: each `{"type": "function", "function": {"name", "parameters"?}}`.
pub fn functions(tools: &[Value]) -> Result<Vec<Function>, ApiError> {
    let mut out = Vec::new();
    for (i, tool) in tools.iter().enumerate() {
        let bad = |what: &str| ApiError::invalid(format!("tools[{i}]: {what}")).param("tools");
        if tool.get("type").and_then(Value::as_str) != Some("function") {
            return Err(bad("type must be \"function\""));
        }
        let function = tool.get("function").ok_or_else(|| bad("function is missing"))?;
        let name = function
            .get("name")
            .and_then(Value::as_str)
            .filter(|n| !n.is_empty() && n.len() <= 64)
            .ok_or_else(|| bad("function.name must be a string of 1 to 64 characters"))?;
        if !name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-' || c == '.')
        {
            return Err(bad("function.name may hold only letters, digits, '_', '-' and '.'"));
        }
        let parameters = function.get("parameters").cloned();
        if parameters.as_ref().is_some_and(|p| !p.is_object()) {
            return Err(bad("function.parameters must be a JSON Schema object"));
        }
        if out.iter().any(|f: &Function| f.name == name) {
            return Err(bad("function names must be unique"));
        }
        out.push(Function {
            name: name.to_string(),
            parameters,
        });
    }
    Ok(out)
}

/// The grammar that makes the model call `functions` (one of them, or several when
/// `parallel`) in `format`. `tool_calls_token` is Mistral's `[TOOL_CALLS]` control token.
pub fn forced_grammar(
    format: ToolFormat,
    functions: &[Function],
    parallel: bool,
    tool_calls_token: Option<u32>,
) -> Result<String, ApiError> {
    let mut builder = Builder::default();
    let mut calls = Vec::new();
    for function in functions {
        let arguments = match &function.parameters {
            Some(schema) => builder
                .schema(schema, &format!("{}-args", function.name))
                .map_err(|e| ApiError::invalid(format!("tool '{}' parameters: {e}", function.name)).param("tools"))?,
            None => builder.any_object(),
        };
        let name = Value::String(function.name.clone()).to_string();
        let call = match format {
            ToolFormat::Hermes | ToolFormat::Mistral => {
                format!(
                    "{} {arguments} \"}}\"",
                    literal(&format!("{{\"name\": {name}, \"arguments\": "))
                )
            }
            ToolFormat::Llama3 => {
                format!(
                    "{} {arguments} \"}}\"",
                    literal(&format!("{{\"name\": {name}, \"parameters\": "))
                )
            }
            ToolFormat::Harmony => format!(
                "{} {arguments}",
                literal(&format!(
                    "<|channel|>commentary to=functions.{} <|constrain|>json<|message|>",
                    function.name
                ))
            ),
        };
        calls.push(builder.rule("call", call));
    }
    let call = builder.rule("calls", calls.join(" | "));
    let root = match format {
        ToolFormat::Hermes => {
            let block = builder.rule("block", format!("\"<tool_call>\\n\" {call} \"\\n</tool_call>\""));
            if parallel {
                format!("{block} (\"\\n\" {block})*")
            } else {
                block
            }
        }
        ToolFormat::Llama3 | ToolFormat::Harmony => call,
        ToolFormat::Mistral => {
            let marker = tool_calls_token.map_or_else(|| literal("[TOOL_CALLS]"), |id| format!("<[{id}]>"));
            if parallel {
                format!("{marker} \"[\" {call} (\", \" {call})* \"]\"")
            } else {
                format!("{marker} \"[\" {call} \"]\"")
            }
        }
    };
    Ok(builder.finish(&root))
}

/// The system text that tells a model whose template knows nothing of tools how to
/// call them (Hermes style, as NousResearch's and Qwen's templates write it).
pub fn instructions(tools: &[Value]) -> String {
    let mut text = String::from(
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n\
         You are provided with function signatures within <tools></tools> XML tags:\n<tools>",
    );
    for tool in tools {
        text.push('\n');
        text.push_str(&tool.to_string());
    }
    text.push_str(
        "\n</tools>\n\nFor each function call, return a json object with function name and arguments \
         within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \
         \"arguments\": <args-json-object>}\n</tool_call>",
    );
    text
}

/// What the parser releases.
#[derive(Clone, Debug, PartialEq)]
pub enum Out {
    /// Text for `content`.
    Content(String),
    /// Text for `reasoning_content` (gpt-oss's analysis channel).
    Reasoning(String),
    /// A complete call.
    Call(ToolCall),
}

/// Turns generated text, piece by piece, into content and tool calls.
#[derive(Debug)]
pub struct ToolParser {
    format: ToolFormat,
    /// Whether calls are parsed at all (else everything is content, except harmony's
    /// channels which are always separated).
    calls: bool,
    /// Text not yet released.
    held: String,
    /// Inside a Hermes `<tool_call>` block.
    in_call: bool,
    /// Llama 3 and Mistral: undecided (nothing but whitespace yet), or holding a
    /// possible call list until the end.
    decided: Option<bool>,
    /// gpt-oss: the channel whose message is being read (`None` between messages), and
    /// the function it calls, if any.
    channel: Option<(String, Option<String>)>,
    /// Trailing whitespace of the content so far, held back: dropped if a call follows.
    pending_space: String,
    /// `parallel_tool_calls: false`: after the first call, none is parsed.
    one_call: bool,
    /// Calls released so far.
    pub n_calls: usize,
}

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";

impl ToolParser {
    /// A parser for `format`; `calls`: parse tool calls (tools were offered).
    pub fn new(format: ToolFormat, calls: bool) -> ToolParser {
        ToolParser {
            format,
            calls,
            held: String::new(),
            in_call: false,
            decided: None,
            channel: None,
            pending_space: String::new(),
            one_call: false,
            n_calls: 0,
        }
    }

    /// With `one`: the first call is released as soon as it is complete (Llama 3 and
    /// Mistral too, whose calls are otherwise read from the whole answer at its end),
    /// and what follows it is content, never a call.
    pub fn one_call(mut self, one: bool) -> ToolParser {
        self.one_call = one;
        self
    }

    /// Whether this parser changes anything (else text passes through untouched).
    pub fn active(format: ToolFormat, calls: bool) -> bool {
        calls || format == ToolFormat::Harmony
    }

    /// Adds generated text; returns what can be released now.
    pub fn push(&mut self, text: &str) -> Vec<Out> {
        self.held.push_str(text);
        let mut out = Vec::new();
        match self.format {
            _ if !Self::active(self.format, self.calls) => {
                out.push(Out::Content(std::mem::take(&mut self.held)));
            }
            ToolFormat::Hermes => self.hermes(&mut out, false),
            ToolFormat::Llama3 | ToolFormat::Mistral => {
                if self.decided.is_none() {
                    let start = self.held.trim_start();
                    if !start.is_empty() {
                        let looks_like_call = match self.format {
                            ToolFormat::Llama3 => start.starts_with('{'),
                            _ => start.starts_with("[TOOL_CALLS]") || start.starts_with('['),
                        };
                        self.decided = Some(looks_like_call);
                    }
                }
                if self.decided == Some(true) && self.one_call {
                    self.first_listed_call(&mut out);
                }
                if self.decided == Some(false) {
                    out.push(Out::Content(std::mem::take(&mut self.held)));
                }
            }
            ToolFormat::Harmony => self.harmony_stream(&mut out, false),
        }
        self.tidy(out)
    }

    /// A call was released: with [`one_call`](Self::one_call) no other will be, and
    /// `rest` (what followed it, if the format is read as plain text after a call)
    /// is content.
    fn released(&mut self, out: &mut Vec<Out>, call: ToolCall, rest: Option<String>) {
        out.push(Out::Call(call));
        if self.one_call {
            self.calls = false;
            out.extend(rest.map(Out::Content));
        }
    }

    /// Llama 3 / Mistral with [`one_call`](Self::one_call): releases the answer's first
    /// call once it is complete (Llama 3: the first JSON object; Mistral: the first of
    /// the list, or `name[ARGS]{…}`); a list's `,` or `]` right after it is the list's,
    /// not content. An answer whose first value is not a call is content.
    fn first_listed_call(&mut self, out: &mut Vec<Out>) {
        const MARKER: &str = "[TOOL_CALLS]";
        let mut rest = self.held.trim_start();
        let mut name = None;
        let mut list = false;
        if self.format == ToolFormat::Mistral {
            match rest.strip_prefix(MARKER) {
                Some(after) => rest = after.trim_start(),
                None if MARKER.starts_with(rest) => return,
                None => {}
            }
            if let Some((called, args)) = rest.split_once("[ARGS]") {
                name = Some(called.trim().to_string());
                rest = args;
            } else if let Some(items) = rest.strip_prefix('[') {
                list = true;
                rest = items;
            } else {
                // The name of a `name[ARGS]` call, still coming.
                return;
            }
        }
        let mut values = serde_json::Deserializer::from_str(rest).into_iter::<Value>();
        let value = match values.next() {
            None => return,
            Some(Err(e)) if e.is_eof() => return,
            Some(Err(_)) => {
                self.decided = Some(false);
                return;
            }
            Some(Ok(value)) => value,
        };
        let call = match name {
            Some(name) => Some(ToolCall {
                name,
                arguments: value.to_string(),
            }),
            None => call_of(&value),
        };
        let Some(call) = call else {
            self.decided = Some(false);
            return;
        };
        let mut after = &rest[values.byte_offset()..];
        if list {
            let trimmed = after.trim_start();
            after = trimmed.strip_prefix([',', ']']).unwrap_or(after);
        }
        let after = after.to_string();
        self.held.clear();
        self.released(out, call, Some(after));
    }

    /// The end of generation: everything still held.
    pub fn finish(&mut self) -> Vec<Out> {
        let mut out = Vec::new();
        let held = std::mem::take(&mut self.held);
        match self.format {
            _ if !Self::active(self.format, self.calls) => out.push(Out::Content(held)),
            ToolFormat::Hermes => {
                self.held = held;
                self.hermes(&mut out, true);
            }
            ToolFormat::Llama3 | ToolFormat::Mistral => match self.calls_list(&held) {
                Some(calls) => out.extend(calls.into_iter().map(Out::Call)),
                None => out.push(Out::Content(held)),
            },
            ToolFormat::Harmony => {
                self.held = held;
                self.harmony_stream(&mut out, true);
            }
        }
        let mut out = self.tidy(out);
        // Whitespace after the last call is not an answer.
        if self.n_calls == 0 && !self.pending_space.is_empty() {
            out.push(Out::Content(std::mem::take(&mut self.pending_space)));
        }
        out
    }

    /// Counts calls, holds back whitespace-only content, merges content pieces.
    fn tidy(&mut self, out: Vec<Out>) -> Vec<Out> {
        let mut tidy = Vec::new();
        for item in out {
            match item {
                Out::Content(text) => {
                    // Trailing whitespace waits: before a call it is dropped, so the
                    // content reads the same streamed or whole.
                    let body = text.trim_end();
                    if body.is_empty() {
                        self.pending_space.push_str(&text);
                        continue;
                    }
                    let mut out = std::mem::take(&mut self.pending_space);
                    out.push_str(body);
                    self.pending_space.push_str(&text[body.len()..]);
                    tidy.push(Out::Content(out));
                }
                Out::Call(call) => {
                    self.pending_space.clear();
                    self.n_calls += 1;
                    tidy.push(Out::Call(call));
                }
                Out::Reasoning(text) if text.is_empty() => {}
                other => tidy.push(other),
            }
        }
        tidy
    }

    fn hermes(&mut self, out: &mut Vec<Out>, end: bool) {
        loop {
            if self.in_call {
                if let Some(at) = self.held.find(CLOSE) {
                    let body = self.held[..at].to_string();
                    self.held.drain(..at + CLOSE.len());
                    self.in_call = false;
                    match parse_call(&body) {
                        Some(call) => {
                            let rest = self.one_call.then(|| std::mem::take(&mut self.held));
                            self.released(out, call, rest);
                            if self.one_call {
                                return;
                            }
                        }
                        None => out.push(Out::Content(format!("{OPEN}{body}{CLOSE}"))),
                    }
                    continue;
                }
                if end {
                    let body = std::mem::take(&mut self.held);
                    match parse_call(&body) {
                        Some(call) => self.released(out, call, None),
                        None => out.push(Out::Content(format!("{OPEN}{body}"))),
                    }
                }
                return;
            }
            if let Some(at) = self.held.find(OPEN) {
                out.push(Out::Content(self.held[..at].to_string()));
                self.held.drain(..at + OPEN.len());
                self.in_call = true;
                continue;
            }
            // Hold back what may still become the opening tag.
            let keep = if end { 0 } else { partial_suffix(&self.held, OPEN) };
            let release = self.held.len() - keep;
            out.push(Out::Content(self.held[..release].to_string()));
            self.held.drain(..release);
            return;
        }
    }

    /// Llama 3 / Mistral: the whole answer as calls, or `None`.
    fn calls_list(&self, text: &str) -> Option<Vec<ToolCall>> {
        let text = text.trim();
        let text = text.strip_prefix("[TOOL_CALLS]").unwrap_or(text).trim_start();
        // Mistral v11: name[ARGS]{...}, possibly repeated after [TOOL_CALLS].
        if self.format == ToolFormat::Mistral && text.contains("[ARGS]") {
            let mut calls = Vec::new();
            for part in text.split("[TOOL_CALLS]") {
                let (name, args) = part.split_once("[ARGS]")?;
                let args: Value = serde_json::from_str(args.trim()).ok()?;
                calls.push(ToolCall {
                    name: name.trim().to_string(),
                    arguments: args.to_string(),
                });
            }
            return Some(calls);
        }
        let mut calls = Vec::new();
        let mut rest = text;
        loop {
            // Llama writes calls one after another, sometimes separated by ';'.
            rest = rest.trim_start_matches(|c: char| c.is_whitespace() || c == ';');
            if rest.is_empty() {
                break;
            }
            let mut values = serde_json::Deserializer::from_str(rest).into_iter::<Value>();
            let value = values.next()?.ok()?;
            rest = &rest[values.byte_offset()..];
            match value {
                Value::Array(items) => {
                    for item in items {
                        calls.push(call_of(&item)?);
                    }
                }
                item => calls.push(call_of(&item)?),
            }
        }
        (!calls.is_empty()).then_some(calls)
    }

    /// gpt-oss: `<|channel|>NAME[ to=functions.F][ <|constrain|>json]<|message|>BODY`
    /// messages, each after `<|start|>assistant` but the first (the `<|end|>` between them
    /// is a control token and renders as nothing). `final` bodies stream as content,
    /// `analysis` as reasoning; a body addressed `to=functions.F` is a call, released
    /// whole when it ends.
    fn harmony_stream(&mut self, out: &mut Vec<Out>, end: bool) {
        const CHANNEL: &str = "<|channel|>";
        const MESSAGE: &str = "<|message|>";
        const START: &str = "<|start|>";
        loop {
            match self.channel.clone() {
                None => {
                    let Some(at) = self.held.find(CHANNEL) else {
                        if end {
                            let rest = std::mem::take(&mut self.held);
                            let rest = rest.trim_start_matches(START).trim_start_matches("assistant");
                            out.push(Out::Content(rest.to_string()));
                        }
                        return;
                    };
                    let Some(header_end) = self.held[at..].find(MESSAGE).map(|m| at + m) else {
                        if end {
                            out.push(Out::Content(std::mem::take(&mut self.held)));
                        }
                        return;
                    };
                    // Before the first channel: nothing but `<|start|>assistant`, or text.
                    let before = self.held[..at]
                        .trim_start_matches(START)
                        .trim_start_matches("assistant");
                    if !before.trim().is_empty() {
                        out.push(Out::Content(before.to_string()));
                    }
                    let header = &self.held[at + CHANNEL.len()..header_end];
                    let name = header.split_whitespace().next().unwrap_or_default().to_string();
                    let recipient = header
                        .split_whitespace()
                        .find_map(|w| w.strip_prefix("to=functions."))
                        .map(|n| n.trim_end_matches("<|constrain|>json").to_string());
                    self.channel = Some((name, recipient));
                    self.held.drain(..header_end + MESSAGE.len());
                }
                Some((name, recipient)) => {
                    let stop = [START, CHANNEL].iter().filter_map(|m| self.held.find(m)).min();
                    let is_call = recipient.is_some() && self.calls;
                    let (body, finished) = match stop {
                        Some(at) => (self.held[..at].to_string(), true),
                        None if end => (std::mem::take(&mut self.held), true),
                        None if is_call => return,
                        None => {
                            let keep = partial_suffix(&self.held, START).max(partial_suffix(&self.held, CHANNEL));
                            let release = self.held.len() - keep;
                            (self.held[..release].to_string(), false)
                        }
                    };
                    self.held.drain(..body.len().min(self.held.len()));
                    match (&recipient, name.as_str()) {
                        (Some(function), _) if self.calls => match serde_json::from_str::<Value>(body.trim()) {
                            Ok(args) => {
                                let call = ToolCall {
                                    name: function.clone(),
                                    arguments: args.to_string(),
                                };
                                // Later messages are still read as channels: a later
                                // call's body is content.
                                self.released(out, call, None);
                            }
                            Err(_) => out.push(Out::Content(body)),
                        },
                        (_, "analysis") => out.push(Out::Reasoning(body)),
                        _ => out.push(Out::Content(body)),
                    }
                    if !finished {
                        return;
                    }
                    self.channel = None;
                }
            }
        }
    }
}

/// Length of the longest suffix of `text` that `marker` starts with.
pub(crate) fn partial_suffix(text: &str, marker: &str) -> usize {
    (1..marker.len().min(text.len() + 1))
        .rev()
        .find(|&n| text.is_char_boundary(text.len() - n) && marker.starts_with(&text[text.len() - n..]))
        .unwrap_or(0)
}

/// `{"name": …, "arguments": {…}}` (or `"parameters"`) as a call.
fn parse_call(body: &str) -> Option<ToolCall> {
    call_of(&serde_json::from_str::<Value>(body.trim()).ok()?)
}

fn call_of(value: &Value) -> Option<ToolCall> {
    let name = value.get("name")?.as_str()?.to_string();
    let arguments = match value.get("arguments").or_else(|| value.get("parameters")) {
        None => json!({}),
        Some(Value::String(text)) => serde_json::from_str(text).unwrap_or(Value::String(text.clone())),
        Some(args) => args.clone(),
    };
    Some(ToolCall {
        name,
        arguments: arguments.to_string(),
    })
}

#[cfg(test)]
mod tests;
