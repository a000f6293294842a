//! Thinking ("reasoning") split out of a chat answer, as llama.cpp's server and
//! DeepSeek's API do: the model's thinking goes to `reasoning_content` (Anthropic:
//! `thinking` blocks, Responses: a `reasoning` item), the rest is the answer.
//!
//! | models                        | thinking as the model writes it                                    |
//! |-------------------------------|--------------------------------------------------------------------|
//! | Qwen3, DeepSeek R1 and others | `<think>…</think>` opening the answer, or only `…</think>` when the prompt ends with `<think>` |
//! | gpt-oss                       | the `analysis` channel, split by [`crate::tools::ToolParser`]       |
//!
//! [`ThinkSplitter`] reads the tags piece by piece (a tag may arrive split across
//! tokens); [`OutputSplitter`] puts it in front of the tool-call parser, so that calls
//! are parsed in the answer only, and is what every chat-shaped endpoint reads
//! generated text through. As in llama.cpp, a `<think>` that opens the output is split
//! whatever the template (models think without saying so in their template).

use baton_engine::EndCheck;

use crate::tools::{partial_suffix, Out, ToolFormat, ToolParser};

/// What becomes of the model's thinking in the reply.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ReasoningFormat {
    /// Apart from the answer: `reasoning_content`, `thinking` blocks, `reasoning`
    /// items (llama.cpp's `reasoning_format` `deepseek` and `auto`, its default).
    #[default]
    Separate,
    /// Left in the answer's text as the model wrote it (`reasoning_format: none`).
    Inline,
    /// Split off and not sent (Anthropic's `thinking: {"type": "disabled"}`, for a
    /// model that thinks anyway).
    Hidden,
}

impl ReasoningFormat {
    /// llama.cpp's `reasoning_format` values (`deepseek-legacy`, which sends the
    /// thinking twice, is not one of them).
    pub fn parse(name: &str) -> Option<ReasoningFormat> {
        match name {
            "auto" | "deepseek" => Some(ReasoningFormat::Separate),
            "none" => Some(ReasoningFormat::Inline),
            _ => None,
        }
    }
}

/// The tags of a model's thinking.
pub const OPEN: &str = "<think>";
/// The end of it.
pub const CLOSE: &str = "</think>";

/// Where generated text starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Start {
    /// Outside any thinking: a `<think>` may open it.
    Open,
    /// Inside the thinking, which the prompt opened: the output only closes it.
    InThinking,
}

impl Start {
    /// Where the output of a rendered prompt starts: inside the thinking when the
    /// template's generation prompt opened `<think>`, as Qwen3's and DeepSeek R1's
    /// newer ones do.
    pub fn after(rendered: &str) -> Start {
        if rendered.trim_end().ends_with(OPEN) {
            Start::InThinking
        } else {
            Start::Open
        }
    }
}

/// A piece of output, split.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Piece {
    /// Thinking, without its tags.
    Reasoning(String),
    /// The answer.
    Answer(String),
}

/// Where the splitter is in the output.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    /// Nothing but whitespace yet: a `<think>` may still open the output.
    Before,
    /// Inside the thinking; `began`: something besides whitespace was released.
    Thinking { began: bool },
    /// The answer; `began` as for thinking (whitespace after `</think>` is dropped).
    Answer { began: bool },
}

/// Splits `<think>…</think>` off the start of generated text, piece by piece: a tag
/// split across pieces is held until it is whole, whitespace around the thinking is
/// dropped (as llama.cpp trims it), so that the reasoning and the answer read the same
/// streamed or whole. Text after `</think>` is all answer, even a second `<think>`.
#[derive(Clone, Debug)]
pub struct ThinkSplitter {
    state: State,
    /// Text not yet released.
    held: String,
    /// Whitespace at the end of the thinking so far: dropped if the thinking ends there.
    pending_space: String,
}

impl ThinkSplitter {
    /// A splitter for output that starts at `start`.
    pub fn new(start: Start) -> ThinkSplitter {
        let state = match start {
            Start::InThinking => State::Thinking { began: false },
            Start::Open => State::Before,
        };
        ThinkSplitter {
            state,
            held: String::new(),
            pending_space: String::new(),
        }
    }

    /// Adds generated text; returns what can be released now.
    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        self.held.push_str(text);
        let mut out = Vec::new();
        self.split(&mut out, false);
        out
    }

    /// The end of generation: everything still held (thinking never closed is all
    /// thinking, as the model wrote nothing else).
    pub fn finish(&mut self) -> Vec<Piece> {
        let mut out = Vec::new();
        self.split(&mut out, true);
        out
    }

    fn split(&mut self, out: &mut Vec<Piece>, end: bool) {
        loop {
            match self.state {
                State::Before => {
                    let start = self.held.trim_start();
                    if let Some(after) = start.strip_prefix(OPEN) {
                        self.held = after.to_string();
                        self.state = State::Thinking { began: false };
                        continue;
                    }
                    if !end && OPEN.starts_with(start) {
                        // Whitespace, or the start of `<think>`: wait for more.
                        return;
                    }
                    // No thinking: the output as it came, leading whitespace included.
                    self.state = State::Answer { began: true };
                }
                State::Thinking { began } => {
                    let (body, rest, closed) = match self.held.find(CLOSE) {
                        Some(at) => (
                            self.held[..at].to_string(),
                            self.held[at + CLOSE.len()..].to_string(),
                            true,
                        ),
                        None if end => (std::mem::take(&mut self.held), String::new(), true),
                        None => {
                            // Hold back what may still become `</think>`.
                            let at = self.held.len() - partial_suffix(&self.held, CLOSE);
                            (self.held[..at].to_string(), self.held[at..].to_string(), false)
                        }
                    };
                    self.held = rest;
                    let body = if began { body.as_str() } else { body.trim_start() };
                    let text = body.trim_end();
                    if !text.is_empty() {
                        let mut released = std::mem::take(&mut self.pending_space);
                        released.push_str(text);
                        out.push(Piece::Reasoning(released));
                        self.state = State::Thinking { began: true };
                    }
                    if !closed {
                        self.pending_space.push_str(&body[text.len()..]);
                        return;
                    }
                    self.pending_space.clear();
                    self.state = State::Answer { began: false };
                }
                State::Answer { began } => {
                    let text = if began {
                        self.held.as_str()
                    } else {
                        self.held.trim_start()
                    };
                    if !text.is_empty() {
                        out.push(Piece::Answer(text.to_string()));
                        self.state = State::Answer { began: true };
                    }
                    self.held.clear();
                    return;
                }
            }
        }
    }
}

