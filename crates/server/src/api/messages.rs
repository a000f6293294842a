//! `POST /v1/messages`: Anthropic's Messages API over the chat endpoint's job (see
//! `crate::anthropic` for the request), answered in Anthropic's shapes: a whole
//! message, or its server-sent event sequence (`message_start`, a
//! `content_block_start`/`_delta`/`_stop` run per `thinking`, text or `tool_use` block,
//! `message_delta` with the stop reason and usage, `message_stop`).

use super::*;
use crate::anthropic;
use crate::reasoning::ReasoningFormat;

const ENDPOINT: &str = "messages";

pub(super) async fn messages(State(state): State<Arc<AppState>>, body: Body) -> Response {
    let result = messages_inner(state.clone(), body, Instant::now()).await;
    record_refusal(&state, ENDPOINT, &result);
    result.unwrap_or_else(|e| {
        let body = anthropic::error_body(e.status.as_u16(), &e.body.error.message);
        (e.status, Json(body)).into_response()
    })
}

async fn messages_inner(state: Arc<AppState>, body: Body, arrived: Instant) -> Result<Response, ApiError> {
    let body = read_body(&state, body).await?;
    let req = state
        .off_runtime(move |state| {
            let anthropic: Value = request::parse_json(&body)?;
            let chat = anthropic::to_chat(&anthropic)?;
            let mut req = request::chat(chat.to_string().as_bytes(), &state.config.model_id)?;
            if anthropic::thinking_disabled(&anthropic) {
                req.reasoning = ReasoningFormat::Hidden;
            }
            Ok(req)
        })
        .await?;
    let (prepared, parser) = chat_job(&state, req).await?;
    let Prepared {
        job, events, stream, ..
    } = prepared;
    state.engine.submit(job)?;
    let reply = Reply {
        id: state.new_id("msg"),
        state: state.clone(),
        timing: Timing::new(arrived),
        parser,
        calls: 0,
    };
    if stream {
        let stream = MessageStream {
            reply,
            events,
            queue: VecDeque::new(),
            block: None,
            started: false,
            done: false,
        };
        let body = futures_util::stream::unfold(stream, |mut s| async move { s.next().await.map(|e| (e, s)) });
        return Ok(Sse::new(body).keep_alive(KeepAlive::default()).into_response());
    }
    reply.whole(events).await
}

/// What both shapes of an answer share.
struct Reply {
    id: String,
    state: Arc<AppState>,
    timing: Timing,
    /// Separates thinking and tool calls from text.
    parser: Option<OutputSplitter>,
    /// Tool calls released so far.
    calls: usize,
}

impl Reply {
    fn record(&self, outcome: Outcome) {
        self.state.metrics.request(ENDPOINT, outcome);
    }

    /// The blocks for `text`: all of it as text without a splitter, else what the
    /// splitter releases.
    fn blocks(&mut self, text: &str, last: bool) -> Vec<Out> {
        answer_outs(self.parser.as_mut(), text, last)
    }

    fn tool_use(&mut self, call: &tools::ToolCall) -> Value {
        let input = serde_json::from_str::<Value>(&call.arguments).unwrap_or_else(|_| json!({}));
        let id = format!(
            "toolu_{}_{}",
            self.id.rsplit('-').next().unwrap_or_default(),
            self.calls
        );
        self.calls += 1;
        json!({"type": "tool_use", "id": id, "name": call.name, "input": input})
    }

    fn stop_reason(&self, finish: &baton_engine::Finish) -> &'static str {
        let length = finish.reason == FinishReason::Length;
        anthropic::stop_reason(length, finish.stop_string.as_deref(), self.calls > 0)
    }

    fn message(&self, content: Value, stop: (Option<&str>, Option<&str>), usage: Value) -> Value {
        json!({
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.state.config.model_id,
            "content": content,
            "stop_reason": stop.0,
            "stop_sequence": stop.1,
            "usage": usage,
        })
    }

    async fn whole(mut self, mut events: UnboundedReceiver<Event>) -> Result<Response, ApiError> {
        let mut text = String::new();
        while let Some(event) = events.recv().await {
            match event {
                Event::Token(token) => {
                    self.timing.token(&self.state.metrics);
                    text.push_str(&token.text);
                }
                Event::Finished(finish) => {
                    text.push_str(&finish.tail);
                    let mut content = Vec::new();
                    for out in self.blocks(&text, true) {
                        match out {
                            Out::Content(text) => append(&mut content, Block::Text, &text),
                            Out::Reasoning(text) => append(&mut content, Block::Thinking, &text),
                            Out::Call(call) => content.push(self.tool_use(&call)),
                        }
                    }
                    let stop = (Some(self.stop_reason(&finish)), finish.stop_string.as_deref());
                    let usage = json!({"input_tokens": finish.prompt_tokens, "output_tokens": finish.completion_tokens,
                        "cache_read_input_tokens": finish.cached_tokens});
                    let message = self.message(Value::Array(content), stop, usage);
                    self.record(Outcome::Ok);
                    return Ok(Json(message).into_response());
                }
                Event::Failed(failure) => return Err(ApiError::from(failure)),
            }
        }
        Err(ApiError::server("the engine stopped before the request finished"))
    }
}

/// The content block a stream has open.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Block {
    Thinking,
    Text,
    ToolUse,
}

impl Block {
    /// A text or thinking block's type, the field its text is in, and its delta's type.
    fn names(self) -> (&'static str, &'static str, &'static str) {
        match self {
            Block::Thinking => ("thinking", "thinking", "thinking_delta"),
            Block::Text | Block::ToolUse => ("text", "text", "text_delta"),
        }
    }

