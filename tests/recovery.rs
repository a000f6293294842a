//! A worker lost mid-stream: `baton serve` over two `baton worker` processes on fixed
//! loopback ports; one is killed with SIGKILL or stopped with SIGSTOP while a greedy
//! completion streams. With spare capacity the stream goes on and its text equals an
//! undisturbed run's; without it the client gets a clear error at once. A restarted
//! worker rejoins the ring.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use common::{model, QWEN2};
use serde_json::{json, Value};

const TOKEN: &str = "recovery-test-token";

/// One cluster at a time: they share two cores.
static SERIAL: Mutex<()> = Mutex::new(());

/// A `baton worker` on a fixed port, so that it can be restarted where it was.
struct Worker {
    child: Child,
    port: u16,
    /// The directory of models it serves.
    models: PathBuf,
    extra: Vec<String>,
}

impl Worker {
    fn start(extra: &[&str]) -> Worker {
        Worker::start_in(model(QWEN2).parent().unwrap(), extra)
    }

    /// A worker serving the models in `models`.
    fn start_in(models: &Path, extra: &[&str]) -> Worker {
        let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let mut worker = Worker {
            child: spawn_worker(port, models, extra),
            port,
            models: models.to_path_buf(),
            extra: extra.iter().map(|s| s.to_string()).collect(),
        };
        worker.wait_ready();
        worker
    }

    fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    fn pid(&self) -> String {
        self.child.id().to_string()
    }

    /// Sends `signal` (e.g. `-STOP`) with the shell's own `kill`, which every Debian has.
    fn signal(&self, signal: &str) {
        let status = Command::new("sh")
            .args(["-c", &format!("kill {signal} {}", self.pid())])
            .status()
            .unwrap();
        assert!(status.success(), "kill {signal}");
    }

    fn kill(&mut self) {
        self.signal("-KILL");
        let _ = self.child.wait();
    }

    fn restart(&mut self) {
        let extra: Vec<&str> = self.extra.iter().map(String::as_str).collect();
        self.child = spawn_worker(self.port, &self.models, &extra);
        self.wait_ready();
    }

