//! What one ring hop costs on one host, TCP loopback against a Unix-domain socket:
//! round trips of the frames a ring carries per generated token (a `Forward` of one
//! qwen2 hidden state, 896 f32 = 3,584 bytes of values; the `Forward` of one token id
//! that goes into the first stage), echoed back by a thread at the other end, many
//! times, in interleaved batches so that other load on the machine hits every transport
//! alike. Prints a table of median and 99th percentile round trips, and one way (half).
//!
//! `cargo run --release -p baton-net --example hop_latency [ROUNDS] [--tls]`

use std::sync::Arc;
use std::time::{Duration, Instant};

use baton_net::{connect, LinkOptions, Listener, TlsConfig};
use baton_proto::{Forward, Message, Payload};

/// Batches per transport and frame; each batch runs on a fresh connection.
const BATCHES: usize = 20;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let rounds: usize = args.iter().find_map(|a| a.parse().ok()).unwrap_or(20_000);
    let tls = args.iter().any(|a| a == "--tls").then(|| {
        let made = rcgen::generate_simple_self_signed(vec!["baton-cluster".to_string()]).unwrap();
        let (cert, key) = (made.cert.pem(), made.signing_key.serialize_pem());
        let name = std::path::Path::new("generated");
        Arc::new(TlsConfig::from_pem(cert.as_bytes(), name, key.as_bytes(), name).unwrap())
    });
    let dir = std::env::temp_dir().join(format!("baton-hop-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let unix = format!("unix:{}", dir.join("hop.sock").display());

    let forward = |payload, rows: usize| {
        Message::Forward(Forward {
            step: 1,
            payload,
            positions: (0..rows as i32).collect(),
            seq_ids: vec![0; rows],
            sample_rows: vec![rows as u32 - 1],
            row_tokens: vec![],
        })
    };
    let frames = [
        ("token id", forward(Payload::Tokens(vec![9707]), 1)),
        ("hidden state, 896 f32", forward(Payload::Hidden(vec![0.5; 896]), 1)),
    ];
    let transports = [("TCP loopback", "127.0.0.1:0".to_string()), ("Unix socket", unix)];
    println!(
        "{} round trips per row{}, {} batches interleaved\n",
        rounds,
        if tls.is_some() { ", TLS on both" } else { "" },
        BATCHES
    );
    println!("| frame | frame bytes | transport | round trip median | round trip p99 | one hop (median / 2) |");
    println!("|---|---:|---|---:|---:|---:|");
    for (label, msg) in &frames {
        let mut bytes = Vec::new();
        baton_proto::encode(msg, &mut bytes);
        let mut times: Vec<Vec<Duration>> = vec![Vec::new(); transports.len()];
        for _ in 0..BATCHES {
            for (i, (_, addr)) in transports.iter().enumerate() {
                times[i].extend(round_trips(addr, tls.clone(), msg, rounds / BATCHES));
            }
        }
        for ((name, _), times) in transports.iter().zip(&mut times) {
            times.sort();
            let median = times[times.len() / 2];
            let p99 = times[times.len() * 99 / 100];
            println!(
                "| {label} | {} | {name} | {:.1} µs | {:.1} µs | {:.1} µs |",
                bytes.len(),
                micros(median),
                micros(p99),
                micros(median) / 2.0
            );
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

fn micros(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

/// Sends `msg` to an echo thread and waits for it to come back, `rounds` times (after a
/// few unmeasured ones).
fn round_trips(addr: &str, tls: Option<Arc<TlsConfig>>, msg: &Message, rounds: usize) -> Vec<Duration> {
    let opts = LinkOptions {
        tls,
        ..LinkOptions::default()
    };
    let listener = Listener::bind(addr).unwrap();
    let dial = listener.local_addr().to_string();
    let server_opts = opts.clone();
    let echo = std::thread::spawn(move || {
        let mut link = listener.accept_link(&server_opts).unwrap();
        while let Ok(msg) = link.recv() {
            if link.send(msg).is_err() {
                break;
            }
        }
    });
    let mut link = connect(&dial, &opts).unwrap();
    for _ in 0..50 {
        link.send(msg.clone()).unwrap();
        link.recv().unwrap();
    }
    let mut times = Vec::with_capacity(rounds);
    for _ in 0..rounds {
        let msg = msg.clone();
        let start = Instant::now();
        link.send(msg).unwrap();
        link.recv().unwrap();
        times.push(start.elapsed());
    }
    link.closer().unwrap().close();
    echo.join().unwrap();
    times
}
