//! `baton worker` child processes for the end-to-end tests, greedy output from a ring,
//! and libllama's greedy output that a ring must reproduce.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};

use baton_cluster::{ClusterOptions, RemoteRing};
use baton_engine::GenerateRequest;
use baton_ggml::{LlamaContext, LlamaModel};
use baton_sample::{argmax, SamplingParams};

/// The directory of the test models, which the test workers serve.
pub fn models_dir() -> PathBuf {
    super::model(super::QWEN2).parent().unwrap().to_path_buf()
}

/// What the tests form rings of workers with: `token`, 512 cells, weights repacked.
pub fn options(token: &str) -> ClusterOptions {
    ClusterOptions {
        token: Some(token.into()),
        n_ctx: 512,
        repack: true,
        ..Default::default()
    }
}

/// A `baton worker` child process; killed on drop. Its stderr is collected.
pub struct WorkerProc {
    child: Child,
    pub addr: String,
    log: Arc<Mutex<String>>,
}

impl WorkerProc {
    /// Starts a worker on a free loopback port serving `models`, with `extra` arguments.
    pub fn start(models: &Path, token: Option<&str>, extra: &[&str]) -> WorkerProc {
        WorkerProc::start_at("127.0.0.1:0", models, token, extra)
    }

    /// Starts a worker listening on `listen` (`host:port` or `unix:PATH`).
    pub fn start_at(listen: &str, models: &Path, token: Option<&str>, extra: &[&str]) -> WorkerProc {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_baton"));
        cmd.args(["worker", "--listen", listen, "--threads", "1", "--models"])
            .arg(models)
            .args(extra)
            .env("BATON_LOG", "info")
            .env_remove("BATON_TOKEN")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if let Some(token) = token {
            cmd.args(["--token", token]);
        }
        let mut child = cmd.spawn().expect("worker starts");
        let addr = super::printed_addr(&mut child, "listening on ");
        let log = Arc::new(Mutex::new(String::new()));
        let stderr = child.stderr.take().unwrap();
        let sink = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                sink.lock().unwrap().push_str(&(line + "\n"));
            }
        });
        WorkerProc { child, addr, log }
    }

    /// What it logged so far.
    pub fn log(&self) -> String {
        self.log.lock().unwrap().clone()
    }

    /// Its process id.
    #[allow(dead_code)]
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Open file descriptors of the process (sockets included).
    #[allow(dead_code)]
    pub fn open_fds(&self) -> usize {
        std::fs::read_dir(format!("/proc/{}/fd", self.child.id())).map_or(0, |d| d.count())
    }

    /// Whether it is still alive.
    pub fn is_running(&mut self) -> bool {
        self.child.try_wait().unwrap().is_none()
    }
}

impl Drop for WorkerProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Up to `n` greedy tokens from libllama itself.
pub fn reference(oracle: &LlamaModel, prompt: &[u32], n: usize) -> Vec<u32> {
    reference_in(oracle, prompt, n, super::fidelity::SHORT)
}

/// [`reference`] in a context of `setup`.
pub fn reference_in(oracle: &LlamaModel, prompt: &[u32], n: usize, setup: super::fidelity::Setup) -> Vec<u32> {
    let types = [setup.kv_types.k.dtype(), setup.kv_types.v.dtype()];
    let mut ctx = LlamaContext::with_cache_types(oracle, setup.n_ctx as u32, setup.n_batch as u32, 1, types).unwrap();
    let mut next = argmax(&ctx.decode(prompt).unwrap()).unwrap();
    let mut out = Vec::new();
    while out.len() < n && !oracle.is_end_of_generation(next) {
        out.push(next);
        next = argmax(&ctx.decode(&[next]).unwrap()).unwrap();
    }
    out
}

/// Up to `n` greedy tokens from the ring.
pub fn greedy(ring: &mut RemoteRing, prompt: &[u32], n: usize, oracle: &LlamaModel) -> Vec<u32> {
    greedy_in(ring, prompt, n, oracle, 512)
}

/// [`greedy`] with prompts computed in batches of `n_batch`.
pub fn greedy_in(ring: &mut RemoteRing, prompt: &[u32], n: usize, oracle: &LlamaModel, n_batch: usize) -> Vec<u32> {
    let req = GenerateRequest {
        seq: 0,
        prompt,
        params: SamplingParams::greedy(),
        max_tokens: n,
        n_batch,
        logprobs: false,
    };
    ring.head()
        .unwrap()
        .generate(&req, |t| oracle.is_end_of_generation(t), |_| {})
        .unwrap()
        .tokens
}

/// Asserts that the ring's greedy continuation of every test prompt (32 tokens) is
/// libllama's. `label` names the case in a failure.
pub fn assert_prompts_match(ring: &mut RemoteRing, oracle: &LlamaModel, label: &str) {
    for prompt_text in super::PROMPTS {
        let prompt = oracle.tokenize(prompt_text, true, true).unwrap();
        assert_eq!(
            greedy(ring, &prompt, 32, oracle),
            reference(oracle, &prompt, 32),
            "{label}: {prompt_text:?}"
        );
    }
}
