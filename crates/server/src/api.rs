//! The HTTP handlers: check a request ([`crate::request`]), turn it into a prompt, hand it
//! to the engine, and answer in OpenAI's shapes, whole or as server-sent events.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::body::{to_bytes, Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use baton_engine::{Cause, Draft, DraftMode, Engine, Event, Failure, FinishReason, Health, Job, SubmitError, TokenOut};
use baton_ggml::LlamaModel;
use baton_sample::ReasoningBudget;
use serde_json::{json, Map, Value};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

use crate::metrics::{Outcome, Timing};
use crate::openai::{ErrorBody, ErrorDetail, PromptTokensDetails, Usage};
use crate::reasoning::{self, FirstCallEnds, OutputSplitter, Start};
use crate::request::{self, CompletionPrompt, Generation};
use crate::template::{ChatMessage, ChatTemplate};
use crate::tools::{self, Out, ToolChoice, ToolFormat, ToolParser};

mod cluster;
mod embeddings;
mod guard;
mod messages;
mod respond;
mod responses;
mod served;

pub use cluster::Joining;
use guard::{authenticate, guard};
use respond::{respond, Kind};
pub(crate) use served::Served;

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
    /// Longest a client may take to send a request body.
    pub body_timeout: Duration,
    /// The server listens on loopback only: requests must name a loopback host (a web
    /// page that rebinds its own name to 127.0.0.1 must not reach a keyless server).
    pub loopback: bool,
    /// Origins besides the server's own whose pages may call a keyless server.
    pub allowed_origins: Vec<String>,
    /// Prompts rendered and tokenized at once, off the async threads.
    pub prepare_concurrency: usize,
    /// How `/v1/embeddings` pools (the GGUF's `pooling_type` or `--pooling`), or why
    /// it refuses every request (the model names no pooling, or one it cannot serve).
    pub pooling: Result<baton_engine::Pooling, String>,
}

impl ServerConfig {
    /// A configuration with the defaults `baton serve` uses.
    pub fn new(model_id: String) -> ServerConfig {
        ServerConfig {
            model_id,
            api_key: None,
            max_body: 8 << 20,
            draft: Draft::OFF,
            has_draft_model: false,
            body_timeout: Duration::from_secs(30),
            loopback: true,
            allowed_origins: Vec::new(),
            prepare_concurrency: 2,
            pooling: Err("this server was started without a pooling for embeddings".into()),
        }
    }
}

/// The next response id's number (see [`AppState::new_id`]).
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// Everything the handlers share.
pub struct AppState {
    engine: Engine,
    vocab: Arc<LlamaModel>,
    template: ChatTemplate,
    config: ServerConfig,
    created: u64,
    /// How the model writes tool calls (from its template).
    tool_format: ToolFormat,
    /// Mistral's `[TOOL_CALLS]` control token, if the vocabulary has one.
    tool_calls_token: Option<u32>,
    /// Mistral's tool-call markers that are control tokens: shown in the output when
    /// tools are offered, so that the parser sees them.
    tool_markers: Vec<u32>,
    /// Bounds prompt preparation ([`AppState::off_runtime`]).
    prepare_permits: tokio::sync::Semaphore,
    /// Longest text one token stands for, special tokens included.
    max_token_bytes: usize,
    /// Texts of control tokens (`<|im_start|>`), which typed content must not become.
    control_texts: Vec<String>,
    /// The tokens of `<think>` and `</think>`, which a thinking budget counts from and
    /// forces.
    think_tags: (Vec<u32>, Vec<u32>),
    /// Prometheus figures the server keeps itself.
    pub(crate) metrics: crate::metrics::Metrics,
    /// Invites and joins, when the server heads a cluster of workers.
    joining: Option<Joining>,
}

