//! `POST /v1/responses`: OpenAI's Responses API over the chat endpoint's job (see
//! `crate::responses` for the request), answered as a response object, or its event
//! sequence (`response.created`, per output item `response.output_item.added`, the
//! text's `response.content_part.added`/`response.output_text.delta`/`.done` (a
//! `reasoning` item's: `response.reasoning_text.delta`/`.done`) or a call's
//! `response.function_call_arguments.delta`/`.done`, `response.output_item.done`, then
//! `response.completed` or `response.incomplete`). The model's thinking is a
//! `reasoning` item before the message, its text a `reasoning_text` content part. The
//! server keeps no responses.

use super::*;

const ENDPOINT: &str = "responses";

pub(super) async fn responses(State(state): State<Arc<AppState>>, body: Body) -> Result<Response, ApiError> {
    let result = responses_inner(state.clone(), body, Instant::now()).await;
    record_refusal(&state, ENDPOINT, &result);
    result
}

async fn responses_inner(state: Arc<AppState>, body: Body, arrived: Instant) -> Result<Response, ApiError> {
    let body = read_body(&state, body).await?;
    let (req, echo) = state
        .off_runtime(move |state| {
            let given: Value = request::parse_json(&body)?;
            let chat = crate::responses::to_chat(&given)?;
            let req = request::chat(chat.to_string().as_bytes(), &state.config.model_id)?;
            // What a response object repeats of its request.
            let echo = json!({
                "instructions": given.get("instructions").cloned().unwrap_or(Value::Null),
                "tools": given.get("tools").cloned().unwrap_or_else(|| json!([])),
                "tool_choice": given.get("tool_choice").cloned().unwrap_or_else(|| json!("auto")),
                "parallel_tool_calls": given.get("parallel_tool_calls").cloned().unwrap_or(json!(true)),
                "temperature": given.get("temperature").cloned().unwrap_or(Value::Null),
                "top_p": given.get("top_p").cloned().unwrap_or(Value::Null),
                "max_output_tokens": given.get("max_output_tokens").cloned().unwrap_or(Value::Null),
                "text": given.get("text").cloned().unwrap_or_else(|| json!({"format": {"type": "text"}})),
                "metadata": given.get("metadata").cloned().unwrap_or_else(|| json!({})),
            });
            Ok((req, echo))
        })
        .await?;
    let (prepared, parser) = chat_job(&state, req).await?;
    let Prepared {
        job, events, stream, ..
    } = prepared;
    state.engine.submit(job)?;
    let id = state.new_id("resp");
    let reply = Reply {
        suffix: id.rsplit('-').next().unwrap_or_default().to_string(),
        id,
        echo,
        created: unix_time(),
        state: state.clone(),
        timing: Timing::new(arrived),
        parser,
        items: Vec::new(),
    };
    if stream {
        let stream = ResponseStream {
            reply,
            events,
            queue: VecDeque::new(),
            text: None,
            sequence: 0,
            started: false,
            done: false,
        };
        let body = futures_util::stream::unfold(stream, |mut s| async move { s.next().await.map(|e| (e, s)) });
        return Ok(Sse::new(body).keep_alive(KeepAlive::default()).into_response());
    }
    reply.whole(events).await
}

struct Reply {
    id: String,
    /// The id's unique part, for the ids of its items.
    suffix: String,
    echo: Value,
    created: u64,
    state: Arc<AppState>,
    timing: Timing,
    parser: Option<OutputSplitter>,
    /// The output items so far.
    items: Vec<Value>,
}

impl Reply {
    fn record(&self, outcome: Outcome) {
        self.state.metrics.request(ENDPOINT, outcome);
    }

    fn outs(&mut self, text: &str, last: bool) -> Vec<Out> {
        answer_outs(self.parser.as_mut(), text, last)
    }

    fn message_item(&self, text: &str, status: &str) -> Value {
        self.text_item(TextItem::Message, text, status)
    }

    /// A message or reasoning item holding `text`.
    fn text_item(&self, kind: TextItem, text: &str, status: &str) -> Value {
        let n = self.items.len();
        match kind {
            TextItem::Message => json!({
                "type": "message", "id": format!("msg_{}_{n}", self.suffix), "status": status,
                "role": "assistant", "content": [kind.part(text)],
            }),
            TextItem::Reasoning => json!({
                "type": "reasoning", "id": format!("rs_{}_{n}", self.suffix), "status": status,
                "summary": [], "content": [kind.part(text)],
            }),
        }
    }

