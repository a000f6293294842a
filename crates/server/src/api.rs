//! The HTTP handlers: parse and check a request, turn it into a prompt, hand it to the
//! engine, and answer in OpenAI's shapes, whole or as server-sent events.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::body::{to_bytes, Body};
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::Next;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use baton_ggml::LlamaModel;
use baton_node::engine::{Engine, Event, FinishReason, Job, SubmitError, TokenOut};
use baton_sample::SamplingParams;
use serde_json::{json, Value};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

use crate::openai::{
    ChatRequest, CompletionRequest, Content, ErrorBody, ErrorDetail, Prompt, PromptTokensDetails, Sampling, Usage,
};
use crate::template::{ChatMessage, ChatTemplate};

/// How the API behaves.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// The id clients name the model by.
    pub model_id: String,
    /// Required `Authorization: Bearer` key for `/v1/*`, if set.
    pub api_key: Option<String>,
    /// Largest request body in bytes.
    pub max_body: usize,
}

/// Everything the handlers share.
pub struct AppState {
    engine: Engine,
    vocab: Arc<LlamaModel>,
    template: ChatTemplate,
    config: ServerConfig,
    created: u64,
    next_id: AtomicU64,
}

impl AppState {
    /// Serves `engine`'s model; `vocab` tokenizes, `template` renders chats.
    pub fn new(engine: Engine, vocab: Arc<LlamaModel>, template: ChatTemplate, config: ServerConfig) -> AppState {
        AppState {
            engine,
            vocab,
            template,
            config,
            created: unix_time(),
            next_id: AtomicU64::new(1),
        }
    }

    fn new_id(&self, prefix: &str) -> String {
        format!(
            "{prefix}-{:x}{:06x}",
            self.created,
            self.next_id.fetch_add(1, Ordering::Relaxed)
        )
    }
}

/// The routes.
pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/stats", get(stats))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(axum::middleware::from_fn_with_state(state.clone(), authenticate))
        .with_state(state)
}

/// An error in OpenAI's shape.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    body: ErrorBody,
}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, code: Option<&'static str>, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            body: ErrorBody {
                error: ErrorDetail {
                    message: message.into(),
                    kind,
                    param: None,
                    code,
                },
            },
        }
    }

    fn invalid(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, "invalid_request_error", None, message)
    }

    fn param(mut self, param: &'static str) -> ApiError {
        self.body.error.param = Some(param);
        self
    }

    fn server(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", None, message)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, Json(self.body)).into_response()
    }
}

impl From<SubmitError> for ApiError {
    fn from(e: SubmitError) -> ApiError {
        match e {
            SubmitError::TooLong { .. } => ApiError::new(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                Some("context_length_exceeded"),
                e.to_string(),
            )
            .param("messages"),
            SubmitError::EmptyPrompt => ApiError::invalid(e.to_string()).param("prompt"),
            SubmitError::Overloaded { .. } => ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                Some("server_overloaded"),
                e.to_string(),
            ),
            SubmitError::Unavailable(_) => ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                Some("unavailable"),
                e.to_string(),
            ),
        }
    }
}

async fn authenticate(State(state): State<Arc<AppState>>, request: Request, next: Next) -> Response {
    let Some(key) = state.config.api_key.as_deref() else {
        return next.run(request).await;
    };
    if !request.uri().path().starts_with("/v1/") {
        return next.run(request).await;
    }
    let given = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    match given {
        Some(given) if constant_time_eq(given.as_bytes(), key.as_bytes()) => next.run(request).await,
        Some(_) => ApiError::new(
            StatusCode::UNAUTHORIZED,
            "invalid_request_error",
            Some("invalid_api_key"),
            "Incorrect API key provided.",
        )
        .into_response(),
        None => ApiError::new(
            StatusCode::UNAUTHORIZED,
            "invalid_request_error",
            Some("invalid_api_key"),
            "You didn't provide an API key: send it as 'Authorization: Bearer KEY'.",
        )
        .into_response(),
    }
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

async fn not_found(request: Request) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "invalid_request_error",
        Some("unknown_url"),
        format!("Unknown request URL: {} {}", request.method(), request.uri().path()),
    )
}

async fn method_not_allowed(request: Request) -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "invalid_request_error",
        Some("method_not_allowed"),
        format!("{} is not allowed on {}", request.method(), request.uri().path()),
    )
}

