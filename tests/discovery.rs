//! A cluster that forms itself: workers announce themselves on a network of their own
//! (network namespaces this test creates: one per node, veth pairs into a bridge in a
//! namespace of its own; nothing outside them is touched), `baton serve --discover` finds
//! them with no address typed, a worker that announces itself during a stream joins and
//! gets layers, and a worker stopped with SIGTERM during a stream drains; both streams'
//! text stays what it was alone.
//!
//! Needs root (to create namespaces); where namespaces cannot be created the test says
//! so and does nothing.

mod common;

use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;

/// Namespaces `<tag>1..=<tag>N` on the bridge namespace `<tag>br`, node i at 10.77.0.i.
struct Network {
    tag: String,
    nodes: usize,
}

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip").args(args).output().map_err(|e| format!("ip: {e}"))?;
    match out.status.success() {
        true => Ok(()),
        false => Err(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        )),
    }
}

impl Network {
    fn create(nodes: usize) -> Result<Network, String> {
        let tag = format!("bd{}", std::process::id() % 100_000);
        let br = format!("{tag}br");
        ip(&["netns", "add", &br])?;
        // From here on, dropping it removes what was made.
        let mut net = Network { tag, nodes: 0 };
        let in_br = |args: &[&str]| ip(&[&["netns", "exec", &br, "ip"], args].concat());
        in_br(&["link", "add", "br0", "type", "bridge", "mcast_snooping", "0"])?;
        in_br(&["link", "set", "br0", "up"])?;
        for i in 1..=nodes {
            let ns = net.ns(i);
            ip(&["netns", "add", &ns])?;
            net.nodes = i;
            let (inner, outer) = (format!("{}v{i}", net.tag), format!("{}p{i}", net.tag));
            ip(&["link", "add", &inner, "type", "veth", "peer", "name", &outer])?;
            ip(&["link", "set", &inner, "netns", &ns])?;
            ip(&["link", "set", &outer, "netns", &br])?;
            in_br(&["link", "set", &outer, "master", "br0"])?;
            in_br(&["link", "set", &outer, "up"])?;
            let in_ns = |args: &[&str]| ip(&[&["netns", "exec", &ns, "ip"], args].concat());
            in_ns(&["link", "set", "lo", "up"])?;
            in_ns(&["addr", "add", &format!("10.77.0.{i}/24"), "dev", &inner])?;
            in_ns(&["link", "set", &inner, "up"])?;
        }
        Ok(net)
    }

    fn ns(&self, i: usize) -> String {
        format!("{}{i}", self.tag)
    }

    /// `baton ARGS` in node i's namespace.
    fn baton(&self, i: usize, args: &[&str]) -> Node {
        let mut child = Command::new("ip")
            .args(["netns", "exec", &self.ns(i), env!("CARGO_BIN_EXE_baton")])
            .args(args)
            .env("BATON_LOG", "info")
            .env_remove("BATON_TOKEN")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("baton starts");
        let log = Arc::new(Mutex::new(String::new()));
        let (stderr, sink) = (child.stderr.take().unwrap(), log.clone());
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                sink.lock().unwrap().push_str(&(line + "\n"));
            }
        });
        Node { child, log }
    }

    /// `curl ARGS` in node i's namespace, its whole output.
    fn curl(&self, i: usize, args: &[&str]) -> String {
        let out = Command::new("ip")
            .args(["netns", "exec", &self.ns(i), "curl", "-sS", "--max-time", "300"])
            .args(args)
            .output()
            .expect("curl runs");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }
}

impl Drop for Network {
    fn drop(&mut self) {
        for i in 1..=self.nodes {
            let _ = ip(&["netns", "del", &self.ns(i)]);
        }
        let _ = ip(&["netns", "del", &format!("{}br", self.tag)]);
    }
}

/// A `baton` process in a namespace; killed on drop.
struct Node {
    child: Child,
    log: Arc<Mutex<String>>,
}

impl Node {
    fn log(&self) -> String {
        self.log.lock().unwrap().clone()
    }