impl AppState {
    /// Serves `engine`'s model; `vocab` tokenizes, `template` renders chats.
    pub fn new(engine: Engine, vocab: Arc<LlamaModel>, template: ChatTemplate, config: ServerConfig) -> AppState {
        let tool_format = ToolFormat::detect(template.source());
        let control = |text: &str| {
            vocab
                .tokenize(text, false, true)
                .ok()
                .filter(|t| t.len() == 1 && vocab.token_bytes(t[0], false).is_empty())
                .map(|t| t[0])
        };
        let tool_calls_token = control("[TOOL_CALLS]");
        let tool_markers = ["[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"]
            .iter()
            .filter_map(|m| control(m))
            .collect();
        let mut max_token_bytes = 1;
        let mut control_texts = Vec::new();
        for token in 0..vocab.n_vocab() as u32 {
            let special = vocab.token_bytes(token, true);
            max_token_bytes = max_token_bytes.max(special.len());
            if !special.is_empty() && vocab.token_bytes(token, false).is_empty() {
                control_texts.push(String::from_utf8_lossy(&special).into_owned());
            }
        }
        let tags = |text: &str| vocab.tokenize(text, false, true).unwrap_or_default();
        let think_tags = (tags(reasoning::OPEN), tags(reasoning::CLOSE));
        AppState {
            think_tags,
            tool_format,
            tool_calls_token,
            tool_markers,
            prepare_permits: tokio::sync::Semaphore::new(config.prepare_concurrency.max(1)),
            max_token_bytes,
            control_texts,
            metrics: crate::metrics::Metrics::default(),
            engine,
            vocab,
            template,
            config,
            created: unix_time(),
            joining: None,
        }
    }

    /// Lets workers join the cluster with invites (`/v1/cluster/invites`,
    /// `/cluster/join`).
    pub fn with_joining(mut self, joining: Joining) -> AppState {
        self.joining = Some(joining);
        self
    }

    /// The engine.
    pub(crate) fn engine(&self) -> &Engine {
        &self.engine
    }

    /// Runs `work` (template rendering, tokenizing: CPU work that scales with the
    /// request) on the blocking pool, at most `prepare_permits` at once, so that large
    /// prompts cannot stall the threads that serve every other connection.
    async fn off_runtime<T: Send + 'static>(
        self: &Arc<Self>,
        work: impl FnOnce(&AppState) -> Result<T, ApiError> + Send + 'static,
    ) -> Result<T, ApiError> {
        let _permit = self
            .prepare_permits
            .acquire()
            .await
            .map_err(|_| ApiError::server("the server is stopping"))?;
        let state = self.clone();
        tokio::task::spawn_blocking(move || work(&state))
            .await
            .map_err(|e| ApiError::server(format!("preparing the prompt failed: {e}")))?
    }

    /// Refuses, before any tokenizing, text that cannot fit a slot: no token stands for
    /// more than `max_token_bytes` bytes, so `bytes` of text are at least that many
    /// tokens.
    fn check_size(&self, bytes: usize, param: &'static str) -> Result<(), ApiError> {
        let slot_ctx = self.engine.slot_ctx();
        let most = slot_ctx.saturating_mul(self.max_token_bytes.max(1));
        if bytes > most {
            return Err(ApiError::new(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                Some("context_length_exceeded"),
                format!(
                    "the prompt is {bytes} bytes: at least {} tokens (no token is longer than {} bytes), \
                     and this model's context per sequence is {slot_ctx} tokens",
                    bytes.div_ceil(self.max_token_bytes.max(1)),
                    self.max_token_bytes
                ),
            )
            .param(param));
        }
        Ok(())
    }

    /// The prompt tokens of a chat, and where the output starts ([`Start::after`]). Only the template's own special tokens
    /// are special: text a client typed that reads like one (`<|im_start|>`) is
    /// tokenized as text.
    fn chat_prompt(
        &self,
        messages: &[ChatMessage],
        tools: Option<&[Value]>,
        kwargs: &Map<String, Value>,
    ) -> Result<(Vec<u32>, Start), ApiError> {
        let refused = |e: crate::template::TemplateError| {
            ApiError::invalid(format!("the chat template refused the messages: {e}")).param("messages")
        };
        let typed = messages
            .iter()
            .any(|m| self.control_texts.iter().any(|c| m.content.contains(c.as_str())));
        if !typed {
            // The common case, tokenized exactly as before: the whole text at once.
            let rendered = self
                .template
                .render_with_kwargs(messages, tools, kwargs, true)
                .map_err(refused)?;
            return Ok((self.tokenize_rendered(&rendered, true)?, Start::after(&rendered)));
        }
        // Mark each content with private-use characters, render, then tokenize content
        // without special-token parsing and the template's text with it.
        let marked: Vec<ChatMessage> = messages
            .iter()
            .map(|m| {
                let clean: String = m
                    .content
                    .chars()
                    .filter(|&c| c != CONTENT_OPEN && c != CONTENT_CLOSE)
                    .collect();
                ChatMessage {
                    content: format!("{CONTENT_OPEN}{clean}{CONTENT_CLOSE}"),
                    ..m.clone()
                }
            })
            .collect();
        let rendered = self
            .template
            .render_with_kwargs(&marked, tools, kwargs, true)
            .map_err(refused)?;
        let mut tokens = Vec::new();
        for (i, part) in rendered.split([CONTENT_OPEN, CONTENT_CLOSE]).enumerate() {
            if part.is_empty() {
                continue;
            }
            let first = tokens.is_empty();
            let piece = match (i % 2 == 1, first) {
                (false, true) => self.tokenize_rendered(part, true)?,
                (false, false) => self.tokenize_plain(part, false, true)?,
                (true, first) => self.tokenize_plain(part, first, false)?,
            };
            tokens.extend(piece);
        }
        Ok((tokens, Start::after(&rendered)))
    }

    /// A thinking budget of `tokens` for a chat whose prompt is `prompt`, as llama.cpp's
    /// server sets one: counted from `<think>`, ended by `</think>`, which is what is
    /// forced. The prompt's tail from its last `<think>` (the template's generation
    /// prompt opening the thinking) is read first, so that the count starts there.
    fn reasoning_budget(&self, tokens: u32, prompt: &[u32]) -> ReasoningBudget {
        let (start, end) = self.think_tags.clone();
        // Only a tail a budget can carry is looked at.
        let tail = &prompt[prompt.len().saturating_sub(baton_sample::MAX_BUDGET_SEQ)..];
        let prefill = match (!start.is_empty()).then(|| tail.windows(start.len()).rposition(|w| w == start)) {
            Some(Some(at)) => tail[at..].to_vec(),
            _ => Vec::new(),
        };
        ReasoningBudget {
            tokens,
            start,
            ends: vec![end.clone()],
            forced: end,
            prefill,
        }
    }

    fn tokenize_plain(&self, text: &str, add_special: bool, parse_special: bool) -> Result<Vec<u32>, ApiError> {
        self.vocab
            .tokenize(text, add_special, parse_special)
            .map_err(|e| ApiError::invalid(e.to_string()))
    }

    /// Tokenizes rendered template text (special tokens parsed), without the second
    /// BOS a template that writes `bos_token` would otherwise get.
    fn tokenize_rendered(&self, rendered: &str, add_special: bool) -> Result<Vec<u32>, ApiError> {
        let bos = self
            .vocab
            .bos_token()
            .map(|t| String::from_utf8_lossy(&self.vocab.token_bytes(t, true)).into_owned());
        let text = match bos {
            Some(bos) if self.vocab.adds_bos() && !bos.is_empty() => rendered.strip_prefix(&bos).unwrap_or(rendered),
            _ => rendered,
        };
        self.vocab
            .tokenize(text, add_special, true)
            .map_err(|e| ApiError::invalid(e.to_string()))
    }

    /// A response id, unique in this process: every model's answers count from one
    /// number.
    fn new_id(&self, prefix: &str) -> String {
        format!(
            "{prefix}-{:x}{:06x}",
            self.created,
            NEXT_ID.fetch_add(1, Ordering::Relaxed)
        )
    }
}

