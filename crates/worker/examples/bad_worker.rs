//! A worker that lies (for `bench/attack`): it passes the handshake with the cluster
//! token (from `BATON_TOKEN`), describes itself as holding the head's model, "loads"
//! every layer without loading anything, and answers every step of the ring with a
//! token id outside the vocabulary. A head must fail the request with an error, not
//! abort.
//!
//! `cargo run --release -p baton-worker --example bad_worker -- --listen 127.0.0.1:0 [--token-id N]`
//!
//! Prints `listening on ADDR` first.

use baton_net::{server_handshake, Link, LinkOptions, Listener};
use baton_proto::{Capabilities, DeviceCaps, HeldModel, Message, Role, SampledToken};

fn main() {
    let mut listen = "127.0.0.1:0".to_string();
    let mut bad_id: u32 = 4_000_000_000;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--listen" => listen = args.next().expect("--listen ADDR"),
            "--token-id" => bad_id = args.next().and_then(|v| v.parse().ok()).expect("--token-id N"),
            other => panic!("unknown argument {other}"),
        }
    }
    let token = std::env::var("BATON_TOKEN").ok();
    let listener = Listener::bind(&listen).expect("bind");
    let addr = listener.local_addr().to_string();
    println!("listening on {addr}");
    while let Ok(incoming) = listener.accept() {
        let (token, addr) = (token.clone(), addr.clone());
        std::thread::spawn(move || {
            let mut link = match incoming.into_link(&LinkOptions::default()) {
                Ok(link) => link,
                Err(e) => return eprintln!("dropping a connection: {e}"),
            };
            let role = match server_handshake(link.as_mut(), token.as_deref().map(str::as_bytes)) {
                Ok(role) => role,
                Err(e) => return eprintln!("dropping a connection: {e}"),
            };
            match role {
                Role::Head => head(link.as_mut(), &addr, bad_id),
                Role::Heartbeat => {
                    while let Ok(Message::Ping { .. }) = link.recv() {
                        if link.send(Message::Pong).is_err() {
                            break;
                        }
                    }
                }
                _ => {}
            }
        });
    }
}

/// Plays a whole ring (first and last stage) for one head, lying about every token.
fn head(link: &mut dyn Link, addr: &str, bad_id: u32) {
    loop {
        let msg = match link.recv() {
            Ok(msg) => msg,
            Err(e) => return eprintln!("the head's connection ended: {e}"),
        };
        let reply = match msg {
            Message::Describe { model } => Message::Capabilities(Capabilities {
                devices: vec![DeviceCaps::cpu(1 << 40, Some(1e-4))],
                threads: 1,
                models: vec![HeldModel {
                    file_name: model.file_name,
                    identity: model.identity,
                    size: model.size,
                    complete: true,
                    content: None,
                }],
                ring_addr: addr.to_string(),
                session: 1,
            }),
            Message::LoadPlan(_) => Message::Loaded {
                resident: 0,
                received: 0,
            },
            Message::StartSeq(_)
            | Message::TruncateSeq { .. }
            | Message::Checkpoint { .. }
            | Message::EndSeq { .. } => Message::Done,
            Message::Forward(forward) => Message::Sampled {
                step: forward.step,
                tokens: forward
                    .sample_rows
                    .iter()
                    .map(|&row| SampledToken {
                        seq: forward.seq_ids[row as usize],
                        token: bad_id,
                        logprob: f32::NAN,
                        top: Vec::new(),
                    })
                    .collect(),
            },
            Message::Stats(mut stats) => {
                stats.resident.push(0);
                stats.kv_used.push(0);
                stats.busy_us.push(0);
                stats.rows.push(0);
                stats.link_sent.push(0);
                stats.link_rtt_us.push(0);
                Message::Stats(stats)
            }
            Message::Shutdown => {
                let _ = link.send(Message::Shutdown);
                return;
            }
            other => Message::Error {
                first_layer: 0,
                fault: baton_proto::Fault::Protocol,
                message: format!("{} is not expected", other.kind()),
            },
        };
        if link.send(reply).is_err() {
            return;
        }
    }
}
