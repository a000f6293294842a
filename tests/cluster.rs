//! Head and workers as real processes on loopback: the ring reproduces llama.cpp, only
//! activations and token ids cross the wire, weights stream once to a worker that
//! lacks them, and bad peers never take a worker down.

mod common;

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use baton_cluster::{connect_cluster, ClusterOptions};
use baton_ggml::LlamaModel;
use baton_proto::{Payload, StartSeq};
use baton_sample::SamplingParams;
use common::worker::{assert_prompts_match, greedy, models_dir, reference, WorkerProc};
use common::{model, GEMMA3, PROMPTS, QWEN2};

const TOKEN: &str = "test-cluster-secret";

fn options() -> ClusterOptions {
    common::worker::options(TOKEN)
}

/// Counts the bytes TCP connections carry each way; forwards them to a target given
/// after binding (so a worker can advertise the proxy before it starts).
struct CountingProxy {
    listener: Option<TcpListener>,
    addr: String,
    up: Arc<AtomicU64>,
    down: Arc<AtomicU64>,
}

impl CountingProxy {
    fn bind() -> CountingProxy {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        CountingProxy {
            listener: Some(listener),
            addr,
            up: Arc::default(),
            down: Arc::default(),
        }
    }

    fn forward_to(&mut self, target: String) {
        let listener = self.listener.take().unwrap();
        let (u, d) = (self.up.clone(), self.down.clone());
        std::thread::spawn(move || {
            for client in listener.incoming().map_while(Result::ok) {
                let server = TcpStream::connect(&target).unwrap();
                client.set_nodelay(true).unwrap();
                server.set_nodelay(true).unwrap();
                pipe(client.try_clone().unwrap(), server.try_clone().unwrap(), u.clone());
                pipe(server, client, d.clone());
            }
        });
    }
}

fn pipe(mut from: TcpStream, mut to: TcpStream, count: Arc<AtomicU64>) {
    std::thread::spawn(move || {
        let mut buf = vec![0u8; 1 << 16];
        while let Ok(n) = from.read(&mut buf) {
            if n == 0 || to.write_all(&buf[..n]).is_err() {
                break;
            }
            count.fetch_add(n as u64, Ordering::Relaxed);
        }
        let _ = to.shutdown(std::net::Shutdown::Both);
    });
}

fn check_model_on_two_workers(name: &str) {
    let path = model(name);
    let oracle = LlamaModel::load_full(&path, true).unwrap();
    let w0 = WorkerProc::start(&models_dir(), Some(TOKEN), &[]);
    let w1 = WorkerProc::start(&models_dir(), Some(TOKEN), &[]);
    let mut ring = connect_cluster(&path, &[w0.addr.clone(), w1.addr.clone()], &options()).unwrap();
    assert_eq!(ring.plan.stages.len(), 2);
    assert!(
        ring.workers.iter().all(|w| w.streamed == 0),
        "both workers hold the file: no weights on the wire"
    );
    assert_prompts_match(&mut ring, &oracle, name);
}

#[test]
fn qwen2_on_two_workers_matches_llama_cpp() {
    check_model_on_two_workers(QWEN2);
}

#[test]
fn gemma3_on_two_workers_matches_llama_cpp() {
    check_model_on_two_workers(GEMMA3);
}