    fn first_line(&mut self) -> String {
        let mut line = String::new();
        BufReader::new(self.child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        line
    }

    fn signal(&self, signal: &str) {
        let status = Command::new("kill")
            .args([&format!("-{signal}"), &self.child.id().to_string()])
            .status()
            .unwrap();
        assert!(status.success());
    }

    /// Waits for the process to exit, at most `timeout`.
    fn wait(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if let Some(status) = self.child.try_wait().unwrap() {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        None
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The head serves on loopback in its own namespace; requests come from there too.
const URL: &str = "http://127.0.0.1:8080";

fn completion(max_tokens: usize, stream: bool) -> String {
    serde_json::json!({
        "prompt": common::PROMPTS[1],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
    })
    .to_string()
}

/// A streamed completion from node 1, on a thread: its text, and whether it finished.
fn stream(net: &Arc<Network>, max_tokens: usize) -> std::thread::JoinHandle<(String, bool)> {
    let net = net.clone();
    std::thread::spawn(move || {
        let body = completion(max_tokens, true);
        let mut child = Command::new("ip")
            .args(["netns", "exec", &net.ns(1), "curl", "-sSN", "--max-time", "300"])
            .args(["-H", "content-type: application/json", "-d", &body])
            .arg(format!("{URL}/v1/completions"))
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut out = String::new();
        child.stdout.take().unwrap().read_to_string(&mut out).unwrap();
        child.wait().unwrap();
        let mut text = String::new();
        let mut finished = false;
        for data in out.lines().filter_map(|l| l.strip_prefix("data: ")) {
            if data == "[DONE]" {
                finished = true;
                continue;
            }
            let chunk: Value = serde_json::from_str(data).unwrap_or_else(|e| panic!("{e}: {data}"));
            assert!(chunk.get("error").is_none(), "the stream failed: {data}");
            text.push_str(chunk["choices"][0]["text"].as_str().unwrap_or_default());
        }
        (text, finished)
    })
}

fn health(net: &Network) -> Value {
    serde_json::from_str(&net.curl(1, &[&format!("{URL}/health")])).unwrap_or(Value::Null)
}

fn stages(net: &Network) -> Vec<String> {
    health(net)["stages"]
        .as_array()
        .map(|s| s.iter().map(|v| v.as_str().unwrap().to_string()).collect())
        .unwrap_or_default()
}

/// Waits until `stages` satisfies `done`, at most `timeout`.
fn wait_for_stages(net: &Network, timeout: Duration, done: impl Fn(&[String]) -> bool) -> Vec<String> {
    let deadline = Instant::now() + timeout;
    loop {
        let now = stages(net);
        if done(&now) || Instant::now() > deadline {
            return now;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn workers_found_on_the_network_form_a_cluster_that_grows_and_shrinks_with_the_same_text() {
    let _guard = common::server::lock();
    let net = match Network::create(4) {
        Ok(net) => Arc::new(net),
        Err(why) => {
            eprintln!("SKIPPED: cannot create network namespaces here ({why})");
            return;
        }
    };
    let token_file = std::env::temp_dir().join(format!("baton-discovery-{}.token", std::process::id()));
    std::fs::write(&token_file, "discovery test cluster token").unwrap();
    let token = token_file.to_str().unwrap();
    let models = common::model(common::QWEN2)
        .parent()
        .unwrap()
        .to_str()
        .unwrap()
        .to_string();
    let worker = |i: usize| {
        net.baton(
            i,
            &[
                "worker",
                "--announce",
                "--models",
                &models,
                "--token-file",
                token,
                "--threads",
                "1",
            ],
        )
    };

    // Two workers and a head, no address typed.
    let mut w2 = worker(2);
    let _w3 = worker(3);
    let model = common::model(common::QWEN2);
    let mut head = net.baton(
        1,
        &[
            "serve",
            "--model",
            model.to_str().unwrap(),
            "--discover",
            "--no-head-stage",
            "--token-file",
            token,
            "--port",
            "8080",
        ],
    );
    let line = head.first_line();
    assert!(line.starts_with("listening on"), "{line}\n{}", head.log());
    let formed = stages(&net);
    assert_eq!(
        formed.len(),
        2,
        "two stages, one per worker found: {formed:?}\n{}",
        head.log()
    );
    for ip in ["10.77.0.2", "10.77.0.3"] {
        assert!(formed.iter().any(|s| s.starts_with(ip)), "{ip} in {formed:?}");
    }

    // The text the cluster gives alone.
    let tokens = 96;
    let alone: Value = serde_json::from_str(&net.curl(
        1,
        &[
            "-H",
            "content-type: application/json",
            "-d",
            &completion(tokens, false),
            &format!("{URL}/v1/completions"),
        ],
    ))
    .unwrap();
    let alone = alone["choices"][0]["text"].as_str().unwrap().to_string();
    assert!(!alone.is_empty());

    // A worker that announces itself during a stream joins and gets layers.
    let streaming = stream(&net, tokens);
    std::thread::sleep(Duration::from_millis(800));
    let _w4 = worker(4);
    let grown = wait_for_stages(&net, Duration::from_secs(60), |s| {
        s.iter().any(|s| s.starts_with("10.77.0.4"))
    });
    let still_streaming = !streaming.is_finished();
    let (text, finished) = streaming.join().unwrap();
    assert!(
        grown.iter().any(|s| s.starts_with("10.77.0.4")),
        "the joining worker got layers: {grown:?}\n{}",
        head.log()
    );
    assert!(still_streaming, "the worker joined while the stream ran");
    let log = head.log();
    assert!(
        log.contains("a worker joins the cluster") && log.contains("new ring:") && log.contains("plan:"),
        "the join and the planner's choice are printed: {log}"
    );
    assert!(finished, "the stream finished");
    assert_eq!(text, alone, "the same text with a worker joining mid-stream");
    let stats: Value = serde_json::from_str(&net.curl(1, &[&format!("{URL}/stats")])).unwrap();
    assert!(stats["workers_joined"].as_u64().unwrap() >= 1, "{stats}");
    let status = Command::new("ip")
        .args([
            "netns",
            "exec",
            &net.ns(1),
            env!("CARGO_BIN_EXE_baton"),
            "status",
            "--url",
            URL,
        ])
        .output()
        .unwrap();
    let status = String::from_utf8_lossy(&status.stdout);
    assert!(status.starts_with(&format!("{URL}: ok")), "{status}");
    assert!(
        status.contains("10.77.0.4:7070") && status.contains("1 joined"),
        "{status}"
    );

    // A worker stopped during a stream drains: the stream finishes with the same text,
    // the worker exits by itself, and the ring goes on without it.
    let streaming = stream(&net, tokens);
    std::thread::sleep(Duration::from_millis(800));
    w2.signal("TERM");
    let exited = w2.wait(Duration::from_secs(40));
    let (text, finished) = streaming.join().unwrap();
    assert!(finished, "the stream finished");
    assert_eq!(text, alone, "the same text with a worker leaving mid-stream");
    assert_eq!(
        exited.map(|s| s.code()),
        Some(Some(0)),
        "the worker left cleanly:\n{}",
        w2.log()
    );
    let shrunk = stages(&net);
    assert!(!shrunk.iter().any(|s| s.starts_with("10.77.0.2")), "{shrunk:?}");
    let health = health(&net);
    assert_eq!(health["status"], "ok", "{health}");
    let stats: Value = serde_json::from_str(&net.curl(1, &[&format!("{URL}/stats")])).unwrap();
    assert_eq!(stats["requests_failed"], 0, "{stats}");
    let _ = std::fs::remove_file(&token_file);
}

/// The text of a streamed completion's events.
fn streamed_text(events: &[String]) -> String {
    events
        .iter()
        .filter(|e| *e != "[DONE]")
        .map(|e| {
            let chunk: Value = serde_json::from_str(e).unwrap();
            assert!(chunk.get("error").is_none(), "the stream failed: {e}");
            chunk["choices"][0]["text"].as_str().unwrap_or_default().to_string()
        })
        .collect()
}

#[test]
fn a_worker_with_an_invite_joins_a_running_server_and_the_stream_keeps_its_text() {
    use common::server::{Server, KEY};
    use common::worker::WorkerProc;
    let _guard = common::server::lock();
    let token = "invite test cluster token";
    let model = common::model(common::QWEN2);
    let first = WorkerProc::start(model.parent().unwrap(), Some(token), &[]);
    let server = Arc::new(Server::start_on_workers(
        std::slice::from_ref(&first.addr),
        token,
        &["--no-head-stage"],
    ));
    // The joining machine has its own models directory (the token is kept there).
    let dir = std::env::temp_dir().join(format!("baton-invite-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let linked = dir.join(model.file_name().unwrap());
    if std::fs::hard_link(&model, &linked).is_err() {
        std::fs::copy(&model, &linked).unwrap();
    }

    // Refusals: a bad ttl, and joins without a valid invite.
    let (status, text) = server.request(
        "POST",
        "/v1/cluster/invites",
        Some(&serde_json::json!({"url": server.url(), "ttl_seconds": 0})),
        Some(KEY),
    );
    assert_eq!(status, 400, "{text}");
    let (status, _) = server.request(
        "POST",
        "/v1/cluster/invites",
        Some(&serde_json::json!({"url": server.url()})),
        None,
    );
    assert_eq!(status, 401, "invites need the API key");
    let bogus = serde_json::json!({"invite": "0011223344556677", "nonce": "00".repeat(32), "port": 7070, "proof": "00".repeat(32)});
    let (status, text) = server.request("POST", "/cluster/join", Some(&bogus), None);
    assert_eq!(status, 403, "{text}");

    let alone = server.post(
        "/v1/completions",
        &serde_json::from_str(&completion(64, false)).unwrap(),
    );
    let alone = alone["choices"][0]["text"].as_str().unwrap().to_string();

    // `baton invite` prints the code on stdout.
    let out = Command::new(env!("CARGO_BIN_EXE_baton"))
        .args(["invite", "--url", &server.url(), "--api-key", KEY])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let code = String::from_utf8(out.stdout).unwrap().trim().to_string();
    assert!(code.starts_with("baton-invite-1."), "{code}");

    let streaming = {
        let server = server.clone();
        std::thread::spawn(move || {
            let body: Value = serde_json::from_str(&completion(64, true)).unwrap();
            streamed_text(&server.stream("/v1/completions", &body))
        })
    };
    std::thread::sleep(Duration::from_millis(500));
    // No token on its command line or in its environment: the invite brings it.
    let mut joiner = Command::new(env!("CARGO_BIN_EXE_baton"))
        .args(["worker", "--listen", "127.0.0.1:0", "--threads", "1", "--models"])
        .arg(&dir)
        .env("BATON_JOIN", &code)
        .env_remove("BATON_TOKEN")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let joined = common::printed_addr(&mut joiner, "listening on ");
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut stages = Vec::new();
    while Instant::now() < deadline {
        let (_, health) = server.request("GET", "/health", None, Some(KEY));
        stages = serde_json::from_str::<Value>(&health).unwrap()["stages"]
            .as_array()
            .map(|s| s.iter().map(|v| v.as_str().unwrap_or_default().to_string()).collect())
            .unwrap_or_default();
        if stages.iter().any(|s: &String| s.starts_with(&joined)) {
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let text = streaming.join().unwrap();
    assert!(
        stages.iter().any(|s| s.starts_with(&joined)),
        "{joined} got layers: {stages:?}"
    );
    assert_eq!(text, alone, "the same text with a worker joining mid-stream");
    let kept = dir.join(".baton/cluster.token");
    assert_eq!(
        std::fs::read_to_string(&kept).unwrap(),
        token,
        "the token is kept for restarts"
    );
    use std::os::unix::fs::PermissionsExt as _;
    assert_eq!(std::fs::metadata(&kept).unwrap().permissions().mode() & 0o777, 0o600);

    // The invite is spent.
    let again = Command::new(env!("CARGO_BIN_EXE_baton"))
        .args(["worker", "--listen", "127.0.0.1:0", "--models"])
        .arg(&dir)
        .env("BATON_JOIN", &code)
        .env_remove("BATON_TOKEN")
        .output()
        .unwrap();
    assert!(!again.status.success());
    let err = String::from_utf8_lossy(&again.stderr);
    assert!(err.contains("no such invite, or it was used"), "{err}");
    let _ = joiner.kill();
    let _ = joiner.wait();
    let _ = std::fs::remove_dir_all(&dir);
}
