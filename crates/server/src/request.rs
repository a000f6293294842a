//! Request bodies of the generation endpoints: JSON in, a checked request or the
//! [`ApiError`] the client gets out. Nothing here needs the engine or the model (the
//! handlers render and tokenize the prompt afterwards), so every check can be tested,
//! and fuzzed (`fuzz/fuzz_targets/http_body.rs`), without loading one.

use axum::http::StatusCode;
use baton_engine::draft::MAX_DRAFT;
use baton_engine::{DraftMode, SubmitError};
use baton_grammar::{schema, Grammar};
use baton_sample::SamplingParams;
use serde::de::DeserializeOwned;
use serde_json::{Map, Value};

use crate::api::ApiError;
use crate::openai::{ChatRequest, CompletionRequest, Content, Prompt, Sampling};
use crate::reasoning::ReasoningFormat;
use crate::template::ChatMessage;
use crate::tools::{self, Function, ToolChoice};

/// Longest grammar a request may bring (it travels to the last stage in `StartSeq`).
pub const MAX_GRAMMAR: usize = 60 << 10;

/// The longest stop string: every generated token is searched for each one.
pub const MAX_STOP_BYTES: usize = 256;

/// What a request asks of generation, checked.
#[derive(Clone, Debug, PartialEq)]
pub struct Generation {
    /// Valid sampling parameters (a random seed when the request gave none).
    pub params: SamplingParams,
    /// At most 4 stop strings.
    pub stop: Vec<String>,
    /// Most tokens to generate, at least 1; `None`: until the context is full.
    pub max_tokens: Option<usize>,
    /// Return log-probabilities of the generated tokens.
    pub logprobs: bool,
    /// And this many alternatives per token.
    pub top_logprobs: u8,
    /// Stream with server-sent events.
    pub stream: bool,
    /// End a stream with a chunk of token counts.
    pub include_usage: bool,
    /// Speculative decoding asked for, if the request says (else the server's default).
    pub draft: Option<DraftMode>,
    /// Most drafted tokens per step, if the request says.
    pub draft_max: Option<usize>,
    /// GBNF grammar the output must follow (`response_format`), checked.
    pub grammar: Option<String>,
}

/// A checked `POST /v1/chat/completions`.
#[derive(Clone, Debug)]
pub struct Chat {
    /// The conversation, at least one message, as the chat template sees it.
    pub messages: Vec<ChatMessage>,
    /// The tools as the client sent them (for the template).
    pub tools: Vec<Value>,
    /// The same, checked.
    pub functions: Vec<Function>,
    /// Whether and which tool must be called.
    pub tool_choice: ToolChoice,
    /// Several calls in one answer.
    pub parallel_tool_calls: bool,
    /// What becomes of the model's thinking.
    pub reasoning: ReasoningFormat,
    /// Variables for the chat template besides the messages and tools; always holds
    /// `enable_thinking` (true unless the request turned thinking off), as llama.cpp
    /// passes it.
    pub template_kwargs: Map<String, Value>,
    /// Most tokens the thinking may take (`reasoning_budget_tokens`), if limited.
    pub reasoning_budget: Option<u32>,
    /// The rest of the request.
    pub generation: Generation,
}

/// The prompt of a checked completion request.
#[derive(Clone, Debug, PartialEq)]
pub enum CompletionPrompt {
    /// Text, still to be tokenized.
    Text(String),
    /// Token ids, at least one, each inside the vocabulary.
    Tokens(Vec<u32>),
}

/// A checked `POST /v1/completions`.
#[derive(Clone, Debug)]
pub struct Completion {
    /// The prompt.
    pub prompt: CompletionPrompt,
    /// The rest of the request.
    pub generation: Generation,
}