/// A q4_0 KV cache on two TCP workers (the types travel in each worker's `LoadPlan`):
/// the greedy tokens of llama.cpp with `-ctk q4_0 -ctv q4_0`.
#[test]
fn a_quantized_kv_cache_on_two_workers_matches_llama_cpp() {
    use baton_model::{CacheType, KvTypes};
    use common::fidelity::{Setup, SHORT};
    let path = model(GEMMA3);
    let oracle = LlamaModel::load_full(&path, true).unwrap();
    let w0 = WorkerProc::start(&models_dir(), Some(TOKEN), &[]);
    let w1 = WorkerProc::start(&models_dir(), Some(TOKEN), &[]);
    let kv_types = KvTypes::both(CacheType::Q4_0);
    let options = ClusterOptions {
        kv_types,
        split: Some(vec![9, 9]),
        ..options()
    };
    let mut ring = connect_cluster(&path, &[w0.addr.clone(), w1.addr.clone()], &options).unwrap();
    assert_eq!(ring.plan.stages.len(), 2);
    let prompt = oracle.tokenize(PROMPTS[2], true, true).unwrap();
    let setup = Setup { kv_types, ..SHORT };
    let expected = common::worker::reference_in(&oracle, &prompt, 32, setup);
    assert_ne!(
        expected,
        reference(&oracle, &prompt, 32),
        "q4_0 changes llama.cpp's tokens here, so the test sees the type arrive"
    );
    assert_eq!(greedy(&mut ring, &prompt, 32, &oracle), expected);
}

#[test]
fn per_token_traffic_is_one_hidden_state_per_hop_and_a_token_id_back() {
    let path = model(QWEN2);
    let n_embd = baton_model::ModelFile::open(&path).unwrap().hparams().n_embd as u64;
    // Worker 0 reaches worker 1 through a counting proxy that worker 1 advertises.
    let mut proxy = CountingProxy::bind();
    let w0 = WorkerProc::start(&models_dir(), Some(TOKEN), &[]);
    let w1 = WorkerProc::start(&models_dir(), Some(TOKEN), &["--advertise", &proxy.addr]);
    proxy.forward_to(w1.addr.clone());
    let mut ring = connect_cluster(&path, &[w0.addr.clone(), w1.addr.clone()], &options()).unwrap();
    let head = ring.head().unwrap();
    head.control(StartSeq::new(0, SamplingParams::greedy(), vec![]).into())
        .unwrap();
    let mut token = head
        .forward(Payload::Tokens(vec![1, 2, 3]), vec![0, 1, 2], vec![0; 3], vec![2])
        .unwrap()[0]
        .token;
    let (up0, back0) = (proxy.up.load(Ordering::Relaxed), ring.from_last.received());
    const STEPS: u64 = 20;
    for pos in 3..3 + STEPS as i32 {
        token = ring
            .head()
            .unwrap()
            .forward(Payload::Tokens(vec![token]), vec![pos], vec![0], vec![0])
            .unwrap()[0]
            .token;
    }
    let hop = (proxy.up.load(Ordering::Relaxed) - up0) / STEPS;
    let back = (ring.from_last.received() - back0) / STEPS;
    println!(
        "per token: worker 0 -> worker 1 {hop} bytes (n_embd x 4 = {}), last stage -> head {back} bytes",
        n_embd * 4
    );
    assert!(hop <= n_embd * 4 + 256, "worker link carries {hop} bytes per token");
    assert!(hop >= n_embd * 4, "the hidden state itself must cross ({hop})");
    assert!(back <= 64, "head receives {back} bytes per token");
}

#[test]
fn a_worker_without_the_file_receives_its_tensors_once() {
    let path = model(GEMMA3);
    let oracle = LlamaModel::load_full(&path, true).unwrap();
    let empty = tempdir("stream");
    let prompt = oracle.tokenize(PROMPTS[0], true, true).unwrap();
    let expected = reference(&oracle, &prompt, 16);
    let holder = WorkerProc::start(&models_dir(), Some(TOKEN), &[]);
    for attempt in 0..2 {
        let lacking = WorkerProc::start(&empty, Some(TOKEN), &[]);
        let mut ring = connect_cluster(&path, &[holder.addr.clone(), lacking.addr.clone()], &options()).unwrap();
        let (streamed, received) = (ring.workers[1].streamed, ring.workers[1].received);
        if attempt == 0 {
            // The head and the worker that holds the file share the tensors, balanced
            // by bytes one whole tensor at a time (here gemma3's output embedding alone
            // is most of the stage: the head sends it, the holder the rest).
            assert!(
                streamed > 10 << 20,
                "first start streams the stage's weights ({streamed} bytes)"
            );
            assert!(
                received > streamed + (1 << 20),
                "the holder sent part of them: {received} received, {streamed} from the head"
            );
            assert!(holder.log().contains("sent tensors to a peer"), "{}", holder.log());
        } else {
            assert_eq!((streamed, received), (0, 0), "a restarted worker loads from its cache");
        }
        assert_eq!(ring.workers[0].streamed, 0);
        assert_eq!(greedy(&mut ring, &prompt, 16, &oracle), expected);
    }
}

