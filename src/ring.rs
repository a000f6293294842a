//! Where a command's stages run: in this process, on given workers, or on local worker
//! processes started for the occasion.

use std::path::Path;

use anyhow::Context as _;
use baton_model::{ModelFile, StageConfig};
use baton_node::cluster::{connect_cluster, ClusterOptions, RemoteRing};
use baton_node::{Head, LocalRing};
use clap::{Args, ValueEnum};

use crate::local_workers::LocalWorkers;
use crate::StageArgs;

/// Element type of hidden states between stages.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum WireDtype {
    /// 4 bytes per value (exact).
    F32,
    /// 2 bytes per value.
    F16,
}

/// Where the stages run.
#[derive(Args, Clone, Debug)]
pub struct ClusterArgs {
    /// Run the stages on these workers (HOST:PORT,...) instead of in this process.
    #[arg(long, value_delimiter = ',')]
    pub workers: Vec<String>,
    /// Start N local worker processes on loopback and run the stages there.
    #[arg(long)]
    pub local_workers: Option<usize>,
    /// Cluster secret for --workers (or the BATON_TOKEN environment variable).
    #[arg(long, env = "BATON_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
    /// Element type of hidden states on the wire between workers.
    #[arg(long, value_enum, default_value_t = WireDtype::F32)]
    pub wire_dtype: WireDtype,
    /// Keep every layer on the workers (by default the head runs the first stage
    /// itself when it has the memory and the planner finds that faster).
    #[arg(long)]
    pub no_head_stage: bool,
    /// Bytes of memory the head offers for its own stage (default: what is available).
    #[arg(long)]
    pub head_memory: Option<u64>,
}

/// A running ring of one of the three kinds.
pub enum Ring {
    /// Stages on threads of this process.
    Local(LocalRing),
    /// Stages on workers; the local worker processes, if we started them, die with it.
    Remote {
        /// The ring through the workers.
        ring: Box<RemoteRing>,
        /// Worker processes this command started (dropped after the ring).
        _local: Option<LocalWorkers>,
    },
}

impl Ring {
    /// Starts the stages the arguments ask for.
    /// `n_seq > 0` gives each of that many sequences its own region of every stage's
    /// KV cache (see `baton_model::KvCache::new`).
    pub fn start(model: &Path, stages: &StageArgs, cluster: &ClusterArgs, n_seq: usize) -> anyhow::Result<Ring> {
        let file = ModelFile::open(model).with_context(|| format!("loading {}", model.display()))?;
        let n_layer = file.hparams().n_layer;
        let head_stage = !cluster.no_head_stage;
        let (workers, token, local, threads) = match cluster.local_workers {
            Some(n) => {
                // Head and workers share this machine's cores.
                let threads = stages.threads_for(n + usize::from(head_stage));
                let local = LocalWorkers::start(n, model, threads)?;
                (local.addrs.clone(), Some(local.token.clone()), Some(local), threads)
            }
            None if !cluster.workers.is_empty() => (
                cluster.workers.clone(),
                cluster.token.clone(),
                None,
                stages.threads_for(1),
            ),
            None => {
                let config = StageConfig {
                    n_ctx: stages.ctx_size,
                    n_threads: stages.threads(),
                    repack: !stages.no_repack,
                    n_seq,
                };
                return Ok(Ring::Local(LocalRing::start(file, &stages.ranges(n_layer)?, &config)?));
            }
        };
        let split = stages.split.as_deref().map(baton_plan::parse_node_split).transpose()?;
        let opts = ClusterOptions {
            token,
            split,
            n_ctx: stages.ctx_size,
            n_seq,
            wire_f16: cluster.wire_dtype == WireDtype::F16,
            repack: !stages.no_repack,
            link: Default::default(),
            head_stage,
            threads,
            head_memory: cluster.head_memory,
        };
        let remote = connect_cluster(model, &workers, &opts)?;
        Ok(Ring::Remote {
            ring: Box::new(remote),
            _local: local,
        })
    }

    /// The head end.
    pub fn head(&mut self) -> &mut Head {
        match self {
            Ring::Local(ring) => &mut ring.head,
            Ring::Remote { ring, .. } => &mut ring.head,
        }
    }

    /// The layer range of each stage, in ring order.
    pub fn ranges(&self) -> Vec<std::ops::Range<usize>> {
        match self {
            Ring::Local(ring) => ring.ranges().to_vec(),
            Ring::Remote { ring, .. } => ring.plan.stages.iter().map(|s| s.layers.clone()).collect(),
        }
    }
}
