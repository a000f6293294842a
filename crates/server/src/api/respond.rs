//! Answers in OpenAI's shapes: a whole response, or server-sent events as tokens arrive.

use super::*;

#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    Chat,
    Completion,
}

pub(super) async fn respond(
    state: Arc<AppState>,
    prepared: Prepared,
    kind: Kind,
    logprobs: bool,
    parser: Option<OutputSplitter>,
    arrived: Instant,
) -> Result<Response, ApiError> {
    let Prepared {
        job,
        events,
        stream,
        include_usage,
    } = prepared;
    state.engine.submit(job)?;
    let id = state.new_id(if kind == Kind::Chat { "chatcmpl" } else { "cmpl" });
    let writer = Writer {
        state: state.clone(),
        id,
        kind,
        logprobs,
        created: unix_time(),
        timing: Timing::new(arrived),
    };
    if stream {
        let stream = SseStream {
            writer,
            parser,
            events,
            queue: VecDeque::new(),
            include_usage,
            started: false,
            done: false,
            calls_sent: 0,
        };
        let body = futures_util::stream::unfold(stream, |mut s| async move { s.next().await.map(|e| (e, s)) });
        return Ok(Sse::new(body).keep_alive(KeepAlive::default()).into_response());
    }
    let mut events = events;
    let mut writer = writer;
    let mut text = String::new();
    let mut tokens = Vec::new();
    while let Some(event) = events.recv().await {
        match event {
            Event::Token(token) => {
                writer.token_arrived();
                text.push_str(&token.text);
                tokens.push(token);
            }
            Event::Finished(finish) => {
                text.push_str(&finish.tail);
                let usage = usage(&finish);
                let mut reason = finish_reason(finish.reason);
                let message = match parser {
                    Some(mut parser) => {
                        let mut outs = parser.push(&text);
                        outs.extend(parser.finish());
                        if parser.n_calls() > 0 {
                            reason = "tool_calls";
                        }
                        writer.message(&outs)
                    }
                    None => json!({ "role": "assistant", "content": text }),
                };
                writer.record(Outcome::Ok);
                return Ok(Json(writer.whole(&text, message, &tokens, reason, usage)).into_response());
            }
            Event::Failed(failure) => return Err(ApiError::from(failure)),
        }
    }
    Err(ApiError::server("the engine stopped before the request finished"))
}

fn usage(finish: &baton_engine::Finish) -> Usage {
    Usage {
        prompt_tokens: finish.prompt_tokens,
        completion_tokens: finish.completion_tokens,
        total_tokens: finish.prompt_tokens + finish.completion_tokens,
        prompt_tokens_details: PromptTokensDetails {
            cached_tokens: finish.cached_tokens,
        },
    }
}

fn finish_reason(reason: FinishReason) -> &'static str {
    match reason {
        FinishReason::Stop => "stop",
        FinishReason::Length => "length",
    }
}

/// Renders responses of one request.
struct Writer {
    state: Arc<AppState>,
    id: String,
    kind: Kind,
    logprobs: bool,
    created: u64,
    timing: Timing,
}