/// Mounts each route and lists it in [`ROUTES`] from one table, so that the list the
/// OpenAPI description is checked against is what the router serves. Three kinds:
/// `server` routes answer for the whole server (the first model's state holds what
/// the models share: the key, the origins, the invites); `model` routes are answered
/// by the model their body names ([`Served::route`]); `all` routes see every model.
macro_rules! routes {
    (
        server { $($s_method:ident $s_path:literal => $s_handler:expr,)* }
        model { $($m_method:ident $m_path:literal => $m_handler:expr,)* }
        all { $($a_method:ident $a_path:literal => $a_handler:expr,)* }
    ) => {
        /// Every `(method, path)` the router mounts (for the description's tests).
        #[cfg(test)]
        pub(crate) const ROUTES: &[(&str, &str)] = &[
            $((stringify!($s_method), $s_path),)*
            $((stringify!($m_method), $m_path),)*
            $((stringify!($a_method), $a_path),)*
        ];

        fn mount(first: Arc<AppState>, served: Arc<Served>) -> Router {
            let server = Router::new()$(.route($s_path, $s_method($s_handler)))*.with_state(first);
            let models = Router::new()
                $(.route($m_path, $m_method(|State(served): State<Arc<Served>>, body: Body| async move {
                    served.route(body, $m_handler).await
                })))*
                $(.route($a_path, $a_method($a_handler)))*
                .with_state(served);
            server.merge(models)
        }
    };
}

