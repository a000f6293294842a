//! Where a command's stages run: in this process, on given workers, or on local worker
//! processes started for the occasion.

use std::path::Path;
use std::sync::Arc;

use anyhow::Context as _;
use baton_cluster::{connect_cluster, ClusterOptions, ContextFit, Members, RemoteRing, Supervisor, CONTEXT_STEP};
use baton_engine::{Engine, EngineConfig};
use baton_engine::{Head, LocalRing};
use baton_model::{ModelFile, StageConfig};
use baton_net::discovery::Browser;
use baton_net::LinkOptions;
use clap::{Args, ValueEnum};

use crate::cert::TlsArgs;
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
    /// Run the stages on these workers instead of in this process: HOST:PORT for TCP,
    /// unix:PATH for a worker's Unix-domain socket on this machine (comma-separated).
    #[arg(long, value_delimiter = ',')]
    pub workers: Vec<String>,
    /// Start N local worker processes and run the stages there (they listen on Unix
    /// sockets in a private temporary directory).
    #[arg(long)]
    pub local_workers: Option<usize>,
    /// The cluster secret for --workers.
    #[command(flatten)]
    pub token: crate::token::TokenArgs,
    /// Element type of hidden states on the wire between workers.
    #[arg(long, value_enum, default_value_t = WireDtype::F32)]
    pub wire_dtype: WireDtype,
    /// Keep every layer on the workers (by default the head runs the first stage
    /// itself when it has the memory and the planner finds that faster).
    #[arg(long)]
    pub no_head_stage: bool,
    /// Bytes of memory this process offers its stages: its own stage beside workers, or
    /// every in-process stage (default: what is available). The default context is
    /// the most that fits in it.
    #[arg(long)]
    pub head_memory: Option<u64>,
    /// TLS on every link (with --local-workers, the workers get the same files).
    #[command(flatten)]
    pub tls: TlsArgs,
    /// Seconds without an answer to the head's heartbeat after which a worker is lost
    /// (`baton serve` then forms a new ring over the workers that remain).
    #[arg(long, default_value_t = 2.0, value_parser = heartbeat_secs)]
    pub heartbeat_timeout: f64,
    /// Seconds a worker may take to answer the handshake and describe itself.
    #[arg(long, default_value_t = 10.0, value_parser = positive_secs)]
    pub handshake_timeout: f64,
    /// Members 1.. of the tensor-parallel group (`baton tp-member` processes, in rank
    /// order); this process is member 0. The group runs the whole model as one stage;
    /// --tp must be one more than the number of addresses. (With --workers, the head
    /// forms groups of workers itself: give --tp N or auto instead.)
    #[arg(long, value_delimiter = ',')]
    pub tp_members: Vec<String>,
    /// Find the workers on the local network (mDNS): those started with `baton worker
    /// --announce` and the same token. With `baton serve`, a worker that announces itself
    /// later joins the running cluster (running requests move to the new ring with
    /// their text unchanged).
    #[arg(long)]
    pub discover: bool,
    /// Seconds --discover looks for workers before the first ring is formed (longer
    /// while none has answered).
    #[arg(long, default_value_t = 3.0, value_parser = positive_secs)]
    pub discover_wait: f64,
}

fn positive_secs(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(secs) if secs.is_finite() && secs > 0.0 && secs <= 86_400.0 => Ok(secs),
        _ => Err(format!("'{s}' is not a number of seconds between 0 and 86400")),
    }
}

/// A heartbeat timeout: at most what a worker accepts (`MAX_HEARTBEAT_MS`).
fn heartbeat_secs(s: &str) -> Result<f64, String> {
    let most = f64::from(baton_proto::MAX_HEARTBEAT_MS) / 1000.0;
    match s.parse::<f64>() {
        Ok(secs) if secs.is_finite() && secs > 0.0 && secs <= most => Ok(secs),
        _ => Err(format!("'{s}' is not a number of seconds between 0 and {most}")),
    }
}

