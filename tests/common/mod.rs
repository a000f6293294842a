//! Shared helpers of the end-to-end tests: the real models and a stage chain that
//! returns logits (the ring itself only returns sampled tokens).
#![allow(dead_code)]

use std::ops::Range;
use std::path::PathBuf;
use std::sync::Arc;

use baton_ggml::{Device, LlamaModel};
use baton_model::{Batch, LogitReply, ModelFile, Stage, StageConfig, StageInput, StageOutput, StageSpan};

pub mod fidelity;
pub mod proxy;
pub mod server;
pub mod synth;
pub mod worker;

/// The qwen2 test model (Qwen2.5-Coder-0.5B-Instruct, Q4_K_M).
pub const QWEN2: &str = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf";
/// The gemma3 test model (gemma-3-270m, Q4_K_M).
pub const GEMMA3: &str = "gemma-3-270m-q4_k_m.gguf";

/// Prompts used by the fidelity tests.
pub const PROMPTS: [&str; 3] = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
];

/// Path of a real model; panics with the fix when it has not been fetched.
pub fn model(name: &str) -> PathBuf {
    let dir = std::env::var_os("BATON_MODELS").map_or_else(
        || PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("models"),
        PathBuf::from,
    );
    let path = dir.join(name);
    assert!(
        path.exists(),
        "{} is missing: run scripts/fetch-models first",
        path.display()
    );
    path
}

/// Stages for `ranges`, chained in this thread.
pub struct Chain {
    pub stages: Vec<Stage>,
    /// Round hidden states to f16 between stages, as `--wire-dtype f16` does.
    pub wire_f16: bool,
}

/// `n` distinct prompts, tokenized by `vocab`: the test prompts in turn, each numbered.
pub fn numbered_prompts(vocab: &LlamaModel, n: usize) -> Vec<Vec<u32>> {
    (0..n)
        .map(|i| {
            let text = format!("{} ({i})", PROMPTS[i % PROMPTS.len()]);
            vocab.tokenize(&text, true, true).unwrap()
        })
        .collect()
}

impl Chain {
    /// Computes prompt `i` as sequence `i`, from position 0; returns their lengths.
    pub fn prefill_all(&mut self, prompts: &[Vec<u32>]) -> Vec<i32> {
        for (seq, prompt) in prompts.iter().enumerate() {
            self.logits(seq as u32, prompt, 0);
        }
        prompts.iter().map(|p| p.len() as i32).collect()
    }

    /// Cuts sequence `i` back to `lens[i]` positions in every stage.
    pub fn truncate_all(&mut self, lens: &[i32]) {
        for stage in &mut self.stages {
            for (seq, &len) in lens.iter().enumerate() {
                stage.truncate_seq(seq as u32, len as usize);
            }
        }
    }

    pub fn load(file: &Arc<ModelFile>, ranges: &[Range<usize>], n_ctx: usize) -> Chain {
        Self::load_with(file, ranges, &StageConfig::new(n_ctx, 2))
    }

    pub fn load_with(file: &Arc<ModelFile>, ranges: &[Range<usize>], config: &StageConfig) -> Chain {
        let on_cpu: Vec<_> = ranges.iter().map(|r| (r.clone(), Device::cpu())).collect();
        Self::load_on(file, &on_cpu, config)
    }

    /// Stages for `ranges`, each on its device.
    pub fn load_on(file: &Arc<ModelFile>, stages: &[(Range<usize>, Device)], config: &StageConfig) -> Chain {
        let n = stages.len();
        let stages = stages
            .iter()
            .enumerate()
            .map(|(i, (r, device))| {
                let span = StageSpan {
                    layers: r.clone(),
                    first: i == 0,
                    last: i + 1 == n,
                };
                Stage::load_on(file.clone(), span, config, *device).expect("stage loads")
            })
            .collect();
        Chain {
            stages,
            wire_f16: false,
        }
    }

    /// Runs `tokens` at positions `start..` of sequence `seq` through every stage;
    /// returns the logits of the last token.
    pub fn logits(&mut self, seq: u32, tokens: &[u32], start: i32) -> Vec<f32> {
        let positions: Vec<i32> = (start..start + tokens.len() as i32).collect();
        let seq_ids = vec![seq; tokens.len()];
        self.forward(tokens, &positions, &seq_ids, &[tokens.len() as u32 - 1], false)
    }

    /// Runs one batch through every stage; returns the logits of `rows`. `decode`: the
    /// rows are decode rows ([`Batch::decode`]: a token and its drafts).
    pub fn forward(
        &mut self,
        tokens: &[u32],
        positions: &[i32],
        seq_ids: &[u32],
        rows: &[u32],
        decode: bool,
    ) -> Vec<f32> {
        let mut hidden = Vec::new();
        let n = self.stages.len();
        for (i, stage) in self.stages.iter_mut().enumerate() {
            let input = if i == 0 {
                StageInput::Tokens(tokens)
            } else {
                StageInput::Hidden(&hidden)
            };
            let logit_rows: &[u32] = if i + 1 == n { rows } else { &[] };
            let batch = Batch {
                input,
                positions,
                seq_ids,
                logit_rows,
                decode,
            };
            match stage.forward(&batch, LogitReply::Logits).expect("forward succeeds") {
                StageOutput::Hidden(h) if self.wire_f16 => {
                    hidden = baton_proto::Payload::f16_rows(&h, tokens.len())
                        .widen_f16()
                        .expect("f16 payload")
                }
                StageOutput::Hidden(h) => hidden = h,
                StageOutput::Logits(l) => return l,
                StageOutput::Best(_) | StageOutput::Normed(_) => unreachable!("logits were asked for"),
            }
        }
        unreachable!("the last stage returns logits")
    }
}

/// Normalised mean squared error of `ours` against `reference`.
pub fn nmse(ours: &[f32], reference: &[f32]) -> f64 {
    assert_eq!(ours.len(), reference.len());
    let err: f64 = ours
        .iter()
        .zip(reference)
        .map(|(a, b)| (*a as f64 - *b as f64).powi(2))
        .sum();
    let norm: f64 = reference.iter().map(|b| (*b as f64).powi(2)).sum();
    err / norm
}

/// The address a `baton` child process prints as its first stdout line after `prefix`
/// (`"listening on "` for a worker, `"listening on http://"` for a server).
pub fn printed_addr(child: &mut std::process::Child, prefix: &str) -> String {
    use std::io::BufRead;
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().expect("stdout is piped"))
        .read_line(&mut line)
        .unwrap();
    line.trim()
        .strip_prefix(prefix)
        .unwrap_or_else(|| panic!("expected {prefix:?}..., the child printed {line:?}"))
        .to_string()
}

/// Connects to `addr` from the local address `from` (any 127.0.0.0/8 address on Linux
/// reaches a server on 127.0.0.1: a second "host" on one machine).
#[allow(dead_code)]
pub fn connect_from(from: &str, addr: &str) -> std::net::TcpStream {
    use std::net::SocketAddr;
    let target: SocketAddr = addr.parse().unwrap();
    let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
    socket
        .bind(&format!("{from}:0").parse::<SocketAddr>().unwrap().into())
        .unwrap();
    socket.connect(&target.into()).unwrap();
    socket.into()
}
