//! What strangers, token holders in the middle and stale peers can do to real worker
//! processes (issue 16): each test is an attack that worked before its fix.

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::worker::WorkerProc;
use common::{model, GEMMA3};

const TOKEN: &str = "hardening-test-secret";

fn models_dir() -> PathBuf {
    model(GEMMA3).parent().unwrap().to_path_buf()
}

/// Connects to `addr` from the local address `from` (any 127.0.0.0/8 address on Linux
/// reaches a worker on 127.0.0.1: a second "host" on one machine).
fn connect_from(from: &str, addr: &str) -> TcpStream {
    let target: SocketAddr = addr.parse().unwrap();
    let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
    socket
        .bind(&format!("{from}:0").parse::<SocketAddr>().unwrap().into())
        .unwrap();
    socket.connect(&target.into()).unwrap();
    socket.into()
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
    assert!(held <= 16, "the worker still holds {held} of the flood's connections");
}