/// Looks for the cluster's workers on the local network for `wait` seconds, and then
/// until one answers; the browser keeps adding those that announce themselves later.
fn discover(members: &Members, token: Option<&str>, wait: f64) -> anyhow::Result<Browser> {
    let token = token.context(
        "--discover needs the cluster token (--token-file or BATON_TOKEN): workers announce the \
         cluster by an id derived from it",
    )?;
    let cluster = baton_proto::auth::cluster_id(token.as_bytes());
    let joining = members.clone();
    let browser = Browser::start(
        &cluster,
        Box::new(move |addr: &str| {
            joining.join(addr);
        }),
    )?;
    eprintln!("looking for workers on the local network ({wait} s)");
    std::thread::sleep(std::time::Duration::from_secs_f64(wait));
    let mut waited = std::time::Instant::now();
    while members.addrs().is_empty() {
        if waited.elapsed() >= std::time::Duration::from_secs(10) {
            eprintln!("no worker of this cluster has announced itself yet (baton worker --announce, same token)");
            waited = std::time::Instant::now();
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    eprintln!(
        "found {} worker(s): {}",
        members.addrs().len(),
        members.addrs().join(", ")
    );
    Ok(browser)
}

/// A running ring of one of the three kinds.
pub enum Ring {
    /// Stages on threads of this process, each with a KV cache of `n_ctx` cells.
    Local { ring: LocalRing, n_ctx: usize },
    /// Stages on workers; the local worker processes, if we started them, die with it.
    Remote {
        /// The ring through the workers.
        ring: Box<RemoteRing>,
        /// Worker processes this command started (dropped after the ring).
        _local: Option<LocalWorkers>,
    },
    /// Stages on workers, formed (and formed again when one is lost) by a supervisor
    /// that the engine takes over.
    Supervised {
        /// Moves into the engine.
        supervisor: Option<Box<Supervisor>>,
        /// Worker processes this command started (they outlive the engine).
        _local: Option<LocalWorkers>,
        /// Finds workers that join (`--discover`).
        _browser: Option<Browser>,
        /// The cluster's members (shared with the supervisor: adding one joins it).
        members: Members,
        /// The cluster token, given to workers that join with an invite.
        token: Option<String>,
    },
}

/// What forming a remote ring needs, or the in-process ring when no workers are given.
enum Setup {
    Local {
        ring: LocalRing,
        n_ctx: usize,
    },
    Remote {
        members: Members,
        opts: Box<ClusterOptions>,
        local: Option<LocalWorkers>,
        browser: Option<Browser>,
    },
}

impl Ring {
    /// Starts the stages the arguments ask for.
    /// `n_seq > 0` gives each of that many sequences its own region of every stage's
    /// KV cache (see `baton_model::KvCache::new`).
    pub fn start(model: &Path, stages: &StageArgs, cluster: &ClusterArgs, n_seq: usize) -> anyhow::Result<Ring> {
        let file = ModelFile::open(model).with_context(|| format!("loading {}", model.display()))?;
        match Ring::setup(model, file, stages, cluster, n_seq)? {
            Setup::Local { ring, n_ctx } => Ok(Ring::Local { ring, n_ctx }),
            Setup::Remote {
                members, opts, local, ..
            } => {
                let remote = connect_cluster(model, &members.addrs(), &opts)?;
                Ok(Ring::Remote {
                    ring: Box::new(remote),
                    _local: local,
                })
            }
        }
    }

    /// Like [`start`](Self::start), but a remote ring is formed by a [`Supervisor`],
    /// for an engine that forms it again when a worker is lost; `file` is the model at
    /// `model`, opened by the caller (the first ring is formed from it).
    pub fn start_supervised(
        model: &Path,
        file: Arc<ModelFile>,
        stages: &StageArgs,
        cluster: &ClusterArgs,
        n_seq: usize,
    ) -> anyhow::Result<Ring> {
        match Ring::setup(model, file, stages, cluster, n_seq)? {
            Setup::Local { ring, n_ctx } => Ok(Ring::Local { ring, n_ctx }),
            Setup::Remote {
                members,
                opts,
                local,
                browser,
            } => {
                let heartbeat = std::time::Duration::from_secs_f64(cluster.heartbeat_timeout);
                let token = opts.token.clone();
                let supervisor = Box::new(Supervisor::new(model, members.clone(), *opts, heartbeat));
                Ok(Ring::Supervised {
                    supervisor: Some(supervisor),
                    _local: local,
                    _browser: browser,
                    members,
                    token,
                })
            }
        }
    }

    /// Hands the ring to an engine (a supervised ring is formed now). `draft_model`
    /// makes the draft model, if any, for the tokens each slot holds: a supervised
    /// ring's are known only once it has formed.
    pub fn engine(
        &mut self,
        vocab: Arc<dyn baton_engine::Vocab>,
        config: EngineConfig,
        draft_model: impl FnOnce(usize) -> anyhow::Result<Option<Box<dyn baton_engine::Drafter>>> + 'static,
    ) -> anyhow::Result<Engine> {
        match self {
            Ring::Supervised { supervisor, .. } => {
                let supervisor = supervisor.take().context("a supervised ring goes to one engine")?;
                let draft: baton_engine::DraftFor =
                    Box::new(move |slot_ctx| draft_model(slot_ctx).map_err(|e| format!("{e:#}")));
                Ok(Engine::start_supervised(supervisor, vocab, config, draft)?)
            }
            Ring::Local { ring, .. } => {
                let ends = ring.take_ends().context("the ring is driven by an engine already")?;
                let draft = draft_model(config.slot_ctx)?;
                Ok(Engine::start(ends, vocab, config, draft))
            }
            Ring::Remote { ring, .. } => {
                let ends = ring.take_ends().context("the ring is driven by an engine already")?;
                let draft = draft_model(config.slot_ctx)?;
                Ok(Engine::start(ends, vocab, config, draft))
            }
        }
    }

    fn setup(
        model: &Path,
        file: Arc<ModelFile>,
        stages: &StageArgs,
        cluster: &ClusterArgs,
        n_seq: usize,
    ) -> anyhow::Result<Setup> {
        let n_layer = file.hparams().n_layer;
        // Refused here, before any worker is started or reached.
        stages.kv_types().check(file.hparams())?;
        let context = asked_context(file.hparams(), stages, n_seq);
        let head_stage = !cluster.no_head_stage;
        // Bad certificate files fail here, before any worker is started or reached.
        let tls = cluster.tls.load()?;
        let with_workers = cluster.local_workers.is_some() || !cluster.workers.is_empty() || cluster.discover;
        anyhow::ensure!(
            with_workers || stages.tp != baton_plan::TpDegree::Auto,
            "--tp auto chooses groups of workers (--workers or --local-workers); in one process give --tp N"
        );
        anyhow::ensure!(
            cluster.tp_members.is_empty() || !with_workers,
            "--tp-members makes this process member 0 of a group of `baton tp-member` processes; with \
             --workers or --local-workers the head forms groups of workers itself (give --tp N)"
        );
        if let baton_plan::TpDegree::Fixed(n) = stages.tp {
            let offered = cluster.local_workers.unwrap_or(cluster.workers.len());
            anyhow::ensure!(
                !with_workers || cluster.discover || offered >= n,
                "--tp {n} needs at least {n} workers to form one group; {offered} given"
            );
        }
        // Groups of workers are the stages: the head runs none of its own.
        let head_stage = head_stage && !(with_workers && stages.tp_wanted());
        if stages.tp_size() > 1 {
            let devices = baton_ggml::Device::parse_list(&stages.device)?;
            if let Some(device) = devices.iter().find(|d| !d.is_cpu()) {
                anyhow::bail!(
                    "--tp {} with --device {device:?}: tensor-parallel members run on the CPU only",
                    stages.tp_size()
                );
            }
        }
        if !cluster.tp_members.is_empty() {
            // The members are told their context on their own command line (4096 by
            // default), so member 0 keeps to that unless --ctx-size says otherwise.
            let context = (stages.ctx_size.unwrap_or(TP_MEMBER_CTX), ContextFit::Exact);
            let n_ctx = local_context(&file, context, stages, cluster, n_seq)?;
            let ring = tp_over_links(file, stages, cluster, n_seq, n_ctx)?;
            return Ok(Setup::Local { ring, n_ctx });
        }
        let (workers, token, local, threads) = match cluster.local_workers {
            Some(n) => {
                // Head and workers share this machine's cores.
                let threads = stages.threads_for(n + usize::from(head_stage));
                let local = LocalWorkers::start(n, model, threads, &cluster.tls)?;
                (local.addrs.clone(), Some(local.token.clone()), Some(local), threads)
            }
            None if !cluster.workers.is_empty() || cluster.discover => (
                cluster.workers.clone(),
                cluster.token.load()?,
                None,
                stages.threads_for(1),
            ),
            None => {
                let n_ctx = local_context(&file, context, stages, cluster, n_seq)?;
                let config = StageConfig {
                    n_ctx,
                    n_threads: stages.threads(),
                    repack: !stages.no_repack,
                    n_seq,
                    kv_types: stages.kv_types(),
                    n_ubatch: baton_model::DEFAULT_UBATCH,
                };
                let ranges = stages.ranges(n_layer)?;
                if stages.tp_size() > 1 {
                    // Members run on the CPU (checked above), whatever devices there are.
                    let ring = LocalRing::start_tp(file, &ranges, &config, stages.tp_size())?;
                    return Ok(Setup::Local { ring, n_ctx });
                }
                let devices = stages.stage_devices(ranges.len())?;
                let on: Vec<_> = ranges.into_iter().zip(devices).collect();
                let ring = LocalRing::start_on(file, &on, &config)?;
                return Ok(Setup::Local { ring, n_ctx });
            }
        };
        let members = Members::new(&workers);
        let browser = match cluster.discover {
            true => Some(discover(&members, token.as_deref(), cluster.discover_wait)?),
            false => None,
        };
        let split = stages.split.as_deref().map(baton_plan::parse_node_split).transpose()?;
        let opts = ClusterOptions {
            token,
            split,
            n_ctx: context.0,
            ctx_fit: context.1,
            n_seq,
            kv_types: stages.kv_types(),
            wire_f16: cluster.wire_dtype == WireDtype::F16,
            repack: !stages.no_repack,
            link: LinkOptions {
                tls,
                ..Default::default()
            },
            head_stage,
            threads,
            head_memory: cluster.head_memory,
            head_devices: node_devices(&stages.device)?,
            head_secs_per_layer: Vec::new(),
            // A worker found on the network may be anyone's: one that refuses is left
            // out. Given addresses must all answer.
            skip_unreachable: cluster.discover,
            handshake_timeout: Some(std::time::Duration::from_secs_f64(cluster.handshake_timeout)),
            on_reached: None,
            tp: stages.tp,
            opened: Some(file),
        };
        Ok(Setup::Remote {
            members,
            opts: Box::new(opts),
            local,
            browser,
        })
    }

    /// The members of a supervised ring of workers and their token: what a worker that
    /// joins with an invite is added to and given.
    pub fn joinable(&self) -> Option<(Members, String)> {
        match self {
            Ring::Supervised {
                members,
                token: Some(token),
                ..
            } => Some((members.clone(), token.clone())),
            _ => None,
        }
    }

    /// The head end, while no engine drives the ring.
    /// (See [`tp_over_links`] for `--tp-members`.)
    pub fn head(&mut self) -> anyhow::Result<&mut Head> {
        let head = match self {
            Ring::Local { ring, .. } => ring.head(),
            Ring::Remote { ring, .. } => ring.head(),
            Ring::Supervised { .. } => None,
        };
        head.context("the ring is driven by an engine")
    }

    /// Why the layers are split as they are (`None` for in-process stages).
    pub fn plan_why(&self) -> Option<&str> {
        match self {
            Ring::Remote { ring, .. } => Some(&ring.plan.why),
            Ring::Local { .. } | Ring::Supervised { .. } => None,
        }
    }

    /// Each stage's node, layers and devices, for people (`None` for in-process
    /// stages).
    pub fn describe_stages(&self) -> Option<Vec<String>> {
        match self {
            Ring::Remote { ring, .. } => Some(ring.describe_stages()),
            Ring::Local { .. } | Ring::Supervised { .. } => None,
        }
    }

    /// KV cells of every stage, when known before an engine forms the ring (a
    /// supervised ring's is known once formed: see `Engine::slot_ctx`).
    pub fn n_ctx(&self) -> Option<usize> {
        match self {
            Ring::Local { n_ctx, .. } => Some(*n_ctx),
            Ring::Remote { ring, .. } => Some(ring.n_ctx),
            Ring::Supervised { .. } => None,
        }
    }

    /// The layer range of each stage, in ring order.
    pub fn ranges(&self) -> Vec<std::ops::Range<usize>> {
        match self {
            Ring::Local { ring, .. } => ring.ranges().to_vec(),
            Ring::Remote { ring, .. } => ring.plan.stages.iter().map(|s| s.layers.clone()).collect(),
            Ring::Supervised { .. } => Vec::new(),
        }
    }
}

/// This process as member 0 of a tensor-parallel group whose other members are the
/// `baton tp-member` processes at `--tp-members`: one stage (the whole model), in a ring
/// of this process.
fn tp_over_links(
    file: Arc<ModelFile>,
    stages: &StageArgs,
    cluster: &ClusterArgs,
    n_seq: usize,
    n_ctx: usize,
) -> anyhow::Result<LocalRing> {
    use baton_model::{GroupMember, Stage, StageGroup, StageSpan};
    use baton_stage::tp_net::{dial_members, MeshCollective, RemoteMember};
    let n = cluster.tp_members.len() + 1;
    anyhow::ensure!(
        stages.tp == baton_plan::TpDegree::Fixed(n),
        "--tp {:?} with {} --tp-members: the group is this process and its members",
        stages.tp,
        n - 1
    );
    let n_layer = file.hparams().n_layer;
    let ranges = stages.ranges(n_layer)?;
    anyhow::ensure!(
        ranges.len() == 1,
        "a tensor-parallel group across processes runs the whole model as one stage (--stages 1)"
    );
    let span = StageSpan {
        layers: 0..n_layer,
        first: true,
        last: true,
    };
    let split = baton_model::tp_splits(&file, n)?.swap_remove(0);
    let token = cluster.token.load()?;
    let opts = LinkOptions {
        tls: cluster.tls.load()?,
        ..Default::default()
    };
    let peers = dial_members(&cluster.tp_members, token.as_deref().map(str::as_bytes), &opts)?;
    let collective = std::sync::Arc::new(MeshCollective::new(0, peers.clone()));
    let config = StageConfig {
        n_ctx,
        n_threads: stages.threads_for(1),
        repack: !stages.no_repack,
        n_seq,
        kv_types: stages.kv_types(),
        n_ubatch: baton_model::DEFAULT_UBATCH,
    };
    let members: Vec<Box<dyn GroupMember>> = peers
        .into_iter()
        .map(|p| Box::new(RemoteMember::new(p)) as Box<dyn GroupMember>)
        .collect();
    let member0 = Stage::load_member(file, span, &config, Some((split, collective)))?;
    Ok(LocalRing::from_stages(
        vec![StageGroup::new(member0, members)],
        &ranges,
    )?)
}

/// `baton tp-member`'s default --ctx-size, which member 0 of such a group keeps to.
pub const TP_MEMBER_CTX: usize = 4096;

/// The KV cells every stage is asked for, and whether that is what it gets or the most:
/// `--ctx-size`, exactly; by default the model's trained context for each of `n_seq`
/// sequences (one when 0), or what memory holds.
fn asked_context(hp: &baton_model::HParams, stages: &StageArgs, n_seq: usize) -> (usize, ContextFit) {
    match stages.ctx_size {
        Some(n_ctx) => (n_ctx, ContextFit::Exact),
        None => (hp.n_ctx_train.max(1).saturating_mul(n_seq.max(1)), ContextFit::Fit),
    }
}

/// The KV cells of stages in this process (or of a tensor-parallel group led from it):
/// `(n_ctx, fit)` as [`asked_context`] gives them, against the memory this machine
/// offers (`--head-memory`, else what is available): weights and KV cache of every
/// layer must fit. An exact context that does not fit, or a fitted one of which not
/// even 256 cells per sequence fit, is refused with the numbers.
fn local_context(
    file: &ModelFile,
    (n_ctx, fit): (usize, ContextFit),
    stages: &StageArgs,
    cluster: &ClusterArgs,
    n_seq: usize,
) -> anyhow::Result<usize> {
    let hp = file.hparams();
    let offered = cluster.head_memory.unwrap_or_else(baton_stage::available_memory);
    let types = stages.kv_types();
    let need = |n: usize| baton_cluster::model_cost(file, n, n_seq, types).stage_bytes(&(0..hp.n_layer));
    let step = CONTEXT_STEP * n_seq.max(1);
    let tried = match fit {
        ContextFit::Exact if need(n_ctx) <= offered => return Ok(n_ctx),
        ContextFit::Exact => n_ctx,
        ContextFit::Fit => match baton_plan::largest_context(n_ctx, step, |n| need(n) <= offered) {
            Some(n) => {
                if n < n_ctx {
                    tracing::info!(n_ctx = n, most = n_ctx, "memory holds a KV cache of {n} cells");
                }
                return Ok(n);
            }
            None => step.min(n_ctx),
        },
    };
    let mib = |bytes: u64| bytes as f64 / f64::from(1 << 20);
    let kv = need(tried) - need(0);
    anyhow::bail!(
        "a context of {tried} tokens{} needs {:.0} MiB of KV cache ({}/{}), {:.0} MiB with the weights, but this \
         machine offers {:.0} MiB ({}); lower --ctx-size{}, or quantize the cache (--cache-type-k/-v q8_0)",
        if n_seq > 1 {
            format!(" ({} per sequence for --parallel {n_seq})", tried / n_seq)
        } else {
            String::new()
        },
        mib(kv),
        types.k,
        types.v,
        mib(need(tried)),
        mib(offered),
        if cluster.head_memory.is_some() {
            "--head-memory"
        } else {
            "its available memory"
        },
        if n_seq > 1 { " or --parallel" } else { "" },
    )
}

/// The devices of a worker's stage, or of the head's own beside workers: `--device`,
/// or the first accelerator (else the CPU).
pub fn node_devices(given: &[String]) -> anyhow::Result<Vec<baton_ggml::Device>> {
    let devices = match given.is_empty() {
        true => vec![baton_ggml::Device::preferred()],
        false => baton_ggml::Device::parse_list(given)?,
    };
    check_device_list(&devices)?;
    Ok(devices)
}

/// Refuses a device list that names an accelerator twice (ggml computes one stage per
/// device and process); the CPU may be named more than once, each a stage of its own.
fn check_device_list(devices: &[baton_ggml::Device]) -> anyhow::Result<()> {
    for (i, device) in devices.iter().enumerate() {
        anyhow::ensure!(
            device.is_cpu() || !devices[..i].contains(device),
            "--device names {device:?} twice (a device other than the CPU computes one stage per process)"
        );
    }
    Ok(())
}