/// Parses and checks the body of a chat request for the model named `model_id`.
pub fn chat(body: &[u8], model_id: &str) -> Result<Chat, ApiError> {
    let req: ChatRequest = parse_json(body)?;
    if req.messages.is_empty() {
        return Err(ApiError::invalid("messages must not be empty").param("messages"));
    }
    let mut messages = Vec::with_capacity(req.messages.len());
    for message in req.messages {
        let content = match message.content {
            None => String::new(),
            Some(Content::Text(text)) => text,
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
            message.role
        };
        let tool_calls = message
            .tool_calls
            .map(|calls| calls.into_iter().map(template_call).collect());
        messages.push(ChatMessage {
            role,
            content,
            tool_calls,
            tool_call_id: message.tool_call_id,
            name: message.name,
        });
    }
    let tools = req.tools.unwrap_or_default();
    let functions = tools::functions(&tools)?;
    let tool_choice = tool_choice(req.tool_choice.as_ref(), &functions)?;
    if req.top_logprobs.is_some_and(|n| n > 0) && !req.logprobs {
        return Err(ApiError::invalid("top_logprobs requires logprobs: true").param("top_logprobs"));
    }
    let top_logprobs = if req.logprobs { req.top_logprobs.unwrap_or(0) } else { 0 };
    let mut generation = generation(&req.sampling, model_id, req.logprobs, top_logprobs)?;
    generation.grammar = response_format(req.response_format.as_ref())?;
    if let Some(grammar) = req.grammar {
        if generation.grammar.is_some() {
            return Err(ApiError::invalid("grammar and response_format cannot both be given").param("grammar"));
        }
        check_grammar(&grammar).map_err(|e| e.param("grammar"))?;
        generation.grammar = Some(grammar);
    }
    let reasoning = match req.reasoning_format.as_deref() {
        None => ReasoningFormat::Separate,
        Some(name) => ReasoningFormat::parse(name).ok_or_else(|| {
            ApiError::invalid(format!("reasoning_format '{name}' is not auto, deepseek or none"))
                .param("reasoning_format")
        })?,
    };
    let template_kwargs = template_kwargs(req.chat_template_kwargs, req.reasoning_effort.as_deref())?;
    let reasoning_budget = match req.reasoning_budget_tokens {
        None | Some(-1) => None,
        Some(n) => Some(u32::try_from(n).map_err(|_| {
            ApiError::invalid(format!(
                "reasoning_budget_tokens {n} is not -1 (no limit) or a count of tokens"
            ))
            .param("reasoning_budget_tokens")
        })?),
    };
    Ok(Chat {
        messages,
        tools,
        functions,
        tool_choice,
        parallel_tool_calls: req.parallel_tool_calls.unwrap_or(true),
        reasoning,
        template_kwargs,
        reasoning_budget,
        generation,
    })
}

/// The chat template's extra variables: `chat_template_kwargs` as given (checked:
/// `enable_thinking` is a boolean), `reasoning_effort` added as `reasoning_effort`
/// (`none` and `minimal` as `low`, the least gpt-oss knows, and thinking off), and
/// `enable_thinking` true unless one of them turned it off.
fn template_kwargs(given: Option<Map<String, Value>>, effort: Option<&str>) -> Result<Map<String, Value>, ApiError> {
    let mut kwargs = given.unwrap_or_default();
    if kwargs.get("enable_thinking").is_some_and(|v| !v.is_boolean()) {
        return Err(
            ApiError::invalid("chat_template_kwargs.enable_thinking must be true or false")
                .param("chat_template_kwargs"),
        );
    }
    if let Some(effort) = effort {
        let (level, thinks) = match effort {
            "none" | "minimal" => ("low", false),
            "low" | "medium" | "high" => (effort, true),
            other => {
                return Err(ApiError::invalid(format!(
                    "reasoning_effort '{other}' is not none, minimal, low, medium or high"
                ))
                .param("reasoning_effort"))
            }
        };
        kwargs.entry("reasoning_effort").or_insert_with(|| Value::from(level));
        kwargs.entry("enable_thinking").or_insert(Value::Bool(thinks));
    }
    kwargs.entry("enable_thinking").or_insert(Value::Bool(true));
    Ok(kwargs)
}

/// An assistant message's call as templates expect it: `arguments` parsed from
/// OpenAI's JSON string into an object (kept as a string if it is not JSON).
fn template_call(mut call: Value) -> Value {
    if let Some(arguments) = call.pointer_mut("/function/arguments") {
        if let Some(parsed) = arguments
            .as_str()
            .and_then(|text| serde_json::from_str::<Value>(text).ok())
        {
            *arguments = parsed;
        }
    }
    call
}

