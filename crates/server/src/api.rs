//! The HTTP handlers: check a request ([`crate::request`]), turn it into a prompt, hand it
//! to the engine, and answer in OpenAI's shapes, whole or as server-sent events.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::body::{to_bytes, Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::Next;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use baton_ggml::LlamaModel;
use baton_node::engine::{Draft, DraftMode, Engine, Event, FinishReason, Health, Job, SubmitError, TokenOut};
use serde_json::{json, Value};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

use crate::openai::{ErrorBody, ErrorDetail, PromptTokensDetails, Usage};
use crate::request::{self, CompletionPrompt, Generation};
use crate::template::ChatTemplate;

/// How the API behaves.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// The id clients name the model by.
    pub model_id: String,
    /// Required `Authorization: Bearer` key for `/v1/*`, if set.
    pub api_key: Option<String>,
    /// Largest request body in bytes.
    pub max_body: usize,
    /// Speculative decoding for requests that do not say (`--draft`, `--draft-max`).
    pub draft: Draft,
    /// Whether the engine has a draft model (`--draft-model`).
    pub has_draft_model: bool,
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
    pub(crate) fn new(
        status: StatusCode,
        kind: &'static str,
        code: Option<&'static str>,
        message: impl Into<String>,
    ) -> ApiError {
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

    pub(crate) fn invalid(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, "invalid_request_error", None, message)
    }

    pub(crate) fn param(mut self, param: &'static str) -> ApiError {
        self.body.error.param = Some(param);
        self
    }

    /// The HTTP status the client gets.
    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// What the client is told.
    pub fn message(&self) -> &str {
        &self.body.error.message
    }

    /// The request field at fault, if the error names one.
    pub fn field(&self) -> Option<&'static str> {
        self.body.error.param
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

/// `ok` (200) while a ring computes, with its stages and the workers lost from it;
/// `recovering` (503) while a new ring is formed after a worker was lost (requests
/// wait); `waiting` (503) while no ring can be formed until a lost worker returns
/// (requests are refused); `error` (503) when the ring is gone for good.
async fn health(State(state): State<Arc<AppState>>) -> Response {
    let counters = state.engine.counters();
    let active = counters.active.load(Ordering::Relaxed);
    let queued = counters.queued.load(Ordering::Relaxed);
    let rings_formed = counters.rings_formed.load(Ordering::Relaxed);
    let unavailable = |status: &str, reason: String| {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({ "status": status, "error": reason, "active": active, "queued": queued })),
        )
            .into_response()
    };
    match state.engine.health() {
        Health::Serving { stages, lost } => Json(json!({
            "status": "ok",
            "active": active,
            "queued": queued,
            "stages": stages,
            "lost": lost.iter().map(|(node, why)| json!({ "node": node, "why": why })).collect::<Vec<_>>(),
            "rings_formed": rings_formed,
        }))
        .into_response(),
        Health::Recovering { reason } => unavailable("recovering", reason),
        Health::Waiting { reason } => unavailable("waiting", reason),
        Health::Failed { reason } => unavailable("error", reason),
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
        "draft_tokens": c.draft_tokens.load(Ordering::Relaxed),
        "draft_accepted": c.draft_accepted.load(Ordering::Relaxed),
        "slot_ctx": state.engine.slot_ctx(),
        "stages": stages.resident.iter().zip(&stages.kv_used)
            .map(|(resident, kv)| json!({ "resident_bytes": resident, "kv_cells_used": kv }))
            .collect::<Vec<_>>(),
    })))
}

async fn read_body(state: &AppState, body: Body) -> Result<Bytes, ApiError> {
    to_bytes(body, state.config.max_body).await.map_err(|_| {
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            Some("request_too_large"),
            format!(
                "the request body is larger than {} bytes (or could not be read)",
                state.config.max_body
            ),
        )
    })
}

/// A request made ready for the engine.
struct Prepared {
    job: Job,
    events: UnboundedReceiver<Event>,
    stream: bool,
    include_usage: bool,
}

/// Checks that `prompt` and the tokens to generate fit a slot, and builds the job.
fn prepare(state: &AppState, generation: Generation, prompt: Vec<u32>) -> Result<Prepared, ApiError> {
    let max_tokens = request::fit_slot(&generation, prompt.len(), state.engine.slot_ctx())?;
    let default = state.config.draft;
    let draft = Draft {
        mode: generation.draft.unwrap_or(default.mode),
        max: generation.draft_max.unwrap_or(default.max),
        fixed: default.fixed,
    };
    if draft.mode == DraftMode::Model && !state.config.has_draft_model {
        return Err(ApiError::invalid("draft \"model\" needs a server started with --draft-model").param("draft"));
    }
    let (tx, events) = unbounded_channel();
    let job = Job {
        prompt,
        params: generation.params,
        max_tokens,
        logprobs: generation.logprobs,
        top_logprobs: generation.top_logprobs,
        stop: generation.stop,
        draft,
        grammar: None,
        events: tx,
    };
    Ok(Prepared {
        job,
        events,
        stream: generation.stream,
        include_usage: generation.include_usage,
    })
}

fn unix_time() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

async fn chat(State(state): State<Arc<AppState>>, _headers: HeaderMap, body: Body) -> Result<Response, ApiError> {
    let body = read_body(&state, body).await?;
    let req = request::chat(&body, &state.config.model_id)?;
    let rendered = state
        .template
        .render(&req.messages, true)
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
    let logprobs = req.generation.logprobs;
    let prepared = prepare(&state, req.generation, prompt)?;
    respond(state, prepared, Kind::Chat, logprobs).await
}

async fn completions(State(state): State<Arc<AppState>>, body: Body) -> Result<Response, ApiError> {
    let body = read_body(&state, body).await?;
    let req = request::completion(&body, &state.config.model_id, state.vocab.n_vocab())?;
    let prompt = match req.prompt {
        CompletionPrompt::Text(text) => state
            .vocab
            .tokenize(&text, true, true)
            .map_err(|e| ApiError::invalid(e.to_string()))?,
        CompletionPrompt::Tokens(tokens) => tokens,
    };
    if prompt.is_empty() {
        return Err(request::empty_prompt());
    }
    let logprobs = req.generation.logprobs;
    let prepared = prepare(&state, req.generation, prompt)?;
    respond(state, prepared, Kind::Completion, logprobs).await
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