async fn models(State(state): State<Arc<AppState>>) -> Json<Value> {
    Json(json!({
        "object": "list",
        "data": [{ "id": state.config.model_id, "object": "model", "created": state.created, "owned_by": "baton" }],
    }))
}

async fn health(State(state): State<Arc<AppState>>) -> Response {
    let counters = state.engine.counters();
    match state.engine.failure() {
        Some(reason) => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({ "status": "error", "error": reason })),
        )
            .into_response(),
        None => Json(json!({
            "status": "ok",
            "active": counters.active.load(Ordering::Relaxed),
            "queued": counters.queued.load(Ordering::Relaxed),
        }))
        .into_response(),
    }
}

async fn stats(State(state): State<Arc<AppState>>) -> Result<Json<Value>, ApiError> {
    let stages = tokio::time::timeout(Duration::from_secs(10), state.engine.stage_stats())
        .await
        .map_err(|_| ApiError::server("the stages did not answer within 10 s"))?
        .map_err(ApiError::server)?;
    let c = state.engine.counters();
    let load = |v: &AtomicU64| v.load(Ordering::Relaxed);
    Ok(Json(json!({
        "prompt_tokens_computed": load(&c.prompt_tokens_computed),
        "prompt_tokens_reused": load(&c.prompt_tokens_reused),
        "completion_tokens": load(&c.completion_tokens),
        "requests_finished": load(&c.requests_finished),
        "requests_cancelled": load(&c.requests_cancelled),
        "requests_failed": load(&c.requests_failed),
        "steps": load(&c.steps),
        "active": c.active.load(Ordering::Relaxed),
        "queued": c.queued.load(Ordering::Relaxed),
        "slot_ctx": state.engine.slot_ctx(),
        "stages": stages.resident.iter().zip(&stages.kv_used)
            .map(|(resident, kv)| json!({ "resident_bytes": resident, "kv_cells_used": kv }))
            .collect::<Vec<_>>(),
    })))
}

async fn read_json<T: serde::de::DeserializeOwned>(state: &AppState, body: Body) -> Result<T, ApiError> {
    let bytes = to_bytes(body, state.config.max_body).await.map_err(|_| {
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            Some("request_too_large"),
            format!(
                "the request body is larger than {} bytes (or could not be read)",
                state.config.max_body
            ),
        )
    })?;
    serde_json::from_slice(&bytes).map_err(|e| {
        let what = if e.is_syntax() || e.is_eof() {
            "malformed JSON"
        } else {
            "invalid request"
        };
        ApiError::invalid(format!("{what}: {e}"))
    })
}

/// A request made ready for the engine.
struct Prepared {
    job: Job,
    events: UnboundedReceiver<Event>,
    stream: bool,
    include_usage: bool,
}