fn tool_choice(choice: Option<&Value>, functions: &[Function]) -> Result<ToolChoice, ApiError> {
    let bad = |message: String| ApiError::invalid(message).param("tool_choice");
    let choice = match choice {
        None | Some(Value::Null) => ToolChoice::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "auto" => ToolChoice::Auto,
            "none" => ToolChoice::None,
            "required" => ToolChoice::Required,
            other => return Err(bad(format!("tool_choice '{other}' is not auto, none or required"))),
        },
        Some(object) => match object.pointer("/function/name").and_then(Value::as_str) {
            Some(name) if object.get("type").and_then(Value::as_str) == Some("function") => {
                if !functions.iter().any(|f| f.name == name) {
                    return Err(bad(format!("tool_choice names '{name}', which is not in tools")));
                }
                ToolChoice::Function(name.to_string())
            }
            _ => {
                return Err(bad(
                    "tool_choice must be a string or {\"type\": \"function\", \"function\": {\"name\": …}}".into(),
                ))
            }
        },
    };
    if functions.is_empty() && matches!(choice, ToolChoice::Required | ToolChoice::Function(_)) {
        return Err(bad("tool_choice requires tools".into()));
    }
    Ok(choice)
}

/// The grammar `response_format` asks for (none for `text`), compiled and checked.
fn response_format(format: Option<&Value>) -> Result<Option<String>, ApiError> {
    let bad = |message: String| ApiError::invalid(message).param("response_format");
    let Some(format) = format else { return Ok(None) };
    let kind = format.get("type").and_then(Value::as_str).unwrap_or_default();
    let grammar = match kind {
        "text" => return Ok(None),
        // llama.cpp's extension: a schema beside json_object.
        "json_object" => match format.get("schema") {
            Some(schema) => schema::to_gbnf(schema).map_err(|e| bad(e.to_string()))?,
            None => schema::json_object(),
        },
        "json_schema" => {
            let schema = format
                .pointer("/json_schema/schema")
                .ok_or_else(|| bad("response_format json_schema needs json_schema.schema".into()))?;
            schema::to_gbnf(schema).map_err(|e| bad(e.to_string()))?
        }
        other => {
            return Err(bad(format!(
                "response_format type '{other}' is not text, json_object or json_schema"
            )))
        }
    };
    check_grammar(&grammar).map_err(|e| e.param("response_format"))?;
    Ok(Some(grammar))
}

/// Refuses a grammar too large to send or that the last stage would refuse.
pub fn check_grammar(grammar: &str) -> Result<(), ApiError> {
    if grammar.len() > MAX_GRAMMAR {
        return Err(ApiError::invalid(format!(
            "the schema compiles to a grammar of {} bytes, more than {MAX_GRAMMAR}",
            grammar.len()
        )));
    }
    let refused = |e: baton_grammar::GrammarError| ApiError::invalid(format!("the schema's grammar is refused: {e}"));
    let grammar = Grammar::parse(grammar).map_err(refused)?;
    // Its first step, as the last stage will take it (too ambiguous a grammar fails here).
    baton_grammar::Matcher::new(std::sync::Arc::new(grammar)).map_err(refused)?;
    Ok(())
}

/// Parses and checks the body of a completion request for the model named `model_id`,
/// whose vocabulary has `n_vocab` tokens.
pub fn completion(body: &[u8], model_id: &str, n_vocab: usize) -> Result<Completion, ApiError> {
    let req: CompletionRequest = parse_json(body)?;
    if req.echo {
        return Err(ApiError::invalid("echo is not supported").param("echo"));
    }
    let prompt = match req.prompt {
        Prompt::Text(text) => CompletionPrompt::Text(text),
        Prompt::Texts(mut texts) if texts.len() == 1 => CompletionPrompt::Text(texts.remove(0)),
        Prompt::Texts(_) => return Err(ApiError::invalid("only one prompt per request is supported").param("prompt")),
        Prompt::Tokens(tokens) => {
            if let Some(bad) = tokens.iter().find(|&&t| t as usize >= n_vocab) {
                return Err(
                    ApiError::invalid(format!("token {bad} is outside the vocabulary of {n_vocab}")).param("prompt"),
                );
            }
            if tokens.is_empty() {
                return Err(empty_prompt());
            }
            CompletionPrompt::Tokens(tokens)
        }
    };
    let n_top = req.logprobs.unwrap_or(0);
    if n_top > 5 {
        return Err(ApiError::invalid("logprobs must be between 0 and 5").param("logprobs"));
    }
    let generation = generation(&req.sampling, model_id, req.logprobs.is_some(), n_top)?;
    Ok(Completion { prompt, generation })
}

