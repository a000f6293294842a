//! A TCP proxy that delays every byte by a fixed time each way: a link with latency on
//! loopback (this kernel has no `netem`). Each direction is a delay line (what arrives is
//! written `delay` later, in order), so a stream keeps its throughput and a round trip
//! through the proxy takes twice the delay plus what the two ends take.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

/// Forwards connections to a target given after binding (so a worker can advertise the
/// proxy before it starts).
pub struct DelayProxy {
    listener: Option<TcpListener>,
    /// Where to connect to reach the target through the proxy.
    pub addr: String,
    /// Microseconds each way, for bytes read from now on.
    delay: Arc<AtomicU64>,
    /// Bytes forwarded to the target, and back from it, over every connection.
    pub to_target: Arc<AtomicU64>,
    pub from_target: Arc<AtomicU64>,
}

impl DelayProxy {
    /// A proxy on a free loopback port that will delay each direction by `delay`.
    pub fn bind(delay: Duration) -> DelayProxy {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        DelayProxy {
            listener: Some(listener),
            addr,
            delay: Arc::new(AtomicU64::new(delay.as_micros() as u64)),
            to_target: Arc::default(),
            from_target: Arc::default(),
        }
    }

    /// Changes the delay of every connection, for bytes read from now on.
    pub fn set_delay(&self, delay: Duration) {
        self.delay.store(delay.as_micros() as u64, Ordering::Relaxed);
    }

    /// Starts forwarding every connection to `target`.
    pub fn forward_to(&mut self, target: String) {
        let listener = self.listener.take().expect("forwarding starts once");
        let delay = self.delay.clone();
        let (up, down) = (self.to_target.clone(), self.from_target.clone());
        std::thread::spawn(move || {
            for client in listener.incoming().map_while(Result::ok) {
                let Ok(server) = TcpStream::connect(&target) else {
                    continue;
                };
                client.set_nodelay(true).unwrap();
                server.set_nodelay(true).unwrap();
                let (up, down) = (up.clone(), down.clone());
                delay_line(
                    client.try_clone().unwrap(),
                    server.try_clone().unwrap(),
                    delay.clone(),
                    up,
                );
                delay_line(server, client, delay.clone(), down);
            }
        });
    }
}

/// Copies `from` to `to`, each chunk written `delay` (microseconds, as it is when the
/// chunk is read) after it was read, counting the bytes written in `count`; when `from`
/// ends, `to` is shut down once everything read has been written.
fn delay_line(mut from: TcpStream, mut to: TcpStream, delay: Arc<AtomicU64>, count: Arc<AtomicU64>) {
    let (chunks, due) = mpsc::channel::<(Instant, Vec<u8>)>();
    std::thread::spawn(move || {
        let mut buf = vec![0u8; 1 << 16];
        while let Ok(n) = from.read(&mut buf) {
            let due = Instant::now() + Duration::from_micros(delay.load(Ordering::Relaxed));
            if n == 0 || chunks.send((due, buf[..n].to_vec())).is_err() {
                break;
            }
        }
    });
    std::thread::spawn(move || {
        for (at, bytes) in due {
            std::thread::sleep(at.saturating_duration_since(Instant::now()));
            if to.write_all(&bytes).is_err() {
                break;
            }
            count.fetch_add(bytes.len() as u64, Ordering::Relaxed);
        }
        let _ = to.shutdown(Shutdown::Both);
    });
}
