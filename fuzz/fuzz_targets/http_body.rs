//! Request bodies of `POST /v1/chat/completions`, `POST /v1/completions` and
//! `POST /v1/embeddings`, up to the
//! point where a job would be submitted: every input is parsed as both, and a chat that
//! passes is rendered as the handler would, with the default (ChatML) template and with
//! one in the style of the models' own.
//!
//! Checked: nothing panics; no allocation is out of proportion to the body; an accepted
//! request holds what the engine relies on (valid sampling parameters, at most 4 stop
//! strings, `max_tokens` at least 1, bounded log-probabilities, a non-empty prompt of
//! in-vocabulary tokens) and `fit_slot` hands the engine a prompt plus `max_tokens` that
//! fits the slot; a refusal is a 4xx whose response serializes.
#![no_main]

use axum::response::IntoResponse;
use baton_fuzz::{check_allocations, LargestAlloc};
use baton_server::request::{chat, completion, embeddings, fit_slot, CompletionPrompt, Generation, MAX_EMBEDDING_INPUTS};
use baton_server::template::{ChatTemplate, DEFAULT_TEMPLATE};
use baton_server::ApiError;
use libfuzzer_sys::fuzz_target;

#[global_allocator]
static ALLOC: LargestAlloc = LargestAlloc;

/// The served model's id, as the seeds name it.
const MODEL: &str = "qwen2.5-coder-0.5b-instruct-q4_k_m";
/// That model's vocabulary size.
const N_VOCAB: usize = 151_936;
/// Tokens per slot, and the prompt length assumed for a text prompt.
const SLOT_CTX: usize = 4096;
const TEXT_PROMPT_LEN: usize = 100;

/// A template in the style of the models' own: role checks with `raise_exception`,
/// Python string methods, and transformers' `tojson` with options (custom code in
/// crates/server/src/template.rs).
const MODEL_STYLE_TEMPLATE: &str = r#"{{- bos_token -}}
{%- for message in messages -%}
  {%- if message.role not in ['system', 'user', 'assistant', 'tool'] -%}
    {{- raise_exception('Unknown role: ' + message.role) -}}
  {%- endif -%}
  {{- '<start_of_turn>' + message.role | replace('assistant', 'model') + '\n' -}}
  {{- message.content.strip() + '<end_of_turn>\n' -}}
  {{- message | tojson -}}
  {{- message.content.split('\n') | tojson(ensure_ascii=true, indent=2, sort_keys=true) -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<start_of_turn>model\n' -}}{%- endif -%}"#;

thread_local! {
    /// The default (ChatML) template and [`MODEL_STYLE_TEMPLATE`], compiled once.
    static TEMPLATES: [ChatTemplate; 2] = [
        ChatTemplate::new(Some(DEFAULT_TEMPLATE), "", "").expect("the default template compiles"),
        ChatTemplate::new(Some(MODEL_STYLE_TEMPLATE), "<bos>", "<eos>").expect("the model-style template compiles"),
    ];
}

fuzz_target!(|data: &[u8]| {
    match check_allocations(data.len(), || chat(data, MODEL)) {
        Ok(req) => {
            assert!(!req.messages.is_empty());
            let g = &req.generation;
            assert!(g.params.validate().is_ok() && g.stop.len() <= 4 && g.max_tokens != Some(0));
            assert!(g.top_logprobs <= 20 && (g.logprobs || g.top_logprobs == 0));
            TEMPLATES.with(|templates| {
                for template in templates {
                    let _ = template.render(&req.messages, true);
                }
            });
            fits(g, TEXT_PROMPT_LEN);
        }
        Err(err) => refused(err),
    }
    match check_allocations(data.len(), || completion(data, MODEL, N_VOCAB)) {
        Ok(req) => {
            let g = &req.generation;
            assert!(g.params.validate().is_ok() && g.stop.len() <= 4 && g.max_tokens != Some(0));
            assert!(g.top_logprobs <= 5);
            let prompt_len = match &req.prompt {
                CompletionPrompt::Tokens(tokens) => {
                    assert!(!tokens.is_empty() && tokens.iter().all(|&t| (t as usize) < N_VOCAB));
                    tokens.len()
                }
                CompletionPrompt::Text(_) => TEXT_PROMPT_LEN,
            };
            fits(g, prompt_len);
        }
        Err(err) => refused(err),
    }
    match check_allocations(data.len(), || embeddings(data, MODEL, N_VOCAB, 896)) {
        Ok(req) => {
            assert!(!req.inputs.is_empty() && req.inputs.len() <= MAX_EMBEDDING_INPUTS);
            for input in &req.inputs {
                match input {
                    CompletionPrompt::Tokens(tokens) => {
                        assert!(!tokens.is_empty() && tokens.iter().all(|&t| (t as usize) < N_VOCAB))
                    }
                    CompletionPrompt::Text(text) => assert!(!text.is_empty()),
                }
            }
        }
        Err(err) => refused(err),
    }
});

/// What the engine is handed fits the slot: prompt plus tokens to generate.
fn fits(generation: &Generation, prompt_len: usize) {
    match fit_slot(generation, prompt_len, SLOT_CTX) {
        Ok(max_tokens) => assert!(max_tokens >= 1 && prompt_len.checked_add(max_tokens).is_some_and(|n| n <= SLOT_CTX)),
        Err(err) => refused(err),
    }
}

fn refused(err: ApiError) {
    assert!(err.status().is_client_error(), "{err:?}");
    assert!(!err.message().is_empty());
    assert!(err.into_response().status().is_client_error());
}
