//! `baton serve` child processes for the end-to-end tests: a head with 2 local
//! workers, plain HTTP/1.0 requests, SSE streams.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::Duration;

use serde_json::Value;

use super::{model, QWEN2};

pub const KEY: &str = "test-api-key";

/// One server at a time: they share two cores, and counters are read per server.
static SERIAL: Mutex<()> = Mutex::new(());

/// A `baton serve --local-workers 2` process; killed on drop (its workers follow).
pub struct Server {
    child: Child,
    pub addr: String,
}

impl Server {
    pub fn start(extra: &[&str]) -> Server {
        let mut args = vec!["--api-key", KEY];
        args.extend_from_slice(extra);
        Server::start_keyless(&args)
    }

    /// A server without `--api-key` (only loopback names and its own page's origin).
    pub fn start_keyless(extra: &[&str]) -> Server {
        let mut child = Command::new(env!("CARGO_BIN_EXE_baton"))
            .args([
                "serve",
                "--local-workers",
                "2",
                "--port",
                "0",
                "--threads",
                "1",
                "--model",
            ])
            .arg(model(QWEN2))
            .args(extra)
            .env_remove("BATON_TOKEN")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("baton serve starts");
        let addr = super::printed_addr(&mut child, "listening on http://");
        Server { child, addr }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn model_id(&self) -> String {
        QWEN2.trim_end_matches(".gguf").to_string()
    }

    /// One request (HTTP/1.0, so the body ends when the server closes).
    pub fn request(&self, method: &str, path: &str, body: Option<&Value>, key: Option<&str>) -> (u16, String) {
        let mut stream = self.send(method, path, body.map(|b| b.to_string()).as_deref(), key);
        let mut response = String::new();
        stream.read_to_string(&mut response).unwrap();
        split_response(&response)
    }

    pub fn send(&self, method: &str, path: &str, body: Option<&str>, key: Option<&str>) -> TcpStream {
        let mut stream = TcpStream::connect(&self.addr).unwrap();
        stream.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
        let body = body.unwrap_or("");
        let auth = key
            .map(|k| format!("Authorization: Bearer {k}\r\n"))
            .unwrap_or_default();
        write!(
            stream,
            "{method} {path} HTTP/1.0\r\nHost: test\r\n{auth}Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        stream
    }

    pub fn post(&self, path: &str, body: &Value) -> Value {
        let (status, text) = self.request("POST", path, Some(body), Some(KEY));
        assert_eq!(status, 200, "{path}: {text}");
        serde_json::from_str(&text).unwrap()
    }

    pub fn stats(&self) -> Value {
        let (status, text) = self.request("GET", "/stats", None, Some(KEY));
        assert_eq!(status, 200, "{text}");
        serde_json::from_str(&text).unwrap()
    }

    /// A streaming request; returns the `data:` payloads in order.
    pub fn stream(&self, path: &str, body: &Value) -> Vec<String> {
        let stream = self.send("POST", path, Some(&body.to_string()), Some(KEY));
        let mut events = Vec::new();
        let mut reader = BufReader::new(stream);
        let mut line = String::new();
        while reader.read_line(&mut line).unwrap() > 0 {
            if let Some(data) = line.trim_end().strip_prefix("data: ") {
                events.push(data.to_string());
            }
            line.clear();
        }
        events
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn split_response(response: &str) -> (u16, String) {
    let status = response.split(' ').nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    let body = response.split_once("\r\n\r\n").map_or("", |(_, b)| b).to_string();
    (status, body)
}

pub fn lock() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}