    /// An empty text or thinking block (thinking carries a signature, which Anthropic
    /// uses to check thinking sent back; this server has nothing to sign).
    fn empty(self) -> Value {
        let (kind, field, _) = self.names();
        let mut block = json!({"type": kind, field: ""});
        if self == Block::Thinking {
            block["signature"] = json!("");
        }
        block
    }
}

/// Adds `text` to `content` as a `kind` (text or thinking) block, to the last block
/// when it is one.
fn append(content: &mut Vec<Value>, kind: Block, text: &str) {
    if text.is_empty() {
        return;
    }
    let (name, field, _) = kind.names();
    match content.last_mut() {
        Some(last) if last["type"] == name => {
            let joined = format!("{}{text}", last[field].as_str().unwrap_or_default());
            last[field] = json!(joined);
        }
        _ => {
            let mut block = kind.empty();
            block[field] = json!(text);
            content.push(block);
        }
    }
}

struct MessageStream {
    reply: Reply,
    events: UnboundedReceiver<Event>,
    queue: VecDeque<SseEvent>,
    /// The open block and its index; indexes count every block of the message.
    block: Option<(Block, usize)>,
    started: bool,
    done: bool,
}

impl Drop for MessageStream {
    /// A stream dropped before its end: the client went away.
    fn drop(&mut self) {
        if !self.done {
            self.reply.record(Outcome::Cancelled);
        }
    }
}

impl MessageStream {
    async fn next(&mut self) -> Option<Result<SseEvent, Infallible>> {
        loop {
            if let Some(event) = self.queue.pop_front() {
                return Some(Ok(event));
            }
            if self.done {
                return None;
            }
            match self.events.recv().await {
                Some(event) => self.render(event),
                None => self.fail(ApiError::server("the engine stopped before the request finished")),
            }
        }
    }

    fn push(&mut self, name: &'static str, value: Value) {
        self.queue
            .push_back(SseEvent::default().event(name).data(value.to_string()));
    }

    /// `message_start` (before the first token: the prompt's size is not known yet,
    /// so its usage counts arrive with `message_delta`).
    fn start(&mut self) {
        if self.started {
            return;
        }
        self.started = true;
        let usage = json!({"input_tokens": 0, "output_tokens": 0});
        let message = self.reply.message(json!([]), (None, None), usage);
        self.push("message_start", json!({"type": "message_start", "message": message}));
    }

    /// Index of the next block.
    fn next_index(&self) -> usize {
        self.block.map_or(0, |(_, index)| index + 1)
    }

    fn close_block(&mut self) {
        if let Some((_, index)) = self.block {
            self.push(
                "content_block_stop",
                json!({"type": "content_block_stop", "index": index}),
            );
        }
    }

    fn push_outs(&mut self, outs: Vec<Out>) {
        for out in outs {
            match out {
                Out::Content(text) => self.text_delta(Block::Text, &text),
                Out::Reasoning(text) => self.text_delta(Block::Thinking, &text),
                Out::Call(call) => {
                    self.close_block();
                    let index = self.next_index();
                    let mut block = self.reply.tool_use(&call);
                    let input = std::mem::replace(&mut block["input"], json!({}));
                    self.push(
                        "content_block_start",
                        json!({"type": "content_block_start", "index": index, "content_block": block}),
                    );
                    let delta = json!({"type": "content_block_delta", "index": index,
                        "delta": {"type": "input_json_delta", "partial_json": input.to_string()}});
                    self.push("content_block_delta", delta);
                    self.block = Some((Block::ToolUse, index));
                }
            }
        }
    }

    /// `text` added to the open `kind` (text or thinking) block, or to a new one.
    fn text_delta(&mut self, kind: Block, text: &str) {
        if text.is_empty() {
            return;
        }
        let index = match self.block {
            Some((open, index)) if open == kind => index,
            _ => {
                self.close_block();
                let index = self.next_index();
                let start = json!({"type": "content_block_start", "index": index, "content_block": kind.empty()});
                self.push("content_block_start", start);
                self.block = Some((kind, index));
                index
            }
        };
        let (_, field, delta) = kind.names();
        let delta = json!({"type": "content_block_delta", "index": index,
            "delta": {"type": delta, field: text}});
        self.push("content_block_delta", delta);
    }

    fn render(&mut self, event: Event) {
        self.start();
        match event {
            Event::Token(token) => {
                self.reply.timing.token(&self.reply.state.metrics);
                let outs = self.reply.blocks(&token.text, false);
                self.push_outs(outs);
            }
            Event::Finished(finish) => {
                let outs = self.reply.blocks(&finish.tail, true);
                self.push_outs(outs);
                self.close_block();
                let delta = json!({
                    "type": "message_delta",
                    "delta": {"stop_reason": self.reply.stop_reason(&finish), "stop_sequence": finish.stop_string},
                    "usage": {"input_tokens": finish.prompt_tokens, "output_tokens": finish.completion_tokens,
                        "cache_read_input_tokens": finish.cached_tokens},
                });
                self.push("message_delta", delta);
                self.push("message_stop", json!({"type": "message_stop"}));
                self.done = true;
                self.reply.record(Outcome::Ok);
            }
            Event::Failed(failure) => self.fail(ApiError::from(failure)),
        }
    }

    /// An `error` event ends the stream.
    fn fail(&mut self, error: ApiError) {
        self.reply.record(error.outcome());
        let body = anthropic::error_body(error.status.as_u16(), &error.body.error.message);
        self.push("error", body);
        self.done = true;
    }
}