routes! {
    server {
        get "/" => crate::page::index,
        post "/v1/cluster/invites" => cluster::invite,
        post "/cluster/join" => cluster::join,
        get "/openapi.json" => crate::description::openapi,
    }
    model {
        post "/v1/chat/completions" => chat,
        post "/v1/completions" => completions,
        post "/v1/messages" => messages::messages,
        post "/v1/responses" => responses::responses,
        post "/v1/embeddings" => embeddings::embeddings,
        post "/tokenize" => tokenize,
        post "/detokenize" => detokenize,
    }
    all {
        get "/v1/models" => served::models,
        get "/health" => served::health,
        get "/stats" => served::stats,
        get "/metrics" => crate::metrics::metrics,
    }
}

/// The routes of a server of one model.
pub fn router(state: Arc<AppState>) -> Router {
    routes_of(vec![state])
}

/// The routes of a server of several models, each with its own engine (in the order
/// given): a request goes to the model its `model` field names, the first when it names
/// none. The first model's configuration holds what they share (the API key, the
/// origins, invites); `/metrics` labels each model's figures with its id.
///
/// # Panics
/// When `models` is empty.
pub fn router_for(mut models: Vec<AppState>) -> Router {
    assert!(!models.is_empty(), "a server serves at least one model");
    if models.len() > 1 {
        let shared = crate::metrics::Metrics::default();
        for model in &mut models {
            model.metrics = crate::metrics::Metrics::of_model(&shared, &model.config.model_id);
        }
    }
    routes_of(models.into_iter().map(Arc::new).collect())
}

fn routes_of(models: Vec<Arc<AppState>>) -> Router {
    let first = models[0].clone();
    mount(first.clone(), Arc::new(Served::new(models)))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(axum::middleware::from_fn_with_state(first.clone(), authenticate))
        .layer(axum::middleware::from_fn_with_state(first, guard))
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

    /// How the request counts in the metrics.
    fn outcome(&self) -> Outcome {
        match self.status.is_client_error() {
            true => Outcome::ClientError,
            false => Outcome::ServerError,
        }
    }
}