fn tempdir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("baton-{tag}-{}-{}", std::process::id(), rand_suffix()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn rand_suffix() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64
}

#[test]
fn wrong_or_missing_token_is_refused_on_both_sides() {
    let path = model(GEMMA3);
    let worker = WorkerProc::start(&models_dir(), Some(TOKEN), &[]);
    let wrong = ClusterOptions {
        token: Some("not-the-secret".into()),
        ..options()
    };
    let err = connect_cluster(&path, std::slice::from_ref(&worker.addr), &wrong)
        .err()
        .expect("refused")
        .to_string();
    assert!(err.contains("wrong token"), "{err}");
    let missing = ClusterOptions {
        token: None,
        ..options()
    };
    let err = connect_cluster(&path, std::slice::from_ref(&worker.addr), &missing)
        .err()
        .expect("refused")
        .to_string();
    assert!(err.contains("requires a token"), "{err}");
    std::thread::sleep(Duration::from_millis(200));
    let log = worker.log();
    assert!(log.contains("wrong token"), "worker log: {log}");
    assert!(log.contains("requires a token"), "worker log: {log}");

    let open = WorkerProc::start(&models_dir(), None, &[]);
    let err = connect_cluster(&path, std::slice::from_ref(&open.addr), &options())
        .err()
        .expect("refused")
        .to_string();
    assert!(err.contains("without a token"), "{err}");
}

/// Sends raw bytes to the worker, then reads until it closes (or 5 s pass).
fn poke(addr: &str, bytes: &[u8], then_close: bool) -> Vec<u8> {
    let mut stream = TcpStream::connect(addr).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let _ = stream.write_all(bytes);
    if then_close {
        return Vec::new();
    }
    let mut reply = Vec::new();
    let _ = stream.read_to_end(&mut reply);
    reply
}

fn frame(kind: u16, payload: &[u8]) -> Vec<u8> {
    let mut out = baton_proto::header(kind, payload.len()).to_vec();
    out.extend_from_slice(payload);
    out
}

#[test]
fn bad_peers_are_dropped_and_the_worker_keeps_serving() {
    let path = model(GEMMA3);
    let oracle = LlamaModel::load_full(&path, true).unwrap();
    let mut worker = WorkerProc::start(&models_dir(), Some(TOKEN), &[]);
    let addr = worker.addr.clone();

    // Garbage, HTTP, an oversized length field, an unknown kind, a truncated frame.
    poke(&addr, b"\x00\x01garbage that is not a frame at all\xff\xfe", false);
    poke(&addr, b"GET / HTTP/1.1\r\nHost: worker\r\n\r\n", false);
    poke(&addr, &[0xff, 0xff, 0xff, 0xff, 1, 0, 0, 0], false);
    poke(&addr, &frame(999, b"whatever"), false);
    poke(&addr, &frame(1, &[1, 2, 3]), false);
    // A frame announcing 1000 bytes, of which 10 arrive before the peer vanishes.
    let mut partial = baton_proto::header(1, 1000).to_vec();
    partial.extend_from_slice(&[0; 10]);
    poke(&addr, &partial, true);
    // A Hello with a wrong protocol version gets a Refused that says so.
    let mut hello = Vec::new();
    baton_proto::encode(
        &baton_proto::Message::Hello {
            version: 99,
            role: baton_proto::Role::Head,
            nonce: [7; 32],
        },
        &mut hello,
    );
    let reply = poke(&addr, &hello, false);
    assert!(
        String::from_utf8_lossy(&reply).contains("protocol version 99"),
        "reply: {reply:?}"
    );

    // A real head works, and a second head is refused while it is connected.
    let prompt = oracle.tokenize(PROMPTS[0], true, true).unwrap();
    let expected = reference(&oracle, &prompt, 8);
    let mut ring = connect_cluster(&path, std::slice::from_ref(&addr), &options()).unwrap();
    let second = connect_cluster(&path, std::slice::from_ref(&addr), &options())
        .err()
        .expect("second head refused")
        .to_string();
    assert!(second.contains("another head"), "{second}");
    assert_eq!(greedy(&mut ring, &prompt, 8, &oracle), expected);
    drop(ring);

    // The first head left: a new one is served again.
    std::thread::sleep(Duration::from_millis(300));
    let mut ring = connect_cluster(&path, std::slice::from_ref(&addr), &options()).unwrap();
    assert_eq!(greedy(&mut ring, &prompt, 8, &oracle), expected);
    assert!(worker.is_running());
    let log = worker.log();
    let drops = log.matches("dropping connection").count();
    assert!(drops >= 8, "each bad peer gets one log line ({drops}):\n{log}");
}

