//! What sealing every frame costs (issue 16): the time to seal and open one frame
//! (AES-256-GCM, `baton_proto::auth::FrameSeal`; the copy of the payload that a link
//! does not make is included), and round trips of one frame over loopback without a
//! token (frames as they are) and with one (sealed), interleaved, at the sizes a ring
//! carries. For comparison, HMAC-SHA256 over the same bytes (the design first tried).
//!
//! `cargo run --release -p baton-net --example frame_seal`

use std::time::{Duration, Instant};

use baton_net::{client_handshake, connect, server_handshake, LinkOptions, Listener};
use baton_proto::auth::{frame_keys, new_nonce, Side, TAG_LEN};
use baton_proto::{Forward, Message, Payload, Role};

const TOKEN: &[u8] = b"frame-mac-benchmark-secret";

/// A `Forward` of `rows` hidden states of width `n_embd`, as a middle stage sends it.
fn hidden(n_embd: usize, rows: usize) -> Message {
    Message::Forward(Forward {
        step: 1,
        payload: Payload::Hidden(vec![0.25; n_embd * rows]),
        positions: (0..rows as i32).collect(),
        seq_ids: vec![0; rows],
        sample_rows: vec![],
        row_tokens: vec![],
    })
}

fn main() {
    let sizes: [(&str, Message, usize); 5] = [
        (
            "token id",
            Message::Forward(Forward {
                step: 1,
                payload: Payload::Tokens(vec![42]),
                positions: vec![7],
                seq_ids: vec![0],
                sample_rows: vec![0],
                row_tokens: vec![],
            }),
            20_000,
        ),
        ("qwen2 hidden state (n_embd 896)", hidden(896, 1), 20_000),
        ("70B-class hidden state (n_embd 8192)", hidden(8192, 1), 10_000),
        ("32-token chunk, qwen2", hidden(896, 32), 2_000),
        (
            "tensor chunk (8 MiB)",
            Message::TensorChunk {
                index: 0,
                offset: 0,
                data: vec![7; 8 << 20],
            },
            20,
        ),
    ];

    println!(
        "| frame | bytes | seal + open (median) | HMAC-SHA256 sign + verify | plain round trip | sealed round trip | extra per hop |"
    );
    println!("|---|---|---|---|---|---|---|");
    for (label, msg, rounds) in sizes {
        let mut frame = Vec::new();
        baton_proto::encode(&msg, &mut frame);
        let (head, payload) = frame.split_at(baton_proto::HEADER_LEN);
        let (nonce_c, nonce_s) = (new_nonce(), new_nonce());
        let mut sender = frame_keys(TOKEN, &nonce_c, &nonce_s, Side::Client).send;
        let mut receiver = frame_keys(TOKEN, &nonce_c, &nonce_s, Side::Server).recv;
        let mut mac_times = Vec::with_capacity(rounds);
        for _ in 0..rounds {
            let start = Instant::now();
            let mut sealed = payload.to_vec();
            let tag = sender.seal(head, &mut sealed);
            assert!(receiver.open(head, &mut sealed, &tag));
            mac_times.push(start.elapsed());
        }
        let seal = median(&mut mac_times);
        let mut hmac_times = Vec::with_capacity(rounds);
        for _ in 0..rounds {
            let start = Instant::now();
            let tag = hmac_sha256(head, payload);
            assert_eq!(tag, hmac_sha256(head, payload));
            hmac_times.push(start.elapsed());
        }
        let hmac = median(&mut hmac_times);

        let (mut plain, mut tagged) = (Vec::new(), Vec::new());
        let trips = (rounds / 5).max(10);
        // Alternate short batches so that other load on the machine hits both alike.
        for _ in 0..10 {
            plain.extend(round_trips(None, &msg, trips / 10));
            tagged.extend(round_trips(Some(TOKEN), &msg, trips / 10));
        }
        let (p, t) = (median(&mut plain), median(&mut tagged));
        let extra = t.saturating_sub(p) / 2;
        println!(
            "| {label} | {} + {TAG_LEN} | {seal:.2?} | {hmac:.2?} | {p:.1?} | {t:.1?} | {extra:.2?} |",
            frame.len()
        );
    }
}

/// HMAC-SHA256 under a fixed key over a header and payload, as a per-frame MAC would be.
fn hmac_sha256(head: &[u8], payload: &[u8]) -> [u8; 32] {
    use hmac::{Hmac, Mac};
    let mut mac = <Hmac<sha2::Sha256> as Mac>::new_from_slice(TOKEN).unwrap();
    mac.update(head);
    mac.update(payload);
    mac.finalize().into_bytes().into()
}

/// Sends `msg` and waits for it to come back, `rounds` times, over a link whose
/// handshake had `token` (tagged frames) or not.
fn round_trips(token: Option<&'static [u8]>, msg: &Message, rounds: usize) -> Vec<Duration> {
    let listener = Listener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().to_string();
    let echo = std::thread::spawn(move || {
        let mut link = listener.accept_link(&LinkOptions::default()).unwrap();
        server_handshake(link.as_mut(), token).unwrap();
        while let Ok(msg) = link.recv() {
            if link.send(msg).is_err() {
                break;
            }
        }
    });
    let mut link = connect(&addr, &LinkOptions::default()).unwrap();
    client_handshake(link.as_mut(), Role::Ring, token).unwrap();
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
