//! The real models under `models/`, when `scripts/fetch-models` has fetched them.

use std::path::PathBuf;

use crate::{GgmlType, Gguf};

/// The bytes of `models/{name}`, or `None` (with a note) when it is absent.
fn read_model(name: &str) -> Option<Vec<u8>> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../models")
        .join(name);
    match std::fs::read(&path) {
        Ok(bytes) => Some(bytes),
        Err(err) => {
            eprintln!("skipping: cannot read {}: {err}", path.display());
            None
        }
    }
}

#[test]
fn qwen2_5_coder_0_5b() {
    let Some(bytes) = read_model("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf") else {
        return;
    };
    let gguf = Gguf::parse(&bytes).unwrap();
    assert_eq!(gguf.architecture().unwrap(), "qwen2");
    assert_eq!(gguf.get_u32("qwen2.block_count").unwrap(), 24);
    let wq = gguf.tensor("blk.0.attn_q.weight").unwrap();
    assert_eq!(wq.dims, [896, 896]);
    assert!(wq.ggml_type.is_quantized());
    assert_eq!(
        gguf.tensors.iter().filter(|t| t.name.starts_with("blk.23.")).count(),
        12
    );
    let tokens = gguf.get_str_array("tokenizer.ggml.tokens").unwrap();
    assert_eq!(tokens.len() as u64, gguf.tensor("token_embd.weight").unwrap().dims[1]);
    assert_eq!(gguf.tensor("output_norm.weight").unwrap().ggml_type, GgmlType::F32);
}

#[test]
fn gemma3_270m() {
    let Some(bytes) = read_model("gemma-3-270m-q4_k_m.gguf") else {
        return;
    };
    let gguf = Gguf::parse(&bytes).unwrap();
    assert_eq!(gguf.architecture().unwrap(), "gemma3");
    let n_layer = gguf.get_u32("gemma3.block_count").unwrap();
    assert!(gguf.tensor(&format!("blk.{}.attn_q.weight", n_layer - 1)).is_some());
    assert!(gguf.tensor(&format!("blk.{n_layer}.attn_q.weight")).is_none());
}
