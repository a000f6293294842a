//! A tokenizer copied from another GGUF: every `tokenizer.*` key, optionally cut to
//! the first `n` ordinary tokens so that a small model's embedding stays small.
//!
//! Cutting keeps every special token (control, user-defined, unknown, byte tokens),
//! renumbered after the ordinary ones, keeps only the BPE merges whose two parts and
//! result all survive, and renumbers the `*_token_id` keys (dropping those whose token
//! is gone). The result tokenizes any text, with fewer merges than the original.

use std::collections::{HashMap, HashSet};

use baton_gguf::{Gguf, Value};

use crate::SynthError;

const TOKENS: &str = "tokenizer.ggml.tokens";
const TYPES: &str = "tokenizer.ggml.token_type";
const SCORES: &str = "tokenizer.ggml.scores";
const MERGES: &str = "tokenizer.ggml.merges";

/// llama.cpp's token type of ordinary text pieces (`LLAMA_TOKEN_TYPE_NORMAL`).
const NORMAL: i128 = 1;
/// Token type of tokens nothing produces (`LLAMA_TOKEN_TYPE_UNUSED`).
const UNUSED: i128 = 5;

/// The tokenizer keys of `source`, cut to `max_ordinary` ordinary tokens when given.
/// Returns the keys and the vocabulary size they describe.
pub fn copy_tokenizer(source: &Gguf, max_ordinary: Option<usize>) -> Result<(Vec<(String, Value)>, usize), SynthError> {
    let keys: Vec<(String, Value)> = source
        .metadata
        .iter()
        .filter(|(k, _)| k.starts_with("tokenizer."))
        .cloned()
        .collect();
    let tokens = source.get_str_array(TOKENS).map_err(SynthError::Tokenizer)?;
    let n_tokens = tokens.len();
    let Some(max) = max_ordinary.filter(|&m| m < n_tokens) else {
        return Ok((keys, n_tokens));
    };
    let types: Vec<i128> = match source.get(TYPES).and_then(Value::as_array) {
        Some(items) => items.iter().map(|v| v.as_integer().unwrap_or(NORMAL)).collect(),
        None => vec![NORMAL; n_tokens],
    };
    // Old id -> new id of every kept token, ordinary ones first in id order.
    let kept: Vec<usize> = (0..n_tokens)
        .filter(|&id| {
            let kind = types.get(id).copied().unwrap_or(NORMAL);
            if kind == NORMAL {
                id < max
            } else {
                kind != UNUSED
            }
        })
        .collect();
    let new_id: HashMap<usize, usize> = kept.iter().enumerate().map(|(new, &old)| (old, new)).collect();
    let texts: HashSet<&str> = kept.iter().map(|&id| tokens[id]).collect();

    let mut out = Vec::with_capacity(keys.len());
    for (key, value) in keys {
        let value = match key.as_str() {
            TOKENS | TYPES | SCORES => match value {
                Value::Array(items) => Value::Array(kept.iter().filter_map(|&id| items.get(id).cloned()).collect()),
                other => other,
            },
            MERGES => match value {
                Value::Array(items) => Value::Array(
                    items
                        .into_iter()
                        .filter(|merge| {
                            merge.as_str().and_then(|m| m.split_once(' ')).is_some_and(|(a, b)| {
                                texts.contains(a) && texts.contains(b) && texts.contains(format!("{a}{b}").as_str())
                            })
                        })
                        .collect(),
                ),
                other => other,
            },
            k if k.starts_with("tokenizer.ggml.") && k.ends_with("_token_id") => {
                match value.as_integer().and_then(|id| usize::try_from(id).ok()) {
                    Some(old) => match new_id.get(&old) {
                        Some(&new) => Value::U32(new as u32),
                        None => continue,
                    },
                    None => value,
                }
            }
            _ => value,
        };
        out.push((key, value));
    }
    Ok((out, kept.len()))
}

#[cfg(test)]
mod tests {
    use baton_gguf::GgufWriter;

    use super::*;

    fn strings(items: &[&str]) -> Value {
        Value::Array(items.iter().map(|s| Value::Str(s.to_string())).collect())
    }

    #[test]
    fn cutting_keeps_specials_renumbers_ids_and_drops_merges_of_lost_tokens() {
        let source = GgufWriter::new()
            .kv_str("general.architecture", "qwen2")
            .kv_str("tokenizer.ggml.model", "gpt2")
            .kv(
                TOKENS,
                strings(&["a", "b", "c", "ab", "abc", "bc", "<|end|>", "<unused>"]),
            )
            .kv(
                TYPES,
                Value::Array([1, 1, 1, 1, 1, 1, 3, 5].into_iter().map(Value::I32).collect()),
            )
            .kv(MERGES, strings(&["a b", "ab c", "b c"]))
            .kv_u32("tokenizer.ggml.eos_token_id", 6)
            .kv_u32("tokenizer.ggml.padding_token_id", 4)
            .to_bytes();
        let gguf = Gguf::parse(&source).unwrap();
        let (keys, n_vocab) = copy_tokenizer(&gguf, Some(4)).unwrap();
        assert_eq!(n_vocab, 5, "a b c ab and the control token");
        let get = |k: &str| keys.iter().find(|(key, _)| key == k).map(|(_, v)| v.clone());
        assert_eq!(get(TOKENS), Some(strings(&["a", "b", "c", "ab", "<|end|>"])));
        assert_eq!(get(MERGES), Some(strings(&["a b"])), "abc and bc are gone");
        assert_eq!(get("tokenizer.ggml.eos_token_id"), Some(Value::U32(4)));
        assert_eq!(get("tokenizer.ggml.padding_token_id"), None, "its token is gone");
        assert_eq!(get("tokenizer.ggml.model"), Some(Value::Str("gpt2".into())));
        assert!(get("general.architecture").is_none(), "only tokenizer keys are copied");

        let (all, n_all) = copy_tokenizer(&gguf, None).unwrap();
        assert_eq!(n_all, 8);
        assert_eq!(all.len(), 6, "every tokenizer key");
    }
}
