//! `baton serve` child processes for the end-to-end tests: a head with 2 local
//! workers, plain HTTP/1.0 requests, SSE streams.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::Duration;

use serde_json::Value;

use super::{model, QWEN2};

pub const KEY: &str = "test-api-key";

/// One server at a time: they share two cores, and counters are read per server.
static SERIAL: Mutex<()> = Mutex::new(());

/// A `baton serve` process (on 2 local workers unless started otherwise); killed on
/// drop (its workers follow).
pub struct Server {
    child: Child,
    pub addr: String,
    /// File name of the model it serves.
    model: String,
}

impl Server {
    pub fn start(extra: &[&str]) -> Server {
        let mut args = vec!["--api-key", KEY];
        args.extend_from_slice(extra);
        Server::start_keyless(&args)
    }

    /// A server without `--api-key` (only loopback names and its own page's origin).
    pub fn start_keyless(extra: &[&str]) -> Server {
        Server::launch(&model(QWEN2), &["--local-workers", "2"], extra)
    }

    /// A server of `model` (a file name in models/) on 2 local workers.
    pub fn start_model(name: &'static str, extra: &[&str]) -> Server {
        Server::start_path(&model(name), extra)
    }

    /// A server of the model file at `path` on 2 local workers.
    pub fn start_path(path: &std::path::Path, extra: &[&str]) -> Server {
        Server::start_on(path, &["--local-workers", "2"], extra)
    }

    /// A server of the model file at `path` (with an API key) whose stages run where
    /// `cluster` says (`--stages N` in its own process, `--local-workers N`).
    pub fn start_on(path: &std::path::Path, cluster: &[&str], extra: &[&str]) -> Server {
        let mut args = vec!["--api-key", KEY];
        args.extend_from_slice(extra);
        Server::launch(path, cluster, &args)
    }

    /// A server whose ring runs on `workers` (already started, requiring `token`).
    pub fn start_on_workers(workers: &[String], token: &str, extra: &[&str]) -> Server {
        let workers = workers.join(",");
        let mut args = vec!["--api-key", KEY];
        args.extend_from_slice(extra);
        Server::launch(&model(QWEN2), &["--workers", &workers, "--token", token], &args)
    }

    /// `baton serve` on `served` (a file name in models/) with `cluster` arguments
    /// (where the stages run) and `extra` ones.
    /// Unless `extra` gives a --ctx-size, 4096 cells shared by the --parallel
    /// sequences: the model's whole trained context (baton's default) for each of 4
    /// would cost every test server a gigabyte and more.
    fn launch(served: &std::path::Path, cluster: &[&str], extra: &[&str]) -> Server {
        let sized = extra.iter().any(|a| *a == "--ctx-size" || *a == "-c");
        let size: &[&str] = if sized { &[] } else { &["--ctx-size", "4096"] };
        Server::launch_sized(served, cluster, &[size, extra].concat())
    }

    /// `baton serve` of QWEN2 (with an API key) on `cluster`, with `extra` arguments
    /// and the context baton chooses unless they give one.
    pub fn start_sized_by_baton(cluster: &[&str], extra: &[&str]) -> Server {
        Server::launch_sized(&model(QWEN2), cluster, &[&["--api-key", KEY][..], extra].concat())
    }

