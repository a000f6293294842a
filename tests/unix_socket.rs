//! Workers on Unix-domain sockets (`--listen unix:PATH`), as real processes: the ring
//! reproduces llama.cpp with every hop on a socket file, bad peers on the socket are
//! dropped as on TCP, and a socket file left by a dead worker does not keep a new one
//! from starting (while a live worker's socket is never taken over).

mod common;

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use baton_cluster::{connect_cluster, ClusterOptions};
use baton_ggml::LlamaModel;
use baton_proto::{Message, RefusalCode, Role, PROTOCOL_VERSION};
use common::worker::{assert_prompts_match, greedy, models_dir, reference, WorkerProc};
use common::{model, GEMMA3, PROMPTS, QWEN2};

const TOKEN: &str = "test-cluster-secret";

fn options() -> ClusterOptions {
    common::worker::options(TOKEN)
}

/// A fresh directory for socket files, removed on drop.
struct SocketDir(PathBuf);

impl SocketDir {
    fn new(tag: &str) -> SocketDir {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos();
        let dir = std::env::temp_dir().join(format!("baton-{tag}-{}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        SocketDir(dir)
    }

    fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }

    fn addr(&self, name: &str) -> String {
        format!("unix:{}", self.path(name).display())
    }
}

impl Drop for SocketDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn qwen2_on_two_workers_over_unix_sockets_matches_llama_cpp() {
    let path = model(QWEN2);
    let oracle = LlamaModel::load_full(&path, true).unwrap();
    let dir = SocketDir::new("unix-ring");
    let w0 = WorkerProc::start_at(&dir.addr("w0.sock"), &models_dir(), Some(TOKEN), &[]);
    let w1 = WorkerProc::start_at(&dir.addr("w1.sock"), &models_dir(), Some(TOKEN), &[]);
    assert_eq!(
        w0.addr,
        dir.addr("w0.sock"),
        "the worker prints the address it listens on"
    );
    let mut ring = connect_cluster(&path, &[w0.addr.clone(), w1.addr.clone()], &options()).unwrap();
    assert_eq!(ring.plan.stages.len(), 2);
    // Each worker advertises its socket for the ring: worker 0 reaches worker 1 on it
    // (neither has a TCP port at all).
    for (worker, proc) in ring.workers.iter().zip([&w0, &w1]) {
        assert_eq!(worker.caps.ring_addr, proc.addr);
    }
    assert_prompts_match(&mut ring, &oracle, "qwen2 over Unix sockets");
}

/// Sends raw bytes to the worker's socket, then reads until it closes (or 5 s pass).
fn poke(socket: &Path, bytes: &[u8], then_close: bool) -> Vec<u8> {
    let mut stream = UnixStream::connect(socket).unwrap();
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
fn bad_peers_on_a_unix_socket_are_dropped_and_the_worker_keeps_serving() {
    let path = model(GEMMA3);
    let oracle = LlamaModel::load_full(&path, true).unwrap();
    let dir = SocketDir::new("unix-bad-peers");
    let mut worker = WorkerProc::start_at(&dir.addr("w.sock"), &models_dir(), Some(TOKEN), &[]);
    let socket = dir.path("w.sock");

    // Garbage, HTTP, an oversized length field, an unknown kind, a truncated frame, a
    // peer that vanishes mid-frame.
    poke(&socket, b"\x00\x01garbage that is not a frame at all\xff\xfe", false);
    poke(&socket, b"GET / HTTP/1.1\r\nHost: worker\r\n\r\n", false);
    poke(&socket, &[0xff, 0xff, 0xff, 0xff, 1, 0, 0, 0], false);
    poke(&socket, &frame(999, b"whatever"), false);
    poke(&socket, &frame(1, &[1, 2, 3]), false);
    let mut partial = baton_proto::header(1, 1000).to_vec();
    partial.extend_from_slice(&[0; 10]);
    poke(&socket, &partial, true);
    // A Hello with a wrong protocol version gets this version's Hello, then a Refused
    // that says why.
    let mut hello = Vec::new();
    baton_proto::encode(
        &Message::Hello {
            version: 99,
            role: Role::Head,
            nonce: [7; 32],
        },
        &mut hello,
    );
    let reply = poke(&socket, &hello, false);
    let mut expected = Vec::new();
    let (kind, len) = baton_proto::parse_header(reply[..8].try_into().unwrap(), 1 << 16).unwrap();
    assert_eq!(
        baton_proto::decode(kind, &reply[8..8 + len]).unwrap().kind(),
        "Hello",
        "{reply:?}"
    );
    baton_proto::encode(
        &Message::Refused {
            code: RefusalCode::Version,
            reason: format!("protocol version 99 is not supported (this worker speaks {PROTOCOL_VERSION})"),
        },
        &mut expected,
    );
    assert_eq!(&reply[8 + len..], &expected[..]);

    // A real head works, and a second head is refused, typed as busy, while it is
    // connected.
    let prompt = oracle.tokenize(PROMPTS[0], true, true).unwrap();
    let expected = reference(&oracle, &prompt, 8);
    let addr = worker.addr.clone();
    let mut ring = connect_cluster(&path, std::slice::from_ref(&addr), &options()).unwrap();
    let second = connect_cluster(&path, std::slice::from_ref(&addr), &options())
        .err()
        .expect("second head refused");
    assert_eq!(second.refusal(), Some(RefusalCode::Busy), "{second}");
    assert!(second.to_string().contains("another head"), "{second}");
    assert_eq!(greedy(&mut ring, &prompt, 8, &oracle), expected);
    drop(ring);

    std::thread::sleep(Duration::from_millis(300));
    let mut ring = connect_cluster(&path, std::slice::from_ref(&addr), &options()).unwrap();
    assert_eq!(greedy(&mut ring, &prompt, 8, &oracle), expected);
    assert!(worker.is_running());
    let log = worker.log();
    let drops = log.matches("dropping connection").count();
    assert!(drops >= 8, "each bad peer gets one log line ({drops}):\n{log}");
}

#[test]
fn a_stale_socket_file_does_not_stop_a_new_worker_but_a_live_one_is_not_stolen() {
    let path = model(GEMMA3);
    let dir = SocketDir::new("unix-stale");
    let addr = dir.addr("w.sock");
    let first = WorkerProc::start_at(&addr, &models_dir(), Some(TOKEN), &[]);

    // A second worker on the same path while the first listens: it refuses to start,
    // and the first keeps its socket.
    let second = Command::new(env!("CARGO_BIN_EXE_baton"))
        .args(["worker", "--listen", &addr, "--models"])
        .arg(models_dir())
        .env("BATON_TOKEN", TOKEN)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&second.stderr);
    assert!(!second.status.success(), "{stderr}");
    assert!(
        stderr.contains(&format!("cannot listen on {addr}")) && stderr.contains("another process listens"),
        "{stderr}"
    );
    let ring = connect_cluster(&path, std::slice::from_ref(&first.addr), &options());
    assert!(ring.is_ok(), "the first worker still serves: {:?}", ring.err());
    drop(ring);

    // Killed (SIGKILL), it leaves its socket file behind; a new worker takes it over.
    drop(first);
    assert!(dir.path("w.sock").exists(), "a killed worker leaves its socket file");
    std::thread::sleep(Duration::from_millis(100));
    let third = WorkerProc::start_at(&addr, &models_dir(), Some(TOKEN), &[]);
    let ring = connect_cluster(&path, std::slice::from_ref(&third.addr), &options());
    assert!(ring.is_ok(), "the new worker serves: {:?}", ring.err());
}

/// What a temporary directory holds: `(name, mode, sockets inside)` per directory.
/// Workers exiting remove their files while this looks, so whatever vanishes
/// between listing and reading counts as gone.
fn socket_dirs(tmp: &Path) -> Vec<(String, u32, Vec<String>)> {
    use std::os::unix::fs::{FileTypeExt as _, PermissionsExt as _};
    let mut dirs = Vec::new();
    for entry in std::fs::read_dir(tmp).unwrap().map(Result::unwrap) {
        let (Ok(metadata), Ok(inside)) = (entry.metadata(), std::fs::read_dir(entry.path())) else {
            continue;
        };
        let mode = metadata.permissions().mode() & 0o777;
        let mut sockets: Vec<String> = inside
            .filter_map(Result::ok)
            .filter(|e| e.file_type().is_ok_and(|t| t.is_socket()))
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        sockets.sort();
        dirs.push((entry.file_name().to_string_lossy().into_owned(), mode, sockets));
    }
    dirs
}

#[test]
fn local_workers_listen_in_a_private_directory_that_goes_with_the_head() {
    let tmp = SocketDir::new("local-workers-tmp");
    // A command that ends normally removes the directory.
    let out = Command::new(env!("CARGO_BIN_EXE_baton"))
        .args(["run", "--model"])
        .arg(model(GEMMA3))
        .args([
            "--local-workers",
            "2",
            "--no-head-stage",
            "--threads",
            "1",
            "--ctx-size",
            "256",
        ])
        .args(["--prompt", PROMPTS[0], "-n", "4"])
        .env("TMPDIR", &tmp.0)
        .env_remove("BATON_TOKEN")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(socket_dirs(&tmp.0), []);

    // While a server runs, its workers' sockets are in a directory only this user can
    // enter; killed, it cannot clean up, and its workers (which exit with it) do.
    let mut server = Command::new(env!("CARGO_BIN_EXE_baton"))
        .args([
            "serve",
            "--local-workers",
            "2",
            "--port",
            "0",
            "--threads",
            "1",
            "--ctx-size",
            "256",
        ])
        .arg("--model")
        .arg(model(GEMMA3))
        .env("TMPDIR", &tmp.0)
        .env_remove("BATON_TOKEN")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    common::printed_addr(&mut server, "listening on http://");
    let dirs = socket_dirs(&tmp.0);
    assert_eq!(dirs.len(), 1, "{dirs:?}");
    let (_, mode, sockets) = &dirs[0];
    assert_eq!(*mode, 0o700, "directory mode {mode:o}");
    assert_eq!(sockets, &["w0.sock", "w1.sock"]);
    server.kill().unwrap();
    server.wait().unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !socket_dirs(&tmp.0).is_empty() && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(socket_dirs(&tmp.0), []);
}
