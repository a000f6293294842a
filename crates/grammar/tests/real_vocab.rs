//! The matcher over a real vocabulary (Qwen2.5's 151,936 tokens, from libllama): the
//! mask computed for all tokens at once agrees with trying tokens one by one, greedy
//! decoding under the mask yields JSON that parses, and how long a mask takes is printed.

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use baton_ggml::LlamaModel;
use baton_grammar::{schema, Grammar, Matcher, TokenTable};

const QWEN: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
);

fn qwen_table() -> (LlamaModel, TokenTable) {
    let vocab = LlamaModel::load_vocab(Path::new(QWEN)).expect("scripts/fetch-models puts qwen2 in models/");
    let table = TokenTable::new(
        (0..vocab.n_vocab() as u32).map(|t| (vocab.token_bytes(t, false), vocab.is_end_of_generation(t))),
    );
    (vocab, table)
}

#[test]
fn masks_over_qwen_vocabulary_agree_with_single_tokens_and_build_json() {
    let (vocab, table) = qwen_table();
    let schema = serde_json::json!({"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "units": {"enum": ["metric", "imperial"]}},
        "required": ["city", "days", "units"], "additionalProperties": false});
    let grammar = Arc::new(Grammar::parse(&schema::to_gbnf(&schema).unwrap()).unwrap());
    let mut matcher = Matcher::new(grammar).unwrap();
    // Text to steer by: at each step take the allowed token that extends it longest.
    let target = r#"{"city": "Zürich, the largest city", "days": 12, "units": "metric"}"#;
    let mut text = String::new();
    let mut allowed = Vec::new();
    let mut slowest = 0f64;
    for _ in 0..200 {
        let started = Instant::now();
        matcher.fill_allowed(&table, &mut allowed).unwrap();
        slowest = slowest.max(started.elapsed().as_secs_f64());
        for t in (0..table.len() as u32).step_by(97) {
            assert_eq!(
                allowed[t as usize],
                matcher.allows(t, &table),
                "token {t} after {text:?}"
            );
        }
        let rest = &target.as_bytes()[text.len()..];
        let best = (0..table.len() as u32)
            .filter(|&t| allowed[t as usize])
            .filter(|&t| !table.bytes(t).unwrap().is_empty() && rest.starts_with(table.bytes(t).unwrap()))
            .max_by_key(|&t| table.bytes(t).unwrap().len());
        let Some(token) = best else {
            assert!(allowed
                .iter()
                .enumerate()
                .any(|(t, &a)| a && vocab.is_end_of_generation(t as u32)));
            break;
        };
        matcher.accept(token, &table).unwrap();
        text.push_str(std::str::from_utf8(table.bytes(token).unwrap()).unwrap());
    }
    assert_eq!(text, target);
    assert!(matcher.is_complete());
    serde_json::from_str::<serde_json::Value>(&text).unwrap();
    eprintln!("slowest mask over {} tokens: {:.1} ms", table.len(), slowest * 1e3);
}