fn prepare(
    state: &AppState,
    sampling: &Sampling,
    prompt: Vec<u32>,
    logprobs: bool,
    top_logprobs: u8,
) -> Result<Prepared, ApiError> {
    if let Some(model) = &sampling.model {
        if model != &state.config.model_id {
            return Err(ApiError::new(
                StatusCode::NOT_FOUND,
                "invalid_request_error",
                Some("model_not_found"),
                format!(
                    "The model '{model}' does not exist; this server serves '{}'.",
                    state.config.model_id
                ),
            )
            .param("model"));
        }
    }
    if sampling.n.is_some_and(|n| n != 1) {
        return Err(ApiError::invalid("only n = 1 is supported").param("n"));
    }
    let check = |ok: bool, param: &'static str, message: &str| {
        if ok {
            Ok(())
        } else {
            Err(ApiError::invalid(message.to_string()).param(param))
        }
    };
    let temperature = sampling.temperature.unwrap_or(1.0);
    check(
        (0.0..=2.0).contains(&temperature),
        "temperature",
        "temperature must be between 0 and 2",
    )?;
    let top_p = sampling.top_p.unwrap_or(1.0);
    check(top_p > 0.0 && top_p <= 1.0, "top_p", "top_p must be in (0, 1]")?;
    let presence_penalty = sampling.presence_penalty.unwrap_or(0.0);
    check(
        (-2.0..=2.0).contains(&presence_penalty),
        "presence_penalty",
        "presence_penalty must be between -2 and 2",
    )?;
    let frequency_penalty = sampling.frequency_penalty.unwrap_or(0.0);
    check(
        (-2.0..=2.0).contains(&frequency_penalty),
        "frequency_penalty",
        "frequency_penalty must be between -2 and 2",
    )?;
    check(
        top_logprobs <= 20,
        "top_logprobs",
        "top_logprobs must be between 0 and 20",
    )?;
    let stop = sampling.stop.clone().map(|s| s.into_vec()).unwrap_or_default();
    check(stop.len() <= 4, "stop", "at most 4 stop strings are allowed")?;
    let params = SamplingParams {
        temperature,
        top_k: sampling.top_k.unwrap_or(0),
        top_p,
        min_p: sampling.min_p.unwrap_or(0.0),
        repeat_penalty: sampling.repeat_penalty.unwrap_or(1.0),
        frequency_penalty,
        presence_penalty,
        seed: sampling.seed.unwrap_or_else(random_seed),
        ..SamplingParams::default()
    };
    params.validate().map_err(|e| ApiError::invalid(e.to_string()))?;

    let slot_ctx = state.engine.slot_ctx();
    if prompt.len() >= slot_ctx {
        return Err(SubmitError::TooLong {
            slot_ctx,
            prompt: prompt.len(),
            max_tokens: 1,
        }
        .into());
    }
    let max_tokens = match sampling.max_completion_tokens.or(sampling.max_tokens) {
        Some(0) => return Err(ApiError::invalid("max_tokens must be at least 1").param("max_tokens")),
        Some(n) => usize::try_from(n).unwrap_or(usize::MAX),
        None => slot_ctx - prompt.len(),
    };
    let (tx, events) = unbounded_channel();
    let job = Job {
        prompt,
        params,
        max_tokens,
        logprobs,
        top_logprobs,
        stop,
        events: tx,
    };
    Ok(Prepared {
        job,
        events,
        stream: sampling.stream,
        include_usage: sampling.stream_options.as_ref().is_some_and(|o| o.include_usage),
    })
}

fn random_seed() -> u64 {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    nanos ^ (std::process::id() as u64).rotate_left(32)
}

fn unix_time() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

async fn chat(State(state): State<Arc<AppState>>, _headers: HeaderMap, body: Body) -> Result<Response, ApiError> {
    let req: ChatRequest = read_json(&state, body).await?;
    if req.messages.is_empty() {
        return Err(ApiError::invalid("messages must not be empty").param("messages"));
    }
    let mut messages = Vec::with_capacity(req.messages.len());
    for message in &req.messages {
        let content = match &message.content {
            None => String::new(),
            Some(Content::Text(text)) => text.clone(),
            Some(Content::Parts(parts)) => {
                let mut text = String::new();
                for part in parts {
                    match (part.kind.as_str(), &part.text) {
                        ("text", Some(t)) => text.push_str(t),
                        (kind, _) => {
                            return Err(ApiError::invalid(format!(
                                "content parts of type '{kind}' are not supported (only text)"
                            ))
                            .param("messages"))
                        }
                    }
                }
                text
            }
        };
        let role = if message.role == "developer" {
            "system".to_string()
        } else {
            message.role.clone()
        };
        messages.push(ChatMessage { role, content });
    }
    let rendered = state
        .template
        .render(&messages, true)
        .map_err(|e| ApiError::invalid(format!("the chat template refused the messages: {e}")).param("messages"))?;
    // The template writes the BOS text itself where the model wants it; the tokenizer
    // would add a second one.
    let bos = state
        .vocab
        .bos_token()
        .map(|t| String::from_utf8_lossy(&state.vocab.token_bytes(t, true)).into_owned());
    let text = match bos {
        Some(bos) if state.vocab.adds_bos() && !bos.is_empty() => rendered.strip_prefix(&bos).unwrap_or(&rendered),
        _ => &rendered,
    };
    let prompt = state
        .vocab
        .tokenize(text, true, true)
        .map_err(|e| ApiError::invalid(e.to_string()))?;
    let top = if req.logprobs { req.top_logprobs.unwrap_or(0) } else { 0 };
    if req.top_logprobs.is_some_and(|n| n > 0) && !req.logprobs {
        return Err(ApiError::invalid("top_logprobs requires logprobs: true").param("top_logprobs"));
    }
    let prepared = prepare(&state, &req.sampling, prompt, req.logprobs, top)?;
    respond(state, prepared, Kind::Chat, req.logprobs).await
}

