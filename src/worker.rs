//! `baton worker`: serve one stage of a cluster.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context as _;
use baton_net::discovery::Announcement;
use baton_net::{Addr, LinkOptions, Listener};
use baton_worker::{Worker, WorkerConfig};
use clap::Args;

/// Arguments of `baton worker`.
#[derive(Args, Debug)]
pub struct WorkerArgs {
    /// Address to listen on: HOST:PORT (port 0 picks a free port), or unix:PATH for a
    /// Unix-domain socket that only this machine can reach (a socket file left by a
    /// stopped worker is taken over). The bound address is printed. Default
    /// 127.0.0.1:7070, or 0.0.0.0:7070 with --announce.
    #[arg(long)]
    listen: Option<String>,
    /// Announce this worker on the local network (mDNS/DNS-SD), so that `baton serve
    /// --discover` with the same token finds it: the announcement carries an id derived
    /// from the token, never the token. Needs a token.
    #[arg(long)]
    announce: bool,
    /// Join a cluster with an invite code (`baton invite` on the head prints one; or
    /// the BATON_JOIN variable): the head gives this worker the cluster token (kept in
    /// DIR/.baton/cluster.token for restarts) and plans it in. Default listen
    /// 0.0.0.0:7070 then.
    #[arg(long, env = "BATON_JOIN", hide_env_values = true, value_name = "CODE")]
    join: Option<String>,
    /// Seconds a stopped worker (SIGTERM or Ctrl-C) waits for its head to form a ring
    /// without it before it exits anyway; a second signal exits at once.
    #[arg(long, default_value_t = 30.0)]
    drain_timeout: f64,
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
    let listen = args.listen.clone().unwrap_or_else(|| {
        let host = if args.announce || args.join.is_some() {
            "0.0.0.0"
        } else {
            "127.0.0.1"
        };
        format!("{host}:7070")
    });
    let local = Addr::parse(&listen)
        .and_then(|addr| addr.is_local())
        .with_context(|| format!("bad --listen address {listen}"))?;
    let mut token = args.token.load()?;
    anyhow::ensure!(
        args.join.is_none() || token.is_none(),
        "--join gets the cluster token from the head: give no --token-file, --token or BATON_TOKEN with it"
    );
    anyhow::ensure!(
        !args.announce || token.is_some() || args.join.is_some(),
        "--announce needs the cluster token (--token-file or BATON_TOKEN): the announcement names \
         the cluster by an id derived from it, and a head finds its workers by that id"
    );
    anyhow::ensure!(
        args.drain_timeout.is_finite() && args.drain_timeout >= 0.0 && args.drain_timeout <= 86_400.0,
        "--drain-timeout must be between 0 and 86400 seconds"
    );
    if !local && token.is_none() && args.join.is_none() && !args.insecure {
        anyhow::bail!(
            "refusing to listen on {} without --token: any machine that can reach it could drive this \
             worker. Set a cluster token (--token-file or BATON_TOKEN), or pass --insecure to accept that.",
            listen
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
    let mut tls = args.tls.load()?;
    // Bound before joining: the head is told the port.
    let listener = Listener::bind(&listen)?;
    if let Some(code) = &args.join {
        let joined = crate::invite::join(
            code,
            port_of(listener.local_addr())?,
            args.advertise.as_deref(),
            &args.models,
        )?;
        token = Some(joined.token);
        if let Some((cert, key)) = joined.tls {
            tls = Some(std::sync::Arc::new(baton_net::TlsConfig::from_pem_files(&cert, &key)?));
        }
    }
    let threads = args
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let devices = crate::ring::node_devices(&args.device)?;
    let config = WorkerConfig {
        listen,
        models: args.models,
        token: token.clone(),
        threads,
        memory: args.memory,
        advertise: args.advertise.clone(),
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
    let worker = Worker::on(listener, config)?;
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
    let _announcement = match (args.announce, token.as_deref()) {
        (true, Some(token)) => Some(announce(worker.local_addr(), token, args.advertise.as_deref())?),
        _ => None,
    };
    leave_on_signal(&worker, Duration::from_secs_f64(args.drain_timeout))?;
    // The first line on stdout is the bound address: `--local-workers` and tests read it.
    println!("listening on {}", worker.local_addr());
    worker.serve();
    Ok(())
}

/// Announces the worker bound at `bound` on the local network.
fn announce(bound: &str, token: &str, advertise: Option<&str>) -> anyhow::Result<Announcement> {
    let port = port_of(bound)?;
    let cluster = baton_proto::auth::cluster_id(token.as_bytes());
    let announcement = Announcement::start(&cluster, port, advertise)?;
    tracing::info!(name = announcement.name(), "announced on the local network");
    Ok(announcement)
}

/// The TCP port of a bound address.
fn port_of(bound: &str) -> anyhow::Result<u16> {
    match Addr::parse(bound)? {
        Addr::Tcp(addr) => addr
            .rsplit_once(':')
            .and_then(|(_, port)| port.parse::<u16>().ok())
            .with_context(|| format!("no port in {addr}")),
        _ => anyhow::bail!("--announce and --join need a TCP --listen address: a Unix socket is not on the network"),
    }
}

/// On SIGTERM or SIGINT the worker leaves: it refuses new heads, tells its head (which
/// forms a ring without it and replays what ran here), and exits once the head has let
/// it go, or after `timeout`. A second signal exits at once.
fn leave_on_signal(worker: &Worker, timeout: Duration) -> anyhow::Result<()> {
    use signal_hook::consts::{SIGINT, SIGTERM};
    let mut signals = signal_hook::iterator::Signals::new([SIGTERM, SIGINT]).context("handling SIGTERM")?;
    let leave = worker.leave_handle();
    std::thread::Builder::new().name("signals".into()).spawn(move || {
        if signals.forever().next().is_none() {
            return;
        }
        std::thread::spawn(move || {
            let _ = signals.forever().next();
            tracing::warn!("a second signal: exiting without waiting for the head");
            std::process::exit(1);
        });
        tracing::info!("leaving: refusing new heads and telling the head to form its ring without this worker");
        if leave.drain(timeout) {
            tracing::info!("left the cluster: no head uses this worker");
            std::process::exit(0);
        }
        tracing::warn!(
            "the head still used this worker after {} s: exiting",
            timeout.as_secs_f64()
        );
        std::process::exit(1);
    })?;
    Ok(())
}