    fn call_item(&self, call: &tools::ToolCall) -> Value {
        let n = self.items.len();
        json!({
            "type": "function_call", "id": format!("fc_{}_{n}", self.suffix),
            "call_id": format!("call_{}_{n}", self.suffix), "name": call.name, "arguments": call.arguments,
            "status": "completed",
        })
    }

    /// The response object as it stands, `status` `in_progress`, `completed` or
    /// `incomplete`.
    fn object(&self, status: &str, finish: Option<&baton_engine::Finish>) -> Value {
        let mut object = json!({
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "model": self.state.config.model_id, "output": self.items, "error": null,
            "incomplete_details": null, "usage": null,
        });
        if let (Some(echo), Some(out)) = (self.echo.as_object(), object.as_object_mut()) {
            out.extend(echo.iter().map(|(k, v)| (k.clone(), v.clone())));
        }
        if let Some(finish) = finish {
            if finish.reason == FinishReason::Length {
                object["incomplete_details"] = json!({"reason": "max_output_tokens"});
            }
            object["usage"] = json!({
                "input_tokens": finish.prompt_tokens,
                "input_tokens_details": {"cached_tokens": finish.cached_tokens},
                "output_tokens": finish.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": finish.prompt_tokens + finish.completion_tokens,
            });
        }
        object
    }

    fn status(finish: &baton_engine::Finish) -> &'static str {
        match finish.reason {
            FinishReason::Length => "incomplete",
            FinishReason::Stop => "completed",
        }
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
                    let status = Reply::status(&finish);
                    let mut content = String::new();
                    let mut reasoning = String::new();
                    let mut calls = Vec::new();
                    for out in self.outs(&text, true) {
                        match out {
                            Out::Content(text) => content.push_str(&text),
                            Out::Reasoning(text) => reasoning.push_str(&text),
                            Out::Call(call) => calls.push(call),
                        }
                    }
                    // The thinking, then the answer, then the calls.
                    if !reasoning.is_empty() {
                        let item = self.text_item(TextItem::Reasoning, &reasoning, "completed");
                        self.items.push(item);
                    }
                    if !content.is_empty() || calls.is_empty() {
                        let item = self.message_item(&content, status);
                        self.items.push(item);
                    }
                    for call in &calls {
                        let item = self.call_item(call);
                        self.items.push(item);
                    }
                    self.record(Outcome::Ok);
                    return Ok(Json(self.object(status, Some(&finish))).into_response());
                }
                Event::Failed(failure) => return Err(ApiError::from(failure)),
            }
        }
        Err(ApiError::server("the engine stopped before the request finished"))
    }
}

/// An output item made of text.
#[derive(Clone, Copy, PartialEq, Eq)]
enum TextItem {
    /// The answer.
    Message,
    /// The model's thinking.
    Reasoning,
}

impl TextItem {
    /// Its content part holding `text`.
    fn part(self, text: &str) -> Value {
        match self {
            TextItem::Message => json!({"type": "output_text", "text": text, "annotations": []}),
            TextItem::Reasoning => json!({"type": "reasoning_text", "text": text}),
        }
    }

    /// The events for its text: a delta and the whole.
    fn events(self) -> (&'static str, &'static str) {
        match self {
            TextItem::Message => ("response.output_text.delta", "response.output_text.done"),
            TextItem::Reasoning => ("response.reasoning_text.delta", "response.reasoning_text.done"),
        }
    }
}

struct ResponseStream {
    reply: Reply,
    events: UnboundedReceiver<Event>,
    queue: VecDeque<SseEvent>,
    /// The text item being written: what it is, its index in the output and its text
    /// so far.
    text: Option<(TextItem, usize, String)>,
    sequence: u64,
    started: bool,
    done: bool,
}

impl Drop for ResponseStream {
    fn drop(&mut self) {
        if !self.done {
            self.reply.record(Outcome::Cancelled);
        }
    }
}

impl ResponseStream {
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

    /// An event named by its `type`, numbered.
    fn push(&mut self, kind: &'static str, mut value: Value) {
        value["type"] = json!(kind);
        value["sequence_number"] = json!(self.sequence);
        self.sequence += 1;
        self.queue
            .push_back(SseEvent::default().event(kind).data(value.to_string()));
    }

