//! `--local-workers N`: N `baton worker` child processes on loopback, with a random
//! token (and the head's cluster certificate, with TLS), stopped when the head exits.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};

use anyhow::{bail, Context as _};

use crate::cert::TlsArgs;

/// Running child workers; killed on drop.
pub struct LocalWorkers {
    children: Vec<Child>,
    // Each worker exits when its stdin closes: if this process dies, even by SIGKILL,
    // the kernel closes these and the workers follow.
    _lifelines: Vec<std::process::ChildStdin>,
    /// Their addresses, in start order.
    pub addrs: Vec<String>,
    /// The token they require.
    pub token: String,
}

impl LocalWorkers {
    /// Starts `n` workers serving the directory of `model`, `threads` threads each, with
    /// the head's TLS certificate and key if it has them.
    pub fn start(n: usize, model: &Path, threads: usize, tls: &TlsArgs) -> anyhow::Result<LocalWorkers> {
        let exe = std::env::current_exe().context("cannot find the baton executable")?;
        let dir = model
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        let token = baton_proto::auth::hex(&baton_proto::auth::new_nonce());
        let mut workers = LocalWorkers {
            children: Vec::new(),
            _lifelines: Vec::new(),
            addrs: Vec::new(),
            token,
        };
        for i in 0..n {
            let mut child = Command::new(&exe)
                .args([
                    "worker",
                    "--listen",
                    "127.0.0.1:0",
                    "--exit-on-stdin-close",
                    "--threads",
                    &threads.to_string(),
                    "--models",
                ])
                .arg(dir)
                .args(tls.to_args())
                .env("BATON_TOKEN", &workers.token)
                .stdout(Stdio::piped())
                .stdin(Stdio::piped())
                .spawn()
                .with_context(|| format!("cannot start worker {i}"))?;
            let stdout = child.stdout.take().context("worker stdout")?;
            workers._lifelines.extend(child.stdin.take());
            workers.children.push(child);
            let mut line = String::new();
            BufReader::new(stdout)
                .read_line(&mut line)
                .context("reading the worker's address")?;
            let Some(addr) = line.trim().strip_prefix("listening on ") else {
                bail!("worker {i} did not start (it printed {line:?})");
            };
            workers.addrs.push(addr.to_string());
        }
        Ok(workers)
    }
}

impl Drop for LocalWorkers {
    fn drop(&mut self) {
        for child in &mut self.children {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}