impl Writer {
    fn endpoint(&self) -> &'static str {
        match self.kind {
            Kind::Chat => "chat",
            Kind::Completion => "completions",
        }
    }

    fn record(&self, outcome: Outcome) {
        self.state.metrics.request(self.endpoint(), outcome);
    }

    fn token_arrived(&mut self) {
        self.timing.token(&self.state.metrics);
    }

    fn token_text(&self, id: u32) -> String {
        String::from_utf8_lossy(&self.state.vocab.token_bytes(id, false)).into_owned()
    }

    fn chat_logprobs(&self, tokens: &[TokenOut]) -> Value {
        let entry = |id: u32, logprob: f32| {
            let text = self.token_text(id);
            json!({ "token": text, "logprob": logprob, "bytes": text.as_bytes() })
        };
        let content: Vec<Value> = tokens
            .iter()
            .map(|t| {
                let mut e = entry(t.id, t.logprob);
                e["top_logprobs"] = t.top.iter().map(|&(id, lp)| entry(id, lp)).collect();
                e
            })
            .collect();
        json!({ "content": content })
    }

    fn completion_logprobs(&self, tokens: &[TokenOut], offset: usize) -> Value {
        let mut text_offset = Vec::new();
        let mut at = offset;
        for t in tokens {
            text_offset.push(at);
            at += t.text.len();
        }
        let top: Vec<Value> = tokens
            .iter()
            .map(|t| Value::Object(t.top.iter().map(|&(id, lp)| (self.token_text(id), json!(lp))).collect()))
            .collect();
        json!({
            "tokens": tokens.iter().map(|t| self.token_text(t.id)).collect::<Vec<_>>(),
            "token_logprobs": tokens.iter().map(|t| t.logprob).collect::<Vec<_>>(),
            "top_logprobs": top,
            "text_offset": text_offset,
        })
    }

    fn logprobs_value(&self, tokens: &[TokenOut], offset: usize) -> Value {
        match (self.logprobs, self.kind) {
            (false, _) => Value::Null,
            (true, Kind::Chat) => self.chat_logprobs(tokens),
            (true, Kind::Completion) => self.completion_logprobs(tokens, offset),
        }
    }

    fn model(&self) -> &str {
        &self.state.config.model_id
    }

    /// A tool call as OpenAI writes it; `index` counts the request's calls.
    fn tool_call(&self, index: usize, call: &tools::ToolCall) -> Value {
        json!({
            "index": index,
            "id": format!("call_{}_{index}", self.id.rsplit('-').next().unwrap_or_default()),
            "type": "function",
            "function": { "name": call.name, "arguments": call.arguments },
        })
    }

    /// The assistant message for what the splitter released.
    fn message(&self, outs: &[Out]) -> Value {
        let mut content = String::new();
        let mut reasoning = String::new();
        let mut calls = Vec::new();
        for out in outs {
            match out {
                Out::Content(text) => content.push_str(text),
                Out::Reasoning(text) => reasoning.push_str(text),
                Out::Call(call) => {
                    let mut call = self.tool_call(calls.len(), call);
                    if let Some(object) = call.as_object_mut() {
                        object.remove("index");
                    }
                    calls.push(call);
                }
            }
        }
        let mut message = json!({ "role": "assistant", "content": content });
        if !calls.is_empty() {
            if content.is_empty() {
                message["content"] = Value::Null;
            }
            message["tool_calls"] = Value::Array(calls);
        }
        if !reasoning.is_empty() {
            message["reasoning_content"] = json!(reasoning);
        }
        message
    }

    /// A whole (non-streamed) response; `message` is the chat message to send.
    fn whole(&self, text: &str, message: Value, tokens: &[TokenOut], reason: &str, usage: Usage) -> Value {
        let logprobs = self.logprobs_value(tokens, 0);
        let choice = match self.kind {
            Kind::Chat => json!({
                "index": 0,
                "message": message,
                "logprobs": logprobs,
                "finish_reason": reason,
            }),
            Kind::Completion => json!({ "index": 0, "text": text, "logprobs": logprobs, "finish_reason": reason }),
        };
        json!({
            "id": self.id,
            "object": if self.kind == Kind::Chat { "chat.completion" } else { "text_completion" },
            "created": self.created,
            "model": self.model(),
            "choices": [choice],
            "usage": usage,
        })
    }

    /// One streamed chunk: `text` (and `role` on the first chat chunk), or the end.
    fn chunk(&self, text: Option<&str>, role: bool, tokens: &[TokenOut], offset: usize, reason: Option<&str>) -> Value {
        let logprobs = if tokens.is_empty() {
            Value::Null
        } else {
            self.logprobs_value(tokens, offset)
        };
        let choice = match self.kind {
            Kind::Chat => {
                let mut delta = json!({});
                if role {
                    delta["role"] = json!("assistant");
                }
                if let Some(text) = text {
                    delta["content"] = json!(text);
                }
                json!({ "index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": reason })
            }
            Kind::Completion => {
                json!({ "index": 0, "text": text.unwrap_or(""), "logprobs": logprobs, "finish_reason": reason })
            }
        };
        json!({
            "id": self.id,
            "object": if self.kind == Kind::Chat { "chat.completion.chunk" } else { "text_completion" },
            "created": self.created,
            "model": self.model(),
            "choices": [choice],
        })
    }

    fn usage_chunk(&self, usage: Usage) -> Value {
        json!({
            "id": self.id,
            "object": if self.kind == Kind::Chat { "chat.completion.chunk" } else { "text_completion" },
            "created": self.created,
            "model": self.model(),
            "choices": [],
            "usage": usage,
        })
    }
}

