//! `baton tp-member`: one member (rank 1..) of a tensor-parallel group across
//! processes. It loads its slice of every layer from its own copy of the model, links
//! with the other members, and computes what member 0 (`baton run|bench|serve --tp N
//! --tp-members ...`) sends it.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context as _;
use baton_model::{ModelFile, Stage, StageConfig, StageSpan};
use std::time::Duration;

use baton_net::{Addr, LinkOptions, Listener};
use baton_stage::tp_net::{join_group, serve_member, MemberDoor, MeshCollective};
use clap::Args;

/// Arguments of `baton tp-member`.
#[derive(Args, Debug)]
pub struct TpMemberArgs {
    /// GGUF model file (this machine's copy).
    #[arg(long, short = 'm', default_value = "models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf")]
    model: PathBuf,
    /// This member's rank (1..N; member 0 is the process that runs the model).
    #[arg(long)]
    rank: usize,
    /// Listen addresses of members 1.. in rank order (this one's among them).
    #[arg(long, value_delimiter = ',', required = true)]
    members: Vec<String>,
    /// CPU threads.
    #[arg(long, short = 't', default_value_t = 1)]
    threads: usize,
    /// KV cache cells (as member 0's --ctx-size).
    #[arg(long, short = 'c', default_value_t = crate::ring::TP_MEMBER_CTX)]
    ctx_size: usize,
    /// Sequences with a cache region each (as member 0's; `baton serve` uses --parallel).
    #[arg(long, default_value_t = 0)]
    n_seq: usize,
    /// As member 0's --no-repack.
    #[arg(long)]
    no_repack: bool,
    /// As member 0's --cache-type-k.
    #[arg(long, visible_alias = "ctk", default_value = "f16", value_parser = crate::parse_cache_type)]
    cache_type_k: baton_model::CacheType,
    /// As member 0's --cache-type-v.
    #[arg(long, visible_alias = "ctv", default_value = "f16", value_parser = crate::parse_cache_type)]
    cache_type_v: baton_model::CacheType,
    /// The cluster secret.
    #[command(flatten)]
    token: crate::token::TokenArgs,
    /// TLS on every link.
    #[command(flatten)]
    tls: crate::cert::TlsArgs,
    /// Listen on a non-loopback address without a token (anyone who can connect could
    /// join the group in a member's place).
    #[arg(long)]
    insecure: bool,
    /// Seconds a connecting member may take for its handshake and introduction.
    #[arg(long, default_value_t = 10.0)]
    handshake_timeout: f64,
    /// Most connections in their handshake at once (and authenticated at once).
    #[arg(long, default_value_t = 64)]
    max_connections: usize,
    /// Most connections in their handshake at once from one address.
    #[arg(long, default_value_t = 8)]
    max_handshakes_per_source: usize,
}

/// Runs the member until member 0 shuts it down or goes.
pub fn tp_member(args: TpMemberArgs) -> anyhow::Result<()> {
    let n = args.members.len() + 1;
    anyhow::ensure!(
        (1..n).contains(&args.rank),
        "--rank {} is not one of 1..{n} (--members lists members 1..)",
        args.rank
    );
    let listen = &args.members[args.rank - 1];
    let local = Addr::parse(listen)
        .and_then(|addr| addr.is_local())
        .with_context(|| format!("bad listen address {listen}"))?;
    let token = args.token.load()?;
    if !local && token.is_none() && !args.insecure {
        anyhow::bail!(
            "refusing to listen on {listen} without --token: any machine that can reach it could join the \
             group in a member's place. Set a cluster token (--token-file or BATON_TOKEN), or pass --insecure \
             to accept that."
        );
    }
    anyhow::ensure!(
        args.handshake_timeout.is_finite() && args.handshake_timeout > 0.0 && args.handshake_timeout <= 3600.0,
        "--handshake-timeout must be between 0 and 3600 seconds"
    );
    anyhow::ensure!(args.max_connections >= 1, "--max-connections must be at least 1");
    anyhow::ensure!(
        args.max_handshakes_per_source >= 1,
        "--max-handshakes-per-source must be at least 1"
    );
    let listener = Listener::bind(listen).with_context(|| format!("listening on {listen}"))?;
    println!("listening on {}", listener.local_addr());
    let door = MemberDoor {
        token,
        link: LinkOptions {
            tls: args.tls.load()?,
            ..Default::default()
        },
        handshake_timeout: Duration::from_secs_f64(args.handshake_timeout),
        max_connections: args.max_connections,
        per_source: args.max_handshakes_per_source,
    };
    let (peers, leader) = join_group(args.rank, &args.members, listener, &door)?;
    let file = ModelFile::open(&args.model).with_context(|| format!("loading {}", args.model.display()))?;
    let n_layer = file.hparams().n_layer;
    let span = StageSpan {
        layers: 0..n_layer,
        first: true,
        last: true,
    };
    let split = baton_model::tp_splits(&file, n)?.swap_remove(args.rank);
    let config = StageConfig {
        n_ctx: args.ctx_size,
        n_threads: args.threads,
        repack: !args.no_repack,
        n_seq: args.n_seq,
        kv_types: baton_model::KvTypes {
            k: args.cache_type_k,
            v: args.cache_type_v,
        },
        n_ubatch: baton_model::DEFAULT_UBATCH,
    };
    let collective = Arc::new(MeshCollective::new(args.rank, peers));
    let stage = Stage::load_member(file, span, &config, Some((split, collective)))?;
    serve_member(stage, leader)?;
    Ok(())
}