    fn wait_ready(&mut self) {
        common::printed_addr(&mut self.child, "listening on ");
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = Command::new("sh")
            .args(["-c", &format!("kill -CONT {}", self.pid())])
            .status();
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn spawn_worker(port: u16, models: &Path, extra: &[&str]) -> Child {
    Command::new(env!("CARGO_BIN_EXE_baton"))
        .args(["worker", "--listen", &format!("127.0.0.1:{port}"), "--threads", "1"])
        .arg("--models")
        .arg(models)
        .args(["--token", TOKEN])
        .args(extra)
        .env_remove("BATON_TOKEN")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("worker starts")
}

/// `baton serve` over the two workers, every layer on the workers, split evenly when
/// both answer.
struct Server {
    child: Child,
    addr: String,
}

impl Server {
    fn start(workers: &[&Worker]) -> Server {
        Server::start_with(workers, &[])
    }

    fn start_with(workers: &[&Worker], extra: &[&str]) -> Server {
        Server::start_layout(workers, &["--split", "12,12"], extra)
    }

    /// With `layout` (`--split 12,12`, `--tp 2`) instead of the even split.
    fn start_layout(workers: &[&Worker], layout: &[&str], extra: &[&str]) -> Server {
        Server::start_served(workers, &model(QWEN2), layout, extra)
    }

    /// Of the model at `path`.
    fn start_served(workers: &[&Worker], path: &Path, layout: &[&str], extra: &[&str]) -> Server {
        let addrs: Vec<String> = workers.iter().map(|w| w.addr()).collect();
        let mut child = Command::new(env!("CARGO_BIN_EXE_baton"))
            .args(["serve", "--port", "0", "--threads", "1", "--no-head-stage"])
            .args(layout)
            .args(["--parallel", "2", "--ctx-size", "1024", "--heartbeat-timeout", "2"])
            // Chunks of 8: a repeated prompt reuses whole chunks of the cache, so the
            // disturbed stream is rebuilt from a partly cached prompt.
            .args(["--chunk", "8"])
            .args(["--token", TOKEN, "--workers", &addrs.join(","), "--model"])
            .arg(path)
            .args(extra)
            .env_remove("BATON_TOKEN")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("baton serve starts");
        let addr = common::printed_addr(&mut child, "listening on http://");
        Server { child, addr }
    }

    fn send(&self, method: &str, path: &str, body: &str) -> TcpStream {
        let mut stream = TcpStream::connect(&self.addr).unwrap();
        stream.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        write!(
            stream,
            "{method} {path} HTTP/1.0\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        stream
    }

    fn get(&self, path: &str) -> (u16, Value) {
        let mut response = String::new();
        self.send("GET", path, "").read_to_string(&mut response).unwrap();
        let status = response.split(' ').nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
        let body = response.split_once("\r\n\r\n").map_or("", |(_, b)| b);
        (status, serde_json::from_str(body).unwrap_or(Value::Null))
    }

    fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        let mut response = String::new();
        self.send("POST", path, &body.to_string())
            .read_to_string(&mut response)
            .unwrap();
        let status = response.split(' ').nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
        let body = response.split_once("\r\n\r\n").map_or("", |(_, b)| b);
        (status, serde_json::from_str(body).unwrap_or(Value::Null))
    }

    /// Streams a greedy completion; `during` runs once `after` tokens have arrived.
    fn stream(&self, after: usize, during: impl FnOnce()) -> Streamed {
        let body = json!({
            "prompt": common::PROMPTS[2],
            "max_tokens": 64,
            "temperature": 0,
            "stream": true,
            "stream_options": {"include_usage": true},
        });
        let mut reader = BufReader::new(self.send("POST", "/v1/completions", &body.to_string()));
        let mut out = Streamed::default();
        let mut during = Some(during);
        let mut last = Instant::now();
        let mut line = String::new();
        while reader.read_line(&mut line).unwrap() > 0 {
            if let Some(data) = line.trim_end().strip_prefix("data: ") {
                if data == "[DONE]" {
                    break;
                }
                let event: Value = serde_json::from_str(data).unwrap();
                out.longest_gap = out.longest_gap.max(last.elapsed());
                last = Instant::now();
                if let Some(error) = event.get("error") {
                    out.error = Some((
                        error["message"].as_str().unwrap_or_default().to_string(),
                        Instant::now(),
                    ));
                    break;
                }
                if let Some(cached) = event["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64() {
                    out.cached = cached;
                }
                if let Some(choice) = event["choices"].get(0) {
                    out.text.push_str(choice["text"].as_str().unwrap_or_default());
                    if let Some(reason) = choice["finish_reason"].as_str() {
                        out.finish = Some(reason.to_string());
                    }
                }
                out.events += 1;
                if out.events == after {
                    if let Some(during) = during.take() {
                        out.disturbed_at = Some(Instant::now());
                        during();
                    }
                }
            }
            line.clear();
        }
        out
    }

    /// Waits until `/health` satisfies `done`; returns the last answer.
    fn wait_health(&self, within: Duration, done: impl Fn(u16, &Value) -> bool) -> (u16, Value) {
        let deadline = Instant::now() + within;
        loop {
            let (status, health) = self.get("/health");
            if done(status, &health) || Instant::now() > deadline {
                return (status, health);
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[derive(Debug, Default)]
struct Streamed {
    text: String,
    events: usize,
    finish: Option<String>,
    error: Option<(String, Instant)>,
    disturbed_at: Option<Instant>,
    longest_gap: Duration,
    /// Prompt tokens taken from the cache.
    cached: u64,
}

fn serving(stages: usize) -> impl Fn(u16, &Value) -> bool {
    move |status, health| status == 200 && health["stages"].as_array().is_some_and(|s| s.len() == stages)
}

/// Kills or stops worker 1 mid-stream and checks the stream goes on unchanged on
/// worker 0 alone; then brings worker 1 back with `revive` and checks it rejoins.
fn lose_a_worker_mid_stream(lose: impl FnOnce(&mut Worker), revive: impl FnOnce(&mut Worker)) {
    lose_a_worker_mid_stream_with(&[], lose, revive);
}

fn lose_a_worker_mid_stream_with(
    serve_args: &[&str],
    lose: impl FnOnce(&mut Worker),
    revive: impl FnOnce(&mut Worker),
) {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let w0 = Worker::start(&[]);
    let mut w1 = Worker::start(&[]);
    let server = Server::start_with(&[&w0, &w1], serve_args);
    let undisturbed = server.stream(usize::MAX, || {});
    assert_eq!(undisturbed.finish.as_deref(), Some("length"), "{undisturbed:?}");
    assert!(undisturbed.events > 32, "{undisturbed:?}");

    let streamed = server.stream(8, || lose(&mut w1));
    eprintln!("longest pause in the disturbed stream: {:?}", streamed.longest_gap);
    assert!(streamed.error.is_none(), "{streamed:?}");
    assert!(streamed.disturbed_at.is_some(), "the worker was lost mid-stream");
    assert!(
        streamed.cached > 0,
        "the disturbed request reused the first one's prompt chunks"
    );
    assert_eq!(streamed.text, undisturbed.text, "the stream goes on unchanged");
    assert_eq!(streamed.finish.as_deref(), Some("length"));
    assert!(
        streamed.longest_gap < Duration::from_secs(10),
        "detected and recovered in {:?}",
        streamed.longest_gap
    );
    let (status, health) = server.get("/health");
    assert_eq!(status, 200, "{health}");
    assert_eq!(health["stages"].as_array().map(Vec::len), Some(1), "{health}");
    assert!(health["lost"].to_string().contains(&w1.addr()), "{health}");

    // Back, it is reconnected and the ring moves back to both workers.
    revive(&mut w1);
    let (status, health) = server.wait_health(Duration::from_secs(30), serving(2));
    assert!(serving(2)(status, &health), "the worker rejoins: {health}");
    let again = server.stream(usize::MAX, || {});
    assert_eq!(again.text, undisturbed.text);
}

/// A synthetic `arch` on 2 workers (2 layers each) loses the second mid-stream; the
/// stream goes on without an error and with the undisturbed text. Returns it.
fn synthetic_stream_survives_a_killed_worker(arch: &str) -> Streamed {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let path = common::synth::synthetic(arch, baton_ggml::FileType::Q4KM);
    let w0 = Worker::start_in(path.parent().unwrap(), &[]);
    let mut w1 = Worker::start_in(path.parent().unwrap(), &[]);
    let server = Server::start_served(&[&w0, &w1], &path, &["--split", "2,2"], &[]);
    let undisturbed = server.stream(usize::MAX, || {});
    assert_eq!(undisturbed.finish.as_deref(), Some("length"), "{undisturbed:?}");
    let streamed = server.stream(8, || w1.kill());
    assert!(streamed.error.is_none(), "{arch}: {streamed:?}");
    assert!(
        streamed.disturbed_at.is_some(),
        "{arch}: the worker was lost mid-stream"
    );
    assert_eq!(streamed.text, undisturbed.text, "{arch}: the stream goes on unchanged");
    streamed
}

/// A hybrid model (synthetic qwen35, recurrent states in half its layers) loses a
/// worker mid-stream: the new ring rebuilds every state by replaying the sequence from
/// position 0, and the text goes on unchanged. The disturbed request started from the
/// first one's checkpoint of its states after its whole prompt chunks.
#[test]
fn a_hybrid_models_stream_goes_on_after_a_killed_worker() {
    let streamed = synthetic_stream_survives_a_killed_worker("qwen35");
    assert!(streamed.cached > 0, "the prompt's whole chunks came from a checkpoint");
}

/// Kimi Linear (synthetic kimi-linear: KDA states in half its layers, MLA latent rows
/// in the others) loses a worker mid-stream: the new ring replays the sequence from
/// position 0, rebuilding the states and the latent rows, and the text goes on
/// unchanged. The disturbed request started from the first one's checkpoint.
#[test]
fn a_kimi_linear_stream_goes_on_after_a_killed_worker() {
    let streamed = synthetic_stream_survives_a_killed_worker("kimi-linear");
    assert!(streamed.cached > 0, "the prompt's whole chunks came from a checkpoint");
}

/// DeepSeek V3.2's sparse attention (synthetic deepseek32) loses a worker mid-stream:
/// the new ring replays the sequence, which fills each layer's indexer keys again with
/// its latent rows, and the text goes on unchanged.
#[test]
fn a_sparse_attention_models_stream_goes_on_after_a_killed_worker() {
    synthetic_stream_survives_a_killed_worker("deepseek32");
}

#[test]
fn a_killed_worker_is_replaced_and_the_stream_goes_on() {
    lose_a_worker_mid_stream(|w| w.kill(), |w| w.restart());
}

/// Drafted tokens are in flight when the worker dies: the rebuilt stream still gives
/// the undrafted text (the model drafts for itself, so every step carries a draft).
#[test]
fn a_killed_worker_is_replaced_while_drafts_are_in_flight() {
    let path = model(QWEN2);
    let args = [
        "--draft-model",
        path.to_str().unwrap(),
        "--draft-max",
        "3",
        "--draft-fixed",
    ];
    lose_a_worker_mid_stream_with(&args, |w| w.kill(), |w| w.restart());
}

#[test]
fn a_hung_worker_is_detected_and_replaced() {
    lose_a_worker_mid_stream(
        |w| w.signal("-STOP"),
        // Resumed, it finds its session's sockets closed, ends it, and answers again.
        |w| w.signal("-CONT"),
    );
}

/// The stage names of `/health` (`"w0+w1 layers 0..24"` for a tensor-parallel group).
fn stage_names(health: &Value) -> Vec<String> {
    health["stages"]
        .as_array()
        .map(|stages| {
            stages
                .iter()
                .map(|s| s.as_str().unwrap_or_default().to_string())
                .collect()
        })
        .unwrap_or_default()
}

/// Issue 19: both workers form one tensor-parallel group (the whole model); member 1 is
/// lost mid-stream. Member 0's exchange fails, its stage stops, the head sees the ring
/// lost and forms a new one over member 0 alone (a pipeline of one), rebuilding the
/// stream on it: the text is the undisturbed one. Back, member 1 rejoins the group.
fn lose_a_tp_member_mid_stream(lose: impl FnOnce(&mut Worker), revive: impl FnOnce(&mut Worker)) {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let w0 = Worker::start(&[]);
    let mut w1 = Worker::start(&[]);
    let group = format!("{}+{} layers 0..24", w0.addr(), w1.addr());
    let server = Server::start_layout(&[&w0, &w1], &["--tp", "2"], &[]);
    let (_, health) = server.get("/health");
    assert_eq!(stage_names(&health), vec![group.clone()], "{health}");
    let undisturbed = server.stream(usize::MAX, || {});
    assert_eq!(undisturbed.finish.as_deref(), Some("length"), "{undisturbed:?}");

    let streamed = server.stream(8, || lose(&mut w1));
    eprintln!("longest pause in the disturbed stream: {:?}", streamed.longest_gap);
    assert!(streamed.error.is_none(), "{streamed:?}");
    assert!(streamed.disturbed_at.is_some(), "the member was lost mid-stream");
    assert_eq!(streamed.text, undisturbed.text, "the stream goes on unchanged");
    assert_eq!(streamed.finish.as_deref(), Some("length"));
    assert!(
        streamed.longest_gap < Duration::from_secs(10),
        "detected and recovered in {:?}",
        streamed.longest_gap
    );
    let (status, health) = server.get("/health");
    assert_eq!(status, 200, "{health}");
    assert_eq!(
        stage_names(&health),
        vec![format!("{} layers 0..24", w0.addr())],
        "{health}"
    );
    assert!(health["lost"].to_string().contains(&w1.addr()), "{health}");

    revive(&mut w1);
    let back = |status: u16, health: &Value| status == 200 && stage_names(health) == [group.clone()];
    let (status, health) = server.wait_health(Duration::from_secs(30), back);
    assert!(back(status, &health), "the member rejoins its group: {health}");
    let again = server.stream(usize::MAX, || {});
    assert_eq!(again.text, undisturbed.text);
}

#[test]
fn a_killed_tp_member_is_replaced_and_the_stream_goes_on() {
    lose_a_tp_member_mid_stream(|w| w.kill(), |w| w.restart());
}

#[test]
fn a_hung_tp_member_is_detected_and_replaced() {
    lose_a_tp_member_mid_stream(|w| w.signal("-STOP"), |w| w.signal("-CONT"));
}

#[test]
fn without_spare_capacity_clients_get_a_clear_error_at_once() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    // Each worker holds half the model, not all of it.
    let memory = ["--memory", "420000000"];
    let w0 = Worker::start(&memory);
    let mut w1 = Worker::start(&memory);
    let server = Server::start(&[&w0, &w1]);

    let streamed = server.stream(4, || w1.kill());
    let (message, at) = streamed.error.clone().expect("the stream ends with an error event");
    let took = at - streamed.disturbed_at.unwrap();
    eprintln!("the client's error came {took:?} after the kill");
    assert!(took < Duration::from_secs(2), "error after {took:?}");
    assert!(
        message.contains("cannot hold the model") && message.contains(&w1.addr()),
        "{message}"
    );

    let (status, health) = server.get("/health");
    assert_eq!(status, 503, "{health}");
    assert_eq!(health["status"], "waiting", "{health}");
    let (status, refused) = server.post("/v1/completions", &json!({ "prompt": "Hi", "max_tokens": 4 }));
    assert_eq!(status, 503, "{refused}");
    assert!(
        refused["error"]["message"]
            .to_string()
            .contains("cannot hold the model"),
        "{refused}"
    );

    w1.restart();
    let (status, health) = server.wait_health(Duration::from_secs(30), serving(2));
    assert!(serving(2)(status, &health), "serving again: {health}");
    let (status, answer) = server.post(
        "/v1/completions",
        &json!({ "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0 }),
    );
    assert_eq!(status, 200, "{answer}");
}

/// A peer that authenticates as a worker, describes itself as holding the model, and
/// then hangs: it never answers the load plan, and never answers a heartbeat (a worker
/// stopped while loading its range).
fn start_worker_that_hangs_while_loading() -> String {
    use baton_net::{server_handshake, LinkOptions, Listener};
    use baton_proto::{Capabilities, DeviceCaps, HeldModel, Message, Role};

    let listener = Listener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().to_string();
    let ring_addr = addr.clone();
    std::thread::spawn(move || {
        while let Ok(incoming) = listener.accept() {
            let ring_addr = ring_addr.clone();
            std::thread::spawn(move || {
                let mut link = incoming.into_link(&LinkOptions::default()).unwrap();
                let role = server_handshake(link.as_mut(), Some(TOKEN.as_bytes())).unwrap();
                while let Ok(msg) = link.recv() {
                    // The load plan and pings are read and never answered.
                    if let (Role::Head, Message::Describe { model }) = (role, msg) {
                        let held = HeldModel {
                            file_name: model.file_name.clone(),
                            identity: model.identity,
                            size: model.size,
                            complete: true,
                            content: None,
                        };
                        let caps = Capabilities {
                            devices: vec![DeviceCaps::cpu(1 << 40, Some(0.001))],
                            threads: 1,
                            models: vec![held],
                            ring_addr: ring_addr.clone(),
                            session: 1,
                        };
                        link.send(Message::Capabilities(caps)).unwrap();
                    }
                }
            });
        }
    });
    addr
}

#[test]
fn a_worker_that_hangs_while_the_ring_forms_is_left_out_in_time() {
    use baton_cluster::{ClusterOptions, Members, Supervisor};
    use baton_engine::{FormError, RingSource};

    let addr = start_worker_that_hangs_while_loading();
    let opts = ClusterOptions {
        token: Some(TOKEN.into()),
        n_ctx: 256,
        repack: true,
        ..Default::default()
    };
    let workers = [addr.clone()];
    let mut supervisor = Supervisor::new(&model(QWEN2), Members::new(&workers), opts, Duration::from_secs(1));
    let (done, outcome) = std::sync::mpsc::channel();
    let started = Instant::now();
    std::thread::spawn(move || {
        let result = supervisor.form(std::sync::Arc::new(|_: &str, _: &str| {}));
        let _ = done.send(result.err());
    });
    let error = outcome
        .recv_timeout(Duration::from_secs(20))
        .expect("forming the ring must not wait for a hung worker")
        .expect("no ring can be formed on a hung worker");
    let took = started.elapsed();
    eprintln!("forming gave up after {took:?}: {error:?}");
    assert!(took < Duration::from_secs(5), "{took:?}");
    let (FormError::Retry(text) | FormError::Capacity(text)) = error;
    assert!(text.contains(&addr), "{text}");
}

/// Issue 19: the second member of a tensor-parallel group describes itself and then
/// hangs, so member 0 waits for it to link, and the head waits on member 0. The head's
/// heartbeat finds the hung worker lost and ends the formation (every worker's control
/// link is closed while the ring forms), instead of waiting for member 0 to give up.
#[test]
fn a_member_that_hangs_while_its_group_forms_ends_the_formation_in_time() {
    use baton_cluster::{ClusterOptions, Members, Supervisor};
    use baton_engine::{FormError, RingSource};

    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let w0 = Worker::start(&["--handshake-timeout", "60"]);
    let hung = start_worker_that_hangs_while_loading();
    let opts = ClusterOptions {
        token: Some(TOKEN.into()),
        n_ctx: 256,
        repack: true,
        tp: baton_plan::TpDegree::Fixed(2),
        ..Default::default()
    };
    let workers = [w0.addr(), hung.clone()];
    let mut supervisor = Supervisor::new(&model(QWEN2), Members::new(&workers), opts, Duration::from_secs(1));
    let (done, outcome) = std::sync::mpsc::channel();
    let started = Instant::now();
    std::thread::spawn(move || {
        let result = supervisor.form(std::sync::Arc::new(|_: &str, _: &str| {}));
        let _ = done.send(result.err());
    });
    let error = outcome
        .recv_timeout(Duration::from_secs(30))
        .expect("forming the ring must not wait for a hung member")
        .expect("no ring can be formed with a hung member");
    let took = started.elapsed();
    eprintln!("forming gave up after {took:?}: {error:?}");
    assert!(took < Duration::from_secs(5), "{took:?}");
    let (FormError::Retry(text) | FormError::Capacity(text)) = error;
    assert!(text.contains(&hung), "{text}");
}