#[test]
fn strangers_get_small_frames_few_connections_and_little_time() {
    let path = model(GEMMA3);
    let worker = WorkerProc::start(
        &models_dir(),
        Some(TOKEN),
        &["--max-connections", "4", "--handshake-timeout", "2"],
    );
    let addr = worker.addr.clone();

    // Before the handshake, a frame of 1 MiB is too large (the worker would not even
    // allocate it), though authenticated peers may send up to --max-frame.
    let mut big = baton_proto::header(1, 1 << 20).to_vec();
    big.extend_from_slice(&[0; 64]);
    poke(&addr, &big, false);

    // Four silent peers hold every connection; a fifth is closed at once; once the
    // handshake time has passed the silent ones are gone and a head is served again.
    std::thread::sleep(Duration::from_millis(300));
    let silent: Vec<TcpStream> = (0..4).map(|_| TcpStream::connect(&addr).unwrap()).collect();
    std::thread::sleep(Duration::from_millis(300));
    let started = std::time::Instant::now();
    let reply = poke(&addr, b"", false);
    assert!(
        reply.is_empty() && started.elapsed() < Duration::from_secs(1),
        "{:?} {reply:?}\n{}",
        started.elapsed(),
        worker.log()
    );
    for mut stream in silent {
        stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut rest = Vec::new();
        let _ = stream.read_to_end(&mut rest);
    }
    let ring = connect_cluster(&path, std::slice::from_ref(&addr), &options());
    assert!(ring.is_ok(), "{:?}", ring.err());
    let log = worker.log();
    assert!(log.contains("exceeds the maximum of 65536"), "{log}");
    assert!(log.contains("the most allowed (--max-connections)"), "{log}");
    assert!(
        log.matches("timed out waiting for").count() >= 4,
        "silent peers time out: {log}"
    );
}

#[test]
fn the_head_runs_the_first_stage_when_planned() {
    let path = model(QWEN2);
    let oracle = LlamaModel::load_full(&path, true).unwrap();
    let w0 = WorkerProc::start(&models_dir(), Some(TOKEN), &[]);
    let w1 = WorkerProc::start(&models_dir(), Some(TOKEN), &[]);
    let opts = ClusterOptions {
        head_stage: true,
        threads: 1,
        ..options()
    };
    // Left to the planner, the plan follows measured speeds, which other tests running
    // at the same time disturb; whatever it picks, the head (node 0) can only be first.
    let ring = connect_cluster(&path, &[w0.addr.clone(), w1.addr.clone()], &opts).unwrap();
    assert!(
        ring.plan.stages.iter().skip(1).all(|s| s.node != 0),
        "plan: {:?}",
        ring.plan
    );
    drop(ring);
    std::thread::sleep(Duration::from_millis(300));
    let opts = ClusterOptions {
        split: Some(vec![8, 8, 8]),
        ..opts
    };
    let mut ring = connect_cluster(&path, &[w0.addr.clone(), w1.addr.clone()], &opts).unwrap();
    let nodes: Vec<&str> = ring
        .plan
        .stages
        .iter()
        .map(|s| ring.node_names[s.node].as_str())
        .collect();
    assert_eq!(
        nodes,
        ["head", w0.addr.as_str(), w1.addr.as_str()],
        "plan: {:?}",
        ring.plan
    );
    assert_prompts_match(&mut ring, &oracle, "qwen2");
    drop(ring);
    std::thread::sleep(Duration::from_millis(300));
    // Forced onto the head alone, the ring never leaves the process.
    let opts = ClusterOptions {
        split: Some(vec![24, 0, 0]),
        ..opts
    };
    let mut ring = connect_cluster(&path, &[w0.addr.clone(), w1.addr.clone()], &opts).unwrap();
    assert_eq!(ring.plan.stages.len(), 1);
    assert_eq!(ring.plan.left_out.len(), 2);
    let prompt = oracle.tokenize(PROMPTS[0], true, true).unwrap();
    assert_eq!(greedy(&mut ring, &prompt, 16, &oracle), reference(&oracle, &prompt, 16));
}