async fn completions(State(state): State<Arc<AppState>>, body: Body) -> Result<Response, ApiError> {
    let req: CompletionRequest = read_json(&state, body).await?;
    if req.echo {
        return Err(ApiError::invalid("echo is not supported").param("echo"));
    }
    let prompt = match req.prompt {
        Prompt::Text(text) => state
            .vocab
            .tokenize(&text, true, true)
            .map_err(|e| ApiError::invalid(e.to_string()))?,
        Prompt::Texts(texts) if texts.len() == 1 => state
            .vocab
            .tokenize(&texts[0], true, true)
            .map_err(|e| ApiError::invalid(e.to_string()))?,
        Prompt::Texts(_) => return Err(ApiError::invalid("only one prompt per request is supported").param("prompt")),
        Prompt::Tokens(tokens) => {
            let n_vocab = state.vocab.n_vocab();
            if let Some(bad) = tokens.iter().find(|&&t| t as usize >= n_vocab) {
                return Err(
                    ApiError::invalid(format!("token {bad} is outside the vocabulary of {n_vocab}")).param("prompt"),
                );
            }
            tokens
        }
    };
    if prompt.is_empty() {
        return Err(ApiError::invalid("the prompt is empty").param("prompt"));
    }
    let n_top = req.logprobs.unwrap_or(0);
    if n_top > 5 {
        return Err(ApiError::invalid("logprobs must be between 0 and 5").param("logprobs"));
    }
    let prepared = prepare(&state, &req.sampling, prompt, req.logprobs.is_some(), n_top)?;
    respond(state, prepared, Kind::Completion, req.logprobs.is_some()).await
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Chat,
    Completion,
}

async fn respond(state: Arc<AppState>, prepared: Prepared, kind: Kind, logprobs: bool) -> Result<Response, ApiError> {
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
    };
    if stream {
        let stream = SseStream {
            writer,
            events,
            queue: VecDeque::new(),
            include_usage,
            started: false,
            done: false,
        };
        let body = futures_util::stream::unfold(stream, |mut s| async move { s.next().await.map(|e| (e, s)) });
        return Ok(Sse::new(body).keep_alive(KeepAlive::default()).into_response());
    }
    let mut events = events;
    let mut text = String::new();
    let mut tokens = Vec::new();
    while let Some(event) = events.recv().await {
        match event {
            Event::Token(token) => {
                text.push_str(&token.text);
                tokens.push(token);
            }
            Event::Finished(finish) => {
                text.push_str(&finish.tail);
                let usage = usage(&finish);
                let reason = finish_reason(finish.reason);
                return Ok(Json(writer.whole(&text, &tokens, reason, usage)).into_response());
            }
            Event::Failed(reason) => return Err(ApiError::server(reason)),
        }
    }
    Err(ApiError::server("the engine stopped before the request finished"))
}

fn usage(finish: &baton_node::engine::Finish) -> Usage {
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
}

impl Writer {
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

    /// A whole (non-streamed) response.
    fn whole(&self, text: &str, tokens: &[TokenOut], reason: &str, usage: Usage) -> Value {
        let logprobs = self.logprobs_value(tokens, 0);
        let choice = match self.kind {
            Kind::Chat => json!({
                "index": 0,
                "message": { "role": "assistant", "content": text },
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
    events: UnboundedReceiver<Event>,
    queue: VecDeque<SseEvent>,
    include_usage: bool,
    started: bool,
    done: bool,
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
                }
            }
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
                if token.text.is_empty() && !self.writer.logprobs {
                    return;
                }
                let chunk = self
                    .writer
                    .chunk(Some(&token.text), false, std::slice::from_ref(&token), 0, None);
                self.push(&chunk);
            }
            Event::Finished(finish) => {
                if !finish.tail.is_empty() {
                    let chunk = self.writer.chunk(Some(&finish.tail), false, &[], 0, None);
                    self.push(&chunk);
                }
                let last = self
                    .writer
                    .chunk(None, false, &[], 0, Some(finish_reason(finish.reason)));
                self.push(&last);
                if self.include_usage {
                    let usage = self.writer.usage_chunk(usage(&finish));
                    self.push(&usage);
                }
                self.queue.push_back(SseEvent::default().data("[DONE]"));
                self.done = true;
            }
            Event::Failed(reason) => {
                let error = ApiError::server(reason).body;
                self.push(&serde_json::to_value(error).unwrap_or_default());
                self.done = true;
            }
        }
    }
}
