//! `baton tp-member`: one member (rank 1..) of a tensor-parallel group across
//! processes. It loads its slice of every layer from its own copy of the model, links
//! with the other members, and computes what member 0 (`baton run|bench|serve --tp N
//! --tp-members ...`) sends it.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context as _;
use baton_model::{ModelFile, Stage, StageConfig, StageSpan};
use baton_net::{LinkOptions, Listener};
use baton_node::tp_net::{join_group, serve_member, MeshCollective};
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
    #[arg(long, short = 'c', default_value_t = 4096)]
    ctx_size: usize,
    /// Sequences with a cache region each (as member 0's; `baton serve` uses --parallel).
    #[arg(long, default_value_t = 0)]
    n_seq: usize,
    /// As member 0's --no-repack.
    #[arg(long)]
    no_repack: bool,
    /// The cluster secret.
    #[command(flatten)]
    token: crate::token::TokenArgs,
    /// TLS on every link.
    #[command(flatten)]
    tls: crate::cert::TlsArgs,
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
    let listener = Listener::bind(listen).with_context(|| format!("listening on {listen}"))?;
    println!("listening on {}", listener.local_addr());
    let token = args.token.load()?;
    let opts = LinkOptions {
        tls: args.tls.load()?,
        ..Default::default()
    };
    let (peers, leader) = join_group(
        args.rank,
        &args.members,
        &listener,
        token.as_deref().map(str::as_bytes),
        &opts,
    )?;
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
    };
    let collective = Arc::new(MeshCollective::new(args.rank, peers));
    let stage = Stage::load_member(file, span, &config, Some((split, collective)))?;
    serve_member(stage, leader)?;
    Ok(())
}