/// How many tokens a request may generate once its prompt is known to be `prompt_len`
/// tokens: what it asked for, or the rest of the slot of `slot_ctx` tokens. Refuses a
/// prompt that leaves no room and a `max_tokens` beyond the room left.
pub fn fit_slot(generation: &Generation, prompt_len: usize, slot_ctx: usize) -> Result<usize, ApiError> {
    let too_long = |max_tokens| {
        ApiError::from(SubmitError::TooLong {
            slot_ctx,
            prompt: prompt_len,
            max_tokens,
        })
    };
    let room = slot_ctx
        .checked_sub(prompt_len)
        .filter(|&room| room > 0)
        .ok_or_else(|| too_long(1))?;
    match generation.max_tokens {
        // The engine checks this too, but as `prompt + max_tokens`, which wraps for a
        // `max_tokens` near 2^64 and let such a request run into the end of its slot.
        Some(max_tokens) if max_tokens > room => Err(too_long(max_tokens)),
        Some(max_tokens) => Ok(max_tokens),
        None => Ok(room),
    }
}

/// Refuses a request that names a model other than `model_id` (404, as OpenAI).
fn check_model(model: Option<&str>, model_id: &str) -> Result<(), ApiError> {
    match model {
        Some(model) if model != model_id => Err(ApiError::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            Some("model_not_found"),
            format!("The model '{model}' does not exist; this server serves '{model_id}'."),
        )
        .param("model")),
        _ => Ok(()),
    }
}

/// Most inputs one embeddings request may carry (OpenAI's limit).
pub const MAX_EMBEDDING_INPUTS: usize = 2048;

/// A checked `POST /v1/embeddings`.
#[derive(Clone, Debug, PartialEq)]
pub struct Embeddings {
    /// Each input, its own sequence: text still to be tokenized, or token ids (at least
    /// one, each inside the vocabulary). At least one input.
    pub inputs: Vec<CompletionPrompt>,
    /// Answer each vector as base64 of its little-endian f32 bytes instead of numbers.
    pub base64: bool,
}

/// Parses and checks the body of an embeddings request for the model named `model_id`,
/// whose vocabulary has `n_vocab` tokens and whose vectors have `n_embd` values.
pub fn embeddings(body: &[u8], model_id: &str, n_vocab: usize, n_embd: usize) -> Result<Embeddings, ApiError> {
    let req: EmbeddingsRequest = parse_json(body)?;
    check_model(req.model.as_deref(), model_id)?;
    let base64 = match req.encoding_format.as_deref() {
        None | Some("float") => false,
        Some("base64") => true,
        Some(other) => {
            return Err(ApiError::invalid(format!(
                "encoding_format must be \"float\" or \"base64\", not {other:?}"
            ))
            .param("encoding_format"))
        }
    };
    if let Some(dimensions) = req.dimensions.filter(|&d| d != n_embd as u64) {
        return Err(ApiError::invalid(format!(
            "dimensions must be this model's width, {n_embd} (its vectors cannot be shortened), not {dimensions}"
        ))
        .param("dimensions"));
    }
    let tokens = |ids: Vec<u32>| {
        if ids.is_empty() {
            return Err(ApiError::invalid("an input has no tokens").param("input"));
        }
        if let Some(bad) = ids.iter().find(|&&t| t as usize >= n_vocab) {
            return Err(
                ApiError::invalid(format!("token {bad} is outside the vocabulary of {n_vocab}")).param("input"),
            );
        }
        Ok(CompletionPrompt::Tokens(ids))
    };
    let inputs: Vec<CompletionPrompt> = match req.input {
        EmbeddingInput::Text(text) => vec![CompletionPrompt::Text(text)],
        EmbeddingInput::Texts(texts) => texts.into_iter().map(CompletionPrompt::Text).collect(),
        EmbeddingInput::Tokens(ids) if ids.is_empty() => Vec::new(),
        EmbeddingInput::Tokens(ids) => vec![tokens(ids)?],
        EmbeddingInput::TokenLists(lists) => lists.into_iter().map(tokens).collect::<Result<_, _>>()?,
    };
    if inputs.is_empty() {
        return Err(ApiError::invalid("input must not be empty").param("input"));
    }
    if inputs.len() > MAX_EMBEDDING_INPUTS {
        return Err(ApiError::invalid(format!(
            "input holds {} items, more than the {MAX_EMBEDDING_INPUTS} one request may carry",
            inputs.len()
        ))
        .param("input"));
    }
    if inputs
        .iter()
        .any(|i| matches!(i, CompletionPrompt::Text(t) if t.is_empty()))
    {
        return Err(ApiError::invalid("an input is empty text").param("input"));
    }
    Ok(Embeddings { inputs, base64 })
}

