//! What TLS costs a link: round trips of one frame over loopback, plain and TLS
//! interleaved, at the sizes a ring carries (a token id, a qwen2 hidden state, a
//! 32-token prompt chunk of hidden states, a streamed 8 MiB tensor chunk).
//!
//! `cargo run --release -p baton-net --example tls_overhead`

use std::sync::Arc;
use std::time::{Duration, Instant};

use baton_net::{connect, LinkOptions, Listener, TlsConfig};
use baton_proto::Message;

fn main() {
    let made = rcgen::generate_simple_self_signed(vec!["baton-cluster".to_string()]).unwrap();
    let (cert, key) = (made.cert.pem(), made.signing_key.serialize_pem());
    let name = std::path::Path::new("generated");
    let tls = Arc::new(TlsConfig::from_pem(cert.as_bytes(), name, key.as_bytes(), name).unwrap());

    println!("| frame payload | plain round trip (median) | TLS round trip (median) | TLS extra per hop |");
    println!("|---|---|---|---|");
    for (label, bytes, rounds) in [
        ("token id (64 B)", 64, 4000),
        ("qwen2 hidden state (3,584 B)", 3584, 4000),
        ("32 hidden states (114,688 B)", 32 * 3584, 1000),
        ("tensor chunk (8 MiB)", 8 << 20, 20),
    ] {
        let mut plain = Vec::new();
        let mut secure = Vec::new();
        // Alternate short batches so that other load on the machine hits both alike.
        for _ in 0..10 {
            plain.extend(round_trips(None, bytes, rounds / 10));
            secure.extend(round_trips(Some(tls.clone()), bytes, rounds / 10));
        }
        let (p, s) = (median(&mut plain), median(&mut secure));
        let extra = s.saturating_sub(p) / 2;
        println!("| {label} | {p:.1?} | {s:.1?} | {extra:.1?} |");
    }
}

/// Sends a frame of `bytes` and waits for it to come back, `rounds` times.
fn round_trips(tls: Option<Arc<TlsConfig>>, bytes: usize, rounds: usize) -> Vec<Duration> {
    let opts = LinkOptions {
        tls,
        ..LinkOptions::default()
    };
    let listener = Listener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().to_string();
    let server_opts = opts.clone();
    let echo = std::thread::spawn(move || {
        let mut link = listener.accept_link(&server_opts).unwrap();
        while let Ok(msg) = link.recv() {
            if link.send(msg).is_err() {
                break;
            }
        }
    });
    let mut link = connect(&addr, &opts).unwrap();
    let msg = Message::TensorChunk {
        index: 0,
        offset: 0,
        data: vec![7; bytes],
    };
    let mut times = Vec::with_capacity(rounds);
    for _ in 0..rounds {
        let start = Instant::now();
        link.send(msg.clone()).unwrap();
        link.recv().unwrap();
        times.push(start.elapsed());
    }
    link.closer().unwrap().close();
    echo.join().unwrap();
    times
}

fn median(times: &mut [Duration]) -> Duration {
    times.sort();
    times[times.len() / 2]
}