/// Generated text split into reasoning, content and tool calls: the thinking first
/// ([`ThinkSplitter`], or gpt-oss's channels in the tool parser), then the answer
/// through the tool-call parser. One per request, whatever the endpoint.
#[derive(Debug)]
pub struct OutputSplitter {
    think: Option<ThinkSplitter>,
    tools: Option<ToolParser>,
    reasoning: ReasoningFormat,
}

impl OutputSplitter {
    /// The splitter for a chat whose template writes tool calls in `format` (gpt-oss's
    /// harmony format also carries its thinking), `tools`: the call parser when calls
    /// are parsed or `None`, `start`: where the output starts. `None` when nothing is
    /// split: the text is all content.
    pub fn new(
        format: ToolFormat,
        tools: Option<ToolParser>,
        reasoning: ReasoningFormat,
        start: Start,
    ) -> Option<OutputSplitter> {
        let splitter = OutputSplitter::with(format, tools, reasoning, start);
        (splitter.think.is_some() || splitter.tools.is_some()).then_some(splitter)
    }

    fn with(format: ToolFormat, tools: Option<ToolParser>, reasoning: ReasoningFormat, start: Start) -> OutputSplitter {
        let think =
            (format != ToolFormat::Harmony && reasoning != ReasoningFormat::Inline).then(|| ThinkSplitter::new(start));
        OutputSplitter {
            think,
            tools,
            reasoning,
        }
    }

    /// Adds generated text; returns what can be released now.
    pub fn push(&mut self, text: &str) -> Vec<Out> {
        let pieces = match self.think.as_mut() {
            Some(think) => think.push(text),
            None => vec![Piece::Answer(text.to_string())],
        };
        let mut out = Vec::new();
        self.release(&mut out, pieces, false);
        out
    }

    /// The end of generation: everything still held.
    pub fn finish(&mut self) -> Vec<Out> {
        let pieces = self.think.as_mut().map(ThinkSplitter::finish).unwrap_or_default();
        let mut out = Vec::new();
        self.release(&mut out, pieces, true);
        out
    }

    /// Tool calls released so far.
    pub fn n_calls(&self) -> usize {
        self.tools.as_ref().map_or(0, |tools| tools.n_calls)
    }

    fn release(&mut self, out: &mut Vec<Out>, pieces: Vec<Piece>, end: bool) {
        let mut answer = Vec::new();
        for piece in pieces {
            match (piece, self.tools.as_mut()) {
                (Piece::Reasoning(text), _) => answer.push(Out::Reasoning(text)),
                (Piece::Answer(text), Some(tools)) => answer.extend(tools.push(&text)),
                (Piece::Answer(text), None) => answer.push(Out::Content(text)),
            }
        }
        if end {
            answer.extend(self.tools.as_mut().map(ToolParser::finish).unwrap_or_default());
        }
        for item in answer {
            match (item, self.reasoning) {
                (Out::Reasoning(text), ReasoningFormat::Inline) => out.push(Out::Content(text)),
                (Out::Reasoning(_), ReasoningFormat::Hidden) => {}
                (Out::Reasoning(text), ReasoningFormat::Separate) if text.is_empty() => {}
                (item, _) => out.push(item),
            }
        }
    }
}

/// Ends generation as soon as the first tool call is complete (`parallel_tool_calls:
/// false`): an [`OutputSplitter`] of its own whose parser takes one call
/// ([`ToolParser::one_call`]), fed on the engine's thread the same text the response's
/// splitter is fed, so both see the call complete at the same token (and neither
/// takes a call written while thinking).
#[derive(Debug)]
pub struct FirstCallEnds(OutputSplitter);

impl FirstCallEnds {
    /// For answers in `format`, read as the response's [`OutputSplitter::new`] reads
    /// them (`reasoning`, `start`).
    pub fn new(format: ToolFormat, reasoning: ReasoningFormat, start: Start) -> FirstCallEnds {
        let tools = ToolParser::new(format, true).one_call(true);
        FirstCallEnds(OutputSplitter::with(format, Some(tools), reasoning, start))
    }
}

impl EndCheck for FirstCallEnds {
    fn ends_after(&mut self, text: &str) -> bool {
        self.0.push(text);
        self.0.n_calls() > 0
    }
}

#[cfg(test)]
mod tests;