/// `input` of an embeddings request.
#[derive(Clone, Debug, serde::Deserialize)]
#[serde(untagged)]
enum EmbeddingInput {
    /// One text.
    Text(String),
    /// One input as token ids.
    Tokens(Vec<u32>),
    /// Several texts.
    Texts(Vec<String>),
    /// Several inputs as token ids.
    TokenLists(Vec<Vec<u32>>),
}

/// `POST /v1/embeddings`, as OpenAI defines it (`user` is accepted and ignored).
#[derive(Clone, Debug, serde::Deserialize)]
struct EmbeddingsRequest {
    input: EmbeddingInput,
    model: Option<String>,
    encoding_format: Option<String>,
    dimensions: Option<u64>,
}

/// The error for a prompt with no tokens (also given after tokenizing an empty text).
pub(crate) fn empty_prompt() -> ApiError {
    ApiError::invalid("the prompt is empty").param("prompt")
}

pub(crate) fn parse_json<T: DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice(body).map_err(|e| {
        let what = if e.is_syntax() || e.is_eof() {
            "malformed JSON"
        } else {
            "invalid request"
        };
        ApiError::invalid(format!("{what}: {e}"))
    })
}

/// The fields both endpoints share, checked against OpenAI's ranges and then
/// [`SamplingParams::validate`].
fn generation(sampling: &Sampling, model_id: &str, logprobs: bool, top_logprobs: u8) -> Result<Generation, ApiError> {
    check_model(sampling.model.as_deref(), model_id)?;
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
    check(
        stop.iter().all(|s| s.len() <= MAX_STOP_BYTES),
        "stop",
        &format!("a stop string may be at most {MAX_STOP_BYTES} bytes long"),
    )?;
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
    let draft = match &sampling.draft {
        Some(mode) => Some(
            mode.parse::<DraftMode>()
                .map_err(|e| ApiError::invalid(e).param("draft"))?,
        ),
        None => None,
    };
    let draft_max = sampling.draft_max.map(|n| n as usize);
    check(
        draft_max.is_none_or(|n| n <= MAX_DRAFT),
        "draft_max",
        &format!("draft_max must be between 0 and {MAX_DRAFT}"),
    )?;
    let max_tokens = match sampling.max_completion_tokens.or(sampling.max_tokens) {
        Some(0) => return Err(ApiError::invalid("max_tokens must be at least 1").param("max_tokens")),
        Some(n) => Some(usize::try_from(n).unwrap_or(usize::MAX)),
        None => None,
    };
    Ok(Generation {
        params,
        stop,
        max_tokens,
        logprobs,
        top_logprobs,
        stream: sampling.stream,
        include_usage: sampling.stream_options.as_ref().is_some_and(|o| o.include_usage),
        draft,
        draft_max,
        grammar: None,
    })
}

fn random_seed() -> u64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    nanos ^ (std::process::id() as u64).rotate_left(32)
}

#[cfg(test)]
mod tests;