/// Issue 15: a worker offers each of its devices (with its memory and speed), and the
/// plan gives each a layer range of its own; so does the head for its own stage. Two
/// CPU devices stand in for a GPU and its host here; the hidden state passes between
/// them in memory, and the text is llama.cpp's.
#[test]
fn each_device_of_a_worker_and_of_the_head_gets_its_own_range() {
    let path = model(QWEN2);
    let oracle = LlamaModel::load_full(&path, true).unwrap();
    let w0 = WorkerProc::start(&models_dir(), Some(TOKEN), &["--device", "CPU,CPU"]);
    let w1 = WorkerProc::start(&models_dir(), Some(TOKEN), &[]);
    let cpu = baton_ggml::Device::cpu();
    let opts = ClusterOptions {
        head_stage: true,
        threads: 1,
        head_devices: vec![cpu, cpu],
        split: Some(vec![8, 9, 7]),
        ..options()
    };
    let mut ring = connect_cluster(&path, &[w0.addr.clone(), w1.addr.clone()], &opts).unwrap();
    let offered: Vec<usize> = ring.workers.iter().map(|w| w.caps.devices.len()).collect();
    assert_eq!(offered, [2, 1]);
    assert!(
        ring.workers[0]
            .caps
            .devices
            .iter()
            .all(|d| d.secs_per_layer.is_some() && d.memory > 0),
        "{:?}",
        ring.workers[0].caps.devices
    );
    // Equal devices share their node's layers (of 9, the second takes 5: a worker
    // left to split them itself gives the first the extra one); the last stage keeps
    // its one device.
    #[allow(clippy::single_range_in_vec_init)] // the last stage's one range is the case
    let expected = [vec![0..4, 4..8], vec![8..12, 12..17], vec![17..24]];
    let parts: Vec<Vec<std::ops::Range<usize>>> = ring
        .plan
        .stages
        .iter()
        .map(|s| s.parts.iter().map(|p| p.layers.clone()).collect())
        .collect();
    assert_eq!(parts, expected, "{}", ring.plan.why);
    let log = w0.log();
    assert!(
        log.contains("devices=CPU 8..12, CPU 12..17"),
        "the worker loads what the plan says: {log}"
    );
    assert_prompts_match(&mut ring, &oracle, "qwen2");
}

#[test]
fn a_worker_holding_a_different_file_of_that_name_is_named_in_the_error() {
    let dir = tempdir("mismatch");
    // Another model under the qwen2 file's name.
    std::os::unix::fs::symlink(model(GEMMA3), dir.join(QWEN2)).unwrap();
    let worker = WorkerProc::start(&dir, Some(TOKEN), &[]);
    let err = connect_cluster(&model(QWEN2), std::slice::from_ref(&worker.addr), &options())
        .err()
        .expect("refused")
        .to_string();
    assert!(err.contains(&worker.addr) && err.contains("different"), "{err}");
    assert!(err.contains("header hash"), "{err}");
}
