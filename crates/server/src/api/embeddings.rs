//! `POST /v1/embeddings`: each input is its own sequence through the ring, its rows
//! pooled and L2-normalized by the last stage (mean, cls or last, as the model's GGUF
//! says or `--pooling` overrides), answered in OpenAI's shape.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use base64::Engine as _;
use baton_engine::{Event, Job, SubmitError};
use serde_json::{json, Value};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

use super::{read_body, record_refusal, ApiError, AppState};
use crate::metrics::Outcome;
use crate::request::{self, CompletionPrompt};

pub(super) async fn embeddings(State(state): State<Arc<AppState>>, body: Body) -> Result<Response, ApiError> {
    let result = embeddings_inner(&state, body).await;
    match &result {
        Ok(_) => state.metrics.request("embeddings", Outcome::Ok),
        Err(_) => record_refusal(&state, "embeddings", &result),
    }
    result
}

async fn embeddings_inner(state: &Arc<AppState>, body: Body) -> Result<Response, ApiError> {
    let pooling = state.config.pooling.clone().map_err(|why| {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            Some("embeddings_unsupported"),
            why,
        )
    })?;
    let body = read_body(state, body).await?;
    let req = state
        .off_runtime(move |state| {
            request::embeddings(
                &body,
                &state.config.model_id,
                state.vocab.n_vocab(),
                state.engine().n_embd(),
            )
        })
        .await?;
    for input in &req.inputs {
        if let CompletionPrompt::Text(text) = input {
            state.check_size(text.len(), "input")?;
        }
    }
    let inputs = req.inputs;
    let prompts: Vec<Vec<u32>> = state
        .off_runtime(move |state| {
            inputs
                .into_iter()
                .map(|input| match input {
                    // As llama-server tokenizes an input: special tokens added and parsed.
                    CompletionPrompt::Text(text) => state.tokenize_plain(&text, true, true),
                    CompletionPrompt::Tokens(tokens) => Ok(tokens),
                })
                .collect()
        })
        .await?;
    let slot_ctx = state.engine().slot_ctx();
    for (i, prompt) in prompts.iter().enumerate() {
        if prompt.is_empty() {
            return Err(ApiError::invalid(format!("input {i} has no tokens")).param("input"));
        }
        if prompt.len() > slot_ctx {
            return Err(ApiError::new(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                Some("context_length_exceeded"),
                format!(
                    "input {i} is {} tokens, more than this model's context per sequence of {slot_ctx} tokens",
                    prompt.len()
                ),
            )
            .param("input"));
        }
    }
    // As many inputs in the engine at once as it has slots: a large batch waits its
    // turn here instead of filling the queue other requests share.
    let window = state.engine().n_slots().max(1);
    let mut vectors: Vec<Option<Vec<f32>>> = vec![None; prompts.len()];
    let mut prompt_tokens = 0;
    let mut running: std::collections::VecDeque<(usize, UnboundedReceiver<Event>)> = Default::default();
    let mut next = 0;
    while next < prompts.len() || !running.is_empty() {
        while next < prompts.len() && running.len() < window {
            running.push_back((next, submit(state, prompts[next].clone(), pooling)?));
            next += 1;
        }
        let Some((i, mut events)) = running.pop_front() else {
            break;
        };
        let (vector, tokens) = pooled(&mut events).await?;
        prompt_tokens += tokens;
        vectors[i] = Some(vector);
    }
    let data: Vec<Value> = vectors
        .into_iter()
        .enumerate()
        .map(|(index, vector)| {
            let vector = vector.unwrap_or_default();
            let embedding = match req.base64 {
                true => Value::String(base64_floats(&vector)),
                false => json!(vector),
            };
            json!({ "object": "embedding", "index": index, "embedding": embedding })
        })
        .collect();
    Ok(Json(json!({
        "object": "list",
        "data": data,
        "model": state.config.model_id,
        "usage": { "prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens },
    }))
    .into_response())
}

/// Hands one input to the engine as a pooled job.
fn submit(
    state: &AppState,
    prompt: Vec<u32>,
    pooling: baton_engine::Pooling,
) -> Result<UnboundedReceiver<Event>, ApiError> {
    let (events, receiver) = unbounded_channel();
    let job = Job {
        prompt,
        params: baton_sample::SamplingParams::greedy(),
        max_tokens: 0,
        logprobs: false,
        top_logprobs: 0,
        stop: Vec::new(),
        draft: baton_engine::Draft::OFF,
        grammar: None,
        budget: None,
        show: Vec::new(),
        end: None,
        pooling: Some(pooling),
        events,
    };
    state
        .engine()
        .submit(job)
        .map_err(|e: SubmitError| ApiError::from(e).param("input"))?;
    Ok(receiver)
}

/// Waits for a pooled job's vector; also returns its prompt tokens.
async fn pooled(events: &mut UnboundedReceiver<Event>) -> Result<(Vec<f32>, usize), ApiError> {
    loop {
        match events.recv().await {
            Some(Event::Finished(finish)) => {
                let vector = finish
                    .embedding
                    .ok_or_else(|| ApiError::server("the request finished without its embedding"))?;
                return Ok((vector, finish.prompt_tokens));
            }
            Some(Event::Failed(failure)) => return Err(ApiError::from(failure)),
            Some(Event::Token(_)) => {}
            None => return Err(ApiError::server("the engine dropped the request")),
        }
    }
}

/// `values` as OpenAI's `encoding_format: "base64"` sends them: the little-endian bytes
/// of each f32, in standard base64.
fn base64_floats(values: &[f32]) -> String {
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_vectors_are_little_endian_f32_bytes() {
        // 1.0 = 00 00 80 3f, -2.0 = 00 00 00 c0.
        assert_eq!(base64_floats(&[1.0, -2.0]), "AACAPwAAAMA=");
        assert_eq!(base64_floats(&[]), "");
    }
}