/// A request that failed while it ran: 400 when it cannot be served as asked, 503 when
/// a stage had no room for it (it may succeed later), 500 otherwise.
impl From<Failure> for ApiError {
    fn from(failure: Failure) -> ApiError {
        match failure.cause {
            Cause::Request => ApiError::invalid(failure.reason),
            Cause::Capacity => ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                Some("server_overloaded"),
                failure.reason,
            ),
            Cause::Server => ApiError::server(failure.reason),
        }
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

/// `POST /tokenize {"content", "add_special"?, "parse_special"?, "with_pieces"?}`, as
/// llama.cpp's server answers it: `{"tokens": [...]}` (or `[{"id", "piece"}]`).
async fn tokenize(State(state): State<Arc<AppState>>, body: Body) -> Result<Json<Value>, ApiError> {
    #[derive(serde::Deserialize)]
    struct TokenizeRequest {
        content: String,
        #[serde(default)]
        add_special: bool,
        #[serde(default = "yes")]
        parse_special: bool,
        #[serde(default)]
        with_pieces: bool,
    }
    fn yes() -> bool {
        true
    }
    let body = read_body(&state, body).await?;
    let req: TokenizeRequest = request::parse_json(&body)?;
    state.check_size(req.content.len(), "content")?;
    let tokens = state
        .off_runtime(move |state| {
            let tokens = state.tokenize_plain(&req.content, req.add_special, req.parse_special)?;
            Ok(if req.with_pieces {
                json!(tokens
                    .iter()
                    .map(|&id| {
                        let bytes = state.vocab.token_bytes(id, true);
                        match String::from_utf8(bytes) {
                            Ok(piece) => json!({ "id": id, "piece": piece }),
                            Err(e) => json!({ "id": id, "piece": e.into_bytes() }),
                        }
                    })
                    .collect::<Vec<_>>())
            } else {
                json!(tokens)
            })
        })
        .await?;
    Ok(Json(json!({ "tokens": tokens })))
}

/// `POST /detokenize {"tokens": [...]}` → `{"content"}` (special tokens as text).
async fn detokenize(State(state): State<Arc<AppState>>, body: Body) -> Result<Json<Value>, ApiError> {
    #[derive(serde::Deserialize)]
    struct DetokenizeRequest {
        tokens: Vec<u32>,
    }
    let body = read_body(&state, body).await?;
    let req: DetokenizeRequest = request::parse_json(&body)?;
    let n_vocab = state.vocab.n_vocab();
    if let Some(bad) = req.tokens.iter().find(|&&t| t as usize >= n_vocab) {
        return Err(ApiError::invalid(format!("token {bad} is outside the vocabulary of {n_vocab}")).param("tokens"));
    }
    let content = state
        .off_runtime(move |state| Ok(state.vocab.detokenize(&req.tokens, true)))
        .await?;
    Ok(Json(json!({ "content": content })))
}

async fn read_body(state: &AppState, body: Body) -> Result<Bytes, ApiError> {
    let timeout = state.config.body_timeout;
    let read = tokio::time::timeout(timeout, to_bytes(body, state.config.max_body))
        .await
        .map_err(|_| {
            ApiError::new(
                StatusCode::REQUEST_TIMEOUT,
                "invalid_request_error",
                Some("request_timeout"),
                format!("the request body did not arrive within {} s", timeout.as_secs_f32()),
            )
        })?;
    read.map_err(|_| {
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
        grammar: generation.grammar,
        budget: None,
        show: Vec::new(),
        end: None,
        pooling: None,
        events: tx,
    };
    Ok(Prepared {
        job,
        events,
        stream: generation.stream,
        include_usage: generation.include_usage,
    })
}

/// Marks a message's content in rendered text (Unicode private use: never in a
/// template, and removed from content where a client sent it).
const CONTENT_OPEN: char = '\u{F8F0}';
const CONTENT_CLOSE: char = '\u{F8F1}';

fn unix_time() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

async fn chat(State(state): State<Arc<AppState>>, body: Body) -> Result<Response, ApiError> {
    let result = chat_inner(state.clone(), body, Instant::now()).await;
    record_refusal(&state, "chat", &result);
    result
}

async fn completions(State(state): State<Arc<AppState>>, body: Body) -> Result<Response, ApiError> {
    let result = completions_inner(state.clone(), body, Instant::now()).await;
    record_refusal(&state, "completions", &result);
    result
}

/// Counts a request that ended in an error response (the others count where they end).
fn record_refusal(state: &AppState, endpoint: &str, result: &Result<Response, ApiError>) {
    if let Err(e) = result {
        state.metrics.request(endpoint, e.outcome());
    }
}

async fn chat_inner(state: Arc<AppState>, body: Body, arrived: Instant) -> Result<Response, ApiError> {
    let body = read_body(&state, body).await?;
    // Parsing compiles JSON schemas to grammars: bounded work, but off the runtime.
    let req = state
        .off_runtime(move |state| request::chat(&body, &state.config.model_id))
        .await?;
    let logprobs = req.generation.logprobs;
    let (prepared, parser) = chat_job(&state, req).await?;
    respond(state, prepared, Kind::Chat, logprobs, parser, arrived).await
}

/// What `splitter` releases of `text` (all of it as content without one; with `last`,
/// what it still held too).
fn answer_outs(splitter: Option<&mut OutputSplitter>, text: &str, last: bool) -> Vec<Out> {
    let Some(splitter) = splitter else {
        return vec![Out::Content(text.to_string())];
    };
    let mut outs = splitter.push(text);
    if last {
        outs.extend(splitter.finish());
    }
    outs
}

/// The engine job of a checked chat request (tools described or forced, the prompt
/// rendered and tokenized) and the splitter that parts its text into reasoning,
/// content and calls.
async fn chat_job(
    state: &Arc<AppState>,
    mut req: request::Chat,
) -> Result<(Prepared, Option<OutputSplitter>), ApiError> {
    let offer_tools = !req.tools.is_empty() && req.tool_choice != ToolChoice::None;
    // A template that knows nothing of tools gets them described in a system message,
    // in the format the parser reads.
    let (format, template_tools) = match (offer_tools, state.template.renders_tools()) {
        (false, _) => (state.tool_format, None),
        (true, true) => (state.tool_format, Some(req.tools.as_slice())),
        (true, false) => {
            let instructions = tools::instructions(&req.tools);
            match req.messages.first_mut() {
                Some(first) if first.role == "system" => {
                    first.content = format!("{}\n\n{instructions}", first.content);
                }
                _ => req.messages.insert(0, ChatMessage::new("system", instructions)),
            }
            (ToolFormat::Hermes, None)
        }
    };
    let forced = match &req.tool_choice {
        ToolChoice::Required => Some(req.functions.clone()),
        ToolChoice::Function(name) => Some(req.functions.iter().filter(|f| &f.name == name).cloned().collect()),
        ToolChoice::Auto | ToolChoice::None => None,
    };
    if let Some(functions) = forced {
        if req.generation.grammar.is_some() {
            return Err(ApiError::invalid(
                "a grammar (grammar or response_format) cannot be given with a tool_choice that forces a call",
            )
            .param("tool_choice"));
        }
        let parallel = req.parallel_tool_calls && matches!(req.tool_choice, ToolChoice::Required);
        let grammar = state
            .off_runtime(move |state| {
                let grammar = tools::forced_grammar(format, &functions, parallel, state.tool_calls_token)?;
                request::check_grammar(&grammar).map_err(|e| e.param("tools"))?;
                Ok(grammar)
            })
            .await?;
        req.generation.grammar = Some(grammar);
    }
    // `parallel_tool_calls: false`: generation ends once the first call is written.
    let one_call = offer_tools && !req.parallel_tool_calls;
    let parser =
        ToolParser::active(format, offer_tools).then(|| ToolParser::new(format, offer_tools).one_call(one_call));
    let reasoning = req.reasoning;
    // What the prompt holds at least: every message's text, and the tools it shows.
    let content_bytes: usize = req.messages.iter().map(|m| m.content.len()).sum::<usize>()
        + template_tools.map_or(0, |tools| tools.iter().map(|t| t.to_string().len()).sum());
    state.check_size(content_bytes, "messages")?;
    let tools = template_tools.map(<[Value]>::to_vec);
    let messages = std::mem::take(&mut req.messages);
    let kwargs = std::mem::take(&mut req.template_kwargs);
    let (prompt, start) = state
        .off_runtime(move |state| state.chat_prompt(&messages, tools.as_deref(), &kwargs))
        .await?;
    let splitter = OutputSplitter::new(format, parser, reasoning, start);
    // gpt-oss thinks in its analysis channel, which has no `<think>` to count from.
    let budget = match (req.reasoning_budget, format) {
        (Some(tokens), format) if format != ToolFormat::Harmony => Some(state.reasoning_budget(tokens, &prompt)),
        _ => None,
    };
    let mut prepared = prepare(state, req.generation, prompt)?;
    prepared.job.budget = budget;
    if offer_tools && format == ToolFormat::Mistral {
        prepared.job.show = state.tool_markers.clone();
    }
    if one_call {
        prepared.job.end = Some(Box::new(FirstCallEnds::new(format, reasoning, start)));
    }
    Ok((prepared, splitter))
}

async fn completions_inner(state: Arc<AppState>, body: Body, arrived: Instant) -> Result<Response, ApiError> {
    let body = read_body(&state, body).await?;
    let req = state
        .off_runtime(move |state| request::completion(&body, &state.config.model_id, state.vocab.n_vocab()))
        .await?;
    let prompt = match req.prompt {
        CompletionPrompt::Text(text) => {
            state.check_size(text.len(), "prompt")?;
            state
                .off_runtime(move |state| {
                    state
                        .vocab
                        .tokenize(&text, true, true)
                        .map_err(|e| ApiError::invalid(e.to_string()))
                })
                .await?
        }
        CompletionPrompt::Tokens(tokens) => tokens,
    };
    if prompt.is_empty() {
        return Err(request::empty_prompt());
    }
    let logprobs = req.generation.logprobs;
    let prepared = prepare(&state, req.generation, prompt)?;
    respond(state, prepared, Kind::Completion, logprobs, None, arrived).await
}

#[cfg(test)]
mod failure_tests {
    use super::*;

    /// A request that fails while it runs is answered by whose failure it was.
    #[test]
    fn a_failure_is_answered_by_its_cause() {
        let answer = |cause| {
            let e = ApiError::from(Failure {
                cause,
                reason: "the stage from layer 3: why".into(),
            });
            (
                e.status(),
                e.body.error.kind,
                e.body.error.code,
                e.message().to_string(),
            )
        };
        let why = "the stage from layer 3: why".to_string();
        assert_eq!(
            answer(Cause::Request),
            (StatusCode::BAD_REQUEST, "invalid_request_error", None, why.clone())
        );
        assert_eq!(
            answer(Cause::Capacity),
            (
                StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                Some("server_overloaded"),
                why.clone()
            )
        );
        assert_eq!(
            answer(Cause::Server),
            (StatusCode::INTERNAL_SERVER_ERROR, "server_error", None, why)
        );
    }
}
