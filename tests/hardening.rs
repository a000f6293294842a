//! What strangers, token holders in the middle and stale peers can do to real worker
//! processes (issue 16): each test is an attack that worked before its fix.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use baton_cluster::{connect_cluster, ClusterOptions};
use baton_net::{client_handshake, connect, Link, LinkOptions};
use baton_proto::{Message, RefusalCode, Role};
use common::worker::WorkerProc;
use common::{connect_from, model, GEMMA3};

const TOKEN: &str = "hardening-test-secret";

fn models_dir() -> PathBuf {
    model(GEMMA3).parent().unwrap().to_path_buf()
}

fn tempdir(tag: &str) -> PathBuf {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let dir = std::env::temp_dir().join(format!("baton-{tag}-{}-{nanos}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// `n` connections from `from` that each send one byte every `every` until dropped:
/// the slow-drip flood of issue 16.
struct Flood {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<usize>>,
}

impl Flood {
    fn start(from: &str, addr: &str, n: usize, every: Duration) -> Flood {
        let mut streams: Vec<TcpStream> = (0..n).map(|_| connect_from(from, addr)).collect();
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut next = Instant::now();
            while !stopped.load(Ordering::SeqCst) {
                if Instant::now() >= next {
                    // A byte of a frame header that never completes.
                    streams.retain_mut(|s| s.write_all(&[0]).is_ok());
                    next += every;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            // Still open: a read finds nothing yet (closed ones read EOF or a reset).
            streams
                .iter_mut()
                .map(|s| {
                    s.set_nonblocking(true).unwrap();
                    matches!(s.read(&mut [0; 64]), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock)
                })
                .filter(|&open| open)
                .count()
        });
        Flood {
            stop,
            thread: Some(thread),
        }
    }

    /// Stops; returns how many connections the worker still held open.
    fn stop(mut self) -> usize {
        self.stop.store(true, Ordering::SeqCst);
        self.thread.take().unwrap().join().unwrap()
    }
}

impl Drop for Flood {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

/// `baton run` as its own process against `workers`, with the token from the environment.
fn baton_run(workers: &str, token: &str) -> Output {
    Command::new(env!("CARGO_BIN_EXE_baton"))
        .args(["run", "--model"])
        .arg(model(GEMMA3))
        .args([
            "--workers",
            workers,
            "--no-head-stage",
            "-n",
            "4",
            "-c",
            "256",
            "-t",
            "1",
        ])
        .env("BATON_TOKEN", token)
        .stdin(Stdio::null())
        .output()
        .unwrap()
}

/// Issue 16: 70 connections that each send a byte every 5 s locked every head out of a
/// worker with a token ("Connection reset by peer" at once, for as long as they stayed).
#[test]
fn a_slow_drip_flood_does_not_lock_heads_out() {
    let worker = WorkerProc::start(&models_dir(), Some(TOKEN), &[]);
    let flood = Flood::start("127.0.0.1", &worker.addr, 70, Duration::from_secs(5));
    std::thread::sleep(Duration::from_millis(500));
    let out = baton_run(&worker.addr, TOKEN);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "baton run failed during the flood: {stderr}\n{}",
        worker.log()
    );
    assert!(!String::from_utf8_lossy(&out.stdout).trim().is_empty(), "{stderr}");
    let held = flood.stop();
    assert!(held <= 8, "the worker still holds {held} of the flood's connections");
    let log = worker.log();
    assert!(log.contains("closed the oldest handshake from 127.0.0.1"), "{log}");
}

fn options() -> ClusterOptions {
    ClusterOptions {
        token: Some(TOKEN.into()),
        n_ctx: 256,
        repack: true,
        // Nothing a broken peer does may leave a test waiting for ever.
        handshake_timeout: Some(Duration::from_secs(10)),
        ..Default::default()
    }
}

/// A Hello as a head sends it.
fn hello_bytes() -> Vec<u8> {
    let mut hello = Vec::new();
    baton_proto::encode(
        &Message::Hello {
            version: baton_proto::PROTOCOL_VERSION,
            role: Role::Head,
            nonce: [7; 32],
        },
        &mut hello,
    );
    hello
}

/// Sends `bytes` one at a time, `every` apart, until the worker closes the connection;
/// returns how long the worker kept it open.
fn drip_until_closed(addr: &str, bytes: &[u8], every: Duration, give_up: Duration) -> Duration {
    let mut stream = TcpStream::connect(addr).unwrap();
    stream.set_read_timeout(Some(every)).unwrap();
    let started = Instant::now();
    for byte in bytes.iter().cycle() {
        if started.elapsed() > give_up || stream.write_all(&[*byte]).is_err() {
            break;
        }
        match stream.read(&mut [0; 256]) {
            Ok(0) => break,
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {}
            Err(_) => break,
            // A Refused or a TLS alert: the worker is closing.
            Ok(_) => {}
        }
    }
    started.elapsed()
}

/// Issue 16: the handshake timeout bounded each read, not the handshake, so a peer
/// sending a byte a little more often than that held its connection for ever.
#[test]
fn a_handshake_dripped_a_byte_at_a_time_ends_at_the_deadline() {
    let worker = WorkerProc::start(&models_dir(), Some(TOKEN), &["--handshake-timeout", "2"]);
    let held = drip_until_closed(
        &worker.addr,
        &hello_bytes(),
        Duration::from_millis(300),
        Duration::from_secs(8),
    );
    assert!(
        held >= Duration::from_millis(1500) && held < Duration::from_secs(4),
        "held {held:?}\n{}",
        worker.log()
    );
}

/// The same inside TLS: rustls reads until its handshake is done, so a deadline checked
/// between its reads never fired while bytes kept coming.
#[test]
fn a_tls_handshake_dripped_a_byte_at_a_time_ends_at_the_deadline() {
    let dir = tempdir("drip-tls");
    let out = Command::new(env!("CARGO_BIN_EXE_baton"))
        .args(["cert", "--out"])
        .arg(&dir)
        .output()
        .unwrap();
    assert!(out.status.success());
    let (cert, key) = (dir.join("cluster.crt"), dir.join("cluster.key"));
    let worker = WorkerProc::start(
        &models_dir(),
        Some(TOKEN),
        &[
            "--handshake-timeout",
            "2",
            "--tls-cert",
            cert.to_str().unwrap(),
            "--tls-key",
            key.to_str().unwrap(),
        ],
    );
    // A TLS handshake record announcing 512 bytes, then filler, a byte every 300 ms.
    let mut record = vec![0x16, 0x03, 0x01, 0x02, 0x00, 0x01, 0x00, 0x01, 0xfc, 0x03, 0x03];
    record.extend(std::iter::repeat_n(0x42, 64));
    let held = drip_until_closed(
        &worker.addr,
        &record,
        Duration::from_millis(300),
        Duration::from_secs(8),
    );
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(
        held >= Duration::from_millis(1500) && held < Duration::from_secs(4),
        "held {held:?}\n{}",
        worker.log()
    );
}

/// Issue 16: a head over the limit was dropped at once ("Connection reset by peer",
/// nothing said why). Now only authenticated connections count, and the one too many
/// is told why with a typed refusal.
#[test]
fn a_head_over_the_connection_limit_is_told_why() {
    let worker = WorkerProc::start(&models_dir(), Some(TOKEN), &["--max-connections", "4"]);
    // Four authenticated connections (bare heartbeats) take every slot.
    let held: Vec<Box<dyn Link>> = (0..4)
        .map(|_| {
            let mut link = connect(&worker.addr, &LinkOptions::default()).unwrap();
            client_handshake(link.as_mut(), Role::Heartbeat, Some(TOKEN.as_bytes())).unwrap();
            link
        })
        .collect();
    // Silent strangers do not count against the limit.
    let _strangers: Vec<TcpStream> = (0..3).map(|_| connect_from("127.0.0.2", &worker.addr)).collect();
    let err = connect_cluster(&model(GEMMA3), std::slice::from_ref(&worker.addr), &options())
        .err()
        .expect("a fifth authenticated connection is refused");
    assert_eq!(err.refusal(), Some(RefusalCode::Busy), "{err}");
    let text = err.to_string();
    assert!(
        text.contains("too many connections") && text.contains("--max-connections"),
        "{text}"
    );
    // One leaves: the next head is served.
    drop(held);
    std::thread::sleep(Duration::from_millis(300));
    let ring = connect_cluster(&model(GEMMA3), std::slice::from_ref(&worker.addr), &options());
    assert!(ring.is_ok(), "{:?}\n{}", ring.err(), worker.log());
}

/// Strangers on another address keep at most their share of handshake slots, and a
/// head on its own address is served at once. (A head sharing their address takes the
/// slot of their oldest by sending its Hello: the flood test above.)
#[test]
fn strangers_from_one_address_get_their_share_of_handshakes_and_no_more() {
    let worker = WorkerProc::start(&models_dir(), Some(TOKEN), &["--max-handshakes-per-source", "3"]);
    let strangers: Vec<TcpStream> = (0..12).map(|_| connect_from("127.0.0.2", &worker.addr)).collect();
    std::thread::sleep(Duration::from_millis(900));
    let open = strangers
        .iter()
        .filter(|s| {
            s.set_nonblocking(true).unwrap();
            matches!((&**s).read(&mut [0; 8]), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock)
        })
        .count();
    assert_eq!(open, 3, "{}", worker.log());
    let started = Instant::now();
    let ring = connect_cluster(&model(GEMMA3), std::slice::from_ref(&worker.addr), &options());
    assert!(ring.is_ok(), "{:?}", ring.err());
    assert!(started.elapsed() < Duration::from_secs(5));
}

/// Issue 16: on plain TCP, anyone a node dialed could pass the handshake through and
/// then speak for the head. A real relay process forwards a real handshake and injects
/// a `Shutdown` of its own; the worker used to obey it ("the head's plan leaves this
/// worker out"). Frames after the handshake now carry tags, and the injected one fails.
#[test]
fn a_relay_cannot_inject_frames_after_the_handshake() {
    let worker = WorkerProc::start(&models_dir(), Some(TOKEN), &[]);
    let mut shutdown = Vec::new();
    baton_proto::encode(&Message::Shutdown, &mut shutdown);
    let hex: String = shutdown.iter().map(|b| format!("{b:02x}")).collect();
    // The worker's Hello (8 + 37 bytes) and Auth (8 + 32) make its handshake.
    let mut relay = Command::new("python3")
        .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/relay.py"))
        .args([&worker.addr, "--after-server-bytes", "85", "--inject-hex", &hex])
        .stdout(Stdio::piped())
        .spawn()
        .expect("python3 runs the relay");
    let relay_addr = common::printed_addr(&mut relay, "listening on ");
    let err = connect_cluster(&model(GEMMA3), std::slice::from_ref(&relay_addr), &options())
        .err()
        .expect("the head's connection through the relay fails");
    let _ = relay.kill();
    let _ = relay.wait();
    std::thread::sleep(Duration::from_millis(200));
    let log = worker.log();
    assert!(
        !log.contains("plan leaves this worker out"),
        "the worker obeyed the relay:\n{log}"
    );
    assert!(log.contains("failed authentication"), "{err}\n{log}");
}

/// Issue 16: a heartbeat connection ended whatever session was running when it
/// connected, so a bare probe (the supervisor's, after a failed formation) that hung up
/// ended another head's session. A heartbeat now ends only the session its pings name.
#[test]
fn a_heartbeat_ends_only_its_own_session() {
    use baton_ggml::LlamaModel;
    use common::worker::{greedy, reference};

    let path = model(GEMMA3);
    let oracle = LlamaModel::load_full(&path, true).unwrap();
    let prompt = oracle.tokenize(common::PROMPTS[0], true, true).unwrap();
    let expected = reference(&oracle, &prompt, 8);
    let worker = WorkerProc::start(&models_dir(), Some(TOKEN), &[]);
    let mut ring = connect_cluster(&path, std::slice::from_ref(&worker.addr), &options()).unwrap();
    // A probe: a heartbeat handshake that hangs up; then one that pings a session
    // that is not running, and stops.
    let mut probe = connect(&worker.addr, &LinkOptions::default()).unwrap();
    client_handshake(probe.as_mut(), Role::Heartbeat, Some(TOKEN.as_bytes())).unwrap();
    drop(probe);
    let mut stray = connect(&worker.addr, &LinkOptions::default()).unwrap();
    client_handshake(stray.as_mut(), Role::Heartbeat, Some(TOKEN.as_bytes())).unwrap();
    stray
        .send(Message::Ping {
            timeout_ms: 100,
            session: 12345,
        })
        .unwrap();
    assert_eq!(stray.recv().unwrap(), Message::Pong);
    std::thread::sleep(Duration::from_millis(400));
    drop(stray);
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(greedy(&mut ring, &prompt, 8, &oracle), expected, "{}", worker.log());
    assert!(!worker.log().contains("ending the head's session"), "{}", worker.log());
}

/// Issue 19: a link that announces itself as a member of a tensor-parallel group is
/// refused unless its first frame is a `JoinGroup`, and a second link from the same
/// member of the same group is refused; neither disturbs the ring the worker serves.
#[test]
fn member_links_are_refused_unless_they_join_a_group_once() {
    use baton_ggml::LlamaModel;
    use common::worker::{greedy, reference};

    let path = model(GEMMA3);
    let oracle = LlamaModel::load_full(&path, true).unwrap();
    let prompt = oracle.tokenize(common::PROMPTS[0], true, true).unwrap();
    let expected = reference(&oracle, &prompt, 8);
    let worker = WorkerProc::start(&models_dir(), Some(TOKEN), &[]);
    let mut ring = connect_cluster(&path, std::slice::from_ref(&worker.addr), &options()).unwrap();
    let member = || {
        let mut link = connect(&worker.addr, &LinkOptions::default()).unwrap();
        client_handshake(link.as_mut(), Role::Member, Some(TOKEN.as_bytes())).unwrap();
        link.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        link
    };
    let refusal = |link: &mut Box<dyn Link>| match link.recv() {
        Ok(Message::Refused {
            code: RefusalCode::BadRequest,
            reason,
        }) => reason,
        other => panic!("expected a refusal, got {other:?}"),
    };
    let mut stranger = member();
    stranger.send(Message::Pong).unwrap();
    assert_eq!(refusal(&mut stranger), "Pong where a member's JoinGroup was due");

    let mut first = member();
    first.send(Message::JoinGroup { group: 7, rank: 1 }).unwrap();
    std::thread::sleep(Duration::from_millis(200));
    let mut again = member();
    again.send(Message::JoinGroup { group: 7, rank: 1 }).unwrap();
    assert_eq!(refusal(&mut again), "member 1 of this group is linked already");

    assert_eq!(greedy(&mut ring, &prompt, 8, &oracle), expected, "{}", worker.log());
    drop(first);
}

/// What `baton worker` says on stderr when it refuses to start with `args` and the
/// token from `env` (if any) only; a worker that starts anyway fails the test.
fn worker_refusal(args: &[&str], env: Option<&str>) -> String {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_baton"));
    cmd.args(["worker", "--listen", "127.0.0.1:0", "--models"])
        .arg(models_dir())
        .args(args)
        .env_remove("BATON_TOKEN")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    if let Some(token) = env {
        cmd.env("BATON_TOKEN", token);
    }
    let mut child = cmd.spawn().unwrap();
    let started = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if started.elapsed() > Duration::from_secs(10) {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the worker started with {args:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = child.wait_with_output().unwrap();
    assert!(!out.status.success(), "the worker started with {args:?}");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Issue 16: `--token ""` or `--token x` made a worker anyone could guess into.
#[test]
fn empty_or_short_tokens_are_refused_and_tokens_come_from_files_or_the_environment() {
    let err = worker_refusal(&["--token", ""], None);
    assert!(err.contains("the cluster token is empty"), "{err}");
    let err = worker_refusal(&[], Some("short"));
    assert!(err.contains("5 bytes long, shorter than the 12 allowed"), "{err}");
    let dir = tempdir("token");
    let file = dir.join("cluster.token");
    std::fs::write(&file, "tiny\n").unwrap();
    let err = worker_refusal(&["--token-file", file.to_str().unwrap()], None);
    assert!(err.contains("the token in") && err.contains("4 bytes long"), "{err}");

    // A token from a file (whitespace around it ignored) is the worker's token: a head
    // with that token is served, one with BATON_TOKEN's other token is not.
    std::fs::write(&file, format!("  {TOKEN}\n")).unwrap();
    let worker = WorkerProc::start(&models_dir(), None, &["--token-file", file.to_str().unwrap()]);
    let ring = connect_cluster(&model(GEMMA3), std::slice::from_ref(&worker.addr), &options());
    assert!(ring.is_ok(), "{:?}", ring.err());
    drop(ring);
    std::thread::sleep(Duration::from_millis(300));
    let out = baton_run(&worker.addr, "another-long-cluster-secret");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("wrong token"));
    let out = baton_run(&worker.addr, TOKEN);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Issue 16: a worker loaded a streamed stage whatever the head had sent: a tensor the
/// head left out was a hole in the sparse copy, and read as zeros. A head (here, a
/// hand-driven one) that leaves one out now gets the load refused, saying which.
#[test]
fn a_streamed_stage_with_a_tensor_left_out_is_refused_not_loaded_as_zeros() {
    use baton_model::{ModelFile, StageSpan};
    use baton_proto::{LoadPlan, TensorEntry};

    let path = model(GEMMA3);
    let file = ModelFile::open(&path).unwrap();
    let model_ref = baton_cluster::model_ref(&file);
    let span = StageSpan {
        layers: 5..6,
        first: false,
        last: false,
    };
    let bytes = file.bytes();
    let mut names = baton_model::stage_tensor_sources(&file, &span);
    let left_out = names.pop().unwrap();
    let entries: Vec<TensorEntry> = names
        .iter()
        .map(|name| {
            let t = file.gguf().tensor(name).unwrap();
            TensorEntry {
                name: name.clone(),
                offset: t.offset,
                len: t.n_bytes,
                sha256: baton_proto::auth::identity_hash(&bytes[t.offset as usize..(t.offset + t.n_bytes) as usize]),
            }
        })
        .collect();

    let empty = tempdir("hole");
    let worker = WorkerProc::start(&empty, Some(TOKEN), &[]);
    let mut link = connect(&worker.addr, &LinkOptions::default()).unwrap();
    client_handshake(link.as_mut(), Role::Head, Some(TOKEN.as_bytes())).unwrap();
    link.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    link.send(Message::Describe {
        model: model_ref.clone(),
    })
    .unwrap();
    assert!(matches!(link.recv().unwrap(), Message::Capabilities(_)));
    link.send(Message::LoadPlan(Box::new(LoadPlan {
        model: model_ref,
        layer_start: 5,
        layer_end: 6,
        first: false,
        last: false,
        n_ctx: 256,
        n_seq: 0,
        next: None,
        next_session: 0,
        stream: true,
        wire_f16: false,
        repack: false,
        devices: vec![],
        tp: None,
        cache_type_k: "f16".into(),
        cache_type_v: "f16".into(),
    })))
    .unwrap();
    link.send(Message::StreamStart {
        header: bytes[..file.gguf().data_offset as usize].to_vec(),
        tensors: entries.clone(),
    })
    .unwrap();
    let Message::StreamStart { tensors: wanted, .. } = link.recv().unwrap() else {
        panic!("the worker asks for the tensors it lacks")
    };
    assert_eq!(wanted.len(), entries.len());
    for (index, entry) in entries.iter().enumerate() {
        let data = &bytes[entry.offset as usize..(entry.offset + entry.len) as usize];
        for (i, chunk) in data.chunks(8 << 20).enumerate() {
            link.send(Message::TensorChunk {
                index: index as u32,
                offset: (i * (8 << 20)) as u64,
                data: chunk.to_vec(),
            })
            .unwrap();
        }
    }
    let answer = link.recv();
    let _ = std::fs::remove_dir_all(&empty);
    match answer {
        Ok(Message::Refused {
            code: RefusalCode::LoadFailed,
            reason,
        }) => assert!(
            reason.contains("did not send") && reason.contains(&left_out),
            "{reason}"
        ),
        other => panic!("the stage loaded with {left_out} missing: {other:?}\n{}", worker.log()),
    }
}

/// Issue 16: the head chooses `n_ctx`, and a worker allocated (and zeroed) whatever KV
/// cache that asked for. A plan whose cache exceeds the memory the worker offers is
/// refused, saying so, and the worker goes on serving.
#[test]
fn a_plan_whose_kv_cache_exceeds_the_workers_memory_is_refused() {
    use baton_model::ModelFile;
    use baton_proto::LoadPlan;

    let file = ModelFile::open(&model(GEMMA3)).unwrap();
    let model_ref = baton_cluster::model_ref(&file);
    let worker = WorkerProc::start(&models_dir(), Some(TOKEN), &["--memory", "1000000000"]);
    let ask = |n_ctx: u32| {
        let mut link = connect(&worker.addr, &LinkOptions::default()).unwrap();
        client_handshake(link.as_mut(), Role::Head, Some(TOKEN.as_bytes())).unwrap();
        link.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        link.send(Message::Describe {
            model: model_ref.clone(),
        })
        .unwrap();
        assert!(matches!(link.recv().unwrap(), Message::Capabilities(_)));
        link.send(Message::LoadPlan(Box::new(LoadPlan {
            model: model_ref.clone(),
            layer_start: 0,
            layer_end: 2,
            first: true,
            last: false,
            n_ctx,
            n_seq: 0,
            next: None,
            next_session: 0,
            stream: false,
            wire_f16: false,
            repack: false,
            devices: vec![],
            tp: None,
            cache_type_k: "f16".into(),
            cache_type_v: "f16".into(),
        })))
        .unwrap();
        link.recv()
    };
    match ask(u32::MAX) {
        Ok(Message::Refused {
            code: RefusalCode::LoadFailed,
            reason,
        }) => assert!(
            reason.contains("4294967295 tokens") && reason.contains("KV cache") && reason.contains("--memory"),
            "{reason}"
        ),
        other => panic!("a 4-billion-token cache was not refused: {other:?}\n{}", worker.log()),
    }
    // The worker is still there, and loads a sane plan.
    let answer = ask(256);
    assert!(
        !matches!(answer, Ok(Message::Refused { .. }) | Err(_)),
        "{answer:?}\n{}",
        worker.log()
    );
}

/// Each ring or member link a worker accepted kept a duplicated socket among its
/// session's closers until the session ended, after the link was replaced or refused
/// too, outside `--max-connections`: about 1,000 of them exhausted RLIMIT_NOFILE and
/// the worker could accept nothing more. Links that come and go now leave nothing open.
#[test]
fn ring_and_member_links_that_come_and_go_leave_no_descriptors_behind() {
    use baton_ggml::LlamaModel;
    use common::worker::{greedy, reference};

    let path = model(GEMMA3);
    let oracle = LlamaModel::load_full(&path, true).unwrap();
    let prompt = oracle.tokenize(common::PROMPTS[0], true, true).unwrap();
    let expected = reference(&oracle, &prompt, 8);
    let worker = WorkerProc::start(&models_dir(), Some(TOKEN), &[]);
    let mut ring = connect_cluster(&path, std::slice::from_ref(&worker.addr), &options()).unwrap();
    let authenticated = |role| {
        let mut link = connect(&worker.addr, &LinkOptions::default()).unwrap();
        client_handshake(link.as_mut(), role, Some(TOKEN.as_bytes())).unwrap();
        link.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        link
    };
    let mut parked = authenticated(Role::Member);
    parked.send(Message::JoinGroup { group: 9, rank: 1 }).unwrap();
    std::thread::sleep(Duration::from_millis(200));
    let before = worker.open_fds();
    for _ in 0..150 {
        drop(authenticated(Role::Ring));
        let mut again = authenticated(Role::Member);
        again.send(Message::JoinGroup { group: 9, rank: 1 }).unwrap();
        assert!(matches!(again.recv(), Ok(Message::Refused { .. })));
    }
    std::thread::sleep(Duration::from_millis(500));
    let after = worker.open_fds();
    assert!(
        after <= before + 4,
        "{before} descriptors open before 300 links came and went, {after} after"
    );
    assert_eq!(greedy(&mut ring, &prompt, 8, &oracle), expected, "{}", worker.log());
    drop(parked);
}

/// A heartbeat asking for a timeout of 49 days (`u32::MAX` ms) held an authenticated
/// slot for that long. A worker now refuses one longer than the protocol allows.
#[test]
fn a_heartbeat_timeout_longer_than_the_protocol_allows_is_refused() {
    let worker = WorkerProc::start(&models_dir(), Some(TOKEN), &[]);
    let mut link = connect(&worker.addr, &LinkOptions::default()).unwrap();
    client_handshake(link.as_mut(), Role::Heartbeat, Some(TOKEN.as_bytes())).unwrap();
    link.send(Message::Ping {
        timeout_ms: u32::MAX,
        session: 0,
    })
    .unwrap();
    match link.recv() {
        Ok(Message::Refused {
            code: RefusalCode::BadRequest,
            reason,
        }) => assert_eq!(
            reason,
            format!(
                "a heartbeat timeout of {} ms is longer than the {} ms a worker allows",
                u32::MAX,
                baton_proto::MAX_HEARTBEAT_MS
            )
        ),
        other => panic!("expected a refusal, got {other:?}"),
    }
}

/// `baton tp-member` ended when anything connected and closed ("link ... is closed"),
/// and a stranger's first frame could be 64 MiB. Now a member takes its links through
/// the worker's door: strangers, garbage and a member 0 that introduces itself wrongly
/// are refused and logged, the member keeps waiting, and the real member 0 then forms
/// the group and runs it (its greedy text is libllama's).
#[test]
fn a_tp_member_survives_strangers_while_its_group_forms() {
    use baton_model::{ModelFile, Stage, StageConfig, StageSpan};
    use baton_stage::tp_net::{dial_members, MeshCollective, RemoteMember};

    let path = model(GEMMA3);
    let addr = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap().to_string()
    };
    let mut member = Command::new(env!("CARGO_BIN_EXE_baton"))
        .args([
            "tp-member",
            "--threads",
            "1",
            "--ctx-size",
            "256",
            "--rank",
            "1",
            "--members",
            &addr,
        ])
        .arg("--model")
        .arg(&path)
        .env("BATON_TOKEN", TOKEN)
        .env("BATON_LOG", "info")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("tp-member starts");
    let log = Arc::new(std::sync::Mutex::new(String::new()));
    {
        let (stderr, sink) = (member.stderr.take().unwrap(), log.clone());
        std::thread::spawn(move || {
            use std::io::BufRead;
            for line in std::io::BufReader::new(stderr).lines().map_while(Result::ok) {
                sink.lock().unwrap().push_str(&(line + "\n"));
            }
        });
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    let stranger = loop {
        match TcpStream::connect(&addr) {
            Ok(stream) => break stream,
            Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(50)),
            Err(e) => panic!("the member never listened: {e}"),
        }
    };
    // The confirmed attack: connect and close.
    drop(stranger);
    // A frame header announcing 64 MiB before any handshake.
    let mut big = TcpStream::connect(&addr).unwrap();
    let _ = big.write_all(&(64u32 << 20).to_le_bytes());
    // The wrong token.
    let mut wrong = connect(&addr, &LinkOptions::default()).unwrap();
    assert!(client_handshake(wrong.as_mut(), Role::Ring, Some(b"not-the-cluster-token")).is_err());
    // The right token, then something else than a member's introduction.
    let mut rude = connect(&addr, &LinkOptions::default()).unwrap();
    client_handshake(rude.as_mut(), Role::Ring, Some(TOKEN.as_bytes())).unwrap();
    rude.send(Message::Pong).unwrap();
    assert!(matches!(
        rude.recv(),
        Ok(Message::Refused {
            code: RefusalCode::BadRequest,
            ..
        })
    ));
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        member.try_wait().unwrap().is_none(),
        "the member died: {}",
        log.lock().unwrap()
    );

    let file = ModelFile::open(&path).unwrap();
    let peers = dial_members(std::slice::from_ref(&addr), Some(TOKEN.as_bytes()), &Default::default()).unwrap();
    let split = baton_model::tp_splits(&file, 2).unwrap().remove(0);
    let collective = Arc::new(MeshCollective::new(0, peers.clone()));
    let members: Vec<Box<dyn baton_model::GroupMember>> = peers
        .into_iter()
        .map(|p| Box::new(RemoteMember::new(p)) as Box<dyn baton_model::GroupMember>)
        .collect();
    let n_layer = file.hparams().n_layer;
    let span = StageSpan {
        layers: 0..n_layer,
        first: true,
        last: true,
    };
    let member0 = Stage::load_member(file, span, &StageConfig::new(256, 1), Some((split, collective))).unwrap();
    let mut stage = baton_model::StageGroup::new(member0, members);
    // A connection once the group has formed is refused; the group goes on.
    let mut late = connect(&addr, &LinkOptions::default()).unwrap();
    client_handshake(late.as_mut(), Role::Ring, Some(TOKEN.as_bytes())).unwrap();
    late.send(Message::Partial {
        sum: 0,
        values: vec![0.0],
    })
    .unwrap();
    assert!(matches!(
        late.recv(),
        Ok(Message::Refused {
            code: RefusalCode::Busy,
            ..
        })
    ));
    let oracle = baton_ggml::LlamaModel::load_full(&path, true).unwrap();
    let prompt = oracle.tokenize(common::PROMPTS[0], true, true).unwrap();
    let expected = common::worker::reference(&oracle, &prompt, 8);
    let mut got = Vec::new();
    let mut input = prompt.clone();
    let mut start = 0;
    while got.len() < expected.len() {
        let positions: Vec<i32> = (start..start + input.len()).map(|p| p as i32).collect();
        let seq_ids = vec![0; input.len()];
        let batch = baton_model::Batch {
            input: baton_model::StageInput::Tokens(&input),
            positions: &positions,
            seq_ids: &seq_ids,
            logit_rows: &[input.len() as u32 - 1],
            decode: false,
        };
        let baton_model::StageOutput::Logits(logits) = stage.forward(&batch, baton_model::LogitReply::Logits).unwrap()
        else {
            panic!("a last stage returns logits")
        };
        start += input.len();
        let token = baton_sample::argmax(&logits).unwrap();
        got.push(token);
        input = vec![token];
    }
    assert_eq!(got, expected, "{}", log.lock().unwrap());
    drop(stage);
    let status = member.wait().unwrap();
    assert!(
        status.success(),
        "the member ended with {status}: {}",
        log.lock().unwrap()
    );
    drop(big);
}
