//! `baton worker`: serve one stage of a cluster.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context as _;
use baton_net::{Addr, LinkOptions};
use baton_worker::{Worker, WorkerConfig};
use clap::Args;

/// Arguments of `baton worker`.
#[derive(Args, Debug)]
pub struct WorkerArgs {
    /// Address to listen on: HOST:PORT (port 0 picks a free port), or unix:PATH for a
    /// Unix-domain socket that only this machine can reach (a socket file left by a
    /// stopped worker is taken over). The bound address is printed.
    #[arg(long, default_value = "127.0.0.1:7070")]
    listen: String,
    /// Directory of GGUF models (streamed tensors are cached under DIR/.baton).
    #[arg(long)]
    models: PathBuf,
    #[command(flatten)]
    token: crate::token::TokenArgs,
    /// Listen on a non-loopback address without a token (anyone who can connect can use it).
    #[arg(long)]
    insecure: bool,
    /// Compute threads.
    #[arg(long, short = 't')]
    threads: Option<usize>,
    /// Bytes of memory to offer (default: what the machine has available).
    #[arg(long)]
    memory: Option<u64>,
    /// Devices the stage computes on, e.g. Vulkan0 or Vulkan0,CPU (`baton devices`
    /// lists them; default: the first accelerator, else the CPU). Each is offered to the
    /// head with its free memory and measured speed, and the head's plan gives each a
    /// layer range of its own; the hidden state passes from one to the next in memory.
    /// --memory caps what the worker offers in all, each device keeping its share.
    #[arg(long, value_delimiter = ',')]
    device: Vec<String>,
    /// Address other stages reach this worker at (default: the one the head used).
    #[arg(long)]
    advertise: Option<String>,
    /// Largest frame accepted from an authenticated peer, in bytes (before it has
    /// authenticated, 64 KiB).
    #[arg(long, default_value_t = baton_proto::DEFAULT_MAX_FRAME)]
    max_frame: usize,
    /// Seconds a peer may take to complete the handshake (TLS included), however it
    /// spaces its bytes.
    #[arg(long, default_value_t = 10.0)]
    handshake_timeout: f64,
    /// Most authenticated connections served at once (heads, ring links, heartbeats):
    /// one more is told "too many connections". Also the most connections in their
    /// handshake at once.
    #[arg(long, default_value_t = 64)]
    max_connections: usize,
    /// Most connections in their handshake at once from one IPv4 address (or IPv6 /64).
    /// A connection over a limit may take the slot of the oldest handshake by sending
    /// its Hello within half a second; otherwise it is closed.
    #[arg(long, default_value_t = 8)]
    max_handshakes_per_source: usize,
    /// Kernel socket buffer sizes in bytes (SO_SNDBUF and SO_RCVBUF).
    #[arg(long)]
    socket_buffer: Option<usize>,
    #[command(flatten)]
    tls: crate::cert::TlsArgs,
    /// Exit when standard input closes (how `--local-workers` ties workers to the head),
    /// removing a Unix socket and, if then empty, its directory (the head's own).
    #[arg(long, hide = true)]
    exit_on_stdin_close: bool,
}

/// Runs the worker until killed.
pub fn worker(args: WorkerArgs) -> anyhow::Result<()> {
    let local = Addr::parse(&args.listen)
        .and_then(|addr| addr.is_local())
        .with_context(|| format!("bad --listen address {}", args.listen))?;
    let token = args.token.load()?;
    if !local && token.is_none() && !args.insecure {
        anyhow::bail!(
            "refusing to listen on {} without --token: any machine that can reach it could drive this \
             worker. Set a cluster token (--token-file or BATON_TOKEN), or pass --insecure to accept that.",
            args.listen
        );
    }
    anyhow::ensure!(
        args.handshake_timeout.is_finite() && args.handshake_timeout > 0.0 && args.handshake_timeout <= 3600.0,
        "--handshake-timeout must be between 0 and 3600 seconds"
    );
    anyhow::ensure!(
        args.max_connections >= 4,
        "--max-connections must be at least 4 (a head, its heartbeat, a ring link and a spare)"
    );
    anyhow::ensure!(
        args.max_handshakes_per_source >= 1,
        "--max-handshakes-per-source must be at least 1"
    );
    anyhow::ensure!(
        args.max_frame >= 1 << 20,
        "--max-frame must be at least 1 MiB (a prompt chunk's hidden states must fit)"
    );
    let tls = args.tls.load()?;
    let threads = args
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let devices = crate::ring::node_devices(&args.device)?;
    let config = WorkerConfig {
        listen: args.listen.clone(),
        models: args.models,
        token,
        threads,
        memory: args.memory,
        advertise: args.advertise,
        link: LinkOptions {
            max_frame: args.max_frame,
            send_buffer: args.socket_buffer,
            recv_buffer: args.socket_buffer,
            read_timeout: None,
            tls,
        },
        handshake_timeout: Duration::from_secs_f64(args.handshake_timeout),
        max_connections: args.max_connections,
        max_handshakes_per_source: args.max_handshakes_per_source,
        devices,
    };
    let worker = Worker::bind(config)?;
    if args.exit_on_stdin_close {
        let socket = match Addr::parse(worker.local_addr()) {
            Ok(Addr::Unix(path)) => Some(path),
            _ => None,
        };
        std::thread::spawn(move || {
            let _ = std::io::copy(&mut std::io::stdin(), &mut std::io::sink());
            // The head is gone, maybe killed before it could clean up: its workers'
            // sockets live in a directory of its own, which the last worker out removes
            // (`remove_dir` only removes an empty one).
            if let Some(path) = socket {
                let _ = std::fs::remove_file(&path);
                if let Some(dir) = path.parent() {
                    let _ = std::fs::remove_dir(dir);
                }
            }
            std::process::exit(0);
        });
    }
    // The first line on stdout is the bound address: `--local-workers` and tests read it.
    println!("listening on {}", worker.local_addr());
    worker.serve();
    Ok(())
}
