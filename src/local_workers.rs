//! `--local-workers N`: N `baton worker` child processes on this machine, listening on
//! Unix-domain sockets in a private directory (mode 0700, removed when the head exits),
//! with a random token (and the head's cluster certificate, with TLS), stopped when the
//! head exits. The workers advertise their sockets, so the hops between them stay on
//! Unix sockets too.

use std::io::{BufRead, BufReader};
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use anyhow::{bail, Context as _};

use crate::cert::TlsArgs;

/// Running child workers; killed on drop.
pub struct LocalWorkers {
    children: Vec<Child>,
    // Each worker exits when its stdin closes: if this process dies, even by SIGKILL,
    // the kernel closes these and the workers follow.
    _lifelines: Vec<std::process::ChildStdin>,
    /// Their addresses (`unix:` sockets), in start order.
    pub addrs: Vec<String>,
    /// The token they require.
    pub token: String,
    /// Where their sockets are; dropped (removed) after the workers are stopped.
    _sockets: SocketDir,
}

/// A directory only this user can enter, removed with everything in it on drop.
struct SocketDir(PathBuf);

impl SocketDir {
    /// A fresh directory under the system's temporary directory.
    fn create() -> anyhow::Result<SocketDir> {
        let base = std::env::temp_dir();
        for _ in 0..8 {
            let name = format!(
                "baton-{}-{}",
                std::process::id(),
                baton_proto::auth::hex(&baton_proto::auth::new_nonce()[..6])
            );
            let dir = base.join(name);
            // `create` (not `create_all`) fails if the name is taken: the directory is
            // ours alone from the moment it exists.
            match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
                Ok(()) => return Ok(SocketDir(dir)),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(e).with_context(|| format!("cannot create {}", dir.display())),
            }
        }
        bail!("cannot find a free directory name under {}", base.display())
    }
}

impl Drop for SocketDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
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
        let sockets = SocketDir::create()?;
        let mut workers = LocalWorkers {
            children: Vec::new(),
            _lifelines: Vec::new(),
            addrs: Vec::new(),
            token,
            _sockets: sockets,
        };
        for i in 0..n {
            let listen = format!("unix:{}", workers._sockets.0.join(format!("w{i}.sock")).display());
            let mut child = Command::new(&exe)
                .args([
                    "worker",
                    "--listen",
                    &listen,
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

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt as _;

    use super::*;

    #[test]
    fn socket_dirs_are_private_fresh_and_removed_with_their_contents() {
        let (a, b) = (SocketDir::create().unwrap(), SocketDir::create().unwrap());
        assert_ne!(a.0, b.0);
        let mode = std::fs::metadata(&a.0).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o700, "mode {mode:o}");
        std::fs::write(a.0.join("w0.sock"), "").unwrap();
        let path = a.0.clone();
        drop(a);
        assert!(!path.exists());
    }
}