    fn launch_sized(served: &std::path::Path, cluster: &[&str], extra: &[&str]) -> Server {
        let mut child = Command::new(env!("CARGO_BIN_EXE_baton"))
            .args(["serve", "--port", "0", "--threads", "1", "--model"])
            .arg(served)
            .args(cluster)
            .args(extra)
            .env_remove("BATON_TOKEN")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("baton serve starts");
        let addr = super::printed_addr(&mut child, "listening on http://");
        Server {
            child,
            addr,
            model: served
                .file_name()
                .map_or_else(String::new, |n| n.to_string_lossy().into_owned()),
        }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// `program` set up to talk to this server: BATON_URL, BATON_API_KEY and BATON_MODEL.
    fn client(&self, program: &str) -> Command {
        let mut cmd = Command::new(program);
        cmd.env("BATON_URL", self.url())
            .env("BATON_API_KEY", KEY)
            .env("BATON_MODEL", self.model_id());
        cmd
    }

    /// Runs pytest on `target` (relative to the repository) against this server, with
    /// the project's Python; whether every test passed (pytest prints what failed).
    pub fn pytest(&self, target: &str) -> bool {
        self.client(python())
            .args(["-m", "pytest", target, "-q", "-x", "-p", "no:cacheprovider"])
            .env("PYTHONDONTWRITEBYTECODE", "1")
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .status()
            .expect("python runs (scripts/setup installs tests/openai/requirements.txt into .venv)")
            .success()
    }

    /// `node --test` on `files` of tests/node against this server, one file at a time
    /// (scripts/setup installs what they import).
    pub fn node_tests(&self, files: &[&str]) -> Command {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/node");
        assert!(
            std::path::Path::new(dir).join("node_modules/openai").exists(),
            "tests/node/node_modules is missing: run scripts/setup"
        );
        let mut cmd = self.client("node");
        cmd.args(["--test", "--test-concurrency=1"])
            .args(files)
            .current_dir(dir);
        cmd
    }

    pub fn model_id(&self) -> String {
        self.model.trim_end_matches(".gguf").to_string()
    }

    /// One request (HTTP/1.0, so the body ends when the server closes).
    pub fn request(&self, method: &str, path: &str, body: Option<&Value>, key: Option<&str>) -> (u16, String) {
        let mut stream = self.send(method, path, body.map(|b| b.to_string()).as_deref(), key);
        let mut response = String::new();
        stream.read_to_string(&mut response).unwrap();
        split_response(&response)
    }

    pub fn send(&self, method: &str, path: &str, body: Option<&str>, key: Option<&str>) -> TcpStream {
        let mut stream = TcpStream::connect(&self.addr).unwrap();
        stream.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
        let body = body.unwrap_or("");
        let auth = key
            .map(|k| format!("Authorization: Bearer {k}\r\n"))
            .unwrap_or_default();
        write!(
            stream,
            "{method} {path} HTTP/1.0\r\nHost: test\r\n{auth}Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        stream
    }

    pub fn post(&self, path: &str, body: &Value) -> Value {
        let (status, text) = self.request("POST", path, Some(body), Some(KEY));
        assert_eq!(status, 200, "{path}: {text}");
        serde_json::from_str(&text).unwrap()
    }

    pub fn stats(&self) -> Value {
        let (status, text) = self.request("GET", "/stats", None, Some(KEY));
        assert_eq!(status, 200, "{text}");
        serde_json::from_str(&text).unwrap()
    }

    /// A streaming request; returns the `data:` payloads in order.
    pub fn stream(&self, path: &str, body: &Value) -> Vec<String> {
        let stream = self.send("POST", path, Some(&body.to_string()), Some(KEY));
        let mut events = Vec::new();
        let mut reader = BufReader::new(stream);
        let mut line = String::new();
        while reader.read_line(&mut line).unwrap() > 0 {
            if let Some(data) = line.trim_end().strip_prefix("data: ") {
                events.push(data.to_string());
            }
            line.clear();
        }
        events
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The Python of the project's `.venv` (scripts/setup puts the test clients there), or
/// `python3` when there is none.
pub fn python() -> &'static str {
    let venv = concat!(env!("CARGO_MANIFEST_DIR"), "/.venv/bin/python");
    if std::path::Path::new(venv).exists() {
        venv
    } else {
        "python3"
    }
}

/// One sample of a metric: its name, labels and value.
#[derive(Debug)]
pub struct Sample {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub value: f64,
}

/// Parses an OpenMetrics exposition with Prometheus' own parser (`prometheus_client`,
/// in the `.venv` that scripts/setup makes), so the text is checked as Prometheus
/// reads it.
pub fn parse_metrics(text: &str) -> Vec<Sample> {
    const PARSE: &str = "import json, sys\n\
        from prometheus_client.openmetrics.parser import text_string_to_metric_families\n\
        samples = [{'name': s.name, 'labels': s.labels, 'value': s.value}\n\
                   for f in text_string_to_metric_families(sys.stdin.read()) for s in f.samples]\n\
        print(json.dumps(samples))\n";
    let mut child = Command::new(python())
        .args(["-c", PARSE])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("python runs (scripts/setup installs prometheus-client into .venv)");
    child.stdin.take().unwrap().write_all(text.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "Prometheus' parser refused /metrics:\n{text}");
    let samples: Vec<Value> = serde_json::from_slice(&out.stdout).unwrap();
    samples
        .iter()
        .map(|s| Sample {
            name: s["name"].as_str().unwrap().to_string(),
            labels: s["labels"]
                .as_object()
                .unwrap()
                .iter()
                .map(|(k, v)| (k.clone(), v.as_str().unwrap().to_string()))
                .collect(),
            value: s["value"].as_f64().unwrap(),
        })
        .collect()
}

/// The value of the sample `name` whose labels include `labels`, if there is one.
pub fn sample(samples: &[Sample], name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    samples
        .iter()
        .find(|s| {
            s.name == name
                && labels
                    .iter()
                    .all(|(k, v)| s.labels.get(*k).map(String::as_str) == Some(*v))
        })
        .map(|s| s.value)
}

pub fn split_response(response: &str) -> (u16, String) {
    let status = response.split(' ').nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    let body = response.split_once("\r\n\r\n").map_or("", |(_, b)| b).to_string();
    (status, body)
}

pub fn lock() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}