    fn start(&mut self) {
        if self.started {
            return;
        }
        self.started = true;
        let response = self.reply.object("in_progress", None);
        self.push("response.created", json!({"response": response}));
        self.push("response.in_progress", json!({"response": response}));
    }

    /// Ends the open text item, if any.
    fn close_text(&mut self, status: &str) {
        let Some((kind, index, text)) = self.text.take() else {
            return;
        };
        let mut item = self.reply.text_item(kind, &text, status);
        item["id"] = self.reply.items[index]["id"].clone();
        let id = item["id"].clone();
        let part = kind.part(&text);
        let at = json!({"item_id": id, "output_index": index, "content_index": 0});
        let mut done = at.clone();
        done["text"] = json!(text);
        self.push(kind.events().1, done);
        let mut part_done = at;
        part_done["part"] = part;
        self.push("response.content_part.done", part_done);
        self.reply.items[index] = item.clone();
        self.push(
            "response.output_item.done",
            json!({"output_index": index, "item": item}),
        );
    }

    fn push_outs(&mut self, outs: Vec<Out>) {
        for out in outs {
            match out {
                Out::Content(delta) => self.text_delta(TextItem::Message, &delta),
                Out::Reasoning(delta) => self.text_delta(TextItem::Reasoning, &delta),
                Out::Call(call) => {
                    self.close_text("completed");
                    let index = self.reply.items.len();
                    let item = self.reply.call_item(&call);
                    let mut added = item.clone();
                    added["arguments"] = json!("");
                    added["status"] = json!("in_progress");
                    self.reply.items.push(item.clone());
                    self.push(
                        "response.output_item.added",
                        json!({"output_index": index, "item": added}),
                    );
                    let at = json!({"item_id": item["id"], "output_index": index});
                    let mut delta = at.clone();
                    delta["delta"] = json!(call.arguments);
                    self.push("response.function_call_arguments.delta", delta);
                    let mut done = at;
                    done["arguments"] = json!(call.arguments);
                    self.push("response.function_call_arguments.done", done);
                    self.push(
                        "response.output_item.done",
                        json!({"output_index": index, "item": item}),
                    );
                }
            }
        }
    }

    /// `delta` added to the open `kind` item, or to a new one (closing another).
    fn text_delta(&mut self, kind: TextItem, delta: &str) {
        if delta.is_empty() {
            return;
        }
        if self.text.as_ref().is_some_and(|(open, ..)| *open != kind) {
            self.close_text("completed");
        }
        if self.text.is_none() {
            let index = self.reply.items.len();
            let mut item = self.reply.text_item(kind, "", "in_progress");
            item["content"] = json!([]);
            self.reply.items.push(item.clone());
            self.push(
                "response.output_item.added",
                json!({"output_index": index, "item": item}),
            );
            self.push(
                "response.content_part.added",
                json!({"item_id": item["id"], "output_index": index, "content_index": 0, "part": kind.part("")}),
            );
            self.text = Some((kind, index, String::new()));
        }
        let Some((_, index, text)) = self.text.as_mut() else {
            return;
        };
        text.push_str(delta);
        let (index, id) = (*index, self.reply.items[*index]["id"].clone());
        self.push(
            kind.events().0,
            json!({"item_id": id, "output_index": index, "content_index": 0, "delta": delta}),
        );
    }

    fn render(&mut self, event: Event) {
        self.start();
        match event {
            Event::Token(token) => {
                self.reply.timing.token(&self.reply.state.metrics);
                let outs = self.reply.outs(&token.text, false);
                self.push_outs(outs);
            }
            Event::Finished(finish) => {
                let outs = self.reply.outs(&finish.tail, true);
                self.push_outs(outs);
                let status = Reply::status(&finish);
                self.close_text(status);
                let response = self.reply.object(status, Some(&finish));
                let kind = match status {
                    "incomplete" => "response.incomplete",
                    _ => "response.completed",
                };
                self.push(kind, json!({"response": response}));
                self.done = true;
                self.reply.record(Outcome::Ok);
            }
            Event::Failed(failure) => self.fail(ApiError::from(failure)),
        }
    }

    /// A `response.failed` event ends the stream.
    fn fail(&mut self, error: ApiError) {
        self.reply.record(error.outcome());
        let mut response = self.reply.object("failed", None);
        response["error"] = json!({"code": error.body.error.kind, "message": error.body.error.message});
        self.push("response.failed", json!({"response": response}));
        self.done = true;
    }
}