/// Engine events turned into server-sent events.
struct SseStream {
    writer: Writer,
    /// Separates reasoning and tool calls from content.
    parser: Option<OutputSplitter>,
    events: UnboundedReceiver<Event>,
    queue: VecDeque<SseEvent>,
    include_usage: bool,
    started: bool,
    done: bool,
    /// Tool calls streamed so far.
    calls_sent: usize,
}

impl Drop for SseStream {
    /// A stream dropped before its end: the client went away.
    fn drop(&mut self) {
        if !self.done {
            self.writer.record(Outcome::Cancelled);
        }
    }
}

impl SseStream {
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
                None => {
                    let error = ApiError::server("the engine stopped before the request finished").body;
                    self.push(&serde_json::to_value(error).unwrap_or_default());
                    self.done = true;
                    self.writer.record(Outcome::ServerError);
                }
            }
        }
    }

    /// Chunks for what the splitter released; `logprobs`: the token's, sent with
    /// the first chunk (or alone when nothing was released).
    fn push_outs(&mut self, outs: Vec<Out>, mut logprobs: Option<&[TokenOut]>) {
        for out in outs {
            let tokens = logprobs.take().unwrap_or(&[]);
            let mut chunk = self.writer.chunk(None, false, tokens, 0, None);
            let delta = &mut chunk["choices"][0]["delta"];
            match out {
                Out::Content(text) => delta["content"] = json!(text),
                Out::Reasoning(text) => delta["reasoning_content"] = json!(text),
                Out::Call(call) => {
                    delta["tool_calls"] = json!([self.writer.tool_call(self.calls_sent, &call)]);
                    self.calls_sent += 1;
                }
            }
            self.push(&chunk);
        }
        if let Some(tokens) = logprobs {
            let chunk = self.writer.chunk(Some(""), false, tokens, 0, None);
            self.push(&chunk);
        }
    }

    fn push(&mut self, value: &Value) {
        self.queue.push_back(SseEvent::default().data(value.to_string()));
    }

    fn start(&mut self) {
        if !self.started && self.writer.kind == Kind::Chat {
            let first = self.writer.chunk(Some(""), true, &[], 0, None);
            self.push(&first);
        }
        self.started = true;
    }

    fn render(&mut self, event: Event) {
        self.start();
        match event {
            Event::Token(token) => {
                self.writer.token_arrived();
                if let Some(parser) = self.parser.as_mut() {
                    let outs = parser.push(&token.text);
                    let logprobs = self.writer.logprobs.then(|| std::slice::from_ref(&token));
                    self.push_outs(outs, logprobs);
                    return;
                }
                if token.text.is_empty() && !self.writer.logprobs {
                    return;
                }
                let chunk = self
                    .writer
                    .chunk(Some(&token.text), false, std::slice::from_ref(&token), 0, None);
                self.push(&chunk);
            }
            Event::Finished(finish) => {
                let mut reason = finish_reason(finish.reason);
                if let Some(parser) = self.parser.as_mut() {
                    let mut outs = parser.push(&finish.tail);
                    outs.extend(parser.finish());
                    if parser.n_calls() > 0 {
                        reason = "tool_calls";
                    }
                    self.push_outs(outs, None);
                } else if !finish.tail.is_empty() {
                    let chunk = self.writer.chunk(Some(&finish.tail), false, &[], 0, None);
                    self.push(&chunk);
                }
                let last = self.writer.chunk(None, false, &[], 0, Some(reason));
                self.push(&last);
                if self.include_usage {
                    let usage = self.writer.usage_chunk(usage(&finish));
                    self.push(&usage);
                }
                self.queue.push_back(SseEvent::default().data("[DONE]"));
                self.done = true;
                self.writer.record(Outcome::Ok);
            }
            Event::Failed(failure) => {
                let error = ApiError::from(failure);
                self.writer.record(error.outcome());
                self.push(&serde_json::to_value(error.body).unwrap_or_default());
                self.done = true;
            }
        }
    }
}
